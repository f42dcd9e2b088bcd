//! A session cell whose answer streams (`/v1/sessions/{id}/exec/stream`, E2B's `/execute`,
//! envd's `Process/Start`): the cell runs on a task of its own, its output and its end come
//! as events on a channel the response stream reads, and a client that goes away (the
//! response stream, and so the channel's receiver, dropped) cancels the cell: the task stops
//! waiting for [`session_routes::run_cell`], whose drop cancels it ([`crate::jobs::CancelOnDrop`];
//! a cell is interrupted, so its session stays usable if it stops within the grace).

use tokio::sync::mpsc;
use vmm::job::Stream;

use crate::api::ExecRequest;
use crate::error::ApiError;
use crate::session_routes::{self, CellResponse};
use crate::state::AppState;

/// What a cell that ran or could not run ended with.
pub type CellEnd = Result<CellResponse, ApiError>;

/// Runs `req` as a cell of session `id` on its own task, on behalf of API key `key` (for the
/// audit trail). Its output arrives as `output(stream, bytes)` events, its end as one
/// `end(..)` event, the last. Dropping the receiver cancels the cell.
pub fn spawn<E: Send + 'static>(
    state: AppState,
    id: String,
    req: ExecRequest,
    route: &'static str,
    key: Option<String>,
    output: fn(Stream, Vec<u8>) -> E,
    end: impl FnOnce(CellEnd) -> E + Send + 'static,
) -> mpsc::UnboundedReceiver<E> {
    let (tx, rx) = mpsc::unbounded_channel::<E>();
    let out = tx.clone();
    tokio::spawn(crate::audit::KEY.scope(key, async move {
        let forward = move |s: Stream, bytes: &[u8]| {
            let _ = out.send(output(s, bytes.to_vec()));
        };
        let cell = session_routes::run_cell(&state, &id, req, route, forward);
        tokio::select! {
            r = cell => {
                let _ = tx.send(end(r.map(|(cell, _)| cell)));
            }
            // Nobody reads any more: dropping `cell` cancels it.
            () = tx.closed() => {}
        }
    }));
    rx
}

/// The first event of a cell's channel, which decides the response's status: `split` turns
/// an end event of a cell that could not run into its error (the HTTP error answered
/// instead of a stream), and passes every other event through.
pub async fn first<E>(
    rx: &mut mpsc::UnboundedReceiver<E>,
    split: impl FnOnce(E) -> Result<E, ApiError>,
) -> Result<E, ApiError> {
    let first = rx.recv().await.ok_or_else(|| ApiError::Internal {
        field: None,
        message: "the cell's task ended without an answer".into(),
    })?;
    split(first)
}
