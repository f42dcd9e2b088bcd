//! Admission and the job threads: where KVM work runs, away from the async runtime.
//!
//! - **Admission** is a counter of jobs in the system (running or waiting), capped at
//!   `workers + queue`. [`JobThreads::admit`] takes `n` slots at once or none (a batch is
//!   admitted whole), so a full server answers 429 at once instead of queueing without bound.
//! - **Job threads**: `workers` plain OS threads take work from one channel and run it. Each
//!   job runs one clone's vCPU on its job thread ([`vmm::Executor::run`] is synchronous); the
//!   tokio workers only await a reply.
//! - A [`Slot`] goes back when its work is done (or dropped unrun), whatever happened.
//! - [`JobThreads::close`] stops admission; the threads finish what was queued and exit.
//!
//! This module never touches KVM itself and never blocks an async task.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Work = Box<dyn FnOnce() + Send>;

#[derive(Debug, Default)]
struct Counters {
    admitted: AtomicUsize,
    running: AtomicUsize,
    closed: AtomicBool,
}

/// A fixed set of job threads behind an admission counter.
#[derive(Debug)]
pub struct JobThreads {
    capacity: usize,
    counters: Arc<Counters>,
    tx: Mutex<Option<Sender<(Slot, Work)>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// One admitted job's place; handing it back happens on drop.
#[derive(Debug)]
pub struct Slot {
    counters: Arc<Counters>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.counters.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Cancels its job when dropped while armed. Held by the request's future, or by its
/// response stream: a client that goes away drops them, which cancels what it asked for
/// ([`vmm::Cancel`]: the vCPU is kicked, the job ends `cancelled`, the worker is free).
#[derive(Debug)]
pub struct CancelOnDrop(Option<vmm::Cancel>);

impl CancelOnDrop {
    /// A new handle for `job`, armed.
    pub fn for_job(job: &mut vmm::Job) -> Self {
        let c = vmm::Cancel::new();
        job.cancel = Some(c.clone());
        Self(Some(c))
    }

    /// The job's answer went out: nothing to cancel any more.
    pub fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.cancel();
        }
    }
}

/// Why work was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error("all {0} job slots are taken")]
    Full(usize),
    #[error("job threads are closed")]
    Closed,
}

impl JobThreads {
    /// Starts `workers` job threads admitting up to `capacity` jobs at once.
    pub fn start(workers: usize, capacity: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<(Slot, Work)>();
        let rx = Arc::new(Mutex::new(rx));
        let counters = Arc::new(Counters::default());
        let mut threads = Vec::with_capacity(workers);
        for i in 0..workers {
            let rx = rx.clone();
            let counters = counters.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("bud-job-{i}"))
                    .spawn(move || job_thread(&rx, &counters))?,
            );
        }
        Ok(Self {
            capacity,
            counters,
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
        })
    }

    /// Takes `n` slots, all or none.
    pub fn admit(&self, n: usize) -> Result<Vec<Slot>, AdmitError> {
        if self.counters.closed.load(Ordering::Acquire) {
            return Err(AdmitError::Closed);
        }
        let taken =
            self.counters
                .admitted
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                    (now + n <= self.capacity).then_some(now + n)
                });
        if taken.is_err() {
            return Err(AdmitError::Full(self.capacity));
        }
        Ok((0..n)
            .map(|_| Slot {
                counters: self.counters.clone(),
            })
            .collect())
    }

    /// Runs `work` on a job thread; the slot is released when it returns.
    pub fn spawn(
        &self,
        slot: Slot,
        work: impl FnOnce() + Send + 'static,
    ) -> Result<(), AdmitError> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        match tx.as_ref() {
            Some(tx) => tx
                .send((slot, Box::new(work)))
                .map_err(|_| AdmitError::Closed),
            None => Err(AdmitError::Closed),
        }
    }

    /// Most jobs admitted at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Jobs on a job thread now.
    pub fn running(&self) -> usize {
        self.counters.running.load(Ordering::Relaxed)
    }

    /// Jobs admitted and not yet on a job thread.
    pub fn queued(&self) -> usize {
        self.counters
            .admitted
            .load(Ordering::Relaxed)
            .saturating_sub(self.running())
    }

    /// Stops admitting; queued work still runs. Idempotent.
    pub fn close(&self) {
        self.counters.closed.store(true, Ordering::Release);
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// Closes and waits for the job threads to finish everything queued.
    pub fn join(&self) {
        self.close();
        let threads: Vec<_> = self
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for t in threads {
            // A job thread does not panic: work runs under catch_unwind.
            let _ = t.join();
        }
    }
}

impl Drop for JobThreads {
    fn drop(&mut self) {
        self.join();
    }
}

fn job_thread(rx: &Mutex<Receiver<(Slot, Work)>>, counters: &Counters) {
    loop {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok((slot, work)) = next else {
            return;
        };
        counters.running.fetch_add(1, Ordering::AcqRel);
        // A panicking job drops its reply channel (the request gets a 500); the thread lives.
        let _ = catch_unwind(AssertUnwindSafe(work));
        counters.running.fetch_sub(1, Ordering::AcqRel);
        drop(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn admission_is_all_or_nothing_and_slots_come_back() {
        let jobs = JobThreads::start(1, 3).unwrap();

        let two = jobs.admit(2).unwrap();
        let too_many = jobs.admit(2);
        let one = jobs.admit(1).unwrap();
        drop(two);
        let again = jobs.admit(2);

        assert_eq!(too_many.unwrap_err(), AdmitError::Full(3));
        assert_eq!(one.len(), 1);
        assert_eq!(again.map(|s| s.len()), Ok(2));
    }

    #[test]
    fn work_runs_on_a_job_thread_and_releases_its_slot() {
        let jobs = JobThreads::start(2, 2).unwrap();
        let (tx, rx) = channel();

        for slot in jobs.admit(2).unwrap() {
            let tx = tx.clone();
            jobs.spawn(slot, move || {
                let name = std::thread::current().name().unwrap_or("").to_string();
                tx.send(name).unwrap();
            })
            .unwrap();
        }
        let names = [rx.recv().unwrap(), rx.recv().unwrap()];
        jobs.join();

        assert!(names.iter().all(|n| n.starts_with("bud-job-")), "{names:?}");
        assert_eq!(jobs.queued() + jobs.running(), 0);
    }

    #[test]
    fn a_panicking_job_does_not_kill_its_thread() {
        let jobs = JobThreads::start(1, 2).unwrap();
        let (tx, rx) = channel();
        let mut slots = jobs.admit(2).unwrap();

        jobs.spawn(slots.pop().unwrap(), || panic!("job panicked"))
            .unwrap();
        jobs.spawn(slots.pop().unwrap(), move || tx.send(7).unwrap())
            .unwrap();

        assert_eq!(rx.recv().unwrap(), 7);
    }

    #[test]
    fn closed_threads_admit_nothing_but_finish_queued_work() {
        let jobs = JobThreads::start(1, 2).unwrap();
        let (tx, rx) = channel();
        let slot = jobs.admit(1).unwrap().pop().unwrap();
        jobs.spawn(slot, move || tx.send(1).unwrap()).unwrap();

        jobs.join();

        assert_eq!(jobs.admit(1).unwrap_err(), AdmitError::Closed);
        assert_eq!(rx.recv().unwrap(), 1);
    }
}
