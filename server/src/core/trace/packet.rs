//! The review packet of a session (`GET /v1/sessions/{id}/trace.tar.gz`): one gzipped tar
//! of everything a reviewer needs without the server, under a folder named for the
//! session:
//!
//! ```text
//! ID/trace.ndjson   the trace file as it is on disk (`bud trace verify` reads it)
//! ID/verify.json    what the server's check found (chain, seal, signature)
//! ID/seal.json      the seal (key id, HMAC, events, the hash it signs), when sealed
//! ID/files.json     each path changed (through the API, or found by a checkpoint of the
//!                   work directory with its diff), its last change, size and hash
//! ID/review.html    the review page, readable offline
//! ID/otlp.json      the OpenTelemetry spans
//! ID/README.txt     what these are and how to check them
//! ```
//!
//! The tar is made by the `tar` crate (GNU headers) through `flate2`'s gzip, both
//! maintained and already how Rust reads and writes archives; every entry has mode 0644
//! and the trace's last event as its time, so the same trace makes the same packet.

use std::collections::BTreeMap;
use std::io::Write;

use serde_json::{Value, json};

use super::view::{Recorded, Verdict};

/// What goes into one packet.
#[derive(Debug)]
pub struct Contents<'a> {
    pub id: &'a str,
    /// The trace file's bytes.
    pub trace: &'a [u8],
    pub events: &'a [Recorded],
    pub verdict: &'a Verdict,
    /// The check as the API shows it (`/trace/verify`).
    pub check: Value,
}

/// Each path's last change: through the API, or as a checkpoint found it (`via`).
pub fn files(events: &[Recorded]) -> Value {
    let mut last: BTreeMap<String, Value> = BTreeMap::new();
    for e in events {
        let change = |path: &str| {
            json!({"path": path, "change": e.kind, "seq": e.seq, "time": e.time,
                   "bytes": e.data.get("bytes"), "sha256": e.data.get("sha256")})
        };
        match e.kind.as_str() {
            "file_written" | "file_removed" | "dir_made" => {
                if let Some(p) = e.str("path") {
                    last.insert(p.to_owned(), change(p));
                }
            }
            "file_renamed" => {
                if let (Some(from), Some(to)) = (e.str("from"), e.str("to")) {
                    last.insert(from.to_owned(), change(from));
                    let mut moved = change(to);
                    moved["from"] = json!(from);
                    last.insert(to.to_owned(), moved);
                }
            }
            super::files::KIND => {
                for c in e.data["changes"].as_array().into_iter().flatten() {
                    if let Some(p) = c["path"].as_str() {
                        let mut seen = change(p);
                        seen["change"] = c["change"].clone();
                        seen["via"] = json!("checkpoint");
                        seen["bytes"] = c["size"].clone();
                        seen["sha256"] = c["sha256"].clone();
                        if let Some(diff) = c.get("diff") {
                            seen["diff"] = diff.clone();
                        }
                        last.insert(p.to_owned(), seen);
                    }
                }
            }
            _ => {}
        }
    }
    Value::Array(last.into_values().collect())
}

fn readme(c: &Contents<'_>) -> String {
    format!(
        "The review packet of bud session {id}.\n\n\
         trace.ndjson  every event of the session, one JSON line each, hash-chained\n\
         verify.json   the server's check when this packet was made: {verdict}\n\
         seal.json     the seal: an HMAC-SHA256 under the server's session key\n\
         files.json    each path changed (through the API or found by a checkpoint of the\n\
         \x20             work directory, with its diff): its last change, size, SHA-256\n\
         review.html   the timeline, outputs, files and network, for a browser (offline)\n\
         otlp.json     the events as OpenTelemetry spans (OTLP JSON)\n\n\
         Check the chain:             bud trace verify trace.ndjson\n\
         and the seal's signature:    bud trace verify trace.ndjson --key-file SESSION_KEY\n\
         What the sandbox's own programs changed is recorded at each checkpoint of its work \
         directory (files_changed events); see bud's docs/evidence.md.\n",
        id = c.id,
        verdict = c.verdict.text,
    )
}

/// The packet's gzipped tar.
pub fn build(c: &Contents<'_>) -> std::io::Result<Vec<u8>> {
    let mtime = c
        .events
        .last()
        .and_then(|e| crate::core::clock::rfc3339_nanos(&e.time))
        .map_or(0, |n| n / 1_000_000_000);
    let pretty = |v: &Value| serde_json::to_vec_pretty(v).unwrap_or_default();
    let mut entries: Vec<(&str, Vec<u8>)> = vec![
        ("README.txt", readme(c).into_bytes()),
        ("trace.ndjson", c.trace.to_vec()),
        ("verify.json", pretty(&c.check)),
    ];
    if let Some(seal) = c
        .events
        .iter()
        .rev()
        .find(|e| e.kind == super::chain::SEALED)
    {
        entries.push(("seal.json", pretty(&seal.data)));
    }
    entries.push(("files.json", pretty(&files(c.events))));
    entries.push((
        "review.html",
        super::review::page(c.id, c.events, c.verdict).into_bytes(),
    ));
    entries.push(("otlp.json", pretty(&super::otlp::export(c.id, c.events))));

    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    for (name, data) in &entries {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(mtime);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        tar.append_data(&mut h, format!("{}/{name}", c.id), data.as_slice())?;
    }
    let mut gz = tar.into_inner()?;
    gz.flush()?;
    gz.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn ev(seq: u64, kind: &str, data: Value) -> Recorded {
        Recorded {
            seq,
            time: "2026-12-02T15:00:00.000Z".into(),
            kind: kind.into(),
            data,
        }
    }

    #[test]
    fn the_packet_holds_the_trace_as_it_is_and_the_last_change_of_each_path() {
        let events = [
            ev(
                1,
                "file_written",
                json!({"path": "/a", "bytes": 1, "sha256": "x"}),
            ),
            ev(2, "file_renamed", json!({"from": "/a", "to": "/b"})),
            ev(
                3,
                "file_written",
                json!({"path": "/c", "bytes": 2, "sha256": "y"}),
            ),
            ev(4, "file_removed", json!({"path": "/c"})),
            ev(5, "sealed", json!({"events": 4, "key": "k1", "mac": "m"})),
        ];
        let verdict = Verdict {
            ok: true,
            sealed: true,
            text: "chain whole".into(),
        };
        let trace = b"{\"seq\":1}\n";
        let c = Contents {
            id: "ses-1",
            trace,
            events: &events,
            verdict: &verdict,
            check: json!({"ok": true}),
        };

        let gz = build(&c).unwrap();
        assert_eq!(
            build(&c).unwrap(),
            gz,
            "the same trace makes the same packet"
        );
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(gz.as_slice()));
        let mut got = BTreeMap::new();
        for entry in tar.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().display().to_string();
            let mut body = Vec::new();
            entry.read_to_end(&mut body).unwrap();
            got.insert(name, body);
        }

        let names: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "ses-1/README.txt",
                "ses-1/files.json",
                "ses-1/otlp.json",
                "ses-1/review.html",
                "ses-1/seal.json",
                "ses-1/trace.ndjson",
                "ses-1/verify.json"
            ]
        );
        assert_eq!(got["ses-1/trace.ndjson"], trace);
        let files: Value = serde_json::from_slice(&got["ses-1/files.json"]).unwrap();
        let changes: Vec<(&str, &str)> = files
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f["path"].as_str().unwrap(), f["change"].as_str().unwrap()))
            .collect();
        assert_eq!(
            changes,
            [
                ("/a", "file_renamed"),
                ("/b", "file_renamed"),
                ("/c", "file_removed")
            ]
        );
        let seal: Value = serde_json::from_slice(&got["ses-1/seal.json"]).unwrap();
        assert_eq!(seal["mac"], "m");
    }
}
