//! Durable sessions: pause a session to the state directory and resume it (explicitly, or
//! at the next request that wants it), snapshot a running one and start sessions from the
//! snapshot, and pause instead of end where asked (at expiry, at shutdown). The files and
//! their records are [`crate::core::durable`]'s; the VM's part is vmm's `Session::save` and
//! `Session::load`.
//!
//! - **Pause**: the session is taken like any request takes it, its file written
//!   (atomically: a crash leaves it paused in whole or still running), then it leaves the
//!   live sessions and its VM ends. Its lifetime stands still while paused; its background
//!   processes are frozen with the VM and listed again after the resume (their output from
//!   before the pause stays behind).
//! - **Resume** ([`crate::service::resume`]): explicitly here, or at the next request
//!   that wants the session; then its processes' pump starts again.
//! - **Park** (`--park-idle-s`): a session idle that long is paused by the server the same
//!   way, marked parked: it is shown running, its idle timeout and lifetime go on on disk
//!   ([`sweep_parked`] ends it when one is up, as a running session would end), and its
//!   next request resumes it. Live sessions are then bounded by memory, parked ones by
//!   disk.
//! - **Snapshot**: the session is held while its file is written, then goes on. A session
//!   started from a snapshot gets the snapshot's memory, files and processes and an
//!   identity of its own; many share its pages in the page cache.

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use vmm::session::Session;
use vmm::session_file;

use crate::core::audit::Origin;
use crate::core::durable::{
    ParkedUntil, Paused, ProcessRecord, RECORD_VERSION, Reservation, SessionRecord, Snapshot,
    SnapshotRecord, StateDir, epoch_ms,
};
use crate::core::sessions::{Busy, Ended, Entry, NewSession, Unavailable};
use crate::core::state::AppState;
use crate::service::access::{acquire, unavailable};
use crate::service::admission::{self, check_count, check_memory};
use crate::service::error::Error;
use crate::service::resume::remove_paused;
use crate::service::sessions::CreateSession;
use crate::service::templates;

/// Session `id`, running, resumed if it was paused, with its processes' pump going.
pub async fn resume(state: &AppState, id: &str) -> Result<Arc<Entry>, Error> {
    let e = crate::service::resume::resume(state, id).await?;
    crate::service::processes::ensure_pump(state, &e);
    Ok(e)
}

fn dir(state: &AppState) -> Result<Arc<StateDir>, Error> {
    state.state_dir().cloned().ok_or(Error::NoStateDir)
}

fn processes_of(e: &Entry) -> Vec<ProcessRecord> {
    e.processes
        .list()
        .into_iter()
        .filter(|(_, end)| end.is_none())
        .map(|(info, _)| ProcessRecord::of(&info))
        .collect()
}

/// The quota, for a file about the size of the memory `e` holds: held until the file is
/// recorded (two pauses never both pass it).
fn check_quota(dir: &Arc<StateDir>, e: &Entry) -> Result<Reservation, Error> {
    use std::sync::atomic::Ordering::Relaxed;
    let need = e.private_bytes.load(Relaxed) + e.layer_bytes.load(Relaxed);
    dir.reserve(need).ok_or_else(|| {
        let (used, quota) = dir.usage();
        Error::StateQuota { used, need, quota }
    })
}

/// Pauses session `id` (module docs). A parked session ([`park`]) is resumed and paused
/// again: it was running as far as its client knew, and is paused now.
pub async fn pause(state: &AppState, id: &str) -> Result<PauseResponse, Error> {
    pause_as(state, id, false).await
}

/// Parks session `id`: pauses it because it idled past `--park-idle-s`, so that it holds
/// disk instead of memory until its next request resumes it. It is shown running, and its
/// idle timeout and lifetime go on while it is parked ([`sweep_parked`] ends it when one
/// is up). No checkpoint of its files is taken: nothing of it changes for its client.
pub async fn park(state: &AppState, id: &str) -> Result<PauseResponse, Error> {
    pause_as(state, id, true).await
}

async fn pause_as(state: &AppState, id: &str, parked: bool) -> Result<PauseResponse, Error> {
    let dir = dir(state)?;
    let now = epoch_ms(SystemTime::now());
    match dir.paused().get(id) {
        Some(p) if !parked && p.record.parked_at(now) => {
            resume(state, id).await?;
        }
        Some(_) => return Err(Error::Paused(id.to_owned())),
        None => {}
    }
    if !parked {
        crate::service::sessions::checkpoint_before(state, id, "paused").await;
    }
    let busy = acquire(state, id).await?;
    let what = if parked { "park" } else { "pause" };
    let origin = Origin::here(what, &busy.entry().template, Some(id));
    let st = state.clone();
    let paused = admission::call(state, move || pause_held(&st, &dir, busy, parked)).await??;
    if let Some(a) = state.audit() {
        let took = Duration::from_secs_f64(paused.pause_ms / 1e3);
        a.lifecycle(&origin, what, took, None);
    }
    Ok(paused)
}

/// Pauses the session `busy` holds (on a job thread); `parked`: for idling ([`park`]).
fn pause_held(
    state: &AppState,
    dir: &Arc<StateDir>,
    busy: Busy,
    parked: bool,
) -> Result<PauseResponse, Error> {
    let started = Instant::now();
    let e = busy.entry().clone();
    e.account();
    let _held = check_quota(dir, &e)?;
    let now = SystemTime::now();
    let parked = parked.then(|| {
        let at = |d: Duration| epoch_ms(now + d);
        ParkedUntil {
            idle_ms: at(e.idle_timeout.saturating_sub(e.idle_for())),
            lifetime_ms: at(e.lifetime_left()),
        }
    });
    let record = SessionRecord {
        version: RECORD_VERSION,
        id: e.id.clone(),
        created_at_ms: epoch_ms(e.created_at),
        paused_at_ms: epoch_ms(SystemTime::now()),
        idle_timeout_s: e.idle_timeout.as_secs(),
        lifetime_left_ms: u64::try_from(e.lifetime_left().as_millis()).unwrap_or(u64::MAX),
        language: e.language,
        dialect: e.dialect,
        env: e.env.clone(),
        metadata: e.metadata.clone(),
        parent: e.parent.clone(),
        template: e.template.clone(),
        auto_pause: e.auto_pause.load(std::sync::atomic::Ordering::Relaxed),
        owner: e.owner.clone(),
        processes: processes_of(&e),
        watches: e.processes.watch_list(),
        attachment: e.attachment_record(),
        contexts: e.contexts().clone(),
        network: e.network.as_ref().and_then(|g| g.policy()),
        trace: None,
        parked,
    };
    let mut carried = SessionRecord {
        trace: carried_trace(state, &e.id),
        ..record.clone()
    };
    let app = serde_json::to_vec(&carried).map_err(Error::internal)?;
    carried.trace = None;
    let path = dir.paused().path(&e.id);
    let exec = crate::service::access::executor(&e)?;
    let saved = e
        .with_vmm(|s, exec| s.save(exec, &path, app, dir.keys()))
        .ok_or_else(|| unavailable(&e.id, Unavailable::Unknown))?
        .map_err(Error::internal)?;
    let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
    // Kept while this pause needs it (a later build of the template never prunes it).
    let _ = exec.template().pin(dir.holder());
    dir.paused().add(Paused {
        record,
        bytes,
        key: exec.template().key(),
        written_here: true,
    });
    if let Some((entry, vm)) = state.sessions().take_out(&e.id, parked.is_some()) {
        drop(entry);
        vm.end();
    }
    drop(busy);
    let counter = if parked.is_some() {
        &dir.parks
    } else {
        &dir.pauses
    };
    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(PauseResponse {
        id: e.id.clone(),
        state: if parked.is_some() { "parked" } else { "paused" }.into(),
        bytes,
        memory_bytes: saved.page_bytes,
        pause_ms: started.elapsed().as_secs_f64() * 1e3,
    })
}

/// Session `id`'s trace so far, to carry in its file (None without one, or past
/// [`crate::core::durable::MAX_CARRIED_TRACE`]).
fn carried_trace(state: &AppState, id: &str) -> Option<String> {
    let path = state.traces()?.file_of(id)?;
    let size = std::fs::metadata(&path).ok()?.len();
    if size > crate::core::durable::MAX_CARRIED_TRACE as u64 {
        tracing::warn!(
            session = id,
            bytes = size,
            "its trace is too large to carry in its file"
        );
        return None;
    }
    std::fs::read_to_string(path).ok()
}

/// Takes a snapshot of session `id`, which goes on (module docs).
pub async fn snapshot(state: &AppState, id: &str) -> Result<Snapshot, Error> {
    let dir = dir(state)?;
    crate::service::sessions::checkpoint_before(state, id, "snapshot").await;
    let busy = acquire(state, id).await?;
    let origin = Origin::here("snapshot", &busy.entry().template, Some(id));
    let started = Instant::now();
    let snap_id = state.sessions().new_id("snap").map_err(Error::internal)?;
    let snap = admission::call(state, move || {
        let e = busy.entry().clone();
        e.account();
        let _held = check_quota(&dir, &e)?;
        let record = SnapshotRecord {
            version: RECORD_VERSION,
            id: snap_id.clone(),
            created_at_ms: epoch_ms(SystemTime::now()),
            source: e.id.clone(),
            language: e.language,
            dialect: e.dialect,
            env: e.env.clone(),
            metadata: e.metadata.clone(),
            template: e.template.clone(),
            idle_timeout_s: e.idle_timeout.as_secs(),
            processes: processes_of(&e),
            watches: e.processes.watch_list(),
            attachment: e.attachment_record(),
            contexts: e.contexts().clone(),
            network: e.network.as_ref().and_then(|g| g.policy()),
            owner: e.owner.clone(),
        };
        let app = serde_json::to_vec(&record).map_err(Error::internal)?;
        let path = dir.snapshots().path(&snap_id);
        let exec = crate::service::access::executor(&e)?;
        e.with_vmm(|s, exec| s.save(exec, &path, app, dir.keys()))
            .ok_or_else(|| unavailable(&e.id, Unavailable::Unknown))?
            .map_err(Error::internal)?;
        drop(busy);
        let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
        let _ = exec.template().pin(dir.holder());
        let snap = Snapshot {
            record,
            bytes,
            key: exec.template().key(),
            pages_checked: std::sync::Arc::new(true.into()),
        };
        dir.snapshots().add(snap.clone());
        dir.snapshots_taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok::<_, Error>(snap)
    })
    .await??;
    if let Some(a) = state.audit() {
        a.lifecycle(
            &origin,
            "snapshot",
            started.elapsed(),
            Some(&snap.record.id),
        );
    }
    state.trace(
        id,
        "snapshot",
        |_| serde_json::json!({"snapshot": snap.record.id, "bytes": snap.bytes}),
    );
    Ok(snap)
}

/// Deletes snapshot `id` (sessions started from it go on).
pub fn delete_snapshot(state: &AppState, id: &str) -> Result<(), Error> {
    let dir = dir(state)?;
    let s = dir
        .snapshots()
        .remove(id)
        .ok_or_else(|| Error::NoSnapshot(id.to_owned()))?;
    if let Ok(exec) = templates::served_executor(state, &s.record.template) {
        crate::service::resume::unpin_if_unneeded(&dir, &exec, &s.key);
    }
    Ok(())
}

/// Starts a session from snapshot `snap` with the settings of `req` that it gives (the
/// snapshot's otherwise).
pub async fn start_from(
    state: &AppState,
    snap: &str,
    req: CreateSession,
) -> Result<Arc<Entry>, Error> {
    let dir = dir(state)?;
    let s = dir.snapshots().get(snap).ok_or_else(|| {
        Error::wrong_node(state.node(), snap).unwrap_or_else(|| Error::NoSnapshot(snap.to_owned()))
    })?;
    if let Some(t) = req.template.as_deref()
        && t != s.record.template
    {
        return Err(Error::invalid(
            "template",
            format!("snapshot {snap} is of template {}", s.record.template),
        ));
    }
    crate::service::trace::check_traces(state)?;
    let r = s.record.clone();
    let lim = &state.config().sessions;
    let idle = req.idle_timeout_s.unwrap_or(r.idle_timeout_s);
    let life = req.max_lifetime_s.unwrap_or(lim.default_lifetime_s);
    if !(1..=lim.max_idle_timeout_s).contains(&idle) || !(1..=lim.max_lifetime_s).contains(&life) {
        return Err(Error::invalid(
            "idle_timeout_s",
            format!(
                "idle_timeout_s must be 1..={} and max_lifetime_s 1..={}",
                lim.max_idle_timeout_s, lim.max_lifetime_s
            ),
        ));
    }
    let exec = crate::service::resume::executor_of_key(state, &dir, &r.template, &s.key).await?;
    check_count(state, 1)?;
    check_memory(state)?;
    let mut env = r.env.clone();
    env.extend(req.env);
    crate::service::import_check::check_env(state, &env)?;
    let (language, dialect) = match req.language.as_deref() {
        None => (r.language, r.dialect),
        Some(name) => templates::runtime(&exec, Some(name), "language")?.runs(),
    };
    let settings = NewSession {
        language,
        dialect,
        env,
        idle_timeout: Duration::from_secs(idle),
        max_lifetime: Duration::from_secs(life),
        metadata: if req.metadata.is_null() {
            r.metadata.clone()
        } else {
            req.metadata
        },
        parent: Some(r.source.clone()),
        template: r.template.clone(),
        engine: crate::core::engine::vmm::engine(&exec),
        auto_pause: req.auto_pause.unwrap_or(false),
        again: None,
        // The request's policy, else the snapshot's (never the server's default: a
        // snapshot of a restricted session stays restricted).
        network: match &req.network {
            Some(spec) => {
                crate::service::network::gate_for(state, &exec, &r.template, Some(spec), "network")?
            }
            None => crate::service::network::restored(state, &exec, r.network.as_ref()),
        },
        owner: crate::core::audit::current_key(),
    };
    let path = dir.snapshots().path(snap);
    let sessions = state.sessions().clone();
    let snap_id = snap.to_owned();
    let keys = dir.keys().clone();
    let pages_checked = s.pages_checked.clone();
    let e = admission::call(state, move || {
        let f = session_file::read(&path, &keys)
            .and_then(|f| {
                // A file found at start: its pages read back and checked once.
                use std::sync::atomic::Ordering::SeqCst;
                if !pages_checked.load(SeqCst) {
                    f.verify_pages()?;
                    pages_checked.store(true, SeqCst);
                }
                Ok(f)
            })
            .map_err(|e| Error::Unresumable {
                id: snap_id.clone(),
                why: e.to_string(),
            })?;
        let vm = Session::load(&exec, &f, true).map_err(|e| Error::Unresumable {
            id: snap_id,
            why: e.to_string(),
        })?;
        let vm = crate::core::engine::vmm::session(vm, &exec);
        let e = sessions.insert(settings, vm).map_err(Error::internal)?;
        e.keep_record(r.attachment);
        *e.contexts() = r.contexts.copy();
        for p in &r.processes {
            e.processes.add(p.info());
        }
        for (id, path) in &r.watches {
            e.processes.add_watch(*id, path);
        }
        e.account();
        Ok::<_, Error>(e)
    })
    .await??;
    crate::service::processes::ensure_pump(state, &e);
    Ok(e)
}

/// Pauses the sessions whose time is up and that asked to be paused (the reaper's); one
/// that cannot be paused ends, with why.
pub async fn pause_expired(state: &AppState, ids: Vec<String>) {
    for id in ids {
        if let Err(e) = pause(state, &id).await {
            tracing::warn!(session = %id, error = %e, "auto-pause failed: the session ends");
            let sessions = state.sessions().clone();
            let why = Ended {
                reason: "pause_failed".into(),
                detail: Some(e.to_string()),
            };
            let _ = tokio::task::spawn_blocking(move || sessions.end(&id, why)).await;
        }
    }
}

/// Parks the sessions that idled past `--park-idle-s` (the reaper's). One that cannot be
/// parked (the state directory's quota, a VM that cannot be saved) stays running.
pub async fn park_idle(state: &AppState, ids: Vec<String>) {
    for id in ids {
        if let Err(e) = park(state, &id).await {
            tracing::debug!(session = %id, error = %e, "not parked");
        }
    }
}

/// Ends the parked sessions whose idle timeout or lifetime is up (as a running session
/// ends at its time: its file removed, its end traced, later calls 410 with the reason);
/// one that asked for `auto_pause` stays, an ordinary paused session from then on.
pub async fn sweep_parked(state: &AppState) {
    let Some(dir) = state.state_dir().cloned() else {
        return;
    };
    let now = epoch_ms(SystemTime::now());
    let due = dir
        .paused()
        .matching(|p| p.record.parked_due(now).is_some() && !p.record.auto_pause);
    for p in due {
        let r = &p.record;
        let Some(reason) = r.parked_due(now) else {
            continue;
        };
        if !dir.claim_resume(&r.id) {
            continue;
        }
        // Claimed as a resume is: no request resumes it while it ends, and one waiting for
        // it finds its tombstone once the claim is released.
        let detail = "while parked";
        if remove_paused(state, &dir, &r.id, reason, detail).is_some() {
            state.sessions().tombstone(
                &r.id,
                Ended {
                    reason: reason.into(),
                    detail: Some(detail.into()),
                },
            );
            state.sessions().count_ended(reason);
        }
        dir.release_resume(&r.id);
        dir.resumed.notify_waiters();
    }
}

/// Pauses every running session (a shutdown with `--pause-on-shutdown`, a drain with
/// `pause`), one after another: each one's id and how its pause went (one that cannot be
/// paused stays as it is).
pub async fn pause_all(state: &AppState) -> Vec<(String, Result<PauseResponse, Error>)> {
    let mut done = Vec::new();
    for e in state.sessions().list() {
        let paused = pause(state, &e.id).await;
        done.push((e.id.clone(), paused));
    }
    done
}

/// Imports the session file uploaded to `tmp` (another server's export of a paused
/// session) as a paused session here: its MAC, pages, machine state and record checked
/// ([`crate::service::import_check`]), its template and host this server's, its id new
/// here. The file is moved into place, or removed if refused. `held` is the quota the
/// upload holds, given back once the file is counted.
/// Keeps the trace an imported session's file carried (when this server has no trace of
/// it) and records the import in it.
fn adopt_trace(state: &AppState, id: &str, carried: Option<String>) {
    let Some(t) = state.traces() else { return };
    let bytes = carried.as_ref().map_or(0, String::len);
    let kept = match carried {
        Some(text) => t.adopt(id, &text).unwrap_or_else(|e| {
            tracing::warn!(session = id, error = %e, "cannot keep an imported trace");
            false
        }),
        None => false,
    };
    t.record(
        id,
        "imported",
        |_| serde_json::json!({"carried_bytes": bytes, "kept": kept}),
    );
}

pub async fn import(
    state: &AppState,
    tmp: std::path::PathBuf,
    held: Reservation,
) -> Result<Paused, Error> {
    if let Err(e) = admission::check_open(state) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    let dir = dir(state)?;
    let st = state.clone();
    tokio::task::spawn_blocking(move || {
        let checked = crate::service::import_check::check_import(&st, &dir, &tmp);
        let adopted = checked.and_then(|(p, trace)| match dir.adopt_upload(&tmp, p.clone()) {
            Ok(true) => {
                adopt_trace(&st, &p.record.id, trace);
                Ok(p)
            }
            Ok(false) => Err(Error::Exists(p.record.id.clone())),
            Err(e) => {
                tracing::error!(error = %e, "an import could not be moved into place");
                Err(Error::internal(e.without_path()))
            }
        });
        drop(held);
        match adopted {
            Ok(p) => {
                // An id that ended here before is paused here now: its tombstone would
                // hide it.
                st.sessions().forget(&p.record.id);
                // One this node handed to another and now takes back is served here
                // again, not forwarded to where it was (which would forward it back).
                st.node().back(&p.record.id);
                Ok(p)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    })
    .await
    .map_err(Error::internal)?
}

/// What a pause wrote.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PauseResponse {
    pub id: String,
    pub state: String,
    /// Size of its file in the state directory; of it, guest memory.
    pub bytes: u64,
    pub memory_bytes: u64,
    /// How long the session was held: state, pages, fsync, and ending its VM.
    pub pause_ms: f64,
}
