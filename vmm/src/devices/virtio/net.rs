//! A virtio-net device: one receive queue (0) and one transmit queue (1), moving Ethernet
//! frames between the guest and a host-side [`FrameSink`] (where the user-mode network stack
//! will plug in; `docs/network-design.md` section 2).
//!
//! Features offered (the design's section 1.2): `VERSION_1`, `RING_EVENT_IDX`, `MAC` (a fixed
//! address: every clone is alone on its link), `MTU` (65520 by default: one 64 KiB frame
//! instead of 45 at 1500, each of which costs guest-kernel work that is emulated on kvm_pvm),
//! `CSUM` (the guest may leave checksums to the host, which terminates TCP and never needs
//! them), `GUEST_CSUM` (received frames carry `DATA_VALID`, so the guest skips checksumming
//! them) and `MRG_RXBUF` (a large frame spans several small receive buffers, which Linux
//! refills cheaply). Not offered: indirect descriptors (Linux would `kmalloc` a table per
//! multi-buffer packet), a control queue, multiqueue, link status, TSO/UFO.
//!
//! Every buffer starts with the 12-byte `virtio_net_hdr_v1` (VERSION_1's header, whatever
//! else is negotiated). Transmit: each chain (device-readable buffers only) is gathered,
//! checked (at least header + an Ethernet header, at most header + [`NetConfig::max_frame_len`]
//! bytes, no GSO, checksum offsets inside the frame) and its frame handed to the sink without
//! the header; the buffer goes back with used length 0. Receive: [`VirtioNet::receive`] writes
//! the header and the frame across as many receive chains (device-writable buffers only) as it
//! takes, sets `num_buffers`, adds each chain to the used ring with the bytes it got, and with
//! EVENT_IDX interrupts only when the driver's `used_event` asks for it. When the receive ring
//! is short the frame is not taken ([`RxOutcome::NoBuffers`]): the caller keeps it and retries
//! after the driver's next receive-queue notification, which the device asks for.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF,
    VIRTIO_NET_F_MTU, VIRTIO_NET_HDR_F_DATA_VALID, VIRTIO_NET_HDR_F_NEEDS_CSUM,
    VIRTIO_NET_HDR_GSO_NONE, VIRTIO_NET_S_LINK_UP,
};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VRING_AVAIL_F_NO_INTERRUPT};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory};
use vm_superio::Trigger;

use super::mmio::{MmioTransport, StateError, TransportState, VirtioDevice};
use super::{DeviceFault, Direction, Segment, walk_chain};

/// Index of the receive queue.
pub const RX_QUEUE: u16 = 0;
/// Index of the transmit queue.
pub const TX_QUEUE: u16 = 1;
/// Maximum size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Length of `virtio_net_hdr_v1`, in front of every frame in both directions.
pub const VNET_HDR_LEN: usize = 12;
/// An Ethernet header (destination, source, ethertype).
pub const ETH_HDR_LEN: usize = 14;
/// One 802.1Q tag, allowed on top of the MTU.
pub const VLAN_TAG_LEN: usize = 4;
/// The MTU announced by default (passt's default; the design's choice).
pub const DEFAULT_MTU: u16 = 65520;
/// The MAC address announced by default (locally administered; every clone has its own link).
pub const DEFAULT_MAC: [u8; 6] = [0x02, 0x42, 0x0a, 0x00, 0x02, 0x0f];
/// Length of the config space bud exposes: `mac`, `status`, `max_virtqueue_pairs`, `mtu`.
pub const CONFIG_LEN: usize = 12;

const QUEUE_MAX_SIZES: [u16; 2] = [QUEUE_SIZE, QUEUE_SIZE];

/// The features this device offers.
pub const OFFERED_FEATURES: u64 = (1 << VIRTIO_F_VERSION_1)
    | (1 << VIRTIO_RING_F_EVENT_IDX)
    | (1 << VIRTIO_NET_F_MAC)
    | (1 << VIRTIO_NET_F_MTU)
    | (1 << VIRTIO_NET_F_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_CSUM)
    | (1 << VIRTIO_NET_F_MRG_RXBUF);

/// What the device announces in its config space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    pub mac: [u8; 6],
    pub mtu: u16,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            mac: DEFAULT_MAC,
            mtu: DEFAULT_MTU,
        }
    }
}

impl NetConfig {
    /// The largest Ethernet frame either way: MTU + Ethernet header + one VLAN tag (65538 at
    /// the default MTU; with the virtio header, a 65550-byte chain).
    pub fn max_frame_len(&self) -> usize {
        usize::from(self.mtu) + ETH_HDR_LEN + VLAN_TAG_LEN
    }

    fn bytes(&self) -> [u8; CONFIG_LEN] {
        let mut b = [0u8; CONFIG_LEN];
        b[..6].copy_from_slice(&self.mac);
        // Link status (meaningful only with VIRTIO_NET_F_STATUS, not offered: always up).
        b[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        // max_virtqueue_pairs (meaningful only with MQ): one pair.
        b[8..10].copy_from_slice(&1u16.to_le_bytes());
        b[10..12].copy_from_slice(&self.mtu.to_le_bytes());
        b
    }
}

/// How the guest left a transmitted frame's checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxChecksum {
    /// The frame is complete as sent.
    Complete,
    /// `VIRTIO_NET_HDR_F_NEEDS_CSUM`: the checksum over `frame[start..]` belongs at
    /// `frame[start + offset..][..2]` and is not computed (a host that forwards the frame
    /// must compute it; one that terminates TCP ignores it).
    Partial { start: u16, offset: u16 },
}

/// Where transmitted frames go: the host side of the link.
pub trait FrameSink {
    /// One Ethernet frame from the guest (without the virtio header).
    fn transmit(&mut self, frame: &[u8], checksum: TxChecksum);
}

/// Why a frame was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Shorter than an Ethernet header (for transmit: after the virtio header).
    Runt,
    /// Longer than [`NetConfig::max_frame_len`].
    Oversize,
    /// Transmit with a GSO type (no TSO/UFO was offered).
    Gso,
    /// Transmit with NEEDS_CSUM that CSUM did not allow, or offsets outside the frame.
    Checksum,
    /// Receive: the driver's buffers cannot hold the frame however many there are (without
    /// MRG_RXBUF, one buffer too small; with it, the whole ring too small).
    NeverFits,
}

/// What became of a frame offered to the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxOutcome {
    /// Written into this many receive buffers.
    Delivered { buffers: u16 },
    /// Not enough receive buffers now: keep the frame and retry after the driver notifies the
    /// receive queue (the device has asked it to).
    NoBuffers,
    /// Dropped and counted.
    Dropped(DropReason),
    /// The driver has not started the device, its receive queue is not ready, or the device
    /// is broken: keep or drop the frame, the guest cannot take it.
    NotRunning,
}

/// Diagnostic counters of the device (not part of its state).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetCounters {
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub tx_dropped: u64,
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub rx_dropped: u64,
    /// Frames not taken for lack of receive buffers (each attempt).
    pub rx_no_buffers: u64,
    /// Notifications of the receive queue (the driver added buffers).
    pub rx_kicks: u64,
    pub last_drop: Option<DropReason>,
}

/// The virtio-net device model (behind an [`MmioTransport`]).
#[derive(Debug)]
pub struct VirtioNet<B> {
    config: NetConfig,
    config_bytes: [u8; CONFIG_LEN],
    /// Negotiated features (0 until the driver sets DRIVER_OK).
    features: u64,
    sink: B,
    counters: NetCounters,
    /// Scratch space reused across frames: buffers of the chain(s) at hand, and the bytes.
    segments: Vec<Segment>,
    /// Receive chains taken for one frame: head, capacity, number of its segments.
    chains: Vec<(u16, u64, usize)>,
    bytes: Vec<u8>,
}

/// A virtio-net device with its MMIO transport.
pub type NetDevice<B, T> = MmioTransport<VirtioNet<B>, T>;

/// The device's state by value: its config and its transport (snapshots and resets).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetDeviceState {
    pub config: NetConfig,
    pub transport: TransportState,
}

/// Why a [`NetDeviceState`] cannot be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetStateError {
    #[error("the state's config {found:?} differs from the device's {expected:?}")]
    Config {
        found: NetConfig,
        expected: NetConfig,
    },
    #[error(transparent)]
    Transport(#[from] StateError),
}

impl<B: FrameSink> VirtioNet<B> {
    /// A device announcing `config`, sending frames to `sink`.
    pub fn new(config: NetConfig, sink: B) -> Self {
        Self {
            config,
            config_bytes: config.bytes(),
            features: 0,
            sink,
            counters: NetCounters::default(),
            segments: Vec::new(),
            chains: Vec::new(),
            bytes: Vec::new(),
        }
    }

    /// The config announced.
    pub fn config(&self) -> NetConfig {
        self.config
    }

    /// The frame sink.
    pub fn sink(&self) -> &B {
        &self.sink
    }

    /// The frame sink, mutably.
    pub fn sink_mut(&mut self) -> &mut B {
        &mut self.sink
    }

    /// Diagnostic counters.
    pub fn counters(&self) -> NetCounters {
        self.counters
    }

    fn has(&self, feature: u32) -> bool {
        self.features & (1 << feature) != 0
    }

    /// Offers `frame` to the guest through the receive queue of `queues`. Returns what became
    /// of it and whether the driver should be interrupted. Use it through
    /// [`MmioTransport::run`] (or [`NetDevice::receive_frame`]), which checks the device is
    /// running and turns a fault into a broken device.
    pub fn receive<M: GuestMemory>(
        &mut self,
        frame: &[u8],
        queues: &mut [Queue],
        mem: &M,
    ) -> Result<(RxOutcome, bool), DeviceFault> {
        let Some(queue) = queues.get_mut(usize::from(RX_QUEUE)).filter(|q| q.ready()) else {
            return Ok((RxOutcome::NotRunning, false));
        };
        if frame.len() > self.config.max_frame_len() {
            return Ok((self.drop_rx(DropReason::Oversize), false));
        }
        if frame.len() < ETH_HDR_LEN {
            return Ok((self.drop_rx(DropReason::Runt), false));
        }
        let need = (VNET_HDR_LEN + frame.len()) as u64;
        let mergeable = self.has(VIRTIO_NET_F_MRG_RXBUF);
        let start = queue.next_avail();
        loop {
            self.segments.clear();
            self.chains.clear();
            let mut capacity = 0u64;
            while capacity < need && (mergeable || self.chains.is_empty()) {
                let Some(head) = next_head(queue, RX_QUEUE, mem)? else {
                    break;
                };
                let before = self.segments.len();
                let len = walk_chain(
                    mem,
                    RX_QUEUE,
                    GuestAddress(queue.desc_table()),
                    queue.size(),
                    head,
                    Direction::Writable,
                    &mut self.segments,
                )?;
                self.chains.push((head, len, self.segments.len() - before));
                capacity += len;
            }
            if capacity >= need {
                break;
            }
            // Not enough: give the chains back untouched.
            let one_too_small = !mergeable && !self.chains.is_empty();
            let ring_too_small = self.chains.len() >= usize::from(queue.size());
            if one_too_small || ring_too_small {
                queue.set_next_avail(start);
                return Ok((self.drop_rx(DropReason::NeverFits), false));
            }
            // Every available chain was looked at (fewer than the ring holds). Ask for a
            // notification when the driver adds past them (EVENT_IDX's avail_event is written
            // from next_avail, so it must point past them while asking); if some arrived
            // meanwhile they would not be notified: look again now. Each retry needs the
            // driver to have added chains, and the ring bounds that.
            let more = queue
                .enable_notification(mem)
                .map_err(|e| ring_fault(RX_QUEUE, e))?;
            queue.set_next_avail(start);
            if !more {
                self.counters.rx_no_buffers += 1;
                return Ok((RxOutcome::NoBuffers, false));
            }
        }

        let buffers = if mergeable { self.chains.len() } else { 1 };
        let flags = if self.has(VIRTIO_NET_F_GUEST_CSUM) {
            VIRTIO_NET_HDR_F_DATA_VALID as u8
        } else {
            0
        };
        self.bytes.clear();
        self.bytes.extend_from_slice(&[flags, VIRTIO_NET_HDR_GSO_NONE as u8]);
        // hdr_len, gso_size, csum_start, csum_offset: 0.
        self.bytes.extend_from_slice(&[0; 8]);
        // At most QUEUE_SIZE chains, so it fits.
        self.bytes.extend_from_slice(&(buffers as u16).to_le_bytes());
        self.bytes.extend_from_slice(frame);

        let mut offset = 0usize;
        let mut segments = self.segments.iter();
        for &(head, _, count) in &self.chains {
            let chain_start = offset;
            for segment in segments.by_ref().take(count) {
                let n = (segment.len as usize).min(self.bytes.len() - offset);
                if n == 0 {
                    continue;
                }
                mem.write_slice(&self.bytes[offset..offset + n], segment.addr)
                    .map_err(|_| DeviceFault::BufferOutsideMemory {
                        queue: RX_QUEUE,
                        addr: segment.addr.0,
                        len: segment.len,
                    })?;
                offset += n;
            }
            // A chain holds at most the frame (< 4 GiB).
            queue
                .add_used(mem, head, (offset - chain_start) as u32)
                .map_err(|e| ring_fault(RX_QUEUE, e))?;
        }
        self.counters.rx_frames += 1;
        self.counters.rx_bytes += frame.len() as u64;
        let signal = should_signal(queue, RX_QUEUE, mem)?;
        Ok((
            RxOutcome::Delivered {
                buffers: buffers as u16,
            },
            signal,
        ))
    }

    fn drop_rx(&mut self, reason: DropReason) -> RxOutcome {
        self.counters.rx_dropped += 1;
        self.counters.last_drop = Some(reason);
        RxOutcome::Dropped(reason)
    }

    /// Sends every frame the driver has made available on the transmit queue.
    fn process_tx<M: GuestMemory>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
    ) -> Result<bool, DeviceFault> {
        loop {
            queue
                .disable_notification(mem)
                .map_err(|e| ring_fault(TX_QUEUE, e))?;
            while let Some(head) = next_head(queue, TX_QUEUE, mem)? {
                self.transmit_chain(queue, head, mem)?;
                queue
                    .add_used(mem, head, 0)
                    .map_err(|e| ring_fault(TX_QUEUE, e))?;
            }
            // Ask for the next notification; if frames arrived meanwhile, go on.
            if !queue
                .enable_notification(mem)
                .map_err(|e| ring_fault(TX_QUEUE, e))?
            {
                break;
            }
        }
        should_signal(queue, TX_QUEUE, mem)
    }

    fn transmit_chain<M: GuestMemory>(
        &mut self,
        queue: &Queue,
        head: u16,
        mem: &M,
    ) -> Result<(), DeviceFault> {
        self.segments.clear();
        let total = walk_chain(
            mem,
            TX_QUEUE,
            GuestAddress(queue.desc_table()),
            queue.size(),
            head,
            Direction::Readable,
            &mut self.segments,
        )?;
        if total > (VNET_HDR_LEN + self.config.max_frame_len()) as u64 {
            self.drop_tx(DropReason::Oversize);
            return Ok(());
        }
        if total < (VNET_HDR_LEN + ETH_HDR_LEN) as u64 {
            self.drop_tx(DropReason::Runt);
            return Ok(());
        }
        self.bytes.clear();
        self.bytes.resize(total as usize, 0);
        let mut offset = 0usize;
        for segment in &self.segments {
            let len = segment.len as usize;
            mem.read_slice(&mut self.bytes[offset..offset + len], segment.addr)
                .map_err(|_| DeviceFault::BufferOutsideMemory {
                    queue: TX_QUEUE,
                    addr: segment.addr.0,
                    len: segment.len,
                })?;
            offset += len;
        }
        let header = &self.bytes[..VNET_HDR_LEN];
        let frame_len = self.bytes.len() - VNET_HDR_LEN;
        if u32::from(header[1]) != VIRTIO_NET_HDR_GSO_NONE {
            self.drop_tx(DropReason::Gso);
            return Ok(());
        }
        let checksum = if u32::from(header[0]) & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 {
            let start = u16::from_le_bytes([header[6], header[7]]);
            let offset = u16::from_le_bytes([header[8], header[9]]);
            let end = usize::from(start) + usize::from(offset) + 2;
            if !self.has(VIRTIO_NET_F_CSUM) || end > frame_len {
                self.drop_tx(DropReason::Checksum);
                return Ok(());
            }
            TxChecksum::Partial { start, offset }
        } else {
            TxChecksum::Complete
        };
        self.sink
            .transmit(&self.bytes[VNET_HDR_LEN..], checksum);
        self.counters.tx_frames += 1;
        self.counters.tx_bytes += frame_len as u64;
        Ok(())
    }

    fn drop_tx(&mut self, reason: DropReason) {
        self.counters.tx_dropped += 1;
        self.counters.last_drop = Some(reason);
    }
}

impl<B: FrameSink> VirtioDevice for VirtioNet<B> {
    fn device_id(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn device_features(&self) -> u64 {
        OFFERED_FEATURES
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_MAX_SIZES
    }

    fn config_space(&self) -> &[u8] {
        &self.config_bytes
    }

    fn activate(&mut self, features: u64) {
        self.features = features;
    }

    fn reset(&mut self) {
        self.features = 0;
        self.segments.clear();
        self.chains.clear();
        self.bytes.clear();
    }

    fn queue_notify<M: GuestMemory>(
        &mut self,
        index: u16,
        queues: &mut [Queue],
        mem: &M,
    ) -> Result<bool, DeviceFault> {
        match (index, queues.get_mut(usize::from(TX_QUEUE))) {
            (TX_QUEUE, Some(tx)) => self.process_tx(tx, mem),
            _ => {
                // The driver added receive buffers: whoever holds a frame retries.
                self.counters.rx_kicks += 1;
                Ok(false)
            }
        }
    }
}

impl<B: FrameSink, T: Trigger> MmioTransport<VirtioNet<B>, T> {
    /// Offers `frame` to the guest ([`VirtioNet::receive`]), interrupting it if the device
    /// says so; [`RxOutcome::NotRunning`] if the device is not running or broke on this frame.
    pub fn receive_frame<M: GuestMemory>(&mut self, frame: &[u8], mem: &M) -> RxOutcome {
        self.run(mem, |net, queues, mem| net.receive(frame, queues, mem))
            .unwrap_or(RxOutcome::NotRunning)
    }

    /// The device's state by value.
    pub fn net_state(&self) -> NetDeviceState {
        NetDeviceState {
            config: self.device().config(),
            transport: self.state(),
        }
    }

    /// Returns the device to `state` (checked first; on error nothing changes). Its counters
    /// are zeroed, as the transport's.
    pub fn restore_net<M: GuestMemory>(
        &mut self,
        state: &NetDeviceState,
        mem: &M,
    ) -> Result<(), NetStateError> {
        let expected = self.device().config();
        if state.config != expected {
            return Err(NetStateError::Config {
                found: state.config,
                expected,
            });
        }
        self.restore(&state.transport, mem)?;
        self.device_mut().counters = NetCounters::default();
        Ok(())
    }
}

/// The head of the next available chain, if any.
fn next_head<M: GuestMemory>(
    queue: &mut Queue,
    index: u16,
    mem: &M,
) -> Result<Option<u16>, DeviceFault> {
    let mut chains = queue.iter(mem).map_err(|e| match e {
        virtio_queue::Error::InvalidAvailRingIndex => DeviceFault::AvailIndex { queue: index },
        e => ring_fault(index, e),
    })?;
    Ok(chains.next().map(|chain| chain.head_index()))
}

/// Whether the driver wants an interrupt for what was just used: EVENT_IDX's `used_event`
/// when negotiated, else the available ring's NO_INTERRUPT flag.
fn should_signal<M: GuestMemory>(
    queue: &mut Queue,
    index: u16,
    mem: &M,
) -> Result<bool, DeviceFault> {
    if queue.event_idx_enabled() {
        return queue
            .needs_notification(mem)
            .map_err(|e| ring_fault(index, e));
    }
    let flags: u16 = mem
        .load(GuestAddress(queue.avail_ring()), Ordering::Acquire)
        .map_err(|e| DeviceFault::Ring {
            queue: index,
            detail: e.to_string(),
        })?;
    Ok(u32::from(u16::from_le(flags)) & VRING_AVAIL_F_NO_INTERRUPT == 0)
}

fn ring_fault(queue: u16, e: virtio_queue::Error) -> DeviceFault {
    DeviceFault::Ring {
        queue,
        detail: e.to_string(),
    }
}
