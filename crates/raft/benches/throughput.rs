//! Committed proposals per second for a 3-node group in one process:
//! in-memory storage that syncs at once, messages delivered by function
//! call. Each round proposes `batch` commands at the leader in one
//! `step_batch` and delivers everything until the round is committed and
//! applied on the leader. With batch 1 every proposal pays for its own
//! persist and append round trip; with batch 64 they share them. The time
//! per element is the CPU time per committed proposal (one thread does all
//! the work of all three nodes).

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferry_raft::{
    Action, Input, Message, Options, RaftNode, Request, RequestId, RestoredState, Role,
};

struct Group {
    nodes: Vec<RaftNode>,
    network: VecDeque<Message>,
    local: VecDeque<(usize, Input)>,
    leader: usize,
    applied_on_leader: u64,
    next_request: u64,
    actions: Vec<Action>,
}

impl Group {
    fn new() -> Self {
        let nodes = (1..=3u64)
            .map(|id| {
                let mut options = Options::new(id, 1);
                options.compaction_lag_entries = 1000;
                RaftNode::new(options, RestoredState::bootstrap([1, 2, 3]), id).expect("node")
            })
            .collect();
        let mut group = Group {
            nodes,
            network: VecDeque::new(),
            local: VecDeque::new(),
            leader: 0,
            applied_on_leader: 0,
            next_request: 1,
            actions: Vec::new(),
        };
        // Elect a leader by ticking.
        for _ in 0..1000 {
            for i in 0..3 {
                group.step(i, Input::Tick);
            }
            group.settle();
            if let Some(leader) = group.nodes.iter().position(|n| n.role() == Role::Leader) {
                group.leader = leader;
                return group;
            }
        }
        panic!("no leader elected");
    }

    fn step(&mut self, i: usize, input: Input) {
        let mut actions = std::mem::take(&mut self.actions);
        self.nodes[i].step(input, &mut actions);
        self.carry_out(i, &mut actions);
        self.actions = actions;
    }

    fn carry_out(&mut self, i: usize, actions: &mut Vec<Action>) {
        for action in actions.drain(..) {
            match action {
                Action::Persist(p) => self.local.push_back((i, Input::Persisted { seq: p.seq })),
                Action::Send(m) => self.network.push_back(m),
                Action::Apply(entries) => {
                    if i == self.leader {
                        self.applied_on_leader += entries.len() as u64;
                    }
                    black_box(entries);
                }
                Action::Respond { result, .. } => {
                    let _ = black_box(result);
                }
                // No follower lags in this benchmark: nothing is loaded.
                Action::LoadSnapshotChunk { .. }
                | Action::LoadEntries { .. }
                | Action::SaveSnapshotChunk { .. }
                | Action::Compact { .. }
                | Action::RoleChanged { .. }
                | Action::Removed
                | Action::Fault(_) => {}
            }
        }
    }

    fn settle(&mut self) {
        loop {
            if let Some((i, input)) = self.local.pop_front() {
                self.step(i, input);
            } else if let Some(m) = self.network.pop_front() {
                let to = (m.to - 1) as usize;
                self.step(to, Input::Message(m));
            } else {
                break;
            }
        }
    }

    /// Proposes `batch` commands in one step and runs until they are applied on the leader.
    fn round(&mut self, batch: usize, payload: &Bytes) {
        let target = self.applied_on_leader + batch as u64;
        let inputs: Vec<Input> = (0..batch)
            .map(|_| {
                self.next_request += 1;
                Input::Client {
                    id: RequestId(self.next_request),
                    request: Request::Propose(payload.clone()),
                }
            })
            .collect();
        let mut actions = std::mem::take(&mut self.actions);
        self.nodes[self.leader].step_batch(inputs, &mut actions);
        self.carry_out(self.leader, &mut actions);
        self.actions = actions;
        self.settle();
        assert!(self.applied_on_leader >= target, "round did not commit");
        // Keep memory bounded: snapshot every so often (compaction keeps a lag).
        if self.next_request % 8192 < batch as u64 {
            for i in 0..3 {
                let index = self.nodes[i].applied_index();
                self.step(i, Input::SnapshotBuilt { index });
            }
        }
    }
}

fn throughput(c: &mut Criterion) {
    let payload = Bytes::from(vec![7u8; 128]);
    let mut group = c.benchmark_group("committed_proposals");
    for batch in [1usize, 64] {
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_with_input(BenchmarkId::new("batch", batch), &batch, |b, &batch| {
            let mut g = Group::new();
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    g.round(batch, &payload);
                }
                start.elapsed().max(Duration::from_nanos(1))
            });
        });
    }
    group.finish();
}

criterion_group!(benches, throughput);
criterion_main!(benches);
