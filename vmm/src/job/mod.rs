//! Jobs: what a user asks to run ([`Job`]) and what comes back ([`JobResult`], with its
//! [`Status`] and [`JobTimings`]). Running one in a VM is [`run()`] (module `run`).

mod decode;
mod run;
mod supervise;

pub use decode::decode_result;
pub(crate) use decode::{Collected, end_from_outcome};
pub use run::run;
pub(crate) use run::{Kind, Request, give_identity, run_request, write_request};

use std::time::Duration;

use crate::identity::IdentityError;
use crate::mailbox::MailboxError;
use crate::protocol::{job, language};
use crate::snapshot::SnapshotError;
use crate::vcpu::VcpuError;

/// Default wall-clock limit of a job.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default cap on stdout + stderr bytes kept.
pub const DEFAULT_OUTPUT_LIMIT: usize = crate::protocol::DEFAULT_OUTPUT_LIMIT;

/// Most bytes of a request's code, stdin, args and env together (the mailbox's request
/// area, [`crate::protocol::job::DATA`]..`DATA_END`).
pub const MAX_REQUEST_DATA: usize = job::DATA_END - job::DATA;
/// How often a streamed job's output is taken while it runs (see [`Job::stream_output`]).
pub(crate) const STREAM_TICK: Duration = Duration::from_millis(50);
/// Console lines a crashed job carries.
pub(crate) const CRASH_TAIL_LINES: usize = 40;

/// How the worker runs a job's code: defined with the template manifest, whose runtimes
/// name these modes ([`crate::manifest`]).
pub use crate::manifest::Language;

impl Language {
    fn code(self) -> u32 {
        match self {
            Language::Python => language::PYTHON,
            Language::Shell => language::SHELL,
            Language::Kernel => language::KERNEL,
            Language::Program => language::PROGRAM,
        }
    }
}

/// A unit of work: code and its inputs, with limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub language: Language,
    /// Which of the kernel's languages a [`Language::Kernel`] job is written in (the
    /// runtime's [`crate::manifest::Runtime::dialect`]: 0 JavaScript, 1 TypeScript on
    /// `node`), or which program runtime a [`Language::Program`] job is; 0 for the
    /// worker's own modes.
    pub dialect: u32,
    pub code: Vec<u8>,
    pub stdin: Vec<u8>,
    /// `sys.argv[1:]` (Python) or `$1...` (shell).
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    pub timeout: Duration,
    /// Cap on stdout + stderr bytes; past it the job stops with [`Status::OutputLimit`].
    pub output_limit: usize,
    /// How a session cell runs (ignored by one-shot jobs and file operations).
    pub cell: CellOptions,
    /// Cancels the job from another thread (its client went away).
    pub cancel: Option<Cancel>,
    /// The caller streams the output: it is also taken every [`STREAM_TICK`] while the job
    /// runs, not only when the guest FLUSHes (which it does when it writes again).
    pub stream_output: bool,
    /// Decides the names and connections of this job's network card (a template with a
    /// card), in place of its executor's ([`crate::Executor::set_egress`]); the VM's reset
    /// after the job gives it back the executor's. Ignored by a session's requests (a
    /// session's card keeps the egress it was made with) and by VMs without a card.
    pub egress: Option<crate::net::JobEgress>,
}

/// How a session cell runs: in which Python namespace and directory, and how it reports an
/// exception.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CellOptions {
    /// 0: the session's `__main__`; another number: an independent namespace (a context of
    /// a code-interpreter client), made empty on first use.
    pub namespace: u32,
    /// Empty the namespace before the cell runs (a restarted context).
    pub reset: bool,
    /// The working directory the namespace starts in (a context's `cwd`): the guest enters
    /// it before the namespace's first cell and again after a [`CellOptions::reset`]; a
    /// directory it cannot enter leaves the namespace where the process is. `None`: the
    /// namespace starts where the process is. Later cells keep what the namespace's own
    /// cells made of it (`os.chdir`).
    pub directory: Option<String>,
    /// Report an uncaught exception as [`JobResult::error`] instead of printing its
    /// traceback on stderr.
    pub error_in_display: bool,
}

impl Job {
    /// A Python job with default limits.
    pub fn python(code: impl Into<Vec<u8>>) -> Self {
        Self::new(Language::Python, code)
    }

    /// A shell job with default limits.
    pub fn shell(code: impl Into<Vec<u8>>) -> Self {
        Self::new(Language::Shell, code)
    }

    /// A job with default limits.
    pub fn new(language: Language, code: impl Into<Vec<u8>>) -> Self {
        Self {
            language,
            dialect: 0,
            code: code.into(),
            stdin: Vec::new(),
            args: Vec::new(),
            env: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            output_limit: DEFAULT_OUTPUT_LIMIT,
            cell: CellOptions::default(),
            cancel: None,
            stream_output: false,
            egress: None,
        }
    }

    /// Runs in `runtime` (a manifest's runtime): its worker mode and dialect.
    pub fn set_runtime(&mut self, runtime: &crate::manifest::Runtime) {
        self.language = runtime.run;
        self.dialect = runtime.dialect;
    }

    /// Checks the job fits the protocol; on success returns the encoded args and env blobs.
    /// The args and env blobs. `lead` goes before the args (a cell's start directory).
    fn encode(&self, lead: Option<&str>) -> Result<(Vec<u8>, Vec<u8>), JobError> {
        let mut args = Vec::new();
        for a in lead.into_iter().chain(self.args.iter().map(String::as_str)) {
            if a.contains('\0') {
                return Err(JobError::Nul("args"));
            }
            args.extend_from_slice(a.as_bytes());
            args.push(0);
        }
        let mut env = Vec::new();
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(JobError::BadEnv(k.clone()));
            }
            env.extend_from_slice(k.as_bytes());
            env.push(b'=');
            env.extend_from_slice(v.as_bytes());
            env.push(0);
        }
        let total = self.code.len() + self.stdin.len() + args.len() + env.len();
        if total > MAX_REQUEST_DATA {
            return Err(JobError::TooLarge {
                bytes: total,
                limit: MAX_REQUEST_DATA,
            });
        }
        Ok((args, env))
    }
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Exited with status 0.
    Ok,
    /// Exited with another status, or was killed by a signal.
    Error,
    /// Ran past its wall-clock limit.
    Timeout,
    /// Wrote more than its output cap.
    OutputLimit,
    /// Ran out of memory (uncaught `MemoryError`, or the guest's OOM killer).
    MemoryLimit,
    /// The guest kernel panicked, the vCPU faulted, or the guest broke the protocol.
    Crashed,
    /// Cancelled by the host before it ended (its client went away): see [`Cancel`].
    Cancelled,
}

/// Cancels a job from another thread: the job's vCPU is kicked and the job ends as
/// [`Status::Cancelled`] with the output it had written, its VM thrown away (never reused).
/// Cancelling before the job starts makes it end at once when it does. A session cell is
/// interrupted instead, as at its timeout: one that stops within the grace leaves its
/// session usable; one cancelled before it started never runs.
#[derive(Debug, Clone, Default)]
pub struct Cancel(std::sync::Arc<CancelState>);

#[derive(Debug, Default)]
struct CancelState {
    cancelled: std::sync::atomic::AtomicBool,
    /// The kicker of the vCPU running the job, while it runs.
    kicker: std::sync::Mutex<Option<crate::vcpu::Kicker>>,
}

impl Cancel {
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels the job (idempotent).
    pub fn cancel(&self) {
        self.0
            .cancelled
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(k) = self.kicker().as_ref() {
            k.kick();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.cancelled.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn kicker(&self) -> std::sync::MutexGuard<'_, Option<crate::vcpu::Kicker>> {
        self.0.kicker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The job starts on the vCPU of `k` (kicked at once if already cancelled).
    fn attach(&self, k: &crate::vcpu::Kicker) {
        *self.kicker() = Some(k.clone());
        if self.is_cancelled() {
            k.kick();
        }
    }

    /// The job has left the vCPU.
    fn detach(&self) {
        *self.kicker() = None;
    }
}

impl PartialEq for Cancel {
    /// The same handle.
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Cancel {}

/// Where the time of a job went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobTimings {
    /// Getting a VM at READY: zero for a warm VM or a pooled clone, else creating a clone.
    pub clone: Duration,
    /// From resuming the clone to the job's end.
    pub run: Duration,
    /// Both, plus writing the request and collecting the result.
    pub total: Duration,
    /// The guest's own account of `run`, when the job ended at DONE.
    pub guest: Option<GuestPhases>,
    /// Exits from the guest to the VMM during the job (doorbells, console bytes, ...).
    pub exits: u64,
    /// KVM's own counters over the job: all exits, emulated instructions, page faults.
    pub kvm: crate::kvm_stats::VcpuCounters,
}

/// The guest worker's phases of a job, by its own clock (from `result::PHASE_*_NS`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GuestPhases {
    /// Resume to request read.
    pub read: Duration,
    /// Giving the job its identity (seeding `random`, checking the clock).
    pub identity: Duration,
    /// Compiling the code (Python) or handing the script to the shell.
    pub compile: Duration,
    /// Running the job and flushing its output, to just before DONE.
    pub run: Duration,
    /// The guest had to set its wall clock itself (the host's write did not hold).
    pub clock_set: bool,
}

impl GuestPhases {
    /// From the four cumulative marks (0: not reached); None if they are not in order.
    fn from_marks(read: u64, identity: u64, compiled: u64, finished: u64) -> Option<Self> {
        let compiled = if compiled == 0 { identity } else { compiled };
        let ordered = read <= identity && identity <= compiled && compiled <= finished;
        (finished > 0 && ordered).then(|| Self {
            read: Duration::from_nanos(read),
            identity: Duration::from_nanos(identity - read),
            compile: Duration::from_nanos(compiled - identity),
            run: Duration::from_nanos(finished - compiled),
            clock_set: false,
        })
    }
}

/// What came back from a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobResult {
    pub status: Status,
    /// Exit status, when the job exited.
    pub exit_code: Option<i32>,
    /// Signal number, when a signal ended it.
    pub signal: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// For [`Status::Crashed`]: what went wrong and the last console lines.
    pub crash: Option<String>,
    pub console_tail: Vec<String>,
    /// What a session cell displayed: its final expression's value (empty otherwise).
    pub display: Vec<Display>,
    /// The matplotlib figures a Python job or cell showed or left open, as `image/png`, in
    /// order (the guest's `bud_session.take_figures`).
    pub figures: Vec<Display>,
    /// A cell's uncaught exception, when it ran with [`CellOptions::error_in_display`].
    pub error: Option<CellError>,
    pub timings: JobTimings,
}

impl JobResult {
    /// The result of a job that ended as `status` before it started: no output, no time.
    pub fn never_ran(status: Status) -> Self {
        Self {
            status,
            exit_code: None,
            signal: None,
            stdout: Vec::new(),
            stderr: Vec::new(),
            crash: None,
            console_tail: Vec::new(),
            display: Vec::new(),
            figures: Vec::new(),
            error: None,
            timings: JobTimings::default(),
        }
    }
}

impl JobResult {
    /// A cell's result put together outside a request (a code context's kernel process):
    /// how it ended, its output, and the guest's display JSON (`bud_session.display_json`,
    /// as at [`crate::protocol::result::DISPLAY_LEN`]). Hostile input: anything but that
    /// JSON is dropped whole, as a request's is.
    pub fn of_cell(
        status: Status,
        exit_code: Option<i32>,
        signal: Option<i32>,
        display: &[u8],
    ) -> Self {
        let shown: decode::Shown = serde_json::from_slice(display).unwrap_or_default();
        Self {
            exit_code,
            signal,
            display: shown.value,
            figures: shown.figures,
            error: shown.error,
            ..Self::never_ran(status)
        }
    }
}

/// An uncaught exception of a cell, as Jupyter reports it: the exception's class name, its
/// `str`, and the formatted traceback.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CellError {
    pub name: String,
    pub value: String,
    pub traceback: String,
}

/// One representation of a displayed value, as Jupyter's display data: `mime` is
/// `text/plain`, `text/html` or `image/png` (`data` base64-encoded).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Display {
    #[serde(rename = "type")]
    pub mime: String,
    pub data: String,
}

/// Whether a VM may take another request after one: the one answer the executor (reset and
/// reuse, or replace), sessions (go on, or end) and their metrics read. Only a request that
/// ended at the DONE doorbell with its worker intact leaves the VM [`Health::Ready`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// Its worker waits for the next request (a one-shot job's VM is reset first).
    Ready,
    /// It must be thrown away, for this reason.
    Discard(Unusable),
}

impl Health {
    pub(crate) fn is_ready(&self) -> bool {
        matches!(self, Health::Ready)
    }
}

/// Why a VM cannot take another request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    /// The host stopped the request where the vCPU was: at its deadline or output cap with
    /// no grace, or past the grace after its interrupt ([`Status::Timeout`],
    /// [`Status::OutputLimit`]), or at a cancel ([`Status::Cancelled`]).
    #[error("the request was stopped where it ran ({0:?})")]
    Stopped(Status),
    /// A one-shot job the host interrupted (at its timeout, its cap or a cancel) and that then
    /// ended at DONE: its VM is still never reused, only one whose job ended by itself is.
    #[error("the job was interrupted ({0:?})")]
    Interrupted(Status),
    /// The worker process ended: its own exit, a signal, the OOM killer.
    #[error("the worker process is gone ({0})")]
    WorkerGone(String),
    /// The guest crashed or broke the protocol.
    #[error("the guest crashed: {0}")]
    Crashed(String),
    /// bud could not run the request.
    #[error("the VMM could not run the request: {0}")]
    Failed(String),
}

/// Output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Errors that stop bud from running a job at all (as opposed to a job that ran and failed,
/// which is a [`JobResult`] with a status).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("job code + stdin + args + env is {bytes} bytes; the limit is {limit}")]
    TooLarge { bytes: usize, limit: usize },
    #[error("{0} must not contain NUL bytes")]
    Nul(&'static str),
    #[error("environment variable name {0:?} is empty or holds '=' or NUL, or its value holds NUL")]
    BadEnv(String),
    #[error("giving the clone its identity: {0}")]
    Identity(#[from] IdentityError),
    #[error("pinning the clone's clock: {0}")]
    Clock(#[from] SnapshotError),
    #[error("writing the request into the mailbox: {0}")]
    Mailbox(#[from] MailboxError),
    #[error("running the clone's vCPU: {0}")]
    Run(#[from] VcpuError),
    #[error("interrupting the guest: {0}")]
    Interrupt(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_phases_come_from_cumulative_marks_and_disorder_is_dropped() {
        let p = GuestPhases::from_marks(10, 30, 60, 100).unwrap();
        let no_compile = GuestPhases::from_marks(10, 30, 0, 100).unwrap();

        assert_eq!(p.read, Duration::from_nanos(10));
        assert_eq!(p.identity, Duration::from_nanos(20));
        assert_eq!(p.compile, Duration::from_nanos(30));
        assert_eq!(p.run, Duration::from_nanos(40));
        assert_eq!(no_compile.compile, Duration::ZERO);
        assert_eq!(GuestPhases::from_marks(50, 30, 60, 100), None);
        assert_eq!(GuestPhases::from_marks(0, 0, 0, 0), None);
    }

    #[test]
    fn args_and_env_are_nul_terminated_and_validated() {
        let mut j = Job::python("print(1)");
        j.args = vec!["a".into(), "bc".into()];
        j.env = vec![("K".into(), "v=1".into())];

        let (args, env) = j.encode(None).unwrap();
        let (led, _) = j.encode(Some("/home/user")).unwrap();
        let bad_lead = j.encode(Some("/t\0")).unwrap_err();
        j.env = vec![("A=B".into(), "x".into())];
        let bad_env = j.encode(None).unwrap_err();
        j.env.clear();
        j.args = vec!["a\0b".into()];
        let bad_arg = j.encode(None).unwrap_err();

        assert_eq!(args, b"a\0bc\0");
        assert_eq!(led, b"/home/user\0a\0bc\0");
        assert!(matches!(bad_lead, JobError::Nul("args")));
        assert_eq!(env, b"K=v=1\0");
        assert!(matches!(bad_env, JobError::BadEnv(_)));
        assert!(matches!(bad_arg, JobError::Nul("args")));
    }

    #[test]
    fn a_request_larger_than_the_area_is_refused() {
        let mut j = Job::python("x");
        j.stdin = vec![0; job::DATA_END];

        assert!(matches!(j.encode(None), Err(JobError::TooLarge { .. })));
    }
}
