//! HAProxy's agent check (`agent-check` on a server line; docs/cluster.md): on each TCP
//! connection to `--agent-port`, the node writes one line and closes it. HAProxy reads
//! the line as the server's state and weight:
//! - `down` until the default template is ready (no job could run);
//! - `drain` while the node drains: HAProxy sends it no new balanced requests, and still
//!   sends the requests its sessions' ids route to it;
//! - `ready up NN%` otherwise: NN the share of the node's job threads that are idle, at
//!   least 1. `ready` clears a drain HAProxy was told through this check.
//!
//! **Load, smoothed.** The front's balanced backend (`balance roundrobin` over these
//! weights) sees only the requests it balances, not a node's session cells, processes or
//! direct calls: the weight is what tells it about those. Sampled at the instant of the
//! check, with one job thread per node under load, it flipped between 1 and 100 from one
//! second to the next, and a node idle at its check got ~100 times the others' share for
//! a second (measured through HAProxy's `show stat`). So a sampler reads the busy share
//! (running and queued jobs over job threads, at most 1) every [`SAMPLE`] into an
//! exponential average with a time constant of [`TAU`], and the weight is made from the
//! larger of that average and the share now: new load counts at once, and a node that was
//! busy most of the last second is not reported idle because it was at one instant.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::core::state::AppState;

/// How often the load is sampled.
pub const SAMPLE: Duration = Duration::from_millis(100);
/// The time constant of the load's average.
pub const TAU: Duration = Duration::from_secs(1);

/// The node's busy share now: running and queued jobs over job threads, at most 1 (read
/// off the job threads' counters, not `AppState::gauges`, which also sums every template's
/// VM statistics: this runs every [`SAMPLE`]).
fn busy_now(state: &AppState) -> f64 {
    let jobs = state.jobs();
    let workers = state.config().workers.max(1) as f64;
    ((jobs.running() + jobs.queued()) as f64 / workers).min(1.0)
}

/// The load average (module docs), as f32 bits.
#[derive(Debug, Default)]
pub struct Load(AtomicU32);

impl Load {
    fn get(&self) -> f64 {
        f64::from(f32::from_bits(self.0.load(Ordering::Relaxed)))
    }

    /// Adds a sample `busy` (0..=1) taken [`SAMPLE`] after the last.
    pub fn sample(&self, busy: f64) {
        let alpha = 1.0 - (-SAMPLE.as_secs_f64() / TAU.as_secs_f64()).exp();
        let avg = self.get() + (busy - self.get()) * alpha;
        self.0.store((avg as f32).to_bits(), Ordering::Relaxed);
    }

    /// The weight for a node whose busy share is `busy` now: the idle share of the larger
    /// of that and the average, in percent, at least 1.
    pub fn weight(&self, busy: f64) -> u32 {
        let busy = busy.max(self.get()).clamp(0.0, 1.0);
        (((1.0 - busy) * 100.0).round() as u32).max(1)
    }
}

/// The line for the node's state now.
pub fn line(state: &AppState, load: &Load) -> String {
    if state.executor_if_ready().is_none() {
        return "down\n".into();
    }
    if state.node().draining() {
        return "drain\n".into();
    }
    format!("ready up {}%\n", load.weight(busy_now(state)))
}

/// Samples the load and answers agent checks on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, state: AppState) {
    let load = Arc::new(Load::default());
    let (sampled, st) = (load.clone(), state.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SAMPLE);
        loop {
            tick.tick().await;
            sampled.sample(busy_now(&st));
        }
    });
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            // Out of descriptors or similar: the next check comes in a moment.
            tokio::time::sleep(SAMPLE).await;
            continue;
        };
        let reply = line(&state, &load);
        tokio::spawn(async move {
            let _ = conn.write_all(reply.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_follows_load_at_once_and_forgets_it_over_about_a_second() {
        let load = Load::default();
        assert_eq!(load.weight(0.0), 100);
        // New load counts at once...
        assert_eq!(load.weight(1.0), 1);
        // ...and a node busy for a second is not idle because it is at one instant.
        for _ in 0..10 {
            load.sample(1.0);
        }
        let after_busy_second = load.weight(0.0);
        assert!(
            (30..=40).contains(&after_busy_second),
            "{after_busy_second}"
        );
        for _ in 0..30 {
            load.sample(0.0);
        }
        assert!(load.weight(0.0) >= 95, "{}", load.weight(0.0));
        assert_eq!(load.weight(0.5), 50);
    }
}
