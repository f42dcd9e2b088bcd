//! Draining a node (docs/cluster.md) on real servers in this process, on loopback: with
//! `pause` it leaves its sessions on disk for the next server; with a target it hands over live and paused sessions (and E2B sandboxes) to another node,
//! which serves them with their state, while the drained node forwards their requests.
//! A drain with no target is tested on the test engine (`src/http/tests/sessions.rs`).
//! The same through HAProxy with `bud serve` processes is `tests/cluster.rs`.

mod common;

use std::path::PathBuf;

use common::{TestServer, test_config};
use serde_json::{Value, json};

fn state_dir(name: &str) -> PathBuf {
    common::empty_dir("drain", name)
}

/// A node with the session key the nodes of these tests share (a hand-over imports the
/// drained node's files).
fn node(id: &str, dir: Option<PathBuf>) -> TestServer {
    let mut config = test_config();
    config.cluster.node_id = Some(id.to_owned());
    config.state_dir = dir;
    config.session_key_file = Some(common::shared_key_file());
    TestServer::with_config(config)
}

fn session(s: &TestServer) -> String {
    let (status, r) = s.post("/v1/sessions", &json!({}));
    assert_eq!(status, 201, "{r}");
    r["id"].as_str().unwrap().to_owned()
}

fn cell(s: &TestServer, id: &str, code: &str) -> (u16, Value) {
    s.post(&format!("/v1/sessions/{id}/exec"), &json!({ "code": code }))
}

#[test]
fn a_drain_that_pauses_leaves_its_sessions_on_disk_for_the_next_server() {
    let dir = state_dir("pause");
    let id = {
        let a = node("a", Some(dir.clone()));
        let id = session(&a);
        assert_eq!(cell(&a, &id, "z = 'across'").0, 200);
        let (status, r) = a.post(
            "/v1/admin/drain",
            &json!({ "pause": true, "to": "http://127.0.0.1:1" }),
        );
        assert_eq!((status, r["error"]["field"].clone()), (400, json!("pause")));
        let (status, report) = a.post("/v1/admin/drain", &json!({ "pause": true }));
        assert_eq!(status, 200, "{report}");
        assert_eq!(report["paused"], json!([id]));
        assert_eq!(report["ended"], json!([]));
        id
    };
    let again = node("a", Some(dir));
    let (status, r) = cell(&again, &id, "print(z)");
    assert_eq!((status, r["stdout"].clone()), (200, json!("across\n")));
}

#[test]
fn a_drain_hands_live_and_paused_sessions_to_another_node_which_serves_them() {
    let a = node("a", Some(state_dir("a")));
    let b = node("b", Some(state_dir("b")));
    let live = session(&a);
    assert_eq!(cell(&a, &live, "x = 'kept'").0, 200);
    let paused = session(&a);
    assert_eq!(cell(&a, &paused, "y = 7").0, 200);
    let (status, r) = a.post(&format!("/v1/sessions/{paused}/pause"), &json!({}));
    assert_eq!(status, 200, "{r}");
    let (status, sbx) = a.post("/sandboxes", &json!({ "templateID": "python" }));
    assert_eq!(status, 201, "{sbx}");
    let sandbox = sbx["sandboxID"].as_str().unwrap().to_owned();

    // Bad targets are refused before anything happens.
    for (to, why) in [
        (a.url(""), "is this node"),
        ("http://127.0.0.1:1".to_owned(), "not ready"),
        ("https://x".to_owned(), "not an http:// URL"),
    ] {
        let (status, r) = a.post("/v1/admin/drain", &json!({ "to": to }));
        assert_eq!(status, 400, "{to}: {r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(message.contains(why), "{to}: {message}");
    }
    let (status, r) = a.post("/v1/admin/drain", &json!({ "deadline_s": 0 }));
    assert_eq!(
        (status, r["error"]["field"].clone()),
        (400, json!("deadline_s"))
    );
    let health: Value = a.get("/v1/health").json().unwrap();
    assert_eq!(
        health["draining"], false,
        "a refused drain leaves the node open"
    );

    let (status, report) = a.post("/v1/admin/drain", &json!({ "to": b.url("") }));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["to_node"], "b");
    let mut moved: Vec<&str> = report["moved"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["node"], "b");
            m["id"].as_str().unwrap()
        })
        .collect();
    moved.sort();
    let mut all = vec![live.as_str(), paused.as_str(), sandbox.as_str()];
    all.sort();
    assert_eq!(moved, all, "{report}");

    // The drained node forwards; the new one serves them with their state.
    let resp = common::client()
        .post(a.url(&format!("/v1/sessions/{live}/exec")))
        .json(&json!({ "code": "print(x)" }))
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["x-bud-node"], "b");
    let r: Value = resp.json().unwrap();
    assert_eq!(r["stdout"], "kept\n");
    let (status, r) = cell(&b, &paused, "print(y)");
    assert_eq!((status, r["stdout"].clone()), (200, json!("7\n")));
    let info: Value = b.get(&format!("/sandboxes/{sandbox}")).json().unwrap();
    assert_eq!(info["sandboxID"], sandbox, "{info}");
    // Nothing of them is left on the drained node's disk.
    let listed: Value = a.get("/v1/sessions").json().unwrap();
    assert_eq!(listed["sessions"], json!([]), "{listed}");

    // Handed back, a session is served where it is again, not forwarded to where it was
    // (each node would forward it to the other).
    let (status, _) = a.post("/v1/admin/undrain", &json!({}));
    assert_eq!(status, 200);
    let (status, report) = b.post("/v1/admin/drain", &json!({ "to": a.url("") }));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["failed"], json!([]), "{report}");
    let resp = common::client()
        .post(a.url(&format!("/v1/sessions/{live}/exec")))
        .timeout(std::time::Duration::from_secs(20))
        .json(&json!({ "code": "print(x)" }))
        .send()
        .expect("an answer, not a forwarding loop");
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["x-bud-node"], "a");
    let r: Value = resp.json().unwrap();
    assert_eq!(r["stdout"], "kept\n");

    // A node asked for an id of another node that it does not hold names that node.
    let stranger = format!("ses_a_{}", "0".repeat(32));
    let (status, r) = cell(&b, &stranger, "print(1)");
    assert_eq!(status, 421, "{r}");
    assert_eq!(
        (r["error"]["code"].clone(), r["error"]["node"].clone()),
        (json!("wrong_node"), json!("a"))
    );
}
