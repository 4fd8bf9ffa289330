//! The Raft safety properties, checked as the run goes: election safety
//! (at most one leader per term), log matching (an index and term name one
//! entry, with one predecessor), leader completeness (a new leader holds
//! every committed entry) and state machine safety (no two nodes apply
//! different entries at one index).
//!
//! The checker sees what the engines write, send, commit and apply; it keeps
//! one global record per (index, term) and per committed index. A run keeps
//! one checker per Raft group: the properties hold within a group.

use std::collections::BTreeMap;
use std::fmt;

use ferry_raft::{Entry, EntryPayload, Index, NodeId, RaftNode, Term};

/// What kind of promise a run broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// A Raft safety property.
    Safety,
    /// Something was acknowledged before it was durable, or durable state went back.
    Durability,
    /// The engine broke its contract with the runtime (an action that cannot be carried out).
    Contract,
    /// The cluster did not converge after the faults stopped.
    Liveness,
    /// The client history is not linearizable.
    Linearizability,
    /// A scenario's expected outcome did not happen.
    Scenario,
    /// The engine (or the simulator) panicked.
    Panic,
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FailureKind::Safety => "safety",
            FailureKind::Durability => "durability",
            FailureKind::Contract => "contract",
            FailureKind::Liveness => "liveness",
            FailureKind::Linearizability => "linearizability",
            FailureKind::Scenario => "scenario",
            FailureKind::Panic => "panic",
        })
    }
}

/// Why a seed failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The kind of promise broken.
    pub kind: FailureKind,
    /// The simulated time it was noticed at.
    pub at_us: u64,
    /// What exactly, in words.
    pub detail: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} violation at {}us: {}",
            self.kind, self.at_us, self.detail
        )
    }
}

/// A broken safety property, in words.
pub type Violation = String;

/// The global record the safety properties are checked against.
#[derive(Clone, Debug, Default)]
pub struct SafetyChecker {
    leaders: BTreeMap<Term, NodeId>,
    entries: BTreeMap<(Index, Term), EntryPayload>,
    predecessors: BTreeMap<(Index, Term), Term>,
    /// Committed entries with the term of the node that first saw them
    /// committed (at least the term they were committed in).
    committed: BTreeMap<Index, (Term, EntryPayload, Term)>,
    applied: BTreeMap<Index, (Term, EntryPayload, NodeId)>,
}

impl SafetyChecker {
    /// Records that `node` is leader in `term`.
    pub fn observe_leader(&mut self, term: Term, node: NodeId) -> Result<(), Violation> {
        match self.leaders.get(&term) {
            Some(&other) if other != node => Err(format!(
                "election safety: nodes {other} and {node} are both leader in term {term}"
            )),
            Some(_) => Ok(()),
            None => {
                self.leaders.insert(term, node);
                Ok(())
            }
        }
    }

    /// Whether a leader was seen in some term before `term`.
    pub fn leader_before(&self, term: Term) -> bool {
        self.leaders.range(..term).next().is_some()
    }

    /// The leader of `term`, if one was seen.
    pub fn leader_of(&self, term: Term) -> Option<NodeId> {
        self.leaders.get(&term).copied()
    }

    /// Records a run of consecutive entries, optionally with the (index,
    /// term) of the entry before them, as some node holds or sends them.
    pub fn observe_entries(
        &mut self,
        node: NodeId,
        previous: Option<(Index, Term)>,
        entries: &[Entry],
    ) -> Result<(), Violation> {
        let mut prev = previous;
        for entry in entries {
            if let Some((prev_index, prev_term)) = prev {
                if prev_index + 1 == entry.index {
                    self.observe_predecessor(node, entry, prev_term)?;
                }
            }
            match self.entries.get(&(entry.index, entry.term)) {
                Some(payload) if *payload != entry.payload => {
                    return Err(format!(
                        "log matching: node {node} holds ({}, {}) = {:?}, elsewhere it is {:?}",
                        entry.index, entry.term, entry.payload, payload
                    ))
                }
                Some(_) => {}
                None => {
                    self.entries
                        .insert((entry.index, entry.term), entry.payload.clone());
                }
            }
            prev = Some((entry.index, entry.term));
        }
        Ok(())
    }

    fn observe_predecessor(
        &mut self,
        node: NodeId,
        entry: &Entry,
        prev_term: Term,
    ) -> Result<(), Violation> {
        match self.predecessors.get(&(entry.index, entry.term)) {
            Some(&known) if known != prev_term => Err(format!(
                "log matching: node {node} has ({}, {}) after an entry of term {prev_term}, elsewhere after term {known}",
                entry.index, entry.term
            )),
            Some(_) => Ok(()),
            None => {
                self.predecessors.insert((entry.index, entry.term), prev_term);
                Ok(())
            }
        }
    }

    /// Records that `node`, in `node_term`, considers `entry` committed.
    pub fn observe_committed(
        &mut self,
        node: NodeId,
        node_term: Term,
        entry: &Entry,
    ) -> Result<(), Violation> {
        match self.committed.get(&entry.index) {
            Some((term, payload, _)) if *term != entry.term || *payload != entry.payload => Err(format!(
                "state machine safety: node {node} committed ({}, {}) but ({}, {term}) was committed before",
                entry.index, entry.term, entry.index
            )),
            Some(_) => Ok(()),
            None => {
                self.committed
                    .insert(entry.index, (entry.term, entry.payload.clone(), node_term));
                Ok(())
            }
        }
    }

    /// Records that `node`, in `node_term`, applied `entry`.
    pub fn observe_applied(
        &mut self,
        node: NodeId,
        node_term: Term,
        entry: &Entry,
    ) -> Result<(), Violation> {
        match self.applied.get(&entry.index) {
            Some((term, payload, other)) if *term != entry.term || *payload != entry.payload => Err(format!(
                "state machine safety: node {node} applied ({}, {}) {:?} but node {other} applied ({}, {term}) {:?}",
                entry.index, entry.term, entry.payload, entry.index, payload
            )),
            Some(_) => Ok(()),
            None => {
                self.applied
                    .insert(entry.index, (entry.term, entry.payload.clone(), node));
                self.observe_committed(node, node_term, entry)
            }
        }
    }

    /// Checks that a node that just became leader holds every entry known
    /// committed in an earlier term, after its snapshot. (An entry first
    /// seen committed in the leader's term or later may have been committed
    /// after this leader's election: Raft promises nothing about it.)
    pub fn check_leader_completeness(&self, leader: &RaftNode) -> Result<(), Violation> {
        let snapshot = leader.snapshot_meta();
        let leader_term = leader.term();
        if let Some((term, _, seen_in)) = self.committed.get(&snapshot.index) {
            if snapshot.index > 0 && *seen_in < leader_term && *term != snapshot.term {
                return Err(format!(
                    "leader completeness: leader {} has a snapshot at ({}, {}) but ({}, {term}) is committed",
                    leader.id(),
                    snapshot.index,
                    snapshot.term,
                    snapshot.index
                ));
            }
        }
        for (&index, (term, payload, seen_in)) in self.committed.range(snapshot.index + 1..) {
            if *seen_in >= leader_term {
                continue;
            }
            match leader.entry(index) {
                Some(entry) if entry.term == *term && entry.payload == *payload => {}
                Some(entry) => {
                    return Err(format!(
                        "leader completeness: leader {} of term {} has ({index}, {}) where ({index}, {term}) is committed",
                        leader.id(),
                        leader.term(),
                        entry.term
                    ))
                }
                // Its body may be in storage only (beyond the engine's
                // memory bound): the log still knows its term.
                None if leader.term_at(index) == Some(*term) => {}
                None => {
                    return Err(format!(
                        "leader completeness: leader {} of term {} lacks committed entry ({index}, {term}) (its log ends at {})",
                        leader.id(),
                        leader.term(),
                        leader.last_index()
                    ))
                }
            }
        }
        Ok(())
    }

    /// The highest index known committed.
    pub fn committed_index(&self) -> Index {
        self.committed.keys().next_back().copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn entry(index: Index, term: Term, byte: u8) -> Entry {
        Entry {
            index,
            term,
            payload: EntryPayload::Command(Bytes::from(vec![byte])),
        }
    }

    #[test]
    fn two_leaders_in_one_term_are_caught() {
        let mut checker = SafetyChecker::default();
        checker.observe_leader(3, 1).unwrap();
        checker.observe_leader(3, 1).unwrap();
        checker.observe_leader(4, 2).unwrap();
        assert!(checker.observe_leader(3, 2).is_err());
    }

    #[test]
    fn log_matching_violations_are_caught() {
        let mut checker = SafetyChecker::default();
        checker
            .observe_entries(1, Some((0, 0)), &[entry(1, 1, 1), entry(2, 1, 2)])
            .unwrap();
        checker.observe_entries(2, None, &[entry(2, 1, 2)]).unwrap();
        assert!(checker.observe_entries(2, None, &[entry(2, 1, 9)]).is_err());
        assert!(checker
            .observe_entries(3, Some((1, 5)), &[entry(2, 1, 2)])
            .is_err());
    }

    #[test]
    fn different_applied_entries_are_caught() {
        let mut checker = SafetyChecker::default();
        checker.observe_applied(1, 1, &entry(1, 1, 1)).unwrap();
        checker.observe_applied(2, 1, &entry(1, 1, 1)).unwrap();
        assert!(checker.observe_applied(3, 2, &entry(1, 2, 1)).is_err());
        assert!(checker.observe_committed(3, 2, &entry(1, 1, 7)).is_err());
        assert_eq!(checker.committed_index(), 1);
    }
}
