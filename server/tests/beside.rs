//! Requests beside a running cell ([`vmm::beside`]) against a real server on loopback, over
//! the real template on the real VMM: through bud's native API (a process started, fed and
//! read to its end while a cell runs) and through E2B's SDKs, sync and async
//! (`compat/e2b_beside.py`: files, commands, a background command and a watcher while a
//! cell runs). Every cell waits for a file the client writes last, so a request that
//! waited for the cell's end would hang it. Needs /dev/kvm (and PyPI for the SDK's venv).

mod common;

use std::io::{BufRead, BufReader};

use common::clients::{client_script, e2b_env};
use common::*;
use serde_json::{Value, json};

#[test]
fn a_process_runs_to_its_end_beside_a_cell_through_the_native_api() {
    let s = TestServer::start();
    let (status, r) = s.post("/v1/sessions", &json!({}));
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    let url = s.url(&format!("/v1/sessions/{id}/exec"));
    let cell = std::thread::spawn(move || {
        let code = "import os, time\nopen('started', 'w').close()\n\
                    while not os.path.exists('go'):\n    time.sleep(0.02)\n'cell done'";
        let r = client()
            .post(url)
            .json(&json!({"code": code, "timeout_ms": 60_000}))
            .send()
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().unwrap())
    });
    let started = s.url(&format!("/v1/sessions/{id}/files/started"));
    for _ in 0..2000 {
        if client().get(&started).send().unwrap().status() == 200 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    let (status, p) = s.post(
        &format!("/v1/sessions/{id}/processes"),
        &json!({"command": "read x; echo \"got $x\"; exit 5", "stdin": true}),
    );
    assert_eq!(status, 201, "{p}");
    let pid = p["pid"].as_u64().unwrap();
    let r = client()
        .post(s.url(&format!("/v1/sessions/{id}/processes/{pid}/stdin")))
        .json(&json!({"data": "beside\n", "close": true}))
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let body = r.text().unwrap();
    if status != 204 {
        // Seen once in CI (409 stdin_closed): the process's record (how it ended, if it
        // did) goes with the failure. Not its output stream: that ends only with it.
        std::thread::sleep(std::time::Duration::from_secs(2));
        let processes = s.get(&format!("/v1/sessions/{id}/processes")).text();
        panic!("stdin: {status} {body}\nthe session's processes: {processes:?}");
    }
    let stream = client()
        .get(s.url(&format!("/v1/sessions/{id}/processes/{pid}/output")))
        .send()
        .unwrap();
    let lines: Vec<Value> = BufReader::new(stream)
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    let info: Value = s.get(&format!("/v1/sessions/{id}")).json().unwrap();
    assert_eq!(info["busy"], json!(true), "the cell ended early: {info}");
    let put = client()
        .put(s.url(&format!("/v1/sessions/{id}/files/go")))
        .body("")
        .send()
        .unwrap();
    assert_eq!(put.status().as_u16(), 204);
    let (status, done) = cell.join().unwrap();

    assert_eq!(
        lines.first(),
        Some(&json!({"type": "stdout", "data": "got beside\n"}))
    );
    let end = lines.last().unwrap();
    assert_eq!(
        (&end["type"], &end["status"], &end["exit_code"]),
        (&json!("end"), &json!("exited"), &json!(5)),
        "{lines:?}"
    );
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["result"]["text/plain"], json!("'cell done'"), "{done}");
    s.assert_still_serving();
}

#[test]
fn the_e2b_sdks_use_files_commands_and_watchers_while_a_cell_runs() {
    let s = TestServer::start();
    let seen = client_script("e2b_beside.py", &[], &e2b_env(&s, "e2b_any"));
    assert_eq!(
        seen,
        json!({
            "read": "written beside a cell",
            "listed": ["a.txt"],
            "info_owner": "user",
            "command": ["42 as user in /home/user\n", 0],
            "background": "from the background\n",
            "watched": true,
            "cell_still_running": true,
            "cell": {"stdout": ["cell saw go\n"], "error": null},
            "async": {
                "read": "async beside",
                "command": "async beside\n",
                "cell_still_running": true,
                "cell": ["cell saw async go\n"],
            },
        })
    );
    s.assert_still_serving();
}
