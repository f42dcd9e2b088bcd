//! Many sessions on one server (issue 60), through bud's own API on a real server (in this
//! process, on loopback) with real guests: a CI-sized count of live sessions made, used and
//! deleted, whose VMs are then closed rather than kept; and idle sessions parked to the
//! state directory (`--park-idle-s`), shown running, resumed by their next request, and
//! ended at their idle timeout while parked. The long run (1 000 sessions) is
//! `scripts/bench-density.sh`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TestServer, cell, session, show, test_config};
use serde_json::{Value, json};

/// Live sessions held at once by the count test: enough that keeping every ended session's
/// VM warm (what a server did before) is far past what it keeps now.
const SESSIONS: usize = 24;

/// An executor over the python template that keeps at most `max_idle` idle VMs.
fn executor(max_idle: usize) -> Arc<vmm::Executor> {
    common::require_kvm();
    let template = bud_templates::template(
        &common::template_options("python"),
        &mut |line: &str| eprintln!("[guest build] {line}"),
        None,
    )
    .expect("the python template");
    let opts = vmm::ExecutorOptions {
        pool_size: 2,
        max_idle,
        ..vmm::ExecutorOptions::default()
    };
    Arc::new(vmm::Executor::new(template, opts).expect("executor"))
}

/// The value of metric `name` (summed over its labels) in `/metrics`.
fn metric(s: &TestServer, name: &str) -> f64 {
    let text = s.get("/metrics").text().unwrap();
    text.lines()
        .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits (up to `limit`) until `done` holds; panics naming `what` otherwise.
fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < limit, "{what}: not after {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn many_live_sessions_each_keep_their_state_and_their_vms_are_closed_when_deleted() {
    let mut config = test_config();
    config.sessions.max_sessions = SESSIONS + 4;
    let max_idle = 4;
    let s = TestServer::with_executors(config, &[("python", executor(max_idle))]);
    let closed_before = metric(&s, "bud_vms_closed_total");

    let ids: Vec<String> = (0..SESSIONS).map(|_| session(&s, json!({}))).collect();
    for (i, id) in ids.iter().enumerate() {
        cell(&s, id, &format!("x = {i}"));
    }
    let live = metric(&s, "bud_sessions");
    let printed: Vec<String> = ids.iter().map(|id| cell(&s, id, "print(x)")).collect();
    for id in &ids {
        assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
    }
    // The VMs of the deleted sessions are closed, not kept warm: at most `max_idle` stay.
    wait_for(
        "idle VMs back to the executor's bound",
        Duration::from_secs(120),
        || metric(&s, "bud_live_clones") <= max_idle as f64,
    );
    let closed = metric(&s, "bud_vms_closed_total") - closed_before;

    assert_eq!(live, SESSIONS as f64);
    let want: Vec<String> = (0..SESSIONS).map(|i| format!("{i}\n")).collect();
    assert_eq!(printed, want);
    assert!(
        closed >= (SESSIONS - max_idle) as f64,
        "{closed} VMs closed of {SESSIONS} sessions deleted"
    );
    assert_eq!(metric(&s, "bud_sessions"), 0.0);
}

/// A server that parks sessions idle for two seconds, on a state directory of its own.
fn parking_server(name: &str) -> TestServer {
    let mut config = test_config();
    config.state_dir = Some(common::empty_dir("density", name));
    config.sessions.park_idle_s = 2;
    TestServer::with_executors(config, &[("python", common::executor())])
}

#[test]
fn an_idle_session_is_parked_shown_running_and_resumed_by_its_next_cell() {
    let s = parking_server("park");
    let id = session(&s, json!({}));
    cell(&s, &id, "x = 41");
    let file = s.state.state_dir().unwrap().paused().path(&id);

    wait_for("the session parked", Duration::from_secs(60), || {
        metric(&s, "bud_sessions_parked") == 1.0
    });
    let (status, parked) = show(&s, &id);
    let listed = s.get("/v1/sessions").json::<Value>().unwrap();
    let on_disk = file.exists();
    let live_while_parked = metric(&s, "bud_sessions");
    let printed = cell(&s, &id, "print(x + 1)");
    let (_, resumed) = show(&s, &id);

    assert_eq!(status, 200);
    assert_eq!(parked["state"], "running", "{parked}");
    assert_eq!(parked["parked"], true, "{parked}");
    assert_eq!(parked.get("paused_at"), None, "{parked}");
    assert_eq!(listed["sessions"][0]["id"], json!(id), "{listed}");
    assert_eq!(listed["sessions"][0]["state"], "running", "{listed}");
    assert!(on_disk, "no parked file at {}", file.display());
    assert_eq!(live_while_parked, 0.0);
    assert_eq!(printed, "42\n");
    assert_eq!(resumed["state"], "running", "{resumed}");
    assert_eq!(resumed.get("parked"), None, "{resumed}");
    assert!(metric(&s, "bud_sessions_parked_total") >= 1.0);
    assert!(metric(&s, "bud_sessions_resumed_total") >= 1.0);
}

#[test]
fn a_parked_session_ends_at_its_idle_timeout_as_a_running_one_would() {
    let s = parking_server("park-expiry");
    let id = session(&s, json!({"idle_timeout_s": 5}));
    cell(&s, &id, "x = 1");
    let file = s.state.state_dir().unwrap().paused().path(&id);
    wait_for("the session parked", Duration::from_secs(60), || {
        metric(&s, "bud_sessions_parked") == 1.0
    });

    wait_for("the parked session ended", Duration::from_secs(60), || {
        show(&s, &id).0 == 410
    });
    let (_, gone) = show(&s, &id);
    let (status, r) = s.post(&format!("/v1/sessions/{id}/exec"), &json!({"code": "x"}));

    assert_eq!(gone["error"]["code"], "session_gone", "{gone}");
    assert!(
        gone["error"]["message"]
            .as_str()
            .unwrap()
            .contains("idle_timeout"),
        "{gone}"
    );
    assert_eq!(status, 410, "{r}");
    assert!(!file.exists(), "{} still there", file.display());
    assert_eq!(metric(&s, "bud_sessions_parked"), 0.0);
}
