//! Client requests in every role and sub-state: proposals, reads of each
//! consistency, membership changes, leadership transfer and status. Each
//! gets exactly one answer: executed, forwarded (and the answer relayed),
//! held until a leader is known (with a deadline), or a typed error.

use crate::fault::TERM_MAX;
use crate::io::Action;
use crate::membership::MembershipChange;
use crate::message::MessageBody;
use crate::node::{HeldRequest, PendingRead, RaftNode, ReadOrigin, RoleState};
use crate::quorum::{committed_index, is_quorum};
use crate::request::{
    CampaignOutcome, CampaignRefusal, ForwardedRequest, ReadConsistency, Request, RequestError,
    RequestId, Response,
};
use crate::types::{EntryPayload, Index, NodeId, Term};

/// A learner may be promoted once its match index is within this many
/// entries of the leader's last index.
pub const PROMOTE_LAG_ENTRIES_MAX: u64 = 64;

type Outcome = Result<Response, RequestError>;

/// The most executed forwards a leader remembers to recognise duplicates
/// (independent of `pending_requests_max`: this bounds memory, not load).
pub(crate) const EXECUTED_FORWARDS_MAX: usize = 16_384;

/// How long an executed forward is remembered, in request timeouts.
pub(crate) const EXECUTED_FORWARDS_TIMEOUTS: u64 = 20;

impl RaftNode {
    fn respond(&mut self, id: RequestId, result: Outcome, actions: &mut Vec<Action>) {
        actions.push(Action::Respond { id, result });
    }

    fn is_leader(&self) -> bool {
        matches!(self.role, RoleState::Leader(_))
    }

    /// A client request (or one re-dispatched after waiting for a leader).
    pub(crate) fn handle_client(
        &mut self,
        id: RequestId,
        request: Request,
        deadline: u64,
        actions: &mut Vec<Action>,
    ) {
        if self.removed {
            let result = match request {
                Request::Status => Ok(Response::Status(self.status())),
                Request::Propose(_)
                | Request::Read(_)
                | Request::ChangeMembership(_)
                | Request::TransferLeadership(_)
                | Request::Campaign => Err(RequestError::Removed),
            };
            self.respond(id, result, actions);
            return;
        }
        match request {
            Request::Status => {
                let status = self.status();
                self.respond(id, Ok(Response::Status(status)), actions);
            }
            Request::Campaign => {
                let result = self.campaign_now(actions);
                self.respond(id, result, actions);
            }
            Request::Read(ReadConsistency::Local { min_applied }) => {
                // Served from the state last applied, also while a snapshot
                // is being received (the install moves applied forward).
                let wanted = min_applied.unwrap_or(0);
                if self.applied >= wanted {
                    let index = self.applied;
                    self.respond(id, Ok(Response::ReadReady { index }), actions);
                } else if self.pending_request_count() >= self.options.pending_requests_max {
                    self.respond(
                        id,
                        Err(RequestError::Busy {
                            limit: self.options.pending_requests_max,
                        }),
                        actions,
                    );
                } else {
                    self.requests.awaiting_apply.push((id, wanted, deadline));
                }
            }
            Request::Read(ReadConsistency::Lease)
                if !(self.options.lease_reads && self.options.check_quorum) =>
            {
                self.respond(id, Err(RequestError::LeaseReadsDisabled), actions);
            }
            Request::Read(ReadConsistency::Lease) if !self.is_leader() => {
                // Only the leader holds a lease; a follower cannot serve it.
                self.respond(
                    id,
                    Err(RequestError::NotLeader {
                        leader: self.leader,
                    }),
                    actions,
                );
            }
            request @ (Request::Propose(_)
            | Request::Read(ReadConsistency::Linearizable | ReadConsistency::Lease)
            | Request::ChangeMembership(_)
            | Request::TransferLeadership(_)) => {
                if self.is_leader() {
                    self.execute_on_leader(id, request, deadline, actions);
                } else {
                    self.route_to_leader(id, request, deadline, actions);
                }
            }
        }
    }

    fn execute_on_leader(
        &mut self,
        id: RequestId,
        request: Request,
        deadline: u64,
        actions: &mut Vec<Action>,
    ) {
        let origin = ReadOrigin::Local(id);
        match request {
            Request::Propose(data) => {
                let result = self.propose(EntryPayload::Command(data));
                self.respond(id, result, actions);
            }
            Request::ChangeMembership(change) => {
                let result = self.propose_membership(change);
                self.respond(id, result, actions);
            }
            Request::TransferLeadership(target) => {
                let result = self.start_transfer(target, actions);
                self.respond(id, result, actions);
            }
            Request::Read(ReadConsistency::Lease) => {
                if self.lease_valid() {
                    let index = self.commit;
                    self.wait_for_apply(id, index, deadline, actions);
                } else {
                    // Without a valid lease, fall back to a quorum round.
                    self.read_index(origin, deadline, actions);
                }
            }
            Request::Read(ReadConsistency::Linearizable) => {
                self.read_index(origin, deadline, actions)
            }
            Request::Read(ReadConsistency::Local { .. }) | Request::Status | Request::Campaign => {
                self.handle_client(id, request, deadline, actions)
            }
        }
    }

    fn route_to_leader(
        &mut self,
        id: RequestId,
        request: Request,
        deadline: u64,
        actions: &mut Vec<Action>,
    ) {
        if !self.options.forward_requests {
            self.respond(
                id,
                Err(RequestError::NotLeader {
                    leader: self.leader,
                }),
                actions,
            );
            return;
        }
        if self.pending_request_count() >= self.options.pending_requests_max {
            self.respond(
                id,
                Err(RequestError::Busy {
                    limit: self.options.pending_requests_max,
                }),
                actions,
            );
            return;
        }
        match self.leader {
            Some(leader) => {
                if let (Request::Read(_), Some(carrier)) =
                    (&request, self.requests.read_riders.open_carrier(leader))
                {
                    // A read of this step went to the leader already: this
                    // one takes its answer (see `ReadRiders`).
                    self.requests.read_riders.ride(
                        carrier,
                        HeldRequest {
                            id,
                            request,
                            deadline_tick: deadline,
                        },
                    );
                    return;
                }
                let is_read = matches!(request, Request::Read(_));
                let forwarded = match &request {
                    Request::Propose(data) => ForwardedRequest::Propose(data.clone()),
                    Request::Read(_) => ForwardedRequest::ReadIndex,
                    Request::ChangeMembership(change) => {
                        ForwardedRequest::ChangeMembership(*change)
                    }
                    Request::TransferLeadership(target) => {
                        ForwardedRequest::TransferLeadership(*target)
                    }
                    Request::Status | Request::Campaign => {
                        debug_assert!(false, "status and campaign are answered locally");
                        return;
                    }
                };
                if let Some(old) = self.requests.forwarded.insert(
                    id,
                    HeldRequest {
                        id,
                        request,
                        deadline_tick: deadline,
                    },
                ) {
                    // The runtime reused an id still pending: answer the old
                    // one, and the reads riding on it (the answer to this id
                    // will be the new request's).
                    self.respond(old.id, Err(RequestError::Timeout), actions);
                    for rider in self.requests.read_riders.take(id) {
                        self.respond(rider.id, Err(RequestError::Timeout), actions);
                    }
                }
                self.send(
                    leader,
                    MessageBody::Forward {
                        id,
                        request: forwarded,
                    },
                    actions,
                );
                if is_read {
                    self.requests.read_riders.open(leader, id);
                }
            }
            None => {
                self.requests.awaiting_leader.push_back(HeldRequest {
                    id,
                    request,
                    deadline_tick: deadline,
                });
            }
        }
    }

    /// A leader became known (or this node became leader): dispatch the
    /// requests that were waiting for one.
    pub(crate) fn on_leader_known(&mut self, actions: &mut Vec<Action>) {
        let waiting = std::mem::take(&mut self.requests.awaiting_leader);
        for held in waiting {
            self.handle_client(held.id, held.request, held.deadline_tick, actions);
        }
    }

    /// No leader is known now. Requests already forwarded keep waiting for
    /// their answer (or deadline).
    pub(crate) fn on_leader_unknown(&mut self, _actions: &mut Vec<Action>) {}

    /// A follower's forwarded request, sent in the follower's term
    /// `sent_in`.
    pub(crate) fn handle_forward(
        &mut self,
        from: NodeId,
        sent_in: Term,
        id: RequestId,
        request: ForwardedRequest,
        actions: &mut Vec<Action>,
    ) {
        if self.removed || !self.is_leader() {
            // Not executed here: the forwarder waits for the right leader.
            let error = RequestError::NotLeader {
                leader: if self.removed { None } else { self.leader },
            };
            self.send(
                from,
                MessageBody::ForwardResponse {
                    id,
                    result: Err(error),
                },
                actions,
            );
            return;
        }
        if sent_in < self.term && !matches!(request, ForwardedRequest::ReadIndex) {
            // Sent in an older term, so possibly a late copy of a Forward
            // this node executed when it led before: what a leader executed
            // is remembered in memory, for duplicates within its term, and
            // a restart forgets it (a node leads at most once per term, so
            // within one term nothing is forgotten). Not executed, and not
            // answered: the forwarder still waiting for this request reports
            // its outcome unknown at its deadline, as for any unanswered
            // Forward. (A read has no effect: it is served whatever its term.)
            return;
        }
        if let Some((earlier, result, _)) = self.requests.executed_forwards.get(&(from, id)) {
            if *earlier == request {
                // A duplicate (the network delivered the Forward twice):
                // answer as the first time, never execute it again.
                let result = result.clone();
                self.send(from, MessageBody::ForwardResponse { id, result }, actions);
                return;
            }
        }
        let deadline = self.now_tick + u64::from(self.options.request_timeout_ticks);
        let result = match request.clone() {
            ForwardedRequest::Propose(data) => self.propose(EntryPayload::Command(data)),
            ForwardedRequest::ChangeMembership(change) => self.propose_membership(change),
            ForwardedRequest::TransferLeadership(target) => self.start_transfer(target, actions),
            ForwardedRequest::ReadIndex => {
                // Reads have no effect: a duplicate just reads twice.
                self.read_index(ReadOrigin::Remote { from, id }, deadline, actions);
                return;
            }
        };
        self.remember_forward(from, id, request, result.clone());
        self.send(from, MessageBody::ForwardResponse { id, result }, actions);
    }

    fn remember_forward(
        &mut self,
        from: NodeId,
        id: RequestId,
        request: ForwardedRequest,
        result: Outcome,
    ) {
        // Network duplicates arrive within a few request timeouts; keep a
        // generous margin.
        let forget_at = self.now_tick
            + EXECUTED_FORWARDS_TIMEOUTS * u64::from(self.options.request_timeout_ticks);
        let pending = &mut self.requests;
        if pending
            .executed_forwards
            .insert((from, id), (request, result, forget_at))
            .is_none()
        {
            pending.executed_order.push_back((from, id));
        }
        while pending.executed_order.len() > EXECUTED_FORWARDS_MAX {
            if let Some(key) = pending.executed_order.pop_front() {
                pending.executed_forwards.remove(&key);
            }
        }
    }

    fn forget_old_forwards(&mut self) {
        let now = self.now_tick;
        let pending = &mut self.requests;
        while let Some(key) = pending.executed_order.front() {
            match pending.executed_forwards.get(key) {
                Some((_, _, forget_at)) if *forget_at > now => break,
                Some(_) | None => {
                    if let Some(key) = pending.executed_order.pop_front() {
                        pending.executed_forwards.remove(&key);
                    }
                }
            }
        }
    }

    pub(crate) fn handle_forward_response(
        &mut self,
        from: NodeId,
        id: RequestId,
        result: Outcome,
        actions: &mut Vec<Action>,
    ) {
        // The reads that rode on this one take its answer, also when it
        // timed out itself (riders have deadlines of their own).
        for rider in self.requests.read_riders.take(id) {
            self.answer_forwarded(from, rider, result.clone(), actions);
        }
        let Some(held) = self.requests.forwarded.remove(&id) else {
            return; // already answered (timed out); the late answer has no one to go to
        };
        self.answer_forwarded(from, held, result, actions);
    }

    /// The leader's answer to a forwarded request: a read waits for apply
    /// (or tries again when the leader changed), anything else is passed on.
    fn answer_forwarded(
        &mut self,
        from: NodeId,
        held: HeldRequest,
        result: Outcome,
        actions: &mut Vec<Action>,
    ) {
        let id = held.id;
        let is_read = matches!(held.request, Request::Read(_));
        match result {
            Ok(Response::ReadReady { index }) => {
                self.wait_for_apply(id, index, held.deadline_tick, actions)
            }
            Err(RequestError::NotLeader { .. })
                if is_read && held.deadline_tick > self.now_tick =>
            {
                // A read has no effect: wait for the right leader and retry.
                if self.leader == Some(from) {
                    self.requests.awaiting_leader.push_back(held);
                } else {
                    self.handle_client(held.id, held.request, held.deadline_tick, actions);
                }
            }
            Err(RequestError::NotLeader { .. }) if !is_read => {
                // This refusal may answer a duplicate of the Forward while the
                // original was executed (by this node when it led): it does
                // not prove "no effect". Keep waiting for the real answer;
                // at the deadline the outcome is reported unknown (Timeout).
                self.requests.forwarded.insert(id, held);
            }
            result => self.respond(id, result, actions),
        }
    }

    /// `Request::Campaign`: an election now, if this node may campaign.
    fn campaign_now(&mut self, actions: &mut Vec<Action>) -> Outcome {
        let outcome = match &self.role {
            RoleState::Leader(_) => CampaignOutcome::AlreadyLeader,
            RoleState::PreCandidate(_) | RoleState::Candidate(_) => {
                CampaignOutcome::AlreadyCampaigning
            }
            RoleState::Follower => {
                let refusal = if !self.config.is_voter(self.options.id) {
                    Some(CampaignRefusal::NotVoter)
                } else if self.receiving.is_some() {
                    Some(CampaignRefusal::ReceivingSnapshot)
                } else if self.term >= TERM_MAX {
                    Some(CampaignRefusal::TermExhausted)
                } else {
                    None
                };
                if let Some(reason) = refusal {
                    return Err(RequestError::CannotCampaign { reason });
                }
                debug_assert!(self.can_campaign(), "every refusal is named above");
                self.campaign(false, actions);
                CampaignOutcome::Started
            }
        };
        Ok(Response::Campaign(outcome))
    }

    // ----- proposals and membership, on the leader -----

    fn propose(&mut self, payload: EntryPayload) -> Outcome {
        let Some(state) = self.leader_state() else {
            return Err(RequestError::NotLeader {
                leader: self.leader,
            });
        };
        if state.transfer.is_some() {
            return Err(RequestError::TransferInProgress);
        }
        // Bound the uncommitted tail: a leader that cannot commit (no
        // quorum) must not grow its log without limit.
        let limit = self.options.pending_requests_max;
        if self.log.last_index() - self.commit >= limit as u64 {
            return Err(RequestError::Busy { limit });
        }
        let index = self.append_entry(payload);
        Ok(Response::Proposed {
            index,
            term: self.term,
        })
    }

    fn propose_membership(&mut self, change: MembershipChange) -> Outcome {
        if self.config.is_joint() || self.log.last_config_index_after(self.commit).is_some() {
            return Err(RequestError::MembershipChangePending);
        }
        let config = self.config.clone();
        let invalid = |reason: String| Err(RequestError::InvalidMembershipChange { reason });
        let mut next = config.clone();
        match change {
            MembershipChange::AddLearner(id) => {
                if config.contains(id) {
                    return invalid(format!("node {id} is already a member"));
                }
                next.learners.insert(id);
            }
            MembershipChange::AddVoter(id) => {
                if config.is_voter(id) {
                    return invalid(format!("node {id} is already a voter"));
                }
                next.learners.remove(&id);
                next.voters.insert(id);
                next.voters_outgoing = config.voters.clone();
            }
            MembershipChange::PromoteLearner(id) => {
                if !config.is_learner(id) {
                    return invalid(format!("node {id} is not a learner"));
                }
                let last_index = self.log.last_index();
                let matched = self
                    .leader_state()
                    .and_then(|s| s.progress.get(&id))
                    .map_or(0, |p| p.match_index);
                if matched + PROMOTE_LAG_ENTRIES_MAX < last_index {
                    return Err(RequestError::LearnerNotCaughtUp {
                        id,
                        matched,
                        last_index,
                    });
                }
                next.learners.remove(&id);
                next.voters.insert(id);
                next.voters_outgoing = config.voters.clone();
            }
            MembershipChange::Remove(id) => {
                if config.is_learner(id) {
                    next.learners.remove(&id);
                } else if config.is_voter(id) {
                    if config.voters.len() == 1 {
                        return invalid(format!(
                            "node {id} is the only voter; a group needs at least one"
                        ));
                    }
                    next.voters.remove(&id);
                    next.voters_outgoing = config.voters.clone();
                } else {
                    return invalid(format!("node {id} is not a member"));
                }
            }
        }
        let result = self.propose(EntryPayload::Config(next));
        self.sync_progress_with_config();
        result
    }

    // ----- reads -----

    fn wait_for_apply(
        &mut self,
        id: RequestId,
        index: Index,
        deadline: u64,
        actions: &mut Vec<Action>,
    ) {
        if self.applied >= index {
            self.respond(id, Ok(Response::ReadReady { index }), actions);
        } else {
            self.requests.awaiting_apply.push((id, index, deadline));
        }
    }

    /// Answers the reads whose index the state machine has now applied.
    pub(crate) fn release_applied_reads(&mut self, actions: &mut Vec<Action>) {
        let applied = self.applied;
        let mut ready = Vec::new();
        self.requests.awaiting_apply.retain(|&(id, index, _)| {
            if index <= applied {
                ready.push((id, index));
                false
            } else {
                true
            }
        });
        for (id, index) in ready {
            self.respond(id, Ok(Response::ReadReady { index }), actions);
        }
    }

    fn read_index(&mut self, origin: ReadOrigin, deadline: u64, actions: &mut Vec<Action>) {
        let limit = self.options.pending_requests_max;
        if self.pending_request_count() >= limit {
            self.answer_read_origin(origin, Err(RequestError::Busy { limit }), actions);
            return;
        }
        if self.log.term_at(self.commit) != Some(self.term) {
            // The commit index of an earlier term may be behind: wait for
            // this term's no-op to commit first.
            if let Some(state) = self.leader_state_mut() {
                state.reads_awaiting_noop.push((origin, deadline));
            }
            return;
        }
        self.start_read_index(origin, deadline, actions);
    }

    pub(crate) fn start_read_index(
        &mut self,
        origin: ReadOrigin,
        deadline: u64,
        actions: &mut Vec<Action>,
    ) {
        let index = self.commit;
        let fresh = self.leader_state().and_then(|s| s.fresh_round);
        let round = match fresh {
            Some(round) => round,
            None => self.broadcast_heartbeat(actions),
        };
        if let Some(state) = self.leader_state_mut() {
            state.pending_reads.push_back(PendingRead {
                origin,
                index,
                round,
                deadline_tick: deadline,
            });
        }
        self.check_reads(actions);
    }

    /// Confirms the reads whose heartbeat round a quorum has answered.
    pub(crate) fn check_reads(&mut self, actions: &mut Vec<Action>) {
        let id = self.options.id;
        let mut ready = Vec::new();
        if let RoleState::Leader(state) = &mut self.role {
            while let Some(read) = state.pending_reads.front() {
                let round = read.round;
                let confirmed = is_quorum(&self.config, |peer| {
                    peer == id
                        || state
                            .progress
                            .get(&peer)
                            .is_some_and(|p| p.acked_round >= round)
                });
                if !confirmed {
                    break;
                }
                if let Some(read) = state.pending_reads.pop_front() {
                    ready.push(read);
                }
            }
        }
        for read in ready {
            match read.origin {
                ReadOrigin::Local(id) => {
                    self.wait_for_apply(id, read.index, read.deadline_tick, actions)
                }
                ReadOrigin::Remote { from, id } => {
                    let body = MessageBody::ForwardResponse {
                        id,
                        result: Ok(Response::ReadReady { index: read.index }),
                    };
                    self.send(from, body, actions);
                }
            }
        }
    }

    pub(crate) fn answer_read_origin(
        &mut self,
        origin: ReadOrigin,
        result: Outcome,
        actions: &mut Vec<Action>,
    ) {
        match origin {
            ReadOrigin::Local(id) => self.respond(id, result, actions),
            ReadOrigin::Remote { from, id } => {
                self.send(from, MessageBody::ForwardResponse { id, result }, actions)
            }
        }
    }

    /// The ticks a lease lasts after the heartbeat round that renewed it.
    /// Followers refuse votes for `election_timeout_ticks` of their own
    /// ticks after hearing the leader; a quarter is kept back for clock
    /// drift, one tick for tick granularity (see the crate docs).
    pub fn lease_ticks(election_timeout_ticks: u32) -> u64 {
        let timeout = u64::from(election_timeout_ticks);
        timeout.saturating_sub(timeout / 4 + 1)
    }

    fn lease_valid(&self) -> bool {
        let Some(state) = self.leader_state() else {
            return false;
        };
        if !(self.options.lease_reads && self.options.check_quorum) || state.transfer.is_some() {
            return false;
        }
        if self.log.term_at(self.commit) != Some(self.term) {
            return false;
        }
        let id = self.options.id;
        let now = self.now_tick;
        let not_before = state.lease_not_before_tick + 1;
        // The latest round send tick (+1) a quorum has confirmed.
        let quorum_sent = committed_index(&self.config, |peer| {
            if peer == id {
                now + 1
            } else {
                state
                    .progress
                    .get(&peer)
                    .map_or(0, |p| p.acked_round_sent_tick)
            }
        });
        quorum_sent >= not_before
            && quorum_sent - 1 + Self::lease_ticks(self.options.election_timeout_ticks) > now
    }

    // ----- deadlines -----

    pub(crate) fn expire_requests(&mut self, actions: &mut Vec<Action>) {
        self.forget_old_forwards();
        let now = self.now_tick;
        let mut expired: Vec<(RequestId, RequestError)> = Vec::new();
        self.requests.awaiting_leader.retain(|held| {
            if held.deadline_tick <= now {
                expired.push((held.id, RequestError::NoLeader));
                false
            } else {
                true
            }
        });
        self.requests.forwarded.retain(|_, held| {
            if held.deadline_tick <= now {
                expired.push((held.id, RequestError::Timeout));
                false
            } else {
                true
            }
        });
        self.requests.awaiting_apply.retain(|&(id, _, deadline)| {
            if deadline <= now {
                expired.push((id, RequestError::Timeout));
                false
            } else {
                true
            }
        });
        for id in self.requests.read_riders.expire(now) {
            expired.push((id, RequestError::Timeout));
        }
        for (id, error) in expired {
            self.respond(id, Err(error), actions);
        }
        let mut expired_reads = Vec::new();
        if let RoleState::Leader(state) = &mut self.role {
            state.pending_reads.retain(|read| {
                if read.deadline_tick <= now {
                    expired_reads.push(read.origin);
                    false
                } else {
                    true
                }
            });
            state.reads_awaiting_noop.retain(|&(origin, deadline)| {
                if deadline <= now {
                    expired_reads.push(origin);
                    false
                } else {
                    true
                }
            });
        }
        for origin in expired_reads {
            self.answer_read_origin(origin, Err(RequestError::Timeout), actions);
        }
    }

    /// This node was removed: requests that never left it fail with
    /// `Removed` (no effect). Requests already forwarded may have taken
    /// effect: they keep waiting for the leader's answer (or their deadline,
    /// then `Timeout`). Reads waiting for apply still complete.
    pub(crate) fn fail_all_requests_removed(&mut self, actions: &mut Vec<Action>) {
        self.fail_requests_awaiting_leader(RequestError::Removed, actions);
    }

    /// This node halted the group: requests that never left it fail with
    /// `Halted` (no effect); forwarded ones wait as above.
    pub(crate) fn fail_all_requests_halted(&mut self, actions: &mut Vec<Action>) {
        let error = self.halted_error();
        self.fail_requests_awaiting_leader(error, actions);
    }

    fn fail_requests_awaiting_leader(&mut self, error: RequestError, actions: &mut Vec<Action>) {
        let ids: Vec<RequestId> = self
            .requests
            .awaiting_leader
            .drain(..)
            .map(|h| h.id)
            .collect();
        for id in ids {
            self.respond(id, Err(error.clone()), actions);
        }
    }
}
