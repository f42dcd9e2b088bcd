//! The real engine: KVM VMs through the `vmm` library. Every method forwards to
//! [`Executor`] or [`Session`] unchanged, so the service behaves with real VMs exactly as
//! it did when it called them itself; this file must never grow policy.

use std::sync::Arc;
use std::time::Duration;

use vmm::executor::ExecutorStats;
use vmm::session::{ForkStats, Session, SessionError};
use vmm::{Executor, Health, Job, JobResult};

use super::{Deliver, Engine, LayerShare, Output, SessionVm};

impl Engine for Arc<Executor> {
    fn run_then(&self, job: &Job, out: Output<'_>, deliver: Deliver<'_>) {
        Executor::run_then(self, job, out, deliver);
    }

    fn start(&self) -> Result<Box<dyn SessionVm>, SessionError> {
        let s = Session::start(self)?;
        Ok(Box::new(VmmSession::new(s, self.clone())))
    }

    fn stats(&self) -> ExecutorStats {
        Executor::stats(self)
    }

    fn sizes(&self) -> (u64, u64) {
        let t = self.template();
        (t.state().ram_size, t.memory_file_bytes())
    }

    fn executor(&self) -> Option<&Arc<Executor>> {
        Some(self)
    }

    fn manifest(&self) -> &::vmm::manifest::Manifest {
        self.template().manifest()
    }
}

/// A session's VM on the executor of its template.
#[derive(Debug)]
pub struct VmmSession {
    session: Session,
    executor: Arc<Executor>,
}

impl VmmSession {
    pub fn new(session: Session, executor: Arc<Executor>) -> Self {
        Self { session, executor }
    }
}

impl SessionVm for VmmSession {
    fn exec(
        &mut self,
        job: &Job,
        grace: Duration,
        out: Output<'_>,
    ) -> Result<JobResult, SessionError> {
        self.session.exec(&self.executor, job, grace, out)
    }

    fn executions(&self) -> u64 {
        self.session.executions()
    }

    fn fork(&mut self, count: usize) -> Result<(Vec<Box<dyn SessionVm>>, ForkStats), SessionError> {
        let (children, stats) = self.session.fork(&self.executor, count)?;
        let children = children
            .into_iter()
            .map(|c| Box::new(VmmSession::new(c, self.executor.clone())) as Box<dyn SessionVm>)
            .collect();
        Ok((children, stats))
    }

    fn health(&self) -> Health {
        self.session.health().clone()
    }

    fn console_tail(&self, lines: usize) -> Vec<String> {
        self.session.console_tail(lines)
    }

    fn private_bytes(&self) -> Result<u64, SessionError> {
        self.session.private_bytes()
    }

    fn layers(&self) -> Vec<LayerShare> {
        self.session
            .layers()
            .iter()
            .map(|l| LayerShare {
                id: Arc::as_ptr(l) as *const () as usize,
                bytes: l.bytes(),
            })
            .collect()
    }

    fn beside(&self) -> vmm::beside::Beside {
        self.session.beside()
    }

    fn set_egress(&mut self, egress: Arc<dyn vmm::Egress>) {
        self.session.set_egress(egress);
    }

    fn end(self: Box<Self>) {
        self.session.end(&self.executor);
    }

    fn vmm(&mut self) -> Option<(&mut Session, &Arc<Executor>)> {
        Some((&mut self.session, &self.executor))
    }
}

/// `ex` as an engine.
pub fn engine(ex: &Arc<Executor>) -> Arc<dyn Engine> {
    Arc::new(ex.clone())
}

/// VMM session `s` on `ex` as a session's VM.
pub fn session(s: Session, ex: &Arc<Executor>) -> Box<dyn SessionVm> {
    Box::new(VmmSession::new(s, ex.clone()))
}
