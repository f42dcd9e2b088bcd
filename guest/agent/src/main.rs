//! bud-agent: PID 1 of bud's guest.
//!
//! # The agent <-> Python arrangement
//!
//! Two processes, each doing one thing:
//!
//! - **bud-agent (PID 1)** is a tiny supervisor. It mounts /proc, /sys, /dev, /dev/shm and
//!   /tmp (also at /home/user), turns on transparent huge pages (`hugepages.rs`), takes ioperm for the doorbell,
//!   rings AGENT_STARTED, starts the worker with `posix_spawn`, names it to the guest
//!   kernel's exit report (`worker::watch_exit`: the kernel tells the VMM the worker's wait
//!   status as soon as it starts to exit, before the seconds of emulated teardown), and then
//!   sleeps in `waitpid` for the rest of the VM's life: it reaps orphans, and if the worker
//!   ever exits (and the VMM let the guest run on) it writes a line and rings
//!   FAILED(WORKER_EXITED, wait status). Before READY that means the template failed; in a
//!   clone it means the job took the worker down.
//! - **The warm Python worker** (`python3.11 -m bud_worker --guest`, `guest/python/`) imports the
//!   standard library a job is likely to use, pre-touches its heap, creates the mailbox
//!   (locked and touched) and rings READY *itself*, from the thread that will run the
//!   jobs. The host snapshots at that exit, and a clone resumes the vCPU just after the
//!   `out`: the worker's `ready()` returns and the job runs right there, in user mode.
//!
//! Why this way round: guest-kernel work is the only thing that is slow here (0.2-0.7 ms per
//! syscall, 1.3 ms per fresh page, under kvm_pvm's emulator). With the worker parked at the
//! doorbell, resuming costs nothing in the guest kernel: no wake-up, no scheduling, no
//! pipe between two processes. Reading the job from the mailbox, running pure Python,
//! writing its output into the mailbox and ringing the next doorbell are all user-mode
//! accesses to pages that are already mapped: zero syscalls, zero fresh pages. Had PID 1 been
//! the one parked, every job would pay at least a write, a wake-up, a read and a context
//! switch each way before any Python ran. Shell jobs run in a busybox `sh` the worker started
//! and parked before READY (blocked reading its script from a pipe), so they pay a few pipe
//! syscalls and a wake-up, but no process creation (see `guest/python/bud_shell.py`).
//!
//! # What PID 1 must never do
//!
//! Exit, or panic out of `main`: the kernel panics when init dies. On a fatal error the agent
//! writes one line, rings FAILED with the failure code and errno, and blocks forever (still
//! reaping). It is built without Rust's `main` shim (`no_main`): that shim aborts when stdio
//! is closed and /dev/null is missing, which is exactly the state of a broken initramfs,
//! and would take the kernel down instead of reporting. The agent never touches the mailbox
//! and never rings READY.

#![cfg_attr(not(test), no_main)]

#[path = "../../../vmm/src/protocol.rs"]
#[allow(dead_code)] // shared verbatim with the host; the agent uses only some of it
mod protocol;

mod console;
mod doorbell;
mod error;
mod hugepages;
mod mounts;
mod worker;

use std::io;
use std::panic;

use console::say;
use doorbell::Doorbell;
use error::Error;
use protocol::{PROTOCOL_VERSION, code, failure};
use worker::WaitStatus;

/// The C entry point (crt1 calls it; std needs no runtime set-up of its own).
#[cfg(not(test))]
#[unsafe(no_mangle)]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    agent_main()
}

/// Runs the agent; a panic ends in [`halt`], never in an exit.
#[cfg_attr(test, allow(dead_code))] // under test the harness owns `main`
fn agent_main() -> ! {
    // A panic unwinds to here and must go no further: an unwind out of an `extern "C"` fn
    // aborts, and init aborting is a kernel panic. Nothing of `run`'s state is used after a
    // panic, so unwind safety is moot.
    let _ = panic::catch_unwind(|| run());
    say!("panicked; halting");
    halt()
}

/// Boots the guest's user space and supervises the worker. Never returns.
fn run() -> ! {
    console::ensure_stdio();

    // Permission first, so that every later failure can be rung.
    let doorbell = match Doorbell::open() {
        Ok(doorbell) => doorbell,
        Err(e) => fail_without_doorbell(&Error::Ioperm(e)),
    };
    doorbell.ring(code::AGENT_STARTED, u64::from(PROTOCOL_VERSION), 0);

    if let Err(e) = mounts::mount_all(|warning| say!("{warning} (continuing)")) {
        fail(&doorbell, &e);
    }
    hugepages::enable(|path, e| say!("{path}: {e} (continuing with 4 KiB pages)"));
    let worker = match worker::spawn() {
        Ok(pid) => pid,
        Err(e) => fail(&doorbell, &Error::Spawn(e)),
    };
    if let Err(e) = worker::watch_exit(worker) {
        say!(
            "{}: {e} (continuing: a worker exit is reported when it is reaped)",
            worker::EXIT_WATCH
        );
    }
    say!(
        "up at {:.3} s, worker pid {worker}",
        console::uptime().as_secs_f64()
    );

    reap_forever(|pid, status| {
        if pid == worker {
            say!("worker {status}");
            doorbell.ring(code::FAILED, failure::WORKER_EXITED, status.detail());
        }
    })
}

/// Reports a fatal error and blocks forever.
fn fail(doorbell: &Doorbell, error: &Error) -> ! {
    say!("{error}");
    doorbell.ring(code::FAILED, error.failure_code(), error.errno());
    halt()
}

/// Reports a fatal error when `ioperm` failed, then blocks forever.
///
/// Without the permission the `out` most likely faults (it did under kvm_pvm, as it does under
/// hardware virtualization), but the FAILED doorbell is still worth trying: it is rung from a
/// disposable child, so a fault kills the child, not init, and the console line stays.
fn fail_without_doorbell(error: &Error) -> ! {
    say!("{error}");
    // SAFETY: fork has no preconditions here: PID 1 is single-threaded at this point.
    match unsafe { libc::fork() } {
        0 => {
            // SAFETY: this runs inside bud's guest, and in a child that may die of the
            // fault (the parent only reaps it).
            unsafe { doorbell::ring_unchecked(code::FAILED, error.failure_code(), error.errno()) };
            // SAFETY: _exit ends the child without running anything of the parent's.
            unsafe { libc::_exit(0) }
        }
        -1 => say!("fork: {}", io::Error::last_os_error()),
        _ => {}
    }
    halt()
}

/// Blocks forever, reaping whatever exits.
fn halt() -> ! {
    reap_forever(|_, _| {})
}

/// Init's loop: waits for any child, hands each exit to `on_exit`, never returns.
///
/// Signals sent to PID 1 without a handler are dropped by the kernel, so there are no
/// handlers and no signal masks to manage. When no child is left (ECHILD), no process can
/// become our child again (every user process descends from init), so it parks in `pause`.
fn reap_forever(mut on_exit: impl FnMut(libc::pid_t, WaitStatus)) -> ! {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid writes one int through a pointer to a live local.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid > 0 {
            on_exit(pid, WaitStatus(status));
        } else if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            park();
        }
    }
}

/// Sleeps for good.
fn park() -> ! {
    loop {
        // SAFETY: pause has no arguments and only sleeps until a handled signal (none).
        unsafe { libc::pause() };
    }
}
