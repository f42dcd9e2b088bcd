//! JavaScript one-shot jobs on the `node` template against the real server on loopback: the
//! warm Node.js kernel that holds the doorbell (guest/node/kernel.js), `node -e` semantics
//! (output, args, env, stdin, exit codes, uncaught errors, the event loop drained), limits,
//! no state between jobs, randomness of its own in every clone, and the worker's own
//! runtimes beside it (Python and shell jobs handed over); TypeScript jobs and cells in the
//! same kernel; E2B's and Piston's clients. Needs /dev/kvm; the first run
//! builds and boots the node template (minutes), later runs load it.

mod common;

use std::collections::BTreeSet;

use bud_server::Config;
use common::clients::{client_script, e2b_env};
use common::*;
use serde_json::{Value, json};

fn node() -> TestServer {
    let mut config: Config = test_config();
    config.templates = vec!["node".into()];
    // The memory bomb below fills the guest at the speed of fresh pages.
    config.limits.max_timeout_ms = 600_000;
    TestServer::with_config(config)
}

fn js(s: &TestServer, body: Value) -> Value {
    let mut body = body;
    body["template"] = json!("node");
    if body.get("language").is_none() {
        body["language"] = json!("javascript");
    }
    let (status, r) = s.exec(body);
    assert_eq!(status, 200, "{r}");
    r
}

fn outcome(r: &Value) -> (&Value, &Value, &Value, &Value) {
    (&r["status"], &r["exit_code"], &r["stdout"], &r["stderr"])
}

#[test]
fn console_output_args_env_and_stdin_come_back_as_from_node_e() {
    let s = node();

    let r = js(
        &s,
        json!({
            "code": "console.log(1 + 1); console.error('to stderr');\n\
                     console.log(process.argv.slice(1).join('|'), process.env.GREETING);\n\
                     process.stdout.write(require('fs').readFileSync(0, 'utf8').toUpperCase())",
            "args": ["one", "two words"],
            "env": {"GREETING": "hello"},
            "stdin": "from stdin\n",
        }),
    );

    assert_eq!(
        outcome(&r),
        (
            &json!("ok"),
            &json!(0),
            &json!("2\none|two words hello\nFROM STDIN\n"),
            &json!("to stderr\n")
        ),
        "{r}"
    );
}

#[test]
fn every_alias_names_javascript_and_it_is_the_templates_default() {
    let s = node();

    for language in ["javascript", "js", "node"] {
        let r = js(
            &s,
            json!({"code": "console.log(typeof require)", "language": language}),
        );
        assert_eq!(outcome(&r).2, &json!("function\n"), "{language}: {r}");
    }
    let (status, r) = s.exec(json!({"template": "node", "code": "console.log(6 * 7)"}));

    assert_eq!((status, &r["stdout"]), (200, &json!("42\n")), "{r}");
}

#[test]
fn exit_codes_follow_process_exit_and_exit_code() {
    let s = node();

    let exit = js(
        &s,
        json!({"code": "console.log('before'); process.exit(7); console.log('after')"}),
    );
    let code = js(
        &s,
        json!({"code": "process.exitCode = 4; setTimeout(() => console.log('ran'), 20)"}),
    );

    assert_eq!(
        outcome(&exit),
        (&json!("error"), &json!(7), &json!("before\n"), &json!("")),
        "{exit}"
    );
    assert_eq!(
        outcome(&code),
        (&json!("error"), &json!(4), &json!("ran\n"), &json!("")),
        "{code}"
    );
}

#[test]
fn an_uncaught_error_prints_its_stack_and_exits_1() {
    let s = node();

    let thrown = js(&s, json!({"code": "function f() { return null.x; }\nf()"}));
    let rejected = js(
        &s,
        json!({"code": "Promise.reject(new RangeError('no such range'))"}),
    );
    let syntax = js(&s, json!({"code": "let = ;"}));

    for r in [&thrown, &rejected, &syntax] {
        assert_eq!(
            (&r["status"], &r["exit_code"], &r["stdout"]),
            (&json!("error"), &json!(1), &json!("")),
            "{r}"
        );
        assert!(
            !r["stderr"].as_str().unwrap().contains("kernel.js"),
            "bud's frames shown: {r}"
        );
    }
    let stderr = thrown["stderr"].as_str().unwrap();
    assert!(
        stderr.contains("TypeError: Cannot read properties of null (reading 'x')")
            && stderr.contains("at f ([eval]:1:")
            && stderr.ends_with(&format!("\n\nNode.js {}\n", node_version(&s))),
        "{thrown}"
    );
    assert!(
        rejected["stderr"]
            .as_str()
            .unwrap()
            .contains("RangeError: no such range"),
        "{rejected}"
    );
    assert!(
        syntax["stderr"].as_str().unwrap().contains("SyntaxError"),
        "{syntax}"
    );
}

fn node_version(s: &TestServer) -> String {
    let r = js(s, json!({"code": "process.stdout.write(process.version)"}));
    r["stdout"].as_str().unwrap().to_owned()
}

#[test]
fn timers_promises_and_async_functions_run_before_the_job_ends() {
    let s = node();

    let r = js(
        &s,
        json!({"code": "const sleep = (ms) => new Promise((r) => setTimeout(r, ms));\n\
                        (async () => { await sleep(30); console.log('after 30 ms'); })();\n\
                        setImmediate(() => console.log('immediate'));\n\
                        process.on('exit', (c) => console.log('exit', c));\n\
                        console.log('sync')"}),
    );

    assert_eq!(
        outcome(&r),
        (
            &json!("ok"),
            &json!(0),
            &json!("sync\nimmediate\nafter 30 ms\nexit 0\n"),
            &json!("")
        ),
        "{r}"
    );
}

#[test]
fn nothing_of_one_job_reaches_the_next() {
    let s = node();

    let first = js(
        &s,
        json!({"code": "globalThis.leaked = 'secret'; Object.prototype.polluted = 1;\n\
                        require('fs').writeFileSync('/tmp/left-behind', 'x');\n\
                        process.env.LEFT = 'yes'; console.log('planted')"}),
    );
    let second = js(
        &s,
        json!({"code": "console.log(typeof leaked, ({}).polluted, process.env.LEFT,\n\
                        require('fs').existsSync('/tmp/left-behind'))"}),
    );

    assert_eq!(first["stdout"], json!("planted\n"), "{first}");
    assert_eq!(
        outcome(&second),
        (
            &json!("ok"),
            &json!(0),
            &json!("undefined undefined undefined false\n"),
            &json!("")
        ),
        "{second}"
    );
}

#[test]
fn a_job_may_declare_any_top_level_name() {
    let s = node();

    // The names the kernel's warm-up used: none of them is left declared in the snapshot.
    let r = js(
        &s,
        json!({"code": "const fs = require('fs'); const os = require('os'); const p = require('path');\n\
                        const c = require('crypto'); let f = 1; class e {}\n\
                        console.log(typeof fs.readFileSync, typeof os.EOL, p.join('a', 'b'), f)"}),
    );

    assert_eq!(
        outcome(&r),
        (
            &json!("ok"),
            &json!(0),
            &json!("function string a/b 1\n"),
            &json!("")
        ),
        "{r}"
    );
}

#[test]
fn every_clone_has_its_own_math_random_and_crypto_streams() {
    let s = node();
    let mut seen = BTreeSet::new();

    for _ in 0..12 {
        let r = js(
            &s,
            json!({"code": "const c = require('crypto');\n\
                            console.log(Math.random(), c.randomBytes(16).toString('hex'), c.randomUUID())"}),
        );
        let out = r["stdout"].as_str().unwrap().to_owned();
        let parts: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(parts.len(), 3, "{r}");
        for part in parts {
            assert!(seen.insert(part.to_owned()), "{part} seen twice");
        }
    }

    assert_eq!(seen.len(), 36);
}

#[test]
fn a_loop_times_out_and_the_next_job_runs() {
    let s = node();

    let r = js(
        &s,
        json!({"code": "console.log('start'); while (true) {}", "timeout_ms": 1500}),
    );
    let next = js(&s, json!({"code": "console.log('next')"}));

    assert_eq!(r["status"], json!("timeout"), "{r}");
    assert_eq!(
        outcome(&next),
        (&json!("ok"), &json!(0), &json!("next\n"), &json!("")),
        "{next}"
    );
}

#[test]
fn a_memory_bomb_ends_as_memory_limit_and_the_next_job_runs() {
    let s = node();

    // Buffers outside V8's heap, 1 MiB each, until the guest's memory is gone: filling it is
    // emulated guest-kernel work on kvm_pvm (~20 s alone), so the limit is generous.
    let r = js(
        &s,
        json!({"code": "const a = []; for (;;) a.push(Buffer.alloc(1 << 20, 1))", "timeout_ms": 600000}),
    );
    let next = js(&s, json!({"code": "console.log('still here')"}));

    assert_eq!(r["status"], json!("memory_limit"), "{r}");
    assert_eq!(
        outcome(&next),
        (&json!("ok"), &json!(0), &json!("still here\n"), &json!("")),
        "{next}"
    );
}

#[test]
fn output_past_the_cap_ends_with_output_limit() {
    let s = node();

    let r = js(
        &s,
        json!({"code": "for (;;) console.log('x'.repeat(1000))", "output_limit": 100000}),
    );

    assert_eq!(r["status"], json!("output_limit"), "{r}");
    let kept = r["stdout"].as_str().unwrap().len();
    assert!(
        (100_000..=100_000 + 1001).contains(&kept) || kept == 100_000,
        "{kept}"
    );
}

#[test]
fn a_mebibyte_of_output_and_a_childs_output_come_back_intact() {
    let s = node();

    let big = js(
        &s,
        json!({"code": "process.stdout.write('y'.repeat(3 * 1024 * 1024 + 5))"}),
    );
    let child = js(
        &s,
        json!({"code": "const out = require('child_process').execSync('echo from-child; echo child-err >&2');\n\
                        console.log(out.toString().trim())"}),
    );

    assert_eq!(
        big["stdout"].as_str().map(str::len),
        Some(3 * 1024 * 1024 + 5),
        "{}",
        big["status"]
    );
    assert_eq!(
        outcome(&child),
        (
            &json!("ok"),
            &json!(0),
            &json!("from-child\n"),
            &json!("child-err\n")
        ),
        "{child}"
    );
}

#[test]
fn python_and_shell_jobs_still_run_on_the_node_template() {
    let s = node();

    let py = js(
        &s,
        json!({"code": "import sys; print(sys.version_info[0])", "language": "python"}),
    );
    let sh = js(&s, json!({"code": "echo $((6 * 7))", "language": "shell"}));
    let after = js(&s, json!({"code": "console.log('js again')"}));

    assert_eq!(
        outcome(&py),
        (&json!("ok"), &json!(0), &json!("3\n"), &json!("")),
        "{py}"
    );
    assert_eq!(
        outcome(&sh),
        (&json!("ok"), &json!(0), &json!("42\n"), &json!("")),
        "{sh}"
    );
    assert_eq!(after["stdout"], json!("js again\n"), "{after}");
}

#[test]
fn the_template_lists_javascript_and_typescript_with_their_aliases_and_version() {
    let s = node();

    let r: Value = s.get("/v1/templates/node").json().unwrap();

    let runtimes = r["runtimes"]
        .as_array()
        .unwrap_or_else(|| panic!("no runtimes: {r}"));
    let first = &runtimes[0];
    assert_eq!(
        (
            &first["name"],
            &first["aliases"],
            &first["run"],
            &first["interpreter"]
        ),
        (
            &json!("javascript"),
            &json!(["js", "node"]),
            &json!("kernel"),
            &json!("/usr/bin/node")
        ),
        "{r}"
    );
    assert!(first["version"].as_str().unwrap().starts_with("18."), "{r}");
    let names: Vec<&str> = runtimes.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(
        names,
        ["javascript", "python", "shell", "typescript"],
        "{r}"
    );
    let ts = &runtimes[3];
    assert_eq!(
        (&ts["aliases"], &ts["run"], &ts["dialect"], &ts["version"]),
        (
            &json!(["ts"]),
            &json!("kernel"),
            &json!(1),
            &first["version"]
        ),
        "{r}"
    );
}

// ---- session cells

fn session(s: &TestServer) -> String {
    let (status, r) = s.post("/v1/sessions", &json!({"template": "node"}));
    assert_eq!(status, 201, "{r}");
    r["id"].as_str().expect("id").to_owned()
}

fn cell(s: &TestServer, id: &str, body: Value) -> Value {
    let (status, r) = s.post(&format!("/v1/sessions/{id}/exec"), &body);
    assert_eq!(status, 200, "{r}");
    r
}

fn shown(r: &Value) -> &Value {
    &r["result"]["text/plain"]
}

#[test]
fn cells_keep_variables_functions_and_modules_and_show_the_last_value() {
    let s = node();
    let id = session(&s);

    let first = cell(
        &s,
        &id,
        json!({"code": "const xs = [1, 2, 3];\nfunction double(v) { return v * 2; }\nconst path = require('path');\nconsole.log(xs.length)"}),
    );
    let second = cell(
        &s,
        &id,
        json!({"code": "xs.map(double).concat(path.basename('/a/b.txt'))"}),
    );
    let again = cell(&s, &id, json!({"code": "const xs = 'redeclared'; xs"}));
    let awaited = cell(
        &s,
        &id,
        json!({"code": "const v = await new Promise((r) => setTimeout(() => r(6 * 7), 20));\nv"}),
    );
    let later = cell(&s, &id, json!({"code": "v + 1"}));

    assert_eq!(
        (&first["status"], &first["stdout"], shown(&first)),
        (&json!("ok"), &json!("3\n"), &Value::Null),
        "{first}"
    );
    assert_eq!(shown(&second), &json!("[ 2, 4, 6, 'b.txt' ]"), "{second}");
    assert_eq!(shown(&again), &json!("'redeclared'"), "{again}");
    assert_eq!(shown(&awaited), &json!("42"), "{awaited}");
    assert_eq!(shown(&later), &json!("43"), "{later}");
}

#[test]
fn typescript_jobs_lose_their_types_keep_their_lines_and_import_modules() {
    let s = node();

    let ran = js(
        &s,
        json!({"language": "ts", "args": ["a"],
               "code": "import * as path from 'path';\ninterface P { n: number }\nenum E { A, B }\nconst p: P = { n: E.B };\nconsole.log(path.join('x', process.argv[1]), p.n as number);"}),
    );
    let thrown = js(
        &s,
        json!({"language": "typescript",
               "code": "function f(a: number): never {\n  throw new Error(`no ${a}`);\n}\nf(7);"}),
    );
    let bad = js(&s, json!({"language": "ts", "code": "let n: number = ;"}));

    assert_eq!(
        outcome(&ran),
        (&json!("ok"), &json!(0), &json!("x/a 1\n"), &json!("")),
        "{ran}"
    );
    assert_eq!(
        (&thrown["status"], &thrown["exit_code"]),
        (&json!("error"), &json!(1)),
        "{thrown}"
    );
    let stderr = thrown["stderr"].as_str().unwrap();
    assert!(
        stderr.starts_with("[eval]:2\n")
            && stderr.contains("Error: no 7\n    at f ([eval]:2:9)\n    at [eval]:4:1\n"),
        "{thrown}"
    );
    assert_eq!(
        outcome(&bad),
        (
            &json!("error"),
            &json!(1),
            &json!(""),
            &json!(format!(
                "[eval]:1\nlet n: number = ;\n                ^\n\nSyntaxError: Unexpected token (1:17)\n    at [eval]:1:17\n\nNode.js {}\n",
                node_version(&s)
            ))
        ),
        "{bad}"
    );
}

#[test]
fn typescript_cells_and_javascript_imports_keep_their_names_for_the_next_cells() {
    let s = node();
    let (status, r) = s.post(
        "/v1/sessions",
        &json!({"template": "node", "language": "typescript"}),
    );
    assert_eq!(status, 201, "{r}");
    assert_eq!(r["language"], json!("typescript"), "{r}");
    let id = r["id"].as_str().expect("id").to_owned();

    let first = cell(
        &s,
        &id,
        json!({"code": "import * as path from 'path';\nimport type { Stats } from 'fs';\nclass K { constructor(public n: number) {} }\nconst k: K = new K(2);"}),
    );
    let second = cell(&s, &id, json!({"code": "path.basename('/a/b') + k.n"}));
    let in_js = cell(
        &s,
        &id,
        json!({"language": "js", "code": "import { join as j } from 'path';\nimport fs from 'fs';\n[j('a', 'b'), typeof fs.readFileSync, k.n]"}),
    );
    let bad = cell(&s, &id, json!({"code": "let q: = 1"}));

    assert_eq!(
        (&first["status"], shown(&first)),
        (&json!("ok"), &Value::Null),
        "{first}"
    );
    assert_eq!(shown(&second), &json!("'b2'"), "{second}");
    assert_eq!(shown(&in_js), &json!("[ 'a/b', 'function', 2 ]"), "{in_js}");
    assert_eq!(
        (&bad["status"], &bad["exit_code"]),
        (&json!("error"), &json!(1)),
        "{bad}"
    );
    assert!(
        bad["stderr"]
            .as_str()
            .unwrap()
            .contains("SyntaxError: Unexpected token (1:8)"),
        "{bad}"
    );
}

#[test]
fn a_cells_error_comes_back_with_its_name_and_the_session_goes_on() {
    let s = node();
    let id = session(&s);

    let failed = cell(&s, &id, json!({"code": "let n = 1;\nnull.x"}));
    let next = cell(&s, &id, json!({"code": "n + 1"}));

    assert_eq!(
        (&failed["status"], &failed["exit_code"]),
        (&json!("error"), &json!(1)),
        "{failed}"
    );
    let stderr = failed["stderr"].as_str().unwrap();
    assert!(
        stderr.contains("TypeError: Cannot read properties of null (reading 'x')")
            && stderr.contains("[cell]:2:"),
        "{failed}"
    );
    assert!(!stderr.contains("kernel.js"), "{failed}");
    assert_eq!(shown(&next), &json!("2"), "{next}");
}

#[test]
fn a_cell_past_its_timeout_is_interrupted_and_the_session_goes_on() {
    let s = node();
    let id = session(&s);
    cell(&s, &id, json!({"code": "let count = 0"}));

    let looping = cell(
        &s,
        &id,
        json!({"code": "while (true) { count += 1; }", "timeout_ms": 1500}),
    );
    let after_loop = cell(&s, &id, json!({"code": "count > 0"}));
    let waiting = cell(
        &s,
        &id,
        json!({"code": "count = -1;\nawait new Promise((r) => setTimeout(r, 600000))", "timeout_ms": 1500}),
    );
    let after_wait = cell(&s, &id, json!({"code": "count"}));
    let shown_session: Value = s.get(&format!("/v1/sessions/{id}")).json().unwrap();

    for r in [&looping, &waiting] {
        assert_eq!(
            (&r["status"], &r["stderr"]),
            (
                &json!("timeout"),
                &json!(format!(
                    "Error: Script execution was interrupted by `SIGINT`\n\nNode.js {}\n",
                    node_version(&s)
                ))
            ),
            "{r}"
        );
    }
    assert_eq!(shown(&after_loop), &json!("true"), "{after_loop}");
    assert_eq!(shown(&after_wait), &json!("-1"), "{after_wait}");
    assert_eq!(shown_session["state"], json!("running"), "{shown_session}");
}

#[test]
fn javascript_and_python_cells_share_the_sessions_files() {
    let s = node();
    let id = session(&s);

    let js_write = cell(
        &s,
        &id,
        json!({"code": "require('fs').writeFileSync('/tmp/shared.txt', 'from js'); 'written'"}),
    );
    let py = cell(
        &s,
        &id,
        json!({"language": "python", "code": "open('/tmp/shared.txt').read()"}),
    );
    let js_read = cell(
        &s,
        &id,
        json!({"code": "require('fs').readFileSync('/tmp/shared.txt', 'utf8')"}),
    );

    assert_eq!(shown(&js_write), &json!("'written'"), "{js_write}");
    assert_eq!(shown(&py), &json!("'from js'"), "{py}");
    assert_eq!(shown(&js_read), &json!("'from js'"), "{js_read}");
}

#[test]
fn sessions_get_their_own_javascript_randomness_whichever_runtime_ran_first() {
    let s = node();
    let mut seen = BTreeSet::new();

    for python_first in [false, false, true, true] {
        let id = session(&s);
        if python_first {
            cell(&s, &id, json!({"language": "python", "code": "1"}));
        }
        let r = cell(
            &s,
            &id,
            json!({"code": "[Math.random(), require('crypto').randomBytes(8).toString('hex')].join(' ')"}),
        );
        let text = shown(&r)
            .as_str()
            .unwrap_or_else(|| panic!("{r}"))
            .to_owned();
        for part in text.trim_matches('\'').split(' ') {
            assert!(seen.insert(part.to_owned()), "{part} seen twice: {r}");
        }
    }

    assert_eq!(seen.len(), 8);
}

// ---- real clients

#[test]
fn e2b_code_interpreter_and_piston_clients_run_javascript() {
    let s = node();

    let seen = client_script(
        "e2b_javascript.py",
        &[&s.url("/api/v2/piston/")],
        &e2b_env(&s, "e2b_any"),
    );

    assert_eq!(seen["first"], json!("42"), "{seen}");
    assert_eq!(seen["stateful"], json!("82"), "{seen}");
    assert_eq!(
        seen["logs"],
        json!([["out\n"], ["err\n"], "done"]),
        "{seen}"
    );
    // E2B shows a string value as its text, without quotes.
    assert_eq!(seen["awaited"], json!("later"), "{seen}");
    assert_eq!(
        seen["error"],
        json!(["TypeError", "Cannot read properties of null (reading 'x')"]),
        "{seen}"
    );
    assert_eq!(seen["after_error"], json!("41"), "{seen}");
    assert_eq!(seen["context_language"], json!("javascript"), "{seen}");
    assert_eq!(seen["context_isolated"], json!("undefined"), "{seen}");
    assert_eq!(seen["context_state"], json!("in context"), "{seen}");
    assert_eq!(seen["default_untouched"], json!("undefined"), "{seen}");
    assert_eq!(seen["python_beside"], json!("42"), "{seen}");
    assert_eq!(seen["typescript"], json!(["42", null]), "{seen}");
    assert_eq!(
        seen["typescript_error"],
        json!(["SyntaxError", "Unexpected token (1:8)"]),
        "{seen}"
    );
    assert_eq!(seen["ts_context_language"], json!("typescript"), "{seen}");
    assert_eq!(seen["ts_context_state"], json!("Green"), "{seen}");
    assert_eq!(
        seen["piston_runtime"],
        json!([
            "javascript",
            ["javascript", "js", "node", "node-javascript", "node-js"],
            "18."
        ]),
        "{seen}"
    );
    assert_eq!(seen["piston_run"], json!(["a|b c PIPED IN\n", 3]), "{seen}");
    assert_eq!(seen["piston_ts"], json!(["typescript", "2\n", 0]), "{seen}");
}
