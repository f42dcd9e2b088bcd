//! The keys that sign and check this server's session files (vmm's `session_file::mac`):
//! from `--session-key-file` (one hex key per line, the first signs, every one verifies:
//! a cluster's nodes share it, and rotate by adding the new key second, then first, then
//! dropping the old), or else the state directory's own `session.key`, made at its first
//! start (32 bytes from the host's CRNG, mode 0600). With its own key a node resumes what
//! it paused and after a restart; another node's export needs the shared key file.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use vmm::session_file::SessionKeys;

/// Why the session keys could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SessionKeyError {
    #[error("session key file {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("session key file {path}: {source}")]
    Keys {
        path: std::path::PathBuf,
        source: vmm::session_file::KeyError,
    },
}

/// The state directory's own key file (when no `--session-key-file` is given).
pub const OWN_KEY_FILE: &str = "session.key";

/// The keys of a server on state directory `root` (module docs).
pub fn load(root: &Path, key_file: Option<&Path>) -> Result<SessionKeys, SessionKeyError> {
    let path = key_file.map_or_else(|| root.join(OWN_KEY_FILE), Path::to_owned);
    let io = |source| SessionKeyError::Io {
        path: path.clone(),
        source,
    };
    let keys = |text: &str| {
        SessionKeys::parse(text).map_err(|source| SessionKeyError::Keys {
            path: path.clone(),
            source,
        })
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => keys(&text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && key_file.is_none() => {
            let made = SessionKeys::generate().map_err(|source| SessionKeyError::Keys {
                path: path.clone(),
                source,
            })?;
            // create_new: two servers starting on one directory never write two keys (the
            // second is refused by the directory's lock anyway).
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(io)?;
            f.write_all(made.to_file_text().as_bytes())
                .and_then(|()| f.sync_all())
                .map_err(io)?;
            tracing::info!(
                key = made.signer_id(),
                "made this state directory's session key"
            );
            Ok(made)
        }
        Err(e) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("bud-keys-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_directory_makes_its_own_key_once_mode_0600_and_keeps_it() {
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("own");

        let first = load(&d, None).unwrap();
        let again = load(&d, None).unwrap();
        let mode = std::fs::metadata(d.join(OWN_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();

        assert_eq!(first.signer_id(), again.signer_id());
        assert_eq!(mode & 0o777, 0o600);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_given_key_file_is_used_and_a_missing_or_bad_one_is_an_error() {
        let d = scratch("given");
        let file = d.join("keys");
        std::fs::write(&file, "ab".repeat(32)).unwrap();
        let bad = d.join("bad");
        std::fs::write(&bad, "not a key").unwrap();

        let given = load(&d, Some(&file)).unwrap();
        let missing = load(&d, Some(&d.join("none")));
        let refused = load(&d, Some(&bad));

        assert_eq!(
            given.signer_id(),
            SessionKeys::parse(&"ab".repeat(32)).unwrap().signer_id()
        );
        assert!(!d.join(OWN_KEY_FILE).exists(), "no own key with a key file");
        assert!(matches!(missing, Err(SessionKeyError::Io { .. })));
        assert!(matches!(refused, Err(SessionKeyError::Keys { .. })));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
