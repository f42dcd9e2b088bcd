//! The audit trail: one JSON line per job and per session cell (`--audit-log PATH`).
//!
//! A record says who ran what and what came of it: the time, the API key's *name* (never the
//! key), the route, whether it was a one-shot job or a cell, the template, the session id,
//! the language, the sha256 and size of the code and of stdin, the status, exit code or
//! signal, the timings, and the size and sha256 of stdout and stderr; `--audit-content`
//! also stores the code and the output (each cut to [`CONTENT_CAP`] bytes, lossy UTF-8).
//!
//! Off the request path: the job thread that ran the job hashes its inputs and outputs
//! (sha256, ~2 ms per MiB here) and hands the record to a bounded channel
//! ([`QUEUE`] records); one writer thread appends the lines and flushes after each batch.
//! If the channel is full the record is dropped and counted; if the file cannot be
//! written the log is *failing*: `GET /v1/health` and `/metrics` say so, and with
//! `--audit-required` the server refuses new jobs (503 `audit_unavailable`) rather than run
//! them unrecorded, until a write succeeds again.
//!
//! Who asked: the API-key middleware runs each request inside [`KEY`], a task-local with the
//! key's name; work that moves to another task carries it along ([`current_key`]).

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use sha2::{Digest, Sha256};
use vmm::{Job, JobResult, Language};

/// Records waiting for the writer.
pub const QUEUE: usize = 4096;
/// Bytes of code, stdout and stderr kept with `--audit-content`.
pub const CONTENT_CAP: usize = 64 << 10;

tokio::task_local! {
    /// The name of the API key of the request being served (None without keys).
    pub static KEY: Option<String>;
}

/// The key name of the current request (None outside one, or without keys).
pub fn current_key() -> Option<String> {
    KEY.try_with(Clone::clone).ok().flatten()
}

/// How the server audits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditConfig {
    pub path: PathBuf,
    /// Store code and output too (capped).
    pub content: bool,
    /// Refuse jobs while the log cannot be written.
    pub required: bool,
}

/// What a request says about the job before it runs.
#[derive(Debug, Clone, Default)]
pub struct Origin {
    pub key: Option<String>,
    pub route: String,
    pub template: String,
    pub session: Option<String>,
}

impl Origin {
    /// The origin of a job run for the current request on `route`.
    pub fn here(route: &str, template: &str, session: Option<&str>) -> Self {
        Self {
            key: current_key(),
            route: route.to_owned(),
            template: template.to_owned(),
            session: session.map(str::to_owned),
        }
    }
}

/// One line of the log.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Record {
    pub time: String,
    pub key: Option<String>,
    pub route: String,
    /// `job`, `cell`, or `process` (a background process, recorded as it starts: its
    /// script is the code, and it has no status, output or time yet), or a session's
    /// `pause`, `resume` or `snapshot` (no code; `total_ms` is how long it took, the
    /// snapshot's id is in `stdout`), or one of a sandbox's network attempts, `dns` or
    /// `connect` (route: a one-shot job's own, `network` for a session's; the attempt as
    /// `GET /v1/sessions/{id}/network` shows it is in `network`, with a connection's bytes;
    /// status `ok` if allowed, else `error`). Events carry `language` `python` as a filler.
    pub kind: String,
    pub template: String,
    pub session: Option<String>,
    pub language: Language,
    pub code_sha256: String,
    pub code_bytes: usize,
    pub stdin_sha256: String,
    pub stdin_bytes: usize,
    pub status: vmm::Status,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub queue_ms: f64,
    pub run_ms: f64,
    pub total_ms: f64,
    pub stdout_bytes: usize,
    pub stdout_sha256: String,
    pub stderr_bytes: usize,
    pub stderr_sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<serde_json::Value>,
}

impl Record {
    /// The record of an event of `origin` that is not a job (a process start, a pause):
    /// now, `kind`, no code, input or output (their hashes the empty one), status ok, no
    /// time; the caller fills in what the event has.
    fn event(origin: &Origin, kind: &str, language: Language) -> Self {
        let empty = sha256_hex(b"");
        Self {
            time: crate::core::clock::rfc3339(crate::core::clock::epoch_s(SystemTime::now())),
            key: origin.key.clone(),
            route: origin.route.clone(),
            kind: kind.to_owned(),
            template: origin.template.clone(),
            session: origin.session.clone(),
            language,
            code_sha256: empty.clone(),
            code_bytes: 0,
            stdin_sha256: empty.clone(),
            stdin_bytes: 0,
            status: vmm::Status::Ok,
            exit_code: None,
            signal: None,
            queue_ms: 0.0,
            run_ms: 0.0,
            total_ms: 0.0,
            stdout_bytes: 0,
            stdout_sha256: empty.clone(),
            stderr_bytes: 0,
            stderr_sha256: empty,
            code: None,
            stdout: None,
            stderr: None,
            network: None,
        }
    }
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn capped(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[..b.len().min(CONTENT_CAP)]).into_owned()
}

/// Counters of the log, for health and metrics.
#[derive(Debug, Default)]
pub struct AuditState {
    pub written: AtomicU64,
    pub dropped: AtomicU64,
    failing: AtomicBool,
    last_error: Mutex<Option<String>>,
}

impl AuditState {
    pub fn failing(&self) -> bool {
        self.failing.load(Ordering::Acquire)
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn fail(&self, why: String) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        self.failing.store(true, Ordering::Release);
    }

    fn recover(&self) {
        self.failing.store(false, Ordering::Release);
    }
}

/// The audit log: its channel and state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AuditLog {
    config: AuditConfig,
    tx: SyncSender<Record>,
    pub state: Arc<AuditState>,
}

impl AuditLog {
    /// Opens (appends to) the log and starts its writer thread. A file that cannot be opened
    /// now makes the log failing from the start (retried at each batch).
    pub fn start(config: AuditConfig) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel(QUEUE);
        let state = Arc::new(AuditState::default());
        let writer_state = state.clone();
        let path = config.path.clone();
        std::thread::Builder::new()
            .name("bud-audit".into())
            .spawn(move || writer(path, rx, &writer_state))?;
        Ok(Self { config, tx, state })
    }

    /// Whether jobs must be refused now (`--audit-required` and the log is failing).
    pub fn refuses_jobs(&self) -> bool {
        self.config.required && self.state.failing()
    }

    /// Builds the record of `job` (run for `origin`) and queues it. Runs on the job thread.
    pub fn job(&self, origin: &Origin, kind: &str, job: &Job, r: &JobResult, waited: Duration) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let content = self.config.content;
        let record = Record {
            time: crate::core::clock::rfc3339(crate::core::clock::epoch_s(SystemTime::now())),
            key: origin.key.clone(),
            route: origin.route.clone(),
            kind: kind.to_owned(),
            template: origin.template.clone(),
            session: origin.session.clone(),
            language: job.language,
            code_sha256: sha256_hex(&job.code),
            code_bytes: job.code.len(),
            stdin_sha256: sha256_hex(&job.stdin),
            stdin_bytes: job.stdin.len(),
            status: r.status,
            exit_code: r.exit_code,
            signal: r.signal,
            queue_ms: ms(waited),
            run_ms: ms(r.timings.run),
            total_ms: ms(r.timings.total),
            stdout_bytes: r.stdout.len(),
            stdout_sha256: sha256_hex(&r.stdout),
            stderr_bytes: r.stderr.len(),
            stderr_sha256: sha256_hex(&r.stderr),
            code: content.then(|| capped(&job.code)),
            stdout: content.then(|| capped(&r.stdout)),
            stderr: content.then(|| capped(&r.stderr)),
            network: None,
        };
        self.queue(record);
    }

    /// Records one network attempt of `origin`'s sandbox (`dns` or `connect`). Runs on a
    /// dial thread or a vCPU thread: it only queues.
    pub fn egress(&self, origin: &Origin, attempt: &crate::core::egress::Attempt) {
        let mut record = Record::event(origin, attempt.kind, Language::Python);
        if !attempt.allowed {
            record.status = vmm::Status::Error;
        }
        record.network = serde_json::to_value(attempt).ok();
        self.queue(record);
    }

    /// Records the start of a background process (`kind` `process`): who started which
    /// script where; its output and end are not in the trail.
    pub fn process(&self, origin: &Origin, script: &[u8]) {
        let mut record = Record::event(origin, "process", Language::Shell);
        record.code_sha256 = sha256_hex(script);
        record.code_bytes = script.len();
        record.code = self.config.content.then(|| capped(script));
        self.queue(record);
    }

    /// Records a durable-session event (`pause`, `resume`, `snapshot`) of `origin`'s
    /// session that took `took`; `detail` (a snapshot's id) goes in `stdout`.
    pub fn lifecycle(&self, origin: &Origin, kind: &str, took: Duration, detail: Option<&str>) {
        let ms = took.as_secs_f64() * 1e3;
        let mut record = Record::event(origin, kind, Language::Python);
        record.run_ms = ms;
        record.total_ms = ms;
        if let Some(d) = detail {
            record.stdout_bytes = d.len();
            record.stdout_sha256 = sha256_hex(d.as_bytes());
            record.stdout = Some(d.to_owned());
        }
        self.queue(record);
    }

    fn queue(&self, record: Record) {
        match self.tx.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.state.dropped.fetch_add(1, Ordering::Relaxed);
                self.state
                    .fail(format!("the audit queue ({QUEUE} records) is full"));
            }
            Err(TrySendError::Disconnected(_)) => {
                self.state.dropped.fetch_add(1, Ordering::Relaxed);
                self.state.fail("the audit writer has stopped".into());
            }
        }
    }
}

/// The writer thread: appends what arrives, a batch at a time, until the server drops the
/// last sender.
fn writer(path: PathBuf, rx: Receiver<Record>, state: &AuditState) {
    let open = || {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map(BufWriter::new)
    };
    let mut file: Option<BufWriter<File>> = match open() {
        Ok(f) => Some(f),
        Err(e) => {
            state.fail(format!("cannot open {}: {e}", path.display()));
            None
        }
    };
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        if file.is_none() {
            file = open()
                .map_err(|e| state.fail(format!("cannot open {}: {e}", path.display())))
                .ok();
        }
        let Some(f) = file.as_mut() else {
            state
                .dropped
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            continue;
        };
        let wrote = batch.iter().try_for_each(|r| {
            serde_json::to_writer(&mut *f, r).map_err(std::io::Error::other)?;
            f.write_all(b"\n")
        });
        match wrote.and_then(|()| f.flush()) {
            Ok(()) => {
                state
                    .written
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                state.recover();
            }
            Err(e) => {
                state
                    .dropped
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                state.fail(format!("cannot write {}: {e}", path.display()));
                file = None;
            }
        }
    }
}
