//! One lock for every first-use build step of a build directory: the kernel (and the apt
//! installs of its script), the guest binaries, the host tools, the image, and the tools the
//! tests install (the compat client venv, cargo-fuzz).
//!
//! First-use steps install host packages, and apt allows one client at a time: two test
//! threads or processes that reach a build at once must not both run it. So every step takes
//! [`BuildLock`] on `<build dir>/build.lock` first; a second caller waits (saying for what)
//! and then finds the work done. It is an `flock(2)`, so it goes away with its holder, even a
//! killed one, and separate opens conflict even inside one process (two test threads).
//! The holder writes its pid and what it builds into the file for the waiters' progress line.
//!
//! A step that installs no host package and shares no file with the guest build (a client
//! venv made by pip, cargo-fuzz made by cargo) takes a lock of its own instead,
//! `<build dir>/<step>.lock` ([`BuildLock::acquire_step`]): under the one lock, the fuzz test
//! waited 12 minutes for a guest build it does not use when the suite's binaries ran side by
//! side (`cargo xtask test`).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, flock};

/// The lock file, inside the build directory.
pub const LOCK_FILE: &str = "build.lock";

#[derive(Debug, thiserror::Error)]
#[error("build lock {path}")]
pub struct LockError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Held while a build step runs; released on drop.
#[derive(Debug)]
pub struct BuildLock {
    _file: File,
}

impl BuildLock {
    /// Takes the build lock of `build_dir` for `what` (a few words: "guest build", "compat
    /// client venv"), waiting for another holder with one progress line naming it.
    pub fn acquire(
        build_dir: &Path,
        what: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<BuildLock, LockError> {
        Self::take(build_dir, LOCK_FILE, what, progress)
    }

    /// Takes the lock of build step `step` alone (`<build_dir>/<step>.lock`; see the
    /// module's doc for which steps may), for `what`, waiting like [`BuildLock::acquire`].
    pub fn acquire_step(
        build_dir: &Path,
        step: &str,
        what: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<BuildLock, LockError> {
        Self::take(build_dir, &format!("{step}.lock"), what, progress)
    }

    fn take(
        build_dir: &Path,
        file_name: &str,
        what: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<BuildLock, LockError> {
        let path = build_dir.join(file_name);
        let err = |source| LockError {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(build_dir).map_err(err)?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(err)?;
        if flock(&file, FlockOperation::NonBlockingLockExclusive).is_err() {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() {
                "another build".to_owned()
            } else {
                holder.to_owned()
            };
            progress(&format!(
                "waiting for {holder} to finish (lock {})",
                path.display()
            ));
            flock(&file, FlockOperation::LockExclusive).map_err(|e| err(e.into()))?;
        }
        // Best effort: only the waiters' progress line reads it.
        let _ = file.set_len(0).and_then(|()| {
            file.seek(SeekFrom::Start(0))?;
            write!(file, "{what} (pid {})", std::process::id())
        });
        Ok(BuildLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_second_holder_waits_and_is_told_for_what() {
        let dir = std::env::temp_dir().join(format!("bud-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = BuildLock::acquire(&dir, "the first build", &mut |_| {}).unwrap();
        let (said, heard) = mpsc::channel();
        let (got, taken) = mpsc::channel();
        let d = dir.clone();
        let waiter = std::thread::spawn(move || {
            let lock = BuildLock::acquire(&d, "the second build", &mut |line: &str| {
                said.send(line.to_owned()).unwrap()
            })
            .unwrap();
            got.send(()).unwrap();
            drop(lock);
        });
        let line = heard.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(
            line.starts_with(&format!(
                "waiting for the first build (pid {}) to finish",
                std::process::id()
            )),
            "{line}"
        );
        assert!(
            taken.recv_timeout(Duration::from_millis(300)).is_err(),
            "the second caller took the lock while the first held it"
        );
        drop(first);
        taken.recv_timeout(Duration::from_secs(10)).unwrap();
        waiter.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_step_of_its_own_does_not_wait_for_the_build_lock_but_for_its_own() {
        let dir = std::env::temp_dir().join(format!("bud-lock-step-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let build = BuildLock::acquire(&dir, "the guest build", &mut |_| {}).unwrap();
        let mut waited = Vec::new();
        let tools = BuildLock::acquire_step(&dir, "tools", "cargo-fuzz", &mut |l: &str| {
            waited.push(l.to_owned())
        })
        .unwrap();
        assert_eq!(waited, Vec::<String>::new());
        assert!(dir.join("tools.lock").is_file());
        let (said, heard) = mpsc::channel();
        let d = dir.clone();
        let second = std::thread::spawn(move || {
            BuildLock::acquire_step(&d, "tools", "cargo-fuzz again", &mut |l: &str| {
                said.send(l.to_owned()).unwrap()
            })
            .map(drop)
            .unwrap();
        });
        let line = heard.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(line.starts_with("waiting for cargo-fuzz (pid"), "{line}");
        drop(tools);
        second.join().unwrap();
        drop(build);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
