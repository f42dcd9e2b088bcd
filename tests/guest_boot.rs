//! The real guest on the real VMM: boots to the agent's READY doorbell with a valid mailbox,
//! and a broken guest fails with the reason in the console tail. Needs /dev/kvm.

mod common;

use std::time::Duration;

use common::*;
use vmm::protocol::{MAILBOX_DEFAULT_SIZE, PROTOCOL_VERSION};
use vmm::{BootError, HostKind};

#[test]
fn guest_boots_to_ready_with_a_valid_mailbox() {
    let cfg = boot_config();

    let ready = vmm::boot(&cfg, None).expect("boot to READY failed");

    assert_eq!(ready.mailbox.len(), MAILBOX_DEFAULT_SIZE as u64);
    assert_eq!(
        ready.mailbox.read_u32(&ready.machine.ram, 4).unwrap(),
        PROTOCOL_VERSION
    );
    assert!(
        ready.timings.to_agent.is_some(),
        "the agent rang AGENT_STARTED"
    );
    assert!(ready.timings.to_agent.unwrap() < ready.timings.to_ready);
    let console: Vec<String> = ready.machine.bus.console().tail(50);
    assert!(
        console.iter().any(|l| l.starts_with("bud-worker: ready")),
        "worker's READY line missing from console: {console:#?}"
    );
    assert_eq!(ready.host_kind, HostKind::detect());
    if ready.host_kind == HostKind::Pvm {
        assert!(ready.cmdline.contains("clearcpuid="));
    }
}

#[test]
fn guest_without_init_fails_with_the_kernel_panic_in_the_console_tail() {
    let dir = std::env::temp_dir().join(format!("bud-noinit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let initramfs = dir.join("empty.cpio");
    let mut tree = bud_guest::cpio::Tree::new();
    tree.insert(bud_guest::cpio::Entry::char_dev("dev/console", 0o600, 5, 1))
        .unwrap();
    tree.write(std::fs::File::create(&initramfs).unwrap())
        .unwrap();
    let mut cfg = boot_config();
    cfg.initramfs = initramfs;

    let err = vmm::boot(&cfg, None).expect_err("a guest without /init cannot reach READY");
    std::fs::remove_dir_all(&dir).unwrap();

    let BootError::Stopped { console, .. } = &err else {
        panic!("expected the guest to stop, got: {err}");
    };
    assert!(
        console.0.iter().any(|l| l.contains("Kernel panic")),
        "console tail lacks the panic: {err}"
    );
}

#[test]
fn boot_timeout_stops_the_guest_and_reports_the_console() {
    let mut cfg = boot_config();
    cfg.timeout = Duration::from_millis(300);

    let err = vmm::boot(&cfg, None).expect_err("nothing boots in 300 ms here");

    assert!(matches!(err, BootError::Timeout { .. }), "got: {err}");
    assert!(err.to_string().contains("no READY within"));
}

#[test]
fn a_template_made_under_another_cpu_or_kvm_is_never_restored() {
    let t = template();
    let here = t.state().host_identity.clone();
    assert_eq!(here.len(), 24, "a template records its host identity");
    // The same template, as if captured under another CPU/KVM: its state's identity
    // changed, its memory file linked.
    let dir = std::env::temp_dir().join(format!("bud-other-host-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = std::fs::read(t.dir().join("state")).unwrap();
    let mut state = vmm::snapshot::SnapshotState::from_bytes(&bytes).unwrap();
    state.host_identity = "ffffffffffffffffffffffff".into();
    std::fs::write(dir.join("state"), state.to_bytes().unwrap()).unwrap();
    // Linked where the filesystem allows it (same device), copied where it does not.
    if std::fs::hard_link(t.dir().join("memory"), dir.join("memory")).is_err() {
        std::fs::copy(t.dir().join("memory"), dir.join("memory")).unwrap();
    }

    let err = vmm::Template::load(&dir).expect_err("another host's template must not load");
    let same = vmm::Template::load(t.dir()).map(|_| ());
    std::fs::remove_dir_all(&dir).unwrap();

    assert!(
        matches!(
            &err,
            vmm::template::TemplateError::WrongIdentity { made, this }
                if made == "ffffffffffffffffffffffff" && this == &here
        ),
        "{err}"
    );
    same.expect("the template made here loads");
}
