//! The durable-session API's handlers: pause and resume a session, take a snapshot of one,
//! list, show and delete snapshots (a session starts from one with `POST /v1/sessions`
//! `{"snapshot": ID}`). Thin adapters over [`crate::service::durable`]. Without a state
//! directory every one of them is 501 `no_state_dir`.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use crate::api::SessionInfo;
use crate::api::sessions::{PauseResponse, SnapshotInfo};
use crate::error::{ApiError, Error};
use crate::service::durable;
use crate::state::AppState;

/// `POST /v1/sessions/{id}/pause`: 200 with what was written; 409 `session_paused` if it
/// is paused already.
pub async fn pause(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<PauseResponse>, ApiError> {
    Ok(Json(durable::pause(&state, &id).await?))
}

/// `POST /v1/sessions/{id}/resume`: 200 with the running session (at once if it runs).
pub async fn resume(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SessionInfo>, ApiError> {
    let e = durable::resume(&state, &id).await?;
    Ok(Json(SessionInfo::of(&e)))
}

/// `POST /v1/sessions/{id}/snapshots`: 201 with the snapshot; the session goes on.
pub async fn snapshot(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<SnapshotInfo>), ApiError> {
    let s = durable::snapshot(&state, &id).await?;
    Ok((StatusCode::CREATED, Json(SnapshotInfo::of(&s))))
}

/// `GET /v1/snapshots`.
pub async fn list(State(state): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    let dir = state.state_dir().ok_or(Error::NoStateDir)?;
    let all: Vec<SnapshotInfo> = dir.list_snapshots().iter().map(SnapshotInfo::of).collect();
    Ok(Json(serde_json::json!({ "snapshots": all })))
}

/// `GET /v1/snapshots/{id}`.
pub async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SnapshotInfo>, ApiError> {
    let dir = state.state_dir().ok_or(Error::NoStateDir)?;
    let s = dir.snapshot(&id).ok_or(Error::NoSnapshot(id))?;
    Ok(Json(SnapshotInfo::of(&s)))
}

/// `DELETE /v1/snapshots/{id}`: 204; sessions started from it go on.
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    durable::delete_snapshot(&state, &id)?;
    Ok(StatusCode::NO_CONTENT)
}
