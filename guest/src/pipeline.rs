//! The guest build pipeline: kernel, guest binaries, host tools, image; each step cached, so a
//! second [`ensure`] with nothing changed takes a second or two and touches no network.
//!
//! This module owns the order of the steps, where their outputs live under the build
//! directory, and the artifact key the template cache uses. Every failure names its step;
//! a failing command comes with its command line and the tail of its output.
//!
//! One file although over 500 lines: the steps read in order in under 350 lines, and the rest
//! is their unit tests, kept below the code.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use sha2::{Digest, Sha256};

use crate::debs::{self, DebError, Package};
use crate::definition::Definition;
use crate::hashes::{HashCache, HashError};
use crate::host::{self, Apt, HostError};
use crate::image::{self, Image, ImageError, ImageInputs, ImageReport};
use crate::lock::{BuildLock, LockError};
use crate::manifest::{self, MANIFEST_FILE, ManifestError};
use crate::npm::{self, NpmError};
use crate::recipe::{Recipe, RecipeError, Site};
use crate::run::{self, RunError};
use crate::user::{Layers, UserError};
use crate::wheels::{self, WheelError};

/// The kernel build (kept in scripts/): `bash <script> <out dir>` leaves `<out dir>/vmlinux`.
pub const KERNEL_SCRIPT: &str = "scripts/build-kernel.sh";
/// The recipe directory, relative to the source tree.
pub const RECIPE_DIR: &str = "guest/image";
/// bud's guest Python modules, relative to the source tree.
pub const PYTHON_DIR: &str = "guest/python";
/// The nested cargo build's own target directory, relative to the source tree, so it never
/// waits on the lock of an outer `cargo run` or `cargo test`.
pub const GUEST_TARGET_DIR: &str = "target/guest";
/// The guest crates the nested cargo build makes.
const GUEST_PACKAGES: &[&str] = &["bud-agent", "bud-pyext", "bud-nodeext"];
/// Outputs of the nested build, relative to its target directory.
const AGENT_BINARY: &str = "release/bud-agent";
const EXTENSION_LIBRARY: &str = "release/lib_bud.so";
/// The Node-API addon of a kernel runtime's kernel (`guest/nodeext`), beside the extension.
const KERNEL_ADDON_LIBRARY: &str = "libbud_nodeext.so";
/// Remembered sha256 of the inputs, inside the build directory (see `hashes.rs`).
const HASH_CACHE: &str = "sha256-cache.tsv";

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("kernel step: {0} not found")]
    KernelScriptMissing(PathBuf),
    #[error("kernel step")]
    Kernel(#[source] RunError),
    #[error("kernel step: {0} missing after the build script ran")]
    KernelMissing(PathBuf),
    #[error("guest binaries step")]
    GuestBinaries(#[source] RunError),
    #[error("guest binaries step: {0} missing after cargo build")]
    GuestBinaryMissing(PathBuf),
    #[error("host tools step")]
    HostTools(#[source] HostError),
    #[error("image step: recipe")]
    Recipe(#[source] RecipeError),
    #[error("image step: packages")]
    Packages(#[source] DebError),
    #[error("image step")]
    Image(#[source] ImageError),
    #[error("waiting for the build directory")]
    Lock(#[source] LockError),
    #[error("artifact key")]
    Hash(#[source] HashError),
    #[error("manifest step: the staged image {0} is gone (remove its image directory to rebuild)")]
    StagedImageMissing(PathBuf),
    #[error("manifest step")]
    Manifest(#[source] ManifestError),
    #[error("user template")]
    User(#[source] UserError),
    #[error("Python packages")]
    Wheels(#[source] WheelError),
    #[error("npm packages")]
    Npm(#[source] NpmError),
    #[error("pip: the base image's packages have no {PIP_PACKAGE}")]
    NoPip,
    #[error("image step: bud's egress CA")]
    EgressCa(#[source] crate::egress_ca::CaError),
}

/// The Debian package of the base image that carries pip as a wheel (run on the host to
/// fetch a user template's wheels: `wheels.rs`).
const PIP_PACKAGE: &str = "python3-pip-whl";

/// Where to build from and to.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// The repository root.
    pub source_dir: PathBuf,
    /// Outputs: `kernel/`, `debs/`, `image/`. Default `<source_dir>/build`.
    pub build_dir: PathBuf,
    /// Ask apt for the current package versions even when the cached ones are complete.
    pub refresh_packages: bool,
    /// The template whose image to build: [`recipe::BASE_TEMPLATE`], one of
    /// `guest/image/templates/`, or a user template (stored, or [`Self::definition`]).
    pub template: String,
    /// A user template's definition to build (not stored yet: `user::save` stores it once
    /// its build and first boot succeeded). `None`: a built-in or stored template.
    pub definition: Option<Definition>,
}

impl BuildOptions {
    pub fn new(source_dir: impl Into<PathBuf>) -> Self {
        let source_dir = source_dir.into();
        BuildOptions {
            build_dir: source_dir.join("build"),
            source_dir,
            refresh_packages: false,
            template: crate::recipe::BASE_TEMPLATE.to_owned(),
            definition: None,
        }
    }

    /// The template's user layers: `None` for a built-in template; the definition given or
    /// stored for a user template.
    pub fn layers(&self) -> Result<Option<Layers>, BuildError> {
        let recipe_dir = self.source_dir.join(RECIPE_DIR);
        if let Some(def) = self.definition.as_ref().filter(|d| d.name == self.template) {
            return Layers::resolve(def, &recipe_dir, &self.build_dir)
                .map(Some)
                .map_err(BuildError::User);
        }
        if crate::recipe::template_names(&recipe_dir).contains(&self.template) {
            return Ok(None);
        }
        match Layers::of_stored(&self.template, &recipe_dir, &self.build_dir) {
            Ok(Some(layers)) => Ok(Some(layers)),
            // Neither built in nor stored: the recipe's error names the known ones.
            Ok(None) => crate::recipe::load_site(&recipe_dir, &self.template)
                .map(|_| None)
                .map_err(BuildError::Recipe),
            Err(e) => Err(BuildError::User(e)),
        }
    }

    /// The template's site (what it adds to the base image) and its user layers.
    pub fn site(&self) -> Result<(Option<Site>, Option<Layers>), BuildError> {
        let recipe_dir = self.source_dir.join(RECIPE_DIR);
        match self.layers()? {
            Some(layers) => {
                let site = layers.site(&recipe_dir).map_err(BuildError::User)?;
                Ok((Some(site), Some(layers)))
            }
            None => crate::recipe::load_site(&recipe_dir, &self.template)
                .map(|site| (site, None))
                .map_err(BuildError::Recipe),
        }
    }
}

/// What a booted guest is made of.
#[derive(Debug, Clone)]
pub struct GuestArtifacts {
    /// The ELF `vmlinux`.
    pub kernel: PathBuf,
    /// The uncompressed `newc` initramfs.
    pub initramfs: PathBuf,
    /// What the image can run (`manifest.json` beside the initramfs).
    pub manifest: manifest::Manifest,
    /// sha256 over the kernel's and the initramfs' sha256: names a template.
    pub key: String,
    pub image_size: u64,
    pub image_sha256: String,
    /// The Debian packages in the image, with exact versions and `.deb` sha256.
    pub packages: Vec<Package>,
    /// Set when this call rebuilt the image.
    pub image_report: Option<ImageReport>,
}

/// Prefixes every line with the elapsed time and the step name.
struct Progress<'a> {
    start: Instant,
    sink: &'a mut dyn FnMut(&str),
}

impl Progress<'_> {
    fn say(&mut self, step: &str, line: &str) {
        let elapsed = self.start.elapsed().as_secs_f64();
        (self.sink)(&format!("[{elapsed:7.1}s] {step}: {line}"));
    }

    /// A callback for streamed command output of `step`.
    fn stream<'s>(&'s mut self, step: &'s str) -> impl FnMut(&str) + 's {
        move |line| self.say(step, line)
    }
}

/// Builds (or finds current) everything a guest needs: the kernel, the agent and extension,
/// and the initramfs. Progress lines go to `progress`. Every step runs under the build
/// directory's [`BuildLock`]: concurrent callers (test threads, test binaries, a CLI run)
/// take turns, and the later ones find the work done.
pub fn ensure(
    opts: &BuildOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<GuestArtifacts, BuildError> {
    let mut p = Progress {
        start: Instant::now(),
        sink: progress,
    };
    let what = format!("the guest build of template {}", opts.template);
    let _lock = BuildLock::acquire(&opts.build_dir, &what, &mut p.stream("lock"))
        .map_err(BuildError::Lock)?;
    let kernel = build_kernel(opts, &mut p.stream("kernel"))?;
    let (agent, extension) = build_guest_binaries(opts, &mut p.stream("guest binaries"))?;
    let mut apt = Apt::new();
    host::ensure_tools(&mut apt, &mut p.stream("host tools")).map_err(BuildError::HostTools)?;
    let (image, packages) =
        build_image(opts, &agent, &extension, &mut apt, &mut p.stream("image"))?;
    let manifest = write_manifest(opts, &packages)?;
    p.say(
        "manifest",
        &format!(
            "runtimes {}; tools {}",
            manifest.runtime_names().join(", "),
            manifest.tools.join(", ")
        ),
    );
    if let Some(report) = &image.report {
        p.say(
            "image",
            &format!("{} entries, {}", report.entries, megabytes(image.size)),
        );
        for (part, size) in &report.parts {
            p.say("image", &format!("  {:>9}  {part}", megabytes(*size)));
        }
        for (path, size) in &report.largest {
            p.say("image", &format!("  {:>9}  /{path}", megabytes(*size)));
        }
    }
    let key = artifact_key(opts, &kernel, &image)?;
    p.say("done", &format!("key {}", &key[..16]));
    Ok(GuestArtifacts {
        kernel,
        initramfs: image.path,
        manifest,
        key,
        image_size: image.size,
        image_sha256: image.sha256,
        packages,
        image_report: image.report,
    })
}

/// Where a build under `build_dir` leaves the manifest of `template`'s image (beside the
/// initramfs; it may not exist).
pub fn manifest_path(build_dir: &Path, template: &str) -> PathBuf {
    image_dir(build_dir, template).join(MANIFEST_FILE)
}

/// Where a build under `build_dir` leaves the kernel and the initramfs of `template` (they
/// may not exist).
pub fn artifact_paths(build_dir: &Path, template: &str) -> (PathBuf, PathBuf) {
    (
        build_dir.join("kernel").join("vmlinux"),
        image_dir(build_dir, template).join(crate::image::IMAGE_FILE),
    )
}

/// The image work directory of `template`: `image/` for the base one, `image-<name>/`.
fn image_dir(build_dir: &Path, template: &str) -> PathBuf {
    if template == crate::recipe::BASE_TEMPLATE {
        build_dir.join("image")
    } else {
        build_dir.join(format!("image-{template}"))
    }
}

/// The kernel and initramfs already under `opts.build_dir`, taken as they are (no check that
/// they are current, so a caller that starts often stays fast); builds them with [`ensure`]
/// when either is missing, or the manifest beside the initramfs is.
pub fn built_or_ensure(
    opts: &BuildOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<(PathBuf, PathBuf), BuildError> {
    let (kernel, initramfs) = artifact_paths(&opts.build_dir, &opts.template);
    let manifest = manifest_path(&opts.build_dir, &opts.template);
    if kernel.is_file() && initramfs.is_file() && manifest.is_file() {
        return Ok((kernel, initramfs));
    }
    progress("no guest build found: building the kernel and image (minutes on first use)");
    let a = ensure(opts, progress)?;
    Ok((a.kernel, a.initramfs))
}

fn megabytes(bytes: u64) -> String {
    format!("{:.2} MB", bytes as f64 / 1e6)
}

/// Step 1: runs the kernel build script and returns `<build>/kernel/vmlinux`.
pub fn build_kernel(
    opts: &BuildOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, BuildError> {
    let script = opts.source_dir.join(KERNEL_SCRIPT);
    if !script.is_file() {
        return Err(BuildError::KernelScriptMissing(script));
    }
    let out_dir = opts.build_dir.join("kernel");
    let mut cmd = Command::new("bash");
    cmd.arg(&script).arg(&out_dir).current_dir(&opts.source_dir);
    progress(&run::describe(&cmd));
    run::run(&mut cmd, false, progress).map_err(BuildError::Kernel)?;
    let (vmlinux, _) = artifact_paths(&opts.build_dir, crate::recipe::BASE_TEMPLATE);
    if !vmlinux.is_file() {
        return Err(BuildError::KernelMissing(vmlinux));
    }
    Ok(vmlinux)
}

/// Step 2: builds the agent and the extension in their own target directory; returns their
/// paths.
pub fn build_guest_binaries(
    opts: &BuildOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<(PathBuf, PathBuf), BuildError> {
    let target_dir = opts.source_dir.join(GUEST_TARGET_DIR);
    // Under `cargo run`/`cargo test`, CARGO names the cargo that started us.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release"]);
    for package in GUEST_PACKAGES {
        cmd.args(["-p", package]);
    }
    cmd.arg("--target-dir")
        .arg(&target_dir)
        .current_dir(&opts.source_dir)
        // Build scripts of the guest crates (libc's, pyo3's) rerun when this changes and may
        // build other code: a caller's RUSTC_BOOTSTRAP (scripts/test-times.sh sets it for
        // libtest's timing flags) must not give the image, and so the template, new bytes.
        .env_remove("RUSTC_BOOTSTRAP");
    progress(&run::describe(&cmd));
    run::run(&mut cmd, false, progress).map_err(BuildError::GuestBinaries)?;
    let agent = target_dir.join(AGENT_BINARY);
    let extension = target_dir.join(EXTENSION_LIBRARY);
    for path in [&agent, &extension] {
        if !path.is_file() {
            return Err(BuildError::GuestBinaryMissing(path.clone()));
        }
    }
    Ok((agent, extension))
}

/// Step 4 (under the caller's [`BuildLock`]): fetches the packages (cached: Debian
/// packages, a user template's wheels, the template's npm packages) and returns the image,
/// rebuilt only when an input changed, with the packages it is made of. The agent and
/// extension are the files to place at `/init` and [`image::EXTENSION_PATH`].
pub fn build_image(
    opts: &BuildOptions,
    agent: &Path,
    extension: &Path,
    apt: &mut Apt,
    progress: &mut dyn FnMut(&str),
) -> Result<(Image, Vec<Package>), BuildError> {
    let recipe_dir = opts.source_dir.join(RECIPE_DIR);
    let recipe = Recipe::load(&recipe_dir).map_err(BuildError::Recipe)?;
    let (site, layers) = opts.site()?;
    let debs_dir = opts.build_dir.join("debs");
    let mut hashes = HashCache::load(&opts.build_dir.join(HASH_CACHE));
    let specs = &recipe.packages.debs;
    // Every template's packages share the pool of the build directory.
    let pool = opts.build_dir.join(debs::POOL_DIR);
    let dirs = |dir| debs::DebDirs { dir, pool: &pool };
    let packages = debs::fetch(
        specs,
        dirs(&debs_dir),
        apt,
        opts.refresh_packages,
        &mut hashes,
        progress,
    )
    .map_err(BuildError::Packages)?;
    let site_debs_dir = opts.build_dir.join(format!("debs-{}", opts.template));
    let site_packages = match &site {
        None => Vec::new(),
        Some(site) => debs::fetch_with_libraries(
            &site.debs,
            &packages,
            dirs(&site_debs_dir),
            apt,
            opts.refresh_packages,
            &mut hashes,
            progress,
        )
        .map_err(BuildError::Packages)?,
    };
    let user = match layers {
        None => None,
        Some(layers) => {
            let wheels = fetch_wheels(opts, &layers, &packages, progress)?;
            Some(image::UserInputs { layers, wheels })
        }
    };
    // The site's npm packages, a user template's among them (`Layers::site`).
    let npm = match site.as_ref().filter(|s| !s.npm.is_empty()) {
        None => None,
        Some(site) => Some(
            npm::fetch(&site.npm, &opts.build_dir.join(npm::CACHE_DIR), progress)
                .map_err(BuildError::Npm)?,
        ),
    };
    let mut all = packages.clone();
    all.extend(site_packages.iter().cloned());
    let egress_ca =
        crate::egress_ca::EgressCa::load_or_create(&crate::egress_ca::dir_of(&opts.build_dir))
            .map_err(BuildError::EgressCa)?;
    let inputs = ImageInputs {
        recipe_dir,
        agent: agent.to_owned(),
        extension: extension.to_owned(),
        kernel_addon: extension.with_file_name(KERNEL_ADDON_LIBRARY),
        source_dir: opts.source_dir.clone(),
        python_dir: opts.source_dir.join(PYTHON_DIR),
        debs_dir,
        packages,
        template: opts.template.clone(),
        site,
        site_debs_dir,
        site_packages,
        user,
        npm,
        trusted: Some(egress_ca.cert_pem().to_owned()),
    };
    let image = image::ensure(
        &inputs,
        &image_dir(&opts.build_dir, &opts.template),
        &mut hashes,
        progress,
    )
    .map_err(BuildError::Image);
    hashes.save();
    let image = image?;
    if image.report.is_none() {
        progress(&format!("up to date ({})", megabytes(image.size)));
    }
    Ok((image, all))
}

/// Step 5: the manifest of the image (derived from its staged files and packages, module
/// `manifest`), written beside it; also when the image was current, so that a build from
/// before manifests gets one without a rebuild.
fn write_manifest(
    opts: &BuildOptions,
    packages: &[Package],
) -> Result<manifest::Manifest, BuildError> {
    let dir = image_dir(&opts.build_dir, &opts.template);
    let rootfs = dir.join(image::ROOTFS_DIR);
    if !rootfs.join(image::INIT_PATH).is_file() {
        return Err(BuildError::StagedImageMissing(rootfs));
    }
    let (site, _) = opts.site()?;
    let m = manifest::derive(&opts.template, site.as_ref(), packages, &rootfs);
    m.write(&dir.join(MANIFEST_FILE))
        .map_err(BuildError::Manifest)?;
    Ok(m)
}

/// The wheels of a user template's Python requirements (`wheels.rs`), fetched with the pip
/// of the base image's packages (unpacked once under `<build>/pip/`) into `<build>/wheels/`.
fn fetch_wheels(
    opts: &BuildOptions,
    layers: &Layers,
    packages: &[Package],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<wheels::Wheel>, BuildError> {
    let requirements = layers.requirements();
    if requirements.is_empty() {
        return Ok(Vec::new());
    }
    let pip = packages
        .iter()
        .find(|p| p.name == PIP_PACKAGE)
        .ok_or(BuildError::NoPip)?;
    let pip_root = opts.build_dir.join("pip").join(&pip.sha256[..16]);
    let wheel = match wheels::pip_wheel(&pip_root) {
        Some(wheel) => wheel,
        None => {
            debs::extract(
                std::slice::from_ref(pip),
                &opts.build_dir.join("debs"),
                &pip_root,
                progress,
            )
            .map_err(BuildError::Packages)?;
            wheels::pip_wheel(&pip_root).ok_or(BuildError::NoPip)?
        }
    };
    wheels::fetch(
        &requirements,
        &wheel,
        &opts.build_dir.join("wheels"),
        progress,
    )
    .map_err(BuildError::Wheels)
}

/// sha256 over the kernel's and the image's sha256.
fn artifact_key(opts: &BuildOptions, kernel: &Path, image: &Image) -> Result<String, BuildError> {
    let mut hashes = HashCache::load(&opts.build_dir.join(HASH_CACHE));
    let kernel_sha = hashes.sha256(kernel).map_err(BuildError::Hash);
    hashes.save();
    let kernel_sha = kernel_sha?;
    let text = format!("kernel {kernel_sha}\ninitramfs {}\n", image.sha256);
    Ok(hex::encode(Sha256::digest(text.as_bytes())))
}

#[cfg(test)]
mod tests {
    //! End-to-end builds: `cargo test -p bud-guest -- --ignored --nocapture` (needs root,
    //! apt and a few minutes for the first kernel build; later runs are cached).

    use std::sync::OnceLock;

    use super::*;
    use crate::libs;

    fn repo_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .to_owned()
    }

    /// One real build per test process, shared by the tests below.
    fn built() -> &'static GuestArtifacts {
        static BUILT: OnceLock<GuestArtifacts> = OnceLock::new();
        BUILT.get_or_init(|| {
            ensure(&BuildOptions::new(repo_root()), &mut |line| {
                eprintln!("{line}")
            })
            .unwrap()
        })
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bud-e2e-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Unpacks the built archive with the system cpio, as root (device nodes included).
    fn unpack_archive(into: &Path) {
        unpack(&built().initramfs, into);
    }

    fn unpack(archive: &Path, into: &Path) {
        let status = Command::new("cpio")
            .args([
                "-i",
                "--quiet",
                "--no-absolute-filenames",
                "--make-directories",
                "-F",
            ])
            .arg(archive)
            .current_dir(into)
            .status()
            .unwrap();
        assert!(status.success());
    }

    fn chroot(root: &Path, args: &[&str]) -> std::process::Output {
        let chroot = host::find_program("chroot").expect("`chroot` (coreutils) is not on PATH");
        Command::new(chroot)
            .arg(root)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .output()
            .unwrap()
    }

    #[test]
    fn second_ensure_is_a_quick_no_op() {
        let first = built();
        let start = Instant::now();

        let second = ensure(&BuildOptions::new(repo_root()), &mut |line| {
            eprintln!("{line}")
        })
        .unwrap();

        eprintln!("no-op ensure took {:.2} s", start.elapsed().as_secs_f64());
        assert_eq!(second.key, first.key);
        assert!(second.image_report.is_none());
    }

    #[test]
    fn image_rebuilt_elsewhere_has_identical_bytes() {
        let first = built();
        let inputs = image_inputs(first, &repo_root().join(RECIPE_DIR));
        let work = scratch("rebuild");

        let again = image::build(&inputs, &work, "rebuild", &mut |_| {}).unwrap();

        assert_eq!(again.sha256, first.image_sha256);
        assert_eq!(again.size, first.image_size);
        std::fs::remove_dir_all(&work).unwrap();
    }

    /// The inputs of the shared build, with another recipe directory.
    fn image_inputs(built: &GuestArtifacts, recipe_dir: &Path) -> ImageInputs {
        let opts = BuildOptions::new(repo_root());
        let guest_target = opts.source_dir.join(GUEST_TARGET_DIR);
        ImageInputs {
            recipe_dir: recipe_dir.to_owned(),
            agent: guest_target.join(AGENT_BINARY),
            extension: guest_target.join(EXTENSION_LIBRARY),
            kernel_addon: guest_target.join("release").join(KERNEL_ADDON_LIBRARY),
            source_dir: opts.source_dir.clone(),
            python_dir: opts.source_dir.join(PYTHON_DIR),
            debs_dir: opts.build_dir.join("debs"),
            packages: built.packages.clone(),
            template: crate::recipe::BASE_TEMPLATE.to_owned(),
            site: None,
            site_debs_dir: opts.build_dir.join("debs-python"),
            site_packages: Vec::new(),
            user: None,
            npm: None,
            // The build directory's egress CA, as the shared build trusts it.
            trusted: Some(
                crate::egress_ca::EgressCa::load(&crate::egress_ca::dir_of(&opts.build_dir))
                    .expect("the shared build made the egress CA")
                    .cert_pem()
                    .to_owned(),
            ),
        }
    }

    #[test]
    fn image_with_sources_shows_standard_library_lines_in_tracebacks() {
        let work = scratch("sources");
        let recipe_dir = work.join("recipe");
        std::fs::create_dir_all(recipe_dir.join("overlay/etc")).unwrap();
        let recipe = std::fs::read_to_string(repo_root().join(RECIPE_DIR).join("recipe.toml"))
            .unwrap()
            .replace("ship_sources = false", "ship_sources = true");
        std::fs::write(recipe_dir.join("recipe.toml"), recipe).unwrap();
        let inputs = image_inputs(built(), &recipe_dir);
        let image = image::build(&inputs, &work.join("image"), "sources", &mut |_| {}).unwrap();
        let root = work.join("root");
        std::fs::create_dir_all(&root).unwrap();
        unpack(&image.path, &root);

        // The traceback module reads sources through the zip's loader (the interpreter's own
        // last-resort printer only opens plain files).
        let code = "import json, traceback\n\
                    try: json.loads('x')\n\
                    except ValueError: traceback.print_exc()";
        let out = chroot(&root, &["/usr/bin/python3", "-c", code]);

        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(r#"/usr/lib/python311.zip/json/decoder.py", line "#),
            "{stderr}"
        );
        assert!(stderr.contains("raise JSONDecodeError("), "{stderr}");
        std::fs::remove_dir_all(&work).unwrap();
    }

    #[test]
    fn every_elf_in_the_archive_finds_its_libraries() {
        let root = scratch("elf");
        unpack_archive(&root);

        let files = libs::check(&root).unwrap();

        for name in ["init", "usr/bin/python3.11", "usr/lib/bud/_bud.abi3.so"] {
            assert!(
                files.iter().any(|f| f.path == name),
                "{name} missing or not ELF"
            );
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn chrooted_guest_python_imports_the_standard_library() {
        let root = scratch("chroot");
        unpack_archive(&root);
        let code = "import json, decimal, hashlib, sqlite3, uuid, ctypes, lzma, bz2, zlib, \
                    pwd, getpass, subprocess, asyncio, zoneinfo, xml.etree.ElementTree, \
                    unittest, dataclasses, email, csv, re, os, sys\n\
                    print(json.dumps([str(decimal.Decimal(1) / 7)[:8], \
                    hashlib.sha256(b'').hexdigest()[:8], sqlite3.sqlite_version, \
                    len(str(uuid.uuid4())), getpass.getuser(), sys.prefix, \
                    subprocess.run(['echo', 'hi'], capture_output=True).stdout.decode()]))";

        let out = chroot(&root, &["/usr/bin/python3", "-c", code]);

        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.starts_with(r#"["0.142857", "e3b0c442", "3."#),
            "{stdout}"
        );
        assert!(
            stdout.contains(r#"36, "root", "/usr", "hi\n"]"#),
            "{stdout}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn chrooted_python_loads_bud_extension_and_modules() {
        let root = scratch("bud-modules");
        unpack_archive(&root);
        let code =
            "import sys; sys.path.insert(0, '/usr/lib/bud'); import _bud; print(_bud.__file__)";
        let modules = crate::python::bud_modules(&repo_root().join(PYTHON_DIR)).unwrap();

        let out = chroot(&root, &["/usr/bin/python3", "-c", code]);

        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "/usr/lib/bud/_bud.abi3.so\n"
        );
        for module in modules {
            let stem = module.file_stem().unwrap().to_string_lossy().into_owned();
            assert!(
                root.join(format!("usr/lib/bud/{stem}.py")).is_file(),
                "{stem}.py"
            );
            let pyc = format!("usr/lib/bud/__pycache__/{stem}.cpython-311.pyc");
            assert!(root.join(&pyc).is_file(), "{pyc}");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn chrooted_busybox_shell_runs_applets() {
        let root = scratch("shell");
        unpack_archive(&root);

        let out = chroot(
            &root,
            &[
                "/bin/sh",
                "-c",
                "echo a b c | tr ' ' '\\n' | sort -r | head -1; ls /dev",
            ],
        );

        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "c\nconsole\n");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
