//! bud's guest build: the kernel (through `scripts/build-kernel.sh`), the in-guest agent and
//! Python extension (a nested cargo build), and the initramfs they boot from, assembled from
//! Debian packages by a recipe in `guest/image/`.
//!
//! [`ensure`] is the entry point: it runs every step, each cached, and returns the
//! [`GuestArtifacts`] a VM boots. This crate only builds files; it never boots anything (`bud-templates` boots them into templates).

pub mod archive;
pub mod cpio;
pub mod debs;
pub mod definition;
pub mod echo;
pub mod egress_ca;
pub mod elf;
pub mod hashes;
pub mod host;
pub mod image;
pub mod layer;
pub mod libs;
pub mod lock;
pub mod manifest;
pub mod npm;
pub mod pipeline;
pub mod program;
pub mod python;
pub mod recipe;
pub mod run;
pub mod site;
pub mod stage;
pub mod user;
pub mod venv;
pub mod wheels;
pub mod zip;
pub mod zipped;

pub use lock::BuildLock;
pub use pipeline::{
    BuildError, BuildOptions, GuestArtifacts, artifact_paths, built_or_ensure, ensure,
    manifest_path,
};
