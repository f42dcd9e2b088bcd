//! A virtio-net device: one receive queue (0) and one transmit queue (1), moving Ethernet
//! frames between the guest and a host-side [`FrameSink`] (where the user-mode network stack
//! will plug in; `docs/network-design.md` section 2).
//!
//! Features offered (the design's section 1.2): `VERSION_1`, `RING_EVENT_IDX`, `MAC` (a fixed
//! address: every clone is alone on its link), `MTU` (65500 by default: one 64 KiB frame
//! instead of 45 at 1500, each of which costs guest-kernel work that is emulated on kvm_pvm),
//! `CSUM` (the guest may leave checksums to the host, which terminates TCP and never needs
//! them), `GUEST_CSUM` (received frames carry `DATA_VALID`, so the guest skips checksumming
//! them) and `MRG_RXBUF` (a large frame spans several receive buffers, of up to 16 KiB each
//! with the guest kernel's patch 0018; Linux's own are at most a page). Not offered: indirect descriptors (Linux would `kmalloc` a table per
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
/// The MTU announced by default: a frame with its virtio header (65 500 + 14 + 12 = 65 526
/// bytes) fills four of the guest kernel's 16 KiB mergeable receive buffers (its patch 0018)
/// where passt's 65 520 would spill 10 bytes into a fifth.
pub const DEFAULT_MTU: u16 = 65500;
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
    /// The largest Ethernet frame either way: MTU + Ethernet header + one VLAN tag (65518 at
    /// the default MTU; with the virtio header, a 65530-byte chain).
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
        self.bytes
            .extend_from_slice(&[flags, VIRTIO_NET_HDR_GSO_NONE as u8]);
        // hdr_len, gso_size, csum_start, csum_offset: 0.
        self.bytes.extend_from_slice(&[0; 8]);
        // At most QUEUE_SIZE chains, so it fits.
        self.bytes
            .extend_from_slice(&(buffers as u16).to_le_bytes());
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
        self.sink.transmit(&self.bytes[VNET_HDR_LEN..], checksum);
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

#[cfg(test)]
mod tests {
    use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_NEEDS_RESET as NEEDS_RESET;
    use virtio_bindings::virtio_mmio::{
        VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING, VIRTIO_MMIO_INTERRUPT_ACK,
        VIRTIO_MMIO_QUEUE_NOTIFY, VIRTIO_MMIO_STATUS,
    };
    use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor;
    use vm_memory::GuestMemoryMmap;

    use super::super::mmio::TransportCounters;
    use super::super::testing::{
        BUFFERS, CountingIrq, DriverQueue, RAM_SIZE, memory, start, write_reg,
    };
    use super::*;

    /// Frames the guest sent, in order.
    #[derive(Debug, Default)]
    struct Frames(Vec<(Vec<u8>, TxChecksum)>);

    impl FrameSink for Frames {
        fn transmit(&mut self, frame: &[u8], checksum: TxChecksum) {
            self.0.push((frame.to_vec(), checksum));
        }
    }

    type Net = NetDevice<Frames, CountingIrq>;

    fn device() -> (Net, CountingIrq) {
        let irq = CountingIrq::default();
        let dev = MmioTransport::new(
            VirtioNet::new(NetConfig::default(), Frames::default()),
            irq.clone(),
        );
        (dev, irq)
    }

    /// A device the driver started with `features` and two queues of `size`.
    fn running(features: u64, size: u16) -> (Net, CountingIrq, GuestMemoryMmap, Vec<DriverQueue>) {
        let mem = memory();
        let (mut dev, irq) = device();
        let queues = start(&mut dev, &mem, features, size);
        assert!(dev.is_running());
        (dev, irq, mem, queues)
    }

    fn frame(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + 3) as u8).collect()
    }

    fn header(flags: u8, gso: u8, csum_start: u16, csum_offset: u16) -> [u8; VNET_HDR_LEN] {
        let mut h = [0u8; VNET_HDR_LEN];
        h[0] = flags;
        h[1] = gso;
        h[6..8].copy_from_slice(&csum_start.to_le_bytes());
        h[8..10].copy_from_slice(&csum_offset.to_le_bytes());
        h
    }

    /// Writes a header and a frame into RAM and queues them as one tx chain of two buffers.
    fn send(mem: &GuestMemoryMmap, tx: &mut DriverQueue, hdr: [u8; VNET_HDR_LEN], f: &[u8]) -> u16 {
        mem.write_slice(&hdr, GuestAddress(BUFFERS)).unwrap();
        mem.write_slice(f, GuestAddress(BUFFERS + 0x100)).unwrap();
        tx.add(
            mem,
            &[
                (BUFFERS, 12, false),
                (BUFFERS + 0x100, f.len() as u32, false),
            ],
        )
    }

    fn notify(dev: &mut Net, mem: &GuestMemoryMmap, queue: u16) {
        write_reg(dev, mem, VIRTIO_MMIO_QUEUE_NOTIFY, queue.into());
    }

    fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    #[test]
    fn a_transmitted_frame_reaches_the_sink_without_its_header_and_the_buffer_comes_back() {
        let (mut dev, irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        let f = frame(60);
        let head = send(&mem, &mut q[1], header(0, 0, 0, 0), &f);

        notify(&mut dev, &mem, TX_QUEUE);

        assert_eq!(dev.device().sink().0, vec![(f, TxChecksum::Complete)]);
        assert_eq!(q[1].used_idx(&mem), 1);
        assert_eq!(q[1].used(&mem, 0), (u32::from(head), 0));
        // EVENT_IDX: used_event is 0, so the first used buffer interrupts; the device asks
        // to be notified of the next available entry.
        assert_eq!(irq.0.get(), 1);
        assert_eq!(dev.interrupt_status(), VIRTIO_MMIO_INT_VRING);
        assert_eq!(q[1].avail_event(&mem), 1);
        let c = dev.device().counters();
        assert_eq!((c.tx_frames, c.tx_bytes, c.tx_dropped), (1, 60, 0));
        write_reg(
            &mut dev,
            &mem,
            VIRTIO_MMIO_INTERRUPT_ACK,
            VIRTIO_MMIO_INT_VRING,
        );
        assert_eq!(dev.interrupt_status(), 0);
    }

    #[test]
    fn a_partial_checksum_is_passed_on_and_bad_offsets_or_gso_are_dropped() {
        let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        let f = frame(60);
        let needs = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;

        let partial = send(&mem, &mut q[1], header(needs, 0, 34, 16), &f);
        notify(&mut dev, &mem, TX_QUEUE);
        let outside = send(&mem, &mut q[1], header(needs, 0, 50, 9), &f);
        notify(&mut dev, &mem, TX_QUEUE);
        let gso = send(&mem, &mut q[1], header(0, 1, 0, 0), &f);
        notify(&mut dev, &mem, TX_QUEUE);

        assert_eq!(
            dev.device().sink().0,
            vec![(
                f,
                TxChecksum::Partial {
                    start: 34,
                    offset: 16
                }
            )]
        );
        assert_eq!(q[1].used_idx(&mem), 3);
        assert_eq!(q[1].used(&mem, 0), (u32::from(partial), 0));
        assert_eq!(q[1].used(&mem, 1), (u32::from(outside), 0));
        assert_eq!(q[1].used(&mem, 2), (u32::from(gso), 0));
        let c = dev.device().counters();
        assert_eq!((c.tx_frames, c.tx_dropped), (1, 2));
        assert_eq!(c.last_drop, Some(DropReason::Gso));
        assert!(dev.is_running());
    }

    #[test]
    fn a_header_and_frame_in_one_buffer_as_linux_sends_them_is_split_at_12_bytes() {
        let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        let f = frame(1514);
        let mut packet = header(0, 0, 0, 0).to_vec();
        packet.extend_from_slice(&f);
        mem.write_slice(&packet, GuestAddress(BUFFERS)).unwrap();
        q[1].add(&mem, &[(BUFFERS, packet.len() as u32, false)]);

        notify(&mut dev, &mem, TX_QUEUE);

        assert_eq!(dev.device().sink().0, vec![(f, TxChecksum::Complete)]);
    }

    #[test]
    fn a_needs_csum_frame_is_dropped_when_csum_was_not_negotiated() {
        let features = OFFERED_FEATURES & !(1 << VIRTIO_NET_F_CSUM);
        let (mut dev, _irq, mem, mut q) = running(features, 16);
        let needs = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;

        send(&mem, &mut q[1], header(needs, 0, 14, 6), &frame(60));
        notify(&mut dev, &mem, TX_QUEUE);

        assert_eq!(dev.device().sink().0, vec![]);
        assert_eq!(
            dev.device().counters().last_drop,
            Some(DropReason::Checksum)
        );
    }

    #[test]
    fn a_received_frame_larger_than_one_buffer_is_merged_across_buffers() {
        let (mut dev, irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        // Three receive chains of 2048 bytes; the first made of two buffers.
        let h0 = q[0].add(
            &mem,
            &[(BUFFERS, 1000, true), (BUFFERS + 0x800, 1048, true)],
        );
        let h1 = q[0].add(&mem, &[(BUFFERS + 0x1000, 2048, true)]);
        let h2 = q[0].add(&mem, &[(BUFFERS + 0x2000, 2048, true)]);
        let f = frame(5000);

        let outcome = dev.receive_frame(&f, &mem);

        assert_eq!(outcome, RxOutcome::Delivered { buffers: 3 });
        assert_eq!(q[0].used_idx(&mem), 3);
        assert_eq!(q[0].used(&mem, 0), (u32::from(h0), 2048));
        assert_eq!(q[0].used(&mem, 1), (u32::from(h1), 2048));
        assert_eq!(q[0].used(&mem, 2), (u32::from(h2), 5012 - 4096));
        // flags DATA_VALID (GUEST_CSUM), GSO none, num_buffers 3.
        assert_eq!(
            read(&mem, BUFFERS, 12),
            vec![2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0]
        );
        let mut got = read(&mem, BUFFERS + 12, 1000 - 12);
        got.extend(read(&mem, BUFFERS + 0x800, 1048));
        got.extend(read(&mem, BUFFERS + 0x1000, 2048));
        got.extend(read(&mem, BUFFERS + 0x2000, 5012 - 4096));
        assert_eq!(got, f);
        assert_eq!(irq.0.get(), 1);
        let c = dev.device().counters();
        assert_eq!((c.rx_frames, c.rx_bytes, c.rx_dropped), (1, 5000, 0));
    }

    #[test]
    fn without_mrg_rxbuf_a_frame_takes_one_buffer_with_num_buffers_1_or_is_dropped() {
        let features = OFFERED_FEATURES & !(1 << VIRTIO_NET_F_MRG_RXBUF);
        let (mut dev, _irq, mem, mut q) = running(features, 16);
        q[0].add(&mem, &[(BUFFERS, 2048, true)]);
        q[0].add(&mem, &[(BUFFERS + 0x1000, 2048, true)]);

        let fits = dev.receive_frame(&frame(100), &mem);
        let too_big = dev.receive_frame(&frame(3000), &mem);

        assert_eq!(fits, RxOutcome::Delivered { buffers: 1 });
        assert_eq!(
            read(&mem, BUFFERS, 12),
            vec![2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]
        );
        assert_eq!(too_big, RxOutcome::Dropped(DropReason::NeverFits));
        assert_eq!(q[0].used_idx(&mem), 1);
        assert_eq!(dev.queues()[0].next_avail(), 1);
    }

    #[test]
    fn without_enough_buffers_the_frame_is_kept_and_a_notification_asked_for() {
        let (mut dev, irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        let h0 = q[0].add(&mem, &[(BUFFERS, 100, true)]);
        let f = frame(200);

        let short = dev.receive_frame(&f, &mem);
        let avail_event = q[0].avail_event(&mem);
        let next_avail = dev.queues()[0].next_avail();
        let h1 = q[0].add(&mem, &[(BUFFERS + 0x1000, 200, true)]);
        notify(&mut dev, &mem, RX_QUEUE);
        let retried = dev.receive_frame(&f, &mem);

        assert_eq!(short, RxOutcome::NoBuffers);
        // Notify me when the driver's available index passes 1 (the one entry seen).
        assert_eq!(avail_event, 1);
        assert_eq!(next_avail, 0);
        assert_eq!(retried, RxOutcome::Delivered { buffers: 2 });
        assert_eq!(q[0].used(&mem, 0), (u32::from(h0), 100));
        assert_eq!(q[0].used(&mem, 1), (u32::from(h1), 112));
        assert_eq!(irq.0.get(), 1);
        let c = dev.device().counters();
        assert_eq!((c.rx_no_buffers, c.rx_kicks, c.rx_frames), (1, 1, 1));
    }

    #[test]
    fn a_frame_the_whole_ring_cannot_hold_is_dropped() {
        let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 2);
        q[0].add(&mem, &[(BUFFERS, 100, true)]);
        q[0].add(&mem, &[(BUFFERS + 0x1000, 100, true)]);

        let outcome = dev.receive_frame(&frame(1000), &mem);

        assert_eq!(outcome, RxOutcome::Dropped(DropReason::NeverFits));
        assert_eq!(q[0].used_idx(&mem), 0);
        assert_eq!(dev.queues()[0].next_avail(), 0);
    }

    #[test]
    fn event_idx_interrupts_only_when_used_passes_used_event() {
        let (mut dev, irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        for i in 0..3 {
            q[0].add(&mem, &[(BUFFERS + 0x1000 * i, 2048, true)]);
        }
        q[0].set_used_event(&mem, 1);

        dev.receive_frame(&frame(100), &mem);
        let after_first = irq.0.get();
        dev.receive_frame(&frame(100), &mem);
        let after_second = irq.0.get();
        dev.receive_frame(&frame(100), &mem);
        let after_third = irq.0.get();

        assert_eq!((after_first, after_second, after_third), (0, 1, 1));
        assert_eq!(q[0].used_idx(&mem), 3);
    }

    #[test]
    fn without_event_idx_the_no_interrupt_flag_is_honoured() {
        let features = OFFERED_FEATURES & !(1 << VIRTIO_RING_F_EVENT_IDX);
        let (mut dev, irq, mem, mut q) = running(features, 16);
        q[0].add(&mem, &[(BUFFERS, 2048, true)]);
        q[0].add(&mem, &[(BUFFERS + 0x1000, 2048, true)]);

        q[0].set_avail_flags(&mem, VRING_AVAIL_F_NO_INTERRUPT as u16);
        dev.receive_frame(&frame(100), &mem);
        let suppressed = irq.0.get();
        q[0].set_avail_flags(&mem, 0);
        dev.receive_frame(&frame(100), &mem);

        assert_eq!((suppressed, irq.0.get()), (0, 1));
    }

    #[test]
    fn oversize_and_runt_frames_are_dropped_and_counted_both_ways() {
        let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        let max = NetConfig::default().max_frame_len();
        q[0].add(&mem, &[(BUFFERS, 2048, true)]);

        let rx_big = dev.receive_frame(&frame(max + 1), &mem);
        let rx_runt = dev.receive_frame(&frame(13), &mem);
        let big = send(&mem, &mut q[1], header(0, 0, 0, 0), &frame(max + 1));
        notify(&mut dev, &mem, TX_QUEUE);
        send(&mem, &mut q[1], header(0, 0, 0, 0), &frame(max));
        notify(&mut dev, &mem, TX_QUEUE);
        send(&mem, &mut q[1], header(0, 0, 0, 0), &frame(13));
        notify(&mut dev, &mem, TX_QUEUE);

        assert_eq!(max, 65518);
        assert_eq!(rx_big, RxOutcome::Dropped(DropReason::Oversize));
        assert_eq!(rx_runt, RxOutcome::Dropped(DropReason::Runt));
        assert_eq!(q[0].used_idx(&mem), 0);
        assert_eq!(q[1].used_idx(&mem), 3);
        assert_eq!(q[1].used(&mem, 0), (u32::from(big), 0));
        let sent: Vec<usize> = dev.device().sink().0.iter().map(|(f, _)| f.len()).collect();
        assert_eq!(sent, vec![max]);
        let c = dev.device().counters();
        assert_eq!((c.rx_dropped, c.tx_dropped, c.tx_frames), (2, 2, 1));
        assert_eq!(c.last_drop, Some(DropReason::Runt));
        assert!(dev.is_running());
    }

    /// Runs a hostile tx chain whose head is already published, and returns the fault.
    fn tx_fault(dev: &mut Net, mem: &GuestMemoryMmap) -> Option<DeviceFault> {
        notify(dev, mem, TX_QUEUE);
        dev.last_fault().cloned()
    }

    #[test]
    fn a_descriptor_loop_breaks_the_device_with_a_config_interrupt_and_a_reset_mends_it() {
        let (mut dev, irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        let next = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
        q[1].write_desc(&mem, 0, Descriptor::new(BUFFERS, 12, next, 1));
        q[1].write_desc(&mem, 1, Descriptor::new(BUFFERS, 60, next, 0));
        q[1].publish(&mem, 0);

        let fault = tx_fault(&mut dev, &mem);
        notify(&mut dev, &mem, TX_QUEUE);

        assert_eq!(fault, Some(DeviceFault::ChainLoop { queue: 1, head: 0 }));
        assert_eq!(dev.status() & NEEDS_RESET, NEEDS_RESET);
        assert_eq!(dev.interrupt_status(), VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(irq.0.get(), 1);
        assert_eq!(q[1].used_idx(&mem), 0);
        assert_eq!(dev.device().sink().0, vec![]);
        assert_eq!(
            dev.counters(),
            TransportCounters {
                bad_accesses: 1,
                faults: 1,
                irq_errors: 0
            }
        );
        // The driver resets and starts again: the device serves.
        write_reg(&mut dev, &mem, VIRTIO_MMIO_STATUS, 0);
        let mut q = start(&mut dev, &mem, OFFERED_FEATURES, 16);
        send(&mem, &mut q[1], header(0, 0, 0, 0), &frame(60));
        notify(&mut dev, &mem, TX_QUEUE);
        assert_eq!(dev.device().sink().0.len(), 1);
    }

    #[test]
    fn buffers_outside_ram_indirect_descriptors_wrong_directions_and_bad_indices_are_faults() {
        let write = VRING_DESC_F_WRITE as u16;
        let cases: Vec<(Descriptor, u16, DeviceFault)> = vec![
            (
                Descriptor::new(RAM_SIZE - 8, 64, 0, 0),
                TX_QUEUE,
                DeviceFault::BufferOutsideMemory {
                    queue: 1,
                    addr: RAM_SIZE - 8,
                    len: 64,
                },
            ),
            (
                Descriptor::new(u64::MAX - 4, 64, 0, 0),
                TX_QUEUE,
                DeviceFault::BufferOutsideMemory {
                    queue: 1,
                    addr: u64::MAX - 4,
                    len: 64,
                },
            ),
            (
                Descriptor::new(BUFFERS, 16, VRING_DESC_F_INDIRECT as u16, 0),
                TX_QUEUE,
                DeviceFault::Indirect { queue: 1 },
            ),
            (
                Descriptor::new(BUFFERS, 64, write, 0),
                TX_QUEUE,
                DeviceFault::Direction {
                    queue: 1,
                    found: "device-writable",
                },
            ),
            (
                Descriptor::new(BUFFERS, 64, 0, 0),
                RX_QUEUE,
                DeviceFault::Direction {
                    queue: 0,
                    found: "device-readable",
                },
            ),
            (
                Descriptor::new(BUFFERS, 64, write | 1, 40),
                RX_QUEUE,
                DeviceFault::DescriptorIndex {
                    queue: 0,
                    index: 40,
                },
            ),
        ];
        for (desc, queue, expected) in cases {
            let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 16);
            q[usize::from(queue)].write_desc(&mem, 0, desc);
            q[usize::from(queue)].publish(&mem, 0);

            let outcome = if queue == TX_QUEUE {
                notify(&mut dev, &mem, TX_QUEUE);
                None
            } else {
                Some(dev.receive_frame(&frame(60), &mem))
            };

            assert_eq!(dev.last_fault(), Some(&expected));
            assert_eq!(dev.status() & NEEDS_RESET, NEEDS_RESET);
            assert_eq!(q[usize::from(queue)].used_idx(&mem), 0);
            if queue == RX_QUEUE {
                assert_eq!(outcome, Some(RxOutcome::NotRunning));
            }
        }
    }

    #[test]
    fn a_head_outside_the_table_or_an_available_index_past_the_ring_is_a_fault() {
        let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        q[1].publish(&mem, 40);
        let bad_head = tx_fault(&mut dev, &mem);

        let (mut dev, _irq, mem, q) = running(OFFERED_FEATURES, 16);
        q[1].set_avail_idx(&mem, 17);
        let jump = tx_fault(&mut dev, &mem);

        assert_eq!(
            bad_head,
            Some(DeviceFault::DescriptorIndex {
                queue: 1,
                index: 40
            })
        );
        assert_eq!(jump, Some(DeviceFault::AvailIndex { queue: 1 }));
    }

    #[test]
    fn nothing_is_received_before_driver_ok_or_after_a_reset() {
        let (mut fresh, _irq) = device();
        let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        q[0].add(&mem, &[(BUFFERS, 2048, true)]);
        let initial = fresh.net_state();

        let before = fresh.receive_frame(&frame(60), &mem);
        write_reg(&mut dev, &mem, VIRTIO_MMIO_STATUS, 0);
        let after = dev.receive_frame(&frame(60), &mem);

        assert_eq!(before, RxOutcome::NotRunning);
        assert_eq!(after, RxOutcome::NotRunning);
        assert_eq!(dev.net_state(), initial);
    }

    #[test]
    fn state_round_trips_by_value_through_bincode_and_a_restored_device_carries_on() {
        let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 16);
        send(&mem, &mut q[1], header(0, 0, 0, 0), &frame(60));
        notify(&mut dev, &mem, TX_QUEUE);
        q[0].add(&mem, &[(BUFFERS + 0x1000, 2048, true)]);
        q[0].add(&mem, &[(BUFFERS + 0x2000, 2048, true)]);
        dev.receive_frame(&frame(100), &mem);
        let state = dev.net_state();

        let bytes = bincode::serialize(&state).unwrap();
        let decoded: NetDeviceState = bincode::deserialize(&bytes).unwrap();
        let (mut restored, _irq) = device();
        restored.restore_net(&decoded, &mem).unwrap();
        let outcome = restored.receive_frame(&frame(100), &mem);

        assert_eq!(decoded, state);
        assert_eq!(state.transport.status, 15);
        assert_eq!(state.transport.driver_features, OFFERED_FEATURES);
        let rx = state.transport.queues[0].0;
        let tx = state.transport.queues[1].0;
        assert_eq!(
            (rx.next_avail, rx.next_used, rx.size, rx.ready),
            (1, 1, 16, true)
        );
        assert_eq!(
            (tx.next_avail, tx.next_used, tx.event_idx_enabled),
            (1, 1, true)
        );
        assert_eq!(outcome, RxOutcome::Delivered { buffers: 1 });
        assert_eq!(q[0].used_idx(&mem), 2);
        assert_eq!(
            read(&mem, BUFFERS + 0x2000, 12),
            vec![2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]
        );
        let mut again = restored.net_state();
        again.transport.queues[0].0.next_avail = 1;
        again.transport.queues[0].0.next_used = 1;
        assert_eq!(again, state);
    }

    #[test]
    fn a_state_that_does_not_fit_the_device_or_ram_is_refused_and_changes_nothing() {
        let (dev, _irq, mem, _q) = running(OFFERED_FEATURES, 16);
        let good = dev.net_state();
        let (mut target, _irq) = device();
        let before = target.net_state();

        let mut other_mac = good.clone();
        other_mac.config.mac[5] = 0x10;
        let mut outside = good.clone();
        outside.transport.queues[1].0.desc_table = 0x20_0000;
        let mut bigger = good.clone();
        bigger.transport.queues[0].0.max_size = 512;
        let mut features = good.clone();
        features.transport.driver_features |= 1 << 17;
        let mut status = good.clone();
        status.transport.status |= 0x10;
        let mut short = good.clone();
        short.transport.queues.pop();

        let results = [
            target.restore_net(&other_mac, &mem),
            target.restore_net(&outside, &mem),
            target.restore_net(&bigger, &mem),
            target.restore_net(&features, &mem),
            target.restore_net(&status, &mem),
            target.restore_net(&short, &mem),
        ];

        assert_eq!(
            results,
            [
                Err(NetStateError::Config {
                    found: other_mac.config,
                    expected: NetConfig::default()
                }),
                Err(NetStateError::Transport(StateError::RingOutsideMemory {
                    queue: 1
                })),
                Err(NetStateError::Transport(StateError::QueueMaxSize {
                    queue: 0,
                    found: 512,
                    expected: 256
                })),
                Err(NetStateError::Transport(StateError::Features {
                    found: OFFERED_FEATURES | (1 << 17),
                    offered: OFFERED_FEATURES
                })),
                Err(NetStateError::Transport(StateError::Status(0x1f))),
                Err(NetStateError::Transport(StateError::QueueCount {
                    found: 1,
                    expected: 2
                })),
            ]
        );
        assert_eq!(target.net_state(), before);
    }

    /// A small deterministic PRNG (xorshift64) for the randomized test.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Zeroes both queues' rings and starts the device again, as a driver does after a reset.
    fn restart(dev: &mut Net, mem: &GuestMemoryMmap) -> Vec<DriverQueue> {
        write_reg(dev, mem, VIRTIO_MMIO_STATUS, 0);
        mem.write_slice(&[0u8; 0x3_0000], GuestAddress(0x1_0000))
            .unwrap();
        start(dev, mem, OFFERED_FEATURES, 16)
    }

    #[test]
    fn a_random_hostile_driver_never_panics_the_device_and_a_reset_mends_it() {
        let mut totals = (0u64, 0u64, 0u64);
        for seed in 1..=16u64 {
            let (mut dev, _irq, mem, mut q) = running(OFFERED_FEATURES, 16);
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            for _ in 0..400 {
                let queue = rng.below(2) as usize;
                match rng.below(20) {
                    // Register accesses of any width at any offset.
                    0 => {
                        let len = [1, 2, 4, 8][rng.below(4) as usize];
                        let value = rng.below(u64::MAX).to_le_bytes();
                        dev.write(rng.below(0x120), &value[..len], &mem);
                    }
                    1 => {
                        let mut data = [0u8; 8];
                        let len = [0, 1, 2, 4, 8][rng.below(5) as usize];
                        dev.read(rng.below(0x1000), &mut data[..len]);
                    }
                    // A scribbled descriptor: any address, length, flags, next.
                    2 => {
                        let addr = [
                            BUFFERS + rng.below(0x1000),
                            RAM_SIZE - rng.below(64),
                            rng.below(u64::MAX),
                        ][rng.below(3) as usize];
                        let desc = Descriptor::new(
                            addr,
                            rng.below(0x2_0000) as u32,
                            rng.below(8) as u16,
                            rng.below(20) as u16,
                        );
                        q[queue].write_desc(&mem, rng.below(16) as u16, desc);
                    }
                    3 => q[queue].publish(&mem, rng.below(20) as u16),
                    4 => q[queue].set_avail_idx(&mem, rng.below(40) as u16),
                    // Well-formed chains of one to three buffers, most of the time.
                    5..=10 => {
                        let buffers: Vec<_> = (0..1 + rng.below(3))
                            .map(|_| {
                                let addr = BUFFERS + rng.below(0x4_0000);
                                (addr, rng.below(0x2000) as u32, queue == 0)
                            })
                            .collect();
                        q[queue].add(&mem, &buffers);
                    }
                    11..=13 => notify(&mut dev, &mem, rng.below(3) as u16),
                    14..=17 => {
                        dev.receive_frame(&frame(rng.below(9000) as usize), &mem);
                    }
                    18 => {
                        dev.receive_frame(&frame(rng.below(70_000) as usize), &mem);
                    }
                    _ if !dev.is_running() => q = restart(&mut dev, &mem),
                    _ => {}
                }
                // Every state the driver can reach survives bincode and a restore, exactly.
                let state = dev.net_state();
                let bytes = bincode::serialize(&state).unwrap();
                assert_eq!(
                    bincode::deserialize::<NetDeviceState>(&bytes).unwrap(),
                    state
                );
                let (mut twin, _irq) = device();
                twin.restore_net(&state, &mem).unwrap();
                assert_eq!(twin.net_state(), state);
            }
            let c = dev.device().counters();
            totals.0 += dev.counters().faults;
            totals.1 += c.tx_frames;
            totals.2 += c.rx_frames;

            let mut q = restart(&mut dev, &mem);
            send(&mem, &mut q[1], header(0, 0, 0, 0), &frame(60));
            notify(&mut dev, &mem, TX_QUEUE);
            assert_eq!(q[1].used_idx(&mem), 1, "seed {seed}");
            assert_eq!(dev.device().sink().0.last().map(|(f, _)| f.len()), Some(60));
        }
        // The random driver reached the fault paths and moved frames both ways.
        eprintln!("faults, tx frames, rx frames: {totals:?}");
        assert!(totals.0 > 0 && totals.1 > 0 && totals.2 > 0, "{totals:?}");
    }
}
