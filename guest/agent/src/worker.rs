//! The warm Python worker: its command line, its environment, and starting it.
//!
//! Owns how the worker process is made; the agent never talks to it afterwards except by
//! reaping it. The worker itself lives in `guest/python/bud_worker.py`.

use std::fmt;
use std::io;
use std::process::{Command, Stdio};

/// Debian's CPython, in the image at this path.
pub const PYTHON: &str = "/usr/bin/python3.11";

/// Interpreter flags, chosen deliberately:
/// - `site` *is* imported (no `-S`): jobs get `exit()`, `quit()`, `help()` and
///   dist-packages on `sys.path`, as `python3 -c` has them. Its cost is paid once, at
///   template boot, never per job.
/// - `-s`: no user site directory (HOME=/tmp has none; saves the lookups).
/// - `-P`: no working directory at the front of `sys.path`, so warm-up imports do not probe
///   /tmp first. The job runner gives each job the `sys.path[0]` that `python3 -c` would.
/// - `-m bud_worker`: found through PYTHONPATH as a precompiled .pyc; runpy is frozen into
///   the interpreter, so `-m` costs no extra files.
/// - `--guest`: the worker's own flag for "you are in a bud guest: ring the doorbell"
///   (without it the worker refuses; `--dry-run` warms up without ringing, for hosts).
///
/// No `-E`/`-I` (PYTHONPATH is how the worker is found), no `-u` (the worker's own stdout
/// is the console and only carries a line or two), no `-O` (jobs expect `assert`).
pub const ARGS: [&str; 5] = ["-s", "-P", "-m", "bud_worker", "--guest"];

/// Working directory of the worker (and so of jobs): the tmpfs.
pub const WORKDIR: &str = "/tmp";

/// The worker's whole environment. The agent's own environment (whatever the kernel passed
/// from its command line) is not inherited. Jobs and their child processes see this.
pub const ENV: [(&str, &str); 10] = [
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/tmp"),
    ("TMPDIR", "/tmp"),
    ("USER", "root"),
    ("LOGNAME", "root"),
    ("SHELL", "/bin/sh"),
    // Output is captured, never shown on a terminal.
    ("TERM", "dumb"),
    // glibc 2.36 has C.UTF-8 built in: UTF-8 everywhere without locale files.
    ("LANG", "C.UTF-8"),
    // The image's .pyc files are precompiled; the worker never writes new ones.
    ("PYTHONDONTWRITEBYTECODE", "1"),
    ("PYTHONPATH", "/usr/lib/bud"),
];

/// What keeps the guest's libraries (and so nearly all code of every guest process) off the
/// AVX, AVX2 and AVX-512 registers where the kernel does not save them (see
/// [`kernel_saves_avx`]): each library picks its vector code from `cpuid` when it loads, and
/// each has its own switch. The worker gets them when it starts, so they hold for everything
/// the template loads before its snapshot (numpy is imported there) and every process a job
/// starts. A job can still run AVX code of its own (or clear these variables); that harms
/// only its own processes.
pub const NO_AVX: [(&str, &str); 5] = [
    // glibc: memcpy, strlen... and libm.
    (
        "GLIBC_TUNABLES",
        "glibc.cpu.hwcaps=-AVX,-AVX2,-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD,\
         -AVX_Fast_Unaligned_Load",
    ),
    // numpy's dispatched loops (the names of numpy 1.24, the datascience image's: names a
    // build does not dispatch only warn, and disabling what the CPU lacks is allowed).
    (
        "NPY_DISABLE_CPU_FEATURES",
        "AVX F16C FMA3 AVX2 AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL",
    ),
    // OpenSSL (hashlib, ssl): clears AVX and OSXSAVE in the first capability word, and
    // AVX2, AVX512F/DQ/IFMA/BW/VL, VAES and VPCLMULQDQ in the second (OPENSSL_ia32cap(3)).
    ("OPENSSL_ia32cap", "~0x1800000000000000:~0x600c0230020"),
    // libjpeg-turbo (Pillow, matplotlib): its SSE2 code instead of AVX2.
    ("JSIMD_FORCESSE2", "1"),
    // OpenBLAS (numpy's BLAS and LAPACK in the datascience image): picks its kernels from
    // cpuid and xgetbv at load, so it would take the host's AVX2/AVX-512 ones (Zen,
    // Haswell, SkylakeX). Nehalem's are SSE2-SSE4.2 only and run on every x86-64 host bud
    // supports; a 1500x1500 product with them took ~1.6x the Zen kernels' time on the host.
    ("OPENBLAS_CORETYPE", "Nehalem"),
];

/// Whether the guest kernel saves and restores the AVX register state between processes:
/// only with XSAVE (`xsave` among the kernel's CPU flags). Under kvm_pvm the guest kernel
/// runs without it (`noxsave`: the hypervisor's instruction emulator lacks the xsave
/// family), but guest user code runs natively on the host CPU, where `cpuid` and `xgetbv`
/// still report AVX-512 as usable, so glibc picks its AVX2/AVX-512 `memcpy`, `strlen`...
/// and one process's vector registers (their upper halves, zmm16-31, the mask registers)
/// are clobbered by another's at every context switch: measured, a 1 MiB `bytearray`
/// copy in a child lost its first 128 bytes whenever the parent made system calls
/// meanwhile, and a starting busybox read glibc's TLS locale pointer as 0 and died of
/// SIGSEGV (issue 11, item 6). With [`NO_AVX`] the libraries leave those registers alone.
pub fn kernel_saves_avx() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| {
        info.lines()
            .find(|l| l.starts_with("flags"))
            .is_some_and(|l| l.split_whitespace().any(|f| f == "xsave"))
    })
}

/// Starts the worker and returns its pid.
///
/// stdin is /dev/null (a job never reads the console by accident); stdout and stderr stay on
/// the console for the worker's few diagnostic lines. std spawns with `posix_spawn`
/// (a vfork-style clone), which is far cheaper than fork+exec when every page-table copy is
/// emulated.
pub fn spawn() -> io::Result<libc::pid_t> {
    let mut cmd = Command::new(PYTHON);
    cmd.args(ARGS).env_clear().envs(ENV);
    if !kernel_saves_avx() {
        cmd.envs(NO_AVX);
    }
    let child = cmd.current_dir(WORKDIR).stdin(Stdio::null()).spawn()?;
    libc::pid_t::try_from(child.id()).map_err(io::Error::other)
}

/// Where the guest kernel takes the pid whose exit it reports to the VMM before tearing the
/// process down (bud's kernel patch 0010, `vmm::devices::exit_report`).
pub const EXIT_WATCH: &str = "/sys/module/kernel/parameters/bud_exit_watch";

/// Names `pid` (the worker) to the guest kernel's exit report. Without it (a kernel without
/// the patch) the agent's own report when it reaps the worker still ends the job, later.
pub fn watch_exit(pid: libc::pid_t) -> io::Result<()> {
    std::fs::write(EXIT_WATCH, pid.to_string())
}

/// A `waitpid` status, displayed for people.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitStatus(pub libc::c_int);

impl WaitStatus {
    /// The raw status as the FAILED doorbell's detail word (no sign extension).
    pub fn detail(self) -> u64 {
        // `as u32` reinterprets the bits, as the host reads them back.
        u64::from(self.0 as u32)
    }
}

impl fmt::Display for WaitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.0;
        if libc::WIFEXITED(status) {
            write!(f, "exited with status {}", libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            let core = if libc::WCOREDUMP(status) {
                " (core dumped)"
            } else {
                ""
            };
            write!(f, "killed by signal {}{core}", libc::WTERMSIG(status))
        } else {
            write!(f, "wait status {status:#x}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_status_is_described_with_its_code() {
        let status = WaitStatus(78 << 8);

        assert_eq!(status.to_string(), "exited with status 78");
    }

    #[test]
    fn signal_death_is_described_with_signal_and_core() {
        let status = WaitStatus(libc::SIGSEGV | 0x80);

        assert_eq!(status.to_string(), "killed by signal 11 (core dumped)");
    }

    #[test]
    fn detail_is_the_raw_status_without_sign_extension() {
        let status = WaitStatus(-1);

        assert_eq!(status.detail(), 0xffff_ffff);
    }

    #[test]
    fn worker_environment_has_no_duplicate_names() {
        let mut names: Vec<_> = ENV.iter().map(|(name, _)| *name).collect();
        names.sort_unstable();
        names.dedup();

        assert_eq!(names.len(), ENV.len());
    }

    #[test]
    fn worker_finds_its_module_through_pythonpath() {
        let pythonpath = ENV.iter().find(|(name, _)| *name == "PYTHONPATH");

        assert_eq!(pythonpath, Some(&("PYTHONPATH", "/usr/lib/bud")));
        assert!(ARGS.windows(2).any(|pair| pair == ["-m", "bud_worker"]));
    }

    #[test]
    fn worker_home_and_workdir_are_the_tmpfs() {
        let home = ENV
            .iter()
            .find(|(name, _)| *name == "HOME")
            .map(|(_, v)| *v);

        assert_eq!((home, WORKDIR), (Some("/tmp"), "/tmp"));
    }
}
