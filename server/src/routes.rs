//! The JSON handlers: one job, a batch, health, metrics, the OpenAPI document, and the
//! answers for unknown routes and methods. Streaming lives in [`crate::stream`].
//!
//! Order of checks for a job request: content type (415), body size (413), JSON shape (400),
//! field limits (400/413), template ready (503), admission (429). Only then does a job run, on
//! a job thread; the handler awaits its reply.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::sync::oneshot;
use vmm::{ExecError, Executor, Job, JobResult};

use crate::api::{BatchRequest, BatchResponse, ExecRequest, ExecResponse};
use crate::audit::Origin;
use crate::body::JsonBody;
use crate::error::ApiError;
use crate::jobs::{CancelOnDrop, Slot};
use crate::metrics::Metrics;
use crate::state::AppState;

/// A job's outcome and how long it waited for a job thread.
pub type Outcome = (Result<JobResult, ExecError>, Duration);

/// Records and logs a finished job (on the job thread, so it counts even if the client left).
pub fn record(metrics: &Metrics, outcome: &Outcome) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    match &outcome.0 {
        Ok(r) => {
            metrics.job(r.status, outcome.1, &r.timings);
            tracing::debug!(
                status = ?r.status,
                exit_code = r.exit_code,
                queue_ms = ms(outcome.1),
                clone_ms = ms(r.timings.clone),
                run_ms = ms(r.timings.run),
                total_ms = ms(r.timings.total),
                "job finished"
            );
            if let Some(why) = &r.crash {
                tracing::warn!(crash = %why, "job crashed its clone");
            }
        }
        Err(e) => {
            metrics.failure();
            tracing::error!(error = %e, "job could not run");
        }
    }
}

/// Queues `job` on a job thread; the receiver gets its outcome. A job whose client has gone
/// away before a thread picks it up is dropped unrun.
fn start(
    state: &AppState,
    exec: Arc<Executor>,
    slot: Slot,
    mut job: Job,
    origin: Origin,
) -> Result<(oneshot::Receiver<Outcome>, CancelOnDrop), ApiError> {
    let cancel = CancelOnDrop::for_job(state.jobs(), &mut job);
    let (tx, rx) = oneshot::channel();
    let metrics = state.metrics_handle();
    let st = state.clone();
    let queued_at = Instant::now();
    state.spawn(slot, move || {
        let waited = queued_at.elapsed();
        if tx.is_closed() {
            return;
        }
        // The result goes out before the VM is reset for its next job.
        exec.run_then(&job, &mut |_, _| {}, |result| {
            if let Ok(r) = &result {
                st.audit_job(&origin, "job", &job, r, waited);
            }
            let outcome = (result, waited);
            record(&metrics, &outcome);
            let _ = tx.send(outcome);
        });
    })?;
    Ok((rx, cancel))
}

async fn finish(rx: oneshot::Receiver<Outcome>) -> Result<(JobResult, Duration), NoResult> {
    match rx.await {
        Ok((Ok(r), waited)) => Ok((r, waited)),
        Ok((Err(e), _)) => Err(NoResult::Exec(e)),
        Err(_) => Err(NoResult::Lost),
    }
}

/// Why a queued job produced no result.
enum NoResult {
    Exec(ExecError),
    /// The job thread dropped the job (it panicked).
    Lost,
}

impl NoResult {
    fn into_api(self, field: Option<String>) -> ApiError {
        match self {
            NoResult::Exec(e) => ApiError::exec(e, field),
            NoResult::Lost => ApiError::Internal {
                field,
                message: "the job thread lost the job".into(),
            },
        }
    }
}

/// `POST /v1/exec`.
pub async fn exec(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<ExecRequest>,
) -> Result<Json<ExecResponse>, ApiError> {
    run_exec(&state, req, "/v1/exec").await.map(Json)
}

/// Checks and runs one job, with its files if it has any: `POST /v1/exec`, and the way
/// compat layers run theirs (same limits, same admission).
/// `route` names the route in the audit trail.
pub async fn run_exec(
    state: &AppState,
    mut req: ExecRequest,
    route: &str,
) -> Result<ExecResponse, ApiError> {
    let output_b64 = req.output_b64;
    let files = req.take_files(&state.config().limits)?;
    let template = req.template.take();
    let job = req.into_job(&state.config().limits, "")?;
    let exec = state.executor_for(template.as_deref())?;
    let origin = Origin::here(route, state.template_name(template.as_deref()), None);
    if !files.is_empty() {
        return crate::session_files::exec_with_files(state, exec, job, files, output_b64, origin)
            .await;
    }
    let slot = state.admit(1)?.remove(0);
    // Dropped with this future if the client goes away: that cancels the job.
    let (rx, mut cancel) = start(state, exec, slot, job, origin)?;
    let done = finish(rx).await;
    cancel.disarm();
    let (r, waited) = done.map_err(|e| e.into_api(None))?;
    Ok(ExecResponse::new(r, waited, output_b64))
}

/// `POST /v1/exec/batch`: all jobs admitted at once or none, run in parallel on the job
/// threads, results in request order. One job bud could not run fails the whole request.
pub async fn batch(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let limits = &state.config().limits;
    let n = req.jobs.len();
    if n == 0 {
        return Err(ApiError::invalid("jobs", "jobs must hold at least one job"));
    }
    if n > limits.max_batch_jobs {
        return Err(ApiError::TooMany {
            field: "jobs".into(),
            count: n,
            limit: limits.max_batch_jobs,
        });
    }
    // The jobs share the batch's output budget (`Limits::max_batch_output_bytes`).
    let share = (limits.max_batch_output_bytes / n).max(1);
    let mut jobs = Vec::with_capacity(n);
    for (i, r) in req.jobs.into_iter().enumerate() {
        let b64 = r.output_b64;
        let template = r.template.clone();
        let mut job = r.into_job(limits, &format!("jobs[{i}]."))?;
        job.output_limit = job.output_limit.min(share);
        jobs.push((job, b64, template));
    }
    let mut ready = Vec::with_capacity(n);
    for (i, (job, b64, template)) in jobs.into_iter().enumerate() {
        let exec = state
            .executor_for(template.as_deref())
            .map_err(|e| e.in_field(&format!("jobs[{i}].template")))?;
        let origin = Origin::here(
            "/v1/exec/batch",
            state.template_name(template.as_deref()),
            None,
        );
        ready.push((job, b64, exec, origin));
    }
    let slots = state.admit(n)?;
    let mut pending = Vec::with_capacity(n);
    for (slot, (job, b64, exec, origin)) in slots.into_iter().zip(ready) {
        pending.push((start(&state, exec, slot, job, origin)?, b64));
    }
    let mut results = Vec::with_capacity(n);
    for (i, ((rx, mut cancel), b64)) in pending.into_iter().enumerate() {
        let done = finish(rx).await;
        cancel.disarm();
        let (r, waited) = done.map_err(|e| e.into_api(Some(format!("jobs[{i}]"))))?;
        results.push(ExecResponse::new(r, waited, b64));
    }
    Ok(Json(BatchResponse { results }))
}

/// `GET /v1/health`: 200 once the template is ready, 503 (same body) before.
pub async fn health(State(state): State<AppState>) -> Response {
    let h = state.health();
    let code = if h.template_ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(h)).into_response()
}

/// `GET /v1/templates`: the served templates, their state (`ready`, `building`, `failed`
/// with why), image size, packages and memory.
pub async fn templates(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "templates": state.templates() }))
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let text = state.metrics().render(&state.gauges());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// `GET /v1/openapi.json`.
pub async fn openapi(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(crate::openapi::document(&state.config().limits))
}

pub async fn not_found(req: Request) -> ApiError {
    ApiError::NotFound(format!("{} {}", req.method(), req.uri().path()))
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}
