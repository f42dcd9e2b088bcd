//! What kind of `/dev/kvm` this host has, and what that means for the guest.
//!
//! bud runs on two kinds of host:
//! - **hardware virtualization** (VMX or SVM, `kvm_intel`/`kvm_amd`): the guest kernel runs
//!   natively and may use every CPU feature KVM offers (XSAVE, AVX, ...);
//! - **kvm_pvm** (the PVM software hypervisor): guest user mode runs natively but guest kernel
//!   mode is run by an instruction emulator that lacks some instructions (the xsave family,
//!   `popcnt`, `clac`/`stac`, ...), and `KVM_SET_CPUID2` cannot hide leaves 1 and 7 from the
//!   guest (kvm_pvm ORs the host's bits back in). The guest kernel must then be told on its
//!   command line not to use those features.
//!
//! The kind is detected, never assumed: a loaded `kvm_pvm` module means PVM. The PVM-only knobs
//! are applied only there, and the kind is part of every template's identity. Everything that
//! differs between the two kinds (command line, CPUID, MSRs, FPU state, paging) and how the
//! hardware path is tested on a machine without it: docs/platform.md.

use std::fmt;
use std::path::Path;

/// The virtualization backend behind `/dev/kvm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum HostKind {
    /// Hardware-assisted KVM (VMX or SVM).
    Hardware,
    /// The kvm_pvm software hypervisor.
    Pvm,
}

/// Kernel command-line options for a guest on kvm_pvm.
///
/// The first ones keep the guest kernel away from the CPU features the kvm_pvm instruction
/// emulator cannot run (CPUID masking alone is not enough there, see module doc). The last
/// three, `bud.host_zero`, `bud.host_copy` and `bud.host_random`, switch on guest kernel
/// patches 0009, 0013 and 0016: the VMM zeroes fresh memory, does user<->kernel copies of
/// 512 bytes and more, and fills `getrandom`/`/dev/urandom` reads of any size from
/// the host's CSPRNG (see [`crate::devices::host_zero`], [`crate::devices::host_copy`] and
/// [`crate::devices::host_random`]), work that kvm_pvm otherwise emulates one `rep stos`/
/// `rep movs` iteration or one ChaCha20 round at a time. On hardware virtualization the
/// guest does all three natively, faster than an exit to the VMM, so they are kvm_pvm's
/// only.
pub(crate) const PVM_CMDLINE_KNOBS: &str = "noxsave nopcid noinvpcid nofsgsbase \
clearcpuid=smap,smep,fsgsbase,erms,fsrm,popcnt,rdrand,rdseed,rdpid,rdtscp,serialize,\
clflushopt,clwb,pcid,invpcid,avx,avx2,avx512f,xsave,rtm,hle,movbe \
bud.host_zero bud.host_copy bud.host_random";

/// Environment switch for one experiment only (docs/measurements.md, session 21): set to 1,
/// a kvm_pvm guest is booted with XSAVE and AVX offered ([`PVM_XSAVE_EXPERIMENT_KNOBS`]
/// instead of [`PVM_CMDLINE_KNOBS`], and CPUID's XSAVE/AVX bits and leaf 0xD kept), to see
/// what kvm_pvm does with such a guest. Not a supported mode: snapshots on kvm_pvm carry
/// the legacy FPU state only.
pub const PVM_XSAVE_EXPERIMENT_ENV: &str = "BUD_EXPERIMENT_PVM_XSAVE";

/// [`PVM_CMDLINE_KNOBS`] without `noxsave` and without `avx,avx2,avx512f,xsave` in
/// `clearcpuid` (the experiment of [`PVM_XSAVE_EXPERIMENT_ENV`]).
const PVM_XSAVE_EXPERIMENT_KNOBS: &str = "nopcid noinvpcid nofsgsbase \
clearcpuid=smap,smep,fsgsbase,erms,fsrm,popcnt,rdrand,rdseed,rdpid,rdtscp,serialize,\
clflushopt,clwb,pcid,invpcid,rtm,hle,movbe \
bud.host_zero bud.host_copy bud.host_random";

/// Whether the XSAVE experiment is switched on in this process's environment.
pub(crate) fn pvm_xsave_experiment() -> bool {
    std::env::var_os(PVM_XSAVE_EXPERIMENT_ENV).is_some_and(|v| v == "1")
}

impl HostKind {
    /// Detects the kind of this host from `/sys/module`.
    pub fn detect() -> Self {
        Self::detect_in(Path::new("/sys/module"))
    }

    /// Detection against a given sysfs module directory (for tests).
    pub(crate) fn detect_in(sys_module: &Path) -> Self {
        if sys_module.join("kvm_pvm").exists() {
            HostKind::Pvm
        } else {
            HostKind::Hardware
        }
    }

    /// Whether KVM translates guest memory through shadow page tables built from the guest's
    /// own page tables (kvm_pvm always; hardware when EPT/NPT is off), rather than through
    /// two-dimensional paging (EPT/NPT). Under shadow paging, a host write into a guest
    /// page-table page leaves KVM's shadow of it stale, so a reset must drop KVM's mappings.
    /// Read from `/sys/module`; unknown means yes (the safe answer).
    pub fn shadow_paging(self) -> bool {
        Self::shadow_paging_in(self, Path::new("/sys/module"))
    }

    /// [`HostKind::shadow_paging`] against a given sysfs module directory (for tests).
    pub(crate) fn shadow_paging_in(self, sys_module: &Path) -> bool {
        if self == HostKind::Pvm {
            return true;
        }
        let on = |module: &str, param: &str| {
            std::fs::read_to_string(sys_module.join(module).join("parameters").join(param))
                .map(|v| matches!(v.trim(), "Y" | "y" | "1"))
                .unwrap_or(false)
        };
        !(on("kvm_intel", "ept") || on("kvm_amd", "npt"))
    }

    /// Extra kernel command-line options this host kind needs.
    pub(crate) fn cmdline_knobs(self) -> &'static str {
        match self {
            HostKind::Hardware => "",
            HostKind::Pvm if pvm_xsave_experiment() => PVM_XSAVE_EXPERIMENT_KNOBS,
            HostKind::Pvm => PVM_CMDLINE_KNOBS,
        }
    }

    /// A short stable name, used in template keys and reports.
    pub fn name(self) -> &'static str {
        match self {
            HostKind::Hardware => "hardware",
            HostKind::Pvm => "pvm",
        }
    }
}

impl fmt::Display for HostKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_pvm_module_means_pvm_and_its_absence_means_hardware() {
        let dir = std::env::temp_dir().join(format!("bud-host-test-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("kvm")).unwrap();

        let without = HostKind::detect_in(&dir);
        std::fs::create_dir_all(dir.join("kvm_pvm")).unwrap();
        let with = HostKind::detect_in(&dir);
        std::fs::remove_dir_all(&dir).unwrap();

        assert_eq!(without, HostKind::Hardware);
        assert_eq!(with, HostKind::Pvm);
    }

    #[test]
    fn shadow_paging_unless_ept_or_npt_is_on() {
        let dir = std::env::temp_dir().join(format!("bud-tdp-test-{}", std::process::id()));
        let params = dir.join("kvm_intel").join("parameters");
        std::fs::create_dir_all(&params).unwrap();

        let unknown = HostKind::Hardware.shadow_paging_in(&dir);
        std::fs::write(params.join("ept"), "Y\n").unwrap();
        let ept = HostKind::Hardware.shadow_paging_in(&dir);
        let pvm = HostKind::Pvm.shadow_paging_in(&dir);
        std::fs::write(params.join("ept"), "N\n").unwrap();
        let no_ept = HostKind::Hardware.shadow_paging_in(&dir);
        std::fs::remove_dir_all(&dir).unwrap();

        assert!(unknown);
        assert!(!ept);
        assert!(pvm);
        assert!(no_ept);
    }

    #[test]
    fn only_pvm_gets_the_feature_knobs() {
        assert_eq!(HostKind::Hardware.cmdline_knobs(), "");
        assert!(HostKind::Pvm.cmdline_knobs().contains("noxsave"));
        assert!(HostKind::Pvm.cmdline_knobs().contains("clearcpuid=smap"));
    }

    #[test]
    fn the_host_work_switches_are_pvm_only() {
        for switch in ["bud.host_zero", "bud.host_copy", "bud.host_random"] {
            assert!(
                HostKind::Pvm
                    .cmdline_knobs()
                    .split(' ')
                    .any(|w| w == switch)
            );
            assert!(!HostKind::Hardware.cmdline_knobs().contains(switch));
        }
    }
}
