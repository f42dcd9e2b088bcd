//! The host-random port: the guest kernel asks the VMM to fill a buffer with fresh bytes from
//! the host's CSPRNG.
//!
//! On kvm_pvm the guest kernel runs in an instruction emulator, where its ChaCha20 costs
//! ~18 us per byte: `os.urandom(1 MiB)` took ~21 s. bud's guest kernel patch
//! `guest/kernel/patches/0016-bud-host-random.patch` (active only with `bud.host_random` on
//! the command line, which bud adds on kvm_pvm only, see [`crate::host`]) instead serves a
//! `getrandom()` or `/dev/urandom` read of any size from a 64 KiB kernel buffer: one
//! 32-bit `out` to [`PORT`] names the buffer's first page frame number (bits `0..PFN_BITS`)
//! and the order of the range (the 4 bits above); the VMM fills that guest-physical range from
//! the host's `getrandom(2)` before the `out` returns. With [`WIPE`] set the VMM zeroes the
//! range instead: the guest sends that once the reader has its bytes, so none stays in guest
//! kernel memory. The patch repeats these numbers in C.
//!
//! Security: every request gets fresh host bytes, so every clone and every read has its own
//! (no state of the template's is involved) and the VMM keeps nothing from which output could
//! be derived or predicted. Like every port, this one is reachable by hostile guest code (a
//! root job may `ioperm` it): a request only ever writes random bytes or zeros into guest RAM,
//! at most 1 MiB ([`MAX_ORDER`]) per exit; a larger one, or one outside guest RAM, stops the
//! VM.

use crate::memory::{GuestRam, MemoryError};

/// I/O port of the request (past the host-copy port).
pub(crate) const PORT: u16 = 0x0be0;

/// Bits of the request that hold the page frame number; the order is in the 4 bits above.
pub(crate) const PFN_BITS: u32 = 27;

/// The request bit that asks for the range to be zeroed instead of filled.
pub(crate) const WIPE: u32 = 1 << 31;

/// Largest order a request may name (1 MiB): bounds the host work of one exit. A request
/// for more stops the VM (the guest kernel asks for 64 KiB).
pub(crate) const MAX_ORDER: u32 = 8;

/// Why a request could not be served (the VM is stopped: a correct guest never sends one).
#[derive(Debug, thiserror::Error)]
pub(crate) enum HostRandomError {
    #[error("a request for {0:#x} bytes is larger than one exit may fill")]
    TooLarge(u64),
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fill {
    /// Fresh bytes from the host's CSPRNG.
    Random,
    /// Zeros (the guest is done with the bytes).
    Wipe,
}

/// The guest-physical `(address, length, fill)` a request names (any order the 4 bits hold;
/// [`serve`] refuses those above [`MAX_ORDER`]).
pub(crate) fn decode(value: u32) -> (u64, u64, Fill) {
    let pfn = u64::from(value & ((1 << PFN_BITS) - 1));
    let order = (value & !WIPE) >> PFN_BITS;
    let fill = if value & WIPE != 0 {
        Fill::Wipe
    } else {
        Fill::Random
    };
    (pfn << 12, 4096u64 << order, fill)
}

/// Serves a decoded request: fills or zeroes guest-physical `addr..addr + len`. An error
/// (more than [`MAX_ORDER`] allows, a range outside guest RAM, or the host's `getrandom`
/// failing) means the VM must stop: a correct guest never sends such a request, and it must
/// not go on without its bytes.
pub(crate) fn serve(
    ram: &GuestRam,
    addr: u64,
    len: u64,
    fill: Fill,
) -> Result<(), HostRandomError> {
    if len > 4096 << MAX_ORDER {
        return Err(HostRandomError::TooLarge(len));
    }
    match fill {
        Fill::Random => ram.fill_random(addr, len)?,
        Fill::Wipe => ram.zero(addr, len)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_names_its_first_frame_its_order_and_whether_to_wipe() {
        assert_eq!(
            decode(0x123 | (4 << PFN_BITS)),
            (0x123_000, 64 << 10, Fill::Random)
        );
        assert_eq!(
            decode(0x123 | (4 << PFN_BITS) | WIPE),
            (0x123_000, 64 << 10, Fill::Wipe)
        );
        assert_eq!(decode(0x7ff_ffff), (0x007f_ffff_f000, 4096, Fill::Random));
        assert_eq!(decode(15 << PFN_BITS | WIPE), (0, 128 << 20, Fill::Wipe));
    }

    #[test]
    fn an_order_past_the_largest_is_refused_and_writes_nothing() {
        let ram = GuestRam::anonymous(4 << 20).unwrap();
        ram.write(0, &[7; 8]).unwrap();
        let (addr, len, fill) = decode(9 << PFN_BITS);

        let err = serve(&ram, addr, len, fill).unwrap_err();
        let mut first = [0u8; 8];
        ram.read(0, &mut first).unwrap();

        assert!(matches!(err, HostRandomError::TooLarge(0x20_0000)), "{err}");
        assert_eq!(first, [7; 8]);
    }

    #[test]
    fn two_fills_of_one_range_differ_and_a_wipe_zeroes_it() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        let mut first = vec![0u8; 64 << 10];
        let mut second = vec![0u8; 64 << 10];
        let mut wiped = vec![1u8; 64 << 10];

        serve(&ram, 0x1_0000, 64 << 10, Fill::Random).unwrap();
        ram.read(0x1_0000, &mut first).unwrap();
        serve(&ram, 0x1_0000, 64 << 10, Fill::Random).unwrap();
        ram.read(0x1_0000, &mut second).unwrap();
        serve(&ram, 0x1_0000, 64 << 10, Fill::Wipe).unwrap();
        ram.read(0x1_0000, &mut wiped).unwrap();

        assert_ne!(first, second);
        // 64 KiB of real randomness has every byte value (a missing one has odds ~2^-370).
        let mut seen = [false; 256];
        first.iter().for_each(|&b| seen[usize::from(b)] = true);
        assert!(seen.iter().all(|&s| s));
        assert!(wiped.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_range_past_guest_ram_is_an_error_and_leaves_ram_alone() {
        let ram = GuestRam::anonymous(1 << 20).unwrap();
        ram.write(0xf_f000, &[7; 4096]).unwrap();

        let outside = serve(&ram, 0xf_f000, 8192, Fill::Random).unwrap_err();
        let mut last = [0u8; 4096];
        ram.read(0xf_f000, &mut last).unwrap();

        assert!(matches!(
            outside,
            HostRandomError::Memory(MemoryError::OutOfRange { .. })
        ));
        assert_eq!(last, [7; 4096]);
    }
}
