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
pub const CR4_LA57: u64 = 1 << 12;

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
pub fn translate(ram: &GuestRam, cr3: u64, cr4: u64, gva: u64) -> Result<u64, PagingError> {
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

/// Every page-table page reachable from the kernel's own PGD (`init_top_pgt`), from the PGD of
/// every mm on the kernel's `pgd_list`, and from `extra_roots`, as a bitmap over the pages of
/// `ram` (bit `n % 64` of word `n / 64` is page `n`).
pub fn all_table_pages(
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
pub fn translate_pages(
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
