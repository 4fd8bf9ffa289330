//! The messages Raft nodes exchange. Every message names its group, sender,
//! receiver and the sender's term; the body says what it is.

use bytes::Bytes;

use crate::request::{ForwardedRequest, RequestError, RequestId, Response};
use crate::types::{Entry, GroupId, Index, NodeId, SnapshotMeta, Term};

/// The `read_seq` of a heartbeat that only carries a new commit index: the
/// follower does not answer it. Read rounds count from 1.
pub const COMMIT_NOTICE_READ_SEQ: u64 = 0;

/// A message between two members of one group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The group the message belongs to.
    pub group: GroupId,
    /// The sender.
    pub from: NodeId,
    /// The receiver.
    pub to: NodeId,
    /// The sender's current term (for a pre-vote request: the term the
    /// sender would campaign in).
    pub term: Term,
    /// What the message says.
    pub body: MessageBody,
}

/// The kinds of message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MessageBody {
    /// A candidate (or pre-candidate) asks for a vote.
    RequestVote {
        /// A pre-vote: asks "would you vote for me?" without changing anyone's term.
        pre_vote: bool,
        /// The index of the candidate's last entry.
        last_log_index: Index,
        /// The term of the candidate's last entry.
        last_log_term: Term,
        /// Set when the candidate campaigns because the leader told it to
        /// (leadership transfer); voters then ignore their leader lease.
        transfer: bool,
    },
    /// The answer to a vote request.
    RequestVoteResponse {
        /// Answers a pre-vote request.
        pre_vote: bool,
        /// Whether the vote was granted.
        granted: bool,
        /// The voter's commit index. A candidate whose log holds the same
        /// entry there (`commit_term`) learns that it is committed: a
        /// configuration change that only some voters know to be committed
        /// may decide who can win (see `RaftNode::learn_commit`).
        commit: Index,
        /// The term of the voter's entry at `commit` (0 with `commit` 0).
        commit_term: Term,
    },
    /// The leader replicates entries (possibly none) that follow
    /// (`prev_log_index`, `prev_log_term`).
    Append {
        /// The index of the entry just before `entries`.
        prev_log_index: Index,
        /// The term of that entry.
        prev_log_term: Term,
        /// The entries, consecutive, starting at `prev_log_index + 1`.
        entries: Vec<Entry>,
        /// The leader's commit index.
        leader_commit: Index,
    },
    /// A follower's answer to an append.
    AppendResponse(AppendResult),
    /// The leader asserts its leadership and, with `read_seq`, asks the
    /// follower to confirm it for pending ReadIndex requests.
    Heartbeat {
        /// The leader's commit index, capped at what the follower is known to have.
        leader_commit: Index,
        /// The leader's read round; echoed back. 0 makes it a commit notice,
        /// sent when the commit index moves with nothing else to send: it
        /// is not answered.
        read_seq: u64,
    },
    /// A follower's answer to a heartbeat.
    HeartbeatResponse {
        /// The read round of the heartbeat being answered.
        read_seq: u64,
        /// The follower's last log index: a leader that sees it below what
        /// the follower acknowledged learns that its log went backwards.
        last_index: Index,
        /// The follower could not take the heartbeat's commit index: no
        /// append of this leader has shown its log matching there since it
        /// (re)started. The leader sends it one.
        needs_append: bool,
    },
    /// One chunk of a snapshot, sent by the leader.
    SnapshotChunk {
        /// Which snapshot.
        meta: SnapshotMeta,
        /// Where in the snapshot's bytes this chunk starts.
        offset: u64,
        /// The chunk.
        data: Bytes,
        /// Whether this is the last chunk.
        done: bool,
    },
    /// The follower has saved a chunk; the leader may send the next one.
    SnapshotChunkAck {
        /// Which snapshot.
        snapshot_index: Index,
        /// The offset of the next chunk the follower expects.
        next_offset: u64,
    },
    /// The end of a snapshot transfer, whatever its outcome. Always sent, so
    /// the leader never waits for a signal that cannot come.
    SnapshotResponse {
        /// Which snapshot.
        snapshot_index: Index,
        /// What happened to it.
        outcome: SnapshotOutcome,
    },
    /// The leader tells a caught-up follower to campaign at once
    /// (leadership transfer).
    TimeoutNow,
    /// A follower passes a client request to the leader.
    Forward {
        /// The id the follower gave the request; echoed back.
        id: RequestId,
        /// The request.
        request: ForwardedRequest,
    },
    /// The leader's answer to a forwarded request.
    ForwardResponse {
        /// The id from the `Forward` message.
        id: RequestId,
        /// The outcome.
        result: Result<Response, RequestError>,
    },
    /// The leader of an idle group goes quiet (`Options::quiesce`): it sends
    /// no heartbeats until something wakes it. A follower whose log ends at
    /// (`last_index`, `last_term`), verified against this leader, and whose
    /// commit index is `commit`, stops its election timer; any other
    /// follower answers [`MessageBody::WakeUp`]. Not otherwise answered.
    Quiesce {
        /// The leader's last index (every member has matched it).
        last_index: Index,
        /// The term of the leader's entry at `last_index`.
        last_term: Term,
        /// The leader's commit index (equal to `last_index`).
        commit: Index,
    },
    /// A follower asks its quiescent leader to resume heartbeats: it was
    /// woken by something other than the leader (a client request, a
    /// message from another member), or it could not go quiet on the
    /// leader's [`MessageBody::Quiesce`]. The leader wakes and sends it an
    /// append, so that its log is verified against the leader again.
    WakeUp,
}

/// What a follower says about an append.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppendResult {
    /// The follower's log matches the leader's up to `match_index`.
    Success {
        /// The last index known to match the leader's log.
        match_index: Index,
    },
    /// The follower has no entry at `rejected_index` with the leader's
    /// `prev_log_term`.
    Reject {
        /// The `prev_log_index` of the rejected append.
        rejected_index: Index,
        /// A hint for the leader's next probe: the follower's best guess of
        /// the last index where the logs may agree.
        hint_index: Index,
        /// The term of the follower's entry at `hint_index` (0 when it has
        /// none there, e.g. when its log is empty or that index is compacted).
        hint_term: Term,
    },
}

/// The outcome of a snapshot transfer, reported by the follower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotOutcome {
    /// The follower installed the snapshot. Its log now ends at `last_index`.
    Installed {
        /// The follower's last log index after installing.
        last_index: Index,
    },
    /// The follower had already applied everything the snapshot covers and
    /// did not install it. Its log matches the leader's up to `match_index`.
    Stale {
        /// The follower's last index known to match the leader's log.
        match_index: Index,
    },
    /// The follower could not take the snapshot (a chunk out of order, or
    /// its storage failed); the leader starts over.
    Rejected,
}
