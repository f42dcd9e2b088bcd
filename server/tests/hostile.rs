//! Hostile jobs against a real server: each gets a clear status, and the server answers a
//! normal job right after; overload is 429. Needs /dev/kvm. Hostile requests (bad JSON,
//! huge or trickled bodies and headers) and the memory budget are tested on the test
//! engine (`src/http/tests/`).

mod common;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bud_server::{Config, Limits};
use common::*;
use serde_json::{Value, json};

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
