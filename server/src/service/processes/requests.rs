//! What a request for a process, a watcher, stdin or a signal says, and the checks that
//! turn it into the core's terms ([`Start`]): the service's own input types.

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::core::processes::Start;
use crate::service::error::Error;

/// Longest command accepted, in bytes.
pub const MAX_COMMAND_BYTES: usize = 256 << 10;

/// `POST /v1/sessions/{id}/processes`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartProcess {
    /// A shell command line (`/bin/sh -c`).
    pub command: String,
    /// Its working directory (absolute, or relative to the work directory); default: the
    /// session's.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Variables on top of the session's.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Give it a stdin pipe (default: it reads nothing, `/dev/null`).
    #[serde(default)]
    pub stdin: bool,
    /// A name of the client's for it, shown in listings.
    #[serde(default)]
    pub tag: Option<String>,
    /// Run it on a terminal of this size (its stdin, stdout and stderr; output comes as
    /// stdout, input through `/stdin`).
    #[serde(default)]
    pub pty: Option<TerminalSize>,
    /// Run it as this user of the guest (`user`: uid 1000, home `/home/user`; `root`): its
    /// ids and groups, and `HOME`, `USER`, `LOGNAME`, `SHELL` from the guest's
    /// `/etc/passwd` (`env` may still set them). Default: as today, root with the session's
    /// environment (`HOME=/tmp`).
    #[serde(default)]
    pub user: Option<String>,
}

/// Longest user name accepted (Linux's `LOGIN_NAME_MAX` less its NUL).
pub const MAX_USER_BYTES: usize = 32;

/// A user name as the guest's `/etc/passwd` may have it: `[a-z_][a-z0-9_-]*`, at most
/// [`MAX_USER_BYTES`].
pub fn check_user(field: &str, user: &str) -> Result<(), Error> {
    let mut chars = user.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_-".contains(c));
    if !first_ok || !rest_ok || user.len() > MAX_USER_BYTES {
        return Err(Error::invalid(
            field,
            format!("{user:?} is not a user name (the guest has root and user)"),
        ));
    }
    Ok(())
}

/// A terminal's size; `POST /v1/sessions/{id}/processes/{pid}/resize`.
#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TerminalSize {
    pub rows: u16,
    pub cols: u16,
}

impl TerminalSize {
    /// Checked: 1..=1000 each.
    pub fn checked(self) -> Result<(u16, u16), Error> {
        if !(1..=1000).contains(&self.rows) || !(1..=1000).contains(&self.cols) {
            return Err(Error::invalid(
                "pty",
                format!(
                    "a terminal is 1..=1000 rows and columns (got {}x{})",
                    self.rows, self.cols
                ),
            ));
        }
        Ok((self.rows, self.cols))
    }
}

impl StartProcess {
    /// The service's request, checked.
    pub fn into_start(self) -> Result<Start, Error> {
        if self.command.trim().is_empty() {
            return Err(Error::invalid("command", "command must not be empty"));
        }
        if self.command.len() > MAX_COMMAND_BYTES {
            return Err(Error::TooLarge {
                field: "command".into(),
                bytes: self.command.len(),
                limit: MAX_COMMAND_BYTES,
            });
        }
        check_env(&self.env)?;
        if self.command.contains('\0') || self.cwd.as_deref().is_some_and(|c| c.contains('\0')) {
            return Err(Error::invalid(
                "command",
                "command and cwd must not contain NUL",
            ));
        }
        if let Some(user) = &self.user {
            check_user("user", user)?;
        }
        Ok(Start {
            cmd: self.command.clone(),
            args: Vec::new(),
            script: self.command,
            cwd: self.cwd.filter(|c| !c.is_empty()),
            env: self.env,
            tag: self.tag,
            stdin: self.stdin,
            pty: self.pty.map(TerminalSize::checked).transpose()?,
            user: self.user,
            internal: false,
        })
    }
}

/// Environment names a process may be given: a shell variable's.
pub fn check_env(env: &BTreeMap<String, String>) -> Result<(), Error> {
    for (k, v) in env {
        let name_ok = !k.is_empty()
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !name_ok || v.contains('\0') {
            return Err(Error::invalid(
                "env",
                format!("env: {k:?} is not a variable name, or its value holds NUL"),
            ));
        }
    }
    Ok(())
}

/// `POST /v1/sessions/{id}/watchers`: watch a directory of the work directory (`"."`: all
/// of it), and its subdirectories if `recursive`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateWatcher {
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
}

/// `POST /v1/sessions/{id}/processes/{pid}/stdin`: `data` (text) or `data_b64`, then close
/// it if `close`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteStdin {
    #[serde(default)]
    pub data: Option<String>,
    #[serde(default)]
    pub data_b64: Option<String>,
    #[serde(default)]
    pub close: bool,
}

impl WriteStdin {
    /// The bytes to write.
    pub fn bytes(&self) -> Result<Vec<u8>, Error> {
        match (&self.data, &self.data_b64) {
            (Some(_), Some(_)) => Err(Error::invalid("data", "give data or data_b64, not both")),
            (Some(t), None) => Ok(t.as_bytes().to_vec()),
            (None, Some(b)) => base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|e| Error::invalid("data_b64", format!("data_b64 is not base64: {e}"))),
            (None, None) => Ok(Vec::new()),
        }
    }
}

/// `POST /v1/sessions/{id}/processes/{pid}/signal`: a number or a name (`SIGTERM`, `TERM`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendSignal {
    pub signal: serde_json::Value,
}

/// The signals known by name.
const SIGNALS: [(&str, i32); 12] = [
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("KILL", 9),
    ("USR1", 10),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
];

impl SendSignal {
    pub fn number(&self) -> Result<i32, Error> {
        let bad = || {
            Error::invalid(
                "signal",
                "signal must be 1..=64 or a name such as SIGTERM, SIGKILL, SIGINT",
            )
        };
        match &self.signal {
            serde_json::Value::Number(n) => n
                .as_i64()
                .filter(|n| (1..=64).contains(n))
                .map(|n| n as i32)
                .ok_or_else(bad),
            serde_json::Value::String(s) => {
                let name = s.trim().to_ascii_uppercase();
                let name = name.strip_prefix("SIG").unwrap_or(&name);
                SIGNALS
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| *v)
                    .ok_or_else(bad)
            }
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn signals_by_number_and_name() {
        let sig = |v| SendSignal { signal: v }.number().ok();
        assert_eq!(sig(json!(9)), Some(9));
        assert_eq!(sig(json!("SIGTERM")), Some(15));
        assert_eq!(sig(json!("int")), Some(2));
        assert_eq!(sig(json!(0)), None);
        assert_eq!(sig(json!("SIGNOPE")), None);
        assert_eq!(sig(json!(true)), None);
    }

    #[test]
    fn a_start_request_is_checked() {
        let ok = StartProcess {
            command: "sleep 1".into(),
            ..StartProcess::default()
        };
        assert_eq!(ok.into_start().unwrap().script, "sleep 1");
        let empty = StartProcess::default();
        assert!(empty.into_start().is_err());
        let bad_env = StartProcess {
            command: "true".into(),
            env: [("1X".to_string(), "v".to_string())].into(),
            ..StartProcess::default()
        };
        assert!(bad_env.into_start().is_err());
        let as_user = |u: &str| StartProcess {
            command: "id".into(),
            user: Some(u.into()),
            ..StartProcess::default()
        };
        assert_eq!(
            as_user("user").into_start().unwrap().user.as_deref(),
            Some("user")
        );
        for bad in ["", "Root", "1x", "a b", "x:y", &"u".repeat(33)] {
            assert!(as_user(bad).into_start().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stdin_is_text_or_base64() {
        let w = WriteStdin {
            data_b64: Some("aGk=".into()),
            ..WriteStdin::default()
        };
        assert_eq!(w.bytes().unwrap(), b"hi");
        let both = WriteStdin {
            data: Some("a".into()),
            data_b64: Some("YQ==".into()),
            close: false,
        };
        assert!(both.bytes().is_err());
    }
}
