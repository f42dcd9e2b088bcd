//! The few Node-API and libcrypto items the addon uses, declared by hand.
//!
//! Types and values follow Node's `js_native_api_types.h` and `js_native_api.h` (Node-API
//! version 8 at most: BigInt needs 6, nothing here needs more). C enums are plain `c_int`s
//! with named constants, never Rust enums, so a value Node adds later cannot be undefined
//! behaviour here.
//!
//! Nothing is linked: the `napi_*` functions are defined by node (Debian's `libnode.so.108`,
//! which `/usr/bin/node` links; the host's Node.js has them in its executable) and
//! `RAND_seed` by the libcrypto node is linked with (Debian's `libcrypto.so.3`; the host's
//! Node.js exports its bundled copy). All of them are in the global scope when node
//! `dlopen`s the addon, and the dynamic linker binds them then. That works because rustc
//! links a cdylib without `-z defs` (undefined symbols are allowed in a shared object);
//! `nm -D --undefined-only` on the built file lists them. The file is linked `-z now`
//! (BIND_NOW), so a missing symbol fails the `require` with its name rather than a later
//! call.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::marker::{PhantomData, PhantomPinned};

/// Opaque `struct napi_env__`.
#[repr(C)]
#[derive(Debug)]
pub struct napi_env__ {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

/// Opaque `struct napi_value__`.
#[repr(C)]
#[derive(Debug)]
pub struct napi_value__ {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

/// Opaque `struct napi_callback_info__`.
#[repr(C)]
#[derive(Debug)]
pub struct napi_callback_info__ {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

pub type napi_env = *mut napi_env__;
pub type napi_value = *mut napi_value__;
pub type napi_callback_info = *mut napi_callback_info__;

/// `napi_status`: `napi_ok` (0) or the reason a call failed.
pub type napi_status = c_int;
pub const NAPI_OK: napi_status = 0;

/// `napi_valuetype`, what `typeof` says.
pub type napi_valuetype = c_int;
pub const NAPI_UNDEFINED: napi_valuetype = 0;
pub const NAPI_NUMBER: napi_valuetype = 3;
pub const NAPI_BIGINT: napi_valuetype = 9;

/// `napi_typedarray_type`.
pub type napi_typedarray_type = c_int;
pub const NAPI_UINT8_ARRAY: napi_typedarray_type = 1;

/// `napi_callback`: a JS function implemented in native code.
pub type napi_callback =
    Option<unsafe extern "C" fn(env: napi_env, info: napi_callback_info) -> napi_value>;

/// `napi_finalize`: called when the JS object that owns native data is collected.
pub type napi_finalize =
    Option<unsafe extern "C" fn(env: napi_env, data: *mut c_void, hint: *mut c_void)>;

// SAFETY: the signatures are those of js_native_api.h (Node-API <= 8), all provided by node
// 18's executable; pointers are passed as the header's C types.
unsafe extern "C" {
    pub fn napi_create_function(
        env: napi_env,
        utf8name: *const c_char,
        length: usize,
        cb: napi_callback,
        data: *mut c_void,
        result: *mut napi_value,
    ) -> napi_status;

    pub fn napi_set_named_property(
        env: napi_env,
        object: napi_value,
        utf8name: *const c_char,
        value: napi_value,
    ) -> napi_status;

    pub fn napi_get_cb_info(
        env: napi_env,
        cbinfo: napi_callback_info,
        argc: *mut usize,
        argv: *mut napi_value,
        this_arg: *mut napi_value,
        data: *mut *mut c_void,
    ) -> napi_status;

    pub fn napi_typeof(
        env: napi_env,
        value: napi_value,
        result: *mut napi_valuetype,
    ) -> napi_status;

    pub fn napi_get_value_double(env: napi_env, value: napi_value, result: *mut f64)
    -> napi_status;

    /// Node-API 6.
    pub fn napi_get_value_bigint_uint64(
        env: napi_env,
        value: napi_value,
        result: *mut u64,
        lossless: *mut bool,
    ) -> napi_status;

    pub fn napi_is_typedarray(env: napi_env, value: napi_value, result: *mut bool) -> napi_status;

    pub fn napi_get_typedarray_info(
        env: napi_env,
        typedarray: napi_value,
        kind: *mut napi_typedarray_type,
        length: *mut usize,
        data: *mut *mut c_void,
        arraybuffer: *mut napi_value,
        byte_offset: *mut usize,
    ) -> napi_status;

    pub fn napi_create_external_arraybuffer(
        env: napi_env,
        external_data: *mut c_void,
        byte_length: usize,
        finalize_cb: napi_finalize,
        finalize_hint: *mut c_void,
        result: *mut napi_value,
    ) -> napi_status;

    pub fn napi_create_uint32(env: napi_env, value: u32, result: *mut napi_value) -> napi_status;

    pub fn napi_create_double(env: napi_env, value: f64, result: *mut napi_value) -> napi_status;

    pub fn napi_get_undefined(env: napi_env, result: *mut napi_value) -> napi_status;

    pub fn napi_throw_error(env: napi_env, code: *const c_char, msg: *const c_char) -> napi_status;

    pub fn napi_throw_type_error(
        env: napi_env,
        code: *const c_char,
        msg: *const c_char,
    ) -> napi_status;

    pub fn napi_throw_range_error(
        env: napi_env,
        code: *const c_char,
        msg: *const c_char,
    ) -> napi_status;

    pub fn napi_is_exception_pending(env: napi_env, result: *mut bool) -> napi_status;
}

// SAFETY: OpenSSL 3's `void RAND_seed(const void *buf, int num)` (openssl/rand.h); it reads
// `num` bytes at `buf` and nothing else of ours.
unsafe extern "C" {
    pub fn RAND_seed(buf: *const c_void, num: c_int);
}
