//! `ferry`: the one binary. Subcommands: `dev`, `serve`, `snapshot`, `sim`,
//! `lincheck`, `bench`, `nemesis`.

#![forbid(unsafe_code)]

mod bench_cmd;
mod bench_watch;
mod dev_cmd;
mod lincheck_cmd;
mod nemesis;
mod serve_cmd;
mod sim_cmd;
mod snapshot_cmd;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The allocator of every ferry process. A member allocates and frees many
/// small objects per request (gRPC frames and futures, messages, log
/// entries, store records) on several threads; with glibc's malloc that
/// took about a sixth of a member's CPU under load (perf, 256 clients of
/// puts), most of it in arena bookkeeping (`_int_malloc`, `unlink_chunk`,
/// `malloc_consolidate`). mimalloc's per-thread free lists make the same
/// work cheaper; it is one C file built by the `cc` crate, so the build
/// needs nothing beyond the C compiler the Rust toolchain links with.
/// The crate's default, mimalloc v3, is also cheaper here than its v2
/// (`scripts/bench-ab.sh`, puts at 256 clients, 5 rounds: 62 against
/// 69 µs of server CPU per put, medians).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// ferry: a Raft consensus engine and a replicated key-value store that
/// speaks the etcd v3 API.
#[derive(Parser, Debug)]
#[command(name = "ferry", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start a local three-node cluster (client ports 2379, 22379, 32379;
    /// data under ./ferry-dev/). Ctrl-C stops it; run again to resume.
    Dev(dev_cmd::DevArgs),
    /// Run one node of a cluster: the etcd v3 API, the peer transport and
    /// the replicated key-value store.
    // Boxed: its many options would make every other command as large.
    Serve(Box<serve_cmd::ServeArgs>),
    /// Inspect a backup taken with `etcdctl snapshot save`, or restore a
    /// new cluster's member from one.
    Snapshot(snapshot_cmd::SnapshotArgs),
    /// Run seeds of the simulator: the real engine under network, disk and
    /// clock faults, with safety, linearizability and liveness checked.
    Sim(sim_cmd::SimArgs),
    /// Check Jepsen-format register histories for linearizability.
    Lincheck(lincheck_cmd::LincheckArgs),
    /// Load-test any etcd v3 endpoints (ferry or etcd) with puts or reads and
    /// report throughput and latency percentiles.
    Bench(bench_cmd::BenchArgs),
    /// Run a fault test of real `ferry serve` processes (as root): members
    /// in network namespaces partitioned, paused, killed, their disks
    /// filled and stalled, while clients run; then check linearizability,
    /// the watch guarantees and leases.
    Nemesis(nemesis::NemesisArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Dev(args) => dev_cmd::run(args),
        Command::Serve(args) => serve_cmd::run(*args),
        Command::Snapshot(args) => snapshot_cmd::run(args),
        Command::Sim(args) => sim_cmd::run(args),
        Command::Lincheck(args) => lincheck_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Nemesis(args) => nemesis::run(args),
    }
}

/// How `ferry serve` writes its log.
#[derive(clap::ValueEnum, serde::Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Lines for people (colored on a terminal).
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, message and
    /// every field of the event.
    Json,
}

/// Logs to stderr in `format`; `RUST_LOG` picks what (default: info).
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
}
