//! The shapes of the session API: creating one, what it shows, a cell's answer, a fork.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use vmm::Language;

use crate::api::exec::ExecResponse;
use crate::clock::epoch_s;
use crate::sessions::Entry;

/// `POST /v1/sessions`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// Default language of its cells (`python` unless given).
    pub language: Option<Language>,
    /// Environment of every cell.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub idle_timeout_s: Option<u64>,
    pub max_lifetime_s: Option<u64>,
    /// Anything the client wants back in `GET` (at most 4 KiB of JSON).
    #[serde(default)]
    pub metadata: serde_json::Value,
    /// The template to start from (default: the server's default template).
    pub template: Option<String>,
    /// Start from this snapshot instead of the template: its memory, files and processes,
    /// with an identity of its own (settings not given here are the snapshot's).
    pub snapshot: Option<String>,
    /// Pause the session instead of ending it when its idle timeout or lifetime is up
    /// (needs the server's state directory).
    pub auto_pause: Option<bool>,
}

/// A session as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionInfo {
    pub id: String,
    pub created_at: f64,
    pub expires_at: f64,
    pub idle_timeout_s: u64,
    pub language: Language,
    pub execution_count: u64,
    /// Host memory this session holds alone (its private pages).
    pub memory_bytes: u64,
    /// Fork layers it sits on (shared with its relatives).
    pub shared_memory_bytes: u64,
    pub busy: bool,
    /// Requests waiting for it.
    pub waiting: usize,
    pub parent: Option<String>,
    pub metadata: serde_json::Value,
    pub template: String,
    /// `running` or `paused`.
    pub state: String,
    pub auto_pause: bool,
    /// When it paused (a paused session).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<f64>,
}

impl SessionInfo {
    /// A paused session as the API shows it: its lifetime stands still (`expires_at` is
    /// what it would be if it resumed now).
    pub fn paused(p: &crate::durable::Paused) -> Self {
        use crate::durable::from_epoch_ms;
        let r = &p.record;
        let now = std::time::SystemTime::now();
        Self {
            id: r.id.clone(),
            created_at: epoch_s(from_epoch_ms(r.created_at_ms)),
            expires_at: epoch_s(now + std::time::Duration::from_millis(r.lifetime_left_ms)),
            idle_timeout_s: r.idle_timeout_s,
            language: r.language,
            execution_count: 0,
            memory_bytes: 0,
            shared_memory_bytes: 0,
            busy: false,
            waiting: 0,
            parent: r.parent.clone(),
            metadata: r.metadata.clone(),
            template: r.template.clone(),
            state: "paused".into(),
            auto_pause: r.auto_pause,
            paused_at: Some(epoch_s(from_epoch_ms(r.paused_at_ms))),
        }
    }

    pub fn of(e: &Entry) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        Self {
            id: e.id.clone(),
            created_at: epoch_s(e.created_at),
            expires_at: epoch_s(e.expires_at()),
            idle_timeout_s: e.idle_timeout.as_secs(),
            language: e.language,
            execution_count: e.executions.load(Relaxed),
            memory_bytes: e.private_bytes.load(Relaxed),
            shared_memory_bytes: e.layer_bytes.load(Relaxed),
            busy: e.is_busy(),
            waiting: e.waiting(),
            parent: e.parent.clone(),
            metadata: e.metadata.clone(),
            template: e.template.clone(),
            state: "running".into(),
            auto_pause: e.auto_pause.load(Relaxed),
            paused_at: None,
        }
    }
}

/// What a pause wrote.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PauseResponse {
    pub id: String,
    pub state: String,
    /// Size of its file in the state directory; of it, guest memory.
    pub bytes: u64,
    pub memory_bytes: u64,
    /// How long the session was held: state, pages, fsync, and ending its VM.
    pub pause_ms: f64,
}

/// A snapshot as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub id: String,
    /// The session it was taken of.
    pub source: String,
    pub created_at: f64,
    pub template: String,
    pub metadata: serde_json::Value,
    /// Size of its file in the state directory.
    pub bytes: u64,
}

impl SnapshotInfo {
    pub fn of(s: &crate::durable::Snapshot) -> Self {
        let r = &s.record;
        Self {
            id: r.id.clone(),
            source: r.source.clone(),
            created_at: epoch_s(crate::durable::from_epoch_ms(r.created_at_ms)),
            template: r.template.clone(),
            metadata: r.metadata.clone(),
            bytes: s.bytes,
        }
    }
}

/// A cell's result: the job result, plus the displayed value and the execution count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CellResponse {
    #[serde(flatten)]
    pub exec: ExecResponse,
    /// The final expression's value by MIME type (`text/plain`, `text/html`, `image/png` in
    /// base64), as Jupyter's `execute_result`; null when there is none.
    pub result: Option<BTreeMap<String, String>>,
    pub execution_count: u64,
    /// The cell's uncaught exception, for cells run with `error_in_display` (the
    /// code-interpreter compat layer); the native API prints it on stderr instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<vmm::CellError>,
}

impl CellResponse {
    /// The answer for cell result `r`, which waited `waited` for a job thread and was the
    /// session's `execution_count`th; `output_b64`: always give the output in base64 too.
    pub fn new(
        r: vmm::JobResult,
        waited: std::time::Duration,
        execution_count: u64,
        output_b64: bool,
    ) -> Self {
        let result = (!r.display.is_empty()).then(|| {
            r.display
                .iter()
                .map(|d| (d.mime.clone(), d.data.clone()))
                .collect()
        });
        let error = r.error.clone();
        Self {
            exec: ExecResponse::new(r, waited, output_b64),
            result,
            execution_count,
            error,
        }
    }
}

/// Display formats bud's guest adds for the E2B code interpreter (a DataFrame's columns,
/// a chart, what `display()` showed besides the value): the E2B adapter reads them; the
/// native API's `result` does not carry them.
const BUD_FORMATS: &str = "application/vnd.bud.";

impl CellResponse {
    /// The answer of the native session API: the value's formats without bud's own
    /// ([`BUD_FORMATS`]), null when none is left.
    pub fn native(mut self) -> Self {
        if let Some(r) = &mut self.result {
            r.retain(|mime, _| !mime.starts_with(BUD_FORMATS));
            if r.is_empty() {
                self.result = None;
            }
        }
        self
    }
}

/// `POST /v1/sessions/{id}/fork`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    #[serde(default = "one")]
    pub count: usize,
}

fn one() -> usize {
    1
}

/// What a fork made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForkResponse {
    pub ids: Vec<String>,
    /// How long the source was paused (state capture, layer copy, remap).
    pub source_pause_ms: f64,
    /// Creation time of each child.
    pub per_child_ms: f64,
    /// Bytes frozen into the new layer (shared by the source and the children).
    pub layer_bytes: u64,
}

impl ForkResponse {
    /// The answer for children `ids` made at the cost `stats`.
    pub fn new(ids: Vec<String>, stats: &vmm::session::ForkStats) -> Self {
        Self {
            ids,
            source_pause_ms: stats.source_pause.as_secs_f64() * 1e3,
            per_child_ms: stats.per_child.as_secs_f64() * 1e3,
            layer_bytes: stats.layer_bytes,
        }
    }
}

/// `POST /v1/sessions/{id}/contexts`: a code context, a kernel of its own.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CreateContext {
    /// `python` (default) or `bash`.
    pub language: Option<String>,
    /// Where its kernel starts (default: the session's work directory, `/tmp`).
    pub cwd: Option<String>,
}

/// A code context as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContextInfo {
    pub id: String,
    pub language: String,
    pub cwd: String,
}

impl From<&crate::contexts::Context> for ContextInfo {
    fn from(c: &crate::contexts::Context) -> Self {
        Self {
            id: c.id.clone(),
            language: c.language.clone(),
            cwd: c.cwd.clone(),
        }
    }
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
        limits: &crate::config::Limits,
    ) -> Result<(String, BTreeMap<String, String>, std::time::Duration), crate::service::error::Error>
    {
        use crate::api::exec::{check_size, check_timeout};
        check_size("", "code", self.code.len(), limits.max_code_bytes)?;
        let timeout_ms = check_timeout("", self.timeout_ms, limits)?;
        Ok((
            self.code,
            self.env,
            std::time::Duration::from_millis(timeout_ms),
        ))
    }
}
