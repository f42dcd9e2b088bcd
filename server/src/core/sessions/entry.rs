//! One session's entry in the registry: its settings, its VM, and its bookkeeping (busy,
//! waiting requests, lifetime and idle time, memory, the pump's hold, a dialect's
//! attachment). The registry ([`super::Sessions`]) decides who holds it and when it ends.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use vmm::Executor;
use vmm::session::Session;

use crate::core::engine::{Engine, SessionVm};

/// A session's settings and bookkeeping (the VM is in `vm`).
#[derive(Debug)]
pub struct Entry {
    pub id: String,
    pub created_at: SystemTime,
    pub idle_timeout: Duration,
    pub language: vmm::Language,
    /// Which of the kernel's languages its cells are in by default (`vmm::Job::dialect`).
    pub dialect: u32,
    pub env: BTreeMap<String, String>,
    pub metadata: serde_json::Value,
    pub parent: Option<String>,
    /// The template the session was made from, and its engine.
    pub template: String,
    pub engine: Arc<dyn Engine>,
    /// When it ends whatever it does (its lifetime), as an instant and on the wall clock.
    deadline: Mutex<(Instant, SystemTime)>,
    last_used: Mutex<Instant>,
    pub(super) busy: AtomicBool,
    /// Requests waiting for it to be free, and how they learn it is (or that it ended).
    pub(super) waiting: AtomicUsize,
    pub(super) freed: tokio::sync::Notify,
    /// The VM; None once the session ended.
    pub(super) vm: Mutex<Option<Box<dyn SessionVm>>>,
    pub private_bytes: AtomicU64,
    pub layer_bytes: AtomicU64,
    pub executions: AtomicU64,
    /// Time its VM ran requests, nanoseconds (between them it runs only while it has
    /// live background processes).
    pub run_ns: AtomicU64,
    /// Its background processes (`service::processes`).
    pub processes: crate::core::processes::Processes,
    /// The lane beside the request its VM runs ([`vmm::beside`]).
    beside: vmm::beside::Beside,
    /// While the processes' pump holds the session: the cancel of its wait in the guest,
    /// which a request that wants the session pulls ([`Entry::preempt`]).
    pub(super) background: Mutex<Option<vmm::Cancel>>,
    /// Paused rather than ended when its time is up.
    pub auto_pause: AtomicBool,
    /// What an API dialect keeps of it (E2B's sandbox), saved with it when it pauses.
    attachment: Mutex<Attached>,
    /// Its code contexts (`crate::service::contexts`), saved with it when it pauses.
    pub contexts: Mutex<crate::core::contexts::Contexts>,
    /// Its network's gate (None: its template has no network card).
    pub network: Option<Arc<crate::core::egress::Gate>>,
    /// The API key that made it (None: no keys, or made before sessions had owners):
    /// listings show a key its own sessions only ([`listed_for`]). Its id is the way to
    /// it: the id's holder may use it, as E2B's sandbox ids are.
    pub owner: Option<String>,
}

/// A dialect's rules for the record its attachment saves ([`Attachment::record`]), checked
/// on every record that comes from outside this server (an import): the bounds that
/// dialect's create keeps. The compat layer adds its own
/// (`crate::core::state::AppState::add_attachment_rules`); the core knows no dialect.
pub trait AttachmentRules: Send + Sync + std::fmt::Debug {
    /// Why `attachment` cannot be the saved attachment of session `id`, made by API key
    /// `owner`, if it cannot.
    fn check(
        &self,
        id: &str,
        owner: Option<&str>,
        attachment: &serde_json::Value,
    ) -> Result<(), String>;
}

/// What an API dialect keeps of a session besides the session (E2B's sandbox: its token,
/// contexts, ...): its record is saved with the session when it pauses or is snapshotted.
pub trait Attachment: Send + Sync + std::fmt::Debug {
    /// Its record now, as JSON (a dialect's own shape, under its own key).
    fn record(&self) -> serde_json::Value;
}

/// A session's attachment: the dialect's live one, or a record saved with the session
/// that no dialect has taken back yet (a resumed session).
#[derive(Debug, Clone)]
enum Attached {
    Saved(serde_json::Value),
    Live(Arc<dyn Attachment>),
}

/// Settings a new session starts with.
#[derive(Debug, Clone)]
pub struct NewSession {
    pub language: vmm::Language,
    pub dialect: u32,
    pub env: BTreeMap<String, String>,
    pub idle_timeout: Duration,
    pub max_lifetime: Duration,
    pub metadata: serde_json::Value,
    pub parent: Option<String>,
    pub template: String,
    pub engine: Arc<dyn Engine>,
    pub auto_pause: bool,
    /// The id and start of a session made again (resumed): None for a new one.
    pub again: Option<(String, SystemTime)>,
    /// Its network's gate, given to its VM as it is registered (None: no card).
    pub network: Option<Arc<crate::core::egress::Gate>>,
    /// The API key that made it ([`Entry::owner`]).
    pub owner: Option<String>,
}

/// Held while a request uses a session (or, the flag set, while its processes' pump does,
/// which neither counts as use for the idle timeout nor keeps the reaper away); frees it
/// on drop.
#[derive(Debug)]
pub struct Busy(pub(super) Arc<Entry>, pub(super) bool);

impl Busy {
    pub fn entry(&self) -> &Arc<Entry> {
        &self.0
    }
}

impl Drop for Busy {
    /// The request is over: the session is free for the next one.
    fn drop(&mut self) {
        if self.1 {
            *self.0.background.lock().unwrap_or_else(|e| e.into_inner()) = None;
        } else {
            *self.0.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
        self.0.busy.store(false, Ordering::Release);
        self.0.freed.notify_waiters();
    }
}

/// A request counted among a session's waiting ones until dropped.
pub(super) struct Waiting(pub(super) Arc<Entry>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Entry {
    pub(super) fn new(id: String, s: NewSession, beside: vmm::beside::Beside) -> Self {
        let now = SystemTime::now();
        Self {
            id,
            created_at: s.again.map_or(now, |a| a.1),
            idle_timeout: s.idle_timeout,
            language: s.language,
            dialect: s.dialect,
            env: s.env,
            metadata: s.metadata,
            parent: s.parent,
            template: s.template,
            engine: s.engine,
            deadline: Mutex::new((Instant::now() + s.max_lifetime, now + s.max_lifetime)),
            last_used: Mutex::new(Instant::now()),
            busy: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            freed: tokio::sync::Notify::new(),
            vm: Mutex::new(None),
            private_bytes: AtomicU64::new(0),
            layer_bytes: AtomicU64::new(0),
            executions: AtomicU64::new(0),
            run_ns: AtomicU64::new(0),
            processes: crate::core::processes::Processes::default(),
            beside,
            background: Mutex::new(None),
            auto_pause: AtomicBool::new(s.auto_pause),
            attachment: Mutex::new(Attached::Saved(serde_json::Value::Null)),
            contexts: Mutex::default(),
            network: s.network,
            owner: s.owner,
        }
    }

    /// Its code contexts now.
    pub fn contexts(&self) -> std::sync::MutexGuard<'_, crate::core::contexts::Contexts> {
        self.contexts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attaches a dialect's record of the session.
    pub fn attach(&self, a: Arc<dyn Attachment>) {
        *self.attachment.lock().unwrap_or_else(|e| e.into_inner()) = Attached::Live(a);
    }

    /// Keeps `record` (saved with the session) until a dialect attaches itself again.
    pub fn keep_record(&self, record: serde_json::Value) {
        *self.attachment.lock().unwrap_or_else(|e| e.into_inner()) = Attached::Saved(record);
    }

    /// The attachment's record now (to be saved with the session).
    pub fn attachment_record(&self) -> serde_json::Value {
        let a = self
            .attachment
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match a {
            Attached::Saved(v) => v,
            Attached::Live(a) => a.record(),
        }
    }

    /// What is left of its lifetime.
    pub fn lifetime_left(&self) -> Duration {
        self.deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .saturating_duration_since(Instant::now())
    }

    /// Ends the pump's wait in the guest, if the pump holds the session, so that a request
    /// gets it within a guest wakeup.
    pub fn preempt(&self) {
        if let Some(c) = self
            .background
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            c.cancel();
        }
    }

    /// The lane beside the request running in it now, if one runs that takes a file
    /// operation (or, `processes`, a process operation) beside it ([`vmm::beside`]).
    pub fn beside(&self, processes: bool) -> Option<vmm::beside::Beside> {
        (self.is_busy() && self.beside.open_for(processes)).then(|| self.beside.clone())
    }

    /// Whether the session is held by its processes' pump rather than a request.
    pub(super) fn busy_in_background(&self) -> bool {
        self.background
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// When its lifetime ends (wall clock).
    pub fn expires_at(&self) -> SystemTime {
        self.deadline.lock().unwrap_or_else(|e| e.into_inner()).1
    }

    /// Moves the end of its lifetime to `lifetime` from now (an E2B sandbox's
    /// `set_timeout`; it may come sooner than the old one).
    pub fn set_lifetime(&self, lifetime: Duration) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) =
            (Instant::now() + lifetime, SystemTime::now() + lifetime);
    }

    pub(super) fn past_deadline(&self, now: Instant) -> bool {
        now >= self.deadline.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    /// Runs `f` on the session's VM (on a job thread). None if the session has ended.
    /// The one way to a session's VM: the request holds the session ([`Busy`]), or the
    /// VM is only read.
    pub fn with_vm<R>(&self, f: impl FnOnce(&mut dyn SessionVm) -> R) -> Option<R> {
        let mut vm = self.vm.lock().unwrap_or_else(|e| e.into_inner());
        let s = vm.as_mut()?;
        let r = f(s.as_mut());
        self.executions.store(s.executions(), Ordering::Relaxed);
        Some(r)
    }

    /// Runs `f` on the session's VMM session and its executor, for the operations not
    /// behind the engine's seam yet (files, processes, pause; [`crate::core::engine`]).
    /// None if the session has ended, or if its engine has no VMM (a test's).
    pub fn with_vmm<R>(&self, f: impl FnOnce(&mut Session, &Executor) -> R) -> Option<R> {
        self.with_vm(|vm| vm.vmm().map(|(s, ex)| f(s, ex)))
            .flatten()
    }

    /// Records the memory the session holds (its private pages, its layers).
    pub fn account(&self) {
        let _ = self.with_vm(|s| {
            if let Ok(bytes) = s.private_bytes() {
                self.private_bytes.store(bytes, Ordering::Relaxed);
            }
            let layers = s.layers().iter().map(|l| l.bytes).sum();
            self.layer_bytes.store(layers, Ordering::Relaxed);
        });
    }

    /// Whether a request is running in it.
    /// Counts as use for the idle timeout (a client reading a process's output).
    pub fn touch(&self) {
        *self.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    pub fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Acquire)
    }

    /// Requests waiting for it now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// When it was last used (end of its last request, or its creation).
    pub fn idle_for(&self) -> Duration {
        self.last_used
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }

    /// The session's VM, taken out (it has ended).
    pub(super) fn take_vm(&self) -> Option<Box<dyn SessionVm>> {
        self.vm.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Whether something owned by `owner` is listed to the request asking now: with API keys,
/// only its own key's (and what has no owner); without keys, or outside a request, all.
pub fn listed_for(owner: Option<&str>) -> bool {
    match (owner, crate::core::audit::current_key()) {
        (Some(owner), Some(asker)) => owner == asker,
        _ => true,
    }
}
