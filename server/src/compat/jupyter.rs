//! E2B's code-interpreter API (`/execute`, `/contexts`) over session cells.
//!
//! `POST /execute` runs a cell in the sandbox's session and streams NDJSON as E2B's
//! code-interpreter server does: `stdout` / `stderr` lines (`text`, `timestamp`) as the
//! output comes, then one `result` per `display()` call and per figure `plt.show()` showed
//! (`png`, `text` and the figure's `chart`), the cell's displayed value as the main result
//! (`text`, and what its `_repr_*_` methods give: `html`, `markdown`, `svg`, `png`, `jpeg`,
//! `pdf`, `latex`, `json` (also a dict or list value), `javascript`, and a DataFrame's
//! columns as `data`; `is_main_result: true`), one `result` per figure left open, an `error`
//! (`name`, `value`, `traceback`) when the cell raised, `number_of_executions`, and
//! `end_of_execution`. Python cells report their exception in the display data
//! (`vmm::CellOptions::error_in_display`), not as a traceback on stderr, as Jupyter does.
//! A cell that ends otherwise than by an exception (a non-zero `SystemExit`, a shell cell's
//! exit status, a timeout past the interrupt, the output cap) gets an `error` line named
//! after how it ended.
//!
//! Contexts: `context_id` picks a context made by `POST /contexts`: a Python or bash
//! context is a kernel of its own (`crate::service::kernels`: a Python interpreter, or a
//! shell whose `cd` and variables carry from cell to cell), a JavaScript one (`js`,
//! `javascript`; named `javascript` as E2B names it) a namespace of the session's Node.js
//! (`crate::service::contexts`). Without one, `language` `python` (default) is the session's
//! `__main__`, `js` / `javascript` the session's main JavaScript namespace (namespace 0,
//! which the native API's JavaScript cells share), and `bash` / `sh` the sandbox's default
//! bash kernel. JavaScript cells report their error in the display data as Python's do, and
//! their value's `text/plain` (`util.inspect`) is the main result. TypeScript (`ts`,
//! `typescript`) runs in the same kernel, stripped of its types: a `ts` context is a
//! namespace of its own, while `ts` cells without a context share namespace 0 with the
//! `js` ones. JavaScript or TypeScript on a template without them is 400 naming the
//! template's runtimes.
//! Restarting a context kills its kernel (the next cell starts a new one) or empties its
//! namespace (the default context's: Python's `__main__`); deleting one does so and forgets
//! it. A cell's time limit is the server's `max_timeout_ms` (E2B's own limit is the
//! client's HTTP timeout).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
use super::e2b::{e2b_error, sandbox_of};
use crate::core::contexts::Context;
use crate::core::state::AppState;
use crate::http::error::{ApiError, Error};
use crate::http::sessions::CellResponse;
use crate::service::jobs::ExecRequest;
use crate::service::{contexts, kernels, sessions, task};

/// The default context's id in `GET /contexts`.
pub const DEFAULT_CONTEXT: &str = "default";
/// The sandbox's home, as E2B names it: bud's work directory, /tmp, mounted there again.
/// Where the default context's cells start, and a new context's without a `cwd`.
pub const HOME: &str = "/home/user";

#[derive(Debug, Deserialize)]
pub struct ExecuteRequest {
    pub code: String,
    pub context_id: Option<String>,
    pub language: Option<String>,
    pub env_vars: Option<BTreeMap<String, String>>,
}

/// Where a cell runs: a context (a made one, or the default bash context), or the
/// session's own namespace 0 (the default Python context, `__main__`; the default
/// JavaScript context, the main namespace of the session's Node.js).
enum Target {
    /// A context run by `contexts::run`: a made one (by id) or the default bash one (None).
    Context(Language, Option<String>),
    /// The session's namespace 0 in this language; for a kernel runtime, the name it was
    /// asked by (`ts` picks the kernel's TypeScript dialect).
    Session(Language, Option<String>),
}

/// Which context `req` asks for in session `id` (an unknown context is 404 here, before
/// the stream starts; a language the template does not run, 400).
fn target(state: &AppState, id: &str, req: &ExecuteRequest) -> Result<Target, Error> {
    Ok(match req.context_id.as_deref() {
        Some(DEFAULT_CONTEXT) => Target::Session(Language::Python, None),
        Some(ctx) => {
            let c = contexts::get(state, id, ctx)?;
            Target::Context(contexts::language(state, id, &c)?, Some(c.id))
        }
        None => {
            let e = crate::service::access::get(state, id)?;
            let asked = req.language.as_deref().unwrap_or("python");
            match contexts::language_of(e.engine.manifest(), asked)? {
                Language::Shell => Target::Context(Language::Shell, None),
                Language::Kernel => Target::Session(Language::Kernel, Some(asked.to_owned())),
                language => Target::Session(language, None),
            }
        }
    })
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
            held.len() - crate::http::stream::incomplete_tail(held)
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

/// Display data keys the guest adds for E2B (`guest/python/bud_session.py`): a DataFrame's
/// columns (E2B's `data`), a figure's chart (E2B's `chart`), both JSON text; everything a
/// cell displayed besides its value, `{"before": [...], "after": [...]}`, each entry a
/// `{MIME: data}` object, a figure's naming its PNG (an index into the figures) under
/// [`FIGURE_KEY`].
const MIME_DATA: &str = "application/vnd.bud.dataframe+json";
const MIME_CHART: &str = "application/vnd.bud.chart+json";
const MIME_OUTPUTS: &str = "application/vnd.bud.outputs+json";
const FIGURE_KEY: &str = "bud/figure";

/// A `result` line from display data (`format(MIME)`), as E2B's server makes one from a
/// Jupyter `display_data` (`main`: false) or `execute_result` (`main`: true).
fn push_result(out: &mut Vec<u8>, format: &dyn Fn(&str) -> Option<String>, main: bool) {
    let mut line = json!({"type": "result", "is_main_result": main});
    if let Some(text) = format("text/plain") {
        // E2B shows a string's repr without its quotes.
        let quoted = text.len() >= 2
            && ((text.starts_with('\'') && text.ends_with('\''))
                || (text.starts_with('"') && text.ends_with('"')));
        line["text"] = json!(if quoted {
            &text[1..text.len() - 1]
        } else {
            &text[..]
        });
    }
    for (mime, key) in [
        ("text/html", "html"),
        ("text/markdown", "markdown"),
        ("image/svg+xml", "svg"),
        ("image/png", "png"),
        ("image/jpeg", "jpeg"),
        ("application/pdf", "pdf"),
        ("text/latex", "latex"),
        ("application/javascript", "javascript"),
    ] {
        if let Some(v) = format(mime) {
            line[key] = json!(v);
        }
    }
    // JSON comes as JSON text from the guest; E2B's clients get the value, spliced in as
    // it is so that its keys keep their order (a DataFrame's columns).
    let raw: Vec<(&str, String)> = [
        ("application/json", "json"),
        (MIME_DATA, "data"),
        (MIME_CHART, "chart"),
    ]
    .into_iter()
    .filter_map(|(mime, key)| Some((key, json_text(&format(mime)?)?)))
    .collect();
    let start = out.len();
    push(out, line);
    if raw.is_empty() {
        return;
    }
    out.truncate(out.len() - 2); // the line's closing "}\n"
    for (key, text) in raw {
        out.extend_from_slice(format!(",\"{key}\":").as_bytes());
        out.extend_from_slice(text.as_bytes());
    }
    out.extend_from_slice(b"}\n");
    debug_assert!(serde_json::from_slice::<serde_json::Value>(&out[start..]).is_ok());
}

/// `text` if it is one JSON value, without line breaks (outside strings they can only be
/// whitespace: JSON strings cannot hold them raw), to go inside an NDJSON line.
fn json_text(text: &str) -> Option<String> {
    serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
    Some(text.replace(['\n', '\r'], ""))
}

/// The `result` line of one entry of the guest's outputs; a figure's PNG is `figures[i]`.
fn push_output(out: &mut Vec<u8>, entry: &serde_json::Value, figures: &[&str]) {
    let png = entry
        .get(FIGURE_KEY)
        .and_then(|i| i.as_u64())
        .and_then(|i| figures.get(i as usize).copied());
    let format = |mime: &str| match (mime, png) {
        ("image/png", Some(png)) => Some(png.to_owned()),
        _ => entry.get(mime).and_then(|v| v.as_str()).map(str::to_owned),
    };
    push_result(out, &format, false);
}

/// The lines after a cell's output: what it displayed (display() calls and figures, as
/// non-main results, in order, around the main result as Jupyter sends them: figures left
/// open come after it), the main result, error, execution count.
fn end_lines(cell: &CellResponse, language: Language, out: &mut Vec<u8>) {
    let figures: Vec<&str> = cell
        .exec
        .results
        .iter()
        .filter(|f| f.mime == "image/png")
        .map(|f| f.data_b64.as_str())
        .collect();
    let outputs = cell
        .result
        .as_ref()
        .and_then(|shown| shown.get(MIME_OUTPUTS))
        .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok());
    let entries = |part: &str| {
        outputs
            .as_ref()
            .and_then(|o| o.get(part))
            .and_then(|v| v.as_array())
            .map(|list| list.as_slice())
            .unwrap_or_default()
    };
    if outputs.is_some() {
        for entry in entries("before") {
            push_output(out, entry, &figures);
        }
    } else {
        // Display data without outputs (too large for the display area): the figures alone.
        for png in &figures {
            push(
                out,
                json!({"type": "result", "png": png, "is_main_result": false}),
            );
        }
    }
    // The value: always has text/plain (the outputs may come without a value).
    if let Some(shown) = cell
        .result
        .as_ref()
        .filter(|s| s.contains_key("text/plain"))
    {
        push_result(out, &|mime| shown.get(mime).cloned(), true);
    }
    for entry in entries("after") {
        push_output(out, entry, &figures);
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
    let target = target(&state, &e.id, &req)?;
    let timeout_ms = state.config().limits.max_timeout_ms;
    let env = req.env_vars.unwrap_or_default();
    // The audit trail names the key that made the sandbox (its routes carry no API key).
    let key = s.key.clone();
    let id = e.id.clone();
    let mut rx = match target {
        Target::Context(language, ctx) => {
            let end = move |r: Result<kernels::Ran, Error>| {
                let r = r
                    .map(|c| CellResponse::new(c.result, Duration::ZERO, c.execution_count, false));
                Event::End(Box::new(r), language)
            };
            let cell = contexts::Cell {
                code: req.code,
                env,
                timeout: Duration::from_millis(timeout_ms),
                stream: true,
            };
            task::spawn(key, Event::Output, end, move |sink| async move {
                let which = match &ctx {
                    Some(ctx) => contexts::Which::Made(ctx),
                    None => contexts::Which::DefaultBash(HOME),
                };
                contexts::run(&state, &id, which, cell, "/execute", sink).await
            })
        }
        Target::Session(language, runtime) => {
            let native = ExecRequest {
                mode: runtime.is_none().then_some(language),
                language: runtime,
                code: Some(req.code),
                env,
                timeout_ms: Some(timeout_ms),
                cell: CellOptions {
                    namespace: 0,
                    reset: false,
                    directory: Some(HOME.into()),
                    error_in_display: true,
                },
                stream: true,
                ..ExecRequest::default()
            };
            let end = move |r: Result<sessions::Cell, Error>| {
                let r = r.map(|c| CellResponse::new(c.result, c.waited, c.execution_count, false));
                Event::End(Box::new(r), language)
            };
            task::spawn(key, Event::Output, end, move |sink| async move {
                sessions::cell(&state, &id, native, "/execute", sink).await
            })
        }
    };
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

/// `POST /contexts`: a new context, with a kernel of its own from its first cell (an empty
/// `cwd` is the home, as E2B's server has it).
pub async fn create_context(State(c): State<Compat>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let (_, e) = sandbox_of(&c, &headers)?;
        let req: NewContext = if body.is_empty() {
            NewContext::default()
        } else {
            serde_json::from_slice(&body)
                .map_err(|err| ApiError::invalid("body", format!("bad JSON body: {err}")))?
        };
        let made = contexts::create(
            &c.app,
            &e.id,
            req.language.as_deref(),
            req.cwd.as_deref(),
            HOME,
        )?;
        Ok(Json(context_json(&made)).into_response())
    };
    run().unwrap_or_else(e2b_error)
}

/// `GET /contexts`: the default context, then those made.
pub async fn list_contexts(State(c): State<Compat>, headers: HeaderMap) -> Response {
    let run = || -> Result<Response, ApiError> {
        let (_, e) = sandbox_of(&c, &headers)?;
        let mut all = vec![json!({"id": DEFAULT_CONTEXT, "language": "python", "cwd": HOME})];
        all.extend(contexts::list(&c.app, &e.id)?.iter().map(context_json));
        Ok(Json(all).into_response())
    };
    run().unwrap_or_else(e2b_error)
}

/// Empties context `id` (and forgets it if `forget`): a made context's kernel is killed
/// (its next cell starts a new one) or its namespace emptied, the default context's
/// namespace (Python's `__main__`) emptied by a cell.
async fn reset(c: Compat, headers: HeaderMap, id: String, forget: bool) -> Response {
    let run = async {
        let (s, e) = sandbox_of(&c, &headers)?;
        if id != DEFAULT_CONTEXT {
            let (app, sid) = (&c.app, &e.id);
            let done = async {
                if forget {
                    contexts::remove(app, sid, &id, "/contexts").await
                } else {
                    contexts::restart(app, sid, &id, "/contexts").await
                }
            };
            crate::core::audit::KEY.scope(s.key.clone(), done).await?;
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        if forget {
            return Err(ApiError::invalid(
                "id",
                "the default context cannot be removed",
            ));
        }
        let native = ExecRequest {
            // Python's, whatever the session's default runtime (`javascript` on `node`).
            mode: Some(Language::Python),
            code: Some(String::new()),
            cell: CellOptions {
                namespace: 0,
                reset: true,
                directory: Some(HOME.into()),
                error_in_display: true,
            },
            ..ExecRequest::default()
        };
        let reset = sessions::cell(&c.app, &e.id, native, "/contexts", task::no_sink());
        crate::core::audit::KEY.scope(s.key.clone(), reset).await?;
        Ok(StatusCode::NO_CONTENT.into_response())
    };
    run.await.unwrap_or_else(e2b_error)
}

/// `POST /contexts/{id}/restart`: its kernel killed, or the default namespace emptied.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(out: &[u8]) -> Vec<serde_json::Value> {
        out.split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).expect("one JSON value a line"))
            .collect()
    }

    #[test]
    fn json_formats_are_spliced_in_their_order_on_one_line() {
        let shown: BTreeMap<String, String> = [
            ("text/plain", "'quoted'"),
            ("application/json", "{\"b\": 1,\n \"a\": 2}"),
            (MIME_DATA, "{\"z\": [1], \"y\": [2]}"),
            (MIME_CHART, "{not json"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let mut out = Vec::new();
        push_result(&mut out, &|m| shown.get(m).cloned(), true);

        let text = String::from_utf8(out.clone()).unwrap();
        assert_eq!(text.matches('\n').count(), 1, "{text}");
        assert!(text.contains(r#""data":{"z": [1], "y": [2]}"#), "{text}");
        let line = &lines(&out)[0];
        assert_eq!(line["text"], "quoted");
        assert_eq!(line["json"], json!({"a": 2, "b": 1}));
        assert_eq!(line["is_main_result"], true);
        assert!(line.get("chart").is_none(), "bad JSON is left out: {line}");
    }

    #[test]
    fn output_entries_take_their_figures_pngs() {
        let outputs = json!({
            "before": [{"text/plain": "1"}, {"text/plain": "<Figure>", FIGURE_KEY: 1}],
            "after": [{"text/plain": "<Figure>", FIGURE_KEY: 0}, {"text/plain": "x", FIGURE_KEY: 9}],
        });
        let entries: Vec<serde_json::Value> = ["before", "after"]
            .iter()
            .flat_map(|p| outputs[p].as_array().unwrap().clone())
            .collect();
        let mut out = Vec::new();
        for e in &entries {
            push_output(&mut out, e, &["AAAA", "BBBB"]);
        }
        let got: Vec<_> = lines(&out)
            .iter()
            .map(|l| {
                (
                    l["text"].clone(),
                    l["png"].clone(),
                    l["is_main_result"].clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (json!("1"), json!(null), json!(false)),
                (json!("<Figure>"), json!("BBBB"), json!(false)),
                (json!("<Figure>"), json!("AAAA"), json!(false)),
                (json!("x"), json!(null), json!(false)),
            ]
        );
    }

    #[test]
    fn a_javascript_cells_value_and_error_map_as_e2bs_js_kernel_gives_them() {
        // The node kernel's display JSON, as a Python cell's: util.inspect of the value.
        let value = br#"{"value": [{"type": "text/plain", "data": "'hi'"}], "figures": []}"#;
        let error = br#"{"value": [], "figures": [], "error": {"name": "ReferenceError", "value": "y is not defined", "traceback": "ReferenceError: y is not defined\n    at cell:1:1"}}"#;
        let object = br#"{"value": [{"type": "text/plain", "data": "{ a: 1 }"}], "figures": []}"#;
        let end = |status, exit_code, display: &[u8]| {
            let r = vmm::JobResult::of_cell(status, exit_code, None, display);
            let mut out = Vec::new();
            end_lines(
                &CellResponse::new(r, Duration::ZERO, 2, false),
                Language::Kernel,
                &mut out,
            );
            lines(&out)
        };
        let count = json!({"type": "number_of_executions", "execution_count": 2});

        assert_eq!(
            end(Status::Ok, Some(0), value),
            [
                json!({"type": "result", "is_main_result": true, "text": "hi"}),
                count.clone()
            ]
        );
        assert_eq!(
            end(Status::Ok, Some(0), object),
            [
                json!({"type": "result", "is_main_result": true, "text": "{ a: 1 }"}),
                count.clone()
            ]
        );
        assert_eq!(
            end(Status::Error, Some(1), error),
            [
                json!({"type": "error", "name": "ReferenceError", "value": "y is not defined",
                       "traceback": "ReferenceError: y is not defined\n    at cell:1:1"}),
                count.clone()
            ]
        );
        // An exit without an error (process.exit(3)) is no SystemExit: it is Python's.
        assert_eq!(
            end(Status::Error, Some(3), b"{}"),
            [
                json!({"type": "error", "name": "CommandExitError", "value": "exit status 3",
                       "traceback": ""}),
                count
            ]
        );
    }
}
