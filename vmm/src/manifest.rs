//! A template's manifest: what its image can run, as the image builder found it. The builder
//! (`bud-guest`) writes it as `manifest.json` beside the initramfs; the VMM reads it with the
//! template ([`crate::Template::manifest`]) and keeps a copy in the template's directory, and
//! the server reads it for everything a template offers: the runtimes a job may name, the
//! tools (bash or only busybox), the code-context kernels, the packages and their versions,
//! the network.
//!
//! A runtime is a name (`python`, `shell`, `javascript`), the other names a client may use
//! for it (`js`, `node`), and how the guest worker runs it ([`Language`], the worker's modes:
//! the wire protocol's language codes). Python and the shell are the worker's own modes; a
//! runtime with a warm kernel is a [`Language::Kernel`]: a program of the image
//! (`Runtime::kernel`) started before READY that runs the jobs (`guest/python/bud_runtime.py`);
//! any other interpreter is a [`Language::Program`]: the worker writes the code to a file and
//! runs the interpreter on it, a process per job (`lua`, `perl`, `ruby` in a user template).
//! A new runtime or a user's template changes a manifest, not a Rust enum.
//!
//! Shared verbatim with the builder (`guest/src/manifest.rs` includes this file), like
//! `protocol.rs`: it uses std, serde, serde_json and thiserror only, and never anything of
//! the VMM.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The manifest's file name: beside the initramfs, and in a template's directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The one format this code reads and writes.
pub const MANIFEST_FORMAT: u32 = 1;

/// How the guest worker runs a runtime's code: its modes, which the wire protocol names
/// (`protocol::language`). Not a list of languages: those are a manifest's runtimes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// CPython with `python3 -c CODE` semantics, in the worker's own interpreter.
    #[default]
    Python,
    /// A POSIX shell (the image's `/bin/sh`) with `sh -c CODE` semantics.
    Shell,
    /// The image's kernel program ([`Runtime::kernel`]), warm before READY, runs the code
    /// (JavaScript: `node -e CODE` semantics in a warm Node.js).
    Kernel,
    /// An interpreter of the image started on a file holding the code, a process per job
    /// or cell: `INTERPRETER ARGS... FILE JOB_ARGS...` ([`Runtime::interpreter`],
    /// [`Runtime::args`], [`Runtime::extension`]), with the job's stdin, environment and
    /// working directory. Which of the template's program runtimes is the job's
    /// [`Runtime::dialect`].
    Program,
}

impl Language {
    /// The mode's name in a manifest (`python`, `shell`): also the name of the runtime of
    /// that mode in the images bud builds.
    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Shell => "shell",
            Language::Kernel => "kernel",
            Language::Program => "program",
        }
    }
}

/// Whether a template's guest reaches a network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    /// No network device at all.
    #[default]
    None,
    /// A network card behind bud's stack ([`crate::net`]): a sandbox reaches what its
    /// egress allows, and nothing without one. Set by [`crate::Template`] from its
    /// snapshot (a template booted with a card), never by the image builder.
    Card,
}

/// A runtime: a name a job asks for, and how the worker runs it.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Runtime {
    /// What a job names (`language` of `/v1/exec`).
    pub name: String,
    /// Other names a job or a client may use for it (`js`, `node` for `javascript`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// Its upstream version (`3.11.2`), from the package that provides it.
    pub version: String,
    /// How the worker runs it.
    pub run: Language,
    /// The program behind it in the guest (`/usr/bin/python3`, `/bin/sh`, `/usr/bin/node`).
    pub interpreter: String,
    /// A [`Language::Program`] runtime's arguments before the code file (`["-W"]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// A [`Language::Program`] runtime's code file suffix (`.lua`), for interpreters that
    /// go by it; empty for none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub extension: String,
    /// A [`Language::Kernel`] runtime's kernel: the arguments the interpreter is started
    /// with before READY (`["--single-threaded-gc", "/usr/lib/bud/node/kernel.js"]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernel: Vec<String>,
    /// Which of the kernel's languages a [`Language::Kernel`] runtime is: 0 the kernel's
    /// own (JavaScript), `n` its `n`-th dialect (TypeScript), which the kernel turns into
    /// its own before it runs it. Every kernel runtime of a template shares its one kernel.
    /// For a [`Language::Program`] runtime, its number among the template's program
    /// runtimes (0, 1, ...), which the worker looks up in its own manifest.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dialect: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Runtime {
    /// Whether a job naming `name` means this runtime (its name or one of its aliases).
    pub fn answers_to(&self, name: &str) -> bool {
        self.name == name || self.aliases.iter().any(|a| a == name)
    }

    /// How its code runs: the worker's mode and the kernel's dialect.
    pub fn runs(&self) -> (Language, u32) {
        (self.run, self.dialect)
    }
}

/// A code-context kernel (a Jupyter-style context of E2B's code interpreter).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Kernel {
    /// The context language a client names (`python`, `bash`).
    pub language: String,
    /// How its cells run.
    pub run: Language,
    /// Kernels of this kind started before READY, waiting in the template.
    pub warm: u32,
}

/// What a template's image can run (module docs).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: u32,
    /// The template's name.
    pub name: String,
    /// The runtimes, the default one first.
    pub runtimes: Vec<Runtime>,
    pub kernels: Vec<Kernel>,
    /// Programs on the guest's `PATH` besides the runtimes' interpreters (`busybox`, `bash`,
    /// `git`), sorted.
    pub tools: Vec<String>,
    /// Every Debian package of the image, name to version.
    pub packages: BTreeMap<String, String>,
    /// The Python packages a user template's wheels put in (`*.dist-info` under
    /// `/usr/local/lib/python3.11/dist-packages`), name to version; empty for the others.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub python_packages: BTreeMap<String, String>,
    /// The npm packages of the image (`node_modules` of its global module directory), name
    /// to version; empty without any.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub npm_packages: BTreeMap<String, String>,
    pub network: Network,
}

/// Why a manifest could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("cannot read the template manifest {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the template manifest {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the template manifest {path} is not valid")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("the template manifest {path} has format {found}; this bud reads {MANIFEST_FORMAT}")]
    Format { path: PathBuf, found: u32 },
    #[error("the template manifest {path} names runtime `{name}` twice")]
    DuplicateRuntime { path: PathBuf, name: String },
    #[error("the template manifest {path} has kernel runtime `{name}` without its kernel")]
    KernelWithoutProgram { path: PathBuf, name: String },
    #[error(
        "the template manifest {path} has kernel runtimes that differ in their kernel or share a dialect number (`{name}`): a template has one kernel, each runtime one dialect of it"
    )]
    SecondKernel { path: PathBuf, name: String },
    #[error(
        "the template manifest {path} has program runtime `{name}` without an interpreter, or with a number another program runtime has"
    )]
    BadProgram { path: PathBuf, name: String },
}

impl Manifest {
    /// Reads and checks the manifest at `path`.
    pub fn load(path: &Path) -> Result<Self, ManifestError> {
        let bytes = std::fs::read(path).map_err(|source| ManifestError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&bytes, path)
    }

    /// Parses and checks manifest bytes (`path` names them in errors).
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, ManifestError> {
        let manifest: Manifest =
            serde_json::from_slice(bytes).map_err(|source| ManifestError::Parse {
                path: path.to_owned(),
                source,
            })?;
        if manifest.format != MANIFEST_FORMAT {
            return Err(ManifestError::Format {
                path: path.to_owned(),
                found: manifest.format,
            });
        }
        let mut names = std::collections::BTreeSet::new();
        for r in &manifest.runtimes {
            for name in std::iter::once(&r.name).chain(&r.aliases) {
                if !names.insert(name.as_str()) {
                    return Err(ManifestError::DuplicateRuntime {
                        path: path.to_owned(),
                        name: name.clone(),
                    });
                }
            }
            if r.run == Language::Kernel && r.kernel.is_empty() {
                return Err(ManifestError::KernelWithoutProgram {
                    path: path.to_owned(),
                    name: r.name.clone(),
                });
            }
        }
        let mut programs = std::collections::BTreeSet::new();
        for r in manifest
            .runtimes
            .iter()
            .filter(|r| r.run == Language::Program)
        {
            if r.interpreter.is_empty() || !programs.insert(r.dialect) {
                return Err(ManifestError::BadProgram {
                    path: path.to_owned(),
                    name: r.name.clone(),
                });
            }
        }
        let mut kernels = manifest
            .runtimes
            .iter()
            .filter(|r| r.run == Language::Kernel);
        if let Some(first) = kernels.next() {
            let mut dialects = std::collections::BTreeSet::from([first.dialect]);
            for r in kernels {
                let same = r.interpreter == first.interpreter && r.kernel == first.kernel;
                if !same || !dialects.insert(r.dialect) {
                    return Err(ManifestError::SecondKernel {
                        path: path.to_owned(),
                        name: r.name.clone(),
                    });
                }
            }
        }
        Ok(manifest)
    }

    /// The manifest as the file holds it (pretty JSON, ending in a newline).
    pub fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(self).unwrap_or_default();
        text.push('\n');
        text
    }

    /// Writes the manifest to `path` (a temporary file renamed into place); a file that
    /// already holds the same text is left alone.
    pub fn write(&self, path: &Path) -> Result<(), ManifestError> {
        let text = self.to_json();
        if std::fs::read(path).is_ok_and(|old| old == text.as_bytes()) {
            return Ok(());
        }
        let err = |source| ManifestError::Write {
            path: path.to_owned(),
            source,
        };
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text.as_bytes()).map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }

    /// The runtime named `name`, by its name or an alias.
    pub fn runtime(&self, name: &str) -> Option<&Runtime> {
        self.runtimes.iter().find(|r| r.answers_to(name))
    }

    /// The runtime a job that names none runs in: the first.
    pub fn default_runtime(&self) -> Option<&Runtime> {
        self.runtimes.first()
    }

    /// The first runtime the worker runs as `run`.
    pub fn runtime_running(&self, run: Language) -> Option<&Runtime> {
        self.runtimes.iter().find(|r| r.run == run)
    }

    /// The runtimes' names, in order.
    pub fn runtime_names(&self) -> Vec<&str> {
        self.runtimes.iter().map(|r| r.name.as_str()).collect()
    }

    /// Whether `tool` is on the guest's `PATH`.
    pub fn has_tool(&self, tool: &str) -> bool {
        self.tools.iter().any(|t| t == tool)
    }

    /// The code-context kernel for context language `language`.
    pub fn kernel(&self, language: &str) -> Option<&Kernel> {
        self.kernels.iter().find(|k| k.language == language)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT,
            name: "tools".into(),
            runtimes: vec![
                Runtime {
                    name: "python".into(),
                    version: "3.11.2".into(),
                    run: Language::Python,
                    interpreter: "/usr/bin/python3".into(),
                    ..Runtime::default()
                },
                Runtime {
                    name: "shell".into(),
                    version: "1.35.0".into(),
                    run: Language::Shell,
                    interpreter: "/bin/sh".into(),
                    ..Runtime::default()
                },
            ],
            kernels: vec![Kernel {
                language: "python".into(),
                run: Language::Python,
                warm: 1,
            }],
            tools: vec!["bash".into(), "busybox".into()],
            packages: BTreeMap::from([("bash".into(), "5.2.15-2+b7".into())]),
            python_packages: BTreeMap::from([("tabulate".into(), "0.9.0".into())]),
            npm_packages: BTreeMap::new(),
            network: Network::None,
        }
    }

    #[test]
    fn a_written_manifest_reads_back_equal() {
        let m = sample();

        let back = Manifest::parse(m.to_json().as_bytes(), Path::new("m")).unwrap();

        assert_eq!(back, m);
    }

    #[test]
    fn runtimes_are_found_by_name_and_the_first_is_the_default() {
        let m = sample();

        assert_eq!(m.runtime("shell").map(|r| r.run), Some(Language::Shell));
        assert_eq!(m.runtime("ruby"), None);
        assert_eq!(m.default_runtime().map(|r| r.name.as_str()), Some("python"));
        assert_eq!(m.runtime_names(), ["python", "shell"]);
        assert_eq!(
            m.runtime_running(Language::Shell).map(|r| r.name.as_str()),
            Some("shell")
        );
        assert!(m.has_tool("bash") && !m.has_tool("git"));
        assert_eq!(m.kernel("python").map(|k| k.warm), Some(1));
    }

    #[test]
    fn the_file_format_is_plain_json_with_lowercase_modes() {
        let text = sample().to_json();

        assert!(text.contains(r#""run": "python""#), "{text}");
        assert!(text.contains(r#""network": "none""#), "{text}");
        assert_eq!(Language::Shell.name(), "shell");
        assert!(text.ends_with("}\n"), "{text}");
    }

    #[test]
    fn another_format_is_refused() {
        let mut m = sample();
        m.format = MANIFEST_FORMAT + 1;

        let err = Manifest::parse(m.to_json().as_bytes(), Path::new("m")).unwrap_err();

        assert!(matches!(err, ManifestError::Format { found, .. } if found == MANIFEST_FORMAT + 1));
    }

    #[test]
    fn a_runtime_answers_to_its_aliases_and_a_kernel_needs_its_program() {
        let mut m = sample();
        m.runtimes.push(Runtime {
            name: "javascript".into(),
            aliases: vec!["js".into(), "node".into()],
            version: "18.20.4".into(),
            run: Language::Kernel,
            interpreter: "/usr/bin/node".into(),
            kernel: vec!["/usr/lib/bud/node/kernel.js".into()],
            ..Runtime::default()
        });
        let back = Manifest::parse(m.to_json().as_bytes(), Path::new("m")).unwrap();
        m.runtimes[2].kernel.clear();
        let no_program = Manifest::parse(m.to_json().as_bytes(), Path::new("m"));

        assert_eq!(
            back.runtime("js").map(|r| r.name.as_str()),
            Some("javascript")
        );
        assert_eq!(back.runtime("node").map(|r| r.run), Some(Language::Kernel));
        assert!(
            matches!(no_program, Err(ManifestError::KernelWithoutProgram { name, .. }) if name == "javascript")
        );
    }

    #[test]
    fn kernel_runtimes_share_one_kernel_each_as_a_dialect_of_its_own() {
        let js = Runtime {
            name: "javascript".into(),
            version: "18.20.4".into(),
            run: Language::Kernel,
            interpreter: "/usr/bin/node".into(),
            kernel: vec!["/usr/lib/bud/node/kernel.js".into()],
            ..Runtime::default()
        };
        let ts = Runtime {
            name: "typescript".into(),
            aliases: vec!["ts".into()],
            dialect: 1,
            ..js.clone()
        };
        let mut m = sample();
        m.runtimes.extend([js, ts]);
        let both = Manifest::parse(m.to_json().as_bytes(), Path::new("m")).unwrap();
        let mut same_dialect = m.clone();
        same_dialect.runtimes[3].dialect = 0;
        let mut other_kernel = m.clone();
        other_kernel.runtimes[3].kernel = vec!["/usr/lib/bud/deno/kernel.js".into()];

        assert_eq!(both.runtime("ts").map(|r| r.dialect), Some(1));
        assert_eq!(both.runtime("javascript").map(|r| r.dialect), Some(0));
        assert!(!m.to_json().contains(r#""dialect": 0"#), "{}", m.to_json());
        for bad in [same_dialect, other_kernel] {
            let err = Manifest::parse(bad.to_json().as_bytes(), Path::new("m")).unwrap_err();
            assert!(
                matches!(&err, ManifestError::SecondKernel { name, .. } if name == "typescript"),
                "{err:?}"
            );
        }
    }

    #[test]
    fn program_runtimes_name_an_interpreter_and_each_has_its_own_number() {
        let lua = Runtime {
            name: "lua".into(),
            version: "5.4.4".into(),
            run: Language::Program,
            interpreter: "/usr/bin/lua5.4".into(),
            extension: ".lua".into(),
            ..Runtime::default()
        };
        let awk = Runtime {
            name: "awk".into(),
            run: Language::Program,
            interpreter: "/bin/busybox".into(),
            args: vec!["awk".into(), "-f".into()],
            dialect: 1,
            ..Runtime::default()
        };
        let mut m = sample();
        m.runtimes.extend([lua, awk]);
        let back = Manifest::parse(m.to_json().as_bytes(), Path::new("m")).unwrap();
        let mut same_number = m.clone();
        same_number.runtimes[3].dialect = 0;
        let mut no_interpreter = m.clone();
        no_interpreter.runtimes[2].interpreter.clear();

        assert_eq!(back, m);
        assert!(
            m.to_json().contains(r#""run": "program""#),
            "{}",
            m.to_json()
        );
        assert_eq!(back.runtime("awk").map(|r| r.args.len()), Some(2));
        assert_eq!(
            back.runtime("lua").map(|r| r.extension.as_str()),
            Some(".lua")
        );
        for (bad, who) in [(same_number, "awk"), (no_interpreter, "lua")] {
            let err = Manifest::parse(bad.to_json().as_bytes(), Path::new("m")).unwrap_err();
            assert!(
                matches!(&err, ManifestError::BadProgram { name, .. } if name == who),
                "{err:?}"
            );
        }
    }

    #[test]
    fn an_alias_taken_by_another_runtime_is_refused() {
        let mut m = sample();
        m.runtimes[1].aliases = vec!["sh".into(), "python".into()];

        let err = Manifest::parse(m.to_json().as_bytes(), Path::new("m")).unwrap_err();

        assert!(matches!(err, ManifestError::DuplicateRuntime { name, .. } if name == "python"));
    }

    #[test]
    fn a_runtime_named_twice_is_refused() {
        let mut m = sample();
        m.runtimes[1].name = "python".into();

        let err = Manifest::parse(m.to_json().as_bytes(), Path::new("m")).unwrap_err();

        assert!(matches!(err, ManifestError::DuplicateRuntime { name, .. } if name == "python"));
    }

    #[test]
    fn an_unknown_way_to_run_is_refused_and_unknown_fields_are_ignored() {
        let text = sample().to_json();
        let unknown_run = text.replacen(r#""run": "shell""#, r#""run": "ruby""#, 1);
        let extra = text.replacen("{", r#"{"later": [1, 2],"#, 1);

        let refused = Manifest::parse(unknown_run.as_bytes(), Path::new("m"));
        let read = Manifest::parse(extra.as_bytes(), Path::new("m")).unwrap();

        assert!(matches!(refused, Err(ManifestError::Parse { .. })));
        assert_eq!(read, sample());
    }

    #[test]
    fn writing_the_same_manifest_again_leaves_the_file_alone() {
        let dir = std::env::temp_dir().join(format!("bud-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(MANIFEST_FILE);
        sample().write(&path).unwrap();
        let first = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));

        sample().write(&path).unwrap();

        assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), first);
        assert_eq!(Manifest::load(&path).unwrap(), sample());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
