//! The `bud.node` addon loaded in the host's Node.js (`node` on PATH).
//!
//! Never takes the doorbell nor rings: on the host `ioperm` needs root and an `out` to the
//! port faults or reaches a real port. These tests check that `ring` refuses without the
//! permission instead. The mailbox is a memfd this test makes and fills, inherited by node
//! at the same descriptor number (told in `BUD_MAILBOX_FD`), as the Python worker hands its
//! memfd to the kernel. Without `node` on PATH they fail, saying so.

use std::ffi::c_void;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::ptr::NonNull;

const PAGE_SIZE: usize = 4096;

/// Node.js of the host (the guest's is Debian's 18; the addon uses Node-API <= 8 only).
const NODE: &str = "node";

/// The cdylib cargo built next to this test binary (target/<profile>/libbud_nodeext.so, or
/// the one in deps/): the newer of the two, since a `cargo build` of another day may have
/// left the first one behind.
fn built_addon() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    [
        profile_dir.join("libbud_nodeext.so"),
        profile_dir.join("deps/libbud_nodeext.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max_by_key(|(modified, _)| *modified)
    .map(|(_, p)| p)
}

/// A temp dir of its own for test `name` (tests run in parallel, and overwriting a loaded
/// addon would SIGBUS the node using it) holding the addon as `bud.node`, as the guest's
/// /usr/lib/bud/node does.
fn stage(name: &str) -> Stage {
    let so = built_addon().expect("libbud_nodeext.so next to the test binary (cargo builds it)");
    let dir = std::env::temp_dir().join(format!("bud-nodeext-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create stage dir");
    std::fs::copy(so, dir.join("bud.node")).expect("copy addon");
    Stage(dir)
}

/// The staged directory, removed when the test ends.
struct Stage(PathBuf);

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A memfd holding [`pattern`] and this process's own shared mapping of it.
struct Mailbox {
    file: File,
    map: NonNull<u8>,
    len: usize,
}

impl Mailbox {
    fn new(name: &str, len: usize) -> Self {
        let name = std::ffi::CString::new(format!("bud-nodeext-test-{name}")).expect("name");
        // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor
        // (or -1); MFD_CLOEXEC keeps it out of children of other tests running meanwhile.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: fd is a fresh descriptor that the File alone owns from here.
        let mut file = unsafe { File::from_raw_fd(fd) };
        let data: Vec<u8> = (0..len).map(pattern).collect();
        file.write_all(&data).expect("fill memfd");
        // SAFETY: a new shared mapping of the whole file, at an address of the kernel's
        // choice, overlapping nothing.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert!(
            map != libc::MAP_FAILED,
            "mmap: {}",
            io::Error::last_os_error()
        );
        let map = NonNull::new(map.cast::<u8>()).expect("mmap returned NULL");
        Self { file, map, len }
    }

    fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// A copy of the bytes, read through this process's mapping.
    fn bytes(&self) -> Vec<u8> {
        // SAFETY: the mapping is `len` readable bytes, alive while self is; node, the only
        // other user, has exited when the tests read it.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.len) }.to_vec()
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly this value's own mapping; no reference into it survives.
        unsafe { libc::munmap(self.map.as_ptr().cast::<c_void>(), self.len) };
    }
}

/// The bytes the test writes into a mailbox before node maps it.
fn pattern(i: usize) -> u8 {
    (i % 251) as u8 ^ 0x5a
}

/// Runs `node -e script` with the staged addon's path in `BUD_ADDON` and, if given, the
/// mailbox inherited at its own descriptor number, told in `BUD_MAILBOX_FD`.
fn node(stage: &Stage, script: &str, mailbox: Option<&Mailbox>) -> Output {
    let mut command = Command::new(NODE);
    command
        .args(["-e", script])
        .env("BUD_ADDON", stage.0.join("bud.node"))
        .env_remove("NODE_OPTIONS")
        .current_dir(&stage.0);
    if let Some(mailbox) = mailbox {
        let fd = mailbox.fd();
        command.env("BUD_MAILBOX_FD", fd.to_string());
        // SAFETY: the closure runs in the forked child before exec and only calls fcntl,
        // which is async-signal-safe. Clearing FD_CLOEXEC there (not here) lets this child
        // alone inherit the descriptor, at the number it has here, so it cannot land on a
        // descriptor the child still uses.
        unsafe {
            command.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    command.output().unwrap_or_else(|e| {
        panic!("run {NODE}: {e} (these tests need Node.js on PATH)");
    })
}

/// Runs the script and returns its stdout, asserting that it exited 0 and wrote nothing on
/// stderr.
fn run(stage: &Stage, script: &str, mailbox: Option<&Mailbox>) -> String {
    let out = node(stage, script, mailbox);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "{}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
}

/// Loads the addon and defines `attempt(f)`: f's value, or `Name: message` of what it threw.
const PRELUDE: &str = r#"
const bud = require(process.env.BUD_ADDON);
const fd = Number(process.env.BUD_MAILBOX_FD);
const attempt = (f) => {
  try {
    return String(f());
  } catch (e) {
    return `${e.constructor.name}: ${e.message}`;
  }
};
"#;

#[test]
fn exports_are_the_seven_functions() {
    let stage = stage("exports");

    let stdout = run(
        &stage,
        &format!(
            "{PRELUDE}
for (const [name, value] of Object.entries(bud)) console.log(name, typeof value, value.name);
"
        ),
        None,
    );

    assert_eq!(
        stdout,
        "mapMailbox function mapMailbox\n\
         takeDoorbell function takeDoorbell\n\
         ring function ring\n\
         mailboxAddress function mailboxAddress\n\
         lockMemory function lockMemory\n\
         afterTick function afterTick\n\
         reseed function reseed\n"
    );
}

#[test]
fn after_tick_returns_once_the_coarse_clock_moved() {
    let stage = stage("tick");

    let stdout = run(
        &stage,
        &format!(
            "{PRELUDE}
console.log(bud.afterTick());
"
        ),
        None,
    );

    // 1: it saw the host's coarse clock move (0 would be its 200 ms limit).
    assert_eq!(stdout, "1\n");
}

#[test]
fn mailbox_is_shared_both_ways_locked_and_keeps_its_data() {
    let stage = stage("shared");
    let mailbox = Mailbox::new("shared", 2 * PAGE_SIZE);

    let stdout = run(
        &stage,
        &format!(
            r#"{PRELUDE}
console.log(attempt(() => bud.mailboxAddress()));
const ab = bud.mapMailbox(fd, 8192);
const addr = bud.mailboxAddress();
console.log(Number.isSafeInteger(addr), addr > 0, addr % 4096);
const u = new Uint8Array(ab);
let sum = 0;
for (const x of u) sum += x;
console.log(ab instanceof ArrayBuffer, ab.byteLength, u[0], u[4095], u[4096], u[8191], sum);
const smaps = require('fs').readFileSync('/proc/self/smaps', 'utf8');
const blocks = smaps.split(/\n(?=[0-9a-f]+-[0-9a-f]+ )/);
const block = blocks.filter((b) => b.split('\n')[0].includes('/memfd:bud-nodeext-test-shared'));
const field = (name) => block[0].match(new RegExp(`^${{name}}:\\s+(.*)$`, 'm'))[1];
const flags = field('VmFlags').split(' ');
console.log(block.length, field('Rss'), field('Locked'), flags.includes('sh'), flags.includes('lo'), flags.includes('dc'));
u.set([0xde, 0xad, 0xbe, 0xef], 100);
u[8191] = 7;
console.log(attempt(() => bud.reseed(new Uint8Array(ab, 104, 32))));
"#
        ),
        Some(&mailbox),
    );

    let expected_sum: usize = (0..2 * PAGE_SIZE).map(|i| usize::from(pattern(i))).sum();
    assert_eq!(
        stdout,
        format!(
            "Error: mailboxAddress: no mailbox: call mapMailbox() first\ntrue true 0\n\
             true 8192 {} {} {} {} {expected_sum}\n1 8 kB 8 kB true true true\nundefined\n",
            pattern(0),
            pattern(4095),
            pattern(4096),
            pattern(8191),
        )
    );
    let mut expected: Vec<u8> = (0..2 * PAGE_SIZE).map(pattern).collect();
    expected[100..104].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
    expected[8191] = 7;
    assert!(
        mailbox.bytes() == expected,
        "node's writes, and only them, reach the memfd"
    );
}

#[test]
fn second_mailbox_and_bad_arguments_are_refused() {
    let stage = stage("refused");
    let mailbox = Mailbox::new("refused", 2 * PAGE_SIZE);

    let stdout = run(
        &stage,
        &format!(
            r#"{PRELUDE}
const tries = [
  [fd, 0], [fd, 4097], [fd, 64], [fd, 64 * 1024 * 1024 + 4096], [fd, 12288], [fd, -4096],
  [fd, 1.5], [fd, '8192'], [fd], ['3', 8192], [-1, 8192], [2 ** 31, 8192], [99999, 8192],
];
for (const args of tries) console.log(attempt(() => bud.mapMailbox(...args)));
console.log(bud.mapMailbox(fd, 4096).byteLength);
console.log(attempt(() => bud.mapMailbox(fd, 4096)));
"#
        ),
        Some(&mailbox),
    );

    let fd = mailbox.fd();
    let range = "must be an integer from 0 to";
    assert_eq!(
        stdout,
        format!(
            "RangeError: mapMailbox: length 0: smaller than the mailbox header\n\
             RangeError: mapMailbox: length 4097: not a whole number of pages\n\
             RangeError: mapMailbox: length 64: not a whole number of pages\n\
             RangeError: mapMailbox: length 67112960: larger than MAILBOX_MAX_SIZE\n\
             RangeError: mapMailbox: fd {fd} holds 8192 bytes, fewer than length 12288\n\
             RangeError: mapMailbox: length {range} 9007199254740991, not -4096\n\
             RangeError: mapMailbox: length {range} 9007199254740991, not 1.5\n\
             TypeError: mapMailbox: length must be a number\n\
             TypeError: mapMailbox: length must be a number\n\
             TypeError: mapMailbox: fd must be a number\n\
             RangeError: mapMailbox: fd {range} 2147483647, not -1\n\
             RangeError: mapMailbox: fd {range} 2147483647, not 2147483648\n\
             Error: mapMailbox: fstat: Bad file descriptor (os error 9)\n\
             4096\n\
             Error: mapMailbox: this process already mapped its mailbox\n"
        )
    );
    assert!(
        mailbox
            .bytes()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(i)),
        "refused or not, mapping changed no byte"
    );
}

#[test]
fn reseed_takes_bytes_and_random_bytes_still_work() {
    let stage = stage("reseed");

    let stdout = run(
        &stage,
        &format!(
            r#"{PRELUDE}
const crypto = require('crypto');
console.log(attempt(() => bud.reseed(Buffer.from('a fresh seed for this clone'))));
console.log(attempt(() => bud.reseed(new Uint8Array(new ArrayBuffer(64), 16, 32))));
const a = crypto.randomBytes(16);
const b = crypto.randomBytes(16);
console.log(a.length, b.length, a.equals(b));
const bad = ['seed', new Uint16Array(4), new ArrayBuffer(4), new Uint8Array(0), undefined];
for (const value of bad) console.log(attempt(() => bud.reseed(value)));
crypto.randomBytes(16, (err, buf) => console.log('async', err, buf.length));
"#
        ),
        None,
    );

    assert_eq!(
        stdout,
        "undefined\n\
         undefined\n\
         16 16 false\n\
         TypeError: reseed: buf must be a Uint8Array or a Buffer\n\
         TypeError: reseed: buf must be a Uint8Array or a Buffer\n\
         TypeError: reseed: buf must be a Uint8Array or a Buffer\n\
         RangeError: reseed: buf is empty: there is nothing to seed with\n\
         TypeError: reseed: buf must be a Uint8Array or a Buffer\n\
         async null 16\n"
    );
}

#[test]
fn ring_refuses_without_the_doorbell_permission() {
    let stage = stage("ring");

    let stdout = run(
        &stage,
        &format!(
            r#"{PRELUDE}
const tries = [
  [2], [2, 1n, 2], [2, 2 ** 53, 0], [-1], [2 ** 32], [1.5], [], [2, -1], [2, 1n << 64n],
  [2, -1n], [2, 'x'], [2, 0, null],
];
for (const args of tries) console.log(attempt(() => bud.ring(...args)));
"#
        ),
        None,
    );

    let no_permission = "Error: ring: no doorbell permission on this thread: \
                         call takeDoorbell() first (inside a bud guest only)";
    let range = "must be an integer from 0 to";
    let bigint = "RangeError: ring: a must be a BigInt from 0n to 18446744073709551615n";
    assert_eq!(
        stdout,
        format!(
            "{no_permission}\n\
             {no_permission}\n\
             RangeError: ring: a {range} 9007199254740991, not 9007199254740992\n\
             RangeError: ring: code {range} 4294967295, not -1\n\
             RangeError: ring: code {range} 4294967295, not 4294967296\n\
             RangeError: ring: code {range} 4294967295, not 1.5\n\
             TypeError: ring: code must be a number\n\
             RangeError: ring: a {range} 9007199254740991, not -1\n\
             {bigint}\n\
             {bigint}\n\
             TypeError: ring: a must be a number or a BigInt\n\
             TypeError: ring: b must be a number or a BigInt\n"
        )
    );
}
