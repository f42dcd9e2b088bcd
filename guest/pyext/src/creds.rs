//! Whom a process the worker starts runs as (`guest/python/bud_procs.py`): the calling
//! thread's own credentials, switched around the spawn.
//!
//! `subprocess.Popen(user=..., group=..., extra_groups=...)` changes ids in the child, which
//! makes CPython give up `vfork` for `fork` (a child sharing the parent's memory must not run
//! glibc's process-wide `setuid`): measured under kvm_pvm, starting `sh -c true` took 2.6 s
//! instead of 0.4 s on the python template, 8.4 s instead of 0.47 s on datascience (the
//! worker's page tables are copied and its pages write-protected). Linux keeps credentials
//! per thread, so the worker instead gives *its calling thread* the user's ids with raw
//! system calls (glibc's wrappers would change every thread), spawns with `vfork` as
//! always, and takes root back: 7 system calls, ~6-9 ms here. The child inherits the thread's
//! ids; its `execve` sets the saved ids to the effective ones and, with no id left 0, drops
//! every capability, so the program runs as the user alone. The saved ids stay 0 on the
//! worker's thread meanwhile: that is what lets it become root again. The worker's other
//! threads never change.
//!
//! Changing the effective id clears the process's "dumpable" flag (the kernel does it for
//! any credential change); [`thread_as_root`] sets it again, so the worker is as before.

use std::io;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;

fn checked(op: &str, rc: libc::c_long) -> PyResult<()> {
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    Err(match e.raw_os_error() {
        Some(errno) => PyOSError::new_err((errno, format!("{op}: {e}"))),
        None => PyOSError::new_err(format!("{op}: {e}")),
    })
}

fn set_groups(groups: &[libc::gid_t]) -> PyResult<()> {
    // SAFETY: the pointer and length describe `groups`, which outlives the call; the kernel
    // only reads it. A raw system call changes only the calling thread's credentials.
    let rc = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    checked("setgroups", rc)
}

/// Real and effective group ids `gid`, saved `saved`.
fn set_gids(gid: libc::gid_t, saved: libc::gid_t) -> PyResult<()> {
    // SAFETY: setresgid takes integers only and touches no memory of ours; raw, it changes
    // only the calling thread's credentials (module docs).
    let rc = unsafe { libc::syscall(libc::SYS_setresgid, gid, gid, saved) };
    checked("setresgid", rc)
}

/// Real and effective user ids `uid`, saved `saved`.
fn set_uids(uid: libc::uid_t, saved: libc::uid_t) -> PyResult<()> {
    // SAFETY: setresuid takes integers only and touches no memory of ours; raw, it changes
    // only the calling thread's credentials (module docs).
    let rc = unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, saved) };
    checked("setresuid", rc)
}

/// Makes the calling thread (only it) run as user `uid`, group `gid` and supplementary
/// `groups`, root staying its saved ids (module docs). Undone by [`thread_as_root`]; on a
/// failure the thread is root again and the error raised.
#[pyfunction]
pub fn thread_as_user(uid: u32, gid: u32, groups: Vec<u32>) -> PyResult<()> {
    let done = set_groups(&groups)
        .and_then(|()| set_gids(gid, 0))
        .and_then(|()| set_uids(uid, 0));
    if done.is_err() {
        let _ = thread_as_root(Vec::new());
    }
    done
}

/// Gives the calling thread root's ids back, with supplementary `groups` (the worker's
/// own), and the process its dumpable flag.
#[pyfunction]
pub fn thread_as_root(groups: Vec<u32>) -> PyResult<()> {
    // The user id first: root's effective id is what allows the rest.
    set_uids(0, 0)?;
    set_gids(0, 0)?;
    set_groups(&groups)?;
    // SAFETY: PR_SET_DUMPABLE takes an integer argument and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) };
    checked("prctl(PR_SET_DUMPABLE)", rc.into())
}
