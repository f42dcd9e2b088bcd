//! The jail of `bud serve`: seccomp filters, and with `--user` an unprivileged user, closed
//! once every served template is prepared. The filters are on by default where the host
//! allows them ([`probe`]); `--no-jail` turns the jail off, `--jail` (implied by `--user`)
//! makes a host that cannot install the filters an error instead of a warning. Closing the
//! jail logs one line saying what is in force (filters on or off and why, the uid).
//!
//! Why then: preparing a template may build the guest (a kernel build, apt, Python's
//! compiler: `execve` and root), and a first boot writes the template's files. After that
//! the server needs none of it (a user template built while it runs is built and booted by
//! the builder process, started before the jail closes, and only loaded here: the filters
//! allow reading its directory, `mkdir` and `flock`): every VM comes from an executor that holds the
//! KVM fd and the open memory file, sessions' layers are `memfd`s, the listening socket and
//! the audit log are open. So [`close`]:
//! 1. with `--user NAME`, drops to that user and its group (supplementary groups cleared,
//!    then `setgid`, then `setuid`; a `setuid(0)` afterwards must fail, or the jail fails),
//!    and marks the process dumpable again, as the kernel unmarks it on a uid change, which
//!    would leave `/proc/self/pagemap` (read by every VM reset) to root;
//! 2. unless `--no-jail`, and if the host allows it, installs [`process_filter`] on every
//!    thread (`SECCOMP_FILTER_FLAG_TSYNC`; threads made later inherit it): what the server
//!    as a whole does, measured (`strace -f` of `bud serve` under jobs, batches, streams,
//!    files, sessions, forks, cancellations, floods, timeouts) and checked by running the
//!    jailed server under the soak, the E2B and Piston clients, every native route and its
//!    shutdowns;
//! 3. hands [`job_filter`] to the job threads, which stack it on their own before their next
//!    job: a job thread runs the guest's vCPU and parses what the guest wrote, so it is what
//!    a hostile guest would attack first; it may not create threads or processes, sockets,
//!    or change credentials.
//!
//! "The host allows it" ([`probe`]): the kernel has seccomp filters and their kill-process
//! action (Linux 4.14), and `seccomp(2)` is not refused (as a container's own filter may
//! refuse it). Without them the server runs with no filters and warns, unless the jail was
//! required; a host that passes the probe and then fails to install the filters is an
//! error either way.
//!
//! Anything outside a filter kills the whole process (`SECCOMP_RET_KILL_PROCESS`): a jail
//! that returned errors would leave a compromised thread running. Until the jail closes
//! (while templates are prepared) jobs can already run, unjailed; `/v1/health` says
//! `jailed` once the filters are on. `ioctl` is checked by request: job threads may make
//! KVM's only (any of them: the request's type byte, not each number), the other threads
//! also the few socket and terminal ones measured. This module never relaxes a filter to
//! let a feature through unmeasured. Not covered: no namespaces, chroot or cgroups (see the
//! threat model in docs/security.md, beside Firecracker's jailer).
//!
//! One module per concern: [`seccomp`] (the probe, the measured lists, the filters) and
//! [`user`] (the drop to `--user`); this one decides what is in force and closes the jail.

mod seccomp;
mod user;

use std::path::PathBuf;

use seccompiler::BpfProgram;

pub use seccomp::{Unavailable, apply_here, job_filter, probe, process_filter};
pub use user::drop_privileges;

/// Why the jail could not be closed (the server then stops: it was asked to be jailed).
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("giving {path} to the --user: {source}")]
    Give {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no user named {0}")]
    NoUser(String),
    #[error("{call} failed: {source}")]
    Call {
        call: &'static str,
        source: std::io::Error,
    },
    #[error("still able to become root after dropping to uid {0}")]
    StillRoot(u32),
    #[error("seccomp filter: {0}")]
    Filter(String),
    #[error(
        "--jail and --user need seccomp filters, which this host cannot install (--no-jail runs without them)"
    )]
    Unavailable(#[from] Unavailable),
}

/// What `bud serve` asks of the jail: by default the seccomp filters where the host allows
/// them, none with `--no-jail`; with `--jail` or `--user`, the filters or no server.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct JailConfig {
    /// Require the jail: stop if this host cannot install the seccomp filters (by default the
    /// server then runs without them and logs a warning).
    #[arg(long = "jail")]
    pub required: bool,
    /// Run without the jail. By default, once the templates are prepared, every thread is put
    /// under a seccomp filter (job threads under a narrower one) where the host allows it; a
    /// system call outside it kills the server.
    #[arg(
        long = "no-jail",
        action = clap::ArgAction::SetFalse,
        conflicts_with_all = ["required", "user"]
    )]
    pub seccomp: bool,
    /// Once the templates are prepared, drop to this user and its group (implies --jail).
    #[arg(long)]
    pub user: Option<String>,
}

impl Default for JailConfig {
    /// `bud serve`'s default: the filters where the host allows them, no user change.
    fn default() -> Self {
        Self {
            required: false,
            seccomp: true,
            user: None,
        }
    }
}

impl JailConfig {
    /// The filters or no server (`--jail`, or `--user`, which implies it).
    pub fn requires_seccomp(&self) -> bool {
        self.required || self.user.is_some()
    }

    /// Asks for nothing it cannot have: a jail that is both off and required is a mistake.
    pub fn is_consistent(&self) -> bool {
        self.seccomp || !self.requires_seccomp()
    }
}

/// What the jail does about seccomp filters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seccomp {
    /// The filters are installed.
    On,
    /// `--no-jail`.
    Off,
    /// The host cannot install them (why); the server runs without them.
    Unavailable(String),
}

/// Decides the filters' fate from what was asked and what the host allows ([`probe`]'s
/// answer): an error when they are required and the host cannot install them.
pub fn plan(config: &JailConfig, host: Result<(), Unavailable>) -> Result<Seccomp, JailError> {
    match host {
        _ if !config.seccomp => Ok(Seccomp::Off),
        Ok(()) => Ok(Seccomp::On),
        Err(why) if config.requires_seccomp() => Err(JailError::Unavailable(why)),
        Err(why) => Ok(Seccomp::Unavailable(format!(
            "{}: {}",
            why.call, why.source
        ))),
    }
}
/// What [`close`] put in force.
#[derive(Debug)]
pub struct Closed {
    pub seccomp: Seccomp,
    /// The job threads' filter, for them to stack: with [`Seccomp::On`] only.
    pub job_filter: Option<BpfProgram>,
    /// The user dropped to (`--user`), if any.
    pub user: Option<String>,
    /// The effective uid the server runs as from now on.
    pub uid: u32,
}

impl Closed {
    /// Whether the filters are on.
    pub fn jailed(&self) -> bool {
        self.seccomp == Seccomp::On
    }
}

impl std::fmt::Display for Closed {
    /// The log line: `jail: seccomp filters on, running as nobody (uid 65534)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.seccomp {
            Seccomp::On => write!(f, "jail: seccomp filters on")?,
            Seccomp::Off => write!(f, "jail: seccomp filters off (--no-jail)")?,
            Seccomp::Unavailable(why) => write!(
                f,
                "jail: seccomp filters off (the host cannot install them: {why})"
            )?,
        }
        match &self.user {
            Some(user) => write!(f, ", running as {user} (uid {})", self.uid),
            None => write!(f, ", running as uid {} (no --user)", self.uid),
        }
    }
}

/// Closes the jail (module docs): user, then, if asked and allowed, the process filter on
/// every thread; returns what is in force and the job threads' filter.
///
/// With `--user`, the folders `writable` (and everything in them) are first given to that
/// user: the state directory and the served templates' pin folders, made while the server
/// was root, are written after the drop (a pause, a pin); left to root, every pause of a
/// server started with `--user` on a new state directory failed with "Permission denied".
pub fn close(config: &JailConfig, writable: &[PathBuf]) -> Result<Closed, JailError> {
    let seccomp = plan(config, if config.seccomp { probe() } else { Ok(()) })?;
    if let Some(user) = &config.user {
        let (uid, gid) = user::lookup(user)?;
        for path in writable {
            user::give(path, uid, gid).map_err(|source| JailError::Give {
                path: path.clone(),
                source,
            })?;
        }
        drop_privileges(user)?;
    }
    // SAFETY: geteuid has no preconditions (and is made before the filters, which omit it).
    let uid = unsafe { libc::geteuid() };
    let job_filter = if seccomp == Seccomp::On {
        let job = job_filter()?;
        seccompiler::apply_filter_all_threads(&process_filter()?)
            .map_err(|e| JailError::Filter(e.to_string()))?;
        Some(job)
    } else {
        None
    };
    Ok(Closed {
        seccomp,
        job_filter,
        user: config.user.clone(),
        uid,
    })
}

#[cfg(test)]
mod tests {
    //! What the jail puts in force, from what was asked and what the host allows.

    use super::*;

    fn refused(call: &'static str) -> Result<(), Unavailable> {
        Err(Unavailable {
            call,
            source: std::io::Error::from_raw_os_error(libc::ENOSYS),
        })
    }

    #[test]
    fn the_filters_are_on_by_default_where_the_host_allows_them() {
        let seccomp = plan(&JailConfig::default(), Ok(())).unwrap();

        assert_eq!(seccomp, Seccomp::On);
    }

    #[test]
    fn a_host_that_refuses_seccomp_runs_without_the_filters_by_default() {
        let seccomp = plan(&JailConfig::default(), refused("seccomp")).unwrap();

        assert!(
            matches!(&seccomp, Seccomp::Unavailable(why) if why.starts_with("seccomp: ")),
            "{seccomp:?}"
        );
    }

    #[test]
    fn a_required_jail_on_a_host_that_refuses_seccomp_is_an_error() {
        let jail = JailConfig {
            required: true,
            ..JailConfig::default()
        };
        let as_user = JailConfig {
            user: Some("nobody".into()),
            ..JailConfig::default()
        };

        for config in [jail, as_user] {
            let e = plan(&config, refused("seccomp")).unwrap_err();
            assert!(matches!(e, JailError::Unavailable(_)), "{config:?}: {e}");
        }
    }

    #[test]
    fn no_jail_means_no_filters_whatever_the_host() {
        let off = JailConfig {
            seccomp: false,
            ..JailConfig::default()
        };

        assert_eq!(plan(&off, Ok(())).unwrap(), Seccomp::Off);
        assert_eq!(plan(&off, refused("seccomp")).unwrap(), Seccomp::Off);
    }

    #[test]
    fn the_log_line_says_which_filters_and_which_user() {
        let closed = |seccomp, user: Option<&str>, uid| {
            Closed {
                seccomp,
                job_filter: None,
                user: user.map(str::to_owned),
                uid,
            }
            .to_string()
        };

        assert_eq!(
            closed(Seccomp::On, Some("nobody"), 65534),
            "jail: seccomp filters on, running as nobody (uid 65534)"
        );
        assert_eq!(
            closed(Seccomp::Off, None, 0),
            "jail: seccomp filters off (--no-jail), running as uid 0 (no --user)"
        );
        assert_eq!(
            closed(Seccomp::Unavailable("seccomp: ENOSYS".into()), None, 0),
            "jail: seccomp filters off (the host cannot install them: seccomp: ENOSYS), running as uid 0 (no --user)"
        );
    }
}
