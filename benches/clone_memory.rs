//! Memory a clone adds to the process: private (copy-on-write) pages after restore and after a
//! trivial job, measured from /proc/self/smaps_rollup with N clones alive at once. Reported,
//! not asserted. The template's memory file is fsynced when written, so its pages are clean
//! page cache here and only a clone's own writes count as Private_Dirty. Memory KVM keeps in
//! the kernel for a VM (shadow or EPT page tables, vCPU state) is not in these numbers.

mod common;

use vmm::Job;

const CLONES: usize = 20;

fn smaps_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .expect("smaps_rollup")
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this as a test: skip then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let template = common::template();
    let kvm = vmm::vm::open_kvm().expect("/dev/kvm");
    let job = Job::python("print(1+1)");

    let base = smaps_kib("Private_Dirty:");
    let mut restored = Vec::new();
    for _ in 0..CLONES {
        restored.push(template.clone_machine(&kvm).expect("clone"));
    }
    let after_restore = smaps_kib("Private_Dirty:");
    drop(restored);

    let base_job = smaps_kib("Private_Dirty:");
    let mut ran = Vec::new();
    for _ in 0..CLONES {
        let mut m = template.clone_machine(&kvm).expect("clone");
        let (r, _) = vmm::job::run(&mut m, template.state(), &job, &mut |_, _| {}).expect("run");
        assert_eq!(r.stdout, b"2\n");
        ran.push(m);
    }
    let after_job = smaps_kib("Private_Dirty:");

    let per = |a: u64, b: u64| (a.saturating_sub(b)) as f64 / CLONES as f64;
    println!(
        "private memory per clone ({CLONES} clones alive, /proc/self/smaps_rollup Private_Dirty):"
    );
    println!(
        "  after restore:           {:8.1} KiB",
        per(after_restore, base)
    );
    println!(
        "  after print(1+1):        {:8.1} KiB",
        per(after_job, base_job)
    );
}
