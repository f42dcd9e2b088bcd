//! `POST /v1/exec/stream` and `/v1/sessions/{id}/exec/stream`: a job's (or cell's) output
//! as it comes, as NDJSON (one JSON object a line).
//!
//! The call runs through the service on a task of its own ([`crate::service::task`]),
//! whose sink sends each output chunk down a channel; the response body turns channel
//! messages into lines:
//! - `{"type":"stdout","data":"..."}` and `{"type":"stderr",...}`, with `data_b64` when the
//!   chunk is not valid UTF-8 (or the request set `output_b64`). A multi-byte character split
//!   between two chunks is held back and sent whole with the next one.
//! - then one `{"type":"result", ...}`: the fields of a `POST /v1/exec` answer, with `stdout`
//!   and `stderr` empty (their bytes came as chunks);
//! - or, if bud could not run the job after output had started, `{"type":"error","error":{...}}`.
//!
//! The response starts only with the first message, so a job that cannot run at all still
//! gets a real error status. The channel is unbounded, but a job's output is capped by its
//! `output_limit`, so what waits in it is too.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::Serialize;
use tokio::sync::mpsc;
use vmm::job::Stream;

use crate::core::state::AppState;
use crate::http::body::JsonBody;
use crate::http::error::{ApiError, Error};
use crate::http::jobs::{ExecResponse, text_and_b64};
use crate::http::jobs::{one_shot, response};
use crate::http::sessions::CellResponse;
use crate::service::jobs::ExecRequest;
use crate::service::{jobs, sessions, task};

/// What the call's task sends to the response body.
enum Event {
    Output(Stream, Vec<u8>),
    /// A one-shot job's end.
    Done(Box<Result<ExecResponse, Error>>),
    /// A session cell's end (`POST /v1/sessions/{id}/exec/stream`).
    Cell(Box<Result<CellResponse, Error>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum Line<'a> {
    Stdout {
        data: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    Stderr {
        data: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    Result(&'a ExecResponse),
    #[serde(rename = "result")]
    CellResult(&'a CellResponse),
    Error {
        error: serde_json::Value,
    },
}

/// Number of trailing bytes of `b` that begin a UTF-8 character not yet complete.
pub(crate) fn incomplete_tail(b: &[u8]) -> usize {
    for back in 1..=b.len().min(3) {
        let byte = b[b.len() - back];
        if byte & 0xc0 == 0x80 {
            continue;
        }
        let need = match byte {
            0xc0..=0xdf => 2,
            0xe0..=0xef => 3,
            0xf0..=0xf7 => 4,
            _ => 1,
        };
        return if need > back { back } else { 0 };
    }
    0
}

/// Turns events into NDJSON lines, holding back split characters per stream.
struct Encoder {
    output_b64: bool,
    held: [Vec<u8>; 2],
}

impl Encoder {
    fn chunk_line(&self, s: Stream, bytes: &[u8], out: &mut Vec<u8>) {
        if bytes.is_empty() {
            return;
        }
        let (data, data_b64) = text_and_b64(bytes, self.output_b64);
        let line = match s {
            Stream::Stdout => Line::Stdout { data, data_b64 },
            Stream::Stderr => Line::Stderr { data, data_b64 },
        };
        push_line(out, &line);
    }

    /// Sends what was held back of both streams (the output has ended).
    fn flush_held(&mut self, out: &mut Vec<u8>) {
        for s in [Stream::Stdout, Stream::Stderr] {
            let rest = std::mem::take(&mut self.held[s as usize]);
            self.chunk_line(s, &rest, out);
        }
    }

    fn encode(&mut self, ev: Event) -> Bytes {
        let mut out = Vec::new();
        match ev {
            Event::Output(s, bytes) => {
                let held = &mut self.held[s as usize];
                held.extend_from_slice(&bytes);
                let cut = held.len() - incomplete_tail(held);
                let ready: Vec<u8> = held.drain(..cut).collect();
                self.chunk_line(s, &ready, &mut out);
            }
            Event::Cell(result) => {
                self.flush_held(&mut out);
                match *result {
                    Ok(mut r) => {
                        r.exec.stdout.clear();
                        r.exec.stderr.clear();
                        r.exec.stdout_b64 = None;
                        r.exec.stderr_b64 = None;
                        push_line(&mut out, &Line::CellResult(&r));
                    }
                    Err(e) => {
                        let error = ApiError::from(e).body()["error"].take();
                        push_line(&mut out, &Line::Error { error });
                    }
                }
            }
            Event::Done(result) => {
                self.flush_held(&mut out);
                match *result {
                    Ok(mut r) => {
                        r.stdout.clear();
                        r.stderr.clear();
                        r.stdout_b64 = None;
                        r.stderr_b64 = None;
                        push_line(&mut out, &Line::Result(&r));
                    }
                    Err(e) => {
                        let error = ApiError::from(e).body()["error"].take();
                        push_line(&mut out, &Line::Error { error });
                    }
                }
            }
        }
        Bytes::from(out)
    }
}

fn push_line(out: &mut Vec<u8>, line: &Line<'_>) {
    // Serializing these plain structs cannot fail.
    let _ = serde_json::to_writer(&mut *out, line);
    out.push(b'\n');
}

/// `POST /v1/exec/stream`.
pub async fn exec_stream(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<ExecRequest>,
) -> Result<Response, ApiError> {
    let output_b64 = req.output_b64;
    let mut one = one_shot(&state, req, "/v1/exec/stream", "", false)?;
    one.job.stream_output = true;
    let end =
        |r: Result<jobs::Ran, Error>| Event::Done(Box::new(r.map(|ran| response(ran, false))));
    let key = crate::core::audit::current_key();
    let mut rx = task::spawn(key, Event::Output, end, move |sink| async move {
        jobs::run(&state, one, sink).await
    });
    let first = task::first(&mut rx, split).await?;
    Ok(respond(first, rx, output_b64))
}

/// `POST /v1/sessions/{id}/exec/stream`: a cell's output as it comes, then its result line
/// (the fields of a `POST /v1/sessions/{id}/exec` answer). A cell that cannot run at all
/// (unknown or busy session, bad request) gets its error status instead.
pub async fn session_stream(
    State(state): State<AppState>,
    Path(id): Path<String>,
    JsonBody(mut req): JsonBody<ExecRequest>,
) -> Result<Response, ApiError> {
    let output_b64 = req.output_b64;
    req.stream = true;
    let route = "/v1/sessions/{id}/exec/stream";
    let end = move |r: Result<sessions::Cell, Error>| {
        Event::Cell(Box::new(r.map(|c| {
            CellResponse::new(c.result, c.waited, c.execution_count, output_b64).native()
        })))
    };
    let key = crate::core::audit::current_key();
    let mut rx = task::spawn(key, Event::Output, end, move |sink| async move {
        sessions::cell(&state, &id, req, route, sink).await
    });
    let first = task::first(&mut rx, split).await?;
    Ok(respond(first, rx, output_b64))
}

/// A first event that is the end of a call that failed: its error, answered with its
/// status instead of a stream.
fn split(ev: Event) -> Result<Event, Error> {
    match ev {
        Event::Done(r) => (*r).map(|ok| Event::Done(Box::new(Ok(ok)))),
        Event::Cell(r) => (*r).map(|ok| Event::Cell(Box::new(Ok(ok)))),
        ev => Ok(ev),
    }
}

/// The NDJSON response: `first`, then every event from `rx`, one line each. Dropping it
/// (the client went away) drops `rx`, which cancels the call ([`task`]).
fn respond(first: Event, rx: mpsc::UnboundedReceiver<Event>, output_b64: bool) -> Response {
    let encoder = Encoder {
        output_b64,
        held: [Vec::new(), Vec::new()],
    };
    let lines = stream::unfold(
        (Some(first), rx, encoder),
        |(pending, mut rx, mut enc)| async move {
            let ev = match pending {
                Some(ev) => ev,
                None => rx.recv().await?,
            };
            let line = enc.encode(ev);
            Some((Ok::<_, Infallible>(line), (None, rx, enc)))
        },
    );
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoder() -> Encoder {
        Encoder {
            output_b64: false,
            held: [Vec::new(), Vec::new()],
        }
    }

    #[test]
    fn a_character_split_across_chunks_is_sent_whole() {
        let euro = "€".as_bytes();
        let mut enc = encoder();

        let first = enc.encode(Event::Output(Stream::Stdout, [b"a", &euro[..1]].concat()));
        let second = enc.encode(Event::Output(Stream::Stdout, euro[1..].to_vec()));

        assert_eq!(&first[..], b"{\"type\":\"stdout\",\"data\":\"a\"}\n");
        assert_eq!(
            &second[..],
            "{\"type\":\"stdout\",\"data\":\"€\"}\n".as_bytes()
        );
    }

    #[test]
    fn invalid_bytes_come_with_base64() {
        let mut enc = encoder();

        let line = enc.encode(Event::Output(Stream::Stderr, vec![0xff, b'x']));

        assert_eq!(
            &line[..],
            "{\"type\":\"stderr\",\"data\":\"\u{fffd}x\",\"data_b64\":\"/3g=\"}\n".as_bytes()
        );
    }

    #[test]
    fn incomplete_tails_are_measured() {
        assert_eq!(incomplete_tail(b"abc"), 0);
        assert_eq!(incomplete_tail(&[b'a', 0xe2, 0x82]), 2);
        assert_eq!(incomplete_tail(&[0xe2, 0x82, 0xac]), 0);
        assert_eq!(incomplete_tail(&[0xf0]), 1);
        assert_eq!(incomplete_tail(&[0x80, 0x80, 0x80]), 0);
    }
}
