//! Several Raft groups per simulated node: one log per node with group
//! commit, one link per pair of nodes for every group's messages, a
//! workload spread over the groups with some left idle, and the checks run
//! group by group.

use bytes::Bytes;
use ferry_raft::{Entry, EntryPayload, PersistRequest, Request, Response};
use ferry_sim::config::{DiskConfig, SimConfig, TICK_US};
use ferry_sim::net::Partition;
use ferry_sim::scenarios::{run_scenario, ScenarioOptions};
use ferry_sim::sim::{run_seed_in_groups, Interference, Simulation};
use ferry_sim::storage::{DurableState, NodeDisk};
use ferry_sim::{run_seed, Counter};

fn assert_seed_passes(seed: u64, groups: usize) {
    let report = run_seed_in_groups(seed, None, groups, false);
    if let Some(failure) = &report.failure {
        panic!("seed {seed} with {groups} groups: {failure}\nreplay: ferry sim --seed {seed} --groups {groups} --trace");
    }
    assert_eq!(report.histories.len(), groups);
    // The idle groups (about a quarter, the highest ids) got no client
    // operation at all, and the liveness phase still passed for them.
    let config = SimConfig::random(seed, None).with_groups(groups);
    for (i, history) in report.histories.iter().enumerate() {
        let group = i as u64 + 1;
        if config.is_idle_group(group) {
            assert!(
                history.operations.is_empty(),
                "seed {seed}: idle group {group} saw operations"
            );
        }
    }
}

#[test]
fn seeds_with_four_groups_pass() {
    for seed in 0..10 {
        assert_seed_passes(seed, 4);
    }
}

#[test]
fn seeds_with_eight_groups_pass() {
    for seed in 100..106 {
        assert_seed_passes(seed, 8);
    }
}

#[test]
fn a_quarter_of_the_groups_are_idle() {
    let config = SimConfig::quiet(1, 3).with_groups(8);
    let idle: Vec<u64> = config
        .group_ids()
        .into_iter()
        .filter(|&g| config.is_idle_group(g))
        .collect();
    assert_eq!(idle, vec![7, 8]);
    assert_eq!(config.active_group_ids(), (1..=6).collect::<Vec<_>>());
    let one = SimConfig::quiet(1, 3).with_groups(1);
    assert_eq!(one.idle_groups, 0);
    assert_eq!(one, SimConfig::quiet(1, 3), "one group is the default");
}

/// With one group the multi-group entry point is the old one, draw for draw.
#[test]
fn one_group_runs_as_before() {
    for seed in [3u64, 16_953] {
        let old = run_seed(seed, None, true);
        let new = run_seed_in_groups(seed, None, 1, true);
        assert_eq!(old.trace, new.trace, "seed {seed}");
        let trace = new.trace.unwrap_or_default();
        assert!(
            !trace.contains(" g1 "),
            "seed {seed}: one-group traces name no group"
        );
    }
}

#[test]
fn multi_group_seeds_replay_byte_for_byte() {
    let a = run_seed_in_groups(21, None, 4, true);
    let b = run_seed_in_groups(21, None, 4, true);
    let (Some(ta), Some(tb)) = (&a.trace, &b.trace) else {
        panic!("no trace recorded");
    };
    assert_eq!(ta.as_bytes(), tb.as_bytes());
    assert_eq!(a.histories, b.histories);
    // Per-group events name their group.
    for group in 1..=4 {
        assert!(ta.contains(&format!(" g{group} role ")), "group {group}");
    }
}

fn elect_all(sim: &mut Simulation) {
    let done = sim.run_until_true(300 * TICK_US, TICK_US, |s| {
        s.groups().iter().all(|&g| s.group_leader(g).is_some())
    });
    assert!(done, "not every group elected a leader");
}

fn counts(sim: &Simulation, links: &[(u64, u64)], groups: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    for &(from, to) in links {
        for &group in groups {
            out.push(sim.delivered_messages(from, to, group));
        }
    }
    out
}

/// One link per pair of nodes: a partition that isolates a node cuts every
/// group at once, both ways, while the links among the others go on
/// carrying every group; once it heals, every group reaches the node again.
#[test]
fn a_partition_cuts_every_group() {
    let mut sim = Simulation::new(SimConfig::quiet(31, 3).with_groups(4));
    elect_all(&mut sim);
    let groups = sim.groups();
    let ids = sim.config().all_ids();
    sim.partition(Partition::isolate(&ids, 3));
    let cut = [(1, 3), (2, 3), (3, 1), (3, 2)];
    let kept = [(1, 2), (2, 1)];
    // Let what was in flight when the partition came arrive (or be dropped).
    let settle = sim.now_us() + 10 * TICK_US;
    sim.run_until(settle);
    let (cut_before, kept_before) = (counts(&sim, &cut, &groups), counts(&sim, &kept, &groups));
    let later = sim.now_us() + 60 * TICK_US;
    sim.run_until(later);
    assert_eq!(
        counts(&sim, &cut, &groups),
        cut_before,
        "a message of some group crossed the partition"
    );
    let kept_after = counts(&sim, &kept, &groups);
    assert!(
        kept_after.iter().zip(&kept_before).all(|(a, b)| a > b),
        "every group keeps talking on the links that are up: {kept_before:?} -> {kept_after:?}"
    );
    sim.partition(Partition::default());
    let later = sim.now_us() + 60 * TICK_US;
    sim.run_until(later);
    let healed = counts(&sim, &cut, &groups);
    assert!(
        healed.iter().zip(&cut_before).all(|(a, b)| a > b),
        "every group reaches node 3 again: {cut_before:?} -> {healed:?}"
    );
    assert!(sim.run_liveness(), "{:?}", sim.failure());
}

/// A clogged link holds the messages of every group it carries, and
/// releases them all. (Node 1's links in both directions are clogged: each
/// group's leader talks to node 1 over one of them.)
#[test]
fn a_clogged_link_holds_every_group() {
    let mut sim = Simulation::new(SimConfig::quiet(32, 3).with_groups(3));
    elect_all(&mut sim);
    let groups = sim.groups();
    let links = [(1, 2), (1, 3), (2, 1), (3, 1)];
    let per_group = |sim: &Simulation| -> Vec<u64> {
        groups
            .iter()
            .map(|&g| {
                links
                    .iter()
                    .map(|&(from, to)| sim.delivered_messages(from, to, g))
                    .sum()
            })
            .collect()
    };
    for (from, to) in links {
        sim.clog_link(from, to);
    }
    let settle = sim.now_us() + 5 * TICK_US;
    sim.run_until(settle);
    let before = per_group(&sim);
    let later = sim.now_us() + 30 * TICK_US;
    sim.run_until(later);
    assert_eq!(
        per_group(&sim),
        before,
        "a clogged link let a message through"
    );
    for (from, to) in links {
        sim.unclog_link(from, to);
    }
    let later = sim.now_us() + 5 * TICK_US;
    sim.run_until(later);
    let after = per_group(&sim);
    assert!(
        after.iter().zip(&before).all(|(a, b)| a > b),
        "{before:?} -> {after:?}"
    );
    assert!(sim.run_liveness(), "{:?}", sim.failure());
}

/// The idle group must converge too: with every message of group 4 lost,
/// the liveness phase fails, naming the group.
#[test]
fn liveness_requires_idle_groups_to_converge() {
    let mut config = SimConfig::quiet(33, 3).with_groups(4);
    config.liveness_election_timeouts = 5;
    let mut sim = Simulation::new(config);
    elect_all(&mut sim);
    sim.set_message_hook(Box::new(|_, m| {
        if m.group == 4 {
            Interference::Drop
        } else {
            Interference::None
        }
    }));
    if let Some(leader) = sim.group_leader(4) {
        sim.crash_node(leader);
    }
    assert!(!sim.run_liveness(), "converged with group 4 cut off");
    let failure = sim.failure().cloned().expect("a liveness failure");
    assert!(
        failure.detail.contains("group 4: "),
        "the failure names the idle group: {failure}"
    );
}

#[test]
fn idle_group_leader_crash_scenario() {
    let report = match run_scenario(
        "idle-group-leader-crash",
        ScenarioOptions {
            trace: true,
            ..ScenarioOptions::default()
        },
    ) {
        Ok(report) => report,
        Err(e) => panic!("{e}"),
    };
    if let Some(failure) = &report.failure {
        let trace = report.trace.as_deref().unwrap_or("");
        let tail: Vec<&str> = trace.lines().rev().take(60).collect();
        panic!(
            "{failure}\nnotes: {:#?}\nlast trace lines (newest first):\n{}",
            report.notes,
            tail.join("\n")
        );
    }
    assert!(
        report.notes.iter().any(|n| n.contains("elected node")),
        "{:#?}",
        report.notes
    );
}

fn write(seq: u64, index: u64) -> PersistRequest {
    PersistRequest {
        seq,
        hard_state: None,
        entries: vec![Entry {
            index,
            term: 1,
            payload: EntryPayload::Command(Bytes::from_static(b"x")),
        }],
    }
}

/// Group commit in the node's storage model: one sync covers every
/// group's writes since the last, each through its own seq; a crash loses
/// every group's unsynced writes together.
#[test]
fn one_sync_covers_writes_of_several_groups() {
    let mut disk = NodeDisk::new((1..=3).map(|g| (g, DurableState::default())));
    disk.write(1, write(1, 1)).unwrap();
    disk.write(3, write(1, 1)).unwrap();
    disk.write(3, write(2, 2)).unwrap();
    let covered = disk.start_sync().unwrap();
    assert_eq!(covered, vec![(1, 1), (3, 2)]);
    disk.write(2, write(1, 1)).unwrap();
    disk.complete_sync(&covered).unwrap();
    assert_eq!(disk.take_persisted_reports(), vec![(1, 1), (3, 2)]);
    disk.crash();
    let last: Vec<u64> = (1..=3)
        .map(|g| disk.group(g).map_or(0, |d| d.synced().last_index()))
        .collect();
    assert_eq!(last, vec![1, 0, 2], "group 2's write was not synced");
}

/// The same on the real storage, in a run: groups write at once, one sync
/// of the node's log covers several of them, and the seqs the real log
/// reports durable per group match the model's (the run checks each sync).
/// A crash and restart then brings every group back from the one log.
#[test]
fn one_real_sync_covers_several_groups_in_a_run() {
    let mut config = SimConfig::quiet(34, 3).with_groups(4);
    config.disk = DiskConfig {
        real: true,
        sync_ticks_min: 2,
        sync_ticks_max: 4,
        fault_weight: 0,
        replacements: 0,
    };
    let mut sim = Simulation::new(config);
    elect_all(&mut sim);
    let mut tags = Vec::new();
    for round in 0..10 {
        for group in [1, 2, 3] {
            let Some(leader) = sim.group_leader(group) else {
                continue;
            };
            let command = sim.scenario_write(0, round * 10 + group);
            tags.push(sim.submit_to(leader, group, Request::Propose(command)));
        }
        let next = sim.now_us() + TICK_US;
        sim.run_until(next);
    }
    let answered = sim.run_until_true(200 * TICK_US, TICK_US, |s| {
        tags.iter().all(|t| s.probe_response(*t).is_some())
    });
    assert!(answered, "not every write was answered");
    for tag in &tags {
        assert!(
            matches!(
                sim.probe_response(*tag),
                Some(Ok(Response::Proposed { .. }))
            ),
            "{:?}",
            sim.probe_response(*tag)
        );
    }
    assert!(
        sim.coverage().count(Counter::SyncCoveredGroups) > 0,
        "no sync covered writes of two groups"
    );
    assert!(sim.failure().is_none(), "{:?}", sim.failure());
    // Every node restarts on what its one log holds, for every group.
    sim.crash_node(2);
    assert!(sim.restart_node(2));
    assert!(sim.run_liveness(), "{:?}", sim.failure());
    for group in [1, 2, 3] {
        let applied = sim.group_machine(2, group).map_or(0, |m| m.applied());
        assert!(
            applied >= 10,
            "group {group} on node 2 applied only {applied}"
        );
    }
}
