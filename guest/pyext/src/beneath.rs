//! `open_beneath`: a path of the work directory opened in one system call, for the file
//! operations (`guest/python/bud_session.py`). Python's way to keep a path inside a
//! directory is `os.path.realpath` and then the checks on what it found: one `lstat` per
//! component and one `stat` per check, each a path walk that the emulated guest kernel
//! pays ~1.6 ms for. `openat2` with `RESOLVE_BENEATH` has the kernel refuse any path that
//! leaves the directory (`..` above it, an absolute symlink, a magic link: `EXDEV` or
//! `ELOOP`), so the caller opens first and asks `fstat` what it got. Python has no binding
//! for `openat2`.

use std::ffi::CString;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::inotify::last_error;

/// The kernel's `struct open_how` (linux/openat2.h; libc's is non-exhaustive, so it cannot
/// be built field by field).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Opens `path` (relative) under directory descriptor `dir` with open(2) `flags` and
/// `mode`, never leaving `dir`: `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`.
/// Returns the descriptor; raises OSError with the errno (`EXDEV`: the path, or a link on
/// it, leads out).
#[pyfunction]
pub fn open_beneath(dir: i32, path: &[u8], flags: i32, mode: u32) -> PyResult<i32> {
    let c = CString::new(path).map_err(|_| PyValueError::new_err("path holds NUL"))?;
    let how = OpenHow {
        flags: u64::from(flags as u32),
        mode: u64::from(mode),
        resolve: libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: `c` is NUL-terminated and `how` a fully initialised `struct open_how`, both
    // alive for the call, whose size is passed as openat2 requires; the kernel only reads
    // them.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(last_error("openat2"));
    }
    Ok(fd as i32)
}
