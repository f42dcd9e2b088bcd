//! User templates under API keys: a template belongs to the key that built it, another
//! key's is answered as a template that does not exist (listing, entry, build log,
//! `DELETE`, jobs, batches, sessions, E2B's `templateID`, a definition's `from`), its name
//! is taken (409, naming no key), the owner comes back with the state directory's record;
//! without keys every template is every request's.

use std::sync::Arc;

use serde_json::{Value, json};

use super::super::*;
use super::with_builder;
use crate::core::keys::ApiKeys;

const ALICE: &str = "alice-0123456789abcdef";
const BOB: &str = "bob-0123456789abcdef00";

fn keyed_config() -> Config {
    let mut config = test_config();
    config.api_keys = Some(Arc::new(
        ApiKeys::parse(&format!("alice {ALICE}\nbob {BOB}\n")).unwrap(),
    ));
    config
}

/// `method` on `path` with API key `key` (and `body` as JSON, if any): the status and the
/// JSON answer (null for none).
async fn call(
    s: &Served,
    method: &str,
    key: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = s
        .client
        .request(method, s.url(path))
        .header("x-api-key", key);
    if let Some(b) = body {
        req = req.json(b);
    }
    answer(req.send().await.expect("request failed")).await
}

async fn get(s: &Served, key: &str, path: &str) -> (u16, Value) {
    call(s, "GET", key, path, None).await
}

async fn post(s: &Served, key: &str, path: &str, body: Value) -> (u16, Value) {
    call(s, "POST", key, path, Some(&body)).await
}

/// The names `GET /v1/templates` lists for `key`.
async fn names(s: &Served, key: &str) -> Vec<String> {
    let (status, r) = get(s, key, "/v1/templates").await;
    assert_eq!(status, 200, "{r}");
    r["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect()
}

/// `answer` with every `name` in its text made `NAME`: what an answer about another key's
/// template must equal of one about a template that does not exist.
fn named(answer: &(u16, Value), name: &str) -> (u16, String) {
    (answer.0, answer.1.to_string().replace(name, "NAME"))
}

/// Alice's template `mine`, built (the fake builder holds the build) and made ready on the
/// fake engine.
async fn alices_template(s: &Served) {
    let (status, r) = post(s, ALICE, "/v1/templates", json!({"name": "mine"})).await;
    assert_eq!(status, 201, "{r}");
    assert_eq!(
        (&r["owner"], &r["status"]),
        (&json!("alice"), &json!("building"))
    );
    let engine = Arc::new(s.engine.clone());
    assert!(s.state.set_engine("mine", engine, TemplateInfo::default()));
}

#[tokio::test]
async fn another_keys_template_is_not_listed_and_its_entry_and_build_are_404() {
    let (s, builder) = with_builder(keyed_config()).await;
    alices_template(&s).await;

    assert_eq!(names(&s, ALICE).await, ["python", "mine"]);
    assert_eq!(names(&s, BOB).await, ["python"]);
    let (status, r) = get(&s, ALICE, "/v1/templates/mine").await;
    assert_eq!(
        (status, &r["status"], &r["owner"]),
        (200, &json!("ready"), &json!("alice"))
    );
    assert_eq!(r["build"]["status"], "building", "{r}");
    let entry = get(&s, BOB, "/v1/templates/mine").await;
    assert_eq!(
        entry,
        (
            404,
            json!({"error": {"code": "unknown_template", "field": null,
                "message": "template mine is not served and was not built here; this server serves: python"}})
        )
    );
    assert_eq!(
        named(&entry, "mine"),
        named(&get(&s, BOB, "/v1/templates/nope").await, "nope")
    );
    let log = get(&s, BOB, "/v1/templates/mine/build").await;
    assert_eq!(
        log,
        (
            404,
            json!({"error": {"code": "unknown_template", "field": null,
                "message": "no build of template mine on this server"}})
        )
    );
    assert_eq!(
        named(&log, "mine"),
        named(&get(&s, BOB, "/v1/templates/nope/build").await, "nope")
    );
    let r = s
        .client
        .get(s.url("/v1/templates/mine/build"))
        .header("x-api-key", ALICE)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    builder.finish();
}

#[tokio::test]
async fn another_keys_template_cannot_run_jobs_batches_sessions_or_sandboxes() {
    let (s, builder) = with_builder(keyed_config()).await;
    alices_template(&s).await;
    let unknown = |field: &str| {
        json!({"error": {"code": "unknown_template", "field": field,
            "message": "unknown template `mine`; this server serves: python"}})
    };

    let job = json!({"template": "mine", "code": "x"});
    let refused = post(&s, BOB, "/v1/exec", job.clone()).await;
    assert_eq!(refused, (400, unknown("template")));
    let nope = post(
        &s,
        BOB,
        "/v1/exec",
        json!({"template": "nope", "code": "x"}),
    )
    .await;
    assert_eq!(named(&refused, "mine"), named(&nope, "nope"));
    let (status, r) = post(&s, ALICE, "/v1/exec", job.clone()).await;
    assert_eq!((status, &r["stdout"]), (200, &json!("x")), "{r}");

    let batch = json!({"jobs": [{"code": "a"}, job]});
    assert_eq!(
        post(&s, BOB, "/v1/exec/batch", batch.clone()).await,
        (400, unknown("jobs[1].template"))
    );
    let (status, r) = post(&s, ALICE, "/v1/exec/batch", batch).await;
    assert_eq!(
        (status, &r["results"][1]["stdout"]),
        (200, &json!("x")),
        "{r}"
    );

    let session = json!({"template": "mine"});
    assert_eq!(
        post(&s, BOB, "/v1/sessions", session.clone()).await,
        (400, unknown("template"))
    );
    let (status, r) = post(&s, ALICE, "/v1/sessions", session).await;
    assert_eq!((status, &r["template"]), (201, &json!("mine")), "{r}");

    let sandbox = post(&s, BOB, "/v2/sandboxes", json!({"templateID": "mine"})).await;
    let nope = post(&s, BOB, "/v2/sandboxes", json!({"templateID": "nope"})).await;
    assert_eq!(sandbox.0, 400, "{}", sandbox.1);
    assert_eq!(named(&sandbox, "mine"), named(&nope, "nope"));
    let (status, r) = post(&s, ALICE, "/v2/sandboxes", json!({"templateID": "mine"})).await;
    assert_eq!((status, &r["templateID"]), (201, &json!("mine")), "{r}");
    builder.finish();
}

#[tokio::test]
async fn another_keys_name_is_taken_its_template_no_base_and_only_its_owner_deletes_it() {
    let (s, builder) = with_builder(keyed_config()).await;
    alices_template(&s).await;

    let taken = json!({"error": {"code": "template_exists", "field": null,
        "message": "the name mine is taken on this server; give yours another name"}});
    let built = post(&s, BOB, "/v1/templates", json!({"name": "mine"})).await;
    assert_eq!(built, (409, taken.clone()));
    assert!(!built.1.to_string().contains("alice"));
    assert_eq!(
        call(&s, "PUT", BOB, "/v1/templates/mine", None).await,
        (409, taken)
    );
    let from = post(
        &s,
        BOB,
        "/v1/templates",
        json!({"name": "b", "from": "mine"}),
    )
    .await;
    assert_eq!(
        from,
        (
            400,
            json!({"error": {"code": "unknown_template", "field": "from",
                "message": "unknown template `mine`; this server serves: python"}})
        )
    );
    let nope = post(
        &s,
        BOB,
        "/v1/templates",
        json!({"name": "b", "from": "nope"}),
    )
    .await;
    assert_eq!(named(&from, "mine"), named(&nope, "nope"));
    let deleted = call(&s, "DELETE", BOB, "/v1/templates/mine", None).await;
    assert_eq!(
        deleted,
        (
            404,
            json!({"error": {"code": "unknown_template", "field": null,
                "message": "template mine is not served; this server serves: python"}})
        )
    );
    let nope = call(&s, "DELETE", BOB, "/v1/templates/nope", None).await;
    assert_eq!(named(&deleted, "mine"), named(&nope, "nope"));
    assert_eq!(
        builder.started.lock().unwrap().len(),
        1,
        "bob built nothing"
    );

    // Bob builds on a built-in template; alice on hers, and her error lists hers.
    let (status, r) = post(
        &s,
        BOB,
        "/v1/templates",
        json!({"name": "b", "from": "tools"}),
    )
    .await;
    assert_eq!((status, &r["owner"]), (201, &json!("bob")), "{r}");
    let (status, r) = post(
        &s,
        ALICE,
        "/v1/templates",
        json!({"name": "a", "from": "nope"}),
    )
    .await;
    assert_eq!(
        (status, &r["error"]["message"]),
        (
            400,
            &json!("unknown template `nope`; this server serves: python, mine")
        ),
        "{r}"
    );
    let (status, _) = call(&s, "DELETE", ALICE, "/v1/templates/mine", None).await;
    assert_eq!(status, 204);
    assert_eq!(names(&s, ALICE).await, ["python"]);
    assert_eq!(names(&s, BOB).await, ["python", "b"]);
    builder.finish();
}

#[tokio::test]
async fn a_failed_build_is_its_keys_to_read() {
    let (s, _builder) = with_builder(keyed_config()).await;
    let body = json!({"name": "broken", "env": {"END": "fail"}});
    let (status, _) = post(&s, ALICE, "/v1/templates", body).await;
    assert_eq!(status, 201);

    let (status, r) = get(&s, ALICE, "/v1/templates/broken").await;
    assert_eq!((status, &r["status"]), (200, &json!("failed")), "{r}");
    let (status, r) = get(&s, BOB, "/v1/templates/broken").await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (404, &json!("unknown_template")),
        "{r}"
    );
    let (status, _) = get(&s, BOB, "/v1/templates/broken/build").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn without_keys_every_user_template_is_everyones() {
    let (s, builder) = with_builder(test_config()).await;
    let (status, r) = s.post("/v1/templates", &json!({"name": "mine"})).await;
    assert_eq!(status, 201, "{r}");
    assert!(r.get("owner").is_none(), "nobody's: {r}");
    let engine = Arc::new(s.engine.clone());
    assert!(s.state.set_engine("mine", engine, TemplateInfo::default()));

    let (_, r) = s.get("/v1/templates").await;
    assert_eq!(r["templates"][1]["name"], "mine", "{r}");
    let (status, r) = s.exec(json!({"template": "mine", "code": "x"})).await;
    assert_eq!((status, &r["stdout"]), (200, &json!("x")), "{r}");
    let (status, r) = s.post("/v1/templates", &json!({"name": "mine"})).await;
    assert_eq!(
        (status, &r["error"]["message"]),
        (
            409,
            &json!("template mine is served already (DELETE /v1/templates/mine first)")
        )
    );
    assert_eq!(s.delete("/v1/templates/mine").await, 204);
    builder.finish();
}

#[tokio::test]
async fn a_user_templates_owner_comes_back_from_the_state_directorys_record() {
    let dir = std::env::temp_dir().join(format!("bud-http-owners-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    crate::core::builds::record(&dir, "mine", Some("alice")).unwrap();
    crate::core::builds::record(&dir, "old", None).unwrap();
    // As `bud serve` starts again: the recorded templates after the configured ones.
    let mut config = keyed_config();
    config.state_dir = Some(dir.clone());
    config.templates = ["python", "mine", "old"].map(String::from).into();
    let s = Served::with_config(config).await;

    assert_eq!(names(&s, ALICE).await, ["python", "mine", "old"]);
    assert_eq!(names(&s, BOB).await, ["python", "old"]);
    let (status, r) = post(
        &s,
        BOB,
        "/v1/exec",
        json!({"template": "mine", "code": "x"}),
    )
    .await;
    assert_eq!(
        (status, &r["error"]["code"]),
        (400, &json!("unknown_template")),
        "{r}"
    );
    let (status, r) = post(
        &s,
        ALICE,
        "/v1/exec",
        json!({"template": "mine", "code": "x"}),
    )
    .await;
    assert_eq!((status, &r["stdout"]), (200, &json!("x")), "{r}");
    let (status, _) = call(&s, "DELETE", ALICE, "/v1/templates/mine", None).await;
    assert_eq!(status, 204);
    assert_eq!(crate::core::builds::recorded(&dir), ["old"]);
    let _ = std::fs::remove_dir_all(&dir);
}
