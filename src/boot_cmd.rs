//! `bud boot`: build the guest if needed, boot it to the agent's READY doorbell, show the
//! console with timestamps and report the time from the first KVM_RUN to READY (and, for
//! diagnostics, an instruction-pointer profile of the boot).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use vmm::devices::console::ConsoleLine;
use vmm::{BootConfig, HostKind};

use crate::{Cli, build_guest, progress};

#[derive(Debug, clap::Args)]
pub struct BootArgs {
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = vmm::boot::DEFAULT_RAM_SIZE >> 20)]
    mem_mib: u64,
    /// Give up if READY has not come after this many seconds.
    #[arg(long, default_value_t = vmm::boot::DEFAULT_BOOT_TIMEOUT.as_secs())]
    timeout_s: u64,
    /// Keep kernel messages on the console (slower: every byte is a port exit).
    #[arg(long)]
    kernel_messages: bool,
    /// Extra kernel command-line options.
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Give the VM a virtio-net card (its driver probes it and eth0 gets its static address
    /// during the boot; no policy, so nothing can leave).
    #[arg(long)]
    network: bool,
    /// Boot this many times and report the median (the console is shown for the first only).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Sample the guest's instruction pointer every N microseconds and write a histogram,
    /// resolved against the kernel's System.map when found, to FILE (diagnostics).
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
    /// Sampling interval for --profile, in microseconds.
    #[arg(long, default_value_t = 1000)]
    profile_us: u64,
    /// Use this kernel instead of the built one (skips the guest build).
    #[arg(long, requires = "initramfs")]
    kernel: Option<PathBuf>,
    /// Use this initramfs instead of the built one.
    #[arg(long, requires = "kernel")]
    initramfs: Option<PathBuf>,
}

/// Writes `rip count symbol+offset` lines, most frequent first. Symbols come from the
/// System.map next to the kernel's build tree (`<kernel dir>/src/System.map`), if present.
fn write_profile(
    path: &std::path::Path,
    profile: &std::collections::HashMap<u64, u64>,
    kernel: &std::path::Path,
) -> anyhow::Result<()> {
    let map_path = kernel.parent().map(|d| d.join("src").join("System.map"));
    let mut symbols: Vec<(u64, String)> = map_path
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|text| {
            text.lines()
                .filter_map(|l| {
                    let mut it = l.split_whitespace();
                    let addr = u64::from_str_radix(it.next()?, 16).ok()?;
                    let _kind = it.next()?;
                    Some((addr, it.next()?.to_string()))
                })
                .collect()
        })
        .unwrap_or_default();
    symbols.sort();
    let name = |rip: u64| match symbols.partition_point(|(a, _)| *a <= rip) {
        0 => "?".to_string(),
        i if rip < 0xffff_8000_0000_0000 => format!("user:{:#x} (near {})", rip, symbols[i - 1].1),
        i => format!("{}+{:#x}", symbols[i - 1].1, rip - symbols[i - 1].0),
    };
    let mut by_symbol: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    for (&rip, &n) in profile {
        let sym = name(rip);
        let func = if rip >= 0xffff_8000_0000_0000 {
            sym.split('+').next().unwrap_or("?").to_string()
        } else {
            "(user mode)".to_string()
        };
        *by_symbol.entry(func).or_insert(0) += n;
    }
    let mut rows: Vec<_> = by_symbol.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1));
    let total: u64 = rows.iter().map(|r| r.1).sum::<u64>().max(1);
    let mut out = String::new();
    for (func, n) in rows {
        out.push_str(&format!(
            "{n:8} {:5.1}%  {func}\n",
            n as f64 * 100.0 / total as f64
        ));
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Resident set size and its peak of this process, in KiB, from /proc/self/status.
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn echo_line(line: &ConsoleLine) {
    let mut out = std::io::stdout().lock();
    // A closed stdout must not kill the boot; the console is also kept in memory.
    let _ = writeln!(
        out,
        "[{:>10.1} ms] {}",
        line.at.as_secs_f64() * 1e3,
        line.text
    );
}

pub fn boot(cli: &Cli, args: &BootArgs) -> anyhow::Result<()> {
    let (kernel, initramfs) = match (&args.kernel, &args.initramfs) {
        (Some(k), Some(i)) => (k.clone(), i.clone()),
        _ => {
            let a = build_guest(cli, bud_guest::recipe::BASE_TEMPLATE)?;
            (a.kernel, a.initramfs)
        }
    };
    let mut cfg = BootConfig::new(kernel, initramfs);
    cfg.ram_size = args.mem_mib << 20;
    cfg.timeout = Duration::from_secs(args.timeout_s);
    cfg.kernel_messages = args.kernel_messages;
    cfg.extra_cmdline = args.cmdline.clone();
    cfg.network = args.network;
    if args.profile.is_some() {
        cfg.profile_interval = Some(Duration::from_micros(args.profile_us));
    }
    progress(&format!(
        "host: {} ({}), guest RAM {} MiB",
        cfg.host_kind,
        match cfg.host_kind {
            HostKind::Pvm => "kvm_pvm software hypervisor: PVM command-line knobs applied",
            HostKind::Hardware => "hardware virtualization",
        },
        args.mem_mib
    ));
    progress(&format!("kernel command line: {}", cfg.cmdline()));

    let mut to_ready = Vec::with_capacity(args.repeat);
    let mut rss = Vec::with_capacity(args.repeat);
    for i in 0..args.repeat.max(1) {
        let echo: Option<vmm::devices::console::EchoFn> = if i == 0 {
            Some(Box::new(echo_line))
        } else {
            None
        };
        let guest = vmm::boot(&cfg, echo).with_context(|| format!("boot {} failed", i + 1))?;
        let t = guest.timings;
        progress(&format!(
            "boot {}: READY {:.1} ms after the first KVM_RUN (agent started at {}, VMM setup {:.1} ms); mailbox {} KiB at {:#x}",
            i + 1,
            t.to_ready.as_secs_f64() * 1e3,
            t.to_agent
                .map(|d| format!("{:.1} ms", d.as_secs_f64() * 1e3))
                .unwrap_or_else(|| "?".into()),
            t.setup.as_secs_f64() * 1e3,
            guest.mailbox.len() >> 10,
            guest.mailbox.guest_virtual_address(),
        ));
        to_ready.push(t.to_ready);
        // While the guest is alive: guest RAM the guest touched is part of this process.
        rss.push(rss_kib().0);
        if let Some(path) = &args.profile {
            write_profile(path, &guest.profile, &cfg.kernel)?;
            progress(&format!(
                "profile: {} samples written to {}",
                guest.profile.values().sum::<u64>(),
                path.display()
            ));
        }
    }
    let (_, peak) = rss_kib();
    to_ready.sort();
    rss.sort();
    progress(&format!(
        "time to READY: median {:.1} ms over {} boot(s) (min {:.1}, max {:.1}); VMM process RSS at READY {} KiB (median), peak {} KiB",
        to_ready[to_ready.len() / 2].as_secs_f64() * 1e3,
        to_ready.len(),
        to_ready[0].as_secs_f64() * 1e3,
        to_ready[to_ready.len() - 1].as_secs_f64() * 1e3,
        rss[rss.len() / 2],
        peak
    ));
    Ok(())
}
