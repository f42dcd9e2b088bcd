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
