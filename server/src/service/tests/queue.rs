//! One request at a time in a session: the next ones wait their turn, at most
//! `--session-max-waiting` of them (409 past that), and a waiter that goes away leaves.

use super::{cell, new_session, server_with, sessions, until};
use crate::core::config::Config;
use crate::core::state::AppState;
use crate::service::access::acquire;
use crate::service::error::Error;
use crate::service::sessions::Cell;
use crate::service::task::no_sink;

fn server(max_waiting: usize) -> (AppState, crate::core::engine::fake::FakeEngine) {
    server_with(Config {
        workers: 2,
        queue: 4,
        sessions: sessions(|s| s.max_waiting = max_waiting),
        limits: crate::core::config::Limits {
            max_batch_jobs: 6,
            ..crate::core::config::Limits::default()
        },
        ..Config::default()
    })
}

fn spawn_cell(
    state: &AppState,
    id: &str,
    code: &str,
) -> tokio::task::JoinHandle<Result<Cell, Error>> {
    let (st, id, req) = (state.clone(), id.to_owned(), cell(code));
    tokio::spawn(
        async move { crate::service::sessions::cell(&st, &id, req, "/test", no_sink()).await },
    )
}

fn waiting(state: &AppState, id: &str) -> usize {
    state.sessions().get(id).map_or(0, |e| e.waiting())
}

#[tokio::test]
async fn a_cell_waits_for_the_one_running_then_runs() {
    let (state, engine) = server(2);
    let id = new_session(&state).await;
    let first = spawn_cell(&state, &id, "wait g");
    until("the first cell runs", || engine.counts().running == 1).await;
    let second = spawn_cell(&state, &id, "second");
    until("the second cell waits", || waiting(&state, &id) == 1).await;
    let ran_while_held = engine.counts().running;

    engine.open("g");
    let second = second.await.unwrap().unwrap();
    let first = first.await.unwrap().unwrap();

    assert_eq!(ran_while_held, 1);
    assert_eq!(first.execution_count, 1);
    assert_eq!(second.execution_count, 2);
}

#[tokio::test]
async fn past_the_waiting_cap_a_request_is_session_busy() {
    let (state, engine) = server(1);
    let id = new_session(&state).await;
    let first = spawn_cell(&state, &id, "wait g");
    until("the first cell runs", || engine.counts().running == 1).await;
    let second = spawn_cell(&state, &id, "second");
    until("the second cell waits", || waiting(&state, &id) == 1).await;

    let third = crate::service::sessions::cell(&state, &id, cell("third"), "/test", no_sink())
        .await
        .unwrap_err();
    engine.open("g");

    assert!(
        matches!(&third, Error::SessionBusy(s) if *s == id),
        "{third:?}"
    );
    assert!(second.await.unwrap().is_ok());
    assert!(first.await.unwrap().is_ok());
}

#[tokio::test]
async fn a_waiter_that_goes_away_leaves_the_queue() {
    let (state, engine) = server(1);
    let id = new_session(&state).await;
    let first = spawn_cell(&state, &id, "wait g");
    until("the first cell runs", || engine.counts().running == 1).await;
    let second = spawn_cell(&state, &id, "second");
    until("the second cell waits", || waiting(&state, &id) == 1).await;

    second.abort();
    until("the waiter left", || waiting(&state, &id) == 0).await;
    let third = spawn_cell(&state, &id, "third");
    until("the third cell waits", || waiting(&state, &id) == 1).await;
    engine.open("g");

    assert_eq!(third.await.unwrap().unwrap().result.stdout, b"third");
    assert!(first.await.unwrap().is_ok());
}

#[tokio::test]
async fn waiters_learn_that_the_session_ended_under_them() {
    let (state, engine) = server(2);
    let id = new_session(&state).await;
    let first = spawn_cell(&state, &id, "wait g");
    until("the first cell runs", || engine.counts().running == 1).await;
    let second = spawn_cell(&state, &id, "second");
    until("the second cell waits", || waiting(&state, &id) == 1).await;

    // Off the runtime, as every end is: it waits for the running cell to let go of the VM.
    let (sessions, i) = (state.sessions().clone(), id.clone());
    let ending = tokio::task::spawn_blocking(move || {
        let why = crate::core::sessions::Ended {
            reason: "shutdown".into(),
            detail: None,
        };
        sessions.end(&i, why);
    });
    let second = second.await.unwrap().unwrap_err();
    engine.open("g");
    let first = first.await.unwrap().unwrap();
    ending.await.unwrap();

    assert!(
        matches!(&second, Error::SessionGone { reason, .. } if reason == "shutdown"),
        "{second:?}"
    );
    assert_eq!(first.result.stdout, b"wait g");
    assert_eq!(engine.counts().ended, 1);
}

#[tokio::test]
async fn a_held_session_is_taken_after_it_is_freed() {
    let (state, _engine) = server(1);
    let id = new_session(&state).await;
    let held = acquire(&state, &id).await.unwrap();
    let (st, i) = (state.clone(), id.clone());
    let next = tokio::spawn(async move { acquire(&st, &i).await.map(|b| b.entry().id.clone()) });
    until("the next request waits", || waiting(&state, &id) == 1).await;

    drop(held);

    assert_eq!(next.await.unwrap().unwrap(), id);
}

#[tokio::test]
async fn a_fork_waits_for_the_cell_running_in_its_session() {
    let (state, engine) = server(2);
    let id = new_session(&state).await;
    let running = spawn_cell(&state, &id, "wait g");
    until("the cell runs", || engine.counts().running == 1).await;
    let (st, i) = (state.clone(), id.clone());
    let forking = tokio::spawn(async move { crate::service::sessions::fork(&st, &i, 1).await });
    until("the fork waits", || waiting(&state, &id) == 1).await;
    let count_while_held = state.sessions().count();

    engine.open("g");
    let forked = forking.await.unwrap().unwrap();
    running.await.unwrap().unwrap();

    assert_eq!(count_while_held, 1);
    assert_eq!(forked.ids.len(), 1);
    assert_eq!(state.sessions().count(), 2);
}
