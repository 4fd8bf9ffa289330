//! Quiescence (`Options::quiesce`): an idle group goes quiet, so that a
//! process hosting thousands of groups pays almost nothing for the idle
//! ones. The leader of an idle group sends [`MessageBody::Quiesce`] instead
//! of a heartbeat round and then sends nothing; a follower whose log and
//! commit index match the notice stops its election timer. Anything that
//! needs the group wakes it (see the crate docs, "Quiescence", for the wake
//! rules, the host's part and why this is safe).
//!
//! Quiescence only suppresses timers: the heartbeat timer and check-quorum
//! countdown of the leader, the election timer of a follower. Every vote,
//! append and commit decision is made by the same code on the same state as
//! without it.

use crate::io::Action;
use crate::message::{AppendResult, Message, MessageBody};
use crate::node::{RaftNode, RoleState};
use crate::progress::ReplicationState;
use crate::request::{ReadConsistency, Request};
use crate::types::{Index, NodeId, Term};

impl RaftNode {
    /// (Leader.) Whether the group is idle: nothing waits on the leader,
    /// every member has matched the whole log, which is committed and
    /// synced here, and no membership change, transfer or snapshot is under
    /// way.
    pub(crate) fn group_is_idle(&self) -> bool {
        let Some(state) = self.leader_state() else {
            return false;
        };
        let last = self.log.last_index();
        self.commit == last
            && self.log.durable_index() == last
            && self.inflight_persists.is_empty()
            && !self.needs_persist()
            && self.requests.len() == 0
            && self.receiving.is_none()
            && state.pending_reads.is_empty()
            && state.reads_awaiting_noop.is_empty()
            && state.transfer.is_none()
            && state.retiring.is_empty()
            && !state.unsent_entries
            && !self.config.is_joint()
            && state.progress.values().all(|p| {
                p.match_index == last
                    && p.inflights.count() == 0
                    && !matches!(p.state, ReplicationState::Snapshot(_))
            })
    }

    /// (Leader.) Counts this tick toward the group's idle time; returns
    /// whether the group has been idle for at least a heartbeat interval.
    pub(crate) fn count_idle_tick(&mut self) -> bool {
        if !self.options.quiesce {
            return false;
        }
        let idle = self.group_is_idle();
        let interval = self.options.heartbeat_interval_ticks;
        let Some(state) = self.leader_state_mut() else {
            return false;
        };
        state.idle_ticks = if idle {
            state.idle_ticks.saturating_add(1)
        } else {
            0
        };
        idle && state.idle_ticks >= interval
    }

    /// (Leader.) Something new happened (a client request): the group is
    /// not idle for another heartbeat interval at least.
    pub(crate) fn note_leader_activity(&mut self) {
        if let Some(state) = self.leader_state_mut() {
            state.idle_ticks = 0;
        }
    }

    /// (Leader.) Goes quiet: tells every member, instead of this heartbeat
    /// round, and stops the heartbeat timer and check-quorum.
    pub(crate) fn quiesce_group(&mut self, actions: &mut Vec<Action>) {
        let last_index = self.log.last_index();
        let last_term = self.log.last_term();
        let commit = self.commit;
        let Some(state) = self.leader_state_mut() else {
            return;
        };
        state.check_quorum_elapsed = 0;
        state.idle_ticks = 0;
        // A read arriving later must start a round of its own (which wakes
        // the leader), not join one sent before the group went quiet.
        state.fresh_round = None;
        let peers: Vec<NodeId> = state
            .progress
            .iter_mut()
            .map(|(&peer, progress)| {
                // The notice carries the commit index (each peer matched it).
                progress.commit_sent = progress.commit_sent.max(commit);
                peer
            })
            .collect();
        self.quiescent = true;
        for peer in peers {
            let body = MessageBody::Quiesce {
                last_index,
                last_term,
                commit,
            };
            self.send(peer, body, actions);
        }
    }

    /// (Follower, after following the sender.) The leader's notice: stop
    /// the election timer if this node is where the leader says the group
    /// is; otherwise ask the leader to keep its heartbeats going.
    pub(crate) fn handle_quiesce(
        &mut self,
        from: NodeId,
        (last_index, last_term): (Index, Term),
        commit: Index,
        actions: &mut Vec<Action>,
    ) {
        // The commit index is taken as from a heartbeat: capped at what an
        // append of this leader verified.
        self.take_leader_commit(from, commit, actions);
        let own_last = self.log.last_index();
        let matches_leader = own_last == last_index
            && self.log.term_at(own_last) == Some(last_term)
            && self.leader_verified_index >= own_last
            && self.commit == commit;
        let can_quiesce = self.options.quiesce
            && matches!(self.role, RoleState::Follower)
            && self.leader == Some(from)
            && !self.removed
            && self.receiving.is_none()
            && self.requests.len() == 0
            && matches_leader;
        if can_quiesce {
            self.quiescent = true;
            self.wake_leader = None;
        } else {
            // Behind, ahead, unverified, or with requests of its own waiting:
            // this node needs the leader's heartbeats (its timer would
            // otherwise fire, and its campaign wake the group anyway).
            self.send(from, MessageBody::WakeUp, actions);
        }
    }

    /// (Non-voter, after an election timeout without a word from its
    /// leader: a learner, or a node that joined and has not yet committed
    /// the configuration that adds it.) A voter that missed the leader's
    /// notice finds out by campaigning, which wakes the group; a non-voter
    /// cannot campaign, and a notice it missed (with the commit index it
    /// carried), or a restart that made it forget its leader, would leave
    /// it behind for as long as the group stays quiet. So it asks for
    /// heartbeats: its leader, which wakes, sends it an append and goes
    /// quiet again with a new notice; or, with no leader known, every voter
    /// it knows of, whose followers wake on it and wake their leader. A
    /// dead group costs a message per voter per election timeout.
    pub(crate) fn ask_for_heartbeats(&mut self, actions: &mut Vec<Action>) {
        let voter = self.config.is_voter(self.options.id);
        if !self.options.quiesce || voter || self.removed {
            return;
        }
        let asked = match self.leader {
            Some(leader) => vec![leader],
            None => self.voters_except_self(),
        };
        for peer in asked {
            self.send(peer, MessageBody::WakeUp, actions);
        }
    }

    /// (Leader.) A follower asks for heartbeats. The leader woke already
    /// (any message wakes it); it sends the follower an append from where
    /// it is, which verifies the follower's log against this leader again
    /// (a follower that restarted needs that before it can go quiet).
    pub(crate) fn handle_wake_up(&mut self, from: NodeId, actions: &mut Vec<Action>) {
        let Some(progress) = self
            .leader_state_mut()
            .and_then(|s| s.progress.get_mut(&from))
        else {
            // Not leading (any more), or not a member: its own timers and
            // the current leader's heartbeats serve it.
            return;
        };
        progress.recent_active = true;
        if let ReplicationState::Probe { paused } = &mut progress.state {
            *paused = false;
        }
        self.send_append(from, true, actions);
    }

    /// (Quiescent leader.) Whether `message` is a late answer to a
    /// heartbeat or append the leader sent before it went quiet, from a
    /// member that is exactly where the notice assumed it (its log matched
    /// through the last index, this term): it needs nothing and tells the
    /// leader nothing it lacks (a quiet leader counts no check-quorum
    /// answers, and waking resets them anyway). Waking on it made the
    /// leader send a heartbeat round, whose answers woke it again: on a
    /// loaded host whose answers take longer than a heartbeat interval to
    /// come back, thousands of idle groups never stayed quiet, and the
    /// load that made them late never went away.
    pub(crate) fn is_late_answer_of_a_caught_up_member(&self, message: &Message) -> bool {
        let Some(state) = self.leader_state() else {
            return false;
        };
        let last = self.log.last_index();
        let caught_up = message.term == self.term
            && state
                .progress
                .get(&message.from)
                .is_some_and(|p| p.match_index == last);
        if !caught_up {
            return false;
        }
        match &message.body {
            MessageBody::HeartbeatResponse {
                last_index,
                needs_append,
                read_seq: _,
            } => *last_index == last && !needs_append,
            MessageBody::AppendResponse(AppendResult::Success { match_index }) => {
                *match_index == last
            }
            MessageBody::AppendResponse(AppendResult::Reject { .. })
            | MessageBody::RequestVote { .. }
            | MessageBody::RequestVoteResponse { .. }
            | MessageBody::Append { .. }
            | MessageBody::Heartbeat { .. }
            | MessageBody::SnapshotChunk { .. }
            | MessageBody::SnapshotChunkAck { .. }
            | MessageBody::SnapshotResponse { .. }
            | MessageBody::TimeoutNow
            | MessageBody::Forward { .. }
            | MessageBody::ForwardResponse { .. }
            | MessageBody::Quiesce { .. }
            | MessageBody::WakeUp => false,
        }
    }

    /// (Quiescent follower.) Whether `message` is a heartbeat or append of
    /// this follower's leader, in this term, that brings nothing the
    /// follower lacks: a commit index no higher than its own and entries it
    /// holds already. It is answered as always, without waking: the
    /// follower stays where the notice left it. Such a message is either a
    /// late copy of one sent before the notice (networks duplicate and
    /// delay), or a heartbeat of a leader that woke for someone else (a
    /// read round, a member that reconnected), which needs only the
    /// answer. Waking on the late copy left the follower's election timer
    /// running under a leader that had gone quiet: it campaigned and
    /// deposed a healthy leader.
    pub(crate) fn is_nothing_new_from_the_leader(&self, message: &Message) -> bool {
        let from_leader = matches!(self.role, RoleState::Follower)
            && self.leader == Some(message.from)
            && message.term == self.term;
        if !from_leader {
            return false;
        }
        let held = |index: Index, term: Term| self.log.term_at(index) == Some(term);
        match &message.body {
            MessageBody::Heartbeat {
                leader_commit,
                read_seq: _,
            } => *leader_commit <= self.commit,
            MessageBody::Append {
                prev_log_index,
                prev_log_term,
                entries,
                leader_commit,
            } => {
                *leader_commit <= self.commit
                    && held(*prev_log_index, *prev_log_term)
                    && entries.iter().all(|e| held(e.index, e.term))
            }
            MessageBody::RequestVote { .. }
            | MessageBody::RequestVoteResponse { .. }
            | MessageBody::AppendResponse(_)
            | MessageBody::HeartbeatResponse { .. }
            | MessageBody::SnapshotChunk { .. }
            | MessageBody::SnapshotChunkAck { .. }
            | MessageBody::SnapshotResponse { .. }
            | MessageBody::TimeoutNow
            | MessageBody::Forward { .. }
            | MessageBody::ForwardResponse { .. }
            | MessageBody::Quiesce { .. }
            | MessageBody::WakeUp => false,
        }
    }

    /// Leaves the quiescent sub-state, with every timer running again. A
    /// leader sends a heartbeat round at the end of the step and starts a
    /// fresh check-quorum window; a follower with `notify_leader` tells its
    /// leader at the end of the step, unless the step sends the leader
    /// something anyway.
    pub(crate) fn wake(&mut self, notify_leader: bool, actions: &[Action]) {
        if !self.quiescent {
            return;
        }
        self.quiescent = false;
        let at = actions.len();
        match &mut self.role {
            RoleState::Leader(state) => {
                state.idle_ticks = 0;
                // Who answered before the group went quiet says nothing about
                // who is there now: the leader must hear from a quorum within
                // a full election timeout from now.
                state.check_quorum_elapsed = 0;
                for progress in state.progress.values_mut() {
                    progress.recent_active = false;
                }
                state.wake_heartbeat_due = true;
                self.heartbeat_elapsed = 0;
            }
            RoleState::Follower => {
                if notify_leader {
                    self.wake_leader = self.leader.map(|leader| (leader, at));
                }
            }
            RoleState::PreCandidate(_) | RoleState::Candidate(_) => {
                debug_assert!(false, "only leaders and followers are ever quiescent");
            }
        }
    }

    /// At the end of a step: a follower that woke for a reason other than
    /// its leader tells the leader, unless it sent the leader something in
    /// this step already (a forwarded request, a vote request), or no longer
    /// follows it.
    pub(crate) fn flush_wake_up(&mut self, actions: &mut Vec<Action>) {
        let Some((leader, from)) = self.wake_leader.take() else {
            return;
        };
        if self.quiescent
            || !matches!(self.role, RoleState::Follower)
            || self.leader != Some(leader)
        {
            return;
        }
        let told = actions.get(from..).is_some_and(|since| {
            since
                .iter()
                .any(|a| matches!(a, Action::Send(m) if m.to == leader))
        });
        if !told {
            self.send(leader, MessageBody::WakeUp, actions);
        }
    }

    /// Whether a client request needs more than this node's state as it is
    /// (and so wakes a quiescent node and counts as activity on a leader).
    /// A status query, a local read that can be answered now, a campaign
    /// request on a leader and a lease read that is refused at once leave
    /// nothing behind: they need no timer, and a monitor polling them must
    /// not keep thousands of idle groups awake.
    pub(crate) fn request_wakes(&self, request: &Request) -> bool {
        let leading = matches!(self.role, RoleState::Leader(_));
        match request {
            Request::Status => false,
            Request::Read(ReadConsistency::Local { min_applied }) => {
                min_applied.is_some_and(|wanted| wanted > self.applied)
            }
            Request::Read(ReadConsistency::Lease) => {
                leading && self.options.lease_reads && self.options.check_quorum
            }
            Request::Campaign => !leading,
            Request::Propose(_)
            | Request::Read(ReadConsistency::Linearizable)
            | Request::ChangeMembership(_)
            | Request::TransferLeadership(_) => true,
        }
    }
}
