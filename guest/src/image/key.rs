//! Whether a recorded image is still current: the input hash of everything an image is made
//! of, and the record a build leaves next to the archive.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::{BUILDER_VERSION, IMAGE_FILE, Image, ImageError, ImageInputs, KEY_FILE};
use crate::hashes::HashCache;
use crate::python;
use crate::recipe;
use crate::stage::files_under;

fn hash_of(hashes: &mut HashCache, path: &Path) -> Result<String, ImageError> {
    Ok(hashes.sha256(path)?)
}

/// The input hash: the builder version, every recipe file, the packages (name, version,
/// sha256), a user template's definitions and wheels, the npm specs and the content of
/// their installed tree (every staged file's path, mode and sha256), the agent, the
/// extension and bud's Python modules (only the files staged, so a stray `__pycache__/` in
/// guest/python does not force a rebuild), and the certificate the bundles trust besides.
pub fn input_key(inputs: &ImageInputs, hashes: &mut HashCache) -> Result<String, ImageError> {
    for (what, path) in [("agent", &inputs.agent), ("extension", &inputs.extension)] {
        if !path.is_file() {
            return Err(ImageError::MissingInput {
                what,
                path: path.clone(),
            });
        }
    }
    let mut text = format!(
        "bud-guest-image {BUILDER_VERSION}\ntemplate {}\n",
        inputs.template
    );
    let templates = format!("{}/", recipe::TEMPLATES_DIR);
    let mine = |rel: &str| match &inputs.site {
        None => false,
        Some(site) => {
            let name = &rel[templates.len()..];
            name == format!("{}.toml", inputs.template) || site.warm.as_deref() == Some(name)
        }
    };
    let recipe_files = files_under(&inputs.recipe_dir)?;
    // Other templates' recipes are not this image's input.
    let recipe_files = recipe_files
        .into_iter()
        .filter(|rel| !rel.starts_with(&templates) || mine(rel));
    for rel in recipe_files {
        text.push_str(&format!(
            "recipe {rel} {}\n",
            hash_of(hashes, &inputs.recipe_dir.join(&rel))?
        ));
    }
    for p in inputs.packages.iter().chain(&inputs.site_packages) {
        text.push_str(&format!("deb {} {} {}\n", p.name, p.version, p.sha256));
    }
    if let Some(user) = &inputs.user {
        for def in &user.layers.chain {
            let json = def.to_json();
            text.push_str(&format!(
                "definition {} {}\n",
                def.name,
                hex::encode(Sha256::digest(json.as_bytes()))
            ));
        }
        for wheel in &user.wheels {
            text.push_str(&format!(
                "wheel {} {}\n",
                wheel.path.file_name().unwrap_or_default().to_string_lossy(),
                hash_of(hashes, &wheel.path)?
            ));
        }
    }
    if let Some(tree) = &inputs.npm {
        for spec in &tree.specs {
            text.push_str(&format!("npm {spec}\n"));
        }
        let digest = crate::npm::tree_digest(tree, hashes).map_err(ImageError::Npm)?;
        text.push_str(&format!("npm-tree {digest}\n"));
    }
    text.push_str(&format!("agent {}\n", hash_of(hashes, &inputs.agent)?));
    text.push_str(&format!(
        "extension {}\n",
        hash_of(hashes, &inputs.extension)?
    ));
    if let Some(runtime) = inputs.site.as_ref().and_then(|s| s.runtime.as_ref()) {
        for (from, to) in super::kernel_files(inputs, runtime)? {
            text.push_str(&format!("kernel {to} {}\n", hash_of(hashes, &from)?));
        }
    }
    for path in python::bud_modules(&inputs.python_dir)? {
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        text.push_str(&format!("python {name} {}\n", hash_of(hashes, &path)?));
    }
    if let Some(pem) = &inputs.trusted {
        text.push_str(&format!(
            "trusted {}\n",
            hex::encode(Sha256::digest(pem.as_bytes()))
        ));
    }
    Ok(hex::encode(Sha256::digest(text.as_bytes())))
}

/// The recorded image in `work_dir`, if its input key is `key` and the file is still there
/// with the recorded size.
pub(super) fn current(work_dir: &Path, key: &str) -> Option<Image> {
    let text = std::fs::read_to_string(work_dir.join(KEY_FILE)).ok()?;
    let mut lines = text.lines();
    let (input_key, sha256, size) = (lines.next()?, lines.next()?, lines.next()?.parse().ok()?);
    let path = work_dir.join(IMAGE_FILE);
    let on_disk = path.metadata().ok()?.len();
    (input_key == key && on_disk == size).then(|| Image {
        path,
        sha256: sha256.to_owned(),
        size,
        input_key: key.to_owned(),
        report: None,
    })
}
