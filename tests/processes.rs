//! A session's background processes on the real VMM and guest, through the library: start,
//! poll for output and exits, stdin, signals, concurrency with cells, cancel of a poll, and
//! what a session that ran processes becomes at its end. Needs /dev/kvm. (The HTTP and E2B
//! APIs over them are tested in `server/tests/processes.rs`.)

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use vmm::job::Stream;
use vmm::process::{ProcessError, ProcessEvent, ProcessSpec, Processes};
use vmm::session::{DEFAULT_INTERRUPT_GRACE, Session};
use vmm::{Cancel, Executor, Job, Status};

fn executor() -> Executor {
    common::verifying_executor()
}

fn spec(script: &str) -> ProcessSpec {
    ProcessSpec {
        script: script.into(),
        ..ProcessSpec::default()
    }
}

/// How a process ended: (exit code, signal).
type Ended = (Option<i32>, Option<i32>);

/// What one process did: stdout, stderr, and how it ended once it did.
type Record = (Vec<u8>, Vec<u8>, Option<Ended>);

/// What the processes did, per pid.
#[derive(Debug, Default)]
struct Seen {
    out: BTreeMap<u32, Record>,
}

impl Seen {
    fn take(&mut self, events: Vec<ProcessEvent>) {
        for e in events {
            match e {
                ProcessEvent::Output { pid, stream, data } => {
                    let p = self.out.entry(pid).or_default();
                    assert!(p.2.is_none(), "output of {pid} after its exit");
                    match stream {
                        Stream::Stdout => p.0.extend(data),
                        Stream::Stderr => p.1.extend(data),
                    }
                }
                ProcessEvent::Exit {
                    pid,
                    exit_code,
                    signal,
                } => {
                    let p = self.out.entry(pid).or_default();
                    assert!(p.2.is_none(), "two exits of {pid}");
                    p.2 = Some((exit_code, signal));
                }
                ProcessEvent::Watch { watcher, .. } => panic!("no watcher here: {watcher}"),
            }
        }
    }

    fn ended(&self, pid: u32) -> Option<Ended> {
        self.out.get(&pid).and_then(|p| p.2)
    }

    fn stdout(&self, pid: u32) -> String {
        String::from_utf8_lossy(&self.out[&pid].0).into_owned()
    }
}

/// Polls until `pid` ended (at most `limit`).
fn poll_until_ended(s: &mut Session, ex: &Executor, seen: &mut Seen, pid: u32, limit: Duration) {
    let t = Instant::now();
    while seen.ended(pid).is_none() {
        assert!(t.elapsed() < limit, "process {pid} did not end: {seen:?}");
        let ev = s
            .poll_processes(ex, Duration::from_secs(5), 1 << 20, None)
            .expect("poll failed");
        seen.take(ev);
    }
}

#[test]
fn a_background_process_runs_between_requests_and_reports_output_and_exit() {
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    let pid = s
        .start_process(
            &ex,
            &ProcessSpec {
                script: "echo out; echo err >&2; echo \"$GREETING\"; pwd; exit 7".into(),
                env: vec![("GREETING".into(), "hello there".into())],
                cwd: Some("/usr".into()),
                ..ProcessSpec::default()
            },
        )
        .expect("start");
    assert!(pid > 1, "pid {pid}");
    let mut seen = Seen::default();
    poll_until_ended(&mut s, &ex, &mut seen, pid, Duration::from_secs(60));
    assert_eq!(seen.stdout(pid), "out\nhello there\n/usr\n");
    assert_eq!(String::from_utf8_lossy(&seen.out[&pid].1), "err\n");
    assert_eq!(seen.ended(pid), Some((Some(7), None)));
    // Ended: no longer a process to signal or write to.
    assert!(matches!(
        s.signal_process(&ex, pid, 15),
        Err(ProcessError::NotFound(_))
    ));
    // Nothing live: a poll answers at once, empty.
    let t = Instant::now();
    let ev = s
        .poll_processes(&ex, Duration::from_secs(30), 1 << 20, None)
        .unwrap();
    assert!(ev.is_empty(), "{ev:?}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    s.end(&ex);
}

#[test]
fn a_process_runs_as_the_user_it_names_and_the_worker_stays_root() {
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    let who = "id -un; id -G; echo \"$HOME $USER $LOGNAME $SHELL\"; pwd; \
               f=made-$$; touch $f; stat -c %U $f; grep -E '^Cap(Prm|Eff)' /proc/self/status";
    let as_user = |user: Option<&str>, env: Vec<(String, String)>| ProcessSpec {
        script: who.into(),
        env,
        user: user.map(str::to_owned),
        ..ProcessSpec::default()
    };
    let user = s
        .start_process(&ex, &as_user(Some("user"), vec![]))
        .expect("start as user");
    let mut seen = Seen::default();
    poll_until_ended(&mut s, &ex, &mut seen, user, Duration::from_secs(60));
    // The request's env still wins over the user's own.
    let moved = vec![("HOME".to_owned(), "/elsewhere".to_owned())];
    let home = s
        .start_process(&ex, &as_user(Some("user"), moved))
        .expect("start with HOME");
    poll_until_ended(&mut s, &ex, &mut seen, home, Duration::from_secs(60));
    let root = s
        .start_process(&ex, &as_user(None, vec![]))
        .expect("start as root");
    poll_until_ended(&mut s, &ex, &mut seen, root, Duration::from_secs(60));
    let unknown = s.start_process(&ex, &as_user(Some("nobody2"), vec![]));
    // The worker itself (every thread of it) is still root after spawning as user.
    let cell = s
        .exec(
            &ex,
            &Job::python("import os\nprint(os.getresuid(), os.getresgid(), os.getgroups())"),
            DEFAULT_INTERRUPT_GRACE,
            &mut |_, _| {},
        )
        .unwrap();

    assert_eq!(
        seen.stdout(user),
        "user\n1000\n/home/user user user /bin/sh\n/tmp\nuser\n\
         CapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n"
    );
    assert!(
        seen.stdout(home)
            .starts_with("user\n1000\n/elsewhere user user /bin/sh\n"),
        "{}",
        seen.stdout(home)
    );
    let root_out = seen.stdout(root);
    assert!(
        root_out.starts_with("root\n0\n/tmp root root /bin/sh\n/tmp\nroot\n"),
        "{root_out}"
    );
    assert!(
        !root_out.contains("CapEff:\t0000000000000000"),
        "{root_out}"
    );
    assert!(
        matches!(&unknown, Err(ProcessError::Invalid(m)) if m.contains("nobody2")),
        "{unknown:?}"
    );
    assert_eq!(
        String::from_utf8_lossy(&cell.stdout),
        "(0, 0, 0) (0, 0, 0) []\n"
    );
    s.end(&ex);
}

#[test]
fn stdin_signals_and_cells_while_processes_live() {
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    // A reader of stdin that echoes each line, and a sleeper.
    let cat = s
        .start_process(
            &ex,
            &ProcessSpec {
                script: "while read -r line; do echo \"got $line\"; done; echo eof".into(),
                stdin: true,
                ..ProcessSpec::default()
            },
        )
        .expect("start cat");
    let sleeper = s
        .start_process(&ex, &spec("sleep 600"))
        .expect("start sleep");
    assert_ne!(cat, sleeper);
    let taken = s
        .process_stdin(&ex, cat, b"one\ntwo\n".to_vec(), false)
        .unwrap();
    assert_eq!(taken, 8);
    // A cell runs while both live, and sees them.
    let r = s
        .exec(
            &ex,
            &Job::shell(format!("kill -0 {cat} {sleeper} && echo both alive")),
            DEFAULT_INTERRUPT_GRACE,
            &mut |_, _| {},
        )
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&r.stdout), "both alive\n");
    // Stdin that was never opened cannot be written.
    assert!(matches!(
        s.process_stdin(&ex, sleeper, b"x".to_vec(), false),
        Err(ProcessError::NotFound(_))
    ));
    s.process_stdin(&ex, cat, b"three\n".to_vec(), true)
        .unwrap();
    let mut seen = Seen::default();
    poll_until_ended(&mut s, &ex, &mut seen, cat, Duration::from_secs(60));
    assert_eq!(seen.stdout(cat), "got one\ngot two\ngot three\neof\n");
    assert_eq!(seen.ended(cat), Some((Some(0), None)));
    assert_eq!(seen.ended(sleeper), None);
    s.signal_process(&ex, sleeper, 9).unwrap();
    poll_until_ended(&mut s, &ex, &mut seen, sleeper, Duration::from_secs(60));
    assert_eq!(seen.ended(sleeper), Some((None, Some(9))));
    assert!(matches!(
        s.signal_process(&ex, sleeper, 0),
        Err(ProcessError::Invalid(_))
    ));
    s.end(&ex);
}

#[test]
fn a_cancelled_poll_answers_early_and_loses_nothing() {
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    // Quiet for a while, then one line.
    let pid = s
        .start_process(&ex, &spec("sleep 3; echo late"))
        .expect("start");
    let cancel = Cancel::new();
    let c = cancel.clone();
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        c.cancel();
    });
    let t = Instant::now();
    let ev = s
        .poll_processes(&ex, Duration::from_secs(60), 1 << 20, Some(cancel))
        .expect("cancelled poll");
    let waited = t.elapsed();
    canceller.join().unwrap();
    assert!(ev.is_empty(), "{ev:?}");
    assert!(
        waited < Duration::from_secs(30),
        "the cancel did not end the wait"
    );
    assert!(s.usable(), "{:?}", s.health());
    let mut seen = Seen::default();
    poll_until_ended(&mut s, &ex, &mut seen, pid, Duration::from_secs(60));
    assert_eq!(seen.stdout(pid), "late\n");
    assert_eq!(seen.ended(pid), Some((Some(0), None)));
    // A bad working directory is refused with why.
    let bad = s.start_process(
        &ex,
        &ProcessSpec {
            script: "true".into(),
            cwd: Some("/no/such/dir".into()),
            ..ProcessSpec::default()
        },
    );
    assert!(matches!(bad, Err(ProcessError::Invalid(ref m)) if m.contains("/no/such/dir")));
    s.end(&ex);
}

#[test]
fn output_larger_than_a_poll_budget_arrives_whole_and_in_order() {
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    let pid = s.start_process(&ex, &spec("seq 1 40000")).expect("start");
    let mut seen = Seen::default();
    let t = Instant::now();
    while seen.ended(pid).is_none() {
        assert!(t.elapsed() < Duration::from_secs(120));
        // A small budget: many polls, each bounded.
        let ev = s
            .poll_processes(&ex, Duration::from_secs(5), 16 << 10, None)
            .unwrap();
        let bytes: usize = ev
            .iter()
            .map(|e| match e {
                ProcessEvent::Output { data, .. } => data.len(),
                ProcessEvent::Exit { .. } | ProcessEvent::Watch { .. } => 0,
            })
            .sum();
        assert!(bytes <= 16 << 10, "a poll took {bytes} bytes");
        seen.take(ev);
    }
    let expected: String = (1..=40000).map(|i| format!("{i}\n")).collect();
    assert_eq!(seen.stdout(pid), expected);
    let status = s
        .poll_processes(&ex, Duration::ZERO, 1 << 20, None)
        .unwrap();
    assert!(status.is_empty());
    assert_eq!(
        s.exec(
            &ex,
            &Job::python("print(1)"),
            DEFAULT_INTERRUPT_GRACE,
            &mut |_, _| {}
        )
        .unwrap()
        .status,
        Status::Ok
    );
    s.end(&ex);
}

#[test]
fn a_process_on_a_terminal_has_its_size_input_and_resize() {
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    let pid = s
        .start_process(
            &ex,
            &ProcessSpec {
                script: "stty size; [ -t 0 ] && tty; read -r x; stty size; echo \"got $x\"".into(),
                pty: Some((24, 80)),
                ..ProcessSpec::default()
            },
        )
        .expect("start");
    let mut seen = Seen::default();
    let t = Instant::now();
    // Typed input is echoed by the terminal as it is written: wait for the prompt's lines.
    while !seen
        .out
        .get(&pid)
        .is_some_and(|p| p.0.windows(9).any(|w| w == b"/dev/pts/"))
    {
        assert!(t.elapsed() < Duration::from_secs(60), "{seen:?}");
        seen.take(
            s.poll_processes(&ex, Duration::from_secs(5), 1 << 20, None)
                .unwrap(),
        );
    }
    s.resize_process(&ex, pid, 30, 100).expect("resize");
    s.process_stdin(&ex, pid, b"hello\n".to_vec(), false)
        .unwrap();
    poll_until_ended(&mut s, &ex, &mut seen, pid, Duration::from_secs(60));
    let out = seen.stdout(pid);
    // The terminal's own line endings and echo of what was typed.
    assert!(out.starts_with("24 80\r\n/dev/pts/"), "{out:?}");
    assert!(out.contains("hello\r\n30 100\r\ngot hello\r\n"), "{out:?}");
    assert_eq!(seen.ended(pid), Some((Some(0), None)));
    // Not a terminal: no resize.
    let plain = s.start_process(&ex, &spec("sleep 30")).unwrap();
    assert!(matches!(
        s.resize_process(&ex, plain, 10, 10),
        Err(ProcessError::NotFound(_))
    ));
    s.end(&ex);
}

#[test]
fn a_watched_directory_reports_its_changes_recursively() {
    use vmm::process::Change;
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    let shell = |s: &mut Session, code: &str| {
        let r = s
            .exec(
                &ex,
                &Job::shell(code),
                DEFAULT_INTERRUPT_GRACE,
                &mut |_, _| {},
            )
            .unwrap();
        assert_eq!(
            r.status,
            Status::Ok,
            "{}",
            String::from_utf8_lossy(&r.stderr)
        );
    };
    shell(&mut s, "mkdir -p w/old");
    assert!(matches!(
        s.watch_dir(&ex, "nope", false, false),
        Err(ProcessError::NotFound(_))
    ));
    let w = s.watch_dir(&ex, "w", true, false).expect("watch");
    let mut changes = Vec::new();
    let mut wait_for = |s: &mut Session, what: (Change, &str)| {
        let what = (what.0, what.1.to_string());
        let t = Instant::now();
        while !changes.contains(&what) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{what:?}: {changes:?}"
            );
            for e in s
                .poll_processes(&ex, Duration::from_secs(5), 1 << 20, None)
                .unwrap()
            {
                if let ProcessEvent::Watch { watcher, changed } = e {
                    assert_eq!(watcher, w);
                    assert_eq!(changed.entry, None, "a watcher without entries");
                    changes.push((changed.change, changed.path));
                }
            }
        }
        changes.clone()
    };
    // A new directory with something in it already, then changes in it once watched.
    shell(
        &mut s,
        "echo a > w/a.txt; mkdir -p w/new/deep; echo z > w/new/deep/z.txt",
    );
    wait_for(&mut s, (Change::Create, "new/deep/z.txt"));
    shell(
        &mut s,
        "echo b > w/new/b.txt; echo c > w/old/c.txt; mv w/a.txt w/moved.txt; \
         chmod 600 w/moved.txt; rm w/new/b.txt",
    );
    let changes = wait_for(&mut s, (Change::Remove, "new/b.txt"));
    for want in [
        (Change::Create, "a.txt"),
        (Change::Write, "a.txt"),
        (Change::Create, "new"),
        (Change::Create, "new/deep"),
        (Change::Create, "new/b.txt"),
        (Change::Create, "old/c.txt"),
        (Change::Rename, "a.txt"),
        (Change::Create, "moved.txt"),
        (Change::Chmod, "moved.txt"),
    ] {
        let want = (want.0, want.1.to_string());
        assert!(changes.contains(&want), "{want:?} not in {changes:?}");
    }
    s.unwatch(&ex, w).unwrap();
    assert!(matches!(s.unwatch(&ex, w), Err(ProcessError::NotFound(_))));
    let t = Instant::now();
    assert!(
        s.poll_processes(&ex, Duration::from_secs(30), 1 << 20, None)
            .unwrap()
            .is_empty()
    );
    assert!(t.elapsed() < Duration::from_secs(20), "nothing to wait for");
    s.end(&ex);
}

/// Watcher `w`'s changes, polled until one is a `last` (at most 60 s); a change of
/// another watcher fails the test.
fn changes_until(
    s: &mut Session,
    ex: &Executor,
    w: u32,
    last: vmm::process::Change,
) -> Vec<vmm::process::Changed> {
    let mut changes = Vec::new();
    let started = Instant::now();
    while !changes
        .iter()
        .any(|c: &vmm::process::Changed| c.change == last)
    {
        assert!(started.elapsed() < Duration::from_secs(60), "{changes:?}");
        for e in s
            .poll_processes(ex, Duration::from_secs(5), 1 << 20, None)
            .unwrap()
        {
            if let ProcessEvent::Watch { watcher, changed } = e {
                assert_eq!(watcher, w);
                changes.push(changed);
            }
        }
    }
    changes
}

#[test]
fn file_metadata_is_set_replaced_read_and_carried_by_watch_entries() {
    use std::collections::BTreeMap;
    use vmm::files::{FileError, FileKind, Files, Owner};
    use vmm::process::Change;
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    let t = Duration::from_secs(10);
    let meta = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    s.make_dir(&ex, "w", t).unwrap();
    let w = s
        .watch_dir(&ex, "w", false, true)
        .expect("watch with entries");
    let set = meta(&[("author", "ada"), ("n", "1")]);
    s.put_file_with_metadata(&ex, "w/m.txt", b"hello", Owner::User, &set, t)
        .unwrap();
    let st = s.stat_with_metadata(&ex, "w/m.txt", t).unwrap();
    assert_eq!(st.metadata.as_ref(), Some(&set));
    assert_eq!((st.size, st.owner.as_str()), (5, "user"));
    // The watcher's events carry the entry as the poll that takes them finds it.
    let seen = changes_until(&mut s, &ex, w, Change::Create);
    for c in &seen {
        let e = c.entry.as_ref().expect("an entry: the file is there");
        assert_eq!((c.path.as_str(), e.name.as_str()), ("m.txt", "m.txt"));
        assert_eq!(
            (e.kind, e.size, e.metadata.as_ref()),
            (FileKind::File, 5, Some(&set))
        );
    }
    assert_eq!(
        s.stat(&ex, "w/m.txt", t).unwrap().metadata,
        None,
        "not asked for"
    );
    let listed = s.list_dir_with_metadata(&ex, "w", t).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].metadata.as_ref(), Some(&set));
    // Code in the guest sees the attributes, and what it sets is read back.
    let r = s
        .exec(
            &ex,
            &Job::python(
                "import os\n\
                 print(os.getxattr('w/m.txt', 'user.e2b.author').decode())\n\
                 os.setxattr('w/m.txt', 'user.e2b.by', b'code')\n\
                 os.setxattr('w/m.txt', 'user.other', b'not metadata')",
            ),
            DEFAULT_INTERRUPT_GRACE,
            &mut |_, _| {},
        )
        .unwrap();
    assert_eq!((r.status, r.stdout.as_slice()), (Status::Ok, &b"ada\n"[..]));
    let st = s.stat_with_metadata(&ex, "w/m.txt", t).unwrap();
    assert_eq!(
        st.metadata,
        Some(meta(&[("author", "ada"), ("by", "code"), ("n", "1")]))
    );
    // A write with metadata replaces the set (over 2 chunks: set at the first); {} clears it.
    // (1 MiB is the size of one request's chunk.)
    let big = vec![b'x'; (1 << 20) + 10];
    s.put_file_with_metadata(&ex, "w/m.txt", &big, Owner::Root, &meta(&[("n", "2")]), t)
        .unwrap();
    let st = s.stat_with_metadata(&ex, "w/m.txt", t).unwrap();
    assert_eq!(
        (st.size as usize, st.metadata),
        (big.len(), Some(meta(&[("n", "2")])))
    );
    s.put_file_with_metadata(&ex, "w/m.txt", b"kept", Owner::Root, &BTreeMap::new(), t)
        .unwrap();
    let st = s.stat_with_metadata(&ex, "w/m.txt", t).unwrap();
    assert_eq!(st.metadata, Some(BTreeMap::new()));
    // A key the guest cannot store is refused, and the file is untouched.
    let nul = meta(&[("a\0b", "v")]);
    assert!(matches!(
        s.put_file_with_metadata(&ex, "w/m.txt", b"new", Owner::Root, &nul, t),
        Err(FileError::BadPath(_))
    ));
    assert_eq!(s.get_file(&ex, "w/m.txt", 1 << 10, t).unwrap(), b"kept");
    // A remove carries no entry; events taken after the file is gone carry none either.
    let r = s
        .exec(
            &ex,
            &Job::shell("chmod 600 w/m.txt && rm w/m.txt"),
            DEFAULT_INTERRUPT_GRACE,
            &mut |_, _| {},
        )
        .unwrap();
    assert_eq!(r.status, Status::Ok);
    let changes = changes_until(&mut s, &ex, w, Change::Remove);
    for c in &changes {
        assert_eq!((c.path.as_str(), &c.entry), ("m.txt", &None), "{changes:?}");
    }
    assert!(
        changes.iter().any(|c| c.change == Change::Chmod),
        "{changes:?}"
    );
    s.unwatch(&ex, w).unwrap();
    s.end(&ex);
}

#[test]
fn a_session_that_started_a_process_is_discarded_never_reset_for_reuse() {
    let ex = executor();
    let before = ex.stats();
    let quiet = Session::start(&ex).expect("session");
    quiet.end(&ex);
    let after_quiet = ex.stats();
    assert_eq!(
        after_quiet.resets,
        before.resets + 1,
        "a quiet session's VM is reset: {after_quiet:?}"
    );
    let mut s = Session::start(&ex).expect("session");
    s.start_process(&ex, &spec("sleep 1000")).expect("start");
    s.end(&ex);
    let after = ex.stats();
    assert_eq!(after.resets, after_quiet.resets, "not reset: {after:?}");
}

#[test]
fn a_large_tree_moved_under_a_recursive_watcher_is_reported_within_bounds() {
    use vmm::process::Change;
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    let mut make = Job::shell(
        "mkdir -p w big/sub && cd big/sub && i=0; \
         while [ $i -lt 1500 ]; do : > f$i; i=$((i+1)); done",
    );
    make.timeout = Duration::from_secs(60);
    let r = s
        .exec(&ex, &make, DEFAULT_INTERRUPT_GRACE, &mut |_, _| {})
        .unwrap();
    assert_eq!(
        r.status,
        Status::Ok,
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    let w = s.watch_dir(&ex, "w", true, false).expect("watch");
    let r = s
        .exec(
            &ex,
            &Job::shell("mv big w/big"),
            DEFAULT_INTERRUPT_GRACE,
            &mut |_, _| {},
        )
        .unwrap();
    assert_eq!(r.status, Status::Ok);
    // The tree is adopted with at most 1000 of its entries reported; every poll answers.
    let mut created = 0;
    for _ in 0..3 {
        for e in s
            .poll_processes(&ex, Duration::from_secs(2), 16 << 10, None)
            .unwrap()
        {
            if matches!(e, ProcessEvent::Watch { changed, .. } if changed.change == Change::Create)
            {
                created += 1;
            }
        }
    }
    assert!((1..=1001).contains(&created), "{created} creates");
    s.unwatch(&ex, w).unwrap();
    assert!(s.usable());
    s.end(&ex);
}

#[test]
fn a_kernel_runs_cells_over_its_stdin_and_ends_each_with_a_frame() {
    // A code context's kernel (bud_kernel) as the server drives it: cells as lines on its
    // stdin, each ending with a frame behind the mark the cell's line gave. The python
    // template holds no kernel (its recipe asks for none), so this one starts fresh, after
    // a process started just before (the datascience template's is taken instead: tested
    // through E2B's SDK in server/tests/compat.rs).
    let ex = executor();
    let mut s = Session::start(&ex).expect("session");
    let kernel = ProcessSpec {
        script: "exec python3 -m bud_kernel".into(),
        stdin: true,
        ..ProcessSpec::default()
    };
    let sleeper = s.start_process(&ex, &spec("sleep 60")).expect("sleep");
    let pid = s.start_process(&ex, &kernel).expect("kernel");
    assert!(pid > sleeper, "a kernel ({pid}) older than {sleeper}");

    let mark = "\u{1e}test-mark ";
    let mut seen = Seen::default();
    let cell = |s: &mut Session, seen: &mut Seen, seq: u32, code: &str| {
        let line = serde_json::json!({
            "seq": seq, "code": code, "env": {"K": "v"}, "mark": mark, "cwd": "/home/user",
        });
        let data = (line.to_string() + "\n").into_bytes();
        let n = data.len();
        assert_eq!(s.process_stdin(&ex, pid, data, false).expect("stdin"), n);
        let t = Instant::now();
        loop {
            let err = String::from_utf8_lossy(&seen.out.get(&pid).map_or(vec![], |p| p.1.clone()))
                .into_owned();
            if let Some(at) = err.rfind(mark) {
                if err.ends_with('\n') && at + mark.len() < err.len() {
                    let frame: serde_json::Value =
                        serde_json::from_str(&err[at + mark.len()..]).expect("a frame");
                    seen.out.get_mut(&pid).unwrap().1.clear();
                    return (err[..at].to_owned(), frame);
                }
            }
            assert!(t.elapsed() < Duration::from_secs(120), "no frame: {seen:?}");
            let ev = s
                .poll_processes(&ex, Duration::from_secs(5), 1 << 20, None)
                .expect("poll");
            seen.take(ev);
        }
    };
    let (err, frame) = cell(
        &mut s,
        &mut seen,
        1,
        "import os\nprint('out', os.environ['K'])\nos.getcwd()",
    );
    assert_eq!(err, "");
    assert_eq!(frame["seq"], 1);
    assert_eq!(frame["count"], 1);
    assert_eq!(frame["outcome"], 1);
    assert_eq!(frame["status"], 0);
    assert_eq!(
        frame["display"]["value"][0],
        serde_json::json!({"type": "text/plain", "data": "'/home/user'"})
    );
    assert_eq!(seen.stdout(pid), "out v\n");
    // Its stdin is not the cell's; an exception comes back in the frame.
    let (_, frame) = cell(&mut s, &mut seen, 2, "input()");
    assert_eq!(frame["count"], 2);
    assert_eq!(frame["status"], 1);
    assert_eq!(frame["display"]["error"]["name"], "EOFError");
    s.end(&ex);
}
