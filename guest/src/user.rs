//! User templates on disk: each definition ([`Definition`]) kept as canonical JSON in
//! `<build>/user-templates/<name>.json`, and what a build makes of one ([`Layers`]): the
//! built-in template at the bottom of its `from` chain, and everything the chain adds.
//!
//! The build directory is where every guest build and template snapshot is cached, so a
//! user template's definition lives beside its image (`<build>/image-<name>/`) and its
//! snapshot (`<build>/templates/<key>/`): a server restarted on the same build directory
//! finds all three. A definition is written only once its build succeeded
//! ([`crate::pipeline`]); a failed build leaves nothing registered.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::definition::{Definition, DefinitionError, Limits};
use crate::recipe::{self, Site};

/// The directory of definitions, inside the build directory.
pub const DIR: &str = "user-templates";
/// How deep a `from` chain of user templates may go.
const MAX_DEPTH: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("template {0} is built into bud; a user template needs another name")]
    BuiltIn(String),
    #[error("no template {name} to build from (built-in: {}; user: {})", .built_in.join(", "), none_if_empty(.user))]
    UnknownBase {
        name: String,
        built_in: Vec<String>,
        user: Vec<String>,
    },
    #[error("the `from` chain of {0} is longer than {MAX_DEPTH} or loops")]
    Chain(String),
    #[error("read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the stored definition {path} is not valid: {source}")]
    Stored {
        path: PathBuf,
        #[source]
        source: DefinitionError,
    },
    #[error("write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Recipe(#[from] recipe::RecipeError),
    #[error(
        "npm: npm packages need Node.js: build from the node template (or a user template from \
         it); {template} builds on {base}, which has none"
    )]
    NpmNeedsNode { template: String, base: String },
    #[error(
        "runtimes: {name} is a runtime of {base} already; a program runtime needs a name of its own"
    )]
    RuntimeTaken { name: String, base: String },
    #[error("runtimes: {count} program runtimes with those of the templates below; at most {max}")]
    TooManyRuntimes { count: usize, max: usize },
}

impl UserError {
    /// The definition's field at fault, when one is (`npm`).
    pub fn field(&self) -> Option<&'static str> {
        match self {
            UserError::NpmNeedsNode { .. } => Some("npm"),
            UserError::RuntimeTaken { .. } | UserError::TooManyRuntimes { .. } => Some("runtimes"),
            _ => None,
        }
    }
}

fn none_if_empty(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// Where `name`'s definition is kept under `build_dir`.
pub fn path(build_dir: &Path, name: &str) -> PathBuf {
    build_dir.join(DIR).join(format!("{name}.json"))
}

/// The stored definition of user template `name`, if there is one.
pub fn load(build_dir: &Path, name: &str) -> Result<Option<Definition>, UserError> {
    let path = path(build_dir, name);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(UserError::Read { path, source }),
    };
    // Stored definitions were checked when saved; the default limits are the widest a
    // server uses, so a stricter server still serves what a looser one built.
    let unlimited = Limits {
        packages: usize::MAX,
        inline_bytes: usize::MAX,
        files: usize::MAX,
        min_memory_mib: 0,
        max_memory_mib: u64::MAX,
        archive: crate::archive::ArchiveLimits::UNLIMITED,
        archives: usize::MAX,
    };
    Definition::from_json(&bytes, &unlimited)
        .map(Some)
        .map_err(|source| UserError::Stored { path, source })
}

/// The names of the stored user templates, sorted.
pub fn names(build_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(build_dir.join(DIR))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".json").map(str::to_owned)
        })
        .filter(|n| crate::definition::valid_name(n))
        .collect();
    names.sort();
    names
}

/// Stores `def` (atomically: a reader sees the old definition or the new one).
pub fn save(build_dir: &Path, def: &Definition) -> Result<(), UserError> {
    let path = path(build_dir, &def.name);
    let write_err = |source| UserError::Write {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(build_dir.join(DIR)).map_err(write_err)?;
    let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    std::fs::write(&tmp, def.to_json()).map_err(write_err)?;
    std::fs::rename(&tmp, &path).map_err(write_err)
}

/// Forgets user template `name`'s definition (its image and snapshot stay in the cache
/// until the build directory is cleaned). `false` if there was none.
pub fn remove(build_dir: &Path, name: &str) -> Result<bool, UserError> {
    let path = path(build_dir, name);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(UserError::Write { path, source }),
    }
}

/// A user template as a build sees it: the built-in template at the bottom of its chain,
/// and the user definitions from the bottom up (the template's own last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layers {
    pub base: String,
    pub chain: Vec<Definition>,
}

impl Layers {
    /// Resolves `def`'s `from` chain: user templates stored under `build_dir`, down to one
    /// of the built-in templates of `recipe_dir`.
    pub fn resolve(
        def: &Definition,
        recipe_dir: &Path,
        build_dir: &Path,
    ) -> Result<Layers, UserError> {
        let built_in = recipe::template_names(recipe_dir);
        if built_in.contains(&def.name) {
            return Err(UserError::BuiltIn(def.name.clone()));
        }
        let mut chain = vec![def.clone()];
        loop {
            let from = chain.last().map(|d| d.from.clone()).unwrap_or_default();
            if built_in.contains(&from) {
                chain.reverse();
                return Ok(Layers { base: from, chain });
            }
            if chain.len() > MAX_DEPTH || chain.iter().any(|d| d.name == from) {
                return Err(UserError::Chain(def.name.clone()));
            }
            match load(build_dir, &from)? {
                Some(next) => chain.push(next),
                None => {
                    return Err(UserError::UnknownBase {
                        name: from,
                        built_in,
                        user: names(build_dir),
                    });
                }
            }
        }
    }

    /// The stored user template `name`'s layers; `None` if it is not a stored one.
    pub fn of_stored(
        name: &str,
        recipe_dir: &Path,
        build_dir: &Path,
    ) -> Result<Option<Layers>, UserError> {
        match load(build_dir, name)? {
            Some(def) => Self::resolve(&def, recipe_dir, build_dir).map(Some),
            None => Ok(None),
        }
    }

    /// The template's own definition.
    pub fn top(&self) -> &Definition {
        self.chain.last().expect("a chain has its template")
    }

    /// Debian packages of every layer, each named once (a later pin wins).
    pub fn apt(&self) -> Vec<String> {
        let mut by_name: BTreeMap<&str, &str> = BTreeMap::new();
        let mut order = Vec::new();
        for spec in self.chain.iter().flat_map(|d| &d.apt) {
            let name = recipe::package_name(spec);
            if by_name.insert(name, spec).is_none() {
                order.push(name);
            }
        }
        order.iter().map(|n| by_name[n].to_owned()).collect()
    }

    /// npm packages of every layer, each named once (a later layer's spec wins), installed
    /// together with the base template's.
    pub fn npm(&self) -> Vec<String> {
        let mut by_name: BTreeMap<&str, &str> = BTreeMap::new();
        let mut order = Vec::new();
        for spec in self.chain.iter().flat_map(|d| &d.npm) {
            let name = crate::npm::spec_name(spec);
            if by_name.insert(name, spec).is_none() {
                order.push(name);
            }
        }
        order.iter().map(|n| by_name[n].to_owned()).collect()
    }

    /// Python requirements of every layer, resolved together.
    pub fn requirements(&self) -> Vec<String> {
        self.chain.iter().flat_map(|d| d.requirements()).collect()
    }

    /// Files of every layer (a later layer's file replaces an earlier one at its path).
    pub fn files(&self) -> BTreeMap<String, String> {
        self.chain.iter().flat_map(|d| d.files.clone()).collect()
    }

    /// Directories given as archives by every layer, bottom up (a later layer's files
    /// replace an earlier one's at the same path).
    pub fn archives(&self) -> Vec<(String, String)> {
        self.chain.iter().flat_map(|d| d.archives.clone()).collect()
    }

    /// Environment of every layer (a later layer's value wins).
    pub fn env(&self) -> BTreeMap<String, String> {
        self.chain.iter().flat_map(|d| d.env.clone()).collect()
    }

    /// The working directory the nearest layer sets.
    pub fn workdir(&self) -> Option<String> {
        self.chain.iter().rev().find_map(|d| d.workdir.clone())
    }

    /// Each layer's warm-up code, bottom up.
    pub fn warm(&self) -> Vec<String> {
        self.chain.iter().filter_map(|d| d.warm.clone()).collect()
    }

    /// Guest RAM the nearest layer asks for.
    pub fn memory_mib(&self) -> Option<u64> {
        self.chain.iter().rev().find_map(|d| d.memory_mib)
    }

    /// Whether sandboxes get a network card: the nearest layer that says.
    pub fn network(&self) -> Option<bool> {
        self.chain.iter().rev().find_map(|d| d.network)
    }

    /// The build's site: the built-in base's (if it has one) with the layers' Debian and npm
    /// packages added, their RAM, and boot time for a bigger image. npm packages need a base
    /// with Node.js ([`Site::has_node`]).
    pub fn site(&self, recipe_dir: &Path) -> Result<Site, UserError> {
        let mut site = recipe::load_site(recipe_dir, &self.base)?.unwrap_or_else(|| Site {
            debs: Vec::new(),
            drop: Vec::new(),
            share: Vec::new(),
            alternatives: BTreeMap::new(),
            npm: Vec::new(),
            preload: Vec::new(),
            kernels: 0,
            warm: None,
            runtime: None,
            programs: Vec::new(),
            ram_mib: vmm_default_ram_mib(),
            boot_timeout_s: 600,
        });
        for spec in self.apt() {
            let name = recipe::package_name(&spec);
            site.debs.retain(|d| recipe::package_name(d) != name);
            site.debs.push(spec);
        }
        let npm = self.npm();
        if !npm.is_empty() && !site.has_node() {
            return Err(UserError::NpmNeedsNode {
                template: self.top().name.clone(),
                base: self.base.clone(),
            });
        }
        for spec in npm {
            let name = crate::npm::spec_name(&spec);
            site.npm.retain(|s| crate::npm::spec_name(s) != name);
            site.npm.push(spec);
        }
        self.add_programs(&mut site)?;
        if let Some(mib) = self.memory_mib() {
            site.ram_mib = mib;
        }
        // The first boot unpacks the whole image on kvm_pvm (~1 s per MB): room for big ones.
        site.boot_timeout_s = site.boot_timeout_s.max(1800);
        Ok(site)
    }

    /// The layers' program runtimes added to `site`'s, bottom up (a runtime of a name
    /// already there replaces it in its place, keeping its number); no name or alias may be
    /// taken twice, nor by the base's kernel runtime and its dialects.
    fn add_programs(&self, site: &mut Site) -> Result<(), UserError> {
        for runtime in self.chain.iter().flat_map(|d| &d.runtimes) {
            match site.programs.iter_mut().find(|r| r.name == runtime.name) {
                Some(slot) => *slot = runtime.clone(),
                None => site.programs.push(runtime.clone()),
            }
        }
        let kernel = site.runtime.iter().flat_map(|r| {
            let dialects = r
                .dialects
                .iter()
                .flat_map(|d| std::iter::once(&d.name).chain(&d.aliases));
            std::iter::once(&r.name).chain(&r.aliases).chain(dialects)
        });
        let mut names: std::collections::BTreeSet<&str> = kernel.map(String::as_str).collect();
        for name in site.programs.iter().flat_map(|r| r.names()) {
            if !names.insert(name) {
                return Err(UserError::RuntimeTaken {
                    name: name.to_owned(),
                    base: self.base.clone(),
                });
            }
        }
        if site.programs.len() > crate::program::MAX_PROGRAMS {
            return Err(UserError::TooManyRuntimes {
                count: site.programs.len(),
                max: crate::program::MAX_PROGRAMS,
            });
        }
        Ok(())
    }
}

/// The base template's guest RAM (the VMM's default, 256 MiB), in MiB.
fn vmm_default_ram_mib() -> u64 {
    256
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bud-user-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("templates")).unwrap();
        dir
    }

    fn def(text: &str) -> Definition {
        Definition::from_toml(text, &Limits::default()).unwrap()
    }

    #[test]
    fn chains_resolve_to_a_built_in_and_merge_bottom_up() {
        let dir = scratch("chain");
        let recipe_dir = dir.join("recipe");
        std::fs::create_dir_all(recipe_dir.join("templates")).unwrap();
        let a = def(
            "name = \"a\"\napt = [\"jq\"]\npip = [\"tabulate\"]\nenv = { X = \"1\", Y = \"a\" }\n\
             workdir = \"/w\"\nwarm = \"import tabulate\"\nmemory_mib = 512",
        );
        let b = def(
            "name = \"b\"\nfrom = \"a\"\napt = [\"jq=1.6-2.1\", \"sqlite3\"]\npip = [\"idna\"]\n\
             env = { Y = \"b\" }\nwarm = \"import idna\"",
        );
        save(&dir, &a).unwrap();
        save(&dir, &b).unwrap();

        let layers = Layers::of_stored("b", &recipe_dir, &dir).unwrap().unwrap();

        assert_eq!(layers.base, "python");
        assert_eq!(layers.chain, [a, b]);
        assert_eq!(layers.apt(), ["jq=1.6-2.1", "sqlite3"]);
        assert_eq!(layers.requirements(), ["tabulate", "idna"]);
        assert_eq!(layers.env()["Y"], "b");
        assert_eq!(layers.env()["X"], "1");
        assert_eq!(layers.workdir().as_deref(), Some("/w"));
        assert_eq!(layers.warm(), ["import tabulate", "import idna"]);
        assert_eq!(layers.memory_mib(), Some(512));
        let site = layers.site(&recipe_dir).unwrap();
        assert_eq!(site.debs, ["jq=1.6-2.1", "sqlite3"]);
        assert_eq!(site.ram_mib, 512);
        assert_eq!(names(&dir), ["a", "b"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn npm_packages_merge_over_the_base_and_need_node() {
        let dir = scratch("npm");
        let recipe_dir = dir.join("recipe");
        std::fs::create_dir_all(recipe_dir.join("templates")).unwrap();
        std::fs::write(
            recipe_dir.join("templates/node.toml"),
            "[site]\ndebs = [\"nodejs\"]\ndrop = []\nnpm = [\"sucrase@3.35.1\", \"lodash@4\"]\n\
             preload = []\nram_mib = 512\nboot_timeout_s = 60\n[site.runtime]\n\
             name = \"javascript\"\npackage = \"nodejs\"\ninterpreter = \"/usr/bin/node\"\n\
             kernel = []\nfiles = \"guest/node\"\n",
        )
        .unwrap();
        std::fs::write(
            recipe_dir.join("templates/tools.toml"),
            "[site]\ndebs = []\ndrop = []\npreload = []\nram_mib = 256\nboot_timeout_s = 60\n",
        )
        .unwrap();
        let a = def("name = \"a\"\nfrom = \"node\"\nnpm = [\"lodash@4.17.21\", \"@s/x\"]");
        let b = def("name = \"b\"\nfrom = \"a\"\nnpm = [\"@s/x@2\"]");
        save(&dir, &a).unwrap();
        save(&dir, &b).unwrap();
        let on_tools = def("name = \"c\"\nfrom = \"tools\"\nnpm = [\"lodash\"]");

        let layers = Layers::of_stored("b", &recipe_dir, &dir).unwrap().unwrap();
        let site = layers.site(&recipe_dir).unwrap();
        let refused = Layers::resolve(&on_tools, &recipe_dir, &dir)
            .unwrap()
            .site(&recipe_dir)
            .unwrap_err();

        assert_eq!(layers.npm(), ["lodash@4.17.21", "@s/x@2"]);
        assert_eq!(site.npm, ["sucrase@3.35.1", "lodash@4.17.21", "@s/x@2"]);
        assert_eq!(refused.field(), Some("npm"));
        let text = refused.to_string();
        assert!(
            text.starts_with("npm: npm packages need Node.js: build from the node template"),
            "{text}"
        );
        assert!(text.contains("c builds on tools"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn program_runtimes_merge_by_name_and_keep_clear_of_the_base_runtimes() {
        let dir = scratch("programs");
        let recipe_dir = dir.join("recipe");
        std::fs::create_dir_all(recipe_dir.join("templates")).unwrap();
        std::fs::write(
            recipe_dir.join("templates/node.toml"),
            "[site]\ndebs = [\"nodejs\"]\ndrop = []\npreload = []\nram_mib = 512\n\
             boot_timeout_s = 60\n[site.runtime]\nname = \"javascript\"\naliases = [\"js\"]\n\
             package = \"nodejs\"\ninterpreter = \"/usr/bin/node\"\nkernel = []\n\
             files = \"guest/node\"\ndialects = [{ name = \"typescript\", aliases = [\"ts\"] }]\n",
        )
        .unwrap();
        let a = def(
            "name = \"a\"\n[[runtimes]]\nname = \"lua\"\ncommand = [\"lua5.3\"]\n\
             [[runtimes]]\nname = \"awk\"\ncommand = [\"busybox\", \"awk\", \"-f\"]",
        );
        let b = def(
            "name = \"b\"\nfrom = \"a\"\n[[runtimes]]\nname = \"perl\"\ncommand = [\"perl\"]\n\
             [[runtimes]]\nname = \"lua\"\ncommand = [\"lua5.4\"]\nextension = \".lua\"",
        );
        save(&dir, &a).unwrap();
        save(&dir, &b).unwrap();
        let clash = def(
            "name = \"c\"\nfrom = \"node\"\n[[runtimes]]\nname = \"tsc\"\naliases = [\"ts\"]\n\
             command = [\"tsc\"]",
        );
        let across = def(
            "name = \"d\"\nfrom = \"a\"\n[[runtimes]]\nname = \"gawk\"\naliases = [\"awk\"]\n\
             command = [\"gawk\"]",
        );

        let site = Layers::of_stored("b", &recipe_dir, &dir)
            .unwrap()
            .unwrap()
            .site(&recipe_dir)
            .unwrap();
        let refused = |d: &Definition| {
            Layers::resolve(d, &recipe_dir, &dir)
                .unwrap()
                .site(&recipe_dir)
                .unwrap_err()
        };

        let order: Vec<(&str, &str)> = site
            .programs
            .iter()
            .map(|p| (p.name.as_str(), p.command[0].as_str()))
            .collect();
        assert_eq!(
            order,
            [("lua", "lua5.4"), ("awk", "busybox"), ("perl", "perl")]
        );
        assert_eq!(site.programs[0].extension, ".lua");
        for (bad, name) in [(refused(&clash), "ts"), (refused(&across), "awk")] {
            assert_eq!(bad.field(), Some("runtimes"));
            assert!(
                matches!(&bad, UserError::RuntimeTaken { name: n, .. } if n == name),
                "{bad}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_bases_built_in_names_and_loops_are_refused() {
        let dir = scratch("bad");
        let recipe_dir = dir.join("recipe");
        std::fs::create_dir_all(recipe_dir.join("templates")).unwrap();
        std::fs::write(recipe_dir.join("templates/tools.toml"), "").unwrap();

        let unknown = Layers::resolve(&def("name = \"a\"\nfrom = \"nope\""), &recipe_dir, &dir);
        let built_in = Layers::resolve(&def("name = \"tools\""), &recipe_dir, &dir);
        save(&dir, &def("name = \"x\"\nfrom = \"y\"")).unwrap();
        save(&dir, &def("name = \"y\"\nfrom = \"x\"")).unwrap();
        let looping = Layers::of_stored("x", &recipe_dir, &dir);

        let unknown = unknown.unwrap_err().to_string();
        assert!(unknown.contains("no template nope"), "{unknown}");
        assert!(unknown.contains("python, tools"), "{unknown}");
        assert!(matches!(built_in, Err(UserError::BuiltIn(n)) if n == "tools"));
        assert!(matches!(looping, Err(UserError::Chain(n)) if n == "x"));
        assert!(remove(&dir, "x").unwrap());
        assert!(!remove(&dir, "x").unwrap());
        assert_eq!(load(&dir, "x").unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
