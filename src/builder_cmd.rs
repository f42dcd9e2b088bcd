//! `bud template builder`: the helper process that builds user templates for `bud serve`
//! (`bud_server::core::builds` says why a helper, and the protocol: one JSON request a line
//! on stdin, JSON reports a line on stdout). Each build is a child process of its own,
//! `bud template build FILE`, in a process group of its own, so that the build time limit
//! stops it and everything it started. The helper ends when its stdin closes (the server
//! stopped), stopping the builds in flight.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bud_server::core::builds::{Report, ReportKind, Request};

use crate::Cli;

/// What a build is allowed (the server's `--template-build-*` options).
#[derive(Debug, Clone, clap::Args)]
pub struct BuilderArgs {
    /// Stop a build after this many seconds.
    #[arg(long, default_value_t = 1800)]
    timeout_s: u64,
    /// Refuse an image larger than this, in MiB.
    #[arg(long, default_value_t = 1024)]
    max_image_mib: u64,
    /// Build templates with a network card (the server's `--network`).
    #[arg(long)]
    network: bool,
}

type Out = Arc<Mutex<std::io::Stdout>>;

fn report(out: &Out, id: u64, what: ReportKind) {
    let line = serde_json::to_string(&Report { id, what }).unwrap_or_default();
    let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

pub fn builder(cli: &Cli, args: &BuilderArgs) -> anyhow::Result<ExitCode> {
    let out: Out = Arc::new(Mutex::new(std::io::stdout()));
    let incoming = cli
        .build_options()
        .build_dir
        .join(bud_guest::user::DIR)
        .join("incoming");
    std::fs::create_dir_all(&incoming)
        .with_context(|| format!("creating {}", incoming.display()))?;
    let children: Arc<Mutex<Vec<i32>>> = Arc::default();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let request: Request = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("bud template builder: a request that is not one: {e}");
                continue;
            }
        };
        let (out, args, children) = (out.clone(), args.clone(), children.clone());
        // This very binary, even if a newer one replaced its file since (a rebuild, an
        // upgrade): the build speaks the protocol this helper speaks.
        let exe = PathBuf::from("/proc/self/exe");
        let (source, build) = (cli.source_dir.clone(), cli.build_options().build_dir);
        let file = incoming.join(format!("{}-{}.json", std::process::id(), request.id));
        std::thread::spawn(move || {
            let id = request.id;
            let result = run_one(
                &exe, &source, &build, &file, &request, &args, &out, &children,
            );
            let _ = std::fs::remove_file(&file);
            report(&out, id, ReportKind::Done(result));
        });
    }
    // The server is gone: so are its builds.
    for pgid in children.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        // SAFETY: kill(2) with a negative pid signals that process group; no memory is
        // involved, and a group that is gone already only makes it fail with ESRCH.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    Ok(ExitCode::SUCCESS)
}

/// One build in a child process; `Ok` once it built and stored the template.
#[allow(clippy::too_many_arguments)]
fn run_one(
    exe: &PathBuf,
    source: &PathBuf,
    build: &PathBuf,
    file: &PathBuf,
    request: &Request,
    args: &BuilderArgs,
    out: &Out,
    children: &Mutex<Vec<i32>>,
) -> Result<(), String> {
    let text = serde_json::to_vec_pretty(&request.definition).map_err(|e| e.to_string())?;
    std::fs::write(file, text).map_err(|e| format!("writing {}: {e}", file.display()))?;
    let network = args.network
        && request
            .definition
            .get("network")
            .and_then(|n| n.as_bool())
            .unwrap_or(true);
    let mut cmd = Command::new(exe);
    cmd.arg("--source-dir")
        .arg(source)
        .arg("--build-dir")
        .arg(build)
        .args(["template", "build"])
        .arg(file)
        .args(["--max-image-mib", &args.max_image_mib.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if network {
        cmd.arg("--network");
    }
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting the build: {e}"))?;
    let pgid = child.id() as i32;
    children
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(pgid);
    let result = follow(&mut child, request.id, args.timeout_s, out);
    children
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|p| *p != pgid);
    result
}

/// Passes the child's output on as log lines and waits for it, within `timeout_s`.
fn follow(child: &mut Child, id: u64, timeout_s: u64, out: &Out) -> Result<(), String> {
    let pgid = child.id() as i32;
    let last_error: Arc<Mutex<Option<String>>> = Arc::default();
    let mut pumps = Vec::new();
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let (out, last_error) = (out.clone(), last_error.clone());
        pumps.push(std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                let line = line.strip_prefix("[bud] ").unwrap_or(&line).to_owned();
                if let Some(error) = line.strip_prefix("bud: error: ") {
                    *last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.to_owned());
                }
                report(&out, id, ReportKind::Line(line));
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(timeout_s);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() >= deadline => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(format!("waiting for the build: {e}")),
        }
    };
    let Some(status) = status else {
        // SAFETY: as in `builder`: signals the build's own process group.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = child.wait();
        return Err(format!(
            "the build took longer than {timeout_s} s (--template-build-timeout-s) and was stopped"
        ));
    };
    for pump in pumps {
        let _ = pump.join();
    }
    if status.success() {
        return Ok(());
    }
    let why = last_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    Err(why.unwrap_or_else(|| format!("the build failed ({status})")))
}
