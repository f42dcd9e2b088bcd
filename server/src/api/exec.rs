//! The shapes of a job request and its answer, and the checks that turn a request into
//! a [`Job`] (limits, fields, bytes).
//!
//! Bytes: `code` and `stdin` come as UTF-8 text (`code`, `stdin`) or base64 (`code_b64`,
//! `stdin_b64`), one or the other. Output comes back as text (`stdout`, `stderr`; invalid
//! UTF-8 replaced by U+FFFD) plus the exact bytes in base64 (`stdout_b64`, `stderr_b64`) when
//! the text is not them, or always when the request sets `output_b64`.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use vmm::{Job, JobResult, Language, Status};

use crate::config::Limits;
use crate::service::error::Error;

/// `POST /v1/exec` and `/v1/exec/stream`, and each entry of a batch.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// `python` (default) or `shell`.
    #[serde(default)]
    pub language: Option<Language>,
    pub code: Option<String>,
    pub code_b64: Option<String>,
    pub stdin: Option<String>,
    pub stdin_b64: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub timeout_ms: Option<u64>,
    /// Cap on stdout + stderr bytes.
    pub output_limit: Option<u64>,
    /// Always return `stdout_b64` and `stderr_b64`.
    #[serde(default)]
    pub output_b64: bool,
    /// Files put in the job's working directory (/tmp) before it runs: relative path ->
    /// content in base64 (`POST /v1/exec` only).
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// Glob patterns (relative to /tmp, `**` allowed) of files to return after the job, in
    /// the answer's `files` (`POST /v1/exec` only).
    #[serde(default)]
    pub return_files: Vec<String>,
    /// The template to run in (`GET /v1/templates`; default: the server's default). Not for
    /// session cells: a session keeps the template it was created from.
    pub template: Option<String>,
    /// How a session cell runs (set by the code-interpreter compat layer, not by clients).
    #[serde(skip)]
    pub cell: vmm::CellOptions,
    /// Its output is streamed to the client (set by the streaming routes).
    #[serde(skip)]
    pub stream: bool,
}

/// The files of a job: what goes in, and the patterns of what comes back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobFiles {
    pub put: Vec<(String, Vec<u8>)>,
    pub return_globs: Vec<String>,
}

impl JobFiles {
    pub fn is_empty(&self) -> bool {
        self.put.is_empty() && self.return_globs.is_empty()
    }
}

/// A relative path (or pattern) inside the work directory: not empty, not absolute, no
/// `..` component, no NUL.
pub fn check_relative(field: &str, path: &str) -> Result<(), Error> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path.contains('\0')
        || path.split('/').any(|c| c == "..");
    if bad {
        return Err(Error::invalid(
            field,
            format!("{path:?} must be a relative path without '..'"),
        ));
    }
    Ok(())
}

/// `POST /v1/exec/batch`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    pub jobs: Vec<ExecRequest>,
}

/// Where a job's time went, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Timings {
    /// Waiting for a job thread.
    pub queue_ms: f64,
    /// Creating the clone (zero when it came ready from the pool).
    pub clone_ms: f64,
    /// From resuming the clone to the job's end.
    pub run_ms: f64,
    /// Clone + run + collecting the result (queueing not included).
    pub total_ms: f64,
    /// Exits from the guest to the VMM during the job.
    #[serde(default)]
    pub exits: u64,
    /// The guest's own account of `run_ms`, when the job ended normally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<GuestTimings>,
    /// KVM's counters over the job, where this host's KVM keeps them.
    #[serde(default)]
    pub kvm: KvmCounters,
}

/// KVM's own counters of the job's vCPU during the job (null where KVM has no such count).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct KvmCounters {
    /// Exits from the guest to KVM (most never reach bud).
    pub exits: Option<u64>,
    /// Guest instructions KVM emulated (under kvm_pvm: every guest-kernel instruction).
    pub emulated_instructions: Option<u64>,
    /// Page faults KVM took for the guest.
    pub page_faults: Option<u64>,
}

/// The guest worker's phases of a job, in milliseconds of its own clock.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct GuestTimings {
    /// Resume to request read.
    pub read_ms: f64,
    /// Seeding `random` and checking the clock.
    pub identity_ms: f64,
    /// Compiling the code (Python), or handing the script to the shell.
    pub compile_ms: f64,
    /// Running the job and flushing its output.
    pub run_ms: f64,
    /// The guest had to set its wall clock itself (the host's setting did not hold).
    #[serde(default)]
    pub clock_set: bool,
}

/// The result of a job that ran (whatever its status).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExecResponse {
    pub status: Status,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_b64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_b64: Option<String>,
    /// For `crashed`: what went wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crash: Option<String>,
    /// For `crashed`: the last lines of the guest console.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub console_tail: Vec<String>,
    /// The files `return_files` matched (path -> content in base64), when it was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<BTreeMap<String, String>>,
    /// Rich results: every matplotlib figure the job showed (`plt.show()`) or left open,
    /// in order, as `image/png`.
    #[serde(default)]
    pub results: Vec<RichResult>,
    pub timings: Timings,
}

/// One rich result of a job or cell.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RichResult {
    /// MIME type: `image/png`.
    #[serde(rename = "type")]
    pub mime: String,
    pub data_b64: String,
}

/// `POST /v1/exec/batch`: one result per job, in request order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchResponse {
    pub results: Vec<ExecResponse>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `bytes` in base64.
pub fn b64(bytes: &[u8]) -> String {
    BASE64.encode(bytes)
}

/// Text for `bytes`, and their base64 when the text does not hold them exactly (or `always`).
pub fn text_and_b64(bytes: &[u8], always: bool) -> (String, Option<String>) {
    match std::str::from_utf8(bytes) {
        Ok(s) => (s.to_string(), always.then(|| BASE64.encode(bytes))),
        Err(_) => (
            String::from_utf8_lossy(bytes).into_owned(),
            Some(BASE64.encode(bytes)),
        ),
    }
}

impl ExecResponse {
    pub fn new(r: JobResult, queued: Duration, output_b64: bool) -> Self {
        let (stdout, stdout_b64) = text_and_b64(&r.stdout, output_b64);
        let (stderr, stderr_b64) = text_and_b64(&r.stderr, output_b64);
        Self {
            status: r.status,
            exit_code: r.exit_code,
            signal: r.signal,
            stdout,
            stderr,
            stdout_b64,
            stderr_b64,
            crash: r.crash,
            console_tail: r.console_tail,
            files: None,
            results: r
                .figures
                .into_iter()
                .map(|f| RichResult {
                    mime: f.mime,
                    data_b64: f.data,
                })
                .collect(),
            timings: Timings {
                queue_ms: ms(queued),
                clone_ms: ms(r.timings.clone),
                run_ms: ms(r.timings.run),
                total_ms: ms(r.timings.total),
                exits: r.timings.exits,
                guest: r.timings.guest.map(|g| GuestTimings {
                    read_ms: ms(g.read),
                    identity_ms: ms(g.identity),
                    compile_ms: ms(g.compile),
                    run_ms: ms(g.run),
                    clock_set: g.clock_set,
                }),
                kvm: KvmCounters {
                    exits: r.timings.kvm.exits,
                    emulated_instructions: r.timings.kvm.emulated_instructions,
                    page_faults: r.timings.kvm.page_faults,
                },
            },
        }
    }
}

/// One of `text` / `b64` as bytes: exactly one for required fields, at most one otherwise.
fn bytes_field(
    prefix: &str,
    name: &str,
    text: Option<String>,
    b64: Option<String>,
    required: bool,
) -> Result<Vec<u8>, Error> {
    match (text, b64) {
        (Some(_), Some(_)) => Err(Error::invalid(
            format!("{prefix}{name}"),
            format!("give {name} or {name}_b64, not both"),
        )),
        (Some(t), None) => Ok(t.into_bytes()),
        (None, Some(b)) => BASE64.decode(b.as_bytes()).map_err(|e| {
            Error::invalid(
                format!("{prefix}{name}_b64"),
                format!("{name}_b64 is not valid base64: {e}"),
            )
        }),
        (None, None) if required => Err(Error::invalid(
            format!("{prefix}{name}"),
            format!("{name} (or {name}_b64) is required"),
        )),
        (None, None) => Ok(Vec::new()),
    }
}

pub(crate) fn check_size(
    prefix: &str,
    name: &str,
    bytes: usize,
    limit: usize,
) -> Result<(), Error> {
    if bytes > limit {
        return Err(Error::TooLarge {
            field: format!("{prefix}{name}"),
            bytes,
            limit,
        });
    }
    Ok(())
}

/// A request's `timeout_ms` (the server's default if none), checked against `limits`.
pub(crate) fn check_timeout(
    prefix: &str,
    timeout_ms: Option<u64>,
    limits: &Limits,
) -> Result<u64, Error> {
    let timeout_ms = timeout_ms.unwrap_or(limits.default_timeout_ms);
    if !(1..=limits.max_timeout_ms).contains(&timeout_ms) {
        return Err(Error::invalid(
            format!("{prefix}timeout_ms"),
            format!(
                "timeout_ms must be 1..={} (got {timeout_ms})",
                limits.max_timeout_ms
            ),
        ));
    }
    Ok(timeout_ms)
}

impl ExecRequest {
    /// Takes the request's files out (checked: paths, base64, total size against the body
    /// limit). Routes that do not take files leave them in, and [`ExecRequest::into_job`]
    /// refuses them.
    pub fn take_files(&mut self, limits: &Limits) -> Result<JobFiles, Error> {
        let files = std::mem::take(&mut self.files);
        let globs = std::mem::take(&mut self.return_files);
        let mut put = Vec::with_capacity(files.len());
        let mut total = 0;
        for (name, b64) in files {
            let field = format!("files[{name:?}]");
            check_relative(&field, &name)?;
            let bytes = BASE64
                .decode(b64.as_bytes())
                .map_err(|e| Error::invalid(&field, format!("not valid base64: {e}")))?;
            total += bytes.len();
            put.push((name, bytes));
        }
        check_size("", "files", total, limits.max_body_bytes)?;
        for (i, g) in globs.iter().enumerate() {
            check_relative(&format!("return_files[{i}]"), g)?;
        }
        Ok(JobFiles {
            put,
            return_globs: globs,
        })
    }

    /// Checks the request against `limits` and builds the job; `prefix` names this request in
    /// error fields (`""`, or `"jobs[3]."` in a batch).
    pub fn into_job(self, limits: &Limits, prefix: &str) -> Result<Job, Error> {
        if !(self.files.is_empty() && self.return_files.is_empty()) {
            return Err(Error::invalid(
                format!("{prefix}files"),
                "files and return_files are taken by POST /v1/exec only",
            ));
        }
        let code = bytes_field(prefix, "code", self.code, self.code_b64, true)?;
        check_size(prefix, "code", code.len(), limits.max_code_bytes)?;
        let stdin = bytes_field(prefix, "stdin", self.stdin, self.stdin_b64, false)?;
        check_size(prefix, "stdin", stdin.len(), limits.max_stdin_bytes)?;

        let timeout_ms = check_timeout(prefix, self.timeout_ms, limits)?;
        let output_limit = self.output_limit.unwrap_or(limits.max_output_bytes as u64);
        if !(1..=limits.max_output_bytes as u64).contains(&output_limit) {
            return Err(Error::invalid(
                format!("{prefix}output_limit"),
                format!(
                    "output_limit must be 1..={} (got {output_limit})",
                    limits.max_output_bytes
                ),
            ));
        }

        if let Some(i) = self.args.iter().position(|a| a.contains('\0')) {
            return Err(Error::invalid(
                format!("{prefix}args[{i}]"),
                "arguments must not contain NUL bytes",
            ));
        }
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(Error::invalid(
                    format!("{prefix}env"),
                    format!(
                        "variable {k:?}: names must be non-empty without '=' or NUL, values without NUL"
                    ),
                ));
            }
        }
        let args_bytes: usize = self.args.iter().map(|a| a.len() + 1).sum();
        let env_bytes: usize = self.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        let field = if args_bytes >= env_bytes {
            "args"
        } else {
            "env"
        };
        check_size(
            prefix,
            field,
            args_bytes + env_bytes,
            limits.max_args_env_bytes,
        )?;

        let mut job = Job::new(self.language.unwrap_or(Language::Python), code);
        job.stdin = stdin;
        job.args = self.args;
        job.env = self.env.into_iter().collect();
        job.timeout = Duration::from_millis(timeout_ms);
        job.output_limit = output_limit as usize;
        job.cell = self.cell;
        job.stream_output = self.stream;
        Ok(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(code: &str) -> ExecRequest {
        ExecRequest {
            code: Some(code.into()),
            ..ExecRequest::default()
        }
    }

    #[test]
    fn defaults_make_a_python_job_with_default_limits() {
        let job = req("print(1)").into_job(&Limits::default(), "").unwrap();

        assert_eq!(job.language, Language::Python);
        assert_eq!(job.timeout, vmm::job::DEFAULT_TIMEOUT);
        assert_eq!(job.output_limit, Limits::default().max_output_bytes);
    }

    #[test]
    fn base64_stdin_is_decoded_byte_exact() {
        let mut r = req("x");
        r.stdin_b64 = Some(BASE64.encode([0u8, 0xff, 0x80]));

        let job = r.into_job(&Limits::default(), "").unwrap();

        assert_eq!(job.stdin, vec![0, 0xff, 0x80]);
    }

    #[test]
    fn missing_code_names_the_field() {
        let e = ExecRequest::default()
            .into_job(&Limits::default(), "jobs[2].")
            .unwrap_err();

        assert_eq!(e.field(), Some("jobs[2].code"));
        assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
    }

    #[test]
    fn oversized_stdin_is_413_naming_stdin() {
        let mut r = req("x");
        r.stdin = Some("a".repeat(11));
        let limits = Limits {
            max_stdin_bytes: 10,
            ..Limits::default()
        };

        let e = r.into_job(&limits, "").unwrap_err();

        assert!(matches!(e, Error::TooLarge { .. }), "{e:?}");
        assert_eq!(e.field(), Some("stdin"));
    }

    #[test]
    fn timeout_out_of_range_is_400_naming_timeout_ms() {
        let mut zero = req("x");
        zero.timeout_ms = Some(0);
        let mut huge = req("x");
        huge.timeout_ms = Some(10_000_000);

        let zero = zero.into_job(&Limits::default(), "").unwrap_err();
        let huge = huge.into_job(&Limits::default(), "").unwrap_err();

        assert_eq!(zero.field(), Some("timeout_ms"));
        assert_eq!(huge.field(), Some("timeout_ms"));
    }

    #[test]
    fn bad_env_and_args_are_refused() {
        let mut env = req("x");
        env.env.insert("A=B".into(), "v".into());
        let mut args = req("x");
        args.args = vec!["ok".into(), "nul\0".into()];
        let mut both = req("x");
        both.code_b64 = Some("eA==".into());

        let env = env.into_job(&Limits::default(), "").unwrap_err();
        let args = args.into_job(&Limits::default(), "").unwrap_err();
        let both = both.into_job(&Limits::default(), "").unwrap_err();

        assert_eq!(env.field(), Some("env"));
        assert_eq!(args.field(), Some("args[1]"));
        assert_eq!(both.field(), Some("code"));
    }

    #[test]
    fn output_that_is_not_utf8_also_comes_as_base64() {
        let (text, b64) = text_and_b64(&[b'a', 0xff], false);
        let (plain, none) = text_and_b64(b"hi", false);
        let (_, forced) = text_and_b64(b"hi", true);

        assert_eq!(text, "a\u{fffd}");
        assert_eq!(b64.as_deref(), Some("Yf8="));
        assert_eq!((plain.as_str(), none), ("hi", None));
        assert_eq!(forced.as_deref(), Some("aGk="));
    }
}
