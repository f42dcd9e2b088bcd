//! Draining the node: new work refused, running work waited for, sessions left ended.

use std::time::Duration;

use super::{job, jobs_run, new_session, server, until};
use crate::service::drain::{DrainRequest, drain, undrain};
use crate::service::error::Error;
use crate::service::sessions::{CreateSession, fork, start_fresh};

fn request(deadline_s: u64) -> DrainRequest {
    DrainRequest {
        deadline_s: Some(deadline_s),
        ..DrainRequest::default()
    }
}

#[tokio::test]
async fn a_draining_node_refuses_new_jobs_sessions_and_forks() {
    let (state, engine) = server(1, 1);
    let id = new_session(&state).await;
    state.node().set_draining(true);

    let job = jobs_run(&state, "x").await.unwrap_err();
    let session = start_fresh(&state, CreateSession::default())
        .await
        .unwrap_err();
    let forked = fork(&state, &id, 1).await.unwrap_err();

    for e in [&job, &session, &forked] {
        assert!(matches!(e, Error::Draining { .. }), "{e:?}");
    }
    assert_eq!(engine.counts().jobs, 0);
    assert_eq!(engine.counts().started, 1);
}

#[tokio::test]
async fn a_draining_node_still_runs_cells_of_its_sessions() {
    let (state, _engine) = server(1, 1);
    let id = new_session(&state).await;
    state.node().set_draining(true);

    let ran = crate::service::sessions::cell(
        &state,
        &id,
        super::cell("still"),
        "/test",
        crate::service::task::no_sink(),
    )
    .await
    .unwrap();

    assert_eq!(ran.result.stdout, b"still");
}

#[tokio::test]
async fn an_undrained_node_takes_work_again() {
    let (state, _engine) = server(1, 1);
    state.node().set_draining(true);

    undrain(&state);
    let ran = jobs_run(&state, "again").await.unwrap();

    assert_eq!(ran.result.stdout, b"again");
}

#[tokio::test]
async fn an_idle_node_drains_at_once_with_nothing_to_report() {
    let (state, _engine) = server(1, 1);

    let report = drain(&state, request(5), None).await.unwrap();

    assert!(report.jobs_finished);
    assert!(report.ended.is_empty() && report.failed.is_empty());
    assert!(state.node().draining());
}

#[tokio::test]
async fn a_drain_ends_the_sessions_left_at_its_deadline_as_drained() {
    let (state, engine) = server(1, 1);
    let id = new_session(&state).await;

    let report = drain(&state, request(1), None).await.unwrap();
    let after = state.sessions().get(&id).unwrap_err();

    assert_eq!(report.ended, [id]);
    assert!(
        matches!(&after, crate::core::sessions::Unavailable::Gone(e) if e.reason == "drained"),
        "{after:?}"
    );
    assert_eq!(engine.counts().ended, 1);
}

#[tokio::test]
async fn a_drain_waits_for_the_running_job_it_finds() {
    let (state, engine) = server(1, 1);
    let st = state.clone();
    let running = tokio::spawn(async move {
        crate::service::jobs::run(&st, job("wait g"), crate::service::task::no_sink()).await
    });
    until("the job runs", || engine.counts().running == 1).await;
    let st = state.clone();
    let draining = tokio::spawn(async move { drain(&st, request(30), None).await });
    until("the node drains", || state.node().draining()).await;

    engine.open("g");
    let report = draining.await.unwrap().unwrap();

    assert!(report.jobs_finished);
    assert_eq!(running.await.unwrap().unwrap().result.stdout, b"wait g");
}

#[tokio::test]
async fn a_drain_past_its_deadline_says_the_jobs_did_not_finish() {
    let (state, engine) = server(1, 1);
    let st = state.clone();
    let running = tokio::spawn(async move {
        crate::service::jobs::run(
            &st,
            super::job_with_timeout("hang", Duration::from_secs(600)),
            crate::service::task::no_sink(),
        )
        .await
    });
    until("the job runs", || engine.counts().running == 1).await;

    let report = drain(&state, request(1), None).await.unwrap();
    running.abort();

    assert!(!report.jobs_finished);
}

#[tokio::test]
async fn a_drain_that_pauses_or_hands_over_needs_a_state_directory() {
    let (state, _engine) = server(1, 1);
    let pause = DrainRequest {
        pause: true,
        ..request(1)
    };
    let to = DrainRequest {
        to: Some("http://127.0.0.1:1".into()),
        ..request(1)
    };

    let pause = drain(&state, pause, None).await.unwrap_err();
    let to = drain(&state, to, None).await.unwrap_err();

    assert!(matches!(pause, Error::NoStateDir), "{pause:?}");
    assert!(matches!(to, Error::NoStateDir), "{to:?}");
    assert!(!state.node().draining());
}

#[tokio::test]
async fn a_drain_deadline_out_of_range_is_invalid() {
    let (state, _engine) = server(1, 1);

    let e = drain(&state, request(0), None).await.unwrap_err();

    assert_eq!(e.field(), Some("deadline_s"));
    assert!(!state.node().draining());
}
