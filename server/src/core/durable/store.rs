//! One folder of the state directory's session files, known by id: the paused sessions
//! (`paused/`) or the snapshots (`snapshots/`). Both are kept the same way (a file per id,
//! its bytes counted in the quota, listed oldest first); what differs is the kind ([`Kept`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::RECORD_VERSION;
use super::quota::Quota;

/// A kind of file a [`Store`] keeps: what the server knows of one (its record, size and
/// template's key), and the folder they are in.
pub trait Kept: Clone {
    /// What its session file records of it.
    type Record: serde::de::DeserializeOwned;
    /// Its folder in the state directory.
    const FOLDER: &'static str;
    /// One found in the folder at start (not written by this server).
    fn found(record: Self::Record, bytes: u64, key: String) -> Self;
    /// The id and version a record says it is of.
    fn names(record: &Self::Record) -> (&str, u32);
    fn id(&self) -> &str;
    fn created_at_ms(&self) -> u64;
    /// Bytes of its file.
    fn bytes(&self) -> u64;
    /// The key of the template its file was made on.
    fn key(&self) -> &str;
}

/// The files of one kind (module docs).
#[derive(Debug)]
pub struct Store<T> {
    folder: PathBuf,
    quota: Arc<Quota>,
    items: Mutex<HashMap<String, T>>,
}

impl<T: Kept> Store<T> {
    pub(super) fn new(root: &Path, quota: Arc<Quota>) -> Self {
        Self {
            folder: root.join(T::FOLDER),
            quota,
            items: Mutex::default(),
        }
    }

    /// The file of `id`.
    pub fn path(&self, id: &str) -> PathBuf {
        self.folder.join(format!("{id}.bud"))
    }

    /// Records one whose file was just written here; its bytes count in the quota.
    pub fn add(&self, item: T) {
        self.quota.add(item.bytes());
        self.items().insert(item.id().to_owned(), item);
    }

    pub fn get(&self, id: &str) -> Option<T> {
        self.items().get(id).cloned()
    }

    /// All of them, oldest first.
    pub fn list(&self) -> Vec<T> {
        let mut all: Vec<T> = self.items().values().cloned().collect();
        all.sort_by(|a, b| (a.created_at_ms(), a.id()).cmp(&(b.created_at_ms(), b.id())));
        all
    }

    /// Forgets `id` and removes its file (a paused session resumed or deleted, a snapshot
    /// deleted); its bytes are given back.
    pub fn remove(&self, id: &str) -> Option<T> {
        let item = self.items().remove(id)?;
        let _ = std::fs::remove_file(self.path(id));
        self.quota.give_back(item.bytes());
        Some(item)
    }

    /// Those for which `keep` holds, in no order (only those are copied: a sweep or a
    /// gauge looks at every one every second).
    pub fn matching(&self, keep: impl Fn(&T) -> bool) -> Vec<T> {
        self.items().values().filter(|i| keep(i)).cloned().collect()
    }

    /// How many there are for which `keep` holds.
    pub fn count(&self, keep: impl Fn(&T) -> bool) -> usize {
        self.items().values().filter(|i| keep(i)).count()
    }

    pub fn len(&self) -> usize {
        self.items().len()
    }

    pub fn is_empty(&self) -> bool {
        self.items().is_empty()
    }

    /// Whether any was made on template `key`.
    pub fn made_on(&self, key: &str) -> bool {
        self.items().values().any(|i| i.key() == key)
    }

    /// Forgets `id`, leaving its file and its bytes' count to the caller.
    pub(super) fn take(&self, id: &str) -> Option<T> {
        self.items().remove(id)
    }

    /// The map itself, for a check and an insert that must be one step.
    pub(super) fn items(&self) -> MutexGuard<'_, HashMap<String, T>> {
        self.items.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records file `id` found at start, from its session file's record: it must name
    /// `id` at this server's [`RECORD_VERSION`].
    pub(super) fn load(
        &self,
        id: &str,
        bytes: u64,
        key: String,
        record: &[u8],
    ) -> Result<(), String> {
        let record: T::Record = serde_json::from_slice(record).map_err(|e| e.to_string())?;
        let (named, version) = T::names(&record);
        if named != id || version != RECORD_VERSION {
            return Err(format!("its record is for {named} (version {version})"));
        }
        self.add(T::found(record, bytes, key));
        Ok(())
    }
}
