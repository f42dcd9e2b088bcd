//! The CPUID table a guest vCPU sees.
//!
//! Starts from `KVM_GET_SUPPORTED_CPUID` (fetched once per process: the ioctl costs ~0.5 ms)
//! and applies bud's policy: one logical CPU, the hypervisor bit set, no machine-check or
//! performance-monitoring features (bud emulates neither), only the KVM paravirtual features a
//! single-vCPU throwaway guest needs (kvm-clock and PV EOI), and no interface through which
//! guest code could drive a hypervisor of its own: VMX, SMX and SVM are cleared with SVM's
//! feature leaf 0x8000_000A, and so are the memory-encryption leaf 0x8000_001F (SME/SEV, for
//! a host launching encrypted guests) and SKINIT. KVM makes nested virtualization depend on
//! these bits (`kvm_intel`'s VMX MSRs and VMXON, `kvm_amd`'s EFER.SVME and VMRUN refuse a
//! guest whose CPUID lacks them), and `kvm_amd` offers nested SVM by default; so hiding them
//! both hides the interface and turns it off. The same policy applies on both host kinds.
//! On kvm_pvm it also clears what the guest kernel's emulated mode cannot execute; kvm_pvm
//! ignores part of that (see [`crate::host`]), so the kernel command line carries the same
//! policy.

use std::sync::OnceLock;

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES, kvm_cpuid_entry2};
use kvm_ioctls::Kvm;

use crate::host::HostKind;

/// Errors of building the CPUID table.
#[derive(Debug, thiserror::Error)]
pub enum CpuidError {
    #[error("KVM_GET_SUPPORTED_CPUID failed: {0}")]
    GetSupported(kvm_ioctls::Error),
}

// Leaf 1 ECX bits.
const L1_ECX_VMX: u32 = 1 << 5;
const L1_ECX_SMX: u32 = 1 << 6;
const L1_ECX_CX16: u32 = 1 << 13;
const L1_ECX_POPCNT: u32 = 1 << 23;
const L1_ECX_XSAVE: u32 = 1 << 26;
const L1_ECX_OSXSAVE: u32 = 1 << 27;
const L1_ECX_AVX: u32 = 1 << 28;
const L1_ECX_RDRAND: u32 = 1 << 30;
const L1_ECX_HYPERVISOR: u32 = 1 << 31;
// Leaf 1 EDX bits.
const L1_EDX_MCE: u32 = 1 << 7;
const L1_EDX_MCA: u32 = 1 << 14;
const L1_EDX_HTT: u32 = 1 << 28;
// Leaf 7 EDX and leaf 0xd XCR0 bits of AMX.
const L7_EDX_AMX_BF16: u32 = 1 << 22;
const L7_EDX_AMX_TILE: u32 = 1 << 24;
const L7_EDX_AMX_INT8: u32 = 1 << 25;
const XCR0_TILECFG: u32 = 1 << 17;
const XCR0_TILEDATA: u32 = 1 << 18;
// Leaf 0x8000_0001 bits.
const EXT_ECX_SVM: u32 = 1 << 2;
const EXT_ECX_LZCNT: u32 = 1 << 5;
const EXT_ECX_PREFETCHW: u32 = 1 << 8;
const EXT_ECX_SKINIT: u32 = 1 << 12;
const EXT_EDX_PAGE1GB: u32 = 1 << 26;
const EXT_EDX_RDTSCP: u32 = 1 << 27;
/// KVM paravirtual features kept (leaf 0x4000_0001 EAX): CLOCKSOURCE (0), NOP_IO_DELAY (1),
/// CLOCKSOURCE2 (3), PV_EOI (6) and CLOCKSOURCE_STABLE_BIT (24). Async page faults, steal
/// time, PV TLB flush, PV spinlocks and friends are for long-lived multi-vCPU guests.
const KVM_FEATURES_KEPT: u32 = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 6) | (1 << 24);

static SUPPORTED: OnceLock<CpuId> = OnceLock::new();

/// `KVM_GET_SUPPORTED_CPUID`, asked once per process.
pub(crate) fn supported(kvm: &Kvm) -> Result<&'static CpuId, CpuidError> {
    if let Some(c) = SUPPORTED.get() {
        return Ok(c);
    }
    let c = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(CpuidError::GetSupported)?;
    Ok(SUPPORTED.get_or_init(|| c))
}

/// The guest's CPUID table for a host of `kind`.
pub fn guest_cpuid(kvm: &Kvm, kind: HostKind) -> Result<CpuId, CpuidError> {
    let mut cpuid = supported(kvm)?.clone();
    let experiment = kind == HostKind::Pvm && crate::host::pvm_xsave_experiment();
    for entry in cpuid.as_mut_slice() {
        let kept = (entry.function == 1).then_some(entry.ecx & (L1_ECX_XSAVE | L1_ECX_AVX));
        let leaf_d = *entry;
        apply_policy(entry, kind);
        // The XSAVE experiment (crate::host::PVM_XSAVE_EXPERIMENT_ENV): XSAVE, AVX and the
        // XSAVE leaf as the hardware policy leaves them.
        if experiment {
            if let Some(bits) = kept {
                entry.ecx |= bits;
            }
            if entry.function == 0xd {
                *entry = leaf_d;
                apply_policy(entry, HostKind::Hardware);
            }
        }
    }
    Ok(cpuid)
}

fn zero(e: &mut kvm_cpuid_entry2) {
    e.eax = 0;
    e.ebx = 0;
    e.ecx = 0;
    e.edx = 0;
}

/// bud's CPUID policy for one entry.
pub(crate) fn apply_policy(e: &mut kvm_cpuid_entry2, kind: HostKind) {
    let pvm = kind == HostKind::Pvm;
    match e.function {
        1 => {
            // EBX[31:24] initial APIC id 0, EBX[23:16] one logical processor.
            e.ebx = (e.ebx & 0x0000_ffff) | (1 << 16);
            e.ecx |= L1_ECX_HYPERVISOR;
            e.ecx &= !L1_ECX_OSXSAVE; // reflects CR4.OSXSAVE; the guest kernel sets it
            e.ecx &= !(L1_ECX_VMX | L1_ECX_SMX);
            e.edx &= !(L1_EDX_MCE | L1_EDX_MCA | L1_EDX_HTT);
            if pvm {
                e.ecx &= !(L1_ECX_CX16 | L1_ECX_POPCNT | L1_ECX_XSAVE | L1_ECX_AVX | L1_ECX_RDRAND);
            }
        }
        // Deterministic cache parameters: one core, one thread per cache.
        4 => e.eax &= 0x3fff,
        // Thermal/power management, architectural PMU: not emulated.
        6 | 0xa => zero(e),
        // Structured extended features and XSAVE state: the PVM emulator lacks the
        // instructions behind most of them (smap's clac/stac, xsave, fsgsbase, ...).
        7 | 0xd if pvm => zero(e),
        // SGX and processor trace: never for a sandbox.
        0x12 | 0x14 => zero(e),
        // x2APIC topology: we are x2APIC id 0.
        0xb | 0x1f => e.edx = 0,
        0x8000_0001 => {
            e.ecx &= !(EXT_ECX_SVM | EXT_ECX_SKINIT);
            if pvm {
                e.ecx &= !(EXT_ECX_LZCNT | EXT_ECX_PREFETCHW);
                e.edx &= !(EXT_EDX_PAGE1GB | EXT_EDX_RDTSCP);
            }
        }
        // SVM's features (revision, ASIDs, nested paging, ...) and SME/SEV's.
        0x8000_000a | 0x8000_001f => zero(e),
        // AMX tile state does not fit the 4 KiB `kvm_xsave` area snapshots carry.
        7 if e.index == 0 => e.edx &= !(L7_EDX_AMX_BF16 | L7_EDX_AMX_TILE | L7_EDX_AMX_INT8),
        0xd if e.index == 0 => e.eax &= !(XCR0_TILECFG | XCR0_TILEDATA),
        0x4000_0001 => e.eax &= KVM_FEATURES_KEPT,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: u32::MAX,
            ebx: u32::MAX,
            ecx: u32::MAX,
            edx: u32::MAX,
            ..Default::default()
        }
    }

    #[test]
    fn leaf1_reports_one_cpu_apic_id_0_and_a_hypervisor() {
        let mut e = entry(1, 0);

        apply_policy(&mut e, HostKind::Hardware);

        assert_eq!(e.ebx >> 24, 0);
        assert_eq!((e.ebx >> 16) & 0xff, 1);
        assert_ne!(e.ecx & L1_ECX_HYPERVISOR, 0);
        assert_eq!(e.edx & (L1_EDX_MCE | L1_EDX_MCA | L1_EDX_HTT), 0);
    }

    #[test]
    fn hardware_keeps_xsave_and_avx_but_pvm_clears_them() {
        let mut hw = entry(1, 0);
        let mut pvm = entry(1, 0);
        let mut hw7 = entry(7, 0);
        let mut pvm7 = entry(7, 0);

        apply_policy(&mut hw, HostKind::Hardware);
        apply_policy(&mut pvm, HostKind::Pvm);
        apply_policy(&mut hw7, HostKind::Hardware);
        apply_policy(&mut pvm7, HostKind::Pvm);

        assert_ne!(hw.ecx & (L1_ECX_XSAVE | L1_ECX_AVX), 0);
        assert_eq!(
            pvm.ecx & (L1_ECX_XSAVE | L1_ECX_AVX | L1_ECX_POPCNT | L1_ECX_CX16),
            0
        );
        assert_eq!(hw7.ebx, u32::MAX);
        assert_eq!((pvm7.eax, pvm7.ebx, pvm7.ecx, pvm7.edx), (0, 0, 0, 0));
    }

    /// Neither kind of host offers the guest a virtualization interface (VMX, SMX, SVM with
    /// its feature leaf, SKINIT, SME/SEV), whatever KVM reports as supported.
    #[test]
    fn no_host_kind_offers_a_virtualization_interface() {
        for kind in [HostKind::Hardware, HostKind::Pvm] {
            let mut l1 = entry(1, 0);
            let mut ext = entry(0x8000_0001, 0);
            let mut svm = entry(0x8000_000a, 0);
            let mut sev = entry(0x8000_001f, 0);

            apply_policy(&mut l1, kind);
            apply_policy(&mut ext, kind);
            apply_policy(&mut svm, kind);
            apply_policy(&mut sev, kind);

            assert_eq!(l1.ecx & (L1_ECX_VMX | L1_ECX_SMX), 0, "{kind}: VMX/SMX");
            assert_eq!(ext.ecx & (EXT_ECX_SVM | EXT_ECX_SKINIT), 0, "{kind}: SVM");
            assert_eq!((svm.eax, svm.ebx, svm.ecx, svm.edx), (0, 0, 0, 0), "{kind}");
            assert_eq!((sev.eax, sev.ebx, sev.ecx, sev.edx), (0, 0, 0, 0), "{kind}");
        }
    }

    /// Hiding SVM does not take the other extended features with it on hardware.
    #[test]
    fn hardware_keeps_the_other_extended_features() {
        let mut ext = entry(0x8000_0001, 0);

        apply_policy(&mut ext, HostKind::Hardware);

        assert_eq!(ext.ecx, !(EXT_ECX_SVM | EXT_ECX_SKINIT));
        assert_eq!(ext.edx, u32::MAX);
    }

    #[test]
    fn kvm_paravirt_features_are_limited_to_the_clock_and_pv_eoi() {
        let mut e = entry(0x4000_0001, 0);

        apply_policy(&mut e, HostKind::Pvm);

        assert_eq!(e.eax, KVM_FEATURES_KEPT);
    }
}
