//! JavaScript, the node template's kernel runtime, as clients see it: `POST /v1/exec` by
//! its name or aliases, Piston's `javascript` runtime only where the template has it, and
//! the 400 of a JavaScript cell or context (native and E2B's), which are not built yet.

use serde_json::{Value, json};
use vmm::Language;

use super::{Served, test_config};
use crate::core::engine::fake::FakeEngine;

/// What a cell or context in JavaScript is told.
const NOT_BUILT: &str = "JavaScript cells and contexts are not built yet: run JavaScript as one-shot jobs (POST /v1/exec with language \"javascript\")";

/// A server whose default template is the node template (javascript, python, shell).
async fn node() -> Served {
    Served::with_engine(test_config(), FakeEngine::with_node()).await
}

/// A server whose default template is the python template (python, shell).
async fn python() -> Served {
    Served::start().await
}

impl Served {
    /// POSTs `body` to `path` with E2B's sandbox header for `sandbox`.
    async fn post_in_sandbox(&self, sandbox: &str, path: &str, body: &Value) -> (u16, Value) {
        let req = self
            .client
            .post(self.url(path))
            .header(crate::compat::e2b::SANDBOX_ID_HEADER, sandbox)
            .json(body);
        super::answer(req.send().await.expect("request failed")).await
    }
}

/// `(status, error.field, error.message)` of a native answer.
fn native_error(status: u16, r: &Value) -> (u16, &Value, &Value) {
    (status, &r["error"]["field"], &r["error"]["message"])
}

#[tokio::test]
async fn exec_runs_javascript_by_its_name_or_aliases_in_the_kernel_runtime() {
    let s = node().await;

    for name in ["javascript", "js", "node"] {
        let (status, r) = s
            .exec(json!({"language": name, "code": "console.log(1)"}))
            .await;
        assert_eq!(
            (status, &r["status"], &r["stdout"]),
            (200, &json!("ok"), &json!("console.log(1)")),
            "{name}: {r}"
        );
    }

    assert_eq!(s.engine.languages(), [Language::Kernel; 3]);
}

#[tokio::test]
async fn exec_in_javascript_on_the_python_template_is_400_naming_its_runtimes() {
    let s = python().await;

    let (status, r) = s.exec(json!({"language": "js", "code": "1"})).await;

    assert_eq!(
        native_error(status, &r),
        (
            400,
            &json!("language"),
            &json!("template fake has no runtime \"js\"; its runtimes: python, shell")
        ),
        "{r}"
    );
    assert_eq!(r["error"]["code"], "invalid_request");
    assert_eq!(s.engine.counts().jobs, 0);
}

#[tokio::test]
async fn pistons_runtimes_list_javascript_only_where_the_template_has_it() {
    let (with, without) = (node().await, python().await);

    let (with_status, with_list) = with.get("/api/v2/runtimes").await;
    let (without_status, without_list) = without.get("/api/v2/piston/runtimes").await;

    let python_and_bash = [
        json!({"language": "python", "version": "0",
               "aliases": ["py", "py3", "python3", "python3.11"]}),
        json!({"language": "bash", "version": "0", "aliases": ["sh"]}),
    ];
    assert_eq!(
        (without_status, &without_list),
        (200, &json!(python_and_bash))
    );
    assert_eq!(with_status, 200);
    assert_eq!(
        with_list,
        json!([
            {"language": "javascript", "version": "18.20.4",
             "aliases": ["node-javascript", "node-js", "javascript", "js", "node"],
             "runtime": "node"},
            python_and_bash[0],
            python_and_bash[1],
        ])
    );
}

#[tokio::test]
async fn pistons_execute_runs_javascript_as_a_kernel_job() {
    let (with, without) = (node().await, python().await);
    // A file without a name: a named one is also put in the working directory, which the
    // fake engine does not do.
    let body = |language: &str| {
        json!({"language": language, "version": "18",
               "files": [{"content": "console.log(2)"}]})
    };

    let mut answers = Vec::new();
    for language in ["javascript", "js", "node", "node-js"] {
        answers.push(with.post("/api/v2/execute", &body(language)).await);
    }
    let (unknown, refused) = without.post("/api/v2/execute", &body("javascript")).await;

    for (status, r) in &answers {
        assert_eq!(*status, 200, "{r}");
        assert_eq!(
            (
                &r["language"],
                &r["version"],
                &r["run"]["stdout"],
                &r["run"]["code"]
            ),
            (
                &json!("javascript"),
                &json!("18.20.4"),
                &json!("console.log(2)"),
                &json!(0)
            ),
            "{r}"
        );
    }
    assert_eq!(with.engine.languages(), [Language::Kernel; 4]);
    assert_eq!(
        (unknown, refused),
        (400, json!({"message": "javascript-18 runtime is unknown"}))
    );
    assert_eq!(without.engine.counts().jobs, 0);
}

#[tokio::test]
async fn a_javascript_session_cell_or_context_is_400_saying_where_javascript_runs() {
    let s = node().await;
    let id = s.session(json!({})).await;

    let (session, session_r) = s
        .post("/v1/sessions", &json!({"language": "javascript"}))
        .await;
    let (cell, cell_r) = s
        .post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"language": "js", "code": "1"}),
        )
        .await;
    let (context, context_r) = s
        .post(
            &format!("/v1/sessions/{id}/contexts"),
            &json!({"language": "node"}),
        )
        .await;

    for (status, r) in [
        (session, &session_r),
        (cell, &cell_r),
        (context, &context_r),
    ] {
        assert_eq!(
            native_error(status, r),
            (400, &json!("language"), &json!(NOT_BUILT)),
            "{r}"
        );
    }
    assert_eq!(s.engine.counts().started, 1);
    assert!(s.engine.languages().is_empty());
}

#[tokio::test]
async fn e2bs_js_and_ts_cells_and_contexts_are_400_saying_where_javascript_runs() {
    let s = node().await;
    let (created, sandbox) = s
        .post("/v2/sandboxes", &json!({"templateID": "python"}))
        .await;
    assert_eq!(created, 201, "{sandbox}");
    let id = sandbox["sandboxID"].as_str().expect("an id");

    let (js_context, js_context_r) = s
        .post_in_sandbox(id, "/contexts", &json!({"language": "js"}))
        .await;
    let (ts_context, ts_context_r) = s
        .post_in_sandbox(id, "/contexts", &json!({"language": "ts"}))
        .await;
    let (js_cell, js_cell_r) = s
        .post_in_sandbox(
            id,
            "/execute",
            &json!({"code": "1", "language": "javascript"}),
        )
        .await;

    assert_eq!(
        (js_context, &js_context_r),
        (400, &json!({"code": 400, "message": NOT_BUILT}))
    );
    assert_eq!(
        (ts_context, &ts_context_r),
        (
            400,
            &json!({"code": 400, "message": format!("bud runs no TypeScript; {NOT_BUILT}")})
        )
    );
    assert_eq!(
        (js_cell, &js_cell_r),
        (400, &json!({"code": 400, "message": NOT_BUILT}))
    );
    assert!(s.engine.languages().is_empty());
}
