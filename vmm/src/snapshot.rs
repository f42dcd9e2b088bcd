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
//!
//! The serial console's state is vm-superio's own `SerialState` (from `Serial::state`, given
//! back to `Serial::from_state`), held as is. vm-superio 0.8 derives no serde for it, and its
//! companion crate vm-superio-ser, whose `SerialStateSer` does, cannot be used: its newest
//! release (0.4.1) pins vm-superio `=0.8.1`, one release behind the 0.8.2 bud runs (whose
//! IER fix signals input that arrived while the guest's 8250 driver had receive interrupts
//! masked), and it brings in Firecracker's `versionize` for per-struct versions this format
//! does not have. So `SerialStateDef` is the one mirror here: serde's remote derive over
//! `SerialState`'s fields, which fails to compile if vm-superio adds or changes a field.

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
/// Version of the state file format; bumped on any change to [`SnapshotState`] or to what
/// it holds (5: the CPUID policy hides VMX/SVM, so a template captured before must not be
/// reused; the MSRs captured leave out the Hyper-V range).
pub const SNAPSHOT_FORMAT_VERSION: u32 = 5;

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
    /// The serial console, as vm-superio's `Serial::state` gives it.
    #[serde(with = "SerialStateDef")]
    pub serial: SerialState,
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

/// KVM's Hyper-V synthetic MSRs (`HV_X64_MSR_*`: 0x4000_0000 to 0x4000_0118 today, the
/// range Hyper-V's TLFS reserves for them).
const HYPERV_MSRS: std::ops::RangeInclusive<u32> = 0x4000_0000..=0x4000_01ff;

/// Which of the MSRs KVM lists (`KVM_GET_MSR_INDEX_LIST`) bud captures, on purpose: every
/// one, TSC first, except the MSRs of an interface bud's guest does not have.
///
/// That is the Hyper-V range. Hardware KVM lists its Hyper-V emulation's MSRs; kvm_pvm
/// does not. A guest reaches them only when its CPUID carries Hyper-V's signature, and
/// bud's carries KVM's ([`crate::cpuid`]), so KVM refuses the guest every access (#GP) and
/// they are never guest state. Read by the host they are not even constant: two of them
/// count time (`HV_X64_MSR_VP_RUNTIME` 0x4000_0010, the thread's run time, and
/// `HV_X64_MSR_TIME_REF_COUNT` 0x4000_0020, the VM's reference counter), so a capture of a
/// correctly reset VM would differ from its template's. Capturing them bought nothing and
/// made every reset verification fail on hardware hosts.
///
/// MSRs KVM lists but the vCPU refuses to read or write back (VMX capability MSRs when
/// CPUID hides VMX, features the CPU lacks) are dropped after this, by probing
/// ([`saveable_msrs`]).
pub fn msr_candidates(listed: &[u32]) -> Vec<u32> {
    let mut wanted: Vec<u32> = listed
        .iter()
        .copied()
        .filter(|i| !HYPERV_MSRS.contains(i))
        .collect();
    wanted.sort_by_key(|&i| (i != MSR_IA32_TSC, i));
    wanted.dedup();
    wanted
}

/// MSRs this host's vCPUs both report and accept among [`msr_candidates`], found once per
/// process by reading and writing back each one. TSC first.
fn saveable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<&'static [u32], SnapshotError> {
    if let Some(v) = MSR_INDICES.get() {
        return Ok(v);
    }
    let listed = cap("KVM_GET_MSR_INDEX_LIST", kvm.get_msr_index_list())?;
    let mut ok = Vec::new();
    for index in msr_candidates(listed.as_slice()) {
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
        serial: serial.clone(),
    })
}

/// The environment variable that turns on the TSS restore quirk for QEMU's TCG (`1`: on;
/// anything else or unset: off, the default). Only for a test platform: see
/// [`sregs_to_restore`] and docs/platform.md.
pub const TCG_TSS_QUIRK_ENV: &str = "BUD_TCG_TSS_QUIRK";

/// Whether [`TCG_TSS_QUIRK_ENV`] is `1` (read once per process).
fn tcg_tss_quirk() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(TCG_TSS_QUIRK_ENV).is_some_and(|v| v == "1"))
}

/// TSS descriptor types: 64-bit TSS, available and busy.
const TSS_AVAILABLE: u8 = 9;
const TSS_BUSY: u8 = 11;

/// Whether a CPUID table's vendor (leaf 0) is AMD's or Hygon's (SVM).
fn svm_vendor(cpuid: &[kvm_cpuid_entry2]) -> bool {
    const AMD: [u32; 3] = [0x6874_7541, 0x6974_6e65, 0x444d_4163]; // "Auth" "enti" "cAMD"
    const HYGON: [u32; 3] = [0x6f67_7948, 0x6e65_476e, 0x656e_6975]; // "Hygo" "nGen" "uine"
    cpuid
        .iter()
        .find(|e| e.function == 0)
        .is_some_and(|e| [AMD, HYGON].contains(&[e.ebx, e.edx, e.ecx]))
}

/// The special registers to restore: `sregs` as captured, except with `quirk` on an AMD
/// (SVM) CPUID, where a busy TR (type 11) is restored as available (type 9).
///
/// Why: `kvm_amd` always reports TR as busy (the VMCB does not keep the bit; KVM sets it
/// on every read), and hardware SVM does not care which of the two it is given. QEMU's TCG,
/// emulating SVM for a nested test (scripts/test-hwvirt.sh), refuses every I/O-permission
/// check (user-mode `in`/`out` under `ioperm`) unless TR's cached type is 9: a QEMU defect,
/// the architecture checks only the TSS limit and I/O bitmap. Without the quirk every job in
/// a restored clone dies at its first doorbell there. Never on Intel: VM entry with VMX
/// requires a busy TSS, so the quirk is ignored unless the CPUID is AMD's. A verify reads
/// TR back as busy from `kvm_amd`, so a reset still compares equal to its template.
fn sregs_to_restore(sregs: &kvm_sregs, cpuid: &[kvm_cpuid_entry2], quirk: bool) -> kvm_sregs {
    let mut out = *sregs;
    if quirk && out.tr.type_ == TSS_BUSY && svm_vendor(cpuid) {
        out.tr.type_ = TSS_AVAILABLE;
    }
    out
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
///    relies on; TR as captured unless the test-only quirk of [`sregs_to_restore`] is on), FPU or XSAVE + XCRs, debug registers, LAPIC.
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
    let sregs = sregs_to_restore(&s.sregs, &s.cpuid, tcg_tss_quirk());
    res("KVM_SET_SREGS", vcpu.set_sregs(&sregs))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Part of the index list Debian 12's 6.1 `kvm_amd` reports (97 MSRs, 27 of them Hyper-V;
    /// read inside scripts/test-hwvirt.sh's emulated EPYC): architectural MSRs, the TSC among
    /// them, KVM's paravirtual MSRs, and Hyper-V MSRs, of which 0x4000_0010 and 0x4000_0020
    /// count time.
    const HARDWARE_LIST: [u32; 14] = [
        0x174,       // SYSENTER_CS
        0xc000_0081, // STAR
        0x10,        // TSC
        0x4000_0000, // HV_X64_MSR_GUEST_OS_ID
        0x4000_0001, // HV_X64_MSR_HYPERCALL
        0x4000_0010, // HV_X64_MSR_VP_RUNTIME
        0x4000_0020, // HV_X64_MSR_TIME_REF_COUNT
        0x4000_0021, // HV_X64_MSR_REFERENCE_TSC
        0x4000_0100, // HV_X64_MSR_CRASH_P0
        0x4000_0108, // HV_X64_MSR_TSC_EMULATION_STATUS
        0x4b56_4d01, // MSR_KVM_SYSTEM_TIME_NEW
        0x4b56_4d04, // MSR_KVM_PV_EOI_EN
        0x6e0,       // TSC_DEADLINE
        0x12,        // MSR_KVM_SYSTEM_TIME (KVM's old range stays)
    ];

    #[test]
    fn hyperv_msrs_are_not_captured_and_the_tsc_comes_first() {
        let wanted = msr_candidates(&HARDWARE_LIST);

        assert_eq!(
            wanted,
            [
                0x10,
                0x12,
                0x174,
                0x6e0,
                0x4b56_4d01,
                0x4b56_4d04,
                0xc000_0081
            ]
        );
    }

    fn vendor(ebx: u32, edx: u32, ecx: u32) -> Vec<kvm_cpuid_entry2> {
        vec![kvm_cpuid_entry2 {
            function: 0,
            eax: 0x10,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }]
    }

    fn busy_tr() -> kvm_sregs {
        let mut s = kvm_sregs::default();
        s.tr.type_ = TSS_BUSY;
        s.tr.selector = 0x40;
        s.tr.limit = 0x4087;
        s.tr.present = 1;
        s
    }

    #[test]
    fn the_tss_quirk_restores_an_available_tss_on_amd_only_when_asked() {
        let amd = vendor(0x6874_7541, 0x6974_6e65, 0x444d_4163);
        let hygon = vendor(0x6f67_7948, 0x6e65_476e, 0x656e_6975);
        let intel = vendor(0x756e_6547, 0x4965_6e69, 0x6c65_746e); // "GenuineIntel"
        let captured = busy_tr();

        let off = sregs_to_restore(&captured, &amd, false);
        let on = sregs_to_restore(&captured, &amd, true);
        let on_hygon = sregs_to_restore(&captured, &hygon, true);
        let on_intel = sregs_to_restore(&captured, &intel, true);
        let on_unknown = sregs_to_restore(&captured, &[], true);

        assert_eq!(off, captured);
        assert_eq!(on.tr.type_, TSS_AVAILABLE);
        assert_eq!(on_hygon.tr.type_, TSS_AVAILABLE);
        assert_eq!(
            kvm_sregs {
                tr: captured.tr,
                ..on
            },
            captured,
            "only TR's type changes"
        );
        assert_eq!(on_intel, captured);
        assert_eq!(on_unknown, captured);
    }

    #[test]
    fn a_list_without_hyperv_msrs_is_kept_whole() {
        // kvm_pvm's list has no Hyper-V MSRs: nothing is dropped there.
        let pvm = [0xc000_0100, 0x10, 0x4b56_4d00, 0x277, 0x10];

        assert_eq!(
            msr_candidates(&pvm),
            [0x10, 0x277, 0x4b56_4d00, 0xc000_0100]
        );
    }

    /// vm-superio's `SerialState` alone, encoded as [`MachineState`] encodes it.
    #[derive(Debug, Serialize, Deserialize)]
    struct Serial(#[serde(with = "SerialStateDef")] SerialState);

    #[test]
    fn serial_state_encoding_is_the_one_of_format_version_5() {
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
        assert_eq!(SNAPSHOT_FORMAT_VERSION, 5);
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
