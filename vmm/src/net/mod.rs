//! A VM's network card and the user-mode network stack behind it (issue 39, stage 1 of
//! `docs/network-design.md`): the virtio-net device of [`crate::devices::virtio`] in the
//! MMIO window of [`crate::layout::VIRTIO_NET_MMIO_BASE`], interrupting through an irqfd on
//! [`crate::layout::VIRTIO_NET_IRQ`], with smoltcp behind it as a socket-level proxy
//! ([`stack`]) that dials only what the VM's [`Egress`] allows and answers DNS itself
//! ([`dns`]).
//!
//! **Who owns what.** The [`Nic`] (card, queues, smoltcp, relays) belongs to the vCPU thread,
//! inside [`crate::devices::PortBus`]: the guest's MMIO exits reach it without a lock, and
//! every write to guest memory (receive buffers, used rings) happens between exits, where the
//! vCPU is not running. Notifications come by MMIO exit (a QueueNotify write), interrupts go
//! out through the irqfd. Host-side events (a host socket ready, a smoltcp timer, a lookup or
//! dial done) are seen by one thread of the process ([`waker`]) that only marks the card
//! pending and kicks the vCPU out of `KVM_RUN`; the run loop then serves the card. Lookups
//! and connections are decided, and dials started, on a pool of threads of the process
//! ([`dialer`]); one more thread waits for the dials to complete ([`connect`]). So a VM that
//! is not running does nothing on the network, a reset finds the card quiescent, and the
//! thread that makes a card (a jailed server's job thread) creates no thread and no socket.
//!
//! **Exactness.** The card's guest-visible state ([`NetDeviceState`]) is part of
//! [`crate::snapshot::MachineState`]; a clone starts from it, and a reset returns to it by
//! value with a brand-new stack (no connection, no DNS name, no learned neighbour, no queued
//! frame), which is what a fresh clone has. [`Nic::is_host_side_pristine`] lets a verify check
//! that.
//!
//! Addresses: the guest is [`GUEST_IP`]/24 (set by the kernel from `ip=` on its command line,
//! [`crate::boot`]'s `NIC_CMDLINE`), the gateway and DNS server [`GATEWAY_IP`] (smoltcp's own
//! address), every other destination is routed through the gateway and accepted by smoltcp.

mod connect;
mod dialer;
pub mod dns;
pub mod egress;
mod inbox;
#[cfg(test)]
mod link_tests;
pub mod names;
mod stack;
mod terminate;
mod waker;

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use crate::devices::IrqEvent;
use crate::devices::virtio::net::{
    FrameSink, NetConfig, NetDevice, NetDeviceState, NetStateError, RxOutcome, TxChecksum,
    VirtioNet,
};
use crate::memory::{GuestRam, MemoryError};
use crate::vcpu::Kicker;
pub use connect::in_flight as dials_in_flight;
pub use dialer::queued as dialer_queued;
pub use egress::{
    ConnectRequest, Egress, Headers, JobEgress, Limit, NoEgress, Refusal, Traffic, Verdict,
};
pub use stack::StackCounters;
pub use terminate::Interception;

/// The guest's address (eth0, static).
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);
/// The gateway's address: the stack's own, where DNS is answered.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
/// Prefix length of the guest's link.
pub const GUEST_PREFIX: u8 = 24;
/// The gateway's MAC address (locally administered).
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x42, 0x0a, 0x00, 0x02, 0x02];
/// Where bud answers DNS.
pub const DNS_PORT: u16 = 53;
/// Frames the guest may have sent that the stack has not taken yet; more are dropped (the
/// stack takes them all at every exit, so this bounds only a burst within one).
const MAX_TX_QUEUED: usize = 1024;

/// Errors of making or restoring a card.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("restoring the network card: {0}")]
    State(#[from] NetStateError),
    #[error("network card: {0}")]
    Memory(#[from] MemoryError),
}

/// Frames the card took from the transmit queue, for the stack.
#[derive(Debug, Default)]
pub(crate) struct TxFrames(VecDeque<Vec<u8>>);

impl FrameSink for TxFrames {
    fn transmit(&mut self, frame: &[u8], _checksum: TxChecksum) {
        // The stack terminates every connection: a checksum left to the card is never needed.
        if self.0.len() < MAX_TX_QUEUED {
            self.0.push_back(frame.to_vec());
        }
    }
}

/// A VM's network card with its stack.
#[derive(Debug)]
pub struct Nic {
    device: NetDevice<TxFrames, IrqEvent>,
    stack: stack::Stack,
    waker: Arc<waker::Waker>,
}

/// Starts the process's network threads (the wake-up thread, the dial pool and the connect
/// thread) if they have not started: [`crate::Executor::new`] calls it, before a jailed
/// server's job threads (which may not create threads) make any card.
pub(crate) fn start() {
    waker::start();
    dialer::start();
    connect::start();
}

impl Nic {
    /// A card raising its interrupt through `irq` (an irqfd), kicking the vCPU of `kicker`
    /// when the host side has work, in its reset state or in `state` (a clone).
    pub(crate) fn new(
        irq: EventFd,
        kicker: Kicker,
        state: Option<&NetDeviceState>,
        ram: &GuestRam,
    ) -> Result<Self, NetError> {
        let config = NetConfig::default();
        let waker = waker::Waker::new(kicker);
        let stack = stack::Stack::new(config.mtu, Arc::new(NoEgress), waker.clone());
        let mut device = NetDevice::new(VirtioNet::new(config, TxFrames::default()), IrqEvent(irq));
        if let Some(state) = state {
            ram.with_guest_memory(|mem| device.restore_net(state, mem))??;
        }
        Ok(Self {
            device,
            stack,
            waker,
        })
    }

    /// The eventfd of the card's interrupt (registered with KVM as an irqfd).
    pub(crate) fn irq(&self) -> &EventFd {
        &self.device_irq().0
    }

    fn device_irq(&self) -> &IrqEvent {
        self.device.irq()
    }

    /// Decides names and connections from now on (the default refuses everything).
    pub fn set_egress(&mut self, egress: Arc<dyn Egress>) {
        self.stack.set_egress(egress);
    }

    /// What the stack did since the card was made or reset.
    pub fn counters(&self) -> StackCounters {
        self.stack.counters()
    }

    /// A guest read at `offset` in the card's window.
    pub(crate) fn mmio_read(&mut self, offset: u64, data: &mut [u8]) {
        self.device.read(offset, data);
    }

    /// A guest write at `offset` in the card's window; a queue notification runs the stack.
    pub(crate) fn mmio_write(&mut self, offset: u64, data: &[u8], ram: &GuestRam) {
        let device = &mut self.device;
        let _ = ram.with_guest_memory(|mem| device.write(offset, data, mem));
        if offset == u64::from(virtio_bindings::virtio_mmio::VIRTIO_MMIO_QUEUE_NOTIFY) {
            self.pump(ram);
        }
    }

    /// Whether the helper thread saw host-side work for the stack.
    pub(crate) fn is_pending(&self) -> bool {
        self.waker.is_pending()
    }

    /// Runs the stack if the helper thread asked for it.
    pub(crate) fn serve(&mut self, ram: &GuestRam) {
        if self.waker.take_pending() {
            self.pump(ram);
        }
    }

    /// Moves the guest's frames into the stack, runs it, and delivers its frames to the
    /// guest while it has receive buffers (the rest wait for its next receive notification).
    fn pump(&mut self, ram: &GuestRam) {
        let sent = &mut self.device.device_mut().sink_mut().0;
        self.stack.link.to_stack.extend(sent.drain(..));
        let timer = self.stack.poll();
        let device = &mut self.device;
        let to_guest = &mut self.stack.link.to_guest;
        let _ = ram.with_guest_memory(|mem| {
            while let Some(frame) = to_guest.front() {
                match device.receive_frame(frame, mem) {
                    RxOutcome::NoBuffers => break,
                    // Delivered, dropped as never fitting, or a card the guest does not run
                    // (booting, broken): nothing more to do with this frame.
                    _ => {
                        to_guest.pop_front();
                    }
                }
            }
        });
        self.waker.set_timer(timer);
    }

    /// The card's guest-visible state.
    pub fn state(&self) -> NetDeviceState {
        self.device.net_state()
    }

    /// Returns the card to `state` by value with a brand-new stack (a reset): every host
    /// connection is closed, every DNS name forgotten, every queued frame dropped; the
    /// egress stays.
    pub(crate) fn restore(
        &mut self,
        state: &NetDeviceState,
        ram: &GuestRam,
    ) -> Result<(), NetError> {
        let device = &mut self.device;
        ram.with_guest_memory(|mem| device.restore_net(state, mem))??;
        self.device.device_mut().sink_mut().0.clear();
        let egress = self.stack.egress();
        let waker = self.waker.clone();
        // The old stack closes its inbox as it goes: work of the dialer for it wakes nothing
        // from now on, and the mark it may have left is cleared here.
        self.stack = stack::Stack::new(self.device.device().config().mtu, egress, waker);
        self.waker.clear();
        Ok(())
    }

    /// Whether the host side holds nothing a fresh card's would not (no connection, no DNS
    /// name, no queued frame, no pending work).
    pub(crate) fn is_host_side_pristine(&self) -> bool {
        self.stack.is_pristine()
            && self.device.device().sink().0.is_empty()
            && !self.waker.is_pending()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::console::ConsoleLog;
    use crate::devices::{PortBus, PortEvent};
    use crate::layout::{VIRTIO_NET_MMIO_BASE, VIRTIO_NET_MMIO_SIZE};
    use virtio_bindings::virtio_mmio::{VIRTIO_MMIO_DEVICE_ID, VIRTIO_MMIO_STATUS};

    fn bus_with_card(ram: &GuestRam) -> PortBus {
        let mut bus = PortBus::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            ConsoleLog::new(8),
        );
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        bus.set_nic(Nic::new(irq, Kicker::new(), None, ram).unwrap());
        bus
    }

    fn read32(bus: &mut PortBus, addr: u64) -> u32 {
        let mut b = [0u8; 4];
        assert_eq!(bus.mmio_read(addr, &mut b), PortEvent::Handled);
        u32::from_le_bytes(b)
    }

    #[test]
    fn the_cards_window_answers_as_virtio_mmio_and_the_rest_reads_all_ones() {
        let ram = GuestRam::anonymous(4 << 20).unwrap();
        let mut bus = bus_with_card(&ram);
        let status = VIRTIO_NET_MMIO_BASE + u64::from(VIRTIO_MMIO_STATUS);

        let magic = read32(&mut bus, VIRTIO_NET_MMIO_BASE);
        let id = read32(
            &mut bus,
            VIRTIO_NET_MMIO_BASE + u64::from(VIRTIO_MMIO_DEVICE_ID),
        );
        let past = read32(&mut bus, VIRTIO_NET_MMIO_BASE + VIRTIO_NET_MMIO_SIZE);
        let straddling = read32(&mut bus, VIRTIO_NET_MMIO_BASE + VIRTIO_NET_MMIO_SIZE - 2);
        bus.mmio_write(status, &1u32.to_le_bytes(), &ram);
        let acknowledged = read32(&mut bus, status);

        assert_eq!(magic, crate::devices::virtio::mmio::MAGIC_VALUE);
        assert_eq!(id, 1, "a network card");
        assert_eq!(past, u32::MAX);
        assert_eq!(straddling, u32::MAX);
        assert_eq!(acknowledged, 1);
    }

    #[test]
    fn a_reset_card_is_back_to_its_state_by_value_with_an_empty_host_side() {
        let ram = GuestRam::anonymous(4 << 20).unwrap();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut nic = Nic::new(irq, Kicker::new(), None, &ram).unwrap();
        let saved = nic.state();
        let status = u64::from(VIRTIO_MMIO_STATUS);
        nic.mmio_write(status, &3u32.to_le_bytes(), &ram);
        nic.stack.link.to_guest.push_back(vec![0; 60]);
        let mutated = nic.state();

        nic.restore(&saved, &ram).unwrap();

        assert_ne!(mutated, saved);
        assert_eq!(nic.state(), saved);
        assert!(nic.is_host_side_pristine());
    }
}
