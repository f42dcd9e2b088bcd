//! Session traces through the service: what a session's life writes, the filters, the
//! check, the live stream a client reconnects to, a restart on the same state directory,
//! the quota's refusal, the output budget, and a server that keeps none.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;

use super::{TempDir, cell, job, server_with, stopped};
use crate::core::config::Config;
use crate::core::state::AppState;
use crate::core::trace::{OverQuota, TraceConfig};
use crate::service::error::Error;
use crate::service::sessions::{CreateSession, end, fork, start_fresh};
use crate::service::task::no_sink;
use crate::service::trace::{Filter, check, events, follow, packet, review, spans};

fn traced(dir: &TempDir, trace: TraceConfig) -> AppState {
    server_with(Config {
        state_dir: Some(dir.0.clone()),
        trace,
        ..Config::default()
    })
    .0
}

async fn session(state: &AppState) -> String {
    start_fresh(state, CreateSession::default())
        .await
        .expect("a session")
        .id
        .clone()
}

async fn run(state: &AppState, id: &str, code: &str) {
    crate::service::sessions::cell(state, id, cell(code), "/test", no_sink())
        .await
        .expect("the cell ran");
}

/// Every event of session `id`: (kind, data).
async fn all(state: &AppState, id: &str) -> Vec<(String, Value)> {
    events(state, id, Filter::default())
        .await
        .expect("a trace")
        .into_iter()
        .map(|l| {
            let v: Value = serde_json::from_str(&l.text).expect("a JSON line");
            (l.kind, v["data"].clone())
        })
        .collect()
}

fn kinds(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(k, _)| k.as_str()).collect()
}

#[tokio::test]
async fn a_session_life_is_traced_in_order_and_sealed_when_it_ends() {
    let dir = TempDir::new("trace-life");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;

    run(&state, &id, "print-me").await;
    run(&state, &id, "exit 3").await;
    end(&state, &id).await.unwrap();

    let ev = all(&state, &id).await;
    assert_eq!(kinds(&ev), ["created", "cell", "cell", "ended", "sealed"]);
    assert_eq!(ev[1].1["code"], "print-me");
    assert_eq!(ev[1].1["stdout"], "print-me");
    assert_eq!(ev[1].1["status"], "ok");
    assert_eq!(ev[2].1["exit_code"], 3);
    assert_eq!(ev[2].1["status"], "error");
    assert_eq!(ev[3].1["reason"], "deleted");
    assert_eq!(ev[4].1["events"], 4);
    let c = check(&state, &id).await.unwrap();
    assert!(c.ok, "{c:?}");
    assert!(c.sealed);
    assert_eq!(c.events, 5);
}

#[tokio::test]
async fn a_fork_links_parent_and_children() {
    let dir = TempDir::new("trace-fork");
    let state = traced(&dir, TraceConfig::default());
    let parent = session(&state).await;

    let children = fork(&state, &parent, 2).await.unwrap().ids;

    let ev = all(&state, &parent).await;
    let forked = ev
        .iter()
        .find(|(k, _)| k == "forked")
        .expect("a forked event");
    assert_eq!(forked.1["children"], serde_json::json!(children));
    for child in &children {
        let ev = all(&state, child).await;
        assert_eq!(ev[0].0, "created");
        assert_eq!(ev[0].1["parent"], parent.as_str());
    }
}

#[tokio::test]
async fn a_timeout_and_a_crash_are_traced_with_their_status() {
    let dir = TempDir::new("trace-faults");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;
    let mut hang = cell("hang");
    hang.timeout_ms = Some(10);

    crate::service::sessions::cell(&state, &id, hang, "/test", no_sink())
        .await
        .unwrap();
    run(&state, &id, "crash").await;

    let ev = all(&state, &id).await;
    assert_eq!(kinds(&ev), ["created", "cell", "cell", "ended", "sealed"]);
    assert_eq!(ev[1].1["status"], "timeout");
    assert_eq!(ev[2].1["status"], "crashed");
    assert_eq!(ev[3].1["reason"], "crashed");
    assert!(check(&state, &id).await.unwrap().ok);
}

#[tokio::test]
async fn filters_keep_the_kinds_asked_for_and_the_events_after_a_seq() {
    let dir = TempDir::new("trace-filter");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;
    for code in ["a", "b", "c"] {
        run(&state, &id, code).await;
    }

    let cells = events(
        &state,
        &id,
        Filter {
            kinds: BTreeSet::from(["cell".to_owned()]),
            ..Filter::default()
        },
    )
    .await
    .unwrap();
    let after = events(
        &state,
        &id,
        Filter {
            after: 2,
            ..Filter::default()
        },
    )
    .await
    .unwrap();
    let future = events(
        &state,
        &id,
        Filter {
            since: Some("9999".into()),
            ..Filter::default()
        },
    )
    .await
    .unwrap();

    assert_eq!(cells.iter().map(|l| l.seq).collect::<Vec<_>>(), [2, 3, 4]);
    assert_eq!(after.iter().map(|l| l.seq).collect::<Vec<_>>(), [3, 4]);
    assert!(future.is_empty());
}

#[tokio::test]
async fn a_client_that_drops_ten_times_during_a_busy_session_misses_no_event_and_sees_none_twice() {
    let dir = TempDir::new("trace-follow");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;
    const CELLS: usize = 200;
    let busy = {
        let (state, id) = (state.clone(), id.clone());
        tokio::spawn(async move {
            for i in 0..CELLS {
                run(&state, &id, &format!("cell-{i}")).await;
                // Room for the client to come and go while the session is busy.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            end(&state, &id).await.unwrap();
        })
    };

    let mut seen: Vec<u64> = Vec::new();
    let mut drops = 0;
    loop {
        let mut rx = follow(&state, &id, seen.last().copied().unwrap_or(0))
            .await
            .unwrap();
        // A few events, then the client goes away (ten times), then it reads to the seal.
        let take = if drops < 10 { 7 } else { usize::MAX };
        let mut got = 0;
        let mut sealed = false;
        while got < take {
            let Some(line) = rx.recv().await else { break };
            seen.push(line.seq);
            got += 1;
            if line.kind == "sealed" {
                sealed = true;
                break;
            }
        }
        drop(rx);
        if sealed {
            break;
        }
        drops += 1;
        if drops == 10 {
            // All ten drops came while the session was still running cells.
            assert!(state.sessions().get(&id).is_ok(), "the session ended first");
        }
        assert!(drops < 1000, "the stream never reached the seal");
    }
    busy.await.unwrap();

    // created, the cells, ended, sealed: each once, in order.
    let want: Vec<u64> = (1..=(CELLS as u64 + 3)).collect();
    assert!(drops >= 10, "dropped {drops} times");
    assert_eq!(seen, want);
}

#[tokio::test]
async fn a_restarted_server_reads_and_checks_the_traces_of_the_last_one() {
    let dir = TempDir::new("trace-restart");
    let (ended, lost) = {
        let state = traced(&dir, TraceConfig::default());
        let ended = session(&state).await;
        run(&state, &ended, "kept").await;
        end(&state, &ended).await.unwrap();
        let lost = session(&state).await;
        run(&state, &lost, "running").await;
        // The server stops with `lost` running (as a kill would leave it).
        stopped(state).await;
        (ended, lost)
    };

    let state = traced(&dir, TraceConfig::default());

    let ev = all(&state, &ended).await;
    assert_eq!(kinds(&ev), ["created", "cell", "ended", "sealed"]);
    assert!(check(&state, &ended).await.unwrap().ok);
    let ev = all(&state, &lost).await;
    assert_eq!(kinds(&ev), ["created", "cell", "ended", "sealed"]);
    assert_eq!(ev[2].1["reason"], "lost");
    let c = check(&state, &lost).await.unwrap();
    assert!(c.ok && c.sealed, "{c:?}");
}

#[tokio::test]
async fn a_tampered_trace_fails_its_check_at_the_line_changed() {
    let dir = TempDir::new("trace-tamper");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;
    run(&state, &id, "honest").await;
    end(&state, &id).await.unwrap();
    let file = state.traces().unwrap().file_of(&id).unwrap();
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, text.replacen("honest", "hacked", 2)).unwrap();

    let c = check(&state, &id).await.unwrap();

    assert!(!c.ok);
    assert!(c.broken.as_deref().unwrap().contains("line 2"), "{c:?}");
}

#[tokio::test]
async fn over_its_quota_with_refuse_the_server_refuses_new_sessions() {
    let dir = TempDir::new("trace-refuse");
    let state = traced(
        &dir,
        TraceConfig {
            quota_mib: 1,
            over_quota: OverQuota::Refuse,
            ..TraceConfig::default()
        },
    );
    let first = session(&state).await;
    // Cells of 60 KiB (their code and their output kept) until the trace holds its MiB.
    let big = "x".repeat(60 << 10);
    let mut cells = 0;
    while !state.traces().unwrap().refuses_sessions() {
        run(&state, &first, &big).await;
        cells += 1;
        assert!(cells < 100, "the quota was never reached");
    }

    let e = start_fresh(&state, CreateSession::default())
        .await
        .unwrap_err();

    assert!(
        matches!(e, Error::TraceQuota { used, quota: 1048576 } if used >= 1048576),
        "{e:?}"
    );
    assert!(state.sessions().get(&first).is_ok());
}

#[tokio::test]
async fn output_past_the_budget_is_cut_and_the_cut_said() {
    let dir = TempDir::new("trace-budget");
    let state = traced(
        &dir,
        TraceConfig {
            output_mib: 0,
            ..TraceConfig::default()
        },
    );
    let id = session(&state).await;

    run(&state, &id, "twelve-bytes").await;

    let ev = all(&state, &id).await;
    assert_eq!(ev[1].1["stdout"], "");
    assert_eq!(ev[1].1["stdout_bytes"], 12);
    assert_eq!(ev[1].1["stdout_cut"], 12);
    assert_eq!(ev[1].1["output_bytes_kept"], 0);
}

#[tokio::test]
async fn a_server_that_keeps_no_traces_says_so() {
    let dir = TempDir::new("trace-off");
    let state = traced(
        &dir,
        TraceConfig {
            off: true,
            ..TraceConfig::default()
        },
    );
    let id = session(&state).await;

    let e = events(&state, &id, Filter::default()).await.unwrap_err();

    assert!(matches!(&e, Error::NoTrace(s) if *s == id), "{e:?}");
    assert!(state.traces().is_none());
}

#[tokio::test]
async fn a_client_that_falls_far_behind_the_live_events_still_gets_each_once() {
    let dir = TempDir::new("trace-lag");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;
    let mut rx = follow(&state, &id, 0).await.unwrap();
    // More events than the live backlog holds, none read meanwhile.
    let cells = crate::core::trace::LIVE_BACKLOG + 200;
    for i in 0..cells {
        run(&state, &id, &format!("c{i}")).await;
    }
    end(&state, &id).await.unwrap();

    let mut seen = Vec::new();
    while let Some(line) = rx.recv().await {
        seen.push(line.seq);
    }

    let want: Vec<u64> = (1..=(cells as u64 + 3)).collect();
    assert_eq!(seen, want);
}

#[tokio::test]
async fn the_review_page_shows_each_cell_escaped_the_verdict_and_the_fork_links() {
    let dir = TempDir::new("trace-review");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;
    run(&state, &id, "<b>bold</b>").await;
    run(&state, &id, "exit 3").await;
    let children = fork(&state, &id, 1).await.unwrap().ids;
    end(&state, &id).await.unwrap();

    let page = review(&state, &id).await.unwrap();
    let child = review(&state, &children[0]).await.unwrap();

    assert!(page.starts_with("<!doctype html>"));
    assert!(
        page.contains("chain whole, 6 events, sealed, signature verified"),
        "{page}"
    );
    assert!(page.contains("&lt;b&gt;bold&lt;/b&gt;"));
    assert!(!page.contains("<b>bold</b>"));
    assert!(page.contains(" · exit 3"));
    assert!(page.contains("2 cells (1 not ok)"));
    assert!(page.contains(&format!("href=\"../{}/review\"", children[0])));
    assert!(child.contains(&format!("href=\"../{id}/review\"")));
    assert!(child.contains("open (not sealed yet)"), "{child}");
}

#[tokio::test]
async fn the_otlp_export_has_a_session_span_with_a_child_per_cell_and_the_same_ids_twice() {
    let dir = TempDir::new("trace-otlp");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;
    run(&state, &id, "one").await;
    run(&state, &id, "exit 2").await;
    end(&state, &id).await.unwrap();

    let first = spans(&state, &id).await.unwrap();
    let again = spans(&state, &id).await.unwrap();

    assert_eq!(first, again);
    let spans = first["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array()
        .expect("spans")
        .clone();
    assert_eq!(spans.len(), 3, "{spans:?}");
    let root = &spans[0];
    assert_eq!(root["name"], "session");
    assert!(root.get("parentSpanId").is_none(), "{root}");
    for s in &spans {
        assert_eq!(s["traceId"], root["traceId"]);
    }
    let cells: Vec<&Value> = spans[1..].iter().collect();
    for c in &cells {
        assert_eq!(c["parentSpanId"], root["spanId"]);
    }
    assert_eq!(cells[0]["status"]["code"], 1);
    assert_eq!(cells[1]["status"]["code"], 2);
    let events: Vec<&str> = root["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["created", "ended", "sealed"]);
}

#[tokio::test]
async fn the_packet_holds_the_trace_byte_for_byte_and_is_the_same_twice() {
    let dir = TempDir::new("trace-packet");
    let state = traced(&dir, TraceConfig::default());
    let id = session(&state).await;
    run(&state, &id, "hello").await;
    end(&state, &id).await.unwrap();

    let gz = packet(&state, &id).await.unwrap();

    assert_eq!(gz, packet(&state, &id).await.unwrap());
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(gz.as_slice()));
    let mut entries = Vec::new();
    for entry in tar.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().to_string_lossy().into_owned();
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut body).unwrap();
        entries.push((name, body));
    }
    let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    let want: Vec<String> = [
        "README.txt",
        "trace.ndjson",
        "verify.json",
        "seal.json",
        "files.json",
        "review.html",
        "otlp.json",
    ]
    .iter()
    .map(|f| format!("{id}/{f}"))
    .collect();
    assert_eq!(names, want);
    let lines = events(&state, &id, Filter::default()).await.unwrap();
    let joined: String = lines.iter().map(|l| format!("{}\n", l.text)).collect();
    assert_eq!(String::from_utf8_lossy(&entries[1].1), joined);
    let verify: Value = serde_json::from_slice(&entries[2].1).unwrap();
    assert_eq!(verify["ok"], true);
    assert_eq!(verify["sealed"], true);
    assert_eq!(entries[4].1, b"[]");
}

#[tokio::test]
async fn review_otlp_and_packet_of_an_unknown_session_are_no_trace() {
    let dir = TempDir::new("trace-unknown");
    let state = traced(&dir, TraceConfig::default());
    let id = "ses-none";

    let errors = [
        review(&state, id).await.unwrap_err(),
        spans(&state, id).await.unwrap_err(),
        packet(&state, id).await.unwrap_err(),
    ];

    for e in errors {
        assert!(matches!(&e, Error::NoTrace(s) if s == id), "{e:?}");
    }
}

#[tokio::test]
async fn a_one_shot_job_that_asks_is_traced_alone_and_sealed_and_one_that_does_not_is_not() {
    let dir = TempDir::new("trace-job");
    let state = traced(&dir, TraceConfig::default());
    let mut asked = job("exit 5");
    asked.trace = true;

    let ran = crate::service::jobs::run(&state, asked, no_sink())
        .await
        .unwrap();
    let plain = crate::service::jobs::run(&state, job("plain"), no_sink())
        .await
        .unwrap();

    let id = ran.trace.expect("a trace id");
    assert!(id.starts_with("job_"), "{id}");
    assert_eq!(plain.trace, None);
    let ev = all(&state, &id).await;
    assert_eq!(kinds(&ev), ["created", "cell", "ended", "sealed"]);
    assert_eq!(ev[0].1["one_shot"], true);
    assert_eq!(ev[0].1["route"], "/test");
    assert_eq!(ev[1].1["code"], "exit 5");
    assert_eq!(ev[1].1["exit_code"], 5);
    assert_eq!(ev[2].1["reason"], "finished");
    let c = check(&state, &id).await.unwrap();
    assert!(c.ok && c.sealed, "{c:?}");
    assert!(state.traces().unwrap().usage().0 > 0);
    assert_eq!(
        state
            .traces()
            .unwrap()
            .counts
            .events
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
}

#[tokio::test]
async fn a_trace_asked_of_a_server_without_traces_or_of_a_session_cell_is_a_clear_error() {
    let dir = TempDir::new("trace-job-refused");
    let off = traced(
        &dir,
        TraceConfig {
            off: true,
            ..TraceConfig::default()
        },
    );
    let mut asked = job("x");
    asked.trace = true;
    let on = traced(&TempDir::new("trace-cell-refused"), TraceConfig::default());
    let id = session(&on).await;
    let mut traced_cell = cell("x");
    traced_cell.trace = true;

    let e = crate::service::jobs::run(&off, asked, no_sink())
        .await
        .unwrap_err();
    let c = crate::service::sessions::cell(&on, &id, traced_cell, "/test", no_sink())
        .await
        .unwrap_err();

    assert!(
        matches!(&e, Error::Invalid { field: Some(f), .. } if f == "trace"),
        "{e:?}"
    );
    assert!(e.to_string().contains("keeps no traces"), "{e}");
    assert!(
        matches!(&c, Error::Invalid { field: Some(f), .. } if f == "trace"),
        "{c:?}"
    );
    assert!(c.to_string().contains("always traced"), "{c}");
}

#[tokio::test]
async fn a_traced_one_shot_job_past_the_quota_with_refuse_is_refused() {
    let dir = TempDir::new("trace-job-quota");
    let state = traced(
        &dir,
        TraceConfig {
            quota_mib: 0,
            over_quota: OverQuota::Refuse,
            ..TraceConfig::default()
        },
    );
    let mut asked = job("x");
    asked.trace = true;

    let e = crate::service::jobs::run(&state, asked, no_sink())
        .await
        .unwrap_err();
    let plain = crate::service::jobs::run(&state, job("plain"), no_sink()).await;

    assert!(matches!(e, Error::TraceQuota { .. }), "{e:?}");
    assert!(plain.is_ok(), "an untraced job is not refused: {plain:?}");
}
