//! bud's routes for a session's code contexts (`crate::service::contexts`): a Python or bash
//! context is a kernel of its own (a Python interpreter or a shell), so cells of different
//! contexts run at the same time, beside the session's own cells and commands; a context
//! in the template's kernel runtime (JavaScript) is a namespace of the session's kernel.
//!
//! - `POST /v1/sessions/{id}/contexts` `{"language": "python"|"bash"|"javascript", "cwd":
//!   DIR}`: 201, the context (its kernel or namespace starts at its first cell);
//! - `GET /v1/sessions/{id}/contexts`: the session's contexts;
//! - `POST /v1/sessions/{id}/contexts/{context}/exec` `{"code", "env", "timeout_ms"}`: the
//!   cell's answer, as a session cell's (a Python cell's displayed value in `result`);
//! - `POST /v1/sessions/{id}/contexts/{context}/restart`: 204, its kernel killed (the next
//!   cell starts a new one) or its namespace emptied;
//! - `DELETE /v1/sessions/{id}/contexts/{context}`: 204, emptied so and the context
//!   forgotten.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use crate::core::state::AppState;
use crate::http::body::JsonBody;
use crate::http::error::ApiError;
use crate::http::sessions::CellResponse;
use crate::service::contexts::{ContextCell, CreateContext};
use crate::service::{contexts, task};

/// Where a context starts unless asked: the session's work directory (where its own cells
/// start).
const WORK_DIR: &str = "/tmp";

/// `POST /v1/sessions/{id}/contexts`.
pub async fn create(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<CreateContext>,
) -> Result<(StatusCode, Json<ContextInfo>), ApiError> {
    let c = contexts::create(
        &state,
        &id,
        req.language.as_deref(),
        req.cwd.as_deref(),
        WORK_DIR,
    )?;
    Ok((StatusCode::CREATED, Json(ContextInfo::from(&c))))
}

/// `GET /v1/sessions/{id}/contexts`.
pub async fn list(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Vec<ContextInfo>>, ApiError> {
    let all = contexts::list(&state, &id)?;
    Ok(Json(all.iter().map(ContextInfo::from).collect()))
}

/// `POST /v1/sessions/{id}/contexts/{context}/exec`.
pub async fn exec(
    State(state): State<AppState>,
    Path((id, context)): Path<(String, String)>,
    JsonBody(req): JsonBody<ContextCell>,
) -> Result<Json<CellResponse>, ApiError> {
    let (code, env, timeout) = req.checked(&state.config().limits)?;
    let cell = contexts::Cell {
        code,
        env,
        timeout,
        stream: false,
    };
    let route = "/v1/sessions/{id}/contexts/{context}/exec";
    let which = contexts::Which::Made(&context);
    let ran = contexts::run(&state, &id, which, cell, route, task::no_sink()).await?;
    Ok(Json(
        CellResponse::new(
            ran.result,
            std::time::Duration::ZERO,
            ran.execution_count,
            false,
        )
        .native(),
    ))
}

/// `POST /v1/sessions/{id}/contexts/{context}/restart`.
pub async fn restart(
    State(state): State<AppState>,
    Path((id, context)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let route = "/v1/sessions/{id}/contexts/{context}/restart";
    contexts::restart(&state, &id, &context, route).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /v1/sessions/{id}/contexts/{context}`.
pub async fn remove(
    State(state): State<AppState>,
    Path((id, context)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let route = "/v1/sessions/{id}/contexts/{context}";
    contexts::remove(&state, &id, &context, route).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A code context as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContextInfo {
    pub id: String,
    pub language: String,
    pub cwd: String,
}

impl From<&crate::core::contexts::Context> for ContextInfo {
    fn from(c: &crate::core::contexts::Context) -> Self {
        Self {
            id: c.id.clone(),
            language: c.language.clone(),
            cwd: c.cwd.clone(),
        }
    }
}
