//! Per-key quotas and fair admission against a real server on loopback: a key past its
//! quota gets 429 `key_quota` while another key's job is admitted, and waiting jobs run
//! round robin between keys (seen in the order of the audit log, written by the job
//! thread as each job ends). Needs /dev/kvm.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bud_server::core::audit::{AuditConfig, Record};
use bud_server::core::keys::ApiKeys;
use common::*;
use serde_json::{Value, json};

const ALICE: &str = "alice-0123456789abcdef";
const BOB: &str = "bob-0123456789abcdef00";

/// Holds the one job thread until its client leaves (30 s timeout otherwise).
const HOLD: &str = "import time\nwhile True:\n    time.sleep(1)";

fn health(s: &TestServer) -> Value {
    s.get("/v1/health").json().unwrap()
}

/// Polls (at most 15 s) until `running` jobs run and `queued` wait.
fn wait_for(s: &TestServer, running: u64, queued: u64) {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let h = health(s);
        if h["jobs_running"] == json!(running) && h["jobs_queued"] == json!(queued) {
            return;
        }
        assert!(
            Instant::now() < until,
            "waiting for {running}/{queued}: {h}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A POST /v1/exec on its own connection, answer read later with [`answer`].
fn send(s: &TestServer, key: &str, code: &str) -> TcpStream {
    let body = serde_json::to_vec(&json!({"code": code, "timeout_ms": 30_000})).unwrap();
    let mut c = TcpStream::connect(s.addr).unwrap();
    write!(
        c,
        "POST /v1/exec HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    c.write_all(&body).unwrap();
    c
}

/// The raw answer of a connection made by [`send`].
fn answer(mut c: TcpStream) -> String {
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut all = String::new();
    c.read_to_string(&mut all).unwrap();
    all
}

#[test]
fn a_key_past_its_quota_gets_429_and_waiting_jobs_run_round_robin_between_keys() {
    let dir = std::env::temp_dir().join(format!("bud-quota-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log: PathBuf = dir.join("audit.jsonl");
    let mut config = test_config();
    config.workers = 1;
    config.queue = 4;
    config.key_max_jobs = Some(3);
    config.limits.max_batch_jobs = 1;
    config.limits.max_timeout_ms = 30_000;
    config.limits.default_timeout_ms = 30_000;
    config.api_keys = Some(Arc::new(
        ApiKeys::parse(&format!("alice {ALICE}\nbob {BOB}\n")).unwrap(),
    ));
    config.audit = Some(AuditConfig {
        path: log.clone(),
        content: true,
        required: false,
    });
    let s = TestServer::with_config(config);

    // alice: one job on the only job thread, two waiting; then bob's one.
    let hold = send(&s, ALICE, HOLD);
    wait_for(&s, 1, 0);
    let a2 = send(&s, ALICE, "print('alice-2')");
    wait_for(&s, 1, 1);
    let a3 = send(&s, ALICE, "print('alice-3')");
    wait_for(&s, 1, 2);
    let b1 = send(&s, BOB, "print('bob-1')");
    wait_for(&s, 1, 3);

    // alice's fourth is past her quota of 3; bob still has room (capacity 5).
    let over = client()
        .post(s.url("/v1/exec"))
        .header("x-api-key", ALICE)
        .json(&json!({"code": "print('alice-4')"}))
        .send()
        .unwrap();
    let status = over.status().as_u16();
    let retry = over.headers()["retry-after"].to_str().unwrap().to_owned();
    let body: Value = over.json().unwrap();
    assert_eq!((status, retry.as_str()), (429, "1"), "{body}");
    assert_eq!(body["error"]["code"], "key_quota", "{body}");
    assert_eq!(
        body["error"]["message"],
        "key alice already has 3 jobs running or queued, its quota (--key-max-jobs); retry later"
    );
    let metrics = client()
        .get(s.url("/metrics"))
        .header("x-api-key", BOB)
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(
        metrics.contains("bud_rejected_total{reason=\"key_quota\"} 1\n"),
        "{metrics}"
    );

    // alice's first job leaves; the job thread serves alice, bob, alice.
    hold.shutdown(std::net::Shutdown::Both).unwrap();
    drop(hold);
    for (c, want) in [(a2, "alice-2\\n"), (a3, "alice-3\\n"), (b1, "bob-1\\n")] {
        let a = answer(c);
        assert!(a.starts_with("HTTP/1.1 200 "), "{a}");
        assert!(a.contains(&format!("\"stdout\":\"{want}\"")), "{a}");
    }
    let until = Instant::now() + Duration::from_secs(30);
    while health(&s)["audit"]["written"].as_u64() < Some(4) {
        assert!(Instant::now() < until, "{}", health(&s));
        std::thread::sleep(Duration::from_millis(10));
    }
    let ran: Vec<(String, vmm::Status, String)> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Record>(l).unwrap())
        .map(|r| {
            (
                r.key.unwrap_or_default(),
                r.status,
                r.stdout.unwrap_or_default(),
            )
        })
        .collect();
    let row = |k: &str, st: vmm::Status, out: &str| (k.to_owned(), st, out.to_owned());
    assert_eq!(
        ran,
        [
            row("alice", vmm::Status::Cancelled, ""),
            row("alice", vmm::Status::Ok, "alice-2\n"),
            row("bob", vmm::Status::Ok, "bob-1\n"),
            row("alice", vmm::Status::Ok, "alice-3\n"),
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
