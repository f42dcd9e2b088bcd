//! The native API of a session's background processes, a thin adapter over
//! [`crate::service::processes`]:
//! - `POST /v1/sessions/{id}/processes`: start one (201, its info);
//! - `GET /v1/sessions/{id}/processes`: running and recently ended ones;
//! - `GET /v1/sessions/{id}/processes/{pid}`: one;
//! - `GET /v1/sessions/{id}/processes/{pid}/output?from=start|now`: its output as NDJSON
//!   (`{"type":"stdout"|"stderr","data":...}` with `data_b64` for bytes that are not UTF-8,
//!   `{"type":"dropped","bytes":N}` for output no longer kept, then `{"type":"end",...}`
//!   with the process's info), until it ends; a client that goes away leaves it running;
//! - `POST .../{pid}/stdin`: write (and close) its stdin; `POST .../{pid}/signal`;
//!   `POST .../{pid}/resize` (a terminal's size); `DELETE .../{pid}`: SIGKILL;
//! - `POST /v1/sessions/{id}/watchers` (`{"path", "recursive"}`: 201 `{"id"}`), `GET
//!   .../watchers/{wid}/changes` (the changes since the last call, and how many were
//!   dropped), `DELETE .../watchers/{wid}`.

use std::convert::Infallible;

use crate::core::clock::{epoch_s, rfc3339};
use crate::core::processes::{Exit, Info};
use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tokio::sync::broadcast::error::RecvError;
use vmm::job::Stream;

use crate::core::processes::{Event, Subscription};
use crate::core::state::AppState;
use crate::http::body::JsonBody;
use crate::http::error::{ApiError, Error};
use crate::http::jobs::text_and_b64;
use crate::service::files::check_relative;
use crate::service::processes;
use crate::service::processes::requests::{
    CreateWatcher, SendSignal, StartProcess, TerminalSize, WriteStdin,
};

fn info_of(state: &AppState, id: &str, pid: u32) -> Result<ProcessInfo, Error> {
    let all = processes::list(state, id)?;
    all.iter()
        .find(|(i, _)| i.pid == pid)
        .map(|(i, end)| ProcessInfo::of(i, end.as_ref()))
        .ok_or(Error::NoProcess {
            pid,
            message: format!("no process {pid} in this sandbox"),
        })
}

/// `POST /v1/sessions/{id}/processes`.
pub async fn start(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<StartProcess>,
) -> Result<(StatusCode, Json<ProcessInfo>), ApiError> {
    let route = "/v1/sessions/{id}/processes";
    let pid = processes::start(&state, &id, req.into_start()?, route).await?;
    Ok((StatusCode::CREATED, Json(info_of(&state, &id, pid)?)))
}

/// `GET /v1/sessions/{id}/processes`.
pub async fn list(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let all: Vec<ProcessInfo> = processes::list(&state, &id)?
        .iter()
        .map(|(i, end)| ProcessInfo::of(i, end.as_ref()))
        .collect();
    Ok(Json(serde_json::json!({ "processes": all })))
}

/// `GET /v1/sessions/{id}/processes/{pid}`.
pub async fn show(
    State(state): State<AppState>,
    Path((id, pid)): Path<(String, u32)>,
) -> Result<Json<ProcessInfo>, ApiError> {
    Ok(Json(info_of(&state, &id, pid)?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    /// `start` (default): everything still kept, then what comes; `now`: only what comes.
    #[serde(default)]
    from: Option<String>,
}

/// `GET /v1/sessions/{id}/processes/{pid}/output`.
pub async fn output(
    State(state): State<AppState>,
    Path((id, pid)): Path<(String, u32)>,
    Query(q): Query<OutputQuery>,
) -> Result<Response, ApiError> {
    let from_start = match q.from.as_deref() {
        None | Some("start") => true,
        Some("now") => false,
        Some(other) => {
            return Err(Error::invalid(
                "from",
                format!("from must be start or now (got {other:?})"),
            )
            .into());
        }
    };
    let sub = processes::connect(&state, &id, pid, from_start)?;
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines(sub)),
    )
        .into_response())
}

/// The NDJSON lines of a subscription (module docs), ending after the process's end.
fn lines(sub: Subscription) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> {
    let first = (sub.dropped > 0)
        .then(|| line(serde_json::json!({"type": "dropped", "bytes": sub.dropped})));
    let info = sub.info.clone();
    let replay = sub.replay.into_iter();
    let state = (first, replay, Some(sub.rx), sub.ended.is_some());
    stream::unfold(state, move |(first, mut replay, rx, mut done)| {
        let info = info.clone();
        async move {
            if let Some(l) = first {
                return Some((Ok(l), (None, replay, rx, done)));
            }
            let mut rx = rx?;
            let ev = match replay.next() {
                Some(ev) => ev,
                None if done => return None,
                None => match rx.recv().await {
                    Ok(ev) => ev,
                    // This client fell too far behind: say how many events it lost.
                    Err(RecvError::Lagged(n)) => {
                        let l = line(serde_json::json!({"type": "lagged", "events": n}));
                        return Some((Ok(l), (None, replay, Some(rx), done)));
                    }
                    Err(RecvError::Closed) => return None,
                },
            };
            let l = match ev {
                Event::Output(s, bytes) => {
                    let (data, data_b64) = text_and_b64(&bytes, false);
                    let kind = if s == Stream::Stdout {
                        "stdout"
                    } else {
                        "stderr"
                    };
                    let mut v = serde_json::json!({"type": kind, "data": data});
                    if let Some(b) = data_b64 {
                        v["data_b64"] = b.into();
                    }
                    line(v)
                }
                Event::End(exit) => {
                    done = true;
                    let mut v = serde_json::to_value(ProcessInfo::of(&info, Some(&exit)))
                        .unwrap_or_default();
                    v["type"] = "end".into();
                    line(v)
                }
            };
            Some((Ok(l), (None, replay, Some(rx), done)))
        }
    })
}

fn line(v: serde_json::Value) -> Bytes {
    let mut b = serde_json::to_vec(&v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

/// `POST /v1/sessions/{id}/processes/{pid}/stdin`.
pub async fn stdin(
    State(state): State<AppState>,
    Path((id, pid)): Path<(String, u32)>,
    JsonBody(req): JsonBody<WriteStdin>,
) -> Result<StatusCode, ApiError> {
    let data = req.bytes()?;
    processes::stdin(&state, &id, pid, data, req.close).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sessions/{id}/processes/{pid}/signal`.
pub async fn signal(
    State(state): State<AppState>,
    Path((id, pid)): Path<(String, u32)>,
    JsonBody(req): JsonBody<SendSignal>,
) -> Result<StatusCode, ApiError> {
    let sig = req.number()?;
    processes::signal(&state, &id, pid, sig).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sessions/{id}/processes/{pid}/resize`.
pub async fn resize(
    State(state): State<AppState>,
    Path((id, pid)): Path<(String, u32)>,
    JsonBody(req): JsonBody<TerminalSize>,
) -> Result<StatusCode, ApiError> {
    let (rows, cols) = req.checked()?;
    processes::resize(&state, &id, pid, rows, cols).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sessions/{id}/watchers`.
pub async fn watch(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<CreateWatcher>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    check_relative("path", &req.path)?;
    let wid = processes::watch(&state, &id, &req.path, req.recursive, false).await?;
    let body = serde_json::json!({"id": wid, "path": req.path, "recursive": req.recursive});
    Ok((StatusCode::CREATED, Json(body)))
}

/// `GET /v1/sessions/{id}/watchers/{wid}/changes`.
pub async fn changes(
    State(state): State<AppState>,
    Path((id, wid)): Path<(String, u32)>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (changes, dropped) = processes::changes(&state, &id, wid)?;
    let changes: Vec<WatchChange> = changes
        .into_iter()
        .map(|c| WatchChange::of(c.change, c.path))
        .collect();
    Ok(Json(
        serde_json::json!({"changes": changes, "dropped": dropped}),
    ))
}

/// `DELETE /v1/sessions/{id}/watchers/{wid}`.
pub async fn unwatch(
    State(state): State<AppState>,
    Path((id, wid)): Path<(String, u32)>,
) -> Result<StatusCode, ApiError> {
    processes::unwatch(&state, &id, wid).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /v1/sessions/{id}/processes/{pid}`: SIGKILL to it and what it started.
pub async fn kill(
    State(state): State<AppState>,
    Path((id, pid)): Path<(String, u32)>,
) -> Result<StatusCode, ApiError> {
    processes::signal(&state, &id, pid, 9).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A process in a listing (and the answer to starting one).
#[derive(Debug, Serialize)]
pub struct ProcessInfo {
    pub pid: u32,
    pub command: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    pub cwd: Option<String>,
    pub env: BTreeMap<String, String>,
    pub tag: Option<String>,
    pub stdin: bool,
    /// The terminal it was started on, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pty: Option<TerminalSize>,
    /// The user it runs as, if one was asked for (else root).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    pub started_at: String,
    /// `running`, `exited`, `killed` (by a signal) or `lost` (the sandbox ended first).
    pub status: &'static str,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
    /// From its start to its end (null while it runs), as the server saw them.
    pub duration_ms: Option<f64>,
}

impl ProcessInfo {
    pub fn of(info: &Info, end: Option<&Exit>) -> Self {
        let status = match end {
            None => "running",
            Some(e) if e.lost.is_some() => "lost",
            Some(e) if e.signal.is_some() => "killed",
            Some(_) => "exited",
        };
        Self {
            pid: info.pid,
            command: info.start.cmd.clone(),
            args: info.start.args.clone(),
            cwd: info.start.cwd.clone(),
            env: info.start.env.clone(),
            tag: info.start.tag.clone(),
            stdin: info.takes_input(),
            pty: info
                .start
                .pty
                .map(|(rows, cols)| TerminalSize { rows, cols }),
            user: info.start.user.clone(),
            started_at: rfc3339(epoch_s(info.started_at)),
            status,
            exit_code: end.and_then(|e| e.exit_code),
            signal: end.and_then(|e| e.signal),
            lost: end.and_then(|e| e.lost.clone()),
            duration_ms: end.map(|e| {
                e.ended_at
                    .duration_since(info.started_at)
                    .unwrap_or_default()
                    .as_secs_f64()
                    * 1e3
            }),
        }
    }
}

/// One change a watcher saw.
#[derive(Debug, Serialize)]
pub struct WatchChange {
    /// `create`, `write`, `remove`, `rename` (moved away) or `chmod`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Relative to the watched directory.
    pub path: String,
}

impl WatchChange {
    pub fn of(change: vmm::process::Change, path: String) -> Self {
        use vmm::process::Change;
        let kind = match change {
            Change::Create => "create",
            Change::Write => "write",
            Change::Remove => "remove",
            Change::Rename => "rename",
            Change::Chmod => "chmod",
        };
        Self { kind, path }
    }
}
