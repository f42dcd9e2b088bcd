//! A trace's lines read as events, for what is made of them: the review page
//! ([`super::review`]), the OpenTelemetry spans ([`super::otlp`]) and the review packet
//! ([`super::packet`]).

use serde_json::Value;

use super::Line;
use super::chain::{Broken, Verified};

/// One event of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub seq: u64,
    /// RFC 3339 UTC, as written.
    pub time: String,
    pub kind: String,
    pub data: Value,
}

impl Recorded {
    /// A string field of `data`.
    pub fn str(&self, field: &str) -> Option<&str> {
        self.data.get(field).and_then(Value::as_str)
    }
}

/// The events of `lines` (a line that is not JSON, which a checked trace never has, is
/// left out).
pub fn events(lines: &[Line]) -> Vec<Recorded> {
    lines
        .iter()
        .filter_map(|l| {
            let mut v: Value = serde_json::from_str(&l.text).ok()?;
            Some(Recorded {
                seq: l.seq,
                time: v.get("time")?.as_str()?.to_owned(),
                kind: l.kind.clone(),
                data: v.get_mut("data").map(Value::take).unwrap_or(Value::Null),
            })
        })
        .collect()
}

/// What a check of the trace found, in words and as a verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The chain is whole (and a seal, when checked, verifies).
    pub ok: bool,
    pub sealed: bool,
    /// One line: `chain whole, 12 events, sealed, signature verified` or where it breaks.
    pub text: String,
}

impl From<&Result<Verified, Broken>> for Verdict {
    fn from(r: &Result<Verified, Broken>) -> Self {
        match r {
            Ok(v) => {
                let seal = match (v.sealed, v.signature_checked) {
                    (false, _) => "open (not sealed yet)",
                    // A wrong signature is a `Broken`.
                    (true, Some(_)) => "sealed, signature verified",
                    (true, None) => "sealed, signature not checked",
                };
                let torn = if v.torn_tail {
                    ", a torn last line left out"
                } else {
                    ""
                };
                Self {
                    ok: true,
                    sealed: v.sealed,
                    text: format!("chain whole, {} events, {seal}{torn}", v.events),
                }
            }
            Err(b) => Self {
                ok: false,
                sealed: false,
                text: format!("broken: {b}"),
            },
        }
    }
}
