//! Transparent huge pages for the guest's anonymous memory, set once at boot.
//!
//! A fresh anonymous page is guest-kernel work: a page fault, an allocation, a clear, a page
//! table update. Under kvm_pvm every instruction of it is emulated (~1 000 per 4 KiB page,
//! measured with `perf record -e kvm:kvm_emulate_insn`: `__handle_mm_fault`, `mt_find`, the
//! page allocator, the LRU), so touching 32 MiB took over 11 s. With transparent huge pages
//! a fresh, 2 MiB-aligned range inside one mapping is one fault, one allocation and one
//! clear: the same 32 MiB took 1.1 M emulated instructions instead of ~9 M. On hardware
//! virtualization nothing of this is emulated and huge pages are the usual default.
//!
//! The kernel turns THP off by itself on machines under 512 MiB of RAM (`hugepage_init`),
//! which bud's guests are, so the agent turns it back on through sysfs, and keeps its
//! background and fault-time work out of jobs: no synchronous compaction at a fault (fall
//! back to 4 KiB pages instead), no proactive compaction, and khugepaged (which collapses
//! 4 KiB pages into huge ones in the background) asleep after a first pass of one page.
//! Every setting is optional: on a kernel without THP the files are missing, the agent says
//! so on the console and the guest runs with 4 KiB pages.

use std::io;

/// `(sysfs or procfs file, value)`, written in this order: khugepaged's sleeps before THP
/// is enabled (enabling starts khugepaged).
pub const SETTINGS: [(&str, &str); 8] = [
    // khugepaged's first pass starts when huge pages are enabled and scans this many pages
    // of the processes that then fault in memory (4096 by default); the sleeps below only
    // follow a pass. Under kvm_pvm that pass (copying and clearing into 2 MiB pages) is
    // emulated: it had used 1.3 s of guest CPU, unfinished, at the template's snapshot,
    // and a nice-19 task queued with that much run time delays every wakeup in the clones
    // (`bud_worker.settle_run_queue`). One page: the smallest pass the kernel takes.
    (
        "/sys/kernel/mm/transparent_hugepage/khugepaged/pages_to_scan",
        "1",
    ),
    (
        "/sys/kernel/mm/transparent_hugepage/khugepaged/scan_sleep_millisecs",
        // The largest value the kernel takes (an unsigned int): about 49 days.
        "4294967295",
    ),
    (
        "/sys/kernel/mm/transparent_hugepage/khugepaged/alloc_sleep_millisecs",
        "4294967295",
    ),
    ("/sys/kernel/mm/transparent_hugepage/khugepaged/defrag", "0"),
    ("/sys/kernel/mm/transparent_hugepage/defrag", "never"),
    ("/proc/sys/vm/compaction_proactiveness", "0"),
    // Anonymous shared mappings (`mmap.mmap(-1, n)` in Python is MAP_SHARED), memfds and
    // SysV shm live on the kernel's internal shmem mount, which uses 4 KiB folios unless
    // told otherwise: measured 2.8 ms per fresh page of `mmap.mmap(-1, n)` under kvm_pvm.
    // `within_size`: huge folios only where the file (the mapping) covers all 2 MiB of one,
    // so a small memfd does not take a huge page. tmpfs mounts (/tmp, /dev/shm, the output
    // capture) have their own `huge=` options (`mounts.rs`).
    (
        "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
        "within_size",
    ),
    ("/sys/kernel/mm/transparent_hugepage/enabled", "always"),
];

/// Writes every [`SETTINGS`] entry; each failure goes to `warn` with its file, and the rest
/// are still written.
pub fn enable(mut warn: impl FnMut(&str, &io::Error)) {
    for (path, value) in SETTINGS {
        if let Err(e) = std::fs::write(path, value) {
            warn(path, &e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn khugepaged_sleeps_before_huge_pages_are_enabled_last() {
        let index = |name: &str| SETTINGS.iter().position(|(p, _)| p.ends_with(name));
        let enabled = index("transparent_hugepage/enabled").unwrap();
        assert_eq!(enabled, SETTINGS.len() - 1);
        assert!(index("scan_sleep_millisecs").unwrap() < enabled);
        assert!(index("alloc_sleep_millisecs").unwrap() < enabled);
        assert!(index("pages_to_scan").unwrap() < enabled);
    }
}
