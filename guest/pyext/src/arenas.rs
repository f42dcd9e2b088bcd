//! pymalloc's arenas carved from one region that fresh-memory faults fill 2 MiB at a time.
//!
//! Python keeps objects of up to 512 bytes (ints, short strings, tuples, small dicts) in
//! 1 MiB arenas, each its own `mmap`, unmapped again as soon as it is empty. In the guest
//! each fresh arena is 256 fresh 4 KiB pages, each an emulated page fault under kvm_pvm
//! (~1 000 emulated instructions each, measured: `list(range(10**6))` took 13 M emulated
//! instructions, almost all in the fault path), and an arena given back and taken again is
//! fresh again. Separate 1 MiB mappings never cover a whole aligned 2 MiB range, so the
//! guest's transparent huge pages (`guest/agent/src/hugepages.rs`) cannot help them.
//!
//! So the worker reserves one large region (address space only: `MAP_NORESERVE`, no page
//! until touched, aligned to 2 MiB) and installs an arena allocator that hands out 1 MiB
//! arenas from it: the first touch of each 2 MiB is one huge-page fault that serves two
//! arenas, and an arena Python frees is kept on a free list and handed out again (still
//! present, no fault). Requests of another size, arenas past the region's end and arenas
//! the previous allocator made (before [`install`]) go to the previous allocator.
//!
//! What it costs: freed arenas stay resident in the process until the VM is reset (a
//! one-shot job) or the session ends: a session's memory is its peak of small objects, not
//! its current use. On hardware virtualization the faults are not emulated and the gain is
//! smaller, the behaviour the same.

use std::ffi::c_void;
use std::io;
use std::sync::Mutex;

/// CPython's `PyObjectArenaAllocator` (not in the limited API that pyo3 builds against
/// here; the functions are exported by every CPython 3 interpreter).
#[repr(C)]
#[derive(Clone, Copy)]
struct ArenaAllocator {
    ctx: *mut c_void,
    alloc: Option<unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void>,
    free: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize)>,
}

unsafe extern "C" {
    fn PyObject_GetArenaAllocator(allocator: *mut ArenaAllocator);
    fn PyObject_SetArenaAllocator(allocator: *mut ArenaAllocator);
}

/// Alignment of the region: the x86-64 huge page.
pub const HUGE_PAGE: usize = 2 << 20;

/// The region and its bookkeeping.
struct Region {
    base: usize,
    len: usize,
    /// Offset of the first never-used byte.
    next: usize,
    /// The size pymalloc asks for (set by its first request).
    arena: usize,
    /// Arenas freed by Python, reused first (still resident).
    free: Vec<usize>,
    /// The allocator before ours, for everything that is not ours.
    previous: ArenaAllocator,
}

// SAFETY: `previous` holds CPython's context pointer and functions, which may be called
// from any thread holding the GIL; the Region is only touched under its Mutex.
unsafe impl Send for Region {}

static REGION: Mutex<Option<Region>> = Mutex::new(None);

/// The address range the arena region reserved (`None` before [`install`]): what
/// `memory::lock_mapped_except` leaves alone, since locking it would make it resident whole.
pub fn reserved() -> Option<(usize, usize)> {
    let slot = REGION.lock().unwrap_or_else(|e| e.into_inner());
    // The mapping starts up to one huge page below `base` (see install).
    slot.as_ref()
        .map(|r| (r.base - HUGE_PAGE, r.base + r.len + HUGE_PAGE))
}

/// Reserves `bytes` of address space (rounded up to 2 MiB, aligned to 2 MiB) and makes it
/// pymalloc's source of arenas. Fails if called twice or if the reservation fails.
pub fn install(bytes: usize) -> io::Result<()> {
    let mut slot = REGION.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_some() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the arena region is already installed",
        ));
    }
    let len = bytes.div_ceil(HUGE_PAGE) * HUGE_PAGE;
    // SAFETY: a new private anonymous mapping at an address of the kernel's choice; it
    // aliases nothing.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len + HUGE_PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let base = (raw as usize).div_ceil(HUGE_PAGE) * HUGE_PAGE;
    let mut previous = ArenaAllocator {
        ctx: std::ptr::null_mut(),
        alloc: None,
        free: None,
    };
    // SAFETY: CPython fills the struct we own; the caller holds the GIL (a pyfunction).
    unsafe { PyObject_GetArenaAllocator(&mut previous) };
    *slot = Some(Region {
        base,
        len,
        next: 0,
        arena: 0,
        free: Vec::with_capacity(len / (1 << 20)),
        previous,
    });
    let mut ours = ArenaAllocator {
        ctx: std::ptr::null_mut(),
        alloc: Some(arena_alloc),
        free: Some(arena_free),
    };
    // SAFETY: CPython copies the struct; both functions are valid for the process's life.
    unsafe { PyObject_SetArenaAllocator(&mut ours) };
    Ok(())
}

unsafe extern "C" fn arena_alloc(_ctx: *mut c_void, size: usize) -> *mut c_void {
    let previous = {
        let mut slot = REGION.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = slot.as_mut() else {
            return std::ptr::null_mut();
        };
        if r.arena == 0 && size > 0 && HUGE_PAGE % size == 0 {
            r.arena = size;
        }
        if size == r.arena {
            if let Some(at) = r.free.pop() {
                return at as *mut c_void;
            }
            if r.next + size <= r.len {
                let at = r.base + r.next;
                r.next += size;
                return at as *mut c_void;
            }
        }
        r.previous
    };
    match previous.alloc {
        // SAFETY: the previous allocator, called as CPython would with its own context.
        Some(alloc) => unsafe { alloc(previous.ctx, size) },
        None => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn arena_free(_ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    let previous = {
        let mut slot = REGION.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = slot.as_mut() else {
            return;
        };
        let at = ptr as usize;
        if at >= r.base && at < r.base + r.len {
            r.free.push(at);
            return;
        }
        r.previous
    };
    if let Some(free) = previous.free {
        // SAFETY: `ptr` came from the previous allocator (it is outside our region).
        unsafe { free(previous.ctx, ptr, size) };
    }
}
