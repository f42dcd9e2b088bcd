//! The host <-> guest protocol: doorbell port, doorbell codes and the mailbox header.
//!
//! This file is shared verbatim by the host (`vmm`) and the guest (`bud-agent`, the `_bud`
//! Python extension, which include it with `#[path]`), so it must stay free of dependencies:
//! plain constants and `core` only.
//!
//! # Doorbell
//! The guest rings the host with a 32-bit `out` to [`DOORBELL_PORT`] from user space (CPL3):
//! `eax` holds a doorbell code, `rdi` and `rsi` carry arguments (the code says which). One port
//! exit per job boundary and no guest-kernel work. A CPL3 `out` needs permission in the TSS I/O
//! bitmap for every port it touches (kvm_pvm checks it as hardware does), so the guest takes
//! `ioperm(DOORBELL_PORT, DOORBELL_WIDTH, 1)` first.
//!
//! # Mailbox
//! Memory the warm Python worker allocated, locked and touched before READY. At the READY
//! doorbell `rdi` is its guest-virtual address and `rsi` its length; the host translates it
//! once through the guest page tables into a list of guest-physical pages. It starts with a
//! header (see [`header`]) (little endian) written by the guest. Everything the guest
//! writes there is hostile input to the host: the host bounds-checks every field.

/// Version of this protocol. Bumped on any change to the codes or the mailbox layout.
pub const PROTOCOL_VERSION: u32 = 15;

/// I/O port of the doorbell. Not used by any device bud emulates (nor by legacy PC hardware).
pub const DOORBELL_PORT: u16 = 0x0bd0;

/// Width of the doorbell access in bytes (a 32-bit `out`), hence the number of ports the
/// guest's `ioperm` must cover.
pub const DOORBELL_WIDTH: u64 = 4;

/// Magic at offset 0 of the mailbox: "BUDM" in little endian.
pub const MAILBOX_MAGIC: u32 = u32::from_le_bytes(*b"BUDM");

/// Mailbox size the worker allocates: two [`lane`]s of 4 MiB (a multiple of the 4 KiB page
/// size). The layout in [`job`] and [`result`] is each lane's.
pub const MAILBOX_DEFAULT_SIZE: usize = 2 * lane::SIZE;

/// Upper bound the host accepts for the mailbox length at READY.
pub const MAILBOX_MAX_SIZE: usize = 64 << 20;

/// Why a mailbox of `len` bytes breaks the protocol's rules (room for the header, whole
/// 4 KiB pages, at most [`MAILBOX_MAX_SIZE`]), or `None` when it keeps them: the one check of
/// whoever makes a mailbox in the guest (the worker's `_bud`, the node kernel's addon) and of
/// the host at READY.
pub fn mailbox_len_fault(len: u64) -> Option<&'static str> {
    if len < header::SIZE as u64 {
        Some("smaller than the mailbox header")
    } else if len % 4096 != 0 {
        Some("not a whole number of pages")
    } else if len > MAILBOX_MAX_SIZE as u64 {
        Some("larger than MAILBOX_MAX_SIZE")
    } else {
        None
    }
}

/// Bytes past a request's [`job::OUTPUT_LIMIT`] that the guest's output capture may hold:
/// enough for the host to see the cap crossed (and so say `output_limit`).
pub const CAPTURE_SLACK: usize = 64 << 10;

/// The output cap of a request that names none (8 MiB); the guest's capture file system is
/// made this size plus [`CAPTURE_SLACK`] at boot, so such jobs never resize it.
pub const DEFAULT_OUTPUT_LIMIT: usize = 8 << 20;

/// Byte offsets of the mailbox header fields (all `u32`, little endian).
pub mod header {
    /// [`super::MAILBOX_MAGIC`].
    pub const MAGIC: usize = 0;
    /// [`super::PROTOCOL_VERSION`] the guest speaks.
    pub const VERSION: usize = 4;
    /// The guest's `CLOCK_REALTIME` (nanoseconds since the epoch, `u64`), read by the worker
    /// right before it rings READY. Clones resume with the template's clock, so this is their
    /// wall clock at resume; the host moves it to its own (see `vmm::identity`).
    pub const READY_WALL_NS: usize = 8;
    /// Size of the header; payload (defined by the job protocol) starts here.
    pub const SIZE: usize = 64;
}

/// The mailbox's two lanes. Lane 0 (offset 0) carries the request the VM runs: the host
/// writes it and resumes the vCPU, and the worker's main thread answers it at DONE. Lane 1
/// (offset [`lane::SIZE`]) carries one request *beside* it (a file or process operation
/// while a cell runs): the host writes it while the vCPU is stopped at any exit of the main
/// request and puts [`lane::BYTE`] on the console; the worker's lane thread serves it and
/// rings [`code::FLUSH`] and [`code::DONE`] with [`lane::DOORBELL_BIT`] set. Each lane has
/// the whole layout of [`job`] and [`result`] at its own offset. The worker's main thread
/// holds the lane's lock from before it rings DONE until it is resumed, so at the main
/// request's DONE no lane request is being served: one the host sent that has not been
/// answered was never started, and the host takes it back by writing 0 to the lane's
/// `job::SEQUENCE`.
pub mod lane {
    /// Bytes of each lane (a request area and two output areas).
    pub const SIZE: usize = 4 << 20;
    /// Offset of the lane beside the main request.
    pub const BESIDE: usize = SIZE;
    /// Set in a doorbell code rung for the lane beside (`FLUSH | DOORBELL_BIT`, ...).
    pub const DOORBELL_BIT: u32 = 0x100;
    /// The console byte that tells the worker's lane thread a request waits in lane 1 (ENQ;
    /// the interrupt byte is ETX).
    pub const BYTE: u8 = 0x05;
}

/// Doorbell codes (the value in `eax` of the 32-bit `out`).
pub mod code {
    /// The agent (PID 1) started; `rdi` = [`super::PROTOCOL_VERSION`]. Diagnostic only.
    pub const AGENT_STARTED: u32 = 0x0001;
    /// The warm worker is ready: `rdi` = mailbox guest-virtual address, `rsi` = its length.
    /// The host takes the template snapshot at this exit.
    pub const READY: u32 = 0x0002;
    /// Output is waiting in the stdout/stderr areas (full, or pending for a while): the host
    /// copies `result::STDOUT_LEN` / `result::STDERR_LEN` bytes out of them, sets both lengths
    /// to 0 and resumes the guest.
    pub const FLUSH: u32 = 0x0003;
    /// The job finished: `result::OUTCOME` and `result::EXIT_CODE` are valid; output still in
    /// the areas is the last of it.
    pub const DONE: u32 = 0x0004;
    /// The guest failed: `rdi` = a [`super::failure`] code, `rsi` = detail (an exit status or
    /// errno). Before READY this is a failed boot; after it, `WORKER_EXITED` is how a job that
    /// ended its process (`os._exit`, a fatal signal, the OOM killer) is reported, and output
    /// already in the areas is still valid. The console holds the human-readable story.
    pub const FAILED: u32 = 0x00ff;
}

/// Language codes in `job::LANGUAGE`.
pub mod language {
    /// `python3 -c CODE` semantics.
    pub const PYTHON: u32 = 1;
    /// POSIX shell (busybox `sh`).
    pub const SHELL: u32 = 2;
    /// A file operation in the work directory (`job::FILE_OP`, see [`super::file_op`]):
    /// `code` is the path, `stdin` the data written.
    pub const FILES: u32 = 3;
    /// A process operation (`job::FILE_OP` holds a [`super::process_op`]): the sandbox's
    /// background processes, kept by the worker between requests.
    pub const PROCESS: u32 = 4;
    /// The image's kernel runtime (the manifest's `run: "kernel"` runtimes, JavaScript and
    /// TypeScript in the `node` template): the warm kernel program runs the code, as the
    /// language `job::DIALECT` names.
    pub const KERNEL: u32 = 5;
    /// A template layer, applied in a clone of the parent template to make a user template
    /// without a first boot ([`crate::template`]'s `derive`): `code` is a JSON object
    /// `{"archive": PATH, "warm_from": N}`, the archive a `newc` cpio of the files the layer
    /// adds, written to PATH by file requests first; `warm_from` the first of the manifest's
    /// `user_warm` files this layer runs. On success the worker rings READY, where the host
    /// snapshots the new template (and where its clones resume); on failure DONE, the error
    /// on stderr.
    pub const LAYER: u32 = 6;
    /// A program runtime (the manifest's `run: "program"` runtimes): the worker writes
    /// `code` to a file and runs the runtime's interpreter on it, the job's `args` after it;
    /// `job::DIALECT` says which of the template's program runtimes.
    pub const PROGRAM: u32 = 7;
}

/// How the worker treats a request (`job::MODE`).
pub mod mode {
    /// A one-shot job: `python3 -c` semantics in a fresh `__main__`. The VM is reset (or
    /// thrown away) afterwards.
    pub const JOB: u32 = 0;
    /// A cell of a session: Python runs in the session's `__main__`, which persists from
    /// cell to cell, and a final expression's value is reported in the display area
    /// (`result::DISPLAY_LEN`); shell runs in the session's working directory.
    pub const CELL: u32 = 1;
}

/// Bits of `job::FLAGS`.
pub mod job_flags {
    /// Seed Python's `random` from `job::SEED` (always done for [`super::mode::JOB`]; for a
    /// session only on its first request and the first request of a fork child, so that a
    /// session's own random state carries from cell to cell).
    pub const RESEED: u32 = 1;
    /// A cell: empty its namespace (`job::NAMESPACE`) before running it (a restarted
    /// context; a new namespace starts empty anyway).
    pub const RESET_NAMESPACE: u32 = 2;
    /// A cell: report an uncaught exception in the display area (`"error": {"name",
    /// "value", "traceback"}`) instead of printing its traceback on stderr (Jupyter's
    /// error message, for clients that show it apart from the output).
    pub const ERROR_IN_DISPLAY: u32 = 4;
    /// A [`super::process_op::START`]: give the process a stdin pipe.
    pub const PROCESS_STDIN: u32 = 8;
    /// A [`super::process_op::START`]: run it on a terminal (`args[1]` is its size).
    pub const PROCESS_PTY: u32 = 16;
    /// A cell: `args[0]` is the directory its namespace starts in (not one of the cell's
    /// args). The worker enters it before the namespace's first cell and again after a
    /// [`RESET_NAMESPACE`]; a directory it cannot enter leaves the namespace where the
    /// process is, without a word (as IPython's `%cd`, which E2B uses, only prints).
    pub const START_DIRECTORY: u32 = 32;
}

/// File operations (`job::FILE_OP` of a `language::FILES` request). Paths are relative to
/// the work directory and must resolve inside it; exit codes are [`file_status`].
pub mod file_op {
    /// Create or truncate the file, then write `stdin` (parent directories are created).
    pub const WRITE: u32 = 1;
    /// Append `stdin` to the file (a large upload arrives in several requests).
    pub const APPEND: u32 = 2;
    /// Write the file's bytes to stdout.
    pub const READ: u32 = 3;
    /// Write a JSON list of `{"name", "type": "file"|"dir"|"symlink"|"other", "size", "mode"
    /// (`st_mode`), "mtime_ns", "target" (a symlink's)}` to stdout (entries as `lstat` sees
    /// them).
    pub const LIST: u32 = 4;
    /// Remove a file, or a directory with everything in it.
    pub const DELETE: u32 = 5;
    /// Write the names of the regular files matching the glob pattern in `code` (relative
    /// to the work directory, `**` allowed) to stdout, NUL-separated.
    pub const GLOB: u32 = 6;
    /// Write a JSON object `{"name", "type": "file"|"dir"|"symlink"|"other", "size", "mode"
    /// (`st_mode`), "mtime_ns", "target"}` of the path (not following a final symlink) to
    /// stdout.
    pub const STAT: u32 = 7;
    /// Create the directory and its parents (an existing directory is not an error; an
    /// existing file is [`super::file_status::WRONG_KIND`]).
    pub const MKDIR: u32 = 8;
    /// Rename the path to the path in `stdin` (parents of the destination are created).
    pub const MOVE: u32 = 9;
    /// A flag on WRITE, APPEND, MKDIR and MOVE: what the operation creates or writes (the
    /// file written, directories made on the way) belongs to the guest's non-root user
    /// `user` (its uid and gid in the guest's `/etc/passwd`), not to root. The operation
    /// itself runs as root either way.
    pub const AS_USER: u32 = 1 << 16;
    /// A flag on LIST and STAT: each entry also has `"metadata"`, `{key: value}` of its
    /// `user.e2b.<key>` extended attributes (E2B's file metadata; a final symlink's own,
    /// which the guest never has: the link is not followed). On WRITE: the request's path
    /// is `PATH\0JSON`, JSON an object of string keys and values, and after the write the
    /// file's `user.e2b.*` attributes are exactly those keys (others removed; `{}` clears
    /// them).
    pub const METADATA: u32 = 1 << 17;
}

/// Process operations (`job::FILE_OP` of a `language::PROCESS` request). Exit codes are
/// [`file_status`] (`NOT_FOUND`: no such live process; `BAD_PATH`: the working directory
/// is not a directory).
pub mod process_op {
    /// Start `/bin/sh -c CODE` in its own session (process group) with the request's env,
    /// in the directory `args[0]` (the work directory if empty), stdout and stderr on
    /// pipes, stdin on a pipe if `job::FLAGS` has [`super::job_flags::PROCESS_STDIN`] (else
    /// `/dev/null`). With [`super::job_flags::PROCESS_PTY`] it runs on a new terminal of
    /// `args[1]` (`ROWSxCOLS`) instead, as its controlling terminal (busybox `setsid -c`),
    /// stdin, stdout and stderr; its output comes as [`super::process_event::PTY`] and
    /// `STDIN` writes to the terminal. With a user name in `args[2]` (one of the guest's
    /// `/etc/passwd`) it runs as that user (its uid, gid and groups) with its `HOME`, `USER`,
    /// `LOGNAME` and `SHELL`, unless the request's env sets them; else as the worker (root)
    /// with the worker's environment. Writes its pid (decimal) to stdout.
    pub const START: u32 = 1;
    /// Wait up to `args[0]` milliseconds (until the host's interrupt, or until there is
    /// something to report) for output and exits of the live processes, and write what
    /// happened to stdout as events (see [`super::process_event`]), at most `args[1]`
    /// bytes of output. Nothing to wait for (no live process): returns at once.
    pub const POLL: u32 = 2;
    /// Write `stdin` to the stdin pipe of process `CODE` (decimal pid) without blocking:
    /// stdout is the number of bytes taken (decimal); then close it if `args[0]` is
    /// `close`.
    pub const STDIN: u32 = 3;
    /// Send signal `args[0]` (decimal) to process group `CODE` (the process and what it
    /// started).
    pub const SIGNAL: u32 = 4;
    /// Set the terminal size of PTY process `CODE` to `args[0]` (`ROWSxCOLS`); the process
    /// gets SIGWINCH.
    pub const RESIZE: u32 = 5;
    /// Watch directory `CODE` (absolute, or relative to the work directory), and its
    /// subdirectories if `args[0]` is `recursive`: its changes come as
    /// [`super::process_event::WATCH`] events of the watcher, whose number (decimal) is
    /// the answer. With `entries` in `args[1]`, a create, write or chmod event also
    /// carries the entry as it is when the guest reads the event (see
    /// [`super::process_event::WATCH`]). A watcher counts as a live process for polls.
    pub const WATCH: u32 = 6;
    /// Stop watcher `CODE`.
    pub const UNWATCH: u32 = 7;
}

/// The events a [`process_op::POLL`] writes, back to back: a header of `pid: u32`,
/// `kind: u32`, `value: i32`, `len: u32` (little endian), then `len` bytes of data.
pub mod process_event {
    /// Output on the process's stdout (the data).
    pub const STDOUT: u32 = 1;
    /// Output on its stderr.
    pub const STDERR: u32 = 2;
    /// It ended: `value` is its exit status (>= 0) or minus the signal that killed it.
    /// Every output event of the process comes before this one.
    pub const EXIT: u32 = 3;
    /// Output on its terminal (a PTY process).
    pub const PTY: u32 = 4;
    /// A change under a watched directory: `pid` is the watcher, `value` one of
    /// [`super::watch_event`], the data the path relative to the watched directory; for a
    /// watcher made with `entries`, then a NUL and the entry's JSON as a
    /// [`super::file_op::STAT`] with [`super::file_op::METADATA`] writes it (none when the
    /// entry is gone again).
    pub const WATCH: u32 = 5;
    /// Size of an event's header.
    pub const HEADER: usize = 16;
}

/// What changed, in a [`process_event::WATCH`] event (E2B's, as fsnotify names them).
pub mod watch_event {
    /// Created, or moved in.
    pub const CREATE: i32 = 1;
    /// Written (modified).
    pub const WRITE: i32 = 2;
    pub const REMOVE: i32 = 3;
    /// Moved away (renamed).
    pub const RENAME: i32 = 4;
    /// Its permissions or other metadata changed.
    pub const CHMOD: i32 = 5;
}

/// Exit codes of a `language::FILES` request (`EXIT_CODE` with outcome `EXITED`).
pub mod file_status {
    pub const OK: i32 = 0;
    /// The path is malformed or leaves the work directory (after resolving symlinks).
    pub const BAD_PATH: i32 = 2;
    pub const NOT_FOUND: i32 = 3;
    /// A directory where a file was needed, or the other way round.
    pub const WRONG_KIND: i32 = 4;
    /// Any other OS error (stderr says which).
    pub const OS_ERROR: i32 = 5;
}

/// The job request: fields the host writes before resuming a clone (byte offsets in the
/// mailbox; `u32`/`u64` little endian). The variable parts lie back to back in the request
/// area starting at [`job::DATA`]: code, stdin, args, env; args and env entries are each
/// NUL-terminated (`KEY=VALUE` for env).
pub mod job {
    /// [`super::language`] code.
    pub const LANGUAGE: usize = 64;
    pub const CODE_LEN: usize = 68;
    pub const STDIN_LEN: usize = 72;
    /// Number of NUL-terminated strings in the args blob, and its length in bytes.
    pub const ARGC: usize = 76;
    pub const ARGS_LEN: usize = 80;
    /// Number of NUL-terminated `KEY=VALUE` strings in the env blob, and its length in bytes.
    pub const ENVC: usize = 84;
    pub const ENV_LEN: usize = 88;
    /// Host wall-clock time (`CLOCK_REALTIME`, nanoseconds since the epoch, `u64`) when the
    /// request was written. The host has already set the guest's clock; the guest only
    /// checks it (and sets it itself if it is off by more than its tolerance).
    pub const WALL_CLOCK_NS: usize = 96;
    /// Fresh host randomness that seeds Python's `random` (and the shell's `$RANDOM`). Not
    /// the kernel CRNG's secret: the host writes that one straight into the guest kernel.
    pub const SEED: usize = 104;
    pub const SEED_LEN: usize = 32;
    /// [`super::mode`] of the request (`u32`).
    pub const MODE: usize = 136;
    /// [`super::job_flags`] bits (`u32`).
    pub const FLAGS: usize = 140;
    /// Sequence number of the request (`u32`, never 0): the worker runs a request once;
    /// resumed with a number it has already run, it rings DONE again without running it.
    pub const SEQUENCE: usize = 144;
    /// [`super::file_op`] of a `language::FILES` request (`u32`).
    pub const FILE_OP: usize = 148;
    /// The sequence number of the request the host wants interrupted (`u32`), written
    /// before it sends the interrupt byte on the console. The guest's watcher signals the
    /// running request only if this matches its `SEQUENCE`: a late byte never interrupts
    /// the next request.
    pub const INTERRUPT: usize = 152;
    /// The Python namespace of a cell (`u32`): 0 is the session's `__main__`, any other
    /// number an independent namespace made on first use (a context of a code-interpreter
    /// client). Unused by other requests.
    pub const NAMESPACE: usize = 156;
    /// The request's output cap, stdout + stderr bytes (`u64`). The host enforces it as it
    /// copies output out; the guest only uses it to bound the files that catch output
    /// written below Python's level (shell jobs, child processes, `os.write`) at the cap
    /// plus [`super::CAPTURE_SLACK`], so a flood there ends promptly (the writer gets
    /// `ENOSPC`) instead of filling the guest's RAM.
    pub const OUTPUT_LIMIT: usize = 160;
    /// Which of the kernel's languages a [`super::language::KERNEL`] request is written in
    /// (`u32`): 0 the kernel runtime's own (JavaScript), `n` the `n`-th of its dialects
    /// (TypeScript), as the manifest's runtimes number them (`Runtime::dialect`). 0 in
    /// every other request.
    pub const DIALECT: usize = 168;
    /// Start of the request data.
    pub const DATA: usize = 4096;
    /// End of the request data: code + stdin + args + env must fit in `DATA..DATA_END`.
    pub const DATA_END: usize = 2 << 20;
}

/// The job result and output areas (guest writes, host reads).
pub mod result {
    /// Bytes waiting in the stdout / stderr area (`u32`); the host zeroes them after a FLUSH.
    pub const STDOUT_LEN: usize = 256;
    pub const STDERR_LEN: usize = 260;
    /// [`super::outcome`] code (`u32`), valid at DONE.
    pub const OUTCOME: usize = 264;
    /// Exit status or signal number (`i32`), valid at DONE.
    pub const EXIT_CODE: usize = 268;
    /// The guest's own phase marks, valid at DONE: `u64` nanoseconds of the guest's
    /// `CLOCK_MONOTONIC` since the worker resumed from READY, at the end of each phase:
    /// request read, identity applied, code compiled (Python; for shell, the script handed
    /// to the shell), job finished (output flushed, just before DONE). 0: not reached.
    pub const PHASE_READ_NS: usize = 272;
    pub const PHASE_IDENTITY_NS: usize = 280;
    pub const PHASE_COMPILED_NS: usize = 288;
    pub const PHASE_FINISHED_NS: usize = 296;
    /// What the guest had to do itself (`u32`, bits of [`super::guest_flags`]), valid at DONE.
    pub const GUEST_FLAGS: usize = 304;
    /// Bytes of display data (`u32`), valid at DONE of a Python request (0: none): the JSON
    /// object `{"value": [...], "figures": [...]}` at `job::DATA`, over the request, which is
    /// no longer needed by then; `value` is a cell's displayed final expression and
    /// `figures` the matplotlib figures shown or left open, each a list of
    /// `{"type": MIME, "data": TEXT}` objects (`image/png` base64-encoded). Hostile input:
    /// the host clamps the length to `job::DATA_END - job::DATA` and parses it strictly.
    pub const DISPLAY_LEN: usize = 308;
    /// The stdout area.
    pub const STDOUT_AREA: usize = 2 << 20;
    pub const STDOUT_AREA_END: usize = 3 << 20;
    /// The stderr area.
    pub const STDERR_AREA: usize = 3 << 20;
    pub const STDERR_AREA_END: usize = 4 << 20;
}

/// Bits of `result::GUEST_FLAGS`.
pub mod guest_flags {
    /// The guest found its wall clock off and set it itself (`clock_settime`): the host's
    /// write of the clock did not hold.
    pub const CLOCK_SET: u32 = 1;
}

/// How a job ended (`result::OUTCOME`).
pub mod outcome {
    /// Exited normally; `EXIT_CODE` is the exit status (for Python: `SystemExit` code, 1 on an
    /// uncaught exception).
    pub const EXITED: u32 = 1;
    /// Killed by a signal; `EXIT_CODE` is the signal number (shell jobs).
    pub const SIGNALED: u32 = 2;
    /// Python raised `MemoryError` that nobody caught (exit status 1, like `python3`).
    pub const OUT_OF_MEMORY: u32 = 3;
}

/// Failure codes carried in `rdi` of a [`code::FAILED`] doorbell.
pub mod failure {
    /// A mount the agent needs failed; `rsi` = errno.
    pub const MOUNT: u64 = 1;
    /// The worker could not be started; `rsi` = errno.
    pub const SPAWN: u64 = 2;
    /// The worker exited before READY; `rsi` = its wait status.
    pub const WORKER_EXITED: u64 = 3;
    /// `ioperm` for the doorbell failed (reported from a throwaway child, which may die trying).
    pub const IOPERM: u64 = 4;
}
