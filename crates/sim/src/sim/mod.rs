//! The simulation: N nodes of the real engine, each with a simulated disk,
//! a register state machine and a drifting clock, over a simulated network,
//! driven by one seed through one event queue in simulated microseconds.
//!
//! Each node hosts one or more Raft groups (`SimConfig::groups`): one engine
//! and one state machine per group, over one storage per node (one log with
//! group commit, a snapshot store per group) and one link per ordered pair
//! of nodes that carries every group's messages. A node's clock ticks every
//! group, a crash or a pause stops them all, and a connection event goes to
//! each of them.
//!
//! A run has a main phase (workload, faults, membership changes) and a
//! liveness phase (every fault off, slow messages and slow syncs too,
//! everyone reconnected, restarted and resumed), after which the cluster
//! must have converged within a bounded number of election timeouts.
//! Safety is checked after every step.

mod clients;
mod disk;
mod faults;
mod liveness;
mod membership;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::fmt::Write as _;

use bytes::Bytes;
use ferry_raft::{
    Action, AppendResult, Entry, EntryPayload, GroupId, Index, Input, MembershipChange, Message,
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
use crate::storage::{DurableState, GroupViolation, NodeDisk, SyncCoverage};

/// The first group's id: with one group per node (the default) the only
/// one, and the group the accessors without a group argument look at.
pub const GROUP: u64 = 1;
/// Salts the main seed into the stream the multi-group choices are drawn
/// from (which group an operation or a membership change goes to), so that
/// a run with one group draws exactly what it always drew.
const GROUP_STREAM_SALT: u64 = 0x6772_6f75_7073_0001;
/// The most inputs a paused node's inbox holds (all groups together), like
/// a socket buffer;
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
    /// A message, with the epoch of the connection it was sent on (see
    /// [`Simulation::connection_epoch`]).
    Deliver {
        message: Message,
        epoch: u64,
    },
    SyncDone {
        node: NodeId,
        incarnation: u64,
        /// The seq each group's writes reach in this sync.
        covered: SyncCoverage,
    },
    FalsePersisted {
        node: NodeId,
        group: GroupId,
        incarnation: u64,
        seq: u64,
    },
    ChunkLoaded {
        node: NodeId,
        group: GroupId,
        incarnation: u64,
        to: NodeId,
        snapshot_index: Index,
        offset: u64,
        max_bytes: u64,
    },
    EntriesLoaded {
        node: NodeId,
        group: GroupId,
        incarnation: u64,
        to: NodeId,
        term: Term,
        from: Index,
        through: Index,
        max_bytes: u64,
        /// The disk fails the read: answered `None`.
        failed: bool,
    },
    ChunkSaved {
        node: NodeId,
        group: GroupId,
        incarnation: u64,
        meta: SnapshotMeta,
        offset: u64,
        done: bool,
        ok: bool,
    },
    LocalSnapshot {
        node: NodeId,
        group: GroupId,
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

/// One group's replica on a simulated node: its engine, its state machine
/// and what the checks remember of it.
struct Replica {
    engine: Option<RaftNode>,
    machine: RegisterMachine,
    removed: bool,
    last_commit: Index,
    last_applied: Index,
    last_role: Option<(Role, Term)>,
    snapshot_in_progress: bool,
    /// The group's state on this node before it ever wrote anything.
    initial: DurableState,
    /// A snapshot being saved on the real storage, not yet reported done.
    snapshot_attempt: Option<(SnapshotMeta, Bytes)>,
}

impl Replica {
    fn new(initial: DurableState) -> Self {
        Replica {
            engine: None,
            machine: RegisterMachine::default(),
            removed: false,
            last_commit: 0,
            last_applied: 0,
            last_role: None,
            snapshot_in_progress: false,
            initial,
            snapshot_attempt: None,
        }
    }
}

/// The runtime of one simulated node: what its groups share (clock,
/// storage, process state, inbox) and a replica per group.
struct SimNode {
    id: NodeId,
    /// Whether the node exists yet (spares start when added).
    started: bool,
    incarnation: u64,
    /// The node's storage model: one log for all its groups.
    disk: NodeDisk,
    paused: bool,
    /// Inputs that arrived while paused, with the group each is for.
    inbox: VecDeque<(GroupId, Input)>,
    tick_period_us: u64,
    /// Request ids are unique per node, over all its groups.
    next_request_id: u64,
    /// The real storage on a simulated disk, in real-storage runs.
    real: Option<RealStorage>,
    /// Its storage was found corrupt: it must never run on it again.
    disk_lost: bool,
    /// A sector was damaged since the storage last opened.
    corrupted_since_open: bool,
    /// What each group had synced and written when the node stopped, to
    /// check what the real storage brings back.
    restart_check: Option<BTreeMap<GroupId, crate::real_storage::Acknowledged>>,
    /// One replica per hosted group, group g at index g - 1 (groups are
    /// 1..=N; a vector keeps the per-message lookups cheap).
    replicas: Vec<Replica>,
}

impl SimNode {
    fn running(&self) -> bool {
        self.replicas.iter().any(|r| r.engine.is_some())
    }

    fn replica(&self, group: GroupId) -> Option<&Replica> {
        self.replicas.get(group_index(group)?)
    }

    fn replica_mut(&mut self, group: GroupId) -> Option<&mut Replica> {
        self.replicas.get_mut(group_index(group)?)
    }

    fn engine(&self, group: GroupId) -> Option<&RaftNode> {
        self.replica(group).and_then(|r| r.engine.as_ref())
    }

    fn initial_states(&self) -> BTreeMap<GroupId, DurableState> {
        (1..)
            .zip(&self.replicas)
            .map(|(group, r)| (group, r.initial.clone()))
            .collect()
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
    /// The group the operation goes to (its registers are the group's own).
    group: GroupId,
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
    Admin { group: GroupId },
    Probe { tag: u64, group: GroupId },
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
    /// The groups each node hosted.
    pub groups: usize,
    /// The client history of each group, in group order (index 0: group 1).
    pub histories: Vec<History>,
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
    /// Quiesce notices the leaders sent (how often a group went quiet),
    /// summed over the groups.
    pub quiesce_notices: u64,
    /// Wake-ups the followers sent to quiescent (or awake) leaders, summed
    /// over the groups.
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
    /// Each pair of nodes' connection epoch (see
    /// [`Simulation::connection_epoch`]).
    connection_epochs: Vec<u64>,
    /// The connection epoch of each message a clogged link holds, in the
    /// link's order.
    held_epochs: BTreeMap<(NodeId, NodeId), Vec<u64>>,
    /// The Raft safety record of each group (group g at index g - 1).
    checkers: Vec<SafetyChecker>,
    coverage: Coverage,
    /// The client history of each group.
    histories: BTreeMap<GroupId, History>,
    /// Where the choices only several groups need are drawn from.
    group_rng: SimRng,
    clients: Vec<ClientSlot>,
    next_client_id: u64,
    next_value: u64,
    next_op_uid: u64,
    /// The last value a client saw in each register of each group (CAS
    /// uses it so that some swaps succeed).
    last_values: BTreeMap<(GroupId, u64), u64>,
    owners: BTreeMap<(NodeId, RequestId), Owner>,
    probe_responses: BTreeMap<u64, Result<Response, RequestError>>,
    next_probe: u64,
    /// The nodes ever added to (or started for) each group: a spare joins
    /// a group at most once.
    ever_added: BTreeSet<(GroupId, NodeId)>,
    /// A leadership transfer asked for: (group, target, deadline).
    transfer_target: Option<(GroupId, NodeId, u64)>,
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
    faults_seen: Option<Vec<(NodeId, GroupId, ferry_raft::Fault)>>,
    /// Messages handed to each (from, to, group)'s engine, for tests of the
    /// shared links.
    /// Indexed by [`Simulation::delivered_slot`]; counted on every
    /// delivery, so a flat vector rather than a map.
    delivered: Vec<u64>,
    /// Quiesce notices and wake-ups sent, every group's together (counted,
    /// not coverage counters, so that a run with quiescence off reports
    /// exactly what it did before).
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

/// A node (and, with several groups, its group) as failure details name
/// it: "node 3" or "node 3 (group 2)". Formatted only when a detail is.
#[derive(Clone, Copy, Debug)]
struct Who {
    id: NodeId,
    group: Option<GroupId>,
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.group {
            Some(group) => write!(f, "node {} (group {group})", self.id),
            None => write!(f, "node {}", self.id),
        }
    }
}

/// Where group `group` sits in the per-group vectors (groups are 1..=N).
fn group_index(group: GroupId) -> Option<usize> {
    usize::try_from(group).ok()?.checked_sub(1)
}

/// The engine seed of one group's replica on a node: the node's seed for
/// group 1 (as with one group), mixed with the group id for the others.
fn group_seed(node_seed: u64, group: GroupId) -> u64 {
    node_seed ^ group.saturating_sub(1).wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn op_label(kind: OpKind) -> String {
    match kind {
        OpKind::Read => "read".to_string(),
        OpKind::Write(v) => format!("write {v}"),
        OpKind::Cas { from, to } => format!("cas {from}->{to}"),
    }
}

impl SeedReport {
    /// The client operations of every group.
    pub fn operations(&self) -> usize {
        self.histories.iter().map(|h| h.operations.len()).sum()
    }

    /// The client history of group 1 (the only one with one group per node).
    pub fn history(&self) -> &History {
        static EMPTY: History = History {
            operations: Vec::new(),
        };
        self.histories.first().unwrap_or(&EMPTY)
    }
}

impl Simulation {
    /// A cluster built from `config`: the founding voters running, the
    /// spares not started, nothing scheduled but the nodes' clocks and,
    /// for random runs, the workload, faults and the liveness phase.
    pub fn new(config: SimConfig) -> Self {
        let mut rng = SimRng::new(config.seed);
        let group_rng = SimRng::new(config.seed ^ GROUP_STREAM_SALT);
        let all_ids = config.all_ids();
        let voters = config.voter_ids();
        let groups = config.group_ids();
        let mut nodes = BTreeMap::new();
        for &id in &all_ids {
            let founding = voters.contains(&id);
            // Every group is founded by the same voters.
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
                    disk::disk_seed(config.seed, id),
                    config.disk.sync_ticks_min,
                    config.disk.sync_ticks_max,
                )
            });
            let replicas: Vec<Replica> = groups
                .iter()
                .map(|_| Replica::new(initial.clone()))
                .collect();
            nodes.insert(
                id,
                SimNode {
                    id,
                    started: false,
                    incarnation: 0,
                    disk: NodeDisk::new(groups.iter().map(|&g| (g, initial.clone()))),
                    paused: false,
                    inbox: VecDeque::new(),
                    tick_period_us,
                    next_request_id: 1,
                    real,
                    disk_lost: false,
                    corrupted_since_open: false,
                    restart_check: None,
                    replicas,
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
            connection_epochs: Vec::new(),
            held_epochs: BTreeMap::new(),
            checkers: groups.iter().map(|_| SafetyChecker::default()).collect(),
            coverage: Coverage::default(),
            histories: groups.iter().map(|&g| (g, History::default())).collect(),
            group_rng,
            clients,
            next_value: 1,
            next_op_uid: 1,
            last_values: BTreeMap::new(),
            owners: BTreeMap::new(),
            probe_responses: BTreeMap::new(),
            next_probe: 1,
            ever_added: BTreeSet::new(),
            transfer_target: None,
            failure: None,
            phase: Phase::Main,
            hook: None,
            local_snapshots: true,
            liveness_started_us: 0,
            converged_after_us: None,
            repair: None,
            faults_seen: None,
            delivered: Vec::new(),
            quiesce_notices: 0,
            wake_ups: 0,
        };
        sim.delivered = vec![0; sim.all_ids.len().pow(2) * sim.config.groups.max(1)];
        sim.connection_epochs = vec![0; sim.all_ids.len().pow(2)];
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
        let groups: Vec<GroupId> = self.histories.keys().copied().collect();
        for group in groups {
            if self.failure.is_some() {
                break;
            }
            let verdict = match self.histories.get(&group) {
                Some(history) => check_linearizable(history),
                None => Ok(()),
            };
            if let Err(detail) = verdict {
                let detail = format!("{}{detail}", self.group_prefix(group));
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
            groups: self.config.groups,
            histories: self.histories.into_values().collect(),
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

    /// The groups every node hosts, in order.
    pub fn groups(&self) -> Vec<GroupId> {
        self.config.group_ids()
    }

    /// Group 1's engine on a running node.
    pub fn engine(&self, id: NodeId) -> Option<&RaftNode> {
        self.group_engine(id, GROUP)
    }

    /// A group's engine on a running node.
    pub fn group_engine(&self, id: NodeId, group: GroupId) -> Option<&RaftNode> {
        self.nodes.get(&id).and_then(|n| n.engine(group))
    }

    /// Group 1's state machine on a node.
    pub fn machine(&self, id: NodeId) -> Option<&RegisterMachine> {
        self.group_machine(id, GROUP)
    }

    /// A group's state machine on a node.
    pub fn group_machine(&self, id: NodeId, group: GroupId) -> Option<&RegisterMachine> {
        self.nodes
            .get(&id)
            .and_then(|n| n.replica(group))
            .map(|r| &r.machine)
    }

    /// Group 1's running leader with the highest term.
    pub fn leader(&self) -> Option<NodeId> {
        self.group_leader(GROUP)
    }

    /// A group's running leader with the highest term.
    pub fn group_leader(&self, group: GroupId) -> Option<NodeId> {
        self.nodes
            .values()
            .filter_map(|n| n.engine(group))
            .filter(|e| e.role() == Role::Leader)
            .max_by_key(|e| e.term())
            .map(|e| e.id())
    }

    /// How many messages of `group` sent by `from` were handed to `to`'s
    /// engine (or its paused inbox) so far.
    pub fn delivered_messages(&self, from: NodeId, to: NodeId, group: GroupId) -> u64 {
        self.delivered_slot(from, to, group)
            .and_then(|slot| self.delivered.get(slot))
            .copied()
            .unwrap_or(0)
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

    /// Group 1's client history so far.
    pub fn history(&self) -> &History {
        self.group_history(GROUP)
    }

    /// A group's client history so far.
    pub fn group_history(&self, group: GroupId) -> &History {
        static EMPTY: History = History {
            operations: Vec::new(),
        };
        self.histories.get(&group).unwrap_or(&EMPTY)
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

    /// Clogs the link from `from` to `to` now: it holds every message, of
    /// every group, until [`Simulation::unclog_link`].
    pub fn clog_link(&mut self, from: NodeId, to: NodeId) {
        self.net.clog(from, to);
        self.log(None, &format!("clog n{from}->n{to}"));
    }

    /// Releases a clogged link and what it held.
    pub fn unclog_link(&mut self, from: NodeId, to: NodeId) {
        self.unclog(from, to);
    }

    /// Sets the connection-setup window (messages sent on a link while it
    /// sets up are lost) to exactly `window_us`.
    pub fn set_connect_window_us(&mut self, window_us: u64) {
        self.config.connect_window_min_us = window_us;
        self.config.connect_window_max_us = window_us;
    }

    /// Starts a spare node with an empty disk (before adding it as a
    /// learner, to any of its groups).
    pub fn start_spare(&mut self, id: NodeId) {
        for group in self.config.group_ids() {
            self.ever_added.insert((group, id));
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

    /// Submits a request to group 1 on `node` as a scenario; returns a tag
    /// to look the answer up with [`Simulation::probe_response`].
    pub fn submit(&mut self, node: NodeId, request: Request) -> u64 {
        self.submit_to(node, GROUP, request)
    }

    /// Submits a request to `group` on `node` as a scenario; returns a tag
    /// to look the answer up with [`Simulation::probe_response`].
    pub fn submit_to(&mut self, node: NodeId, group: GroupId, request: Request) -> u64 {
        let tag = self.next_probe;
        self.next_probe += 1;
        self.send_request(node, group, request, Owner::Probe { tag, group });
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

    /// Logs an event of one group: with several groups per node the line
    /// names the group after the node (`n2 g3 ...`); with one it reads as
    /// it always did.
    fn log_group(&mut self, node: Option<NodeId>, group: GroupId, text: &str) {
        if self.trace.is_none() {
            return;
        }
        if self.config.groups > 1 {
            self.log(node, &format!("g{group} {text}"));
        } else {
            self.log(node, text);
        }
    }

    /// What a failure detail about one group starts with: its name when
    /// there are several groups, nothing otherwise.
    fn group_prefix(&self, group: GroupId) -> String {
        if self.config.groups > 1 {
            format!("group {group}: ")
        } else {
            String::new()
        }
    }

    /// "node 3" for a one-group run, "node 3 (group 2)" otherwise.
    fn who(&self, id: NodeId, group: GroupId) -> Who {
        Who {
            id,
            group: (self.config.groups > 1).then_some(group),
        }
    }

    fn checker(&mut self, group: GroupId) -> &mut SafetyChecker {
        let index = group_index(group).unwrap_or(0);
        if self.checkers.len() <= index {
            self.checkers.resize_with(index + 1, SafetyChecker::default);
        }
        &mut self.checkers[index]
    }

    /// Where the delivery count of (from, to, group) is kept, if the ids
    /// are the run's.
    fn delivered_slot(&self, from: NodeId, to: NodeId, group: GroupId) -> Option<usize> {
        let nodes = self.all_ids.len();
        let groups = self.config.groups.max(1);
        let (from, to, group) = (
            usize::try_from(from).ok()?.checked_sub(1)?,
            usize::try_from(to).ok()?.checked_sub(1)?,
            group_index(group)?,
        );
        (from < nodes && to < nodes && group < groups)
            .then_some((from * nodes + to) * groups + group)
    }

    fn connection_slot(&self, a: NodeId, b: NodeId) -> Option<usize> {
        let nodes = self.all_ids.len();
        let (low, high) = (a.min(b), a.max(b));
        let (low, high) = (
            usize::try_from(low).ok()?.checked_sub(1)?,
            usize::try_from(high).ok()?.checked_sub(1)?,
        );
        (high < nodes).then_some(low * nodes + high)
    }

    /// The epoch of the connection between `a` and `b`: it goes up each
    /// time the runtime reports the connection broken
    /// ([`Input::PeerDisconnected`], on a crash or a cut both ways). A
    /// message belongs to the connection it was sent on; a real transport
    /// delivers a connection's messages before it reports the connection
    /// gone, or loses them, never after (a message heard from a peer after
    /// that comes on a new connection, which is reported first).
    fn connection_epoch(&self, a: NodeId, b: NodeId) -> u64 {
        self.connection_slot(a, b)
            .and_then(|slot| self.connection_epochs.get(slot))
            .copied()
            .unwrap_or(0)
    }

    /// The runtime reports the connection between `a` and `b` broken: what
    /// is still in flight on it will not arrive.
    fn connection_broke(&mut self, a: NodeId, b: NodeId) {
        if let Some(epoch) = self
            .connection_slot(a, b)
            .and_then(|slot| self.connection_epochs.get_mut(slot))
        {
            *epoch += 1;
        }
    }

    /// Whether a message sent on connection epoch `epoch` from `from` to
    /// `to` is lost because that connection broke since. Only with
    /// quiescence on, where the engine relies on the order (a quiesce
    /// notice delivered after its leader was reported gone would silence
    /// the follower for good); with it off the engine only probes on the
    /// report, and a run stays draw for draw what it always was.
    fn sent_on_broken_connection(&self, from: NodeId, to: NodeId, epoch: u64) -> bool {
        self.config.engine.quiesce && epoch != self.connection_epoch(from, to)
    }

    /// Schedules the delivery of `message`, sent now, after `delay`.
    fn schedule_delivery(&mut self, delay: u64, message: Message) {
        let epoch = self.connection_epoch(message.from, message.to);
        self.schedule(delay, Event::Deliver { message, epoch });
    }

    /// The groups every node hosts (ids 1..=groups), without allocating:
    /// the clock and the connection events walk them on every tick.
    fn group_ids(&self) -> std::ops::RangeInclusive<GroupId> {
        1..=self.config.groups.max(1) as GroupId
    }

    fn storage_violation(&mut self, id: NodeId, (group, violation): GroupViolation) {
        let who = self.who(id, group);
        self.fail(FailureKind::Durability, format!("{who}: {violation}"));
    }

    // ----- nodes -----

    fn node_seed(&self, id: NodeId, incarnation: u64) -> u64 {
        self.config
            .seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(id.wrapping_mul(0x1000_0001))
            .wrapping_add(incarnation.wrapping_mul(0x51_7cc1_b727_220a))
    }

    /// Starts (or restarts) a node from what its disk holds: every group it
    /// hosts, each from its part of the storage.
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
        let mut started = Vec::new();
        for group in node.disk.group_ids() {
            let Some(synced) = node.disk.group(group).map(|d| d.synced().clone()) else {
                continue;
            };
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
                    let who = self.who(id, group);
                    self.fail(
                        FailureKind::Durability,
                        format!("{who}: durable snapshot unreadable: {e}"),
                    );
                    return;
                }
            };
            let options = self.config.engine.options(id, group);
            let engine = match RaftNode::new(options, restored, group_seed(seed, group)) {
                Ok(engine) => engine,
                Err(e) => {
                    let who = self.who(id, group);
                    self.fail(
                        FailureKind::Contract,
                        format!("{who} could not restart from its synced state: {e}"),
                    );
                    return;
                }
            };
            started.push((group, engine, machine));
        }
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        node.started = true;
        node.incarnation = incarnation;
        node.paused = false;
        node.inbox.clear();
        let period = node.tick_period_us;
        let mut logs = Vec::new();
        for (group, engine, machine) in started {
            let (commit, applied) = (engine.commit_index(), engine.applied_index());
            logs.push((group, commit, applied));
            if let Some(replica) = node.replica_mut(group) {
                replica.engine = Some(engine);
                replica.machine = machine;
                replica.last_commit = commit;
                replica.last_applied = applied;
                replica.last_role = None;
                replica.snapshot_in_progress = false;
            }
        }
        for (group, commit, applied) in logs {
            self.log_group(
                Some(id),
                group,
                &format!("start incarnation={incarnation} commit={commit} applied={applied}"),
            );
        }
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

    /// Hands an input to one group on a node: at once if it runs, into its
    /// inbox if it is paused, nowhere if it is down.
    fn feed(&mut self, id: NodeId, group: GroupId, input: Input) {
        let delivered_slot = match &input {
            Input::Message(message) => self.delivered_slot(message.from, id, group),
            _ => None,
        };
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if !node.running() || node.replica(group).is_none() {
            return;
        }
        if let Some(count) = delivered_slot.and_then(|slot| self.delivered.get_mut(slot)) {
            *count += 1;
        }
        if node.paused {
            if node.inbox.len() >= INBOX_MAX && matches!(input, Input::Message(_)) {
                self.coverage.hit(Counter::InboxOverflow);
                return;
            }
            node.inbox.push_back((group, input));
            return;
        }
        self.step(id, group, input);
    }

    /// Hands an input to every group on a node (a connection event: the
    /// link is the node's, shared by all its groups).
    fn feed_all(&mut self, id: NodeId, input: Input) {
        for group in self.group_ids() {
            self.feed(id, group, input.clone());
        }
    }

    fn step(&mut self, id: NodeId, group: GroupId, input: Input) {
        self.step_inputs(id, group, vec![input]);
    }

    /// Steps several inputs of one group together, as the runtime's worker
    /// does with what arrived in one turn ([`ferry_raft::RaftNode::step_batch`]).
    pub(super) fn step_inputs(&mut self, id: NodeId, group: GroupId, inputs: Vec<Input>) {
        if self.failure.is_some() || inputs.is_empty() {
            return;
        }
        for input in &inputs {
            self.note_input(id, group, input);
        }
        let mut actions = Vec::new();
        match self
            .nodes
            .get_mut(&id)
            .and_then(|n| n.replica_mut(group))
            .and_then(|r| r.engine.as_mut())
        {
            Some(engine) if inputs.len() == 1 => {
                engine.step(inputs.into_iter().next().expect("one input"), &mut actions)
            }
            Some(engine) => engine.step_batch(inputs, &mut actions),
            None => return,
        }
        let incarnation = self.incarnation(id);
        for action in actions {
            // A storage failure stops the node in the middle of its actions.
            if self.failure.is_some() || self.incarnation(id) != incarnation || !self.is_running(id)
            {
                return;
            }
            self.carry_out(id, group, action);
        }
        self.check_node(id, group);
    }

    /// Traces an input and counts what it covers.
    fn note_input(&mut self, id: NodeId, group: GroupId, input: &Input) {
        if let Input::Message(message) = input {
            if self.trace.is_some() {
                let text = format!(
                    "recv n{}->n{} t{} {}",
                    message.from,
                    message.to,
                    message.term,
                    describe_body(&message.body)
                );
                self.log_group(Some(id), group, &text);
            }
        }
        if let Input::Client { .. } = input {
            if self
                .group_engine(id, group)
                .is_some_and(|e| e.is_receiving_snapshot())
            {
                self.coverage.hit(Counter::RequestWhileReceivingSnapshot);
            }
        }
    }

    fn check_node(&mut self, id: NodeId, group: GroupId) {
        let Some(replica) = self.nodes.get(&id).and_then(|n| n.replica(group)) else {
            return;
        };
        let Some(engine) = replica.engine.as_ref() else {
            return;
        };
        let (role, term, commit, applied) = (
            engine.role(),
            engine.term(),
            engine.commit_index(),
            engine.applied_index(),
        );
        let (last_commit, last_applied) = (replica.last_commit, replica.last_applied);
        let who = self.who(id, group);
        let index = group_index(group).unwrap_or(0);
        if self.checkers.len() <= index {
            self.checkers.resize_with(index + 1, SafetyChecker::default);
        }
        let checker = &mut self.checkers[index];
        let mut problem = None;
        if role == Role::Leader {
            if let Err(v) = checker.observe_leader(term, id) {
                problem = Some((FailureKind::Safety, v));
            }
        }
        if commit < last_commit {
            problem = Some((
                FailureKind::Safety,
                format!("{who}: commit index went back from {last_commit} to {commit}"),
            ));
        }
        if applied < last_applied {
            problem = Some((
                FailureKind::Safety,
                format!("{who}: applied index went back from {last_applied} to {applied}"),
            ));
        }
        if problem.is_none() && commit > last_commit {
            for index in last_commit + 1..=commit {
                if let Some(entry) = engine.entry(index) {
                    if let Err(v) = checker.observe_committed(id, term, entry) {
                        problem = Some((FailureKind::Safety, v));
                        break;
                    }
                }
            }
        }
        if let Some((kind, detail)) = problem {
            let detail = format!("{}{detail}", self.group_prefix(group));
            self.fail(kind, detail);
            return;
        }
        if let Some(replica) = self.nodes.get_mut(&id).and_then(|n| n.replica_mut(group)) {
            replica.last_commit = commit;
            replica.last_applied = applied;
        }
    }

    // ----- actions -----

    fn carry_out(&mut self, id: NodeId, group: GroupId, action: Action) {
        match action {
            Action::Persist(request) => {
                let seq = request.seq;
                if let Some(entries) = (!request.entries.is_empty()).then_some(&request.entries) {
                    if let Err(v) = self.checker(group).observe_entries(id, None, entries) {
                        let detail = format!("{}{v}", self.group_prefix(group));
                        self.fail(FailureKind::Safety, detail);
                        return;
                    }
                }
                let Some(node) = self.nodes.get_mut(&id) else {
                    return;
                };
                let appended = node
                    .real
                    .as_mut()
                    .map_or(Ok(()), |real| real.append(group, &request));
                // The model counts the write even when the real one failed:
                // a failed write may still have reached the disk (the power
                // can go after its record was written and before the write
                // ended: a later record of the same flush, the space the log
                // reserves ahead), and the crash that follows may keep or
                // lose it, as the real disk does.
                let modelled = node.disk.write(group, request);
                if let Err(e) = appended {
                    self.storage_failed(id, e);
                    return;
                }
                if let Err(v) = modelled {
                    self.storage_violation(id, (group, v));
                    return;
                }
                if self.config.sabotage == Sabotage::PersistedBeforeSync {
                    let incarnation = self.incarnation(id);
                    self.schedule(
                        0,
                        Event::FalsePersisted {
                            node: id,
                            group,
                            incarnation,
                            seq,
                        },
                    );
                }
                self.maybe_start_sync(id);
            }
            Action::Send(message) => self.send_message(id, group, message),
            Action::Apply(entries) => self.apply_entries(id, group, entries),
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
                        group,
                        incarnation,
                        to,
                        snapshot_index,
                        offset,
                        max_bytes,
                    },
                );
            }
            Action::LoadEntries {
                to,
                term,
                from,
                through,
                max_bytes,
            } => {
                // Some reads fail and some answers are lost (a worker
                // dropped it, the node was busy): the engine must live
                // with both.
                let fate = self.rng.range(0, 100);
                if fate < 5 {
                    self.coverage.hit(Counter::EntriesLoadFailed);
                    return;
                }
                let delay = self.rng.range(20, 300);
                let incarnation = self.incarnation(id);
                self.schedule(
                    delay,
                    Event::EntriesLoaded {
                        node: id,
                        group,
                        incarnation,
                        to,
                        term,
                        from,
                        through,
                        max_bytes,
                        failed: fate < 10,
                    },
                );
            }
            Action::SaveSnapshotChunk {
                meta,
                offset,
                data,
                done,
            } => {
                let ok = match self
                    .nodes
                    .get_mut(&id)
                    .and_then(|n| n.disk.group_mut(group))
                {
                    Some(disk) => disk.save_chunk(&meta, offset, &data),
                    None => return,
                };
                let ok = ok && self.real_save_chunk(id, group, &meta, offset, &data);
                if !self.is_running(id) {
                    return;
                }
                let delay = self.rng.range(20, 500);
                let incarnation = self.incarnation(id);
                self.schedule(
                    delay,
                    Event::ChunkSaved {
                        node: id,
                        group,
                        incarnation,
                        meta,
                        offset,
                        done,
                        ok,
                    },
                );
            }
            Action::Compact { through } => {
                let who = self.who(id, group);
                let Some(node) = self.nodes.get_mut(&id) else {
                    return;
                };
                let Some(disk) = node.disk.group_mut(group) else {
                    return;
                };
                let snapshot_index = disk.synced().snapshot.index;
                if through > snapshot_index {
                    self.fail(
                        FailureKind::Contract,
                        format!("{who}: compact through {through} but the durable snapshot is at {snapshot_index}"),
                    );
                    return;
                }
                disk.compact(through);
                if let Some(real) = node.real.as_mut() {
                    if let Err(e) = real.compact(group, through) {
                        self.storage_failed(id, e);
                    }
                }
            }
            Action::RoleChanged { role, term, leader } => {
                self.on_role_changed(id, group, role, term, leader)
            }
            Action::Removed => {
                self.log_group(Some(id), group, "removed from the group");
                self.coverage.hit(Counter::NodeRemoved);
                if let Some(replica) = self.nodes.get_mut(&id).and_then(|n| n.replica_mut(group)) {
                    replica.removed = true;
                }
            }
            Action::Fault(fault) => {
                if let ferry_raft::Fault::FollowerLogWentBack { certain: false, .. } = fault {
                    // A late duplicate of an old rejection looks the same;
                    // the network here duplicates and delays messages.
                    self.log_group(Some(id), group, &format!("possible fault: {fault}"));
                    if let Some(seen) = self.faults_seen.as_mut() {
                        seen.push((id, group, fault));
                    }
                    return;
                }
                if self.faults_seen.is_some() {
                    self.log_group(Some(id), group, &format!("fault detected: {fault}"));
                    if let Some(seen) = self.faults_seen.as_mut() {
                        seen.push((id, group, fault));
                    }
                    return;
                }
                // No node here is faulty or hostile: any detected fault means
                // the engine, the storage or this runtime broke an assumption.
                let who = self.who(id, group);
                self.fail(
                    FailureKind::Safety,
                    format!("{who} reported a fault: {fault}"),
                );
            }
        }
    }

    fn on_role_changed(
        &mut self,
        id: NodeId,
        group: GroupId,
        role: Role,
        term: Term,
        leader: Option<NodeId>,
    ) {
        self.log_group(
            Some(id),
            group,
            &format!("role {role:?} term={term} leader={leader:?}"),
        );
        let previous = self
            .nodes
            .get_mut(&id)
            .and_then(|n| n.replica_mut(group))
            .and_then(|r| r.last_role.replace((role, term)));
        if role != Role::Leader || previous == Some((Role::Leader, term)) {
            return;
        }
        let reelected = self.checker(group).leader_before(term);
        if let Err(v) = self.checker(group).observe_leader(term, id) {
            let detail = format!("{}{v}", self.group_prefix(group));
            self.fail(FailureKind::Safety, detail);
            return;
        }
        let Some(engine) = self.group_engine(id, group) else {
            return;
        };
        let completeness = self
            .checkers
            .get(group_index(group).unwrap_or(usize::MAX))
            .map_or(Ok(()), |c| c.check_leader_completeness(engine));
        if let Err(v) = completeness {
            let detail = format!("{}{v}", self.group_prefix(group));
            self.fail(FailureKind::Safety, detail);
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
        if self.config.groups > 1 {
            if reelected && self.config.is_idle_group(group) {
                self.coverage.hit(Counter::IdleGroupReelected);
            }
            let spread = self
                .group_ids()
                .filter(|&g| g != group)
                .any(|g| self.group_leader(g).is_some_and(|l| l != id));
            if spread {
                self.coverage.hit(Counter::GroupLeadersSpread);
            }
        }
        if let Some((target_group, target, deadline)) = self.transfer_target {
            if target_group == group && target == id && self.now_us <= deadline {
                self.coverage.hit(Counter::LeadershipTransferred);
                self.transfer_target = None;
            }
        }
    }

    /// Starts a sync of the node's log if none runs and some group has
    /// writes to sync: one sync for all of them (group commit).
    fn maybe_start_sync(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let incarnation = node.incarnation;
        if let Some(covered) = node.disk.start_sync() {
            let delay = match node.real.as_mut().map(RealStorage::start_sync) {
                None => {
                    let (low, high) = self.config.sync_delay_us;
                    self.rng.range_inclusive(low, high)
                }
                Some(Ok(Some(disk_us))) => {
                    let disk_us = self.sync_us_in_phase(disk_us);
                    if disk_us >= 2 * TICK_US {
                        self.coverage.hit(Counter::SlowSync);
                    }
                    20 + disk_us
                }
                Some(Ok(None)) => {
                    let through = if self.config.groups > 1 {
                        format!("{covered:?}")
                    } else {
                        covered.iter().map(|(_, s)| s.to_string()).collect()
                    };
                    self.fail(
                        FailureKind::Contract,
                        format!("node {id}: the model has writes to sync (through seq {through}) but the real log has none"),
                    );
                    return;
                }
                Some(Err(e)) => {
                    self.storage_failed(id, e);
                    return;
                }
            };
            if covered.len() > 1 {
                self.coverage.hit(Counter::SyncCoveredGroups);
            }
            self.schedule(
                delay,
                Event::SyncDone {
                    node: id,
                    incarnation,
                    covered,
                },
            );
        }
    }

    /// Principle 6: an append is acknowledged and a vote granted or asked
    /// for only once the state behind it is synced.
    fn check_durable_before_send(
        &mut self,
        id: NodeId,
        group: GroupId,
        message: &Message,
    ) -> Result<(), String> {
        let Some(node) = self.nodes.get(&id) else {
            return Ok(());
        };
        let Some(synced) = node.disk.group(group).map(|d| d.synced()) else {
            return Ok(());
        };
        let Some(checker) = group_index(group).and_then(|i| self.checkers.get(i)) else {
            return Ok(());
        };
        match &message.body {
            // Only the leader of the response's term counts it; an answer to
            // a stale leader is ignored there and proves nothing.
            MessageBody::AppendResponse(AppendResult::Success { match_index })
                if checker.leader_of(message.term) == Some(message.to)
                    && synced.last_index() < *match_index =>
            {
                return Err(format!(
                    "node {id} acknowledged index {match_index} to {}, the leader of term {}, but has synced only up to {} (its own term is {})",
                    message.to,
                    message.term,
                    synced.last_index(),
                    node.engine(group).map_or(0, |e| e.term())
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

    fn send_message(&mut self, id: NodeId, group: GroupId, message: Message) {
        if message.group != group {
            let who = self.who(id, group);
            self.fail(
                FailureKind::Contract,
                format!("{who} sent a message of group {}", message.group),
            );
            return;
        }
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
        if let Err(detail) = self.check_durable_before_send(id, group, &message) {
            let detail = format!("{}{detail}", self.group_prefix(group));
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
                if let Err(v) = self.checker(group).observe_entries(
                    id,
                    Some((*prev_log_index, *prev_log_term)),
                    entries,
                ) {
                    let detail = format!("{}{v}", self.group_prefix(group));
                    self.fail(FailureKind::Safety, detail);
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
                self.log_group(
                    Some(id),
                    group,
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
                self.schedule_delivery(delay, message.clone());
            }
            Interference::Delay(extra) => {
                let delay = self.net.delay_us(&mut self.rng) + extra;
                self.schedule_delivery(delay, message);
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
                    self.schedule_delivery(delay, message.clone());
                }
            }
            SendOutcome::Held => {
                let epoch = self.connection_epoch(message.from, message.to);
                self.held_epochs
                    .entry((message.from, message.to))
                    .or_default()
                    .push(epoch);
            }
            SendOutcome::Dropped(reason) => match reason {
                DropReason::Loss | DropReason::ClogOverflow => {
                    self.coverage.hit(Counter::MessageDropped)
                }
                DropReason::ConnectWindow => self.coverage.hit(Counter::ConnectWindowLoss),
                DropReason::Partition => {}
            },
        }
    }

    fn apply_entries(&mut self, id: NodeId, group: GroupId, entries: Vec<Entry>) {
        let (commit, node_term) = self
            .group_engine(id, group)
            .map_or((0, 0), |e| (e.commit_index(), e.term()));
        let who = self.who(id, group);
        for entry in &entries {
            if entry.index > commit {
                self.fail(
                    FailureKind::Safety,
                    format!(
                        "{who} applies entry {} beyond its commit index {commit}",
                        entry.index
                    ),
                );
                return;
            }
            if let Err(v) = self.checker(group).observe_applied(id, node_term, entry) {
                let detail = format!("{}{v}", self.group_prefix(group));
                self.fail(FailureKind::Safety, detail);
                return;
            }
            // A proposal answered at exactly this (index, term) must be this command.
            for slot in 0..self.clients.len() {
                let client_id = self.clients[slot].client_id;
                if let Some(op) = self.clients[slot].op {
                    if let Awaiting::Apply { node, index, term } = op.awaiting {
                        if node == id && op.group == group && index == entry.index {
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
                                            "{who}: proposal of client {client_id} was answered at ({index}, {term}) but that entry holds {:?}",
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
            let Some(node) = self.nodes.get_mut(&id).and_then(|n| n.replica_mut(group)) else {
                return;
            };
            if let EntryPayload::Command(bytes) = &entry.payload {
                if let Ok(command) = Command::decode(bytes) {
                    if let Some(session) = node.machine.session(command.client()) {
                        if session.op_seq >= command.op_seq() {
                            let detail = format!(
                                "{who} applies operation {} of client {} a second time, at index {}: one client request became two log entries (a duplicated forward, or an attempt refused as 'no effect' that took effect)",
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
                    self.fail(FailureKind::Contract, format!("{who}: {e}"));
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
        self.resolve_applied(id, group, false);
        self.maybe_take_snapshot(id, group);
    }

    fn maybe_take_snapshot(&mut self, id: NodeId, group: GroupId) {
        let every = self.config.snapshot_every_entries.max(1);
        if !self.local_snapshots {
            return;
        }
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let incarnation = node.incarnation;
        let Some(snapshot_index) = node.disk.group(group).map(|d| d.synced().snapshot.index) else {
            return;
        };
        let Some(replica) = node.replica_mut(group) else {
            return;
        };
        if replica.snapshot_in_progress
            || replica.machine.applied() < snapshot_index.saturating_add(every)
        {
            return;
        }
        replica.snapshot_in_progress = true;
        let meta = SnapshotMeta {
            index: replica.machine.applied(),
            term: replica.machine.applied_term(),
            config: replica.machine.config().clone(),
        };
        let data = replica.machine.encode_snapshot();
        let delay = self.rng.range(100, 2_000);
        self.schedule(
            delay,
            Event::LocalSnapshot {
                node: id,
                group,
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
                    // The node's one clock drives every group it hosts.
                    for group in self.group_ids() {
                        self.step(node, group, Input::Tick);
                    }
                }
                self.schedule(period, Event::Tick { node, incarnation });
            }
            Event::Deliver { message, epoch } => {
                if self
                    .net
                    .partition()
                    .blocked
                    .contains(&(message.from, message.to))
                {
                    return;
                }
                if self.sent_on_broken_connection(message.from, message.to, epoch) {
                    self.log_group(
                        Some(message.to),
                        message.group,
                        &format!(
                            "lost n{}->n{} {} (its connection broke)",
                            message.from,
                            message.to,
                            describe_body(&message.body)
                        ),
                    );
                    return;
                }
                let (to, group) = (message.to, message.group);
                self.feed(to, group, Input::Message(message));
            }
            Event::FalsePersisted {
                node,
                group,
                incarnation,
                seq,
            } => {
                if self.incarnation(node) == incarnation {
                    self.feed(node, group, Input::Persisted { seq });
                }
            }
            Event::SyncDone {
                node,
                incarnation,
                covered,
            } => {
                if self.incarnation(node) != incarnation || !self.is_running(node) {
                    return;
                }
                if !self.real_complete_sync(node, &covered) {
                    return;
                }
                let (result, reports) = match self.nodes.get_mut(&node) {
                    Some(n) => {
                        let result = n.disk.complete_sync(&covered);
                        (result, n.disk.take_persisted_reports())
                    }
                    None => return,
                };
                if let Err(v) = result {
                    self.storage_violation(node, v);
                    return;
                }
                // Every group the sync covered learns its writes are durable.
                for (group, seq) in reports {
                    self.feed(node, group, Input::Persisted { seq });
                }
                self.maybe_start_sync(node);
            }
            Event::ChunkLoaded {
                node,
                group,
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
                    .and_then(|n| n.disk.group(group))
                    .and_then(|d| d.load_chunk(snapshot_index, offset, max_bytes));
                let Some(chunk) =
                    self.real_load_chunk(node, group, snapshot_index, offset, max_bytes, chunk)
                else {
                    return;
                };
                if chunk.is_none() {
                    self.coverage.hit(Counter::SnapshotChunkGone);
                }
                self.feed(
                    node,
                    group,
                    Input::SnapshotChunkLoaded {
                        to,
                        snapshot_index,
                        offset,
                        chunk,
                    },
                );
            }
            Event::EntriesLoaded {
                node,
                group,
                incarnation,
                to,
                term,
                from,
                through,
                max_bytes,
                failed,
            } => {
                if self.incarnation(node) != incarnation {
                    return;
                }
                let entries = if failed {
                    self.coverage.hit(Counter::EntriesLoadFailed);
                    None
                } else {
                    let disk = self.nodes.get(&node).and_then(|n| n.disk.group(group));
                    let model = disk.and_then(|d| d.load_written(from, through, max_bytes));
                    let covered = disk.map_or((0, 0), |d| {
                        (d.synced().snapshot.index, d.synced().snapshot.term)
                    });
                    let Some(entries) = self.real_load_entries(
                        node,
                        group,
                        (from, through, max_bytes),
                        (model, covered),
                    ) else {
                        return;
                    };
                    entries
                };
                if entries.is_some() {
                    self.coverage.hit(Counter::EntriesLoadedFromStorage);
                }
                self.feed(
                    node,
                    group,
                    Input::EntriesLoaded {
                        to,
                        term,
                        from,
                        entries,
                    },
                );
            }
            Event::ChunkSaved {
                node,
                group,
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
                    self.install_snapshot(node, group, &meta)
                } else {
                    ok
                };
                if self.failure.is_some() {
                    return;
                }
                self.feed(
                    node,
                    group,
                    Input::SnapshotChunkSaved {
                        snapshot_index: meta.index,
                        offset,
                        ok,
                    },
                );
            }
            Event::LocalSnapshot {
                node,
                group,
                incarnation,
                meta,
                data,
            } => {
                if self.incarnation(node) != incarnation {
                    return;
                }
                let index = meta.index;
                if !self.real_save_local_snapshot(node, group, &meta, &data) {
                    return;
                }
                let stored = match self.nodes.get_mut(&node) {
                    Some(n) => {
                        if let Some(replica) = n.replica_mut(group) {
                            replica.snapshot_in_progress = false;
                        }
                        n.disk
                            .group_mut(group)
                            .is_some_and(|d| d.store_local_snapshot(meta, data))
                    }
                    None => return,
                };
                if stored {
                    self.coverage.hit(Counter::LocalSnapshotTaken);
                    self.feed(node, group, Input::SnapshotBuilt { index });
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
                // One link per pair of nodes: every group hears of it.
                self.feed_all(node, Input::PeerConnected(peer));
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

    fn install_snapshot(&mut self, id: NodeId, group: GroupId, meta: &SnapshotMeta) -> bool {
        let who = self.who(id, group);
        let Some(node) = self.nodes.get_mut(&id) else {
            return false;
        };
        let Some(incoming) = node.disk.group_mut(group).and_then(|d| d.take_incoming()) else {
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
        let applied = node.replica(group).map_or(0, |r| r.machine.applied());
        if meta.index <= applied {
            self.fail(
                FailureKind::Contract,
                format!(
                    "{who} was asked to install snapshot at {} but has applied {applied}: installing would roll back its state machine",
                    meta.index
                ),
            );
            return false;
        }
        if let Some(real) = node.real.as_mut() {
            if let Some(replica) = group_index(group).and_then(|i| node.replicas.get_mut(i)) {
                replica.snapshot_attempt = Some((meta.clone(), data.clone()));
            }
            if let Err(e) = real.install_incoming(group, meta) {
                self.storage_failed(id, e);
                return false;
            }
            if let Some(replica) = group_index(group).and_then(|i| node.replicas.get_mut(i)) {
                replica.snapshot_attempt = None;
            }
        }
        let Some(node) = self.nodes.get_mut(&id) else {
            return false;
        };
        let unsynced_elsewhere = node
            .disk
            .group_ids()
            .into_iter()
            .any(|g| g != group && node.disk.group(g).is_some_and(|d| d.has_unsynced()));
        if let Err(v) = node.disk.install_snapshot(group, meta.clone(), data) {
            self.storage_violation(id, v);
            return false;
        }
        if let Some(replica) = node.replica_mut(group) {
            replica.machine = machine;
        }
        let reports = node.disk.take_persisted_reports();
        self.log_group(
            Some(id),
            group,
            &format!("installed snapshot ({}, {})", meta.index, meta.term),
        );
        self.coverage.hit(Counter::SnapshotInstalled);
        if unsynced_elsewhere {
            self.coverage.hit(Counter::InstallSyncedOtherGroups);
        }
        // The install synced the whole log: the installing group hears
        // first, then every other group whose writes it made durable.
        let (own, others): (Vec<_>, Vec<_>) = reports.into_iter().partition(|(g, _)| *g == group);
        for (g, seq) in own.into_iter().chain(others) {
            self.feed(id, g, Input::Persisted { seq });
        }
        self.resolve_applied(id, group, true);
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

/// Runs one seed with random parameters and one group per node, catching
/// panics.
pub fn run_seed(seed: u64, voters: Option<usize>, trace: bool) -> SeedReport {
    run_seed_with(seed, voters, trace, QuiesceMode::Off)
}

/// Runs one seed with random parameters, one group per node and quiescence
/// set by `quiesce`, catching panics.
pub fn run_seed_with(
    seed: u64,
    voters: Option<usize>,
    trace: bool,
    quiesce: QuiesceMode,
) -> SeedReport {
    run_seed_in_groups_with(seed, voters, 1, trace, quiesce)
}

/// Runs one seed with random parameters and `groups` Raft groups per node
/// (see [`SimConfig::with_groups`]), quiescence off, catching panics. With
/// one group it is [`run_seed`], draw for draw.
pub fn run_seed_in_groups(
    seed: u64,
    voters: Option<usize>,
    groups: usize,
    trace: bool,
) -> SeedReport {
    run_seed_in_groups_with(seed, voters, groups, trace, QuiesceMode::Off)
}

/// Runs one seed with random parameters, `groups` Raft groups per node and
/// quiescence set by `quiesce` for every group's engine, catching panics.
/// The seed's parameters, the choices only several groups need and the
/// quiescence draw come from three separate generators, so that neither
/// flag changes what the others draw.
pub fn run_seed_in_groups_with(
    seed: u64,
    voters: Option<usize>,
    groups: usize,
    trace: bool,
    quiesce: QuiesceMode,
) -> SeedReport {
    let mut config = SimConfig::random(seed, voters).with_groups(groups);
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
    let groups = config.groups;
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
                    groups,
                    histories: Vec::new(),
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
