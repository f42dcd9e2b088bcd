//! A trace's lines and their hash chain: how an event becomes one line of the file, and how
//! a file is checked (`bud trace verify`).
//!
//! A line is one JSON object, its fields always in this order:
//!
//! ```text
//! {"seq":N,"time":"…","session":"ses-…","kind":"cell","data":{…},"prev":"<hex>","hash":"<hex>"}
//! ```
//!
//! `hash` is the SHA-256 of the line's *body*: the exact bytes of the line without
//! `,"hash":"…"` (so ending `"prev":"<hex>"}`). `prev` is the hash of the line before
//! (for the first, [`GENESIS`]), and `seq` counts from 1. So changing, dropping, adding or
//! reordering any line breaks the chain at that line, and the check needs no
//! re-serialisation: it hashes the bytes the file holds.
//!
//! A trace whose session has ended ends in a `sealed` event whose `data` holds an
//! HMAC-SHA256, under the server's session key ([`crate::core::session_keys`]), of the
//! hash of the line before it: a sealed trace cannot be rewritten without the key, and
//! one cut short of its seal says it was not finished.

use std::io::BufRead;

use serde::Serialize;
use sha2::{Digest, Sha256};

/// `prev` of a trace's first line.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The domain of a seal's HMAC (never the same input as a session file's).
pub const SEAL_DOMAIN: &[u8] = b"bud trace seal\0";

/// The kind of a trace's last event once its session ended.
pub const SEALED: &str = "sealed";

/// The fields of a line before its hash, in the file's order.
#[derive(Debug, Serialize)]
pub struct Body<'a> {
    pub seq: u64,
    pub time: &'a str,
    pub session: &'a str,
    pub kind: &'a str,
    pub data: &'a serde_json::Value,
    pub prev: &'a str,
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The line of `body` (with its newline) and its hash.
pub fn line_of(body: &Body<'_>) -> (String, String) {
    let mut text = serde_json::to_string(body).unwrap_or_else(|_| unreachable!());
    let hash = hex(&Sha256::digest(text.as_bytes()));
    text.pop(); // the closing brace, put back after the hash
    text.push_str(",\"hash\":\"");
    text.push_str(&hash);
    text.push_str("\"}\n");
    (text, hash)
}

/// What a line holds, read back.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Parsed {
    pub seq: u64,
    pub time: String,
    pub session: String,
    pub kind: String,
    pub data: serde_json::Value,
    pub prev: String,
    pub hash: String,
}

/// Why a line breaks the chain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Broken {
    #[error("line {line}: not a trace event ({why})")]
    NotAnEvent { line: u64, why: String },
    #[error("line {line} (event {seq}): its hash does not match its contents (changed)")]
    Hash { line: u64, seq: u64 },
    #[error(
        "line {line} (event {seq}): it follows event {after} (an event was removed, added or moved)"
    )]
    Sequence { line: u64, seq: u64, after: u64 },
    #[error(
        "line {line} (event {seq}): its prev is not the hash of the event before it (the chain is broken there)"
    )]
    Link { line: u64, seq: u64 },
    #[error("line {line} (event {seq}): it belongs to session {found}, the trace to {session}")]
    Session {
        line: u64,
        seq: u64,
        session: String,
        found: String,
    },
    #[error("line {line}: the trace goes on after its seal")]
    AfterSeal { line: u64 },
    #[error("the seal's signature does not verify with the given keys")]
    Signature,
    #[error("reading line {line}: {why}")]
    Read { line: u64, why: String },
}

/// What a whole, unbroken trace is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub session: String,
    pub events: u64,
    /// The last event's hash.
    pub head: String,
    /// Whether it ends in a seal, and if so whether a key checked it (`None`: no key was
    /// given, so only the chain was checked).
    pub sealed: bool,
    pub signature_checked: Option<bool>,
    /// A last line cut short (a server killed while writing it): left out, not an error.
    pub torn_tail: bool,
}

/// Splits `line` (without its newline) into its body's bytes and its hash.
fn split(line: &str) -> Option<(String, &str)> {
    const TAIL: usize = ",\"hash\":\"".len() + 64 + "\"}".len();
    if line.len() < TAIL || !line.ends_with("\"}") {
        return None;
    }
    let at = line.len() - TAIL;
    let tail = line.get(at..)?;
    let hash = tail.strip_prefix(",\"hash\":\"")?.strip_suffix("\"}")?;
    if !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut body = line[..at].to_owned();
    body.push('}');
    Some((body, hash))
}

/// Parses one line (without its newline) and checks its own hash.
pub fn parse_line(line: &str, number: u64) -> Result<Parsed, Broken> {
    let not = |why: &str| Broken::NotAnEvent {
        line: number,
        why: why.to_owned(),
    };
    let (body, hash) = split(line).ok_or_else(|| not("no hash at its end"))?;
    let parsed: Parsed = serde_json::from_str(line).map_err(|e| not(&e.to_string()))?;
    if hex(&Sha256::digest(body.as_bytes())) != hash {
        return Err(Broken::Hash {
            line: number,
            seq: parsed.seq,
        });
    }
    Ok(parsed)
}

/// The seq a line starts with (`{"seq":N,`), without parsing the rest.
pub fn seq_of(line: &str) -> Option<u64> {
    let rest = line.strip_prefix("{\"seq\":")?;
    let end = rest.find(',')?;
    rest[..end].parse().ok()
}

/// Checks a seal: `(key id, mac hex, signed bytes) -> verified`.
pub type SealCheck<'a> = &'a dyn Fn(&str, &str, &[u8]) -> bool;

/// Checks a trace read from `input`; `check_seal` (when keys are given) verifies a seal's
/// HMAC of the hash before it: `(key id, mac hex, signed bytes) -> verified`.
pub fn verify(input: impl BufRead, check_seal: Option<SealCheck<'_>>) -> Result<Verified, Broken> {
    let mut prev = GENESIS.to_owned();
    let mut last_seq = 0;
    let mut session: Option<String> = None;
    let mut sealed = false;
    let mut signature_checked = None;
    let mut torn_tail = false;
    for (i, line) in input.split(b'\n').enumerate() {
        let number = i as u64 + 1;
        let bytes = line.map_err(|e| Broken::Read {
            line: number,
            why: e.to_string(),
        })?;
        if torn_tail {
            // Only the very last line may be cut short.
            return Err(Broken::NotAnEvent {
                line: number - 1,
                why: "cut short".into(),
            });
        }
        if bytes.is_empty() {
            continue;
        }
        let text = String::from_utf8(bytes).map_err(|_| Broken::NotAnEvent {
            line: number,
            why: "not UTF-8".into(),
        })?;
        if sealed {
            return Err(Broken::AfterSeal { line: number });
        }
        let event = match parse_line(&text, number) {
            Ok(e) => e,
            Err(Broken::NotAnEvent { .. }) if seq_of(&text).is_some() && split(&text).is_none() => {
                // A line with no end yet: the writer was stopped in the middle of it.
                torn_tail = true;
                continue;
            }
            Err(e) => return Err(e),
        };
        if event.seq != last_seq + 1 {
            return Err(Broken::Sequence {
                line: number,
                seq: event.seq,
                after: last_seq,
            });
        }
        if event.prev != prev {
            return Err(Broken::Link {
                line: number,
                seq: event.seq,
            });
        }
        match &session {
            None => session = Some(event.session.clone()),
            Some(s) if *s != event.session => {
                return Err(Broken::Session {
                    line: number,
                    seq: event.seq,
                    session: s.clone(),
                    found: event.session,
                });
            }
            Some(_) => {}
        }
        if event.kind == SEALED {
            sealed = true;
            if let Some(check) = check_seal {
                let key = event.data["key"].as_str().unwrap_or_default();
                let mac = event.data["mac"].as_str().unwrap_or_default();
                if !check(key, mac, &seal_input(&prev)) {
                    return Err(Broken::Signature);
                }
                signature_checked = Some(true);
            }
        }
        prev = event.hash;
        last_seq = event.seq;
    }
    Ok(Verified {
        session: session.unwrap_or_default(),
        events: last_seq,
        head: prev,
        sealed,
        signature_checked,
        torn_tail,
    })
}

/// What a seal's HMAC covers: [`SEAL_DOMAIN`], then the hash of the event before it.
pub fn seal_input(prev_hash: &str) -> Vec<u8> {
    let mut v = SEAL_DOMAIN.to_vec();
    v.extend_from_slice(prev_hash.as_bytes());
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u64) -> String {
        let mut prev = GENESIS.to_owned();
        let mut out = String::new();
        for seq in 1..=n {
            let data = serde_json::json!({"n": seq, "text": "a \"quoted\"\nline"});
            let (line, hash) = line_of(&Body {
                seq,
                time: "2026-12-02T08:00:00.000Z",
                session: "ses-a",
                kind: "cell",
                data: &data,
                prev: &prev,
            });
            out.push_str(&line);
            prev = hash;
        }
        out
    }

    #[test]
    fn a_whole_chain_verifies_and_its_seq_reads_without_parsing() {
        let text = chain(5);
        let v = verify(text.as_bytes(), None).unwrap();
        assert_eq!(
            (v.events, v.session.as_str(), v.sealed),
            (5, "ses-a", false)
        );
        assert_eq!(seq_of(text.lines().nth(2).unwrap()), Some(3));
    }

    #[test]
    fn a_changed_line_is_named() {
        let text = chain(4).replacen("\"n\":3", "\"n\":33", 1);
        assert_eq!(
            verify(text.as_bytes(), None),
            Err(Broken::Hash { line: 3, seq: 3 })
        );
    }

    #[test]
    fn a_removed_line_is_named() {
        let text = chain(4);
        let mut lines: Vec<&str> = text.lines().collect();
        lines.remove(1);
        let text = lines.join("\n");
        assert_eq!(
            verify(text.as_bytes(), None),
            Err(Broken::Sequence {
                line: 2,
                seq: 3,
                after: 1
            })
        );
    }

    #[test]
    fn a_rehashed_line_still_breaks_the_link() {
        // Someone changes event 2 and recomputes its own hash: event 2 is whole, but its
        // successor's prev no longer matches.
        let text = chain(3);
        let lines: Vec<&str> = text.lines().collect();
        let old = parse_line(lines[1], 2).unwrap();
        let data = serde_json::json!({"n": 99});
        let (forged, _) = line_of(&Body {
            seq: 2,
            time: &old.time,
            session: &old.session,
            kind: &old.kind,
            data: &data,
            prev: &old.prev,
        });
        let text = format!("{}\n{}{}\n", lines[0], forged, lines[2]);
        assert_eq!(
            verify(text.as_bytes(), None),
            Err(Broken::Link { line: 3, seq: 3 })
        );
    }

    #[test]
    fn a_torn_last_line_is_left_out_but_a_torn_middle_is_not() {
        let text = chain(3);
        let torn = &text[..text.len() - 20];
        let v = verify(torn.as_bytes(), None).unwrap();
        assert_eq!((v.events, v.torn_tail), (2, true));
        let lines: Vec<&str> = text.lines().collect();
        let middle = format!("{}\n{}\n{}\n", lines[0], &lines[1][..40], lines[2]);
        assert!(matches!(
            verify(middle.as_bytes(), None),
            Err(Broken::NotAnEvent { line: 2, .. })
        ));
    }
}
