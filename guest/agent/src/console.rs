//! Diagnostic lines on the console.
//!
//! Every byte written to the serial console is a port exit, and every `write` a guest
//! syscall, so a line is formatted first and written with one `write`, and the agent keeps
//! to a handful of lines per boot. Console trouble never takes PID 1 down: errors are
//! dropped, the doorbell carries the facts that matter.

use std::fmt::{self, Write as _};
use std::io;
use std::time::Duration;

/// Prefix of every line the agent writes.
const PREFIX: &str = "bud-agent: ";

/// The kernel opens this for PID 1 as stdin, stdout and stderr.
const CONSOLE: &std::ffi::CStr = c"/dev/console";

/// Writes `bud-agent: <args>\n` to stderr (the console) with a single `write` when possible.
pub fn line(args: fmt::Arguments<'_>) {
    let mut text = String::with_capacity(96);
    text.push_str(PREFIX);
    // Formatting into a String only fails if a Display impl fails; the line is best effort.
    let _ = text.write_fmt(args);
    text.push('\n');
    write_all(libc::STDERR_FILENO, text.as_bytes());
}

/// `say!("...", args)`: one diagnostic line on the console.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::console::line(format_args!($($arg)*))
    };
}
pub(crate) use say;

fn write_all(fd: libc::c_int, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: the pointer and length come from a live slice; write reads at most that.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        match usize::try_from(n) {
            Ok(0) => return,
            Ok(written) => bytes = bytes.get(written..).unwrap_or_default(),
            Err(_) if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Makes sure fds 0-2 are open, on the console if they were not.
///
/// The kernel gives PID 1 the console as stdio when it can open `/dev/console`; if it could
/// not, every later diagnostic would vanish and the worker would start with closed stdio
/// (which lets its first `open` land on fd 0). One `fcntl` when all is well.
pub fn ensure_stdio() {
    // SAFETY: F_GETFD only queries the descriptor flags of fd 2.
    if unsafe { libc::fcntl(libc::STDERR_FILENO, libc::F_GETFD) } != -1 {
        return;
    }
    // SAFETY: CONSOLE is a NUL-terminated path; open touches no other memory.
    let fd = unsafe { libc::open(CONSOLE.as_ptr(), libc::O_RDWR | libc::O_NOCTTY) };
    if fd < 0 {
        return;
    }
    for target in [libc::STDIN_FILENO, libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        if fd != target {
            // SAFETY: dup2 on descriptors we own; 0-2 are unused by anything in this process.
            unsafe { libc::dup2(fd, target) };
        }
    }
    if fd > libc::STDERR_FILENO {
        // SAFETY: fd came from the open above and is no longer needed after the dup2s.
        unsafe { libc::close(fd) };
    }
}

/// Time since boot (CLOCK_MONOTONIC, read through the vDSO: no syscall).
pub fn uptime() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live local.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}
