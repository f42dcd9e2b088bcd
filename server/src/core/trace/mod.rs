//! Session traces: what every session did, kept on disk after it ends (docs/evidence.md).
//!
//! ```text
//! STATE_DIR/traces/ID.ndjson     one session's events, one JSON line each, append-only
//! ```
//!
//! Every event of a session (its start, each cell with its code and output, each
//! background process, each file written or removed through the API, its network
//! attempts, forks, pauses, resumes, snapshots, its end) is appended as one line the moment
//! it happens, by the thread it happens on, with one `write(2)` of the whole line: a server
//! killed at any moment leaves every finished event whole (at most the line being written
//! is cut short, and the next server on the directory trims it off). Lines are hash-chained
//! and a finished trace is sealed with the server's session key ([`chain`]).
//!
//! What a trace keeps of output is bounded per session (`--trace-output-mib`): past it, a
//! cell's output is cut and the event says how many bytes were left out. Ended traces are
//! kept `--trace-retention-hours`, and all traces together within `--trace-quota-mib`:
//! past the quota, ended traces are removed oldest first (`prune`), or new sessions are
//! refused (`refuse`) until retention frees room.
//!
//! A live session's events also go to its subscribers ([`Traces::subscribe`]) as they are
//! written: the live stream (`GET /v1/sessions/{id}/events`) reads what is on disk and
//! then follows, so a client that reconnects misses nothing.
//!
//! Why files of JSON lines and not a database: an event is written once and read in order;
//! a line a crash cut short is the only damage, it is found by its missing hash, and
//! `grep`, `jq` and `bud trace verify` read the files as they are. The directory is listed
//! once, when the server starts (the jail then closes, and listing directories is not
//! among its calls): from then on the store keeps its own index.

pub mod chain;
pub mod event;
pub mod files;
pub mod otlp;
pub mod packet;
mod read;
mod retention;
pub mod review;
pub mod view;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::broadcast;

pub use chain::{Broken, Verified};

/// The folder of the state directory that holds the traces.
pub const TRACES_DIR: &str = "traces";
/// A trace file's extension.
pub const EXTENSION: &str = "ndjson";
/// Events a slow subscriber may fall behind before it re-reads the file.
pub const LIVE_BACKLOG: usize = 1024;

/// What to do when the traces would pass their quota (`--trace-over-quota`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OverQuota {
    /// Remove ended traces, oldest first, until they fit.
    #[default]
    Prune,
    /// Keep every trace; refuse new sessions (507 `trace_quota`) until retention frees
    /// room.
    Refuse,
}

/// How the server keeps traces.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct TraceConfig {
    /// Keep no session traces (with a state directory they are kept by default).
    #[arg(long = "no-trace")]
    pub off: bool,
    /// Hours an ended session's trace is kept.
    #[arg(
        long = "trace-retention-hours",
        value_name = "HOURS",
        default_value_t = TraceConfig::default().retention_hours
    )]
    pub retention_hours: u64,
    /// MiB all traces may take together.
    #[arg(
        long = "trace-quota-mib",
        value_name = "MIB",
        default_value_t = TraceConfig::default().quota_mib
    )]
    pub quota_mib: u64,
    /// Past the quota: `prune` removes ended traces oldest first, `refuse` refuses new
    /// sessions.
    #[arg(long = "trace-over-quota", value_enum, default_value_t = OverQuota::Prune)]
    pub over_quota: OverQuota,
    /// MiB of cell and command output one session's trace keeps (code is kept up to
    /// 64 KiB a cell); past it, output is cut and the event says how much.
    #[arg(
        long = "trace-output-mib",
        value_name = "MIB",
        default_value_t = TraceConfig::default().output_mib
    )]
    pub output_mib: u64,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self {
            off: false,
            retention_hours: 7 * 24,
            quota_mib: 1024,
            over_quota: OverQuota::Prune,
            output_mib: 4,
        }
    }
}

impl TraceConfig {
    fn retention(&self) -> Duration {
        Duration::from_secs(self.retention_hours.saturating_mul(3600))
    }
}

/// Why the trace store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("trace directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One line of a trace, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    pub seq: u64,
    pub kind: String,
    /// The line as the file holds it, without its newline.
    pub text: String,
}

/// A trace read whole ([`Traces::whole`]).
#[derive(Debug)]
pub struct Whole {
    pub bytes: Vec<u8>,
    pub lines: Vec<Line>,
    pub check: Result<Verified, Broken>,
}

/// The whole lines of a trace's text with a seq above `after` (a torn last line left out).
fn lines_of(text: &str, after: u64) -> Vec<Line> {
    let mut lines = Vec::new();
    for line in text.split_inclusive('\n') {
        let Some(body) = line.strip_suffix('\n') else {
            break;
        };
        let Some(seq) = chain::seq_of(body) else {
            continue;
        };
        if seq <= after {
            continue;
        }
        let kind = kind_of(body).unwrap_or_default();
        lines.push(Line {
            seq,
            kind,
            text: body.to_owned(),
        });
    }
    lines
}

/// What the store knows of one trace file.
#[derive(Debug, Clone)]
struct Kept {
    bytes: u64,
    /// When its session ended (its seal), None while it may still grow.
    ended: Option<SystemTime>,
}

/// An open (unsealed) trace.
#[derive(Debug)]
struct Open {
    writer: Mutex<Writer>,
    live: broadcast::Sender<Arc<Line>>,
}

#[derive(Debug)]
struct Writer {
    file: File,
    seq: u64,
    prev: String,
    /// Output bytes the trace may still keep.
    output_left: u64,
    sealed: bool,
}

/// Counts for `/metrics` and health.
#[derive(Debug, Default)]
pub struct TraceCounts {
    pub events: AtomicU64,
    /// Events that could not be written (the disk refused them).
    pub failed: AtomicU64,
    /// Ended traces removed for retention or the quota.
    pub removed: AtomicU64,
}

/// The traces of a state directory (module docs).
#[derive(Debug)]
pub struct Traces {
    dir: PathBuf,
    config: TraceConfig,
    keys: vmm::session_file::SessionKeys,
    open: Mutex<HashMap<String, Arc<Open>>>,
    index: Mutex<HashMap<String, Kept>>,
    pub counts: TraceCounts,
}

/// Whether `id` can name a trace file (session ids are letters, digits, `-` and `_`).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn now_text() -> String {
    crate::core::clock::rfc3339(crate::core::clock::epoch_s(SystemTime::now()))
}

impl Traces {
    /// Opens (makes) `root/traces/`, reads what it holds, trims lines a crash cut short,
    /// and applies retention and the quota.
    pub fn open(
        root: &Path,
        config: TraceConfig,
        keys: vmm::session_file::SessionKeys,
    ) -> Result<Self, TraceError> {
        let dir = root.join(TRACES_DIR);
        let io = |source| TraceError::Io {
            path: dir.clone(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io)?;
        let mut index = HashMap::new();
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let path = entry.path();
            let Some(id) = trace_id(&path) else { continue };
            let meta = entry.metadata().map_err(io)?;
            let ended = last_line(&path)
                .ok()
                .flatten()
                .filter(|l| chain::parse_line(l, 0).is_ok_and(|e| e.kind == chain::SEALED))
                .map(|_| meta.modified().unwrap_or_else(|_| SystemTime::now()));
            index.insert(
                id,
                Kept {
                    bytes: meta.len(),
                    ended,
                },
            );
        }
        let traces = Self {
            dir,
            config,
            keys,
            open: Mutex::new(HashMap::new()),
            index: Mutex::new(index),
            counts: TraceCounts::default(),
        };
        traces.sweep(SystemTime::now());
        Ok(traces)
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.{EXTENSION}"))
    }

    fn index(&self) -> std::sync::MutexGuard<'_, HashMap<String, Kept>> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn opened(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Open>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether session `id` has a trace on disk.
    pub fn has(&self, id: &str) -> bool {
        valid_id(id) && self.index().contains_key(id)
    }

    /// Bytes all traces take, and the quota.
    pub fn usage(&self) -> (u64, u64) {
        let used = self.index().values().map(|k| k.bytes).sum();
        (used, self.config.quota_mib << 20)
    }

    /// Whether new sessions must be refused (`--trace-over-quota refuse` and the traces
    /// are at their quota).
    pub fn refuses_sessions(&self) -> bool {
        let (used, quota) = self.usage();
        self.config.over_quota == OverQuota::Refuse && used >= quota
    }

    /// The open trace of `id`, opened (or made) if it is not yet: None if it was sealed
    /// or cannot be opened (counted as a failed event).
    fn writer(&self, id: &str) -> Option<Arc<Open>> {
        if !valid_id(id) {
            return None;
        }
        let mut open = self.opened();
        if let Some(o) = open.get(id) {
            return Some(o.clone());
        }
        if self.index().get(id).is_some_and(|k| k.ended.is_some()) {
            return None;
        }
        match self.reopen(id) {
            Ok(o) => {
                let o = Arc::new(o);
                open.insert(id.to_owned(), o.clone());
                self.index().entry(id.to_owned()).or_insert(Kept {
                    bytes: 0,
                    ended: None,
                });
                Some(o)
            }
            Err(e) => {
                self.counts.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(session = id, error = %e, "cannot open the session's trace");
                None
            }
        }
    }

    /// Opens `id`'s file to append: its last event's seq and hash read back, a line cut
    /// short by a crash trimmed off.
    fn reopen(&self, id: &str) -> std::io::Result<Open> {
        let path = self.path(id);
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&path)?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        let (mut seq, mut prev, mut output) = (0, chain::GENESIS.to_owned(), 0u64);
        let mut whole = 0;
        for line in text.split_inclusive('\n') {
            let Ok(e) = chain::parse_line(line.trim_end_matches('\n'), 0) else {
                break;
            };
            if !line.ends_with('\n') {
                break;
            }
            seq = e.seq;
            prev = e.hash;
            output += e.data["output_bytes_kept"].as_u64().unwrap_or(0);
            whole += line.len();
        }
        if whole < text.len() {
            tracing::warn!(
                session = id,
                bytes = text.len() - whole,
                "trimmed the end of a trace that a crash cut short"
            );
            file.set_len(whole as u64)?;
            file.seek(SeekFrom::End(0))?;
        }
        let budget = self.config.output_mib << 20;
        let (live, _) = broadcast::channel(LIVE_BACKLOG);
        Ok(Open {
            writer: Mutex::new(Writer {
                file,
                seq,
                prev,
                output_left: budget.saturating_sub(output),
                sealed: false,
            }),
            live,
        })
    }

    /// Appends an event of `kind` to session `id`'s trace; `data` is made with the
    /// session's output budget at hand (an event that keeps output takes it from there and
    /// says how much it kept in `output_bytes_kept`). A write the disk refuses is counted
    /// and logged; the session goes on.
    pub fn record(&self, id: &str, kind: &str, data: impl FnOnce(&mut u64) -> serde_json::Value) {
        let Some(open) = self.writer(id) else { return };
        self.append(id, &open, kind, data);
    }

    fn append(
        &self,
        id: &str,
        open: &Open,
        kind: &str,
        data: impl FnOnce(&mut u64) -> serde_json::Value,
    ) -> Option<String> {
        let mut w = open.writer.lock().unwrap_or_else(|e| e.into_inner());
        if w.sealed {
            return None;
        }
        let data = data(&mut w.output_left);
        let time = now_text();
        let prev = w.prev.clone();
        let (text, hash) = chain::line_of(&chain::Body {
            seq: w.seq + 1,
            time: &time,
            session: id,
            kind,
            data: &data,
            prev: &prev,
        });
        if let Err(e) = w.file.write_all(text.as_bytes()) {
            self.counts.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(session = id, kind, error = %e, "cannot write a trace event");
            return None;
        }
        w.seq += 1;
        w.prev = hash;
        self.counts.events.fetch_add(1, Ordering::Relaxed);
        if let Some(k) = self.index().get_mut(id) {
            k.bytes += text.len() as u64;
        }
        let mut text = text;
        text.pop();
        // Sent under the writer's lock: subscribers get events in their order.
        let _ = open.live.send(Arc::new(Line {
            seq: w.seq,
            kind: kind.to_owned(),
            text,
        }));
        Some(prev)
    }

    /// Session `id` ended: an `ended` event with why, then the seal; the trace is closed
    /// (kept for the retention time).
    pub fn end(&self, id: &str, reason: &str, detail: Option<&str>) {
        let Some(open) = self.writer(id) else { return };
        self.append(
            id,
            &open,
            "ended",
            |_| serde_json::json!({"reason": reason, "detail": detail}),
        );
        let w = open.writer.lock().unwrap_or_else(|e| e.into_inner());
        let events = w.seq;
        let input = chain::seal_input(&w.prev);
        let (key, mac) = self.keys.sign_bytes(&input);
        drop(w);
        self.append(
            id,
            &open,
            chain::SEALED,
            |_| serde_json::json!({"events": events, "key": key, "mac": mac}),
        );
        open.writer.lock().unwrap_or_else(|e| e.into_inner()).sealed = true;
        self.opened().remove(id);
        if let Some(k) = self.index().get_mut(id) {
            k.ended = Some(SystemTime::now());
        }
        self.sweep(SystemTime::now());
    }

    /// Follows session `id`'s events from now on (None: it has no trace, or its trace is
    /// sealed). A trace of an earlier server on the directory is opened for it.
    pub fn subscribe(&self, id: &str) -> Option<broadcast::Receiver<Arc<Line>>> {
        if !self.has(id) {
            return None;
        }
        self.writer(id).map(|o| o.live.subscribe())
    }
}

/// The session id a trace file's path names.
fn trace_id(path: &Path) -> Option<String> {
    if path.extension()? != EXTENSION {
        return None;
    }
    let id = path.file_stem()?.to_str()?;
    valid_id(id).then(|| id.to_owned())
}

/// The `kind` of a line without parsing its data (it follows `session`).
fn kind_of(line: &str) -> Option<String> {
    let at = line.find(",\"kind\":\"")? + ",\"kind\":\"".len();
    let end = line[at..].find('"')?;
    Some(line[at..at + end].to_owned())
}

/// The last line of a file (its last 64 KiB are read: a seal is short).
fn last_line(path: &Path) -> std::io::Result<Option<String>> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let from = len.saturating_sub(64 << 10);
    f.seek(SeekFrom::Start(from))?;
    let mut tail = String::new();
    f.read_to_string(&mut tail)?;
    Ok(tail
        .trim_end_matches('\n')
        .rsplit('\n')
        .next()
        .map(str::to_owned))
}

#[cfg(test)]
mod tests;
