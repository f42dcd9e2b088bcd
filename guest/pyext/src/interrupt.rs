//! The host's interrupt of a session cell, guest side: Jupyter's "interrupt kernel".
//!
//! A cell that runs past its time must get `KeyboardInterrupt` and leave the session usable.
//! The host has one way to wake something in the guest without the guest asking: a byte on
//! the serial console's receive line, which raises the UART's IRQ. [`start`] (before READY)
//! opens the console tty in raw mode (so that no line discipline echoes, buffers lines or
//! turns the byte into a signal for some process group) and leaves a small thread blocked in
//! `read` on it. For every [`INTERRUPT_BYTE`] it reads, if the mailbox's `job::INTERRUPT`
//! names the request now running (`job::SEQUENCE`), it sends `SIGINT` to the worker's main
//! thread (a byte that arrives late, after its request ended, interrupts nothing), and a
//! blocking call (a `sleep`, a wait for a child) returns early with `EINTR`.
//!
//! The check and the signal are two steps, and the signal is taken later still (when the
//! main thread unblocks it and Python's eval loop runs the handler): in between, the
//! request may end by itself and the host start the next one. So the watcher records which
//! request it signalled for ([`take_sent`]), and the worker's SIGINT handler
//! (`bud_jobs.JobRunner.on_sigint`) raises `KeyboardInterrupt` only if that request is still
//! the host's current one: a late signal must never interrupt the next cell. A SIGINT the
//! watcher did not send (a job's own `os.kill`) records nothing and raises as usual.
//!
//! A request the image's kernel runtime runs (`language::KERNEL`: JavaScript on `node`) is
//! not the worker's: the kernel's process ([`set_kernel_pid`]) gets SIGINT, which stops the
//! code it runs synchronously, then SIGUSR2, which ends a request waiting in its event loop
//! (guest/node/kernel.js says why two); it ends the request itself, and nothing is recorded
//! for [`take_sent`] then.
//!
//! The same thread wakes the worker's lane thread (`bud_beside`): for a [`LANE_BYTE`] it
//! writes one byte to that thread's pipe (non-blocking: a full pipe already holds a wakeup).
//!
//! The thread is plain Rust, not Python: it never needs the GIL, so a cell that holds the
//! GIL in a long C call is still signalled (Python raises once the call returns). It costs
//! nothing while nobody writes to the console: it sleeps in the guest kernel. A cell can
//! defeat the interrupt (ignore SIGINT, catch `KeyboardInterrupt`, close the tty): the host
//! then ends the session after its grace period; that harms only that session.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

use crate::mailbox::Mailbox;
use crate::protocol::{job, lane, language};

/// The byte that means "interrupt" (ETX, what a terminal's Ctrl-C sends).
pub const INTERRUPT_BYTE: u8 = 0x03;

/// The byte that means "a request waits in the lane beside" ([`lane::BYTE`]).
pub const LANE_BYTE: u8 = lane::BYTE;

/// The request the watcher last sent SIGINT for (0: none since the last [`take_sent`]).
static SENT: AtomicU32 = AtomicU32::new(0);

/// The kernel runtime's process (0: none started).
static KERNEL_PID: AtomicI32 = AtomicI32::new(0);

/// The process that runs `language::KERNEL` requests, where their SIGINT goes.
pub fn set_kernel_pid(pid: i32) {
    KERNEL_PID.store(pid, Ordering::SeqCst);
}

/// The request the watcher's last SIGINT was for, and forget it (0: the watcher sent none
/// since the last call, so a SIGINT came from elsewhere).
pub fn take_sent() -> u32 {
    SENT.swap(0, Ordering::SeqCst)
}

/// Stack of the watcher thread: it only loops over `read`.
const STACK_SIZE: usize = 64 << 10;

/// Opens `tty` raw and starts the watcher thread; must be called on the main thread (the
/// one that runs cells), which is the one signalled. `lane_fd` (if not negative) is the
/// write end of the lane thread's pipe, owned by the watcher from here on.
pub fn start(tty: &str, mailbox: &'static Mailbox, lane_fd: libc::c_int) -> io::Result<()> {
    let path = std::ffi::CString::new(tty).map_err(io::Error::other)?;
    // SAFETY: `path` is a valid C string; open has no other memory effects.
    let raw = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a descriptor we just opened and own from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    make_raw(fd.as_raw_fd())?;
    let lane = if lane_fd >= 0 {
        // SAFETY: fcntl on a descriptor the caller passed; a bad one fails with EBADF.
        let flags = unsafe { libc::fcntl(lane_fd, libc::F_GETFL) };
        // SAFETY: as above, setting status flags only.
        if flags < 0 || unsafe { libc::fcntl(lane_fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0
        {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the caller hands the descriptor over (documented above).
        Some(unsafe { OwnedFd::from_raw_fd(lane_fd) })
    } else {
        None
    };
    // SAFETY: pthread_self has no preconditions.
    let main = unsafe { libc::pthread_self() };
    std::thread::Builder::new()
        .name("bud-interrupt".into())
        .stack_size(STACK_SIZE)
        .spawn(move || watch(fd, main, mailbox, lane))?;
    Ok(())
}

/// `cfmakeraw` on `fd`: no echo, no line buffering, no signal characters, no output
/// processing, 8-bit bytes; `read` returns as soon as one byte is there.
fn make_raw(fd: libc::c_int) -> io::Result<()> {
    // SAFETY: termios is plain data, filled in by tcgetattr before use.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: `t` is a valid termios for tcgetattr to fill.
    if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `t` is a valid, initialised termios.
    unsafe { libc::cfmakeraw(&mut t) };
    t.c_cc[libc::VMIN] = 1;
    t.c_cc[libc::VTIME] = 0;
    // SAFETY: `t` is a valid termios for tcsetattr to read.
    if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A `u32` field of the mailbox, read as the host left it.
fn field(mailbox: &Mailbox, offset: usize) -> u32 {
    debug_assert!(offset + 4 <= mailbox.len());
    // SAFETY: the mailbox lives for the whole process and `offset + 4` is inside it; the host
    // writes these fields only while the vCPU is stopped, so a volatile read sees them whole.
    unsafe { std::ptr::read_volatile(mailbox.as_ptr().add(offset).cast::<u32>()) }
}

fn watch(fd: OwnedFd, main: libc::pthread_t, mailbox: &'static Mailbox, lane: Option<OwnedFd>) {
    let mut buf = [0u8; 64];
    loop {
        // SAFETY: `buf` is a valid writable buffer of its length; `fd` is open.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return; // the tty is gone: interrupts are off for this worker
        }
        if n == 0 {
            return;
        }
        match &lane {
            Some(lane) if buf[..n as usize].contains(&LANE_BYTE) => {
                // SAFETY: writes one byte from a valid buffer to an open descriptor; EAGAIN
                // (a full pipe) means the lane thread has wakeups waiting already.
                unsafe { libc::write(lane.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
            }
            _ => {}
        }
        let sequence = field(mailbox, job::SEQUENCE);
        if buf[..n as usize].contains(&INTERRUPT_BYTE)
            && sequence != 0
            && field(mailbox, job::INTERRUPT) == sequence
        {
            let kernel = KERNEL_PID.load(Ordering::SeqCst);
            if kernel > 0 && field(mailbox, job::LANGUAGE) == language::KERNEL {
                // SAFETY: kill has no memory effects; the kernel is a child of this process,
                // so its pid is not reused while it is unreaped.
                unsafe {
                    libc::kill(kernel, libc::SIGINT);
                    libc::kill(kernel, libc::SIGUSR2);
                }
                continue;
            }
            SENT.store(sequence, Ordering::SeqCst);
            // SAFETY: `main` is the worker's main thread, which lives as long as the process.
            unsafe { libc::pthread_kill(main, libc::SIGINT) };
        }
    }
}
