//! The doorbell: a 32-bit `out` to [`DOORBELL_PORT`] from guest user space.
//!
//! Owns the port permission (`ioperm`) and the one instruction, nothing else: what a code
//! means is the caller's business (see `protocol.rs`). Shared verbatim by `bud-agent` and the
//! `_bud` extension, which both include this file with `#[path]` next to their own
//! `mod protocol`. It must never ring anything outside a bud guest: on a real machine the
//! `out` either faults (no permission) or reaches a real I/O port.

use std::io;
use std::marker::PhantomData;

use crate::protocol::{DOORBELL_PORT, DOORBELL_WIDTH};

/// Proof that the current thread may ring the doorbell.
///
/// Created only by [`Doorbell::open`] after `ioperm` succeeded. Linux keeps the I/O permission
/// bitmap per thread (threads and children created later inherit it), so the token is neither
/// `Send` nor `Sync`: it cannot travel to a thread that lacks the permission.
#[derive(Debug)]
pub struct Doorbell {
    _this_thread_only: PhantomData<*const ()>,
}

impl Doorbell {
    /// Takes `ioperm(DOORBELL_PORT, 4, 1)` for the calling thread.
    ///
    /// The doorbell is a 32-bit `out`, which touches ports `DOORBELL_PORT..DOORBELL_PORT + 4`:
    /// the permission bitmap must allow all four, or the `out` raises #GP (measured under
    /// kvm_pvm: `ioperm(port, 1, 1)` + `outl` faults, `ioperm(port, 4, 1)` + `outl` reaches the
    /// VMM; hardware virtualization applies the same TSS bitmap rule natively). Only these
    /// four ports, never IOPL: user code gets no `cli`/`sti` and no other port. Needs root
    /// (CAP_SYS_RAWIO) and CONFIG_X86_IOPL_IOPERM.
    pub fn open() -> io::Result<Self> {
        // SAFETY: ioperm only changes the calling thread's I/O permission bitmap; it reads
        // and writes no memory of ours.
        let rc = unsafe { libc::ioperm(libc::c_ulong::from(DOORBELL_PORT), DOORBELL_WIDTH, 1) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            _this_thread_only: PhantomData,
        })
    }

    /// Rings the host: `eax` = `code`, `rdi` = `a`, `rsi` = `b`.
    ///
    /// Returns `eax` as the vCPU resumes: the code itself unless the host left a reply there.
    /// A doorbell may never return in this VM (the host snapshots or discards it); in a
    /// clone it returns right here.
    pub fn ring(&self, code: u32, a: u64, b: u64) -> u32 {
        // SAFETY: holding `self` proves this thread took ioperm for the ports, and the binary
        // only runs as bud's guest agent or worker, so the port belongs to bud's VMM.
        unsafe { ring_unchecked(code, a, b) }
    }
}

/// Rings the host without proof of permission.
///
/// # Safety
/// The caller must run inside a bud guest, where the port belongs to bud's VMM. Without
/// `ioperm` the `out` raises #GP and the kernel kills the process with SIGSEGV, so call this
/// only where such a death is acceptable (a disposable child).
pub unsafe fn ring_unchecked(code: u32, a: u64, b: u64) -> u32 {
    let reply: u32;
    // SAFETY: `out` reads three registers and writes nothing in this process; the caller
    // guarantees the port is bud's doorbell. No `nomem`: the asm is a compiler barrier, so
    // mailbox writes made before the doorbell are not moved after it (nor reads after it
    // before it). It uses no stack and leaves the flags alone.
    unsafe {
        core::arch::asm!(
            "out dx, eax",
            in("dx") DOORBELL_PORT,
            inout("eax") code => reply,
            in("rdi") a,
            in("rsi") b,
            options(nostack, preserves_flags),
        );
    }
    reply
}

/// Returns right after the guest kernel's next tick (the coarse monotonic clock, which moves
/// once a tick, changed), or after `limit` if it did not move. Called right before READY.
///
/// Why: a clone resumes at READY with the template's clock, so every job on it starts at the
/// same place between two of the guest's ticks. Where READY fell just before a tick, every
/// job paid that tick (the timer interrupt, timekeeping, the timer wheel, the scheduler's
/// tick: ~2 300 emulated guest-kernel instructions under kvm_pvm, ~1-2 ms, measured with
/// `perf record -e kvm:kvm_emulate_insn` symbolized with the guest's System.map: a Python
/// `print(1+1)` 2 927 against 628 on a template whose READY fell after a tick). Right after a
/// tick, a job has the whole tick period (40 ms at the guest's HZ=25) before the next. The
/// wait spins in user mode (the clock is read in the vDSO), so the tick keeps running; it is
/// at most one tick period, once per template boot. On hardware virtualization a tick costs
/// microseconds and the wait changes nothing else.
#[allow(dead_code)] // the agent never rings READY; `_bud` and `bud.node` do
pub fn after_tick(limit: std::time::Duration) -> bool {
    let coarse = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes only the timespec we pass, which is valid.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        (ts.tv_sec, ts.tv_nsec)
    };
    let start = coarse();
    let give_up = std::time::Instant::now() + limit;
    while coarse() == start {
        if std::time::Instant::now() > give_up {
            return false;
        }
        std::hint::spin_loop();
    }
    true
}
