//! The runtime's errors: what a host or a group call can fail with.

use ferry_raft::{GroupId, RequestError};
use ferry_storage::StorageError;

/// Why a call on a group failed.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// The engine refused or could not complete the request (not the
    /// leader and no leader to forward to, a timeout, a removed or halted
    /// member, ...). See [`RequestError`] for what each means and whether
    /// retrying elsewhere can help.
    #[error(transparent)]
    Engine(#[from] RequestError),
    /// The group is not running on this host (never started, stopped, or
    /// the host is stopping).
    #[error("group {group} is not running on this node")]
    NotRunning {
        /// The group.
        group: GroupId,
    },
    /// The group is already running on this host.
    #[error("group {group} is already running on this node")]
    AlreadyRunning {
        /// The group.
        group: GroupId,
    },
    /// The entry a proposal was given was replaced by another leader's
    /// before it committed: the command was not applied.
    #[error("the proposal lost its place in the log to a new leader; it was not applied")]
    Dropped,
    /// The command was applied, but its response was not kept: a durable
    /// machine's state already held it (a streamed snapshot from the
    /// leader covered it). Retrying would apply it again.
    #[error("the command was applied, but its response came in a snapshot and was not kept")]
    AppliedWithoutAnswer,
    /// The group's stored state could not be read or refused to start.
    #[error("group {group}: {reason}")]
    Start {
        /// The group.
        group: GroupId,
        /// Why.
        reason: String,
    },
    /// The storage failed for this group's request.
    #[error("group {group}: storage: {source}")]
    Storage {
        /// The group.
        group: GroupId,
        /// The cause.
        source: StorageError,
    },
    /// The machine could not apply a committed command on this node (see
    /// [`crate::ApplyError`]): the group is stopped here. The command is
    /// committed, so it is applied on the other members and here once the
    /// group starts again.
    #[error(
        "group {group} stopped on this node: its machine could not apply entry {index}: {reason}"
    )]
    MachineFailed {
        /// The group.
        group: GroupId,
        /// The entry it could not apply.
        index: ferry_raft::Index,
        /// Why.
        reason: String,
    },
    /// A handle was used with a machine of another type than its group
    /// runs (a bug in the embedder).
    #[error("group {group} runs another kind of state machine than this handle's")]
    WrongMachine {
        /// The group.
        group: GroupId,
    },
}

impl GroupError {
    /// Whether a proposal that failed with this error may have been applied
    /// (or may be later): retrying could apply the command twice. Every
    /// other error means it was not and will not be.
    pub fn outcome_unknown(&self) -> bool {
        match self {
            GroupError::Engine(error) => match error {
                RequestError::Timeout => true,
                RequestError::NotLeader { .. }
                | RequestError::NoLeader
                | RequestError::Busy { .. }
                | RequestError::Removed
                | RequestError::LeadershipLost
                | RequestError::MembershipChangePending
                | RequestError::InvalidMembershipChange { .. }
                | RequestError::LearnerNotCaughtUp { .. }
                | RequestError::TransferInProgress
                | RequestError::LeaseReadsDisabled
                | RequestError::CannotCampaign { .. }
                | RequestError::Halted { .. } => false,
            },
            // Stopped while it waited: it may have been in the log.
            GroupError::NotRunning { .. } => true,
            GroupError::AppliedWithoutAnswer => true,
            // Committed (or waiting behind a command that is): it may
            // apply elsewhere, and here once the group starts again.
            GroupError::MachineFailed { .. } => true,
            GroupError::AlreadyRunning { .. }
            | GroupError::Dropped
            | GroupError::Start { .. }
            | GroupError::Storage { .. }
            | GroupError::WrongMachine { .. } => false,
        }
    }
}

/// Why a host could not start.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The storage could not be opened or recovered.
    #[error("storage in {dir}: {source}")]
    Storage {
        /// The data directory.
        dir: String,
        /// The cause.
        source: StorageError,
    },
    /// The peer transport could not start.
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
}
