//! Faults the engine detects: input no correct peer sends, and states Raft's
//! assumptions rule out (a log that lost what it acknowledged, two entries at
//! one index and term). Each is reported as [`crate::Action::Fault`]; what
//! the node does about it is fixed per kind (see [`Fault`]).
//!
//! # Limits on terms and indexes
//!
//! A message whose term or any index exceeds [`TERM_MAX`] / [`INDEX_MAX`] is
//! refused before it is looked at. No real group gets near them (a new term
//! every millisecond for a million years is below 2^45), and every sum the
//! engine forms from a value at most 2^62 and a count bounded by a message's
//! size stays far from `u64::MAX`, so none can wrap. A node whose own term
//! reaches `TERM_MAX` (only a faulty peer could have brought it there) stops
//! campaigning and reports [`Fault::TermExhausted`] instead of wrapping to
//! term 0.

use crate::message::{AppendResult, Message, MessageBody, SnapshotOutcome};
use crate::types::{Index, NodeId, Term};

/// The largest term a node adopts or campaigns in.
pub const TERM_MAX: Term = 1 << 62;

/// The largest log index (and snapshot byte offset) a message may carry.
pub const INDEX_MAX: Index = 1 << 62;

/// A fault the engine detected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Fault {
    /// A message was refused unread: one of its terms or indexes is beyond
    /// the limits. Nothing changed; the sender is faulty or hostile.
    #[error("refused a message from node {from:x}: its {field} {value} is beyond the limit")]
    MessageOutOfRange {
        /// The sender.
        from: NodeId,
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// This node's term reached [`TERM_MAX`]: it no longer campaigns (its
    /// term cannot be incremented). Only a faulty peer can cause this.
    #[error("term {term} cannot be incremented: this node no longer campaigns")]
    TermExhausted {
        /// The term.
        term: Term,
    },
    /// A leader's entry differs from this node's entry at the same index and
    /// term, or contradicts an entry this node holds as committed: the log
    /// matching property is broken (two leaders in one term through a
    /// duplicated node id or a restored data directory, or forged traffic).
    /// The node halts the group: it takes no more entries, applies nothing
    /// more and answers requests with [`crate::RequestError::Halted`]. The way
    /// back is the repair procedure (remove the member, wipe it, add it anew).
    #[error(
        "node {from:x} sent an entry at index {index} (term {term}) that contradicts this node's log; \
         the group is halted on this node"
    )]
    LogConflict {
        /// The sender of the contradicting entry.
        from: NodeId,
        /// Where.
        index: Index,
        /// The term of the sender's entry.
        term: Term,
    },
    /// The leader believes this node's log matches further than it holds:
    /// its commit index, capped at what it knows matches here, is beyond
    /// this node's last index. This node's log lost entries it had
    /// acknowledged (a damaged tail cut, or an older copy of its data
    /// directory). The commit is refused; the node's answers carry its real
    /// last index, and the leader sends it the log again.
    #[error(
        "leader {from:x} sent commit index {commit} but this node's log ends at {last_index}: \
         the log lost entries it had acknowledged"
    )]
    CommitBeyondLog {
        /// The leader.
        from: NodeId,
        /// Its commit index.
        commit: Index,
        /// This node's last index.
        last_index: Index,
    },
    /// (On the leader.) A follower's answer shows that it no longer holds
    /// entries it acknowledged: its log ends before them, or a probe at an
    /// acknowledged index was refused (its log went backwards, or an older
    /// copy replaced it). The leader forgets what it knew matched and probes
    /// it afresh.
    #[error(
        "follower {peer:x} acknowledged entries through {match_index} but no longer holds them \
         (its log ends at or differs from {last_index}); sending it the log again"
    )]
    FollowerLogWentBack {
        /// The follower.
        peer: NodeId,
        /// What it had acknowledged.
        match_index: Index,
        /// Its last index now, or where its log may first differ.
        last_index: Index,
        /// Shown by an answer sent after the follower acknowledged (a
        /// heartbeat round begun later): certain. `false` when a rejection
        /// of the probe showed it, which a late duplicate of a rejection
        /// sent before the acknowledgement can also do (the leader then only
        /// spends one more probe round).
        certain: bool,
    },
    /// (On the leader.) Entries that storage returned for a follower (the
    /// answer to [`crate::Action::LoadEntries`]) do not fit the log: an
    /// index out of the range asked for or out of order, a term that
    /// differs from the log's term there, or a configuration entry where
    /// the log has none (or the reverse). Storage is damaged or the runtime
    /// answered another request. Nothing of it is sent; the leader asks
    /// again with the next heartbeat round (so a storage that keeps failing
    /// is reported once a round).
    #[error(
        "storage returned entries for follower {peer:x} (asked from index {from}) that do not \
         fit the log at index {index}: {reason}; asking again with the next heartbeat"
    )]
    LoadedEntriesInvalid {
        /// The follower they were for.
        peer: NodeId,
        /// The first index asked for.
        from: Index,
        /// Where they do not fit.
        index: Index,
        /// How.
        reason: &'static str,
    },
}

/// Checks every term and index in `message` against the limits.
pub(crate) fn check_message(message: &Message) -> Result<(), Fault> {
    let from = message.from;
    let check = |field: &'static str, value: u64, max: u64| {
        if value > max {
            Err(Fault::MessageOutOfRange { from, field, value })
        } else {
            Ok(())
        }
    };
    let term = |field, value| check(field, value, TERM_MAX);
    let index = |field, value| check(field, value, INDEX_MAX);
    term("term", message.term)?;
    match &message.body {
        MessageBody::RequestVote {
            last_log_index,
            last_log_term,
            ..
        } => {
            index("last log index", *last_log_index)?;
            term("last log term", *last_log_term)
        }
        MessageBody::RequestVoteResponse {
            commit,
            commit_term,
            ..
        } => {
            index("commit index", *commit)?;
            term("commit term", *commit_term)
        }
        MessageBody::Append {
            prev_log_index,
            prev_log_term,
            entries,
            leader_commit,
        } => {
            index("previous log index", *prev_log_index)?;
            term("previous log term", *prev_log_term)?;
            index("commit index", *leader_commit)?;
            for entry in entries {
                index("entry index", entry.index)?;
                term("entry term", entry.term)?;
            }
            Ok(())
        }
        MessageBody::AppendResponse(AppendResult::Success { match_index }) => {
            index("match index", *match_index)
        }
        MessageBody::AppendResponse(AppendResult::Reject {
            rejected_index,
            hint_index,
            hint_term,
        }) => {
            index("rejected index", *rejected_index)?;
            index("hint index", *hint_index)?;
            term("hint term", *hint_term)
        }
        MessageBody::Heartbeat { leader_commit, .. } => index("commit index", *leader_commit),
        MessageBody::HeartbeatResponse { last_index, .. } => index("last index", *last_index),
        MessageBody::SnapshotChunk { meta, offset, .. } => {
            index("snapshot index", meta.index)?;
            term("snapshot term", meta.term)?;
            index("chunk offset", *offset)
        }
        MessageBody::SnapshotChunkAck {
            snapshot_index,
            next_offset,
        } => {
            index("snapshot index", *snapshot_index)?;
            index("chunk offset", *next_offset)
        }
        MessageBody::SnapshotResponse {
            snapshot_index,
            outcome,
        } => {
            index("snapshot index", *snapshot_index)?;
            match outcome {
                SnapshotOutcome::Installed { last_index: i }
                | SnapshotOutcome::Stale { match_index: i } => index("snapshot outcome index", *i),
                SnapshotOutcome::Rejected => Ok(()),
            }
        }
        MessageBody::Quiesce {
            last_index,
            last_term,
            commit,
        } => {
            index("last index", *last_index)?;
            term("last term", *last_term)?;
            index("commit index", *commit)
        }
        MessageBody::TimeoutNow
        | MessageBody::WakeUp
        | MessageBody::Forward { .. }
        | MessageBody::ForwardResponse { .. } => Ok(()),
    }
}
