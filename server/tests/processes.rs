//! A sandbox's background processes against a real server on loopback, over the real
//! template on the real VMM: through bud's native API (start, list, output streams from the
//! start and from now, stdin, signals, kill, limits, errors, a session that ends under its
//! processes) and through E2B's SDK, sync and async (`compat/e2b_processes.py`). Needs
//! /dev/kvm (and PyPI for the SDK's venv).

mod common;

use std::io::{BufRead, BufReader};
use std::time::Duration;

use bud_server::Config;
use common::clients::{client_script, e2b_env};
use common::*;
use serde_json::{Value, json};

fn start(s: &TestServer, id: &str, body: Value) -> Value {
    let (status, r) = s.post(&format!("/v1/sessions/{id}/processes"), &body);
    assert_eq!(status, 201, "{r}");
    r
}

/// The NDJSON lines of a process's output stream, up to and with its `end` line.
fn output(s: &TestServer, id: &str, pid: u64, from: &str) -> Vec<Value> {
    let r = client()
        .get(s.url(&format!(
            "/v1/sessions/{id}/processes/{pid}/output?from={from}"
        )))
        .send()
        .expect("request failed");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["content-type"], "application/x-ndjson");
    BufReader::new(r)
        .lines()
        .map(|l| serde_json::from_str(&l.expect("reading the stream")).expect("a JSON line"))
        .collect()
}

fn stdout_of(lines: &[Value]) -> String {
    lines
        .iter()
        .filter(|l| l["type"] == "stdout")
        .map(|l| l["data"].as_str().unwrap())
        .collect()
}

/// POSTs `body` as JSON; the status and the body's JSON (null when it has none: 204).
fn post(s: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(s.url(path))
        .json(body)
        .send()
        .expect("request failed");
    let status = r.status().as_u16();
    let text = r.text().expect("reading the answer");
    let v = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).expect("the answer is not JSON")
    };
    (status, v)
}

#[test]
fn a_background_process_streams_its_output_and_end_to_any_number_of_clients() {
    let s = TestServer::start();
    let id = session(&s, json!({"env": {"WHO": "session"}}));
    let p = start(
        &s,
        &id,
        json!({
            "command": "echo \"$WHO $EXTRA\"; pwd; echo oops >&2; printf '\\377\\n'; exit 5",
            "env": {"EXTRA": "extra"},
            "cwd": "/usr",
            "tag": "first"
        }),
    );
    assert_eq!(p["status"], "running", "{p}");
    assert_eq!(p["tag"], "first");
    assert!(
        p["command"].as_str().unwrap().starts_with("echo \"$WHO"),
        "{p}"
    );
    let pid = p["pid"].as_u64().unwrap();
    let lines = output(&s, &id, pid, "start");
    assert_eq!(stdout_of(&lines), "session extra\n/usr\n\u{fffd}\n");
    let binary: Vec<&Value> = lines
        .iter()
        .filter(|l| l.get("data_b64").is_some())
        .collect();
    assert_eq!(binary.len(), 1, "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l["type"] == "stderr" && l["data"] == "oops\n")
    );
    let end = lines.last().unwrap();
    assert_eq!(
        (
            &end["type"],
            &end["status"],
            &end["exit_code"],
            &end["signal"]
        ),
        (&json!("end"), &json!("exited"), &json!(5), &Value::Null),
        "{end}"
    );
    // A second client, after the end: the same record.
    assert_eq!(output(&s, &id, pid, "start"), lines);
    let (status, listed) = s.post(&format!("/v1/sessions/{id}/exec"), &json!({"code": "1"}));
    assert_eq!(status, 200, "{listed}");
    let all: Value = s
        .get(&format!("/v1/sessions/{id}/processes"))
        .json()
        .unwrap();
    assert_eq!(all["processes"][0]["pid"], json!(pid));
    assert_eq!(all["processes"][0]["status"], "exited");
    let one: Value = s
        .get(&format!("/v1/sessions/{id}/processes/{pid}"))
        .json()
        .unwrap();
    assert_eq!(one["exit_code"], 5);
    assert!(
        one["duration_ms"].as_f64().is_some_and(|d| d > 0.0),
        "{one}"
    );
    assert_eq!(p["duration_ms"], Value::Null, "running: {p}");
}

#[test]
fn stdin_signals_kill_and_cells_beside_a_running_process() {
    let s = TestServer::start();
    let id = session(&s, json!({}));
    let reader = start(
        &s,
        &id,
        json!({"command": "while read -r l; do echo \"got $l\"; done; echo eof", "stdin": true}),
    );
    let rpid = reader["pid"].as_u64().unwrap();
    let base = format!("/v1/sessions/{id}/processes/{rpid}");
    let (st, r) = post(&s, &format!("{base}/stdin"), &json!({"data": "one\n"}));
    assert_eq!(st, 204, "{r:?}");
    // A cell runs meanwhile and sees the process.
    let (st, r) = s.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({"language": "shell", "code": format!("kill -0 {rpid} && echo alive")}),
    );
    assert_eq!((st, &r["stdout"]), (200, &json!("alive\n")), "{r}");
    let (st, _) = post(
        &s,
        &format!("{base}/stdin"),
        &json!({"data_b64": "dHdvCg==", "close": true}),
    );
    assert_eq!(st, 204);
    let lines = output(&s, &id, rpid, "start");
    assert_eq!(stdout_of(&lines), "got one\ngot two\neof\n");
    // Closed: more stdin is a conflict; the process has ended, so it is not found first.
    let (st, r) = post(&s, &format!("{base}/stdin"), &json!({"data": "x"}));
    assert_eq!(
        (st, &r["error"]["code"]),
        (404, &json!("no_process")),
        "{r}"
    );

    let sleeper = start(&s, &id, json!({"command": "sleep 600"}));
    let spid = sleeper["pid"].as_u64().unwrap();
    let sbase = format!("/v1/sessions/{id}/processes/{spid}");
    let (st, r) = post(&s, &format!("{sbase}/stdin"), &json!({"data": "x"}));
    assert_eq!(
        (st, &r["error"]["code"]),
        (409, &json!("stdin_closed")),
        "{r}"
    );
    let (st, r) = post(
        &s,
        &format!("{sbase}/signal"),
        &json!({"signal": "SIGNOPE"}),
    );
    assert_eq!(
        (st, &r["error"]["code"]),
        (400, &json!("invalid_request")),
        "{r}"
    );
    let (st, _) = post(
        &s,
        &format!("{sbase}/signal"),
        &json!({"signal": "SIGTERM"}),
    );
    assert_eq!(st, 204);
    let end = output(&s, &id, spid, "now");
    let end = end.last().unwrap();
    assert_eq!(
        (&end["status"], &end["signal"]),
        (&json!("killed"), &json!(15)),
        "{end}"
    );

    let third = start(&s, &id, json!({"command": "sleep 600"}));
    let tpid = third["pid"].as_u64().unwrap();
    assert_eq!(
        s.delete(&format!("/v1/sessions/{id}/processes/{tpid}")),
        204
    );
    let end = output(&s, &id, tpid, "start");
    assert_eq!(end.last().unwrap()["signal"], 9);
    assert_eq!(
        s.delete(&format!("/v1/sessions/{id}/processes/{tpid}")),
        404
    );
    assert_eq!(s.delete(&format!("/v1/sessions/{id}/processes/99999")), 404);
}

#[test]
fn bad_requests_limits_and_a_session_that_ends_under_its_processes() {
    let mut config: Config = test_config();
    config.sessions.max_processes = 2;
    let s = TestServer::with_config(config);
    let id = session(&s, json!({}));
    let path = format!("/v1/sessions/{id}/processes");
    for (body, code, status) in [
        (json!({"command": ""}), "invalid_request", 400),
        (
            json!({"command": "true", "env": {"1BAD": "x"}}),
            "invalid_request",
            400,
        ),
        (
            json!({"command": "true", "nope": 1}),
            "invalid_request",
            400,
        ),
        (
            json!({"command": "true", "cwd": "/no/such"}),
            "invalid_request",
            400,
        ),
    ] {
        let (st, r) = s.post(&path, &body);
        assert_eq!(
            (st, r["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}: {r}"
        );
    }
    let (st, r) = s.post(
        "/v1/sessions/ses_nope/processes",
        &json!({"command": "true"}),
    );
    assert_eq!(
        (st, &r["error"]["code"]),
        (404, &json!("no_session")),
        "{r}"
    );
    let a = start(&s, &id, json!({"command": "sleep 600"}));
    start(&s, &id, json!({"command": "sleep 600"}));
    let (st, r) = s.post(&path, &json!({"command": "sleep 600"}));
    assert_eq!(
        (st, &r["error"]["code"]),
        (429, &json!("too_many_processes")),
        "{r}"
    );
    // A client streams from a live process while its session is deleted: the stream ends
    // with the process lost, and the session's processes are gone with it.
    let pid = a["pid"].as_u64().unwrap();
    let url = s.url(&format!("{path}/{pid}/output"));
    let (connected, is_connected) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let r = client().get(url).send().expect("request failed");
        connected.send(r.status().as_u16()).unwrap();
        BufReader::new(r)
            .lines()
            .map(|l| serde_json::from_str::<Value>(&l.unwrap()).unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(is_connected.recv().unwrap(), 200);
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
    let lines = reader.join().unwrap();
    let end = lines.last().unwrap();
    assert_eq!(end["status"], "lost", "{lines:?}");
    assert!(end["lost"].as_str().unwrap().contains("deleted"), "{end}");
    let (st, _) = post(&s, &path, &json!({"command": "true"}));
    assert_eq!(st, 404);
    s.assert_still_serving();
}

#[test]
fn a_process_runs_as_root_unless_it_names_a_user_of_the_guest() {
    let s = TestServer::start();
    let id = session(&s, json!({}));
    let who = "id -un; echo \"$HOME $USER\"; pwd";
    let user = start(&s, &id, json!({"command": who, "user": "user"}));
    assert_eq!(user["user"], "user", "{user}");
    let root = start(&s, &id, json!({"command": who}));
    assert!(root.get("user").is_none(), "{root}");
    let explicit = start(
        &s,
        &id,
        json!({"command": who, "user": "root", "cwd": "/home/user"}),
    );
    let out = |p: &Value| stdout_of(&output(&s, &id, p["pid"].as_u64().unwrap(), "start"));
    assert_eq!(out(&user), "user\n/home/user user\n/tmp\n");
    assert_eq!(out(&root), "root\n/tmp root\n/tmp\n");
    assert_eq!(out(&explicit), "root\n/root root\n/home/user\n");
    let listed: Value = s
        .get(&format!("/v1/sessions/{id}/processes"))
        .json()
        .unwrap();
    let users: Vec<&Value> = listed["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["user"])
        .collect();
    assert_eq!(users, [&json!("user"), &Value::Null, &json!("root")]);
    for bad in ["nobody2", "Not A Name"] {
        let (status, r) = post(
            &s,
            &format!("/v1/sessions/{id}/processes"),
            &json!({"command": "true", "user": bad}),
        );
        assert_eq!(status, 400, "{bad}: {r}");
        assert!(r["error"]["message"].as_str().unwrap().contains(bad), "{r}");
    }
    s.assert_still_serving();
}

#[test]
fn the_e2b_sdk_runs_background_commands_stdin_connect_list_kill_terminals_and_watchers() {
    let s = TestServer::start();
    let seen = client_script("e2b_processes.py", &[], &e2b_env(&s, "e2b_any"));
    assert_eq!(
        seen,
        json!({
            "pid_is_int": true,
            "listed": true,
            "foreground_meanwhile": ["hello from the foreground\n", 0],
            "background_end": [4, "started\ndone\n"],
            "listed_after_end": [],
            "stdin": "got one\ngot two\ngot three\ngot four\neof\n",
            "connected_output": true,
            "kill": true,
            "killed_end": [-1, null],
            "kill_again": false,
            "client_timeout": "TimeoutException",
            "outlived_client": "still here\n",
            "concurrent": ["A saw the flag\n", "B made it\n"],
            "pty_end": 3,
            "pty": [true, true, true, true],
            "watch": [true, true, true, true, true],
            "watch_stopped": "SandboxException",
            "async": [["async hi\n", 0], true, true, true, true, 4, true],
        })
    );
}

#[test]
fn the_e2b_sdk_keeps_file_metadata_and_gets_entries_with_watch_events() {
    let s = TestServer::start();
    let seen = client_script("e2b_metadata.py", &[], &e2b_env(&s, "e2b_any"));
    assert_eq!(
        seen,
        json!({
            "written": {"author": "ada", "purpose": "test"},
            "get_info": {"author": "ada", "purpose": "test"},
            "listed": [["m.txt", {"author": "ada", "purpose": "test"}]],
            "in_guest": "['user.e2b.author', 'user.e2b.purpose'] ada",
            "replaced": {"purpose": "second"},
            "moved": {"purpose": "second"},
            "cleared": null,
            "set_in_guest": {"by": "code"},
            "long_key": "InvalidArgumentException",
            "bad_not_written": false,
            "watch": [
                ["e.txt", "chmod", "e.txt", "/home/user/w/e.txt"],
                ["e.txt", "create", "e.txt", "/home/user/w/e.txt"],
                ["e.txt", "remove", false, false],
                ["e.txt", "write", "e.txt", "/home/user/w/e.txt"],
            ],
            "chmod_entry": [["user", 5, "file", {"tag": "watched"}]],
            "async": [{"k": "v"}, {"k": "v"}, [2, {"side": "async"}]],
        })
    );
}

#[test]
fn a_fork_child_has_its_own_copy_of_each_running_process() {
    let s = TestServer::start();
    let id = session(&s, json!({}));
    let p = start(
        &s,
        &id,
        json!({"command": "while read -r l; do echo \"read $l\"; done; echo eof", "stdin": true}),
    );
    let pid = p["pid"].as_u64().unwrap();
    let (st, r) = s.post(&format!("/v1/sessions/{id}/fork"), &json!({"count": 1}));
    assert_eq!(st, 201, "{r}");
    let child = r["ids"][0].as_str().unwrap().to_owned();
    let listed: Value = s
        .get(&format!("/v1/sessions/{child}/processes"))
        .json()
        .unwrap();
    assert_eq!(listed["processes"][0]["pid"], json!(pid), "{listed}");
    assert_eq!(listed["processes"][0]["status"], "running");
    for (sid, word) in [(&child, "child"), (&id, "parent")] {
        let (st, r) = post(
            &s,
            &format!("/v1/sessions/{sid}/processes/{pid}/stdin"),
            &json!({"data": format!("{word}\n"), "close": true}),
        );
        assert_eq!(st, 204, "{r}");
    }
    assert_eq!(
        stdout_of(&output(&s, &child, pid, "start")),
        "read child\neof\n"
    );
    assert_eq!(
        stdout_of(&output(&s, &id, pid, "start")),
        "read parent\neof\n"
    );
}

#[test]
fn a_process_on_a_terminal_through_the_native_api() {
    let s = TestServer::start();
    let id = session(&s, json!({}));
    let (st, r) = s.post(
        &format!("/v1/sessions/{id}/processes"),
        &json!({"command": "true", "pty": {"rows": 0, "cols": 80}}),
    );
    assert_eq!(
        (st, &r["error"]["code"]),
        (400, &json!("invalid_request")),
        "{r}"
    );
    let p = start(
        &s,
        &id,
        json!({"command": "read -r go; stty size; echo \"$TERM\"", "pty": {"rows": 24, "cols": 80}}),
    );
    assert_eq!(p["pty"], json!({"rows": 24, "cols": 80}), "{p}");
    assert_eq!(p["stdin"], true);
    let pid = p["pid"].as_u64().unwrap();
    let base = format!("/v1/sessions/{id}/processes/{pid}");
    let (st, r) = post(
        &s,
        &format!("{base}/resize"),
        &json!({"rows": 40, "cols": 120}),
    );
    assert_eq!(st, 204, "{r}");
    let (st, _) = post(&s, &format!("{base}/stdin"), &json!({"data": "go\n"}));
    assert_eq!(st, 204);
    let lines = output(&s, &id, pid, "start");
    assert_eq!(stdout_of(&lines), "go\r\n40 120\r\nxterm-256color\r\n");
    assert_eq!(lines.last().unwrap()["exit_code"], 0);
    // A process without a terminal cannot be resized.
    let plain = start(&s, &id, json!({"command": "sleep 60"}));
    let (st, r) = post(
        &s,
        &format!("/v1/sessions/{id}/processes/{}/resize", plain["pid"]),
        &json!({"rows": 10, "cols": 10}),
    );
    assert_eq!(
        (st, &r["error"]["code"]),
        (400, &json!("invalid_request")),
        "{r}"
    );
}

#[test]
fn a_watcher_through_the_native_api_reports_changes_once() {
    let s = TestServer::start();
    let id = session(&s, json!({}));
    let (st, r) = s.post(
        &format!("/v1/sessions/{id}/watchers"),
        &json!({"path": "/etc"}),
    );
    assert_eq!(
        (st, &r["error"]["code"]),
        (400, &json!("invalid_request")),
        "{r}"
    );
    let (st, r) = s.post(
        &format!("/v1/sessions/{id}/watchers"),
        &json!({"path": "nope"}),
    );
    assert_eq!((st, &r["error"]["code"]), (404, &json!("no_file")), "{r}");
    let (st, r) = s.post(
        &format!("/v1/sessions/{id}/watchers"),
        &json!({"path": ".", "recursive": true}),
    );
    assert_eq!(st, 201, "{r}");
    let wid = r["id"].as_u64().unwrap();
    let url = format!("/v1/sessions/{id}/watchers/{wid}/changes");
    let mut seen: Vec<Value> = Vec::new();
    let mut wait_for = |want: Value| {
        for _ in 0..300 {
            if seen.contains(&want) {
                return;
            }
            let r: Value = s.get(&url).json().unwrap();
            assert_eq!(r["dropped"], 0, "{r}");
            seen.extend(r["changes"].as_array().unwrap().iter().cloned());
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("{want} not in {seen:?}");
    };
    let shell = |code: &str| {
        let (st, r) = s.post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"language": "shell", "code": code}),
        );
        assert_eq!(st, 200, "{r}");
    };
    // A new directory is watched from when the watcher sees it (inotify's way): its
    // file's changes come after that.
    shell("mkdir d");
    wait_for(json!({"type": "create", "path": "d"}));
    shell("echo x > d/f; rm d/f");
    wait_for(json!({"type": "create", "path": "d/f"}));
    wait_for(json!({"type": "remove", "path": "d/f"}));
    // Taken once: the next call has nothing new.
    let again: Value = s.get(&url).json().unwrap();
    assert_eq!(again["changes"], json!([]));
    assert_eq!(s.delete(&format!("/v1/sessions/{id}/watchers/{wid}")), 204);
    assert_eq!(s.delete(&format!("/v1/sessions/{id}/watchers/{wid}")), 404);
    assert_eq!(s.get(&url).status().as_u16(), 404);
}

#[test]
fn quick_processes_started_while_others_run_all_report_output_and_end() {
    let s = TestServer::start();
    let id = session(&s, json!({}));
    // The pump runs for this one: each later start races with its polls.
    start(&s, &id, json!({"command": "sleep 600"}));
    for n in 0..8 {
        let p = start(&s, &id, json!({"command": format!("echo quick {n}")}));
        let lines = output(&s, &id, p["pid"].as_u64().unwrap(), "start");
        assert_eq!(stdout_of(&lines), format!("quick {n}\n"), "{lines:?}");
        assert_eq!(lines.last().unwrap()["exit_code"], 0, "{lines:?}");
    }
}

#[test]
fn a_session_takes_at_most_64_output_streams_at_once() {
    let s = TestServer::start();
    let id = session(&s, json!({}));
    let p = start(&s, &id, json!({"command": "sleep 600"}));
    let url = s.url(&format!(
        "/v1/sessions/{id}/processes/{}/output",
        p["pid"].as_u64().unwrap()
    ));
    let open: Vec<_> = (0..64)
        .map(|_| client().get(&url).send().expect("request failed"))
        .collect();
    assert!(open.iter().all(|r| r.status().as_u16() == 200));
    let r = client().get(&url).send().expect("request failed");
    assert_eq!(r.status().as_u16(), 429);
    let body: Value = r.json().unwrap();
    assert_eq!(body["error"]["code"], "too_many_streams", "{body}");
    drop(open);
    // Closed streams are counted out as the server notices them gone.
    let mut status = 0;
    for _ in 0..100 {
        let r = client().get(&url).send().expect("request failed");
        status = r.status().as_u16();
        if status == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(status, 200);
}
