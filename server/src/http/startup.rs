//! `bud serve` from start to stop: logging, the listener, the template, signals.
//!
//! The server listens first and prepares its templates on one thread of their own, the
//! default one first, then the others in the configured order (finding or building each
//! guest image, then loading or booting its template, all logged), so health answers
//! `starting` until the default one is ready and a template's jobs get 503 until it is. A
//! default template that cannot be prepared stops the server; another one is marked failed
//! (its requests get 503 saying why). Once every template is prepared the jail closes
//! ([`crate::core::jail`]; on by default), with one log line saying what is in force. SIGINT or
//! SIGTERM starts a graceful shutdown: no new connections, in-flight jobs finish and are
//! answered; a second signal exits at once.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tracing::{error, info, warn};
use vmm::devices::console::{ConsoleLine, EchoFn};

use crate::core::config::Config;
use crate::core::state::{AppState, Moment, StateError};
pub use crate::core::state::{SourceError, TemplateSource};
pub use crate::service::templates::{PrepareError, prepare};

/// Everything `bud serve` needs.
pub struct ServeOptions {
    pub listen: IpAddr,
    pub port: u16,
    pub config: Config,
    /// Where each template of `config.templates`, and each one added while the server
    /// runs, comes from (the `bud` binary passes `bud_templates::template`).
    pub template: TemplateSource,
    /// Who builds user templates (`POST /v1/templates`): the `bud` binary's helper process,
    /// started before the jail closes; `None`: the server builds none.
    pub builder: Option<Arc<dyn crate::core::builds::Builder>>,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("listen", &self.listen)
            .field("port", &self.port)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Why `bud serve` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serving: {0}")]
    Serve(std::io::Error),
    #[error(
        "bud serve without API keys listens on loopback only ({0} is not): give --api-keys-file"
    )]
    OpenBeyondLoopback(IpAddr),
    #[error("cannot start the template thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Prepare(#[from] Box<PrepareError>),
    #[error(transparent)]
    Jail(#[from] crate::core::jail::JailError),
}

/// Logs to stderr; `RUST_LOG` filters (default `info`). Does nothing if logging is set up.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// A console echo for a template boot, into the log (target `bud::guest_console`).
pub fn console_echo() -> EchoFn {
    Box::new(
        |line: &ConsoleLine| info!(target: "bud::guest_console", at_ms = line.at.as_millis() as u64, "{}", line.text),
    )
}

/// A guest build progress line, into the log (target `bud::guest_build`).
pub fn log_build_line(line: &str) {
    info!(target: "bud::guest_build", "{line}");
}

/// Reads `--egress-secrets` again at each SIGHUP (a file that does not parse leaves the
/// secrets held as they were). Watched only with the flag: without it SIGHUP ends the server,
/// as it always has.
fn reload_secrets_on_sighup(state: AppState) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            warn!("cannot watch SIGHUP: {e}; --egress-secrets is read at start only");
            return;
        }
    };
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            match state.egress_site().secrets.reload() {
                Ok(n) => info!(secrets = n, "SIGHUP: --egress-secrets read again"),
                Err(e) => warn!(
                    "SIGHUP: --egress-secrets not read again, the secrets held stay: {}",
                    crate::core::error_chain(&e)
                ),
            }
        }
    });
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            warn!("cannot watch SIGTERM: {e}");
            let _ = ctrl_c.await;
            return;
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}

/// Allocations at least this large get their own mapping (see [`return_large_buffers`]).
pub const MMAP_THRESHOLD: i32 = 128 << 10;

/// Makes glibc's malloc give large buffers back to the kernel when they are freed. The
/// server's large allocations are short-lived (a request body, a job's output, an answer's
/// JSON: up to tens of MiB each), and by default glibc raises its mmap threshold after the
/// first such buffer is freed and then serves the next ones from its arenas, which keep
/// the memory: measured, the server's own memory (outside guest RAM) went from 8 MiB to
/// 87 MiB after four 8 MiB outputs and a 20 MiB request, and stayed there. A fixed
/// threshold keeps every buffer from 128 KiB up in its own mapping, unmapped on free.
pub fn return_large_buffers() {
    // SAFETY: mallopt only sets allocator parameters; called before the runtime and the
    // job threads start, so no other thread is in malloc.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// What the server writes after the jail closes, which `--user` must own: the state
/// directory, and each served template's pin folder (made here if missing).
fn writable_after_jail(state: &AppState) -> Vec<std::path::PathBuf> {
    let mut paths: Vec<std::path::PathBuf> = state
        .ready_executors()
        .iter()
        .map(|(_, e)| e.template().dir().join(vmm::template::PINS_DIR))
        .filter(|pins| std::fs::create_dir_all(pins).is_ok())
        .collect();
    if let Some(dir) = state.state_dir() {
        paths.push(dir.root().to_owned());
    }
    paths
}

/// Runs `bud serve` until a signal (Ok) or a failure to prepare the template (Err).
pub fn run(opts: ServeOptions, app: fn(AppState) -> axum::Router) -> Result<(), ServeError> {
    if opts.config.api_keys.is_none() && !opts.listen.is_loopback() {
        return Err(ServeError::OpenBeyondLoopback(opts.listen));
    }
    return_large_buffers();
    let state = AppState::new(opts.config.clone(), None)?;
    // A jail that must close and cannot: say so now, not after minutes of template builds.
    if opts.config.jail.requires_seccomp() && opts.config.jail.seccomp {
        crate::core::jail::probe().map_err(crate::core::jail::JailError::from)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("bud-http")
        .build()
        .map_err(ServeError::Runtime)?;
    let failed: Arc<Mutex<Option<PrepareError>>> = Arc::default();
    runtime.block_on(async {
        let addr = SocketAddr::new(opts.listen, opts.port);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Bind { addr, source })?;
        let local = listener.local_addr().map_err(ServeError::Serve)?;
        info!(
            addr = %local,
            workers = opts.config.workers,
            queue = opts.config.queue,
            pool = opts.config.pool_size,
            node = state.node().id(),
            "listening"
        );
        for note in crate::http::node::host_notes() {
            warn!("{note}");
        }
        if let Some(intercept) = &state.egress_site().intercept {
            info!(ca = ?intercept, "TLS to hosts with rules is terminated with bud's egress CA");
            if intercept.system_roots() == 0 {
                warn!(
                    "the host's trust store gave no certificate: TLS to hosts with rules fails \
                     unless --egress-upstream-ca trusts them"
                );
            }
        }

        if let Some(port) = opts.config.cluster.agent_port {
            let addr = SocketAddr::new(opts.listen, port);
            let agent = TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind { addr, source })?;
            // Never reached from a sandbox, as the API's own listener is not (`http::serve`).
            state
                .egress_site()
                .listeners
                .add(agent.local_addr().map_err(ServeError::Serve)?);
            info!(addr = %addr, node = state.node().id(), "answering HAProxy's agent checks");
            tokio::spawn(crate::http::agent::serve(agent, state.clone()));
        }

        let (prep_done, prep_failed) = oneshot::channel::<()>();
        let prep_state = state.clone();
        let prep_config = opts.config.clone();
        let source = opts.template;
        state.set_template_source(source.clone());
        if let Some(builder) = opts.builder.clone() {
            state.set_builder(builder);
        }
        let prep_error = failed.clone();
        // Detached: a signal during a long guest build must not wait for it.
        std::thread::Builder::new()
            .name("bud-template".into())
            .spawn(move || {
                let default = prep_config.default_template().to_owned();
                let mut order = vec![default.clone()];
                order.extend(prep_config.templates.iter().filter(|t| **t != default).cloned());
                for name in order {
                    match prepare(&source, &name, Moment::Start, &prep_config) {
                        Ok((e, info)) => {
                            prep_state.set_template(&name, Arc::new(e), info);
                        }
                        Err(e) if name != default => {
                            error!(template = %name, "{}", crate::core::error_chain(&e));
                            prep_state.template_failed(&name, crate::core::error_chain(&e));
                        }
                        Err(e) => {
                            error!(template = %name, "{}", crate::core::error_chain(&e));
                            *prep_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                            let _ = prep_done.send(());
                            return;
                        }
                    }
                }
                // Every template is prepared: nothing needs root or execve any more.
                // Not while a template is added (loading one needs what the filters forbid);
                // none is added once they are on.
                prep_state.fix_templates_if(|| {
                    let writable = writable_after_jail(&prep_state);
                    // The state directory, written by the jailed server (`--user`): a folder
                    // it cannot reach is an error now, not a 500 at the first pause.
                    let closed = crate::core::jail::close(&prep_config.jail, &writable)
                        .map_err(PrepareError::from)
                        .and_then(|closed| match prep_state.state_dir() {
                            Some(dir) => dir
                                .probe_writable()
                                .map(|()| closed)
                                .map_err(PrepareError::from),
                            None => Ok(closed),
                        });
                    match closed {
                        Ok(closed) => {
                            if let crate::core::jail::Seccomp::Unavailable(why) = &closed.seccomp {
                                warn!("this host cannot install seccomp filters ({why}): running without the jail (--jail makes this an error)");
                            }
                            let line = closed.to_string();
                            let (seccomp, uid) = (closed.jailed(), closed.uid);
                            // Handed to the job threads before the line that says the jail is
                            // in force: /v1/health's `jailed` reads it, and a client that saw
                            // the line found `jailed: false` (tests/jail.rs, 1 run in ~6).
                            if let Some(f) = closed.job_filter {
                                prep_state.jobs().set_job_filter(f);
                            }
                            info!(seccomp, uid, "{line}");
                            seccomp
                        }
                        // The server stops; whether the filters are on or not, nothing is
                        // added meanwhile.
                        Err(e) => {
                            error!("{}", crate::core::error_chain(&e));
                            *prep_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                            let _ = prep_done.send(());
                            true
                        }
                    }
                });
            })
            .map_err(ServeError::Thread)?;

        if state.config().egress_secrets.is_some() {
            reload_secrets_on_sighup(state.clone());
        }
        let shutdown = async move {
            tokio::select! {
                _ = shutdown_signal() => info!("shutting down: finishing in-flight jobs (signal again to exit now)"),
                Ok(()) = prep_failed => info!("shutting down: the template could not be prepared"),
            }
            tokio::spawn(async {
                shutdown_signal().await;
                warn!("second signal: exiting now");
                std::process::exit(130);
            });
        };
        { let router = app(state.clone()); crate::http::serve(listener, state, router, shutdown) }
            .await
            .map_err(ServeError::Serve)?;
        info!("stopped");
        Ok::<(), ServeError>(())
    })?;
    // Do not wait for a template thread that may still be building.
    runtime.shutdown_background();
    match failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
        Some(e) => Err(Box::new(e).into()),
        None => Ok(()),
    }
}
