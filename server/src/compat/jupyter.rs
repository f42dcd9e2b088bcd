//! E2B's code-interpreter API (`/execute`, `/contexts`) over session cells.
//!
//! `POST /execute` runs a cell in the sandbox's session and streams NDJSON as E2B's
//! code-interpreter server does: `stdout` / `stderr` lines (`text`, `timestamp`) as the
//! output comes, then one `result` per figure the cell showed (`png`), the cell's displayed
//! value as the main result (`text`, and what its `_repr_*_` methods give: `html`,
//! `markdown`, `svg`, `png`, `jpeg`, `pdf`, `latex`, `json`, `javascript`;
//! `is_main_result: true`), an `error`
//! (`name`, `value`, `traceback`) when the cell raised, `number_of_executions`, and
//! `end_of_execution`. Python cells report their exception in the display data
//! (`vmm::CellOptions::error_in_display`), not as a traceback on stderr, as Jupyter does.
//! A cell that ends otherwise than by an exception (a non-zero `SystemExit`, a shell cell's
//! exit status, a timeout past the interrupt, the output cap) gets an `error` line named
//! after how it ended.
//!
//! Contexts: `context_id` picks a context made by `POST /contexts` (its own Python
//! namespace, `vmm::CellOptions::namespace`); without one, `language` `python` (default) is
//! the session's `__main__` and `bash` / `sh` runs a shell cell. Restarting a context empties
//! its namespace; deleting one empties it and forgets it. A cell's time limit is the
//! server's `max_timeout_ms` (E2B's own limit is the client's HTTP timeout).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::Deserialize;
use serde_json::json;
use vmm::job::Stream;
use vmm::{CellOptions, Language, Status};

use super::Compat;
use super::e2b::{Context, e2b_error, sandbox_of};
use crate::api::{CellResponse, ExecRequest};
use crate::error::{ApiError, Error};
use crate::service::{sessions, task};

/// The default context's id in `GET /contexts`.
pub const DEFAULT_CONTEXT: &str = "default";
/// The sandbox's home, as E2B names it (a link to bud's work directory, /tmp).
pub const HOME: &str = "/home/user";

#[derive(Debug, Deserialize)]
pub struct ExecuteRequest {
    pub code: String,
    pub context_id: Option<String>,
    pub language: Option<String>,
    pub env_vars: Option<BTreeMap<String, String>>,
}

/// How a cell runs: its language and namespace.
fn target(
    contexts: &super::e2b::Contexts,
    req: &ExecuteRequest,
) -> Result<(Language, u32), ApiError> {
    let language = match req.context_id.as_deref() {
        Some(DEFAULT_CONTEXT) => "python",
        Some(id) => {
            let c = contexts
                .made
                .get(id)
                .ok_or_else(|| ApiError::NotFound(format!("context {id} not found")))?;
            return Ok((language_of(&c.language)?, c.namespace));
        }
        None => req.language.as_deref().unwrap_or("python"),
    };
    Ok((language_of(language)?, 0))
}

fn language_of(name: &str) -> Result<Language, Error> {
    match name {
        "python" | "python3" => Ok(Language::Python),
        "bash" | "sh" => Ok(Language::Shell),
        other => Err(Error::invalid(
            "language",
            format!("bud runs python and bash (busybox sh) code, not {other}"),
        )),
    }
}

fn micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// What the cell's task sends to the response body.
enum Event {
    Output(Stream, Vec<u8>),
    End(Box<Result<CellResponse, Error>>, Language),
}

/// Turns events into E2B's NDJSON lines, holding back characters split between chunks.
#[derive(Default)]
struct Lines {
    held: [Vec<u8>; 2],
}

impl Lines {
    fn text(&mut self, s: Stream, bytes: &[u8], out: &mut Vec<u8>, last: bool) {
        let held = &mut self.held[s as usize];
        held.extend_from_slice(bytes);
        let cut = if last {
            held.len()
        } else {
            held.len() - crate::stream::incomplete_tail(held)
        };
        let ready: Vec<u8> = held.drain(..cut).collect();
        if ready.is_empty() {
            return;
        }
        let kind = match s {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        };
        push(
            out,
            json!({"type": kind, "text": String::from_utf8_lossy(&ready), "timestamp": micros_now()}),
        );
    }

    fn encode(&mut self, ev: Event) -> Bytes {
        let mut out = Vec::new();
        match ev {
            Event::Output(s, bytes) => self.text(s, &bytes, &mut out, false),
            Event::End(r, language) => {
                self.text(Stream::Stdout, &[], &mut out, true);
                self.text(Stream::Stderr, &[], &mut out, true);
                match *r {
                    Ok(cell) => end_lines(&cell, language, &mut out),
                    Err(e) => push(
                        &mut out,
                        json!({"type": "error", "name": "SandboxError", "value": e.to_string(), "traceback": ""}),
                    ),
                }
                push(&mut out, json!({"type": "end_of_execution"}));
            }
        }
        Bytes::from(out)
    }
}

fn push(out: &mut Vec<u8>, v: serde_json::Value) {
    let _ = serde_json::to_writer(&mut *out, &v);
    out.push(b'\n');
}

/// The lines after a cell's output: figures, main result, error, execution count.
fn end_lines(cell: &CellResponse, language: Language, out: &mut Vec<u8>) {
    for f in &cell.exec.results {
        if f.mime == "image/png" {
            push(
                out,
                json!({"type": "result", "png": f.data_b64, "is_main_result": false}),
            );
        }
    }
    if let Some(shown) = &cell.result {
        let mut line = json!({"type": "result", "is_main_result": true});
        for (mime, key) in [
            ("text/plain", "text"),
            ("text/html", "html"),
            ("text/markdown", "markdown"),
            ("image/svg+xml", "svg"),
            ("image/png", "png"),
            ("image/jpeg", "jpeg"),
            ("application/pdf", "pdf"),
            ("text/latex", "latex"),
            ("application/javascript", "javascript"),
        ] {
            if let Some(v) = shown.get(mime) {
                line[key] = json!(v);
            }
        }
        // JSON comes as JSON text from the guest; E2B's clients get the value.
        if let Some(v) = shown
            .get("application/json")
            .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok())
        {
            line["json"] = v;
        }
        push(out, line);
    }
    let r = &cell.exec;
    let error = match (&cell.error, r.status) {
        (Some(e), _) => Some((e.name.clone(), e.value.clone(), e.traceback.clone())),
        (None, Status::Ok) => None,
        (None, Status::Error) => Some(match (language, r.exit_code) {
            (Language::Python, Some(code)) => {
                ("SystemExit".into(), code.to_string(), String::new())
            }
            (_, code) => (
                "CommandExitError".into(),
                match (code, r.signal) {
                    (Some(c), _) => format!("exit status {c}"),
                    (None, Some(s)) => format!("killed by signal {s}"),
                    _ => "failed".into(),
                },
                String::new(),
            ),
        }),
        (None, status) => {
            let name = match status {
                Status::Timeout => "TimeoutError",
                Status::OutputLimit => "OutputLimitError",
                Status::MemoryLimit => "MemoryError",
                _ => "SandboxCrashed",
            };
            let why = r.crash.clone().unwrap_or_else(|| format!("{status:?}"));
            Some((name.into(), why, String::new()))
        }
    };
    if let Some((name, value, traceback)) = error {
        push(
            out,
            json!({"type": "error", "name": name, "value": value, "traceback": traceback}),
        );
    }
    push(
        out,
        json!({"type": "number_of_executions", "execution_count": cell.execution_count}),
    );
}

/// `POST /execute`.
pub async fn execute(State(c): State<Compat>, headers: HeaderMap, body: Bytes) -> Response {
    start_execute(c, headers, body)
        .await
        .unwrap_or_else(e2b_error)
}

async fn start_execute(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (s, e) = sandbox_of(&c, &headers)?;
    let state = c.app;
    let req: ExecuteRequest = serde_json::from_slice(&body)
        .map_err(|err| ApiError::invalid("body", format!("bad JSON body: {err}")))?;
    let (language, namespace) = {
        let contexts = s.contexts.lock().unwrap_or_else(|p| p.into_inner());
        target(&contexts, &req)?
    };
    let native = ExecRequest {
        language: Some(language),
        code: Some(req.code),
        env: req.env_vars.unwrap_or_default(),
        timeout_ms: Some(state.config().limits.max_timeout_ms),
        cell: CellOptions {
            namespace,
            reset: false,
            error_in_display: true,
        },
        stream: true,
        ..ExecRequest::default()
    };
    // The audit trail names the key that made the sandbox (its routes carry no API key).
    let key = s.key.clone();
    let end = move |r: Result<sessions::Cell, Error>| {
        let r = r.map(|c| CellResponse::new(c.result, c.waited, c.execution_count, false));
        Event::End(Box::new(r), language)
    };
    let id = e.id.clone();
    let mut rx = task::spawn(key, Event::Output, end, move |sink| async move {
        sessions::cell(&state, &id, native, "/execute", sink).await
    });
    // The first event decides the status: a cell that could not run is an HTTP error.
    let first = task::first(&mut rx, |ev| match ev {
        Event::End(r, l) => (*r).map(|ok| Event::End(Box::new(Ok(ok)), l)),
        ev => Ok(ev),
    })
    .await?;
    let lines = stream::unfold(
        (Some(first), rx, Lines::default()),
        |(pending, mut rx, mut enc)| async move {
            let ev = match pending {
                Some(ev) => ev,
                None => rx.recv().await?,
            };
            Some((Ok::<_, Infallible>(enc.encode(ev)), (None, rx, enc)))
        },
    );
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

fn context_json(c: &Context) -> serde_json::Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

#[derive(Debug, Default, Deserialize)]
pub struct NewContext {
    pub language: Option<String>,
    pub cwd: Option<String>,
}

/// `POST /contexts`: a new context with its own namespace.
pub async fn create_context(State(c): State<Compat>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let (s, _) = sandbox_of(&c, &headers)?;
        let req: NewContext = if body.is_empty() {
            NewContext::default()
        } else {
            serde_json::from_slice(&body)
                .map_err(|err| ApiError::invalid("body", format!("bad JSON body: {err}")))?
        };
        let language = req.language.unwrap_or_else(|| "python".into());
        language_of(&language)?;
        let cwd = req.cwd.unwrap_or_else(|| HOME.into());
        let mut contexts = s.contexts.lock().unwrap_or_else(|p| p.into_inner());
        let c = contexts.add(&language, &cwd)?;
        Ok(Json(context_json(&c)).into_response())
    };
    run().unwrap_or_else(e2b_error)
}

/// `GET /contexts`: the default context, then those made.
pub async fn list_contexts(State(c): State<Compat>, headers: HeaderMap) -> Response {
    let run = || -> Result<Response, ApiError> {
        let (s, _) = sandbox_of(&c, &headers)?;
        let contexts = s.contexts.lock().unwrap_or_else(|p| p.into_inner());
        let mut all = vec![json!({"id": DEFAULT_CONTEXT, "language": "python", "cwd": HOME})];
        all.extend(contexts.made.values().map(context_json));
        Ok(Json(all).into_response())
    };
    run().unwrap_or_else(e2b_error)
}

/// Empties context `id`'s namespace with an empty cell (and forgets it if `forget`).
async fn reset(c: Compat, headers: HeaderMap, id: String, forget: bool) -> Response {
    let run = async {
        let (s, e) = sandbox_of(&c, &headers)?;
        let namespace = if id == DEFAULT_CONTEXT {
            if forget {
                return Err(ApiError::invalid(
                    "id",
                    "the default context cannot be removed",
                ));
            }
            0
        } else {
            let contexts = s.contexts.lock().unwrap_or_else(|p| p.into_inner());
            let c = contexts
                .made
                .get(&id)
                .ok_or_else(|| ApiError::NotFound(format!("context {id} not found")))?;
            c.namespace
        };
        let native = ExecRequest {
            code: Some(String::new()),
            cell: CellOptions {
                namespace,
                reset: true,
                error_in_display: true,
            },
            ..ExecRequest::default()
        };
        let reset = sessions::cell(&c.app, &e.id, native, "/contexts", task::no_sink());
        crate::audit::KEY.scope(s.key.clone(), reset).await?;
        if forget {
            s.contexts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .made
                .remove(&id);
        }
        Ok(StatusCode::NO_CONTENT.into_response())
    };
    run.await.unwrap_or_else(e2b_error)
}

/// `POST /contexts/{id}/restart`: its namespace emptied.
pub async fn restart_context(
    State(c): State<Compat>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    reset(c, headers, id, false).await
}

/// `DELETE /contexts/{id}`.
pub async fn remove_context(
    State(c): State<Compat>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    reset(c, headers, id, true).await
}
