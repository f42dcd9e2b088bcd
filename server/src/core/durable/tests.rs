//! The state directory on disk: its lock, marks, damaged files, quota and ids.

use super::*;
use std::path::PathBuf;

#[test]
fn a_second_server_on_one_directory_is_refused_and_marks_become_lost_sessions() {
    let root = std::env::temp_dir().join(format!("bud-durable-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (first, found) = StateDir::open(&root, &StateOptions::quota(1 << 30)).unwrap();
    first.mark_running("ses_1");
    first.mark_running("ses_2");
    first.unmark_running("ses_2");
    std::fs::write(root.join("paused/ses_9.bud"), b"not a session").unwrap();

    let second = StateDir::open(&root, &StateOptions::quota(1 << 30));
    drop(first);
    // Other tests of this binary fork children (the jail's), which hold a copy of the
    // lock's file description until they exit: a moment.
    let mut third = StateDir::open(&root, &StateOptions::quota(1 << 30));
    for _ in 0..200 {
        if !matches!(third, Err(DurableError::Locked { .. })) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
        third = StateDir::open(&root, &StateOptions::quota(1 << 30));
    }
    let (_third, again) = third.unwrap();

    assert!(found.lost.is_empty() && found.damaged.is_empty());
    assert!(
        matches!(&second, Err(DurableError::Locked { holder, .. }) if holder == &format!("pid {}", std::process::id())),
        "{second:?}"
    );
    assert_eq!(again.lost, vec!["ses_1".to_owned()]);
    assert_eq!(again.damaged.len(), 1);
    assert!(root.join("damaged/paused-ses_9.bud").exists());
    std::fs::remove_dir_all(&root).unwrap();
}

fn scratch(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("bud-durable-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    root
}

#[test]
fn reservations_never_pass_the_quota_together_and_are_given_back() {
    let root = scratch("reserve");
    let (dir, _) = StateDir::open(&root, &StateOptions::quota(1000)).unwrap();
    let dir = std::sync::Arc::new(dir);

    let first = dir.reserve(600);
    let second = dir.reserve(600);
    let (first_held, second_held) = (first.is_some(), second.is_some());
    let mut growing = dir.reserve(0).unwrap();
    let grew = growing.grow(400);
    let past = growing.grow(1);
    drop(first);
    drop(growing);
    let after = dir.usage().0;

    assert!(
        first_held && !second_held,
        "two reservations passed the quota"
    );
    assert!(grew && !past);
    assert_eq!(after, 0);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn damaged_files_count_in_the_quota_and_old_ones_are_pruned() {
    let root = scratch("damaged");
    let (dir, _) = StateDir::open(&root, &StateOptions::quota(1 << 20)).unwrap();
    std::fs::write(root.join("paused/ses_x.bud"), vec![1u8; 3000]).unwrap();
    drop(dir);
    let keep = StateOptions::quota(1 << 20);
    let prune = StateOptions {
        damaged_keep: Duration::ZERO,
        ..StateOptions::quota(1 << 20)
    };

    let (kept, found) = StateDir::open(&root, &keep).unwrap();
    let counted = kept.usage().0;
    drop(kept);
    let (pruned, _) = StateDir::open(&root, &prune).unwrap();

    assert_eq!(found.damaged.len(), 1, "not a signed file: set aside");
    assert_eq!(counted, 3000);
    assert_eq!(pruned.usage().0, 0);
    assert!(!root.join("damaged/paused-ses_x.bud").exists());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_state_directory_that_cannot_be_written_is_an_error_at_open() {
    use std::os::unix::fs::PermissionsExt;
    let root = scratch("readonly");
    for sub in ["paused", "snapshots", "running", "damaged"] {
        std::fs::create_dir_all(root.join(sub)).unwrap();
    }
    std::fs::set_permissions(root.join("paused"), std::fs::Permissions::from_mode(0o500)).unwrap();
    // Root writes anywhere: the folder is taken away instead.
    let as_root = unsafe_is_root();
    if as_root {
        std::fs::remove_dir_all(root.join("paused")).unwrap();
        std::fs::write(root.join("paused"), b"a file, not a folder").unwrap();
    }

    let opened = StateDir::open(&root, &StateOptions::quota(1 << 20));

    assert!(
        matches!(opened, Err(DurableError::NotWritable { .. })),
        "{opened:?}"
    );
    let _ = std::fs::set_permissions(root.join("paused"), std::fs::Permissions::from_mode(0o700));
    std::fs::remove_dir_all(&root).unwrap();
}

fn unsafe_is_root() -> bool {
    // SAFETY: geteuid has no preconditions and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn ids_of_a_long_node_id_are_plain_ids_and_the_limit_is_an_imports() {
    let long = format!("ses_{}_{}", "n".repeat(63), "0".repeat(32));
    let too_long = format!("ses_{}", "a".repeat(crate::core::node::MAX_ID_LEN));

    assert_eq!(long.len(), 100);
    assert!(plain_id(&long) && crate::core::node::is_session_id(&long));
    assert!(!plain_id(&too_long) && !crate::core::node::is_session_id(&too_long));
}
