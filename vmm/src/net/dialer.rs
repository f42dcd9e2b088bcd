//! The network stacks' blocking work, off their vCPU threads: asking a VM's [`super::Egress`]
//! about a name (which may resolve it on the host) and about a connection, and starting the
//! dial of what it allows ([`super::connect`], non-blocking: the connect's completion and its
//! timeout are waited for by the connect thread, not here). A stack holds the guest's DNS
//! query or SYN meanwhile and answers it when the work comes back ([`super::stack`]), so a
//! slow resolver or a far host never stops a vCPU, and a job thread (which a jailed server
//! forbids to open sockets) never opens one.
//!
//! A fixed pool of [`THREADS`] threads for the whole process, started with the first
//! executor ([`start`]) as the other helper threads are. Each piece of work is short but for
//! a name the egress resolves on the host, bounded by the host resolver's own timeouts; a
//! dial never holds a thread past its start, so hosts that never answer stall no one (issue
//! 58: 16 dials to a port that never answers once held a thread each for 10 s and stalled
//! every other VM's lookups). Slow resolutions still hold their thread, so the pool is fair
//! between VMs ([`Owner`]: one per stack):
//! - each VM's work waits in a queue of its own, and the threads take from the VMs in turn
//!   (round robin), a VM's own work in order, its lookups before its connections;
//! - a VM runs at most [`PER_OWNER`] pieces at once, whatever it queues;
//! - connections are decided on at most [`DIAL_THREADS`] threads in all: the rest only ever
//!   run lookups, so a name is decided while every other thread is held.
//!
//! [`queued`] is the work waiting for a thread, for the server's metrics.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};

/// Threads in the pool.
pub(crate) const THREADS: usize = 8;
/// Pieces of work one VM may have running at once.
pub(crate) const PER_OWNER: usize = 2;
/// Threads that may decide connections (and start their dials) at once; the others are
/// kept for lookups.
pub(crate) const DIAL_THREADS: usize = 6;

/// One piece of blocking work.
pub(crate) type Work = Box<dyn FnOnce() + Send>;

/// What a piece of work is: a lookup (a DNS query's decision) goes before a dial (a
/// connection's decision and the start of its dial), and never waits for a dial thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Lookup,
    Dial,
}

/// Whose work it is: one per stack, so per VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Owner(u64);

impl Owner {
    pub(crate) fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// One VM's work: waiting, and how much runs.
#[derive(Default)]
struct Waiting {
    lookups: VecDeque<Work>,
    dials: VecDeque<Work>,
    running: usize,
}

/// The pool's state, under one lock.
#[derive(Default)]
struct Queues {
    /// The VMs with work waiting, in the order they are served next.
    turn: VecDeque<Owner>,
    of: HashMap<Owner, Waiting>,
    /// Dials running, all VMs together.
    dials_running: usize,
    /// Pieces waiting, all VMs together.
    queued: usize,
}

impl Queues {
    fn push(&mut self, owner: Owner, kind: Kind, work: Work) {
        let w = self.of.entry(owner).or_default();
        match kind {
            Kind::Lookup => w.lookups.push_back(work),
            Kind::Dial => w.dials.push_back(work),
        }
        if !self.turn.contains(&owner) {
            self.turn.push_back(owner);
        }
        self.queued += 1;
    }

    /// The next piece a thread may run, if any: the first VM in turn that is under its
    /// share and has a lookup, or a dial while a dial thread is free; that VM goes to the
    /// back of the turn.
    fn take(&mut self) -> Option<(Owner, Kind, Work)> {
        let dial_free = self.dials_running < DIAL_THREADS;
        let (at, kind) = self.turn.iter().enumerate().find_map(|(at, owner)| {
            let w = &self.of[owner];
            if w.running >= PER_OWNER {
                None
            } else if !w.lookups.is_empty() {
                Some((at, Kind::Lookup))
            } else if dial_free && !w.dials.is_empty() {
                Some((at, Kind::Dial))
            } else {
                None
            }
        })?;
        let owner = self.turn.remove(at)?;
        let w = self.of.get_mut(&owner)?;
        let work = match kind {
            Kind::Lookup => w.lookups.pop_front(),
            Kind::Dial => w.dials.pop_front(),
        }?;
        w.running += 1;
        if !w.lookups.is_empty() || !w.dials.is_empty() {
            self.turn.push_back(owner);
        }
        if kind == Kind::Dial {
            self.dials_running += 1;
        }
        self.queued -= 1;
        Some((owner, kind, work))
    }

    /// Takes out `owner`'s work that has not started, for the caller to drop; what runs
    /// ends as it would.
    fn forget(&mut self, owner: Owner) -> Vec<Work> {
        let Some(w) = self.of.get_mut(&owner) else {
            return Vec::new();
        };
        let dropped: Vec<Work> = w.lookups.drain(..).chain(w.dials.drain(..)).collect();
        self.queued -= dropped.len();
        if w.running == 0 {
            self.of.remove(&owner);
        }
        self.turn.retain(|o| *o != owner);
        dropped
    }

    fn done(&mut self, owner: Owner, kind: Kind) {
        if kind == Kind::Dial {
            self.dials_running -= 1;
        }
        if let Some(w) = self.of.get_mut(&owner) {
            w.running -= 1;
            if w.running == 0 && w.lookups.is_empty() && w.dials.is_empty() {
                self.of.remove(&owner);
            }
        }
    }
}

struct Pool {
    queues: Mutex<Queues>,
    /// Signalled when work is queued or a piece ends (which may let a VM's next run).
    ready: Condvar,
}

/// Runs `work` of `owner` on a thread of the pool when its turn comes (module docs).
pub(crate) fn submit(owner: Owner, kind: Kind, work: Work) {
    let pool = pool();
    lock(pool).push(owner, kind, work);
    pool.ready.notify_one();
}

/// Drops the work of `owner` that waits for a thread (its stack went: nothing is decided
/// or dialed for a VM that is gone). Takes the pool's lock only if the pool has started.
pub(crate) fn forget(owner: Owner) {
    if let Some(pool) = POOL.get() {
        let dropped = lock(pool).forget(owner);
        // Outside the lock: the work holds its stack's handles.
        drop(dropped);
    }
}

/// Work waiting for a thread, all VMs together.
pub fn queued() -> usize {
    POOL.get().map_or(0, |p| lock(p).queued)
}

/// Starts the pool if it has not started ([`crate::Executor::new`] calls it).
pub(crate) fn start() {
    pool();
}

static POOL: OnceLock<Pool> = OnceLock::new();

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        for i in 0..THREADS {
            // Without its threads no VM could ever connect: fail loudly at the first
            // executor rather than leave guests waiting on every connection.
            std::thread::Builder::new()
                .name(format!("bud-dial-{i}"))
                .spawn(serve)
                .expect("cannot start bud's network dial threads");
        }
        Pool {
            queues: Mutex::default(),
            ready: Condvar::new(),
        }
    })
}

fn lock(pool: &Pool) -> MutexGuard<'_, Queues> {
    pool.queues.lock().unwrap_or_else(|e| e.into_inner())
}

fn serve() {
    let pool = pool();
    loop {
        let (owner, kind, work) = {
            let mut q = lock(pool);
            loop {
                if let Some(next) = q.take() {
                    break next;
                }
                q = pool.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        // Work panicking would take this thread with it; the work of a stack catches
        // nothing it could panic on, but the pool keeps its size anyway.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        lock(pool).done(owner, kind);
        // A piece ending may let another run (its VM's, or a dial): any waiting thread may
        // be the one to take it.
        pool.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// Longer than any wait here that must end.
    const PATIENCE: Duration = Duration::from_secs(10);

    #[test]
    fn work_runs_off_the_callers_thread_and_a_panic_does_not_shrink_the_pool() {
        let (tx, rx) = mpsc::channel();
        for _ in 0..THREADS {
            submit(
                Owner::new(),
                Kind::Dial,
                Box::new(|| panic!("a piece that panics")),
            );
        }
        for i in 0..THREADS * 2 {
            let tx = tx.clone();
            submit(
                Owner::new(),
                Kind::Lookup,
                Box::new(move || {
                    let _ = tx.send((i, std::thread::current().name().map(str::to_owned)));
                }),
            );
        }
        let mut seen: Vec<usize> = Vec::new();
        for _ in 0..THREADS * 2 {
            let (i, name) = rx.recv_timeout(PATIENCE).unwrap();
            assert!(name.unwrap_or_default().starts_with("bud-dial-"));
            seen.push(i);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..THREADS * 2).collect::<Vec<_>>());
    }

    /// Work that says it started, then holds its thread until `release` says go (or
    /// hangs up).
    fn held(
        started: &mpsc::Sender<()>,
        release: &std::sync::Arc<Mutex<mpsc::Receiver<()>>>,
    ) -> Work {
        let (started, release) = (started.clone(), release.clone());
        Box::new(move || {
            let _ = started.send(());
            let _ = release.lock().unwrap().recv();
        })
    }

    #[test]
    fn a_vm_whose_dials_hang_holds_its_share_and_others_lookups_and_dials_still_run() {
        let (started, starts) = mpsc::channel();
        let (release, hold) = mpsc::channel::<()>();
        let hold = std::sync::Arc::new(Mutex::new(hold));
        let (hostile, other) = (Owner::new(), Owner::new());
        // Far more hanging dials than the pool has threads (the stack lets a VM have 64).
        for _ in 0..THREADS * 4 {
            submit(hostile, Kind::Dial, held(&started, &hold));
        }
        for _ in 0..PER_OWNER {
            starts.recv_timeout(PATIENCE).unwrap();
        }
        let (done, finished) = mpsc::channel();
        for kind in [Kind::Lookup, Kind::Dial] {
            let done = done.clone();
            submit(other, kind, Box::new(move || done.send(kind).unwrap()));
        }

        let mut ran = [
            finished.recv_timeout(PATIENCE),
            finished.recv_timeout(PATIENCE),
        ];
        let more_started = starts.recv_timeout(Duration::from_millis(100));

        ran.sort_by_key(|r| *r == Ok(Kind::Lookup));
        assert_eq!(ran, [Ok(Kind::Dial), Ok(Kind::Lookup)]);
        assert!(more_started.is_err(), "the hostile VM ran past its share");
        assert_eq!(lock(pool()).of[&hostile].running, PER_OWNER);
        drop(release);
    }

    #[test]
    fn lookups_run_while_every_dial_thread_is_held() {
        let mut q = Queues::default();
        let vms: Vec<Owner> = (0..DIAL_THREADS).map(|_| Owner::new()).collect();
        let late = Owner::new();
        for vm in &vms {
            q.push(*vm, Kind::Dial, Box::new(|| {}));
        }
        q.push(late, Kind::Dial, Box::new(|| {}));
        q.push(late, Kind::Lookup, Box::new(|| {}));

        let dials: Vec<(Owner, Kind)> = (0..DIAL_THREADS)
            .map(|_| q.take().map(|(o, k, _)| (o, k)).unwrap())
            .collect();
        let next = q.take().map(|(o, k, _)| (o, k));
        let then = q.take().map(|(o, k, _)| (o, k));
        q.done(vms[0], Kind::Dial);
        let after = q.take().map(|(o, k, _)| (o, k));

        assert_eq!(
            dials,
            vms.iter().map(|vm| (*vm, Kind::Dial)).collect::<Vec<_>>(),
            "each VM in turn"
        );
        assert_eq!(next, Some((late, Kind::Lookup)), "not behind the dials");
        assert_eq!(then, None, "every dial thread is held");
        assert_eq!(after, Some((late, Kind::Dial)));
        assert_eq!(q.queued, 0);
    }

    #[test]
    fn a_forgotten_vms_waiting_work_never_runs_and_its_running_work_ends_as_before() {
        let mut q = Queues::default();
        let (gone, other) = (Owner::new(), Owner::new());
        q.push(gone, Kind::Dial, Box::new(|| {}));
        let running = q.take().map(|(o, k, _)| (o, k));
        q.push(gone, Kind::Lookup, Box::new(|| {}));
        q.push(gone, Kind::Dial, Box::new(|| {}));
        q.push(other, Kind::Dial, Box::new(|| {}));

        let dropped = q.forget(gone).len();
        let next = q.take().map(|(o, k, _)| (o, k));
        let then = q.take().map(|(o, k, _)| (o, k));
        q.done(gone, Kind::Dial);

        assert_eq!(running, Some((gone, Kind::Dial)));
        assert_eq!(dropped, 2);
        assert_eq!(next, Some((other, Kind::Dial)));
        assert_eq!(then, None);
        assert_eq!(q.queued, 0);
        assert!(!q.of.contains_key(&gone));
    }
}
