//! The kernel's mailbox: the parent's memfd, mapped shared, locked and touched, once per
//! process.
//!
//! The parent (the Python worker) makes the mailbox, a memfd, writes into it and hands the
//! descriptor to node. Node maps it here and never unmaps it: the host reaches the memory
//! through the guest page tables, so it must stay put, resident and writable for the life of
//! the process, and no job may take a page fault in it:
//! - `MAP_SHARED`: the parent and node see each other's writes;
//! - `mlock` makes every page resident and keeps it so;
//! - every page is then touched from user space, a volatile read of one byte and a volatile
//!   write of the same byte back (so the page is mapped writable in node's page tables
//!   without changing what the parent put there). The touch assumes nobody else writes that
//!   byte at the same moment: the parent waits for node while it maps;
//! - `MADV_DONTFORK`: a child of node (`child_process`) does not inherit the mapping.

use std::ffi::c_int;
use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::{Mutex, PoisonError};

use crate::protocol::mailbox_len_fault;

/// Page size of the guest (x86-64).
pub const PAGE_SIZE: usize = 4096;

/// Address and length of the process's mailbox, once mapped (never unmapped after).
static MAILBOX: Mutex<Option<(usize, usize)>> = Mutex::new(None);

/// Why the mailbox could not be mapped.
#[derive(Debug)]
pub enum MapError {
    /// The requested length breaks the protocol's rules.
    BadLength { len: usize, reason: &'static str },
    /// The file behind the descriptor is shorter than the requested length (touching the
    /// pages past its end would kill node with SIGBUS).
    FileTooShort { fd: c_int, size: u64, len: usize },
    /// This process already mapped its mailbox.
    AlreadyMapped,
    /// A system call failed.
    Os { op: &'static str, source: io::Error },
}

impl fmt::Display for MapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadLength { len, reason } => write!(f, "length {len}: {reason}"),
            Self::FileTooShort { fd, size, len } => {
                write!(f, "fd {fd} holds {size} bytes, fewer than length {len}")
            }
            Self::AlreadyMapped => write!(f, "this process already mapped its mailbox"),
            Self::Os { op, source } => write!(f, "{op}: {source}"),
        }
    }
}

/// Checks a requested length against the protocol: room for the header, whole pages, at
/// most [`MAILBOX_MAX_SIZE`] (the rules, and reasons, of the Python worker's mailbox).
pub fn check_length(len: usize) -> Result<(), MapError> {
    match mailbox_len_fault(len as u64) {
        None => Ok(()),
        Some(reason) => Err(MapError::BadLength { len, reason }),
    }
}

/// The mailbox's address in this process, once mapped (what READY announces: the host finds
/// its guest-physical pages through this process's page tables).
pub fn address() -> Option<usize> {
    let slot = MAILBOX.lock().unwrap_or_else(PoisonError::into_inner);
    slot.map(|(addr, _)| addr)
}

/// Maps `len` bytes of `fd` as the process's mailbox (see the module docs) and hands the
/// mapping to `publish` (which makes the JS view of it). If `publish` succeeds, the mapping
/// stays for the life of the process and later calls fail with
/// [`MapError::AlreadyMapped`]; if anything fails, nothing stays mapped and a later call may
/// try again.
pub fn map_once<T, E: From<MapError>>(
    fd: c_int,
    len: usize,
    publish: impl FnOnce(&Mapping) -> Result<T, E>,
) -> Result<T, E> {
    check_length(len)?;
    // Held throughout, so two threads (worker_threads) cannot both map one.
    let mut slot = MAILBOX.lock().unwrap_or_else(PoisonError::into_inner);
    if slot.is_some() {
        return Err(MapError::AlreadyMapped.into());
    }
    let mapping = Mapping::new(fd, len)?;
    let published = publish(&mapping)?;
    *slot = Some(mapping.keep());
    Ok(published)
}

/// A shared read-write mapping of a file, locked and touched; unmapped on drop unless kept.
#[derive(Debug)]
pub struct Mapping {
    addr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    /// Maps, locks, touches and `MADV_DONTFORK`s the first `len` bytes of `fd`.
    pub fn new(fd: c_int, len: usize) -> Result<Self, MapError> {
        let size = file_size(fd)?;
        if size < len as u64 {
            return Err(MapError::FileTooShort { fd, size, len });
        }
        // SAFETY: a new shared mapping at an address of the kernel's choice; it overlaps
        // nothing of ours and nothing else in this process refers to it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        let addr = NonNull::new(addr.cast::<u8>()).ok_or_else(|| os_error("mmap"))?;
        // From here `mapping` unmaps on an early return.
        let mapping = Self { addr, len };
        // SAFETY: locks exactly our own mapping; mlock changes residency, not contents.
        if unsafe { libc::mlock(mapping.addr.as_ptr().cast(), len) } != 0 {
            return Err(os_error("mlock"));
        }
        mapping.touch();
        // SAFETY: advice on exactly our own mapping; MADV_DONTFORK discards no data.
        if unsafe { libc::madvise(mapping.addr.as_ptr().cast(), len, libc::MADV_DONTFORK) } != 0 {
            return Err(os_error("madvise(MADV_DONTFORK)"));
        }
        Ok(mapping)
    }

    /// Reads one byte of every page and writes it back, volatile so both accesses are made.
    fn touch(&self) {
        for offset in (0..self.len).step_by(PAGE_SIZE) {
            // SAFETY: offset < len, so the byte lies in our live read-write mapping, within
            // the file (checked against its size); raw volatile accesses make no reference
            // that another writer of the shared memory could invalidate.
            unsafe {
                let byte = self.addr.as_ptr().add(offset);
                std::ptr::write_volatile(byte, std::ptr::read_volatile(byte));
            }
        }
    }

    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr.as_ptr()
    }

    /// Length in bytes (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Keeps the mapping for the life of the process; returns its address and length.
    fn keep(self) -> (usize, usize) {
        let kept = (self.addr.as_ptr() as usize, self.len);
        std::mem::forget(self);
        kept
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this value owns; nothing made from it outlives
        // it (map_once keeps a mapping whose address it published).
        let rc = unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
        // A failed munmap of our own mapping means the bookkeeping is wrong; nothing to do
        // but say so (a Drop cannot return errors and must not panic into node).
        if rc != 0 {
            eprintln!("bud.node: munmap: {}", io::Error::last_os_error());
        }
    }
}

fn file_size(fd: c_int) -> Result<u64, MapError> {
    // SAFETY: all-zero bytes are a valid `struct stat` (integers only).
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes only into `stat`, a valid, writable struct stat.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 {
        return Err(os_error("fstat"));
    }
    Ok(u64::try_from(stat.st_size).unwrap_or(0))
}

fn os_error(op: &'static str) -> MapError {
    MapError::Os {
        op,
        source: io::Error::last_os_error(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{MAILBOX_DEFAULT_SIZE, MAILBOX_MAX_SIZE};

    /// A memfd of `len` bytes holding `byte(i)` at offset i.
    fn memfd(len: usize, byte: impl Fn(usize) -> u8) -> std::fs::File {
        use std::io::Write;
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor
        // (or -1), which the File below then owns alone.
        let fd = unsafe { libc::memfd_create(c"bud-nodeext-unit".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: fd is a fresh descriptor nobody else owns.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        let data: Vec<u8> = (0..len).map(byte).collect();
        file.write_all(&data).expect("write memfd");
        file
    }

    fn pattern(i: usize) -> u8 {
        (i % 251) as u8 ^ 0x5a
    }

    #[test]
    fn default_size_is_accepted() {
        assert!(check_length(MAILBOX_DEFAULT_SIZE).is_ok());
    }

    #[test]
    fn length_that_is_not_whole_pages_is_refused() {
        let error = check_length(PAGE_SIZE + 1).expect_err("refused");

        assert_eq!(
            error.to_string(),
            "length 4097: not a whole number of pages"
        );
    }

    #[test]
    fn length_below_the_header_is_refused() {
        let error = check_length(0).expect_err("refused");

        assert_eq!(
            error.to_string(),
            "length 0: smaller than the mailbox header"
        );
    }

    #[test]
    fn length_above_the_maximum_is_refused() {
        let error = check_length(MAILBOX_MAX_SIZE + PAGE_SIZE).expect_err("refused");

        assert!(matches!(error, MapError::BadLength { reason, .. } if reason.contains("MAX")));
    }

    #[test]
    fn mapping_keeps_the_data_and_shares_writes() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        let file = memfd(2 * PAGE_SIZE, pattern);

        let mapping = Mapping::new(file.as_raw_fd(), 2 * PAGE_SIZE).expect("map");
        // SAFETY: the mapping is 2 pages of live read-write memory, only read and written
        // here while `mapping` lives.
        let bytes = unsafe { std::slice::from_raw_parts_mut(mapping.as_ptr(), mapping.len()) };
        let kept = bytes.iter().enumerate().all(|(i, &b)| b == pattern(i));
        bytes[PAGE_SIZE] = 0xee;
        let mut seen = [0_u8; 1];
        file.read_exact_at(&mut seen, PAGE_SIZE as u64)
            .expect("read memfd");

        assert!(kept, "the touch changed the data");
        assert_eq!(seen, [0xee]);
    }

    #[test]
    fn file_shorter_than_the_length_is_refused() {
        use std::os::fd::AsRawFd;
        let file = memfd(PAGE_SIZE, pattern);

        let error = Mapping::new(file.as_raw_fd(), 2 * PAGE_SIZE).expect_err("refused");

        assert!(matches!(
            error,
            MapError::FileTooShort {
                size: 4096,
                len: 8192,
                ..
            }
        ));
    }
}
