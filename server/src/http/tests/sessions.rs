//! Sessions' policies as a client sees them: the caps (429, 507), the queue of a busy
//! session and a delete under it, expiry (410), a drain without a target, the answers of a
//! server without a state directory, and a shutdown that ends every session.

use std::time::Duration;

use serde_json::{Value, json};

use super::{Served, test_config, until};

/// A cell of session `id`: its status and answer.
async fn cell(s: &Served, id: &str, code: &str) -> (u16, Value) {
    let path = format!("/v1/sessions/{id}/exec");
    s.post(&path, &json!({ "code": code })).await
}

/// Polls session `id` until `ready(info)` (its `GET`).
async fn wait_for(s: &Served, id: &str, what: &str, ready: impl Fn(&Value) -> bool) {
    let path = format!("/v1/sessions/{id}");
    let (path, ready) = (&path, &ready);
    until(what, || async move {
        let (_, info) = s.get(path).await;
        (ready(&info), info.to_string())
    })
    .await;
}

#[tokio::test]
async fn the_session_caps_answer_429_and_507() {
    let mut config = test_config();
    config.sessions.max_sessions = 2;
    config.sessions.max_memory_bytes = 4 << 20;
    let s = Served::with_config(config).await;
    let a = s.session(json!({})).await;
    let b = s.session(json!({})).await;

    let (full, too_many) = s.post("/v1/sessions", &json!({})).await;
    assert_eq!(s.delete(&format!("/v1/sessions/{b}")).await, 204);
    // From now on the fake guest's VMs hold 6 MiB each: `a` is past the cap.
    s.engine.set_vm_bytes(6 << 20);
    let (_, grew) = cell(&s, &a, "grow").await;
    let (over, out_of_memory) = s.post("/v1/sessions", &json!({})).await;
    let fork = format!("/v1/sessions/{a}/fork");
    let (fork_over, _) = s.post(&fork, &json!({"count": 1})).await;
    assert_eq!(s.delete(&format!("/v1/sessions/{a}")).await, 204);
    let again = s.session(json!({})).await;

    assert_eq!(
        (full, &too_many["error"]["code"]),
        (429, &json!("too_many_sessions")),
        "{too_many}"
    );
    assert_eq!(
        (over, &out_of_memory["error"]["code"]),
        (507, &json!("out_of_memory")),
        "{out_of_memory}"
    );
    assert_eq!(fork_over, 507);
    assert_eq!(grew["status"], "ok", "{grew}");
    assert_eq!(s.delete(&format!("/v1/sessions/{again}")).await, 204);
}

/// A waiting request whose client gives up leaves the queue; one waiting while its session
/// is deleted is answered 404 once the running cell has ended, never left hanging.
#[tokio::test]
async fn a_waiting_request_leaves_the_queue_with_its_client_and_learns_of_a_delete() {
    let s = Served::start().await;
    let id = s.session(json!({})).await;
    let exec = s.url(&format!("/v1/sessions/{id}/exec"));
    let post = |client: reqwest::Client, code: &str| {
        let req = client.post(&exec).json(&json!({ "code": code }));
        tokio::spawn(async move {
            let r = req.send().await;
            Some(super::answer(r.ok()?).await)
        })
    };
    let slow = post(s.client.clone(), "wait slow");
    wait_for(&s, &id, "the slow cell's start", |i| {
        i["busy"] == json!(true)
    })
    .await;
    // A client that waits 0.5 s and leaves.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let impatient = post(impatient, "1").await.unwrap();
    wait_for(&s, &id, "the queue emptied", |i| i["waiting"] == json!(0)).await;
    let waiter = post(s.client.clone(), "1");
    wait_for(&s, &id, "one waiting request", |i| i["waiting"] == json!(1)).await;
    // The delete waits for the running cell's end: the slow cell ends once the session
    // has left the registry.
    let deleted = {
        let req = s.client.delete(s.url(&format!("/v1/sessions/{id}")));
        tokio::spawn(async move { req.send().await.map(|r| r.status().as_u16()) })
    };
    let show = format!("/v1/sessions/{id}");
    let (show, served) = (&show, &s);
    until("the session left the registry", || async move {
        let (status, r) = served.get(show).await;
        (status != 200, r.to_string())
    })
    .await;
    s.engine.open("slow");
    let deleted = deleted.await.unwrap().expect("an answer");
    let (waited, answer) = waiter.await.unwrap().expect("an answer");

    assert!(impatient.is_none(), "the impatient client got an answer");
    assert_eq!(deleted, 204);
    assert_eq!(
        (waited, &answer["error"]["code"]),
        (404, &json!("no_session")),
        "{answer}"
    );
    assert_eq!(slow.await.unwrap().expect("an answer").0, 200);
}

#[tokio::test]
async fn idle_sessions_expire_with_410() {
    let s = Served::start().await;
    let id = s.session(json!({"idle_timeout_s": 1})).await;
    assert_eq!(cell(&s, &id, "1").await.0, 200);

    // Polled until the reaper ends it (1 s idle; it looks every second).
    let path = format!("/v1/sessions/{id}");
    let (path, served) = (&path, &s);
    until("the session expired", || async move {
        let (status, r) = served.get(path).await;
        (status != 200, r.to_string())
    })
    .await;
    let (status, r) = s.get(path).await;
    let (bad, refused) = s.post("/v1/sessions", &json!({"idle_timeout_s": 0})).await;

    assert_eq!(status, 410, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("idle_timeout"),
        "{r}"
    );
    assert_eq!(
        (bad, &refused["error"]["field"]),
        (400, &json!("idle_timeout_s"))
    );
}

#[tokio::test]
async fn shutdown_ends_every_session() {
    let mut s = Served::start().await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(s.session(json!({})).await);
    }
    assert_eq!(cell(&s, &ids[0], "x = 1").await.0, 200);

    s.shutdown().await;

    assert_eq!(s.state.sessions().count(), 0);
    assert_eq!(s.state.sessions().gauges().ended.get("shutdown"), Some(&3));
    assert_eq!(s.engine.counts().ended, 3);
}

#[tokio::test]
async fn without_a_state_directory_pause_and_snapshots_are_refused_with_why() {
    let s = Served::start().await;
    let id = s.session(json!({})).await;
    let pause = format!("/v1/sessions/{id}/pause");
    let (pause_status, pause) = s.post(&pause, &json!({})).await;
    let (auto_status, _) = s.post("/v1/sessions", &json!({"auto_pause": true})).await;
    let (list, _) = s.get("/v1/snapshots").await;

    assert_eq!(
        (pause_status, pause["error"]["code"].clone()),
        (501, json!("no_state_dir"))
    );
    assert_eq!((auto_status, list), (501, 501));
    assert_eq!(cell(&s, &id, "still").await.1["stdout"], "still");
}

#[tokio::test]
async fn a_drain_without_a_target_refuses_new_work_and_ends_the_sessions_left_at_its_deadline() {
    let mut config = test_config();
    config.cluster.node_id = Some("a".to_owned());
    let a = Served::with_config(config).await;
    let id = a.session(json!({})).await;
    assert!(id.starts_with("ses_a_"), "{id}");
    assert_eq!(cell(&a, &id, "x = 1").await.0, 200);

    let (status, report) = a.post("/v1/admin/drain", &json!({ "deadline_s": 1 })).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["node"], "a");
    assert_eq!(report["jobs_finished"], true);
    assert_eq!(report["ended"], json!([id]));
    assert_eq!(
        (report["moved"].clone(), report["failed"].clone()),
        (json!([]), json!([]))
    );
    assert!(report["drain_ms"].as_f64().unwrap() >= 1000.0, "{report}");

    let (_, health) = a.get("/v1/health").await;
    assert_eq!(
        (health["node"].clone(), health["draining"].clone()),
        (json!("a"), json!(true))
    );
    for (path, body) in [
        ("/v1/exec", json!({ "code": "x" })),
        ("/v1/sessions", json!({})),
    ] {
        let (status, r) = a.post(path, &body).await;
        assert_eq!(
            (status, r["error"]["code"].clone()),
            (503, json!("draining")),
            "{path}"
        );
    }
    let (status, r) = cell(&a, &id, "x").await;
    assert_eq!(
        (status, r["error"]["code"].clone()),
        (410, json!("session_gone"))
    );
    let message = r["error"]["message"].as_str().unwrap();
    assert!(message.contains("drained"), "{message}");

    let (status, r) = a.post("/v1/admin/drain", &json!({ "pause": true })).await;
    assert_eq!(
        (status, r["error"]["code"].clone()),
        (501, json!("no_state_dir"))
    );

    let (status, h) = a.post("/v1/admin/undrain", &json!({})).await;
    assert_eq!((status, h["draining"].clone()), (200, json!(false)));
    let (status, r) = a.exec(json!({ "code": "2" })).await;
    assert_eq!((status, r["stdout"].clone()), (200, json!("2")));
}

/// Under API keys a listing shows a key its own sessions only (an id is the way to a
/// session, so a listing must not hand out another key's).
#[tokio::test]
async fn a_key_lists_its_own_sessions_and_no_other_keys() {
    const ALICE: &str = "0123456789abcdef";
    const BOB: &str = "fedcba9876543210";
    let mut config = super::test_config();
    config.api_keys = Some(std::sync::Arc::new(
        crate::core::keys::ApiKeys::parse(&format!("alice {ALICE}\nbob {BOB}\n")).unwrap(),
    ));
    let s = Served::with_config(config).await;
    let mut ids = Vec::new();
    for key in [ALICE, BOB] {
        let (status, r) = s.post_as(Some(key), "/v1/sessions", &json!({})).await;
        assert_eq!(status, 201, "{r}");
        ids.push(r["id"].as_str().unwrap().to_owned());
    }
    let mut listed = Vec::new();
    for key in [ALICE, BOB] {
        let r = s
            .client
            .get(s.url("/v1/sessions"))
            .header("x-api-key", key)
            .send()
            .await
            .unwrap();
        let (status, body) = super::answer(r).await;
        assert_eq!(status, 200, "{body}");
        let ids: Vec<String> = body["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect();
        listed.push(ids);
    }

    assert_eq!(listed, [vec![ids[0].clone()], vec![ids[1].clone()]]);
    assert_eq!(s.state.sessions().count(), 2);
}
