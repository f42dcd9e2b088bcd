//! A thin safe layer over the raw Node-API calls of [`crate::ffi`]: reading arguments,
//! making values, throwing errors.
//!
//! Every exported function goes through [`callback`], which reads its arguments, runs the
//! Rust body and turns an `Err` (or, should one ever happen, a panic: none may unwind into
//! node) into a thrown JS error whose message starts with the function's name.

use std::ffi::{CString, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use crate::ffi::{self, napi_callback_info, napi_env, napi_status, napi_value};

/// `Number.MAX_SAFE_INTEGER`: the largest integer a JS number holds exactly.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// Which JS error constructor an error is thrown with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Error,
    TypeError,
    RangeError,
}

/// An error on its way to JS: thrown as `new <kind>("<function>: <message>")`.
#[derive(Debug)]
pub struct JsError {
    pub kind: Kind,
    pub message: String,
}

impl JsError {
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            kind: Kind::Error,
            message: message.into(),
        }
    }

    pub fn type_error(message: impl Into<String>) -> Self {
        Self {
            kind: Kind::TypeError,
            message: message.into(),
        }
    }

    pub fn range_error(message: impl Into<String>) -> Self {
        Self {
            kind: Kind::RangeError,
            message: message.into(),
        }
    }
}

pub type JsResult<T> = Result<T, JsError>;

/// The `napi_env` of the call in progress.
///
/// Made only by [`callback`] and the module initializer, for the duration of the call Node
/// made into the addon; never stored. Not `Send` (a raw pointer): the env belongs to the JS
/// thread that called.
#[derive(Debug, Clone, Copy)]
pub struct Env {
    raw: napi_env,
}

impl Env {
    /// # Safety
    /// `raw` must be the env Node passed to the native call in progress, and the `Env` must
    /// not outlive that call.
    pub unsafe fn new(raw: napi_env) -> Self {
        Self { raw }
    }

    fn check(self, status: napi_status, call: &str) -> JsResult<()> {
        if status == ffi::NAPI_OK {
            Ok(())
        } else {
            Err(JsError::error(format!(
                "{call} failed (napi_status {status})"
            )))
        }
    }

    /// The first `N` arguments of the call (`undefined` for those not passed).
    ///
    /// # Safety
    /// `info` must be the callback info of the call in progress.
    unsafe fn args<const N: usize>(self, info: napi_callback_info) -> JsResult<[napi_value; N]> {
        let mut argv = [ptr::null_mut(); N];
        let mut argc = N;
        // SAFETY: env and info are those of the current call; argv has room for argc values
        // (Node writes at most argc and fills the rest with undefined); this and data are
        // optional outputs, NULL to skip.
        let status = unsafe {
            ffi::napi_get_cb_info(
                self.raw,
                info,
                &mut argc,
                argv.as_mut_ptr(),
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
        self.check(status, "napi_get_cb_info")?;
        Ok(argv)
    }

    /// `typeof value`, as a `napi_valuetype`.
    pub fn type_of(self, value: napi_value) -> JsResult<ffi::napi_valuetype> {
        let mut kind = ffi::NAPI_UNDEFINED;
        // SAFETY: a live env and a value handle of this call; kind is a valid output.
        let status = unsafe { ffi::napi_typeof(self.raw, value, &mut kind) };
        self.check(status, "napi_typeof")?;
        Ok(kind)
    }

    /// A JS number that is an integer in `0..=max` (`max` at most [`MAX_SAFE_INTEGER`]).
    pub fn integer(self, value: napi_value, name: &str, max: u64) -> JsResult<u64> {
        if self.type_of(value)? != ffi::NAPI_NUMBER {
            return Err(JsError::type_error(format!("{name} must be a number")));
        }
        let mut number = 0.0_f64;
        // SAFETY: value is a number of this call (checked above); number is a valid output.
        let status = unsafe { ffi::napi_get_value_double(self.raw, value, &mut number) };
        self.check(status, "napi_get_value_double")?;
        let max = max.min(MAX_SAFE_INTEGER);
        // Every integer up to 2^53 is exact as an f64, so these conversions are exact.
        if number.fract() != 0.0 || !(0.0..=max as f64).contains(&number) {
            return Err(JsError::range_error(format!(
                "{name} must be an integer from 0 to {max}, not {number}"
            )));
        }
        Ok(number as u64)
    }

    /// An unsigned 64-bit argument: a number (an integer up to [`MAX_SAFE_INTEGER`]), a
    /// BigInt in `0..2^64`, or `undefined` for 0.
    pub fn u64_or_bigint(self, value: napi_value, name: &str) -> JsResult<u64> {
        match self.type_of(value)? {
            ffi::NAPI_UNDEFINED => Ok(0),
            ffi::NAPI_NUMBER => self.integer(value, name, MAX_SAFE_INTEGER),
            ffi::NAPI_BIGINT => {
                let (mut result, mut lossless) = (0_u64, false);
                // SAFETY: value is a BigInt of this call (checked above); both outputs valid.
                let status = unsafe {
                    ffi::napi_get_value_bigint_uint64(self.raw, value, &mut result, &mut lossless)
                };
                self.check(status, "napi_get_value_bigint_uint64")?;
                if !lossless {
                    return Err(JsError::range_error(format!(
                        "{name} must be a BigInt from 0n to {}n",
                        u64::MAX
                    )));
                }
                Ok(result)
            }
            _ => Err(JsError::type_error(format!(
                "{name} must be a number or a BigInt"
            ))),
        }
    }

    /// Runs `f` on the bytes of `value`, which must be a `Uint8Array` (a `Buffer` is one).
    ///
    /// The slice is valid while `f` runs: the typed array is an argument of the call in
    /// progress (kept alive by its handle scope), and no JS runs until the call returns,
    /// so nothing can detach, resize or free its buffer meanwhile.
    pub fn with_uint8_array<R>(
        self,
        value: napi_value,
        name: &str,
        f: impl FnOnce(&[u8]) -> R,
    ) -> JsResult<R> {
        let mut is_typed_array = false;
        // SAFETY: a live env and a value handle of this call; the output is valid.
        let status = unsafe { ffi::napi_is_typedarray(self.raw, value, &mut is_typed_array) };
        self.check(status, "napi_is_typedarray")?;
        let (mut kind, mut len, mut data) = (ffi::NAPI_UINT8_ARRAY, 0_usize, ptr::null_mut());
        if is_typed_array {
            // SAFETY: value is a typed array (checked above); kind, length and data are
            // valid outputs; the ArrayBuffer and byte offset are optional, NULL to skip.
            let status = unsafe {
                ffi::napi_get_typedarray_info(
                    self.raw,
                    value,
                    &mut kind,
                    &mut len,
                    &mut data,
                    ptr::null_mut(),
                    ptr::null_mut(),
                )
            };
            self.check(status, "napi_get_typedarray_info")?;
        }
        if !is_typed_array || kind != ffi::NAPI_UINT8_ARRAY {
            return Err(JsError::type_error(format!(
                "{name} must be a Uint8Array or a Buffer"
            )));
        }
        if len == 0 || data.is_null() {
            return Ok(f(&[]));
        }
        // SAFETY: for a Uint8Array, Node reports in `data` the address of its first element
        // (byte offset applied) and in `len` its length in bytes: `len` initialized bytes,
        // alive and unchanged while `f` runs (see above).
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>().cast_const(), len) };
        Ok(f(bytes))
    }

    pub fn undefined(self) -> JsResult<napi_value> {
        let mut result = ptr::null_mut();
        // SAFETY: a live env; result is a valid output.
        let status = unsafe { ffi::napi_get_undefined(self.raw, &mut result) };
        self.check(status, "napi_get_undefined")?;
        Ok(result)
    }

    pub fn uint32(self, value: u32) -> JsResult<napi_value> {
        let mut result = ptr::null_mut();
        // SAFETY: a live env; result is a valid output.
        let status = unsafe { ffi::napi_create_uint32(self.raw, value, &mut result) };
        self.check(status, "napi_create_uint32")?;
        Ok(result)
    }

    pub fn double(self, value: f64) -> JsResult<napi_value> {
        let mut result = ptr::null_mut();
        // SAFETY: a live env; result is a valid output.
        let status = unsafe { ffi::napi_create_double(self.raw, value, &mut result) };
        self.check(status, "napi_create_double")?;
        Ok(result)
    }

    /// An ArrayBuffer over `len` bytes at `data`, which it neither copies nor ever frees.
    ///
    /// # Safety
    /// `data` must be `len` readable and writable bytes that stay mapped for the rest of the
    /// process's life, and no other ArrayBuffer may be made over them (V8 keeps one
    /// backing store per address).
    pub unsafe fn external_arraybuffer(self, data: *mut u8, len: usize) -> JsResult<napi_value> {
        let mut result = ptr::null_mut();
        // SAFETY: the caller vouches for the memory; the finalizer does nothing, so V8
        // collecting the buffer leaves the memory alone; result is a valid output.
        let status = unsafe {
            ffi::napi_create_external_arraybuffer(
                self.raw,
                data.cast::<c_void>(),
                len,
                Some(keep_memory),
                ptr::null_mut(),
                &mut result,
            )
        };
        self.check(status, "napi_create_external_arraybuffer")?;
        Ok(result)
    }

    /// Makes `object[name]` a JS function implemented by `cb`.
    pub fn set_function(
        self,
        object: napi_value,
        name: &std::ffi::CStr,
        cb: unsafe extern "C" fn(napi_env, napi_callback_info) -> napi_value,
    ) -> JsResult<()> {
        let mut function = ptr::null_mut();
        // SAFETY: a live env; name is a NUL-terminated UTF-8 string of the given length; no
        // callback data; function is a valid output.
        let status = unsafe {
            ffi::napi_create_function(
                self.raw,
                name.as_ptr(),
                name.count_bytes(),
                Some(cb),
                ptr::null_mut(),
                &mut function,
            )
        };
        self.check(status, "napi_create_function")?;
        // SAFETY: object and function are live handles of this call; name is NUL-terminated.
        let status =
            unsafe { ffi::napi_set_named_property(self.raw, object, name.as_ptr(), function) };
        self.check(status, "napi_set_named_property")
    }

    /// Throws `error` with its message prefixed by `function: `, unless an exception is
    /// already pending (a failed Node-API call may have thrown one: that one stands).
    pub fn throw(self, function: &str, error: &JsError) {
        let mut pending = false;
        // SAFETY: a live env; pending is a valid output.
        let status = unsafe { ffi::napi_is_exception_pending(self.raw, &mut pending) };
        if status == ffi::NAPI_OK && pending {
            return;
        }
        let message = format!("{function}: {}", error.message).replace('\0', "\\0");
        let message = CString::new(message).unwrap_or_default();
        let throw = match error.kind {
            Kind::Error => ffi::napi_throw_error,
            Kind::TypeError => ffi::napi_throw_type_error,
            Kind::RangeError => ffi::napi_throw_range_error,
        };
        // SAFETY: a live env; no error code (NULL); message is NUL-terminated and Node copies
        // it before returning. Nothing to do if throwing fails.
        unsafe { throw(self.raw, ptr::null(), message.as_ptr()) };
    }
}

/// The finalizer of the mailbox's ArrayBuffer: the mapping lives as long as the process.
unsafe extern "C" fn keep_memory(_env: napi_env, _data: *mut c_void, _hint: *mut c_void) {}

/// Runs an exported function: reads `N` arguments, calls `body`, and returns its value or
/// throws its error (as `function: message`). A panic becomes a thrown `Error` instead of
/// unwinding into node.
///
/// # Safety
/// `raw` and `info` must be those Node passed to the native callback in progress.
pub unsafe fn callback<const N: usize>(
    raw: napi_env,
    info: napi_callback_info,
    function: &str,
    body: fn(Env, [napi_value; N]) -> JsResult<napi_value>,
) -> napi_value {
    // SAFETY: the caller passes the env of the call in progress; `env` lives only in it.
    let env = unsafe { Env::new(raw) };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: info is the callback info of this very call (the caller's guarantee).
        let args = unsafe { env.args::<N>(info) }?;
        body(env, args)
    }));
    let error = match outcome {
        Ok(Ok(value)) => return value,
        Ok(Err(error)) => error,
        Err(_) => JsError::error("internal error: the addon panicked"),
    };
    env.throw(function, &error);
    // NULL: the call's value is undefined, and the pending exception is what JS sees.
    ptr::null_mut()
}
