//! What the output capture (`bud_capture.FdCapture`) needs from the kernel that Python's `os`
//! lacks: freeing the part of a capture file already copied out, and resizing the capture
//! file system to a request's output cap.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;

/// Frees the first `length` bytes of file `fd` (`FALLOC_FL_PUNCH_HOLE`): their pages go
/// back to the file system, the file keeps its size and later offsets. On tmpfs this is
/// what keeps a long session's capture files from filling their bounded file system.
pub fn punch_hole(fd: RawFd, length: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(length).map_err(io::Error::other)?;
    // SAFETY: fallocate only acts on the descriptor; no memory is passed.
    let rc = unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Remounts the tmpfs at `path` with `size=bytes` (its other options unchanged). The
/// kernel refuses a size below what the file system holds now (`EINVAL`).
pub fn resize_tmpfs(path: &str, bytes: u64) -> io::Result<()> {
    let target = CString::new(path).map_err(io::Error::other)?;
    let data = CString::new(format!("size={bytes}")).map_err(io::Error::other)?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the call, or null
    // where mount allows it (source and type are ignored by a remount).
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
