//! One-shot jobs and batches: answers, refusals, queueing and cancel.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm::Status;

use super::{job, job_with_timeout, server, server_with, until};
use crate::core::config::{Config, Limits};
use crate::service::error::Error;
use crate::service::jobs::{batch, run};
use crate::service::task::{Sink, no_sink};

#[tokio::test]
async fn a_job_answers_with_its_output() {
    let (state, engine) = server(1, 1);

    let ran = run(&state, job("print(1)"), no_sink()).await.unwrap();

    assert_eq!(ran.result.status, Status::Ok);
    assert_eq!(ran.result.stdout, b"print(1)");
    assert_eq!(engine.counts().jobs, 1);
}

#[tokio::test]
async fn a_jobs_output_goes_to_its_sink_as_it_comes() {
    let (state, _engine) = server(1, 1);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let sink: Sink = Box::new(move |_, b| s.lock().unwrap().extend_from_slice(b));

    run(&state, job("streamed"), sink).await.unwrap();

    assert_eq!(*seen.lock().unwrap(), b"streamed");
}

#[tokio::test]
async fn a_job_that_exits_nonzero_is_an_error_result_with_its_code() {
    let (state, _engine) = server(1, 1);

    let ran = run(&state, job("exit 3"), no_sink()).await.unwrap();

    assert_eq!(ran.result.status, Status::Error);
    assert_eq!(ran.result.exit_code, Some(3));
}

#[tokio::test]
async fn a_crashed_guest_is_a_crashed_result_not_a_refusal() {
    let (state, _engine) = server(1, 1);

    let ran = run(&state, job("crash"), no_sink()).await.unwrap();

    assert_eq!(ran.result.status, Status::Crashed);
    assert_eq!(ran.result.crash.as_deref(), Some("the fake guest crashed"));
}

#[tokio::test]
async fn a_job_past_its_timeout_ends_as_timeout() {
    let (state, _engine) = server(1, 1);

    let ran = run(
        &state,
        job_with_timeout("hang", Duration::from_millis(20)),
        no_sink(),
    )
    .await
    .unwrap();

    assert_eq!(ran.result.status, Status::Timeout);
}

#[tokio::test]
async fn an_unknown_template_is_refused_naming_the_served_ones() {
    let (state, engine) = server(1, 1);
    let mut j = job("x");
    j.template = Some("nope".into());

    let e = run(&state, j, no_sink()).await.unwrap_err();

    let Error::UnknownTemplate { name, served, .. } = e else {
        panic!("{e:?}");
    };
    assert_eq!(name, "nope");
    assert_eq!(served, state.config().templates);
    assert_eq!(engine.counts().jobs, 0);
}

#[tokio::test]
async fn a_template_still_building_is_not_ready_with_retry_after() {
    let state = crate::core::state::AppState::new(Config::default(), None).unwrap();

    let e = run(&state, job("x"), no_sink()).await.unwrap_err();

    assert!(
        matches!(&e, Error::NotReady { retry_after, .. } if *retry_after == state.config().retry_after()),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_template_that_failed_says_why() {
    let state = crate::core::state::AppState::new(Config::default(), None).unwrap();
    let name = state.config().default_template().to_owned();
    state.template_failed(&name, "no kernel".into());

    let e = run(&state, job("x"), no_sink()).await.unwrap_err();

    assert!(
        matches!(&e, Error::TemplateFailed { why, .. } if why == "no kernel"),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_full_server_refuses_at_once_with_its_capacity() {
    let (state, engine) = server(1, 0);
    let st = state.clone();
    let held = tokio::spawn(async move { run(&st, job("wait g"), no_sink()).await });
    until("the first job runs", || engine.counts().running == 1).await;

    let refused = run(&state, job("x"), no_sink()).await.unwrap_err();
    engine.open("g");
    let first = held.await.unwrap().unwrap();

    assert!(
        matches!(refused, Error::Overloaded { capacity: 1, .. }),
        "{refused:?}"
    );
    assert_eq!(first.result.status, Status::Ok);
}

#[tokio::test]
async fn a_job_queued_behind_a_busy_thread_runs_when_it_frees() {
    let (state, engine) = server(1, 1);
    let st = state.clone();
    let first = tokio::spawn(async move { run(&st, job("wait g"), no_sink()).await });
    until("the first job runs", || engine.counts().running == 1).await;
    let st = state.clone();
    let second = tokio::spawn(async move { run(&st, job("second"), no_sink()).await });
    until("the second job queues", || state.jobs().queued() == 1).await;
    let jobs_while_held = engine.counts().jobs;

    engine.open("g");
    let second = second.await.unwrap().unwrap();
    first.await.unwrap().unwrap();

    // A job thread answers before it counts itself free.
    until("both slots come back", || {
        state.jobs().queued() + state.jobs().running() == 0
    })
    .await;

    assert_eq!(jobs_while_held, 1);
    assert_eq!(second.result.stdout, b"second");
}

#[tokio::test]
async fn a_caller_that_goes_away_cancels_its_running_job_and_frees_its_slot() {
    let (state, engine) = server(1, 0);
    let st = state.clone();
    let caller = tokio::spawn(async move {
        run(
            &st,
            job_with_timeout("hang", Duration::from_secs(600)),
            no_sink(),
        )
        .await
    });
    until("the job runs", || engine.counts().running == 1).await;

    caller.abort();
    until("the job ends", || engine.counts().running == 0).await;
    until("its slot is back", || state.jobs().running() == 0).await;
    let next = run(&state, job("next"), no_sink()).await.unwrap();

    assert_eq!(next.result.status, Status::Ok);
}

#[tokio::test]
async fn a_key_past_its_quota_is_refused_while_another_key_runs() {
    let (state, engine) = server_with(Config {
        workers: 1,
        queue: 3,
        key_max_jobs: Some(1),
        limits: Limits {
            max_batch_jobs: 1,
            ..Limits::default()
        },
        ..Config::default()
    });
    let key = |k: &str| Some(k.to_owned());
    let st = state.clone();
    let alice = tokio::spawn(crate::core::audit::KEY.scope(key("alice"), async move {
        run(&st, job("wait g"), no_sink()).await
    }));
    until("alice's job runs", || engine.counts().running == 1).await;

    let again = crate::core::audit::KEY
        .scope(key("alice"), run(&state, job("x"), no_sink()))
        .await
        .unwrap_err();
    let st = state.clone();
    let bob = tokio::spawn(crate::core::audit::KEY.scope(key("bob"), async move {
        run(&st, job("bob"), no_sink()).await
    }));
    until("bob's job queues", || state.jobs().queued() == 1).await;
    engine.open("g");

    assert!(
        matches!(&again, Error::KeyQuota { key, quota: 1, .. } if key == "alice"),
        "{again:?}"
    );
    assert_eq!(bob.await.unwrap().unwrap().result.stdout, b"bob");
    alice.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_server_over_its_memory_budget_refuses_jobs() {
    let (state, engine) = server_with(Config {
        memory_budget_bytes: Some(1),
        ..Config::default()
    });

    let e = run(&state, job("x"), no_sink()).await.unwrap_err();

    assert!(matches!(e, Error::MemoryBudget { budget: 1, .. }), "{e:?}");
    assert_eq!(engine.counts().jobs, 0);
}

#[tokio::test]
async fn closed_job_threads_refuse_as_shutting_down() {
    let (state, _engine) = server(1, 1);
    state.jobs().close();

    let e = run(&state, job("x"), no_sink()).await.unwrap_err();

    assert!(matches!(e, Error::ShuttingDown), "{e:?}");
}

#[tokio::test]
async fn a_batch_answers_every_job_in_order() {
    let (state, _engine) = server(2, 2);

    let ran = batch(&state, vec![job("a"), job("exit 2"), job("c")])
        .await
        .unwrap();

    let outs: Vec<_> = ran.iter().map(|r| r.result.stdout.clone()).collect();
    assert_eq!(outs, [b"a".to_vec(), Vec::new(), b"c".to_vec()]);
    assert_eq!(ran[1].result.exit_code, Some(2));
}

#[tokio::test]
async fn a_batch_larger_than_the_free_slots_is_refused_whole() {
    let (state, engine) = server(1, 2);
    let st = state.clone();
    let held = tokio::spawn(async move { run(&st, job("wait g"), no_sink()).await });
    until("a job holds a slot", || engine.counts().running == 1).await;

    let e = batch(&state, vec![job("a"), job("b"), job("c")])
        .await
        .unwrap_err();
    engine.open("g");
    held.await.unwrap().unwrap();

    assert!(matches!(e, Error::Overloaded { capacity: 3, .. }), "{e:?}");
    assert_eq!(engine.counts().jobs, 1);
}

#[tokio::test]
async fn an_empty_batch_is_invalid() {
    let (state, _engine) = server(1, 1);

    let e = batch(&state, Vec::new()).await.unwrap_err();

    assert_eq!(e.field(), Some("jobs"));
    assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
}

#[tokio::test]
async fn a_batch_over_its_cap_is_too_many() {
    let (state, _engine) = server_with(Config {
        limits: Limits {
            max_batch_jobs: 2,
            ..Limits::default()
        },
        ..Config::default()
    });

    let e = batch(&state, vec![job("a"), job("b"), job("c")])
        .await
        .unwrap_err();

    assert!(
        matches!(
            e,
            Error::TooMany {
                count: 3,
                limit: 2,
                ..
            }
        ),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_batch_job_on_an_unknown_template_names_its_place() {
    let (state, engine) = server(2, 2);
    let mut bad = job("b");
    bad.template = Some("nope".into());

    let e = batch(&state, vec![job("a"), bad]).await.unwrap_err();

    assert_eq!(e.field(), Some("jobs[1].template"));
    assert_eq!(engine.counts().jobs, 0);
}
