//! The file systems the guest needs, mounted once at boot.
//!
//! Owns the mount table and the few `/dev` symlinks that shells expect. It runs before the
//! worker exists and never again: nothing here may be on a job's path.

use std::ffi::CStr;
use std::io;

use crate::error::Error;

/// One mount the agent performs.
#[derive(Debug)]
pub struct Mount {
    pub source: &'static CStr,
    pub target: &'static CStr,
    pub fstype: &'static CStr,
    pub flags: libc::c_ulong,
    pub data: &'static CStr,
    /// A failed required mount is fatal (FAILED/MOUNT); an optional one is only logged.
    pub required: bool,
}

const NOSUID_NODEV: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;

/// The mount table, in order (a parent before anything mounted beneath it).
///
/// /tmp keeps exec (jobs write scripts there and run them) and is also the worker's HOME
/// and working directory. /tmp and /dev/shm use 2 MiB folios where a file covers all of one
/// (`huge=within_size`, judged by the end of the write that creates the folio): a large file
/// is written and read a folio at a time instead of 4 KiB at a time (~3 000 emulated
/// instructions each on the write path under kvm_pvm), while small files keep 4 KiB folios
/// and cost no more memory than before. /dev/shm is for POSIX shared memory and semaphores
/// (`multiprocessing`); it is optional because a job that does not use it loses nothing,
/// as is /dev/pts (terminals).
/// /tmp belongs to the guest's non-root user `user` (uid/gid 1000, E2B's user) and keeps its
/// sticky bit: the work directory is also that user's home, mounted again (a bind mount) at
/// /home/user, so it is a real directory there (`getcwd` says /home/user) with the same files.
/// The bind mount costs nothing per job: it is made once, before the snapshot. A rename
/// between the two names is EXDEV (two mounts), as between /tmp and /home on a machine whose
/// /tmp is a tmpfs; `mv` and `shutil.move` copy then.
/// /run/bud-output holds the files that catch a job's output below Python's level (see
/// `guest/python/bud_io.py`, `FdCapture`): its own small tmpfs in 2 MiB folios, sized to the
/// default output cap plus `CAPTURE_SLACK` (the worker resizes it for a request with another
/// cap), so that a flood of output there ends with `ENOSPC` for the writer, not with a full
/// guest RAM.
pub const MOUNTS: [Mount; 9] = [
    Mount {
        source: c"proc",
        target: c"/proc",
        fstype: c"proc",
        flags: NOSUID_NODEV | libc::MS_NOEXEC,
        data: c"",
        required: true,
    },
    Mount {
        source: c"sysfs",
        target: c"/sys",
        fstype: c"sysfs",
        flags: NOSUID_NODEV | libc::MS_NOEXEC,
        data: c"",
        required: true,
    },
    Mount {
        source: c"devtmpfs",
        target: c"/dev",
        fstype: c"devtmpfs",
        flags: libc::MS_NOSUID,
        data: c"mode=0755",
        required: true,
    },
    // Pseudo-terminals for processes started on a terminal (`guest/python/bud_procs.py`):
    // devtmpfs's /dev/ptmx opens this instance. Optional: only terminals need it.
    Mount {
        source: c"devpts",
        target: c"/dev/pts",
        fstype: c"devpts",
        flags: libc::MS_NOSUID | libc::MS_NOEXEC,
        data: c"mode=0620,ptmxmode=0666",
        required: false,
    },
    Mount {
        source: c"shm",
        target: c"/dev/shm",
        fstype: c"tmpfs",
        flags: NOSUID_NODEV,
        data: c"mode=1777,huge=within_size",
        required: false,
    },
    Mount {
        source: c"tmpfs",
        target: c"/tmp",
        fstype: c"tmpfs",
        flags: NOSUID_NODEV,
        data: c"mode=1777,uid=1000,gid=1000,huge=within_size",
        required: true,
    },
    Mount {
        source: c"/tmp",
        target: HOME_DIR,
        fstype: c"",
        flags: libc::MS_BIND,
        data: c"",
        required: true,
    },
    Mount {
        source: c"tmpfs",
        target: c"/run",
        fstype: c"tmpfs",
        flags: NOSUID_NODEV | libc::MS_NOEXEC,
        data: c"mode=0755",
        required: true,
    },
    Mount {
        source: c"bud-output",
        target: CAPTURE_DIR,
        fstype: c"tmpfs",
        flags: NOSUID_NODEV | libc::MS_NOEXEC,
        // DEFAULT_OUTPUT_LIMIT + CAPTURE_SLACK (a test checks it). 2 MiB folios: a 4 KiB
        // folio costs ~3 900 emulated instructions on the write path under kvm_pvm
        // (allocation, page cache, LRU, accounting, then the punch that frees it), so fd
        // output ran at ~1 MiB/s; the part of a new huge folio a write leaves is cleared by the
        // guest (or by the host with `bud.host_zero`, kernel patch 0009, on kvm_pvm) and the
        // worker frees copied output in whole 2 MiB (`bud_capture.PUNCH_EVERY`). Near the
        // size limit shmem falls back to 4 KiB folios, so the bound stays exact.
        data: c"mode=0700,size=8454144,huge=always",
        required: true,
    },
];

/// The home of the guest's user `user` (etc/passwd): the work directory again.
pub const HOME_DIR: &CStr = c"/home/user";

/// Where the worker's output capture files live (`bud_capture.CAPTURE_DIR`).
pub const CAPTURE_DIR: &CStr = c"/run/bud-output";

/// Symlinks devtmpfs does not create but shells and `/dev/stdin`-style paths rely on
/// (bash process substitution uses /dev/fd). Optional: a failure is logged only.
pub const DEV_LINKS: [(&CStr, &CStr); 4] = [
    (c"/proc/self/fd", c"/dev/fd"),
    (c"/proc/self/fd/0", c"/dev/stdin"),
    (c"/proc/self/fd/1", c"/dev/stdout"),
    (c"/proc/self/fd/2", c"/dev/stderr"),
];

/// Mounts everything in [`MOUNTS`] and creates [`DEV_LINKS`].
///
/// Returns the first failure of a required mount; optional failures go to `warn`.
pub fn mount_all(mut warn: impl FnMut(&Error)) -> Result<(), Error> {
    for m in &MOUNTS {
        match mount_one(m) {
            Ok(()) => {}
            Err(e) if m.required => return Err(e),
            Err(e) => warn(&e),
        }
    }
    for (target, link) in DEV_LINKS {
        // SAFETY: both are NUL-terminated static strings; symlink reads only them.
        if unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) } != 0 {
            let source = io::Error::last_os_error();
            if source.kind() != io::ErrorKind::AlreadyExists {
                warn(&Error::Symlink { link, source });
            }
        }
    }
    Ok(())
}

fn mount_one(m: &Mount) -> Result<(), Error> {
    // SAFETY: NUL-terminated static path; mkdir reads only it.
    if unsafe { libc::mkdir(m.target.as_ptr(), 0o755) } != 0 {
        let source = io::Error::last_os_error();
        if source.kind() != io::ErrorKind::AlreadyExists {
            return Err(Error::Mkdir {
                path: m.target,
                source,
            });
        }
    }
    // SAFETY: all four strings are NUL-terminated statics; mount reads only them.
    let rc = unsafe {
        libc::mount(
            m.source.as_ptr(),
            m.target.as_ptr(),
            m.fstype.as_ptr(),
            m.flags,
            m.data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(Error::Mount {
            target: m.target,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capture_file_system_is_the_default_cap_plus_the_slack() {
        let m = MOUNTS.iter().find(|m| m.target == CAPTURE_DIR).unwrap();
        let size = crate::protocol::DEFAULT_OUTPUT_LIMIT + crate::protocol::CAPTURE_SLACK;
        assert_eq!(
            m.data.to_str().unwrap(),
            format!("mode=0700,size={size},huge=always")
        );
    }

    fn is_under(path: &[u8], parent: &[u8]) -> bool {
        path.len() > parent.len() && path.starts_with(parent) && path[parent.len()] == b'/'
    }

    #[test]
    fn every_mount_target_is_absolute() {
        let relative: Vec<_> = MOUNTS
            .iter()
            .filter(|m| !m.target.to_bytes().starts_with(b"/"))
            .collect();

        assert!(relative.is_empty(), "{relative:?}");
    }

    #[test]
    fn parents_are_mounted_before_their_children() {
        let targets: Vec<&[u8]> = MOUNTS.iter().map(|m| m.target.to_bytes()).collect();

        let misordered: Vec<_> = targets
            .iter()
            .enumerate()
            .flat_map(|(i, child)| targets[i + 1..].iter().map(move |later| (*child, *later)))
            .filter(|(earlier, later)| is_under(earlier, later))
            .collect();

        assert!(misordered.is_empty(), "{misordered:?}");
    }

    #[test]
    fn required_mounts_are_proc_sys_dev_tmp_home_and_the_capture() {
        let required: Vec<_> = MOUNTS
            .iter()
            .filter(|m| m.required)
            .map(|m| m.target.to_str().unwrap_or("?"))
            .collect();

        assert_eq!(
            required,
            [
                "/proc",
                "/sys",
                "/dev",
                "/tmp",
                "/home/user",
                "/run",
                "/run/bud-output"
            ]
        );
    }

    #[test]
    fn dev_links_live_in_dev_and_point_into_proc() {
        let odd: Vec<_> = DEV_LINKS
            .iter()
            .filter(|(target, link)| {
                !is_under(link.to_bytes(), b"/dev") || !is_under(target.to_bytes(), b"/proc")
            })
            .collect();

        assert!(odd.is_empty(), "{odd:?}");
    }
}
