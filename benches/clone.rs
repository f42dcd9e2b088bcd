//! Start-up latency of bud's clones: restore alone, restore + a trivial Python or shell job,
//! a job printing 1 MiB, and parallel throughput. Each iteration makes a fresh clone from the
//! template; closing it happens on the reaper thread or after the timed part.

mod common;

use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use vmm::{Executor, Job, Status};

fn benches(c: &mut Criterion) {
    let template = common::template();
    let kvm = vmm::vm::open_kvm().expect("/dev/kvm");

    let mut g = c.benchmark_group("clone");
    g.sample_size(50).measurement_time(Duration::from_secs(10));
    g.bench_function("restore", |b| {
        b.iter_batched(
            || (),
            |()| template.clone_machine(&kvm).expect("clone"),
            BatchSize::PerIteration,
        )
    });
    g.finish();

    let exec = Executor::new(template, 0).expect("executor");
    let mut g = c.benchmark_group("job");
    g.sample_size(30).measurement_time(Duration::from_secs(10));
    let run_ok = |j: &Job| {
        let r = exec.run(j).expect("run");
        assert_eq!(r.status, Status::Ok, "{r:?}");
        r
    };
    let print = Job::python("print(1+1)");
    g.bench_function("clone+python print(1+1)", |b| b.iter(|| run_ok(&print)));
    let echo = Job::shell("echo hi");
    g.bench_function("clone+shell echo hi", |b| b.iter(|| run_ok(&echo)));
    g.throughput(Throughput::Bytes(1 << 20));
    let mib = Job::python("import sys; sys.stdout.write('x' * (1 << 20))");
    g.bench_function("clone+python print 1 MiB", |b| b.iter(|| run_ok(&mib)));
    g.finish();

    let mut g = c.benchmark_group("parallel");
    g.sample_size(10).measurement_time(Duration::from_secs(15));
    const JOBS: usize = 16;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    g.throughput(Throughput::Elements(JOBS as u64));
    g.bench_function(
        format!("{JOBS} print(1+1) jobs on {threads} threads"),
        |b| {
            b.iter(|| {
                std::thread::scope(|s| {
                    for t in 0..threads {
                        let exec = &exec;
                        s.spawn(move || {
                            for _ in (t..JOBS).step_by(threads) {
                                let r = exec.run(&Job::python("print(1+1)")).expect("run");
                                assert_eq!(r.status, Status::Ok);
                            }
                        });
                    }
                })
            })
        },
    );
    g.finish();
}

criterion_group!(bud, benches);
criterion_main!(bud);
