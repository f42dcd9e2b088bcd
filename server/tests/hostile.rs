//! Hostile requests and jobs against a real server: each gets a clear status, and the server
//! answers a normal job right after. Needs /dev/kvm.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bud_server::{Config, Limits};
use common::*;
use serde_json::{Value, json};

#[test]
fn malformed_json_is_400_and_the_server_keeps_serving() {
    let s = TestServer::start();

    let (truncated, t) = s.post_raw(
        "/v1/exec",
        "application/json",
        b"{\"code\": \"print(1)".to_vec(),
    );
    let (garbage, g) = s.post_raw("/v1/exec", "application/json", vec![0xde, 0xad, 0xbe, 0xef]);
    let (wrong_shape, w) = s.post_raw(
        "/v1/exec",
        "application/json",
        b"{\"code\": [1, 2]}".to_vec(),
    );

    assert_eq!(
        (truncated, &t["error"]["code"]),
        (400, &json!("invalid_json"))
    );
    assert_eq!(
        (garbage, &g["error"]["code"]),
        (400, &json!("invalid_json"))
    );
    assert_eq!(
        (wrong_shape, &w["error"]["code"]),
        (400, &json!("invalid_request"))
    );
    s.assert_still_serving();
}

#[test]
fn a_huge_body_is_413_and_the_server_keeps_serving() {
    let s = TestServer::start();
    let limit = Limits::default().max_body_bytes;
    let body = format!("{{\"code\": \"{}\"}}", "x".repeat(limit + (4 << 20)));

    let (status, r) = s.post_raw("/v1/exec", "application/json", body.into_bytes());

    assert_eq!(
        (status, &r["error"]["code"]),
        (413, &json!("body_too_large"))
    );
    s.assert_still_serving();
}

#[test]
fn a_body_too_huge_to_drain_is_refused_before_it_is_read() {
    let s = TestServer::start();
    let mut tcp = TcpStream::connect(s.addr).unwrap();
    let head = format!(
        "POST /v1/exec HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        1u64 << 40
    );

    tcp.write_all(head.as_bytes()).unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).unwrap();

    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("body_too_large"), "{answer}");
    s.assert_still_serving();
}

#[test]
fn invalid_utf8_in_code_is_400_as_text_and_a_job_as_base64() {
    let s = TestServer::start();
    let mut raw = b"{\"code\": \"print('".to_vec();
    raw.extend_from_slice(&[0xff, 0xfe]);
    raw.extend_from_slice(b"')\"}");

    let (status, r) = s.post_raw("/v1/exec", "application/json", raw);
    let (b64_status, b) = s.exec(json!({"code_b64": BASE64.encode(b"print('\xff')")}));

    assert_eq!(
        (status, &r["error"]["code"], &r["error"]["field"]),
        (400, &json!("invalid_json"), &json!("code"))
    );
    assert_eq!((b64_status, &b["status"]), (200, &json!("error")), "{b}");
    s.assert_still_serving();
}

#[test]
fn binary_stdin_reaches_the_job_byte_exact() {
    let s = TestServer::start();
    let stdin: Vec<u8> = (0..=255u8).cycle().take(64 << 10).collect();

    let (status, r) = s.exec(json!({
        "code": "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read())",
        "stdin_b64": BASE64.encode(&stdin),
    }));

    let echoed = BASE64
        .decode(r["stdout_b64"].as_str().expect("stdout_b64"))
        .unwrap();
    assert_eq!(
        (status, &r["status"]),
        (200, &json!("ok")),
        "{}",
        r["stderr"]
    );
    assert!(echoed == stdin, "stdin came back changed");
    s.assert_still_serving();
}

#[test]
fn a_fork_bomb_ends_in_its_own_clone() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({
        "code": "import os\nwhile True:\n    os.fork()",
        "timeout_ms": 1000,
    }));

    assert_eq!(status, 200, "{r}");
    // Under kvm_pvm a fork costs ~0.5 s of guest kernel, so the bomb is still small at its
    // 1 s timeout; on hardware it may fill the guest's RAM first.
    let possible: &[&str] = match vmm::HostKind::detect() {
        vmm::HostKind::Pvm => &["timeout"],
        vmm::HostKind::Hardware => &["timeout", "memory_limit"],
    };
    assert!(
        possible.contains(&r["status"].as_str().unwrap_or("")),
        "{r}"
    );
    s.assert_still_serving();
}

#[test]
fn a_memory_bomb_is_a_memory_limit() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({
        "code": "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 30))",
        "timeout_ms": 5000,
    }));

    assert_eq!((status, &r["status"]), (200, &json!("memory_limit")), "{r}");
    s.assert_still_serving();
}

#[test]
fn a_slow_memory_bomb_ends_with_a_status() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({
        "code": "chunks = []\nwhile True:\n    chunks.append(b'x' * (8 << 20))",
        "timeout_ms": 1000,
    }));

    assert_eq!(status, 200, "{r}");
    let ended = ["timeout", "memory_limit"].map(Value::from);
    assert!(ended.contains(&r["status"]), "{r}");
    s.assert_still_serving();
}

#[test]
fn an_output_flood_stops_at_the_output_limit() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({
        "code": "while True:\n    print('x' * 1000)",
        "output_limit": 100_000,
    }));

    assert_eq!((status, &r["status"]), (200, &json!("output_limit")), "{r}");
    assert!(r["stdout"].as_str().unwrap().len() <= 100_000);
    s.assert_still_serving();
}

/// A batch whose every job floods its output shares one output budget: the answer (and
/// what the server holds for it) stays bounded, each job ending `output_limit` at its share.
/// The hostile battery's 16 jobs printing 8 MiB each made an 805 MB response.
#[test]
fn a_batch_of_floods_shares_one_output_budget() {
    let s = TestServer::start();
    let flood = json!({"code": "import sys\nsys.stdout.write('x' * (8 << 20))"});
    let jobs: Vec<Value> = (0..16).map(|_| flood.clone()).collect();
    let budget = Limits::default().max_batch_output_bytes;

    let (status, r) = s.post("/v1/exec/batch", &json!({ "jobs": jobs }));

    assert_eq!(status, 200, "{r}");
    let results = r["results"].as_array().unwrap();
    assert_eq!(results.len(), 16);
    let mut total = 0;
    for (i, job) in results.iter().enumerate() {
        assert_eq!(job["status"], json!("output_limit"), "job {i}: {job}");
        let kept = job["stdout"].as_str().unwrap().len();
        assert!(kept <= budget / 16, "job {i} kept {kept} bytes");
        total += kept;
    }
    assert!(total <= budget, "{total} bytes kept");
    s.assert_still_serving();
}

#[test]
fn an_infinite_loop_times_out() {
    let s = TestServer::start();

    let (status, r) = s.exec(json!({"code": "while True: pass", "timeout_ms": 500}));
    let (shell_status, sh) =
        s.exec(json!({"language": "shell", "code": "while :; do :; done", "timeout_ms": 500}));

    assert_eq!((status, &r["status"]), (200, &json!("timeout")));
    assert_eq!((shell_status, &sh["status"]), (200, &json!("timeout")));
    s.assert_still_serving();
}

#[test]
fn overload_is_429_with_retry_after_and_the_server_recovers() {
    let s = TestServer::with_config(Config {
        workers: 1,
        queue: 1,
        limits: Limits {
            max_batch_jobs: 2,
            ..Limits::default()
        },
        ..test_config()
    });
    let url = s.url("/v1/exec");
    let slow = json!({"code": "while True: pass", "timeout_ms": 1500});

    let answers: Vec<(u16, Option<String>, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let (url, slow) = (url.clone(), slow.clone());
                scope.spawn(move || {
                    let r = client().post(url).json(&slow).send().unwrap();
                    let status = r.status().as_u16();
                    let retry = r
                        .headers()
                        .get("retry-after")
                        .map(|v| v.to_str().unwrap().to_string());
                    (status, retry, r.json::<Value>().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    let ran = answers.iter().filter(|a| a.0 == 200).count();
    let refused: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    assert_eq!(ran + refused.len(), 6, "{answers:?}");
    assert!(!refused.is_empty(), "{answers:?}");
    assert!(
        refused.iter().all(|a| a.1.as_deref() == Some("1")),
        "{answers:?}"
    );
    assert!(
        refused.iter().all(|a| a.2["error"]["code"] == "overloaded"),
        "{answers:?}"
    );
    s.assert_still_serving();
    let metrics = s.get("/metrics").text().unwrap();
    assert!(metrics.contains(&format!(
        "bud_rejected_total{{reason=\"overloaded\"}} {}\n",
        refused.len()
    )));
}

#[test]
fn a_body_trickled_past_the_time_limit_is_408_and_the_server_keeps_serving() {
    let mut config = test_config();
    config.limits.body_timeout_ms = 300;
    let s = TestServer::with_config(config);
    let mut c = TcpStream::connect(s.addr).unwrap();
    // Headers promise 100 bytes; 10 come, then nothing.
    write!(
        c,
        "POST /v1/exec HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: 100\r\n\r\n{{\"code\": "
    )
    .unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.ends_with(b"}") {
        let n = c.read(&mut buf).expect("the server answered");
        assert!(n > 0, "closed without an answer: {answer:?}");
        answer.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408 "), "{text}");
    assert!(text.contains("\"code\":\"request_timeout\""), "{text}");
    s.assert_still_serving();
}

#[test]
fn headers_trickled_past_the_time_limit_are_408_and_an_idle_connection_is_closed_silently() {
    let mut config = test_config();
    config.limits.header_timeout_ms = 300;
    let s = TestServer::with_config(config);
    let timeout = Some(std::time::Duration::from_secs(30));

    // A request line and one header, then a byte every 50 ms: past 300 ms it is cut off.
    let mut slow = TcpStream::connect(s.addr).unwrap();
    slow.set_read_timeout(timeout).unwrap();
    write!(slow, "POST /v1/exec HTTP/1.1\r\nhost: x\r\n").unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    for b in b"x-slow: 0123456789012345678901234567890123456789"
        .iter()
        .cycle()
    {
        // Ends when the server closes the connection; a write to it may then fail.
        slow.set_nonblocking(true).unwrap();
        match slow.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("{e}: {answer:?}"),
        }
        slow.set_nonblocking(false).unwrap();
        if slow.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    slow.set_nonblocking(false).unwrap();
    let _ = slow.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
        "{text}"
    );
    assert!(text.contains("connection: close\r\n"), "{text}");
    let body: serde_json::Value =
        serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"error": {"code": "request_timeout", "field": null,
            "message": "the request headers did not arrive within 300ms"}})
    );

    // A connection that never sends anything is closed without an answer.
    let mut idle = TcpStream::connect(s.addr).unwrap();
    idle.set_read_timeout(timeout).unwrap();
    let mut nothing = Vec::new();
    assert_eq!(idle.read_to_end(&mut nothing).unwrap(), 0);
    s.assert_still_serving();
}

#[test]
fn over_the_memory_budget_jobs_get_503_with_retry_after_and_under_it_they_run() {
    let mut tight = test_config();
    // Less than any process holds: every admission is over it.
    tight.memory_budget_bytes = Some(1 << 20);
    let s = TestServer::with_config(tight);
    let r = client()
        .post(s.url("/v1/exec"))
        .json(&serde_json::json!({"code": "print(1)"}))
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let retry = r.headers()["retry-after"].to_str().unwrap().to_owned();
    let body: serde_json::Value = r.json().unwrap();
    let (session_status, session) = s.post("/v1/sessions", &serde_json::json!({}));
    let metrics = s.get("/metrics").text().unwrap();
    drop(s);

    let mut roomy = test_config();
    roomy.memory_budget_bytes = Some(1 << 40);
    let s = TestServer::with_config(roomy);
    let (ok_status, ok) = s.exec(serde_json::json!({"code": "print(1)"}));

    assert_eq!((status, retry.as_str()), (503, "1"), "{body}");
    assert_eq!(body["error"]["code"], "memory_budget", "{body}");
    assert_eq!(
        (session_status, &session["error"]["code"]),
        (503, &serde_json::json!("memory_budget"))
    );
    assert!(
        metrics.contains("bud_rejected_total{reason=\"memory_budget\"} 2\n"),
        "{metrics}"
    );
    assert_eq!(
        (ok_status, &ok["status"]),
        (200, &serde_json::json!("ok")),
        "{ok}"
    );
}
