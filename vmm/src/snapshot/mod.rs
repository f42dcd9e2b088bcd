//! Capturing a stopped machine's complete CPU and device state, restoring it into a new VM,
//! and the on-disk format of that state.
//!
//! Everything a clone needs is one flat serde struct, [`SnapshotState`]: the vCPU (registers,
//! special registers, FPU or XSAVE state, LAPIC, every MSR the vCPU both reports and accepts,
//! events, MP state, debug registers), the VM (both PICs, the IOAPIC, the PIT, the KVM clock),
//! the serial console, the network card if the VM has one, and where the mailbox is. On disk it is [`SNAPSHOT_MAGIC`], a little-endian
//! `u32` [`SNAPSHOT_FORMAT_VERSION`], then bincode. No per-struct versions: a format change
//! bumps the one version and old templates are rebuilt.
//!
//! Guest memory is not part of this struct: a template keeps it in its own file, which clones
//! map copy-on-write (see [`crate::template`]).
//!
//! The serial console's state is vm-superio's own `SerialState` (from `Serial::state`, given
//! back to `Serial::from_state`), held as is. vm-superio 0.8 derives no serde for it, and its
//! companion crate vm-superio-ser, whose `SerialStateSer` does, cannot be used: its newest
//! release (0.4.1) pins vm-superio `=0.8.1`, one release behind the 0.8.2 bud runs (whose
//! IER fix signals input that arrived while the guest's 8250 driver had receive interrupts
//! masked), and it brings in Firecracker's `versionize` for per-struct versions this format
//! does not have. So `SerialStateDef` is the one mirror here: serde's remote derive over
//! `SerialState`'s fields, which fails to compile if vm-superio adds or changes a field.
//!
//! This file holds the format; `capture` reads a stopped machine's state out of KVM (which
//! MSRs, the PIT quirk) and `restore` writes it into a VM, in the order its doc gives, and
//! pins the guest's clock between runs.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state,
    kvm_mp_state, kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave,
};
use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;

use crate::host::HostKind;
use crate::kernel_layout::KernelLayout;
use crate::mailbox::Mailbox;

mod capture;
mod restore;

/// MSR of the TSC, which moves with time: captured first, so that TSC-relative MSRs restore
/// against it, and never compared exactly.
pub(crate) const MSR_IA32_TSC: u32 = 0x10;
/// MSR of the LAPIC timer's deadline in TSC-deadline mode (Linux's clock event device).
pub(crate) const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

pub(crate) use capture::complete_pending_io;
pub use capture::{MsrList, capture};
pub use restore::{Target, restore};
pub(crate) use restore::{
    pin_clock, read_clock, rearm_deadline_timer, rearm_timer, set_clock, timer_ahead,
    timer_ahead_of,
};

/// First bytes of a snapshot state file.
pub(crate) const SNAPSHOT_MAGIC: [u8; 8] = *b"BUDSNAP\0";
/// Version of the state file format; bumped on any change to [`SnapshotState`] or to what
/// it holds (5: the CPUID policy hides VMX/SVM, so a template captured before must not be
/// reused; the MSRs captured leave out the Hyper-V range; 6: the network card's state, and
/// the kernel layout's memory counters that the memory cap reads).
pub(crate) const SNAPSHOT_FORMAT_VERSION: u32 = 6;

/// Errors of capturing, restoring, encoding or decoding state.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("capture: {op} failed")]
    Capture {
        op: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("restore: {op} failed")]
    Restore {
        op: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error(
        "restore: KVM_SET_MSRS restored {set} of {total} MSRs (first refused: {first_refused:#x})"
    )]
    PartialMsrs {
        set: usize,
        total: usize,
        first_refused: u32,
    },
    #[error("capture: the vCPU did not stop cleanly to complete pending I/O: {0}")]
    CompleteIo(String),
    #[error("restore: the CPUID offers an XSAVE area larger than KVM_SET_XSAVE's 4 KiB")]
    XsaveTooLarge,
    #[error("too many MSRs or CPUID entries for KVM's fixed-size arrays")]
    TooManyEntries,
    #[error("not a bud snapshot state (bad magic)")]
    BadMagic,
    #[error("snapshot format version {found}, this bud reads version {SNAPSHOT_FORMAT_VERSION}")]
    Version { found: u32 },
    #[error("snapshot state encoding: {0}")]
    Encoding(#[from] bincode::Error),
}

/// x87/SSE state in KVM's legacy `kvm_fpu` layout (used where XSAVE is not in play).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FpuState {
    pub(crate) fpr: [[u8; 16]; 8],
    pub(crate) fcw: u16,
    pub(crate) fsw: u16,
    pub(crate) ftwx: u8,
    pub(crate) last_opcode: u16,
    pub(crate) last_ip: u64,
    pub(crate) last_dp: u64,
    pub(crate) xmm: [[u8; 16]; 16],
    pub(crate) mxcsr: u32,
}

impl From<&kvm_fpu> for FpuState {
    fn from(f: &kvm_fpu) -> Self {
        Self {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
        }
    }
}

impl From<&FpuState> for kvm_fpu {
    fn from(f: &FpuState) -> Self {
        kvm_fpu {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
            ..Default::default()
        }
    }
}

/// How serde writes vm-superio's `SerialState`: serde's remote derive over the same fields, the
/// one mirror of device state in the snapshot (the module doc says why). [`MachineState`]
/// holds vm-superio's own `SerialState`; deserializing builds it as a struct literal naming
/// every field, so a field a later vm-superio adds fails the build instead of silently being
/// left out of templates. Its encoding is [`SNAPSHOT_FORMAT_VERSION`]'s: a change here bumps it.
#[derive(Serialize, Deserialize)]
#[serde(remote = "SerialState")]
struct SerialStateDef {
    baud_divisor_low: u8,
    baud_divisor_high: u8,
    interrupt_enable: u8,
    interrupt_identification: u8,
    line_control: u8,
    line_status: u8,
    modem_control: u8,
    modem_status: u8,
    scratch: u8,
    in_buffer: Vec<u8>,
}

/// The CPU and device state of one machine.
#[derive(Debug, Serialize, Deserialize)]
pub struct MachineState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub fpu: FpuState,
    /// XSAVE area and XCRs, when the host supports them (hardware virtualization).
    pub(crate) xsave: Option<kvm_xsave>,
    pub(crate) xcrs: Option<kvm_xcrs>,
    pub(crate) lapic: kvm_lapic_state,
    /// TSC first, so that TSC-relative MSRs (TSC_DEADLINE) restore against the right TSC.
    pub msrs: Vec<kvm_msr_entry>,
    pub(crate) events: kvm_vcpu_events,
    pub mp_state: kvm_mp_state,
    pub debug_regs: kvm_debugregs,
    pub pic_master: kvm_irqchip,
    pub(crate) pic_slave: kvm_irqchip,
    pub(crate) ioapic: kvm_irqchip,
    pub(crate) pit: kvm_pit_state2,
    pub(crate) clock: kvm_clock_data,
    /// The serial console, as vm-superio's `Serial::state` gives it.
    #[serde(with = "SerialStateDef")]
    pub serial: SerialState,
    /// The network card's guest-visible state (transport registers, queues), for a VM that
    /// has one ([`crate::net`]); `None` for a VM without a card.
    pub net: Option<crate::devices::virtio::net::NetDeviceState>,
}

/// Everything a clone needs besides guest memory.
#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotState {
    pub host_kind: HostKind,
    /// The CPU and KVM it was captured under ([`crate::host_identity`]).
    pub host_identity: String,
    pub ram_size: u64,
    pub machine: MachineState,
    pub mailbox: Mailbox,
    /// Where the guest kernel keeps its clock and CRNG (read from its vmlinux).
    pub kernel: KernelLayout,
    /// The guest's wall clock at READY (ns since the epoch): a clone's wall clock at resume.
    pub ready_wall_ns: u64,
}

impl SnapshotState {
    /// Encodes as magic + version + bincode.
    pub fn to_bytes(&self) -> Result<Vec<u8>, SnapshotError> {
        let mut out = Vec::with_capacity(16 * 1024);
        out.extend_from_slice(&SNAPSHOT_MAGIC);
        out.extend_from_slice(&SNAPSHOT_FORMAT_VERSION.to_le_bytes());
        bincode::serialize_into(&mut out, self)?;
        Ok(out)
    }

    /// Decodes what [`SnapshotState::to_bytes`] wrote, checking magic and version.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let rest = bytes
            .strip_prefix(&SNAPSHOT_MAGIC[..])
            .ok_or(SnapshotError::BadMagic)?;
        let (version, payload) = rest.split_at_checked(4).ok_or(SnapshotError::BadMagic)?;
        let found = u32::from_le_bytes(version.try_into().map_err(|_| SnapshotError::BadMagic)?);
        if found != SNAPSHOT_FORMAT_VERSION {
            return Err(SnapshotError::Version { found });
        }
        Ok(bincode::deserialize(payload)?)
    }
}

fn cap<T>(op: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, SnapshotError> {
    r.map_err(|source| SnapshotError::Capture { op, source })
}

fn res<T>(op: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, SnapshotError> {
    r.map_err(|source| SnapshotError::Restore { op, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vm-superio's `SerialState` alone, encoded as [`MachineState`] encodes it.
    #[derive(Debug, Serialize, Deserialize)]
    struct Serial(#[serde(with = "SerialStateDef")] SerialState);

    #[test]
    fn serial_state_encoding_is_the_one_of_format_version_6() {
        let state = SerialState {
            baud_divisor_low: 1,
            baud_divisor_high: 2,
            interrupt_enable: 3,
            interrupt_identification: 4,
            line_control: 5,
            line_status: 6,
            modem_control: 7,
            modem_status: 8,
            scratch: 9,
            in_buffer: vec![10, 11],
        };

        let bytes = bincode::serialize(&Serial(state)).unwrap();

        // bincode 1: the nine registers in field order, then the receive buffer as a u64
        // length and its bytes. A change here changes the template format: bump
        // SNAPSHOT_FORMAT_VERSION, then this test.
        assert_eq!(SNAPSHOT_FORMAT_VERSION, 6);
        assert_eq!(
            bytes,
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 0, 0, 0, 0, 0, 0, 0, 10, 11]
        );
    }

    #[test]
    fn serial_state_survives_encoding_then_mutation_then_restore() {
        use crate::devices::PortBus;
        use crate::devices::console::ConsoleLog;
        use crate::layout::SERIAL_PORT_BASE as COM1;
        let mut bus = PortBus::new(
            vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            ConsoleLog::new(8),
        );
        bus.write(COM1 + 3, &[0x80]); // LCR: divisor latch on
        bus.write(COM1, &[0x0c]); // divisor low: 9600 baud
        bus.write(COM1 + 3, &[0x03]); // LCR: 8N1, divisor latch off
        bus.write(COM1 + 1, &[0x01]); // IER: receive interrupts
        bus.write(COM1 + 7, &[0x5a]); // scratch
        bus.send_to_guest(b"hi").unwrap();
        let saved = bus.serial_state();
        let bytes = bincode::serialize(&Serial(saved.clone())).unwrap();
        bus.write(COM1 + 7, &[0x00]);
        bus.write(COM1 + 1, &[0x00]);
        bus.send_to_guest(b" there").unwrap();
        let mutated = bus.serial_state();

        let Serial(decoded) = bincode::deserialize(&bytes).unwrap();
        bus.restore_serial(&decoded).unwrap();

        assert_ne!(mutated, saved);
        assert_eq!(bus.serial_state(), saved);
    }
}
