//! Other sandboxes' real clients against bud on loopback: the E2B code-interpreter SDK and
//! the Piston client aiopyston, unmodified, installed from PyPI (pinned in
//! `compat/requirements.txt`) into `<repo>/build/compat-venv` by the first test that needs
//! them. Each client script prints what it saw as JSON and the test asserts every value.
//! Needs /dev/kvm and PyPI. Everything here runs on the `python` template; what needs the
//! `datascience` one (figures, DataFrames, charts) is in `compat_figures.rs`, so that this
//! binary does not wait for that template's build in the suite.

mod common;

use std::sync::Arc;

use bud_server::Config;
use bud_server::core::keys::ApiKeys;
use common::clients::{client_script, e2b_env};
use common::*;
use serde_json::{Value, json};

fn server(keys: Option<&str>) -> TestServer {
    let mut config: Config = test_config();
    config.templates = vec!["python".into()];
    config.api_keys = keys.map(|k| Arc::new(ApiKeys::parse(k).expect("test keys")));
    TestServer::with_config(config)
}

#[test]
fn the_e2b_sdk_runs_stateful_cells_errors_contexts_and_bash() {
    let s = server(None);
    let seen = client_script("e2b_interpreter.py", &[], &e2b_env(&s, "e2b_any"));
    assert_eq!(seen["id_prefix"], json!("ses_"));
    assert_eq!(seen["first"], json!("42"));
    assert_eq!(seen["stateful"], json!("82"));
    assert_eq!(seen["indented"], json!("42"));
    assert_eq!(seen["exec_env"], json!(["one", "unset"]));
    assert_eq!(seen["count"], json!(-1));
    assert_eq!(
        seen["streamed"],
        json!([["stderr", "b\n"], ["stdout", "a\nc\n"]])
    );
    assert_eq!(seen["logs"], json!([["a\n", "c\n"], ["b\n"]]));
    assert_eq!(seen["no_error"], json!(true));
    assert_eq!(
        seen["rich"],
        json!([
            "**bold**",
            "<svg/>",
            "$x^2$",
            {"a": [1, 2]},
            "alert(1)",
            "<b>b</b>",
            true
        ])
    );
    assert_eq!(
        seen["error"],
        json!([
            "ZeroDivisionError",
            "division by zero",
            ["ZeroDivisionError"]
        ])
    );
    assert_eq!(seen["traceback_has_line"], json!(true));
    assert_eq!(
        seen["traceback_ends"],
        json!("ZeroDivisionError: division by zero")
    );
    assert_eq!(seen["stderr_after_error"], json!([]));
    assert_eq!(
        seen["display_only"],
        json!([[false, "0"], [false, "1"], [false, "2"]])
    );
    assert_eq!(seen["json_value"], json!({"a": [1, 2.5], "b": null}));
    eprintln!("E2B cell wall times (python), s: {}", seen["timings"]);
    assert_eq!(seen["context"], json!(["in the context", "41"]));
    assert_eq!(seen["indented_in_context"], json!("42"));
    assert_eq!(seen["exec_env_context"], json!(["two", "unset"]));
    assert_eq!(seen["contexts"], json!([false, true]));
    assert_eq!(seen["restarted"], json!("NameError"));
    assert_eq!(
        seen["cwds"],
        json!([
            "/home/user",
            "/home/user/proj",
            "/tmp",
            "/home/user",
            "/home/user/proj"
        ])
    );
    assert_eq!(
        seen["overlap"],
        json!(["ctx/default", "ctx/other", "default/other"])
    );
    assert_eq!(seen["removed"], json!(["default"]));
    assert_eq!(seen["bash"], json!(["42 /home/user\n"]));
    assert_eq!(seen["bash_state"], json!(["7 /home/user/b\n"]));
    assert_eq!(seen["exec_env_bash"], json!([["three\n"], ["unset\n"]]));
    assert_eq!(
        seen["bash_context"],
        json!([["/tmp\n"], ["1unset /\n"], ["7 /home/user/b\n"]])
    );
    assert_eq!(
        seen["bash_error"],
        json!([["out\n"], "CommandExitError", "exit status 1"])
    );
    assert_eq!(seen["bash_interrupt"], json!("TimeoutException"));
    assert_eq!(seen["bash_kept"], json!([["1 x1 /\n"], true]));
    assert_eq!(seen["bash_exit"], json!([["bye\n"], "DeadKernelError"]));
    assert_eq!(seen["bash_new_shell"], json!(["gone /tmp\n"]));
    assert_eq!(seen["async"], json!([true, ["/tmp\n"], ["/tmp\n"]]));
    assert_eq!(seen["async_symlink"], json!(["symlink", "t.txt"]));
    assert_eq!(seen["running"], json!(true));
    assert_eq!(seen["running_after_kill"], json!(false));
    assert_eq!(seen["kill_again"], json!(false));
    assert_eq!(
        s.state.sessions().count(),
        0,
        "the sandbox's session is gone"
    );
}

#[test]
fn the_e2b_sdk_moves_files_and_runs_commands() {
    let s = server(None);
    let seen = client_script("e2b_sandbox.py", &[], &e2b_env(&s, "e2b_any"));
    assert_eq!(seen["written"], json!(["data.txt", "/home/user/data.txt"]));
    assert_eq!(seen["read"], json!("one\ntwo\n"));
    assert_eq!(seen["read_relative"], json!("one\ntwo\n"));
    assert_eq!(seen["bytes"], json!([111, 110, 101]));
    assert_eq!(seen["seen_by_code"], json!("['one', 'two']"));
    assert_eq!(seen["cmd"], json!(["out\nhello\n", "err\n", 0]));
    assert_eq!(seen["cmd_exit"], json!([3, "partial\n"]));
    assert_eq!(seen["cmd_cwd"], json!("2"));
    assert_eq!(seen["users"], json!(["user\n", "root\n"]));
    assert_eq!(seen["context"], json!(["42", 1, 0]));
    assert_eq!(seen["mkdir"], json!([true, false]));
    assert_eq!(seen["moved"], json!("one\ntwo\n"));
    assert_eq!(seen["exists"], json!([false, true]));
    assert_eq!(
        seen["list"],
        json!([
            ["e", "dir", "/home/user/d/e", 40],
            ["moved.txt", "file", "/home/user/d/moved.txt", 8]
        ])
    );
    assert_eq!(
        seen["list_deep"],
        json!(["/home/user/d", "/home/user/d/e", "/home/user/d/moved.txt"])
    );
    assert_eq!(seen["removed"], json!(false));
    assert_eq!(seen["gzip_read"], json!(true));
    assert_eq!(seen["gzip_raw"], json!([200, "gzip", true, true]));
    assert_eq!(
        seen["symlinks"],
        json!([
            ["link.txt", "symlink", "target.txt"],
            ["target.txt", "file", null]
        ])
    );
    assert_eq!(seen["missing"], json!("NotFoundException"));
    assert_eq!(seen["connected"], json!("2"));
}

#[test]
fn e2b_commands_terminals_and_files_belong_to_user_unless_root_is_asked_for() {
    let s = server(None);
    let seen = client_script("e2b_users.py", &[], &e2b_env(&s, "e2b_any"));
    let lines = |v: &[&str]| json!(v);
    assert_eq!(
        seen["default"],
        lines(&[
            "user",
            "1000",
            "1000",
            "user",
            "/home/user user user /bin/sh",
            "/home/user"
        ])
    );
    assert_eq!(seen["getcwd"], json!("/home/user\n"));
    assert_eq!(
        seen["root"],
        lines(&[
            "root",
            "0",
            "0",
            "root",
            "/root root root /bin/sh",
            "/home/user"
        ])
    );
    assert_eq!(seen["explicit_user"], json!("user\n"));
    assert_eq!(seen["relative_cwd"], json!("/home/user/sub\n"));
    assert_eq!(seen["cwd_sub"], json!("/home/user/sub\n"));
    assert_eq!(seen["home"], lines(&["user user 1777", "user user 1777"]));
    assert_eq!(seen["unknown_user"], json!("InvalidArgumentException"));
    assert_eq!(seen["modified"], json!([0, "uploaded\nappended\n"]));
    assert_eq!(
        seen["up_info"],
        json!(["user", "user", "-rw-r--r--", "0o644"])
    );
    assert_eq!(seen["made"], json!([["deep", "user", "user"]]));
    assert_eq!(seen["parents"], lines(&["user", "user", "user"]));
    assert_eq!(seen["root_info"], json!(["root", "root", "-rw-r--r--"]));
    assert_eq!(seen["user_denied"], json!([1, true]));
    assert_eq!(seen["root_may"], json!("root\n"));
    assert_eq!(
        seen["listed"],
        json!({
            "rootfile.txt": ["root", "root", "-rw-------"],
            "mine": ["root", "root", "drwxr-xr-x"],
            "by-user": ["user", "user", "drwxr-xr-x"],
            "up.txt": ["user", "user", "-rw-r--r--"],
        })
    );
    assert_eq!(seen["made_by_user"], json!([["f", "user"]]));
    assert_eq!(seen["url_owner"], json!("root"));
    assert_eq!(seen["pty"], json!([true, true]));
    assert_eq!(
        seen["async"],
        json!([
            ["user", "/home/user"],
            ["root", "/root"],
            "user",
            "2",
            "user",
            "root"
        ])
    );
}

#[test]
fn the_e2b_sdk_lists_filters_pages_measures_and_forks_sandboxes() {
    let s = server(None);
    let seen = client_script("e2b_control.py", &[], &e2b_env(&s, "e2b_any"));
    assert_eq!(seen["all"], json!(["alice", "bob"]));
    assert_eq!(seen["by_user"], json!(["alice"]));
    assert_eq!(seen["by_odd_metadata"], json!(["alice"]));
    assert_eq!(seen["by_no_match"], json!([[]]));
    assert_eq!(seen["running"], json!(["alice", "bob"]));
    assert_eq!(seen["paused"], json!([[]]));
    assert_eq!(seen["by_template"], json!(["alice", "bob"]));
    assert_eq!(seen["pages_of_one"], json!([1, 1]));
    assert_eq!(seen["pages_cover"], json!(["alice", "bob"]));
    assert_eq!(
        seen["info"],
        json!(["base", "running", {"user": "alice", "k&": "v=1 x"}, 1])
    );
    assert_eq!(
        seen["metrics"],
        json!([1, 1, true, 256u64 << 20, 0, true]),
        "{seen}"
    );
    assert_eq!(seen["download"], json!([200, "for the signed url\n"]));
    assert_eq!(seen["download_expiring"], json!(200));
    assert_eq!(
        seen["download_expired"],
        json!([401, "the URL's signature has expired"])
    );
    assert_eq!(
        seen["download_tampered"],
        json!([401, "the URL's signature matches no sandbox's"])
    );
    assert_eq!(seen["upload"], json!([200, "uploaded\n", false]));
    assert_eq!(seen["forks"], json!(2));
    assert_eq!(seen["fork_ids_differ"], json!(true));
    assert_eq!(seen["fork_state"], json!(["42", "42"]));
    assert_eq!(seen["fork_isolated"], json!(["41", "41"]));
    assert_eq!(seen["fork_listed"], json!(3));
    assert_eq!(
        seen["async"],
        json!([
            true,
            true,
            [200, "async\n"],
            [200, "up\n"],
            true,
            ["42"],
            true
        ])
    );
    assert_eq!(seen["after_kill"], json!([[]]));
}

/// With API keys, a listing shows a key the sandboxes it made and none of another key's
/// (a sandbox's id is the key to it).
#[test]
fn a_sandbox_listing_shows_a_key_only_its_own_sandboxes() {
    let s = server(Some(
        "alice 0123456789abcdef-alice\nbob 0123456789abcdef-bob\n",
    ));
    let call = |method: reqwest::Method, path: &str, key: &str, body: Option<Value>| {
        let mut r = client()
            .request(method, s.url(path))
            .header("X-API-Key", key);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let r = r.send().unwrap();
        (
            r.status().as_u16(),
            r.json::<Value>().unwrap_or(Value::Null),
        )
    };
    let alice = "0123456789abcdef-alice";
    let bob = "0123456789abcdef-bob";
    let (made, sandbox) = call(
        reqwest::Method::POST,
        "/v2/sandboxes",
        alice,
        Some(json!({"templateID": "base", "timeout": 60})),
    );
    let id = sandbox["sandboxID"].clone();

    let (alice_status, alice_list) = call(reqwest::Method::GET, "/v2/sandboxes", alice, None);
    let (bob_status, bob_list) = call(reqwest::Method::GET, "/v2/sandboxes", bob, None);
    let ids = |v: &Value| -> Vec<Value> {
        v.as_array()
            .map(|a| a.iter().map(|x| x["sandboxID"].clone()).collect())
            .unwrap_or_default()
    };
    call(
        reqwest::Method::DELETE,
        &format!("/sandboxes/{}", id.as_str().unwrap_or_default()),
        alice,
        None,
    );

    assert_eq!(made, 201, "{sandbox}");
    assert_eq!((alice_status, ids(&alice_list)), (200, vec![id]));
    assert_eq!((bob_status, ids(&bob_list)), (200, vec![]));
}

#[test]
fn an_e2b_sandbox_has_the_same_trace_as_a_session() {
    let state_dir = std::env::temp_dir().join(format!("bud-e2b-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state_dir);
    let mut config: Config = test_config();
    config.state_dir = Some(state_dir.clone());
    let s = TestServer::with_config(config);

    let seen = client_script("e2b_trace.py", &[], &e2b_env(&s, "e2b_any"));
    let id = seen["id"].as_str().expect("a sandbox id").to_owned();
    let get = |path: &str| {
        let r = client().get(s.url(path)).send().unwrap();
        (r.status().as_u16(), r.text().unwrap_or_default())
    };
    let (status, trace) = get(&format!("/v1/sessions/{id}/trace"));
    let (verify_status, verify) = get(&format!("/v1/sessions/{id}/trace/verify"));
    let (review_status, review) = get(&format!("/v1/sessions/{id}/review"));
    let _ = std::fs::remove_dir_all(&state_dir);

    assert_eq!(seen["cell"], json!(["42\n"]), "{seen}");
    assert_eq!(seen["cmd"], json!(4), "{seen}");
    assert_eq!(seen["killed"], json!(true), "{seen}");
    assert_eq!(status, 200, "{trace}");
    let events: Vec<Value> = trace
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    let find = |kind: &str| {
        events
            .iter()
            .find(|e| e["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} in {kinds:?}"))
    };
    assert_eq!(kinds.first(), Some(&"created"), "{kinds:?}");
    assert_eq!(&kinds[kinds.len() - 2..], ["ended", "sealed"], "{kinds:?}");
    let cell = find("cell");
    assert_eq!(cell["data"]["code"], "print(6 * 7)");
    assert_eq!(cell["data"]["stdout"], "42\n");
    let process = find("process");
    assert!(
        process["data"].to_string().contains("echo traced; exit 4"),
        "{process}"
    );
    assert_eq!(find("process_end")["data"]["exit_code"], 4);
    // Paths are kept as the native API names them: relative to /home/user.
    assert_eq!(find("file_written")["data"]["path"], "evidence.txt");
    assert_eq!(find("file_written")["data"]["bytes"], 4);
    assert_eq!(verify_status, 200, "{verify}");
    let verify: Value = serde_json::from_str(&verify).unwrap();
    assert_eq!(
        (&verify["ok"], &verify["sealed"]),
        (&json!(true), &json!(true))
    );
    assert_eq!(review_status, 200);
    assert!(review.contains("echo traced; exit 4"), "{review}");
}

#[test]
fn a_piston_client_runs_python_and_bash_with_stdin_and_args() {
    let s = server(None);
    let seen = client_script("piston_client.py", &[&s.url("/api/v2/piston/"), ""], &[]);
    assert_eq!(
        seen["runtimes"],
        json!([
            ["bash", ["sh"]],
            ["python", ["py", "py3", "python3", "python3.11"]]
        ])
    );
    let version = seen["python_version"].as_str().expect("a version");
    assert!(version.starts_with("3.11."), "{version}");
    assert_eq!(seen["python"], json!(["['a', 'b c'] PIPED\n", 0, "python"]));
    assert_eq!(seen["bash"], json!(["x-y\ngot input\n", 4]));
    assert_eq!(seen["error"], json!([1, "ValueError: boom"]));
    assert_eq!(seen["unknown"], json!("cobol-* runtime is unknown"));
}

/// A raw POST with no Content-Type, as the npm `piston-client` sends it.
fn post_bare(s: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(s.url(path))
        .body(serde_json::to_vec(body).unwrap())
        .send()
        .expect("request failed");
    let status = r.status().as_u16();
    (status, r.json().expect("the answer is not JSON"))
}

#[test]
fn piston_execute_decodes_files_maps_statuses_and_answers_bad_input_with_400() {
    let s = server(None);
    let (status, r) = post_bare(
        &s,
        "/api/v2/execute",
        &json!({
            "language": "python", "version": "3",
            "files": [
                {"name": "main.py", "content": "696d706f7274206c69620a7072696e74286c69622e56290a", "encoding": "hex"},
                {"name": "lib.py", "content": "ViA9ICdzaWJsaW5nJwo=", "encoding": "base64"}
            ]
        }),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["run"]["stdout"], json!("sibling\n"));
    assert_eq!(r["run"]["status"], Value::Null);
    assert_eq!(r["run"]["code"], json!(0));

    let (status, r) = post_bare(
        &s,
        "/api/v2/execute/",
        &json!({"language": "python", "files": [{"content": "import time; time.sleep(5)"}], "run_timeout": 300}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        (&r["run"]["status"], &r["run"]["signal"]),
        (&json!("TO"), &json!("SIGKILL"))
    );

    let (status, r) = post_bare(
        &s,
        "/api/v2/execute",
        &json!({"language": "bash", "files": [{"content": "kill -SEGV $$"}]}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        (&r["run"]["status"], &r["run"]["signal"]),
        (&json!("SG"), &json!("SIGSEGV"))
    );

    for (body, message) in [
        (
            json!({"language": "python", "version": "2.7", "files": [{"content": "1"}]}),
            "python-2.7 runtime is unknown",
        ),
        (
            json!({"language": "python", "files": []}),
            "files is required as a non-empty array",
        ),
        (
            json!({"language": "python", "files": [{"content": "zz", "encoding": "hex"}]}),
            "files[0].content is not valid hex",
        ),
        (
            json!({"language": "python", "files": [{"content": "1"}], "run_timeout": 999999}),
            "run_timeout must be 1..=60000 ms, the configured limit (got 999999)",
        ),
    ] {
        let (status, r) = post_bare(&s, "/api/v2/execute", &body);
        assert_eq!(
            (status, &r),
            (400, &json!({ "message": message })),
            "{body}"
        );
    }
}

#[test]
fn with_keys_every_client_needs_one_and_e2b_sandboxes_their_token() {
    let key = "0123456789abcdef0123";
    let s = server(Some(&format!("ci {key}\n")));

    // The native API and Piston: no key, a wrong one, the right one in each header form.
    let (status, r) = s.exec(json!({"code": "print(1)"}));
    assert_eq!((status, &r["error"]["code"]), (401, &json!("unauthorized")));
    let run = |header: &str, value: &str| {
        client()
            .post(s.url("/api/v2/execute"))
            .header(header, value)
            .json(&json!({"language": "python", "files": [{"content": "print(2)"}]}))
            .send()
            .expect("request failed")
            .status()
            .as_u16()
    };
    assert_eq!(run("authorization", "wrong-key-wrong-key"), 401);
    assert_eq!(run("authorization", key), 200);
    assert_eq!(run("authorization", &format!("Bearer {key}")), 200);
    assert_eq!(run("x-api-key", key), 200);
    assert_eq!(s.get("/v1/health").status().as_u16(), 200);

    // The E2B SDK with the right key works end to end; with a wrong one it is refused.
    let seen = client_script("piston_client.py", &[&s.url("/api/v2/piston/"), key], &[]);
    assert_eq!(seen["bash"], json!(["x-y\ngot input\n", 4]));
    let (status, r) = {
        let resp = client()
            .post(s.url("/v2/sandboxes"))
            .header("x-api-key", "not-the-key-at-all")
            .json(&json!({"templateID": "base"}))
            .send()
            .unwrap();
        (resp.status().as_u16(), resp.json::<Value>().unwrap())
    };
    assert_eq!((status, &r["error"]["code"]), (401, &json!("unauthorized")));

    // A sandbox's routes need its own access token, not only its id.
    let resp = client()
        .post(s.url("/v2/sandboxes"))
        .header("x-api-key", key)
        .json(&json!({"templateID": "base"}))
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 201);
    let made: Value = resp.json().unwrap();
    let id = made["sandboxID"].as_str().unwrap().to_owned();
    let token = made["envdAccessToken"].as_str().unwrap().to_owned();
    let execute = |token: Option<&str>| {
        let mut req = client()
            .post(s.url("/execute"))
            .header("e2b-sandbox-id", &id)
            .json(&json!({"code": "6 * 7"}));
        if let Some(t) = token {
            req = req.header("x-access-token", t);
        }
        let resp = req.send().unwrap();
        (resp.status().as_u16(), resp.text().unwrap())
    };
    assert_eq!(execute(None).0, 401);
    assert_eq!(execute(Some("0000")).0, 401);
    let (status, body) = execute(Some(&token));
    assert_eq!(status, 200, "{body}");
    let lines: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["text"], json!("42"));
    assert_eq!(lines.last().unwrap()["type"], json!("end_of_execution"));
    // The code interpreter's context calls carry only the traffic access token: bud's is
    // the sandbox's token.
    assert_eq!(made["trafficAccessToken"], json!(token));
    let contexts = |header: Option<(&str, &str)>| {
        let mut req = client()
            .get(s.url("/contexts"))
            .header("e2b-sandbox-id", &id);
        if let Some((h, v)) = header {
            req = req.header(h, v);
        }
        req.send().unwrap().status().as_u16()
    };
    assert_eq!(contexts(None), 401);
    assert_eq!(contexts(Some(("e2b-traffic-access-token", "0000"))), 401);
    assert_eq!(contexts(Some(("e2b-traffic-access-token", &token))), 200);
    assert_eq!(contexts(Some(("x-access-token", &token))), 200);
    let seen = client_script("e2b_sandbox.py", &[], &e2b_env(&s, key));
    assert_eq!(seen["connected"], json!("2"));
    assert_eq!(seen["context"], json!(["42", 1, 0]));
    // The user's Authorization header (root here) is no key, and no key is asked for there.
    assert_eq!(seen["users"], json!(["user\n", "root\n"]));
}
