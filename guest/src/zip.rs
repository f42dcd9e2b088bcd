//! A minimal, deterministic ZIP writer: the standard library ships as one archive on
//! `sys.path` (`python311.zip`), read by CPython's zipimport.
//!
//! Why one archive: every initramfs entry costs the guest kernel tens of milliseconds to
//! unpack under kvm_pvm, and the library is ~540 files and directories; deflate also makes it
//! a third of the size, and inflating at import runs in guest user mode, at native speed.
//! Determinism: entries in the caller's order, a fixed 1980-01-01 timestamp, fixed modes, and
//! deflate from the pure-Rust miniz_oxide backend (same crate version, same bytes).

use std::io::{self, Write};

use flate2::Compression;
use flate2::write::DeflateEncoder;

const LOCAL_HEADER_SIG: u32 = 0x0403_4b50;
const CENTRAL_HEADER_SIG: u32 = 0x0201_4b50;
const END_OF_CENTRAL_DIR_SIG: u32 = 0x0605_4b50;
/// Version 2.0: deflate and directories.
const VERSION_NEEDED: u16 = 20;
/// Made by Unix (3), spec 3.0: the high half of the external attributes is a Unix mode.
const VERSION_MADE_BY: u16 = (3 << 8) | 30;
/// General purpose flag bit 11: names are UTF-8.
const FLAG_UTF8: u16 = 1 << 11;
const METHOD_STORED: u16 = 0;
const METHOD_DEFLATED: u16 = 8;
/// MS-DOS date of 1980-01-01 (the earliest a ZIP can say); the time is 00:00.
const DOS_DATE_1980: u16 = (1 << 5) | 1;
const FILE_MODE: u32 = 0o100_644;
const DIR_MODE: u32 = 0o040_755;
/// MS-DOS directory attribute, for readers that look at the low half.
const DOS_DIR_ATTR: u32 = 0x10;

#[derive(Debug, thiserror::Error)]
pub enum ZipError {
    #[error("{0}: entry too large for a plain (non-zip64) archive")]
    TooLarge(String),
    #[error("too many entries for a plain (non-zip64) archive")]
    TooManyEntries,
    #[error("compress {0}")]
    Compress(String, #[source] io::Error),
    #[error("write archive")]
    Write(#[source] io::Error),
}

/// One member: a file, or a directory when the name ends with `/` (data empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZipEntry {
    pub name: String,
    pub data: Vec<u8>,
}

struct Written {
    name: String,
    method: u16,
    crc: u32,
    compressed: u32,
    size: u32,
    offset: u32,
    is_dir: bool,
}

fn u32_of(value: usize, name: &str) -> Result<u32, ZipError> {
    u32::try_from(value).map_err(|_| ZipError::TooLarge(name.to_owned()))
}

fn deflate(entry: &ZipEntry) -> Result<Vec<u8>, ZipError> {
    let compress_err = |e| ZipError::Compress(entry.name.clone(), e);
    let mut encoder = DeflateEncoder::new(Vec::new(), Compression::best());
    encoder.write_all(&entry.data).map_err(compress_err)?;
    encoder.finish().map_err(compress_err)
}

/// Writes `entries` as a ZIP archive, deflating each file unless that does not make it
/// smaller. Returns the archive length.
pub fn write<W: Write>(mut out: W, entries: &[ZipEntry]) -> Result<u64, ZipError> {
    let count = u16::try_from(entries.len()).map_err(|_| ZipError::TooManyEntries)?;
    let mut offset = 0usize;
    let mut written = Vec::with_capacity(entries.len());
    for entry in entries {
        let is_dir = entry.name.ends_with('/');
        let mut crc = flate2::Crc::new();
        crc.update(&entry.data);
        let deflated = if is_dir { None } else { Some(deflate(entry)?) };
        let (method, body) = match deflated {
            Some(d) if d.len() < entry.data.len() => (METHOD_DEFLATED, d),
            _ => (METHOD_STORED, entry.data.clone()),
        };
        let record = Written {
            name: entry.name.clone(),
            method,
            crc: crc.sum(),
            compressed: u32_of(body.len(), &entry.name)?,
            size: u32_of(entry.data.len(), &entry.name)?,
            offset: u32_of(offset, &entry.name)?,
            is_dir,
        };
        let mut header = Vec::with_capacity(30 + entry.name.len());
        header.extend_from_slice(&LOCAL_HEADER_SIG.to_le_bytes());
        common_fields(&mut header, &record)?;
        header.extend_from_slice(&0u16.to_le_bytes()); // extra field length
        header.extend_from_slice(record.name.as_bytes());
        out.write_all(&header).map_err(ZipError::Write)?;
        out.write_all(&body).map_err(ZipError::Write)?;
        offset += header.len() + body.len();
        written.push(record);
    }
    let central_start = offset;
    for record in &written {
        let mut header = Vec::with_capacity(46 + record.name.len());
        header.extend_from_slice(&CENTRAL_HEADER_SIG.to_le_bytes());
        header.extend_from_slice(&VERSION_MADE_BY.to_le_bytes());
        common_fields(&mut header, record)?;
        header.extend_from_slice(&0u16.to_le_bytes()); // extra field length
        header.extend_from_slice(&0u16.to_le_bytes()); // comment length
        header.extend_from_slice(&0u16.to_le_bytes()); // disk number start
        header.extend_from_slice(&0u16.to_le_bytes()); // internal attributes
        let external = if record.is_dir {
            (DIR_MODE << 16) | DOS_DIR_ATTR
        } else {
            FILE_MODE << 16
        };
        header.extend_from_slice(&external.to_le_bytes());
        header.extend_from_slice(&record.offset.to_le_bytes());
        header.extend_from_slice(record.name.as_bytes());
        out.write_all(&header).map_err(ZipError::Write)?;
        offset += header.len();
    }
    let central_size = u32_of(offset - central_start, "central directory")?;
    let mut end = Vec::with_capacity(22);
    end.extend_from_slice(&END_OF_CENTRAL_DIR_SIG.to_le_bytes());
    end.extend_from_slice(&0u16.to_le_bytes()); // this disk
    end.extend_from_slice(&0u16.to_le_bytes()); // disk with the central directory
    end.extend_from_slice(&count.to_le_bytes());
    end.extend_from_slice(&count.to_le_bytes());
    end.extend_from_slice(&central_size.to_le_bytes());
    end.extend_from_slice(&u32_of(central_start, "central directory")?.to_le_bytes());
    end.extend_from_slice(&0u16.to_le_bytes()); // comment length
    out.write_all(&end).map_err(ZipError::Write)?;
    out.flush().map_err(ZipError::Write)?;
    Ok((offset + end.len()) as u64)
}

/// The fields local and central headers share, from "version needed" to "name length".
fn common_fields(header: &mut Vec<u8>, record: &Written) -> Result<(), ZipError> {
    let name_len =
        u16::try_from(record.name.len()).map_err(|_| ZipError::TooLarge(record.name.clone()))?;
    header.extend_from_slice(&VERSION_NEEDED.to_le_bytes());
    header.extend_from_slice(&FLAG_UTF8.to_le_bytes());
    header.extend_from_slice(&record.method.to_le_bytes());
    header.extend_from_slice(&0u16.to_le_bytes()); // time 00:00:00
    header.extend_from_slice(&DOS_DATE_1980.to_le_bytes());
    header.extend_from_slice(&record.crc.to_le_bytes());
    header.extend_from_slice(&record.compressed.to_le_bytes());
    header.extend_from_slice(&record.size.to_le_bytes());
    header.extend_from_slice(&name_len.to_le_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// Reads an archive back through its central directory: (name, data) pairs.
    fn read_back(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
        let end = bytes.len() - 22;
        assert_eq!(u32_at(bytes, end), END_OF_CENTRAL_DIR_SIG);
        let (count, start) = (u16_at(bytes, end + 10), u32_at(bytes, end + 16) as usize);
        let mut at = start;
        let mut out = Vec::new();
        for _ in 0..count {
            assert_eq!(u32_at(bytes, at), CENTRAL_HEADER_SIG);
            let method = u16_at(bytes, at + 10);
            let crc = u32_at(bytes, at + 16);
            let (compressed, size) = (u32_at(bytes, at + 20), u32_at(bytes, at + 24));
            let name_len = u16_at(bytes, at + 28) as usize;
            let local = u32_at(bytes, at + 42) as usize;
            let name = String::from_utf8(bytes[at + 46..at + 46 + name_len].to_vec()).unwrap();
            assert_eq!(u32_at(bytes, local), LOCAL_HEADER_SIG);
            let data_at = local + 30 + u16_at(bytes, local + 26) as usize;
            let raw = &bytes[data_at..data_at + compressed as usize];
            let data = match method {
                METHOD_STORED => raw.to_vec(),
                METHOD_DEFLATED => {
                    let mut data = Vec::new();
                    flate2::read::DeflateDecoder::new(raw)
                        .read_to_end(&mut data)
                        .unwrap();
                    data
                }
                other => panic!("method {other}"),
            };
            assert_eq!(data.len(), size as usize);
            let mut check = flate2::Crc::new();
            check.update(&data);
            assert_eq!(check.sum(), crc, "{name}");
            out.push((name, data));
            at += 46 + name_len;
        }
        out
    }

    fn sample() -> Vec<ZipEntry> {
        vec![
            ZipEntry {
                name: "json/".into(),
                data: vec![],
            },
            ZipEntry {
                name: "json/__init__.pyc".into(),
                data: b"abc".repeat(1000),
            },
            ZipEntry {
                name: "tiny.pyc".into(),
                data: b"x".to_vec(),
            },
        ]
    }

    #[test]
    fn archive_reads_back_with_the_same_contents() {
        let mut bytes = Vec::new();

        let len = write(&mut bytes, &sample()).unwrap();

        assert_eq!(len as usize, bytes.len());
        let got = read_back(&bytes);
        let want: Vec<(String, Vec<u8>)> = sample().into_iter().map(|e| (e.name, e.data)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn compressible_files_are_deflated_and_tiny_ones_stored() {
        let mut bytes = Vec::new();

        write(&mut bytes, &sample()).unwrap();

        assert_eq!(u16_at(&bytes, 8), METHOD_STORED); // the directory
        let second = 30 + "json/".len();
        assert_eq!(u16_at(&bytes, second + 8), METHOD_DEFLATED);
        assert!(bytes.len() < 3000);
    }

    #[test]
    fn same_entries_give_the_same_bytes() {
        let (mut one, mut two) = (Vec::new(), Vec::new());

        write(&mut one, &sample()).unwrap();
        write(&mut two, &sample()).unwrap();

        assert_eq!(one, two);
    }

    #[test]
    fn local_header_carries_fixed_date_and_utf8_flag() {
        let mut bytes = Vec::new();

        write(&mut bytes, &sample()[2..]).unwrap();

        assert_eq!(u16_at(&bytes, 6), FLAG_UTF8);
        assert_eq!(u16_at(&bytes, 10), 0);
        assert_eq!(u16_at(&bytes, 12), DOS_DATE_1980);
    }
}
