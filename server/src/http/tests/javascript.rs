//! JavaScript, the node template's kernel runtime, as clients see it: `POST /v1/exec` by
//! its name or aliases, Piston's `javascript` runtime only where the template has it,
//! sessions, cells and code contexts in it (native and E2B's), TypeScript as its dialect
//! 1 through every client, and the 400s of JavaScript and TypeScript on a template without
//! them.

use serde_json::{Value, json};
use vmm::{CellOptions, Language};

use super::{Served, test_config};
use crate::core::engine::fake::FakeEngine;

/// The header E2B's SDKs name a sandbox with (spelled out: this layer does not import the
/// compat layer it tests through).
const E2B_SANDBOX_HEADER: &str = "e2b-sandbox-id";

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
            .header(E2B_SANDBOX_HEADER, sandbox)
            .json(body);
        super::answer(req.send().await.expect("request failed")).await
    }

    /// GETs `path` with E2B's sandbox header for `sandbox`.
    async fn get_in_sandbox(&self, sandbox: &str, path: &str) -> (u16, Value) {
        let req = self
            .client
            .get(self.url(path))
            .header(E2B_SANDBOX_HEADER, sandbox);
        super::answer(req.send().await.expect("request failed")).await
    }

    /// E2B's `POST /execute` of `body` in `sandbox`: the status and the NDJSON lines (an
    /// error's JSON body as one line).
    async fn execute(&self, sandbox: &str, body: &Value) -> (u16, Vec<Value>) {
        let req = self
            .client
            .post(self.url("/execute"))
            .header(E2B_SANDBOX_HEADER, sandbox)
            .json(body);
        let r = req.send().await.expect("request failed");
        let status = r.status().as_u16();
        let text = r.text().await.expect("the body");
        let lines = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("one JSON value a line"))
            .collect();
        (status, lines)
    }

    /// E2B's sandbox on template `python` (served by this server's engine): its id.
    async fn sandbox(&self) -> String {
        let (created, sandbox) = self
            .post("/v2/sandboxes", &json!({"templateID": "python"}))
            .await;
        assert_eq!(created, 201, "{sandbox}");
        sandbox["sandboxID"].as_str().expect("an id").to_owned()
    }
}

/// A cell's options as the fake engine records them.
fn opts(namespace: u32, directory: Option<&str>, error_in_display: bool) -> CellOptions {
    CellOptions {
        namespace,
        reset: false,
        directory: directory.map(str::to_owned),
        error_in_display,
    }
}

/// An E2B answer's lines without their timestamps.
fn untimed(mut lines: Vec<Value>) -> Vec<Value> {
    for l in &mut lines {
        if let Some(o) = l.as_object_mut() {
            o.remove("timestamp");
        }
    }
    lines
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
            {"language": "typescript", "version": "18.20.4",
             "aliases": ["ts", "node-ts", "tsc"]},
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
async fn typescript_runs_as_the_kernels_dialect_1_through_every_client() {
    let s = node().await;
    let id = s.sandbox().await;
    let session = s.session(json!({"language": "typescript"})).await;

    let (job, job_r) = s
        .post(
            "/v1/exec",
            &json!({"language": "ts", "code": "let a: number"}),
        )
        .await;
    let (cell, cell_r) = s
        .post(
            &format!("/v1/sessions/{session}/exec"),
            &json!({"code": "1"}),
        )
        .await;
    let (_, shown) = s.get(&format!("/v1/sessions/{session}")).await;
    let (e2b_cell, e2b_lines) = s
        .execute(&id, &json!({"code": "1", "language": "ts"}))
        .await;
    let (made, ctx) = s
        .post_in_sandbox(&id, "/contexts", &json!({"language": "ts"}))
        .await;
    let ctx_id = ctx["id"].as_str().expect("a context id").to_owned();
    let (in_ctx, _) = s
        .execute(&id, &json!({"code": "2", "context_id": ctx_id}))
        .await;
    let (piston, piston_r) = s
        .post(
            "/api/v2/execute",
            &json!({"language": "tsc", "version": "*", "files": [{"content": "3"}]}),
        )
        .await;

    assert_eq!((job, &job_r["status"]), (200, &json!("ok")), "{job_r}");
    assert_eq!((cell, &cell_r["status"]), (200, &json!("ok")), "{cell_r}");
    assert_eq!(shown["language"], json!("typescript"), "{shown}");
    assert_eq!(e2b_cell, 200, "{e2b_lines:?}");
    assert_eq!(
        (made, &ctx["language"]),
        (200, &json!("typescript")),
        "{ctx}"
    );
    assert_eq!(in_ctx, 200);
    assert_eq!(
        (piston, &piston_r["language"]),
        (200, &json!("typescript")),
        "{piston_r}"
    );
    assert_eq!(s.engine.languages(), [Language::Kernel; 5]);
    assert_eq!(s.engine.dialects(), [1; 5]);
}

#[tokio::test]
async fn a_javascript_session_and_its_contexts_run_in_the_kernel_runtime() {
    let s = node().await;
    let id = s.session(json!({"language": "js"})).await;
    let default = s.session(json!({})).await;

    let (_, shown) = s.get(&format!("/v1/sessions/{id}")).await;
    let (_, shown_default) = s.get(&format!("/v1/sessions/{default}")).await;
    let (cell, cell_r) = s
        .post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"code": "1 + 1"}),
        )
        .await;
    let (python, python_r) = s
        .post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"language": "python", "code": "2"}),
        )
        .await;
    let contexts = format!("/v1/sessions/{id}/contexts");
    let (made_a, a) = s.post(&contexts, &json!({"language": "js"})).await;
    let (made_b, b) = s
        .post(&contexts, &json!({"language": "javascript", "cwd": "/srv"}))
        .await;
    let mut ran = Vec::new();
    for (ctx, code) in [(&a, "let x = 1"), (&a, "x"), (&b, "typeof x")] {
        let path = format!("{contexts}/{}/exec", ctx["id"].as_str().unwrap());
        ran.push(s.post(&path, &json!({"code": code})).await);
    }
    let (listed, list) = s.get(&contexts).await;

    assert_eq!(
        (shown["language"].clone(), shown_default["language"].clone()),
        (json!("javascript"), json!("javascript"))
    );
    assert_eq!(
        (
            cell,
            &cell_r["status"],
            &cell_r["stdout"],
            &cell_r["execution_count"]
        ),
        (200, &json!("ok"), &json!("1 + 1"), &json!(1)),
        "{cell_r}"
    );
    assert_eq!(
        (python, &python_r["execution_count"]),
        (200, &json!(2)),
        "{python_r}"
    );
    assert_eq!(
        (made_a, &a["language"], &a["cwd"]),
        (201, &json!("javascript"), &json!("/tmp")),
        "{a}"
    );
    assert_eq!(
        (made_b, &b["language"], &b["cwd"]),
        (201, &json!("javascript"), &json!("/srv")),
        "{b}"
    );
    let counts: Vec<_> = ran
        .iter()
        .map(|(status, r)| (*status, r["status"].clone(), r["execution_count"].clone()))
        .collect();
    assert_eq!(
        counts,
        [
            (200, json!("ok"), json!(1)),
            (200, json!("ok"), json!(2)),
            (200, json!("ok"), json!(1)),
        ]
    );
    assert_eq!((listed, list.as_array().map(Vec::len)), (200, Some(2)));
    let in_a = opts(1, Some("/tmp"), true);
    assert_eq!(
        s.engine.cells(),
        [
            (Language::Kernel, opts(0, None, false)),
            (Language::Python, opts(0, None, false)),
            (Language::Kernel, in_a.clone()),
            (Language::Kernel, in_a),
            (Language::Kernel, opts(2, Some("/srv"), true)),
        ]
    );
}

#[tokio::test]
async fn a_javascript_contexts_restart_and_delete_empty_its_namespace() {
    let s = node().await;
    let id = s.session(json!({})).await;
    let contexts = format!("/v1/sessions/{id}/contexts");
    let (_, a) = s.post(&contexts, &json!({"language": "node"})).await;
    let ctx = format!("{contexts}/{}", a["id"].as_str().unwrap());

    let (restarted, _) = s.post(&format!("{ctx}/restart"), &json!({})).await;
    let deleted = s.delete(&ctx).await;
    let (after, after_r) = s.post(&format!("{ctx}/exec"), &json!({"code": "1"})).await;

    assert_eq!((restarted, deleted), (204, 204));
    assert_eq!(
        (after, &after_r["error"]["code"]),
        (404, &json!("no_context")),
        "{after_r}"
    );
    let reset = CellOptions {
        reset: true,
        ..opts(1, Some("/tmp"), true)
    };
    assert_eq!(
        s.engine.cells(),
        [(Language::Kernel, reset.clone()), (Language::Kernel, reset)]
    );
}

#[tokio::test]
async fn javascript_and_typescript_on_the_python_template_are_400_naming_its_runtimes() {
    let (p, n) = (python().await, node().await);
    let on_python = p.session(json!({})).await;
    // A node session beside: it is no part of what is refused.
    n.session(json!({})).await;

    let (session, session_r) = p
        .post("/v1/sessions", &json!({"language": "javascript"}))
        .await;
    let (cell, cell_r) = p
        .post(
            &format!("/v1/sessions/{on_python}/exec"),
            &json!({"language": "js", "code": "1"}),
        )
        .await;
    let (context, context_r) = p
        .post(
            &format!("/v1/sessions/{on_python}/contexts"),
            &json!({"language": "node"}),
        )
        .await;
    let (ts, ts_r) = p
        .post(
            &format!("/v1/sessions/{on_python}/contexts"),
            &json!({"language": "typescript"}),
        )
        .await;
    let (ts_job, ts_job_r) = p
        .post("/v1/exec", &json!({"language": "ts", "code": "1"}))
        .await;

    let no = |name: &str| {
        json!(format!(
            "template fake has no runtime \"{name}\"; its runtimes: python, shell"
        ))
    };
    assert_eq!(
        native_error(session, &session_r),
        (400, &json!("language"), &no("javascript")),
        "{session_r}"
    );
    assert_eq!(
        native_error(cell, &cell_r),
        (400, &json!("language"), &no("js")),
        "{cell_r}"
    );
    assert_eq!(
        native_error(context, &context_r),
        (400, &json!("language"), &no("node")),
        "{context_r}"
    );
    assert_eq!(
        native_error(ts, &ts_r),
        (400, &json!("language"), &no("typescript")),
        "{ts_r}"
    );
    assert_eq!(
        native_error(ts_job, &ts_job_r),
        (400, &json!("language"), &no("ts")),
        "{ts_job_r}"
    );
    assert_eq!(
        (p.engine.counts().started, n.engine.counts().started),
        (1, 1)
    );
    assert!(p.engine.cells().is_empty() && n.engine.cells().is_empty());
}

#[tokio::test]
async fn e2bs_js_contexts_and_cells_run_in_the_kernel_runtime() {
    let s = node().await;
    let id = s.sandbox().await;

    let (made, ctx) = s
        .post_in_sandbox(&id, "/contexts", &json!({"language": "js"}))
        .await;
    let ctx_id = ctx["id"].as_str().expect("a context id").to_owned();
    let (in_ctx, in_ctx_lines) = s
        .execute(&id, &json!({"code": "let a = 1", "context_id": ctx_id}))
        .await;
    let (again, again_lines) = s
        .execute(&id, &json!({"code": "a", "context_id": ctx_id}))
        .await;
    let mut default_js = Vec::new();
    for language in ["js", "javascript"] {
        default_js.push(
            s.execute(&id, &json!({"code": "b", "language": language}))
                .await,
        );
    }
    let (python, _) = s.execute(&id, &json!({"code": "c"})).await;
    let (listed, list) = s.get_in_sandbox(&id, "/contexts").await;
    let (restarted, _) = s
        .post_in_sandbox(&id, &format!("/contexts/{ctx_id}/restart"), &json!({}))
        .await;

    assert_eq!(
        (made, &ctx["language"], &ctx["cwd"]),
        (200, &json!("javascript"), &json!("/home/user")),
        "{ctx}"
    );
    assert_eq!(
        (in_ctx, untimed(in_ctx_lines)),
        (
            200,
            vec![
                json!({"type": "stdout", "text": "let a = 1"}),
                json!({"type": "number_of_executions", "execution_count": 1}),
                json!({"type": "end_of_execution"}),
            ]
        )
    );
    assert_eq!(
        (again, &again_lines[1]),
        (
            200,
            &json!({"type": "number_of_executions", "execution_count": 2})
        )
    );
    for (status, lines) in &default_js {
        assert_eq!(*status, 200);
        assert_eq!(
            lines.first().map(|l| &l["text"]),
            Some(&json!("b")),
            "{lines:?}"
        );
    }
    assert_eq!((python, restarted), (200, 204));
    assert_eq!(listed, 200);
    assert_eq!(
        list,
        json!([
            {"id": "default", "language": "python", "cwd": "/home/user"},
            {"id": ctx_id, "language": "javascript", "cwd": "/home/user"},
        ])
    );
    let (in_ctx, main) = (
        opts(1, Some("/home/user"), true),
        opts(0, Some("/home/user"), true),
    );
    assert_eq!(
        s.engine.cells(),
        [
            (Language::Kernel, in_ctx.clone()),
            (Language::Kernel, in_ctx.clone()),
            (Language::Kernel, main.clone()),
            (Language::Kernel, main.clone()),
            (Language::Python, main),
            (
                Language::Kernel,
                CellOptions {
                    reset: true,
                    ..in_ctx
                }
            ),
        ]
    );
}

#[tokio::test]
async fn e2bs_default_context_restart_empties_pythons_main_on_a_javascript_template() {
    let s = node().await;
    let id = s.sandbox().await;

    let (restarted, _) = s
        .post_in_sandbox(&id, "/contexts/default/restart", &json!({}))
        .await;

    assert_eq!(restarted, 204);
    assert_eq!(
        s.engine.cells(),
        [(
            Language::Python,
            CellOptions {
                reset: true,
                ..opts(0, Some("/home/user"), true)
            }
        )]
    );
}

#[tokio::test]
async fn e2bs_ts_and_js_without_the_runtime_are_400_saying_what_runs() {
    let p = python().await;
    let on_python = p.sandbox().await;

    let (ts_context, ts_context_r) = p
        .post_in_sandbox(&on_python, "/contexts", &json!({"language": "ts"}))
        .await;
    let (ts_cell, ts_cell_r) = p
        .execute(&on_python, &json!({"code": "1", "language": "typescript"}))
        .await;
    let (js_context, js_context_r) = p
        .post_in_sandbox(&on_python, "/contexts", &json!({"language": "js"}))
        .await;
    let (js_cell, js_cell_r) = p
        .execute(&on_python, &json!({"code": "1", "language": "javascript"}))
        .await;

    assert_eq!(
        (ts_context, &ts_context_r),
        (
            400,
            &json!({"code": 400, "message": "template fake has no runtime \"ts\"; its runtimes: python, shell"})
        )
    );
    assert_eq!(
        (ts_cell, ts_cell_r),
        (
            400,
            vec![
                json!({"code": 400, "message": "template fake has no runtime \"typescript\"; its runtimes: python, shell"})
            ]
        )
    );
    assert_eq!(
        (js_context, &js_context_r),
        (
            400,
            &json!({"code": 400, "message": "template fake has no runtime \"js\"; its runtimes: python, shell"})
        )
    );
    assert_eq!(
        (js_cell, js_cell_r),
        (
            400,
            vec![
                json!({"code": 400, "message": "template fake has no runtime \"javascript\"; its runtimes: python, shell"})
            ]
        )
    );
    assert!(p.engine.cells().is_empty());
}
