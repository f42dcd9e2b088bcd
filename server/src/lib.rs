//! bud's HTTP API over the `vmm` library: `bud serve`.
//!
//! [`app`] builds the axum [`Router`] over an [`AppState`] (tested without a socket through
//! `tower::ServiceExt::oneshot`); [`serve`] runs it on a listener until a shutdown future
//! resolves, then lets in-flight jobs finish; [`run`] is the whole `bud serve`.
//!
//! Four layers, one folder each, each using only those below it (`tests/layers.rs` reads
//! the layer of a file from its path and fails on an import that points up or a cycle):
//! - [`core`]: the data the service reads (configuration, state, sessions, job threads,
//!   durable state, audit, metrics, keys, jail, node, clock); names no dialect;
//! - [`service`]: what bud does, whoever asks: admission, jobs, sessions, processes,
//!   contexts, files, durable sessions, drain, templates; its own input and output types
//!   and its own error type;
//! - [`http`]: bud's own routes, bodies, errors as HTTP, streaming, the OpenAPI document,
//!   the accept loop, startup;
//! - [`compat`]: the dialects (E2B, envd, Jupyter, Piston), adapters over the service
//!   that share the edge's bodies and errors.
//!
//! This file, the root, only puts them together.
//!
//! KVM work never runs on the async runtime's threads: every job runs on a job thread
//! ([`core::jobs`]) behind a bounded admission counter ([`service::admission`]).

pub mod compat;
pub mod core;
pub mod http;
pub mod service;

use std::future::Future;

use axum::Router;
use axum::middleware;

pub use crate::core::config::{Config, Limits};
pub use crate::core::error_chain;
pub use crate::core::state::AppState;
pub use crate::http::error::ApiError;
pub use crate::http::startup::{ServeOptions, TemplateSource, init_logging};
pub use crate::http::{KeyGate, ROUTES, require_key};

/// Where every dialect's requests name a sandbox, E2B's first (its header wins over a
/// path), for the node's routing and for a router in front (`bud routes`).
pub const SANDBOX_PLACES: &[http::node::SandboxPlaces] =
    &[compat::e2b::SANDBOX_PLACES, http::node::NATIVE];

/// The API's router over `state`: bud's own routes and the dialects', behind the node's
/// routing, the API-key gate and the response counter.
pub fn app(state: AppState) -> Router {
    http::routes()
        .merge(compat::routes(state.clone()))
        .fallback(http::error::not_found)
        .method_not_allowed_fallback(http::error::method_not_allowed)
        .layer(middleware::from_fn_with_state(
            http::node::Routing {
                state: state.clone(),
                dialects: SANDBOX_PLACES,
            },
            http::node::by_node,
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
            http::count_responses,
        ))
        .with_state(state)
}

/// Serves [`app`] over `state` on `listener` until `shutdown` resolves ([`http::serve`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = app(state.clone());
    http::serve(listener, state, router, shutdown).await
}

/// The whole `bud serve` ([`http::startup::run`] over [`app`]).
pub fn run(opts: ServeOptions) -> Result<(), http::startup::ServeError> {
    http::startup::run(opts, app)
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
        // A runtime is the template's (its manifest's): not known before it is ready.
        assert_eq!(
            (language, &l["error"]["code"]),
            (StatusCode::SERVICE_UNAVAILABLE, &"not_ready".into())
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

    #[test]
    fn haproxys_sandbox_places_are_the_servers() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/haproxy/sandbox-places"
        );
        let file = std::fs::read_to_string(path).unwrap();
        let lines: Vec<&str> = file
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .collect();

        assert_eq!(lines, http::node::sandbox_places(SANDBOX_PLACES));
    }

    #[test]
    fn the_kubernetes_front_reads_every_sandbox_place() {
        // The ConfigMap's haproxy.cfg is written by hand (it reads node addresses from the
        // ids, unlike gen-config.sh's fixed node list): each place must be in its rules.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/k8s/front-config.yaml"
        );
        let yaml = std::fs::read_to_string(path).unwrap();
        let rules: Vec<&str> = yaml
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("http-request") || l.starts_with("acl"))
            .collect();
        let has = |needle: &str| rules.iter().any(|r| r.contains(needle));
        let token = |t: &str| rules.iter().any(|r| r.split_whitespace().any(|w| w == t));

        let missing: Vec<String> = http::node::sandbox_places(SANDBOX_PLACES)
            .into_iter()
            .filter(|line| {
                let parts: Vec<&str> = line.split(' ').collect();
                !match parts.as_slice() {
                    ["header", h] => has(&format!("req.hdr({h})")),
                    ["prefix", p] => token(p),
                    ["host", _] => has("req.hdr(host)"),
                    ["create", p, f] => token(p) && has(&format!("$.{f}")),
                    _ => false,
                }
            })
            .collect();

        assert_eq!(missing, Vec::<String>::new());
    }
}
