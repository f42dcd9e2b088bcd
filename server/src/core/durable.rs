//! The server's state directory: paused sessions and snapshots on disk, and marks of the
//! running sessions, so that a server started again on the same directory serves what the
//! last one paused and reports what it lost (docs/durable.md).
//!
//! ```text
//! STATE_DIR/
//!   lock                 held (flock) by the serving process: one server per directory
//!   paused/ID.bud        a paused session (vmm's session file; its record inside)
//!   snapshots/SNAP.bud   a snapshot: sessions start from it, it stays
//!   running/ID           a running session's mark, removed when it ends or pauses;
//!                        found at start, it was running when its server died: lost
//!   damaged/             files found torn, foreign or of another version, moved aside;
//!                        counted in the quota, removed after `--damaged-keep-hours`
//!   session.key          the key that signs session files, when no `--session-key-file`
//!                        is given (made at the first start, mode 0600)
//! ```
//!
//! Every session file is signed with the server's session key (vmm's `session_file::mac`)
//! and read only if a key of the server verifies it: a file another node exported, and
//! files found here at start, the same way (`session_keys`).
//!
//! The directory is made mode 0700 and its files 0600: they hold sessions' memory (their
//! variables, files and secrets). A session file is written atomically (vmm's `session_file`: temporary file, fsync,
//! rename, fsync of the folder), so a crash mid-pause leaves the session either paused in
//! whole or not at all. The files' sizes count against a quota (`--state-quota-mib`).
//!
//! This is core data: what is on disk and the records in the files. Pausing, resuming and
//! snapshotting sessions is the service's (`service::durable`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// Version of [`SessionRecord`] and [`SnapshotRecord`] (in the session file's record).
pub const RECORD_VERSION: u32 = 1;

/// Why the state directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DurableError {
    #[error("state directory {dir} is in use by another bud serve ({holder})")]
    Locked { dir: PathBuf, holder: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("state directory {dir} cannot be written by this server: {source}")]
    NotWritable {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Keys(#[from] crate::core::session_keys::SessionKeyError),
}

impl DurableError {
    /// What went wrong without the state directory's paths (for an HTTP answer).
    pub fn without_path(&self) -> String {
        match self {
            DurableError::Locked { holder, .. } => {
                format!("the state directory is in use ({holder})")
            }
            DurableError::Io { source, .. } | DurableError::NotWritable { source, .. } => {
                format!("the state directory: {source}")
            }
            DurableError::Keys(_) => "the session key could not be read".to_owned(),
        }
    }
}

/// How a state directory is kept (`bud serve`'s flags).
#[derive(Debug, Clone)]
pub struct StateOptions {
    /// Bytes its files may take (`--state-quota-mib`).
    pub quota: u64,
    /// The session keys' file (`--session-key-file`); None: `session.key` in the directory.
    pub key_file: Option<PathBuf>,
    /// How long a damaged file is kept (`--damaged-keep-hours`).
    pub damaged_keep: Duration,
}

impl StateOptions {
    /// A quota, the directory's own key, damaged files kept a day.
    pub fn quota(quota: u64) -> Self {
        Self {
            quota,
            key_file: None,
            damaged_keep: Duration::from_secs(24 * 3600),
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DurableError + '_ {
    move |source| DurableError::Io {
        path: path.to_owned(),
        source,
    }
}

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
    pub env: BTreeMap<String, String>,
    pub metadata: serde_json::Value,
    pub parent: Option<String>,
    pub template: String,
    /// Paused instead of ended when its time is up.
    pub auto_pause: bool,
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
}

/// What a snapshot is besides its VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub version: u32,
    pub id: String,
    pub created_at_ms: u64,
    /// The session it was taken of.
    pub source: String,
    pub language: vmm::Language,
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

/// What [`StateDir::open`] found.
#[derive(Debug, Default)]
pub struct Found {
    /// Sessions that were running when the last server stopped without ending them.
    pub lost: Vec<String>,
    /// Files set aside, with why.
    pub damaged: Vec<(PathBuf, String)>,
}

/// The state directory, locked (module docs).
#[derive(Debug)]
pub struct StateDir {
    root: PathBuf,
    /// [`StateDir::holder`]'s name (computed at open: resolving the path later may be
    /// outside the jail's system calls).
    holder: String,
    _lock: File,
    quota: u64,
    /// Bytes of its files (damaged ones too) and of the reservations held now.
    used: AtomicU64,
    /// The keys session files are signed and checked with.
    keys: vmm::session_file::SessionKeys,
    damaged_keep: Duration,
    /// Files in `damaged/`: path, bytes, when set aside.
    damaged: Mutex<Vec<(PathBuf, u64, SystemTime)>>,
    paused: Mutex<HashMap<String, Paused>>,
    snapshots: Mutex<HashMap<String, Snapshot>>,
    /// Sessions being resumed now (a second request for one waits for the first).
    resuming: Mutex<HashSet<String>>,
    pub resumed: tokio::sync::Notify,
    /// Pauses, resumes and snapshots taken by this server (for metrics).
    pub pauses: AtomicU64,
    pub resumes: AtomicU64,
    pub snapshots_taken: AtomicU64,
    /// Executors of older templates that paused sessions still need, by key.
    old_executors: Mutex<HashMap<String, std::sync::Arc<vmm::Executor>>>,
}

/// What `/metrics` shows of the state directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateGauges {
    pub paused: usize,
    pub snapshots: usize,
    pub bytes: u64,
    pub pauses: u64,
    pub resumes: u64,
    pub snapshots_taken: u64,
}

pub fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub fn from_epoch_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Ids are made by the server (`ses_` or `snap_` and hex): anything else is no file of ours.
/// The same length limit as an import's ([`crate::core::node::MAX_ID_LEN`]).
fn plain_id(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= crate::core::node::MAX_ID_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl StateDir {
    /// Opens (creating it) and locks `root`, reads the paused sessions and snapshots in it
    /// (their headers and records, not their pages), sets aside damaged files and collects
    /// the marks of sessions that were running.
    /// Says so at once if it cannot write in it (not at the first pause).
    pub fn open(root: &Path, opts: &StateOptions) -> Result<(Self, Found), DurableError> {
        for sub in ["paused", "snapshots", "running", "damaged"] {
            let d = root.join(sub);
            std::fs::create_dir_all(&d).map_err(|source| DurableError::NotWritable {
                dir: root.to_owned(),
                source,
            })?;
        }
        probe_writable(root)?;
        // Its files are sessions' memory: the serving user's alone.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700)).map_err(io(root))?;
        let lock_path = root.join("lock");
        let lock_file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        // SAFETY: flock on an fd this function owns; it touches no memory.
        let rc = unsafe { libc::flock(lock_file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let holder = std::fs::read_to_string(&lock_path).unwrap_or_default();
            return Err(DurableError::Locked {
                dir: root.to_owned(),
                holder: format!("pid {}", holder.trim()),
            });
        }
        lock_file.set_len(0).map_err(io(&lock_path))?;
        std::io::Write::write_all(&mut &lock_file, std::process::id().to_string().as_bytes())
            .map_err(io(&lock_path))?;
        let holder = {
            use sha2::Digest;
            let path = root.canonicalize().unwrap_or_else(|_| root.to_owned());
            let digest = sha2::Sha256::digest(path.as_os_str().as_encoded_bytes());
            let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
            format!("state-{hex}")
        };
        let keys = crate::core::session_keys::load(root, opts.key_file.as_deref())?;
        let dir = Self {
            holder,
            root: root.to_owned(),
            _lock: lock_file,
            quota: opts.quota,
            used: AtomicU64::new(0),
            keys,
            damaged_keep: opts.damaged_keep,
            damaged: Mutex::default(),
            paused: Mutex::default(),
            snapshots: Mutex::default(),
            resuming: Mutex::default(),
            resumed: tokio::sync::Notify::new(),
            pauses: AtomicU64::new(0),
            resumes: AtomicU64::new(0),
            snapshots_taken: AtomicU64::new(0),
            old_executors: Mutex::default(),
        };
        let mut found = Found::default();
        dir.scan("paused", &mut found, |d, id, bytes, key, rec| {
            let record: SessionRecord = serde_json::from_slice(rec).map_err(|e| e.to_string())?;
            if record.id != id || record.version != RECORD_VERSION {
                return Err(format!(
                    "its record is for {} (version {})",
                    record.id, record.version
                ));
            }
            lock(&d.paused).insert(
                id.to_owned(),
                Paused {
                    record,
                    bytes,
                    key,
                    written_here: false,
                },
            );
            Ok(())
        })?;
        dir.scan("snapshots", &mut found, |d, id, bytes, key, rec| {
            let record: SnapshotRecord = serde_json::from_slice(rec).map_err(|e| e.to_string())?;
            if record.id != id || record.version != RECORD_VERSION {
                return Err(format!(
                    "its record is for {} (version {})",
                    record.id, record.version
                ));
            }
            let pages_checked = Default::default();
            let s = Snapshot {
                record,
                bytes,
                key,
                pages_checked,
            };
            lock(&d.snapshots).insert(id.to_owned(), s);
            Ok(())
        })?;
        dir.count_damaged();
        let running = root.join("running");
        for entry in std::fs::read_dir(&running).map_err(io(&running))? {
            let entry = entry.map_err(io(&running))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let _ = std::fs::remove_file(entry.path());
            if plain_id(&name) && !lock(&dir.paused).contains_key(&name) {
                found.lost.push(name);
            }
        }
        Ok((dir, found))
    }

    /// Reads every `*.bud` of `sub`, giving `add` its id, size and record; moves what
    /// fails to `damaged/` with why. Leftover temporary files (a crash mid-write) go.
    fn scan(
        &self,
        sub: &str,
        found: &mut Found,
        add: impl Fn(&Self, &str, u64, String, &[u8]) -> Result<(), String>,
    ) -> Result<(), DurableError> {
        let d = self.root.join(sub);
        for entry in std::fs::read_dir(&d).map_err(io(&d))? {
            let entry = entry.map_err(io(&d))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".tmp") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let id = name.strip_suffix(".bud").filter(|id| plain_id(id));
            let checked = match id {
                None => Err("not a session file's name".to_owned()),
                Some(id) => vmm::session_file::read(&path, &self.keys)
                    .map_err(|e| e.to_string())
                    .and_then(|f| {
                        let bytes = entry.metadata().map_or(0, |m| m.len());
                        add(self, id, bytes, f.template().to_owned(), f.app())?;
                        self.used.fetch_add(bytes, Ordering::Relaxed);
                        Ok(())
                    }),
            };
            if let Err(why) = checked {
                let aside = self.root.join("damaged").join(format!("{sub}-{name}"));
                let _ = std::fs::rename(&path, &aside);
                found.damaged.push((path, why));
            }
        }
        Ok(())
    }

    /// Lists `damaged/` (at open: a jailed server may not list folders) into
    /// [`StateDir::damaged`], its bytes counted in the quota, then prunes it.
    fn count_damaged(&self) {
        let d = self.root.join("damaged");
        let Ok(entries) = std::fs::read_dir(&d) else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(m) = entry.metadata() else { continue };
            use std::os::unix::fs::MetadataExt;
            // When it was set aside: a rename sets a file's ctime.
            let aside = SystemTime::UNIX_EPOCH + Duration::from_secs(m.ctime().max(0) as u64);
            self.used.fetch_add(m.len(), Ordering::SeqCst);
            lock(&self.damaged).push((entry.path(), m.len(), aside));
        }
        self.prune_damaged();
    }

    /// Removes the damaged files kept longer than `--damaged-keep-hours` (no folder
    /// listing: it runs on job threads too, which the jail does not let list folders).
    pub fn prune_damaged(&self) {
        let now = SystemTime::now();
        let mut gone = 0;
        lock(&self.damaged).retain(|(path, bytes, aside)| {
            let old = now.duration_since(*aside).unwrap_or_default() >= self.damaged_keep;
            let removed = old
                && match std::fs::remove_file(path) {
                    Ok(()) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::NotFound,
                };
            if removed {
                gone += bytes;
            }
            !removed
        });
        self.give_back(gone);
    }

    /// The keys session files are signed and checked with.
    pub fn keys(&self) -> &vmm::session_file::SessionKeys {
        &self.keys
    }

    /// Holds `bytes` of the quota for a file about to be written (`None` past the quota):
    /// the check and the count are one step, so two writers never both pass.
    pub fn reserve(self: &std::sync::Arc<Self>, bytes: u64) -> Option<Reservation> {
        let r = Reservation {
            dir: self.clone(),
            bytes: 0,
        };
        r.grown(bytes)
    }

    fn take(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_add(bytes).filter(|&n| n <= self.quota)
            })
            .is_ok()
    }

    fn give_back(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                Some(used.saturating_sub(bytes))
            });
    }
}

/// Bytes of a state directory's quota held for a file being written (an upload as it
/// streams, a pause), given back when dropped; the file's own bytes are counted when it is
/// recorded (`add_paused`, `add_snapshot`).
#[derive(Debug)]
pub struct Reservation {
    dir: std::sync::Arc<StateDir>,
    bytes: u64,
}

impl Reservation {
    /// `more` bytes held too, if they fit.
    pub fn grow(&mut self, more: u64) -> bool {
        if !self.dir.take(more) {
            return false;
        }
        self.bytes += more;
        true
    }

    fn grown(mut self, more: u64) -> Option<Self> {
        self.grow(more).then_some(self)
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.dir.give_back(self.bytes);
    }
}

/// Creates and removes a file in each folder of `root`: a directory this server cannot
/// write is an error at start, not at the first pause.
fn probe_writable(root: &Path) -> Result<(), DurableError> {
    for sub in ["paused", "snapshots", "running", "damaged"] {
        let probe = root
            .join(sub)
            .join(format!(".probe-{}.tmp", std::process::id()));
        let made = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&probe)
            .and_then(|_| std::fs::remove_file(&probe));
        if let Err(source) = made {
            return Err(DurableError::NotWritable {
                dir: root.to_owned(),
                source,
            });
        }
    }
    Ok(())
}

impl StateDir {
    /// [`probe_writable`] again (after the server dropped to `--user`).
    pub fn probe_writable(&self) -> Result<(), DurableError> {
        probe_writable(&self.root)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn paused_path(&self, id: &str) -> PathBuf {
        self.root.join("paused").join(format!("{id}.bud"))
    }

    pub fn snapshot_path(&self, id: &str) -> PathBuf {
        self.root.join("snapshots").join(format!("{id}.bud"))
    }

    /// Marks session `id` running (not synced: a mark lost with the machine makes a lost
    /// session a 404 rather than a 410).
    pub fn mark_running(&self, id: &str) {
        let _ = File::create(self.root.join("running").join(id));
    }

    pub fn unmark_running(&self, id: &str) {
        let _ = std::fs::remove_file(self.root.join("running").join(id));
    }

    /// Bytes of files in it, and its quota.
    pub fn usage(&self) -> (u64, u64) {
        (self.used.load(Ordering::Relaxed), self.quota)
    }

    /// Whether `more` bytes fit under the quota.
    pub fn fits(&self, more: u64) -> bool {
        self.used.load(Ordering::Relaxed).saturating_add(more) <= self.quota
    }

    pub fn add_paused(&self, p: Paused) {
        self.used.fetch_add(p.bytes, Ordering::Relaxed);
        lock(&self.paused).insert(p.record.id.clone(), p);
    }

    pub fn paused(&self, id: &str) -> Option<Paused> {
        lock(&self.paused).get(id).cloned()
    }

    pub fn list_paused(&self) -> Vec<Paused> {
        let mut all: Vec<_> = lock(&self.paused).values().cloned().collect();
        all.sort_by_key(|p| (p.record.created_at_ms, p.record.id.clone()));
        all
    }

    /// Forgets paused session `id` and removes its file (it was resumed or deleted).
    pub fn remove_paused(&self, id: &str) -> Option<Paused> {
        let p = lock(&self.paused).remove(id)?;
        let _ = std::fs::remove_file(self.paused_path(id));
        self.used
            .fetch_sub(p.bytes.min(self.used()), Ordering::Relaxed);
        Some(p)
    }

    fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn add_snapshot(&self, s: Snapshot) {
        self.used.fetch_add(s.bytes, Ordering::Relaxed);
        lock(&self.snapshots).insert(s.record.id.clone(), s);
    }

    pub fn snapshot(&self, id: &str) -> Option<Snapshot> {
        lock(&self.snapshots).get(id).cloned()
    }

    pub fn list_snapshots(&self) -> Vec<Snapshot> {
        let mut all: Vec<_> = lock(&self.snapshots).values().cloned().collect();
        all.sort_by_key(|s| (s.record.created_at_ms, s.record.id.clone()));
        all
    }

    pub fn remove_snapshot(&self, id: &str) -> Option<Snapshot> {
        let s = lock(&self.snapshots).remove(id)?;
        let _ = std::fs::remove_file(self.snapshot_path(id));
        self.used
            .fetch_sub(s.bytes.min(self.used()), Ordering::Relaxed);
        Some(s)
    }

    /// Moves paused session `id`'s file to `damaged/` and forgets it (it cannot be
    /// resumed); its bytes stay counted until `damaged/` is pruned.
    pub fn set_aside_paused(&self, id: &str) {
        if let Some(p) = lock(&self.paused).remove(id) {
            let aside = self.root.join("damaged").join(format!("paused-{id}.bud"));
            if std::fs::rename(self.paused_path(id), &aside).is_ok() {
                lock(&self.damaged).push((aside, p.bytes, SystemTime::now()));
            } else {
                self.give_back(p.bytes);
            }
            self.prune_damaged();
        }
    }

    /// A temporary file's path in `paused/` for an upload (removed at the next start if
    /// left behind).
    pub fn upload_path(&self, n: u64) -> PathBuf {
        self.root.join("paused").join(format!(".upload-{n}.tmp"))
    }

    /// Moves verified upload `tmp` into place as paused session `p`'s file (renamed, the
    /// folder fsync'd) and records it, unless a paused session of its id is here already
    /// (`Ok(false)`): the check and the rename are one step. Its bytes are counted here;
    /// the caller's reservation for the upload is given back after.
    pub fn adopt_upload(&self, tmp: &Path, p: Paused) -> Result<bool, DurableError> {
        let mut paused = lock(&self.paused);
        if paused.contains_key(&p.record.id) {
            return Ok(false);
        }
        let path = self.paused_path(&p.record.id);
        std::fs::rename(tmp, &path).map_err(io(&path))?;
        let dir = self.root.join("paused");
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))?;
        self.used.fetch_add(p.bytes, Ordering::SeqCst);
        paused.insert(p.record.id.clone(), p);
        Ok(true)
    }

    /// The name this directory pins templates under (`vmm::Template::pin`): its path's
    /// hash, so that two state directories never take each other's pins.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Whether any paused session or snapshot here was made on template `key`.
    pub fn needs(&self, key: &str) -> bool {
        lock(&self.paused).values().any(|p| p.key == key)
            || lock(&self.snapshots).values().any(|s| s.key == key)
    }

    /// The executor kept for an older template `key` (sessions paused before their
    /// template was rebuilt resume on it), if one was made.
    pub fn old_executor(&self, key: &str) -> Option<std::sync::Arc<vmm::Executor>> {
        lock(&self.old_executors).get(key).cloned()
    }

    pub fn keep_old_executor(&self, key: &str, e: std::sync::Arc<vmm::Executor>) {
        lock(&self.old_executors).insert(key.to_owned(), e);
    }

    /// What `/metrics` shows of it.
    pub fn gauges(&self) -> StateGauges {
        StateGauges {
            paused: lock(&self.paused).len(),
            snapshots: lock(&self.snapshots).len(),
            bytes: self.used(),
            pauses: self.pauses.load(Ordering::Relaxed),
            resumes: self.resumes.load(Ordering::Relaxed),
            snapshots_taken: self.snapshots_taken.load(Ordering::Relaxed),
        }
    }

    /// Claims the resume of `id`: false if another request resumes it now.
    pub fn claim_resume(&self, id: &str) -> bool {
        lock(&self.resuming).insert(id.to_owned())
    }

    pub fn release_resume(&self, id: &str) {
        lock(&self.resuming).remove(id);
        self.resumed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_server_on_one_directory_is_refused_and_marks_become_lost_sessions() {
        let root = std::env::temp_dir().join(format!("bud-durable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (first, found) = StateDir::open(&root, &StateOptions::quota(1 << 30)).unwrap();
        first.mark_running("ses_1");
        first.mark_running("ses_2");
        first.unmark_running("ses_2");
        std::fs::write(root.join("paused/ses_9.bud"), b"not a session").unwrap();

        let second = StateDir::open(&root, &StateOptions::quota(1 << 30));
        drop(first);
        // Other tests of this binary fork children (the jail's), which hold a copy of the
        // lock's file description until they exit: a moment.
        let mut third = StateDir::open(&root, &StateOptions::quota(1 << 30));
        for _ in 0..200 {
            if !matches!(third, Err(DurableError::Locked { .. })) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
            third = StateDir::open(&root, &StateOptions::quota(1 << 30));
        }
        let (_third, again) = third.unwrap();

        assert!(found.lost.is_empty() && found.damaged.is_empty());
        assert!(
            matches!(&second, Err(DurableError::Locked { holder, .. }) if holder == &format!("pid {}", std::process::id())),
            "{second:?}"
        );
        assert_eq!(again.lost, vec!["ses_1".to_owned()]);
        assert_eq!(again.damaged.len(), 1);
        assert!(root.join("damaged/paused-ses_9.bud").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

    fn scratch(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!("bud-durable-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        root
    }

    #[test]
    fn reservations_never_pass_the_quota_together_and_are_given_back() {
        let root = scratch("reserve");
        let (dir, _) = StateDir::open(&root, &StateOptions::quota(1000)).unwrap();
        let dir = std::sync::Arc::new(dir);

        let first = dir.reserve(600);
        let second = dir.reserve(600);
        let (first_held, second_held) = (first.is_some(), second.is_some());
        let mut growing = dir.reserve(0).unwrap();
        let grew = growing.grow(400);
        let past = growing.grow(1);
        drop(first);
        drop(growing);
        let after = dir.usage().0;

        assert!(
            first_held && !second_held,
            "two reservations passed the quota"
        );
        assert!(grew && !past);
        assert_eq!(after, 0);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn damaged_files_count_in_the_quota_and_old_ones_are_pruned() {
        let root = scratch("damaged");
        let (dir, _) = StateDir::open(&root, &StateOptions::quota(1 << 20)).unwrap();
        std::fs::write(root.join("paused/ses_x.bud"), vec![1u8; 3000]).unwrap();
        drop(dir);
        let keep = StateOptions::quota(1 << 20);
        let prune = StateOptions {
            damaged_keep: Duration::ZERO,
            ..StateOptions::quota(1 << 20)
        };

        let (kept, found) = StateDir::open(&root, &keep).unwrap();
        let counted = kept.usage().0;
        drop(kept);
        let (pruned, _) = StateDir::open(&root, &prune).unwrap();

        assert_eq!(found.damaged.len(), 1, "not a signed file: set aside");
        assert_eq!(counted, 3000);
        assert_eq!(pruned.usage().0, 0);
        assert!(!root.join("damaged/paused-ses_x.bud").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_state_directory_that_cannot_be_written_is_an_error_at_open() {
        use std::os::unix::fs::PermissionsExt;
        let root = scratch("readonly");
        for sub in ["paused", "snapshots", "running", "damaged"] {
            std::fs::create_dir_all(root.join(sub)).unwrap();
        }
        std::fs::set_permissions(root.join("paused"), std::fs::Permissions::from_mode(0o500))
            .unwrap();
        // Root writes anywhere: the folder is taken away instead.
        let as_root = unsafe_is_root();
        if as_root {
            std::fs::remove_dir_all(root.join("paused")).unwrap();
            std::fs::write(root.join("paused"), b"a file, not a folder").unwrap();
        }

        let opened = StateDir::open(&root, &StateOptions::quota(1 << 20));

        assert!(
            matches!(opened, Err(DurableError::NotWritable { .. })),
            "{opened:?}"
        );
        let _ =
            std::fs::set_permissions(root.join("paused"), std::fs::Permissions::from_mode(0o700));
        std::fs::remove_dir_all(&root).unwrap();
    }

    fn unsafe_is_root() -> bool {
        // SAFETY: geteuid has no preconditions and touches no memory.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn ids_of_a_long_node_id_are_plain_ids_and_the_limit_is_an_imports() {
        let long = format!("ses_{}_{}", "n".repeat(63), "0".repeat(32));
        let too_long = format!("ses_{}", "a".repeat(crate::core::node::MAX_ID_LEN));

        assert_eq!(long.len(), 100);
        assert!(plain_id(&long) && crate::core::node::is_session_id(&long));
        assert!(!plain_id(&too_long) && !crate::core::node::is_session_id(&too_long));
    }
}
