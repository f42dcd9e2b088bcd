//! E2B's in-sandbox daemon (envd) over a session: commands, the filesystem RPCs, `/files`.
//!
//! - **Connect protocol, JSON codec** (what E2B's SDKs speak to envd): a unary call is a
//!   `POST /{service}/{method}` with a JSON body, answered with JSON, or with an HTTP error
//!   status and `{"code", "message"}` (Connect's codes); a server-streaming call
//!   (`process.Process/Start`) sends and receives *envelopes* (1 flag byte, a big-endian
//!   u32 length, the JSON), the last one flagged end-of-stream with `{}` or `{"error"}`.
//! - `process.Process/Start` runs the command as a **shell cell** of the sandbox's session
//!   (the same files and working directory as its Python cells): `/bin/bash -l -c SCRIPT`
//!   (what `sandbox.commands.run` sends) runs SCRIPT in busybox `sh`; any other command
//!   runs as its quoted argv. `envs` and `cwd` apply; the timeout is `Connect-Timeout-Ms`
//!   up to the server's `max_timeout_ms`. Events: `start` (a per-server pid number, not a
//!   guest pid), `data` (stdout / stderr as they come, base64 as proto JSON has bytes),
//!   `end` (`exitCode`, `exited`, `status`). Background processes, stdin, signals, PTYs and
//!   `List`/`Connect` are not implemented (`unimplemented`).
//! - `filesystem.Filesystem`: `Stat`, `ListDir` (depth >= 1), `MakeDir`
//!   (`already_exists` when it does), `Remove`, `Move`; watchers are not implemented.
//! - `GET /files?path=` reads a file; `POST /files` writes files from a multipart form
//!   (field `file`, the path as its filename or `?path=`) or an octet-stream body with
//!   `?path=`, answering `[{"name", "type": "file", "path"}]`.
//! - `GET /health`: 204 while the sandbox runs, 502 once it does not.
//!
//! **Paths**: E2B's home `/home/user` is a link to bud's work directory `/tmp` in the guest
//! image, so code sees the same files under both names. The API accepts paths under either,
//! or relative to the home, and names them under `/home/user` in its answers; any other
//! absolute path is `invalid_argument` (bud's file operations stay in the work directory).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Multipart, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures_util::{StreamExt, stream};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use vmm::job::Stream;
use vmm::protocol::file_op;
use vmm::{Language, Status};

use super::e2b::{e2b_error, rfc3339, sandbox_of};
use super::jupyter::HOME;
use crate::api::ExecRequest;
use crate::error::ApiError;
use crate::session_routes;
use crate::state::AppState;

/// The work directory's other name in the guest.
const WORKDIR: &str = "/tmp";
/// Entries one `ListDir` may return.
const MAX_ENTRIES: usize = 10_000;

/// A guest path relative to the work directory, from an E2B path (module docs).
pub fn guest_path(p: &str) -> Result<String, ApiError> {
    let p = p.trim_end_matches('/');
    let rel = if p.is_empty() || p == HOME || p == WORKDIR {
        "."
    } else if let Some(r) = p
        .strip_prefix(&format!("{HOME}/"))
        .or_else(|| p.strip_prefix(&format!("{WORKDIR}/")))
    {
        r
    } else if p.starts_with('/') {
        return Err(ApiError::invalid(
            "path",
            format!("{p}: bud sandboxes keep files under {HOME} (the same directory as {WORKDIR})"),
        ));
    } else {
        p
    };
    if rel != "." {
        crate::api::check_relative("path", rel)?;
    }
    Ok(rel.to_owned())
}

/// The E2B path of a guest path relative to the work directory.
fn e2b_path(rel: &str) -> String {
    if rel == "." || rel.is_empty() {
        HOME.to_owned()
    } else {
        format!("{HOME}/{}", rel.trim_start_matches("./"))
    }
}

/// Connect's code for a native error.
fn connect_code(e: &ApiError) -> &'static str {
    match e.status().as_u16() {
        400 => "invalid_argument",
        401 => "unauthenticated",
        404 => "not_found",
        409 => "aborted",
        413 | 429 | 507 => "resource_exhausted",
        410 | 502 | 503 => "unavailable",
        501 => "unimplemented",
        _ => "internal",
    }
}

/// A unary Connect error: Connect's HTTP status for the code, `{"code", "message"}`.
fn connect_error(code: &str, message: String) -> Response {
    let status = match code {
        "invalid_argument" => StatusCode::BAD_REQUEST,
        "unauthenticated" => StatusCode::UNAUTHORIZED,
        "not_found" => StatusCode::NOT_FOUND,
        "already_exists" | "aborted" => StatusCode::CONFLICT,
        "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
        "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        "unimplemented" => StatusCode::NOT_IMPLEMENTED,
        "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, Json(json!({"code": code, "message": message}))).into_response()
}

fn from_api(e: ApiError) -> Response {
    connect_error(connect_code(&e), e.to_string())
}

/// `GET /health`.
pub async fn health(State(state): State<AppState>, headers: HeaderMap) -> Response {
    match sandbox_of(&state, &headers) {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e2b_error(e),
    }
}

// ---- files

#[derive(Debug, Deserialize)]
pub struct FileQuery {
    pub path: Option<String>,
}

/// `GET /files?path=`.
pub async fn read_file(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Response {
    let run = async {
        let (_, e) = sandbox_of(&state, &headers)?;
        let path = guest_path(q.path.as_deref().unwrap_or_default())?;
        session_routes::file_request(&state, &e.id, file_op::READ, path, Vec::new()).await
    };
    match run.await {
        Ok(bytes) => (
            [(header::CONTENT_TYPE, "application/octet-stream")],
            Bytes::from(bytes),
        )
            .into_response(),
        Err(e) => e2b_error(e),
    }
}

/// `POST /files`.
pub async fn write_files(
    State(state): State<AppState>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Response {
    match write(&state, q, req).await {
        Ok(written) => Json(written).into_response(),
        Err(e) => e2b_error(e),
    }
}

async fn write(state: &AppState, q: FileQuery, req: Request) -> Result<Vec<Value>, ApiError> {
    let (_, e) = sandbox_of(state, req.headers())?;
    let limit = state.config().sessions.max_file_bytes;
    let too_large = |bytes| ApiError::TooLarge {
        field: "file".into(),
        bytes,
        limit,
    };
    let multipart = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    if multipart {
        let mut form = Multipart::from_request(req, state)
            .await
            .map_err(|err| ApiError::invalid("body", err.body_text()))?;
        while let Some(mut field) = form
            .next_field()
            .await
            .map_err(|err| ApiError::invalid("body", err.body_text()))?
        {
            let name = field
                .file_name()
                .map(str::to_owned)
                .or_else(|| q.path.clone())
                .ok_or_else(|| ApiError::invalid("path", "a file part needs a path"))?;
            let mut data = Vec::new();
            while let Some(chunk) = field
                .chunk()
                .await
                .map_err(|err| ApiError::invalid("body", err.body_text()))?
            {
                data.extend_from_slice(&chunk);
                if data.len() > limit {
                    return Err(too_large(data.len()));
                }
            }
            files.push((name, data));
        }
    } else {
        let path = q
            .path
            .clone()
            .ok_or_else(|| ApiError::invalid("path", "path is required"))?;
        let data = crate::body::read_limited(req.into_body(), limit)
            .await
            .map_err(|err| match err {
                ApiError::BodyTooLarge { limit } => too_large(limit + 1),
                other => other,
            })?;
        files.push((path, data));
    }
    let mut written = Vec::with_capacity(files.len());
    for (path, data) in files {
        let rel = guest_path(&path)?;
        session_routes::file_request(state, &e.id, file_op::WRITE, rel.clone(), data).await?;
        let name = rel.rsplit('/').next().unwrap_or(&rel).to_owned();
        written.push(json!({"name": name, "type": "file", "path": e2b_path(&rel)}));
    }
    Ok(written)
}

// ---- filesystem.Filesystem

/// An EntryInfo of the guest's stat or listing JSON for guest path `rel`.
fn entry_info(rel: &str, st: &Value) -> Value {
    let mode = st["mode"].as_u64().unwrap_or(0) as u32;
    let kind = match mode & 0o170000 {
        0o040000 => "FILE_TYPE_DIRECTORY",
        0o100000 => "FILE_TYPE_FILE",
        0o120000 => "FILE_TYPE_SYMLINK",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let perms: String = {
        let t = match kind {
            "FILE_TYPE_DIRECTORY" => 'd',
            "FILE_TYPE_SYMLINK" => 'l',
            _ => '-',
        };
        let bits = "rwxrwxrwx";
        std::iter::once(t)
            .chain(
                bits.chars()
                    .enumerate()
                    .map(|(i, c)| if mode & (1 << (8 - i)) != 0 { c } else { '-' }),
            )
            .collect()
    };
    let mtime = st["mtime_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
    let mut v = json!({
        "name": st["name"],
        "type": kind,
        "path": e2b_path(rel),
        "size": st["size"].as_u64().unwrap_or(0).to_string(),
        "mode": mode & 0o7777,
        "permissions": perms,
        "owner": "root",
        "group": "root",
        "modifiedTime": rfc3339(mtime),
    });
    if let Some(t) = st["target"].as_str() {
        v["symlinkTarget"] = json!(t);
    }
    v
}

async fn stat(state: &AppState, id: &str, rel: &str) -> Result<Value, ApiError> {
    let out =
        session_routes::file_request(state, id, file_op::STAT, rel.to_owned(), Vec::new()).await?;
    let st: Value = serde_json::from_slice(&out).map_err(|err| ApiError::Internal {
        field: None,
        message: format!("the guest's stat is not JSON: {err}"),
    })?;
    Ok(entry_info(rel, &st))
}

fn field(body: &Value, name: &str) -> Result<String, ApiError> {
    body[name]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ApiError::invalid(name, format!("{name} is required")))
}

/// `POST /filesystem.Filesystem/{method}`.
pub async fn filesystem(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(method): Path<String>,
    body: Bytes,
) -> Response {
    let run = async {
        let (_, e) = sandbox_of(&state, &headers)?;
        let body: Value = serde_json::from_slice(&body)
            .map_err(|err| ApiError::invalid("body", format!("bad JSON body: {err}")))?;
        let id = e.id.as_str();
        let answer = match method.as_str() {
            "Stat" => {
                let rel = guest_path(&field(&body, "path")?)?;
                json!({"entry": stat(&state, id, &rel).await?})
            }
            "ListDir" => {
                let rel = guest_path(&field(&body, "path")?)?;
                let depth = body["depth"].as_u64().unwrap_or(1).max(1);
                json!({"entries": list(&state, id, &rel, depth).await?})
            }
            "MakeDir" => {
                let rel = guest_path(&field(&body, "path")?)?;
                if stat(&state, id, &rel).await.is_ok() {
                    return Ok(connect_error(
                        "already_exists",
                        format!("{} already exists", e2b_path(&rel)),
                    ));
                }
                session_routes::file_request(&state, id, file_op::MKDIR, rel.clone(), Vec::new())
                    .await?;
                json!({"entry": stat(&state, id, &rel).await?})
            }
            "Remove" => {
                let rel = guest_path(&field(&body, "path")?)?;
                session_routes::file_request(&state, id, file_op::DELETE, rel, Vec::new()).await?;
                json!({})
            }
            "Move" => {
                let from = guest_path(&field(&body, "source")?)?;
                let to = guest_path(&field(&body, "destination")?)?;
                session_routes::file_request(
                    &state,
                    id,
                    file_op::MOVE,
                    from,
                    to.clone().into_bytes(),
                )
                .await?;
                json!({"entry": stat(&state, id, &to).await?})
            }
            other => {
                return Ok(connect_error(
                    "unimplemented",
                    format!("filesystem.Filesystem/{other} is not implemented by bud"),
                ));
            }
        };
        Ok::<_, ApiError>(Json(answer).into_response())
    };
    run.await.unwrap_or_else(from_api)
}

/// Entries under `rel` down to `depth` levels, breadth first, at most [`MAX_ENTRIES`].
async fn list(state: &AppState, id: &str, rel: &str, depth: u64) -> Result<Vec<Value>, ApiError> {
    let mut entries = Vec::new();
    let mut level = vec![rel.to_owned()];
    for _ in 0..depth {
        let mut next = Vec::new();
        for dir in level {
            let out =
                session_routes::file_request(state, id, file_op::LIST, dir.clone(), Vec::new())
                    .await?;
            let items: Vec<Value> =
                serde_json::from_slice(&out).map_err(|err| ApiError::Internal {
                    field: None,
                    message: format!("the guest's listing is not JSON: {err}"),
                })?;
            for item in items {
                let name = item["name"].as_str().unwrap_or_default();
                let child = if dir == "." {
                    name.to_owned()
                } else {
                    format!("{dir}/{name}")
                };
                if item["type"] == "dir" {
                    next.push(child.clone());
                }
                entries.push(entry_info(&child, &item));
                if entries.len() >= MAX_ENTRIES {
                    return Ok(entries);
                }
            }
        }
        level = next;
    }
    Ok(entries)
}

// ---- process.Process

/// Pid numbers of started commands (per server, for the `start` event).
static NEXT_PID: AtomicU32 = AtomicU32::new(1000);

/// One Connect envelope: flags, big-endian length, the JSON.
fn envelope(flags: u8, v: &Value) -> Bytes {
    let json = serde_json::to_vec(v).unwrap_or_default();
    let mut out = Vec::with_capacity(5 + json.len());
    out.push(flags);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    Bytes::from(out)
}

/// The JSON message of an enveloped request body (or of a bare JSON one).
fn unwrap_envelope(body: &[u8]) -> Result<Value, ApiError> {
    let json = match body {
        [0, a, b, c, d, rest @ ..] => {
            let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
            rest.get(..len)
                .ok_or_else(|| ApiError::invalid("body", "truncated Connect envelope"))?
        }
        [1, ..] => {
            return Err(ApiError::invalid(
                "body",
                "compressed envelopes are not supported",
            ));
        }
        other => other,
    };
    serde_json::from_slice(json).map_err(|e| ApiError::invalid("body", format!("bad JSON: {e}")))
}

/// Single-quotes `s` for the shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The shell script of a process config (module docs).
fn script_of(process: &Value) -> Result<String, ApiError> {
    let cmd = process["cmd"]
        .as_str()
        .ok_or_else(|| ApiError::invalid("process.cmd", "process.cmd is required"))?;
    let args: Vec<&str> = process["args"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let shell = matches!(cmd.rsplit('/').next(), Some("bash" | "sh" | "ash" | "dash"));
    let dash_c = args.iter().position(|a| *a == "-c");
    let mut script = match (shell, dash_c) {
        (true, Some(i)) if args[..i].iter().all(|a| a.starts_with('-')) => args
            .get(i + 1)
            .ok_or_else(|| ApiError::invalid("process.args", "-c needs a script"))?
            .to_string(),
        _ => std::iter::once(cmd)
            .chain(args.iter().copied())
            .map(quote)
            .collect::<Vec<_>>()
            .join(" "),
    };
    if let Some(cwd) = process["cwd"].as_str().filter(|c| !c.is_empty()) {
        script = format!("cd -- {} || exit 1\n{script}", quote(cwd));
    }
    Ok(script)
}

enum Event {
    Output(Stream, Vec<u8>),
    End(Box<Result<crate::session_routes::CellResponse, ApiError>>),
}

/// `POST /process.Process/{method}`.
pub async fn process(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(method): Path<String>,
    body: Bytes,
) -> Response {
    if method != "Start" {
        return connect_error(
            "unimplemented",
            format!(
                "process.Process/{method} is not implemented by bud (commands run in the foreground)"
            ),
        );
    }
    start(state, headers, body).await.unwrap_or_else(from_api)
}

async fn start(state: AppState, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&state, &headers)?;
    let req = unwrap_envelope(&body)?;
    let process = &req["process"];
    let script = script_of(process)?;
    if req["stdin"].as_bool() == Some(true) || process["pty"].is_object() || req["pty"].is_object()
    {
        return Err(ApiError::invalid(
            "stdin",
            "bud runs commands without stdin or a PTY",
        ));
    }
    let env = process["envs"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    let max = state.config().limits.max_timeout_ms;
    let timeout_ms = headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .map_or(max, |t| t.clamp(1, max));
    let native = ExecRequest {
        language: Some(Language::Shell),
        code: Some(script),
        env,
        timeout_ms: Some(timeout_ms),
        stream: true,
        ..ExecRequest::default()
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
    let out = tx.clone();
    let id = e.id.clone();
    tokio::spawn(async move {
        let forward = move |s: Stream, bytes: &[u8]| {
            let _ = out.send(Event::Output(s, bytes.to_vec()));
        };
        let r = session_routes::run_cell(&state, &id, native, forward).await;
        let _ = tx.send(Event::End(Box::new(r.map(|(cell, _)| cell))));
    });
    let first = rx.recv().await.ok_or_else(|| ApiError::Internal {
        field: None,
        message: "the command's task ended without an answer".into(),
    })?;
    let first = match first {
        Event::End(r) => match *r {
            Err(e) => return Err(e),
            ok => Event::End(Box::new(ok)),
        },
        ev => ev,
    };
    let pid = NEXT_PID.fetch_add(1, Ordering::Relaxed);
    let started = envelope(0, &json!({"event": {"start": {"pid": pid}}}));
    let events = stream::unfold(Some((Some(first), rx)), |st| async move {
        let (pending, mut rx) = st?;
        let ev = match pending {
            Some(ev) => ev,
            None => rx.recv().await?,
        };
        match ev {
            Event::Output(s, bytes) => {
                let key = if s == Stream::Stdout {
                    "stdout"
                } else {
                    "stderr"
                };
                let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
                let msg = envelope(0, &json!({"event": {"data": {key: b64}}}));
                Some((msg, Some((None, rx))))
            }
            Event::End(r) => Some((end_frames(*r), None)),
        }
    });
    let body = stream::once(async move { started })
        .chain(events)
        .map(Ok::<_, Infallible>);
    Ok((
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(body),
    )
        .into_response())
}

/// The `end` event and the end-of-stream envelope of a finished command.
fn end_frames(r: Result<crate::session_routes::CellResponse, ApiError>) -> Bytes {
    let mut out = Vec::new();
    let trailer = match r {
        Ok(cell) => {
            let r = &cell.exec;
            let (code, exited, status) = match (r.exit_code, r.signal) {
                (Some(c), _) => (c, true, format!("exit status {c}")),
                (None, Some(s)) => (-1, false, format!("signal: {s}")),
                _ => (-1, false, format!("{:?}", r.status)),
            };
            let mut end = json!({"exitCode": code, "exited": exited, "status": status});
            let error = match r.status {
                Status::Timeout => Some(("deadline_exceeded", "the command timed out")),
                Status::OutputLimit => Some((
                    "resource_exhausted",
                    "the command's output passed its limit",
                )),
                Status::Crashed => Some(("internal", "the sandbox crashed")),
                _ => None,
            };
            if let Some((_, why)) = error {
                end["error"] = json!(why);
            }
            out.extend_from_slice(&envelope(0, &json!({"event": {"end": end}})));
            match error {
                Some((code, why)) => json!({"error": {"code": code, "message": why}}),
                None => json!({}),
            }
        }
        Err(e) => json!({"error": {"code": connect_code(&e), "message": e.to_string()}}),
    };
    out.extend_from_slice(&envelope(2, &trailer));
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2b_paths_map_into_the_work_directory() {
        assert_eq!(guest_path("/home/user/a.txt").unwrap(), "a.txt");
        assert_eq!(guest_path("/tmp/d/a.txt").unwrap(), "d/a.txt");
        assert_eq!(guest_path("/home/user").unwrap(), ".");
        assert_eq!(guest_path("/home/user/").unwrap(), ".");
        assert_eq!(guest_path("rel/x").unwrap(), "rel/x");
        assert!(guest_path("/etc/passwd").is_err());
        assert!(guest_path("/home/user/../../etc/passwd").is_err());
        assert_eq!(e2b_path("d/a.txt"), "/home/user/d/a.txt");
        assert_eq!(e2b_path("."), "/home/user");
    }

    #[test]
    fn commands_become_shell_scripts() {
        let bash = json!({"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi; exit 3"]});
        assert_eq!(script_of(&bash).unwrap(), "echo hi; exit 3");
        let argv = json!({"cmd": "ls", "args": ["-l", "it's"], "cwd": "/home/user"});
        assert_eq!(
            script_of(&argv).unwrap(),
            "cd -- '/home/user' || exit 1\n'ls' '-l' 'it'\\''s'"
        );
    }

    #[test]
    fn envelopes_round_trip() {
        let v = json!({"process": {"cmd": "sh"}});
        let e = envelope(0, &v);
        assert_eq!(e[0], 0);
        assert_eq!(
            u32::from_be_bytes([e[1], e[2], e[3], e[4]]) as usize,
            e.len() - 5
        );
        assert_eq!(unwrap_envelope(&e).unwrap(), v);
        assert_eq!(unwrap_envelope(br#"{"a":1}"#).unwrap(), json!({"a": 1}));
        assert!(unwrap_envelope(&[0, 0, 0, 0, 9, b'{']).is_err());
    }

    #[test]
    fn entry_info_has_proto_json_fields() {
        let st = json!({"name": "a.txt", "size": 5, "mode": 0o100644, "mtime_ns": 0});
        let v = entry_info("d/a.txt", &st);
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["path"], "/home/user/d/a.txt");
        assert_eq!(v["size"], "5");
        assert_eq!(v["permissions"], "-rw-r--r--");
        assert_eq!(v["mode"], 0o644);
        assert_eq!(v["modifiedTime"], "1970-01-01T00:00:00.000Z");
    }
}
