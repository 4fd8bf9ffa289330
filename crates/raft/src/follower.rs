//! The follower: appends, heartbeats, and receiving a snapshot in chunks.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::fault::Fault;
use crate::io::Action;
use crate::log::AppendError;
use crate::message::{AppendResult, MessageBody, SnapshotOutcome, COMMIT_NOTICE_READ_SEQ};
use crate::node::{RaftNode, Receiving};
use crate::types::{Entry, Index, NodeId, SnapshotMeta, Term};

/// Ticks without a chunk after which a follower abandons a snapshot it was
/// receiving, in election timeouts (the leader restarts or probes anyway).
pub(crate) const RECEIVING_IDLE_ELECTION_TIMEOUTS: u32 = 4;

impl RaftNode {
    fn installing_snapshot(&self) -> bool {
        self.receiving
            .as_ref()
            .is_some_and(|r| r.saving.is_some_and(|(_, _, done)| done))
    }

    pub(crate) fn handle_append(
        &mut self,
        from: NodeId,
        prev_log_index: Index,
        prev_log_term: Term,
        entries: Vec<Entry>,
        leader_commit: Index,
        actions: &mut Vec<Action>,
    ) {
        if self.installing_snapshot() {
            // The log is about to be replaced; acknowledging entries now
            // could claim what the install wipes. The leader retries.
            return;
        }
        // A leader's entries never go back in term and are never newer than
        // its term; anything else is malformed, and refused like a mismatch.
        let terms_valid = entries
            .iter()
            .try_fold(prev_log_term, |before, e| {
                (e.term >= before && e.term <= self.term).then_some(e.term)
            })
            .is_some();
        if !terms_valid {
            let hint = self.log.mismatch_hint(prev_log_index, prev_log_term);
            let body = MessageBody::AppendResponse(AppendResult::Reject {
                rejected_index: prev_log_index,
                hint_index: hint.hint_index,
                hint_term: hint.hint_term,
            });
            self.send_after_persist(from, body, actions);
            return;
        }
        let (mut prev_index, mut prev_term, mut entries) = (prev_log_index, prev_log_term, entries);
        if prev_index < self.commit {
            // Entries up to the commit index are committed and so must match
            // the leader's: check what can be checked, then skip them and
            // continue from the commit index.
            let skip = entries
                .iter()
                .take_while(|e| e.index <= self.commit)
                .count();
            let contradicted = entries[..skip].iter().find(|e| {
                self.log.term_at(e.index).is_some_and(|t| t != e.term)
                    || self
                        .log
                        .entry(e.index)
                        .is_some_and(|held| held.term == e.term && held.payload != e.payload)
            });
            if let Some(e) = contradicted {
                let fault = Fault::LogConflict {
                    from,
                    index: e.index,
                    term: e.term,
                };
                self.halt(fault, actions);
                return;
            }
            entries.drain(..skip);
            prev_index = self.commit;
            match self.log.term_at(prev_index) {
                Some(term) => prev_term = term,
                None => {
                    debug_assert!(false, "the commit index is never below the log's boundary");
                    return;
                }
            }
            if entries.first().is_some_and(|e| e.index != prev_index + 1) {
                entries.clear();
            }
        }
        let commit = self.commit;
        match self.log.try_append(prev_index, prev_term, &entries, commit) {
            Ok(match_index) => {
                self.leader_verified_index = self.leader_verified_index.max(match_index);
                self.commit_to(leader_commit.min(match_index), actions);
                self.send_after_persist(
                    from,
                    MessageBody::AppendResponse(AppendResult::Success { match_index }),
                    actions,
                );
            }
            Err(AppendError::Conflict { index, term }) => {
                self.halt(Fault::LogConflict { from, index, term }, actions);
            }
            Err(AppendError::Mismatch(hint)) => {
                let body = MessageBody::AppendResponse(AppendResult::Reject {
                    rejected_index: prev_log_index,
                    hint_index: hint.hint_index,
                    hint_term: hint.hint_term,
                });
                self.send_after_persist(from, body, actions);
            }
        }
    }

    /// Takes a commit index from a heartbeat or a quiesce notice. The leader
    /// caps it at what it knows matches here. Beyond our log, this log lost
    /// entries it acknowledged: report it and take nothing. Otherwise take
    /// it up to what an append of this leader showed matching (a log that
    /// went backwards may hold other entries there); heartbeat answers
    /// carry our last index so the leader can see.
    pub(crate) fn take_leader_commit(
        &mut self,
        from: NodeId,
        leader_commit: Index,
        actions: &mut Vec<Action>,
    ) {
        let last_index = self.log.last_index();
        if leader_commit > last_index {
            actions.push(Action::Fault(Fault::CommitBeyondLog {
                from,
                commit: leader_commit,
                last_index,
            }));
        } else if !self.installing_snapshot() {
            self.commit_to(leader_commit.min(self.leader_verified_index), actions);
        }
    }

    pub(crate) fn handle_heartbeat(
        &mut self,
        from: NodeId,
        leader_commit: Index,
        read_seq: u64,
        actions: &mut Vec<Action>,
    ) {
        self.take_leader_commit(from, leader_commit, actions);
        let last_index = self.log.last_index();
        if read_seq == COMMIT_NOTICE_READ_SEQ {
            // A commit notice: the leader needs no answer.
            return;
        }
        let body = MessageBody::HeartbeatResponse {
            read_seq,
            last_index,
            needs_append: leader_commit > self.commit,
        };
        self.send_after_persist(from, body, actions);
    }

    pub(crate) fn handle_snapshot_chunk(
        &mut self,
        from: NodeId,
        meta: SnapshotMeta,
        offset: u64,
        data: Bytes,
        done: bool,
        actions: &mut Vec<Action>,
    ) {
        let index = meta.index;
        if self.snapshot_is_stale(&meta) {
            self.answer_stale_snapshot(from, &meta, actions);
            return;
        }
        let term = self.term;
        let same = self.receiving.as_ref().is_some_and(|r| {
            r.meta.index == index && r.meta.term == meta.term && r.from == from && r.term == term
        });
        if offset == 0 && !same {
            if self.installing_snapshot() {
                return; // another snapshot is being installed; the leader retries
            }
            self.receiving = Some(Receiving {
                meta: meta.clone(),
                from,
                term,
                next_offset: 0,
                saving: None,
                queued: VecDeque::new(),
                queued_bytes: 0,
                idle_ticks: 0,
            });
        } else if !same {
            // A chunk from the middle of a transfer this node is not in.
            let body = MessageBody::SnapshotResponse {
                snapshot_index: index,
                outcome: SnapshotOutcome::Rejected,
            };
            self.send(from, body, actions);
            return;
        }
        let (messages_max, bytes_max) = (
            self.options.inflight_messages_max,
            self.options.inflight_bytes_max,
        );
        let Some(receiving) = &mut self.receiving else {
            return;
        };
        receiving.idle_ticks = 0;
        let saved = receiving.next_offset;
        let expected = receiving.expected_offset();
        if offset < saved || offset > expected {
            // Saved already (its acknowledgement may have been lost), or
            // beyond a gap (a chunk before it was lost): say where we are.
            self.send(
                from,
                MessageBody::SnapshotChunkAck {
                    snapshot_index: index,
                    next_offset: saved,
                },
                actions,
            );
            return;
        }
        if offset < expected {
            return; // being saved or queued already; its ack follows
        }
        if receiving.saving.is_some() {
            // One chunk is saved at a time; keep the next ones in order, as
            // many as the window lets the leader send. One beyond it is
            // dropped and resent once the leader hears where we are.
            let length = data.len() as u64;
            if receiving.queued.len() < messages_max
                && receiving.queued_bytes.saturating_add(length) <= bytes_max
            {
                receiving.queued_bytes += length;
                receiving.queued.push_back((offset, data, done));
            }
            return;
        }
        receiving.saving = Some((offset, data.len() as u64, done));
        actions.push(Action::SaveSnapshotChunk {
            meta,
            offset,
            data,
            done,
        });
    }

    /// Stale: everything the snapshot covers is committed here already, or
    /// the log already holds its last entry.
    fn snapshot_is_stale(&self, meta: &SnapshotMeta) -> bool {
        meta.index <= self.commit
            || (meta.index > 0 && self.log.term_at(meta.index) == Some(meta.term))
    }

    /// Acknowledges a stale snapshot at once without saving (more of) it,
    /// and drops the transfer if it was this one and nothing is being saved.
    fn answer_stale_snapshot(
        &mut self,
        from: NodeId,
        meta: &SnapshotMeta,
        actions: &mut Vec<Action>,
    ) {
        let index = meta.index;
        let has_entry = self.log.term_at(index) == Some(meta.term) && index > 0;
        let match_index = if has_entry {
            index.max(self.commit)
        } else {
            self.commit
        };
        if has_entry && !self.installing_snapshot() {
            self.commit_to(index, actions);
        }
        if self
            .receiving
            .as_ref()
            .is_some_and(|r| r.meta.index == index && r.saving.is_none())
        {
            self.receiving = None;
        }
        let body = MessageBody::SnapshotResponse {
            snapshot_index: index,
            outcome: SnapshotOutcome::Stale { match_index },
        };
        self.send_after_persist(from, body, actions);
    }

    pub(crate) fn handle_chunk_saved(
        &mut self,
        snapshot_index: Index,
        offset: u64,
        ok: bool,
        actions: &mut Vec<Action>,
    ) {
        let Some(receiving) = &mut self.receiving else {
            return;
        };
        let Some((saving_offset, length, done)) = receiving.saving else {
            return;
        };
        if receiving.meta.index != snapshot_index || saving_offset != offset {
            return; // a completion for a transfer abandoned since
        }
        receiving.saving = None;
        let from = receiving.from;
        if !ok {
            self.receiving = None;
            let body = MessageBody::SnapshotResponse {
                snapshot_index,
                outcome: SnapshotOutcome::Rejected,
            };
            self.send(from, body, actions);
            return;
        }
        if !done {
            receiving.next_offset = offset.saturating_add(length);
            let meta = receiving.meta.clone();
            if self.snapshot_is_stale(&meta) {
                // The log caught up past the snapshot while its chunks were
                // queued (appends keep coming): drop it and say so, as for a
                // stale chunk arriving. Installing it would roll back.
                self.answer_stale_snapshot(from, &meta, actions);
                return;
            }
            let Some(receiving) = &mut self.receiving else {
                return;
            };
            let next_offset = receiving.next_offset;
            if let Some((offset, data, done)) = receiving.queued.pop_front() {
                receiving.queued_bytes -= data.len() as u64;
                debug_assert_eq!(offset, next_offset, "queued chunks are contiguous");
                receiving.saving = Some((offset, data.len() as u64, done));
                actions.push(Action::SaveSnapshotChunk {
                    meta,
                    offset,
                    data,
                    done,
                });
            }
            self.send(
                from,
                MessageBody::SnapshotChunkAck {
                    snapshot_index,
                    next_offset,
                },
                actions,
            );
            return;
        }
        // Installed by the runtime: the state machine is at meta.index and the
        // stored log was reset to it.
        let meta = receiving.meta.clone();
        self.receiving = None;
        self.install_snapshot(meta, actions);
        let last_index = self.log.last_index();
        let body = MessageBody::SnapshotResponse {
            snapshot_index,
            outcome: SnapshotOutcome::Installed { last_index },
        };
        self.send_after_persist(from, body, actions);
    }

    fn install_snapshot(&mut self, meta: SnapshotMeta, actions: &mut Vec<Action>) {
        let index = meta.index;
        assert!(index > self.applied, "a stale snapshot is never installed");
        self.log.reset_to_snapshot(meta);
        // Pending persists wrote entries the snapshot replaced.
        self.inflight_persists.clear();
        self.commit = index;
        self.applied = index;
        self.leader_verified_index = self.leader_verified_index.max(index);
        let config = self.log.snapshot().config.clone();
        if config != self.config {
            self.config = config;
            self.on_config_committed(actions);
        }
        self.release_applied_reads(actions);
    }

    pub(crate) fn tick_receiving(&mut self, actions: &mut Vec<Action>) {
        let limit = self
            .options
            .election_timeout_ticks
            .saturating_mul(RECEIVING_IDLE_ELECTION_TIMEOUTS);
        let Some(receiving) = &mut self.receiving else {
            return;
        };
        if receiving.saving.is_some() {
            return; // waiting on our own storage, not on the leader
        }
        receiving.idle_ticks += 1;
        if receiving.idle_ticks >= limit {
            let (from, snapshot_index) = (receiving.from, receiving.meta.index);
            self.receiving = None;
            let body = MessageBody::SnapshotResponse {
                snapshot_index,
                outcome: SnapshotOutcome::Rejected,
            };
            self.send(from, body, actions);
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use crate::testing::test_options;
    use crate::{
        Action, Configuration, Entry, EntryPayload, HardState, Input, Message, MessageBody,
        RaftNode, RestoredState, SnapshotMeta, SnapshotOutcome,
    };

    fn follower_with_commit(n: u64) -> RaftNode {
        let entries = (1..=n)
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
                commit: n,
            },
            entries,
            applied: n,
            ..RestoredState::bootstrap([1, 2, 3])
        };
        RaftNode::new(test_options(1), restored, 1).unwrap()
    }

    fn chunk(index: u64, offset: u64) -> Input {
        let meta = SnapshotMeta {
            index,
            term: 1,
            config: Configuration::with_voters([1, 2, 3]),
        };
        let body = MessageBody::SnapshotChunk {
            meta,
            offset,
            data: Bytes::from_static(b"data"),
            done: false,
        };
        Input::Message(Message {
            group: 1,
            from: 2,
            to: 1,
            term: 1,
            body,
        })
    }

    #[test]
    fn stale_snapshot_is_acknowledged_without_saving() {
        let mut n = follower_with_commit(10);
        let mut actions = Vec::new();
        n.step(chunk(10, 0), &mut actions);
        assert!(!actions
            .iter()
            .any(|a| matches!(a, Action::SaveSnapshotChunk { .. })));
        let stale = actions.iter().any(|a| {
            matches!(
                a,
                Action::Send(Message {
                    body: MessageBody::SnapshotResponse {
                        outcome: SnapshotOutcome::Stale { match_index: 10 },
                        ..
                    },
                    ..
                })
            )
        });
        assert!(stale);
        assert!(!n.is_receiving_snapshot());
    }

    /// Found by the sweep while chunks were first pipelined: chunks queued
    /// behind one being saved, then appends carried the log past the
    /// snapshot; the queued last chunk was saved and installed, rolling the
    /// state machine back. It is dropped and answered `Stale` instead.
    #[test]
    fn queued_chunks_of_a_snapshot_that_became_stale_are_not_installed() {
        let mut n = follower_with_commit(2);
        let mut actions = Vec::new();
        n.step(chunk(6, 0), &mut actions);
        n.step(chunk(6, 4), &mut actions);
        let mut last = chunk(6, 8);
        if let Input::Message(Message {
            body: MessageBody::SnapshotChunk { done, .. },
            ..
        }) = &mut last
        {
            *done = true;
        }
        n.step(last, &mut actions);
        let saves = |actions: &[Action]| {
            actions
                .iter()
                .filter(|a| matches!(a, Action::SaveSnapshotChunk { .. }))
                .count()
        };
        assert_eq!(saves(&actions), 1, "one save at a time, the rest queued");
        // Meanwhile the leader's appends carry the log past the snapshot.
        let entries = (3..=8)
            .map(|index| Entry {
                index,
                term: 1,
                payload: EntryPayload::Noop,
            })
            .collect();
        let append = MessageBody::Append {
            prev_log_index: 2,
            prev_log_term: 1,
            entries,
            leader_commit: 8,
        };
        n.step(
            Input::Message(Message {
                group: 1,
                from: 2,
                to: 1,
                term: 1,
                body: append,
            }),
            &mut actions,
        );
        assert_eq!(n.commit_index(), 8);
        let persisted: Vec<u64> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Persist(p) => Some(p.seq),
                _ => None,
            })
            .collect();
        actions.clear();
        n.step(
            Input::SnapshotChunkSaved {
                snapshot_index: 6,
                offset: 0,
                ok: true,
            },
            &mut actions,
        );
        assert_eq!(saves(&actions), 0, "a stale snapshot must not be installed");
        for seq in persisted {
            n.step(Input::Persisted { seq }, &mut actions);
        }
        assert!(actions.iter().any(|a| matches!(
            a,
            Action::Send(Message {
                body: MessageBody::SnapshotResponse {
                    outcome: SnapshotOutcome::Stale { .. },
                    ..
                },
                ..
            })
        )));
        assert!(!n.is_receiving_snapshot());
    }

    #[test]
    fn out_of_order_chunks_are_redirected_or_rejected() {
        let mut n = follower_with_commit(2);
        let mut actions = Vec::new();
        // A middle chunk of a transfer this node never started: rejected.
        n.step(chunk(20, 16), &mut actions);
        assert!(actions.iter().any(|a| matches!(
            a,
            Action::Send(Message {
                body: MessageBody::SnapshotResponse {
                    outcome: SnapshotOutcome::Rejected,
                    ..
                },
                ..
            })
        )));
        actions.clear();
        n.step(chunk(20, 0), &mut actions);
        n.step(
            Input::SnapshotChunkSaved {
                snapshot_index: 20,
                offset: 0,
                ok: true,
            },
            &mut actions,
        );
        actions.clear();
        // A chunk beyond the expected offset: ask for the right one.
        n.step(chunk(20, 64), &mut actions);
        assert!(actions.iter().any(|a| matches!(
            a,
            Action::Send(Message {
                body: MessageBody::SnapshotChunkAck { next_offset: 4, .. },
                ..
            })
        )));
    }

    #[test]
    fn last_chunk_installs_and_answers_with_the_new_last_index() {
        let mut n = follower_with_commit(2);
        let mut actions = Vec::new();
        let meta = SnapshotMeta {
            index: 20,
            term: 1,
            config: Configuration::with_voters([1, 2, 3]),
        };
        let body = MessageBody::SnapshotChunk {
            meta,
            offset: 0,
            data: Bytes::from_static(b"all"),
            done: true,
        };
        n.step(
            Input::Message(Message {
                group: 1,
                from: 2,
                to: 1,
                term: 1,
                body,
            }),
            &mut actions,
        );
        assert!(n.is_receiving_snapshot());
        n.step(
            Input::SnapshotChunkSaved {
                snapshot_index: 20,
                offset: 0,
                ok: true,
            },
            &mut actions,
        );
        assert!(!n.is_receiving_snapshot());
        assert_eq!(
            (n.commit_index(), n.applied_index(), n.last_index()),
            (20, 20, 20)
        );
        let installed = actions.iter().any(|a| {
            matches!(
                a,
                Action::Send(Message {
                    body: MessageBody::SnapshotResponse {
                        outcome: SnapshotOutcome::Installed { last_index: 20 },
                        ..
                    },
                    ..
                })
            )
        });
        assert!(installed);
    }
}
