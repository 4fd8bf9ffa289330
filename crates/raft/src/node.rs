//! The Raft node: one member of one group. (Skeleton: the public surface the
//! runtime and the simulator program against; the engine fills it in.)

use crate::io::{Action, Input};
use crate::membership::Configuration;
use crate::options::Options;
use crate::request::{Role, Status};
use crate::types::{Entry, Index, NodeId, RestoredState, SnapshotMeta, Term};

/// Why a node could not start from the state it was given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InitError {
    /// The restored state contradicts itself.
    #[error("restored state is inconsistent: {0}")]
    Inconsistent(String),
    /// The options are out of range.
    #[error("invalid options: {0}")]
    InvalidOptions(String),
}

/// One member of one Raft group.
#[derive(Debug)]
pub struct RaftNode {
    options: Options,
    snapshot: SnapshotMeta,
}

impl RaftNode {
    /// Starts a node from what its storage holds. `seed` drives the
    /// randomized election timeouts.
    pub fn new(options: Options, restored: RestoredState, seed: u64) -> Result<Self, InitError> {
        let _ = seed;
        Ok(RaftNode { options, snapshot: restored.snapshot })
    }

    /// Feeds one input; appends the resulting actions to `actions`.
    pub fn step(&mut self, input: Input, actions: &mut Vec<Action>) {
        let _ = (input, actions);
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.options.id
    }

    /// This node's view of its group.
    pub fn status(&self) -> Status {
        Status {
            group: self.options.group,
            id: self.options.id,
            role: Role::Follower,
            receiving_snapshot: false,
            term: 0,
            leader: None,
            last_index: 0,
            commit: 0,
            applied: 0,
            config: self.snapshot.config.clone(),
            removed: false,
        }
    }

    /// The current role.
    pub fn role(&self) -> Role { Role::Follower }
    /// The current term.
    pub fn term(&self) -> Term { 0 }
    /// The known leader.
    pub fn leader(&self) -> Option<NodeId> { None }
    /// The commit index.
    pub fn commit_index(&self) -> Index { 0 }
    /// The index last handed to the state machine.
    pub fn applied_index(&self) -> Index { 0 }
    /// The index of the first entry held in the log (snapshot index + 1 when empty).
    pub fn first_index(&self) -> Index { self.snapshot.index + 1 }
    /// The index of the last entry (the snapshot index when the log is empty).
    pub fn last_index(&self) -> Index { self.snapshot.index }
    /// The term of the entry at `index`, if the log or the snapshot knows it.
    pub fn term_at(&self, index: Index) -> Option<Term> { let _ = index; None }
    /// The entry at `index`, if held in the log.
    pub fn entry(&self, index: Index) -> Option<&Entry> { let _ = index; None }
    /// The latest snapshot.
    pub fn snapshot_meta(&self) -> &SnapshotMeta { &self.snapshot }
    /// The configuration in force.
    pub fn config(&self) -> &Configuration { &self.snapshot.config }
    /// Whether the node is in its receiving-snapshot sub-state.
    pub fn is_receiving_snapshot(&self) -> bool { false }
}
