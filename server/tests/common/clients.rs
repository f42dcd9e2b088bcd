//! Other sandboxes' real client libraries for the tests: the E2B SDKs and aiopyston, pinned
//! in `server/tests/compat/requirements.txt`, installed from PyPI into
//! `<repo>/build/compat-venv` by the first test that needs them, and the client scripts of
//! `server/tests/compat/` run with them.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use super::{TestServer, error_chain, repo_dir};

/// The venv with the pinned clients, made once under the build lock (another test binary
/// or process making it is waited for); a failure fails every test that needs it with its
/// cause, once made.
pub fn venv_python() -> PathBuf {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match PYTHON.get_or_init(make_venv) {
        Ok(python) => python.clone(),
        Err(e) => panic!("making the client venv failed: {e}"),
    }
}

fn make_venv() -> Result<PathBuf, String> {
    bud_guest::venv::ensure(
        &repo_dir().join("build"),
        "compat-venv",
        &repo_dir().join("server/tests/compat/requirements.txt"),
        &mut |l| eprintln!("[compat venv] {l}"),
    )
    .map_err(|e| error_chain(&e))
}

/// Runs client script `name` (in `server/tests/compat/`) with `args` and `env`; its
/// stdout's JSON.
pub fn client_script(name: &str, args: &[&str], env: &[(&str, String)]) -> Value {
    let script = repo_dir().join("server/tests/compat").join(name);
    let out = Command::new(venv_python())
        .arg(&script)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        // A crash of the client prints every thread's Python stack on stderr.
        .env("PYTHONFAULTHANDLER", "1")
        .output()
        .expect("starting the client script");
    assert!(
        out.status.success(),
        "{name} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{name} printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The environment that points E2B's SDK at server `s` with API key `key`.
pub fn e2b_env(s: &TestServer, key: &str) -> Vec<(&'static str, String)> {
    vec![
        ("E2B_API_URL", s.url("")),
        ("E2B_SANDBOX_URL", s.url("")),
        ("E2B_API_KEY", key.to_owned()),
    ]
}
