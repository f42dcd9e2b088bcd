//! The worker's mailbox: one locked, pre-touched shared mapping of a memfd per process.
//!
//! Owns the mapping, its memfd and its header. The memory is a memfd mapped shared, not
//! anonymous private memory, so that a kernel runtime's process (a warm Node.js that rings
//! the doorbell itself, `guest/python/bud_runtime.py`) maps the very same pages: the host
//! finds the mailbox once, by guest-physical page, whichever process rings. It is made once, before READY, and never unmapped: the
//! host learns its address at READY and reads and writes it straight in guest memory from
//! then on, so it must stay put, resident and writable for the life of the process. The
//! mapping is made so that a job never takes a page fault in it:
//! - `mlock` populates every page in the kernel (write faults, so real private pages);
//! - every page is then touched from user space as well;
//! - `MADV_DONTFORK`: a child (a shell job) does not inherit it, so a fork never
//!   write-protects it and the worker's next write into it is not a copy-on-write fault.

use std::io;
use std::ptr::NonNull;
use std::sync::OnceLock;

use crate::protocol::{MAILBOX_MAGIC, PROTOCOL_VERSION, header, mailbox_len_fault};

/// Page size of the guest (x86-64).
pub const PAGE_SIZE: usize = 4096;

/// The process's mailbox, once created.
static MAILBOX: OnceLock<Mailbox> = OnceLock::new();

/// Why a mailbox could not be made.
#[derive(Debug)]
pub enum MailboxError {
    /// The requested size breaks the protocol's rules.
    BadSize { size: usize, reason: &'static str },
    /// This process already has its mailbox.
    AlreadyCreated,
    /// A system call failed.
    Os { op: &'static str, source: io::Error },
}

/// A live mailbox: address and length of a mapping that is never unmapped, and its memfd.
#[derive(Debug)]
pub struct Mailbox {
    addr: usize,
    len: usize,
    fd: i32,
}

impl Mailbox {
    /// Guest-virtual address (page aligned).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Length in bytes (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// The memfd behind it (close-on-exec; open for the life of the process).
    pub fn fd(&self) -> i32 {
        self.fd
    }

    /// Writes `CLOCK_REALTIME` now into `header::READY_WALL_NS` (a vDSO read, no syscall).
    pub fn set_ready_wall_clock(&self) {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec.
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
        let ns = (ts.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(ts.tv_nsec as u64);
        let at = header::READY_WALL_NS;
        // SAFETY: the mapping is at least `header::SIZE` bytes (checked at creation) and
        // `READY_WALL_NS + 8 <= header::SIZE`; an unaligned-safe byte copy into memory only
        // this process and the host touch.
        unsafe {
            std::ptr::copy_nonoverlapping(ns.to_le_bytes().as_ptr(), self.as_ptr().add(at), 8)
        };
    }

    /// Start of the memory, for building views on it.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }
}

/// The mailbox, if this process made one.
pub fn get() -> Option<&'static Mailbox> {
    MAILBOX.get()
}

/// Makes the process's mailbox of `size` bytes (see the module docs for how).
pub fn create(size: usize) -> Result<&'static Mailbox, MailboxError> {
    check_size(size)?;
    if MAILBOX.get().is_some() {
        return Err(MailboxError::AlreadyCreated);
    }
    let mut mapping = Mapping::new(size)?;
    mapping.madvise(libc::MADV_DONTFORK, "madvise(MADV_DONTFORK)")?;
    mapping.lock()?;
    let bytes = mapping.bytes_mut();
    for page in bytes.chunks_mut(PAGE_SIZE) {
        // Volatile, so the store of a zero over a zero is really made.
        // SAFETY: `page` is a live, exclusively borrowed, non-empty chunk of the mapping.
        unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
    }
    write_header(bytes);
    let mailbox = Mailbox {
        addr: mapping.addr.as_ptr() as usize,
        len: size,
        fd: mapping.fd,
    };
    MAILBOX
        .set(mailbox)
        .map_err(|_| MailboxError::AlreadyCreated)?;
    // From here the mapping belongs to MAILBOX, for the life of the process.
    std::mem::forget(mapping);
    MAILBOX.get().ok_or(MailboxError::AlreadyCreated)
}

/// Checks a requested size against the protocol: whole pages, room for the header, at most
/// [`MAILBOX_MAX_SIZE`].
pub fn check_size(size: usize) -> Result<(), MailboxError> {
    match mailbox_len_fault(size as u64) {
        None => Ok(()),
        Some(reason) => Err(MailboxError::BadSize { size, reason }),
    }
}

/// Writes the header (magic, version; the rest of it zero) at the start of `buf`.
pub fn write_header(buf: &mut [u8]) {
    let Some(head) = buf.get_mut(..header::SIZE) else {
        return;
    };
    head.fill(0);
    head[header::MAGIC..header::MAGIC + 4].copy_from_slice(&MAILBOX_MAGIC.to_le_bytes());
    head[header::VERSION..header::VERSION + 4].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
}

/// A shared read-write mapping of a fresh memfd, unmapped and closed on drop unless
/// forgotten.
struct Mapping {
    addr: NonNull<u8>,
    len: usize,
    fd: i32,
}

impl Mapping {
    fn new(len: usize) -> Result<Self, MailboxError> {
        // SAFETY: the name is a NUL-terminated string; the flags ask for a new memfd.
        let fd = unsafe { libc::memfd_create(c"bud-mailbox".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("memfd_create"));
        }
        let close = |err| {
            // SAFETY: `fd` is the memfd made above, owned here and not used after.
            unsafe { libc::close(fd) };
            err
        };
        let size = libc::off_t::try_from(len).map_err(|_| {
            close(MailboxError::BadSize {
                size: len,
                reason: "larger than a file offset",
            })
        })?;
        // SAFETY: sizes the memfd made above; no memory is involved.
        if unsafe { libc::ftruncate(fd, size) } != 0 {
            return Err(close(os_error("ftruncate")));
        }
        // SAFETY: a fresh shared mapping of our own memfd at an address of the kernel's
        // choice; it overlaps nothing and nothing else refers to it.
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
            return Err(close(os_error("mmap")));
        }
        let addr = NonNull::new(addr.cast::<u8>()).ok_or_else(|| close(os_error("mmap")))?;
        Ok(Self { addr, len, fd })
    }

    fn madvise(&mut self, advice: libc::c_int, op: &'static str) -> Result<(), MailboxError> {
        // SAFETY: advice on exactly our own mapping; these advices never discard data.
        if unsafe { libc::madvise(self.addr.as_ptr().cast(), self.len, advice) } != 0 {
            return Err(os_error(op));
        }
        Ok(())
    }

    fn lock(&mut self) -> Result<(), MailboxError> {
        // SAFETY: locks exactly our own mapping; mlock changes residency, not contents.
        if unsafe { libc::mlock(self.addr.as_ptr().cast(), self.len) } != 0 {
            return Err(os_error("mlock"));
        }
        Ok(())
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` readable and writable bytes, alive as long as self,
        // and `&mut self` makes this the only reference into it.
        unsafe { std::slice::from_raw_parts_mut(self.addr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this value owns; no reference into it outlives
        // self (bytes_mut borrows self).
        let rc = unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
        // SAFETY: closes the memfd this value owns; nothing else holds this number.
        unsafe { libc::close(self.fd) };
        // A failed munmap of our own mapping means the bookkeeping is wrong; nothing to do
        // but say so (a Drop cannot return errors and must not panic into Python).
        if rc != 0 {
            eprintln!("_bud: munmap: {}", io::Error::last_os_error());
        }
    }
}

fn os_error(op: &'static str) -> MailboxError {
    MailboxError::Os {
        op,
        source: io::Error::last_os_error(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{MAILBOX_DEFAULT_SIZE, MAILBOX_MAX_SIZE};

    #[test]
    fn default_size_is_accepted() {
        assert!(check_size(MAILBOX_DEFAULT_SIZE).is_ok());
    }

    #[test]
    fn size_that_is_not_whole_pages_is_refused() {
        let result = check_size(PAGE_SIZE + 1);

        assert!(matches!(result, Err(MailboxError::BadSize { size, .. }) if size == 4097));
    }

    #[test]
    fn size_below_the_header_is_refused() {
        assert!(matches!(check_size(0), Err(MailboxError::BadSize { .. })));
    }

    #[test]
    fn size_above_the_maximum_is_refused() {
        let result = check_size(MAILBOX_MAX_SIZE + PAGE_SIZE);

        assert!(matches!(result, Err(MailboxError::BadSize { .. })));
    }

    #[test]
    fn header_holds_magic_and_version_little_endian_and_zeros() {
        let mut buf = vec![0xaa_u8; PAGE_SIZE];

        write_header(&mut buf);

        assert_eq!(&buf[..4], b"BUDM");
        assert_eq!(&buf[4..8], &PROTOCOL_VERSION.to_le_bytes());
        assert!(buf[8..header::SIZE].iter().all(|&b| b == 0));
        assert_eq!(buf[header::SIZE], 0xaa);
    }

    #[test]
    fn mapping_is_writable_and_unmapped_on_drop() {
        let mut mapping = Mapping::new(2 * PAGE_SIZE).expect("mmap");

        mapping.bytes_mut()[PAGE_SIZE] = 7;

        assert_eq!(mapping.bytes_mut()[PAGE_SIZE], 7);
    }
}
