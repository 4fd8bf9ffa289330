//! The bound on the entries the log holds in memory
//! (`Options::log_memory_bytes_max` / `log_memory_entries_max`): settled
//! entries beyond it live in storage only, the leader loads them for a
//! lagging follower (`Action::LoadEntries` / `Input::EntriesLoaded`), and
//! a restart needs the bodies only after the applied point.

use bytes::Bytes;
use ferry_raft::testing::{test_options, Cluster};
use ferry_raft::{
    Action, Configuration, Entry, EntryPayload, Fault, HardState, Input, LogOutline, Message,
    MessageBody, Options, RaftNode, RestoredState, SnapshotMeta,
};

const ENTRIES_MAX: u64 = 3;

fn bounded(id: u64) -> Options {
    let mut o = test_options(id);
    o.log_memory_entries_max = ENTRIES_MAX;
    // Many small appends, so that catching up takes several loads.
    o.append_bytes_max = 64;
    // A window wide enough that loads, not acknowledgments, pace the
    // catch-up these tests follow step by step.
    o.inflight_messages_max = 256;
    o
}

fn others(leader: u64) -> Vec<u64> {
    [1u64, 2, 3].into_iter().filter(|&n| n != leader).collect()
}

/// A leader whose memory holds only the tail of a log of 40+ entries, and a
/// follower cut off before all of them.
fn leader_with_lagging_follower(options: fn(u64) -> Options) -> (Cluster, u64, u64) {
    let mut c = Cluster::with_options(&[1, 2, 3], options);
    let leader = c.elect();
    let follower = others(leader)[0];
    c.partition(leader, follower);
    for i in 0..40 {
        c.propose(leader, &format!("command-{i}"));
        c.deliver_all();
    }
    assert!(c.run_until(20, |c| c.node(leader).applied_index
        == c.raft(leader).last_index()));
    let log = c.raft(leader).log();
    assert!(log.settled_entry_count() <= ENTRIES_MAX);
    assert!(
        log.held_first_index() > c.raft(follower).last_index() + 1,
        "the entries the follower needs are in storage only"
    );
    (c, leader, follower)
}

/// Heals the partition and ticks until the leader asks to load entries
/// for the follower (held, not answered).
fn held_load(c: &mut Cluster, leader: u64, follower: u64) -> Input {
    c.nodes.get_mut(&leader).unwrap().hold_entry_loads = true;
    c.heal();
    assert!(c.run_until(20, |c| !c.node(leader).held_loads.is_empty()));
    let node = c.nodes.get_mut(&leader).unwrap();
    let load = node.held_loads.pop_front().unwrap();
    node.held_loads.clear();
    node.hold_entry_loads = false;
    let Input::EntriesLoaded { to, .. } = &load else {
        panic!("not a load answer: {load:?}")
    };
    assert_eq!(*to, follower);
    load
}

fn appends_from(actions: &[Action], leader: u64, to: u64) -> usize {
    actions
        .iter()
        .filter(|a| {
            matches!(a, Action::Send(Message { from, to: t, body: MessageBody::Append { entries, .. }, .. })
                if *from == leader && *t == to && !entries.is_empty())
        })
        .count()
}

#[test]
fn a_lagging_follower_catches_up_with_entries_loaded_from_storage() {
    let (mut c, leader, follower) = leader_with_lagging_follower(bounded);
    c.heal();
    let last = c.raft(leader).last_index();
    assert!(c.run_until(200, |c| c.node(follower).applied_index == last));
    let node = c.node(leader);
    assert!(
        node.entry_loads >= 2,
        "caught up over several loads: {}",
        node.entry_loads
    );
    assert!(node.faults.is_empty(), "{:?}", node.faults);
    assert_eq!(
        c.node(follower).storage.snapshot.index,
        0,
        "no snapshot was needed"
    );
    assert!(c.raft(leader).log().settled_entry_count() <= ENTRIES_MAX);
    assert_eq!(c.node(follower).applied, c.node(leader).applied);
}

#[test]
fn a_load_answer_after_a_leader_change_is_dropped() {
    let (mut c, leader, follower) = leader_with_lagging_follower(bounded);
    let load = held_load(&mut c, leader, follower);
    // A newer term deposes the leader before the answer comes.
    let term = c.raft(leader).term();
    let mut actions = Vec::new();
    let node = &mut c.nodes.get_mut(&leader).unwrap().raft;
    node.step(
        Input::Message(Message {
            group: 1,
            from: follower,
            to: leader,
            term: term + 1,
            body: MessageBody::HeartbeatResponse {
                read_seq: 0,
                last_index: 0,
                needs_append: false,
            },
        }),
        &mut actions,
    );
    assert!(node.role() != ferry_raft::Role::Leader);
    actions.clear();
    node.step(load, &mut actions);
    assert_eq!(appends_from(&actions, leader, follower), 0, "{actions:?}");
    assert!(!actions.iter().any(|a| matches!(a, Action::Fault(_))));
}

#[test]
fn a_load_answer_from_an_earlier_term_is_dropped() {
    let (mut c, leader, follower) = leader_with_lagging_follower(bounded);
    let load = held_load(&mut c, leader, follower);
    let Input::EntriesLoaded {
        to, from, entries, ..
    } = load
    else {
        unreachable!()
    };
    let mut actions = Vec::new();
    let node = &mut c.nodes.get_mut(&leader).unwrap().raft;
    let term = node.term();
    node.step(
        Input::EntriesLoaded {
            to,
            term: term - 1,
            from,
            entries,
        },
        &mut actions,
    );
    assert_eq!(appends_from(&actions, leader, follower), 0, "{actions:?}");
}

#[test]
fn a_load_answer_after_the_follower_moved_on_is_dropped() {
    let (mut c, leader, follower) = leader_with_lagging_follower(bounded);
    let load = held_load(&mut c, leader, follower);
    let Input::EntriesLoaded { from, .. } = &load else {
        unreachable!()
    };
    let from = *from;
    // The follower shows it has more than the load was for (it got them
    // another way): the leader replicates from there and loads afresh.
    let term = c.raft(leader).term();
    let mut actions = Vec::new();
    let node = &mut c.nodes.get_mut(&leader).unwrap().raft;
    node.step(
        Input::Message(Message {
            group: 1,
            from: follower,
            to: leader,
            term,
            body: MessageBody::AppendResponse(ferry_raft::AppendResult::Success {
                match_index: from + 5,
            }),
        }),
        &mut actions,
    );
    let reloads: Vec<_> = actions
        .iter()
        .filter_map(|a| match a {
            Action::LoadEntries { from, .. } => Some(*from),
            _ => None,
        })
        .collect();
    assert_eq!(reloads, vec![from + 6], "a load from where it is now");
    actions.clear();
    node.step(load, &mut actions);
    assert_eq!(appends_from(&actions, leader, follower), 0, "{actions:?}");
}

#[test]
fn a_load_answered_with_none_falls_back_to_the_snapshot() {
    fn options(id: u64) -> Options {
        let mut o = bounded(id);
        // The snapshot does not compact the log: the follower's entries
        // are still part of it, evicted from memory only.
        o.compaction_lag_entries = 1000;
        o
    }
    let (mut c, leader, follower) = leader_with_lagging_follower(options);
    c.snapshot(leader);
    let snapshot_index = c.raft(leader).snapshot_meta().index;
    assert!(c.raft(leader).first_index() <= c.raft(follower).last_index() + 1);
    c.nodes.get_mut(&leader).unwrap().fail_entry_loads = true;
    c.heal();
    let last = c.raft(leader).last_index();
    assert!(c.run_until(300, |c| c.node(follower).applied_index == last));
    assert!(c.node(leader).entry_loads >= 1);
    assert_eq!(
        c.node(follower).storage.snapshot.index,
        snapshot_index,
        "caught up by the snapshot"
    );
}

#[test]
fn loaded_entries_that_do_not_fit_the_log_raise_a_fault() {
    type Damage = fn(&mut Vec<Entry>);
    let damages: [(&str, Damage); 4] = [
        ("wrong term", |entries| entries[0].term += 1),
        ("empty", |entries| entries.clear()),
        ("gap", |entries| entries[0].index += 1),
        ("beyond through", |entries| {
            let mut extra = entries[entries.len() - 1].clone();
            extra.index += 1000;
            entries.push(extra);
        }),
    ];
    for (what, damage) in damages {
        let (mut c, leader, follower) = leader_with_lagging_follower(bounded);
        let mut load = held_load(&mut c, leader, follower);
        let Input::EntriesLoaded {
            entries: Some(entries),
            ..
        } = &mut load
        else {
            panic!("{what}: the load found its entries")
        };
        damage(entries);
        let mut actions = Vec::new();
        c.nodes
            .get_mut(&leader)
            .unwrap()
            .raft
            .step(load, &mut actions);
        assert!(
            actions
                .iter()
                .any(|a| matches!(a, Action::Fault(Fault::LoadedEntriesInvalid { .. }))),
            "{what}: {actions:?}"
        );
        assert_eq!(appends_from(&actions, leader, follower), 0, "{what}");
        assert!(
            !actions
                .iter()
                .any(|a| matches!(a, Action::LoadEntries { .. })),
            "{what}: not asked again at once"
        );
        // The next heartbeat round asks again, and the follower catches up.
        let last = c.raft(leader).last_index();
        assert!(
            c.run_until(200, |c| c.node(follower).applied_index == last),
            "{what}"
        );
        assert_eq!(c.node(follower).storage.snapshot.index, 0, "{what}");
    }
}

#[test]
fn memory_stays_within_the_bound_under_a_long_run() {
    const BYTES_MAX: u64 = 300;
    fn options(id: u64) -> Options {
        let mut o = test_options(id);
        o.log_memory_bytes_max = BYTES_MAX;
        o
    }
    let mut c = Cluster::with_options(&[1, 2, 3], options);
    let leader = c.elect();
    c.auto_sync = false;
    for round in 0..300 {
        for i in 0..5 {
            c.propose(leader, &format!("round-{round}-{i}"));
        }
        for id in [1, 2, 3] {
            if (round + id) % 3 != 0 {
                c.sync(id);
            }
        }
        c.deliver_all();
        for id in [1, 2, 3] {
            let raft = c.raft(id);
            let log = raft.log();
            assert!(
                log.settled_bytes() <= BYTES_MAX,
                "node {id}: {}",
                log.settled_bytes()
            );
            // Held beyond the bound: only what is not yet settled.
            let settled_limit = raft.applied_index().min(raft.durable_index());
            assert!(
                log.held_entry_count()
                    <= log.settled_entry_count() + (raft.last_index() - settled_limit),
                "node {id}"
            );
            log.assert_invariants_full();
        }
    }
    // Everything settles: syncs come again as appends arrive (entries the
    // leader still held behind a full window arrive after the last manual
    // sync).
    c.auto_sync = true;
    for id in [1, 2, 3] {
        c.sync(id);
    }
    c.tick_all();
    let last = c.raft(leader).last_index();
    assert!(last > 1500);
    assert!(c.run_until(50, |c| c.all_applied(last)));
    for id in [1, 2, 3] {
        let log = c.raft(id).log();
        assert!(
            log.held_entry_count() < 50,
            "node {id}: {}",
            log.held_entry_count()
        );
        // The whole log is still known: terms everywhere, though the
        // bodies are in storage.
        assert_eq!(c.raft(id).term_at(2), c.raft(leader).term_at(2));
        assert!(c.raft(id).entry(2).is_none());
    }
}

#[test]
fn restart_with_a_log_longer_than_the_bound() {
    let mut c = Cluster::with_options(&[1, 2, 3], bounded);
    let leader = c.elect();
    let lagging = others(leader)[0];
    for i in 0..20 {
        c.propose(leader, &format!("before-{i}"));
        c.deliver_all();
    }
    c.isolate(lagging);
    for i in 0..20 {
        c.propose(leader, &format!("after-{i}"));
        c.deliver_all();
    }
    assert!(c.run_until(20, |c| c.node(leader).applied_index
        == c.raft(leader).last_index()));
    let last = c.raft(leader).last_index();
    for id in [1, 2, 3] {
        c.restart_keeping_applied(id);
        let raft = c.raft(id);
        assert!(
            raft.log().held_first_index() == raft.applied_index() + 1,
            "node {id}: only the entries after the applied point are in memory"
        );
    }
    c.heal();
    assert!(c.run_until(300, |c| c.all_applied(last)));
    let loads: u64 = c.nodes.values().map(|n| n.entry_loads).sum();
    assert!(loads >= 1, "the lagging node's entries came from storage");
    assert_eq!(c.node(lagging).storage.snapshot.index, 0);
    for id in [1, 2, 3] {
        assert!(c.node(id).faults.is_empty(), "{:?}", c.node(id).faults);
        assert!(c.raft(id).log().settled_entry_count() <= ENTRIES_MAX);
        assert_eq!(
            c.node(id).applied[..last as usize],
            c.node(leader).applied[..last as usize]
        );
    }
}

#[test]
fn a_restored_tail_must_cover_what_is_applied_again() {
    let config = Configuration::with_voters([1, 2, 3]);
    let entries: Vec<Entry> = (1..=10)
        .map(|index| Entry {
            index,
            term: if index < 5 { 1 } else { 2 },
            payload: if index == 3 {
                EntryPayload::Config(config.clone())
            } else {
                EntryPayload::Command(Bytes::from(format!("c{index}")))
            },
        })
        .collect();
    let restored = |applied, from: u64| RestoredState {
        hard_state: HardState {
            term: 2,
            vote: None,
            commit: 10,
        },
        snapshot: SnapshotMeta {
            config: config.clone(),
            ..SnapshotMeta::default()
        },
        entries: entries[(from - 1) as usize..].to_vec(),
        outline: Some(LogOutline::of(&entries)),
        applied,
    };
    // Bodies from 7 on, applied 6: starts with the whole log known.
    let mut node = RaftNode::new(test_options(1), restored(6, 7), 1).unwrap();
    assert_eq!(node.term_at(4), Some(1));
    assert_eq!(node.term_at(5), Some(2));
    assert!(node.entry(4).is_none());
    let mut actions = Vec::new();
    node.step(Input::Tick, &mut actions);
    let applied: Vec<u64> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Apply(entries) => Some(entries.iter().map(|e| e.index).collect::<Vec<_>>()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(applied, vec![7, 8, 9, 10]);
    // Bodies from 8 with applied 6: entry 7 would have to be applied.
    assert!(RaftNode::new(test_options(1), restored(6, 8), 1).is_err());
    // An outline that disagrees with the bodies is refused.
    let mut bad = restored(6, 7);
    if let Some(outline) = &mut bad.outline {
        outline.term_runs[1].0 = 8;
    }
    assert!(RaftNode::new(test_options(1), bad, 1).is_err());
}
