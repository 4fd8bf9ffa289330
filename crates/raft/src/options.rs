//! The tunable limits and timeouts of one Raft node.

use crate::types::{GroupId, NodeId};

/// Settings of one node. [`Options::new`] gives sensible defaults; every
/// timeout is in ticks, every size limit in bytes or counts as named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// This node.
    pub id: NodeId,
    /// Its group.
    pub group: GroupId,
    /// The least election timeout; each timeout is drawn uniformly from
    /// `[election_timeout_ticks, 2 * election_timeout_ticks)`.
    pub election_timeout_ticks: u32,
    /// How often a leader sends heartbeats.
    pub heartbeat_interval_ticks: u32,
    /// Campaign only after a pre-vote round shows the node could win.
    pub pre_vote: bool,
    /// A leader steps down if it has not heard from a quorum within an
    /// election timeout; followers ignore votes while they hear a leader.
    pub check_quorum: bool,
    /// Allow [`crate::ReadConsistency::Lease`] reads (needs `check_quorum`).
    /// Set it alike on every node of the group: it also makes a node hold
    /// back its vote for one election timeout after it starts, which the
    /// leases of the others rely on (see the crate docs).
    pub lease_reads: bool,
    /// Forward requests to the leader (true) or answer `NotLeader` (false).
    pub forward_requests: bool,
    /// The most append messages (or snapshot chunks) in flight to one
    /// follower; a follower also queues at most this many snapshot chunks.
    ///
    /// The default (4) is small on purpose: a follower makes one batch of
    /// appends durable at a time, so entries sent while it syncs wait
    /// there for the next sync anyway. Held at the leader until an
    /// acknowledgment opens the window, they leave as one larger append,
    /// which the follower steps, persists and acknowledges once. With 256
    /// clients on a 3-member cluster on one machine this took the server
    /// CPU per put from 46.9 to 43.1 µs (medians of 4 alternating rounds,
    /// `scripts/bench-ab.sh`); a window of 2 measured the same as 4. Each
    /// message carries up to `append_bytes_max`, so the window bounds
    /// messages, not throughput.
    pub inflight_messages_max: usize,
    /// The most entry bytes (or snapshot chunk bytes) in flight to one
    /// follower; a follower also queues at most this many chunk bytes.
    pub inflight_bytes_max: u64,
    /// The most entry bytes in one append message (at least one entry is
    /// always sent).
    pub append_bytes_max: u64,
    /// The size of a snapshot chunk.
    pub snapshot_chunk_bytes: u64,
    /// How long the leader waits for a snapshot chunk's acknowledgement
    /// before it resends from the last acknowledged offset.
    pub snapshot_chunk_timeout_ticks: u32,
    /// How long a request may wait for a leader, a forwarded answer or a
    /// read to become ready, before it fails.
    pub request_timeout_ticks: u32,
    /// The most client requests waiting on this node at once.
    pub pending_requests_max: usize,
    /// Entries kept in the log behind a new snapshot, so that followers a
    /// little behind can still be sent entries rather than the snapshot.
    pub compaction_lag_entries: u64,
    /// The most bytes (as [`crate::Entry::size_bytes`] counts them) of
    /// settled entries the log holds in memory: entries that are both
    /// durable here and already handed out in [`crate::Action::Apply`].
    /// Older settled entries stay part of the log (their index, term and
    /// configuration are known) but their bodies live only in storage; a
    /// follower that needs them gets them through
    /// [`crate::Action::LoadEntries`]. Entries not yet durable or not yet
    /// applied are always held, whatever this says: the engine must hand
    /// them to storage and to the state machine, and until they are durable
    /// storage may not have them to load. The bound thus does not depend on
    /// snapshots: an in-memory state machine may let its log grow large
    /// between snapshots without the engine holding it.
    pub log_memory_bytes_max: u64,
    /// The most settled entries (see `log_memory_bytes_max`) the log holds
    /// in memory, whatever their size: small entries cost more memory than
    /// their counted bytes.
    pub log_memory_entries_max: u64,
    /// Let an idle group go quiet: its leader stops sending heartbeats and
    /// counting check-quorum, its followers stop their election timers, and
    /// ticks cost almost nothing until something wakes the group (see the
    /// crate docs, "Quiescence"). Off by default. With it on, the host must
    /// report [`crate::Input::PeerDisconnected`] within a bounded time after
    /// it stops hearing from a peer node: that is how the followers of a
    /// dead quiescent leader learn to hold an election. Set it alike on
    /// every node of the group: a follower with it off refuses to go quiet
    /// and asks the leader to keep its heartbeats going.
    pub quiesce: bool,
}

impl Options {
    /// Defaults for node `id` of group `group`: election timeout 10 ticks,
    /// heartbeat 1 tick, pre-vote and check-quorum on, quiescence off; the log
    /// holds at most 64 MiB or 262 144 settled entries in memory.
    pub fn new(id: NodeId, group: GroupId) -> Self {
        Options {
            id,
            group,
            election_timeout_ticks: 10,
            heartbeat_interval_ticks: 1,
            pre_vote: true,
            check_quorum: true,
            lease_reads: false,
            forward_requests: true,
            inflight_messages_max: 4,
            inflight_bytes_max: 16 << 20,
            append_bytes_max: 1 << 20,
            snapshot_chunk_bytes: 1 << 20,
            snapshot_chunk_timeout_ticks: 20,
            request_timeout_ticks: 50,
            pending_requests_max: 4096,
            compaction_lag_entries: 1000,
            log_memory_bytes_max: 64 << 20,
            log_memory_entries_max: 1 << 18,
            quiesce: false,
        }
    }
}
