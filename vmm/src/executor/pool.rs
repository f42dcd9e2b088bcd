//! Where a job's VM comes from: a new clone of the template, the pool's filler thread that
//! keeps up to `pool_size` VMs ready before jobs ask (with [`Reuse::Warm`] each new clone is
//! warmed up first: its first job's page faults are paid here, and the working set a lean VM
//! keeps is recorded), and taking a VM (warm, pooled or new; lean for a session).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{ExecError, Executor, Reuse, Shared};
use crate::job::{self, Health, Job, Kind, Request};
use crate::template::TemplateError;
use crate::vm::Machine;

/// The job the pool runs on each new clone before pooling it: the template's own warm-up
/// code when its image has one (`/usr/lib/bud/template_warm.py`, written by the guest
/// builder: `guest/src/site.rs`; the datascience template's group-by and figure), so the
/// pages a typical job of that template touches are mapped before a caller's job; an empty
/// job otherwise (one `stat` more).
const WARM_UP_JOB: &str = "import os\n\
if os.path.exists('/usr/lib/bud/template_warm.py'):\n\
    exec(compile(open('/usr/lib/bud/template_warm.py').read(), 'template_warm', 'exec'), {})\n";

/// The session cell the pool runs on each new clone after [`WARM_UP_JOB`]: an assignment
/// and an expression's value, what a session's first cells do.
const WARM_UP_CELL: &str = "_ = list(range(10))\nlen(_)";

/// How long the warm-up cell may take past its time before the VM is given up.
const WARM_UP_GRACE: Duration = Duration::from_secs(2);

impl Shared {
    /// Closes VM `m` (here, on the calling thread) and counts it out.
    pub(super) fn close(&self, m: Machine) {
        let started = Instant::now();
        drop(m);
        let c = &self.counters;
        c.close_nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        c.closed.fetch_add(1, Ordering::Relaxed);
        c.live.fetch_sub(1, Ordering::Relaxed);
    }

    fn new_clone(&self) -> Result<Machine, TemplateError> {
        let mut m = self.template.clone_machine(&self.kvm)?;
        m.set_egress(self.egress());
        self.counters.live.fetch_add(1, Ordering::Relaxed);
        Ok(m)
    }

    /// Runs [`WARM_UP_JOB`] on a new clone and resets it: the clone's first job pays for
    /// faulting in everything a job touches (tens of milliseconds under kvm_pvm's shadow
    /// paging); this pays it before any caller waits. None if anything went wrong (then the
    /// clone is closed).
    fn warm_up(&self, mut m: Machine) -> Option<Machine> {
        // The pages every warm-up writes, copied before the guest runs: no copy-on-write
        // fault in the guest, and none that every other VM of this process hears of
        // (`GuestRam::populate_private`). A kernel without MADV_POPULATE_WRITE (before 5.14)
        // refuses it: then the guest's writes copy them as before.
        if let Some(pages) = self.working_set.get() {
            let _ = m.ram.populate_private(pages);
        }
        let warm_up = Job::python(WARM_UP_JOB);
        let state = self.template.state();
        let ran = job::run(&mut m, state, &warm_up, &mut |_, _| {});
        // Then one session cell: a session's first cell then finds the pages of the
        // worker's cell path mapped and, being in the working set, private already (a lean
        // VM keeps them), instead of faulting each in (~300 faults, ~15 ms under kvm_pvm,
        // more with many VMs alive).
        let cell_job = Job::python(WARM_UP_CELL);
        let cell = Request {
            job: &cell_job,
            kind: Kind::Cell { reseed: false },
            sequence: 2,
            interrupt_grace: Some(WARM_UP_GRACE),
            beside: None,
        };
        let ran = match ran {
            Ok((_, Health::Ready)) => job::run_request(&mut m, state, &cell, &mut |_, _| {}),
            other => other,
        };
        let ok = matches!(ran, Ok((_, Health::Ready))) && self.reset(&mut m).is_ok();
        if ok {
            if self.working_set.get().is_none()
                && let Ok(pages) = m.ram.private_pages()
            {
                let _ = self.working_set.set(pages);
            }
            return Some(m);
        }
        self.close(m);
        None
    }

    pub(super) fn fill(&self) {
        let mut idle = self.idle();
        while !self.stopping.load(Ordering::SeqCst) {
            if idle.fresh.len() + idle.warm.len() >= self.opts.pool_size {
                idle = self
                    .wake_filler
                    .wait(idle)
                    .unwrap_or_else(|e| e.into_inner());
                continue;
            }
            drop(idle);
            let made = self.new_clone();
            let made = match (made, self.opts.reuse) {
                (Ok(m), Reuse::Warm) => self.warm_up(m).ok_or(()),
                (Ok(m), Reuse::Fresh) => Ok(m),
                (Err(_), _) => Err(()),
            };
            idle = self.idle();
            match made {
                Ok(m) if self.opts.reuse == Reuse::Warm => idle.warm.push(m),
                Ok(m) => idle.fresh.push_back(m),
                // The inline path reports errors to callers; here, back off and retry.
                Err(_) => {
                    idle = self
                        .wake_filler
                        .wait_timeout(idle, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }
}

impl Executor {
    /// A VM at READY: a warm one if any is idle, else a fresh clone from the pool, else one
    /// made now. Returns it and the time taken.
    pub(crate) fn take_vm(&self) -> Result<(Machine, Duration), ExecError> {
        let started = Instant::now();
        let idle = {
            let mut idle = self.shared.idle();
            let m = idle.warm.pop().or_else(|| idle.fresh.pop_front());
            self.shared.wake_filler.notify_one();
            m
        };
        let m = match idle {
            Some(m) => m,
            None => self.shared.new_clone()?,
        };
        Ok((m, started.elapsed()))
    }

    /// A VM at READY, like [`Executor::take_vm`], holding no more host memory than a
    /// warmed-up clone: for a VM kept long (a session). A warm VM keeps private every page
    /// any of its earlier jobs wrote (a reset copies the template back into them, module
    /// docs), up to `max_private_pages`; the pages outside the working set a warm-up
    /// records are given back ([`GuestRam::drop_private_pages`](crate::memory::GuestRam::drop_private_pages)),
    /// which is exact because a reset VM's pages equal the template's. With no working set
    /// recorded yet (no warm-up ran) every private page is given back. Returns the VM, the
    /// time taken and the pages given back.
    pub(crate) fn take_lean_vm(&self) -> Result<(Machine, Duration, u64), ExecError> {
        let (m, _) = self.take_vm()?;
        let started = Instant::now();
        let trimmed = m
            .ram
            .private_pages()
            .map_err(ExecError::Pagemap)
            .and_then(|mut pages| {
                if let Some(keep) = self.shared.working_set.get() {
                    for (word, kept) in pages.iter_mut().zip(keep) {
                        *word &= !kept;
                    }
                }
                Ok(m.ram.drop_private_pages(&pages)?)
            });
        match trimmed {
            Ok(dropped) => Ok((m, started.elapsed(), dropped)),
            Err(e) => {
                self.discard(m);
                Err(e)
            }
        }
    }
}
