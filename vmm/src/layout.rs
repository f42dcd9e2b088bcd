//! The guest's physical address map, I/O ports and IRQ lines: every fixed number the VMM and
//! the guest agree on lives here, documented once.
//!
//! Low memory (below 1 MiB) holds what the VMM writes before the first instruction; the kernel
//! is loaded at [`HIMEM_START`] and the initramfs at the top of RAM.
//!
//! ```text
//! 0x0000_0500  boot GDT                       0x0000_9000  PML4
//! 0x0000_0520  boot IDT (empty)               0x0000_a000  PDPT
//! 0x0000_6000  setup_data (RNG seed)          0x0000_b000  4 page directories (2 MiB pages)
//! 0x0000_7000  zero page (boot_params)        0x0002_0000  kernel command line
//! 0x0000_8ff0  boot stack (grows down)        0x0009_fc00  MP table (e820 reserved)
//! 0x000f_0000  BIOS area (e820 reserved)      0x0010_0000  kernel (ELF vmlinux)
//! top of RAM   initramfs (page aligned)       0xd000_0000  virtio-net MMIO window (NIC VMs)
//!                                             0xfec0_0000  IOAPIC, 0xfee0_0000 LAPIC
//! ```

/// Boot GDT: null, null, 64-bit code, data, TSS descriptors.
pub(crate) const BOOT_GDT_START: u64 = 0x500;
/// An empty IDT: no exception can be delivered before the kernel installs its own.
pub(crate) const BOOT_IDT_START: u64 = 0x520;
/// `setup_data` chain (one `SETUP_RNG_SEED` entry).
pub(crate) const SETUP_DATA_START: u64 = 0x6000;
/// The zero page (`struct boot_params`) the kernel finds through `rsi`.
pub(crate) const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the kernel's 64-bit entry.
pub(crate) const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Level-4 page table of the boot identity mapping.
pub(crate) const PML4_START: u64 = 0x9000;
/// Page-directory-pointer table of the boot identity mapping.
pub(crate) const PDPTE_START: u64 = 0xa000;
/// First of [`BOOT_PD_COUNT`] consecutive page directories (2 MiB pages).
pub const PDE_START: u64 = 0xb000;
/// Number of page directories: 4 x 1 GiB = the low 4 GiB identity mapped.
pub(crate) const BOOT_PD_COUNT: u64 = 4;
/// Kernel command line, NUL terminated.
pub(crate) const CMDLINE_START: u64 = 0x2_0000;
/// Largest command line the VMM writes (the kernel's COMMAND_LINE_SIZE on x86_64 is 2048).
pub(crate) const CMDLINE_MAX_SIZE: usize = 2048;
/// MP floating pointer + configuration table (top 1 KiB of base memory, the EBDA).
pub(crate) const MPTABLE_START: u64 = 0x9_fc00;
/// End of the usable base memory (start of the EBDA/VGA hole).
pub(crate) const EBDA_START: u64 = 0x9_fc00;
/// The legacy BIOS ROM area the kernel may scan; reserved in the e820 map.
pub(crate) const BIOS_START: u64 = 0xf_0000;
/// Where high memory starts; the ELF kernel loads at or above it.
pub(crate) const HIMEM_START: u64 = 0x10_0000;
/// Start of the 32-bit MMIO hole: guest RAM must end at or below it.
pub(crate) const MMIO_HOLE_START: u64 = 0xc000_0000;
/// Base of the virtio-net device's MMIO window (virtio-MMIO registers, then its config space),
/// in the hole above RAM; only a VM with a network card has it (Firecracker's first window).
pub(crate) const VIRTIO_NET_MMIO_BASE: u64 = 0xd000_0000;
/// Size of that window: one page.
pub(crate) const VIRTIO_NET_MMIO_SIZE: u64 = 0x1000;
/// ISA IRQ line of the virtio-net device (free, routed to IOAPIC pin 5 by the MP table).
pub(crate) const VIRTIO_NET_IRQ: u32 = 5;
/// IOAPIC MMIO base (KVM's in-kernel IOAPIC).
pub(crate) const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC MMIO base.
pub(crate) const APIC_START: u64 = 0xfee0_0000;
/// Three pages KVM needs for the VMX real-mode TSS (Intel only; harmless elsewhere).
pub(crate) const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// One page KVM needs for the VMX identity map (Intel only; harmless elsewhere).
pub(crate) const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

/// Smallest guest RAM the VMM accepts: kernel, initramfs and a Python process must fit.
pub(crate) const MIN_RAM_SIZE: u64 = 64 << 20;
/// Largest guest RAM: everything stays below the 32-bit MMIO hole (no RAM above 4 GiB yet).
pub(crate) const MAX_RAM_SIZE: u64 = MMIO_HOLE_START;

/// COM1, the serial console: ports `SERIAL_PORT_BASE .. SERIAL_PORT_BASE + 8`.
pub(crate) const SERIAL_PORT_BASE: u16 = 0x3f8;
/// Number of 16550 registers.
pub(crate) const SERIAL_PORT_COUNT: u16 = 8;
/// ISA IRQ line of COM1.
pub(crate) const SERIAL_IRQ: u32 = 4;
/// i8042 data port (reads as 0).
pub(crate) const I8042_DATA_PORT: u16 = 0x60;
/// i8042 command/status port: the guest writes [`I8042_CMD_RESET`] here to reboot (`reboot=k`).
pub(crate) const I8042_COMMAND_PORT: u16 = 0x64;
/// The i8042 "pulse reset line" command.
pub(crate) const I8042_CMD_RESET: u8 = 0xfe;
/// Number of ISA IRQ lines routed through the IOAPIC (pins 0..16, identity mapped).
pub(crate) const ISA_IRQ_COUNT: u8 = 16;
