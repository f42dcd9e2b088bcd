//! Virtio devices over virtio-MMIO: the transport's register file ([`mmio`]) and a virtio-net
//! device behind it ([`net`]), as plain state machines over guest memory that know nothing of
//! KVM, threads or sockets.
//!
//! **Wiring.** [`crate::net::Nic`] puts a [`net::NetDevice`] in the MMIO window of a VM that
//! has a network card ([`crate::layout::VIRTIO_NET_MMIO_BASE`], announced with
//! `virtio_mmio.device=` on its command line), raising its interrupt through an irqfd, with the
//! user-mode stack behind [`net::FrameSink`]; its state is part of `MachineState`. The
//! transport stays one single-owner object: the vCPU thread owns it and runs the queues
//! between exits (`docs/network-design.md`, stage 1, says why). This module is tested on its
//! own too, driven by unit tests that play the guest driver against a `GuestMemoryMmap`.
//!
//! **Why these crates.** Split virtqueues come from rust-vmm's `virtio-queue` 0.18 (`Queue` for
//! the ring arithmetic, EVENT_IDX and notification suppression; `QueueState` for snapshots), and
//! the register offsets, feature bits and header flags from `virtio-bindings` 0.2 (generated
//! from Linux's uapi headers): the same well-kept rust-vmm family as bud's `kvm-ioctls`,
//! `vm-memory` 0.18 (which both resolve to; one copy in `Cargo.lock`) and `vm-superio`. The
//! MMIO transport itself is bud's own: rust-vmm's `virtio-device` crate is not published.
//!
//! **Hostile guests.** Every register access and every ring is untrusted input (a job runs as
//! root in its guest). Nothing here panics on it. The rule:
//! - harmless nonsense (a register access that is not 32-bit and aligned, a read past the config
//!   space, a write to a read-only register, a queue register while no queue is selected) is
//!   ignored, reads as zero, and is counted ([`mmio::TransportCounters::bad_accesses`]);
//! - a driver that breaks the protocol in a way that leaves the device in doubt (queue setup in
//!   the wrong state, an invalid queue size, unaligned rings or rings outside guest RAM, a
//!   descriptor chain that loops, leaves RAM, points outside the table, uses indirect
//!   descriptors (never offered) or has the wrong direction, an available index that jumps past
//!   the ring) marks the device broken: `DEVICE_NEEDS_RESET` in Status, a config-change
//!   interrupt if the driver had it running, a [`DeviceFault`] recorded and counted, and no more
//!   queue processing until the driver resets the device (writes 0 to Status);
//! - a well-formed request with unacceptable content (an oversize or runt frame, GSO that was
//!   not offered, checksum offsets outside the frame) is dropped and counted, and its buffer
//!   goes back to the guest.

pub mod mmio;
pub mod net;

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

/// Why a device stopped serving its queues (it then reports `DEVICE_NEEDS_RESET`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceFault {
    #[error("queue {queue} set up while the device status is {status:#x} or the queue is ready")]
    QueueSetupState { queue: u16, status: u32 },
    #[error("queue {queue}: invalid size {size}")]
    QueueSize { queue: u16, size: u32 },
    #[error("queue {queue}: {what} address {addr:#x} is not aligned")]
    RingAlignment {
        queue: u16,
        what: &'static str,
        addr: u64,
    },
    #[error("queue {queue}: its rings are not inside guest RAM")]
    RingOutsideMemory { queue: u16 },
    #[error("queue {queue}: the available index moved more than the ring's size")]
    AvailIndex { queue: u16 },
    #[error("queue {queue}: descriptor index {index} is outside the table")]
    DescriptorIndex { queue: u16, index: u16 },
    #[error("queue {queue}: the chain from head {head} is longer than the ring (a loop)")]
    ChainLoop { queue: u16, head: u16 },
    #[error("queue {queue}: indirect descriptor (the feature was not offered)")]
    Indirect { queue: u16 },
    #[error("queue {queue}: a {found} descriptor where the device expects the other direction")]
    Direction { queue: u16, found: &'static str },
    #[error("queue {queue}: buffer {addr:#x}+{len:#x} is not inside guest RAM")]
    BufferOutsideMemory { queue: u16, addr: u64, len: u32 },
    #[error("queue {queue}: ring access failed: {detail}")]
    Ring { queue: u16, detail: String },
}

/// One buffer of a descriptor chain, checked to lie inside guest RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

/// Which buffers a device expects in a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Device-readable buffers only (driver to device, like virtio-net tx).
    Readable,
    /// Device-writable buffers only (device to driver, like virtio-net rx).
    Writable,
}

/// Walks the descriptor chain starting at `head` in the table at `desc_table` of a queue of
/// `size` entries, appending its buffers to `out`, and returns the chain's total length.
///
/// bud walks chains itself rather than through `virtio_queue::DescriptorChain`, which follows
/// indirect tables whether or not the feature was negotiated and ends a malformed chain
/// silently; here every malformation is a [`DeviceFault`]. At most `size` descriptors are
/// followed, so a loop ends.
pub(crate) fn walk_chain<M: GuestMemory>(
    mem: &M,
    queue: u16,
    desc_table: GuestAddress,
    size: u16,
    head: u16,
    direction: Direction,
    out: &mut Vec<Segment>,
) -> Result<u64, DeviceFault> {
    let mut index = head;
    let mut total = 0u64;
    for _ in 0..size {
        if index >= size {
            return Err(DeviceFault::DescriptorIndex { queue, index });
        }
        // The table was checked to lie in RAM when the queue became ready; a failure here
        // still ends in a fault, not a panic.
        let desc: Descriptor = desc_table
            .checked_add(u64::from(index) * 16)
            .and_then(|addr| mem.read_obj(addr).ok())
            .ok_or(DeviceFault::DescriptorIndex { queue, index })?;
        if desc.refers_to_indirect_table() {
            return Err(DeviceFault::Indirect { queue });
        }
        match (direction, desc.is_write_only()) {
            (Direction::Readable, true) => {
                return Err(DeviceFault::Direction {
                    queue,
                    found: "device-writable",
                });
            }
            (Direction::Writable, false) => {
                return Err(DeviceFault::Direction {
                    queue,
                    found: "device-readable",
                });
            }
            _ => {}
        }
        let access = match direction {
            Direction::Readable => Permissions::Read,
            Direction::Writable => Permissions::Write,
        };
        if !mem.check_range(desc.addr(), desc.len() as usize, access) {
            return Err(DeviceFault::BufferOutsideMemory {
                queue,
                addr: desc.addr().0,
                len: desc.len(),
            });
        }
        out.push(Segment {
            addr: desc.addr(),
            len: desc.len(),
        });
        total += u64::from(desc.len());
        if !desc.has_next() {
            return Ok(total);
        }
        index = desc.next();
    }
    Err(DeviceFault::ChainLoop { queue, head })
}

#[cfg(test)]
pub(crate) mod testing;
