//! Secrets the operator gives the server (`--egress-secrets FILE`), for rules' header values
//! to name (`{{secret:NAME}}`, [`super::rules`]): read at start and again on SIGHUP, held
//! in the server's memory only. No route returns a value; the connection log, the audit log,
//! traces, metrics and error messages name secrets, never their values.
//!
//! The file: one `NAME=VALUE` a line (NAME: letters, digits and `_`, not starting with a
//! digit; VALUE: the rest of the line, as it is), `#` comments and blank lines. A file that
//! does not parse is refused whole: at start the server does not start, at a reload the
//! secrets held stay as they were.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

/// Why a secrets file was refused (the line, never a value).
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error("reading {0}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("line {line}: not NAME=VALUE")]
    NotAssignment { line: usize },
    #[error("line {line}: {} is not a secret's name (letters, digits and _)", bud_guest::echo::quote(.name))]
    BadName { line: usize, name: String },
    #[error("line {line}: {name} is given twice")]
    Twice { line: usize, name: String },
    #[error("{0}: holds a carriage return or a NUL")]
    BadByte(PathBuf),
}

/// The secrets held now, and where they are read from.
#[derive(Default)]
pub struct Secrets {
    path: Option<PathBuf>,
    values: RwLock<BTreeMap<String, String>>,
}

impl std::fmt::Debug for Secrets {
    /// Names only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets")
            .field("path", &self.path)
            .field("names", &self.names())
            .finish()
    }
}

impl Secrets {
    /// Reads `path`.
    pub fn load(path: &Path) -> Result<Self, SecretsError> {
        let values = read(path)?;
        Ok(Self {
            path: Some(path.to_owned()),
            values: RwLock::new(values),
        })
    }

    /// Secrets from `text` (tests).
    pub fn from_text(text: &str) -> Result<Self, SecretsError> {
        Ok(Self {
            path: None,
            values: RwLock::new(parse(text)?),
        })
    }

    /// Reads the file again; on an error the secrets held stay. Returns how many are held.
    pub fn reload(&self) -> Result<usize, SecretsError> {
        let Some(path) = &self.path else {
            return Ok(0);
        };
        let values = read(path)?;
        let n = values.len();
        *self.values.write().unwrap_or_else(|e| e.into_inner()) = values;
        Ok(n)
    }

    /// The value of `name`, if held.
    pub fn get(&self, name: &str) -> Option<String> {
        self.values
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// Whether `name` is held.
    pub fn holds(&self, name: &str) -> bool {
        self.values
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(name)
    }

    /// The names held.
    pub fn names(&self) -> Vec<String> {
        self.values
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }
}

fn read(path: &Path) -> Result<BTreeMap<String, String>, SecretsError> {
    let text = std::fs::read_to_string(path).map_err(|e| SecretsError::Read(path.to_owned(), e))?;
    if text.bytes().any(|b| b == b'\r' || b == 0) {
        return Err(SecretsError::BadByte(path.to_owned()));
    }
    parse(&text)
}

fn parse(text: &str) -> Result<BTreeMap<String, String>, SecretsError> {
    let mut values = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        let (name, value) = line
            .split_once('=')
            .ok_or(SecretsError::NotAssignment { line: line_no })?;
        let name = name.trim();
        let good = name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !good {
            return Err(SecretsError::BadName {
                line: line_no,
                name: name.to_owned(),
            });
        }
        if values.insert(name.to_owned(), value.to_owned()).is_some() {
            return Err(SecretsError::Twice {
                line: line_no,
                name: name.to_owned(),
            });
        }
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_of_assignments_is_read_and_reloaded_and_a_bad_one_changes_nothing() {
        let dir = std::env::temp_dir().join(format!("bud-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secrets");
        std::fs::write(&path, "# keys\nOPENAI=sk-live=1\n\n_GH = x \n").unwrap();
        let secrets = Secrets::load(&path).unwrap();

        assert_eq!(secrets.get("OPENAI").as_deref(), Some("sk-live=1"));
        assert_eq!(secrets.get("_GH").as_deref(), Some(" x "));
        assert!(!format!("{secrets:?}").contains("sk-live"));

        std::fs::write(&path, "OPENAI=sk-live-2\n").unwrap();
        assert_eq!(secrets.reload().unwrap(), 1);
        assert_eq!(secrets.get("OPENAI").as_deref(), Some("sk-live-2"));
        assert!(!secrets.holds("_GH"));

        std::fs::write(&path, "OPENAI=sk-live-3\n9BAD=x\n").unwrap();
        let err = secrets.reload().unwrap_err().to_string();
        assert_eq!(
            err,
            "line 2: \"9BAD\" is not a secret's name (letters, digits and _)"
        );
        assert_eq!(secrets.get("OPENAI").as_deref(), Some("sk-live-2"));
        for (text, message) in [
            ("A=1\nA=2\n", "line 2: A is given twice"),
            ("just text\n", "line 1: not NAME=VALUE"),
        ] {
            std::fs::write(&path, text).unwrap();
            assert_eq!(secrets.reload().unwrap_err().to_string(), message);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
