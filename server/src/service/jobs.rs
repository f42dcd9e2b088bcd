//! One-shot jobs and batches: the one submit path of a job, whoever asks (`POST /v1/exec`,
//! its stream, a batch, Piston). A job is admitted, runs on a job thread in a fresh (or
//! reset) clone of its template, is cancelled when the caller goes away, and is recorded
//! once (metrics, log, audit) on the job thread, so it counts even if the caller left.
//! Streaming is a sink: the output chunks go to it as the job writes them.

use std::sync::Arc;
use std::time::Duration;

use vmm::{ExecError, Executor, Job, JobResult};

use crate::api::JobFiles;
use crate::audit::Origin;
use crate::jobs::{CancelOnDrop, Slot};
use crate::service::admission::{self, Pending, Reply};
use crate::service::error::Error;
use crate::service::record::finished;
use crate::service::task::Sink;
use crate::service::{files, templates};
use crate::state::AppState;

/// A one-shot job as the service takes it: checked (see [`crate::api::ExecRequest`]).
#[derive(Debug)]
pub struct OneShot {
    pub job: Job,
    /// The template to run in (None: the default).
    pub template: Option<String>,
    /// Files put before it runs and patterns of those returned after.
    pub files: JobFiles,
    /// The route that asked, for the audit trail.
    pub route: String,
}

/// A job that ran (whatever its status).
#[derive(Debug)]
pub struct Ran {
    pub result: JobResult,
    /// How long it waited for a job thread.
    pub waited: Duration,
    /// The files its `return_files` patterns matched (path -> bytes), when it had any.
    pub files: files::Returned,
}

/// Sends `one` to a job thread in `slot`; `field` names it in errors (a batch's job).
fn submit(
    state: &AppState,
    exec: Arc<Executor>,
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
    } = one;
    let origin = Origin::here(&route, state.template_name(template.as_deref()), None);
    // Held by the caller's future: a caller that goes away drops it, which cancels the job.
    let cancel = CancelOnDrop::for_job(state.jobs(), &mut job);
    let st = state.clone();
    let rx = admission::spawn(state, slot, move |reply: Reply<Result<Ran, Error>>| {
        if reply.caller_gone() {
            return; // never started: nobody waits for it
        }
        let waited = reply.waited();
        if files.is_empty() {
            // The result goes out before the VM is reset for its next job.
            exec.run_then(&job, &mut *sink, |result| {
                let shown = result.as_ref().map_err(|e| e as &dyn std::fmt::Display);
                finished(&st, &origin, "job", &job, shown, waited);
                reply.send(ran(result, waited, field));
            });
            return;
        }
        let result = files::run_with_files(&exec, &job, &files, &mut *sink);
        let shown = result
            .as_ref()
            .map(|(r, _)| r)
            .map_err(|e| e as &dyn std::fmt::Display);
        finished(&st, &origin, "job", &job, shown, waited);
        reply.send(result.map(|(result, files)| Ran {
            result,
            waited,
            files,
        }));
    })?;
    Ok(Pending::new(rx, cancel))
}

fn ran(
    result: Result<JobResult, ExecError>,
    waited: Duration,
    field: Option<String>,
) -> Result<Ran, Error> {
    match result {
        Ok(result) => Ok(Ran {
            result,
            waited,
            files: None,
        }),
        Err(e) => Err(Error::exec(e, field)),
    }
}

/// Runs `one`: its template ready, admitted, on a job thread; its output also goes to
/// `sink` as it comes. Dropping the future cancels the job.
pub async fn run(state: &AppState, one: OneShot, sink: Sink) -> Result<Ran, Error> {
    admission::check_open(state)?;
    let exec = templates::executor_for(state, one.template.as_deref())?;
    let slot = admission::admit(state, 1)?.remove(0);
    submit(state, exec, slot, one, sink, None)?.finish().await
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
        let exec = templates::executor_for(state, one.template.as_deref())
            .map_err(|e| e.in_field(&format!("jobs[{i}].template")))?;
        one.job.output_limit = one.job.output_limit.min(share);
        ready.push((exec, one));
    }
    let slots = admission::admit(state, n)?;
    let mut pending = Vec::with_capacity(n);
    for (i, (slot, (exec, one))) in slots.into_iter().zip(ready).enumerate() {
        let field = Some(format!("jobs[{i}]"));
        pending.push(submit(
            state,
            exec,
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
