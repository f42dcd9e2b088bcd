//! Draining this node (docs/cluster.md), for an upgrade or before it leaves the cluster:
//!
//! 1. it takes no new work: one-shot jobs, new sessions, forks and imports are refused
//!    with 503 `draining` (answered before anything starts, so a router may retry them on
//!    another node), and HAProxy's agent check reads `drain`;
//! 2. it waits for the jobs running and queued to finish (up to the deadline);
//! 3. with a target node (`to`) and a state directory, it hands every session over: each
//!    is paused (a live one waits for its running cell), its file is imported by the
//!    target (same id), and the local file removed. Requests for a session being handed
//!    over wait until it is done; afterwards this node forwards them to the target
//!    ([`crate::core::node::Node::moved`]) until it stops, and a router learns the new place
//!    (the HAProxy map `moved.map`). A session the target refused stays here, paused, and
//!    is reported;
//! 4. without a target but with `pause`, it pauses every live session to the state
//!    directory (a restart on the same machine resumes them: Kubernetes' preStop hook);
//! 5. without either, it waits for the sessions to end, up to the deadline, then ends
//!    the ones left (410 `session_gone`, reason `drained`, afterwards; paused sessions stay
//!    on disk for the next server on this state directory) and reports them.
//!
//! The node stays draining until `undrain`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::HeaderValue;
use serde::{Deserialize, Serialize};

use crate::core::node::Moved;
use crate::core::peer;
use crate::core::sessions::Ended;
use crate::core::state::AppState;
use crate::service::error::Error;
use crate::service::{admission, durable, sessions};

/// Longest deadline a drain may be given.
pub const MAX_DEADLINE_S: u64 = 3600;
/// A drain's deadline when it gives none.
pub const DEFAULT_DEADLINE_S: u64 = 300;

/// What a drain is asked.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// The node (`http://HOST:PORT`) that takes this node's sessions.
    pub to: Option<String>,
    /// Seconds to wait for running jobs (and, without `to` or `pause`, for sessions) to end.
    pub deadline_s: Option<u64>,
    /// Without `to`: pause every live session to the state directory at once, for the next
    /// server on it (a restart on the same machine), instead of waiting for them to end.
    #[serde(default)]
    pub pause: bool,
}

/// A session handed to another node.
#[derive(Debug, Clone, Serialize)]
pub struct MovedOut {
    pub id: String,
    pub node: String,
}

/// A session that could not be handed over, and why (it stays here, paused or live).
#[derive(Debug, Clone, Serialize)]
pub struct Failed {
    pub id: String,
    pub error: String,
}

/// What a drain did.
#[derive(Debug, Clone, Serialize)]
pub struct DrainReport {
    pub node: String,
    /// The target node's id, if there was one.
    pub to_node: Option<String>,
    /// Whether the jobs running at the start finished before the deadline.
    pub jobs_finished: bool,
    pub moved: Vec<MovedOut>,
    /// Sessions ended at the deadline (no target).
    pub ended: Vec<String>,
    /// Sessions paused here (`pause`).
    pub paused: Vec<String>,
    pub failed: Vec<Failed>,
    pub drain_ms: f64,
}

/// Drains this node (module docs). `auth` goes with the calls to the target.
pub async fn drain(
    state: &AppState,
    req: DrainRequest,
    auth: Option<HeaderValue>,
) -> Result<DrainReport, Error> {
    let deadline_s = req.deadline_s.unwrap_or(DEFAULT_DEADLINE_S);
    if !(1..=MAX_DEADLINE_S).contains(&deadline_s) {
        return Err(Error::invalid(
            "deadline_s",
            format!("deadline_s must be 1..={MAX_DEADLINE_S} (got {deadline_s})"),
        ));
    }
    if (req.to.is_some() || req.pause) && state.state_dir().is_none() {
        return Err(Error::NoStateDir);
    }
    if req.to.is_some() && req.pause {
        return Err(Error::invalid(
            "pause",
            "pause is for a drain without `to` (with `to`, sessions are paused and handed over)",
        ));
    }
    let target = match &req.to {
        Some(to) => Some(target(state, to, auth.as_ref()).await?),
        None => None,
    };
    let started = Instant::now();
    let deadline = started + Duration::from_secs(deadline_s);
    let node = state.node();
    node.set_draining(true);
    tracing::info!(node = node.id(), to = ?req.to, deadline_s, "draining");
    let jobs = state.jobs();
    let jobs_finished = wait_until(deadline, || jobs.running() + jobs.queued() == 0).await;
    let mut report = DrainReport {
        node: node.id().to_owned(),
        to_node: target.as_ref().map(|t| t.node.clone()),
        jobs_finished,
        moved: Vec::new(),
        ended: Vec::new(),
        paused: Vec::new(),
        failed: Vec::new(),
        drain_ms: 0.0,
    };
    match target {
        Some(to) => {
            for id in session_ids(state) {
                match hand_over(state, &id, &to, auth.as_ref()).await {
                    Ok(()) => report.moved.push(MovedOut {
                        id,
                        node: to.node.clone(),
                    }),
                    Err(e) => report.failed.push(Failed {
                        id,
                        error: e.to_string(),
                    }),
                }
            }
        }
        None if req.pause => {
            for (id, paused) in durable::pause_all(state).await {
                match paused {
                    Ok(_) => report.paused.push(id),
                    Err(err) => report.failed.push(Failed {
                        id,
                        error: err.to_string(),
                    }),
                }
            }
        }
        None => {
            let s = state.sessions().clone();
            wait_until(deadline, || s.count() == 0).await;
            for e in state.sessions().list() {
                let why = Ended {
                    reason: "drained".into(),
                    detail: Some(format!(
                        "node {} drained and ended the sessions left after {deadline_s} s",
                        node.id()
                    )),
                };
                let registry = state.sessions().clone();
                let id = e.id.clone();
                match admission::call(state, move || registry.end(&id, why)).await {
                    Ok(()) => report.ended.push(e.id.clone()),
                    Err(err) => report.failed.push(Failed {
                        id: e.id.clone(),
                        error: err.to_string(),
                    }),
                }
            }
        }
    }
    report.drain_ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::info!(
        moved = report.moved.len(),
        ended = report.ended.len(),
        paused = report.paused.len(),
        failed = report.failed.len(),
        ms = report.drain_ms,
        "drained"
    );
    Ok(report)
}

/// Takes work again.
pub fn undrain(state: &AppState) {
    state.node().set_draining(false);
    tracing::info!(node = state.node().id(), "taking work again");
}

/// Every session here: live ones, then paused ones.
fn session_ids(state: &AppState) -> Vec<String> {
    let mut ids: Vec<String> = state
        .sessions()
        .list()
        .iter()
        .map(|e| e.id.clone())
        .collect();
    if let Some(dir) = state.state_dir() {
        ids.extend(dir.paused().list().into_iter().map(|p| p.record.id));
    }
    ids.dedup();
    ids
}

/// Polls `done` every 10 ms until it holds (true) or `deadline` passes (false).
async fn wait_until(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The target node: its URL and id, checked ready, open and not this node.
struct Target {
    url: String,
    node: String,
}

async fn target(state: &AppState, to: &str, auth: Option<&HeaderValue>) -> Result<Target, Error> {
    let bad = |why: String| Error::invalid("to", why);
    let uri = peer::url(to, "/v1/health").map_err(|e| bad(e.to_string()))?;
    let health = peer::json(peer::request("GET", uri, auth, None, Body::empty()))
        .await
        .map_err(|e| bad(format!("the target node is not ready: {e}")))?;
    let node = health["node"]
        .as_str()
        .ok_or_else(|| bad(format!("{to} does not say its node id (an older bud?)")))?;
    if node == state.node().id() {
        return Err(bad(format!("{to} is this node ({node})")));
    }
    if health["draining"] == serde_json::Value::Bool(true) {
        return Err(bad(format!("node {node} at {to} is draining too")));
    }
    Ok(Target {
        url: to.trim_end_matches('/').to_owned(),
        node: node.to_owned(),
    })
}

/// Hands session `id` to `to`: paused here, imported there, removed here. Requests for it
/// wait meanwhile, and are forwarded once it has moved.
async fn hand_over(
    state: &AppState,
    id: &str,
    to: &Target,
    auth: Option<&HeaderValue>,
) -> Result<(), Error> {
    let node = state.node().clone();
    let _moving = Moving::start(node.clone(), id);
    node.quiet(id).await;
    if state.sessions().get(id).is_ok() {
        durable::pause(state, id).await?;
    }
    let dir = state.state_dir().ok_or(Error::NoStateDir)?.clone();
    let path = dir.paused().path(id);
    let file = tokio::task::spawn_blocking(move || std::fs::File::open(path))
        .await
        .map_err(Error::internal)?
        .map_err(Error::internal)?;
    let uri = peer::url(&to.url, "/v1/sessions/import").map_err(Error::internal)?;
    let req = peer::request(
        "POST",
        uri,
        auth,
        Some("application/octet-stream"),
        Body::from_stream(chunks(file)),
    );
    peer::json(req)
        .await
        .map_err(|e| Error::internal(format!("handing {id} to node {}: {e}", to.node)))?;
    node.moved_to(
        id,
        Moved {
            node: to.node.clone(),
            url: to.url.clone(),
        },
    );
    sessions::end(state, id).await?;
    Ok(())
}

/// The bytes of `file` in chunks of [`UPLOAD_CHUNK`], each read on the blocking pool: a
/// session file is sent as it is read, never held whole (it holds the session's memory).
fn chunks(
    file: std::fs::File,
) -> impl futures_util::Stream<Item = std::io::Result<axum::body::Bytes>> + Send {
    futures_util::stream::unfold(Some(file), |file| async move {
        let mut file = file?;
        let read = tokio::task::spawn_blocking(move || {
            use std::io::Read;
            let mut buf = vec![0u8; UPLOAD_CHUNK];
            let n = file.read(&mut buf)?;
            buf.truncate(n);
            Ok::<_, std::io::Error>((file, buf))
        })
        .await
        .map_err(std::io::Error::other);
        match read {
            Ok(Ok((_, buf))) if buf.is_empty() => None,
            Ok(Ok((file, buf))) => Some((Ok(buf.into()), Some(file))),
            Ok(Err(e)) | Err(e) => Some((Err(e), None)),
        }
    })
}

/// Bytes of a session file read at a time for a hand-over.
const UPLOAD_CHUNK: usize = 1 << 20;

/// A session marked as being handed over, unmarked on drop (also when the drain fails).
struct Moving {
    node: Arc<crate::core::node::Node>,
    id: String,
}

impl Moving {
    fn start(node: Arc<crate::core::node::Node>, id: &str) -> Self {
        node.start_moving(id);
        Self {
            node,
            id: id.to_owned(),
        }
    }
}

impl Drop for Moving {
    fn drop(&mut self) {
        self.node.end_moving(&self.id);
    }
}
