//! The deployment files, checked offline with the real tools (docs/deploy.md):
//! - `deploy/k8s/`: every manifest validated against a named Kubernetes version's JSON
//!   schemas by the pinned PyPI package `kubernetes-validate` (`deploy/k8s/requirements.txt`,
//!   installed into `<repo>/build/deploy-venv` once, under the build lock), strictly (unknown
//!   fields fail) and with no kind left unchecked; the kustomization lists every manifest;
//!   the pieces agree (ports, names, the drain hook, the probes, /dev/kvm);
//! - the front's HAProxy configuration (the ConfigMap's `haproxy.cfg`): `haproxy -c`, then a
//!   real HAProxy run on it against fake nodes on loopback (127.0.0.2 and 127.0.0.3, found
//!   through a fake DNS server as the headless Service's would answer): routing by the node
//!   in the id in every place a request names its sandbox, moved.map, unknown and dead
//!   nodes, agent weights and drain, 503s tried again elsewhere;
//! - `deploy/systemd/`: `systemd-analyze verify` of bud.service and of Debian's
//!   haproxy.service with bud's drop-in, with no warning at all.
//!
//! Debian's `haproxy` and `systemd` (systemd-analyze) are installed with apt-get when
//! missing, as root; a test that needs a tool it cannot get fails saying so, never skips.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The Kubernetes version the manifests are validated against: the oldest release they are
/// meant for (every field used is in it), and the newest the pinned package ships.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn k8s_dir() -> PathBuf {
    repo().join("deploy/k8s")
}

/// A folder of this test's own under the system's temporary folder, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("bud-deploy-{}-{what}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("making a temporary folder");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn output(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

// ---- tools: the venv, haproxy, systemd-analyze ----

/// The venv with the pinned validator (`bud_guest::venv`: made once under the build lock,
/// again when requirements.txt changes); a failure fails every test that needs it.
fn python() -> PathBuf {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match PYTHON.get_or_init(make_venv) {
        Ok(p) => p.clone(),
        Err(e) => panic!("making the deploy venv failed: {e}"),
    }
}

fn make_venv() -> Result<PathBuf, String> {
    let reqs = k8s_dir().join("requirements.txt");
    bud_guest::venv::ensure(&repo().join("build"), "deploy-venv", &reqs, &mut |l| {
        eprintln!("[deploy venv] {l}")
    })
    .map_err(|e| e.to_string())
}

/// `program`, installed from Debian's `package` when missing (as root, under the build
/// lock, as scripts/build-kernel.sh installs its own); panics saying why when it cannot be.
fn require_program(program: &str, package: &str) -> PathBuf {
    let find = || {
        ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(program))
            .find(|p| p.is_file())
    };
    if let Some(p) = find() {
        return p;
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "\n\n*** {program} is missing and only root can install it (apt-get install {package}) ***\n"
    );
    let _lock = bud_guest::BuildLock::acquire(&repo().join("build"), "apt-get", &mut |l| {
        eprintln!("[apt] {l}")
    })
    .expect("taking the build lock");
    if find().is_none() {
        for args in [
            vec!["update", "-q"],
            vec!["install", "-y", "-q", "--no-install-recommends", package],
        ] {
            let (ok, text) = output(
                Command::new("apt-get")
                    .env("DEBIAN_FRONTEND", "noninteractive")
                    .args(["-o", "DPkg::Lock::Timeout=600"])
                    .args(&args)
                    .stdin(Stdio::null()),
            );
            assert!(ok, "apt-get {args:?} failed:\n{text}");
        }
    }
    find().unwrap_or_else(|| panic!("{package} installed but no {program} found"))
}

// ---- the manifests ----

/// Validates (`validate VERSION DIR`: JSON of the kustomization's resources, the YAML files,
/// every document and every error) or extracts a ConfigMap's files (`configmap FILE DIR`).
const PY: &str = r#"
import json, os, sys, yaml
from kubernetes_validate import utils
if sys.argv[1] == "configmap":
    doc = yaml.safe_load(open(sys.argv[2]))
    for name, text in doc["data"].items():
        open(os.path.join(sys.argv[3], name), "w").write(text)
    sys.exit(0)
version, folder = sys.argv[2], sys.argv[3]
kustomization = yaml.safe_load(open(os.path.join(folder, "kustomization.yaml")))
files = sorted(f for f in os.listdir(folder) if f.endswith(".yaml") and f != "kustomization.yaml")
documents, errors = [], []
for f in files:
    for doc in yaml.safe_load_all(open(os.path.join(folder, f))):
        if not doc:
            continue
        documents.append(doc)
        try:
            utils.validate(doc, version, strict=True)
        except Exception as e:
            errors.append("%s %s/%s: %s" % (f, doc.get("kind"), doc.get("metadata", {}).get("name"),
                                           getattr(e, "message", None) or e))
print(json.dumps({"resources": sorted(kustomization.get("resources", [])), "files": files,
                  "documents": documents, "errors": errors}))
"#;

fn validate(version: &str) -> Value {
    let (ok, text) = output(
        Command::new(python())
            .arg("-c")
            .arg(PY)
            .args(["validate", version])
            .arg(k8s_dir()),
    );
    assert!(ok, "the validation script failed:\n{text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("no JSON ({e}):\n{text}"))
}

/// The manifests' documents, by `Kind/name`.
fn manifests() -> BTreeMap<String, Value> {
    let docs = validate(KUBERNETES_VERSIONS[0])["documents"].clone();
    let docs = docs.as_array().expect("documents").clone();
    docs.into_iter()
        .map(|d| {
            let key = format!(
                "{}/{}",
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap()
            );
            (key, d)
        })
        .collect()
}

fn get<'a>(m: &'a BTreeMap<String, Value>, key: &str) -> &'a Value {
    m.get(key)
        .unwrap_or_else(|| panic!("no {key} in deploy/k8s"))
}

/// The ConfigMap's haproxy.cfg, moved.map and node-networks.lst, written into `dir`.
fn front_config(dir: &Path) {
    let (ok, text) = output(
        Command::new(python())
            .arg("-c")
            .arg(PY)
            .arg("configmap")
            .arg(k8s_dir().join("front-config.yaml"))
            .arg(dir),
    );
    assert!(ok, "extracting the ConfigMap failed:\n{text}");
}

#[test]
fn manifests_validate_against_the_kubernetes_schemas() {
    for version in KUBERNETES_VERSIONS {
        let v = validate(version);
        assert_eq!(v["errors"], json!([]), "against Kubernetes {version}");
        assert_eq!(
            v["resources"], v["files"],
            "kustomization.yaml must list every manifest"
        );
    }
    let m = manifests();
    for key in [
        "Namespace/bud",
        "DaemonSet/bud-node",
        "Service/bud-nodes",
        "ConfigMap/bud-front",
        "Deployment/bud-front",
        "Service/bud-front",
        "Deployment/bud-redis",
        "Service/bud-redis",
    ] {
        get(&m, key);
    }
    for (key, doc) in &m {
        if !key.starts_with("Namespace/") {
            assert_eq!(doc["metadata"]["namespace"], "bud", "{key}'s namespace");
        }
    }
}

#[test]
fn the_nodes_are_set_up_as_the_front_and_the_docs_expect() {
    let m = manifests();
    let ds = get(&m, "DaemonSet/bud-node");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    assert_eq!(pod["nodeSelector"]["bud.dev/kvm"], "true");
    assert_eq!(ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"], 0);
    let volumes: BTreeMap<&str, &Value> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    assert_eq!(
        volumes["kvm"]["hostPath"],
        json!({"path": "/dev/kvm", "type": "CharDevice"})
    );
    assert_eq!(volumes["state"]["hostPath"]["path"], "/var/lib/bud/state");
    assert_eq!(volumes["api-keys"]["secret"]["secretName"], "bud-api-keys");

    let c = &pod["containers"][0];
    assert_eq!(
        c["securityContext"]["privileged"], true,
        "/dev/kvm needs it"
    );
    let mounts: BTreeMap<&str, &str> = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap(),
                v["mountPath"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(mounts["kvm"], "/dev/kvm");
    let script = c["args"][0].as_str().unwrap();
    for arg in [
        "tr . -",
        "--node-id \"$BUD_NODE_ID\"",
        "--port 8080",
        "--agent-port 8081",
        "--user bud",
        &format!("--state-dir {}", mounts["state"]),
        &format!(
            "--build-dir {}",
            mounts["templates"].trim_end_matches("/templates")
        ),
        "--pause-on-shutdown",
        "--api-keys-file /etc/bud/keys/api-keys",
        "--redis redis://bud-redis.bud.svc.cluster.local:6379",
        "exec /usr/local/bin/bud serve",
    ] {
        assert!(
            script.contains(arg),
            "the node's start script lacks {arg:?}"
        );
    }
    assert_eq!(mounts["api-keys"], "/etc/bud/keys");
    let pre_stop = c["lifecycle"]["preStop"]["exec"]["command"][2]
        .as_str()
        .unwrap();
    assert!(pre_stop.contains("/v1/admin/drain"), "preStop must drain");
    for (what, script) in [("start script", script), ("preStop", pre_stop)] {
        let (ok, text) = output(Command::new("sh").args(["-n", "-c", script]));
        assert!(ok, "the node's {what} is not valid sh: {text}");
    }
    assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() >= 120);
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe]["httpGet"]["path"], "/v1/health", "{probe}");
    }
    let startup = &c["startupProbe"];
    let budget =
        startup["periodSeconds"].as_u64().unwrap() * startup["failureThreshold"].as_u64().unwrap();
    assert!(
        budget >= 600,
        "a first start boots the template: {budget} s is too short"
    );

    // The front finds the nodes through the headless Service, on the ports above.
    let svc = get(&m, "Service/bud-nodes");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(
        svc["spec"]["selector"],
        ds["spec"]["selector"]["matchLabels"]
    );
    let cfg = get(&m, "ConfigMap/bud-front")["data"]["haproxy.cfg"]
        .as_str()
        .unwrap()
        .to_owned();
    for knob in [
        "${BUD_NODES_DNS-bud-nodes.bud.svc.cluster.local}",
        "${BUD_NODE_PORT-8080}",
        "${BUD_AGENT_PORT-8081}",
    ] {
        assert!(cfg.contains(knob), "haproxy.cfg lacks {knob}");
    }
    let redis = get(&m, "Service/bud-redis");
    assert_eq!(redis["spec"]["ports"][0]["port"], 6379);

    // The front runs that configuration.
    let front = &get(&m, "Deployment/bud-front")["spec"]["template"]["spec"];
    assert_eq!(front["volumes"][0]["configMap"]["name"], "bud-front");
    assert_eq!(
        front["containers"][0]["volumeMounts"][0]["mountPath"],
        "/usr/local/etc/haproxy"
    );
    assert!(cfg.contains("${BUD_FRONT_PORT-8080}"));
    assert_eq!(front["containers"][0]["ports"][0]["containerPort"], 8080);
}

#[test]
fn the_front_config_passes_haproxy_check() {
    let haproxy = require_program("haproxy", "haproxy");
    let dir = TempDir::new("check");
    front_config(&dir.0);
    let (ok, text) = output(
        Command::new(haproxy)
            .arg("-c")
            .arg("-f")
            .arg(dir.0.join("haproxy.cfg"))
            .env("BUD_HAPROXY_DIR", &dir.0),
    );
    assert!(ok && !text.contains("[WARNING]"), "haproxy -c:\n{text}");
    assert!(text.contains("Configuration file is valid"), "{text}");
}

#[test]
fn systemd_units_pass_systemd_analyze_verify() {
    let analyze = require_program("systemd-analyze", "systemd");
    let dir = TempDir::new("units");
    let units = repo().join("deploy/systemd");
    // The programs the units start must exist: point the install paths at a stub and at
    // this checkout's files; everything else is verified as written.
    let stub = dir.0.join("bud");
    std::fs::write(&stub, "#!/bin/sh\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rewrite = |text: String| {
        text.replace("/usr/local/bin/bud", stub.to_str().unwrap())
            .replace(
                "/usr/local/lib/bud/bud-drain",
                units.join("bud-drain").to_str().unwrap(),
            )
            .replace("/opt/bud/deploy/", repo().join("deploy/").to_str().unwrap())
    };
    let service = std::fs::read_to_string(units.join("bud.service")).unwrap();
    std::fs::write(dir.0.join("bud.service"), rewrite(service)).unwrap();
    let (ok, text) = output(
        Command::new(&analyze)
            .args(["verify", "--man=no"])
            .arg(dir.0.join("bud.service")),
    );
    assert!(
        ok && text.trim().is_empty(),
        "systemd-analyze verify bud.service:\n{text}"
    );

    // The drop-in over Debian's haproxy.service (from Debian's haproxy package).
    require_program("haproxy", "haproxy");
    let unit_path = dir.0.join("units");
    std::fs::create_dir_all(unit_path.join("haproxy.service.d")).unwrap();
    std::fs::copy(
        "/lib/systemd/system/haproxy.service",
        unit_path.join("haproxy.service"),
    )
    .expect("Debian's haproxy.service");
    let drop_in = std::fs::read_to_string(units.join("haproxy.service.d/bud.conf")).unwrap();
    std::fs::write(
        unit_path.join("haproxy.service.d/bud.conf"),
        rewrite(drop_in),
    )
    .unwrap();
    let (ok, text) = output(
        Command::new(&analyze)
            .args(["verify", "--man=no", "haproxy.service"])
            .env("SYSTEMD_UNIT_PATH", format!("{}:", unit_path.display())),
    );
    assert!(
        ok && text.trim().is_empty(),
        "systemd-analyze verify haproxy.service + bud.conf:\n{text}"
    );

    let (ok, text) = output(Command::new("sh").arg("-n").arg(units.join("bud-drain")));
    assert!(ok, "bud-drain: {text}");
}

// ---- the front, run: fake nodes, fake DNS, real HAProxy ----

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
