//! A sandbox's background processes: start one, list them, connect to one's output, write
//! its stdin, signal it; and the pump that keeps the sandbox's VM running while any lives.
//!
//! **Beside a cell.** Every operation here runs beside a cell the session runs, if one runs
//! ([`vmm::beside`]): a command started, fed or killed while a long cell computes.
//!
//! **The pump.** A session's VM runs only during a request. While the session has live
//! processes, a task of its own ([`pump`]) takes the session whenever no request wants it and
//! runs a poll ([`vmm::process`]): the guest waits in one `select` for output and exits (its
//! processes run meanwhile) and answers as soon as there is something, or after
//! [`POLL_WAIT`]. While a cell runs it polls beside the cell instead. A request for the session pulls the poll's cancel
//! ([`crate::core::sessions::Entry::preempt`]), so it waits for one guest wakeup, not a round; the
//! pump yields to every waiting request and takes the session back after them. The pump's
//! polls run on the blocking pool, not on a job thread: a sandbox with a server in the
//! background must not hold one of the few job threads for its whole life. It stops when
//! the last process ended, or with the session.
//!
//! Measured cost: see `docs/processes.md` (a quiet process costs a guest wakeup per
//! [`POLL_WAIT`]; each burst of output one round trip).

pub mod requests;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use vmm::Cancel;
use vmm::process::{Changed, ProcessError, ProcessSpec, Processes};
use vmm::session::{Requests, SessionError};

use crate::core::processes::{Info, Kept, MAX_STREAMS, Start, Subscription};
use crate::core::sessions::{Busy, Entry};
use crate::core::state::AppState;
use crate::service::access::{Taken, acquire, beside, beside_or_acquire, end_if_unusable, get};
use crate::service::admission;
use crate::service::error::Error;

/// Longest a poll waits in the guest when nothing happens (a request ends it early).
pub const POLL_WAIT: Duration = Duration::from_secs(10);

/// Output bytes one poll takes at most.
pub const POLL_BUDGET: usize = 1 << 20;

/// How long a write to stdin may wait for the process to take it all.
pub const STDIN_PATIENCE: Duration = Duration::from_secs(30);

fn failed(e: ProcessError, pid: Option<u32>) -> Error {
    match e {
        ProcessError::NotFound(m) => match pid {
            Some(pid) => Error::NoProcess { pid, message: m },
            None => Error::internal(m),
        },
        ProcessError::Invalid(m) => Error::Invalid {
            field: None,
            message: m,
        },
        other => Error::internal(other),
    }
}

/// Runs `op` in session `id`: beside the cell it runs, if one runs, else on its VM on a job
/// thread (admitted like a cell: the server's refusals are the outer error; a VM it leaves
/// unusable ends the session with why).
async fn in_session<R: Send + 'static>(
    state: &AppState,
    id: &str,
    op: impl Fn(&mut dyn Requests, &vmm::Executor) -> Result<R, ProcessError> + Send + Sync + 'static,
) -> Result<Result<R, ProcessError>, Error> {
    let op = Arc::new(op);
    let o = op.clone();
    let lane_op =
        Arc::new(
            move |lane: &mut vmm::beside::Beside, ex: &vmm::Executor| match o(lane, ex) {
                Err(ProcessError::Session(s)) if s.not_beside() => None,
                done => Some(done),
            },
        );
    match beside_or_acquire(state, id, true, lane_op).await? {
        Taken::Beside(done) => Ok(done),
        Taken::Held(busy) => on_vm(state, busy, move |s, ex| op(s, ex)).await,
    }
}

/// Runs `op` on session `busy`'s VM on a job thread (see [`in_session`]).
async fn on_vm<R: Send + 'static>(
    state: &AppState,
    busy: Busy,
    op: impl FnOnce(&mut vmm::session::Session, &vmm::Executor) -> Result<R, ProcessError>
    + Send
    + 'static,
) -> Result<Result<R, ProcessError>, Error> {
    let st = state.clone();
    admission::call(state, move || {
        let r = busy
            .entry()
            .with_vmm(|s, exec| op(s, exec))
            .unwrap_or(Err(ProcessError::Session(SessionError::Gone)));
        end_if_unusable(&st, &busy);
        drop(busy);
        r
    })
    .await
}

/// Starts `req` in session `id`; returns its pid. It runs until it ends, is killed, or the
/// session ends, whoever listens. `route` names the route in the audit trail, which
/// records the start (kind `process`).
pub async fn start(state: &AppState, id: &str, req: Start, route: &str) -> Result<u32, Error> {
    let e = live_entry(state, id).await?;
    let origin = crate::core::audit::Origin::here(route, &e.template, Some(id));
    let limit = state.config().sessions.max_processes;
    let starting = e.processes.starting();
    if e.processes.live() >= limit {
        return Err(Error::TooManyProcesses { limit });
    }
    let mut env = e.env.clone();
    env.extend(req.env.clone());
    let spec = ProcessSpec {
        script: req.script.clone(),
        env: env.into_iter().collect(),
        cwd: req.cwd.clone(),
        stdin: req.stdin,
        pty: req.pty,
        user: req.user.clone(),
    };
    let script = req.script.clone();
    let traced = serde_json::json!({
        "cmd": req.cmd, "args": req.args, "cwd": req.cwd, "tag": req.tag, "internal": req.internal,
    });
    let entry = e.clone();
    // Recorded before the start is over (`starting`, or the session still held): the
    // pump's next poll may already bring the new process's output and end, which a record
    // made later would miss.
    let (pid, added) = in_session(state, id, move |s, ex| {
        let pid = s.start_process(ex, &spec)?;
        let info = Info {
            pid,
            start: req.clone(),
            started_at: SystemTime::now(),
        };
        Ok((pid, entry.processes.add(info)))
    })
    .await?
    .map_err(|e| failed(e, None))?;
    drop(starting);
    state.audit_process(&origin, script.as_bytes());
    state.trace(id, "process", |_| {
        let mut data = crate::core::trace::event::process(&origin, script.as_bytes());
        data["pid"] = pid.into();
        if let (Some(d), serde_json::Value::Object(more)) = (data.as_object_mut(), traced) {
            d.extend(more);
        }
        data
    });
    if !added {
        return Err(get(state, id)
            .err()
            .unwrap_or_else(|| Error::NoSession(id.into())));
    }
    ensure_pump(state, &e);
    Ok(pid)
}

/// Session `id`, live: resumed first if it is paused.
async fn live_entry(state: &AppState, id: &str) -> Result<Arc<Entry>, Error> {
    match get(state, id) {
        Ok(e) => Ok(e),
        Err(Error::Paused(_)) => Ok(acquire(state, id).await?.entry().clone()),
        Err(e) => Err(e),
    }
}

/// The processes of session `id` (running and recently ended), oldest first; bud's own
/// (kernels) left out.
pub fn list(state: &AppState, id: &str) -> Result<Vec<Kept>, Error> {
    let mut all = get(state, id)?.processes.list();
    all.retain(|(info, _)| !info.start.internal);
    Ok(all)
}

/// Whether process `pid` of session `id` is known and has not ended.
pub fn is_running(state: &AppState, id: &str, pid: u32) -> bool {
    get(state, id)
        .ok()
        .and_then(|e| e.processes.get(pid))
        .is_some_and(|(_, end, _)| end.is_none())
}

/// A client's connection to process `pid` of session `id`: its output so far (if
/// `from_start`) and what comes next.
pub fn connect(
    state: &AppState,
    id: &str,
    pid: u32,
    from_start: bool,
) -> Result<Subscription, Error> {
    let e = get(state, id)?;
    if e.processes.streams() >= MAX_STREAMS {
        return Err(Error::TooManyStreams { limit: MAX_STREAMS });
    }
    e.processes
        .subscribe(pid, from_start)
        .ok_or_else(|| no_process(pid))
}

fn no_process(pid: u32) -> Error {
    Error::NoProcess {
        pid,
        message: format!("no process {pid} in this sandbox"),
    }
}

/// A process of session `id` that has not ended.
fn live(state: &AppState, id: &str, pid: u32) -> Result<(Arc<Entry>, bool), Error> {
    let e = get(state, id)?;
    match e.processes.get(pid) {
        Some((_, None, stdin_open)) => Ok((e, stdin_open)),
        Some((_, Some(_), _)) => Err(Error::NoProcess {
            pid,
            message: format!("process {pid} has ended"),
        }),
        None => Err(no_process(pid)),
    }
}

/// Writes `data` to process `pid`'s stdin (all of it, waiting up to [`STDIN_PATIENCE`] for
/// the process to read), then closes it if `close`.
pub async fn stdin(
    state: &AppState,
    id: &str,
    pid: u32,
    data: Vec<u8>,
    close: bool,
) -> Result<(), Error> {
    let (e, open) = live(state, id, pid)?;
    if !open {
        return Err(Error::StdinClosed(pid));
    }
    let since = Instant::now();
    let sent = data.len();
    let mut rest = data;
    loop {
        let chunk = rest.clone();
        let last = close;
        let taken = in_session(state, id, move |s, ex| {
            let n = chunk.len();
            let taken = s.process_stdin(ex, pid, chunk.clone(), false)?;
            if taken == n && last {
                s.process_stdin(ex, pid, Vec::new(), true)?;
            }
            Ok(taken)
        })
        .await?
        .map_err(|err| match err {
            ProcessError::NotFound(_) => Error::StdinClosed(pid),
            other => failed(other, Some(pid)),
        })?;
        rest.drain(..taken.min(rest.len()));
        if rest.is_empty() {
            if close {
                e.processes.stdin_closed(pid);
            }
            state.trace(
                id,
                "process_stdin",
                |_| serde_json::json!({"pid": pid, "bytes": sent, "closed": close}),
            );
            return Ok(());
        }
        if since.elapsed() > STDIN_PATIENCE {
            return Err(Error::StdinFull {
                pid,
                left: rest.len(),
            });
        }
        // The pipe is full: let the process run (the pump) and read some.
        ensure_pump(state, &e);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `signal` to process `pid` of session `id` and what it started.
pub async fn signal(state: &AppState, id: &str, pid: u32, signal: i32) -> Result<(), Error> {
    let (e, _) = live(state, id, pid)?;
    in_session(state, id, move |s, ex| s.signal_process(ex, pid, signal))
        .await?
        .map_err(|err| failed(err, Some(pid)))?;
    state.trace(
        id,
        "process_signal",
        |_| serde_json::json!({"pid": pid, "signal": signal}),
    );
    // Its end comes through the pump.
    ensure_pump(state, &e);
    Ok(())
}

/// Watches directory `path` of session `id` (and its subdirectories if `recursive`);
/// returns the watcher's number. Its changes are kept for [`changes`] and sent to
/// streaming clients ([`crate::core::processes::Processes::subscribe_watch`]); with `entries` a
/// create, write or chmod carries the entry (E2B's `include_entry`).
pub async fn watch(
    state: &AppState,
    id: &str,
    path: &str,
    recursive: bool,
    entries: bool,
) -> Result<u32, Error> {
    let e = live_entry(state, id).await?;
    let starting = e.processes.starting();
    let limit = state.config().sessions.max_processes;
    if e.processes.live() + e.processes.watchers() >= limit {
        return Err(Error::TooManyProcesses { limit });
    }
    let dir = path.to_owned();
    let entry = e.clone();
    // Recorded before the start is over, for the same reason as a process.
    let (wid, added) = in_session(state, id, move |s, ex| {
        let wid = s.watch_dir(ex, &dir, recursive, entries)?;
        Ok((wid, entry.processes.add_watch(wid, &dir)))
    })
    .await?
    .map_err(|err| match err {
        ProcessError::NotFound(m) => Error::NoFile(m),
        other => failed(other, None),
    })?;
    drop(starting);
    if !added {
        return Err(get(state, id)
            .err()
            .unwrap_or_else(|| Error::NoSession(id.into())));
    }
    ensure_pump(state, &e);
    Ok(wid)
}

/// Watcher `wid`'s changes since the last call, and how many were dropped meanwhile.
pub fn changes(state: &AppState, id: &str, wid: u32) -> Result<(Vec<Changed>, u64), Error> {
    get(state, id)?
        .processes
        .take_changes(wid)
        .ok_or_else(|| no_watcher(wid))
}

/// The directory watcher `wid` of session `id` watches, as it was given.
pub fn watched(state: &AppState, id: &str, wid: u32) -> Result<String, Error> {
    get(state, id)?
        .processes
        .watch_path(wid)
        .ok_or_else(|| no_watcher(wid))
}

fn no_watcher(wid: u32) -> Error {
    Error::NoProcess {
        pid: wid,
        message: format!("no watcher {wid} in this sandbox"),
    }
}

/// Stops watcher `wid` of session `id`.
pub async fn unwatch(state: &AppState, id: &str, wid: u32) -> Result<(), Error> {
    let e = get(state, id)?;
    if !e.processes.remove_watch(wid) {
        return Err(no_watcher(wid));
    }
    in_session(state, id, move |s, ex| s.unwatch(ex, wid))
        .await?
        .map_err(|err| failed(err, None))
}

/// Sets the terminal size of PTY process `pid` of session `id`.
pub async fn resize(
    state: &AppState,
    id: &str,
    pid: u32,
    rows: u16,
    cols: u16,
) -> Result<(), Error> {
    let (e, _) = live(state, id, pid)?;
    if e.processes
        .get(pid)
        .is_some_and(|(i, _, _)| i.start.pty.is_none())
    {
        return Err(Error::invalid(
            "pty",
            format!("process {pid} has no terminal"),
        ));
    }
    in_session(state, id, move |s, ex| {
        s.resize_process(ex, pid, rows, cols)
    })
    .await?
    .map_err(|err| failed(err, Some(pid)))
}

/// Starts the pump of session `e` unless one runs or nothing lives.
pub fn ensure_pump(state: &AppState, e: &Arc<Entry>) {
    if e.processes.claim_pump() {
        tokio::spawn(pump(state.clone(), e.clone()));
    }
}

/// How often the pump measures the session's memory (its processes grow it).
const ACCOUNT_EVERY: Duration = Duration::from_secs(1);

/// How long the pump waits for the session before it looks again for a cell to poll
/// beside (one may start while the session is held by another request).
const BESIDE_RECHECK: Duration = Duration::from_millis(100);

/// What a poll beside a running cell brought: None if none runs (or it ended first).
async fn poll_beside(
    e: &Arc<Entry>,
) -> Option<Result<Vec<vmm::process::ProcessEvent>, ProcessError>> {
    if e.processes.is_starting() {
        // A start beside the cell is under way: its record first (Processes::starting).
        tokio::time::sleep(Duration::from_millis(5)).await;
        return Some(Ok(Vec::new()));
    }
    match beside(e, true, |lane, ex| {
        lane.poll_processes(ex, POLL_WAIT, POLL_BUDGET, None)
    })
    .await
    {
        Some(Err(ProcessError::Session(s))) if s.not_beside() => None,
        polled => polled,
    }
}

/// Keeps session `e`'s VM running while it has live processes (module docs). A client
/// connected to a process's output counts as use of the session (its idle timeout).
async fn pump(state: AppState, e: Arc<Entry>) {
    let mut accounted = Instant::now();
    while !e.processes.pump_should_stop() {
        if let Some(polled) = poll_beside(&e).await {
            match polled {
                Ok(events) => e.processes.record(events),
                Err(err) => {
                    tracing::warn!(session = %e.id, "polling the sandbox's processes beside its cell failed: {err}");
                    e.processes
                        .close(&format!("polling its processes failed: {err}"));
                }
            }
            continue;
        }
        let cancel = Cancel::new();
        let acquired = tokio::select! {
            acquired = state.sessions().acquire_background(&e.id, cancel.clone()) => acquired,
            () = tokio::time::sleep(BESIDE_RECHECK) => continue,
        };
        let Ok(busy) = acquired else {
            // The session ended: its processes ended with it (Sessions::end).
            let _ = e.processes.pump_should_stop();
            return;
        };
        let st = state.clone();
        let account = accounted.elapsed() >= ACCOUNT_EVERY;
        if account {
            accounted = Instant::now();
        }
        let polled = tokio::task::spawn_blocking(move || {
            let r = busy
                .entry()
                .with_vmm(|s, exec| s.poll_processes(exec, POLL_WAIT, POLL_BUDGET, Some(cancel)))
                .unwrap_or(Err(ProcessError::Session(SessionError::Gone)));
            end_if_unusable(&st, &busy);
            if account {
                busy.entry().account();
            }
            r
        })
        .await;
        if e.processes.watched() {
            e.touch();
        }
        match polled {
            Ok(Ok(events)) => e.processes.record(events),
            Ok(Err(err)) => {
                tracing::warn!(session = %e.id, "polling the sandbox's processes failed: {err}");
                e.processes
                    .close(&format!("polling its processes failed: {err}"));
            }
            Err(err) => {
                tracing::error!(session = %e.id, "the process pump panicked: {err}");
                e.processes.close("the process pump failed");
            }
        }
    }
}
