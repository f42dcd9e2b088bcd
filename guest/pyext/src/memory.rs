//! Memory warm-up for the worker: malloc tuning, heap reserve, stack and whole-process
//! prefaulting.
//!
//! Everything here runs before READY. The goal is that a job, in a clone, finds every page it
//! is likely to touch already present in the worker's page tables: a fresh page costs
//! ~1.3 ms of emulated guest kernel, a page that is already mapped costs nothing in the guest.
//! The policy (which settings, how many bytes) is the worker's, in Python; these are thin,
//! checked bindings.

use std::io;

/// Most stack [`prefault_stack`] agrees to touch: well inside the 8 MiB main-thread stack.
pub const STACK_PREFAULT_MAX: usize = 2 << 20;

/// Bytes of stack touched per recursion step.
const STACK_STEP: usize = 4096;

/// `mallopt(param, value)`; false if glibc refused the setting.
pub fn mallopt(param: libc::c_int, value: libc::c_int) -> bool {
    // SAFETY: mallopt only changes allocator parameters; it validates both arguments.
    unsafe { libc::mallopt(param, value) == 1 }
}

/// Grows the malloc heap by `bytes` and leaves it there, free.
///
/// Mallocs one block and frees it. With the mmap threshold above `bytes` the block comes from
/// the brk heap, and with trimming disabled the free block stays part of the heap, so later
/// allocations are carved from it instead of from new memory. Nothing is touched here; the
/// pages become resident with [`lock_all`]. False if malloc failed.
pub fn reserve_heap(bytes: usize) -> bool {
    // SAFETY: plain malloc of `bytes`; the block is freed right away and never used.
    // black_box: the pointer must look used, or the optimizer deletes the malloc/free pair.
    let block = std::hint::black_box(unsafe { libc::malloc(bytes) });
    if block.is_null() {
        return false;
    }
    // SAFETY: `block` came from malloc above and is freed exactly once.
    unsafe { libc::free(block) };
    true
}

/// Touches `bytes` of stack below the caller, so that deeper C recursion in a job (the
/// compiler, `re`, `json`, sorting with key functions) finds stack pages already present.
pub fn prefault_stack(bytes: usize) {
    touch_stack(bytes.min(STACK_PREFAULT_MAX));
}

#[inline(never)]
fn touch_stack(remaining: usize) {
    let mut frame = [0u8; STACK_STEP];
    // The optimizer must assume the zeroed frame is read and written: the zeroing (and so
    // the page touch) stays, and the recursion cannot become a loop reusing one frame.
    std::hint::black_box(&mut frame);
    if remaining > STACK_STEP {
        touch_stack(remaining - STACK_STEP);
    }
    std::hint::black_box(&frame);
}

/// `mlockall(MCL_CURRENT)`: makes every page of every mapping that exists now resident and
/// present in the page tables, in one system call.
///
/// The kernel populates them itself (writable private pages with write faults, so
/// copy-on-write is already broken): code and data pages of the interpreter and its
/// libraries that warm-up never touched, the heap reserve, the free pools of pymalloc's
/// arenas. Not MCL_FUTURE: later mappings (a job's thread stacks, big allocations) must not
/// be populated in full. The guest has no swap, so the lock changes nothing else.
pub fn lock_all() -> io::Result<()> {
    // SAFETY: mlockall changes residency of our own mappings, never their contents.
    if unsafe { libc::mlockall(libc::MCL_CURRENT) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What [`lock_all`] does, for every mapping but the address range `skip` (start, end):
/// `mlock` of each range `/proc/self/maps` lists, cut around `skip`. For a worker that locks
/// again after READY's warm-up had reserved a region it must not make resident (a template
/// layer's warm-up, `bud_layer.py`). A range the kernel will not lock is left as it is.
/// Returns the bytes locked.
pub fn lock_mapped_except(skip: Option<(usize, usize)>) -> io::Result<usize> {
    let mut bytes = 0;
    for (start, end, perms) in mappings()? {
        if perms.starts_with("---") {
            continue;
        }
        let pieces = match skip {
            Some((a, b)) if a < end && start < b => [(start, a.max(start)), (b.min(end), end)],
            _ => [(start, end), (end, end)],
        };
        for (from, to) in pieces.into_iter().filter(|(f, t)| f < t) {
            // SAFETY: mlock changes the residency of a range of our own mappings, never
            // their contents.
            if unsafe { libc::mlock(from as *const libc::c_void, to - from) } == 0 {
                bytes += to - from;
            }
        }
    }
    Ok(bytes)
}

/// This process's mappings as `/proc/self/maps` lists them: (start, end, permissions).
fn mappings() -> io::Result<Vec<(usize, usize, String)>> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    Ok(maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.to_owned();
            let start = usize::from_str_radix(start, 16).ok()?;
            let end = usize::from_str_radix(end, 16).ok()?;
            Some((start, end, perms))
        })
        .collect())
}

/// Makes every page of every writable private mapping this process's own and present:
/// `MADV_POPULATE_WRITE` on each `rw-p` range of `/proc/self/maps`. After a fork that breaks
/// the copy-on-write the process shares with its parent, so that neither pays a fault for
/// it later; unlike [`lock_all`] it leaves alone what is only read (libraries' code and
/// constants, files mapped read-only), which a fork shares for good. A range the kernel will
/// not populate (a special mapping) is left as it is. Returns the bytes of the ranges.
pub fn own_writable_pages() -> io::Result<usize> {
    let mut bytes = 0;
    for (start, end, perms) in mappings()? {
        if perms != "rw-p" {
            continue;
        }
        // SAFETY: advice on a mapping of this process as /proc lists it; populating for
        // write changes which physical pages back it, never what they hold.
        let r = unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            let error = io::Error::last_os_error();
            // A kernel older than 5.14 has no such advice: the caller's to handle.
            if error.raw_os_error() == Some(libc::EINVAL) {
                return Err(error);
            }
            continue;
        }
        bytes += end - start;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_mapping_is_listed_with_its_permissions_and_a_skipped_one_stays_unlocked() {
        let len = 4 << 20;
        // SAFETY: a new private anonymous mapping of our own; unmapped below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        let start = at as usize;
        let listed = mappings().unwrap();
        assert!(
            listed
                .iter()
                .any(|(s, e, p)| *s <= start && start + len <= *e && p.starts_with("r--")),
            "{listed:?}"
        );
        lock_mapped_except(Some((start, start + len))).unwrap();
        let mut resident = vec![0u8; len / 4096];
        // SAFETY: mincore on our own mapping into a vector of one byte per page.
        assert_eq!(unsafe { libc::mincore(at, len, resident.as_mut_ptr()) }, 0);
        assert!(
            resident.iter().all(|r| r & 1 == 0),
            "the skipped range was made resident"
        );
        // SAFETY: unlocks and unmaps what this test mapped and locked.
        unsafe {
            libc::munlockall();
            libc::munmap(at, len);
        }
    }

    #[test]
    fn writable_pages_are_populated_with_their_contents_kept() {
        let data = vec![7u8; 4 << 20];
        let bytes = own_writable_pages().unwrap();
        assert!(bytes >= data.len(), "{bytes}");
        assert!(data.iter().all(|&b| b == 7));
    }

    #[test]
    fn reserve_heap_of_a_few_pages_succeeds() {
        assert!(reserve_heap(16 * 4096));
    }

    #[test]
    fn prefault_stack_returns_after_touching_its_maximum() {
        // Runs on a thread with a known, large enough stack.
        let handle = std::thread::Builder::new()
            .stack_size(2 * STACK_PREFAULT_MAX)
            .spawn(|| prefault_stack(usize::MAX))
            .expect("spawn");

        assert!(handle.join().is_ok());
    }

    #[test]
    fn mallopt_accepts_the_largest_mmap_threshold_of_64_bit_glibc() {
        assert!(mallopt(libc::M_MMAP_THRESHOLD, 32 << 20));
    }
}
