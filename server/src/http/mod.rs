//! The HTTP edge: bud's own routes over the service, one file per feature, named as the
//! service's and the core's files are ([`exec`], [`sessions`], [`processes`],
//! [`contexts`], [`durable`], [`network`], [`node`], [`templates`], [`trace`]), and what every route shares: the
//! request body ([`body`]), errors as HTTP ([`error`]), streamed answers ([`stream`]), the
//! OpenAPI document ([`openapi`]), the API-key gate ([`KeyGate`]), the accept loop
//! ([`conn`]), HAProxy's agent check ([`agent`]) and startup ([`startup`]).
//!
//! It uses the service and the core, never the compat dialects: the crate's root
//! ([`crate::app`]) puts the dialects' routes beside these.

pub mod agent;
pub mod body;
pub mod conn;
pub mod contexts;
pub mod durable;
pub mod error;
pub mod jobs;
pub mod network;
pub mod node;
pub mod openapi;
pub mod processes;
pub mod sessions;
pub mod startup;
pub mod stream;
pub mod templates;
pub mod trace;

use std::future::Future;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};

use crate::core::state::AppState;
use crate::service;
use error::ApiError;

/// Every route and its method, as documented in the OpenAPI document.
pub const ROUTES: [(&str, &str); 58] = [
    ("post", "/v1/exec"),
    ("post", "/v1/exec/batch"),
    ("post", "/v1/exec/stream"),
    ("get", "/v1/health"),
    ("get", "/metrics"),
    ("get", "/v1/openapi.json"),
    ("get", "/v1/templates"),
    ("post", "/v1/templates"),
    ("get", "/v1/templates/{name}"),
    ("put", "/v1/templates/{name}"),
    ("delete", "/v1/templates/{name}"),
    ("get", "/v1/templates/{name}/build"),
    ("post", "/v1/sessions"),
    ("get", "/v1/sessions"),
    ("get", "/v1/sessions/{id}"),
    ("delete", "/v1/sessions/{id}"),
    ("post", "/v1/sessions/{id}/exec"),
    ("post", "/v1/sessions/{id}/exec/stream"),
    ("post", "/v1/sessions/{id}/fork"),
    ("get", "/v1/sessions/{id}/network"),
    ("put", "/v1/sessions/{id}/network"),
    ("get", "/v1/sessions/{id}/files"),
    ("put", "/v1/sessions/{id}/files/{path}"),
    ("get", "/v1/sessions/{id}/files/{path}"),
    ("delete", "/v1/sessions/{id}/files/{path}"),
    ("post", "/v1/sessions/{id}/processes"),
    ("get", "/v1/sessions/{id}/processes"),
    ("get", "/v1/sessions/{id}/processes/{pid}"),
    ("delete", "/v1/sessions/{id}/processes/{pid}"),
    ("get", "/v1/sessions/{id}/processes/{pid}/output"),
    ("post", "/v1/sessions/{id}/processes/{pid}/stdin"),
    ("post", "/v1/sessions/{id}/processes/{pid}/signal"),
    ("post", "/v1/sessions/{id}/processes/{pid}/resize"),
    ("post", "/v1/sessions/{id}/contexts"),
    ("get", "/v1/sessions/{id}/contexts"),
    ("post", "/v1/sessions/{id}/contexts/{context}/exec"),
    ("post", "/v1/sessions/{id}/contexts/{context}/restart"),
    ("delete", "/v1/sessions/{id}/contexts/{context}"),
    ("post", "/v1/sessions/{id}/watchers"),
    ("delete", "/v1/sessions/{id}/watchers/{wid}"),
    ("get", "/v1/sessions/{id}/watchers/{wid}/changes"),
    ("post", "/v1/sessions/{id}/pause"),
    ("post", "/v1/sessions/{id}/resume"),
    ("post", "/v1/sessions/{id}/snapshots"),
    ("get", "/v1/snapshots"),
    ("get", "/v1/snapshots/{id}"),
    ("delete", "/v1/snapshots/{id}"),
    ("get", "/v1/sessions/{id}/export"),
    ("get", "/v1/sessions/{id}/trace"),
    ("get", "/v1/sessions/{id}/trace/verify"),
    ("post", "/v1/sessions/{id}/trace/checkpoint"),
    ("get", "/v1/sessions/{id}/trace/otlp"),
    ("get", "/v1/sessions/{id}/trace.tar.gz"),
    ("get", "/v1/sessions/{id}/review"),
    ("get", "/v1/sessions/{id}/events"),
    ("post", "/v1/sessions/import"),
    ("post", "/v1/admin/drain"),
    ("post", "/v1/admin/undrain"),
];

/// bud's own routes (the native API), without their state: [`crate::app`] adds the
/// dialects' routes, the fallbacks and the layers.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/exec", post(jobs::exec))
        .route("/v1/exec/batch", post(jobs::batch))
        .route("/v1/exec/stream", post(stream::exec_stream))
        .route("/v1/health", get(node::health))
        .route("/metrics", get(node::metrics))
        .route("/v1/openapi.json", get(openapi::serve))
        .route(
            "/v1/templates",
            get(templates::list).post(templates::create),
        )
        .route(
            "/v1/templates/{name}",
            get(templates::get)
                .put(templates::add)
                .delete(templates::remove),
        )
        .route("/v1/templates/{name}/build", get(templates::build_log))
        .route("/v1/sessions", post(sessions::create).get(sessions::list))
        .route(
            "/v1/sessions/{id}",
            get(sessions::show).delete(sessions::delete),
        )
        .route("/v1/sessions/{id}/exec", post(sessions::exec))
        .route(
            "/v1/sessions/{id}/exec/stream",
            post(stream::session_stream),
        )
        .route("/v1/sessions/{id}/fork", post(sessions::fork))
        .route(
            "/v1/sessions/{id}/network",
            get(network::show).put(network::replace),
        )
        .route("/v1/sessions/{id}/files", get(sessions::list_files))
        .route(
            "/v1/sessions/{id}/files/{*path}",
            get(sessions::get_file)
                .put(sessions::put_file)
                .delete(sessions::delete_file),
        )
        .route(
            "/v1/sessions/{id}/processes",
            get(processes::list).post(processes::start),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}",
            get(processes::show).delete(processes::kill),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/output",
            get(processes::output),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/stdin",
            post(processes::stdin),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/signal",
            post(processes::signal),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/resize",
            post(processes::resize),
        )
        .route(
            "/v1/sessions/{id}/contexts",
            post(contexts::create).get(contexts::list),
        )
        .route(
            "/v1/sessions/{id}/contexts/{context}",
            delete(contexts::remove),
        )
        .route(
            "/v1/sessions/{id}/contexts/{context}/exec",
            post(contexts::exec),
        )
        .route(
            "/v1/sessions/{id}/contexts/{context}/restart",
            post(contexts::restart),
        )
        .route("/v1/sessions/{id}/watchers", post(processes::watch))
        .route(
            "/v1/sessions/{id}/watchers/{wid}",
            delete(processes::unwatch),
        )
        .route(
            "/v1/sessions/{id}/watchers/{wid}/changes",
            get(processes::changes),
        )
        .route("/v1/sessions/{id}/pause", post(durable::pause))
        .route("/v1/sessions/{id}/resume", post(durable::resume))
        .route("/v1/sessions/{id}/snapshots", post(durable::snapshot))
        .route("/v1/sessions/{id}/export", get(durable::export))
        .route("/v1/sessions/{id}/trace", get(trace::lines))
        .route("/v1/sessions/{id}/trace/verify", get(trace::verify))
        .route(
            "/v1/sessions/{id}/trace/checkpoint",
            post(trace::checkpoint),
        )
        .route("/v1/sessions/{id}/trace/otlp", get(trace::otlp))
        .route("/v1/sessions/{id}/trace.tar.gz", get(trace::packet))
        .route("/v1/sessions/{id}/review", get(trace::review))
        .route("/v1/sessions/{id}/events", get(trace::events))
        .route("/v1/sessions/import", post(durable::import))
        .route("/v1/snapshots", get(durable::list))
        .route(
            "/v1/snapshots/{id}",
            get(durable::show).delete(durable::delete),
        )
        .route("/v1/admin/drain", post(node::drain))
        .route("/v1/admin/undrain", post(node::undrain))
}

/// What the key middleware checks: the keys (None: the server is open), and the routes
/// that need none (the edge names them: health, and the compat dialects' routes that
/// carry a credential of their own).
#[derive(Debug, Clone)]
pub struct KeyGate {
    pub keys: Option<std::sync::Arc<crate::core::keys::ApiKeys>>,
    pub exempt: fn(&str) -> bool,
}

/// The key middleware: 401 unless the request presents a configured key ([`keys`]).
pub async fn require_key(State(gate): State<KeyGate>, req: Request, next: Next) -> Response {
    let Some(keys) = gate.keys.as_deref() else {
        return crate::core::audit::KEY.scope(None, next.run(req)).await;
    };
    let exempt = (gate.exempt)(req.uri().path());
    let name = crate::core::keys::presented(req.headers())
        .and_then(|k| keys.name_of(k).map(str::to_owned));
    if exempt || name.is_some() {
        // The key's name goes with the request, for the audit trail.
        return crate::core::audit::KEY.scope(name, next.run(req)).await;
    }
    ApiError::Unauthorized.into_response()
}

pub async fn count_responses(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    state.metrics().response(response.status().as_u16());
    response
}

/// Serves `app` (the router over `state`, [`crate::app`]) on `listener` until `shutdown` resolves; then stops accepting, waits for
/// every in-flight request (so every running job) to finish, and stops the job threads.
/// The listener's address is one no sandbox's network reaches
/// ([`crate::core::egress::listeners`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    state.egress_site().listeners.add(listener.local_addr()?);
    let reaper = tokio::spawn(service::lifecycle::reaper(state.clone()));
    let header_timeout = state.config().limits.header_timeout();
    // Once the shutdown starts, running and queued jobs get the grace period to finish;
    // then whatever is left is cancelled, so their requests end and the server stops.
    let (started, start) = tokio::sync::oneshot::channel::<()>();
    let grace = std::time::Duration::from_secs(state.config().shutdown_grace_s);
    let late = state.clone();
    let canceller = tokio::spawn(async move {
        if start.await.is_ok() {
            tokio::time::sleep(grace).await;
            let n = late.jobs().cancel_all();
            tracing::info!(
                jobs = n,
                "shutdown grace period over: cancelled what still ran"
            );
        }
    });
    let shutdown = async move {
        shutdown.await;
        let _ = started.send(());
    };
    conn::serve_connections(listener, app, header_timeout, shutdown).await;
    reaper.abort();
    if state.config().pause_on_shutdown && state.state_dir().is_some() {
        for (id, paused) in service::durable::pause_all(&state).await {
            match paused {
                Ok(p) => tracing::info!(session = %id, bytes = p.bytes, "paused at shutdown"),
                Err(err) => {
                    tracing::warn!(session = %id, error = %err, "could not pause at shutdown")
                }
            }
        }
    }
    // Every request has its answer; jobs of clients that left may still be queued.
    let drained = state.clone();
    tokio::task::spawn_blocking(move || {
        drained.drain();
        drained.sessions().end_all();
    })
    .await
    .map_err(std::io::Error::other)?;
    canceller.abort();
    Ok(())
}

#[cfg(test)]
mod tests;
