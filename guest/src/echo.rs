//! What an error message may repeat of what a client sent: at most a short prefix of a
//! value, then `…` and the value's length, so the refusal of a 1 MiB policy entry is a
//! line, not a second copy of the entry (in the answer, the log and the audit trail).
//!
//! [`quote`] and [`excerpt`] for a value bud names itself (a policy entry, a field's path);
//! [`shorten`] for a message another library made: serde's quote the value or key they did
//! not expect, whole.

use std::borrow::Cow;

/// Characters of one value a message repeats, at most.
pub const PREFIX_CHARS: usize = 64;

/// Bytes of a message [`shorten`] passes on, at most (past its shortened quotes: a message
/// that quotes nothing long is never this long).
pub const MESSAGE_BYTES: usize = 1024;

/// `value` quoted and escaped (`{:?}`): whole if it has at most [`PREFIX_CHARS`]
/// characters, else its first ones, `…` and its length (`"aaaa"… (1048576 bytes)`).
pub fn quote(value: &str) -> String {
    match prefix(value) {
        None => format!("{value:?}"),
        Some(p) => format!("{p:?}… ({} bytes)", value.len()),
    }
}

/// `value` as it is, shortened as [`quote`] shortens it (a field's path, which may hold a
/// client's map key).
pub fn excerpt(value: &str) -> Cow<'_, str> {
    match prefix(value) {
        None => Cow::Borrowed(value),
        Some(p) => Cow::Owned(format!("{p}… ({} bytes)", value.len())),
    }
}

/// The first [`PREFIX_CHARS`] characters of `value`, if it has more.
fn prefix(value: &str) -> Option<&str> {
    value
        .char_indices()
        .nth(PREFIX_CHARS)
        .map(|(at, _)| &value[..at])
}

/// `message` with each quoted run (`"..."` with backslash escapes, as serde quotes a value,
/// or `` `...` ``, as it quotes a key) cut as [`quote`] cuts a value, and the whole cut at
/// [`MESSAGE_BYTES`] if it is still longer.
pub fn shorten(message: &str) -> Cow<'_, str> {
    let bytes = message.as_bytes();
    let mut out = String::new();
    // Copied to `out` up to here; looked at up to `at`.
    let (mut copied, mut at) = (0, 0);
    while let Some(open) = bytes[at..]
        .iter()
        .position(|b| *b == b'"' || *b == b'`')
        .map(|i| at + i)
    {
        let quote_char = bytes[open];
        let close = closing(bytes, open + 1, quote_char);
        let run = &message[open + 1..close];
        if let Some(p) = prefix(run) {
            out.push_str(&message[copied..=open]);
            // A cut escape (`\`) would escape the closing quote.
            out.push_str(p.trim_end_matches('\\'));
            out.push(char::from(quote_char));
            out.push_str(&format!("… ({} bytes)", run.len()));
            copied = (close + 1).min(bytes.len());
        }
        at = (close + 1).min(bytes.len());
    }
    let shortened = if copied == 0 {
        Cow::Borrowed(message)
    } else {
        out.push_str(&message[copied..]);
        Cow::Owned(out)
    };
    if shortened.len() <= MESSAGE_BYTES {
        return shortened;
    }
    let mut end = MESSAGE_BYTES;
    while !shortened.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!(
        "{}… ({} bytes)",
        &shortened[..end],
        shortened.len()
    ))
}

/// Where the run opened by `quote` before `from` closes: its closing quote, or the end of
/// `bytes` if it never closes.
fn closing(bytes: &[u8], from: usize, quote: u8) -> usize {
    let mut i = from;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if quote == b'"' => i += 2,
            b if b == quote => return i,
            _ => i += 1,
        }
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_value_is_quoted_whole_and_a_long_one_by_its_prefix_and_length() {
        let long = "a".repeat(1 << 20);
        let wide = "é".repeat(100);

        assert_eq!(quote("pypi.test"), r#""pypi.test""#);
        assert_eq!(quote("a\"b"), r#""a\"b""#);
        assert_eq!(
            quote(&long),
            format!("\"{}\"… (1048576 bytes)", "a".repeat(64))
        );
        assert_eq!(quote(&wide), format!("\"{}\"… (200 bytes)", "é".repeat(64)));
        assert_eq!(excerpt("network.deny_out"), "network.deny_out");
        assert_eq!(
            excerpt(&format!("env.{long}")),
            format!("env.{}… (1048580 bytes)", "a".repeat(60))
        );
    }

    #[test]
    fn serdes_messages_keep_their_words_and_lose_the_long_values_they_quote() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Spec {
            allow_out: Vec<String>,
        }
        let long = "a".repeat(1 << 20);
        let wrong_type = serde_json::from_str::<Spec>(&format!(r#"{{"allow_out": "{long}"}}"#))
            .unwrap_err()
            .to_string();
        let unknown = serde_json::from_str::<Spec>(&format!(r#"{{"{long}": 1}}"#))
            .unwrap_err()
            .to_string();
        let a64 = "a".repeat(64);

        assert_eq!(
            shorten(&wrong_type),
            format!(
                "invalid type: string \"{a64}\"… (1048576 bytes), expected a sequence at line 1 column 1048592"
            )
        );
        assert_eq!(
            shorten(&unknown),
            format!(
                "unknown field `{a64}`… (1048576 bytes), expected `allow_out` at line 1 column 1048579"
            )
        );
        assert!(matches!(
            shorten("unknown field `deny_out`"),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn an_escape_at_the_cut_does_not_eat_the_closing_quote_and_a_long_message_is_cut() {
        let escaped = format!("bad \"{}\\\"{}\" here", "b".repeat(63), "c".repeat(10));
        let unclosed = format!("bad `{}", "d".repeat(100));
        let wordy = "word ".repeat(1000);

        assert_eq!(
            shorten(&escaped),
            format!("bad \"{}\"… (75 bytes) here", "b".repeat(63))
        );
        assert_eq!(
            shorten(&unclosed),
            format!("bad `{}`… (100 bytes)", "d".repeat(64))
        );
        assert_eq!(
            shorten(&wordy),
            format!("{}… (5000 bytes)", &wordy[..MESSAGE_BYTES])
        );
    }
}
