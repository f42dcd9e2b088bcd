//! A real `bud serve` for the tests: the real guest and template (built once under
//! `<repo>/build`, reused after), one executor per test binary, and per test a server on
//! 127.0.0.1 with port 0 (real TCP) driven by a real HTTP client (reqwest).
//!
//! These tests need /dev/kvm. They never skip silently: without it they fail saying so.
#![allow(dead_code)]

pub mod clients;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use bud_server::{AppState, Config, Limits};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use vmm::Executor;

pub fn repo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("server/ has a parent")
        .to_path_buf()
}

/// An empty directory `target/tmp/AREA/NAME-PID` of a test's own (emptied if a run before
/// left it).
pub fn empty_dir(area: &str, name: &str) -> PathBuf {
    let d = repo_dir()
        .join("target/tmp")
        .join(area)
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "\n\n*** THIS TEST NEEDS /dev/kvm AND THIS MACHINE HAS NONE: IT CANNOT RUN HERE ***\n\n"
    );
}

/// The options of template `name` in this source tree (its guest brought up to date).
pub fn template_options(name: &str) -> bud_templates::TemplateOptions {
    let mut opts = bud_templates::TemplateOptions::named(repo_dir(), name);
    opts.guest = bud_templates::GuestBuild::Current;
    opts
}

/// One executor over template `name` for this test binary (built or loaded on first use;
/// the first build of the datascience template boots its guest: minutes). Made once per
/// binary: a failure is remembered, and every later test that needs the template fails
/// with that first cause instead of building again.
pub fn executor_of(name: &str) -> Arc<Executor> {
    /// Each template's executor, or why it could not be made.
    type Made = BTreeMap<String, Result<Arc<Executor>, String>>;
    static EXECS: OnceLock<Mutex<Made>> = OnceLock::new();
    let mut all = EXECS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let made = all.entry(name.to_owned()).or_insert_with(|| {
        require_kvm();
        let template = bud_templates::template(
            &template_options(name),
            &mut |line: &str| eprintln!("[guest build {name}] {line}"),
            None,
        )
        .map_err(|e| format!("building the guest or template {name}: {}", error_chain(&e)))?;
        Executor::new(template, vmm::ExecutorOptions::default())
            .map(Arc::new)
            .map_err(|e| format!("starting the executor of {name}: {}", error_chain(&e)))
    });
    match made {
        Ok(e) => e.clone(),
        Err(e) => panic!("{e} (failed once for this test binary; not retried)"),
    }
}

/// An error with its chain of causes.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// One executor over the default template for this test binary.
pub fn executor() -> Arc<Executor> {
    executor_of("python")
}

/// The session key the nodes of a test share (hex, 32 bytes): what `--session-key-file`
/// would hold on both servers of an export and an import.
pub const SHARED_SESSION_KEY: &str =
    "b0d5e551011f11e5b0d5e551011f11e5b0d5e551011f11e5b0d5e551011f11e5";

/// A key file holding [`SHARED_SESSION_KEY`] (under `target/tmp/keys`, written once per
/// test binary).
pub fn shared_key_file() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = empty_dir("keys", "shared").join("session.keys");
        std::fs::write(&path, format!("{SHARED_SESSION_KEY}\n")).unwrap();
        path
    })
    .clone()
}

/// The configuration the tests use unless they need another: defaults, two job threads.
/// The tests' server: two job threads, and jobs that give no `timeout_ms` get the longest
/// one the server allows (60 s), not the 10 s default. Guest-kernel work runs emulated on
/// kvm_pvm at a speed that varies with the machine's load: on 2026-11-28 a shell job of
/// 2.8 M emulated instructions took 10.1 s with builds beside the tests (0.28 M/s) and
/// failed a test of args and stdin at the 10 s default. Tests of timeouts give their own.
pub fn test_config() -> Config {
    let max = Limits::default().max_timeout_ms;
    Config {
        workers: 2,
        queue: 16,
        limits: Limits {
            default_timeout_ms: max,
            ..Limits::default()
        },
        ..Config::default()
    }
}

/// Where a test server's added templates (`PUT /v1/templates/{name}`) come from: this
/// source tree's, as `bud serve` gets them (an added one only if its guest is built).
pub fn template_source() -> bud_server::TemplateSource {
    use bud_server::core::state::{Moment, SourceError, TemplateInfo};
    Arc::new(|name: &str, moment: Moment| {
        let mut opts = template_options(name);
        if moment == Moment::Added {
            opts.guest = bud_templates::GuestBuild::Built;
        }
        let template = bud_templates::template(&opts, &mut |_| {}, None).map_err(|e| match e {
            e @ bud_templates::TemplateSetupError::NotBuilt(_) => {
                SourceError::NotFound(e.to_string())
            }
            e => SourceError::Failed(e.into()),
        })?;
        let (image_bytes, packages) = bud_templates::image_facts(&opts);
        Ok((
            template,
            TemplateInfo {
                image_bytes,
                packages,
                user: opts.build.layers().ok().flatten().is_some(),
            },
        ))
    })
}

/// A new session of `body` on `s` (201), its id.
pub fn session(s: &TestServer, body: Value) -> String {
    let (status, r) = s.post("/v1/sessions", &body);
    assert_eq!(status, 201, "{r}");
    r["id"].as_str().unwrap().to_owned()
}

/// Runs `code` in session `id`; returns its stdout (the cell must succeed: 200 and `ok`).
pub fn cell(s: &TestServer, id: &str, code: &str) -> String {
    let (status, r) = s.post(&format!("/v1/sessions/{id}/exec"), &json!({"code": code}));
    assert_eq!((status, &r["status"]), (200, &json!("ok")), "{r}");
    r["stdout"].as_str().unwrap().to_owned()
}

/// `GET /v1/sessions/{id}`: its status and body.
pub fn show(s: &TestServer, id: &str) -> (u16, Value) {
    let r = s.get(&format!("/v1/sessions/{id}"));
    let status = r.status().as_u16();
    (status, r.json().unwrap())
}

/// A server on 127.0.0.1:0, stopped (gracefully, joined) on drop.
pub struct TestServer {
    pub addr: SocketAddr,
    pub state: AppState,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl TestServer {
    pub fn start() -> Self {
        Self::with_config(test_config())
    }

    /// A server with every template of `config.templates` ready.
    pub fn with_config(config: Config) -> Self {
        let all = config.templates.clone();
        let ready: Vec<&str> = all.iter().map(String::as_str).collect();
        Self::with_templates(config, &ready)
    }

    /// A server on which only the templates in `ready` are ready (the others stay
    /// `building`).
    pub fn with_templates(config: Config, ready: &[&str]) -> Self {
        // The executors first: on a fresh build one builds the image whose facts follow.
        let executors: Vec<(&str, Arc<Executor>)> = ready
            .iter()
            .map(|name| (*name, executor_of(name)))
            .collect();
        Self::with_executors(config, &executors)
    }

    /// A server whose templates `ready` are served by these executors.
    pub fn with_executors(config: Config, ready: &[(&str, Arc<Executor>)]) -> Self {
        let state = AppState::new(config, None).expect("server state");
        state.set_template_source(template_source());
        for (name, executor) in ready {
            let (image_bytes, packages) = bud_templates::image_facts(&template_options(name));
            let info = bud_server::core::state::TemplateInfo {
                image_bytes,
                packages,
                user: false,
            };
            assert!(state.set_template(name, executor.clone(), info));
        }
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let served = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind 127.0.0.1:0");
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                bud_server::serve(listener, served, async {
                    let _ = stopped.await;
                })
                .await
                .expect("serving failed");
            });
        });
        let addr = addr_rx.recv().expect("the server did not start");
        Self {
            addr,
            state,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Starts a graceful shutdown and waits for the server to finish.
    pub fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            t.join().expect("the server thread panicked");
        }
    }

    /// POSTs `body` as JSON; returns the status and the JSON answer.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = client()
            .post(self.url(path))
            .json(body)
            .send()
            .expect("request failed");
        let status = r.status().as_u16();
        (status, r.json().expect("the answer is not JSON"))
    }

    /// POSTs raw bytes with a content type.
    pub fn post_raw(&self, path: &str, ctype: &str, body: Vec<u8>) -> (u16, Value) {
        let r = client()
            .post(self.url(path))
            .header("content-type", ctype)
            .body(body)
            .send()
            .expect("request failed");
        let status = r.status().as_u16();
        (status, r.json().expect("the answer is not JSON"))
    }

    pub fn exec(&self, body: Value) -> (u16, Value) {
        self.post("/v1/exec", &body)
    }

    /// Runs `print('alive')` and checks it worked: the server still serves.
    pub fn assert_still_serving(&self) {
        let (status, r) = self.exec(json!({"code": "print('alive')"}));
        assert_eq!((status, &r["stdout"]), (200, &json!("alive\n")), "{r}");
    }

    /// DELETEs `path`; returns the status.
    pub fn delete(&self, path: &str) -> u16 {
        client()
            .delete(self.url(path))
            .send()
            .expect("request failed")
            .status()
            .as_u16()
    }

    pub fn get(&self, path: &str) -> reqwest::blocking::Response {
        client().get(self.url(path)).send().expect("request failed")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A blocking client with a generous timeout (the machine is shared and slow).
pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("http client")
}
