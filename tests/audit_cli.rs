//! `bud audit` on a log file: filters by key, status and session, prints JSON lines or a
//! table, and reports a line that is not a record (exit status 1). No KVM needed.

use std::process::Command;

fn record(key: &str, status: &str, session: Option<&str>, time: &str) -> String {
    serde_json::json!({
        "time": time, "key": key, "route": "/v1/exec", "kind": "job", "template": "python",
        "session": session, "language": "python",
        "code_sha256": "c0de", "code_bytes": 8, "stdin_sha256": "e3b0", "stdin_bytes": 0,
        "status": status, "exit_code": 0, "signal": null,
        "queue_ms": 0.1, "run_ms": 1.0, "total_ms": 1.5,
        "stdout_bytes": 2, "stdout_sha256": "aa", "stderr_bytes": 0, "stderr_sha256": "bb",
    })
    .to_string()
}

fn bud_audit(log: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bud"))
        .arg("audit")
        .arg(log)
        .args(args)
        .output()
        .expect("running bud audit");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bud_audit_filters_records_and_reports_bad_lines() {
    let dir = std::env::temp_dir().join(format!("bud-audit-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("audit.jsonl");
    let a = record("alice", "ok", None, "2026-11-23T10:00:00.000Z");
    let b = record("bob", "timeout", None, "2026-11-23T11:00:00.000Z");
    let c = record("alice", "error", Some("ses_1"), "2026-11-23T12:00:00.000Z");
    std::fs::write(&log, format!("{a}\n{b}\n{c}\n")).unwrap();

    assert_eq!(
        bud_audit(&log, &["--key", "alice"]),
        (0, format!("{a}\n{c}\n"), String::new())
    );
    assert_eq!(
        bud_audit(&log, &["--status", "timeout"]),
        (0, format!("{b}\n"), String::new())
    );
    assert_eq!(
        bud_audit(&log, &["--session", "ses_1"]),
        (0, format!("{c}\n"), String::new())
    );
    assert_eq!(
        bud_audit(&log, &["--since", "2026-11-23T11:00"]),
        (0, format!("{b}\n{c}\n"), String::new())
    );
    let (code, table, _) = bud_audit(&log, &["--table", "--key", "bob"]);
    assert_eq!(code, 0);
    assert!(
        table.starts_with("2026-11-23T11:00:00.000Z bob ") && table.contains(" timeout "),
        "{table}"
    );

    std::fs::write(&log, format!("{a}\nnot json\n")).unwrap();
    let (code, out, err) = bud_audit(&log, &[]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!((code, out), (1, format!("{a}\n")));
    assert!(err.contains("line 2: not an audit record"), "{err}");
}
