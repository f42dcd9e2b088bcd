//! Sessions in the library (no HTTP): a cell round trip (`x += 1`) in a live session, a
//! session started, used once and ended, and forks into 8 children of a session holding
//! 32 MiB of Python data (the first fork's cost, which includes freezing the data into a
//! layer, is printed; the measured ones have nothing new to freeze). Children are dropped
//! (closed) outside the measurement. `scripts/bench-sessions.sh` measures over HTTP, with
//! 100 MiB.

mod common;

use std::time::Duration;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use vmm::session::{DEFAULT_INTERRUPT_GRACE, Session};
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
    let mut g = c.benchmark_group("session");
    g.sample_size(30).measurement_time(Duration::from_secs(10));

    let mut s = Session::start(&ex).expect("session");
    cell(&mut s, &ex, "x = 0");
    g.bench_function("cell x += 1", |b| b.iter(|| cell(&mut s, &ex, "x += 1")));
    s.end(&ex);

    g.bench_function("start, one cell, end", |b| {
        b.iter(|| {
            let mut s = Session::start(&ex).expect("session");
            cell(&mut s, &ex, "y = 1");
            s.end(&ex);
        })
    });

    let mut source = Session::start(&ex).expect("session");
    cell(
        &mut source,
        &ex,
        "import random\ndata = [random.randbytes(8 << 20) for _ in range(4)]",
    );
    // The first fork freezes the 32 MiB (and whatever else the session wrote) into a layer;
    // its cost is printed. The measured forks find no new page to freeze: they measure the
    // pause and the children alone.
    let (kids, first) = source.fork(&ex, 8).expect("fork");
    eprintln!("[session] first fork of the 32 MiB session: {first:?}");
    for k in kids {
        k.end(&ex);
    }
    g.sample_size(10);
    g.bench_function("fork x8, nothing new to freeze", |b| {
        b.iter_batched(
            || (),
            |()| source.fork(&ex, 8).expect("fork").0,
            BatchSize::PerIteration,
        )
    });
    g.finish();
    source.end(&ex);
}

criterion_group!(bud, benches);
criterion_main!(bud);
