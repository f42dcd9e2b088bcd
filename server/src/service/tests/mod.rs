//! The service through the test engine ([`crate::core::engine::fake`]): admission and
//! quotas, queueing, 409 and 410, cancel when the caller goes away, expiry and drain, with
//! no VM and no `/dev/kvm`. What only a real guest can prove is in `server/tests/`.
//!
//! These test several service modules together (a cell waits behind another, a drain
//! ends what the reaper would), so they live here rather than at the bottom of one file.
//! Every wait is bounded ([`until`]) and never stands for an assertion of speed.

mod drain;
mod jobs;
mod network;
mod owners;
mod programs;
mod queue;
mod runtimes;
mod sessions;
mod trace;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::core::config::{Config, Limits, SessionLimits};
use crate::core::engine::fake::FakeEngine;
use crate::core::state::{AppState, TemplateInfo};
use crate::service::files::JobFiles;
use crate::service::jobs::{ExecRequest, OneShot};
use crate::service::sessions::CreateSession;

/// Longest a test waits for something that must happen.
const PATIENCE: Duration = Duration::from_secs(10);

/// A server on a fake engine with `workers` job threads and room for `queue` more jobs.
fn server(workers: usize, queue: usize) -> (AppState, FakeEngine) {
    server_with(Config {
        workers,
        queue,
        // A batch must fit the capacity.
        limits: Limits {
            max_batch_jobs: workers + queue,
            ..Limits::default()
        },
        ..Config::default()
    })
}

/// A server on a fake engine, configured as `config` says.
fn server_with(config: Config) -> (AppState, FakeEngine) {
    server_on(config, FakeEngine::new())
}

/// A server on `engine`, configured as `config` says.
fn server_on(config: Config, engine: FakeEngine) -> (AppState, FakeEngine) {
    let state = AppState::new(config, None).expect("a state");
    let name = state.config().default_template().to_owned();
    assert!(state.set_engine(&name, Arc::new(engine.clone()), TemplateInfo::default()));
    (state, engine)
}

/// Limits with room for small test jobs.
fn limits() -> Limits {
    Limits::default()
}

fn sessions(f: impl FnOnce(&mut SessionLimits)) -> SessionLimits {
    let mut s = SessionLimits::default();
    f(&mut s);
    s
}

/// A one-shot job whose code is `code` (the fake engine's command).
fn job(code: &str) -> OneShot {
    OneShot {
        job: ExecRequest {
            code: Some(code.into()),
            ..ExecRequest::default()
        }
        .into_job(&limits(), "")
        .expect("a valid job"),
        template: None,
        runtime: None,
        files: JobFiles::default(),
        route: "/test".into(),
        network: None,
        trace: false,
    }
}

/// The same with a timeout.
fn job_with_timeout(code: &str, timeout: Duration) -> OneShot {
    let mut j = job(code);
    j.job.timeout = timeout;
    j
}

/// A cell whose code is `code`.
fn cell(code: &str) -> ExecRequest {
    ExecRequest {
        code: Some(code.into()),
        ..ExecRequest::default()
    }
}

/// A new session on the default template, its id.
async fn new_session(state: &AppState) -> String {
    crate::service::sessions::start_fresh(state, CreateSession::default())
        .await
        .expect("a session")
        .id
        .clone()
}

/// Waits until `cond` holds (at most [`PATIENCE`]: past that the test fails, saying what).
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Drops `state` once it is the last handle on its server (a job's closure on a job thread
/// lets go of its own clone just after its reply is sent), so the server is gone, its state
/// directory unlocked, when this returns: what a restart on the same directory needs.
async fn stopped(state: AppState) {
    until("the server's last handle is the test's", || {
        state.handles() == 1
    })
    .await;
    drop(state);
}

/// Runs one-shot job `code` with no sink.
async fn jobs_run(
    state: &AppState,
    code: &str,
) -> Result<crate::service::jobs::Ran, crate::service::error::Error> {
    crate::service::jobs::run(state, job(code), crate::service::task::no_sink()).await
}

/// A state directory of its own for one test (removed when dropped).
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("bud-fake-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
