//! What goes into the engine ([`Input`]) and what comes out ([`Action`]).
//!
//! The runtime (the server, or the simulator) calls
//! [`crate::RaftNode::step`] with one input at a time and carries out the
//! actions it gets back, in order. Completions of the actions that take time
//! (a sync, a snapshot chunk read or written) come back as inputs.

use bytes::Bytes;

use crate::message::Message;
use crate::request::{Request, RequestError, RequestId, Response, Role};
use crate::types::{Entry, HardState, Index, NodeId, SnapshotMeta, Term};

/// One input to the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// One unit of time has passed. All timeouts are counted in ticks.
    Tick,
    /// A message from a peer.
    Message(Message),
    /// A client request arrived at this node.
    Client {
        /// The runtime's id for the request, echoed in the response.
        id: RequestId,
        /// The request.
        request: Request,
    },
    /// Every [`PersistRequest`] with `seq` up to and including this one is
    /// durable (written and synced).
    Persisted {
        /// The highest durable sequence number.
        seq: u64,
    },
    /// The state machine has taken a snapshot covering every entry up to
    /// `index` (which it has applied). The engine may compact its log
    /// behind it and will send this snapshot to followers that need it.
    SnapshotBuilt {
        /// The last index the snapshot covers.
        index: Index,
    },
    /// The answer to [`Action::LoadSnapshotChunk`].
    SnapshotChunkLoaded {
        /// The follower the chunk is for.
        to: NodeId,
        /// The snapshot the chunk is from.
        snapshot_index: Index,
        /// Where the chunk starts.
        offset: u64,
        /// The chunk and whether it is the last one, or `None` if that
        /// snapshot is no longer available (the engine then starts over with
        /// its latest snapshot).
        chunk: Option<(Bytes, bool)>,
    },
    /// The answer to [`Action::LoadEntries`].
    EntriesLoaded {
        /// The follower the entries are for (echoed from the action).
        to: NodeId,
        /// The leader's term when it asked (echoed from the action).
        term: Term,
        /// The first index asked for (echoed from the action).
        from: Index,
        /// The entries from `from` on, consecutive, at most through the
        /// action's `through` (at least one if any), or `None` if storage
        /// no longer holds `from` (compacted): the leader then sends its
        /// snapshot. A failed read may also answer `None`.
        entries: Option<Vec<Entry>>,
    },
    /// The answer to [`Action::SaveSnapshotChunk`]. For the last chunk, this
    /// means the snapshot is installed: the state machine restored from it
    /// and the log in storage reset to its index, durably.
    SnapshotChunkSaved {
        /// Which snapshot.
        snapshot_index: Index,
        /// The offset of the saved chunk.
        offset: u64,
        /// Whether saving succeeded. On failure the engine rejects the
        /// transfer and the leader starts over.
        ok: bool,
    },
    /// The transport has (re)connected to a peer. The engine sends what that
    /// peer needs to know now (its leadership, its candidacy); a quiescent
    /// leader wakes.
    PeerConnected(NodeId),
    /// The transport lost its connection to a peer, or the host stopped
    /// hearing from the peer's node. With `Options::quiesce` on the host
    /// must report this within a bounded time after it stops hearing from
    /// the peer: a quiescent follower wakes on it when the peer is its
    /// leader, and nothing else tells it that the leader of an idle group
    /// died (see the crate docs, "Quiescence").
    PeerDisconnected(NodeId),
}

/// One thing the engine wants done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Write to the log and sync, then report [`Input::Persisted`] with this
    /// `seq`. Requests must become durable in `seq` order.
    Persist(PersistRequest),
    /// Send a message to a peer. Delivery is best effort; the engine
    /// re-sends what matters.
    Send(Message),
    /// Apply these committed entries to the state machine, in order, before
    /// carrying out any later action.
    Apply(Vec<Entry>),
    /// Answer a client request.
    Respond {
        /// The request's id.
        id: RequestId,
        /// The outcome.
        result: Result<Response, RequestError>,
    },
    /// Read a chunk of the snapshot at `snapshot_index` for sending to `to`,
    /// and report it with [`Input::SnapshotChunkLoaded`].
    LoadSnapshotChunk {
        /// The follower.
        to: NodeId,
        /// Which snapshot.
        snapshot_index: Index,
        /// Where the chunk starts.
        offset: u64,
        /// The most bytes the chunk may hold.
        max_bytes: u64,
    },
    /// (On the leader.) Read log entries `from..=through` from storage, up
    /// to about `max_bytes` of them (at least one), for sending to `to`,
    /// and report them with [`Input::EntriesLoaded`]. Asked for entries the
    /// log no longer holds in memory (see `Options::log_memory_bytes_max`);
    /// they are all durable. At most one is outstanding per follower; an
    /// answer that never comes is made up for by the next probe.
    LoadEntries {
        /// The follower.
        to: NodeId,
        /// The leader's term.
        term: Term,
        /// The first index to read.
        from: Index,
        /// The last index that may be read.
        through: Index,
        /// The most entry bytes to read (at least one entry is read).
        max_bytes: u64,
    },
    /// Save a received snapshot chunk (and on the last one, install the
    /// snapshot), then report [`Input::SnapshotChunkSaved`].
    SaveSnapshotChunk {
        /// Which snapshot.
        meta: SnapshotMeta,
        /// Where the chunk starts.
        offset: u64,
        /// The chunk.
        data: Bytes,
        /// Whether this is the last chunk.
        done: bool,
    },
    /// Log entries up to and including `through` are covered by a snapshot
    /// and no longer needed; storage may drop them.
    Compact {
        /// The last index that may be dropped.
        through: Index,
    },
    /// The node's role, term or known leader changed. Informational.
    RoleChanged {
        /// The new role.
        role: Role,
        /// The current term.
        term: Term,
        /// The known leader, if any.
        leader: Option<NodeId>,
    },
    /// This node has been removed from the group. It stops campaigning and
    /// answers every request with [`RequestError::Removed`].
    Removed,
    /// The engine detected a fault (see [`crate::Fault`] for what each kind
    /// means and what the node does about it). The runtime reports it to
    /// the operator; repeated ones may be rate-limited.
    Fault(crate::Fault),
}

/// A write to the durable log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PersistRequest {
    /// Sequence number, increasing by one per request.
    pub seq: u64,
    /// A new hard state to write, if it changed.
    pub hard_state: Option<HardState>,
    /// Entries to write. If not empty, every stored entry at or after
    /// `entries[0].index` is replaced by these.
    pub entries: Vec<Entry>,
}
