//! `bud template`: user templates (`docs/templates.md`). `build FILE` builds one from its
//! definition (TOML, or JSON for a `.json` file) in this process: its packages fetched, its
//! image assembled, its first boot, then the definition stored under the build directory,
//! where `bud serve --templates NAME` and `PUT /v1/templates/NAME` find it. `list` shows the
//! stored ones; `rm NAME` forgets one.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use bud_guest::definition::{Definition, Limits};

use crate::{Cli, progress};

#[derive(Debug, clap::Subcommand)]
pub enum TemplateCommand {
    /// Build a user template from its definition file and store it.
    Build {
        /// The definition (TOML; JSON when the name ends in `.json`).
        file: PathBuf,
        /// Build it with a network card (as `bud serve --network` serves it).
        #[arg(long)]
        network: bool,
        /// Refuse an image larger than this, in MiB.
        #[arg(long, default_value_t = 1024)]
        max_image_mib: u64,
        /// A directory of this machine put into the image at a guest directory, as the
        /// definition's `archives` (files and directories only); repeatable.
        #[arg(long = "dir", value_name = "GUEST_DIR=HOST_DIR")]
        dirs: Vec<String>,
        /// Build it on the `bud serve` at this URL (`POST /v1/templates`, its log followed),
        /// which then serves it, instead of in this process.
        #[arg(long, value_name = "URL", conflicts_with_all = ["network", "max_image_mib"])]
        server: Option<String>,
    },
    /// The helper process of `bud serve` that builds user templates (internal).
    #[command(hide = true)]
    Builder(crate::builder_cmd::BuilderArgs),
    /// List the stored user templates.
    List,
    /// Forget a stored user template (its cached image stays until `build/` is cleaned).
    Rm { name: String },
}

pub fn template(cli: &Cli, command: &TemplateCommand) -> anyhow::Result<ExitCode> {
    let build_dir = cli.build_options().build_dir;
    match command {
        TemplateCommand::Builder(args) => crate::builder_cmd::builder(cli, args),
        TemplateCommand::Build {
            file,
            network,
            max_image_mib,
            dirs,
            server,
        } => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let limits = Limits::default();
            let definition = if file.extension().is_some_and(|e| e == "json") {
                Definition::from_json(text.as_bytes(), &limits)
            } else {
                Definition::from_toml(&text, &limits)
            }
            .with_context(|| format!("{} is not a valid template definition", file.display()))?;
            let mut definition = definition;
            if !dirs.is_empty() {
                for spec in dirs {
                    let (guest, host) = spec
                        .split_once('=')
                        .with_context(|| format!("--dir {spec}: give GUEST_DIR=HOST_DIR"))?;
                    definition
                        .archives
                        .insert(guest.to_owned(), pack(std::path::Path::new(host))?);
                }
                definition
                    .check(&limits)
                    .with_context(|| format!("{} with its --dir", file.display()))?;
            }
            let name = definition.name.clone();
            let started = Instant::now();
            if let Some(url) = server {
                return build_on(url.trim_end_matches('/'), &definition, started);
            }
            let template = bud_templates::build_user(
                cli.build_options(),
                definition,
                *network,
                max_image_mib << 20,
                &mut |l: &str| progress(l),
                // The first boot's console: the warm-up's output and, if it fails, its
                // traceback belong in the build's log.
                Some(Box::new(|line: &vmm::devices::console::ConsoleLine| {
                    progress(&format!(
                        "[{:7.1}s] guest: {}",
                        line.at.as_secs_f64(),
                        line.text
                    ))
                })),
            )
            .with_context(|| format!("building template {name}"))?;
            let manifest = template.manifest();
            let listed = |packages: &std::collections::BTreeMap<String, String>| match packages {
                p if p.is_empty() => "none".to_owned(),
                p => p
                    .iter()
                    .map(|(n, v)| format!("{n} {v}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            progress(&format!(
                "template {name} built in {:.1} s: runtimes {}; tools {}; Python packages {}; \
                 npm packages {}",
                started.elapsed().as_secs_f64(),
                manifest.runtime_names().join(", "),
                manifest.tools.join(", "),
                listed(&manifest.python_packages),
                listed(&manifest.npm_packages),
            ));
            Ok(ExitCode::SUCCESS)
        }
        TemplateCommand::List => {
            for name in bud_guest::user::names(&build_dir) {
                let def = bud_guest::user::load(&build_dir, &name)?;
                let from = def.map(|d| d.from).unwrap_or_default();
                println!("{name}\tfrom {from}");
            }
            Ok(ExitCode::SUCCESS)
        }
        TemplateCommand::Rm { name } => {
            if bud_guest::user::remove(&build_dir, name)? {
                Ok(ExitCode::SUCCESS)
            } else {
                anyhow::bail!("no user template {name}")
            }
        }
    }
}

/// `bud template build --server URL`: the definition POSTed, its build log followed and
/// shown as it comes; exits non-zero if the build failed.
fn build_on(url: &str, definition: &Definition, started: Instant) -> anyhow::Result<ExitCode> {
    let name = &definition.name;
    match ureq::post(&format!("{url}/v1/templates")).send_json(definition) {
        Ok(_) => {}
        Err(ureq::Error::Status(code, r)) => {
            let body = r.into_string().unwrap_or_default();
            anyhow::bail!("bud serve at {url} refused the template: HTTP {code}: {body}");
        }
        Err(e) => anyhow::bail!("cannot reach bud serve at {url}: {e}"),
    }
    let log = ureq::get(&format!("{url}/v1/templates/{name}/build"))
        .call()
        .with_context(|| format!("following the build of {name}"))?;
    let mut last = serde_json::Value::Null;
    for line in std::io::BufRead::lines(std::io::BufReader::new(log.into_reader())) {
        let line: serde_json::Value = serde_json::from_str(&line?)?;
        match line["line"].as_str() {
            Some(text) => progress(text),
            None => last = line,
        }
    }
    match last["status"].as_str() {
        Some("ready") => {
            progress(&format!(
                "template {name} built and served by {url} in {:.1} s",
                started.elapsed().as_secs_f64()
            ));
            Ok(ExitCode::SUCCESS)
        }
        _ => anyhow::bail!(
            "the build of {name} failed: {}",
            last["error"]
                .as_str()
                .unwrap_or("the server said nothing more")
        ),
    }
}

/// The directory `host` as a base64 tar archive (its symbolic links kept as links, which
/// the definition's check refuses by name).
fn pack(host: &std::path::Path) -> anyhow::Result<String> {
    use base64::Engine;
    anyhow::ensure!(
        host.is_dir(),
        "--dir: {} is not a directory",
        host.display()
    );
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    builder
        .append_dir_all(".", host)
        .with_context(|| format!("packing {}", host.display()))?;
    let bytes = builder.into_inner().context("packing")?;
    Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
}
