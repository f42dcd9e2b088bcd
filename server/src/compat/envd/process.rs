//! envd's process service (Connect, JSON codec) over the sandbox's background processes
//! ([`crate::service::processes`]):
//! - `Start` (server streaming): the command starts as a process of the sandbox (`/bin/bash
//!   -l -c SCRIPT`, what `sandbox.commands.run` sends, runs SCRIPT in busybox `sh`; any other
//!   command runs as its quoted argv), with `envs`, `cwd`, `tag` and a stdin pipe if
//!   `stdin`; events: `start` (its pid in the guest), `data` (stdout / stderr, base64 as
//!   proto JSON has bytes), `end` (`exitCode`, `exited`, `status`), and `keepalive` every
//!   `Keepalive-Ping-Interval` seconds while it is quiet. The stream ends at the process's
//!   end, or with `deadline_exceeded` at `Connect-Timeout-Ms`; a client that goes away (or
//!   times out) leaves the process running, which is how `background=True` works.
//! - `Connect` (server streaming): the same events for a running process, from now on.
//! - `List`, `SendInput` (stdin), `StreamInput` (client streaming: its envelopes are read
//!   whole), `CloseStdin`, `SendSignal` (`SIGNAL_SIGKILL`, `SIGNAL_SIGTERM`); a process is
//!   selected by `pid` or `tag`.
//! - Users: a command (and a PTY) runs as the request's user (`user` by default, `root`
//!   when the client asks: the parent module's [`EnvdUser`]), in `/home/user` unless it
//!   has a `cwd` (a relative one is under `/home/user`), with that user's `HOME`, `USER`,
//!   `LOGNAME` and `SHELL`.
//! - PTYs: `Start` with `pty` runs the command on a terminal of that size (`/bin/bash -i
//!   -l`, what `sandbox.pty.create` sends, is busybox `sh -i`); its output comes as `pty`
//!   data, `SendInput` with `pty` types into it, `Update` resizes it.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures_util::stream;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use vmm::job::Stream;

use super::connect::{
    Next, Timing, envelope, next, stream_response, unwrap_envelope, unwrap_envelopes,
};
use super::{EnvdUser, connect_error, from_api};
use crate::compat::Compat;
use crate::compat::e2b::sandbox_of;
use crate::compat::jupyter::HOME;
use crate::core::processes::{Event, Exit, Start, Subscription};
use crate::http::error::{ApiError, Error};
use crate::service::processes;
use crate::service::processes::requests::{TerminalSize, check_env};

/// Single-quotes `s` for the shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The shell script of a process config (module docs); its cwd is the process's own.
/// `bash`: the sandbox's template has GNU bash (the `tools` template): a `bash` command
/// runs in it, as its argv (~1 s more per command here than busybox `sh`).
fn script_of(process: &Value, bash: bool) -> Result<String, Error> {
    let cmd = process["cmd"]
        .as_str()
        .ok_or_else(|| Error::invalid("process.cmd", "process.cmd is required"))?;
    let args: Vec<&str> = process["args"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let name = cmd.rsplit('/').next();
    let shell = matches!(name, Some("bash" | "sh" | "ash" | "dash"));
    let dash_c = args.iter().position(|a| *a == "-c");
    let quoted = || {
        std::iter::once(cmd)
            .chain(args.iter().copied())
            .map(quote)
            .collect::<Vec<_>>()
            .join(" ")
    };
    if bash && name == Some("bash") {
        return Ok(format!("exec {}", quoted()));
    }
    let script = match (shell, dash_c) {
        (true, Some(i)) if args[..i].iter().all(|a| a.starts_with('-')) => args
            .get(i + 1)
            .ok_or_else(|| Error::invalid("process.args", "-c needs a script"))?
            .to_string(),
        // A shell of its own (E2B's PTY: `/bin/bash -i -l`): busybox sh, interactive when
        // asked (a login shell reads no profile here).
        (true, None) if args.iter().all(|a| a.starts_with('-')) => {
            if args.contains(&"-i") {
                "exec /bin/sh -i".to_owned()
            } else {
                "exec /bin/sh".to_owned()
            }
        }
        _ => quoted(),
    };
    Ok(script)
}

/// `POST /process.Process/{method}`.
pub async fn process(
    State(c): State<Compat>,
    headers: HeaderMap,
    Path(method): Path<String>,
    body: Bytes,
) -> Response {
    let key = match sandbox_of(&c, &headers) {
        Ok((s, _)) => s.key.clone(),
        Err(e) => return from_api(e),
    };
    let call = async move {
        match method.as_str() {
            "Start" => start(c, headers, body).await,
            "Connect" => connect(c, headers, body).await,
            "List" => list(c, headers).await,
            "SendInput" => send_input(c, headers, body).await,
            "StreamInput" => stream_input(c, headers, body).await,
            "CloseStdin" => close_stdin(c, headers, body).await,
            "SendSignal" => send_signal(c, headers, body).await,
            "Update" => update(c, headers, body).await,
            other => Ok(connect_error(
                "unimplemented",
                format!("process.Process/{other} is not a method of envd's process service"),
            )),
        }
    };
    crate::core::audit::KEY
        .scope(key, call)
        .await
        .unwrap_or_else(from_api)
}

/// The pid a `ProcessSelector` (`{"pid"}` or `{"tag"}`) names in sandbox `id`.
fn selected(c: &Compat, id: &str, selector: &Value) -> Result<u32, ApiError> {
    if let Some(pid) = selector["pid"].as_u64() {
        return u32::try_from(pid).map_err(|_| ApiError::invalid("process.pid", "bad pid"));
    }
    if let Some(tag) = selector["tag"].as_str() {
        return processes::list(&c.app, id)?
            .iter()
            .rev()
            .find(|(i, end)| end.is_none() && i.start.tag.as_deref() == Some(tag))
            .map(|(i, _)| i.pid)
            .ok_or_else(|| {
                Error::NoProcess {
                    pid: 0,
                    message: format!("no running process tagged {tag:?}"),
                }
                .into()
            });
    }
    Err(ApiError::invalid("process", "process needs a pid or a tag"))
}

fn unary(v: Value) -> Response {
    axum::Json(v).into_response()
}

async fn start(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&c, &headers)?;
    let req = unwrap_envelope(&body)?;
    let process = &req["process"];
    let pty = match &req["pty"]["size"] {
        Value::Null => None,
        size => Some(size_of(size)?),
    };
    let env: std::collections::BTreeMap<String, String> = process["envs"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    check_env(&env)?;
    let user = EnvdUser::of(&headers)?;
    let cwd = match process["cwd"].as_str().filter(|c| !c.is_empty()) {
        None => HOME.to_owned(),
        Some(c) if c.starts_with('/') => c.to_owned(),
        Some(rel) => format!("{HOME}/{rel}"),
    };
    let start = Start {
        cmd: process["cmd"].as_str().unwrap_or_default().to_owned(),
        args: process["args"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
        script: script_of(process, c.app.template_has_tool(&e.template, "bash"))?,
        cwd: Some(cwd),
        pty,
        env,
        tag: req["tag"].as_str().map(str::to_owned),
        stdin: req["stdin"].as_bool() == Some(true),
        user: Some(user.name().to_owned()),
        internal: false,
    };
    let pid = processes::start(&c.app, &e.id, start, "/process.Process/Start").await?;
    let sub = processes::connect(&c.app, &e.id, pid, true)?;
    Ok(events(sub, &headers))
}

async fn connect(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&c, &headers)?;
    let req = unwrap_envelope(&body)?;
    let pid = selected(&c, &e.id, &req["process"])?;
    let sub = processes::connect(&c.app, &e.id, pid, false)?;
    if sub.ended.is_some() {
        return Err(Error::NoProcess {
            pid,
            message: format!("process {pid} has ended"),
        }
        .into());
    }
    Ok(events(sub, &headers))
}

async fn list(c: Compat, headers: HeaderMap) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&c, &headers)?;
    let running: Vec<Value> = processes::list(&c.app, &e.id)?
        .iter()
        .filter(|(_, end)| end.is_none())
        .map(|(i, _)| {
            let st = &i.start;
            let mut config = json!({"cmd": st.cmd, "args": st.args, "envs": st.env});
            if let Some(cwd) = &st.cwd {
                config["cwd"] = json!(cwd);
            }
            let mut p = json!({"pid": i.pid, "config": config});
            if let Some(tag) = &st.tag {
                p["tag"] = json!(tag);
            }
            p
        })
        .collect();
    Ok(unary(json!({ "processes": running })))
}

/// A PTY's `{"rows", "cols"}`, checked.
fn size_of(size: &Value) -> Result<(u16, u16), ApiError> {
    let dim = |k: &str| {
        size[k]
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .unwrap_or(0)
    };
    let size = TerminalSize {
        rows: dim("rows"),
        cols: dim("cols"),
    };
    Ok(size.checked()?)
}

/// Bytes of a `ProcessInput` (`{"stdin": BASE64}` or `{"pty": BASE64}`: both go to what
/// the process reads, its stdin pipe or its terminal).
fn input_bytes(input: &Value) -> Result<Vec<u8>, ApiError> {
    let b64 = input["stdin"]
        .as_str()
        .or_else(|| input["pty"].as_str())
        .unwrap_or_default();
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| ApiError::invalid("input.stdin", format!("input.stdin is not base64: {e}")))
}

async fn send_input(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&c, &headers)?;
    let req = unwrap_envelope(&body)?;
    let pid = selected(&c, &e.id, &req["process"])?;
    let data = input_bytes(&req["input"])?;
    processes::stdin(&c.app, &e.id, pid, data, false).await?;
    Ok(unary(json!({})))
}

async fn stream_input(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&c, &headers)?;
    let mut pid = None;
    let mut data = Vec::new();
    for msg in unwrap_envelopes(&body)? {
        // The request's oneof `event` is flat in proto JSON (`{"start": ...}`).
        let ev = if msg["event"].is_object() {
            &msg["event"]
        } else {
            &msg
        };
        if ev["start"].is_object() {
            pid = Some(selected(&c, &e.id, &ev["start"]["process"])?);
        } else if ev["data"].is_object() {
            data.extend(input_bytes(&ev["data"]["input"])?);
        }
    }
    let pid = pid.ok_or_else(|| ApiError::invalid("event.start", "the stream names no process"))?;
    processes::stdin(&c.app, &e.id, pid, data, false).await?;
    // One response message, then the end of the stream.
    let mut out = envelope(0, &json!({})).to_vec();
    out.extend_from_slice(&envelope(2, &json!({})));
    Ok((
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from(out),
    )
        .into_response())
}

/// `Update`: a PTY's new size.
async fn update(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&c, &headers)?;
    let req = unwrap_envelope(&body)?;
    let pid = selected(&c, &e.id, &req["process"])?;
    let (rows, cols) = size_of(&req["pty"]["size"])?;
    processes::resize(&c.app, &e.id, pid, rows, cols).await?;
    Ok(unary(json!({})))
}

async fn close_stdin(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&c, &headers)?;
    let req = unwrap_envelope(&body)?;
    let pid = selected(&c, &e.id, &req["process"])?;
    processes::stdin(&c.app, &e.id, pid, Vec::new(), true).await?;
    Ok(unary(json!({})))
}

/// Signal numbers of envd's `Signal` enum (JSON gives its name or its number).
fn signal_of(v: &Value) -> Result<i32, ApiError> {
    let n = match v {
        Value::String(s) if s == "SIGNAL_SIGKILL" => 9,
        Value::String(s) if s == "SIGNAL_SIGTERM" => 15,
        Value::Number(n) => n.as_i64().unwrap_or(0) as i32,
        _ => 0,
    };
    if n == 9 || n == 15 {
        Ok(n)
    } else {
        Err(ApiError::invalid(
            "signal",
            "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM",
        ))
    }
}

async fn send_signal(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (_, e) = sandbox_of(&c, &headers)?;
    let req = unwrap_envelope(&body)?;
    let pid = selected(&c, &e.id, &req["process"])?;
    let sig = signal_of(&req["signal"])?;
    processes::signal(&c.app, &e.id, pid, sig).await?;
    Ok(unary(json!({})))
}

fn data_event(s: Stream, bytes: &[u8], pty: bool) -> Bytes {
    let key = match s {
        _ if pty => "pty",
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    };
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    envelope(0, &json!({"event": {"data": {key: b64}}}))
}

/// What one step of a process's stream sends, and whether it was the last.
enum Step {
    Send(Bytes),
    Last(Bytes),
}

/// A process's events as envd's stream (module docs): `start`, then `data` and
/// `keepalive`, then `end` and the end of the stream.
fn events(sub: Subscription, headers: &HeaderMap) -> Response {
    let pid = sub.info.pid;
    let pty = sub.info.start.pty.is_some();
    let started = envelope(0, &json!({"event": {"start": {"pid": pid}}}));
    let timing = Timing::of(headers);
    let replay = sub.replay.into_iter();
    let state = Some((replay, sub.rx));
    let rest = stream::unfold(state, move |st| async move {
        let (mut replay, mut rx) = st?;
        let step = match replay.next() {
            Some(ev) => step_of(ev, pty),
            None => next_step(&mut rx, timing, pty).await,
        };
        Some(match step {
            Step::Send(b) => (b, Some((replay, rx))),
            Step::Last(b) => (b, None),
        })
    });
    stream_response(started, rest)
}

fn step_of(ev: Event, pty: bool) -> Step {
    match ev {
        Event::Output(s, bytes) => Step::Send(data_event(s, &bytes, pty)),
        Event::End(exit) => Step::Last(end_frames(&exit)),
    }
}

/// The next step from the live channel: an event, a keepalive, or the deadline's error.
async fn next_step(rx: &mut broadcast::Receiver<Event>, t: Timing, pty: bool) -> Step {
    match next(rx, t).await {
        Next::Event(ev) => step_of(ev, pty),
        Next::Keepalive => Step::Send(envelope(0, &json!({"event": {"keepalive": {}}}))),
        Next::Deadline => Step::Last(trailer(
            "deadline_exceeded",
            "the command's stream reached its timeout (the process goes on)",
        )),
        Next::Closed => Step::Last(trailer(
            "unavailable",
            "the sandbox's process record is gone",
        )),
    }
}

fn trailer(code: &str, message: &str) -> Bytes {
    envelope(2, &json!({"error": {"code": code, "message": message}}))
}

/// The `end` event and the end-of-stream envelope of an ended process.
fn end_frames(exit: &Exit) -> Bytes {
    let mut out = Vec::new();
    let (code, exited, status) = match (exit.exit_code, exit.signal, &exit.lost) {
        (Some(c), _, _) => (c, true, format!("exit status {c}")),
        (None, Some(9), _) => (-1, false, "signal: killed".to_owned()),
        (None, Some(s), _) => (-1, false, format!("signal: {s}")),
        (None, None, Some(why)) => (-1, false, why.clone()),
        (None, None, None) => (-1, false, "ended".to_owned()),
    };
    let mut end = json!({"exitCode": code, "exited": exited, "status": status});
    if let Some(why) = &exit.lost {
        end["error"] = json!(why);
    }
    out.extend_from_slice(&envelope(0, &json!({"event": {"end": end}})));
    out.extend_from_slice(&envelope(2, &json!({})));
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_become_shell_scripts() {
        let bash = json!({"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi; exit 3"]});
        assert_eq!(script_of(&bash, false).unwrap(), "echo hi; exit 3");
        assert_eq!(
            script_of(&bash, true).unwrap(),
            "exec '/bin/bash' '-l' '-c' 'echo hi; exit 3'"
        );
        let argv = json!({"cmd": "ls", "args": ["-l", "it's"], "cwd": "/home/user"});
        assert_eq!(script_of(&argv, true).unwrap(), "'ls' '-l' 'it'\\''s'");
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
        // A client stream: two messages and its end.
        let mut body = envelope(0, &json!({"a": 1})).to_vec();
        body.extend_from_slice(&envelope(0, &json!({"b": 2})));
        body.extend_from_slice(&envelope(2, &json!({})));
        assert_eq!(
            unwrap_envelopes(&body).unwrap(),
            vec![json!({"a": 1}), json!({"b": 2})]
        );
    }
}
