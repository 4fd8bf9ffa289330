//! The three field reports as scenarios, and a restored stale data
//! directory: each must reach its situation and show the correct outcome.

use ferry_sim::scenarios::{run_scenario, ScenarioOptions, SCENARIOS};

fn run(name: &str, options: ScenarioOptions) -> ferry_sim::scenarios::ScenarioReport {
    match run_scenario(name, options) {
        Ok(report) => report,
        Err(e) => panic!("{e}"),
    }
}

fn assert_passes(name: &str) {
    let report = run(
        name,
        ScenarioOptions {
            trace: true,
            ..ScenarioOptions::default()
        },
    );
    if let Some(failure) = &report.failure {
        let trace = report.trace.as_deref().unwrap_or("");
        let tail: Vec<&str> = trace.lines().rev().take(60).collect();
        panic!(
            "scenario {name} failed: {failure}\nnotes: {:#?}\nlast trace lines (newest first):\n{}",
            report.notes,
            tail.join("\n")
        );
    }
}

#[test]
fn snapshot_requests() {
    assert_passes("snapshot-requests");
}

#[test]
fn lost_leader_announcement() {
    assert_passes("lost-leader-announcement");
}

#[test]
fn stale_snapshot_hint_zero() {
    assert_passes("stale-snapshot-hint-zero");
}

/// Byzantine-lite: an older copy of a follower's data directory restored.
/// Both sides detect the log that went backwards, and it catches up.
#[test]
fn stale_data_directory() {
    assert_passes("stale-data-directory");
}

/// With the runtime's connection events taken away (nothing re-sends what
/// was lost while the link set up), the scenario fails: it detects the
/// class of bug from seed 002.
#[test]
fn lost_leader_announcement_fails_without_connection_events() {
    let report = run(
        "lost-leader-announcement",
        ScenarioOptions {
            without_peer_connected: true,
            ..ScenarioOptions::default()
        },
    );
    let failure = report
        .failure
        .expect("the scenario must fail without PeerConnected");
    assert!(failure.detail.contains("did not learn"), "{failure}");
}

/// Seed 004's signal taken away: every snapshot report from the follower
/// is lost (raft-rs did not accept them over the network at all). ferry's
/// leader must not wait for it: it leaves the snapshot state by its own
/// timeout, and the follower still catches up.
#[test]
fn stale_snapshot_hint_zero_recovers_when_every_report_is_lost() {
    let report = run(
        "stale-snapshot-hint-zero",
        ScenarioOptions {
            drop_snapshot_reports: true,
            ..ScenarioOptions::default()
        },
    );
    assert!(
        report.failure.is_none(),
        "{:?}\n{:#?}",
        report.failure,
        report.notes
    );
    assert!(
        report.notes.iter().any(|n| n.contains("caught up")),
        "{:#?}",
        report.notes
    );
}

#[test]
fn scenarios_are_deterministic() {
    for name in SCENARIOS {
        let options = ScenarioOptions {
            trace: true,
            ..ScenarioOptions::default()
        };
        let a = run(name, options);
        let b = run(name, options);
        assert_eq!(a.trace, b.trace, "{name}");
    }
}

#[test]
fn unknown_scenarios_are_refused() {
    assert!(run_scenario("no-such-thing", ScenarioOptions::default()).is_err());
}

#[test]
fn quiescent_leader_crash() {
    assert_passes("quiescent-leader-crash");
}

#[test]
fn quiescent_follower_partition() {
    assert_passes("quiescent-follower-partition");
}
