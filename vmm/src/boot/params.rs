//! The Linux x86 boot protocol's zero page (`struct boot_params`), the e820 memory map and the
//! `setup_data` chain, as plain bytes ready to copy into guest memory.
//!
//! References: the kernel's Documentation/arch/x86/boot.rst ("64-bit boot protocol") and
//! zero-page.rst. bud boots the ELF `vmlinux` directly in 64-bit mode, so only the fields a
//! 64-bit entry reads are filled.

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};

use crate::layout::{BIOS_START, EBDA_START, HIMEM_START, MPTABLE_START};

/// e820 type of usable RAM.
pub(crate) const E820_RAM: u32 = 1;
/// e820 type of reserved memory.
pub(crate) const E820_RESERVED: u32 = 2;
/// `setup_data` type of a random seed for the kernel's CRNG (`SETUP_RNG_SEED`).
pub(crate) const SETUP_RNG_SEED: u32 = 9;
/// Size of the RNG seed bud hands the kernel.
pub(crate) const RNG_SEED_SIZE: usize = 32;

/// `boot_flag` magic.
const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `header` magic "HdrS".
const HDRS_MAGIC: u32 = 0x5372_6448;
/// `type_of_loader` for a boot loader without an assigned id.
const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// `loadflags` bit: the protected-mode kernel is loaded at 0x100000.
const LOADED_HIGH: u8 = 0x01;
/// Alignment the (non-relocatable) kernel was built for: CONFIG_PHYSICAL_ALIGN.
const KERNEL_ALIGNMENT: u32 = 0x0100_0000;

/// One e820 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct E820Entry {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) kind: u32,
}

/// Errors of building the zero page.
#[derive(Debug, thiserror::Error)]
pub enum ParamsError {
    #[error("guest RAM of {0:#x} bytes leaves no high memory for the kernel")]
    RamTooSmall(u64),
    #[error("initramfs at {addr:#x}+{size:#x} does not fit the 32-bit boot protocol fields")]
    InitrdTooHigh { addr: u64, size: u64 },
    #[error("command line of {0} bytes (with its NUL) does not fit its field")]
    CmdlineTooLong(usize),
}

/// The e820 map of a guest with `ram_size` bytes of RAM: base memory up to the EBDA, the MP
/// table page and BIOS area reserved (so the kernel keeps its hands off them), and RAM from
/// 1 MiB to the end.
pub(crate) fn e820_map(ram_size: u64) -> Result<Vec<E820Entry>, ParamsError> {
    if ram_size <= HIMEM_START {
        return Err(ParamsError::RamTooSmall(ram_size));
    }
    Ok(vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820_RAM,
        },
        E820Entry {
            addr: MPTABLE_START,
            size: 0xa_0000 - MPTABLE_START,
            kind: E820_RESERVED,
        },
        E820Entry {
            addr: BIOS_START,
            size: HIMEM_START - BIOS_START,
            kind: E820_RESERVED,
        },
        E820Entry {
            addr: HIMEM_START,
            size: ram_size - HIMEM_START,
            kind: E820_RAM,
        },
    ])
}

/// What goes into the zero page.
#[derive(Debug, Clone)]
pub(crate) struct ZeroPage {
    pub(crate) e820: Vec<E820Entry>,
    pub(crate) cmdline_addr: u64,
    /// Length of the command line including its terminating NUL.
    pub(crate) cmdline_size: usize,
    pub(crate) initrd_addr: u64,
    pub(crate) initrd_size: u64,
    /// Guest-physical address of the first `setup_data` entry, or 0.
    pub(crate) setup_data: u64,
}

impl ZeroPage {
    /// Serializes to the 4096-byte `struct boot_params`.
    pub(crate) fn to_bytes(&self) -> Result<Vec<u8>, ParamsError> {
        let initrd_end = self.initrd_addr.saturating_add(self.initrd_size);
        if initrd_end > u64::from(u32::MAX) {
            return Err(ParamsError::InitrdTooHigh {
                addr: self.initrd_addr,
                size: self.initrd_size,
            });
        }
        let cmdline_size = u32::try_from(self.cmdline_size)
            .map_err(|_| ParamsError::CmdlineTooLong(self.cmdline_size))?;
        let mut bp = boot_params::default();
        bp.hdr.boot_flag = BOOT_FLAG_MAGIC;
        bp.hdr.header = HDRS_MAGIC;
        bp.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
        bp.hdr.loadflags |= LOADED_HIGH;
        bp.hdr.kernel_alignment = KERNEL_ALIGNMENT;
        bp.hdr.cmd_line_ptr = self.cmdline_addr as u32;
        bp.hdr.cmdline_size = cmdline_size;
        bp.hdr.ramdisk_image = self.initrd_addr as u32;
        bp.hdr.ramdisk_size = self.initrd_size as u32;
        bp.hdr.setup_data = self.setup_data;
        let max = bp.e820_table.len();
        for (slot, e) in bp.e820_table.iter_mut().zip(self.e820.iter().take(max)) {
            *slot = boot_e820_entry {
                addr: e.addr,
                size: e.size,
                r#type: e.kind,
            };
        }
        bp.e820_entries = self.e820.len().min(max) as u8;

        let size = std::mem::size_of::<boot_params>();
        let mut out = vec![0u8; size];
        // SAFETY: `boot_params` is a bindgen-generated `repr(C, packed)` plain-old-data struct
        // (integers and arrays of integers, no padding, no pointers); reading its `size` bytes
        // through a byte pointer is valid, and `out` has exactly `size` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&bp as *const boot_params).cast::<u8>(),
                out.as_mut_ptr(),
                size,
            )
        };
        Ok(out)
    }
}

/// A `setup_data` entry of type `SETUP_RNG_SEED` carrying `seed`, terminating the chain.
///
/// Without it the guest has no RDRAND (hidden on PVM) and would spend ~2 s collecting jitter
/// entropy before its CRNG is ready.
pub(crate) fn rng_seed_setup_data(seed: &[u8; RNG_SEED_SIZE]) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + RNG_SEED_SIZE);
    b.extend_from_slice(&0u64.to_le_bytes()); // next: end of chain
    b.extend_from_slice(&SETUP_RNG_SEED.to_le_bytes());
    b.extend_from_slice(&(RNG_SEED_SIZE as u32).to_le_bytes());
    b.extend_from_slice(seed);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u16_at(b: &[u8], o: usize) -> u16 {
        u16::from_le_bytes(b[o..o + 2].try_into().unwrap())
    }
    fn u32_at(b: &[u8], o: usize) -> u32 {
        u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], o: usize) -> u64 {
        u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
    }

    #[test]
    fn e820_map_reserves_the_mp_table_and_bios_and_covers_all_ram() {
        let map = e820_map(256 << 20).unwrap();

        let ram: u64 = map
            .iter()
            .filter(|e| e.kind == E820_RAM)
            .map(|e| e.size)
            .sum();
        assert_eq!(
            map[0],
            E820Entry {
                addr: 0,
                size: 0x9_fc00,
                kind: E820_RAM
            }
        );
        assert!(
            map.iter()
                .any(|e| e.kind == E820_RESERVED && e.addr == MPTABLE_START)
        );
        assert!(
            map.iter()
                .any(|e| e.kind == E820_RESERVED && e.addr == BIOS_START)
        );
        assert_eq!(
            map.last().unwrap().addr + map.last().unwrap().size,
            256 << 20
        );
        assert_eq!(ram, (256 << 20) - HIMEM_START + 0x9_fc00);
    }

    #[test]
    fn e820_entries_do_not_overlap_and_are_sorted() {
        let map = e820_map(128 << 20).unwrap();

        for pair in map.windows(2) {
            assert!(pair[0].addr + pair[0].size <= pair[1].addr, "{pair:?}");
        }
    }

    #[test]
    fn e820_refuses_ram_without_high_memory() {
        assert!(matches!(
            e820_map(HIMEM_START),
            Err(ParamsError::RamTooSmall(_))
        ));
    }

    #[test]
    fn zero_page_fields_sit_at_the_boot_protocol_offsets() {
        let zp = ZeroPage {
            e820: e820_map(256 << 20).unwrap(),
            cmdline_addr: 0x2_0000,
            cmdline_size: 42,
            initrd_addr: 0x0f00_0000,
            initrd_size: 0x12_3456,
            setup_data: 0x6000,
        };

        let b = zp.to_bytes().unwrap();

        assert_eq!(b.len(), 4096);
        assert_eq!(b[0x1e8], 4, "e820_entries");
        assert_eq!(u16_at(&b, 0x1fe), 0xaa55, "boot_flag");
        assert_eq!(u32_at(&b, 0x202), 0x5372_6448, "header HdrS");
        assert_eq!(b[0x210], 0xff, "type_of_loader");
        assert_eq!(b[0x211] & 1, 1, "loadflags LOADED_HIGH");
        assert_eq!(u32_at(&b, 0x218), 0x0f00_0000, "ramdisk_image");
        assert_eq!(u32_at(&b, 0x21c), 0x12_3456, "ramdisk_size");
        assert_eq!(u32_at(&b, 0x228), 0x2_0000, "cmd_line_ptr");
        assert_eq!(u32_at(&b, 0x238), 42, "cmdline_size");
        assert_eq!(u64_at(&b, 0x250), 0x6000, "setup_data");
        // e820_table at 0x2d0, 20 bytes per entry: the fourth entry is high RAM.
        assert_eq!(u64_at(&b, 0x2d0 + 3 * 20), HIMEM_START);
        assert_eq!(u64_at(&b, 0x2d0 + 3 * 20 + 8), (256 << 20) - HIMEM_START);
        assert_eq!(u32_at(&b, 0x2d0 + 3 * 20 + 16), E820_RAM);
    }

    #[test]
    fn initrd_above_4g_is_refused() {
        let zp = ZeroPage {
            e820: vec![],
            cmdline_addr: 0,
            cmdline_size: 1,
            initrd_addr: 0xffff_f000,
            initrd_size: 0x2000,
            setup_data: 0,
        };

        assert!(matches!(
            zp.to_bytes(),
            Err(ParamsError::InitrdTooHigh { .. })
        ));
    }

    #[test]
    fn rng_seed_setup_data_has_type_9_and_ends_the_chain() {
        let seed = [0x5a; RNG_SEED_SIZE];

        let b = rng_seed_setup_data(&seed);

        assert_eq!(u64_at(&b, 0), 0);
        assert_eq!(u32_at(&b, 8), 9);
        assert_eq!(u32_at(&b, 12), 32);
        assert_eq!(&b[16..], &seed);
    }
}
