//! A user template's definition: what a user writes (a TOML file, or the same keys as JSON
//! over HTTP) to get a template of their own, checked here before anything is fetched.
//!
//! ```toml
//! name = "report"
//! from = "python"                  # a built-in template or another user template
//! apt = ["jq", "sqlite3=3.40.1-2+deb12u1"]
//! pip = ["tabulate==0.9.0"]        # requirement strings; `requirements` takes a file's text
//! npm = ["sucrase@3.35.1"]         # npm packages; only `from` a template with Node.js (`node`)
//! env = { REPORT_MODE = "fast" }
//! workdir = "/home/user/project"
//! warm = "import tabulate"        # Python run in the guest before the snapshot
//! memory_mib = 512
//! [files]
//! "/home/user/project/README" = "hello\n"
//! [[runtimes]]                     # a language run by an interpreter of the image
//! name = "lua"
//! command = ["lua5.4"]
//! extension = ".lua"
//! ```
//!
//! Everything a definition names is data: Debian packages are unpacked (never their
//! maintainer scripts), Python packages come as wheels and are unpacked (never built or run
//! on the host: `wheels.rs`), npm packages are installed by the host's npm without their
//! install scripts, and refused where a package needs one (`npm.rs`), and `warm` runs only
//! inside the guest. This module checks the
//! shape and the limits ([`Limits`]) and says which field is wrong; it knows nothing of the
//! network or the build.

use std::collections::BTreeMap;

use crate::archive::ArchiveLimits;

use serde::{Deserialize, Serialize};

use crate::echo::{excerpt, quote, shorten};
use crate::program::{MAX_PROGRAMS, ProgramRuntime};

/// Why a definition was refused: the field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DefinitionError {
    /// Not TOML or JSON at all.
    #[error("{0}")]
    Syntax(String),
    /// A key missing, unknown, or of the wrong type; or a value that breaks a rule.
    #[error("{field}: {why}")]
    Field { field: String, why: String },
}

impl DefinitionError {
    /// The field at fault (`body` for a syntax error).
    pub fn field(&self) -> &str {
        match self {
            DefinitionError::Syntax(_) => "body",
            DefinitionError::Field { field, .. } => field,
        }
    }

    /// A deserializer's complaint about the key at `path` (`.` for the whole): a missing or
    /// unknown key is that key's fault.
    fn shape(path: &str, message: &str) -> Self {
        let named = ["missing field `", "unknown field `"]
            .iter()
            .find_map(|p| message.split_once(p))
            .and_then(|(_, rest)| rest.split_once('`'))
            .map(|(name, _)| name.to_owned());
        let field = match (path, named) {
            (".", Some(name)) => name,
            (".", None) => return DefinitionError::Syntax(shorten(message).into_owned()),
            (path, _) => path.to_owned(),
        };
        DefinitionError::at(excerpt(&field), shorten(message))
    }

    fn at(field: impl Into<String>, why: impl Into<String>) -> Self {
        DefinitionError::Field {
            field: field.into(),
            why: why.into(),
        }
    }
}

/// What a user template holds (module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Definition {
    pub name: String,
    /// The template it builds on: `python` (the default), a built-in one, or a user template.
    #[serde(default = "default_from")]
    pub from: String,
    /// Debian bookworm packages, `name` or `name=version`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub apt: Vec<String>,
    /// Python requirement strings (`name`, `name==1.2`, `name[extra]>=1,<2`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pip: Vec<String>,
    /// The text of a requirements file (one requirement a line, `#` comments): added to
    /// `pip`. Options (`-r`, `--index-url`, `-e`) and URLs are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requirements: Option<String>,
    /// npm packages (`name`, `name@1.2.3`, `@scope/name@^1`, a dist-tag), from the registry
    /// the host's npm is configured with; their install scripts never run, and a package
    /// that has one is refused at the build. Only on a template with Node.js (`from =
    /// "node"`, or a user template from it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub npm: Vec<String>,
    /// Files of the image: absolute guest path -> text content.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
    /// Directories of the image given as archives: absolute guest directory -> a tar
    /// archive (plain or gzip), base64 (`crate::archive`: files and directories only).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub archives: BTreeMap<String, String>,
    /// Environment variables of every job and session of the template.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The working directory of jobs (made if missing); default `/home/user` as on every
    /// template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Python code run inside the guest before the snapshot (imports, a data file loaded);
    /// an exception fails the build with its traceback in the build log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<String>,
    /// Guest RAM; default the base template's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Whether sandboxes of it get a network card (on a server started with `--network`;
    /// default true there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<bool>,
    /// Languages run by an interpreter of the image on a file of code (`crate::program`):
    /// jobs and cells name them as `language`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runtimes: Vec<ProgramRuntime>,
}

fn default_from() -> String {
    crate::recipe::BASE_TEMPLATE.to_owned()
}

/// The bounds a definition must keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Debian packages, Python requirements and npm packages named.
    pub packages: usize,
    /// Bytes of `files`, `warm`, `env` and `requirements` together.
    pub inline_bytes: usize,
    /// Entries of `files`.
    pub files: usize,
    pub min_memory_mib: u64,
    pub max_memory_mib: u64,
    /// Each of `archives`, unpacked.
    pub archive: ArchiveLimits,
    /// Entries of `archives` (directories given as archives).
    pub archives: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            packages: 64,
            inline_bytes: 4 << 20,
            files: 256,
            min_memory_mib: 128,
            max_memory_mib: 8192,
            archive: ArchiveLimits {
                bytes: 256 << 20,
                entries: 20_000,
            },
            archives: 16,
        }
    }
}

/// Paths of the image that are bud's own: a definition's files may not replace them.
/// (`/run` is a tmpfs mounted over the image; `/tmp` and `/home/user` are too, and their
/// files are put in place by the worker.)
const RESERVED: &[&str] = &["/init", "/usr/lib/bud", "/dev", "/proc", "/sys", "/run"];
/// A template name: lowercase letters, digits, `-` and `_`, at most 64, starting with a
/// letter or digit.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl Definition {
    /// Parses a TOML definition and checks it.
    pub fn from_toml(text: &str, limits: &Limits) -> Result<Definition, DefinitionError> {
        let de = toml::Deserializer::new(text);
        let def: Definition = serde_path_to_error::deserialize(de)
            .map_err(|e| DefinitionError::shape(&e.path().to_string(), e.inner().message()))?;
        def.check(limits)?;
        Ok(def)
    }

    /// Parses a JSON definition and checks it.
    pub fn from_json(bytes: &[u8], limits: &Limits) -> Result<Definition, DefinitionError> {
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        Self::checked(serde_path_to_error::deserialize(de), limits)
    }

    /// A definition already parsed as JSON (an HTTP body), checked.
    pub fn from_value(
        value: serde_json::Value,
        limits: &Limits,
    ) -> Result<Definition, DefinitionError> {
        Self::checked(serde_path_to_error::deserialize(value), limits)
    }

    /// A JSON deserializer's outcome, its error named by field, then [`Self::check`]ed.
    fn checked(
        parsed: Result<Definition, serde_path_to_error::Error<serde_json::Error>>,
        limits: &Limits,
    ) -> Result<Definition, DefinitionError> {
        let def = parsed.map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                DefinitionError::Syntax(shorten(&inner.to_string()).into_owned())
            } else {
                DefinitionError::shape(&path, &inner.to_string())
            }
        })?;
        def.check(limits)?;
        Ok(def)
    }

    /// The definition as stored: canonical JSON (its sha256 names the build's inputs).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Every Python requirement: `pip`, then the lines of `requirements`.
    pub fn requirements(&self) -> Vec<String> {
        let lines = self.requirements.iter().flat_map(|text| {
            text.lines()
                .map(|l| l.split_once('#').map_or(l, |(before, _)| before).trim())
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
        });
        self.pip.iter().cloned().chain(lines).collect()
    }

    /// Checks every field against its rules and `limits`; the first fault found is the error.
    pub fn check(&self, limits: &Limits) -> Result<(), DefinitionError> {
        if !valid_name(&self.name) {
            return Err(DefinitionError::at(
                "name",
                format!(
                    "{} is not a template name: 1-64 of lowercase letters, digits, '-' and '_', \
                     starting with a letter or digit",
                    quote(&self.name)
                ),
            ));
        }
        if !valid_name(&self.from) {
            return Err(DefinitionError::at(
                "from",
                format!("{} is not a template name", quote(&self.from)),
            ));
        }
        if self.from == self.name {
            return Err(DefinitionError::at(
                "from",
                "a template cannot build on itself",
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, spec) in self.apt.iter().enumerate() {
            check_deb(spec).map_err(|why| DefinitionError::at(format!("apt[{i}]"), why))?;
            if !seen.insert(crate::recipe::package_name(spec)) {
                return Err(DefinitionError::at(
                    format!("apt[{i}]"),
                    format!("package {} is listed twice", quote(spec)),
                ));
            }
        }
        for (i, spec) in self.pip.iter().enumerate() {
            check_requirement(spec).map_err(|why| DefinitionError::at(format!("pip[{i}]"), why))?;
        }
        if let Some(text) = &self.requirements {
            for (n, line) in text.lines().enumerate() {
                let line = line
                    .split_once('#')
                    .map_or(line, |(before, _)| before)
                    .trim();
                if !line.is_empty() {
                    check_requirement(line).map_err(|why| {
                        DefinitionError::at("requirements", format!("line {}: {why}", n + 1))
                    })?;
                }
            }
        }
        crate::npm::check_specs(&self.npm).map_err(|e| match e {
            crate::npm::NpmError::BadSpec { index, why } => {
                DefinitionError::at(format!("npm[{index}]"), why)
            }
            other => DefinitionError::at("npm", other.to_string()),
        })?;
        if !self.npm.is_empty() && self.from == crate::recipe::BASE_TEMPLATE {
            return Err(DefinitionError::at(
                "npm",
                format!(
                    "npm packages need Node.js: build from the node template (`from = \"node\"`), \
                     not {}",
                    quote(&self.from)
                ),
            ));
        }
        let packages = self.apt.len() + self.requirements().len() + self.npm.len();
        if packages > limits.packages {
            return Err(DefinitionError::at(
                if self.npm.is_empty() { "pip" } else { "npm" },
                format!(
                    "{packages} packages named (apt, pip and npm); at most {} are allowed",
                    limits.packages
                ),
            ));
        }
        if self.files.len() > limits.files {
            return Err(DefinitionError::at(
                "files",
                format!(
                    "{} files; at most {} are allowed",
                    self.files.len(),
                    limits.files
                ),
            ));
        }
        for path in self.files.keys() {
            let field = || format!("files[{}]", quote(path));
            check_guest_path(path).map_err(|why| DefinitionError::at(field(), why))?;
            if ["/tmp", "/home", "/home/user"].contains(&path.as_str()) {
                return Err(DefinitionError::at(field(), "a directory, not a file"));
            }
        }
        if self.archives.len() > limits.archives {
            return Err(DefinitionError::at(
                "archives",
                format!(
                    "{} archives; at most {} are allowed",
                    self.archives.len(),
                    limits.archives
                ),
            ));
        }
        for (dir, text) in &self.archives {
            let field = || format!("archives[{}]", quote(dir));
            check_guest_path(dir).map_err(|why| DefinitionError::at(field(), why))?;
            let files = crate::archive::files(text, &limits.archive)
                .map_err(|why| DefinitionError::at(field(), why))?;
            for file in &files {
                check_guest_path(&format!("{dir}/{}", file.path))
                    .map_err(|why| DefinitionError::at(field(), why))?;
            }
        }
        for (name, value) in &self.env {
            if !valid_env_name(name) {
                return Err(DefinitionError::at(
                    format!("env[{}]", quote(name)),
                    "an environment variable's name is letters, digits and '_', not starting \
                     with a digit",
                ));
            }
            if value.contains('\0') {
                return Err(DefinitionError::at(
                    format!("env[{}]", quote(name)),
                    "a value may not hold a NUL byte",
                ));
            }
        }
        if let Some(dir) = &self.workdir {
            check_guest_path(dir).map_err(|why| DefinitionError::at("workdir", why))?;
        }
        let inline: usize = self
            .files
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
            + self
                .env
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
            + self.warm.as_ref().map_or(0, String::len)
            + self.requirements.as_ref().map_or(0, String::len);
        if inline > limits.inline_bytes {
            return Err(DefinitionError::at(
                "files",
                format!(
                    "files, env, warm and requirements hold {inline} bytes; at most {} are \
                     allowed",
                    limits.inline_bytes
                ),
            ));
        }
        self.check_runtimes()?;
        if let Some(mib) = self.memory_mib
            && !(limits.min_memory_mib..=limits.max_memory_mib).contains(&mib)
        {
            return Err(DefinitionError::at(
                "memory_mib",
                format!(
                    "{mib} is out of range: {} to {}",
                    limits.min_memory_mib, limits.max_memory_mib
                ),
            ));
        }
        Ok(())
    }
}

impl Definition {
    /// `runtimes`: each well formed, at most [`MAX_PROGRAMS`], no name twice, and each
    /// `package` a Debian package name.
    fn check_runtimes(&self) -> Result<(), DefinitionError> {
        if self.runtimes.len() > MAX_PROGRAMS {
            return Err(DefinitionError::at(
                "runtimes",
                format!(
                    "{} runtimes; at most {MAX_PROGRAMS} are allowed",
                    self.runtimes.len()
                ),
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, runtime) in self.runtimes.iter().enumerate() {
            runtime.check().map_err(|(field, why)| {
                DefinitionError::at(format!("runtimes[{i}].{field}"), why)
            })?;
            if let Some(name) = runtime.names().find(|n| !names.insert(*n)) {
                return Err(DefinitionError::at(
                    format!("runtimes[{i}]"),
                    format!("runtime name {} is used twice", quote(name)),
                ));
            }
            if let Some(package) = &runtime.package {
                check_deb(package)
                    .map_err(|why| DefinitionError::at(format!("runtimes[{i}].package"), why))?;
            }
        }
        Ok(())
    }
}

/// A Debian package spec: a package name (Debian policy 5.6.1) and an optional `=version`.
fn check_deb(spec: &str) -> Result<(), String> {
    let name = crate::recipe::package_name(spec);
    let good_name = (2..=128).contains(&name.len())
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'+' | b'-' | b'.')
        });
    if !good_name {
        return Err(format!(
            "{} is not a Debian package name (lowercase letters, digits, '+', '-', '.')",
            quote(spec)
        ));
    }
    if let Some(version) = crate::recipe::package_version(spec) {
        let good = !version.is_empty()
            && version.bytes().next().is_some_and(|b| b.is_ascii_digit())
            && version.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-' | b'~' | b':')
            });
        if !good {
            return Err(format!("{} is not a Debian version", quote(version)));
        }
    }
    Ok(())
}

/// A requirement as pip's resolver takes it from an index: a project name with optional
/// extras, version specifiers and an environment marker. Everything that would make pip
/// fetch from elsewhere or read a file (options, URLs, paths, `name @ url`) is refused.
fn check_requirement(spec: &str) -> Result<(), String> {
    let spec = spec.trim();
    if spec.starts_with('-') {
        return Err(format!(
            "{}: pip options are not allowed, only requirements",
            quote(spec)
        ));
    }
    let head = spec.split(';').next().unwrap_or_default();
    if head.contains('@') || head.contains("://") || head.contains('/') || head.contains('\\') {
        return Err(format!(
            "{}: only packages from the index by name and version (no URLs, paths or `@`)",
            quote(spec)
        ));
    }
    let name_end = head
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        .unwrap_or(head.len());
    let name = &head[..name_end];
    let rest = head[name_end..].trim();
    let good_name = !name.is_empty()
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    let good_rest = rest.is_empty()
        || rest.starts_with(['[', '=', '<', '>', '!', '~', '('])
            && rest.chars().all(|c| {
                c.is_ascii_alphanumeric()
                    || matches!(c, '[' | ']' | ',' | '=' | '<' | '>' | '!' | '~' | '.' | '*')
                    || matches!(c, '-' | '_' | '+' | ' ' | '(' | ')')
            });
    if !good_name || !good_rest {
        return Err(format!("{} is not a requirement pip can take", quote(spec)));
    }
    Ok(())
}

/// An absolute guest path, clean, outside bud's own paths.
fn check_guest_path(path: &str) -> Result<(), String> {
    let clean = path.starts_with('/')
        && path.len() > 1
        && path.len() <= 4096
        && !path.ends_with('/')
        && path[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != ".." && !c.contains('\0'));
    if !clean {
        return Err(format!(
            "{} is not a clean absolute path (no `.`, `..`, empty parts or trailing `/`)",
            quote(path)
        ));
    }
    if let Some(reserved) = RESERVED
        .iter()
        .find(|r| path == **r || path.starts_with(&format!("{r}/")))
    {
        return Err(format!(
            "{} is under {reserved}, which is bud's own",
            quote(path)
        ));
    }
    Ok(())
}

fn valid_env_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Definition, DefinitionError> {
        Definition::from_toml(text, &Limits::default())
    }

    #[test]
    fn a_full_definition_parses_and_round_trips_through_json() {
        let def = parse(
            r#"
            name = "report"
            from = "tools"
            apt = ["jq", "sqlite3=3.40.1-2+deb12u1"]
            pip = ["tabulate==0.9.0", "rich[jupyter]>=13,<14"]
            requirements = "httpx  # a comment\n\n# only a comment\nidna>=3\n"
            npm = ["sucrase@3.35.1", "@scope/x@^1 || 2.x", "lodash"]
            env = { REPORT_MODE = "fast" }
            workdir = "/home/user/project"
            warm = "import tabulate"
            memory_mib = 512
            network = false
            [files]
            "/home/user/project/README" = "hello\n"
            "#,
        )
        .unwrap();

        assert_eq!(def.from, "tools");
        assert_eq!(
            def.requirements(),
            [
                "tabulate==0.9.0",
                "rich[jupyter]>=13,<14",
                "httpx",
                "idna>=3"
            ]
        );
        assert_eq!(def.npm, ["sucrase@3.35.1", "@scope/x@^1 || 2.x", "lodash"]);
        let again = Definition::from_json(def.to_json().as_bytes(), &Limits::default()).unwrap();
        assert_eq!(again, def);
    }

    #[test]
    fn from_defaults_to_python_and_nothing_else_is_required() {
        let def = parse("name = \"a\"").unwrap();

        assert_eq!(def.from, "python");
        assert!(def.apt.is_empty() && def.pip.is_empty() && def.files.is_empty());
        assert_eq!(
            def.to_json(),
            "{\n  \"name\": \"a\",\n  \"from\": \"python\"\n}"
        );
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: &[(&str, &str)] = &[
            ("name = \"Bad Name\"", "name"),
            ("name = \"\"", "name"),
            ("name = \"a\"\nfrom = \"a\"", "from"),
            ("name = \"a\"\nfrom = \"../x\"", "from"),
            ("name = \"a\"\napt = [\"Jq\"]", "apt[0]"),
            ("name = \"a\"\napt = [\"jq\", \"jq=1.6\"]", "apt[1]"),
            ("name = \"a\"\napt = [\"jq=latest\"]", "apt[0]"),
            ("name = \"a\"\npip = [\"--index-url=http://x\"]", "pip[0]"),
            ("name = \"a\"\npip = [\"x @ https://h/x.whl\"]", "pip[0]"),
            ("name = \"a\"\npip = [\"./local\"]", "pip[0]"),
            ("name = \"a\"\npip = [\"ok\", \"a b c\"]", "pip[1]"),
            (
                "name = \"a\"\nrequirements = \"ok\\n-e .\\n\"",
                "requirements",
            ),
            (
                "name = \"a\"\nfiles = { \"rel/path\" = \"x\" }",
                "files[\"rel/path\"]",
            ),
            (
                "name = \"a\"\nfiles = { \"/a/../b\" = \"x\" }",
                "files[\"/a/../b\"]",
            ),
            (
                "name = \"a\"\nfiles = { \"/init\" = \"x\" }",
                "files[\"/init\"]",
            ),
            (
                "name = \"a\"\nfiles = { \"/usr/lib/bud/x.py\" = \"x\" }",
                "files[\"/usr/lib/bud/x.py\"]",
            ),
            (
                "name = \"a\"\narchives = { \"/opt/app\" = \"%%%\" }",
                "archives[\"/opt/app\"]",
            ),
            (
                "name = \"a\"\narchives = { \"/init\" = \"\" }",
                "archives[\"/init\"]",
            ),
            ("name = \"a\"\nenv = { \"1X\" = \"x\" }", "env[\"1X\"]"),
            ("name = \"a\"\nenv = { \"A-B\" = \"x\" }", "env[\"A-B\"]"),
            ("name = \"a\"\nworkdir = \"home\"", "workdir"),
            ("name = \"a\"\nmemory_mib = 1", "memory_mib"),
            ("name = \"a\"\nmemory_mib = 100000", "memory_mib"),
            ("name = \"a\"\nunknown = 1", "unknown"),
            ("name = \"a\"\napt = \"jq\"", "apt"),
            ("name = \"a\"\napt = [1]", "apt[0]"),
            (
                "name = \"a\"\nfrom = \"node\"\nnpm = [\"ok\", \"x@file:../y\"]",
                "npm[1]",
            ),
            (
                "name = \"a\"\nfrom = \"node\"\nnpm = [\"a\", \"b\", \"a@1\"]",
                "npm[2]",
            ),
            (
                "name = \"a\"\nfrom = \"node\"\nnpm = [\"--global\"]",
                "npm[0]",
            ),
            (
                "name = \"a\"\nfrom = \"node\"\nnpm = [\"u/repo\"]",
                "npm[0]",
            ),
            ("name = \"a\"\nfrom = \"node\"\nnpm = \"lodash\"", "npm"),
            ("name = \"a\"\nfrom = \"node\"\nnpm = [1]", "npm[0]"),
            ("name = \"a\"\nnpm = [\"lodash\"]", "npm"),
            (
                "name = \"a\"\n[[runtimes]]\nname = \"lua\"\ncommand = [\"../lua\"]",
                "runtimes[0].command",
            ),
            (
                "name = \"a\"\n[[runtimes]]\nname = \"lua\"\ncommand = []",
                "runtimes[0].command",
            ),
            (
                "name = \"a\"\n[[runtimes]]\nname = \"Lua\"\ncommand = [\"lua\"]",
                "runtimes[0].name",
            ),
            (
                "name = \"a\"\n[[runtimes]]\nname = \"lua\"\ncommand = [\"lua\"]\n\
                 extension = \"lua\"",
                "runtimes[0].extension",
            ),
            (
                "name = \"a\"\n[[runtimes]]\nname = \"lua\"\ncommand = [\"lua\"]\n\
                 package = \"Lua\"",
                "runtimes[0].package",
            ),
            (
                "name = \"a\"\n[[runtimes]]\nname = \"lua\"\ncommand = [\"lua\"]\n\
                 [[runtimes]]\nname = \"l\"\naliases = [\"lua\"]\ncommand = [\"lua\"]",
                "runtimes[1]",
            ),
            (
                "name = \"a\"\n[[runtimes]]\nname = \"lua\"\ncommand = [\"lua\"]\nargs = 1",
                "runtimes[0].args",
            ),
            ("apt = []", "name"),
            ("name = ", "body"),
        ];
        for (text, field) in cases {
            let err = parse(text).expect_err(text);
            assert_eq!(err.field(), *field, "{text}: {err}");
        }
    }

    #[test]
    fn limits_are_kept() {
        let limits = Limits {
            packages: 2,
            inline_bytes: 10,
            files: 1,
            ..Limits::default()
        };
        let too_many = Definition::from_toml(
            "name = \"a\"\napt = [\"jq\"]\npip = [\"x\"]\nrequirements = \"y\"",
            &limits,
        );
        let too_big = Definition::from_toml("name = \"a\"\nwarm = \"x = 1234567890\"", &limits);
        let too_many_files = Definition::from_toml(
            "name = \"a\"\nfiles = { \"/a\" = \"\", \"/b\" = \"\" }",
            &limits,
        );

        let too_many_npm = Definition::from_toml(
            "name = \"a\"\nfrom = \"node\"\napt = [\"jq\"]\nnpm = [\"x\", \"y\"]",
            &limits,
        );

        assert_eq!(too_many.unwrap_err().field(), "pip");
        assert_eq!(too_many_npm.unwrap_err().field(), "npm");
        assert_eq!(too_big.unwrap_err().field(), "files");
        assert_eq!(too_many_files.unwrap_err().field(), "files");
    }

    #[test]
    fn npm_faults_are_named_in_json_too() {
        let bad = Definition::from_json(
            br#"{"name": "a", "from": "node", "npm": ["sucrase@3.35.1", "x@https://h/x.tgz"]}"#,
            &Limits::default(),
        )
        .unwrap_err();
        let no_node =
            Definition::from_json(br#"{"name": "a", "npm": ["sucrase"]}"#, &Limits::default())
                .unwrap_err();
        let good = Definition::from_json(
            br#"{"name": "a", "from": "node", "npm": ["sucrase@3.35.1"]}"#,
            &Limits::default(),
        )
        .unwrap();

        assert_eq!(bad.field(), "npm[1]");
        assert!(bad.to_string().contains("no URLs"), "{bad}");
        assert_eq!(no_node.field(), "npm");
        assert!(
            no_node
                .to_string()
                .contains("npm packages need Node.js: build from the node template"),
            "{no_node}"
        );
        assert_eq!(good.npm, ["sucrase@3.35.1"]);
        assert!(good.to_json().contains("\"npm\": ["), "{}", good.to_json());
    }

    #[test]
    fn quotes_are_cut_to_a_prefix() {
        let long = "X".repeat(1 << 20);
        let err = parse(&format!("name = \"a\"\napt = [\"{long}\"]")).unwrap_err();
        let text = err.to_string();

        assert!(text.len() < 300, "{}", text.len());
        assert!(text.contains("(1048576 bytes)"), "{text}");
        assert_eq!(quote("short"), "\"short\"");
    }
}
