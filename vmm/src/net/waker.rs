//! The one helper thread of a VM with a network card. It never touches guest memory, the card
//! or smoltcp (all of which the vCPU thread owns, lock-free): it waits, in `epoll`, for a host
//! socket of the VM to become ready or for smoltcp's next timer, then marks the card pending
//! and kicks the vCPU out of `KVM_RUN` ([`Kicker::poke`]), whose run loop runs the stack and
//! goes back in. A guest blocked in `recv` sleeps in KVM (the in-kernel irqchip halts it
//! there) until that kick delivers its data and interrupt.
//!
//! Host sockets are watched edge-triggered: a kick per new readiness, never a busy loop while
//! data waits for the guest's window (the guest's next ACK exits to the card and runs the
//! stack anyway). A parked VM is not running: kicks then only leave the pending mark, which
//! the next run serves first.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::vcpu::Kicker;

/// `epoll` data of the control eventfd (host sockets carry their fd, never this).
const CONTROL: u64 = u64::MAX;
/// No timer due.
const NEVER: u64 = u64::MAX;

/// What the vCPU thread and the helper thread share.
#[derive(Debug)]
pub(crate) struct Waker {
    epoll: Epoll,
    /// Written to make the thread look at `stop` and the deadline again.
    control: EventFd,
    pending: AtomicBool,
    /// When smoltcp next wants to run, in microseconds since `origin` ([`NEVER`]: no timer).
    deadline_us: AtomicU64,
    stop: AtomicBool,
    origin: Instant,
}

impl Waker {
    /// Whether the stack has something to do (and clears the mark).
    pub(crate) fn take_pending(&self) -> bool {
        self.pending.swap(false, Ordering::AcqRel)
    }

    /// Whether the stack has something to do (leaves the mark).
    pub(crate) fn is_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Clears the mark and the timer (a reset).
    pub(crate) fn clear(&self) {
        self.pending.store(false, Ordering::Release);
        self.deadline_us.store(NEVER, Ordering::Release);
    }

    /// Watches host socket `fd` (edge-triggered, read and write readiness) until it closes.
    pub(crate) fn watch(&self, fd: RawFd) -> io::Result<()> {
        let events =
            EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED;
        self.epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(events, fd as u64),
        )
    }

    /// Runs the stack again after `delay` (`None`: no timer).
    pub(crate) fn set_timer(&self, delay: Option<Duration>) {
        let at = delay.map_or(NEVER, |d| {
            (self.origin.elapsed() + d)
                .as_micros()
                .min(u128::from(NEVER - 1)) as u64
        });
        let before = self.deadline_us.swap(at, Ordering::AcqRel);
        if at < before {
            // The thread may be waiting for the later time: make it look again.
            let _ = self.control.write(1);
        }
    }
}

/// The helper thread of one VM; stops and is joined on drop.
#[derive(Debug)]
pub(crate) struct WakerThread {
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

/// Why the helper thread could not start.
#[derive(Debug, thiserror::Error)]
pub enum WakerError {
    #[error("epoll_create1 failed: {0}")]
    Epoll(io::Error),
    #[error("cannot create the control eventfd: {0}")]
    EventFd(io::Error),
    #[error("EPOLL_CTL_ADD of the control eventfd failed: {0}")]
    Watch(io::Error),
    #[error("cannot start the network helper thread: {0}")]
    Spawn(io::Error),
}

impl WakerThread {
    /// Starts the helper thread, kicking the vCPU of `kicker`.
    pub(crate) fn start(kicker: Kicker) -> Result<Self, WakerError> {
        let waker = Arc::new(Waker {
            epoll: Epoll::new().map_err(WakerError::Epoll)?,
            control: EventFd::new(libc::EFD_NONBLOCK).map_err(WakerError::EventFd)?,
            pending: AtomicBool::new(false),
            deadline_us: AtomicU64::new(NEVER),
            stop: AtomicBool::new(false),
            origin: Instant::now(),
        });
        waker
            .epoll
            .ctl(
                ControlOperation::Add,
                waker.control.as_raw_fd(),
                EpollEvent::new(EventSet::IN, CONTROL),
            )
            .map_err(WakerError::Watch)?;
        let shared = waker.clone();
        let thread = std::thread::Builder::new()
            .name("bud-net".into())
            .spawn(move || wait_loop(&shared, &kicker))
            .map_err(WakerError::Spawn)?;
        Ok(Self {
            waker,
            thread: Some(thread),
        })
    }

    pub(crate) fn waker(&self) -> &Arc<Waker> {
        &self.waker
    }
}

impl Drop for WakerThread {
    fn drop(&mut self) {
        self.waker.stop.store(true, Ordering::Release);
        let _ = self.waker.control.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wait_loop(w: &Waker, kicker: &Kicker) {
    let mut events = [EpollEvent::default(); 16];
    while !w.stop.load(Ordering::Acquire) {
        let deadline = w.deadline_us.load(Ordering::Acquire);
        let timeout = match deadline {
            NEVER => -1,
            at => {
                let now = w.origin.elapsed().as_micros() as u64;
                // Round up: waking before the deadline would only wait again.
                i32::try_from(at.saturating_sub(now).div_ceil(1000)).unwrap_or(i32::MAX)
            }
        };
        let ready = match w.epoll.wait(timeout, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // An epoll that fails is a bug; the VM's network then only runs on guest exits.
            Err(_) => return,
        };
        let mut wake = false;
        for e in &events[..ready] {
            if e.data() == CONTROL {
                let _ = w.control.read();
            } else {
                wake = true;
            }
        }
        let now = w.origin.elapsed().as_micros() as u64;
        let due = w.deadline_us.load(Ordering::Acquire);
        if due != NEVER && due <= now {
            // Only if nobody set a new deadline meanwhile.
            let _ = w
                .deadline_us
                .compare_exchange(due, NEVER, Ordering::AcqRel, Ordering::Acquire);
            wake = true;
        }
        if wake && !w.stop.load(Ordering::Acquire) {
            w.pending.store(true, Ordering::Release);
            kicker.poke();
        }
    }
}
