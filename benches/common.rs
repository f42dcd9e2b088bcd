//! Shared setup for bud's benchmarks: the guest and template the tests use (built on first
//! use), so a benchmark measures clones, never a boot.
#![allow(dead_code)]

use std::path::PathBuf;

use vmm::{BootConfig, Template, TemplateSpec};

pub fn source_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn template() -> Template {
    let opts = bud_guest::BuildOptions::new(source_dir());
    let guest = bud_guest::ensure(&opts, &mut |l: &str| eprintln!("[guest build] {l}"))
        .expect("building the guest failed");
    let spec = TemplateSpec {
        boot: BootConfig::new(&guest.kernel, &guest.initramfs),
        root: source_dir().join("build").join("templates"),
    };
    Template::load_or_build(&spec, None).expect("building the template failed")
}
