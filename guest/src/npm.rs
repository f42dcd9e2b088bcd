//! A template's npm packages: fetched by the host's npm from the npm registry, checked, and
//! staged into the image. No package code runs on the host.
//!
//! - **Fetch** ([`fetch`]): the host's `npm install --ignore-scripts --no-audit --no-fund
//!   --omit=dev --no-package-lock --prefix <dir> -- <specs>`, so npm's resolver picks the
//!   versions and the dependencies, and no `preinstall`, `install` or `postinstall` script
//!   (nor node-gyp) ever runs. npm uses the machine's own configuration (its registry,
//!   certificates, proxies; bud names no registry). Each spec list is installed once, into
//!   `<build>/npm/<key>/` ([`cache_key`]: the sha256 of the sorted specs), through a
//!   temporary directory renamed into place when complete: a second build with the same
//!   list fetches nothing.
//! - **Check** ([`check_tree`]): every package of the installed tree, nested ones too, is
//!   read; one that needs an install script to work (`scripts.preinstall`, `install` or
//!   `postinstall`, a `binding.gyp`, `gypfile: true`) is refused and fails the build, named
//!   with the script: bud never runs one, and a package whose script never ran (a native
//!   addon never built, a binary never downloaded) would fail in the guest instead.
//! - **Stage** ([`stage`]): the `node_modules` tree goes to [`GLOBAL_DIR`], on the guest
//!   Node.js's global module paths, so `require('sucrase')` works from any directory (not
//!   `import`: ES modules never search global paths). Files keep their modes, the links of
//!   `.bin/` stay links (each also linked into `/usr/local/bin`, as pip puts a wheel's
//!   scripts there). Type declarations (`*.d.ts`), source maps and Markdown are left out:
//!   nothing runs them, and every initramfs entry costs the first boot time.
//!
//! A cached list is not resolved again: `lodash` stays at the version first installed until
//! its cache directory is removed (pin versions for builds that must not change).
//!
//! Why npm and not the tarballs fetched and unpacked by bud itself: npm's resolver is what
//! a spec list means (ranges, dist-tags, peer and optional dependencies, the platform's
//! optional binaries), and with `--ignore-scripts` it only downloads and unpacks. What it
//! unpacked is still checked before it is staged: a link that leads out of the tree is
//! refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::hashes::{HashCache, HashError};
use crate::run::{self, RunError};
use crate::stage::{StageError, Staging};

/// Where the packages go in the image: a global module path of Debian bookworm's Node.js.
/// Its libnode is built with `node_relative_path = lib/x86_64-linux-gnu/nodejs:share/nodejs`
/// (read from the library by [`check_search_path`] at every build), resolved against the
/// prefix of `/usr/bin/node`: `Module.globalPaths` is `$HOME/.node_modules`,
/// `$HOME/.node_libraries`, `/usr/lib/x86_64-linux-gnu/nodejs` and `/usr/share/nodejs`.
/// Not `/usr/share/nodejs`: Debian's `node-*` packages put their files there, and libnode
/// reads some of them as its own builtins (acorn, undici).
pub const GLOBAL_DIR: &str = "usr/lib/x86_64-linux-gnu/nodejs";
/// The global path as the libnode build names it (relative to Node's prefix, `/usr`).
const RELATIVE_PATH: &str = "lib/x86_64-linux-gnu/nodejs";
/// Where the links to the packages' programs go (on the worker's `PATH`).
pub const BIN_DIR: &str = "usr/local/bin";
/// The cache of installed spec lists, inside the build directory.
pub const CACHE_DIR: &str = "npm";
/// Bump when what [`fetch`] leaves in a cache directory changes (its command, its checks).
const CACHE_VERSION: u32 = 1;
/// The installed tree inside a cache directory.
const NODE_MODULES: &str = "node_modules";
/// npm's record of the tree it installed (`node_modules/.package-lock.json`): not staged.
const HIDDEN_LOCK: &str = ".package-lock.json";
/// The install hooks npm runs (and bud never does), in the order npm runs them.
const INSTALL_HOOKS: &[&str] = &["preinstall", "install", "postinstall"];
/// File name endings left out of the image (module docs).
const LEFT_OUT: &[&str] = &[
    ".d.ts",
    ".d.mts",
    ".d.cts",
    ".js.map",
    ".mjs.map",
    ".cjs.map",
    ".ts.map",
    ".md",
    ".markdown",
];
/// npm's lines worth repeating when it fails.
const ERROR_PREFIXES: &[&str] = &["npm error", "npm ERR!"];
/// How many of them an error carries, at most.
const ERROR_LINES: usize = 20;

#[derive(Debug, thiserror::Error)]
pub enum NpmError {
    #[error("npm[{index}]: {why}")]
    BadSpec { index: usize, why: String },
    #[error(
        "npm packages are fetched by the host's npm, which is not on PATH (install Node.js and \
         npm on the host)"
    )]
    NoNpm,
    #[error("create {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("npm install {specs} failed:\n{messages}")]
    Install { specs: String, messages: String },
    #[error("npm install {specs}")]
    Npm {
        specs: String,
        #[source]
        source: RunError,
    },
    #[error("npm left no {0}")]
    NoTree(PathBuf),
    #[error("read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a package.json npm could have written: {why}")]
    PackageJson { path: PathBuf, why: String },
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Refused(Vec<Refusal>),
    #[error("{path}: a link to {target}, outside the packages")]
    Escapes { path: String, target: String },
    #[error(
        "the image's Node.js does not search /usr/{RELATIVE_PATH} for modules (its relative \
         paths: {found}), where bud puts npm packages"
    )]
    NotSearched { found: String },
    #[error("stage npm packages")]
    Stage(#[from] StageError),
    #[error("hash npm packages")]
    Hash(#[from] HashError),
}

/// A package of the tree that needs a script bud never runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `name@version`.
    pub package: String,
    /// Where it is in the tree, when not at the top (`a/node_modules/b`).
    pub nested: Option<String>,
    /// What it would run: `postinstall: node install.js`, or `binding.gyp (node-gyp)`.
    pub script: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = self
            .nested
            .as_ref()
            .map(|n| format!(" (at node_modules/{n})"))
            .unwrap_or_default();
        write!(
            f,
            "{}{at}: runs an install script ({}), which bud never runs; choose a package \
             without one",
            self.package, self.script
        )
    }
}

/// A spec list installed in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpmTree {
    /// The cache directory (its `node_modules/` is what the image gets).
    pub dir: PathBuf,
    /// The specs, sorted.
    pub specs: Vec<String>,
    /// Every package at the top of `node_modules/` (the specs' and the dependencies npm
    /// hoisted there), name to version.
    pub packages: BTreeMap<String, String>,
}

impl NpmTree {
    /// The installed `node_modules/`.
    pub fn node_modules(&self) -> PathBuf {
        self.dir.join(NODE_MODULES)
    }
}

/// The package name of a spec: `lodash@4` is `lodash`, `@scope/x@^1` is `@scope/x`.
pub fn spec_name(spec: &str) -> &str {
    let from = usize::from(spec.starts_with('@'));
    match spec[from..].find('@') {
        Some(at) => &spec[..from + at],
        None => spec,
    }
}

/// Checks one spec: a package of the registry by name (`@scope/name` too), with an optional
/// version, range or dist-tag after `@`. Everything that would make npm fetch from
/// elsewhere or read a file (URLs, paths, git, `npm:` aliases, options) is refused.
pub fn check_spec(spec: &str) -> Result<(), String> {
    let name = spec_name(spec);
    let (scope, bare) = match name.strip_prefix('@') {
        Some(scoped) => match scoped.split_once('/') {
            Some((scope, bare)) => (Some(scope), bare),
            None => (None, ""),
        },
        None => (None, name),
    };
    let good_part = |part: &str| {
        part.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
    };
    let good_name = name.len() <= 214
        && good_part(bare)
        && scope.is_none_or(|s| good_part(s) && !s.bytes().any(|b| b.is_ascii_uppercase()));
    if !good_name {
        return Err(format!(
            "{} is not an npm package name (`name` or `@scope/name`, of letters, digits, '-', \
             '.', '_' and '~', starting with a letter or digit), with an optional `@version`",
            crate::echo::quote(spec)
        ));
    }
    if let Some(range) = spec[name.len()..].strip_prefix('@') {
        let good = !range.trim().is_empty()
            && range.len() <= 128
            && range.bytes().all(|b| {
                b.is_ascii_alphanumeric()
                    || matches!(
                        b,
                        b'.' | b'-' | b'+' | b'_' | b'~' | b'^' | b'<' | b'>' | b'=' | b'*'
                    )
                    || matches!(b, b'|' | b' ')
            });
        if !good {
            return Err(format!(
                "{}: only packages of the registry by name and version, range or tag (no URLs, \
                 paths, git or `npm:` aliases)",
                crate::echo::quote(spec)
            ));
        }
    }
    Ok(())
}

/// Checks a list of specs: each one ([`check_spec`]) and each package named once; the
/// fault names the spec's index.
pub fn check_specs(specs: &[String]) -> Result<(), NpmError> {
    let mut seen = std::collections::BTreeSet::new();
    for (index, spec) in specs.iter().enumerate() {
        check_spec(spec).map_err(|why| NpmError::BadSpec { index, why })?;
        if !seen.insert(spec_name(spec)) {
            return Err(NpmError::BadSpec {
                index,
                why: format!(
                    "package {} is listed twice",
                    crate::echo::quote(spec_name(spec))
                ),
            });
        }
    }
    Ok(())
}

/// The cache key of a spec list: the sha256 of the sorted specs (and of what [`fetch`]
/// does with them), so the same list in any order is installed once.
pub fn cache_key(specs: &[String]) -> String {
    let mut sorted: Vec<&str> = specs.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let mut text = format!("bud-npm {CACHE_VERSION}\n");
    for spec in sorted {
        text.push_str(spec);
        text.push('\n');
    }
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// Installs `specs` into the cache under `cache` (module docs), or finds them installed
/// there; checks the tree either way. Progress lines are npm's own.
pub fn fetch(
    specs: &[String],
    cache: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<NpmTree, NpmError> {
    check_specs(specs)?;
    let mut sorted = specs.to_vec();
    sorted.sort();
    let key = cache_key(specs);
    let create_err = |path: &Path| {
        let path = path.to_owned();
        move |source| NpmError::Create { path, source }
    };
    let cache = std::path::absolute(cache).map_err(create_err(cache))?;
    std::fs::create_dir_all(&cache).map_err(create_err(&cache))?;
    let dir = cache.join(&key[..32]);
    let listed = sorted.join(" ");
    if dir.join(NODE_MODULES).is_dir() {
        progress(&format!(
            "npm packages {listed}: cached in {}",
            dir.display()
        ));
    } else {
        let tmp = cache.join(format!(".tmp-{}-{}", &key[..32], std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(create_err(&tmp))?;
        let installed = install(&sorted, &tmp, progress).and_then(|()| {
            let node_modules = tmp.join(NODE_MODULES);
            if !node_modules.is_dir() {
                return Err(NpmError::NoTree(node_modules));
            }
            check_tree(&node_modules)
        });
        if let Err(e) = installed {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        if let Err(source) = std::fs::rename(&tmp, &dir) {
            let _ = std::fs::remove_dir_all(&tmp);
            // Another build of the same list got there first: its tree is as good.
            if !dir.join(NODE_MODULES).is_dir() {
                return Err(NpmError::Create { path: dir, source });
            }
        }
    }
    let packages = check_tree(&dir.join(NODE_MODULES))?;
    progress(&format!(
        "npm packages: {}",
        packages
            .iter()
            .map(|(name, version)| format!("{name}@{version}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(NpmTree {
        dir,
        specs: sorted,
        packages,
    })
}

/// Runs the host's npm for `specs` with `prefix` as its project.
fn install(
    specs: &[String],
    prefix: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(), NpmError> {
    let npm = crate::host::find_program("npm").ok_or(NpmError::NoNpm)?;
    let mut cmd = Command::new(npm);
    cmd.arg("install")
        .args(["--ignore-scripts", "--no-audit", "--no-fund", "--omit=dev"])
        .arg("--no-package-lock")
        .arg("--prefix")
        .arg(prefix)
        // No spec is ever read as an option (they are checked not to start with `-` too).
        .arg("--")
        .args(specs)
        .current_dir(prefix);
    progress(&format!("npm install {}", specs.join(" ")));
    let mut messages = Vec::new();
    let result = run::run(&mut cmd, false, &mut |line: &str| {
        progress(line);
        if ERROR_PREFIXES.iter().any(|p| line.starts_with(p)) {
            messages.push(line.to_owned());
        }
    });
    let specs = specs.join(" ");
    match result {
        Ok(_) => Ok(()),
        Err(RunError::Failed { .. }) if !messages.is_empty() => {
            let skip = messages.len().saturating_sub(ERROR_LINES);
            Err(NpmError::Install {
                specs,
                messages: messages[skip..].join("\n"),
            })
        }
        Err(source) => Err(NpmError::Npm { specs, source }),
    }
}

/// The package directories of the tree at `node_modules`, nested ones too: where each is
/// below `node_modules/` (`a`, `@s/b`, `a/node_modules/c`), sorted.
fn package_dirs(node_modules: &Path) -> Result<Vec<String>, NpmError> {
    let mut out = Vec::new();
    collect_packages(node_modules, "", &mut out)?;
    out.sort();
    Ok(out)
}

/// Adds the packages of the `node_modules` directory `modules` (at `prefix` in the tree) and
/// of the trees nested in them to `out`. Links are not followed (npm links no registry
/// package), so the walk ends.
fn collect_packages(modules: &Path, prefix: &str, out: &mut Vec<String>) -> Result<(), NpmError> {
    for name in sorted_dirs(modules)? {
        // `.bin`, npm's `.cache` and the like.
        if name.starts_with('.') {
            continue;
        }
        let names = if name.starts_with('@') {
            sorted_dirs(&modules.join(&name))?
                .into_iter()
                .map(|bare| format!("{name}/{bare}"))
                .collect()
        } else {
            vec![name]
        };
        for package in names {
            let rel = format!("{prefix}{package}");
            let nested = modules.join(&package).join(NODE_MODULES);
            if nested.is_dir() {
                collect_packages(&nested, &format!("{rel}/{NODE_MODULES}/"), out)?;
            }
            out.push(rel);
        }
    }
    Ok(())
}

/// The subdirectories of `dir` (not links), sorted.
fn sorted_dirs(dir: &Path) -> Result<Vec<String>, NpmError> {
    let read_err = |source| NpmError::Read {
        path: dir.to_owned(),
        source,
    };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        if entry.file_type().map_err(read_err)?.is_dir() {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// Checks every package of the tree at `node_modules` (module docs); returns the packages at
/// its top, name to version.
pub fn check_tree(node_modules: &Path) -> Result<BTreeMap<String, String>, NpmError> {
    let mut top = BTreeMap::new();
    let mut refused = Vec::new();
    for rel in package_dirs(node_modules)? {
        let dir = node_modules.join(&rel);
        let path = dir.join("package.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            // A directory without one is no package (npm leaves none such).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(NpmError::Read { path, source }),
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| NpmError::PackageJson {
                path: path.clone(),
                why: e.to_string(),
            })?;
        let name = json["name"].as_str().unwrap_or(&rel).to_owned();
        let version = json["version"].as_str().unwrap_or("?").to_owned();
        let nested = rel
            .contains(&format!("/{NODE_MODULES}/"))
            .then(|| rel.clone());
        if nested.is_none() {
            top.insert(rel.clone(), version.clone());
        }
        if let Some(script) = install_script(&json, &dir) {
            refused.push(Refusal {
                package: format!("{name}@{version}"),
                nested,
                script,
            });
        }
    }
    if refused.is_empty() {
        Ok(top)
    } else {
        Err(NpmError::Refused(refused))
    }
}

/// The packages at the top of an installed or staged tree (`node_modules/`, or [`GLOBAL_DIR`]
/// of a staged image), name to version: what a template manifest lists. Unreadable ones are
/// left out.
pub fn installed(node_modules: &Path) -> BTreeMap<String, String> {
    let Ok(dirs) = package_dirs(node_modules) else {
        return BTreeMap::new();
    };
    dirs.into_iter()
        .filter(|rel| !rel.contains(&format!("/{NODE_MODULES}/")))
        .filter_map(|rel| {
            let text =
                std::fs::read_to_string(node_modules.join(&rel).join("package.json")).ok()?;
            let json: serde_json::Value = serde_json::from_str(&text).ok()?;
            Some((rel, json["version"].as_str()?.to_owned()))
        })
        .collect()
}

/// What of package `json` (in `dir`) npm would run at install: the first install hook, or
/// node-gyp for a `binding.gyp` (npm's implicit `install: node-gyp rebuild`) or
/// `gypfile: true`.
fn install_script(json: &serde_json::Value, dir: &Path) -> Option<String> {
    for hook in INSTALL_HOOKS {
        if let Some(command) = json["scripts"][hook].as_str() {
            return Some(format!("{hook}: {}", crate::echo::excerpt(command)));
        }
    }
    if json["gypfile"].as_bool() == Some(true) {
        return Some("gypfile: true, a node-gyp build".to_owned());
    }
    if dir.join("binding.gyp").is_file() {
        return Some("binding.gyp, a node-gyp build".to_owned());
    }
    None
}

/// One entry of the tree the image gets, relative to `node_modules/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    File { rel: String, mode: u32 },
    Link { rel: String, target: String },
}

/// The files and links of `node_modules` the image gets (module docs), sorted by path; a
/// link that would lead out of the tree is refused.
pub fn entries(node_modules: &Path) -> Result<Vec<Entry>, NpmError> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut dirs = vec![String::new()];
    while let Some(dir) = dirs.pop() {
        let host = node_modules.join(&dir);
        let read_err = |source| NpmError::Read {
            path: host.clone(),
            source,
        };
        for entry in std::fs::read_dir(&host).map_err(read_err)? {
            let entry = entry.map_err(read_err)?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if dir.is_empty() {
                if name == HIDDEN_LOCK {
                    continue;
                }
                name.clone()
            } else {
                format!("{dir}/{name}")
            };
            let meta = entry.metadata().map_err(read_err)?;
            let kind = meta.file_type();
            if kind.is_dir() {
                dirs.push(rel);
            } else if kind.is_symlink() {
                let target = std::fs::read_link(entry.path())
                    .map_err(read_err)?
                    .to_string_lossy()
                    .into_owned();
                let base = Path::new(&rel)
                    .parent()
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if target.starts_with('/') || crate::stage::normalize(&base, &target).is_err() {
                    return Err(NpmError::Escapes { path: rel, target });
                }
                out.push(Entry::Link { rel, target });
            } else if kind.is_file() && !LEFT_OUT.iter().any(|end| name.ends_with(end)) {
                out.push(Entry::File {
                    rel,
                    mode: meta.permissions().mode() & 0o7777,
                });
            }
        }
    }
    out.sort_by(|a, b| a.rel().cmp(b.rel()));
    Ok(out)
}

impl Entry {
    pub fn rel(&self) -> &str {
        match self {
            Entry::File { rel, .. } | Entry::Link { rel, .. } => rel,
        }
    }
}

/// The content hash of what the image gets of `tree`: every entry's path, mode and sha256
/// (or link target). Part of the image's input key.
pub fn tree_digest(tree: &NpmTree, hashes: &mut HashCache) -> Result<String, NpmError> {
    let node_modules = tree.node_modules();
    let mut hasher = Sha256::new();
    for entry in entries(&node_modules)? {
        let line = match &entry {
            Entry::File { rel, mode } => {
                format!(
                    "file {rel} {mode:o} {}\n",
                    hashes.sha256(&node_modules.join(rel))?
                )
            }
            Entry::Link { rel, target } => format!("link {rel} {target}\n"),
        };
        hasher.update(line.as_bytes());
    }
    Ok(hex::encode(hasher.finalize()))
}

/// What [`stage`] put in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageReport {
    pub files: usize,
    pub links: usize,
    pub programs: usize,
}

/// Stages `tree` into the image at [`GLOBAL_DIR`], and links its top-level programs
/// (`node_modules/.bin/*`) into [`BIN_DIR`] where nothing is there yet.
pub fn stage(tree: &NpmTree, staging: &Staging) -> Result<StageReport, NpmError> {
    let node_modules = tree.node_modules();
    let mut report = StageReport::default();
    for entry in entries(&node_modules)? {
        match entry {
            Entry::File { rel, .. } => {
                staging.copy(&node_modules.join(&rel), &format!("{GLOBAL_DIR}/{rel}"))?;
                report.files += 1;
            }
            Entry::Link { rel, target } => {
                staging.symlink(&format!("{GLOBAL_DIR}/{rel}"), &target)?;
                report.links += 1;
                if let Some(program) = rel.strip_prefix(".bin/") {
                    let dest = format!("{BIN_DIR}/{program}");
                    if !staging.contains(&dest) {
                        staging.symlink(&dest, &format!("/{GLOBAL_DIR}/{rel}"))?;
                        report.programs += 1;
                    }
                }
            }
        }
    }
    Ok(report)
}

/// Checks that the Node.js unpacked under `root` searches [`GLOBAL_DIR`] for modules: the
/// `node_relative_path` its build recorded in libnode (or in `usr/bin/node` itself).
pub fn check_search_path(root: &Path) -> Result<(), NpmError> {
    let lib_dir = root.join("usr/lib/x86_64-linux-gnu");
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(&lib_dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnode.so"))
                && p.is_file()
        })
        .collect();
    candidates.sort();
    candidates.push(root.join("usr/bin/node"));
    let mut found = Vec::new();
    for path in candidates {
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        if let Some(paths) = relative_paths(&bytes) {
            if paths.split(':').any(|p| p == RELATIVE_PATH) {
                return Ok(());
            }
            found.push(paths);
        }
    }
    Err(NpmError::NotSearched {
        found: if found.is_empty() {
            "none recorded".to_owned()
        } else {
            found.join("; ")
        },
    })
}

/// The value of `"node_relative_path": "..."` in a Node.js build's embedded config.
fn relative_paths(bytes: &[u8]) -> Option<String> {
    let needle = b"\"node_relative_path\": \"";
    let at = bytes.windows(needle.len()).position(|w| w == needle)? + needle.len();
    let len = bytes[at..].iter().take(4096).position(|b| *b == b'"')?;
    Some(String::from_utf8_lossy(&bytes[at..at + len]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bud-npm-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn package(root: &Path, rel: &str, json: &str) {
        let dir = root.join(rel);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("package.json"), json).unwrap();
    }

    #[test]
    fn specs_name_registry_packages_only() {
        for good in [
            "sucrase@3.35.1",
            "lodash",
            "@scope/name@^1",
            "@babel/core",
            "left-pad@~1.3.0",
            "react@>=16 <19",
            "x@1.x || 2.x",
            "typescript@next",
            "JSONStream@1.3.5",
            "lodash.merge",
        ] {
            assert_eq!(check_spec(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "-g",
            "--registry=x",
            "@scope",
            "@scope/",
            "@/x",
            "@Scope/x",
            ".hidden",
            "_under",
            "a b",
            "x@",
            "x@ ",
            "x@npm:y@1",
            "x@git+ssh://h/r.git",
            "x@https://h/x.tgz",
            "x@file:../x",
            "user/repo",
            "x@user/repo#main",
            "../local",
            "/abs/path",
            "x@1;rm",
        ] {
            assert!(check_spec(bad).is_err(), "{bad:?}");
        }
        assert_eq!(spec_name("@scope/name@^1"), "@scope/name");
        assert_eq!(spec_name("@scope/name"), "@scope/name");
        assert_eq!(spec_name("sucrase@3.35.1"), "sucrase");
        assert_eq!(spec_name("lodash"), "lodash");
    }

    #[test]
    fn lists_name_the_faulty_index_and_duplicates() {
        let specs = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();

        let bad = check_specs(&specs(&["lodash", "x@file:y"])).unwrap_err();
        let twice = check_specs(&specs(&["@a/b@1", "lodash", "@a/b@2"])).unwrap_err();

        assert!(bad.to_string().starts_with("npm[1]: \"x@file:y\""), "{bad}");
        assert!(
            twice
                .to_string()
                .contains("npm[2]: package \"@a/b\" is listed twice"),
            "{twice}"
        );
        assert!(check_specs(&specs(&["a", "@s/a", "b@1"])).is_ok());
    }

    #[test]
    fn the_cache_key_is_the_sorted_list() {
        let a = cache_key(&["sucrase@3.35.1".into(), "lodash".into()]);
        let b = cache_key(&["lodash".into(), "sucrase@3.35.1".into()]);
        let c = cache_key(&["lodash".into()]);
        let d = cache_key(&["lodash@4".into()]);

        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(c, d);
        assert_eq!(a.len(), 64);
    }

    #[test]
    fn packages_that_need_install_scripts_are_refused_by_name() {
        let dir = scratch("refuse");
        let nm = dir.join("node_modules");
        package(
            &nm,
            "plain",
            r#"{"name":"plain","version":"1.0.0","scripts":{"test":"x"}}"#,
        );
        package(
            &nm,
            "esbuild",
            r#"{"name":"esbuild","version":"0.20.2","scripts":{"postinstall":"node install.js"}}"#,
        );
        package(
            &nm,
            "@s/native",
            r#"{"name":"@s/native","version":"2.0.0","gypfile":true}"#,
        );
        package(&nm, "gyp", r#"{"name":"gyp","version":"3.1.0"}"#);
        std::fs::write(nm.join("gyp/binding.gyp"), "{}").unwrap();
        package(
            &nm,
            "plain/node_modules/deep",
            r#"{"name":"deep","version":"0.1.0","scripts":{"preinstall":"sh x.sh"}}"#,
        );
        // Not packages: a package's own subdirectory with a package.json, and .bin.
        package(
            &nm,
            "plain/dist/esm",
            r#"{"type":"module","scripts":{"install":"x"}}"#,
        );
        std::fs::create_dir_all(nm.join(".bin")).unwrap();

        let err = check_tree(&nm).unwrap_err();

        let NpmError::Refused(refused) = &err else {
            panic!("{err}")
        };
        let packages: Vec<&str> = refused.iter().map(|r| r.package.as_str()).collect();
        assert_eq!(
            packages,
            [
                "@s/native@2.0.0",
                "esbuild@0.20.2",
                "gyp@3.1.0",
                "deep@0.1.0"
            ]
        );
        let text = err.to_string();
        assert!(
            text.contains(
                "esbuild@0.20.2: runs an install script (postinstall: node install.js), which \
                 bud never runs; choose a package without one"
            ),
            "{text}"
        );
        assert!(
            text.contains("deep@0.1.0 (at node_modules/plain/node_modules/deep)"),
            "{text}"
        );
        assert!(text.contains("preinstall: sh x.sh"), "{text}");
        assert!(text.contains("binding.gyp"), "{text}");
        assert!(text.contains("gypfile: true"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_clean_tree_lists_its_top_packages() {
        let dir = scratch("clean");
        let nm = dir.join("node_modules");
        package(&nm, "sucrase", r#"{"name":"sucrase","version":"3.35.1"}"#);
        package(
            &nm,
            "@jridgewell/gen-mapping",
            r#"{"name":"@jridgewell/gen-mapping","version":"0.3.13"}"#,
        );
        package(
            &nm,
            "sucrase/node_modules/commander",
            r#"{"name":"commander","version":"4.1.1"}"#,
        );

        let top = check_tree(&nm).unwrap();
        std::fs::create_dir_all(nm.join("not-a-package")).unwrap();
        let listed = installed(&nm);

        assert_eq!(
            top,
            BTreeMap::from([
                ("@jridgewell/gen-mapping".to_owned(), "0.3.13".to_owned()),
                ("sucrase".to_owned(), "3.35.1".to_owned()),
            ])
        );
        assert_eq!(listed, top);
        assert!(installed(&dir.join("none")).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_tree_is_staged_with_modes_and_links_and_without_declarations() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("stage");
        let nm = dir.join("node_modules");
        package(&nm, "tool", r#"{"name":"tool","version":"1.0.0"}"#);
        std::fs::create_dir_all(nm.join("tool/bin")).unwrap();
        std::fs::write(nm.join("tool/bin/tool.js"), "#!/usr/bin/env node\n").unwrap();
        std::fs::set_permissions(
            nm.join("tool/bin/tool.js"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        for name in ["index.js", "index.d.ts", "index.js.map", "README.md"] {
            std::fs::write(nm.join("tool").join(name), "x").unwrap();
        }
        std::fs::create_dir_all(nm.join(".bin")).unwrap();
        std::os::unix::fs::symlink("../tool/bin/tool.js", nm.join(".bin/tool")).unwrap();
        std::fs::write(nm.join(HIDDEN_LOCK), "{}").unwrap();
        let tree = NpmTree {
            dir: dir.clone(),
            specs: vec!["tool".into()],
            packages: BTreeMap::new(),
        };
        let staging = Staging::reset(&dir.join("rootfs")).unwrap();

        let report = stage(&tree, &staging).unwrap();

        assert_eq!(
            report,
            StageReport {
                files: 3,
                links: 1,
                programs: 1
            }
        );
        let at = |rel: &str| format!("{GLOBAL_DIR}/{rel}");
        assert!(staging.contains(&at("tool/index.js")));
        assert!(staging.contains(&at("tool/package.json")));
        assert!(!staging.contains(&at("tool/index.d.ts")));
        assert!(!staging.contains(&at("tool/index.js.map")));
        assert!(!staging.contains(&at("tool/README.md")));
        assert!(!staging.contains(&at(HIDDEN_LOCK)));
        let mode = std::fs::metadata(staging.path(&at("tool/bin/tool.js")))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        assert_eq!(
            std::fs::read_link(staging.path(&at(".bin/tool"))).unwrap(),
            Path::new("../tool/bin/tool.js")
        );
        assert_eq!(
            std::fs::read_link(staging.path("usr/local/bin/tool")).unwrap(),
            Path::new("/usr/lib/x86_64-linux-gnu/nodejs/.bin/tool")
        );
        // The digest follows the content.
        let mut hashes = HashCache::load(&dir.join("hashes.tsv"));
        let before = tree_digest(&tree, &mut hashes).unwrap();
        std::fs::write(nm.join("tool/index.d.ts"), "changed, but left out").unwrap();
        assert_eq!(tree_digest(&tree, &mut hashes).unwrap(), before);
        std::fs::write(nm.join("tool/index.js"), "changed").unwrap();
        assert_ne!(tree_digest(&tree, &mut hashes).unwrap(), before);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn links_out_of_the_tree_are_refused() {
        let dir = scratch("escape");
        let nm = dir.join("node_modules");
        std::fs::create_dir_all(nm.join(".bin")).unwrap();
        std::os::unix::fs::symlink("../../../etc/passwd", nm.join(".bin/evil")).unwrap();

        let err = entries(&nm).unwrap_err();

        assert!(
            matches!(err, NpmError::Escapes { ref path, .. } if path == ".bin/evil"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_search_path_is_read_from_the_node_build() {
        let dir = scratch("search");
        let lib = dir.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        let config = |paths: &str| {
            format!("\0\0{{ \"variables\": {{ \"node_relative_path\": \"{paths}\", \"x\": 1 }} }}")
        };

        std::fs::write(lib.join("libnode.so.108"), config("share/nodejs")).unwrap();
        let missing = check_search_path(&dir).unwrap_err().to_string();
        std::fs::write(
            lib.join("libnode.so.108"),
            config("lib/x86_64-linux-gnu/nodejs:share/nodejs"),
        )
        .unwrap();

        assert!(missing.contains("share/nodejs"), "{missing}");
        assert!(check_search_path(&dir).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
