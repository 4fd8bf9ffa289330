//! `ferry`: the one binary. Subcommands: `dev`, `serve`, `sim`, `lincheck`.

#![forbid(unsafe_code)]

mod lincheck_cmd;
mod sim_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    /// Run seeds of the simulator: the real engine under network, disk and
    /// clock faults, with safety, linearizability and liveness checked.
    Sim(sim_cmd::SimArgs),
    /// Check Jepsen-format register histories for linearizability.
    Lincheck(lincheck_cmd::LincheckArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Sim(args) => sim_cmd::run(args),
        Command::Lincheck(args) => lincheck_cmd::run(args),
    }
}
