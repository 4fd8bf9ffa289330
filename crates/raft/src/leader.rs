//! The leader: replication (probe / replicate / snapshot per follower),
//! heartbeat rounds (which also confirm reads and the lease), commit,
//! check-quorum, snapshot sending and leadership transfer.

use bytes::Bytes;

use crate::fault::Fault;
use crate::io::Action;
use crate::message::{AppendResult, MessageBody, SnapshotOutcome, COMMIT_NOTICE_READ_SEQ};
use crate::node::{LeaderState, RaftNode, RoleState, Transfer, ROUNDS_REMEMBERED_MAX};
use crate::progress::{EntriesLoad, Progress, ReplicationState, SnapshotTransfer};
use crate::quorum::{committed_index, is_quorum};
use crate::request::{RequestError, Response};
use crate::types::{Entry, EntryPayload, Index, NodeId, Term};

/// Snapshot chunk timeouts in a row, without any progress, after which the
/// leader abandons the transfer and probes the follower afresh.
pub(crate) const SNAPSHOT_TIMEOUTS_MAX: u32 = 3;

/// How long (in election timeouts) a leader keeps replicating to a removed
/// member, so that it learns of the commit that removed it.
pub(crate) const RETIRING_ELECTION_TIMEOUTS: u32 = 4;

/// Heartbeat answers in a row without the match index moving, while entries
/// are outstanding, after which the leader assumes an append was lost.
pub(crate) const STALLED_HEARTBEATS_MAX: u32 = 3;

impl RaftNode {
    pub(crate) fn leader_state(&self) -> Option<&LeaderState> {
        match &self.role {
            RoleState::Leader(state) => Some(state),
            RoleState::Follower | RoleState::PreCandidate(_) | RoleState::Candidate(_) => None,
        }
    }

    pub(crate) fn leader_state_mut(&mut self) -> Option<&mut LeaderState> {
        match &mut self.role {
            RoleState::Leader(state) => Some(state),
            RoleState::Follower | RoleState::PreCandidate(_) | RoleState::Candidate(_) => None,
        }
    }

    /// Keeps a progress for every member of the configuration in force and
    /// of the newest configuration in the log (so new members catch up
    /// before their change commits).
    pub(crate) fn sync_progress_with_config(&mut self) {
        let id = self.options.id;
        let latest = self.log.config_at(self.log.last_index());
        let mut members = self.config.members();
        members.extend(latest.members());
        members.remove(&id);
        let next = self.log.last_index() + 1;
        let retire_ticks = self
            .options
            .election_timeout_ticks
            .saturating_mul(RETIRING_ELECTION_TIMEOUTS);
        let Some(state) = self.leader_state_mut() else {
            return;
        };
        for peer in state.progress.keys() {
            if !members.contains(peer) {
                state.retiring.entry(*peer).or_insert(retire_ticks);
            }
        }
        for peer in members {
            state.retiring.remove(&peer);
            state
                .progress
                .entry(peer)
                .or_insert_with(|| Progress::new(next));
        }
    }

    pub(crate) fn broadcast_append(&mut self, actions: &mut Vec<Action>) {
        let peers: Vec<NodeId> = match self.leader_state() {
            Some(state) => state.progress.keys().copied().collect(),
            None => return,
        };
        for peer in peers {
            self.send_append(peer, false, actions);
        }
    }

    /// Sends `peer` what it needs next, if its state allows: entries from
    /// its next index, or (when those are compacted) a snapshot. Entries
    /// whose bodies were evicted from memory are loaded from storage first
    /// ([`Action::LoadEntries`], one load at a time per follower) and sent
    /// when they come back (`handle_entries_loaded`).
    pub(crate) fn send_append(
        &mut self,
        peer: NodeId,
        send_if_empty: bool,
        actions: &mut Vec<Action>,
    ) {
        let last = self.log.last_index();
        let held_first = self.log.held_first_index();
        let term = self.term;
        let (messages_max, bytes_max, append_max) = (
            self.options.inflight_messages_max,
            self.options.inflight_bytes_max,
            self.options.append_bytes_max,
        );
        let Some(state) = self.leader_state() else {
            return;
        };
        let Some(progress) = state.progress.get(&peer) else {
            return;
        };
        let remaining_bytes = match &progress.state {
            ReplicationState::Snapshot(_) | ReplicationState::Probe { paused: true } => return,
            ReplicationState::Replicate => {
                if progress.inflights.is_full(messages_max, bytes_max) {
                    return;
                }
                bytes_max - progress.inflights.bytes()
            }
            ReplicationState::Probe { paused: false } => append_max,
        };
        if progress.loading.is_some() {
            // Its next entries are being loaded; they go out when they come.
            return;
        }
        let next = progress.next_index;
        let prev = next - 1;
        let Some(prev_term) = self.log.term_at(prev) else {
            self.start_snapshot(peer, actions);
            return;
        };
        if next <= last && next < held_first {
            // Evicted from memory (durable, so storage has them unless a
            // snapshot compacted them since: then the answer is None).
            let load = EntriesLoad {
                from: next,
                through: held_first - 1,
                max_bytes: append_max.min(remaining_bytes),
            };
            let Some(progress) = self
                .leader_state_mut()
                .and_then(|s| s.progress.get_mut(&peer))
            else {
                return;
            };
            progress.loading = Some(load);
            if let ReplicationState::Probe { paused } = &mut progress.state {
                // Like the probe it stands for: the next heartbeat round
                // unpauses and forgets it, so that a lost answer is asked
                // for again.
                *paused = true;
            }
            actions.push(Action::LoadEntries {
                to: peer,
                term,
                from: load.from,
                through: load.through,
                max_bytes: load.max_bytes,
            });
            return;
        }
        let entries = if next <= last {
            self.log.slice(next, last, append_max.min(remaining_bytes))
        } else {
            Vec::new()
        };
        if entries.is_empty() && !send_if_empty {
            return;
        }
        self.send_entries(peer, prev, prev_term, entries, actions);
    }

    /// Sends `peer` an append of `entries` after (`prev`, `prev_term`) and
    /// records it (in the window when replicating, as the probe otherwise).
    fn send_entries(
        &mut self,
        peer: NodeId,
        prev: Index,
        prev_term: Term,
        entries: Vec<Entry>,
        actions: &mut Vec<Action>,
    ) {
        let commit = self.commit;
        let sent_bytes: u64 = entries.iter().map(Entry::size_bytes).sum();
        let last_sent = prev + entries.len() as u64;
        let Some(state) = self.leader_state_mut() else {
            return;
        };
        let Some(progress) = state.progress.get_mut(&peer) else {
            return;
        };
        match &mut progress.state {
            ReplicationState::Replicate => {
                if !entries.is_empty() {
                    progress.inflights.add(last_sent, sent_bytes);
                    progress.next_index = last_sent + 1;
                }
            }
            ReplicationState::Probe { paused } => *paused = true,
            ReplicationState::Snapshot(_) => unreachable_snapshot(),
        }
        // Accepted, it lets the follower commit up to here.
        progress.commit_sent = progress.commit_sent.max(commit.min(last_sent));
        self.send(
            peer,
            MessageBody::Append {
                prev_log_index: prev,
                prev_log_term: prev_term,
                entries,
                leader_commit: commit,
            },
            actions,
        );
    }

    /// The answer to a [`Action::LoadEntries`]: entries for `to` from
    /// `from` on, or `None` if storage no longer has them. Used only if it
    /// answers the load outstanding for `to` in this term and the follower
    /// still needs exactly those; checked against the log's terms and
    /// configurations (a mismatch is a fault of storage: nothing is sent,
    /// and the next heartbeat round asks again). `None` sends the snapshot
    /// if it covers `from`, and otherwise (a failed read) asks again with
    /// the next heartbeat round.
    pub(crate) fn handle_entries_loaded(
        &mut self,
        to: NodeId,
        term: Term,
        from: Index,
        entries: Option<Vec<Entry>>,
        actions: &mut Vec<Action>,
    ) {
        if term != self.term {
            return; // asked by an earlier leadership
        }
        let Some(progress) = self
            .leader_state_mut()
            .and_then(|s| s.progress.get_mut(&to))
        else {
            return; // not leading, or no longer a member
        };
        let Some(load) = progress.loading.filter(|load| load.from == from) else {
            return; // not the load outstanding: superseded or duplicated
        };
        progress.loading = None;
        let still_needed = progress.next_index == from
            && match progress.state {
                ReplicationState::Replicate | ReplicationState::Probe { .. } => true,
                ReplicationState::Snapshot(_) => false,
            };
        if !still_needed {
            // The follower moved on (its answer came first): send what it
            // needs now.
            self.send_append(to, false, actions);
            return;
        }
        let Some(mut entries) = entries else {
            if self.log.snapshot().index >= from {
                // Storage no longer has them (compacted), or cannot read
                // them: the snapshot covers them.
                self.start_snapshot(to, actions);
            } else {
                // No snapshot covers them, so storage must have them: a
                // failed read. Ask again with the next heartbeat round.
                self.retry_load_at_heartbeat(to);
            }
            return;
        };
        let prev = from - 1;
        let Some(prev_term) = self.log.term_at(prev) else {
            // A snapshot compacted them while they were read: it covers them.
            self.start_snapshot(to, actions);
            return;
        };
        if let Err(mismatch) = self.log.check_loaded(from, load.through, &entries) {
            actions.push(Action::Fault(Fault::LoadedEntriesInvalid {
                peer: to,
                from,
                index: mismatch.index,
                reason: mismatch.reason,
            }));
            // Nothing of it is sent. The next heartbeat round asks again:
            // a storage that keeps answering wrongly costs one load and one
            // report per round, not a storm.
            self.retry_load_at_heartbeat(to);
            return;
        }
        // Keep to what the window allowed when the load was asked for.
        let mut bytes = 0u64;
        let keep = entries
            .iter()
            .take_while(|e| {
                bytes = bytes.saturating_add(e.size_bytes());
                bytes <= load.max_bytes
            })
            .count()
            .max(1);
        entries.truncate(keep);
        self.send_entries(to, prev, prev_term, entries, actions);
        // Replicating: the window may take the next batch (loaded or held).
        self.send_append(to, false, actions);
    }

    /// A load for `peer` failed: probe it, paused until the next heartbeat
    /// round (which unpauses it, and its answer asks again), as after a
    /// probe that got no answer.
    fn retry_load_at_heartbeat(&mut self, peer: NodeId) {
        if let Some(progress) = self
            .leader_state_mut()
            .and_then(|s| s.progress.get_mut(&peer))
        {
            progress.become_probe();
            progress.state = ReplicationState::Probe { paused: true };
        }
    }

    /// Starts a heartbeat round: every peer is asked to confirm this
    /// leadership; the answers confirm pending reads and renew the lease.
    pub(crate) fn broadcast_heartbeat(&mut self, actions: &mut Vec<Action>) -> u64 {
        let now = self.now_tick;
        let commit = self.commit;
        let Some(state) = self.leader_state_mut() else {
            return 0;
        };
        state.round += 1;
        let round = state.round;
        state.fresh_round = Some(round);
        state.rounds.push_back((round, now));
        while state.rounds.len() > ROUNDS_REMEMBERED_MAX {
            state.rounds.pop_front();
        }
        let mut sends = Vec::new();
        for (&peer, progress) in state.progress.iter_mut() {
            if let ReplicationState::Probe { paused } = &mut progress.state {
                // The probe (or the load it waits for) may have been lost:
                // the heartbeat answer will trigger the next one.
                *paused = false;
                progress.loading = None;
            }
            let leader_commit = commit.min(progress.match_index);
            progress.commit_sent = progress.commit_sent.max(leader_commit);
            sends.push((peer, leader_commit));
        }
        for (peer, leader_commit) in sends {
            self.send(
                peer,
                MessageBody::Heartbeat {
                    leader_commit,
                    read_seq: round,
                },
                actions,
            );
        }
        self.check_reads(actions);
        round
    }

    pub(crate) fn tick_leader(&mut self, actions: &mut Vec<Action>) {
        let election_timeout = self.options.election_timeout_ticks;
        let idle_long_enough = self.count_idle_tick();
        self.heartbeat_elapsed += 1;
        if self.heartbeat_elapsed >= self.options.heartbeat_interval_ticks {
            self.heartbeat_elapsed = 0;
            if idle_long_enough {
                // The notice takes the place of this heartbeat round; with
                // the group idle there is no transfer, no retiring member
                // and no snapshot transfer for the rest of this tick to
                // advance, and check-quorum stops with the heartbeats.
                self.quiesce_group(actions);
                return;
            }
            self.broadcast_heartbeat(actions);
        }
        // Check-quorum.
        let check_quorum = self.options.check_quorum;
        let id = self.options.id;
        let mut step_down = false;
        if let RoleState::Leader(state) = &mut self.role {
            state.check_quorum_elapsed += 1;
            if state.check_quorum_elapsed >= election_timeout {
                state.check_quorum_elapsed = 0;
                let active = |peer: NodeId| {
                    peer == id || state.progress.get(&peer).is_some_and(|p| p.recent_active)
                };
                if check_quorum && !is_quorum(&self.config, active) {
                    step_down = true;
                }
                for progress in state.progress.values_mut() {
                    progress.recent_active = false;
                }
            }
            state.retiring.retain(|_, ticks| {
                *ticks = ticks.saturating_sub(1);
                *ticks > 0
            });
            let retiring = &state.retiring;
            let config = &self.config;
            let latest_members = self.log.config_at(self.log.last_index()).members();
            state.progress.retain(|peer, _| {
                retiring.contains_key(peer)
                    || config.contains(*peer)
                    || latest_members.contains(peer)
            });
            if let Some(transfer) = &mut state.transfer {
                transfer.elapsed_ticks += 1;
                if transfer.elapsed_ticks >= election_timeout {
                    state.transfer = None;
                    state.lease_not_before_tick = self.now_tick;
                }
            }
        }
        if step_down {
            self.become_follower(self.term, None, actions);
            return;
        }
        self.tick_snapshot_transfers(actions);
    }

    fn tick_snapshot_transfers(&mut self, actions: &mut Vec<Action>) {
        let timeout = self.options.snapshot_chunk_timeout_ticks;
        let mut resend = Vec::new();
        let mut abandon = Vec::new();
        let Some(state) = self.leader_state_mut() else {
            return;
        };
        for (&peer, progress) in state.progress.iter_mut() {
            if let ReplicationState::Snapshot(transfer) = &mut progress.state {
                transfer.idle_ticks += 1;
                if transfer.idle_ticks >= timeout {
                    transfer.idle_ticks = 0;
                    transfer.timeouts_in_a_row += 1;
                    if transfer.timeouts_in_a_row >= SNAPSHOT_TIMEOUTS_MAX {
                        abandon.push(peer);
                    } else {
                        resend.push((peer, transfer.acked_offset));
                    }
                }
            }
        }
        for peer in abandon {
            if let Some(progress) = self
                .leader_state_mut()
                .and_then(|s| s.progress.get_mut(&peer))
            {
                // Probe right after the snapshot being sent: if the follower
                // installed it (its answer lost), this append succeeds and
                // replication resumes without any snapshot report; if not,
                // its rejection says where it is.
                let snapshot_index = match &progress.state {
                    ReplicationState::Snapshot(transfer) => transfer.meta.index,
                    ReplicationState::Probe { .. } | ReplicationState::Replicate => 0,
                };
                progress.become_probe();
                progress.next_index = progress.next_index.max(snapshot_index + 1);
            }
            self.send_append(peer, true, actions);
        }
        for (peer, offset) in resend {
            self.resend_snapshot_from(peer, offset, actions);
        }
    }

    /// Commits what a quorum has durably (counting this node only for
    /// entries its own storage has synced), but only entries of this term.
    pub(crate) fn maybe_commit(&mut self, actions: &mut Vec<Action>) {
        let id = self.options.id;
        let durable = self.log.durable_index();
        let Some(state) = self.leader_state() else {
            return;
        };
        let index = committed_index(&self.config, |peer| {
            if peer == id {
                durable
            } else {
                state.progress.get(&peer).map_or(0, |p| p.match_index)
            }
        });
        if index > self.commit && self.log.term_at(index) == Some(self.term) {
            self.commit_to(index, actions);
        }
    }

    /// After the commit index moved on the leader: leave a joint
    /// configuration, release reads waiting for the first entry of the term,
    /// and tell the followers.
    pub(crate) fn on_leader_commit(&mut self, actions: &mut Vec<Action>) {
        let own_term_committed = self.log.term_at(self.commit) == Some(self.term);
        if own_term_committed
            && self.config.is_joint()
            && self.log.last_config_index_after(self.commit).is_none()
        {
            let mut leave = self.config.clone();
            leave.voters_outgoing.clear();
            self.append_entry(EntryPayload::Config(leave));
            self.sync_progress_with_config();
        }
        if own_term_committed {
            let waiting = match self.leader_state_mut() {
                Some(state) => std::mem::take(&mut state.reads_awaiting_noop),
                None => Vec::new(),
            };
            for (origin, deadline) in waiting {
                self.start_read_index(origin, deadline, actions);
            }
        }
        self.send_commit_notices(actions);
    }

    /// Tells the followers of a new commit index now, not with the next
    /// heartbeat: when no entries follow a write, their applies (what
    /// serializable reads and watches served by them see) would lag by up
    /// to a heartbeat interval. (Linearizable reads do not wait for this:
    /// their ReadIndex round carries the commit index.) A follower with
    /// entries to receive gets the commit index with them; the others get a
    /// heartbeat without a read round, which they do not answer (one
    /// message, not two, per follower).
    pub(crate) fn send_commit_notices(&mut self, actions: &mut Vec<Action>) {
        let last = self.log.last_index();
        let commit = self.commit;
        let Some(state) = self.leader_state_mut() else {
            return;
        };
        let mut appends = Vec::new();
        let mut notices = Vec::new();
        for (&peer, progress) in state.progress.iter_mut() {
            // Capped at what its log is known to match, as in heartbeats.
            let leader_commit = commit.min(progress.match_index);
            if leader_commit <= progress.commit_sent {
                continue;
            }
            match progress.state {
                ReplicationState::Replicate | ReplicationState::Probe { paused: false } => {
                    if progress.next_index <= last {
                        appends.push(peer);
                    } else {
                        progress.commit_sent = leader_commit;
                        notices.push((peer, leader_commit));
                    }
                }
                // Told with the next probe or once the snapshot is in.
                ReplicationState::Probe { paused: true } | ReplicationState::Snapshot(_) => {}
            }
        }
        for peer in appends {
            self.send_append(peer, false, actions);
        }
        for (peer, leader_commit) in notices {
            self.send(
                peer,
                MessageBody::Heartbeat {
                    leader_commit,
                    read_seq: COMMIT_NOTICE_READ_SEQ,
                },
                actions,
            );
        }
    }

    /// Appends an entry of the current term to the leader's log.
    pub(crate) fn append_entry(&mut self, payload: EntryPayload) -> Index {
        let index = self.log.last_index() + 1;
        self.log.append_new(Entry {
            term: self.term,
            index,
            payload,
        });
        if let Some(state) = self.leader_state_mut() {
            state.unsent_entries = true;
            state.idle_ticks = 0;
        }
        index
    }

    pub(crate) fn handle_append_response(
        &mut self,
        from: NodeId,
        result: AppendResult,
        actions: &mut Vec<Action>,
    ) {
        let last = self.log.last_index();
        let Some(state) = self.leader_state_mut() else {
            // Not leader (any more): the answer is for a leadership that ended.
            return;
        };
        let round = state.round;
        let Some(progress) = state.progress.get_mut(&from) else {
            return;
        };
        progress.recent_active = true;
        match result {
            AppendResult::Success { match_index } => {
                let match_index = match_index.min(last);
                let news = progress.update_match(match_index);
                if news {
                    progress.match_round = round;
                }
                match &progress.state {
                    ReplicationState::Probe { .. } | ReplicationState::Snapshot(_) => {
                        progress.become_replicate()
                    }
                    ReplicationState::Replicate => {}
                }
                if news {
                    progress.stalled_heartbeats = 0;
                    self.maybe_commit(actions);
                }
                self.send_append(from, false, actions);
                if news {
                    // Its log now matches further: it may take a commit
                    // index it could not take before.
                    self.send_commit_notices(actions);
                }
                self.maybe_send_timeout_now(from, actions);
            }
            AppendResult::Reject {
                rejected_index,
                hint_index,
                hint_term,
            } => {
                if rejected_index <= progress.match_index {
                    let answers_probe = matches!(progress.state, ReplicationState::Probe { .. })
                        && rejected_index + 1 == progress.next_index;
                    if !answers_probe {
                        return; // stale: that part of the log is known to match
                    }
                    // It answers the probe just sent, yet the follower lacks
                    // what it acknowledged: its log went backwards or an
                    // older copy replaced it (one longer than ours is not
                    // seen in its last index). Forget the match and
                    // backtrack as for any rejection. A late duplicate of
                    // an old rejection can look the same: reported as not
                    // certain, and it costs only one more probe round.
                    let fault = Fault::FollowerLogWentBack {
                        peer: from,
                        match_index: progress.match_index,
                        last_index: hint_index,
                        certain: false,
                    };
                    actions.push(Action::Fault(fault));
                    let next = progress.next_index;
                    progress.forget_match(hint_index);
                    progress.next_index = next;
                }
                match &progress.state {
                    ReplicationState::Probe { .. } if rejected_index + 1 != progress.next_index => {
                        return
                    }
                    ReplicationState::Probe { .. }
                    | ReplicationState::Replicate
                    | ReplicationState::Snapshot(_) => {}
                }
                // hint_term == 0 means the follower cannot tell the term at
                // hint_index (empty or compacted there): probe right after it.
                let candidate = if hint_term == 0 {
                    hint_index
                } else {
                    self.log
                        .find_by_term(hint_index, hint_term)
                        .unwrap_or(hint_index)
                };
                let Some(state) = self.leader_state_mut() else {
                    return;
                };
                let Some(progress) = state.progress.get_mut(&from) else {
                    return;
                };
                let next = (candidate + 1)
                    .min(rejected_index)
                    .max(progress.match_index + 1);
                progress.become_probe();
                progress.next_index = next;
                self.send_append(from, true, actions);
            }
        }
    }

    pub(crate) fn handle_heartbeat_response(
        &mut self,
        from: NodeId,
        round: u64,
        follower_last_index: Index,
        needs_append: bool,
        actions: &mut Vec<Action>,
    ) {
        let last = self.log.last_index();
        let (messages_max, bytes_max) = (
            self.options.inflight_messages_max,
            self.options.inflight_bytes_max,
        );
        let Some(state) = self.leader_state_mut() else {
            return;
        };
        let sent_tick = state
            .rounds
            .iter()
            .find(|(r, _)| *r == round)
            .map(|&(_, t)| t);
        let Some(progress) = state.progress.get_mut(&from) else {
            return;
        };
        progress.recent_active = true;
        if round > progress.acked_round {
            progress.acked_round = round;
            if let Some(tick) = sent_tick {
                progress.acked_round_sent_tick = tick + 1;
            }
        }
        let mut send = false;
        if round > progress.match_round && follower_last_index < progress.match_index {
            // Answered after it acknowledged match_index, yet its log ends
            // before it: the log went backwards (a damaged tail cut, an old
            // copy of its data restored). Stale rejections cannot tell us
            // this; this answer can.
            let fault = Fault::FollowerLogWentBack {
                peer: from,
                match_index: progress.match_index,
                last_index: follower_last_index,
                certain: true,
            };
            actions.push(Action::Fault(fault));
            progress.forget_match(follower_last_index.min(last));
            send = true;
        } else if needs_append && !matches!(progress.state, ReplicationState::Snapshot(_)) {
            // It restarted (or lost track) and cannot take the commit on a
            // heartbeat's word: an append from its match lets it check.
            progress.become_probe();
            send = true;
        } else if progress.match_index < last {
            match &mut progress.state {
                ReplicationState::Probe { paused } => {
                    *paused = false;
                    send = true;
                }
                ReplicationState::Replicate => {
                    if progress.match_index == progress.match_at_last_heartbeat {
                        progress.stalled_heartbeats += 1;
                    } else {
                        progress.stalled_heartbeats = 0;
                    }
                    if progress.stalled_heartbeats >= STALLED_HEARTBEATS_MAX {
                        // An append was lost: find out where the follower is.
                        progress.stalled_heartbeats = 0;
                        progress.become_probe();
                        send = true;
                    } else if progress.inflights.is_full(messages_max, bytes_max) {
                        progress.inflights.free_first();
                        send = true;
                    }
                }
                ReplicationState::Snapshot(_) => {}
            }
        }
        progress.match_at_last_heartbeat = progress.match_index;
        if send {
            self.send_append(from, true, actions);
        }
        self.check_reads(actions);
    }

    pub(crate) fn handle_peer_connected(&mut self, peer: NodeId, actions: &mut Vec<Action>) {
        if self
            .leader_state()
            .is_some_and(|s| s.progress.contains_key(&peer))
        {
            // The peer may be behind (it restarted, or missed the notice):
            // a quiescent leader resumes its heartbeats for it.
            self.wake(false, actions);
        }
        match &mut self.role {
            RoleState::Leader(state) => {
                let Some(progress) = state.progress.get_mut(&peer) else {
                    return;
                };
                match &mut progress.state {
                    ReplicationState::Snapshot(transfer) => {
                        // What was in flight on the old connection is lost.
                        let offset = transfer.acked_offset;
                        self.resend_snapshot_from(peer, offset, actions);
                    }
                    ReplicationState::Probe { .. } | ReplicationState::Replicate => {
                        // What was in flight on the old connection is lost:
                        // probe, and tell the peer at once who leads.
                        progress.become_probe();
                        self.send_append(peer, true, actions);
                    }
                }
            }
            RoleState::PreCandidate(_) | RoleState::Candidate(_) => {
                self.resend_vote_request(peer, actions)
            }
            // A follower has nothing the peer needs: a leader re-sends on its own.
            RoleState::Follower => {}
        }
    }

    pub(crate) fn handle_peer_disconnected(&mut self, peer: NodeId, actions: &[Action]) {
        if let Some(progress) = self
            .leader_state_mut()
            .and_then(|s| s.progress.get_mut(&peer))
        {
            progress.become_probe();
        }
        if self.quiescent && matches!(self.role, RoleState::Follower) && self.leader == Some(peer) {
            // The liveness rule: a quiescent follower that loses its leader
            // runs its election timer again, so that a dead leader of an
            // idle group is replaced within the usual bound. It cannot tell
            // the leader (the link is down).
            self.wake(false, actions);
        }
    }

    // ----- snapshots, leader side -----

    fn start_snapshot(&mut self, peer: NodeId, actions: &mut Vec<Action>) {
        let meta = self.log.snapshot().clone();
        assert!(
            meta.index >= self.log.boundary_index(),
            "the latest snapshot covers the compacted log"
        );
        let Some(progress) = self
            .leader_state_mut()
            .and_then(|s| s.progress.get_mut(&peer))
        else {
            return;
        };
        progress.become_snapshot(meta);
        self.resend_snapshot_from(peer, 0, actions);
    }

    /// The snapshot transfer to `peer`, if this node leads and sends it one.
    fn snapshot_transfer_mut(&mut self, peer: NodeId) -> Option<&mut SnapshotTransfer> {
        match &mut self.leader_state_mut()?.progress.get_mut(&peer)?.state {
            ReplicationState::Snapshot(transfer) => Some(transfer),
            ReplicationState::Probe { .. } | ReplicationState::Replicate => None,
        }
    }

    /// Sends the snapshot to `peer` again from `offset` (where the follower
    /// said it is), forgetting the chunks sent beyond it.
    pub(crate) fn resend_snapshot_from(
        &mut self,
        peer: NodeId,
        offset: u64,
        actions: &mut Vec<Action>,
    ) {
        let Some(transfer) = self.snapshot_transfer_mut(peer) else {
            return;
        };
        transfer.rewind_to(offset);
        transfer.loading_offset = None;
        transfer.idle_ticks = 0;
        self.fill_snapshot_window(peer, actions);
    }

    /// Loads the next chunk for `peer` if the window has room; each loaded
    /// chunk is sent and the window filled again (`handle_chunk_loaded`).
    fn fill_snapshot_window(&mut self, peer: NodeId, actions: &mut Vec<Action>) {
        let (messages_max, bytes_max) = (
            self.options.inflight_messages_max,
            self.options.inflight_bytes_max,
        );
        let max_bytes = self.options.snapshot_chunk_bytes;
        let Some(transfer) = self.snapshot_transfer_mut(peer) else {
            return;
        };
        if !transfer.window_open(messages_max, bytes_max) {
            return;
        }
        let offset = transfer.sent_offset;
        transfer.loading_offset = Some(offset);
        actions.push(Action::LoadSnapshotChunk {
            to: peer,
            snapshot_index: transfer.meta.index,
            offset,
            max_bytes,
        });
    }

    pub(crate) fn handle_chunk_loaded(
        &mut self,
        to: NodeId,
        snapshot_index: Index,
        offset: u64,
        chunk: Option<(Bytes, bool)>,
        actions: &mut Vec<Action>,
    ) {
        let Some(progress) = self
            .leader_state_mut()
            .and_then(|s| s.progress.get_mut(&to))
        else {
            return;
        };
        let ReplicationState::Snapshot(transfer) = &mut progress.state else {
            return;
        };
        if transfer.meta.index != snapshot_index || transfer.loading_offset != Some(offset) {
            return; // a load for a transfer or chunk that has since moved on
        }
        transfer.loading_offset = None;
        match chunk {
            None => {
                // That snapshot is gone: start over with the latest one.
                self.start_snapshot(to, actions);
            }
            Some((data, done)) => {
                let end = offset.saturating_add(data.len() as u64);
                if data.is_empty() && !done {
                    // Storage handed back nothing before the end: try again
                    // from here after the chunk timeout rather than at once.
                    return;
                }
                transfer.sent_offset = end;
                transfer.chunks_in_flight.push_back(end);
                transfer.last_chunk_sent = done;
                let meta = transfer.meta.clone();
                self.send(
                    to,
                    MessageBody::SnapshotChunk {
                        meta,
                        offset,
                        data,
                        done,
                    },
                    actions,
                );
                self.fill_snapshot_window(to, actions);
            }
        }
    }

    pub(crate) fn handle_chunk_ack(
        &mut self,
        from: NodeId,
        snapshot_index: Index,
        next_offset: u64,
        actions: &mut Vec<Action>,
    ) {
        let Some(progress) = self
            .leader_state_mut()
            .and_then(|s| s.progress.get_mut(&from))
        else {
            return;
        };
        progress.recent_active = true;
        let ReplicationState::Snapshot(transfer) = &mut progress.state else {
            return;
        };
        if transfer.meta.index != snapshot_index {
            return;
        }
        if !transfer.acknowledge(next_offset)
            && next_offset == transfer.acked_offset
            && transfer.sent_offset > next_offset
            && transfer.rewound_at != Some(next_offset)
        {
            // The follower is still at the acknowledged offset while more
            // was sent: a chunk was lost (or reordered). Resend from there
            // once; further answers like it wait for the timeout.
            transfer.rewound_at = Some(next_offset);
            self.resend_snapshot_from(from, next_offset, actions);
            return;
        }
        self.fill_snapshot_window(from, actions);
    }

    pub(crate) fn handle_snapshot_response(
        &mut self,
        from: NodeId,
        snapshot_index: Index,
        outcome: SnapshotOutcome,
        actions: &mut Vec<Action>,
    ) {
        let last = self.log.last_index();
        let Some(state) = self.leader_state_mut() else {
            return;
        };
        let round = state.round;
        let Some(progress) = state.progress.get_mut(&from) else {
            return;
        };
        progress.recent_active = true;
        match outcome {
            SnapshotOutcome::Installed { last_index: index }
            | SnapshotOutcome::Stale { match_index: index } => {
                if progress.update_match(index.min(last)) {
                    progress.match_round = round;
                }
                if matches!(progress.state, ReplicationState::Snapshot(_)) {
                    progress.become_probe();
                }
                self.maybe_commit(actions);
                self.send_append(from, true, actions);
            }
            SnapshotOutcome::Rejected => {
                if let ReplicationState::Snapshot(transfer) = &progress.state {
                    if transfer.meta.index == snapshot_index {
                        // Start over from offset 0 with the latest snapshot,
                        // after the chunk timeout (not at once: a follower
                        // whose storage keeps failing must not cause a storm).
                        let meta = self.log.snapshot().clone();
                        if let Some(progress) = self
                            .leader_state_mut()
                            .and_then(|s| s.progress.get_mut(&from))
                        {
                            progress.become_snapshot(meta);
                        }
                    }
                }
            }
        }
    }

    // ----- leadership transfer -----

    pub(crate) fn start_transfer(
        &mut self,
        target: NodeId,
        actions: &mut Vec<Action>,
    ) -> Result<crate::Response, RequestError> {
        let id = self.options.id;
        if target == id {
            return Ok(Response::TransferStarted);
        }
        if !self.config.is_voter(target) {
            return Err(RequestError::InvalidMembershipChange {
                reason: format!("leadership can only go to a voter; node {target} is not one"),
            });
        }
        let Some(state) = self.leader_state_mut() else {
            return Err(RequestError::NotLeader { leader: None });
        };
        if state.transfer.is_some() {
            return Err(RequestError::TransferInProgress);
        }
        state.transfer = Some(Transfer {
            target,
            elapsed_ticks: 0,
            timeout_now_sent: false,
        });
        self.maybe_send_timeout_now(target, actions);
        if let Some(state) = self.leader_state() {
            if state.transfer.is_some_and(|t| !t.timeout_now_sent) {
                self.send_append(target, true, actions);
            }
        }
        Ok(Response::TransferStarted)
    }

    fn maybe_send_timeout_now(&mut self, peer: NodeId, actions: &mut Vec<Action>) {
        let last = self.log.last_index();
        let Some(state) = self.leader_state_mut() else {
            return;
        };
        let Some(transfer) = &mut state.transfer else {
            return;
        };
        if transfer.target != peer || transfer.timeout_now_sent {
            return;
        }
        if state
            .progress
            .get(&peer)
            .is_some_and(|p| p.match_index == last)
        {
            transfer.timeout_now_sent = true;
            self.send(peer, MessageBody::TimeoutNow, actions);
        }
    }

    pub(crate) fn handle_timeout_now(&mut self, from: NodeId, actions: &mut Vec<Action>) {
        match &self.role {
            RoleState::Follower if self.leader == Some(from) || self.leader.is_none() => {
                if self.can_campaign() {
                    self.campaign(true, actions);
                }
            }
            // Only a follower of the sender acts on it; others ignore it and
            // the transfer times out on the leader.
            RoleState::Follower
            | RoleState::PreCandidate(_)
            | RoleState::Candidate(_)
            | RoleState::Leader(_) => {}
        }
    }
}

fn unreachable_snapshot() {
    debug_assert!(false, "send_append returns early in the snapshot state");
}

#[cfg(test)]
mod tests {
    use crate::message::AppendResult;
    use crate::node::RoleState;
    use crate::progress::ReplicationState;
    use crate::testing::Cluster;
    use crate::{Input, Message, MessageBody, RaftNode};

    fn leader_of_three() -> (Cluster, u64) {
        let mut c = Cluster::new(&[1, 2, 3]);
        let leader = c.elect();
        for i in 0..10 {
            c.propose(leader, &format!("e{i}"));
        }
        c.deliver_all();
        (c, leader)
    }

    fn progress_of(node: &RaftNode, peer: u64) -> (u64, u64, bool) {
        let RoleState::Leader(state) = &node.role else {
            panic!("not leader")
        };
        let p = &state.progress[&peer];
        (
            p.match_index,
            p.next_index,
            matches!(p.state, ReplicationState::Probe { .. }),
        )
    }

    fn reject(
        c: &mut Cluster,
        leader: u64,
        from: u64,
        rejected_index: u64,
        hint_index: u64,
        hint_term: u64,
    ) {
        let term = c.raft(leader).term();
        let body = MessageBody::AppendResponse(AppendResult::Reject {
            rejected_index,
            hint_index,
            hint_term,
        });
        // Step the engine directly so the append it sends stays in flight.
        let mut actions = Vec::new();
        let node = &mut c.nodes.get_mut(&leader).unwrap().raft;
        node.step(
            Input::Message(Message {
                group: 1,
                from,
                to: leader,
                term,
                body,
            }),
            &mut actions,
        );
    }

    #[test]
    fn zero_hint_term_probes_right_after_the_hint_but_never_below_match() {
        let (mut c, leader) = leader_of_three();
        let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
        let last = c.raft(leader).last_index();
        let (matched, _, _) = progress_of(c.raft(leader), follower);
        assert_eq!(matched, last);
        // Entries beyond the follower's match, then a reject with hint term 0.
        c.blocked.insert((leader, follower));
        c.propose(leader, "x");
        c.propose(leader, "y");
        c.deliver_all();
        let new_last = c.raft(leader).last_index();
        reject(&mut c, leader, follower, new_last, 0, 0);
        let (matched_after, next, probe) = progress_of(c.raft(leader), follower);
        assert_eq!(matched_after, last);
        assert_eq!(next, last + 1, "next must not fall below match + 1");
        assert!(probe);
    }

    #[test]
    fn stale_rejects_are_ignored() {
        let (mut c, leader) = leader_of_three();
        let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
        let before = progress_of(c.raft(leader), follower);
        reject(&mut c, leader, follower, 2, 0, 0);
        assert_eq!(progress_of(c.raft(leader), follower), before);
    }

    #[test]
    fn hint_with_a_known_term_resumes_right_after_the_hint() {
        let (mut c, leader) = leader_of_three();
        let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
        let (matched, _, _) = progress_of(c.raft(leader), follower);
        c.blocked.insert((leader, follower));
        for i in 0..5 {
            c.propose(leader, &format!("z{i}"));
        }
        c.deliver_all();
        let last = c.raft(leader).last_index();
        // The follower says its log agrees up to matched + 2 (same term there).
        let hint_index = matched + 2;
        let hint_term = c.raft(leader).term_at(hint_index).unwrap();
        reject(&mut c, leader, follower, last, hint_index, hint_term);
        let (_, next, probe) = progress_of(c.raft(leader), follower);
        assert_eq!(next, hint_index + 1);
        assert!(probe);
    }
}
