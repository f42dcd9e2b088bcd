//! Why the service did not do what it was asked: the errors of jobs, sessions, files and
//! templates, in the service's own words. No HTTP here: the edge ([`crate::http::error`]) gives
//! each its status and code, and every compat dialect its own shape.
//!
//! A job that ran and failed (a non-zero exit, a timeout, ...) is not an error: it is a
//! result carrying the job's status.

use std::time::Duration;

use vmm::ExecError;
use vmm::job::JobError;

/// A request the service refused or could not carry out.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A field has a wrong value.
    #[error("{message}")]
    Invalid {
        field: Option<String>,
        message: String,
    },
    /// A field is over its size limit.
    #[error("{field} is {bytes} bytes; the limit is {limit}")]
    TooLarge {
        field: String,
        bytes: usize,
        limit: usize,
    },
    /// A list is longer than its limit.
    #[error("{field} holds {count} entries; the limit is {limit}")]
    TooMany {
        field: String,
        count: usize,
        limit: usize,
    },
    /// No room in the admission queue.
    #[error("the server is running and queueing {capacity} jobs, its limit; retry later")]
    Overloaded {
        capacity: usize,
        retry_after: Duration,
    },
    /// The request's API key has its quota of jobs admitted.
    #[error(
        "key {key} already has {quota} jobs running or queued, its quota (--key-max-jobs); retry later"
    )]
    KeyQuota {
        key: String,
        quota: usize,
        retry_after: Duration,
    },
    /// The server's private memory is over `--memory-budget-mib`.
    #[error(
        "the server holds {used} bytes of private memory, over its budget of {budget} (--memory-budget-mib); retry later"
    )]
    MemoryBudget {
        used: u64,
        budget: u64,
        retry_after: Duration,
    },
    /// The template is still being built or loaded.
    #[error("template `{template}` is not ready yet (it is being built or loaded)")]
    NotReady {
        template: String,
        retry_after: Duration,
    },
    /// A request named a template the server does not serve.
    #[error("unknown template `{name}`; this server serves: {}", .served.join(", "))]
    UnknownTemplate {
        name: String,
        served: Vec<String>,
        field: String,
    },
    /// The template could not be prepared.
    #[error("template `{name}` could not be prepared: {why}")]
    TemplateFailed { name: String, why: String },
    /// A template to add has nothing to load (no guest build), or one to remove is not
    /// served.
    #[error("{0}")]
    NoTemplate(String),
    /// A template cannot be removed now: the default one, or one that live sessions run on.
    #[error("{0}")]
    TemplateInUse(String),
    /// Templates cannot be added or removed under the jail's filters.
    #[error(
        "the served templates are fixed once the jail's filters are on (adding one may boot it, which they do not allow): serve it with --templates, build it with POST /v1/templates, or run with --no-jail"
    )]
    Jailed,
    /// A user template to build is named like one served, built in, or building.
    #[error("{0}")]
    TemplateExists(String),
    /// As many user templates are building as the server allows at once.
    #[error(
        "{limit} template builds are running, the server's limit (--template-builds); retry later"
    )]
    TooManyBuilds { limit: usize },
    /// This server builds no user templates (no builder, or `--template-builds 0`).
    #[error("{0}")]
    NoBuilds(String),
    /// The server is finishing in-flight jobs before it stops.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The node drains: it takes no new sessions or jobs (another node will).
    #[error("node {node} is draining: it takes no new sessions or jobs; send them to another node")]
    Draining { node: String },
    /// The id names another node, and this one does not hold it.
    #[error("{id} lives on node {node}; this is node {here}: send its requests to node {node}")]
    WrongNode {
        id: String,
        node: String,
        here: String,
    },
    /// No live or ended session has this id.
    #[error("no session {0}")]
    NoSession(String),
    /// The session has ended: why, and for a crash the console's last lines.
    #[error("session {id} has ended: {reason}{}", detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    SessionGone {
        id: String,
        reason: String,
        detail: Option<String>,
    },
    /// A request runs in the session and as many as may wait for it already do.
    #[error(
        "session {0} is busy: a request runs in it and --session-max-waiting more wait for it; retry later"
    )]
    SessionBusy(String),
    /// The live-session cap is reached.
    #[error("{limit} sessions are live, the server's limit; delete one or retry later")]
    TooManySessions { limit: usize, retry_after: Duration },
    /// Sessions hold as much host memory as the server allows.
    #[error("sessions hold {used} bytes of host memory; the limit is {limit}")]
    OutOfMemory { used: u64, limit: u64 },
    /// No such process in the session (or it has ended, for what needs a live one).
    #[error("{message}")]
    NoProcess { pid: u32, message: String },
    /// The session has as many live processes as it may.
    #[error(
        "the sandbox has {limit} processes running, its limit (--session-max-processes); wait for one to end or kill one"
    )]
    TooManyProcesses { limit: usize },
    /// The session's processes and watchers have as many clients connected as they may.
    #[error(
        "the sandbox has {limit} output and watch streams open, its limit; close one or retry later"
    )]
    TooManyStreams { limit: usize },
    /// The process has no open stdin (started without one, or closed).
    #[error("process {0} has no open stdin")]
    StdinClosed(u32),
    /// The process did not read its stdin within the time a write may wait.
    #[error("process {pid} did not read its stdin: {left} bytes were not written")]
    StdinFull { pid: u32, left: usize },
    /// No such file in the session.
    #[error("{0}")]
    NoFile(String),
    /// No such code context in the session.
    #[error("{0}")]
    NoContext(String),
    /// The server has no state directory, so nothing is paused or snapshotted.
    #[error(
        "this server keeps no state directory (--state-dir): it cannot pause, resume or snapshot"
    )]
    NoStateDir,
    /// The session is paused, and this call needs it running.
    #[error("session {0} is paused; resume it first")]
    Paused(String),
    /// The session runs, and this call needs it paused.
    #[error("session {0} is running; pause it first")]
    NotPaused(String),
    /// A session with this id exists already (live or paused).
    #[error("a session {0} exists already on this server")]
    Exists(String),
    /// No snapshot has this id.
    #[error("no snapshot {0}")]
    NoSnapshot(String),
    /// The state directory's files would pass its quota.
    #[error(
        "the state directory holds {used} bytes and this needs about {need} more; its quota is {quota} (--state-quota-mib)"
    )]
    StateQuota { used: u64, need: u64, quota: u64 },
    /// `--trace-over-quota refuse` and the session traces are at their quota.
    #[error(
        "the session traces hold {used} bytes, their quota is {quota} (--trace-quota-mib); no new session until ended traces expire (--trace-retention-hours)"
    )]
    TraceQuota { used: u64, quota: u64 },
    /// No trace of this session is kept.
    #[error("no trace of session {0} is kept here")]
    NoTrace(String),
    /// A paused session or snapshot cannot be made into a session again: why.
    #[error("{id} cannot be resumed: {why}")]
    Unresumable { id: String, why: String },
    /// `--audit-required` and the audit log cannot be written.
    #[error("the audit log cannot be written, so no job runs: {0}")]
    AuditUnavailable(String),
    /// bud could not run the job at all: a clone or vCPU failure, or a bug of ours.
    #[error("could not run the job: {message}")]
    Internal {
        field: Option<String>,
        message: String,
    },
}

/// The service's error for a session that cannot take a request.
pub fn unavailable(id: &str, u: crate::core::sessions::Unavailable) -> Error {
    use crate::core::sessions::Unavailable;
    match u {
        Unavailable::Unknown => Error::NoSession(id.to_owned()),
        Unavailable::Busy => Error::SessionBusy(id.to_owned()),
        Unavailable::Gone(e) => Error::SessionGone {
            id: id.to_owned(),
            reason: e.reason,
            detail: e.detail,
        },
    }
}

impl Error {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Invalid {
            field: Some(field.into()),
            message: message.into(),
        }
    }

    /// A failure of bud's own (500): `e` says what.
    /// The error for a request here of `id`, if `id` names a node other than `here`.
    pub fn wrong_node(here: &crate::core::node::Node, id: &str) -> Option<Self> {
        here.elsewhere(id).map(|node| Error::WrongNode {
            id: id.to_owned(),
            node: node.to_owned(),
            here: here.id().to_owned(),
        })
    }

    /// A session request's failure: a VM whose guest memory holds no clock or identity
    /// bud can set (a session file's pages that are not a guest's) is 410 `unresumable`,
    /// the session ended; anything else is bud's own failure.
    pub fn of_session(id: &str, e: vmm::session::SessionError) -> Self {
        match e {
            vmm::session::SessionError::Identity(_) => Error::Unresumable {
                id: id.to_owned(),
                why: e.to_string(),
            },
            e => Error::internal(e),
        }
    }

    pub fn internal(e: impl std::fmt::Display) -> Self {
        Error::Internal {
            field: None,
            message: e.to_string(),
        }
    }

    /// An executor failure for the job named by `field` (`None` for a single job). Failures
    /// that are the request's fault stay the request's.
    pub fn exec(e: ExecError, field: Option<String>) -> Self {
        let at = |name: &str| match &field {
            Some(f) => format!("{f}.{name}"),
            None => name.to_string(),
        };
        match e {
            ExecError::Job(JobError::TooLarge { bytes, limit }) => Error::TooLarge {
                field: field.unwrap_or_else(|| "request".into()),
                bytes,
                limit,
            },
            ExecError::Job(JobError::Nul(what)) => {
                Error::invalid(at(what), format!("{what} must not contain NUL bytes"))
            }
            ExecError::Job(e @ JobError::BadEnv(_)) => Error::invalid(at("env"), e.to_string()),
            e => Error::Internal {
                field,
                message: e.to_string(),
            },
        }
    }

    /// The request field at fault, if one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            Error::Invalid { field, .. } | Error::Internal { field, .. } => field.as_deref(),
            Error::TooLarge { field, .. } | Error::TooMany { field, .. } => Some(field),
            Error::UnknownTemplate { field, .. } => Some(field),
            _ => None,
        }
    }

    /// When a refused request may be tried again.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::Overloaded { retry_after, .. }
            | Error::KeyQuota { retry_after, .. }
            | Error::MemoryBudget { retry_after, .. }
            | Error::NotReady { retry_after, .. }
            | Error::TooManySessions { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// The same error, reported against `field` when it names none of its own (a batch's
    /// job).
    pub fn in_field(self, field: &str) -> Self {
        match self {
            Error::UnknownTemplate { name, served, .. } => Error::UnknownTemplate {
                name,
                served,
                field: field.to_owned(),
            },
            other => other,
        }
    }
}
