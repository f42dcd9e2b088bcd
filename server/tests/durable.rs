//! Durable sessions through bud's own API on a real server (in this process, on loopback)
//! with a state directory: pause and resume (explicitly and by the next request), a
//! server stopped and started again on the same directory, snapshots and sessions started
//! from them, auto-pause, and a file found damaged. The crash test (a real `bud serve`
//! killed with SIGKILL) is `tests/durable_crash.rs`.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{TestServer, cell, session, show, test_config};
use serde_json::{Value, json};

/// An empty state directory of this test's own.
fn state_dir(name: &str) -> PathBuf {
    common::empty_dir("durable", name)
}

fn mode_of(p: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// A server on state directory `dir`, with the session key the servers of these tests
/// share (an export from one imports on another).
fn server_on(dir: &std::path::Path) -> TestServer {
    let mut config = test_config();
    config.state_dir = Some(dir.to_owned());
    config.session_key_file = Some(common::shared_key_file());
    TestServer::with_config(config)
}

/// The output of process `pid` of session `id` from its start, until it ends.
fn process_output(s: &TestServer, id: &str, pid: u64) -> String {
    let body = s
        .get(&format!(
            "/v1/sessions/{id}/processes/{pid}/output?from=start"
        ))
        .text()
        .unwrap();
    let mut out = String::new();
    for line in body.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        if v["type"] == "stdout" {
            out.push_str(v["data"].as_str().unwrap());
        }
    }
    out
}

#[test]
fn a_paused_session_resumes_at_its_next_request_with_its_state_and_processes() {
    let dir = state_dir("pause");
    let s = server_on(&dir);
    let id = session(&s, json!({}));
    cell(
        &s,
        &id,
        "import time\nx = 41\nopen('kept.txt', 'w').write('kept')\nt0 = time.monotonic()",
    );
    let (status, p) = s.post(
        &format!("/v1/sessions/{id}/processes"),
        &json!({"command": "read line; echo got $line", "stdin": true}),
    );
    assert_eq!(status, 201, "{p}");
    let pid = p["pid"].as_u64().unwrap();
    // The guest's clock just before the pause: it must not move while paused.
    let host_t0 = Instant::now();
    cell(&s, &id, "t0 = time.monotonic()");

    let (paused_status, paused) = s.post(&format!("/v1/sessions/{id}/pause"), &json!({}));
    let (again_status, again) = s.post(&format!("/v1/sessions/{id}/pause"), &json!({}));
    let (shown_status, shown) = show(&s, &id);
    let listed = s.get("/v1/sessions").json::<Value>().unwrap();
    let file = dir.join(format!("paused/{id}.bud"));
    let on_disk = file.exists();
    let file_copy = dir.join("mode-probe");
    std::fs::hard_link(&file, &file_copy).unwrap();
    // Paused for PAUSED: what the guest's clock reads since t0 is the time its VM ran (the
    // processes' pump runs it between requests, before the pause and after the resume until
    // this cell takes it), which on a loaded machine has reached 3.1 s. Both that and the
    // pause lie between the host's instants around the two cells, so a clock that stood
    // still while paused reads at most the host's time less the pause; one that moved reads
    // more (the bound holds on any load: no time is asserted).
    const PAUSED: Duration = Duration::from_millis(3000);
    std::thread::sleep(PAUSED);
    let seen = cell(
        &s,
        &id,
        "d = time.monotonic() - t0\nprint(x + 1, open('kept.txt').read(), round(d, 3))",
    );
    let host_elapsed = host_t0.elapsed();
    let stdin_status = common::client()
        .post(s.url(&format!("/v1/sessions/{id}/processes/{pid}/stdin")))
        .json(&json!({"data": "hi\n", "close": true}))
        .send()
        .unwrap()
        .status()
        .as_u16();
    let out = process_output(&s, &id, pid);
    let (after_status, after) = show(&s, &id);

    assert_eq!(paused_status, 200, "{paused}");
    assert_eq!(paused["state"], "paused");
    assert!(paused["memory_bytes"].as_u64().unwrap() > 0, "{paused}");
    assert_eq!(
        (again_status, again["error"]["code"].clone()),
        (409, json!("session_paused"))
    );
    assert_eq!(
        (shown_status, shown["state"].clone()),
        (200, json!("paused"))
    );
    assert!(
        listed["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["id"] == json!(id) && x["state"] == "paused"),
        "{listed}"
    );
    assert!(on_disk, "no file {}", file.display());
    assert_eq!(
        mode_of(&dir),
        0o700,
        "the state directory is readable by others"
    );
    assert_eq!(
        mode_of(&file_copy),
        0o600,
        "a paused session's file is readable by others"
    );
    let (seen, ran) = seen.trim_end().rsplit_once(' ').unwrap();
    assert_eq!(seen, "42 kept");
    let ran: f64 = ran.parse().unwrap();
    // 10 ms for the rounding and the two clocks' rates.
    let bound = (host_elapsed - PAUSED).as_secs_f64() + 0.01;
    assert!(
        ran <= bound,
        "the guest's clock moved {ran} s since t0, more than the {bound:.3} s the host saw \
         outside the {PAUSED:?} pause: it ran while the session was paused"
    );
    assert_eq!(stdin_status, 204);
    assert_eq!(out, "got hi\n");
    assert_eq!(
        (after_status, after["state"].clone()),
        (200, json!("running"))
    );
    assert!(!file.exists(), "the file of a resumed session stays");
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
}

#[test]
fn a_server_started_again_on_the_directory_serves_what_the_last_one_paused() {
    let dir = state_dir("restart");
    let (id, kept) = {
        let s = server_on(&dir);
        let kept = session(
            &s,
            json!({"metadata": {"owner": "a"}, "idle_timeout_s": 77}),
        );
        cell(
            &s,
            &kept,
            "import random\nsecret = random.random()\nprint(secret)",
        );
        let (status, r) = s.post(&format!("/v1/sessions/{kept}/pause"), &json!({}));
        assert_eq!(status, 200, "{r}");
        let ended = session(&s, json!({}));
        (ended, kept)
        // Dropped: a graceful stop ends the running session `ended` (no pause asked).
    };
    let s = server_on(&dir);
    let (shown_status, shown) = show(&s, &kept);
    let resumed = s.post(&format!("/v1/sessions/{kept}/resume"), &json!({}));
    let printed = cell(&s, &kept, "print(secret)");
    let (gone_status, _) = show(&s, &id);

    assert_eq!(shown_status, 200, "{shown}");
    assert_eq!(shown["state"], "paused");
    assert_eq!(shown["metadata"], json!({"owner": "a"}));
    assert_eq!(shown["idle_timeout_s"], 77);
    assert_eq!(resumed.0, 200, "{}", resumed.1);
    assert_eq!(resumed.1["state"], "running");
    assert!(printed.trim().parse::<f64>().is_ok(), "{printed}");
    assert_eq!(
        gone_status, 404,
        "a session ended at a graceful stop is simply gone"
    );
}

#[test]
fn snapshots_start_many_sessions_apart_from_each_other_and_are_deleted() {
    let dir = state_dir("snapshots");
    let s = server_on(&dir);
    let source = session(&s, json!({"metadata": {"k": "v"}}));
    cell(&s, &source, "import os, random\nbase = 'from the snapshot'");
    let (status, snap) = s.post(&format!("/v1/sessions/{source}/snapshots"), &json!({}));
    assert_eq!(status, 201, "{snap}");
    let snap_id = snap["id"].as_str().unwrap().to_owned();
    let a = session(&s, json!({"snapshot": snap_id}));
    let b = session(&s, json!({"snapshot": snap_id}));
    let probe = "print(base, random.random(), os.urandom(8).hex())";
    let from_a = cell(&s, &a, probe);
    let from_b = cell(&s, &b, probe);
    let source_goes_on = cell(&s, &source, "print(base)");
    let listed = s.get("/v1/snapshots").json::<Value>().unwrap();
    let (a_status, a_info) = show(&s, &a);
    let deleted = s.delete(&format!("/v1/snapshots/{snap_id}"));
    let deleted_again = s.delete(&format!("/v1/snapshots/{snap_id}"));
    let (after_status, after) = s.post("/v1/sessions", &json!({"snapshot": snap_id}));
    let a_goes_on = cell(&s, &a, "print(base)");

    assert!(from_a.starts_with("from the snapshot "), "{from_a}");
    assert!(from_b.starts_with("from the snapshot "), "{from_b}");
    assert_ne!(
        from_a, from_b,
        "two sessions of one snapshot share random state"
    );
    assert_eq!(source_goes_on, "from the snapshot\n");
    assert_eq!(listed["snapshots"][0]["id"], json!(snap_id), "{listed}");
    assert_eq!(listed["snapshots"][0]["source"], json!(source));
    assert_eq!(
        (a_status, a_info["metadata"].clone()),
        (200, json!({"k": "v"}))
    );
    assert_eq!(a_info["parent"], json!(source));
    assert_eq!((deleted, deleted_again), (204, 404));
    assert_eq!(
        (after_status, after["error"]["code"].clone()),
        (404, json!("no_snapshot"))
    );
    assert_eq!(a_goes_on, "from the snapshot\n");
}

#[test]
fn a_session_that_asked_for_it_is_paused_at_its_idle_timeout_not_ended() {
    let dir = state_dir("autopause");
    let s = server_on(&dir);
    let id = session(&s, json!({"idle_timeout_s": 1, "auto_pause": true}));
    cell(&s, &id, "y = 'still here'");
    let t = Instant::now();
    let state = loop {
        let (_, v) = show(&s, &id);
        if v["state"] == "paused" || t.elapsed() > Duration::from_secs(30) {
            break v;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let printed = cell(&s, &id, "print(y)");

    assert_eq!(state["state"], "paused", "{state}");
    assert_eq!(state["auto_pause"], true);
    assert_eq!(printed, "still here\n");
}

#[test]
fn a_damaged_paused_file_is_set_aside_at_start_and_a_corrupt_page_is_refused_at_resume() {
    let dir = state_dir("damaged");
    let (torn, flipped) = {
        let s = server_on(&dir);
        let a = session(&s, json!({}));
        let b = session(&s, json!({}));
        for id in [&a, &b] {
            cell(&s, id, "z = bytes(1 << 20)");
            assert_eq!(
                s.post(&format!("/v1/sessions/{id}/pause"), &json!({})).0,
                200
            );
        }
        (a, b)
    };
    let torn_file = dir.join(format!("paused/{torn}.bud"));
    let len = std::fs::metadata(&torn_file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&torn_file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let flipped_file = dir.join(format!("paused/{flipped}.bud"));
    let mut bytes = std::fs::read(&flipped_file).unwrap();
    bytes[5000] ^= 0x40;
    std::fs::write(&flipped_file, bytes).unwrap();

    let s = server_on(&dir);
    let (torn_status, _) = show(&s, &torn);
    let (flipped_status, flipped_info) = show(&s, &flipped);
    let (resume_status, resumed) = s.post(
        &format!("/v1/sessions/{flipped}/exec"),
        &json!({"code": "print(1)"}),
    );
    let (later_status, later) = show(&s, &flipped);

    assert_eq!(
        torn_status, 404,
        "a torn file was taken for a paused session"
    );
    assert!(dir.join(format!("damaged/paused-{torn}.bud")).exists());
    assert_eq!(
        (flipped_status, flipped_info["state"].clone()),
        (200, json!("paused"))
    );
    assert_eq!(
        (resume_status, resumed["error"]["code"].clone()),
        (410, json!("unresumable")),
        "{resumed}"
    );
    assert!(
        resumed["error"]["message"]
            .as_str()
            .unwrap()
            .contains("checksum"),
        "{resumed}"
    );
    assert_eq!(
        (later_status, later["error"]["code"].clone()),
        (410, json!("session_gone"))
    );
}

#[test]
fn the_e2b_sdk_pauses_connects_snapshots_and_auto_pauses_sandboxes() {
    let dir = state_dir("e2b");
    let s = server_on(&dir);
    let seen = common::clients::client_script(
        "e2b_durable.py",
        &[],
        &common::clients::e2b_env(&s, "e2b_any"),
    );

    assert_eq!(
        seen,
        json!({
            "pause": true,
            "pause_again": false,
            "state": "paused",
            "listed": [true, false],
            "while_paused": ["SandboxNotRunningException", "TimeoutException"],
            "resumed": [["42\n"], "kept", "running"],
            "from_snapshot": ["41", "41", true],
            "snapshots_listed": true,
            "snapshot_deleted": [true, false],
            "auto_paused": "paused",
            "auto_resumed": ["paused at its timeout\n"],
            "auto_resume": ["paused", ["woken by a call\n"], "running"],
            "async": [true, ["async\n"]],
        })
    );
}

#[test]
fn an_e2b_sandbox_paused_before_a_restart_is_found_and_resumed_with_its_token() {
    let dir = state_dir("e2b-restart");
    let (id, token) = {
        let s = server_on(&dir);
        let (status, made) = s.post(
            "/v2/sandboxes",
            &json!({"templateID": "base", "timeout": 120, "metadata": {"m": "1"}}),
        );
        assert_eq!(status, 201, "{made}");
        let id = made["sandboxID"].as_str().unwrap().to_owned();
        let pause = common::client()
            .post(s.url(&format!("/sandboxes/{id}/pause")))
            .json(&json!({}))
            .send()
            .unwrap()
            .status()
            .as_u16();
        assert_eq!(pause, 204);
        (id, made["envdAccessToken"].clone())
    };
    let s = server_on(&dir);
    let info = s.get(&format!("/sandboxes/{id}")).json::<Value>().unwrap();
    let (status, connected) = s.post(
        &format!("/v2/sandboxes/{id}/connect"),
        &json!({"timeout": 60}),
    );
    let (again_status, _) = s.post(
        &format!("/v2/sandboxes/{id}/connect"),
        &json!({"timeout": 60}),
    );

    assert_eq!(info["state"], "paused", "{info}");
    assert_eq!(info["templateID"], "base");
    assert_eq!(info["metadata"], json!({"m": "1"}));
    assert_eq!(status, 201, "{connected}");
    assert_eq!(connected["envdAccessToken"], token);
    assert_eq!(again_status, 200, "a running sandbox's connect is 200");
}

#[test]
fn pauses_resumes_and_snapshots_are_counted_and_recorded_in_the_audit_trail() {
    let dir = state_dir("audit");
    let log = dir.join("audit.jsonl");
    let mut config = test_config();
    config.state_dir = Some(dir.join("state"));
    config.audit = Some(bud_server::core::audit::AuditConfig {
        path: log.clone(),
        content: false,
        required: true,
    });
    let s = TestServer::with_config(config);
    let id = session(&s, json!({}));
    cell(&s, &id, "a = 1");
    assert_eq!(
        s.post(&format!("/v1/sessions/{id}/pause"), &json!({})).0,
        200
    );
    assert_eq!(
        s.post(&format!("/v1/sessions/{id}/resume"), &json!({})).0,
        200
    );
    let (status, snap) = s.post(&format!("/v1/sessions/{id}/snapshots"), &json!({}));
    assert_eq!(status, 201, "{snap}");
    let metrics = s.get("/metrics").text().unwrap();
    let mut s = s;
    s.shutdown(); // the audit writer has flushed every record
    let kinds: Vec<(String, Option<String>, Option<String>)> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["session"] == json!(id))
        .map(|r| {
            (
                r["kind"].as_str().unwrap().to_owned(),
                r["route"].as_str().map(str::to_owned),
                r["stdout"].as_str().map(str::to_owned),
            )
        })
        .collect();

    for line in [
        "bud_sessions_paused 0",
        "bud_snapshots 1",
        "bud_sessions_paused_total 1",
        "bud_sessions_resumed_total 1",
        "bud_snapshots_taken_total 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no {line:?} in\n{metrics}"
        );
    }
    assert_eq!(
        kinds,
        vec![
            (
                "cell".to_owned(),
                Some("/v1/sessions/{id}/exec".to_owned()),
                None
            ),
            ("pause".to_owned(), Some("pause".to_owned()), None),
            ("resume".to_owned(), Some("resume".to_owned()), None),
            (
                "snapshot".to_owned(),
                Some("snapshot".to_owned()),
                snap["id"].as_str().map(str::to_owned)
            ),
        ]
    );
}

#[test]
fn a_paused_session_exported_from_one_server_is_imported_and_resumed_on_another() {
    let here = server_on(&state_dir("export-here"));
    let there = server_on(&state_dir("export-there"));
    let id = session(&here, json!({"metadata": {"moved": true}}));
    cell(
        &here,
        &id,
        "moved = 'from the other server'\nopen('f.txt', 'w').write('file too')",
    );
    let running = here
        .get(&format!("/v1/sessions/{id}/export"))
        .status()
        .as_u16();
    assert_eq!(
        here.post(&format!("/v1/sessions/{id}/pause"), &json!({})).0,
        200
    );
    let exported = here.get(&format!("/v1/sessions/{id}/export"));
    assert_eq!(exported.status().as_u16(), 200);
    let file = exported.bytes().unwrap().to_vec();
    let import = |s: &TestServer, body: Vec<u8>| {
        s.post_raw("/v1/sessions/import", "application/octet-stream", body)
    };

    let (status, info) = import(&there, file.clone());
    let (again, again_r) = import(&there, file.clone());
    let mut torn = file.clone();
    torn.truncate(file.len() - 10);
    let (torn_status, torn_r) = import(&there, torn);
    let mut flipped = file.clone();
    flipped[100] ^= 1;
    let (flipped_status, flipped_r) = import(&there, flipped);
    let printed = cell(&there, &id, "print(moved, open('f.txt').read())");

    assert_eq!(running, 409);
    assert_eq!(status, 201, "{info}");
    assert_eq!(
        (info["state"].clone(), info["metadata"].clone()),
        (json!("paused"), json!({"moved": true}))
    );
    assert_eq!(
        (again, again_r["error"]["code"].clone()),
        (409, json!("session_exists"))
    );
    assert_eq!(torn_status, 400, "{torn_r}");
    assert_eq!(flipped_status, 400, "{flipped_r}");
    assert!(
        flipped_r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("checksum"),
        "{flipped_r}"
    );
    assert_eq!(printed, "from the other server file too\n");
    let leftovers: Vec<_> =
        std::fs::read_dir(there.state.state_dir().unwrap().root().join("paused"))
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
    assert!(leftovers.is_empty(), "files left in paused/: {leftovers:?}");
}

#[test]
fn a_graceful_stop_with_pause_on_shutdown_pauses_running_sessions_for_the_next_server() {
    let dir = state_dir("shutdown");
    let id = {
        let mut config = test_config();
        config.state_dir = Some(dir.clone());
        config.session_key_file = Some(common::shared_key_file());
        config.pause_on_shutdown = true;
        let mut s = TestServer::with_config(config);
        let id = session(&s, json!({}));
        cell(&s, &id, "kept = 'across the stop'");
        s.shutdown();
        id
    };
    let s = server_on(&dir);
    let (status, shown) = show(&s, &id);
    let printed = cell(&s, &id, "print(kept)");

    assert_eq!(
        (status, shown["state"].clone()),
        (200, json!("paused")),
        "{shown}"
    );
    assert_eq!(printed, "across the stop\n");
}

/// Waits (up to 30 s) until watcher `wid` of session `id` reports `want`.
fn wait_for_change(s: &TestServer, id: &str, wid: u64, want: Value) {
    let url = format!("/v1/sessions/{id}/watchers/{wid}/changes");
    let mut seen: Vec<Value> = Vec::new();
    for _ in 0..300 {
        let r = s.get(&url);
        assert_eq!(r.status().as_u16(), 200, "{id}'s watcher {wid}");
        let r: Value = r.json().unwrap();
        seen.extend(r["changes"].as_array().unwrap().iter().cloned());
        if seen.contains(&want) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{want} not in {seen:?} ({id}'s watcher {wid})");
}

#[test]
fn a_watcher_goes_on_after_a_resume_and_in_a_fork_child() {
    let dir = state_dir("watchers");
    let s = server_on(&dir);
    let id = session(&s, json!({}));
    let (status, w) = s.post(
        &format!("/v1/sessions/{id}/watchers"),
        &json!({"path": ".", "recursive": true}),
    );
    assert_eq!(status, 201, "{w}");
    let wid = w["id"].as_u64().unwrap();
    assert_eq!(
        s.post(&format!("/v1/sessions/{id}/pause"), &json!({})).0,
        200
    );
    cell(&s, &id, "open('after_resume.txt', 'w').write('x')");
    wait_for_change(
        &s,
        &id,
        wid,
        json!({"type": "create", "path": "after_resume.txt"}),
    );
    let (status, forked) = s.post(&format!("/v1/sessions/{id}/fork"), &json!({"count": 1}));
    assert_eq!(status, 201, "{forked}");
    let child = forked["ids"][0].as_str().unwrap().to_owned();
    cell(&s, &child, "open('in_the_child.txt', 'w').write('x')");
    wait_for_change(
        &s,
        &child,
        wid,
        json!({"type": "create", "path": "in_the_child.txt"}),
    );
}

#[test]
fn a_session_paused_before_its_template_was_rebuilt_resumes_on_the_pinned_old_one() {
    let dir = state_dir("old-template");
    let current = common::executor();
    let key = current.template().key();
    let root = current.template().dir().parent().unwrap().to_owned();
    let (id, holder) = {
        let s = server_on(&dir);
        let id = session(&s, json!({}));
        cell(&s, &id, "x = 'made on the old template'");
        assert_eq!(
            s.post(&format!("/v1/sessions/{id}/pause"), &json!({})).0,
            200
        );
        let holder = s.state.state_dir().unwrap().holder().to_owned();
        (id, holder)
    };
    let pin = root.join(&key).join("pins").join(&holder);
    let pinned_while_paused = pin.exists();
    // A rebuild, as the server sees it: its template `python` now has another key (here
    // the same files under another name, hard-linked), the old one stays on disk.
    let rebuilt = root.join(format!("{key}-rebuilt-{}", std::process::id()));
    std::fs::create_dir_all(&rebuilt).unwrap();
    for f in ["state", "memory"] {
        std::fs::hard_link(root.join(&key).join(f), rebuilt.join(f)).unwrap();
    }
    let opts = vmm::ExecutorOptions {
        pool_size: 0,
        ..vmm::ExecutorOptions::default()
    };
    let new = vmm::Executor::new(vmm::Template::load(&rebuilt).unwrap(), opts).unwrap();
    let mut config = test_config();
    config.state_dir = Some(dir.clone());
    config.session_key_file = Some(common::shared_key_file());
    let s = TestServer::with_executors(config, &[("python", std::sync::Arc::new(new))]);
    let printed = cell(&s, &id, "print(x)");
    let pinned_after = pin.exists();
    drop(s);
    std::fs::remove_dir_all(&rebuilt).unwrap();

    assert!(pinned_while_paused, "no pin {}", pin.display());
    assert_eq!(printed, "made on the old template\n");
    assert!(
        !pinned_after,
        "the pin stayed after the last pause on it resumed"
    );
}

#[test]
fn a_session_imported_where_it_had_ended_before_is_served_not_hidden_by_its_end() {
    let here = server_on(&state_dir("reimport-here"));
    let there = server_on(&state_dir("reimport-there"));
    let id = session(&here, json!({"idle_timeout_s": 1}));
    cell(&here, &id, "back = 'again'");
    assert_eq!(
        here.post(&format!("/v1/sessions/{id}/pause"), &json!({})).0,
        200
    );
    let file = here
        .get(&format!("/v1/sessions/{id}/export"))
        .bytes()
        .unwrap()
        .to_vec();
    let import =
        |body: Vec<u8>| there.post_raw("/v1/sessions/import", "application/octet-stream", body);
    assert_eq!(import(file.clone()).0, 201);
    cell(&there, &id, "print(back)");
    // Its idle timeout ends it there: a tombstone says why.
    let t = Instant::now();
    while show(&there, &id).0 != 410 {
        assert!(t.elapsed() < Duration::from_secs(30), "never expired");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, r) = import(file);
    let printed = cell(&there, &id, "print(back)");

    assert_eq!(status, 201, "{r}");
    assert_eq!(printed, "again\n");
}

/// The kinds of session `id`'s trace on `s`, and its check.
fn trace_of(s: &TestServer, id: &str) -> (Vec<Value>, Value) {
    let r = s.get(&format!("/v1/sessions/{id}/trace"));
    assert_eq!(r.status().as_u16(), 200);
    let events = r
        .text()
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let check = s
        .get(&format!("/v1/sessions/{id}/trace/verify"))
        .json()
        .unwrap();
    (events, check)
}

fn kinds(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["kind"].as_str().unwrap()).collect()
}

#[test]
fn an_exported_session_carries_its_trace_and_the_importing_server_goes_on_with_it() {
    let here = server_on(&state_dir("trace-export-here"));
    let there = server_on(&state_dir("trace-export-there"));
    let id = session(&here, json!({}));
    cell(&here, &id, "print('before the move')");
    assert_eq!(
        here.post(&format!("/v1/sessions/{id}/pause"), &json!({})).0,
        200
    );
    let file = here
        .get(&format!("/v1/sessions/{id}/export"))
        .bytes()
        .unwrap()
        .to_vec();
    let (before, _) = trace_of(&here, &id);

    let (status, r) = there.post_raw("/v1/sessions/import", "application/octet-stream", file);
    cell(&there, &id, "print('after the move')");
    assert_eq!(there.delete(&format!("/v1/sessions/{id}")), 204);
    let (after, check) = trace_of(&there, &id);

    assert_eq!(status, 201, "{r}");
    let carried = before.len() - 1; // the `paused` event came after the file was written
    assert_eq!(kinds(&before).last(), Some(&"paused"), "{before:?}");
    let walk = before
        .iter()
        .find(|e| e["kind"] == "files_changed")
        .expect("a checkpoint");
    assert_eq!(walk["data"]["why"], "paused", "{walk}");
    assert_eq!(
        after[..carried],
        before[..carried],
        "the carried events, byte for byte"
    );
    let moved = kinds(&after[carried..]);
    assert_eq!(moved.first(), Some(&"imported"), "{moved:?}");
    assert_eq!(after[carried]["data"]["kept"], true);
    assert!(moved.contains(&"resumed"), "{moved:?}");
    let last_cell = after.iter().rev().find(|e| e["kind"] == "cell").unwrap();
    assert_eq!(last_cell["data"]["stdout"], "after the move\n");
    assert_eq!(&moved[moved.len() - 2..], ["ended", "sealed"]);
    assert_eq!(
        (&check["ok"], &check["sealed"]),
        (&json!(true), &json!(true)),
        "{check}"
    );
    assert_eq!(check["events"], after.len());
}
