//! Session traces through a real, jailed `bud serve` on a state directory: the live event
//! stream over HTTP (Server-Sent Events) resumed with `Last-Event-ID`, the NDJSON trace and
//! its filters, a kill -9 of the server in the middle of a cell (the trace up to the last
//! completed event intact, sealed `lost` by the next server), and `bud trace verify` on the
//! downloaded trace: whole, then tampered. Needs /dev/kvm.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Command;
use std::time::Duration;

use common::served::{Served, own_state_dir, serve};
use serde_json::{Value, json};

fn request(s: &Served, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
    let req = ureq::request(method, &format!("{}{path}", s.base)).timeout(Duration::from_secs(120));
    let r = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    match r {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(status, r)) => (status, r.into_string().unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    }
}

fn json_of(s: &Served, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let (status, text) = request(s, method, path, body);
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn cell(s: &Served, id: &str, code: &str) -> Value {
    let (status, r) = json_of(
        s,
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "code": code })),
    );
    assert_eq!(status, 200, "{r}");
    r
}

/// Reads `count` SSE events (id, event, data) from `/events`, resuming after `last`.
fn sse(s: &Served, id: &str, last: Option<u64>, count: usize) -> Vec<(u64, String, Value)> {
    let mut req =
        ureq::get(&format!("{}/v1/sessions/{id}/events", s.base)).timeout(Duration::from_secs(60));
    if let Some(l) = last {
        req = req.set("Last-Event-ID", &l.to_string());
    }
    let r = req.call().expect("the event stream");
    assert_eq!(r.status(), 200);
    assert!(r.content_type().starts_with("text/event-stream"));
    let mut out = Vec::new();
    let (mut seq, mut kind, mut data) = (None, String::new(), String::new());
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.expect("a line of the stream");
        if let Some(v) = line.strip_prefix("id:") {
            seq = Some(v.trim().parse::<u64>().unwrap());
        } else if let Some(v) = line.strip_prefix("event:") {
            kind = v.trim().to_owned();
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push_str(v.trim_start());
        } else if line.is_empty() && seq.is_some() {
            out.push((
                seq.take().unwrap(),
                std::mem::take(&mut kind),
                serde_json::from_str(&std::mem::take(&mut data)).unwrap(),
            ));
            if out.len() == count {
                break;
            }
        }
    }
    out
}

fn bud_verify(file: &std::path::Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bud"))
        .args(["trace", "verify"])
        .arg(file)
        .args(args)
        .output()
        .expect("running bud trace verify");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn a_session_trace_streams_resumes_survives_a_kill_and_verifies() {
    common::require_kvm();
    let mut s = serve(&[]);
    let dir = own_state_dir(s.port);
    let dir_arg = dir.to_string_lossy().into_owned();
    s.wait_ready();
    let (status, r) = json_of(&s, "POST", "/v1/sessions", Some(json!({})));
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    cell(&s, &id, "print('one')");
    cell(&s, &id, "import sys; sys.exit(3)");
    let put = ureq::put(&format!("{}/v1/sessions/{id}/files/notes.txt", s.base))
        .send_string("notes")
        .expect("a file written");
    assert_eq!(put.status(), 204);

    // The stream from the start, dropped after two events, resumed after the second.
    let first = sse(&s, &id, None, 2);
    let rest = sse(&s, &id, Some(first[1].0), 2);
    let seqs: Vec<u64> = first.iter().chain(&rest).map(|e| e.0).collect();
    assert_eq!(seqs, [1, 2, 3, 4]);
    assert_eq!(first[0].1, "created");
    assert_eq!(first[1].2["data"]["stdout"], "one\n");
    assert_eq!(rest[0].2["data"]["exit_code"], 3);
    assert_eq!(rest[1].1, "file_written");

    // The NDJSON trace, and a filter.
    let (status, cells) = request(
        &s,
        "GET",
        &format!("/v1/sessions/{id}/trace?kind=cell"),
        None,
    );
    assert_eq!(status, 200, "{cells}");
    assert_eq!(cells.lines().count(), 2);

    // The server killed while a cell runs: the next server seals the trace as lost.
    let base = s.base.clone();
    let running = id.clone();
    let cutting = std::thread::spawn(move || {
        let _ = ureq::post(&format!("{base}/v1/sessions/{running}/exec"))
            .timeout(Duration::from_secs(60))
            .send_json(json!({"code": "import time; time.sleep(30)"}));
    });
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGKILL) };
    let _ = s.child.wait();
    cutting.join().unwrap();
    drop(s);
    let mut s = serve(&["--state-dir", &dir_arg]);
    s.wait_ready();

    let (status, text) = request(&s, "GET", &format!("/v1/sessions/{id}/trace"), None);
    assert_eq!(status, 200, "{text}");
    let kinds: Vec<String> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["kind"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        kinds,
        ["created", "cell", "cell", "file_written", "ended", "sealed"]
    );
    let (status, check) = json_of(&s, "GET", &format!("/v1/sessions/{id}/trace/verify"), None);
    assert_eq!(status, 200, "{check}");
    assert_eq!(check["ok"], true, "{check}");
    assert_eq!(check["sealed"], true, "{check}");

    // The downloaded trace checked by the CLI with the server's key, then tampered.
    let file = dir.join("downloaded-trace.ndjson");
    std::fs::write(&file, &text).unwrap();
    let (code, said) = bud_verify(&file, &["--state-dir", &dir_arg]);
    assert_eq!(code, 0, "{said}");
    assert!(
        said.contains("6 events, sealed, signature verified"),
        "{said}"
    );
    std::fs::write(&file, text.replacen("one\\n", "two\\n", 1)).unwrap();
    let (code, said) = bud_verify(&file, &["--state-dir", &dir_arg]);
    assert_eq!(code, 1, "{said}");
    assert!(said.contains("broken: line 2 (event 2)"), "{said}");
    let (status, _) = request(&s, "GET", "/v1/sessions/ses-nope/trace", None);
    assert_eq!(status, 404);
}

#[test]
fn a_one_shot_job_that_asks_for_a_trace_gets_one_sealed_and_a_session_cell_is_refused_it() {
    common::require_kvm();
    let mut s = serve(&[]);
    s.wait_ready();

    let (status, r) = json_of(
        &s,
        "POST",
        "/v1/exec",
        Some(json!({"code": "print(7); raise SystemExit(2)", "trace": true})),
    );
    let (plain_status, plain) = json_of(&s, "POST", "/v1/exec", Some(json!({"code": "1"})));
    let (session_status, session) = json_of(&s, "POST", "/v1/sessions", Some(json!({})));
    let sid = session["id"].as_str().unwrap_or_default().to_owned();
    let (cell_status, refused) = json_of(
        &s,
        "POST",
        &format!("/v1/sessions/{sid}/exec"),
        Some(json!({"code": "1", "trace": true})),
    );

    assert_eq!(status, 200, "{r}");
    assert_eq!(
        (&r["stdout"], &r["exit_code"]),
        (&json!("7\n"), &json!(2)),
        "{r}"
    );
    let id = r["trace_id"].as_str().expect("a trace_id").to_owned();
    assert_eq!(plain_status, 200, "{plain}");
    assert!(plain.get("trace_id").is_none(), "{plain}");
    let (status, text) = request(&s, "GET", &format!("/v1/sessions/{id}/trace"), None);
    assert_eq!(status, 200, "{text}");
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["created", "cell", "ended", "sealed"]);
    assert_eq!(events[0]["data"]["one_shot"], true);
    assert_eq!(events[1]["data"]["code"], "print(7); raise SystemExit(2)");
    assert_eq!(events[1]["data"]["stdout"], "7\n");
    assert_eq!(events[2]["data"]["reason"], "finished");
    let (status, check) = json_of(&s, "GET", &format!("/v1/sessions/{id}/trace/verify"), None);
    assert_eq!(status, 200, "{check}");
    assert_eq!(
        (&check["ok"], &check["sealed"]),
        (&json!(true), &json!(true)),
        "{check}"
    );
    assert_eq!(session_status, 201, "{session}");
    assert_eq!(cell_status, 400, "{refused}");
    assert_eq!(refused["error"]["field"], "trace", "{refused}");
}

#[test]
fn checkpoints_of_the_work_directory_record_what_the_sandboxs_programs_changed_with_diffs() {
    common::require_kvm();
    let mut s = serve(&[]);
    s.wait_ready();
    let (status, r) = json_of(&s, "POST", "/v1/sessions", Some(json!({})));
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    cell(
        &s,
        &id,
        "import os\nopen('a.txt', 'w').write('one\\ntwo\\n')\n\
         open('b.bin', 'wb').write(bytes(range(256)))\n\
         os.makedirs('d', exist_ok=True)\nopen('d/c.txt', 'w').write('c\\n')",
    );

    let (status, first) = json_of(
        &s,
        "POST",
        &format!("/v1/sessions/{id}/trace/checkpoint"),
        None,
    );
    cell(
        &s,
        &id,
        "import os\nopen('a.txt', 'w').write('one\\nTWO\\n')\nos.remove('b.bin')",
    );
    let (deleted, _) = json_of(&s, "DELETE", &format!("/v1/sessions/{id}"), None);
    let (_, text) = request(&s, "GET", &format!("/v1/sessions/{id}/trace"), None);
    let (_, page) = request(&s, "GET", &format!("/v1/sessions/{id}/review"), None);

    assert_eq!(status, 200, "{first}");
    assert_eq!(first["why"], "asked");
    assert_eq!(first["against"], "empty");
    assert_eq!(
        (&first["files"], &first["unchanged"]),
        (&json!(3), &json!(0)),
        "{first}"
    );
    let change = |e: &Value, path: &str| {
        e["changes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["path"] == path)
            .cloned()
            .unwrap_or(Value::Null)
    };
    assert_eq!(change(&first, "a.txt")["change"], "added", "{first}");
    assert_eq!(change(&first, "b.bin")["size"], 256, "{first}");
    assert!(change(&first, "b.bin").get("diff").is_none(), "{first}");
    assert_eq!(change(&first, "d/c.txt")["text"], "c\n", "{first}");
    assert_eq!(deleted, 204);
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let walks: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "files_changed")
        .collect();
    assert_eq!(walks.len(), 2, "{text}");
    let last = &walks[1]["data"];
    assert_eq!(last["why"], "ended");
    assert_eq!(last["against"], walks[0]["seq"]);
    assert_eq!(change(last, "a.txt")["change"], "modified", "{last}");
    assert_eq!(
        change(last, "a.txt")["diff"],
        "--- a/a.txt\n+++ b/a.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+TWO\n"
    );
    assert_eq!(change(last, "b.bin")["change"], "removed", "{last}");
    assert_eq!(change(last, "d/c.txt"), Value::Null, "{last}");
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(
        &kinds[kinds.len() - 3..],
        ["files_changed", "ended", "sealed"]
    );
    assert!(page.contains("-two\n+TWO"), "{page}");
    let (status, _) = request(&s, "POST", "/v1/sessions/ses-nope/trace/checkpoint", None);
    assert_eq!(status, 404);
}
