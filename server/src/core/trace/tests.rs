//! The store on a real directory: events appended and chained, a seal that verifies with
//! the server's key only, a torn end trimmed by the next server, retention and the quota.

use std::time::{Duration, SystemTime};

use serde_json::json;

use super::*;

fn keys() -> vmm::session_file::SessionKeys {
    vmm::session_file::SessionKeys::parse(
        "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff",
    )
    .unwrap()
}

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("bud-trace-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn store(dir: &Dir, config: TraceConfig) -> Traces {
    Traces::open(&dir.0, config, keys()).unwrap()
}

fn note(t: &Traces, id: &str, n: u64) {
    t.record(id, "note", |_| json!({"n": n}));
}

#[test]
fn events_are_chained_in_order_and_a_sealed_trace_verifies_with_the_key() {
    let dir = Dir::new("chain");
    let t = store(&dir, TraceConfig::default());

    for n in 1..=3 {
        note(&t, "ses-a", n);
    }
    t.end("ses-a", "deleted", None);
    note(&t, "ses-a", 4); // after the seal: not written

    let lines = t.read("ses-a", 0).unwrap().unwrap();
    let kinds: Vec<_> = lines.iter().map(|l| l.kind.as_str()).collect();
    assert_eq!(kinds, ["note", "note", "note", "ended", "sealed"]);
    assert_eq!(
        lines.iter().map(|l| l.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
    let v = t.verify("ses-a").unwrap().unwrap().unwrap();
    assert_eq!(
        (v.events, v.sealed, v.signature_checked),
        (5, true, Some(true))
    );
    // Another server's key does not verify the seal.
    let other = vmm::session_file::SessionKeys::parse(&"ab".repeat(32)).unwrap();
    let file = std::fs::File::open(t.file_of("ses-a").unwrap()).unwrap();
    let check = |k: &str, m: &str, i: &[u8]| other.verify_bytes(k, m, i);
    assert_eq!(
        chain::verify(std::io::BufReader::new(file), Some(&check)),
        Err(Broken::Signature)
    );
}

#[test]
fn reading_after_a_seq_gives_only_what_follows() {
    let dir = Dir::new("after");
    let t = store(&dir, TraceConfig::default());
    for n in 1..=5 {
        note(&t, "ses-b", n);
    }

    let after = t.read("ses-b", 3).unwrap().unwrap();

    assert_eq!(after.iter().map(|l| l.seq).collect::<Vec<_>>(), [4, 5]);
    assert!(t.read("ses-none", 0).unwrap().is_none());
    assert!(t.read("../etc/passwd", 0).unwrap().is_none());
}

#[test]
fn subscribers_get_each_event_as_it_is_written() {
    let dir = Dir::new("live");
    let t = store(&dir, TraceConfig::default());
    note(&t, "ses-c", 1);
    let mut rx = t.subscribe("ses-c").unwrap();

    note(&t, "ses-c", 2);
    t.end("ses-c", "deleted", None);

    let got: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok())
        .map(|l| (l.seq, l.kind.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (2, "note".into()),
            (3, "ended".into()),
            (4, "sealed".into())
        ]
    );
    assert!(t.subscribe("ses-c").is_none());
}

#[test]
fn a_line_cut_short_by_a_crash_is_trimmed_and_the_chain_goes_on() {
    let dir = Dir::new("torn");
    {
        let t = store(&dir, TraceConfig::default());
        note(&t, "ses-d", 1);
        note(&t, "ses-d", 2);
    }
    // A server killed in the middle of its third line.
    let path = dir.0.join("traces/ses-d.ndjson");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(b"{\"seq\":3,\"time\":\"2026").unwrap();
    drop(f);
    let torn = chain::verify(std::io::BufReader::new(File::open(&path).unwrap()), None);
    assert_eq!(torn.map(|v| (v.events, v.torn_tail)), Ok((2, true)));

    let t = store(&dir, TraceConfig::default());
    note(&t, "ses-d", 3);

    let v = t.verify("ses-d").unwrap().unwrap().unwrap();
    assert_eq!((v.events, v.torn_tail), (3, false));
}

#[test]
fn the_output_budget_is_shared_by_a_sessions_events_and_survives_a_restart() {
    let dir = Dir::new("budget");
    let config = TraceConfig {
        output_mib: 1,
        ..TraceConfig::default()
    };
    let big = vec![b'x'; 700 << 10];
    let job = vmm::Job::python("print('x' * 700_000)");
    let mut r = vmm::JobResult::never_ran(vmm::Status::Ok);
    r.stdout = big.clone();
    let origin = crate::core::audit::Origin::default();
    {
        let t = store(&dir, config.clone());
        t.record("ses-e", "cell", |b| {
            event::cell(&origin, &job, &r, Duration::ZERO, b)
        });
    }
    let t = store(&dir, config);
    t.record("ses-e", "cell", |b| {
        event::cell(&origin, &job, &r, Duration::ZERO, b)
    });

    let lines = t.read("ses-e", 0).unwrap().unwrap();
    let second: serde_json::Value = serde_json::from_str(&lines[1].text).unwrap();
    assert_eq!(second["data"]["stdout_bytes"], 700 << 10);
    assert_eq!(
        second["data"]["stdout_cut"],
        (700 << 10) - ((1 << 20) - (700 << 10))
    );
    let first: serde_json::Value = serde_json::from_str(&lines[0].text).unwrap();
    assert!(first["data"].get("stdout_cut").is_none());
}

#[test]
fn ended_traces_go_after_the_retention_time_and_live_ones_stay() {
    let dir = Dir::new("retention");
    let t = store(
        &dir,
        TraceConfig {
            retention_hours: 1,
            ..TraceConfig::default()
        },
    );
    note(&t, "ses-old", 1);
    t.end("ses-old", "deleted", None);
    note(&t, "ses-live", 1);

    t.sweep(SystemTime::now() + Duration::from_secs(1800));
    assert!(t.has("ses-old"));
    t.sweep(SystemTime::now() + Duration::from_secs(3601));

    assert!(!t.has("ses-old"));
    assert!(!dir.0.join("traces/ses-old.ndjson").exists());
    assert!(t.has("ses-live"));
    assert_eq!(t.counts.removed.load(Ordering::Relaxed), 1);
}

#[test]
fn past_the_quota_ended_traces_are_pruned_oldest_first_or_sessions_refused() {
    let dir = Dir::new("quota");
    let config = TraceConfig {
        quota_mib: 1,
        ..TraceConfig::default()
    };
    let t = store(&dir, config.clone());
    let fill = |id: &str| {
        t.record(id, "note", |_| json!({"pad": "p".repeat(400 << 10)}));
        t.end(id, "deleted", None);
    };
    fill("ses-1");
    std::thread::sleep(Duration::from_millis(5));
    fill("ses-2");
    std::thread::sleep(Duration::from_millis(5));
    fill("ses-3"); // 1.2 MiB in all: the oldest goes

    assert!(!t.has("ses-1"));
    assert!(t.has("ses-2") && t.has("ses-3"));
    assert!(!t.refuses_sessions());

    let dir2 = Dir::new("refuse");
    let t = store(
        &dir2,
        TraceConfig {
            over_quota: OverQuota::Refuse,
            ..config
        },
    );
    for id in ["ses-1", "ses-2", "ses-3"] {
        t.record(id, "note", |_| json!({"pad": "p".repeat(400 << 10)}));
        t.end(id, "deleted", None);
    }
    assert!(t.has("ses-1"));
    assert!(t.refuses_sessions());
}

#[test]
fn a_restarted_store_knows_which_traces_ended() {
    let dir = Dir::new("restart");
    {
        let t = store(&dir, TraceConfig::default());
        note(&t, "ses-x", 1);
        t.end("ses-x", "deleted", None);
        note(&t, "ses-y", 1);
    }
    let t = store(&dir, TraceConfig::default());

    note(&t, "ses-x", 2); // sealed: nothing more
    note(&t, "ses-y", 2); // still open: goes on

    assert_eq!(t.read("ses-x", 0).unwrap().unwrap().len(), 3);
    assert_eq!(t.read("ses-y", 0).unwrap().unwrap().len(), 2);
    assert_eq!(t.verify("ses-y").unwrap().unwrap().unwrap().events, 2);
}
