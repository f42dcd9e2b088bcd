//! Connect's streaming wire (what envd's streams speak): envelopes (1 flag byte, a
//! big-endian u32 length, the JSON; flag 2 ends a stream), and the client's keepalive
//! interval and deadline headers. Used by [`super::process`] and [`super::filesystem`].

use std::time::Duration;

use axum::body::Bytes;
use axum::http::HeaderMap;
use serde_json::Value;

use crate::error::Error;

/// One Connect envelope: flags, big-endian length, the JSON.
pub(super) fn envelope(flags: u8, v: &Value) -> Bytes {
    let json = serde_json::to_vec(v).unwrap_or_default();
    let mut out = Vec::with_capacity(5 + json.len());
    out.push(flags);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    Bytes::from(out)
}

/// The JSON messages of an enveloped request body (several for a client stream), or of a
/// bare JSON one.
pub(super) fn unwrap_envelopes(mut body: &[u8]) -> Result<Vec<Value>, Error> {
    let parse = |json: &[u8]| {
        serde_json::from_slice(json).map_err(|e| Error::invalid("body", format!("bad JSON: {e}")))
    };
    if !matches!(body.first(), Some(0..=3)) {
        return Ok(vec![parse(body)?]);
    }
    let mut all = Vec::new();
    while let [flags, a, b, c, d, rest @ ..] = body {
        if flags & 1 != 0 {
            return Err(Error::invalid(
                "body",
                "compressed envelopes are not supported",
            ));
        }
        let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
        let json = rest
            .get(..len)
            .ok_or_else(|| Error::invalid("body", "truncated Connect envelope"))?;
        // Flag 2: the client stream's end (no message of its own to act on).
        if flags & 2 == 0 {
            all.push(parse(json)?);
        }
        body = &rest[len..];
    }
    if !body.is_empty() {
        return Err(Error::invalid("body", "truncated Connect envelope"));
    }
    Ok(all)
}

/// The one JSON message of a request body.
pub(super) fn unwrap_envelope(body: &[u8]) -> Result<Value, Error> {
    unwrap_envelopes(body)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::invalid("body", "no message in the request"))
}

/// How often a quiet stream sends a keepalive (the client's `Keepalive-Ping-Interval`).
pub(super) fn keepalive(headers: &HeaderMap) -> Option<Duration> {
    let s = headers
        .get("keepalive-ping-interval")?
        .to_str()
        .ok()?
        .parse::<u64>()
        .ok()?;
    (s > 0).then(|| Duration::from_secs(s))
}

/// The stream's deadline (`Connect-Timeout-Ms`), if any.
pub(super) fn deadline(headers: &HeaderMap) -> Option<tokio::time::Instant> {
    let ms = headers
        .get("connect-timeout-ms")?
        .to_str()
        .ok()?
        .parse::<u64>()
        .ok()?;
    (ms > 0).then(|| tokio::time::Instant::now() + Duration::from_millis(ms))
}
