//! The suite's jobs: every test binary of the workspace, built by `cargo test --workspace
//! --no-run` and listed from cargo's JSON messages, the doc tests, and the first-use builds
//! the guest tests share (run by the `bud` binary that same build made; see `hints`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

/// Why the suite could not be built or listed.
#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    #[error("starting cargo")]
    Cargo(#[source] std::io::Error),
    #[error("building the test binaries failed ({0})")]
    Build(std::process::ExitStatus),
    #[error("reading cargo's messages")]
    Messages(#[source] std::io::Error),
    #[error(
        "a binary picked by {0:?} does not exist (the binaries are named by their source paths)"
    )]
    NoSuchBinary(String),
    #[error("writing {0}")]
    Log(PathBuf, #[source] std::io::Error),
    #[error("cargo built no `bud` binary for the tests (its build jobs need one)")]
    NoBud,
}

/// `e` and each of its sources, joined.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// One thing the suite runs: a test binary, or cargo's doc tests.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// The source file it is built from, relative to the workspace (`server/tests/http.rs`),
    /// or `doc tests`.
    pub label: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Where it runs: its package's folder, as `cargo test` runs it.
    pub dir: PathBuf,
    /// The cargo command that runs it alone.
    pub rerun: String,
}

#[cfg(test)]
impl Job {
    /// A job labelled `label` that runs a program of that name in `/w` (for the runner's
    /// tests).
    pub fn named(label: &str) -> Job {
        Job {
            label: label.into(),
            program: label.into(),
            args: vec![],
            dir: "/w".into(),
            rerun: String::new(),
        }
    }
}

/// The workspace this xtask belongs to.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask/ lies in the workspace")
        .to_path_buf()
}

fn cargo() -> PathBuf {
    std::env::var_os("CARGO").map_or_else(|| "cargo".into(), PathBuf::from)
}

/// What the build made: the test binaries and doc tests as jobs, and the `bud` binary.
#[derive(Debug)]
pub struct Built {
    pub jobs: Vec<Job>,
    pub bud: Option<PathBuf>,
}

/// Builds every test binary (cargo's own progress on stderr) and lists them, and the doc
/// tests, as jobs.
pub fn build(root: &Path) -> Result<Built, SuiteError> {
    let mut child = Command::new(cargo())
        .args([
            "test",
            "--workspace",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(root)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(SuiteError::Cargo)?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut jobs = Vec::new();
    let mut bud = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.map_err(SuiteError::Messages)?;
        // Lines that are not JSON objects are build scripts' output: not ours to read.
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if let Some(job) = job_of(root, &message)
            && !jobs.iter().any(|j: &Job| j.program == job.program)
        {
            jobs.push(job);
        }
        if let Some(path) = bud_of(&message) {
            bud = Some(path);
        }
    }
    let status = child.wait().map_err(SuiteError::Cargo)?;
    if !status.success() {
        return Err(SuiteError::Build(status));
    }
    jobs.push(Job {
        label: "doc tests".into(),
        program: cargo(),
        args: vec![
            "test".into(),
            "--workspace".into(),
            "--doc".into(),
            // What the suite passes on goes to the doc tests' harness.
            "--".into(),
        ],
        dir: root.to_path_buf(),
        rerun: "cargo test --workspace --doc".into(),
    });
    Ok(Built { jobs, bud })
}

/// The `bud` executable of a `compiler-artifact` message for it (the binary the integration
/// tests run); `None` for any other message.
fn bud_of(message: &Value) -> Option<PathBuf> {
    let target = &message["target"];
    let is_bud = message["reason"] == "compiler-artifact"
        && message["profile"]["test"] == false
        && target["name"] == "bud"
        && target["kind"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "bin"));
    is_bud.then(|| message["executable"].as_str().map(PathBuf::from))?
}

/// The first-use build jobs (`hints::BUILDS`), each a `bud guest build` run by `bud`.
pub fn build_jobs(root: &Path, bud: &Path) -> Vec<Job> {
    crate::hints::BUILDS
        .iter()
        .map(|&(label, template)| {
            let mut args: Vec<String> = vec!["guest".into(), "build".into()];
            if let Some(name) = template {
                args.extend(["--template".into(), name.into(), "--boot".into()]);
            }
            Job {
                label: label.to_owned(),
                program: bud.to_path_buf(),
                rerun: format!("cargo run -- {}", args.join(" ")),
                args,
                dir: root.to_path_buf(),
            }
        })
        .collect()
}

/// The jobs of a run: with no picks, every binary and the build jobs; with picks, the
/// binaries picked (each builds what it needs itself, as under `cargo test`).
pub fn jobs_of(root: &Path, built: Built, picks: &[String]) -> Result<Vec<Job>, SuiteError> {
    if !picks.is_empty() {
        return pick(built.jobs, picks);
    }
    let bud = built.bud.ok_or(SuiteError::NoBud)?;
    let mut jobs = build_jobs(root, &bud);
    jobs.extend(built.jobs);
    Ok(jobs)
}

/// The job of a `compiler-artifact` message for a test executable; `None` for any other.
fn job_of(root: &Path, message: &Value) -> Option<Job> {
    if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
        return None;
    }
    let program = PathBuf::from(message["executable"].as_str()?);
    let target = &message["target"];
    let src = Path::new(target["src_path"].as_str()?);
    let label = src.strip_prefix(root).unwrap_or(src).display().to_string();
    let dir = Path::new(message["manifest_path"].as_str()?)
        .parent()?
        .to_path_buf();
    let package = package_name(message["package_id"].as_str()?);
    let name = target["name"].as_str()?;
    let kinds: Vec<&str> = target["kind"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let selector = if kinds.contains(&"test") {
        format!("--test {name}")
    } else if kinds.contains(&"bin") {
        format!("--bin {name}")
    } else {
        "--lib".to_owned()
    };
    Some(Job {
        label,
        program,
        args: Vec::new(),
        dir,
        rerun: format!("cargo test -p {package} {selector}"),
    })
}

/// A package's name from cargo's package id: `path+file:///w/server#bud-server@0.1.0`, or
/// `path+file:///w/vmm#0.1.0` where the name is the folder's.
fn package_name(id: &str) -> String {
    let (url, fragment) = id.split_once('#').unwrap_or((id, ""));
    match fragment.split_once('@') {
        Some((name, _)) => name.to_owned(),
        None => url.rsplit('/').next().unwrap_or(url).to_owned(),
    }
}

/// The jobs whose label contains one of `picks` (all of them without picks); a pick that
/// matches none is an error.
pub fn pick(jobs: Vec<Job>, picks: &[String]) -> Result<Vec<Job>, SuiteError> {
    if picks.is_empty() {
        return Ok(jobs);
    }
    if let Some(missing) = picks
        .iter()
        .find(|p| !jobs.iter().any(|j| j.label.contains(p.as_str())))
    {
        return Err(SuiteError::NoSuchBinary(missing.clone()));
    }
    Ok(jobs
        .into_iter()
        .filter(|j| picks.iter().any(|p| j.label.contains(p.as_str())))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_test_artifact_becomes_a_job_run_in_its_package_folder() {
        let root = Path::new("/w");
        let message = json!({
            "reason": "compiler-artifact",
            "package_id": "path+file:///w/server#bud-server@0.1.0",
            "manifest_path": "/w/server/Cargo.toml",
            "target": {"kind": ["test"], "name": "http", "src_path": "/w/server/tests/http.rs"},
            "profile": {"test": true},
            "executable": "/w/target/debug/deps/http-0123"
        });
        assert_eq!(
            job_of(root, &message),
            Some(Job {
                label: "server/tests/http.rs".into(),
                program: "/w/target/debug/deps/http-0123".into(),
                args: vec![],
                dir: "/w/server".into(),
                rerun: "cargo test -p bud-server --test http".into(),
            })
        );
        let unit = json!({
            "reason": "compiler-artifact",
            "package_id": "path+file:///w/vmm#0.1.0",
            "manifest_path": "/w/vmm/Cargo.toml",
            "target": {"kind": ["lib"], "name": "vmm", "src_path": "/w/vmm/src/lib.rs"},
            "profile": {"test": true},
            "executable": "/w/target/debug/deps/vmm-4567"
        });
        let job = job_of(root, &unit).unwrap();
        assert_eq!(job.label, "vmm/src/lib.rs");
        assert_eq!(job.rerun, "cargo test -p vmm --lib");
    }

    #[test]
    fn libraries_built_for_the_tests_and_other_messages_are_not_jobs() {
        let root = Path::new("/w");
        let library = json!({
            "reason": "compiler-artifact",
            "package_id": "path+file:///w/vmm#0.1.0",
            "manifest_path": "/w/vmm/Cargo.toml",
            "target": {"kind": ["lib"], "name": "vmm", "src_path": "/w/vmm/src/lib.rs"},
            "profile": {"test": false},
            "executable": null
        });
        assert_eq!(job_of(root, &library), None);
        assert_eq!(job_of(root, &json!({"reason": "build-finished"})), None);
    }

    #[test]
    fn picks_select_by_source_path_and_an_unknown_pick_is_refused() {
        let job = Job::named;
        let jobs = vec![job("server/tests/http.rs"), job("tests/compat.rs")];
        let picked = pick(jobs.clone(), &["http".into()]).unwrap();
        assert_eq!(picked, vec![job("server/tests/http.rs")]);
        assert_eq!(pick(jobs.clone(), &[]).unwrap(), jobs);
        assert!(matches!(
            pick(jobs, &["nope".into()]),
            Err(SuiteError::NoSuchBinary(p)) if p == "nope"
        ));
    }

    #[test]
    fn the_bud_binary_is_found_and_its_builds_become_jobs_that_lead_a_whole_run() {
        let bin = json!({
            "reason": "compiler-artifact",
            "package_id": "path+file:///w#bud@0.1.0",
            "manifest_path": "/w/Cargo.toml",
            "target": {"kind": ["bin"], "name": "bud", "src_path": "/w/src/main.rs"},
            "profile": {"test": false},
            "executable": "/w/target/debug/bud"
        });
        assert_eq!(bud_of(&bin), Some(PathBuf::from("/w/target/debug/bud")));
        let mut its_tests = bin.clone();
        its_tests["profile"]["test"] = json!(true);
        assert_eq!(bud_of(&its_tests), None);

        let root = Path::new("/w");
        let test = Job {
            label: "tests/jobs.rs".into(),
            program: "/w/target/debug/deps/jobs-1".into(),
            args: vec![],
            dir: "/w".into(),
            rerun: String::new(),
        };
        let built = || Built {
            jobs: vec![test.clone()],
            bud: Some("/w/target/debug/bud".into()),
        };
        let all = jobs_of(root, built(), &[]).unwrap();
        let labels: Vec<&str> = all.iter().map(|j| j.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                crate::hints::GUEST,
                crate::hints::PYTHON,
                crate::hints::DATASCIENCE,
                crate::hints::TOOLS,
                crate::hints::NODE,
                "tests/jobs.rs"
            ]
        );
        assert_eq!(all[0].args, ["guest", "build"]);
        assert_eq!(
            all[2].args,
            ["guest", "build", "--template", "datascience", "--boot"]
        );
        assert_eq!(all[2].program, PathBuf::from("/w/target/debug/bud"));
        // A pick runs the binaries picked and no build job.
        assert_eq!(jobs_of(root, built(), &["jobs".into()]).unwrap(), [test]);
        assert!(matches!(
            jobs_of(
                root,
                Built {
                    jobs: vec![],
                    bud: None
                },
                &[]
            ),
            Err(SuiteError::NoBud)
        ));
    }
}
