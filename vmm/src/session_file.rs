//! Sessions on disk: one file holds everything a session is beyond its template (the pages
//! where its memory differs from the template's, its vCPU and device state, its clock and
//! counters, and the caller's own record), so that the session can be ended and made again
//! later, in this process or in another one on the same template: how a server pauses,
//! resumes and snapshots sessions and finds them again after a restart.
//!
//! **Layout** (one file, so that it is written atomically and can be moved as it is):
//!
//! ```text
//! [pages of run 0][pages of run 1]...   page-aligned from offset 0
//! [header: bincode of Header]           runs, checksum of the pages, machine state, ...
//! [footer: 32 bytes]                    magic, format version, header length and CRC,
//!                                       length of the pages
//! ```
//!
//! The pages come first so that each run can be mapped straight from the file; the header
//! after them because its checksum of the pages is known only once they are written.
//!
//! **Writing** ([`write`]) goes to a temporary file (mode 0600: it is guest memory) in the
//! same folder, `fsync`s it, renames
//! it over the final name and `fsync`s the folder: a crash leaves either the whole new file
//! or none (the old one, if any), never a torn one under the final name.
//!
//! **Reading** ([`read`]) checks the footer's magic and version, the header's length and
//! CRC-32, that every run lies inside guest RAM and the pages fill exactly the space before
//! the header, and that the file was made on this template and host. [`verify_pages`] reads
//! every page back and checks their CRC-32 (the one check that reads the whole file).
//!
//! **Loading** maps the runs copy-on-write over a fresh clone of the template, as a fork
//! child maps its parent's layers ([`crate::layer`]): it costs a few mmaps, and the pages
//! are read from the file (the page cache) only as the guest touches them. Many sessions
//! loaded from one file share its pages in the page cache.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::memory::{GuestRam, PAGE_SIZE};
use crate::snapshot::MachineState;

/// The footer's first bytes.
const MAGIC: [u8; 8] = *b"BUDSESS\0";
/// Version of the format (of [`Header`] and of [`MachineState`] in it). Bump on any change;
/// a file of another version is refused, never guessed at.
pub const FORMAT_VERSION: u32 = 1;
const FOOTER_LEN: u64 = 32;
/// Largest header read (runs are at most [`crate::layer::MAX_RUNS`], the state a few KiB,
/// the caller's record what it chooses): a bigger one is not a file of ours.
const MAX_HEADER: u64 = 16 << 20;
/// Bytes read or written per call.
const CHUNK: usize = 1 << 20;

/// Errors reading or writing a session file.
#[derive(Debug, thiserror::Error)]
pub enum SessionFileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a bud session file (no footer)")]
    NotOurs { path: PathBuf },
    #[error("{path}: session file format version {found}, this bud reads version {FORMAT_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("{path}: corrupt session file: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("{path}: made on template {found}, not on this one ({want})")]
    OtherTemplate {
        path: PathBuf,
        found: String,
        want: String,
    },
    #[error("{path}: made on another host ({found}), not on this one ({want})")]
    OtherHost {
        path: PathBuf,
        found: String,
        want: String,
    },
    #[error("encoding the session's state: {0}")]
    Encode(bincode::Error),
}

/// What a session file says besides its pages.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Header {
    /// The template's key (its folder's name) and the host it was captured on.
    pub template: String,
    pub host_identity: String,
    pub ram_size: u64,
    /// (first guest page, page count), ascending, disjoint; stored one after another.
    pub runs: Vec<(u64, u64)>,
    /// CRC-32 of all the pages, in file order.
    pub pages_crc: u32,
    pub machine: MachineState,
    pub sequence: u32,
    pub executions: u64,
    pub parked_wall_ns: i128,
    pub ran_processes: bool,
    /// The caller's own record (opaque here).
    pub app: Vec<u8>,
}

/// A session file, read and checked (not its pages).
#[derive(Debug)]
pub struct SessionFile {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    pub(crate) header: Header,
}

impl SessionFile {
    /// The caller's record it holds.
    pub fn app(&self) -> &[u8] {
        &self.header.app
    }

    /// Bytes of guest memory it holds.
    pub fn page_bytes(&self) -> u64 {
        self.header.runs.iter().map(|r| r.1).sum::<u64>() * PAGE_SIZE
    }

    /// The key of the template it needs.
    pub fn template(&self) -> &str {
        &self.header.template
    }

    /// Where it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Byte offset of each run in the file.
    pub(crate) fn file_offsets(&self) -> Vec<u64> {
        let mut at = 0;
        self.header
            .runs
            .iter()
            .map(|&(_, pages)| {
                let here = at;
                at += pages * PAGE_SIZE;
                here
            })
            .collect()
    }

    /// Checks that it was made on template `t` and this host (a file from another machine
    /// of the same template and CPU loads; any other is refused with why).
    pub fn check_template(&self, t: &crate::Template) -> Result<(), SessionFileError> {
        check_origin(self, &t.key(), t.state().ram_size, &t.state().host_identity)
    }

    /// Reads every page and checks their CRC-32 against the header's.
    pub fn verify_pages(&self) -> Result<(), SessionFileError> {
        let io = |source| SessionFileError::Io {
            path: self.path.clone(),
            source,
        };
        let len = self.page_bytes();
        let mut h = crc32fast::Hasher::new();
        let mut buf = vec![0u8; CHUNK];
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(CHUNK as u64) as usize;
            self.file.read_exact_at(&mut buf[..n], at).map_err(io)?;
            h.update(&buf[..n]);
            at += n as u64;
        }
        if h.finalize() != self.header.pages_crc {
            return Err(SessionFileError::Corrupt {
                path: self.path.clone(),
                what: "the pages' checksum does not match".into(),
            });
        }
        Ok(())
    }
}

/// What writing a session file cost.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteStats {
    /// Bytes of guest memory written, and the runs they make.
    pub page_bytes: u64,
    pub runs: usize,
    /// Copying the pages (and their checksum) into the file, then `fsync` and rename.
    pub copy: std::time::Duration,
    pub sync: std::time::Duration,
}

/// Writes `header` (its `pages_crc` filled in here) and the pages of `ram` it lists to
/// `path`, atomically (module docs).
pub(crate) fn write(
    path: &Path,
    ram: &GuestRam,
    mut header: Header,
) -> Result<WriteStats, SessionFileError> {
    let io = |source| SessionFileError::Io {
        path: path.to_owned(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{}.tmp", name.unwrap_or_default()));
    let started = std::time::Instant::now();
    let written = (|| {
        // Guest memory: readable by this user alone.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        let mut h = crc32fast::Hasher::new();
        let mut buf = vec![0u8; CHUNK];
        let mut at = 0u64;
        for &(first, pages) in &header.runs {
            let mut addr = first * PAGE_SIZE;
            let end = addr + pages * PAGE_SIZE;
            while addr < end {
                let n = (end - addr).min(CHUNK as u64) as usize;
                ram.read(addr, &mut buf[..n])
                    .map_err(std::io::Error::other)?;
                h.update(&buf[..n]);
                f.write_all_at(&buf[..n], at)?;
                addr += n as u64;
                at += n as u64;
            }
        }
        header.pages_crc = h.finalize();
        let encoded = bincode::serialize(&header).map_err(std::io::Error::other)?;
        let mut footer = Vec::with_capacity(FOOTER_LEN as usize);
        footer.extend_from_slice(&MAGIC);
        footer.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        footer.extend_from_slice(&crc32fast::hash(&encoded).to_le_bytes());
        footer.extend_from_slice(&(encoded.len() as u64).to_le_bytes());
        footer.extend_from_slice(&at.to_le_bytes());
        f.write_all_at(&encoded, at)?;
        f.write_all_at(&footer, at + encoded.len() as u64)?;
        f.flush()?;
        Ok::<_, std::io::Error>((f, at))
    })();
    let (f, page_bytes) = match written {
        Ok(w) => w,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
    };
    let copy = started.elapsed();
    let synced = f
        .sync_all()
        .and_then(|()| std::fs::rename(&tmp, path))
        .and_then(|()| File::open(dir)?.sync_all());
    if let Err(e) = synced {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(WriteStats {
        page_bytes,
        runs: header.runs.len(),
        copy,
        sync: started.elapsed() - copy,
    })
}

/// Reads and checks a session file's footer and header (module docs), not its pages.
pub fn read(path: &Path) -> Result<SessionFile, SessionFileError> {
    let io = |source| SessionFileError::Io {
        path: path.to_owned(),
        source,
    };
    let corrupt = |what: String| SessionFileError::Corrupt {
        path: path.to_owned(),
        what,
    };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len < FOOTER_LEN {
        return Err(SessionFileError::NotOurs {
            path: path.to_owned(),
        });
    }
    let mut footer = [0u8; FOOTER_LEN as usize];
    file.read_exact_at(&mut footer, len - FOOTER_LEN)
        .map_err(io)?;
    if footer[..8] != MAGIC {
        return Err(SessionFileError::NotOurs {
            path: path.to_owned(),
        });
    }
    let word = |at: usize| {
        u32::from_le_bytes([footer[at], footer[at + 1], footer[at + 2], footer[at + 3]])
    };
    let long = |at: usize| u64::from_le_bytes(footer[at..at + 8].try_into().unwrap_or([0; 8]));
    let version = word(8);
    if version != FORMAT_VERSION {
        return Err(SessionFileError::Version {
            path: path.to_owned(),
            found: version,
        });
    }
    let (header_crc, header_len, pages_len) = (word(12), long(16), long(24));
    if header_len > MAX_HEADER
        || pages_len % PAGE_SIZE != 0
        || pages_len
            .checked_add(header_len)
            .and_then(|n| n.checked_add(FOOTER_LEN))
            != Some(len)
    {
        return Err(corrupt(format!(
            "{len} bytes do not make {pages_len} bytes of pages, a header of {header_len} and the footer"
        )));
    }
    let mut encoded = vec![0u8; header_len as usize];
    file.read_exact_at(&mut encoded, pages_len).map_err(io)?;
    if crc32fast::hash(&encoded) != header_crc {
        return Err(corrupt("the header's checksum does not match".into()));
    }
    let header: Header =
        bincode::deserialize(&encoded).map_err(|e| corrupt(format!("header: {e}")))?;
    let ram_pages = header.ram_size / PAGE_SIZE;
    let mut next = 0u64;
    let mut total = 0u64;
    for &(first, pages) in &header.runs {
        if first < next || pages == 0 || first.saturating_add(pages) > ram_pages {
            return Err(corrupt(format!(
                "page run {first}+{pages} is out of order or outside {ram_pages} pages"
            )));
        }
        next = first + pages;
        total += pages;
    }
    if total * PAGE_SIZE != pages_len {
        return Err(corrupt(format!(
            "the runs hold {} bytes, the file {pages_len}",
            total * PAGE_SIZE
        )));
    }
    Ok(SessionFile {
        path: path.to_owned(),
        file,
        header,
    })
}

/// Checks that `f` was made on template `key` (a folder name), of RAM `ram_size`, on host
/// `host_identity`.
fn check_origin(
    f: &SessionFile,
    key: &str,
    ram_size: u64,
    host_identity: &str,
) -> Result<(), SessionFileError> {
    if f.header.template != key || f.header.ram_size != ram_size {
        return Err(SessionFileError::OtherTemplate {
            path: f.path.clone(),
            found: f.header.template.clone(),
            want: key.to_owned(),
        });
    }
    if f.header.host_identity != host_identity {
        return Err(SessionFileError::OtherHost {
            path: f.path.clone(),
            found: f.header.host_identity.clone(),
            want: host_identity.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_or_foreign_files_are_not_ours_and_a_missing_one_is_an_io_error() {
        let dir = std::env::temp_dir().join(format!("bud-session-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let short = dir.join("short");
        std::fs::write(&short, b"hello").unwrap();
        let foreign = dir.join("foreign");
        std::fs::write(&foreign, vec![7u8; 4096]).unwrap();

        assert!(matches!(
            read(&short),
            Err(SessionFileError::NotOurs { .. })
        ));
        assert!(matches!(
            read(&foreign),
            Err(SessionFileError::NotOurs { .. })
        ));
        assert!(matches!(
            read(&dir.join("none")),
            Err(SessionFileError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
