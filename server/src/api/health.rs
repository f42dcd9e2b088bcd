//! `GET /v1/health`: what a load balancer and an operator read.

use serde::{Deserialize, Serialize};

/// `GET /v1/health`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Health {
    /// `ok` or `starting`.
    pub status: String,
    pub template_ready: bool,
    /// The template's key (its directory name), once ready.
    pub template: Option<String>,
    pub version: String,
    pub host_kind: String,
    pub workers: usize,
    pub queue_capacity: usize,
    pub jobs_running: usize,
    pub jobs_queued: usize,
    pub pool_size: usize,
    pub pool_ready: usize,
    pub live_clones: usize,
    /// Reset VMs waiting for a job.
    pub warm_vms: usize,
    /// `warm` (VMs reset and reused) or `fresh` (a fresh clone per job).
    pub reuse: String,
    /// The audit log's state, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditHealth>,
    /// The jail is closed: seccomp filters on (the default; not with `--no-jail` or where
    /// the host cannot install them), and privileges dropped with `--user`.
    #[serde(default)]
    pub jailed: bool,
    /// This node's id, which its session and snapshot ids carry (docs/cluster.md).
    #[serde(default)]
    pub node: String,
    /// The node drains: it takes no new sessions or jobs, and still serves its sessions.
    #[serde(default)]
    pub draining: bool,
}

/// The audit log in `GET /v1/health`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuditHealth {
    /// Records written.
    pub written: u64,
    /// Records lost (queue full or the file not writable).
    pub dropped: u64,
    /// The last write (or the queue) failed; with `--audit-required` jobs are refused.
    pub failing: bool,
    /// The last failure.
    pub error: Option<String>,
}
