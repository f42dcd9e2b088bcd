//! Sessions leave nothing behind: 100 created and deleted over the real server, with the
//! process's RSS, threads and fds compared. A test binary of its own, so no other test's
//! threads or memory run beside it. Needs /dev/kvm.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

fn proc_status(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Polls (at most 30 s) until no session is left and no job runs or waits: every VM the
/// sessions held has been ended and handed back.
fn settle(s: &TestServer) {
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while s.state.sessions().count() != 0 || s.state.jobs().running() + s.state.jobs().queued() != 0
    {
        assert!(std::time::Instant::now() < until, "sessions never settled");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_hundred_sessions_created_and_deleted_leave_nothing_behind() {
    let s = TestServer::start();
    let cycle = || {
        let (status, r) = s.post("/v1/sessions", &json!({}));
        assert_eq!(status, 201, "{r}");
        let id = r["id"].as_str().unwrap();
        let (status, r) = s.post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"code": "x = 1"}),
        );
        assert_eq!((status, &r["status"]), (200, &json!("ok")), "{r}");
        let gone = client()
            .delete(s.url(&format!("/v1/sessions/{id}")))
            .send()
            .unwrap();
        assert_eq!(gone.status().as_u16(), 204);
    };
    for _ in 0..10 {
        cycle();
    }
    settle(&s);
    let (rss, threads, fds) = (proc_status("VmRSS:"), proc_status("Threads:"), open_fds());

    for _ in 0..100 {
        cycle();
    }
    settle(&s);
    // tokio keeps an idle blocking-pool thread for 10 s, and how many the pool started depends
    // on how the cycles overlapped (on a slow machine two can, and one more thread appears):
    // a thread still there after 15 s is a leak, one that leaves was the pool's.
    let until = std::time::Instant::now() + Duration::from_secs(15);
    while proc_status("Threads:") > threads && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (rss2, threads2, fds2) = (proc_status("VmRSS:"), proc_status("Threads:"), open_fds());

    assert_eq!(s.state.sessions().count(), 0);
    assert!(
        threads2 <= threads,
        "threads grew from {threads} to {threads2}"
    );
    assert!(fds2 <= fds + 2, "fds grew from {fds} to {fds2}");
    assert!(
        rss2 <= rss + 16 * 1024,
        "RSS grew from {rss} kB to {rss2} kB"
    );
}
