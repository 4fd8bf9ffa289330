//! Membership changes issued during the run, and the routing of client and
//! admin requests to nodes and of their answers back. Membership is a
//! group's: each change goes to one active group (with several, drawn from
//! the multi-group stream), so the groups' configurations drift apart; a
//! spare node, once started, hosts every group and may join each of them
//! once.

use super::*;

impl Simulation {
    pub(super) fn next_membership(&mut self) {
        if self.phase != Phase::Main {
            return;
        }
        let next = self
            .rng
            .range(1, 2 * self.config.faults.membership_interval_us);
        self.schedule(next, Event::NextMembership);
        // Idle groups get no requests at all, not even these: only their
        // own engines' traffic (and, for a lost disk, its replacement).
        let group = if self.config.groups > 1 {
            let groups = self.config.active_group_ids();
            self.group_rng.pick(&groups).copied().unwrap_or(GROUP)
        } else {
            GROUP
        };
        let Some(leader) = self.group_leader(group) else {
            return;
        };
        let Some(config) = self.group_engine(leader, group).map(|e| e.config().clone()) else {
            return;
        };
        let spares: Vec<NodeId> = self
            .all_ids
            .iter()
            .copied()
            .filter(|id| {
                !config.contains(*id)
                    && !self.ever_added.contains(&(group, *id))
                    && !self.config.voter_ids().contains(id)
                    && !self.config.replacement_ids().contains(id)
            })
            .collect();
        let learners: Vec<NodeId> = config.learners.iter().copied().collect();
        let voters: Vec<NodeId> = config.voters.iter().copied().collect();
        let request = match self.rng.range(0, 8) {
            0 | 1 => match self.rng.pick(&spares) {
                Some(&spare) => {
                    self.ever_added.insert((group, spare));
                    self.start_node(spare);
                    Request::ChangeMembership(MembershipChange::AddLearner(spare))
                }
                None => return,
            },
            2 => match self.rng.pick(&spares) {
                // A voter added directly, through joint consensus. It counts
                // in the quorum before it has anything, also while another
                // voter's disk is damaged (regression:
                // a_joining_voter_that_knows_no_configuration_still_votes).
                Some(&spare) if voters.len() < 7 => {
                    self.ever_added.insert((group, spare));
                    self.start_node(spare);
                    Request::ChangeMembership(MembershipChange::AddVoter(spare))
                }
                _ => return,
            },
            3 => match self.rng.pick(&learners) {
                Some(&learner) => {
                    Request::ChangeMembership(MembershipChange::PromoteLearner(learner))
                }
                None => return,
            },
            4 => {
                // Remove a voter (keeping at least three) or a learner.
                let removable: Vec<NodeId> = if voters.len() > 3 && !config.is_joint() {
                    voters.iter().chain(&learners).copied().collect()
                } else {
                    learners.clone()
                };
                match self.rng.pick(&removable) {
                    Some(&member) => Request::ChangeMembership(MembershipChange::Remove(member)),
                    None => return,
                }
            }
            5 => {
                // Requests that make no sense must be refused, not dropped:
                // a transfer to a non-voter, a promotion of a voter.
                let all = self.all_ids.clone();
                match self.rng.pick(&all) {
                    Some(&id) if self.rng.chance_percent(50) => Request::TransferLeadership(id),
                    Some(&id) => Request::ChangeMembership(MembershipChange::PromoteLearner(id)),
                    None => return,
                }
            }
            _ => match self.rng.pick(&voters) {
                Some(&voter) => Request::TransferLeadership(voter),
                None => return,
            },
        };
        let started: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.running())
            .map(|n| n.id)
            .collect();
        if let Some(&target) = self.rng.pick(&started) {
            self.log_group(Some(target), group, &format!("admin request {request:?}"));
            self.send_request(target, group, request, Owner::Admin { group });
        }
    }

    pub(super) fn send_request(
        &mut self,
        node: NodeId,
        group: GroupId,
        request: Request,
        owner: Owner,
    ) {
        let Some(n) = self.nodes.get_mut(&node) else {
            return;
        };
        let id = RequestId(n.next_request_id);
        n.next_request_id += 1;
        if let Request::TransferLeadership(target) = request {
            let deadline =
                self.now_us + 4 * u64::from(self.config.engine.election_timeout_ticks) * TICK_US;
            self.transfer_target = Some((group, target, deadline));
        }
        self.owners.insert((node, id), owner);
        self.feed(node, group, Input::Client { id, request });
    }

    pub(super) fn on_response(
        &mut self,
        node: NodeId,
        request: RequestId,
        result: Result<Response, RequestError>,
    ) {
        let Some(owner) = self.owners.remove(&(node, request)) else {
            return;
        };
        match owner {
            Owner::Client { slot, uid } => self.client_response(slot, uid, node, result),
            Owner::Admin { group } => {
                self.log_group(Some(node), group, &format!("admin response {result:?}"))
            }
            Owner::Probe { tag, group } => {
                self.log_group(
                    Some(node),
                    group,
                    &format!("probe {tag} response {result:?}"),
                );
                self.probe_responses.insert(tag, result);
            }
        }
    }
}
