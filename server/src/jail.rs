//! The jail of `bud serve` (`--jail`, implied by `--user`): an unprivileged user and
//! seccomp filters, closed once every served template is prepared.
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
//! 2. installs [`process_filter`] on every thread (`SECCOMP_FILTER_FLAG_TSYNC`; threads made
//!    later inherit it): what the server as a whole does, measured (`strace -f` of `bud
//!    serve` under jobs, batches, streams, files, sessions, forks, cancellations, floods,
//!    timeouts);
//! 3. hands [`job_filter`] to the job threads, which stack it on their own before their next
//!    job: a job thread runs the guest's vCPU and parses what the guest wrote, so it is what
//!    a hostile guest would attack first; it may not create threads or processes, sockets,
//!    or change credentials.
//!
//! Anything outside a filter kills the whole process (`SECCOMP_RET_KILL_PROCESS`): a jail
//! that returned errors would leave a compromised thread running. Until the jail closes
//! (while templates are prepared) jobs can already run, unjailed; `/v1/health` says
//! `jailed` once it is closed. `ioctl` is checked by request: job threads may make KVM's
//! only (any of them: the request's type byte, not each number), the other threads also
//! the few socket and terminal ones measured. Not covered: no namespaces, chroot or cgroups
//! (see the threat model in docs/security.md, beside Firecracker's jailer).

use std::collections::BTreeMap;
use std::ffi::CString;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Why the jail could not be closed (the server then stops: it was asked to be jailed).
#[derive(Debug, thiserror::Error)]
pub enum JailError {
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
}

/// What `--jail` / `--user` asked for (`bud serve` takes the fields as these options).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct JailConfig {
    /// Once the templates are prepared, put every thread under a seccomp filter (job threads
    /// under a narrower one); a system call outside it kills the server.
    #[arg(long = "jail")]
    pub seccomp: bool,
    /// Once the templates are prepared, drop to this user and its group (implies --jail).
    #[arg(long)]
    pub user: Option<String>,
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
];

/// What the other threads of the server make besides [`JOB_THREAD`]'s (module docs).
const OTHER_THREADS: &[i64] = &[
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
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

/// A filter allowing the system calls `allowed` whole, and `ioctl` only for the requests
/// `ioctls` (its second argument, 32 bits as the kernel reads it).
fn filter(allowed: &[i64], ioctls: &[(u64, u64)]) -> Result<BpfProgram, JailError> {
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
    )
}

/// The filter job threads stack on it.
pub fn job_filter() -> Result<BpfProgram, JailError> {
    filter(JOB_THREAD, JOB_THREAD_IOCTLS)
}

/// Installs `prog` on the calling thread only.
pub fn apply_here(prog: &BpfProgram) -> Result<(), JailError> {
    seccompiler::apply_filter(prog).map_err(|e| JailError::Filter(e.to_string()))
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

/// Closes the jail (module docs): user, then the process filter on every thread; returns
/// the job threads' filter for them to stack.
pub fn close(config: &JailConfig) -> Result<Option<BpfProgram>, JailError> {
    if let Some(user) = &config.user {
        drop_privileges(user)?;
    }
    if !config.seccomp && config.user.is_none() {
        return Ok(None);
    }
    seccompiler::apply_filter_all_threads(&process_filter()?)
        .map_err(|e| JailError::Filter(e.to_string()))?;
    Ok(Some(job_filter()?))
}

#[cfg(test)]
mod tests {
    //! The filters against the real kernel, in forked children (a filter cannot be removed,
    //! and the forbidden call must kill a process that is not the test runner).

    use super::*;

    /// Forks; the child stacks the job filter and makes `call`, then exits 0 if it was
    /// allowed. Returns the child's wait status.
    fn in_child(call: fn() -> libc::c_long) -> libc::c_int {
        let prog = job_filter().unwrap();
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
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_ptrace,
            libc::SYS_setuid,
            libc::SYS_mount,
            libc::SYS_bpf,
        ] {
            assert!(!all.contains(&forbidden), "{forbidden}");
        }
        for forbidden in [libc::SYS_clone, libc::SYS_clone3, libc::SYS_accept4] {
            assert!(!JOB_THREAD.contains(&forbidden), "{forbidden}");
        }
    }

    #[test]
    fn an_unknown_user_is_a_clear_error() {
        let e = drop_privileges("no-such-user-bud").unwrap_err();
        assert_eq!(e.to_string(), "no user named no-such-user-bud");
    }
}
