//! `bud`: the command line over the `vmm` library and the guest build.
//!
//! - `bud guest build`: build (or reuse) the guest kernel and initramfs, with progress; with
//!   `--boot`, also bring the template up (boot it to READY and save it, or find it saved).
//! - `bud boot`: build the guest if needed, boot it to the agent's READY doorbell, show the
//!   console with timestamps and report the time from the first KVM_RUN to READY.
//! - `bud run`: run one job in a copy-on-write clone of the template (booting and saving the
//!   template on first use), print its output and exit with its exit code.
//! - `bud serve`: the HTTP API (`bud-server`), until SIGINT or SIGTERM.
//! - `bud audit`: the records of an audit log that match filters.
//! - `bud template`: user templates built from a definition (`build FILE`, `list`, `rm`).
//!
//! Each subcommand is a module (`*_cmd.rs`: its options and what it does); this file holds
//! the global options, the guest build they share, and the dispatch.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

mod audit_cmd;
mod boot_cmd;
mod builder_cmd;
mod remote;
mod run_cmd;
mod serve_cmd;
mod template_cmd;
mod trace_cmd;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "bud",
    version,
    about = "Fast copy-on-write snapshot code executor"
)]
pub struct Cli {
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
    Boot(boot_cmd::BootArgs),
    /// Run one job in a fresh clone of the template and exit with its exit code.
    Run(run_cmd::RunArgs),
    /// Serve the HTTP API (POST /v1/exec, ...) until SIGINT or SIGTERM.
    Serve(Box<serve_cmd::ServeArgs>),
    /// Print the records of an audit log (`bud serve --audit-log`) that match filters.
    Audit(audit_cmd::AuditArgs),
    /// Check a session's trace (`bud trace verify FILE`).
    Trace(trace_cmd::TraceArgs),
    /// User templates: build one from a definition, list, remove (docs/templates.md).
    Template {
        #[command(subcommand)]
        command: template_cmd::TemplateCommand,
    },
}

#[derive(Debug, Subcommand)]
enum GuestCommand {
    /// Build the guest kernel and initramfs (cached; rebuilt only when inputs change).
    Build {
        /// The template whose image to build (`python`, or one of guest/image/templates/).
        #[arg(long, default_value = bud_guest::recipe::BASE_TEMPLATE)]
        template: String,
        /// Also bring the template up: boot it to READY and save its snapshot under
        /// `<build>/templates/` (or find it saved), as `bud run` and `bud serve` would on
        /// first use.
        #[arg(long)]
        boot: bool,
    },
}

impl Cli {
    /// Guest build options: `--build-dir`, or `<source>/build` by default.
    pub fn build_options(&self) -> bud_guest::BuildOptions {
        let mut opts = bud_guest::BuildOptions::new(&self.source_dir);
        if let Some(dir) = &self.build_dir {
            opts.build_dir = dir.clone();
        }
        opts
    }
}

pub fn progress(line: &str) {
    eprintln!("[bud] {line}");
}

pub fn build_guest(cli: &Cli, template: &str) -> anyhow::Result<bud_guest::GuestArtifacts> {
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

/// Brings template `name` up on the guest just built: loads its saved snapshot, or boots it
/// to READY and saves one.
fn boot_template(cli: &Cli, name: &str) -> anyhow::Result<()> {
    let mut build = cli.build_options();
    build.template = name.to_owned();
    let opts = bud_templates::TemplateOptions {
        build,
        guest: bud_templates::GuestBuild::Built,
        ram_size: None,
        network: false,
    };
    let started = Instant::now();
    let template = bud_templates::template(&opts, &mut |l: &str| progress(l), None)
        .with_context(|| format!("bringing template {name} up"))?;
    let how = match template.origin() {
        vmm::template::Origin::Built { boot, .. } => {
            format!("booted, READY after {:.1} s", boot.to_ready.as_secs_f64())
        }
        vmm::template::Origin::Derived { layer, .. } => format!(
            "made from its parent's snapshot in {:.1} s",
            layer.as_secs_f64()
        ),
        vmm::template::Origin::Loaded { .. } => "found saved".to_owned(),
    };
    progress(&format!(
        "template {name} up in {:.1} s ({how})",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Guest {
            command: GuestCommand::Build { template, boot },
        } => build_guest(&cli, template)
            .and_then(|_| match boot {
                true => boot_template(&cli, template),
                false => Ok(()),
            })
            .map(|_| ExitCode::SUCCESS),
        Command::Boot(args) => boot_cmd::boot(&cli, args).map(|_| ExitCode::SUCCESS),
        Command::Run(args) => run_cmd::run(&cli, args),
        Command::Serve(args) => serve_cmd::serve(&cli, args),
        Command::Audit(args) => audit_cmd::audit(args),
        Command::Trace(args) => trace_cmd::trace(args),
        Command::Template { command } => template_cmd::template(&cli, command),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bud: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
