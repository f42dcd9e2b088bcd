//! The agent's failures and how each one is reported to the host.
//!
//! One variant per failing operation; each carries the `io::Error` (and so the errno) it came
//! from, and maps to the `FAILED` doorbell's failure code and detail word.

use std::ffi::CStr;
use std::fmt;
use std::io;

use crate::protocol::failure;

/// What went wrong in the agent.
#[derive(Debug)]
pub enum Error {
    /// `ioperm` for the doorbell failed.
    Ioperm(io::Error),
    /// Creating a mount point failed.
    Mkdir {
        path: &'static CStr,
        source: io::Error,
    },
    /// A mount failed.
    Mount {
        target: &'static CStr,
        source: io::Error,
    },
    /// Creating a `/dev` symlink failed (never fatal).
    Symlink {
        link: &'static CStr,
        source: io::Error,
    },
    /// Starting the worker failed.
    Spawn(io::Error),
}

impl Error {
    /// The [`failure`] code rung in `rdi` of the FAILED doorbell.
    pub fn failure_code(&self) -> u64 {
        match self {
            Self::Ioperm(_) => failure::IOPERM,
            Self::Mkdir { .. } | Self::Mount { .. } | Self::Symlink { .. } => failure::MOUNT,
            Self::Spawn(_) => failure::SPAWN,
        }
    }

    /// The detail word rung in `rsi`: the errno, or 0 if the error carries none.
    pub fn errno(&self) -> u64 {
        let source = match self {
            Self::Ioperm(source) | Self::Spawn(source) => source,
            Self::Mkdir { source, .. }
            | Self::Mount { source, .. }
            | Self::Symlink { source, .. } => source,
        };
        source
            .raw_os_error()
            .and_then(|errno| u64::try_from(errno).ok())
            .unwrap_or(0)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ioperm(e) => write!(f, "ioperm for the doorbell: {e}"),
            Self::Mkdir { path, source } => write!(f, "mkdir {}: {source}", path.to_string_lossy()),
            Self::Mount { target, source } => {
                write!(f, "mount {}: {source}", target.to_string_lossy())
            }
            Self::Symlink { link, source } => {
                write!(f, "symlink {}: {source}", link.to_string_lossy())
            }
            Self::Spawn(e) => write!(f, "start worker: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Ioperm(source) | Self::Spawn(source) => Some(source),
            Self::Mkdir { source, .. }
            | Self::Mount { source, .. }
            | Self::Symlink { source, .. } => Some(source),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_failure_reports_mount_code_and_errno() {
        let e = Error::Mount {
            target: c"/proc",
            source: io::Error::from_raw_os_error(libc::ENODEV),
        };

        assert_eq!((e.failure_code(), e.errno()), (failure::MOUNT, 19));
    }

    #[test]
    fn mkdir_failure_is_reported_as_a_mount_failure() {
        let e = Error::Mkdir {
            path: c"/tmp",
            source: io::Error::from_raw_os_error(libc::EROFS),
        };

        assert_eq!((e.failure_code(), e.errno()), (failure::MOUNT, 30));
    }

    #[test]
    fn spawn_failure_reports_spawn_code_and_errno() {
        let e = Error::Spawn(io::Error::from_raw_os_error(libc::ENOENT));

        assert_eq!((e.failure_code(), e.errno()), (failure::SPAWN, 2));
    }

    #[test]
    fn ioperm_failure_reports_ioperm_code_and_errno() {
        let e = Error::Ioperm(io::Error::from_raw_os_error(libc::EPERM));

        assert_eq!((e.failure_code(), e.errno()), (failure::IOPERM, 1));
    }

    #[test]
    fn error_without_errno_reports_zero() {
        let e = Error::Spawn(io::Error::other("no errno here"));

        assert_eq!(e.errno(), 0);
    }

    #[test]
    fn message_names_the_mount_point_and_the_os_error() {
        let e = Error::Mount {
            target: c"/sys",
            source: io::Error::from_raw_os_error(libc::EBUSY),
        };

        let text = e.to_string();

        assert!(
            text.starts_with("mount /sys: ") && text.contains("os error 16"),
            "{text}"
        );
    }
}
