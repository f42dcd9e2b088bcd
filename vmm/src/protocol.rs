//! The host <-> guest protocol: doorbell port, doorbell codes and the mailbox header.
//!
//! This file is shared verbatim by the host (`vmm`) and the guest (`bud-agent`, the `_bud`
//! Python extension, which include it with `#[path]`), so it must stay free of dependencies:
//! plain constants and `core` only.
//!
//! # Doorbell
//! The guest rings the host with a 32-bit `out` to [`DOORBELL_PORT`] from user space (CPL3):
//! `eax` holds a doorbell code, `rdi` and `rsi` carry arguments (the code says which). One port
//! exit per job boundary and no guest-kernel work. Under hardware virtualization a CPL3 `out`
//! needs permission in the TSS I/O bitmap, so the guest takes `ioperm(DOORBELL_PORT, 1, 1)`
//! first; kvm_pvm lets it through without.
//!
//! # Mailbox
//! Memory the warm Python worker allocated, locked and touched before READY. At the READY
//! doorbell `rdi` is its guest-virtual address and `rsi` its length; the host translates it
//! once through the guest page tables into a list of guest-physical pages. It starts with a
//! [`MailboxHeader`]-shaped header (little endian) written by the guest. Everything the guest
//! writes there is hostile input to the host: the host bounds-checks every field.

/// Version of this protocol. Bumped on any change to the codes or the mailbox layout.
pub const PROTOCOL_VERSION: u32 = 1;

/// I/O port of the doorbell. Not used by any device bud emulates (nor by legacy PC hardware).
pub const DOORBELL_PORT: u16 = 0x0bd0;

/// Magic at offset 0 of the mailbox: "BUDM" in little endian.
pub const MAILBOX_MAGIC: u32 = u32::from_le_bytes(*b"BUDM");

/// Default mailbox size the worker allocates: 2 MiB (a multiple of the 4 KiB page size).
pub const MAILBOX_DEFAULT_SIZE: usize = 2 << 20;

/// Upper bound the host accepts for the mailbox length at READY.
pub const MAILBOX_MAX_SIZE: usize = 64 << 20;

/// Byte offsets of the mailbox header fields (all `u32`, little endian).
pub mod header {
    /// [`super::MAILBOX_MAGIC`].
    pub const MAGIC: usize = 0;
    /// [`super::PROTOCOL_VERSION`] the guest speaks.
    pub const VERSION: usize = 4;
    /// Size of the header; payload (defined by the job protocol) starts here.
    pub const SIZE: usize = 64;
}

/// Doorbell codes (the value in `eax` of the 32-bit `out`).
pub mod code {
    /// The agent (PID 1) started; `rdi` = [`super::PROTOCOL_VERSION`]. Diagnostic only.
    pub const AGENT_STARTED: u32 = 0x0001;
    /// The warm worker is ready: `rdi` = mailbox guest-virtual address, `rsi` = its length.
    /// The host takes the template snapshot at this exit.
    pub const READY: u32 = 0x0002;
    /// The guest failed before READY: `rdi` = a [`super::failure`] code, `rsi` = detail
    /// (an exit status or errno). The console holds the human-readable story.
    pub const FAILED: u32 = 0x00ff;
}

/// Failure codes carried in `rdi` of a [`code::FAILED`] doorbell.
pub mod failure {
    /// A mount the agent needs failed; `rsi` = errno.
    pub const MOUNT: u64 = 1;
    /// The worker could not be started; `rsi` = errno.
    pub const SPAWN: u64 = 2;
    /// The worker exited before READY; `rsi` = its wait status.
    pub const WORKER_EXITED: u64 = 3;
    /// `ioperm` for the doorbell failed (seen only by a later doorbell if the port still works).
    pub const IOPERM: u64 = 4;
}
