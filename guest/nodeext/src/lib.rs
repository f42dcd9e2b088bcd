//! `bud.node`: the warm Node.js kernel's native piece, the JavaScript counterpart of the
//! Python worker's `_bud` extension (`guest/pyext`).
//!
//! Loaded in the guest with `require('/usr/lib/bud/node/bud.node')` (this crate's cdylib,
//! renamed). Its exports, all plain functions:
//! - `mapMailbox(fd, length)` -> `ArrayBuffer` ([`mailbox`]): maps the memfd the parent (the
//!   Python worker) shares as the kernel's mailbox, `MAP_SHARED`, locked and touched, and
//!   returns an ArrayBuffer over the memory itself (no copy). Once per process.
//! - `takeDoorbell()`: `ioperm` for the doorbell ports on the calling thread (root only).
//! - `ring(code, a, b)` -> number: the doorbell, one `out` with `eax` = code, `rdi` = a,
//!   `rsi` = b (numbers or BigInts; omitted: 0); returns `eax` as the vCPU resumes. Refuses
//!   (throws) on a thread that did not `takeDoorbell()`.
//! - `afterTick()`: returns right after the guest kernel's next tick, so that READY (and
//!   every clone's job) starts a whole tick period before the next one (`doorbell.rs`).
//! - `reseed(buf)` ([`rand`]): mixes a `Uint8Array`/`Buffer` into OpenSSL's random
//!   generator, so every clone of a snapshot gets its own `crypto.randomBytes` stream.
//!
//! Errors are thrown as `Error`, `TypeError` (wrong kind of argument) or `RangeError` (bad
//! value), their message starting with the function's name. Nothing rings on its own, so
//! loading the addon and mapping a mailbox outside a bud guest is safe; ringing is not.
//!
//! # Node-API by hand
//! The addon declares the dozen Node-API functions it calls itself ([`ffi`], from
//! `node_api.h`/`js_native_api.h`, Node-API 8 at most, as Node 18 has) rather than depend on
//! `napi-sys` or `napi`: they are few and stable, the crate then needs nothing but `libc`,
//! and what each call does is in plain view. Node finds the module through
//! `napi_register_module_v1`; the `napi_*` symbols (and libcrypto's `RAND_seed`) stay
//! undefined in the shared object and bind to the loading node process at `dlopen`.
//!
//! The protocol constants and the doorbell instruction are the very files the agent and
//! `_bud` use (`vmm/src/protocol.rs`, `guest/agent/src/doorbell.rs`, included with `#[path]`).

#[path = "../../../vmm/src/protocol.rs"]
#[allow(dead_code)] // shared verbatim with the host; the addon uses only some of it
mod protocol;

#[path = "../../agent/src/doorbell.rs"]
mod doorbell;
mod ffi;
mod js;
mod mailbox;
mod rand;

use std::cell::OnceCell;
use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};

use doorbell::Doorbell;
use ffi::{napi_callback_info, napi_env, napi_value};
use js::{Env, JsError, JsResult};
use mailbox::MapError;

/// The Node-API version the addon is written against (Node 18 has up to 8).
const NAPI_VERSION: i32 = 8;

thread_local! {
    /// The doorbell permission, on the thread that took it (Linux keeps it per thread).
    static DOORBELL: OnceCell<Doorbell> = const { OnceCell::new() };
}

impl From<MapError> for JsError {
    fn from(e: MapError) -> Self {
        match e {
            MapError::BadLength { .. } | MapError::FileTooShort { .. } => {
                JsError::range_error(e.to_string())
            }
            MapError::AlreadyMapped | MapError::Os { .. } => JsError::error(e.to_string()),
        }
    }
}

/// `mapMailbox(fd, length)`: see [`mailbox`].
fn map_mailbox(env: Env, [fd, length]: [napi_value; 2]) -> JsResult<napi_value> {
    let fd = env.integer(fd, "fd", c_int::MAX as u64)?;
    let fd = c_int::try_from(fd).map_err(|e| JsError::range_error(format!("fd: {e}")))?;
    let length = env.integer(length, "length", js::MAX_SAFE_INTEGER)?;
    let length =
        usize::try_from(length).map_err(|e| JsError::range_error(format!("length: {e}")))?;
    mailbox::map_once(fd, length, |mapping| {
        // SAFETY: map_once keeps the mapping (never unmapped) once this returns Ok, and it
        // lets this run once per process, so one ArrayBuffer only is made over the memory.
        unsafe { env.external_arraybuffer(mapping.as_ptr(), mapping.len()) }
    })
}

/// `takeDoorbell()`: ioperm for the doorbell ports on this thread (threads it starts later
/// inherit it). Needs root. Idempotent.
fn take_doorbell(env: Env, []: [napi_value; 0]) -> JsResult<napi_value> {
    DOORBELL.with(|cell| {
        if cell.get().is_none() {
            let doorbell = Doorbell::open().map_err(|e| JsError::error(format!("ioperm: {e}")))?;
            // The cell was empty a moment ago on this very thread, so this set wins.
            let _ = cell.set(doorbell);
        }
        Ok::<_, JsError>(())
    })?;
    env.undefined()
}

/// `ring(code, a, b)`: rings the host with eax = code, rdi = a, rsi = b and returns eax as
/// the vCPU resumes (the code, unless the host left a reply). Never call it outside a bud
/// guest.
fn ring(env: Env, [code, a, b]: [napi_value; 3]) -> JsResult<napi_value> {
    let code = env.integer(code, "code", u32::MAX.into())?;
    let code = u32::try_from(code).map_err(|e| JsError::range_error(format!("code: {e}")))?;
    let a = env.u64_or_bigint(a, "a")?;
    let b = env.u64_or_bigint(b, "b")?;
    let reply = DOORBELL
        .with(|cell| cell.get().map(|doorbell| doorbell.ring(code, a, b)))
        .ok_or_else(|| {
            JsError::error(concat!(
                "no doorbell permission on this thread: ",
                "call takeDoorbell() first (inside a bud guest only)"
            ))
        })?;
    env.uint32(reply)
}

/// `mailboxAddress()`: the mailbox's address in this process (a Number: user-space
/// addresses are below 2^47, exact in a double), for READY.
fn mailbox_address(env: Env, []: [napi_value; 0]) -> JsResult<napi_value> {
    let addr =
        mailbox::address().ok_or_else(|| JsError::error("no mailbox: call mapMailbox() first"))?;
    env.double(addr as f64)
}

/// `lockMemory()`: `mlockall(MCL_CURRENT)`, as the Python worker does before READY: every
/// page mapped now is made present (and its page-table entry written) in the template, so a
/// clone's job neither takes a guest page fault for it nor changes a template page table
/// (which makes the VM's reset drop every shadow mapping, vmm/src/reset.rs).
fn lock_memory(env: Env, []: [napi_value; 0]) -> JsResult<napi_value> {
    // SAFETY: mlockall changes the residency of this process's mappings, never their
    // contents.
    if unsafe { libc::mlockall(libc::MCL_CURRENT) } != 0 {
        return Err(JsError::error(format!(
            "mlockall: {}",
            std::io::Error::last_os_error()
        )));
    }
    env.undefined()
}

/// `afterTick()`: returns right after the guest kernel's next tick (`doorbell::after_tick`,
/// at most 200 ms); the kernel calls it right before READY. Returns whether it saw one.
fn after_tick(env: Env, []: [napi_value; 0]) -> JsResult<napi_value> {
    let seen = doorbell::after_tick(std::time::Duration::from_millis(200));
    env.double(if seen { 1.0 } else { 0.0 })
}

/// `reseed(buf)`: see [`rand`].
fn reseed(env: Env, [buf]: [napi_value; 1]) -> JsResult<napi_value> {
    env.with_uint8_array(buf, "buf", rand::seed)??;
    env.undefined()
}

unsafe extern "C" fn map_mailbox_cb(env: napi_env, info: napi_callback_info) -> napi_value {
    // SAFETY: Node calls this with the env and info of the call in progress.
    unsafe { js::callback(env, info, "mapMailbox", map_mailbox) }
}

unsafe extern "C" fn take_doorbell_cb(env: napi_env, info: napi_callback_info) -> napi_value {
    // SAFETY: Node calls this with the env and info of the call in progress.
    unsafe { js::callback(env, info, "takeDoorbell", take_doorbell) }
}

unsafe extern "C" fn ring_cb(env: napi_env, info: napi_callback_info) -> napi_value {
    // SAFETY: Node calls this with the env and info of the call in progress.
    unsafe { js::callback(env, info, "ring", ring) }
}

unsafe extern "C" fn mailbox_address_cb(env: napi_env, info: napi_callback_info) -> napi_value {
    // SAFETY: Node calls this with the env and info of the call in progress.
    unsafe { js::callback(env, info, "mailboxAddress", mailbox_address) }
}

unsafe extern "C" fn lock_memory_cb(env: napi_env, info: napi_callback_info) -> napi_value {
    // SAFETY: Node calls this with the env and info of the call in progress.
    unsafe { js::callback(env, info, "lockMemory", lock_memory) }
}

unsafe extern "C" fn after_tick_cb(env: napi_env, info: napi_callback_info) -> napi_value {
    // SAFETY: Node calls this with the env and info of the call in progress.
    unsafe { js::callback(env, info, "afterTick", after_tick) }
}

unsafe extern "C" fn reseed_cb(env: napi_env, info: napi_callback_info) -> napi_value {
    // SAFETY: Node calls this with the env and info of the call in progress.
    unsafe { js::callback(env, info, "reseed", reseed) }
}

fn register(env: Env, exports: napi_value) -> JsResult<()> {
    env.set_function(exports, c"mapMailbox", map_mailbox_cb)?;
    env.set_function(exports, c"takeDoorbell", take_doorbell_cb)?;
    env.set_function(exports, c"ring", ring_cb)?;
    env.set_function(exports, c"mailboxAddress", mailbox_address_cb)?;
    env.set_function(exports, c"lockMemory", lock_memory_cb)?;
    env.set_function(exports, c"afterTick", after_tick_cb)?;
    env.set_function(exports, c"reseed", reseed_cb)
}

/// The module initializer Node looks up when it loads the addon: adds the seven functions to
/// `exports`. On failure it throws, so `require` does.
///
/// # Safety
/// Only Node calls it, with a live env and the module's `exports` object.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn napi_register_module_v1(env: napi_env, exports: napi_value) -> napi_value {
    // SAFETY: Node passes the env of this (initializer) call; `env` lives only in it.
    let env = unsafe { Env::new(env) };
    let error = match catch_unwind(AssertUnwindSafe(|| register(env, exports))) {
        Ok(Ok(())) => return exports,
        Ok(Err(error)) => error,
        Err(_) => JsError::error("internal error: the addon panicked"),
    };
    env.throw("bud.node", &error);
    std::ptr::null_mut()
}

/// The Node-API version the module targets, which Node reads at load (as the
/// `NAPI_MODULE_INIT` macro of node_api.h defines it).
#[unsafe(no_mangle)]
pub extern "C" fn node_api_module_get_api_version_v1() -> i32 {
    NAPI_VERSION
}
