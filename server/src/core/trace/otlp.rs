//! A trace as OpenTelemetry spans, in OTLP's JSON encoding (the body of an OTLP/HTTP
//! `POST /v1/traces` with `Content-Type: application/json`), so the tools that read traces
//! (Jaeger, Tempo, an OpenTelemetry Collector) read a session's.
//!
//! One trace per session (its id a hash of the session's), a root span for the session
//! from its `created` to its `ended`, a child span per cell (ending at the cell's event,
//! starting its run time before) and per background process (from its start to its end),
//! and every other event (files, forks, snapshots, network attempts, pauses, the seal) as
//! a span event of the root. Attributes are `bud.*`; a cell's code is kept up to
//! [`CODE_ATTRIBUTE_CAP`] bytes (the trace has it whole).

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::view::Recorded;
use crate::core::clock::rfc3339_nanos;

/// Bytes of a cell's code or a process's script an attribute keeps.
pub const CODE_ATTRIBUTE_CAP: usize = 4096;
/// OTLP's `SPAN_KIND_INTERNAL`.
const INTERNAL: u8 = 1;
/// OTLP's status codes.
const STATUS_OK: u8 = 1;
const STATUS_ERROR: u8 = 2;

fn hex_of(input: &str, bytes: usize) -> String {
    super::chain::hex(&Sha256::digest(input.as_bytes())[..bytes])
}

/// The trace id of session `id` (16 bytes).
pub fn trace_id(id: &str) -> String {
    hex_of(&format!("bud trace {id}"), 16)
}

/// The span id of event `seq` of session `id` (8 bytes); seq 0 is the session's span.
pub fn span_id(id: &str, seq: u64) -> String {
    hex_of(&format!("bud span {id} {seq}"), 8)
}

/// One OTLP attribute of a JSON value (strings, integers, floats, booleans; others as
/// their JSON text).
fn attribute(key: &str, v: &Value) -> Option<Value> {
    let value = match v {
        Value::Null => return None,
        Value::Bool(b) => json!({"boolValue": b}),
        Value::Number(n) if n.is_i64() || n.is_u64() => json!({"intValue": n.to_string()}),
        Value::Number(n) => json!({"doubleValue": n.as_f64()}),
        Value::String(s) => json!({"stringValue": s}),
        other => json!({"stringValue": other.to_string()}),
    };
    Some(json!({"key": key, "value": value}))
}

/// `s` cut to at most `cap` bytes at a character boundary.
fn capped(s: &str, cap: usize) -> &str {
    let mut end = s.len().min(cap);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The attributes of an event's data: each field as `bud.FIELD` but the outputs' text
/// (their sizes and hashes stay), code and scripts capped.
fn attributes(e: &Recorded) -> Vec<Value> {
    let mut out = vec![json!({"key": "bud.seq", "value": {"intValue": e.seq.to_string()}})];
    let Some(fields) = e.data.as_object() else {
        return out;
    };
    for (k, v) in fields {
        if matches!(k.as_str(), "stdout" | "stderr") {
            continue;
        }
        let v = match (k.as_str(), v) {
            ("code" | "script", Value::String(s)) => {
                Value::String(capped(s, CODE_ATTRIBUTE_CAP).to_owned())
            }
            _ => v.clone(),
        };
        out.extend(attribute(&format!("bud.{k}"), &v));
    }
    out
}

fn nanos(e: &Recorded) -> u64 {
    rfc3339_nanos(&e.time).unwrap_or(0)
}

/// OTLP's JSON writes 64-bit integers as strings.
fn n(v: u64) -> String {
    v.to_string()
}

/// The spans of session `id`'s trace `events`: the `resourceSpans` document.
pub fn export(id: &str, events: &[Recorded]) -> Value {
    let trace = trace_id(id);
    let root = span_id(id, 0);
    let first = events.first().map(nanos).unwrap_or(0);
    let last = events.last().map(nanos).unwrap_or(first);
    let mut spans = Vec::new();
    let mut root_events = Vec::new();
    let mut root_status = json!({"code": STATUS_OK});
    for (i, e) in events.iter().enumerate() {
        let at = nanos(e);
        match e.kind.as_str() {
            "cell" => {
                let ms = e.data["total_ms"]
                    .as_f64()
                    .or_else(|| e.data["duration_ms"].as_f64())
                    .unwrap_or(0.0);
                let start = at.saturating_sub((ms * 1e6) as u64);
                let status = match e.str("status") {
                    Some("ok") => json!({"code": STATUS_OK}),
                    other => {
                        let why = e.data["error"]["name"]
                            .as_str()
                            .or(other)
                            .unwrap_or("unknown");
                        json!({"code": STATUS_ERROR, "message": why})
                    }
                };
                spans.push(json!({
                    "traceId": trace, "spanId": span_id(id, e.seq), "parentSpanId": root,
                    "name": format!("cell {}", e.str("language").unwrap_or("")).trim_end(),
                    "kind": INTERNAL, "startTimeUnixNano": n(start), "endTimeUnixNano": n(at),
                    "attributes": attributes(e), "status": status,
                }));
            }
            "process" => {
                let pid = &e.data["pid"];
                let later = &events[i + 1..];
                let ends = later
                    .iter()
                    .position(|l| l.kind == "process_end" && &l.data["pid"] == pid);
                let end = ends.map(|j| &later[j]);
                let span_events: Vec<Value> = later[..ends.unwrap_or(later.len())]
                    .iter()
                    .filter(|l| l.kind.starts_with("process_") && &l.data["pid"] == pid)
                    .map(|l| {
                        json!({
                            "timeUnixNano": n(nanos(l)), "name": l.kind,
                            "attributes": attributes(l),
                        })
                    })
                    .collect();
                let (end_at, status) = match end {
                    Some(end) => {
                        let ok = end.data["exit_code"] == 0;
                        let mut attrs = attributes(e);
                        attrs.extend(attribute("bud.exit_code", &end.data["exit_code"]));
                        attrs.extend(attribute("bud.signal", &end.data["signal"]));
                        let status = if ok {
                            json!({"code": STATUS_OK})
                        } else {
                            json!({"code": STATUS_ERROR, "message": "exit"})
                        };
                        (nanos(end), (status, attrs))
                    }
                    // Still running when the trace was read (or lost with its session).
                    None => (last, (json!({"code": 0}), attributes(e))),
                };
                let (status, attrs) = status;
                spans.push(json!({
                    "traceId": trace, "spanId": span_id(id, e.seq), "parentSpanId": root,
                    "name": format!("process {pid}"), "kind": INTERNAL,
                    "startTimeUnixNano": n(at), "endTimeUnixNano": n(end_at.max(at)),
                    "attributes": attrs, "events": span_events, "status": status,
                }));
            }
            "process_stdin" | "process_signal" | "process_end" => {}
            kind => {
                if kind == "ended"
                    && matches!(
                        e.str("reason"),
                        Some("crashed" | "lost" | "timeout" | "failed")
                    )
                {
                    root_status = json!({"code": STATUS_ERROR, "message": e.str("reason")});
                }
                root_events.push(json!({
                    "timeUnixNano": n(at), "name": kind, "attributes": attributes(e),
                }));
            }
        }
    }
    let created = events.iter().find(|e| e.kind == "created");
    let mut root_attrs = vec![json!({"key": "bud.session", "value": {"stringValue": id}})];
    if let Some(c) = created {
        for f in ["template", "language", "parent"] {
            root_attrs.extend(attribute(&format!("bud.{f}"), &c.data[f]));
        }
    }
    spans.insert(
        0,
        json!({
            "traceId": trace, "spanId": root, "name": "session", "kind": INTERNAL,
            "startTimeUnixNano": n(first), "endTimeUnixNano": n(last),
            "attributes": root_attrs, "events": root_events, "status": root_status,
        }),
    );
    json!({"resourceSpans": [{
        "resource": {"attributes": [
            {"key": "service.name", "value": {"stringValue": "bud"}},
            {"key": "service.version", "value": {"stringValue": env!("CARGO_PKG_VERSION")}},
        ]},
        "scopeSpans": [{"scope": {"name": "bud.trace"}, "spans": spans}],
    }]})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seq: u64, time: &str, kind: &str, data: Value) -> Recorded {
        Recorded {
            seq,
            time: format!("2026-12-02T15:00:{time}Z"),
            kind: kind.into(),
            data,
        }
    }

    #[test]
    fn a_session_is_a_root_span_with_a_child_per_cell_and_process() {
        let events = [
            ev(
                1,
                "00.000",
                "created",
                json!({"template": "python", "language": "python"}),
            ),
            ev(
                2,
                "01.500",
                "cell",
                json!({"status": "ok", "total_ms": 500.0, "language": "python",
                "code": "print(1)", "stdout": "1\n", "stdout_bytes": 2}),
            ),
            ev(
                3,
                "02.000",
                "process",
                json!({"pid": 7, "script": "sleep 1"}),
            ),
            ev(
                4,
                "02.100",
                "file_written",
                json!({"path": "/a", "bytes": 1}),
            ),
            ev(5, "02.200", "process_stdin", json!({"pid": 7, "bytes": 3})),
            ev(
                6,
                "03.000",
                "process_end",
                json!({"pid": 7, "exit_code": 1, "signal": null}),
            ),
            ev(
                7,
                "04.000",
                "cell",
                json!({"status": "error", "total_ms": 10.0,
                "error": {"name": "ValueError", "value": "x"}}),
            ),
            ev(8, "05.000", "ended", json!({"reason": "deleted"})),
        ];

        let doc = export("ses-x", &events);
        let spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap();

        assert_eq!(spans.len(), 4, "{doc:#}");
        let root = &spans[0];
        assert_eq!(root["spanId"], span_id("ses-x", 0));
        assert_eq!(root["traceId"].as_str().unwrap().len(), 32);
        let base = rfc3339_nanos("2026-12-02T15:00:00Z").unwrap();
        assert_eq!(root["startTimeUnixNano"], n(base));
        assert_eq!(root["endTimeUnixNano"], n(base + 5_000_000_000));
        let names: Vec<&str> = root["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["created", "file_written", "ended"]);
        let cell = &spans[1];
        assert_eq!(cell["parentSpanId"], root["spanId"]);
        assert_eq!(cell["startTimeUnixNano"], n(base + 1_000_000_000));
        assert_eq!(cell["endTimeUnixNano"], n(base + 1_500_000_000));
        assert_eq!(cell["status"]["code"], STATUS_OK);
        let keys: Vec<&str> = cell["attributes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["key"].as_str().unwrap())
            .collect();
        assert!(keys.contains(&"bud.code") && keys.contains(&"bud.stdout_bytes"));
        assert!(
            !keys.contains(&"bud.stdout"),
            "output text stays in the trace"
        );
        let process = &spans[2];
        assert_eq!(process["endTimeUnixNano"], n(base + 3_000_000_000));
        assert_eq!(process["status"]["code"], STATUS_ERROR);
        assert_eq!(process["events"][0]["name"], "process_stdin");
        assert_eq!(spans[3]["status"]["message"], "ValueError");
    }

    #[test]
    fn code_attributes_are_capped_at_a_character_boundary() {
        let long = "é".repeat(CODE_ATTRIBUTE_CAP);
        let e = ev(1, "00.000", "cell", json!({"code": long}));
        let attrs = attributes(&e);
        let code = attrs[1]["value"]["stringValue"].as_str().unwrap();
        assert_eq!(code.len(), CODE_ATTRIBUTE_CAP);
    }
}
