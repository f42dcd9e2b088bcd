//! Code contexts, whoever asks (bud's `/v1/sessions/{id}/contexts`, E2B's code
//! interpreter): make one, list them, run a cell in one, restart or remove one. A context is
//! a kernel of its own ([`crate::service::kernels`]): a Python interpreter or a shell, so
//! cells of different contexts run at the same time, beside the session's own cells and
//! commands. The contexts are the session's ([`crate::core::contexts`]): paused, snapshotted and
//! forked with it.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

use vmm::Language;

use crate::core::contexts::{Context, Contexts, Kernel};
use crate::core::state::AppState;
use crate::service::error::Error;
use crate::service::kernels::{self, KernelCell, Ran};
use crate::service::task::Sink;
use crate::service::{access, processes, templates};

/// The longest context `cwd` (Linux's `PATH_MAX`).
pub const MAX_CWD: usize = 4096;

/// The language a context's `language` names: `python` (`python3`) or `bash` (`sh`).
/// JavaScript (`js`, `javascript`, `node`) and TypeScript (`ts`, `typescript`) contexts,
/// which E2B's code interpreter has, are not built yet: 400 saying so.
pub fn language_of(name: &str) -> Result<Language, Error> {
    match name {
        "python" | "python3" => Ok(Language::Python),
        "bash" | "sh" => Ok(Language::Shell),
        "js" | "javascript" | "node" => Err(templates::kernel_cells("language", "javascript")),
        "ts" | "typescript" => Err(Error::invalid(
            "language",
            format!(
                "bud runs no TypeScript; {}",
                templates::kernel_cells_message("javascript")
            ),
        )),
        other => Err(Error::invalid(
            "language",
            format!("bud runs python and bash (busybox sh) code, not {other}"),
        )),
    }
}

/// A new context of session `id`: `language` (default `python`), starting in `cwd` (empty
/// or none: `home`). Its kernel starts at its first cell.
pub fn create(
    state: &AppState,
    id: &str,
    language: Option<&str>,
    cwd: Option<&str>,
    home: &str,
) -> Result<Context, Error> {
    let e = access::get(state, id)?;
    let language = language.unwrap_or("python");
    // The template's manifest says which kernels it has (one made before manifests lists
    // none, and keeps both), and which name is its kernel runtime's (JavaScript).
    let manifest = e.engine.manifest();
    if let Some(r) = manifest.runtime(language)
        && r.run == Language::Kernel
    {
        return Err(templates::kernel_cells("language", &r.name));
    }
    let kernel = match language_of(language)? {
        Language::Python => "python",
        Language::Shell => "bash",
        Language::Kernel => return Err(templates::kernel_cells("language", language)),
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
    let cwd = cwd.filter(|d| !d.is_empty()).unwrap_or(home);
    if cwd.contains('\0') || cwd.len() > MAX_CWD {
        return Err(Error::invalid(
            "cwd",
            format!("a directory is at most {MAX_CWD} bytes, without a NUL byte"),
        ));
    }
    let name = crate::core::node::random_hex(8).map_err(Error::internal)?;
    e.contexts()
        .add(language, cwd, format!("ctx_{name}"))
        .ok_or_else(|| {
            Error::invalid(
                "contexts",
                format!("a session has at most {} contexts", Contexts::MAX),
            )
        })
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

/// Runs `cell` in a context of session `id` (its kernel started first if it has none), its
/// output to `sink` as it comes; one cell of a context at a time, the next waiting.
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
            (c.kernel, language_of(&c.language)?, c.cwd, c.id)
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

/// Kills context `context`'s kernel: its running cell ends with `DeadKernelError`, its next
/// cell starts a new kernel, empty, back in the context's `cwd`.
pub async fn restart(state: &AppState, id: &str, context: &str) -> Result<(), Error> {
    kill(state, id, get(state, id, context)?.kernel).await
}

/// Kills context `context`'s kernel and forgets the context.
pub async fn remove(state: &AppState, id: &str, context: &str) -> Result<(), Error> {
    restart(state, id, context).await?;
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
    /// `python` (default) or `bash` (JavaScript contexts are not built yet: 400).
    pub language: Option<String>,
    /// Where its kernel starts (default: the session's work directory, `/tmp`).
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
