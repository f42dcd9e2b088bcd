//! The templates over HTTP: `GET /v1/templates` and `GET /v1/templates/{name}`; `POST
//! /v1/templates`, which builds a user template from its definition, and `GET
//! /v1/templates/{name}/build`, its build's log as NDJSON; `PUT` and `DELETE
//! /v1/templates/{name}`, which add a built template to the running server and remove one
//! (`crate::service::templates` and `crate::service::builds` decide).

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::stream;

use crate::core::builds::{Build, BuildState};
use crate::core::state::{AppState, TemplateStatus};
use crate::http::body::JsonBody;
use crate::http::error::ApiError;
use crate::service::builds::{self, Found};
use crate::service::templates::{self, Added};

/// `GET /v1/templates`: the served templates the caller may see (with API keys: the
/// built-in ones and its key's own), their state (`ready`, `building`, `failed`
/// with why), image size, packages and memory, and from their manifests their runtimes,
/// kernels, tools and network.
pub async fn list(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "templates": templates::visible_templates(&state) }))
}

/// `GET /v1/templates/{name}`: one served template's entry, with its last build's state
/// when it was built here; a template whose build failed answers its build (`failed`,
/// `error`); 404 otherwise.
pub async fn get(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    match builds::find(&state, &name)? {
        Found::Served(t, build) => {
            let mut entry = serde_json::to_value(&t).unwrap_or_default();
            if let (Some(b), Some(object)) = (build, entry.as_object_mut()) {
                object.insert("build".into(), build_summary(&b));
            }
            Ok(Json(entry))
        }
        Found::Built(b) => Ok(Json(serde_json::json!({
            "name": name,
            "status": state_name(&b.state()),
            "error": match b.state() { BuildState::Failed(why) => Some(why), _ => None },
            "build": build_summary(&b),
        }))),
    }
}

fn state_name(state: &BuildState) -> &'static str {
    match state {
        BuildState::Building => "building",
        BuildState::Ready => "ready",
        BuildState::Failed(_) => "failed",
    }
}

fn build_summary(build: &Build) -> serde_json::Value {
    serde_json::json!({
        "status": state_name(&build.state()),
        "seconds": build.seconds(),
        "log": format!("/v1/templates/{}/build", build.name),
    })
}

/// `POST /v1/templates`: a user template's definition (docs/templates.md). 201 with the
/// template's entry, `building`; its build's log at `GET /v1/templates/{name}/build`.
pub async fn create(
    State(state): State<AppState>,
    JsonBody(definition): JsonBody<serde_json::Value>,
) -> Result<Response, ApiError> {
    let (status, _build) = builds::create(&state, definition)?;
    let location = format!("/v1/templates/{}", status.name);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json::<TemplateStatus>(status),
    )
        .into_response())
}

/// `GET /v1/templates/{name}/build`: the build's log as NDJSON, one `{"t_s", "line"}` per
/// line from its start, following it live, then `{"status": "ready"}` or `{"status":
/// "failed", "error"}` as the last line.
pub async fn build_log(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let build = builds::build_of(&state, &name)?;
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(log_lines(build)),
    )
        .into_response())
}

fn ndjson(value: &serde_json::Value) -> Bytes {
    let mut text = value.to_string();
    text.push('\n');
    Bytes::from(text)
}

/// The lines of a build's log (module docs), ending with its end.
fn log_lines(build: Arc<Build>) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> {
    let watch = build.watch();
    stream::unfold(
        (build, watch, 0usize, false),
        |(build, mut watch, next, ended)| async move {
            if ended {
                return None;
            }
            loop {
                // Marked seen before reading, so a change after the read wakes the wait.
                watch.borrow_and_update();
                let (lines, over, total) = build.since(next);
                if !lines.is_empty() {
                    let text: String = lines
                        .iter()
                        .map(|l| {
                            let mut s = serde_json::to_string(l).unwrap_or_default();
                            s.push('\n');
                            s
                        })
                        .collect();
                    return Some((Ok(Bytes::from(text)), (build, watch, total, false)));
                }
                if let Some(state) = over {
                    let last = match state {
                        BuildState::Failed(why) => {
                            serde_json::json!({"status": "failed", "error": why})
                        }
                        other => {
                            serde_json::json!({"status": state_name(&other), "seconds": build.seconds()})
                        }
                    };
                    return Some((Ok(ndjson(&last)), (build, watch, total, true)));
                }
                if watch.changed().await.is_err() {
                    return None;
                }
            }
        },
    )
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
