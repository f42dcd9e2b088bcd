//! What the guest writes into the mailbox by the end of a request: output areas and their
//! counters, outcome, exit value, phase marks and display JSON (`vmm::job::decode_result`).
//! Input: the mailbox's bytes (a 4 MiB mailbox over scattered guest pages). The host must
//! never panic and never keep more output than the cap.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::mailbox::Mailbox;
use vmm::memory::GuestRam;
use vmm::protocol::MAILBOX_DEFAULT_SIZE;

const PAGES: usize = MAILBOX_DEFAULT_SIZE / 4096;

fuzz_target!(|data: &[u8]| {
    let ram = GuestRam::anonymous((2 * MAILBOX_DEFAULT_SIZE) as u64).unwrap();
    // Every other page of RAM, backwards: a mailbox is not contiguous in guest memory.
    let pages: Vec<u64> = (0..PAGES)
        .rev()
        .map(|i| (2 * i as u64 + 1) * 4096)
        .collect();
    let mb = Mailbox::over_pages(0x7f00_0000_0000, pages);
    let n = data.len().min(MAILBOX_DEFAULT_SIZE);
    mb.write(&ram, 0, &data[..n]).unwrap();
    let limit = 1 << 16;
    if let Ok(kept) = vmm::job::decode_result(&ram, &mb, limit) {
        assert!(kept <= limit);
    }
});
