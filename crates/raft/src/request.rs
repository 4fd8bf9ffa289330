//! Client requests and their outcomes.
//!
//! Every request gets exactly one [`crate::Action::Respond`], in every role
//! and sub-state: executed, forwarded to the leader (and then answered),
//! held until a leader is known (with a deadline), or refused with a
//! [`RequestError`] that says why and what to do.

use bytes::Bytes;

use crate::membership::{Configuration, MembershipChange};
use crate::types::{GroupId, Index, NodeId, Term};

/// Identifies a client request on the node that received it. The runtime
/// chooses it; the engine echoes it in the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// A client request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Append a command to the log.
    Propose(Bytes),
    /// Wait until the state machine may be read at the given consistency.
    Read(ReadConsistency),
    /// Change the membership.
    ChangeMembership(MembershipChange),
    /// Hand leadership to another voter.
    TransferLeadership(NodeId),
    /// Report this node's view of the group. Answered locally in every state.
    Status,
    /// Start an election now (as etcd raft's `Campaign`), with a pre-vote
    /// round first when `pre_vote` is on (so a healthy leader is not
    /// deposed). Answered at once with [`Response::Campaign`], without
    /// waiting for the election's outcome (watch
    /// [`crate::Action::RoleChanged`]); a node that cannot campaign refuses
    /// with [`RequestError::CannotCampaign`], a removed one with
    /// [`RequestError::Removed`]. Never forwarded.
    Campaign,
}

/// The answer to [`Request::Campaign`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CampaignOutcome {
    /// This node started an election (a pre-vote round when `pre_vote` is on).
    Started,
    /// This node is already campaigning; that election goes on.
    AlreadyCampaigning,
    /// This node already leads the group.
    AlreadyLeader,
}

/// Why a node cannot campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CampaignRefusal {
    /// It does not vote in the configuration in force (a learner).
    NotVoter,
    /// It is receiving a snapshot: its log is being replaced.
    ReceivingSnapshot,
    /// Its term reached [`crate::TERM_MAX`] (see [`crate::Fault::TermExhausted`]).
    TermExhausted,
}

impl std::fmt::Display for CampaignRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CampaignRefusal::NotVoter => "it does not vote in the configuration in force",
            CampaignRefusal::ReceivingSnapshot => "it is receiving a snapshot",
            CampaignRefusal::TermExhausted => "its term cannot be incremented",
        })
    }
}

/// How fresh a read must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadConsistency {
    /// Linearizable, by ReadIndex: the leader confirms it is still leader
    /// with a quorum round, then the node waits until it has applied the
    /// leader's commit index at the time of the request.
    Linearizable,
    /// Linearizable under a clock assumption: the leader serves from its lease
    /// without a quorum round. Only with check-quorum on; see the crate docs.
    Lease,
    /// Whatever this node has applied, optionally waiting until it has
    /// applied at least `min_applied`.
    Local {
        /// The applied index to wait for, if any.
        min_applied: Option<Index>,
    },
}

/// A request passed from a follower to the leader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForwardedRequest {
    /// A proposal.
    Propose(Bytes),
    /// A ReadIndex request.
    ReadIndex,
    /// A membership change.
    ChangeMembership(MembershipChange),
    /// A leadership transfer.
    TransferLeadership(NodeId),
}

/// A successful outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// The proposal (command or membership change) is in the leader's log at
    /// (`index`, `term`). It takes effect if and when the entry at `index`
    /// applies with this `term`; if that index applies with another term, the
    /// proposal was lost and will never take effect.
    Proposed {
        /// Where the entry is.
        index: Index,
        /// The term it was proposed in.
        term: Term,
    },
    /// The state machine may now be read: it has applied at least `index`,
    /// which satisfies the requested consistency.
    ReadReady {
        /// The index the read is served at.
        index: Index,
    },
    /// The leader has started handing leadership to the target.
    TransferStarted,
    /// This node's view of the group.
    Status(Status),
    /// The answer to [`Request::Campaign`].
    Campaign(CampaignOutcome),
}

/// A node's view of its group, for status queries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The group.
    pub group: GroupId,
    /// This node.
    pub id: NodeId,
    /// Its role.
    pub role: Role,
    /// Whether it is receiving a snapshot.
    pub receiving_snapshot: bool,
    /// Its current term.
    pub term: Term,
    /// The leader it knows of, if any.
    pub leader: Option<NodeId>,
    /// Its last log index.
    pub last_index: Index,
    /// Its commit index.
    pub commit: Index,
    /// The index it has applied.
    pub applied: Index,
    /// The configuration in force.
    pub config: Configuration,
    /// Whether it has been removed from the group.
    pub removed: bool,
}

/// The role a node plays in its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Follows a leader (or waits for one).
    Follower,
    /// Checks with a pre-vote whether it could win an election.
    PreCandidate,
    /// Campaigns for votes.
    Candidate,
    /// Leads the group.
    Leader,
    /// A non-voting member.
    Learner,
}

/// Why a request was not carried out. Each says what the client can do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// This node does not take the request itself; send it to `leader`.
    /// Returned instead of forwarding when forwarding is off.
    #[error("not the leader; retry on node {leader:?}")]
    NotLeader {
        /// The leader, if known.
        leader: Option<NodeId>,
    },
    /// No leader became known before the request's deadline. The request had
    /// no effect; retry later.
    #[error(
        "no leader is known (an election may be under way); the request had no effect, retry later"
    )]
    NoLeader,
    /// The request was passed to the leader but no answer came before the
    /// deadline: the outcome is unknown.
    #[error("the leader did not answer in time; the request may or may not have taken effect")]
    Timeout,
    /// Too many requests are waiting on this node; retry later.
    #[error("too many requests are waiting (limit {limit}); retry later")]
    Busy {
        /// The queue limit that was reached.
        limit: usize,
    },
    /// This node is no longer a member of the group.
    #[error("this node has been removed from the group; send requests to a current member")]
    Removed,
    /// The leader lost leadership before it could confirm the read or
    /// accept the request; retry.
    #[error("leadership changed while the request was pending; retry")]
    LeadershipLost,
    /// A membership change is already in progress; retry once it completes.
    #[error("a membership change is already in progress; retry once it has been committed")]
    MembershipChangePending,
    /// The membership change makes no sense for the current configuration.
    #[error("membership change refused: {reason}")]
    InvalidMembershipChange {
        /// Why, in words.
        reason: String,
    },
    /// A learner cannot be promoted until it has caught up with the leader.
    #[error("learner {id} has not caught up yet (at {matched} of {last_index}); retry later")]
    LearnerNotCaughtUp {
        /// The learner.
        id: NodeId,
        /// Its match index.
        matched: Index,
        /// The leader's last index.
        last_index: Index,
    },
    /// A leadership transfer is under way; proposals wait for it to finish.
    #[error("a leadership transfer is under way; retry shortly")]
    TransferInProgress,
    /// Lease reads need check-quorum, which is off.
    #[error("lease reads need check_quorum, which is off; use a linearizable read")]
    LeaseReadsDisabled,
    /// This node detected that its log contradicts the group's (see
    /// [`crate::Fault::LogConflict`]) and halted the group: it serves
    /// nothing until it is repaired. Send requests to another member.
    #[error("this member halted the group after detecting a log conflict ({reason}); send requests to another member")]
    Halted {
        /// The fault, in words.
        reason: String,
    },
    /// [`Request::Campaign`] on a node that cannot campaign.
    #[error("this node cannot campaign: {reason}")]
    CannotCampaign {
        /// Why.
        reason: CampaignRefusal,
    },
}
