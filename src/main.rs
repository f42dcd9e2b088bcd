//! `bud`: the command line over the `vmm` library and the guest build.
//!
//! - `bud guest build`: build (or reuse) the guest kernel and initramfs, with progress.
//! - `bud boot`: build the guest if needed, boot it to the agent's READY doorbell, show the
//!   console with timestamps and report the time from the first KVM_RUN to READY.
//! - `bud run`: run one job in a copy-on-write clone of the template (booting and saving the
//!   template on first use), print its output and exit with its exit code.
//! - `bud serve`: the HTTP API (`bud-server`), until SIGINT or SIGTERM.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod audit_cmd;
mod remote;

use anyhow::Context;
use clap::{Parser, Subcommand};
use vmm::devices::console::ConsoleLine;
use vmm::{BootConfig, HostKind};

#[derive(Debug, Parser)]
#[command(
    name = "bud",
    version,
    about = "Fast copy-on-write snapshot code executor"
)]
struct Cli {
    /// Where guest build outputs are cached (default: <source>/build).
    #[arg(long, global = true)]
    build_dir: Option<PathBuf>,
    /// bud's source tree (kernel config, patches, guest recipe).
    #[arg(long, global = true, default_value = env!("CARGO_MANIFEST_DIR"))]
    source_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Build or update the guest kernel and image.
    Guest {
        #[command(subcommand)]
        command: GuestCommand,
    },
    /// Boot the guest to READY and report how long it took.
    Boot(BootArgs),
    /// Run one job in a fresh clone of the template and exit with its exit code.
    Run(RunArgs),
    /// Serve the HTTP API (POST /v1/exec, ...) until SIGINT or SIGTERM.
    Serve(ServeArgs),
    /// Print the records of an audit log (`bud serve --audit-log`) that match filters.
    Audit(audit_cmd::AuditArgs),
}

#[derive(Debug, Subcommand)]
enum GuestCommand {
    /// Build the guest kernel and initramfs (cached; rebuilt only when inputs change).
    Build {
        /// The template whose image to build (`python`, or one of guest/image/templates/).
        #[arg(long, default_value = bud_guest::recipe::BASE_TEMPLATE)]
        template: String,
    },
}

#[derive(Debug, clap::Args)]
struct BootArgs {
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = vmm::boot::DEFAULT_RAM_SIZE >> 20)]
    mem_mib: u64,
    /// Give up if READY has not come after this many seconds.
    #[arg(long, default_value_t = vmm::boot::DEFAULT_BOOT_TIMEOUT.as_secs())]
    timeout_s: u64,
    /// Keep kernel messages on the console (slower: every byte is a port exit).
    #[arg(long)]
    kernel_messages: bool,
    /// Extra kernel command-line options.
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Boot this many times and report the median (the console is shown for the first only).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Sample the guest's instruction pointer every N microseconds and write a histogram,
    /// resolved against the kernel's System.map when found, to FILE (diagnostics).
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
    /// Sampling interval for --profile, in microseconds.
    #[arg(long, default_value_t = 1000)]
    profile_us: u64,
    /// Use this kernel instead of the built one (skips the guest build).
    #[arg(long, requires = "initramfs")]
    kernel: Option<PathBuf>,
    /// Use this initramfs instead of the built one.
    #[arg(long, requires = "kernel")]
    initramfs: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Lang {
    Python,
    Shell,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The code to run (instead of FILE).
    #[arg(short = 'c', long = "code", conflicts_with = "file")]
    code: Option<String>,
    /// A file holding the code to run.
    #[arg(required_unless_present = "code")]
    file: Option<PathBuf>,
    /// Arguments for the job (`sys.argv[1:]` or `$1...`); put them after `--`.
    #[arg(last = true)]
    args: Vec<String>,
    /// Language of the code.
    #[arg(long, value_enum, default_value = "python")]
    lang: Lang,
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

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    listen: std::net::IpAddr,
    /// TCP port (0: any free port, logged at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Job threads: jobs running at once (default: one per core).
    #[arg(long, default_value_t = bud_server::config::default_workers())]
    workers: usize,
    /// Jobs that may wait for a job thread; past workers + queue, requests get 429.
    #[arg(long, default_value_t = bud_server::Config::default().queue)]
    queue: usize,
    /// VMs kept ready (fresh clones and idle warm VMs).
    #[arg(long, default_value_t = bud_server::Config::default().pool_size)]
    pool: usize,
    /// A fresh clone for every job instead of resetting and reusing warm VMs.
    #[arg(long)]
    fresh_clones: bool,
    /// Verify every reset by value against the template (reads all of guest RAM per job).
    #[arg(long)]
    verify_resets: bool,
    /// The templates to serve, comma-separated, prepared in this order at start (`python`,
    /// `datascience`: guest/image/templates/). Jobs and sessions choose one with
    /// `template`; without it they get `python` if served, else the first.
    #[arg(long, value_delimiter = ',', default_value = "python")]
    templates: Vec<String>,
    /// Guest RAM in MiB of every template (part of its identity; default: each template's).
    #[arg(long)]
    mem_mib: Option<u64>,
    /// API keys, one `NAME KEY` a line: every request then needs one (Authorization:
    /// Bearer KEY, or X-API-Key). Required to listen on anything but loopback.
    #[arg(long)]
    api_keys_file: Option<std::path::PathBuf>,
    /// Most jobs one API key may have running or queued at once (429 key_quota past it).
    /// Default: half of workers + queue with several keys (at least --max-batch-jobs),
    /// no limit but the server's own with one key or none.
    #[arg(long)]
    key_max_jobs: Option<usize>,
    /// On SIGINT/SIGTERM: seconds running and queued jobs get to finish before they are
    /// cancelled (their clients get `cancelled`).
    #[arg(long, default_value_t = bud_server::Config::default().shutdown_grace_s)]
    shutdown_grace_s: u64,
    /// Refuse jobs, cells and new sessions (503 memory_budget, Retry-After) while the
    /// server's private memory (its VMs' private pages, sessions, buffers) is over this.
    #[arg(long)]
    memory_budget_mib: Option<u64>,
    /// Once the templates are prepared, put every thread under a seccomp filter (job threads
    /// under a narrower one); a system call outside it kills the server.
    #[arg(long)]
    jail: bool,
    /// Once the templates are prepared, drop to this user and its group (implies --jail).
    #[arg(long)]
    user: Option<String>,
    /// Append one JSON line per job and session cell to this file (`bud audit` reads it).
    #[arg(long)]
    audit_log: Option<std::path::PathBuf>,
    /// Also store each job's code and output in the audit log (64 KiB of each at most).
    #[arg(long, requires = "audit_log")]
    audit_content: bool,
    /// Refuse jobs (503) while the audit log cannot be written, rather than run them
    /// unrecorded.
    #[arg(long, requires = "audit_log")]
    audit_required: bool,
    /// Most live sessions; past it, creating or forking one is 429.
    #[arg(long, default_value_t = bud_server::config::SessionLimits::default().max_sessions)]
    max_sessions: usize,
    /// Host memory all sessions may hold (private pages + fork layers), in MiB; past it,
    /// creating or forking one is 507.
    #[arg(long, default_value_t = bud_server::config::SessionLimits::default().max_memory_bytes >> 20)]
    sessions_memory_mib: u64,
    /// Idle timeout of a session that asks for none, in seconds.
    #[arg(long, default_value_t = bud_server::config::SessionLimits::default().default_idle_timeout_s)]
    session_idle_timeout_s: u64,
    /// Largest idle timeout a session may ask for, in seconds.
    #[arg(long, default_value_t = bud_server::config::SessionLimits::default().max_idle_timeout_s)]
    max_session_idle_timeout_s: u64,
    /// Lifetime of a session that asks for none, in seconds.
    #[arg(long, default_value_t = bud_server::config::SessionLimits::default().default_lifetime_s)]
    session_lifetime_s: u64,
    /// Largest lifetime a session may ask for, in seconds.
    #[arg(long, default_value_t = bud_server::config::SessionLimits::default().max_lifetime_s)]
    max_session_lifetime_s: u64,
    /// Largest file uploaded into a session, in bytes.
    #[arg(long, default_value_t = bud_server::config::SessionLimits::default().max_file_bytes)]
    max_file_bytes: usize,
    /// Limits on one request.
    #[command(flatten)]
    limits: bud_server::Limits,
}

impl Cli {
    /// Guest build options: `--build-dir`, or `<source>/build` by default.
    fn build_options(&self) -> bud_guest::BuildOptions {
        let mut opts = bud_guest::BuildOptions::new(&self.source_dir);
        if let Some(dir) = &self.build_dir {
            opts.build_dir = dir.clone();
        }
        opts
    }
}

fn progress(line: &str) {
    eprintln!("[bud] {line}");
}

fn build_guest(cli: &Cli, template: &str) -> anyhow::Result<bud_guest::GuestArtifacts> {
    let mut opts = cli.build_options();
    opts.template = template.to_owned();
    let started = Instant::now();
    let artifacts = bud_guest::ensure(&opts, &mut |l: &str| progress(l))
        .context("building the guest kernel and image")?;
    progress(&format!(
        "guest ready in {:.1} s: kernel {}, image {} ({:.1} MiB)",
        started.elapsed().as_secs_f64(),
        artifacts.kernel.display(),
        artifacts.initramfs.display(),
        artifacts.image_size as f64 / (1 << 20) as f64
    ));
    Ok(artifacts)
}

/// Writes `rip count symbol+offset` lines, most frequent first. Symbols come from the
/// System.map next to the kernel's build tree (`<kernel dir>/src/System.map`), if present.
fn write_profile(
    path: &std::path::Path,
    profile: &std::collections::HashMap<u64, u64>,
    kernel: &std::path::Path,
) -> anyhow::Result<()> {
    let map_path = kernel.parent().map(|d| d.join("src").join("System.map"));
    let mut symbols: Vec<(u64, String)> = map_path
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|text| {
            text.lines()
                .filter_map(|l| {
                    let mut it = l.split_whitespace();
                    let addr = u64::from_str_radix(it.next()?, 16).ok()?;
                    let _kind = it.next()?;
                    Some((addr, it.next()?.to_string()))
                })
                .collect()
        })
        .unwrap_or_default();
    symbols.sort();
    let name = |rip: u64| match symbols.partition_point(|(a, _)| *a <= rip) {
        0 => "?".to_string(),
        i if rip < 0xffff_8000_0000_0000 => format!("user:{:#x} (near {})", rip, symbols[i - 1].1),
        i => format!("{}+{:#x}", symbols[i - 1].1, rip - symbols[i - 1].0),
    };
    let mut by_symbol: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    for (&rip, &n) in profile {
        let sym = name(rip);
        let func = if rip >= 0xffff_8000_0000_0000 {
            sym.split('+').next().unwrap_or("?").to_string()
        } else {
            "(user mode)".to_string()
        };
        *by_symbol.entry(func).or_insert(0) += n;
    }
    let mut rows: Vec<_> = by_symbol.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1));
    let total: u64 = rows.iter().map(|r| r.1).sum::<u64>().max(1);
    let mut out = String::new();
    for (func, n) in rows {
        out.push_str(&format!(
            "{n:8} {:5.1}%  {func}\n",
            n as f64 * 100.0 / total as f64
        ));
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Resident set size and its peak of this process, in KiB, from /proc/self/status.
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn echo_line(line: &ConsoleLine) {
    let mut out = std::io::stdout().lock();
    // A closed stdout must not kill the boot; the console is also kept in memory.
    let _ = writeln!(
        out,
        "[{:>10.1} ms] {}",
        line.at.as_secs_f64() * 1e3,
        line.text
    );
}

fn boot(cli: &Cli, args: &BootArgs) -> anyhow::Result<()> {
    let (kernel, initramfs) = match (&args.kernel, &args.initramfs) {
        (Some(k), Some(i)) => (k.clone(), i.clone()),
        _ => {
            let a = build_guest(cli, bud_guest::recipe::BASE_TEMPLATE)?;
            (a.kernel, a.initramfs)
        }
    };
    let mut cfg = BootConfig::new(kernel, initramfs);
    cfg.ram_size = args.mem_mib << 20;
    cfg.timeout = Duration::from_secs(args.timeout_s);
    cfg.kernel_messages = args.kernel_messages;
    cfg.extra_cmdline = args.cmdline.clone();
    if args.profile.is_some() {
        cfg.profile_interval = Some(Duration::from_micros(args.profile_us));
    }
    progress(&format!(
        "host: {} ({}), guest RAM {} MiB",
        cfg.host_kind,
        match cfg.host_kind {
            HostKind::Pvm => "kvm_pvm software hypervisor: PVM command-line knobs applied",
            HostKind::Hardware => "hardware virtualization",
        },
        args.mem_mib
    ));
    progress(&format!("kernel command line: {}", cfg.cmdline()));

    let mut to_ready = Vec::with_capacity(args.repeat);
    let mut rss = Vec::with_capacity(args.repeat);
    for i in 0..args.repeat.max(1) {
        let echo: Option<vmm::devices::console::EchoFn> = if i == 0 {
            Some(Box::new(echo_line))
        } else {
            None
        };
        let guest = vmm::boot(&cfg, echo).with_context(|| format!("boot {} failed", i + 1))?;
        let t = guest.timings;
        progress(&format!(
            "boot {}: READY {:.1} ms after the first KVM_RUN (agent started at {}, VMM setup {:.1} ms); mailbox {} KiB at {:#x}",
            i + 1,
            t.to_ready.as_secs_f64() * 1e3,
            t.to_agent
                .map(|d| format!("{:.1} ms", d.as_secs_f64() * 1e3))
                .unwrap_or_else(|| "?".into()),
            t.setup.as_secs_f64() * 1e3,
            guest.mailbox.len() >> 10,
            guest.mailbox.guest_virtual_address(),
        ));
        to_ready.push(t.to_ready);
        // While the guest is alive: guest RAM the guest touched is part of this process.
        rss.push(rss_kib().0);
        if let Some(path) = &args.profile {
            write_profile(path, &guest.profile, &cfg.kernel)?;
            progress(&format!(
                "profile: {} samples written to {}",
                guest.profile.values().sum::<u64>(),
                path.display()
            ));
        }
    }
    let (_, peak) = rss_kib();
    to_ready.sort();
    rss.sort();
    progress(&format!(
        "time to READY: median {:.1} ms over {} boot(s) (min {:.1}, max {:.1}); VMM process RSS at READY {} KiB (median), peak {} KiB",
        to_ready[to_ready.len() / 2].as_secs_f64() * 1e3,
        to_ready.len(),
        to_ready[0].as_secs_f64() * 1e3,
        to_ready[to_ready.len() - 1].as_secs_f64() * 1e3,
        rss[rss.len() / 2],
        peak
    ));
    Ok(())
}

/// `bud run`: through a reachable `bud serve` (see `remote`), else in this process.
fn run(cli: &Cli, args: &RunArgs) -> anyhow::Result<ExitCode> {
    let code = match (&args.code, &args.file) {
        (Some(c), _) => c.clone().into_bytes(),
        (None, Some(f)) => std::fs::read(f).with_context(|| format!("reading {}", f.display()))?,
        (None, None) => anyhow::bail!("give code with -c or a FILE"),
    };
    let mut job = vmm::Job::new(
        match args.lang {
            Lang::Python => vmm::Language::Python,
            Lang::Shell => vmm::Language::Shell,
        },
        code,
    );
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
        Some(url) => remote::run(&url, &job, &args.template)?,
        None => run_local(cli, args, &job)?,
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

fn serve(cli: &Cli, args: &ServeArgs) -> anyhow::Result<ExitCode> {
    bud_server::init_logging();
    let config = bud_server::Config {
        workers: args.workers,
        queue: args.queue,
        pool_size: args.pool,
        reuse: if args.fresh_clones {
            vmm::Reuse::Fresh
        } else {
            vmm::Reuse::Warm
        },
        verify_resets: args.verify_resets,
        limits: args.limits.clone(),
        sessions: bud_server::config::SessionLimits {
            max_sessions: args.max_sessions,
            max_memory_bytes: args.sessions_memory_mib << 20,
            default_idle_timeout_s: args.session_idle_timeout_s,
            max_idle_timeout_s: args.max_session_idle_timeout_s,
            default_lifetime_s: args.session_lifetime_s,
            max_lifetime_s: args.max_session_lifetime_s,
            max_file_bytes: args.max_file_bytes,
            ..bud_server::config::SessionLimits::default()
        },
        templates: args.templates.clone(),
        key_max_jobs: args.key_max_jobs,
        shutdown_grace_s: args.shutdown_grace_s,
        memory_budget_bytes: args.memory_budget_mib.map(|m| m << 20),
        jail: bud_server::jail::JailConfig {
            seccomp: args.jail || args.user.is_some(),
            user: args.user.clone(),
        },
        audit: args
            .audit_log
            .clone()
            .map(|path| bud_server::audit::AuditConfig {
                path,
                content: args.audit_content,
                required: args.audit_required,
            }),
        api_keys: match &args.api_keys_file {
            Some(path) => Some(std::sync::Arc::new(bud_server::keys::ApiKeys::load(path)?)),
            None => None,
        },
        ..bud_server::Config::default()
    };
    let build = cli.build_options();
    let ram_size = args.mem_mib.map(|m| m << 20);
    bud_server::run(bud_server::ServeOptions {
        listen: args.listen,
        port: args.port,
        config,
        template: Box::new(move |name: &str| {
            let mut build = build.clone();
            build.template = name.to_owned();
            let opts = bud_templates::TemplateOptions {
                build,
                guest: bud_templates::GuestBuild::Existing,
                ram_size,
            };
            let template = bud_templates::template(
                &opts,
                &mut bud_server::startup::log_build_line,
                Some(bud_server::startup::console_echo()),
            )?;
            let (image_bytes, packages) = bud_templates::image_facts(&opts);
            let info = bud_server::state::TemplateInfo {
                image_bytes,
                packages,
            };
            Ok((template, info))
        }),
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Runs `job` in a fresh clone in this process (loading or building the template; an
/// existing guest build is used as it is, so a run stays fast: `bud guest build` picks up
/// source changes).
fn run_local(cli: &Cli, args: &RunArgs, job: &vmm::Job) -> anyhow::Result<vmm::JobResult> {
    let started = Instant::now();
    let mut build = cli.build_options();
    build.template.clone_from(&args.template);
    let opts = bud_templates::TemplateOptions {
        build,
        guest: bud_templates::GuestBuild::Existing,
        ram_size: args.mem_mib.map(|m| m << 20),
    };
    let template = bud_templates::template(&opts, &mut |l: &str| progress(l), None)
        .context("preparing the template")?;
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
    Ok(executor.run(job)?)
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Guest {
            command: GuestCommand::Build { template },
        } => build_guest(&cli, template).map(|_| ExitCode::SUCCESS),
        Command::Boot(args) => boot(&cli, args).map(|_| ExitCode::SUCCESS),
        Command::Run(args) => run(&cli, args),
        Command::Serve(args) => serve(&cli, args),
        Command::Audit(args) => audit_cmd::audit(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bud: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
