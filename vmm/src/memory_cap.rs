//! The memory cap of a job, enforced by the host: a job that takes the guest's free memory
//! below the guest kernel's low watermark is stopped there, as [`Status::MemoryLimit`]
//! (crate::job::Status), instead of when the guest kernel's OOM killer gets to it.
//!
//! What the cap is: guest RAM is each job's memory ceiling (`--mem-mib`). The guest kernel
//! keeps its zones above a minimum watermark and wakes its reclaim below the low watermark
//! (both follow from `min_free_kbytes`; low is min plus a quarter). bud's guest has no swap
//! and no disk, so reclaim can free next to nothing: below the low watermark the guest is
//! out of memory in all but name, and what follows is kswapd and direct reclaim walking
//! their lists, then the OOM killer, all of it run by kvm_pvm's instruction emulator. So the
//! cap is "the guest's free pages stay at or above its low watermark": a job may use all the
//! memory the guest has above it, and the moment it takes the free count below it, the job
//! is over.
//!
//! How it is watched: on kvm_pvm every fresh user folio (anonymous memory, tmpfs and shmem
//! pages) is zeroed by the VMM at the guest kernel's request (the host-zero port,
//! [`crate::devices::host_zero`]), so the VMM already sees each allocation that makes a job
//! grow, with no extra exit. After serving one, it reads the guest kernel's free-page
//! counter (`vm_zone_stat[NR_FREE_PAGES]`, found in the kernel's symbol table; bud's guest
//! kernel is uniprocessor, so the global counter is updated at every allocation, not folded
//! in from per-CPU deltas) and compares it with the floor. One 8-byte read of guest RAM per
//! fresh folio; nothing in the guest changes. The floor is read once per request from the
//! guest's own `min_free_kbytes` (a root job that changes it changes only its own cap).
//!
//! Why this and not the alternatives (measured on kvm_pvm, 2026-11-28, docs/measurements.md
//! session 21):
//! - The late answer was not mostly the OOM path: a loop appending 1 MiB `bytearray`s
//!   grows at a steady ~3 MiB/s for its whole run (fresh 4 KiB pages of the malloc heap,
//!   ~1 000 emulated instructions each, and the timer ticks of a long run); the guest's
//!   reclaim and OOM kill were the last few seconds. What a cap can remove is those seconds
//!   (and any emulated reclaim a slower bomb triggers), so it has to act at the crossing,
//!   which the host sees at the next fresh folio.
//! - The private pages of the clone's RAM mapping (pagemap, RSS, the dirty log) do not
//!   measure a job's memory: a reused VM keeps the private pages of every earlier job (a
//!   reset copies the template's bytes into them), and pages the guest frees stay private.
//! - RLIMIT_DATA in the worker does not see the pymalloc arena region (reserved up front as
//!   one writable mapping), tmpfs files, shared memory or child processes, and setting it
//!   per job is a system call on the trivial job's path; RLIMIT_AS counts that 8 GiB
//!   reservation. The guest's free-page count sees all of them.
//!
//! What it counts as used: pages the guest kernel keeps on its per-CPU free lists. A freed
//! page goes to the CPU's list first and reaches the free count only when the list is
//! drained (past its `high` mark, or by the kernel's periodic decay); measured in a job
//! that maps, fills and unmaps 48 MiB (session 26), up to ~27 MiB of a 256 MiB guest sat
//! there for a while. The guest's own watermark checks read the same counter, but its
//! allocator drains those lists before it gives up; the cap does not, so a job that frees
//! and allocates right at the edge can be stopped by the cap where the guest alone would
//! have drained its lists and gone on. Such a job is within a few MiB of the guest's RAM
//! either way.
//!
//! What it does not do: kernel allocations that are not user folios (page tables, slab,
//! pipe buffers) do not reach the VMM, so they are noticed at the next user folio. On
//! hardware virtualization the guest zeroes its own pages (no host-zero exits) and runs its
//! reclaim and OOM killer natively: there the guest's OOM killer remains the cap.

use crate::memory::GuestRam;

/// Bytes of a page (the unit of the kernel's counters).
const PAGE_SIZE: u64 = 4096;

/// A clone's memory cap: where the guest kernel keeps its free-page count and how low it may
/// go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemoryCap {
    /// Guest-physical address of the free-page counter (an `atomic_long_t`).
    free_pages: u64,
    /// The job is over when the free count drops below this many pages.
    floor_pages: u64,
}

impl MemoryCap {
    /// The cap of a guest whose free-page counter is at `free_pages` and whose
    /// `min_free_kbytes` is at `min_free_kbytes` (guest-physical addresses), with the floor
    /// read from `ram` now. None when the guest has no such counter or the read fails.
    pub(crate) fn read(ram: &GuestRam, layout: Option<&MemoryLayout>) -> Option<Self> {
        let layout = layout?;
        let mut b = [0u8; 4];
        ram.read(layout.min_free_kbytes, &mut b).ok()?;
        Some(Self {
            free_pages: layout.free_pages,
            floor_pages: low_watermark_pages(u64::from(i32::from_le_bytes(b).max(0) as u32)),
        })
    }

    /// Whether the guest's free pages are below the floor now. A counter the host cannot
    /// read (outside RAM) or that is negative (hostile or torn) counts as not crossed: the
    /// guest's own OOM killer is still there.
    pub(crate) fn crossed(&self, ram: &GuestRam) -> bool {
        ram.read_u64(self.free_pages)
            .is_ok_and(|free| (free as i64) >= 0 && free < self.floor_pages)
    }
}

/// Where the guest kernel keeps what [`MemoryCap`] reads (guest-physical addresses, from
/// the kernel's symbol table: [`crate::kernel_layout`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct MemoryLayout {
    /// `vm_zone_stat[NR_FREE_PAGES]` (index 0).
    pub(crate) free_pages: u64,
    /// `min_free_kbytes` (an `int`).
    pub(crate) min_free_kbytes: u64,
}

/// The guest kernel's low watermark, summed over its zones, in pages: the min watermark
/// (`min_free_kbytes`) plus a quarter (`__setup_per_zone_wmarks`; the scale-factor term is
/// smaller in guests of bud's sizes).
fn low_watermark_pages(min_free_kbytes: u64) -> u64 {
    let min = min_free_kbytes * 1024 / PAGE_SIZE;
    min + min / 4
}

#[cfg(test)]
mod tests {
    use super::*;

    const FREE: u64 = 0x1000;
    const MIN_KB: u64 = 0x2000;

    fn guest(free_pages: i64, min_free_kbytes: i32) -> GuestRam {
        let ram = GuestRam::anonymous(4 * PAGE_SIZE).unwrap();
        ram.write(FREE, &free_pages.to_le_bytes()).unwrap();
        ram.write(MIN_KB, &min_free_kbytes.to_le_bytes()).unwrap();
        ram
    }

    fn layout() -> MemoryLayout {
        MemoryLayout {
            free_pages: FREE,
            min_free_kbytes: MIN_KB,
        }
    }

    #[test]
    fn the_floor_is_the_low_watermark_of_min_free_kbytes() {
        // 11 244 KiB: bud's 256 MiB guest; its zone reports min 2 811, low 3 513 pages.
        assert_eq!(low_watermark_pages(11_244), 2_811 + 702);
    }

    #[test]
    fn free_memory_below_the_low_watermark_crosses_the_cap_and_above_it_does_not() {
        let above = guest(3_514, 11_244);
        let at = guest(3_513, 11_244);
        let below = guest(3_512, 11_244);
        let cap = |ram: &GuestRam| MemoryCap::read(ram, Some(&layout())).unwrap();

        assert!(!cap(&above).crossed(&above));
        assert!(!cap(&at).crossed(&at));
        assert!(cap(&below).crossed(&below));
    }

    #[test]
    fn a_negative_or_unreadable_counter_and_no_layout_never_cross() {
        let negative = guest(-5, 11_244);
        let outside = MemoryCap {
            free_pages: 1 << 40,
            floor_pages: u64::MAX,
        };

        assert!(
            !MemoryCap::read(&negative, Some(&layout()))
                .unwrap()
                .crossed(&negative)
        );
        assert!(!outside.crossed(&negative));
        assert_eq!(MemoryCap::read(&negative, None), None);
    }
}
