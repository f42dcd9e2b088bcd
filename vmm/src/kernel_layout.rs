//! What bud's guest kernel tells the VMM about itself: where its clock, CRNG and page tables
//! live, as the compiler laid them out.
//!
//! bud's guest kernel carries three read-only structs (patches
//! `guest/kernel/patches/0006-bud-host-layout.patch` and `0007-bud-page-table-layout.patch`):
//! `bud_time_layout`, `bud_random_layout` and `bud_mm_layout`, holding addresses of kernel
//! data and offsets of fields. [`KernelLayout::from_vmlinux`] reads them from the kernel's ELF
//! file (the `object` crate: symbol table, then the bytes of the segment holding each) and
//! checks magic, version and sizes, and turns kernel virtual addresses into guest-physical
//! ones through the ELF program headers (bud loads the kernel at its physical addresses).
//! A kernel without the time and CRNG layouts cannot make a template; one without the page
//! table layout only makes every reset drop KVM's mappings (see [`crate::reset`]).
//!
//! Users: [`crate::identity`] (clock and CRNG writes) and [`crate::paging`] (page tables).

use std::path::Path;

use object::read::elf::{ElfFile64, ProgramHeader};
use object::{Endianness, Object, ObjectSymbol};

use crate::memory_cap::MemoryLayout;

/// `"BUDT"`: magic of `bud_time_layout`.
const TIME_MAGIC: u32 = 0x5444_5542;
/// `"BUDR"`: magic of `bud_random_layout`.
const RANDOM_MAGIC: u32 = 0x5244_5542;
/// `"BUDP"`: magic of `bud_mm_layout`.
const MM_MAGIC: u32 = 0x5044_5542;
/// The layout versions this VMM reads.
const TIME_VERSION: u32 = 1;
const RANDOM_VERSION: u32 = 1;
const MM_VERSION: u32 = 1;
/// Sizes of the structs (C layout of the patches).
const TIME_LAYOUT_SIZE: usize = 120;
const RANDOM_LAYOUT_SIZE: usize = 80;
const MM_LAYOUT_SIZE: usize = 40;

/// Errors of finding and checking the layouts.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("cannot read the guest kernel {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the guest kernel is not an ELF file bud can read: {0}")]
    Elf(#[from] object::Error),
    #[error(
        "the guest kernel has no symbol {0}: it was built without bud's patch 0006-bud-host-layout"
    )]
    MissingSymbol(&'static str),
    #[error("symbol {name} is {found} bytes, this VMM reads {expected}")]
    SymbolSize {
        name: &'static str,
        found: u64,
        expected: usize,
    },
    #[error("symbol {0} lies outside the kernel's loaded segments")]
    NotLoaded(&'static str),
    #[error("{name}: bad magic {magic:#x} or version {version} (this VMM reads version {want})")]
    Version {
        name: &'static str,
        magic: u32,
        version: u32,
        want: u32,
    },
    #[error("{0}: a field lies outside the struct it describes, or sizes are not what bud writes")]
    BadLayout(&'static str),
    #[error("kernel address {0:#x} is outside the kernel's loaded segments")]
    Address(u64),
}

/// Where the guest kernel keeps its timekeeping state (guest-physical addresses, byte
/// offsets). Read from `bud_time_layout`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct TimeLayout {
    /// `tk_core.timekeeper` and `shadow_timekeeper`: both get the same change.
    pub(crate) timekeepers: [u64; 2],
    pub(crate) timekeeper_seq: u64,
    /// `tk_fast_mono`.
    pub(crate) fast_mono: u64,
    /// `_vdso_data[CS_HRES_COARSE]`.
    pub(crate) vdso_data: u64,
    pub(crate) xtime_sec: u64,
    pub(crate) xtime_nsec: u64,
    pub(crate) shift: u64,
    pub(crate) base_real: u64,
    pub(crate) wall_to_monotonic: u64,
    pub(crate) offs_real: u64,
    pub(crate) offs_tai: u64,
    pub(crate) clock_was_set_seq: u64,
    pub(crate) fast_base: u64,
    pub(crate) read_base_size: u64,
    pub(crate) read_base_base_real: u64,
    pub(crate) vdso_seq: u64,
    pub(crate) vdso_basetime: u64,
    pub(crate) vdso_timestamp_size: u64,
    pub(crate) clock_realtime: u64,
    pub(crate) clock_realtime_coarse: u64,
    pub(crate) clock_tai: u64,
}

impl TimeLayout {
    /// Offsets of the two timekeeper fields that the kernel derives from the wall clock and
    /// that patch 0006 does not name: `tkr_mono.base` (the monotonic clock's base, which a
    /// change of `tkr_mono.xtime_nsec` must be balanced by) and `ktime_sec`. Each lies
    /// between two fields the patch does name, with no room for anything else: in `struct
    /// tk_read_base`, `xtime_nsec`, `base`, `base_real` (8 bytes each); in `struct
    /// timekeeper`, `xtime_sec`, `ktime_sec`, `wall_to_monotonic`. None when the named
    /// fields are not so placed (a kernel whose structs differ: nothing is written then).
    pub(crate) fn derived_fields(&self) -> Option<DerivedTimeFields> {
        (self.base_real == self.xtime_nsec + 16 && self.wall_to_monotonic == self.xtime_sec + 16)
            .then_some(DerivedTimeFields {
                mono_base: self.xtime_nsec + 8,
                ktime_sec: self.xtime_sec + 8,
            })
    }
}

/// Byte offsets in `struct timekeeper` of `tkr_mono.base` and `ktime_sec`
/// ([`TimeLayout::derived_fields`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DerivedTimeFields {
    pub(crate) mono_base: u64,
    pub(crate) ktime_sec: u64,
}

/// Where the guest kernel keeps its CRNG state (guest-physical addresses). Read from
/// `bud_random_layout`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct RandomLayout {
    /// `base_crng.key`, the CPU's `crngs.key`, `input_pool.hash.h`, with their sizes.
    pub(crate) keys: [(u64, u64); 3],
    /// `batched_entropy_{u8,u16,u32,u64}.entropy`.
    pub(crate) batches: [u64; 4],
    pub(crate) batch_size: u64,
}

/// Both layouts of one guest kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelLayout {
    pub(crate) time: TimeLayout,
    pub(crate) random: RandomLayout,
    /// None for a kernel without `bud_mm_layout` (or with a memory layout that is not fixed
    /// at build time): its page tables cannot be found, and every reset drops KVM's mappings.
    pub(crate) mm: Option<MmLayout>,
    /// Where the guest kernel counts its free pages ([`crate::memory_cap`]); None for a
    /// kernel whose symbol table lacks `vm_zone_stat` or `min_free_kbytes`.
    pub(crate) memory: Option<MemoryLayout>,
}

/// Where the guest kernel's page tables are found. Read from `bud_mm_layout`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct MmLayout {
    /// Guest-physical address of `init_top_pgt` (the kernel's own PGD).
    pub(crate) init_top_pgt: u64,
    /// Kernel virtual and guest-physical address of `pgd_list` (a `list_head`).
    pub(crate) pgd_list_va: u64,
    pub(crate) pgd_list: u64,
    /// Kernel virtual address of the struct page of pfn 0, its size, and the offset of `lru`.
    pub(crate) vmemmap: u64,
    pub(crate) page_size: u64,
    pub(crate) page_lru: u64,
}

/// The kernel's loaded segments: virtual address, physical address, file bytes, memory size.
struct Segments<'a> {
    list: Vec<(u64, u64, &'a [u8], u64)>,
}

impl Segments<'_> {
    /// The guest-physical address of `len` bytes at kernel address `vaddr`, which must lie
    /// inside one loaded segment.
    fn phys(&self, vaddr: u64, len: u64) -> Result<u64, LayoutError> {
        self.list
            .iter()
            .find_map(|&(va, pa, _, size)| {
                let end = vaddr.checked_add(len)?;
                (vaddr >= va && end <= va + size).then(|| pa + (vaddr - va))
            })
            .ok_or(LayoutError::Address(vaddr))
    }

    fn bytes(&self, vaddr: u64, len: usize) -> Option<&[u8]> {
        self.list.iter().find_map(|&(va, _, data, _)| {
            let off = usize::try_from(vaddr.checked_sub(va)?).ok()?;
            data.get(off..off.checked_add(len)?)
        })
    }
}

/// Little-endian field reader over a struct's bytes.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn u32(&self, at: usize) -> u64 {
        u64::from(u32::from_le_bytes(
            self.0[at..at + 4].try_into().unwrap_or([0; 4]),
        ))
    }
    fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().unwrap_or([0; 8]))
    }
}

impl KernelLayout {
    /// Reads and checks both layouts from the guest kernel's ELF file.
    pub(crate) fn from_vmlinux(path: &Path) -> Result<Self, LayoutError> {
        let data = std::fs::read(path).map_err(|source| LayoutError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_elf(&data)
    }

    /// Like [`KernelLayout::from_vmlinux`], from the file's bytes.
    pub(crate) fn from_elf(data: &[u8]) -> Result<Self, LayoutError> {
        let elf = ElfFile64::<Endianness>::parse(data)?;
        let endian = elf.endian();
        let mut list = Vec::new();
        for ph in elf.elf_program_headers() {
            if ph.p_type(endian) != object::elf::PT_LOAD {
                continue;
            }
            let (offset, filesz) = (ph.p_offset(endian), ph.p_filesz(endian));
            let bytes = usize::try_from(offset)
                .ok()
                .zip(usize::try_from(offset.saturating_add(filesz)).ok())
                .and_then(|(a, b)| data.get(a..b))
                .ok_or(LayoutError::BadLayout("program headers"))?;
            list.push((
                ph.p_vaddr(endian),
                ph.p_paddr(endian),
                bytes,
                ph.p_memsz(endian),
            ));
        }
        let segments = Segments { list };
        let symbol = |name: &'static str, size: usize| -> Result<&[u8], LayoutError> {
            let sym = elf
                .symbols()
                .find(|s| s.name() == Ok(name))
                .ok_or(LayoutError::MissingSymbol(name))?;
            if sym.size() != size as u64 {
                return Err(LayoutError::SymbolSize {
                    name,
                    found: sym.size(),
                    expected: size,
                });
            }
            segments
                .bytes(sym.address(), size)
                .ok_or(LayoutError::NotLoaded(name))
        };
        let time = parse_time(
            &Fields(symbol("bud_time_layout", TIME_LAYOUT_SIZE)?),
            &segments,
        )?;
        let random = parse_random(
            &Fields(symbol("bud_random_layout", RANDOM_LAYOUT_SIZE)?),
            &segments,
        )?;
        let mm = match symbol("bud_mm_layout", MM_LAYOUT_SIZE) {
            Ok(bytes) => parse_mm(&Fields(bytes), &segments)?,
            Err(LayoutError::MissingSymbol(_)) => None,
            Err(e) => return Err(e),
        };
        let memory = memory_layout(&elf, &segments)?;
        Ok(Self {
            time,
            random,
            mm,
            memory,
        })
    }
}

/// The guest kernel's free-page counter and `min_free_kbytes`, from plain symbols of its
/// ELF file (no bud struct describes them): `vm_zone_stat` is an array of `atomic_long_t`
/// whose first item is `NR_FREE_PAGES`, `min_free_kbytes` an `int`. Missing symbols (another
/// kernel) give None; symbols of another size are refused.
fn memory_layout(
    elf: &ElfFile64<'_, Endianness>,
    segments: &Segments,
) -> Result<Option<MemoryLayout>, LayoutError> {
    let find = |name: &'static str| elf.symbols().find(|s| s.name() == Ok(name));
    let (Some(stat), Some(min)) = (find("vm_zone_stat"), find("min_free_kbytes")) else {
        return Ok(None);
    };
    if stat.size() < 8 || stat.size() % 8 != 0 {
        return Err(LayoutError::BadLayout("vm_zone_stat"));
    }
    if min.size() != 4 {
        return Err(LayoutError::SymbolSize {
            name: "min_free_kbytes",
            found: min.size(),
            expected: 4,
        });
    }
    Ok(Some(MemoryLayout {
        free_pages: segments.phys(stat.address(), 8)?,
        min_free_kbytes: segments.phys(min.address(), 4)?,
    }))
}

fn check_header(
    f: &Fields,
    name: &'static str,
    magic: u32,
    version: u32,
) -> Result<(), LayoutError> {
    let (m, v) = (f.u32(0) as u32, f.u32(4) as u32);
    if m != magic || v != version {
        return Err(LayoutError::Version {
            name,
            magic: m,
            version: v,
            want: version,
        });
    }
    Ok(())
}

fn parse_time(f: &Fields, seg: &Segments) -> Result<TimeLayout, LayoutError> {
    const NAME: &str = "bud_time_layout";
    check_header(f, NAME, TIME_MAGIC, TIME_VERSION)?;
    let tk_size = f.u32(48);
    let t = TimeLayout {
        timekeepers: [seg.phys(f.u64(8), tk_size)?, seg.phys(f.u64(24), tk_size)?],
        timekeeper_seq: seg.phys(f.u64(16), 4)?,
        fast_mono: seg.phys(f.u64(32), 8)?,
        vdso_data: seg.phys(f.u64(40), 8)?,
        xtime_sec: f.u32(52),
        xtime_nsec: f.u32(56),
        shift: f.u32(60),
        base_real: f.u32(64),
        wall_to_monotonic: f.u32(68),
        offs_real: f.u32(72),
        offs_tai: f.u32(76),
        clock_was_set_seq: f.u32(80),
        fast_base: f.u32(84),
        read_base_size: f.u32(88),
        read_base_base_real: f.u32(92),
        vdso_seq: f.u32(96),
        vdso_basetime: f.u32(100),
        vdso_timestamp_size: f.u32(104),
        clock_realtime: f.u32(108),
        clock_realtime_coarse: f.u32(112),
        clock_tai: f.u32(116),
    };
    let fields_fit = [
        (t.xtime_sec, 8),
        (t.xtime_nsec, 8),
        (t.shift, 4),
        (t.base_real, 8),
        (t.wall_to_monotonic, 16),
        (t.offs_real, 8),
        (t.offs_tai, 8),
        (t.clock_was_set_seq, 4),
    ]
    .iter()
    .all(|&(off, len)| off + len <= tk_size);
    let last_clock = t
        .clock_realtime
        .max(t.clock_realtime_coarse)
        .max(t.clock_tai);
    let vdso_end = t.vdso_basetime + (last_clock + 1) * t.vdso_timestamp_size;
    if !fields_fit
        || t.derived_fields().is_none()
        || t.read_base_base_real + 8 > t.read_base_size
        || t.vdso_timestamp_size != 16
        || last_clock > 16
        || seg
            .phys(f.u64(32), t.fast_base + 2 * t.read_base_size)
            .is_err()
        || seg.phys(f.u64(40), vdso_end).is_err()
    {
        return Err(LayoutError::BadLayout(NAME));
    }
    Ok(t)
}

fn parse_random(f: &Fields, seg: &Segments) -> Result<RandomLayout, LayoutError> {
    const NAME: &str = "bud_random_layout";
    check_header(f, NAME, RANDOM_MAGIC, RANDOM_VERSION)?;
    let (key_size, pool_size, batch_size) = (f.u32(64), f.u32(68), f.u32(72));
    if key_size != 32 || pool_size != 32 || batch_size == 0 || batch_size > 4096 {
        return Err(LayoutError::BadLayout(NAME));
    }
    Ok(RandomLayout {
        keys: [
            (seg.phys(f.u64(8), key_size)?, key_size),
            (seg.phys(f.u64(16), key_size)?, key_size),
            (seg.phys(f.u64(24), pool_size)?, pool_size),
        ],
        batches: [
            seg.phys(f.u64(32), batch_size)?,
            seg.phys(f.u64(40), batch_size)?,
            seg.phys(f.u64(48), batch_size)?,
            seg.phys(f.u64(56), batch_size)?,
        ],
        batch_size,
    })
}

fn parse_mm(f: &Fields, seg: &Segments) -> Result<Option<MmLayout>, LayoutError> {
    const NAME: &str = "bud_mm_layout";
    check_header(f, NAME, MM_MAGIC, MM_VERSION)?;
    let (page_size, page_lru) = (f.u32(32), f.u32(36));
    if page_size == 0 || page_size > 256 || page_lru + 16 > page_size {
        return Err(LayoutError::BadLayout(NAME));
    }
    let vmemmap = f.u64(24);
    if vmemmap == 0 {
        return Ok(None);
    }
    Ok(Some(MmLayout {
        init_top_pgt: seg.phys(f.u64(8), 4096)?,
        pgd_list_va: f.u64(16),
        pgd_list: seg.phys(f.u64(16), 16)?,
        vmemmap,
        page_size,
        page_lru,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_without_the_layouts_is_refused_by_name() {
        let this = std::fs::read(std::env::current_exe().unwrap()).unwrap();

        let err = KernelLayout::from_elf(&this).unwrap_err();

        assert!(
            matches!(err, LayoutError::MissingSymbol("bud_time_layout")),
            "{err}"
        );
    }
}
