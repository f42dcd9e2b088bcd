//! User templates through the real `bud serve` (jailed, as by default) and its builder
//! process: a definition POSTed, its build followed as NDJSON (Debian's `jq` and a wheel
//! from the package index fetched on the host, the template made, the warm-up's output in
//! the log), jobs on it (the wheel imported, the Debian program run, the definition's
//! environment, working directory and files), one more wheel on it (each made from its
//! parent's snapshot, not booted), a build whose warm-up raises (its traceback
//! in the log, nothing served), the template served again after a restart, then deleted
//! and gone after the next; and a server killed mid-build, which restarts without the
//! half-built template and builds it again. Needs /dev/kvm and the package registries (apt,
//! PyPI).

mod common;

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::served::{Served, own_state_dir, serve};

/// The definition this test builds (a fixed name and content: a second run finds its image
/// and its first boot in the build cache).
fn definition() -> Value {
    json!({
        "name": "ci-report",
        "from": "python",
        "apt": ["jq"],
        "pip": ["tabulate==0.9.0"],
        "env": {"REPORT_STYLE": "github"},
        "workdir": "/home/user/report",
        "files": {"/home/user/report/data.json": "[{\"region\": \"north\", \"sales\": 12}]"},
        "warm": "import tabulate\nprint('warm: tabulate', tabulate.__version__)\n",
    })
}

/// One more wheel, a Debian package, a file, two directories given as archives, an
/// environment variable, a warm-up and two runtimes of its own (Debian's Lua, busybox's
/// awk) on `ci-report`.
fn more_definition() -> Value {
    json!({
        "name": "ci-report-more",
        "from": "ci-report",
        "pip": ["six==1.16.0"],
        "apt": ["lua5.4"],
        "runtimes": [
            {"name": "lua", "aliases": ["lua5.4"], "command": ["lua5.4"], "extension": ".lua",
             "package": "lua5.4"},
            {"name": "awk", "command": ["/bin/busybox", "awk", "-f"]},
        ],
        "env": {"MORE": "yes"},
        "files": {"/home/user/report/notes.txt": "from the layer"},
        "archives": {
            "/home/user/report/app": tar_b64(&[
                ("main.py", "print('app')\n", 0o644),
                ("bin/run.sh", "#!/bin/sh\necho run $MORE\n", 0o755),
            ]),
            "/opt/tools": tar_b64(&[("hello", "#!/bin/sh\necho hello from /opt\n", 0o700)]),
        },
        "warm": "import six, sys\nsys.modules['warm_six'] = six\n",
    })
}

/// A tar archive of `files` (path, text, mode), base64.
fn tar_b64(files: &[(&str, &str, u32)]) -> String {
    use base64::Engine;
    let mut b = tar::Builder::new(Vec::new());
    for (path, text, mode) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(text.len() as u64);
        h.set_mode(*mode);
        h.set_entry_type(tar::EntryType::Regular);
        if path.contains("..") {
            // tar's own path setter refuses `..`: write the name as a hostile archive would.
            h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
            h.set_cksum();
            b.append(&h, text.as_bytes()).unwrap();
        } else {
            b.append_data(&mut h, path, text.as_bytes()).unwrap();
        }
    }
    base64::engine::general_purpose::STANDARD.encode(b.into_inner().unwrap())
}

/// Removes the saved snapshots of templates `names` from the build directory (their
/// images stay cached).
fn forget_snapshots(names: &[&str]) {
    let root = common::template_root();
    for dir in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let manifest = dir.path().join("manifest.json");
        let Ok(text) = std::fs::read_to_string(&manifest) else {
            continue;
        };
        let name: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if names.iter().any(|n| name["name"] == *n) {
            std::fs::remove_dir_all(dir.path()).expect("an old snapshot removed");
        }
    }
}

fn call(req: ureq::Request, body: Option<Value>) -> (u16, Value) {
    let r = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    let r = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("request failed: {e}"),
    };
    let status = r.status();
    (status, r.into_json().unwrap_or(Value::Null))
}

fn post(s: &Served, path: &str, body: Value) -> (u16, Value) {
    call(
        ureq::post(&format!("{}{path}", s.base)).timeout(Duration::from_secs(120)),
        Some(body),
    )
}

fn get(s: &Served, path: &str) -> (u16, Value) {
    call(ureq::get(&format!("{}{path}", s.base)), None)
}

/// The build log of `name` to its end (the server streams it as the build goes).
fn build_log(s: &Served, name: &str) -> Vec<Value> {
    let r = ureq::get(&format!("{}/v1/templates/{name}/build", s.base))
        .timeout(Duration::from_secs(1800))
        .call()
        .expect("the build log");
    assert_eq!(r.content_type(), "application/x-ndjson");
    let text = r.into_string().expect("the log text");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn lines_of(log: &[Value]) -> Vec<&str> {
    log.iter().filter_map(|l| l["line"].as_str()).collect()
}

/// POSTs `definition`, whose build must fail: its log's lines, and its error.
fn failed_build(s: &Served, definition: Value) -> (String, Value) {
    let name = definition["name"].as_str().expect("a name").to_owned();
    let (status, r) = post(s, "/v1/templates", definition);
    assert_eq!(status, 201, "{r}");
    let log = build_log(s, &name);
    let last = log.last().expect("a last line");
    assert_eq!(last["status"], "failed", "{last}");
    (lines_of(&log).join("\n"), last["error"].clone())
}

fn exec(s: &Served, body: Value) -> Value {
    let (status, r) = post(s, "/v1/exec", body);
    assert_eq!(status, 200, "{r}");
    r
}

/// Stops `s` with SIGTERM and checks it exits cleanly (a system call outside the jail's
/// filters at shutdown kills it with SIGSYS instead).
fn stop(mut s: Served) {
    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let status = s.child.wait().expect("the server's exit");
    assert!(status.success(), "bud serve did not stop cleanly: {status}");
    // Reaped: its Drop must not signal the pid again (another process may have it now).
    std::mem::forget(s);
}

/// Starts a server on `state` (a directory kept across restarts) and waits until it is
/// ready and jailed.
fn start(state: &std::path::Path) -> Served {
    let mut s = serve(&["--state-dir", state.to_str().unwrap()]);
    s.wait_ready();
    s
}

/// Waits until `name` is served and ready (a restart prepares the recorded user templates
/// after the default one).
fn wait_served(s: &Served, name: &str) -> Value {
    let until = Instant::now() + Duration::from_secs(600);
    loop {
        let (status, t) = get(s, &format!("/v1/templates/{name}"));
        if status == 200 && t["status"] == "ready" {
            return t;
        }
        assert!(Instant::now() < until, "{name} never became ready: {t}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_user_template_is_built_over_http_served_jailed_kept_across_restarts_and_deleted() {
    common::require_kvm();
    let state = own_state_dir(0).with_file_name("user-templates-state");
    let _ = std::fs::remove_dir_all(&state);
    // Their snapshots from an earlier run would be loaded as they are: made again here.
    forget_snapshots(&["ci-report", "ci-report-more"]);
    let mut s = start(&state);

    let (status, created) = post(&s, "/v1/templates", definition());
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["name"], "ci-report");
    assert_eq!(created["status"], "building");
    let log = build_log(&s, "ci-report");
    let last = log.last().expect("a last line");
    assert_eq!(last["status"], "ready", "{}", json!(lines_of(&log)));
    let lines = lines_of(&log);
    assert!(
        lines.iter().any(|l| l.contains("tabulate")),
        "the wheel's fetch is in the log: {lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("ready: the template is served")),
        "{lines:?}"
    );
    // Its image only adds to python's: made from python's snapshot, with no first boot.
    assert!(
        lines.iter().any(|l| l.contains("layer on python: ")),
        "{lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("first boot of its own")),
        "{lines:?}"
    );

    let t = wait_served(&s, "ci-report");
    assert_eq!(t["python_packages"]["tabulate"], "0.9.0", "{t}");
    assert!(t["packages"]["jq"].is_string(), "{t}");
    let tools = t["tools"].as_array().expect("tools");
    assert!(
        tools.contains(&json!("jq")) && tools.contains(&json!("tabulate")),
        "{t}"
    );
    assert_eq!(t["build"]["status"], "ready", "{t}");

    let py = exec(
        &s,
        json!({"template": "ci-report", "code": "import os, json, tabulate\n\
               rows = json.load(open('data.json'))\n\
               print(os.getcwd(), os.environ['REPORT_STYLE'])\n\
               print(tabulate.tabulate(rows, headers='keys', tablefmt='github'))"}),
    );
    assert_eq!(py["status"], "ok", "{py}");
    assert_eq!(
        py["stdout"],
        "/home/user/report github\n| region   |   sales |\n|----------|---------|\n| north    |      12 |\n",
        "{py}"
    );
    let sh = exec(
        &s,
        // Two processes, one a Python interpreter's start: seconds under kvm_pvm.
        json!({"template": "ci-report", "language": "shell", "timeout_ms": 60000,
               "code": "pwd; jq -r '.[0].region' data.json; tabulate --help | head -1"}),
    );
    assert_eq!(sh["status"], "ok", "{sh}");
    assert_eq!(
        sh["stdout"], "/home/user/report\nnorth\nUsage: tabulate [options] [FILE ...]\n",
        "{sh}"
    );
    // The other templates are as they were.
    let plain = exec(&s, json!({"code": "import os; print(os.getcwd())"}));
    assert_eq!(plain["stdout"], "/tmp\n", "{plain}");

    // One more package on it: a layer on ci-report's own snapshot, which keeps what
    // ci-report's layer and warm-up made and adds its own.
    let (status, r) = post(&s, "/v1/templates", more_definition());
    assert_eq!(status, 201, "{r}");
    let log = build_log(&s, "ci-report-more");
    let lines = lines_of(&log);
    assert_eq!(
        log.last().expect("a last line")["status"],
        "ready",
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("layer on ci-report: ")),
        "{lines:?}"
    );
    let more = exec(
        &s,
        json!({"template": "ci-report-more", "code": "import os, sys, six, tabulate\n\
               print(six.__version__, tabulate.__version__, os.getcwd())\n\
               print(os.environ['REPORT_STYLE'], os.environ['MORE'])\n\
               print(open('notes.txt').read(), 'warm_six' in sys.modules)"}),
    );
    assert_eq!(more["status"], "ok", "{more}");
    assert_eq!(
        more["stdout"], "1.16.0 0.9.0 /home/user/report\ngithub yes\nfrom the layer True\n",
        "{more}"
    );
    // Each job on it starts from its snapshot, as on any template.
    let first = exec(
        &s,
        json!({"template": "ci-report-more", "code": "open('notes.txt', 'a').write('!')\n\
               import six; six.marker = 1"}),
    );
    assert_eq!(first["status"], "ok", "{first}");
    let second = exec(
        &s,
        json!({"template": "ci-report-more", "code": "import six\n\
               print(open('notes.txt').read(), hasattr(six, 'marker'))"}),
    );
    assert_eq!(second["stdout"], "from the layer False\n", "{second}");
    let sh = exec(
        &s,
        json!({"template": "ci-report-more", "language": "shell", "timeout_ms": 60000,
               "code": "jq -n '1+1'; cat app/main.py; app/bin/run.sh; /opt/tools/hello; \
                        stat -c '%U %a' app/main.py app/bin/run.sh /opt/tools/hello"}),
    );
    assert_eq!(
        (&sh["status"], &sh["stdout"]),
        (
            &json!("ok"),
            &json!("2\nprint('app')\nrun yes\nhello from /opt\nuser 644\nuser 755\nroot 755\n")
        ),
        "{sh}"
    );
    program_runtimes(&s);
    // An archive that is not one is refused before any build, naming it.
    let mut bad = more_definition();
    bad["name"] = json!("ci-bad-archive");
    bad["archives"] = json!({"/opt/app": tar_b64(&[("../../etc/passwd", "x", 0o644)])});
    let (status, r) = post(&s, "/v1/templates", bad);
    assert_eq!(
        (status, &r["error"]["code"], &r["error"]["field"]),
        (
            400,
            &json!("invalid_request"),
            &json!("archives[\"/opt/app\"]")
        ),
        "{r}"
    );
    let gone = ureq::delete(&format!("{}/v1/templates/ci-report-more", s.base))
        .call()
        .expect("the delete");
    assert_eq!(gone.status(), 204);

    // A warm-up that raises: the build fails with its traceback, and nothing is served.
    let broken =
        json!({"name": "ci-broken", "warm": "raise ValueError('the model file is missing')"});
    let (text, _) = failed_build(&s, broken);
    assert!(
        text.contains("ValueError: the model file is missing"),
        "the traceback is in the log: {text}"
    );
    let (status, r) = post(
        &s,
        "/v1/exec",
        json!({"template": "ci-broken", "code": "1"}),
    );
    assert_eq!(
        (status, &r["error"]["code"]),
        (400, &json!("unknown_template")),
        "{r}"
    );
    let (status, r) = get(&s, "/v1/templates/ci-broken");
    assert_eq!((status, &r["status"]), (200, &json!("failed")), "{r}");

    // A restart on the same state directory serves it again.
    stop(s);
    s = start(&state);
    wait_served(&s, "ci-report");
    let again = exec(
        &s,
        json!({"template": "ci-report", "code": "import tabulate; print(tabulate.__version__)"}),
    );
    assert_eq!(again["stdout"], "0.9.0\n", "{again}");

    // A paused session made on it keeps it: the delete is refused, naming the session,
    // until the paused session is deleted.
    let (status, session) = post(&s, "/v1/sessions", json!({"template": "ci-report"}));
    assert_eq!(status, 201, "{session}");
    let id = session["id"].as_str().expect("an id").to_owned();
    let (status, paused) = post(&s, &format!("/v1/sessions/{id}/pause"), json!({}));
    assert_eq!(status, 200, "{paused}");
    let (status, refused) = call(
        ureq::delete(&format!("{}/v1/templates/ci-report", s.base)),
        None,
    );
    assert_eq!(
        (status, &refused["error"]["code"]),
        (409, &json!("template_in_use")),
        "{refused}"
    );
    assert_eq!(
        refused["error"]["message"],
        format!(
            "template ci-report is needed by paused session(s) {id}: end the sessions and delete the paused ones and the snapshots first"
        )
    );
    let (status, _) = call(ureq::delete(&format!("{}/v1/sessions/{id}", s.base)), None);
    assert_eq!(status, 204);

    // Deleted, it is gone now and after the next restart.
    let deleted = ureq::delete(&format!("{}/v1/templates/ci-report", s.base))
        .call()
        .expect("the delete");
    assert_eq!(deleted.status(), 204);
    let (status, r) = post(
        &s,
        "/v1/exec",
        json!({"template": "ci-report", "code": "1"}),
    );
    assert_eq!(
        (status, &r["error"]["code"]),
        (400, &json!("unknown_template")),
        "{r}"
    );
    stop(s);
    let s = start(&state);
    let (_, list) = get(&s, "/v1/templates");
    let names: Vec<&str> = list["templates"]
        .as_array()
        .expect("templates")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["python"], "{list}");
    stop(s);
    let _ = std::fs::remove_dir_all(&state);
}

/// `ci-report-more`'s runtimes of its own: listed as programs, each job and cell a process
/// of its interpreter on the code's file, with args, stdin, environment, exit status and
/// the session's directory as any job's; a runtime that takes a built-in's name is a 400,
/// and one whose interpreter no package put in the image fails its build, naming it.
fn program_runtimes(s: &Served) {
    let (_, t) = get(s, "/v1/templates/ci-report-more");
    let runtimes = t["runtimes"].as_array().expect("runtimes");
    let lua = runtimes
        .iter()
        .find(|r| r["name"] == "lua")
        .expect("lua is listed");
    assert_eq!(
        (&lua["run"], &lua["interpreter"], &lua["extension"]),
        (&json!("program"), &json!("/usr/bin/lua5.4"), &json!(".lua")),
        "{t}"
    );
    assert!(
        lua["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("5.4")),
        "{t}"
    );

    let job = exec(
        s,
        json!({"template": "ci-report-more", "language": "lua5.4", "args": ["x y"],
               "stdin": "in\n", "timeout_ms": 60000,
               "code": "print(arg[1], io.read('l'), os.getenv('MORE'), arg[0])\nos.exit(3)"}),
    );
    assert_eq!(
        (&job["status"], &job["exit_code"], &job["stdout"]),
        (
            &json!("error"),
            &json!(3),
            &json!("x y\tin\tyes\t/tmp/.bud-code/code.lua\n")
        ),
        "{job}"
    );
    let broken = exec(
        s,
        json!({"template": "ci-report-more", "language": "lua", "timeout_ms": 60000,
               "code": "print(("}),
    );
    assert_eq!(broken["exit_code"], 1, "{broken}");
    assert!(
        broken["stderr"]
            .as_str()
            .is_some_and(|e| e.starts_with("/usr/bin/lua5.4: /tmp/.bud-code/code.lua:1:")),
        "{broken}"
    );
    // Past its time the interpreter is stopped, as a shell job is.
    let endless = exec(
        s,
        json!({"template": "ci-report-more", "language": "lua", "timeout_ms": 4000,
               "code": "io.write('started\\n') io.flush() while true do end"}),
    );
    assert_eq!(
        (&endless["status"], &endless["stdout"]),
        (&json!("timeout"), &json!("started\n")),
        "{endless}"
    );
    let awk = exec(
        s,
        json!({"template": "ci-report-more", "language": "awk", "stdin": "a\nb\n",
               "timeout_ms": 60000, "code": "{ print NR \": \" $0 }"}),
    );
    assert_eq!(
        (&awk["status"], &awk["stdout"]),
        (&json!("ok"), &json!("1: a\n2: b\n")),
        "{awk}"
    );

    // A session in Lua: each cell a process, in the session's directory; what a cell
    // leaves on disk is there for the next, its variables are not.
    let (status, session) = post(
        s,
        "/v1/sessions",
        json!({"template": "ci-report-more", "language": "lua"}),
    );
    assert_eq!(status, 201, "{session}");
    let id = session["id"].as_str().expect("an id").to_owned();
    let cell = |code: &str| {
        let (status, r) = post(
            s,
            &format!("/v1/sessions/{id}/exec"),
            json!({"code": code, "timeout_ms": 60000}),
        );
        assert_eq!(status, 200, "{r}");
        r
    };
    let first = cell("x = 1\nlocal f = io.open('lua-note', 'w') f:write('kept') f:close()");
    assert_eq!(first["status"], "ok", "{first}");
    let second = cell("print(io.open('/home/user/report/lua-note'):read('a'), x)");
    assert_eq!(second["stdout"], "kept\tnil\n", "{second}");
    let (status, _) = call(ureq::delete(&format!("{}/v1/sessions/{id}", s.base)), None);
    assert_eq!(status, 204);

    let mut taken = more_definition();
    taken["name"] = json!("ci-bad-runtime");
    taken["runtimes"] = json!([{"name": "python", "command": ["lua5.4"]}]);
    let (status, r) = post(s, "/v1/templates", taken);
    assert_eq!(
        (status, &r["error"]["field"]),
        (400, &json!("runtimes[0].name")),
        "{r}"
    );
    let (lines, error) = failed_build(
        s,
        json!({"name": "ci-no-ruby", "runtimes": [{"name": "ruby", "command": ["ruby"]}]}),
    );
    let text = format!("{lines}\n{error}");
    assert!(
        text.contains(
            "runtime ruby: its interpreter ruby is not in the image (looked for in \
             /usr/local/bin, /usr/bin, /bin, /usr/sbin, /sbin): add the Debian package that \
             has it to `apt`"
        ),
        "{text}"
    );
}

/// A server killed in the middle of a build (its template being made from python's
/// snapshot) loses nothing: the helper's build stops with it, the restarted server serves
/// what it served before (not the half-built template), and the same definition then builds
/// and serves as if nothing had happened.
#[test]
fn a_server_killed_mid_build_restarts_without_it_and_builds_it_again() {
    use std::io::BufRead;
    common::require_kvm();
    let state = own_state_dir(0).with_file_name("user-templates-killed-state");
    let _ = std::fs::remove_dir_all(&state);
    forget_snapshots(&["ci-killed"]);
    let definition = json!({
        "name": "ci-killed",
        "files": {"/opt/killed/x": "after a kill"},
        // Holds the layer's clone for a while: the kill lands while it runs.
        "warm": "import time\ntime.sleep(3)\n",
    });
    let mut s = start(&state);
    let (status, r) = post(&s, "/v1/templates", definition.clone());
    assert_eq!(status, 201, "{r}");
    let log = ureq::get(&format!("{}/v1/templates/ci-killed/build", s.base))
        .timeout(Duration::from_secs(600))
        .call()
        .expect("the build log");
    let mut seen = Vec::new();
    for line in std::io::BufReader::new(log.into_reader()).lines() {
        let line = line.expect("a log line");
        let layering = line.contains("layer on python: ");
        seen.push(line);
        if layering {
            break;
        }
    }
    assert!(
        seen.last().is_some_and(|l| l.contains("layer on python: ")),
        "the build ended before its layer: {seen:?}"
    );
    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGKILL) };
    s.child.wait().expect("the killed server's exit");
    std::mem::forget(s);

    let s = start(&state);
    let (status, r) = get(&s, "/v1/templates/ci-killed");
    assert_eq!(status, 404, "the half-built template is served: {r}");
    let (status, r) = post(
        &s,
        "/v1/exec",
        json!({"template": "ci-killed", "code": "1"}),
    );
    assert_eq!(
        (status, &r["error"]["code"]),
        (400, &json!("unknown_template")),
        "{r}"
    );
    let (status, r) = post(&s, "/v1/templates", definition);
    assert_eq!(status, 201, "{r}");
    let log = build_log(&s, "ci-killed");
    assert_eq!(
        log.last().expect("a last line")["status"],
        "ready",
        "{}",
        json!(lines_of(&log))
    );
    let job = exec(
        &s,
        json!({"template": "ci-killed", "code": "print(open('/opt/killed/x').read())"}),
    );
    assert_eq!(job["stdout"], "after a kill\n", "{job}");
    stop(s);
    let _ = std::fs::remove_dir_all(&state);
}
