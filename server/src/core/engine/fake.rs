//! The test engine: no VM, no `/dev/kvm`; it does what a job's code tells it, so a test
//! of the service says in its request what the "guest" does.
//!
//! A job's or cell's code (its first word, and what follows):
//! - `exit N`: ends with status `error` and exit code N;
//! - `crash`: the guest crashed (`crashed`; a session's VM is unusable after it);
//! - `hang`: runs until it is cancelled or its timeout, then stops within the grace
//!   (`cancelled` / `timeout`; a session goes on);
//! - `hang-hard`: the same, but does not stop within the grace (its session is over);
//! - `wait NAME`: runs until the test opens gate NAME ([`FakeEngine::open`]), then answers;
//! - anything else: answers `ok` with the code as its stdout (streamed as it "runs").
//!
//! Its template is bud's python template (runtimes `python` and `shell`), or with
//! [`FakeEngine::with_node`] the node template's (and `javascript`, a kernel runtime); it
//! records the worker mode each job and cell ran in ([`FakeEngine::languages`]), and each
//! session cell's mode and options: namespace, reset, directory ([`FakeEngine::cells`]).
//!
//! The engine itself can hold starts back ([`FakeEngine::hold_starts`]: a slow start that
//! ends when [`FakeEngine::release_starts`] is called), fail them, and says what it did
//! ([`FakeEngine::counts`]).
//!
//! Compiled for the unit tests, and for other crates' tests with the `fake-engine` feature;
//! never in a served binary.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm::executor::{Executor, ExecutorStats};
use vmm::job::{JobTimings, Stream};
use vmm::session::{ForkStats, Session, SessionError};
use vmm::{Cancel, CellOptions, ExecError, Health, Job, JobResult, Language, Status, Unusable};

use super::{Deliver, Engine, LayerShare, Output, SessionVm};

/// How often a hanging job looks at its cancel.
const HANG_POLL: Duration = Duration::from_millis(1);

/// What a [`FakeEngine`] did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// One-shot jobs it ran.
    pub jobs: usize,
    /// Session VMs it started (forks not counted).
    pub started: usize,
    /// Session VMs ended (by [`SessionVm::end`]).
    pub ended: usize,
    /// Jobs and cells running now.
    pub running: usize,
    /// Session VMs given an egress (a network gate).
    pub egress_given: usize,
}

#[derive(Debug, Default)]
struct Inner {
    jobs: AtomicUsize,
    started: AtomicUsize,
    ended: AtomicUsize,
    running: AtomicUsize,
    egress_given: AtomicUsize,
    vm_bytes: AtomicU64,
    /// What the fake template offers: python and shell, as bud's python template.
    manifest: FakeManifest,
    /// The worker mode of each job and cell it ran, in order.
    languages: Mutex<Vec<Language>>,
    /// The kernel dialect of each job and cell it ran, in order.
    dialects: Mutex<Vec<u32>>,
    /// The worker mode and options of each session cell it ran, in order.
    cells: Mutex<Vec<(Language, CellOptions)>>,
    /// Open gates, starts held, a start's failure.
    state: Mutex<Gates>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Gates {
    open: HashSet<String>,
    starts_held: bool,
    start_fails: Option<String>,
}

impl Inner {
    fn gates(&self) -> MutexGuard<'_, Gates> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The test engine (module docs). Cheap to clone: the clones are one engine.
#[derive(Debug, Clone, Default)]
pub struct FakeEngine(Arc<Inner>);

impl FakeEngine {
    pub fn new() -> Self {
        Self::default()
    }

    /// A fake template with a network card (its manifest says so).
    pub fn with_card() -> Self {
        let mut manifest = FakeManifest::default();
        manifest.0.network = ::vmm::manifest::Network::Card;
        Self(Arc::new(Inner {
            manifest,
            ..Inner::default()
        }))
    }

    /// A fake template with a JavaScript kernel runtime too (`javascript`, aliases `js` and
    /// `node`, run as [`Language::Kernel`]) and its TypeScript dialect (`typescript`, alias
    /// `ts`, dialect 1), as bud's node template: javascript (its default), python, shell,
    /// typescript.
    pub fn with_node() -> Self {
        let mut manifest = FakeManifest::default();
        manifest.0.name = "fake-node".to_owned();
        let javascript = ::vmm::manifest::Runtime {
            name: "javascript".to_owned(),
            aliases: vec!["js".to_owned(), "node".to_owned()],
            version: "18.20.4".to_owned(),
            run: Language::Kernel,
            interpreter: "/usr/bin/node".to_owned(),
            kernel: vec!["/usr/lib/bud/node/kernel.js".to_owned()],
            ..::vmm::manifest::Runtime::default()
        };
        let typescript = ::vmm::manifest::Runtime {
            name: "typescript".to_owned(),
            aliases: vec!["ts".to_owned()],
            dialect: 1,
            ..javascript.clone()
        };
        manifest.0.runtimes.insert(0, javascript);
        manifest.0.runtimes.push(typescript);
        Self(Arc::new(Inner {
            manifest,
            ..Inner::default()
        }))
    }

    /// An engine whose template adds two program runtimes (as a user template's
    /// `runtimes`): `lua` (alias `lua5.4`, program 0) and `awk` (program 1), after python
    /// and shell.
    pub fn with_programs() -> Self {
        let mut manifest = FakeManifest::default();
        manifest.0.name = "fake-programs".to_owned();
        let lua = ::vmm::manifest::Runtime {
            name: "lua".to_owned(),
            aliases: vec!["lua5.4".to_owned()],
            version: "5.4.4".to_owned(),
            run: Language::Program,
            interpreter: "/usr/bin/lua5.4".to_owned(),
            extension: ".lua".to_owned(),
            ..::vmm::manifest::Runtime::default()
        };
        let awk = ::vmm::manifest::Runtime {
            name: "awk".to_owned(),
            run: Language::Program,
            interpreter: "/bin/busybox".to_owned(),
            args: vec!["awk".to_owned(), "-f".to_owned()],
            dialect: 1,
            ..::vmm::manifest::Runtime::default()
        };
        manifest.0.runtimes.extend([lua, awk]);
        Self(Arc::new(Inner {
            manifest,
            ..Inner::default()
        }))
    }

    /// The worker mode of each job and cell it ran so far, in order.
    pub fn languages(&self) -> Vec<Language> {
        self.0
            .languages
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The kernel dialect of each job and cell it ran so far, in order (0 but for a kernel
    /// runtime's dialect: 1 for `typescript` on [`FakeEngine::with_node`]).
    pub fn dialects(&self) -> Vec<u32> {
        self.0
            .dialects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The worker mode and cell options (namespace, reset, directory, error in the display)
    /// of each session cell it ran so far, in order (one-shot jobs are not cells).
    pub fn cells(&self) -> Vec<(Language, CellOptions)> {
        self.0
            .cells
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Opens gate `name`: jobs waiting on it answer, and later ones pass at once.
    pub fn open(&self, name: &str) {
        self.0.gates().open.insert(name.to_owned());
        self.0.changed.notify_all();
    }

    /// Session starts wait from now until [`FakeEngine::release_starts`].
    pub fn hold_starts(&self) {
        self.0.gates().starts_held = true;
    }

    pub fn release_starts(&self) {
        self.0.gates().starts_held = false;
        self.0.changed.notify_all();
    }

    /// Session starts fail from now on, with `why`.
    pub fn fail_starts(&self, why: &str) {
        self.0.gates().start_fails = Some(why.to_owned());
    }

    /// The private memory every session VM reports from now on.
    pub fn set_vm_bytes(&self, bytes: u64) {
        self.0.vm_bytes.store(bytes, Ordering::Relaxed);
    }

    pub fn counts(&self) -> Counts {
        Counts {
            jobs: self.0.jobs.load(Ordering::Acquire),
            started: self.0.started.load(Ordering::Acquire),
            ended: self.0.ended.load(Ordering::Acquire),
            running: self.0.running.load(Ordering::Acquire),
            egress_given: self.0.egress_given.load(Ordering::Acquire),
        }
    }

    fn wait_gate(&self, name: &str) {
        let mut g = self.0.gates();
        while !g.open.contains(name) {
            g = self.0.changed.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Runs `job` as its code says; the health its VM is left in.
    fn run(&self, job: &Job, grace: bool, out: Output<'_>) -> (JobResult, Health) {
        self.0.running.fetch_add(1, Ordering::AcqRel);
        self.0
            .languages
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(job.language);
        self.0
            .dialects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(job.dialect);
        let started = Instant::now();
        let code = String::from_utf8_lossy(&job.code).into_owned();
        let mut words = code.split_whitespace();
        let (r, health) = match (words.next(), words.next()) {
            (Some("exit"), Some(n)) => {
                let mut r = result(Status::Error);
                r.exit_code = n.parse().ok();
                (r, Health::Ready)
            }
            (Some("crash"), _) => {
                let mut r = result(Status::Crashed);
                r.crash = Some("the fake guest crashed".into());
                r.console_tail = vec!["fake: crashed".into()];
                let why = Unusable::Crashed("the fake guest crashed".into());
                (r, Health::Discard(why))
            }
            (Some(hang @ ("hang" | "hang-hard")), _) => {
                let status = hang_until(job.cancel.as_ref(), job.timeout);
                let health = if hang == "hang" && grace {
                    Health::Ready
                } else {
                    Health::Discard(Unusable::Stopped(status))
                };
                (result(status), health)
            }
            (Some("wait"), Some(gate)) => {
                self.wait_gate(gate);
                (answer(&code, out), Health::Ready)
            }
            _ => (answer(&code, out), Health::Ready),
        };
        let mut r = r;
        r.timings = JobTimings {
            run: started.elapsed(),
            ..JobTimings::default()
        };
        self.0.running.fetch_sub(1, Ordering::AcqRel);
        (r, health)
    }
}

/// A result of `status` with no output (exit code 0 when it is `ok`).
fn result(status: Status) -> JobResult {
    JobResult {
        exit_code: (status == Status::Ok).then_some(0),
        ..JobResult::never_ran(status)
    }
}

/// An `ok` answer whose stdout is `code`, streamed as it goes.
fn answer(code: &str, out: Output<'_>) -> JobResult {
    out(Stream::Stdout, code.as_bytes());
    let mut r = result(Status::Ok);
    r.stdout = code.as_bytes().to_vec();
    r
}

/// Waits for `cancel` or `timeout`: which came.
fn hang_until(cancel: Option<&Cancel>, timeout: Duration) -> Status {
    let deadline = Instant::now() + timeout;
    loop {
        if cancel.is_some_and(Cancel::is_cancelled) {
            return Status::Cancelled;
        }
        if Instant::now() >= deadline {
            return Status::Timeout;
        }
        std::thread::sleep(HANG_POLL);
    }
}

impl Engine for FakeEngine {
    fn run_then(&self, job: &Job, out: Output<'_>, deliver: Deliver<'_>) {
        self.0.jobs.fetch_add(1, Ordering::AcqRel);
        let (r, _) = self.run(job, false, out);
        deliver(Ok::<_, ExecError>(r));
    }

    fn start(&self) -> Result<Box<dyn SessionVm>, SessionError> {
        let mut g = self.0.gates();
        while g.starts_held {
            g = self.0.changed.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(why) = &g.start_fails {
            return Err(SessionError::Unusable(Unusable::Failed(why.clone())));
        }
        drop(g);
        self.0.started.fetch_add(1, Ordering::AcqRel);
        Ok(Box::new(FakeVm::new(self.clone())))
    }

    fn stats(&self) -> ExecutorStats {
        ExecutorStats::default()
    }

    fn sizes(&self) -> (u64, u64) {
        (0, 0)
    }

    fn executor(&self) -> Option<&Arc<Executor>> {
        None
    }

    fn manifest(&self) -> &::vmm::manifest::Manifest {
        &self.0.manifest.0
    }
}

/// The fake template's manifest: the runtimes and tools of bud's python template.
#[derive(Debug)]
struct FakeManifest(::vmm::manifest::Manifest);

impl Default for FakeManifest {
    fn default() -> Self {
        use ::vmm::manifest::{Manifest, Runtime};
        let runtime = |name: &str, run, interpreter: &str| Runtime {
            name: name.to_owned(),
            version: "0".to_owned(),
            run,
            interpreter: interpreter.to_owned(),
            ..Runtime::default()
        };
        Self(Manifest {
            name: "fake".to_owned(),
            runtimes: vec![
                runtime("python", Language::Python, "/usr/bin/python3"),
                runtime("shell", Language::Shell, "/bin/sh"),
            ],
            tools: vec!["sh".to_owned()],
            ..Manifest::default()
        })
    }
}

/// A session's VM on the fake engine.
#[derive(Debug)]
pub struct FakeVm {
    engine: FakeEngine,
    executions: u64,
    health: Health,
    beside: vmm::beside::Beside,
}

impl FakeVm {
    fn new(engine: FakeEngine) -> Self {
        Self {
            engine,
            executions: 0,
            health: Health::Ready,
            beside: vmm::beside::Beside::default(),
        }
    }
}

impl SessionVm for FakeVm {
    fn exec(
        &mut self,
        job: &Job,
        _grace: Duration,
        out: Output<'_>,
    ) -> Result<JobResult, SessionError> {
        if let Health::Discard(why) = &self.health {
            return Err(SessionError::Unusable(why.clone()));
        }
        self.engine
            .0
            .cells
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((job.language, job.cell.clone()));
        let (r, health) = self.engine.run(job, true, out);
        self.health = health;
        self.executions += 1;
        Ok(r)
    }

    fn executions(&self) -> u64 {
        self.executions
    }

    fn fork(&mut self, count: usize) -> Result<(Vec<Box<dyn SessionVm>>, ForkStats), SessionError> {
        if let Health::Discard(why) = &self.health {
            return Err(SessionError::Unusable(why.clone()));
        }
        let children = (0..count)
            .map(|_| {
                let mut c = FakeVm::new(self.engine.clone());
                c.executions = self.executions;
                Box::new(c) as Box<dyn SessionVm>
            })
            .collect();
        Ok((children, ForkStats::default()))
    }

    fn health(&self) -> Health {
        self.health.clone()
    }

    fn console_tail(&self, _lines: usize) -> Vec<String> {
        match self.health {
            Health::Ready => Vec::new(),
            Health::Discard(_) => vec!["fake: crashed".into()],
        }
    }

    fn private_bytes(&self) -> Result<u64, SessionError> {
        Ok(self.engine.0.vm_bytes.load(Ordering::Relaxed))
    }

    fn layers(&self) -> Vec<LayerShare> {
        Vec::new()
    }

    fn beside(&self) -> vmm::beside::Beside {
        self.beside.clone()
    }

    fn set_egress(&mut self, _egress: Arc<dyn vmm::Egress>) {
        self.engine.0.egress_given.fetch_add(1, Ordering::AcqRel);
    }

    fn end(self: Box<Self>) {
        self.engine.0.ended.fetch_add(1, Ordering::AcqRel);
    }

    fn vmm(&mut self) -> Option<(&mut Session, &Arc<Executor>)> {
        None
    }
}
