//! Capturing a stopped machine's complete CPU and device state, restoring it into a new VM,
//! and the on-disk format of that state.
//!
//! Everything a clone needs is one flat serde struct, [`SnapshotState`]: the vCPU (registers,
//! special registers, FPU or XSAVE state, LAPIC, every MSR the vCPU both reports and accepts,
//! events, MP state, debug registers), the VM (both PICs, the IOAPIC, the PIT, the KVM clock),
//! the serial console and where the mailbox is. On disk it is [`SNAPSHOT_MAGIC`], a little-endian
//! `u32` [`SNAPSHOT_FORMAT_VERSION`], then bincode. No per-struct versions: a format change
//! bumps the one version and old templates are rebuilt.
//!
//! Guest memory is not part of this struct: a template keeps it in its own file, which clones
//! map copy-on-write (see [`crate::template`]).

use std::sync::OnceLock;

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, Msrs, kvm_clock_data,
    kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;

use crate::host::HostKind;
use crate::kernel_layout::KernelLayout;
use crate::mailbox::Mailbox;

/// First bytes of a snapshot state file.
pub const SNAPSHOT_MAGIC: [u8; 8] = *b"BUDSNAP\0";
/// Version of the state file format; bumped on any change to [`SnapshotState`].
pub const SNAPSHOT_FORMAT_VERSION: u32 = 4;

const MSR_IA32_TSC: u32 = 0x10;

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
    pub fpr: [[u8; 16]; 8],
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: [[u8; 16]; 16],
    pub mxcsr: u32,
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

/// The serial console's registers (mirror of vm-superio's `SerialState`, with serde).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialSnapshot {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl From<&SerialState> for SerialSnapshot {
    fn from(s: &SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

impl From<&SerialSnapshot> for SerialState {
    fn from(s: &SerialSnapshot) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// The CPU and device state of one machine.
#[derive(Debug, Serialize, Deserialize)]
pub struct MachineState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub fpu: FpuState,
    /// XSAVE area and XCRs, when the host supports them (hardware virtualization).
    pub xsave: Option<kvm_xsave>,
    pub xcrs: Option<kvm_xcrs>,
    pub lapic: kvm_lapic_state,
    /// TSC first, so that TSC-relative MSRs (TSC_DEADLINE) restore against the right TSC.
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
    pub mp_state: kvm_mp_state,
    pub debug_regs: kvm_debugregs,
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    pub serial: SerialSnapshot,
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

/// Whether to carry FPU state as XSAVE (hardware hosts with the capability) or as `kvm_fpu`.
/// On kvm_pvm the guest runs with XSAVE disabled (`noxsave`), so `kvm_fpu` holds all of it.
fn use_xsave(kvm: &Kvm, kind: HostKind) -> bool {
    kind == HostKind::Hardware && kvm.check_extension(Cap::Xsave) && kvm.check_extension(Cap::Xcrs)
}

static MSR_INDICES: OnceLock<Vec<u32>> = OnceLock::new();

/// MSRs this host's vCPUs both report and accept, found once per process by reading and
/// writing back each index KVM lists. TSC first.
fn saveable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<&'static [u32], SnapshotError> {
    if let Some(v) = MSR_INDICES.get() {
        return Ok(v);
    }
    let listed = cap("KVM_GET_MSR_INDEX_LIST", kvm.get_msr_index_list())?;
    let mut ok = Vec::new();
    for &index in listed.as_slice() {
        let mut one = Msrs::from_entries(&[kvm_msr_entry {
            index,
            ..Default::default()
        }])
        .map_err(|_| SnapshotError::TooManyEntries)?;
        if vcpu.get_msrs(&mut one).ok() != Some(1) {
            continue;
        }
        if vcpu.set_msrs(&one).ok() == Some(1) {
            ok.push(index);
        }
    }
    ok.sort_by_key(|&i| (i != MSR_IA32_TSC, i));
    Ok(MSR_INDICES.get_or_init(|| ok))
}

/// Lets KVM finish the instruction behind the last exit (a port write's completion advances
/// `rip`) without running the guest: `KVM_RUN` with `immediate_exit` set does that and
/// returns `EINTR`. Before a capture, so the state describes a finished instruction; before
/// a reset, so a completion left over from the job's last exit cannot land on the restored
/// registers.
pub fn complete_pending_io(vcpu: &mut VcpuFd) -> Result<(), SnapshotError> {
    vcpu.set_kvm_immediate_exit(1);
    let completed = vcpu.run().map(|exit| format!("{exit:?}"));
    vcpu.set_kvm_immediate_exit(0);
    match completed {
        Err(e) if e.errno() == libc::EINTR => Ok(()),
        other => Err(SnapshotError::CompleteIo(format!("{other:?}"))),
    }
}

/// PIT counter modes that count down once (0, 1, 4, 5); 2 and 3 are periodic.
const PIT_ONE_SHOT_MODES: [u8; 4] = [0, 1, 4, 5];

/// KVM cannot restore an *expired* one-shot PIT channel 0: `KVM_SET_PIT2` reloads the count
/// and arms the timer again, so every clone would take a timer interrupt (IRQ 0) about 55 ms
/// after its restore that the template never saw pending. bud's guest shuts the PIT down
/// early in boot (mode 0 with a zero count, one last countdown long expired by READY) and
/// ticks with the LAPIC TSC-deadline timer. For such a state the capture sets
/// `KVM_PIT_FLAGS_HPET_LEGACY`, with which `KVM_SET_PIT2` restores the channel's registers
/// without arming its timer. A periodic channel 0 is kept as it is.
fn quiet_expired_pit(mut pit: kvm_pit_state2) -> kvm_pit_state2 {
    if PIT_ONE_SHOT_MODES.contains(&pit.channels[0].mode) {
        pit.flags |= kvm_bindings::KVM_PIT_FLAGS_HPET_LEGACY;
    }
    pit
}

/// Which MSRs [`capture`] reads.
#[derive(Debug, Clone, Copy)]
pub enum MsrList<'a> {
    /// Every MSR this host's vCPUs report and accept (probed once per process, by writing).
    Probe,
    /// Exactly these (a reference state's), read without writing any.
    These(&'a [u32]),
}

/// Captures the state of a vCPU stopped by an exit (typically the READY doorbell).
///
/// First it re-enters `KVM_RUN` with `immediate_exit` set: KVM then completes the pending
/// port I/O (advancing `rip` past the `out`) and returns `EINTR` without running the guest, so
/// the captured registers describe a finished instruction.
///
/// The MSRs captured are those this host's vCPUs both report and accept, found once per
/// process by reading and writing back each one KVM lists, on this vCPU: only ever do that on
/// a VM whose memory is captured afterwards (writing some MSRs makes KVM write guest memory).
/// To capture a VM for comparison, pass the reference's MSR list instead.
pub fn capture(
    kvm: &Kvm,
    vm: &VmFd,
    vcpu: &mut VcpuFd,
    kind: HostKind,
    cpuid: Vec<kvm_cpuid_entry2>,
    serial: &SerialState,
    msrs: MsrList<'_>,
) -> Result<MachineState, SnapshotError> {
    complete_pending_io(vcpu)?;
    // The clock first: the guest read its wall clock for READY just before the exit, and a
    // clone's wall clock is that reading plus the clock's advance up to here.
    let clock = cap("KVM_GET_CLOCK", vm.get_clock())?;
    let indices = match msrs {
        MsrList::Probe => saveable_msrs(kvm, vcpu)?,
        MsrList::These(indices) => indices,
    };
    let mut msrs = Msrs::from_entries(
        &indices
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect::<Vec<_>>(),
    )
    .map_err(|_| SnapshotError::TooManyEntries)?;
    let read = cap("KVM_GET_MSRS", vcpu.get_msrs(&mut msrs))?;
    if read != indices.len() {
        return Err(SnapshotError::PartialMsrs {
            set: read,
            total: indices.len(),
            first_refused: indices.get(read).copied().unwrap_or(0),
        });
    }
    let (xsave, xcrs) = if use_xsave(kvm, kind) {
        (
            Some(cap("KVM_GET_XSAVE", vcpu.get_xsave())?),
            Some(cap("KVM_GET_XCRS", vcpu.get_xcrs())?),
        )
    } else {
        (None, None)
    };
    let chip = |chip_id| -> Result<kvm_irqchip, SnapshotError> {
        let mut c = kvm_irqchip {
            chip_id,
            ..Default::default()
        };
        cap("KVM_GET_IRQCHIP", vm.get_irqchip(&mut c))?;
        Ok(c)
    };
    Ok(MachineState {
        cpuid,
        regs: cap("KVM_GET_REGS", vcpu.get_regs())?,
        sregs: cap("KVM_GET_SREGS", vcpu.get_sregs())?,
        fpu: FpuState::from(&cap("KVM_GET_FPU", vcpu.get_fpu())?),
        xsave,
        xcrs,
        lapic: cap("KVM_GET_LAPIC", vcpu.get_lapic())?,
        msrs: msrs.as_slice().to_vec(),
        events: cap("KVM_GET_VCPU_EVENTS", vcpu.get_vcpu_events())?,
        mp_state: cap("KVM_GET_MP_STATE", vcpu.get_mp_state())?,
        debug_regs: cap("KVM_GET_DEBUGREGS", vcpu.get_debug_regs())?,
        pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
        pit: quiet_expired_pit(cap("KVM_GET_PIT2", vm.get_pit2())?),
        clock,
        serial: SerialSnapshot::from(serial),
    })
}

/// What [`restore`] restores into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A VM that has never run: everything, CPUID included.
    NewVm,
    /// A VM that ran the same template before (a reset): CPUID is left as it is (KVM refuses
    /// a different CPUID after the first `KVM_RUN`, and this one is the template's already).
    SameVm,
}

/// Restores `s` into a VM and vCPU (see [`crate::vm::Machine::create`], which has already
/// registered memory, created the irqchip and PIT, and restored the serial device).
///
/// Order, and why:
/// 1. VM devices: PIT, KVM clock (flags cleared, so the guest's clock continues from the
///    snapshot instead of jumping), then PIC master, PIC slave, IOAPIC.
/// 2. CPUID first on the vCPU: KVM derives other vCPU properties (XSAVE size, MSR
///    availability) from it.
/// 3. MP state, general registers, special registers (sets the APIC base the LAPIC restore
///    relies on), FPU or XSAVE + XCRs, debug registers, LAPIC.
/// 4. MSRs, TSC first so TSC_DEADLINE is read against the restored TSC; all or nothing.
/// 5. vCPU events last: pending exceptions and interrupts refer to the state above.
///
/// Every call is checked; a partial MSR restore is an error.
pub fn restore(
    vm: &VmFd,
    vcpu: &VcpuFd,
    s: &MachineState,
    target: Target,
) -> Result<(), SnapshotError> {
    res("KVM_SET_PIT2", vm.set_pit2(&s.pit))?;
    set_clock(vm, s)?;
    for chip in [&s.pic_master, &s.pic_slave, &s.ioapic] {
        res("KVM_SET_IRQCHIP", vm.set_irqchip(chip))?;
    }

    if target == Target::NewVm {
        let cpuid = kvm_bindings::CpuId::from_entries(&s.cpuid)
            .map_err(|_| SnapshotError::TooManyEntries)?;
        res("KVM_SET_CPUID2", vcpu.set_cpuid2(&cpuid))?;
    }
    res("KVM_SET_MP_STATE", vcpu.set_mp_state(s.mp_state))?;
    res("KVM_SET_REGS", vcpu.set_regs(&s.regs))?;
    res("KVM_SET_SREGS", vcpu.set_sregs(&s.sregs))?;
    match (&s.xsave, &s.xcrs) {
        (Some(xsave), Some(xcrs)) => {
            // SAFETY: `xsave` was read by KVM_GET_XSAVE (a full 4 KiB `kvm_xsave`) on a vCPU
            // with the same CPUID, whose policy keeps the XSAVE area within 4 KiB (no AMX), so
            // KVM reads no more than the struct holds.
            res("KVM_SET_XSAVE", unsafe { vcpu.set_xsave(xsave) })?;
            res("KVM_SET_XCRS", vcpu.set_xcrs(xcrs))?;
        }
        _ => res("KVM_SET_FPU", vcpu.set_fpu(&kvm_fpu::from(&s.fpu)))?,
    }
    res("KVM_SET_DEBUGREGS", vcpu.set_debug_regs(&s.debug_regs))?;
    res("KVM_SET_LAPIC", vcpu.set_lapic(&s.lapic))?;
    let msrs = Msrs::from_entries(&s.msrs).map_err(|_| SnapshotError::TooManyEntries)?;
    let set = res("KVM_SET_MSRS", vcpu.set_msrs(&msrs))?;
    if set != s.msrs.len() {
        return Err(SnapshotError::PartialMsrs {
            set,
            total: s.msrs.len(),
            first_refused: s.msrs.get(set).map(|e| e.index).unwrap_or(0),
        });
    }
    res("KVM_SET_VCPU_EVENTS", vcpu.set_vcpu_events(&s.events))?;
    Ok(())
}

/// Sets the VM's kvm-clock to the snapshot's value (flags cleared: not the real time), so the
/// guest's clock continues from the instant of the snapshot. Called by [`restore`], and again
/// right before a job resumes the guest, so that time a clone spent waiting (in a pool, or as
/// a warm VM between jobs) is never seen by the guest: a guest that sees time pass accounts
/// it in its timekeeping and timers, tick by tick, all emulated on kvm_pvm.
pub fn set_clock(vm: &VmFd, s: &MachineState) -> Result<(), SnapshotError> {
    pin_clock(vm, &s.clock)
}

/// Sets the VM's kvm-clock to `clock` (flags cleared, as [`set_clock`]): a session's clock
/// where its last request stopped.
pub fn pin_clock(vm: &VmFd, clock: &kvm_clock_data) -> Result<(), SnapshotError> {
    let clock = kvm_clock_data { flags: 0, ..*clock };
    res("KVM_SET_CLOCK", vm.set_clock(&clock))
}

/// The VM's kvm-clock now.
pub fn read_clock(vm: &VmFd) -> Result<kvm_clock_data, SnapshotError> {
    cap("KVM_GET_CLOCK", vm.get_clock())
}
