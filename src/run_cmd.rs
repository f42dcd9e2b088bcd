//! `bud run`: one job in a fresh clone of the template, through a reachable `bud serve`
//! (see [`crate::remote`]) or in this process (booting and saving the template on first
//! use); prints its output and exits with its exit code.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::{Cli, progress, remote};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The code to run (instead of FILE).
    #[arg(short = 'c', long = "code", conflicts_with = "file")]
    code: Option<String>,
    /// A file holding the code to run.
    #[arg(required_unless_present = "code")]
    file: Option<PathBuf>,
    /// Arguments for the job (`sys.argv[1:]` or `$1...`); put them after `--`.
    #[arg(last = true)]
    args: Vec<String>,
    /// The runtime to run the code in: one of the template's runtimes, by name or alias
    /// (`python`, `shell`; `javascript` (`js`, `node`) and `typescript` (`ts`) on the `node` template). Default: the
    /// template's first (`javascript` on `node`, `python` on the others).
    #[arg(long, value_name = "RUNTIME")]
    lang: Option<String>,
    /// A file whose bytes become the job's stdin.
    #[arg(long)]
    stdin: Option<PathBuf>,
    /// Environment variable for the job, KEY=VALUE (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Wall-clock limit in milliseconds.
    #[arg(long, default_value_t = vmm::job::DEFAULT_TIMEOUT.as_millis() as u64)]
    timeout_ms: u64,
    /// Cap on stdout + stderr bytes.
    #[arg(long, default_value_t = vmm::job::DEFAULT_OUTPUT_LIMIT)]
    output_limit: usize,
    /// Print status and timings to stderr after the output.
    #[arg(long)]
    timings: bool,
    /// Guest RAM in MiB (part of the template's identity; default: the template's). Given,
    /// it runs the job in this process.
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Save the job's figures (matplotlib figures shown or left open) as DIR/figure-N.png.
    #[arg(long, value_name = "DIR")]
    figures_dir: Option<PathBuf>,
    /// The template to run in (`python`, `datascience`, ...).
    #[arg(long, default_value = bud_guest::recipe::BASE_TEMPLATE)]
    template: String,
    /// Run in this process even when a `bud serve` is reachable (BUD_URL, or
    /// http://127.0.0.1:8080).
    #[arg(long)]
    local: bool,
}

/// `bud run`: through a reachable `bud serve` (see `remote`), else in this process.
pub fn run(cli: &Cli, args: &RunArgs) -> anyhow::Result<ExitCode> {
    let code = match (&args.code, &args.file) {
        (Some(c), _) => c.clone().into_bytes(),
        (None, Some(f)) => std::fs::read(f).with_context(|| format!("reading {}", f.display()))?,
        (None, None) => anyhow::bail!("give code with -c or a FILE"),
    };
    // Its worker mode is the template's to say (its manifest's runtime of that name): the
    // server's, or run_local's once the template is loaded.
    let mut job = vmm::Job::new(vmm::Language::Python, code);
    job.args = args.args.clone();
    job.timeout = Duration::from_millis(args.timeout_ms);
    job.output_limit = args.output_limit;
    if let Some(path) = &args.stdin {
        job.stdin = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    }
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--env {kv:?} is not KEY=VALUE"))?;
        job.env.push((k.to_string(), v.to_string()));
    }

    let server = if args.local || args.mem_mib.is_some() {
        None
    } else {
        remote::server_url()?
    };
    let result = match server {
        Some(url) => remote::run(&url, &job, &args.template, args.lang.as_deref())?,
        None => run_local(cli, args, job)?,
    };
    {
        let mut out = std::io::stdout().lock();
        out.write_all(&result.stdout)?;
        out.flush()?;
        let mut err = std::io::stderr().lock();
        err.write_all(&result.stderr)?;
        err.flush()?;
    }
    save_figures(&result, args.figures_dir.as_deref())?;
    if args.timings {
        let t = result.timings;
        eprintln!(
            "[bud] status {:?}, exit code {:?}, signal {:?}; clone {:.3} ms, run {:.3} ms, total {:.3} ms",
            result.status,
            result.exit_code,
            result.signal,
            t.clone.as_secs_f64() * 1e3,
            t.run.as_secs_f64() * 1e3,
            t.total.as_secs_f64() * 1e3
        );
    }
    Ok(exit_code_of(&result, args))
}

/// Writes the job's figures into `dir` (figure-1.png, ...), or says how many there are.
fn save_figures(result: &vmm::JobResult, dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    use base64::Engine;
    if result.figures.is_empty() {
        return Ok(());
    }
    let Some(dir) = dir else {
        progress(&format!(
            "the job returned {} figure(s); --figures-dir DIR saves them",
            result.figures.len()
        ));
        return Ok(());
    };
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (i, f) in result.figures.iter().enumerate() {
        let png = base64::engine::general_purpose::STANDARD
            .decode(&f.data)
            .context("a figure is not base64")?;
        let path = dir.join(format!("figure-{}.png", i + 1));
        std::fs::write(&path, png).with_context(|| format!("writing {}", path.display()))?;
        progress(&format!("figure {} saved: {}", i + 1, path.display()));
    }
    Ok(())
}

/// Runs `job` in a fresh clone in this process (loading or building the template; an
/// existing guest build is used as it is, so a run stays fast: `bud guest build` picks up
/// source changes), in the template's runtime `--lang` names.
fn run_local(cli: &Cli, args: &RunArgs, mut job: vmm::Job) -> anyhow::Result<vmm::JobResult> {
    let started = Instant::now();
    let mut build = cli.build_options();
    build.template.clone_from(&args.template);
    let opts = bud_templates::TemplateOptions {
        build,
        guest: bud_templates::GuestBuild::Existing,
        ram_size: args.mem_mib.map(|m| m << 20),
        network: false,
    };
    let template = bud_templates::template(&opts, &mut |l: &str| progress(l), None)
        .context("preparing the template")?;
    let manifest = template.manifest();
    let runtime = match args.lang.as_deref() {
        Some(name) => manifest.runtime(name),
        None => manifest.default_runtime(),
    };
    match runtime {
        Some(r) => job.set_runtime(r),
        None => anyhow::bail!(
            "template {} has no runtime {}; its runtimes: {}",
            args.template,
            args.lang
                .as_deref()
                .map_or_else(|| "at all".to_owned(), |l| format!("{l:?}")),
            bud_server::service::templates::runtime_list(manifest)
        ),
    };
    if let vmm::template::Origin::Built {
        boot,
        capture,
        write,
    } = template.origin()
    {
        progress(&format!(
            "template built in {:.1} s (READY after {:.1} s, capture {:.1} ms, memory file {:.0} ms): {}",
            started.elapsed().as_secs_f64(),
            boot.to_ready.as_secs_f64(),
            capture.as_secs_f64() * 1e3,
            write.as_secs_f64() * 1e3,
            template.dir().display()
        ));
    }
    // One job in this process: a fresh clone, no pool, nothing to reset.
    let once = vmm::ExecutorOptions {
        pool_size: 0,
        reuse: vmm::Reuse::Fresh,
        ..vmm::ExecutorOptions::default()
    };
    let executor = vmm::Executor::new(template, once)?;
    Ok(executor.run(&job)?)
}

/// The process exit code for a job: its own exit status, 128 + signal, or (like `timeout(1)`)
/// 124 for a timeout; bud's own statuses say why on stderr.
fn exit_code_of(result: &vmm::JobResult, args: &RunArgs) -> ExitCode {
    use vmm::Status;
    match result.status {
        Status::Ok | Status::Error => {
            if let Some(code) = result.exit_code {
                ExitCode::from(code.clamp(0, 255) as u8)
            } else {
                ExitCode::from((128 + result.signal.unwrap_or(0)).clamp(0, 255) as u8)
            }
        }
        Status::Timeout => {
            eprintln!(
                "bud: the job ran past its {} ms limit and was stopped",
                args.timeout_ms
            );
            ExitCode::from(124)
        }
        Status::OutputLimit => {
            eprintln!(
                "bud: the job wrote more than {} bytes and was stopped",
                args.output_limit
            );
            ExitCode::from(125)
        }
        Status::MemoryLimit => {
            eprintln!("bud: the job ran out of memory");
            ExitCode::from(137)
        }
        Status::Crashed => {
            eprintln!(
                "bud: the guest crashed: {}",
                result.crash.as_deref().unwrap_or("unknown reason")
            );
            for line in &result.console_tail {
                eprintln!("  | {line}");
            }
            ExitCode::from(70)
        }
        Status::Cancelled => {
            eprintln!("bud: the job was cancelled");
            ExitCode::from(130)
        }
    }
}
