//! A template's runtimes by name and alias, and its kernel runtime (JavaScript in the node
//! template): one-shot jobs, batches and session cells run in it; its code contexts are
//! namespaces of the session's kernel, each its own; TypeScript is the kernel's dialect 1
//! in jobs, cells and contexts alike; TypeScript and JavaScript on a template without them
//! are refused, naming what runs.

use std::sync::Arc;

use vmm::{CellOptions, Language, Status};

use super::{job, new_session};
use crate::core::config::Config;
use crate::core::engine::fake::FakeEngine;
use crate::core::state::{AppState, TemplateInfo};
use crate::service::error::Error;
use crate::service::jobs::{OneShot, batch, run};
use crate::service::sessions::{CreateSession, start_fresh};
use crate::service::task::no_sink;

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
        "template fake-node has no runtime \"ruby\"; its runtimes: javascript (js, node), python, shell, typescript (ts)",
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

/// A session cell's options as the fake engine records them: `namespace`, entering
/// `directory` before its first cell, its error in the display data.
fn opts(namespace: u32, directory: Option<&str>, error_in_display: bool) -> CellOptions {
    CellOptions {
        namespace,
        reset: false,
        directory: directory.map(str::to_owned),
        error_in_display,
    }
}

/// Runs cell `code` in session `id`, in runtime `language` (None: the session's).
async fn cell_in(state: &AppState, id: &str, language: Option<&str>, code: &str) -> Status {
    let req = crate::service::jobs::ExecRequest {
        language: language.map(str::to_owned),
        ..super::cell(code)
    };
    let ran = crate::service::sessions::cell(state, id, req, "/test", no_sink()).await;
    ran.expect("the cell ran").result.status
}

/// A cell `code` for a context, with the default limits.
fn context_cell(code: &str) -> crate::service::contexts::Cell {
    crate::service::contexts::Cell {
        code: code.to_owned(),
        env: Default::default(),
        timeout: std::time::Duration::from_secs(5),
        stream: false,
    }
}

/// Runs cell `code` in context `ctx` of session `id`, which must take it.
async fn in_context(
    state: &AppState,
    id: &str,
    ctx: &str,
    code: &str,
) -> crate::service::kernels::Ran {
    use crate::service::contexts::{Which, run};
    run(
        state,
        id,
        Which::Made(ctx),
        context_cell(code),
        "/test",
        no_sink(),
    )
    .await
    .expect("a cell")
}

#[tokio::test]
async fn a_javascript_session_runs_its_cells_in_the_kernel_runtime_by_any_of_its_names() {
    let (state, python, node) = two_templates();

    let mut ids = Vec::new();
    for name in ["javascript", "js", "node"] {
        let req = CreateSession {
            template: Some("node".into()),
            language: Some(name.into()),
            ..CreateSession::default()
        };
        let e = start_fresh(&state, req).await.expect("a session");
        assert_eq!(e.language, Language::Kernel, "{name}");
        ids.push(e.id.clone());
    }
    for id in &ids {
        assert_eq!(cell_in(&state, id, None, "1 + 1").await, Status::Ok);
    }
    // A cell may name another runtime of the template, as in a Python session.
    assert_eq!(
        cell_in(&state, &ids[0], Some("python"), "x").await,
        Status::Ok
    );
    assert_eq!(
        cell_in(&state, &ids[0], Some("shell"), "x").await,
        Status::Ok
    );

    let main = opts(0, None, false);
    assert_eq!(
        node.cells(),
        [
            (Language::Kernel, main.clone()),
            (Language::Kernel, main.clone()),
            (Language::Kernel, main.clone()),
            (Language::Python, main.clone()),
            (Language::Shell, main),
        ]
    );
    assert_eq!(node.counts().started, 3);
    assert_eq!(python.counts().started, 0);
}

#[tokio::test]
async fn typescript_is_the_kernels_dialect_1_in_jobs_batches_sessions_and_cells() {
    let (state, _python, node) = two_templates();

    for name in ["typescript", "ts"] {
        let ran = run(
            &state,
            job_in(Some("node"), name, "let x: number"),
            no_sink(),
        )
        .await
        .unwrap();
        assert_eq!(ran.result.status, Status::Ok, "{name}");
    }
    let ran = batch(
        &state,
        vec![
            job_in(Some("node"), "ts", "a"),
            job_in(Some("node"), "js", "b"),
        ],
    )
    .await
    .unwrap();
    assert!(ran.iter().all(|r| r.result.status == Status::Ok));
    let req = CreateSession {
        template: Some("node".into()),
        language: Some("ts".into()),
        ..CreateSession::default()
    };
    let ts_session = start_fresh(&state, req).await.expect("a session");
    let id = ts_session.id.clone();
    assert_eq!(
        (ts_session.language, ts_session.dialect),
        (Language::Kernel, 1)
    );
    // Its cells are TypeScript unless one names another runtime.
    for language in [None, Some("js"), Some("python"), Some("typescript")] {
        assert_eq!(cell_in(&state, &id, language, "1").await, Status::Ok);
    }

    assert_eq!(
        node.languages(),
        [
            [Language::Kernel; 6].as_slice(),
            &[Language::Python, Language::Kernel]
        ]
        .concat()
    );
    let mut dialects = node.dialects();
    // The batch's two jobs run side by side, in either order.
    dialects[2..4].sort();
    assert_eq!(dialects, [1, 1, 0, 1, 1, 0, 0, 1]);
}

#[tokio::test]
async fn a_node_session_runs_javascript_by_default_and_python_by_name() {
    let (state, python, node) = two_templates();
    let on_node = session_of(&state, "node").await;
    let on_python = new_session(&state).await;

    assert_eq!(cell_in(&state, &on_node, None, "1").await, Status::Ok);
    assert_eq!(
        cell_in(&state, &on_node, Some("python"), "2").await,
        Status::Ok
    );
    assert_eq!(cell_in(&state, &on_node, Some("js"), "3").await, Status::Ok);
    assert_eq!(cell_in(&state, &on_python, None, "4").await, Status::Ok);

    assert_eq!(
        state.sessions().get(&on_node).unwrap().language,
        Language::Kernel
    );
    assert_eq!(
        node.languages(),
        [Language::Kernel, Language::Python, Language::Kernel]
    );
    assert_eq!(python.languages(), [Language::Python]);
}

#[tokio::test]
async fn javascript_on_the_python_template_is_400_naming_its_runtimes() {
    let (state, python, _node) = two_templates();
    let req = CreateSession {
        language: Some("js".into()),
        ..CreateSession::default()
    };
    let id = new_session(&state).await;

    let session = start_fresh(&state, req).await.unwrap_err();
    let cell = crate::service::sessions::cell(
        &state,
        &id,
        crate::service::jobs::ExecRequest {
            language: Some("javascript".into()),
            ..super::cell("1")
        },
        "/test",
        no_sink(),
    )
    .await
    .unwrap_err();
    let context =
        crate::service::contexts::create(&state, &id, Some("js"), None, "/tmp").unwrap_err();

    let runtimes = "its runtimes: python, shell";
    assert_invalid(
        &session,
        "language",
        &format!("template fake has no runtime \"js\"; {runtimes}"),
    );
    assert_invalid(
        &cell,
        "language",
        &format!("template fake has no runtime \"javascript\"; {runtimes}"),
    );
    assert_invalid(
        &context,
        "language",
        &format!("template fake has no runtime \"js\"; {runtimes}"),
    );
    assert_eq!(python.counts().started, 1);
    assert!(python.cells().is_empty());
    assert!(
        crate::service::contexts::list(&state, &id)
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn javascript_contexts_are_namespaces_of_their_own_beside_a_python_context() {
    use crate::service::contexts::{self, Which};
    let (state, _python, node) = two_templates();
    let id = session_of(&state, "node").await;

    let a = contexts::create(&state, &id, Some("js"), None, "/tmp").unwrap();
    let b = contexts::create(&state, &id, Some("javascript"), Some("/srv"), "/tmp").unwrap();
    let py = contexts::create(&state, &id, Some("python"), None, "/tmp").unwrap();
    let mut counts = Vec::new();
    for (ctx, code) in [(&a, "let x = 1"), (&b, "x"), (&a, "x")] {
        let ran = in_context(&state, &id, &ctx.id, code).await;
        assert_eq!(ran.result.status, Status::Ok);
        counts.push(ran.execution_count);
    }
    let in_python = contexts::language(&state, &id, &py).unwrap();
    // A Python context's cell goes to a kernel process of its own (which the fake engine,
    // without a VMM, cannot start), never to the session's cells.
    let py_cell = contexts::run(
        &state,
        &id,
        Which::Made(&py.id),
        context_cell("1"),
        "/test",
        no_sink(),
    )
    .await;

    // Named as the template names the runtime (E2B names a `js` context `javascript`).
    assert_eq!(
        [&a.language, &b.language, &py.language],
        ["javascript", "javascript", "python"]
    );
    assert_eq!((a.namespace, b.namespace, py.namespace), (1, 2, 0));
    assert_eq!((a.cwd.as_str(), b.cwd.as_str()), ("/tmp", "/srv"));
    assert_eq!(in_python, Language::Python);
    assert!(py_cell.is_err(), "{py_cell:?}");
    assert_eq!(counts, [1, 1, 2], "each context counts its own cells");
    assert_eq!(
        node.cells(),
        [
            (Language::Kernel, opts(1, Some("/tmp"), true)),
            (Language::Kernel, opts(2, Some("/srv"), true)),
            (Language::Kernel, opts(1, Some("/tmp"), true)),
        ]
    );
}

#[tokio::test]
async fn restarting_a_javascript_context_empties_its_namespace_and_removing_it_too() {
    use crate::service::contexts::{self, Which};
    let (state, _python, node) = two_templates();
    let id = session_of(&state, "node").await;
    let a = contexts::create(&state, &id, Some("node"), None, "/tmp").unwrap();
    let run = |code: &'static str| {
        contexts::run(
            &state,
            &id,
            Which::Made(&a.id),
            context_cell(code),
            "/test",
            no_sink(),
        )
    };

    run("1").await.unwrap();
    contexts::restart(&state, &id, &a.id, "/test")
        .await
        .unwrap();
    let after = run("2").await.unwrap();
    contexts::remove(&state, &id, &a.id, "/test").await.unwrap();
    let gone = run("3").await.unwrap_err();
    let next = contexts::create(&state, &id, Some("js"), None, "/tmp").unwrap();

    assert_eq!(after.execution_count, 1, "counted again from 1");
    assert!(matches!(gone, Error::NoContext(_)), "{gone:?}");
    assert_eq!(
        next.namespace, 2,
        "a removed context's namespace is not given again"
    );
    let reset = CellOptions {
        reset: true,
        ..opts(1, Some("/tmp"), true)
    };
    assert_eq!(
        node.cells(),
        [
            (Language::Kernel, opts(1, Some("/tmp"), true)),
            (Language::Kernel, reset.clone()),
            (Language::Kernel, opts(1, Some("/tmp"), true)),
            (Language::Kernel, reset),
        ]
    );
}

#[tokio::test]
async fn a_typescript_context_is_a_namespace_in_the_kernels_dialect_and_an_unknown_is_400() {
    use crate::service::contexts;
    let (state, _python, node) = two_templates();
    let on_python = new_session(&state).await;
    let on_node = session_of(&state, "node").await;
    let create = |id: &str, language: &str| {
        crate::service::contexts::create(&state, id, Some(language), None, "/tmp").unwrap_err()
    };
    let ts = contexts::create(&state, &on_node, Some("ts"), None, "/tmp").unwrap();
    let js = contexts::create(&state, &on_node, Some("js"), None, "/tmp").unwrap();
    for (ctx, code) in [(&ts, "let x: number = 1"), (&js, "1"), (&ts, "x")] {
        let ran = in_context(&state, &on_node, &ctx.id, code).await;
        assert_eq!(ran.result.status, Status::Ok);
    }

    assert_eq!(
        (ts.language.as_str(), ts.namespace),
        ("typescript", 1),
        "named as the template names the runtime"
    );
    assert_eq!(
        contexts::language(&state, &on_node, &ts).unwrap(),
        Language::Kernel
    );
    assert_eq!(node.languages(), [Language::Kernel; 3]);
    assert_eq!(node.dialects(), [1, 0, 1], "TypeScript is dialect 1");
    for language in ["ts", "typescript"] {
        assert_invalid(
            &create(&on_python, language),
            "language",
            &format!("template fake has no runtime {language:?}; its runtimes: python, shell"),
        );
    }
    assert_invalid(
        &create(&on_node, "r"),
        "language",
        "bud runs python, bash (busybox sh), javascript and typescript code, not r",
    );
    assert_invalid(
        &create(&on_python, "r"),
        "language",
        "bud runs python and bash (busybox sh) code, not r",
    );
    let made = |id: &str| crate::service::contexts::list(&state, id).unwrap().len();
    assert_eq!((made(&on_python), made(&on_node)), (0, 2));
}
