//! The templates over HTTP: `GET /v1/templates`.

use axum::Json;
use axum::extract::State;

use crate::core::state::AppState;

/// `GET /v1/templates`: the served templates, their state (`ready`, `building`, `failed`
/// with why), image size, packages and memory.
pub async fn list(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "templates": state.templates() }))
}
