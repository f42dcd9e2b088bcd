//! An Intel MultiProcessor Specification 1.4 table for a one-vCPU guest.
//!
//! Without ACPI the kernel finds its interrupt routing here. Writing one at a known place also
//! saves ~1.7 s of boot under kvm_pvm: without it the kernel scans the BIOS area for the
//! floating pointer 16 bytes at a time through `early_memremap`, every step emulated.
//!
//! Layout: the 16-byte floating pointer at the start, the configuration table right after it.
//! Entries: one processor (APIC id 0, bootstrap), one ISA bus, KVM's IOAPIC, ISA IRQs 0..16
//! routed to IOAPIC pins 0..16 (the identity routing KVM's in-kernel irqchip uses), ExtINT on
//! LINT0 and NMI on LINT1.

use crate::layout::{APIC_START, IOAPIC_START, ISA_IRQ_COUNT};

const FLOATING_POINTER_SIGNATURE: &[u8; 4] = b"_MP_";
const TABLE_SIGNATURE: &[u8; 4] = b"PCMP";
const SPEC_REVISION: u8 = 4;
const FLOATING_POINTER_SIZE: usize = 16;
const TABLE_HEADER_SIZE: usize = 44;

const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const IOAPIC_ID: u8 = 1;
const ISA_BUS_ID: u8 = 0;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTSTRAP: u8 = 2;
const IOAPIC_ENABLED: u8 = 1;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
/// Family 6 signature and FPU + APIC feature flags for the processor entry.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;

/// Checksum byte that makes the bytes of `b` sum to zero.
fn checksum(b: &[u8]) -> u8 {
    0u8.wrapping_sub(b.iter().fold(0u8, |a, &x| a.wrapping_add(x)))
}

/// The MP floating pointer and configuration table, to be copied to guest-physical `base`.
pub(crate) fn mptable(base: u32) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut count: u16 = 0;

    entries.extend_from_slice(&[
        ENTRY_PROCESSOR,
        0,
        APIC_VERSION,
        CPU_ENABLED | CPU_BOOTSTRAP,
    ]);
    entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
    entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
    entries.extend_from_slice(&[0; 8]);
    count += 1;

    entries.extend_from_slice(&[ENTRY_BUS, ISA_BUS_ID]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;

    entries.extend_from_slice(&[ENTRY_IOAPIC, IOAPIC_ID, IOAPIC_VERSION, IOAPIC_ENABLED]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    count += 1;

    for irq in 0..ISA_IRQ_COUNT {
        // flags 0: polarity and trigger "conform to the bus" (ISA: active high, edge).
        entries.extend_from_slice(&[ENTRY_IO_INTERRUPT, INT_TYPE_INT, 0, 0]);
        entries.extend_from_slice(&[ISA_BUS_ID, irq, IOAPIC_ID, irq]);
        count += 1;
    }

    // Local APIC id 0xff: "all local APICs".
    entries.extend_from_slice(&[
        ENTRY_LOCAL_INTERRUPT,
        INT_TYPE_EXTINT,
        0,
        0,
        ISA_BUS_ID,
        0,
        0xff,
        0,
    ]);
    entries.extend_from_slice(&[
        ENTRY_LOCAL_INTERRUPT,
        INT_TYPE_NMI,
        0,
        0,
        ISA_BUS_ID,
        0,
        0xff,
        1,
    ]);
    count += 2;

    let table_len = (TABLE_HEADER_SIZE + entries.len()) as u16;
    let mut table = Vec::with_capacity(usize::from(table_len));
    table.extend_from_slice(TABLE_SIGNATURE);
    table.extend_from_slice(&table_len.to_le_bytes());
    table.push(SPEC_REVISION);
    table.push(0); // checksum, filled below
    table.extend_from_slice(b"BUD     "); // OEM id, 8 bytes
    table.extend_from_slice(b"BUD VMM     "); // product id, 12 bytes
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    table.extend_from_slice(&0u16.to_le_bytes()); // extended table length
    table.push(0); // extended table checksum
    table.push(0); // reserved
    debug_assert_eq!(table.len(), TABLE_HEADER_SIZE);
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = Vec::with_capacity(FLOATING_POINTER_SIZE + table.len());
    fp.extend_from_slice(FLOATING_POINTER_SIGNATURE);
    fp.extend_from_slice(&(base + FLOATING_POINTER_SIZE as u32).to_le_bytes());
    fp.push(1); // length in 16-byte paragraphs
    fp.push(SPEC_REVISION);
    fp.push(0); // checksum, filled below
    fp.extend_from_slice(&[0; 5]); // feature bytes: 0 = a configuration table is present
    fp[10] = checksum(&fp);
    fp.extend_from_slice(&table);
    fp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, &x| a.wrapping_add(x))
    }

    #[test]
    fn floating_pointer_points_at_the_table_and_sums_to_zero() {
        let t = mptable(0x9_fc00);

        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(u32::from_le_bytes(t[4..8].try_into().unwrap()), 0x9_fc10);
        assert_eq!(t[8], 1);
        assert_eq!(sum(&t[..16]), 0);
    }

    #[test]
    fn configuration_table_length_count_and_checksum_are_consistent() {
        let t = mptable(0x9_fc00);
        let table = &t[16..];

        let len = u16::from_le_bytes([table[4], table[5]]) as usize;
        let count = u16::from_le_bytes([table[34], table[35]]);
        assert_eq!(&table[0..4], b"PCMP");
        assert_eq!(len, table.len());
        assert_eq!(sum(table), 0);
        // 1 processor + 1 bus + 1 IOAPIC + 16 IRQs + 2 local interrupts
        assert_eq!(count, 21);
        assert_eq!(len, 44 + 20 + 8 * 20);
        assert_eq!(
            u32::from_le_bytes(table[36..40].try_into().unwrap()),
            0xfee0_0000
        );
    }

    #[test]
    fn isa_irqs_route_to_matching_ioapic_pins() {
        let t = mptable(0x9_fc00);
        let entries = &t[16 + 44 + 20 + 8 + 8..];

        for irq in 0..16u8 {
            let e = &entries[usize::from(irq) * 8..usize::from(irq) * 8 + 8];
            assert_eq!(e, [3, 0, 0, 0, 0, irq, 1, irq]);
        }
    }

    #[test]
    fn table_fits_below_the_bios_area() {
        let t = mptable(0x9_fc00);

        assert!(0x9_fc00 + t.len() <= 0xa_0000);
    }
}
