//! Just enough of ELF to find what a binary loads: its program interpreter (`PT_INTERP`) and
//! the shared libraries it names (`DT_NEEDED`).
//!
//! Only 64-bit little-endian files (x86_64) are understood; anything else is an error rather
//! than a guess. This module reads bytes; it never looks anything up on disk.

const MAGIC: &[u8; 4] = b"\x7fELF";
const ELFCLASS64: u8 = 2;
const ELFDATA2LSB: u8 = 1;
const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;
const DT_RPATH: u64 = 15;
const DT_RUNPATH: u64 = 29;
const EHDR_LEN: usize = 64;
const PHDR_LEN: usize = 56;
const DYN_LEN: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    #[error("not a 64-bit little-endian ELF file")]
    Unsupported,
    #[error("truncated or malformed ELF: {0}")]
    Malformed(&'static str),
}

/// What the dynamic loader needs to run a file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Dynamic {
    /// `PT_INTERP`, e.g. `/lib64/ld-linux-x86-64.so.2`; `None` for static files and libraries.
    pub interpreter: Option<String>,
    /// `DT_NEEDED` names in file order.
    pub needed: Vec<String>,
    /// `DT_RUNPATH` or `DT_RPATH`, if any (the image ignores them; callers may warn).
    pub runpath: Option<String>,
}

/// True when `bytes` starts with the ELF magic.
pub fn is_elf(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

struct Segment {
    kind: u32,
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, ElfError> {
    let s = b.get(at..at + 2).ok_or(ElfError::Malformed("short read"))?;
    Ok(u16::from_le_bytes([s[0], s[1]]))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, ElfError> {
    let s = b.get(at..at + 4).ok_or(ElfError::Malformed("short read"))?;
    Ok(u32::from_le_bytes(s.try_into().unwrap_or_default()))
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, ElfError> {
    let s = b.get(at..at + 8).ok_or(ElfError::Malformed("short read"))?;
    Ok(u64::from_le_bytes(s.try_into().unwrap_or_default()))
}

fn usize_of(v: u64) -> Result<usize, ElfError> {
    usize::try_from(v).map_err(|_| ElfError::Malformed("offset overflow"))
}

fn c_str_at(b: &[u8], at: usize) -> Result<String, ElfError> {
    let tail = b
        .get(at..)
        .ok_or(ElfError::Malformed("string out of bounds"))?;
    let end = tail
        .iter()
        .position(|&c| c == 0)
        .ok_or(ElfError::Malformed("unterminated string"))?;
    String::from_utf8(tail[..end].to_vec()).map_err(|_| ElfError::Malformed("non-UTF-8 string"))
}

fn segments(b: &[u8]) -> Result<Vec<Segment>, ElfError> {
    let phoff = usize_of(u64_at(b, 0x20)?)?;
    let phentsize = usize::from(u16_at(b, 0x36)?);
    let phnum = usize::from(u16_at(b, 0x38)?);
    if phnum > 0 && phentsize < PHDR_LEN {
        return Err(ElfError::Malformed("program header entry too small"));
    }
    (0..phnum)
        .map(|i| {
            let at = phoff + i * phentsize;
            Ok(Segment {
                kind: u32_at(b, at)?,
                offset: u64_at(b, at + 0x08)?,
                vaddr: u64_at(b, at + 0x10)?,
                filesz: u64_at(b, at + 0x20)?,
            })
        })
        .collect()
}

/// Maps a virtual address to a file offset through the `PT_LOAD` segments.
fn file_offset(segments: &[Segment], vaddr: u64) -> Result<usize, ElfError> {
    segments
        .iter()
        .find(|s| s.kind == PT_LOAD && vaddr >= s.vaddr && vaddr < s.vaddr + s.filesz)
        .ok_or(ElfError::Malformed("address outside loaded segments"))
        .and_then(|s| usize_of(vaddr - s.vaddr + s.offset))
}

/// Reads the interpreter and needed libraries of an ELF file held in memory.
pub fn parse(b: &[u8]) -> Result<Dynamic, ElfError> {
    if !is_elf(b) || b.len() < EHDR_LEN || b[4] != ELFCLASS64 || b[5] != ELFDATA2LSB {
        return Err(ElfError::Unsupported);
    }
    let segments = segments(b)?;
    let mut out = Dynamic::default();
    if let Some(interp) = segments.iter().find(|s| s.kind == PT_INTERP) {
        out.interpreter = Some(c_str_at(b, usize_of(interp.offset)?)?);
    }
    let Some(dynamic) = segments.iter().find(|s| s.kind == PT_DYNAMIC) else {
        return Ok(out);
    };
    let (start, len) = (usize_of(dynamic.offset)?, usize_of(dynamic.filesz)?);
    let mut entries = Vec::new();
    for at in (start..start + len).step_by(DYN_LEN) {
        let tag = u64_at(b, at)?;
        if tag == DT_NULL {
            break;
        }
        entries.push((tag, u64_at(b, at + 8)?));
    }
    let Some(&(_, strtab)) = entries.iter().find(|(tag, _)| *tag == DT_STRTAB) else {
        return Ok(out);
    };
    let strtab = file_offset(&segments, strtab)?;
    for (tag, value) in entries {
        let string = || c_str_at(b, strtab + usize_of(value)?);
        match tag {
            DT_NEEDED => out.needed.push(string()?),
            DT_RUNPATH | DT_RPATH => out.runpath = Some(string()?),
            _ => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-made dynamic executable: ELF header, three program headers (INTERP, LOAD,
    /// DYNAMIC), the interpreter string, a string table and a dynamic section.
    fn tiny_elf() -> Vec<u8> {
        let mut b = vec![0u8; 0x200];
        b[..4].copy_from_slice(MAGIC);
        b[4] = ELFCLASS64;
        b[5] = ELFDATA2LSB;
        b[0x20..0x28].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        b[0x36..0x38].copy_from_slice(&(PHDR_LEN as u16).to_le_bytes());
        b[0x38..0x3a].copy_from_slice(&3u16.to_le_bytes());
        let phdr = |b: &mut Vec<u8>, i: usize, kind: u32, off: u64, vaddr: u64, size: u64| {
            let at = 64 + i * PHDR_LEN;
            b[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&off.to_le_bytes());
            b[at + 0x10..at + 0x18].copy_from_slice(&vaddr.to_le_bytes());
            b[at + 0x20..at + 0x28].copy_from_slice(&size.to_le_bytes());
        };
        phdr(&mut b, 0, PT_INTERP, 0x100, 0x400100, 0x10);
        phdr(&mut b, 1, PT_LOAD, 0, 0x400000, 0x200);
        phdr(&mut b, 2, PT_DYNAMIC, 0x180, 0x400180, 0x50);
        b[0x100..0x10c].copy_from_slice(b"/lib/ld.so\0\0");
        // String table at 0x140: "\0libc.so.6\0libm.so.6\0$ORIGIN\0"
        let strtab = b"\0libc.so.6\0libm.so.6\0$ORIGIN\0";
        b[0x140..0x140 + strtab.len()].copy_from_slice(strtab);
        let dyns: [(u64, u64); 5] = [
            (DT_NEEDED, 1),
            (DT_STRTAB, 0x400140),
            (DT_NEEDED, 11),
            (DT_RUNPATH, 21),
            (0, 0),
        ];
        for (i, (tag, val)) in dyns.iter().enumerate() {
            let at = 0x180 + i * DYN_LEN;
            b[at..at + 8].copy_from_slice(&tag.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&val.to_le_bytes());
        }
        b
    }

    #[test]
    fn reads_interpreter_needed_and_runpath() {
        let bytes = tiny_elf();

        let dynamic = parse(&bytes).unwrap();

        assert_eq!(dynamic.interpreter.as_deref(), Some("/lib/ld.so"));
        assert_eq!(dynamic.needed, ["libc.so.6", "libm.so.6"]);
        assert_eq!(dynamic.runpath.as_deref(), Some("$ORIGIN"));
    }

    #[test]
    fn rejects_non_elf_and_32_bit() {
        let mut bytes = tiny_elf();
        bytes[4] = 1;

        assert!(matches!(parse(b"#!/bin/sh\n"), Err(ElfError::Unsupported)));
        assert!(matches!(parse(&bytes), Err(ElfError::Unsupported)));
    }

    #[test]
    fn truncated_file_is_malformed_not_a_panic() {
        let bytes = tiny_elf();

        for len in [64, 100, 0x150, 0x185] {
            assert!(parse(&bytes[..len]).is_err(), "len {len}");
        }
    }

    #[test]
    fn host_binary_needs_libc() {
        let bytes = std::fs::read(std::env::current_exe().unwrap()).unwrap();

        let dynamic = parse(&bytes).unwrap();

        assert!(
            dynamic.needed.iter().any(|n| n == "libc.so.6"),
            "{dynamic:?}"
        );
    }
}
