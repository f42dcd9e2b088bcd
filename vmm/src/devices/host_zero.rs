//! The host-zero port: the guest kernel asks the VMM to zero fresh memory for it.
//!
//! On kvm_pvm the guest kernel runs in an instruction emulator that executes every iteration
//! of `clear_page`'s `rep stosq` on its own: ~136 ms per 2 MiB huge page, ~0.25 ms per 4 KiB
//! page, most of the cost of fresh memory. bud's guest kernel patch
//! `guest/kernel/patches/0009-bud-host-zero.patch` (active only with `bud.host_zero` on the
//! command line, meant for kvm_pvm and off for now: see [`crate::host`]) instead zeroes a fresh
//! user folio with one 32-bit `out` to [`PORT`]: bits `0..PFN_BITS` hold its first page frame
//! number, the bits above its order. The VMM zeroes that range of guest RAM before the `out`
//! returns. The patch repeats these numbers in C.
//!
//! Like every port, this one is reachable by hostile guest code (a root job may `ioperm` it):
//! a request only ever zeroes guest RAM, and one outside it stops the VM.

/// I/O port of the request (just past the doorbell's four).
pub(crate) const PORT: u16 = 0x0bd4;

/// Bits of the request that hold the page frame number; the order is above them.
pub(crate) const PFN_BITS: u32 = 27;

/// Largest order a request may name (a 1 GiB folio).
pub(crate) const MAX_ORDER: u32 = 18;

/// The guest-physical `(address, length)` a request names, or `None` for an order above
/// [`MAX_ORDER`].
pub(crate) fn decode(value: u32) -> Option<(u64, u64)> {
    let pfn = u64::from(value & ((1 << PFN_BITS) - 1));
    let order = value >> PFN_BITS;
    (order <= MAX_ORDER).then(|| (pfn << 12, 4096u64 << order))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_names_its_first_frame_and_its_order() {
        assert_eq!(decode(0x123), Some((0x123_000, 4096)));
        assert_eq!(decode(0x400 | (9 << PFN_BITS)), Some((0x40_0000, 2 << 20)));
        assert_eq!(
            decode(((1 << PFN_BITS) - 1) | (18 << PFN_BITS)),
            Some((((1u64 << PFN_BITS) - 1) << 12, 1 << 30))
        );
    }

    #[test]
    fn an_order_past_the_largest_is_refused() {
        assert_eq!(decode(19 << PFN_BITS), None);
        assert_eq!(decode(u32::MAX), None);
    }
}
