//! Guest-virtual to guest-physical translation by walking the guest's x86-64 page tables in
//! guest RAM (4-level, or 5-level when CR4.LA57 is set).
//!
//! Used once per template: to turn the mailbox the guest worker announced (a user-space
//! virtual address) into guest-physical pages the host can read and write, and to list every
//! page-table page of the template ([`all_table_pages`], which resets consult). The tables are
//! guest memory, so a walk trusts nothing: every table address is bounds-checked by
//! [`GuestRam`] and a malformed entry is an error or skipped, never a panic.

use crate::kernel_layout::MmLayout;
use crate::memory::{GuestRam, MemoryError, PAGE_SIZE};

const PTE_PRESENT: u64 = 1 << 0;
const PTE_PAGE_SIZE: u64 = 1 << 7;
/// Physical-address bits 12..52 of an entry.
const PTE_ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// CR4.LA57: 5-level paging.
pub(crate) const CR4_LA57: u64 = 1 << 12;

/// Errors of a page walk.
#[derive(Debug, thiserror::Error)]
pub enum PagingError {
    #[error("virtual address {0:#x} is not mapped")]
    NotMapped(u64),
    #[error("page table access: {0}")]
    Memory(#[from] MemoryError),
    #[error("the kernel's pgd_list is malformed at {0:#x}")]
    PgdList(u64),
}

/// Translates `gva` through the tables rooted at `cr3`.
pub(crate) fn translate(ram: &GuestRam, cr3: u64, cr4: u64, gva: u64) -> Result<u64, PagingError> {
    let levels: u32 = if cr4 & CR4_LA57 != 0 { 5 } else { 4 };
    let mut table = cr3 & PTE_ADDR_MASK;
    for level in (1..=levels).rev() {
        let shift = 12 + 9 * (level - 1);
        let index = (gva >> shift) & 0x1ff;
        let entry = ram.read_u64(table + index * 8)?;
        if entry & PTE_PRESENT == 0 {
            return Err(PagingError::NotMapped(gva));
        }
        // A large page at the PDPT (1 GiB) or PD (2 MiB) level ends the walk.
        if (level == 2 || level == 3) && entry & PTE_PAGE_SIZE != 0 {
            let page_mask = (1u64 << shift) - 1;
            return Ok((entry & PTE_ADDR_MASK & !page_mask) | (gva & page_mask));
        }
        table = entry & PTE_ADDR_MASK;
    }
    Ok(table | (gva & (PAGE_SIZE - 1)))
}

const PTE_WRITABLE: u64 = 1 << 1;
const PTE_USER: u64 = 1 << 2;
const PTE_DIRTY: u64 = 1 << 6;
/// Virtual addresses below this are the user half of a 4-level address space.
const USER_HALF_END: u64 = 1 << 47;

/// How the host means to touch a guest-virtual address on the guest's behalf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

/// Translates `gva` as the CPU would for a kernel-mode access of kind `access` that must not
/// fault or change the tables: every level present; for a write, writable at every level and
/// already dirty in the last one (the host never sets accessed or dirty bits: that would be a
/// write into a page-table page behind the back of KVM's shadow MMU); for a user-half
/// address, user-accessible at every level. Returns the guest-physical address and the bytes
/// left in its page (4 KiB, 2 MiB or 1 GiB), or `None` where the CPU would fault or would set
/// a bit (the caller then leaves that part to the guest). 4-level paging only (bud's guests).
pub(crate) fn translate_access(
    ram: &GuestRam,
    cr3: u64,
    gva: u64,
    access: Access,
) -> Result<Option<(u64, u64)>, PagingError> {
    let user = gva < USER_HALF_END;
    let mut table = cr3 & PTE_ADDR_MASK;
    for level in (1..=4u32).rev() {
        let shift = 12 + 9 * (level - 1);
        let entry = ram.read_u64(table + ((gva >> shift) & 0x1ff) * 8)?;
        let needed = PTE_PRESENT
            | if access == Access::Write {
                PTE_WRITABLE
            } else {
                0
            }
            | if user { PTE_USER } else { 0 };
        if entry & needed != needed {
            return Ok(None);
        }
        let last = level == 1 || ((level == 2 || level == 3) && entry & PTE_PAGE_SIZE != 0);
        if last {
            if access == Access::Write && entry & PTE_DIRTY == 0 {
                return Ok(None);
            }
            let page_mask = (1u64 << shift) - 1;
            let gpa = (entry & PTE_ADDR_MASK & !page_mask) | (gva & page_mask);
            return Ok(Some((gpa, (page_mask + 1) - (gva & page_mask))));
        }
        table = entry & PTE_ADDR_MASK;
    }
    unreachable!("the level-1 entry ends every walk")
}

/// Every page-table page reachable from the kernel's own PGD (`init_top_pgt`), from the PGD of
/// every mm on the kernel's `pgd_list`, and from `extra_roots`, as a bitmap over the pages of
/// `ram` (bit `n % 64` of word `n / 64` is page `n`).
pub(crate) fn all_table_pages(
    ram: &GuestRam,
    mm: &MmLayout,
    cr4: u64,
    extra_roots: &[u64],
) -> Result<Vec<u64>, PagingError> {
    let mut roots = vec![mm.init_top_pgt];
    roots.extend_from_slice(extra_roots);
    // pgd_list links the struct page of each PGD through its `lru` member.
    let mut next = ram.read_u64(mm.pgd_list)?;
    let mut steps = 0u64;
    while next != mm.pgd_list_va {
        steps += 1;
        let page_va = next.wrapping_sub(mm.page_lru);
        let offset = page_va.wrapping_sub(mm.vmemmap);
        if steps > ram.pages() || offset % mm.page_size != 0 || offset / mm.page_size >= ram.pages()
        {
            return Err(PagingError::PgdList(next));
        }
        roots.push(offset / mm.page_size * PAGE_SIZE);
        next = ram.read_u64(translate(ram, mm.init_top_pgt, cr4, next)?)?;
    }
    let levels: u32 = if cr4 & CR4_LA57 != 0 { 5 } else { 4 };
    let mut bitmap = vec![0u64; ram.pages().div_ceil(64) as usize];
    for root in roots {
        mark_tables(ram, root & PTE_ADDR_MASK, levels, &mut bitmap)?;
    }
    Ok(bitmap)
}

/// Marks `table` and every table below it (down to page tables of level 1).
fn mark_tables(
    ram: &GuestRam,
    table: u64,
    level: u32,
    bitmap: &mut [u64],
) -> Result<(), PagingError> {
    let page = table / PAGE_SIZE;
    if table + PAGE_SIZE > ram.len() || bitmap[(page / 64) as usize] & (1 << (page % 64)) != 0 {
        return Ok(());
    }
    bitmap[(page / 64) as usize] |= 1 << (page % 64);
    if level == 1 {
        return Ok(());
    }
    let mut entries = [0u8; PAGE_SIZE as usize];
    ram.read(table, &mut entries)?;
    for entry in entries.chunks_exact(8) {
        let e = u64::from_le_bytes(entry.try_into().unwrap_or([0; 8]));
        let large = (level == 2 || level == 3) && e & PTE_PAGE_SIZE != 0;
        if e & PTE_PRESENT != 0 && !large {
            mark_tables(ram, e & PTE_ADDR_MASK, level - 1, bitmap)?;
        }
    }
    Ok(())
}

/// Guest-physical addresses of the `len / PAGE_SIZE` pages starting at page-aligned `gva`.
pub(crate) fn translate_pages(
    ram: &GuestRam,
    cr3: u64,
    cr4: u64,
    gva: u64,
    len: u64,
) -> Result<Vec<u64>, PagingError> {
    (0..len.div_ceil(PAGE_SIZE))
        .map(|i| translate(ram, cr3, cr4, gva + i * PAGE_SIZE))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds 4-level tables at 0x1000.. mapping `gva` to `gpa` with a 4 KiB page and
    /// 0x4000_0000.. with a 2 MiB page.
    fn tables(ram: &GuestRam, gva: u64, gpa: u64) -> u64 {
        let (pml4, pdpt, pd, pt) = (0x1000u64, 0x2000u64, 0x3000u64, 0x4000u64);
        let idx = |level: u32| (gva >> (12 + 9 * (level - 1))) & 0x1ff;
        ram.write_u64(pml4 + idx(4) * 8, pdpt | 7).unwrap();
        ram.write_u64(pdpt + idx(3) * 8, pd | 7).unwrap();
        ram.write_u64(pd + idx(2) * 8, pt | 7).unwrap();
        ram.write_u64(pt + idx(1) * 8, gpa | 7).unwrap();
        pml4
    }

    #[test]
    fn a_4k_mapping_translates_with_the_page_offset() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let gva = 0x7f12_3456_7000;
        let cr3 = tables(&ram, gva, 0x8_0000);

        let gpa = translate(&ram, cr3, 0, gva + 0x123).unwrap();

        assert_eq!(gpa, 0x8_0123);
    }

    #[test]
    fn table_pages_cover_every_root_on_pgd_list_and_stop_at_large_pages() {
        // init_top_pgt at 0x1000 maps 0xffff_8880_0000_0000 (the struct pages) through
        // 0x2000 (PDPT) -> 0x3000 (PD, a 2 MiB page at 0x40_0000). One mm's PGD at 0x5000 has
        // a PDPT at 0x6000 -> PD at 0x7000 -> PT at 0x8000. pgd_list lives at 0x9000.
        let ram = GuestRam::anonymous(8 << 20).unwrap();
        let vmemmap = 0xffff_8880_0000_0000u64;
        let idx = |va: u64, level: u32| (va >> (12 + 9 * (level - 1))) & 0x1ff;
        ram.write_u64(0x1000 + idx(vmemmap, 4) * 8, 0x2000 | 3)
            .unwrap();
        ram.write_u64(0x2000 + idx(vmemmap, 3) * 8, 0x3000 | 3)
            .unwrap();
        ram.write_u64(0x3000 + idx(vmemmap, 2) * 8, 0x40_0000 | 0x83)
            .unwrap();
        ram.write_u64(0x5000, 0x6000 | 7).unwrap();
        ram.write_u64(0x6000, 0x7000 | 7).unwrap();
        ram.write_u64(0x7000 + 8, 0x8000 | 7).unwrap();
        ram.write_u64(0x8000, 0x20_0000 | 7).unwrap();
        let (page_size, lru) = (64u64, 8u64);
        let pgd_list_va = 0xffff_ffff_8100_9000u64;
        let pgd_page = vmemmap + 5 * page_size; // the struct page of pfn 5 (0x5000)
        ram.write_u64(0x9000, pgd_page + lru).unwrap();
        ram.write_u64(0x40_0000 + 5 * page_size + lru, pgd_list_va)
            .unwrap();
        let mm = MmLayout {
            init_top_pgt: 0x1000,
            pgd_list_va,
            pgd_list: 0x9000,
            vmemmap,
            page_size,
            page_lru: lru,
        };

        let bitmap = all_table_pages(&ram, &mm, 0, &[]).unwrap();
        let pages: Vec<u64> = crate::memory::set_bits(&bitmap).collect();

        assert_eq!(pages, vec![1, 2, 3, 5, 6, 7, 8]);
    }

    #[test]
    fn a_looping_pgd_list_is_an_error() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let mm = MmLayout {
            init_top_pgt: 0x1000,
            pgd_list_va: 0xffff_ffff_8100_9000,
            pgd_list: 0x9000,
            vmemmap: 0,
            page_size: 64,
            page_lru: 8,
        };
        ram.write_u64(0x9000, 0x7777).unwrap();

        let err = all_table_pages(&ram, &mm, 0, &[]).unwrap_err();

        assert!(
            matches!(err, PagingError::PgdList(_) | PagingError::NotMapped(_)),
            "{err}"
        );
    }

    #[test]
    fn a_2m_page_ends_the_walk_at_the_page_directory() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let gva = 0x7f12_3456_7000;
        let cr3 = tables(&ram, gva, 0x8_0000);
        let pd_index = (gva >> 21) & 0x1ff;
        ram.write_u64(0x3000 + pd_index * 8, 0x0020_0000 | 0x83)
            .unwrap();

        let gpa = translate(&ram, cr3, 0, gva).unwrap();

        assert_eq!(gpa, 0x0020_0000 | (gva & 0x1f_ffff));
    }

    #[test]
    fn unmapped_and_out_of_ram_tables_are_errors() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let gva = 0x7f12_3456_7000;
        let cr3 = tables(&ram, gva, 0x8_0000);

        let unmapped = translate(&ram, cr3, 0, 0x1000).unwrap_err();
        let bogus_root = translate(&ram, 0x7fff_f000, 0, gva).unwrap_err();

        assert!(matches!(unmapped, PagingError::NotMapped(0x1000)));
        assert!(matches!(bogus_root, PagingError::Memory(_)));
    }

    #[test]
    fn an_access_needs_present_user_and_for_writes_writable_dirty_entries() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let gva = 0x7f12_3456_7000;
        let cr3 = tables(&ram, gva, 0x8_0000); // every level: present, writable, user
        let pte = 0x4000 + ((gva >> 12) & 0x1ff) * 8;

        let read = translate_access(&ram, cr3, gva + 0x10, Access::Read).unwrap();
        let clean_write = translate_access(&ram, cr3, gva, Access::Write).unwrap();
        ram.write_u64(pte, 0x8_0000 | 7 | PTE_DIRTY).unwrap();
        let dirty_write = translate_access(&ram, cr3, gva, Access::Write).unwrap();
        ram.write_u64(pte, 0x8_0000 | 5 | PTE_DIRTY).unwrap(); // read-only (copy on write)
        let read_only_write = translate_access(&ram, cr3, gva, Access::Write).unwrap();
        ram.write_u64(pte, 0x8_0000 | 3 | PTE_DIRTY).unwrap(); // kernel-only page
        let kernel_page_read = translate_access(&ram, cr3, gva, Access::Read).unwrap();
        let unmapped = translate_access(&ram, cr3, gva + (1 << 30), Access::Read).unwrap();

        assert_eq!(read, Some((0x8_0010, 0xff0)));
        assert_eq!(clean_write, None, "the CPU would set the dirty bit");
        assert_eq!(dirty_write, Some((0x8_0000, 0x1000)));
        assert_eq!(read_only_write, None);
        assert_eq!(
            kernel_page_read, None,
            "a user-half address must be user-accessible"
        );
        assert_eq!(unmapped, None);
    }

    #[test]
    fn a_kernel_half_2m_page_needs_no_user_bit_and_reports_the_room_to_its_end() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let gva = 0xffff_8880_0020_0000u64;
        let (pml4, pdpt, pd) = (0x1000u64, 0x2000u64, 0x3000u64);
        let idx = |level: u32| (gva >> (12 + 9 * (level - 1))) & 0x1ff;
        ram.write_u64(pml4 + idx(4) * 8, pdpt | 3).unwrap();
        ram.write_u64(pdpt + idx(3) * 8, pd | 3).unwrap();
        ram.write_u64(pd + idx(2) * 8, 0x20_0000 | 3 | PTE_DIRTY | PTE_PAGE_SIZE)
            .unwrap();

        let at = translate_access(&ram, pml4, gva + 0x1_2345, Access::Write).unwrap();

        assert_eq!(at, Some((0x21_2345, (2 << 20) - 0x1_2345)));
    }

    #[test]
    fn translate_pages_returns_one_address_per_page() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let gva = 0x7f12_3456_7000;
        let cr3 = tables(&ram, gva, 0x8_0000);
        let pt_index = (gva >> 12) & 0x1ff;
        ram.write_u64(0x4000 + (pt_index + 1) * 8, 0x9_0000 | 7)
            .unwrap();

        let pages = translate_pages(&ram, cr3, 0, gva, 2 * PAGE_SIZE).unwrap();

        assert_eq!(pages, vec![0x8_0000, 0x9_0000]);
    }
}
