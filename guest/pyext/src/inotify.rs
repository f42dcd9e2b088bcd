//! inotify for the worker's directory watchers (`guest/python/bud_procs.py`): Python's
//! standard library has no binding, and `ctypes` in the worker would mark every later
//! request's output capture sticky (the audit hook treats `ctypes.*` as a job reaching
//! below Python). The descriptor is read with `os.read` and the events parsed in Python.

use std::ffi::CString;
use std::io;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The last OS error as Python's `OSError` (with its errno), named after `op`.
pub(crate) fn last_error(op: &str) -> PyErr {
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(errno) => pyo3::exceptions::PyOSError::new_err((errno, format!("{op}: {e}"))),
        None => pyo3::exceptions::PyOSError::new_err(format!("{op}: {e}")),
    }
}

/// A new non-blocking, close-on-exec inotify descriptor.
#[pyfunction]
pub fn inotify_init() -> PyResult<i32> {
    // SAFETY: inotify_init1 takes flags only and touches no memory of ours.
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if fd < 0 {
        return Err(last_error("inotify_init1"));
    }
    Ok(fd)
}

/// Watches `path` on inotify descriptor `fd` for the events in `mask`; returns the watch
/// descriptor.
#[pyfunction]
pub fn inotify_add_watch(fd: i32, path: &str, mask: u32) -> PyResult<i32> {
    let c = CString::new(path).map_err(|_| PyValueError::new_err("path holds NUL"))?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call; the kernel only
    // reads it.
    let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), mask) };
    if wd < 0 {
        return Err(last_error("inotify_add_watch"));
    }
    Ok(wd)
}
