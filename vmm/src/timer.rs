//! One timer thread per process that kicks vCPUs whose deadline passed.
//!
//! Every job has a wall-clock limit, and a vCPU stuck in guest code can only be stopped by a
//! kick from another thread. Spawning a thread per job would cost more than a clone; instead
//! [`arm`] registers (deadline, kicker) with a single sleeping thread and returns a guard that
//! disarms on drop.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Instant;

use crate::vcpu::Kicker;

#[derive(Debug, Default)]
struct Timers {
    next_id: u64,
    armed: BTreeMap<(Instant, u64), Kicker>,
}

#[derive(Debug, Default)]
struct Service {
    timers: Mutex<Timers>,
    changed: Condvar,
}

impl Service {
    fn run(&self) {
        let mut t = self.timers.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let now = Instant::now();
            while let Some(entry) = t.armed.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                entry.remove().kick();
            }
            t = match t.armed.keys().next().map(|k| k.0) {
                Some(due) => {
                    let wait = due.saturating_duration_since(Instant::now());
                    self.changed
                        .wait_timeout(t, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.changed.wait(t).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }
}

/// Starts the timer thread if it has not started: [`crate::Executor::new`] calls it, so
/// that the thread exists before any job runs. A server closes its seccomp jail once its
/// executors exist, and a job thread may not create threads: started lazily by the first
/// job, the thread was the job thread's `clone3`, and the jail killed the server (seen in
/// a fresh-clone run: a template loaded from disk, the jail closed, the first job).
pub(crate) fn start() {
    service();
}

fn service() -> &'static Service {
    static SERVICE: OnceLock<&'static Service> = OnceLock::new();
    SERVICE.get_or_init(|| {
        let s: &'static Service = Box::leak(Box::default());
        // If the thread cannot start, deadlines would silently never fire: better to fail loudly
        // at the first job than to let a runaway guest spin forever.
        std::thread::Builder::new()
            .name("bud-timer".into())
            .spawn(move || s.run())
            .expect("cannot start bud's timer thread");
        s
    })
}

/// A registered deadline; dropping it disarms the timer.
#[derive(Debug)]
pub(crate) struct Armed {
    key: (Instant, u64),
}

/// Kicks `kicker` at `deadline` unless the returned guard is dropped first.
pub(crate) fn arm(deadline: Instant, kicker: Kicker) -> Armed {
    let s = service();
    let mut t = s.timers.lock().unwrap_or_else(|e| e.into_inner());
    t.next_id += 1;
    let key = (deadline, t.next_id);
    let earliest = t.armed.keys().next().is_none_or(|k| *k > key);
    t.armed.insert(key, kicker);
    drop(t);
    if earliest {
        s.changed.notify_one();
    }
    Armed { key }
}

impl Drop for Armed {
    fn drop(&mut self) {
        let mut t = service().timers.lock().unwrap_or_else(|e| e.into_inner());
        t.armed.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_passed_deadline_kicks_and_a_dropped_one_does_not() {
        let fires = Kicker::new();
        let dropped = Kicker::new();

        let _a = arm(Instant::now() + Duration::from_millis(20), fires.clone());
        drop(arm(
            Instant::now() + Duration::from_millis(20),
            dropped.clone(),
        ));
        std::thread::sleep(Duration::from_millis(200));

        assert!(fires.is_kicked());
        assert!(!dropped.is_kicked());
    }

    #[test]
    fn an_earlier_deadline_armed_later_still_fires_first() {
        let late = Kicker::new();
        let early = Kicker::new();

        let _l = arm(Instant::now() + Duration::from_secs(30), late.clone());
        let _e = arm(Instant::now() + Duration::from_millis(10), early.clone());
        std::thread::sleep(Duration::from_millis(200));

        assert!(early.is_kicked());
        assert!(!late.is_kicked());
    }
}
