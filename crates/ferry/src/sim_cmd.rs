//! `ferry sim`.

use std::process::ExitCode;

/// Arguments of `ferry sim`.
#[derive(clap::Args, Debug)]
pub struct SimArgs {}

/// Runs `ferry sim`.
pub fn run(args: SimArgs) -> ExitCode {
    let _ = args;
    ExitCode::SUCCESS
}
