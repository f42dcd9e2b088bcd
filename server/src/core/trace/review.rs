//! The review page of a session (`GET /v1/sessions/{id}/review`): one HTML document made
//! on the server from the trace, with its style inline and no request of its own (no
//! script to fetch data, no font, no CDN), so it also reads offline, saved or inside the
//! review packet. A timeline of every event (each cell's code, output and end), the files
//! changed through the API, the network log, and links to a fork's parent and children.
//!
//! A long trace is tens of thousands of elements: each event is laid out only when near the
//! screen (`content-visibility: auto`, with a size kept for the ones not yet drawn), which
//! is what holds a 10 000-event page to the browser's budget (docs/measurements.md).
//!
//! Every text from the trace is escaped ([`esc`]) and the page is served with a policy
//! that runs no script but its own one ([`content_security_policy`]): what a sandbox
//! printed is shown, never run. That one script writes, once the page is laid out, how
//! long it took into `<html data-rendered-ms>`, which the browser test and the benchmark
//! read.

use std::fmt::Write as _;

use base64::Engine as _;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::view::{Recorded, Verdict};

/// The page's style, inline: the page is one document.
const STYLE: &str = r#"
:root { color-scheme: light dark; --fg: #1b1f24; --bg: #fff; --mute: #57606a; --line: #d0d7de;
  --ok: #1a7f37; --bad: #cf222e; --warn: #9a6700; --code: #f6f8fa; }
@media (prefers-color-scheme: dark) { :root { --fg: #e6edf3; --bg: #0d1117; --mute: #8d96a0;
  --line: #30363d; --ok: #3fb950; --bad: #f85149; --warn: #d29922; --code: #161b22; } }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 72rem; padding: 1rem; font: 15px/1.45 system-ui, sans-serif;
  color: var(--fg); background: var(--bg); }
h1 { font-size: 1.25rem; margin: 0 0 .5rem; word-break: break-all; }
h2 { font-size: 1.05rem; margin: 1.5rem 0 .5rem; border-bottom: 1px solid var(--line); }
code, pre { font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
pre { background: var(--code); border: 1px solid var(--line); border-radius: 6px; margin: .3rem 0;
  padding: .4rem .6rem; max-height: 20em; overflow: auto; white-space: pre-wrap; word-break: break-word; }
pre.err { border-left: 3px solid var(--bad); }
a { color: inherit; }
.verdict { display: inline-block; padding: .15rem .5rem; border-radius: 6px; font-weight: 600; }
.verdict.ok { color: var(--ok); border: 1px solid var(--ok); }
.verdict.bad { color: var(--bad); border: 1px solid var(--bad); }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .1rem 1rem; margin: .6rem 0; }
dl.facts dt { color: var(--mute); }
dl.facts dd { margin: 0; word-break: break-all; }
nav.counts { color: var(--mute); }
ol.timeline { list-style: none; margin: 0; padding: 0; }
ol.timeline > li { border-left: 3px solid var(--line); padding: .2rem 0 .5rem .7rem; margin: 0 0 .3rem; }
ol.timeline > li { content-visibility: auto; contain-intrinsic-size: auto 4.5em; }
li.ok { border-left-color: var(--ok) !important; }
li.bad { border-left-color: var(--bad) !important; }
li.warn { border-left-color: var(--warn) !important; }
.meta { display: flex; flex-wrap: wrap; gap: .2rem .7rem; align-items: baseline; }
.meta .seq { color: var(--mute); text-decoration: none; min-width: 3.5em; }
.meta time { color: var(--mute); font-variant-numeric: tabular-nums; }
.kind { font-weight: 600; }
.what { word-break: break-word; }
.note { color: var(--mute); font-size: .9em; margin: .2rem 0; }
.bad-text { color: var(--bad); }
table { border-collapse: collapse; width: 100%; font-size: .92em; }
th, td { text-align: left; padding: .25rem .5rem; border-bottom: 1px solid var(--line); vertical-align: top; }
td { word-break: break-all; }
.scroll { overflow-x: auto; }
@media (max-width: 40rem) { body { padding: .6rem; font-size: 14px; }
  .meta .seq { min-width: 0; } pre { max-height: 14em; } }
"#;

/// The page's one script: how long the page took to be laid out.
const SCRIPT: &str = "addEventListener('load',function(){document.body.offsetHeight;\
document.documentElement.dataset.renderedMs=Math.round(performance.now())});";

/// The `Content-Security-Policy` the page is served with: nothing is fetched, styles
/// inline, and no script runs but [`SCRIPT`] (by its hash).
pub fn content_security_policy() -> String {
    let hash = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(SCRIPT));
    format!(
        "default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{hash}'; \
         img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
}

/// `s` made safe as HTML text and inside a quoted attribute.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A link to another session's review page (a sibling of this page's URL), or the id as
/// text when it is not a session id.
fn session_link(id: &str) -> String {
    if super::valid_id(id) {
        format!("<a href=\"../{0}/review\"><code>{0}</code></a>", esc(id))
    } else {
        format!("<code>{}</code>", esc(id))
    }
}

/// The clock time of an RFC 3339 stamp (`15:00:00.123`).
fn clock(time: &str) -> &str {
    time.get(11..23).unwrap_or(time)
}

fn num(v: &Value, field: &str) -> Option<f64> {
    v.get(field).and_then(Value::as_f64)
}

/// How an event is marked: `ok`, `bad` or `warn` (its left bar), or none.
fn mark(e: &Recorded) -> &'static str {
    match e.kind.as_str() {
        "cell" => match e.str("status") {
            Some("ok") => "ok",
            Some("timeout" | "cancelled") => "warn",
            _ => "bad",
        },
        "process_end" => match (e.data.get("exit_code"), e.data.get("signal")) {
            (Some(Value::Number(n)), _) if n.as_i64() == Some(0) => "ok",
            _ => "bad",
        },
        "dns" | "connect" => {
            if e.data["allowed"] == true {
                "ok"
            } else {
                "bad"
            }
        }
        "ended" => match e.str("reason") {
            Some("deleted" | "finished") => "",
            _ => "warn",
        },
        _ => "",
    }
}

fn pre(out: &mut String, class: &str, text: &str) {
    let _ = write!(out, "<pre class=\"{class}\">{}</pre>", esc(text));
}

/// A note that `field_cut` bytes of a stream were left out, if any.
fn cut_note(out: &mut String, e: &Recorded, name: &str) {
    if let Some(cut) = num(&e.data, &format!("{name}_cut")) {
        let total = num(&e.data, &format!("{name}_bytes")).unwrap_or(0.0);
        let _ = write!(
            out,
            "<p class=\"note\">{name}: {cut} of {total} bytes not kept (the trace's output \
             budget); its SHA-256 is of all of it</p>"
        );
    }
}

/// One event's line of words and its blocks.
fn event(out: &mut String, e: &Recorded) {
    let d = &e.data;
    let s = |f: &str| {
        d.get(f)
            .and_then(Value::as_str)
            .map(esc)
            .unwrap_or_default()
    };
    let what = match e.kind.as_str() {
        "created" => {
            let mut w = format!("template <code>{}</code>, {}", s("template"), s("language"));
            if let Some(p) = e.str("parent") {
                let _ = write!(w, ", forked from {}", session_link(p));
            }
            w
        }
        "cell" => {
            let mut w = format!("<b>{}</b>", s("status"));
            if let Some(code) = d.get("exit_code").filter(|v| !v.is_null()) {
                let _ = write!(w, " · exit {code}");
            }
            if let Some(sig) = d.get("signal").filter(|v| !v.is_null()) {
                let _ = write!(w, " · signal {sig}");
            }
            if let Some(ms) = num(d, "duration_ms") {
                let _ = write!(w, " · {ms:.1} ms");
            }
            let _ = write!(w, " · {} · {}", s("language"), s("route"));
            w
        }
        "process" => format!("pid {}", d["pid"]),
        "process_stdin" => format!("pid {} · {} bytes", d["pid"], d["bytes"]),
        "process_signal" => format!("pid {} · signal {}", d["pid"], d["signal"]),
        "process_end" => format!(
            "pid {} · exit {} · signal {}",
            d["pid"], d["exit_code"], d["signal"]
        ),
        "file_written" => format!(
            "<code>{}</code> · {} bytes · sha256 {}",
            s("path"),
            d["bytes"],
            esc(e.str("sha256").unwrap_or("").get(..12).unwrap_or(""))
        ),
        "file_removed" | "dir_made" => format!("<code>{}</code>", s("path")),
        "file_renamed" => format!("<code>{}</code> → <code>{}</code>", s("from"), s("to")),
        "forked" => {
            let children: Vec<String> = d["children"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(session_link)
                .collect();
            format!("into {}", children.join(", "))
        }
        "snapshot" => format!("<code>{}</code>", s("snapshot")),
        "files_changed" => {
            let against = match &d["against"] {
                Value::Number(n) => format!("<a href=\"#e{n}\">#{n}</a>"),
                _ => "an empty work directory".into(),
            };
            let mut w = format!(
                "{} changes · {} files, {} unchanged · {} · against {against}",
                d["changes"].as_array().map_or(0, Vec::len),
                d["files"],
                d["unchanged"],
                s("why"),
            );
            if let Some(cut) = e.str("cut") {
                let _ = write!(
                    w,
                    " · <span class=\"bad-text\">walk cut ({})</span>",
                    esc(cut)
                );
            }
            w
        }
        "dns" | "connect" => network_words(d),
        "ended" => {
            let mut w = format!("<b>{}</b>", s("reason"));
            if let Some(detail) = e.str("detail") {
                let _ = write!(w, ": {}", esc(detail));
            }
            w
        }
        "sealed" => format!("{} events · key <code>{}</code>", d["events"], s("key")),
        _ => format!("<code>{}</code>", esc(&d.to_string())),
    };
    let mark = mark(e);
    let _ = write!(
        out,
        "<li id=\"e{seq}\" class=\"{mark}\"><div class=\"meta\"><a class=\"seq\" \
         href=\"#e{seq}\">#{seq}</a><time datetime=\"{time}\">{clock}</time>\
         <span class=\"kind\">{kind}</span><span class=\"what\">{what}</span></div>",
        seq = e.seq,
        time = esc(&e.time),
        clock = esc(clock(&e.time)),
        kind = esc(&e.kind),
    );
    match e.kind.as_str() {
        "cell" => {
            pre(out, "code", e.str("code").unwrap_or(""));
            for (name, class) in [("stdout", "out"), ("stderr", "err")] {
                if let Some(text) = e.str(name).filter(|t| !t.is_empty()) {
                    pre(out, class, text);
                }
                cut_note(out, e, name);
            }
            if let Some(err) = d.get("error") {
                let _ = write!(
                    out,
                    "<p class=\"bad-text\">{}: {}</p>",
                    esc(err["name"].as_str().unwrap_or("")),
                    esc(err["value"].as_str().unwrap_or(""))
                );
            }
            if let Some(why) = e.str("crash") {
                let _ = write!(out, "<p class=\"bad-text\">crashed: {}</p>", esc(why));
            }
        }
        "process" => pre(out, "code", e.str("script").unwrap_or("")),
        "files_changed" => {
            for c in d["changes"].as_array().into_iter().flatten() {
                let _ = write!(
                    out,
                    "<p class=\"note\"><b>{}</b> <code>{}</code> {}</p>",
                    esc(c["change"].as_str().unwrap_or("")),
                    esc(c["path"].as_str().unwrap_or("")),
                    c.get("size")
                        .map(|n| format!("· {n} bytes"))
                        .unwrap_or_default(),
                );
                if let Some(diff) = c["diff"].as_str() {
                    pre(out, "diff", diff);
                } else if c["text_cut"] == true {
                    out.push_str(
                        "<p class=\"note\">its diff is past the trace's output budget</p>",
                    );
                }
            }
        }
        _ => {}
    }
    out.push_str("</li>\n");
}

fn network_words(d: &Value) -> String {
    let mut w = String::new();
    if let Some(name) = d.get("name").and_then(Value::as_str) {
        let _ = write!(w, "<code>{}</code> ", esc(name));
    }
    if let Some(addr) = d.get("addr").and_then(Value::as_str) {
        let _ = write!(w, "{}", esc(addr));
        if let Some(port) = d.get("port").filter(|p| !p.is_null()) {
            let _ = write!(w, ":{port}");
        }
        w.push(' ');
    }
    let verdict = if d["allowed"] == true {
        "allowed"
    } else {
        "denied"
    };
    let _ = write!(
        w,
        "· <b>{verdict}</b> ({})",
        esc(d["reason"].as_str().unwrap_or(""))
    );
    if let Some(rule) = d.get("rule").and_then(Value::as_str) {
        let _ = write!(w, " by <code>{}</code>", esc(rule));
    }
    w
}

/// The page of session `id` whose trace holds `events`, checked as `verdict` says.
pub fn page(id: &str, events: &[Recorded], verdict: &Verdict) -> String {
    let find = |kind: &str| events.iter().find(|e| e.kind == kind);
    let count = |f: &dyn Fn(&Recorded) -> bool| events.iter().filter(|e| f(e)).count();
    let mut out = String::with_capacity(4096 + events.len() * 400);
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>Review of {id}</title><style>{STYLE}</style></head><body>\n<header>\
         <h1>Session <code>{id}</code></h1><span class=\"verdict {class}\">{verdict}</span>\
         <dl class=\"facts\">",
        id = esc(id),
        class = if verdict.ok { "ok" } else { "bad" },
        verdict = esc(&verdict.text),
    );
    if let Some(c) = find("created") {
        let _ = write!(
            out,
            "<dt>started</dt><dd><time datetime=\"{0}\">{0}</time></dd>\
             <dt>template</dt><dd><code>{1}</code> ({2})</dd>",
            esc(&c.time),
            esc(c.str("template").unwrap_or("")),
            esc(c.str("language").unwrap_or("")),
        );
        if let Some(p) = c.str("parent") {
            let _ = write!(out, "<dt>forked from</dt><dd>{}</dd>", session_link(p));
        }
    }
    let forks: Vec<String> = events
        .iter()
        .filter(|e| e.kind == "forked")
        .flat_map(|e| e.data["children"].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_str().map(session_link))
        .collect();
    if !forks.is_empty() {
        let _ = write!(out, "<dt>forks</dt><dd>{}</dd>", forks.join(", "));
    }
    match find("ended") {
        Some(e) => {
            let _ = write!(
                out,
                "<dt>ended</dt><dd>{} at <time datetime=\"{1}\">{1}</time></dd>",
                esc(e.str("reason").unwrap_or("")),
                esc(&e.time)
            );
        }
        None => out.push_str("<dt>ended</dt><dd>not yet (live)</dd>"),
    }
    let cells = count(&|e| e.kind == "cell");
    let failed = count(&|e| e.kind == "cell" && e.str("status") != Some("ok"));
    let processes = count(&|e| e.kind == "process");
    let files: Vec<&Recorded> = events
        .iter()
        .filter(|e| e.kind.starts_with("file_") || e.kind == "dir_made")
        .collect();
    let network: Vec<&Recorded> = events
        .iter()
        .filter(|e| e.kind == "dns" || e.kind == "connect")
        .collect();
    let _ = write!(
        out,
        "</dl><nav class=\"counts\"><a href=\"#timeline\">{} events</a> · {cells} cells \
         ({failed} not ok) · {processes} processes · <a href=\"#files\">{} file changes</a> · \
         <a href=\"#network\">{} network attempts</a></nav></header>\n<main>\
         <section id=\"timeline\"><h2>Timeline</h2><ol class=\"timeline\">\n",
        events.len(),
        files.len(),
        network.len(),
    );
    for e in events {
        event(&mut out, e);
    }
    out.push_str("</ol></section>\n<section id=\"files\"><h2>Files changed through the API</h2>");
    if files.is_empty() {
        out.push_str("<p class=\"note\">None.</p>");
    } else {
        out.push_str(
            "<div class=\"scroll\"><table><tr><th>#</th><th>change</th><th>path</th>\
             <th>bytes</th><th>sha256</th></tr>",
        );
        for e in &files {
            let path = match e.kind.as_str() {
                "file_renamed" => format!(
                    "{} → {}",
                    esc(e.str("from").unwrap_or("")),
                    esc(e.str("to").unwrap_or(""))
                ),
                _ => esc(e.str("path").unwrap_or("")),
            };
            let _ = write!(
                out,
                "<tr><td><a href=\"#e{0}\">{0}</a></td><td>{1}</td><td><code>{path}</code></td>\
                 <td>{2}</td><td><code>{3}</code></td></tr>",
                e.seq,
                esc(&e.kind),
                e.data
                    .get("bytes")
                    .map(Value::to_string)
                    .unwrap_or_default(),
                esc(e.str("sha256").unwrap_or("")),
            );
        }
        out.push_str("</table></div>");
    }
    let walks: Vec<&Recorded> = events
        .iter()
        .filter(|e| e.kind == "files_changed")
        .collect();
    if walks.is_empty() {
        out.push_str(
            "<p class=\"note\">No checkpoint of the work directory was taken, so what the \
             sandbox's own programs changed is not recorded (docs/evidence.md).</p>",
        );
    } else {
        out.push_str("<h2>Work directory checkpoints</h2><ol class=\"timeline\">");
        for e in walks {
            event(&mut out, e);
        }
        out.push_str("</ol>");
    }
    out.push_str("</section>\n<section id=\"network\"><h2>Network</h2>");
    if network.is_empty() {
        out.push_str("<p class=\"note\">No attempt.</p>");
    } else {
        out.push_str("<ol class=\"timeline\">");
        for e in network {
            event(&mut out, e);
        }
        out.push_str("</ol>");
    }
    let _ = write!(
        out,
        "</section></main>\n<footer class=\"note\">Made by bud from the session's trace \
         (<code>GET /v1/sessions/{id}/trace</code>).</footer><script>{SCRIPT}</script>\
         </body></html>\n",
        id = esc(id)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(seq: u64, kind: &str, data: Value) -> Recorded {
        Recorded {
            seq,
            time: "2026-12-02T15:00:00.123Z".into(),
            kind: kind.into(),
            data,
        }
    }

    fn ok() -> Verdict {
        Verdict {
            ok: true,
            sealed: true,
            text: "chain whole".into(),
        }
    }

    #[test]
    fn what_a_sandbox_printed_is_shown_escaped_never_as_markup() {
        let evil = "<script>alert('x')</script><img src=x onerror=alert(1)>\"&";
        let events = [ev(
            1,
            "cell",
            json!({"status": "ok", "code": evil, "stdout": evil, "stderr": evil,
                   "language": "python", "route": "exec"}),
        )];

        let html = page("ses-1", &events, &ok());

        assert!(!html.contains("<img"), "{html}");
        assert_eq!(html.matches("<script>").count(), 1, "only the page's own");
        assert_eq!(
            html.matches("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;")
                .count(),
            3
        );
    }

    #[test]
    fn a_fork_links_its_parent_and_children_and_a_bad_id_is_no_link() {
        let events = [
            ev(
                1,
                "created",
                json!({"template": "python", "language": "python", "parent": "ses-parent"}),
            ),
            ev(2, "forked", json!({"children": ["ses-a", "../../x"]})),
        ];

        let html = page("ses-1", &events, &ok());

        assert!(html.contains("href=\"../ses-parent/review\""));
        assert!(html.contains("href=\"../ses-a/review\""));
        assert!(!html.contains("href=\"../../../x"), "{html}");
        assert!(html.contains("<code>../../x</code>"));
    }

    #[test]
    fn the_policy_allows_exactly_the_pages_own_script() {
        let csp = content_security_policy();
        let hash = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(SCRIPT));
        assert!(csp.contains(&format!("script-src 'sha256-{hash}'")));
        assert!(csp.starts_with("default-src 'none'"));
        assert!(page("ses-1", &[], &ok()).contains(&format!("<script>{SCRIPT}</script>")));
    }

    #[test]
    fn a_cut_output_and_a_broken_chain_are_said() {
        let events = [ev(
            1,
            "cell",
            json!({"status": "error", "stdout": "abc", "stdout_bytes": 10, "stdout_cut": 7,
                   "error": {"name": "ValueError", "value": "no"}}),
        )];
        let bad = Verdict {
            ok: false,
            sealed: false,
            text: "broken: line 2".into(),
        };

        let html = page("ses-1", &events, &bad);

        assert!(html.contains("stdout: 7 of 10 bytes not kept"));
        assert!(html.contains("class=\"verdict bad\">broken: line 2"));
        assert!(html.contains("<li id=\"e1\" class=\"bad\">"));
        assert!(html.contains("ValueError: no"));
    }
}
