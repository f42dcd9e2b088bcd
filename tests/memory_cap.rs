//! The memory cap on the real guest (vmm's `memory_cap`): runaway memory ends as
//! `memory_limit`, a job just under the cap runs to its end. Needs /dev/kvm.
//!
//! Its own binary, not part of `tests/jobs.rs`: each bomb keeps the guest's vCPU busy for a
//! minute or more on kvm_pvm (filling the guest at the speed of fresh pages), which starved
//! the 10 s jobs running beside it in that binary on a loaded 2-core machine.

mod common;

use std::time::Duration;

use common::*;
use vmm::{Job, JobResult, Status};

fn run(job: &Job) -> JobResult {
    executor().run(job).expect("bud could not run the job")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Memory bombs fill the guest at the speed of fresh pages (4 KiB faults of the malloc heap,
/// emulated on kvm_pvm): minutes under load, never a time asserted here.
const MEMORY_BOMB_TIMEOUT: Duration = Duration::from_secs(600);

#[test]
fn a_loop_appending_1_mib_buffers_ends_as_memory_limit() {
    let mut j = Job::python("a = []\nwhile True:\n    a.append(bytearray(1 << 20))");
    j.timeout = MEMORY_BOMB_TIMEOUT;

    let r = run(&j);
    let next = run(&Job::python("print('still here')"));

    assert_eq!(r.status, Status::MemoryLimit, "{r:?}");
    assert_eq!(text(&next.stdout), "still here\n", "{next:?}");
}

#[test]
fn unbounded_recursion_with_a_raised_limit_ends_as_memory_limit() {
    let mut j = Job::python(
        "import sys\nsys.setrecursionlimit(10**9)\ndef f(n):\n    return f(n + 1)\nf(0)",
    );
    j.timeout = MEMORY_BOMB_TIMEOUT;

    let r = run(&j);

    assert_eq!(r.status, Status::MemoryLimit, "{r:?}");
}

/// The cap is the guest kernel's low watermark (vmm's `memory_cap`): a job that keeps 16 MiB
/// of the guest's free memory above it (read from /proc in the guest) runs to its end.
#[test]
fn a_job_just_under_the_memory_cap_succeeds() {
    let mut j = Job::python(
        "import re\n\
         free_kb = int(re.search(r'MemFree:\\s+(\\d+)', open('/proc/meminfo').read()).group(1))\n\
         low_kb = 4 * sum(int(x) for x in re.findall(r'\\n\\s+low\\s+(\\d+)', open('/proc/zoneinfo').read()))\n\
         n = (free_kb - low_kb) // 1024 - 16\n\
         a = [bytearray(1 << 20) for _ in range(n)]\n\
         print('held', len(a) > 100)",
    );
    j.timeout = MEMORY_BOMB_TIMEOUT;

    let r = run(&j);

    assert_eq!(r.status, Status::Ok, "{}", text(&r.stderr));
    assert_eq!(text(&r.stdout), "held True\n");
}
