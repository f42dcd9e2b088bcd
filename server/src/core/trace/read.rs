//! Reading a kept trace (its lines after a seq, the whole of it with its check, the file to
//! export), and keeping the one an imported session's file carried.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use super::chain::{self, Broken, Verified};
use super::{Kept, Line, Traces, Whole, lines_of, valid_id};

impl Traces {
    /// Session `id`'s events on disk with seq after `after`, in order (None: it has no
    /// trace). A line cut short at the end is left out.
    pub fn read(&self, id: &str, after: u64) -> std::io::Result<Option<Vec<Line>>> {
        if !self.has(id) {
            return Ok(None);
        }
        let text = match std::fs::read_to_string(self.path(id)) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(Some(lines_of(&text, after)))
    }

    /// Session `id`'s trace read once, whole: its bytes, its lines and their check with
    /// this server's keys (what the review page, the packet and the spans are made of).
    pub fn whole(&self, id: &str) -> std::io::Result<Option<Whole>> {
        let Some(path) = self.file_of(id) else {
            return Ok(None);
        };
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let check = |key: &str, mac: &str, input: &[u8]| self.keys.verify_bytes(key, mac, input);
        let check = chain::verify(bytes.as_slice(), Some(&check));
        let lines = lines_of(&String::from_utf8_lossy(&bytes), 0);
        Ok(Some(Whole {
            bytes,
            lines,
            check,
        }))
    }

    /// Keeps `text`, the trace an imported session's file carried, as session `id`'s, if
    /// this server has none of it and `text`'s chain is whole and of that one session
    /// (then it is reopened and goes on where it stopped). Whether it was kept.
    pub fn adopt(&self, id: &str, text: &str) -> std::io::Result<bool> {
        if !valid_id(id) || self.has(id) {
            return Ok(false);
        }
        match chain::verify(text.as_bytes(), None) {
            Ok(v) if !v.sealed && v.session == id && !v.torn_tail => {}
            _ => return Ok(false),
        }
        let tmp = self.dir.join(format!(".{id}.adopt"));
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, self.path(id))?;
        self.index().insert(
            id.to_owned(),
            Kept {
                bytes: text.len() as u64,
                ended: None,
            },
        );
        Ok(true)
    }

    /// The path of session `id`'s trace file, if it has one (to export it whole).
    pub fn file_of(&self, id: &str) -> Option<PathBuf> {
        self.has(id).then(|| self.path(id))
    }

    /// Checks session `id`'s trace on disk, its seal with this server's keys.
    pub fn verify(&self, id: &str) -> std::io::Result<Option<Result<Verified, Broken>>> {
        let Some(path) = self.file_of(id) else {
            return Ok(None);
        };
        let file = std::io::BufReader::new(File::open(path)?);
        let check = |key: &str, mac: &str, input: &[u8]| self.keys.verify_bytes(key, mac, input);
        Ok(Some(chain::verify(file, Some(&check))))
    }
}
