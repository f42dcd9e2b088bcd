//! What a guest sends on a connection allowed for a name, as the relay's name check reads it
//! (an HTTP request head and body framing, a TLS ClientHello). Input: a split point, then
//! the bytes, fed in two parts. No panic; only the guest's own bytes go on, in order, and a
//! check that is over let every byte through.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::net::names::NameCheck;

fuzz_target!(|data: &[u8]| {
    let Some((&split, bytes)) = data.split_first() else {
        return;
    };
    let cut = usize::from(split) % (bytes.len() + 1);
    let mut check = NameCheck::new("echo.test");
    let mut out = Vec::new();
    let mut refused = false;
    for part in [&bytes[..cut], &bytes[cut..]] {
        if check.feed(part, &mut out).is_err() {
            refused = true;
            break;
        }
    }
    assert!(bytes.starts_with(&out), "only the guest's bytes, in order");
    if check.is_open() && !refused {
        assert_eq!(out, bytes, "an open check holds nothing back");
    }
});
