//! The doorbell READY's mailbox announcement: the guest names an address and a length, and
//! the host walks the guest's own page tables to find its pages (`Mailbox::locate`). Input:
//! cr3, cr4, gva and length (8 bytes each), then the first MiB of guest RAM.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::mailbox::Mailbox;
use vmm::memory::GuestRam;

fuzz_target!(|data: &[u8]| {
    if data.len() < 32 {
        return;
    }
    let word = |i: usize| u64::from_le_bytes(data[i * 8..i * 8 + 8].try_into().unwrap());
    let (cr3, cr4, gva, len) = (word(0), word(1), word(2), word(3));
    let ram = GuestRam::anonymous(1 << 20).unwrap();
    let image = &data[32..data.len().min(32 + (1 << 20))];
    ram.write(0, image).unwrap();
    if let Ok(mb) = Mailbox::locate(&ram, cr3, cr4, gva, len) {
        // Whatever it located lies inside guest RAM.
        assert!(mb.pages().iter().all(|&p| p + 4096 <= 1 << 20));
    }
});
