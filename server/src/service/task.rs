//! A service call whose answer streams: it runs on a task of its own, its output chunks
//! and then its end arrive as events on a channel that the response body reads, and a
//! client that goes away (the response, so the receiver, dropped) cancels it: the task
//! stops waiting for the call, and dropping the call's future cancels its job or cell.
//! Used by `/v1/exec/stream`, `/v1/sessions/{id}/exec/stream`, E2B's `/execute` and
//! envd's `Process/Start`.

use std::future::Future;

use tokio::sync::mpsc;
use vmm::job::Stream;

use crate::service::error::Error;

/// Where a job's output goes as it comes (a stream's channel; or nowhere, `|_, _| {}`: it
/// is in the result anyway).
pub type Sink = Box<dyn FnMut(Stream, &[u8]) + Send>;

/// A sink that drops what it is given.
pub fn no_sink() -> Sink {
    Box::new(|_, _| {})
}

/// Runs `call` on its own task, on behalf of API key `key` (for the audit trail); it is
/// given a sink that sends every output chunk as `output(stream, bytes)`, and what it
/// returns is sent as `end(..)`, the last event. Dropping the receiver cancels it.
pub fn spawn<E, T, F, Fut>(
    key: Option<String>,
    output: fn(Stream, Vec<u8>) -> E,
    end: impl FnOnce(Result<T, Error>) -> E + Send + 'static,
    call: F,
) -> mpsc::UnboundedReceiver<E>
where
    E: Send + 'static,
    F: FnOnce(Sink) -> Fut,
    Fut: Future<Output = Result<T, Error>> + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel::<E>();
    let out = tx.clone();
    let sink: Sink = Box::new(move |s: Stream, bytes: &[u8]| {
        let _ = out.send(output(s, bytes.to_vec()));
    });
    let running = call(sink);
    tokio::spawn(crate::core::audit::KEY.scope(key, async move {
        tokio::select! {
            r = running => {
                let _ = tx.send(end(r));
            }
            // Nobody reads any more: dropping `running` cancels it.
            () = tx.closed() => {}
        }
    }));
    rx
}

/// The first event of a call's channel, which decides the response's status: `split`
/// turns the end event of a call that failed into its error (answered as an HTTP error
/// instead of a stream) and passes every other event through.
pub async fn first<E>(
    rx: &mut mpsc::UnboundedReceiver<E>,
    split: impl FnOnce(E) -> Result<E, Error>,
) -> Result<E, Error> {
    let first = rx
        .recv()
        .await
        .ok_or_else(|| Error::internal("the call's task ended without an answer"))?;
    split(first)
}
