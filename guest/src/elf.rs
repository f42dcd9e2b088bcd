//! Just enough of ELF to find what a binary loads: its program interpreter (`PT_INTERP`) and
//! the shared libraries it names (`DT_NEEDED`).
//!
//! Only 64-bit little-endian files (x86_64) are understood; anything else is an error rather
//! than a guess. This module reads bytes; it never looks anything up on disk.
//!
//! The `object` crate does the parsing (as in `vmm::kernel_layout`). Its unified `Object` API
//! has no view of the dynamic section's `DT_NEEDED`/`DT_RUNPATH` entries, so this module uses
//! its ELF layer (`object::read::elf`): the file header, the program headers, `PT_INTERP`,
//! `PT_DYNAMIC` and the string table that `DT_STRTAB` points at. It goes through the program
//! headers only, as the dynamic loader does: section headers may be stripped, and are never
//! read.

use object::LittleEndian;
use object::elf::{
    DT_NEEDED, DT_NULL, DT_RPATH, DT_RUNPATH, DT_STRSZ, DT_STRTAB, ELFMAG, FileHeader64, PT_LOAD,
    ProgramHeader64,
};
use object::read::StringTable;
use object::read::elf::{Dyn, FileHeader, ProgramHeader};

#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    #[error("not a 64-bit little-endian ELF file")]
    Unsupported,
    #[error("read the ELF header")]
    Header(#[source] object::Error),
    #[error("read the program headers")]
    ProgramHeaders(#[source] object::Error),
    #[error("read PT_INTERP")]
    Interpreter(#[source] object::Error),
    #[error("read PT_DYNAMIC")]
    Dynamic(#[source] object::Error),
    #[error("DT_STRTAB {0:#x} is outside the loaded segments")]
    StringTableAddress(u64),
    #[error("the string table at DT_STRTAB {0:#x} is past the end of the file")]
    StringTableData(u64),
    #[error("read the string of dynamic tag {tag}")]
    String {
        tag: u64,
        #[source]
        source: object::Error,
    },
    #[error("{0} is not UTF-8")]
    NotUtf8(&'static str),
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
    bytes.starts_with(&ELFMAG)
}

type Header = FileHeader64<LittleEndian>;
type Segment = ProgramHeader64<LittleEndian>;

fn utf8(bytes: &[u8], what: &'static str) -> Result<String, ElfError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| ElfError::NotUtf8(what))
}

/// The string table at virtual address `address`, found through the `PT_LOAD` segment that
/// holds it: `size` bytes (`DT_STRSZ`), or the rest of the segment when the file gives no size.
fn string_table<'a>(
    b: &'a [u8],
    segments: &[Segment],
    address: u64,
    size: Option<u64>,
) -> Result<StringTable<'a>, ElfError> {
    let e = LittleEndian;
    let segment = segments
        .iter()
        .find(|s| {
            let (vaddr, filesz) = (s.p_vaddr(e), s.p_filesz(e));
            s.p_type(e) == PT_LOAD && address >= vaddr && address - vaddr < filesz
        })
        .ok_or(ElfError::StringTableAddress(address))?;
    let size = size.unwrap_or(segment.p_vaddr(e) + segment.p_filesz(e) - address);
    let bytes = segment
        .data_range(e, b, address, size)
        .ok()
        .flatten()
        .ok_or(ElfError::StringTableData(address))?;
    Ok(StringTable::new(bytes, 0, bytes.len() as u64))
}

/// Reads the interpreter and needed libraries of an ELF file held in memory.
pub fn parse(b: &[u8]) -> Result<Dynamic, ElfError> {
    if object::FileKind::parse(b).ok() != Some(object::FileKind::Elf64) {
        return Err(ElfError::Unsupported);
    }
    let header = Header::parse(b).map_err(ElfError::Header)?;
    let e = header.endian().map_err(|_| ElfError::Unsupported)?;
    let segments = header
        .program_headers(e, b)
        .map_err(ElfError::ProgramHeaders)?;
    let mut out = Dynamic::default();
    for segment in segments {
        if let Some(interp) = segment.interpreter(e, b).map_err(ElfError::Interpreter)? {
            out.interpreter = Some(utf8(interp, "PT_INTERP")?);
            break;
        }
    }
    let mut dynamic = None;
    for segment in segments {
        dynamic = segment.dynamic(e, b).map_err(ElfError::Dynamic)?;
        if dynamic.is_some() {
            break;
        }
    }
    let Some(dynamic) = dynamic else {
        return Ok(out);
    };
    let entries: Vec<_> = dynamic
        .iter()
        .take_while(|d| d.d_tag(e) != u64::from(DT_NULL))
        .collect();
    let value_of = |tag: u32| {
        entries
            .iter()
            .find(|d| d.d_tag(e) == u64::from(tag))
            .map(|d| d.d_val(e))
    };
    let Some(strtab) = value_of(DT_STRTAB) else {
        return Ok(out);
    };
    let strings = string_table(b, segments, strtab, value_of(DT_STRSZ))?;
    for entry in entries {
        let tag = entry.d_tag(e);
        let string = || {
            entry
                .string(e, strings)
                .map_err(|source| ElfError::String { tag, source })
        };
        if tag == u64::from(DT_NEEDED) {
            out.needed.push(utf8(string()?, "DT_NEEDED")?);
        } else if tag == u64::from(DT_RUNPATH) || tag == u64::from(DT_RPATH) {
            out.runpath = Some(utf8(string()?, "DT_RUNPATH")?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::process::Command;

    use super::*;

    const PROGRAM: &str = "int main(void) { return 0; }\n";

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bud-elf-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Compiles [`PROGRAM`] with the host's C compiler (the one cargo links with) and `args`,
    /// and returns the ELF file it wrote.
    fn compile(name: &str, args: &[&str]) -> Vec<u8> {
        let dir = scratch(name);
        let (source, out) = (dir.join("main.c"), dir.join("out"));
        std::fs::write(&source, PROGRAM).unwrap();
        let status = Command::new("cc")
            .arg(&source)
            .arg("-o")
            .arg(&out)
            .args(args)
            .status()
            .expect("the tests compile ELF files with `cc`; install a C compiler");
        assert!(status.success(), "cc {args:?}: {status}");
        let bytes = std::fs::read(&out).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        bytes
    }

    /// Where the `PT_DYNAMIC` segment of `bytes` ends in the file.
    fn dynamic_end(bytes: &[u8]) -> usize {
        let header = Header::parse(bytes).unwrap();
        let e = LittleEndian;
        let segment = header
            .program_headers(e, bytes)
            .unwrap()
            .iter()
            .find(|s| s.p_type(e) == object::elf::PT_DYNAMIC)
            .unwrap();
        usize::try_from(segment.p_offset(e) + segment.p_filesz(e)).unwrap()
    }

    #[test]
    fn reads_interpreter_needed_and_runpath_of_a_program() {
        let bytes = compile(
            "runpath",
            &[
                "-Wl,--no-as-needed",
                "-lm",
                "-Wl,-rpath,$ORIGIN/lib",
                "-Wl,--enable-new-dtags",
            ],
        );

        let dynamic = parse(&bytes).unwrap();

        assert_eq!(
            dynamic.interpreter.as_deref(),
            Some("/lib64/ld-linux-x86-64.so.2")
        );
        assert_eq!(dynamic.needed, ["libm.so.6", "libc.so.6"]);
        assert_eq!(dynamic.runpath.as_deref(), Some("$ORIGIN/lib"));
    }

    #[test]
    fn old_style_rpath_is_reported_as_runpath() {
        let bytes = compile("rpath", &["-Wl,-rpath,/opt/lib", "-Wl,--disable-new-dtags"]);

        let dynamic = parse(&bytes).unwrap();

        assert_eq!(dynamic.runpath.as_deref(), Some("/opt/lib"));
    }

    #[test]
    fn static_program_loads_nothing() {
        let bytes = compile("static", &["-static"]);

        let dynamic = parse(&bytes).unwrap();

        assert_eq!(dynamic, Dynamic::default());
    }

    #[test]
    fn shared_library_has_no_interpreter() {
        let bytes = compile("shared", &["-shared", "-fPIC", "-Wl,--no-as-needed", "-lm"]);

        let dynamic = parse(&bytes).unwrap();

        assert_eq!(dynamic.interpreter, None);
        assert_eq!(dynamic.needed, ["libm.so.6", "libc.so.6"]);
        assert_eq!(dynamic.runpath, None);
    }

    #[test]
    fn this_test_binary_needs_libc() {
        let bytes = std::fs::read(std::env::current_exe().unwrap()).unwrap();

        let dynamic = parse(&bytes).unwrap();

        assert!(
            dynamic.needed.iter().any(|n| n == "libc.so.6"),
            "{dynamic:?}"
        );
    }

    #[test]
    fn rejects_non_elf_32_bit_and_big_endian() {
        let script = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
        let program = compile("unsupported", &[]);
        let mut elf32 = program.clone();
        elf32[4] = object::elf::ELFCLASS32;
        let mut big_endian = program.clone();
        big_endian[5] = object::elf::ELFDATA2MSB;

        let results = [parse(&script), parse(&elf32), parse(&big_endian)];

        for result in results {
            assert!(matches!(result, Err(ElfError::Unsupported)), "{result:?}");
        }
    }

    #[test]
    fn truncated_program_is_an_error_not_a_panic() {
        let bytes = compile("truncated", &["-Wl,--no-as-needed", "-lm"]);
        let end = dynamic_end(&bytes);

        let results: Vec<_> = (0..end).map(|len| parse(&bytes[..len])).collect();

        assert!(results.iter().all(Result::is_err));
        assert_eq!(parse(&bytes).unwrap().needed, ["libm.so.6", "libc.so.6"]);
    }
}
