//! The limits on one request ([`Limits`]) and on sessions ([`SessionLimits`]), each a
//! group of `bud serve`'s options with its defaults.

use std::time::Duration;

/// Limits on one request. Every limit is checked before a job is admitted, and a request over
/// one is answered 400 or 413 with the offending field named.
/// `bud serve` takes every field as an option of the same name (`--max-code-bytes`...),
/// with [`Limits::default`]'s value as its default.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct Limits {
    /// Bytes of code (after base64 decoding).
    #[arg(long, default_value_t = Limits::default().max_code_bytes)]
    pub max_code_bytes: usize,
    /// Bytes of stdin (after base64 decoding).
    #[arg(long, default_value_t = Limits::default().max_stdin_bytes)]
    pub max_stdin_bytes: usize,
    /// Bytes of args + env as the guest gets them (each entry NUL-terminated, `K=V` for env).
    #[arg(long, default_value_t = Limits::default().max_args_env_bytes)]
    pub max_args_env_bytes: usize,
    /// Timeout used when a request gives none.
    #[arg(long, default_value_t = Limits::default().default_timeout_ms)]
    pub default_timeout_ms: u64,
    /// Largest `timeout_ms` a request may ask for (the smallest is 1).
    #[arg(long, default_value_t = Limits::default().max_timeout_ms)]
    pub max_timeout_ms: u64,
    /// Largest `output_limit` (stdout + stderr bytes kept) a request may ask for; also the
    /// default.
    #[arg(long, default_value_t = Limits::default().max_output_bytes)]
    pub max_output_bytes: usize,
    /// Jobs in one `POST /v1/exec/batch`.
    #[arg(long, default_value_t = Limits::default().max_batch_jobs)]
    pub max_batch_jobs: usize,
    /// Bytes of stdout + stderr the jobs of one batch keep together: each keeps at most its
    /// share (this divided by the batch's jobs) or its own `output_limit`, whichever is
    /// smaller, and past it ends `output_limit`. Bounds a batch's response and the memory
    /// the server holds for it (16 jobs each at the per-job cap made an 805 MB response).
    #[arg(long, default_value_t = Limits::default().max_batch_output_bytes)]
    pub max_batch_output_bytes: usize,
    /// Bytes of one request body.
    #[arg(long, default_value_t = Limits::default().max_body_bytes)]
    pub max_body_bytes: usize,
    /// Time a request body may take to arrive, milliseconds (then 408).
    #[arg(long, default_value_t = Limits::default().body_timeout_ms)]
    pub body_timeout_ms: u64,
    /// Time a request's head (request line and headers) may take to arrive, milliseconds
    /// (then 408; a connection idle that long between requests is closed).
    #[arg(long, default_value_t = Limits::default().header_timeout_ms)]
    pub header_timeout_ms: u64,
}

impl Limits {
    pub fn body_timeout(&self) -> Duration {
        Duration::from_millis(self.body_timeout_ms)
    }

    pub fn header_timeout(&self) -> Duration {
        Duration::from_millis(self.header_timeout_ms)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_code_bytes: 512 << 10,
            max_stdin_bytes: 1 << 20,
            max_args_env_bytes: 64 << 10,
            default_timeout_ms: vmm::job::DEFAULT_TIMEOUT.as_millis() as u64,
            max_timeout_ms: 60_000,
            max_output_bytes: vmm::job::DEFAULT_OUTPUT_LIMIT,
            max_batch_jobs: 16,
            max_batch_output_bytes: vmm::job::DEFAULT_OUTPUT_LIMIT,
            max_body_bytes: 16 << 20,
            body_timeout_ms: 30_000,
            header_timeout_ms: 10_000,
        }
    }
}

/// Limits of sessions (`/v1/sessions`). `bud serve` takes each field but the fork count as
/// an option (named in its `long`; the memory in MiB), with [`SessionLimits::default`]'s
/// value as its default.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct SessionLimits {
    /// Most live sessions; past it, creating or forking one is 429.
    #[arg(long, default_value_t = SessionLimits::default().max_sessions)]
    pub max_sessions: usize,
    /// Host memory all sessions may hold (private pages + fork layers), in MiB; past it,
    /// creating or forking one is 507.
    #[arg(
        long = "sessions-memory-mib",
        value_name = "SESSIONS_MEMORY_MIB",
        value_parser = mib_to_bytes,
        default_value_t = SessionLimits::default().max_memory_bytes >> 20
    )]
    pub max_memory_bytes: u64,
    /// Idle timeout of a session that asks for none, in seconds.
    #[arg(
        long = "session-idle-timeout-s",
        value_name = "SESSION_IDLE_TIMEOUT_S",
        default_value_t = SessionLimits::default().default_idle_timeout_s
    )]
    pub default_idle_timeout_s: u64,
    /// Largest idle timeout a session may ask for, in seconds.
    #[arg(
        long = "max-session-idle-timeout-s",
        value_name = "MAX_SESSION_IDLE_TIMEOUT_S",
        default_value_t = SessionLimits::default().max_idle_timeout_s
    )]
    pub max_idle_timeout_s: u64,
    /// Lifetime of a session that asks for none, in seconds.
    #[arg(
        long = "session-lifetime-s",
        value_name = "SESSION_LIFETIME_S",
        default_value_t = SessionLimits::default().default_lifetime_s
    )]
    pub default_lifetime_s: u64,
    /// Largest lifetime a session may ask for, in seconds.
    #[arg(
        long = "max-session-lifetime-s",
        value_name = "MAX_SESSION_LIFETIME_S",
        default_value_t = SessionLimits::default().max_lifetime_s
    )]
    pub max_lifetime_s: u64,
    /// Largest file uploaded into a session, in bytes.
    #[arg(long, default_value_t = SessionLimits::default().max_file_bytes)]
    pub max_file_bytes: usize,
    /// Requests that may wait for a busy session at once (a request finding it busy waits
    /// for its turn); past it, 409. 0: never wait.
    #[arg(long = "session-max-waiting", default_value_t = SessionLimits::default().max_waiting)]
    pub max_waiting: usize,
    /// Background processes one session may have running at once; past it, 429.
    #[arg(long = "session-max-processes", default_value_t = SessionLimits::default().max_processes)]
    pub max_processes: usize,
    /// Park sessions idle this long, in seconds: pause them to the state directory and
    /// resume them at their next request, transparently (they are shown running, their
    /// idle timeout and lifetime go on). 0: never (docs/sessions.md, "Many sessions").
    #[arg(long = "park-idle-s", default_value_t = SessionLimits::default().park_idle_s)]
    pub park_idle_s: u64,
    /// Children of one fork request (not an option of `bud serve`).
    #[arg(skip = MAX_FORK_COUNT)]
    pub max_fork_count: usize,
}

/// [`SessionLimits::max_fork_count`]'s value.
const MAX_FORK_COUNT: usize = 16;

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            max_sessions: 64,
            max_memory_bytes: 4 << 30,
            max_waiting: 8,
            max_processes: 32,
            default_idle_timeout_s: 600,
            max_idle_timeout_s: 3600,
            default_lifetime_s: 3600,
            max_lifetime_s: 24 * 3600,
            max_file_bytes: 16 << 20,
            max_fork_count: MAX_FORK_COUNT,
            park_idle_s: 0,
        }
    }
}

/// A size given in MiB (`--sessions-memory-mib`, `--memory-budget-mib`), in bytes.
pub(super) fn mib_to_bytes(mib: &str) -> Result<u64, String> {
    let mib: u64 = mib
        .parse()
        .map_err(|e: std::num::ParseIntError| e.to_string())?;
    mib.checked_mul(1 << 20)
        .ok_or_else(|| format!("{mib} MiB is more than {} bytes", u64::MAX))
}
