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

mod quota;
mod records;
mod store;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

pub use quota::{Quota, Reservation};
pub use records::{
    MAX_CARRIED_TRACE, ParkedUntil, Paused, ProcessRecord, RECORD_VERSION, SessionRecord, Snapshot,
    SnapshotRecord, epoch_ms, from_epoch_ms,
};
pub use store::{Kept, Store};

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
    /// Bytes of its files (damaged ones too) and of the reservations held now.
    quota: Arc<Quota>,
    /// The keys session files are signed and checked with.
    keys: vmm::session_file::SessionKeys,
    damaged_keep: Duration,
    /// Files in `damaged/`: path, bytes, when set aside.
    damaged: Mutex<Vec<(PathBuf, u64, SystemTime)>>,
    paused: Store<Paused>,
    snapshots: Store<Snapshot>,
    /// Sessions being resumed now (a second request for one waits for the first).
    resuming: Mutex<HashSet<String>>,
    pub resumed: tokio::sync::Notify,
    /// Pauses, resumes and snapshots taken by this server (for metrics).
    pub pauses: AtomicU64,
    /// Sessions parked for idling (`--park-idle-s`), counted apart from pauses.
    pub parks: AtomicU64,
    pub resumes: AtomicU64,
    pub snapshots_taken: AtomicU64,
    /// Executors of older templates that paused sessions still need, by key.
    old_executors: Mutex<HashMap<String, std::sync::Arc<vmm::Executor>>>,
}

/// What `/metrics` shows of the state directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateGauges {
    pub paused: usize,
    /// Of the paused, those parked now (shown running).
    pub parked: usize,
    pub snapshots: usize,
    pub bytes: u64,
    pub pauses: u64,
    pub parks: u64,
    pub resumes: u64,
    pub snapshots_taken: u64,
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
        let quota = Arc::new(Quota::new(opts.quota));
        let dir = Self {
            holder,
            root: root.to_owned(),
            _lock: lock_file,
            paused: Store::new(root, quota.clone()),
            snapshots: Store::new(root, quota.clone()),
            quota,
            keys,
            damaged_keep: opts.damaged_keep,
            damaged: Mutex::default(),
            resuming: Mutex::default(),
            resumed: tokio::sync::Notify::new(),
            pauses: AtomicU64::new(0),
            parks: AtomicU64::new(0),
            resumes: AtomicU64::new(0),
            snapshots_taken: AtomicU64::new(0),
            old_executors: Mutex::default(),
        };
        let mut found = Found::default();
        dir.scan(&dir.paused, &mut found)?;
        dir.scan(&dir.snapshots, &mut found)?;
        dir.count_damaged();
        let running = root.join("running");
        for entry in std::fs::read_dir(&running).map_err(io(&running))? {
            let entry = entry.map_err(io(&running))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let _ = std::fs::remove_file(entry.path());
            if plain_id(&name) && dir.paused.get(&name).is_none() {
                found.lost.push(name);
            }
        }
        Ok((dir, found))
    }

    /// Reads every `*.bud` of `store`'s folder into it (their headers and records); moves
    /// what fails to `damaged/` with why. Leftover temporary files (a crash mid-write) go.
    fn scan<T: Kept>(&self, store: &Store<T>, found: &mut Found) -> Result<(), DurableError> {
        let sub = T::FOLDER;
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
                        store.load(id, bytes, f.template().to_owned(), f.app())
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
            self.quota.add(m.len());
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
        self.quota.give_back(gone);
    }

    /// The keys session files are signed and checked with.
    pub fn keys(&self) -> &vmm::session_file::SessionKeys {
        &self.keys
    }

    /// Holds `bytes` of the quota for a file about to be written (`None` past the quota):
    /// the check and the count are one step, so two writers never both pass.
    pub fn reserve(&self, bytes: u64) -> Option<Reservation> {
        self.quota.reserve(bytes)
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

    /// The paused sessions.
    pub fn paused(&self) -> &Store<Paused> {
        &self.paused
    }

    /// The snapshots.
    pub fn snapshots(&self) -> &Store<Snapshot> {
        &self.snapshots
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
        (self.quota.used(), self.quota.limit())
    }

    /// Whether `more` bytes fit under the quota.
    pub fn fits(&self, more: u64) -> bool {
        self.quota.fits(more)
    }

    /// Moves paused session `id`'s file to `damaged/` and forgets it (it cannot be
    /// resumed); its bytes stay counted until `damaged/` is pruned.
    pub fn set_aside_paused(&self, id: &str) {
        if let Some(p) = self.paused.take(id) {
            let aside = self.root.join("damaged").join(format!("paused-{id}.bud"));
            if std::fs::rename(self.paused.path(id), &aside).is_ok() {
                lock(&self.damaged).push((aside, p.bytes, SystemTime::now()));
            } else {
                self.quota.give_back(p.bytes);
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
        let mut paused = self.paused.items();
        if paused.contains_key(&p.record.id) {
            return Ok(false);
        }
        let path = self.paused.path(&p.record.id);
        std::fs::rename(tmp, &path).map_err(io(&path))?;
        let dir = self.root.join("paused");
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))?;
        self.quota.add(p.bytes);
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
        self.paused.made_on(key) || self.snapshots.made_on(key)
    }

    /// The executor kept for an older template `key` (sessions paused before their
    /// template was rebuilt resume on it), if one was made.
    pub fn old_executor(&self, key: &str) -> Option<std::sync::Arc<vmm::Executor>> {
        lock(&self.old_executors).get(key).cloned()
    }

    pub fn keep_old_executor(&self, key: &str, e: std::sync::Arc<vmm::Executor>) {
        lock(&self.old_executors).insert(key.to_owned(), e);
    }

    /// Paused sessions that are parked now ([`SessionRecord::parked_at`]).
    pub fn parked_now(&self) -> usize {
        let now = epoch_ms(SystemTime::now());
        self.paused.count(|p| p.record.parked_at(now))
    }

    /// What `/metrics` shows of it.
    pub fn gauges(&self) -> StateGauges {
        StateGauges {
            paused: self.paused.len(),
            parked: self.parked_now(),
            snapshots: self.snapshots.len(),
            bytes: self.quota.used(),
            pauses: self.pauses.load(Ordering::Relaxed),
            parks: self.parks.load(Ordering::Relaxed),
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
mod tests;
