//! The host-copy port: the guest kernel asks the VMM to do a copy between user and kernel
//! memory for it.
//!
//! On kvm_pvm the guest kernel runs in an instruction emulator that executes every iteration
//! of `copy_user_generic`'s `rep movsq` on its own, with a guest page-table walk each: ~0.5 us
//! per 8 bytes, ~16 MB/s, for every `read`, `write`, pipe and file copy. bud's guest kernel
//! patch `guest/kernel/patches/0013-bud-host-copy.patch` (active only with `bud.host_copy` on
//! the command line, meant for kvm_pvm and off for now, see [`crate::host`]) instead writes a
//! [`request`] block in its own memory and sends the block's guest-physical address with one
//! 32-bit `out` to [`PORT`]: the VMM translates both ranges through the guest's page tables
//! as the CPU would ([`crate::paging::translate_access`]), copies, and writes how many bytes
//! it copied into the block. It stops at the first page the CPU would fault on or would
//! have to mark accessed or dirty in a way the host does not do, and the guest copies the
//! rest itself (taking the fault as upstream).
//!
//! Hostile guest code can write this port too (a root job may `ioperm` it). The VMM only ever
//! reads and writes guest RAM, bounds-checked, and does at most [`MAX_LEN`] bytes per request;
//! a request that names memory outside guest RAM stops the VM. What it can do inside its own
//! guest (write kernel memory through the kernel's own mappings) gives a root job nothing a
//! later job could see: the VM is reset from the template, or discarded, after every job.

use crate::memory::{GuestRam, MemoryError};
use crate::paging::{Access, PagingError, translate_access};

/// I/O port of the request (past the exit-report port).
pub(crate) const PORT: u16 = 0x0bdc;

/// Largest copy one request does (the guest asks again for the rest): bounds the time one
/// exit can hold the vCPU thread, whatever a hostile guest writes in `len`.
pub(crate) const MAX_LEN: u64 = 16 << 20;

/// Byte offsets of the request block's fields (all `u64`, little endian), 8-byte aligned in
/// guest RAM.
pub(crate) mod request {
    /// CR3 of the address space both addresses live in.
    pub(crate) const CR3: u64 = 0;
    /// Destination virtual address.
    pub(crate) const DST: u64 = 8;
    /// Source virtual address.
    pub(crate) const SRC: u64 = 16;
    /// Bytes to copy.
    pub(crate) const LEN: u64 = 24;
    /// Written by the host: bytes copied, from the start.
    pub(crate) const DONE: u64 = 32;
    /// Size of the block.
    #[allow(
        dead_code,
        reason = "completes the layout the guest kernel patch shares; the host reads fields only"
    )]
    pub(crate) const SIZE: u64 = 40;
}

/// Why a request could not be served (the VM is stopped: a correct guest never sends one).
#[derive(Debug, thiserror::Error)]
pub(crate) enum HostCopyError {
    #[error("request block at {0:#x} is not 8-byte aligned")]
    Unaligned(u64),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Paging(#[from] PagingError),
}

/// Serves the request whose block is at guest-physical `block`: copies what it can and writes
/// the count into the block. Returns the count.
pub(crate) fn serve(ram: &GuestRam, block: u64) -> Result<u64, HostCopyError> {
    if block % 8 != 0 {
        return Err(HostCopyError::Unaligned(block));
    }
    let field = |offset| ram.read_u64(block + offset);
    let (cr3, dst, src) = (
        field(request::CR3)?,
        field(request::DST)?,
        field(request::SRC)?,
    );
    let len = field(request::LEN)?.min(MAX_LEN);
    let mut done = 0;
    while done < len {
        let (s, d) = (src.wrapping_add(done), dst.wrapping_add(done));
        let Some((s_gpa, s_room)) = translate_access(ram, cr3, s, Access::Read)? else {
            break;
        };
        let Some((d_gpa, d_room)) = translate_access(ram, cr3, d, Access::Write)? else {
            break;
        };
        let n = (len - done).min(s_room).min(d_room);
        ram.copy_within(s_gpa, d_gpa, n)?;
        done += n;
    }
    ram.write_u64(block + request::DONE, done)?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PML4: u64 = 0x1000;

    /// Maps `gva` to `gpa` (4 KiB, user, present, writable, with `flags` added) in 4-level
    /// tables rooted at [`PML4`], whose lower levels live at `tables..`.
    fn map(ram: &GuestRam, gva: u64, gpa: u64, last_flags: u64, tables: u64) {
        let idx = |level: u32| (gva >> (12 + 9 * (level - 1))) & 0x1ff;
        let (pdpt, pd, pt) = (tables, tables + 0x1000, tables + 0x2000);
        ram.write_u64(PML4 + idx(4) * 8, pdpt | 7).unwrap();
        ram.write_u64(pdpt + idx(3) * 8, pd | 7).unwrap();
        ram.write_u64(pd + idx(2) * 8, pt | 7).unwrap();
        ram.write_u64(pt + idx(1) * 8, gpa | last_flags).unwrap();
    }

    fn request(ram: &GuestRam, block: u64, dst: u64, src: u64, len: u64) {
        ram.write_u64(block + request::CR3, PML4).unwrap();
        ram.write_u64(block + request::DST, dst).unwrap();
        ram.write_u64(block + request::SRC, src).unwrap();
        ram.write_u64(block + request::LEN, len).unwrap();
    }

    const DIRTY: u64 = 1 << 6;

    #[test]
    fn a_copy_across_pages_lands_in_the_destination_and_reports_its_length() {
        let ram = GuestRam::anonymous(4 << 20).unwrap();
        // Source: two user pages at 0x40_0000 -> 0x10_0000 and 0x40_1000 -> 0x30_0000
        // (not contiguous in guest-physical memory); destination one dirty page and its
        // neighbour at 0x50_0000.
        map(&ram, 0x40_0000, 0x10_0000, 7, 0x2000);
        map(&ram, 0x40_1000, 0x30_0000, 7, 0x2000);
        map(&ram, 0x50_0000, 0x20_0000, 7 | DIRTY, 0x2000);
        map(&ram, 0x50_1000, 0x20_1000, 7 | DIRTY, 0x2000);
        ram.write(0x10_0f00, &[1; 256]).unwrap();
        ram.write(0x30_0000, &[2; 256]).unwrap();
        request(&ram, 0x8000, 0x50_0010, 0x40_0f00, 512);

        let done = serve(&ram, 0x8000).unwrap();

        let mut back = [0u8; 512];
        ram.read(0x20_0010, &mut back).unwrap();
        assert_eq!(done, 512);
        assert_eq!(ram.read_u64(0x8000 + request::DONE).unwrap(), 512);
        assert_eq!(&back[..256], &[1; 256]);
        assert_eq!(&back[256..], &[2; 256]);
    }

    #[test]
    fn the_copy_stops_where_the_cpu_would_fault_or_set_the_dirty_bit() {
        let ram = GuestRam::anonymous(4 << 20).unwrap();
        map(&ram, 0x40_0000, 0x10_0000, 7, 0x2000);
        map(&ram, 0x40_1000, 0x11_0000, 7, 0x2000);
        map(&ram, 0x50_0000, 0x20_0000, 7 | DIRTY, 0x2000);
        map(&ram, 0x50_1000, 0x21_0000, 7, 0x2000); // writable, not yet dirty
        ram.write(0x21_0000, &[9; 16]).unwrap();
        request(&ram, 0x8000, 0x50_0000, 0x40_0000, 0x2000);
        let to_clean = serve(&ram, 0x8000).unwrap();
        request(&ram, 0x8000, 0x50_0000, 0x60_0000, 0x1000); // unmapped source
        let from_unmapped = serve(&ram, 0x8000).unwrap();

        let mut untouched = [0u8; 16];
        ram.read(0x21_0000, &mut untouched).unwrap();
        assert_eq!(to_clean, 0x1000);
        assert_eq!(untouched, [9; 16]);
        assert_eq!(from_unmapped, 0);
    }

    #[test]
    fn a_hostile_length_is_capped_and_a_block_outside_ram_is_an_error() {
        let ram = GuestRam::anonymous(4 << 20).unwrap();
        // One writable dirty page aliased in every entry of a page table, and that table in
        // 16 page-directory entries: 32 MiB of virtual memory on one page, which would let a
        // guest ask for any length; the cap bounds the work.
        for i in 0..512u64 {
            map(&ram, 0x40_0000 + i * 0x1000, 0x10_0000, 7 | DIRTY, 0x2000);
        }
        for i in 0..16u64 {
            ram.write_u64(0x3000 + (2 + i) * 8, 0x4000 | 7).unwrap();
        }
        request(&ram, 0x8000, 0x40_0000, 0x40_0000, u64::MAX);
        let capped = serve(&ram, 0x8000).unwrap();
        let outside = serve(&ram, 4 << 20).unwrap_err();
        let unaligned = serve(&ram, 0x8004).unwrap_err();

        assert_eq!(capped, MAX_LEN);
        assert!(matches!(outside, HostCopyError::Memory(_)));
        assert!(matches!(unaligned, HostCopyError::Unaligned(0x8004)));
    }
}
