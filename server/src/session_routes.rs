//! The session API's handlers: create, list, show, delete, run a cell, fork, and the
//! session's files (`PUT/GET/DELETE /v1/sessions/{id}/files/{*path}`, the listing). Each
//! is a thin adapter over [`crate::service::sessions`] and [`crate::service::files`]:
//! the request's shape in, the service's answer or error out.
//!
//! Error model as `/v1/exec`; a busy session is 409, an ended one 410 with why.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::api::{
    CellResponse, CreateSession, ExecRequest, ForkRequest, ForkResponse, SessionInfo,
};
use crate::body::JsonBody;
use crate::error::{ApiError, Error};
use crate::service::{files, sessions, task};
use crate::state::AppState;

/// `POST /v1/sessions`.
pub async fn create(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<CreateSession>,
) -> Result<(StatusCode, Json<SessionInfo>), ApiError> {
    let made = sessions::start(&state, req).await?;
    Ok((StatusCode::CREATED, Json(SessionInfo::of(&made))))
}

/// `GET /v1/sessions`.
pub async fn list(State(state): State<AppState>) -> Json<serde_json::Value> {
    let mut all: Vec<SessionInfo> = state
        .sessions()
        .list()
        .iter()
        .map(|e| SessionInfo::of(e))
        .collect();
    if let Some(dir) = state.state_dir() {
        all.extend(dir.list_paused().iter().map(SessionInfo::paused));
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
            .and_then(|d| d.paused(&id))
            .map(|p| Json(SessionInfo::paused(&p)))
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
    crate::api::check_relative("path", path)?;
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
    let data = crate::body::read_limited(req.into_body(), limit, timeout)
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
