//! What the host Python test binaries share: the `_bud` extension cargo built.

use std::path::PathBuf;

/// The cdylib cargo built next to this test binary (target/<profile>/lib_bud.so, or the
/// one in deps/): the newer of the two, since a `cargo build` of another day may have left
/// the first one behind.
pub fn built_extension() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    [
        profile_dir.join("lib_bud.so"),
        profile_dir.join("deps/lib_bud.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max_by_key(|(modified, _)| *modified)
    .map(|(_, p)| p)
}
