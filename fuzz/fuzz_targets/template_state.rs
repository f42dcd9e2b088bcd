//! A template's saved machine state, as `Template::load` reads it from disk
//! (`SnapshotState::from_bytes`). Input: the file's bytes. No panic, and whatever loads
//! saves back to a state that loads equal.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::snapshot::SnapshotState;

fuzz_target!(|data: &[u8]| {
    if let Ok(state) = SnapshotState::from_bytes(data)
        && let Ok(bytes) = state.to_bytes()
    {
        let again = SnapshotState::from_bytes(&bytes).expect("a saved state loads");
        assert_eq!(again.to_bytes().ok(), Some(bytes));
    }
});
