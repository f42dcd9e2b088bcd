//! The jail of the real `bud serve` binary: on by default (seccomp filters once the template
//! is prepared, `/v1/health` says `jailed`), off with `--no-jail`, each saying which in its
//! log; and `bud serve --user nobody`: the binary prepares its template, drops to `nobody`
//! with every thread under seccomp, and still runs jobs, resets and reuses its VMs (the
//! reset reads /proc/self/pagemap, which a uid change would otherwise hand to root), and
//! serves sessions. Servers are stopped by pid. Needs /dev/kvm, a host that allows seccomp
//! filters, and for `--user`: root and a user `nobody`.

mod common;

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::served::{Served, serve};

/// The first log line with `needle` in it. First use may build and boot the template:
/// minutes.
fn wait_for_log(s: &mut Served, needle: &str) -> String {
    let until = Instant::now() + Duration::from_secs(1800);
    loop {
        assert!(Instant::now() < until, "no log line with {needle:?}");
        if let Ok(line) = s.log.recv_timeout(Duration::from_millis(200)) {
            if line.contains(needle) {
                return line;
            }
        } else if let Ok(Some(status)) = s.child.try_wait() {
            panic!("bud serve exited: {status}");
        }
    }
}

fn health(s: &Served) -> Option<Value> {
    ureq::get(&format!("{}/v1/health", s.base))
        .call()
        .ok()?
        .into_json()
        .ok()
}

fn post(s: &Served, path: &str, body: Value) -> Value {
    ureq::post(&format!("{}{path}", s.base))
        .timeout(Duration::from_secs(120))
        .send_json(body)
        .unwrap()
        .into_json()
        .unwrap()
}

fn status_line(pid: u32, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .split_whitespace()
        .skip(1)
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn a_server_jailed_as_nobody_runs_jobs_resets_vms_and_serves_sessions() {
    common::require_kvm();
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "this test drops from root: run it as root");
    let mut s = serve(&["--user", "nobody"]);

    // First use may build and boot the template: minutes.
    let until = Instant::now() + Duration::from_secs(1800);
    while health(&s).is_none_or(|h| h["jailed"] != json!(true)) {
        assert!(Instant::now() < until, "never jailed: {:?}", health(&s));
        if let Ok(Some(status)) = s.child.try_wait() {
            panic!("bud serve exited: {status}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let pid = s.child.id();
    let jobs: Vec<Value> = (0..6)
        .map(|i| post(&s, "/v1/exec", json!({"code": format!("print({i} * 7)")})))
        .collect();
    let session = post(&s, "/v1/sessions", json!({}));
    let id = session["id"].as_str().unwrap().to_owned();
    post(
        &s,
        &format!("/v1/sessions/{id}/exec"),
        json!({"code": "x = 6"}),
    );
    let cell = post(
        &s,
        &format!("/v1/sessions/{id}/exec"),
        json!({"code": "x * 7"}),
    );
    // A pause writes into the state directory, made by root before the drop: it was
    // given to nobody, and the template's pin folder too.
    let paused = post(&s, &format!("/v1/sessions/{id}/pause"), json!({}));
    let resumed = post(
        &s,
        &format!("/v1/sessions/{id}/exec"),
        json!({"code": "x * 6"}),
    );
    let metrics = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();

    assert_eq!(status_line(pid, "Uid:"), "65534 65534 65534 65534");
    assert_eq!(status_line(pid, "Gid:"), "65534 65534 65534 65534");
    assert_eq!(status_line(pid, "Seccomp:"), "2");
    assert_eq!(status_line(pid, "NoNewPrivs:"), "1");
    for (i, r) in jobs.iter().enumerate() {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["stdout"], format!("{}\n", i * 7));
    }
    assert_eq!(cell["status"], "ok", "{cell}");
    assert_eq!(cell["result"]["text/plain"], "42");
    assert_eq!(paused["state"], "paused", "{paused}");
    assert_eq!(resumed["result"]["text/plain"], "36", "{resumed}");

    // Six jobs on two job threads: VMs were reset and reused, none failed to reset.
    let counter = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in metrics"))
    };
    assert!(counter("bud_resets_total ") >= 1, "{metrics}");
    assert_eq!(
        counter("bud_vms_replaced_total{reason=\"reset_failed\"} "),
        0
    );
}

#[test]
fn a_server_started_without_options_is_jailed_once_ready() {
    common::require_kvm();
    let mut s = serve(&[]);

    let line = wait_for_log(&mut s, "jail: ");
    let health = health(&s).unwrap();
    let threads = named_threads(s.child.id(), "bud-timer");
    let job = post(&s, "/v1/exec", json!({"code": "print(6 * 7)"}));

    assert!(line.contains("INFO"), "{line}");
    assert!(line.contains("jail: seccomp filters on"), "{line}");
    assert_eq!(health["jailed"], json!(true), "{health}");
    assert_eq!(status_line(s.child.id(), "Seccomp:"), "2");
    // Made before the jail: the first job's thread may not make it (it did, lazily, and
    // the jail killed the server at its first job after a template loaded from disk).
    assert!(
        threads.iter().any(|t| t == "bud-timer"),
        "no timer thread before the first job: {threads:?}"
    );
    assert_eq!(job["stdout"], "42\n", "{job}");
}

/// The names of process `pid`'s threads once one is named `name`, or after 10 s. A new
/// thread names itself once it first runs (Rust's std), so under load a thread made
/// just before the jail still shows its parent's name for a moment.
fn named_threads(pid: u32, name: &str) -> Vec<String> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let names = thread_names(pid);
        if names.iter().any(|t| t == name) || std::time::Instant::now() > until {
            return names;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The names of process `pid`'s threads.
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_owned())
        .collect()
}

#[test]
fn a_server_started_with_no_jail_says_so_and_is_not_jailed() {
    common::require_kvm();
    let mut s = serve(&["--no-jail"]);

    let line = wait_for_log(&mut s, "jail: ");
    let health = health(&s).unwrap();
    let job = post(&s, "/v1/exec", json!({"code": "print(6 * 7)"}));

    assert!(line.contains("INFO"), "{line}");
    assert!(
        line.contains("jail: seccomp filters off (--no-jail)"),
        "{line}"
    );
    assert_eq!(health["jailed"], json!(false), "{health}");
    assert_eq!(job["stdout"], "42\n", "{job}");
}

/// A server on 127.0.0.1 that reads a connection to its end (the client's half-close),
/// then answers how many bytes came and closes.
fn counting_server() -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut all = Vec::new();
                if conn.read_to_end(&mut all).is_ok() {
                    let _ = conn.write_all(format!("got {}", all.len()).as_bytes());
                }
            });
        }
    });
    addr
}

#[test]
fn a_jailed_server_with_network_cards_dials_relays_and_passes_a_half_close_on() {
    common::require_kvm();
    let peer = counting_server();
    let dir = common::source_dir().join("target/tmp/jail-network");
    std::fs::create_dir_all(&dir).unwrap();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "peer.test 127.0.0.1\n").unwrap();
    let hosts = hosts.to_string_lossy().into_owned();
    let mut s = serve(&[
        "--network",
        "--egress-hosts",
        &hosts,
        "--egress-allow-private",
        "127.0.0.1",
    ]);
    let line = wait_for_log(&mut s, "jail: ");
    assert!(line.contains("jail: seccomp filters on"), "{line}");

    // A session's cell: its VM's relay runs on a job thread, under the job filter; the
    // dial, the lookup of the pinned name and the wake-ups on the process's own threads.
    let session = post(
        &s,
        "/v1/sessions",
        json!({"network": {"allow_out": ["peer.test"], "deny_out": ["0.0.0.0/0"]}}),
    );
    let id = session["id"].as_str().unwrap();
    let code = format!(
        "import socket\n\
         s = socket.create_connection(('peer.test', {}), timeout=40)\n\
         s.sendall(b'x' * 100000)\n\
         s.shutdown(socket.SHUT_WR)\n\
         got = b''\n\
         while True:\n    \
             b = s.recv(65536)\n    \
             if not b:\n        \
                 break\n    \
             got += b\n\
         print(got.decode())\n",
        peer.port()
    );
    let cell = post(
        &s,
        &format!("/v1/sessions/{id}/exec"),
        json!({"code": code, "timeout_ms": 60_000}),
    );

    assert_eq!(cell["stdout"], "got 100000\n", "{cell}");
    assert!(s.child.try_wait().unwrap().is_none(), "the jail killed it");
    assert_eq!(health(&s).unwrap()["jailed"], json!(true));
}
