//! The one way to get a template: the guest found or built ([`bud_guest`], which only builds
//! files), then the template loaded from disk or booted and saved ([`vmm::Template`]).
//! `bud run`, `bud serve`, the integration tests and the benchmarks all come through
//! [`template`]. This crate is where the image builder's files meet the VMM: the builder
//! never boots anything, the VMM never builds anything.

use std::path::PathBuf;

use vmm::devices::console::EchoFn;
use vmm::{BootConfig, Template, TemplateSpec};

use bud_guest::pipeline::{
    BuildError, BuildOptions, RECIPE_DIR, artifact_paths, built_or_ensure, ensure,
};

/// How much to trust an existing guest build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestBuild {
    /// Use the kernel and image under the build directory as they are; build them only if
    /// missing (fast: what `bud run` and `bud serve` do; `bud guest build` updates them).
    Existing,
    /// Bring them up to date with their inputs first (tests and benchmarks: a changed patch
    /// or recipe must not go unnoticed).
    Current,
    /// Use them as they are and never build: missing ones are an error (a template added
    /// to a running server, which may no longer run a build).
    Built,
    /// As [`Self::Built`], and the template too must be saved already: it is loaded, never
    /// booted (a jailed server loading what its builder process built and booted).
    Saved,
}

/// Errors of getting a template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateSetupError {
    #[error("building the guest kernel and image: {0}")]
    Guest(#[from] Box<BuildError>),
    #[error("preparing the template: {0}")]
    Template(#[from] vmm::template::TemplateError),
    #[error("{0}")]
    Recipe(#[from] bud_guest::recipe::RecipeError),
    #[error("template {0} has no guest build (`bud guest build --template {0}` makes one)")]
    NotBuilt(String),
    #[error("comparing the image with its parent's: {0}")]
    Layer(#[from] bud_guest::layer::LayerError),
    #[error("storing the definition: {0}")]
    Store(#[from] bud_guest::user::UserError),
    #[error(
        "the image is {size_mib} MiB, over the limit of {limit_mib} MiB (fewer or smaller \
         packages, or a larger limit)"
    )]
    TooLarge { size_mib: u64, limit_mib: u64 },
}

/// What to prepare.
#[derive(Debug)]
pub struct TemplateOptions {
    pub build: BuildOptions,
    pub guest: GuestBuild,
    /// Guest RAM in bytes (part of the template's identity); `None`: the template recipe's
    /// `ram_mib`, or [`vmm::boot::DEFAULT_RAM_SIZE`] for the base template.
    pub ram_size: Option<u64>,
    /// A network card in the guest (part of the template's identity: [`vmm::net`]). Without
    /// a policy it has no route out.
    pub network: bool,
}

impl TemplateOptions {
    /// Defaults for the source tree at `source_dir`: its `build/`, the base template, an
    /// existing guest build, the template's guest RAM.
    pub fn new(source_dir: impl Into<PathBuf>) -> Self {
        Self {
            build: BuildOptions::new(source_dir),
            guest: GuestBuild::Existing,
            ram_size: None,
            network: false,
        }
    }

    /// The same for template `name`.
    pub fn named(source_dir: impl Into<PathBuf>, name: &str) -> Self {
        let mut opts = Self::new(source_dir);
        opts.build.template = name.to_owned();
        opts
    }

    /// The template's name.
    pub fn name(&self) -> &str {
        &self.build.template
    }

    /// The templates the source tree defines (sorted).
    pub fn names(&self) -> Vec<String> {
        bud_guest::recipe::template_names(&self.build.source_dir.join(RECIPE_DIR))
    }

    /// Where templates are kept: `<build>/templates`.
    pub fn template_root(&self) -> PathBuf {
        self.build.build_dir.join("templates")
    }
}

/// What the image of `opts`' template holds, as its builder recorded it: the image's size
/// and the Debian packages its manifest lists (name to version). Zero and empty when the
/// image or its manifest is missing.
pub fn image_facts(opts: &TemplateOptions) -> (u64, std::collections::BTreeMap<String, String>) {
    let (_, image) = bud_guest::pipeline::artifact_paths(&opts.build.build_dir, opts.name());
    let size = image.metadata().map_or(0, |m| m.len());
    let manifest = vmm::Manifest::load(&bud_guest::manifest_path(
        &opts.build.build_dir,
        opts.name(),
    ));
    (size, manifest.map(|m| m.packages).unwrap_or_default())
}

/// Builds user template `definition` (`bud_guest::user`): its image brought up to date,
/// then its template, and only then its definition stored, so that a failed build leaves
/// nothing registered. The template is made from its parent's snapshot when the image only
/// adds files to the parent's (a layer: [`vmm::template::Layer`], seconds), or else by a
/// first boot of its own (a minute or more); either runs its warm-up code, and an exception
/// there fails the build. `build`'s template and definition are set from `definition`; an
/// image over `max_image_bytes` is refused before anything runs it.
pub fn build_user(
    mut build: BuildOptions,
    definition: bud_guest::definition::Definition,
    network: bool,
    max_image_bytes: u64,
    progress: &mut dyn FnMut(&str),
    echo: Option<EchoFn>,
) -> Result<Template, TemplateSetupError> {
    build.template = definition.name.clone();
    build.definition = Some(definition.clone());
    let artifacts = ensure(&build, progress).map_err(Box::new)?;
    if artifacts.image_size > max_image_bytes {
        return Err(TemplateSetupError::TooLarge {
            size_mib: artifacts.image_size.div_ceil(1 << 20),
            limit_mib: max_image_bytes >> 20,
        });
    }
    let opts = TemplateOptions {
        build,
        guest: GuestBuild::Built,
        ram_size: None,
        network,
    };
    let template = match layer_plan(&opts, &definition, progress)? {
        Plan::Saved(template) => template,
        Plan::Layer {
            parent,
            spec,
            archive,
            warm_from,
            timeout,
        } => {
            let layer = vmm::template::Layer {
                archive: &archive,
                warm_from,
                timeout,
            };
            let started = std::time::Instant::now();
            let template = Template::load_or_derive(&spec, &parent, &layer, echo)?;
            progress(&format!(
                "layer on {}: template ready in {:.1} s",
                definition.from,
                started.elapsed().as_secs_f64()
            ));
            template
        }
        Plan::Boot(why) => {
            progress(&format!("first boot of its own: {why}"));
            template(&opts, progress, echo)?
        }
    };
    bud_guest::user::save(&opts.build.build_dir, &definition)?;
    Ok(template)
}

/// How a user template's snapshot is made ([`build_user`]).
enum Plan {
    /// Saved already (the same image built before).
    Saved(Template),
    /// From its parent's snapshot, with the files its image adds.
    Layer {
        parent: Template,
        spec: TemplateSpec,
        archive: Vec<u8>,
        warm_from: usize,
        timeout: std::time::Duration,
    },
    /// A first boot of its own, and why.
    Boot(String),
}

/// Whether the user template of `opts` (image built) can be a layer on its parent
/// (`definition.from`): the parent's snapshot saved with the same guest kernel, RAM and
/// network card, no kernel of the parent's waiting in it (a held code-context kernel or a
/// kernel runtime forked before the layer would not see it), and an image that only adds
/// files ([`bud_guest::layer`]).
fn layer_plan(
    opts: &TemplateOptions,
    definition: &bud_guest::definition::Definition,
    progress: &mut dyn FnMut(&str),
) -> Result<Plan, TemplateSetupError> {
    let spec = spec_of(opts)?;
    if let Ok(saved) = Template::load_saved(&spec) {
        return Ok(Plan::Saved(saved));
    }
    let parent_opts = TemplateOptions {
        build: BuildOptions {
            template: definition.from.clone(),
            definition: None,
            ..opts.build.clone()
        },
        guest: GuestBuild::Saved,
        ram_size: None,
        network: opts.network,
    };
    let parent = match template(&parent_opts, progress, None) {
        Ok(parent) => parent,
        Err(e) => {
            return Ok(Plan::Boot(format!(
                "{} has no saved snapshot ({e})",
                definition.from
            )));
        }
    };
    let pm = parent.manifest();
    if pm.kernels.iter().any(|k| k.warm > 0) {
        return Ok(Plan::Boot(format!(
            "{} holds code-context kernels",
            definition.from
        )));
    }
    if pm.runtimes.iter().any(|r| r.run == vmm::Language::Kernel) {
        return Ok(Plan::Boot(format!(
            "{} has a kernel runtime",
            definition.from
        )));
    }
    let parent_spec = spec_of(&parent_opts)?;
    if parent_spec.boot.cmdline() != spec.boot.cmdline() {
        return Ok(Plan::Boot(
            "its kernel command line is not the parent's".to_owned(),
        ));
    }
    let (_, parent_image) = artifact_paths(&opts.build.build_dir, &definition.from);
    let (_, image) = artifact_paths(&opts.build.build_dir, opts.name());
    let (archive, entries) = match bud_guest::layer::delta(&parent_image, &image)? {
        bud_guest::layer::Delta::Layer { archive, entries } => (archive, entries),
        bud_guest::layer::Delta::NotALayer(why) => return Ok(Plan::Boot(why)),
    };
    progress(&format!(
        "layer on {}: {entries} entries, {} KiB",
        definition.from,
        archive.len().div_ceil(1024)
    ));
    let (_, layers) = opts.build.site().map_err(Box::new)?;
    let warm = layers.as_ref().map_or(0, |l| l.warm().len());
    let warm_from = warm - usize::from(definition.warm.is_some());
    let timeout = spec.boot.timeout;
    Ok(Plan::Layer {
        parent,
        spec,
        archive,
        warm_from,
        timeout,
    })
}

/// The guest (found or built), then its template (loaded, or booted and saved: about a
/// minute the first time). `progress` sees the guest build's lines; `echo` the console of a
/// template boot.
pub fn template(
    opts: &TemplateOptions,
    progress: &mut dyn FnMut(&str),
    echo: Option<EchoFn>,
) -> Result<Template, TemplateSetupError> {
    if matches!(opts.guest, GuestBuild::Built | GuestBuild::Saved) {
        let (kernel, initramfs) = artifact_paths(&opts.build.build_dir, opts.name());
        let manifest = bud_guest::manifest_path(&opts.build.build_dir, opts.name());
        if !(kernel.is_file() && initramfs.is_file() && manifest.is_file()) {
            return Err(TemplateSetupError::NotBuilt(opts.name().to_owned()));
        }
    }
    let (kernel, initramfs) = match opts.guest {
        GuestBuild::Existing => built_or_ensure(&opts.build, progress).map_err(Box::new)?,
        GuestBuild::Current => {
            let a = ensure(&opts.build, progress).map_err(Box::new)?;
            (a.kernel, a.initramfs)
        }
        GuestBuild::Built | GuestBuild::Saved => artifact_paths(&opts.build.build_dir, opts.name()),
    };
    let spec = spec_for(opts, kernel, initramfs)?;
    Ok(match opts.guest {
        GuestBuild::Saved => Template::load_saved(&spec)?,
        _ => Template::load_or_build(&spec, echo)?,
    })
}

/// Where the template of `opts` is, its guest already built.
fn spec_of(opts: &TemplateOptions) -> Result<TemplateSpec, TemplateSetupError> {
    let (kernel, initramfs) = artifact_paths(&opts.build.build_dir, opts.name());
    spec_for(opts, kernel, initramfs)
}

/// The template of `opts` booted from `kernel` and `initramfs`: its RAM (the option, or
/// the recipe's), network card and boot timeout, under the build's template root.
fn spec_for(
    opts: &TemplateOptions,
    kernel: PathBuf,
    initramfs: PathBuf,
) -> Result<TemplateSpec, TemplateSetupError> {
    let (site, _) = opts.build.site().map_err(Box::new)?;
    let mut boot = BootConfig::new(kernel, initramfs);
    boot.ram_size = opts.ram_size.unwrap_or_else(|| {
        site.as_ref()
            .map_or(vmm::boot::DEFAULT_RAM_SIZE, |s| s.ram_mib << 20)
    });
    boot.network = opts.network;
    if let Some(site) = &site {
        boot.timeout = std::time::Duration::from_secs(site.boot_timeout_s);
    }
    Ok(TemplateSpec {
        boot,
        root: opts.template_root(),
    })
}
