//! Crafted imports against a real server and guest (issue 44): a paused session's file
//! from outside is untrusted input. Each crafted file is answered with an exact status
//! (400 `invalid_request` saying what was wrong, never a path of the state directory), or,
//! where the key is right and the file in range, runs safely; the server serves after
//! each, and a job after all of them sees nothing of them. Files are made from a real
//! export and, where a valid MAC is needed, re-signed with the key the test gave the
//! server (vmm's `session_file::rewrite`). Needs /dev/kvm.

mod common;

use std::path::{Path, PathBuf};

use common::{TestServer, test_config};
use serde_json::{Value, json};
use vmm::session_file::{self, Header, SessionKeys};

fn keys() -> SessionKeys {
    SessionKeys::parse(common::SHARED_SESSION_KEY).unwrap()
}

fn server(dir: &Path, quota: Option<u64>) -> TestServer {
    let mut config = test_config();
    config.state_dir = Some(dir.to_owned());
    config.session_key_file = Some(common::shared_key_file());
    if let Some(q) = quota {
        config.state_quota_bytes = q;
    }
    TestServer::with_config(config)
}

fn import(s: &TestServer, body: Vec<u8>) -> (u16, Value) {
    s.post_raw("/v1/sessions/import", "application/octet-stream", body)
}

/// A real export: a session that ran a cell, paused, its file; then deleted there.
fn exported(s: &TestServer) -> Vec<u8> {
    let (status, r) = s.post("/v1/sessions", &json!({}));
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    let (status, r) = s.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({"code": "kept = 'from the export'"}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        s.post(&format!("/v1/sessions/{id}/pause"), &json!({})).0,
        200
    );
    let file = s.get(&format!("/v1/sessions/{id}/export"));
    assert_eq!(file.status().as_u16(), 200);
    let bytes = file.bytes().unwrap().to_vec();
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
    bytes
}

/// `bytes` re-signed with the test's key after `edit` (header and pages), with the
/// record's id set to `id`.
fn resigned(
    scratch: &Path,
    bytes: &[u8],
    id: &str,
    edit: impl FnOnce(&mut Header, &mut Vec<u8>),
) -> Vec<u8> {
    let src = scratch.join("src.bud");
    let out = scratch.join("out.bud");
    std::fs::write(&src, bytes).unwrap();
    let f = session_file::read(&src, &keys()).unwrap();
    session_file::rewrite(&f, &out, &keys(), |h, pages| {
        let mut record: Value = serde_json::from_slice(&h.app).unwrap();
        record["id"] = json!(id);
        h.app = serde_json::to_vec(&record).unwrap();
        edit(h, pages);
    })
    .unwrap();
    std::fs::read(&out).unwrap()
}

/// The record of `h` with `field` set to `value`.
fn with_record(h: &mut Header, field: &str, value: Value) {
    let mut record: Value = serde_json::from_slice(&h.app).unwrap();
    record[field] = value;
    h.app = serde_json::to_vec(&record).unwrap();
}

/// An E2B sandbox's saved record for session `id`, made by API key `key`.
fn e2b_record(id: &str, key: Option<&str>, metadata: serde_json::Map<String, Value>) -> Value {
    json!({"e2b": {"id": id, "template_id": "python", "token": "0".repeat(32), "key": key,
                   "metadata": metadata, "auto_pause": false, "auto_resume": false}})
}

fn fresh_id(n: usize) -> String {
    format!("ses_hostile{n}_{:032x}", std::process::id())
}

fn message(r: &Value) -> String {
    r["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn crafted_imports_are_refused_with_why_or_run_safely_and_the_server_goes_on() {
    let root = common::empty_dir("import-hostile", "battery");
    let s = server(&root.join("state"), None);
    let scratch = root.join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let file = exported(&s);
    let n = file.len();
    let footer = n - 72;
    let state_path = root.join("state").to_string_lossy().into_owned();

    // Without the key: torn, flipped, a recomputed CRC, another key, no MAC.
    let mut flipped_page = file.clone();
    flipped_page[4096 + 9] ^= 1;
    let mut recomputed = file.clone();
    recomputed[footer - 1] ^= 0x20; // the record's last byte
    let header_len = u64::from_le_bytes(recomputed[footer + 16..footer + 24].try_into().unwrap());
    let crc = crc32fast::hash(&recomputed[footer - header_len as usize..footer]);
    recomputed[footer + 12..footer + 16].copy_from_slice(&crc.to_le_bytes());
    let other_key = {
        let src = scratch.join("k.bud");
        std::fs::write(&src, &file).unwrap();
        let f = session_file::read(&src, &keys()).unwrap();
        let out = scratch.join("other.bud");
        session_file::rewrite(&f, &out, &SessionKeys::generate().unwrap(), |_, _| {}).unwrap();
        std::fs::read(out).unwrap()
    };
    let mut no_mac = file.clone();
    no_mac[n - 32..].fill(0);
    let mut absurd_len = file.clone();
    absurd_len[footer + 16..footer + 24].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut torn = file.clone();
    torn.truncate(n - 10);
    let unkeyed: Vec<(&str, Vec<u8>, &str)> = vec![
        ("torn", torn, ""),
        ("flipped page", flipped_page, "checksum"),
        ("recomputed CRC", recomputed, "MAC"),
        ("another key", other_key, "key this server does not hold"),
        ("no MAC", no_mac, "MAC"),
        ("absurd header length", absurd_len, "corrupt"),
        ("empty", Vec::new(), "not a bud session file"),
    ];

    // With the key: foreign machine settings, absurd fields and limits.
    let keyed: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "CPUID with VMX",
            resigned(&scratch, &file, &fresh_id(1), |h, _| {
                for e in h.machine.cpuid.iter_mut().filter(|e| e.function == 1) {
                    e.ecx |= 1 << 5;
                }
            }),
            "CPUID",
        ),
        (
            "CPUID without a leaf",
            resigned(&scratch, &file, &fresh_id(2), |h, _| {
                h.machine.cpuid.pop();
            }),
            "CPUID",
        ),
        (
            "an MSR more",
            resigned(&scratch, &file, &fresh_id(3), |h, _| {
                let mut extra = h.machine.msrs[0];
                extra.index = 0x3a;
                h.machine.msrs.push(extra);
            }),
            "MSR list",
        ),
        (
            "RFLAGS all ones",
            resigned(&scratch, &file, &fresh_id(4), |h, _| {
                h.machine.regs.rflags = u64::MAX
            }),
            "RFLAGS",
        ),
        (
            "EFER.SVME",
            resigned(&scratch, &file, &fresh_id(5), |h, _| {
                h.machine.sregs.efer |= 1 << 12
            }),
            "virtualization",
        ),
        (
            "MP state 99",
            resigned(&scratch, &file, &fresh_id(6), |h, _| {
                h.machine.mp_state.mp_state = 99
            }),
            "MP state",
        ),
        (
            "parked at i128::MIN",
            resigned(&scratch, &file, &fresh_id(7), |h, _| {
                h.parked_wall_ns = i128::MIN
            }),
            "parked",
        ),
        (
            "lifetime 2^64-1",
            resigned(&scratch, &file, &fresh_id(8), |h, _| {
                with_record(h, "lifetime_left_ms", json!(u64::MAX))
            }),
            "lifetime",
        ),
        (
            "idle timeout 2^64-1",
            resigned(&scratch, &file, &fresh_id(9), |h, _| {
                with_record(h, "idle_timeout_s", json!(u64::MAX))
            }),
            "idle timeout",
        ),
        (
            "an env name with '='",
            resigned(&scratch, &file, &fresh_id(10), |h, _| {
                with_record(h, "env", json!({"A=B": "x"}))
            }),
            "environment",
        ),
        (
            "an E2B record of 20 000 metadata keys",
            resigned(&scratch, &file, &fresh_id(12), |h, _| {
                let metadata: serde_json::Map<String, Value> =
                    (0..20_000).map(|i| (format!("k{i}"), json!("v"))).collect();
                with_record(h, "attachment", e2b_record(&fresh_id(12), None, metadata))
            }),
            "E2B metadata",
        ),
        (
            "an E2B record of another API key",
            resigned(&scratch, &file, &fresh_id(13), |h, _| {
                let record = e2b_record(&fresh_id(13), Some("bob"), Default::default());
                with_record(h, "attachment", record)
            }),
            "API key",
        ),
        (
            "an attachment of 100 000 bytes",
            resigned(&scratch, &file, &fresh_id(14), |h, _| {
                with_record(h, "attachment", json!({"other": "x".repeat(100_000)}))
            }),
            "attachment",
        ),
        (
            "an id of 200 characters",
            resigned(
                &scratch,
                &file,
                &format!("ses_{}", "a".repeat(196)),
                |_, _| {},
            ),
            "not a session id",
        ),
        (
            "an id with a slash",
            resigned(&scratch, &file, "ses_../../etc", |_, _| {}),
            "not a session id",
        ),
        (
            "another template",
            resigned(&scratch, &file, &fresh_id(11), |h, _| {
                h.template = "python-0000".into()
            }),
            "template",
        ),
    ];

    let mut answers = Vec::new();
    for (what, body, why) in unkeyed.into_iter().chain(keyed) {
        let (status, r) = import(&s, body);
        answers.push((what, status, r["error"]["code"].clone(), message(&r), why));
        s.assert_still_serving();
    }

    for (what, status, code, msg, why) in &answers {
        assert_eq!(
            (*status, code),
            (400, &json!("invalid_request")),
            "{what}: {msg}"
        );
        assert!(msg.contains(why), "{what}: {msg:?} does not say {why:?}");
        assert!(!msg.contains(&state_path), "{what}: names a path: {msg}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(root.join("state/paused"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    assert!(leftovers.is_empty(), "files left in paused/: {leftovers:?}");
    let (status, r) =
        s.exec(json!({"code": "import os; print(os.path.exists('/root/kept'), 'later')"}));
    assert_eq!(
        (status, &r["stdout"]),
        (200, &json!("False later\n")),
        "{r}"
    );
}

/// With the key, a file in range runs safely even when its counters are absurd or its
/// pages are garbage: counters wrap, garbage memory ends that session alone with a clear
/// status, and the next job on the server sees nothing of it.
#[test]
fn signed_files_with_absurd_counters_or_garbage_pages_run_safely() {
    let root = common::empty_dir("import-hostile", "safely");
    let s = server(&root.join("state"), None);
    let scratch = root.join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let file = exported(&s);
    let counters_id = fresh_id(20);
    let counters = resigned(&scratch, &file, &counters_id, |h, _| {
        h.executions = u64::MAX;
    });
    // The request sequence is the guest worker's too: one out of step ends that session's
    // request with a clear status (the guest does not answer it), nothing else.
    let sequence_id = fresh_id(22);
    let sequence = resigned(&scratch, &file, &sequence_id, |h, _| h.sequence = u32::MAX);
    let garbage_id = fresh_id(21);
    let garbage = resigned(&scratch, &file, &garbage_id, |_, pages| pages.fill(0xff));

    let (counters_status, counters_r) = import(&s, counters);
    let (ran_status, ran) = s.post(
        &format!("/v1/sessions/{counters_id}/exec"),
        &json!({"code": "print(kept)"}),
    );
    let (sequence_status, sequence_r) = import(&s, sequence);
    let (seq_run_status, seq_run) = s.post(
        &format!("/v1/sessions/{sequence_id}/exec"),
        &json!({"code": "print(kept)", "timeout_ms": 5000}),
    );
    s.assert_still_serving();
    let (garbage_status, garbage_r) = import(&s, garbage);
    let (garbage_run_status, garbage_run) = s.post(
        &format!("/v1/sessions/{garbage_id}/exec"),
        &json!({"code": "print(1)", "timeout_ms": 5000}),
    );
    s.assert_still_serving();
    let (later_status, later) = s.exec(json!({"code": "print('later')"}));

    assert_eq!(counters_status, 201, "{counters_r}");
    assert_eq!(
        (ran_status, &ran["stdout"]),
        (200, &json!("from the export\n")),
        "{ran}"
    );
    assert_eq!(
        ran["execution_count"],
        json!(u64::MAX),
        "the count saturates: {ran}"
    );
    assert_eq!(sequence_status, 201, "{sequence_r}");
    assert!(
        seq_run_status == 200 && [json!("ok"), json!("crashed")].contains(&seq_run["status"]),
        "{seq_run_status} {seq_run}"
    );
    assert_eq!(garbage_status, 201, "{garbage_r}");
    assert!(
        garbage_run_status == 410
            || (garbage_run_status == 200 && garbage_run["status"] != json!("ok")),
        "a session of garbage memory: {garbage_run_status} {garbage_run}"
    );
    assert_eq!(
        (later_status, &later["stdout"]),
        (200, &json!("later\n")),
        "{later}"
    );
}

/// Concurrent imports at the quota: the state directory never holds more than its quota,
/// every import past it is 507 `state_quota`, and no upload is left behind.
#[test]
fn concurrent_imports_at_the_quota_never_pass_it() {
    let root = common::empty_dir("import-hostile", "quota");
    let source = server(&root.join("source"), None);
    let file = exported(&source);
    let scratch = root.join("scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let bodies: Vec<Vec<u8>> = (0..4)
        .map(|i| resigned(&scratch, &file, &fresh_id(30 + i), |_, _| {}))
        .collect();
    // Room for two files and a half.
    let quota = (file.len() as u64) * 5 / 2;
    let s = server(&root.join("state"), Some(quota));

    let answers: Vec<(u16, Value)> = std::thread::scope(|t| {
        let running: Vec<_> = bodies
            .into_iter()
            .map(|b| {
                let s = &s;
                t.spawn(move || import(s, b))
            })
            .collect();
        running.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let created = answers.iter().filter(|(st, _)| *st == 201).count();
    let refused = answers
        .iter()
        .filter(|(st, r)| *st == 507 && r["error"]["code"] == json!("state_quota"))
        .count();
    let on_disk: u64 = walk(&root.join("state"));
    let (used, q) = s.state.state_dir().unwrap().usage();

    // Uploads stream side by side, each holding what it has received: at most two fit,
    // and how many is a race (one that cannot grow its share is refused midway).
    assert!(created <= 2, "{answers:?}");
    assert_eq!(created + refused, 4, "{answers:?}");
    assert!(on_disk <= quota, "{on_disk} bytes on disk, quota {quota}");
    assert_eq!(q, quota);
    assert!(used <= quota, "{used} counted, quota {quota}");
    s.assert_still_serving();
}

/// Bytes of the session files under `dir`.
fn walk(dir: &PathBuf) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let m = e.metadata().unwrap();
        if m.is_dir() {
            total += walk(&e.path());
        } else if e.file_name().to_string_lossy().ends_with(".bud")
            || e.file_name().to_string_lossy().ends_with(".tmp")
        {
            total += m.len();
        }
    }
    total
}

/// A file on the node's own disk is checked as an import is: a snapshot found at start
/// whose page was changed on disk is refused at its first start (its pages read back once),
/// with why, and the server goes on.
#[test]
fn a_snapshot_changed_on_disk_is_refused_at_its_first_start_after_a_restart() {
    let dir = common::empty_dir("import-hostile", "snapshot-on-disk");
    let snap = {
        let s = server(&dir, None);
        let (status, r) = s.post("/v1/sessions", &json!({}));
        assert_eq!(status, 201, "{r}");
        let id = r["id"].as_str().unwrap().to_owned();
        let (status, r) = s.post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"code": "data = bytes(1 << 20)"}),
        );
        assert_eq!(status, 200, "{r}");
        let (status, r) = s.post(&format!("/v1/sessions/{id}/snapshots"), &json!({}));
        assert_eq!(status, 201, "{r}");
        r["id"].as_str().unwrap().to_owned()
    };
    let file = dir.join(format!("snapshots/{snap}.bud"));
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[5000] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();

    let s = server(&dir, None);
    let (status, r) = s.post("/v1/sessions", &json!({"snapshot": snap}));

    assert_eq!(
        (status, r["error"]["code"].clone()),
        (410, json!("unresumable")),
        "{r}"
    );
    assert!(message(&r).contains("checksum"), "{r}");
    s.assert_still_serving();
}
