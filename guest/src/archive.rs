//! Directories given with a user template's definition (`archives`): a tar archive (plain
//! or gzip), base64 in the definition's JSON, unpacked into the image at a directory of
//! the guest.
//!
//! What an archive may hold is checked when the definition is, before anything is built,
//! so a bad one is a 400 naming it: regular files and directories only (a link, a device
//! or a FIFO is refused by name: a link could point anywhere in the image), paths relative
//! and clean (no `..`, no absolute path), each file at most the limit of the whole. Owners,
//! times and modes are not taken: files are the image's (root's, or the user's under the
//! work directory), mode 0644, or 0755 where the archive gives any execute bit.

use std::io::Read;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;

/// One file of an archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveFile {
    /// Relative to the archive's root: `src/app.py`.
    pub path: String,
    pub data: Vec<u8>,
    pub executable: bool,
}

/// The bounds one archive must keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArchiveLimits {
    /// Bytes of all files, unpacked.
    pub bytes: u64,
    /// Entries (files and directories).
    pub entries: usize,
}

impl ArchiveLimits {
    /// No bound: for an archive checked already (a stored definition's).
    pub const UNLIMITED: ArchiveLimits = ArchiveLimits {
        bytes: u64::MAX,
        entries: usize::MAX,
    };
}

/// The files of the base64 tar (or tar.gz) `text`, or why it is not one bud takes.
pub fn files(text: &str, limits: &ArchiveLimits) -> Result<Vec<ArchiveFile>, String> {
    let raw = BASE64
        .decode(text.trim())
        .map_err(|e| format!("not base64: {e}"))?;
    let reader: Box<dyn Read + '_> = match raw.starts_with(&[0x1f, 0x8b]) {
        true => Box::new(flate2::read::GzDecoder::new(&raw[..])),
        false => Box::new(&raw[..]),
    };
    let mut archive = tar::Archive::new(reader);
    let mut out = Vec::new();
    let (mut entries, mut bytes) = (0usize, 0u64);
    let entries_of = archive
        .entries()
        .map_err(|e| format!("not a tar archive: {e}"))?;
    for entry in entries_of {
        let mut entry = entry.map_err(|e| format!("not a tar archive: {e}"))?;
        entries += 1;
        if entries > limits.entries {
            return Err(format!("more than {} entries", limits.entries));
        }
        let name = entry
            .path()
            .map_err(|e| format!("an entry's name: {e}"))?
            .to_string_lossy()
            .into_owned();
        let path = clean(&name)?;
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            continue;
        }
        if !kind.is_file() || path.is_empty() {
            return Err(format!(
                "{name:?} is a {}: only files and directories are taken",
                kind_name(kind)
            ));
        }
        let size = entry
            .header()
            .size()
            .map_err(|e| format!("{name:?}: {e}"))?;
        bytes = bytes.saturating_add(size);
        if bytes > limits.bytes {
            return Err(format!("more than {} bytes unpacked", limits.bytes));
        }
        let mut data = Vec::with_capacity(size as usize);
        entry
            .read_to_end(&mut data)
            .map_err(|e| format!("{name:?}: {e}"))?;
        let mode = entry.header().mode().unwrap_or(0o644);
        out.push(ArchiveFile {
            path,
            data,
            executable: mode & 0o111 != 0,
        });
    }
    Ok(out)
}

/// `name` as a clean relative path (`./` and a trailing `/` dropped; `""` for the root,
/// `./`, which only a directory may be), or why it is not one.
fn clean(name: &str) -> Result<String, String> {
    let trimmed = name.trim_start_matches("./").trim_end_matches('/');
    if trimmed.is_empty() || trimmed == "." {
        return Ok(String::new());
    }
    let parts: Vec<&str> = trimmed.split('/').filter(|p| *p != ".").collect();
    let ok = !name.starts_with('/')
        && name.len() <= 4096
        && parts
            .iter()
            .all(|p| !p.is_empty() && *p != ".." && !p.contains('\0'));
    match ok {
        true => Ok(parts.join("/")),
        false => Err(format!(
            "{name:?} is not a clean relative path (no `..`, no absolute path)"
        )),
    }
}

fn kind_name(kind: tar::EntryType) -> &'static str {
    match kind {
        tar::EntryType::Symlink => "symbolic link",
        tar::EntryType::Link => "hard link",
        tar::EntryType::Char | tar::EntryType::Block => "device",
        tar::EntryType::Fifo => "FIFO",
        _ => "special entry",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ArchiveLimits = ArchiveLimits {
        bytes: 1 << 20,
        entries: 100,
    };

    fn header(path: &str, kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        // set_path refuses `..`; a hostile archive writes the name bytes itself.
        let name = &mut h.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h.set_cksum();
        h
    }

    fn tar_of(entries: &[(&str, tar::EntryType, &[u8], u32)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data, mode) in entries {
            let h = header(path, *kind, data.len() as u64, *mode);
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn files_and_directories_unpack_with_their_execute_bit_plain_or_gzip() {
        use tar::EntryType::{Directory, Regular};
        let tar = tar_of(&[
            ("./", Directory, b"", 0o755),
            ("./app/", Directory, b"", 0o755),
            ("./app/main.py", Regular, b"print(1)", 0o644),
            ("app/run.sh", Regular, b"#!/bin/sh", 0o700),
        ]);
        let want = vec![
            ArchiveFile {
                path: "app/main.py".into(),
                data: b"print(1)".to_vec(),
                executable: false,
            },
            ArchiveFile {
                path: "app/run.sh".into(),
                data: b"#!/bin/sh".to_vec(),
                executable: true,
            },
        ];
        assert_eq!(files(&BASE64.encode(&tar), &LIMITS).unwrap(), want);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        let gz = gz.finish().unwrap();
        assert_eq!(files(&BASE64.encode(&gz), &LIMITS).unwrap(), want);
    }

    #[test]
    fn links_escapes_and_oversize_archives_are_refused_by_name() {
        use tar::EntryType::{Regular, Symlink};
        let refused = |entries: &[(&str, tar::EntryType, &[u8], u32)]| {
            files(&BASE64.encode(tar_of(entries)), &LIMITS).unwrap_err()
        };
        assert_eq!(
            refused(&[("../etc/passwd", Regular, b"x", 0o644)]),
            "\"../etc/passwd\" is not a clean relative path (no `..`, no absolute path)"
        );
        assert_eq!(
            refused(&[("/etc/passwd", Regular, b"x", 0o644)]),
            "\"/etc/passwd\" is not a clean relative path (no `..`, no absolute path)"
        );
        assert_eq!(
            refused(&[("a/link", Symlink, b"", 0o777)]),
            "\"a/link\" is a symbolic link: only files and directories are taken"
        );
        let big = vec![b'x'; (LIMITS.bytes + 1) as usize];
        assert_eq!(
            refused(&[("big", Regular, &big, 0o644)]),
            format!("more than {} bytes unpacked", LIMITS.bytes)
        );
        assert_eq!(
            files("%%%", &LIMITS).unwrap_err(),
            "not base64: Invalid symbol 37, offset 0."
        );
        assert!(
            files(
                &BASE64.encode(b"not a tar at all, but long enough to look"),
                &LIMITS
            )
            .unwrap_err()
            .starts_with("not a tar archive"),
        );
    }
}
