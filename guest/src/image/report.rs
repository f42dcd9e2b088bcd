//! What a build put in the image: entries, bytes per part, the largest files, and every file
//! with its size in the work directory's contents list.

use std::path::Path;

use super::{CONTENTS_FILE, ImageError, write_atomically};
use crate::cpio::{self, Tree};
use crate::libs::ElfFile;

/// How many of the largest files a report lists.
const REPORT_LARGEST: usize = 12;

/// What a build put in the image.
#[derive(Debug, Clone)]
pub struct ImageReport {
    /// Archive entries, directories and links included.
    pub entries: usize,
    /// Bytes of regular-file contents per part of the image, largest first.
    pub parts: Vec<(String, u64)>,
    /// The largest files, largest first.
    pub largest: Vec<(String, u64)>,
    /// Every ELF file and what it loads.
    pub elf_files: Vec<ElfFile>,
}

pub(super) struct FullReport {
    pub(super) public: ImageReport,
    pub(super) largest_all: Vec<(String, u64)>,
}

/// The parts of the image a report adds up, by path prefix; the first match wins.
const PARTS: &[(&str, &str)] = &[
    ("usr/bin/python3.11", "python interpreter"),
    (
        "usr/lib/python3.11/lib-dynload/",
        "python extension modules",
    ),
    ("usr/lib/python311.zip", "python standard library (zip)"),
    ("usr/lib/python3.11/", "python standard library landmark"),
    ("usr/lib/bud/", "bud python modules + extension"),
    ("init", "bud agent (/init)"),
    ("bin/busybox", "busybox"),
    ("lib/", "shared libraries"),
    ("usr/lib/", "shared libraries"),
];

pub(super) fn report(tree: &Tree, elf_files: Vec<ElfFile>) -> FullReport {
    let mut files: Vec<(String, u64)> = Vec::new();
    for entry in tree.entries() {
        if let cpio::Kind::File(cpio::Data::Path(path)) = &entry.kind {
            files.push((entry.path.clone(), path.metadata().map_or(0, |m| m.len())));
        }
    }
    files.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut parts: Vec<(String, u64)> = Vec::new();
    for (path, size) in &files {
        let part = PARTS
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix))
            .map_or("other", |(_, name)| name);
        match parts.iter_mut().find(|(name, _)| name == part) {
            Some((_, total)) => *total += size,
            None => parts.push((part.to_owned(), *size)),
        }
    }
    parts.sort_by_key(|part| std::cmp::Reverse(part.1));
    FullReport {
        public: ImageReport {
            entries: tree.entries().len(),
            parts,
            largest: files.iter().take(REPORT_LARGEST).cloned().collect(),
            elf_files,
        },
        largest_all: files,
    }
}

pub(super) fn write_contents(work_dir: &Path, files: &[(String, u64)]) -> Result<(), ImageError> {
    let mut text = String::new();
    for (path, size) in files {
        text.push_str(&format!("{size:>10} /{path}\n"));
    }
    write_atomically(&work_dir.join(CONTENTS_FILE), text.as_bytes())
}
