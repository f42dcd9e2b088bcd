//! A real `bud serve` process for the tests that need one whole (the jail, a crash): on a
//! free port, with a state directory of its own under `target/tmp/` unless the test gives
//! one, its log echoed to the test's stderr and kept for the test to read.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The server process; SIGTERM and wait on drop.
pub struct Served {
    pub child: Child,
    pub base: String,
    /// Its log lines (also echoed to the test's stderr).
    pub log: mpsc::Receiver<String>,
    pub port: u16,
}

impl Served {
    /// Waits until the server answers jobs, jailed (first use may build: minutes); fails
    /// if it exits first.
    pub fn wait_ready(&mut self) {
        let until = Instant::now() + Duration::from_secs(1800);
        loop {
            assert!(Instant::now() < until, "bud serve never became ready");
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("bud serve exited: {status}");
            }
            let health = ureq::get(&format!("{}/v1/health", self.base))
                .timeout(Duration::from_secs(120))
                .call()
                .ok()
                .and_then(|r| r.into_json::<serde_json::Value>().ok());
            if let Some(h) = health
                && h["template_ready"] == true
                && h["jailed"] == true
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        // SAFETY: kill on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// `bud serve ARGS` on a free port, with a state directory of its own under `target/tmp/`
/// (emptied first) unless `args` give `--state-dir`.
pub fn serve(args: &[&str]) -> Served {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bud"));
    cmd.args(["serve", "--port", &port.to_string(), "--workers", "2"]);
    if !args.contains(&"--state-dir") {
        let dir = own_state_dir(port);
        let _ = std::fs::remove_dir_all(&dir);
        cmd.arg("--state-dir").arg(dir);
    }
    let child = cmd
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines, log) = mpsc::channel();
    let mut s = Served {
        child,
        base: format!("http://127.0.0.1:{port}"),
        log,
        port,
    };
    // Keep the log flowing (and visible on failure) without blocking the server.
    let stderr = s.child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[bud serve] {line}");
            let _ = lines.send(line);
        }
    });
    s
}

/// The state directory [`serve`] gives a server on `port`.
pub fn own_state_dir(port: u16) -> PathBuf {
    super::source_dir().join(format!("target/tmp/served-state/{port}"))
}
