//! User templates built over HTTP (`POST /v1/templates`) on a fake builder: every bad
//! definition a 400 naming its field, the names that cannot be taken (409), the build's log
//! as NDJSON, a failed build leaving nothing served, and the limits on builds at once.
//! Loading a built template needs the VMM: the real build is in tests/user_templates.rs.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::*;
use crate::core::builds::Builder;

mod keys;

/// A builder that ends each build as its definition's `env.END` says: `ok`, `fail`, or
/// (anything else) never, until [`FakeBuilder::finish`].
type Done = Box<dyn FnOnce(Result<(), String>) + Send>;

#[derive(Default)]
struct FakeBuilder {
    started: Mutex<Vec<Value>>,
    held: Mutex<Vec<Done>>,
}

impl std::fmt::Debug for FakeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FakeBuilder")
    }
}

impl FakeBuilder {
    fn finish(&self) {
        for done in self.held.lock().unwrap().drain(..) {
            done(Ok(()));
        }
    }
}

impl Builder for FakeBuilder {
    fn built_in(&self) -> Vec<String> {
        vec!["python".into(), "tools".into()]
    }

    fn start(
        &self,
        definition: Value,
        line: Box<dyn Fn(&str) + Send + Sync>,
        done: Box<dyn FnOnce(Result<(), String>) + Send>,
    ) {
        self.started.lock().unwrap().push(definition.clone());
        line("fetching packages");
        line("booting");
        match definition["env"]["END"].as_str() {
            Some("ok") => done(Ok(())),
            Some("fail") => done(Err("warm-up failed: ValueError: nope".into())),
            _ => self.held.lock().unwrap().push(done),
        }
    }
}

async fn with_builder(config: Config) -> (Served, Arc<FakeBuilder>) {
    let served = Served::with_config(config).await;
    let builder = Arc::new(FakeBuilder::default());
    served.state.set_builder(builder.clone());
    (served, builder)
}

/// The build log of `name` as NDJSON lines, to its end.
async fn log(s: &Served, name: &str) -> Vec<Value> {
    let r = s
        .client
        .get(s.url(&format!("/v1/templates/{name}/build")))
        .send()
        .await
        .expect("request failed");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["content-type"], "application/x-ndjson");
    let text = r.text().await.expect("the log");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[tokio::test]
async fn each_malformed_definition_is_a_400_naming_its_field() {
    let (s, builder) = with_builder(test_config()).await;
    let big = "x".repeat(5 << 20);
    let cases: Vec<(Value, &str)> = vec![
        (json!({}), "name"),
        (json!({"name": "Bad Name"}), "name"),
        (json!({"name": 7}), "name"),
        (json!({"name": "a", "from": "../x"}), "from"),
        (json!({"name": "a", "from": "a"}), "from"),
        (json!({"name": "a", "apt": "jq"}), "apt"),
        (json!({"name": "a", "apt": ["JQ"]}), "apt[0]"),
        (json!({"name": "a", "apt": ["jq", "jq=1"]}), "apt[1]"),
        (json!({"name": "a", "apt": ["jq=latest!"]}), "apt[0]"),
        (
            json!({"name": "a", "pip": ["--index-url=http://x"]}),
            "pip[0]",
        ),
        (
            json!({"name": "a", "pip": ["x @ https://h/x.whl"]}),
            "pip[0]",
        ),
        (json!({"name": "a", "pip": ["ok", "../local"]}), "pip[1]"),
        (
            json!({"name": "a", "requirements": "ok\n-e .\n"}),
            "requirements",
        ),
        (
            json!({"name": "a", "files": {"rel": "x"}}),
            "files[\"rel\"]",
        ),
        (
            json!({"name": "a", "files": {"/init": "x"}}),
            "files[\"/init\"]",
        ),
        (
            json!({"name": "a", "files": {"/tmp": "x"}}),
            "files[\"/tmp\"]",
        ),
        (json!({"name": "a", "env": {"A-B": "x"}}), "env[\"A-B\"]"),
        (json!({"name": "a", "workdir": "relative"}), "workdir"),
        (json!({"name": "a", "memory_mib": 16}), "memory_mib"),
        (json!({"name": "a", "warm": big}), "files"),
        (json!({"name": "a", "deny_out": []}), "deny_out"),
    ];
    assert!(cases.len() >= 20);
    for (body, field) in &cases {
        let (status, r) = s.post("/v1/templates", body).await;
        let shown = r.to_string();
        assert_eq!(status, 400, "{}: {}", &shown[..shown.len().min(300)], field);
        assert_eq!(r["error"]["code"], "invalid_request", "{field}");
        assert_eq!(
            r["error"]["field"],
            *field,
            "{}",
            &shown[..shown.len().min(300)]
        );
        assert!(
            shown.len() < 2000,
            "an error repeats a short prefix: {} bytes",
            shown.len()
        );
    }
    assert!(
        builder.started.lock().unwrap().is_empty(),
        "nothing was built"
    );
    assert_eq!(s.state.template_names(), ["python"]);
    s.assert_still_serving().await;
}

#[tokio::test]
async fn built_in_served_and_building_names_are_409() {
    let (s, builder) = with_builder(test_config()).await;
    for name in ["python", "tools"] {
        let (status, r) = s.post("/v1/templates", &json!({"name": name})).await;
        assert_eq!(
            (status, &r["error"]["code"]),
            (409, &json!("template_exists")),
            "{r}"
        );
    }
    let (status, r) = s.post("/v1/templates", &json!({"name": "slow"})).await;
    assert_eq!((status, &r["status"]), (201, &json!("building")), "{r}");
    let (status, r) = s.post("/v1/templates", &json!({"name": "slow"})).await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (409, &json!("template_exists")),
        "{r}"
    );
    assert_eq!(builder.started.lock().unwrap().len(), 1);
    // While it builds it is served as building: its jobs are told to come back.
    let (status, r) = s.exec(json!({"template": "slow", "code": "x"})).await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (503, &json!("not_ready")),
        "{r}"
    );
    builder.finish();
}

#[tokio::test]
async fn a_failed_build_says_why_in_its_log_and_leaves_nothing_served() {
    let (s, _builder) = with_builder(test_config()).await;
    let body = json!({"name": "broken", "pip": ["tabulate"], "env": {"END": "fail"}});

    let (status, r) = s.post("/v1/templates", &body).await;
    assert_eq!(status, 201, "{r}");
    let lines = log(&s, "broken").await;

    let texts: Vec<&str> = lines.iter().filter_map(|l| l["line"].as_str()).collect();
    assert_eq!(texts, ["fetching packages", "booting"]);
    assert!(lines[0]["t_s"].as_f64().is_some());
    let last = lines.last().unwrap();
    assert_eq!(last["status"], "failed", "{last}");
    assert_eq!(last["error"], "warm-up failed: ValueError: nope");
    assert_eq!(s.state.template_names(), ["python"]);
    let (status, r) = s.get("/v1/templates/broken").await;
    assert_eq!((status, &r["status"]), (200, &json!("failed")), "{r}");
    assert_eq!(r["error"], "warm-up failed: ValueError: nope");
    let (status, r) = s.exec(json!({"template": "broken", "code": "x"})).await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (400, &json!("unknown_template")),
        "{r}"
    );
    // The name is free again: a second build starts.
    let (status, _) = s.post("/v1/templates", &json!({"name": "broken"})).await;
    assert_eq!(status, 201);
}

#[tokio::test]
async fn a_built_template_that_cannot_be_loaded_is_dropped_with_why() {
    // The fake server has no template source: a build that ends well still fails to load.
    let (s, _builder) = with_builder(test_config()).await;
    let (status, _) = s
        .post(
            "/v1/templates",
            &json!({"name": "ok", "env": {"END": "ok"}}),
        )
        .await;
    assert_eq!(status, 201);

    let lines = log(&s, "ok").await;

    let last = lines.last().unwrap();
    assert_eq!(last["status"], "failed", "{last}");
    assert_eq!(last["error"], "this server has no source of templates");
    assert_eq!(s.state.template_names(), ["python"]);
}

#[tokio::test]
async fn builds_at_once_are_limited_and_a_server_without_builds_says_so() {
    let mut config = test_config();
    config.builds.template_builds = 1;
    let (s, builder) = with_builder(config).await;
    let (status, _) = s.post("/v1/templates", &json!({"name": "one"})).await;
    assert_eq!(status, 201);
    let (status, r) = s.post("/v1/templates", &json!({"name": "two"})).await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (429, &json!("too_many_builds")),
        "{r}"
    );
    builder.finish();

    let none = Served::start().await;
    let (status, r) = none.post("/v1/templates", &json!({"name": "x"})).await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (501, &json!("no_builds")),
        "{r}"
    );
    let mut off = test_config();
    off.builds.template_builds = 0;
    let (off, _) = with_builder(off).await;
    let (status, r) = off.post("/v1/templates", &json!({"name": "x"})).await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (501, &json!("no_builds")),
        "{r}"
    );
    let (status, r) = off.get("/v1/templates/x/build").await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (404, &json!("unknown_template")),
        "{r}"
    );
}

#[tokio::test]
async fn too_many_packages_is_a_400_on_this_servers_limit() {
    let mut config = test_config();
    config.builds.template_max_packages = 2;
    let (s, _) = with_builder(config).await;
    let (status, r) = s
        .post(
            "/v1/templates",
            &json!({"name": "a", "apt": ["jq"], "pip": ["x", "y"]}),
        )
        .await;
    assert_eq!((status, &r["error"]["field"]), (400, &json!("pip")), "{r}");
}
