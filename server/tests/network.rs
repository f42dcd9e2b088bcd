//! A sandbox's network through the HTTP API, on the real VMM and guest (issue 39): a server
//! whose python template has a network card, a policy per session and per job, the record
//! of every name resolved and connection opened (`GET /v1/sessions/{id}/network`, a job's
//! `network`), a policy replaced while the session lives (`PUT`), and a sandbox given no
//! policy that reaches nothing; each attempt in the audit log and the metrics, a connection
//! with the bytes it moved; HTTPS verified against the image's CA bundle and a test CA, and
//! `pip install` from a package index. The only hosts reached are the test's own servers on
//! 127.0.0.1 (an echo server, an index, `openssl s_server`), named `echo.test`, `pypi.test`
//! and `tls.test` in the server's `--egress-hosts` file and opened with
//! `--egress-allow-private 127.0.0.1` (loopback is never dialed otherwise). Needs /dev/kvm,
//! and Debian's `openssl` (installed with apt-get when missing, as root).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

use bud_server::core::config::EgressDefault;
use bud_server::core::egress::Private;
use common::{TestServer, client, session, test_config};
use serde_json::{Value, json};

/// An echo server on 127.0.0.1 (a thread per connection, until the peer closes).
fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// A server whose python template has a network card, `echo.test` pinned to 127.0.0.1.
fn networked_server() -> TestServer {
    networked_server_with(|_| {})
}

/// The same, its configuration changed by `change` first.
fn networked_server_with(change: impl FnOnce(&mut bud_server::Config)) -> TestServer {
    // A folder of each server's own: the tests of this binary run at once.
    static SERVERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = SERVERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = common::empty_dir("network", &format!("hosts-{n}"));
    let hosts = dir.join("hosts");
    std::fs::write(
        &hosts,
        "echo.test 127.0.0.1\npypi.test 127.0.0.1\ntls.test 127.0.0.1\napi.test 127.0.0.1\n\
         plain.test 127.0.0.1\n",
    )
    .unwrap();
    let mut opts = common::template_options("python");
    opts.network = true;
    let template = bud_templates::template(&opts, &mut |_| {}, None)
        .expect("building the python template with a network card");
    let executor = Arc::new(
        vmm::Executor::new(template, vmm::ExecutorOptions::default()).expect("its executor"),
    );
    let mut config = test_config();
    config.egress_hosts = Some(hosts);
    config.egress_allow_private = Private::parse("127.0.0.1").unwrap();
    change(&mut config);
    TestServer::with_executors(config, &[("python", executor)])
}

/// Python that connects to `host:port`, sends a line and prints what came back, or prints
/// the exception's class (a refused name or connection is an answer, not a hang: the
/// socket's timeout is far past the few seconds such an answer takes here).
fn echo_code(host: &str, port: u16) -> String {
    format!(
        "import socket\n\
         try:\n    \
             s = socket.create_connection(({host:?}, {port}), timeout=40)\n    \
             s.sendall(b'through bud')\n    \
             print(s.recv(100).decode())\n    \
             s.close()\n\
         except Exception as e:\n    \
             print(type(e).__name__)\n"
    )
}

fn cell(s: &TestServer, id: &str, code: &str) -> String {
    let (status, r) = s.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({"code": code, "timeout_ms": 60_000}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["status"], "ok", "{r}");
    r["stdout"].as_str().unwrap().to_owned()
}

fn network_of(s: &TestServer, id: &str) -> Value {
    let r = s.get(&format!("/v1/sessions/{id}/network"));
    assert_eq!(r.status().as_u16(), 200);
    r.json().unwrap()
}

/// (kind, name, allowed, reason) of each attempt, a repeat of the one before left out: the
/// guest's resolver asks for a name's A and AAAA records at once, two DNS attempts alike.
fn attempts(view: &Value) -> Vec<(String, String, bool, String)> {
    let mut all: Vec<_> = view["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["kind"].as_str().unwrap().to_owned(),
                a["name"].as_str().unwrap_or("").to_owned(),
                a["allowed"].as_bool().unwrap(),
                a["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    all.dedup();
    all
}

fn a(kind: &str, name: &str, allowed: bool, reason: &str) -> (String, String, bool, String) {
    (kind.into(), name.into(), allowed, reason.into())
}

#[test]
fn a_sessions_policy_is_enforced_recorded_and_replaced_live() {
    let echo = echo_server();
    let audit_log = common::empty_dir("network", "audit").join("audit.jsonl");
    let s = networked_server_with(|c| {
        c.audit = Some(bud_server::core::audit::AuditConfig {
            path: audit_log.clone(),
            content: false,
            required: false,
        });
    });
    let policy = json!({"allow_out": ["echo.test"], "deny_out": ["0.0.0.0/0"]});
    let id = session(&s, json!({"network": policy}));

    let reached = cell(&s, &id, &echo_code("echo.test", echo.port()));
    let other = cell(&s, &id, &echo_code("other.test", echo.port()));
    // An address, not a name (TEST-NET-1: nothing is there, and nothing is dialed).
    let by_address = cell(&s, &id, &echo_code("192.0.2.1", echo.port()));
    let view = network_of(&s, &id);

    assert_eq!(reached, "through bud\n");
    assert_eq!(other, "gaierror\n", "a name no entry allows: NXDOMAIN");
    assert_eq!(
        by_address, "ConnectionRefusedError\n",
        "denied by 0.0.0.0/0"
    );
    assert_eq!(view["card"], true);
    assert_eq!(view["policy"], policy);
    assert_eq!(view["reaches"], "\"echo.test\"; nothing else");
    assert_eq!(
        attempts(&view),
        [
            a("dns", "echo.test", true, "allowed"),
            a("connect", "echo.test", true, "allowed"),
            a("dns", "other.test", false, "nxdomain"),
            a("connect", "", false, "denied"),
        ]
    );
    let dialed: Vec<&Value> = view["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["kind"] == "connect" && a["allowed"] == true)
        .collect();
    assert_eq!(dialed.len(), 1);
    assert_eq!(dialed[0]["dialed"], format!("127.0.0.1:{}", echo.port()));

    // Replaced while the session lives: the name the guest resolved before (its address
    // still in the guest's hands) is refused from now on.
    let put = client()
        .put(s.url(&format!("/v1/sessions/{id}/network")))
        .json(&json!({"deny_out": ["0.0.0.0/0"]}))
        .send()
        .unwrap();
    assert_eq!(put.status().as_u16(), 200);
    let shown: Value = put.json().unwrap();
    assert_eq!(
        shown["reaches"],
        "nothing: no name resolves, no connection opens"
    );
    let code = format!(
        "import socket\n\
         addr = {:?}\n\
         try:\n    \
             socket.create_connection((addr, {}), timeout=40)\n    \
             print('connected')\n\
         except Exception as e:\n    \
             print(type(e).__name__)\n",
        dialed[0]["addr"].as_str().unwrap(),
        echo.port()
    );
    let after = cell(&s, &id, &code);
    let last = attempts(&network_of(&s, &id)).pop().unwrap();

    assert_eq!(after, "ConnectionRefusedError\n");
    assert_eq!(last, a("connect", "echo.test", false, "denied"));

    // The session's end closes what is still open: every attempt is in the audit log by
    // then (a refused one at once, the connection at its end with its bytes: 11 each way).
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
    let records = audited_connects(&audit_log, 3);
    // In the order they were decided, but the allowed one's record waits for its close,
    // which may come before the next cell or at the session's end.
    let mut seen: Vec<_> = records
        .iter()
        .map(|r| {
            let n = &r["network"];
            (
                r["status"].as_str().unwrap(),
                n["name"].as_str().unwrap_or(""),
                n["reason"].as_str().unwrap(),
                n["bytes_sent"].as_u64(),
                n["bytes_received"].as_u64(),
            )
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        [
            ("error", "", "denied", None, None),
            ("error", "echo.test", "denied", None, None),
            ("ok", "echo.test", "allowed", Some(11), Some(11)),
        ]
    );
    assert!(
        records
            .iter()
            .all(|r| r["session"] == id.as_str() && r["route"] == "network"),
        "{records:?}"
    );
    let metrics = s.get("/metrics").text().unwrap();
    for series in [
        "bud_egress_attempts_total{kind=\"connect\",result=\"allowed\"} 1\n",
        "bud_egress_attempts_total{kind=\"connect\",result=\"refused\"} 2\n",
        "bud_egress_bytes_total{direction=\"sent\"} 11\n",
        "bud_egress_bytes_total{direction=\"received\"} 11\n",
    ] {
        assert!(metrics.contains(series), "{series} in {metrics}");
    }
}

/// The `connect` records of the audit log at `path`, once it holds `n` of them (the writer
/// is a thread of its own; waits at most 60 s).
fn audited_connects(path: &std::path::Path, n: usize) -> Vec<Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let records: Vec<Value> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|r: &Value| r["kind"] == "connect")
            .collect();
        if records.len() >= n || std::time::Instant::now() > deadline {
            assert_eq!(records.len(), n, "{records:?}");
            return records;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn a_sandbox_given_no_policy_reaches_nothing_and_a_job_carries_its_own() {
    let echo = echo_server();
    let s = networked_server();
    let id = session(&s, json!({}));

    let closed = cell(&s, &id, &echo_code("echo.test", echo.port()));
    let view = network_of(&s, &id);
    // An allow-list alone (bud's API): that destination and nothing else, where E2B's rule
    // would leave `pypi.test` (pinned, and at the same address and port) open.
    let (status, job) = s.exec(json!({
        "code": echo_code("echo.test", echo.port()) + &echo_code("pypi.test", echo.port()),
        "timeout_ms": 60_000,
        "network": {"allow_out": ["echo.test:{}".replace("{}", &echo.port().to_string())]},
    }));
    let (bad_status, bad) = s.exec(json!({"code": "1", "network": {"deny_out": ["evil.test"]}}));

    assert_eq!(closed, "gaierror\n");
    assert_eq!(view["policy"], Value::Null);
    assert_eq!(
        view["reaches"],
        "no route out: no name resolves, no connection opens"
    );
    assert_eq!(attempts(&view), [a("dns", "echo.test", false, "no-policy")]);
    assert_eq!(status, 200, "{job}");
    assert_eq!(job["stdout"], "through bud\ngaierror\n", "{job}");
    assert_eq!(
        attempts(&job["network"]),
        [
            a("dns", "echo.test", true, "allowed"),
            a("connect", "echo.test", true, "allowed"),
            a("dns", "pypi.test", false, "nxdomain"),
        ]
    );
    assert_eq!(bad_status, 400, "{bad}");
    assert_eq!(bad["error"]["field"], "network", "{bad}");
}

#[test]
fn e2bs_sdk_sets_lists_updates_and_cuts_off_a_sandboxs_network() {
    let echo = echo_server();
    let s = networked_server();
    let port = echo.port().to_string();
    let seen = common::clients::client_script(
        "e2b_network.py",
        &[&port],
        &common::clients::e2b_env(&s, "e2b_any"),
    );

    assert_eq!(seen["allowed"], "through bud\n", "{seen}");
    assert_eq!(seen["unlisted"], "gaierror\n");
    assert_eq!(
        seen["info"],
        json!({"allow_out": ["echo.test"], "deny_out": ["0.0.0.0/0"]})
    );
    assert_eq!(
        seen["after_update"], "gaierror\n",
        "echo.test no longer listed"
    );
    assert_eq!(seen["no_internet"], "gaierror\n");
    // A 400 at create is what E2B's SDK raises as its SandboxException, with bud's message.
    assert_eq!(seen["rules"], "X-Key: from-e2b\n", "{seen}");
}

#[test]
fn a_policy_survives_pause_resume_and_snapshots_and_never_widens_to_the_default() {
    let echo = echo_server();
    let dir = common::empty_dir("network", "state");
    let s = networked_server_with(|c| {
        c.state_dir = Some(dir.clone());
        c.egress_default = EgressDefault::All;
    });
    // The server's default would reach the echo server; this policy does not.
    let policy = json!({"allow_out": ["other.test"], "deny_out": ["0.0.0.0/0"]});
    let id = session(&s, json!({"network": policy}));
    let open = session(&s, json!({}));

    let (paused, p) = s.post(&format!("/v1/sessions/{id}/pause"), &json!({}));
    assert_eq!(paused, 200, "{p}");
    let (resumed, r) = s.post(&format!("/v1/sessions/{id}/resume"), &json!({}));
    assert_eq!(resumed, 200, "{r}");
    let after_resume = network_of(&s, &id);
    let resumed_reach = cell(&s, &id, &echo_code("echo.test", echo.port()));
    let (status, snap) = s.post(&format!("/v1/sessions/{id}/snapshots"), &json!({}));
    assert_eq!(status, 201, "{snap}");
    let from_snap = session(&s, json!({"snapshot": snap["id"]}));
    let snap_reach = cell(&s, &from_snap, &echo_code("echo.test", echo.port()));
    let open_reach = cell(&s, &open, &echo_code("echo.test", echo.port()));

    assert_eq!(after_resume["policy"], policy);
    assert_eq!(resumed_reach, "gaierror\n");
    assert_eq!(network_of(&s, &from_snap)["policy"], policy);
    assert_eq!(snap_reach, "gaierror\n");
    assert_eq!(
        open_reach, "through bud\n",
        "the default the others never got"
    );
    assert_eq!(
        network_of(&s, &open)["policy"],
        json!({"allow_out": [], "deny_out": []})
    );
}

#[test]
fn a_guest_flooding_connections_and_lookups_meets_the_limits_and_harms_no_one() {
    let echo = echo_server();
    let s = networked_server_with(|c| c.egress_max_bytes = Some(1 << 20));
    let policy = json!({"allow_out": ["echo.test"], "deny_out": ["0.0.0.0/0"]});
    let id = session(&s, json!({"network": policy}));
    let other = session(&s, json!({"network": policy}));

    // 80 connections opened at once (a sandbox may have 64), then 300 DNS queries sent
    // without waiting for answers (16 may wait for the policy at once; the rest are
    // dropped, as a lossy network would).
    let flood = format!(
        "import select, socket, errno\n\
         addr = socket.gethostbyname('echo.test')\n\
         socks = []\n\
         for i in range(80):\n    \
             s = socket.socket(); s.setblocking(False)\n    \
             s.connect_ex((addr, {port})); socks.append(s)\n\
         pending, up, refused = list(socks), 0, 0\n\
         while pending:\n    \
             _, w, _ = select.select([], pending, [], 40)\n    \
             if not w: break\n    \
             for s in w:\n        \
                 pending.remove(s)\n        \
                 err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)\n        \
                 if err == 0: up += 1\n        \
                 elif err == errno.ECONNREFUSED: refused += 1\n\
         u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         q = b'\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x04echo\\x04test\\x00\\x00\\x01\\x00\\x01'\n\
         for i in range(300):\n    \
             u.sendto(q, ('10.0.2.2', 53))\n\
         print(up, refused, len(pending))\n",
        port = echo.port()
    );
    let flooded = cell(&s, &id, &flood);
    let beside = cell(&s, &other, &echo_code("echo.test", echo.port()));
    let after = cell(
        &s,
        &id,
        "import socket\nfor s in list(globals().get('socks', [])): s.close()\n\
         print(socket.gethostbyname('echo.test'))",
    );
    let limited = network_of(&s, &id)["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["reason"] == "limit")
        .count();

    assert_eq!(
        flooded, "64 16 0\n",
        "64 connected, the rest refused at once"
    );
    assert_eq!(limited, 16, "each refusal past the limit is recorded");
    assert_eq!(beside, "through bud\n", "another sandbox is unharmed");
    assert_eq!(after, "198.18.0.1\n", "the flooded sandbox still resolves");
    assert_eq!(s.get("/v1/health").status().as_u16(), 200);

    // The other sandbox pushes 2 MiB through the echo server past its 1 MiB cap
    // (--egress-max-bytes, both ways together): reset on the way, then refused.
    let push = format!(
        r#"import socket
s = socket.create_connection(('echo.test', {port}), timeout=40)
sent = got = 0
block = b'x' * 65536
try:
    while sent < (2 << 20):
        s.sendall(block); sent += len(block)
        while got < sent - (256 << 10):
            b = s.recv(65536)
            if not b: raise EOFError
            got += len(b)
    print('moved all')
except (ConnectionResetError, BrokenPipeError) as e:
    print('reset', got < (1 << 20))
try:
    socket.create_connection(('echo.test', {port}), timeout=40)
    print('connected')
except Exception as e:
    print(type(e).__name__)
"#,
        port = echo.port()
    );
    let capped = cell(&s, &other, &push);
    let last = attempts(&network_of(&s, &other)).pop().unwrap();

    assert_eq!(capped, "reset True\nConnectionRefusedError\n");
    assert_eq!(last, a("connect", "echo.test", false, "bytes"));
}

/// A wheel of one pure-Python package `budtiny` (version 1.0) whose `GREETING` is `greeting`,
/// its RECORD hashed as pip expects.
fn tiny_wheel(greeting: &str) -> Vec<u8> {
    use base64::Engine as _;
    use sha2::Digest as _;
    let info = "budtiny-1.0.dist-info";
    let mut files: Vec<(String, Vec<u8>)> = vec![
        (
            "budtiny/__init__.py".into(),
            format!("GREETING = {greeting:?}\n").into_bytes(),
        ),
        (
            format!("{info}/METADATA"),
            b"Metadata-Version: 2.1\nName: budtiny\nVersion: 1.0\n".to_vec(),
        ),
        (
            format!("{info}/WHEEL"),
            b"Wheel-Version: 1.0\nGenerator: bud-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
                .to_vec(),
        ),
    ];
    let mut record = String::new();
    for (name, data) in &files {
        let hash =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sha2::Sha256::digest(data));
        record.push_str(&format!("{name},sha256={hash},{}\n", data.len()));
    }
    record.push_str(&format!("{info}/RECORD,,\n"));
    files.push((format!("{info}/RECORD"), record.into_bytes()));
    let entries: Vec<bud_guest::zip::ZipEntry> = files
        .into_iter()
        .map(|(name, data)| bud_guest::zip::ZipEntry { name, data })
        .collect();
    let mut out = Vec::new();
    bud_guest::zip::write(&mut out, &entries).unwrap();
    out
}

/// A package index on 127.0.0.1 (PEP 503's simple API) serving `budtiny` only; every
/// request it answered, in order.
fn package_index() -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let wheel = tiny_wheel("hello from a wheel");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                head.push(byte[0]);
            }
            let head = String::from_utf8_lossy(&head);
            let path = head.split(' ').nth(1).unwrap_or("").to_owned();
            log.lock().unwrap().push(path.clone());
            let name = "budtiny-1.0-py3-none-any.whl";
            let (status, kind, body) = match path.as_str() {
                "/simple/budtiny/" => (
                    "200 OK",
                    "text/html",
                    format!("<a href=\"/packages/{name}\">{name}</a>\n").into_bytes(),
                ),
                p if p == format!("/packages/{name}") => {
                    ("200 OK", "application/octet-stream", wheel.clone())
                }
                _ => ("404 Not Found", "text/plain", b"not here\n".to_vec()),
            };
            let _ = conn.write_all(
                format!(
                    "HTTP/1.0 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n",
                    body.len()
                )
                .as_bytes(),
            );
            let _ = conn.write_all(&body);
        }
    });
    (addr, seen)
}

/// Runs `openssl` with `args` in `dir`; panics with its output if it fails.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new(openssl_program())
        .current_dir(dir)
        .args(args)
        .output()
        .expect("running openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Debian's `openssl`, installed with apt-get when missing (as root; fails loudly else).
fn openssl_program() -> std::path::PathBuf {
    if let Some(p) = bud_guest::host::find_program("openssl") {
        return p;
    }
    bud_guest::host::Apt::new()
        .install(&["openssl"], &mut |l| eprintln!("[apt] {l}"))
        .expect("installing Debian's openssl");
    bud_guest::host::find_program("openssl").expect("openssl installed but not on PATH")
}

/// `openssl s_server -www` on 127.0.0.1 with a certificate for `tls.test` issued by a test
/// CA made here; its port and the CA's certificate (PEM). Killed when the guard drops.
struct TlsServer {
    child: std::process::Child,
    port: u16,
    ca_pem: String,
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tls_server() -> TlsServer {
    let dir = common::empty_dir("network", "tls");
    // A P-256 key and a request for `subject` (with `-x509`, a self-signed certificate).
    let key_and = |key: &str, out: &str, subject: &str, x509: bool| {
        let mut args = vec!["req"];
        if x509 {
            args.extend(["-x509", "-days", "2"]);
        }
        args.extend([
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ]);
        args.extend(["-keyout", key, "-out", out, "-subj", subject]);
        openssl(&dir, &args);
    };
    key_and("ca.key", "ca.pem", "/CN=bud test CA", true);
    key_and("leaf.key", "leaf.csr", "/CN=tls.test", false);
    std::fs::write(dir.join("leaf.ext"), "subjectAltName=DNS:tls.test\n").unwrap();
    openssl(
        &dir,
        &[
            "x509",
            "-req",
            "-in",
            "leaf.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "leaf.pem",
            "-days",
            "2",
            "-extfile",
            "leaf.ext",
        ],
    );
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = std::process::Command::new(openssl_program())
        .current_dir(&dir)
        .args([
            "s_server", "-quiet", "-www", "-cert", "leaf.pem", "-key", "leaf.key",
        ])
        .args(["-accept", &format!("127.0.0.1:{port}")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting openssl s_server");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "s_server never listened"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    TlsServer {
        child,
        port,
        ca_pem: std::fs::read_to_string(dir.join("ca.pem")).unwrap(),
    }
}

#[test]
fn https_is_verified_against_the_images_ca_bundle_and_pip_installs_from_an_index() {
    let tls = tls_server();
    let (index, requests) = package_index();
    let s = networked_server_with(|c| c.limits.max_timeout_ms = 300_000);
    let id = session(
        &s,
        json!({"network": {"allow_out": ["tls.test", "pypi.test"], "deny_out": ["0.0.0.0/0"]}}),
    );

    // The image's CA bundle is what Python's ssl trusts by default (Mozilla's roots, so not
    // the test CA); the test CA given to a context of its own verifies tls.test.
    let https = format!(
        "import ssl, urllib.error, urllib.request\n\
         url = 'https://tls.test:{}/'\n\
         system = ssl.create_default_context()\n\
         print(system.cert_store_stats()['x509_ca'] > 100)\n\
         ca = ssl.create_default_context(cadata={:?})\n\
         print('s_server' in urllib.request.urlopen(url, context=ca, timeout=50).read().decode())\n\
         try:\n    \
             urllib.request.urlopen(url, context=system, timeout=50)\n    \
             print('trusted')\n\
         except urllib.error.URLError as e:\n    \
             print(type(e.reason).__name__)\n",
        tls.port, tls.ca_pem
    );
    let verified = cell(&s, &id, &https);
    assert_eq!(verified, "True\nTrue\nSSLCertVerificationError\n");

    // pip, from a shell in the session; what it installs is importable by the next cell.
    let (status, r) = s.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({
            "language": "shell",
            "code": format!(
                "pip install --no-cache-dir --disable-pip-version-check --trusted-host pypi.test \
                 --index-url http://pypi.test:{}/simple/ budtiny", index.port()),
            "timeout_ms": 300_000,
        }),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        (r["status"].as_str(), r["exit_code"].as_i64()),
        (Some("ok"), Some(0)),
        "{r}"
    );
    assert!(
        r["stdout"]
            .as_str()
            .unwrap()
            .contains("Successfully installed budtiny-1.0"),
        "{r}"
    );
    assert_eq!(
        cell(&s, &id, "import budtiny\nprint(budtiny.GREETING)"),
        "hello from a wheel\n"
    );
    assert_eq!(
        *requests.lock().unwrap(),
        ["/simple/budtiny/", "/packages/budtiny-1.0-py3-none-any.whl"]
    );
}

/// A connection allowed for one name that then names another host in its bytes is reset
/// and recorded (`host-mismatch`), over HTTP (`Host`) and TLS (SNI): `echo.test` and
/// `pypi.test` share an address here, as names behind one front do. Bytes that name the
/// allowed host go through.
#[test]
fn a_connection_naming_another_host_than_it_was_allowed_for_is_reset() {
    let echo = echo_server();
    let s = networked_server();
    let id = session(
        &s,
        json!({"network": {"allow_out": ["echo.test", "pypi.test"]}}),
    );
    let code = format!(
        "import socket, ssl\n\
         def http(host):\n    \
             s = socket.create_connection(('echo.test', {port}), timeout=40)\n    \
             s.sendall(b'GET / HTTP/1.1\\r\\nHost: ' + host.encode() + b':{port}\\r\\n\\r\\n')\n    \
             try:\n        \
                 got = s.recv(100)\n        \
                 print(host, 'echoed' if got.startswith(b'GET / HTTP/1.1') else got)\n    \
             except OSError as e:\n        \
                 print(host, type(e).__name__)\n    \
             s.close()\n\
         def tls(name):\n    \
             s = socket.create_connection(('echo.test', {port}), timeout=40)\n    \
             try:\n        \
                 ssl.create_default_context().wrap_socket(s, server_hostname=name)\n        \
                 print(name, 'handshake')\n    \
             except ssl.SSLError as e:\n        \
                 print(name, 'SSLError')\n    \
             except OSError as e:\n        \
                 print(name, type(e).__name__)\n\
         http('echo.test'); http('pypi.test'); tls('echo.test'); tls('pypi.test')\n",
        port = echo.port()
    );

    let out = cell(&s, &id, &code);
    let view = network_of(&s, &id);

    // The echo server sends the request back; the TLS client then meets its own hello
    // where a server's should be.
    assert_eq!(
        out,
        "echo.test echoed\npypi.test ConnectionResetError\n\
         echo.test SSLError\npypi.test ConnectionResetError\n"
    );
    let refused: Vec<(String, String, String)> = view["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["allowed"] == false)
        .map(|a| {
            (
                a["name"].as_str().unwrap().to_owned(),
                a["reason"].as_str().unwrap().to_owned(),
                a["detail"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let mismatch = (
        "echo.test".to_owned(),
        "host-mismatch".to_owned(),
        "pypi.test".to_owned(),
    );
    assert_eq!(refused, [mismatch.clone(), mismatch], "{view}");
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
}

/// An HTTP server on 127.0.0.1 that keeps each request's head (they never go back: it
/// answers `ok` to each, on a kept-alive connection).
fn head_keeping_server() -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    head_keeping_server_with(None)
}

/// A stream the head-keeping server reads and answers: TCP, or TLS over it.
trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

/// As [`head_keeping_server`], over TLS with `tls` if given.
fn head_keeping_server_with(
    tls: Option<Arc<rustls::ServerConfig>>,
) -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = heads.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let kept = kept.clone();
            let mut conn: Box<dyn Stream> = match &tls {
                None => Box::new(conn),
                Some(config) => Box::new(rustls::StreamOwned::new(
                    rustls::ServerConnection::new(config.clone()).unwrap(),
                    conn,
                )),
            };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while let Ok(n) = conn.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        kept.lock()
                            .unwrap()
                            .push(String::from_utf8_lossy(&head).into_owned());
                        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
                        let _ = conn.flush();
                    }
                }
            });
        }
    });
    (addr, heads)
}

/// A test CA (its certificate, PEM) and a server config for `names` with a certificate it
/// signed: an HTTPS upstream that only a client given that CA trusts.
fn upstream_tls(names: &[&str]) -> (String, Arc<rustls::ServerConfig>) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "upstream test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let leaf = rcgen::CertificateParams::new(names)
        .unwrap()
        .signed_by(&key, &ca_cert, &ca_key)
        .unwrap();
    #[allow(deprecated)] // ring's provider: see core/egress/intercept.rs
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
        )
        .unwrap();
    (ca_cert.pem(), Arc::new(config))
}

/// Headers set outside the sandbox (issue 59): a rule for `api.test` whose value names a
/// secret the server holds (`--egress-secrets`) is set on each HTTP request, in place of
/// the guest's own, and on each HTTPS request too: bud terminates the guest's TLS with a
/// certificate of its egress CA (which the image trusts) and opens its own to the upstream
/// (trusted through `--egress-upstream-ca`); a request inside that TLS naming another host
/// is reset. The policy is shown with the value redacted, each connection's record names
/// the rule and the secret; and the secret is nowhere in the sandbox's memory (its paused
/// file, searched whole, holds the guest's own dummy token but not the secret).
#[test]
fn a_rules_headers_are_set_outside_the_sandbox_over_http_and_https_and_its_secret_never_enters_it()
{
    const SECRET: &str = "sk-test-5f1e0c9a-never-in-the-guest";
    let (upstream, heads) = head_keeping_server();
    let (upstream_ca, upstream_tls) = upstream_tls(&["api.test"]);
    let (secure, secure_heads) = head_keeping_server_with(Some(upstream_tls));
    let dir = common::empty_dir("network", "rules");
    let secrets = dir.join("secrets");
    std::fs::write(&secrets, format!("# for the test\nAPI_TOKEN={SECRET}\n")).unwrap();
    let upstream_ca_file = dir.join("upstream-ca.pem");
    std::fs::write(&upstream_ca_file, &upstream_ca).unwrap();
    let state = dir.join("state");
    let ca_dir = bud_guest::egress_ca::dir_of(&common::template_options("python").build.build_dir);
    let s = networked_server_with(|c| {
        c.egress_secrets = Some(secrets.clone());
        c.egress_ca_dir = Some(ca_dir.clone());
        c.egress_upstream_ca = Some(upstream_ca_file.clone());
        c.state_dir = Some(state.clone());
    });
    let network = json!({
        "allow_out": ["api.test"],
        "rules": {"api.test": [{"transform": {"headers": {
            "Authorization": "Bearer {{secret:API_TOKEN}}",
            "X-Team": "blue",
        }}}]},
    });
    let id = session(&s, json!({"network": network}));
    let code = format!(
        "import http.client, ssl\n\
         dummy = {{'Authorization': 'Bearer dummy-guest-token'}}\n\
         c = http.client.HTTPConnection('api.test', {port}, timeout=40)\n\
         for path in ('/a', '/b'):\n    \
             c.request('GET', path, headers=dummy)\n    \
             print(c.getresponse().read().decode())\n\
         c.close()\n\
         ctx = ssl.create_default_context()\n\
         t = http.client.HTTPSConnection('api.test', {tls_port}, timeout=40, context=ctx)\n\
         for path in ('/c', '/d'):\n    \
             t.request('GET', path, headers=dummy)\n    \
             print(t.getresponse().read().decode())\n\
         issuer = dict(x[0] for x in t.sock.getpeercert()['issuer'])\n\
         print(issuer['commonName'].startswith('bud egress CA'))\n\
         t.close()\n\
         t = http.client.HTTPSConnection('api.test', {tls_port}, timeout=40, context=ctx)\n\
         try:\n    \
             t.request('GET', '/e', headers={{'Host': 'other.test'}})\n    \
             print(t.getresponse().status)\n\
         except OSError as e:\n    \
             print(isinstance(e, ConnectionError))\n",
        port = upstream.port(),
        tls_port = secure.port(),
    );

    let out = cell(&s, &id, &code);
    // The HTTPS connection's record gets its count of rewritten requests when it is over.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (view, connects) = loop {
        let view = network_of(&s, &id);
        let connects: Vec<Value> = view["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["kind"] == "connect")
            .cloned()
            .collect();
        let over = connects.len() == 4
            && connects[..2]
                .iter()
                .all(|c| !c["requests_rewritten"].is_null());
        if over || std::time::Instant::now() > deadline {
            break (view, connects);
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };

    assert_eq!(out, "ok\nok\nok\nok\nTrue\nTrue\n");
    let mut heads = heads.lock().unwrap().clone();
    heads.extend(secure_heads.lock().unwrap().iter().cloned());
    assert_eq!(heads.len(), 4, "{heads:?}");
    for (head, path) in heads.iter().zip(["/a", "/b", "/c", "/d"]) {
        assert!(
            head.starts_with(&format!("GET {path} HTTP/1.1\r\n")),
            "{head}"
        );
        assert!(
            head.contains(&format!("\r\nAuthorization: Bearer {SECRET}\r\n"))
                && head.contains("\r\nX-Team: blue\r\n")
                && !head.contains("dummy-guest-token"),
            "{head}"
        );
    }
    assert_eq!(
        view["policy"]["rules"],
        json!({"api.test": [{"transform": {"headers": {
            "Authorization": "<redacted>", "X-Team": "<redacted>"}}}]})
    );
    assert_eq!(connects.len(), 4, "{view}");
    for c in &connects[..2] {
        assert_eq!(
            (&c["headers_from"], &c["secrets"], &c["requests_rewritten"]),
            (&json!("api.test"), &json!(["API_TOKEN"]), &json!(2)),
            "{view}"
        );
    }
    assert_eq!(
        (
            &connects[3]["reason"],
            connects[3]["allowed"].as_bool(),
            &connects[3]["detail"]
        ),
        (&json!("host-mismatch"), Some(false), &json!("other.test")),
        "{view}"
    );
    assert!(!view.to_string().contains(SECRET));

    // The guest's memory, as its paused file holds it.
    let (status, p) = s.post(&format!("/v1/sessions/{id}/pause"), &json!({}));
    assert_eq!(status, 200, "{p}");
    let mut files = vec![state.clone()];
    let (mut dummy, mut secret) = (0, 0);
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let count = |needle: &[u8]| bytes.windows(needle.len()).filter(|w| *w == needle).count();
        dummy += count(b"dummy-guest-token");
        secret += count(SECRET.as_bytes());
    }
    assert!(dummy > 0, "the search finds what the guest did hold");
    assert_eq!(secret, 0, "the secret is nowhere in the sandbox's memory");
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
}

/// What a rule costs a request (issue 59's target: at most 2 ms more at p50), measured and
/// printed, never asserted (`scripts/bench-rules.sh`): one session allowed `api.test`
/// (with a rule setting two headers, one from a secret) and `plain.test` (none), both
/// pinned to the same local upstreams; the guest times, with `time.perf_counter`, the
/// median of N requests each way: HTTP on a kept-alive connection, HTTPS on a kept-alive
/// connection, and HTTPS on a new connection each (its handshake: with a rule, bud's two).
#[test]
#[ignore = "a measurement: scripts/bench-rules.sh"]
fn what_a_rule_costs_a_request() {
    let n: usize = std::env::var("BUD_RULES_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let (upstream, _) = head_keeping_server();
    let (upstream_ca, upstream_tls) = upstream_tls(&["api.test", "plain.test"]);
    let (secure, _) = head_keeping_server_with(Some(upstream_tls));
    let dir = common::empty_dir("network", "rules-cost");
    let secrets = dir.join("secrets");
    std::fs::write(&secrets, "API_TOKEN=sk-measure\n").unwrap();
    let upstream_ca_file = dir.join("upstream-ca.pem");
    std::fs::write(&upstream_ca_file, &upstream_ca).unwrap();
    let ca_dir = bud_guest::egress_ca::dir_of(&common::template_options("python").build.build_dir);
    let s = networked_server_with(|c| {
        c.egress_secrets = Some(secrets.clone());
        c.egress_ca_dir = Some(ca_dir.clone());
        c.egress_upstream_ca = Some(upstream_ca_file.clone());
        c.limits.max_timeout_ms = 600_000;
    });
    let network = json!({
        "allow_out": ["api.test", "plain.test"],
        "rules": {"api.test": [{"transform": {"headers": {
            "Authorization": "Bearer {{secret:API_TOKEN}}", "X-Team": "blue"}}}]},
    });
    let id = session(&s, json!({"network": network}));
    let code = format!(
        "import http.client, ssl, statistics, time\n\
         N = {n}\n\
         bud = ssl.create_default_context()\n\
         upstream = ssl.create_default_context(cadata={upstream_ca:?})\n\
         def ms(f):\n    \
             ts = []\n    \
             for _ in range(N):\n        \
                 t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)\n    \
             return statistics.median(ts) * 1000\n\
         def get(c):\n    \
             c.request('GET', '/x'); c.getresponse().read()\n\
         def fresh(host, ctx):\n    \
             c = http.client.HTTPSConnection(host, {tls}, timeout=60, context=ctx); get(c); c.close()\n\
         rows = []\n\
         for what, plain, ruled in [\n    \
             ('http, kept-alive', http.client.HTTPConnection('plain.test', {port}, timeout=60),\n     \
              http.client.HTTPConnection('api.test', {port}, timeout=60)),\n    \
             ('https, kept-alive', http.client.HTTPSConnection('plain.test', {tls}, timeout=60, context=upstream),\n     \
              http.client.HTTPSConnection('api.test', {tls}, timeout=60, context=bud))]:\n    \
             get(plain); get(ruled)\n    \
             rows.append((what, ms(lambda: get(plain)), ms(lambda: get(ruled))))\n\
         rows.append(('https, new connection', ms(lambda: fresh('plain.test', upstream)), ms(lambda: fresh('api.test', bud))))\n\
         for what, a, b in rows:\n    \
             print(f'{{what}}: without a rule {{a:.2f}} ms, with {{b:.2f}} ms, {{b - a:+.2f}} ms')\n",
        port = upstream.port(),
        tls = secure.port(),
    );
    let (status, r) = s.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({"code": code, "timeout_ms": 600_000}),
    );
    assert_eq!(status, 200, "{r}");
    println!("{n} requests each, medians as the guest times them:");
    print!("{}", r["stdout"].as_str().unwrap_or_default());
    eprint!("{}", r["stderr"].as_str().unwrap_or_default());
    assert_eq!(s.delete(&format!("/v1/sessions/{id}")), 204);
}
