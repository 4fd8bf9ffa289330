//! The liveness phase: every fault off, then the cluster must converge
//! within a bound counted in election timeouts: every group, those without
//! any client traffic too.

use super::*;

impl Simulation {
    pub(super) fn liveness_bound_us(&self) -> u64 {
        let election = u64::from(self.config.engine.election_timeout_ticks) * TICK_US;
        // Slow clocks stretch timeouts; allow for the slowest drift.
        let stretch = 100 + self.config.faults.drift_percent_max;
        self.config.liveness_election_timeouts * election * stretch / 100 + self.client_timeout_us()
    }

    /// How long a sync that took the simulated disk `disk_us` lasts in
    /// this phase: as drawn in the main phase, at most an eighth of the
    /// election timeout in the liveness phase. A slow sync is a fault like
    /// a slow message: Raft elects a leader only when a vote round (two
    /// durable writes, each perhaps queued behind the sync in flight, which
    /// with many groups sharing a node's log is the rule, and two message
    /// delays) fits in the election timeout with room to spare. With syncs
    /// of up to six milliseconds against an eight-millisecond timeout, the
    /// candidates of a group timed out before their votes came back, round
    /// after round, past the liveness bound (seeds 315517 and 317537 with
    /// 8 groups).
    pub(super) fn sync_us_in_phase(&self, disk_us: u64) -> u64 {
        match self.phase {
            Phase::Main | Phase::Done => disk_us,
            Phase::Liveness { .. } => {
                let election_us = u64::from(self.config.engine.election_timeout_ticks) * TICK_US;
                disk_us.min(election_us / 8)
            }
        }
    }

    pub(super) fn start_liveness(&mut self) {
        if self.phase != Phase::Main {
            return;
        }
        let deadline_us = self.now_us + self.liveness_bound_us();
        self.phase = Phase::Liveness { deadline_us };
        self.liveness_started_us = self.now_us;
        self.log(None, "liveness phase: faults off");
        let mut net = self.net.config().clone();
        net.loss_ppm = 0;
        net.duplicate_ppm = 0;
        net.slow_ppm = 0;
        self.net.set_config(net);
        if !self.net.partition().blocked.is_empty() {
            self.apply_partition(Partition::default());
        }
        for (from, to) in self.net.clogged_links() {
            self.unclog(from, to);
        }
        // Clock drift is a fault too: every clock runs at the nominal rate.
        for node in self.nodes.values_mut() {
            node.tick_period_us = TICK_US;
        }
        let ids: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.started && !n.disk_lost)
            .map(|n| n.id)
            .collect();
        for id in ids {
            if !self.is_running(id) {
                self.coverage.hit(Counter::CrashRestart);
                self.start_node(id);
            } else {
                self.resume(id);
            }
        }
        self.schedule(TICK_US, Event::LivenessCheck);
    }

    /// Why the cluster has not converged yet; `None` once it has: every
    /// group, idle ones included, has converged, and every client
    /// operation has completed.
    pub(super) fn convergence_gap(&self) -> Option<String> {
        for group in self.group_ids() {
            if let Some(gap) = self.group_convergence_gap(group) {
                return Some(format!("{}{gap}", self.group_prefix(group)));
            }
        }
        if let Some(c) = self.clients.iter().find(|c| c.op.is_some()) {
            return Some(format!(
                "client c{} has an operation in flight",
                c.client_id
            ));
        }
        None
    }

    /// Why one group has not converged yet: it needs one leader, followed
    /// by every healthy member, with its whole log committed and applied
    /// everywhere. A group without clients is held to the same: if its
    /// leader crashed, it must have elected another.
    fn group_convergence_gap(&self, group: GroupId) -> Option<String> {
        let Some(leader_id) = self.group_leader(group) else {
            return Some("no leader".into());
        };
        let leader = self.group_engine(leader_id, group)?;
        let config = leader.config();
        if config.is_joint() {
            return Some(format!(
                "leader {leader_id} is still in a joint configuration"
            ));
        }
        if leader.commit_index() < leader.last_index() {
            return Some(format!(
                "leader {leader_id} has committed {} of {}",
                leader.commit_index(),
                leader.last_index()
            ));
        }
        for member in config.members() {
            // A node whose disk was found corrupt stays down: liveness is
            // judged over the healthy nodes (a majority by construction).
            if self.nodes.get(&member).is_some_and(|n| n.disk_lost) {
                continue;
            }
            let Some(engine) = self.group_engine(member, group) else {
                return Some(format!("member {member} is not running"));
            };
            let applied = self.group_machine(member, group).map_or(0, |m| m.applied());
            if member != leader_id
                && (engine.leader() != Some(leader_id) || engine.term() != leader.term())
            {
                return Some(format!(
                    "member {member} follows {:?} in term {}, not {leader_id} in term {}",
                    engine.leader(),
                    engine.term(),
                    leader.term()
                ));
            }
            if engine.commit_index() != leader.commit_index() || applied != leader.commit_index() {
                return Some(format!(
                    "member {member} has commit {} applied {applied}, leader {leader_id} commit {}",
                    engine.commit_index(),
                    leader.commit_index()
                ));
            }
        }
        let other_leaders = self
            .nodes
            .values()
            .filter_map(|n| n.engine(group))
            .filter(|e| e.role() == Role::Leader && e.id() != leader_id)
            .count();
        if other_leaders > 0 {
            return Some(format!("{other_leaders} other nodes still think they lead"));
        }
        None
    }

    /// Every running replica's state, one item each, for a liveness failure.
    fn replica_states(&self) -> Vec<String> {
        let mut states = Vec::new();
        for group in self.group_ids() {
            let label = if self.config.groups > 1 {
                format!("g{group}:")
            } else {
                String::new()
            };
            for e in self.nodes.values().filter_map(|n| n.engine(group)) {
                states.push(format!(
                    "{label}n{}:{:?}/t{}/leader{:?}/last{}/commit{}/applied{}/voters{:?}{}{}",
                    e.id(),
                    e.role(),
                    e.term(),
                    e.leader(),
                    e.last_index(),
                    e.commit_index(),
                    e.applied_index(),
                    e.config().voters,
                    if e.config().voters_outgoing.is_empty() {
                        String::new()
                    } else {
                        format!("+outgoing{:?}", e.config().voters_outgoing)
                    },
                    if e.is_receiving_snapshot() {
                        "/receiving-snapshot"
                    } else {
                        ""
                    }
                ));
            }
        }
        states
    }

    pub(super) fn liveness_check(&mut self) {
        let Phase::Liveness { deadline_us } = self.phase else {
            return;
        };
        match self.convergence_gap() {
            None => {
                self.log(None, "liveness: converged");
                self.converged_after_us = Some(self.now_us - self.liveness_started_us);
                self.phase = Phase::Done;
            }
            Some(gap) if self.now_us >= deadline_us => {
                let states = self.replica_states();
                self.fail(
                    FailureKind::Liveness,
                    format!(
                        "not converged {}us after faults stopped: {gap}; nodes: {}",
                        self.liveness_bound_us(),
                        states.join(" ")
                    ),
                );
            }
            Some(_) => self.schedule(TICK_US, Event::LivenessCheck),
        }
    }
}
