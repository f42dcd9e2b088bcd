//! The order of the queue and what each job waits for.
//!
//! The suite's first-use builds are jobs of their own ([`GUEST`], then one per template:
//! `bud guest build [--template NAME --boot]`), so the lanes can see the chain every guest
//! test waits on: the kernel (both cores, minutes), then the `python` template's first boot,
//! then the `datascience` and `tools` templates' (one emulated vCPU each, minutes). A job
//! waits until every build job it needs has ended (it builds nothing itself then, only finds
//! the result; a build that failed leaves its dependants to fail loudly on their own); a
//! lane takes the first job of the queue that has nothing left to wait for.
//!
//! The queue: the build jobs first, in chain order; then every test binary, longest first
//! (so no lane is left with a long job at the end). So while the kernel builds, the other
//! lane runs the binaries that need no guest; while one template boots on one core, the
//! other lane boots the next or runs tests that need only what is built.
//!
//! Only what needs the `datascience` template waits for it, the longest build of the chain:
//! `compat_figures.rs` (E2B's charts, frames and the warm kernel) and
//! `templates_datascience.rs`. `compat.rs` (every other client, on `python`) waits for
//! `python`, and `templates.rs` (the registry, the `tools` template) for `tools`.
//!
//! The seconds are each job's from a clean-clone run in two lanes on the development machine
//! (2 cores, kvm_pvm, 2026-11-28; docs/measurements.md, session 22), each beside whatever
//! the other lane ran; those of the four binaries split from `compat.rs` and `templates.rs`
//! on 2026-12-07 are each run alone with one test thread, its templates built, the other
//! core busy with other work. They only order the queue: every binary runs whether it is
//! listed or not, and one not listed counts as [`UNLISTED`]. The run has two bounds: the
//! machine's two cores (docs/measurements.md, session 23: nothing idles), so the sum of these
//! seconds over two lanes; and the chain of builds with what waits for its last one.

use crate::suite::Job;

/// The build job of the guest kernel and the `python` image.
pub const GUEST: &str = "build: guest";
/// The build job that brings up the `python` template (booted and saved).
pub const PYTHON: &str = "build: template python";
/// The build job of the `datascience` template (its image, first boot and snapshot).
pub const DATASCIENCE: &str = "build: template datascience";
/// The build job of the `tools` template.
pub const TOOLS: &str = "build: template tools";
/// The build job of the `node` template (Node.js, the JavaScript kernel warm in it).
pub const NODE: &str = "build: template node";
/// The build jobs, in the order of the chain; each needs the ones before it that it names.
pub const BUILDS: [(&str, Option<&str>); 5] = [
    (GUEST, None),
    (PYTHON, Some("python")),
    (DATASCIENCE, Some("datascience")),
    (TOOLS, Some("tools")),
    (NODE, Some("node")),
];

/// Whether `label` is one of the build jobs ([`BUILDS`]).
pub fn is_build(label: &str) -> bool {
    rank(label) < BUILDS.len()
}

/// What a job is expected to cost and what it waits for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hint {
    pub seconds: u32,
    /// The build jobs it waits for (those in the run: a pick of binaries runs no build job,
    /// and each binary then builds what it needs itself, as `cargo test` would).
    pub needs: &'static [&'static str],
}

const NONE: &[&str] = &[];
const ON_GUEST: &[&str] = &[GUEST];
const ON_PYTHON: &[&str] = &[GUEST, PYTHON];
const ON_DATASCIENCE: &[&str] = &[GUEST, PYTHON, DATASCIENCE];
const ON_TOOLS: &[&str] = &[GUEST, PYTHON, TOOLS];
const ON_NODE: &[&str] = &[GUEST, PYTHON, NODE];

/// A binary the table does not name: short, and needing the `python` template to be safe.
pub const UNLISTED: Hint = Hint {
    seconds: 30,
    needs: ON_PYTHON,
};

/// (job, seconds, the build jobs it waits for).
const HINTS: &[(&str, u32, &[&str])] = &[
    (GUEST, 443, NONE),
    (PYTHON, 125, ON_GUEST),
    (DATASCIENCE, 537, ON_PYTHON),
    (TOOLS, 102, ON_PYTHON),
    // Its image (Node.js, ~120 MB) and a first boot that warms Node.js up.
    (NODE, 150, ON_PYTHON),
    ("server/tests/javascript.rs", 135, ON_NODE),
    // The clients on the `python` template; the first of the two compat binaries to run
    // makes their venv from PyPI (~16 s) under its lock, the other waits for it.
    ("server/tests/compat.rs", 122, ON_PYTHON),
    // E2B's figures, frames and charts: the only compat test on `datascience`.
    // Its sandbox's second code context starts a fresh kernel (numpy, pandas and matplotlib
    // imported in a new process under emulation): most of its time (265 s in session 30).
    ("server/tests/compat_figures.rs", 265, ON_DATASCIENCE),
    // A first-level VM under QEMU's TCG (installs QEMU on first use): one host thread.
    ("tests/hwvirt.rs", 194, ON_GUEST),
    // Builds the instrumented targets (one cargo job per lane), fuzzes each 5 s. It needs
    // no guest: it waits for the kernel build only so that the two do not share the cores
    // (the kernel build is the head of every guest test's chain; fuzz's build is nobody's).
    ("tests/fuzz.rs", 269, ON_GUEST),
    // The registry on `python` and the `tools` template's jobs (bash, git, curl).
    ("server/tests/templates.rs", 56, ON_TOOLS),
    // numpy in three processes side by side (~43 s), the rest in seconds.
    ("server/tests/templates_datascience.rs", 112, ON_DATASCIENCE),
    // Builds four user templates (apt, wheels; three made from their parent's snapshot, one
    // whose warm-up fails) through bud serve's builder process, restarts the server twice,
    // and kills one mid-build.
    ("tests/user_templates.rs", 140, ON_PYTHON),
    // Three layers on the python template's snapshot, on the VMM alone.
    ("tests/template_layer.rs", 15, ON_PYTHON),
    ("tests/reset.rs", 116, ON_PYTHON),
    // Two memory bombs and a job just under the cap.
    ("tests/memory_cap.rs", 95, ON_PYTHON),
    // Boots its own template (the guest with a network card).
    ("tests/network.rs", 86, ON_GUEST),
    // Both boot the python image with a network card, a template of its own.
    ("server/tests/network.rs", 77, ON_GUEST),
    ("tests/network_attack.rs", 30, ON_GUEST),
    ("tests/session.rs", 69, ON_PYTHON),
    // Installs Debian's chromium on first use (112 MB fetched); 21 s once installed.
    ("tests/review.rs", 45, ON_PYTHON),
    ("tests/stress.rs", 48, ON_PYTHON),
    ("tests/guest_boot.rs", 145, ON_GUEST),
    ("server/tests/processes.rs", 68, ON_PYTHON),
    ("tests/beside.rs", 4, ON_PYTHON),
    ("tests/cluster.rs", 24, ON_PYTHON),
    ("tests/processes.rs", 68, ON_PYTHON),
    ("tests/jobs.rs", 51, ON_PYTHON),
    ("tests/sleeps.rs", 10, ON_PYTHON),
    ("server/tests/sessions.rs", 36, ON_PYTHON),
    ("tests/deploy.rs", 27, ON_PYTHON),
    // Its pipeline tests run the guest build's steps on the shared build folder.
    ("guest/src/lib.rs", 30, ON_GUEST),
    ("server/tests/beside.rs", 13, ON_PYTHON),
    ("server/tests/durable.rs", 18, ON_PYTHON),
    ("server/tests/density.rs", 15, ON_PYTHON),
    // Reads the guest's busybox (it runs the build's up-to-date check itself).
    ("guest/pyext/tests/host_jobs.rs", 12, ON_GUEST),
    ("server/tests/session_leaks.rs", 6, ON_PYTHON),
    ("server/tests/http.rs", 4, ON_PYTHON),
    ("tests/session_file.rs", 4, ON_PYTHON),
    ("tests/durable_crash.rs", 3, ON_PYTHON),
    ("tests/trace.rs", 5, ON_PYTHON),
    ("server/tests/cancel.rs", 2, ON_PYTHON),
    ("server/tests/drain.rs", 2, ON_PYTHON),
    ("server/tests/import_hostile.rs", 4, ON_PYTHON),
    ("server/tests/audit.rs", 1, ON_PYTHON),
    ("server/tests/hostile.rs", 13, ON_PYTHON),
    ("tests/jail.rs", 1, ON_PYTHON),
    ("tests/audit_cli.rs", 1, NONE),
    ("server/tests/layers.rs", 1, NONE),
    ("server/src/lib.rs", 8, NONE),
    ("vmm/src/lib.rs", 2, NONE),
    ("guest/agent/src/main.rs", 1, NONE),
    ("guest/pyext/src/lib.rs", 1, NONE),
    ("guest/pyext/tests/host_python.rs", 1, NONE),
    ("templates/src/lib.rs", 1, NONE),
    ("vmm/tests/snapshot_restore.rs", 1, NONE),
    ("vmm/tests/vcpu_pio.rs", 1, NONE),
    ("xtask/src/main.rs", 1, NONE),
    ("src/main.rs", 1, NONE),
    ("doc tests", 4, NONE),
];

/// The hint for the job labelled `label`.
pub fn hint(label: &str) -> Hint {
    HINTS
        .iter()
        .find(|(l, _, _)| *l == label)
        .map_or(UNLISTED, |&(_, seconds, needs)| Hint { seconds, needs })
}

/// Where a job stands in the chain: the build jobs by their place in [`BUILDS`], then the
/// rest.
fn rank(label: &str) -> usize {
    BUILDS
        .iter()
        .position(|(l, _)| *l == label)
        .unwrap_or(BUILDS.len())
}

/// `jobs` in the order the lanes take them (see the module's doc).
pub fn order(mut jobs: Vec<Job>) -> Vec<Job> {
    // The builds in chain order, then longest first; the label breaks ties so the order is
    // the same every run.
    jobs.sort_by(|a, b| {
        rank(&a.label)
            .cmp(&rank(&b.label))
            .then_with(|| hint(&b.label).seconds.cmp(&hint(&a.label).seconds))
            .then_with(|| a.label.cmp(&b.label))
    });
    jobs
}

/// The first job of `queue` (in order) that waits for nothing: each of its needs has
/// `ended`, or is not a job of this run (`in_run` says which are).
pub fn next_ready(
    queue: &[Job],
    ended: &dyn Fn(&str) -> bool,
    in_run: &dyn Fn(&str) -> bool,
) -> Option<usize> {
    queue.iter().position(|job| {
        hint(&job.label)
            .needs
            .iter()
            .all(|need| ended(need) || !in_run(need))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(label: &str) -> Job {
        Job::named(label)
    }

    fn labels(jobs: &[Job]) -> Vec<&str> {
        jobs.iter().map(|j| j.label.as_str()).collect()
    }

    #[test]
    fn the_builds_lead_in_chain_order_then_the_rest_longest_first() {
        let jobs = [
            "tests/audit_cli.rs",
            TOOLS,
            "tests/reset.rs",
            "tests/new.rs",
            GUEST,
            "tests/fuzz.rs",
            DATASCIENCE,
            PYTHON,
        ]
        .map(job)
        .to_vec();
        assert_eq!(
            labels(&order(jobs)),
            [
                GUEST,
                PYTHON,
                DATASCIENCE,
                TOOLS,
                "tests/fuzz.rs",
                "tests/reset.rs",
                "tests/new.rs",
                "tests/audit_cli.rs",
            ]
        );
    }

    #[test]
    fn a_lane_takes_the_first_job_whose_builds_have_ended() {
        let queue = order(
            [
                GUEST,
                PYTHON,
                DATASCIENCE,
                "server/tests/compat_figures.rs",
                "tests/reset.rs",
                "tests/audit_cli.rs",
            ]
            .map(job)
            .to_vec(),
        );
        let in_run = |l: &str| queue.iter().any(|j| j.label == l);
        let ready = |ended: &[&str]| {
            next_ready(&queue, &|l: &str| ended.contains(&l), &in_run)
                .map(|i| queue[i].label.as_str())
        };
        // Nothing built: the guest build, and the binary that needs no guest.
        assert_eq!(ready(&[]), Some(GUEST));
        let rest: Vec<Job> = queue[1..].to_vec();
        let ready_in = |q: &[Job], ended: &[&str]| {
            next_ready(q, &|l: &str| ended.contains(&l), &in_run).map(|i| q[i].label.clone())
        };
        assert_eq!(ready_in(&rest, &[]), Some("tests/audit_cli.rs".into()));
        // The guest built: the python template next; the figures wait for datascience.
        assert_eq!(ready_in(&rest, &[GUEST]), Some(PYTHON.into()));
        let figures_then_cli = ["server/tests/compat_figures.rs", "tests/audit_cli.rs"].map(job);
        assert_eq!(
            ready_in(&figures_then_cli, &[GUEST, PYTHON]),
            Some("tests/audit_cli.rs".into())
        );
        assert_eq!(
            ready_in(&figures_then_cli, &[GUEST, PYTHON, DATASCIENCE]),
            Some("server/tests/compat_figures.rs".into())
        );
        // The tools build is not in this run: templates.rs does not wait for it.
        let templates = [job("server/tests/templates.rs")];
        assert_eq!(
            ready_in(&templates, &[GUEST, PYTHON]),
            Some("server/tests/templates.rs".into())
        );
        assert_eq!(ready_in(&templates, &[GUEST]), None);
    }

    #[test]
    fn only_the_datascience_tests_wait_for_the_datascience_template() {
        assert_eq!(hint("server/tests/compat.rs").needs, [GUEST, PYTHON]);
        assert_eq!(
            hint("server/tests/compat_figures.rs").needs,
            [GUEST, PYTHON, DATASCIENCE]
        );
        assert_eq!(
            hint("server/tests/templates.rs").needs,
            [GUEST, PYTHON, TOOLS]
        );
        assert_eq!(
            hint("server/tests/templates_datascience.rs").needs,
            [GUEST, PYTHON, DATASCIENCE]
        );
        let waiting: Vec<&str> = HINTS
            .iter()
            .filter(|(_, _, needs)| needs.contains(&DATASCIENCE))
            .map(|(label, _, _)| *label)
            .collect();
        assert_eq!(
            waiting,
            [
                "server/tests/compat_figures.rs",
                "server/tests/templates_datascience.rs"
            ]
        );
        // With every build in the run, templates.rs goes once tools has built, while
        // datascience still boots.
        let all = |l: &str| is_build(l);
        let templates = [job("server/tests/templates.rs")];
        let ended = [GUEST, PYTHON, TOOLS];
        assert_eq!(
            next_ready(&templates, &|l: &str| ended.contains(&l), &all),
            Some(0)
        );
        assert_eq!(
            next_ready(&templates, &|l: &str| [GUEST, PYTHON].contains(&l), &all),
            None
        );
    }

    #[test]
    fn an_unlisted_binary_is_short_and_waits_for_the_python_template() {
        assert_eq!(hint("tests/not_yet_written.rs"), UNLISTED);
        assert_eq!(UNLISTED.needs, [GUEST, PYTHON]);
        let fuzz = hint("tests/fuzz.rs");
        assert_eq!(fuzz.needs, [GUEST]);
        assert!(fuzz.seconds > UNLISTED.seconds, "{fuzz:?}");
    }

    #[test]
    fn only_the_five_builds_are_build_jobs() {
        assert!(
            [GUEST, PYTHON, DATASCIENCE, TOOLS, NODE]
                .iter()
                .all(|l| is_build(l))
        );
        assert!(!is_build("tests/fuzz.rs"));
        assert!(!is_build("build: template nope"));
    }
}
