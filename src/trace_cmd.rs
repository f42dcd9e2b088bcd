//! `bud trace verify FILE`: checks a session's trace (from `GET /v1/sessions/{id}/trace`
//! or the state directory's `traces/`): every event's hash, its link to the one before, the
//! order, one session throughout, and the seal's signature when the server's key is given.
//! It says which line breaks the chain and exits with status 1 then; 0 when it is whole.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use bud_server::core::session_keys::OWN_KEY_FILE;
use bud_server::core::trace::chain;
use vmm::session_file::SessionKeys;

#[derive(Debug, clap::Args)]
pub struct TraceArgs {
    #[command(subcommand)]
    command: TraceCommand,
}

#[derive(Debug, clap::Subcommand)]
enum TraceCommand {
    /// Check a trace file's chain (and its seal, given the key).
    Verify(VerifyArgs),
}

#[derive(Debug, clap::Args)]
struct VerifyArgs {
    /// The trace to check (NDJSON, one event a line).
    file: PathBuf,
    /// The server's session keys (`bud serve --session-key-file`: one hex key a line), to
    /// check the seal's signature.
    #[arg(long, value_name = "FILE", conflicts_with = "state_dir")]
    key_file: Option<PathBuf>,
    /// The server's state directory, whose own key checks the seal's signature.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
}

pub fn trace(a: &TraceArgs) -> anyhow::Result<ExitCode> {
    match &a.command {
        TraceCommand::Verify(v) => verify(v),
    }
}

fn verify(a: &VerifyArgs) -> anyhow::Result<ExitCode> {
    let key_path = a
        .key_file
        .clone()
        .or_else(|| a.state_dir.as_ref().map(|d| d.join(OWN_KEY_FILE)));
    let keys = match &key_path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the session key file {}", p.display()))?;
            Some(
                SessionKeys::parse(&text)
                    .with_context(|| format!("session key file {}", p.display()))?,
            )
        }
        None => None,
    };
    let file = std::fs::File::open(&a.file)
        .with_context(|| format!("cannot open the trace {}", a.file.display()))?;
    let check = |key: &str, mac: &str, input: &[u8]| {
        keys.as_ref()
            .is_some_and(|k| k.verify_bytes(key, mac, input))
    };
    let seal: Option<chain::SealCheck<'_>> = match keys {
        Some(_) => Some(&check),
        None => None,
    };
    let name = a.file.display();
    match chain::verify(std::io::BufReader::new(file), seal) {
        Ok(v) => {
            let signature = match (v.sealed, v.signature_checked) {
                (false, _) => "not sealed: its session had not ended when it was read",
                (true, Some(true)) => "sealed, signature verified",
                (true, _) => "sealed, signature not checked (no --key-file or --state-dir)",
            };
            println!(
                "{name}: ok: session {}, {} events, {signature}; last hash {}{}",
                v.session,
                v.events,
                v.head,
                if v.torn_tail {
                    " (a last line cut short by a crash was left out)"
                } else {
                    ""
                }
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(b) => {
            println!("{name}: broken: {b}");
            Ok(ExitCode::FAILURE)
        }
    }
}
