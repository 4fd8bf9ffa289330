//! What a group handle can read without a call: the group's state on this
//! node as of its last step.

use ferry_raft::{Configuration, Index, NodeId, Role, Term};

/// A group's state on this node, published after every step of its engine
/// (see [`crate::GroupHandle::view`]). Reading it costs a lock, not a call
/// to the group's worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupView {
    /// This node's role.
    pub role: Role,
    /// Its current term.
    pub term: Term,
    /// The leader it knows of.
    pub leader: Option<NodeId>,
    /// Its last log index.
    pub last_index: Index,
    /// Its commit index.
    pub commit: Index,
    /// The index its machine has applied.
    pub applied: Index,
    /// The configuration in force.
    pub config: Configuration,
    /// Whether it is receiving a snapshot from the leader.
    pub receiving_snapshot: bool,
    /// Whether the group is quiet here: idle, with no heartbeats and no
    /// election timer running (see the engine's quiescence).
    pub quiescent: bool,
    /// Whether it was removed from the group.
    pub removed: bool,
    /// The fault it halted the group on, if it did.
    pub halted: Option<String>,
}

impl Default for GroupView {
    fn default() -> Self {
        GroupView {
            role: Role::Follower,
            term: 0,
            leader: None,
            last_index: 0,
            commit: 0,
            applied: 0,
            config: Configuration::default(),
            receiving_snapshot: false,
            quiescent: false,
            removed: false,
            halted: None,
        }
    }
}
