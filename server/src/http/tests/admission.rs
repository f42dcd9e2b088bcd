//! Admission as a client sees it: the memory budget (503), a key's quota (429) and the
//! round robin between keys' waiting jobs, and an audit log that cannot be written.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};
use tokio::net::TcpStream;

use super::{Served, read_all, test_config, until};
use crate::core::audit::{AuditConfig, Record};
use crate::core::keys::ApiKeys;

const ALICE: &str = "alice-0123456789abcdef";
const BOB: &str = "bob-0123456789abcdef00";

/// A directory of its own for one test (removed when dropped).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("bud-http-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test]
async fn over_the_memory_budget_jobs_get_503_with_retry_after_and_under_it_they_run() {
    let mut tight = test_config();
    // Less than any process holds: every admission is over it.
    tight.memory_budget_bytes = Some(1 << 20);
    let s = Served::with_config(tight).await;
    let r = s
        .client
        .post(s.url("/v1/exec"))
        .json(&json!({"code": "x"}))
        .send()
        .await
        .unwrap();
    let retry = r.headers()["retry-after"].to_str().unwrap().to_owned();
    let (status, body) = super::answer(r).await;
    let (session_status, session) = s.post("/v1/sessions", &json!({})).await;
    let metrics = s.metrics(None).await;

    let mut roomy = test_config();
    roomy.memory_budget_bytes = Some(1 << 40);
    let roomy = Served::with_config(roomy).await;
    let (ok_status, ok) = roomy.exec(json!({"code": "x"})).await;

    assert_eq!((status, retry.as_str()), (503, "1"), "{body}");
    assert_eq!(body["error"]["code"], "memory_budget", "{body}");
    assert_eq!(
        (session_status, &session["error"]["code"]),
        (503, &json!("memory_budget"))
    );
    assert!(
        metrics.contains("bud_rejected_total{reason=\"memory_budget\"} 2\n"),
        "{metrics}"
    );
    assert_eq!((ok_status, &ok["status"]), (200, &json!("ok")), "{ok}");
    assert_eq!(s.engine.counts().jobs + s.engine.counts().started, 0);
}

/// Polls health until `running` jobs run and `queued` wait.
async fn wait_for(s: &Served, running: u64, queued: u64) {
    until("jobs running and queued", || async move {
        let (_, h) = s.get("/v1/health").await;
        let done = h["jobs_running"] == json!(running) && h["jobs_queued"] == json!(queued);
        (done, format!("want {running}/{queued}: {h}"))
    })
    .await;
}

/// A POST /v1/exec of `code` with `key` on its own connection (answer read later).
async fn send(s: &Served, key: &str, code: &str) -> TcpStream {
    let extra = format!("x-api-key: {key}\r\nconnection: close\r\n");
    let body = json!({"code": code, "timeout_ms": 30_000});
    s.raw_post("/v1/exec", &extra, &body).await
}

/// Polls health until the audit writer has written `n` records, then reads them.
async fn records(s: &Served, log: &std::path::Path, n: u64) -> Vec<Record> {
    until("the records written", || async move {
        let (_, h) = s.get("/v1/health").await;
        (h["audit"]["written"].as_u64() >= Some(n), h.to_string())
    })
    .await;
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[tokio::test]
async fn a_key_past_its_quota_gets_429_and_waiting_jobs_run_round_robin_between_keys() {
    let dir = Scratch::new("quota");
    let log = dir.0.join("audit.jsonl");
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
    let s = Served::with_config(config).await;

    // alice: one job on the only job thread, two waiting; then bob's one.
    let hold = send(&s, ALICE, "hang").await;
    wait_for(&s, 1, 0).await;
    let a2 = send(&s, ALICE, "alice-2").await;
    wait_for(&s, 1, 1).await;
    let a3 = send(&s, ALICE, "alice-3").await;
    wait_for(&s, 1, 2).await;
    let b1 = send(&s, BOB, "bob-1").await;
    wait_for(&s, 1, 3).await;

    // alice's fourth is past her quota of 3; bob still has room (capacity 5).
    let over = s
        .client
        .post(s.url("/v1/exec"))
        .header("x-api-key", ALICE)
        .json(&json!({"code": "alice-4"}))
        .send()
        .await
        .unwrap();
    let retry = over.headers()["retry-after"].to_str().unwrap().to_owned();
    let (status, body) = super::answer(over).await;
    assert_eq!((status, retry.as_str()), (429, "1"), "{body}");
    assert_eq!(body["error"]["code"], "key_quota", "{body}");
    assert_eq!(
        body["error"]["message"],
        "key alice already has 3 jobs running or queued, its quota (--key-max-jobs); retry later"
    );
    let metrics = s.metrics(Some(BOB)).await;
    assert!(
        metrics.contains("bud_rejected_total{reason=\"key_quota\"} 1\n"),
        "{metrics}"
    );

    // alice's first job leaves; the job thread serves alice, bob, alice.
    drop(hold);
    for (c, want) in [(a2, "alice-2"), (a3, "alice-3"), (b1, "bob-1")] {
        let a = read_all(c).await;
        assert!(a.starts_with("HTTP/1.1 200 "), "{a}");
        assert!(a.contains(&format!("\"stdout\":\"{want}\"")), "{a}");
    }
    let ran: Vec<(String, vmm::Status, String)> = records(&s, &log, 4)
        .await
        .into_iter()
        .map(|r| {
            let key = r.key.unwrap_or_default();
            (key, r.status, r.stdout.unwrap_or_default())
        })
        .collect();
    let row = |k: &str, st: vmm::Status, out: &str| (k.to_owned(), st, out.to_owned());
    assert_eq!(
        ran,
        [
            row("alice", vmm::Status::Cancelled, ""),
            row("alice", vmm::Status::Ok, "alice-2"),
            row("bob", vmm::Status::Ok, "bob-1"),
            row("alice", vmm::Status::Ok, "alice-3"),
        ]
    );
}

/// A server with key `alice` whose audit log is a directory: it cannot be written.
async fn unwritable_log(dir: &Scratch, required: bool) -> Served {
    let log = dir.0.join("audit.jsonl");
    std::fs::create_dir_all(&log).unwrap();
    let mut config = test_config();
    config.api_keys = Some(Arc::new(
        ApiKeys::parse(&format!("alice {ALICE}\n")).unwrap(),
    ));
    config.audit = Some(AuditConfig {
        path: log,
        content: false,
        required,
    });
    Served::with_config(config).await
}

async fn audit_health(s: &Served) -> Value {
    s.get("/v1/health").await.1["audit"].clone()
}

#[tokio::test]
async fn a_log_that_cannot_be_written_refuses_jobs_when_required_and_says_so() {
    let dir = Scratch::new("unwritable");
    let s = unwritable_log(&dir, true).await;
    until("the log failing", || async {
        let a = audit_health(&s).await;
        (a["failing"] == json!(true), a.to_string())
    })
    .await;

    let (status, r) = s
        .post_as(Some(ALICE), "/v1/exec", &json!({"code": "x"}))
        .await;

    assert_eq!(
        (status, &r["error"]["code"]),
        (503, &json!("audit_unavailable"))
    );
    let a = audit_health(&s).await;
    assert!(a["error"].as_str().unwrap().contains("cannot open"), "{a}");
    assert!(
        s.metrics(Some(ALICE))
            .await
            .contains("bud_audit_failing 1\n")
    );
    assert_eq!(s.engine.counts().jobs, 0);
}

#[tokio::test]
async fn without_required_a_failing_log_counts_what_it_lost_and_jobs_still_run() {
    let dir = Scratch::new("lossy");
    let s = unwritable_log(&dir, false).await;

    let (status, r) = s
        .post_as(Some(ALICE), "/v1/exec", &json!({"code": "ran"}))
        .await;

    assert_eq!((status, &r["stdout"]), (200, &json!("ran")));
    until("the record dropped", || async {
        let a = audit_health(&s).await;
        (a["dropped"] == json!(1), a.to_string())
    })
    .await;
    assert_eq!(audit_health(&s).await["failing"], json!(true));
}
