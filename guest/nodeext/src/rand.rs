//! `reseed`: fresh bytes into OpenSSL's random generator, so that every clone of a snapshot
//! draws its own stream from `crypto.randomBytes` and friends.
//!
//! A snapshot freezes OpenSSL's DRBGs with the rest of node's memory, so without this every
//! clone would hand out the same "random" bytes. The kernel calls `reseed(seed)` with the
//! request's fresh host randomness (`job::SEED`) before running a clone's first code.
//!
//! # Why `RAND_seed` on its own is enough (OpenSSL 3.0, as Debian bookworm ships it)
//!
//! Read in the OpenSSL 3.0 sources:
//! 1. `RAND_seed` (`crypto/rand/rand_lib.c`) calls the default `RAND_METHOD`'s `seed`, which
//!    is `drbg_seed` -> `drbg_add` (`crypto/rand/rand_meth.c`):
//!    `EVP_RAND_reseed(RAND_get0_primary(NULL), 0, NULL, 0, buf, num)`: a reseed of the
//!    *primary* DRBG with our bytes as additional input. (Without a `RAND_METHOD` `RAND_seed`
//!    makes the same call itself.) No engine replaces the method in node.
//! 2. That reseed, `ossl_prov_drbg_reseed` (`providers/implementations/rands/drbg.c`), also
//!    draws fresh entropy from the OS seed source (`get_entropy`: the primary has no parent,
//!    so `ossl_prov_get_entropy`, i.e. `getrandom`), mixes it in with our bytes, and on
//!    success moves the primary's `reseed_counter` to `reseed_next_counter` (the old value
//!    plus one; it starts at 1 in `ossl_rand_drbg_new`, so it is never the "0: off" value).
//! 3. The public and private DRBGs are per-thread children of the primary
//!    (`RAND_get0_public`/`RAND_get0_private` in `rand_lib.c`). Each remembers the parent's
//!    counter from its own last reseed (`parent_reseed_counter`), and
//!    `ossl_prov_drbg_generate` (`drbg.c`) sets `reseed_required` when
//!    `get_parent_reseed_count(drbg) != drbg->parent_reseed_counter`. So the next generate
//!    of every child, on every thread, first reseeds it from the (already reseeded) primary.
//! 4. Node 18's `crypto.randomBytes`/`randomFill`/`getRandomValues` go through
//!    `node::crypto::CSPRNG` (`src/crypto/crypto_util.cc`), which calls
//!    `RAND_bytes_ex(nullptr, ...)`: the calling thread's *public* DRBG, a child as above
//!    (on the main thread for the sync forms, on a libuv pool thread for the async ones:
//!    both are children of the one primary). Keys come from the private DRBG, likewise.
//!
//! So no `RAND_poll` is needed: one `RAND_seed` makes every later draw, on any thread,
//! depend on our bytes and on fresh OS entropy. Seen happen, too: under gdb with a
//! breakpoint on `ossl_prov_drbg_reseed`, the host's node 20 (OpenSSL 3.0.19) stops once in
//! `reseed` (via `EVP_RAND_reseed`), once more in the next `crypto.randomBytes` (via
//! `ossl_prov_drbg_generate`: the public DRBG), and not in the draw after that, nor in a
//! draw without a `reseed` before it.
//!
//! Not covered (they do not draw from OpenSSL per call): `Math.random` (V8's own generator,
//! seeded once per isolate), and the bytes node's JS layer caches ahead: `crypto.randomUUID`
//! (a batch of 128 UUIDs' worth) and `crypto.randomInt` (a 6 KiB cache). Whatever of those
//! caches the snapshot holds is the same in every clone, so the warm kernel must not call
//! them before the snapshot.

use std::ffi::c_int;

use crate::ffi;
use crate::js::JsError;

/// Mixes `bytes` into OpenSSL's primary DRBG (see the module docs for what follows).
pub fn seed(bytes: &[u8]) -> Result<(), JsError> {
    if bytes.is_empty() {
        return Err(JsError::range_error(
            "buf is empty: there is nothing to seed with",
        ));
    }
    let Ok(num) = c_int::try_from(bytes.len()) else {
        return Err(JsError::range_error(format!(
            "buf holds {} bytes, more than RAND_seed takes ({})",
            bytes.len(),
            c_int::MAX
        )));
    };
    // SAFETY: RAND_seed reads `num` bytes at the pointer, all within `bytes`, and keeps no
    // pointer to them; the symbol is libcrypto's, which node has loaded.
    unsafe { ffi::RAND_seed(bytes.as_ptr().cast(), num) };
    Ok(())
}
