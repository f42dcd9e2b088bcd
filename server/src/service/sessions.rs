//! Sessions: start one, run a cell in it, fork it, end it, and expire them. Each operation
//! that touches a session's VM takes the session (busy meanwhile: one request at a time;
//! the next ones wait for it, [`acquire`])
//! and an admission slot, and runs on a job thread like a job; a VM that a request left
//! unusable ends its session with why ([`end_if_unusable`]).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use vmm::JobResult;
use vmm::session::{DEFAULT_INTERRUPT_GRACE, ForkStats, SessionError};

use crate::core::audit::Origin;
use crate::core::jobs::CancelOnDrop;
use crate::core::sessions::{Ended, Entry, NewSession, Unavailable};
use crate::core::state::AppState;
pub use crate::service::access::{acquire, end_if_unusable, get, unavailable};
use crate::service::admission::{self, Pending, Reply, check_count, check_memory};
use crate::service::error::Error;
use crate::service::jobs::ExecRequest;
use crate::service::record::finished;
use crate::service::task::Sink;
use crate::service::templates;

fn seconds(field: &str, asked: Option<u64>, default: u64, max: u64) -> Result<Duration, Error> {
    let s = asked.unwrap_or(default);
    if !(1..=max).contains(&s) {
        return Err(Error::invalid(
            field,
            format!("{field} must be 1..={max} (got {s})"),
        ));
    }
    Ok(Duration::from_secs(s))
}

/// Checks `req` (one without a snapshot: [`crate::service::lifecycle::start`] takes
/// both) against the limits and caps, starts its session from its template on a job
/// thread and registers it.
pub async fn start_fresh(state: &AppState, req: CreateSession) -> Result<Arc<Entry>, Error> {
    admission::check_open(state)?;
    if req.auto_pause == Some(true) && state.state_dir().is_none() {
        return Err(Error::NoStateDir);
    }
    crate::service::trace::check_traces(state)?;
    let lim = &state.config().sessions;
    let idle = seconds(
        "idle_timeout_s",
        req.idle_timeout_s,
        lim.default_idle_timeout_s,
        lim.max_idle_timeout_s,
    )?;
    let life = seconds(
        "max_lifetime_s",
        req.max_lifetime_s,
        lim.default_lifetime_s,
        lim.max_lifetime_s,
    )?;
    if serde_json::to_vec(&req.metadata).map_or(0, |v| v.len()) > 4096 {
        return Err(Error::invalid(
            "metadata",
            "metadata must be at most 4096 bytes of JSON",
        ));
    }
    let probe = ExecRequest {
        code: Some(String::new()),
        env: req.env.clone(),
        ..ExecRequest::default()
    };
    probe.into_job(&state.config().limits, "")?;
    let engine = templates::engine_for(state, req.template.as_deref())?;
    let (language, dialect) =
        templates::runtime(engine.as_ref(), req.language.as_deref(), "language")?.runs();
    let template = state.template_name(req.template.as_deref()).to_owned();
    let network = crate::service::network::gate_for(
        state,
        engine.as_ref(),
        &template,
        req.network.as_ref(),
        "network",
    )?;
    check_count(state, 1)?;
    check_memory(state)?;
    let settings = NewSession {
        language,
        dialect,
        env: req.env,
        idle_timeout: idle,
        max_lifetime: life,
        metadata: req.metadata,
        parent: None,
        template,
        engine: engine.clone(),
        auto_pause: req.auto_pause.unwrap_or(false),
        again: None,
        network,
        owner: crate::core::audit::current_key(),
    };
    let sessions = state.sessions().clone();
    admission::call(state, move || {
        let made = engine
            .start()
            .map_err(Error::internal)
            .and_then(|vm| sessions.insert(settings, vm).map_err(Error::internal))?;
        made.account();
        Ok::<_, Error>(made)
    })
    .await?
}

/// How long a delete, pause or snapshot waits for the checkpoint of the session's work
/// directory.
pub const END_CHECKPOINT: Duration = Duration::from_secs(10);

/// A checkpoint of live session `id`'s work directory in its trace before it is deleted,
/// paused or snapshotted (`why`), when the server keeps traces; given up after
/// [`END_CHECKPOINT`] (a wedged guest must not hold the operation up), and skipped where it
/// fails (a session with no files to read: the operation says what is wrong).
pub async fn checkpoint_before(state: &AppState, id: &str, why: &str) {
    if state.traces().is_none() || state.sessions().get(id).is_err() {
        return;
    }
    let walk = crate::service::trace::checkpoint(state, id, why);
    match tokio::time::timeout(END_CHECKPOINT, walk).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::debug!(session = id, why, error = %e, "no checkpoint"),
        Err(_) => tracing::warn!(session = id, why, "the checkpoint took too long"),
    }
}

/// Ends session `id` as deleted (its tombstone too, if it had ended already); waits for a
/// running request's end.
pub async fn end(state: &AppState, id: &str) -> Result<(), Error> {
    if let Some(dir) = state.state_dir()
        && crate::service::resume::remove_paused(state, dir, id, "deleted", "deleted while paused")
            .is_some()
    {
        return Ok(());
    }
    match state.sessions().get(id) {
        Ok(_) => {}
        Err(Unavailable::Gone(_)) => {
            state.sessions().forget(id);
            return Ok(());
        }
        Err(u) => return Err(unavailable(id, u)),
    }
    // What its programs changed in its work directory, while its VM is still there.
    checkpoint_before(state, id, "ended").await;
    let sessions = state.sessions().clone();
    let id = id.to_owned();
    let why = Ended {
        reason: "deleted".into(),
        detail: None,
    };
    admission::call(state, move || sessions.end(&id, why)).await
}

/// A cell that ran (whatever its status).
#[derive(Debug)]
pub struct Cell {
    pub result: JobResult,
    /// How long it waited for a job thread.
    pub waited: Duration,
    /// The session's cells so far, this one included (Jupyter's execution count).
    pub execution_count: u64,
}

/// The job of cell `req` in session `e`: the session's language and env unless the
/// request gives its own.
fn cell_job(state: &AppState, e: &Entry, mut req: ExecRequest) -> Result<vmm::Job, Error> {
    if req.network.is_some() {
        return Err(Error::invalid(
            "network",
            "a session's network is set when it is created, or replaced with PUT /v1/sessions/{id}/network; not per cell",
        ));
    }
    if let Some(t) = req.template.as_deref()
        && t != e.template
    {
        return Err(Error::invalid(
            "template",
            format!(
                "a session keeps its template ({}); create another session for {t}",
                e.template
            ),
        ));
    }
    let (language, dialect) = match (req.mode, req.language.take()) {
        (Some(mode), _) => (mode, 0),
        (None, None) => (e.language, e.dialect),
        (None, Some(name)) => {
            templates::runtime(e.engine.as_ref(), Some(&name), "language")?.runs()
        }
    };
    let mut env = e.env.clone();
    env.append(&mut req.env);
    req.env = env;
    let mut job = req.into_job(&state.config().limits, "")?;
    job.language = language;
    job.dialect = dialect;
    Ok(job)
}

/// Runs cell `req` in session `id` on a job thread; its output also goes to `sink` as it
/// comes. `route` names the route in the audit trail. Dropping the future cancels the
/// cell: it is interrupted, so the session goes on if it stops within the grace.
pub async fn cell(
    state: &AppState,
    id: &str,
    req: ExecRequest,
    route: &str,
    mut sink: Sink,
) -> Result<Cell, Error> {
    let busy = acquire(state, id).await?;
    let mut job = cell_job(state, busy.entry(), req)?;
    // Held by this future (and known to the job threads while the cell runs: a shutdown
    // past its grace cancels it).
    let cancel = CancelOnDrop::for_job(state.jobs(), &mut job);
    let origin = Origin::here(route, &busy.entry().template, Some(id));
    let st = state.clone();
    let slot = admission::admit(state, 1)?.remove(0);
    let rx = admission::spawn(state, slot, move |reply: Reply<Result<Cell, Error>>| {
        let waited = reply.waited();
        let ran = busy
            .entry()
            .with_vm(|s| {
                s.exec(&job, DEFAULT_INTERRUPT_GRACE, &mut *sink)
                    .map(|r| (r, s.executions()))
            })
            .unwrap_or(Err(SessionError::Gone));
        if let Ok((r, _)) = &ran {
            finished(&st, &origin, "cell", &job, Ok(r), waited);
            let ns = u64::try_from(r.timings.run.as_nanos()).unwrap_or(u64::MAX);
            busy.entry()
                .run_ns
                .fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
        }
        end_if_unusable(&st, &busy);
        // Accounted before the answer: a client that creates or forks right after a cell
        // that grew must meet the memory cap with that growth counted. Freed before the
        // answer too, so its next cell never finds it busy.
        busy.entry().account();
        let id = busy.entry().id.clone();
        drop(busy);
        reply.send(
            ran.map(|(result, execution_count)| Cell {
                result,
                waited,
                execution_count,
            })
            .map_err(|e| Error::of_session(&id, e)),
        );
    })?;
    Pending::new(rx, cancel).finish().await
}

/// What a fork made: the children's ids and what it cost.
#[derive(Debug)]
pub struct Forked {
    pub ids: Vec<String>,
    pub stats: ForkStats,
}

/// Forks session `id` into `count` children, each a new session with the parent's settings
/// and the rest of its lifetime.
pub async fn fork(state: &AppState, id: &str, count: usize) -> Result<Forked, Error> {
    let max = state.config().sessions.max_fork_count;
    if !(1..=max).contains(&count) {
        return Err(Error::invalid(
            "count",
            format!("count must be 1..={max} (got {count})"),
        ));
    }
    admission::check_open(state)?;
    let busy = acquire(state, id).await?;
    check_count(state, count)?;
    check_memory(state)?;
    crate::service::trace::check_traces(state)?;
    let sessions = state.sessions().clone();
    let forked = admission::call(state, move || {
        let e = busy.entry().clone();
        let forked = e
            .with_vm(|s| s.fork(count))
            .unwrap_or(Err(SessionError::Gone));
        let (children, stats) = forked.map_err(Error::internal)?;
        let mut made = Vec::with_capacity(children.len());
        for child in children {
            let settings = NewSession {
                language: e.language,
                dialect: e.dialect,
                env: e.env.clone(),
                idle_timeout: e.idle_timeout,
                max_lifetime: e
                    .expires_at()
                    .duration_since(SystemTime::now())
                    .unwrap_or_default()
                    .max(Duration::from_secs(1)),
                metadata: e.metadata.clone(),
                parent: Some(e.id.clone()),
                template: e.template.clone(),
                engine: e.engine.clone(),
                auto_pause: e.auto_pause.load(std::sync::atomic::Ordering::Relaxed),
                again: None,
                // The parent's policy, a log of its own.
                network: e.network.as_ref().map(|g| Arc::new(g.child())),
                owner: e.owner.clone(),
            };
            let child_entry = sessions.insert(settings, child).map_err(Error::internal)?;
            child_entry.account();
            made.push(child_entry);
        }
        sessions
            .forked
            .fetch_add(made.len() as u64, std::sync::atomic::Ordering::Relaxed);
        e.account();
        // Each child has its own copy of the parent's live processes (and their pipes),
        // watchers (the guest's inotify) and code contexts' kernels: its own from now on.
        let live: Vec<_> = e
            .processes
            .list()
            .into_iter()
            .filter(|(_, end)| end.is_none())
            .collect();
        let watches = e.processes.watch_list();
        let contexts = e.contexts().clone();
        for child in &made {
            *child.contexts() = contexts.copy();
            for (info, _) in &live {
                child.processes.add((**info).clone());
            }
            for (id, path) in &watches {
                child.processes.add_watch(*id, path);
            }
        }
        drop(busy);
        Ok::<_, Error>((made, stats))
    })
    .await??;
    let (made, stats) = forked;
    for child in &made {
        crate::service::processes::ensure_pump(state, child);
    }
    let ids: Vec<String> = made.iter().map(|c| c.id.clone()).collect();
    state.trace(id, "forked", |_| serde_json::json!({"children": ids}));
    Ok(Forked { ids, stats })
}

/// `POST /v1/sessions`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// Default runtime of its cells, one of its template's by name or alias (unless given,
    /// the template's default runtime, its manifest's first, as for one-shot jobs:
    /// `javascript` on `node`). A cell may name another (its own `language`).
    pub language: Option<String>,
    /// Environment of every cell.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub idle_timeout_s: Option<u64>,
    pub max_lifetime_s: Option<u64>,
    /// Anything the client wants back in `GET` (at most 4 KiB of JSON).
    #[serde(default)]
    pub metadata: serde_json::Value,
    /// The template to start from (default: the server's default template).
    pub template: Option<String>,
    /// Start from this snapshot instead of the template: its memory, files and processes,
    /// with an identity of its own (settings not given here are the snapshot's).
    pub snapshot: Option<String>,
    /// Pause the session instead of ending it when its idle timeout or lifetime is up
    /// (needs the server's state directory).
    pub auto_pause: Option<bool>,
    /// What its network may reach (a template with a card only; default: the server's
    /// `--egress-default`).
    pub network: Option<crate::core::egress::PolicySpec>,
}

/// `POST /v1/sessions/{id}/fork`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    #[serde(default = "one")]
    pub count: usize,
}

fn one() -> usize {
    1
}
