//! Running one job in a VM at READY.
//!
//! The host gives the VM its identity and writes the request into its mailbox (layout in
//! [`crate::protocol`]), resumes the vCPU where the template's worker rang READY, and then
//! serves doorbells: FLUSH (copy output out of the areas), DONE (the job's outcome), FAILED
//! (the worker process ended: an `os._exit`, a fatal signal, the OOM killer). Everything the
//! guest wrote is hostile input: lengths are bounds-checked against the areas, unknown codes
//! end the job as crashed. A job that runs past its deadline is kicked off the vCPU by the
//! timer thread. Afterwards the VM is reset or thrown away ([`crate::executor`]), so nothing
//! a job does reaches another job. What the guest wrote is read by [`super::decode`].

use std::time::{Duration, Instant};

use super::decode::{
    Collected, End, Shown, end_from_outcome, end_from_wait_status, read_display, read_phases,
};
use super::supervise::{Event, Facts, Finish, Next, Supervisor};
use super::{
    CRASH_TAIL_LINES, Health, Job, JobError, JobResult, JobTimings, STREAM_TICK, Status, Stream,
    Unusable,
};
use crate::beside::{Accepts, Beside, Lane};
use crate::identity;
use crate::mailbox::Mailbox;
use crate::memory::GuestRam;
use crate::memory_cap::MemoryCap;
use crate::protocol::{code, failure, job, job_flags, lane, language, mode, result};
use crate::snapshot::{self, SnapshotState};
use crate::timer;
use crate::vcpu::{VcpuError, VcpuStop};
use crate::vm::Machine;

/// What the worker is asked to do with a request ([`crate::protocol::mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A one-shot job: `python3 -c` / `sh -c` semantics.
    Job,
    /// A session cell; `reseed`: the session's first request, or a fork child's, which
    /// seeds Python's `random`.
    Cell { reseed: bool },
    /// A file operation ([`crate::protocol::file_op`]): the job's code is the path, its
    /// stdin the data.
    File(u32),
    /// A process operation ([`crate::protocol::process_op`]) and its
    /// [`crate::protocol::job_flags`] (a started process's stdin pipe or terminal).
    /// Interrupted by a cancel, like a cell.
    Process { op: u32, flags: u32 },
    /// A template layer ([`crate::protocol::language::LAYER`]): the job's code is its JSON.
    Layer,
}

/// One request to a VM's worker: the job, how to treat it, and its sequence number (never
/// 0, different from the last request's: the worker runs each number once).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'a> {
    pub(crate) job: &'a Job,
    pub(crate) kind: Kind,
    pub(crate) sequence: u32,
    /// What a timeout or the output cap does: None ends the request there, as
    /// [`Status::Timeout`] or [`Status::OutputLimit`], with the vCPU stopped where it was
    /// (the VM is then unusable); Some(grace) interrupts it (SIGINT, `KeyboardInterrupt`;
    /// output past the cap is dropped) and waits up to `grace` for it to end at DONE, with
    /// the VM still usable and the same status; if it does not end, the request ends as a
    /// timeout with the VM unusable.
    pub(crate) interrupt_grace: Option<Duration>,
    /// The session's lane beside this request, and what may go in it (None: nothing).
    pub(crate) beside: Option<(&'a Beside, Accepts)>,
}

/// How long a one-shot job interrupted at its timeout or output cap has to end at DONE:
/// long enough for the worker to collect what the job wrote below Python's level (shell
/// jobs, child processes), which it does as the interrupt ends the job; a job that ignores
/// the interrupt is stopped after it as before.
pub(crate) const ONE_SHOT_GRACE: Duration = Duration::from_secs(1);

impl<'a> Request<'a> {
    /// A one-shot job, the first request of its VM.
    pub(crate) fn one_shot(job: &'a Job) -> Self {
        Self {
            job,
            kind: Kind::Job,
            sequence: 1,
            interrupt_grace: Some(ONE_SHOT_GRACE),
            beside: None,
        }
    }
}

/// Writes `r` into the mailbox, with fresh randomness and the host's wall-clock time.
pub(crate) fn write_request(ram: &GuestRam, mb: &Mailbox, r: &Request<'_>) -> Result<(), JobError> {
    let j = r.job;
    let directory = match r.kind {
        Kind::Cell { .. } => j.cell.directory.as_deref(),
        _ => None,
    };
    let (args, env) = j.encode(directory)?;
    let mut seed = [0u8; job::SEED_LEN];
    identity::host_random(&mut seed)?;
    let wall_ns = identity::host_wall_ns() as u64;
    let put32 = |off: usize, v: usize| mb.write(ram, off as u64, &(v as u32).to_le_bytes());
    // Which kernel dialect, or which program runtime; nothing for the worker's own modes.
    let numbered = matches!(
        j.language,
        super::Language::Kernel | super::Language::Program
    );
    let dialect = match r.kind {
        Kind::Job | Kind::Cell { .. } if numbered => j.dialect,
        _ => 0,
    };
    let (lang, mode, flags, op) = match r.kind {
        Kind::Job => (j.language.code(), mode::JOB, 0, 0),
        Kind::Cell { reseed } => {
            let c = &j.cell;
            let bit = |on: bool, b: u32| if on { b } else { 0 };
            (
                j.language.code(),
                mode::CELL,
                bit(reseed, job_flags::RESEED)
                    | bit(c.reset, job_flags::RESET_NAMESPACE)
                    | bit(c.error_in_display, job_flags::ERROR_IN_DISPLAY)
                    | bit(directory.is_some(), job_flags::START_DIRECTORY),
                0,
            )
        }
        Kind::File(op) => (language::FILES, mode::JOB, 0, op),
        Kind::Process { op, flags } => (language::PROCESS, mode::JOB, flags, op),
        Kind::Layer => (language::LAYER, mode::JOB, 0, 0),
    };
    put32(job::LANGUAGE, lang as usize)?;
    put32(job::MODE, mode as usize)?;
    put32(job::FLAGS, flags as usize)?;
    put32(job::SEQUENCE, r.sequence as usize)?;
    put32(job::FILE_OP, op as usize)?;
    put32(job::INTERRUPT, 0)?;
    put32(job::NAMESPACE, j.cell.namespace as usize)?;
    put32(job::DIALECT, dialect as usize)?;
    put32(result::DISPLAY_LEN, 0)?;
    put32(job::CODE_LEN, j.code.len())?;
    put32(job::STDIN_LEN, j.stdin.len())?;
    put32(job::ARGC, j.args.len() + usize::from(directory.is_some()))?;
    put32(job::ARGS_LEN, args.len())?;
    put32(job::ENVC, j.env.len())?;
    put32(job::ENV_LEN, env.len())?;
    mb.write(ram, job::WALL_CLOCK_NS as u64, &wall_ns.to_le_bytes())?;
    mb.write(
        ram,
        job::OUTPUT_LIMIT as u64,
        &(j.output_limit as u64).to_le_bytes(),
    )?;
    mb.write(ram, job::SEED as u64, &seed)?;
    put32(result::STDOUT_LEN, 0)?;
    put32(result::STDERR_LEN, 0)?;
    put32(result::OUTCOME, 0)?;
    let mut at = job::DATA as u64;
    for part in [&j.code[..], &j.stdin[..], &args[..], &env[..]] {
        mb.write(ram, at, part)?;
        at += part.len() as u64;
    }
    Ok(())
}

/// Gives a clone at READY its own identity, right before it resumes: its kvm-clock pinned to
/// the template's (so the guest sees no time pass while the clone waited) and its timer
/// re-armed to match ([`snapshot::rearm_deadline_timer`]), its wall clock
/// moved to the host's, its kernel CRNG replaced (see [`crate::identity`]).
pub(crate) fn give_identity(m: &Machine, s: &SnapshotState) -> Result<(), JobError> {
    snapshot::set_clock(&m.vm, &s.machine)?;
    snapshot::rearm_deadline_timer(&m.vcpu, &s.machine)?;
    let now = identity::host_wall_ns();
    identity::set_realtime(&m.ram, &s.kernel.time, now - i128::from(s.ready_wall_ns))?;
    identity::reseed_crng(&m.ram, &s.kernel.random)?;
    Ok(())
}

/// Runs `j` in a clone `m` of the template whose state is `s`, restored (or reset) to READY
/// and not run since. `on_output` sees output chunks as they are drained (for streaming).
pub fn run(
    m: &mut Machine,
    s: &SnapshotState,
    j: &Job,
    on_output: &mut dyn FnMut(Stream, &[u8]),
) -> Result<(JobResult, Health), JobError> {
    give_identity(m, s)?;
    let (result, health) = run_request(m, s, &Request::one_shot(j), on_output)?;
    // A one-shot job the host had to interrupt (even one that then ended at DONE) leaves a
    // VM that is never reused: only a job that ended by itself is.
    let health = match (health, result.status) {
        (Health::Ready, why @ (Status::Timeout | Status::OutputLimit | Status::Cancelled)) => {
            Health::Discard(Unusable::Interrupted(why))
        }
        (health, _) => health,
    };
    Ok((result, health))
}

/// Sends the interrupt of request `sequence` (names it in the mailbox, then puts the
/// interrupt byte on the console: the guest's watcher turns it into SIGINT) and arms the
/// timer that kicks the vCPU at `until`, the end of its grace.
fn interrupt(
    m: &mut Machine,
    mb: &Mailbox,
    sequence: u32,
    until: Instant,
) -> Result<timer::Armed, JobError> {
    mb.write(&m.ram, job::INTERRUPT as u64, &sequence.to_le_bytes())?;
    m.bus
        .send_to_guest(&[INTERRUPT_BYTE])
        .map_err(|e| JobError::Interrupt(e.to_string()))?;
    Ok(timer::arm(until, m.kicker.clone()))
}

/// What the supervisor needs to know of how the vCPU stopped. A FAILED doorbell carries
/// its failure in the vCPU's registers: the worker's wait status (WORKER_EXITED, from the
/// agent once it reaped the worker) or the agent's own failure.
fn event_of(stop: VcpuStop, vcpu: &kvm_ioctls::VcpuFd) -> Result<Event, JobError> {
    Ok(match stop {
        VcpuStop::Doorbell(code::FLUSH) => Event::Flush,
        VcpuStop::Doorbell(code::DONE) => Event::Done,
        VcpuStop::Doorbell(code::FAILED) => {
            let regs = vcpu.get_regs().map_err(VcpuError::Run)?;
            if regs.rdi == failure::WORKER_EXITED {
                Event::WorkerExited(regs.rsi)
            } else {
                Event::AgentFailed {
                    what: regs.rdi,
                    detail: regs.rsi,
                }
            }
        }
        VcpuStop::Doorbell(other) => Event::UnknownDoorbell(other),
        // From the guest kernel as the worker starts to exit.
        VcpuStop::WorkerExited(status) => Event::WorkerExited(u64::from(status)),
        VcpuStop::Kicked => Event::Kicked,
        VcpuStop::MemoryLimit => Event::MemoryLimit,
        other => Event::Stopped(format!("{other:?}")),
    })
}

/// The byte the guest's watcher takes as "interrupt" (ETX, a terminal's Ctrl-C).
pub(crate) const INTERRUPT_BYTE: u8 = 0x03;

/// Runs request `r` in `m`, a VM whose worker is at READY or at the DONE of its last
/// request, with its identity and clock already given by the caller: writes it, arms its
/// deadline and cancel, runs the vCPU until the supervisor ends it ([`supervise`]), then
/// reads how it ended ([`end_of`]) and what it left ([`result_of`]).
pub(crate) fn run_request(
    m: &mut Machine,
    s: &SnapshotState,
    r: &Request<'_>,
    on_output: &mut dyn FnMut(Stream, &[u8]),
) -> Result<(JobResult, Health), JobError> {
    let mb = &s.mailbox;
    let j = r.job;
    // A session cell (or process request) is cancelled as it is timed out (see supervise).
    let cell = matches!(r.kind, Kind::Cell { .. } | Kind::Process { .. });
    if cell && cancelled(j) {
        // Cancelled while it waited: the session's VM never sees it (an interrupt sent now
        // could reach the guest before it starts the cell, where it cannot be taken).
        return Ok((JobResult::never_ran(Status::Cancelled), Health::Ready));
    }
    write_request(&m.ram, mb, r)?;
    // A kick still pending here is the last request's: a timer (a stream tick, the grace)
    // that fired as that request ended, after its run loop. Left set, it stopped this one at
    // its first KVM_RUN, which the supervisor took for a timeout: a session cell was
    // interrupted before it started (so the interrupt was lost) and a later cancel ended
    // the session when that grace ran out. A warm one-shot VM gets the same from its reset.
    m.kicker.reset();
    let started = Instant::now();
    let deadline = started + j.timeout;
    let timer = timer::arm(deadline, m.kicker.clone());
    if let Some(c) = &j.cancel {
        c.attach(&m.kicker);
    }
    let mut out = Collected::new(j.output_limit, Some(on_output));
    let mut sup = Supervisor::new(deadline, r.interrupt_grace, cell, j.stream_output);
    let before = Before {
        started,
        exits: m.bus.exits(),
        kvm: m.stats.as_ref().map(|s| s.read()).unwrap_or_default(),
    };
    let mut lane = r
        .beside
        .and_then(|(b, accepts)| Lane::open(b, mb, &m.kicker, accepts));
    // The request's memory cap, armed while it runs (see crate::memory_cap).
    let cap = MemoryCap::read(&m.ram, s.kernel.memory.as_ref());
    m.bus.set_memory_cap(cap);
    let finish = supervise(m, mb, r, &mut sup, &mut out, lane.as_mut(), timer);
    m.bus.set_memory_cap(None);
    let finish = finish?;
    if let Some(c) = &j.cancel {
        c.detach();
    }
    if let (Some(l), Finish::Outcome) = (lane.as_mut(), &finish) {
        l.take_back(m)?;
    }
    drop(lane);
    let (end, health) = end_of(m, mb, finish, sup.host_reason())?;
    let result = result_of(m, mb, r.kind, end, &health, out, &before)?;
    Ok((result, health))
}

/// Whether the job has been cancelled by its caller.
fn cancelled(j: &Job) -> bool {
    j.cancel.as_ref().is_some_and(super::Cancel::is_cancelled)
}

/// The VM's counters as a request started, to take the request's share from.
struct Before {
    started: Instant,
    exits: u64,
    kvm: crate::kvm_stats::VcpuCounters,
}

/// Runs the vCPU until the supervisor ends request `r`: serves the doorbells (the
/// request's and the lane's beside it), takes output as it comes (and every
/// [`STREAM_TICK`] of a streamed job), and sends the interrupt the supervisor asks for at a
/// timeout, the output cap or a cancel. `timer` (the deadline's) and the stream tick are
/// dropped as the request ends.
fn supervise(
    m: &mut Machine,
    mb: &Mailbox,
    r: &Request<'_>,
    sup: &mut Supervisor,
    out: &mut Collected<'_>,
    mut lane: Option<&mut Lane<'_>>,
    mut timer: timer::Armed,
) -> Result<Finish, JobError> {
    let j = r.job;
    // A streamed job's output is also taken every STREAM_TICK while it runs: the guest
    // FLUSHes only when it writes again, so a job that goes quiet after a line would hold
    // it back until it writes or ends.
    let arm_tick = |k: &crate::vcpu::Kicker| {
        j.stream_output
            .then(|| timer::arm(Instant::now() + STREAM_TICK, k.clone()))
    };
    let mut tick = arm_tick(&m.kicker);
    let finish = loop {
        let stop = crate::vcpu::run(&mut m.vcpu, &mut m.bus, &m.ram, &m.kicker)?;
        let event = match (stop, lane.as_deref_mut()) {
            (VcpuStop::Doorbell(c), Some(l)) if c == code::FLUSH | lane::DOORBELL_BIT => {
                l.flushed(m)?;
                Event::Lane
            }
            (VcpuStop::Doorbell(c), Some(l)) if c == code::DONE | lane::DOORBELL_BIT => {
                l.done(m)?;
                Event::Lane
            }
            (stop, _) => event_of(stop, &m.vcpu)?,
        };
        let kicked = event == Event::Kicked;
        if kicked {
            m.kicker.reset();
        }
        if event.takes_output() {
            out.drain(&m.ram, mb, event == Event::Flush)?;
        }
        let facts = Facts {
            now: Instant::now(),
            cancelled: cancelled(j),
            over_limit: out.over_limit,
        };
        let rearm = match sup.next(event, facts) {
            Next::Finish(finish) => break finish,
            Next::Resume { tick } => tick,
            Next::Interrupt { until, tick } => {
                timer = interrupt(m, mb, r.sequence, until)?;
                tick
            }
        };
        if rearm {
            tick = arm_tick(&m.kicker);
        }
        if let Some(l) = lane.as_deref_mut() {
            l.step(m)?;
        }
        // A timer that fired between the stop and the reset above was cleared with it: a
        // passed deadline (or end of grace) kicks again, so it is never lost.
        if kicked && Instant::now() >= sup.kick_at() {
            m.kicker.kick();
        }
    };
    drop(timer);
    drop(tick);
    Ok(finish)
}

/// How the request ended and whether its VM may run again, from how the supervisor
/// finished it: at DONE the guest's outcome decides, unless the host interrupted it
/// (`host_reason`); a worker that ended, the host's stop or a crash leave the VM unusable.
fn end_of(
    m: &Machine,
    mb: &Mailbox,
    finish: Finish,
    host_reason: Option<Status>,
) -> Result<(End, Health), JobError> {
    Ok(match finish {
        Finish::Outcome => {
            let oc = mb.read_u32(&m.ram, result::OUTCOME as u64)?;
            let value = mb.read_u32(&m.ram, result::EXIT_CODE as u64)? as i32;
            let end = end_from_outcome(oc, value);
            match (end.status, host_reason) {
                (Status::Crashed, _) => {
                    let why = end.crash.clone().unwrap_or_default();
                    (end, Health::Discard(Unusable::Crashed(why)))
                }
                // The request ended because the host interrupted it (or, for the cap,
                // because it ran over it): the host's word, not the guest's.
                (_, Some(why)) => (End::with(why), Health::Ready),
                _ => (end, Health::Ready),
            }
        }
        Finish::WaitStatus(status) => {
            let oom = m
                .bus
                .console()
                .tail(CRASH_TAIL_LINES)
                .iter()
                .any(|l| l.contains("Out of memory"));
            let end = end_from_wait_status(status, oom);
            let how = match (end.exit_code, end.signal) {
                (Some(code), _) => format!("exit code {code}"),
                (_, Some(signal)) => format!("signal {signal}"),
                _ => format!("{:?}", end.status),
            };
            (end, Health::Discard(Unusable::WorkerGone(how)))
        }
        Finish::Host(status) => (
            End::with(status),
            Health::Discard(Unusable::Stopped(status)),
        ),
        Finish::Crashed(why) => (
            End::crashed(why.clone()),
            Health::Discard(Unusable::Crashed(why)),
        ),
    })
}

/// The request's result: its end, its output, and what the guest left in the mailbox
/// (phases, the value shown) when its VM is still usable; the console's tail of a crash.
fn result_of(
    m: &Machine,
    mb: &Mailbox,
    kind: Kind,
    end: End,
    health: &Health,
    out: Collected<'_>,
    before: &Before,
) -> Result<JobResult, JobError> {
    let run = before.started.elapsed();
    let kvm = m
        .stats
        .as_ref()
        .map(|s| s.read().since(&before.kvm))
        .unwrap_or_default();
    let guest = if health.is_ready() {
        read_phases(&m.ram, mb)?
    } else {
        None
    };
    let console_tail = if end.status == Status::Crashed {
        m.bus.console().tail(CRASH_TAIL_LINES)
    } else {
        Vec::new()
    };
    let shown = if health.is_ready() && matches!(kind, Kind::Job | Kind::Cell { .. }) {
        read_display(&m.ram, mb)?
    } else {
        Shown::default()
    };
    Ok(JobResult {
        status: end.status,
        exit_code: end.exit_code,
        signal: end.signal,
        stdout: out.stdout,
        stderr: out.stderr,
        crash: end.crash,
        console_tail,
        display: shown.value,
        figures: shown.figures,
        error: shown.error,
        timings: JobTimings {
            clone: Duration::ZERO,
            run,
            total: run,
            guest,
            exits: m.bus.exits() - before.exits,
            kvm,
        },
    })
}
