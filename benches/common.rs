//! Shared setup for bud's benchmarks: the guest and template the tests use (built on first
//! use), so a benchmark measures clones, never a boot.
#![allow(dead_code)]

use std::path::PathBuf;

use vmm::Template;

pub fn source_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn template() -> Template {
    let mut opts = bud_templates::TemplateOptions::new(source_dir());
    opts.guest = bud_templates::GuestBuild::Current;
    bud_templates::template(&opts, &mut |l: &str| eprintln!("[guest build] {l}"), None)
        .expect("building the guest or its template failed")
}
