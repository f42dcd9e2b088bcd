//! A session's review page in a real browser: a real, jailed `bud serve` records a session
//! (cells that print markup, fail and exit non-zero, a file written through the API, a fork,
//! the end), then Debian's chromium, headless, loads `GET /v1/sessions/{id}/review` and the
//! test reads the page as the browser laid it out (`--dump-dom`): the timeline, outputs shown
//! as text and never run, the file, the fork's links, the page's own script having run (it
//! writes `data-rendered-ms`), and a screenshot at a phone's and a wide screen's size. Then
//! the same state directory behind API keys: the page needs a key as the rest of the API.
//!
//! chromium is installed with apt-get when missing (as root; the test fails loudly if it
//! cannot be). It is told to resolve no name but loopback's and to fetch nothing of its own,
//! so the only traffic is to the test's server. Needs /dev/kvm.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::served::{Served, own_state_dir, serve};
use serde_json::{Value, json};

fn call(
    s: &Served,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> ureq::Response {
    let mut req =
        ureq::request(method, &format!("{}{path}", s.base)).timeout(Duration::from_secs(120));
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    let r = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    match r {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

fn json_call(s: &Served, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let r = call(s, method, path, None, body);
    let status = r.status();
    let text = r.into_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn cell(s: &Served, id: &str, code: &str) -> Value {
    let (status, r) = json_call(
        s,
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(json!({ "code": code })),
    );
    assert_eq!(status, 200, "{r}");
    r
}

/// Debian's chromium, installed with apt-get when missing.
fn chromium() -> PathBuf {
    if let Some(p) = bud_guest::host::find_program("chromium") {
        return p;
    }
    bud_guest::host::Apt::new()
        .install(&["chromium"], &mut |l| eprintln!("[apt] {l}"))
        .expect("installing Debian's chromium (the review page's browser test needs it)");
    bud_guest::host::find_program("chromium").expect("chromium installed but not on PATH")
}

/// chromium, headless, on `url` with `args` (its profile under `dir`): its stdout.
/// It resolves no name but loopback's and starts none of its own background fetches.
fn browse(dir: &Path, url: &str, args: &[&str]) -> String {
    let profile = dir.join("profile");
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-default-apps",
            "--disable-extensions",
            "--metrics-recording-only",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--virtual-time-budget=10000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .current_dir(dir)
        .output()
        .expect("running chromium");
    assert!(
        out.status.success(),
        "chromium {args:?} {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of `<html data-rendered-ms="N">` in a dumped DOM.
fn rendered_ms(dom: &str) -> Option<u64> {
    let at = dom.find("data-rendered-ms=\"")? + "data-rendered-ms=\"".len();
    dom[at..].split('"').next()?.parse().ok()
}

#[test]
fn a_recorded_session_reads_in_a_real_browser_on_a_phone_and_a_wide_screen() {
    common::require_kvm();
    let dir = common::source_dir().join("target/tmp/review");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = serve(&[]);
    let state_dir = own_state_dir(s.port).to_string_lossy().into_owned();
    s.wait_ready();
    let (status, r) = json_call(&s, "POST", "/v1/sessions", Some(json!({})));
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    // Markup a sandbox prints: shown as text, never an element, never run.
    let markup = "<img src=x onerror=\"document.title='ran'\"><b>bold</b>";
    cell(&s, &id, &format!("print({markup:?})"));
    let failed = cell(&s, &id, "1 / 0");
    assert_eq!(failed["status"], "error", "{failed}");
    cell(&s, &id, "import sys; sys.exit(3)");
    let put = call(
        &s,
        "PUT",
        &format!("/v1/sessions/{id}/files/notes.txt"),
        None,
        None,
    );
    assert_eq!(put.status(), 204);
    let (status, forked) = json_call(
        &s,
        "POST",
        &format!("/v1/sessions/{id}/fork"),
        Some(json!({"count": 1})),
    );
    assert_eq!(status, 201, "{forked}");
    let child = forked["ids"][0].as_str().unwrap().to_owned();
    let (status, _) = json_call(&s, "DELETE", &format!("/v1/sessions/{id}"), None);
    assert_eq!(status, 204);

    // Served as a page that runs no script but its own.
    let r = call(&s, "GET", &format!("/v1/sessions/{id}/review"), None, None);
    assert_eq!(r.status(), 200);
    assert_eq!(r.header("content-type"), Some("text/html; charset=utf-8"));
    let csp = r.header("content-security-policy").unwrap_or("").to_owned();
    assert!(csp.starts_with("default-src 'none';"), "{csp}");
    assert!(csp.contains("script-src 'sha256-"), "{csp}");
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    let served = r.into_string().unwrap();

    // As chromium laid it out.
    let url = format!("{}/v1/sessions/{id}/review", s.base);
    let dom = browse(&dir, &url, &["--dump-dom"]);
    assert!(
        rendered_ms(&dom).is_some(),
        "the page's own script did not run: {dom}"
    );
    assert!(
        dom.contains(&format!("<title>Review of {id}</title>")),
        "{dom}"
    );
    assert!(
        !dom.contains("<img"),
        "a printed tag became an element: {dom}"
    );
    assert!(!dom.contains("<b>bold</b>"), "{dom}");
    assert!(dom.contains("&lt;b&gt;bold&lt;/b&gt;"), "{dom}");
    assert!(dom.contains("ZeroDivisionError"), "{dom}");
    assert!(dom.contains(" · exit 3"), "{dom}");
    assert!(dom.contains("3 cells (2 not ok)"), "{dom}");
    assert!(dom.contains("<code>notes.txt</code>"), "{dom}");
    assert!(
        dom.contains(&format!("href=\"../{child}/review\"")),
        "{dom}"
    );
    assert!(dom.contains("sealed, signature verified"), "{dom}");
    let child_page = call(
        &s,
        "GET",
        &format!("/v1/sessions/{child}/review"),
        None,
        None,
    )
    .into_string()
    .unwrap();
    assert!(
        child_page.contains(&format!("href=\"../{id}/review\"")),
        "{child_page}"
    );

    // A phone's and a wide screen's size.
    for (name, size) in [("phone", "390,844"), ("wide", "1440,900")] {
        let png = dir.join(format!("review-{name}.png"));
        browse(
            &dir,
            &url,
            &[
                &format!("--screenshot={}", png.display()),
                &format!("--window-size={size}"),
                "--hide-scrollbars",
            ],
        );
        let bytes = std::fs::read(&png).expect("a screenshot");
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{name}");
        let (w, h) = (
            u32::from_be_bytes(bytes[16..20].try_into().unwrap()),
            u32::from_be_bytes(bytes[20..24].try_into().unwrap()),
        );
        let (want_w, want_h) = size.split_once(',').unwrap();
        assert_eq!(
            (w.to_string(), h.to_string()),
            (want_w.into(), want_h.into())
        );
        eprintln!("[review] screenshot {}", png.display());
    }
    drop(s);

    // The same state directory behind API keys: the page as the rest of the API.
    let keys = dir.join("api-keys");
    let key = "review-test-key-0123456789";
    std::fs::write(&keys, format!("reviewer {key}\n")).unwrap();
    let mut s = serve(&[
        "--state-dir",
        &state_dir,
        "--api-keys-file",
        &keys.to_string_lossy(),
    ]);
    s.wait_ready();
    let path = format!("/v1/sessions/{id}/review");
    assert_eq!(call(&s, "GET", &path, None, None).status(), 401);
    assert_eq!(
        call(&s, "GET", &path, Some("not-the-key-0123456789"), None).status(),
        401
    );
    let r = call(&s, "GET", &path, Some(key), None);
    assert_eq!(r.status(), 200);
    assert_eq!(r.into_string().unwrap(), served);
    let packet = call(
        &s,
        "GET",
        &format!("/v1/sessions/{id}/trace.tar.gz"),
        Some(key),
        None,
    );
    assert_eq!(packet.status(), 200);
    assert_eq!(packet.header("content-type"), Some("application/gzip"));
    let otlp = call(
        &s,
        "GET",
        &format!("/v1/sessions/{id}/trace/otlp"),
        Some(key),
        None,
    );
    assert_eq!(otlp.status(), 200);
    let spans: Value = otlp.into_json().unwrap();
    let cells = spans["resourceSpans"][0]["scopeSpans"][0]["spans"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"] == "cell python")
        .count();
    assert_eq!(cells, 3, "{spans}");
}
