//! The three field reports of `shared/seeds/` as named scenarios. Each
//! builds the situation of its report on purpose, with a fixed seed, and
//! asserts the outcome ferry promises; a scenario that fails to reach its
//! situation fails too (it would otherwise prove nothing).
//!
//! - `snapshot-requests` (seed 000, Ra): a follower receiving a snapshot gets
//!   proposals, linearizable reads, local reads, a membership request and a
//!   status query; each gets a definite answer, and the snapshot completes.
//! - `lost-leader-announcement` (seed 002, Tarantool): the leader's messages
//!   to a freshly connected follower are lost while the link sets up; once
//!   the transport reports the link ready the follower follows that leader,
//!   before any heartbeat could have told it, and without a new election.
//! - `stale-snapshot-hint-zero` (seed 004, Picodata): a follower with an
//!   empty log rejects a new leader's probe with hint term 0 and, the log
//!   being compacted, gets a snapshot; the report of the install is lost,
//!   so the leader sends the snapshot again, which the follower reports
//!   stale; the leader must go on replicating and the follower catch up.
//!
//! And one Byzantine-lite fault, beyond the reports:
//!
//! - `stale-data-directory`: a follower's data directory is replaced by an
//!   older copy while it is down (a backup restored). Its log went
//!   backwards below what it had acknowledged: the leader must notice
//!   (its heartbeat answers show the shorter log), the follower must refuse
//!   the commit index beyond its log rather than clamp it, and it must
//!   catch up, with every check still holding.
//!
//! And one of several groups per node:
//!
//! - `idle-group-leader-crash`: four groups on every node, the last one
//!   idle (no client traffic at all). The node leading the idle group (and
//!   not group 1, whose leadership is moved away if need be) crashes while
//!   group 1 takes writes; the idle group must elect a new leader among the
//!   others by itself (nothing but its own timers can make it), group 1
//!   must keep its leader and term, and once the node is back every group,
//!   the idle one too, must converge.
//!
//! And two of quiescence (idle groups go quiet, `ferry_raft::Options::quiesce`):
//!
//! - `quiescent-leader-crash`: a group goes idle and quiet (no message for
//!   many election timeouts), then its leader crashes. The transport
//!   reports the leader gone; the followers' election timers run again and
//!   a new leader is elected within the usual bound (the first campaign
//!   within two election timeouts of the crash), and serves writes.
//! - `quiescent-follower-partition`: a follower of a quiet group is cut
//!   off. It wakes (its transport reports the leader gone) and campaigns in
//!   vain, while the leader and the other follower stay quiet; once the
//!   partition heals, the leader wakes, and a write through the follower
//!   succeeds on every node, with no new election.

use std::cell::Cell;
use std::rc::Rc;

use ferry_raft::{
    AppendResult, MembershipChange, MessageBody, NodeId, ReadConsistency, Request, RequestError,
    Response, SnapshotOutcome,
};

use crate::checks::{Failure, FailureKind};
use crate::config::{SimConfig, TICK_US};
use crate::coverage::{Counter, Coverage};
use crate::net::Partition;
use crate::sim::{Interference, Simulation};

/// The scenario names, as `ferry sim --scenario NAME` takes them.
pub const SCENARIOS: &[&str] = &[
    "snapshot-requests",
    "lost-leader-announcement",
    "stale-snapshot-hint-zero",
    "stale-data-directory",
    "idle-group-leader-crash",
    "quiescent-leader-crash",
    "quiescent-follower-partition",
];

/// What a scenario run found.
#[derive(Clone, Debug)]
pub struct ScenarioReport {
    /// The scenario.
    pub name: String,
    /// Why it failed, if it did.
    pub failure: Option<Failure>,
    /// What it observed, in words (for the command's output).
    pub notes: Vec<String>,
    /// What it exercised.
    pub coverage: Coverage,
    /// The trace, when recorded.
    pub trace: Option<String>,
}

/// A scenario name that does not exist.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown scenario {name:?}; the scenarios are: {}", SCENARIOS.join(", "))]
pub struct UnknownScenario {
    /// The name asked for.
    pub name: String,
}

/// Switches that put a scenario's bug back, to show the scenario catches it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScenarioOptions {
    /// Record a trace.
    pub trace: bool,
    /// `lost-leader-announcement`: the runtime does not tell the engine when
    /// a link becomes ready (nothing re-sends what was lost).
    pub without_peer_connected: bool,
    /// `stale-snapshot-hint-zero`: every snapshot report from the follower
    /// is lost (raft-rs never accepted them over the network), so the
    /// leader must leave its snapshot state by its own timeout.
    pub drop_snapshot_reports: bool,
}

/// Runs a scenario by name.
pub fn run_scenario(
    name: &str,
    options: ScenarioOptions,
) -> Result<ScenarioReport, UnknownScenario> {
    let run: fn(&mut Simulation, &mut Vec<String>, ScenarioOptions) -> Result<(), String> =
        match name {
            "snapshot-requests" => snapshot_requests,
            "lost-leader-announcement" => lost_leader_announcement,
            "stale-snapshot-hint-zero" => stale_snapshot_hint_zero,
            "stale-data-directory" => stale_data_directory,
            "idle-group-leader-crash" => idle_group_leader_crash,
            "quiescent-leader-crash" => quiescent_leader_crash,
            "quiescent-follower-partition" => quiescent_follower_partition,
            _ => {
                return Err(UnknownScenario {
                    name: name.to_string(),
                })
            }
        };
    let mut config = match name {
        "snapshot-requests" => snapshot_requests_config(),
        "lost-leader-announcement" => lost_leader_announcement_config(),
        "stale-data-directory" => stale_data_directory_config(),
        "idle-group-leader-crash" => idle_group_leader_crash_config(),
        "quiescent-leader-crash" => quiescent_config(11),
        "quiescent-follower-partition" => quiescent_config(12),
        _ => stale_snapshot_hint_zero_config(),
    };
    config.trace = options.trace;
    config.peer_connected_events = !options.without_peer_connected;
    let mut notes = Vec::new();
    let mut slot: Option<Simulation> = None;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let sim = slot.insert(Simulation::new(config));
        run(sim, &mut notes, options)
    }));
    let (failure, coverage, trace) = match slot {
        Some(sim) => {
            let failure = match outcome {
                Ok(Ok(())) => sim.failure().cloned(),
                Ok(Err(detail)) => Some(sim.failure().cloned().unwrap_or(Failure {
                    kind: FailureKind::Scenario,
                    at_us: sim.now_us(),
                    detail,
                })),
                Err(_) => Some(Failure {
                    kind: FailureKind::Panic,
                    at_us: sim.now_us(),
                    detail: "panic during the scenario".to_string(),
                }),
            };
            let coverage = sim.coverage().clone();
            (failure, coverage, sim.into_report().trace)
        }
        None => (
            Some(Failure {
                kind: FailureKind::Panic,
                at_us: 0,
                detail: "panic while building the cluster".to_string(),
            }),
            Coverage::default(),
            None,
        ),
    };
    Ok(ScenarioReport {
        name: name.to_string(),
        failure,
        notes,
        coverage,
        trace,
    })
}

fn wait_for_leader(sim: &mut Simulation) -> Result<NodeId, String> {
    let found = sim.run_until_true(300 * TICK_US, TICK_US, |s| s.leader().is_some());
    sim.leader()
        .filter(|_| found)
        .ok_or_else(|| "no leader was elected within 300 ticks".to_string())
}

/// Proposes `count` writes through `leader`, one per tick, and waits until
/// they are committed.
fn write_through(
    sim: &mut Simulation,
    leader: NodeId,
    count: u64,
    value_base: u64,
) -> Result<(), String> {
    let mut tags = Vec::new();
    for i in 0..count {
        let command = sim.scenario_write(i % 2, value_base + i);
        tags.push(sim.submit(leader, Request::Propose(command)));
        let next = sim.now_us() + TICK_US;
        sim.run_until(next);
    }
    let answered = sim.run_until_true(200 * TICK_US, TICK_US, |s| {
        tags.iter().all(|t| s.probe_response(*t).is_some())
    });
    if !answered {
        return Err("writes through the leader were not all answered".to_string());
    }
    for tag in &tags {
        match sim.probe_response(*tag) {
            Some(Ok(Response::Proposed { .. })) => {}
            other => return Err(format!("a write through the leader was answered {other:?}")),
        }
    }
    let target = sim.engine(leader).map_or(0, |e| e.last_index());
    let committed = sim.run_until_true(200 * TICK_US, TICK_US, |s| {
        s.engine(leader).is_some_and(|e| e.commit_index() >= target)
    });
    if committed {
        Ok(())
    } else {
        Err(format!("the leader did not commit up to {target}"))
    }
}

fn snapshot_requests_config() -> SimConfig {
    let mut config = SimConfig::quiet(0, 3);
    config.snapshot_every_entries = 5;
    config.engine.compaction_lag_entries = 0;
    config.engine.snapshot_chunk_bytes = 64;
    config.engine.snapshot_chunk_timeout_ticks = 30;
    config.engine.request_timeout_ticks = 100;
    config
}

fn snapshot_requests(
    sim: &mut Simulation,
    notes: &mut Vec<String>,
    _: ScenarioOptions,
) -> Result<(), String> {
    let leader = wait_for_leader(sim)?;
    let follower = if leader == 1 { 2 } else { 1 };
    let ids = sim.config().all_ids();
    sim.partition(Partition::isolate(&ids, follower));
    write_through(sim, leader, 40, 100)?;
    // Slow every snapshot chunk to the follower so that it stays in its
    // receiving state while the requests arrive.
    sim.set_message_hook(Box::new(move |_, m| match m.body {
        MessageBody::SnapshotChunk { .. } if m.to == follower => Interference::Delay(TICK_US),
        _ => Interference::None,
    }));
    sim.partition(Partition::default());
    let receiving = sim.run_until_true(300 * TICK_US, 100, |s| {
        s.engine(follower)
            .is_some_and(|e| e.is_receiving_snapshot())
    });
    if !receiving {
        return Err(format!(
            "follower {follower} never entered its receiving-snapshot state"
        ));
    }
    notes.push(format!(
        "follower {follower} is receiving a snapshot at {}us",
        sim.now_us()
    ));
    let write = sim.scenario_write(0, 9_999);
    let requests = vec![
        ("propose", Request::Propose(write)),
        (
            "linearizable read",
            Request::Read(ReadConsistency::Linearizable),
        ),
        (
            "local read",
            Request::Read(ReadConsistency::Local { min_applied: None }),
        ),
        (
            "local read at the leader's commit",
            Request::Read(ReadConsistency::Local {
                min_applied: sim.engine(leader).map(|e| e.commit_index()),
            }),
        ),
        ("status", Request::Status),
        (
            "membership change",
            Request::ChangeMembership(MembershipChange::Remove(99)),
        ),
    ];
    let mut tags = Vec::new();
    for (what, request) in requests {
        let still = sim
            .engine(follower)
            .is_some_and(|e| e.is_receiving_snapshot());
        if !still {
            return Err(format!(
                "follower {follower} left its receiving state before the {what} was sent"
            ));
        }
        tags.push((what, sim.submit(follower, request)));
    }
    let all_answered = sim.run_until_true(300 * TICK_US, 100, |s| {
        tags.iter().all(|(_, t)| s.probe_response(*t).is_some())
    });
    for (what, tag) in &tags {
        let answer = sim.probe_response(*tag).cloned();
        notes.push(format!("{what}: {answer:?}"));
        match (*what, answer) {
            (_, None) => {
                return Err(format!(
                    "the {what} sent to the receiving follower got no answer"
                ))
            }
            (_, Some(Err(RequestError::Timeout))) => {
                return Err(format!(
                    "the {what} sent to the receiving follower timed out"
                ))
            }
            ("propose", Some(Ok(Response::Proposed { .. })))
            | ("linearizable read", Some(Ok(Response::ReadReady { .. })))
            | ("local read", Some(Ok(Response::ReadReady { .. })))
            | ("local read at the leader's commit", Some(Ok(Response::ReadReady { .. })))
            | ("status", Some(Ok(Response::Status(_))))
            | ("membership change", Some(Err(RequestError::InvalidMembershipChange { .. }))) => {}
            (_, Some(Err(RequestError::NotLeader { leader: Some(_) }))) => {}
            (_, other) => {
                return Err(format!(
                    "the {what} sent to the receiving follower was answered {other:?}"
                ))
            }
        }
    }
    if !all_answered {
        return Err("not every request was answered".to_string());
    }
    sim.clear_message_hook();
    if !sim.run_liveness() {
        return Err("the cluster did not converge after the snapshot".to_string());
    }
    if sim.coverage().count(Counter::SnapshotInstalled) == 0 {
        return Err("no snapshot was installed".to_string());
    }
    if sim.coverage().count(Counter::RequestWhileReceivingSnapshot) < tags.len() as u64 {
        return Err(
            "the requests did not all arrive while the snapshot was being received".to_string(),
        );
    }
    let applied = sim
        .machine(follower)
        .map_or(0, |m| m.get(0).map_or(0, |v| v));
    notes.push(format!(
        "follower {follower} register 0 = {applied} after convergence"
    ));
    Ok(())
}

fn lost_leader_announcement_config() -> SimConfig {
    let mut config = SimConfig::quiet(2, 3);
    // Heartbeats far apart: only the engine's answer to the link becoming
    // ready can tell the follower about the leader in time.
    config.engine.heartbeat_interval_ticks = 20;
    config.engine.election_timeout_ticks = 40;
    config.engine.request_timeout_ticks = 100;
    config
}

fn lost_leader_announcement(
    sim: &mut Simulation,
    notes: &mut Vec<String>,
    _: ScenarioOptions,
) -> Result<(), String> {
    let ids = sim.config().all_ids();
    // Node 3 starts cut off; 1 and 2 elect a leader without it.
    sim.partition(Partition::isolate(&ids, 3));
    let found = sim.run_until_true(400 * TICK_US, TICK_US, |s| {
        s.leader().is_some_and(|l| l != 3)
    });
    let leader = sim
        .leader()
        .filter(|_| found)
        .ok_or("no leader among nodes 1 and 2")?;
    let term = sim.engine(leader).map_or(0, |e| e.term());
    write_through(sim, leader, 5, 500)?;
    // Let the leader's last heartbeat to the others go out, so that the next
    // one is a full interval away.
    let heartbeat_sent = Rc::new(Cell::new(0u64));
    let seen = Rc::clone(&heartbeat_sent);
    sim.set_message_hook(Box::new(move |now, m| {
        if m.from == leader
            && matches!(
                m.body,
                MessageBody::Heartbeat { .. } | MessageBody::Append { .. }
            )
        {
            seen.set(now);
        }
        Interference::None
    }));
    let before = sim.now_us();
    sim.run_until_true(60 * TICK_US, 100, |_| heartbeat_sent.get() > before);
    // The link to node 3 comes up, but takes 3 ticks to set up: what the
    // leader sends meanwhile is lost.
    let last_periodic_us = heartbeat_sent.get();
    let window_us = 3 * TICK_US;
    sim.set_connect_window_us(window_us);
    let up_at = sim.now_us();
    sim.partition(Partition::default());
    notes.push(format!(
        "link to node 3 comes up at {up_at}us, ready at {}us",
        up_at + window_us
    ));
    let ready_at = up_at + window_us;
    // Before the next heartbeat could arrive, node 3 must know the leader.
    let deadline = ready_at + 4 * TICK_US;
    let follows = sim.run_until_true(deadline - sim.now_us(), 100, |s| {
        s.engine(3).is_some_and(|e| e.leader() == Some(leader))
    });
    let next_heartbeat_earliest = last_periodic_us + 20 * TICK_US * 9 / 10;
    if deadline >= next_heartbeat_earliest {
        return Err(
            "the scenario's timing does not separate the link event from the next heartbeat"
                .to_string(),
        );
    }
    if !follows {
        return Err(format!(
            "node 3 did not learn that {leader} leads within 4 ticks of the link becoming ready (at {}us it knows {:?})",
            sim.now_us(),
            sim.engine(3).and_then(|e| e.leader())
        ));
    }
    notes.push(format!("node 3 follows {leader} at {}us", sim.now_us()));
    sim.clear_message_hook();
    let caught_up = sim.run_until_true(100 * TICK_US, TICK_US, |s| {
        let target = s.engine(leader).map_or(0, |e| e.commit_index());
        s.machine(3).is_some_and(|m| m.applied() >= target)
    });
    if !caught_up {
        return Err("node 3 did not catch up with the leader's log".to_string());
    }
    let terms: Vec<u64> = [1, 2, 3]
        .iter()
        .map(|&n| sim.engine(n).map_or(0, |e| e.term()))
        .collect();
    if sim.leader() != Some(leader) || terms.iter().any(|&t| t != term) {
        return Err(format!(
            "a new election happened: leader {:?}, terms {terms:?}, expected {leader} in term {term}",
            sim.leader()
        ));
    }
    notes.push(format!(
        "no new election: every node is in term {term} under leader {leader}"
    ));
    if !sim.run_liveness() {
        return Err("the cluster did not converge".to_string());
    }
    Ok(())
}

fn stale_snapshot_hint_zero_config() -> SimConfig {
    let mut config = SimConfig::quiet(4, 3);
    config.snapshot_every_entries = 5;
    config.engine.compaction_lag_entries = 0;
    config.engine.snapshot_chunk_bytes = 32;
    config.engine.snapshot_chunk_timeout_ticks = 10;
    config
}

fn stale_snapshot_hint_zero(
    sim: &mut Simulation,
    notes: &mut Vec<String>,
    options: ScenarioOptions,
) -> Result<(), String> {
    // Node 3 is cut off from the start by a silent black hole (the
    // transport does not notice, so no connection events are reported):
    // its log stays empty. Later, until the leader has started a snapshot
    // for node 3, the entries sent there are lost; and the leader never
    // hears that the first install succeeded, so it sends the snapshot
    // again to a follower that has already applied it.
    let isolated = Rc::new(Cell::new(true));
    let snapshot_sent = Rc::new(Cell::new(false));
    let install_dropped = Rc::new(Cell::new(false));
    let probe_rejected = Rc::new(Cell::new(false));
    let (cut, sent, dropped) = (
        Rc::clone(&isolated),
        Rc::clone(&snapshot_sent),
        Rc::clone(&install_dropped),
    );
    let rejected_flag = Rc::clone(&probe_rejected);
    let drop_reports = options.drop_snapshot_reports;
    sim.set_message_hook(Box::new(move |_, m| {
        if cut.get() && (m.to == 3 || m.from == 3) {
            return Interference::Drop;
        }
        if drop_reports && m.from == 3 && matches!(m.body, MessageBody::SnapshotResponse { .. }) {
            dropped.set(true);
            return Interference::Drop;
        }
        match &m.body {
            MessageBody::AppendResponse(AppendResult::Reject { hint_term: 0, .. })
                if m.from == 3 =>
            {
                rejected_flag.set(true);
                Interference::None
            }
            MessageBody::SnapshotChunk { .. } if m.to == 3 => {
                sent.set(true);
                Interference::None
            }
            MessageBody::Append { entries, .. }
                if m.to == 3 && !entries.is_empty() && rejected_flag.get() && !sent.get() =>
            {
                Interference::Drop
            }
            MessageBody::SnapshotResponse {
                outcome: SnapshotOutcome::Installed { .. },
                ..
            } if m.from == 3 && !dropped.get() => {
                dropped.set(true);
                Interference::Drop
            }
            _ => Interference::None,
        }
    }));
    sim.set_local_snapshots(false);
    let found = sim.run_until_true(400 * TICK_US, TICK_US, |s| {
        s.leader().is_some_and(|l| l != 3)
    });
    let first = sim
        .leader()
        .filter(|_| found)
        .ok_or("no leader among nodes 1 and 2")?;
    write_through(sim, first, 30, 1_000)?;
    // A second leader, whose probes to node 3 start at the end of its log:
    // node 3's empty log rejects them with hint term 0.
    let second = if first == 1 { 2 } else { 1 };
    let tag = sim.submit(first, Request::TransferLeadership(second));
    let moved = sim.run_until_true(200 * TICK_US, TICK_US, |s| s.leader() == Some(second));
    if !moved {
        return Err(format!(
            "leadership did not move to {second} (transfer answered {:?})",
            sim.probe_response(tag)
        ));
    }
    let leader = second;
    isolated.set(false);
    let rejected = sim.run_until_true(100 * TICK_US, TICK_US, |s| {
        s.coverage().count(Counter::RejectHintTermZero) > 0
    });
    if !rejected {
        return Err("node 3 never rejected an append with hint term 0".to_string());
    }
    // Now the leader snapshots and compacts: node 3 can only catch up from
    // a snapshot.
    sim.set_local_snapshots(true);
    write_through(sim, leader, 12, 1_500)?;
    let stale = sim.run_until_true(300 * TICK_US, TICK_US, |s| {
        s.coverage().count(Counter::StaleSnapshot) > 0
    });
    notes.push(format!(
        "hint-term-0 rejects: {}, snapshots installed: {}, stale snapshot reports: {}",
        sim.coverage().count(Counter::RejectHintTermZero),
        sim.coverage().count(Counter::SnapshotInstalled),
        sim.coverage().count(Counter::StaleSnapshot)
    ));
    if !snapshot_sent.get() || !install_dropped.get() {
        return Err("node 3 never installed the snapshot".to_string());
    }
    if !stale {
        return Err("node 3 never reported a stale snapshot".to_string());
    }
    if !options.drop_snapshot_reports {
        sim.clear_message_hook();
    }
    // The leader must keep replicating to node 3: new writes reach it.
    write_through(sim, leader, 10, 2_000)?;
    let target = sim.engine(leader).map_or(0, |e| e.commit_index());
    let caught_up = sim.run_until_true(200 * TICK_US, TICK_US, |s| {
        s.machine(3).is_some_and(|m| m.applied() >= target)
    });
    if !caught_up {
        return Err(format!(
            "node 3 is stuck at applied {} while the leader committed {target}",
            sim.machine(3).map_or(0, |m| m.applied())
        ));
    }
    notes.push(format!(
        "node 3 caught up to {target} after the stale snapshot"
    ));
    if !sim.run_liveness() {
        return Err("the cluster did not converge".to_string());
    }
    Ok(())
}

fn stale_data_directory_config() -> SimConfig {
    let mut config = SimConfig::quiet(7, 3);
    config.snapshot_every_entries = 1_000;
    config
}

fn stale_data_directory(
    sim: &mut Simulation,
    notes: &mut Vec<String>,
    _options: ScenarioOptions,
) -> Result<(), String> {
    let leader = wait_for_leader(sim)?;
    let follower = sim
        .config()
        .voter_ids()
        .into_iter()
        .find(|&n| n != leader)
        .ok_or("no follower")?;
    write_through(sim, leader, 5, 100)?;
    let settled = sim.run_until_true(100 * TICK_US, TICK_US, |s| {
        s.engine(follower).map(|e| e.commit_index()) == s.engine(leader).map(|e| e.commit_index())
    });
    if !settled {
        return Err("the follower did not catch up before the backup".into());
    }
    let backup = sim
        .copy_disk(follower)
        .ok_or("the scenario needs the storage model")?;
    let backed_up = backup.group(1).map_or(0, |d| d.synced().last_index());
    write_through(sim, leader, 10, 200)?;
    sim.crash_node(follower);
    if !sim.restore_stale_disk(follower, backup) {
        return Err("could not restore the older copy".into());
    }
    if !sim.restart_node(follower) {
        return Err("the follower did not restart".into());
    }
    let restored_last = sim.engine(follower).map_or(0, |e| e.last_index());
    notes.push(format!(
        "node {follower} restarted on a copy ending at {restored_last} (backed up at {backed_up}); the leader had committed {}",
        sim.engine(leader).map_or(0, |e| e.commit_index())
    ));
    let target = sim.engine(leader).map_or(0, |e| e.last_index());
    let caught_up = sim.run_until_true(100 * TICK_US, TICK_US, |s| {
        s.engine(follower)
            .is_some_and(|e| e.last_index() >= target && e.applied_index() >= target)
    });
    if !caught_up {
        return Err(format!(
            "node {follower}, restored from an older copy, never caught up to {target}"
        ));
    }
    let leader_noticed = sim.faults_seen().iter().any(|(id, _, f)| {
        *id == leader
            && matches!(f, ferry_raft::Fault::FollowerLogWentBack { peer, .. } if *peer == follower)
    });
    let follower_refused = sim.faults_seen().iter().any(|(id, _, f)| {
        *id == follower && matches!(f, ferry_raft::Fault::CommitBeyondLog { .. })
    });
    notes.push(format!(
        "detected: the leader saw the log go back: {leader_noticed}; the follower refused a commit beyond its log: {follower_refused}"
    ));
    if !leader_noticed || !follower_refused {
        return Err("the stale copy was not detected on both sides".into());
    }
    if !sim.run_liveness() {
        return Err("no convergence after the restore".into());
    }
    Ok(())
}

fn idle_group_leader_crash_config() -> SimConfig {
    SimConfig::quiet(11, 3).with_groups(4)
}

fn idle_group_leader_crash(
    sim: &mut Simulation,
    notes: &mut Vec<String>,
    _options: ScenarioOptions,
) -> Result<(), String> {
    let groups = sim.groups();
    let idle = *groups.last().ok_or("no groups")?;
    if !sim.config().is_idle_group(idle) || sim.config().is_idle_group(1) {
        return Err(format!("group {idle} must be idle and group 1 busy"));
    }
    let all_led = sim.run_until_true(300 * TICK_US, TICK_US, |s| {
        s.groups().iter().all(|&g| s.group_leader(g).is_some())
    });
    if !all_led {
        return Err("not every group elected a leader".into());
    }
    let crashed = sim
        .group_leader(idle)
        .ok_or("the idle group has no leader")?;
    let old_term = sim.group_engine(crashed, idle).map_or(0, |e| e.term());
    notes.push(format!(
        "node {crashed} leads idle group {idle} in term {old_term}; group 1 is led by {:?}",
        sim.leader()
    ));
    let mut busy_leader = wait_for_leader(sim)?;
    if busy_leader == crashed {
        // Move the busy group's leadership away (a request to the busy group
        // only), so that the crash strikes the idle group's leader alone.
        let target = sim
            .config()
            .voter_ids()
            .into_iter()
            .find(|&n| n != crashed)
            .ok_or("no other voter")?;
        let tag = sim.submit(crashed, Request::TransferLeadership(target));
        let moved = sim.run_until_true(200 * TICK_US, TICK_US, |s| s.leader() == Some(target));
        if !moved {
            return Err(format!(
                "group 1's leadership did not move to {target} (answered {:?})",
                sim.probe_response(tag)
            ));
        }
        busy_leader = target;
    }
    write_through(sim, busy_leader, 5, 100)?;
    let busy_term = sim.engine(busy_leader).map_or(0, |e| e.term());
    sim.crash_node(crashed);
    // Only the idle group's own election timers can replace its leader.
    let election_us = u64::from(sim.config().engine.election_timeout_ticks) * TICK_US;
    let replaced = sim.run_until_true(20 * election_us, TICK_US, |s| {
        s.group_leader(idle).is_some_and(|l| {
            l != crashed && s.group_engine(l, idle).is_some_and(|e| e.term() > old_term)
        })
    });
    let new_leader = sim.group_leader(idle).filter(|_| replaced).ok_or_else(|| {
        format!("idle group {idle} did not elect a new leader within 20 election timeouts of its leader {crashed} crashing")
    })?;
    let new_term = sim.group_engine(new_leader, idle).map_or(0, |e| e.term());
    notes.push(format!(
        "idle group {idle} elected node {new_leader} in term {new_term} after node {crashed} crashed"
    ));
    // The busy group, whose leader did not crash, goes on under it.
    write_through(sim, busy_leader, 5, 200)?;
    let still = sim.engine(busy_leader).map_or(0, |e| e.term());
    if sim.leader() != Some(busy_leader) || still != busy_term {
        return Err(format!(
            "group 1 changed leader ({:?} in term {still}, was {busy_leader} in term {busy_term}): the crash of another group's leader must not disturb it",
            sim.leader()
        ));
    }
    notes.push(format!(
        "group 1 kept leader {busy_leader} in term {busy_term} throughout"
    ));
    if !sim.group_history(idle).operations.is_empty() {
        return Err(format!("idle group {idle} saw client operations"));
    }
    if !sim.restart_node(crashed) {
        return Err(format!("node {crashed} did not restart"));
    }
    if !sim.run_liveness() {
        return Err("the groups did not all converge after the restart".into());
    }
    if sim.coverage().count(Counter::IdleGroupReelected) == 0 {
        return Err("no re-election in an idle group was counted".into());
    }
    let caught_up = sim.group_machine(crashed, idle).map_or(0, |m| m.applied());
    notes.push(format!(
        "after the restart node {crashed} follows {:?} in group {idle}, applied {caught_up}",
        sim.group_engine(crashed, idle).and_then(|e| e.leader())
    ));
    Ok(())
}

fn quiescent_config(seed: u64) -> SimConfig {
    let mut config = SimConfig::quiet(seed, 3);
    config.engine.quiesce = true;
    config
}

/// Waits until every running voter is quiescent.
fn wait_until_quiet(sim: &mut Simulation) -> Result<(), String> {
    let voters = sim.config().voter_ids();
    let quiet = sim.run_until_true(100 * TICK_US, TICK_US, |s| {
        voters
            .iter()
            .all(|&n| s.engine(n).is_some_and(|e| e.is_quiescent()))
    });
    if quiet {
        Ok(())
    } else {
        Err("the idle group did not go quiet within 100 ticks".to_string())
    }
}

/// Counts the messages sent by the nodes `from` (all when empty) from now on.
fn count_messages(sim: &mut Simulation, from: Vec<NodeId>) -> Rc<Cell<u64>> {
    let count = Rc::new(Cell::new(0u64));
    let seen = Rc::clone(&count);
    sim.set_message_hook(Box::new(move |_, m| {
        if from.is_empty() || from.contains(&m.from) {
            seen.set(seen.get() + 1);
        }
        Interference::None
    }));
    count
}

fn quiescent_leader_crash(
    sim: &mut Simulation,
    notes: &mut Vec<String>,
    _: ScenarioOptions,
) -> Result<(), String> {
    let election_us = u64::from(sim.config().engine.election_timeout_ticks) * TICK_US;
    let leader = wait_for_leader(sim)?;
    write_through(sim, leader, 3, 100)?;
    wait_until_quiet(sim)?;
    notes.push(format!(
        "the group went quiet under leader {leader} at {}us",
        sim.now_us()
    ));
    // Quiet: nothing at all is sent for many election timeouts.
    let sent = count_messages(sim, Vec::new());
    let until = sim.now_us() + 20 * election_us;
    sim.run_until(until);
    if sent.get() != 0 {
        return Err(format!(
            "the quiet group sent {} messages in 20 election timeouts",
            sent.get()
        ));
    }
    notes.push("no message in 20 election timeouts".to_string());
    // The leader crashes; the transport of each follower reports it gone.
    let first_campaign = Rc::new(Cell::new(None::<u64>));
    let seen = Rc::clone(&first_campaign);
    sim.set_message_hook(Box::new(move |now, m| {
        if matches!(m.body, MessageBody::RequestVote { .. }) && seen.get().is_none() {
            seen.set(Some(now));
        }
        Interference::None
    }));
    let crashed_at = sim.now_us();
    sim.crash_node(leader);
    let awake = sim
        .config()
        .voter_ids()
        .into_iter()
        .all(|n| n == leader || sim.engine(n).is_some_and(|e| !e.is_quiescent()));
    if !awake {
        return Err("a follower stayed quiet after its leader was reported gone".to_string());
    }
    // The usual bound: timers drawn from [T, 2T) start the first campaign
    // within two election timeouts; allow a split vote or two after it.
    let bound_us = 6 * election_us;
    let elected = sim.run_until_true(bound_us, 100, |s| s.leader().is_some_and(|l| l != leader));
    let campaign_us = first_campaign.get().map(|t| t.saturating_sub(crashed_at));
    notes.push(format!(
        "first campaign {campaign_us:?}us after the crash; a new leader {:?} after {}us (election timeout {election_us}us)",
        sim.leader(),
        sim.now_us() - crashed_at
    ));
    if campaign_us.is_none_or(|us| us >= 2 * election_us + TICK_US) {
        return Err(format!(
            "the first campaign came {campaign_us:?}us after the crash, beyond two election timeouts"
        ));
    }
    let new_leader = sim
        .leader()
        .filter(|&l| elected && l != leader)
        .ok_or_else(|| format!("no new leader within {bound_us}us of the crash"))?;
    sim.clear_message_hook();
    write_through(sim, new_leader, 3, 200)?;
    if !sim.restart_node(leader) {
        return Err("the old leader did not restart".to_string());
    }
    if !sim.run_liveness() {
        return Err("the cluster did not converge after the crash".to_string());
    }
    Ok(())
}

fn quiescent_follower_partition(
    sim: &mut Simulation,
    notes: &mut Vec<String>,
    _: ScenarioOptions,
) -> Result<(), String> {
    let election_us = u64::from(sim.config().engine.election_timeout_ticks) * TICK_US;
    let leader = wait_for_leader(sim)?;
    let voters = sim.config().voter_ids();
    let [follower, other] = voters
        .iter()
        .copied()
        .filter(|&n| n != leader)
        .collect::<Vec<_>>()[..]
    else {
        return Err("not three voters".to_string());
    };
    write_through(sim, leader, 3, 100)?;
    wait_until_quiet(sim)?;
    let term = sim.engine(leader).map_or(0, |e| e.term());
    let ids = sim.config().all_ids();
    // Cut the follower off: its transport reports the leader gone (it
    // wakes), the leader's reports the follower gone (it stays quiet).
    let from_the_rest = count_messages(sim, vec![leader, other]);
    sim.partition(Partition::isolate(&ids, follower));
    let until = sim.now_us() + 5 * election_us;
    sim.run_until(until);
    let quiet_rest = [leader, other]
        .iter()
        .all(|&n| sim.engine(n).is_some_and(|e| e.is_quiescent()));
    let woke = sim.engine(follower).is_some_and(|e| !e.is_quiescent());
    notes.push(format!(
        "follower {follower} cut off for 5 election timeouts: awake {woke}, role {:?}; the others quiet {quiet_rest}, {} messages from them",
        sim.engine(follower).map(|e| e.role()),
        from_the_rest.get()
    ));
    if !woke {
        return Err(format!(
            "follower {follower} stayed quiet although its leader was reported gone"
        ));
    }
    if !quiet_rest || from_the_rest.get() != 0 {
        return Err("the leader and the other follower did not stay quiet".to_string());
    }
    sim.clear_message_hook();
    sim.partition(Partition::default());
    let write = sim.scenario_write(0, 777);
    let tag = sim.submit(follower, Request::Propose(write));
    let answered = sim.run_until_true(100 * TICK_US, TICK_US, |s| s.probe_response(tag).is_some());
    let answer = sim.probe_response(tag).cloned();
    notes.push(format!(
        "a write through follower {follower} after the heal: {answer:?}"
    ));
    let Some(Ok(Response::Proposed { index, .. })) = answer.clone().filter(|_| answered) else {
        return Err(format!(
            "the write through follower {follower} was answered {answer:?}"
        ));
    };
    let applied = sim.run_until_true(100 * TICK_US, TICK_US, |s| {
        voters.iter().all(|&n| {
            s.machine(n)
                .is_some_and(|m| m.applied() >= index && m.get(0) == Some(777))
        })
    });
    if !applied {
        return Err(format!(
            "the write at {index} was not applied on every node"
        ));
    }
    let terms: Vec<u64> = voters
        .iter()
        .map(|&n| sim.engine(n).map_or(0, |e| e.term()))
        .collect();
    if sim.leader() != Some(leader) || terms.iter().any(|&t| t != term) {
        return Err(format!(
            "a new election happened: leader {:?}, terms {terms:?}, expected {leader} in term {term}",
            sim.leader()
        ));
    }
    notes.push(format!(
        "applied on every node at {index}; still leader {leader} in term {term}"
    ));
    if !sim.run_liveness() {
        return Err("the cluster did not converge after the heal".to_string());
    }
    Ok(())
}
