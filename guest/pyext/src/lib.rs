//! `_bud`: the warm Python worker's only native piece.
//!
//! Gives `guest/python/bud_worker.py` what Python cannot do by itself, or not without
//! syscalls and fresh pages on the job path:
//! - **the mailbox** ([`mailbox`]): one locked, pre-touched anonymous mapping with the
//!   protocol header, handed to Python as a writable `memoryview` over the memory itself
//!   (no copy), plus its address and length;
//! - **the doorbell**: `ring(code, a, b)` and `ready()`, one `out` instruction each (see
//!   `guest/agent/src/doorbell.rs`, shared with the agent);
//! - **memory warm-up** ([`memory`]): `mallopt`, `reserve_heap`, `prefault_stack`,
//!   `lock_memory`; and pymalloc's arenas from one huge-page-friendly region ([`arenas`]:
//!   `use_arena_region`);
//! - **whom a process runs as** ([`creds`]): the calling thread's ids switched around a
//!   spawn, so `vfork` stays;
//! - **`open_beneath`** ([`beneath`]): a path of the work directory opened in one
//!   `openat2` that cannot leave it, for the file operations;
//! - **`Hooked`** ([`hooked`]): a frame-less stand-in for an `os` function that runs a hook
//!   first (how the job runner notices fd-level output without showing up in tracebacks).
//!
//! Every call holds the GIL and returns on the thread that made it: a doorbell is a plain
//! call, and in a clone the vCPU resumes right after its `out`, in the middle of `ring`.
//! Failed system calls raise `OSError` with the errno. The extension never rings on its own,
//! and `ring` refuses (RuntimeError) on a thread without the doorbell permission, so importing
//! it and using the mailbox outside a bud guest is safe; ringing outside one is not.

#[path = "../../../vmm/src/protocol.rs"]
#[allow(dead_code)] // shared verbatim with the host; the extension uses only some of it
mod protocol;

mod arenas;
mod beneath;
mod capture;
mod creds;
#[path = "../../agent/src/doorbell.rs"]
mod doorbell;
mod hooked;
mod inotify;
mod interrupt;
mod mailbox;
mod memory;

use std::cell::OnceCell;
use std::io;

use pyo3::exceptions::{PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use doorbell::Doorbell;
use mailbox::{Mailbox, MailboxError};
use protocol::{
    MAILBOX_DEFAULT_SIZE, code, failure, file_op, file_status, guest_flags, header, job, job_flags,
    lane, language, mode, outcome, process_event, process_op, result, watch_event,
};

/// Every constant of `protocol.rs`, under its Python name: `NAME` for top-level constants and
/// doorbell codes, `MODULE_NAME` for the others (`job::CODE_LEN` is `JOB_CODE_LEN`). A test
/// checks this list against the file, so a constant added there cannot be forgotten here.
const PROTOCOL: &[(&str, u64)] = &[
    ("PROTOCOL_VERSION", protocol::PROTOCOL_VERSION as u64),
    ("DOORBELL_PORT", protocol::DOORBELL_PORT as u64),
    ("DOORBELL_WIDTH", protocol::DOORBELL_WIDTH),
    ("MAILBOX_MAGIC", protocol::MAILBOX_MAGIC as u64),
    (
        "MAILBOX_DEFAULT_SIZE",
        protocol::MAILBOX_DEFAULT_SIZE as u64,
    ),
    ("MAILBOX_MAX_SIZE", protocol::MAILBOX_MAX_SIZE as u64),
    ("CAPTURE_SLACK", protocol::CAPTURE_SLACK as u64),
    (
        "DEFAULT_OUTPUT_LIMIT",
        protocol::DEFAULT_OUTPUT_LIMIT as u64,
    ),
    ("LANE_SIZE", lane::SIZE as u64),
    ("LANE_BESIDE", lane::BESIDE as u64),
    ("LANE_DOORBELL_BIT", lane::DOORBELL_BIT as u64),
    ("LANE_BYTE", lane::BYTE as u64),
    ("HEADER_MAGIC", header::MAGIC as u64),
    ("HEADER_VERSION", header::VERSION as u64),
    ("HEADER_READY_WALL_NS", header::READY_WALL_NS as u64),
    ("HEADER_SIZE", header::SIZE as u64),
    ("AGENT_STARTED", code::AGENT_STARTED as u64),
    ("READY", code::READY as u64),
    ("FLUSH", code::FLUSH as u64),
    ("DONE", code::DONE as u64),
    ("FAILED", code::FAILED as u64),
    ("LANGUAGE_PYTHON", language::PYTHON as u64),
    ("LANGUAGE_SHELL", language::SHELL as u64),
    ("LANGUAGE_FILES", language::FILES as u64),
    ("LANGUAGE_PROCESS", language::PROCESS as u64),
    ("LANGUAGE_KERNEL", language::KERNEL as u64),
    ("LANGUAGE_LAYER", language::LAYER as u64),
    ("LANGUAGE_PROGRAM", language::PROGRAM as u64),
    ("PROCESS_OP_START", process_op::START as u64),
    ("PROCESS_OP_POLL", process_op::POLL as u64),
    ("PROCESS_OP_STDIN", process_op::STDIN as u64),
    ("PROCESS_OP_SIGNAL", process_op::SIGNAL as u64),
    ("PROCESS_OP_RESIZE", process_op::RESIZE as u64),
    ("PROCESS_OP_WATCH", process_op::WATCH as u64),
    ("PROCESS_OP_UNWATCH", process_op::UNWATCH as u64),
    ("PROCESS_EVENT_WATCH", process_event::WATCH as u64),
    ("WATCH_EVENT_CREATE", watch_event::CREATE as u64),
    ("WATCH_EVENT_WRITE", watch_event::WRITE as u64),
    ("WATCH_EVENT_REMOVE", watch_event::REMOVE as u64),
    ("WATCH_EVENT_RENAME", watch_event::RENAME as u64),
    ("WATCH_EVENT_CHMOD", watch_event::CHMOD as u64),
    ("PROCESS_EVENT_PTY", process_event::PTY as u64),
    ("JOB_FLAGS_PROCESS_PTY", job_flags::PROCESS_PTY as u64),
    (
        "JOB_FLAGS_START_DIRECTORY",
        job_flags::START_DIRECTORY as u64,
    ),
    ("PROCESS_EVENT_STDOUT", process_event::STDOUT as u64),
    ("PROCESS_EVENT_STDERR", process_event::STDERR as u64),
    ("PROCESS_EVENT_EXIT", process_event::EXIT as u64),
    ("PROCESS_EVENT_HEADER", process_event::HEADER as u64),
    ("JOB_FLAGS_PROCESS_STDIN", job_flags::PROCESS_STDIN as u64),
    ("MODE_JOB", mode::JOB as u64),
    ("MODE_CELL", mode::CELL as u64),
    ("JOB_FLAGS_RESEED", job_flags::RESEED as u64),
    (
        "JOB_FLAGS_RESET_NAMESPACE",
        job_flags::RESET_NAMESPACE as u64,
    ),
    (
        "JOB_FLAGS_ERROR_IN_DISPLAY",
        job_flags::ERROR_IN_DISPLAY as u64,
    ),
    ("FILE_OP_WRITE", file_op::WRITE as u64),
    ("FILE_OP_APPEND", file_op::APPEND as u64),
    ("FILE_OP_READ", file_op::READ as u64),
    ("FILE_OP_LIST", file_op::LIST as u64),
    ("FILE_OP_DELETE", file_op::DELETE as u64),
    ("FILE_OP_GLOB", file_op::GLOB as u64),
    ("FILE_OP_STAT", file_op::STAT as u64),
    ("FILE_OP_MKDIR", file_op::MKDIR as u64),
    ("FILE_OP_MOVE", file_op::MOVE as u64),
    ("FILE_OP_AS_USER", file_op::AS_USER as u64),
    ("FILE_OP_METADATA", file_op::METADATA as u64),
    ("FILE_STATUS_OK", file_status::OK as u64),
    ("FILE_STATUS_BAD_PATH", file_status::BAD_PATH as u64),
    ("FILE_STATUS_NOT_FOUND", file_status::NOT_FOUND as u64),
    ("FILE_STATUS_WRONG_KIND", file_status::WRONG_KIND as u64),
    ("FILE_STATUS_OS_ERROR", file_status::OS_ERROR as u64),
    ("JOB_LANGUAGE", job::LANGUAGE as u64),
    ("JOB_CODE_LEN", job::CODE_LEN as u64),
    ("JOB_STDIN_LEN", job::STDIN_LEN as u64),
    ("JOB_ARGC", job::ARGC as u64),
    ("JOB_ARGS_LEN", job::ARGS_LEN as u64),
    ("JOB_ENVC", job::ENVC as u64),
    ("JOB_ENV_LEN", job::ENV_LEN as u64),
    ("JOB_WALL_CLOCK_NS", job::WALL_CLOCK_NS as u64),
    ("JOB_SEED", job::SEED as u64),
    ("JOB_SEED_LEN", job::SEED_LEN as u64),
    ("JOB_MODE", job::MODE as u64),
    ("JOB_FLAGS", job::FLAGS as u64),
    ("JOB_SEQUENCE", job::SEQUENCE as u64),
    ("JOB_FILE_OP", job::FILE_OP as u64),
    ("JOB_INTERRUPT", job::INTERRUPT as u64),
    ("JOB_NAMESPACE", job::NAMESPACE as u64),
    ("JOB_OUTPUT_LIMIT", job::OUTPUT_LIMIT as u64),
    ("JOB_DIALECT", job::DIALECT as u64),
    ("JOB_DATA", job::DATA as u64),
    ("JOB_DATA_END", job::DATA_END as u64),
    ("RESULT_STDOUT_LEN", result::STDOUT_LEN as u64),
    ("RESULT_STDERR_LEN", result::STDERR_LEN as u64),
    ("RESULT_OUTCOME", result::OUTCOME as u64),
    ("RESULT_EXIT_CODE", result::EXIT_CODE as u64),
    ("RESULT_PHASE_READ_NS", result::PHASE_READ_NS as u64),
    ("RESULT_PHASE_IDENTITY_NS", result::PHASE_IDENTITY_NS as u64),
    ("RESULT_PHASE_COMPILED_NS", result::PHASE_COMPILED_NS as u64),
    ("RESULT_PHASE_FINISHED_NS", result::PHASE_FINISHED_NS as u64),
    ("RESULT_GUEST_FLAGS", result::GUEST_FLAGS as u64),
    ("RESULT_DISPLAY_LEN", result::DISPLAY_LEN as u64),
    ("GUEST_FLAGS_CLOCK_SET", guest_flags::CLOCK_SET as u64),
    ("RESULT_STDOUT_AREA", result::STDOUT_AREA as u64),
    ("RESULT_STDOUT_AREA_END", result::STDOUT_AREA_END as u64),
    ("RESULT_STDERR_AREA", result::STDERR_AREA as u64),
    ("RESULT_STDERR_AREA_END", result::STDERR_AREA_END as u64),
    ("OUTCOME_EXITED", outcome::EXITED as u64),
    ("OUTCOME_SIGNALED", outcome::SIGNALED as u64),
    ("OUTCOME_OUT_OF_MEMORY", outcome::OUT_OF_MEMORY as u64),
    ("FAILURE_MOUNT", failure::MOUNT),
    ("FAILURE_SPAWN", failure::SPAWN),
    ("FAILURE_WORKER_EXITED", failure::WORKER_EXITED),
    ("FAILURE_IOPERM", failure::IOPERM),
];

thread_local! {
    /// The doorbell permission, on the thread that took it (Linux keeps it per thread).
    static DOORBELL: OnceCell<Doorbell> = const { OnceCell::new() };
}

impl From<MailboxError> for PyErr {
    fn from(e: MailboxError) -> Self {
        match e {
            MailboxError::BadSize { size, reason } => {
                PyValueError::new_err(format!("mailbox size {size}: {reason}"))
            }
            MailboxError::AlreadyCreated => {
                PyRuntimeError::new_err("this process already has its mailbox")
            }
            MailboxError::Os { op, source } => os_error(op, &source),
        }
    }
}

/// `OSError(errno, "op: strerror")`; Python picks the subclass (PermissionError...) from errno.
fn os_error(op: &str, e: &io::Error) -> PyErr {
    match e.raw_os_error() {
        Some(errno) => PyOSError::new_err((errno, format!("{op}: {e}"))),
        None => PyOSError::new_err(format!("{op}: {e}")),
    }
}

fn existing_mailbox() -> PyResult<&'static Mailbox> {
    mailbox::get().ok_or_else(|| PyRuntimeError::new_err("no mailbox: call create_mailbox()"))
}

fn with_doorbell<R>(f: impl FnOnce(&Doorbell) -> R) -> PyResult<R> {
    DOORBELL.with(|cell| cell.get().map(f)).ok_or_else(|| {
        PyRuntimeError::new_err(concat!(
            "no doorbell permission on this thread: ",
            "take_doorbell() first (inside a bud guest only)"
        ))
    })
}

/// A writable memoryview over the whole mailbox (no copy).
fn view<'py>(py: Python<'py>, mailbox: &'static Mailbox) -> PyResult<Bound<'py, PyAny>> {
    let len = isize::try_from(mailbox.len()).map_err(|e| PyValueError::new_err(e.to_string()))?;
    // SAFETY: the memory is `len` readable and writable bytes that are never unmapped
    // ('static), so the view can never outlive it. PyMemoryView_FromMemory returns a new
    // reference or NULL with an exception set, which from_owned_ptr_or_err turns into Err.
    unsafe {
        let ptr = pyo3::ffi::PyMemoryView_FromMemory(
            mailbox.as_ptr().cast(),
            len,
            pyo3::ffi::PyBUF_WRITE,
        );
        Bound::from_owned_ptr_or_err(py, ptr)
    }
}

/// Takes ioperm for the doorbell ports on this thread (threads started later inherit it).
/// Needs root. Idempotent.
#[pyfunction]
fn take_doorbell() -> PyResult<()> {
    DOORBELL.with(|cell| {
        if cell.get().is_none() {
            let doorbell = Doorbell::open().map_err(|e| os_error("ioperm", &e))?;
            // The cell was empty a moment ago on this very thread, so this set wins.
            let _ = cell.set(doorbell);
        }
        Ok(())
    })
}

/// Creates the process's mailbox of `size` bytes (whole pages) and returns a writable
/// memoryview on it. With `doorbell=True` (the default) it first takes the doorbell
/// permission; `doorbell=False` is for trying the mailbox outside a bud guest.
#[pyfunction]
#[pyo3(signature = (size = MAILBOX_DEFAULT_SIZE, *, doorbell = true))]
fn create_mailbox(py: Python<'_>, size: usize, doorbell: bool) -> PyResult<Bound<'_, PyAny>> {
    if doorbell {
        take_doorbell()?;
    }
    let mailbox = mailbox::create(size)?;
    view(py, mailbox)
}

/// A new writable memoryview on the existing mailbox.
#[pyfunction]
#[pyo3(name = "mailbox")]
fn mailbox_view(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    view(py, existing_mailbox()?)
}

/// The file descriptor of the mailbox's memory (a memfd, close-on-exec): a kernel runtime
/// started with it maps the same pages (`bud_runtime`).
#[pyfunction]
fn mailbox_fd() -> PyResult<i32> {
    Ok(existing_mailbox()?.fd())
}

/// Guest-virtual address of the mailbox.
#[pyfunction]
fn mailbox_address() -> PyResult<usize> {
    Ok(existing_mailbox()?.addr())
}

/// Length of the mailbox in bytes.
#[pyfunction]
fn mailbox_size() -> PyResult<usize> {
    Ok(existing_mailbox()?.len())
}

/// Rings the host: eax = code, rdi = a, rsi = b. Returns eax as the vCPU resumes (the code,
/// unless the host left a reply). Never call it outside a bud guest.
#[pyfunction]
#[pyo3(signature = (code, a = 0, b = 0))]
fn ring(code: u32, a: u64, b: u64) -> PyResult<u32> {
    with_doorbell(|doorbell| doorbell.ring(code, a, b))
}

/// The longest [`ready`] waits for the guest's tick (several tick periods: the clock not
/// moving in that time means there is no tick to wait for).
const TICK_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Rings READY with the mailbox's address and length, right after a tick of the guest
/// kernel (`doorbell::after_tick`) and after writing the wall clock into the header
/// (`header::READY_WALL_NS`). The host snapshots here; in a clone this call returns, and the
/// job starts.
#[pyfunction]
fn ready() -> PyResult<u32> {
    let mailbox = existing_mailbox()?;
    let (addr, len) = (mailbox.addr() as u64, mailbox.len() as u64);
    doorbell::after_tick(TICK_WAIT_LIMIT);
    mailbox.set_ready_wall_clock();
    with_doorbell(|doorbell| doorbell.ring(code::READY, addr, len))
}

/// glibc `mallopt(param, value)`; ValueError if glibc refuses it.
#[pyfunction]
fn mallopt(param: i32, value: i32) -> PyResult<()> {
    if !memory::mallopt(param, value) {
        return Err(PyValueError::new_err(format!(
            "mallopt({param}, {value}) refused"
        )));
    }
    Ok(())
}

/// Grows the malloc heap by `nbytes` and leaves the space free for later allocations
/// (needs the mmap threshold above `nbytes` and trimming off to stay).
#[pyfunction]
fn reserve_heap(nbytes: usize) -> PyResult<()> {
    if !memory::reserve_heap(nbytes) {
        return Err(PyMemoryError::new_err(format!("malloc({nbytes}) failed")));
    }
    Ok(())
}

/// Touches `nbytes` of the calling thread's stack below the current frame.
#[pyfunction]
fn prefault_stack(nbytes: usize) -> PyResult<()> {
    if nbytes > memory::STACK_PREFAULT_MAX {
        return Err(PyValueError::new_err(format!(
            "prefault_stack: at most {} bytes",
            memory::STACK_PREFAULT_MAX
        )));
    }
    memory::prefault_stack(nbytes);
    Ok(())
}

/// Starts the thread that turns the host's interrupt byte on `tty` into SIGINT for this
/// (the main) thread, and its lane byte into a byte written to `lane_fd` (the lane thread's
/// pipe; -1: none) (see `interrupt.rs`). Call before READY, from the main thread.
#[pyfunction]
#[pyo3(signature = (tty = "/dev/ttyS0", lane_fd = -1))]
fn start_interrupt_watcher(tty: &str, lane_fd: i32) -> PyResult<()> {
    let mailbox = existing_mailbox()?;
    interrupt::start(tty, mailbox, lane_fd).map_err(|e| os_error("interrupt watcher", &e))
}

/// The request the interrupt watcher last sent SIGINT for, forgotten by this call (0: none;
/// see `interrupt.rs`).
#[pyfunction]
fn take_interrupt() -> u32 {
    interrupt::take_sent()
}

/// The process that runs `language::KERNEL` requests (the image's kernel runtime): the
/// interrupt watcher sends a kernel request's SIGINT there (see `interrupt.rs`).
#[pyfunction]
fn set_kernel_pid(pid: i32) {
    interrupt::set_kernel_pid(pid);
}

/// mlockall(MCL_CURRENT): every page mapped now becomes resident and present.
#[pyfunction]
fn lock_memory() -> PyResult<()> {
    memory::lock_all().map_err(|e| os_error("mlockall", &e))
}

/// [`lock_memory`] again, for a worker whose arena region is installed: every mapping but
/// that region (see `memory::lock_mapped_except`); returns the bytes locked.
#[pyfunction]
fn lock_memory_again() -> PyResult<usize> {
    memory::lock_mapped_except(arenas::reserved()).map_err(|e| os_error("mlock", &e))
}

/// Makes every writable private page of this process its own (see
/// `memory::own_writable_pages`); returns the bytes of those mappings.
#[pyfunction]
fn own_writable_pages() -> PyResult<usize> {
    memory::own_writable_pages().map_err(|e| os_error("madvise(MADV_POPULATE_WRITE)", &e))
}

/// Makes pymalloc take its arenas from one reserved region of `bytes` (see `arenas.rs`).
/// Call after `lock_memory` (which would make the whole region resident) and once.
#[pyfunction]
fn use_arena_region(bytes: usize) -> PyResult<()> {
    arenas::install(bytes).map_err(|e| os_error("arena region", &e))
}

/// Frees the first `length` bytes of file `fd` (see `capture.rs`).
#[pyfunction]
fn punch_hole(fd: i32, length: u64) -> PyResult<()> {
    capture::punch_hole(fd, length).map_err(|e| os_error("fallocate(PUNCH_HOLE)", &e))
}

/// Remounts the tmpfs at `path` with `size=bytes` (see `capture.rs`).
#[pyfunction]
fn resize_tmpfs(path: &str, bytes: u64) -> PyResult<()> {
    capture::resize_tmpfs(path, bytes).map_err(|e| os_error("remount", &e))
}

/// Mailbox and doorbell of bud's warm Python worker (inside a bud guest).
#[pymodule]
fn _bud(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(take_doorbell, m)?)?;
    m.add_function(wrap_pyfunction!(create_mailbox, m)?)?;
    m.add_function(wrap_pyfunction!(mailbox_view, m)?)?;
    m.add_function(wrap_pyfunction!(mailbox_address, m)?)?;
    m.add_function(wrap_pyfunction!(mailbox_size, m)?)?;
    m.add_function(wrap_pyfunction!(mailbox_fd, m)?)?;
    m.add_function(wrap_pyfunction!(ring, m)?)?;
    m.add_function(wrap_pyfunction!(ready, m)?)?;
    m.add_function(wrap_pyfunction!(inotify::inotify_init, m)?)?;
    m.add_function(wrap_pyfunction!(beneath::open_beneath, m)?)?;
    m.add_function(wrap_pyfunction!(creds::thread_as_user, m)?)?;
    m.add_function(wrap_pyfunction!(creds::thread_as_root, m)?)?;
    m.add_function(wrap_pyfunction!(inotify::inotify_add_watch, m)?)?;
    m.add_function(wrap_pyfunction!(mallopt, m)?)?;
    m.add_function(wrap_pyfunction!(reserve_heap, m)?)?;
    m.add_function(wrap_pyfunction!(prefault_stack, m)?)?;
    m.add_function(wrap_pyfunction!(lock_memory, m)?)?;
    m.add_function(wrap_pyfunction!(lock_memory_again, m)?)?;
    m.add_function(wrap_pyfunction!(own_writable_pages, m)?)?;
    m.add_function(wrap_pyfunction!(use_arena_region, m)?)?;
    m.add_function(wrap_pyfunction!(start_interrupt_watcher, m)?)?;
    m.add_function(wrap_pyfunction!(take_interrupt, m)?)?;
    m.add_function(wrap_pyfunction!(set_kernel_pid, m)?)?;
    m.add_function(wrap_pyfunction!(punch_hole, m)?)?;
    m.add_function(wrap_pyfunction!(resize_tmpfs, m)?)?;
    m.add("INTERRUPT_BYTE", interrupt::INTERRUPT_BYTE)?;
    m.add_class::<hooked::Hooked>()?;

    // The protocol, from the one shared source.
    for (name, value) in PROTOCOL {
        m.add(*name, *value)?;
    }

    // glibc malloc parameters for mallopt().
    m.add("M_TRIM_THRESHOLD", libc::M_TRIM_THRESHOLD)?;
    m.add("M_TOP_PAD", libc::M_TOP_PAD)?;
    m.add("M_MMAP_THRESHOLD", libc::M_MMAP_THRESHOLD)?;
    m.add("M_ARENA_MAX", libc::M_ARENA_MAX)?;

    m.add("PAGE_SIZE", mailbox::PAGE_SIZE)?;
    m.add("STACK_PREFAULT_MAX", memory::STACK_PREFAULT_MAX)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python names of the `pub const`s in protocol.rs, read from its text.
    fn constants_in_protocol_rs() -> Vec<String> {
        let mut module = None;
        let mut names = Vec::new();
        for line in include_str!("../../../vmm/src/protocol.rs").lines() {
            if let Some(rest) = line.strip_prefix("pub mod ") {
                module = rest.split_whitespace().next();
            } else if line == "}" {
                module = None;
            } else if let Some(rest) = line.trim_start().strip_prefix("pub const ") {
                let name = rest.split(':').next().unwrap_or_default().trim();
                names.push(match module {
                    None | Some("code") => name.to_owned(),
                    Some(m) => format!("{}_{name}", m.to_uppercase()),
                });
            }
        }
        names
    }

    #[test]
    fn every_protocol_constant_is_exported_to_python() {
        let exported: Vec<_> = PROTOCOL
            .iter()
            .map(|(name, _)| (*name).to_owned())
            .collect();

        let missing: Vec<_> = constants_in_protocol_rs()
            .into_iter()
            .filter(|name| !exported.contains(name))
            .collect();

        assert!(missing.is_empty(), "add to PROTOCOL in lib.rs: {missing:?}");
    }

    #[test]
    fn every_exported_constant_exists_in_protocol_rs() {
        let in_file = constants_in_protocol_rs();

        let stale: Vec<_> = PROTOCOL
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| !in_file.iter().any(|n| n == name))
            .collect();

        assert!(stale.is_empty(), "{stale:?}");
    }
}
