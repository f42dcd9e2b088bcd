//! bud's HTTP API over the `vmm` library: `bud serve`.
//!
//! [`app`] builds the axum [`Router`] over an [`AppState`] (tested without a socket through
//! `tower::ServiceExt::oneshot`); [`serve`] runs it on a listener until a shutdown future
//! resolves, then lets in-flight jobs finish; [`run`] is the whole `bud serve`.
//!
//! Three layers, each using only those below it (a test checks that no module imports
//! form a cycle, `tests/layers.rs`):
//! - **edge**: the native routes ([`routes`], [`session_routes`], [`stream`]), the compat
//!   dialects ([`compat`]: E2B, envd, Jupyter, Piston, with their own router state), the
//!   request body ([`body`]), errors as HTTP ([`error`]), the API shapes ([`api`]), the
//!   API-key gate ([`keys`]), the OpenAPI document ([`openapi`]), the accept loop
//!   ([`conn`]), startup ([`startup`]);
//! - **service** ([`service`]): what bud does, whoever asks: admission, jobs, sessions,
//!   files, templates, with its own error type;
//! - **core**: the data the service reads: [`state`] (configuration, templates,
//!   executors), [`sessions`] (the registry), [`jobs`] (the job threads), [`metrics`],
//!   [`audit`], [`config`], [`jail`], [`clock`]. The core names no dialect.
//!
//! KVM work never runs on the async runtime's threads: every job runs on a job thread
//! ([`jobs`]) behind a bounded admission counter ([`service::admission`]).

pub mod agent;
pub mod api;
pub mod audit;
pub mod body;
pub mod clock;
pub mod compat;
pub mod config;
pub mod conn;
pub mod context_routes;
pub mod contexts;
pub mod durable;
pub mod durable_routes;
pub mod error;
pub mod jail;
pub mod jobs;
pub mod keys;
pub mod metrics;
pub mod node;
pub mod node_routes;
pub mod openapi;
pub mod peer;
pub mod process_routes;
pub mod procs;
pub mod registry;
pub mod routes;
pub mod service;
pub mod session_keys;
pub mod session_routes;
pub mod sessions;
pub mod startup;
pub mod state;
pub mod stream;

use std::future::Future;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};

pub use config::{Config, Limits};
pub use error::ApiError;
pub use startup::{ServeOptions, TemplateSource, init_logging, run};
pub use state::AppState;

/// Every route and its method, as documented in the OpenAPI document.
pub const ROUTES: [(&str, &str); 44] = [
    ("post", "/v1/exec"),
    ("post", "/v1/exec/batch"),
    ("post", "/v1/exec/stream"),
    ("get", "/v1/health"),
    ("get", "/metrics"),
    ("get", "/v1/openapi.json"),
    ("get", "/v1/templates"),
    ("post", "/v1/sessions"),
    ("get", "/v1/sessions"),
    ("get", "/v1/sessions/{id}"),
    ("delete", "/v1/sessions/{id}"),
    ("post", "/v1/sessions/{id}/exec"),
    ("post", "/v1/sessions/{id}/exec/stream"),
    ("post", "/v1/sessions/{id}/fork"),
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
    ("post", "/v1/sessions/import"),
    ("post", "/v1/admin/drain"),
    ("post", "/v1/admin/undrain"),
];

/// An error and its sources, `a: b: c` (what a log line or an answer says of a failure
/// whose cause is a few sources deep: a template build, a call to another node).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The API's router over `state`.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/v1/exec", post(routes::exec))
        .route("/v1/exec/batch", post(routes::batch))
        .route("/v1/exec/stream", post(stream::exec_stream))
        .route("/v1/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/v1/openapi.json", get(routes::openapi))
        .route("/v1/templates", get(routes::templates))
        .route(
            "/v1/sessions",
            post(session_routes::create).get(session_routes::list),
        )
        .route(
            "/v1/sessions/{id}",
            get(session_routes::show).delete(session_routes::delete),
        )
        .route("/v1/sessions/{id}/exec", post(session_routes::exec))
        .route(
            "/v1/sessions/{id}/exec/stream",
            post(stream::session_stream),
        )
        .route("/v1/sessions/{id}/fork", post(session_routes::fork))
        .route("/v1/sessions/{id}/files", get(session_routes::list_files))
        .route(
            "/v1/sessions/{id}/files/{*path}",
            get(session_routes::get_file)
                .put(session_routes::put_file)
                .delete(session_routes::delete_file),
        )
        .route(
            "/v1/sessions/{id}/processes",
            get(process_routes::list).post(process_routes::start),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}",
            get(process_routes::show).delete(process_routes::kill),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/output",
            get(process_routes::output),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/stdin",
            post(process_routes::stdin),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/signal",
            post(process_routes::signal),
        )
        .route(
            "/v1/sessions/{id}/processes/{pid}/resize",
            post(process_routes::resize),
        )
        .route(
            "/v1/sessions/{id}/contexts",
            post(context_routes::create).get(context_routes::list),
        )
        .route(
            "/v1/sessions/{id}/contexts/{context}",
            delete(context_routes::remove),
        )
        .route(
            "/v1/sessions/{id}/contexts/{context}/exec",
            post(context_routes::exec),
        )
        .route(
            "/v1/sessions/{id}/contexts/{context}/restart",
            post(context_routes::restart),
        )
        .route("/v1/sessions/{id}/watchers", post(process_routes::watch))
        .route(
            "/v1/sessions/{id}/watchers/{wid}",
            delete(process_routes::unwatch),
        )
        .route(
            "/v1/sessions/{id}/watchers/{wid}/changes",
            get(process_routes::changes),
        )
        .route("/v1/sessions/{id}/pause", post(durable_routes::pause))
        .route("/v1/sessions/{id}/resume", post(durable_routes::resume))
        .route(
            "/v1/sessions/{id}/snapshots",
            post(durable_routes::snapshot),
        )
        .route("/v1/sessions/{id}/export", get(durable_routes::export))
        .route("/v1/sessions/import", post(durable_routes::import))
        .route("/v1/snapshots", get(durable_routes::list))
        .route(
            "/v1/snapshots/{id}",
            get(durable_routes::show).delete(durable_routes::delete),
        )
        .route("/v1/admin/drain", post(node_routes::drain))
        .route("/v1/admin/undrain", post(node_routes::undrain))
        .merge(compat::routes(state.clone()))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            node_routes::by_node,
        ))
        .layer(middleware::from_fn_with_state(
            KeyGate {
                keys: state.config().api_keys.clone(),
                exempt: |path| path == "/v1/health" || compat::exempt_from_keys(path),
            },
            require_key,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_responses,
        ))
        .with_state(state)
}

/// What the key middleware checks: the keys (None: the server is open), and the routes
/// that need none (the edge names them: health, and the compat dialects' routes that
/// carry a credential of their own).
#[derive(Debug, Clone)]
pub struct KeyGate {
    pub keys: Option<std::sync::Arc<keys::ApiKeys>>,
    pub exempt: fn(&str) -> bool,
}

/// The key middleware: 401 unless the request presents a configured key ([`keys`]).
pub async fn require_key(State(gate): State<KeyGate>, req: Request, next: Next) -> Response {
    let Some(keys) = gate.keys.as_deref() else {
        return crate::audit::KEY.scope(None, next.run(req)).await;
    };
    let exempt = (gate.exempt)(req.uri().path());
    let name = keys::presented(req.headers()).and_then(|k| keys.name_of(k).map(str::to_owned));
    if exempt || name.is_some() {
        // The key's name goes with the request, for the audit trail.
        return crate::audit::KEY.scope(name, next.run(req)).await;
    }
    ApiError::Unauthorized.into_response()
}

async fn count_responses(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    state.metrics().response(response.status().as_u16());
    response
}

/// Serves `state` on `listener` until `shutdown` resolves; then stops accepting, waits for
/// every in-flight request (so every running job) to finish, and stops the job threads.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let reaper = tokio::spawn(service::sessions::reaper(state.clone()));
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
    conn::serve_connections(listener, app(state.clone()), header_timeout, shutdown).await;
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
mod tests {
    //! The router without a socket or KVM: everything answered before a job would run.

    use super::*;
    use axum::body::Body;
    use axum::http::{Method, StatusCode, header};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    fn state() -> AppState {
        let config = Config {
            workers: 1,
            queue: 1,
            limits: Limits {
                max_batch_jobs: 2,
                max_body_bytes: 1000,
                ..Limits::default()
            },
            ..Config::default()
        };
        AppState::new(config, None).unwrap()
    }

    async fn send(
        method: Method,
        uri: &str,
        ctype: Option<&str>,
        body: &[u8],
    ) -> (StatusCode, Vec<(String, String)>, serde_json::Value) {
        let mut req = axum::http::Request::builder().method(method).uri(uri);
        if let Some(t) = ctype {
            req = req.header(header::CONTENT_TYPE, t);
        }
        let req = req.body(Body::from(body.to_vec())).unwrap();
        let resp = app(state()).oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp
            .headers()
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
            .collect();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (status, headers, json)
    }

    async fn post(uri: &str, body: &str) -> (StatusCode, serde_json::Value) {
        let (s, _, j) = send(Method::POST, uri, Some("application/json"), body.as_bytes()).await;
        (s, j)
    }

    #[tokio::test]
    async fn wrong_content_type_is_415() {
        let (status, _, body) = send(Method::POST, "/v1/exec", Some("text/plain"), b"{}").await;

        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(body["error"]["code"], "unsupported_media_type");
    }

    #[tokio::test]
    async fn malformed_json_is_400_invalid_json() {
        let (status, body) = post("/v1/exec", "{\"code\": \"print(1)\"").await;

        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["code"], "invalid_json");
    }

    #[tokio::test]
    async fn trailing_garbage_is_invalid_json_and_a_wrong_type_names_its_field() {
        let (garbage, g) = post("/v1/exec", r#"{"code": "print(1)"} {"code": "2"}"#).await;
        let (wrong, w) = post("/v1/exec", r#"{"code": "print(1)", "language": 1}"#).await;

        assert_eq!(garbage, StatusCode::BAD_REQUEST);
        assert_eq!(g["error"]["code"], "invalid_json");
        assert_eq!(wrong, StatusCode::BAD_REQUEST);
        assert_eq!(w["error"]["code"], "invalid_request");
        assert_eq!(w["error"]["field"], "language", "{w}");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_413() {
        let big = format!("{{\"code\": \"{}\"}}", "x".repeat(2000));

        let (status, body) = post("/v1/exec", &big).await;

        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(body["error"]["code"], "body_too_large");
    }

    #[tokio::test]
    async fn field_errors_name_the_field_before_readiness_is_checked() {
        let (timeout, t) = post("/v1/exec", r#"{"code": "x", "timeout_ms": 0}"#).await;
        let (language, l) = post("/v1/exec", r#"{"code": "x", "language": "cobol"}"#).await;
        let (batch, b) = post(
            "/v1/exec/batch",
            r#"{"jobs": [{"code": "x"}, {"code": "x"}, {"code": "x"}]}"#,
        )
        .await;
        let (empty, e) = post("/v1/exec/batch", r#"{"jobs": []}"#).await;

        assert_eq!(
            (timeout, &t["error"]["field"]),
            (StatusCode::BAD_REQUEST, &"timeout_ms".into())
        );
        assert_eq!(
            (language, &l["error"]["field"]),
            (StatusCode::BAD_REQUEST, &"language".into())
        );
        assert_eq!(
            (batch, &b["error"]["code"]),
            (StatusCode::PAYLOAD_TOO_LARGE, &"too_many".into())
        );
        assert_eq!(
            (empty, &e["error"]["field"]),
            (StatusCode::BAD_REQUEST, &"jobs".into())
        );
    }

    #[tokio::test]
    async fn jobs_before_the_template_is_ready_get_503_with_retry_after() {
        let (status, headers, body) = send(
            Method::POST,
            "/v1/exec/stream",
            Some("application/json"),
            br#"{"code": "x"}"#,
        )
        .await;

        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            headers.iter().any(|(k, v)| k == "retry-after" && v == "1"),
            "{headers:?}"
        );
        assert_eq!(body["error"]["code"], "not_ready");
    }

    #[tokio::test]
    async fn health_says_starting_with_503_until_the_template_is_ready() {
        let (status, _, body) = send(Method::GET, "/v1/health", None, b"").await;

        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["status"], "starting");
        assert_eq!(body["template_ready"], false);
        assert_eq!(body["version"], env!("CARGO_PKG_VERSION"));
    }

    #[tokio::test]
    async fn unknown_routes_and_methods_get_json_errors() {
        let (missing, _, m) = send(Method::GET, "/v2/nothing", None, b"").await;
        let (method, _, w) = send(Method::GET, "/v1/exec", None, b"").await;

        assert_eq!(
            (missing, &m["error"]["code"]),
            (StatusCode::NOT_FOUND, &"not_found".into())
        );
        assert_eq!(
            (method, &w["error"]["code"]),
            (StatusCode::METHOD_NOT_ALLOWED, &"method_not_allowed".into())
        );
    }

    #[tokio::test]
    async fn every_documented_route_is_routed() {
        let (_, _, doc) = send(Method::GET, "/v1/openapi.json", None, b"").await;

        for (method, path) in ROUTES {
            assert!(
                doc["paths"][path][method].is_object(),
                "{method} {path} undocumented"
            );
            let m = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            let uri = path.replace("{id}", "ses_x").replace("{path}", "f.txt");
            let (status, _, body) = send(m, &uri, Some("application/json"), b"{}").await;
            // A session route answers 404 for an unknown session, but never the router's.
            assert_ne!(body["error"]["code"], "not_found", "{method} {path}");
            assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        }
    }

    #[tokio::test]
    async fn metrics_are_prometheus_text() {
        let req = axum::http::Request::get("/metrics")
            .body(Body::empty())
            .unwrap();

        let resp = app(state()).oneshot(req).await.unwrap();
        let ctype = resp.headers()[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_string();
        let text = String::from_utf8(
            resp.into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
        .unwrap();

        assert!(ctype.starts_with("text/plain; version=0.0.4"));
        assert!(text.contains("# TYPE bud_job_total_seconds histogram"));
        assert!(text.contains("bud_template_ready 0\n"));
    }
}
