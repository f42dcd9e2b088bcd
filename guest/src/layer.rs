//! A user template as a layer over its parent's snapshot: what the child's image adds to the
//! parent's, and whether that is all it does.
//!
//! A user template's image is the parent's image plus its packages, wheels and files (and
//! a new worker manifest). Booting it costs a minute or more on kvm_pvm, and redoes what the
//! parent's first boot did; a clone of the parent's snapshot that unpacks only the added
//! files and runs the child's own warm-up gets there in seconds (`vmm::template::Layer`,
//! `guest/python/bud_layer.py`). That is sound only if the layer adds files: a file the
//! parent already has may be loaded in the parent's running worker (a module imported,
//! a library mapped), which a changed file on disk would not change. So [`delta`] compares
//! the two archives entry by entry and refuses, naming the first path, any layer that
//! removes or changes what the parent has, but the worker manifest (read again by the
//! layer). Archives from [`crate::cpio`] are deterministic (owners, times and inode
//! numbers fixed), so equal entries are equal bytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::cpio::{CpioError, Data, Entry, Writer};

/// The one file of the parent's image a layer may change: the worker manifest, which
/// `bud_layer.apply` reads after unpacking.
const MAY_CHANGE: &[&str] = &[crate::site::MANIFEST_PATH];

const S_IFMT: u32 = 0o170000;
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const HEADER: usize = 110;
const TRAILER: &str = "TRAILER!!!";

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a newc archive: {why} at byte {at}")]
    Torn {
        path: PathBuf,
        why: &'static str,
        at: usize,
    },
    #[error("writing the layer's archive: {0}")]
    Write(#[from] CpioError),
}

/// What a child image adds to its parent's, or why it is not a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    /// Only additions (and the worker manifest): a `newc` archive of them.
    Layer { archive: Vec<u8>, entries: usize },
    /// The child removes or changes what the parent has: it needs a first boot of its own.
    NotALayer(String),
}

/// One member of an archive, its data borrowed.
struct Member<'a> {
    name: &'a str,
    mode: u32,
    data: &'a [u8],
}

/// The members of the `newc` archive `bytes` (read from `path`, for errors), in order.
fn members<'a>(bytes: &'a [u8], path: &Path) -> Result<Vec<Member<'a>>, LayerError> {
    let torn = |why, at| LayerError::Torn {
        path: path.to_path_buf(),
        why,
        at,
    };
    let field = |at: usize, i: usize| -> Result<usize, LayerError> {
        let digits = bytes
            .get(at + 6 + 8 * i..at + 14 + 8 * i)
            .ok_or(torn("a short header", at))?;
        std::str::from_utf8(digits)
            .ok()
            .and_then(|d| usize::from_str_radix(d, 16).ok())
            .ok_or(torn("a header field that is not hex", at))
    };
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        if bytes.get(at..at + 6) != Some(b"070701") {
            return Err(torn("no newc magic", at));
        }
        let (mode, size, name_size) = (field(at, 1)?, field(at, 6)?, field(at, 11)?);
        let name = bytes
            .get(at + HEADER..(at + HEADER + name_size).saturating_sub(1))
            .and_then(|n| std::str::from_utf8(n).ok())
            .ok_or(torn("a name that is not UTF-8 or ends early", at))?;
        let start = (at + HEADER + name_size + 3) & !3;
        let data = bytes
            .get(start..start + size)
            .ok_or(torn("data past the end", at))?;
        at = (start + size + 3) & !3;
        if name == TRAILER {
            return Ok(out);
        }
        out.push(Member {
            name,
            mode: mode as u32,
            data,
        });
    }
}

fn read(path: &Path) -> Result<Vec<u8>, LayerError> {
    std::fs::read(path).map_err(|source| LayerError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// What `child`'s archive adds to `parent`'s (module docs).
pub fn delta(parent: &Path, child: &Path) -> Result<Delta, LayerError> {
    let parent_bytes = read(parent)?;
    let mut had: HashMap<String, (u32, [u8; 32])> = HashMap::new();
    for m in members(&parent_bytes, parent)? {
        had.insert(m.name.to_owned(), (m.mode, Sha256::digest(m.data).into()));
    }
    drop(parent_bytes);
    let child_bytes = read(child)?;
    let mut writer = Writer::new(Vec::new());
    let mut entries = 0;
    for m in members(&child_bytes, child)? {
        if let Some((mode, hash)) = had.remove(m.name) {
            let same = mode == m.mode && hash == <[u8; 32]>::from(Sha256::digest(m.data));
            if same {
                continue;
            }
            if !MAY_CHANGE.contains(&m.name) {
                return Ok(Delta::NotALayer(format!(
                    "it changes /{} of the parent's image",
                    m.name
                )));
            }
        }
        let perm = m.mode & 0o7777;
        let entry = match m.mode & S_IFMT {
            S_IFDIR => Entry::dir(m.name, perm),
            S_IFREG => Entry::file(m.name, perm, Data::Bytes(m.data.to_vec())),
            S_IFLNK => Entry::symlink(m.name, &String::from_utf8_lossy(m.data)),
            _ => {
                return Ok(Delta::NotALayer(format!(
                    "it adds /{}, which is not a file, directory or link",
                    m.name
                )));
            }
        };
        writer.append(&entry)?;
        entries += 1;
    }
    if let Some(gone) = had.keys().min() {
        return Ok(Delta::NotALayer(format!(
            "it lacks /{gone} of the parent's image"
        )));
    }
    let (archive, _) = writer.finish()?;
    Ok(Delta::Layer { archive, entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(dir: &Path, name: &str, entries: &[Entry]) -> PathBuf {
        let mut w = Writer::new(Vec::new());
        for e in entries {
            w.append(e).unwrap();
        }
        let path = dir.join(name);
        std::fs::write(&path, w.finish().unwrap().0).unwrap();
        path
    }

    fn file(path: &str, text: &str) -> Entry {
        Entry::file(path, 0o644, Data::Bytes(text.as_bytes().to_vec()))
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("bud-layer-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn base() -> Vec<Entry> {
        vec![
            Entry::dir("usr", 0o755),
            Entry::dir("usr/lib", 0o755),
            Entry::dir("usr/lib/bud", 0o755),
            file(crate::site::MANIFEST_PATH, "{}"),
            file("usr/lib/os.py", "x = 1"),
        ]
    }

    #[test]
    fn a_child_that_only_adds_is_a_layer_of_its_additions_and_manifest() {
        let d = tmp("adds");
        let parent = archive(&d, "p", &base());
        let mut more = base();
        more[3] = file(crate::site::MANIFEST_PATH, r#"{"env": {"A": "1"}}"#);
        more.push(Entry::dir("usr/bin", 0o755));
        more.push(Entry {
            perm: 0o755,
            ..file("usr/bin/jq", "ELF")
        });
        more.push(Entry::symlink("usr/bin/jq1", "jq"));
        let child = archive(&d, "c", &more);

        let Delta::Layer { archive, entries } = delta(&parent, &child).unwrap() else {
            panic!("not a layer");
        };
        assert_eq!(entries, 4);
        let got: Vec<(String, u32, Vec<u8>)> = members(&archive, &d)
            .unwrap()
            .into_iter()
            .map(|m| (m.name.to_owned(), m.mode, m.data.to_vec()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    crate::site::MANIFEST_PATH.to_owned(),
                    S_IFREG | 0o644,
                    br#"{"env": {"A": "1"}}"#.to_vec()
                ),
                ("usr/bin".to_owned(), S_IFDIR | 0o755, vec![]),
                ("usr/bin/jq".to_owned(), S_IFREG | 0o755, b"ELF".to_vec()),
                ("usr/bin/jq1".to_owned(), S_IFLNK | 0o777, b"jq".to_vec()),
            ]
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_child_that_changes_or_removes_a_parent_file_is_not_a_layer() {
        let d = tmp("changes");
        let parent = archive(&d, "p", &base());
        let mut changed = base();
        changed[4] = file("usr/lib/os.py", "x = 2");
        let child = archive(&d, "c", &changed);
        assert_eq!(
            delta(&parent, &child).unwrap(),
            Delta::NotALayer("it changes /usr/lib/os.py of the parent's image".to_owned())
        );
        let mut mode = base();
        mode[4].perm = 0o755;
        let child = archive(&d, "m", &mode);
        assert!(matches!(
            delta(&parent, &child).unwrap(),
            Delta::NotALayer(_)
        ));
        let mut removed = base();
        removed.pop();
        let child = archive(&d, "r", &removed);
        assert_eq!(
            delta(&parent, &child).unwrap(),
            Delta::NotALayer("it lacks /usr/lib/os.py of the parent's image".to_owned())
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_torn_archive_is_an_error_naming_it() {
        let d = tmp("torn");
        let parent = archive(&d, "p", &base());
        let bytes = std::fs::read(&parent).unwrap();
        let torn = d.join("t");
        std::fs::write(&torn, &bytes[..bytes.len() / 2]).unwrap();
        let err = delta(&parent, &torn).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{} is not a newc archive", torn.display())),
            "{err}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
