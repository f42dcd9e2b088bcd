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
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

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
        "--session-key-file /etc/bud/keys/session-keys",
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

#[path = "deploy/front.rs"]
mod front;
