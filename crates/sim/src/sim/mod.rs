//! The simulation: N nodes of the real engine, each with a simulated disk,
//! a register state machine and a drifting clock, over a simulated network,
//! driven by one seed through one event queue in simulated microseconds.
//!
//! A run has a main phase (workload, faults, membership changes) and a
//! liveness phase (every fault off, everyone reconnected, restarted and
//! resumed), after which the cluster must have converged within a bounded
//! number of election timeouts. Safety is checked after every step.

mod clients;
mod disk;
mod faults;
mod liveness;
mod membership;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::fmt::Write as _;

use bytes::Bytes;
use ferry_raft::{
    Action, AppendResult, Entry, EntryPayload, Index, Input, MembershipChange, Message,
    MessageBody, NodeId, RaftNode, ReadConsistency, Request, RequestError, RequestId, Response,
    Role, SnapshotMeta, SnapshotOutcome, Term,
};

use crate::checks::{Failure, FailureKind, SafetyChecker};
use crate::config::{QuiesceMode, Sabotage, SimConfig, TICK_US};
use crate::coverage::{Counter, Coverage};
use crate::history::{History, OpKind, Operation, Outcome};
use crate::net::{DropReason, Network, Partition, SendOutcome};
use crate::real_storage::RealStorage;
use crate::rng::SimRng;
use crate::state_machine::{Command, CommandResult, RegisterMachine};
use crate::storage::{DiskModel, DurableState};

/// The group id every simulated node belongs to.
pub const GROUP: u64 = 1;
/// The most inputs a paused node's inbox holds, like a socket buffer;
/// messages beyond it are dropped (completions are always kept: they are
/// bounded by in-flight I/O).
pub const INBOX_MAX: usize = 256;
/// The most attempts a client makes at one operation after definite refusals.
pub const CLIENT_ATTEMPTS_MAX: u32 = 12;
/// Client ids from here up belong to requests a scenario submits itself.
pub const SCENARIO_CLIENT_BASE: u64 = 1 << 40;

/// What a scenario's message hook does to one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interference {
    /// Nothing: the network decides.
    None,
    /// Drop it.
    Drop,
    /// Deliver it normally and once more after this extra delay.
    DuplicateLate(u64),
    /// Deliver it after this extra delay.
    Delay(u64),
}

/// A scenario's message hook: (now, message) -> what to do.
pub type MessageHook = Box<dyn FnMut(u64, &Message) -> Interference>;

#[derive(Debug)]
enum Event {
    Tick {
        node: NodeId,
        incarnation: u64,
    },
    Deliver(Message),
    SyncDone {
        node: NodeId,
        incarnation: u64,
        seq: u64,
    },
    FalsePersisted {
        node: NodeId,
        incarnation: u64,
        seq: u64,
    },
    ChunkLoaded {
        node: NodeId,
        incarnation: u64,
        to: NodeId,
        snapshot_index: Index,
        offset: u64,
        max_bytes: u64,
    },
    ChunkSaved {
        node: NodeId,
        incarnation: u64,
        meta: SnapshotMeta,
        offset: u64,
        done: bool,
        ok: bool,
    },
    LocalSnapshot {
        node: NodeId,
        incarnation: u64,
        meta: SnapshotMeta,
        data: Bytes,
    },
    PeerReady {
        node: NodeId,
        incarnation: u64,
        peer: NodeId,
    },
    NextFault,
    HealPartition {
        generation: u64,
    },
    Restart {
        node: NodeId,
    },
    Resume {
        node: NodeId,
    },
    Unclog {
        from: NodeId,
        to: NodeId,
    },
    ClientWake {
        slot: usize,
    },
    ClientRetry {
        slot: usize,
        uid: u64,
        target: Option<NodeId>,
    },
    ClientDeadline {
        slot: usize,
        uid: u64,
    },
    NextMembership,
    RepairStep,
    LivenessStart,
    LivenessCheck,
}

struct Scheduled {
    at_us: u64,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at_us, self.seq) == (other.at_us, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Earliest first in a max-heap; ties broken by scheduling order.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at_us, other.seq).cmp(&(self.at_us, self.seq))
    }
}

/// The runtime of one simulated node.
struct SimNode {
    id: NodeId,
    /// Whether the node exists yet (spares start when added).
    started: bool,
    engine: Option<RaftNode>,
    incarnation: u64,
    disk: DiskModel,
    machine: RegisterMachine,
    paused: bool,
    inbox: VecDeque<Input>,
    tick_period_us: u64,
    removed: bool,
    next_request_id: u64,
    last_commit: Index,
    last_applied: Index,
    last_role: Option<(Role, Term)>,
    snapshot_in_progress: bool,
    /// The real storage on a simulated disk, in real-storage runs.
    real: Option<RealStorage>,
    /// The node's state before it ever wrote anything.
    initial: DurableState,
    /// Its storage was found corrupt: it must never run on it again.
    disk_lost: bool,
    /// A sector was damaged since the storage last opened.
    corrupted_since_open: bool,
    /// What the node had synced and what it had written when it stopped,
    /// to check what the real storage brings back.
    restart_check: Option<crate::real_storage::Acknowledged>,
    /// A snapshot being saved on the real storage, not yet reported done.
    snapshot_attempt: Option<(SnapshotMeta, Bytes)>,
}

impl SimNode {
    fn running(&self) -> bool {
        self.engine.is_some()
    }
}

#[derive(Clone, Copy, Debug)]
enum Awaiting {
    Response {
        node: NodeId,
        request: RequestId,
    },
    Apply {
        node: NodeId,
        index: Index,
        term: Term,
    },
    Backoff,
}

#[derive(Clone, Copy, Debug)]
struct ClientOp {
    /// Unique over the run: events and request owners name the operation by
    /// it (op_seq restarts when a retired client's slot gets a new client).
    uid: u64,
    op_seq: u64,
    key: u64,
    kind: OpKind,
    /// A read asked of the leader's lease rather than by ReadIndex.
    lease_read: bool,
    invoked_at: u64,
    attempts: u32,
    awaiting: Awaiting,
}

#[derive(Clone, Debug)]
struct ClientSlot {
    client_id: u64,
    next_op_seq: u64,
    op: Option<ClientOp>,
}

#[derive(Clone, Copy, Debug)]
enum Owner {
    Client { slot: usize, uid: u64 },
    Admin,
    Probe(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Main,
    Liveness { deadline_us: u64 },
    Done,
}

/// What one seed did and whether it passed.
#[derive(Clone, Debug)]
pub struct SeedReport {
    /// The seed.
    pub seed: u64,
    /// The founding voters.
    pub voters: usize,
    /// Why it failed, if it did.
    pub failure: Option<Failure>,
    /// What it exercised.
    pub coverage: Coverage,
    /// The client history.
    pub history: History,
    /// The simulated time the run ended at.
    pub end_us: u64,
    /// The trace, when recorded.
    pub trace: Option<String>,
    /// How long the cluster took to converge once the faults stopped.
    pub converged_after_us: Option<u64>,
    /// The run's least election timeout, for scale.
    pub election_timeout_us: u64,
    /// Whether the run had quiescence on.
    pub quiesce: bool,
    /// Quiesce notices the leaders sent (how often a group went quiet).
    pub quiesce_notices: u64,
    /// Wake-ups the followers sent to quiescent (or awake) leaders.
    pub wake_ups: u64,
}

/// One simulated cluster.
pub struct Simulation {
    config: SimConfig,
    rng: SimRng,
    now_us: u64,
    queue: BinaryHeap<Scheduled>,
    next_event_seq: u64,
    nodes: BTreeMap<NodeId, SimNode>,
    all_ids: Vec<NodeId>,
    net: Network,
    partition_generation: u64,
    checker: SafetyChecker,
    coverage: Coverage,
    history: History,
    clients: Vec<ClientSlot>,
    next_client_id: u64,
    next_value: u64,
    next_op_uid: u64,
    /// The last value a client saw in each register (CAS uses it so that
    /// some swaps succeed).
    last_values: BTreeMap<u64, u64>,
    owners: BTreeMap<(NodeId, RequestId), Owner>,
    probe_responses: BTreeMap<u64, Result<Response, RequestError>>,
    next_probe: u64,
    ever_added: Vec<NodeId>,
    transfer_target: Option<(NodeId, u64)>,
    failure: Option<Failure>,
    trace: Option<String>,
    phase: Phase,
    hook: Option<MessageHook>,
    local_snapshots: bool,
    liveness_started_us: u64,
    converged_after_us: Option<u64>,
    repair: Option<disk::Repair>,
    /// Faults the engines reported, when a scenario made a node faulty on
    /// purpose (see `restore_stale_disk`); otherwise any fault fails the run.
    faults_seen: Option<Vec<(NodeId, ferry_raft::Fault)>>,
    /// Quiesce notices and wake-ups sent (counted, not coverage counters,
    /// so that a run with quiescence off reports exactly what it did before).
    quiesce_notices: u64,
    wake_ups: u64,
}

fn retryable(error: &RequestError) -> bool {
    match error {
        RequestError::NotLeader { .. }
        | RequestError::NoLeader
        | RequestError::Busy { .. }
        | RequestError::Removed
        | RequestError::Halted { .. }
        | RequestError::LeadershipLost
        | RequestError::TransferInProgress => true,
        RequestError::Timeout
        | RequestError::MembershipChangePending
        | RequestError::InvalidMembershipChange { .. }
        | RequestError::LearnerNotCaughtUp { .. }
        | RequestError::LeaseReadsDisabled
        | RequestError::CannotCampaign { .. } => false,
    }
}

/// A short readable form of a message body for the trace.
pub fn describe_body(body: &MessageBody) -> String {
    match body {
        MessageBody::RequestVote {
            pre_vote,
            last_log_index,
            last_log_term,
            transfer,
        } => format!(
            "{} last=({last_log_index},{last_log_term}){}",
            if *pre_vote { "PreVote" } else { "RequestVote" },
            if *transfer { " transfer" } else { "" }
        ),
        MessageBody::RequestVoteResponse {
            pre_vote,
            granted,
            commit,
            commit_term,
        } => format!(
            "{}Response granted={granted} commit=({commit},{commit_term})",
            if *pre_vote { "PreVote" } else { "RequestVote" }
        ),
        MessageBody::Append {
            prev_log_index,
            prev_log_term,
            entries,
            leader_commit,
        } => format!(
            "Append prev=({prev_log_index},{prev_log_term}) entries={} commit={leader_commit}",
            entries.len()
        ),
        MessageBody::AppendResponse(AppendResult::Success { match_index }) => {
            format!("AppendOk match={match_index}")
        }
        MessageBody::AppendResponse(AppendResult::Reject {
            rejected_index,
            hint_index,
            hint_term,
        }) => format!("AppendReject at={rejected_index} hint=({hint_index},{hint_term})"),
        MessageBody::Heartbeat {
            leader_commit,
            read_seq,
        } => {
            format!("Heartbeat commit={leader_commit} read_seq={read_seq}")
        }
        MessageBody::HeartbeatResponse {
            read_seq,
            last_index,
            needs_append,
        } => {
            let needs = if *needs_append { " needs-append" } else { "" };
            format!("HeartbeatResponse read_seq={read_seq} last={last_index}{needs}")
        }
        MessageBody::SnapshotChunk {
            meta,
            offset,
            data,
            done,
        } => format!(
            "SnapshotChunk snap=({},{}) offset={offset} len={} done={done}",
            meta.index,
            meta.term,
            data.len()
        ),
        MessageBody::SnapshotChunkAck {
            snapshot_index,
            next_offset,
        } => format!("SnapshotChunkAck snap={snapshot_index} next={next_offset}"),
        MessageBody::SnapshotResponse {
            snapshot_index,
            outcome,
        } => format!("SnapshotResponse snap={snapshot_index} {outcome:?}"),
        MessageBody::TimeoutNow => "TimeoutNow".to_string(),
        MessageBody::Forward { id, request } => format!("Forward id={} {request:?}", id.0),
        MessageBody::ForwardResponse { id, result } => {
            format!("ForwardResponse id={} {result:?}", id.0)
        }
        MessageBody::Quiesce {
            last_index,
            last_term,
            commit,
        } => format!("Quiesce last=({last_index},{last_term}) commit={commit}"),
        MessageBody::WakeUp => "WakeUp".to_string(),
    }
}

fn op_label(kind: OpKind) -> String {
    match kind {
        OpKind::Read => "read".to_string(),
        OpKind::Write(v) => format!("write {v}"),
        OpKind::Cas { from, to } => format!("cas {from}->{to}"),
    }
}

impl Simulation {
    /// A cluster built from `config`: the founding voters running, the
    /// spares not started, nothing scheduled but the nodes' clocks and,
    /// for random runs, the workload, faults and the liveness phase.
    pub fn new(config: SimConfig) -> Self {
        let mut rng = SimRng::new(config.seed);
        let all_ids = config.all_ids();
        let voters = config.voter_ids();
        let mut nodes = BTreeMap::new();
        for &id in &all_ids {
            let founding = voters.contains(&id);
            let initial = if founding {
                let restored = ferry_raft::RestoredState::bootstrap(voters.iter().copied());
                DurableState {
                    snapshot: restored.snapshot,
                    ..DurableState::default()
                }
            } else {
                DurableState::default()
            };
            let tick_period_us = Self::drifted_period(&mut rng, config.faults.drift_percent_max);
            let real = config.disk.real.then(|| {
                RealStorage::new(
                    GROUP,
                    disk::disk_seed(config.seed, id),
                    config.disk.sync_ticks_min,
                    config.disk.sync_ticks_max,
                )
            });
            nodes.insert(
                id,
                SimNode {
                    id,
                    started: false,
                    engine: None,
                    incarnation: 0,
                    disk: DiskModel::new(initial.clone()),
                    machine: RegisterMachine::default(),
                    paused: false,
                    inbox: VecDeque::new(),
                    tick_period_us,
                    removed: false,
                    next_request_id: 1,
                    last_commit: 0,
                    last_applied: 0,
                    last_role: None,
                    snapshot_in_progress: false,
                    real,
                    initial,
                    disk_lost: false,
                    corrupted_since_open: false,
                    restart_check: None,
                    snapshot_attempt: None,
                },
            );
        }
        let net = Network::new(config.net.clone());
        let clients = (0..config.clients)
            .map(|i| ClientSlot {
                client_id: i as u64 + 1,
                next_op_seq: 1,
                op: None,
            })
            .collect();
        let mut sim = Simulation {
            trace: config.trace.then(String::new),
            next_client_id: config.clients as u64 + 1,
            config,
            rng,
            now_us: 0,
            queue: BinaryHeap::new(),
            next_event_seq: 0,
            nodes,
            all_ids,
            net,
            partition_generation: 0,
            checker: SafetyChecker::default(),
            coverage: Coverage::default(),
            history: History::default(),
            clients,
            next_value: 1,
            next_op_uid: 1,
            last_values: BTreeMap::new(),
            owners: BTreeMap::new(),
            probe_responses: BTreeMap::new(),
            next_probe: 1,
            ever_added: Vec::new(),
            transfer_target: None,
            failure: None,
            phase: Phase::Main,
            hook: None,
            local_snapshots: true,
            liveness_started_us: 0,
            converged_after_us: None,
            repair: None,
            faults_seen: None,
            quiesce_notices: 0,
            wake_ups: 0,
        };
        if sim.config.disk.real {
            sim.coverage.hit(Counter::RealStorageRun);
        }
        for id in voters {
            sim.start_node(id);
        }
        for slot in 0..sim.clients.len() {
            let delay = sim.rng.range(0, 20 * TICK_US);
            sim.schedule(delay, Event::ClientWake { slot });
        }
        if sim.config.faults.enabled {
            let delay = sim.rng.range(0, 2 * sim.config.faults.mean_interval_us);
            sim.schedule(delay, Event::NextFault);
        }
        if sim.config.faults.membership {
            let delay = sim
                .rng
                .range(0, 2 * sim.config.faults.membership_interval_us);
            sim.schedule(delay, Event::NextMembership);
        }
        sim
    }

    fn drifted_period(rng: &mut SimRng, drift_percent_max: u64) -> u64 {
        if drift_percent_max == 0 {
            return TICK_US;
        }
        let drift = rng.range_inclusive(0, drift_percent_max);
        if rng.chance_percent(50) {
            TICK_US * (100 + drift) / 100
        } else {
            TICK_US * (100 - drift.min(50)) / 100
        }
    }

    // ----- public surface for runs and scenarios -----

    /// Runs the whole seed: main phase, liveness phase, final checks.
    pub fn run(mut self) -> SeedReport {
        self.run_phases();
        self.into_report()
    }

    fn run_phases(&mut self) {
        let main_end = self.config.main_phase_us;
        self.schedule_at(main_end, Event::LivenessStart);
        self.run_until(u64::MAX);
        if self.failure.is_none() && self.phase != Phase::Done {
            self.fail(
                FailureKind::Liveness,
                "the event queue ran dry before the cluster converged".into(),
            );
        }
        if self.failure.is_none() {
            if let Err(detail) = check_linearizable(&self.history) {
                self.fail(FailureKind::Linearizability, detail);
            }
        }
    }

    /// The report of the run so far.
    pub fn into_report(self) -> SeedReport {
        SeedReport {
            seed: self.config.seed,
            voters: self.config.voters,
            failure: self.failure,
            coverage: self.coverage,
            history: self.history,
            end_us: self.now_us,
            trace: self.trace,
            converged_after_us: self.converged_after_us,
            election_timeout_us: u64::from(self.config.engine.election_timeout_ticks) * TICK_US,
            quiesce: self.config.engine.quiesce,
            quiesce_notices: self.quiesce_notices,
            wake_ups: self.wake_ups,
        }
    }

    /// Processes events up to and including simulated time `until_us`, or
    /// until the run fails or finishes.
    pub fn run_until(&mut self, until_us: u64) {
        while self.failure.is_none() && self.phase != Phase::Done {
            match self.queue.peek() {
                Some(next) if next.at_us <= until_us => {}
                _ => break,
            }
            let Some(scheduled) = self.queue.pop() else {
                break;
            };
            self.now_us = scheduled.at_us;
            self.handle(scheduled.event);
        }
        if self.failure.is_none() && self.phase != Phase::Done && until_us != u64::MAX {
            self.now_us = self.now_us.max(until_us);
        }
    }

    /// Stops the faults and runs the liveness phase to its end. Returns
    /// whether the cluster converged (on failure, see [`Simulation::failure`]).
    pub fn run_liveness(&mut self) -> bool {
        self.schedule(0, Event::LivenessStart);
        self.run_until(u64::MAX);
        self.failure.is_none() && self.phase == Phase::Done
    }

    /// The current simulated time.
    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    /// The run's configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// The engine of a running node.
    pub fn engine(&self, id: NodeId) -> Option<&RaftNode> {
        self.nodes.get(&id).and_then(|n| n.engine.as_ref())
    }

    /// The state machine of a node.
    pub fn machine(&self, id: NodeId) -> Option<&RegisterMachine> {
        self.nodes.get(&id).map(|n| &n.machine)
    }

    /// The running leader with the highest term.
    pub fn leader(&self) -> Option<NodeId> {
        self.nodes
            .values()
            .filter_map(|n| n.engine.as_ref())
            .filter(|e| e.role() == Role::Leader)
            .max_by_key(|e| e.term())
            .map(|e| e.id())
    }

    /// The first failure, if any.
    pub fn failure(&self) -> Option<&Failure> {
        self.failure.as_ref()
    }

    /// What the run exercised so far.
    pub fn coverage(&self) -> &Coverage {
        &self.coverage
    }

    /// Counts a scenario-observed event.
    pub fn note(&mut self, counter: Counter) {
        self.coverage.hit(counter);
    }

    /// The client history so far.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// The trace so far, when recording.
    pub fn trace_text(&self) -> Option<&str> {
        self.trace.as_deref()
    }

    /// Records a scenario failure.
    pub fn fail_scenario(&mut self, detail: String) {
        self.fail(FailureKind::Scenario, detail);
    }

    /// Installs a hook that sees every message sent and may interfere.
    pub fn set_message_hook(&mut self, hook: MessageHook) {
        self.hook = Some(hook);
    }

    /// Turns the state machines' snapshots on or off (scenarios use it to
    /// keep the leader's log whole for a while).
    pub fn set_local_snapshots(&mut self, on: bool) {
        self.local_snapshots = on;
    }

    /// Removes the message hook.
    pub fn clear_message_hook(&mut self) {
        self.hook = None;
    }

    /// Installs a partition now.
    pub fn partition(&mut self, partition: Partition) {
        self.apply_partition(partition);
    }

    /// Sets the connection-setup window (messages sent on a link while it
    /// sets up are lost) to exactly `window_us`.
    pub fn set_connect_window_us(&mut self, window_us: u64) {
        self.config.connect_window_min_us = window_us;
        self.config.connect_window_max_us = window_us;
    }

    /// Starts a spare node with an empty disk (before adding it as a learner).
    pub fn start_spare(&mut self, id: NodeId) {
        if !self.ever_added.contains(&id) {
            self.ever_added.push(id);
        }
        self.start_node(id);
    }

    /// Runs in steps of `step_us` until `done` holds or `max_us` has passed.
    /// Returns whether `done` held.
    pub fn run_until_true(
        &mut self,
        max_us: u64,
        step_us: u64,
        done: impl Fn(&Simulation) -> bool,
    ) -> bool {
        let end = self.now_us.saturating_add(max_us);
        loop {
            if done(self) {
                return true;
            }
            if self.now_us >= end || self.failure.is_some() || self.phase == Phase::Done {
                return false;
            }
            let next = (self.now_us + step_us.max(1)).min(end);
            self.run_until(next);
        }
    }

    /// Submits a request to `node` as a scenario; returns a tag to look the
    /// answer up with [`Simulation::probe_response`].
    pub fn submit(&mut self, node: NodeId, request: Request) -> u64 {
        let tag = self.next_probe;
        self.next_probe += 1;
        self.send_request(node, request, Owner::Probe(tag));
        tag
    }

    /// The answer to a scenario request, once it came.
    pub fn probe_response(&self, tag: u64) -> Option<&Result<Response, RequestError>> {
        self.probe_responses.get(&tag)
    }

    /// A command a scenario can propose (client ids of scenarios do not
    /// collide with the workload's).
    pub fn scenario_write(&mut self, key: u64, value: u64) -> Bytes {
        let client = SCENARIO_CLIENT_BASE + self.next_probe;
        Command::Write {
            client,
            op_seq: 1,
            key,
            value,
        }
        .encode()
    }

    // ----- scheduling -----

    fn schedule(&mut self, delay_us: u64, event: Event) {
        let at = self.now_us.saturating_add(delay_us);
        self.schedule_at(at, event);
    }

    fn schedule_at(&mut self, at_us: u64, event: Event) {
        let seq = self.next_event_seq;
        self.next_event_seq += 1;
        self.queue.push(Scheduled { at_us, seq, event });
    }

    fn fail(&mut self, kind: FailureKind, detail: String) {
        if self.failure.is_none() {
            self.log(None, &format!("FAILURE {kind}: {detail}"));
            self.failure = Some(Failure {
                kind,
                at_us: self.now_us,
                detail,
            });
        }
    }

    fn log(&mut self, node: Option<NodeId>, text: &str) {
        if let Some(trace) = &mut self.trace {
            let who = node.map_or_else(|| "--".to_string(), |n| format!("n{n}"));
            let _ = writeln!(trace, "{:>10}us {who} {text}", self.now_us);
        }
    }

    // ----- nodes -----

    fn node_seed(&self, id: NodeId, incarnation: u64) -> u64 {
        self.config
            .seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(id.wrapping_mul(0x1000_0001))
            .wrapping_add(incarnation.wrapping_mul(0x51_7cc1_b727_220a))
    }

    /// Starts (or restarts) a node from what its disk holds.
    fn start_node(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get(&id) else {
            return;
        };
        if node.running() {
            return;
        }
        if node.disk_lost {
            return;
        }
        let incarnation = node.incarnation + 1;
        let seed = self.node_seed(id, incarnation);
        if !self.open_real_storage(id) {
            return;
        }
        let Some(node) = self.nodes.get(&id) else {
            return;
        };
        let synced = node.disk.synced().clone();
        let restored = synced.restored_state();
        let machine = if synced.snapshot.index == 0 {
            Ok(RegisterMachine::new(synced.snapshot.config.clone()))
        } else {
            RegisterMachine::from_snapshot(
                &synced.snapshot_data,
                synced.snapshot.index,
                synced.snapshot.term,
                synced.snapshot.config.clone(),
            )
        };
        let machine = match machine {
            Ok(m) => m,
            Err(e) => {
                self.fail(
                    FailureKind::Durability,
                    format!("node {id}: durable snapshot unreadable: {e}"),
                );
                return;
            }
        };
        let options = self.config.engine.options(id, GROUP);
        let engine = match RaftNode::new(options, restored, seed) {
            Ok(engine) => engine,
            Err(e) => {
                self.fail(
                    FailureKind::Contract,
                    format!("node {id} could not restart from its synced state: {e}"),
                );
                return;
            }
        };
        let commit = engine.commit_index();
        let applied = engine.applied_index();
        let period = match self.nodes.get_mut(&id) {
            Some(node) => {
                node.started = true;
                node.incarnation = incarnation;
                node.engine = Some(engine);
                node.machine = machine;
                node.paused = false;
                node.inbox.clear();
                node.last_commit = commit;
                node.last_applied = applied;
                node.last_role = None;
                node.snapshot_in_progress = false;
                node.tick_period_us
            }
            None => return,
        };
        self.log(
            Some(id),
            &format!("start incarnation={incarnation} commit={commit} applied={applied}"),
        );
        let first_tick = self.rng.range(1, period + 1);
        self.schedule(
            first_tick,
            Event::Tick {
                node: id,
                incarnation,
            },
        );
        // The transport connects to every reachable running peer.
        let peers: Vec<NodeId> = self.all_ids.iter().copied().filter(|&p| p != id).collect();
        for peer in peers {
            if self.is_running(peer) && self.net.connected(id, peer) {
                self.connect_pair(id, peer);
            }
        }
    }

    fn is_running(&self, id: NodeId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.running())
    }

    fn incarnation(&self, id: NodeId) -> u64 {
        self.nodes.get(&id).map_or(0, |n| n.incarnation)
    }

    /// The link between a and b comes up: it takes a setup window, during
    /// which what is sent is lost, and then both sides are told.
    fn connect_pair(&mut self, a: NodeId, b: NodeId) {
        let window = self.rng.range_inclusive(
            self.config.connect_window_min_us,
            self.config
                .connect_window_max_us
                .max(self.config.connect_window_min_us),
        );
        self.net.start_setup(a, b, self.now_us + window);
        let (ia, ib) = (self.incarnation(a), self.incarnation(b));
        self.schedule(
            window,
            Event::PeerReady {
                node: a,
                incarnation: ia,
                peer: b,
            },
        );
        self.schedule(
            window,
            Event::PeerReady {
                node: b,
                incarnation: ib,
                peer: a,
            },
        );
    }

    /// Hands an input to a node: at once if it runs, into its inbox if it
    /// is paused, nowhere if it is down.
    fn feed(&mut self, id: NodeId, input: Input) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if !node.running() {
            return;
        }
        if node.paused {
            if node.inbox.len() >= INBOX_MAX && matches!(input, Input::Message(_)) {
                self.coverage.hit(Counter::InboxOverflow);
                return;
            }
            node.inbox.push_back(input);
            return;
        }
        self.step(id, input);
    }

    fn step(&mut self, id: NodeId, input: Input) {
        if self.failure.is_some() {
            return;
        }
        if let Input::Message(message) = &input {
            if self.trace.is_some() {
                let text = format!(
                    "recv n{}->n{} t{} {}",
                    message.from,
                    message.to,
                    message.term,
                    describe_body(&message.body)
                );
                self.log(Some(id), &text);
            }
        }
        if let Input::Client { .. } = &input {
            if self.engine(id).is_some_and(|e| e.is_receiving_snapshot()) {
                self.coverage.hit(Counter::RequestWhileReceivingSnapshot);
            }
        }
        let mut actions = Vec::new();
        match self.nodes.get_mut(&id).and_then(|n| n.engine.as_mut()) {
            Some(engine) => engine.step(input, &mut actions),
            None => return,
        }
        let incarnation = self.incarnation(id);
        for action in actions {
            // A storage failure stops the node in the middle of its actions.
            if self.failure.is_some() || self.incarnation(id) != incarnation || !self.is_running(id)
            {
                return;
            }
            self.carry_out(id, action);
        }
        self.check_node(id);
    }

    fn check_node(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get(&id) else {
            return;
        };
        let Some(engine) = node.engine.as_ref() else {
            return;
        };
        let (role, term, commit, applied) = (
            engine.role(),
            engine.term(),
            engine.commit_index(),
            engine.applied_index(),
        );
        let mut problem = None;
        if role == Role::Leader {
            if let Err(v) = self.checker.observe_leader(term, id) {
                problem = Some((FailureKind::Safety, v));
            }
        }
        if commit < node.last_commit {
            problem = Some((
                FailureKind::Safety,
                format!(
                    "node {id}: commit index went back from {} to {commit}",
                    node.last_commit
                ),
            ));
        }
        if applied < node.last_applied {
            problem = Some((
                FailureKind::Safety,
                format!(
                    "node {id}: applied index went back from {} to {applied}",
                    node.last_applied
                ),
            ));
        }
        if problem.is_none() && commit > node.last_commit {
            for index in node.last_commit + 1..=commit {
                if let Some(entry) = engine.entry(index) {
                    if let Err(v) = self.checker.observe_committed(id, term, entry) {
                        problem = Some((FailureKind::Safety, v));
                        break;
                    }
                }
            }
        }
        if let Some((kind, detail)) = problem {
            self.fail(kind, detail);
            return;
        }
        if let Some(node) = self.nodes.get_mut(&id) {
            node.last_commit = commit;
            node.last_applied = applied;
        }
    }

    // ----- actions -----

    fn carry_out(&mut self, id: NodeId, action: Action) {
        match action {
            Action::Persist(request) => {
                let seq = request.seq;
                if let Some(entries) = (!request.entries.is_empty()).then_some(&request.entries) {
                    if let Err(v) = self.checker.observe_entries(id, None, entries) {
                        self.fail(FailureKind::Safety, v);
                        return;
                    }
                }
                if let Some(real) = self.nodes.get_mut(&id).and_then(|n| n.real.as_mut()) {
                    if let Err(e) = real.append(&request) {
                        self.storage_failed(id, e);
                        return;
                    }
                }
                let result = match self.nodes.get_mut(&id) {
                    Some(node) => node.disk.write(request),
                    None => return,
                };
                if let Err(v) = result {
                    self.fail(FailureKind::Durability, format!("node {id}: {v}"));
                    return;
                }
                if self.config.sabotage == Sabotage::PersistedBeforeSync {
                    let incarnation = self.incarnation(id);
                    self.schedule(
                        0,
                        Event::FalsePersisted {
                            node: id,
                            incarnation,
                            seq,
                        },
                    );
                }
                self.maybe_start_sync(id);
            }
            Action::Send(message) => self.send_message(id, message),
            Action::Apply(entries) => self.apply_entries(id, entries),
            Action::Respond {
                id: request,
                result,
            } => self.on_response(id, request, result),
            Action::LoadSnapshotChunk {
                to,
                snapshot_index,
                offset,
                max_bytes,
            } => {
                let delay = self.rng.range(20, 300);
                let incarnation = self.incarnation(id);
                self.schedule(
                    delay,
                    Event::ChunkLoaded {
                        node: id,
                        incarnation,
                        to,
                        snapshot_index,
                        offset,
                        max_bytes,
                    },
                );
            }
            Action::SaveSnapshotChunk {
                meta,
                offset,
                data,
                done,
            } => {
                let ok = match self.nodes.get_mut(&id) {
                    Some(node) => node.disk.save_chunk(&meta, offset, &data),
                    None => return,
                };
                let ok = ok && self.real_save_chunk(id, &meta, offset, &data);
                if !self.is_running(id) {
                    return;
                }
                let delay = self.rng.range(20, 500);
                let incarnation = self.incarnation(id);
                self.schedule(
                    delay,
                    Event::ChunkSaved {
                        node: id,
                        incarnation,
                        meta,
                        offset,
                        done,
                        ok,
                    },
                );
            }
            Action::Compact { through } => {
                let Some(node) = self.nodes.get_mut(&id) else {
                    return;
                };
                let snapshot_index = node.disk.synced().snapshot.index;
                if through > snapshot_index {
                    self.fail(
                        FailureKind::Contract,
                        format!("node {id}: compact through {through} but the durable snapshot is at {snapshot_index}"),
                    );
                    return;
                }
                node.disk.compact(through);
                if let Some(real) = node.real.as_mut() {
                    if let Err(e) = real.compact(through) {
                        self.storage_failed(id, e);
                    }
                }
            }
            Action::RoleChanged { role, term, leader } => {
                self.on_role_changed(id, role, term, leader)
            }
            Action::Removed => {
                self.log(Some(id), "removed from the group");
                self.coverage.hit(Counter::NodeRemoved);
                if let Some(node) = self.nodes.get_mut(&id) {
                    node.removed = true;
                }
            }
            Action::Fault(fault) => {
                if let ferry_raft::Fault::FollowerLogWentBack { certain: false, .. } = fault {
                    // A late duplicate of an old rejection looks the same;
                    // the network here duplicates and delays messages.
                    self.log(Some(id), &format!("possible fault: {fault}"));
                    if let Some(seen) = self.faults_seen.as_mut() {
                        seen.push((id, fault));
                    }
                    return;
                }
                if self.faults_seen.is_some() {
                    self.log(Some(id), &format!("fault detected: {fault}"));
                    if let Some(seen) = self.faults_seen.as_mut() {
                        seen.push((id, fault));
                    }
                    return;
                }
                // No node here is faulty or hostile: any detected fault means
                // the engine, the storage or this runtime broke an assumption.
                self.fail(
                    FailureKind::Safety,
                    format!("node {id} reported a fault: {fault}"),
                );
            }
        }
    }

    fn on_role_changed(&mut self, id: NodeId, role: Role, term: Term, leader: Option<NodeId>) {
        self.log(
            Some(id),
            &format!("role {role:?} term={term} leader={leader:?}"),
        );
        let previous = self
            .nodes
            .get_mut(&id)
            .and_then(|n| n.last_role.replace((role, term)));
        if role != Role::Leader || previous == Some((Role::Leader, term)) {
            return;
        }
        if let Err(v) = self.checker.observe_leader(term, id) {
            self.fail(FailureKind::Safety, v);
            return;
        }
        let Some(engine) = self.engine(id) else {
            return;
        };
        if let Err(v) = self.checker.check_leader_completeness(engine) {
            self.fail(FailureKind::Safety, v);
            return;
        }
        let membership_in_progress = engine.config().is_joint()
            || (engine.commit_index() + 1..=engine.last_index()).any(|i| {
                matches!(
                    engine.entry(i).map(|e| &e.payload),
                    Some(EntryPayload::Config(_))
                )
            });
        self.coverage.hit(Counter::LeaderElected);
        if membership_in_progress {
            self.coverage
                .hit(Counter::LeaderChangedDuringMembershipChange);
        }
        if let Some((target, deadline)) = self.transfer_target {
            if target == id && self.now_us <= deadline {
                self.coverage.hit(Counter::LeadershipTransferred);
                self.transfer_target = None;
            }
        }
    }

    fn maybe_start_sync(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let incarnation = node.incarnation;
        if let Some(seq) = node.disk.start_sync() {
            let delay = match node.real.as_mut().map(RealStorage::start_sync) {
                None => {
                    let (low, high) = self.config.sync_delay_us;
                    self.rng.range_inclusive(low, high)
                }
                Some(Ok(Some(disk_us))) => {
                    if disk_us >= 2 * TICK_US {
                        self.coverage.hit(Counter::SlowSync);
                    }
                    20 + disk_us
                }
                Some(Ok(None)) => {
                    self.fail(
                        FailureKind::Contract,
                        format!("node {id}: the model has writes to sync (through seq {seq}) but the real log has none"),
                    );
                    return;
                }
                Some(Err(e)) => {
                    self.storage_failed(id, e);
                    return;
                }
            };
            self.schedule(
                delay,
                Event::SyncDone {
                    node: id,
                    incarnation,
                    seq,
                },
            );
        }
    }

    /// Principle 6: an append is acknowledged and a vote granted or asked
    /// for only once the state behind it is synced.
    fn check_durable_before_send(&mut self, id: NodeId, message: &Message) -> Result<(), String> {
        let Some(node) = self.nodes.get(&id) else {
            return Ok(());
        };
        let synced = node.disk.synced();
        match &message.body {
            // Only the leader of the response's term counts it; an answer to
            // a stale leader is ignored there and proves nothing.
            MessageBody::AppendResponse(AppendResult::Success { match_index })
                if self.checker.leader_of(message.term) == Some(message.to)
                    && synced.last_index() < *match_index =>
            {
                return Err(format!(
                    "node {id} acknowledged index {match_index} to {}, the leader of term {}, but has synced only up to {} (its own term is {})",
                    message.to,
                    message.term,
                    synced.last_index(),
                    node.engine.as_ref().map_or(0, |e| e.term())
                ));
            }
            MessageBody::RequestVoteResponse {
                pre_vote: false,
                granted: true,
                ..
            } => {
                let synced_vote = synced.votes.get(&message.term).copied();
                if synced_vote != Some(message.to) {
                    return Err(format!(
                        "node {id} granted its vote to {} in term {} before syncing it (synced vote in that term: {synced_vote:?})",
                        message.to, message.term
                    ));
                }
            }
            MessageBody::RequestVote {
                pre_vote: false, ..
            } => {
                let synced_vote = synced.votes.get(&message.term).copied();
                if synced_vote != Some(id) {
                    return Err(format!(
                        "node {id} asked for votes in term {} before syncing its own vote (synced vote in that term: {synced_vote:?})",
                        message.term
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn send_message(&mut self, id: NodeId, message: Message) {
        if message.from != id {
            self.fail(
                FailureKind::Contract,
                format!(
                    "node {id} sent a message claiming to be from {}",
                    message.from
                ),
            );
            return;
        }
        if let Err(detail) = self.check_durable_before_send(id, &message) {
            self.fail(FailureKind::Durability, detail);
            return;
        }
        match &message.body {
            MessageBody::Append {
                prev_log_index,
                prev_log_term,
                entries,
                ..
            } => {
                if let Err(v) = self.checker.observe_entries(
                    id,
                    Some((*prev_log_index, *prev_log_term)),
                    entries,
                ) {
                    self.fail(FailureKind::Safety, v);
                    return;
                }
            }
            MessageBody::AppendResponse(AppendResult::Reject { hint_term: 0, .. }) => {
                self.coverage.hit(Counter::RejectHintTermZero);
            }
            MessageBody::SnapshotResponse { outcome, .. } => match outcome {
                SnapshotOutcome::Stale { .. } => self.coverage.hit(Counter::StaleSnapshot),
                SnapshotOutcome::Rejected => self.coverage.hit(Counter::SnapshotRejected),
                SnapshotOutcome::Installed { .. } => {}
            },
            MessageBody::Quiesce { .. } => self.quiesce_notices += 1,
            MessageBody::WakeUp => self.wake_ups += 1,
            _ => {}
        }
        let interference = match &mut self.hook {
            Some(hook) => hook(self.now_us, &message),
            None => Interference::None,
        };
        match interference {
            Interference::Drop => {
                self.log(
                    Some(id),
                    &format!(
                        "hook drops n{}->n{} {}",
                        id,
                        message.to,
                        describe_body(&message.body)
                    ),
                );
                return;
            }
            Interference::DuplicateLate(extra) => {
                let delay = self.net.delay_us(&mut self.rng) + extra;
                self.schedule(delay, Event::Deliver(message.clone()));
            }
            Interference::Delay(extra) => {
                let delay = self.net.delay_us(&mut self.rng) + extra;
                self.schedule(delay, Event::Deliver(message));
                return;
            }
            Interference::None => {}
        }
        match self.net.send(self.now_us, &message, &mut self.rng) {
            SendOutcome::Deliver(delays) => {
                if delays.len() > 1 {
                    self.coverage.hit(Counter::MessageDuplicated);
                }
                for delay in delays {
                    self.schedule(delay, Event::Deliver(message.clone()));
                }
            }
            SendOutcome::Held => {}
            SendOutcome::Dropped(reason) => match reason {
                DropReason::Loss | DropReason::ClogOverflow => {
                    self.coverage.hit(Counter::MessageDropped)
                }
                DropReason::ConnectWindow => self.coverage.hit(Counter::ConnectWindowLoss),
                DropReason::Partition => {}
            },
        }
    }

    fn apply_entries(&mut self, id: NodeId, entries: Vec<Entry>) {
        let (commit, node_term) = self
            .engine(id)
            .map_or((0, 0), |e| (e.commit_index(), e.term()));
        for entry in &entries {
            if entry.index > commit {
                self.fail(
                    FailureKind::Safety,
                    format!(
                        "node {id} applies entry {} beyond its commit index {commit}",
                        entry.index
                    ),
                );
                return;
            }
            if let Err(v) = self.checker.observe_applied(id, node_term, entry) {
                self.fail(FailureKind::Safety, v);
                return;
            }
            // A proposal answered at exactly this (index, term) must be this command.
            for slot in 0..self.clients.len() {
                let client_id = self.clients[slot].client_id;
                if let Some(op) = self.clients[slot].op {
                    if let Awaiting::Apply { node, index, term } = op.awaiting {
                        if node == id && index == entry.index {
                            if term == entry.term {
                                let ours = match &entry.payload {
                                    EntryPayload::Command(bytes) => Command::decode(bytes)
                                        .is_ok_and(|c| {
                                            c.client() == client_id && c.op_seq() == op.op_seq
                                        }),
                                    EntryPayload::Noop | EntryPayload::Config(_) => false,
                                };
                                if !ours {
                                    self.fail(
                                        FailureKind::Safety,
                                        format!(
                                            "node {id}: proposal of client {client_id} was answered at ({index}, {term}) but that entry holds {:?}",
                                            entry.payload
                                        ),
                                    );
                                    return;
                                }
                            } else {
                                self.coverage.hit(Counter::ProposalLost);
                            }
                        }
                    }
                }
            }
            let Some(node) = self.nodes.get_mut(&id) else {
                return;
            };
            if let EntryPayload::Command(bytes) = &entry.payload {
                if let Ok(command) = Command::decode(bytes) {
                    if let Some(session) = node.machine.session(command.client()) {
                        if session.op_seq >= command.op_seq() {
                            let detail = format!(
                                "node {id} applies operation {} of client {} a second time, at index {}: one client request became two log entries (a duplicated forward, or an attempt refused as 'no effect' that took effect)",
                                command.op_seq(),
                                command.client(),
                                entry.index
                            );
                            self.fail(FailureKind::Contract, detail);
                            return;
                        }
                    }
                }
            }
            let before = node.machine.config().clone();
            match node.machine.apply(entry) {
                Ok(Some((_, CommandResult::CompareFailed))) => {
                    self.coverage.hit(Counter::CasCompareFailed)
                }
                Ok(_) => {}
                Err(e) => {
                    self.fail(FailureKind::Contract, format!("node {id}: {e}"));
                    return;
                }
            }
            if let EntryPayload::Config(after) = &entry.payload {
                if after.is_joint() {
                    self.coverage.hit(Counter::JointConfig);
                }
                if after.learners.iter().any(|l| !before.learners.contains(l)) {
                    self.coverage.hit(Counter::LearnerAdded);
                }
                if after.voters.iter().any(|v| before.learners.contains(v)) {
                    self.coverage.hit(Counter::LearnerPromoted);
                }
                if before
                    .members()
                    .iter()
                    .any(|m| before.is_voter(*m) && !after.is_voter(*m))
                {
                    self.coverage.hit(Counter::VoterRemoved);
                }
            }
        }
        self.resolve_applied(id, false);
        self.maybe_take_snapshot(id);
    }

    fn maybe_take_snapshot(&mut self, id: NodeId) {
        let every = self.config.snapshot_every_entries.max(1);
        if !self.local_snapshots {
            return;
        }
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if node.snapshot_in_progress
            || node.machine.applied() < node.disk.synced().snapshot.index.saturating_add(every)
        {
            return;
        }
        node.snapshot_in_progress = true;
        let meta = SnapshotMeta {
            index: node.machine.applied(),
            term: node.machine.applied_term(),
            config: node.machine.config().clone(),
        };
        let data = node.machine.encode_snapshot();
        let incarnation = node.incarnation;
        let delay = self.rng.range(100, 2_000);
        self.schedule(
            delay,
            Event::LocalSnapshot {
                node: id,
                incarnation,
                meta,
                data,
            },
        );
    }

    // ----- events -----

    fn handle(&mut self, event: Event) {
        match event {
            Event::Tick { node, incarnation } => {
                if self.incarnation(node) != incarnation || !self.is_running(node) {
                    return;
                }
                let (paused, period) = match self.nodes.get(&node) {
                    Some(n) => (n.paused, n.tick_period_us),
                    None => return,
                };
                if !paused {
                    self.step(node, Input::Tick);
                }
                self.schedule(period, Event::Tick { node, incarnation });
            }
            Event::Deliver(message) => {
                if self
                    .net
                    .partition()
                    .blocked
                    .contains(&(message.from, message.to))
                {
                    return;
                }
                let to = message.to;
                self.feed(to, Input::Message(message));
            }
            Event::FalsePersisted {
                node,
                incarnation,
                seq,
            } => {
                if self.incarnation(node) == incarnation {
                    self.feed(node, Input::Persisted { seq });
                }
            }
            Event::SyncDone {
                node,
                incarnation,
                seq,
            } => {
                if self.incarnation(node) != incarnation || !self.is_running(node) {
                    return;
                }
                if !self.real_complete_sync(node, seq) {
                    return;
                }
                let (result, report) = match self.nodes.get_mut(&node) {
                    Some(n) => {
                        let result = n.disk.complete_sync(seq);
                        (result, n.disk.take_persisted_report())
                    }
                    None => return,
                };
                if let Err(v) = result {
                    self.fail(FailureKind::Durability, format!("node {node}: {v}"));
                    return;
                }
                if let Some(seq) = report {
                    self.feed(node, Input::Persisted { seq });
                }
                self.maybe_start_sync(node);
            }
            Event::ChunkLoaded {
                node,
                incarnation,
                to,
                snapshot_index,
                offset,
                max_bytes,
            } => {
                if self.incarnation(node) != incarnation {
                    return;
                }
                let chunk = self
                    .nodes
                    .get(&node)
                    .and_then(|n| n.disk.load_chunk(snapshot_index, offset, max_bytes));
                let Some(chunk) =
                    self.real_load_chunk(node, snapshot_index, offset, max_bytes, chunk)
                else {
                    return;
                };
                if chunk.is_none() {
                    self.coverage.hit(Counter::SnapshotChunkGone);
                }
                self.feed(
                    node,
                    Input::SnapshotChunkLoaded {
                        to,
                        snapshot_index,
                        offset,
                        chunk,
                    },
                );
            }
            Event::ChunkSaved {
                node,
                incarnation,
                meta,
                offset,
                done,
                ok,
            } => {
                if self.incarnation(node) != incarnation {
                    return;
                }
                let ok = if ok && done {
                    self.install_snapshot(node, &meta)
                } else {
                    ok
                };
                if self.failure.is_some() {
                    return;
                }
                self.feed(
                    node,
                    Input::SnapshotChunkSaved {
                        snapshot_index: meta.index,
                        offset,
                        ok,
                    },
                );
            }
            Event::LocalSnapshot {
                node,
                incarnation,
                meta,
                data,
            } => {
                if self.incarnation(node) != incarnation {
                    return;
                }
                let index = meta.index;
                if !self.real_save_local_snapshot(node, &meta, &data) {
                    return;
                }
                let stored = match self.nodes.get_mut(&node) {
                    Some(n) => {
                        n.snapshot_in_progress = false;
                        n.disk.store_local_snapshot(meta, data)
                    }
                    None => return,
                };
                if stored {
                    self.coverage.hit(Counter::LocalSnapshotTaken);
                    self.feed(node, Input::SnapshotBuilt { index });
                }
            }
            Event::PeerReady {
                node,
                incarnation,
                peer,
            } => {
                if self.incarnation(node) != incarnation
                    || !self.is_running(peer)
                    || !self.net.connected(node, peer)
                {
                    return;
                }
                if !self.config.peer_connected_events {
                    self.log(
                        Some(node),
                        &format!("link to n{peer} ready (not reported to the engine)"),
                    );
                    return;
                }
                self.log(Some(node), &format!("link to n{peer} ready"));
                self.feed(node, Input::PeerConnected(peer));
            }
            Event::NextFault => self.next_fault(),
            Event::HealPartition { generation } => {
                if generation == self.partition_generation {
                    self.apply_partition(Partition::default());
                }
            }
            Event::Restart { node } => {
                if !self.is_running(node) {
                    self.coverage.hit(Counter::CrashRestart);
                    self.start_node(node);
                }
            }
            Event::Resume { node } => self.resume(node),
            Event::Unclog { from, to } => self.unclog(from, to),
            Event::ClientWake { slot } => self.client_start_op(slot),
            Event::ClientRetry { slot, uid, target } => {
                let current = self.clients.get(slot).and_then(|c| c.op);
                if current
                    .is_some_and(|op| op.uid == uid && matches!(op.awaiting, Awaiting::Backoff))
                {
                    self.client_attempt(slot, target);
                }
            }
            Event::ClientDeadline { slot, uid } => self.client_deadline(slot, uid),
            Event::NextMembership => self.next_membership(),
            Event::RepairStep => self.repair_step(),
            Event::LivenessStart => self.start_liveness(),
            Event::LivenessCheck => self.liveness_check(),
        }
    }

    fn install_snapshot(&mut self, id: NodeId, meta: &SnapshotMeta) -> bool {
        let Some(node) = self.nodes.get_mut(&id) else {
            return false;
        };
        let Some(incoming) = node.disk.take_incoming() else {
            return false;
        };
        if incoming.meta != *meta {
            return false;
        }
        let data = incoming.data.freeze();
        let machine =
            match RegisterMachine::from_snapshot(&data, meta.index, meta.term, meta.config.clone())
            {
                Ok(m) => m,
                Err(_) => return false,
            };
        if meta.index <= node.machine.applied() {
            let applied = node.machine.applied();
            self.fail(
                FailureKind::Contract,
                format!(
                    "node {id} was asked to install snapshot at {} but has applied {applied}: installing would roll back its state machine",
                    meta.index
                ),
            );
            return false;
        }
        if let Some(real) = node.real.as_mut() {
            node.snapshot_attempt = Some((meta.clone(), data.clone()));
            if let Err(e) = real.install_incoming(meta) {
                self.storage_failed(id, e);
                return false;
            }
            node.snapshot_attempt = None;
        }
        let Some(node) = self.nodes.get_mut(&id) else {
            return false;
        };
        if let Err(v) = node.disk.install_snapshot(meta.clone(), data) {
            self.fail(FailureKind::Durability, format!("node {id}: {v}"));
            return false;
        }
        node.machine = machine;
        let report = node.disk.take_persisted_report();
        self.log(
            Some(id),
            &format!("installed snapshot ({}, {})", meta.index, meta.term),
        );
        self.coverage.hit(Counter::SnapshotInstalled);
        if let Some(seq) = report {
            self.feed(id, Input::Persisted { seq });
        }
        self.resolve_applied(id, true);
        true
    }
}

/// Checks the history for linearizability with the lincheck module. A
/// search that hits its bound is not a pass: it fails the seed too.
pub fn check_linearizable(history: &History) -> Result<(), String> {
    match crate::lincheck::check(history) {
        crate::lincheck::Verdict::Linearizable => Ok(()),
        other => Err(other.to_string()),
    }
}

/// Runs one seed with random parameters, catching panics.
pub fn run_seed(seed: u64, voters: Option<usize>, trace: bool) -> SeedReport {
    run_seed_with(seed, voters, trace, QuiesceMode::Off)
}

/// Runs one seed with random parameters and quiescence set by `quiesce`.
pub fn run_seed_with(
    seed: u64,
    voters: Option<usize>,
    trace: bool,
    quiesce: QuiesceMode,
) -> SeedReport {
    let mut config = SimConfig::random(seed, voters);
    config.apply_quiesce(quiesce);
    config.trace = trace;
    run_config(config)
}

thread_local! {
    static LAST_PANIC: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Records a panic's message and location for the report of the seed that
/// panicked on this thread (called from a panic hook).
pub fn record_panic(text: String) {
    LAST_PANIC.with(|slot| *slot.borrow_mut() = Some(text));
}

fn take_recorded_panic() -> Option<String> {
    LAST_PANIC.with(|slot| slot.borrow_mut().take())
}

/// Runs one configured simulation, catching panics (reported as failures,
/// with the trace up to the panic).
pub fn run_config(config: SimConfig) -> SeedReport {
    let seed = config.seed;
    let voters = config.voters;
    let mut slot: Option<Simulation> = None;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let sim = slot.insert(Simulation::new(config));
        sim.run_phases();
    }));
    match (result, slot) {
        (Ok(()), Some(sim)) => sim.into_report(),
        (outcome, sim) => {
            let detail = match outcome {
                Err(_) if LAST_PANIC.with(|slot| slot.borrow().is_some()) => {
                    take_recorded_panic().unwrap_or_default()
                }
                Err(payload) => payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic with a non-string payload".to_string()),
                Ok(()) => "the simulation vanished".to_string(),
            };
            let mut report = match sim {
                Some(sim) => sim.into_report(),
                None => SeedReport {
                    seed,
                    voters,
                    failure: None,
                    coverage: Coverage::default(),
                    history: History::default(),
                    end_us: 0,
                    trace: None,
                    converged_after_us: None,
                    election_timeout_us: 0,
                    quiesce: false,
                    quiesce_notices: 0,
                    wake_ups: 0,
                },
            };
            if let Some(trace) = &mut report.trace {
                let _ = writeln!(trace, "PANIC: {detail}");
            }
            report.failure = Some(Failure {
                kind: FailureKind::Panic,
                at_us: report.end_us,
                detail,
            });
            report
        }
    }
}
