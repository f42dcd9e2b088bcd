//! Other sandboxes' client protocols over bud's own service, so that existing clients
//! switch to bud by changing a URL:
//! - [`e2b`]: E2B's control plane (sandboxes), over bud sessions;
//! - [`jupyter`]: E2B's code-interpreter API (`/execute`, `/contexts`), over session cells;
//! - [`envd`]: E2B's in-sandbox daemon (commands over the Connect protocol, filesystem RPCs,
//!   `/files`), over shell cells and file operations;
//! - [`piston`]: Piston's v2 API, over one-shot jobs.
//!
//! Every route here is an adapter over [`crate::service`]: the same checks, limits and
//! admission as the native API, and the same API-key check ([`crate::core::keys`]). What only a
//! dialect knows (E2B's sandboxes and contexts, Piston's runtimes) lives in [`Compat`], this
//! layer's own router state; the core knows nothing of it. E2B's in-sandbox routes (envd
//! and the code interpreter) are found by the `E2b-Sandbox-Id` header, as E2B's own proxy
//! finds them, and need the sandbox's access token when keys are configured.

pub mod e2b;
pub mod envd;
pub mod jupyter;
pub mod piston;

use std::sync::Arc;

use axum::Router;
use axum::routing::{delete, get, post, put};

use crate::core::state::AppState;

/// What the compat layers keep between requests.
#[derive(Debug, Default)]
pub struct CompatState {
    /// E2B sandboxes: their bud session and what E2B clients know of them.
    pub e2b: e2b::Registry,
}

/// The compat routes' state: the server's, and this layer's own.
#[derive(Debug, Clone)]
pub struct Compat {
    pub app: AppState,
    pub own: Arc<CompatState>,
}

/// Whether `path` is a compat route that carries a credential of its own instead of an
/// API key (E2B's in-sandbox routes: [`e2b::is_sandbox_route`]).
pub fn exempt_from_keys(path: &str) -> bool {
    e2b::is_sandbox_route(path)
}

/// The compat routes over `app`, to merge into the API's router.
pub fn routes<S: Clone + Send + Sync + 'static>(app: AppState) -> Router<S> {
    app.add_attachment_rules(Arc::new(e2b::RecordRules));
    let compat = Compat {
        app,
        own: Arc::default(),
    };
    e2b::cluster::start_publisher(&compat);
    let mut r = Router::new();
    for prefix in ["/api/v2", "/api/v2/piston"] {
        for slash in ["", "/"] {
            r = r
                .route(&format!("{prefix}/runtimes{slash}"), get(piston::runtimes))
                .route(&format!("{prefix}/execute{slash}"), post(piston::execute));
        }
    }
    r.route("/v2/sandboxes", post(e2b::create).get(e2b::control::list))
        .route("/sandboxes", post(e2b::create_v1).get(e2b::control::list))
        .route("/sandboxes/{id}", delete(e2b::kill).get(e2b::info))
        .route("/sandboxes/{id}/metrics", get(e2b::control::metrics))
        .route("/sandboxes/{id}/fork", post(e2b::control::fork))
        .route("/v2/sandboxes/{id}/connect", post(e2b::lifecycle::connect))
        .route("/sandboxes/{id}/connect", post(e2b::lifecycle::connect))
        .route("/sandboxes/{id}/resume", post(e2b::lifecycle::connect))
        .route("/sandboxes/{id}/pause", post(e2b::lifecycle::pause))
        .route("/sandboxes/{id}/snapshots", post(e2b::lifecycle::snapshot))
        .route("/snapshots", get(e2b::lifecycle::list_snapshots))
        .route("/templates/{id}", delete(e2b::lifecycle::delete_snapshot))
        .route("/sandboxes/{id}/timeout", post(e2b::set_timeout))
        .route("/sandboxes/{id}/network", put(e2b::network::update))
        .route("/execute", post(jupyter::execute))
        .route(
            "/contexts",
            post(jupyter::create_context).get(jupyter::list_contexts),
        )
        .route("/contexts/{id}", delete(jupyter::remove_context))
        .route("/contexts/{id}/restart", post(jupyter::restart_context))
        .route("/health", get(envd::health))
        .route("/files", get(envd::read_file).post(envd::write_files))
        .route("/process.Process/{method}", post(envd::process))
        .route("/filesystem.Filesystem/{method}", post(envd::filesystem))
        .route_layer(axum::middleware::from_fn_with_state(
            compat.clone(),
            e2b::lifecycle::auto_resume,
        ))
        .with_state(compat)
}
