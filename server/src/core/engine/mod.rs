//! The engine: what runs the service's work on a VM, as one small seam. The service asks
//! an [`Engine`] (one per served template) to run a one-shot job or to start a session's
//! VM, and a session's VM ([`SessionVm`]) to run a cell, fork, and say whether it can go
//! on; it never needs to know whether a KVM guest or a script answers.
//!
//! - [`vmm`]: the real engine, a thin forwarding layer over [`::vmm::Executor`] and
//!   [`::vmm::session::Session`] (what bud serves).
//! - [`fake`] (tests, or the `fake-engine` feature): an engine that answers, crashes,
//!   hangs and starts slowly on command, so admission, queueing, resume, drain and expiry
//!   are tested in milliseconds without `/dev/kvm`.
//!
//! Some session operations still reach the VMM itself (files, background processes, the
//! lane beside a running request, pause and snapshots: they speak the guest's request
//! protocol or write its memory to disk): [`SessionVm::vmm`] hands them the VMM session,
//! and a fake has none (`None`: the operation answers that the VM is gone).
//!
//! This module decides nothing; it only says what an engine can be asked.

pub mod vmm;

#[cfg(any(test, feature = "fake-engine"))]
pub mod fake;

use std::sync::Arc;
use std::time::Duration;

use ::vmm::executor::ExecutorStats;
use ::vmm::job::Stream;
use ::vmm::session::{ForkStats, Session, SessionError};
use ::vmm::{ExecError, Executor, Health, Job, JobResult};

/// Where a job's output goes as it comes.
pub type Output<'a> = &'a mut dyn FnMut(Stream, &[u8]);

/// What a job's result is given to, once, as soon as it is known (a one-shot job's result
/// goes out before its VM is made ready for the next one).
pub type Deliver<'a> = Box<dyn FnOnce(Result<JobResult, ExecError>) + 'a>;

/// One memory layer a session's VM sits on, shared with the sessions it forked from or
/// into: counted once however many sessions share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerShare {
    /// What tells this layer from another (the same for every session that shares it).
    pub id: usize,
    pub bytes: u64,
}

/// One served template's VMs: one-shot jobs and new sessions.
pub trait Engine: Send + Sync + std::fmt::Debug {
    /// Runs `job` in a fresh (or reset) VM; `deliver` gets its result (or why it could not
    /// run) exactly once. On a job thread.
    fn run_then(&self, job: &Job, out: Output<'_>, deliver: Deliver<'_>);

    /// A new session's VM, started from the template. On a job thread.
    fn start(&self) -> Result<Box<dyn SessionVm>, SessionError>;

    /// Counts of its VMs (ready, live, warm, replaced), for `/metrics`.
    fn stats(&self) -> ExecutorStats;

    /// Guest RAM of its VMs, and the size of the memory file they map, bytes.
    fn sizes(&self) -> (u64, u64);

    /// The VMM executor under it, for the operations that are not behind this seam yet
    /// (a one-shot job with files, pause, resume, import); None for an engine without one.
    fn executor(&self) -> Option<&Arc<Executor>>;

    /// What the template offers: its runtimes, kernels, tools, packages, network.
    fn manifest(&self) -> &::vmm::manifest::Manifest;
}

/// A session's VM, kept between requests. Every method runs on a job thread, with the
/// session held.
pub trait SessionVm: Send + std::fmt::Debug {
    /// Runs a cell; a cell stopped (timeout, cancel, output cap) gets `grace` to end
    /// before the VM is given up.
    fn exec(
        &mut self,
        job: &Job,
        grace: Duration,
        out: Output<'_>,
    ) -> Result<JobResult, SessionError>;

    /// Python and shell cells run so far (Jupyter's execution count).
    fn executions(&self) -> u64;

    /// `count` independent copies of its live state; it goes on too.
    fn fork(&mut self, count: usize) -> Result<(Vec<Box<dyn SessionVm>>, ForkStats), SessionError>;

    /// Whether it can take another request, or why not.
    fn health(&self) -> Health;

    /// Its last console lines (a crashed session's report).
    fn console_tail(&self, lines: usize) -> Vec<String>;

    /// Host memory held by it alone, bytes.
    fn private_bytes(&self) -> Result<u64, SessionError>;

    /// The layers it shares with its forks.
    fn layers(&self) -> Vec<LayerShare>;

    /// The lane beside its running request ([`::vmm::beside`]).
    fn beside(&self) -> ::vmm::beside::Beside;

    /// Decides its network card's names and connections from now on (nothing for a VM
    /// without a card).
    fn set_egress(&mut self, egress: Arc<dyn ::vmm::Egress>);

    /// Ends it (reset for reuse, or closed).
    fn end(self: Box<Self>);

    /// The VMM session and its executor, for the operations not behind this seam yet
    /// (module docs); None for a VM without one.
    fn vmm(&mut self) -> Option<(&mut Session, &Arc<Executor>)>;
}
