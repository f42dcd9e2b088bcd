//! Shared setup for the integration tests: the real guest (kernel + initramfs, built or reused
//! through the same pipeline as `bud guest build`) and one template + executor per test binary.
//!
//! These tests need /dev/kvm and a guest build. They never skip silently: without /dev/kvm
//! they fail with a message saying so.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use bud_guest::{BuildOptions, GuestArtifacts};
use vmm::{BootConfig, Executor, Template};

pub fn source_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "\n\n*** THIS TEST NEEDS /dev/kvm AND THIS MACHINE HAS NONE: IT CANNOT RUN HERE ***\n\n"
    );
}

/// The guest kernel and image, built on first use (minutes), reused after.
pub fn guest() -> &'static GuestArtifacts {
    static GUEST: OnceLock<GuestArtifacts> = OnceLock::new();
    GUEST.get_or_init(|| {
        require_kvm();
        let opts = BuildOptions::new(source_dir());
        bud_guest::ensure(&opts, &mut |line: &str| eprintln!("[guest build] {line}"))
            .expect("building the guest (kernel + image) failed")
    })
}

pub fn boot_config() -> BootConfig {
    let g = guest();
    BootConfig::new(&g.kernel, &g.initramfs)
}

/// Where the tests keep templates (inside the ignored build folder).
pub fn template_root() -> PathBuf {
    source_dir().join("build").join("templates")
}

/// The default template, the one way every caller gets it ([`bud_guest::template`]), with
/// the guest brought up to date with its inputs first.
pub fn template() -> Template {
    require_kvm();
    let mut opts = bud_guest::TemplateOptions::new(source_dir());
    opts.guest = bud_guest::GuestBuild::Current;
    bud_guest::template(
        &opts,
        &mut |line: &str| eprintln!("[guest build] {line}"),
        None,
    )
    .expect("building the guest or its template failed")
}

/// One executor over the default template for this test binary, with a small pool.
pub fn executor() -> &'static Executor {
    static EXEC: OnceLock<Executor> = OnceLock::new();
    EXEC.get_or_init(|| {
        Executor::new(template(), vmm::ExecutorOptions::default())
            .expect("starting the executor failed")
    })
}
