//! Sessions to disk and back, in the library (no HTTP), by how much memory the session
//! holds of its own (a new session, 10 MiB and 100 MiB of Python data): a save (the pages,
//! their checksum, `fsync`, rename: what a pause or a snapshot writes), a load (read and
//! check the file's header, map its pages over a clone, restore the vCPU: what a resume or
//! a start from a snapshot costs before the guest runs), the first cell after a load (which
//! reads back, through page faults, what it touches), and the full check of a file's pages.
//! Loaded sessions are ended outside the measurement. Figures: docs/measurements.md.

mod common;

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use vmm::session::{DEFAULT_INTERRUPT_GRACE, Session};
use vmm::session_file::{self, SessionKeys};
use vmm::{Executor, ExecutorOptions, Job, Status};

fn cell(s: &mut Session, ex: &Executor, code: &str) {
    let mut j = Job::python(code);
    j.timeout = Duration::from_secs(60);
    let r = s
        .exec(ex, &j, DEFAULT_INTERRUPT_GRACE, &mut |_, _| {})
        .expect("cell");
    assert_eq!(r.status, Status::Ok, "{r:?}");
}

fn benches(c: &mut Criterion) {
    let ex = Executor::new(common::template(), ExecutorOptions::default()).expect("executor");
    let dir = common::source_dir().join("target/tmp/bench-durable");
    std::fs::create_dir_all(&dir).expect("bench folder");
    let keys = SessionKeys::generate().expect("a key");
    let mut g = c.benchmark_group("durable");
    g.sample_size(10).measurement_time(Duration::from_secs(10));

    for mib in [0usize, 10, 100] {
        let mut s = Session::start(&ex).expect("session");
        cell(
            &mut s,
            &ex,
            // One MiB of random bytes repeated: the copy is user-space work in the guest.
            &format!("import random\ndata = random.randbytes(1 << 20) * {mib}\nx = 1"),
        );
        let path = dir.join(format!("{mib}.bud"));
        let w = s.save(&ex, &path, Vec::new(), &keys).expect("save");
        eprintln!("[durable] {mib} MiB session: first save {w:?}");
        g.bench_function(format!("save, {mib} MiB"), |b| {
            b.iter(|| s.save(&ex, &path, Vec::new(), &keys).expect("save"))
        });
        s.end(&ex);

        g.bench_function(format!("load, {mib} MiB"), |b| {
            b.iter_custom(|n| {
                let mut spent = Duration::ZERO;
                for _ in 0..n {
                    let t = Instant::now();
                    let f = session_file::read(&path, &keys).expect("read");
                    let s = Session::load(&ex, &f, false).expect("load");
                    spent += t.elapsed();
                    s.end(&ex);
                }
                spent
            })
        });
        g.bench_function(format!("load and a first cell, {mib} MiB"), |b| {
            b.iter_custom(|n| {
                let mut spent = Duration::ZERO;
                for _ in 0..n {
                    let t = Instant::now();
                    let f = session_file::read(&path, &keys).expect("read");
                    let mut s = Session::load(&ex, &f, false).expect("load");
                    cell(&mut s, &ex, "x += 1");
                    spent += t.elapsed();
                    s.end(&ex);
                }
                spent
            })
        });
        g.bench_function(format!("check every page, {mib} MiB"), |b| {
            let f = session_file::read(&path, &keys).expect("read");
            b.iter(|| f.verify_pages().expect("verify"))
        });
    }
    g.finish();
}

criterion_group!(bud, benches);
criterion_main!(bud);
