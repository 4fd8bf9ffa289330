//! Randomized runs through the test harness: message loss, duplication and
//! reordering, partitions, crashes with unsynced writes lost, snapshots and
//! membership changes. The harness checks state machine safety on every
//! apply; at the end, with faults off, every node must catch up and every
//! request must have been answered.

use ferry_raft::testing::Cluster;
use ferry_raft::{Input, MembershipChange, ReadConsistency, Request};
use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn run(seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Vary the settings across seeds.
    let mut c = Cluster::with_options(&[1, 2, 3, 4, 5], |id| {
        let mut o = ferry_raft::testing::test_options(id);
        o.pre_vote = seed % 2 == 0;
        o.check_quorum = seed % 3 != 1;
        o.lease_reads = o.check_quorum && seed % 5 < 3;
        o.inflight_messages_max = 1 + (seed % 4) as usize;
        o.append_bytes_max = 64 + 64 * (seed % 3);
        o.compaction_lag_entries = seed % 7;
        if seed % 2 == 1 {
            // A log that holds only a few settled entries in memory: the
            // leaders load the rest from storage for lagging followers.
            o.log_memory_entries_max = seed % 4;
            o.log_memory_bytes_max = 64 * (seed % 3);
        }
        o
    });
    c.auto_sync = false;
    let ids = [1u64, 2, 3, 4, 5];
    let mut requests = Vec::new();
    for step in 0..1500u64 {
        let roll = rng.next_u64() % 100;
        let node = ids[(rng.next_u64() % 5) as usize];
        match roll {
            0..=29 => {
                // deliver some messages, with faults
                for _ in 0..(rng.next_u64() % 8) {
                    if c.network.is_empty() {
                        break;
                    }
                    let i = (rng.next_u64() as usize) % c.network.len();
                    let m = c.network.remove(i).unwrap();
                    let fate = rng.next_u64() % 20;
                    if fate == 0 {
                        continue; // lost
                    }
                    if fate == 1 {
                        c.network.push_back(m.clone()); // duplicated
                    }
                    if c.nodes[&m.to].up {
                        c.step(m.to, Input::Message(m));
                    }
                }
            }
            30..=49 => c.step(node, Input::Tick),
            50..=64 => c.sync(node),
            65..=74 => {
                let id = c.request(node, Request::Propose(format!("s{seed}-{step}").into()));
                requests.push((node, id));
            }
            75..=79 => {
                let consistency = match rng.next_u64() % 3 {
                    0 => ReadConsistency::Linearizable,
                    1 => ReadConsistency::Lease,
                    _ => ReadConsistency::Local {
                        min_applied: Some(rng.next_u64() % 20),
                    },
                };
                let id = c.request(node, Request::Read(consistency));
                requests.push((node, id));
            }
            80..=82 => {
                if c.nodes[&node].applied_index > 0 {
                    c.snapshot(node);
                }
            }
            83..=84 => {
                if rng.next_u64() % 4 == 0 {
                    // A crash loses the requests waiting on that node (the
                    // runtime fails them with the connection).
                    requests.retain(|(n, id)| *n != node || c.response(*n, *id).is_some());
                    c.restart(node);
                    c.step(node, Input::Tick);
                }
            }
            85..=87 => {
                let other = ids[(rng.next_u64() % 5) as usize];
                if other != node {
                    c.partition(node, other);
                }
            }
            88..=90 => c.heal(),
            91 => {
                let target = ids[(rng.next_u64() % 5) as usize];
                let change = match rng.next_u64() % 4 {
                    0 => MembershipChange::Remove(target),
                    1 => MembershipChange::AddVoter(target),
                    2 => MembershipChange::PromoteLearner(target),
                    _ => MembershipChange::AddLearner(target),
                };
                let id = c.request(node, Request::ChangeMembership(change));
                requests.push((node, id));
            }
            92 => {
                let target = ids[(rng.next_u64() % 5) as usize];
                let id = c.request(node, Request::TransferLeadership(target));
                requests.push((node, id));
            }
            93..=94 => {
                c.step(
                    node,
                    Input::PeerConnected(ids[(rng.next_u64() % 5) as usize]),
                );
            }
            _ => {
                c.step(
                    node,
                    Input::PeerDisconnected(ids[(rng.next_u64() % 5) as usize]),
                );
            }
        }
    }
    // Faults off: heal, sync everything, run.
    c.heal();
    c.auto_sync = true;
    for id in ids {
        c.sync(id);
    }
    let caught_up = c.run_until(600, |c| {
        let Some(leader) = c.leader() else {
            return false;
        };
        let commit = c.raft(leader).commit_index();
        c.nodes.iter().all(|(&id, n)| {
            !c.raft(leader).config().contains(id)
                || n.raft.is_removed()
                || n.applied_index >= commit
        }) && c
            .nodes
            .values()
            .all(|n| n.raft.pending_request_count() == 0)
    });
    assert!(
        caught_up,
        "seed {seed}: the cluster did not converge; leader {:?}, status {:#?}",
        c.leader(),
        c.nodes
            .values()
            .map(|n| n.raft.status())
            .collect::<Vec<_>>()
    );
    // Every request was answered (pending work drained above and runtime
    // requests tracked here).
    for _ in 0..60 {
        c.tick_all();
    }
    let unanswered: Vec<_> = requests
        .iter()
        .filter(|(n, id)| c.response(*n, *id).is_none())
        .collect();
    assert!(
        unanswered.is_empty(),
        "seed {seed}: requests never answered: {unanswered:?}"
    );
}

#[test]
fn randomized_fault_runs_stay_safe_and_converge() {
    let seeds: u64 = std::env::var("FERRY_RAFT_CHAOS_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    for seed in 0..seeds {
        run(seed);
    }
}
