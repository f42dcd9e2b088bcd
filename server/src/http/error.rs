//! The edge of errors: every way a request can fail, each with its HTTP status and a JSON
//! body `{"error": {"code": ..., "message": ..., "field": ...}}`. The service's refusals
//! ([`Error`]) get theirs here; the compat dialects reshape these for their clients.
//!
//! A failed request never gets a 200. A job that ran and failed (non-zero exit, timeout, ...)
//! is not an error here: it is a 200 carrying the job's status.

use std::time::Duration;

use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

pub use crate::service::error::Error;

/// A request bud did not (or could not) answer with a job result: the service's refusals
/// ([`Error`]) and what only HTTP can get wrong.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Service(#[from] Error),
    /// The body is not JSON, or not the JSON this route takes (400).
    #[error("request body is not valid JSON: {message}")]
    Json {
        field: Option<String>,
        message: String,
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
    /// No such route, or no such thing under a compat route (404).
    #[error("{0}")]
    NotFound(String),
    /// The route exists but not with this method (405).
    #[error("method not allowed")]
    MethodNotAllowed,
    /// An E2B in-sandbox request for a sandbox that is not running (502, as E2B's proxy,
    /// whose words "was not found" E2B's SDK reads as `SandboxNotRunningException`).
    #[error("sandbox {0} was not found: it is not running (ended, or paused)")]
    SandboxGone(String),
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
    /// A signed URL whose signature no sandbox made, or that has expired (401).
    #[error("the URL's signature {0}")]
    BadSignature(&'static str),
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
    /// The node that holds what the request named (`wrong_node`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<&'a str>,
}

impl ApiError {
    /// A field with a wrong value (400).
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Service(Error::invalid(field, message))
    }

    /// No such route (404).
    pub fn no_route(method: &str, path: &str) -> Self {
        ApiError::NotFound(format!("no route for {method} {path}"))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Service(e) => service_status(e),
            ApiError::Json { .. } | ApiError::Body(_) => StatusCode::BAD_REQUEST,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::ContentType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Unauthorized | ApiError::BadSignature(_) => StatusCode::UNAUTHORIZED,
            ApiError::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::SandboxGone(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// The machine-readable `error.code`.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Service(e) => service_code(e),
            ApiError::Json { .. } => "invalid_json",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::Body(_) => "bad_body",
            ApiError::ContentType => "unsupported_media_type",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::Unauthorized => "unauthorized",
            ApiError::BadSignature(_) => "bad_signature",
            ApiError::RequestTimeout { .. } => "request_timeout",
            ApiError::SandboxGone(_) => "sandbox_gone",
        }
    }

    /// The request field at fault, if one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            ApiError::Service(e) => e.field(),
            ApiError::Json { field, .. } => field.as_deref(),
            _ => None,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::Service(e) => e.retry_after(),
            _ => None,
        }
    }

    fn detail(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                code: self.code(),
                message: self.to_string(),
                field: self.field(),
                node: match self {
                    ApiError::Service(Error::WrongNode { node, .. }) => Some(node),
                    _ => None,
                },
            },
        }
    }

    /// The JSON body (also used as the last line of a stream that failed after it started).
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(self.detail()).unwrap_or_default()
    }
}

/// The HTTP status of a service error.
fn service_status(e: &Error) -> StatusCode {
    match e {
        Error::Invalid { .. } | Error::UnknownTemplate { .. } => StatusCode::BAD_REQUEST,
        Error::TooLarge { .. } | Error::TooMany { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        Error::Overloaded { .. }
        | Error::KeyQuota { .. }
        | Error::TooManySessions { .. }
        | Error::TooManyProcesses { .. }
        | Error::TooManyStreams { .. }
        | Error::TooManyBuilds { .. } => StatusCode::TOO_MANY_REQUESTS,
        Error::NotReady { .. }
        | Error::MemoryBudget { .. }
        | Error::ShuttingDown
        | Error::Draining { .. }
        | Error::TemplateFailed { .. }
        | Error::AuditUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        Error::NoSession(_)
        | Error::NoFile(_)
        | Error::NoContext(_)
        | Error::NoProcess { .. }
        | Error::NoSnapshot(_)
        | Error::NoTemplate(_)
        | Error::NoTrace(_) => StatusCode::NOT_FOUND,
        Error::StdinClosed(_)
        | Error::StdinFull { .. }
        | Error::Paused(_)
        | Error::NotPaused(_)
        | Error::Exists(_)
        | Error::TemplateInUse(_)
        | Error::TemplateExists(_)
        | Error::Jailed => StatusCode::CONFLICT,
        Error::NoStateDir | Error::NoBuilds(_) => StatusCode::NOT_IMPLEMENTED,
        Error::StateQuota { .. } | Error::TraceQuota { .. } => StatusCode::INSUFFICIENT_STORAGE,
        Error::Unresumable { .. } => StatusCode::GONE,
        Error::WrongNode { .. } => StatusCode::MISDIRECTED_REQUEST,
        Error::SessionGone { .. } => StatusCode::GONE,
        Error::SessionBusy(_) => StatusCode::CONFLICT,
        Error::OutOfMemory { .. } => StatusCode::INSUFFICIENT_STORAGE,
        Error::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The `error.code` of a service error.
fn service_code(e: &Error) -> &'static str {
    match e {
        Error::Invalid { .. } => "invalid_request",
        Error::TooLarge { .. } => "too_large",
        Error::TooMany { .. } => "too_many",
        Error::Overloaded { .. } => "overloaded",
        Error::KeyQuota { .. } => "key_quota",
        Error::MemoryBudget { .. } => "memory_budget",
        Error::NotReady { .. } => "not_ready",
        Error::UnknownTemplate { .. } => "unknown_template",
        Error::TemplateFailed { .. } => "template_failed",
        Error::NoTemplate(_) => "unknown_template",
        Error::TemplateInUse(_) => "template_in_use",
        Error::Jailed => "jailed",
        Error::TemplateExists(_) => "template_exists",
        Error::NoBuilds(_) => "no_builds",
        Error::TooManyBuilds { .. } => "too_many_builds",
        Error::ShuttingDown => "shutting_down",
        Error::Draining { .. } => "draining",
        Error::WrongNode { .. } => "wrong_node",
        Error::NoSession(_) => "no_session",
        Error::SessionGone { .. } => "session_gone",
        Error::SessionBusy(_) => "session_busy",
        Error::TooManySessions { .. } => "too_many_sessions",
        Error::OutOfMemory { .. } => "out_of_memory",
        Error::NoFile(_) => "no_file",
        Error::NoContext(_) => "no_context",
        Error::NoProcess { .. } => "no_process",
        Error::TooManyProcesses { .. } => "too_many_processes",
        Error::TooManyStreams { .. } => "too_many_streams",
        Error::StdinClosed(_) => "stdin_closed",
        Error::StdinFull { .. } => "stdin_full",
        Error::AuditUnavailable(_) => "audit_unavailable",
        Error::NoStateDir => "no_state_dir",
        Error::Paused(_) => "session_paused",
        Error::NotPaused(_) => "session_running",
        Error::Exists(_) => "session_exists",
        Error::NoSnapshot(_) => "no_snapshot",
        Error::StateQuota { .. } => "state_quota",
        Error::TraceQuota { .. } => "trace_quota",
        Error::NoTrace(_) => "no_trace",
        Error::Unresumable { .. } => "unresumable",
        Error::Internal { .. } => "internal",
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

/// The answer for a route that does not exist (the router's fallback).
pub async fn not_found(req: Request) -> ApiError {
    ApiError::no_route(req.method().as_str(), req.uri().path())
}

/// The answer for a method a route does not take.
pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm::ExecError;
    use vmm::job::JobError;

    #[test]
    fn overload_is_429_with_retry_after() {
        let e = ApiError::Service(Error::Overloaded {
            capacity: 4,
            retry_after: Duration::from_secs(2),
        });

        let r = e.into_response();

        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn body_names_code_message_and_field() {
        let e = ApiError::Service(Error::TooLarge {
            field: "jobs[1].stdin".into(),
            bytes: 10,
            limit: 5,
        });

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
        let nul = ApiError::from(Error::exec(ExecError::Job(JobError::Nul("args")), None));
        let big = ApiError::from(Error::exec(
            ExecError::Job(JobError::TooLarge { bytes: 9, limit: 8 }),
            Some("jobs[0]".into()),
        ));

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
