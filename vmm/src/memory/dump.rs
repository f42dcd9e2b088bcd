//! Writing guest RAM to files: all of it, sparse, for a template's memory file, or a range
//! of it for a layer.

use std::fs::File;
use std::os::fd::AsRawFd;

use super::{GuestRam, PAGE_SIZE};

impl GuestRam {
    /// Copies `len` bytes of guest memory at `addr` into `file` at the same offset, straight
    /// from the mapping (no intermediate buffer).
    pub(crate) fn write_to_file(&self, file: &File, addr: u64, len: u64) -> std::io::Result<()> {
        let end = addr.checked_add(len).filter(|&e| e <= self.len);
        if end.is_none() {
            return Err(std::io::Error::other(format!(
                "{len:#x} bytes at {addr:#x} are outside guest RAM"
            )));
        }
        let mut done = 0u64;
        while done < len {
            // SAFETY: `addr + done .. addr + len` lies inside the live mapping (checked
            // above); pwrite only reads it. No Rust reference to guest memory is made, so a
            // guest writing meanwhile races only on the bytes copied, never on Rust's rules.
            let n = unsafe {
                libc::pwrite(
                    file.as_raw_fd(),
                    (self.host_address() + addr + done) as *const libc::c_void,
                    (len - done) as usize,
                    (addr + done) as libc::off_t,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(std::io::Error::other("pwrite wrote nothing"));
            }
            done += n as u64;
        }
        Ok(())
    }

    /// Writes all of guest RAM to `file` (which must be empty), leaving holes where a whole
    /// page is zero so the file stays sparse. Returns the bytes of data written.
    pub fn write_sparse(&self, file: &File) -> std::io::Result<u64> {
        use std::os::unix::fs::FileExt;
        const CHUNK: usize = 1 << 20;
        let page = PAGE_SIZE as usize;
        let mut buf = vec![0u8; CHUNK];
        let mut written = 0u64;
        let mut addr = 0u64;
        while addr < self.len {
            let n = CHUNK.min((self.len - addr) as usize);
            self.read(addr, &mut buf[..n])
                .map_err(std::io::Error::other)?;
            let mut run_start: Option<usize> = None;
            for off in (0..n).step_by(page).chain(std::iter::once(n)) {
                let zero = off < n && buf[off..off + page].iter().all(|&b| b == 0);
                match (run_start, off < n && !zero) {
                    (None, true) => run_start = Some(off),
                    (Some(start), false) => {
                        file.write_all_at(&buf[start..off], addr + start as u64)?;
                        written += (off - start) as u64;
                        run_start = None;
                    }
                    _ => {}
                }
            }
            addr += n as u64;
        }
        file.set_len(self.len)?;
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_dump_reads_back_identically_and_skips_zero_pages() {
        let ram = GuestRam::anonymous(600 * PAGE_SIZE).unwrap();
        ram.write(5, b"start").unwrap();
        ram.write(300 * PAGE_SIZE - 2, b"edge").unwrap();
        ram.write(600 * PAGE_SIZE - 3, b"end").unwrap();
        let path = std::env::temp_dir().join(format!("bud-sparse-{}", std::process::id()));
        let file = File::create(&path).unwrap();

        let written = ram.write_sparse(&file).unwrap();
        let back = GuestRam::private_file(&path, 600 * PAGE_SIZE).unwrap();
        let mut all = vec![0u8; 600 * PAGE_SIZE as usize];
        let mut orig = vec![0u8; 600 * PAGE_SIZE as usize];
        back.read(0, &mut all).unwrap();
        ram.read(0, &mut orig).unwrap();
        std::fs::remove_file(&path).unwrap();

        assert_eq!(written, 4 * PAGE_SIZE, "only the four non-zero pages");
        assert!(all == orig);
    }
}
