//! KVM's own counters of a vCPU, read through its binary statistics file
//! (`KVM_GET_STATS_FD`, Linux 5.14+): how many times the guest exited, how many guest
//! instructions KVM had to emulate (under kvm_pvm: every guest-kernel instruction), and how
//! many page faults KVM handled. A job reads them before and after it runs
//! ([`crate::job::JobTimings::kvm`]), so where a job's time went is visible without perf.
//!
//! The file starts with a [`kvm_stats_header`]; its descriptors name each statistic and give
//! its offset in the data block. Also counted: the interrupts KVM injected into the guest
//! (`irq_injections`), which shows a timer that fired during a request. Names are looked up
//! once per vCPU; a statistic this KVM does not have reads as `None`. A host whose KVM has no
//! statistics file gives no counters at all (never an error for a job).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

use kvm_bindings::kvm_stats_header;
use kvm_ioctls::VcpuFd;

/// `KVM_GET_STATS_FD` = `_IO(KVMIO, 0xce)`.
const KVM_GET_STATS_FD: libc::c_ulong = 0xae_ce;
/// Size of a descriptor before its name (`struct kvm_stats_desc`).
const DESC_HEADER: usize = 16;
/// `KVM_STATS_TYPE_MASK` and `KVM_STATS_TYPE_CUMULATIVE` (counters, as opposed to peaks).
const STATS_TYPE_MASK: u32 = 0xf;
const STATS_TYPE_CUMULATIVE: u32 = 0;

/// The statistics bud reads, by KVM's names: exits, emulated instructions, page faults,
/// injected interrupts.
const NAMES: [&str; 4] = ["exits", "insn_emulation", "pf_taken", "irq_injections"];

/// KVM's counters of one vCPU at one moment (or a difference of two).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VcpuCounters {
    /// Exits from the guest to KVM (most are handled in the kernel, never reach bud).
    pub exits: Option<u64>,
    /// Guest instructions KVM emulated.
    pub emulated_instructions: Option<u64>,
    /// Page faults KVM took for the guest (shadow paging: most of a cold job's cost).
    pub page_faults: Option<u64>,
    /// Interrupts KVM injected into the guest (its timer's among them).
    pub interrupts: Option<u64>,
}

impl VcpuCounters {
    /// `self - before`, counter by counter.
    pub(crate) fn since(&self, before: &VcpuCounters) -> VcpuCounters {
        let d = |a: Option<u64>, b: Option<u64>| Some(a?.wrapping_sub(b?));
        VcpuCounters {
            exits: d(self.exits, before.exits),
            emulated_instructions: d(self.emulated_instructions, before.emulated_instructions),
            page_faults: d(self.page_faults, before.page_faults),
            interrupts: d(self.interrupts, before.interrupts),
        }
    }
}

/// The statistics file of one vCPU, with the byte offsets of the counters bud reads.
#[derive(Debug)]
pub(crate) struct VcpuStats {
    file: File,
    offsets: [Option<u64>; NAMES.len()],
}

impl VcpuStats {
    /// Opens `vcpu`'s statistics; None if this KVM has none (or they cannot be parsed).
    pub(crate) fn open(vcpu: &VcpuFd) -> Option<Self> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new file descriptor, or -1.
        let fd = unsafe { libc::ioctl(vcpu.as_raw_fd(), KVM_GET_STATS_FD as _, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let offsets = parse(&file)?;
        Some(Self { file, offsets })
    }

    /// The counters now.
    pub(crate) fn read(&self) -> VcpuCounters {
        let value = |i: usize| {
            let at = self.offsets[i]?;
            let mut b = [0u8; 8];
            self.file.read_exact_at(&mut b, at).ok()?;
            Some(u64::from_ne_bytes(b))
        };
        VcpuCounters {
            exits: value(0),
            emulated_instructions: value(1),
            page_faults: value(2),
            interrupts: value(3),
        }
    }
}

/// The data offsets of [`NAMES`], from the header and descriptors of a statistics file.
fn parse(file: &impl FileExt) -> Option<[Option<u64>; NAMES.len()]> {
    let mut h = [0u8; std::mem::size_of::<kvm_stats_header>()];
    file.read_exact_at(&mut h, 0).ok()?;
    let word = |i: usize| u32::from_ne_bytes(h[i * 4..i * 4 + 4].try_into().unwrap_or([0; 4]));
    let (name_size, num_desc, desc_offset, data_offset) = (word(1), word(2), word(4), word(5));
    let desc_size = DESC_HEADER + name_size as usize;
    if num_desc > 4096 || name_size == 0 || name_size > 4096 {
        return None;
    }
    let mut descs = vec![0u8; desc_size * num_desc as usize];
    file.read_exact_at(&mut descs, u64::from(desc_offset))
        .ok()?;
    let mut offsets = [None; NAMES.len()];
    for d in descs.chunks_exact(desc_size) {
        let flags = u32::from_ne_bytes(d[0..4].try_into().ok()?);
        let size = u16::from_ne_bytes(d[6..8].try_into().ok()?);
        let offset = u32::from_ne_bytes(d[8..12].try_into().ok()?);
        let name = &d[DESC_HEADER..];
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        if flags & STATS_TYPE_MASK != STATS_TYPE_CUMULATIVE || size != 1 {
            continue;
        }
        if let Some(i) = NAMES.iter().position(|n| n.as_bytes() == name) {
            offsets[i] = Some(u64::from(data_offset) + u64::from(offset));
        }
    }
    Some(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A statistics file with `names` (each a one-u64 cumulative counter) and their values.
    fn stats_file(names: &[&str], values: &[u64]) -> Vec<u8> {
        let name_size = 48usize;
        let desc_size = DESC_HEADER + name_size;
        let desc_offset = 24 + 16;
        let data_offset = desc_offset + desc_size * names.len();
        let mut f = vec![0u8; data_offset + 8 * names.len()];
        for (i, v) in [
            0u32,
            name_size as u32,
            names.len() as u32,
            24,
            desc_offset as u32,
        ]
        .into_iter()
        .chain([data_offset as u32])
        .enumerate()
        {
            f[i * 4..i * 4 + 4].copy_from_slice(&v.to_ne_bytes());
        }
        for (i, name) in names.iter().enumerate() {
            let d = desc_offset + i * desc_size;
            f[d + 6..d + 8].copy_from_slice(&1u16.to_ne_bytes());
            f[d + 8..d + 12].copy_from_slice(&((i * 8) as u32).to_ne_bytes());
            f[d + DESC_HEADER..d + DESC_HEADER + name.len()].copy_from_slice(name.as_bytes());
            f[data_offset + i * 8..data_offset + i * 8 + 8]
                .copy_from_slice(&values[i].to_ne_bytes());
        }
        f
    }

    #[test]
    fn counters_are_found_by_name_and_missing_ones_are_none() {
        let path = std::env::temp_dir().join(format!("bud-kvm-stats-{}", std::process::id()));
        std::fs::write(
            &path,
            stats_file(&["halt_exits", "pf_taken", "exits"], &[7, 42, 99]),
        )
        .unwrap();
        let file = File::open(&path).unwrap();

        let offsets = parse(&file).unwrap();
        let stats = VcpuStats { file, offsets };
        let now = stats.read();
        std::fs::remove_file(&path).unwrap();

        assert_eq!(now.exits, Some(99));
        assert_eq!(now.page_faults, Some(42));
        assert_eq!(now.emulated_instructions, None);
        let later = VcpuCounters {
            exits: Some(120),
            ..now
        };
        assert_eq!(later.since(&now).exits, Some(21));
        assert_eq!(later.since(&now).emulated_instructions, None);
    }
}
