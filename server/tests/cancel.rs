//! A client that goes away cancels its job: the vCPU is kicked, the job ends `cancelled`
//! (counted in the metrics), and its job thread is free for the next job long before the
//! job's own end. A session cell is interrupted instead, and its session goes on. Real server on loopback, real guest; needs /dev/kvm.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// A job that would hold its job thread until its 30 s timeout. Its first line reaches the
/// client while it runs: a streamed job's output is taken every 50 ms.
const LONG: &str = "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(1)";

fn one_worker() -> TestServer {
    let mut config = test_config();
    config.workers = 1;
    // One waiting place: a job's answer goes out before its VM is reset and its slot
    // returned, so a client's next request may arrive before that.
    config.queue = 1;
    config.limits.max_timeout_ms = 30_000;
    config.limits.default_timeout_ms = 30_000;
    config.limits.max_batch_jobs = 1;
    TestServer::with_config(config)
}

fn cancelled_count(s: &TestServer) -> u64 {
    let text = s.get("/metrics").text().unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("bud_jobs_total{status=\"cancelled\"} "))
        .map(|n| n.parse().unwrap())
        .unwrap_or(0)
}

/// Waits (polling, at most 15 s: well under the job's 30 s) for `n` cancelled jobs, then
/// for the job thread to give its slot back (its VM is discarded after the result).
fn wait_cancelled(s: &TestServer, n: u64) {
    let until = Instant::now() + Duration::from_secs(15);
    let idle = |s: &TestServer| {
        let h: serde_json::Value = s.get("/v1/health").json().unwrap();
        h["jobs_running"] == json!(0) && h["jobs_queued"] == json!(0)
    };
    while cancelled_count(s) < n || !idle(s) {
        assert!(
            Instant::now() < until,
            "the job was not cancelled: it still holds its worker"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls (at most 10 s) until one job runs (the metrics' running gauge).
fn wait_running(s: &TestServer) {
    let until = Instant::now() + Duration::from_secs(10);
    while !s
        .get("/metrics")
        .text()
        .unwrap()
        .contains("bud_jobs_running 1\n")
    {
        assert!(Instant::now() < until, "the job never started");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends a raw HTTP/1.1 POST of `body` to `path` on a fresh connection.
fn raw_post(s: &TestServer, path: &str, body: &serde_json::Value) -> TcpStream {
    let mut c = TcpStream::connect(s.addr).unwrap();
    let body = serde_json::to_vec(body).unwrap();
    write!(
        c,
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    c.write_all(&body).unwrap();
    c
}

#[test]
fn a_streaming_client_that_leaves_after_the_first_chunk_cancels_its_job() {
    let s = one_worker();
    let c = raw_post(
        &s,
        "/v1/exec/stream",
        &json!({"code": LONG, "timeout_ms": 30_000}),
    );
    read_until(c, "started"); // then the client goes away

    wait_cancelled(&s, 1);
    // The only job thread is free again (wait_cancelled saw it idle): a job runs now.
    let (status, r) = s.exec(json!({"code": "print('next')"}));
    assert_eq!((status, &r["stdout"]), (200, &json!("next\n")), "{r}");
}

#[test]
fn a_client_that_disconnects_from_a_plain_job_cancels_it() {
    let s = one_worker();
    let c = raw_post(&s, "/v1/exec", &json!({"code": LONG, "timeout_ms": 30_000}));
    // Wait until the job runs, then leave.
    wait_running(&s);
    c.shutdown(std::net::Shutdown::Both).unwrap();
    drop(c);

    wait_cancelled(&s, 1);
    let (status, r) = s.exec(json!({"code": "print('next')"}));
    assert_eq!((status, &r["stdout"]), (200, &json!("next\n")), "{r}");
}

#[test]
fn a_shutdown_cancels_what_still_runs_after_its_grace_period() {
    let mut config = test_config();
    config.workers = 1;
    config.queue = 1;
    config.limits.max_timeout_ms = 30_000;
    config.limits.default_timeout_ms = 30_000;
    config.limits.max_batch_jobs = 1;
    config.shutdown_grace_s = 1;
    let mut s = TestServer::with_config(config);
    let c = raw_post(&s, "/v1/exec", &json!({"code": LONG, "timeout_ms": 30_000}));
    wait_running(&s);

    // The shutdown waits for the request, the grace period passes, the job is cancelled:
    // its client (still there) gets the job's answer with that status, not a timeout.
    let reader = std::thread::spawn(move || {
        let mut c = c;
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut all = String::new();
        let _ = c.read_to_string(&mut all);
        all
    });
    s.shutdown();
    let answer = reader.join().unwrap();

    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.contains("\"status\":\"cancelled\""), "{answer}");
    assert!(answer.contains("\"stdout\":\"started\\n\""), "{answer}");
}

/// Reads `c`'s response lines until one contains `what`.
fn read_until(c: TcpStream, what: &str) {
    let mut lines = BufReader::new(c);
    let mut seen = String::new();
    while !seen.contains(what) {
        let mut line = String::new();
        assert!(
            lines.read_line(&mut line).unwrap() > 0,
            "stream ended: {seen}"
        );
        seen.push_str(&line);
    }
}

/// A session cell whose client goes away (a stream after its first chunk, a plain request
/// while it runs) is cancelled as a timeout is handled: interrupted, counted `cancelled`,
/// its job thread freed, and the session goes on with its state.
#[test]
fn a_session_cell_whose_client_leaves_is_interrupted_and_the_session_goes_on() {
    let s = one_worker();
    let (status, r) = s.post("/v1/sessions", &json!({}));
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    let exec = format!("/v1/sessions/{id}/exec");
    let (status, r) = s.post(&exec, &json!({"code": "x = 41"}));
    assert_eq!((status, &r["status"]), (200, &json!("ok")), "{r}");

    let long = json!({"code": LONG, "timeout_ms": 30_000});
    let streamed = raw_post(&s, &format!("/v1/sessions/{id}/exec/stream"), &long);
    read_until(streamed, "started");
    wait_cancelled(&s, 1);

    let plain = raw_post(&s, &exec, &long);
    wait_running(&s);
    plain.shutdown(std::net::Shutdown::Both).unwrap();
    drop(plain);
    wait_cancelled(&s, 2);

    let (status, r) = s.post(&exec, &json!({"code": "print(x + 1)"}));
    assert_eq!((status, &r["status"]), (200, &json!("ok")), "{r}");
    assert_eq!(r["stdout"], json!("42\n"), "{r}");
}
