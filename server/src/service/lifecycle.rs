//! A session's life from outside its cells: the one way to start a session (from its
//! template, [`sessions::start_fresh`], or from a snapshot, [`durable::start_from`]) and
//! the reaper that ends or pauses the expired ones. It sits above both features, so
//! neither needs the other to start or expire a session.

use std::sync::Arc;
use std::time::Duration;

use crate::core::sessions::Entry;
use crate::core::state::AppState;
use crate::service::error::Error;
use crate::service::sessions::CreateSession;
use crate::service::{admission, durable, processes, sessions};

/// Starts the session `req` asks for: from its snapshot when it names one, else from
/// its template.
pub async fn start(state: &AppState, req: CreateSession) -> Result<Arc<Entry>, Error> {
    admission::check_open(state)?;
    match req.snapshot.clone() {
        Some(snap) => durable::start_from(state, &snap, req).await,
        None => sessions::start_fresh(state, req).await,
    }
}

/// Ends expired sessions every second until the server stops (spawned by `serve`), pauses
/// those that asked for it, starts the processes' pump of a resumed session, and every
/// minute removes traces past their retention.
pub async fn reaper(state: AppState) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut ticks: u64 = 0;
    loop {
        tick.tick().await;
        ticks += 1;
        if ticks % 60 == 0
            && let Some(t) = state.traces().cloned()
        {
            let _ =
                tokio::task::spawn_blocking(move || t.sweep(std::time::SystemTime::now())).await;
        }
        // A session resumed at a request (below the processes' service) gets its pump here,
        // within a tick; elsewhere every pump is started where its processes are.
        for e in state.sessions().list() {
            processes::ensure_pump(&state, &e);
        }
        let sessions: Arc<_> = state.sessions().clone();
        let park_s = state.config().sessions.park_idle_s;
        let park_after =
            (park_s > 0 && state.state_dir().is_some()).then(|| Duration::from_secs(park_s));
        if let Ok(reaped) = tokio::task::spawn_blocking(move || sessions.reap(park_after)).await {
            if !reaped.to_pause.is_empty() {
                durable::pause_expired(&state, reaped.to_pause).await;
            }
            if !reaped.to_park.is_empty() {
                durable::park_idle(&state, reaped.to_park).await;
            }
        }
        durable::sweep_parked(&state).await;
    }
}
