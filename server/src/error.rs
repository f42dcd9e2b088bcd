//! Every way a request can fail, each with its HTTP status and a JSON body
//! `{"error": {"code": ..., "message": ..., "field": ...}}`.
//!
//! A failed request never gets a 200. A job that ran and failed (non-zero exit, timeout, ...)
//! is not an error here: it is a 200 carrying the job's status.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use vmm::ExecError;
use vmm::job::JobError;

/// A request bud did not (or could not) answer with a job result.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field has a wrong value (400).
    #[error("{message}")]
    Invalid {
        field: Option<String>,
        message: String,
    },
    /// The body is not JSON, or not the JSON this route takes (400).
    #[error("request body is not valid JSON: {message}")]
    Json {
        field: Option<String>,
        message: String,
    },
    /// A field is over its size limit (413).
    #[error("{field} is {bytes} bytes; the limit is {limit}")]
    TooLarge {
        field: String,
        bytes: usize,
        limit: usize,
    },
    /// A list is longer than its limit (413).
    #[error("{field} holds {count} entries; the limit is {limit}")]
    TooMany {
        field: String,
        count: usize,
        limit: usize,
    },
    /// The body is over the body limit (413).
    #[error("request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The body could not be read (400).
    #[error("cannot read the request body: {0}")]
    Body(String),
    /// Wrong or missing `Content-Type` (415).
    #[error("Content-Type must be application/json")]
    ContentType,
    /// No room in the admission queue (429, `Retry-After`).
    #[error("the server is running and queueing {capacity} jobs, its limit; retry later")]
    Overloaded {
        capacity: usize,
        retry_after: Duration,
    },
    /// The request's API key has its quota of jobs admitted (429, `Retry-After`).
    #[error(
        "key {key} already has {quota} jobs running or queued, its quota (--key-max-jobs); retry later"
    )]
    KeyQuota {
        key: String,
        quota: usize,
        retry_after: Duration,
    },
    /// The server's private memory is over `--memory-budget-mib` (503, `Retry-After`).
    #[error(
        "the server holds {used} bytes of private memory, over its budget of {budget} (--memory-budget-mib); retry later"
    )]
    MemoryBudget {
        used: u64,
        budget: u64,
        retry_after: Duration,
    },
    /// The template is still being built or loaded (503, `Retry-After`).
    #[error("template `{template}` is not ready yet (it is being built or loaded)")]
    NotReady {
        template: String,
        retry_after: Duration,
    },
    /// A request named a template the server does not serve (400).
    #[error("unknown template `{name}`; this server serves: {}", .served.join(", "))]
    UnknownTemplate {
        name: String,
        served: Vec<String>,
        field: String,
    },
    /// The template could not be prepared (503).
    #[error("template `{name}` could not be prepared: {why}")]
    TemplateFailed { name: String, why: String },
    /// The server is finishing in-flight jobs before it stops (503).
    #[error("the server is shutting down")]
    ShuttingDown,
    /// No such route (404).
    #[error("no route for {0}")]
    NotFound(String),
    /// The route exists but not with this method (405).
    #[error("method not allowed")]
    MethodNotAllowed,
    /// No live or ended session has this id (404).
    #[error("no session {0}")]
    NoSession(String),
    /// The session has ended (410): why, and for a crash the console's last lines.
    #[error("session {id} has ended: {reason}{}", detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    SessionGone {
        id: String,
        reason: String,
        detail: Option<String>,
    },
    /// A request is already running in the session (409).
    #[error("session {0} is running another request; one at a time")]
    SessionBusy(String),
    /// The live-session cap is reached (429, `Retry-After`).
    #[error("{limit} sessions are live, the server's limit; delete one or retry later")]
    TooManySessions { limit: usize, retry_after: Duration },
    /// Sessions hold as much host memory as the server allows (507).
    #[error("sessions hold {used} bytes of host memory; the limit is {limit}")]
    OutOfMemory { used: u64, limit: u64 },
    /// No such file in the session (404).
    #[error("{0}")]
    NoFile(String),
    /// An E2B in-sandbox request for a sandbox that is not running (502, as E2B's proxy).
    #[error("sandbox {0} is not running")]
    SandboxGone(String),
    /// `--audit-required` and the audit log cannot be written (503).
    #[error("the audit log cannot be written, so no job runs: {0}")]
    AuditUnavailable(String),
    /// The request's head or body did not arrive in time (408).
    #[error("the request {part} did not arrive within {after:?}")]
    RequestTimeout {
        /// `headers` or `body`.
        part: &'static str,
        after: std::time::Duration,
    },
    /// Keys are configured and the request presented none of them (401).
    #[error("a valid API key is required (Authorization: Bearer KEY, or X-API-Key: KEY)")]
    Unauthorized,
    /// bud could not run the job at all (500): a clone or vCPU failure.
    #[error("could not run the job: {message}")]
    Internal {
        field: Option<String>,
        message: String,
    },
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

/// The `error` object of an error response.
#[derive(Debug, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ErrorDetail<'a> {
    pub code: &'a str,
    pub message: String,
    pub field: Option<&'a str>,
}

impl ApiError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Invalid {
            field: Some(field.into()),
            message: message.into(),
        }
    }

    /// An executor failure for the job named by `field` (`None` for a single job). Failures
    /// that are the request's fault keep their 400/413.
    pub fn exec(e: ExecError, field: Option<String>) -> Self {
        let at = |name: &str| match &field {
            Some(f) => format!("{f}.{name}"),
            None => name.to_string(),
        };
        match e {
            ExecError::Job(JobError::TooLarge { bytes, limit }) => ApiError::TooLarge {
                field: field.unwrap_or_else(|| "request".into()),
                bytes,
                limit,
            },
            ExecError::Job(JobError::Nul(what)) => {
                ApiError::invalid(at(what), format!("{what} must not contain NUL bytes"))
            }
            ExecError::Job(e @ JobError::BadEnv(_)) => ApiError::invalid(at("env"), e.to_string()),
            e => ApiError::Internal {
                field,
                message: e.to_string(),
            },
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Invalid { .. } | ApiError::Json { .. } | ApiError::Body(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::TooLarge { .. }
            | ApiError::TooMany { .. }
            | ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::ContentType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Overloaded { .. } | ApiError::KeyQuota { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::NotReady { .. }
            | ApiError::MemoryBudget { .. }
            | ApiError::ShuttingDown
            | ApiError::TemplateFailed { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::UnknownTemplate { .. } => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) | ApiError::NoSession(_) | ApiError::NoFile(_) => {
                StatusCode::NOT_FOUND
            }
            ApiError::SessionGone { .. } => StatusCode::GONE,
            ApiError::SessionBusy(_) => StatusCode::CONFLICT,
            ApiError::TooManySessions { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::OutOfMemory { .. } => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::AuditUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::SandboxGone(_) => StatusCode::BAD_GATEWAY,
            ApiError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The machine-readable `error.code`.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Invalid { .. } => "invalid_request",
            ApiError::Json { .. } => "invalid_json",
            ApiError::TooLarge { .. } => "too_large",
            ApiError::TooMany { .. } => "too_many",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::Body(_) => "bad_body",
            ApiError::ContentType => "unsupported_media_type",
            ApiError::Overloaded { .. } => "overloaded",
            ApiError::KeyQuota { .. } => "key_quota",
            ApiError::MemoryBudget { .. } => "memory_budget",
            ApiError::NotReady { .. } => "not_ready",
            ApiError::UnknownTemplate { .. } => "unknown_template",
            ApiError::TemplateFailed { .. } => "template_failed",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::NotFound(_) => "not_found",
            ApiError::NoSession(_) => "no_session",
            ApiError::SessionGone { .. } => "session_gone",
            ApiError::SessionBusy(_) => "session_busy",
            ApiError::TooManySessions { .. } => "too_many_sessions",
            ApiError::OutOfMemory { .. } => "out_of_memory",
            ApiError::NoFile(_) => "no_file",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::Unauthorized => "unauthorized",
            ApiError::RequestTimeout { .. } => "request_timeout",
            ApiError::AuditUnavailable(_) => "audit_unavailable",
            ApiError::SandboxGone(_) => "sandbox_gone",
            ApiError::Internal { .. } => "internal",
        }
    }

    /// The request field at fault, if one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            ApiError::Invalid { field, .. }
            | ApiError::Json { field, .. }
            | ApiError::Internal { field, .. } => field.as_deref(),
            ApiError::TooLarge { field, .. } | ApiError::TooMany { field, .. } => Some(field),
            ApiError::UnknownTemplate { field, .. } => Some(field),
            _ => None,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::Overloaded { retry_after, .. }
            | ApiError::KeyQuota { retry_after, .. }
            | ApiError::MemoryBudget { retry_after, .. }
            | ApiError::NotReady { retry_after, .. }
            | ApiError::TooManySessions { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    fn detail(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                code: self.code(),
                message: self.to_string(),
                field: self.field(),
            },
        }
    }

    /// The same error, reported against `field` when it names none (a batch's job).
    pub fn in_field(self, field: &str) -> Self {
        match self {
            ApiError::UnknownTemplate { name, served, .. } => ApiError::UnknownTemplate {
                name,
                served,
                field: field.to_owned(),
            },
            other => other,
        }
    }

    /// The JSON body (also used as the last line of a stream that failed after it started).
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(self.detail()).unwrap_or_default()
    }
}

impl ApiError {
    /// This error's status and Retry-After with `body`: bud's own error body
    /// (`into_response`), or the compat layers' in their clients' shapes.
    pub fn respond_with(&self, body: serde_json::Value) -> Response {
        let mut response = (self.status(), axum::Json(body)).into_response();
        if let Some(after) = self.retry_after() {
            let secs = after.as_secs().max(1);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.respond_with(self.body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overload_is_429_with_retry_after() {
        let e = ApiError::Overloaded {
            capacity: 4,
            retry_after: Duration::from_secs(2),
        };

        let r = e.into_response();

        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn body_names_code_message_and_field() {
        let e = ApiError::TooLarge {
            field: "jobs[1].stdin".into(),
            bytes: 10,
            limit: 5,
        };

        let body = e.body();

        assert_eq!(body["error"]["code"], "too_large");
        assert_eq!(body["error"]["field"], "jobs[1].stdin");
        assert_eq!(
            body["error"]["message"],
            "jobs[1].stdin is 10 bytes; the limit is 5"
        );
    }

    #[test]
    fn job_errors_that_are_the_requests_fault_stay_client_errors() {
        let nul = ApiError::exec(ExecError::Job(JobError::Nul("args")), None);
        let big = ApiError::exec(
            ExecError::Job(JobError::TooLarge { bytes: 9, limit: 8 }),
            Some("jobs[0]".into()),
        );

        assert_eq!(
            (nul.status(), nul.field()),
            (StatusCode::BAD_REQUEST, Some("args"))
        );
        assert_eq!(
            (big.status(), big.field()),
            (StatusCode::PAYLOAD_TOO_LARGE, Some("jobs[0]"))
        );
    }
}
