//! Quorum arithmetic for simple and joint configurations: the committed
//! index a set of match indexes supports, and the result of an election.
//!
//! In a joint configuration both halves must agree separately: the committed
//! index is the smaller of the two halves' indexes, and an election is won
//! only when both halves grant it.

use std::collections::BTreeSet;

use crate::membership::Configuration;
use crate::types::{Index, NodeId};

/// The outcome of a vote count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VoteResult {
    /// A quorum granted.
    Won,
    /// A quorum can no longer grant.
    Lost,
    /// Not decided yet.
    Pending,
}

/// The highest index that a majority of `voters` has reached, given each
/// voter's index. An empty voter set supports any index (it imposes no
/// constraint, which is what the outgoing half of a simple config means).
pub fn majority_index(voters: &BTreeSet<NodeId>, index_of: impl Fn(NodeId) -> Index) -> Index {
    if voters.is_empty() {
        return Index::MAX;
    }
    // Asked on every acknowledgment the leader gets: the usual cluster of
    // up to seven voters is sorted on the stack, not in a new vector.
    const ON_STACK_MAX: usize = 8;
    let mut on_stack = [0; ON_STACK_MAX];
    let mut on_heap = Vec::new();
    let indexes: &mut [Index] = if voters.len() <= ON_STACK_MAX {
        for (slot, &voter) in on_stack.iter_mut().zip(voters) {
            *slot = index_of(voter);
        }
        &mut on_stack[..voters.len()]
    } else {
        on_heap.extend(voters.iter().map(|&v| index_of(v)));
        &mut on_heap
    };
    indexes.sort_unstable_by(|a, b| b.cmp(a));
    indexes[voters.len() / 2]
}

/// The committed index under `config` (joint-aware).
pub fn committed_index(config: &Configuration, index_of: impl Fn(NodeId) -> Index) -> Index {
    let incoming = majority_index(&config.voters, &index_of);
    let outgoing = majority_index(&config.voters_outgoing, &index_of);
    let index = incoming.min(outgoing);
    if index == Index::MAX {
        0
    } else {
        index
    }
}

/// The result of a vote among `voters`, given each voter's answer (`None` = no answer yet).
pub fn majority_vote(
    voters: &BTreeSet<NodeId>,
    vote_of: impl Fn(NodeId) -> Option<bool>,
) -> VoteResult {
    if voters.is_empty() {
        return VoteResult::Won;
    }
    let (mut granted, mut missing) = (0usize, 0usize);
    for &voter in voters {
        match vote_of(voter) {
            Some(true) => granted += 1,
            Some(false) => {}
            None => missing += 1,
        }
    }
    let quorum = voters.len() / 2 + 1;
    if granted >= quorum {
        VoteResult::Won
    } else if granted + missing >= quorum {
        VoteResult::Pending
    } else {
        VoteResult::Lost
    }
}

/// The result of a vote under `config` (joint-aware).
pub fn vote_result(config: &Configuration, vote_of: impl Fn(NodeId) -> Option<bool>) -> VoteResult {
    let incoming = majority_vote(&config.voters, &vote_of);
    let outgoing = majority_vote(&config.voters_outgoing, &vote_of);
    match (incoming, outgoing) {
        (VoteResult::Won, VoteResult::Won) => VoteResult::Won,
        (VoteResult::Lost, _) | (_, VoteResult::Lost) => VoteResult::Lost,
        (VoteResult::Won | VoteResult::Pending, VoteResult::Pending)
        | (VoteResult::Pending, VoteResult::Won) => VoteResult::Pending,
    }
}

/// Whether the nodes for which `active` holds form a quorum of `config`.
pub fn is_quorum(config: &Configuration, active: impl Fn(NodeId) -> bool) -> bool {
    vote_result(config, |id| Some(active(id))) == VoteResult::Won
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn config(voters: &[NodeId], outgoing: &[NodeId]) -> Configuration {
        Configuration {
            voters: voters.iter().copied().collect(),
            voters_outgoing: outgoing.iter().copied().collect(),
            learners: BTreeSet::new(),
        }
    }

    #[test]
    fn simple_majority() {
        let c = config(&[1, 2, 3], &[]);
        let m: BTreeMap<NodeId, Index> = [(1, 5), (2, 3), (3, 1)].into();
        assert_eq!(committed_index(&c, |id| m[&id]), 3);
        assert_eq!(
            vote_result(&c, |id| (id == 1).then_some(true)),
            VoteResult::Pending
        );
        assert_eq!(vote_result(&c, |id| Some(id != 3)), VoteResult::Won);
        assert_eq!(vote_result(&c, |id| Some(id == 1)), VoteResult::Lost);
    }

    #[test]
    fn joint_needs_both_halves() {
        let c = config(&[1, 2, 3], &[1, 4, 5]);
        let m: BTreeMap<NodeId, Index> = [(1, 9), (2, 9), (3, 9), (4, 1), (5, 1)].into();
        assert_eq!(committed_index(&c, |id| m[&id]), 1);
        assert_eq!(vote_result(&c, |id| Some(id <= 3)), VoteResult::Lost);
    }

    /// Brute force: an index is committed iff a majority of each half has reached it.
    fn brute_committed(c: &Configuration, m: &BTreeMap<NodeId, Index>) -> Index {
        let ok = |set: &BTreeSet<NodeId>, i: Index| {
            set.is_empty() || set.iter().filter(|v| m[v] >= i).count() * 2 > set.len()
        };
        (0..=20)
            .rev()
            .find(|&i| ok(&c.voters, i) && ok(&c.voters_outgoing, i))
            .unwrap_or(0)
    }

    proptest! {
        #[test]
        fn committed_matches_brute_force(
            incoming in proptest::collection::btree_set(1u64..8, 1..6),
            outgoing in proptest::collection::btree_set(1u64..8, 0..6),
            indexes in proptest::collection::vec(0u64..20, 8),
        ) {
            let c = Configuration { voters: incoming, voters_outgoing: outgoing, learners: BTreeSet::new() };
            let m: BTreeMap<NodeId, Index> = (1..8).map(|id| (id, indexes[id as usize])).collect();
            prop_assert_eq!(committed_index(&c, |id| m[&id]), brute_committed(&c, &m));
        }

        #[test]
        fn votes_match_brute_force(
            incoming in proptest::collection::btree_set(1u64..8, 1..6),
            outgoing in proptest::collection::btree_set(1u64..8, 0..6),
            answers in proptest::collection::vec(0u8..3, 8),
        ) {
            let c = Configuration { voters: incoming, voters_outgoing: outgoing, learners: BTreeSet::new() };
            let vote_of = |id: NodeId| match answers[id as usize] { 0 => None, 1 => Some(true), _ => Some(false) };
            let half = |set: &BTreeSet<NodeId>| {
                if set.is_empty() { return VoteResult::Won; }
                let yes = set.iter().filter(|&&v| vote_of(v) == Some(true)).count();
                let maybe = set.iter().filter(|&&v| vote_of(v).is_none()).count();
                if yes * 2 > set.len() { VoteResult::Won }
                else if (yes + maybe) * 2 > set.len() { VoteResult::Pending }
                else { VoteResult::Lost }
            };
            let expected = match (half(&c.voters), half(&c.voters_outgoing)) {
                (VoteResult::Won, VoteResult::Won) => VoteResult::Won,
                (VoteResult::Lost, _) | (_, VoteResult::Lost) => VoteResult::Lost,
                _ => VoteResult::Pending,
            };
            prop_assert_eq!(vote_result(&c, vote_of), expected);
            // Monotonic: granting one more missing vote never turns Won into anything else.
            if expected == VoteResult::Won {
                prop_assert!(is_quorum(&c, |id| vote_of(id) == Some(true)));
            }
        }
    }
}
