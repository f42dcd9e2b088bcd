//! Certificate bundles (the recipe's `rootfs.bundles`), made the way Debian's
//! `update-ca-certificates` makes them at install: the builder unpacks packages and runs no
//! maintainer scripts, so without this the image would hold Mozilla's certificates but no
//! bundle that OpenSSL (Python's `ssl`, curl) reads.

use std::path::Path;

use crate::recipe::Rootfs;
use crate::stage::Staging;

/// Why a bundle of the recipe could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ExtraError {
    #[error("recipe rootfs.bundles `{dest}`: no `*.crt` file in `{dir}` of the packages")]
    EmptyBundle { dest: String, dir: String },
    #[error("read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("stage")]
    Stage(#[from] crate::stage::StageError),
}

/// Stages every bundle `rootfs` names: the `*.crt` files of its directory in the packages
/// unpacked at `root`, in name order, each ending in a newline; then `trusted` (a PEM
/// certificate: bud's egress CA), if given.
pub fn stage(
    rootfs: &Rootfs,
    root: &Path,
    trusted: Option<&str>,
    staging: &Staging,
) -> Result<(), ExtraError> {
    for (dest, dir) in &rootfs.bundles {
        let mut bundle = Vec::new();
        // A directory the packages lack gives no certificate (and the error below).
        let entries = crate::python::sorted_dir(&root.join(dir)).unwrap_or_default();
        let names = entries
            .iter()
            .filter(|(n, t)| t.is_file() && n.ends_with(".crt"));
        for (name, _) in names {
            let path = root.join(dir).join(name);
            let pem = std::fs::read(&path).map_err(|source| ExtraError::Read {
                path: path.display().to_string(),
                source,
            })?;
            bundle.extend_from_slice(&pem);
            if !pem.ends_with(b"\n") {
                bundle.push(b'\n');
            }
        }
        if bundle.is_empty() {
            return Err(ExtraError::EmptyBundle {
                dest: dest.clone(),
                dir: dir.clone(),
            });
        }
        if let Some(pem) = trusted {
            bundle.extend_from_slice(pem.as_bytes());
            if !pem.ends_with('\n') {
                bundle.push(b'\n');
            }
        }
        staging.write(dest, &bundle)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rootfs(bundles: &[(&str, &str)]) -> Rootfs {
        Rootfs {
            dirs: Default::default(),
            links: Default::default(),
            char_devs: Vec::new(),
            bundles: bundles
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        }
    }

    fn tree(name: &str) -> (std::path::PathBuf, Staging) {
        let base = std::env::temp_dir().join(format!("bud-extras-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("unpacked");
        std::fs::create_dir_all(root.join("usr/share/certs")).unwrap();
        std::fs::create_dir_all(root.join("usr/share/empty")).unwrap();
        std::fs::write(root.join("usr/share/certs/b.crt"), b"B\n").unwrap();
        std::fs::write(root.join("usr/share/certs/a.crt"), b"A").unwrap();
        std::fs::write(root.join("usr/share/certs/notes.txt"), b"no").unwrap();
        let staging = Staging::reset(&base.join("rootfs")).unwrap();
        (root, staging)
    }

    #[test]
    fn certificates_are_bundled_in_name_order_each_ending_in_a_newline() {
        let (root, staging) = tree("ok");
        let r = rootfs(&[("etc/ssl/certs/ca-certificates.crt", "usr/share/certs")]);

        stage(&r, &root, None, &staging).unwrap();

        assert_eq!(
            std::fs::read(staging.path("etc/ssl/certs/ca-certificates.crt")).unwrap(),
            b"A\nB\n"
        );
    }

    #[test]
    fn the_trusted_certificate_ends_each_bundle() {
        let (root, staging) = tree("trusted");
        let r = rootfs(&[
            ("etc/ssl/certs/ca-certificates.crt", "usr/share/certs"),
            ("etc/other.crt", "usr/share/certs"),
        ]);

        stage(&r, &root, Some("BUD"), &staging).unwrap();

        for path in ["etc/ssl/certs/ca-certificates.crt", "etc/other.crt"] {
            assert_eq!(std::fs::read(staging.path(path)).unwrap(), b"A\nB\nBUD\n");
        }
    }

    #[test]
    fn a_bundle_without_certificates_is_an_error() {
        let (root, staging) = tree("bad");
        for dir in ["usr/share/empty", "usr/share/missing"] {
            let r = rootfs(&[("x.crt", dir)]);
            assert!(matches!(
                stage(&r, &root, None, &staging),
                Err(ExtraError::EmptyBundle { .. })
            ));
        }
    }
}
