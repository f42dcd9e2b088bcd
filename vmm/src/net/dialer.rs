//! The network stacks' blocking work, off their vCPU threads: asking a VM's [`super::Egress`]
//! about a name (which may resolve it on the host) and about a connection, and dialing what
//! it allows. A stack holds the guest's DNS query or SYN meanwhile and answers it when the
//! work comes back ([`super::stack`]), so a slow resolver or a far host never stops a vCPU,
//! and a job thread (which a jailed server forbids to open sockets) never opens one.
//!
//! A fixed pool of [`THREADS`] threads for the whole process, started with the first
//! executor ([`start`]) as the other helper threads are. Each piece of work is bounded: a
//! dial by its timeout, a lookup by the host resolver's own. A VM may have at most a few in
//! flight (the stack's limits), so one VM cannot hold every thread for long; a pool that is
//! busy only queues work, in order.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};

/// Threads in the pool.
pub(crate) const THREADS: usize = 8;

/// One piece of blocking work.
pub(crate) type Work = Box<dyn FnOnce() + Send>;

/// Runs `work` on a thread of the pool (queued behind what is already there).
pub(crate) fn submit(work: Work) {
    // The pool's threads never end while the process lives, so the channel stays open.
    let _ = pool().lock().unwrap_or_else(|e| e.into_inner()).send(work);
}

/// Starts the pool if it has not started ([`crate::Executor::new`] calls it).
pub(crate) fn start() {
    pool();
}

fn pool() -> &'static Mutex<Sender<Work>> {
    static POOL: OnceLock<Mutex<Sender<Work>>> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Work>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..THREADS {
            let rx = rx.clone();
            // Without its threads no VM could ever connect: fail loudly at the first
            // executor rather than leave guests waiting on every connection.
            std::thread::Builder::new()
                .name(format!("bud-dial-{i}"))
                .spawn(move || serve(&rx))
                .expect("cannot start bud's network dial threads");
        }
        Mutex::new(tx)
    })
}

fn serve(rx: &Mutex<Receiver<Work>>) {
    loop {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        match next {
            // Work panicking would take this thread with it; the work of a stack catches
            // nothing it could panic on, but the pool keeps its size anyway.
            Ok(work) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
            }
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn work_runs_off_the_callers_thread_and_a_panic_does_not_shrink_the_pool() {
        let (tx, rx) = mpsc::channel();
        for _ in 0..THREADS {
            submit(Box::new(|| panic!("a piece of work that panics")));
        }
        for i in 0..THREADS * 2 {
            let tx = tx.clone();
            submit(Box::new(move || {
                let _ = tx.send((i, std::thread::current().name().map(str::to_owned)));
            }));
        }
        let mut seen: Vec<usize> = Vec::new();
        for _ in 0..THREADS * 2 {
            let (i, name) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert!(name.unwrap_or_default().starts_with("bud-dial-"));
            seen.push(i);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..THREADS * 2).collect::<Vec<_>>());
    }
}
