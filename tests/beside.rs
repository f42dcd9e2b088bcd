//! Requests beside a running cell (`vmm::beside`), on the real VMM and guest: file and
//! process operations handed to a session's lane from other threads while its cell runs.
//! Every test makes the cell *wait for* what the lane does (a file it writes, a process it
//! starts), so a lane that only ran after the cell would hang the cell into its timeout
//! and fail the test. Needs /dev/kvm. (Through HTTP and E2B's SDK:
//! `server/tests/beside.rs`.)

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use vmm::beside::{Beside, BesideError};
use vmm::files::{FileError, Files};
use vmm::process::{ProcessEvent, ProcessSpec, Processes};
use vmm::session::{DEFAULT_INTERRUPT_GRACE, Session, SessionError};
use vmm::{Executor, Job, JobResult, Status};

const T: Duration = Duration::from_secs(20);

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `code` as a cell of `s` on a thread of its own, with a 60 s timeout; the flag is
/// set when it has ended.
fn cell_in_background(
    s: Session,
    ex: Arc<Executor>,
    code: &str,
) -> (thread::JoinHandle<(Session, JobResult)>, Arc<AtomicBool>) {
    let ended = Arc::new(AtomicBool::new(false));
    let flag = ended.clone();
    let mut job = Job::python(code);
    job.timeout = Duration::from_secs(60);
    let h = thread::spawn(move || {
        let mut s = s;
        let r = s
            .exec(&ex, &job, DEFAULT_INTERRUPT_GRACE, &mut |_, _| {})
            .expect("the cell could not run");
        flag.store(true, Ordering::SeqCst);
        (s, r)
    });
    (h, ended)
}

/// Waits until the cell has started (its lane is open for process operations).
fn wait_open(lane: &Beside) {
    for _ in 0..2000 {
        if lane.open_for(true) {
            return;
        }
        thread::sleep(Duration::from_millis(5));
    }
    panic!("the cell never started");
}

#[test]
fn file_operations_run_beside_a_cell_that_waits_for_them() {
    let ex = Arc::new(common::verifying_executor());
    let s = Session::start(&ex).unwrap();
    let mut lane = s.beside();
    // Nothing runs: the lane refuses, and the caller runs the request on the VM itself.
    match lane.stat(&ex, ".", T) {
        Err(FileError::Session(SessionError::Beside(BesideError::NotOpen))) => {}
        other => panic!("a lane with nothing running answered {other:?}"),
    }
    let code = "import os, time\n\
                while not (os.path.exists('go') and os.path.getsize('go')):\n    \
                time.sleep(0.02)\n\
                print('cell saw', open('go').read())";
    let (cell, ended) = cell_in_background(s, ex.clone(), code);
    wait_open(&lane);

    lane.put_file(&ex, "dir/data.txt", b"beside\n", T).unwrap();
    assert_eq!(
        lane.get_file(&ex, "dir/data.txt", 1 << 20, T).unwrap(),
        b"beside\n"
    );
    let names: Vec<String> = lane
        .list_dir(&ex, "dir", T)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["data.txt"]);
    // Over the caller's cap: refused, and the cell goes on.
    lane.put_file(&ex, "big", &vec![b'x'; 300_000], T).unwrap();
    match lane.get_file(&ex, "big", 1000, T) {
        Err(FileError::TooLarge { limit: 1000, .. }) => {}
        other => panic!("a read over its cap answered {other:?}"),
    }
    assert!(
        !ended.load(Ordering::SeqCst),
        "the cell ended before the lane's work"
    );
    lane.put_file(&ex, "go", b"now", T).unwrap();

    let (mut s, r) = cell.join().unwrap();
    assert_eq!(r.status, Status::Ok, "{}", text(&r.stderr));
    assert_eq!(text(&r.stdout), "cell saw now\n");
    // The session goes on, and sees what the lane wrote.
    assert_eq!(
        s.get_file(&ex, "dir/data.txt", 1 << 20, T).unwrap(),
        b"beside\n"
    );
    s.end(&ex);
}

#[test]
fn a_process_starts_runs_and_ends_beside_a_cell() {
    let ex = Arc::new(common::verifying_executor());
    let s = Session::start(&ex).unwrap();
    let mut lane = s.beside();
    // The cell waits for the process's file and for the test's, written once the
    // process's end was polled.
    let code = "import os, time\n\
                while not os.path.exists('polled'):\n    time.sleep(0.02)\n\
                print('cell saw', open('from-process').read().strip())";
    let (cell, ended) = cell_in_background(s, ex.clone(), code);
    wait_open(&lane);

    let spec = ProcessSpec {
        script: "read line; echo \"got $line\"; echo made > from-process; exit 3".into(),
        env: vec![],
        cwd: None,
        stdin: true,
        pty: None,
        user: None,
    };
    let pid = lane.start_process(&ex, &spec).unwrap();
    assert_eq!(
        lane.process_stdin(&ex, pid, b"hello\n".to_vec(), true)
            .unwrap(),
        6
    );
    let mut out = Vec::new();
    let mut exit = None;
    for _ in 0..200 {
        for e in lane
            .poll_processes(&ex, Duration::from_secs(2), 1 << 20, None)
            .unwrap()
        {
            match e {
                ProcessEvent::Output { pid: p, data, .. } if p == pid => out.extend(data),
                ProcessEvent::Exit {
                    pid: p, exit_code, ..
                } if p == pid => exit = exit_code,
                _ => {}
            }
        }
        if exit.is_some() {
            break;
        }
    }
    assert_eq!(text(&out), "got hello\n");
    assert_eq!(exit, Some(3));
    assert!(
        !ended.load(Ordering::SeqCst),
        "the cell ended before the lane's work"
    );
    lane.put_file(&ex, "polled", b"", T).unwrap();
    let (s, r) = cell.join().unwrap();
    assert_eq!(r.status, Status::Ok, "{}", text(&r.stderr));
    assert_eq!(text(&r.stdout), "cell saw made\n");
    s.end(&ex);
}

#[test]
fn many_threads_share_the_lane_and_a_cells_end_sends_the_rest_back() {
    let ex = Arc::new(common::verifying_executor());
    let s = Session::start(&ex).unwrap();
    let lane = s.beside();
    // The cell ends once 8 files exist; 8 threads write one each, then keep reading until
    // the lane closes: every request is answered (a value, or NotOpen to run it on the VM).
    let code = "import os, time\n\
                while len([n for n in os.listdir('.') if n.startswith('f')]) < 8:\n    \
                time.sleep(0.02)\n\
                print('eight')";
    let (cell, _) = cell_in_background(s, ex.clone(), code);
    wait_open(&lane);
    let start = Arc::new(Barrier::new(8));
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let (mut lane, ex, start) = (lane.clone(), ex.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                let name = format!("f{i}");
                lane.put_file(&ex, &name, name.as_bytes(), T).unwrap();
                let mut reads = 0;
                loop {
                    match lane.get_file(&ex, &name, 64, T) {
                        Ok(b) => {
                            assert_eq!(b, name.as_bytes());
                            reads += 1;
                        }
                        Err(FileError::Session(SessionError::Beside(BesideError::NotOpen))) => {
                            return reads;
                        }
                        Err(e) => panic!("{name}: {e}"),
                    }
                }
            })
        })
        .collect();
    let (mut s, r) = cell.join().unwrap();
    assert_eq!(
        text(&r.stdout),
        "eight\n",
        "{:?}: {}",
        r.status,
        text(&r.stderr)
    );
    for w in workers {
        w.join().unwrap();
    }
    // After all that, the session is as usable as before.
    let again = s
        .exec(
            &ex,
            &Job::python("print(sorted(os.listdir('.'))[:2])"),
            DEFAULT_INTERRUPT_GRACE,
            &mut |_, _| {},
        )
        .unwrap();
    assert_eq!(
        text(&again.stdout),
        "['f0', 'f1']\n",
        "{}",
        text(&again.stderr)
    );
    s.end(&ex);
}

/// A poll beside a cell waits for its processes; a request handed to the lane meanwhile
/// ends that wait and is answered.
#[test]
fn a_request_ends_the_wait_of_a_poll_beside_a_cell() {
    let ex = Arc::new(common::verifying_executor());
    let s = Session::start(&ex).unwrap();
    let mut lane = s.beside();
    let code = "import os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.02)\n";
    let (cell, _) = cell_in_background(s, ex.clone(), code);
    wait_open(&lane);
    let spec = ProcessSpec {
        script: "sleep 600".into(),
        env: vec![],
        cwd: None,
        stdin: false,
        pty: None,
        user: None,
    };
    lane.start_process(&ex, &spec).unwrap();
    for round in 0..5 {
        let (mut poller, ex2) = (lane.clone(), ex.clone());
        let poll = thread::spawn(move || {
            poller.poll_processes(&ex2, Duration::from_secs(60), 1 << 20, None)
        });
        // A request sent before the poll runs first, and the poll then waits: requests go
        // on until one has ended the poll's wait (without that, the cell's own timeout
        // would end the lane and fail the next request).
        thread::sleep(Duration::from_millis(20 * round));
        while !poll.is_finished() {
            let entry = lane.stat(&ex, ".", T).unwrap();
            assert_eq!(entry.kind, vmm::files::FileKind::Dir, "round {round}");
        }
        assert_eq!(poll.join().unwrap().unwrap(), vec![], "round {round}");
    }
    lane.put_file(&ex, "go", b"", T).unwrap();
    let (s, r) = cell.join().unwrap();
    assert_eq!(r.status, Status::Ok, "{}", text(&r.stderr));
    s.end(&ex);
}
