//! Shared setup for the integration tests: the real guest (kernel + initramfs, built or reused
//! through the same pipeline as `bud guest build`) and one template + executor per test binary.
//!
//! These tests need /dev/kvm and a guest build. They never skip silently: without /dev/kvm
//! they fail with a message saying so.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use bud_guest::{BuildOptions, GuestArtifacts};

pub mod served;
use vmm::{BootConfig, Executor, Template};

pub fn source_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A test's size from environment variable `var` (a positive count), or `ci` when unset:
/// CI runs every long test at a small size that still covers every kind of job; the named
/// scripts (`scripts/stress.sh`, `scripts/reset-exactness.sh`, `scripts/fuzz.sh`) run them
/// at full size.
pub fn size(var: &str, ci: usize) -> usize {
    match std::env::var(var) {
        Err(_) => ci,
        Ok(v) => match v.parse() {
            Ok(n) if n > 0 => n,
            _ => panic!("{var}={v:?}: want a positive number"),
        },
    }
}

pub fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "\n\n*** THIS TEST NEEDS /dev/kvm AND THIS MACHINE HAS NONE: IT CANNOT RUN HERE ***\n\n"
    );
}

/// The guest kernel and image, built on first use (minutes), reused after. Built once per
/// test binary (other binaries and processes wait on the build lock and find it done); a
/// failed build is remembered, so every test that needs it fails with its real cause rather
/// than building again.
pub fn guest() -> &'static GuestArtifacts {
    static GUEST: OnceLock<Result<GuestArtifacts, String>> = OnceLock::new();
    let built = GUEST.get_or_init(|| {
        require_kvm();
        let opts = BuildOptions::new(source_dir());
        bud_guest::ensure(&opts, &mut |line: &str| eprintln!("[guest build] {line}"))
            .map_err(|e| format!("{:#}", anyhow::Error::new(e)))
    });
    match built {
        Ok(g) => g,
        Err(e) => panic!("building the guest (kernel + image) failed: {e}"),
    }
}

pub fn boot_config() -> BootConfig {
    let g = guest();
    BootConfig::new(&g.kernel, &g.initramfs)
}

/// Where the tests keep templates (inside the ignored build folder).
pub fn template_root() -> PathBuf {
    source_dir().join("build").join("templates")
}

/// The default template, the one way every caller gets it ([`bud_templates::template`]), over
/// the guest of [`guest`] (brought up to date with its inputs once per binary). The first
/// call boots and saves it or loads it; later calls load it from disk; a failure is
/// remembered like [`guest`]'s.
pub fn template() -> Template {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    let load = || {
        let opts = bud_templates::TemplateOptions::new(source_dir());
        bud_templates::template(
            &opts,
            &mut |line: &str| eprintln!("[guest build] {line}"),
            None,
        )
        .map_err(|e| format!("{:#}", anyhow::Error::new(e)))
    };
    let mut first = None;
    let ready = READY.get_or_init(|| {
        guest();
        first = Some(load()?);
        Ok(())
    });
    match (ready, first) {
        (Err(e), _) => panic!("preparing the template failed: {e}"),
        (Ok(()), Some(t)) => t,
        (Ok(()), None) => load().unwrap_or_else(|e| panic!("loading the template failed: {e}")),
    }
}

/// One executor over the default template for this test binary, with a small pool.
pub fn executor() -> &'static Executor {
    static EXEC: OnceLock<Executor> = OnceLock::new();
    EXEC.get_or_init(|| {
        Executor::new(template(), vmm::ExecutorOptions::default())
            .expect("starting the executor failed")
    })
}

/// An executor of its own for a test binary's sessions: no pool (each session clones when
/// it starts), every reset verified by value.
pub fn verifying_executor() -> Executor {
    let opts = vmm::ExecutorOptions {
        pool_size: 0,
        verify: true,
        ..vmm::ExecutorOptions::default()
    };
    Executor::new(template(), opts).expect("starting the executor failed")
}

/// Python for the leak searchers: `scan(data, where)` records in `found` every string that
/// follows the marker (the searcher never holds the secret itself, only the marker), and
/// `scan_own_memory(scan, wanted)` passes the resident parts
/// of every writable mapping of this process that `wanted(maps_fields)` accepts to
/// `scan(bytes, 'memory')`. Residency comes from mincore(2): pymalloc's arena region is
/// gigabytes of address space (`guest/pyext/src/arenas.rs`), of which only what was touched
/// holds anything, and reading all of it would need as much memory.
///
/// It reads its own memory directly (`ctypes.string_at`), in user mode: through
/// `/proc/self/mem` every page was a guest-kernel copy, emulated under kvm_pvm (a whole
/// search took 41 M emulated instructions, 17 M this way; the guest kernel has no
/// `process_vm_readv`). Each run is checked with mincore again just before it is read, with
/// no Python object freed in between, so a mapping freed since the list was taken is
/// skipped (mincore fails with ENOMEM on an unmapped range) rather than read.
pub const SCAN_OWN_MEMORY: &str = "import ctypes, re\n\
marker = b'BUDL' + b'EAK-'\n\
found = set()\n\
def scan(data, where):\n\
\x20   at = data.find(marker)\n\
\x20   while at >= 0:\n\
\x20       found.add((where, data[at + 8:at + 40].decode('latin-1')))\n\
\x20       at = data.find(marker, at + 1)\n\
def scan_own_memory(scan, wanted):\n\
\x20   libc = ctypes.CDLL(None, use_errno=True)\n\
\x20   libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]\n\
\x20   for line in open('/proc/self/maps').read().splitlines():\n\
\x20       parts = line.split()\n\
\x20       if not (parts[1].startswith('rw') and wanted(parts)): continue\n\
\x20       lo, hi = (int(x, 16) for x in parts[0].split('-'))\n\
\x20       vec = ctypes.create_string_buffer((hi - lo) // 4096)\n\
\x20       if libc.mincore(lo, hi - lo, vec) != 0: continue\n\
\x20       for m in re.finditer(rb'[^\\x00]+', vec.raw):\n\
\x20           a, b = lo + m.start() * 4096, lo + m.end() * 4096\n\
\x20           if libc.mincore(a, b - a, vec) == 0: scan(ctypes.string_at(a, b - a), 'memory')\n";

/// Python that plants `secret` (behind the leak marker) where a later job could find it if
/// isolation failed: 8 MiB of fresh anonymous memory (huge pages), 6 MiB of malloc heap it
/// frees again, a 1 MiB file in /tmp, 60 000 bytes left in a pipe, and a child whose command
/// line holds it. Prints `planted True` when fresh memory did come in huge pages.
pub fn leak_plant(secret: &str) -> String {
    format!(
        "import ctypes, mmap, os, subprocess\n\
         s = ('BUDLEAK-' + {secret:?}).encode()\n\
         fill = lambda n: (s * (n // len(s) + 1))[:n]\n\
         m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE)\n\
         m[:] = fill(8 << 20)\n\
         libc = ctypes.CDLL(None)\n\
         libc.malloc.restype = ctypes.c_void_p\n\
         p = libc.malloc(6 << 20)\n\
         ctypes.memmove(p, fill(6 << 20), 6 << 20)\n\
         libc.free(ctypes.c_void_p(p))\n\
         open('/tmp/big', 'wb').write(fill(1 << 20))\n\
         r, w = os.pipe()\n\
         os.write(w, fill(60000))\n\
         subprocess.Popen(['sh', '-c', 'x=' + s.decode() + '; sleep 1000'])\n\
         huge = [l for l in open('/proc/meminfo') if l.startswith('AnonHugePages:')][0].split()[1]\n\
         print('planted', int(huge) >= 4 << 10)"
    )
}

/// Python that takes memory of [`leak_plant`]'s sizes without zeroing it (malloc, and mmap,
/// which the kernel must zero) and searches it, the files in /tmp and /dev/shm, every
/// process's command line and every writable mapping of its own for the leak marker; prints
/// what follows each find, then `searched N`. It never holds a secret, only the marker.
pub fn leak_search() -> String {
    [
        SCAN_OWN_MEMORY,
        "import ctypes, mmap, os\n\
         libc = ctypes.CDLL(None)\n\
         libc.malloc.restype = ctypes.c_void_p\n\
         for n in (6 << 20, 8 << 20, 1 << 20):\n\
         \x20   p = libc.malloc(n)\n\
         \x20   scan(ctypes.string_at(p, n), f'malloc {n}')\n\
         m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE)\n\
         scan(m[:], 'mmap')\n\
         for root in ('/tmp', '/dev/shm'):\n\
         \x20   for name in os.listdir(root):\n\
         \x20       p = os.path.join(root, name)\n\
         \x20       if os.path.isfile(p): scan(open(p, 'rb').read(), p)\n\
         for pid in os.listdir('/proc'):\n\
         \x20   if pid.isdigit():\n\
         \x20       try: scan(open(f'/proc/{pid}/cmdline', 'rb').read(), 'cmdline')\n\
         \x20       except OSError: pass\n\
         scan_own_memory(scan, lambda p: len(p) < 6 or p[5] in ('[heap]', '[stack]'))\n\
         for where, tail in sorted(found): print(where, tail)\n\
         print('searched', len(found))",
    ]
    .concat()
}

/// A fresh 32-hex-digit secret from the host's random source.
pub fn new_secret() -> String {
    let mut raw = [0u8; 16];
    vmm::identity::host_random(&mut raw).unwrap();
    raw.iter().map(|b| format!("{b:02x}")).collect()
}

/// An echo server on 127.0.0.1 (a thread per connection, until the peer closes): the far end
/// of a sandbox's connections in the network tests.
pub fn echo_server() -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// The tests' guest booted with a network card (a template of its own: the card is part of
/// it), for the network tests.
pub fn network_template() -> Template {
    guest();
    let mut boot = boot_config();
    boot.network = true;
    let spec = vmm::TemplateSpec {
        boot,
        root: template_root(),
    };
    Template::load_or_build(&spec, None).expect("building the network template failed")
}
