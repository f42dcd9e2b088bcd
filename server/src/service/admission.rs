//! Admission and the way to a job thread: the one place that decides whether work may
//! enter (the audit log, the memory budget, the server's and the API key's capacity, the
//! caps on sessions: [`check_count`], [`check_memory`]) and
//! that hands it to a job thread ([`crate::core::jobs`]) with a channel back.
//!
//! Work on a job thread answers through a [`Reply`], which it may send before it is done
//! (a one-shot job's result goes out before its VM is reset for the next job).

use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::core::jobs::{AdmitError, CancelOnDrop, Slot};
use crate::core::metrics::Rejection;
use crate::core::state::AppState;
use crate::service::error::Error;

/// `n` admission slots for the current request's key, all or none.
pub fn admit(state: &AppState, n: usize) -> Result<Vec<Slot>, Error> {
    if let Some(a) = state.audit()
        && a.refuses_jobs()
    {
        return Err(Error::AuditUnavailable(
            a.state.last_error().unwrap_or_default(),
        ));
    }
    if let Some(budget) = state.config().memory_budget_bytes {
        let used = crate::core::metrics::private_bytes();
        if used > budget {
            state.metrics().rejected(Rejection::MemoryBudget);
            return Err(Error::MemoryBudget {
                used,
                budget,
                retry_after: state.config().retry_after(),
            });
        }
    }
    let client = crate::core::audit::current_key().map(std::sync::Arc::from);
    state.jobs().admit(client, n).map_err(|e| refused(state, e))
}

fn refused(state: &AppState, e: AdmitError) -> Error {
    let retry_after = state.config().retry_after();
    match e {
        AdmitError::Full(capacity) => {
            state.metrics().rejected(Rejection::Overloaded);
            Error::Overloaded {
                capacity,
                retry_after,
            }
        }
        AdmitError::Quota { key, quota } => {
            state.metrics().rejected(Rejection::KeyQuota);
            Error::KeyQuota {
                key,
                quota,
                retry_after,
            }
        }
        AdmitError::Closed => {
            state.metrics().rejected(Rejection::ShuttingDown);
            Error::ShuttingDown
        }
    }
}

/// The answer channel of work on a job thread.
#[derive(Debug)]
pub struct Reply<R> {
    tx: oneshot::Sender<R>,
    queued_at: Instant,
    started: Instant,
}

impl<R> Reply<R> {
    /// How long the work waited for a job thread.
    pub fn waited(&self) -> Duration {
        self.started.duration_since(self.queued_at)
    }

    /// Whoever asked has gone away (its request was dropped): the answer has no reader.
    pub fn caller_gone(&self) -> bool {
        self.tx.is_closed()
    }

    pub fn send(self, answer: R) {
        let _ = self.tx.send(answer);
    }
}

/// Runs `work` on a job thread in `slot`; the receiver gets what it sends (nothing if it
/// panicked: the job thread logs that).
pub fn spawn<R: Send + 'static>(
    state: &AppState,
    slot: Slot,
    work: impl FnOnce(Reply<R>) + Send + 'static,
) -> Result<oneshot::Receiver<R>, Error> {
    let (tx, rx) = oneshot::channel();
    let queued_at = Instant::now();
    state
        .jobs()
        .spawn(slot, move || {
            work(Reply {
                tx,
                queued_at,
                started: Instant::now(),
            });
        })
        .map_err(|e| refused(state, e))?;
    Ok(rx)
}

/// Work on its way to or on a job thread: its answer, and the handle that cancels its job if
/// this is dropped before the answer came (the caller went away).
#[derive(Debug)]
pub struct Pending<T> {
    rx: oneshot::Receiver<Result<T, Error>>,
    cancel: CancelOnDrop,
}

impl<T> Pending<T> {
    pub fn new(rx: oneshot::Receiver<Result<T, Error>>, cancel: CancelOnDrop) -> Self {
        Self { rx, cancel }
    }

    /// The answer; nothing is cancelled once it came.
    pub async fn finish(mut self) -> Result<T, Error> {
        let answer = self.rx.await;
        self.cancel.disarm();
        answer.map_err(|_| lost())?
    }
}

/// What a job thread that dropped its reply leaves the caller.
pub fn lost() -> Error {
    Error::internal("the job thread lost the request (a bug of bud's: see the server log)")
}

/// Admits one piece of work, runs `work` on a job thread and awaits what it returns.
pub async fn call<R: Send + 'static>(
    state: &AppState,
    work: impl FnOnce() -> R + Send + 'static,
) -> Result<R, Error> {
    let slot = admit(state, 1)?.remove(0);
    spawn(state, slot, move |reply| reply.send(work()))?
        .await
        .map_err(|_| lost())
}

/// Refuses new work (a one-shot job, a new session, an import) while the node drains
/// (`crate::service::drain`); requests for the sessions it holds go on.
pub fn check_open(state: &AppState) -> Result<(), Error> {
    let node = state.node();
    if node.draining() {
        return Err(Error::Draining {
            node: node.id().to_owned(),
        });
    }
    Ok(())
}

/// The memory cap, before a session is made or forked.
pub fn check_memory(state: &AppState) -> Result<(), Error> {
    let limit = state.config().sessions.max_memory_bytes;
    let used = state.sessions().memory_bytes();
    if used >= limit {
        return Err(Error::OutOfMemory { used, limit });
    }
    Ok(())
}

/// The live-session cap, before `more` sessions are made.
pub fn check_count(state: &AppState, more: usize) -> Result<(), Error> {
    let limit = state.config().sessions.max_sessions;
    if state.sessions().count() + more > limit {
        return Err(Error::TooManySessions {
            limit,
            retry_after: state.config().retry_after(),
        });
    }
    Ok(())
}
