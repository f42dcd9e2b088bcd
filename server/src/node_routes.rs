//! The node's side of a cluster at the edge (docs/cluster.md): the layer that checks the
//! node of the session or snapshot a request names, and the drain routes.
//!
//! A request names a session or snapshot by its path (`/v1/sessions/ID...`,
//! `/v1/snapshots/ID`, E2B's `/sandboxes/ID...`, `/v2/sandboxes/ID...`,
//! `/templates/ID`), E2B's `E2b-Sandbox-Id` header, or E2B's host form `PORT-ID.DOMAIN`.
//! For such a request the layer
//! - waits while the session is being handed to another node by a drain, and holds off
//!   a hand-over until the requests already on the session have their answer's head (a
//!   streamed answer holds the session itself, so the hand-over's pause waits for it);
//! - forwards it to the node the session went to, if it was handed over;
//! - answers 421 `wrong_node` naming the node, if the id names another node and this one
//!   does not hold it (a router sent it to the wrong node);
//! - else lets it through.
//!
//! HAProxy reads the same places (`deploy/haproxy/`), so a request lands here only when
//! the router's map is out of date or a client called a node directly. Every answer
//! carries `X-Bud-Node`, the node that gave it.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::body::JsonBody;
use crate::compat::e2b::{SANDBOX_ID_HEADER, e2b_error};
use crate::error::ApiError;
use crate::peer;
use crate::service::drain::{self, DrainReport, DrainRequest};
use crate::service::error::Error;
use crate::sessions::Unavailable;
use crate::state::AppState;

/// The session or snapshot id a request names, and whether it came the E2B way.
pub fn named_id(path: &str, headers: &HeaderMap) -> Option<(String, bool)> {
    if let Some(id) = headers.get(SANDBOX_ID_HEADER).and_then(|v| v.to_str().ok()) {
        return Some((id.to_owned(), true));
    }
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let found = match segs.as_slice() {
        ["v1", "sessions", id, ..] if *id != "import" => Some((*id, false)),
        ["v1", "snapshots", id, ..] => Some((*id, false)),
        ["sandboxes", id, ..] | ["v2", "sandboxes", id, ..] | ["templates", id, ..] => {
            Some((*id, true))
        }
        _ => None,
    };
    if let Some((id, e2b)) = found {
        return Some((id.to_owned(), e2b));
    }
    // E2B's host form: `PORT-ID.DOMAIN`.
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let label = host.split('.').next()?;
    let (port, id) = label.split_once('-')?;
    (port.bytes().all(|b| b.is_ascii_digit()) && id.starts_with("ses_"))
        .then(|| (id.to_owned(), true))
}

/// Whether this node holds `id`: a live, ended (remembered), paused session, or a snapshot.
fn holds(state: &AppState, id: &str) -> bool {
    if !matches!(state.sessions().get(id), Err(Unavailable::Unknown)) {
        return true;
    }
    state
        .state_dir()
        .is_some_and(|d| d.paused(id).is_some() || d.snapshot(id).is_some())
}

/// The header naming the node that answered (a forwarded answer keeps the other node's).
pub const NODE_HEADER: &str = "x-bud-node";

/// The layer (module docs); every answer says which node gave it ([`NODE_HEADER`]).
pub async fn by_node(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let mut response = route(&state, req, next).await;
    if let Ok(v) = HeaderValue::from_str(state.node().id()) {
        response.headers_mut().entry(NODE_HEADER).or_insert(v);
    }
    response
}

async fn route(state: &AppState, req: Request, next: Next) -> Response {
    let Some((id, e2b)) = named_id(req.uri().path(), req.headers()) else {
        return next.run(req).await;
    };
    let node = state.node();
    let entered = node.enter(&id).await;
    if let Some(m) = node.moved(&id) {
        drop(entered);
        return peer::forward(&m.url, req).await;
    }
    if let Some(e) = Error::wrong_node(node, &id)
        && !holds(state, &id)
    {
        let e = ApiError::Service(e);
        return if e2b { e2b_error(e) } else { e.into_response() };
    }
    next.run(req).await
}

/// `POST /v1/admin/drain` (`crate::service::drain`): answers when the drain is over. The
/// drain runs on its own task, so a client that leaves does not cut it short.
pub async fn drain(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(req): JsonBody<DrainRequest>,
) -> Result<Json<DrainReport>, ApiError> {
    let auth = headers.get(header::AUTHORIZATION).cloned();
    let task = tokio::spawn(async move { drain::drain(&state, req, auth).await });
    let report = task.await.map_err(Error::internal)??;
    Ok(Json(report))
}

/// `POST /v1/admin/undrain`: the node takes new work again.
pub async fn undrain(State(state): State<AppState>) -> Json<crate::api::Health> {
    drain::undrain(&state);
    Json(crate::routes::health_of(&state))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(path: &str, hdr: &[(&str, &str)]) -> Option<(String, bool)> {
        let mut h = HeaderMap::new();
        for (k, v) in hdr {
            h.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        named_id(path, &h)
    }

    #[test]
    fn requests_name_their_session_in_the_places_e2b_and_bud_use() {
        let id = Some(("ses_n2_ab".to_owned(), false));
        assert_eq!(named("/v1/sessions/ses_n2_ab", &[]), id);
        assert_eq!(named("/v1/sessions/ses_n2_ab/files/a/b", &[]), id);
        assert_eq!(named("/v1/sessions/import", &[]), None);
        assert_eq!(named("/v1/sessions", &[]), None);
        assert_eq!(named("/v1/exec", &[]), None);
        let e2b = Some(("ses_n2_ab".to_owned(), true));
        assert_eq!(named("/sandboxes/ses_n2_ab/pause", &[]), e2b);
        assert_eq!(named("/v2/sandboxes/ses_n2_ab/connect", &[]), e2b);
        assert_eq!(named("/files", &[("e2b-sandbox-id", "ses_n2_ab")]), e2b);
        assert_eq!(
            named("/files", &[("host", "49983-ses_n2_ab.bud.example")]),
            e2b
        );
        assert_eq!(named("/files", &[("host", "127.0.0.1:8080")]), None);
        assert_eq!(
            named("/v1/snapshots/snap_n2_ab", &[]),
            Some(("snap_n2_ab".into(), false))
        );
    }
}
