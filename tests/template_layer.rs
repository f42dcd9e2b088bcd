//! A template made from its parent's snapshot with a layer (`vmm::Template::load_or_derive`,
//! `guest/python/bud_layer.py`), on the real VMM and the `python` template: the layer's files,
//! environment and warm-up are in every clone; its clones are reset to it, every reset
//! verified by value; a warm-up that raises fails with its traceback, and a parent that does
//! not match the child's boot is refused before anything runs. Needs /dev/kvm.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use bud_guest::cpio::{Data, Entry, Writer};
use vmm::template::{Layer, Origin, TemplateError};
use vmm::{BootConfig, Executor, Job, Status, Template, TemplateSpec};

/// The worker manifest of the child: one environment variable and one warm-up file.
const MANIFEST: &str = r#"{"env": {"LAYER": "on"}, "user_warm": ["/usr/lib/bud/user_warm_0.py"]}"#;

/// A `newc` archive of `files` (path, text), with their parent directories.
fn archive(files: &[(&str, &str)]) -> Vec<u8> {
    let mut w = Writer::new(Vec::new());
    for (path, text) in files {
        let mut dirs: Vec<&str> = path.match_indices('/').map(|(i, _)| &path[..i]).collect();
        dirs.retain(|d| d.starts_with("opt"));
        for d in dirs {
            w.append(&Entry::dir(d, 0o755)).unwrap();
        }
        let data = Data::Bytes(text.as_bytes().to_vec());
        w.append(&Entry::file(path, 0o644, data)).unwrap();
    }
    w.finish().unwrap().0
}

/// Where the child lives: its own template root, and a stand-in for its image (the key is
/// a hash of it; a layer never boots it) with the parent's manifest beside it.
fn child_spec(dir: &Path, name: &str, parent: &Template) -> TemplateSpec {
    std::fs::create_dir_all(dir).unwrap();
    let initramfs = dir.join(format!("{name}.cpio"));
    std::fs::write(&initramfs, name).unwrap();
    let mut manifest = parent.manifest().clone();
    manifest.name = name.to_owned();
    manifest
        .write(&vmm::template::manifest_path(&initramfs))
        .unwrap();
    let mut boot = BootConfig::new(common::boot_config().kernel, initramfs);
    boot.ram_size = parent.state().ram_size;
    TemplateSpec {
        boot,
        root: dir.join("templates"),
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = common::source_dir()
        .join("build")
        .join(format!("test-layer-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn run(ex: &Executor, code: &str) -> vmm::JobResult {
    let r = ex.run(&Job::python(code)).expect("the job ran");
    assert_eq!(
        r.status,
        Status::Ok,
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    r
}

#[test]
fn a_layer_is_in_every_clone_and_each_clone_is_reset_to_it() {
    common::require_kvm();
    let parent = common::template();
    let dir = scratch("ok");
    let spec = child_spec(&dir, "layered", &parent);
    let files = archive(&[
        ("usr/lib/bud/template.json", MANIFEST),
        (
            "usr/lib/bud/user_warm_0.py",
            "import builtins\nbuiltins.WARMED = 'by the layer'\nprint('warm output')\n",
        ),
        ("opt/layer/hello.txt", "hello from the layer"),
    ]);
    let layer = Layer {
        archive: &files,
        warm_from: 0,
        timeout: Duration::from_secs(300),
    };
    let child = Template::load_or_derive(&spec, &parent, &layer, None).expect("the layer");
    assert!(
        matches!(child.origin(), Origin::Derived { .. }),
        "{:?}",
        child.origin()
    );
    assert_eq!(child.manifest().name, "layered");

    let ex = Executor::new(
        child,
        vmm::ExecutorOptions {
            pool_size: 0,
            verify: true,
            ..vmm::ExecutorOptions::default()
        },
    )
    .expect("an executor over the layer");
    let code = "import os\n\
                print(open('/opt/layer/hello.txt').read(), os.environ['LAYER'], WARMED)\n\
                print(os.path.exists('/tmp/.bud-layer.cpio'))\n\
                open('/opt/layer/hello.txt', 'w').write('changed')\n\
                import builtins; builtins.WARMED = 'changed'";
    for _ in 0..3 {
        let r = run(&ex, code);
        // The warm-up's own output went to the console, never to a job.
        assert_eq!(
            String::from_utf8_lossy(&r.stdout),
            "hello from the layer on by the layer\nFalse\n"
        );
    }
    let shell = ex
        .run(&Job::new(
            vmm::Language::Shell,
            "echo $LAYER; cat /opt/layer/hello.txt",
        ))
        .expect("the shell job ran");
    assert_eq!(
        String::from_utf8_lossy(&shell.stdout),
        "on\nhello from the layer"
    );
    assert_eq!(ex.take_reset_errors(), Vec::<String>::new());
    assert!(ex.stats().resets >= 3, "{:?}", ex.stats());

    // Loaded again from disk, as a server would, it is the same template.
    drop(ex);
    let again = Template::load_saved(&spec).expect("the saved layer");
    assert!(matches!(again.origin(), Origin::Loaded { .. }));
    let ex = Executor::new(again, vmm::ExecutorOptions::default()).unwrap();
    let r = run(&ex, "import os; print(os.environ['LAYER'], WARMED)");
    assert_eq!(String::from_utf8_lossy(&r.stdout), "on by the layer\n");
    drop(ex);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_warm_up_that_raises_fails_the_layer_with_its_traceback_and_saves_nothing() {
    common::require_kvm();
    let parent = common::template();
    let dir = scratch("raises");
    let spec = child_spec(&dir, "broken", &parent);
    let files = archive(&[
        ("usr/lib/bud/template.json", MANIFEST),
        (
            "usr/lib/bud/user_warm_0.py",
            "def load():\n    raise FileNotFoundError('model.bin')\nload()\n",
        ),
    ]);
    let layer = Layer {
        archive: &files,
        warm_from: 0,
        timeout: Duration::from_secs(300),
    };
    let err = Template::load_or_derive(&spec, &parent, &layer, None).unwrap_err();
    let TemplateError::LayerFailed { stderr, .. } = &err else {
        panic!("{err}");
    };
    assert!(
        stderr.contains("warm-up /usr/lib/bud/user_warm_0.py failed:")
            && stderr.contains("line 2, in load")
            && stderr.contains("FileNotFoundError: model.bin"),
        "{stderr}"
    );
    assert!(matches!(
        Template::load_saved(&spec),
        Err(TemplateError::NotSaved(_))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_parent_of_other_ram_or_a_torn_archive_is_refused() {
    common::require_kvm();
    let parent = common::template();
    let dir = scratch("refused");
    let mut spec = child_spec(&dir, "bigger", &parent);
    spec.boot.ram_size *= 2;
    let files = archive(&[("opt/layer/x", "x")]);
    let layer = Layer {
        archive: &files,
        warm_from: 0,
        timeout: Duration::from_secs(300),
    };
    let err = Template::load_or_derive(&spec, &parent, &layer, None).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "a layer cannot go on this parent: the child has {} MiB of guest RAM, the parent {} MiB",
            spec.boot.ram_size >> 20,
            parent.state().ram_size >> 20
        )
    );

    let spec = child_spec(&dir, "torn", &parent);
    let torn = &files[..files.len() / 2];
    let layer = Layer {
        archive: torn,
        warm_from: 0,
        timeout: Duration::from_secs(300),
    };
    let err = Template::load_or_derive(&spec, &parent, &layer, None).unwrap_err();
    let TemplateError::LayerFailed { stderr, .. } = &err else {
        panic!("{err}");
    };
    assert!(stderr.contains("LayerError: "), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
