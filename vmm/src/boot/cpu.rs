//! The vCPU state at the kernel's 64-bit entry point: a flat GDT, identity page tables for the
//! low 4 GiB, long mode enabled, `rsi` pointing at the zero page; plus the MSR, FPU and LAPIC
//! reset values a kernel expects from firmware.
//!
//! The page tables and GDT are written into guest memory; the register values are returned as
//! KVM structs for the caller to set, so this module needs no vCPU to be tested.

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs};

use crate::layout::{
    BOOT_GDT_START, BOOT_IDT_START, BOOT_PD_COUNT, BOOT_STACK_POINTER, PDE_START, PDPTE_START,
    PML4_START, ZERO_PAGE_START,
};
use crate::memory::{GuestRam, MemoryError};

/// Boot GDT entries: null, null, 64-bit code (selector 0x10), data (0x18), TSS (0x20).
pub(crate) const BOOT_GDT: [u64; 5] = [
    0,
    0,
    0x00af_9b00_0000_ffff, // code: present, DPL0, execute/read, long mode, 4 KiB granularity
    0x00cf_9300_0000_ffff, // data: present, DPL0, read/write, 32-bit, 4 KiB granularity
    0x008f_8b00_0000_ffff, // TSS: present, busy 64-bit TSS
];
/// Selectors of the boot GDT entries.
pub(crate) const CODE_SELECTOR: u16 = 0x10;
pub(crate) const DATA_SELECTOR: u16 = 0x18;
pub(crate) const TSS_SELECTOR: u16 = 0x20;

const CR0_PE: u64 = 1 << 0;
const CR0_ET: u64 = 1 << 4;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
/// Page-table entry bits: present, writable, user; and "page size" for 2 MiB pages.
const PTE_PRESENT_RW_USER: u64 = 0x7;
const PDE_2M_PRESENT_RW: u64 = 0x83;
const RFLAGS_RESERVED_1: u64 = 1 << 1;

// MSR numbers.
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
/// IA32_MISC_ENABLE bit 0: fast string operations enabled.
const MISC_ENABLE_FAST_STRING: u64 = 1;

/// x87 control word and MXCSR after FNINIT / reset.
const FPU_FCW_DEFAULT: u16 = 0x37f;
const MXCSR_DEFAULT: u32 = 0x1f80;

/// LAPIC register offsets and LVT delivery modes.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// Converts a GDT descriptor into KVM's segment form.
pub fn segment_from_gdt(entry: u64, selector: u16) -> kvm_segment {
    let granularity = ((entry >> 55) & 1) as u8;
    let raw_limit = (((entry >> 32) & 0xf_0000) | (entry & 0xffff)) as u32;
    let present = ((entry >> 47) & 1) as u8;
    kvm_segment {
        base: ((entry >> 16) & 0xff_ffff) | (((entry >> 56) & 0xff) << 24),
        limit: if granularity == 1 {
            (raw_limit << 12) | 0xfff
        } else {
            raw_limit
        },
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: granularity,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// Writes the boot GDT, an empty IDT and the identity page tables (2 MiB pages covering the
/// low `BOOT_PD_COUNT` GiB) into guest memory.
pub fn write_boot_tables(ram: &GuestRam) -> Result<(), MemoryError> {
    for (i, entry) in BOOT_GDT.iter().enumerate() {
        ram.write_u64(BOOT_GDT_START + i as u64 * 8, *entry)?;
    }
    ram.write_u64(BOOT_IDT_START, 0)?;
    ram.write_u64(PML4_START, PDPTE_START | PTE_PRESENT_RW_USER)?;
    for pd in 0..BOOT_PD_COUNT {
        let pd_addr = PDE_START + pd * 0x1000;
        ram.write_u64(PDPTE_START + pd * 8, pd_addr | PTE_PRESENT_RW_USER)?;
        for i in 0..512u64 {
            ram.write_u64(pd_addr + i * 8, ((pd * 512 + i) << 21) | PDE_2M_PRESENT_RW)?;
        }
    }
    Ok(())
}

/// Special registers for the 64-bit entry, on top of the vCPU's current (reset) values.
pub fn long_mode_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    let code = segment_from_gdt(BOOT_GDT[2], CODE_SELECTOR);
    let data = segment_from_gdt(BOOT_GDT[3], DATA_SELECTOR);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (BOOT_GDT.len() * 8 - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment_from_gdt(BOOT_GDT[4], TSS_SELECTOR);
    sregs.cr0 = CR0_PE | CR0_ET | CR0_PG;
    sregs.cr3 = PML4_START;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA;
    sregs
}

/// General registers for the 64-bit entry at `entry`.
pub fn entry_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        rflags: RFLAGS_RESERVED_1,
        ..Default::default()
    }
}

/// MSR values at boot: system-call MSRs cleared, TSC at 0, fast strings on.
pub(crate) fn boot_msrs() -> Vec<kvm_msr_entry> {
    let msr = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        msr(MSR_IA32_SYSENTER_CS, 0),
        msr(MSR_IA32_SYSENTER_ESP, 0),
        msr(MSR_IA32_SYSENTER_EIP, 0),
        msr(MSR_STAR, 0),
        msr(MSR_LSTAR, 0),
        msr(MSR_CSTAR, 0),
        msr(MSR_SYSCALL_MASK, 0),
        msr(MSR_KERNEL_GS_BASE, 0),
        msr(MSR_IA32_TSC, 0),
        msr(MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
    ]
}

/// FPU state after reset.
pub(crate) fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: FPU_FCW_DEFAULT,
        mxcsr: MXCSR_DEFAULT,
        ..Default::default()
    }
}

fn lapic_reg(regs: &[libc::c_char], offset: usize) -> u32 {
    let b = |i: usize| regs[offset + i] as u8;
    u32::from_le_bytes([b(0), b(1), b(2), b(3)])
}

fn set_lapic_reg(regs: &mut [libc::c_char], offset: usize, value: u32) {
    for (i, byte) in value.to_le_bytes().iter().enumerate() {
        regs[offset + i] = *byte as libc::c_char;
    }
}

/// Programs LINT0 as ExtINT (the PIC's output) and LINT1 as NMI, as firmware does; the
/// kernel relies on it for the legacy timer check without ACPI.
pub(crate) fn program_lints(regs: &mut [libc::c_char]) {
    let set_mode = |v: u32, mode: u32| (v & !0x700 & !0x1_0000) | (mode << 8);
    let lvt0 = lapic_reg(regs, APIC_LVT0);
    set_lapic_reg(regs, APIC_LVT0, set_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = lapic_reg(regs, APIC_LVT1);
    set_lapic_reg(regs, APIC_LVT1, set_mode(lvt1, APIC_MODE_NMI));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_segment_is_64_bit_ring0_and_data_is_writable() {
        let code = segment_from_gdt(BOOT_GDT[2], CODE_SELECTOR);
        let data = segment_from_gdt(BOOT_GDT[3], DATA_SELECTOR);

        assert_eq!(
            (code.l, code.db, code.dpl, code.present, code.type_),
            (1, 0, 0, 1, 0xb)
        );
        assert_eq!(code.limit, 0xffff_ffff);
        assert_eq!((data.type_, data.s, data.db), (3, 1, 1));
    }

    #[test]
    fn identity_tables_map_the_low_4g_with_2m_pages() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();

        write_boot_tables(&ram).unwrap();

        let pml4 = ram.read_u64(PML4_START).unwrap();
        let pdpte3 = ram.read_u64(PDPTE_START + 3 * 8).unwrap();
        let last = ram.read_u64(PDE_START + 3 * 0x1000 + 511 * 8).unwrap();
        assert_eq!(pml4 & !0xfff, PDPTE_START);
        assert_eq!(pdpte3 & !0xfff, PDE_START + 3 * 0x1000);
        assert_eq!(last & !0xfff, (4u64 << 30) - (2 << 20));
        assert_eq!(last & 0x81, 0x81, "present + 2 MiB page");
    }

    #[test]
    fn long_mode_sregs_enable_paging_pae_and_lma() {
        let s = long_mode_sregs(kvm_sregs::default());

        assert_eq!(s.cr0 & CR0_PG, CR0_PG);
        assert_eq!(s.cr4 & CR4_PAE, CR4_PAE);
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(s.cr3, PML4_START);
        assert_eq!(s.cs.selector, CODE_SELECTOR);
    }

    #[test]
    fn lints_become_extint_and_nmi_and_are_unmasked() {
        let mut regs = [0 as libc::c_char; 1024];
        set_lapic_reg(&mut regs, APIC_LVT0, 0x1_0000);
        set_lapic_reg(&mut regs, APIC_LVT1, 0x1_0000);

        program_lints(&mut regs);

        assert_eq!(lapic_reg(&regs, APIC_LVT0), 0x700);
        assert_eq!(lapic_reg(&regs, APIC_LVT1), 0x400);
    }
}
