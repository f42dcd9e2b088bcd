//! Connect's streaming wire (what envd's streams speak): envelopes (1 flag byte, a
//! big-endian u32 length, the JSON; flag 2 ends a stream), a server stream's keepalives
//! and deadline (the client's headers), and its response. Used by [`super::process`] and
//! [`super::filesystem`].

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt, stream};
use serde_json::Value;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::time::Instant;

use crate::http::error::Error;

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

/// A server stream's clock: how often a quiet stream sends a keepalive (the client's
/// `Keepalive-Ping-Interval`) and when it ends (`Connect-Timeout-Ms`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    ping: Option<Duration>,
    until: Option<Instant>,
}

impl Timing {
    pub(super) fn of(headers: &HeaderMap) -> Self {
        let number = |name: &str| {
            let n = headers.get(name)?.to_str().ok()?.parse::<u64>().ok()?;
            (n > 0).then_some(n)
        };
        Self {
            ping: number("keepalive-ping-interval").map(Duration::from_secs),
            until: number("connect-timeout-ms")
                .map(|ms| Instant::now() + Duration::from_millis(ms)),
        }
    }
}

/// What a server stream sends next.
#[derive(Debug)]
pub(super) enum Next<T> {
    Event(T),
    /// Quiet for the keepalive interval.
    Keepalive,
    /// The stream's deadline passed.
    Deadline,
    /// The channel's sender is gone.
    Closed,
}

/// The next event of `rx` (going on past what a client that fell behind lost), or a
/// keepalive or the deadline when due first.
pub(super) async fn next<T: Clone>(rx: &mut broadcast::Receiver<T>, t: Timing) -> Next<T> {
    let far = Instant::now() + Duration::from_secs(365 * 86_400);
    let ping_at = t.ping.map_or(far, |p| Instant::now() + p);
    let until = t.until.unwrap_or(far);
    loop {
        tokio::select! {
            got = rx.recv() => match got {
                Ok(ev) => return Next::Event(ev),
                Err(RecvError::Lagged(_)) => continue,
                Err(RecvError::Closed) => return Next::Closed,
            },
            () = tokio::time::sleep_until(ping_at.min(until)) => {
                return if Instant::now() >= until { Next::Deadline } else { Next::Keepalive };
            }
        }
    }
}

/// A server stream's response: `first`, then `rest`.
pub(super) fn stream_response(
    first: Bytes,
    rest: impl Stream<Item = Bytes> + Send + 'static,
) -> Response {
    let body = stream::once(async move { first })
        .chain(rest)
        .map(Ok::<_, Infallible>);
    (
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(body),
    )
        .into_response()
}
