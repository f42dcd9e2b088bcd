//! The templates over HTTP: `GET /v1/templates`, and `PUT` and `DELETE
//! /v1/templates/{name}`, which add a template to the running server and remove one
//! (`crate::service::templates` decides).

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use crate::core::state::{AppState, TemplateStatus};
use crate::http::error::ApiError;
use crate::service::templates::{self, Added};

/// `GET /v1/templates`: the served templates, their state (`ready`, `building`, `failed`
/// with why), image size, packages and memory, and from their manifests their runtimes,
/// kernels, tools and network.
pub async fn list(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "templates": state.templates() }))
}

/// `PUT /v1/templates/{name}`: serves a template whose guest is built, without a restart.
/// 201 with its entry once it is ready, 200 if it was served already.
pub async fn add(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<(StatusCode, Json<TemplateStatus>), ApiError> {
    Ok(match templates::add(&state, &name).await? {
        Added::Now(t) => (StatusCode::CREATED, Json(t)),
        Added::Already(t) => (StatusCode::OK, Json(t)),
    })
}

/// `DELETE /v1/templates/{name}`: 204 once it is no longer served.
pub async fn remove(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    templates::remove(&state, &name)?;
    Ok(StatusCode::NO_CONTENT)
}
