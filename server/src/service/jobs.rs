//! One-shot jobs and batches: the one submit path of a job, whoever asks (`POST /v1/exec`,
//! its stream, a batch, Piston). A job is admitted, runs on a job thread in a fresh (or
//! reset) clone of its template, is cancelled when the caller goes away, and is recorded
//! once (metrics, log, audit) on the job thread, so it counts even if the caller left.
//! Streaming is a sink: the output chunks go to it as the job writes them.
//!
//! What a job request says ([`ExecRequest`]: the body of `POST /v1/exec` and of each
//! batch entry, also built by the dialects) and the checks that turn it into a [`Job`]
//! (limits, fields, bytes: `code` and `stdin` as UTF-8 text or base64, one or the other)
//! are the service's own: the edge deserializes into them, the service checks them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use vmm::Language;

use vmm::{ExecError, Job, JobResult};

use crate::core::engine::Engine;

use crate::core::audit::Origin;
use crate::core::config::Limits;
use crate::core::egress::Gate;
use crate::core::jobs::{CancelOnDrop, Slot};
use crate::core::state::AppState;
use crate::service::admission::{self, Pending, Reply};
use crate::service::error::Error;
use crate::service::files::{JobFiles, check_relative};
use crate::service::record::finished;
use crate::service::task::Sink;
use crate::service::{files, network, templates};

/// A one-shot job as the service takes it: checked (see [`ExecRequest`]).
#[derive(Debug)]
pub struct OneShot {
    pub job: Job,
    /// The template to run in (None: the default).
    pub template: Option<String>,
    /// The runtime of the template it names (None: the template's default); the job's
    /// language is set from it once the template is known ([`templates::runtime`]).
    pub runtime: Option<String>,
    /// Files put before it runs and patterns of those returned after.
    pub files: JobFiles,
    /// The route that asked, for the audit trail.
    pub route: String,
    /// What its network may reach (a template with a card only; default: the server's).
    pub network: Option<crate::core::egress::PolicySpec>,
    /// Keep a trace of it (`trace: true`).
    pub trace: bool,
}

/// A job that ran (whatever its status).
#[derive(Debug)]
pub struct Ran {
    pub result: JobResult,
    /// How long it waited for a job thread.
    pub waited: Duration,
    /// The files its `return_files` patterns matched (path -> bytes), when it had any.
    pub files: files::Returned,
    /// Its network's gate (what it resolved and connected to), on a template with a card.
    pub network: Option<Arc<Gate>>,
    /// The id of its trace, when it asked for one.
    pub trace: Option<String>,
}

/// Sends `one` to a job thread in `slot`; `field` names it in errors (a batch's job).
fn submit(
    state: &AppState,
    (engine, gate): (Arc<dyn Engine>, Option<Arc<Gate>>),
    slot: Slot,
    one: OneShot,
    mut sink: Sink,
    field: Option<String>,
) -> Result<Pending<Ran>, Error> {
    let OneShot {
        mut job,
        template,
        files,
        route,
        trace,
        ..
    } = one;
    let origin = Origin::here(&route, state.template_name(template.as_deref()), None);
    let trace = if trace {
        Some(start_trace(state, &origin, &job)?)
    } else {
        None
    };
    job.egress = gate
        .clone()
        .map(|g| vmm::JobEgress(g as Arc<dyn vmm::Egress>));
    // Held by the caller's future: a caller that goes away drops it, which cancels the job.
    let cancel = CancelOnDrop::for_job(state.jobs(), &mut job);
    let st = state.clone();
    let rx = admission::spawn(state, slot, move |reply: Reply<Result<Ran, Error>>| {
        if reply.caller_gone() {
            if let Some(id) = &trace {
                end_trace(
                    &st,
                    id,
                    &origin,
                    &job,
                    Err(&"its client left first"),
                    Duration::ZERO,
                );
            }
            return; // never started: nobody waits for it
        }
        let waited = reply.waited();
        if files.is_empty() {
            // The result goes out before the VM is reset for its next job.
            engine.run_then(
                &job,
                &mut *sink,
                Box::new(|result| {
                    let shown = result.as_ref().map_err(|e| e as &dyn std::fmt::Display);
                    finished(&st, &origin, "job", &job, shown, waited);
                    if let Some(id) = &trace {
                        end_trace(&st, id, &origin, &job, shown, waited);
                    }
                    reply.send(ran(result, waited, field, gate).map(|r| Ran { trace, ..r }));
                }),
            );
            return;
        }
        // Not behind the engine's seam yet: a job with files runs in a VMM session.
        let result = match engine.executor() {
            Some(exec) => files::run_with_files(exec, &job, &files, &mut *sink),
            None => Err(Error::internal("this template's engine has no VMM")),
        };
        let shown = result
            .as_ref()
            .map(|(r, _)| r)
            .map_err(|e| e as &dyn std::fmt::Display);
        finished(&st, &origin, "job", &job, shown, waited);
        if let Some(id) = &trace {
            end_trace(&st, id, &origin, &job, shown, waited);
        }
        reply.send(result.map(|(result, files)| Ran {
            result,
            waited,
            files,
            network: gate,
            trace,
        }));
    })?;
    Ok(Pending::new(rx, cancel))
}

/// Opens the trace of a one-shot job that asked for one: a new `job_` id on this node and
/// its `created` event. Refused when the server keeps no traces, or (with
/// `--trace-over-quota refuse`) they are at their quota.
fn start_trace(state: &AppState, origin: &Origin, job: &Job) -> Result<String, Error> {
    let Some(t) = state.traces() else {
        return Err(Error::invalid(
            "trace",
            "this server keeps no traces (it has no state directory, or runs with --no-trace)",
        ));
    };
    crate::service::trace::check_traces(state)?;
    let id = state.sessions().new_id("job").map_err(Error::internal)?;
    t.record(&id, "created", |_| {
        serde_json::json!({"one_shot": true, "template": origin.template,
                           "language": job.language, "route": origin.route, "key": origin.key})
    });
    Ok(id)
}

/// Closes one-shot job `id`'s trace: its `cell` (what ran and how it ended), then `ended`
/// and the seal; a job that could not run ends it `failed` with why.
fn end_trace(
    state: &AppState,
    id: &str,
    origin: &Origin,
    job: &Job,
    result: Result<&JobResult, &dyn std::fmt::Display>,
    waited: Duration,
) {
    let Some(t) = state.traces() else { return };
    match result {
        Ok(r) => {
            t.record(id, "cell", |budget| {
                crate::core::trace::event::cell(origin, job, r, waited, budget)
            });
            t.end(id, "finished", None);
        }
        Err(e) => t.end(id, "failed", Some(&e.to_string())),
    }
}

fn ran(
    result: Result<JobResult, ExecError>,
    waited: Duration,
    field: Option<String>,
    network: Option<Arc<Gate>>,
) -> Result<Ran, Error> {
    match result {
        Ok(result) => Ok(Ran {
            result,
            waited,
            files: None,
            network,
            trace: None,
        }),
        Err(e) => Err(Error::exec(e, field)),
    }
}

/// Runs `one`: its template ready, admitted, on a job thread; its output also goes to
/// `sink` as it comes. Dropping the future cancels the job.
pub async fn run(state: &AppState, mut one: OneShot, sink: Sink) -> Result<Ran, Error> {
    admission::check_open(state)?;
    let engine = templates::engine_for(state, one.template.as_deref())?;
    one.job.set_runtime(templates::runtime(
        engine.as_ref(),
        one.runtime.as_deref(),
        "language",
    )?);
    let gate = gate_of(state, engine.as_ref(), &one, "network")?;
    let slot = admission::admit(state, 1)?.remove(0);
    submit(state, (engine, gate), slot, one, sink, None)?
        .finish()
        .await
}

/// The gate of one-shot job `one` on `engine` (see [`network::gate_for`]).
fn gate_of(
    state: &AppState,
    engine: &dyn Engine,
    one: &OneShot,
    field: &str,
) -> Result<Option<Arc<Gate>>, Error> {
    let template = state.template_name(one.template.as_deref());
    let gate = network::gate_for(state, engine, template, one.network.as_ref(), field)?;
    if let Some(g) = &gate {
        g.set_origin(crate::core::audit::Origin::here(&one.route, template, None));
    }
    Ok(gate)
}

/// Runs a batch: every job admitted at once or none, all on the job threads in parallel,
/// results in order; their output shares `max_batch_output_bytes`. One job bud could not
/// run fails the whole batch (named `jobs[i]`).
pub async fn batch(state: &AppState, jobs: Vec<OneShot>) -> Result<Vec<Ran>, Error> {
    admission::check_open(state)?;
    let limits = &state.config().limits;
    let n = jobs.len();
    if n == 0 {
        return Err(Error::invalid("jobs", "jobs must hold at least one job"));
    }
    if n > limits.max_batch_jobs {
        return Err(Error::TooMany {
            field: "jobs".into(),
            count: n,
            limit: limits.max_batch_jobs,
        });
    }
    let share = (limits.max_batch_output_bytes / n).max(1);
    let mut ready = Vec::with_capacity(n);
    for (i, mut one) in jobs.into_iter().enumerate() {
        let engine = templates::engine_for(state, one.template.as_deref())
            .map_err(|e| e.in_field(&format!("jobs[{i}].template")))?;
        one.job.set_runtime(templates::runtime(
            engine.as_ref(),
            one.runtime.as_deref(),
            &format!("jobs[{i}].language"),
        )?);
        one.job.output_limit = one.job.output_limit.min(share);
        let gate = gate_of(state, engine.as_ref(), &one, &format!("jobs[{i}].network"))?;
        ready.push(((engine, gate), one));
    }
    let slots = admission::admit(state, n)?;
    let mut pending = Vec::with_capacity(n);
    for (i, (slot, (engine, one))) in slots.into_iter().zip(ready).enumerate() {
        let field = Some(format!("jobs[{i}]"));
        pending.push(submit(
            state,
            engine,
            slot,
            one,
            crate::service::task::no_sink(),
            field,
        )?);
    }
    let mut results = Vec::with_capacity(n);
    for p in pending {
        results.push(p.finish().await?);
    }
    Ok(results)
}

/// `POST /v1/exec` and `/v1/exec/stream`, and each entry of a batch.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// A runtime of the template by name or alias (its manifest's: `python`, `shell`,
    /// `javascript` or `js` on `node`, ...); default: the template's first (a session
    /// cell's: its session's `language`).
    #[serde(default)]
    pub language: Option<String>,
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
    /// What the job's network may reach (a template with a card only; default: the
    /// server's `--egress-default`). Not for session cells: a session's is set when it is
    /// created, or replaced with `PUT /v1/sessions/{id}/network`.
    pub network: Option<crate::core::egress::PolicySpec>,
    /// Keep a trace of this one-shot job, as a session's (needs a server that keeps
    /// traces); its id comes back as `trace_id`. Not for session cells: those are always
    /// traced.
    #[serde(default)]
    pub trace: bool,
    /// How a session cell runs (set by the code-interpreter compat layer, not by clients).
    #[serde(skip)]
    pub cell: vmm::CellOptions,
    /// The worker mode a session cell runs in whatever `language` says (set by a dialect
    /// whose cells are a kernel's, not by clients).
    #[serde(skip)]
    pub mode: Option<Language>,
    /// Its output is streamed to the client (set by the streaming routes).
    #[serde(skip)]
    pub stream: bool,
}

/// `POST /v1/exec/batch`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    pub jobs: Vec<ExecRequest>,
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
    /// error fields (`""`, or `"jobs[3]."` in a batch). Its language is the worker's Python
    /// mode until the caller sets it from the template's runtime (`language` is the
    /// template's to check: [`templates::runtime`]).
    pub fn into_job(self, limits: &Limits, prefix: &str) -> Result<Job, Error> {
        if self.trace {
            return Err(Error::invalid(
                format!("{prefix}trace"),
                "trace is for one-shot jobs: a session's cells are always traced",
            ));
        }
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

        let mut job = Job::new(self.mode.unwrap_or(Language::Python), code);
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
}
