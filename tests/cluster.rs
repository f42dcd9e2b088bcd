//! Many nodes behind the real HAProxy, with the real Redis (docs/cluster.md): clusters of
//! real `bud serve` processes started by `scripts/cluster.sh`, as a user starts one.
//!
//! - requests naming a session reach the node in its id; new work goes to the least
//!   loaded node; a node asked for another's session answers 421 naming it;
//! - a drain hands a node's sessions to another while a client keeps using one: no
//!   request fails and the session's state goes on; the drained node then takes no new
//!   work, and can be stopped;
//! - a node lost (SIGKILL): every other node goes on serving, one-shot jobs are answered,
//!   and the lost node's sessions answer 502 `node_down` naming it, never hang;
//! - E2B's SDK through the front: sandboxes on several nodes, each call on its node, the
//!   list of every node's sandboxes.
//!
//! `scripts/cluster.sh` installs HAProxy and Redis from Debian's packages if they are
//! missing (it needs root for that, and fails saying so otherwise).

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A cluster made by `scripts/cluster.sh up`, brought down on drop.
struct Cluster {
    dir: PathBuf,
    base: u16,
    front: String,
}

impl Cluster {
    /// `nodes` nodes from port `base` (front `base`, node I `base + I`).
    fn up(name: &str, base: u16, nodes: usize) -> Self {
        common::require_kvm();
        let dir = common::source_dir().join("target/tmp/cluster").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        let mut c = Cluster {
            dir,
            base,
            front: String::new(),
        };
        let out = c.script(&["up", &nodes.to_string()]);
        c.front = out.lines().last().unwrap_or_default().trim().to_owned();
        assert!(
            c.front.starts_with("http://"),
            "cluster.sh up printed {out:?}"
        );
        c
    }

    /// Runs `scripts/cluster.sh ARGS` for this cluster; its stdout (it must succeed).
    fn script(&self, args: &[&str]) -> String {
        let out = Command::new(common::source_dir().join("scripts/cluster.sh"))
            .args(args)
            .env("CLUSTER_DIR", &self.dir)
            .env("BASE_PORT", self.base.to_string())
            .env("BUD", env!("CARGO_BIN_EXE_bud"))
            .env("WORKERS", "1")
            .output()
            .expect("running scripts/cluster.sh");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "cluster.sh {args:?} failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    fn node(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.base as usize + i)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(common::source_dir().join("scripts/cluster.sh"))
            .arg("down")
            .env("CLUSTER_DIR", &self.dir)
            .env("BASE_PORT", self.base.to_string())
            .status();
    }
}

/// An answer: its status, the node that gave it (`X-Bud-Node`), its JSON body.
#[derive(Debug)]
struct Answer {
    status: u16,
    node: String,
    body: Value,
}

fn call(method: &str, url: &str, body: Option<Value>) -> Answer {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .build();
    let req = agent.request(method, url);
    let result = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    let resp = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {url}: {e}"),
    };
    let status = resp.status();
    let node = resp.header("x-bud-node").unwrap_or_default().to_owned();
    let text = resp.into_string().unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Answer { status, node, body }
}

/// The node an id names (`ses_NODE_HEX`).
fn node_of(id: &str) -> &str {
    id.split('_').nth(1).expect("an id with a node")
}

/// A new session through `base`; its id.
fn new_session(base: &str) -> String {
    let a = call("POST", &format!("{base}/v1/sessions"), Some(json!({})));
    assert_eq!(a.status, 201, "{a:?}");
    let id = a.body["id"].as_str().unwrap().to_owned();
    assert_eq!(
        node_of(&id),
        a.node,
        "the node that made it is the one in its id"
    );
    id
}

fn cell(base: &str, id: &str, code: &str) -> Answer {
    call(
        "POST",
        &format!("{base}/v1/sessions/{id}/exec"),
        Some(json!({ "code": code })),
    )
}

/// New sessions through the front until one is on node `want`.
fn session_on(front: &str, want: &str) -> String {
    for _ in 0..12 {
        let id = new_session(front);
        if node_of(&id) == want {
            return id;
        }
    }
    panic!("12 sessions through the front and none on {want}");
}

#[test]
fn requests_reach_the_node_in_their_id_and_new_work_the_least_loaded_node() {
    let c = Cluster::up("routing", 19100, 3);
    // Idle nodes take turns (round robin over equal weights).
    let ids: Vec<String> = (0..6).map(|_| new_session(&c.front)).collect();
    let nodes: BTreeSet<&str> = ids.iter().map(|i| node_of(i)).collect();
    assert_eq!(nodes, BTreeSet::from(["n1", "n2", "n3"]), "{ids:?}");
    for id in &ids {
        let a = cell(&c.front, id, &format!("mine = {id:?}"));
        assert_eq!(a.status, 200, "{a:?}");
    }
    for id in &ids {
        let a = cell(&c.front, id, "print(mine)");
        assert_eq!(
            (a.status, a.body["stdout"].clone()),
            (200, json!(format!("{id}\n")))
        );
        assert_eq!(a.node, node_of(id));
    }

    // A node asked for another node's session names that node.
    let on_n2 = ids.iter().find(|i| node_of(i) == "n2").unwrap();
    let a = cell(&c.node(1), on_n2, "print(1)");
    assert_eq!(a.status, 421, "{a:?}");
    assert_eq!(a.body["error"]["code"], "wrong_node");
    assert_eq!(a.body["error"]["node"], "n2");
    // An id of a node the front does not know reaches some node, which says so.
    let stranger = format!("ses_n9_{}", "0".repeat(32));
    let a = call("GET", &format!("{}/v1/sessions/{stranger}", c.front), None);
    assert_eq!(
        (a.status, a.body["error"]["node"].clone()),
        (421, json!("n9"))
    );

    // Node 1 busy (its one job thread, by a call the front never saw): new one-shot jobs
    // through the front go elsewhere, by its agent's weight (1 against the others' 100).
    let busy_url = c.node(1);
    let busy = std::thread::spawn(move || {
        let code = "import time; time.sleep(6); print('done')";
        call(
            "POST",
            &format!("{busy_url}/v1/exec"),
            Some(json!({ "code": code, "timeout_ms": 20_000 })),
        )
    });
    // The agent checks come every second (deploy/haproxy/gen-config.sh).
    std::thread::sleep(Duration::from_millis(2_500));
    let mut ran_on = Vec::new();
    for _ in 0..20 {
        let a = call(
            "POST",
            &format!("{}/v1/exec", c.front),
            Some(json!({ "code": "print(1)" })),
        );
        assert_eq!((a.status, a.body["stdout"].clone()), (200, json!("1\n")));
        ran_on.push(a.node);
    }
    // Weighted round robin gives a weight of 1 among 201 one turn in 201: at most one here.
    let on_busy = ran_on.iter().filter(|n| *n == "n1").count();
    assert!(on_busy <= 1, "{ran_on:?}");
    let a = busy.join().unwrap();
    assert_eq!((a.status, a.body["stdout"].clone()), (200, json!("done\n")));
}

#[test]
fn a_drain_hands_sessions_over_while_a_client_uses_them_and_no_request_fails() {
    let c = Cluster::up("drain", 19300, 3);
    let id = session_on(&c.front, "n1");
    let others: Vec<String> = (0..2).map(|_| new_session(&c.node(1))).collect();
    assert_eq!(cell(&c.front, &id, "x = 0").status, 200);

    // A client counting in the session, through the front, all along.
    let stop = Arc::new(AtomicBool::new(false));
    let (front, sid, halt) = (c.front.clone(), id.clone(), stop.clone());
    let client = std::thread::spawn(move || {
        let mut seen = Vec::new();
        while !halt.load(Ordering::SeqCst) {
            let a = cell(&front, &sid, "x += 1\nprint(x)");
            seen.push((a.status, a.body["stdout"].clone(), a.node));
        }
        seen
    });
    std::thread::sleep(Duration::from_millis(500));
    let out = c.script(&["drain", "1", "2"]);
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    let seen = client.join().unwrap();

    let report: Value = out
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON report in {out:?}"));
    let moved: BTreeSet<String> = report["moved"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    let mut all = BTreeSet::from([id.clone()]);
    all.extend(others);
    assert_eq!(moved, all, "{report}");
    assert_eq!(report["failed"], json!([]));
    // Every request answered 200, counting on: the state went along.
    assert!(seen.len() >= 3, "{seen:?}");
    for (i, (status, stdout, _)) in seen.iter().enumerate() {
        assert_eq!(
            (*status, stdout.clone()),
            (200, json!(format!("{}\n", i + 1)))
        );
    }
    assert_eq!(seen.last().unwrap().2, "n2", "{seen:?}");

    // The drained node takes no new work: new sessions land elsewhere, none fail.
    for _ in 0..4 {
        assert_ne!(node_of(&new_session(&c.front)), "n1");
    }
    let a = call("GET", &format!("{}/v1/health", c.node(1)), None);
    assert_eq!((a.status, a.body["draining"].clone()), (200, json!(true)));

    // Stopped, it is not missed: the front sends its old sessions to their new node.
    c.script(&["stop-node", "1"]);
    let a = cell(&c.front, &id, "x += 1\nprint(x)");
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.body["stdout"], json!(format!("{}\n", seen.len() + 1)));
    assert_eq!(a.node, "n2");
}

#[test]
fn a_lost_node_leaves_the_others_serving_and_its_sessions_answer_why() {
    let c = Cluster::up("loss", 19500, 3);
    let ids: Vec<String> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| session_on(&c.front, n))
        .collect();
    c.script(&["stop-node", "2"]);
    let started = Instant::now();
    // One-shot jobs go on; one sent to the lost node before the front noticed is sent
    // again elsewhere (a refused connection never started it).
    for _ in 0..12 {
        let a = call(
            "POST",
            &format!("{}/v1/exec", c.front),
            Some(json!({ "code": "print(2)" })),
        );
        assert_eq!(
            (a.status, a.body["stdout"].clone()),
            (200, json!("2\n")),
            "{a:?}"
        );
        assert_ne!(a.node, "n2");
    }
    let a = cell(&c.front, &ids[1], "print(1)");
    assert_eq!(a.status, 502, "{a:?}");
    assert_eq!(a.body["error"]["code"], "node_down", "{a:?}");
    assert_eq!(a.body["error"]["node"], "n2", "{a:?}");
    // Never hung: every answer came long before the client's 60 s timeout.
    assert!(started.elapsed() < Duration::from_secs(30));
    for id in [&ids[0], &ids[2]] {
        let a = cell(&c.front, id, "print('alive')");
        assert_eq!(
            (a.status, a.body["stdout"].clone()),
            (200, json!("alive\n"))
        );
    }
}

#[test]
fn e2b_sdk_through_the_front_reaches_every_sandbox_and_lists_every_node() {
    let c = Cluster::up("e2b", 19700, 3);
    let python = bud_guest::venv::ensure(
        &common::source_dir().join("build"),
        "compat-venv",
        &common::source_dir().join("server/tests/compat/requirements.txt"),
        &mut |l| eprintln!("[compat venv] {l}"),
    )
    .unwrap_or_else(|e| panic!("making the client venv failed: {e}"));
    let out = Command::new(python)
        .arg(common::source_dir().join("server/tests/compat/e2b_cluster.py"))
        .env("E2B_API_URL", &c.front)
        .env("E2B_SANDBOX_URL", &c.front)
        .env("E2B_API_KEY", "any")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "e2b_cluster.py: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<String> = serde_json::from_value(seen["ids"].clone()).unwrap();
    let nodes: BTreeSet<&str> = ids.iter().map(|i| node_of(i)).collect();
    assert!(nodes.len() >= 2, "sandboxes on one node only: {ids:?}");
    let echo: Vec<String> = (0..4).map(|i| format!("box {i}\n")).collect();
    assert_eq!(seen["echo"], json!(echo));
    let files: Vec<String> = (0..4).map(|i| format!("file {i}")).collect();
    assert_eq!(seen["files"], json!(files));
    let cells: Vec<Vec<String>> = (0..4).map(|i| vec![format!("{}\n", i * 10)]).collect();
    assert_eq!(seen["cells"], json!(cells));
    let mut sorted = ids.clone();
    sorted.sort();
    assert_eq!(seen["listed"], json!(sorted));
    assert_eq!(seen["listed_one"], json!([ids[2].clone()]));
    assert_eq!(seen["listed_after_kill"], json!([]));
}
