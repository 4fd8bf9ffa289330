//! Membership: who votes, who only learns, and how that changes safely.
//!
//! A configuration is either simple (one voter set) or joint (the incoming
//! and the outgoing voter sets, each of which must agree separately). Voter
//! changes always pass through a joint configuration, which the leader leaves
//! automatically once the joint entry is committed.

use std::collections::BTreeSet;

use crate::types::NodeId;

/// A membership configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Configuration {
    /// The voters of the (incoming) configuration.
    pub voters: BTreeSet<NodeId>,
    /// The voters of the outgoing configuration while in joint consensus;
    /// empty when the configuration is simple.
    pub voters_outgoing: BTreeSet<NodeId>,
    /// Members that receive the log but neither vote nor count for commit.
    pub learners: BTreeSet<NodeId>,
}

impl Configuration {
    /// A simple configuration with the given voters and no learners.
    pub fn with_voters(voters: impl IntoIterator<Item = NodeId>) -> Self {
        Configuration {
            voters: voters.into_iter().collect(),
            ..Configuration::default()
        }
    }

    /// Whether this is a joint configuration.
    pub fn is_joint(&self) -> bool {
        !self.voters_outgoing.is_empty()
    }

    /// Whether `id` votes in either half of the configuration.
    pub fn is_voter(&self, id: NodeId) -> bool {
        self.voters.contains(&id) || self.voters_outgoing.contains(&id)
    }

    /// Whether `id` is a learner.
    pub fn is_learner(&self, id: NodeId) -> bool {
        self.learners.contains(&id)
    }

    /// Whether `id` is a member at all.
    pub fn contains(&self, id: NodeId) -> bool {
        self.is_voter(id) || self.is_learner(id)
    }

    /// Every member, voters and learners, each once, in id order.
    pub fn members(&self) -> BTreeSet<NodeId> {
        self.voters
            .iter()
            .chain(&self.voters_outgoing)
            .chain(&self.learners)
            .copied()
            .collect()
    }

    /// The number of distinct members.
    pub fn member_count(&self) -> usize {
        self.members().len()
    }
}

/// A change of membership a client may request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MembershipChange {
    /// Add a non-voting member. Takes effect in one step.
    AddLearner(NodeId),
    /// Add a voter directly (through joint consensus).
    AddVoter(NodeId),
    /// Make a learner a voter (through joint consensus). Refused until the
    /// learner has caught up with the leader's log.
    PromoteLearner(NodeId),
    /// Remove a voter (through joint consensus) or a learner (in one step).
    Remove(NodeId),
}
