//! The service: what bud does, whoever asks. Routes, streaming, and every compat dialect
//! (E2B, envd, Jupyter, Piston) are thin adapters over it: they turn their requests into
//! the service's calls and its answers and [`error::Error`]s into their shapes and
//! statuses.
//!
//! - [`admission`]: whether work may enter, and the way to a job thread;
//! - [`jobs`]: one-shot jobs and batches (one submit path; recorded once);
//! - [`access`]: the way to a session's VM for one request (take it in turn, end it if
//!   the request left its VM unusable);
//! - [`sessions`]: start, cell, fork, end, expiry;
//! - [`durable`]: pause, snapshots, auto-pause (the state directory); [`resume`]: a
//!   paused session made again, at the request that wants it;
//! - [`contexts`]: code contexts (make, list, run a cell, restart, remove), whoever asks;
//! - [`kernels`]: code contexts as kernel processes (a client's contexts run side by side);
//! - [`processes`]: a session's background processes and the pump that runs its VM
//!   while they live;
//! - [`files`]: a session's files, a one-shot job's files;
//! - [`network`]: a sandbox's network policy, its gate and its record of connections;
//! - [`templates`]: which executor a request runs on, and whose a template is (under API
//!   keys, a user template its builder's key's alone: [`templates::may_see`]);
//! - [`builds`]: user templates built over HTTP;
//! - [`record`]: a finished job or cell recorded once (metrics, log, audit);
//! - [`task`]: where output goes ([`task::Sink`]), and a call whose output streams, on
//!   its own task;
//! - [`error`]: why a call was refused or failed.
//!
//! The service reads the core ([`crate::core::state`], [`crate::core::sessions`], [`crate::core::jobs`],
//! [`crate::core::audit`], [`crate::core::metrics`]) and never an edge module.

pub mod access;
pub mod admission;
pub mod builds;
pub mod contexts;
pub mod drain;
pub mod durable;
pub mod error;
pub mod files;
pub mod import_check;
pub mod jobs;
pub mod kernels;
pub mod lifecycle;
pub mod network;
pub mod processes;
pub mod record;
pub mod resume;
pub mod sessions;
pub mod task;
pub mod templates;
pub mod trace;

#[cfg(test)]
mod tests;
