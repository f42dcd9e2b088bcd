//! Requests beside the one a session's VM runs: a file read while a cell computes, a
//! command started, its output polled, while the cell goes on.
//!
//! A VM runs one request at a time through lane 0 of its mailbox, on the thread that owns
//! it (the cell's: a cell can run for minutes). Lane 1 ([`crate::protocol::lane`]) carries
//! one more. Any thread may hand a request to a session's [`Beside`]; it is queued and the
//! vCPU kicked. The run loop of the main request ([`crate::job::run`]) takes it at that
//! stop, as it takes everything else, on its own thread:
//! - it writes the request into lane 1 (the vCPU is stopped) and puts the lane byte on the
//!   console;
//! - the worker's lane thread (`guest/python/bud_beside.py`) serves it while the cell runs
//!   and rings FLUSH and DONE with the lane's bit;
//! - the loop takes the output at those stops and hands the answer back.
//!
//! One lane request is in the guest at a time; the rest wait in the queue (at most
//! [`MAX_QUEUED`]). A lane poll waits in the guest until something happens; a queued request
//! ends that wait (the lane's `job::INTERRUPT` set, and the lane byte again), so it is
//! answered first.
//!
//! What goes beside what ([`Accepts`]): file operations beside any request of a session;
//! process operations (start, poll, stdin, signal, resize, watch) only beside a cell, as the
//! worker's main thread uses the same process table for its own process requests.
//!
//! **The end of the main request.** Its thread closes the lane. Queued requests are answered
//! [`BesideError::NotOpen`], and their caller runs them as the VM's own request, after it.
//! The worker holds the lane from before its DONE until it is resumed, so a request sent but
//! unanswered at DONE was never started: the host takes it back (0 as its sequence number,
//! which the guest skips) and answers it `NotOpen` too. A guest that breaks this harms only
//! its own session.
//!
//! Why a second lane rather than a second vCPU: a vCPU is a host thread, a guest scheduler
//! on two CPUs, and twice the KVM state for every snapshot, fork and reset; the lane is 4 MiB
//! of the worker's memory and a thread that sleeps until it is used.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::Duration;

use crate::job::{Collected, Kind, Request, end_from_outcome, write_request};
use crate::job::{Job, JobError, JobResult, Status};
use crate::mailbox::Mailbox;
use crate::protocol::{job, lane, process_op, result};
use crate::vcpu::Kicker;
use crate::vm::Machine;

/// Requests waiting beside a running one, at most.
pub const MAX_QUEUED: usize = 32;

/// How long past its own timeout a caller waits for a request beside.
const ANSWER_SLACK: Duration = Duration::from_secs(5);

/// Why a request could not go beside the running one.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BesideError {
    /// No request runs that this one may go beside (or it ended first): run it as the VM's
    /// own request.
    #[error("no request runs that this one can go beside")]
    NotOpen,
    /// [`MAX_QUEUED`] requests wait beside the running one already.
    #[error("{0} requests already wait beside the running one")]
    Full(usize),
    /// The guest did not answer in time (a request still queued then is dropped).
    #[error("the sandbox did not answer a request beside its running one within {0:?}")]
    NoAnswer(Duration),
    /// Writing the request into the guest or reading its answer failed.
    #[error("a request beside the running one failed: {0}")]
    Failed(String),
}

/// What may go beside the running request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Accepts {
    Files,
    FilesAndProcesses,
}

/// A session's lane beside its running request: cheap to clone, usable from any thread
/// (module docs).
#[derive(Debug, Clone, Default)]
pub struct Beside(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// A process was started through the lane (the session is then never reset for reuse).
    ran_processes: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// While a request runs that takes requests beside it.
    open: Option<Open>,
    queue: VecDeque<Call>,
    /// The last sequence number given to a lane request (never 0 when sent).
    sequence: u32,
}

#[derive(Debug)]
struct Open {
    kicker: Kicker,
    accepts: Accepts,
}

#[derive(Debug)]
struct Call {
    job: Job,
    kind: Kind,
    reply: mpsc::Sender<Result<JobResult, BesideError>>,
    /// The caller stopped waiting: not sent if still queued.
    given_up: Arc<AtomicBool>,
}

impl Beside {
    fn state(&self) -> MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a process was started through the lane.
    pub fn ran_processes(&self) -> bool {
        self.0.ran_processes.load(Ordering::Acquire)
    }

    /// Whether a request of this kind could go beside the running one now (it may still
    /// end before the request is taken).
    pub fn open_for(&self, processes: bool) -> bool {
        self.state()
            .open
            .as_ref()
            .is_some_and(|o| !processes || o.accepts == Accepts::FilesAndProcesses)
    }

    /// Runs `job` as a `kind` request beside the running one and waits for its answer (at
    /// most its timeout and a few seconds).
    pub(crate) fn call(&self, job: Job, kind: Kind) -> Result<JobResult, BesideError> {
        let processes = matches!(kind, Kind::Process { .. });
        let start = matches!(kind, Kind::Process { op, .. } if op == process_op::START);
        let wait = job.timeout + ANSWER_SLACK;
        let (reply, answer) = mpsc::channel();
        let given_up = Arc::new(AtomicBool::new(false));
        {
            let mut s = self.state();
            let queued = s.queue.len();
            let Some(open) = s.open.as_mut() else {
                return Err(BesideError::NotOpen);
            };
            if processes && open.accepts != Accepts::FilesAndProcesses {
                return Err(BesideError::NotOpen);
            }
            if queued >= MAX_QUEUED {
                return Err(BesideError::Full(MAX_QUEUED));
            }
            open.kicker.kick();
            if start {
                self.0.ran_processes.store(true, Ordering::Release);
            }
            s.queue.push_back(Call {
                job,
                kind,
                reply,
                given_up: given_up.clone(),
            });
        }
        match answer.recv_timeout(wait) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                given_up.store(true, Ordering::Release);
                Err(BesideError::NoAnswer(wait))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(BesideError::NotOpen),
        }
    }
}

/// A request in lane 1, sent and not answered yet.
struct InFlight {
    call: Call,
    /// Its output so far.
    out: Collected<'static>,
    /// A poll (which waits in the guest until woken).
    poll: bool,
    /// The lane byte was sent again to end the poll's wait for a queued request.
    woken: bool,
}

/// The lane while one main request runs, on the thread that runs it.
pub(crate) struct Lane<'b> {
    beside: &'b Beside,
    mb: Mailbox,
    inflight: Option<InFlight>,
}

impl<'b> Lane<'b> {
    /// Opens `beside` for a request that takes `accepts` beside it, in a VM whose mailbox
    /// is `main`. None if the mailbox has no lane 1 (a guest of an older protocol).
    pub(crate) fn open(
        beside: &'b Beside,
        main: &Mailbox,
        kicker: &Kicker,
        accepts: Accepts,
    ) -> Option<Self> {
        let mb = main.lane(lane::BESIDE, lane::SIZE)?;
        beside.state().open = Some(Open {
            kicker: kicker.clone(),
            accepts,
        });
        Some(Self {
            beside,
            mb,
            inflight: None,
        })
    }

    /// At a stop the main request resumes from: sends the next queued request if the lane
    /// is free, or ends a lane poll's wait if one is queued behind it.
    pub(crate) fn step(&mut self, m: &mut Machine) -> Result<(), JobError> {
        if let Some(f) = &mut self.inflight {
            if f.poll && !f.woken && !self.beside.state().queue.is_empty() {
                // A flag, not only the byte: the lane thread may have read the byte already
                // (with the one that sent the poll) before the poll began to wait.
                f.woken = true;
                self.mb
                    .write(&m.ram, job::INTERRUPT as u64, &1u32.to_le_bytes())?;
                self.ring_guest(m)?;
            }
            return Ok(());
        }
        let (call, sequence) = {
            let mut s = self.beside.state();
            let call = loop {
                match s.queue.pop_front() {
                    Some(c) if c.given_up.load(Ordering::Acquire) => continue,
                    other => break other,
                }
            };
            let Some(call) = call else { return Ok(()) };
            s.sequence = s.sequence.wrapping_add(1).max(1);
            (call, s.sequence)
        };
        let r = Request {
            job: &call.job,
            kind: call.kind,
            sequence,
            interrupt_grace: None,
            beside: None,
        };
        if let Err(e) = write_request(&m.ram, &self.mb, &r) {
            let _ = call.reply.send(Err(BesideError::Failed(e.to_string())));
            return Ok(());
        }
        let poll = matches!(call.kind, Kind::Process { op, .. } if op == process_op::POLL);
        self.inflight = Some(InFlight {
            out: Collected::new(call.job.output_limit, None),
            call,
            poll,
            woken: false,
        });
        self.ring_guest(m)
    }

    fn ring_guest(&self, m: &mut Machine) -> Result<(), JobError> {
        m.bus
            .send_to_guest(&[lane::BYTE])
            .map(drop)
            .map_err(|e| JobError::Interrupt(e.to_string()))
    }

    /// Takes the output of the request in flight (FLUSH: the guest waits, its counters are
    /// zeroed; DONE: the last of it).
    fn drain(&mut self, m: &Machine, reset: bool) -> Result<(), JobError> {
        let Some(f) = &mut self.inflight else {
            return Ok(()); // a guest ringing out of turn: nothing of ours to take
        };
        Ok(f.out.drain(&m.ram, &self.mb, reset)?)
    }

    /// The lane's FLUSH doorbell.
    pub(crate) fn flushed(&mut self, m: &Machine) -> Result<(), JobError> {
        self.drain(m, true)
    }

    /// The lane's DONE doorbell: the answer of the request in flight.
    pub(crate) fn done(&mut self, m: &Machine) -> Result<(), JobError> {
        self.drain(m, false)?;
        let Some(f) = self.inflight.take() else {
            return Ok(());
        };
        let oc = self.mb.read_u32(&m.ram, result::OUTCOME as u64)?;
        let value = self.mb.read_u32(&m.ram, result::EXIT_CODE as u64)? as i32;
        let end = end_from_outcome(oc, value);
        let mut r = JobResult::never_ran(if f.out.over_limit {
            Status::OutputLimit
        } else {
            end.status
        });
        r.exit_code = end.exit_code;
        r.signal = end.signal;
        r.crash = end.crash;
        r.stdout = f.out.stdout;
        r.stderr = f.out.stderr;
        let _ = f.call.reply.send(Ok(r));
        Ok(())
    }

    /// The main request ended at DONE, so the guest never started the request in flight
    /// (module docs): it is taken back, so that the guest never runs it.
    pub(crate) fn take_back(&mut self, m: &Machine) -> Result<(), JobError> {
        if self.inflight.is_some() {
            self.mb
                .write(&m.ram, job::SEQUENCE as u64, &0u32.to_le_bytes())?;
        }
        Ok(())
    }
}

impl Drop for Lane<'_> {
    /// The main request ended (module docs): queued requests and one sent but unanswered go
    /// back to their callers as [`BesideError::NotOpen`].
    fn drop(&mut self) {
        let queued = {
            let mut s = self.beside.state();
            s.open = None;
            std::mem::take(&mut s.queue)
        };
        if let Some(f) = self.inflight.take() {
            let _ = f.call.reply.send(Err(BesideError::NotOpen));
        }
        for c in queued {
            let _ = c.reply.send(Err(BesideError::NotOpen));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn main_mailbox(pages: u64) -> Mailbox {
        Mailbox::over_pages(0x10_0000, (0..pages).map(|p| p * 4096).collect())
    }

    fn file_call(b: &Beside) -> Result<JobResult, BesideError> {
        let mut j = Job::python("x");
        j.timeout = Duration::from_secs(60);
        b.call(j, Kind::File(crate::protocol::file_op::STAT))
    }

    fn start_call(b: &Beside) -> Result<JobResult, BesideError> {
        b.call(
            Job::shell("true"),
            Kind::Process {
                op: process_op::START,
                flags: 0,
            },
        )
    }

    #[test]
    fn nothing_runs_so_nothing_goes_beside() {
        let b = Beside::default();
        assert_eq!(file_call(&b).unwrap_err(), BesideError::NotOpen);
        assert!(!b.open_for(false));
    }

    #[test]
    fn a_guest_without_a_second_lane_opens_none() {
        let b = Beside::default();
        let k = Kicker::new();
        let short = main_mailbox((lane::SIZE / 4096) as u64);
        assert!(Lane::open(&b, &short, &k, Accepts::Files).is_none());
        assert!(!b.open_for(false));
    }

    #[test]
    fn process_operations_go_beside_a_cell_only() {
        let b = Beside::default();
        let k = Kicker::new();
        let mb = main_mailbox((2 * lane::SIZE / 4096) as u64);
        let lane = Lane::open(&b, &mb, &k, Accepts::Files).unwrap();
        assert!(b.open_for(false) && !b.open_for(true));
        assert_eq!(start_call(&b).unwrap_err(), BesideError::NotOpen);
        assert!(!b.ran_processes(), "a refused start counts as none");
        drop(lane);
        let _lane = Lane::open(&b, &mb, &k, Accepts::FilesAndProcesses).unwrap();
        assert!(b.open_for(true));
    }

    #[test]
    fn the_end_of_the_request_sends_queued_calls_back_and_the_queue_is_bounded() {
        let b = Beside::default();
        let k = Kicker::new();
        let mb = main_mailbox((2 * lane::SIZE / 4096) as u64);
        let lane = Lane::open(&b, &mb, &k, Accepts::FilesAndProcesses).unwrap();
        let callers: Vec<_> = (0..MAX_QUEUED)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || file_call(&b))
            })
            .collect();
        while b.state().queue.len() < MAX_QUEUED {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(k.is_kicked(), "a call kicks the vCPU");
        assert_eq!(file_call(&b).unwrap_err(), BesideError::Full(MAX_QUEUED));
        drop(lane);
        for c in callers {
            assert_eq!(c.join().unwrap().unwrap_err(), BesideError::NotOpen);
        }
        assert!(!b.open_for(false));
    }
}
