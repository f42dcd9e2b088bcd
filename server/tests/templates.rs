//! Templates against the real server on loopback: unknown and unready templates refused,
//! each template's manifest listed, the `tools` template (bash, git, curl) and a template
//! added to and removed from a running server. Needs /dev/kvm; the first run builds and
//! boots the tools template. The datascience template's tests are in
//! `templates_datascience.rs`, so that these do not wait for its build in the suite.

mod common;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bud_server::Config;
use common::*;
use serde_json::{Value, json};

#[test]
fn unknown_templates_are_400_and_unready_ones_503() {
    let mut config: Config = test_config();
    config.templates = vec!["python".into(), "datascience".into()];
    let s = TestServer::with_templates(config, &["python"]);

    let (unknown, e) = s.exec(json!({"template": "nope", "code": "1"}));
    let (batch, b) = s.post(
        "/v1/exec/batch",
        &json!({"jobs": [{"code": "1"}, {"code": "1", "template": "nope"}]}),
    );
    let (session, se) = s.post("/v1/sessions", &json!({"template": "nope"}));
    let building = s.get("/v1/templates").json::<Value>().unwrap();
    let r = client()
        .post(s.url("/v1/exec"))
        .json(&json!({"template": "datascience", "code": "1"}))
        .send()
        .unwrap();

    assert_eq!(
        (unknown, &e["error"]["code"], &e["error"]["field"]),
        (400, &json!("unknown_template"), &json!("template")),
        "{e}"
    );
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("python, datascience"),
        "{e}"
    );
    assert_eq!(
        (batch, &b["error"]["field"]),
        (400, &json!("jobs[1].template")),
        "{b}"
    );
    assert_eq!(
        (session, &se["error"]["code"]),
        (400, &json!("unknown_template"))
    );
    assert_eq!(building["templates"][1]["status"], "building", "{building}");
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let not_ready: Value = r.json().unwrap();
    assert_eq!(
        not_ready["error"]["message"],
        "template `datascience` is not ready yet (it is being built or loaded)"
    );
}

/// The upstream version in a Debian version: `1:2.39.5-0+deb12u3` is `2.39.5`.
fn upstream(debian: &Value) -> String {
    let v = debian.as_str().expect("a package version");
    let v = v.split_once(':').map_or(v, |(_, v)| v);
    v.rsplit_once('-').map_or(v, |(v, _)| v).to_owned()
}

/// The `tools` template (bash, curl and git beside busybox; no network device): the
/// programs run at the versions its packages have, git commits in /tmp, curl fails at once
/// with its own error and exit code, and E2B's `base` is this template when it is served.
/// Three shell jobs of ~5-20 s each under kvm_pvm (every dynamically linked process start
/// costs a second or more of emulated guest-kernel work: docs/templates.md).
#[test]
fn the_tools_template_runs_bash_git_and_curl_without_a_network() {
    let mut config: Config = test_config();
    config.templates = vec!["python".into(), "tools".into()];
    let s = TestServer::with_config(config);
    let shell = |code: &str| {
        let (status, r) = s.exec(json!({"template": "tools", "language": "shell",
            "code": code, "timeout_ms": 60_000}));
        assert_eq!(status, 200, "{r}");
        r
    };
    let listed = s.get("/v1/templates").json::<Value>().unwrap();
    let tools = listed["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "tools")
        .expect("tools listed")
        .clone();
    let (bash, git, curl) = (
        upstream(&tools["packages"]["bash"]),
        upstream(&tools["packages"]["git"]),
        upstream(&tools["packages"]["curl"]),
    );

    let versions = shell("bash -c 'echo $BASH_VERSION'; git --version; curl --version | head -1");
    let offline = shell("curl -sS -o /dev/null -w '%{time_total}' http://example.invalid/");
    let repo = shell(
        "cd /tmp && mkdir repo && cd repo && git init -q && echo hello > a.txt && git add a.txt \
         && git -c user.name=bud -c user.email=bud@example.com commit -q -m first \
         && git log --format='%an <%ae> %s' && git status --porcelain && git cat-file -p HEAD:a.txt; \
         echo \"exit=$?\"",
    );
    let (made, sandbox) = s.post("/v2/sandboxes", &json!({"templateID": "base"}));
    let id = sandbox["sandboxID"].as_str().unwrap_or_default();
    // E2B's commands (`/bin/bash -l -c CMD`) run in GNU bash where the template has it.
    let started = client()
        .post(s.url("/process.Process/Start"))
        .header("e2b-sandbox-id", id)
        .header(
            "x-access-token",
            sandbox["envdAccessToken"].as_str().unwrap_or_default(),
        )
        .json(&json!({"process": {"cmd": "/bin/bash",
                                  "args": ["-l", "-c", "echo \"[${BASH_VERSION%%.*}]\""]}}))
        .send()
        .unwrap()
        .bytes()
        .unwrap();
    let mut e2b_out = Vec::new();
    let mut rest = &started[..];
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let msg: Value = serde_json::from_slice(&rest[5..5 + len]).unwrap();
        if let Some(b) = msg["event"]["data"]["stdout"].as_str() {
            e2b_out.extend(BASE64.decode(b).unwrap());
        }
        rest = &rest[5 + len..];
    }
    let deleted = client()
        .delete(s.url(&format!("/sandboxes/{id}")))
        .send()
        .unwrap()
        .status()
        .as_u16();

    assert_eq!(String::from_utf8_lossy(&e2b_out), "[5]\n", "{started:?}");
    let out = versions["stdout"].as_str().unwrap();
    assert_eq!(
        (&versions["exit_code"], &versions["stderr"]),
        (&json!(0), &json!("")),
        "{versions}"
    );
    assert_eq!(
        out.lines().take(2).collect::<Vec<_>>(),
        [format!("{bash}(1)-release"), format!("git version {git}")],
        "{versions}"
    );
    let curl_line = out.lines().nth(2).unwrap_or_default();
    assert!(
        curl_line.starts_with(&format!(
            "curl {curl} (x86_64-pc-linux-gnu) libcurl/{curl} "
        )),
        "{versions}"
    );
    // curl's own error and exit code; no resolver and no route, so it gives up at once (its
    // own timer; the job's time is mostly the process's start-up).
    assert_eq!(
        (&offline["exit_code"], &offline["stderr"]),
        (
            &json!(6),
            &json!("curl: (6) Could not resolve host: example.invalid\n")
        ),
        "{offline}"
    );
    let curl_s: f64 = offline["stdout"]
        .as_str()
        .unwrap()
        .parse()
        .expect("time_total");
    assert!(curl_s < 2.0, "curl took {curl_s} s to fail: {offline}");
    assert_eq!(
        (&repo["exit_code"], &repo["stdout"], &repo["stderr"]),
        (
            &json!(0),
            &json!("bud <bud@example.com> first\nhello\nexit=0\n"),
            &json!("")
        ),
        "{repo}"
    );
    assert_eq!(
        (made, &sandbox["alias"], deleted),
        (201, &json!("tools"), 204),
        "{sandbox}"
    );
}

/// PUTs `path` (no body); returns the status and the JSON answer (null when it has none).
fn put(s: &TestServer, path: &str) -> (u16, Value) {
    let r = client().put(s.url(path)).send().expect("request failed");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// DELETEs `path`; returns the status and the JSON answer (null when it has none).
fn delete(s: &TestServer, path: &str) -> (u16, Value) {
    let r = client().delete(s.url(path)).send().expect("request failed");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// The served templates' entries in `GET /v1/templates`, by name.
fn listed(s: &TestServer) -> Vec<Value> {
    let all = s.get("/v1/templates").json::<Value>().unwrap();
    all["templates"].as_array().unwrap().clone()
}

/// The registry is not fixed at start: a template whose guest is built is added to a
/// running server, lists its manifest (runtimes, tools), runs jobs at once, cannot be
/// removed while a session runs on it, then is removed; all without a restart.
#[test]
fn a_template_is_added_to_a_running_server_runs_jobs_and_is_removed() {
    // Built and booted once for this binary, so that the PUT below loads it.
    executor_of("tools");
    let s = TestServer::start();
    let tools_job = json!({"template": "tools", "language": "shell", "timeout_ms": 60_000,
                           "code": "command -v bash; bash -c 'echo ${BASH_VERSION%%.*}'"});

    let (before, b) = s.exec(tools_job.clone());
    let (added, entry) = put(&s, "/v1/templates/tools");
    let (again, _) = put(&s, "/v1/templates/tools");
    let (ran, r) = s.exec(tools_job.clone());
    let (ruby, rb) = s.exec(json!({"template": "tools", "language": "ruby", "code": "1"}));
    let names: Vec<Value> = listed(&s).iter().map(|t| t["name"].clone()).collect();
    let (made, session) = s.post("/v1/sessions", &json!({"template": "tools"}));
    let id = session["id"].as_str().unwrap_or_default().to_owned();
    let (busy, in_use) = delete(&s, "/v1/templates/tools");
    let ended = s.delete(&format!("/v1/sessions/{id}"));
    let (removed, _) = delete(&s, "/v1/templates/tools");
    let (after, a) = s.exec(tools_job);
    let (twice, _) = delete(&s, "/v1/templates/tools");
    let (default, d) = delete(&s, "/v1/templates/python");
    let (unbuilt, u) = put(&s, "/v1/templates/nope");
    let (bad_name, _) = put(&s, "/v1/templates/No%20Such");
    let still_python = s.exec(json!({"code": "print(6 * 7)"}));

    assert_eq!(
        (before, &b["error"]["code"]),
        (400, &json!("unknown_template")),
        "{b}"
    );
    assert_eq!(
        (added, &entry["name"], &entry["status"]),
        (201, &json!("tools"), &json!("ready")),
        "{entry}"
    );
    let runtimes: Vec<&Value> = entry["runtimes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["name"])
        .collect();
    assert_eq!(runtimes, [&json!("python"), &json!("shell")], "{entry}");
    assert_eq!(
        entry["tools"],
        json!(["bash", "busybox", "curl", "git", "pip", "pip3"]),
        "{entry}"
    );
    assert_eq!(entry["network"], json!("none"), "{entry}");
    assert_eq!(again, 200);
    assert_eq!(
        (ran, &r["status"], &r["stdout"]),
        (200, &json!("ok"), &json!("/bin/bash\n5\n")),
        "{r}"
    );
    assert_eq!(
        (ruby, &rb["error"]["code"], &rb["error"]["field"]),
        (400, &json!("invalid_request"), &json!("language")),
        "{rb}"
    );
    assert!(
        rb["error"]["message"]
            .as_str()
            .unwrap()
            .contains("python, shell"),
        "{rb}"
    );
    assert_eq!(names, [json!("python"), json!("tools")]);
    assert_eq!(made, 201, "{session}");
    assert_eq!(
        (busy, &in_use["error"]["code"]),
        (409, &json!("template_in_use")),
        "{in_use}"
    );
    assert_eq!(ended, 204);
    assert_eq!(removed, 204);
    assert_eq!(
        (after, &a["error"]["code"]),
        (400, &json!("unknown_template")),
        "{a}"
    );
    assert_eq!(twice, 404);
    assert_eq!(
        (default, &d["error"]["code"]),
        (409, &json!("template_in_use")),
        "{d}"
    );
    assert_eq!(
        (unbuilt, &u["error"]["code"]),
        (404, &json!("unknown_template")),
        "{u}"
    );
    assert_eq!(bad_name, 400);
    assert_eq!(
        (still_python.0, &still_python.1["stdout"]),
        (200, &json!("42\n"))
    );
}

/// `GET /v1/templates` shows each ready template's manifest: the base template's runtimes
/// at its guest's versions, busybox as its only tool, no network.
#[test]
fn the_template_list_shows_each_templates_runtimes_and_tools() {
    let s = TestServer::start();

    let all = listed(&s);
    let (status, version) =
        s.exec(json!({"code": "import platform; print(platform.python_version(), end='')"}));

    let python = &all[0];
    assert_eq!(status, 200, "{version}");
    assert_eq!(
        (
            &python["name"],
            &python["runtimes"][0]["name"],
            &python["runtimes"][0]["version"]
        ),
        (&json!("python"), &json!("python"), &version["stdout"]),
        "{python}"
    );
    assert_eq!(python["runtimes"][1]["name"], json!("shell"), "{python}");
    assert_eq!(
        python["tools"],
        json!(["busybox", "pip", "pip3"]),
        "{python}"
    );
    assert_eq!(python["network"], json!("none"), "{python}");
    assert_eq!(
        python["kernels"][0]["language"],
        json!("python"),
        "{python}"
    );
}
