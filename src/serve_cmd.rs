//! `bud serve`: the HTTP API (`bud-server`) until SIGINT or SIGTERM. The server's own
//! options are its configuration, [`bud_server::Config`], flattened; this module adds
//! where to listen, the template source, and what the server reads from files (API keys)
//! or takes as a group of options (the audit trail).

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use bud_server::core::state::{Moment, SourceError};

use anyhow::Context;

use crate::Cli;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    listen: IpAddr,
    /// TCP port (0: any free port, logged at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Guest RAM in MiB of every template (part of its identity; default: each template's).
    #[arg(long)]
    mem_mib: Option<u64>,
    /// API keys, one `NAME KEY` a line: every request then needs one (Authorization:
    /// Bearer KEY, or X-API-Key). Required to listen on anything but loopback.
    #[arg(long)]
    api_keys_file: Option<PathBuf>,
    /// Append one JSON line per job and session cell to this file (`bud audit` reads it).
    #[arg(long)]
    audit_log: Option<PathBuf>,
    /// Also store each job's code and output in the audit log (64 KiB of each at most).
    #[arg(long, requires = "audit_log")]
    audit_content: bool,
    /// Refuse jobs (503) while the audit log cannot be written, rather than run them
    /// unrecorded.
    #[arg(long, requires = "audit_log")]
    audit_required: bool,
    /// The server's configuration: job threads, queue, pool, templates, the jail, session
    /// and request limits.
    #[command(flatten)]
    config: bud_server::Config,
}

pub fn serve(cli: &Cli, args: &ServeArgs) -> anyhow::Result<ExitCode> {
    bud_server::init_logging();
    let mut config = args.config.clone();
    config.audit = args
        .audit_log
        .clone()
        .map(|path| bud_server::core::audit::AuditConfig {
            path,
            content: args.audit_content,
            required: args.audit_required,
        });
    if let Some(path) = &args.api_keys_file {
        config.api_keys = Some(std::sync::Arc::new(bud_server::core::keys::ApiKeys::load(
            path,
        )?));
    }
    let build = cli.build_options();
    // The images this checkout builds trust its build directory's egress CA: a networked
    // server terminates TLS to hosts with rules with that one unless told another.
    if config.network && config.egress_ca_dir.is_none() {
        config.egress_ca_dir = Some(bud_guest::egress_ca::dir_of(&build.build_dir));
    }
    // One state directory per port by default: a server started again on its port finds
    // what it paused, and servers on other ports of this checkout keep theirs apart. A
    // server on any free port (0) keeps none unless given one.
    if config.state_dir.is_none() && args.port != 0 {
        config.state_dir = Some(build.build_dir.join("state").join(args.port.to_string()));
    }
    // The user templates this server built before (its state directory's record) are
    // served again, after the configured ones.
    if let Some(dir) = &config.state_dir {
        let (again, left) =
            bud_server::core::builds::to_serve_again(dir, config.api_keys.as_deref());
        for name in again {
            if !config.templates.contains(&name) {
                config.templates.push(name);
            }
        }
        for r in left {
            crate::progress(&format!(
                "template {} is not served: built under API key {}, which the keys file no \
                 longer has (it comes back with that key; its build stays cached for the same \
                 definition POSTed again)",
                r.name,
                r.owner.as_deref().unwrap_or_default()
            ));
        }
    }
    let ram_size = args.mem_mib.map(|m| m << 20);
    let network = config.network;
    let builder = match config.builds.template_builds {
        0 => None,
        _ => Some(start_builder(cli, &config)?),
    };
    bud_server::run(bud_server::ServeOptions {
        listen: args.listen,
        port: args.port,
        config,
        template: std::sync::Arc::new(move |name: &str, moment: Moment| {
            let mut build = build.clone();
            build.template = name.to_owned();
            // A user template may say its sandboxes get no card (`network = false`).
            let user = build.layers().ok().flatten().is_some();
            let network = network && user_network(&build);
            let opts = bud_templates::TemplateOptions {
                build,
                // Added to a running server: its guest must be built (the server may not
                // run a build any more).
                guest: match moment {
                    Moment::Start => bud_templates::GuestBuild::Existing,
                    Moment::Added => bud_templates::GuestBuild::Built,
                    Moment::Built => bud_templates::GuestBuild::Saved,
                },
                ram_size,
                network,
            };
            let template = bud_templates::template(
                &opts,
                &mut bud_server::http::startup::log_build_line,
                Some(bud_server::http::startup::console_echo()),
            )
            .map_err(|e| match e {
                e @ bud_templates::TemplateSetupError::NotBuilt(_) => {
                    SourceError::NotFound(e.to_string())
                }
                e => SourceError::Failed(e.into()),
            })?;
            let (image_bytes, packages) = bud_templates::image_facts(&opts);
            let info = bud_server::core::state::TemplateInfo {
                image_bytes,
                packages,
                user,
            };
            Ok((template, info))
        }),
        builder,
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Whether `build`'s template (a user template stored under the build directory) wants a network card;
/// true for a built-in template and for a user template that does not say.
fn user_network(build: &bud_guest::BuildOptions) -> bool {
    build
        .layers()
        .ok()
        .flatten()
        .and_then(|layers| layers.network())
        .unwrap_or(true)
}

/// Starts the helper process that builds user templates (`bud template builder`:
/// `bud_server::core::builds`), now, before the server's jail closes.
fn start_builder(
    cli: &Cli,
    config: &bud_server::Config,
) -> anyhow::Result<std::sync::Arc<dyn bud_server::core::builds::Builder>> {
    let build = cli.build_options();
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("--source-dir")
        .arg(&build.source_dir)
        .arg("--build-dir")
        .arg(&build.build_dir)
        .args(["template", "builder"])
        .args([
            "--timeout-s",
            &config.builds.template_build_timeout_s.to_string(),
        ])
        .args([
            "--max-image-mib",
            &config.builds.template_max_image_mib.to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    if config.network {
        cmd.arg("--network");
    }
    let child = cmd.spawn().context("starting the template builder")?;
    let built_in =
        bud_guest::recipe::template_names(&build.source_dir.join(bud_guest::pipeline::RECIPE_DIR));
    Ok(std::sync::Arc::new(
        bud_server::core::builds::HelperBuilder::new(child, built_in)
            .context("starting the template builder")?,
    ))
}
