//! Start-up latency of bud's VMs: a clone's restore alone; a trivial Python or shell job and a
//! job printing 1 MiB, each on a warm VM reset in place after every job (`job/...`, bud's
//! default) and on a fresh clone per job (`job-fresh/...`); parallel throughput of both.
//! Closing discarded VMs happens on the reaper thread, resets after the job's result.

mod common;

use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use vmm::{Executor, ExecutorOptions, Job, Reuse, Status};

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

    drop(template);
    for (group, reuse) in [("job", Reuse::Warm), ("job-fresh", Reuse::Fresh)] {
        let opts = ExecutorOptions {
            pool_size: 0,
            reuse,
            ..ExecutorOptions::default()
        };
        let exec = Executor::new(common::template(), opts).expect("executor");
        let mut g = c.benchmark_group(group);
        g.sample_size(30).measurement_time(Duration::from_secs(10));
        let run_ok = |j: &Job| {
            let r = exec.run(j).expect("run");
            assert_eq!(r.status, Status::Ok, "{r:?}");
            r
        };
        let print = Job::python("print(1+1)");
        g.bench_function("python print(1+1)", |b| b.iter(|| run_ok(&print)));
        let echo = Job::shell("echo hi");
        g.bench_function("shell echo hi", |b| b.iter(|| run_ok(&echo)));
        g.throughput(Throughput::Bytes(1 << 20));
        let mib = Job::python("import sys; sys.stdout.write('x' * (1 << 20))");
        g.bench_function("python print 1 MiB", |b| b.iter(|| run_ok(&mib)));
        g.finish();
        let st = exec.stats();
        eprintln!(
            "[{group}] resets {}, mean reset {:.3} ms, mean pages restored {:.0}, replaced {}",
            st.resets,
            st.reset_time.as_secs_f64() * 1e3 / st.resets.max(1) as f64,
            st.restored_pages as f64 / st.resets.max(1) as f64,
            st.replaced_abnormal + st.replaced_too_dirty + st.replaced_reset_failed
        );
    }
    let exec = Executor::new(common::template(), ExecutorOptions::default()).expect("executor");

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
