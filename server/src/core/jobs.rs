//! Admission and the job threads: where KVM work runs, away from the async runtime.
//!
//! - **Admission** is a counter of jobs in the system (running or waiting), capped at
//!   `workers + queue`, and one per API key, capped at the key's quota (`--key-max-jobs`).
//!   [`JobThreads::admit`] takes `n` slots at once or none (a batch is admitted whole), so a
//!   full server answers 429 at once instead of queueing without bound, and one client cannot
//!   take every place.
//! - **Fair order**: admitted work waits in one queue per key; the job threads serve the keys
//!   round robin (one job of each waiting key in turn, each key's jobs in their order), so a
//!   client with 30 jobs queued does not make another's one job wait behind all 30. Without
//!   keys every request is the same client and the order is plain FIFO.
//! - **Job threads**: `workers` plain OS threads take work from the queues and run it. Each
//!   job runs one clone's vCPU on its job thread ([`vmm::Executor::run`] is synchronous); the
//!   tokio workers only await a reply.
//! - A [`Slot`] goes back when its work is done (or dropped unrun), whatever happened.
//! - [`JobThreads::close`] stops admission; the threads finish what was queued and exit.
//!
//! This module never touches KVM itself and never blocks an async task.
//!
//! (Over 500 lines with its unit tests, which stay beside the code they test; the code
//! itself is under 400.)

use std::collections::{HashMap, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

type Work = Box<dyn FnOnce() + Send>;

/// Who a job is for: an API key's name, or `None` without keys.
pub type Client = Option<Arc<str>>;

/// What admission and the job threads share.
#[derive(Debug, Default)]
struct Shared {
    running: AtomicUsize,
    admitted: AtomicUsize,
    state: Mutex<Queues>,
    ready: Condvar,
    /// The seccomp filter of the job threads, once the jail is closed ([`crate::core::jail`]):
    /// each installs it before its next job.
    job_filter: std::sync::OnceLock<seccompiler::BpfProgram>,
}

/// Admitted counts and waiting work, by client.
#[derive(Default)]
struct Queues {
    /// Slots held per client (running or waiting), for the per-key quota.
    held: HashMap<Client, usize>,
    /// Work waiting, per client.
    waiting: HashMap<Client, VecDeque<(Slot, Work)>>,
    /// Clients with waiting work, in the order they are served next.
    turn: VecDeque<Client>,
    closed: bool,
    /// The cancel handles of the jobs admitted and not yet answered, by ticket.
    cancels: HashMap<u64, vmm::Cancel>,
    next_ticket: u64,
}

impl std::fmt::Debug for Queues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queues")
            .field("held", &self.held)
            .field("turn", &self.turn)
            .field("closed", &self.closed)
            .field("cancels", &self.cancels.len())
            .finish_non_exhaustive()
    }
}

impl Queues {
    fn push(&mut self, slot: Slot, work: Work) {
        let q = self.waiting.entry(slot.client.clone()).or_default();
        if q.is_empty() {
            self.turn.push_back(slot.client.clone());
        }
        q.push_back((slot, work));
    }

    /// The next client's oldest work; that client goes to the back of the turn.
    fn pop(&mut self) -> Option<(Slot, Work)> {
        let client = self.turn.pop_front()?;
        let q = self.waiting.get_mut(&client)?;
        let next = q.pop_front();
        if q.is_empty() {
            self.waiting.remove(&client);
        } else {
            self.turn.push_back(client);
        }
        next
    }
}

/// A fixed set of job threads behind an admission counter.
#[derive(Debug)]
pub struct JobThreads {
    capacity: usize,
    per_client: usize,
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// One admitted job's place; handing it back happens on drop.
#[derive(Debug)]
pub struct Slot {
    shared: Arc<Shared>,
    client: Client,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut q = lock(&self.shared.state);
        if let Some(n) = q.held.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                q.held.remove(&self.client);
            }
        }
        self.shared.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

fn lock(m: &Mutex<Queues>) -> MutexGuard<'_, Queues> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running or waiting job's [`vmm::Cancel`], known to its [`JobThreads`] until dropped (so
/// that a shutdown can cancel everything still running after its grace period).
#[derive(Debug)]
pub struct Tracked {
    cancel: vmm::Cancel,
    id: u64,
    shared: Arc<Shared>,
}

impl Tracked {
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        lock(&self.shared.state).cancels.remove(&self.id);
    }
}

/// Cancels its job when dropped while armed. Held by the request's future, or by its
/// response stream: a client that goes away drops them, which cancels what it asked for
/// ([`vmm::Cancel`]: the vCPU is kicked, the job ends `cancelled`, the worker is free).
#[derive(Debug)]
pub struct CancelOnDrop {
    tracked: Tracked,
    armed: bool,
}

impl CancelOnDrop {
    /// A new handle for `job`, armed.
    pub fn for_job(jobs: &JobThreads, job: &mut vmm::Job) -> Self {
        Self {
            tracked: jobs.track(job),
            armed: true,
        }
    }

    /// The job's answer went out: nothing to cancel any more.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.tracked.cancel();
        }
    }
}

/// Why work was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error("all {0} job slots are taken")]
    Full(usize),
    #[error("key {key} holds {quota} job slots, its quota")]
    Quota { key: String, quota: usize },
    #[error("job threads are closed")]
    Closed,
}

impl JobThreads {
    /// Starts `workers` job threads admitting up to `capacity` jobs at once, and up to
    /// `per_client` of them for one API key.
    pub fn start(workers: usize, capacity: usize, per_client: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let mut threads = Vec::with_capacity(workers);
        for i in 0..workers {
            let shared = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("bud-job-{i}"))
                    .spawn(move || job_thread(&shared))?,
            );
        }
        Ok(Self {
            capacity,
            per_client,
            shared,
            threads: Mutex::new(threads),
        })
    }

    /// Takes `n` slots for `client`, all or none.
    pub fn admit(&self, client: Client, n: usize) -> Result<Vec<Slot>, AdmitError> {
        let mut q = lock(&self.shared.state);
        if q.closed {
            return Err(AdmitError::Closed);
        }
        // The key's own quota first: when both apply, that is the reason to give.
        let held = q.held.get(&client).copied().unwrap_or(0);
        if let Some(key) = &client
            && held + n > self.per_client
        {
            return Err(AdmitError::Quota {
                key: key.to_string(),
                quota: self.per_client,
            });
        }
        let now = self.shared.admitted.load(Ordering::Acquire);
        if now + n > self.capacity {
            return Err(AdmitError::Full(self.capacity));
        }
        q.held.insert(client.clone(), held + n);
        self.shared.admitted.fetch_add(n, Ordering::AcqRel);
        drop(q);
        Ok((0..n)
            .map(|_| Slot {
                shared: self.shared.clone(),
                client: client.clone(),
            })
            .collect())
    }

    /// Runs `work` on a job thread in `slot`'s turn; the slot is released when it returns.
    pub fn spawn(
        &self,
        slot: Slot,
        work: impl FnOnce() + Send + 'static,
    ) -> Result<(), AdmitError> {
        let mut q = lock(&self.shared.state);
        if q.closed {
            return Err(AdmitError::Closed);
        }
        q.push(slot, Box::new(work));
        drop(q);
        self.shared.ready.notify_one();
        Ok(())
    }

    /// Gives `job` a cancel handle known to these job threads until the result is dropped.
    pub fn track(&self, job: &mut vmm::Job) -> Tracked {
        let cancel = vmm::Cancel::new();
        job.cancel = Some(cancel.clone());
        let mut q = lock(&self.shared.state);
        q.next_ticket += 1;
        let id = q.next_ticket;
        q.cancels.insert(id, cancel.clone());
        drop(q);
        Tracked {
            cancel,
            id,
            shared: self.shared.clone(),
        }
    }

    /// Cancels every tracked job, running or waiting (a shutdown past its grace period);
    /// returns how many there were.
    pub fn cancel_all(&self) -> usize {
        let all: Vec<vmm::Cancel> = lock(&self.shared.state).cancels.values().cloned().collect();
        for c in &all {
            c.cancel();
        }
        all.len()
    }

    /// The jail is closed: from their next job on, the job threads run under `filter`.
    pub fn set_job_filter(&self, filter: seccompiler::BpfProgram) {
        let _ = self.shared.job_filter.set(filter);
    }

    /// Whether the job threads have a filter to run under.
    pub fn jailed(&self) -> bool {
        self.shared.job_filter.get().is_some()
    }

    /// Most jobs admitted at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Most jobs admitted at once for one API key.
    pub fn per_client(&self) -> usize {
        self.per_client
    }

    /// Jobs on a job thread now.
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::Relaxed)
    }

    /// Jobs admitted and not yet on a job thread.
    pub fn queued(&self) -> usize {
        self.shared
            .admitted
            .load(Ordering::Relaxed)
            .saturating_sub(self.running())
    }

    /// Stops admitting; queued work still runs. Idempotent.
    pub fn close(&self) {
        lock(&self.shared.state).closed = true;
        self.shared.ready.notify_all();
    }

    /// Closes and waits for the job threads to finish everything queued.
    pub fn join(&self) {
        self.close();
        let threads: Vec<_> = self
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        let me = std::thread::current().id();
        for t in threads {
            // The last handle on the server can be dropped by a job's own closure, on a job
            // thread: that thread cannot wait for itself (EDEADLK); it sees `closed` and ends
            // once the closure returns.
            if t.thread().id() == me {
                continue;
            }
            // A job thread does not panic: work runs under catch_unwind.
            let _ = t.join();
        }
    }
}

impl Drop for JobThreads {
    fn drop(&mut self) {
        self.join();
    }
}

fn job_thread(shared: &Shared) {
    let mut filtered = false;
    loop {
        let mut q = lock(&shared.state);
        let (slot, work) = loop {
            if let Some(next) = q.pop() {
                break next;
            }
            if q.closed {
                return;
            }
            q = shared.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        };
        shared.running.fetch_add(1, Ordering::AcqRel);
        drop(q);
        if !filtered && let Some(filter) = shared.job_filter.get() {
            if let Err(e) = crate::core::jail::apply_here(filter) {
                // Asked to be jailed and cannot be: never run a job outside the jail.
                tracing::error!("job thread cannot enter the jail: {e}");
                std::process::abort();
            }
            filtered = true;
        }
        // A panicking job drops its reply channel (the request gets a 500); the thread lives,
        // and the panic is logged (a bug of ours: it must not pass unseen).
        if let Err(panic) = catch_unwind(AssertUnwindSafe(work)) {
            let what = panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(a panic without a message)");
            tracing::error!("a job panicked on its job thread: {what}");
        }
        shared.running.fetch_sub(1, Ordering::AcqRel);
        drop(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn admission_is_all_or_nothing_and_slots_come_back() {
        let jobs = JobThreads::start(1, 3, 3).unwrap();

        let two = jobs.admit(None, 2).unwrap();
        let too_many = jobs.admit(None, 2);
        let one = jobs.admit(None, 1).unwrap();
        drop(two);
        let again = jobs.admit(None, 2);

        assert_eq!(too_many.unwrap_err(), AdmitError::Full(3));
        assert_eq!(one.len(), 1);
        assert_eq!(again.map(|s| s.len()), Ok(2));
    }

    #[test]
    fn work_runs_on_a_job_thread_and_releases_its_slot() {
        let jobs = JobThreads::start(2, 2, 2).unwrap();
        let (tx, rx) = channel();

        for slot in jobs.admit(None, 2).unwrap() {
            let tx = tx.clone();
            jobs.spawn(slot, move || {
                let name = std::thread::current().name().unwrap_or("").to_string();
                tx.send(name).unwrap();
            })
            .unwrap();
        }
        let names = [rx.recv().unwrap(), rx.recv().unwrap()];
        jobs.join();

        assert!(names.iter().all(|n| n.starts_with("bud-job-")), "{names:?}");
        assert_eq!(jobs.queued() + jobs.running(), 0);
    }

    #[test]
    fn the_last_handle_dropped_by_a_job_on_its_own_thread_closes_the_threads() {
        let jobs = Arc::new(JobThreads::start(2, 2, 2).unwrap());
        let (go_tx, go) = channel::<()>();
        let (tx, rx) = channel();
        let mine = jobs.clone();
        let slot = jobs.admit(None, 1).unwrap().pop().unwrap();
        jobs.spawn(slot, move || {
            go.recv().unwrap();
            // The test's handle is gone: this drop is the last and joins the other thread.
            let dropped = catch_unwind(AssertUnwindSafe(|| drop(mine)));
            tx.send(dropped.is_ok()).unwrap();
        })
        .unwrap();
        drop(jobs);
        go_tx.send(()).unwrap();

        assert_eq!(rx.recv(), Ok(true), "the job thread tried to join itself");
    }

    #[test]
    fn a_panicking_job_does_not_kill_its_thread() {
        let jobs = JobThreads::start(1, 2, 2).unwrap();
        let (tx, rx) = channel();
        let mut slots = jobs.admit(None, 2).unwrap();

        jobs.spawn(slots.pop().unwrap(), || panic!("job panicked"))
            .unwrap();
        jobs.spawn(slots.pop().unwrap(), move || tx.send(7).unwrap())
            .unwrap();

        assert_eq!(rx.recv().unwrap(), 7);
    }

    #[test]
    fn closed_threads_admit_nothing_but_finish_queued_work() {
        let jobs = JobThreads::start(1, 2, 2).unwrap();
        let (tx, rx) = channel();
        let slot = jobs.admit(None, 1).unwrap().pop().unwrap();
        jobs.spawn(slot, move || tx.send(1).unwrap()).unwrap();

        jobs.join();

        assert_eq!(jobs.admit(None, 1).unwrap_err(), AdmitError::Closed);
        assert_eq!(rx.recv().unwrap(), 1);
    }

    fn key(name: &str) -> Client {
        Some(Arc::from(name))
    }

    #[test]
    fn a_key_past_its_quota_is_refused_while_others_are_admitted() {
        let jobs = JobThreads::start(1, 4, 2).unwrap();

        let alice = jobs.admit(key("alice"), 2).unwrap();
        let third = jobs.admit(key("alice"), 1);
        let bob = jobs.admit(key("bob"), 2).unwrap();
        let full = jobs.admit(key("carol"), 1);
        drop(alice);
        let alice_again = jobs.admit(key("alice"), 1);

        assert_eq!(
            third.unwrap_err(),
            AdmitError::Quota {
                key: "alice".into(),
                quota: 2
            }
        );
        assert_eq!(bob.len(), 2);
        assert_eq!(full.unwrap_err(), AdmitError::Full(4));
        assert_eq!(alice_again.map(|s| s.len()), Ok(1));
    }

    #[test]
    fn waiting_work_is_served_round_robin_between_keys() {
        let jobs = JobThreads::start(1, 8, 8).unwrap();
        let (order_tx, order_rx) = channel();
        let (gate_tx, gate_rx) = channel::<()>();
        let (started_tx, started_rx) = channel();
        // The one job thread is held by a job of alice's until the others are queued.
        let first = jobs.admit(key("alice"), 1).unwrap().pop().unwrap();
        jobs.spawn(first, move || {
            started_tx.send(()).unwrap();
            gate_rx.recv().unwrap();
        })
        .unwrap();
        started_rx.recv().unwrap();
        for name in ["alice-1", "alice-2", "alice-3", "bob-1", "bob-2", "carol-1"] {
            let who = name.split('-').next().unwrap();
            let slot = jobs.admit(key(who), 1).unwrap().pop().unwrap();
            let tx = order_tx.clone();
            jobs.spawn(slot, move || tx.send(name).unwrap()).unwrap();
        }
        drop(order_tx);

        gate_tx.send(()).unwrap();
        let order: Vec<&str> = order_rx.iter().collect();

        assert_eq!(
            order,
            ["alice-1", "bob-1", "carol-1", "alice-2", "bob-2", "alice-3"]
        );
    }

    #[test]
    fn cancel_all_reaches_every_tracked_job_and_only_those() {
        let jobs = JobThreads::start(1, 4, 4).unwrap();
        let (mut a, mut b, mut c) = (
            vmm::Job::python("1"),
            vmm::Job::python("2"),
            vmm::Job::python("3"),
        );
        let ta = jobs.track(&mut a);
        let tb = CancelOnDrop::for_job(&jobs, &mut b);
        let tc = jobs.track(&mut c);
        drop(tc); // answered: no longer tracked

        let n = jobs.cancel_all();

        assert_eq!(n, 2);
        let cancelled = |j: &vmm::Job| j.cancel.as_ref().unwrap().is_cancelled();
        assert!(cancelled(&a) && cancelled(&b) && !cancelled(&c));
        drop((ta, tb));
        assert_eq!(jobs.cancel_all(), 0);
    }
}
