//! The doorbell: a 32-bit `out` to [`DOORBELL_PORT`] from guest user space.
//!
//! Owns the port permission (`iopl(3)`) and the one instruction, nothing else: what a code
//! means is the caller's business (see `protocol.rs`). Shared verbatim by `bud-agent` and the
//! `_bud` extension, which both include this file with `#[path]` next to their own
//! `mod protocol`. It must never ring anything outside a bud guest: on a real machine the
//! `out` either faults (no permission) or reaches a real I/O port.

use std::io;
use std::marker::PhantomData;

use crate::protocol::DOORBELL_PORT;

/// Proof that the current thread may ring the doorbell.
///
/// Created only by [`Doorbell::open`] after `iopl(3)` succeeded. The I/O privilege level lives
/// in the calling thread's user RFLAGS (threads and children created later inherit it), so
/// the token is neither `Send` nor `Sync`: it cannot travel to a thread that lacks it.
#[derive(Debug)]
pub struct Doorbell {
    _this_thread_only: PhantomData<*const ()>,
}

impl Doorbell {
    /// Takes I/O privilege level 3 (`iopl(3)`) for the calling thread.
    ///
    /// Why IOPL and not `ioperm` for the one port: a user-mode `out` is allowed when CPL <=
    /// RFLAGS.IOPL, or else when the TSS I/O bitmap allows the port. Under hardware
    /// virtualization both work; under kvm_pvm a Linux guest's `out` raised #GP even after a
    /// successful `ioperm` (kvm_pvm does not reach the guest's TSS bitmap), while IOPL 3 is
    /// honoured. Stock 6.12 only emulates `iopl()` with the bitmap; bud's kernel patch
    /// `0006-iopl-sets-real-iopl` makes it set RFLAGS.IOPL again, so one mechanism works on
    /// both kinds of host. Needs root (CAP_SYS_RAWIO) and CONFIG_X86_IOPL_IOPERM.
    pub fn open() -> io::Result<Self> {
        // SAFETY: iopl only changes the calling thread's I/O privilege level; it reads and
        // writes no memory of ours.
        let rc = unsafe { libc::iopl(3) };
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
        // SAFETY: holding `self` proves this thread took IOPL 3, and the binary
        // only runs as bud's guest agent or worker, so the port belongs to bud's VMM.
        unsafe { ring_unchecked(code, a, b) }
    }
}

/// Rings the host without proof of permission.
///
/// # Safety
/// The caller must run inside a bud guest, where the port belongs to bud's VMM. Without
/// IOPL 3 the `out` raises #GP and the kernel kills the process with SIGSEGV, so call this
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
