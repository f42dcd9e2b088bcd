//! The policy of one request's run, as a pure state machine: given how the vCPU stopped,
//! the clock, whether the caller cancelled and whether the output is over its cap, what
//! happens next. [`mod@super::run`] does the I/O around it (KVM runs, output drains, the
//! interrupt byte, timers); everything here is decided without touching a VM, so every
//! path (timeouts, the output cap, cancels, the interrupt's grace, stream ticks) has a unit
//! test below.
//!
//! The rules:
//! - A kick before the deadline while output streams is a stream tick: take the output,
//!   re-arm the tick, resume.
//! - At the deadline, at the output cap and at a cancel, a request with an interrupt grace
//!   is interrupted once (SIGINT in the guest, `KeyboardInterrupt`) and given until the end
//!   of the grace to reach DONE; it then ends with the status it was interrupted for, its VM
//!   still usable. One without a grace (or one past its grace) ends there, its VM stopped
//!   where it was. A cancel interrupts session cells only: a one-shot job's VM is thrown
//!   away, so it ends at once.
//! - At DONE the guest's outcome decides, unless the host interrupted the request: then the
//!   host's reason does. A worker that exited ends the request as what its wait status says,
//!   unless the host had interrupted it (then, again, the host's reason); an agent that
//!   failed, as crashed; over the cap, as the cap.
//!
//! One file although over 500 lines: the policy is under half of it, and the rest is its
//! unit tests, one per path, kept below the code they drive.

use std::time::{Duration, Instant};

use super::Status;

/// How the vCPU stopped, as the supervisor needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Event {
    /// The FLUSH doorbell: the guest waits while its output is taken.
    Flush,
    /// Another thread kicked the vCPU: the deadline's timer, a cancel, a stream tick or a
    /// request handed to the lane beside this one (told apart by the time and the flags).
    Kicked,
    /// The DONE doorbell: the request ended and the worker waits for the next one.
    Done,
    /// The worker process is gone: its wait status (from the guest kernel's exit report or
    /// from the agent's FAILED(WORKER_EXITED)).
    WorkerExited(u64),
    /// The agent rang FAILED for a failure of its own.
    AgentFailed { what: u64, detail: u64 },
    /// Traffic of the lane beside the request (a request handed in, a lane doorbell):
    /// nothing for this request, which goes on.
    Lane,
    /// The job took the guest's free memory below its cap ([`crate::memory_cap`]).
    MemoryLimit,
    /// A doorbell code bud does not know.
    UnknownDoorbell(u32),
    /// Any other stop (reset, shutdown, halt, an emulation failure): how it stopped.
    Stopped(String),
}

impl Event {
    /// Whether the run loop takes the output before asking what next (all but the stops
    /// that say nothing about the worker). Taking it is safe at any stop: the guest counts
    /// bytes only after copying them.
    pub(super) fn takes_output(&self) -> bool {
        matches!(
            self,
            Event::Flush
                | Event::Lane
                | Event::Kicked
                | Event::Done
                | Event::WorkerExited(_)
                | Event::AgentFailed { .. }
                | Event::MemoryLimit
        )
    }
}

/// What the loop knows besides the event.
#[derive(Debug, Clone, Copy)]
pub(super) struct Facts {
    pub(crate) now: Instant,
    /// The caller cancelled the request.
    pub(crate) cancelled: bool,
    /// The output taken so far reached the cap.
    pub(crate) over_limit: bool,
}

/// What the run loop does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Next {
    /// Resume the vCPU; `tick`: the kick was a stream tick, arm it again first.
    Resume { tick: bool },
    /// Send the interrupt, arm the timer that kicks at `until` (the end of the grace),
    /// resume; `tick` as for [`Next::Resume`].
    Interrupt { until: Instant, tick: bool },
    /// The request is over.
    Finish(Finish),
}

/// How the request ended, before the loop reads what the guest left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Finish {
    /// At DONE: the guest's outcome decides ([`Supervisor::host_reason`] may override it).
    Outcome,
    /// The worker process ended with this wait status.
    WaitStatus(u64),
    /// The host ended it: a timeout, the output cap or a cancel.
    Host(Status),
    /// The guest misbehaved or stopped: why.
    Crashed(String),
}

/// The state of one request's run.
#[derive(Debug)]
pub(super) struct Supervisor {
    grace: Option<Duration>,
    cell: bool,
    streaming: bool,
    /// The deadline, then, once interrupted, the end of the grace.
    kick_at: Instant,
    /// Why the host interrupted the request.
    interrupted: Option<Status>,
}

impl Supervisor {
    /// A request whose deadline is `deadline`; `grace`: see [`super::Request`]; `cell`: a
    /// session cell (cancels interrupt it); `streaming`: a stream tick is armed.
    pub(super) fn new(
        deadline: Instant,
        grace: Option<Duration>,
        cell: bool,
        streaming: bool,
    ) -> Self {
        Self {
            grace,
            cell,
            streaming,
            kick_at: deadline,
            interrupted: None,
        }
    }

    /// When the next kick is due: the deadline, or the end of the grace once interrupted.
    pub(super) fn kick_at(&self) -> Instant {
        self.kick_at
    }

    /// Why the host interrupted the request, if it did: a request that then ended at DONE
    /// ends with this status (the host's word, not the guest's).
    pub(super) fn host_reason(&self) -> Option<Status> {
        self.interrupted
    }

    /// What follows `event`, given `facts` (taken after the loop took the output, for the
    /// events that [`Event::takes_output`]).
    pub(super) fn next(&mut self, event: Event, facts: Facts) -> Next {
        match event {
            Event::Flush | Event::Lane => self.after_output(facts),
            // Before the deadline and not a cancel: a stream tick, or a request handed to the
            // lane beside this one. The timer kicks only once the deadline has passed, so such
            // a kick is never the timeout's, whatever else raced with it (a lane's kick that
            // landed between the loop's reset and its look at the lane once interrupted a
            // cell as timed out, long before its deadline: seen in CI).
            Event::Kicked if !facts.cancelled && facts.now < self.kick_at => {
                let tick = self.streaming;
                match self.after_output(facts) {
                    Next::Resume { .. } => Next::Resume { tick },
                    Next::Interrupt { until, .. } => Next::Interrupt { until, tick },
                    finish => finish,
                }
            }
            Event::Kicked if facts.cancelled => self.cancelled(facts),
            Event::Kicked => match self.grace {
                Some(grace) if self.interrupted.is_none() => {
                    self.interrupt(Status::Timeout, grace, facts.now)
                }
                // No grace, or past it. A request interrupted for its cap that outlived
                // the grace still ends as what it was interrupted for.
                _ => Next::Finish(Finish::Host(self.interrupted.unwrap_or(Status::Timeout))),
            },
            Event::Done => {
                if facts.over_limit {
                    if self.grace.is_none() {
                        return Next::Finish(Finish::Host(Status::OutputLimit));
                    }
                    self.interrupted.get_or_insert(Status::OutputLimit);
                }
                Next::Finish(Finish::Outcome)
            }
            // The cap is the host's word whatever else was going on: the guest was stopped
            // in the middle of an allocation and cannot go on.
            Event::MemoryLimit => Next::Finish(Finish::Host(Status::MemoryLimit)),
            Event::WorkerExited(_) | Event::AgentFailed { .. } if facts.over_limit => {
                Next::Finish(Finish::Host(Status::OutputLimit))
            }
            // The host interrupted it and the worker then ended (by the interrupt, or by
            // whatever the job did in its grace): the host's reason, as at DONE.
            Event::WorkerExited(_) if self.interrupted.is_some() => {
                Next::Finish(Finish::Host(self.interrupted.unwrap_or(Status::Timeout)))
            }
            Event::WorkerExited(status) => Next::Finish(Finish::WaitStatus(status)),
            Event::AgentFailed { what, detail } => Next::Finish(Finish::Crashed(format!(
                "guest agent failure {what} (detail {detail:#x})"
            ))),
            Event::UnknownDoorbell(code) => Next::Finish(Finish::Crashed(format!(
                "guest rang unknown doorbell {code:#x}"
            ))),
            Event::Stopped(how) => Next::Finish(Finish::Crashed(format!("guest stopped: {how}"))),
        }
    }

    /// After output was taken while the request runs: past the cap, interrupt it once (what
    /// it still writes is dropped), or end it without a grace.
    fn after_output(&mut self, facts: Facts) -> Next {
        if !facts.over_limit {
            return Next::Resume { tick: false };
        }
        match self.grace {
            Some(_) if self.interrupted.is_some() => Next::Resume { tick: false },
            Some(grace) => self.interrupt(Status::OutputLimit, grace, facts.now),
            None => Next::Finish(Finish::Host(Status::OutputLimit)),
        }
    }

    /// A cancel: a session cell is interrupted as it is timed out, so that one that stops
    /// within the grace leaves its session usable; a one-shot job's VM is thrown away, so
    /// it ends at once.
    fn cancelled(&mut self, facts: Facts) -> Next {
        match self.grace {
            Some(grace) if self.cell && self.interrupted.is_none() => {
                self.interrupt(Status::Cancelled, grace, facts.now)
            }
            Some(_) if self.cell && facts.now < self.kick_at => {
                // Within an interrupt's grace: a stream tick, a second cancel, or a cancel
                // of a cell already interrupted for its time or its cap (then the client is
                // gone: cancelled is what it ends as).
                self.interrupted = Some(Status::Cancelled);
                Next::Resume { tick: true }
            }
            _ => Next::Finish(Finish::Host(Status::Cancelled)),
        }
    }

    fn interrupt(&mut self, why: Status, grace: Duration, now: Instant) -> Next {
        self.interrupted = Some(why);
        self.kick_at = now + grace;
        Next::Interrupt {
            until: self.kick_at,
            tick: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(1);
    const TIMEOUT: Duration = Duration::from_secs(10);

    /// A supervisor started at `t0` with a 10 s deadline.
    fn sup(t0: Instant, grace: Option<Duration>, cell: bool, streaming: bool) -> Supervisor {
        Supervisor::new(t0 + TIMEOUT, grace, cell, streaming)
    }

    fn at(now: Instant) -> Facts {
        Facts {
            now,
            cancelled: false,
            over_limit: false,
        }
    }

    fn over(now: Instant) -> Facts {
        Facts {
            over_limit: true,
            ..at(now)
        }
    }

    fn cancel(now: Instant) -> Facts {
        Facts {
            cancelled: true,
            ..at(now)
        }
    }

    #[test]
    fn a_quiet_job_flushes_and_ends_at_done_with_its_own_outcome() {
        let t0 = Instant::now();
        let mut s = sup(t0, Some(GRACE), false, false);

        assert_eq!(s.next(Event::Flush, at(t0)), Next::Resume { tick: false });
        assert_eq!(s.next(Event::Done, at(t0)), Next::Finish(Finish::Outcome));
        assert_eq!(s.host_reason(), None);
    }

    #[test]
    fn lane_traffic_resumes_the_request_and_only_its_cap_interrupts_it() {
        let t0 = Instant::now();
        let mut s = sup(t0, Some(GRACE), true, false);

        assert_eq!(s.next(Event::Lane, at(t0)), Next::Resume { tick: false });
        assert_eq!(s.host_reason(), None);
        assert_eq!(
            s.next(Event::Lane, over(t0)),
            Next::Interrupt {
                until: t0 + GRACE,
                tick: false
            }
        );
        assert_eq!(s.host_reason(), Some(Status::OutputLimit));
    }

    #[test]
    fn a_kick_before_the_deadline_that_is_no_cancel_resumes_the_request() {
        let t0 = Instant::now();
        let mut s = sup(t0, Some(GRACE), true, false);

        // A request handed to the lane kicks the vCPU; so may a kick that raced with the
        // loop's reset. Neither is the deadline's.
        assert_eq!(s.next(Event::Kicked, at(t0)), Next::Resume { tick: false });
        assert_eq!(
            s.next(Event::Kicked, at(t0 + TIMEOUT / 2)),
            Next::Resume { tick: false }
        );
        assert_eq!(s.host_reason(), None);
        assert_eq!(
            s.next(Event::Kicked, over(t0)),
            Next::Interrupt {
                until: t0 + GRACE,
                tick: false
            }
        );
        assert_eq!(s.host_reason(), Some(Status::OutputLimit));
    }

    #[test]
    fn a_timeout_interrupts_once_and_done_within_the_grace_ends_as_timeout() {
        let t0 = Instant::now();
        let deadline = t0 + TIMEOUT;
        let mut s = sup(t0, Some(GRACE), false, false);

        let first = s.next(Event::Kicked, at(deadline));
        let done = s.next(Event::Done, at(deadline + GRACE / 2));

        assert_eq!(
            first,
            Next::Interrupt {
                until: deadline + GRACE,
                tick: false
            }
        );
        assert_eq!(done, Next::Finish(Finish::Outcome));
        assert_eq!(s.host_reason(), Some(Status::Timeout));
    }

    #[test]
    fn a_job_that_outlives_its_grace_ends_as_a_timeout_at_the_second_kick() {
        let t0 = Instant::now();
        let deadline = t0 + TIMEOUT;
        let mut s = sup(t0, Some(GRACE), false, false);

        s.next(Event::Kicked, at(deadline));
        let second = s.next(Event::Kicked, at(deadline + GRACE));

        assert_eq!(second, Next::Finish(Finish::Host(Status::Timeout)));
    }

    #[test]
    fn without_a_grace_the_deadline_and_the_cap_end_the_request_at_once() {
        let t0 = Instant::now();
        let mut timed = sup(t0, None, true, false);
        let mut capped = sup(t0, None, true, false);
        let mut capped_at_done = sup(t0, None, true, false);

        assert_eq!(
            timed.next(Event::Kicked, at(t0 + TIMEOUT)),
            Next::Finish(Finish::Host(Status::Timeout))
        );
        assert_eq!(
            capped.next(Event::Flush, over(t0)),
            Next::Finish(Finish::Host(Status::OutputLimit))
        );
        assert_eq!(
            capped_at_done.next(Event::Done, over(t0)),
            Next::Finish(Finish::Host(Status::OutputLimit))
        );
    }

    #[test]
    fn the_cap_interrupts_once_and_the_request_ends_as_output_limit() {
        let t0 = Instant::now();
        let mut s = sup(t0, Some(GRACE), false, false);

        let first = s.next(Event::Flush, over(t0));
        let again = s.next(Event::Flush, over(t0));
        let done = s.next(Event::Done, over(t0));

        assert_eq!(
            first,
            Next::Interrupt {
                until: t0 + GRACE,
                tick: false
            }
        );
        assert_eq!(
            again,
            Next::Resume { tick: false },
            "interrupted once; later output is dropped"
        );
        assert_eq!(done, Next::Finish(Finish::Outcome));
        assert_eq!(s.host_reason(), Some(Status::OutputLimit));
    }

    #[test]
    fn output_over_the_cap_found_only_at_done_is_still_the_cap() {
        let t0 = Instant::now();
        let mut s = sup(t0, Some(GRACE), false, false);

        assert_eq!(s.next(Event::Done, over(t0)), Next::Finish(Finish::Outcome));
        assert_eq!(s.host_reason(), Some(Status::OutputLimit));
    }

    #[test]
    fn a_job_interrupted_for_its_cap_that_outlives_the_grace_ends_as_the_cap() {
        let t0 = Instant::now();
        let mut s = sup(t0, Some(GRACE), false, false);

        s.next(Event::Flush, over(t0));
        let kick = s.next(Event::Kicked, at(t0 + GRACE));

        assert_eq!(kick, Next::Finish(Finish::Host(Status::OutputLimit)));
    }

    #[test]
    fn a_timed_out_job_keeps_timeout_when_its_output_then_reaches_the_cap() {
        let t0 = Instant::now();
        let deadline = t0 + TIMEOUT;
        let mut s = sup(t0, Some(GRACE), false, false);

        s.next(Event::Kicked, at(deadline));
        let flush = s.next(Event::Flush, over(deadline));
        let done = s.next(Event::Done, over(deadline));

        assert_eq!(flush, Next::Resume { tick: false });
        assert_eq!(done, Next::Finish(Finish::Outcome));
        assert_eq!(s.host_reason(), Some(Status::Timeout));
    }

    #[test]
    fn stream_ticks_before_the_deadline_resume_and_rearm_and_after_it_time_out() {
        let t0 = Instant::now();
        let deadline = t0 + TIMEOUT;
        let mut s = sup(t0, Some(GRACE), false, true);

        let tick = s.next(Event::Kicked, at(t0 + Duration::from_millis(50)));
        let capped_tick = s.next(Event::Kicked, over(t0 + Duration::from_millis(100)));
        let mut late = sup(t0, Some(GRACE), false, true);
        let at_deadline = late.next(Event::Kicked, at(deadline));

        assert_eq!(tick, Next::Resume { tick: true });
        assert_eq!(
            capped_tick,
            Next::Interrupt {
                until: t0 + Duration::from_millis(100) + GRACE,
                tick: true
            }
        );
        assert_eq!(
            at_deadline,
            Next::Interrupt {
                until: deadline + GRACE,
                tick: false
            }
        );
        assert_eq!(late.host_reason(), Some(Status::Timeout));
    }

    #[test]
    fn a_cancel_interrupts_a_cell_but_ends_a_one_shot_job_at_once() {
        let t0 = Instant::now();
        let mut cell = sup(t0, Some(GRACE), true, false);
        let mut job = sup(t0, Some(GRACE), false, false);

        let interrupted = cell.next(Event::Kicked, cancel(t0));
        let done = cell.next(Event::Done, at(t0));
        let ended = job.next(Event::Kicked, cancel(t0));

        assert_eq!(
            interrupted,
            Next::Interrupt {
                until: t0 + GRACE,
                tick: false
            }
        );
        assert_eq!(done, Next::Finish(Finish::Outcome));
        assert_eq!(cell.host_reason(), Some(Status::Cancelled));
        assert_eq!(ended, Next::Finish(Finish::Host(Status::Cancelled)));
    }

    #[test]
    fn a_cancel_within_a_cells_grace_becomes_its_reason_and_past_the_grace_ends_it() {
        let t0 = Instant::now();
        let deadline = t0 + TIMEOUT;
        let mut s = sup(t0, Some(GRACE), true, true);

        s.next(Event::Kicked, at(deadline));
        let within = s.next(Event::Kicked, cancel(deadline + GRACE / 2));
        let past = s.next(Event::Kicked, cancel(deadline + GRACE));

        assert_eq!(within, Next::Resume { tick: true });
        assert_eq!(s.host_reason(), Some(Status::Cancelled));
        assert_eq!(past, Next::Finish(Finish::Host(Status::Cancelled)));
    }

    #[test]
    fn a_worker_that_exits_ends_with_its_wait_status_or_the_cap() {
        let t0 = Instant::now();
        let mut s = sup(t0, Some(GRACE), false, false);
        let mut capped = sup(t0, Some(GRACE), false, false);

        assert_eq!(
            s.next(Event::WorkerExited(0x0700), at(t0)),
            Next::Finish(Finish::WaitStatus(0x0700))
        );
        assert_eq!(
            capped.next(Event::WorkerExited(9), over(t0)),
            Next::Finish(Finish::Host(Status::OutputLimit))
        );
    }

    #[test]
    fn a_worker_that_exits_after_the_interrupt_ends_with_the_hosts_reason() {
        let t0 = Instant::now();
        let deadline = t0 + TIMEOUT;
        let mut timed = sup(t0, Some(GRACE), false, false);
        let mut cancelled = sup(t0, Some(GRACE), true, false);

        timed.next(Event::Kicked, at(deadline));
        cancelled.next(Event::Kicked, cancel(t0));

        // 2: SIGINT, the interrupt's own signal, as a worker dies of it.
        assert_eq!(
            timed.next(Event::WorkerExited(2), at(deadline + GRACE / 2)),
            Next::Finish(Finish::Host(Status::Timeout))
        );
        assert_eq!(
            cancelled.next(Event::WorkerExited(0x0300), at(t0)),
            Next::Finish(Finish::Host(Status::Cancelled))
        );
    }

    #[test]
    fn crossing_the_memory_cap_ends_any_request_as_memory_limit_at_once() {
        let t0 = Instant::now();
        let mut job = sup(t0, Some(GRACE), false, false);
        let mut timed_out = sup(t0, Some(GRACE), true, false);

        timed_out.next(Event::Kicked, at(t0 + TIMEOUT));

        assert_eq!(
            job.next(Event::MemoryLimit, at(t0)),
            Next::Finish(Finish::Host(Status::MemoryLimit))
        );
        assert_eq!(
            timed_out.next(Event::MemoryLimit, over(t0 + TIMEOUT)),
            Next::Finish(Finish::Host(Status::MemoryLimit))
        );
        assert!(Event::MemoryLimit.takes_output());
    }

    #[test]
    fn agent_failures_unknown_doorbells_and_other_stops_are_crashes() {
        let t0 = Instant::now();
        let mut s = sup(t0, Some(GRACE), false, false);

        let agent = s.next(
            Event::AgentFailed {
                what: 3,
                detail: 0x10,
            },
            at(t0),
        );
        let doorbell = s.next(Event::UnknownDoorbell(0x99), at(t0));
        let stopped = s.next(Event::Stopped("Shutdown".into()), at(t0));

        assert_eq!(
            agent,
            Next::Finish(Finish::Crashed(
                "guest agent failure 3 (detail 0x10)".into()
            ))
        );
        assert_eq!(
            doorbell,
            Next::Finish(Finish::Crashed("guest rang unknown doorbell 0x99".into()))
        );
        assert_eq!(
            stopped,
            Next::Finish(Finish::Crashed("guest stopped: Shutdown".into()))
        );
        assert!(!Event::Stopped(String::new()).takes_output());
        assert!(!Event::UnknownDoorbell(1).takes_output());
        assert!(Event::Kicked.takes_output());
    }
}
