//! The way to a session's VM for one request: take the session (at once if it is free,
//! else after the requests before it), find it, and end it when a request left its VM
//! unusable. Below [`super::sessions`] (the session's life: start, cell, fork, end) and
//! [`super::processes`] (its background processes), which both take sessions this way.

use std::sync::Arc;
use std::time::Duration;

use vmm::{Health, Status, Unusable};

use crate::core::sessions::{Busy, Ended, Entry, Unavailable};
use crate::core::state::AppState;
use crate::service::error::Error;

pub use crate::service::error::unavailable;

/// Session `id` for a request: at once if it is free, else after the requests before it
/// (at most `--session-max-waiting` wait at once).
/// A paused session is resumed first ([`crate::service::durable::resume`]).
pub async fn acquire(state: &AppState, id: &str) -> Result<Busy, Error> {
    let max = state.config().sessions.max_waiting;
    loop {
        match state.sessions().acquire_waiting(id, max).await {
            Ok(busy) => return Ok(busy),
            Err(Unavailable::Unknown)
                if state
                    .state_dir()
                    .is_some_and(|d| d.paused().get(id).is_some()) =>
            {
                // Paused (maybe just now, while this request waited): resumed, then taken.
                Box::pin(crate::service::resume::resume(state, id)).await?;
            }
            Err(u) => return Err(unavailable(id, u)),
        }
    }
}

/// How long a request that may go beside waits for the session before it looks again
/// for a lane (the request holding the session may not have reached its VM yet).
const BESIDE_RECHECK: Duration = Duration::from_millis(50);

/// How a request that may go beside another got its way ([`beside_or_acquire`]).
#[derive(Debug)]
pub enum Taken<R> {
    /// It ran beside the request the session runs: its result.
    Beside(R),
    /// The session itself, for the request to run on its VM.
    Held(Busy),
}

/// Session `id` for a request that may run beside the one the session runs
/// ([`vmm::beside`]; `processes`: a process operation, which goes only beside a cell):
/// `op` runs in the lane as soon as one is open for it (None from `op`: it did not run
/// there after all, [`vmm::session::SessionError::not_beside`]), or else the session is
/// taken as by [`acquire`]. While it waits for the session it looks for a lane again every
/// [`BESIDE_RECHECK`]: a cell that holds the session before its VM runs it opens one soon.
pub async fn beside_or_acquire<R, F>(
    state: &AppState,
    id: &str,
    processes: bool,
    op: Arc<F>,
) -> Result<Taken<R>, Error>
where
    R: Send + 'static,
    F: Fn(&mut vmm::beside::Beside, &vmm::Executor) -> Option<R> + Send + Sync + 'static,
{
    loop {
        let Ok(e) = get(state, id) else {
            // Paused (resumed here) or gone (its error).
            return acquire(state, id).await.map(Taken::Held);
        };
        let o = op.clone();
        if let Some(Some(r)) = beside(&e, processes, move |lane, ex| o(lane, ex)).await {
            return Ok(Taken::Beside(r));
        }
        let max = state.config().sessions.max_waiting;
        // Not `acquire`: a resume must never be dropped half way by the timer.
        tokio::select! {
            got = state.sessions().acquire_waiting(id, max) => return match got {
                Ok(busy) => Ok(Taken::Held(busy)),
                Err(Unavailable::Unknown) => acquire(state, id).await.map(Taken::Held),
                Err(u) => Err(unavailable(id, u)),
            },
            () = tokio::time::sleep(BESIDE_RECHECK) => {}
        }
    }
}

/// Runs `op` beside the request session `e` runs now, if one runs that takes it
/// ([`vmm::beside`]; `processes`: a process operation), on the blocking pool (it only
/// waits for the guest's answer: no job thread). None: nothing runs that takes it, so it
/// must run as the session's own request. A result that says it did not run there after
/// all ([`vmm::session::SessionError::not_beside`]) is the caller's to check.
pub async fn beside<R: Send + 'static>(
    e: &Arc<Entry>,
    processes: bool,
    op: impl FnOnce(&mut vmm::beside::Beside, &vmm::Executor) -> R + Send + 'static,
) -> Option<R> {
    let mut lane = e.beside(processes)?;
    let ex = e.engine.executor()?.clone();
    let r = tokio::task::spawn_blocking(move || op(&mut lane, &ex))
        .await
        .ok()?;
    e.touch();
    Some(r)
}

/// The VMM executor of session `e`, for an operation not behind the engine's seam yet
/// ([`crate::core::engine`]): a session on a test engine has none (its VM is gone, as far
/// as the operation can tell).
pub fn executor(e: &Entry) -> Result<Arc<vmm::Executor>, Error> {
    e.engine
        .executor()
        .cloned()
        .ok_or_else(|| Error::internal(vmm::session::SessionError::Gone))
}

/// Session `id`, live (a paused one is [`Error::Paused`]: the caller that needs it running
/// resumes it with [`acquire`]).
pub fn get(state: &AppState, id: &str) -> Result<Arc<Entry>, Error> {
    state.sessions().get(id).map_err(|u| match u {
        Unavailable::Unknown
            if state
                .state_dir()
                .is_some_and(|d| d.paused().get(id).is_some()) =>
        {
            Error::Paused(id.to_owned())
        }
        u => unavailable(id, u),
    })
}

/// Ends the session of `busy` if its VM is no longer usable after a request, with why (the
/// VM's own [`Health`]: the one answer the executor and sessions read).
pub fn end_if_unusable(state: &AppState, busy: &Busy) {
    let e = busy.entry();
    let health = e
        .with_vm(|s| s.health())
        .unwrap_or(Health::Discard(Unusable::Failed(
            "the session's VM is gone".into(),
        )));
    let Health::Discard(why) = health else {
        return;
    };
    let stopped = |reason, after| {
        let detail = format!("the cell did not stop within the grace period after {after}");
        (reason, detail)
    };
    let (reason, detail) = match &why {
        Unusable::Stopped(Status::Timeout) => stopped("timeout", "its interrupt"),
        Unusable::Stopped(Status::Cancelled) => stopped("cancelled", "it was cancelled"),
        Unusable::Stopped(Status::OutputLimit) => {
            stopped("output_limit", "its output reached the cap")
        }
        _ => ("crashed", why.to_string()),
    };
    // The 410s that follow carry the last console lines too.
    let last = e.with_vm(|s| s.console_tail(5)).unwrap_or_default();
    let detail = if reason == "crashed" && !last.is_empty() {
        Some(format!("{detail}; console: {}", last.join(" | ")))
    } else {
        Some(detail)
    };
    state.sessions().end(
        &e.id,
        Ended {
            reason: reason.into(),
            detail,
        },
    );
}
