//! The session API against a real server on loopback, over the real template on the real
//! VMM: state across cells, displayed results, interrupts, crashes, one cell at a time,
//! files, forks, contexts. Needs /dev/kvm. The caps, expiry, a waiter's leaving and the
//! shutdown's end of sessions are tested on the test engine (`src/http/tests/`).

mod common;

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use common::*;
use serde_json::{Value, json};

fn create(s: &TestServer, body: Value) -> String {
    let (status, r) = s.post("/v1/sessions", &body);
    assert_eq!(status, 201, "{r}");
    r["id"].as_str().expect("an id").to_owned()
}

fn cell(s: &TestServer, id: &str, code: &str) -> Value {
    let (status, r) = s.post(&format!("/v1/sessions/{id}/exec"), &json!({ "code": code }));
    assert_eq!(status, 200, "{r}");
    r
}

fn shown(r: &Value) -> &Value {
    &r["result"]["text/plain"]
}

fn put(s: &TestServer, path: &str, body: Vec<u8>) -> (u16, String) {
    let r = client()
        .put(s.url(path))
        .body(body)
        .send()
        .expect("request failed");
    (r.status().as_u16(), r.text().unwrap_or_default())
}

fn get_json(s: &TestServer, path: &str) -> (u16, Value) {
    let r = s.get(path);
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn state_persists_across_twenty_cells_with_results_and_execution_counts() {
    let s = TestServer::start();
    let id = create(
        &s,
        json!({"env": {"WHO": "bud"}, "metadata": {"user": "u1"}}),
    );

    let first = cell(
        &s,
        &id,
        "import os\ntotal = 0\ndef add(v):\n    global total\n    total += v\n    return total",
    );
    let mut last = Value::Null;
    for i in 1..=20 {
        last = cell(&s, &id, &format!("add({i})"));
    }
    let env = cell(&s, &id, "os.environ['WHO']");
    let printed = cell(&s, &id, "print('out'); x = 5");
    let shell = s.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({"language": "shell", "code": "echo $WHO; pwd"}),
    );
    let (info_status, info) = get_json(&s, &format!("/v1/sessions/{id}"));
    let (_, listed) = get_json(&s, "/v1/sessions");

    assert_eq!(first["result"], Value::Null);
    assert_eq!(first["execution_count"], 1);
    assert_eq!(shown(&last), "210");
    assert_eq!(last["execution_count"], 21);
    assert_eq!(last["status"], "ok");
    assert_eq!(shown(&env), "'bud'");
    assert_eq!(
        (&printed["stdout"], &printed["result"]),
        (&json!("out\n"), &Value::Null)
    );
    assert_eq!(
        (shell.0, &shell.1["stdout"]),
        (200, &json!("bud\n/tmp\n")),
        "{}",
        shell.1
    );
    assert_eq!(info_status, 200);
    assert_eq!(
        (&info["execution_count"], &info["metadata"]["user"]),
        (&json!(24), &json!("u1"))
    );
    assert!(info["memory_bytes"].as_u64().unwrap() > 0, "{info}");
    assert!(
        listed["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["id"] == id.as_str())
    );
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 404);
    assert_eq!(get_json(&s, &format!("/v1/sessions/{id}")).0, 404);
}

#[test]
fn html_results_and_errors_are_shown_like_jupyter() {
    let s = TestServer::start();
    let id = create(&s, json!({}));

    let html = cell(
        &s,
        &id,
        "class Table:\n    def _repr_html_(self): return '<table></table>'\nTable()",
    );
    let error = cell(&s, &id, "undefined_name");
    let after = cell(&s, &id, "1 + 1");

    assert_eq!(html["result"]["text/html"], "<table></table>");
    assert!(
        html["result"]["text/plain"]
            .as_str()
            .unwrap()
            .contains("Table object")
    );
    assert_eq!(
        (&error["status"], &error["exit_code"]),
        (&json!("error"), &json!(1))
    );
    assert!(
        error["stderr"].as_str().unwrap().contains("NameError"),
        "{error}"
    );
    assert_eq!(shown(&after), "2");
}

#[test]
fn a_cell_past_its_timeout_is_interrupted_and_the_next_cell_works() {
    let s = TestServer::start();
    let id = create(&s, json!({}));
    cell(&s, &id, "count = 0");

    let (status, r) = s.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({"code": "while True:\n    count += 1", "timeout_ms": 500}),
    );
    let next = cell(&s, &id, "count > 0");

    assert_eq!((status, &r["status"]), (200, &json!("timeout")), "{r}");
    assert!(
        r["stderr"].as_str().unwrap().contains("KeyboardInterrupt"),
        "{r}"
    );
    assert_eq!(shown(&next), "True");
}

#[test]
fn a_cell_that_kills_the_worker_ends_the_session_with_410() {
    let s = TestServer::start();
    let id = create(&s, json!({}));

    let r = cell(&s, &id, "import os\nos._exit(7)");
    let (status, gone) = s.post(&format!("/v1/sessions/{id}/exec"), &json!({"code": "1"}));
    let (show, shown_gone) = get_json(&s, &format!("/v1/sessions/{id}"));

    assert_eq!(
        (&r["status"], &r["exit_code"]),
        (&json!("error"), &json!(7)),
        "{r}"
    );
    assert_eq!(
        (status, &gone["error"]["code"]),
        (410, &json!("session_gone")),
        "{gone}"
    );
    let message = gone["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("crashed") && message.contains("the worker process is gone (exit code 7)"),
        "{gone}"
    );
    assert_eq!(show, 410, "{shown_gone}");
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
    assert_eq!(get_json(&s, &format!("/v1/sessions/{id}")).0, 404);
}

/// Polls session `id` until `ready(info)` (its `GET`), at most 30 s.
fn wait_for(s: &TestServer, id: &str, what: &str, ready: impl Fn(&Value) -> bool) {
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let info: Value = s.get(&format!("/v1/sessions/{id}")).json().unwrap();
        if ready(&info) {
            return;
        }
        assert!(
            std::time::Instant::now() < until,
            "{what} never happened: {info}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A cell for a busy session waits for its turn (here two cells behind a slow one, both
/// answered after it); one past
/// `--session-max-waiting` gets 409. A file operation does not wait: it runs beside the
/// slow cell, which waits for the file it writes (so the cell could not end without it).
#[test]
fn requests_to_a_busy_session_wait_their_turn_and_one_past_the_queue_gets_409() {
    let mut config = test_config();
    config.workers = 3;
    config.sessions.max_waiting = 2;
    let s = TestServer::with_config(config);
    let id = create(&s, json!({}));
    let post = |path: String, body: Value| {
        let url = s.url(&path);
        std::thread::spawn(move || {
            let r = client().post(url).json(&body).send().unwrap();
            (
                r.status().as_u16(),
                r.json::<Value>().unwrap_or(Value::Null),
            )
        })
    };

    let exec = format!("/v1/sessions/{id}/exec");
    let slow = post(
        exec.clone(),
        json!({"code": "import os, time\nwhile not os.path.exists('release.txt'):\n    time.sleep(0.02)\nn = 1\n'slept'"}),
    );
    // Until the slow cell holds the session (polled, not slept).
    wait_for(&s, &id, "the slow cell's start", |i| {
        i["busy"] == json!(true)
    });
    let next = post(exec.clone(), json!({"code": "n + 1"}));
    wait_for(&s, &id, "one waiting request", |i| i["waiting"] == json!(1));
    let after = post(exec.clone(), json!({"code": "n + 2"}));
    wait_for(&s, &id, "two waiting requests", |i| {
        i["waiting"] == json!(2)
    });
    let (refused, busy) = s.post(&exec, &json!({"code": "1"}));
    let released = client()
        .put(s.url(&format!("/v1/sessions/{id}/files/release.txt")))
        .body("written beside the slow cell")
        .send()
        .unwrap()
        .status()
        .as_u16();
    let (slow, next, after) = (
        slow.join().unwrap(),
        next.join().unwrap(),
        after.join().unwrap(),
    );
    let read = cell(&s, &id, "open('release.txt').read()");

    assert_eq!(
        (refused, &busy["error"]["code"]),
        (409, &json!("session_busy")),
        "{busy}"
    );
    assert_eq!(released, 204);
    assert_eq!((slow.0, shown(&slow.1)), (200, &json!("'slept'")));
    assert_eq!((next.0, shown(&next.1)), (200, &json!("2")), "{next:?}");
    assert_eq!((after.0, shown(&after.1)), (200, &json!("3")), "{after:?}");
    assert_eq!(shown(&read), "'written beside the slow cell'");
    let info: Value = s.get(&format!("/v1/sessions/{id}")).json().unwrap();
    assert_eq!(
        (&info["busy"], &info["waiting"]),
        (&json!(false), &json!(0))
    );
}

#[test]
fn files_round_trip_binary_and_large_and_escapes_are_refused() {
    let s = TestServer::start();
    let id = create(&s, json!({}));
    let big: Vec<u8> = (0..10 << 20)
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let files = format!("/v1/sessions/{id}/files");

    let (put_status, put_body) = put(&s, &format!("{files}/data/big.bin"), big.clone());
    let got = s.get(&format!("{files}/data/big.bin"));
    let got_status = got.status().as_u16();
    let got_bytes = got.bytes().unwrap().to_vec();
    let seen = cell(
        &s,
        &id,
        "import hashlib\nlen(open('data/big.bin','rb').read())",
    );
    let (list_status, list) = get_json(&s, &format!("{files}?dir=data"));
    cell(&s, &id, "import os\nos.symlink('/etc', 'etc')");
    let escape = put(&s, &format!("{files}/..%2Fx"), b"x".to_vec());
    let absolute = s.get(&format!("{files}/%2Fetc%2Fpasswd")).status().as_u16();
    let via_link = s.get(&format!("{files}/etc/passwd")).status().as_u16();
    let missing = s.get(&format!("{files}/nope")).status().as_u16();
    let removed = s.delete(&format!("{files}/data"));
    let after = cell(&s, &id, "os.path.exists('data')");

    assert_eq!(put_status, 204, "{put_body}");
    assert_eq!(got_status, 200);
    assert!(
        got_bytes == big,
        "the file came back different ({} bytes)",
        got_bytes.len()
    );
    assert_eq!(shown(&seen), "10485760");
    assert_eq!(list_status, 200, "{list}");
    assert_eq!(
        list["files"],
        json!([{"name": "big.bin", "type": "file", "size": 10485760}])
    );
    assert_eq!(escape.0, 400, "{}", escape.1);
    assert_eq!((absolute, via_link, missing), (400, 400, 404));
    assert_eq!(removed, 204);
    assert_eq!(shown(&after), "False");
}

#[test]
fn a_file_over_the_limit_is_413_and_loses_nothing() {
    let mut config = test_config();
    config.sessions.max_file_bytes = 1 << 20;
    let s = TestServer::with_config(config);
    let id = create(&s, json!({}));

    let (status, body) = put(
        &s,
        &format!("/v1/sessions/{id}/files/big"),
        vec![1; (1 << 20) + 1],
    );
    let exists = cell(&s, &id, "import os\nos.path.exists('big')");

    cell(&s, &id, "open('big', 'wb').write(b'y' * (2 << 20))");
    let read_big = s
        .get(&format!("/v1/sessions/{id}/files/big"))
        .status()
        .as_u16();
    let still = cell(&s, &id, "'alive'");

    assert_eq!(status, 413, "{body}");
    assert_eq!(shown(&exists), "False");
    assert_eq!(read_big, 413);
    assert_eq!(shown(&still), "'alive'");
}

#[test]
fn one_shot_jobs_take_files_in_and_return_files_out() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({
        "code": "data = open('in/x.csv').read()\nopen('out.txt', 'w').write(data.upper())\nprint(len(data))",
        "files": {"in/x.csv": BASE64.encode("a,b\n1,2\n")},
        "return_files": ["*.txt", "in/**/*.csv"],
    }));
    let (bad, refused) = s.exec(json!({"code": "1", "files": {"../x": ""}}));
    let (batch, batch_refused) = s.post(
        "/v1/exec/batch",
        &json!({"jobs": [{"code": "1", "return_files": ["*"]}]}),
    );

    assert_eq!(status, 200, "{r}");
    assert_eq!(
        (&r["status"], &r["stdout"]),
        (&json!("ok"), &json!("8\n")),
        "{r}"
    );
    assert_eq!(r["files"]["out.txt"], BASE64.encode("A,B\n1,2\n"));
    assert_eq!(r["files"]["in/x.csv"], BASE64.encode("a,b\n1,2\n"));
    assert_eq!(
        (bad, &refused["error"]["code"]),
        (400, &json!("invalid_request")),
        "{refused}"
    );
    assert_eq!(batch, 400, "{batch_refused}");
    s.assert_still_serving();
}

#[test]
fn forks_diverge_and_never_see_each_other() {
    let s = TestServer::start();
    let id = create(&s, json!({}));
    cell(
        &s,
        &id,
        "items = list(range(100))\nopen('f.txt', 'w').write('base')",
    );

    let (status, fork) = s.post(&format!("/v1/sessions/{id}/fork"), &json!({"count": 8}));
    let kids: Vec<String> = fork["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    for (i, k) in kids.iter().enumerate() {
        cell(
            &s,
            k,
            &format!("items.append({i})\nopen('f.txt', 'a').write('-{i}')"),
        );
    }
    let views: Vec<Value> = kids
        .iter()
        .map(|k| cell(&s, k, "(len(items), items[-1], open('f.txt').read())"))
        .collect();
    let source = cell(&s, &id, "(len(items), open('f.txt').read())");
    let (g_status, grand) = s.post(
        &format!("/v1/sessions/{}/fork", kids[3]),
        &json!({"count": 1}),
    );
    let grandchild = grand["ids"][0].as_str().unwrap().to_owned();
    let g_view = cell(
        &s,
        &grandchild,
        "items.append('g')\n(len(items), open('f.txt').read())",
    );
    let parent_view = cell(&s, &kids[3], "len(items)");
    let (_, info) = get_json(&s, &format!("/v1/sessions/{grandchild}"));

    assert_eq!(status, 201, "{fork}");
    assert_eq!(kids.len(), 8);
    for (i, v) in views.iter().enumerate() {
        assert_eq!(shown(v), &json!(format!("(101, {i}, 'base-{i}')")), "{v}");
    }
    assert_eq!(shown(&source), "(100, 'base')");
    assert_eq!(g_status, 201, "{grand}");
    assert_eq!(shown(&g_view), "(102, 'base-3')");
    assert_eq!(shown(&parent_view), "101");
    assert_eq!(info["parent"], kids[3].as_str());
    assert!(fork["source_pause_ms"].as_f64().unwrap() > 0.0, "{fork}");
    let metrics = s.get("/metrics").text().unwrap();
    let memory: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("bud_sessions_memory_bytes "))
        .unwrap()
        .parse()
        .unwrap();
    for k in kids.iter().chain([&grandchild, &id]) {
        assert_eq!(s.delete(&format!("/v1/sessions/{k}")), 204);
    }
    let after = s.get("/metrics").text().unwrap();

    assert!(metrics.contains("bud_sessions 10\n"), "{metrics}");
    assert!(
        metrics.contains("bud_sessions_forked_total 9\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("bud_sessions_created_total 10\n"),
        "{metrics}"
    );
    assert!(memory > 0, "{metrics}");
    assert!(after.contains("bud_sessions 0\n"), "{after}");
    assert!(
        after.contains("bud_sessions_ended_total{reason=\"deleted\"} 10\n"),
        "{after}"
    );
}

#[test]
fn the_stream_of_a_cell_ends_with_its_result() {
    let s = TestServer::start();
    let id = create(&s, json!({}));

    let r = client()
        .post(s.url(&format!("/v1/sessions/{id}/exec/stream")))
        .json(&json!({"code": "print('a')\n40 + 2"}))
        .send()
        .unwrap();
    let text = r.text().unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();

    assert_eq!(
        lines.first().unwrap(),
        &json!({"type": "stdout", "data": "a\n"})
    );
    let last = lines.last().unwrap();
    assert_eq!(
        (&last["type"], &last["result"]["text/plain"]),
        (&json!("result"), &json!("42")),
        "{text}"
    );
    assert_eq!(last["execution_count"], 1);
}

/// The guest's clock at a cell's start and end, from a Python context and a shell one.
const PY_SPAN: &str = "import time\nup = lambda: float(open('/proc/uptime').read().split()[0])\nt0 = up()\ntime.sleep(1.5)\n[t0, up()]";
const SH_SPAN: &str =
    "read a _ < /proc/uptime; sleep 1.5; read b _ < /proc/uptime; echo \"[$a, $b]\"";

#[test]
fn code_contexts_run_beside_each_other_keep_their_own_state_and_restart_and_go() {
    let s = TestServer::start();
    let id = create(&s, json!({}));
    let base = format!("/v1/sessions/{id}/contexts");
    let (status, py) = s.post(&base, &json!({"cwd": "/"}));
    assert_eq!(status, 201, "{py}");
    assert_eq!(
        (&py["language"], &py["cwd"]),
        (&json!("python"), &json!("/"))
    );
    let (status, sh) = s.post(&base, &json!({"language": "bash"}));
    assert_eq!(status, 201, "{sh}");
    assert_eq!(sh["cwd"], "/tmp");
    let (py, sh) = (py["id"].as_str().unwrap(), sh["id"].as_str().unwrap());
    let run = |ctx: &str, body: Value| s.post(&format!("{base}/{ctx}/exec"), &body);
    let ok = |ctx: &str, code: &str| {
        let (status, r) = run(ctx, json!({ "code": code }));
        assert_eq!(status, 200, "{r}");
        r
    };

    // Bad requests lose nothing.
    let (status, r) = s.post(&base, &json!({"language": "ruby"}));
    assert_eq!(
        (status, &r["error"]["code"]),
        (400, &json!("invalid_request")),
        "{r}"
    );
    let (status, r) = run("ctx_none", json!({"code": "1"}));
    assert_eq!(
        (status, &r["error"]["code"]),
        (404, &json!("no_context")),
        "{r}"
    );
    let (status, r) = run(sh, json!({"code": "1", "stdin": "x"}));
    assert_eq!(status, 400, "{r}");
    let (status, r) = run(sh, json!({"code": "1", "timeout_ms": 0}));
    assert_eq!(
        (status, &r["error"]["field"]),
        (400, &json!("timeout_ms")),
        "{r}"
    );

    // A Python context is an interpreter of its own, in its cwd, with its own count.
    let r = ok(py, "import os\nx = 41\nos.getcwd()");
    assert_eq!(
        (shown(&r), &r["execution_count"]),
        (&json!("'/'"), &json!(1))
    );
    let r = ok(py, "x + 1");
    assert_eq!(
        (shown(&r), &r["execution_count"]),
        (&json!("42"), &json!(2))
    );
    assert_eq!(shown(&cell(&s, &id, "'x' in globals()")), "False");
    let r = ok(py, "1 / 0");
    assert_eq!(
        (&r["status"], &r["error"]["name"]),
        (&json!("error"), &json!("ZeroDivisionError")),
        "{r}"
    );

    // A shell context keeps its directory and variables; its status is its last command's.
    let r = ok(sh, "pwd; cd /; N=5");
    assert_eq!(
        (&r["stdout"], &r["status"]),
        (&json!("/tmp\n"), &json!("ok")),
        "{r}"
    );
    let r = ok(sh, "echo \"$N $(pwd)\"");
    assert_eq!(r["stdout"], "5 /\n", "{r}");
    let r = ok(sh, "echo no >&2; false");
    assert_eq!(
        (&r["status"], &r["exit_code"], &r["stderr"]),
        (&json!("error"), &json!(1), &json!("no\n")),
        "{r}"
    );
    let (status, r) = run(sh, json!({"code": "sleep 30", "timeout_ms": 1000}));
    assert_eq!((status, &r["status"]), (200, &json!("timeout")), "{r}");
    assert_eq!(
        ok(sh, "echo $N").get("stdout"),
        Some(&json!("5\n")),
        "the shell stayed"
    );

    // A cell of each context, sent together, run at the same time (the guest's clock).
    let (a, b) = std::thread::scope(|t| {
        let a = t.spawn(|| ok(py, PY_SPAN));
        let b = t.spawn(|| ok(sh, SH_SPAN));
        (a.join().unwrap(), b.join().unwrap())
    });
    let a: Vec<f64> = serde_json::from_str(shown(&a).as_str().unwrap()).unwrap();
    let b: Vec<f64> = serde_json::from_str(b["stdout"].as_str().unwrap()).unwrap();
    assert!(a[0] < b[1] && b[0] < a[1], "the cells overlap: {a:?} {b:?}");

    let (status, listed) = get_json(&s, &base);
    assert_eq!(status, 200);
    let mut ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut want = vec![py, sh];
    want.sort();
    assert_eq!(ids, want);

    // Restart: a new, empty kernel, back in the context's cwd; remove: gone.
    let restarted = client()
        .post(s.url(&format!("{base}/{sh}/restart")))
        .send()
        .expect("request failed");
    assert_eq!(restarted.status().as_u16(), 204);
    let r = ok(sh, "echo \"${N:-unset} $(pwd)\"");
    assert_eq!(r["stdout"], "unset /tmp\n", "{r}");
    assert_eq!(s.delete(&format!("{base}/{py}")), 204);
    let (status, r) = run(py, json!({"code": "x"}));
    assert_eq!(
        (status, &r["error"]["code"]),
        (404, &json!("no_context")),
        "{r}"
    );
    assert_eq!(s.delete(&format!("{base}/{py}")), 404);
    // The session's own cells went on all along.
    assert_eq!(shown(&cell(&s, &id, "6 * 7")), "42");
}
