//! `ferry snapshot status FILE` and `ferry snapshot restore FILE
//! --data-dir DIR`: what an operator does with a backup that `etcdctl
//! snapshot save` took from a ferry cluster (see `ferry_server::backup`).
//!
//! A restore writes the backup's state into a new data directory; the
//! node started on it founds a new cluster with the members it is given
//! (`ferry serve --id N --member ...`, as for any new cluster), and every
//! member of that cluster is restored from the same file. ferry keeps a
//! cluster's membership in its log, not in the state, so the restore needs
//! no member list of its own.

use std::path::PathBuf;
use std::process::ExitCode;

use ferry_server::backup::{self, BackupInfo};
use ferry_server::kv_state::KvLimits;

/// Arguments of `ferry snapshot`.
#[derive(clap::Args, Debug)]
pub struct SnapshotArgs {
    #[command(subcommand)]
    command: SnapshotCommand,
}

#[derive(clap::Subcommand, Debug)]
enum SnapshotCommand {
    /// Check a backup (its SHA-256, its checksum, its contents) and print
    /// its revision, keys, size and hash.
    Status {
        /// The file `etcdctl snapshot save` wrote.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// `table` (the default) or `json`.
        #[arg(long, short = 'w', default_value = "table", value_parser = ["table", "json"])]
        write_out: String,
    },
    /// Create the data directory of a member of a new cluster from a
    /// backup: the keys at their revisions, the leases and the auth state.
    /// Restore every member from the same file, then start each with
    /// `ferry serve --data-dir DIR --id N --member ...`.
    Restore {
        /// The file `etcdctl snapshot save` wrote.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// The new member's data directory (must not exist, or be empty).
        #[arg(long, value_name = "DIR")]
        data_dir: PathBuf,
    },
}

/// Runs `ferry snapshot`.
pub fn run(args: SnapshotArgs) -> ExitCode {
    let outcome = match args.command {
        SnapshotCommand::Status { file, write_out } => {
            backup::inspect(&file).map(|info| print_status(&info, &write_out))
        }
        SnapshotCommand::Restore { file, data_dir } => {
            backup::restore(&file, &data_dir, KvLimits::default()).map(|info| {
                println!(
                    "restored revision {} ({} keys, {} versions, {} leases) into {}",
                    info.revision,
                    info.keys,
                    info.versions,
                    info.leases,
                    data_dir.display()
                );
            })
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ferry snapshot: {error}");
            ExitCode::FAILURE
        }
    }
}

fn print_status(info: &BackupInfo, write_out: &str) {
    if write_out == "json" {
        println!(
            "{{\"revision\":{},\"compact_revision\":{},\"totalKey\":{},\"versions\":{},\"leases\":{},\"totalSize\":{},\"sha256\":\"{}\"}}",
            info.revision,
            info.compacted_revision,
            info.keys,
            info.versions,
            info.leases,
            info.size_bytes,
            info.sha256
        );
        return;
    }
    let rows = [
        ("REVISION", info.revision.to_string()),
        ("COMPACT REVISION", info.compacted_revision.to_string()),
        ("TOTAL KEYS", info.keys.to_string()),
        ("VERSIONS", info.versions.to_string()),
        ("LEASES", info.leases.to_string()),
        ("TOTAL SIZE", info.size_bytes.to_string()),
        ("SHA-256", info.sha256.clone()),
    ];
    for (name, value) in rows {
        println!("{name:<17} {value}");
    }
}
