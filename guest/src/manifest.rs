//! The template manifest beside each image (`<image dir>/manifest.json`): what the image can
//! run, derived from what the build put in it, never typed by hand. The format is the VMM's
//! (`vmm/src/manifest.rs`, included here verbatim, as the agent includes `protocol.rs`).
//!
//! - **Runtimes**: `python` when the image has the interpreter, at the upstream version of
//!   its package; `shell` when it has `/bin/sh` (busybox's), at busybox's version. The
//!   worker runs them as its Python and shell modes. A template recipe's `[site.runtime]`
//!   (JavaScript in `node`) adds a kernel runtime, first when it is the default.
//! - **Tools**: every executable file directly in `bin/`, `usr/bin/`, `sbin/` and
//!   `usr/sbin/` of the staged image but the interpreters (busybox's applets are links to
//!   `busybox`, which counts once).
//! - **Kernels**: a `python` code-context kernel with the recipe's `kernels` warm ones, and
//!   a `bash` one run by the shell, when the image has those runtimes.
//! - **Packages**: every Debian package of the image with its version.
//! - **Network**: none (the guest has no network device).
//!
//! It is a function of the image's contents, so it is written on every build, also when the
//! image was current, and it is not an input of the image or of the template key.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::debs::Package;
use crate::python;
use crate::recipe::Site;

#[path = "../../vmm/src/manifest.rs"]
mod format;

pub use format::{
    Kernel, Language, MANIFEST_FILE, MANIFEST_FORMAT, Manifest, ManifestError, Network, Runtime,
};

/// The package whose version is the `python` runtime's.
const PYTHON_PACKAGE: &str = "python3.11-minimal";
/// The package whose version is the `shell` runtime's.
const SHELL_PACKAGE: &str = "busybox-static";
/// The shell the worker runs, relative to the root.
const SHELL: &str = "bin/sh";

/// The upstream part of a Debian version: `1:1.35.0-4+b3` is `1.35.0`.
pub fn upstream(version: &str) -> &str {
    let v = version.split_once(':').map_or(version, |(_, v)| v);
    v.rsplit_once('-').map_or(v, |(v, _)| v)
}

/// The manifest of template `name`, whose image was staged at `rootfs` from `packages`.
pub fn derive(name: &str, site: Option<&Site>, packages: &[Package], rootfs: &Path) -> Manifest {
    let version = |package: &str| {
        packages
            .iter()
            .find(|p| p.name == package)
            .map_or_else(String::new, |p| upstream(&p.version).to_owned())
    };
    let mut runtimes = Vec::new();
    let mut kernels = Vec::new();
    if rootfs.join(python::INTERPRETER).is_file() {
        runtimes.push(Runtime {
            name: "python".into(),
            version: version(PYTHON_PACKAGE),
            run: Language::Python,
            interpreter: "/usr/bin/python3".into(),
            ..Runtime::default()
        });
        kernels.push(Kernel {
            language: "python".into(),
            run: Language::Python,
            warm: site.map_or(0, |s| s.kernels),
        });
    }
    if rootfs.join(SHELL).symlink_metadata().is_ok() {
        runtimes.push(Runtime {
            name: "shell".into(),
            version: version(SHELL_PACKAGE),
            run: Language::Shell,
            interpreter: format!("/{SHELL}"),
            ..Runtime::default()
        });
        kernels.push(Kernel {
            language: "bash".into(),
            run: Language::Shell,
            warm: 0,
        });
    }
    if let Some(r) = site.and_then(|s| s.runtime.as_ref()) {
        let runtime = Runtime {
            name: r.name.clone(),
            aliases: r.aliases.clone(),
            version: version(&r.package),
            run: Language::Kernel,
            interpreter: r.interpreter.clone(),
            kernel: r.kernel.clone(),
            ..Runtime::default()
        };
        // Its dialects run in the same kernel, at the same version (the kernel's program
        // turns them into its own language).
        let dialects = r.dialects.iter().zip(1..).map(|(d, n)| Runtime {
            name: d.name.clone(),
            aliases: d.aliases.clone(),
            dialect: n,
            ..runtime.clone()
        });
        let dialects: Vec<Runtime> = dialects.collect();
        // The default runtime comes first.
        let at = if r.default { 0 } else { runtimes.len() };
        runtimes.insert(at, runtime);
        runtimes.extend(dialects);
    }
    // Program runtimes, numbered in their order (the worker's manifest lists them so); the
    // version is the named package's, else that of a package named as the interpreter
    // (`lua5.4`, `gawk`), else none.
    for (p, number) in site.iter().flat_map(|s| &s.programs).zip(0..) {
        let interpreter = &p.command[0];
        let named = interpreter.rsplit('/').next().unwrap_or(interpreter);
        runtimes.push(Runtime {
            name: p.name.clone(),
            aliases: p.aliases.clone(),
            version: version(p.package.as_deref().unwrap_or(named)),
            run: Language::Program,
            interpreter: crate::program::resolve(rootfs, interpreter)
                .unwrap_or_else(|| interpreter.clone()),
            args: p.command[1..].to_vec(),
            extension: p.extension.clone(),
            dialect: number,
            ..Runtime::default()
        });
    }
    let kernel_interpreter = site
        .and_then(|s| s.runtime.as_ref())
        .map(|r| r.interpreter.trim_start_matches('/'));
    let interpreters: Vec<&str> = [python::INTERPRETER]
        .into_iter()
        .chain(kernel_interpreter)
        .collect();
    let mut tools = Vec::new();
    // The guest's PATH, where a program runtime's interpreter is looked for too.
    for dir in crate::program::SEARCH_DIRS {
        let Ok(entries) = std::fs::read_dir(rootfs.join(dir)) else {
            continue;
        };
        for entry in entries.flatten() {
            let rel = format!("{dir}/{}", entry.file_name().to_string_lossy());
            let executable = entry
                .metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
            let is_file = entry.file_type().is_ok_and(|t| t.is_file());
            if executable && is_file && !interpreters.contains(&rel.as_str()) {
                tools.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
    }
    tools.sort();
    tools.dedup();
    Manifest {
        format: MANIFEST_FORMAT,
        name: name.to_owned(),
        runtimes,
        kernels,
        tools,
        packages: packages
            .iter()
            .map(|p| (p.name.clone(), p.version.clone()))
            .collect::<BTreeMap<_, _>>(),
        python_packages: python_packages(&rootfs.join(crate::wheels::SITE_DIR)),
        npm_packages: crate::npm::installed(&rootfs.join(crate::npm::GLOBAL_DIR)),
        network: Network::None,
    }
}

/// Name to version of every `{name}-{version}.dist-info` directory in `site`.
fn python_packages(site: &Path) -> BTreeMap<String, String> {
    let Ok(entries) = std::fs::read_dir(site) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix(".dist-info")?;
            let (name, version) = stem.rsplit_once('-')?;
            Some((name.to_owned(), version.to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod derive_tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn package(name: &str, version: &str) -> Package {
        Package {
            name: name.into(),
            version: version.into(),
            sha256: String::new(),
            file: String::new(),
        }
    }

    fn executable(root: &Path, rel: &str) {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"\x7fELF").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn upstream_versions_drop_the_epoch_and_the_debian_revision() {
        assert_eq!(upstream("1:1.35.0-4+b3"), "1.35.0");
        assert_eq!(upstream("3.11.2-6+deb12u9"), "3.11.2");
        assert_eq!(upstream("2.39.5"), "2.39.5");
    }

    #[test]
    fn a_staged_image_gives_its_runtimes_tools_and_packages() {
        let root = std::env::temp_dir().join(format!("bud-derive-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        executable(&root, python::INTERPRETER);
        executable(&root, "bin/busybox");
        executable(&root, "bin/bash");
        executable(&root, "usr/bin/git");
        symlink("/bin/busybox", root.join("bin/sh")).unwrap();
        symlink("/bin/busybox", root.join("usr/bin/awk")).unwrap();
        std::fs::write(root.join("usr/bin/README"), b"not a program").unwrap();
        executable(&root, "usr/local/bin/tabulate");
        std::fs::create_dir_all(
            root.join(crate::wheels::SITE_DIR)
                .join("tabulate-0.9.0.dist-info"),
        )
        .unwrap();
        let packages = [
            package("python3.11-minimal", "3.11.2-6+deb12u9"),
            package("busybox-static", "1:1.35.0-4+b3"),
            package("bash", "5.2.15-2+b7"),
        ];

        let m = derive("tools", None, &packages, &root);

        assert_eq!(
            m.runtimes
                .iter()
                .map(|r| (r.name.as_str(), r.version.as_str(), r.run))
                .collect::<Vec<_>>(),
            [
                ("python", "3.11.2", Language::Python),
                ("shell", "1.35.0", Language::Shell)
            ]
        );
        assert_eq!(m.tools, ["bash", "busybox", "git", "tabulate"]);
        assert_eq!(m.python_packages["tabulate"], "0.9.0");
        assert_eq!(m.packages["bash"], "5.2.15-2+b7");
        assert_eq!(m.kernel("python").map(|k| k.warm), Some(0));
        assert_eq!(m.kernel("bash").map(|k| k.run), Some(Language::Shell));
        assert_eq!(m.network, Network::None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_node_recipe_gives_javascript_first_and_typescript_as_its_dialect() {
        let recipe_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("image");
        let site = crate::recipe::load_site(&recipe_dir, "node")
            .unwrap()
            .unwrap();
        let root = std::env::temp_dir().join(format!("bud-derive-js-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        executable(&root, python::INTERPRETER);
        executable(&root, "usr/bin/node");
        let packages = [
            package("python3.11-minimal", "3.11.2-6+deb12u9"),
            package("nodejs", "18.20.4+dfsg-1~deb12u3"),
        ];

        let m = derive("node", Some(&site), &packages, &root);
        let check = Manifest::parse(m.to_json().as_bytes(), Path::new("node"));

        let seen: Vec<_> = m
            .runtimes
            .iter()
            .map(|r| (r.name.as_str(), r.version.as_str(), r.run, r.dialect))
            .collect();
        assert_eq!(
            seen,
            [
                ("javascript", "18.20.4+dfsg", Language::Kernel, 0),
                ("python", "3.11.2", Language::Python, 0),
                ("typescript", "18.20.4+dfsg", Language::Kernel, 1),
            ]
        );
        assert_eq!(
            m.runtime("ts").map(|r| &r.kernel),
            Some(&m.runtimes[0].kernel)
        );
        assert_eq!(check.map(|c| c.runtimes.len()).ok(), Some(3));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn program_runtimes_follow_the_others_numbered_with_their_interpreters_path_and_version() {
        let recipe_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("image");
        let mut site = crate::recipe::load_site(&recipe_dir, "tools")
            .unwrap()
            .unwrap();
        let program =
            |name: &str, command: &[&str], package: Option<&str>| crate::program::ProgramRuntime {
                name: name.into(),
                aliases: Vec::new(),
                command: command.iter().map(|w| w.to_string()).collect(),
                extension: String::new(),
                package: package.map(Into::into),
            };
        site.programs = vec![
            program("lua", &["lua5.4"], None),
            program("awk", &["/bin/busybox", "awk", "-f"], None),
            program("perl", &["perl", "-w"], Some("perl-base")),
        ];
        let root = std::env::temp_dir().join(format!("bud-derive-pr-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        executable(&root, python::INTERPRETER);
        executable(&root, "usr/bin/lua5.4");
        executable(&root, "usr/bin/perl");
        executable(&root, "bin/busybox");
        let packages = [
            package("python3.11-minimal", "3.11.2-6+deb12u9"),
            package("lua5.4", "5.4.4-3+deb12u1"),
            package("perl-base", "5.36.0-7+deb12u1"),
        ];

        let m = derive("langs", Some(&site), &packages, &root);
        let check = Manifest::parse(m.to_json().as_bytes(), Path::new("langs"));

        let seen: Vec<_> = m
            .runtimes
            .iter()
            .filter(|r| r.run == Language::Program)
            .map(|r| {
                (
                    r.name.as_str(),
                    r.interpreter.as_str(),
                    r.args.join(" "),
                    r.version.as_str(),
                    r.dialect,
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                ("lua", "/usr/bin/lua5.4", String::new(), "5.4.4", 0),
                ("awk", "/bin/busybox", "awk -f".into(), "", 1),
                ("perl", "/usr/bin/perl", "-w".into(), "5.36.0", 2),
            ]
        );
        assert_eq!(check.map(|c| c.runtimes.len()).ok(), Some(4));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn an_image_without_python_has_no_python_runtime_or_kernel() {
        let root = std::env::temp_dir().join(format!("bud-derive-sh-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        executable(&root, "bin/busybox");
        symlink("/bin/busybox", root.join("bin/sh")).unwrap();

        let m = derive("sh", None, &[], &root);

        assert_eq!(m.runtime_names(), ["shell"]);
        assert_eq!(m.kernel("python"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
