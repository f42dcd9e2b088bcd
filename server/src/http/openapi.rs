//! `GET /v1/openapi.json`: the API described in OpenAPI 3.1.
//!
//! The document is hand-written (`openapi.json` beside this file); the limits in it are the
//! defaults, replaced by the running server's own limits when served. A test checks that it
//! documents exactly the routes in [`crate::ROUTES`], and that those are the router's routes.

use axum::Json;
use axum::extract::State;
use serde_json::Value;

use crate::core::config::Limits;
use crate::core::state::AppState;

/// The document as written, with default limits.
pub const DOCUMENT: &str = include_str!("openapi.json");

/// The document with this server's version and limits.
pub fn document(limits: &Limits) -> Value {
    let mut doc: Value = serde_json::from_str(DOCUMENT).unwrap_or_default();
    doc["info"]["version"] = env!("CARGO_PKG_VERSION").into();
    let schemas = &mut doc["components"]["schemas"];
    let props = &mut schemas["ExecRequest"]["properties"];
    props["timeout_ms"]["maximum"] = limits.max_timeout_ms.into();
    props["timeout_ms"]["default"] = limits.default_timeout_ms.into();
    props["output_limit"]["maximum"] = limits.max_output_bytes.into();
    props["output_limit"]["default"] = limits.max_output_bytes.into();
    schemas["BatchRequest"]["properties"]["jobs"]["maxItems"] = limits.max_batch_jobs.into();
    doc
}

/// `GET /v1/openapi.json`.
pub async fn serve(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(document(&state.config().limits))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn documented_routes(doc: &Value) -> BTreeSet<(String, String)> {
        let mut routes = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            // `parameters` is the path item's shared parameters, not a method.
            for method in item
                .as_object()
                .unwrap()
                .keys()
                .filter(|k| *k != "parameters")
            {
                routes.insert((method.clone(), path.clone()));
            }
        }
        routes
    }

    #[test]
    fn the_document_covers_every_route_and_no_other() {
        let doc = document(&Limits::default());

        let expected: BTreeSet<(String, String)> = crate::ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();

        assert_eq!(doc["openapi"], "3.1.0");
        assert_eq!(documented_routes(&doc), expected);
    }

    #[test]
    fn every_reference_resolves() {
        let doc = document(&Limits::default());
        let text = doc.to_string();

        for piece in text.split("\"$ref\":\"#/").skip(1) {
            let target = piece.split('"').next().unwrap();
            let found = target.split('/').fold(&doc, |v, key| &v[key]);
            assert!(!found.is_null(), "dangling $ref #/{target}");
        }
    }

    #[test]
    fn served_limits_are_the_servers() {
        let limits = Limits {
            max_timeout_ms: 1234,
            max_batch_jobs: 3,
            ..Limits::default()
        };

        let doc = document(&limits);

        let props = &doc["components"]["schemas"]["ExecRequest"]["properties"];
        assert_eq!(props["timeout_ms"]["maximum"], 1234);
        assert_eq!(
            doc["components"]["schemas"]["BatchRequest"]["properties"]["jobs"]["maxItems"],
            3
        );
    }

    #[test]
    fn every_error_code_is_documented() {
        let doc = document(&Limits::default());
        let codes = &doc["components"]["schemas"]["ErrorDetail"]["properties"]["code"]["enum"];
        use crate::http::error::{ApiError, Error};
        let d = std::time::Duration::from_secs(1);
        let service = [
            Error::invalid("f", "m"),
            Error::TooLarge {
                field: String::new(),
                bytes: 1,
                limit: 1,
            },
            Error::TooMany {
                field: String::new(),
                count: 1,
                limit: 1,
            },
            Error::Overloaded {
                capacity: 1,
                retry_after: d,
            },
            Error::KeyQuota {
                key: String::new(),
                quota: 1,
                retry_after: d,
            },
            Error::MemoryBudget {
                used: 1,
                budget: 1,
                retry_after: d,
            },
            Error::NotReady {
                template: String::new(),
                retry_after: d,
            },
            Error::UnknownTemplate {
                name: String::new(),
                served: Vec::new(),
                field: String::new(),
            },
            Error::TemplateFailed {
                name: String::new(),
                why: String::new(),
            },
            Error::NoTemplate(String::new()),
            Error::TemplateInUse(String::new()),
            Error::Jailed,
            Error::ShuttingDown,
            Error::NoSession(String::new()),
            Error::SessionGone {
                id: String::new(),
                reason: String::new(),
                detail: None,
            },
            Error::SessionBusy(String::new()),
            Error::TooManySessions {
                limit: 1,
                retry_after: d,
            },
            Error::OutOfMemory { used: 1, limit: 1 },
            Error::NoFile(String::new()),
            Error::NoContext(String::new()),
            Error::NoProcess {
                pid: 1,
                message: String::new(),
            },
            Error::TooManyProcesses { limit: 1 },
            Error::TooManyStreams { limit: 1 },
            Error::StdinClosed(1),
            Error::StdinFull { pid: 1, left: 1 },
            Error::AuditUnavailable(String::new()),
            Error::NoStateDir,
            Error::Paused(String::new()),
            Error::NotPaused(String::new()),
            Error::Exists(String::new()),
            Error::NoSnapshot(String::new()),
            Error::StateQuota {
                used: 1,
                need: 1,
                quota: 1,
            },
            Error::Unresumable {
                id: String::new(),
                why: String::new(),
            },
            Error::TraceQuota { used: 1, quota: 1 },
            Error::NoTrace(String::new()),
            Error::internal("x"),
        ];
        let edge = [
            ApiError::Json {
                field: None,
                message: String::new(),
            },
            ApiError::BodyTooLarge { limit: 1 },
            ApiError::Body(String::new()),
            ApiError::ContentType,
            ApiError::NotFound(String::new()),
            ApiError::MethodNotAllowed,
            ApiError::SandboxGone(String::new()),
            ApiError::RequestTimeout {
                part: "body",
                after: d,
            },
            ApiError::Unauthorized,
            ApiError::BadSignature("x"),
        ];
        let errors = service.into_iter().map(ApiError::from).chain(edge);

        for e in errors {
            assert!(
                codes.as_array().unwrap().contains(&e.code().into()),
                "{}",
                e.code()
            );
        }
    }
}
