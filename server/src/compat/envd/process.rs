//! envd's `process.Process/Start` (server streaming, Connect JSON envelopes): a command as a
//! shell cell of the sandbox's session (see the parent module).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};
use vmm::job::Stream;
use vmm::{Language, Status};

use super::{connect_code, connect_error, from_api};
use crate::api::{CellResponse, ExecRequest};
use crate::compat::Compat;
use crate::compat::e2b::sandbox_of;
use crate::error::{ApiError, Error};
use crate::service::{sessions, task};

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
fn unwrap_envelope(body: &[u8]) -> Result<Value, Error> {
    let json = match body {
        [0, a, b, c, d, rest @ ..] => {
            let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
            rest.get(..len)
                .ok_or_else(|| Error::invalid("body", "truncated Connect envelope"))?
        }
        [1, ..] => {
            return Err(Error::invalid(
                "body",
                "compressed envelopes are not supported",
            ));
        }
        other => other,
    };
    serde_json::from_slice(json).map_err(|e| Error::invalid("body", format!("bad JSON: {e}")))
}

/// Single-quotes `s` for the shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The shell script of a process config (module docs).
fn script_of(process: &Value) -> Result<String, Error> {
    let cmd = process["cmd"]
        .as_str()
        .ok_or_else(|| Error::invalid("process.cmd", "process.cmd is required"))?;
    let args: Vec<&str> = process["args"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let shell = matches!(cmd.rsplit('/').next(), Some("bash" | "sh" | "ash" | "dash"));
    let dash_c = args.iter().position(|a| *a == "-c");
    let mut script = match (shell, dash_c) {
        (true, Some(i)) if args[..i].iter().all(|a| a.starts_with('-')) => args
            .get(i + 1)
            .ok_or_else(|| Error::invalid("process.args", "-c needs a script"))?
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
    End(Box<Result<CellResponse, Error>>),
}

/// `POST /process.Process/{method}`.
pub async fn process(
    State(c): State<Compat>,
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
    start(c, headers, body).await.unwrap_or_else(from_api)
}

async fn start(c: Compat, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let (sandbox, e) = sandbox_of(&c, &headers)?;
    let state = c.app;
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
    let route = "/process.Process/Start";
    let key = sandbox.key.clone();
    let end = |r: Result<sessions::Cell, Error>| {
        let r = r.map(|c| CellResponse::new(c.result, c.waited, c.execution_count, false));
        Event::End(Box::new(r))
    };
    let id = e.id.clone();
    let mut rx = task::spawn(key, Event::Output, end, move |sink| async move {
        sessions::cell(&state, &id, native, route, sink).await
    });
    let first = task::first(&mut rx, |ev| match ev {
        Event::End(r) => (*r).map(|ok| Event::End(Box::new(Ok(ok)))),
        ev => Ok(ev),
    })
    .await?;
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
fn end_frames(r: Result<CellResponse, Error>) -> Bytes {
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
        Err(e) => {
            let e = ApiError::from(e);
            json!({"error": {"code": connect_code(&e), "message": e.to_string()}})
        }
    };
    out.extend_from_slice(&envelope(2, &trailer));
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
