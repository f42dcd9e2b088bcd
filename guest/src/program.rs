//! Program runtimes: a language a template runs by starting one of its image's interpreters
//! on a file that holds the code (`lua5.4 code.lua ARGS...`), declared as data in a user
//! template's `runtimes` (or a recipe's `[[site.programs]]`):
//!
//! ```toml
//! [[runtimes]]
//! name = "lua"
//! aliases = ["lua5.4"]
//! command = ["lua5.4"]     # the interpreter (a program of the image) and its arguments
//! extension = ".lua"       # the code file's suffix, for interpreters that go by it
//! package = "lua5.4"       # the Debian package whose upstream version is the runtime's
//! ```
//!
//! No code of bud's names the language: the manifest lists it as a `run: "program"` runtime
//! (`vmm::manifest::Language::Program`), a job naming it goes to the worker as language
//! `PROGRAM` with the runtime's number, and the worker runs the interpreter as a shell job
//! (`guest/python/bud_program.py`). Each job or cell is a process of its own; only a warm
//! kernel (`[site.runtime]`) keeps an interpreter running between them.
//!
//! Checked twice: the shape here ([`ProgramRuntime::check`]), and at the build that the
//! interpreter is in the image ([`resolve`]), where its absolute path is written into the
//! manifests so that a job's own `PATH` cannot change what runs.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Most program runtimes a template may declare.
pub const MAX_PROGRAMS: usize = 8;
/// Where a bare interpreter name is looked for in the image, in order (a shell's `PATH`).
pub const SEARCH_DIRS: &[&str] = &["usr/local/bin", "usr/bin", "bin", "usr/sbin", "sbin"];
/// Names no program runtime may take: the runtimes every image with Python has.
pub const RESERVED_NAMES: &[&str] = &["python", "shell"];

/// A program runtime (module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgramRuntime {
    /// What a job names (`language`).
    pub name: String,
    /// Other names for it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The interpreter (an absolute path in the image, or a name looked up in
    /// [`SEARCH_DIRS`]) and its arguments before the code file.
    pub command: Vec<String>,
    /// The code file's suffix (`.lua`); none by default.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub extension: String,
    /// The Debian package whose upstream version the manifest gives as the runtime's; by
    /// default a package named as the interpreter (`lua5.4`), if the image has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub package: Option<String>,
}

/// A runtime or alias name: a lowercase letter, then up to 31 of lowercase letters, digits,
/// `+`, `.`, `_` and `-` (`lua5.4`, `c++`).
pub fn valid_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'+' | b'.' | b'_' | b'-')
        })
}

impl ProgramRuntime {
    /// Checks the runtime's shape; the error is `(the field under the runtime, why)`.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        for name in std::iter::once(&self.name).chain(&self.aliases) {
            if !valid_name(name) {
                return Err((
                    if *name == self.name {
                        "name"
                    } else {
                        "aliases"
                    },
                    format!(
                        "{name:?} is not a runtime name: a lowercase letter, then up to 31 of \
                         lowercase letters, digits, '+', '.', '_' and '-'"
                    ),
                ));
            }
            if RESERVED_NAMES.contains(&name.as_str()) {
                return Err((
                    if *name == self.name {
                        "name"
                    } else {
                        "aliases"
                    },
                    format!("{name:?} is the name of a runtime every template has"),
                ));
            }
        }
        let Some(interpreter) = self.command.first() else {
            return Err((
                "command",
                "the interpreter is missing: `command = [\"lua5.4\"]`".into(),
            ));
        };
        if self.command.len() > 16 {
            return Err(("command", "at most 16 words".into()));
        }
        if let Some(word) = self
            .command
            .iter()
            .find(|w| w.is_empty() || w.len() > 256 || w.contains('\0'))
        {
            return Err((
                "command",
                format!("{word:?}: each word is 1-256 bytes, without NUL"),
            ));
        }
        let absolute = interpreter.starts_with('/');
        let path_ok = if absolute {
            !interpreter.split('/').any(|part| part == "..")
        } else {
            !interpreter.contains('/')
        };
        if !path_ok {
            return Err((
                "command",
                format!(
                    "{interpreter:?}: the interpreter is an absolute path without `..`, or a \
                     program name"
                ),
            ));
        }
        let ext = self.extension.strip_prefix('.');
        if !self.extension.is_empty()
            && !ext.is_some_and(|e| {
                (1..=16).contains(&e.len())
                    && e.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            })
        {
            return Err((
                "extension",
                format!(
                    "{:?}: a dot and 1-16 letters, digits, '_' or '-' (`.lua`)",
                    self.extension
                ),
            ));
        }
        Ok(())
    }

    /// The runtime's names: its name, then its aliases.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.name.as_str()).chain(self.aliases.iter().map(String::as_str))
    }
}

/// The guest path of `interpreter` in the image staged at `root`: itself when absolute and
/// present (a file or a link), else the first of [`SEARCH_DIRS`] that holds it.
pub fn resolve(root: &Path, interpreter: &str) -> Option<String> {
    let present = |rel: &str| root.join(rel).symlink_metadata().is_ok();
    if let Some(rel) = interpreter.strip_prefix('/') {
        return present(rel).then(|| interpreter.to_owned());
    }
    SEARCH_DIRS
        .iter()
        .map(|dir| format!("{dir}/{interpreter}"))
        .find(|rel| present(rel))
        .map(|rel| format!("/{rel}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lua() -> ProgramRuntime {
        ProgramRuntime {
            name: "lua".into(),
            aliases: vec!["lua5.4".into()],
            command: vec!["lua5.4".into()],
            extension: ".lua".into(),
            package: Some("lua5.4".into()),
        }
    }

    #[test]
    fn a_plain_runtime_passes() {
        assert_eq!(lua().check(), Ok(()));
        assert_eq!(lua().names().collect::<Vec<_>>(), ["lua", "lua5.4"]);
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: Vec<(ProgramRuntime, &str)> = vec![
            (
                ProgramRuntime {
                    name: "Lua".into(),
                    ..lua()
                },
                "name",
            ),
            (
                ProgramRuntime {
                    name: "python".into(),
                    ..lua()
                },
                "name",
            ),
            (
                ProgramRuntime {
                    aliases: vec!["shell".into()],
                    ..lua()
                },
                "aliases",
            ),
            (
                ProgramRuntime {
                    aliases: vec!["".into()],
                    ..lua()
                },
                "aliases",
            ),
            (
                ProgramRuntime {
                    command: vec![],
                    ..lua()
                },
                "command",
            ),
            (
                ProgramRuntime {
                    command: vec!["bin/lua".into()],
                    ..lua()
                },
                "command",
            ),
            (
                ProgramRuntime {
                    command: vec!["/usr/../lua".into()],
                    ..lua()
                },
                "command",
            ),
            (
                ProgramRuntime {
                    command: vec!["lua".into(), "".into()],
                    ..lua()
                },
                "command",
            ),
            (
                ProgramRuntime {
                    command: vec!["x".into(); 17],
                    ..lua()
                },
                "command",
            ),
            (
                ProgramRuntime {
                    extension: "lua".into(),
                    ..lua()
                },
                "extension",
            ),
            (
                ProgramRuntime {
                    extension: "./x".into(),
                    ..lua()
                },
                "extension",
            ),
        ];
        for (runtime, field) in cases {
            let err = runtime.check().unwrap_err();
            assert_eq!(err.0, field, "{runtime:?}: {err:?}");
        }
    }

    #[test]
    fn an_interpreter_is_found_by_path_or_by_name_in_the_search_order() {
        let root = std::env::temp_dir().join(format!("bud-program-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for dir in ["usr/bin", "bin"] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
            std::fs::write(root.join(dir).join("lua5.4"), b"").unwrap();
        }
        std::os::unix::fs::symlink("/bin/busybox", root.join("bin/awk")).unwrap();

        assert_eq!(resolve(&root, "lua5.4").as_deref(), Some("/usr/bin/lua5.4"));
        assert_eq!(
            resolve(&root, "/bin/lua5.4").as_deref(),
            Some("/bin/lua5.4")
        );
        assert_eq!(resolve(&root, "awk").as_deref(), Some("/bin/awk"));
        assert_eq!(resolve(&root, "ruby"), None);
        assert_eq!(resolve(&root, "/usr/bin/ruby"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
