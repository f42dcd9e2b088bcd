//! `bud audit`: the records of an audit log (`bud serve --audit-log`) that match filters,
//! as they are (JSON lines) or as a table. A line that is not a record is reported on
//! stderr with its number, and the command then exits with status 1.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use bud_server::core::audit::Record;

#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    /// The audit log to read.
    log: PathBuf,
    /// Only this API key's records (its name).
    #[arg(long)]
    key: Option<String>,
    /// Only records with this status (`ok`, `error`, `timeout`, `cancelled`, ...).
    #[arg(long)]
    status: Option<String>,
    /// Only this session's cells.
    #[arg(long)]
    session: Option<String>,
    /// Only records at or after this time (RFC 3339, UTC, as in the log: `2026-11-23T14:00`).
    #[arg(long)]
    since: Option<String>,
    /// One line per record (time, key, route, kind, status, sizes) instead of JSON.
    #[arg(long)]
    table: bool,
}

fn matches(a: &AuditArgs, r: &Record) -> bool {
    let status = serde_json::to_value(r.status).ok();
    a.key.as_ref().is_none_or(|k| r.key.as_ref() == Some(k))
        && a.status
            .as_ref()
            .is_none_or(|s| status.as_ref().and_then(|v| v.as_str()) == Some(s))
        && a.session
            .as_ref()
            .is_none_or(|s| r.session.as_ref() == Some(s))
        && a.since
            .as_ref()
            .is_none_or(|t| r.time.as_str() >= t.as_str())
}

pub fn audit(a: &AuditArgs) -> anyhow::Result<ExitCode> {
    let file = std::fs::File::open(&a.log)
        .with_context(|| format!("cannot open the audit log {}", a.log.display()))?;
    let mut out = std::io::stdout().lock();
    let mut bad = 0;
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", a.log.display()))?;
        if line.is_empty() {
            continue;
        }
        let r: Record = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                eprintln!(
                    "bud: {} line {}: not an audit record: {e}",
                    a.log.display(),
                    i + 1
                );
                bad += 1;
                continue;
            }
        };
        if !matches(a, &r) {
            continue;
        }
        if a.table {
            let status = serde_json::to_value(r.status)?;
            writeln!(
                out,
                "{} {:<12} {:<28} {:<4} {:<12} code {:>7} B  out {:>8} B  err {:>7} B  {:>9.2} ms{}",
                r.time,
                r.key.as_deref().unwrap_or("-"),
                r.route,
                r.kind,
                status.as_str().unwrap_or("?"),
                r.code_bytes,
                r.stdout_bytes,
                r.stderr_bytes,
                r.total_ms,
                r.session.map(|s| format!("  {s}")).unwrap_or_default(),
            )?;
        } else {
            writeln!(out, "{line}")?;
        }
    }
    Ok(if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
