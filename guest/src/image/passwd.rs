//! The image's `etc/passwd` after staging: a login shell the image does not have becomes
//! `/bin/sh`. The overlay gives `user` GNU bash, which only the `tools` template carries; on
//! the others its shell is busybox `sh`.

use crate::stage::{StageError, Staging};

/// Guest path of the password file.
const PASSWD: &str = "etc/passwd";
/// The shell every image has (busybox).
const FALLBACK_SHELL: &str = "/bin/sh";

/// `passwd` with each entry's shell that `has` (a guest path without its leading `/`) says
/// is missing replaced by [`FALLBACK_SHELL`]; other lines as they were.
pub fn with_present_shells(passwd: &str, has: impl Fn(&str) -> bool) -> String {
    let mut out = String::with_capacity(passwd.len());
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        match fields.as_slice() {
            [head @ .., shell] if fields.len() == 7 && shell.starts_with('/') => {
                let present = has(shell.trim_start_matches('/')) || *shell == "/bin/false";
                out.push_str(&head.join(":"));
                out.push(':');
                out.push_str(if present { shell } else { FALLBACK_SHELL });
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Rewrites the staged `etc/passwd` (if any) with [`with_present_shells`].
pub fn fix_login_shells(staging: &Staging) -> Result<(), StageError> {
    let Ok(text) = std::fs::read_to_string(staging.path(PASSWD)) else {
        return Ok(());
    };
    let fixed = with_present_shells(&text, |rel| staging.contains(rel));
    if fixed != text {
        staging.write(PASSWD, fixed.as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_login_shell_becomes_busybox_sh() {
        let passwd = "root:x:0:0:root:/root:/bin/sh\n\
                      user:x:1000:1000:user:/home/user:/bin/bash\n\
                      nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";

        let without = with_present_shells(passwd, |p| p == "bin/sh");
        let with = with_present_shells(passwd, |p| p == "bin/sh" || p == "bin/bash");

        assert_eq!(
            without,
            passwd.replace("/home/user:/bin/bash", "/home/user:/bin/sh")
        );
        assert_eq!(with, passwd);
    }
}
