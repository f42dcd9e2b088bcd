//! A session's trace over HTTP (docs/evidence.md):
//! - `GET /v1/sessions/{id}/trace` the events as NDJSON, the file's lines as they are
//!   (`?kind=cell,process`, `?since=` and `?until=` RFC 3339 UTC or a prefix of it,
//!   `?after=SEQ`);
//! - `GET /v1/sessions/{id}/trace/verify` the chain and the seal checked;
//! - `POST /v1/sessions/{id}/trace/checkpoint` the work directory's changes recorded;
//! - `GET /v1/sessions/{id}/trace/otlp` the trace as OpenTelemetry spans (OTLP JSON);
//! - `GET /v1/sessions/{id}/trace.tar.gz` the review packet;
//! - `GET /v1/sessions/{id}/review` the review page (HTML, served with a policy that runs
//!   no script but its own);
//! - `GET /v1/sessions/{id}/events` Server-Sent Events, each event's `id` its seq: the
//!   events after `Last-Event-ID` (or `?after=`), then the new ones as they happen, until
//!   the seal. The service reads and follows ([`trace`]).

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::core::state::AppState;
use crate::core::trace::review;
use crate::http::error::ApiError;
use crate::service::trace::{self, Check, Filter};

/// The query of `GET /v1/sessions/{id}/trace`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceQuery {
    /// Kinds, comma-separated.
    pub kind: Option<String>,
    pub since: Option<String>,
    pub until: Option<String>,
    pub after: Option<u64>,
}

/// `GET /v1/sessions/{id}/trace`.
pub async fn lines(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<TraceQuery>,
) -> Result<Response, ApiError> {
    let filter = Filter {
        kinds: q
            .kind
            .iter()
            .flat_map(|k| k.split(','))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
            .collect(),
        since: q.since,
        until: q.until,
        after: q.after.unwrap_or(0),
    };
    let lines = trace::events(&state, &id, filter).await?;
    let mut body = String::with_capacity(lines.iter().map(|l| l.text.len() + 1).sum());
    for l in &lines {
        body.push_str(&l.text);
        body.push('\n');
    }
    let mut response = Body::from(body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    Ok(response)
}

/// `GET /v1/sessions/{id}/trace/verify`.
pub async fn verify(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Check>, ApiError> {
    Ok(Json(trace::check(&state, &id).await?))
}

/// `GET /v1/sessions/{id}/trace/otlp`.
pub async fn otlp(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(trace::spans(&state, &id).await?))
}

/// `GET /v1/sessions/{id}/trace.tar.gz`: a download named for the session.
pub async fn packet(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let gz = trace::packet(&state, &id).await?;
    let mut response = Body::from(gz).into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/gzip"),
    );
    // The id is a trace's: letters, digits, `-` and `_` only.
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{id}.trace.tar.gz\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    Ok(response)
}

/// `POST /v1/sessions/{id}/trace/checkpoint`: what the sandbox's programs changed in its
/// work directory since the last checkpoint, recorded (and answered).
pub async fn checkpoint(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(trace::checkpoint(&state, &id, "asked").await?))
}

/// `GET /v1/sessions/{id}/review`.
pub async fn review(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let page = trace::review(&state, &id).await?;
    let mut response = Body::from(page).into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    if let Ok(csp) = HeaderValue::from_str(&review::content_security_policy()) {
        h.insert(header::CONTENT_SECURITY_POLICY, csp);
    }
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    Ok(response)
}

/// The query of `GET /v1/sessions/{id}/events`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    pub after: Option<u64>,
}

/// How often an idle stream sends a comment, so that proxies keep it open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// `GET /v1/sessions/{id}/events`.
pub async fn events(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    let last = match headers.get("last-event-id") {
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| ApiError::Body("Last-Event-ID must be an event's seq".into()))?,
        ),
        None => None,
    };
    let after = last.or(q.after).unwrap_or(0);
    let rx = trace::follow(&state, &id, after).await?;
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let line = rx.recv().await?;
        let event = Event::default()
            .id(line.seq.to_string())
            .event(line.kind.clone())
            .data(line.text.clone());
        Some((Ok::<_, Infallible>(event), rx))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)))
}
