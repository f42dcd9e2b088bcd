//! The front's configuration run for real: HAProxy on the ConfigMap's `haproxy.cfg`, fake
//! bud nodes on 127.0.0.2 and 127.0.0.3 found through a fake DNS server (as the headless
//! Service's would answer), and requests naming their sandbox in every place they can.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream, UdpSocket};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{TempDir, front_config, require_program};

/// What a fake node answers: its agent's line, and the status of `POST /v1/exec`.
#[derive(Debug)]
struct Behaviour {
    agent: String,
    exec_status: u16,
}

/// A fake bud node on `ip`: HTTP on `port` (every answer says which node it is and what it
/// got), an agent-check port.
struct FakeNode {
    ip: Ipv4Addr,
    behaviour: Arc<Mutex<Behaviour>>,
}

impl FakeNode {
    fn start(ip: Ipv4Addr, http: TcpListener, agent: TcpListener) -> FakeNode {
        let behaviour = Arc::new(Mutex::new(Behaviour {
            agent: "ready up 50%".into(),
            exec_status: 200,
        }));
        let b = behaviour.clone();
        std::thread::spawn(move || {
            for conn in agent.incoming().flatten() {
                let line = format!("{}\n", b.lock().unwrap().agent);
                let _ = (&conn).write_all(line.as_bytes());
            }
        });
        let b = behaviour.clone();
        std::thread::spawn(move || {
            for conn in http.incoming().flatten() {
                let b = b.clone();
                std::thread::spawn(move || serve_fake(ip, conn, &b));
            }
        });
        FakeNode { ip, behaviour }
    }

    fn set(&self, agent: &str, exec_status: u16) {
        let mut b = self.behaviour.lock().unwrap();
        b.agent = agent.into();
        b.exec_status = exec_status;
    }
}

/// One kept-alive connection to a fake node.
fn serve_fake(ip: Ipv4Addr, conn: TcpStream, b: &Mutex<Behaviour>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    while let Some((line, headers, body)) = read_message(&mut reader) {
        let path = line.split(' ').nth(1).unwrap_or("").to_owned();
        let status = match path.as_str() {
            "/v1/exec" => b.lock().unwrap().exec_status,
            _ => 200,
        };
        let out = json!({
            "node": ip.to_string(),
            "request": line,
            "front": headers.get("x-bud-front"),
            "body": String::from_utf8_lossy(&body),
        })
        .to_string();
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            out.len()
        );
        if (&conn)
            .write_all(format!("{head}{out}").as_bytes())
            .is_err()
        {
            return;
        }
    }
}

/// One HTTP/1.1 message: its first line, headers (lowercased names) and body (by
/// content-length); None at the end of the stream.
fn read_message(r: &mut impl BufRead) -> Option<(String, BTreeMap<String, String>, Vec<u8>)> {
    let mut first = String::new();
    if r.read_line(&mut first).ok()? == 0 {
        return None;
    }
    let mut headers = BTreeMap::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (k, v) = line.split_once(':')?;
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
    }
    let len: usize = headers
        .get("content-length")
        .map_or(0, |v| v.parse().unwrap());
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    Some((first.trim_end().to_owned(), headers, body))
}

/// A DNS server answering `name`'s A query with `ips` (as a headless Service's would), an
/// empty answer for its other types and NXDOMAIN for any other name.
fn fake_dns(name: &'static str, ips: Vec<Ipv4Addr>) -> u16 {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = sock.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((n, from)) = sock.recv_from(&mut buf) {
            let q = &buf[..n];
            // The question: labels from byte 12 to a zero byte, then type and class.
            let mut i = 12;
            let mut labels = vec![];
            while i < n && q[i] != 0 {
                let len = q[i] as usize;
                labels.push(String::from_utf8_lossy(&q[i + 1..i + 1 + len]).into_owned());
                i += 1 + len;
            }
            let qtype = u16::from_be_bytes([q[i + 1], q[i + 2]]);
            let question = &q[12..i + 5];
            let found = labels.join(".") == name;
            let answers: Vec<Ipv4Addr> = if found && qtype == 1 {
                ips.clone()
            } else {
                vec![]
            };
            let mut out = vec![q[0], q[1], 0x81, if found { 0x80 } else { 0x83 }, 0, 1];
            out.extend((answers.len() as u16).to_be_bytes());
            out.extend([0, 0, 0, 0]);
            out.extend(question);
            for ip in answers {
                // A pointer to the question's name, type A, class IN, TTL 1 s, 4 bytes.
                out.extend([0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4]);
                out.extend(ip.octets());
            }
            let _ = sock.send_to(&out, from);
        }
    });
    port
}

/// A listener on the same free port of every address in `ips`.
fn same_port_listeners(ips: &[Ipv4Addr]) -> Vec<TcpListener> {
    for _ in 0..50 {
        let first = TcpListener::bind((ips[0], 0)).unwrap();
        let port = first.local_addr().unwrap().port();
        let rest: Result<Vec<_>, _> = ips[1..]
            .iter()
            .map(|ip| TcpListener::bind((*ip, port)))
            .collect();
        if let Ok(mut rest) = rest {
            rest.insert(0, first);
            return rest;
        }
    }
    panic!("no port free on all of {ips:?}");
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The HAProxy process, killed at the end of the test.
struct Haproxy(Child);

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Reply {
    status: u16,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {}", self.status, self.body))
    }
}

fn send(
    stream: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\ncontent-length: {}\r\n",
        body.len()
    );
    if !headers.iter().any(|(k, _)| *k == "host") {
        req.push_str("host: front\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(stream.try_clone().unwrap());
    let (line, _, body) = read_message(&mut r).expect("an answer from the front");
    let status = line.split(' ').nth(1).unwrap().parse().unwrap();
    let body = String::from_utf8_lossy(&body).into_owned();
    Reply { status, body }
}

/// A request to the front on a connection of its own.
fn ask(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    send(&mut s, method, path, headers, body)
}

/// Which fake node answered `path` (a successful request).
fn node_of(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> String {
    let r = ask(port, method, path, headers, body).json();
    assert_eq!(r["front"], "1", "{method} {path}: {r}");
    r["node"].as_str().unwrap().to_owned()
}

/// One command on HAProxy's runtime API.
fn admin(port: u16, command: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(format!("{command}\n").as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Waits until `want` holds of the servers of backend `nodes` (`show servers state` lines
/// of the servers that have an address: name, address, op state, admin state, weight).
fn wait_servers(admin_port: u16, what: &str, want: impl Fn(&[Vec<String>]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let state = admin(admin_port, "show servers state nodes");
        let servers: Vec<Vec<String>> = state
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(' ').map(str::to_owned).collect::<Vec<_>>())
            .filter(|f| f.len() > 7 && f[4] != "-")
            .map(|f| {
                vec![
                    f[3].clone(),
                    f[4].clone(),
                    f[5].clone(),
                    f[6].clone(),
                    f[7].clone(),
                ]
            })
            .collect();
        if want(&servers) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "waited 20 s for {what}; servers: {servers:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_front_routes_by_the_node_in_the_id() {
    let haproxy = require_program("haproxy", "haproxy");
    let dir = TempDir::new("front");
    front_config(&dir.0);
    // The fake nodes live on loopback: let the front connect there.
    std::fs::write(dir.0.join("node-networks.lst"), "127.0.0.0/8\n").unwrap();

    let ips = [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)];
    let mut http = same_port_listeners(&ips);
    let mut agent = same_port_listeners(&ips);
    let node_port = http[0].local_addr().unwrap().port();
    let agent_port = agent[0].local_addr().unwrap().port();
    let nodes: Vec<FakeNode> = ips
        .iter()
        .map(|ip| FakeNode::start(*ip, http.remove(0), agent.remove(0)))
        .collect();
    let dns_port = fake_dns("bud-nodes.test", ips.to_vec());
    let (front, status, admin_port) = (free_port(), free_port(), free_port());
    let log = std::fs::File::create(dir.0.join("haproxy.log")).unwrap();
    let _haproxy = Haproxy(
        Command::new(haproxy)
            .arg("-db")
            .arg("-f")
            .arg(dir.0.join("haproxy.cfg"))
            .env("BUD_HAPROXY_DIR", &dir.0)
            .env("BUD_NODE_PORT", node_port.to_string())
            .env("BUD_AGENT_PORT", agent_port.to_string())
            .env("BUD_NODES_DNS", "bud-nodes.test")
            .env("BUD_NAMESERVER", format!("127.0.0.1:{dns_port}"))
            .env("BUD_FRONT_PORT", front.to_string())
            .env("BUD_STATUS_PORT", status.to_string())
            .env("BUD_ADMIN_PORT", admin_port.to_string())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting haproxy"),
    );
    // Both nodes found through DNS, up (health checks) with the weight their agents give.
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", admin_port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "haproxy did not start: {:?}",
            std::fs::read_to_string(dir.0.join("haproxy.log"))
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_servers(admin_port, "both nodes up at weight 50", |s| {
        s.len() == 2 && s.iter().all(|f| f[2] == "2" && f[4] == "50")
    });
    let r = ask(status, "GET", "/healthz", &[], "");
    assert_eq!((r.status, r.body.as_str()), (200, "ok"));

    // Every place a request names its sandbox.
    let (n2, n3) = ("127.0.0.2", "127.0.0.3");
    let (s2, s3) = ("ses_127-0-0-2_0123abcd", "ses_127-0-0-3_0123abcd");
    for (node, method, path, headers, body) in [
        (n3, "POST", format!("/v1/sessions/{s3}/exec"), vec![], ""),
        (n2, "GET", format!("/v1/sessions/{s2}"), vec![], ""),
        (
            n3,
            "DELETE",
            "/v1/snapshots/snap_127-0-0-3_ff".into(),
            vec![],
            "",
        ),
        (n2, "GET", format!("/sandboxes/{s2}"), vec![], ""),
        (
            n3,
            "POST",
            format!("/v2/sandboxes/{s3}/connect"),
            vec![],
            "",
        ),
        (
            n2,
            "DELETE",
            "/templates/snap_127-0-0-2_ff".into(),
            vec![],
            "",
        ),
        (
            n3,
            "POST",
            "/process.Process/Start".into(),
            vec![("e2b-sandbox-id", s3)],
            "",
        ),
        (
            n2,
            "POST",
            "/execute".into(),
            vec![("host", "49999-ses_127-0-0-2_0123abcd.e2b.test")],
            "",
        ),
        (
            n3,
            "POST",
            "/v1/sessions".into(),
            vec![],
            r#"{"snapshot":"snap_127-0-0-3_ff"}"#,
        ),
        (
            n2,
            "POST",
            "/sandboxes".into(),
            vec![],
            r#"{"templateID":"snap_127-0-0-2_ff"}"#,
        ),
    ] {
        assert_eq!(
            node_of(front, method, &path, &headers, body),
            node,
            "{method} {path} {headers:?} {body}"
        );
    }
    // One client connection, requests for both nodes in turn: each reaches its own.
    let mut s = TcpStream::connect(("127.0.0.1", front)).unwrap();
    for (node, id) in [(n3, s3), (n2, s2), (n3, s3), (n2, s2)] {
        let r = send(&mut s, "GET", &format!("/v1/sessions/{id}"), &[], "").json();
        assert_eq!(r["node"], node, "kept-alive connection, {id}");
    }

    // What is no id goes to any node; the least loaded, so both over a few requests.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..8 {
        seen.insert(node_of(front, "POST", "/v1/exec", &[], "{}"));
    }
    for (path, body) in [
        ("/v1/sessions/import", ""),
        ("/sandboxes", r#"{"templateID":"python"}"#),
    ] {
        seen.insert(node_of(front, "POST", path, &[], body));
    }
    assert_eq!(seen.len(), 2, "one-shot work spread over {seen:?}");

    // A node not in node-networks.lst, or no address at all: no such session here.
    for id in ["ses_8-8-8-8_0123abcd", "ses_n1_0123abcd"] {
        let r = ask(front, "GET", &format!("/v1/sessions/{id}"), &[], "");
        assert_eq!(
            (r.status, &r.json()["error"]["code"]),
            (404, &json!("no_session")),
            "{id}"
        );
    }
    // A node that does not answer: 502 node_down, naming it.
    let r = ask(front, "GET", "/v1/sessions/ses_127-0-0-9_0123abcd", &[], "");
    assert_eq!(r.status, 502, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "node_down");
    assert_eq!(r.json()["error"]["node"], "127-0-0-9");
    // A request that already went through the front: a loop, refused.
    let r = ask(front, "POST", "/v1/exec", &[("x-bud-front", "1")], "");
    assert_eq!(
        (r.status, &r.json()["error"]["code"]),
        (508, &json!("loop"))
    );

    // A session moved by a drain: moved.map, changed through the runtime API, wins.
    let map = dir.0.join("moved.map");
    let out = admin(
        admin_port,
        &format!("add map {} {s3} 127-0-0-2", map.display()),
    );
    assert!(out.trim().is_empty(), "add map: {out}");
    assert_eq!(
        node_of(front, "GET", &format!("/v1/sessions/{s3}"), &[], ""),
        n2
    );

    // A node answering 503 (draining, not ready): one-shot work is tried again elsewhere.
    nodes[0].set("ready up 50%", 503);
    for _ in 0..6 {
        assert_eq!(node_of(front, "POST", "/v1/exec", &[], "{}"), n3);
    }
    // A node whose agent says drain: no one-shot work, but its sandboxes still reach it.
    nodes[0].set("ready up 50%", 200);
    nodes[1].set("drain", 200);
    wait_servers(admin_port, "127.0.0.3 drained", |s| {
        s.iter()
            .any(|f| f[1] == nodes[1].ip.to_string() && f[3] != "0")
    });
    for _ in 0..6 {
        assert_eq!(node_of(front, "POST", "/v1/exec", &[], "{}"), n2);
    }
    let r = ask(front, "GET", "/v1/snapshots/snap_127-0-0-3_ff", &[], "").json();
    assert_eq!(r["node"], n3, "a draining node still serves its sandboxes");
    // And back: `ready` ends the drain.
    nodes[1].set("ready up 50%", 200);
    wait_servers(admin_port, "127.0.0.3 back", |s| {
        s.iter().all(|f| f[3] == "0")
    });
}
