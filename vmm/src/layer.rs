//! Memory layers: the pages a VM made its own, frozen in a file that other VMs map
//! copy-on-write over the template. How a session forks without copying guest RAM per child.
//!
//! A clone's RAM is a `MAP_PRIVATE` mapping of the template's memory file: pages it never
//! wrote are the file's, shared by every clone; pages it wrote are private (anonymous)
//! copies, listed by `/proc/self/pagemap` ([`GuestRam::private_pages`]). [`Layer::capture`]
//! copies those private pages, once, into a new memory file (`memfd`) at their guest
//! offsets. [`Layer::map_over`] then maps the layer's page runs `MAP_PRIVATE | MAP_FIXED`
//! over a guest RAM mapping: the VM sees the layer's bytes there and the template's
//! elsewhere, and its own writes again become private copies. The source VM is mapped
//! over its own layer too, which frees its private copies: the session's data is then held
//! once, in the layer, shared by the source and every child. A fork of a fork adds a
//! layer on top of the layers its source already had (mapped in order, newest last).
//!
//! The copy is the only per-fork cost proportional to the data (one `pwrite` per run, no
//! per-child copy). Mapping is per run of pages, and every run is a VMA in each VM that
//! maps the layer, so runs closer than a gap are merged (the gap's pages are copied too):
//! at most [`MAX_RUNS`] runs per layer, which keeps a child's mapping cheap and every VM far
//! below the kernel's `vm.max_map_count`.
//!
//! KVM learns of a remapping through its MMU notifier: replacing the pages under a live
//! memory slot makes it drop the mappings it derived from them, as for any host-side
//! change of guest memory (this is how QEMU's RAM remapping works too).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};

use crate::memory::{GuestRam, PAGE_SIZE, set_bits};

/// Most page runs a layer is cut into (each one a VMA, and an mmap per child). Measured with
/// `cargo bench --bench session` (a session holding 32 MiB of data, 8 children): its ~330
/// natural runs cost 2.4 ms per child (an mmap is ~3 us); merged to 64 runs the layer holds
/// 9 % more bytes and a child takes 1.25 ms (the fork of 8: 18.7 -> 9.4 ms); to 16 runs,
/// 19 % more bytes for 7.6 ms.
pub(crate) const MAX_RUNS: usize = 64;

/// Errors making or mapping a layer.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("reading /proc/self/pagemap: {0}")]
    Pagemap(std::io::Error),
    #[error("creating the layer's memory file: {0}")]
    Create(std::io::Error),
    #[error("copying pages into the layer: {0}")]
    Copy(std::io::Error),
    #[error("mapping the layer over guest RAM: {0}")]
    Map(std::io::Error),
    #[error("layer of {layer} bytes does not fit guest RAM of {ram} bytes")]
    Size { layer: u64, ram: u64 },
}

/// Pages of one VM frozen in a memory file (module docs).
#[derive(Debug)]
pub struct Layer {
    file: File,
    size: u64,
    /// (first page, page count), ascending, disjoint.
    runs: Vec<(u64, u64)>,
    /// Where each run's pages start in `file`, in bytes: at their guest offset in a layer
    /// made by [`Layer::capture`], one after another in a session file
    /// ([`crate::session_file`]).
    file_offsets: Vec<u64>,
}

impl Layer {
    /// Copies the private pages of `ram` (runs merged as the module docs say) into a new
    /// layer. The VM must not run meanwhile.
    pub(crate) fn capture(ram: &GuestRam) -> Result<Self, LayerError> {
        let private = ram.private_pages().map_err(LayerError::Pagemap)?;
        let runs = coalesce(set_bits(&private), MAX_RUNS);
        let file = memfd("bud-layer").map_err(LayerError::Create)?;
        file.set_len(ram.len()).map_err(LayerError::Create)?;
        for &(first, pages) in &runs {
            let offset = first * PAGE_SIZE;
            ram.write_to_file(&file, offset, pages * PAGE_SIZE)
                .map_err(LayerError::Copy)?;
        }
        let file_offsets = runs.iter().map(|r| r.0 * PAGE_SIZE).collect();
        Ok(Self {
            file,
            size: ram.len(),
            runs,
            file_offsets,
        })
    }

    /// A layer over the pages of `file`: run `runs[i]` of a RAM of `size` bytes is at byte
    /// `file_offsets[i]` of the file (page-aligned; the caller checked the file holds them).
    pub(crate) fn from_file(
        file: File,
        size: u64,
        runs: Vec<(u64, u64)>,
        file_offsets: Vec<u64>,
    ) -> Self {
        Self {
            file,
            size,
            runs,
            file_offsets,
        }
    }

    /// The runs, (first page, page count), ascending.
    pub(crate) fn page_runs(&self) -> &[(u64, u64)] {
        &self.runs
    }

    /// Bytes of guest memory the layer holds.
    pub fn bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.1).sum::<u64>() * PAGE_SIZE
    }

    /// Number of page runs (VMAs per VM that maps the layer).
    pub(crate) fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Maps the layer's runs copy-on-write over `ram`, which must be the same size.
    pub(crate) fn map_over(&self, ram: &GuestRam) -> Result<(), LayerError> {
        if ram.len() != self.size {
            return Err(LayerError::Size {
                layer: self.size,
                ram: ram.len(),
            });
        }
        for (&(first, pages), &offset) in self.runs.iter().zip(&self.file_offsets) {
            let at = ram.host_address() + first * PAGE_SIZE;
            // SAFETY: `at..at + pages * PAGE_SIZE` lies inside `ram`'s own mapping (runs come
            // from a bitmap of a RAM of the same size, or from a session file whose runs were
            // checked against that size when read), which `ram` owns and unmaps whole on
            // drop. MAP_FIXED replaces those pages of that mapping only; no Rust reference
            // into guest RAM is held across this call (guest memory is only accessed through
            // copies and raw pointers), and KVM is told through its MMU notifier.
            let ptr = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    (pages * PAGE_SIZE) as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    self.file.as_raw_fd(),
                    offset as libc::off_t,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(LayerError::Map(std::io::Error::last_os_error()));
            }
        }
        Ok(())
    }
}

/// Runs of consecutive pages, merged across gaps until there are at most `max_runs`.
pub(crate) fn coalesce(pages: impl Iterator<Item = u64>, max_runs: usize) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for p in pages {
        match runs.last_mut() {
            Some((first, n)) if *first + *n == p => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    let mut gap = 1;
    while runs.len() > max_runs.max(1) {
        gap *= 2;
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
        for (first, n) in runs {
            match merged.last_mut() {
                Some((f, m)) if first - (*f + *m) <= gap => *m = first + n - *f,
                _ => merged.push((first, n)),
            }
        }
        runs = merged;
    }
    runs
}

/// An anonymous memory file.
pub(crate) fn memfd(name: &str) -> std::io::Result<File> {
    let name = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: `name` is a valid C string; memfd_create has no other memory effects.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn consecutive_pages_make_one_run_and_gaps_merge_only_past_the_limit() {
        let pages = [1, 2, 3, 10, 11, 40];

        assert_eq!(
            coalesce(pages.into_iter(), 10),
            vec![(1, 3), (10, 2), (40, 1)]
        );
        assert_eq!(coalesce(pages.into_iter(), 2), vec![(1, 11), (40, 1)]);
        assert_eq!(coalesce(pages.into_iter(), 1), vec![(1, 40)]);
        assert_eq!(coalesce(std::iter::empty(), 1), vec![]);
    }

    #[test]
    fn a_mapped_layer_shows_the_source_bytes_and_takes_private_writes() {
        let template = tempfile_with(&[7u8; 4 * 4096]);
        let source = GuestRam::private_fd(&template, 4 * 4096).unwrap();
        source.write(4096, b"source page").unwrap();

        let layer = Layer::capture(&source).unwrap();
        let child = GuestRam::private_fd(&template, 4 * 4096).unwrap();
        layer.map_over(&child).unwrap();
        child.write(4096, b"child").unwrap();
        let mut seen = [0u8; 11];
        child.read(4096, &mut seen).unwrap();
        let mut untouched = [0u8; 4];
        child.read(0, &mut untouched).unwrap();
        let mut source_now = [0u8; 11];
        source.read(4096, &mut source_now).unwrap();

        assert_eq!(layer.runs(), 1);
        assert_eq!(layer.bytes(), 4096);
        assert_eq!(&seen, b"childe page");
        assert_eq!(untouched, [7; 4]);
        assert_eq!(&source_now, b"source page");
    }

    fn tempfile_with(bytes: &[u8]) -> File {
        let f = memfd("test").unwrap();
        f.write_all_at(bytes, 0).unwrap();
        f
    }
}
