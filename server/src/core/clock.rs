//! Wall-clock time as the API shows it: seconds since the epoch, and RFC 3339 UTC.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the epoch of `t` (0 before it).
pub fn epoch_s(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Seconds since the epoch as RFC 3339 UTC (`2026-11-23T13:04:05.123Z`).
pub fn rfc3339(epoch: f64) -> String {
    let secs = epoch.floor() as i64;
    let millis = ((epoch - secs as f64) * 1000.0).floor() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates_are_civil_utc() {
        assert_eq!(rfc3339(0.0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400.5), "2000-02-29T00:00:00.500Z");
        assert_eq!(rfc3339(1_795_438_245.25), "2026-11-23T12:50:45.250Z");
    }
}
