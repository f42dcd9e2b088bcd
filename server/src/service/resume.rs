//! Resuming a paused session: what a request for a paused session does first
//! ([`crate::service::access::acquire`]) and what `service::durable`'s explicit resume
//! does. One request resumes a session (others wait for it): the file is read and checked
//! (its pages too, for a file this server did not write itself), the session made again
//! with its id, settings, clock and identity, and the file removed. A file that cannot be
//! resumed is set aside in `damaged/` and the session answers 410 with why.
//!
//! Below `access` (which calls it) and so apart from `service::durable`, which takes
//! sessions through `access`.

use std::sync::Arc;
use std::time::Duration;
use vmm::session::Session;
use vmm::session_file;

use crate::core::durable::{Paused, StateDir, from_epoch_ms};
use crate::core::sessions::{Ended, Entry, NewSession, Unavailable};
use crate::core::state::AppState;
use crate::service::admission::{self, check_count, check_memory};
use crate::service::error::{Error, unavailable};
use crate::service::templates;

/// Releases a claimed resume when dropped.
struct Claim<'a>(&'a StateDir, &'a str);

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.0.release_resume(self.1);
    }
}

/// Session `id`, running: at once if it is, after resuming it if it is paused (module
/// docs); otherwise why not. Its processes' pump is not started here: the caller does
/// that (`service::durable::resume`), or the next process call does.
pub async fn resume(state: &AppState, id: &str) -> Result<Arc<Entry>, Error> {
    let Some(dir) = state.state_dir().cloned() else {
        return state.sessions().get(id).map_err(|u| unavailable(id, u));
    };
    loop {
        let resumed = dir.resumed.notified();
        tokio::pin!(resumed);
        resumed.as_mut().enable();
        match state.sessions().get(id) {
            Ok(e) => return Ok(e),
            Err(Unavailable::Unknown) if dir.paused().get(id).is_some() => {}
            Err(u) => return Err(unavailable(id, u)),
        }
        if dir.claim_resume(id) {
            break;
        }
        resumed.await;
    }
    let _claim = Claim(&dir, id);
    // Resumed by the one before, between the check and the claim.
    let Some(p) = dir.paused().get(id) else {
        return state.sessions().get(id).map_err(|u| unavailable(id, u));
    };
    let exec = executor_of_key(state, &dir, &p.record.template, &p.key).await?;
    check_count(state, 1)?;
    check_memory(state)?;
    let origin = crate::core::audit::Origin::here("resume", &p.record.template, Some(id));
    let started = std::time::Instant::now();
    let st = state.clone();
    let d = dir.clone();
    let e = admission::call(state, move || resume_file(&st, &d, &exec, p)).await??;
    dir.resumes
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let Some(a) = state.audit() {
        a.lifecycle(&origin, "resume", started.elapsed(), None);
    }
    Ok(e)
}

/// The executor of template `name` as it was when key `key` was made: the served one if
/// the key is its own, else one made (once, then kept) over the template directory of that
/// key, which this server's pins kept (`vmm::Template::pin`) when the template was rebuilt.
/// 410 `unresumable` if that directory is gone.
pub async fn executor_of_key(
    state: &AppState,
    dir: &Arc<StateDir>,
    name: &str,
    key: &str,
) -> Result<Arc<vmm::Executor>, Error> {
    let exec = templates::served_executor(state, name)?;
    if exec.template().key() == key {
        return Ok(exec);
    }
    if let Some(old) = dir.old_executor(key) {
        return Ok(old);
    }
    let Some(path) = exec.template().dir().parent().map(|root| root.join(key)) else {
        return Err(Error::internal("a template directory has no parent"));
    };
    // Not on a job thread: an executor starts threads of its own, which a job thread's
    // jail forbids.
    let owned = name.to_owned();
    let made = tokio::task::spawn_blocking(move || {
        let name = owned;
        let t = vmm::Template::load(&path).map_err(|e| {
            format!(
                "made on template {name} as it was (key {}), which is no longer on disk: {e}",
                path.file_name()
                    .map(|n| n.to_string_lossy())
                    .unwrap_or_default()
            )
        })?;
        let opts = vmm::ExecutorOptions {
            pool_size: 0,
            ..vmm::ExecutorOptions::default()
        };
        vmm::Executor::new(t, opts).map_err(|e| e.to_string())
    })
    .await
    .map_err(Error::internal)?;
    match made {
        Ok(e) => {
            let e = Arc::new(e);
            dir.keep_old_executor(key, e.clone());
            Ok(e)
        }
        Err(why) => Err(Error::Unresumable {
            id: name.to_owned(),
            why,
        }),
    }
}

/// Removes this state directory's pin of template `key` (made by `exec`'s template root)
/// once no paused session or snapshot here needs it.
pub fn unpin_if_unneeded(dir: &StateDir, exec: &vmm::Executor, key: &str) {
    if !dir.needs(key)
        && let Some(root) = exec.template().dir().parent()
    {
        vmm::Template::unpin(&root.join(key), dir.holder());
    }
}

/// Removes paused session `id`'s file, if it has one: its template key unpinned where
/// nothing else here needs it, its trace ended with `reason` and `detail`. The record it
/// had, or None.
pub fn remove_paused(
    state: &AppState,
    dir: &StateDir,
    id: &str,
    reason: &str,
    detail: &str,
) -> Option<Paused> {
    let p = dir.paused().remove(id)?;
    if let Ok(exec) = templates::served_executor(state, &p.record.template) {
        unpin_if_unneeded(dir, &exec, &p.key);
    }
    if let Some(t) = state.traces() {
        t.end(id, reason, Some(detail));
    }
    Some(p)
}

/// Makes paused session `p` again on `exec` (on a job thread).
fn resume_file(
    state: &AppState,
    dir: &StateDir,
    exec: &Arc<vmm::Executor>,
    p: Paused,
) -> Result<Arc<Entry>, Error> {
    let r = p.record;
    let p_key = p.key;
    let id = r.id.clone();
    let loaded = session_file::read(&dir.paused().path(&id), dir.keys())
        .and_then(|f| {
            if !p.written_here {
                f.verify_pages()?;
            }
            Ok(f)
        })
        .map_err(|e| e.to_string())
        .and_then(|f| Session::load(exec, &f, false).map_err(|e| e.to_string()));
    let vm = match loaded {
        Ok(vm) => vm,
        Err(why) => {
            dir.set_aside_paused(&id);
            state.sessions().tombstone(
                &id,
                Ended {
                    reason: "unresumable".into(),
                    detail: Some(why.clone()),
                },
            );
            return Err(Error::Unresumable { id, why });
        }
    };
    let (idle_timeout, max_lifetime) = clamp(state, &r);
    let settings = NewSession {
        language: r.language,
        dialect: r.dialect,
        env: r.env,
        idle_timeout,
        max_lifetime,
        metadata: r.metadata,
        parent: r.parent,
        template: r.template,
        engine: crate::core::engine::vmm::engine(exec),
        auto_pause: r.auto_pause,
        again: Some((id.clone(), from_epoch_ms(r.created_at_ms))),
        network: crate::service::network::restored(state, exec, r.network.as_ref()),
        owner: r.owner,
    };
    let e = state
        .sessions()
        .insert(settings, crate::core::engine::vmm::session(vm, exec))
        .map_err(Error::internal)?;
    e.keep_record(r.attachment);
    *e.contexts() = r.contexts;
    for proc_ in &r.processes {
        e.processes.add(proc_.info());
    }
    for (id, path) in &r.watches {
        e.processes.add_watch(*id, path);
    }
    dir.paused().remove(&id);
    unpin_if_unneeded(dir, exec, &p_key);
    e.account();
    Ok(e)
}

/// A resumed session's idle timeout and lifetime under this server's limits (a file
/// written under looser flags, or before imports were checked against them, gets today's).
fn clamp(state: &AppState, r: &crate::core::durable::SessionRecord) -> (Duration, Duration) {
    let lim = &state.config().sessions;
    let idle = r.idle_timeout_s.clamp(1, lim.max_idle_timeout_s);
    let now = crate::core::durable::epoch_ms(std::time::SystemTime::now());
    let life_ms = u64::try_from(r.lifetime_left_at(now).as_millis())
        .unwrap_or(u64::MAX)
        .clamp(1000, lim.max_lifetime_s.saturating_mul(1000));
    (Duration::from_secs(idle), Duration::from_millis(life_ms))
}
