//! The syntax of the domain names a policy or a rule names (below both, so that neither
//! imports the other).

/// Labels of letters, digits and hyphens (underscores too, as service names use them), at
/// least two labels... or one (`localhost`-like names pinned with `--egress-hosts`).
pub(crate) fn valid_domain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}
