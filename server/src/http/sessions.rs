//! The session API's handlers: create, list, show, delete, run a cell, fork, and the
//! session's files (`PUT/GET/DELETE /v1/sessions/{id}/files/{*path}`, the listing). Each
//! is a thin adapter over [`crate::service::sessions`] and [`crate::service::files`]:
//! the request's shape in, the service's answer or error out.
//!
//! Error model as `/v1/exec`; a busy session is 409, an ended one 410 with why.

use crate::core::clock::epoch_s;
use crate::core::sessions::{Entry, listed_for};
use crate::http::jobs::ExecResponse;
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::core::state::AppState;
use crate::http::body::JsonBody;
use crate::http::error::{ApiError, Error};
use crate::service::jobs::ExecRequest;
use crate::service::sessions::{CreateSession, ForkRequest};
use crate::service::templates::runtime_name;
use crate::service::{files, lifecycle, sessions, task};

/// `POST /v1/sessions`.
pub async fn create(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<CreateSession>,
) -> Result<(StatusCode, Json<SessionInfo>), ApiError> {
    let made = lifecycle::start(&state, req).await?;
    Ok((StatusCode::CREATED, Json(SessionInfo::of(&made))))
}

/// `GET /v1/sessions`.
pub async fn list(State(state): State<AppState>) -> Json<serde_json::Value> {
    // With API keys, a key's own sessions only: an id is the way to a session, and a
    // listing would hand out another key's.
    let mut all: Vec<SessionInfo> = state
        .sessions()
        .list()
        .iter()
        .filter(|e| listed_for(e.owner.as_deref()))
        .map(|e| SessionInfo::of(e))
        .collect();
    if let Some(dir) = state.state_dir() {
        all.extend(
            dir.paused()
                .list()
                .iter()
                .filter(|p| listed_for(p.record.owner.as_deref()))
                .map(|p| SessionInfo::paused(&state, p)),
        );
    }
    Json(serde_json::json!({ "sessions": all }))
}

/// `GET /v1/sessions/{id}`.
pub async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SessionInfo>, ApiError> {
    match sessions::get(&state, &id) {
        Ok(e) => Ok(Json(SessionInfo::of(&e))),
        Err(Error::Paused(_)) => state
            .state_dir()
            .and_then(|d| d.paused().get(&id))
            .map(|p| Json(SessionInfo::paused(&state, &p)))
            .ok_or_else(|| Error::NoSession(id).into()),
        Err(e) => Err(e.into()),
    }
}

/// `DELETE /v1/sessions/{id}`: 204; 404 when unknown; waits for a running request's end;
/// a paused session's file is removed.
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    sessions::end(&state, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sessions/{id}/exec`.
pub async fn exec(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ExecRequest>,
) -> Result<Json<CellResponse>, ApiError> {
    let b64 = req.output_b64;
    let route = "/v1/sessions/{id}/exec";
    let cell = sessions::cell(&state, &id, req, route, task::no_sink()).await?;
    Ok(Json(
        CellResponse::new(cell.result, cell.waited, cell.execution_count, b64).native(),
    ))
}

/// `POST /v1/sessions/{id}/fork`.
pub async fn fork(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ForkRequest>,
) -> Result<(StatusCode, Json<ForkResponse>), ApiError> {
    let made = sessions::fork(&state, &id, req.count).await?;
    Ok((
        StatusCode::CREATED,
        Json(ForkResponse::new(made.ids, &made.stats)),
    ))
}

/// `GET /v1/sessions/{id}/files?dir=`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ListQuery {
    pub dir: Option<String>,
}

/// A file path from the URL, checked before the guest sees it (the guest checks again after
/// resolving symlinks).
fn file_path(path: &str) -> Result<&str, Error> {
    crate::service::files::check_relative("path", path)?;
    Ok(path)
}

/// `PUT /v1/sessions/{id}/files/{*path}`: the raw body becomes the file.
pub async fn put_file(
    State(state): State<AppState>,
    Path((id, path)): Path<(String, String)>,
    req: Request,
) -> Result<StatusCode, ApiError> {
    let path = file_path(&path)?;
    let limit = state.config().sessions.max_file_bytes;
    let timeout = state.config().limits.body_timeout();
    let data = crate::http::body::read_limited(req.into_body(), limit, timeout)
        .await
        .map_err(|e| match e {
            ApiError::BodyTooLarge { limit } => ApiError::Service(Error::TooLarge {
                field: "body".into(),
                bytes: limit + 1,
                limit,
            }),
            other => other,
        })?;
    files::write(&state, &id, path, data).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/sessions/{id}/files/{*path}`: the file's bytes.
pub async fn get_file(
    State(state): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let bytes = files::read(&state, &id, file_path(&path)?).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Bytes::from(bytes),
    )
        .into_response())
}

/// `DELETE /v1/sessions/{id}/files/{*path}`.
pub async fn delete_file(
    State(state): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    files::remove(&state, &id, file_path(&path)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/sessions/{id}/files?dir=`: `{"files": [{name, type, size}]}`.
pub async fn list_files(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let dir = match q.dir.as_deref() {
        None | Some("") | Some(".") => ".",
        Some(d) => file_path(d)?,
    };
    let listed = files::list(&state, &id, dir).await?;
    let files: Vec<serde_json::Value> = listed
        .into_iter()
        .map(|f| serde_json::json!({"name": f.name, "type": f.kind, "size": f.size}))
        .collect();
    Ok(Json(serde_json::json!({ "files": files })))
}

/// A session as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionInfo {
    pub id: String,
    pub created_at: f64,
    pub expires_at: f64,
    pub idle_timeout_s: u64,
    /// The runtime its cells run in unless a cell names another, by its template's name
    /// for it (`python`, `shell`, `javascript`).
    pub language: String,
    pub execution_count: u64,
    /// Host memory this session holds alone (its private pages).
    pub memory_bytes: u64,
    /// Fork layers it sits on (shared with its relatives).
    pub shared_memory_bytes: u64,
    pub busy: bool,
    /// Requests waiting for it.
    pub waiting: usize,
    pub parent: Option<String>,
    pub metadata: serde_json::Value,
    pub template: String,
    /// `running` or `paused`.
    pub state: String,
    /// Parked by the server for idling (`--park-idle-s`): running as far as its client
    /// goes, on disk until its next request resumes it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub parked: bool,
    pub auto_pause: bool,
    /// When it paused (a paused session).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<f64>,
}

impl SessionInfo {
    /// A paused session as the API shows it: its lifetime stands still (`expires_at` is
    /// what it would be if it resumed now). A parked one is shown running, its lifetime
    /// going on.
    pub fn paused(state: &AppState, p: &crate::core::durable::Paused) -> Self {
        use crate::core::durable::{epoch_ms, from_epoch_ms};
        let r = &p.record;
        let now = std::time::SystemTime::now();
        let now_ms = epoch_ms(now);
        let parked = r.parked_at(now_ms);
        let engine = match state.template_state(&r.template) {
            Some(crate::core::state::TemplateState::Ready(e)) => Some(e),
            _ => None,
        };
        Self {
            id: r.id.clone(),
            created_at: epoch_s(from_epoch_ms(r.created_at_ms)),
            expires_at: epoch_s(now + r.lifetime_left_at(now_ms)),
            idle_timeout_s: r.idle_timeout_s,
            language: runtime_name(engine.as_ref().map(|e| e.manifest()), r.language, r.dialect),
            execution_count: 0,
            memory_bytes: 0,
            shared_memory_bytes: 0,
            busy: false,
            waiting: 0,
            parent: r.parent.clone(),
            metadata: r.metadata.clone(),
            template: r.template.clone(),
            state: if parked { "running" } else { "paused" }.into(),
            parked,
            auto_pause: r.auto_pause,
            paused_at: (!parked).then(|| epoch_s(from_epoch_ms(r.paused_at_ms))),
        }
    }

    pub fn of(e: &Entry) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        Self {
            id: e.id.clone(),
            created_at: epoch_s(e.created_at),
            expires_at: epoch_s(e.expires_at()),
            idle_timeout_s: e.idle_timeout.as_secs(),
            language: runtime_name(Some(e.engine.manifest()), e.language, e.dialect),
            execution_count: e.executions.load(Relaxed),
            memory_bytes: e.private_bytes.load(Relaxed),
            shared_memory_bytes: e.layer_bytes.load(Relaxed),
            busy: e.is_busy(),
            waiting: e.waiting(),
            parent: e.parent.clone(),
            metadata: e.metadata.clone(),
            template: e.template.clone(),
            state: "running".into(),
            parked: false,
            auto_pause: e.auto_pause.load(Relaxed),
            paused_at: None,
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

impl CellResponse {
    /// The answer for cell result `r`, which waited `waited` for a job thread and was the
    /// session's `execution_count`th; `output_b64`: always give the output in base64 too.
    pub fn new(
        r: vmm::JobResult,
        waited: std::time::Duration,
        execution_count: u64,
        output_b64: bool,
    ) -> Self {
        let result = (!r.display.is_empty()).then(|| {
            r.display
                .iter()
                .map(|d| (d.mime.clone(), d.data.clone()))
                .collect()
        });
        let error = r.error.clone();
        Self {
            exec: ExecResponse::new(r, waited, output_b64),
            result,
            execution_count,
            error,
        }
    }
}

/// Display formats bud's guest adds for the E2B code interpreter (a DataFrame's columns,
/// a chart, what `display()` showed besides the value): the E2B adapter reads them; the
/// native API's `result` does not carry them.
const BUD_FORMATS: &str = "application/vnd.bud.";

impl CellResponse {
    /// The answer of the native session API: the value's formats without bud's own
    /// ([`BUD_FORMATS`]), null when none is left.
    pub fn native(mut self) -> Self {
        if let Some(r) = &mut self.result {
            r.retain(|mime, _| !mime.starts_with(BUD_FORMATS));
            if r.is_empty() {
                self.result = None;
            }
        }
        self
    }
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

impl ForkResponse {
    /// The answer for children `ids` made at the cost `stats`.
    pub fn new(ids: Vec<String>, stats: &vmm::session::ForkStats) -> Self {
        Self {
            ids,
            source_pause_ms: stats.source_pause.as_secs_f64() * 1e3,
            per_child_ms: stats.per_child.as_secs_f64() * 1e3,
            layer_bytes: stats.layer_bytes,
        }
    }
}
