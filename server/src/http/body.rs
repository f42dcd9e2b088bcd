//! Reading a JSON request body: `Content-Type` check (415), a size limit (413), a time
//! limit (408: a client trickling its body cannot hold a connection and its memory open;
//! `Limits::body_timeout_ms`), and deserialization that names the field at fault (400).
//!
//! A body over the limit is still read and thrown away, up to [`DRAIN_FACTOR`] times the
//! limit, before the 413 goes out: a server that answers early and closes a socket with
//! unread data makes the kernel reset the connection, and the client sees a reset instead of
//! the 413. Bodies past that are cut off (the client may then see the reset).

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::header;
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;

use crate::core::echo;
use crate::core::state::AppState;
use crate::http::error::{ApiError, Error};

/// How far past the limit a body is drained before the 413.
pub const DRAIN_FACTOR: usize = 4;

/// A JSON body of type `T`, checked as described in the module docs.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        if !is_json(req.headers().get(header::CONTENT_TYPE)) {
            return Err(ApiError::ContentType);
        }
        let limits = &state.config().limits;
        let bytes = read_limited(
            req.into_body(),
            limits.max_body_bytes,
            limits.body_timeout(),
        )
        .await?;
        parse(&bytes).map(JsonBody)
    }
}

fn is_json(value: Option<&header::HeaderValue>) -> bool {
    let Some(v) = value.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let mime = v.split(';').next().unwrap_or("").trim();
    mime.eq_ignore_ascii_case("application/json")
}

/// The body's bytes if it is at most `limit` long and all arrives within `timeout`.
pub async fn read_limited(
    body: Body,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<Vec<u8>, ApiError> {
    tokio::time::timeout(timeout, read_all(body, limit))
        .await
        .map_err(|_| ApiError::RequestTimeout {
            part: "body",
            after: timeout,
        })?
}

async fn read_all(body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let drain_cap = limit.saturating_mul(DRAIN_FACTOR);
    let too_large = ApiError::BodyTooLarge { limit };
    let declared = http_body::Body::size_hint(&body).exact();
    if declared.is_some_and(|n| n > drain_cap as u64) {
        return Err(too_large);
    }
    let mut body = body;
    let mut buf = Vec::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::Body(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen += data.len();
        if seen > drain_cap {
            return Err(too_large);
        }
        if seen <= limit {
            buf.extend_from_slice(&data);
        }
    }
    if seen > limit {
        return Err(too_large);
    }
    Ok(buf)
}

/// Deserializes `bytes`, naming the field at fault in errors. An error repeats at most a
/// short prefix of a value or key the client sent ([`echo`]), in its message and its field.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let said = inner.to_string();
        let field = field_of(&path, &said).map(|f| echo::excerpt(&f).into_owned());
        let message = echo::shorten(&said).into_owned();
        if inner.is_data() {
            ApiError::Service(Error::Invalid { field, message })
        } else if is_one_json_document(bytes) {
            // serde_json reports some wrong types as syntax (an integer where an enum's
            // string goes is "expected value"): the body is JSON, the field is wrong.
            ApiError::Service(Error::Invalid {
                field,
                message: "wrong type or value for this field".into(),
            })
        } else {
            ApiError::Json { field, message }
        }
    })?;
    // Anything but whitespace after the value (trailing garbage, a second object) makes
    // the body not one JSON document.
    de.end().map_err(|e| ApiError::Json {
        field: None,
        message: e.to_string(),
    })?;
    Ok(value)
}

/// Whether `bytes` is exactly one JSON value (whatever its shape).
fn is_one_json_document(bytes: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(bytes).is_ok()
}

/// The field an error is about: its path, extended by the name serde quotes for unknown and
/// missing fields (their path is the enclosing object).
fn field_of(path: &str, message: &str) -> Option<String> {
    let quoted = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.split('`').next());
    let base = (path != ".").then_some(path);
    match (base, quoted) {
        (Some(b), Some(q)) if !b.ends_with(q) => Some(format!("{b}.{q}")),
        (Some(b), _) => Some(b.to_string()),
        (None, Some(q)) => Some(q.to_string()),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::jobs::{BatchRequest, ExecRequest};

    /// A time limit no test body comes near.
    const T: std::time::Duration = std::time::Duration::from_secs(60);

    #[test]
    fn content_type_must_be_json() {
        let json = header::HeaderValue::from_static("application/json; charset=utf-8");
        let text = header::HeaderValue::from_static("text/plain");

        assert!(is_json(Some(&json)));
        assert!(!is_json(Some(&text)));
        assert!(!is_json(None));
    }

    #[test]
    fn a_wrong_type_names_its_path() {
        let e = parse::<BatchRequest>(
            br#"{"jobs": [{"code": "x"}, {"code": "x", "timeout_ms": "soon"}]}"#,
        )
        .unwrap_err();

        assert_eq!(e.code(), "invalid_request");
        assert_eq!(e.field(), Some("jobs[1].timeout_ms"));
    }

    #[test]
    fn unknown_and_missing_fields_are_named() {
        let unknown = parse::<ExecRequest>(br#"{"code": "x", "timeout": 5}"#).unwrap_err();
        let missing = parse::<BatchRequest>(b"{}").unwrap_err();
        // A language is a runtime name, checked against the template's manifest later.
        let language = parse::<ExecRequest>(br#"{"code": "x", "language": "ruby"}"#).unwrap();

        assert_eq!(unknown.field(), Some("timeout"));
        assert_eq!(missing.field(), Some("jobs"));
        assert_eq!(language.language.as_deref(), Some("ruby"));
    }

    #[test]
    fn malformed_json_is_invalid_json() {
        let e = parse::<ExecRequest>(b"{\"code\": ").unwrap_err();
        let bad_utf8 = parse::<ExecRequest>(b"{\"code\": \"\xff\"}").unwrap_err();

        assert_eq!(e.code(), "invalid_json");
        assert_eq!(bad_utf8.code(), "invalid_json");
    }

    #[test]
    fn trailing_garbage_or_a_second_object_is_invalid_json() {
        let garbage = parse::<ExecRequest>(br#"{"code": "x"} garbage"#).unwrap_err();
        let two = parse::<ExecRequest>(br#"{"code": "x"}{"code": "y"}"#).unwrap_err();
        let spaces = parse::<ExecRequest>(b"{\"code\": \"x\"} \n\t ");

        assert_eq!(garbage.code(), "invalid_json");
        assert_eq!(two.code(), "invalid_json");
        assert!(spaces.is_ok(), "{spaces:?}");
    }

    #[test]
    fn a_field_of_the_wrong_type_is_invalid_request_naming_it() {
        for body in [
            &br#"{"code": "x", "language": 1}"#[..],
            br#"{"code": 1}"#,
            br#"{"code": "x", "stdin": []}"#,
            br#"{"code": "x", "timeout_ms": "1"}"#,
        ] {
            let e = parse::<ExecRequest>(body).unwrap_err();
            let field = std::str::from_utf8(body).unwrap();
            assert_eq!(e.code(), "invalid_request", "{field}: {e:?}");
            assert!(
                e.field().is_some_and(|f| field.contains(f)),
                "{field}: {e:?}"
            );
        }
    }

    #[test]
    fn a_huge_value_or_key_is_repeated_by_its_prefix_in_the_message_and_the_field() {
        let long = "a".repeat(1 << 20);
        let value = format!(r#"{{"code": "x", "network": {{"allow_out": "{long}"}}}}"#);
        let key = format!(r#"{{"code": "x", "network": {{"{long}": []}}}}"#);

        let wrong_type = parse::<ExecRequest>(value.as_bytes()).unwrap_err();
        let unknown = parse::<ExecRequest>(key.as_bytes()).unwrap_err();

        let a = |n| "a".repeat(n);
        assert_eq!(wrong_type.code(), "invalid_request");
        assert_eq!(wrong_type.field(), Some("network.allow_out"));
        assert_eq!(
            wrong_type.to_string(),
            format!(
                "invalid type: string \"{}\"… (1048576 bytes), expected a sequence at line 1 column 1048617",
                a(64)
            )
        );
        assert_eq!(
            unknown.field(),
            Some(format!("network.{}… (1048584 bytes)", a(56)).as_str())
        );
        assert_eq!(
            unknown.to_string(),
            format!(
                "unknown field `{}`… (1048576 bytes), expected one of `allow_out`, `deny_out`, `rules` at line 1 column 1048604",
                a(64)
            )
        );
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_drained_and_refused() {
        let small = read_limited(Body::from(vec![b'x'; 10]), 10, T).await;
        let over = read_limited(Body::from(vec![b'x'; 11]), 10, T).await;
        let huge = read_limited(Body::from(vec![b'x'; 100]), 10, T).await;

        assert_eq!(small.unwrap().len(), 10);
        assert!(matches!(over, Err(ApiError::BodyTooLarge { limit: 10 })));
        assert!(matches!(huge, Err(ApiError::BodyTooLarge { limit: 10 })));
    }
}
