//! Running jobs against a template from many threads: warm VMs reset in place, a pool of
//! fresh clones in front, a reaper behind.
//!
//! - **Warm VMs** ([`Reuse::Warm`], the default): after a job that ended at DONE, its VM is
//!   [`reset`](crate::reset::reset) to the template's READY state and kept for the next job, whose
//!   pages are then already private and mapped. The idle warm VMs form a stack (the most
//!   recently used first) of at most `max_idle`: one given back past it (a session's at its
//!   end, after a burst of sessions) goes to the reaper. A VM whose job ended any other way (timeout, output cap, a dead
//!   worker, a crash), whose reset or verification failed, or that holds more than
//!   `max_private_pages` private pages, is never reused: it goes to the reaper and a fresh clone takes its
//!   place. [`Reuse::Fresh`] throws every VM away after one job, as bud did before resets.
//! - **Verify** (`verify: true`, tests and the paranoid): after every reset the VM is compared
//!   with the template by value ([`crate::reset::verify`]); a VM whose job ended abnormally is
//!   reset and verified too before it is thrown away, so every kind of job proves the reset.
//!   Failures are kept for [`Executor::take_reset_errors`].
//! - The **pool** keeps up to `pool_size` VMs (fresh clones, plus idle warm VMs) ready, filled
//!   by one background thread, so a job usually starts on a VM that already exists. With
//!   [`Reuse::Warm`] the filler runs an empty job on each new clone and resets it before
//!   pooling it, so even the first job on a VM finds its mappings in place.
//! - The **reaper** thread closes discarded VMs: closing a VM with an in-kernel irqchip takes
//!   milliseconds of wall time, which a job's caller should not wait for. Its backlog is
//!   bounded ([`REAPER_BACKLOG`]): past it, the caller closes the VM itself.
//!
//! [`Executor::run`] is safe to call from many threads at once; each call runs one VM's vCPU
//! on the calling thread (so never call it from an async executor's worker threads).
//!
//! Where VMs come from (new clones, the pool's filler, taking one) is in `pool`; this file
//! holds the executor, the state it shares with its threads, running a job, and where a VM
//! goes after it (reset and kept, or to the reaper).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Discarded VMs that may wait for the reaper; past it, [`Executor::discard`] closes the VM
/// on the calling thread. Bounded so that VMs waiting to be closed (each holding its private pages until then) stay
/// few, yet large enough that a burst of session ends (a client deleting hundreds) returns
/// without closing VMs on its own threads: closing one took ~12 ms with 1 000 VMs alive
/// (docs/measurements.md, issue 60). Counted in `live` until closed.
pub(crate) const REAPER_BACKLOG: usize = 64;

use kvm_ioctls::Kvm;

use crate::job::{self, Health, Job, JobError, JobResult, Stream, Unusable};
use crate::reset::{self, ResetError};
use crate::template::{Template, TemplateError};
use crate::vm::{Machine, VmError};

mod pool;

/// Errors that stop a job from running at all.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot create a clone: {0}")]
    Clone(#[from] TemplateError),
    #[error(transparent)]
    Job(#[from] JobError),
    #[error("cannot start executor thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("reading /proc/self/pagemap: {0}")]
    Pagemap(std::io::Error),
    #[error("giving back a VM's private pages: {0}")]
    Trim(#[from] crate::memory::MemoryError),
}

/// What happens to a VM after its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Reset it in place and run the next job in it (when the job ended cleanly).
    Warm,
    /// Throw it away; every job gets a fresh clone.
    Fresh,
}

/// How an [`Executor`] runs jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutorOptions {
    /// VMs kept ready before jobs ask (0: none).
    pub pool_size: usize,
    pub reuse: Reuse,
    /// Verify every reset by value (slow: reads all of guest RAM).
    pub verify: bool,
    /// A VM holding more private (copy-on-write) pages than this after a job is replaced
    /// instead of kept: bounds the host memory a warm VM keeps (a reset leaves every page a
    /// job wrote private, restored to the template's bytes).
    pub max_private_pages: u64,
    /// Idle VMs (warm and fresh) kept at most: a VM given back past it (a session's, at its
    /// end) is closed instead of kept warm, so a burst of sessions that ends leaves no
    /// hundreds of idle VMs holding memory. At least `pool_size` are kept whatever this says.
    pub max_idle: usize,
}

impl Default for ExecutorOptions {
    fn default() -> Self {
        Self {
            pool_size: 2,
            reuse: Reuse::Warm,
            verify: false,
            max_private_pages: 16 * 1024,
            max_idle: 16,
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    live: AtomicUsize,
    resets: AtomicU64,
    reset_nanos: AtomicU64,
    restored_pages: AtomicU64,
    mapping_drops: AtomicU64,
    replaced_abnormal: AtomicU64,
    replaced_too_dirty: AtomicU64,
    replaced_reset_failed: AtomicU64,
    closed: AtomicU64,
    close_nanos: AtomicU64,
}

#[derive(Debug, Default)]
struct Idle {
    /// Clones that never ran.
    fresh: VecDeque<Machine>,
    /// Reset VMs, most recently used last.
    warm: Vec<Machine>,
}

#[derive(Debug)]
struct Shared {
    template: Template,
    kvm: Kvm,
    opts: ExecutorOptions,
    idle: Mutex<Idle>,
    wake_filler: Condvar,
    stopping: AtomicBool,
    counters: Counters,
    reset_errors: Mutex<Vec<String>>,
    /// The pages a warmed-up clone holds private after its reset: what any job touches
    /// (recorded by the first warm-up; see [`Executor::take_lean_vm`]).
    working_set: OnceLock<Vec<u64>>,
    /// Decides the network card's names and connections in every VM of a template with a
    /// card ([`Executor::set_egress`]); None: the card's default, which refuses everything.
    egress: Mutex<Option<Arc<dyn crate::net::Egress>>>,
}

impl Shared {
    /// The egress of this executor's VMs ([`Executor::set_egress`]), or the card's default.
    fn egress(&self) -> Arc<dyn crate::net::Egress> {
        self.egress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| Arc::new(crate::net::NoEgress))
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resets `m` (and verifies it when asked); returns the private pages it holds. Errors
    /// are kept for [`Executor::take_reset_errors`].
    fn reset(&self, m: &mut Machine) -> Result<u64, ResetError> {
        let t = &self.template;
        let c = &self.counters;
        let done = reset::reset(m, t).and_then(|stats| {
            if self.opts.verify {
                reset::verify(&self.kvm, m, t)?;
            }
            Ok(stats)
        });
        match done {
            Ok(stats) => {
                c.resets.fetch_add(1, Ordering::Relaxed);
                c.reset_nanos
                    .fetch_add(stats.time.as_nanos() as u64, Ordering::Relaxed);
                c.restored_pages
                    .fetch_add(stats.restored_pages, Ordering::Relaxed);
                c.mapping_drops
                    .fetch_add(u64::from(stats.forgot_mappings), Ordering::Relaxed);
                Ok(stats.private_pages)
            }
            Err(e) => {
                self.reset_errors
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(e.to_string());
                Err(e)
            }
        }
    }
}

/// Counters for health and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecutorStats {
    /// Fresh clones waiting in the pool.
    pub ready: usize,
    /// Reset VMs waiting for a job.
    pub warm: usize,
    /// VMs that exist (pooled, warm, running or waiting for the reaper).
    pub live: usize,
    pub pool_size: usize,
    /// Resets done, their total time, and the pages they copied back.
    pub resets: u64,
    pub reset_time: Duration,
    pub restored_pages: u64,
    /// Resets that made KVM drop its mappings (a job changed a page table, shadow paging).
    pub mapping_drops: u64,
    /// VMs replaced instead of reused, by reason.
    pub replaced_abnormal: u64,
    pub replaced_too_dirty: u64,
    pub replaced_reset_failed: u64,
    /// VMs closed, and the time their closing took (the host's teardown of a VM: its
    /// memory unmapped, its vCPU, irqchip and timers freed).
    pub closed: u64,
    pub close_time: Duration,
}

impl std::ops::AddAssign for ExecutorStats {
    /// Adds another executor's figures (a server's several templates).
    fn add_assign(&mut self, o: Self) {
        self.ready += o.ready;
        self.warm += o.warm;
        self.live += o.live;
        self.pool_size += o.pool_size;
        self.resets += o.resets;
        self.reset_time += o.reset_time;
        self.restored_pages += o.restored_pages;
        self.mapping_drops += o.mapping_drops;
        self.replaced_abnormal += o.replaced_abnormal;
        self.replaced_too_dirty += o.replaced_too_dirty;
        self.replaced_reset_failed += o.replaced_reset_failed;
        self.closed += o.closed;
        self.close_time += o.close_time;
    }
}

/// Runs jobs in VMs of one template.
#[derive(Debug)]
pub struct Executor {
    shared: Arc<Shared>,
    filler: Option<JoinHandle<()>>,
    reaper: Option<(SyncSender<Machine>, JoinHandle<()>)>,
}

impl Executor {
    /// An executor over `template`.
    pub fn new(template: Template, opts: ExecutorOptions) -> Result<Self, ExecError> {
        crate::timer::start();
        if template.state().machine.net.is_some() {
            crate::net::start();
        }
        let shared = Arc::new(Shared {
            template,
            kvm: crate::vm::open_kvm()?,
            opts,
            idle: Mutex::new(Idle::default()),
            wake_filler: Condvar::new(),
            stopping: AtomicBool::new(false),
            counters: Counters::default(),
            reset_errors: Mutex::new(Vec::new()),
            working_set: OnceLock::new(),
            egress: Mutex::new(None),
        });
        let filler = if opts.pool_size > 0 {
            let s = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("bud-pool".into())
                    .spawn(move || s.fill())
                    .map_err(ExecError::Thread)?,
            )
        } else {
            None
        };
        let (tx, rx) = mpsc::sync_channel::<Machine>(REAPER_BACKLOG);
        let s = shared.clone();
        let reaper = std::thread::Builder::new()
            .name("bud-reaper".into())
            .spawn(move || {
                for machine in rx {
                    s.close(machine);
                }
            })
            .map_err(ExecError::Thread)?;
        Ok(Self {
            shared,
            filler,
            reaper: Some((tx, reaper)),
        })
    }

    /// Decides names and connections for the network card of every VM from now on: VMs
    /// made later get it, idle ones are given it here (VMs of a template without a card
    /// ignore it).
    pub fn set_egress(&self, egress: Arc<dyn crate::net::Egress>) {
        *self.shared.egress.lock().unwrap_or_else(|e| e.into_inner()) = Some(egress.clone());
        let mut idle = self.shared.idle();
        let Idle { fresh, warm } = &mut *idle;
        for m in fresh.iter_mut().chain(warm.iter_mut()) {
            m.set_egress(egress.clone());
        }
    }

    /// The template jobs run in.
    pub fn template(&self) -> &Template {
        &self.shared.template
    }

    /// Pool, VM and reset counters.
    pub fn stats(&self) -> ExecutorStats {
        let (ready, warm) = {
            let idle = self.shared.idle();
            (idle.fresh.len(), idle.warm.len())
        };
        let c = &self.shared.counters;
        ExecutorStats {
            ready,
            warm,
            live: c.live.load(Ordering::Relaxed),
            pool_size: self.shared.opts.pool_size,
            resets: c.resets.load(Ordering::Relaxed),
            reset_time: Duration::from_nanos(c.reset_nanos.load(Ordering::Relaxed)),
            restored_pages: c.restored_pages.load(Ordering::Relaxed),
            mapping_drops: c.mapping_drops.load(Ordering::Relaxed),
            replaced_abnormal: c.replaced_abnormal.load(Ordering::Relaxed),
            replaced_too_dirty: c.replaced_too_dirty.load(Ordering::Relaxed),
            replaced_reset_failed: c.replaced_reset_failed.load(Ordering::Relaxed),
            closed: c.closed.load(Ordering::Relaxed),
            close_time: Duration::from_nanos(c.close_nanos.load(Ordering::Relaxed)),
        }
    }

    /// Reset and verification failures seen so far (then forgotten).
    pub fn take_reset_errors(&self) -> Vec<String> {
        std::mem::take(
            &mut *self
                .shared
                .reset_errors
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// The KVM handle VMs are made with.
    pub(crate) fn kvm(&self) -> &Kvm {
        &self.shared.kvm
    }

    /// Takes back a VM lent with [`Executor::take_vm`] whose last request ended at DONE
    /// and whose RAM is still the template's mapping (no layer mapped over it): it is reset
    /// and kept like a job's VM (module docs), or replaced if the reset fails or it holds
    /// too many private pages. Closed at once, without a reset, when `max_idle` VMs idle
    /// already (the end of a burst of sessions).
    pub(crate) fn give_back(&self, mut m: Machine) {
        if self.idle_full() {
            return self.discard(m);
        }
        // A session's own egress ([`crate::session::Session::set_egress`]) ends with it.
        m.set_egress(self.shared.egress());
        self.recycle(m, Health::Ready);
    }

    /// Whether as many VMs idle as the executor keeps.
    fn idle_full(&self) -> bool {
        let opts = self.shared.opts;
        let idle = self.shared.idle();
        idle.fresh.len() + idle.warm.len() >= opts.max_idle.max(opts.pool_size)
    }

    /// Counts a VM made outside the executor (a session's fork child) among its live VMs;
    /// it is later handed to [`Executor::discard`] like any other.
    pub(crate) fn adopt(&self, m: Machine) -> Machine {
        self.shared.counters.live.fetch_add(1, Ordering::Relaxed);
        m
    }

    /// Hands a VM to the reaper; closes it here if [`REAPER_BACKLOG`] VMs already wait (so
    /// discarded VMs, each holding its private pages, never pile up faster than they close).
    pub(crate) fn discard(&self, m: Machine) {
        let m = match &self.reaper {
            Some((tx, _)) => match tx.try_send(m) {
                Ok(()) => return,
                Err(TrySendError::Full(back) | TrySendError::Disconnected(back)) => back,
            },
            None => m,
        };
        // No reaper to take it: close it here.
        self.shared.close(m);
    }

    /// Runs `j` and returns its result; the VM is then reset or replaced (module docs).
    pub fn run(&self, j: &Job) -> Result<JobResult, ExecError> {
        self.run_streaming(j, &mut |_, _| {})
    }

    /// Like [`Executor::run`], calling `on_output` with each chunk of output as it arrives.
    pub(crate) fn run_streaming(
        &self,
        j: &Job,
        on_output: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<JobResult, ExecError> {
        let mut out = None;
        self.run_then(j, on_output, |r| out = Some(r));
        out.unwrap_or_else(|| unreachable!("run_then delivers exactly once"))
    }

    /// Runs `j`, hands its outcome to `deliver`, and only then resets (or replaces) the VM,
    /// so a caller that answers a client from `deliver` does not make it wait for the reset.
    pub fn run_then(
        &self,
        j: &Job,
        on_output: &mut dyn FnMut(Stream, &[u8]),
        deliver: impl FnOnce(Result<JobResult, ExecError>),
    ) {
        let started = Instant::now();
        let (mut m, clone_time) = match self.take_vm() {
            Ok(taken) => taken,
            Err(e) => return deliver(Err(e)),
        };
        if let Some(egress) = &j.egress {
            m.set_egress(egress.0.clone());
        }
        let ran = job::run(&mut m, self.shared.template.state(), j, on_output);
        if j.egress.is_some() {
            // Before the reset, which keeps the egress in force: the next job gets the
            // executor's, never this one's.
            m.set_egress(self.shared.egress());
        }
        match ran {
            Ok((mut result, health)) => {
                result.timings.clone = clone_time;
                result.timings.total = started.elapsed();
                deliver(Ok(result));
                self.recycle(m, health);
            }
            Err(e) => {
                let why = Unusable::Failed(e.to_string());
                deliver(Err(e.into()));
                self.recycle(m, Health::Discard(why));
            }
        }
    }

    /// After a job: reset the VM and keep it, or throw it away (module docs).
    fn recycle(&self, mut m: Machine, health: Health) {
        let opts = self.shared.opts;
        if opts.reuse == Reuse::Fresh && !opts.verify {
            return self.discard(m);
        }
        let c = &self.shared.counters;
        // The counter of why a warm VM is replaced; None for a VM that is simply done.
        let replaced = match (self.shared.reset(&mut m), health) {
            (Err(_), _) => Some(&c.replaced_reset_failed),
            (Ok(_), Health::Discard(_)) => Some(&c.replaced_abnormal),
            (Ok(pages), Health::Ready) if pages > opts.max_private_pages => {
                Some(&c.replaced_too_dirty)
            }
            (Ok(_), Health::Ready) if opts.reuse == Reuse::Warm => {
                if self.idle_full() {
                    return self.discard(m);
                }
                self.shared.idle().warm.push(m);
                return;
            }
            (Ok(_), Health::Ready) => None,
        };
        if let (Some(counter), Reuse::Warm) = (replaced, opts.reuse) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        self.discard(m);
        self.shared.wake_filler.notify_one();
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.wake_filler.notify_all();
        if let Some(f) = self.filler.take() {
            let _ = f.join();
        }
        let idle: Vec<Machine> = {
            let mut idle = self.shared.idle();
            let mut all: Vec<Machine> = idle.fresh.drain(..).collect();
            all.append(&mut idle.warm);
            all
        };
        for m in idle {
            self.discard(m);
        }
        if let Some((tx, handle)) = self.reaper.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}
