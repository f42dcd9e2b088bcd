//! The host side of the mailbox: where the guest worker's mailbox lives in guest-physical
//! memory, and bounds-checked access to it.
//!
//! At READY the worker announces its mailbox by guest-virtual address and length (see
//! [`crate::protocol`]). [`Mailbox::locate`] validates both, walks the guest page tables once
//! to find the physical page behind every mailbox page (the pages are locked in the guest and
//! this guest kernel has no swap, compaction or migration, so they never move), and checks the
//! header the guest wrote. Afterwards the host reads and writes the mailbox straight in guest
//! RAM, page by page; every offset is checked against the announced length.

use crate::memory::{GuestRam, MemoryError, PAGE_SIZE};
use crate::paging::{self, PagingError};
use crate::protocol::{MAILBOX_MAGIC, PROTOCOL_VERSION, header};

/// Errors of locating or accessing the mailbox.
#[derive(Debug, thiserror::Error)]
pub enum MailboxError {
    #[error("mailbox address {0:#x} is not page aligned")]
    Unaligned(u64),
    #[error(
        "mailbox length {0:#x} is not a whole number of pages between the header and the maximum"
    )]
    BadLength(u64),
    #[error("mailbox page walk failed: {0}")]
    Paging(#[from] PagingError),
    #[error("mailbox magic is {0:#010x}, expected {MAILBOX_MAGIC:#010x}")]
    BadMagic(u32),
    #[error("guest speaks protocol version {0}, the host speaks {PROTOCOL_VERSION}")]
    VersionMismatch(u32),
    #[error("mailbox access {offset:#x}+{len:#x} is outside its {size:#x} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("mailbox memory access: {0}")]
    Memory(#[from] MemoryError),
}

/// A located mailbox: its guest-physical pages in order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mailbox {
    gva: u64,
    pages: Vec<u64>,
}

impl Mailbox {
    /// Validates the announced mailbox (`gva`, `len`) against guest memory and its header.
    pub fn locate(
        ram: &GuestRam,
        cr3: u64,
        cr4: u64,
        gva: u64,
        len: u64,
    ) -> Result<Self, MailboxError> {
        if gva % PAGE_SIZE != 0 {
            return Err(MailboxError::Unaligned(gva));
        }
        if crate::protocol::mailbox_len_fault(len).is_some() {
            return Err(MailboxError::BadLength(len));
        }
        let pages = paging::translate_pages(ram, cr3, cr4, gva, len)?;
        let mailbox = Self { gva, pages };
        let magic = mailbox.read_u32(ram, header::MAGIC as u64)?;
        if magic != MAILBOX_MAGIC {
            return Err(MailboxError::BadMagic(magic));
        }
        let version = mailbox.read_u32(ram, header::VERSION as u64)?;
        if version != PROTOCOL_VERSION {
            return Err(MailboxError::VersionMismatch(version));
        }
        Ok(mailbox)
    }

    /// A mailbox at `gva` over the guest-physical `pages`, taken as they are (no header
    /// check): for the fuzz targets (`fuzz/`), which put hostile bytes in it.
    #[doc(hidden)]
    pub fn over_pages(gva: u64, pages: Vec<u64>) -> Self {
        Self { gva, pages }
    }

    /// The part of the mailbox at `offset` of `len` bytes (whole pages), as a mailbox of its
    /// own (a [`crate::protocol::lane`]); None if the mailbox is shorter.
    pub(crate) fn lane(&self, offset: usize, len: usize) -> Option<Self> {
        let (first, count) = (offset / PAGE_SIZE as usize, len / PAGE_SIZE as usize);
        let pages = self.pages.get(first..first.checked_add(count)?)?;
        Some(Self {
            gva: self.gva + offset as u64,
            pages: pages.to_vec(),
        })
    }

    /// The guest-virtual address the worker uses.
    pub fn guest_virtual_address(&self) -> u64 {
        self.gva
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.pages.len() as u64 * PAGE_SIZE
    }

    /// Always false: a located mailbox holds at least its header.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Guest-physical address of each page.
    pub fn pages(&self) -> &[u64] {
        &self.pages
    }

    fn check(&self, offset: u64, len: usize) -> Result<(), MailboxError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(MailboxError::OutOfRange {
                offset,
                len: len as u64,
                size: self.len(),
            }),
        }
    }

    /// Reads `buf.len()` bytes at `offset` of the mailbox.
    pub(crate) fn read(
        &self,
        ram: &GuestRam,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), MailboxError> {
        self.check(offset, buf.len())?;
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let in_page = at % PAGE_SIZE;
            let n = ((PAGE_SIZE - in_page) as usize).min(buf.len() - done);
            let page = self.pages[(at / PAGE_SIZE) as usize];
            ram.read(page + in_page, &mut buf[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Writes `data` at `offset` of the mailbox.
    pub fn write(&self, ram: &GuestRam, offset: u64, data: &[u8]) -> Result<(), MailboxError> {
        self.check(offset, data.len())?;
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let in_page = at % PAGE_SIZE;
            let n = ((PAGE_SIZE - in_page) as usize).min(data.len() - done);
            let page = self.pages[(at / PAGE_SIZE) as usize];
            ram.write(page + in_page, &data[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Reads a little-endian `u64` at `offset`.
    pub(crate) fn read_u64(&self, ram: &GuestRam, offset: u64) -> Result<u64, MailboxError> {
        let mut b = [0u8; 8];
        self.read(ram, offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Reads a little-endian `u32` at `offset`.
    pub fn read_u32(&self, ram: &GuestRam, offset: u64) -> Result<u32, MailboxError> {
        let mut b = [0u8; 4];
        self.read(ram, offset, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Maps two scattered physical pages (0x8000, 0x5000) at `GVA` with 4-level tables.
    const GVA: u64 = 0x7f00_0000_0000;
    fn setup(magic: u32, version: u32) -> (GuestRam, u64) {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let (pml4, pdpt, pd, pt) = (0x1000u64, 0x2000u64, 0x3000u64, 0x4000u64);
        let idx = |level: u32| (GVA >> (12 + 9 * (level - 1))) & 0x1ff;
        ram.write_u64(pml4 + idx(4) * 8, pdpt | 7).unwrap();
        ram.write_u64(pdpt + idx(3) * 8, pd | 7).unwrap();
        ram.write_u64(pd + idx(2) * 8, pt | 7).unwrap();
        ram.write_u64(pt + idx(1) * 8, 0x8000 | 7).unwrap();
        ram.write_u64(pt + (idx(1) + 1) * 8, 0x5000 | 7).unwrap();
        ram.write(0x8000, &magic.to_le_bytes()).unwrap();
        ram.write(0x8004, &version.to_le_bytes()).unwrap();
        (ram, pml4)
    }

    #[test]
    fn a_valid_mailbox_is_located_page_by_page() {
        let (ram, cr3) = setup(MAILBOX_MAGIC, PROTOCOL_VERSION);

        let mb = Mailbox::locate(&ram, cr3, 0, GVA, 2 * PAGE_SIZE).unwrap();

        assert_eq!(mb.pages(), &[0x8000, 0x5000]);
        assert_eq!(mb.len(), 8192);
    }

    #[test]
    fn access_across_a_page_boundary_lands_in_both_physical_pages() {
        let (ram, cr3) = setup(MAILBOX_MAGIC, PROTOCOL_VERSION);
        let mb = Mailbox::locate(&ram, cr3, 0, GVA, 2 * PAGE_SIZE).unwrap();

        mb.write(&ram, 4094, b"abcd").unwrap();
        let mut back = [0u8; 4];
        mb.read(&ram, 4094, &mut back).unwrap();
        let mut first = [0u8; 2];
        ram.read(0x8000 + 4094, &mut first).unwrap();
        let mut second = [0u8; 2];
        ram.read(0x5000, &mut second).unwrap();

        assert_eq!(&back, b"abcd");
        assert_eq!(&first, b"ab");
        assert_eq!(&second, b"cd");
    }

    #[test]
    fn access_past_the_announced_length_is_refused() {
        let (ram, cr3) = setup(MAILBOX_MAGIC, PROTOCOL_VERSION);
        let mb = Mailbox::locate(&ram, cr3, 0, GVA, 2 * PAGE_SIZE).unwrap();

        let err = mb.write(&ram, 8190, b"abcd").unwrap_err();

        assert!(matches!(err, MailboxError::OutOfRange { .. }));
    }

    #[test]
    fn bad_magic_version_alignment_and_length_are_refused() {
        let (bad_magic, cr3) = setup(0xdead_beef, PROTOCOL_VERSION);
        let (bad_version, _) = setup(MAILBOX_MAGIC, PROTOCOL_VERSION + 1);
        let (ram, _) = setup(MAILBOX_MAGIC, PROTOCOL_VERSION);

        assert!(matches!(
            Mailbox::locate(&bad_magic, cr3, 0, GVA, PAGE_SIZE),
            Err(MailboxError::BadMagic(0xdead_beef))
        ));
        assert!(matches!(
            Mailbox::locate(&bad_version, cr3, 0, GVA, PAGE_SIZE),
            Err(MailboxError::VersionMismatch(_))
        ));
        assert!(matches!(
            Mailbox::locate(&ram, cr3, 0, GVA + 8, PAGE_SIZE),
            Err(MailboxError::Unaligned(_))
        ));
        assert!(matches!(
            Mailbox::locate(&ram, cr3, 0, GVA, 100),
            Err(MailboxError::BadLength(100))
        ));
        assert!(matches!(
            Mailbox::locate(&ram, cr3, 0, GVA, 1 << 40),
            Err(MailboxError::BadLength(_))
        ));
    }
}
