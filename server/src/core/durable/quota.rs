//! The state directory's quota (`--state-quota-mib`): the bytes of its files (damaged ones
//! too) and of the reservations held for files being written.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes used and the most that may be (module docs).
#[derive(Debug)]
pub struct Quota {
    limit: u64,
    used: AtomicU64,
}

impl Quota {
    pub(super) fn new(limit: u64) -> Self {
        Self {
            limit,
            used: AtomicU64::new(0),
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// Whether `more` bytes fit.
    pub fn fits(&self, more: u64) -> bool {
        self.used().saturating_add(more) <= self.limit
    }

    /// Counts `bytes` of a file that is there (written, found), whether or not they fit.
    pub(super) fn add(&self, bytes: u64) {
        self.used.fetch_add(bytes, Ordering::SeqCst);
    }

    /// Takes `bytes` if they fit: the check and the count are one step.
    fn take(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_add(bytes).filter(|&n| n <= self.limit)
            })
            .is_ok()
    }

    pub(super) fn give_back(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                Some(used.saturating_sub(bytes))
            });
    }

    /// Holds `bytes` for a file about to be written (`None` past the quota), so that two
    /// writers never both pass.
    pub(super) fn reserve(self: &Arc<Self>, bytes: u64) -> Option<Reservation> {
        let mut r = Reservation {
            quota: self.clone(),
            bytes: 0,
        };
        r.grow(bytes).then_some(r)
    }
}

/// Bytes of a state directory's quota held for a file being written (an upload as it
/// streams, a pause), given back when dropped; the file's own bytes are counted when it is
/// recorded (`Store::add`).
#[derive(Debug)]
pub struct Reservation {
    quota: Arc<Quota>,
    bytes: u64,
}

impl Reservation {
    /// `more` bytes held too, if they fit.
    pub fn grow(&mut self, more: u64) -> bool {
        if !self.quota.take(more) {
            return false;
        }
        self.bytes += more;
        true
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.quota.give_back(self.bytes);
    }
}
