//! The session API: create, list, show, delete, run a cell, fork (files: [`crate::session_files`]).
//!
//! Every request that touches a session's VM takes the session (409 if a request is already
//! in it) and an admission slot (429 when the server is full), then runs on a job thread like
//! a job. Error model as `/v1/exec`; an ended session answers 410 with why.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use vmm::session::{DEFAULT_INTERRUPT_GRACE, Session, SessionError};
use vmm::{Executor, Health, Language, Status, Unusable};

use crate::api::{ExecRequest, ExecResponse};
use crate::body::JsonBody;
use crate::error::ApiError;
use crate::jobs::CancelOnDrop;
use crate::sessions::{Busy, Ended, Entry, NewSession, Unavailable, epoch_s};
use crate::state::AppState;

/// `POST /v1/sessions`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// Default language of its cells (`python` unless given).
    pub language: Option<Language>,
    /// Environment of every cell.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub idle_timeout_s: Option<u64>,
    pub max_lifetime_s: Option<u64>,
    /// Anything the client wants back in `GET` (at most 4 KiB of JSON).
    #[serde(default)]
    pub metadata: serde_json::Value,
    /// The template to start from (default: the server's default template).
    pub template: Option<String>,
}

/// A session as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionInfo {
    pub id: String,
    pub created_at: f64,
    pub expires_at: f64,
    pub idle_timeout_s: u64,
    pub language: Language,
    pub execution_count: u64,
    /// Host memory this session holds alone (its private pages).
    pub memory_bytes: u64,
    /// Fork layers it sits on (shared with its relatives).
    pub shared_memory_bytes: u64,
    pub busy: bool,
    pub parent: Option<String>,
    pub metadata: serde_json::Value,
    pub template: String,
}

impl SessionInfo {
    fn of(e: &Entry) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        Self {
            id: e.id.clone(),
            created_at: epoch_s(e.created_at),
            expires_at: epoch_s(e.expires_at()),
            idle_timeout_s: e.idle_timeout.as_secs(),
            language: e.language,
            execution_count: e.executions.load(Relaxed),
            memory_bytes: e.private_bytes.load(Relaxed),
            shared_memory_bytes: e.layer_bytes.load(Relaxed),
            busy: e.is_busy(),
            parent: e.parent.clone(),
            metadata: e.metadata.clone(),
            template: e.template.clone(),
        }
    }
}

/// A cell's result: the job result, plus the displayed value and the execution count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CellResponse {
    #[serde(flatten)]
    pub exec: ExecResponse,
    /// The final expression's value by MIME type (`text/plain`, `text/html`, `image/png` in
    /// base64), as Jupyter's `execute_result`; null when there is none.
    pub result: Option<BTreeMap<String, String>>,
    pub execution_count: u64,
    /// The cell's uncaught exception, for cells run with `error_in_display` (the
    /// code-interpreter compat layer); the native API prints it on stderr instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<vmm::CellError>,
}

/// `POST /v1/sessions/{id}/fork`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    #[serde(default = "one")]
    pub count: usize,
}

fn one() -> usize {
    1
}

/// What a fork made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForkResponse {
    pub ids: Vec<String>,
    /// How long the source was paused (state capture, layer copy, remap).
    pub source_pause_ms: f64,
    /// Creation time of each child.
    pub per_child_ms: f64,
    /// Bytes frozen into the new layer (shared by the source and the children).
    pub layer_bytes: u64,
}

pub fn unavailable(id: &str, u: Unavailable) -> ApiError {
    match u {
        Unavailable::Unknown => ApiError::NoSession(id.to_owned()),
        Unavailable::Busy => ApiError::SessionBusy(id.to_owned()),
        Unavailable::Gone(e) => ApiError::SessionGone {
            id: id.to_owned(),
            reason: e.reason,
            detail: e.detail,
        },
    }
}

pub(crate) fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::Internal {
        field: None,
        message: e.to_string(),
    }
}

/// Checks the memory cap before a session is made or forked.
fn check_memory(state: &AppState) -> Result<(), ApiError> {
    let limit = state.config().sessions.max_memory_bytes;
    let used = state.sessions().memory_bytes();
    if used >= limit {
        return Err(ApiError::OutOfMemory { used, limit });
    }
    Ok(())
}

fn check_count(state: &AppState, more: usize) -> Result<(), ApiError> {
    let limit = state.config().sessions.max_sessions;
    if state.sessions().count() + more > limit {
        return Err(ApiError::TooManySessions {
            limit,
            retry_after: state.config().retry_after(),
        });
    }
    Ok(())
}

fn seconds(field: &str, asked: Option<u64>, default: u64, max: u64) -> Result<Duration, ApiError> {
    let s = asked.unwrap_or(default);
    if !(1..=max).contains(&s) {
        return Err(ApiError::invalid(
            field,
            format!("{field} must be 1..={max} (got {s})"),
        ));
    }
    Ok(Duration::from_secs(s))
}

/// Runs `work` with the executor on a job thread and awaits its answer.
pub(crate) async fn on_job_thread<R: Send + 'static>(
    state: &AppState,
    exec: Arc<Executor>,
    work: impl FnOnce(&Executor) -> R + Send + 'static,
) -> Result<R, ApiError> {
    let slot = state.admit(1)?.remove(0);
    let (tx, rx) = oneshot::channel();
    state.spawn(slot, move || {
        let _ = tx.send(work(&exec));
    })?;
    rx.await
        .map_err(|_| internal("the job thread lost the request"))
}

/// Ends the session of `busy` if its VM is no longer usable after a request, with why (the
/// VM's own [`Health`]: the one answer the executor and sessions read).
pub(crate) fn end_if_unusable(state: &AppState, busy: &Busy) {
    let e = busy.entry();
    let health = e
        .with_vm(|s| s.health().clone())
        .unwrap_or(Health::Discard(Unusable::Failed(
            "the session's VM is gone".into(),
        )));
    let Health::Discard(why) = health else {
        return;
    };
    let stopped = |reason, after| {
        let detail = format!("the cell did not stop within the grace period after {after}");
        (reason, detail)
    };
    let (reason, detail) = match &why {
        Unusable::Stopped(Status::Timeout) => stopped("timeout", "its interrupt"),
        Unusable::Stopped(Status::Cancelled) => stopped("cancelled", "it was cancelled"),
        Unusable::Stopped(Status::OutputLimit) => {
            stopped("output_limit", "its output reached the cap")
        }
        _ => ("crashed", why.to_string()),
    };
    // The 410s that follow carry the last console lines too.
    let last = e.with_vm(|s| s.console_tail(5)).unwrap_or_default();
    let detail = if reason == "crashed" && !last.is_empty() {
        Some(format!("{detail}; console: {}", last.join(" | ")))
    } else {
        Some(detail)
    };
    state.sessions().end(
        &e.id,
        Ended {
            reason: reason.into(),
            detail,
        },
    );
}

/// `POST /v1/sessions`.
pub async fn create(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<CreateSession>,
) -> Result<(StatusCode, Json<SessionInfo>), ApiError> {
    let made = start_session(&state, req).await?;
    Ok((StatusCode::CREATED, Json(SessionInfo::of(&made))))
}

/// Checks `req` against the limits and caps, starts its session on a job thread and
/// registers it (the one way to make a session, for the native API and the compat layers).
pub async fn start_session(state: &AppState, req: CreateSession) -> Result<Arc<Entry>, ApiError> {
    let lim = &state.config().sessions;
    let idle = seconds(
        "idle_timeout_s",
        req.idle_timeout_s,
        lim.default_idle_timeout_s,
        lim.max_idle_timeout_s,
    )?;
    let life = seconds(
        "max_lifetime_s",
        req.max_lifetime_s,
        lim.default_lifetime_s,
        lim.max_lifetime_s,
    )?;
    if serde_json::to_vec(&req.metadata).map_or(0, |v| v.len()) > 4096 {
        return Err(ApiError::invalid(
            "metadata",
            "metadata must be at most 4096 bytes of JSON",
        ));
    }
    let probe = ExecRequest {
        code: Some(String::new()),
        env: req.env.clone(),
        ..ExecRequest::default()
    };
    probe.into_job(&state.config().limits, "")?;
    let exec = state.executor_for(req.template.as_deref())?;
    check_count(state, 1)?;
    check_memory(state)?;
    let settings = NewSession {
        language: req.language.unwrap_or(Language::Python),
        env: req.env,
        idle_timeout: idle,
        max_lifetime: life,
        metadata: req.metadata,
        parent: None,
        template: state.template_name(req.template.as_deref()).to_owned(),
        executor: exec.clone(),
    };
    let sessions = state.sessions().clone();
    on_job_thread(state, exec, move |ex| {
        let made = Session::start(ex)
            .map_err(internal)
            .and_then(|vm| sessions.insert(settings, vm).map_err(internal))?;
        made.account();
        Ok::<_, ApiError>(made)
    })
    .await?
}

/// `GET /v1/sessions`.
pub async fn list(State(state): State<AppState>) -> Json<serde_json::Value> {
    let all: Vec<SessionInfo> = state
        .sessions()
        .list()
        .iter()
        .map(|e| SessionInfo::of(e))
        .collect();
    Json(serde_json::json!({ "sessions": all }))
}

/// `GET /v1/sessions/{id}`.
pub async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SessionInfo>, ApiError> {
    let e = state.sessions().get(&id).map_err(|u| unavailable(&id, u))?;
    Ok(Json(SessionInfo::of(&e)))
}

/// `DELETE /v1/sessions/{id}`: 204; 404 when unknown; waits for a running request's end.
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    end_session(&state, id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Ends session `id` as deleted (its tombstone too, if it had ended already); 404 when
/// unknown; waits for a running request's end.
pub async fn end_session(state: &AppState, id: String) -> Result<(), ApiError> {
    let exec = match state.sessions().get(&id) {
        Ok(e) => e.executor.clone(),
        Err(Unavailable::Gone(_)) => {
            state.sessions().forget(&id);
            return Ok(());
        }
        Err(u) => return Err(unavailable(&id, u)),
    };
    let sessions = state.sessions().clone();
    let why = Ended {
        reason: "deleted".into(),
        detail: None,
    };
    on_job_thread(state, exec, move |_| sessions.end(&id, why)).await
}

fn cell_job(
    state: &AppState,
    e: &Entry,
    mut req: ExecRequest,
) -> Result<(vmm::Job, bool), ApiError> {
    let b64 = req.output_b64;
    if let Some(t) = req.template.as_deref()
        && t != e.template
    {
        return Err(ApiError::invalid(
            "template",
            format!(
                "a session keeps its template ({}); create another session for {t}",
                e.template
            ),
        ));
    }
    if req.language.is_none() {
        req.language = Some(e.language);
    }
    let mut env = e.env.clone();
    env.append(&mut req.env);
    req.env = env;
    Ok((req.into_job(&state.config().limits, "")?, b64))
}

/// Runs a cell of session `id` on a job thread; `on_output` sees its output as it comes.
/// `route` names the route in the audit trail.
pub async fn run_cell(
    state: &AppState,
    id: &str,
    req: ExecRequest,
    route: &str,
    mut on_output: impl FnMut(vmm::job::Stream, &[u8]) + Send + 'static,
) -> Result<(CellResponse, bool), ApiError> {
    let busy = state
        .sessions()
        .acquire(id)
        .map_err(|u| unavailable(id, u))?;
    let (mut job, b64) = cell_job(state, busy.entry(), req)?;
    // Held by this future: a client that goes away drops it, which cancels the cell (it is
    // interrupted; see `vmm::Cancel`). Known to the job threads while it runs, too: a
    // shutdown past its grace cancels it.
    let mut cancel = CancelOnDrop::for_job(state.jobs(), &mut job);
    let origin = crate::audit::Origin::here(route, &busy.entry().template, Some(id));
    let st = state.clone();
    let queued = Instant::now();
    let exec = busy.entry().executor.clone();
    let (ran, waited) = on_job_thread(state, exec, move |ex| {
        let waited = queued.elapsed();
        let ran = busy
            .entry()
            .with_vm(|s| {
                s.exec(ex, &job, DEFAULT_INTERRUPT_GRACE, &mut on_output)
                    .map(|r| (r, s.executions()))
            })
            .unwrap_or(Err(SessionError::Gone));
        if let Ok((r, _)) = &ran {
            st.metrics().job(r.status, waited, &r.timings);
            st.audit_job(&origin, "cell", &job, r, waited);
        }
        end_if_unusable(&st, &busy);
        // Accounted before the answer: a client that creates or forks right after a cell
        // that grew must meet the memory cap with that growth counted. Freed before the
        // answer too, so its next cell never finds it busy.
        busy.entry().account();
        drop(busy);
        (ran, waited)
    })
    .await?;
    cancel.disarm();
    let (r, count) = ran.map_err(internal)?;
    let result = (!r.display.is_empty()).then(|| {
        r.display
            .iter()
            .map(|d| (d.mime.clone(), d.data.clone()))
            .collect()
    });
    let error = r.error.clone();
    let exec = ExecResponse::new(r, waited, b64);
    Ok((
        CellResponse {
            exec,
            result,
            execution_count: count,
            error,
        },
        b64,
    ))
}

/// `POST /v1/sessions/{id}/exec`.
pub async fn exec(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ExecRequest>,
) -> Result<Json<CellResponse>, ApiError> {
    let (r, _) = run_cell(&state, &id, req, "/v1/sessions/{id}/exec", |_, _| {}).await?;
    Ok(Json(r))
}

/// `POST /v1/sessions/{id}/fork`.
pub async fn fork(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ForkRequest>,
) -> Result<(StatusCode, Json<ForkResponse>), ApiError> {
    let max = state.config().sessions.max_fork_count;
    if !(1..=max).contains(&req.count) {
        return Err(ApiError::invalid(
            "count",
            format!("count must be 1..={max} (got {})", req.count),
        ));
    }
    let busy = state
        .sessions()
        .acquire(&id)
        .map_err(|u| unavailable(&id, u))?;
    check_count(&state, req.count)?;
    check_memory(&state)?;
    let sessions = state.sessions().clone();
    let count = req.count;
    let exec = busy.entry().executor.clone();
    let made = on_job_thread(&state, exec, move |ex| {
        let e = busy.entry().clone();
        let forked = e
            .with_vm(|s| s.fork(ex, count))
            .unwrap_or(Err(SessionError::Gone));
        let (children, stats) = forked.map_err(internal)?;
        let mut ids = Vec::with_capacity(children.len());
        for child in children {
            let settings = NewSession {
                language: e.language,
                env: e.env.clone(),
                idle_timeout: e.idle_timeout,
                max_lifetime: e
                    .expires_at()
                    .duration_since(std::time::SystemTime::now())
                    .unwrap_or_default()
                    .max(Duration::from_secs(1)),
                metadata: e.metadata.clone(),
                parent: Some(e.id.clone()),
                template: e.template.clone(),
                executor: e.executor.clone(),
            };
            let child_entry = sessions.insert(settings, child).map_err(internal)?;
            child_entry.account();
            ids.push(child_entry.id.clone());
        }
        sessions
            .forked
            .fetch_add(ids.len() as u64, std::sync::atomic::Ordering::Relaxed);
        e.account();
        drop(busy);
        Ok::<_, ApiError>(ForkResponse {
            ids,
            source_pause_ms: stats.source_pause.as_secs_f64() * 1e3,
            per_child_ms: stats.per_child.as_secs_f64() * 1e3,
            layer_bytes: stats.layer_bytes,
        })
    })
    .await??;
    Ok((StatusCode::CREATED, Json(made)))
}

/// Ends expired sessions every second until the server stops (spawned by `serve`).
pub async fn reaper(state: AppState) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let sessions: Arc<_> = state.sessions().clone();
        let _ = tokio::task::spawn_blocking(move || sessions.reap()).await;
    }
}
