//! What each kind of trace event holds: the `data` of its line (docs/evidence.md lists the
//! kinds). Built on the thread the event happens on; output is kept within the session's
//! budget, and what is cut is said (`stdout_cut`: bytes left out).

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::core::audit::Origin;

/// Bytes of a cell's or a process's code a trace keeps.
pub const CODE_CAP: usize = 64 << 10;

fn sha256_hex(b: &[u8]) -> String {
    super::chain::hex(&Sha256::digest(b))
}

/// `bytes` as text, at most `cap` bytes of it (a character the cap would cut in two is
/// left out whole): the text, and how many bytes were left out.
fn kept(bytes: &[u8], cap: usize) -> (String, usize) {
    let mut end = bytes.len().min(cap);
    if end < bytes.len() {
        // The last character's first byte within the last four: cut before it if it does
        // not end by `end`.
        for i in (end.saturating_sub(3)..end).rev() {
            let b = bytes[i];
            if b & 0xc0 == 0x80 {
                continue;
            }
            let len = match b {
                0xf0.. => 4,
                0xe0.. => 3,
                0xc0.. => 2,
                _ => 1,
            };
            if i + len > end {
                end = i;
            }
            break;
        }
    }
    let text = String::from_utf8_lossy(&bytes[..end]).into_owned();
    (text, bytes.len() - end)
}

/// Puts one output stream into `data` as `NAME`, `NAME_bytes`, `NAME_sha256` and, when cut,
/// `NAME_cut`, taking what it keeps from `budget`; returns the bytes kept.
fn output(data: &mut Value, name: &str, bytes: &[u8], budget: &mut u64) -> u64 {
    let cap = usize::try_from(*budget).unwrap_or(usize::MAX);
    let (text, cut) = kept(bytes, cap);
    let n = (bytes.len() - cut) as u64;
    *budget -= n;
    data[name] = Value::String(text);
    data[format!("{name}_bytes")] = json!(bytes.len());
    data[format!("{name}_sha256")] = json!(sha256_hex(bytes));
    if cut > 0 {
        data[format!("{name}_cut")] = json!(cut);
    }
    n
}

/// A finished cell (or context cell, `kind` says which): who and where, its code, stdin's
/// size, its end and timings, its output within `budget`.
pub fn cell(
    origin: &Origin,
    job: &vmm::Job,
    r: &vmm::JobResult,
    waited: std::time::Duration,
    budget: &mut u64,
) -> Value {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let (code, code_cut) = kept(&job.code, CODE_CAP);
    let mut data = json!({
        "key": origin.key,
        "route": origin.route,
        "language": job.language,
        "code": code,
        "code_bytes": job.code.len(),
        "code_sha256": sha256_hex(&job.code),
        "args": job.args,
        "stdin_bytes": job.stdin.len(),
        "status": r.status,
        "exit_code": r.exit_code,
        "signal": r.signal,
        "queue_ms": ms(waited),
        "duration_ms": ms(r.timings.run),
        "total_ms": ms(r.timings.total),
    });
    if code_cut > 0 {
        data["code_cut"] = json!(code_cut);
    }
    let mut kept = output(&mut data, "stdout", &r.stdout, budget);
    kept += output(&mut data, "stderr", &r.stderr, budget);
    data["output_bytes_kept"] = json!(kept);
    if let Some(e) = &r.error {
        data["error"] = json!({"name": e.name, "value": e.value});
    }
    if let Some(why) = &r.crash {
        data["crash"] = json!(why);
    }
    if !r.display.is_empty() || !r.figures.is_empty() {
        data["results"] = json!({"display": r.display.len(), "figures": r.figures.len()});
    }
    data
}

/// A background process started: its script (capped), who asked.
pub fn process(origin: &Origin, script: &[u8]) -> Value {
    let (text, cut) = kept(script, CODE_CAP);
    let mut data = json!({
        "key": origin.key,
        "route": origin.route,
        "script": text,
        "script_bytes": script.len(),
    });
    if cut > 0 {
        data["script_cut"] = json!(cut);
    }
    data
}

/// A file written through the API: where, how big, its hash.
pub fn file_written(path: &str, data: &[u8]) -> Value {
    json!({"path": path, "bytes": data.len(), "sha256": sha256_hex(data)})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_past_the_budget_is_cut_and_says_how_much() {
        let mut data = json!({});
        let mut budget = 5;

        let n = output(&mut data, "stdout", "héllo world".as_bytes(), &mut budget);

        // "h", "é" (2 bytes), "l", "l" = 5 bytes kept.
        assert_eq!((n, budget), (5, 0));
        assert_eq!(data["stdout"], "héll");
        assert_eq!(data["stdout_bytes"], 12);
        assert_eq!(data["stdout_cut"], 7);
    }

    #[test]
    fn a_character_cut_in_two_is_dropped_not_mangled() {
        let (text, cut) = kept("aé".as_bytes(), 2);
        assert_eq!((text.as_str(), cut), ("a", 2)); // both bytes of "é" left out
    }
}
