//! A template's runtimes by name and alias, and its kernel runtime (JavaScript in the node
//! template): one-shot jobs and batches run in it; session cells and code contexts refuse it
//! (not built yet), saying where JavaScript runs.

use std::sync::Arc;

use vmm::{Language, Status};

use super::{job, new_session};
use crate::core::config::Config;
use crate::core::engine::fake::FakeEngine;
use crate::core::state::{AppState, TemplateInfo};
use crate::service::error::Error;
use crate::service::jobs::{OneShot, batch, run};
use crate::service::sessions::{CreateSession, start_fresh};
use crate::service::task::no_sink;

/// What a cell or context in JavaScript is told.
const NOT_BUILT: &str = "JavaScript cells and contexts are not built yet: run JavaScript as one-shot jobs (POST /v1/exec with language \"javascript\")";

/// A server with templates `python` (the default: python and shell) and `node`
/// (javascript, its default, then python and shell), each on a fake engine of its own.
fn two_templates() -> (AppState, FakeEngine, FakeEngine) {
    let config = Config {
        templates: vec!["python".into(), "node".into()],
        ..Config::default()
    };
    let state = AppState::new(config, None).expect("a state");
    let (python, node) = (FakeEngine::new(), FakeEngine::with_node());
    assert!(state.set_engine("python", Arc::new(python.clone()), TemplateInfo::default()));
    assert!(state.set_engine("node", Arc::new(node.clone()), TemplateInfo::default()));
    (state, python, node)
}

/// One-shot job `code` in runtime `runtime` of `template` (None: the default).
fn job_in(template: Option<&str>, runtime: &str, code: &str) -> OneShot {
    let mut j = job(code);
    j.template = template.map(str::to_owned);
    j.runtime = Some(runtime.to_owned());
    j
}

/// `e` is a 400 on `field` saying `message`.
fn assert_invalid(e: &Error, field: &str, message: &str) {
    assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
    assert_eq!(e.field(), Some(field), "{e:?}");
    assert_eq!(e.to_string(), message);
}

/// A session of `template`.
async fn session_of(state: &AppState, template: &str) -> String {
    let req = CreateSession {
        template: Some(template.into()),
        ..CreateSession::default()
    };
    start_fresh(state, req).await.expect("a session").id.clone()
}

#[tokio::test]
async fn a_javascript_job_runs_in_the_kernel_runtime_by_its_name_or_an_alias() {
    let (state, python, node) = two_templates();

    for name in ["javascript", "js", "node"] {
        let ran = run(
            &state,
            job_in(Some("node"), name, "console.log(1)"),
            no_sink(),
        )
        .await
        .unwrap();
        assert_eq!(ran.result.status, Status::Ok, "{name}");
        assert_eq!(ran.result.stdout, b"console.log(1)", "{name}");
    }
    let shell = run(&state, job_in(Some("node"), "shell", "echo"), no_sink())
        .await
        .unwrap();
    let mut default = job("console.log(2)");
    default.template = Some("node".into());
    run(&state, default, no_sink()).await.unwrap();

    assert_eq!(shell.result.status, Status::Ok);
    assert_eq!(
        node.languages(),
        [
            Language::Kernel,
            Language::Kernel,
            Language::Kernel,
            Language::Shell,
            Language::Kernel
        ]
    );
    assert_eq!(python.counts().jobs, 0);
}

#[tokio::test]
async fn a_javascript_job_on_a_template_without_it_is_400_naming_its_runtimes() {
    let (state, python, node) = two_templates();

    let on_python = run(&state, job_in(None, "js", "x"), no_sink())
        .await
        .unwrap_err();
    let unknown_on_node = run(&state, job_in(Some("node"), "ruby", "x"), no_sink())
        .await
        .unwrap_err();

    assert_invalid(
        &on_python,
        "language",
        "template fake has no runtime \"js\"; its runtimes: python, shell",
    );
    assert_invalid(
        &unknown_on_node,
        "language",
        "template fake-node has no runtime \"ruby\"; its runtimes: javascript (js, node), python, shell",
    );
    assert_eq!((python.counts().jobs, node.counts().jobs), (0, 0));
}

#[tokio::test]
async fn a_batch_resolves_each_jobs_runtime_on_its_own_template() {
    let (state, python, node) = two_templates();

    let ran = batch(
        &state,
        vec![
            job_in(Some("node"), "node", "a"),
            job_in(None, "python", "b"),
        ],
    )
    .await
    .unwrap();
    let refused = batch(
        &state,
        vec![
            job_in(Some("node"), "js", "a"),
            job_in(None, "javascript", "b"),
        ],
    )
    .await
    .unwrap_err();

    assert_eq!(ran.len(), 2);
    assert_eq!(node.languages(), [Language::Kernel]);
    assert_eq!(python.languages(), [Language::Python]);
    assert_invalid(
        &refused,
        "jobs[1].language",
        "template fake has no runtime \"javascript\"; its runtimes: python, shell",
    );
}

#[tokio::test]
async fn a_session_in_javascript_is_400_and_none_starts() {
    let (state, _python, node) = two_templates();
    let req = CreateSession {
        template: Some("node".into()),
        language: Some("js".into()),
        ..CreateSession::default()
    };

    let e = start_fresh(&state, req).await.unwrap_err();

    assert_invalid(&e, "language", NOT_BUILT);
    assert_eq!(node.counts().started, 0);
    assert_eq!(state.sessions().count(), 0);
}

#[tokio::test]
async fn a_cell_in_javascript_is_400_and_a_node_session_runs_python_cells_by_default() {
    let (state, _python, node) = two_templates();
    let id = session_of(&state, "node").await;
    let cell = |language: Option<&str>| crate::service::jobs::ExecRequest {
        language: language.map(str::to_owned),
        ..super::cell("x")
    };

    let js = crate::service::sessions::cell(&state, &id, cell(Some("node")), "/test", no_sink())
        .await
        .unwrap_err();
    let default = crate::service::sessions::cell(&state, &id, cell(None), "/test", no_sink())
        .await
        .unwrap();

    assert_invalid(&js, "language", NOT_BUILT);
    assert_eq!(default.result.status, Status::Ok);
    assert_eq!(default.execution_count, 1);
    assert_eq!(node.languages(), [Language::Python]);
}

#[tokio::test]
async fn a_javascript_or_typescript_context_is_400_on_any_template() {
    let (state, _python, _node) = two_templates();
    let on_python = new_session(&state).await;
    let on_node = session_of(&state, "node").await;
    let create = |id: &str, language: &str| {
        crate::service::contexts::create(&state, id, Some(language), None, "/tmp").unwrap_err()
    };

    for language in ["js", "javascript", "node"] {
        assert_invalid(&create(&on_python, language), "language", NOT_BUILT);
        assert_invalid(&create(&on_node, language), "language", NOT_BUILT);
    }
    for language in ["ts", "typescript"] {
        assert_invalid(
            &create(&on_node, language),
            "language",
            &format!("bud runs no TypeScript; {NOT_BUILT}"),
        );
    }
    let python = crate::service::contexts::create(&state, &on_node, Some("python"), None, "/tmp");
    assert_eq!(python.expect("a python context").language, "python");
    assert_eq!(
        crate::service::contexts::list(&state, &on_node)
            .unwrap()
            .len(),
        1
    );
}
