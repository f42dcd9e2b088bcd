//! Running jobs against a template: a pool of ready clones in front, a reaper behind.
//!
//! - The **pool** keeps up to `pool_size` clones restored and waiting (never running), filled
//!   by one background thread, so a job usually starts on a clone that already exists. When
//!   the pool is empty the job makes its own clone inline.
//! - The **reaper** thread closes finished clones: closing a VM with an in-kernel irqchip takes
//!   milliseconds of wall time, which a job's caller should not wait for.
//!
//! [`Executor::run`] is safe to call from many threads at once; each call runs one clone's
//! vCPU on the calling thread (so never call it from an async executor's worker threads).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::Kvm;

use crate::job::{self, Job, JobError, JobResult, Stream};
use crate::template::{Template, TemplateError};
use crate::vm::{Machine, VmError};

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
}

#[derive(Debug)]
struct Shared {
    template: Template,
    kvm: Kvm,
    ready: Mutex<VecDeque<Machine>>,
    wake_filler: Condvar,
    pool_size: usize,
    stopping: AtomicBool,
    live_clones: AtomicUsize,
}

impl Shared {
    fn new_clone(&self) -> Result<Machine, TemplateError> {
        let m = self.template.clone_machine(&self.kvm)?;
        self.live_clones.fetch_add(1, Ordering::Relaxed);
        Ok(m)
    }

    fn fill(&self) {
        let mut ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        while !self.stopping.load(Ordering::SeqCst) {
            if ready.len() >= self.pool_size {
                ready = self
                    .wake_filler
                    .wait(ready)
                    .unwrap_or_else(|e| e.into_inner());
                continue;
            }
            drop(ready);
            let made = self.new_clone();
            ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
            match made {
                Ok(m) => ready.push_back(m),
                // The inline path reports errors to callers; here, back off and retry.
                Err(_) => {
                    ready = self
                        .wake_filler
                        .wait_timeout(ready, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }
}

/// Counters for health and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutorStats {
    /// Clones waiting in the pool.
    pub ready: usize,
    /// Clones that exist (pooled, running or waiting for the reaper).
    pub live: usize,
    pub pool_size: usize,
}

/// Runs jobs in clones of one template.
#[derive(Debug)]
pub struct Executor {
    shared: Arc<Shared>,
    filler: Option<JoinHandle<()>>,
    reaper: Option<(Sender<Machine>, JoinHandle<()>)>,
}

impl Executor {
    /// An executor over `template` keeping `pool_size` clones ready (0: no pool).
    pub fn new(template: Template, pool_size: usize) -> Result<Self, ExecError> {
        let shared = Arc::new(Shared {
            template,
            kvm: crate::vm::open_kvm()?,
            ready: Mutex::new(VecDeque::new()),
            wake_filler: Condvar::new(),
            pool_size,
            stopping: AtomicBool::new(false),
            live_clones: AtomicUsize::new(0),
        });
        let filler = if pool_size > 0 {
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
        let (tx, rx) = mpsc::channel::<Machine>();
        let s = shared.clone();
        let reaper = std::thread::Builder::new()
            .name("bud-reaper".into())
            .spawn(move || {
                for machine in rx {
                    drop(machine);
                    s.live_clones.fetch_sub(1, Ordering::Relaxed);
                }
            })
            .map_err(ExecError::Thread)?;
        Ok(Self {
            shared,
            filler,
            reaper: Some((tx, reaper)),
        })
    }

    /// The template jobs run in.
    pub fn template(&self) -> &Template {
        &self.shared.template
    }

    /// Pool and clone counters.
    pub fn stats(&self) -> ExecutorStats {
        ExecutorStats {
            ready: self.shared.ready.lock().map(|r| r.len()).unwrap_or(0),
            live: self.shared.live_clones.load(Ordering::Relaxed),
            pool_size: self.shared.pool_size,
        }
    }

    /// A clone: from the pool if one is ready, else made now. Returns it and the time taken.
    pub fn take_clone(&self) -> Result<(Machine, Duration), ExecError> {
        let started = Instant::now();
        let pooled = {
            let mut ready = self.shared.ready.lock().unwrap_or_else(|e| e.into_inner());
            let m = ready.pop_front();
            self.shared.wake_filler.notify_one();
            m
        };
        let m = match pooled {
            Some(m) => m,
            None => self.shared.new_clone()?,
        };
        Ok((m, started.elapsed()))
    }

    /// Hands a finished clone to the reaper.
    pub fn discard(&self, m: Machine) {
        let m = match &self.reaper {
            Some((tx, _)) => match tx.send(m) {
                Ok(()) => return,
                Err(back) => back.0,
            },
            None => m,
        };
        // No reaper to take it: close it here.
        drop(m);
        self.shared.live_clones.fetch_sub(1, Ordering::Relaxed);
    }

    /// Runs `j` in a fresh clone and throws the clone away.
    pub fn run(&self, j: &Job) -> Result<JobResult, ExecError> {
        self.run_streaming(j, &mut |_, _| {})
    }

    /// Like [`Executor::run`], calling `on_output` with each chunk of output as it arrives.
    pub fn run_streaming(
        &self,
        j: &Job,
        on_output: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<JobResult, ExecError> {
        let started = Instant::now();
        let (mut m, clone_time) = self.take_clone()?;
        let outcome = job::run(&mut m, &self.shared.template.state().mailbox, j, on_output);
        self.discard(m);
        let mut result = outcome?;
        result.timings.clone = clone_time;
        result.timings.total = started.elapsed();
        Ok(result)
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.wake_filler.notify_all();
        if let Some(f) = self.filler.take() {
            let _ = f.join();
        }
        let pooled: Vec<Machine> = self
            .shared
            .ready
            .lock()
            .map(|mut r| r.drain(..).collect())
            .unwrap_or_default();
        for m in pooled {
            self.discard(m);
        }
        if let Some((tx, handle)) = self.reaper.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}
