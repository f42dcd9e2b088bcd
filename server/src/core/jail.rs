//! The jail of `bud serve`: seccomp filters, and with `--user` an unprivileged user, closed
//! once every served template is prepared. The filters are on by default where the host
//! allows them ([`probe`]); `--no-jail` turns the jail off, `--jail` (implied by `--user`)
//! makes a host that cannot install the filters an error instead of a warning. Closing the
//! jail logs one line saying what is in force (filters on or off and why, the uid).
//!
//! Why then: preparing a template may build the guest (a kernel build, apt, Python's
//! compiler: `execve` and root), and loading one opens `/dev/kvm` and the template's files.
//! After that the server needs none of it: every VM comes from an executor that holds the
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
//! (Over 500 lines with its unit tests, which stay beside the code they test; the code
//! itself is under 450.)

use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

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

/// Why this host cannot install the filters ([`probe`]): the call that failed, and how.
#[derive(Debug, thiserror::Error)]
#[error("{call}")]
pub struct Unavailable {
    pub call: &'static str,
    pub source: std::io::Error,
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

/// Whether this host lets the server install its filters (module docs). Allocates nothing.
pub fn probe() -> Result<(), Unavailable> {
    let failed = |call| Unavailable {
        call,
        source: std::io::Error::last_os_error(),
    };
    // SAFETY: PR_GET_SECCOMP takes no pointers; it returns the calling thread's mode (0 none,
    // 2 filter: stacking on a filter is allowed) or fails without seccomp in the kernel.
    if unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) } < 0 {
        return Err(failed("prctl(PR_GET_SECCOMP)"));
    }
    let kill_process: u32 = libc::SECCOMP_RET_KILL_PROCESS;
    // SAFETY: SECCOMP_GET_ACTION_AVAIL reads one u32 action from the pointer, which points
    // at a live local.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_GET_ACTION_AVAIL,
            0,
            &kill_process as *const u32,
        )
    };
    if rc != 0 {
        return Err(failed("seccomp(SECCOMP_GET_ACTION_AVAIL, KILL_PROCESS)"));
    }
    Ok(())
}

/// A job thread's system calls (module docs); every other thread may make them too.
const JOB_THREAD: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_close,
    libc::SYS_openat,
    libc::SYS_statx,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_lseek,
    libc::SYS_fcntl,
    libc::SYS_ftruncate,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mremap,
    libc::SYS_brk,
    libc::SYS_memfd_create,
    libc::SYS_eventfd2,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_getrandom,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_exit,
    libc::SYS_exit_group,
    // The state directory (`crate::core::durable`), from the job thread that pauses a session or
    // takes a snapshot (the VM is only touched on a job thread): a session file is written,
    // fsync'd and renamed into place, then its folder fsync'd; a running session's mark is
    // made and removed (tests/durable_crash.rs pauses, resumes and snapshots on a jailed
    // `bud serve`).
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
];

/// What the other threads of the server make besides [`JOB_THREAD`]'s (module docs).
const OTHER_THREADS: &[i64] = &[
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_accept4,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    // Calls out to other nodes (a drain's hand-over and forwards, `crate::core::peer`) and to
    // Redis (`crate::core::registry`): `socket` itself is checked by domain ([`OTHER_SOCKETS`]).
    libc::SYS_connect,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prctl,
    // A job thread stacks its own filter with it (a filter can only narrow what is allowed).
    libc::SYS_seccomp,
];

/// The `ioctl` requests a job thread makes: KVM's (type 0xAE in the request number, the
/// `KVMIO` of `<linux/kvm.h>`), as `(mask, value)`: allowed when `request & mask == value`.
const JOB_THREAD_IOCTLS: &[(u64, u64)] = &[(0xff00, 0xae00)];

/// The other threads' `ioctl` requests besides KVM's (measured with `strace -f -e ioctl`):
/// `FIONBIO` on sockets, `TCGETS` (is stderr a terminal), and the close-on-exec and window
/// size requests the standard library and the terminal check may make.
const OTHER_IOCTLS: &[(u64, u64)] = &[
    (0xffff_ffff, libc::FIONBIO),
    (0xffff_ffff, libc::FIOCLEX),
    (0xffff_ffff, libc::FIONCLEX),
    (0xffff_ffff, libc::TCGETS),
    (0xffff_ffff, libc::TIOCGWINSZ),
];

/// The socket domains the other threads may open: TCP to other nodes and Redis, and what
/// name resolution opens for a host name (UDP to the resolver, the `nscd` socket) —
/// measured with `strace -f -e socket,connect` over a drain and a Redis registration.
const OTHER_SOCKETS: &[i32] = &[libc::AF_INET, libc::AF_INET6, libc::AF_UNIX];

/// A filter allowing the system calls `allowed` whole, `ioctl` only for the requests
/// `ioctls` (its second argument, 32 bits as the kernel reads it), and `socket` only for
/// the domains `sockets` (its first argument).
fn filter(
    allowed: &[i64],
    ioctls: &[(u64, u64)],
    sockets: &[i32],
) -> Result<BpfProgram, JailError> {
    let error = |e: seccompiler::BackendError| JailError::Filter(e.to_string());
    let mut rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> =
        allowed.iter().map(|&n| (n, Vec::new())).collect();
    let requests = ioctls
        .iter()
        .map(|&(mask, value)| {
            let request = SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(mask),
                value,
            )
            .map_err(error)?;
            SeccompRule::new(vec![request]).map_err(error)
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_ioctl, requests);
    if !sockets.is_empty() {
        let domains = sockets
            .iter()
            .map(|&d| {
                let domain =
                    SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, d as u64)
                        .map_err(error)?;
                SeccompRule::new(vec![domain]).map_err(error)
            })
            .collect::<Result<Vec<_>, _>>()?;
        rules.insert(libc::SYS_socket, domains);
    }
    let f = SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| JailError::Filter(e.to_string()))?;
    f.try_into()
        .map_err(|e: seccompiler::BackendError| JailError::Filter(e.to_string()))
}

/// The filter every thread gets.
pub fn process_filter() -> Result<BpfProgram, JailError> {
    filter(
        &[JOB_THREAD, OTHER_THREADS].concat(),
        &[JOB_THREAD_IOCTLS, OTHER_IOCTLS].concat(),
        OTHER_SOCKETS,
    )
}

/// The filter job threads stack on it.
pub fn job_filter() -> Result<BpfProgram, JailError> {
    filter(JOB_THREAD, JOB_THREAD_IOCTLS, &[])
}

/// Installs `prog` on the calling thread only.
pub fn apply_here(prog: &BpfProgram) -> Result<(), JailError> {
    seccompiler::apply_filter(prog).map_err(|e| JailError::Filter(e.to_string()))
}

/// Gives `path` and everything under it (not following symbolic links) to `uid`:`gid`.
fn give(path: &Path, uid: libc::uid_t, gid: libc::gid_t) -> std::io::Result<()> {
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
fn lookup(user: &str) -> Result<(libc::uid_t, libc::gid_t), JailError> {
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
        let (uid, gid) = lookup(user)?;
        for path in writable {
            give(path, uid, gid).map_err(|source| JailError::Give {
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
    //! The filters against the real kernel, in forked children (a filter cannot be removed,
    //! and the forbidden call must kill a process that is not the test runner).

    use super::*;

    /// Forks; the child stacks the job filter and makes `call`, then exits 0 if it was
    /// allowed. Returns the child's wait status.
    fn in_child(call: fn() -> libc::c_long) -> libc::c_int {
        in_child_under(job_filter().unwrap(), call)
    }

    /// [`in_child`] under `prog`.
    fn in_child_under(prog: BpfProgram, call: fn() -> libc::c_long) -> libc::c_int {
        // SAFETY: the child only installs the prepared filter (prctl/seccomp calls, no
        // allocation), makes one system call and _exits; the parent waits for it.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                let code = if apply_here(&prog).is_ok() && call() >= 0 {
                    0
                } else {
                    3
                };
                libc::_exit(code);
            }
            let mut status = 0;
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            status
        }
    }

    fn killed_by_sigsys(status: libc::c_int) -> bool {
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS
    }

    #[test]
    fn a_forbidden_call_on_a_job_thread_kills_the_process() {
        fn socket() -> libc::c_long {
            // SAFETY: a raw system call without memory arguments.
            unsafe { libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0) }
        }
        fn fork() -> libc::c_long {
            // SAFETY: a raw system call without memory arguments (the child, if any, would
            // return here and exit through in_child's _exit).
            unsafe { libc::syscall(libc::SYS_fork) }
        }
        for (name, call) in [("socket", socket as fn() -> libc::c_long), ("fork", fork)] {
            let status = in_child(call);
            assert!(killed_by_sigsys(status), "{name}: wait status {status:#x}");
        }
    }

    #[test]
    fn a_job_thread_may_make_kvm_ioctls_and_no_others() {
        fn kvm_api_version() -> libc::c_long {
            // SAFETY: open and ioctl without memory arguments; the fd is the child's own.
            unsafe {
                let fd = libc::open(c"/dev/kvm".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
                libc::syscall(libc::SYS_ioctl, fd, 0xae00_u64, 0)
            }
        }
        fn terminal_window() -> libc::c_long {
            // SAFETY: winsize is plain integers; all zeroes is a valid value.
            let mut size: libc::winsize = unsafe { std::mem::zeroed() };
            // SAFETY: TIOCGWINSZ writes one winsize into `size`, which outlives the call.
            unsafe { libc::syscall(libc::SYS_ioctl, 0, libc::TIOCGWINSZ, &mut size) }
        }
        let status = in_child(kvm_api_version);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "KVM_GET_API_VERSION: wait status {status:#x}"
        );
        let status = in_child(terminal_window);
        assert!(
            killed_by_sigsys(status),
            "TIOCGWINSZ: wait status {status:#x}"
        );
    }

    #[test]
    fn other_threads_may_open_network_sockets_and_no_others() {
        fn tcp() -> libc::c_long {
            // SAFETY: a raw system call without memory arguments; the child exits after.
            unsafe { libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0) }
        }
        fn netlink() -> libc::c_long {
            // SAFETY: as above.
            unsafe { libc::syscall(libc::SYS_socket, libc::AF_NETLINK, libc::SOCK_RAW, 0) }
        }
        let status = in_child_under(process_filter().unwrap(), tcp);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "AF_INET: {status:#x}"
        );
        let status = in_child_under(process_filter().unwrap(), netlink);
        assert!(killed_by_sigsys(status), "AF_NETLINK: {status:#x}");
    }

    #[test]
    fn an_allowed_call_under_the_job_filter_runs() {
        fn getpid() -> libc::c_long {
            // SAFETY: a raw system call without memory arguments.
            unsafe { libc::syscall(libc::SYS_getpid) }
        }
        let status = in_child(getpid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "{status:#x}"
        );
    }

    #[test]
    fn the_lists_name_each_call_once_and_leave_out_the_dangerous_ones() {
        let all = [JOB_THREAD, OTHER_THREADS].concat();
        let unique: std::collections::BTreeSet<i64> = all.iter().copied().collect();
        assert_eq!(unique.len(), all.len(), "a call is listed twice");
        for forbidden in [
            libc::SYS_execve,
            libc::SYS_socket, // allowed by domain only, and not on job threads
            libc::SYS_ptrace,
            libc::SYS_setuid,
            libc::SYS_mount,
            libc::SYS_bpf,
        ] {
            assert!(!all.contains(&forbidden), "{forbidden}");
        }
        for forbidden in [
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_accept4,
            libc::SYS_connect,
        ] {
            assert!(!JOB_THREAD.contains(&forbidden), "{forbidden}");
        }
    }

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

    #[test]
    fn this_host_allows_the_filters() {
        assert!(probe().is_ok(), "{:?}", probe());
    }

    #[test]
    fn a_host_whose_seccomp_call_is_refused_is_found_out() {
        // What a container's own filter may do: seccomp(2) answers ENOSYS.
        let refuse_seccomp: BpfProgram = SeccompFilter::new(
            [(libc::SYS_seccomp, Vec::new())].into_iter().collect(),
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
            TargetArch::x86_64,
        )
        .unwrap()
        .try_into()
        .unwrap();
        // SAFETY: the child installs the prepared filter, probes (no allocation: the error
        // is an OS error) and _exits; the parent waits for it.
        let status = unsafe {
            let pid = libc::fork();
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                let found = apply_here(&refuse_seccomp).is_ok() && probe().is_err();
                libc::_exit(if found { 0 } else { 3 });
            }
            let mut status = 0;
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            status
        };

        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "wait status {status:#x}"
        );
    }

    #[test]
    fn an_unknown_user_is_a_clear_error() {
        let e = drop_privileges("no-such-user-bud").unwrap_err();
        assert_eq!(e.to_string(), "no user named no-such-user-bud");
    }
}
