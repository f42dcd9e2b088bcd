//! sha256 of build inputs, remembered across runs against each file's stat stamp (size,
//! mtime, ctime, inode), the way make and cargo trust timestamps: an unchanged ~30 MB of
//! inputs is not read again on every no-op build.
//!
//! The cache is advisory: a missing, corrupt or unwritable cache file only costs re-hashing.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
#[error("hash {path}")]
pub struct HashError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// The sha256 of a file, as lowercase hex, read in full.
pub fn sha256_file(path: &Path) -> Result<String, HashError> {
    let hash_err = |source| HashError {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(hash_err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).map_err(hash_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// What identifies the file at `path` as it is now (size, times, device and inode): a
/// cached hash holds while this does.
fn stamp_of(path: &Path) -> Result<String, HashError> {
    let meta = path.metadata().map_err(|source| HashError {
        path: path.to_owned(),
        source,
    })?;
    Ok(format!(
        "{}:{}.{}:{}.{}:{}:{}",
        meta.len(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec(),
        meta.dev(),
        meta.ino()
    ))
}

/// Remembered hashes, loaded from and saved to one file.
#[derive(Debug)]
pub struct HashCache {
    file: PathBuf,
    entries: BTreeMap<PathBuf, (String, String)>,
    dirty: bool,
}

impl HashCache {
    /// Loads the cache kept in `file` (an empty cache if there is none).
    pub fn load(file: &Path) -> HashCache {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let entries = text
            .lines()
            .filter_map(|line| {
                let mut fields = line.split('\t');
                let (path, stamp, sha) = (fields.next()?, fields.next()?, fields.next()?);
                Some((PathBuf::from(path), (stamp.to_owned(), sha.to_owned())))
            })
            .collect();
        HashCache {
            file: file.to_owned(),
            entries,
            dirty: false,
        }
    }

    /// The sha256 of `path`, from the cache when its stamp is unchanged.
    pub fn sha256(&mut self, path: &Path) -> Result<String, HashError> {
        let stamp = stamp_of(path)?;
        match self.entries.get(path) {
            Some((cached_stamp, sha)) if *cached_stamp == stamp => return Ok(sha.clone()),
            _ => {}
        }
        let sha = sha256_file(path)?;
        self.entries.insert(path.to_owned(), (stamp, sha.clone()));
        self.dirty = true;
        Ok(sha)
    }

    /// Records `sha` as the sha256 of `path` as it is now, without reading it: for a caller
    /// that just made `path` from content whose hash it knows, such as a hard link to a file
    /// it hashed (a new link changes the file's ctime, so the old stamp no longer matches).
    pub fn remember(&mut self, path: &Path, sha: &str) -> Result<(), HashError> {
        let stamp = stamp_of(path)?;
        self.entries
            .insert(path.to_owned(), (stamp, sha.to_owned()));
        self.dirty = true;
        Ok(())
    }

    /// Writes the cache back if it changed. Entries for files that are gone are dropped.
    pub fn save(&mut self) {
        if !self.dirty {
            return;
        }
        self.entries.retain(|path, _| path.exists());
        let mut text = String::new();
        for (path, (stamp, sha)) in &self.entries {
            text.push_str(&format!("{}\t{stamp}\t{sha}\n", path.display()));
        }
        let tmp = self
            .file
            .with_extension(format!("tmp.{}", std::process::id()));
        // Advisory: failing to save only costs re-hashing next time.
        if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, &self.file).is_ok() {
            self.dirty = false;
        } else {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_bytes() {
        let path = std::env::temp_dir().join(format!("bud-hashes-sha-{}", std::process::id()));
        std::fs::write(&path, b"abc").unwrap();

        let sha = sha256_file(&path).unwrap();

        assert_eq!(
            sha,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn cache_survives_a_reload_and_notices_a_change() {
        let dir = std::env::temp_dir().join(format!("bud-hashes-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (input, file) = (dir.join("input"), dir.join("cache.tsv"));
        std::fs::write(&input, b"abc").unwrap();
        let mut cache = HashCache::load(&file);
        let first = cache.sha256(&input).unwrap();
        cache.save();

        let mut reloaded = HashCache::load(&file);
        let again = reloaded.sha256(&input).unwrap();
        std::fs::write(&input, b"abcd").unwrap();
        let changed = reloaded.sha256(&input).unwrap();

        assert_eq!(first, again);
        assert!(!reloaded.entries.is_empty());
        assert_ne!(changed, first);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_remembered_hash_is_trusted_until_the_file_changes() {
        let dir = std::env::temp_dir().join(format!("bud-hashes-remember-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (input, file) = (dir.join("input"), dir.join("cache.tsv"));
        std::fs::write(&input, b"abc").unwrap();
        let mut cache = HashCache::load(&file);

        cache.remember(&input, "not-read").unwrap();
        let trusted = cache.sha256(&input).unwrap();
        std::fs::write(&input, b"abcd").unwrap();
        let read = cache.sha256(&input).unwrap();

        assert_eq!(trusted, "not-read");
        assert_eq!(read, sha256_file(&input).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
