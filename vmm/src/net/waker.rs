//! What wakes a VM's network stack between its guest's exits: one thread for the whole
//! process. It never touches guest memory, a card or smoltcp (all of which each VM's vCPU
//! thread owns, lock-free): it waits, in one `epoll`, for any VM's host socket to become
//! ready or for the earliest of the stacks' timers, then marks that VM's [`Waker`] pending
//! and kicks its vCPU out of `KVM_RUN` ([`Kicker::poke`]), whose run loop runs the stack and
//! goes back in. A guest blocked in `recv` sleeps in KVM (the in-kernel irqchip halts it
//! there) until that kick delivers its data and interrupt. The blocking work of a stack
//! (lookups and decisions) runs on [`super::dialer`]'s threads and its dials complete on
//! [`super::connect`]'s thread, which wake it the same way.
//!
//! One thread for every VM, started with the first executor ([`start`]), not one per card:
//! a card is made by whichever thread makes the clone, and in a jailed server that is a job
//! thread, which may not create threads (nor `epoll` instances, nor register with one: the
//! connect thread registers each host socket it connected).
//!
//! Host sockets are watched edge-triggered: a kick per new readiness, never a busy loop while
//! data waits for the guest's window (the guest's next ACK exits to the card and runs the
//! stack anyway). A parked VM is not running: kicks then only leave the pending mark, which
//! the next run serves first.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::vcpu::Kicker;

/// `epoll` data of the control eventfd (host sockets carry their VM's token, never this).
const CONTROL: u64 = u64::MAX;

/// One VM's stack as the wake-up thread knows it.
#[derive(Debug)]
pub(crate) struct Waker {
    token: u64,
    kicker: Kicker,
    pending: AtomicBool,
}

impl Waker {
    /// A waker for the VM of `kicker`, known to the wake-up thread until dropped.
    pub(crate) fn new(kicker: Kicker) -> Arc<Self> {
        let s = service();
        let mut r = s.registry();
        r.next_token += 1;
        let waker = Arc::new(Self {
            token: r.next_token,
            kicker,
            pending: AtomicBool::new(false),
        });
        r.wakers.insert(waker.token, Arc::downgrade(&waker));
        waker
    }

    /// Whether the stack has something to do (and clears the mark).
    pub(crate) fn take_pending(&self) -> bool {
        self.pending.swap(false, Ordering::AcqRel)
    }

    /// Whether the stack has something to do (leaves the mark).
    pub(crate) fn is_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Marks the stack pending and kicks its vCPU out of `KVM_RUN` (a no-op if it is not
    /// running: the next run serves the mark first).
    pub(crate) fn wake(&self) {
        self.pending.store(true, Ordering::Release);
        self.kicker.poke();
    }

    /// Clears the mark and the timer (a reset).
    pub(crate) fn clear(&self) {
        service().registry().set_timer(self.token, None);
        self.pending.store(false, Ordering::Release);
    }

    /// Watches host socket `fd` (edge-triggered, read and write readiness) until it closes.
    pub(crate) fn watch(&self, fd: RawFd) -> io::Result<()> {
        let events =
            EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED;
        service().epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(events, self.token),
        )
    }

    /// Runs the stack again after `delay` (`None`: no timer).
    pub(crate) fn set_timer(&self, delay: Option<Duration>) {
        let s = service();
        let due = delay.map(|d| micros(s.origin.elapsed() + d));
        let earliest = s.registry().set_timer(self.token, due);
        if earliest {
            // The thread may be waiting for a later time: make it look again.
            let _ = s.control.write(1);
        }
    }
}

impl Drop for Waker {
    fn drop(&mut self) {
        let s = service();
        let mut r = s.registry();
        r.set_timer(self.token, None);
        r.wakers.remove(&self.token);
    }
}

/// The wakers and their timers.
#[derive(Debug, Default)]
struct Registry {
    next_token: u64,
    wakers: HashMap<u64, Weak<Waker>>,
    /// (due, token), in microseconds since [`Service::origin`].
    timers: BTreeSet<(u64, u64)>,
    due: HashMap<u64, u64>,
}

impl Registry {
    /// Sets (or clears) `token`'s timer; whether it is now the earliest.
    fn set_timer(&mut self, token: u64, due: Option<u64>) -> bool {
        if let Some(old) = self.due.remove(&token) {
            self.timers.remove(&(old, token));
        }
        let Some(due) = due else { return false };
        self.due.insert(token, due);
        self.timers.insert((due, token));
        self.timers.first() == Some(&(due, token))
    }
}

#[derive(Debug)]
struct Service {
    epoll: Epoll,
    /// Written to make the thread look at the timers again.
    control: EventFd,
    registry: Mutex<Registry>,
    origin: Instant,
}

impl Service {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX - 1)
}

/// Starts the wake-up thread if it has not started ([`crate::Executor::new`] calls it, as
/// for [`crate::timer`]: a jailed server's job threads may not create it later).
pub(crate) fn start() {
    service();
}

fn service() -> &'static Service {
    static SERVICE: OnceLock<&'static Service> = OnceLock::new();
    SERVICE.get_or_init(|| {
        // Without its epoll or thread no VM's network would ever wake: fail loudly at the
        // first executor rather than leave guests hanging on every connection.
        let s: &'static Service = Box::leak(Box::new(Service {
            epoll: Epoll::new().expect("cannot create bud's network epoll"),
            control: EventFd::new(libc::EFD_NONBLOCK).expect("cannot create an eventfd"),
            registry: Mutex::default(),
            origin: Instant::now(),
        }));
        s.epoll
            .ctl(
                ControlOperation::Add,
                s.control.as_raw_fd(),
                EpollEvent::new(EventSet::IN, CONTROL),
            )
            .expect("cannot watch the network thread's eventfd");
        std::thread::Builder::new()
            .name("bud-net".into())
            .spawn(move || wait_loop(s))
            .expect("cannot start bud's network thread");
        s
    })
}

fn wait_loop(s: &Service) {
    let mut events = [EpollEvent::default(); 64];
    loop {
        let timeout = match s.registry().timers.first() {
            None => -1,
            Some(&(due, _)) => {
                let now = micros(s.origin.elapsed());
                // Round up: waking before the time would only wait again.
                i32::try_from(due.saturating_sub(now).div_ceil(1000)).unwrap_or(i32::MAX)
            }
        };
        let ready = match s.epoll.wait(timeout, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // An epoll that fails is a bug; the VMs' networks then only run on guest exits.
            Err(_) => return,
        };
        let mut wake = Vec::new();
        for e in &events[..ready] {
            if e.data() == CONTROL {
                let _ = s.control.read();
            } else {
                wake.push(e.data());
            }
        }
        let wakers: Vec<Arc<Waker>> = {
            let mut r = s.registry();
            let now = micros(s.origin.elapsed());
            while let Some(&(due, token)) = r.timers.first() {
                if due > now {
                    break;
                }
                r.timers.pop_first();
                r.due.remove(&token);
                wake.push(token);
            }
            wake.sort_unstable();
            wake.dedup();
            wake.iter()
                .filter_map(|t| r.wakers.get(t).and_then(Weak::upgrade))
                .collect()
        };
        // Outside the lock: a waker dropped here (its VM gone meanwhile) takes it in Drop.
        for w in wakers {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_due_timer_marks_its_stack_pending_and_a_cleared_one_never_fires() {
        let fired = Waker::new(Kicker::new());
        let cleared = Waker::new(Kicker::new());
        cleared.set_timer(Some(Duration::from_millis(5)));
        cleared.clear();
        fired.set_timer(Some(Duration::from_millis(5)));

        let started = Instant::now();
        while !fired.is_pending() && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));

        assert!(fired.take_pending(), "the timer fired");
        assert!(!fired.is_pending(), "taken once");
        assert!(!cleared.is_pending(), "a cleared timer never fires");
    }
}
