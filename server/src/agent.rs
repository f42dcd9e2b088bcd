//! HAProxy's agent check (`agent-check` on a server line; docs/cluster.md): on each TCP
//! connection to `--agent-port`, the node writes one line and closes it. HAProxy reads
//! the line as the server's state and weight:
//! - `down` until the default template is ready (no job could run);
//! - `drain` while the node drains: HAProxy sends it no new balanced requests, and still
//!   sends the requests its sessions' ids route to it;
//! - `ready up NN%` otherwise, NN the share of the node's job threads that are idle, and
//!   1 when every one is busy or jobs wait: under `balance leastconn` (connections over
//!   weight) a busy node gets new work only when every node is as busy. `ready` clears a
//!   drain HAProxy was told through this check.

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::state::AppState;

/// The line for the node's state now.
pub fn line(state: &AppState) -> String {
    let g = state.gauges();
    if !g.template_ready {
        return "down\n".into();
    }
    if state.node().draining() {
        return "drain\n".into();
    }
    let workers = g.workers.max(1);
    let idle = if g.jobs_queued > 0 {
        0
    } else {
        workers.saturating_sub(g.jobs_running) * 100 / workers
    };
    format!("ready up {}%\n", idle.max(1))
}

/// Answers agent checks on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, state: AppState) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            // Out of descriptors or similar: the next check comes in a moment.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let reply = line(&state);
        tokio::spawn(async move {
            let _ = conn.write_all(reply.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}
