//! Where a session's file and process operations go ([`Requests`]): the session's VM
//! itself, as its own request (a [`Session`] its caller holds), or the lane beside the
//! request it runs ([`Beside`], [`crate::beside`]). The typed operations of
//! [`crate::files::Files`] and [`crate::process::Processes`] work on either, so the wire
//! form of each operation is written once.

use std::time::Duration;

use crate::beside::Beside;
use crate::executor::Executor;
use crate::job::{Job, JobResult, Kind};
use crate::session::{DEFAULT_INTERRUPT_GRACE, Session, SessionError};

/// Where a session's file and process operations go (module docs).
pub trait Requests {
    /// Runs a file operation ([`crate::protocol::file_op`]) on `path` with `data` as its
    /// input; its output is the result's stdout, its [`crate::protocol::file_status`] the
    /// exit code.
    fn file_op(
        &mut self,
        ex: &Executor,
        op: u32,
        path: &str,
        data: Vec<u8>,
        timeout: Duration,
        output_limit: usize,
    ) -> Result<JobResult, SessionError>;

    /// Runs a process operation ([`crate::protocol::process_op`]): `job` carries its code,
    /// data, args and env.
    fn process_op(
        &mut self,
        ex: &Executor,
        op: u32,
        flags: u32,
        job: &Job,
    ) -> Result<JobResult, SessionError>;
}

/// The job of a file operation on `path` with `data`.
fn file_job(path: &str, data: Vec<u8>, timeout: Duration, output_limit: usize) -> Job {
    let mut j = Job::python(path.as_bytes().to_vec());
    j.stdin = data;
    j.timeout = timeout;
    j.output_limit = output_limit;
    j
}

impl Requests for Beside {
    fn file_op(
        &mut self,
        _: &Executor,
        op: u32,
        path: &str,
        data: Vec<u8>,
        timeout: Duration,
        output_limit: usize,
    ) -> Result<JobResult, SessionError> {
        let j = file_job(path, data, timeout, output_limit);
        Ok(self.call(j, Kind::File(op))?)
    }

    fn process_op(
        &mut self,
        _: &Executor,
        op: u32,
        flags: u32,
        job: &Job,
    ) -> Result<JobResult, SessionError> {
        Ok(self.call(job.clone(), Kind::Process { op, flags })?)
    }
}

impl Requests for Session {
    fn file_op(
        &mut self,
        ex: &Executor,
        op: u32,
        path: &str,
        data: Vec<u8>,
        timeout: Duration,
        output_limit: usize,
    ) -> Result<JobResult, SessionError> {
        let j = file_job(path, data, timeout, output_limit);
        // Interrupted at the cap or the deadline like a cell, so the session survives a file
        // larger than the caller's limit.
        let grace = Some(DEFAULT_INTERRUPT_GRACE);
        self.request(ex, &j, Kind::File(op), grace, &mut |_, _| {})
    }

    fn process_op(
        &mut self,
        ex: &Executor,
        op: u32,
        flags: u32,
        job: &Job,
    ) -> Result<JobResult, SessionError> {
        if op == crate::protocol::process_op::START {
            self.mark_ran_processes();
        }
        // A poll ends by itself when its wait is over: one whose interrupt is slow (the
        // guest starved on a busy host) is waited for, never taken for a hung request
        // that ends the session.
        let grace = if op == crate::protocol::process_op::POLL {
            job.timeout
        } else {
            DEFAULT_INTERRUPT_GRACE
        };
        let grace = Some(grace);
        self.request(ex, job, Kind::Process { op, flags }, grace, &mut |_, _| {})
    }
}
