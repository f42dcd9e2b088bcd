//! A session's network over HTTP: `GET /v1/sessions/{id}/network` (its policy and the
//! record of what its guest resolved and connected to) and `PUT` (a new policy, in force
//! for the connections it opens from then on). The service decides ([`network`]).

use axum::Json;
use axum::extract::{Path, State};

use crate::core::egress::PolicySpec;
use crate::core::state::AppState;
use crate::http::body::JsonBody;
use crate::http::error::ApiError;
use crate::service::network::{self, NetworkView};

/// `GET /v1/sessions/{id}/network`.
pub async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<NetworkView>, ApiError> {
    Ok(Json(network::get(&state, &id)?))
}

/// `PUT /v1/sessions/{id}/network` with `{"allow_out": [...], "deny_out": [...]}`.
pub async fn replace(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(spec): JsonBody<PolicySpec>,
) -> Result<Json<NetworkView>, ApiError> {
    Ok(Json(network::put(&state, &id, &spec)?))
}
