//! The audit trail against a real server on loopback: one JSON line per job and per cell,
//! with the key's name, hashes and sizes that match what ran; content on request; a process
//! start's record. A log that cannot be written is tested on the test engine
//! (`src/http/tests/admission.rs`).
//! Needs /dev/kvm.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bud_server::core::audit::{AuditConfig, Record};
use bud_server::core::keys::ApiKeys;
use common::*;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const KEY: &str = "alice-0123456789abcdef";

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bud-audit-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn server(audit: AuditConfig) -> TestServer {
    let mut config = test_config();
    config.api_keys = Some(Arc::new(ApiKeys::parse(&format!("alice {KEY}\n")).unwrap()));
    config.audit = Some(audit);
    TestServer::with_config(config)
}

fn post(s: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(s.url(path))
        .header("x-api-key", KEY)
        .json(body)
        .send()
        .unwrap();
    (r.status().as_u16(), r.json().unwrap())
}

/// `/metrics`, which needs a key like every route but health.
fn metrics(s: &TestServer) -> String {
    client()
        .get(s.url("/metrics"))
        .header("x-api-key", KEY)
        .send()
        .unwrap()
        .text()
        .unwrap()
}

fn health(s: &TestServer) -> Value {
    s.get("/v1/health").json().unwrap()
}

/// Waits until the writer has written `n` records (at most 30 s), then reads them.
fn records(s: &TestServer, log: &PathBuf, n: u64) -> Vec<Record> {
    let until = Instant::now() + Duration::from_secs(30);
    while health(s)["audit"]["written"].as_u64() < Some(n) {
        assert!(Instant::now() < until, "audit: {}", health(s)["audit"]);
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn every_job_and_cell_gets_a_record_naming_its_key_with_matching_hashes() {
    let dir = scratch("records");
    let log = dir.join("audit.jsonl");
    let s = server(AuditConfig {
        path: log.clone(),
        content: false,
        required: true,
    });
    let code = "import sys\nprint(sys.stdin.read().upper())";
    let (status, r) = post(&s, "/v1/exec", &json!({"code": code, "stdin": "hello"}));
    assert_eq!((status, &r["stdout"]), (200, &json!("HELLO\n")));
    let (status, r) = post(&s, "/v1/exec", &json!({"code": "raise SystemExit(3)"}));
    assert_eq!((status, &r["exit_code"]), (200, &json!(3)));
    let (status, made) = post(&s, "/v1/sessions", &json!({}));
    assert_eq!(status, 201, "{made}");
    let id = made["id"].as_str().unwrap().to_owned();
    let (status, r) = post(
        &s,
        &format!("/v1/sessions/{id}/exec"),
        &json!({"code": "6 * 7"}),
    );
    assert_eq!((status, &r["result"]["text/plain"]), (200, &json!("42")));

    let all = records(&s, &log, 3);

    assert_eq!(all.len(), 3, "{all:#?}");
    let (job, failed, cell) = (&all[0], &all[1], &all[2]);
    assert_eq!(job.key.as_deref(), Some("alice"));
    assert_eq!((job.route.as_str(), job.kind.as_str()), ("/v1/exec", "job"));
    assert_eq!((job.template.as_str(), &job.session), ("python", &None));
    assert_eq!(job.code_sha256, sha(code.as_bytes()));
    assert_eq!((job.code_bytes, job.stdin_bytes), (code.len(), 5));
    assert_eq!(job.stdin_sha256, sha(b"hello"));
    assert_eq!(job.status, vmm::Status::Ok);
    assert_eq!(
        (job.stdout_bytes, job.stdout_sha256.as_str()),
        (6, sha(b"HELLO\n").as_str())
    );
    assert_eq!(job.stderr_sha256, sha(b""));
    assert_eq!(job.code, None, "content is off");
    assert_eq!(
        (failed.status, failed.exit_code),
        (vmm::Status::Error, Some(3))
    );
    assert_eq!(cell.kind, "cell");
    assert_eq!(cell.session.as_deref(), Some(id.as_str()));
    assert_eq!(cell.route, "/v1/sessions/{id}/exec");
    assert_eq!(cell.code_sha256, sha(b"6 * 7"));
    assert!(
        cell.time.starts_with("20") && cell.time.ends_with('Z'),
        "{}",
        cell.time
    );
    let metrics = metrics(&s);
    assert!(
        metrics.contains("bud_audit_records_total{result=\"written\"} 3\n"),
        "{metrics}"
    );
    assert!(metrics.contains("bud_audit_failing 0\n"), "{metrics}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn audit_content_keeps_the_code_and_output() {
    let dir = scratch("content");
    let log = dir.join("audit.jsonl");
    let s = server(AuditConfig {
        path: log.clone(),
        content: true,
        required: false,
    });
    let (status, _) = post(
        &s,
        "/v1/exec",
        &json!({"code": "import sys\nprint('out')\nprint('err', file=sys.stderr)"}),
    );
    assert_eq!(status, 200);

    let all = records(&s, &log, 1);

    assert_eq!(
        (
            all[0].code.as_deref(),
            all[0].stdout.as_deref(),
            all[0].stderr.as_deref()
        ),
        (
            Some("import sys\nprint('out')\nprint('err', file=sys.stderr)"),
            Some("out\n"),
            Some("err\n")
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_background_process_is_recorded_as_it_starts() {
    let dir = scratch("process");
    let log = dir.join("audit.jsonl");
    let s = server(AuditConfig {
        path: log.clone(),
        content: true,
        required: true,
    });
    let (status, made) = post(&s, "/v1/sessions", &json!({}));
    assert_eq!(status, 201, "{made}");
    let id = made["id"].as_str().unwrap().to_owned();
    let script = "sleep 300 # started by alice";
    let (status, p) = post(
        &s,
        &format!("/v1/sessions/{id}/processes"),
        &json!({"command": script}),
    );
    assert_eq!(status, 201, "{p}");

    let all = records(&s, &log, 1);

    assert_eq!(all.len(), 1, "{all:#?}");
    let r = &all[0];
    assert_eq!(
        (r.kind.as_str(), r.key.as_deref()),
        ("process", Some("alice"))
    );
    assert_eq!(r.route, "/v1/sessions/{id}/processes");
    assert_eq!(r.session.as_deref(), Some(id.as_str()));
    assert_eq!(r.language, vmm::Language::Shell);
    assert_eq!(r.code_sha256, sha(script.as_bytes()));
    assert_eq!(r.code.as_deref(), Some(script));
    assert_eq!((r.exit_code, r.stdout_bytes), (None, 0));
    std::fs::remove_dir_all(&dir).unwrap();
}
