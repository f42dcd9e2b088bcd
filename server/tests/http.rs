//! The HTTP API against a real server on loopback, over the real template on the real VMM:
//! jobs, their statuses, batch, streaming, health, metrics. Needs /dev/kvm. Bad requests,
//! bodies and the shutdown's wait are tested on the test engine (`src/http/tests/`).

mod common;

use std::io::{BufRead, BufReader};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use common::*;
use serde_json::{Value, json};

#[test]
fn python_print_returns_stdout_status_and_timings() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({"code": "print(1 + 1)"}));

    assert_eq!(status, 200, "{r}");
    assert_eq!(r["stdout"], "2\n");
    assert_eq!((&r["status"], &r["exit_code"]), (&json!("ok"), &json!(0)));
    assert_eq!(r["stderr"], "");
    assert!(r["stdout_b64"].is_null(), "{r}");
    for t in ["queue_ms", "clone_ms", "run_ms", "total_ms"] {
        assert!(r["timings"][t].is_f64(), "{t}: {r}");
    }
}

#[test]
fn shell_job_gets_args_env_and_stdin() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({
        "language": "shell",
        "code": "echo \"$1 $GREETING\"; cat",
        "args": ["one"],
        "env": {"GREETING": "hi"},
        "stdin": "from stdin\n",
    }));

    assert_eq!(status, 200, "{r}");
    assert_eq!(r["stdout"], "one hi\nfrom stdin\n", "{r}");
    assert_eq!(r["status"], "ok", "{r}");
}

#[test]
fn binary_stdin_and_stdout_round_trip_through_base64() {
    let s = TestServer::start();
    let input = [0u8, 0xff, b'a', b'\n', 0x80];

    let (status, r) = s.exec(json!({
        "code": "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()[::-1])",
        "stdin_b64": BASE64.encode(input),
    }));

    let out = BASE64
        .decode(r["stdout_b64"].as_str().expect("stdout_b64"))
        .unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(out, [0x80, b'\n', b'a', 0xff, 0]);
    assert_eq!(r["stdout"], "\u{fffd}\na\u{fffd}\0");
}

#[test]
fn output_b64_always_returns_the_bytes() {
    let s = TestServer::start();

    let (_, r) = s.exec(json!({"code": "print('hi')", "output_b64": true}));

    assert_eq!(r["stdout_b64"], BASE64.encode("hi\n"));
    assert_eq!(r["stderr_b64"], "");
}

#[test]
fn exit_codes_and_failures_are_200_with_their_status() {
    let s = TestServer::start();

    let (code3, exit3) = s.exec(json!({"code": "import sys; sys.exit(3)"}));
    let (raised, traceback) = s.exec(json!({"code": "1 / 0"}));
    let (shell, shell4) = s.exec(json!({"language": "shell", "code": "exit 4"}));

    assert_eq!(
        (code3, &exit3["status"], &exit3["exit_code"]),
        (200, &json!("error"), &json!(3))
    );
    assert_eq!((raised, &traceback["exit_code"]), (200, &json!(1)));
    assert!(
        traceback["stderr"]
            .as_str()
            .unwrap()
            .contains("ZeroDivisionError")
    );
    assert_eq!((shell, &shell4["exit_code"]), (200, &json!(4)));
}

#[test]
fn a_job_past_its_timeout_is_200_timeout() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({"code": "while True: pass", "timeout_ms": 500}));

    assert_eq!((status, &r["status"]), (200, &json!("timeout")), "{r}");
    assert!(r["exit_code"].is_null());
}

#[test]
fn a_batch_answers_in_request_order_when_later_jobs_finish_first() {
    let s = TestServer::start();
    let jobs: Vec<Value> = (0..6)
        .map(|i| json!({"code": format!("import time; time.sleep(0.{}); print({i})", 5 - i)}))
        .collect();

    let (status, r) = s.post("/v1/exec/batch", &json!({"jobs": jobs}));

    assert_eq!(status, 200, "{r}");
    let outs: Vec<&str> = r["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["stdout"].as_str().unwrap())
        .collect();
    assert_eq!(outs, ["0\n", "1\n", "2\n", "3\n", "4\n", "5\n"]);
}

#[test]
fn streaming_sends_chunks_as_they_come_then_the_result() {
    let s = TestServer::start();
    // The job waits by its own clock, not for a sleep's length: each write after a wait
    // comes at least 0.3 s of the guest's time after the last FLUSH, so it rings one (the
    // worker streams output pending for 50 ms, guest/python/bud_io.py), and the chunks
    // are as written however long a sleep lasts or the host takes. What is checked is
    // their order, never timings.
    let code = "import sys, time\n\
                def wait(s):\n\
                \x20   end = time.monotonic() + s\n\
                \x20   while time.monotonic() < end: time.sleep(max(0, end - time.monotonic()))\n\
                print('a', flush=True)\nwait(0.3)\n\
                sys.stderr.write('b\\n'); sys.stderr.flush()\nwait(0.3)\nprint('c')";

    let r = client()
        .post(s.url("/v1/exec/stream"))
        .json(&json!({"code": code}))
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let ctype = r.headers()["content-type"].to_str().unwrap().to_string();
    let lines: Vec<Value> = BufReader::new(r)
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();

    assert_eq!((status, ctype.as_str()), (200, "application/x-ndjson"));
    let chunks: Vec<(String, String)> = lines[..lines.len() - 1]
        .iter()
        .map(|l| {
            (
                l["type"].as_str().unwrap().into(),
                l["data"].as_str().unwrap().into(),
            )
        })
        .collect();
    let expected: Vec<(String, String)> = [("stdout", "a\n"), ("stderr", "b\n"), ("stdout", "c\n")]
        .iter()
        .map(|(t, d)| (t.to_string(), d.to_string()))
        .collect();
    assert_eq!(chunks, expected, "the whole stream: {lines:?}");
    let last = lines.last().unwrap();
    assert_eq!(
        (&last["type"], &last["status"], &last["exit_code"]),
        (&json!("result"), &json!("ok"), &json!(0))
    );
}

#[test]
fn health_reports_ready_template_pool_and_version() {
    let s = TestServer::start();

    let r = s.get("/v1/health");
    let status = r.status().as_u16();
    let h: Value = r.json().unwrap();

    assert_eq!(status, 200);
    assert_eq!(
        (&h["status"], &h["template_ready"]),
        (&json!("ok"), &json!(true))
    );
    assert_eq!(h["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(h["pool_size"], 2);
    assert_eq!(h["workers"], 2);
    assert!(h["template"].as_str().is_some_and(|t| !t.is_empty()), "{h}");
}

#[test]
fn metrics_count_jobs_by_status_and_show_latencies_and_pool() {
    let s = TestServer::start();
    s.exec(json!({"code": "print(1)"}));
    s.exec(json!({"code": "import sys; sys.exit(2)"}));

    let r = s.get("/metrics");
    let status = r.status().as_u16();
    let text = r.text().unwrap();

    assert_eq!(status, 200);
    assert!(text.contains("bud_jobs_total{status=\"ok\"} 1\n"), "{text}");
    assert!(
        text.contains("bud_jobs_total{status=\"error\"} 1\n"),
        "{text}"
    );
    for h in ["clone", "run", "total"] {
        assert!(
            text.contains(&format!("bud_job_{h}_seconds_count 2\n")),
            "{h}: {text}"
        );
    }
    assert!(text.contains("bud_pool_size 2\n"));
    assert!(text.contains("bud_live_clones "));
    assert!(
        text.contains("bud_http_responses_total{code=\"200\"} 2\n"),
        "{text}"
    );
    let rss = text
        .lines()
        .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
        .unwrap();
    assert!(rss.parse::<u64>().unwrap() > 0);
}
