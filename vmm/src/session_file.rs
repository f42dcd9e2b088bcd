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
//! [header: bincode of Header]           runs, SHA-256 of the pages, machine state, ...
//! [footer: 72 bytes]                    magic, format version, header CRC-32 and length,
//!                                       length of the pages, key id, MAC
//! ```
//!
//! The pages come first so that each run can be mapped straight from the file; the header
//! after them because its checksum of the pages is known only once they are written.
//!
//! **Authenticated** ([`mac`]): the footer ends with an HMAC-SHA256 of the footer's fields
//! and the header, made with the caller's [`SessionKeys`]; the header holds the pages'
//! SHA-256. A file is read only if one of the reader's keys verifies it: files leave the
//! process (a state directory, an export, another node's import) and anyone can recompute
//! a CRC. Even then its machine state must be its template's ([`check`]).
//!
//! **Writing** ([`write`]) goes to a temporary file (mode 0600: it is guest memory) in the
//! same folder, `fsync`s it, renames
//! it over the final name and `fsync`s the folder: a crash leaves either the whole new file
//! or none (the old one, if any), never a torn one under the final name.
//!
//! **Reading** ([`read`]) checks the footer's magic and version, the header's length and
//! CRC-32 (a torn file), its MAC (a forged or altered one), that every run lies inside guest
//! RAM and the pages fill exactly the space before the header;
//! [`SessionFile::check_template`] that the file was made on this template and host and
//! that its machine state is the template's. [`SessionFile::verify_pages`] reads every page
//! back and checks their SHA-256 (the one check that reads the whole file).
//!
//! Errors never name the file's path (they reach HTTP answers); [`SessionFileError::path`]
//! gives it to a log.
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
use sha2::{Digest, Sha256};

use crate::memory::{GuestRam, PAGE_SIZE};
use crate::snapshot::MachineState;

mod check;
pub mod mac;

pub(crate) use check::xsave_fits;
pub use mac::{KeyError, SessionKeys};

/// The footer's first bytes.
const MAGIC: [u8; 8] = *b"BUDSESS\0";
/// Version of the format (of [`Header`] and of [`MachineState`] in it). Bump on any change;
/// a file of another version is refused, never guessed at. (2: the MAC in the footer, the
/// pages' SHA-256 in the header.)
pub const FORMAT_VERSION: u32 = 2;
/// Magic, version, header CRC-32 and length, pages' length, key id, MAC.
const FOOTER_LEN: u64 = 32 + (mac::KEY_ID_LEN + mac::MAC_LEN) as u64;
/// The footer's bytes the MAC covers (all but the MAC).
const FOOTER_SIGNED: usize = FOOTER_LEN as usize - mac::MAC_LEN;
/// The first and last wall clock (ns since the epoch) a parked session can hold:
/// 2000-01-01, and a day past the host's now (clocks of two nodes differ).
const MIN_PARKED_WALL_NS: i128 = 946_684_800 * 1_000_000_000;
const PARKED_WALL_SLACK_NS: i128 = 24 * 3600 * 1_000_000_000;
/// Largest header read (runs are at most [`crate::layer::MAX_RUNS`], the state a few KiB,
/// the caller's record what it chooses): a bigger one is not a file of ours.
const MAX_HEADER: u64 = 16 << 20;
/// Bytes read or written per call.
const CHUNK: usize = 1 << 20;

/// Errors reading or writing a session file. Their messages never name the file's path
/// (they reach HTTP answers); [`SessionFileError::path`] gives it where there is one.
#[derive(Debug, thiserror::Error)]
pub enum SessionFileError {
    #[error("{source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a bud session file (no footer)")]
    NotOurs { path: PathBuf },
    #[error("session file format version {found}, this bud reads version {FORMAT_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("corrupt session file: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error(
        "the session file is signed with a key this server does not hold (key id {key_id}): \
         export and import need the same session key on both servers"
    )]
    UnknownKey { path: PathBuf, key_id: String },
    #[error("the session file's MAC does not verify: it was altered after it was signed")]
    BadMac { path: PathBuf },
    #[error("made on template {found}, not on this one ({want})")]
    OtherTemplate {
        path: PathBuf,
        found: String,
        want: String,
    },
    #[error("made on another host ({found}), not on this one ({want})")]
    OtherHost {
        path: PathBuf,
        found: String,
        want: String,
    },
    #[error("the session file's machine state is not its template's: {what}")]
    Machine { path: PathBuf, what: String },
    #[error("encoding the session's state: {0}")]
    Encode(bincode::Error),
}

impl SessionFileError {
    /// The file it is about, if any (for a log; the message leaves it out).
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Io { path, .. }
            | Self::NotOurs { path }
            | Self::Version { path, .. }
            | Self::Corrupt { path, .. }
            | Self::UnknownKey { path, .. }
            | Self::BadMac { path }
            | Self::OtherTemplate { path, .. }
            | Self::OtherHost { path, .. }
            | Self::Machine { path, .. } => Some(path),
            Self::Encode(_) => None,
        }
    }
}

/// What a session file says besides its pages (public for [`rewrite`]; its encoding is
/// [`FORMAT_VERSION`]'s).
#[derive(Debug, Serialize, Deserialize)]
pub struct Header {
    /// The template's key (its folder's name) and the host it was captured on.
    pub template: String,
    pub host_identity: String,
    pub ram_size: u64,
    /// (first guest page, page count), ascending, disjoint; stored one after another.
    pub runs: Vec<(u64, u64)>,
    /// SHA-256 of all the pages, in file order.
    pub pages_sha256: [u8; 32],
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
    /// of the same template and CPU loads; any other is refused with why), and that its
    /// machine state and counters are the template's or in range ([`check`]).
    pub fn check_template(&self, t: &crate::Template) -> Result<(), SessionFileError> {
        let s = t.state();
        check_origin(self, &t.key(), s.ram_size, &s.host_identity)?;
        let machine = |what: String| SessionFileError::Machine {
            path: self.path.clone(),
            what,
        };
        check::machine(&self.header.machine, &s.machine).map_err(machine)?;
        let now = crate::identity::host_wall_ns();
        let wall = self.header.parked_wall_ns;
        if !(MIN_PARKED_WALL_NS..=now.saturating_add(PARKED_WALL_SLACK_NS)).contains(&wall) {
            return Err(machine(format!(
                "it was parked at {wall} ns since the epoch, not between 2000 and now"
            )));
        }
        Ok(())
    }

    /// Reads every page and checks their SHA-256 against the header's (which the MAC
    /// covers).
    pub fn verify_pages(&self) -> Result<(), SessionFileError> {
        let io = |source| SessionFileError::Io {
            path: self.path.clone(),
            source,
        };
        let len = self.page_bytes();
        let mut h = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(CHUNK as u64) as usize;
            self.file.read_exact_at(&mut buf[..n], at).map_err(io)?;
            h.update(&buf[..n]);
            at += n as u64;
        }
        if h.finalize()[..] != self.header.pages_sha256 {
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

/// The footer of a file of `header_len` bytes of header (`encoded`) after `pages_len` of
/// pages, signed with `keys`' first key.
fn footer(encoded: &[u8], pages_len: u64, keys: &SessionKeys) -> Vec<u8> {
    let (m, key_id) = keys.sign();
    let mut footer = Vec::with_capacity(FOOTER_LEN as usize);
    footer.extend_from_slice(&MAGIC);
    footer.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    footer.extend_from_slice(&crc32fast::hash(encoded).to_le_bytes());
    footer.extend_from_slice(&(encoded.len() as u64).to_le_bytes());
    footer.extend_from_slice(&pages_len.to_le_bytes());
    footer.extend_from_slice(&key_id);
    let tag = mac::mac_of(m, &footer, encoded);
    footer.extend_from_slice(&tag);
    footer
}

/// Writes `header` (its `pages_sha256` filled in here) and the pages of `ram` it lists to
/// `path`, atomically, signed with `keys`' first key (module docs).
pub(crate) fn write(
    path: &Path,
    ram: &GuestRam,
    mut header: Header,
    keys: &SessionKeys,
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
        let mut h = Sha256::new();
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
        header.pages_sha256 = h.finalize().into();
        let encoded = bincode::serialize(&header).map_err(std::io::Error::other)?;
        let footer = footer(&encoded, at, keys);
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

/// Reads and checks a session file's footer, MAC (with `keys`) and header (module docs),
/// not its pages.
pub fn read(path: &Path, keys: &SessionKeys) -> Result<SessionFile, SessionFileError> {
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
        // A file of format 1 had a shorter footer: its magic is elsewhere.
        let mut old = [0u8; 12];
        let v1 = file.read_exact_at(&mut old, len - 32).is_ok() && old[..8] == MAGIC;
        return Err(if v1 {
            SessionFileError::Version {
                path: path.to_owned(),
                found: u32::from_le_bytes([old[8], old[9], old[10], old[11]]),
            }
        } else {
            SessionFileError::NotOurs {
                path: path.to_owned(),
            }
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
    let (signed, tag) = footer.split_at(FOOTER_SIGNED);
    let key_id = &signed[FOOTER_SIGNED - mac::KEY_ID_LEN..];
    let Some(m) = keys.verifier(key_id) else {
        return Err(SessionFileError::UnknownKey {
            path: path.to_owned(),
            key_id: key_id.iter().map(|b| format!("{b:02x}")).collect(),
        });
    };
    if !mac::verify(m, signed, &encoded, tag) {
        return Err(SessionFileError::BadMac {
            path: path.to_owned(),
        });
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

/// Writes a copy of `f` to `path` with its header and pages as `edit` leaves them (the
/// pages' SHA-256 recomputed), signed with `keys`: for tests and tools that craft files, such
/// as a hostile import's. Not atomic; never used on a path a server serves.
pub fn rewrite(
    f: &SessionFile,
    path: &Path,
    keys: &SessionKeys,
    edit: impl FnOnce(&mut Header, &mut Vec<u8>),
) -> Result<(), SessionFileError> {
    let io = |source| SessionFileError::Io {
        path: path.to_owned(),
        source,
    };
    let mut pages = vec![0u8; f.page_bytes() as usize];
    f.file.read_exact_at(&mut pages, 0).map_err(io)?;
    let mut header: Header =
        bincode::deserialize(&bincode::serialize(&f.header).map_err(SessionFileError::Encode)?)
            .map_err(SessionFileError::Encode)?;
    edit(&mut header, &mut pages);
    header.pages_sha256 = Sha256::digest(&pages).into();
    let encoded = bincode::serialize(&header).map_err(SessionFileError::Encode)?;
    let footer = footer(&encoded, pages.len() as u64, keys);
    pages.extend_from_slice(&encoded);
    pages.extend_from_slice(&footer);
    std::fs::write(path, pages).map_err(io)
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

    const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    const OTHER: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    fn keys(text: &str) -> SessionKeys {
        SessionKeys::parse(text).unwrap()
    }

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("bud-session-file-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A file as `write` makes it, of two pages of 0x5a at guest pages 3 and 4, signed with
    /// `keys`; its header's encoding is `edit`ed first.
    fn file_bytes(keys: &SessionKeys, edit: impl FnOnce(&mut Header)) -> Vec<u8> {
        let pages = vec![0x5au8; 2 * PAGE_SIZE as usize];
        let mut header = Header {
            template: "python-1".into(),
            host_identity: "host".into(),
            ram_size: 64 * PAGE_SIZE,
            runs: vec![(3, 2)],
            pages_sha256: Sha256::digest(&pages).into(),
            machine: check::tests::state(),
            sequence: 1,
            executions: 1,
            parked_wall_ns: crate::identity::host_wall_ns(),
            ran_processes: false,
            app: b"record".to_vec(),
        };
        edit(&mut header);
        let encoded = bincode::serialize(&header).unwrap();
        let mut out = pages;
        let footer = footer(&encoded, out.len() as u64, keys);
        out.extend_from_slice(&encoded);
        out.extend_from_slice(&footer);
        out
    }

    fn read_bytes(
        d: &Path,
        name: &str,
        bytes: &[u8],
        k: &SessionKeys,
    ) -> Result<SessionFile, SessionFileError> {
        let path = d.join(name);
        std::fs::write(&path, bytes).unwrap();
        read(&path, k)
    }

    #[test]
    fn short_or_foreign_files_are_not_ours_and_a_missing_one_is_an_io_error() {
        let dir = dir("foreign");
        let k = keys(KEY);
        let short = dir.join("short");
        std::fs::write(&short, b"hello").unwrap();
        let foreign = dir.join("foreign");
        std::fs::write(&foreign, vec![7u8; 4096]).unwrap();

        assert!(matches!(
            read(&short, &k),
            Err(SessionFileError::NotOurs { .. })
        ));
        assert!(matches!(
            read(&foreign, &k),
            Err(SessionFileError::NotOurs { .. })
        ));
        assert!(matches!(
            read(&dir.join("none"), &k),
            Err(SessionFileError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_signed_file_reads_back_with_its_key_or_a_rotation_that_holds_it() {
        let d = dir("signed");
        let old = keys(KEY);
        let bytes = file_bytes(&old, |_| {});

        let f = read_bytes(&d, "a.bud", &bytes, &old).unwrap();
        let rotated = read_bytes(&d, "b.bud", &bytes, &keys(&format!("{OTHER}\n{KEY}\n")));

        assert_eq!(f.app(), b"record");
        assert_eq!(f.page_bytes(), 2 * PAGE_SIZE);
        f.verify_pages().unwrap();
        assert!(rotated.is_ok());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn no_key_another_key_or_a_recomputed_crc_is_refused() {
        let d = dir("forged");
        let k = keys(KEY);
        let other = keys(OTHER);
        let by_other = file_bytes(&other, |_| {});
        // An attacker's edit: a header byte changed and its CRC recomputed; the MAC kept.
        let good = file_bytes(&k, |_| {});
        let header_at = 2 * PAGE_SIZE as usize;
        let footer_at = good.len() - FOOTER_LEN as usize;
        let mut forged = good.clone();
        forged[footer_at - 1] ^= 0x20; // the record's last byte: "recorD"
        let crc = crc32fast::hash(&forged[header_at..footer_at]);
        forged[footer_at + 12..footer_at + 16].copy_from_slice(&crc.to_le_bytes());
        let mut flipped_mac = good.clone();
        let last = flipped_mac.len() - 1;
        flipped_mac[last] ^= 1;
        let mut torn = good.clone();
        torn[header_at + 3] ^= 0x40;

        let unknown = read_bytes(&d, "other.bud", &by_other, &k);
        let bad = read_bytes(&d, "forged.bud", &forged, &k);
        let bad_tag = read_bytes(&d, "mac.bud", &flipped_mac, &k);
        let torn = read_bytes(&d, "torn.bud", &torn, &k);

        assert!(
            matches!(unknown, Err(SessionFileError::UnknownKey { .. })),
            "{unknown:?}"
        );
        assert!(
            matches!(bad, Err(SessionFileError::BadMac { .. })),
            "{bad:?}"
        );
        assert!(
            matches!(bad_tag, Err(SessionFileError::BadMac { .. })),
            "{bad_tag:?}"
        );
        assert!(
            matches!(torn, Err(SessionFileError::Corrupt { .. })),
            "{torn:?}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_changed_page_fails_verification_and_messages_name_no_path() {
        let d = dir("pages");
        let k = keys(KEY);
        let mut bytes = file_bytes(&k, |_| {});
        bytes[100] ^= 1;

        let f = read_bytes(&d, "secret-dir-name.bud", &bytes, &k).unwrap();
        let err = f.verify_pages().unwrap_err();
        let missing = read(&d.join("secret-dir-name-2.bud"), &k).unwrap_err();

        assert!(matches!(err, SessionFileError::Corrupt { .. }));
        for e in [&err, &missing] {
            let shown = e.to_string();
            assert!(!shown.contains("secret-dir-name"), "{shown}");
            assert!(e.path().is_some_and(|p| p.starts_with(&d)));
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_file_of_format_1_is_refused_as_such() {
        let d = dir("v1");
        // Format 1's 32-byte footer: magic, version 1, header CRC and length, pages' length.
        let mut v1 = vec![0u8; 4096];
        v1.extend_from_slice(&MAGIC);
        v1.extend_from_slice(&1u32.to_le_bytes());
        v1.extend_from_slice(&[0; 20]);

        let r = read_bytes(&d, "v1.bud", &v1, &keys(KEY));

        assert!(
            matches!(r, Err(SessionFileError::Version { found: 1, .. })),
            "{r:?}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
