//! The Raft node: one member of one group. This module holds the node's
//! state, starts it, dispatches inputs by kind and role, and turns what the
//! handlers decided into actions (persist, apply, role changes) at the end of
//! every step. The handlers live beside it: `election`, `leader`,
//! `follower`, `client`.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::fault::{check_message, Fault, TERM_MAX};
use crate::io::{Action, Input, PersistRequest};
use crate::log::RaftLog;
use crate::membership::Configuration;
use crate::message::{Message, MessageBody};
use crate::options::Options;
use crate::progress::Progress;
use crate::request::{ForwardedRequest, Request, RequestError, RequestId, Response, Role, Status};
use crate::types::{Entry, HardState, Index, NodeId, RestoredState, SnapshotMeta, Term};

/// Why a node could not start from the state it was given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InitError {
    /// The restored state contradicts itself.
    #[error("restored state is inconsistent: {0}")]
    Inconsistent(String),
    /// The options are out of range.
    #[error("invalid options: {0}")]
    InvalidOptions(String),
}

/// The most outgoing messages held back waiting for a sync. When full the
/// oldest is shed: every held message is a response (vote, append or
/// heartbeat answer) that its sender regenerates by timer.
pub(crate) const HELD_MESSAGES_MAX: usize = 4096;

/// The role-specific state.
#[derive(Debug)]
pub(crate) enum RoleState {
    Follower,
    PreCandidate(Campaign),
    Candidate(Campaign),
    Leader(Box<LeaderState>),
}

/// A (pre-)candidate's election.
#[derive(Debug, Default)]
pub(crate) struct Campaign {
    /// The answers received so far.
    pub votes: BTreeMap<NodeId, bool>,
    /// The persist request that makes the own vote durable (0 for pre-vote).
    pub self_vote_seq: u64,
    /// Campaigning because the leader asked (leadership transfer).
    pub transfer: bool,
}

/// Where a read being confirmed by the leader came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadOrigin {
    /// A client of this node.
    Local(RequestId),
    /// A client of a follower, forwarded as ReadIndex.
    Remote { from: NodeId, id: RequestId },
}

/// A ReadIndex request waiting for its heartbeat round to be confirmed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PendingRead {
    pub origin: ReadOrigin,
    pub index: Index,
    pub round: u64,
    pub deadline_tick: u64,
}

/// A leadership transfer under way.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Transfer {
    pub target: NodeId,
    pub elapsed_ticks: u32,
    pub timeout_now_sent: bool,
}

/// The most heartbeat rounds remembered for lease accounting.
pub(crate) const ROUNDS_REMEMBERED_MAX: usize = 256;

/// A leader's state.
#[derive(Debug)]
pub(crate) struct LeaderState {
    pub progress: BTreeMap<NodeId, Progress>,
    pub transfer: Option<Transfer>,
    /// Heartbeat rounds: (round, tick sent), newest last, bounded.
    pub rounds: VecDeque<(u64, u64)>,
    pub round: u64,
    /// A round started since the last message arrived: reads may share it.
    pub fresh_round: Option<u64>,
    pub pending_reads: VecDeque<PendingRead>,
    /// Reads waiting for the leader's first entry of its term to commit.
    pub reads_awaiting_noop: Vec<(ReadOrigin, u64)>,
    pub check_quorum_elapsed: u32,
    /// Heartbeat rounds sent before this tick do not count for the lease.
    pub lease_not_before_tick: u64,
    /// New entries appended since the last broadcast.
    pub unsent_entries: bool,
    /// Former members still replicated to for a while, so that they learn
    /// the commit that removed them: peer -> ticks left.
    pub retiring: BTreeMap<NodeId, u32>,
    /// (Quiescence.) Ticks in a row at which the group was idle, with no
    /// client request or new entry since: the leader goes quiet once this
    /// reaches a heartbeat interval.
    pub idle_ticks: u32,
    /// (Quiescence.) The leader woke: the flush at the end of the step
    /// sends a heartbeat round, so that every member hears from it at once.
    pub wake_heartbeat_due: bool,
}

/// A follower's snapshot being received.
#[derive(Clone, Debug)]
pub(crate) struct Receiving {
    pub meta: SnapshotMeta,
    /// The leader sending it, and its term: a transfer is one leader's
    /// sending of one snapshot in one term.
    pub from: NodeId,
    pub term: Term,
    /// Every byte before this offset is saved.
    pub next_offset: u64,
    /// A chunk being saved: (offset, length, last).
    pub saving: Option<(u64, u64, bool)>,
    /// Chunks received while one is being saved, contiguous after it, in
    /// order: (offset, data, last). Bounded by the inflight window.
    pub queued: VecDeque<(u64, Bytes, bool)>,
    pub queued_bytes: u64,
    pub idle_ticks: u32,
}

impl Receiving {
    /// The offset just after the chunk being saved and those queued behind
    /// it: where the next new chunk must start.
    pub fn expected_offset(&self) -> u64 {
        match self.queued.back() {
            Some((offset, data, _)) => offset.saturating_add(data.len() as u64),
            None => match self.saving {
                Some((offset, length, _)) => offset.saturating_add(length),
                None => self.next_offset,
            },
        }
    }
}

/// A request waiting on this node.
#[derive(Clone, Debug)]
pub(crate) struct HeldRequest {
    pub id: RequestId,
    pub request: Request,
    pub deadline_tick: u64,
}

/// A forwarded request executed by this node as leader: the request, its
/// outcome, and the tick after which it is forgotten.
pub(crate) type ExecutedForward = (ForwardedRequest, Result<Response, RequestError>, u64);

/// Client requests waiting on this node, every queue bounded together by
/// `pending_requests_max`.
#[derive(Debug, Default)]
pub(crate) struct PendingRequests {
    /// Waiting for a leader to become known.
    pub awaiting_leader: VecDeque<HeldRequest>,
    /// Forwarded to the leader, waiting for its answer: (request, deadline).
    pub forwarded: BTreeMap<RequestId, HeldRequest>,
    /// Reads waiting until `applied >= index`: (id, index, deadline).
    pub awaiting_apply: Vec<(RequestId, Index, u64)>,
    /// Forwarded requests this node executed as leader, remembered for a
    /// while so that a duplicated `Forward` is answered with the first
    /// outcome instead of being executed twice: (from, id) -> (request,
    /// outcome, forget at tick). Bounded by `EXECUTED_FORWARDS_MAX`.
    pub executed_forwards: BTreeMap<(NodeId, RequestId), ExecutedForward>,
    /// The keys of `executed_forwards`, oldest first.
    pub executed_order: VecDeque<(NodeId, RequestId)>,
    /// Linearizable reads of a follower that share the `Forward` of an
    /// earlier read of the same step (see [`ReadRiders`]).
    pub read_riders: ReadRiders,
}

impl PendingRequests {
    pub fn len(&self) -> usize {
        self.awaiting_leader.len()
            + self.forwarded.len()
            + self.awaiting_apply.len()
            + self.read_riders.len()
    }
}

/// Linearizable reads that share one forwarded ReadIndex. The first read a
/// follower routes to the leader in a step is forwarded (the carrier); the
/// next ones of the same step ride on it and take its answer, instead of
/// each costing a `Forward` and a `ForwardResponse`.
///
/// Only reads of the same step may ride: the leader fixes the read index
/// when the carrier's `Forward` reaches it, so a read that shares it must
/// have arrived before the `Forward` left, and a step's messages leave
/// after the step. `flush` closes the carrier at the end of every step.
#[derive(Debug, Default)]
pub(crate) struct ReadRiders {
    /// The carrier forwarded in this step, and the leader it went to.
    open: Option<(NodeId, RequestId)>,
    /// The riders of each carrier still waiting for its answer.
    by_carrier: BTreeMap<RequestId, Vec<HeldRequest>>,
    /// Riders in `by_carrier`, all carriers together.
    count: usize,
}

impl ReadRiders {
    /// Riders waiting.
    pub fn len(&self) -> usize {
        self.count
    }

    /// The carrier a read routed to `leader` in this step may ride on.
    pub fn open_carrier(&self, leader: NodeId) -> Option<RequestId> {
        self.open
            .and_then(|(to, carrier)| (to == leader).then_some(carrier))
    }

    /// `carrier` was just forwarded to `leader`: later reads of this step
    /// may ride on it.
    pub fn open(&mut self, leader: NodeId, carrier: RequestId) {
        self.open = Some((leader, carrier));
    }

    /// The step ends (its messages leave): no more riders for its carrier.
    pub fn close(&mut self) {
        self.open = None;
    }

    /// Adds `read` to the riders of `carrier`.
    pub fn ride(&mut self, carrier: RequestId, read: HeldRequest) {
        debug_assert!(matches!(read.request, Request::Read(_)), "only reads ride");
        self.by_carrier.entry(carrier).or_default().push(read);
        self.count += 1;
    }

    /// The riders of `carrier`, which got its answer (or lost its id).
    pub fn take(&mut self, carrier: RequestId) -> Vec<HeldRequest> {
        if self.open.is_some_and(|(_, open)| open == carrier) {
            self.open = None;
        }
        let riders = self.by_carrier.remove(&carrier).unwrap_or_default();
        self.count -= riders.len();
        riders
    }

    /// Removes the riders whose deadline is at or before `now`; returns
    /// their ids.
    pub fn expire(&mut self, now: u64) -> Vec<RequestId> {
        let mut expired = Vec::new();
        self.by_carrier.retain(|_, riders| {
            riders.retain(|read| {
                let keep = read.deadline_tick > now;
                if !keep {
                    expired.push(read.id);
                }
                keep
            });
            !riders.is_empty()
        });
        self.count -= expired.len();
        expired
    }
}

/// One member of one Raft group.
#[derive(Debug)]
pub struct RaftNode {
    pub(crate) options: Options,
    pub(crate) rng: ChaCha8Rng,
    pub(crate) now_tick: u64,
    pub(crate) role: RoleState,
    pub(crate) term: Term,
    pub(crate) vote: Option<NodeId>,
    pub(crate) leader: Option<NodeId>,
    pub(crate) log: RaftLog,
    pub(crate) commit: Index,
    pub(crate) applied: Index,
    /// The configuration in force (the last committed one).
    pub(crate) config: Configuration,
    pub(crate) was_member: bool,
    pub(crate) removed: bool,
    /// Set when the node detected that its log contradicts the group's: it
    /// then takes no input but ticks, status requests and refusals.
    pub(crate) halted: Option<Fault>,
    /// (Follower.) The last index known to match the current leader's log:
    /// what an append of this leader in this term was accepted through. A
    /// heartbeat's commit index is taken only up to here, so that a log
    /// that went backwards (or diverged) since it was acknowledged never
    /// has entries applied on a leader's word alone.
    pub(crate) leader_verified_index: Index,
    pub(crate) election_elapsed: u32,
    pub(crate) randomized_election_timeout: u32,
    pub(crate) heartbeat_elapsed: u32,
    pub(crate) next_seq: u64,
    pub(crate) persisted_seq: u64,
    /// Term and vote as last handed to storage.
    pub(crate) stored_term_vote: (Term, Option<NodeId>),
    /// Persist requests not yet durable: (seq, last index written, its term).
    pub(crate) inflight_persists: VecDeque<(u64, Index, Term)>,
    /// Messages waiting for a persist: (seq needed, message).
    pub(crate) held_messages: VecDeque<(u64, Message)>,
    pub(crate) receiving: Option<Receiving>,
    pub(crate) requests: PendingRequests,
    pub(crate) reported_role: Option<(Role, Term, Option<NodeId>)>,
    /// The quiescent sub-state (see the crate docs, "Quiescence"): a leader
    /// sends no heartbeats and counts no check-quorum, a follower runs no
    /// election timer. Only ever set with `options.quiesce` on.
    pub(crate) quiescent: bool,
    /// (Follower.) It woke for a reason other than its leader: the leader it
    /// followed then, and where this step's actions stood. The flush sends
    /// that leader a `WakeUp` unless the step sent it something anyway.
    pub(crate) wake_leader: Option<(NodeId, usize)>,
}

impl RaftNode {
    /// Starts a node from what its storage holds. `seed` drives the
    /// randomized election timeouts.
    pub fn new(options: Options, restored: RestoredState, seed: u64) -> Result<Self, InitError> {
        validate_options(&options)?;
        let RestoredState {
            hard_state,
            snapshot,
            entries,
            outline,
            applied,
        } = restored;
        if applied < snapshot.index {
            return Err(InitError::Inconsistent(format!(
                "applied index {applied} is below the snapshot index {}",
                snapshot.index
            )));
        }
        let log = RaftLog::restore(snapshot, entries, outline).map_err(InitError::Inconsistent)?;
        if applied > log.last_index() {
            return Err(InitError::Inconsistent(format!(
                "applied index {applied} is beyond the last log index {}",
                log.last_index()
            )));
        }
        if log.held_first_index() > applied + 1 {
            // Entries after the applied index are applied again on start,
            // so their bodies must be at hand.
            return Err(InitError::Inconsistent(format!(
                "the restored entries start at {} but the state machine has applied only {applied}",
                log.held_first_index()
            )));
        }
        let last_term = log.last_term();
        if last_term > hard_state.term {
            return Err(InitError::Inconsistent(format!(
                "the log holds an entry of term {last_term} but the stored term is {}",
                hard_state.term
            )));
        }
        // The stored commit only speeds up restart: never past the log, never
        // below what the state machine applied (which was committed).
        let commit = hard_state.commit.min(log.last_index()).max(applied);
        let config = log.config_at(commit);
        let id = options.id;
        let mut node = RaftNode {
            rng: ChaCha8Rng::seed_from_u64(seed),
            now_tick: 0,
            role: RoleState::Follower,
            term: hard_state.term,
            vote: hard_state.vote,
            leader: None,
            commit,
            applied,
            was_member: config.contains(id),
            config,
            removed: false,
            halted: None,
            leader_verified_index: 0,
            election_elapsed: 0,
            randomized_election_timeout: options.election_timeout_ticks,
            heartbeat_elapsed: 0,
            next_seq: 1,
            persisted_seq: 0,
            stored_term_vote: (hard_state.term, hard_state.vote),
            inflight_persists: VecDeque::new(),
            held_messages: VecDeque::new(),
            receiving: None,
            requests: PendingRequests::default(),
            reported_role: None,
            quiescent: false,
            wake_leader: None,
            log,
            options,
        };
        node.reset_election_timeout();
        Ok(node)
    }

    /// Feeds one input; appends the resulting actions to `actions`.
    pub fn step(&mut self, input: Input, actions: &mut Vec<Action>) {
        if self.quiescent && matches!(input, Input::Tick) {
            // A quiescent tick only keeps time: there is nothing to flush,
            // and a host with thousands of idle groups ticks every one.
            self.now_tick += 1;
            return;
        }
        self.handle(input, actions);
        self.flush(actions);
    }

    /// Feeds several inputs and flushes once at the end, so that proposals
    /// arriving together share one persist request and one append per
    /// follower (batching). Equivalent to calling [`RaftNode::step`] for each
    /// input except for how the resulting work is grouped.
    pub fn step_batch(
        &mut self,
        inputs: impl IntoIterator<Item = Input>,
        actions: &mut Vec<Action>,
    ) {
        for input in inputs {
            self.handle(input, actions);
        }
        self.flush(actions);
    }

    fn handle(&mut self, input: Input, actions: &mut Vec<Action>) {
        if self.halted.is_some() {
            self.handle_halted(input, actions);
            return;
        }
        match input {
            // A quiescent node has no timer running and nothing waiting on
            // a deadline: it only keeps time.
            Input::Tick if self.quiescent => self.now_tick += 1,
            Input::Tick => self.tick(actions),
            Input::Message(message) => self.handle_message(message, actions),
            Input::Client { id, request } => {
                if self.request_wakes(&request) {
                    self.wake(true, actions);
                    self.note_leader_activity();
                }
                let deadline = self.now_tick + u64::from(self.options.request_timeout_ticks);
                self.handle_client(id, request, deadline, actions);
            }
            Input::Persisted { seq } => self.handle_persisted(seq, actions),
            Input::SnapshotBuilt { index } => self.handle_snapshot_built(index, actions),
            Input::SnapshotChunkLoaded {
                to,
                snapshot_index,
                offset,
                chunk,
            } => self.handle_chunk_loaded(to, snapshot_index, offset, chunk, actions),
            Input::SnapshotChunkSaved {
                snapshot_index,
                offset,
                ok,
            } => self.handle_chunk_saved(snapshot_index, offset, ok, actions),
            Input::EntriesLoaded {
                to,
                term,
                from,
                entries,
            } => self.handle_entries_loaded(to, term, from, entries, actions),
            Input::PeerConnected(peer) => self.handle_peer_connected(peer, actions),
            Input::PeerDisconnected(peer) => self.handle_peer_disconnected(peer, actions),
        }
    }

    /// A halted node keeps time (so that held requests still meet their
    /// deadlines), answers status and refuses everything else; peer
    /// messages and storage completions change nothing.
    fn handle_halted(&mut self, input: Input, actions: &mut Vec<Action>) {
        match input {
            Input::Tick => {
                self.now_tick += 1;
                self.expire_requests(actions);
            }
            Input::Client { id, request } => {
                let result = match request {
                    Request::Status => Ok(Response::Status(self.status())),
                    Request::Propose(_)
                    | Request::Read(_)
                    | Request::ChangeMembership(_)
                    | Request::TransferLeadership(_)
                    | Request::Campaign => Err(self.halted_error()),
                };
                actions.push(Action::Respond { id, result });
            }
            Input::Message(_)
            | Input::Persisted { .. }
            | Input::SnapshotBuilt { .. }
            | Input::SnapshotChunkLoaded { .. }
            | Input::SnapshotChunkSaved { .. }
            | Input::EntriesLoaded { .. }
            | Input::PeerConnected(_)
            | Input::PeerDisconnected(_) => {}
        }
    }

    pub(crate) fn halted_error(&self) -> RequestError {
        RequestError::Halted {
            reason: self
                .halted
                .as_ref()
                .map_or_else(String::new, ToString::to_string),
        }
    }

    /// Halts the group on this node after `fault` (see
    /// [`Fault::LogConflict`]): nothing more is accepted or applied, and
    /// requests waiting here fail.
    pub(crate) fn halt(&mut self, fault: Fault, actions: &mut Vec<Action>) {
        if self.halted.is_some() {
            return;
        }
        actions.push(Action::Fault(fault.clone()));
        self.halted = Some(fault);
        self.quiescent = false;
        if !matches!(self.role, RoleState::Follower) || self.leader.is_some() {
            self.become_follower(self.term, None, actions);
        }
        self.fail_all_requests_halted(actions);
    }

    fn tick(&mut self, actions: &mut Vec<Action>) {
        self.now_tick += 1;
        self.expire_requests(actions);
        self.tick_receiving(actions);
        match &self.role {
            RoleState::Leader(_) => self.tick_leader(actions),
            RoleState::Follower | RoleState::PreCandidate(_) | RoleState::Candidate(_) => {
                self.election_elapsed = self.election_elapsed.saturating_add(1);
                if self.election_elapsed >= self.randomized_election_timeout {
                    self.election_elapsed = 0;
                    self.reset_election_timeout();
                    if self.term >= TERM_MAX {
                        let term = self.term;
                        actions.push(Action::Fault(Fault::TermExhausted { term }));
                    }
                    if self.can_campaign() {
                        self.campaign(false, actions);
                    } else {
                        self.ask_for_heartbeats(actions);
                    }
                }
            }
        }
    }

    /// Term handling common to every message, then dispatch by kind.
    fn handle_message(&mut self, message: Message, actions: &mut Vec<Action>) {
        if let Err(fault) = check_message(&message) {
            // Beyond what any correct peer sends: refused unread.
            actions.push(Action::Fault(fault));
            return;
        }
        if message.group != self.options.group
            || message.to != self.options.id
            || message.from == self.options.id
        {
            // Misrouted: not for this node of this group. The runtime routes
            // by (group, to); nothing here could answer it meaningfully.
            return;
        }
        if self.quiescent && self.is_late_answer_of_a_caught_up_member(&message) {
            // Says nothing the quiet group lacks, needs nothing: dropped
            // without waking (see `quiesce.rs`).
            return;
        }
        if self.quiescent
            && !matches!(message.body, MessageBody::Quiesce { .. })
            && !self.is_nothing_new_from_the_leader(&message)
        {
            // Any message but the notice wakes the node. A follower tells its
            // leader too unless the leader itself is the sender (then it is
            // awake already).
            let from_leader = self.leader == Some(message.from) && message.term == self.term;
            self.wake(!from_leader, actions);
        }
        if let RoleState::Leader(leader) = &mut self.role {
            leader.fresh_round = None;
        }
        let from = message.from;
        if let MessageBody::RequestVote {
            last_log_index,
            last_log_term,
            ..
        } = &message.body
        {
            let candidate_is_ahead =
                (*last_log_term, *last_log_index) > (self.log.last_term(), self.log.last_index());
            if !self.knows_voter(from) && !candidate_is_ahead {
                // Not a voter in any configuration this node knows, and its
                // log is no newer than ours, so it knows no configuration we
                // lack: most likely a removed member that never learned of
                // its removal. Its campaign must not raise our term (it would
                // depose a healthy leader again and again when pre-vote and
                // check-quorum are off). A candidate whose log is ahead of
                // ours may be a voter of a configuration we have not seen
                // yet (we are lagging, or joining and know none), and its
                // election may need our vote: it is heard normally.
                return;
            }
        }
        if message.term > self.term {
            match &message.body {
                MessageBody::RequestVote { pre_vote: true, .. } => {}
                MessageBody::RequestVoteResponse {
                    pre_vote: true,
                    granted: true,
                    ..
                } => {}
                MessageBody::RequestVote {
                    pre_vote: false,
                    transfer,
                    ..
                } if self.in_leader_lease() && !transfer => {
                    // We heard from a leader within the election timeout
                    // (see in_leader_lease). Ignoring is safe; the
                    // candidate's timer retries.
                    return;
                }
                MessageBody::Append { .. }
                | MessageBody::Heartbeat { .. }
                | MessageBody::SnapshotChunk { .. }
                | MessageBody::Quiesce { .. } => {
                    self.become_follower(message.term, Some(from), actions);
                }
                MessageBody::RequestVote { .. }
                | MessageBody::RequestVoteResponse { .. }
                | MessageBody::AppendResponse(_)
                | MessageBody::HeartbeatResponse { .. }
                | MessageBody::SnapshotChunkAck { .. }
                | MessageBody::SnapshotResponse { .. }
                | MessageBody::TimeoutNow
                | MessageBody::WakeUp
                | MessageBody::Forward { .. }
                | MessageBody::ForwardResponse { .. } => {
                    self.become_follower(message.term, None, actions);
                }
            }
        } else if message.term < self.term {
            match &message.body {
                MessageBody::Append { .. }
                | MessageBody::Heartbeat { .. }
                | MessageBody::SnapshotChunk { .. }
                | MessageBody::Quiesce { .. } => {
                    // A stale leader: tell it our term so it steps down.
                    let body = MessageBody::HeartbeatResponse {
                        read_seq: 0,
                        last_index: self.log.last_index(),
                        needs_append: false,
                    };
                    self.send(from, body, actions);
                    return;
                }
                MessageBody::RequestVote { pre_vote, .. } => {
                    let refusal = self.vote_response(*pre_vote, false);
                    self.send(from, refusal, actions);
                    return;
                }
                MessageBody::RequestVoteResponse { .. }
                | MessageBody::AppendResponse(_)
                | MessageBody::HeartbeatResponse { .. }
                | MessageBody::SnapshotChunkAck { .. }
                | MessageBody::SnapshotResponse { .. }
                | MessageBody::TimeoutNow
                | MessageBody::WakeUp => {
                    // Answers to (or orders from) an older term: their sender
                    // has moved on; timers regenerate whatever is still needed.
                    return;
                }
                // Client traffic is not Raft state: handled whatever its
                // term (a leader refuses to execute a write forwarded in an
                // older term: see `handle_forward`).
                MessageBody::Forward { .. } | MessageBody::ForwardResponse { .. } => {}
            }
        }
        let term = message.term;
        match message.body {
            MessageBody::RequestVote {
                pre_vote,
                last_log_index,
                last_log_term,
                transfer,
            } => self.handle_request_vote(
                from,
                term,
                pre_vote,
                last_log_index,
                last_log_term,
                transfer,
                actions,
            ),
            MessageBody::RequestVoteResponse {
                pre_vote,
                granted,
                commit,
                commit_term,
            } => self.handle_vote_response(
                from,
                term,
                pre_vote,
                granted,
                (commit, commit_term),
                actions,
            ),
            MessageBody::Append {
                prev_log_index,
                prev_log_term,
                entries,
                leader_commit,
            } => {
                if self.accept_leader_message(from, actions) {
                    self.handle_append(
                        from,
                        prev_log_index,
                        prev_log_term,
                        entries,
                        leader_commit,
                        actions,
                    );
                }
            }
            MessageBody::AppendResponse(result) => {
                self.handle_append_response(from, result, actions)
            }
            MessageBody::Heartbeat {
                leader_commit,
                read_seq,
            } => {
                if self.accept_leader_message(from, actions) {
                    self.handle_heartbeat(from, leader_commit, read_seq, actions);
                }
            }
            MessageBody::HeartbeatResponse {
                read_seq,
                last_index,
                needs_append,
            } => self.handle_heartbeat_response(from, read_seq, last_index, needs_append, actions),
            MessageBody::SnapshotChunk {
                meta,
                offset,
                data,
                done,
            } => {
                if self.accept_leader_message(from, actions) {
                    self.handle_snapshot_chunk(from, meta, offset, data, done, actions);
                }
            }
            MessageBody::SnapshotChunkAck {
                snapshot_index,
                next_offset,
            } => self.handle_chunk_ack(from, snapshot_index, next_offset, actions),
            MessageBody::SnapshotResponse {
                snapshot_index,
                outcome,
            } => self.handle_snapshot_response(from, snapshot_index, outcome, actions),
            MessageBody::TimeoutNow => self.handle_timeout_now(from, actions),
            MessageBody::Quiesce {
                last_index,
                last_term,
                commit,
            } => {
                if self.accept_leader_message(from, actions) {
                    self.handle_quiesce(from, (last_index, last_term), commit, actions);
                }
            }
            MessageBody::WakeUp => self.handle_wake_up(from, actions),
            MessageBody::Forward { id, request } => {
                self.handle_forward(from, term, id, request, actions)
            }
            MessageBody::ForwardResponse { id, result } => {
                self.handle_forward_response(from, id, result, actions)
            }
        }
    }

    /// A message only a leader of the current term sends arrived: follow
    /// that leader (seed 002: whatever message comes first makes the node
    /// follow, without a new election). Returns false if this node is itself
    /// the leader of this term (impossible in Raft; the message is ignored).
    fn accept_leader_message(&mut self, from: NodeId, actions: &mut Vec<Action>) -> bool {
        match &self.role {
            RoleState::Leader(_) => false,
            RoleState::PreCandidate(_) | RoleState::Candidate(_) => {
                self.become_follower(self.term, Some(from), actions);
                true
            }
            RoleState::Follower => {
                if self.leader != Some(from) {
                    self.leader = Some(from);
                    self.on_leader_known(actions);
                }
                self.election_elapsed = 0;
                true
            }
        }
    }

    fn handle_persisted(&mut self, seq: u64, actions: &mut Vec<Action>) {
        // A completion for a request not yet issued is a runtime error; never
        // trust it beyond what was issued.
        let seq = seq.min(self.next_seq - 1);
        if seq <= self.persisted_seq {
            return;
        }
        self.persisted_seq = seq;
        while let Some(&(s, index, term)) = self.inflight_persists.front() {
            if s > seq {
                break;
            }
            self.inflight_persists.pop_front();
            self.log.mark_durable(index, term);
        }
        while let Some((needed, _)) = self.held_messages.front() {
            if *needed > seq {
                break;
            }
            if let Some((_, message)) = self.held_messages.pop_front() {
                // An answer decided in an older term is not sent: since then
                // this node may have voted in a newer term or truncated the
                // entries it would acknowledge. Its receiver (a leader or
                // candidate of that older term) has timers that regenerate
                // whatever still matters.
                if message.term == self.term {
                    actions.push(Action::Send(message));
                }
            }
        }
        match &self.role {
            RoleState::Candidate(_) => self.check_election(actions),
            RoleState::Leader(_) => self.maybe_commit(actions),
            RoleState::Follower | RoleState::PreCandidate(_) => {}
        }
    }

    fn handle_snapshot_built(&mut self, index: Index, actions: &mut Vec<Action>) {
        // A snapshot beyond what was applied, or not newer than the latest,
        // cannot be used; ignoring it leaves everything as it was.
        if index > self.applied || index <= self.log.snapshot().index {
            return;
        }
        // Never compact entries the runtime has not yet written: storage
        // should not see a write below its compaction point.
        let through = index
            .saturating_sub(self.options.compaction_lag_entries)
            .min(self.log.durable_index());
        if let Some(boundary) = self.log.snapshot_built(index, through) {
            actions.push(Action::Compact { through: boundary });
        }
    }

    /// Turns the step's decisions into actions: appends to followers, one
    /// persist request, applies, role changes.
    fn flush(&mut self, actions: &mut Vec<Action>) {
        // The step's messages leave with these actions: a read of a later
        // step may not share this step's forwarded ReadIndex.
        self.requests.read_riders.close();
        if let RoleState::Leader(leader) = &mut self.role {
            let heartbeat = std::mem::take(&mut leader.wake_heartbeat_due);
            if std::mem::take(&mut leader.unsent_entries) {
                self.broadcast_append(actions);
            }
            if heartbeat {
                self.broadcast_heartbeat(actions);
            }
        }
        self.flush_wake_up(actions);
        if self.needs_persist() {
            let entries = self.log.take_unpersisted();
            let hard_state = self.hard_state();
            let seq = self.next_seq;
            self.next_seq += 1;
            if let Some(last) = entries.last() {
                self.inflight_persists
                    .push_back((seq, last.index, last.term));
            }
            self.stored_term_vote = (self.term, self.vote);
            actions.push(Action::Persist(PersistRequest {
                seq,
                hard_state: Some(hard_state),
                entries,
            }));
        }
        self.apply_committed(actions);
        if let RoleState::Leader(_) = self.role {
            // A single-voter group commits on its own durability alone.
            self.maybe_commit(actions);
            self.apply_committed(actions);
        }
        // Only now, after this step's applies: entries become settled
        // once handed out, and the bound holds between steps.
        self.log.release_settled(
            self.applied,
            self.options.log_memory_bytes_max,
            self.options.log_memory_entries_max,
        );
        let now = (self.role(), self.term, self.leader);
        if self.reported_role != Some(now) {
            self.reported_role = Some(now);
            actions.push(Action::RoleChanged {
                role: now.0,
                term: now.1,
                leader: now.2,
            });
        }
    }

    fn apply_committed(&mut self, actions: &mut Vec<Action>) {
        let installing = self
            .receiving
            .as_ref()
            .is_some_and(|r| r.saving.is_some_and(|(_, _, done)| done));
        if installing || self.commit <= self.applied {
            return;
        }
        let entries = self.log.slice(self.applied + 1, self.commit, u64::MAX);
        assert_eq!(
            entries.len() as u64,
            self.commit - self.applied,
            "committed entries must be in the log"
        );
        self.applied = self.commit;
        actions.push(Action::Apply(entries));
        self.release_applied_reads(actions);
    }

    pub(crate) fn needs_persist(&self) -> bool {
        self.stored_term_vote != (self.term, self.vote) || self.log.has_unpersisted()
    }

    pub(crate) fn hard_state(&self) -> HardState {
        HardState {
            term: self.term,
            vote: self.vote,
            commit: self.commit,
        }
    }

    /// Sends a message now.
    pub(crate) fn send(&mut self, to: NodeId, body: MessageBody, actions: &mut Vec<Action>) {
        actions.push(Action::Send(self.message(to, body)));
    }

    pub(crate) fn message(&self, to: NodeId, body: MessageBody) -> Message {
        Message {
            group: self.options.group,
            from: self.options.id,
            to,
            term: self.term,
            body,
        }
    }

    /// Sends a message once everything decided so far is durable (votes,
    /// append and heartbeat answers: durable before acknowledged).
    pub(crate) fn send_after_persist(
        &mut self,
        to: NodeId,
        body: MessageBody,
        actions: &mut Vec<Action>,
    ) {
        let needed = if self.needs_persist() {
            self.next_seq
        } else {
            self.next_seq - 1
        };
        let message = self.message(to, body);
        if needed <= self.persisted_seq {
            actions.push(Action::Send(message));
            return;
        }
        if self.held_messages.len() >= HELD_MESSAGES_MAX {
            self.held_messages.pop_front();
        }
        self.held_messages.push_back((needed, message));
    }

    pub(crate) fn reset_election_timeout(&mut self) {
        let base = u64::from(self.options.election_timeout_ticks);
        let extra = self.rng.next_u64() % base;
        self.randomized_election_timeout = u32::try_from(base + extra).unwrap_or(u32::MAX);
    }

    /// A node that heard from a leader within the election timeout refuses
    /// to help depose it (Raft dissertation §4.2.3): it neither grants nor
    /// adopts the term of vote requests, unless the leader itself asked for
    /// the election (transfer). This holds with check-quorum off too: a
    /// member that missed a configuration change (it still counts a removed
    /// node as a voter) would otherwise adopt that node's ever higher terms
    /// and depose every new leader. Check-quorum additionally makes a leader
    /// that lost its quorum step down, so followers stop granting it a lease.
    ///
    /// With lease reads on, a node that started less than an election
    /// timeout ago refuses too: before it stopped it may have answered a
    /// leader's heartbeat, and that leader counts on the promise for its
    /// lease (reads served from it) although the node no longer remembers
    /// making it. Elections after a start are hardly delayed by this: no
    /// election timer fires sooner.
    pub(crate) fn in_leader_lease(&self) -> bool {
        let timeout_ticks = self.options.election_timeout_ticks;
        let heard_leader = self.leader.is_some() && self.election_elapsed < timeout_ticks;
        let just_started = self.options.lease_reads && self.now_tick < u64::from(timeout_ticks);
        heard_leader || just_started
    }

    /// Whether `id` votes in the configuration in force or in the newest
    /// configuration in this node's log.
    pub(crate) fn knows_voter(&self, id: NodeId) -> bool {
        self.config.is_voter(id) || self.log.config_at(self.log.last_index()).is_voter(id)
    }

    pub(crate) fn can_campaign(&self) -> bool {
        !self.removed
            && self.config.is_voter(self.options.id)
            && self.receiving.is_none()
            && self.term < TERM_MAX
    }

    /// Advances the commit index; configuration changes take effect here.
    pub(crate) fn commit_to(&mut self, index: Index, actions: &mut Vec<Action>) {
        let index = index.min(self.log.last_index());
        if index <= self.commit {
            return;
        }
        let old = self.commit;
        self.commit = index;
        if self.log.last_config_index_after(old).is_some() {
            let config = self.log.config_at(index);
            if config != self.config {
                self.config = config;
                self.on_config_committed(actions);
            }
        }
        if let RoleState::Leader(_) = self.role {
            self.on_leader_commit(actions);
        }
    }

    /// Advances the commit index to what a peer reports committed, if this
    /// node's log holds the same entry there (then, by the log matching
    /// property, the same entries up to it).
    ///
    /// Candidates use it. Commit indexes are learned from the leader, and
    /// persisted lazily, so after a leader crash the voters may disagree on
    /// whether a configuration change is committed; each then counts votes
    /// under another configuration. A voter that refuses a candidate (whose
    /// log is shorter than its own) tells it what it knows to be committed;
    /// without that, a candidate that still counts a removed node as a
    /// voter can wait forever for that node's vote, while the removed node,
    /// which knows the change committed, cannot campaign.
    pub(crate) fn learn_commit(
        &mut self,
        commit: Index,
        commit_term: Term,
        actions: &mut Vec<Action>,
    ) {
        if commit > self.commit && self.log.term_at(commit) == Some(commit_term) {
            self.commit_to(commit, actions);
        }
    }

    /// The answer to a vote request, with what this node knows committed.
    pub(crate) fn vote_response(&self, pre_vote: bool, granted: bool) -> MessageBody {
        let commit_term = self.log.term_at(self.commit);
        MessageBody::RequestVoteResponse {
            pre_vote,
            granted,
            commit: if commit_term.is_some() {
                self.commit
            } else {
                0
            },
            commit_term: commit_term.unwrap_or(0),
        }
    }

    /// A new configuration is in force (committed, or installed by snapshot).
    pub(crate) fn on_config_committed(&mut self, actions: &mut Vec<Action>) {
        let id = self.options.id;
        if self.config.contains(id) {
            self.was_member = true;
        } else if self.was_member && !self.removed {
            self.removed = true;
            actions.push(Action::Removed);
            if let RoleState::Leader(_) = self.role {
                self.become_follower(self.term, None, actions);
            } else if !matches!(self.role, RoleState::Follower) {
                self.become_follower(self.term, self.leader, actions);
            }
            self.fail_all_requests_removed(actions);
            return;
        }
        match self.role {
            RoleState::Leader(_) => {
                if !self.config.is_voter(id) {
                    // A leader that is no longer a voter hands over by stepping down.
                    self.become_follower(self.term, None, actions);
                    return;
                }
                self.sync_progress_with_config();
            }
            RoleState::PreCandidate(_) | RoleState::Candidate(_) if !self.config.is_voter(id) => {
                // It learned mid-campaign that it no longer votes.
                self.become_follower(self.term, self.leader, actions);
            }
            RoleState::PreCandidate(_) | RoleState::Candidate(_) | RoleState::Follower => {}
        }
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.options.id
    }

    /// This node's view of its group.
    pub fn status(&self) -> Status {
        Status {
            group: self.options.group,
            id: self.options.id,
            role: self.role(),
            receiving_snapshot: self.receiving.is_some(),
            term: self.term,
            leader: self.leader,
            last_index: self.log.last_index(),
            commit: self.commit,
            applied: self.applied,
            config: self.config.clone(),
            removed: self.removed,
        }
    }

    /// The current role. A follower that does not vote in the configuration
    /// in force is reported as a learner.
    pub fn role(&self) -> Role {
        match &self.role {
            RoleState::Leader(_) => Role::Leader,
            RoleState::Candidate(_) => Role::Candidate,
            RoleState::PreCandidate(_) => Role::PreCandidate,
            RoleState::Follower => {
                if self.config.is_voter(self.options.id) {
                    Role::Follower
                } else {
                    Role::Learner
                }
            }
        }
    }
    /// The current term.
    pub fn term(&self) -> Term {
        self.term
    }
    /// The known leader.
    pub fn leader(&self) -> Option<NodeId> {
        self.leader
    }
    /// The commit index.
    pub fn commit_index(&self) -> Index {
        self.commit
    }
    /// The index last handed to the state machine.
    pub fn applied_index(&self) -> Index {
        self.applied
    }
    /// The index of the first entry of the log (its boundary + 1), whether
    /// its body is held in memory or in storage only.
    pub fn first_index(&self) -> Index {
        self.log.first_index()
    }
    /// The index of the last entry (the snapshot index when the log is empty).
    pub fn last_index(&self) -> Index {
        self.log.last_index()
    }
    /// The term of the entry at `index`, if the log or the snapshot knows it.
    pub fn term_at(&self, index: Index) -> Option<Term> {
        self.log.term_at(index)
    }
    /// The entry at `index`, if its body is held in memory (see
    /// `Options::log_memory_bytes_max`: older settled entries are in
    /// storage only).
    pub fn entry(&self, index: Index) -> Option<&Entry> {
        self.log.entry(index)
    }
    /// The log (for its sizes: [`RaftLog::held_bytes`],
    /// [`RaftLog::settled_bytes`] and the like).
    pub fn log(&self) -> &RaftLog {
        &self.log
    }
    /// The latest snapshot.
    pub fn snapshot_meta(&self) -> &SnapshotMeta {
        self.log.snapshot()
    }
    /// The configuration in force.
    pub fn config(&self) -> &Configuration {
        &self.config
    }
    /// Whether the node is in its receiving-snapshot sub-state.
    pub fn is_receiving_snapshot(&self) -> bool {
        self.receiving.is_some()
    }
    /// Whether this node has been removed from its group.
    pub fn is_removed(&self) -> bool {
        self.removed
    }
    /// The fault that made this node halt the group, if it did (see
    /// [`Fault::LogConflict`]).
    pub fn halted(&self) -> Option<&Fault> {
        self.halted.as_ref()
    }
    /// Whether this node halted the group.
    pub fn is_halted(&self) -> bool {
        self.halted.is_some()
    }
    /// Whether this node is quiescent: a leader that sends no heartbeats,
    /// or a follower whose election timer is stopped (see the crate docs,
    /// "Quiescence").
    pub fn is_quiescent(&self) -> bool {
        self.quiescent
    }
    /// The index up to which this node's own log is known durable.
    pub fn durable_index(&self) -> Index {
        self.log.durable_index()
    }
    /// The number of client requests waiting on this node.
    pub fn pending_request_count(&self) -> usize {
        self.requests.len()
            + match &self.role {
                RoleState::Leader(l) => l.pending_reads.len() + l.reads_awaiting_noop.len(),
                RoleState::Follower | RoleState::PreCandidate(_) | RoleState::Candidate(_) => 0,
            }
    }
    /// On a leader, its view of every peer it replicates to (the members
    /// of the configurations in force and in its log, and former members
    /// it still tells of their removal); `None` on any other role.
    pub fn peer_progress(&self) -> Option<&BTreeMap<NodeId, Progress>> {
        self.leader_state().map(|state| &state.progress)
    }
}

fn validate_options(options: &Options) -> Result<(), InitError> {
    let fail = |what: &str| Err(InitError::InvalidOptions(what.to_string()));
    if options.id == 0 {
        return fail("node id 0 is reserved for \"none\"; use ids from 1");
    }
    if options.election_timeout_ticks < 2 {
        return fail("election_timeout_ticks must be at least 2");
    }
    if options.heartbeat_interval_ticks == 0
        || options.heartbeat_interval_ticks >= options.election_timeout_ticks
    {
        return fail(
            "heartbeat_interval_ticks must be at least 1 and below election_timeout_ticks",
        );
    }
    if options.inflight_messages_max == 0 || options.inflight_bytes_max == 0 {
        return fail("inflight_messages_max and inflight_bytes_max must be at least 1");
    }
    if options.append_bytes_max == 0 || options.snapshot_chunk_bytes == 0 {
        return fail("append_bytes_max and snapshot_chunk_bytes must be at least 1");
    }
    if options.snapshot_chunk_timeout_ticks == 0 || options.request_timeout_ticks == 0 {
        return fail("snapshot_chunk_timeout_ticks and request_timeout_ticks must be at least 1");
    }
    if options.pending_requests_max == 0 {
        return fail("pending_requests_max must be at least 1");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test_options;
    use crate::types::EntryPayload;

    #[test]
    fn inconsistent_restored_state_is_a_typed_error() {
        let mut restored = RestoredState::bootstrap([1, 2, 3]);
        restored.entries = vec![Entry {
            index: 2,
            term: 1,
            payload: EntryPayload::Noop,
        }];
        restored.hard_state.term = 1;
        assert!(matches!(
            RaftNode::new(test_options(1), restored, 0),
            Err(InitError::Inconsistent(_))
        ));
        let mut restored = RestoredState::bootstrap([1, 2, 3]);
        restored.entries = vec![Entry {
            index: 1,
            term: 5,
            payload: EntryPayload::Noop,
        }];
        restored.hard_state.term = 1;
        assert!(matches!(
            RaftNode::new(test_options(1), restored, 0),
            Err(InitError::Inconsistent(_))
        ));
        let mut restored = RestoredState::bootstrap([1, 2, 3]);
        restored.applied = 3;
        assert!(matches!(
            RaftNode::new(test_options(1), restored, 0),
            Err(InitError::Inconsistent(_))
        ));
    }

    #[test]
    fn invalid_options_are_a_typed_error() {
        let mut options = test_options(1);
        options.heartbeat_interval_ticks = options.election_timeout_ticks;
        let error = RaftNode::new(options, RestoredState::bootstrap([1]), 0).unwrap_err();
        assert!(matches!(error, InitError::InvalidOptions(_)));
        assert!(error.to_string().contains("heartbeat_interval_ticks"));
        assert!(RaftNode::new(test_options(0), RestoredState::bootstrap([1]), 0).is_err());
    }

    #[test]
    fn restart_reapplies_committed_entries_after_applied() {
        let entries: Vec<Entry> = (1..=5)
            .map(|index| Entry {
                index,
                term: 1,
                payload: EntryPayload::Noop,
            })
            .collect();
        let restored = RestoredState {
            hard_state: HardState {
                term: 1,
                vote: None,
                commit: 4,
            },
            entries,
            applied: 2,
            ..RestoredState::bootstrap([1, 2, 3])
        };
        let mut node = RaftNode::new(test_options(1), restored, 0).unwrap();
        let mut actions = Vec::new();
        node.step(Input::Tick, &mut actions);
        let applied: Vec<Index> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Apply(entries) => Some(entries.iter().map(|e| e.index).collect::<Vec<_>>()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(applied, vec![3, 4]);
    }

    #[test]
    fn persist_sequence_starts_at_one_and_increases() {
        let mut node = RaftNode::new(test_options(1), RestoredState::bootstrap([1]), 0).unwrap();
        let mut seqs = Vec::new();
        for _ in 0..40 {
            let mut actions = Vec::new();
            node.step(Input::Tick, &mut actions);
            for a in actions {
                if let Action::Persist(p) = a {
                    seqs.push(p.seq);
                    node.step(Input::Persisted { seq: p.seq }, &mut Vec::new());
                }
            }
        }
        assert!(!seqs.is_empty());
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
        assert_eq!(node.role(), Role::Leader);
    }
}
