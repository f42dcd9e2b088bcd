//! What to boot: [`BootConfig`] (kernel, initramfs, RAM, limits, whether the VM has a network
//! card) and the kernel command line it makes.

use std::path::PathBuf;
use std::time::Duration;

use crate::host::HostKind;

/// Kernel command line every bud guest gets. `reboot=k`: reboot through the i8042 reset line
/// (the VMM's "stop"; the triple-fault path `reboot=t` needs `int3`, which kvm_pvm's emulator
/// lacks). `panic=-1`: a panic reboots at once, so a crashed guest stops instead of hanging.
/// `tsc=reliable`: no clocksource watchdog (one vCPU, nothing to compare against).
/// `retain_initrd`: do not hand the initramfs pages back to the allocator after unpacking;
/// freeing them page by page cost ~3 s of emulated kernel time (measured with
/// `bud boot --profile`: the kernel poisons each freed page). Retained, the guest never
/// reads them again, so the VMM zeroes them at READY (`boot()`) and the template's memory
/// file, which skips zero pages, does not hold the image a second time (the node template's
/// file was 291.7 MiB with its 118 MiB image there).
/// `initramfs_options=huge=within_size`: the root tmpfs the kernel unpacks the image into
/// takes large folios (2 MiB where a file covers them; below that the 16 KiB-1 MiB folios of
/// guest kernel patch 0014), so each file costs a few folio allocations and page-cache
/// insertions instead of one per 4 KiB page: the python template's first boot went from 61.9 M
/// to 46.2 M emulated guest-kernel instructions (docs/measurements.md, session 22). A kernel
/// that did not know the option would pass it to init as an environment variable and mount
/// the root with small pages; `tests/jobs.rs` checks the root's mount options in a clone.
pub(crate) const BASE_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 tsc=reliable clocksource=kvm-clock 8250.nr_uarts=1 retain_initrd initramfs_options=huge=within_size";
/// Added for a VM with a network card ([`BootConfig::network`]): the card's MMIO window and
/// IRQ ([`crate::layout::VIRTIO_NET_MMIO_BASE`], [`crate::layout::VIRTIO_NET_IRQ`]; needs
/// `VIRTIO_MMIO_CMDLINE_DEVICES`), and eth0's static address, gateway and netmask, set by the
/// kernel before init (`IP_PNP`, no DHCP: every clone is alone on its own link with the same
/// address; [`crate::net`] is the other end). A VM without a card gets neither.
pub(crate) const NIC_CMDLINE: &str = "virtio_mmio.device=4K@0xd0000000:5 \
    ip=10.0.2.15::10.0.2.2:255.255.255.0:bud:eth0:off";
/// Added unless kernel messages are wanted: each console byte costs a port exit.
pub(crate) const QUIET_CMDLINE: &str = "quiet";

/// Default guest RAM.
pub const DEFAULT_RAM_SIZE: u64 = 256 << 20;
/// Default limit from the first instruction to READY. The boot is guest-kernel work, which
/// kvm_pvm emulates: the python template's READY came at ~11 s on a quiet machine and at
/// 88-91 s on 2026-11-28 (57.7 M emulated instructions at ~0.6 M/s, a test and a build
/// beside it), so a limit of a few minutes failed whole test binaries on a busy machine.
/// A hung boot is the rare case; it waits this long once, then says what the console
/// showed.
pub const DEFAULT_BOOT_TIMEOUT: Duration = Duration::from_secs(600);

/// What to boot.
#[derive(Debug, Clone)]
pub struct BootConfig {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub ram_size: u64,
    pub timeout: Duration,
    pub host_kind: HostKind,
    /// Keep kernel messages on the console (drops `quiet`).
    pub kernel_messages: bool,
    /// Appended to the command line.
    pub extra_cmdline: String,
    /// Give the VM a virtio-net card ([`crate::net`]); its template then holds the card's
    /// state, and every clone of it has the card. Off by default: no card, no route out.
    pub network: bool,
    /// Sample the guest's instruction pointer this often (a diagnostic: every sample kicks the
    /// vCPU out of the guest, so a boot with sampling is slower).
    pub profile_interval: Option<Duration>,
}

impl BootConfig {
    /// Defaults for this host around a kernel and an initramfs.
    pub fn new(kernel: impl Into<PathBuf>, initramfs: impl Into<PathBuf>) -> Self {
        Self {
            kernel: kernel.into(),
            initramfs: initramfs.into(),
            ram_size: DEFAULT_RAM_SIZE,
            timeout: DEFAULT_BOOT_TIMEOUT,
            host_kind: HostKind::detect(),
            kernel_messages: false,
            extra_cmdline: String::new(),
            network: false,
            profile_interval: None,
        }
    }

    /// The full kernel command line.
    pub fn cmdline(&self) -> String {
        let mut parts = vec![BASE_CMDLINE];
        if !self.kernel_messages {
            parts.push(QUIET_CMDLINE);
        }
        parts.push(self.host_kind.cmdline_knobs());
        if self.network {
            parts.push(NIC_CMDLINE);
        }
        parts.push(&self.extra_cmdline);
        parts.retain(|p| !p.is_empty());
        parts.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pvm_cmdline_carries_the_knobs_and_hardware_does_not() {
        let mut cfg = BootConfig::new("k", "i");
        cfg.host_kind = HostKind::Pvm;
        let pvm = cfg.cmdline();
        cfg.host_kind = HostKind::Hardware;
        let hw = cfg.cmdline();

        assert!(pvm.starts_with(BASE_CMDLINE));
        assert!(pvm.contains("clearcpuid="));
        assert!(!hw.contains("clearcpuid="));
        assert!(hw.ends_with(" quiet"));
    }

    #[test]
    fn kernel_messages_drop_quiet_and_extra_goes_last() {
        let mut cfg = BootConfig::new("k", "i");
        cfg.host_kind = HostKind::Hardware;
        cfg.kernel_messages = true;
        cfg.extra_cmdline = "foo=bar".into();

        assert_eq!(cfg.cmdline(), format!("{BASE_CMDLINE} foo=bar"));
    }

    #[test]
    fn only_a_vm_with_a_network_card_names_it_on_the_command_line() {
        use crate::layout::{VIRTIO_NET_IRQ, VIRTIO_NET_MMIO_BASE, VIRTIO_NET_MMIO_SIZE};
        let mut cfg = BootConfig::new("k", "i");
        let without = cfg.cmdline();
        cfg.network = true;
        let with = cfg.cmdline();

        assert!(!without.contains("virtio_mmio") && !without.contains(" ip="));
        let device = format!(
            "virtio_mmio.device={}K@{VIRTIO_NET_MMIO_BASE:#x}:{VIRTIO_NET_IRQ}",
            VIRTIO_NET_MMIO_SIZE / 1024
        );
        assert!(with.contains(&device), "{with}");
        assert!(with.contains(" ip=10.0.2.15::10.0.2.2:255.255.255.0:bud:eth0:off"));
    }
}
