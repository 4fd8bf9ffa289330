//! The leader's view of one follower: how far its log matches, where to send
//! next, and which replication state it is in. Every state is left by a
//! message from the follower or by a timeout, never by a local signal alone.

use std::collections::VecDeque;

use crate::types::{Index, SnapshotMeta};

/// How the leader replicates to one follower.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicationState {
    /// The leader does not know where the logs agree: one append at a time,
    /// paused until the follower answers or the next heartbeat.
    Probe {
        /// An append is outstanding.
        paused: bool,
    },
    /// The logs agree up to `match_index`: appends are pipelined, bounded by
    /// the inflight window.
    Replicate,
    /// The follower needs a snapshot; its chunks are pipelined under the
    /// same window as appends (messages and bytes in flight).
    Snapshot(SnapshotTransfer),
}

/// The leader's state of one snapshot transfer. Chunks are sent in order
/// from `acked_offset` on while the bytes and chunks beyond what the
/// follower acknowledged fit the inflight window; a lost chunk is resent
/// from the last acknowledged offset (at once when the follower's answer
/// shows the gap, else after the chunk timeout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotTransfer {
    /// The snapshot being sent.
    pub meta: SnapshotMeta,
    /// The follower has saved every byte before this offset.
    pub acked_offset: u64,
    /// Every byte before this offset has been sent (since the last resend);
    /// the next chunk to load starts here.
    pub sent_offset: u64,
    /// The end offset of each chunk sent beyond `acked_offset`, in order.
    pub chunks_in_flight: VecDeque<u64>,
    /// The offset of the chunk being loaded from storage, if any.
    pub loading_offset: Option<u64>,
    /// The last chunk has been sent: wait for the SnapshotResponse.
    pub last_chunk_sent: bool,
    /// The acknowledged offset the transfer was last rewound to because the
    /// follower showed a gap (rewinding again to the same offset waits for
    /// the timeout, so that a burst of answers causes one resend).
    pub rewound_at: Option<u64>,
    /// Ticks since the follower last made progress on this transfer.
    pub idle_ticks: u32,
    /// Chunk timeouts in a row without progress.
    pub timeouts_in_a_row: u32,
}

impl SnapshotTransfer {
    /// Whether another chunk may be sent now under the window.
    pub fn window_open(&self, messages_max: usize, bytes_max: u64) -> bool {
        !self.last_chunk_sent
            && self.loading_offset.is_none()
            && self.chunks_in_flight.len() < messages_max
            && self.sent_offset.saturating_sub(self.acked_offset) < bytes_max
    }

    /// Forgets what was sent beyond `offset` so that sending resumes there.
    pub fn rewind_to(&mut self, offset: u64) {
        self.sent_offset = offset;
        self.chunks_in_flight.clear();
        self.last_chunk_sent = false;
    }

    /// Records the follower's acknowledgement that it saved every byte
    /// before `next_offset`; returns whether that is progress.
    pub fn acknowledge(&mut self, next_offset: u64) -> bool {
        if next_offset <= self.acked_offset {
            return false;
        }
        self.acked_offset = next_offset;
        self.idle_ticks = 0;
        self.timeouts_in_a_row = 0;
        self.rewound_at = None;
        while self
            .chunks_in_flight
            .front()
            .is_some_and(|end| *end <= next_offset)
        {
            self.chunks_in_flight.pop_front();
        }
        if self.sent_offset < next_offset {
            // Acknowledged beyond a resend: skip what is saved already.
            self.rewind_to(next_offset);
        }
        true
    }
}

/// The bounded window of appends in flight to one follower.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inflights {
    /// (last index of the append, its entry bytes), oldest first.
    appends: VecDeque<(Index, u64)>,
    bytes: u64,
}

impl Inflights {
    /// Records an append in flight.
    pub fn add(&mut self, last_index: Index, size_bytes: u64) {
        self.appends.push_back((last_index, size_bytes));
        self.bytes += size_bytes;
    }

    /// Frees every append whose entries are all at or below `index`.
    pub fn free_through(&mut self, index: Index) {
        while let Some(&(last, size)) = self.appends.front() {
            if last > index {
                break;
            }
            self.appends.pop_front();
            self.bytes -= size;
        }
    }

    /// Frees the oldest append (used when a heartbeat answer shows the
    /// follower alive while the window is full, so replication cannot stall).
    pub fn free_first(&mut self) {
        if let Some((_, size)) = self.appends.pop_front() {
            self.bytes -= size;
        }
    }

    /// Whether the window is full by count or by bytes.
    pub fn is_full(&self, messages_max: usize, bytes_max: u64) -> bool {
        self.appends.len() >= messages_max || self.bytes >= bytes_max
    }

    /// The entry bytes in flight.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Number of appends in flight.
    pub fn count(&self) -> usize {
        self.appends.len()
    }

    /// Empties the window.
    pub fn clear(&mut self) {
        self.appends.clear();
        self.bytes = 0;
    }
}

/// A load of entries from storage for one follower, outstanding
/// ([`crate::Action::LoadEntries`]): what was asked, to check the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntriesLoad {
    /// The first index asked for (the follower's next index then).
    pub from: Index,
    /// The last index that may come back.
    pub through: Index,
    /// The most entry bytes to send of them (what the window allowed).
    pub max_bytes: u64,
}

/// The leader's view of one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The follower's log matches the leader's up to here.
    pub match_index: Index,
    /// The next index to send.
    pub next_index: Index,
    /// The replication state.
    pub state: ReplicationState,
    /// Appends in flight (replicate state).
    pub inflights: Inflights,
    /// Heard from since the last check-quorum round.
    pub recent_active: bool,
    /// The highest heartbeat round the peer has answered.
    pub acked_round: u64,
    /// One more than the tick at which that round was sent (0: none), for the lease.
    pub acked_round_sent_tick: u64,
    /// Heartbeat answers in a row during which the match index did not move
    /// although entries were outstanding (replicate state): a lost append.
    pub stalled_heartbeats: u32,
    /// The match index seen at the previous heartbeat answer.
    pub match_at_last_heartbeat: Index,
    /// The highest commit index sent to the peer that it can take (capped
    /// at what its log is known to match): the leader tells it of a newer
    /// one at once (see `send_commit_notices`).
    pub commit_sent: Index,
    /// The leader's heartbeat round when `match_index` last rose: an answer
    /// to a later round was sent after the follower acknowledged it, so
    /// its last index cannot be below `match_index` unless its log went
    /// backwards.
    pub match_round: u64,
    /// The load of entries from storage outstanding for this peer, if any
    /// (at most one). Cleared whenever the next index is decided afresh
    /// (probe, replicate, snapshot) and, in probe, by each heartbeat round:
    /// a lost answer is asked for again as a lost probe is resent.
    pub loading: Option<EntriesLoad>,
}

impl Progress {
    /// A fresh progress for a peer, probing from `next_index`.
    pub fn new(next_index: Index) -> Self {
        Progress {
            match_index: 0,
            next_index,
            state: ReplicationState::Probe { paused: false },
            inflights: Inflights::default(),
            recent_active: false,
            acked_round: 0,
            acked_round_sent_tick: 0,
            stalled_heartbeats: 0,
            match_at_last_heartbeat: 0,
            commit_sent: 0,
            match_round: 0,
            loading: None,
        }
    }

    /// The follower's log went backwards to `last_index`: what it
    /// acknowledged is void. Probe it afresh from its last index.
    pub fn forget_match(&mut self, last_index: Index) {
        self.match_index = 0;
        self.match_round = 0;
        self.commit_sent = 0;
        self.match_at_last_heartbeat = 0;
        self.become_probe();
        self.next_index = last_index.saturating_add(1);
    }

    /// Switches to probe, sending next from `match_index + 1` at the latest.
    pub fn become_probe(&mut self) {
        self.next_index = self.match_index + 1;
        self.state = ReplicationState::Probe { paused: false };
        self.inflights.clear();
        self.loading = None;
    }

    /// Switches to replicate from `match_index + 1`.
    pub fn become_replicate(&mut self) {
        self.next_index = self.match_index + 1;
        self.state = ReplicationState::Replicate;
        self.inflights.clear();
        self.loading = None;
    }

    /// Switches to sending snapshot `snapshot_index` from offset 0.
    pub fn become_snapshot(&mut self, meta: SnapshotMeta) {
        self.inflights.clear();
        self.loading = None;
        self.state = ReplicationState::Snapshot(SnapshotTransfer {
            meta,
            acked_offset: 0,
            sent_offset: 0,
            chunks_in_flight: VecDeque::new(),
            loading_offset: None,
            last_chunk_sent: false,
            rewound_at: None,
            idle_ticks: 0,
            timeouts_in_a_row: 0,
        });
    }

    /// Records that the follower's log matches up to `index`; returns whether
    /// that is news. `next_index` never falls below `match_index + 1`.
    pub fn update_match(&mut self, index: Index) -> bool {
        let news = index > self.match_index;
        if news {
            self.match_index = index;
        }
        self.next_index = self.next_index.max(self.match_index + 1);
        self.inflights.free_through(self.match_index);
        news
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inflight_window_bounded_by_count_and_bytes() {
        let mut w = Inflights::default();
        w.add(5, 100);
        assert!(!w.is_full(2, 1000));
        w.add(9, 100);
        assert!(w.is_full(2, 1000));
        assert!(!w.is_full(3, 1000));
        assert!(w.is_full(3, 200));
        w.free_through(5);
        assert_eq!((w.count(), w.bytes()), (1, 100));
        w.free_first();
        assert_eq!((w.count(), w.bytes()), (0, 0));
    }

    #[test]
    fn match_never_moves_next_below_it() {
        let mut p = Progress::new(10);
        p.update_match(7);
        p.next_index = 3;
        p.update_match(5);
        assert_eq!(p.match_index, 7);
        assert_eq!(p.next_index, 8);
        p.become_probe();
        assert_eq!(p.next_index, 8);
    }
}
