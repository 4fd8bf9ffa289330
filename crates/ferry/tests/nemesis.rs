//! The process-level fault test, as the suite runs it: `ferry nemesis` for
//! a few seeds of 30 s with every fault, and its negative control (reads
//! that may be stale must be caught under partitions). Longer runs are
//! the README's `ferry nemesis --secs 600`.
//!
//! Needs root, iproute2, iptables, e2fsprogs and util-linux (`.ci/run`
//! installs what a fresh machine lacks); without them the runs fail with
//! the reason, they are never skipped.

use std::process::Command;
use std::sync::Mutex;

/// The runs take both cores: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `ferry nemesis ARGS`; its exit code and its summary (last line).
fn nemesis(args: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("nemesis")
        .args(args)
        .output()
        .expect("ferry runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let summary = stdout.lines().last().unwrap_or_default().to_string();
    assert!(
        summary.starts_with("nemesis "),
        "no summary line; stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    eprintln!("{stderr}\n{summary}");
    (output.status.code(), summary)
}

/// The value of `name=` in a summary line.
fn field<'a>(summary: &'a str, name: &str) -> &'a str {
    summary
        .split_whitespace()
        .find_map(|word| word.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name}= in {summary}"))
}

fn number(summary: &str, name: &str) -> u64 {
    field(summary, name)
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number in {summary}"))
}

#[test]
fn under_every_fault_the_registers_are_linearizable_and_watches_and_leases_hold() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    for seed in ["101", "102", "103"] {
        let (code, summary) = nemesis(&["--secs", "30", "--seed", seed]);
        assert_eq!(
            field(&summary, "verdict"),
            "linearizable",
            "seed {seed}: {summary}"
        );
        assert_eq!(code, Some(0), "seed {seed}: {summary}");
        // Faults were applied, operations and watch events were checked.
        assert_ne!(field(&summary, "faults"), "none", "{summary}");
        let faults: u64 = field(&summary, "faults")
            .split(',')
            .map(|kind| kind.split(':').nth(1).unwrap().parse::<u64>().unwrap())
            .sum();
        assert!(faults >= 5, "only {faults} faults in 30 s: {summary}");
        assert!(number(&summary, "ops") > 1000, "{summary}");
        assert!(number(&summary, "watch_events") > 100, "{summary}");
        assert!(number(&summary, "leases") > 0, "{summary}");
    }
}

#[test]
fn the_checker_has_teeth_stale_reads_under_partitions_are_not_linearizable() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (code, summary) = nemesis(&[
        "--secs",
        "20",
        "--seed",
        "7",
        "--serializable-reads",
        "--faults",
        "partition",
    ]);
    assert_eq!(field(&summary, "verdict"), "NOT-linearizable", "{summary}");
    assert_eq!(field(&summary, "kv"), "NOT-linearizable", "{summary}");
    assert_eq!(code, Some(1), "{summary}");
    assert!(
        field(&summary, "faults").starts_with("partition:"),
        "{summary}"
    );
}

#[test]
fn a_run_that_cannot_apply_its_faults_fails_with_the_reason() {
    // Without `iptables` on the PATH the run cannot partition anything: it
    // must say so and fail, not pass without faults.
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let path = std::env::var("PATH").unwrap_or_default();
    let without_iptables: Vec<&str> = path
        .split(':')
        .filter(|dir| !std::path::Path::new(dir).join("iptables").exists())
        .collect();
    let output = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["nemesis", "--secs", "5"])
        .env("PATH", without_iptables.join(":"))
        .output()
        .expect("ferry runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stdout}{stderr}");
    assert!(stdout.trim_end().ends_with("verdict=error"), "{stdout}");
    assert!(stderr.contains("iptables"), "{stderr}");
}
