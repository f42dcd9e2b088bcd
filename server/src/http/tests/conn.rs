//! The accept loop as a client sees it: bodies too large to read, requests trickled past
//! their time limits, idle connections, a client that stays to the end of its stream, and
//! a graceful shutdown that lets the job in flight finish.

use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{PATIENCE, Served, read_all, test_config, until};

#[tokio::test]
async fn a_body_too_huge_to_drain_is_refused_before_it_is_read() {
    let s = Served::start().await;
    let head = format!(
        "POST /v1/exec HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n",
        1u64 << 40
    );

    let answer = read_all(s.raw(&head, b"").await).await;

    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("body_too_large"), "{answer}");
    s.assert_still_serving().await;
}

#[tokio::test]
async fn a_body_trickled_past_the_time_limit_is_408_and_the_server_keeps_serving() {
    let mut config = test_config();
    config.limits.body_timeout_ms = 300;
    let s = Served::with_config(config).await;
    // Headers promise 100 bytes; 10 come, then nothing.
    let head = "POST /v1/exec HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                content-length: 100\r\n";
    let mut c = s.raw(head, b"{\"code\": ").await;

    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.ends_with(b"}") {
        let n = tokio::time::timeout(PATIENCE, c.read(&mut buf))
            .await
            .expect("the server answered in time")
            .expect("the server answered");
        assert!(n > 0, "closed without an answer: {answer:?}");
        answer.extend_from_slice(&buf[..n]);
    }

    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408 "), "{text}");
    assert!(text.contains("\"code\":\"request_timeout\""), "{text}");
    s.assert_still_serving().await;
}

#[tokio::test]
async fn headers_trickled_past_the_time_limit_are_408_and_an_idle_connection_is_closed_silently() {
    let mut config = test_config();
    config.limits.header_timeout_ms = 300;
    let s = Served::with_config(config).await;

    // A request line and one header, then a byte every 50 ms: past 300 ms it is cut off.
    let mut slow = TcpStream::connect(s.addr).await.unwrap();
    slow.write_all(b"POST /v1/exec HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    for b in b"x-slow: 0123456789012345678901234567890123456789"
        .iter()
        .cycle()
    {
        // Ends when the server closes the connection; a write to it may then fail.
        match tokio::time::timeout(Duration::from_millis(50), slow.read(&mut buf)).await {
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => panic!("{e}: {answer:?}"),
            Err(_) => {
                if slow.write_all(&[*b]).await.is_err() {
                    break;
                }
            }
        }
    }
    answer.extend_from_slice(read_all(slow).await.as_bytes());
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
        json!({"error": {"code": "request_timeout", "field": null,
            "message": "the request headers did not arrive within 300ms"}})
    );

    // A connection that never sends anything is closed without an answer.
    let idle = TcpStream::connect(s.addr).await.unwrap();
    assert_eq!(read_all(idle).await, "");
    s.assert_still_serving().await;
}

/// Counted `cancelled` jobs in `/metrics`.
async fn cancelled(s: &Served) -> u64 {
    let text = s.metrics(None).await;
    text.lines()
        .find_map(|l| l.strip_prefix("bud_jobs_total{status=\"cancelled\"} "))
        .map_or(0, |n| n.parse().unwrap())
}

#[tokio::test]
async fn a_client_that_stays_gets_its_result_and_nothing_is_cancelled() {
    let mut config = test_config();
    config.workers = 1;
    config.queue = 1;
    config.limits.max_batch_jobs = 1;
    let s = Served::with_config(config).await;
    let mut c = s
        .raw_post("/v1/exec/stream", "", &json!({"code": "streamed"}))
        .await;

    let mut all = String::new();
    let mut buf = [0u8; 4096];
    while !all.contains("\"type\":\"result\"") {
        let n = tokio::time::timeout(PATIENCE, c.read(&mut buf))
            .await
            .expect("the stream went on in time")
            .unwrap();
        assert!(n > 0, "stream ended early: {all}");
        all.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    drop(c);

    assert!(all.contains("\"status\":\"ok\""), "{all}");
    // The job's status is counted before its result line goes out, and leaving after that
    // line cancels nothing.
    assert_eq!(cancelled(&s).await, 0);
    let (status, r) = s.exec(json!({"code": "next"})).await;
    assert_eq!((status, &r["stdout"]), (200, &json!("next")), "{r}");
    assert_eq!(cancelled(&s).await, 0);
}

#[tokio::test]
async fn graceful_shutdown_finishes_the_job_in_flight() {
    let mut s = Served::start().await;
    let in_flight = {
        let req = s.client.post(s.url("/v1/exec"));
        tokio::spawn(async move {
            let r = req.json(&json!({"code": "wait finish"})).send().await;
            super::answer(r.expect("an answer")).await
        })
    };
    let engine = s.engine.clone();
    until("the job runs", || {
        let running = engine.counts().running;
        async move { (running == 1, format!("{running} running")) }
    })
    .await;

    let opener = {
        let engine = s.engine.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            engine.open("finish");
        })
    };
    s.shutdown().await;
    let (status, r) = in_flight.await.unwrap();
    opener.await.unwrap();
    let after = s.client.get(s.url("/v1/health")).send().await;

    assert_eq!((status, &r["stdout"]), (200, &json!("wait finish")), "{r}");
    assert!(after.is_err(), "the server still answers after shutdown");
}
