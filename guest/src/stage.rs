//! The staging tree: a directory on the host laid out exactly like the guest's root, from
//! which the cpio archive is written.
//!
//! This module owns placing things in it (files, symlinks, directories, parents created on the
//! way) and reading symlinks inside an unpacked package tree without ever following them out
//! of it. It never writes outside its root.

use std::path::{Component, Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("reset staging directory {path}")]
    Reset {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("create directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("copy {from} to {to}")]
    Copy {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("symlink {path} -> {target}")]
    Symlink {
        path: PathBuf,
        target: String,
        #[source]
        source: std::io::Error,
    },
    #[error("read link {path}")]
    ReadLink {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("list {path}")]
    List {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is a link loop or too deep")]
    LinkLoop { path: String },
    #[error("path {0:?} leaves its root")]
    Escapes(String),
}

/// A staging root on the host.
#[derive(Debug)]
pub struct Staging {
    root: PathBuf,
}

impl Staging {
    /// Empties (or creates) `root`.
    pub fn reset(root: &Path) -> Result<Staging, StageError> {
        if root.exists() {
            std::fs::remove_dir_all(root).map_err(|source| StageError::Reset {
                path: root.to_owned(),
                source,
            })?;
        }
        std::fs::create_dir_all(root).map_err(|source| StageError::Reset {
            path: root.to_owned(),
            source,
        })?;
        Ok(Staging {
            root: root.to_owned(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Host path of guest path `rel` (`usr/bin/python3`).
    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// True when guest path `rel` exists (a dangling symlink counts).
    pub fn contains(&self, rel: &str) -> bool {
        self.path(rel).symlink_metadata().is_ok()
    }

    /// Creates directory `rel` and its parents.
    pub fn mkdir(&self, rel: &str) -> Result<PathBuf, StageError> {
        let path = self.path(rel);
        std::fs::create_dir_all(&path).map_err(|source| StageError::CreateDir {
            path: path.clone(),
            source,
        })?;
        Ok(path)
    }

    /// Host path of guest path `rel`, its parent directories created.
    pub fn parent_of(&self, rel: &str) -> Result<PathBuf, StageError> {
        let path = self.path(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|source| StageError::CreateDir {
                path: parent.to_owned(),
                source,
            })?;
        }
        Ok(path)
    }

    /// Copies host file `from` to guest path `rel` (contents and permission bits).
    pub fn copy(&self, from: &Path, rel: &str) -> Result<(), StageError> {
        let to = self.parent_of(rel)?;
        let _ = std::fs::remove_file(&to);
        std::fs::copy(from, &to)
            .map(|_| ())
            .map_err(|source| StageError::Copy {
                from: from.to_owned(),
                to,
                source,
            })
    }

    /// Writes `bytes` to guest path `rel`.
    pub fn write(&self, rel: &str, bytes: &[u8]) -> Result<(), StageError> {
        let path = self.parent_of(rel)?;
        std::fs::write(&path, bytes).map_err(|source| StageError::Write { path, source })
    }

    /// Makes guest path `rel` a symlink to `target` (replacing what was there).
    pub fn symlink(&self, rel: &str, target: &str) -> Result<(), StageError> {
        let path = self.parent_of(rel)?;
        let _ = std::fs::remove_file(&path);
        std::os::unix::fs::symlink(target, &path).map_err(|source| StageError::Symlink {
            path,
            target: target.to_owned(),
            source,
        })
    }
}

/// Sorted relative paths of the regular files under `dir`.
pub fn files_under(dir: &Path) -> Result<Vec<String>, StageError> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(current) = dirs.pop() {
        let list_err = |source| StageError::List {
            path: current.clone(),
            source,
        };
        for dirent in std::fs::read_dir(&current).map_err(list_err)? {
            let dirent = dirent.map_err(list_err)?;
            let file_type = dirent.file_type().map_err(list_err)?;
            if file_type.is_dir() {
                dirs.push(dirent.path());
            } else if file_type.is_file() {
                let path = dirent.path();
                out.push(
                    path.strip_prefix(dir)
                        .unwrap_or(&path)
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Lexically normalizes `path` (absolute, or relative to guest directory `base`) into a guest
/// path without a leading `/`. Fails if `..` climbs above the root.
pub fn normalize(base: &str, path: &str) -> Result<String, StageError> {
    let joined = if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        Path::new("/").join(base).join(path)
    };
    let mut parts: Vec<String> = Vec::new();
    for component in joined.components() {
        match component {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                parts
                    .pop()
                    .ok_or_else(|| StageError::Escapes(path.to_owned()))?;
            }
            Component::Normal(part) => parts.push(part.to_string_lossy().into_owned()),
        }
    }
    Ok(parts.join("/"))
}

/// One step of resolving a guest path inside an unpacked tree: the path, and the link target
/// text if it is a symlink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hop {
    pub path: String,
    pub link: Option<String>,
}

/// Follows guest path `rel` through symlinks inside host tree `root`, never leaving it (an
/// absolute target is taken relative to `root`). Returns every hop, the last one not a link;
/// `None` when the final path does not exist. Only the last component is followed: parents
/// are expected to be real directories, as they are in Debian packages.
pub fn resolve_in(root: &Path, rel: &str) -> Result<Option<Vec<Hop>>, StageError> {
    const MAX_HOPS: usize = 16;
    let mut hops = Vec::new();
    let mut current = rel.to_owned();
    for _ in 0..MAX_HOPS {
        let host = root.join(&current);
        let Ok(meta) = host.symlink_metadata() else {
            return Ok(None);
        };
        if !meta.file_type().is_symlink() {
            hops.push(Hop {
                path: current,
                link: None,
            });
            return Ok(Some(hops));
        }
        let target = std::fs::read_link(&host).map_err(|source| StageError::ReadLink {
            path: host.clone(),
            source,
        })?;
        let target = target.to_string_lossy().into_owned();
        let dir = current
            .rsplit_once('/')
            .map_or("", |(dir, _)| dir)
            .to_owned();
        let next = normalize(&dir, &target)?;
        hops.push(Hop {
            path: current,
            link: Some(target),
        });
        current = next;
    }
    Err(StageError::LinkLoop {
        path: rel.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_handles_relative_absolute_and_dotdot() {
        assert_eq!(normalize("lib64", "/lib/x/ld.so").unwrap(), "lib/x/ld.so");
        assert_eq!(normalize("usr/lib", "../bin/./py").unwrap(), "usr/bin/py");
        assert_eq!(normalize("", "a").unwrap(), "a");
        assert!(matches!(
            normalize("a", "../../x"),
            Err(StageError::Escapes(_))
        ));
    }

    #[test]
    fn resolve_follows_links_inside_the_root() {
        let root = std::env::temp_dir().join(format!("bud-stage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("lib/x")).unwrap();
        std::fs::create_dir_all(root.join("lib64")).unwrap();
        std::fs::write(root.join("lib/x/libz.so.1.2"), b"z").unwrap();
        std::os::unix::fs::symlink("libz.so.1.2", root.join("lib/x/libz.so.1")).unwrap();
        std::os::unix::fs::symlink("/lib/x/libz.so.1", root.join("lib64/z")).unwrap();
        std::os::unix::fs::symlink("loop", root.join("lib64/loop")).unwrap();

        let hops = resolve_in(&root, "lib64/z").unwrap().unwrap();

        let paths: Vec<&str> = hops.iter().map(|h| h.path.as_str()).collect();
        assert_eq!(paths, ["lib64/z", "lib/x/libz.so.1", "lib/x/libz.so.1.2"]);
        assert_eq!(hops[0].link.as_deref(), Some("/lib/x/libz.so.1"));
        assert_eq!(hops[2].link, None);
        assert_eq!(resolve_in(&root, "lib64/none").unwrap(), None);
        assert!(matches!(
            resolve_in(&root, "lib64/loop"),
            Err(StageError::LinkLoop { .. })
        ));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
