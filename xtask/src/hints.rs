//! The order of the queue: what each test binary costs and whether it needs the guest.
//!
//! The figures are seconds from a clean-clone run on the development machine (2 cores,
//! kvm_pvm; docs/testing.md), with the guest already built, except where a binary builds
//! something only it uses (a template, cargo-fuzz). They only order the queue: every binary
//! runs whether it is listed or not, and one not listed counts as [`UNLISTED`].
//!
//! The first job is the costliest one that needs the guest, so the shared first-use build
//! (kernel, image, `python` template: minutes, under `build/build.lock`) starts at once; the
//! jobs that need no guest come next and fill the other lanes while it builds; then the
//! rest, longest first, so no lane is left with a long job at the end.

use crate::suite::Job;

/// What a binary is expected to cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hint {
    pub seconds: u32,
    /// Whether it waits for the guest build (kernel, image, a template).
    pub guest: bool,
}

/// A binary the table does not name: short, and needing the guest to be safe.
pub const UNLISTED: Hint = Hint {
    seconds: 30,
    guest: true,
};

/// (source path, seconds, needs the guest).
const HINTS: &[(&str, u32, bool)] = &[
    // Builds the datascience image and boots it the first time.
    ("server/tests/compat.rs", 560, true),
    // A first-level VM under QEMU's TCG (installs QEMU on first use).
    ("tests/hwvirt.rs", 235, true),
    // Installs cargo-fuzz, builds the instrumented targets, fuzzes each 5 s.
    ("tests/fuzz.rs", 230, false),
    // Builds the tools template.
    ("server/tests/templates.rs", 180, true),
    ("tests/reset.rs", 150, true),
    ("tests/session.rs", 110, true),
    ("tests/stress.rs", 75, true),
    ("tests/guest_boot.rs", 70, true),
    ("server/tests/processes.rs", 50, true),
    ("tests/beside.rs", 45, true),
    ("tests/cluster.rs", 37, true),
    ("tests/processes.rs", 37, true),
    ("tests/jobs.rs", 27, true),
    // Three memory bombs and a job just under the cap (369 s under load, session 21).
    ("tests/memory_cap.rs", 240, true),
    ("server/tests/sessions.rs", 23, true),
    ("tests/deploy.rs", 21, true),
    // Its pipeline tests build the guest (ensure) and rebuild the image elsewhere.
    ("guest/src/lib.rs", 70, true),
    ("server/tests/beside.rs", 12, true),
    ("server/tests/durable.rs", 11, true),
    ("guest/pyext/tests/host_jobs.rs", 11, true),
    ("server/tests/session_leaks.rs", 5, true),
    ("server/tests/http.rs", 3, true),
    ("tests/session_file.rs", 3, true),
    ("tests/durable_crash.rs", 3, true),
    ("server/tests/cancel.rs", 2, true),
    ("server/tests/drain.rs", 2, true),
    ("server/tests/import_hostile.rs", 2, true),
    ("server/tests/audit.rs", 1, true),
    ("server/tests/hostile.rs", 8, true),
    ("tests/jail.rs", 2, true),
    ("tests/audit_cli.rs", 1, false),
    ("server/tests/layers.rs", 1, false),
    ("server/src/lib.rs", 2, false),
    ("vmm/src/lib.rs", 2, false),
    ("guest/agent/src/main.rs", 1, false),
    ("guest/pyext/src/lib.rs", 1, false),
    ("guest/pyext/tests/host_python.rs", 1, false),
    ("templates/src/lib.rs", 1, false),
    ("vmm/tests/snapshot_restore.rs", 1, false),
    ("vmm/tests/vcpu_pio.rs", 1, false),
    ("xtask/src/main.rs", 1, false),
    ("src/main.rs", 1, false),
    ("doc tests", 30, false),
];

/// The hint for the job labelled `label`.
pub fn hint(label: &str) -> Hint {
    HINTS
        .iter()
        .find(|(l, _, _)| *l == label)
        .map_or(UNLISTED, |&(_, seconds, guest)| Hint { seconds, guest })
}

/// `jobs` in the order the lanes take them (see the module's doc).
pub fn order(mut jobs: Vec<Job>) -> Vec<Job> {
    // Longest first; the label breaks ties so the order is the same every run.
    jobs.sort_by(|a, b| {
        hint(&b.label)
            .seconds
            .cmp(&hint(&a.label).seconds)
            .then_with(|| a.label.cmp(&b.label))
    });
    let first_guest = jobs.iter().position(|j| hint(&j.label).guest);
    let mut ordered = Vec::with_capacity(jobs.len());
    if let Some(at) = first_guest {
        ordered.push(jobs.remove(at));
    }
    let (plain, guest): (Vec<Job>, Vec<Job>) =
        jobs.into_iter().partition(|j| !hint(&j.label).guest);
    ordered.extend(plain);
    ordered.extend(guest);
    ordered
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(label: &str) -> Job {
        Job {
            label: label.into(),
            program: label.into(),
            args: vec![],
            dir: "/w".into(),
            rerun: String::new(),
        }
    }

    fn labels(jobs: &[Job]) -> Vec<&str> {
        jobs.iter().map(|j| j.label.as_str()).collect()
    }

    #[test]
    fn the_costliest_guest_job_leads_then_the_guestless_then_the_rest_longest_first() {
        let jobs = [
            "tests/audit_cli.rs",
            "tests/reset.rs",
            "tests/new.rs",
            "tests/fuzz.rs",
        ]
        .map(job)
        .to_vec();
        assert_eq!(
            labels(&order(jobs)),
            [
                "tests/reset.rs",
                "tests/fuzz.rs",
                "tests/audit_cli.rs",
                "tests/new.rs"
            ]
        );
    }

    #[test]
    fn without_guest_jobs_it_is_longest_first() {
        let jobs = ["tests/audit_cli.rs", "tests/fuzz.rs"].map(job).to_vec();
        assert_eq!(
            labels(&order(jobs)),
            ["tests/fuzz.rs", "tests/audit_cli.rs"]
        );
    }

    #[test]
    fn an_unlisted_binary_is_short_and_needs_the_guest() {
        assert_eq!(hint("tests/not_yet_written.rs"), UNLISTED);
        assert_eq!(
            hint("tests/fuzz.rs"),
            Hint {
                seconds: 230,
                guest: false
            }
        );
    }
}
