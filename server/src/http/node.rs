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
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::core::sessions::Unavailable;
use crate::core::state::AppState;
use crate::core::{metrics, peer};
use crate::http::body::JsonBody;
use crate::http::error::ApiError;
use crate::service::drain::{self, DrainReport, DrainRequest};
use crate::service::error::Error;

/// Where one dialect's requests name a sandbox (a session or snapshot id), as data: the
/// node's routing reads it here, and the same data can be printed for a router in front
/// ([`sandbox_places`]). Each dialect gives its own ([`NATIVE`] here, E2B's in
/// `compat::e2b`); the root hands them to the layer ([`Routing`]).
#[derive(Debug, Clone, Copy)]
pub struct SandboxPlaces {
    /// Path prefixes followed by the id as the next segment (`/v1/sessions/` -> ID).
    pub prefixes: &'static [&'static str],
    /// Ids a prefix is followed by that are routes, not sandboxes (`import`).
    pub not_ids: &'static [&'static str],
    /// A header carrying the id.
    pub header: Option<&'static str>,
    /// Whether the Host may be `PORT-ID.DOMAIN` (E2B's per-port host names); the id then
    /// goes in [`Self::header`] on its way to the node.
    pub host_form: bool,
    /// Creates that may name a snapshot in their JSON body: (the `POST` path, the field).
    /// The node needs no routing for them (a create runs where it lands, fetching the
    /// snapshot from its node); a router in front sends them to the snapshot's node.
    pub creates: &'static [(&'static str, &'static str)],
    /// How this dialect words an error (the 421 of a request sent to the wrong node).
    pub error: fn(ApiError) -> Response,
}

/// bud's own routes: `/v1/sessions/ID...` and `/v1/snapshots/ID`.
pub const NATIVE: SandboxPlaces = SandboxPlaces {
    prefixes: &["/v1/sessions/", "/v1/snapshots/"],
    not_ids: &["import"],
    header: None,
    host_form: false,
    creates: &[("/v1/sessions", "snapshot")],
    error: native_error,
};

fn native_error(e: ApiError) -> Response {
    e.into_response()
}

/// What the routing layer needs: the state, and every dialect's places, most specific
/// first (the first that names an id wins).
#[derive(Debug, Clone)]
pub struct Routing {
    pub state: AppState,
    pub dialects: &'static [SandboxPlaces],
}

impl SandboxPlaces {
    /// The id `path` or `headers` name in this dialect's places.
    pub fn named_id(&self, path: &str, headers: &HeaderMap) -> Option<String> {
        if let Some(h) = self.header
            && let Some(id) = headers.get(h).and_then(|v| v.to_str().ok())
        {
            return Some(id.to_owned());
        }
        for prefix in self.prefixes {
            if let Some(rest) = path.strip_prefix(prefix) {
                let id = rest.split('/').next().unwrap_or_default();
                if !id.is_empty() && !self.not_ids.contains(&id) {
                    return Some(id.to_owned());
                }
            }
        }
        if !self.host_form {
            return None;
        }
        // The host form: `PORT-ID.DOMAIN`.
        let host = headers.get(header::HOST)?.to_str().ok()?;
        let label = host.split('.').next()?;
        let (port, id) = label.split_once('-')?;
        (port.bytes().all(|b| b.is_ascii_digit()) && id.starts_with("ses_")).then(|| id.to_owned())
    }
}

/// The session or snapshot id a request names, and the dialect whose place named it.
pub fn named_id<'a>(
    dialects: &'a [SandboxPlaces],
    path: &str,
    headers: &HeaderMap,
) -> Option<(String, &'a SandboxPlaces)> {
    dialects
        .iter()
        .find_map(|d| d.named_id(path, headers).map(|id| (id, d)))
}

/// Every place of `dialects` as lines a router reads, in the order they are checked here
/// (the first that names an id wins): `header NAME`, `prefix PATH`, `host HEADER` (the
/// host form, its id put in HEADER), and `create PATH FIELD`. HAProxy's configuration
/// (`deploy/haproxy/gen-config.sh`) is generated from these lines, kept in
/// `deploy/haproxy/sandbox-places` (a test checks that the file is this function's output).
pub fn sandbox_places(dialects: &[SandboxPlaces]) -> Vec<String> {
    let mut lines = Vec::new();
    for d in dialects {
        lines.extend(d.header.iter().map(|h| format!("header {h}")));
        lines.extend(d.prefixes.iter().map(|p| format!("prefix {p}")));
        if d.host_form {
            lines.push(format!("host {}", d.header.unwrap_or_default()));
        }
    }
    for d in dialects {
        lines.extend(d.creates.iter().map(|(p, f)| format!("create {p} {f}")));
    }
    lines
}

/// Whether this node holds `id`: a live, ended (remembered), paused session, or a snapshot.
fn holds(state: &AppState, id: &str) -> bool {
    if !matches!(state.sessions().get(id), Err(Unavailable::Unknown)) {
        return true;
    }
    state
        .state_dir()
        .is_some_and(|d| d.paused().get(id).is_some() || d.snapshots().get(id).is_some())
}

/// The header naming the node that answered (a forwarded answer keeps the other node's).
pub const NODE_HEADER: &str = "x-bud-node";

/// The layer (module docs); every answer says which node gave it ([`NODE_HEADER`]).
pub async fn by_node(State(routing): State<Routing>, req: Request, next: Next) -> Response {
    let state = &routing.state;
    let mut response = route(state, routing.dialects, req, next).await;
    if let Ok(v) = HeaderValue::from_str(state.node().id()) {
        response.headers_mut().entry(NODE_HEADER).or_insert(v);
    }
    response
}

async fn route(state: &AppState, dialects: &[SandboxPlaces], req: Request, next: Next) -> Response {
    let Some((id, dialect)) = named_id(dialects, req.uri().path(), req.headers()) else {
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
        return (dialect.error)(ApiError::Service(e));
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
pub async fn undrain(State(state): State<AppState>) -> Json<crate::http::node::Health> {
    drain::undrain(&state);
    Json(health_of(&state))
}

/// `GET /v1/health`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Health {
    /// `ok` or `starting`.
    pub status: String,
    pub template_ready: bool,
    /// The template's key (its directory name), once ready.
    pub template: Option<String>,
    pub version: String,
    pub host_kind: String,
    pub workers: usize,
    pub queue_capacity: usize,
    pub jobs_running: usize,
    pub jobs_queued: usize,
    pub pool_size: usize,
    pub pool_ready: usize,
    pub live_clones: usize,
    /// Reset VMs waiting for a job.
    pub warm_vms: usize,
    /// `warm` (VMs reset and reused) or `fresh` (a fresh clone per job).
    pub reuse: String,
    /// The audit log's state, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditHealth>,
    /// The jail is closed: seccomp filters on (the default; not with `--no-jail` or where
    /// the host cannot install them), and privileges dropped with `--user`.
    #[serde(default)]
    pub jailed: bool,
    /// This node's id, which its session and snapshot ids carry (docs/cluster.md).
    #[serde(default)]
    pub node: String,
    /// The node drains: it takes no new sessions or jobs, and still serves its sessions.
    #[serde(default)]
    pub draining: bool,
    /// What of the host slows this server as it holds more VMs, in words (a DAMON monitor
    /// of physical memory: docs/sessions.md, "Many sessions on one server"); absent when
    /// nothing is known.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_notes: Vec<String>,
}

/// [`Health::host_notes`], read from the host once (at startup, before the jail closes).
pub fn host_notes() -> &'static [String] {
    static NOTES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NOTES.get_or_init(|| {
        vmm::PhysicalMonitor::running()
            .iter()
            .map(vmm::PhysicalMonitor::note)
            .collect()
    })
}

/// The audit log in `GET /v1/health`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuditHealth {
    /// Records written.
    pub written: u64,
    /// Records lost (queue full or the file not writable).
    pub dropped: u64,
    /// The last write (or the queue) failed; with `--audit-required` jobs are refused.
    pub failing: bool,
    /// The last failure.
    pub error: Option<String>,
}

/// What `GET /v1/health` shows.
pub fn health_of(state: &AppState) -> Health {
    let g = state.gauges();
    let template = state.executor_if_ready().and_then(|e| {
        e.template()
            .dir()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
    });
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    Health {
        status: if g.template_ready { "ok" } else { "starting" }.into(),
        template_ready: g.template_ready,
        template,
        version: env!("CARGO_PKG_VERSION").into(),
        host_kind: vmm::HostKind::detect().name().into(),
        workers: g.workers,
        queue_capacity: g.queue_capacity,
        jobs_running: g.jobs_running,
        jobs_queued: g.jobs_queued,
        pool_size: g.pool_size,
        pool_ready: g.pool_ready,
        live_clones: g.live_clones,
        warm_vms: g.warm_vms,
        reuse: match state.config().reuse {
            vmm::Reuse::Warm => "warm",
            vmm::Reuse::Fresh => "fresh",
        }
        .into(),
        audit: state.audit().map(|a| AuditHealth {
            written: a.state.written.load(relaxed),
            dropped: a.state.dropped.load(relaxed),
            failing: a.state.failing(),
            error: a.state.last_error(),
        }),
        jailed: state.jobs().jailed(),
        node: state.node().id().to_owned(),
        draining: state.node().draining(),
        host_notes: host_notes().to_vec(),
    }
}

/// `GET /v1/health`: 200 once the template is ready, 503 (same body) before.
pub async fn health(State(state): State<AppState>) -> Response {
    let h = health_of(&state);
    let code = if h.template_ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(h)).into_response()
}

/// `GET /metrics`: the Prometheus text of `core::metrics`, the gauges read now.
pub async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let text = state
        .metrics()
        .render(&state.gauges())
        .map_err(Error::internal)?;
    Ok(([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dialect like E2B's, so the reader is tested without naming one.
    const OTHER: SandboxPlaces = SandboxPlaces {
        prefixes: &["/sandboxes/", "/v2/sandboxes/"],
        not_ids: &[],
        header: Some("e2b-sandbox-id"),
        host_form: true,
        creates: &[("/sandboxes", "templateID")],
        error: native_error,
    };

    fn named(path: &str, hdr: &[(&str, &str)]) -> Option<(String, bool)> {
        let mut h = HeaderMap::new();
        for (k, v) in hdr {
            h.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        named_id(&[NATIVE, OTHER], path, &h).map(|(id, d)| (id, d.host_form))
    }

    #[test]
    fn requests_name_their_session_in_the_places_their_dialect_gives() {
        let id = Some(("ses_n2_ab".to_owned(), false));
        assert_eq!(named("/v1/sessions/ses_n2_ab", &[]), id);
        assert_eq!(named("/v1/sessions/ses_n2_ab/files/a/b", &[]), id);
        assert_eq!(named("/v1/sessions/import", &[]), None);
        assert_eq!(named("/v1/sessions", &[]), None);
        assert_eq!(named("/v1/sessions/", &[]), None);
        assert_eq!(named("/v1/exec", &[]), None);
        let other = Some(("ses_n2_ab".to_owned(), true));
        assert_eq!(named("/sandboxes/ses_n2_ab/pause", &[]), other);
        assert_eq!(named("/v2/sandboxes/ses_n2_ab/connect", &[]), other);
        assert_eq!(named("/files", &[("e2b-sandbox-id", "ses_n2_ab")]), other);
        assert_eq!(
            named("/files", &[("host", "49983-ses_n2_ab.bud.example")]),
            other
        );
        assert_eq!(named("/files", &[("host", "127.0.0.1:8080")]), None);
        assert_eq!(
            named("/v1/snapshots/snap_n2_ab", &[]),
            Some(("snap_n2_ab".into(), false))
        );
    }

    #[test]
    fn the_places_print_as_lines_for_a_router() {
        let lines = sandbox_places(&[OTHER, NATIVE]);

        assert_eq!(
            lines,
            [
                "header e2b-sandbox-id",
                "prefix /sandboxes/",
                "prefix /v2/sandboxes/",
                "host e2b-sandbox-id",
                "prefix /v1/sessions/",
                "prefix /v1/snapshots/",
                "create /sandboxes templateID",
                "create /v1/sessions snapshot",
            ]
        );
    }
}
