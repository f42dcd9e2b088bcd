//! Sessions saved to and loaded from session files, through the library, on the real VMM
//! and guest: what a pause, a resume and a snapshot are made of (the server's API over
//! them is tested in `server/tests/durable.rs`). Needs /dev/kvm.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use vmm::process::{ProcessEvent, ProcessSpec, Processes};
use vmm::session::{DEFAULT_INTERRUPT_GRACE, Session};
use vmm::session_file::{self, SessionFileError, SessionKeys};
use vmm::{Executor, Job, JobResult, Status};

/// The key these tests sign and read files with.
fn keys() -> SessionKeys {
    SessionKeys::parse("5e551011f11e5e551011f11e5e551011f11e5e551011f11e5e551011f11e0001").unwrap()
}

fn executor() -> Executor {
    common::verifying_executor()
}

/// A folder of this test's own under the build folder, empty.
fn scratch(name: &str) -> PathBuf {
    let d = common::source_dir()
        .join("target/tmp/session-file")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cell(s: &mut Session, ex: &Executor, code: &str) -> String {
    let r: JobResult = s
        .exec(
            ex,
            &Job::python(code),
            DEFAULT_INTERRUPT_GRACE,
            &mut |_, _| {},
        )
        .expect("the cell could not run");
    assert_eq!(
        r.status,
        Status::Ok,
        "cell {code:?}: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8_lossy(&r.stdout).trim().to_owned()
}

fn host_time() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Polls until process `pid`'s stdout holds `want` (at most 30 s).
fn output_of(s: &mut Session, ex: &Executor, pid: u32, want: &str) -> String {
    let mut out = Vec::new();
    let t = Instant::now();
    while !String::from_utf8_lossy(&out).contains(want) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no {want:?} from {pid}"
        );
        for e in s
            .poll_processes(ex, Duration::from_secs(5), 1 << 20, None)
            .unwrap()
        {
            if let ProcessEvent::Output { pid: p, data, .. } = e
                && p == pid
            {
                out.extend(data);
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn a_saved_and_ended_session_loads_with_its_variables_files_processes_and_clock() {
    let ex = executor();
    let dir = scratch("pause");
    let path = dir.join("s.bud");
    let mut s = Session::start(&ex).unwrap();
    let digest = cell(
        &mut s,
        &ex,
        "import subprocess, time\n\
         x = 41\n\
         open('kept.txt', 'w').write('kept')\n\
         child = subprocess.Popen(['sleep', '1000'])\n\
         blob = bytes(range(256)) * 40000\n\
         t0 = time.monotonic()\n\
         import hashlib\n\
         print(hashlib.sha256(blob).hexdigest())",
    );
    let pid = s
        .start_process(
            &ex,
            &ProcessSpec {
                script: "read line; echo got $line".into(),
                stdin: true,
                ..ProcessSpec::default()
            },
        )
        .unwrap();

    // The guest's clock just before the save: it must not move while saved.
    cell(&mut s, &ex, "t0 = time.monotonic()");
    let stats = s
        .save(&ex, &path, b"the caller's record".to_vec(), &keys())
        .unwrap();
    s.end(&ex);
    std::thread::sleep(Duration::from_millis(1500));
    let f = session_file::read(&path, &keys()).unwrap();
    f.verify_pages().unwrap();
    let mut s = Session::load(&ex, &f, false).unwrap();
    drop(f);
    std::fs::remove_file(&path).unwrap();
    let seen = cell(
        &mut s,
        &ex,
        &format!(
            // The clocks first: reading the blob back faults in its pages from the file,
            // which took over a second on a loaded machine (load average 8 on 2 cores).
            "m = time.monotonic() - t0; w = abs(time.time() - {})\n\
             print(x + 1, open('kept.txt').read(), child.poll(), \
             hashlib.sha256(blob).hexdigest() == {digest:?}, m < 1.0, w < 1.0)",
            host_time()
        ),
    );
    s.process_stdin(&ex, pid, b"hello\n".to_vec(), true)
        .unwrap();
    let out = output_of(&mut s, &ex, pid, "got hello");

    assert!(stats.page_bytes >= 10 << 20, "{stats:?}");
    assert_eq!(
        seen, "42 kept None True True True",
        "the clock did not stand still while saved, or state was lost"
    );
    assert_eq!(out, "got hello\n");
    assert_eq!(s.executions(), 3);
    s.end(&ex);
}

#[test]
fn a_snapshot_loaded_twice_with_new_identities_gives_two_sessions_apart_from_it() {
    let ex = executor();
    let dir = scratch("snapshot");
    let path = dir.join("snap.bud");
    let mut source = Session::start(&ex).unwrap();
    cell(&mut source, &ex, "import os, random\nbase = 'snapshot'");
    source.save(&ex, &path, Vec::new(), &keys()).unwrap();
    let f = session_file::read(&path, &keys()).unwrap();
    let mut a = Session::load(&ex, &f, true).unwrap();
    let mut b = Session::load(&ex, &f, true).unwrap();

    let probe = "print(base, random.random(), os.urandom(8).hex())";
    let from_a = cell(
        &mut a,
        &ex,
        &format!("open('mine', 'w').write('a')\n{probe}"),
    );
    let from_b = cell(
        &mut b,
        &ex,
        &format!("{probe}\nprint(os.path.exists('mine'))"),
    );
    let from_source = cell(&mut source, &ex, "print(base, os.path.exists('mine'))");

    assert!(from_a.starts_with("snapshot "), "{from_a}");
    assert!(from_b.starts_with("snapshot "), "{from_b}");
    let (a_rand, b_rand) = (
        &from_a[9..],
        from_b.lines().next().unwrap_or("")[9..].to_owned(),
    );
    assert_ne!(
        a_rand, b_rand,
        "two sessions from one snapshot share random state"
    );
    assert!(from_b.ends_with("\nFalse"), "{from_b}");
    assert_eq!(from_source, "snapshot False");
    for s in [a, b, source] {
        s.end(&ex);
    }
}

#[test]
fn a_damaged_truncated_or_foreign_session_file_is_refused_with_why() {
    let ex = executor();
    let dir = scratch("damaged");
    let good = dir.join("good.bud");
    let mut s = Session::start(&ex).unwrap();
    cell(&mut s, &ex, "data = bytearray(b'x' * (1 << 20))");
    s.save(&ex, &good, b"record".to_vec(), &keys()).unwrap();
    s.end(&ex);
    let bytes = std::fs::read(&good).unwrap();
    let pages = session_file::read(&good, &keys()).unwrap().page_bytes() as usize;
    let variant = |name: &str, edit: &dyn Fn(&mut Vec<u8>)| {
        let mut b = bytes.clone();
        edit(&mut b);
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let page_flipped = variant("page.bud", &|b| b[4096 + 7] ^= 1);
    let header_flipped = variant("header.bud", &|b| b[pages + 3] ^= 1);
    let truncated = variant("short.bud", &|b| b.truncate(b.len() - 100));
    let newer = variant("newer.bud", &|b| {
        let at = b.len() - 64;
        b[at] = b[at].wrapping_add(1);
    });
    let foreign = variant("foreign.bud", &|b| *b = vec![0u8; 8192]);

    let flipped = session_file::read(&page_flipped, &keys()).unwrap();
    let loaded = Session::load(&ex, &session_file::read(&good, &keys()).unwrap(), false);

    assert!(
        matches!(
            flipped.verify_pages(),
            Err(SessionFileError::Corrupt { .. })
        ),
        "a flipped page byte was not found"
    );
    assert!(matches!(
        session_file::read(&header_flipped, &keys()),
        Err(SessionFileError::Corrupt { .. })
    ));
    assert!(matches!(
        session_file::read(&good, &SessionKeys::generate().unwrap()),
        Err(SessionFileError::UnknownKey { .. })
    ));
    assert!(matches!(
        session_file::read(&truncated, &keys()),
        Err(SessionFileError::NotOurs { .. } | SessionFileError::Corrupt { .. })
    ));
    assert!(matches!(
        session_file::read(&newer, &keys()),
        Err(SessionFileError::Version { found: 3, .. })
    ));
    assert!(matches!(
        session_file::read(&foreign, &keys()),
        Err(SessionFileError::NotOurs { .. })
    ));
    let mut back = loaded.unwrap();
    assert_eq!(cell(&mut back, &ex, "print(len(data))"), "1048576");
    back.end(&ex);
}

/// Defence in depth: a file signed with the right key whose machine state is not its
/// template's (a CPUID offering VMX, an MSR list with one more MSR, RFLAGS out of range) is
/// refused before any of it reaches KVM, with what was wrong; the good file still loads.
#[test]
fn a_signed_file_with_a_foreign_cpuid_or_msrs_is_refused_before_kvm_sees_it() {
    let ex = executor();
    let dir = scratch("foreign-machine");
    let good = dir.join("good.bud");
    let mut s = Session::start(&ex).unwrap();
    cell(&mut s, &ex, "y = 7");
    s.save(&ex, &good, Vec::new(), &keys()).unwrap();
    s.end(&ex);
    let f = session_file::read(&good, &keys()).unwrap();
    let variant = |name: &str, edit: &dyn Fn(&mut session_file::Header)| {
        let p = dir.join(name);
        session_file::rewrite(&f, &p, &keys(), |h, _| edit(h)).unwrap();
        session_file::read(&p, &keys()).expect("a signed file reads")
    };
    let vmx = variant("vmx.bud", &|h| {
        for e in h.machine.cpuid.iter_mut().filter(|e| e.function == 1) {
            e.ecx |= 1 << 5;
        }
    });
    let msrs = variant("msrs.bud", &|h| {
        let mut extra = h.machine.msrs[0];
        extra.index = 0x3a; // IA32_FEATURE_CONTROL
        h.machine.msrs.push(extra);
    });
    let rflags = variant("rflags.bud", &|h| h.machine.regs.rflags = u64::MAX);

    let refused: Vec<String> = [&vmx, &msrs, &rflags]
        .into_iter()
        .map(|f| match Session::load(&ex, f, false) {
            Err(vmm::session::SessionError::File(e @ SessionFileError::Machine { .. })) => {
                e.to_string()
            }
            other => panic!("not refused for its machine state: {:?}", other.map(|_| ())),
        })
        .collect();
    let mut back = Session::load(&ex, &f, false).unwrap();

    assert!(refused[0].contains("CPUID"), "{}", refused[0]);
    assert!(refused[1].contains("MSR list"), "{}", refused[1]);
    assert!(refused[2].contains("RFLAGS"), "{}", refused[2]);
    assert_eq!(cell(&mut back, &ex, "print(y)"), "7");
    back.end(&ex);
}
