//! Guest RAM: the one place that maps and unmaps host memory for a guest.
//!
//! [`GuestRam`] owns one contiguous mapping that backs guest-physical addresses
//! `0..len`: anonymous memory for a fresh boot, or (for clones) a `MAP_PRIVATE` mapping of a
//! template memory file, so writes stay private to the clone and the file is never written.
//! Every access from the VMM goes through bounds-checked [`GuestRam::read`] /
//! [`GuestRam::write`]; the guest itself reaches the memory through KVM. This module must
//! never hand out a reference that outlives the mapping.
//!
//! This file holds the mapping and byte access to it; two submodules add methods to the same
//! type. `pages` works page by page, for resets: [`GuestRam::private_pages`] lists the pages
//! of a clone that hold a private copy (whoever wrote them: guest, KVM or host), and a
//! template's pristine memory is mapped read-only and shared ([`GuestRam::pristine`]): the
//! source of every page a reset restores. `dump` writes guest RAM to files (a template's
//! memory, a layer's pages).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

mod dump;
mod pages;

pub(crate) use pages::set_bits;

/// Size of a guest page.
pub(crate) const PAGE_SIZE: u64 = 4096;

/// Errors of guest memory mapping and access.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("guest RAM size {0:#x} is zero or not a multiple of the page size")]
    BadSize(u64),
    #[error("mmap of {size:#x} bytes of guest RAM failed")]
    Mmap {
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open memory file {path}")]
    OpenFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("memory file {path} holds {actual:#x} bytes, the guest needs {expected:#x}")]
    ShortFile {
        path: String,
        expected: u64,
        actual: u64,
    },
    #[error("guest access {addr:#x}+{len:#x} is outside guest RAM of {size:#x} bytes")]
    OutOfRange { addr: u64, len: u64, size: u64 },
    #[error("cannot describe guest RAM to vm-memory: {0}")]
    Region(String),
    #[error("guest RAM mapping is read-only")]
    ReadOnly,
    #[error("cannot copy pages between guest RAM mappings of {0:#x} and {1:#x} bytes")]
    SizeMismatch(u64, u64),
    #[error("madvise on guest RAM failed: {0}")]
    Madvise(std::io::Error),
    #[error("the host's getrandom failed: {0}")]
    HostRandom(std::io::Error),
}

/// One contiguous host mapping backing guest-physical `0..len()`.
#[derive(Debug)]
pub struct GuestRam {
    ptr: NonNull<u8>,
    len: u64,
    writable: bool,
}

// SAFETY: `GuestRam` owns its mapping exclusively; the raw pointer is only dereferenced through
// bounds-checked methods, so moving it to another thread is as safe as moving a `Vec<u8>`.
unsafe impl Send for GuestRam {}
// SAFETY: shared references only read through bounds-checked copies; concurrent writers go
// through `&mut self` or through KVM (the guest), exactly like any memory shared with a guest.
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// Maps `len` bytes of zeroed anonymous memory (lazily populated, no swap reservation).
    pub fn anonymous(len: u64) -> Result<Self, MemoryError> {
        check_size(len)?;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing aliases no
        // Rust object; the result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        Self::from_mmap_result(ptr, len)
    }

    /// Maps the first `len` bytes of `path` copy-on-write (`MAP_PRIVATE`): guest writes land in
    /// private pages of this process and never reach the file.
    pub fn private_file(path: &Path, len: u64) -> Result<Self, MemoryError> {
        let file = File::open(path).map_err(|source| MemoryError::OpenFile {
            path: path.display().to_string(),
            source,
        })?;
        Self::private_fd(&file, len)
    }

    /// Like [`GuestRam::private_file`], for an already open file (templates keep theirs open).
    ///
    /// The file length is checked first: a mapping past the end of a file raises SIGBUS on
    /// access instead of an error.
    pub(crate) fn private_fd(file: &File, len: u64) -> Result<Self, MemoryError> {
        map_file(
            file,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE,
        )
    }

    /// Maps `file` read-only and shared: the template's pristine memory, the source a reset
    /// copies pages from. Every access through it is a read; [`GuestRam::write`] refuses.
    pub(crate) fn pristine(file: &File, len: u64) -> Result<Self, MemoryError> {
        let mut ram = map_file(file, len, libc::PROT_READ, libc::MAP_SHARED)?;
        ram.writable = false;
        Ok(ram)
    }

    fn from_mmap_result(ptr: *mut libc::c_void, len: u64) -> Result<Self, MemoryError> {
        if ptr == libc::MAP_FAILED {
            return Err(MemoryError::Mmap {
                size: len,
                source: std::io::Error::last_os_error(),
            });
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(MemoryError::Mmap {
            size: len,
            source: std::io::Error::other("mmap returned NULL"),
        })?;
        Ok(Self {
            ptr,
            len,
            writable: true,
        })
    }

    /// Number of pages.
    pub(crate) fn pages(&self) -> u64 {
        self.len / PAGE_SIZE
    }

    /// Size of guest RAM in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Host virtual address of guest-physical 0, for `KVM_SET_USER_MEMORY_REGION`.
    pub(crate) fn host_address(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn check_range(&self, addr: u64, len: usize) -> Result<usize, MemoryError> {
        let len64 = len as u64;
        match addr.checked_add(len64) {
            Some(end) if end <= self.len => Ok(addr as usize),
            _ => Err(MemoryError::OutOfRange {
                addr,
                len: len64,
                size: self.len,
            }),
        }
    }

    /// [`Self::check_range`] for a length the guest chose (a `u64`): the offset into the
    /// mapping and the length, both inside it.
    fn check_guest_range(&self, addr: u64, len: u64) -> Result<(usize, usize), MemoryError> {
        let n = usize::try_from(len).map_err(|_| MemoryError::OutOfRange {
            addr,
            len,
            size: self.len,
        })?;
        Ok((self.check_range(addr, n)?, n))
    }

    /// Copies `data` into guest memory at guest-physical `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        if !self.writable {
            return Err(MemoryError::ReadOnly);
        }
        let offset = self.check_range(addr, data.len())?;
        // SAFETY: `offset + data.len() <= self.len` (checked), so the destination lies inside
        // our mapping, which cannot overlap `data` (a Rust object outside guest RAM). Guest RAM
        // is plain shared memory: a byte copy is valid whatever the guest does concurrently.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Zeroes guest-physical `addr..addr + len` (the host-zero port, see
    /// [`crate::devices::host_zero`]). Pages of a clone that still share the template's file
    /// become private copies, as they would on a guest write, so resets see them.
    pub(crate) fn zero(&self, addr: u64, len: u64) -> Result<(), MemoryError> {
        if !self.writable {
            return Err(MemoryError::ReadOnly);
        }
        let (offset, len) = self.check_guest_range(addr, len)?;
        // SAFETY: `offset + len <= self.len` (checked), so the range lies inside our mapping;
        // guest RAM is plain shared memory, so a byte store is valid whatever the guest does
        // concurrently (the only vCPU is stopped in this `out` meanwhile).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, len) };
        Ok(())
    }

    /// Fills guest-physical `addr..addr + len` with fresh bytes from the host's CSPRNG
    /// (`getrandom(2)`, the host-random port, see [`crate::devices::host_random`]). Pages of a
    /// clone that still share the template's file become private copies, as for [`Self::zero`].
    pub(crate) fn fill_random(&self, addr: u64, len: u64) -> Result<(), MemoryError> {
        if !self.writable {
            return Err(MemoryError::ReadOnly);
        }
        let (offset, len) = self.check_guest_range(addr, len)?;
        let mut done = 0;
        while done < len {
            // SAFETY: `offset + len <= self.len` (checked), so `offset + done .. offset + len`
            // lies inside our mapping; getrandom only writes that many bytes there, and guest
            // RAM is plain shared memory, so a byte store is valid whatever the guest does
            // concurrently (the only vCPU is stopped in this `out` meanwhile).
            let n = unsafe {
                libc::getrandom(self.ptr.as_ptr().add(offset + done).cast(), len - done, 0)
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                // A signal (the vCPU kick) interrupted it: go on, the bytes are still owed.
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(MemoryError::HostRandom(e));
            }
            if n == 0 {
                return Err(MemoryError::HostRandom(std::io::Error::other(
                    "getrandom returned no bytes",
                )));
            }
            // getrandom may return fewer bytes than asked (a signal, or more than 32 MiB).
            done += n as usize;
        }
        Ok(())
    }

    /// Copies `len` bytes from guest-physical `src` to guest-physical `dst` (the ranges may
    /// overlap; the host-copy port, see [`crate::devices::host_copy`]).
    pub(crate) fn copy_within(&self, src: u64, dst: u64, len: u64) -> Result<(), MemoryError> {
        if !self.writable {
            return Err(MemoryError::ReadOnly);
        }
        let (from, n) = self.check_guest_range(src, len)?;
        let (to, _) = self.check_guest_range(dst, len)?;
        // SAFETY: both ranges lie inside our mapping (checked); `ptr::copy` allows overlap;
        // guest RAM is plain shared memory (the only vCPU is stopped in the `out` meanwhile).
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(from), self.ptr.as_ptr().add(to), n) };
        Ok(())
    }

    /// Copies guest memory at guest-physical `addr` into `buf`.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let offset = self.check_range(addr, buf.len())?;
        // SAFETY: `offset + buf.len() <= self.len` (checked); source and destination do not
        // overlap; any bit pattern is a valid `u8`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        Ok(())
    }

    /// Writes a little-endian `u64` at guest-physical `addr`.
    pub fn write_u64(&self, addr: u64, value: u64) -> Result<(), MemoryError> {
        self.write(addr, &value.to_le_bytes())
    }

    /// Reads a little-endian `u64` at guest-physical `addr`.
    pub(crate) fn read_u64(&self, addr: u64) -> Result<u64, MemoryError> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Runs `f` with a vm-memory view of this RAM (for linux-loader). The view borrows the
    /// mapping and cannot escape the closure, so it never outlives it.
    pub(crate) fn with_guest_memory<R>(
        &self,
        f: impl FnOnce(&GuestMemoryMmap) -> R,
    ) -> Result<R, MemoryError> {
        // SAFETY: the pointer and length describe our live mapping with these protections and
        // flags; `build_raw` does not take ownership (it never unmaps), and the view is dropped
        // at the end of this function, while `self` (and so the mapping) is still borrowed.
        let region = unsafe {
            MmapRegion::<()>::build_raw(
                self.ptr.as_ptr(),
                self.len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
            )
        }
        .map_err(|e| MemoryError::Region(e.to_string()))?;
        let region = GuestRegionMmap::new(region, GuestAddress(0))
            .ok_or_else(|| MemoryError::Region("region overflows the address space".into()))?;
        let mem = GuestMemoryMmap::from_regions(vec![region])
            .map_err(|e| MemoryError::Region(e.to_string()))?;
        Ok(f(&mem))
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: we own this mapping (created in a constructor, never unmapped elsewhere) and
        // no reference into it outlives `self`.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len as usize) };
        // A failed munmap means the address or length is wrong: a bug worth crashing loudly on
        // in debug builds, and leaking (not corrupting) in release builds.
        debug_assert_eq!(
            rc,
            0,
            "munmap of guest RAM failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Maps the first `len` bytes of `file`, after checking that the size is whole pages and
/// that the file is that long (a mapping past its end would raise SIGBUS on access instead of
/// an error; bud never truncates a template file).
fn map_file(
    file: &File,
    len: u64,
    prot: libc::c_int,
    flags: libc::c_int,
) -> Result<GuestRam, MemoryError> {
    check_size(len)?;
    check_file_len(file, len)?;
    // SAFETY: a new mapping of an open file at an address of the kernel's choosing; it
    // aliases no Rust object and the result is checked by `from_mmap_result`.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            prot,
            flags,
            file.as_raw_fd(),
            0,
        )
    };
    GuestRam::from_mmap_result(ptr, len)
}

fn check_file_len(file: &File, len: u64) -> Result<(), MemoryError> {
    let actual = file
        .metadata()
        .map_err(|source| MemoryError::OpenFile {
            path: "(memory file)".into(),
            source,
        })?
        .len();
    if actual < len {
        return Err(MemoryError::ShortFile {
            path: "(memory file)".into(),
            expected: len,
            actual,
        });
    }
    Ok(())
}

fn check_size(len: u64) -> Result<(), MemoryError> {
    if len == 0 || len % PAGE_SIZE != 0 || usize::try_from(len).is_err() {
        return Err(MemoryError::BadSize(len));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_ram_reads_back_what_was_written() {
        let ram = GuestRam::anonymous(16 * PAGE_SIZE).unwrap();

        ram.write(0x1ff8, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
        let mut back = [0u8; 9];
        ram.read(0x1ff8, &mut back).unwrap();

        assert_eq!(back, [1, 2, 3, 4, 5, 6, 7, 8, 9]);
    }

    #[test]
    fn access_past_the_end_is_an_error() {
        let ram = GuestRam::anonymous(PAGE_SIZE).unwrap();

        let err = ram.write(PAGE_SIZE - 4, &[0; 8]).unwrap_err();

        assert!(matches!(err, MemoryError::OutOfRange { .. }));
    }

    #[test]
    fn zeroing_a_clone_range_makes_those_pages_private_zeros_and_leaves_the_rest() {
        let path = std::env::temp_dir().join(format!("bud-zero-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; 4 * PAGE_SIZE as usize]).unwrap();
        let ram = GuestRam::private_file(&path, 4 * PAGE_SIZE).unwrap();
        std::fs::remove_file(&path).unwrap();

        ram.zero(PAGE_SIZE, 2 * PAGE_SIZE).unwrap();
        let mut all = vec![0u8; 4 * PAGE_SIZE as usize];
        ram.read(0, &mut all).unwrap();
        let past_end = ram.zero(3 * PAGE_SIZE, 2 * PAGE_SIZE).unwrap_err();

        let page = PAGE_SIZE as usize;
        assert!(all[..page].iter().all(|&b| b == 7));
        assert!(all[page..3 * page].iter().all(|&b| b == 0));
        assert!(
            all[3 * page..].iter().all(|&b| b == 7),
            "a refused request zeroes nothing"
        );
        assert_eq!(
            ram.private_pages().unwrap(),
            vec![0b110],
            "pages 1 and 2 are private"
        );
        assert!(matches!(past_end, MemoryError::OutOfRange { .. }));
    }

    #[test]
    fn address_overflow_is_an_error_not_a_wrap() {
        let ram = GuestRam::anonymous(PAGE_SIZE).unwrap();

        let err = ram.read_u64(u64::MAX - 3).unwrap_err();

        assert!(matches!(err, MemoryError::OutOfRange { .. }));
    }

    #[test]
    fn size_must_be_whole_pages() {
        assert!(matches!(
            GuestRam::anonymous(100),
            Err(MemoryError::BadSize(100))
        ));
        assert!(matches!(
            GuestRam::anonymous(0),
            Err(MemoryError::BadSize(0))
        ));
    }

    #[test]
    fn private_file_mapping_refuses_a_short_file_and_never_writes_the_file() {
        let dir = std::env::temp_dir().join(format!("bud-mem-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mem");
        std::fs::write(&path, vec![7u8; 2 * PAGE_SIZE as usize]).unwrap();

        let short = GuestRam::private_file(&path, 4 * PAGE_SIZE).unwrap_err();
        let ram = GuestRam::private_file(&path, 2 * PAGE_SIZE).unwrap();
        ram.write(0, &[9u8; 16]).unwrap();
        let mut back = [0u8; 1];
        ram.read(0, &mut back).unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();

        assert!(matches!(short, MemoryError::ShortFile { .. }));
        assert_eq!(back, [9]);
        assert!(on_disk.iter().all(|&b| b == 7));
    }
}
