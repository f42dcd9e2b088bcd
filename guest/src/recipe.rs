//! The declarative part of the image: `guest/image/recipe.toml`, parsed and checked.
//!
//! This module owns the recipe's schema and its path patterns. It never touches the staging
//! tree; `image.rs` acts on what it says.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The recipe file, relative to the recipe directory.
pub const RECIPE_FILE: &str = "recipe.toml";
/// Files copied verbatim into the image, relative to the recipe directory.
pub const OVERLAY_DIR: &str = "overlay";
/// Template recipes (`<name>.toml`: what a template adds to the base image), relative to the
/// recipe directory.
pub const TEMPLATES_DIR: &str = "templates";
/// The template of the base image alone (no template recipe).
pub const BASE_TEMPLATE: &str = "python";

#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error("read recipe {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parse recipe {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("recipe lists package `{0}` twice")]
    DuplicatePackage(String),
    #[error("recipe path `{0}` must be relative, without `.` or `..`")]
    BadPath(String),
    #[error("unknown template `{name}` (known: {})", .known.join(", "))]
    UnknownTemplate { name: String, known: Vec<String> },
    #[error("template recipe {template}: {source}")]
    Npm {
        template: String,
        #[source]
        source: crate::npm::NpmError,
    },
    #[error(
        "template recipe {0}: `npm` packages need Node.js, a `[site.runtime]` whose interpreter \
         is node"
    )]
    NpmWithoutNode(String),
    #[error("template recipe {template}: program runtime {index}, `{field}`: {why}")]
    Program {
        template: String,
        index: usize,
        field: &'static str,
        why: String,
    },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub packages: Packages,
    pub busybox: Busybox,
    pub python: Python,
    pub rootfs: Rootfs,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Packages {
    /// `name` or `name=version`.
    pub debs: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Busybox {
    pub exclude: Vec<String>,
    pub require: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Python {
    pub ship_sources: bool,
    pub drop: Vec<String>,
    pub drop_dynload: Vec<String>,
    /// Wheels of the packages shipped as one precompiled zip each (`zipped.rs`): guest path
    /// of the zip -> a pattern (`*` within the last component) matching exactly one wheel
    /// of the unpacked packages.
    #[serde(default)]
    pub zipped: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rootfs {
    pub dirs: BTreeMap<String, u32>,
    pub links: BTreeMap<String, String>,
    pub char_devs: Vec<CharDev>,
    /// Certificate bundles: guest path -> a directory of the packages whose `*.crt` files,
    /// in name order, are concatenated into it.
    #[serde(default)]
    pub bundles: BTreeMap<String, String>,
}

/// What a template adds to the base image: `guest/image/templates/<name>.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Site {
    /// Debian packages (Python modules, data, programs), `name` or `name=version`; the
    /// shared-library packages they depend on are found by the builder
    /// (`debs::fetch_with_libraries`, which reads `Depends` only: a library named in
    /// `Pre-Depends`, such as bash's libtinfo6, is listed here).
    pub debs: Vec<String>,
    /// Paths under `dist-packages` left out (patterns as `python.drop`); for `share`, the
    /// patterns match the path from the root.
    pub drop: Vec<String>,
    /// Files and directories outside `dist-packages` the image takes from the packages, from
    /// the root: data the Python packages read at run time, or programs (`bin/bash`).
    #[serde(default)]
    pub share: Vec<String>,
    /// Libraries that several Debian packages provide through the alternatives system, and
    /// the one the image uses: library file name (`libblas.so.3`) -> its subdirectory of
    /// `usr/lib/x86_64-linux-gnu` (`openblas-serial`). The image gets the link
    /// `update-alternatives` would make when that package is installed (the builder unpacks
    /// packages and runs no maintainer scripts); an unlisted one takes the first subdirectory
    /// by name (`blas`, the reference BLAS, before `openblas-*`).
    #[serde(default)]
    pub alternatives: BTreeMap<String, String>,
    /// npm packages (`name`, `name@version`, `@scope/name@range`), fetched by the host's npm
    /// without their install scripts (`npm.rs`) and staged on Node.js's global module path;
    /// only with a `runtime` whose interpreter is node.
    #[serde(default)]
    pub npm: Vec<String>,
    /// Modules the worker imports before READY.
    pub preload: Vec<String>,
    /// Code-context kernels the worker starts before READY, so that as many contexts of a
    /// session start at once (`guest/python/bud_kernel.py`; each holds guest memory in
    /// every clone and costs its start at the template's build).
    #[serde(default)]
    pub kernels: u32,
    /// Python code (a file next to the template recipe) the worker runs before READY, after
    /// the imports: it drives the common code paths once.
    pub warm: Option<String>,
    /// A runtime the template adds beside Python and the shell, run by a warm kernel program
    /// of bud's (`guest/node/kernel.js` for JavaScript): `[site.runtime]`.
    #[serde(default)]
    pub runtime: Option<KernelRuntime>,
    /// Runtimes run by an interpreter of the image on a file of code, a process per job
    /// (`[[site.programs]]`, a user template's `runtimes`: `crate::program`), in their wire
    /// order.
    #[serde(default)]
    pub programs: Vec<crate::program::ProgramRuntime>,
    /// Guest RAM in MiB.
    pub ram_mib: u64,
    /// How long the template's first boot may take to READY, in seconds (the guest kernel
    /// unpacks the whole image first: minutes for a big one under kvm_pvm).
    pub boot_timeout_s: u64,
}

/// A kernel runtime of a template recipe (`[site.runtime]`): the manifest's runtime entry
/// (`run: "kernel"`) and what the image needs for it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelRuntime {
    /// What a job names (`javascript`).
    pub name: String,
    /// Other names for it (`js`, `node`).
    #[serde(default)]
    pub aliases: Vec<String>,
    /// The Debian package whose upstream version is the runtime's (`nodejs`).
    pub package: String,
    /// The program that runs the kernel (`/usr/bin/node`).
    pub interpreter: String,
    /// The interpreter's arguments before READY; the kernel program among them is one of
    /// [`Self::files`] staged under `/usr/lib/bud/<dir name>/`.
    pub kernel: Vec<String>,
    /// bud's files of the kernel, a directory of the source tree (`guest/node`): staged
    /// under `/usr/lib/bud/<its name>/`, with the kernel's addon (`bud.node`).
    pub files: String,
    /// Whether it is the template's default runtime (a job that names none), which also
    /// makes it the one that holds the doorbell at READY (`guest/python/bud_runtime.py`).
    #[serde(default)]
    pub default: bool,
    /// Other languages the same kernel runs, each a runtime of its own (TypeScript, which
    /// the JavaScript kernel strips of its types): `[[site.runtime.dialects]]`. The `n`-th
    /// is dialect `n` on the wire; the kernel is told their names and refuses to start if
    /// it knows one not.
    #[serde(default)]
    pub dialects: Vec<Dialect>,
}

/// A language a kernel runtime's kernel also runs (`[[site.runtime.dialects]]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dialect {
    /// What a job names (`typescript`), as the kernel knows it.
    pub name: String,
    /// Other names for it (`ts`).
    #[serde(default)]
    pub aliases: Vec<String>,
}

impl Site {
    /// Whether the template runs Node.js: its kernel runtime's interpreter is `node`.
    pub fn has_node(&self) -> bool {
        self.runtime.as_ref().is_some_and(|r| {
            Path::new(&r.interpreter)
                .file_name()
                .is_some_and(|n| n == "node")
        })
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateFile {
    site: Site,
}

/// The names of the templates `dir` (a recipe directory) defines: the base one and one per
/// template recipe, sorted.
pub fn template_names(dir: &Path) -> Vec<String> {
    let mut names = vec![BASE_TEMPLATE.to_owned()];
    if let Ok(entries) = std::fs::read_dir(dir.join(TEMPLATES_DIR)) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(stem) = name.strip_suffix(".toml") {
                names.push(stem.to_owned());
            }
        }
    }
    names.sort();
    names
}

/// The template recipe of `name` in recipe directory `dir`: `None` for the base template.
pub fn load_site(dir: &Path, name: &str) -> Result<Option<Site>, RecipeError> {
    if name == BASE_TEMPLATE {
        return Ok(None);
    }
    let known = template_names(dir);
    if !known.iter().any(|k| k == name) {
        return Err(RecipeError::UnknownTemplate {
            name: name.to_owned(),
            known,
        });
    }
    let path = dir.join(TEMPLATES_DIR).join(format!("{name}.toml"));
    let text = std::fs::read_to_string(&path).map_err(|source| RecipeError::Read {
        path: path.clone(),
        source,
    })?;
    let file: TemplateFile =
        toml::from_str(&text).map_err(|source| RecipeError::Parse { path, source })?;
    let mut seen = std::collections::BTreeSet::new();
    for spec in &file.site.debs {
        if !seen.insert(package_name(spec)) {
            return Err(RecipeError::DuplicatePackage(package_name(spec).to_owned()));
        }
    }
    for (library, dir) in &file.site.alternatives {
        if [library, dir]
            .iter()
            .any(|part| part.is_empty() || part.contains('/') || part.starts_with('.'))
        {
            return Err(RecipeError::BadPath(format!("{library} = {dir}")));
        }
    }
    if let Some(warm) = &file.site.warm
        && !is_relative_clean(warm)
    {
        return Err(RecipeError::BadPath(warm.clone()));
    }
    for (index, program) in file.site.programs.iter().enumerate() {
        program
            .check()
            .map_err(|(field, why)| RecipeError::Program {
                template: name.to_owned(),
                index,
                field,
                why,
            })?;
    }
    if !file.site.npm.is_empty() {
        crate::npm::check_specs(&file.site.npm).map_err(|source| RecipeError::Npm {
            template: name.to_owned(),
            source,
        })?;
        if !file.site.has_node() {
            return Err(RecipeError::NpmWithoutNode(name.to_owned()));
        }
    }
    Ok(Some(file.site))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CharDev {
    pub path: String,
    pub mode: u32,
    pub major: u32,
    pub minor: u32,
}

impl Recipe {
    /// Reads and checks `<dir>/recipe.toml`.
    pub fn load(dir: &Path) -> Result<Recipe, RecipeError> {
        let path = dir.join(RECIPE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| RecipeError::Read {
            path: path.clone(),
            source,
        })?;
        Recipe::parse(&text).map_err(|e| match e {
            RecipeError::Parse { source, .. } => RecipeError::Parse { path, source },
            other => other,
        })
    }

    /// Parses and checks recipe text.
    pub fn parse(text: &str) -> Result<Recipe, RecipeError> {
        let recipe: Recipe = toml::from_str(text).map_err(|source| RecipeError::Parse {
            path: PathBuf::new(),
            source,
        })?;
        let mut seen = std::collections::BTreeSet::new();
        for spec in &recipe.packages.debs {
            if !seen.insert(package_name(spec)) {
                return Err(RecipeError::DuplicatePackage(package_name(spec).to_owned()));
            }
        }
        let paths = recipe.rootfs.dirs.keys().chain(recipe.rootfs.links.keys());
        for path in paths.chain(recipe.rootfs.char_devs.iter().map(|d| &d.path)) {
            if !is_relative_clean(path) {
                return Err(RecipeError::BadPath(path.clone()));
            }
        }
        Ok(recipe)
    }
}

/// The package name of a `name` or `name=version` spec.
pub fn package_name(spec: &str) -> &str {
    spec.split_once('=').map_or(spec, |(name, _)| name)
}

/// The pinned version of a `name=version` spec.
pub fn package_version(spec: &str) -> Option<&str> {
    spec.split_once('=').map(|(_, version)| version)
}

fn is_relative_clean(path: &str) -> bool {
    !path.is_empty()
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Matches one path component against a pattern component where `*` stands for any run of
/// characters.
fn component_matches(pattern: &str, name: &str) -> bool {
    let Some((first, rest)) = pattern.split_once('*') else {
        return pattern == name;
    };
    let Some(mut tail) = name.strip_prefix(first) else {
        return false;
    };
    let mut parts: Vec<&str> = rest.split('*').collect();
    let last = parts.pop().unwrap_or("");
    for part in parts {
        match tail.find(part) {
            Some(at) => tail = &tail[at + part.len()..],
            None => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last)
}

/// True when `pattern` (see `python.drop` in the recipe) drops `path`, a `/`-separated path
/// relative to the same root: the pattern must match a leading run of its components.
pub fn pattern_drops(pattern: &str, path: &str) -> bool {
    let components: Vec<&str> = path.split('/').collect();
    let prefix_match = |pattern: &str, start: usize| {
        let pattern: Vec<&str> = pattern.split('/').collect();
        components.len() >= start + pattern.len()
            && pattern
                .iter()
                .zip(&components[start..])
                .all(|(p, c)| component_matches(p, c))
    };
    match pattern.strip_prefix("**/") {
        Some(rest) => (0..components.len()).any(|start| prefix_match(rest, start)),
        None => prefix_match(pattern, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_templates_load_and_unknown_ones_are_named() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("image");

        let names = template_names(&dir);
        let ds = load_site(&dir, "datascience").unwrap().unwrap();
        let tools = load_site(&dir, "tools").unwrap().unwrap();
        let node = load_site(&dir, "node").unwrap().unwrap();
        let err = load_site(&dir, "nope").unwrap_err().to_string();

        assert_eq!(names, ["datascience", "node", "python", "tools"]);
        assert!(node.has_node() && !ds.has_node() && !tools.has_node());
        assert!(node.npm.iter().any(|p| p == "sucrase@3.35.1"), "{node:?}");
        assert!(ds.npm.is_empty());
        assert!(load_site(&dir, BASE_TEMPLATE).unwrap().is_none());
        assert!(ds.debs.iter().any(|d| d == "python3-pandas"), "{ds:?}");
        assert_eq!(ds.preload[0], "numpy");
        assert_eq!(ds.kernels, 1);
        assert!(dir.join(TEMPLATES_DIR).join(ds.warm.unwrap()).is_file());
        assert!(tools.share.iter().any(|p| p == "bin/bash"), "{tools:?}");
        assert!(
            tools.preload.is_empty() && tools.warm.is_none(),
            "{tools:?}"
        );
        assert_eq!(
            err,
            "unknown template `nope` (known: datascience, node, python, tools)"
        );
    }

    #[test]
    fn npm_packages_need_node_and_valid_specs() {
        let dir = std::env::temp_dir().join(format!("bud-recipe-npm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join(TEMPLATES_DIR)).unwrap();
        let site = "[site]\ndebs = []\ndrop = []\npreload = []\nram_mib = 256\n\
                    boot_timeout_s = 60\n";
        let runtime = "[site.runtime]\nname = \"javascript\"\npackage = \"nodejs\"\n\
                       interpreter = \"/usr/bin/node\"\nkernel = []\nfiles = \"guest/node\"\n";
        let write = |name: &str, text: String| {
            std::fs::write(dir.join(TEMPLATES_DIR).join(format!("{name}.toml")), text).unwrap()
        };
        write("plain", format!("{site}npm = [\"lodash\"]\n"));
        write("bad", format!("{site}npm = [\"x@file:y\"]\n{runtime}"));
        write("good", format!("{site}npm = [\"lodash@4\"]\n{runtime}"));

        let plain = load_site(&dir, "plain").unwrap_err().to_string();
        let bad = load_site(&dir, "bad").unwrap_err();
        let good = load_site(&dir, "good").unwrap().unwrap();

        assert!(plain.contains("need Node.js"), "{plain}");
        assert!(
            matches!(&bad, RecipeError::Npm { template, .. } if template == "bad"),
            "{bad}"
        );
        assert_eq!(good.npm, ["lodash@4"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_recipe_declares_program_runtimes_checked_as_a_definitions_are() {
        let dir = std::env::temp_dir().join(format!("bud-recipe-prog-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join(TEMPLATES_DIR)).unwrap();
        let site = "[site]\ndebs = [\"lua5.4\"]\ndrop = []\npreload = []\nram_mib = 256\n\
                    boot_timeout_s = 60\n";
        let write = |name: &str, text: String| {
            std::fs::write(dir.join(TEMPLATES_DIR).join(format!("{name}.toml")), text).unwrap()
        };
        write(
            "good",
            format!("{site}[[site.programs]]\nname = \"lua\"\ncommand = [\"lua5.4\"]\n"),
        );
        write(
            "bad",
            format!("{site}[[site.programs]]\nname = \"lua\"\ncommand = [\"../lua\"]\n"),
        );

        let good = load_site(&dir, "good").unwrap().unwrap();
        let bad = load_site(&dir, "bad").unwrap_err();

        assert_eq!(good.programs[0].command, ["lua5.4"]);
        assert!(
            matches!(&bad, RecipeError::Program { template, index: 0, field: "command", .. } if template == "bad"),
            "{bad}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn repository_recipe_parses() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("image");

        let recipe = Recipe::load(&dir).unwrap();

        assert!(
            recipe
                .packages
                .debs
                .iter()
                .any(|d| d == "python3.11-minimal")
        );
        assert_eq!(recipe.rootfs.dirs["tmp"], 0o1777);
        assert_eq!(recipe.rootfs.char_devs[0].path, "dev/console");
    }

    #[test]
    fn unknown_field_is_an_error() {
        let text = "[packages]\ndebs = []\nextra = 1\n";

        assert!(matches!(
            Recipe::parse(text),
            Err(RecipeError::Parse { .. })
        ));
    }

    #[test]
    fn duplicate_package_is_an_error() {
        let text = r#"
            [packages]
            debs = ["a", "a=1.0"]
            [busybox]
            exclude = []
            require = []
            [python]
            ship_sources = false
            drop = []
            drop_dynload = []
            [rootfs]
            dirs = {}
            links = {}
            char_devs = []
        "#;

        assert!(matches!(Recipe::parse(text), Err(RecipeError::DuplicatePackage(n)) if n == "a"));
    }

    #[test]
    fn spec_splits_name_and_version() {
        assert_eq!(package_name("libc6=2.36-9"), "libc6");
        assert_eq!(package_version("libc6=2.36-9"), Some("2.36-9"));
        assert_eq!(package_version("libc6"), None);
    }

    #[test]
    fn patterns_drop_paths_and_subtrees() {
        assert!(pattern_drops("test", "test"));
        assert!(pattern_drops("test", "test/support/x.py"));
        assert!(!pattern_drops("test", "unittest/x.py"));
        assert!(!pattern_drops("test", "testing.py"));
        assert!(pattern_drops("**/test", "unittest/test/x.py"));
        assert!(pattern_drops("**/test", "test/x.py"));
        assert!(!pattern_drops("**/test", "unittest/case.py"));
        assert!(pattern_drops(
            "config-3.11-*",
            "config-3.11-x86_64-linux-gnu/Makefile"
        ));
        assert!(pattern_drops("*.txt", "LICENSE.txt"));
        assert!(!pattern_drops("*.txt", "a/LICENSE.txt"));
        assert!(pattern_drops("a*b*c", "aXXbYYc"));
        assert!(!pattern_drops("a*b*c", "aXXbYY"));
    }
}
