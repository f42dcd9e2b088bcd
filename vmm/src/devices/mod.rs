//! The devices a bud guest can reach, as plain state machines that know nothing of KVM: a 16550
//! serial console (vm-superio), the i8042 reset line, the doorbell port, and the four ports
//! of bud's guest kernel patches ([`host_zero`], [`exit_report`], [`host_copy`],
//! [`host_random`]). [`virtio`] holds virtio devices over MMIO (virtio-net); a VM with a
//! network card has one in its MMIO window ([`crate::net::Nic`]), reached through
//! [`PortBus::mmio_read`]/[`PortBus::mmio_write`].
//!
//! [`PortBus`] routes a port access to its device and says what the access means for the run
//! loop ([`PortEvent`]). Every port is reachable by untrusted guest code (jobs run as root in
//! the guest and can take `ioperm`/`iopl` themselves, or run in the guest kernel after an
//! exploit), so each access is treated as hostile input: unknown ports read as all-ones and
//! swallow writes, wrong access sizes are ignored, nothing panics.

pub mod console;
pub(crate) mod exit_report;
pub(crate) mod host_copy;
pub(crate) mod host_random;
pub(crate) mod host_zero;
pub(crate) mod i8042;
pub mod virtio;

use std::io;

use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::layout::{
    SERIAL_PORT_BASE, SERIAL_PORT_COUNT, VIRTIO_NET_MMIO_BASE, VIRTIO_NET_MMIO_SIZE,
};
use crate::memory::GuestRam;
use crate::net::Nic;
use crate::protocol::DOORBELL_PORT;
use console::ConsoleLog;
use i8042::{I8042, I8042Event};

/// Raises an IRQ (the serial console's, the network card's) by writing an eventfd registered
/// with KVM as an irqfd.
#[derive(Debug)]
pub struct IrqEvent(pub EventFd);

impl Trigger for IrqEvent {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// The serial console device.
pub(crate) type SerialConsole = Serial<IrqEvent, NoEvents, ConsoleLog>;

/// What a port access means to the run loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PortEvent {
    /// Handled; keep running.
    Handled,
    /// The guest rang the doorbell with this code (a 32-bit write to [`DOORBELL_PORT`]).
    Doorbell(u32),
    /// The guest pulsed the i8042 reset line.
    Reset,
    /// The guest kernel asks for guest-physical `addr..addr + len` to be zeroed
    /// ([`host_zero`]); not yet checked against guest RAM.
    Zero { addr: u64, len: u64 },
    /// The guest kernel reports that the worker process is exiting with this wait status
    /// ([`exit_report`]).
    WorkerExit(u32),
    /// The guest kernel asks for the copy described by the block at this guest-physical
    /// address ([`host_copy`]).
    Copy(u64),
    /// The guest kernel asks for guest-physical `addr..addr + len` to be filled with fresh
    /// bytes from the host's CSPRNG, or zeroed ([`host_random`]); not yet checked against
    /// guest RAM.
    Random {
        addr: u64,
        len: u64,
        fill: host_random::Fill,
    },
}

/// Errors of device setup.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("cannot put bytes in the serial receive FIFO: {0}")]
    Receive(String),
    #[error("cannot restore serial state: {0}")]
    SerialState(String),
}

/// The port-I/O devices of one VM.
#[derive(Debug)]
pub struct PortBus {
    serial: SerialConsole,
    i8042: I8042,
    /// The network card, in a VM that has one (boxed: most VMs have none).
    nic: Option<Box<Nic>>,
    /// Accesses to ports no device owns, and malformed doorbell writes (diagnostics).
    stray_accesses: u64,
    /// Exits to the VMM so far (every `KVM_RUN` that returned an exit to handle).
    exits: u64,
    /// The running request's memory cap, checked after each host-zero request
    /// ([`crate::memory_cap`]); None between requests and where the guest has no counter.
    memory_cap: Option<crate::memory_cap::MemoryCap>,
}

impl PortBus {
    /// A bus with a fresh serial console raising its IRQ through `irq` and logging to `log`.
    pub(crate) fn new(irq: EventFd, log: ConsoleLog) -> Self {
        Self {
            serial: Serial::new(IrqEvent(irq), log),
            i8042: I8042,
            nic: None,
            stray_accesses: 0,
            exits: 0,
            memory_cap: None,
        }
    }

    /// Arms (or, with None, disarms) the memory cap of the request about to run.
    pub(crate) fn set_memory_cap(&mut self, cap: Option<crate::memory_cap::MemoryCap>) {
        self.memory_cap = cap;
    }

    /// The memory cap armed now.
    pub(crate) fn memory_cap(&self) -> Option<crate::memory_cap::MemoryCap> {
        self.memory_cap
    }

    /// A bus whose serial console continues from a saved state.
    pub(crate) fn from_state(
        irq: EventFd,
        log: ConsoleLog,
        state: &SerialState,
    ) -> Result<Self, DeviceError> {
        let serial = Serial::from_state(state, IrqEvent(irq), NoEvents, log)
            .map_err(|e| DeviceError::SerialState(format!("{e:?}")))?;
        Ok(Self {
            serial,
            i8042: I8042,
            nic: None,
            stray_accesses: 0,
            exits: 0,
            memory_cap: None,
        })
    }

    /// Returns the serial console to `state` with an empty console log, keeping its IRQ line
    /// (a reused VM's reset). The i8042 has no state.
    pub(crate) fn restore_serial(&mut self, state: &SerialState) -> Result<(), DeviceError> {
        let irq = self
            .serial
            .interrupt_evt()
            .0
            .try_clone()
            .map_err(|e| DeviceError::SerialState(format!("cloning the IRQ eventfd: {e}")))?;
        self.serial = Serial::from_state(state, IrqEvent(irq), NoEvents, ConsoleLog::default())
            .map_err(|e| DeviceError::SerialState(format!("{e:?}")))?;
        self.stray_accesses = 0;
        Ok(())
    }

    /// Puts `bytes` in the serial console's receive FIFO and raises its IRQ if the guest
    /// enabled receive interrupts: how the host interrupts a session's cell (a worker thread
    /// reads the console and signals the cell). Bytes past the FIFO's room are dropped.
    pub(crate) fn send_to_guest(&mut self, bytes: &[u8]) -> Result<usize, DeviceError> {
        self.serial
            .enqueue_raw_bytes(bytes)
            .map_err(|e| DeviceError::Receive(format!("{e:?}")))
    }

    /// Puts a network card in the MMIO window.
    pub(crate) fn set_nic(&mut self, nic: Nic) {
        self.nic = Some(Box::new(nic));
    }

    /// The network card, if the VM has one.
    pub fn nic(&self) -> Option<&Nic> {
        self.nic.as_deref()
    }

    /// The network card, mutably.
    pub fn nic_mut(&mut self) -> Option<&mut Nic> {
        self.nic.as_deref_mut()
    }

    /// The offset of `addr` in the network card's window, if the VM has a card and `addr`
    /// (with the access's length) lies inside it.
    fn nic_offset(&self, addr: u64, len: usize) -> Option<u64> {
        self.nic.as_ref()?;
        let offset = addr.checked_sub(VIRTIO_NET_MMIO_BASE)?;
        (offset.checked_add(len as u64)? <= VIRTIO_NET_MMIO_SIZE).then_some(offset)
    }

    /// A guest MMIO read: the network card's window if the VM has one; everything else
    /// (no device: the IOAPIC and LAPIC live in KVM) reads as all-ones.
    pub(crate) fn mmio_read(&mut self, addr: u64, data: &mut [u8]) -> PortEvent {
        match (self.nic_offset(addr, data.len()), self.nic.as_deref_mut()) {
            (Some(offset), Some(nic)) => nic.mmio_read(offset, data),
            _ => {
                self.stray_accesses += 1;
                data.fill(0xff);
            }
        }
        PortEvent::Handled
    }

    /// A guest MMIO write: the network card's window if the VM has one (a queue
    /// notification runs its stack, writing guest memory); anything else is swallowed.
    pub(crate) fn mmio_write(&mut self, addr: u64, data: &[u8], ram: &GuestRam) -> PortEvent {
        match (self.nic_offset(addr, data.len()), self.nic.as_deref_mut()) {
            (Some(offset), Some(nic)) => nic.mmio_write(offset, data, ram),
            _ => self.stray_accesses += 1,
        }
        PortEvent::Handled
    }

    /// Whether the network card has host-side work (a host socket ready, a timer due).
    pub(crate) fn nic_pending(&self) -> bool {
        self.nic.as_ref().is_some_and(|n| n.is_pending())
    }

    /// Runs the network card's stack if its helper thread asked for it.
    pub(crate) fn serve_nic(&mut self, ram: &GuestRam) {
        if let Some(nic) = self.nic.as_deref_mut() {
            nic.serve(ram);
        }
    }

    /// The eventfd that raises the serial IRQ (registered with KVM as an irqfd).
    pub(crate) fn serial_irq(&self) -> &EventFd {
        &self.serial.interrupt_evt().0
    }

    /// The serial console's register state (for snapshots).
    pub fn serial_state(&self) -> SerialState {
        self.serial.state()
    }

    /// The console log.
    pub fn console(&self) -> &ConsoleLog {
        self.serial.writer()
    }

    /// The console log, mutably (to set an echo or reset its clock).
    pub(crate) fn console_mut(&mut self) -> &mut ConsoleLog {
        self.serial.writer_mut()
    }

    /// Exits to the VMM counted so far.
    pub(crate) fn exits(&self) -> u64 {
        self.exits
    }

    /// Counts one exit (the run loop calls it for every exit it handles).
    pub(crate) fn note_exit(&mut self) {
        self.exits += 1;
    }

    /// Port accesses no device claimed.
    #[allow(
        dead_code,
        reason = "a diagnostic the unit tests check; nothing outside them reports it yet"
    )]
    pub(crate) fn stray_accesses(&self) -> u64 {
        self.stray_accesses
    }

    fn serial_offset(port: u16) -> Option<u8> {
        port.checked_sub(SERIAL_PORT_BASE)
            .filter(|&o| o < SERIAL_PORT_COUNT)
            .map(|o| o as u8)
    }

    /// A guest `in`: fills `data` (1, 2 or 4 bytes).
    pub(crate) fn read(&mut self, port: u16, data: &mut [u8]) -> PortEvent {
        match (Self::serial_offset(port), data.len()) {
            (Some(offset), 1) => data[0] = self.serial.read(offset),
            _ if I8042::owns(port) && data.len() == 1 => data[0] = self.i8042.read(port),
            _ => {
                self.stray_accesses += 1;
                data.fill(0xff);
            }
        }
        PortEvent::Handled
    }

    /// A guest `out` of `data` (1, 2 or 4 bytes).
    pub(crate) fn write(&mut self, port: u16, data: &[u8]) -> PortEvent {
        let event = match port {
            DOORBELL_PORT => |v| Some(PortEvent::Doorbell(v)),
            host_zero::PORT => {
                |v| host_zero::decode(v).map(|(addr, len)| PortEvent::Zero { addr, len })
            }
            host_copy::PORT => |v| Some(PortEvent::Copy(u64::from(v))),
            host_random::PORT => |v| {
                let (addr, len, fill) = host_random::decode(v);
                Some(PortEvent::Random { addr, len, fill })
            },
            exit_report::PORT => |v| Some(PortEvent::WorkerExit(v)),
            _ => return self.write_byte_port(port, data),
        };
        // The 32-bit ports: a value that is not 4 bytes wide, or that means nothing, is stray.
        match <[u8; 4]>::try_from(data)
            .ok()
            .map(u32::from_le_bytes)
            .and_then(event)
        {
            Some(event) => event,
            None => {
                self.stray_accesses += 1;
                PortEvent::Handled
            }
        }
    }

    /// A guest `out` to one of the byte-wide devices (serial, i8042) or to no device.
    fn write_byte_port(&mut self, port: u16, data: &[u8]) -> PortEvent {
        match (Self::serial_offset(port), data) {
            (Some(offset), [value]) => {
                // The only error is a failed IRQ eventfd write; the guest then misses one
                // interrupt, which a console can survive, and the run loop must not stop.
                if self.serial.write(offset, *value).is_err() {
                    self.stray_accesses += 1;
                }
                PortEvent::Handled
            }
            (None, [value]) if I8042::owns(port) => match self.i8042.write(port, *value) {
                I8042Event::Reset => PortEvent::Reset,
                I8042Event::None => PortEvent::Handled,
            },
            _ => {
                self.stray_accesses += 1;
                PortEvent::Handled
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bus() -> PortBus {
        PortBus::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            ConsoleLog::new(8),
        )
    }

    #[test]
    fn bytes_written_to_the_uart_reach_the_console_log() {
        let mut bus = bus();

        for &b in b"hi\n" {
            assert_eq!(bus.write(0x3f8, &[b]), PortEvent::Handled);
        }

        assert_eq!(bus.console().tail(1), vec!["hi"]);
    }

    #[test]
    fn a_32_bit_doorbell_write_is_a_doorbell_and_other_sizes_are_ignored() {
        let mut bus = bus();

        let rung = bus.write(DOORBELL_PORT, &0x0002u32.to_le_bytes());
        let byte = bus.write(DOORBELL_PORT, &[2]);

        assert_eq!(rung, PortEvent::Doorbell(2));
        assert_eq!(byte, PortEvent::Handled);
        assert_eq!(bus.stray_accesses(), 1);
    }

    #[test]
    fn a_32_bit_host_zero_write_names_a_range_and_malformed_ones_are_stray() {
        let mut bus = bus();
        let huge = 0x200u32 | (9 << host_zero::PFN_BITS);

        let zero = bus.write(host_zero::PORT, &huge.to_le_bytes());
        let byte = bus.write(host_zero::PORT, &[1]);
        let too_big = bus.write(
            host_zero::PORT,
            &(31u32 << host_zero::PFN_BITS).to_le_bytes(),
        );

        assert_eq!(
            zero,
            PortEvent::Zero {
                addr: 0x20_0000,
                len: 2 << 20
            }
        );
        assert_eq!(byte, PortEvent::Handled);
        assert_eq!(too_big, PortEvent::Handled);
        assert_eq!(bus.stray_accesses(), 2);
    }

    #[test]
    fn a_32_bit_host_random_write_names_a_range_and_other_sizes_are_stray() {
        let mut bus = bus();
        let fill = 0x1234u32 | (4 << host_random::PFN_BITS);

        let random = bus.write(host_random::PORT, &fill.to_le_bytes());
        let wipe = bus.write(host_random::PORT, &(fill | host_random::WIPE).to_le_bytes());
        let word = bus.write(host_random::PORT, &[1, 2]);

        let range = |fill| PortEvent::Random {
            addr: 0x123_4000,
            len: 64 << 10,
            fill,
        };
        assert_eq!(random, range(host_random::Fill::Random));
        assert_eq!(wipe, range(host_random::Fill::Wipe));
        assert_eq!(word, PortEvent::Handled);
        assert_eq!(bus.stray_accesses(), 1);
    }

    #[test]
    fn a_32_bit_exit_report_carries_the_wait_status_and_other_sizes_are_stray() {
        let mut bus = bus();

        let killed = bus.write(exit_report::PORT, &9u32.to_le_bytes());
        let byte = bus.write(exit_report::PORT, &[9]);

        assert_eq!(killed, PortEvent::WorkerExit(9));
        assert_eq!(byte, PortEvent::Handled);
        assert_eq!(bus.stray_accesses(), 1);
    }

    #[test]
    fn i8042_reset_stops_and_unknown_ports_read_all_ones() {
        let mut bus = bus();
        let mut data = [0u8; 2];

        let reset = bus.write(0x64, &[0xfe]);
        bus.read(0x1234, &mut data);

        assert_eq!(reset, PortEvent::Reset);
        assert_eq!(data, [0xff, 0xff]);
    }

    #[test]
    fn serial_state_survives_save_and_restore() {
        let mut bus = bus();
        bus.write(0x3f8 + 3, &[0x80]); // LCR: DLAB on
        bus.write(0x3f8, &[0x0c]); // divisor low
        bus.write(0x3f8 + 3, &[0x03]); // LCR: 8N1
        let saved = bus.serial_state();

        let restored = PortBus::from_state(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            ConsoleLog::new(8),
            &saved,
        )
        .unwrap();

        assert_eq!(restored.serial_state(), saved);
    }
}
