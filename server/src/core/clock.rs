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

/// Nanoseconds since the epoch of an RFC 3339 UTC stamp as [`rfc3339`] writes it
/// (`2026-11-23T13:04:05.123Z`, any number of fraction digits or none); None for another
/// form or a time before the epoch.
pub fn rfc3339_nanos(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    let digits = |from: usize, n: usize| -> Option<i64> {
        let part = s.get(from..from + n)?;
        part.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| part.parse().ok())?
    };
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' {
        return None;
    }
    if b[16] != b':' || *b.last()? != b'Z' {
        return None;
    }
    let (y, m, d) = (digits(0, 4)?, digits(5, 2)?, digits(8, 2)?);
    let (hh, mm, ss) = (digits(11, 2)?, digits(14, 2)?, digits(17, 2)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    let frac = &s[19..s.len() - 1];
    let nanos = match frac.strip_prefix('.') {
        None if frac.is_empty() => 0,
        Some(f) if !f.is_empty() && f.len() <= 9 && f.bytes().all(|c| c.is_ascii_digit()) => {
            f.parse::<i64>().ok()? * 10i64.pow(9 - f.len() as u32)
        }
        _ => return None,
    };
    let secs = days_from_civil(y, m, d) * 86_400 + hh * 3600 + mm * 60 + ss;
    u64::try_from(secs * 1_000_000_000 + nanos).ok()
}

/// Days since 1970-01-01 of the civil (proleptic Gregorian) date `y-m-d`: the inverse of
/// [`rfc3339`]'s date.
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
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

    #[test]
    fn rfc3339_stamps_read_back_to_their_time() {
        for t in [0.0, 951_782_400.5, 1_795_438_245.25, 1_709_164_800.999] {
            let nanos = rfc3339_nanos(&rfc3339(t)).unwrap();
            assert_eq!(nanos / 1_000_000, (t * 1000.0).floor() as u64, "{t}");
        }
        assert_eq!(rfc3339_nanos("1970-01-01T00:00:01Z"), Some(1_000_000_000));
        assert_eq!(rfc3339_nanos("1970-01-01T00:00:00.000000001Z"), Some(1));
        for bad in [
            "",
            "2026-11-23",
            "2026-13-01T00:00:00Z",
            "2026-11-23T12:50:45+01:00",
        ] {
            assert_eq!(rfc3339_nanos(bad), None, "{bad}");
        }
        assert_eq!(rfc3339_nanos("1969-12-31T23:59:59Z"), None);
    }
}
