//! `ferry lincheck`.

use std::process::ExitCode;

/// Arguments of `ferry lincheck`.
#[derive(clap::Args, Debug)]
pub struct LincheckArgs {}

/// Runs `ferry lincheck`.
pub fn run(args: LincheckArgs) -> ExitCode {
    let _ = args;
    ExitCode::SUCCESS
}
