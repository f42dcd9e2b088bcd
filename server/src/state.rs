//! What every handler shares: the configuration, the executor (once the template is ready),
//! the job threads and the metrics.
//!
//! The server answers before the template exists (health says `starting`, jobs get 503 with
//! `Retry-After`); [`AppState::set_executor`] makes it ready.

use std::sync::{Arc, OnceLock};

use vmm::Executor;

use crate::api::Health;
use crate::config::{Config, ConfigError};
use crate::error::ApiError;
use crate::jobs::{AdmitError, JobThreads, Slot};
use crate::metrics::{Gauges, Metrics, Rejection};

#[derive(Debug)]
struct Shared {
    config: Config,
    executor: OnceLock<Arc<Executor>>,
    jobs: JobThreads,
    metrics: Arc<Metrics>,
    sessions: Arc<crate::sessions::Sessions>,
}

/// Cheap to clone: one `Arc`.
#[derive(Debug, Clone)]
pub struct AppState(Arc<Shared>);

/// Why a state could not be made.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    #[error("cannot start the job threads: {0}")]
    Threads(std::io::Error),
}

impl AppState {
    /// A state with its job threads running; ready for jobs once it has an executor.
    pub fn new(config: Config, executor: Option<Arc<Executor>>) -> Result<Self, StateError> {
        config.validate()?;
        let jobs =
            JobThreads::start(config.workers, config.capacity()).map_err(StateError::Threads)?;
        let slot = OnceLock::new();
        if let Some(e) = executor {
            let _ = slot.set(e);
        }
        Ok(Self(Arc::new(Shared {
            config,
            executor: slot,
            jobs,
            metrics: Arc::default(),
            sessions: Arc::default(),
        })))
    }

    pub fn config(&self) -> &Config {
        &self.0.config
    }

    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// The metrics, to record from a job thread.
    pub fn metrics_handle(&self) -> Arc<Metrics> {
        self.0.metrics.clone()
    }

    /// The live sessions.
    pub fn sessions(&self) -> &Arc<crate::sessions::Sessions> {
        &self.0.sessions
    }

    pub fn jobs(&self) -> &JobThreads {
        &self.0.jobs
    }

    /// Makes the server ready. Returns `false` (and drops `e`) if it already had one.
    pub fn set_executor(&self, e: Arc<Executor>) -> bool {
        self.0.executor.set(e).is_ok()
    }

    /// The executor, or 503 while the template is not ready.
    pub fn executor(&self) -> Result<Arc<Executor>, ApiError> {
        self.0.executor.get().cloned().ok_or_else(|| {
            self.metrics().rejected(Rejection::NotReady);
            ApiError::NotReady {
                retry_after: self.config().retry_after(),
            }
        })
    }

    /// The executor if the template is ready (no rejection counted).
    pub fn executor_if_ready(&self) -> Option<Arc<Executor>> {
        self.0.executor.get().cloned()
    }

    /// `n` admission slots, or 429 (full) / 503 (shutting down).
    pub fn admit(&self, n: usize) -> Result<Vec<Slot>, ApiError> {
        self.0.jobs.admit(n).map_err(|e| self.admit_error(e))
    }

    /// Runs `work` on a job thread in `slot`.
    pub fn spawn(&self, slot: Slot, work: impl FnOnce() + Send + 'static) -> Result<(), ApiError> {
        self.0
            .jobs
            .spawn(slot, work)
            .map_err(|e| self.admit_error(e))
    }

    fn admit_error(&self, e: AdmitError) -> ApiError {
        match e {
            AdmitError::Full(capacity) => {
                self.metrics().rejected(Rejection::Overloaded);
                ApiError::Overloaded {
                    capacity,
                    retry_after: self.config().retry_after(),
                }
            }
            AdmitError::Closed => {
                self.metrics().rejected(Rejection::ShuttingDown);
                ApiError::ShuttingDown
            }
        }
    }

    /// Stops admitting jobs and waits for the job threads to finish what they hold.
    pub fn drain(&self) {
        self.0.jobs.join();
    }

    pub fn gauges(&self) -> Gauges {
        let stats = self.0.executor.get().map(|e| e.stats());
        Gauges {
            workers: self.config().workers,
            queue_capacity: self.0.jobs.capacity(),
            jobs_running: self.0.jobs.running(),
            jobs_queued: self.0.jobs.queued(),
            pool_size: stats.map_or(self.config().pool_size, |s| s.pool_size),
            pool_ready: stats.map_or(0, |s| s.ready),
            live_clones: stats.map_or(0, |s| s.live),
            warm_vms: stats.map_or(0, |s| s.warm),
            template_ready: stats.is_some(),
            executor: stats.unwrap_or_default(),
            sessions: self.0.sessions.gauges(),
        }
    }

    pub fn health(&self) -> Health {
        let g = self.gauges();
        let template = self.0.executor.get().and_then(|e| {
            e.template()
                .dir()
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        });
        Health {
            status: if g.template_ready { "ok" } else { "starting" }.into(),
            template_ready: g.template_ready,
            template,
            version: env!("CARGO_PKG_VERSION").into(),
            host_kind: vmm::HostKind::detect().name().into(),
            workers: g.workers,
            queue_capacity: g.queue_capacity,
            jobs_running: g.jobs_running,
            jobs_queued: g.jobs_queued,
            pool_size: g.pool_size,
            pool_ready: g.pool_ready,
            live_clones: g.live_clones,
            warm_vms: g.warm_vms,
            reuse: match self.config().reuse {
                vmm::Reuse::Warm => "warm",
                vmm::Reuse::Fresh => "fresh",
            }
            .into(),
        }
    }
}
