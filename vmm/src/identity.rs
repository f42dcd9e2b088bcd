//! A clone's own identity, written by the host into the stopped guest: its wall clock and its
//! kernel CRNG. No guest-kernel work: on kvm_pvm `clock_settime()` and the RNDADDENTROPY +
//! RNDRESEEDCRNG ioctls cost milliseconds of emulated kernel time per job.
//!
//! bud's guest kernel carries two read-only structs (patch
//! `guest/kernel/patches/0006-bud-host-layout.patch`), `bud_time_layout` and
//! `bud_random_layout`: the addresses of the timekeeping and CRNG state and the offsets of the
//! fields, as the compiler laid them out. [`KernelLayout::from_vmlinux`] reads them from the
//! kernel's ELF file (symbol table, then the bytes of the segment holding them) and checks
//! magic, version and sizes; a kernel without them cannot make a template.
//!
//! - **Clock.** Every clone resumes with its template's kvm-clock (see
//!   [`crate::snapshot::set_clock`]), so its guest believes no time passed since READY. Its
//!   `CLOCK_REALTIME` (and TAI) is then moved by `host now - guest wall clock at READY`
//!   ([`set_realtime`]): the same fields `do_settimeofday64()` changes (both timekeepers,
//!   the fast timekeeper, the vDSO data), with their sequence counts bumped so that a reader
//!   caught between two reads retries. The guest is stopped in user mode while this happens
//!   (one vCPU, no preemption), so no kernel writer is half-way through an update.
//! - **CRNG.** [`reseed_crng`] writes fresh host randomness over the base CRNG key, the CPU's
//!   CRNG key, the input pool's BLAKE2s chaining value (so a later reseed in the guest draws
//!   on a secret of this clone, not the template's) and the batched-entropy buffers
//!   (`get_random_u32()` and friends), so no value the template could have produced is ever
//!   handed out by a clone.
//!
//! This module must never write guest memory outside the fields the layouts name.

use std::path::Path;

use object::read::elf::{ElfFile64, ProgramHeader};
use object::{Endianness, Object, ObjectSymbol};

use crate::memory::{GuestRam, MemoryError};

/// `"BUDT"`: magic of `bud_time_layout`.
const TIME_MAGIC: u32 = 0x5444_5542;
/// `"BUDR"`: magic of `bud_random_layout`.
const RANDOM_MAGIC: u32 = 0x5244_5542;
/// The layout versions this VMM reads.
const TIME_VERSION: u32 = 1;
const RANDOM_VERSION: u32 = 1;
/// Sizes of the two structs (C layout of the patch).
const TIME_LAYOUT_SIZE: usize = 120;
const RANDOM_LAYOUT_SIZE: usize = 80;
const NSEC_PER_SEC: i128 = 1_000_000_000;

/// Errors of finding the layouts or writing through them.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
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
    #[error("cannot read host randomness: {0}")]
    Entropy(std::io::Error),
    #[error("guest memory: {0}")]
    Memory(#[from] MemoryError),
}

/// Where the guest kernel keeps its timekeeping state (guest-physical addresses, byte
/// offsets). Read from `bud_time_layout`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TimeLayout {
    /// `tk_core.timekeeper` and `shadow_timekeeper`: both get the same change.
    pub timekeepers: [u64; 2],
    pub timekeeper_seq: u64,
    /// `tk_fast_mono`.
    pub fast_mono: u64,
    /// `_vdso_data[CS_HRES_COARSE]`.
    pub vdso_data: u64,
    pub xtime_sec: u64,
    pub xtime_nsec: u64,
    pub shift: u64,
    pub base_real: u64,
    pub wall_to_monotonic: u64,
    pub offs_real: u64,
    pub offs_tai: u64,
    pub clock_was_set_seq: u64,
    pub fast_base: u64,
    pub read_base_size: u64,
    pub read_base_base_real: u64,
    pub vdso_seq: u64,
    pub vdso_basetime: u64,
    pub vdso_timestamp_size: u64,
    pub clock_realtime: u64,
    pub clock_realtime_coarse: u64,
    pub clock_tai: u64,
}

/// Where the guest kernel keeps its CRNG state (guest-physical addresses). Read from
/// `bud_random_layout`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RandomLayout {
    /// `base_crng.key`, the CPU's `crngs.key`, `input_pool.hash.h`, with their sizes.
    pub keys: [(u64, u64); 3],
    /// `batched_entropy_{u8,u16,u32,u64}.entropy`.
    pub batches: [u64; 4],
    pub batch_size: u64,
}

/// Both layouts of one guest kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelLayout {
    pub time: TimeLayout,
    pub random: RandomLayout,
}

/// The kernel's loaded segments: virtual address, physical address, file bytes, memory size.
struct Segments<'a> {
    list: Vec<(u64, u64, &'a [u8], u64)>,
}

impl Segments<'_> {
    fn phys(&self, vaddr: u64, len: u64) -> Option<u64> {
        self.list.iter().find_map(|&(va, pa, _, size)| {
            let end = vaddr.checked_add(len)?;
            (vaddr >= va && end <= va + size).then(|| pa + (vaddr - va))
        })
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
    pub fn from_vmlinux(path: &Path) -> Result<Self, IdentityError> {
        let data = std::fs::read(path).map_err(|source| IdentityError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_elf(&data)
    }

    /// Like [`KernelLayout::from_vmlinux`], from the file's bytes.
    pub fn from_elf(data: &[u8]) -> Result<Self, IdentityError> {
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
                .ok_or(IdentityError::BadLayout("program headers"))?;
            list.push((
                ph.p_vaddr(endian),
                ph.p_paddr(endian),
                bytes,
                ph.p_memsz(endian),
            ));
        }
        let segments = Segments { list };
        let symbol = |name: &'static str, size: usize| -> Result<&[u8], IdentityError> {
            let sym = elf
                .symbols()
                .find(|s| s.name() == Ok(name))
                .ok_or(IdentityError::MissingSymbol(name))?;
            if sym.size() != size as u64 {
                return Err(IdentityError::SymbolSize {
                    name,
                    found: sym.size(),
                    expected: size,
                });
            }
            segments
                .bytes(sym.address(), size)
                .ok_or(IdentityError::NotLoaded(name))
        };
        let time = parse_time(
            &Fields(symbol("bud_time_layout", TIME_LAYOUT_SIZE)?),
            &segments,
        )?;
        let random = parse_random(
            &Fields(symbol("bud_random_layout", RANDOM_LAYOUT_SIZE)?),
            &segments,
        )?;
        Ok(Self { time, random })
    }
}

fn check_header(
    f: &Fields,
    name: &'static str,
    magic: u32,
    version: u32,
) -> Result<(), IdentityError> {
    let (m, v) = (f.u32(0) as u32, f.u32(4) as u32);
    if m != magic || v != version {
        return Err(IdentityError::Version {
            name,
            magic: m,
            version: v,
            want: version,
        });
    }
    Ok(())
}

fn parse_time(f: &Fields, seg: &Segments) -> Result<TimeLayout, IdentityError> {
    const NAME: &str = "bud_time_layout";
    check_header(f, NAME, TIME_MAGIC, TIME_VERSION)?;
    let tk_size = f.u32(48);
    let phys = |vaddr: u64, len: u64| seg.phys(vaddr, len).ok_or(IdentityError::Address(vaddr));
    let t = TimeLayout {
        timekeepers: [phys(f.u64(8), tk_size)?, phys(f.u64(24), tk_size)?],
        timekeeper_seq: phys(f.u64(16), 4)?,
        fast_mono: phys(f.u64(32), 8)?,
        vdso_data: phys(f.u64(40), 8)?,
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
        || t.read_base_base_real + 8 > t.read_base_size
        || t.vdso_timestamp_size != 16
        || last_clock > 16
        || seg
            .phys(f.u64(32), t.fast_base + 2 * t.read_base_size)
            .is_none()
        || seg.phys(f.u64(40), vdso_end).is_none()
    {
        return Err(IdentityError::BadLayout(NAME));
    }
    Ok(t)
}

fn parse_random(f: &Fields, seg: &Segments) -> Result<RandomLayout, IdentityError> {
    const NAME: &str = "bud_random_layout";
    check_header(f, NAME, RANDOM_MAGIC, RANDOM_VERSION)?;
    let (key_size, pool_size, batch_size) = (f.u32(64), f.u32(68), f.u32(72));
    if key_size != 32 || pool_size != 32 || batch_size == 0 || batch_size > 4096 {
        return Err(IdentityError::BadLayout(NAME));
    }
    let phys = |vaddr: u64, len: u64| seg.phys(vaddr, len).ok_or(IdentityError::Address(vaddr));
    Ok(RandomLayout {
        keys: [
            (phys(f.u64(8), key_size)?, key_size),
            (phys(f.u64(16), key_size)?, key_size),
            (phys(f.u64(24), pool_size)?, pool_size),
        ],
        batches: [
            phys(f.u64(32), batch_size)?,
            phys(f.u64(40), batch_size)?,
            phys(f.u64(48), batch_size)?,
            phys(f.u64(56), batch_size)?,
        ],
        batch_size,
    })
}

/// Fills `buf` from the host's CRNG (`getrandom`).
pub fn host_random(buf: &mut [u8]) -> Result<(), IdentityError> {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`, which we own.
        let n =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(IdentityError::Entropy(e));
            }
        } else {
            filled += n as usize;
        }
    }
    Ok(())
}

/// Replaces the guest kernel's CRNG state with fresh host randomness (module docs).
pub fn reseed_crng(ram: &GuestRam, r: &RandomLayout) -> Result<(), IdentityError> {
    let mut buf = [0u8; 4096];
    for &(addr, len) in &r.keys {
        let part = &mut buf[..len as usize];
        host_random(part)?;
        ram.write(addr, part)?;
    }
    for &addr in &r.batches {
        let part = &mut buf[..r.batch_size as usize];
        host_random(part)?;
        ram.write(addr, part)?;
    }
    buf.fill(0);
    Ok(())
}

fn read_i64(ram: &GuestRam, addr: u64) -> Result<i64, MemoryError> {
    Ok(ram.read_u64(addr)? as i64)
}

fn add_i64(ram: &GuestRam, addr: u64, delta: i128) -> Result<(), MemoryError> {
    let v = i128::from(read_i64(ram, addr)?) + delta;
    ram.write_u64(addr, v as i64 as u64)
}

fn bump_u32(ram: &GuestRam, addr: u64, by: u32) -> Result<(), MemoryError> {
    let mut b = [0u8; 4];
    ram.read(addr, &mut b)?;
    ram.write(addr, &u32::from_le_bytes(b).wrapping_add(by).to_le_bytes())
}

/// Moves a (seconds, nanoseconds << shift) pair by `delta_ns`, keeping the sub-nanosecond bits.
fn shift_timestamp(sec: u64, nsec_shifted: u64, shift: u32, delta_ns: i128) -> (u64, u64) {
    let frac = nsec_shifted & ((1u64 << shift) - 1);
    let ns = i128::from(sec) * NSEC_PER_SEC + i128::from(nsec_shifted >> shift) + delta_ns;
    let ns = ns.max(0);
    let new_sec = (ns / NSEC_PER_SEC) as u64;
    let new_nsec = (ns % NSEC_PER_SEC) as u64;
    (new_sec, (new_nsec << shift) | frac)
}

/// Moves the guest's `CLOCK_REALTIME` and `CLOCK_TAI` by `delta_ns` (module docs). Monotonic
/// and boot time are untouched.
pub fn set_realtime(ram: &GuestRam, t: &TimeLayout, delta_ns: i128) -> Result<(), IdentityError> {
    let mut shift_bits = 0;
    for &tk in &t.timekeepers {
        let mut b = [0u8; 4];
        ram.read(tk + t.shift, &mut b)?;
        let shift = u32::from_le_bytes(b);
        if shift >= 64 {
            return Err(IdentityError::BadLayout("timekeeper shift"));
        }
        shift_bits = shift;
        let (sec, nsec) = shift_timestamp(
            ram.read_u64(tk + t.xtime_sec)?,
            ram.read_u64(tk + t.xtime_nsec)?,
            shift,
            delta_ns,
        );
        ram.write_u64(tk + t.xtime_sec, sec)?;
        ram.write_u64(tk + t.xtime_nsec, nsec)?;
        let wtm = tk + t.wall_to_monotonic;
        let wtm_ns = i128::from(read_i64(ram, wtm)?) * NSEC_PER_SEC
            + i128::from(read_i64(ram, wtm + 8)?)
            - delta_ns;
        ram.write_u64(wtm, wtm_ns.div_euclid(NSEC_PER_SEC) as i64 as u64)?;
        ram.write_u64(wtm + 8, wtm_ns.rem_euclid(NSEC_PER_SEC) as u64)?;
        add_i64(ram, tk + t.offs_real, delta_ns)?;
        add_i64(ram, tk + t.offs_tai, delta_ns)?;
        add_i64(ram, tk + t.base_real, delta_ns)?;
        bump_u32(ram, tk + t.clock_was_set_seq, 1)?;
    }
    bump_u32(ram, t.timekeeper_seq, 2)?;
    for i in 0..2 {
        let base = t.fast_mono + t.fast_base + i * t.read_base_size;
        add_i64(ram, base + t.read_base_base_real, delta_ns)?;
    }
    let vd = t.vdso_data;
    bump_u32(ram, vd + t.vdso_seq, 2)?;
    for (clock, shift) in [
        (t.clock_realtime, shift_bits),
        (t.clock_tai, shift_bits),
        (t.clock_realtime_coarse, 0),
    ] {
        let at = vd + t.vdso_basetime + clock * t.vdso_timestamp_size;
        let (sec, nsec) =
            shift_timestamp(ram.read_u64(at)?, ram.read_u64(at + 8)?, shift, delta_ns);
        ram.write_u64(at, sec)?;
        ram.write_u64(at + 8, nsec)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_move_with_carry_and_keep_sub_nanosecond_bits() {
        let shift = 10;
        let nsec = (999_999_000u64 << shift) | 0x155;

        let (sec, moved) = shift_timestamp(100, nsec, shift, 2_000);
        let (back_sec, back) = shift_timestamp(sec, moved, shift, -2_000);

        assert_eq!(sec, 101);
        assert_eq!(moved >> shift, 1_000);
        assert_eq!(moved & 0x3ff, 0x155);
        assert_eq!((back_sec, back), (100, nsec));
    }

    fn layout() -> TimeLayout {
        TimeLayout {
            timekeepers: [0x1000, 0x2000],
            timekeeper_seq: 0x3000,
            fast_mono: 0x4000,
            vdso_data: 0x5000,
            xtime_sec: 0x70,
            xtime_nsec: 0x20,
            shift: 0x1c,
            base_real: 0x30,
            wall_to_monotonic: 0x80,
            offs_real: 0x90,
            offs_tai: 0xa0,
            clock_was_set_seq: 0xa8,
            fast_base: 8,
            read_base_size: 0x38,
            read_base_base_real: 0x30,
            vdso_seq: 0,
            vdso_basetime: 0x28,
            vdso_timestamp_size: 16,
            clock_realtime: 0,
            clock_realtime_coarse: 5,
            clock_tai: 11,
        }
    }

    #[test]
    fn realtime_moves_every_copy_and_bumps_the_sequence_counts() {
        let ram = GuestRam::anonymous(0x10000).unwrap();
        let t = layout();
        for tk in t.timekeepers {
            ram.write(tk + t.shift, &8u32.to_le_bytes()).unwrap();
            ram.write_u64(tk + t.xtime_sec, 1000).unwrap();
            ram.write_u64(tk + t.xtime_nsec, 500_000_000 << 8).unwrap();
            ram.write_u64(tk + t.wall_to_monotonic, (-990i64) as u64)
                .unwrap();
            ram.write_u64(tk + t.wall_to_monotonic + 8, 0).unwrap();
            ram.write_u64(tk + t.offs_real, 990_000_000_000).unwrap();
        }
        ram.write_u64(t.vdso_data + t.vdso_basetime, 1000).unwrap();
        let delta = 3 * NSEC_PER_SEC + 600_000_000;

        set_realtime(&ram, &t, delta).unwrap();

        for tk in t.timekeepers {
            assert_eq!(ram.read_u64(tk + t.xtime_sec).unwrap(), 1004);
            assert_eq!(ram.read_u64(tk + t.xtime_nsec).unwrap(), 100_000_000 << 8);
            assert_eq!(ram.read_u64(tk + t.wall_to_monotonic).unwrap() as i64, -994);
            assert_eq!(
                ram.read_u64(tk + t.wall_to_monotonic + 8).unwrap(),
                400_000_000
            );
            assert_eq!(ram.read_u64(tk + t.offs_real).unwrap(), 993_600_000_000);
        }
        assert_eq!(ram.read_u64(t.vdso_data + t.vdso_basetime).unwrap(), 1003);
        assert_eq!(ram.read_u64(t.timekeeper_seq).unwrap() & 0xffff_ffff, 2);
        assert_eq!(ram.read_u64(t.vdso_data).unwrap() & 0xffff_ffff, 2);
    }

    #[test]
    fn crng_state_is_replaced_with_distinct_randomness() {
        let ram = GuestRam::anonymous(0x10000).unwrap();
        let r = RandomLayout {
            keys: [(0x1000, 32), (0x2000, 32), (0x3000, 32)],
            batches: [0x4000, 0x5000, 0x6000, 0x7000],
            batch_size: 96,
        };

        reseed_crng(&ram, &r).unwrap();
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        ram.read(0x1000, &mut a).unwrap();
        ram.read(0x2000, &mut b).unwrap();
        let mut batch = [0u8; 96];
        ram.read(0x7000, &mut batch).unwrap();

        assert_ne!(a, [0; 32]);
        assert_ne!(a, b);
        assert_ne!(batch, [0; 96]);
    }

    #[test]
    fn a_kernel_without_the_layouts_is_refused_by_name() {
        let this = std::fs::read(std::env::current_exe().unwrap()).unwrap();

        let err = KernelLayout::from_elf(&this).unwrap_err();

        assert!(
            matches!(err, IdentityError::MissingSymbol("bud_time_layout")),
            "{err}"
        );
    }
}
