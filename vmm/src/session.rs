//! Sessions: one VM kept between requests, for a stateful code interpreter.
//!
//! A session takes a VM at READY from the [`Executor`] and keeps it: each cell is a request
//! ([`crate::job::Kind::Cell`]) to the same worker, which keeps its `__main__`, its files
//! and its processes (guest side: `guest/python/bud_session.py`). Between requests the VM
//! does not exist for the host scheduler: no vCPU thread, no timer, nothing runs.
//!
//! **Time.** A one-shot job pins the guest's kvm-clock to the template's, so that a clone
//! never accounts the time it waited. A session cannot: its monotonic time must go on from
//! cell to cell. So the session reads the kvm-clock when a request ends ([`Session::park`])
//! and sets that value back before the next one: the guest sees no time pass while parked
//! (no catch-up of ticks and timers on resume), and its `CLOCK_MONOTONIC` never goes back.
//! Its wall clock is moved forward by the host's time since the park, which keeps it on the
//! host's clock.
//!
//! **Identity.** The kernel CRNG is replaced and Python's `random` reseeded when the
//! session starts, and again in every fork child: two forks of one session never share
//! random state (as `os.fork` reseeds `random` in a child). Between cells nothing is
//! reseeded: `random.seed(42)` in one cell holds in the next.
//!
//! **Interrupts.** A cell past its time is interrupted (`KeyboardInterrupt`, see
//! [`crate::job::Request::interrupt_grace`]); if it still runs after the grace period, the
//! request ends as a timeout with the VM stopped mid-cell and the session is over.
//!
//! **Fork.** [`Session::fork`] freezes the session's private pages into a [`Layer`] and
//! builds each child from the template plus the session's layers plus its vCPU and device
//! state, captured like a template's (module docs of [`crate::layer`]).
//!
//! **On disk.** [`Session::save`] writes the same things (every page where the session
//! differs from its template, from its layers or its own) to a [`crate::session_file`],
//! and the session goes on; [`Session::load`] makes a session from such a file as a fork
//! makes a child, either the same session again (a pause and resume: its CRNG and `random`
//! as they were) or a new one with an identity of its own (a session started from a
//! snapshot). Its clock resumes where it was parked, its wall clock on the host's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::kvm_clock_data;

use crate::beside::{Accepts, Beside, BesideError};
use crate::devices::console::ConsoleLog;
use crate::executor::{ExecError, Executor};
use crate::identity::{self, IdentityError};
use crate::job::{self, Health, Job, JobError, JobResult, Kind, Request, Stream, Unusable};
use crate::layer::{Layer, LayerError};
use crate::memory::{PAGE_SIZE, set_bits};
pub use crate::requests::Requests;
use crate::session_file::{self, SessionFile, SessionFileError, WriteStats};
use crate::snapshot::{self, MsrList, SnapshotError};
use crate::template::TemplateError;
use crate::vm::{Machine, NetStart, SerialStart, VmError};

/// Errors of session operations (a cell that ran and failed is a [`JobResult`]).
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Job(#[from] JobError),
    #[error("session clock: {0}")]
    Clock(#[from] SnapshotError),
    #[error("session identity: {0}")]
    Identity(#[from] IdentityError),
    #[error("fork: {0}")]
    Layer(#[from] LayerError),
    #[error(transparent)]
    File(#[from] SessionFileError),
    #[error("fork: {0}")]
    Template(#[from] TemplateError),
    #[error("fork: {0}")]
    Vm(#[from] VmError),
    #[error("reading the session's memory map: {0}")]
    Pagemap(std::io::Error),
    #[error("the session's VM is no longer usable: {0}")]
    Unusable(Unusable),
    /// The session's VM was already taken away (the session ended meanwhile).
    #[error("the session's VM is gone")]
    Gone,
    /// A request beside the running one ([`crate::beside`]) did not run there.
    #[error(transparent)]
    Beside(#[from] BesideError),
}

impl SessionError {
    /// The request did not run beside the running one and may run as the VM's own
    /// ([`BesideError::NotOpen`], [`BesideError::Full`]).
    pub fn not_beside(&self) -> bool {
        matches!(
            self,
            SessionError::Beside(BesideError::NotOpen | BesideError::Full(_))
        )
    }
}

/// Bytes of file data per request of [`crate::files::Files::put_file`].
pub(crate) const FILE_CHUNK: usize = 1 << 20;

/// How long an interrupted cell has to end before its session is over.
pub const DEFAULT_INTERRUPT_GRACE: Duration = Duration::from_secs(2);

/// A live VM kept between requests (module docs).
#[derive(Debug)]
pub struct Session {
    m: Machine,
    /// Sequence number of the last request (the worker runs each number once).
    sequence: u32,
    /// Python and shell cells run so far (Jupyter's execution count).
    executions: u64,
    /// The guest's kvm-clock when it last stopped.
    clock: kvm_clock_data,
    /// How far its timer's deadline was ahead of its TSC then, re-armed as far ahead when it
    /// resumes ([`snapshot::rearm_timer`]); None: off.
    timer_ahead: Option<u64>,
    /// The host's wall clock then, which is the guest's wall clock then.
    parked_wall_ns: i128,
    /// The next cell reseeds Python's `random` (a new session or a fork child).
    reseed: bool,
    /// Layers mapped over the template in this VM's RAM, oldest first.
    layers: Vec<Arc<Layer>>,
    /// Not ready once a request ended other than at DONE (the VM is stopped mid-request),
    /// with why.
    health: Health,
    /// A background process was started in it: at its end the VM is discarded, never reset
    /// for reuse (the reset's proof covers a worker that ran requests, not processes that
    /// outlived them).
    ran_processes: bool,
    /// The lane beside its running request ([`crate::beside`]).
    beside: Beside,
}

/// What a fork child is made from.
struct ChildRecipe<'a> {
    ex: &'a Executor,
    state: &'a snapshot::MachineState,
    serial: &'a vm_superio::serial::SerialState,
    layers: &'a [Arc<Layer>],
    /// A CRNG of its own (a fork child, a session started from a snapshot), or the one
    /// captured (the same session resumed).
    new_identity: bool,
}

impl ChildRecipe<'_> {
    /// One child VM: the template's memory with the layers over it, the captured state, a
    /// CRNG of its own if asked. Returns it and the time spent mapping layers.
    fn make(&self) -> Result<(Machine, Duration), SessionError> {
        let t = self.ex.template();
        let ram = t.private_ram()?;
        let mapping = Instant::now();
        for l in self.layers {
            l.map_over(&ram)?;
        }
        let mapping = mapping.elapsed();
        let m = Machine::create(
            self.ex.kvm(),
            ram,
            ConsoleLog::default(),
            SerialStart::Restore(self.serial),
            // Host connections cannot be carried over: a child's card continues from the
            // captured registers and queues with an empty stack (the guest's old
            // connections get RST on their next segment).
            NetStart::from_state(self.state.net.as_ref()),
        )?;
        let m = self.ex.adopt(m);
        let ready = snapshot::restore(&m.vm, &m.vcpu, self.state, snapshot::Target::NewVm)
            .map_err(SessionError::from)
            .and_then(|()| {
                if self.new_identity {
                    identity::reseed_crng(&m.ram, &t.state().kernel.random)?;
                }
                Ok(())
            });
        match ready {
            Ok(()) => Ok((m, mapping)),
            Err(e) => {
                self.ex.discard(m);
                Err(e)
            }
        }
    }
}

/// What a fork cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForkStats {
    /// How long the source was held: state capture, layer copy, remapping the source.
    pub source_pause: Duration,
    /// Bytes copied into the new layer, and its page runs.
    pub layer_bytes: u64,
    pub(crate) layer_runs: usize,
    /// Time to make each child (new VM, layers mapped, state restored), on average.
    pub per_child: Duration,
    /// Of `source_pause`: copying the private pages into the layer.
    pub(crate) layer_copy: Duration,
    /// Of all children: mapping the layers over their RAM.
    pub(crate) children_mapping: Duration,
}

impl Session {
    /// A new session on a VM from `ex` (at READY, never run since its reset, holding no
    /// more memory than a warmed-up clone: [`Executor::take_lean_vm`]): gives it its
    /// identity; it has run nothing yet.
    pub fn start(ex: &Executor) -> Result<Self, SessionError> {
        let (m, _, _) = ex.take_lean_vm()?;
        let s = ex.template().state();
        if let Err(e) = job::give_identity(&m, s) {
            ex.discard(m);
            return Err(e.into());
        }
        Ok(Self {
            m,
            sequence: 0,
            executions: 0,
            clock: s.machine.clock,
            timer_ahead: snapshot::timer_ahead_of(&s.machine.msrs),
            parked_wall_ns: identity::host_wall_ns(),
            reseed: true,
            layers: Vec::new(),
            health: Health::Ready,
            ran_processes: false,
            beside: Beside::default(),
        })
    }

    /// Decides the names and connections of the session's network card from now on (a
    /// template with a card; others ignore it): connections already open stay, new ones
    /// see it. The VM goes back to its executor's egress when the session ends.
    pub fn set_egress(&mut self, egress: std::sync::Arc<dyn crate::net::Egress>) {
        self.m.set_egress(egress);
    }

    /// Cells run so far.
    pub fn executions(&self) -> u64 {
        self.executions
    }

    /// Whether the VM can take another request.
    pub fn usable(&self) -> bool {
        self.health.is_ready()
    }

    /// Whether the VM can take another request, and if not, why.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// The error for a request to a VM that cannot take it (None while it can).
    fn refuse(&self) -> Result<(), SessionError> {
        match &self.health {
            Health::Ready => Ok(()),
            Health::Discard(why) => Err(SessionError::Unusable(why.clone())),
        }
    }

    /// Host memory held by this session alone: its private pages, in bytes (layers it shares
    /// with its forks are [`Session::layers`]).
    pub fn private_bytes(&self) -> Result<u64, SessionError> {
        let bitmap = self.m.ram.private_pages().map_err(SessionError::Pagemap)?;
        Ok(bitmap
            .iter()
            .map(|w| u64::from(w.count_ones()))
            .sum::<u64>()
            * PAGE_SIZE)
    }

    /// The layers this session's memory sits on (shared with the sessions it forked from or
    /// into).
    pub fn layers(&self) -> &[Arc<Layer>] {
        &self.layers
    }

    /// The console lines of the VM (for a crashed session's report).
    pub fn console_tail(&self, lines: usize) -> Vec<String> {
        self.m.bus.console().tail(lines)
    }

    /// Runs a cell (`job.language`: Python in the session's namespace, or shell).
    pub fn exec(
        &mut self,
        ex: &Executor,
        job: &Job,
        grace: Duration,
        on_output: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<JobResult, SessionError> {
        let kind = Kind::Cell {
            reseed: self.reseed,
        };
        let r = self.request(ex, job, kind, Some(grace), on_output)?;
        self.reseed = false;
        self.executions = self.executions.saturating_add(1);
        Ok(r)
    }

    /// Runs a one-shot job (`python3 -c` / `sh -c` semantics, no display, no interrupt: a
    /// timeout leaves the VM unusable) in the session's VM: how `/v1/exec` runs a job that
    /// comes with files, between the file operations that bring them in and out.
    pub fn run_job(
        &mut self,
        ex: &Executor,
        job: &Job,
        on_output: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<JobResult, SessionError> {
        self.request(ex, job, Kind::Job, None, on_output)
    }

    /// A background process is started in it: at its end it is discarded, never reset.
    pub(crate) fn mark_ran_processes(&mut self) {
        self.ran_processes = true;
    }

    /// Whether a background process was ever started in it (then it is never reset for
    /// reuse).
    fn ran_processes(&self) -> bool {
        self.ran_processes || self.beside.ran_processes()
    }

    /// The lane beside its running request: file operations (and, beside a cell, process
    /// operations) given to it run while the request does ([`crate::beside`]).
    pub fn beside(&self) -> Beside {
        self.beside.clone()
    }

    pub(crate) fn request(
        &mut self,
        ex: &Executor,
        j: &Job,
        kind: Kind,
        grace: Option<Duration>,
        on_output: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<JobResult, SessionError> {
        self.refuse()?;
        let s = ex.template().state();
        if let Err(e) = self.resume_clock(s) {
            // The guest's memory does not hold a clock bud can set (a session file whose
            // pages are not a guest's): this VM runs nothing more.
            self.health = Health::Discard(Unusable::Failed(e.to_string()));
            return Err(e);
        }
        self.sequence = self.sequence.wrapping_add(1).max(1);
        let accepts = match kind {
            Kind::Cell { .. } => Some(Accepts::FilesAndProcesses),
            Kind::File(_) | Kind::Process { .. } => Some(Accepts::Files),
            Kind::Job | Kind::Layer => None,
        };
        let r = Request {
            job: j,
            kind,
            sequence: self.sequence,
            interrupt_grace: grace,
            beside: accepts.map(|a| (&self.beside, a)),
        };
        let ran = job::run_request(&mut self.m, s, &r, on_output);
        let (result, health) = match ran {
            Ok(done) => done,
            Err(e) => {
                self.health = Health::Discard(Unusable::Failed(e.to_string()));
                return Err(e.into());
            }
        };
        self.health = health;
        if self.health.is_ready() {
            self.park()?;
        }
        Ok(result)
    }

    /// Before a request: the guest's clock where it stopped, its wall clock moved on by the
    /// host's time since.
    fn resume_clock(&mut self, s: &snapshot::SnapshotState) -> Result<(), SessionError> {
        snapshot::pin_clock(&self.m.vm, &self.clock)?;
        snapshot::rearm_timer(&self.m.vcpu, self.timer_ahead)?;
        let now = identity::host_wall_ns();
        identity::set_realtime(&self.m.ram, &s.kernel.time, now - self.parked_wall_ns)?;
        self.parked_wall_ns = now;
        Ok(())
    }

    /// After a request ended at DONE: remember the guest's clock and the host's.
    fn park(&mut self) -> Result<(), SessionError> {
        self.clock = snapshot::read_clock(&self.m.vm)?;
        self.timer_ahead = snapshot::timer_ahead(&self.m.vcpu)?;
        self.parked_wall_ns = identity::host_wall_ns();
        Ok(())
    }

    /// `count` independent copies of this session's live state (module docs), and what the
    /// fork cost. The session itself goes on, now sitting on the new layer too.
    pub fn fork(
        &mut self,
        ex: &Executor,
        count: usize,
    ) -> Result<(Vec<Session>, ForkStats), SessionError> {
        self.refuse()?;
        let started = Instant::now();
        let serial = self.m.bus.serial_state();
        let state = self.capture_state(ex)?;
        let copy_started = Instant::now();
        let layer = Arc::new(Layer::capture(&self.m.ram)?);
        let layer_copy = copy_started.elapsed();
        // The source now reads its own pages from the layer: its private copies are freed.
        // A layer with nothing in it (no page written since the last fork) is not kept.
        if layer.runs() > 0 {
            layer.map_over(&self.m.ram)?;
            self.layers.push(layer.clone());
        }
        let source_pause = started.elapsed();

        let children_started = Instant::now();
        let child = ChildRecipe {
            ex,
            state: &state,
            serial: &serial,
            layers: &self.layers,
            new_identity: true,
        };
        // One after another: making them on several threads was slower here (measured:
        // 22.8 ms against 18.3 ms for 8 children on 2 cores), as every mmap of a layer run
        // takes the process's mmap lock.
        let mut machines = Vec::with_capacity(count);
        let mut children_mapping = Duration::ZERO;
        for _ in 0..count {
            match child.make() {
                Ok((m, mapping)) => {
                    children_mapping += mapping;
                    machines.push(m);
                }
                Err(e) => {
                    machines.into_iter().for_each(|m| ex.discard(m));
                    return Err(e);
                }
            }
        }
        let children: Vec<Session> = machines
            .into_iter()
            .map(|m| Session {
                m,
                sequence: self.sequence,
                executions: self.executions,
                clock: self.clock,
                timer_ahead: self.timer_ahead,
                parked_wall_ns: self.parked_wall_ns,
                reseed: true,
                layers: self.layers.clone(),
                health: Health::Ready,
                ran_processes: self.ran_processes(),
                beside: Beside::default(),
            })
            .collect();
        let per_child = children_started
            .elapsed()
            .checked_div(count.max(1) as u32)
            .unwrap_or_default();
        let stats = ForkStats {
            source_pause,
            layer_bytes: layer.bytes(),
            layer_runs: layer.runs(),
            per_child,
            layer_copy,
            children_mapping,
        };
        Ok((children, stats))
    }

    /// The vCPU and device state of the parked VM, with its parked clock.
    fn capture_state(&mut self, ex: &Executor) -> Result<snapshot::MachineState, SessionError> {
        let t = ex.template().state();
        let msrs: Vec<u32> = t.machine.msrs.iter().map(|e| e.index).collect();
        let mut state = snapshot::capture(
            ex.kvm(),
            &self.m.vm,
            &mut self.m.vcpu,
            t.host_kind,
            t.machine.cpuid.clone(),
            &self.m.bus,
            MsrList::These(&msrs),
        )?;
        state.clock = self.clock;
        Ok(state)
    }

    /// Writes the session to `path` (module docs of [`crate::session_file`]) with `app`,
    /// the caller's own record, in it, signed with `keys`' first key. The session goes on;
    /// to pause it, end it after.
    pub fn save(
        &mut self,
        ex: &Executor,
        path: &std::path::Path,
        app: Vec<u8>,
        keys: &session_file::SessionKeys,
    ) -> Result<WriteStats, SessionError> {
        self.refuse()?;
        let t = ex.template();
        let machine = self.capture_state(ex)?;
        // Every page that can differ from the template: its own copies, and its layers'.
        let mut pages = self.m.ram.private_pages().map_err(SessionError::Pagemap)?;
        for l in &self.layers {
            for &(first, count) in l.page_runs() {
                for p in first..first + count {
                    pages[(p / 64) as usize] |= 1 << (p % 64);
                }
            }
        }
        let runs = crate::layer::coalesce(set_bits(&pages), crate::layer::MAX_RUNS);
        let header = session_file::Header {
            template: t.key(),
            host_identity: t.state().host_identity.clone(),
            ram_size: t.state().ram_size,
            runs,
            pages_sha256: [0; 32],
            machine,
            sequence: self.sequence,
            executions: self.executions,
            parked_wall_ns: self.parked_wall_ns,
            ran_processes: self.ran_processes(),
            app,
        };
        Ok(session_file::write(path, &self.m.ram, header, keys)?)
    }

    /// Makes a session from `f` (read with [`session_file::read`], so its MAC verified) on
    /// `ex`'s template: the same session again, or with `new_identity` a new one with a CRNG
    /// and `random` of its own. Its memory is mapped from the file, which may be removed
    /// after. Its machine state is checked against the template's first
    /// ([`SessionFile::check_template`]): the VM gets the template's CPUID and MSR list, and
    /// nothing out of range reaches KVM.
    pub fn load(ex: &Executor, f: &SessionFile, new_identity: bool) -> Result<Self, SessionError> {
        let t = ex.template();
        f.check_template(t)?;
        let file = f.file.try_clone().map_err(|source| SessionFileError::Io {
            path: f.path.clone(),
            source,
        })?;
        let h = &f.header;
        let layer = Arc::new(Layer::from_file(
            file,
            h.ram_size,
            h.runs.clone(),
            f.file_offsets(),
        ));
        let layers = if h.runs.is_empty() {
            Vec::new()
        } else {
            vec![layer]
        };
        let recipe = ChildRecipe {
            ex,
            state: &h.machine,
            serial: &h.machine.serial,
            layers: &layers,
            new_identity,
        };
        let (m, _) = recipe.make()?;
        Ok(Session {
            m,
            sequence: h.sequence,
            executions: h.executions,
            clock: h.machine.clock,
            timer_ahead: snapshot::timer_ahead_of(&h.machine.msrs),
            parked_wall_ns: h.parked_wall_ns,
            reseed: new_identity,
            layers,
            health: Health::Ready,
            ran_processes: h.ran_processes,
            beside: Beside::default(),
        })
    }

    /// Ends the session: a VM on the plain template mapping that stopped at DONE and never
    /// started a background process is reset and reused; any other is closed by the reaper.
    pub fn end(self, ex: &Executor) {
        if self.health.is_ready() && self.layers.is_empty() && !self.ran_processes() {
            ex.give_back(self.m);
        } else {
            ex.discard(self.m);
        }
    }
}
