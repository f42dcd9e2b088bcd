//! bud's API on loopback over the test engine ([`crate::core::engine::fake`]): the whole
//! router ([`crate::app`]), the accept loop and its timeouts, the shutdown ([`crate::serve`])
//! and a real HTTP client, with no VM and no `/dev/kvm`. These are the server's policies as
//! a client sees them (statuses, codes, fields, headers, metrics): request validation,
//! admission and quotas, the audit gate, session caps, queueing, expiry, drain, shutdown.
//!
//! A job's code is the fake guest's command (`hang`, `wait NAME`, `exit N`; anything else
//! is echoed as its stdout). What only a real guest can show stays in `server/tests/`.

mod admission;
mod conn;
mod javascript;
mod network;
mod requests;
mod sessions;
mod templates;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::core::config::Config;
use crate::core::engine::fake::FakeEngine;
use crate::core::state::{AppState, TemplateInfo};

/// Longest a test waits for something that must happen.
const PATIENCE: Duration = Duration::from_secs(10);

/// The configuration of these tests unless one needs another: two job threads, room for
/// 16 more jobs (the guest-bound tests' own).
fn test_config() -> Config {
    Config {
        workers: 2,
        queue: 16,
        ..Config::default()
    }
}

/// A server on 127.0.0.1:0 over a fake engine, serving until [`Served::shutdown`] (or the
/// end of the test's runtime).
struct Served {
    addr: SocketAddr,
    state: AppState,
    engine: FakeEngine,
    stop: Option<oneshot::Sender<()>>,
    serving: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    client: reqwest::Client,
}

impl Served {
    async fn start() -> Self {
        Self::with_config(test_config()).await
    }

    /// Every template of `config.templates` served by one fake engine.
    async fn with_config(config: Config) -> Self {
        let all = config.templates.clone();
        let ready: Vec<&str> = all.iter().map(String::as_str).collect();
        Self::with_templates(config, &ready).await
    }

    /// Only the templates in `ready` served (the others stay `building`).
    async fn with_templates(config: Config, ready: &[&str]) -> Self {
        Self::on(config, ready, FakeEngine::new()).await
    }

    /// Every template of `config.templates` served by `engine`.
    async fn with_engine(config: Config, engine: FakeEngine) -> Self {
        let all = config.templates.clone();
        let ready: Vec<&str> = all.iter().map(String::as_str).collect();
        Self::on(config, &ready, engine).await
    }

    async fn on(config: Config, ready: &[&str], engine: FakeEngine) -> Self {
        let state = AppState::new(config, None).expect("a state");
        for name in ready {
            let e = std::sync::Arc::new(engine.clone());
            assert!(state.set_engine(name, e, TemplateInfo::default()));
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("an address");
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = tokio::spawn(crate::serve(listener, state.clone(), async {
            let _ = stopped.await;
        }));
        // A connection per request, as the guest-bound tests' clients make.
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(60))
            .build()
            .expect("an HTTP client");
        Self {
            addr,
            state,
            engine,
            stop: Some(stop),
            serving: Some(serving),
            client,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// POSTs `body` as JSON with API key `key` (if any): the status and the JSON answer.
    async fn post_as(&self, key: Option<&str>, path: &str, body: &Value) -> (u16, Value) {
        let mut req = self.client.post(self.url(path)).json(body);
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        answer(req.send().await.expect("request failed")).await
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_as(None, path, body).await
    }

    /// POSTs raw bytes with a content type.
    async fn post_raw(&self, path: &str, ctype: &str, body: Vec<u8>) -> (u16, Value) {
        let req = self
            .client
            .post(self.url(path))
            .header("content-type", ctype);
        answer(req.body(body).send().await.expect("request failed")).await
    }

    async fn exec(&self, body: Value) -> (u16, Value) {
        self.post("/v1/exec", &body).await
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        answer(
            self.client
                .get(self.url(path))
                .send()
                .await
                .expect("request failed"),
        )
        .await
    }

    /// `/metrics` (with API key `key`, where the server has keys).
    async fn metrics(&self, key: Option<&str>) -> String {
        let mut req = self.client.get(self.url("/metrics"));
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        let r = req.send().await.expect("request failed");
        r.text().await.expect("the metrics")
    }

    async fn delete(&self, path: &str) -> u16 {
        let r = self.client.delete(self.url(path)).send().await;
        r.expect("request failed").status().as_u16()
    }

    /// A new session (201), its id.
    async fn session(&self, body: Value) -> String {
        let (status, r) = self.post("/v1/sessions", &body).await;
        assert_eq!(status, 201, "{r}");
        r["id"].as_str().expect("an id").to_owned()
    }

    /// Runs a job that echoes `alive` and checks it did: the server still serves.
    async fn assert_still_serving(&self) {
        let (status, r) = self.exec(json!({"code": "alive"})).await;
        assert_eq!((status, &r["stdout"]), (200, &json!("alive")), "{r}");
    }

    /// Starts a graceful shutdown and waits until the server has stopped.
    async fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(serving) = self.serving.take() {
            serving.await.expect("the server task").expect("serving");
        }
    }

    /// A raw HTTP/1.1 request, `head` (request line and headers, each ending CRLF, the
    /// blank line not included) then `body`, on a connection of its own.
    async fn raw(&self, head: &str, body: &[u8]) -> TcpStream {
        let mut c = TcpStream::connect(self.addr).await.expect("connect");
        c.write_all(format!("{head}\r\n").as_bytes())
            .await
            .expect("write the head");
        c.write_all(body).await.expect("write the body");
        c
    }

    /// A raw JSON POST of `body` to `path` with `extra` headers (each ending CRLF).
    async fn raw_post(&self, path: &str, extra: &str, body: &Value) -> TcpStream {
        let body = serde_json::to_vec(body).expect("JSON");
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n{extra}",
            body.len()
        );
        self.raw(&head, &body).await
    }
}

/// A response's status and JSON body (`null` if it has none).
async fn answer(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let bytes = r.bytes().await.expect("the body");
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Everything `c` receives until the server closes it (at most [`PATIENCE`]).
async fn read_all(mut c: TcpStream) -> String {
    let mut all = Vec::new();
    tokio::time::timeout(PATIENCE, c.read_to_end(&mut all))
        .await
        .expect("the server never closed the connection")
        .expect("reading the answer");
    String::from_utf8_lossy(&all).into_owned()
}

/// Polls `check` until it says yes (at most [`PATIENCE`]: past that the test fails,
/// saying what never happened and the last thing seen).
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (bool, String)>,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (done, seen) = check().await;
        if done {
            return;
        }
        assert!(Instant::now() < deadline, "never happened: {what}: {seen}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
