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

/// A test's size from environment variable `var` (a positive count), or `ci` when unset:
/// CI runs every long test at a small size that still covers every kind of job; the named
/// scripts (`scripts/stress.sh`, `scripts/reset-exactness.sh`, `scripts/fuzz.sh`) run them
/// at full size.
pub fn size(var: &str, ci: usize) -> usize {
    match std::env::var(var) {
        Err(_) => ci,
        Ok(v) => match v.parse() {
            Ok(n) if n > 0 => n,
            _ => panic!("{var}={v:?}: want a positive number"),
        },
    }
}

pub fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "\n\n*** THIS TEST NEEDS /dev/kvm AND THIS MACHINE HAS NONE: IT CANNOT RUN HERE ***\n\n"
    );
}

/// The guest kernel and image, built on first use (minutes), reused after. Built once per
/// test binary (other binaries and processes wait on the build lock and find it done); a
/// failed build is remembered, so every test that needs it fails with its real cause rather
/// than building again.
pub fn guest() -> &'static GuestArtifacts {
    static GUEST: OnceLock<Result<GuestArtifacts, String>> = OnceLock::new();
    let built = GUEST.get_or_init(|| {
        require_kvm();
        let opts = BuildOptions::new(source_dir());
        bud_guest::ensure(&opts, &mut |line: &str| eprintln!("[guest build] {line}"))
            .map_err(|e| format!("{:#}", anyhow::Error::new(e)))
    });
    match built {
        Ok(g) => g,
        Err(e) => panic!("building the guest (kernel + image) failed: {e}"),
    }
}

pub fn boot_config() -> BootConfig {
    let g = guest();
    BootConfig::new(&g.kernel, &g.initramfs)
}

/// Where the tests keep templates (inside the ignored build folder).
pub fn template_root() -> PathBuf {
    source_dir().join("build").join("templates")
}

/// The default template, the one way every caller gets it ([`bud_guest::template`]), over
/// the guest of [`guest`] (brought up to date with its inputs once per binary). The first
/// call boots and saves it or loads it; later calls load it from disk; a failure is
/// remembered like [`guest`]'s.
pub fn template() -> Template {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    let load = || {
        let opts = bud_guest::TemplateOptions::new(source_dir());
        bud_guest::template(
            &opts,
            &mut |line: &str| eprintln!("[guest build] {line}"),
            None,
        )
        .map_err(|e| format!("{:#}", anyhow::Error::new(e)))
    };
    let mut first = None;
    let ready = READY.get_or_init(|| {
        guest();
        first = Some(load()?);
        Ok(())
    });
    match (ready, first) {
        (Err(e), _) => panic!("preparing the template failed: {e}"),
        (Ok(()), Some(t)) => t,
        (Ok(()), None) => load().unwrap_or_else(|e| panic!("loading the template failed: {e}")),
    }
}

/// One executor over the default template for this test binary, with a small pool.
pub fn executor() -> &'static Executor {
    static EXEC: OnceLock<Executor> = OnceLock::new();
    EXEC.get_or_init(|| {
        Executor::new(template(), vmm::ExecutorOptions::default())
            .expect("starting the executor failed")
    })
}
