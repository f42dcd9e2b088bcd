//! The Piston v2 API (`/api/v2/runtimes`, `/api/v2/execute`, also under `/api/v2/piston/`
//! where the public instance and its clients put it), over bud's one-shot jobs.
//!
//! A Piston request becomes a native [`ExecRequest`] and runs through
//! the service's one-shot jobs: the same limits, admission and template as `POST /v1/exec`.
//! Mapping (docs/compat.md has the table):
//! - `language`: the runtimes of the default template's manifest, under Piston's names: the
//!   one the worker runs as Python is `python` (aliases `py`, `py3`, `python3`,
//!   `python3.11`); the shell is `bash` (alias `sh`) — bud's shell is busybox `ash`, and the
//!   runtime list says so (`runtime: "busybox"`, busybox's version) where the manifest has
//!   busybox; the kernel runtime answering to `javascript` (the `node` template's) is
//!   `javascript` (aliases `node-javascript`, `node-js`, `javascript`, `js`, as Piston's node
//!   runtime has them; `runtime: "node"`); any other runtime under its own name. Each also
//!   answers to the manifest's aliases of it (`node`).
//! - `version`: `*`, absent, or a prefix of the real version (`3`, `3.11`, `3.11.2`), as the
//!   manifest has it (the upstream version of the runtime's Debian package).
//! - `files[0]` is the program (its code); every named file, the first one too, is also put
//!   in the job's working directory, so programs that open their siblings find them. Each
//!   file's `encoding` is `utf8` (default), `base64` or `hex`.
//! - `run_timeout` (ms) is the job's timeout (at most the server's `max_timeout_ms`, else
//!   400 as Piston answers a timeout over its limit); `run_memory_limit` is checked (-1 or a
//!   positive number of bytes) but not enforced below the VM's own RAM (docs/compat.md).
//! - The answer's `run.status` is Piston's: `RE` (non-zero exit), `SG` (signal), `TO`
//!   (timeout), `OL` (output limit), `XX` (crash); a memory error is `SG` with `SIGKILL`
//!   as Piston reports its own OOM kills. `output` is stdout followed by stderr (bud keeps
//!   the two streams apart, not their interleaving).
//!
//! Errors are `{"message": "..."}` with the native status code. The request body is JSON
//! whatever its Content-Type says (the npm client sends none).

use std::collections::BTreeMap;

use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use serde::{Deserialize, Serialize};
use vmm::{Language, Status};

use super::Compat;
use crate::core::state::AppState;
use crate::http::error::{ApiError, Error};
use crate::http::jobs::ExecResponse;
use crate::http::jobs::{one_shot, response};
use crate::service::jobs::ExecRequest;
use crate::service::{jobs, task};

/// One entry of `GET /api/v2/runtimes`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Runtime {
    pub language: String,
    pub version: String,
    pub aliases: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
}

/// `POST /api/v2/execute`. Unknown fields are ignored (clients send compile settings).
#[derive(Debug, Clone, Deserialize)]
pub struct Execute {
    pub language: Option<String>,
    pub version: Option<String>,
    pub files: Option<Vec<PistonFile>>,
    #[serde(default)]
    pub stdin: Option<String>,
    #[serde(default)]
    pub args: Option<Vec<String>>,
    pub run_timeout: Option<i64>,
    pub run_memory_limit: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PistonFile {
    pub name: Option<String>,
    pub content: Option<String>,
    pub encoding: Option<String>,
}

/// The `run` stage of an answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Stage {
    pub stdout: String,
    pub stderr: String,
    pub output: String,
    pub code: Option<i32>,
    pub signal: Option<String>,
    pub message: Option<String>,
    pub status: Option<String>,
    pub wall_time: u64,
}

/// Piston's error shape over a native error's status.
fn piston_error(e: ApiError) -> Response {
    let message = match &e {
        ApiError::Service(Error::Invalid { message, .. }) => message.clone(),
        other => other.to_string(),
    };
    e.respond_with(serde_json::json!({ "message": message }))
}

fn bad(message: impl Into<String>) -> Error {
    Error::Invalid {
        field: None,
        message: message.into(),
    }
}

/// Runs `req` as `POST /v1/exec` would, asked on `route`.
async fn run_native(
    state: &AppState,
    req: ExecRequest,
    route: &str,
) -> Result<ExecResponse, Error> {
    let b64 = req.output_b64;
    let one = one_shot(state, req, route, "", true)?;
    Ok(response(jobs::run(state, one, task::no_sink()).await?, b64))
}

/// Piston's names of its runtimes: the language, then its aliases.
const PYTHON_NAMES: [&str; 5] = ["python", "py", "py3", "python3", "python3.11"];
const SHELL_NAMES: [&str; 2] = ["bash", "sh"];
const TYPESCRIPT_NAMES: [&str; 4] = ["typescript", "ts", "node-ts", "tsc"];
const JAVASCRIPT_NAMES: [&str; 5] = [
    "javascript",
    "node-javascript",
    "node-js",
    "javascript",
    "js",
];

/// The default template's manifest (503 while it is not ready, as a job would be).
fn manifest(c: &Compat) -> Result<vmm::Manifest, Error> {
    let engine = crate::service::templates::engine_for(&c.app, None)?;
    Ok(engine.manifest().clone())
}

/// Piston's runtime list of `manifest`, each with the name of the manifest runtime it runs.
fn runtimes_of(manifest: &vmm::Manifest) -> Vec<(Runtime, String)> {
    manifest
        .runtimes
        .iter()
        .map(|r| {
            // Piston's aliases, then the manifest's that Piston's do not have.
            let names = |n: &[&str]| {
                let mut all: Vec<String> = n[1..].iter().map(|s| s.to_string()).collect();
                for a in &r.aliases {
                    if *a != n[0] && !all.contains(a) {
                        all.push(a.clone());
                    }
                }
                all
            };
            // The first runtime of each worker mode takes Piston's name for it (the kernel
            // runtime, where it is JavaScript); another one keeps its own.
            let first = manifest
                .runtime_running(r.run)
                .is_some_and(|f| f.name == r.name);
            let (language, aliases, runtime) = match (r.run, first) {
                (Language::Python, true) => ("python".to_owned(), names(&PYTHON_NAMES), None),
                (Language::Shell, true) => (
                    "bash".to_owned(),
                    names(&SHELL_NAMES),
                    manifest.has_tool("busybox").then(|| "busybox".to_owned()),
                ),
                (Language::Kernel, true) if is_javascript(r) => (
                    "javascript".to_owned(),
                    names(&JAVASCRIPT_NAMES),
                    Some("node".to_owned()),
                ),
                (Language::Kernel, _) if r.answers_to("typescript") => {
                    ("typescript".to_owned(), names(&TYPESCRIPT_NAMES), None)
                }
                _ => (r.name.clone(), names(&[r.name.as_str()]), None),
            };
            let piston = Runtime {
                language,
                version: r.version.clone(),
                aliases,
                runtime,
            };
            (piston, r.name.clone())
        })
        .collect()
}

/// Whether kernel runtime `r` is JavaScript: it answers to `javascript`, `js` or `node`.
fn is_javascript(r: &vmm::manifest::Runtime) -> bool {
    ["javascript", "js", "node"].iter().any(|n| r.answers_to(n))
}

/// `GET /api/v2/runtimes`.
pub async fn runtimes(State(c): State<Compat>) -> Response {
    match manifest(&c) {
        Ok(m) => Json(
            runtimes_of(&m)
                .into_iter()
                .map(|(r, _)| r)
                .collect::<Vec<_>>(),
        )
        .into_response(),
        Err(e) => piston_error(e.into()),
    }
}

/// Whether `asked` (a Piston version request) names version `have`.
fn version_matches(asked: Option<&str>, have: &str) -> bool {
    let asked = match asked.map(str::trim) {
        None | Some("") | Some("*") | Some("x") => return true,
        Some(a) => a.trim_end_matches(".x").trim_end_matches(".*"),
    };
    have == asked || have.starts_with(&format!("{asked}."))
}

fn decode(i: usize, f: &PistonFile) -> Result<Vec<u8>, Error> {
    let content = f
        .content
        .as_deref()
        .ok_or_else(|| bad(format!("files[{i}].content is required as a string")))?;
    match f.encoding.as_deref().unwrap_or("utf8") {
        "utf8" => Ok(content.as_bytes().to_vec()),
        "base64" => base64::engine::general_purpose::STANDARD
            .decode(content)
            .map_err(|e| bad(format!("files[{i}].content is not valid base64: {e}"))),
        "hex" => {
            hex_decode(content).ok_or_else(|| bad(format!("files[{i}].content is not valid hex")))
        }
        other => Err(bad(format!(
            "files[{i}].encoding must be utf8, base64 or hex (got {other:?})"
        ))),
    }
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if s.len() % 2 != 0 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.chunks(2)
        .map(|p| Some(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

/// The native request of a Piston one, and the language and version it names.
fn native(
    state: &AppState,
    req: Execute,
    manifest: &vmm::Manifest,
) -> Result<(ExecRequest, String, String), Error> {
    let lang = req
        .language
        .ok_or_else(|| bad("language is required as a string"))?;
    let all = runtimes_of(manifest);
    let Some((piston, runtime)) = all
        .into_iter()
        .find(|(r, _)| r.language == lang || r.aliases.contains(&lang))
    else {
        return Err(bad(format!(
            "{lang}-{} runtime is unknown",
            req.version.as_deref().unwrap_or("*")
        )));
    };
    let (name, version) = (piston.language, piston.version);
    if !version_matches(req.version.as_deref(), &version) {
        return Err(bad(format!(
            "{lang}-{} runtime is unknown",
            req.version.as_deref().unwrap_or("*")
        )));
    }
    let files = req
        .files
        .filter(|f| !f.is_empty())
        .ok_or_else(|| bad("files is required as a non-empty array"))?;
    let max = state.config().limits.max_timeout_ms;
    let timeout_ms = match req.run_timeout {
        None => None,
        Some(t) if t >= 1 && t as u64 <= max => Some(t as u64),
        Some(t) => {
            return Err(bad(format!(
                "run_timeout must be 1..={max} ms, the configured limit (got {t})"
            )));
        }
    };
    if let Some(m) = req.run_memory_limit
        && m != -1
        && m < 1
    {
        return Err(bad(format!(
            "run_memory_limit must be -1 or a positive number of bytes (got {m})"
        )));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut code = Vec::new();
    let mut put = BTreeMap::new();
    for (i, f) in files.iter().enumerate() {
        let bytes = decode(i, f)?;
        if let Some(n) = f.name.as_deref().filter(|n| !n.is_empty()) {
            crate::service::files::check_relative(&format!("files[{i}].name"), n)?;
            put.insert(n.to_owned(), b64.encode(&bytes));
        }
        if i == 0 {
            code = bytes;
        }
    }
    // Piston runs `node FILE ARG...`, so a program's arguments are `process.argv.slice(2)`;
    // bud's JavaScript runs as `node -e CODE ARG...` (`process.argv.slice(1)`): the first
    // file's name goes first, so both count the same.
    let mut args = req.args.unwrap_or_default();
    if manifest
        .runtime(&runtime)
        .is_some_and(|r| r.run == vmm::Language::Kernel)
    {
        let first = files[0].name.as_deref().filter(|n| !n.is_empty());
        args.insert(0, first.unwrap_or("file0.code").to_owned());
    }
    let native = ExecRequest {
        language: Some(runtime),
        code_b64: Some(b64.encode(&code)),
        stdin: req.stdin,
        args,
        timeout_ms,
        files: put,
        ..ExecRequest::default()
    };
    Ok((native, name, version.clone()))
}

/// Piston's `run` stage of a bud result.
fn stage(r: &ExecResponse) -> Stage {
    let signal_name = |s: i32| {
        let name = match s {
            1 => "SIGHUP",
            2 => "SIGINT",
            3 => "SIGQUIT",
            4 => "SIGILL",
            6 => "SIGABRT",
            8 => "SIGFPE",
            9 => "SIGKILL",
            11 => "SIGSEGV",
            13 => "SIGPIPE",
            14 => "SIGALRM",
            15 => "SIGTERM",
            _ => return format!("SIG{s}"),
        };
        name.to_owned()
    };
    let (status, signal, message) = match r.status {
        Status::Ok => (None, None, None),
        Status::Error => match r.signal {
            Some(s) => (Some("SG"), Some(signal_name(s)), None),
            None => (Some("RE"), None, None),
        },
        Status::Timeout => (Some("TO"), Some("SIGKILL".to_owned()), Some("Timeout")),
        Status::OutputLimit => (
            Some("OL"),
            Some("SIGKILL".to_owned()),
            Some("Output limit exceeded"),
        ),
        Status::MemoryLimit => (
            Some("SG"),
            Some("SIGKILL".to_owned()),
            Some("Memory limit exceeded"),
        ),
        Status::Crashed => (Some("XX"), None, Some("The sandbox crashed")),
        Status::Cancelled => (Some("XX"), None, Some("Cancelled")),
    };
    Stage {
        stdout: r.stdout.clone(),
        stderr: r.stderr.clone(),
        output: format!("{}{}", r.stdout, r.stderr),
        code: r.exit_code,
        signal,
        message: message.map(str::to_owned),
        status: status.map(str::to_owned),
        wall_time: r.timings.total_ms.round() as u64,
    }
}

/// `POST /api/v2/execute`.
pub async fn execute(State(c): State<Compat>, req: Request) -> Response {
    match run(&c, req.into_body()).await {
        Ok(answer) => Json(answer).into_response(),
        Err(e) => piston_error(e),
    }
}

async fn run(c: &Compat, body: Body) -> Result<serde_json::Value, ApiError> {
    let state = &c.app;
    let limits = &state.config().limits;
    let bytes =
        crate::http::body::read_limited(body, limits.max_body_bytes, limits.body_timeout()).await?;
    let req: Execute =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("bad JSON body: {e}")))?;
    let m = manifest(c)?;
    let (native, language, version) = native(state, req, &m)?;
    let r = run_native(state, native, "/api/v2/execute").await?;
    Ok(serde_json::json!({
        "language": language,
        "version": version,
        "run": stage(&r),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(runtimes: &[(&str, Language, &str)], tools: &[&str]) -> vmm::Manifest {
        vmm::Manifest {
            format: vmm::manifest::MANIFEST_FORMAT,
            runtimes: runtimes
                .iter()
                .map(|(name, run, version)| vmm::manifest::Runtime {
                    name: name.to_string(),
                    version: version.to_string(),
                    run: *run,
                    ..vmm::manifest::Runtime::default()
                })
                .collect(),
            tools: tools.iter().map(|t| t.to_string()).collect(),
            ..vmm::Manifest::default()
        }
    }

    #[test]
    fn the_runtime_list_is_the_manifests_under_pistons_names() {
        let m = manifest(
            &[
                ("python", Language::Python, "3.11.2"),
                ("shell", Language::Shell, "1.35.0"),
            ],
            &["busybox"],
        );

        let list = runtimes_of(&m);

        assert_eq!(
            serde_json::to_value(list.iter().map(|(r, _)| r).collect::<Vec<_>>()).unwrap(),
            serde_json::json!([
                {"language": "python", "version": "3.11.2",
                 "aliases": ["py", "py3", "python3", "python3.11"]},
                {"language": "bash", "version": "1.35.0", "aliases": ["sh"],
                 "runtime": "busybox"},
            ])
        );
        assert_eq!(list[1].1, "shell");
    }

    #[test]
    fn another_runtime_keeps_its_name_and_a_shell_without_busybox_names_none() {
        let m = manifest(
            &[
                ("shell", Language::Shell, "5.2.15"),
                ("zsh", Language::Shell, "5.9"),
            ],
            &["bash"],
        );

        let list = runtimes_of(&m);

        assert_eq!(
            list.iter()
                .map(|(r, n)| (r.language.as_str(), r.runtime.as_deref(), n.as_str()))
                .collect::<Vec<_>>(),
            [("bash", None, "shell"), ("zsh", None, "zsh")]
        );
        assert!(list[1].0.aliases.is_empty());
    }

    #[test]
    fn a_javascript_kernel_runtime_is_pistons_node_with_the_manifests_aliases_too() {
        let mut m = manifest(
            &[
                ("python", Language::Python, "3.11.2"),
                ("shell", Language::Shell, "1.35.0"),
            ],
            &[],
        );
        m.runtimes.push(vmm::manifest::Runtime {
            name: "javascript".into(),
            aliases: vec!["js".into(), "node".into()],
            version: "18.20.4".into(),
            run: Language::Kernel,
            ..vmm::manifest::Runtime::default()
        });
        let mut other = m.clone();
        other.runtimes[2].name = "ruby".into();
        other.runtimes[2].aliases = vec!["rb".into()];

        let list = runtimes_of(&m);
        let other = runtimes_of(&other);

        assert_eq!(
            serde_json::to_value(&list[2].0).unwrap(),
            serde_json::json!({"language": "javascript", "version": "18.20.4",
                "aliases": ["node-javascript", "node-js", "javascript", "js", "node"],
                "runtime": "node"})
        );
        assert_eq!(list[2].1, "javascript");
        assert_eq!(
            serde_json::to_value(&other[2].0).unwrap(),
            serde_json::json!({"language": "ruby", "version": "18.20.4", "aliases": ["rb"]})
        );
    }

    #[test]
    fn version_requests_match_by_prefix() {
        for ok in [
            None,
            Some("*"),
            Some("3"),
            Some("3.11"),
            Some("3.11.2"),
            Some("3.x"),
        ] {
            assert!(version_matches(ok, "3.11.2"), "{ok:?}");
        }
        for no in [Some("3.1"), Some("3.10.0"), Some("2"), Some("3.11.22")] {
            assert!(!version_matches(no, "3.11.2"), "{no:?}");
        }
    }

    #[test]
    fn hex_decodes_pairs_and_rejects_the_rest() {
        assert_eq!(hex_decode("48690a"), Some(b"Hi\n".to_vec()));
        assert_eq!(hex_decode("4"), None);
        assert_eq!(hex_decode("zz"), None);
    }
}
