//! Code contexts, whoever asks (bud's `/v1/sessions/{id}/contexts`, E2B's code
//! interpreter): make one, list them, run a cell in one, restart or remove one. A Python or
//! bash context is a kernel of its own ([`crate::service::kernels`]): a Python interpreter
//! or a shell, so cells of different contexts run at the same time, beside the session's
//! own cells and commands. A context in the template's kernel runtime (JavaScript on
//! `node`) is a namespace of the session's own kernel: its cells are session cells
//! ([`crate::service::sessions::cell`]) in [`Language::Kernel`] with the context's
//! namespace (`vmm::CellOptions`), one at a time with the session's other cells. The
//! contexts are the session's ([`crate::core::contexts`]): paused, snapshotted and forked
//! with it.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

use vmm::{CellOptions, Language, Manifest};

use crate::core::contexts::{Context, Contexts, Kernel};
use crate::core::state::AppState;
use crate::service::error::Error;
use crate::service::jobs::ExecRequest;
use crate::service::kernels::{self, KernelCell, Ran};
use crate::service::task::Sink;
use crate::service::{access, processes, sessions, task, templates};

/// The longest context `cwd` (Linux's `PATH_MAX`).
pub const MAX_CWD: usize = 4096;

/// What clients call JavaScript and TypeScript (E2B's code interpreter sends `js` and `ts`,
/// its docs say `javascript` and `typescript`; Node's own name): on a template whose
/// runtimes none of them names, a context or cell in one is told the template's runtimes.
const KERNEL_NAMES: [&str; 5] = ["js", "javascript", "node", "ts", "typescript"];

/// How the cells of a context in `name` run on the template of `manifest`: `python`
/// (`python3`) and `bash` (`sh`) in a kernel process of their own, a name or alias of one
/// of the template's kernel runtimes ([`Language::Kernel`]: `javascript`, `js`, `node`,
/// `typescript`, `ts` on `node`) in a namespace of the session's kernel. JavaScript or
/// TypeScript on a template without them: 400 naming the template's runtimes.
pub fn language_of(manifest: &Manifest, name: &str) -> Result<Language, Error> {
    match name {
        "python" | "python3" => return Ok(Language::Python),
        "bash" | "sh" => return Ok(Language::Shell),
        _ => {}
    }
    if manifest
        .runtime(name)
        .is_some_and(|r| r.run == Language::Kernel)
    {
        return Ok(Language::Kernel);
    }
    if KERNEL_NAMES.contains(&name) {
        return Err(templates::no_runtime(manifest, Some(name), "language"));
    }
    if let Some(r) = manifest
        .runtime(name)
        .filter(|r| r.run == Language::Program)
    {
        return Err(Error::invalid(
            "language",
            format!(
                "{} runs a process per cell and keeps no state for a context to hold: run its \
                 code as jobs or as a session's cells (`language`: {:?})",
                r.name, r.name
            ),
        ));
    }
    let mut runs = vec!["python".to_owned(), "bash (busybox sh)".to_owned()];
    let kernels = manifest
        .runtimes
        .iter()
        .filter(|r| r.run == Language::Kernel);
    runs.extend(kernels.map(|r| r.name.clone()));
    let last = runs.pop().unwrap_or_default();
    Err(Error::invalid(
        "language",
        format!("bud runs {} and {last} code, not {name}", runs.join(", ")),
    ))
}

/// A new context of session `id`: `language` (default `python`), starting in `cwd` (empty
/// or none: `home`). A Python or bash context's kernel starts at its first cell; a context
/// in the template's kernel runtime is named as that runtime (`js` makes a `javascript`
/// context, as E2B names it) and gets a namespace of the session's kernel, made empty at
/// its first cell.
pub fn create(
    state: &AppState,
    id: &str,
    language: Option<&str>,
    cwd: Option<&str>,
    home: &str,
) -> Result<Context, Error> {
    let e = access::get(state, id)?;
    let asked = language.unwrap_or("python");
    // The template's manifest says which kernels it has (one made before manifests lists
    // none, and keeps both) and which runtime is its kernel runtime (JavaScript).
    let manifest = e.engine.manifest();
    let (language, namespaced) = match language_of(manifest, asked)? {
        Language::Kernel => {
            let runtime = manifest.runtime(asked).map_or(asked, |r| r.name.as_str());
            (runtime, true)
        }
        run => {
            let kernel = if run == Language::Python {
                "python"
            } else {
                "bash"
            };
            if !manifest.kernels.is_empty() && manifest.kernel(kernel).is_none() {
                let has: Vec<&str> = manifest
                    .kernels
                    .iter()
                    .map(|k| k.language.as_str())
                    .collect();
                return Err(Error::invalid(
                    "language",
                    format!(
                        "template {} has no {kernel} kernel; its kernels: {}",
                        e.template,
                        has.join(", ")
                    ),
                ));
            }
            (asked, false)
        }
    };
    let cwd = cwd.filter(|d| !d.is_empty()).unwrap_or(home);
    if cwd.contains('\0') || cwd.len() > MAX_CWD {
        return Err(Error::invalid(
            "cwd",
            format!("a directory is at most {MAX_CWD} bytes, without a NUL byte"),
        ));
    }
    let name = crate::core::node::random_hex(8).map_err(Error::internal)?;
    e.contexts()
        .add(language, cwd, format!("ctx_{name}"), namespaced)
        .ok_or_else(|| {
            Error::invalid(
                "contexts",
                format!("a session has at most {} contexts", Contexts::MAX),
            )
        })
}

/// How the cells of context `c` of session `id` run (as [`language_of`] says of its
/// language on the session's template).
pub fn language(state: &AppState, id: &str, c: &Context) -> Result<Language, Error> {
    language_of(access::get(state, id)?.engine.manifest(), &c.language)
}

/// Session `id`'s contexts, in the order of their ids.
pub fn list(state: &AppState, id: &str) -> Result<Vec<Context>, Error> {
    Ok(access::get(state, id)?
        .contexts()
        .made
        .values()
        .cloned()
        .collect())
}

/// Context `context` of session `id`.
pub fn get(state: &AppState, id: &str, context: &str) -> Result<Context, Error> {
    access::get(state, id)?
        .contexts()
        .made
        .get(context)
        .cloned()
        .ok_or_else(|| no_context(id, context))
}

fn no_context(id: &str, context: &str) -> Error {
    Error::NoContext(format!("session {id} has no context {context}"))
}

/// A cell for a context.
#[derive(Debug)]
pub struct Cell {
    pub code: String,
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
    /// Its output goes to a client as it comes (a kernel process's always does; a
    /// namespace context's cell is then streamed as a streamed session cell is).
    pub stream: bool,
}

/// Which kernel a cell runs in.
#[derive(Debug, Clone, Copy)]
pub enum Which<'a> {
    /// A context made by [`create`].
    Made(&'a str),
    /// The session's default bash context (E2B's bash cells without a context), starting in
    /// this directory.
    DefaultBash(&'a str),
}

/// Runs `cell` in a context of session `id` (its kernel started first if it has none),
/// its output to `sink` as it comes; one cell of a context at a time, the next waiting. A
/// context in the template's kernel runtime runs it as a session cell in its namespace.
pub async fn run(
    state: &AppState,
    id: &str,
    which: Which<'_>,
    cell: Cell,
    route: &str,
    sink: Sink,
) -> Result<Ran, Error> {
    let (kernel, language, cwd, name) = match which {
        Which::Made(context) => {
            let c = get(state, id, context)?;
            let language = language(state, id, &c)?;
            if language == Language::Kernel {
                return in_namespace(state, id, &c, cell, route, sink).await;
            }
            (c.kernel, language, c.cwd, c.id)
        }
        Which::DefaultBash(cwd) => {
            let kernel = access::get(state, id)?.contexts().bash.clone();
            (kernel, Language::Shell, cwd.to_owned(), "bash".into())
        }
    };
    let cell = KernelCell {
        language,
        code: cell.code,
        env: cell.env,
        cwd,
        timeout: cell.timeout,
        name,
    };
    kernels::run(state, id, kernel, cell, route, sink).await
}

/// Runs `cell` in the namespace of context `c` (one in the template's kernel runtime): a
/// session cell in [`Language::Kernel`], entering the context's `cwd` before the
/// namespace's first cell, its error in the display data as a kernel's is; the execution
/// count is the context's own.
async fn in_namespace(
    state: &AppState,
    id: &str,
    c: &Context,
    cell: Cell,
    route: &str,
    sink: Sink,
) -> Result<Ran, Error> {
    // By the context's runtime name: the kernel's mode, and its dialect (TypeScript).
    let req = ExecRequest {
        language: Some(c.language.clone()),
        code: Some(cell.code),
        env: cell.env,
        timeout_ms: Some(u64::try_from(cell.timeout.as_millis()).unwrap_or(u64::MAX)),
        cell: CellOptions {
            namespace: c.namespace,
            reset: false,
            directory: Some(c.cwd.clone()),
            error_in_display: true,
        },
        stream: cell.stream,
        ..ExecRequest::default()
    };
    let ran = sessions::cell(state, id, req, route, sink).await?;
    let mut count = 0;
    c.kernel.set(|k| {
        k.count += 1;
        count = k.count;
    });
    Ok(Ran {
        result: ran.result,
        execution_count: count,
    })
}

/// Empties context `c`'s namespace (one in the template's kernel runtime): a session cell
/// without code that resets it (waiting for the session's running cell, if any); its next
/// cell starts again in its `cwd`, counted from 1.
async fn reset_namespace(
    state: &AppState,
    id: &str,
    c: &Context,
    route: &str,
) -> Result<(), Error> {
    let req = ExecRequest {
        language: Some(c.language.clone()),
        code: Some(String::new()),
        cell: CellOptions {
            namespace: c.namespace,
            reset: true,
            directory: Some(c.cwd.clone()),
            error_in_display: true,
        },
        ..ExecRequest::default()
    };
    sessions::cell(state, id, req, route, task::no_sink()).await?;
    c.kernel.set(|k| k.count = 0);
    Ok(())
}

/// Empties context `context`: a kernel process is killed (its running cell ends with
/// `DeadKernelError`, its next cell starts a new kernel, empty, back in the context's
/// `cwd`); a namespace of the session's kernel is emptied (after the session's running
/// cell). `route` names the route in the audit trail.
pub async fn restart(state: &AppState, id: &str, context: &str, route: &str) -> Result<(), Error> {
    let c = get(state, id, context)?;
    if language(state, id, &c)? == Language::Kernel {
        return reset_namespace(state, id, &c, route).await;
    }
    kill(state, id, c.kernel).await
}

/// Empties context `context` ([`restart`]) and forgets it.
pub async fn remove(state: &AppState, id: &str, context: &str, route: &str) -> Result<(), Error> {
    restart(state, id, context, route).await?;
    access::get(state, id)?.contexts().made.remove(context);
    Ok(())
}

async fn kill(state: &AppState, id: &str, kernel: Kernel) -> Result<(), Error> {
    if let Some(pid) = kernel.take_pid() {
        match processes::signal(state, id, pid, libc::SIGKILL).await {
            Ok(()) | Err(Error::NoProcess { .. }) => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// `POST /v1/sessions/{id}/contexts`: a code context, a kernel of its own.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CreateContext {
    /// `python` (default), `bash`, or the template's kernel runtime by name or alias
    /// (`javascript`, `js`, `node` on `node`: a namespace of the session's Node.js).
    pub language: Option<String>,
    /// Where its kernel (or namespace) starts (default: the session's work directory,
    /// `/tmp`).
    pub cwd: Option<String>,
}

/// `POST /v1/sessions/{id}/contexts/{context}/exec`: a cell for a context's kernel.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ContextCell {
    pub code: String,
    /// Variables set in the kernel before the cell (they stay set, as in a notebook).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Past it the cell is interrupted (default: the server's default timeout).
    pub timeout_ms: Option<u64>,
}

impl ContextCell {
    /// Checks the cell against `limits`: its code, environment and time limit.
    pub fn checked(
        self,
        limits: &crate::core::config::Limits,
    ) -> Result<(String, BTreeMap<String, String>, std::time::Duration), crate::service::error::Error>
    {
        use crate::service::jobs::{check_size, check_timeout};
        check_size("", "code", self.code.len(), limits.max_code_bytes)?;
        let timeout_ms = check_timeout("", self.timeout_ms, limits)?;
        Ok((
            self.code,
            self.env,
            std::time::Duration::from_millis(timeout_ms),
        ))
    }
}
