//! The way to a session's VM for one request: take the session (at once if it is free,
//! else after the requests before it), find it, and end it when a request left its VM
//! unusable. Below [`super::sessions`] (the session's life: start, cell, fork, end) and
//! [`super::processes`] (its background processes), which both take sessions this way.

use std::sync::Arc;

use vmm::{Health, Status, Unusable};

use crate::service::error::Error;
use crate::sessions::{Busy, Ended, Entry, Unavailable};
use crate::state::AppState;

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
                if state.state_dir().is_some_and(|d| d.paused(id).is_some()) =>
            {
                // Paused (maybe just now, while this request waited): resumed, then taken.
                Box::pin(crate::service::resume::resume(state, id)).await?;
            }
            Err(u) => return Err(unavailable(id, u)),
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
    let ex = e.executor.clone();
    let r = tokio::task::spawn_blocking(move || op(&mut lane, &ex))
        .await
        .ok()?;
    e.touch();
    Some(r)
}

/// Session `id`, live (a paused one is [`Error::Paused`]: the caller that needs it running
/// resumes it with [`acquire`]).
pub fn get(state: &AppState, id: &str) -> Result<Arc<Entry>, Error> {
    state.sessions().get(id).map_err(|u| match u {
        Unavailable::Unknown if state.state_dir().is_some_and(|d| d.paused(id).is_some()) => {
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
        .with_vm(|s| s.health().clone())
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
