//! The JSON handlers: one job, a batch, health, metrics, the OpenAPI document, and the
//! answers for unknown routes and methods. Streaming lives in [`crate::stream`].
//!
//! Order of checks for a job request: content type (415), body size (413), JSON shape (400),
//! field limits (400/413), template ready (503), admission (429). Only then does a job run, on
//! a job thread; the handler awaits its reply.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::api::{AuditHealth, BatchRequest, BatchResponse, ExecRequest, ExecResponse, Health};
use crate::body::JsonBody;
use crate::error::ApiError;
use crate::service::error::Error;
use crate::service::jobs::{self, OneShot, Ran};
use crate::service::task;
use crate::state::AppState;

/// The service's one-shot job of `req` (checked; its files taken if the route `takes_files`,
/// else refused), asked on `route`; `prefix` names the request in error fields (`""`, or
/// `"jobs[3]."` in a batch).
pub fn one_shot(
    state: &AppState,
    mut req: ExecRequest,
    route: &str,
    prefix: &str,
    takes_files: bool,
) -> Result<OneShot, Error> {
    let files = if takes_files {
        req.take_files(&state.config().limits)?
    } else {
        Default::default()
    };
    let template = req.template.take();
    Ok(OneShot {
        job: req.into_job(&state.config().limits, prefix)?,
        template,
        files,
        route: route.to_owned(),
    })
}

/// The answer for a job that ran.
pub fn response(ran: Ran, output_b64: bool) -> ExecResponse {
    let mut resp = ExecResponse::new(ran.result, ran.waited, output_b64);
    resp.files = ran.files.map(|files| {
        files
            .into_iter()
            .map(|(name, bytes)| (name, crate::api::exec::b64(&bytes)))
            .collect()
    });
    resp
}

/// `POST /v1/exec`.
pub async fn exec(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<ExecRequest>,
) -> Result<Json<ExecResponse>, ApiError> {
    let b64 = req.output_b64;
    let one = one_shot(&state, req, "/v1/exec", "", true)?;
    let ran = jobs::run(&state, one, task::no_sink()).await?;
    Ok(Json(response(ran, b64)))
}

/// `POST /v1/exec/batch`: all jobs admitted at once or none, run in parallel on the job
/// threads, results in request order.
pub async fn batch(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let mut b64 = Vec::with_capacity(req.jobs.len());
    let mut all = Vec::with_capacity(req.jobs.len());
    for (i, r) in req.jobs.into_iter().enumerate() {
        b64.push(r.output_b64);
        all.push(one_shot(
            &state,
            r,
            "/v1/exec/batch",
            &format!("jobs[{i}]."),
            false,
        )?);
    }
    let ran = jobs::batch(&state, all).await?;
    let results = ran
        .into_iter()
        .zip(b64)
        .map(|(r, b)| response(r, b))
        .collect();
    Ok(Json(BatchResponse { results }))
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
    ApiError::no_route(req.method().as_str(), req.uri().path())
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}
