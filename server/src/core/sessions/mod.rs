//! The live sessions of the server: a registry of [`vmm::session::Session`]s with their
//! settings, one request at a time each, expiry, caps, and what is left of ended ones.
//!
//! - **One at a time**: a session is *busy* while a cell, file operation or fork runs in it;
//!   a request meanwhile waits for it (at most `--session-max-waiting` at once; past that,
//!   409), unless it can go beside the running one ([`Entry::beside`], [`vmm::beside`]):
//!   file operations beside any request, process operations beside a cell. The VM itself
//!   is only touched on a job thread.
//! - **Ended sessions** (deleted, expired, crashed, timed out past the interrupt) leave a
//!   tombstone saying why, so later calls get 410 Gone with the reason instead of a bare 404;
//!   a DELETE of an ended session removes its tombstone (204). The tombstones kept are
//!   bounded ([`TOMBSTONES_KEPT`], oldest dropped first).
//! - **Caps**: live sessions (`max_sessions`, 429) and the host memory they hold
//!   (`max_sessions_memory_bytes`: every session's private pages plus every fork layer once,
//!   checked before a session is created or forked, 507).
//! - **Expiry**: [`Sessions::reap`] ends sessions idle past their idle timeout or past their
//!   maximum lifetime (or hands them back to be paused, if they asked for that); `bud
//!   serve` runs it every second, and ends every session at shutdown.
//! - **On disk** (with a state directory, [`crate::core::durable`]): a running session has a mark
//!   there from its start to its end or pause, so that a server started after a crash
//!   reports it lost; [`Sessions::take_out`] takes a session out to be paused.
//!
//! A session's own entry is [`entry`]; this module is the registry.

mod entry;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::core::engine::SessionVm;
use entry::Waiting;
pub use entry::{Attachment, AttachmentRules, Busy, Entry, NewSession, listed_for};

/// Ended sessions remembered for a 410.
pub const TOMBSTONES_KEPT: usize = 4096;

/// Why a session ended.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Ended {
    /// `deleted`, `idle_timeout`, `max_lifetime`, `crashed`, `timeout`, `shutdown`.
    pub reason: String,
    /// What happened; for a crash, with the last console lines.
    pub detail: Option<String>,
}
/// What [`Sessions::reap`] hands back to be paused: sessions whose time is up and that
/// asked to be paused, and idle sessions to park.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reaped {
    pub to_pause: Vec<String>,
    pub to_park: Vec<String>,
}

/// Why a session cannot be used now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    Unknown,
    Gone(Ended),
    Busy,
}
/// The registry (module docs).
#[derive(Debug, Default)]
pub struct Sessions {
    live: Mutex<HashMap<String, Arc<Entry>>>,
    ended: Mutex<(HashMap<String, Ended>, VecDeque<String>)>,
    pub created: AtomicU64,
    pub forked: AtomicU64,
    /// Ended sessions by reason (for metrics).
    pub ended_by: Mutex<BTreeMap<String, u64>>,
    /// The state directory, where running sessions are marked.
    marks: std::sync::OnceLock<Arc<crate::core::durable::StateDir>>,
    /// The node whose ids new sessions get.
    node: std::sync::OnceLock<Arc<crate::core::node::Node>>,
    /// Where each session's start, pause and end are traced.
    traces: std::sync::OnceLock<Arc<crate::core::trace::Traces>>,
}

impl Sessions {
    /// Issues session ids of `node` from now on (else of a node named after the host).
    pub fn use_node(&self, node: Arc<crate::core::node::Node>) {
        let _ = self.node.set(node);
    }

    /// This registry's node.
    pub fn node(&self) -> &Arc<crate::core::node::Node> {
        self.node
            .get_or_init(|| Arc::new(crate::core::node::Node::of(&Default::default())))
    }

    /// A new random id of `kind` (`ses`, `snap`) on this node ([`crate::core::node::Node::new_id`]).
    pub fn new_id(&self, kind: &str) -> Result<String, vmm::identity::IdentityError> {
        self.node().new_id(kind)
    }

    /// Traces sessions' starts, pauses and ends in `traces` from now on.
    pub fn use_traces(&self, traces: Arc<crate::core::trace::Traces>) {
        let _ = self.traces.set(traces);
    }

    fn trace(&self, id: &str, kind: &str, data: serde_json::Value) {
        if let Some(t) = self.traces.get() {
            t.record(id, kind, |_| data);
        }
    }

    /// Marks running sessions in `dir` from now on, and remembers `lost` (sessions that
    /// were running when the last server on it stopped) for a 410.
    pub fn use_state_dir(&self, dir: Arc<crate::core::durable::StateDir>, lost: &[String]) {
        let _ = self.marks.set(dir);
        for id in lost {
            self.tombstone(
                id,
                Ended {
                    reason: "lost".into(),
                    detail: Some(
                        "the server stopped while this session was running (it was not paused)"
                            .into(),
                    ),
                },
            );
        }
    }

    /// Remembers that session `id` ended, and why, for a 410.
    pub fn tombstone(&self, id: &str, why: Ended) {
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended.0.insert(id.to_owned(), why);
        ended.1.push_back(id.to_owned());
        while ended.1.len() > TOMBSTONES_KEPT {
            if let Some(old) = ended.1.pop_front() {
                ended.0.remove(&old);
            }
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Live sessions now.
    pub fn count(&self) -> usize {
        self.live().len()
    }

    /// Every live session.
    pub fn list(&self) -> Vec<Arc<Entry>> {
        let mut all: Vec<_> = self.live().values().cloned().collect();
        all.sort_by_key(|e| e.created_at);
        all
    }

    /// Host memory held by all sessions: private pages, and each layer once.
    pub fn memory_bytes(&self) -> u64 {
        let live = self.live();
        let private: u64 = live
            .values()
            .map(|e| e.private_bytes.load(Ordering::Relaxed))
            .sum();
        let mut seen = std::collections::HashSet::new();
        let mut layers = 0;
        for e in live.values() {
            if let Ok(vm) = e.vm.try_lock() {
                for l in vm.iter().flat_map(|s| s.layers()) {
                    if seen.insert(l.id) {
                        layers += l.bytes;
                    }
                }
            } else {
                // Busy: count its layers as last recorded (maybe twice; errs on the safe side).
                layers += e.layer_bytes.load(Ordering::Relaxed);
            }
        }
        private + layers
    }

    /// Registers a started session.
    pub fn insert(
        &self,
        settings: NewSession,
        vm: Box<dyn SessionVm>,
    ) -> Result<Arc<Entry>, vmm::identity::IdentityError> {
        let id = match &settings.again {
            Some((id, _)) => id.clone(),
            None => self.new_id("ses")?,
        };
        let mut vm = vm;
        if let Some(gate) = &settings.network {
            gate.set_origin(crate::core::audit::Origin::here(
                "network",
                &settings.template,
                Some(&id),
            ));
            vm.set_egress(gate.clone());
        }
        let again = settings.again.is_some();
        let e = Arc::new(Entry::new(id, settings, vm.beside()));
        if let Some(t) = self.traces.get() {
            e.processes.trace_to(&e.id, t.clone());
        }
        if again {
            self.trace(
                &e.id,
                "resumed",
                serde_json::json!({"template": e.template}),
            );
        } else {
            self.trace(
                &e.id,
                "created",
                serde_json::json!({
                    "template": e.template,
                    "language": e.language,
                    "parent": e.parent,
                    "metadata": e.metadata,
                    "idle_timeout_s": e.idle_timeout.as_secs(),
                    "network": e.network.as_ref().map(|g| g.shown_policy()),
                }),
            );
        }
        *e.vm.lock().unwrap_or_else(|e| e.into_inner()) = Some(vm);
        if let Some(d) = self.marks.get() {
            d.mark_running(&e.id);
        }
        self.live().insert(e.id.clone(), e.clone());
        self.created.fetch_add(1, Ordering::Relaxed);
        Ok(e)
    }

    /// The session, if it is live.
    pub fn get(&self, id: &str) -> Result<Arc<Entry>, Unavailable> {
        if let Some(e) = self.live().get(id) {
            return Ok(e.clone());
        }
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        match ended.0.get(id) {
            Some(why) => Err(Unavailable::Gone(why.clone())),
            None => Err(Unavailable::Unknown),
        }
    }

    /// Session `id` for a request, waiting while another holds it, with at most
    /// `max_waiting` requests waiting at once (past that: [`Unavailable::Busy`]). Waiters
    /// are woken together when it is freed, and the first to claim it runs (no order is
    /// promised); one that ends meanwhile wakes them with why. Dropping the future leaves
    /// the queue.
    pub async fn acquire_waiting(&self, id: &str, max_waiting: usize) -> Result<Busy, Unavailable> {
        let e = self.get(id)?;
        let mut queued: Option<Waiting> = None;
        loop {
            // Enabled before the claim: a release between the two still wakes this one.
            let freed = e.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            self.get(id)?; // ended meanwhile: why
            let claimed = e
                .busy
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if claimed {
                return Ok(Busy(Arc::clone(&e), false));
            }
            e.preempt();
            if queued.is_none() {
                // The processes' pump yields at once: waiting for it is never refused.
                let limit = if e.busy_in_background() {
                    usize::MAX
                } else {
                    max_waiting
                };
                if e.waiting.fetch_add(1, Ordering::AcqRel) >= limit {
                    e.waiting.fetch_sub(1, Ordering::AcqRel);
                    return Err(Unavailable::Busy);
                }
                queued = Some(Waiting(e.clone()));
            }
            freed.await;
        }
    }

    /// Ends a session: out of the registry, tombstone kept, VM ended (reset and reused, or
    /// closed; see [`Session::end`]). Call off the async runtime (a reset runs the VMM).
    /// Session `id` for its processes' pump, whose wait `cancel` ends: only when no
    /// request waits for it (they go first), and never while a request holds it.
    pub async fn acquire_background(
        &self,
        id: &str,
        cancel: vmm::Cancel,
    ) -> Result<Busy, Unavailable> {
        let e = self.get(id)?;
        loop {
            let freed = e.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            self.get(id)?;
            if e.waiting() == 0
                && e.busy
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                *e.background.lock().unwrap_or_else(|e| e.into_inner()) = Some(cancel);
                // A request that queued between the check and now must not wait a whole
                // round: it finds the cancel set, or sees it pulled here.
                if e.waiting() > 0 {
                    e.preempt();
                }
                return Ok(Busy(Arc::clone(&e), true));
            }
            freed.await;
        }
    }

    pub fn end(&self, id: &str, why: Ended) {
        let Some(e) = self.live().remove(id) else {
            return;
        };
        e.processes.close(&why.reason);
        e.preempt();
        self.count_ended(&why.reason);
        if let Some(t) = self.traces.get() {
            t.end(id, &why.reason, why.detail.as_deref());
        }
        if why.reason != "deleted" {
            self.tombstone(id, why);
        }
        if let Some(d) = self.marks.get() {
            d.unmark_running(id);
        }
        // Requests waiting for it learn that it ended.
        e.freed.notify_waiters();
        if let Some(vm) = e.take_vm() {
            vm.end();
        }
    }

    /// Counts a session's end, by `reason` (for metrics).
    pub fn count_ended(&self, reason: &str) {
        *self
            .ended_by
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason.to_owned())
            .or_default() += 1;
    }

    /// Takes session `id` out of the registry to be paused (the caller holds it busy), or
    /// parked for idling (`parked`): its entry and VM. Its processes' clients are told it
    /// paused; requests waiting for it find it gone from the live ones (and resume it).
    pub fn take_out(&self, id: &str, parked: bool) -> Option<(Arc<Entry>, Box<dyn SessionVm>)> {
        let e = self.live().remove(id)?;
        let kind = if parked { "parked" } else { "paused" };
        self.trace(id, kind, serde_json::json!({}));
        e.processes.close("paused");
        e.preempt();
        if let Some(d) = self.marks.get() {
            d.unmark_running(id);
        }
        let vm = e.take_vm();
        e.freed.notify_waiters();
        vm.map(|vm| (e, vm))
    }

    /// Forgets an ended session's tombstone; true if there was one.
    pub fn forget(&self, id: &str) -> bool {
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        let had = ended.0.remove(id).is_some();
        if had {
            ended.1.retain(|x| x != id);
        }
        had
    }

    /// Ends the sessions idle past their idle timeout or past their lifetime, and returns
    /// those of them that asked to be paused instead (`to_pause`), and the sessions idle
    /// for `park_after` (when the server parks, `--park-idle-s`) but not yet expired and
    /// running no background process (`to_park`): the caller pauses each.
    pub fn reap(&self, park_after: Option<Duration>) -> Reaped {
        let now = Instant::now();
        let mut reaped = Reaped::default();
        let mut due: Vec<(String, &'static str)> = Vec::new();
        for e in self.live().values() {
            if e.is_busy() && !e.busy_in_background() {
                continue;
            }
            let idle = e.idle_for();
            if e.past_deadline(now) {
                due.push((e.id.clone(), "max_lifetime"));
            } else if idle >= e.idle_timeout {
                due.push((e.id.clone(), "idle_timeout"));
            } else if park_after.is_some_and(|after| idle >= after)
                && !e.is_busy()
                && !e.processes.any_running()
            {
                // Not one with live background processes: parked, they would stop.
                reaped.to_park.push(e.id.clone());
            }
        }
        for (id, reason) in due {
            let pause = self
                .live()
                .get(&id)
                .is_some_and(|e| e.auto_pause.load(Ordering::Relaxed));
            if pause {
                reaped.to_pause.push(id);
                continue;
            }
            self.end(
                &id,
                Ended {
                    reason: reason.into(),
                    detail: None,
                },
            );
        }
        reaped
    }

    /// Counts for `/metrics`.
    pub fn gauges(&self) -> crate::core::metrics::SessionGauges {
        crate::core::metrics::SessionGauges {
            live: self.count(),
            memory_bytes: self.memory_bytes(),
            created: self.created.load(Ordering::Relaxed),
            forked: self.forked.load(Ordering::Relaxed),
            ended: self
                .ended_by
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            state: self.marks.get().map(|d| d.gauges()),
        }
    }

    /// Ends every session (shutdown).
    pub fn end_all(&self) {
        let ids: Vec<String> = self.live().keys().cloned().collect();
        for id in ids {
            self.end(
                &id,
                Ended {
                    reason: "shutdown".into(),
                    detail: None,
                },
            );
        }
    }
}
