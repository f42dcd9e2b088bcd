//! The one way to get a template: the guest found or built, then the template loaded from
//! disk or booted and saved. `bud run`, `bud serve`, the integration tests and the benchmarks
//! all come through [`template`].

use std::path::PathBuf;

use vmm::devices::console::EchoFn;
use vmm::{BootConfig, Template, TemplateSpec};

use crate::pipeline::{BuildError, BuildOptions, built_or_ensure, ensure};

/// How much to trust an existing guest build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestBuild {
    /// Use the kernel and image under the build directory as they are; build them only if
    /// missing (fast: what `bud run` and `bud serve` do; `bud guest build` updates them).
    Existing,
    /// Bring them up to date with their inputs first (tests and benchmarks: a changed patch
    /// or recipe must not go unnoticed).
    Current,
}

/// Errors of getting a template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateSetupError {
    #[error("building the guest kernel and image: {0}")]
    Guest(#[from] Box<BuildError>),
    #[error("preparing the template: {0}")]
    Template(#[from] vmm::template::TemplateError),
}

/// What to prepare.
#[derive(Debug)]
pub struct TemplateOptions {
    pub build: BuildOptions,
    pub guest: GuestBuild,
    /// Guest RAM in bytes (part of the template's identity).
    pub ram_size: u64,
}

impl TemplateOptions {
    /// Defaults for the source tree at `source_dir`: its `build/`, an existing guest build,
    /// the default guest RAM.
    pub fn new(source_dir: impl Into<PathBuf>) -> Self {
        Self {
            build: BuildOptions::new(source_dir),
            guest: GuestBuild::Existing,
            ram_size: vmm::boot::DEFAULT_RAM_SIZE,
        }
    }

    /// Where templates are kept: `<build>/templates`.
    pub fn template_root(&self) -> PathBuf {
        self.build.build_dir.join("templates")
    }
}

/// The guest (found or built), then its template (loaded, or booted and saved: about a
/// minute the first time). `progress` sees the guest build's lines; `echo` the console of a
/// template boot.
pub fn template(
    opts: &TemplateOptions,
    progress: &mut dyn FnMut(&str),
    echo: Option<EchoFn>,
) -> Result<Template, TemplateSetupError> {
    let (kernel, initramfs) = match opts.guest {
        GuestBuild::Existing => built_or_ensure(&opts.build, progress).map_err(Box::new)?,
        GuestBuild::Current => {
            let a = ensure(&opts.build, progress).map_err(Box::new)?;
            (a.kernel, a.initramfs)
        }
    };
    let mut boot = BootConfig::new(kernel, initramfs);
    boot.ram_size = opts.ram_size;
    let spec = TemplateSpec {
        boot,
        root: opts.template_root(),
    };
    Ok(Template::load_or_build(&spec, echo)?)
}
