//! What an idle group costs per tick, with and without quiescence. A
//! three-node group elects a leader, commits one write and goes idle; then
//! one node is ticked alone (its peers' answers are not delivered, so that
//! the measurement is the tick itself: its timers, and the messages it
//! builds). Four cases: the leader and a follower, each awake (quiescence
//! off: a heartbeat round every tick on the leader, an election timer on
//! the follower) and quiescent. Then the whole group per tick, awake and
//! quiescent: every node ticked and every message delivered and answered,
//! which is what an idle group really costs a host (before the transport's
//! own cost per message, which the quiescent group does not pay either).
//!
//! Before the criterion runs, a counted loop ticks each quiescent node a
//! million times and prints the time taken and the actions produced
//! (which must be none); `cargo bench -p ferry-raft --bench quiescent_ticks`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use ferry_raft::testing::{test_options, Cluster};
use ferry_raft::{Action, Input, NodeId, RaftNode, Request};

const TICKS_COUNTED: u64 = 1_000_000;

/// An idle three-node group; with `quiesce`, every node has gone quiet.
/// Returns the group and its leader.
fn idle_group(quiesce: bool) -> (Cluster, NodeId) {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut options = test_options(id);
        options.quiesce = quiesce;
        // Timers far apart, so that an awake follower ticked alone for a
        // whole sample does not campaign: its tick is the timer's upkeep.
        options.election_timeout_ticks = u32::MAX / 4;
        options.request_timeout_ticks = 50;
        options
    });
    // The timers are too slow to elect anyone: ask node 1 to campaign.
    let leader = 1;
    c.request(leader, Request::Campaign);
    c.deliver_all();
    assert_eq!(c.leader(), Some(leader));
    c.propose(leader, "w");
    c.deliver_all();
    for _ in 0..10 {
        c.tick_all();
    }
    if quiesce {
        assert!(
            c.nodes.values().all(|n| n.raft.is_quiescent()),
            "the idle group did not go quiet"
        );
    }
    (c, leader)
}

/// Takes node `id` out of the group to tick it alone.
fn node(c: &mut Cluster, id: NodeId) -> RaftNode {
    let test_node = c.nodes.remove(&id).expect("node");
    test_node.raft
}

fn cases() -> Vec<(&'static str, RaftNode)> {
    let mut out = Vec::new();
    for quiesce in [false, true] {
        let (mut c, leader) = idle_group(quiesce);
        let follower = [1, 2, 3].into_iter().find(|&n| n != leader).unwrap_or(2);
        let (leader_name, follower_name) = if quiesce {
            ("leader_quiescent", "follower_quiescent")
        } else {
            ("leader_awake", "follower_awake")
        };
        out.push((leader_name, node(&mut c, leader)));
        out.push((follower_name, node(&mut c, follower)));
    }
    out
}

/// A million ticks of each quiescent node, timed, with every action counted.
fn counted_loop() {
    for (name, mut raft) in cases() {
        if !raft.is_quiescent() {
            continue;
        }
        let mut actions: Vec<Action> = Vec::new();
        let mut produced = 0usize;
        let start = Instant::now();
        for _ in 0..TICKS_COUNTED {
            raft.step(Input::Tick, &mut actions);
            produced += actions.len();
            actions.clear();
        }
        let elapsed = start.elapsed();
        assert!(raft.is_quiescent());
        assert_eq!(produced, 0, "{name}: a quiescent tick produced actions");
        println!(
            "{name}: {TICKS_COUNTED} ticks in {:.3} ms ({:.2} ns per tick), {produced} actions",
            elapsed.as_secs_f64() * 1e3,
            elapsed.as_secs_f64() * 1e9 / TICKS_COUNTED as f64
        );
    }
}

fn ticks(c: &mut Criterion) {
    let mut group = c.benchmark_group("idle_tick");
    group.throughput(Throughput::Elements(1));
    for (name, mut raft) in cases() {
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            let mut actions: Vec<Action> = Vec::new();
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    raft.step(Input::Tick, &mut actions);
                    black_box(&actions);
                    actions.clear();
                }
                start.elapsed().max(Duration::from_nanos(1))
            });
        });
    }
    group.finish();
    // The whole group per tick: every node ticked, every message delivered
    // and answered (the harness's checks included, alike in both cases).
    let mut group = c.benchmark_group("idle_group_tick");
    group.throughput(Throughput::Elements(1));
    for quiesce in [false, true] {
        let (mut cluster, _) = idle_group(quiesce);
        let name = if quiesce { "quiescent" } else { "awake" };
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    cluster.tick_all();
                }
                start.elapsed().max(Duration::from_nanos(1))
            });
        });
    }
    group.finish();
}

criterion_group!(benches, ticks);

fn main() {
    counted_loop();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
