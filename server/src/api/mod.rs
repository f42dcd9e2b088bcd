//! The native API's JSON shapes: what a request says and what its answer shows, with the
//! checks that turn a request into the service's terms. The compat dialects build these
//! requests too (they speak to the same service).
//!
//! - [`exec`]: a job (and a batch): its request, its checks, its answer;
//! - [`sessions`]: sessions, cells and forks;
//! - [`health`]: `GET /v1/health`.

pub mod exec;
pub mod health;
pub mod processes;
pub mod sessions;

pub use exec::{
    BatchRequest, BatchResponse, ExecRequest, ExecResponse, JobFiles, RichResult, Timings,
    check_relative, text_and_b64,
};
pub use health::{AuditHealth, Health};
pub use sessions::{
    CellResponse, ContextCell, ContextInfo, CreateContext, CreateSession, ForkRequest,
    ForkResponse, SessionInfo,
};
