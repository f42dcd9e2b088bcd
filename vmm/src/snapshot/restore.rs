//! Restoring a captured machine state into a VM (the order and why are in [`restore`]'s doc),
//! and the guest's kvm-clock, pinned where a snapshot or a session's last request left it.

use std::sync::OnceLock;

use kvm_bindings::{Msrs, kvm_clock_data, kvm_cpuid_entry2, kvm_fpu, kvm_sregs};
use kvm_ioctls::{VcpuFd, VmFd};

use super::{MSR_IA32_TSC, MSR_IA32_TSC_DEADLINE, MachineState, SnapshotError, cap, res};

/// The environment variable that turns on the TSS restore quirk for QEMU's TCG (`1`: on;
/// anything else or unset: off, the default). Only for a test platform: see
/// [`sregs_to_restore`] and docs/platform.md.
const TCG_TSS_QUIRK_ENV: &str = "BUD_TCG_TSS_QUIRK";

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
            // KVM_SET_XSAVE reads as many bytes as this vCPU's XSAVE area, which its CPUID
            // sizes: on a new VM `s.cpuid`, set above; on a reset the template's, which is
            // `s` (the warm pool holds only VMs with their template's CPUID: session files
            // are checked against it, `session_file::check`). Checked here, not assumed.
            if !crate::session_file::xsave_fits(&s.cpuid) {
                return Err(SnapshotError::XsaveTooLarge);
            }
            // SAFETY: `xsave` is a whole 4 KiB `kvm_xsave`, and KVM reads no more than the
            // XSAVE area of this vCPU's CPUID, which was just checked to fit in 4 KiB.
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
pub(crate) fn set_clock(vm: &VmFd, s: &MachineState) -> Result<(), SnapshotError> {
    pin_clock(vm, &s.clock)
}

/// Sets the VM's kvm-clock to `clock` (flags cleared, as [`set_clock`]): a session's clock
/// where its last request stopped.
pub(crate) fn pin_clock(vm: &VmFd, clock: &kvm_clock_data) -> Result<(), SnapshotError> {
    let clock = kvm_clock_data { flags: 0, ..*clock };
    res("KVM_SET_CLOCK", vm.set_clock(&clock))
}

/// The value of MSR `index` among `msrs` (a capture).
fn msr(msrs: &[kvm_bindings::kvm_msr_entry], index: u32) -> Option<u64> {
    msrs.iter().find(|e| e.index == index).map(|e| e.data)
}

/// How far the guest's TSC-deadline timer was ahead of its TSC in a capture's `msrs`: None
/// when it was off (0) or already due.
pub(crate) fn timer_ahead_of(msrs: &[kvm_bindings::kvm_msr_entry]) -> Option<u64> {
    let (tsc, deadline) = (msr(msrs, MSR_IA32_TSC)?, msr(msrs, MSR_IA32_TSC_DEADLINE)?);
    deadline.checked_sub(tsc).filter(|_| deadline != 0)
}

/// The vCPU's MSRs `indices` now, in order; None if KVM gave fewer.
fn read_msrs<const N: usize>(
    vcpu: &VcpuFd,
    indices: [u32; N],
) -> Result<Option<[kvm_bindings::kvm_msr_entry; N]>, SnapshotError> {
    let entries = indices.map(|index| kvm_bindings::kvm_msr_entry {
        index,
        ..Default::default()
    });
    let mut msrs = Msrs::from_entries(&entries).map_err(|_| SnapshotError::TooManyEntries)?;
    if cap("KVM_GET_MSRS", vcpu.get_msrs(&mut msrs))? != N {
        return Ok(None);
    }
    Ok(msrs.as_slice().try_into().ok())
}

/// [`timer_ahead_of`] the vCPU as it is now (a session parked after a request).
pub(crate) fn timer_ahead(vcpu: &VcpuFd) -> Result<Option<u64>, SnapshotError> {
    let now = read_msrs(vcpu, [MSR_IA32_TSC, MSR_IA32_TSC_DEADLINE])?;
    Ok(now.and_then(|now| timer_ahead_of(&now)))
}

/// Re-arms the guest's TSC-deadline timer `ahead` TSC ticks ahead of its TSC now (None:
/// leaves it), right before a VM whose kvm-clock was pinned resumes for a request.
///
/// Why: the kvm-clock is pinned where the guest last stopped ([`set_clock`], [`pin_clock`]),
/// but the TSC is not: it ran on while the VM waited (a clone in the pool or reset in place,
/// a session between requests), so the deadline the guest had programmed (its next tick, up
/// to 40 ms ahead) is in the past when it resumes, and the timer fires at once. The guest's
/// handler then finds no timer due (its clock says no time passed) and programs the same
/// deadline again: ~450 emulated guest-kernel instructions per request on kvm_pvm, 627 of a
/// Python job's 628 (`perf record -e kvm:kvm_emulate_insn`, symbolized: `hrtimer_interrupt`,
/// `clockevents_program_event`, `lapic_next_deadline`...). Re-armed, the timer fires when the
/// guest's own clock reaches what it asked for, as in a VM that resumed the instant it
/// stopped.
pub(crate) fn rearm_timer(vcpu: &VcpuFd, ahead: Option<u64>) -> Result<(), SnapshotError> {
    let Some(ahead) = ahead else {
        return Ok(());
    };
    let Some([tsc]) = read_msrs(vcpu, [MSR_IA32_TSC])? else {
        return Ok(());
    };
    let rearmed = Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: MSR_IA32_TSC_DEADLINE,
        data: tsc.data.saturating_add(ahead),
        ..Default::default()
    }])
    .map_err(|_| SnapshotError::TooManyEntries)?;
    res("KVM_SET_MSRS", vcpu.set_msrs(&rearmed)).map(drop)
}

/// [`rearm_timer`] as far ahead as the timer was in the capture `s` (a clone at READY).
pub(crate) fn rearm_deadline_timer(vcpu: &VcpuFd, s: &MachineState) -> Result<(), SnapshotError> {
    rearm_timer(vcpu, timer_ahead_of(&s.msrs))
}

/// The VM's kvm-clock now.
pub(crate) fn read_clock(vm: &VmFd) -> Result<kvm_clock_data, SnapshotError> {
    cap("KVM_GET_CLOCK", vm.get_clock())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msrs(tsc: u64, deadline: u64) -> Vec<kvm_bindings::kvm_msr_entry> {
        [
            (MSR_IA32_TSC, tsc),
            (0x1b, 0xfee0_0900),
            (MSR_IA32_TSC_DEADLINE, deadline),
        ]
        .into_iter()
        .map(|(index, data)| kvm_bindings::kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect()
    }

    #[test]
    fn a_timer_is_re_armed_as_far_ahead_as_it_was_unless_off_or_due() {
        assert_eq!(timer_ahead_of(&msrs(1_000, 81_000)), Some(80_000));
        assert_eq!(timer_ahead_of(&msrs(1_000, 0)), None, "off");
        assert_eq!(timer_ahead_of(&msrs(1_000, 999)), None, "due already");
        assert_eq!(timer_ahead_of(&msrs(1_000, 1_000)), Some(0), "due now");
        assert_eq!(
            timer_ahead_of(&msrs(1_000, 81_000)[..2]),
            None,
            "not captured"
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
}
