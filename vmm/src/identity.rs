//! A clone's own identity, written by the host into the stopped guest: its wall clock and its
//! kernel CRNG. No guest-kernel work: on kvm_pvm `clock_settime()` and the RNDADDENTROPY +
//! RNDRESEEDCRNG ioctls cost milliseconds of emulated kernel time per job. Where to write
//! comes from the guest kernel itself ([`crate::kernel_layout`]).
//!
//! - **Clock.** Every clone resumes with its template's kvm-clock (see
//!   [`crate::snapshot::set_clock`]), so its guest believes no time passed since READY. Its
//!   `CLOCK_REALTIME` (and TAI) is then moved by `host now - guest wall clock at READY`
//!   ([`set_realtime`]): the same fields `do_settimeofday64()` changes (both timekeepers,
//!   the fast timekeeper, the vDSO data), with their sequence counts bumped so that a reader
//!   caught between two reads retries, and, as the kernel would, the fields it derives from
//!   them (the monotonic clock's base, which balances the change of xtime's sub-second part,
//!   its realtime base, `ktime_sec`). The guest's monotonic clock, in the kernel and in the
//!   vDSO, reads the same value before and after. The guest is stopped in user mode while
//!   this happens (one vCPU, no preemption), so no kernel writer is half-way through an
//!   update.
//! - **CRNG.** [`reseed_crng`] writes fresh host randomness over the base CRNG key, the CPU's
//!   CRNG key, the input pool's BLAKE2s chaining value (so a later reseed in the guest draws
//!   on a secret of this clone, not the template's) and the batched-entropy buffers
//!   (`get_random_u32()` and friends), so no value the template could have produced is ever
//!   handed out by a clone.
//!
//! This module must never write guest memory outside the fields the layouts name (and the
//! two a layout places between named ones, [`TimeLayout::derived_fields`]).

use crate::kernel_layout::{RandomLayout, TimeLayout};
use crate::memory::{GuestRam, MemoryError};

const NSEC_PER_SEC: i128 = 1_000_000_000;

/// Errors of writing a clone's identity.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("cannot read host randomness: {0}")]
    Entropy(std::io::Error),
    #[error("the guest's timekeeper shift {0} is not below 64")]
    BadShift(u32),
    #[error("the guest kernel's timekeeper layout is not the one bud writes")]
    Layout,
    #[error("guest memory: {0}")]
    Memory(#[from] MemoryError),
}

/// The host's wall clock (`CLOCK_REALTIME`) in nanoseconds since the epoch; 0 before it.
pub(crate) fn host_wall_ns() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0)
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
pub(crate) fn reseed_crng(ram: &GuestRam, r: &RandomLayout) -> Result<(), IdentityError> {
    let targets: Vec<(u64, usize)> = r
        .keys
        .iter()
        .map(|&(addr, len)| (addr, len as usize))
        .chain(r.batches.iter().map(|&addr| (addr, r.batch_size as usize)))
        .collect();
    // One getrandom for all of it, each target its own slice.
    let mut buf = vec![0u8; targets.iter().map(|&(_, len)| len).sum()];
    host_random(&mut buf)?;
    let mut at = 0;
    for (addr, len) in targets {
        ram.write(addr, &buf[at..at + len])?;
        at += len;
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
/// and boot time are untouched, in the kernel's own reads (`ktime_get()`, which timers and
/// sleeps run on) as in the vDSO's.
pub(crate) fn set_realtime(
    ram: &GuestRam,
    t: &TimeLayout,
    delta_ns: i128,
) -> Result<(), IdentityError> {
    let derived = t.derived_fields().ok_or(IdentityError::Layout)?;
    let mut shift_bits = 0;
    for &tk in &t.timekeepers {
        let mut b = [0u8; 4];
        ram.read(tk + t.shift, &mut b)?;
        let shift = u32::from_le_bytes(b);
        if shift >= 64 {
            return Err(IdentityError::BadShift(shift));
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
        let (wtm_sec, wtm_nsec) = (
            wtm_ns.div_euclid(NSEC_PER_SEC),
            wtm_ns.rem_euclid(NSEC_PER_SEC),
        );
        ram.write_u64(wtm, wtm_sec as i64 as u64)?;
        ram.write_u64(wtm + 8, wtm_nsec as u64)?;
        add_i64(ram, tk + t.offs_real, delta_ns)?;
        add_i64(ram, tk + t.offs_tai, delta_ns)?;
        let offs_real = i128::from(read_i64(ram, tk + t.offs_real)?);
        // What the kernel derives from those (`tk_update_ktime_data()` and
        // `timekeeping_update()`). `ktime_get()` is `tkr_mono.base` plus `tkr_mono.xtime_nsec`
        // plus the clock's progress since the last update, so the base must take back what
        // xtime_nsec's sub-second part moved: left as it was, the kernel's monotonic clock
        // (not the vDSO's) was off by that much, up to a second either way, until its next
        // timekeeping update, and a job's first sleeps ended that much late or at once.
        let seconds = i128::from(sec) + wtm_sec;
        let mono_base = seconds * NSEC_PER_SEC + wtm_nsec;
        let carry = wtm_nsec + i128::from(nsec >> shift) >= NSEC_PER_SEC;
        ram.write_u64(tk + derived.mono_base, mono_base as i64 as u64)?;
        ram.write_u64(tk + t.base_real, (mono_base + offs_real) as i64 as u64)?;
        ram.write_u64(tk + derived.ktime_sec, (seconds + i128::from(carry)) as u64)?;
        bump_u32(ram, tk + t.clock_was_set_seq, 1)?;
    }
    bump_u32(ram, t.timekeeper_seq, 2)?;
    // The fast timekeeper keeps its own copy of the old base and xtime_nsec, which still
    // agree with each other: only its realtime base moves.
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

    /// The kernel's reads of one timekeeper with no clock progress since its last update:
    /// `ktime_get()`, `ktime_get_real()`, `ktime_get_seconds()`.
    fn kernel_reads(ram: &GuestRam, t: &TimeLayout, tk: u64) -> (i128, i128, u64) {
        let d = t.derived_fields().unwrap();
        let shift = 8;
        let xn = i128::from(ram.read_u64(tk + t.xtime_nsec).unwrap() >> shift);
        let base = i128::from(ram.read_u64(tk + d.mono_base).unwrap() as i64);
        let base_real = i128::from(ram.read_u64(tk + t.base_real).unwrap() as i64);
        (
            base + xn,
            base_real + xn,
            ram.read_u64(tk + d.ktime_sec).unwrap(),
        )
    }

    #[test]
    fn moving_realtime_leaves_the_kernels_monotonic_clock_where_it_was() {
        // A timekeeper as the kernel leaves it: wall clock 1000.9 s, monotonic 51.2 s.
        let ram = GuestRam::anonymous(0x10000).unwrap();
        let t = layout();
        let d = t.derived_fields().unwrap();
        let (xs, xn, wtm_sec, wtm_nsec) = (1000i64, 900_000_000i64, -950i64, 300_000_000i64);
        let base = (xs + wtm_sec) * 1_000_000_000 + wtm_nsec;
        let offs_real = -(wtm_sec * 1_000_000_000 + wtm_nsec);
        for tk in t.timekeepers {
            ram.write(tk + t.shift, &8u32.to_le_bytes()).unwrap();
            ram.write_u64(tk + t.xtime_sec, xs as u64).unwrap();
            ram.write_u64(tk + t.xtime_nsec, (xn as u64) << 8 | 0x55)
                .unwrap();
            ram.write_u64(tk + t.wall_to_monotonic, wtm_sec as u64)
                .unwrap();
            ram.write_u64(tk + t.wall_to_monotonic + 8, wtm_nsec as u64)
                .unwrap();
            ram.write_u64(tk + t.offs_real, offs_real as u64).unwrap();
            ram.write_u64(tk + d.mono_base, base as u64).unwrap();
            ram.write_u64(tk + t.base_real, (base + offs_real) as u64)
                .unwrap();
            ram.write_u64(tk + d.ktime_sec, 51).unwrap();
        }
        let before: Vec<_> = t
            .timekeepers
            .iter()
            .map(|&tk| kernel_reads(&ram, &t, tk))
            .collect();
        // 12.3 s: the sub-second part of xtime carries (0.9 + 0.3).
        let delta = 12 * NSEC_PER_SEC + 300_000_000;

        set_realtime(&ram, &t, delta).unwrap();

        for (&tk, &(mono, real, _)) in t.timekeepers.iter().zip(&before) {
            let (mono_after, real_after, ktime_sec) = kernel_reads(&ram, &t, tk);
            assert_eq!(mono_after, mono, "monotonic moved");
            assert_eq!(real_after, real + delta, "realtime did not move by delta");
            assert_eq!(mono, 51_200_000_000);
            assert_eq!(i128::from(ktime_sec), mono_after / NSEC_PER_SEC);
            assert_eq!(ram.read_u64(tk + t.xtime_nsec).unwrap() & 0xff, 0x55);
        }
    }

    #[test]
    fn a_layout_whose_structs_differ_is_refused_and_nothing_written() {
        let ram = GuestRam::anonymous(0x10000).unwrap();
        let t = TimeLayout {
            base_real: 0x38,
            ..layout()
        };

        let r = set_realtime(&ram, &t, NSEC_PER_SEC);

        assert!(matches!(r, Err(IdentityError::Layout)), "{r:?}");
        assert_eq!(ram.read_u64(t.timekeepers[0] + t.xtime_sec).unwrap(), 0);
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
}
