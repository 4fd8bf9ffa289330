//! Elections: pre-vote, campaigning, voting, and role transitions.

use std::collections::BTreeMap;

use crate::io::Action;
use crate::message::MessageBody;
use crate::node::{Campaign, LeaderState, RaftNode, RoleState};
use crate::progress::Progress;
use crate::quorum::{vote_result, VoteResult};
use crate::request::RequestError;
use crate::types::{Entry, EntryPayload, Index, NodeId, Term};

impl RaftNode {
    /// Starts an election (with a pre-vote round first unless `transfer`).
    pub(crate) fn campaign(&mut self, transfer: bool, actions: &mut Vec<Action>) {
        if !self.can_campaign() {
            return;
        }
        if self.options.pre_vote && !transfer {
            self.become_pre_candidate(actions);
        } else {
            self.become_candidate(transfer, actions);
        }
    }

    pub(crate) fn voters_except_self(&self) -> Vec<NodeId> {
        let id = self.options.id;
        self.config
            .voters
            .iter()
            .chain(&self.config.voters_outgoing)
            .copied()
            .filter(|&v| v != id)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    fn become_pre_candidate(&mut self, actions: &mut Vec<Action>) {
        self.leave_leader(actions);
        self.quiescent = false;
        self.leader = None;
        let mut votes = BTreeMap::new();
        votes.insert(self.options.id, true);
        self.role = RoleState::PreCandidate(Campaign {
            votes,
            self_vote_seq: 0,
            transfer: false,
        });
        self.election_elapsed = 0;
        self.reset_election_timeout();
        let body = self.vote_request(true, false);
        for voter in self.voters_except_self() {
            let mut message = self.message(voter, body.clone());
            message.term = self.term + 1;
            actions.push(Action::Send(message));
        }
        self.check_election(actions);
    }

    fn become_candidate(&mut self, transfer: bool, actions: &mut Vec<Action>) {
        self.leave_leader(actions);
        self.quiescent = false;
        self.term += 1;
        self.vote = Some(self.options.id);
        self.leader = None;
        let mut votes = BTreeMap::new();
        votes.insert(self.options.id, true);
        // The flush at the end of this step issues the persist with this seq.
        let self_vote_seq = self.next_seq;
        self.role = RoleState::Candidate(Campaign {
            votes,
            self_vote_seq,
            transfer,
        });
        self.election_elapsed = 0;
        self.reset_election_timeout();
        self.on_leader_unknown(actions);
        let body = self.vote_request(false, transfer);
        for voter in self.voters_except_self() {
            self.send_after_persist(voter, body.clone(), actions);
        }
        self.check_election(actions);
    }

    pub(crate) fn vote_request(&self, pre_vote: bool, transfer: bool) -> MessageBody {
        MessageBody::RequestVote {
            pre_vote,
            last_log_index: self.log.last_index(),
            last_log_term: self.log.last_term(),
            transfer,
        }
    }

    /// Re-sends the vote request to `peer` (after the transport reconnected).
    pub(crate) fn resend_vote_request(&mut self, peer: NodeId, actions: &mut Vec<Action>) {
        if !self.config.is_voter(peer) {
            return;
        }
        match &self.role {
            RoleState::PreCandidate(campaign) if !campaign.votes.contains_key(&peer) => {
                let mut message = self.message(peer, self.vote_request(true, false));
                message.term = self.term + 1;
                actions.push(Action::Send(message));
            }
            RoleState::Candidate(campaign) if !campaign.votes.contains_key(&peer) => {
                let body = self.vote_request(false, campaign.transfer);
                self.send_after_persist(peer, body, actions);
            }
            RoleState::PreCandidate(_)
            | RoleState::Candidate(_)
            | RoleState::Follower
            | RoleState::Leader(_) => {}
        }
    }

    /// Counts the votes; wins or loses the election if decided.
    pub(crate) fn check_election(&mut self, actions: &mut Vec<Action>) {
        let id = self.options.id;
        let durable = self.persisted_seq;
        let (result, pre, transfer) = match &self.role {
            RoleState::PreCandidate(c) => (
                vote_result(&self.config, |v| c.votes.get(&v).copied()),
                true,
                false,
            ),
            RoleState::Candidate(c) => {
                let own_vote_durable = durable >= c.self_vote_seq;
                let result = vote_result(&self.config, |v| {
                    if v == id && !own_vote_durable {
                        None
                    } else {
                        c.votes.get(&v).copied()
                    }
                });
                (result, false, c.transfer)
            }
            RoleState::Follower | RoleState::Leader(_) => return,
        };
        let _ = transfer;
        match result {
            VoteResult::Won if pre => self.become_candidate(false, actions),
            VoteResult::Won => self.become_leader(actions),
            VoteResult::Lost => self.become_follower(self.term, None, actions),
            VoteResult::Pending => {}
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn handle_request_vote(
        &mut self,
        from: NodeId,
        message_term: Term,
        pre_vote: bool,
        last_log_index: Index,
        last_log_term: Term,
        transfer: bool,
        actions: &mut Vec<Action>,
    ) {
        let up_to_date = self.log.is_up_to_date(last_log_index, last_log_term);
        if pre_vote {
            // Would we vote in the term the pre-candidate would campaign in?
            let in_lease = self.in_leader_lease() && !transfer;
            let granted = up_to_date
                && !in_lease
                && (message_term > self.term
                    || (message_term == self.term
                        && (self.vote == Some(from)
                            || (self.vote.is_none() && self.leader.is_none()))));
            let mut message = self.message(from, self.vote_response(true, granted));
            if granted {
                message.term = message_term;
            }
            actions.push(Action::Send(message));
            return;
        }
        debug_assert!(message_term <= self.term);
        let can_vote = self.vote == Some(from) || (self.vote.is_none() && self.leader.is_none());
        let granted = message_term == self.term && can_vote && up_to_date;
        if granted {
            self.vote = Some(from);
            self.election_elapsed = 0;
        }
        let response = self.vote_response(false, granted);
        self.send_after_persist(from, response, actions);
    }

    pub(crate) fn handle_vote_response(
        &mut self,
        from: NodeId,
        message_term: Term,
        pre_vote: bool,
        granted: bool,
        (commit, commit_term): (Index, Term),
        actions: &mut Vec<Action>,
    ) {
        let term = self.term;
        let current = match &self.role {
            RoleState::PreCandidate(_) => {
                pre_vote && (message_term == term + 1 || (!granted && message_term == term))
            }
            RoleState::Candidate(_) => !pre_vote && message_term == term,
            // An answer to an election this node is no longer running.
            RoleState::Follower | RoleState::Leader(_) => false,
        };
        if !current {
            return;
        }
        // May put another configuration in force, or end the campaign.
        self.learn_commit(commit, commit_term, actions);
        let (RoleState::PreCandidate(campaign) | RoleState::Candidate(campaign)) = &mut self.role
        else {
            return;
        };
        campaign.votes.insert(from, granted);
        self.check_election(actions);
    }

    /// Becomes a follower in `term` (a newer term resets the vote).
    pub(crate) fn become_follower(
        &mut self,
        term: Term,
        leader: Option<NodeId>,
        actions: &mut Vec<Action>,
    ) {
        assert!(term >= self.term, "terms never go back");
        self.leave_leader(actions);
        // Every role change starts with timers running: quiescence is
        // entered only by an idle leader's notice, never carried across.
        self.quiescent = false;
        if term > self.term {
            self.term = term;
            self.vote = None;
            self.leader_verified_index = 0;
        }
        self.role = RoleState::Follower;
        let changed = self.leader != leader;
        if changed {
            // What this node verified against the old leader's log says
            // nothing about the new one's.
            self.leader_verified_index = 0;
        }
        self.leader = leader;
        self.election_elapsed = 0;
        self.reset_election_timeout();
        if changed {
            if leader.is_some() {
                self.on_leader_known(actions);
            } else {
                self.on_leader_unknown(actions);
            }
        }
    }

    /// Leaves the leader role (if leader): pending reads fail, since this
    /// node can no longer confirm them.
    fn leave_leader(&mut self, actions: &mut Vec<Action>) {
        let RoleState::Leader(state) = std::mem::replace(&mut self.role, RoleState::Follower)
        else {
            return;
        };
        let mut failed: Vec<_> = state.pending_reads.iter().map(|r| r.origin).collect();
        failed.extend(state.reads_awaiting_noop.iter().map(|(o, _)| *o));
        for origin in failed {
            self.answer_read_origin(origin, Err(RequestError::LeadershipLost), actions);
        }
    }

    fn become_leader(&mut self, actions: &mut Vec<Action>) {
        let id = self.options.id;
        self.leader = Some(id);
        let last = self.log.last_index();
        let state = LeaderState {
            progress: BTreeMap::new(),
            transfer: None,
            rounds: Default::default(),
            round: 0,
            fresh_round: None,
            pending_reads: Default::default(),
            reads_awaiting_noop: Vec::new(),
            check_quorum_elapsed: 0,
            lease_not_before_tick: self.now_tick,
            unsent_entries: true,
            retiring: BTreeMap::new(),
            idle_ticks: 0,
            wake_heartbeat_due: false,
        };
        self.role = RoleState::Leader(Box::new(state));
        self.quiescent = false;
        self.sync_progress_with_config();
        if let RoleState::Leader(state) = &mut self.role {
            for progress in state.progress.values_mut() {
                *progress = Progress::new(last + 1);
            }
        }
        self.heartbeat_elapsed = 0;
        self.election_elapsed = 0;
        self.log.append_new(Entry {
            term: self.term,
            index: last + 1,
            payload: EntryPayload::Noop,
        });
        // A joint configuration inherited from the previous leader is left
        // once this leader commits its first entry (see on_leader_commit).
        self.on_leader_known(actions);
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::test_options;
    use crate::{Action, Input, Message, MessageBody, RaftNode, RestoredState, Role};

    fn node() -> RaftNode {
        RaftNode::new(test_options(1), RestoredState::bootstrap([1, 2, 3]), 3).unwrap()
    }

    fn sent(actions: &[Action]) -> Vec<&Message> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send(m) => Some(m),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn pre_vote_does_not_raise_the_term() {
        let mut n = node();
        let mut actions = Vec::new();
        while n.role() != Role::PreCandidate {
            n.step(Input::Tick, &mut actions);
        }
        assert_eq!(n.term(), 0);
        let requests: Vec<_> = sent(&actions)
            .into_iter()
            .filter(|m| matches!(m.body, MessageBody::RequestVote { pre_vote: true, .. }))
            .collect();
        assert_eq!(requests.len(), 2);
        assert!(requests.iter().all(|m| m.term == 1));
    }

    #[test]
    fn candidate_vote_requests_wait_for_the_durable_vote() {
        let mut n = node();
        let mut actions = Vec::new();
        while n.role() != Role::PreCandidate {
            n.step(Input::Tick, &mut actions);
        }
        actions.clear();
        let grant = MessageBody::RequestVoteResponse {
            pre_vote: true,
            granted: true,
            commit: 0,
            commit_term: 0,
        };
        n.step(
            Input::Message(Message {
                group: 1,
                from: 2,
                to: 1,
                term: 1,
                body: grant,
            }),
            &mut actions,
        );
        assert_eq!(n.role(), Role::Candidate);
        assert!(
            sent(&actions).is_empty(),
            "vote requests went out before the vote was durable"
        );
        let seq = actions
            .iter()
            .find_map(|a| match a {
                Action::Persist(p) => Some(p.seq),
                _ => None,
            })
            .unwrap();
        actions.clear();
        n.step(Input::Persisted { seq }, &mut actions);
        assert_eq!(sent(&actions).len(), 2);
    }

    #[test]
    fn a_node_votes_once_per_term() {
        let mut n = node();
        let mut actions = Vec::new();
        let ask = |_from: u64| MessageBody::RequestVote {
            pre_vote: false,
            last_log_index: 0,
            last_log_term: 0,
            transfer: false,
        };
        n.step(
            Input::Message(Message {
                group: 1,
                from: 2,
                to: 1,
                term: 1,
                body: ask(2),
            }),
            &mut actions,
        );
        n.step(
            Input::Message(Message {
                group: 1,
                from: 3,
                to: 1,
                term: 1,
                body: ask(3),
            }),
            &mut actions,
        );
        n.step(Input::Persisted { seq: 1 }, &mut actions);
        let answers: Vec<_> = sent(&actions)
            .into_iter()
            .filter_map(|m| match m.body {
                MessageBody::RequestVoteResponse { granted, .. } => Some((m.to, granted)),
                _ => None,
            })
            .collect();
        assert_eq!(answers, vec![(2, true), (3, false)]);
    }
}
