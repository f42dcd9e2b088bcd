//! The `newc` (070701) cpio writer that produces the guest's initramfs.
//!
//! This module owns the archive format and its determinism: the caller hands in entries, the
//! writer assigns inode numbers in order, sets uid/gid 0, mtime 0, nlink 1 (2 for directories)
//! and pads names and data to 4 bytes as the kernel's `init/initramfs.c` expects. [`Tree`]
//! collects a staging directory plus extra entries, sorts them by path and adds any missing
//! parent directory, so the same tree always gives the same bytes. It never reads the clock,
//! the owner or the mtime of a staged file: only contents, the executable bit and link targets.
//!
//! One file although over 500 lines: the writer and the tree are one format, under 400 lines,
//! and the rest is their unit tests (byte-exact archives), kept below the code.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Magic of the "new ASCII" format without checksums.
const NEWC_MAGIC: &[u8; 6] = b"070701";
/// Fixed part of every header: the magic plus 13 fields of 8 hex digits.
const HEADER_LEN: usize = 110;
/// Name of the entry that ends the archive.
const TRAILER: &str = "TRAILER!!!";

const S_IFREG: u32 = 0o100_000;
const S_IFDIR: u32 = 0o040_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFCHR: u32 = 0o020_000;

/// Permission bits of every directory unless an entry says otherwise.
pub const DIR_MODE: u32 = 0o755;
/// Permission bits of a staged file with any execute bit set.
pub const EXEC_MODE: u32 = 0o755;
/// Permission bits of a staged file without execute bits.
pub const FILE_MODE: u32 = 0o644;

#[derive(Debug, thiserror::Error)]
pub enum CpioError {
    #[error("entry path {0:?} is not a relative, normalized UTF-8 path")]
    BadPath(String),
    #[error("{0}: file too large for newc (over 4 GiB)")]
    TooLarge(String),
    #[error("read staged file {path}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("staged file {path} changed size while archiving")]
    SizeChanged { path: PathBuf },
    #[error("walk staging tree at {path}")]
    Walk {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("staging tree holds {path}, which is neither file, directory nor symlink")]
    UnsupportedFileType { path: PathBuf },
    #[error("write archive")]
    Write(#[source] io::Error),
}

/// Where a regular file's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Data {
    Bytes(Vec<u8>),
    /// Read when the archive is written; the size is taken then too.
    Path(PathBuf),
}

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    File(Data),
    Dir,
    Symlink(String),
    CharDev { major: u32, minor: u32 },
}

/// One archive member: a path relative to the archive root (`bin/sh`, no leading `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: String,
    /// Permission bits only (`0o755`); the file type comes from `kind`.
    pub perm: u32,
    pub kind: Kind,
}

impl Entry {
    pub fn file(path: &str, perm: u32, data: Data) -> Self {
        Entry {
            path: path.to_owned(),
            perm,
            kind: Kind::File(data),
        }
    }

    pub fn dir(path: &str, perm: u32) -> Self {
        Entry {
            path: path.to_owned(),
            perm,
            kind: Kind::Dir,
        }
    }

    pub fn symlink(path: &str, target: &str) -> Self {
        Entry {
            path: path.to_owned(),
            perm: 0o777,
            kind: Kind::Symlink(target.to_owned()),
        }
    }

    pub fn char_dev(path: &str, perm: u32, major: u32, minor: u32) -> Self {
        Entry {
            path: path.to_owned(),
            perm,
            kind: Kind::CharDev { major, minor },
        }
    }
}

/// Streams entries out in `newc` format. Inode numbers count up from 1 in write order.
#[derive(Debug)]
pub struct Writer<W: Write> {
    out: W,
    next_ino: u32,
    written: u64,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Self {
        Writer {
            out,
            next_ino: 1,
            written: 0,
        }
    }

    /// Appends one entry.
    pub fn append(&mut self, entry: &Entry) -> Result<(), CpioError> {
        check_path(&entry.path)?;
        let perm = entry.perm & 0o7777;
        let ino = self.next_ino;
        self.next_ino += 1;
        match &entry.kind {
            Kind::Dir => self.header_and_data(&entry.path, ino, S_IFDIR | perm, 2, (0, 0), &[]),
            Kind::Symlink(target) => self.header_and_data(
                &entry.path,
                ino,
                S_IFLNK | perm,
                1,
                (0, 0),
                target.as_bytes(),
            ),
            Kind::CharDev { major, minor } => {
                self.header_and_data(&entry.path, ino, S_IFCHR | perm, 1, (*major, *minor), &[])
            }
            Kind::File(Data::Bytes(bytes)) => {
                self.header_and_data(&entry.path, ino, S_IFREG | perm, 1, (0, 0), bytes)
            }
            Kind::File(Data::Path(path)) => self.file_from_path(&entry.path, ino, perm, path),
        }
    }

    /// Writes the trailer and hands back the sink and the archive length in bytes.
    pub fn finish(mut self) -> Result<(W, u64), CpioError> {
        self.header(TRAILER, 0, 0, 1, 0, (0, 0))?;
        self.out.flush().map_err(CpioError::Write)?;
        Ok((self.out, self.written))
    }

    fn file_from_path(
        &mut self,
        name: &str,
        ino: u32,
        perm: u32,
        path: &Path,
    ) -> Result<(), CpioError> {
        let read_err = |source| CpioError::ReadFile {
            path: path.to_owned(),
            source,
        };
        let mut file = File::open(path).map_err(read_err)?;
        let len = file.metadata().map_err(read_err)?.len();
        let size = u32::try_from(len).map_err(|_| CpioError::TooLarge(name.to_owned()))?;
        self.header(name, ino, S_IFREG | perm, 1, size, (0, 0))?;
        let copied =
            io::copy(&mut (&mut file).take(len), &mut self.out).map_err(CpioError::Write)?;
        if copied != len {
            return Err(CpioError::SizeChanged {
                path: path.to_owned(),
            });
        }
        self.written += copied;
        self.pad()
    }

    fn header_and_data(
        &mut self,
        name: &str,
        ino: u32,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> Result<(), CpioError> {
        let size = u32::try_from(data.len()).map_err(|_| CpioError::TooLarge(name.to_owned()))?;
        self.header(name, ino, mode, nlink, size, rdev)?;
        self.put(data)?;
        self.pad()
    }

    fn header(
        &mut self,
        name: &str,
        ino: u32,
        mode: u32,
        nlink: u32,
        size: u32,
        (rdev_major, rdev_minor): (u32, u32),
    ) -> Result<(), CpioError> {
        let name_size =
            u32::try_from(name.len() + 1).map_err(|_| CpioError::TooLarge(name.into()))?;
        // Field order from the newc spec: ino, mode, uid, gid, nlink, mtime, filesize,
        // devmajor, devminor, rdevmajor, rdevminor, namesize, check.
        let fields = [
            ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev_major, rdev_minor, name_size, 0,
        ];
        let mut header = Vec::with_capacity(HEADER_LEN + name.len() + 4);
        header.extend_from_slice(NEWC_MAGIC);
        for field in fields {
            header.extend_from_slice(format!("{field:08x}").as_bytes());
        }
        header.extend_from_slice(name.as_bytes());
        header.push(0);
        self.put(&header)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), CpioError> {
        self.out.write_all(bytes).map_err(CpioError::Write)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Pads with NULs to the next multiple of 4 of the total written so far.
    fn pad(&mut self) -> Result<(), CpioError> {
        let fill = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..fill])
    }
}

fn check_path(path: &str) -> Result<(), CpioError> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path.ends_with('/')
        || path.contains('\0')
        || path
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..");
    if bad {
        Err(CpioError::BadPath(path.to_owned()))
    } else {
        Ok(())
    }
}

/// An archive under construction: entries keyed by path, written sorted.
///
/// Sorting by path bytes puts every directory before its children (a prefix sorts first), and
/// [`Tree::write`] adds any parent directory nobody named, so the kernel can always create a
/// child. A later entry for the same path replaces an earlier one: that is how the caller sets
/// the mode of `/tmp` or adds `/dev/console` on top of a staged tree.
#[derive(Debug, Default)]
pub struct Tree {
    entries: BTreeMap<String, Entry>,
}

impl Tree {
    pub fn new() -> Self {
        Tree::default()
    }

    /// Adds (or replaces) one entry.
    pub fn insert(&mut self, entry: Entry) -> Result<(), CpioError> {
        check_path(&entry.path)?;
        self.entries.insert(entry.path.clone(), entry);
        Ok(())
    }

    /// Adds everything under `root`, named relative to it. Modes are normalized: directories
    /// [`DIR_MODE`], files [`EXEC_MODE`] when any execute bit is set, else [`FILE_MODE`].
    pub fn add_dir_tree(&mut self, root: &Path) -> Result<(), CpioError> {
        self.walk(root, root)
    }

    fn walk(&mut self, root: &Path, dir: &Path) -> Result<(), CpioError> {
        let walk_err = |source| CpioError::Walk {
            path: dir.to_owned(),
            source,
        };
        let mut children = Vec::new();
        for dirent in std::fs::read_dir(dir).map_err(walk_err)? {
            children.push(dirent.map_err(walk_err)?.path());
        }
        for path in children {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            let name = rel
                .to_str()
                .ok_or_else(|| CpioError::BadPath(rel.to_string_lossy().into_owned()))?;
            let meta = std::fs::symlink_metadata(&path).map_err(|source| CpioError::Walk {
                path: path.clone(),
                source,
            })?;
            let file_type = meta.file_type();
            if file_type.is_dir() {
                self.insert(Entry::dir(name, DIR_MODE))?;
                self.walk(root, &path)?;
            } else if file_type.is_symlink() {
                let target = std::fs::read_link(&path).map_err(|source| CpioError::Walk {
                    path: path.clone(),
                    source,
                })?;
                let target = target
                    .to_str()
                    .ok_or_else(|| CpioError::BadPath(target.to_string_lossy().into_owned()))?;
                self.insert(Entry::symlink(name, target))?;
            } else if file_type.is_file() {
                let perm = if meta.permissions().mode() & 0o111 != 0 {
                    EXEC_MODE
                } else {
                    FILE_MODE
                };
                self.insert(Entry::file(name, perm, Data::Path(path.clone())))?;
            } else {
                return Err(CpioError::UnsupportedFileType { path });
            }
        }
        Ok(())
    }

    /// Every entry in archive order (parents nobody named appear once
    /// [`Tree::add_missing_parents`] or [`Tree::write`] ran).
    pub fn entries(&self) -> Vec<&Entry> {
        self.entries.values().collect()
    }

    /// Adds every parent directory that has no entry yet, with [`DIR_MODE`].
    pub fn add_missing_parents(&mut self) {
        let mut missing = Vec::new();
        for path in self.entries.keys() {
            let mut parent = path.as_str();
            while let Some((head, _)) = parent.rsplit_once('/') {
                if !self.entries.contains_key(head) {
                    missing.push(head.to_owned());
                }
                parent = head;
            }
        }
        for path in missing {
            self.entries
                .entry(path.clone())
                .or_insert(Entry::dir(&path, DIR_MODE));
        }
    }

    /// Writes the whole archive, trailer included; returns the number of bytes written.
    pub fn write<W: Write>(mut self, out: W) -> Result<u64, CpioError> {
        self.add_missing_parents();
        let mut writer = Writer::new(out);
        for entry in self.entries.values() {
            writer.append(entry)?;
        }
        Ok(writer.finish()?.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(entries: &[Entry]) -> Vec<u8> {
        let mut writer = Writer::new(Vec::new());
        for entry in entries {
            writer.append(entry).unwrap();
        }
        writer.finish().unwrap().0
    }

    fn header(fields: [u32; 13], name: &str) -> Vec<u8> {
        let mut out = b"070701".to_vec();
        for field in fields {
            out.extend_from_slice(format!("{field:08x}").as_bytes());
        }
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out
    }

    /// An archive member as read back: name, mode, nlink, rdev, data.
    type Parsed = (String, u32, u32, (u32, u32), Vec<u8>);

    /// Splits an archive into its members, checking alignment.
    fn parse(bytes: &[u8]) -> Vec<Parsed> {
        let mut out = Vec::new();
        let mut at = 0;
        loop {
            assert_eq!(at % 4, 0, "header at {at} is not 4-aligned");
            assert_eq!(&bytes[at..at + 6], b"070701");
            let field = |i: usize| {
                let s = std::str::from_utf8(&bytes[at + 6 + i * 8..at + 14 + i * 8]).unwrap();
                u32::from_str_radix(s, 16).unwrap()
            };
            let (mode, nlink, size, namesize) = (field(1), field(4), field(6), field(11));
            let rdev = (field(9), field(10));
            let name_start = at + HEADER_LEN;
            let name = std::str::from_utf8(&bytes[name_start..name_start + namesize as usize - 1])
                .unwrap()
                .to_owned();
            let data_start = (name_start + namesize as usize).next_multiple_of(4);
            let data = bytes[data_start..data_start + size as usize].to_vec();
            at = (data_start + size as usize).next_multiple_of(4);
            if name == TRAILER {
                assert_eq!(at, bytes.len(), "bytes after the trailer");
                return out;
            }
            out.push((name, mode, nlink, rdev, data));
        }
    }

    #[test]
    fn small_file_has_exact_header_bytes() {
        let bytes = archive(&[Entry::file("init", 0o755, Data::Bytes(b"hi\n".to_vec()))]);

        // 110 + "init\0" = 115, padded to 116; "hi\n" ends at 119, padded to 120; the trailer
        // header and name end at 241, padded to 244.
        let mut expected = header([1, 0o100755, 0, 0, 1, 0, 3, 0, 0, 0, 0, 5, 0], "init");
        expected.push(0);
        expected.extend_from_slice(b"hi\n\0");
        expected.extend_from_slice(&header([0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 11, 0], TRAILER));
        expected.extend_from_slice(&[0, 0, 0]);
        assert_eq!(bytes, expected);
        let fields: [&str; 14] = [
            "070701", "00000001", "000081ed", "00000000", "00000000", "00000001", "00000000",
            "00000003", "00000000", "00000000", "00000000", "00000000", "00000005", "00000000",
        ];
        assert_eq!(&bytes[..HEADER_LEN], fields.concat().as_bytes());
    }

    #[test]
    fn names_and_data_are_padded_to_four_bytes() {
        let entries: Vec<Entry> = (1..=8)
            .map(|n| Entry::file(&"n".repeat(n), 0o644, Data::Bytes(vec![b'x'; n])))
            .collect();

        let bytes = archive(&entries);

        let parsed = parse(&bytes);
        assert_eq!(parsed.len(), 8);
        assert_eq!(bytes.len() % 4, 0);
        assert_eq!(parsed[4].0, "nnnnn");
        assert_eq!(parsed[4].4, b"xxxxx");
    }

    #[test]
    fn symlink_stores_target_as_data() {
        let bytes = archive(&[Entry::symlink("bin/sh", "busybox")]);

        let parsed = parse(&bytes);
        assert_eq!(
            parsed,
            vec![("bin/sh".into(), 0o120777, 1, (0, 0), b"busybox".to_vec())]
        );
    }

    #[test]
    fn char_device_carries_rdev_and_no_data() {
        let bytes = archive(&[Entry::char_dev("dev/console", 0o600, 5, 1)]);

        let parsed = parse(&bytes);
        assert_eq!(
            parsed,
            vec![("dev/console".into(), 0o020600, 1, (5, 1), vec![])]
        );
    }

    #[test]
    fn directory_has_nlink_two() {
        let bytes = archive(&[Entry::dir("tmp", 0o1777)]);

        let parsed = parse(&bytes);
        assert_eq!(parsed, vec![("tmp".into(), 0o041777, 2, (0, 0), vec![])]);
    }

    #[test]
    fn empty_archive_is_only_the_trailer() {
        let bytes = archive(&[]);

        let mut expected = header([0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 11, 0], TRAILER);
        expected.extend_from_slice(&[0, 0, 0]);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn inode_numbers_count_up_in_write_order() {
        let bytes = archive(&[Entry::dir("a", 0o755), Entry::dir("b", 0o755)]);

        assert_eq!(&bytes[6..14], b"00000001");
        let second = HEADER_LEN + 2; // 110 + "a\0" = 112, already aligned
        assert_eq!(&bytes[second + 6..second + 14], b"00000002");
    }

    #[test]
    fn bad_paths_are_rejected() {
        let mut tree = Tree::new();

        for bad in ["", "/abs", "a/../b", "a//b", "./a", "a/"] {
            assert!(matches!(
                tree.insert(Entry::dir(bad, 0o755)),
                Err(CpioError::BadPath(_))
            ));
        }
    }

    #[test]
    fn tree_sorts_and_adds_missing_parents_first() {
        let mut tree = Tree::new();
        tree.insert(Entry::file("usr/bin/x", 0o755, Data::Bytes(vec![])))
            .unwrap();
        tree.insert(Entry::file("a-b", 0o644, Data::Bytes(vec![])))
            .unwrap();
        tree.insert(Entry::symlink("a/c", "../usr/bin/x")).unwrap();

        let mut bytes = Vec::new();
        tree.write(&mut bytes).unwrap();

        let names: Vec<String> = parse(&bytes).into_iter().map(|e| e.0).collect();
        assert_eq!(names, ["a", "a-b", "a/c", "usr", "usr/bin", "usr/bin/x"]);
    }

    #[test]
    fn later_entry_replaces_earlier_one() {
        let mut tree = Tree::new();
        tree.insert(Entry::dir("tmp", 0o755)).unwrap();
        tree.insert(Entry::dir("tmp", 0o1777)).unwrap();

        let mut bytes = Vec::new();
        tree.write(&mut bytes).unwrap();

        assert_eq!(parse(&bytes)[0].1, 0o041777);
    }

    fn staging_tree(root: &Path) {
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::create_dir_all(root.join("empty")).unwrap();
        std::fs::write(root.join("bin/tool"), b"#!/bin/sh\necho hi\n").unwrap();
        std::fs::set_permissions(
            root.join("bin/tool"),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        std::fs::write(root.join("data.txt"), b"hello").unwrap();
        std::fs::set_permissions(
            root.join("data.txt"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        std::os::unix::fs::symlink("bin/tool", root.join("link")).unwrap();
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bud-cpio-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn staged_tree_modes_are_normalized() {
        let root = scratch("modes");
        staging_tree(&root);
        let mut tree = Tree::new();

        tree.add_dir_tree(&root).unwrap();
        let mut bytes = Vec::new();
        tree.write(&mut bytes).unwrap();

        let got: Vec<(String, u32)> = parse(&bytes).into_iter().map(|e| (e.0, e.1)).collect();
        let want = [
            ("bin", 0o040755),
            ("bin/tool", 0o100755),
            ("data.txt", 0o100644),
            ("empty", 0o040755),
            ("link", 0o120777),
        ];
        assert_eq!(got, want.map(|(n, m)| (n.to_owned(), m)));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn two_builds_of_the_same_tree_are_identical() {
        let (one, two) = (scratch("same-1"), scratch("same-2"));
        staging_tree(&one);
        staging_tree(&two);
        let build = |root: &Path| {
            let mut tree = Tree::new();
            tree.add_dir_tree(root).unwrap();
            tree.insert(Entry::char_dev("dev/console", 0o600, 5, 1))
                .unwrap();
            let mut bytes = Vec::new();
            tree.write(&mut bytes).unwrap();
            bytes
        };

        let (first, second) = (build(&one), build(&two));

        assert_eq!(first, second);
        std::fs::remove_dir_all(&one).unwrap();
        std::fs::remove_dir_all(&two).unwrap();
    }

    #[test]
    fn system_cpio_extracts_what_we_wrote() {
        // The same host-tools step the pipeline runs: installs Debian's `cpio` if missing,
        // so this cross-check runs on a fresh machine too.
        crate::host::ensure_tools(&mut crate::host::Apt::new(), &mut |l: &str| {
            eprintln!("{l}")
        })
        .expect("installing the host tools (cpio) failed");
        let cpio = crate::host::find_program("cpio").expect("`cpio` still missing after install");
        let root = scratch("extract");
        let (src, out) = (root.join("src"), root.join("out"));
        staging_tree(&src);
        std::fs::create_dir_all(&out).unwrap();
        let mut tree = Tree::new();
        tree.add_dir_tree(&src).unwrap();
        tree.insert(Entry::file(
            "deep/dir/f",
            0o644,
            Data::Bytes(b"x".repeat(1001)),
        ))
        .unwrap();
        let archive_path = root.join("a.cpio");
        tree.write(File::create(&archive_path).unwrap()).unwrap();

        let status = std::process::Command::new(cpio)
            .args(["-i", "--quiet", "--no-absolute-filenames", "-F"])
            .arg(&archive_path)
            .current_dir(&out)
            .status()
            .unwrap();

        assert!(status.success());
        assert_eq!(
            std::fs::read(out.join("bin/tool")).unwrap(),
            b"#!/bin/sh\necho hi\n"
        );
        assert_eq!(std::fs::read(out.join("data.txt")).unwrap(), b"hello");
        assert_eq!(
            std::fs::read(out.join("deep/dir/f")).unwrap(),
            b"x".repeat(1001)
        );
        assert_eq!(
            std::fs::read_link(out.join("link")).unwrap(),
            Path::new("bin/tool")
        );
        let mode = std::fs::metadata(out.join("bin/tool"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        assert!(out.join("empty").is_dir());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
