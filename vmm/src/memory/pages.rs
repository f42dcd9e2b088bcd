//! Page-granular work on guest RAM, for resets: which pages of a clone hold a private copy,
//! which of those differ from the template's pristine memory, copying pages back from it,
//! and giving private pages back to the file; and [`set_bits`], a bitmap's page numbers.

use std::fs::File;

use super::{GuestRam, MemoryError, PAGE_SIZE};

impl GuestRam {
    /// Copies the pages whose bits are set in `bitmap` from `src` (same size) into this RAM.
    /// Returns the number of pages copied.
    pub(crate) fn copy_pages_from(
        &self,
        src: &GuestRam,
        bitmap: &[u64],
    ) -> Result<u64, MemoryError> {
        if !self.writable {
            return Err(MemoryError::ReadOnly);
        }
        if src.len != self.len {
            return Err(MemoryError::SizeMismatch(self.len, src.len));
        }
        let mut copied = 0;
        for page in set_bits(bitmap) {
            let offset = self.check_range(page * PAGE_SIZE, PAGE_SIZE as usize)?;
            // SAFETY: both mappings are `len` bytes long and `offset + PAGE_SIZE <= len`
            // (checked); they are distinct mappings, so the ranges do not overlap. Guest RAM is
            // plain shared memory: a byte copy is valid whatever the guest does concurrently.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.ptr.as_ptr().add(offset),
                    self.ptr.as_ptr().add(offset),
                    PAGE_SIZE as usize,
                )
            };
            copied += 1;
        }
        Ok(copied)
    }

    /// Gives up the private copies of the pages set in `bitmap` (`MADV_DONTNEED` on each run
    /// of them): in a clone's `MAP_PRIVATE` mapping of its template file they read as the file
    /// again, and their host memory is freed. Only meant for pages whose contents equal the
    /// file (a VM just [reset](crate::reset::reset)); otherwise the guest sees them change.
    /// KVM learns of it through its MMU notifier and drops its mappings of those pages (the
    /// guest refaults them). Returns the number of pages given up.
    pub(crate) fn drop_private_pages(&self, bitmap: &[u64]) -> Result<u64, MemoryError> {
        self.advise_runs(bitmap, libc::MADV_DONTNEED)
    }

    /// Makes the pages set in `bitmap` private copies now (`MADV_POPULATE_WRITE` on each run
    /// of them: in a `MAP_PRIVATE` mapping, what the guest's first write to each would do),
    /// with their contents unchanged. Done before the guest touches them, each copy is made
    /// where the host page table has no entry yet, which no MMU notifier hears of; the same
    /// copy made by the guest's write to a page it read first replaces a read-only entry,
    /// and that calls the notifier of every VM of this process (the host walks each VM's
    /// memory slots and caches: a cost that grows with the number of VMs, measured in
    /// docs/measurements.md, "Many sessions on one server"). Returns the number of pages.
    pub(crate) fn populate_private(&self, bitmap: &[u64]) -> Result<u64, MemoryError> {
        self.advise_runs(bitmap, libc::MADV_POPULATE_WRITE)
    }

    /// `madvise(advice)` on each run of consecutive pages set in `bitmap`; the pages advised.
    fn advise_runs(&self, bitmap: &[u64], advice: libc::c_int) -> Result<u64, MemoryError> {
        if !self.writable {
            return Err(MemoryError::ReadOnly);
        }
        let mut advised = 0;
        let mut pages = set_bits(bitmap).peekable();
        while let Some(first) = pages.next() {
            let mut end = first + 1;
            while pages.next_if_eq(&end).is_some() {
                end += 1;
            }
            let offset =
                self.check_range(first * PAGE_SIZE, ((end - first) * PAGE_SIZE) as usize)?;
            // SAFETY: the range lies inside this mapping (checked) and is page aligned; no Rust
            // reference into guest RAM exists (every access copies), so replacing the pages
            // (MADV_DONTNEED: the file's again; MADV_POPULATE_WRITE: a private copy of the
            // same bytes) invalidates nothing the compiler relies on.
            let r = unsafe {
                libc::madvise(
                    self.ptr.as_ptr().add(offset).cast(),
                    ((end - first) * PAGE_SIZE) as usize,
                    advice,
                )
            };
            if r != 0 {
                return Err(MemoryError::Madvise(std::io::Error::last_os_error()));
            }
            advised += end - first;
        }
        Ok(advised)
    }

    /// The pages of this mapping that hold a private copy (a `MAP_PRIVATE` page someone
    /// wrote: guest, KVM or host), as a bitmap, from `/proc/self/pagemap`: present and not a
    /// file page (bit 63 set, bit 61 clear), or swapped out (bit 62). Every other page is the
    /// file's page, so this is every page that can differ from the file.
    pub(crate) fn private_pages(&self) -> std::io::Result<Vec<u64>> {
        use std::os::unix::fs::FileExt;
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        const FILE: u64 = 1 << 61;
        let pagemap = File::open("/proc/self/pagemap")?;
        let pages = self.pages() as usize;
        let mut bitmap = vec![0u64; pages.div_ceil(64)];
        let mut buf = vec![0u8; 8 * 4096];
        let first = self.host_address() / PAGE_SIZE;
        let mut page = 0usize;
        while page < pages {
            let n = (pages - page).min(buf.len() / 8);
            pagemap.read_exact_at(&mut buf[..n * 8], (first + page as u64) * 8)?;
            for (i, entry) in buf[..n * 8].chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(entry.try_into().unwrap_or([0; 8]));
                if (e & PRESENT != 0 && e & FILE == 0) || e & SWAPPED != 0 {
                    let p = page + i;
                    bitmap[p / 64] |= 1 << (p % 64);
                }
            }
            page += n;
        }
        Ok(bitmap)
    }

    /// Of the pages set in `bitmap`, those whose contents differ from `other` (same size), as
    /// a bitmap.
    pub(crate) fn differing_in(
        &self,
        other: &GuestRam,
        bitmap: &[u64],
    ) -> Result<Vec<u64>, MemoryError> {
        if other.len != self.len {
            return Err(MemoryError::SizeMismatch(self.len, other.len));
        }
        let mut out = vec![0u64; bitmap.len()];
        for n in set_bits(bitmap) {
            if self.page_differs(other, n)? {
                out[(n / 64) as usize] |= 1 << (n % 64);
            }
        }
        Ok(out)
    }

    /// Whether page `n` differs between this RAM and `other` (the callers check both are the
    /// same size).
    fn page_differs(&self, other: &GuestRam, n: u64) -> Result<bool, MemoryError> {
        let at = self.check_range(n * PAGE_SIZE, PAGE_SIZE as usize)?;
        // SAFETY: `at + PAGE_SIZE <= len` for both mappings (checked, same length); reads of
        // plain memory into slices that live only for this comparison.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(self.ptr.as_ptr().add(at), PAGE_SIZE as usize),
                std::slice::from_raw_parts(other.ptr.as_ptr().add(at), PAGE_SIZE as usize),
            )
        };
        Ok(a != b)
    }

    /// Guest-physical page numbers whose contents differ between this RAM and `other` (same
    /// size), in order; at most `limit` of them. Reads every page of both.
    pub(crate) fn differing_pages(
        &self,
        other: &GuestRam,
        limit: usize,
    ) -> Result<Vec<u64>, MemoryError> {
        if other.len != self.len {
            return Err(MemoryError::SizeMismatch(self.len, other.len));
        }
        let mut out = Vec::new();
        for n in 0..self.pages() {
            if self.page_differs(other, n)? {
                out.push(n);
                if out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }
}

/// The page numbers whose bits are set in a dirty bitmap, in order.
pub(crate) fn set_bits(bitmap: &[u64]) -> impl Iterator<Item = u64> + '_ {
    bitmap.iter().enumerate().flat_map(|(i, &word)| {
        let mut w = word;
        std::iter::from_fn(move || {
            if w == 0 {
                return None;
            }
            let bit = w.trailing_zeros() as u64;
            w &= w - 1;
            Some(i as u64 * 64 + bit)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copied_pages_match_the_source_and_others_are_untouched() {
        let path = std::env::temp_dir().join(format!("bud-pristine-{}", std::process::id()));
        std::fs::write(&path, vec![5u8; 4 * PAGE_SIZE as usize]).unwrap();
        let file = File::open(&path).unwrap();
        let pristine = GuestRam::pristine(&file, 4 * PAGE_SIZE).unwrap();
        let ram = GuestRam::private_fd(&file, 4 * PAGE_SIZE).unwrap();
        std::fs::remove_file(&path).unwrap();
        ram.write(0, &[9; 8]).unwrap();
        ram.write(2 * PAGE_SIZE, &[9; 8]).unwrap();
        ram.write(3 * PAGE_SIZE, &[5; 8]).unwrap(); // private, same bytes as the file

        let private = ram.private_pages().unwrap();
        let differ = ram.differing_in(&pristine, &private).unwrap();
        let before = ram.differing_pages(&pristine, 10).unwrap();
        let copied = ram.copy_pages_from(&pristine, &[differ[0] & 1]).unwrap();
        let after = ram.differing_pages(&pristine, 10).unwrap();

        assert_eq!(private, vec![0b1101]);
        assert_eq!(differ, vec![0b0101]);
        assert_eq!(before, vec![0, 2]);
        assert_eq!(copied, 1);
        assert_eq!(after, vec![2]);
        assert!(matches!(
            pristine.write(0, &[1]),
            Err(MemoryError::ReadOnly)
        ));
    }

    #[test]
    fn set_bits_lists_pages_across_words() {
        let bits: Vec<u64> = set_bits(&[0b101, 0, 1 << 63]).collect();

        assert_eq!(bits, vec![0, 2, 191]);
    }
}
