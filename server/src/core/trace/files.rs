//! What the sandbox's own programs changed in its work directory, as one trace event
//! (`files_changed`): the files found now against the ones the last such event saw (the
//! first against an empty work directory), each change with its size and SHA-256, and a
//! text file's unified diff and new text (kept, within the trace's output budget, for the
//! next event's diff). The walk of the directory is the service's; this module compares.
//!
//! The diff is made by the `similar` crate (Myers' diff, maintained, what `insta` and
//! other Rust tools diff with), not by a diff of our own.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::view::Recorded;

/// The event's kind.
pub const KIND: &str = "files_changed";
/// Files a walk looks at, at most.
pub const MAX_FILES: usize = 512;
/// Bytes of one file read to hash it, at most (a larger one is listed by size only).
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// Bytes a walk reads in all, at most.
pub const MAX_READ_BYTES: u64 = 32 << 20;
/// A text file up to this size gets a diff and its text kept.
pub const MAX_TEXT_BYTES: usize = 256 << 10;
/// Directories deep a walk goes, at most.
pub const MAX_DEPTH: usize = 16;

/// One file as a walk found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub size: u64,
    /// Its SHA-256 (hex), None when it was not read (past a limit, or not a file).
    pub sha256: Option<String>,
    /// Its text, when it is UTF-8 of at most [`MAX_TEXT_BYTES`].
    pub text: Option<String>,
    /// `file`, `symlink` (its target as text) or `other`.
    pub kind: &'static str,
}

impl Found {
    /// A regular file read whole.
    pub fn read(bytes: &[u8]) -> Self {
        let text = (bytes.len() <= MAX_TEXT_BYTES)
            .then(|| std::str::from_utf8(bytes).ok().map(str::to_owned))
            .flatten();
        Self {
            size: bytes.len() as u64,
            sha256: Some(super::chain::hex(&Sha256::digest(bytes))),
            text,
            kind: "file",
        }
    }
}

/// What the last `files_changed` events of a trace say the work directory held: each
/// path's hash, size and kept text.
#[derive(Debug, Default)]
pub struct Seen {
    files: BTreeMap<String, (Option<String>, u64, Option<String>)>,
    /// The seq of the last such event, None if there was none.
    pub last: Option<u64>,
}

/// The work directory as `events` last recorded it.
pub fn seen(events: &[Recorded]) -> Seen {
    let mut s = Seen::default();
    for e in events.iter().filter(|e| e.kind == KIND) {
        s.last = Some(e.seq);
        for c in e.data["changes"].as_array().into_iter().flatten() {
            let Some(path) = c["path"].as_str() else {
                continue;
            };
            if c["change"] == "removed" {
                s.files.remove(path);
                continue;
            }
            let sha = c["sha256"].as_str().map(str::to_owned);
            let text = c["text"].as_str().map(str::to_owned);
            s.files.insert(
                path.to_owned(),
                (sha, c["size"].as_u64().unwrap_or(0), text),
            );
        }
    }
    s
}

/// The data of a `files_changed` event: `now` (path -> what was found) against `before`,
/// `why` it was taken, and what the walk left out (`cut`). Texts and diffs take from
/// `budget`; past it, a change says `text_cut`.
pub fn event(
    why: &str,
    before: &Seen,
    now: &BTreeMap<String, Found>,
    cut: Option<&'static str>,
    budget: &mut u64,
) -> Value {
    let mut changes = Vec::new();
    let mut unchanged = 0u64;
    for (path, f) in now {
        let (change, old_text) = match before.files.get(path) {
            None => ("added", None),
            Some((sha, size, _)) if *sha == f.sha256 && *size == f.size => {
                unchanged += 1;
                continue;
            }
            Some((_, _, text)) => ("modified", text.as_deref()),
        };
        let mut c = json!({"path": path, "change": change, "kind": f.kind, "size": f.size,
                           "sha256": f.sha256});
        if let Some(text) = &f.text {
            let diff = similar::TextDiff::from_lines(old_text.unwrap_or(""), text)
                .unified_diff()
                .context_radius(3)
                .header(&format!("a/{path}"), &format!("b/{path}"))
                .to_string();
            let cost = (diff.len() + text.len()) as u64;
            if cost <= *budget {
                *budget -= cost;
                c["diff"] = json!(diff);
                c["text"] = json!(text);
            } else {
                c["text_cut"] = json!(true);
            }
        }
        changes.push(c);
    }
    for path in before.files.keys().filter(|p| !now.contains_key(*p)) {
        changes.push(json!({"path": path, "change": "removed"}));
    }
    json!({
        "why": why,
        "against": before.last.map_or(json!("empty"), |seq| json!(seq)),
        "files": now.len(),
        "unchanged": unchanged,
        "changes": changes,
        "cut": cut,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walk(files: &[(&str, &str)]) -> BTreeMap<String, Found> {
        files
            .iter()
            .map(|(p, t)| ((*p).to_owned(), Found::read(t.as_bytes())))
            .collect()
    }

    fn as_event(seq: u64, data: Value) -> Recorded {
        Recorded {
            seq,
            time: "2026-12-03T08:00:00Z".into(),
            kind: KIND.into(),
            data,
        }
    }

    #[test]
    fn a_second_walk_shows_what_changed_since_the_first_with_a_diff() {
        let mut budget = 1 << 20;
        let first = event(
            "checkpoint",
            &Seen::default(),
            &walk(&[("a.txt", "one\ntwo\n"), ("b.txt", "b\n"), ("c.txt", "c\n")]),
            None,
            &mut budget,
        );
        let before = seen(&[as_event(4, first.clone())]);

        let second = event(
            "ended",
            &before,
            &walk(&[("a.txt", "one\nTWO\n"), ("b.txt", "b\n"), ("d.txt", "d\n")]),
            None,
            &mut budget,
        );

        assert_eq!(first["against"], "empty");
        assert_eq!(first["changes"].as_array().unwrap().len(), 3);
        assert_eq!(second["against"], 4);
        assert_eq!(second["unchanged"], 1);
        let changes = second["changes"].as_array().unwrap();
        let of = |p: &str| changes.iter().find(|c| c["path"] == p).unwrap().clone();
        assert_eq!(of("a.txt")["change"], "modified");
        assert_eq!(
            of("a.txt")["diff"],
            "--- a/a.txt\n+++ b/a.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+TWO\n"
        );
        assert_eq!(of("d.txt")["change"], "added");
        assert_eq!(of("c.txt")["change"], "removed");
        assert!(changes.iter().all(|c| c["path"] != "b.txt"));
    }

    #[test]
    fn binary_files_get_a_hash_and_no_text_and_past_the_budget_texts_are_cut() {
        let mut now = walk(&[("t.txt", "hello\n")]);
        now.insert("bin".into(), Found::read(&[0xff, 0xfe, 0x00]));
        let mut budget = 10;

        let e = event("ended", &Seen::default(), &now, Some("files"), &mut budget);

        let changes = e["changes"].as_array().unwrap();
        let bin = changes.iter().find(|c| c["path"] == "bin").unwrap();
        assert_eq!(bin["size"], 3);
        assert_eq!(bin["sha256"].as_str().unwrap().len(), 64);
        assert!(bin.get("diff").is_none() && bin.get("text").is_none());
        let t = changes.iter().find(|c| c["path"] == "t.txt").unwrap();
        assert_eq!(t["text_cut"], true);
        assert_eq!(budget, 10);
        assert_eq!(e["cut"], "files");
    }
}
