//! One Raft group on a worker: its engine, its machine, and the callers
//! waiting on it. Carries out every action the engine returns.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

use ferry_raft::{
    Action, CampaignOutcome, Entry, EntryPayload, GroupId, Index, Input, MembershipChange, Message,
    NodeId, RaftNode, ReadConsistency, Request, RequestError, RequestId, Response, Role, Status,
    Term,
};

use crate::error::GroupError;
use crate::log_limit::LogLimiter;
use crate::log_task::LogRequest;
use crate::machine::{ApplyError, BytesSnapshot, Command, Durability, GroupEvent, StateMachine};
use crate::member_id::Hex;
use crate::metrics::{GroupProgress, HostMetrics};
use crate::snapshot_policy::SnapshotPolicy;
use crate::stream::Outbound;
use crate::transport::codec::encode_message;
use crate::view::GroupView;
use crate::worker::{Completion, GroupRun, Outbox, Workers};
use crate::Links;

/// Logs a consensus event of a group (`$group`, a [`Group`]): every one
/// names the member, the group, the term and the commit index, so that a
/// log collector can line up what each member saw (`--log-format json`).
macro_rules! consensus_event {
    ($level:expr, $group:expr, $($rest:tt)+) => {
        tracing::event!(
            $level,
            member = %Hex($group.node.id()),
            group = $group.id,
            term = $group.node.term(),
            index = $group.node.commit_index(),
            $($rest)+
        )
    };
}

/// Ticks before a local snapshot that failed for lack of descriptors or
/// space is tried again: it costs a pass over the state, and the log keeps
/// every entry meanwhile.
const SNAPSHOT_RETRY_TICKS: u64 = 50;

/// A call from a [`crate::GroupHandle`] for a group of machine `M`.
pub(crate) enum Call<M: StateMachine> {
    Propose {
        command: Bytes,
        reply: oneshot::Sender<Result<M::Response, GroupError>>,
    },
    Query {
        query: M::Query,
        consistency: ReadConsistency,
        reply: oneshot::Sender<Result<M::QueryResponse, GroupError>>,
    },
    Barrier {
        consistency: ReadConsistency,
        reply: oneshot::Sender<Result<Index, GroupError>>,
    },
    ChangeMembership {
        change: MembershipChange,
        reply: oneshot::Sender<Result<Index, GroupError>>,
    },
    TransferLeadership {
        to: NodeId,
        reply: oneshot::Sender<Result<(), GroupError>>,
    },
    Status {
        reply: oneshot::Sender<Result<Status, GroupError>>,
    },
    Campaign {
        reply: oneshot::Sender<Result<CampaignOutcome, GroupError>>,
    },
    Progress {
        reply: oneshot::Sender<Result<GroupProgress, GroupError>>,
    },
}

/// Where a query's answer goes.
type QueryReply<M> = oneshot::Sender<Result<<M as StateMachine>::QueryResponse, GroupError>>;

/// A read waiting for its read index to be applied.
enum PendingRead<M: StateMachine> {
    Query(M::Query, QueryReply<M>),
    Barrier(oneshot::Sender<Result<Index, GroupError>>),
}

/// Reads by the read index they wait for.
type PendingReads<M> = BTreeMap<Index, Vec<PendingRead<M>>>;

/// A request the engine has not answered yet.
enum Waiter<M: StateMachine> {
    Propose(oneshot::Sender<Result<M::Response, GroupError>>),
    Query(M::Query, QueryReply<M>),
    Barrier(oneshot::Sender<Result<Index, GroupError>>),
    Membership(oneshot::Sender<Result<Index, GroupError>>),
    Transfer(oneshot::Sender<Result<(), GroupError>>),
    Status(oneshot::Sender<Result<Status, GroupError>>),
    Campaign(oneshot::Sender<Result<CampaignOutcome, GroupError>>),
}

/// A request whose entry is in the log, waiting for it to apply.
enum Applying<M: StateMachine> {
    Propose(oneshot::Sender<Result<M::Response, GroupError>>),
    Membership(oneshot::Sender<Result<Index, GroupError>>),
}

impl<M: StateMachine> Waiter<M> {
    fn fail(self, error: GroupError) {
        match self {
            Waiter::Propose(reply) => drop(reply.send(Err(error))),
            Waiter::Query(_, reply) => drop(reply.send(Err(error))),
            Waiter::Barrier(reply) => drop(reply.send(Err(error))),
            Waiter::Membership(reply) => drop(reply.send(Err(error))),
            Waiter::Transfer(reply) => drop(reply.send(Err(error))),
            Waiter::Status(reply) => drop(reply.send(Err(error))),
            Waiter::Campaign(reply) => drop(reply.send(Err(error))),
        }
    }
}

impl<M: StateMachine> Applying<M> {
    fn fail(self, error: GroupError) {
        match self {
            Applying::Propose(reply) => drop(reply.send(Err(error))),
            Applying::Membership(reply) => drop(reply.send(Err(error))),
        }
    }
}

/// The snapshot bookkeeping of an in-memory machine.
#[derive(Debug, Default)]
struct Snapshots {
    /// The index of the latest snapshot on disk (0: none).
    index: Index,
    /// Its size.
    bytes: u64,
    /// Bytes of commands applied since it was taken.
    log_bytes: u64,
    /// Commands applied since it was taken.
    log_entries: u64,
    /// The snapshot being written, and `log_bytes` and `log_entries` when
    /// it was started.
    building: Option<(Index, u64, u64)>,
    /// No snapshot is tried before this tick (after one failed).
    retry_at_tick: u64,
}

/// A snapshot arriving from the leader: its chunks go to a file, which the
/// machine restores from once it is sealed.
struct Receiving {
    index: Index,
}

/// One group of machine `M`.
pub(crate) struct Group<M: StateMachine> {
    id: GroupId,
    node: RaftNode,
    /// The machine; away on a blocking thread while it restores from a
    /// snapshot.
    machine: Option<M>,
    /// Entries committed while the machine was away, applied on its
    /// return.
    deferred: Vec<Entry>,
    /// Events that happened while the machine was away.
    deferred_events: Vec<GroupEvent>,
    /// A restored snapshot is being installed: applies wait for it.
    installing: bool,
    /// Whether the machine keeps its own state on disk.
    durable: bool,
    /// A durable machine's state holds every command through this index:
    /// those are not applied again.
    skip_through: Index,
    /// A durable machine's snapshots streamed to followers.
    outbound: BTreeMap<NodeId, Outbound>,
    links: Arc<Links>,
    workers: Workers,
    view: Arc<Mutex<GroupView>>,
    policy: SnapshotPolicy,
    actions: Vec<Action>,
    /// Inputs taken since the worker last flushed this group: stepped
    /// together (see [`Group::flush_batch`]).
    batch: Vec<Input>,
    next_request: u64,
    waiting: HashMap<RequestId, Waiter<M>>,
    applying: BTreeMap<Index, (Term, Applying<M>)>,
    /// Queries whose read index is ahead of what is applied.
    reads: PendingReads<M>,
    applied: Index,
    snapshots: Snapshots,
    receiving: Option<Receiving>,
    ticks: u64,
    role: Role,
    /// The leader last reported by the engine, to count changes.
    leader: Option<NodeId>,
    halted: bool,
    /// The machine could not apply the entry at this index ([`ApplyError`]):
    /// the group is stopped on this node, as a crash would stop it.
    machine_failed: Option<(Index, String)>,
    fault_warnings: LogLimiter,
    metrics: Arc<HostMetrics>,
}

impl<M: StateMachine> Group<M> {
    /// A group around an engine recovered (or bootstrapped) at `applied`
    /// with the machine restored to the snapshot at `snapshot_index`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: GroupId,
        node: RaftNode,
        machine: M,
        links: Arc<Links>,
        workers: Workers,
        view: Arc<Mutex<GroupView>>,
        policy: SnapshotPolicy,
        snapshot: (Index, u64),
        metrics: Arc<HostMetrics>,
    ) -> Group<M> {
        let durable = machine.durability() == Durability::Durable;
        let skip_through = if durable { machine.applied_index() } else { 0 };
        Group {
            id,
            applied: node.applied_index(),
            node,
            machine: Some(machine),
            deferred: Vec::new(),
            deferred_events: Vec::new(),
            installing: false,
            durable,
            skip_through,
            outbound: BTreeMap::new(),
            links,
            workers,
            view,
            policy,
            actions: Vec::new(),
            batch: Vec::new(),
            next_request: 1,
            waiting: HashMap::new(),
            applying: BTreeMap::new(),
            reads: BTreeMap::new(),
            snapshots: Snapshots {
                index: snapshot.0,
                bytes: snapshot.1,
                ..Snapshots::default()
            },
            receiving: None,
            ticks: 0,
            role: Role::Follower,
            leader: None,
            halted: false,
            machine_failed: None,
            fault_warnings: LogLimiter::for_remote_input(),
            metrics,
        }
    }

    /// Publishes what handles read without a call, and tells the machine
    /// of a new configuration.
    fn publish(&mut self) {
        let config_changed = {
            let mut view = self
                .view
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // The configuration in force changes only when the log does (an
            // entry appended or cut, a snapshot installed) or the commit
            // index moves (a change takes effect once committed), so it is
            // compared only then.
            let log_moved = view.last_index != self.node.last_index()
                || view.commit != self.node.commit_index();
            let changed = log_moved && view.config != *self.node.config();
            if changed {
                view.config = self.node.config().clone();
            }
            // A group stopped for its machine leads nothing, whatever the
            // engine's frozen state says.
            let stopped = self.machine_failed.is_some();
            view.role = if stopped { Role::Follower } else { self.role };
            view.term = self.node.term();
            view.leader = if stopped { None } else { self.node.leader() };
            view.commit = self.node.commit_index();
            view.durable_index = self.node.durable_index();
            view.applied = self.applied;
            view.receiving_snapshot = self.node.is_receiving_snapshot();
            view.quiescent = self.node.is_quiescent();
            view.removed = self.node.is_removed();
            if view.halted.is_none() {
                view.halted = self.node.halted().map(ToString::to_string).or_else(|| {
                    self.machine_failed
                        .as_ref()
                        .map(|(index, reason)| machine_failed_text(*index, reason))
                });
            }
            view.last_index = self.node.last_index();
            changed
        };
        if config_changed {
            consensus_event!(
                tracing::Level::INFO,
                self,
                config = ?self.node.config(),
                "the group's configuration changed"
            );
            self.event(GroupEvent::ConfigChanged(self.node.config().clone()));
        }
    }

    /// Tells the machine of an event (later, if it is away).
    fn event(&mut self, event: GroupEvent) {
        match self.machine.as_mut() {
            Some(machine) => machine.on_event(&event),
            None => self.deferred_events.push(event),
        }
    }

    /// Feeds one input and carries out every action it produces (after
    /// the inputs batched before it).
    fn step(&mut self, input: Input, out: &mut Outbox) {
        self.flush_batch(out);
        self.step_unpublished(input, out);
        self.publish();
    }

    /// Takes an input to be stepped with the others the worker takes in
    /// the same turn: proposals arriving together then share one persist
    /// request and one append per follower, and the acknowledgments and
    /// forwarded requests of a moment are answered with one message per
    /// peer, instead of one of each per input. The worker flushes the
    /// batch before it waits for more ([`GroupRun::flush`]), and every
    /// input that is stepped at once flushes it first, so the engine sees
    /// the inputs in the order they came.
    fn enqueue(&mut self, input: Input) {
        self.batch.push(input);
    }

    /// Steps the batched inputs together ([`RaftNode::step_batch`]) and
    /// carries out what they produce.
    fn flush_batch(&mut self, out: &mut Outbox) {
        if self.batch.is_empty() {
            return;
        }
        let mut inputs = std::mem::take(&mut self.batch);
        // Stopped: the engine takes nothing more, as on a crashed node
        // (every caller was answered when it stopped).
        self.step_engine(out, |node, actions| {
            node.step_batch(inputs.drain(..), actions)
        });
        inputs.clear();
        self.batch = inputs;
        self.publish();
    }

    /// [`Group::step`] without publishing the view; returns how many
    /// actions the step produced.
    fn step_unpublished(&mut self, input: Input, out: &mut Outbox) -> usize {
        // Stopped: the engine takes nothing more, as on a crashed node.
        self.step_engine(out, |node, actions| node.step(input, actions))
    }

    /// Runs one step of the engine (`step` fills the action list) unless the
    /// group has stopped, and carries out its actions; returns how many
    /// there were.
    fn step_engine(
        &mut self,
        out: &mut Outbox,
        step: impl FnOnce(&mut RaftNode, &mut Vec<Action>),
    ) -> usize {
        if self.machine_failed.is_some() {
            return 0;
        }
        let mut actions = std::mem::take(&mut self.actions);
        step(&mut self.node, &mut actions);
        let count = actions.len();
        for action in actions.drain(..) {
            self.act(action, out);
        }
        self.actions = actions;
        count
    }

    fn request(&mut self, request: Request, waiter: Waiter<M>) {
        if let Some(error) = self.machine_failed_error() {
            waiter.fail(error);
            return;
        }
        let id = RequestId(self.next_request);
        self.next_request += 1;
        self.waiting.insert(id, waiter);
        self.enqueue(Input::Client { id, request });
    }

    fn act(&mut self, action: Action, out: &mut Outbox) {
        if self.machine_failed.is_some() {
            // The rest of the step that stopped the group is dropped with
            // the engine.
            return;
        }
        match action {
            Action::Persist(request) => out.log.push(LogRequest::Append {
                group: self.id,
                request,
            }),
            Action::Send(message) => {
                self.links.send(message.to, encode_message(&message));
            }
            Action::Apply(entries) => {
                if self.machine.is_none() || self.installing {
                    self.deferred.extend(entries);
                    return;
                }
                for entry in entries {
                    self.apply(entry.index, entry.term, &entry.payload);
                    if self.machine_failed.is_some() {
                        return;
                    }
                }
                self.answer_reads();
                self.maybe_snapshot(out);
            }
            Action::Respond { id, result } => self.respond(id, result),
            Action::LoadSnapshotChunk {
                to,
                snapshot_index,
                offset,
                max_bytes,
            } => {
                if offset == 0 {
                    // The first chunk: a transfer begins (or starts over).
                    self.metrics.snapshots_sent.inc();
                    consensus_event!(
                        tracing::Level::INFO,
                        self,
                        snapshot_index,
                        to = %Hex(to),
                        "sending a snapshot to a follower"
                    );
                }
                if self.durable {
                    self.stream_chunk(to, snapshot_index, offset, max_bytes);
                } else {
                    out.log.push(LogRequest::ReadChunk {
                        group: self.id,
                        to,
                        snapshot_index,
                        offset,
                        max_bytes,
                    });
                }
            }
            // Read by the log task, off this worker thread, like chunks.
            Action::LoadEntries {
                to,
                term,
                from,
                through,
                max_bytes,
            } => out.log.push(LogRequest::ReadEntries {
                group: self.id,
                to,
                term,
                from,
                through,
                max_bytes,
            }),
            Action::SaveSnapshotChunk {
                meta,
                offset,
                data,
                done,
            } => {
                if offset == 0 {
                    self.receiving = Some(Receiving { index: meta.index });
                }
                out.log.push(LogRequest::SaveChunk {
                    group: self.id,
                    meta,
                    offset,
                    data,
                    done,
                });
            }
            Action::Compact { through } => out.log.push(LogRequest::Compact {
                group: self.id,
                through,
            }),
            Action::RoleChanged { role, term, leader } => {
                consensus_event!(
                    tracing::Level::INFO,
                    self,
                    ?role,
                    leader = %Hex(leader.unwrap_or(0)),
                    "role changed"
                );
                self.role = role;
                // As etcd counts them: every time a leader becomes known
                // that is not the one known before (none in between).
                if leader.is_some() && leader != self.leader {
                    self.metrics.leader_changes.inc();
                }
                self.leader = leader;
                self.event(GroupEvent::RoleChanged { role, term, leader });
            }
            Action::Removed => {
                consensus_event!(
                    tracing::Level::INFO,
                    self,
                    "this node was removed from the group"
                );
                // Published first: whoever the event wakes sees it.
                self.publish();
                self.event(GroupEvent::Removed);
            }
            Action::Fault(fault) => {
                if let Some(suppressed) = self.fault_warnings.allow() {
                    consensus_event!(tracing::Level::WARN, self, suppressed, "{fault}");
                }
                if !self.halted {
                    if let Some(halt) = self.node.halted() {
                        self.halted = true;
                        let text = halt.to_string();
                        consensus_event!(
                            tracing::Level::ERROR,
                            self,
                            "this node halted the group: {text}"
                        );
                        self.publish();
                        self.event(GroupEvent::Halted(text));
                    }
                }
            }
        }
    }

    fn apply(&mut self, index: Index, term: Term, payload: &EntryPayload) {
        // Anything waiting on an earlier index lost its place (a new leader
        // replaced the entry): it will never apply.
        while let Some(entry) = self.applying.first_entry() {
            if *entry.key() >= index {
                break;
            }
            let (_, waiter) = entry.remove();
            waiter.fail(GroupError::Dropped);
        }
        let waiter = match self.applying.remove(&index) {
            Some((waited_term, waiter)) if waited_term == term => Some(waiter),
            Some((_, waiter)) => {
                waiter.fail(GroupError::Dropped);
                None
            }
            None => None,
        };
        match payload {
            EntryPayload::Command(data) => {
                self.snapshots.log_bytes =
                    self.snapshots.log_bytes.saturating_add(data.len() as u64);
                self.snapshots.log_entries = self.snapshots.log_entries.saturating_add(1);
                if index <= self.skip_through {
                    // A durable machine's state holds it already (from
                    // before a restart, or from a streamed view).
                    if let Some(waiter) = waiter {
                        waiter.fail(GroupError::AppliedWithoutAnswer);
                    }
                    self.applied = index;
                    return;
                }
                let Some(machine) = self.machine.as_mut() else {
                    debug_assert!(false, "applies wait while the machine is away");
                    return;
                };
                let answered = matches!(waiter, Some(Applying::Propose(_)));
                let applied = machine.apply(Command {
                    index,
                    term,
                    data,
                    answered,
                });
                let response = match applied {
                    Ok(response) => response,
                    Err(error) => {
                        if let Some(waiter) = waiter {
                            waiter.fail(self.failure(index, error.reason()));
                        }
                        self.stop_for_machine(index, error);
                        return;
                    }
                };
                match waiter {
                    Some(Applying::Propose(reply)) => drop(reply.send(Ok(response))),
                    Some(Applying::Membership(reply)) => drop(reply.send(Err(GroupError::Dropped))),
                    None => {}
                }
            }
            EntryPayload::Noop | EntryPayload::Config(_) => match waiter {
                Some(Applying::Membership(reply)) => drop(reply.send(Ok(index))),
                Some(Applying::Propose(reply)) => drop(reply.send(Err(GroupError::Dropped))),
                None => {}
            },
        }
        self.applied = index;
    }

    fn respond(&mut self, id: RequestId, result: Result<Response, RequestError>) {
        let Some(waiter) = self.waiting.remove(&id) else {
            return;
        };
        match (waiter, result) {
            (Waiter::Propose(reply), Ok(Response::Proposed { index, term })) => {
                self.applying
                    .insert(index, (term, Applying::Propose(reply)));
            }
            (Waiter::Membership(reply), Ok(Response::Proposed { index, term })) => {
                self.applying
                    .insert(index, (term, Applying::Membership(reply)));
            }
            (Waiter::Query(query, reply), Ok(Response::ReadReady { index })) => {
                self.reads
                    .entry(index)
                    .or_default()
                    .push(PendingRead::Query(query, reply));
                self.answer_reads();
            }
            (Waiter::Barrier(reply), Ok(Response::ReadReady { index })) => {
                self.reads
                    .entry(index)
                    .or_default()
                    .push(PendingRead::Barrier(reply));
                self.answer_reads();
            }
            (Waiter::Transfer(reply), Ok(Response::TransferStarted)) => {
                let _ = reply.send(Ok(()));
            }
            (Waiter::Status(reply), Ok(Response::Status(status))) => {
                let _ = reply.send(Ok(status));
            }
            (Waiter::Campaign(reply), Ok(Response::Campaign(outcome))) => {
                let _ = reply.send(Ok(outcome));
            }
            (waiter, Ok(other)) => waiter.fail(GroupError::Start {
                group: self.id,
                reason: format!("the engine answered {other:?}"),
            }),
            (waiter, Err(error)) => waiter.fail(GroupError::Engine(error)),
        }
    }

    /// Answers the reads whose read index is now applied (unless the
    /// machine is away: then on its return).
    fn answer_reads(&mut self) {
        let Some(machine) = self.machine.as_ref() else {
            return;
        };
        while let Some(entry) = self.reads.first_entry() {
            if *entry.key() > self.applied {
                break;
            }
            for read in entry.remove() {
                match read {
                    PendingRead::Query(query, reply) => drop(reply.send(Ok(machine.query(query)))),
                    PendingRead::Barrier(reply) => drop(reply.send(Ok(self.applied))),
                }
            }
        }
    }

    /// Serves a chunk of a durable machine's state to a follower, from the
    /// transfer streaming to it (a new one, from a new view, at offset 0).
    fn stream_chunk(&mut self, to: NodeId, snapshot_index: Index, offset: u64, max_bytes: u64) {
        let current = self
            .outbound
            .get(&to)
            .is_some_and(|stream| stream.index == snapshot_index);
        if offset == 0 || !current {
            let Some(machine) = self.machine.as_ref() else {
                // Away restoring: the engine asks again after its timeout.
                return;
            };
            let stream = Outbound::start(
                self.id,
                to,
                snapshot_index,
                machine.snapshot(),
                self.workers.clone(),
            );
            self.outbound.insert(to, stream);
        }
        if let Some(stream) = self.outbound.get(&to) {
            stream.request(offset, max_bytes);
        }
    }

    /// Refuses a received snapshot: the leader starts the transfer over.
    fn refuse_snapshot(&mut self, index: Index, offset: u64, reason: &str, out: &mut Outbox) {
        consensus_event!(
            tracing::Level::WARN,
            self,
            snapshot_index = index,
            %reason,
            "a snapshot from the leader does not restore; the leader starts over"
        );
        out.log.push(LogRequest::AbandonReceived { group: self.id });
        self.step(
            Input::SnapshotChunkSaved {
                snapshot_index: index,
                offset,
                ok: false,
            },
            out,
        );
    }

    /// The error of a machine that could not apply `index`.
    fn failure(&self, index: Index, reason: &str) -> GroupError {
        GroupError::MachineFailed {
            group: self.id,
            index,
            reason: reason.to_string(),
        }
    }

    /// The error every request gets once the group stopped for its machine.
    fn machine_failed_error(&self) -> Option<GroupError> {
        self.machine_failed
            .as_ref()
            .map(|(index, reason)| self.failure(*index, reason))
    }

    /// Stops the group on this node because the machine could not apply
    /// the entry at `index`: nothing more is stepped or applied (the entry
    /// stays unapplied, to be applied when the group starts again), every
    /// caller is answered, and the view and the machine are told.
    fn stop_for_machine(&mut self, index: Index, error: ApplyError) {
        let text = machine_failed_text(index, error.reason());
        consensus_event!(tracing::Level::ERROR, self, entry_index = index, "{text}");
        self.machine_failed = Some((index, error.reason().to_string()));
        let (group, reason) = (self.id, error.reason().to_string());
        self.drop_work(|| GroupError::MachineFailed {
            group,
            index,
            reason: reason.clone(),
        });
        self.publish();
        self.event(GroupEvent::Halted(text));
    }

    /// Drops what the group had to do (deferred applies, outbound streams)
    /// and answers every caller waiting on it with `error()`.
    fn drop_work(&mut self, error: impl Fn() -> GroupError) {
        self.deferred.clear();
        self.outbound.clear();
        for (_, waiter) in std::mem::take(&mut self.waiting) {
            waiter.fail(error());
        }
        for (_, (_, waiter)) in std::mem::take(&mut self.applying) {
            waiter.fail(error());
        }
        for (_, reads) in std::mem::take(&mut self.reads) {
            for read in reads {
                match read {
                    PendingRead::Query(_, reply) => drop(reply.send(Err(error()))),
                    PendingRead::Barrier(reply) => drop(reply.send(Err(error()))),
                }
            }
        }
    }

    /// The machine is back from a restore: what waited for it goes on.
    fn machine_returned(&mut self, out: &mut Outbox) {
        if let Some(machine) = self.machine.as_mut() {
            for event in self.deferred_events.drain(..) {
                machine.on_event(&event);
            }
        }
        let deferred = std::mem::take(&mut self.deferred);
        for entry in deferred {
            if entry.index > self.applied {
                self.apply(entry.index, entry.term, &entry.payload);
                if self.machine_failed.is_some() {
                    return;
                }
            }
        }
        self.answer_reads();
        self.maybe_snapshot(out);
    }

    /// Takes a snapshot when the policy says one is due. Taking the view is
    /// cheap; writing it runs on a blocking thread of the log task.
    fn maybe_snapshot(&mut self, out: &mut Outbox) {
        if self.machine_failed.is_some() {
            return;
        }
        let s = &self.snapshots;
        let Some(machine) = self.machine.as_ref() else {
            return;
        };
        if s.building.is_some()
            || self.applied <= s.index
            || self.ticks < s.retry_at_tick
            || !self.policy.due(s.log_entries, s.log_bytes, s.bytes)
        {
            return;
        }
        // A durable machine's log is compacted only behind what it made
        // durable.
        let index = if self.durable {
            machine.durable_index().min(self.applied)
        } else {
            self.applied
        };
        if index <= s.index {
            return;
        }
        let Some(term) = self.node.term_at(index) else {
            return;
        };
        let meta = ferry_raft::SnapshotMeta {
            index,
            term,
            config: self.node.config().clone(),
        };
        self.snapshots.building =
            Some((index, self.snapshots.log_bytes, self.snapshots.log_entries));
        // A durable machine's state is on disk already: the snapshot file
        // only marks how far the log may be compacted (it holds no state).
        let source = if self.durable {
            Box::new(BytesSnapshot(Bytes::new()))
        } else {
            machine.snapshot()
        };
        out.log.push(LogRequest::TakeSnapshot {
            group: self.id,
            meta,
            source,
        });
    }
}

/// How a group stopped for its machine is described (view, event, log).
fn machine_failed_text(index: Index, reason: &str) -> String {
    format!(
        "the state machine could not apply entry {index} ({reason}): the group is stopped on \
         this node until it is started again"
    )
}

impl<M: StateMachine> GroupRun for Group<M> {
    fn message(&mut self, message: Message, _out: &mut Outbox) {
        self.enqueue(Input::Message(message));
    }

    fn peer(&mut self, peer: NodeId, up: bool, out: &mut Outbox) {
        let input = if up {
            Input::PeerConnected(peer)
        } else {
            Input::PeerDisconnected(peer)
        };
        self.step(input, out);
    }

    fn call(&mut self, call: Box<dyn Any + Send>, out: &mut Outbox) {
        let Ok(call) = call.downcast::<Call<M>>() else {
            // The reply sender inside is dropped: the caller sees an error.
            tracing::error!(group = self.id, "a call for another kind of machine");
            return;
        };
        match *call {
            Call::Propose { command, reply } => {
                self.request(Request::Propose(command), Waiter::Propose(reply))
            }
            Call::Query {
                query,
                consistency,
                reply,
            } => self.request(Request::Read(consistency), Waiter::Query(query, reply)),
            Call::Barrier { consistency, reply } => {
                self.request(Request::Read(consistency), Waiter::Barrier(reply))
            }
            Call::ChangeMembership { change, reply } => {
                self.request(Request::ChangeMembership(change), Waiter::Membership(reply))
            }
            Call::TransferLeadership { to, reply } => {
                self.request(Request::TransferLeadership(to), Waiter::Transfer(reply))
            }
            Call::Status { reply } => self.request(Request::Status, Waiter::Status(reply)),
            Call::Campaign { reply } => self.request(Request::Campaign, Waiter::Campaign(reply)),
            Call::Progress { reply } => {
                self.flush_batch(out);
                let match_index = self
                    .node
                    .peer_progress()
                    .map(|peers| {
                        peers
                            .iter()
                            .map(|(peer, progress)| (*peer, progress.match_index))
                            .collect()
                    })
                    .unwrap_or_default();
                let _ = reply.send(Ok(GroupProgress {
                    role: self.role,
                    last_index: self.node.last_index(),
                    engine_requests: self.node.pending_request_count(),
                    callers_waiting: self.waiting.len()
                        + self.applying.len()
                        + self.reads.values().map(Vec::len).sum::<usize>(),
                    match_index,
                }));
            }
        }
    }

    fn tick(&mut self, out: &mut Outbox) {
        self.flush_batch(out);
        self.ticks += 1;
        let was_quiescent = self.node.is_quiescent();
        let actions = self.step_unpublished(Input::Tick, out);
        // A quiescent tick only moves the engine's clock: nothing the view
        // shows changes, and publishing it anyway was most of what 10,000
        // idle groups cost a node.
        if !(was_quiescent && actions == 0 && self.node.is_quiescent()) {
            self.publish();
        }
        if self.receiving.is_some() && !self.node.is_receiving_snapshot() {
            // The engine gave up on the transfer: its file is not
            // restored from, even if its last chunk is still being saved.
            self.receiving = None;
        }
        if self.snapshots.retry_at_tick == self.ticks {
            self.maybe_snapshot(out);
        }
    }

    fn complete(&mut self, completion: Completion, out: &mut Outbox) {
        match completion {
            Completion::Persisted { seq } => self.enqueue(Input::Persisted { seq }),
            Completion::ChunkLoaded {
                to,
                snapshot_index,
                offset,
                chunk,
            } => self.step(
                Input::SnapshotChunkLoaded {
                    to,
                    snapshot_index,
                    offset,
                    chunk,
                },
                out,
            ),
            Completion::EntriesLoaded {
                to,
                term,
                from,
                entries,
            } => self.step(
                Input::EntriesLoaded {
                    to,
                    term,
                    from,
                    entries,
                },
                out,
            ),
            Completion::ChunkSaved {
                index,
                offset,
                ok,
                last,
                received,
            } => {
                if !ok || !last {
                    if !ok {
                        self.receiving = None;
                    }
                    self.step(
                        Input::SnapshotChunkSaved {
                            snapshot_index: index,
                            offset,
                            ok,
                        },
                        out,
                    );
                    return;
                }
                // The whole snapshot is on disk: restore the machine from
                // it on a blocking thread, then install it (which resets
                // the log).
                let expected = self.receiving.take().filter(|r| r.index == index);
                match (expected.and(received), self.machine.take()) {
                    (Some(mut reader), Some(mut machine)) => {
                        let workers = self.workers.clone();
                        let group = self.id;
                        tokio::task::spawn_blocking(move || {
                            let bytes = reader.data_bytes();
                            let outcome = machine
                                .restore(&mut reader)
                                .map(|()| bytes)
                                .map_err(|e| e.to_string());
                            workers.complete(
                                group,
                                Completion::Restored {
                                    machine: Box::new(machine),
                                    outcome,
                                    index,
                                    offset,
                                },
                            );
                        });
                    }
                    (reader, machine) => {
                        self.machine = self.machine.take().or(machine);
                        let reason = if reader.is_none() {
                            "the transfer was given up"
                        } else {
                            "another restore is in flight"
                        };
                        self.refuse_snapshot(index, offset, reason, out);
                    }
                }
            }
            Completion::Restored {
                machine,
                outcome,
                index,
                offset,
            } => {
                let Ok(machine) = machine.downcast::<M>() else {
                    debug_assert!(false, "a restored machine of another type");
                    return;
                };
                self.machine = Some(*machine);
                match outcome {
                    Ok(bytes) => {
                        if self.durable {
                            if let Some(machine) = self.machine.as_ref() {
                                self.skip_through = machine.applied_index();
                            }
                        }
                        self.snapshots.bytes = bytes;
                        self.installing = true;
                        out.log.push(LogRequest::InstallReceived {
                            group: self.id,
                            offset,
                        });
                    }
                    Err(reason) => {
                        self.machine_returned(out);
                        self.refuse_snapshot(index, offset, &reason, out);
                    }
                }
            }
            Completion::Installed { index, offset } => {
                // Whatever waited on an entry the snapshot covers will hear
                // no more of it here.
                while let Some(entry) = self.applying.first_entry() {
                    if *entry.key() > index {
                        break;
                    }
                    entry.remove().1.fail(GroupError::Dropped);
                }
                consensus_event!(
                    tracing::Level::INFO,
                    self,
                    snapshot_index = index,
                    bytes = self.snapshots.bytes,
                    "installed a snapshot from the leader"
                );
                self.metrics.snapshots_received.inc();
                self.applied = index;
                self.snapshots.index = index;
                self.snapshots.log_bytes = 0;
                self.snapshots.log_entries = 0;
                self.snapshots.building = None;
                // Entries deferred while the machine was away that the
                // snapshot covers are in it.
                self.deferred.retain(|entry| entry.index > index);
                self.installing = false;
                self.step(
                    Input::SnapshotChunkSaved {
                        snapshot_index: index,
                        offset,
                        ok: true,
                    },
                    out,
                );
                self.machine_returned(out);
            }
            Completion::SnapshotTaken { index, bytes } => {
                let (bytes_at_start, entries_at_start) = match self.snapshots.building.take() {
                    Some((building, bytes, entries)) if building == index => (bytes, entries),
                    _ => (0, 0),
                };
                if index <= self.snapshots.index {
                    // A snapshot from the leader was installed meanwhile.
                    return;
                }
                self.snapshots.index = index;
                self.snapshots.bytes = bytes;
                self.snapshots.log_bytes = self.snapshots.log_bytes.saturating_sub(bytes_at_start);
                self.snapshots.log_entries =
                    self.snapshots.log_entries.saturating_sub(entries_at_start);
                self.step(Input::SnapshotBuilt { index }, out);
                self.maybe_snapshot(out);
            }
            Completion::SnapshotFailed { index, error } => {
                tracing::warn!(group = self.id, index, %error, "cannot take a snapshot for now; the log keeps every entry meanwhile");
                self.snapshots.building = None;
                self.snapshots.retry_at_tick = self.ticks + SNAPSHOT_RETRY_TICKS;
            }
        }
    }

    fn flush(&mut self, out: &mut Outbox) {
        self.flush_batch(out);
    }

    fn stop(&mut self) {
        let group = self.id;
        // Inputs not stepped yet go with the engine; their callers are
        // answered below.
        self.batch.clear();
        self.drop_work(|| GroupError::NotRunning { group });
    }
}
