//! Durable sessions across a crash: a real, jailed `bud serve` on a state directory is
//! killed with SIGKILL in the middle of a pause, a resume or a snapshot (in turn, at a
//! delay that varies by round) and started again on the same directory. What must hold
//! each time: every pause that was answered resumes exactly (the session's variable, file
//! and data as they were); a session whose pause or resume was cut short is either paused
//! in whole (and resumes exactly) or was running (and is then `lost`, 410 with why), never
//! half-restored; every answered snapshot is there, and any snapshot there starts a
//! session; no file is ever found damaged. `BUD_CRASH_ROUNDS` sets the rounds (CI: 3). Needs /dev/kvm.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::served::{Served, own_state_dir, serve};
use serde_json::{Value, json};

fn request(s: &Served, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let req = ureq::request(method, &format!("{}{path}", s.base)).timeout(Duration::from_secs(120));
    let r = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    match r {
        Ok(r) => {
            let status = r.status();
            (status, r.into_json().unwrap_or(Value::Null))
        }
        Err(ureq::Error::Status(status, r)) => (status, r.into_json().unwrap_or(Value::Null)),
        Err(e) => (0, json!({"transport": e.to_string()})),
    }
}

fn cell(s: &Served, id: &str, code: &str) -> (u16, Value) {
    request(
        s,
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "code": code })),
    )
}

/// Kills the server with SIGKILL and reaps it.
fn kill9(s: &mut Served) {
    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGKILL) };
    let _ = s.child.wait();
}

#[test]
fn a_server_killed_mid_pause_resume_or_snapshot_never_serves_a_partial_session() {
    common::require_kvm();
    let rounds = common::size("BUD_CRASH_ROUNDS", 3);
    let mut s = serve(&[]);
    let dir = own_state_dir(s.port);
    let dir_arg = dir.to_string_lossy().into_owned();
    s.wait_ready();
    // Session id -> the value it holds, for every pause that was answered.
    let mut paused: BTreeMap<String, String> = BTreeMap::new();
    let mut snapshots: Vec<String> = Vec::new();
    let mut cut_short = 0;
    for round in 0..rounds {
        // One session paused in full, one whose pause the kill may cut, one snapshot.
        let mut ids = Vec::new();
        for k in 0..2 {
            let (status, r) = request(&s, "POST", "/v1/sessions", Some(json!({})));
            assert_eq!(status, 201, "{r}");
            let id = r["id"].as_str().unwrap().to_owned();
            let value = format!("round {round} session {k}");
            let (status, r) = cell(
                &s,
                &id,
                &format!(
                    "v = {value:?}\nopen('v.txt', 'w').write(v)\nblob = bytes(range(256)) * 8192"
                ),
            );
            assert_eq!(status, 200, "{r}");
            ids.push((id, value));
        }
        let (status, r) = request(
            &s,
            "POST",
            &format!("/v1/sessions/{}/pause", ids[0].0),
            None,
        );
        assert_eq!(status, 200, "{r}");
        paused.insert(ids[0].0.clone(), ids[0].1.clone());
        let (status, r) = request(
            &s,
            "POST",
            &format!("/v1/sessions/{}/snapshots", ids[0].0),
            None,
        );
        // A snapshot of a paused session resumes it first, then it goes on running.
        assert_eq!(status, 201, "{r}");
        snapshots.push(r["id"].as_str().unwrap().to_owned());
        paused.remove(&ids[0].0); // running again: a kill now loses it
        let (status, r) = request(
            &s,
            "POST",
            &format!("/v1/sessions/{}/pause", ids[0].0),
            None,
        );
        assert_eq!(status, 200, "{r}");
        paused.insert(ids[0].0.clone(), ids[0].1.clone());

        // One operation cut by the kill after a few milliseconds that vary by round
        // (before, during or after its write): a pause of the running session, a resume
        // of the paused one, or a snapshot of the running one, in turn.
        let (op, victim) = match round % 3 {
            0 => ("pause", ids[1].clone()),
            1 => ("resume", ids[0].clone()),
            _ => ("snapshots", ids[1].clone()),
        };
        let base = s.base.clone();
        let path = format!("/v1/sessions/{}/{op}", victim.0);
        let cutting = std::thread::spawn(move || {
            ureq::post(&format!("{base}{path}"))
                .timeout(Duration::from_secs(60))
                .call()
                .ok()
                .map(|r| (r.status(), r.into_json::<Value>().unwrap_or(Value::Null)))
        });
        std::thread::sleep(Duration::from_millis(5 + 7 * round as u64));
        kill9(&mut s);
        let answered = cutting.join().unwrap();
        // Sessions that must come back exactly or be reported lost, never anything else.
        let mut exact_or_lost = Vec::new();
        match (op, &answered) {
            ("pause", Some((200, _))) => {
                paused.insert(victim.0.clone(), victim.1.clone());
            }
            ("pause", _) => exact_or_lost.push(victim.clone()),
            ("resume", _) => {
                paused.remove(&victim.0);
                exact_or_lost.push(victim.clone());
            }
            (_, Some((201, r))) => snapshots.push(r["id"].as_str().unwrap().to_owned()),
            _ => {}
        }
        if !matches!(&answered, Some((200 | 201, _))) {
            cut_short += 1;
        }

        s = serve(&["--state-dir", &dir_arg]);
        s.wait_ready();
        for (id, value) in &paused {
            let (status, r) = cell(&s, id, "print(v, open('v.txt').read(), len(blob))");
            assert_eq!(status, 200, "{id}: {r}");
            assert_eq!(
                r["stdout"],
                json!(format!("{value} {value} 2097152\n")),
                "{r}"
            );
        }
        for (id, value) in &exact_or_lost {
            let (status, r) = cell(&s, id, "print(v)");
            match status {
                200 => assert_eq!(r["stdout"], json!(format!("{value}\n")), "{r}"),
                410 => assert_eq!(
                    r["error"]["message"].as_str().map(|m| m.contains("lost")),
                    Some(true),
                    "{r}"
                ),
                _ => panic!("a {op} cut short left {id}: {status} {r}"),
            }
        }
        // Every session resumed above runs again now: pause them again for the next round.
        let resumed: Vec<String> = paused.keys().cloned().collect();
        for id in resumed {
            let (status, r) = request(&s, "POST", &format!("/v1/sessions/{id}/pause"), None);
            assert_eq!(status, 200, "{r}");
        }
        // Every answered snapshot is there; any snapshot there (one cut after its rename
        // too) starts a session holding what its source held.
        let (status, listed) = request(&s, "GET", "/v1/snapshots", None);
        assert_eq!(status, 200, "{listed}");
        let listed: Vec<String> = listed["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["id"].as_str().unwrap().to_owned())
            .collect();
        for snap in &snapshots {
            assert!(
                listed.contains(snap),
                "answered snapshot {snap} is gone: {listed:?}"
            );
        }
        for snap in &listed {
            let (status, r) = request(&s, "POST", "/v1/sessions", Some(json!({"snapshot": snap})));
            assert_eq!(status, 201, "snapshot {snap}: {r}");
            let (status, out) = cell(&s, r["id"].as_str().unwrap(), "print(v)");
            assert_eq!(status, 200, "{out}");
            assert!(
                out["stdout"].as_str().unwrap().starts_with("round "),
                "{out}"
            );
        }
    }
    let damaged = std::fs::read_dir(dir.join("damaged")).unwrap().count();
    eprintln!("[crash] {rounds} rounds, {cut_short} operations cut short by the kill");
    assert_eq!(damaged, 0, "a file was found damaged after a crash");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
