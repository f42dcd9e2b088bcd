//! The drop to `--user`: its uid and gid, the folders given to it, the credentials.

use std::ffi::CString;
use std::path::Path;

use super::JailError;

/// Gives `path` and everything under it (not following symbolic links) to `uid`:`gid`.
pub(super) fn give(path: &Path, uid: libc::uid_t, gid: libc::gid_t) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))?;
    if std::fs::symlink_metadata(path)?.is_dir() {
        for entry in std::fs::read_dir(path)? {
            give(&entry?.path(), uid, gid)?;
        }
    }
    Ok(())
}

/// Drops to `user` (module docs).
pub fn drop_privileges(user: &str) -> Result<(), JailError> {
    let (uid, gid) = lookup(user)?;
    let call = |call: &'static str, rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(JailError::Call {
                call,
                source: std::io::Error::last_os_error(),
            })
        }
    };
    // SAFETY: plain system calls on this process's credentials; glibc applies set*id to
    // every thread. setgroups with a null list and length 0 clears the groups.
    unsafe {
        call("setgroups", libc::setgroups(0, std::ptr::null()))?;
        call("setgid", libc::setgid(gid))?;
        call("setuid", libc::setuid(uid))?;
        // A uid change makes the process non-dumpable, which hands /proc/self/* to root.
        call(
            "prctl(PR_SET_DUMPABLE)",
            libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0),
        )?;
        if uid != 0 && libc::setuid(0) == 0 {
            return Err(JailError::StillRoot(uid));
        }
    }
    Ok(())
}

/// The uid and gid of `user` (getpwnam_r).
pub(super) fn lookup(user: &str) -> Result<(libc::uid_t, libc::gid_t), JailError> {
    let name = CString::new(user).map_err(|_| JailError::NoUser(user.to_owned()))?;
    // SAFETY: passwd is plain data filled in by getpwnam_r; buf outlives the call and the
    // strings it points into are not used after it.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut buf = vec![0 as libc::c_char; 16 << 10];
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwnam_r(
            name.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        );
        if rc != 0 || found.is_null() {
            return Err(JailError::NoUser(user.to_owned()));
        }
        Ok((pwd.pw_uid, pwd.pw_gid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_user_is_a_clear_error() {
        let e = drop_privileges("no-such-user-bud").unwrap_err();
        assert_eq!(e.to_string(), "no user named no-such-user-bud");
    }
}
