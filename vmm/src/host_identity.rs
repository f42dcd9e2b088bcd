//! The identity of this host's CPU and KVM, as far as a snapshot depends on it.
//!
//! A template holds vCPU state (registers, MSRs, XSAVE area, LAPIC, clocks) captured under
//! this host's CPU and KVM. Restored where those differ, it could run with features the CPU
//! lacks, MSRs KVM refuses or an XSAVE layout of another size. So the identity is a digest
//! of what KVM reports about them: the supported CPUID entries, the MSR lists (saved and
//! feature MSRs), the XSAVE area size (`KVM_CAP_XSAVE2`) and the capabilities bud's
//! snapshot uses, plus the host kind. It is part of every template's key (another identity
//! gets another template, built on its host) and stored in the template, which refuses to
//! load where it differs ([`crate::template::TemplateError::WrongIdentity`]).

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Cap, Kvm};
use sha2::{Digest, Sha256};

use crate::host::HostKind;

/// Capabilities whose presence or value the snapshot and restore path depends on.
const CAPS: [Cap; 12] = [
    Cap::AdjustClock,
    Cap::VcpuEvents,
    Cap::Debugregs,
    Cap::Xsave,
    Cap::Xsave2,
    Cap::Xcrs,
    Cap::TscControl,
    Cap::GetTscKhz,
    Cap::TscDeadlineTimer,
    Cap::X2ApicApi,
    Cap::Irqchip,
    Cap::ImmediateExit,
];

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("reading KVM's {what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
}

/// The identity of `kvm` on a host of `kind`: 24 hex digits of a SHA-256 (module docs).
pub(crate) fn host_identity(kvm: &Kvm, kind: HostKind) -> Result<String, IdentityError> {
    let err = |what| move |source| IdentityError::Kvm { what, source };
    let mut h = Sha256::new();
    h.update(b"bud-host-identity\0");
    h.update(kind.name().as_bytes());
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(err("supported CPUID"))?;
    let mut entries: Vec<_> = cpuid
        .as_slice()
        .iter()
        .map(|e| {
            let (mut eax, mut ebx, mut ecx, mut edx) = (e.eax, e.ebx, e.ecx, e.edx);
            // The APIC ids of the CPU this thread happens to run on (measured: leaf 1 EBX's
            // top byte and leaf 0xB's EDX differ between this host's two cores): not part
            // of what a snapshot depends on (bud sets its vCPU's own).
            match e.function {
                0x1 => ebx &= 0x00ff_ffff,
                0xb | 0x1f => edx = 0,
                0x8000_001e => (eax, ebx, ecx) = (0, 0, 0),
                _ => {}
            }
            (e.function, e.index, e.flags, eax, ebx, ecx, edx)
        })
        .collect();
    entries.sort_unstable();
    for e in entries {
        for word in [e.0, e.1, e.2, e.3, e.4, e.5, e.6] {
            h.update(word.to_le_bytes());
        }
    }
    h.update(b"msrs\0");
    let mut msrs = kvm
        .get_msr_index_list()
        .map_err(err("MSR list"))?
        .as_slice()
        .to_vec();
    msrs.sort_unstable();
    for m in msrs {
        h.update(m.to_le_bytes());
    }
    h.update(b"feature-msrs\0");
    // Older kernels lack the feature MSR list: its absence is part of the identity too.
    if let Ok(list) = kvm.get_msr_feature_index_list() {
        let mut features = list.as_slice().to_vec();
        features.sort_unstable();
        for m in features {
            h.update(m.to_le_bytes());
        }
    }
    h.update(b"caps\0");
    for cap in CAPS {
        h.update(kvm.check_extension_int(cap).to_le_bytes());
    }
    let digest = h.finalize();
    Ok(digest.iter().take(12).map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The identity is the same on every core (per-core APIC ids are left out).
    #[test]
    fn the_identity_is_the_same_on_every_cpu() {
        let kvm = Kvm::new().expect("/dev/kvm is needed for this test");
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut seen = std::collections::BTreeSet::new();
        for cpu in 0..cpus {
            // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it;
            // sched_setaffinity reads it for this thread only.
            let pinned = unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
            };
            assert!(pinned, "cannot pin this thread to CPU {cpu}");
            seen.insert(host_identity(&kvm, HostKind::detect()).unwrap());
        }
        assert_eq!(seen.len(), 1, "{seen:?}");
    }

    #[test]
    fn the_identity_is_stable_and_depends_on_the_host_kind() {
        let kvm = Kvm::new().expect("/dev/kvm is needed for this test");
        let a = host_identity(&kvm, HostKind::detect()).unwrap();
        let b = host_identity(&kvm, HostKind::detect()).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 24);
        let other = match HostKind::detect() {
            HostKind::Pvm => HostKind::Hardware,
            HostKind::Hardware => HostKind::Pvm,
        };
        assert_ne!(a, host_identity(&kvm, other).unwrap());
    }
}
