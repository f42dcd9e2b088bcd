//! What a session file holds besides its VM (its record: a paused session's settings, a
//! snapshot's), and what the server knows of each file it keeps.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::store::Kept;

/// Version of [`SessionRecord`] and [`SnapshotRecord`] (in the session file's record).
pub const RECORD_VERSION: u32 = 1;

/// A background process as a record keeps it (its output stays behind).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub pid: u32,
    pub start: crate::core::processes::Start,
    pub started_at_ms: u64,
}

impl ProcessRecord {
    pub fn of(i: &crate::core::processes::Info) -> Self {
        Self {
            pid: i.pid,
            start: i.start.clone(),
            started_at_ms: epoch_ms(i.started_at),
        }
    }

    pub fn info(&self) -> crate::core::processes::Info {
        crate::core::processes::Info {
            pid: self.pid,
            start: self.start.clone(),
            started_at: from_epoch_ms(self.started_at_ms),
        }
    }
}

/// What a paused session is besides its VM: its settings, in its session file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionRecord {
    pub version: u32,
    pub id: String,
    pub created_at_ms: u64,
    pub paused_at_ms: u64,
    pub idle_timeout_s: u64,
    /// What was left of its lifetime when it paused (a paused session's lifetime stands
    /// still).
    pub lifetime_left_ms: u64,
    pub language: vmm::Language,
    /// Its default dialect (0 for records older than dialects: JavaScript's, or none).
    #[serde(default)]
    pub dialect: u32,
    pub env: BTreeMap<String, String>,
    pub metadata: serde_json::Value,
    pub parent: Option<String>,
    pub template: String,
    /// Paused instead of ended when its time is up.
    pub auto_pause: bool,
    /// The API key that made it (`crate::core::sessions::Entry::owner`; None in records
    /// older than owners).
    #[serde(default)]
    pub owner: Option<String>,
    /// Its live background processes.
    pub processes: Vec<ProcessRecord>,
    /// Its directory watchers, (id, directory).
    #[serde(default)]
    pub watches: Vec<(u32, String)>,
    /// What an API dialect keeps of it (E2B's sandbox: token, metadata, ...).
    pub attachment: serde_json::Value,
    /// Its code contexts (older records kept them in E2B's attachment).
    #[serde(default)]
    pub contexts: crate::core::contexts::Contexts,
    /// Its network policy (None: no route out, as for records older than networks).
    #[serde(default)]
    pub network: Option<crate::core::egress::PolicySpec>,
    /// Its trace up to the pause (NDJSON), carried in the file so that an import on another
    /// server keeps it (at most [`MAX_CARRIED_TRACE`] bytes). Only in the file: taken out
    /// whenever a record is read, never kept in memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
    /// Parked: paused by the server because it idled (`--park-idle-s`), not by a request or
    /// at its time. It is shown running, and its idle timeout and lifetime go on while it
    /// is on disk: these are when each is up (None: an ordinary pause).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parked: Option<ParkedUntil>,
}

/// When a parked session's idle timeout and lifetime are up (milliseconds since the epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedUntil {
    pub idle_ms: u64,
    pub lifetime_ms: u64,
}

impl SessionRecord {
    /// Whether it is parked and neither its idle timeout nor its lifetime is up at `now_ms`
    /// (one whose time is up is ended then, or, with `auto_pause`, is an ordinary paused
    /// session from then on).
    pub fn parked_at(&self, now_ms: u64) -> bool {
        self.parked_due(now_ms).is_none() && self.parked.is_some()
    }

    /// Why a parked session's time is up at `now_ms`: `idle_timeout` or `max_lifetime`
    /// (the reasons a running session ends with); None if it is not, or is not parked.
    pub fn parked_due(&self, now_ms: u64) -> Option<&'static str> {
        let p = self.parked?;
        if now_ms >= p.lifetime_ms {
            Some("max_lifetime")
        } else if now_ms >= p.idle_ms {
            Some("idle_timeout")
        } else {
            None
        }
    }

    /// What is left of its lifetime if it resumed at `now_ms`: a paused session's stands
    /// still; a parked one's went on until it resumed or its time was up.
    pub fn lifetime_left_at(&self, now_ms: u64) -> Duration {
        let left = match self.parked {
            Some(p) => p.lifetime_ms.saturating_sub(now_ms.min(p.idle_ms)),
            None => self.lifetime_left_ms,
        };
        Duration::from_millis(left.min(self.lifetime_left_ms))
    }
}

/// The largest trace a session's file carries (a larger one stays on its server only).
pub const MAX_CARRIED_TRACE: usize = 8 << 20;

/// What a snapshot is besides its VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub version: u32,
    pub id: String,
    pub created_at_ms: u64,
    /// The session it was taken of.
    pub source: String,
    pub language: vmm::Language,
    #[serde(default)]
    pub dialect: u32,
    pub env: BTreeMap<String, String>,
    pub metadata: serde_json::Value,
    pub template: String,
    pub idle_timeout_s: u64,
    pub processes: Vec<ProcessRecord>,
    #[serde(default)]
    pub watches: Vec<(u32, String)>,
    pub attachment: serde_json::Value,
    #[serde(default)]
    pub contexts: crate::core::contexts::Contexts,
    /// The API key of the session it was taken of (None in records older than owners).
    #[serde(default)]
    pub owner: Option<String>,
    /// The network policy of the session it was taken of (None: no route out).
    #[serde(default)]
    pub network: Option<crate::core::egress::PolicySpec>,
}

/// A paused session known to the server.
#[derive(Debug, Clone)]
pub struct Paused {
    pub record: SessionRecord,
    pub bytes: u64,
    /// The key of the template its file was made on.
    pub key: String,
    /// Written by this server (fsync'd, renamed): its pages are not read back to check
    /// them at resume, as those of a file found at start are.
    pub written_here: bool,
}

/// A snapshot known to the server.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub record: SnapshotRecord,
    pub bytes: u64,
    /// The key of the template its file was made on.
    pub key: String,
    /// Its pages are known good: written by this server, or read back and checked once
    /// (a file found at start is, at the first session started from it).
    pub pages_checked: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// The parts of [`Kept`] that both kinds read from the same fields: the record's id,
/// version and creation, the file's size and template key.
macro_rules! same_fields {
    () => {
        fn names(record: &Self::Record) -> (&str, u32) {
            (&record.id, record.version)
        }

        fn id(&self) -> &str {
            &self.record.id
        }

        fn created_at_ms(&self) -> u64 {
            self.record.created_at_ms
        }

        fn bytes(&self) -> u64 {
            self.bytes
        }

        fn key(&self) -> &str {
            &self.key
        }
    };
}

impl Kept for Paused {
    type Record = SessionRecord;
    const FOLDER: &'static str = "paused";

    fn found(mut record: SessionRecord, bytes: u64, key: String) -> Self {
        record.trace = None;
        Self {
            record,
            bytes,
            key,
            written_here: false,
        }
    }

    same_fields!();
}

impl Kept for Snapshot {
    type Record = SnapshotRecord;
    const FOLDER: &'static str = "snapshots";

    fn found(record: SnapshotRecord, bytes: u64, key: String) -> Self {
        Self {
            record,
            bytes,
            key,
            pages_checked: Default::default(),
        }
    }

    same_fields!();
}

pub fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub fn from_epoch_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}
