//! Program runtimes (a user template's `runtimes`: an interpreter of the image on a file of
//! code): jobs, batches, sessions and cells name them by name or alias and reach the worker
//! as [`Language::Program`] with the runtime's number; a code context in one is refused,
//! saying where its code runs.

use std::sync::Arc;

use vmm::{Language, Status};

use super::job;
use crate::core::config::Config;
use crate::core::engine::fake::FakeEngine;
use crate::core::state::{AppState, TemplateInfo};
use crate::service::error::Error;
use crate::service::jobs::{OneShot, batch, run};
use crate::service::sessions::{CreateSession, start_fresh};
use crate::service::task::no_sink;

/// A server whose one template, `langs`, has python, shell, lua (program 0) and awk
/// (program 1).
fn programs() -> (AppState, FakeEngine) {
    let config = Config {
        templates: vec!["langs".into()],
        ..Config::default()
    };
    let state = AppState::new(config, None).expect("a state");
    let engine = FakeEngine::with_programs();
    assert!(state.set_engine("langs", Arc::new(engine.clone()), TemplateInfo::default()));
    (state, engine)
}

fn job_in(runtime: &str, code: &str) -> OneShot {
    let mut j = job(code);
    j.runtime = Some(runtime.to_owned());
    j
}

#[tokio::test]
async fn a_program_runtimes_jobs_and_batches_go_to_the_worker_with_its_number() {
    let (state, engine) = programs();

    for name in ["lua", "lua5.4", "awk"] {
        let ran = run(&state, job_in(name, "print(1)"), no_sink())
            .await
            .unwrap();
        assert_eq!(ran.result.status, Status::Ok, "{name}");
    }
    let ran = batch(&state, vec![job_in("awk", "a"), job_in("awk", "b")])
        .await
        .unwrap();
    let unknown = run(&state, job_in("ruby", "x"), no_sink())
        .await
        .unwrap_err();

    assert_eq!(ran.len(), 2);
    assert_eq!(engine.languages(), [Language::Program; 5]);
    assert_eq!(engine.dialects(), [0, 0, 1, 1, 1]);
    assert!(matches!(unknown, Error::Invalid { .. }), "{unknown:?}");
    assert_eq!(
        unknown.to_string(),
        "template fake-programs has no runtime \"ruby\"; its runtimes: python, shell, lua (lua5.4), awk"
    );
}

#[tokio::test]
async fn a_session_in_a_program_runtime_runs_its_cells_there_unless_one_names_another() {
    let (state, engine) = programs();
    let req = CreateSession {
        language: Some("lua5.4".into()),
        ..CreateSession::default()
    };
    let session = start_fresh(&state, req).await.expect("a session");
    let id = session.id.clone();

    for language in [None, Some("python"), Some("awk"), None] {
        let req = crate::service::jobs::ExecRequest {
            language: language.map(str::to_owned),
            ..super::cell("x")
        };
        let ran = crate::service::sessions::cell(&state, &id, req, "/test", no_sink())
            .await
            .expect("the cell ran");
        assert_eq!(ran.result.status, Status::Ok, "{language:?}");
    }

    assert_eq!((session.language, session.dialect), (Language::Program, 0));
    assert_eq!(
        engine.languages(),
        [
            Language::Program,
            Language::Python,
            Language::Program,
            Language::Program
        ]
    );
    assert_eq!(engine.dialects(), [0, 0, 1, 0]);
}

#[tokio::test]
async fn a_code_context_in_a_program_runtime_is_400_saying_where_its_code_runs() {
    let (state, engine) = programs();
    let id = start_fresh(&state, CreateSession::default())
        .await
        .expect("a session")
        .id
        .clone();

    let err =
        crate::service::contexts::create(&state, &id, Some("lua5.4"), None, "/tmp").unwrap_err();

    assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
    assert_eq!(err.field(), Some("language"));
    assert_eq!(
        err.to_string(),
        "lua runs a process per cell and keeps no state for a context to hold: run its code as \
         jobs or as a session's cells (`language`: \"lua\")"
    );
    assert_eq!(engine.counts().jobs, 0);
}
