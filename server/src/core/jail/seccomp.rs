//! The seccomp filters: whether the host allows them ([`probe`]), what each kind of
//! thread may call (measured: the jail's module docs), and the filters built from it.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::JailError;

/// Why this host cannot install the filters ([`probe`]): the call that failed, and how.
#[derive(Debug, thiserror::Error)]
#[error("{call}")]
pub struct Unavailable {
    pub call: &'static str,
    pub source: std::io::Error,
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
    // A network card's relays (`vmm::net`, on the vCPU thread) pass a guest's half-close
    // on to the host socket the dial threads connected; they read and write it with
    // read/write, and open, connect or register nothing (tests/jail.rs runs it jailed).
    libc::SYS_shutdown,
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
    // Loading a user template built while the server runs (`crate::service::builds`): the
    // template directory is listed (getdents64), made if missing (mkdir), and its lock
    // taken (flock); the build itself runs in the builder process, never here.
    libc::SYS_getdents64,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_flock,
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
}
