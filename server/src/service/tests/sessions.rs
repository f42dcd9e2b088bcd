//! Sessions: start, cell, fork, end, caps, crashes and expiry.

use std::time::Duration;

use vmm::Status;

use super::{TempDir, cell, new_session, server, server_with, sessions, until};
use crate::core::config::Config;
use crate::core::sessions::Unavailable;
use crate::service::error::Error;
use crate::service::sessions::{CreateSession, end, fork, start_fresh};
use crate::service::task::no_sink;

async fn run_cell(
    state: &crate::core::state::AppState,
    id: &str,
    code: &str,
) -> Result<crate::service::sessions::Cell, Error> {
    crate::service::sessions::cell(state, id, cell(code), "/test", no_sink()).await
}

#[tokio::test]
async fn a_started_session_is_registered_on_its_engine() {
    let (state, engine) = server(1, 1);

    let id = new_session(&state).await;

    assert!(state.sessions().get(&id).is_ok());
    assert_eq!(state.sessions().count(), 1);
    assert_eq!(engine.counts().started, 1);
}

#[tokio::test]
async fn cells_run_in_the_session_and_count_its_executions() {
    let (state, _engine) = server(1, 1);
    let id = new_session(&state).await;

    run_cell(&state, &id, "first").await.unwrap();
    let second = run_cell(&state, &id, "second").await.unwrap();

    assert_eq!(second.result.stdout, b"second");
    assert_eq!(second.execution_count, 2);
}

#[tokio::test]
async fn a_cell_asking_for_another_template_is_invalid() {
    let (state, engine) = server(1, 1);
    let id = new_session(&state).await;
    let mut req = cell("x");
    req.template = Some("other".into());

    let e = crate::service::sessions::cell(&state, &id, req, "/test", no_sink())
        .await
        .unwrap_err();

    assert_eq!(e.field(), Some("template"));
    assert_eq!(engine.counts().running, 0);
}

#[tokio::test]
async fn a_cell_in_an_unknown_session_is_no_session() {
    let (state, _engine) = server(1, 1);

    let e = run_cell(&state, "ses-nope", "x").await.unwrap_err();

    assert!(
        matches!(&e, Error::NoSession(id) if id == "ses-nope"),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_crashed_cell_ends_its_session_and_later_calls_say_crashed() {
    let (state, engine) = server(1, 1);
    let id = new_session(&state).await;

    let crashed = run_cell(&state, &id, "crash").await.unwrap();
    let after = run_cell(&state, &id, "x").await.unwrap_err();

    assert_eq!(crashed.result.status, Status::Crashed);
    let Error::SessionGone { reason, detail, .. } = after else {
        panic!("{after:?}");
    };
    assert_eq!(reason, "crashed");
    assert!(detail.unwrap().contains("console: fake: crashed"));
    assert_eq!(engine.counts().ended, 1);
}

#[tokio::test]
async fn a_cell_that_stops_within_its_grace_leaves_the_session_usable() {
    let (state, _engine) = server(1, 1);
    let id = new_session(&state).await;
    let mut hang = cell("hang");
    hang.timeout_ms = Some(10);

    let timed_out = crate::service::sessions::cell(&state, &id, hang, "/test", no_sink())
        .await
        .unwrap();
    let next = run_cell(&state, &id, "next").await.unwrap();

    assert_eq!(timed_out.result.status, Status::Timeout);
    assert_eq!(next.result.status, Status::Ok);
}

#[tokio::test]
async fn a_cell_that_does_not_stop_within_its_grace_ends_the_session_as_timeout() {
    let (state, _engine) = server(1, 1);
    let id = new_session(&state).await;
    let mut hang = cell("hang-hard");
    hang.timeout_ms = Some(10);

    crate::service::sessions::cell(&state, &id, hang, "/test", no_sink())
        .await
        .unwrap();
    let after = run_cell(&state, &id, "x").await.unwrap_err();

    assert!(
        matches!(&after, Error::SessionGone { reason, .. } if reason == "timeout"),
        "{after:?}"
    );
}

#[tokio::test]
async fn a_cell_whose_caller_goes_away_is_cancelled_and_the_session_goes_on() {
    let (state, engine) = server(1, 1);
    let id = new_session(&state).await;
    let (st, i) = (state.clone(), id.clone());
    let caller = tokio::spawn(async move {
        let mut hang = cell("hang");
        hang.timeout_ms = Some(60_000);
        crate::service::sessions::cell(&st, &i, hang, "/test", no_sink()).await
    });
    until("the cell runs", || engine.counts().running == 1).await;

    caller.abort();
    until("the cell stops", || engine.counts().running == 0).await;
    let next = run_cell(&state, &id, "next").await.unwrap();

    assert_eq!(next.result.stdout, b"next");
}

#[tokio::test]
async fn the_session_cap_refuses_one_more_with_retry_after() {
    let (state, engine) = server_with(Config {
        sessions: sessions(|s| s.max_sessions = 1),
        ..Config::default()
    });
    new_session(&state).await;

    let e = start_fresh(&state, CreateSession::default())
        .await
        .unwrap_err();

    assert!(
        matches!(e, Error::TooManySessions { limit: 1, .. }),
        "{e:?}"
    );
    assert_eq!(engine.counts().started, 1);
}

#[tokio::test]
async fn the_memory_cap_refuses_a_session_once_the_others_hold_it() {
    let (state, engine) = server_with(Config {
        sessions: sessions(|s| s.max_memory_bytes = 1000),
        ..Config::default()
    });
    engine.set_vm_bytes(1000);
    new_session(&state).await;

    let e = start_fresh(&state, CreateSession::default())
        .await
        .unwrap_err();

    assert!(
        matches!(
            e,
            Error::OutOfMemory {
                used: 1000,
                limit: 1000
            }
        ),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_start_the_engine_fails_registers_nothing() {
    let (state, engine) = server(1, 1);
    engine.fail_starts("no memory for a clone");

    let e = start_fresh(&state, CreateSession::default())
        .await
        .unwrap_err();

    assert!(matches!(e, Error::Internal { .. }), "{e:?}");
    assert!(e.to_string().contains("no memory for a clone"), "{e}");
    assert_eq!(state.sessions().count(), 0);
}

#[tokio::test]
async fn a_slow_start_holds_its_job_slot_until_it_is_done() {
    let (state, engine) = server(1, 0);
    engine.hold_starts();
    let st = state.clone();
    let starting = tokio::spawn(async move { new_session(&st).await });
    until("the start holds a job thread", || {
        state.jobs().running() == 1
    })
    .await;

    let meanwhile = super::jobs_run(&state, "x").await.unwrap_err();
    engine.release_starts();
    let id = starting.await.unwrap();

    assert!(
        matches!(meanwhile, Error::Overloaded { capacity: 1, .. }),
        "{meanwhile:?}"
    );
    assert!(state.sessions().get(&id).is_ok());
}

#[tokio::test]
async fn bad_timeouts_and_large_metadata_are_invalid_naming_the_field() {
    let (state, engine) = server(1, 1);
    let idle = CreateSession {
        idle_timeout_s: Some(0),
        ..CreateSession::default()
    };
    let life = CreateSession {
        max_lifetime_s: Some(u64::MAX),
        ..CreateSession::default()
    };
    let meta = CreateSession {
        metadata: serde_json::json!({ "x": "a".repeat(5000) }),
        ..CreateSession::default()
    };

    let idle = start_fresh(&state, idle).await.unwrap_err();
    let life = start_fresh(&state, life).await.unwrap_err();
    let meta = start_fresh(&state, meta).await.unwrap_err();

    assert_eq!(idle.field(), Some("idle_timeout_s"));
    assert_eq!(life.field(), Some("max_lifetime_s"));
    assert_eq!(meta.field(), Some("metadata"));
    assert_eq!(engine.counts().started, 0);
}

#[tokio::test]
async fn auto_pause_without_a_state_directory_is_refused() {
    let (state, _engine) = server(1, 1);
    let req = CreateSession {
        auto_pause: Some(true),
        ..CreateSession::default()
    };

    let e = start_fresh(&state, req).await.unwrap_err();

    assert!(matches!(e, Error::NoStateDir), "{e:?}");
}

#[tokio::test]
async fn a_deleted_session_is_ended_and_then_unknown() {
    let (state, engine) = server(1, 1);
    let id = new_session(&state).await;

    end(&state, &id).await.unwrap();
    let after = run_cell(&state, &id, "x").await.unwrap_err();

    assert!(matches!(after, Error::NoSession(_)), "{after:?}");
    assert_eq!(engine.counts().ended, 1);
    assert_eq!(state.sessions().count(), 0);
}

#[tokio::test]
async fn deleting_an_unknown_session_is_no_session() {
    let (state, _engine) = server(1, 1);

    let e = end(&state, "ses-nope").await.unwrap_err();

    assert!(matches!(e, Error::NoSession(_)), "{e:?}");
}

#[tokio::test]
async fn deleting_an_ended_session_removes_its_tombstone() {
    let (state, _engine) = server(1, 1);
    let id = new_session(&state).await;
    run_cell(&state, &id, "crash").await.unwrap();

    end(&state, &id).await.unwrap();
    let after = run_cell(&state, &id, "x").await.unwrap_err();

    assert!(matches!(after, Error::NoSession(_)), "{after:?}");
}

#[tokio::test]
async fn a_fork_makes_children_with_the_parent_named() {
    let (state, _engine) = server(1, 1);
    let id = new_session(&state).await;
    run_cell(&state, &id, "x").await.unwrap();

    let forked = fork(&state, &id, 2).await.unwrap();

    assert_eq!(forked.ids.len(), 2);
    assert_eq!(state.sessions().count(), 3);
    for child in &forked.ids {
        let e = state.sessions().get(child).unwrap();
        assert_eq!(e.parent.as_deref(), Some(id.as_str()));
    }
}

#[tokio::test]
async fn a_child_goes_on_from_its_parents_executions_on_its_own() {
    let (state, _engine) = server(1, 1);
    let id = new_session(&state).await;
    run_cell(&state, &id, "x").await.unwrap();
    let child = fork(&state, &id, 1).await.unwrap().ids.remove(0);

    let in_child = run_cell(&state, &child, "y").await.unwrap();
    run_cell(&state, &child, "crash").await.unwrap();
    let in_parent = run_cell(&state, &id, "z").await.unwrap();

    assert_eq!(in_child.execution_count, 2);
    assert_eq!(in_parent.execution_count, 2);
}

#[tokio::test]
async fn a_fork_count_out_of_range_is_invalid() {
    let (state, _engine) = server(1, 1);
    let id = new_session(&state).await;
    let max = state.config().sessions.max_fork_count;

    let zero = fork(&state, &id, 0).await.unwrap_err();
    let over = fork(&state, &id, max + 1).await.unwrap_err();

    assert_eq!(zero.field(), Some("count"));
    assert_eq!(over.field(), Some("count"));
    assert_eq!(state.sessions().count(), 1);
}

#[tokio::test]
async fn a_fork_past_the_session_cap_is_refused_whole() {
    let (state, _engine) = server_with(Config {
        sessions: sessions(|s| s.max_sessions = 2),
        ..Config::default()
    });
    let id = new_session(&state).await;

    let e = fork(&state, &id, 2).await.unwrap_err();

    assert!(
        matches!(e, Error::TooManySessions { limit: 2, .. }),
        "{e:?}"
    );
    assert_eq!(state.sessions().count(), 1);
}

#[tokio::test]
async fn a_session_past_its_lifetime_is_reaped_and_then_gone_with_why() {
    let (state, engine) = server(1, 1);
    let id = new_session(&state).await;
    state
        .sessions()
        .get(&id)
        .unwrap()
        .set_lifetime(Duration::ZERO);

    let to_pause = state.sessions().reap(None).to_pause;
    let after = run_cell(&state, &id, "x").await.unwrap_err();

    assert!(to_pause.is_empty());
    assert!(
        matches!(&after, Error::SessionGone { reason, .. } if reason == "max_lifetime"),
        "{after:?}"
    );
    assert_eq!(engine.counts().ended, 1);
}

#[tokio::test]
async fn a_session_in_use_is_not_reaped() {
    let (state, engine) = server(1, 1);
    let id = new_session(&state).await;
    let (st, i) = (state.clone(), id.clone());
    let running = tokio::spawn(async move { run_cell(&st, &i, "wait g").await });
    until("the cell runs", || engine.counts().running == 1).await;
    state
        .sessions()
        .get(&id)
        .unwrap()
        .set_lifetime(Duration::ZERO);

    state.sessions().reap(None);
    let live_while_busy = state.sessions().get(&id).is_ok();
    engine.open("g");
    running.await.unwrap().unwrap();
    state.sessions().reap(None);

    assert!(live_while_busy);
    assert_eq!(
        state.sessions().get(&id).unwrap_err(),
        Unavailable::Gone(crate::core::sessions::Ended {
            reason: "max_lifetime".into(),
            detail: None
        })
    );
}

#[tokio::test]
async fn idle_sessions_are_handed_back_to_park_but_not_busy_or_expired_ones() {
    let (state, engine) = server(2, 2);
    let idle = new_session(&state).await;
    let busy = new_session(&state).await;
    let expired = new_session(&state).await;
    let (st, i) = (state.clone(), busy.clone());
    let running = tokio::spawn(async move { run_cell(&st, &i, "wait p").await });
    until("the cell runs", || engine.counts().running == 1).await;
    state
        .sessions()
        .get(&expired)
        .unwrap()
        .set_lifetime(Duration::ZERO);

    let never = state.sessions().reap(None);
    let reaped = state.sessions().reap(Some(Duration::ZERO));
    engine.open("p");
    running.await.unwrap().unwrap();

    assert_eq!(never.to_park, Vec::<String>::new());
    assert_eq!(reaped.to_park, [idle.as_str()]);
    assert_eq!(reaped.to_pause, Vec::<String>::new());
    assert!(matches!(
        state.sessions().get(&expired),
        Err(Unavailable::Gone(_))
    ));
}

#[tokio::test]
async fn a_shutdown_ends_every_session_as_shutdown() {
    let (state, engine) = server(1, 1);
    let a = new_session(&state).await;
    new_session(&state).await;

    state.sessions().end_all();
    let after = run_cell(&state, &a, "x").await.unwrap_err();

    assert!(
        matches!(&after, Error::SessionGone { reason, .. } if reason == "shutdown"),
        "{after:?}"
    );
    assert_eq!(engine.counts().ended, 2);
}

#[tokio::test]
async fn a_session_that_asked_to_pause_is_handed_back_by_the_reaper_not_ended() {
    let dir = TempDir::new("auto-pause");
    let (state, engine) = server_with(Config {
        state_dir: Some(dir.0.clone()),
        ..Config::default()
    });
    let req = CreateSession {
        auto_pause: Some(true),
        ..CreateSession::default()
    };
    let id = start_fresh(&state, req).await.unwrap().id.clone();
    let plain = new_session(&state).await;
    for s in [&id, &plain] {
        state
            .sessions()
            .get(s)
            .unwrap()
            .set_lifetime(Duration::ZERO);
    }

    let to_pause = state.sessions().reap(None).to_pause;

    assert_eq!(to_pause, [id.as_str()]);
    assert!(state.sessions().get(&id).is_ok());
    assert!(matches!(
        state.sessions().get(&plain),
        Err(Unavailable::Gone(_))
    ));
    assert_eq!(engine.counts().ended, 1);
}
