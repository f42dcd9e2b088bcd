//! Capturing a stopped machine's state out of KVM: which MSRs (every one the vCPU both reports
//! and accepts, except the Hyper-V range), the pending I/O completed first, and an expired PIT
//! made restorable.

use std::sync::OnceLock;

use crate::devices::PortBus;
use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, Msrs, kvm_cpuid_entry2,
    kvm_irqchip, kvm_msr_entry, kvm_pit_state2,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};

use super::{FpuState, MSR_IA32_TSC, MachineState, SnapshotError, cap};
use crate::host::HostKind;

/// Whether to carry FPU state as XSAVE (hardware hosts with the capability) or as `kvm_fpu`.
/// On kvm_pvm the guest runs with XSAVE disabled (`noxsave`), so `kvm_fpu` holds all of it.
/// The XSAVE experiment on kvm_pvm ([`crate::host::PVM_XSAVE_EXPERIMENT_ENV`]) carries XSAVE
/// too, as hardware does.
fn use_xsave(kvm: &Kvm, kind: HostKind) -> bool {
    (kind == HostKind::Hardware || crate::host::pvm_xsave_experiment())
        && kvm.check_extension(Cap::Xsave)
        && kvm.check_extension(Cap::Xcrs)
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
fn msr_candidates(listed: &[u32]) -> Vec<u32> {
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
pub(crate) fn complete_pending_io(vcpu: &mut VcpuFd) -> Result<(), SnapshotError> {
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
/// To capture a VM for comparison, pass the reference's MSR list instead. The devices'
/// state (serial console, network card) comes from `devices`.
pub fn capture(
    kvm: &Kvm,
    vm: &VmFd,
    vcpu: &mut VcpuFd,
    kind: HostKind,
    cpuid: Vec<kvm_cpuid_entry2>,
    devices: &PortBus,
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
        serial: devices.serial_state(),
        net: devices.nic().map(crate::net::Nic::state),
    })
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

    #[test]
    fn a_list_without_hyperv_msrs_is_kept_whole() {
        // kvm_pvm's list has no Hyper-V MSRs: nothing is dropped there.
        let pvm = [0xc000_0100, 0x10, 0x4b56_4d00, 0x277, 0x10];

        assert_eq!(
            msr_candidates(&pvm),
            [0x10, 0x277, 0x4b56_4d00, 0xc000_0100]
        );
    }
}
