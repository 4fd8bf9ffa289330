//! The in-memory Raft log: the entries after the last compaction point, with
//! conflict detection, term lookup, compaction and tracking of which entries
//! have been handed to storage and which are known durable.
//!
//! The log keeps the entries after its *boundary* (the last compacted index
//! and its term). The boundary trails the latest snapshot by
//! `compaction_lag_entries`, so followers slightly behind still get entries.

use std::collections::VecDeque;

use crate::membership::Configuration;
use crate::types::{Entry, EntryPayload, Index, SnapshotMeta, Term};

/// Why an append from a leader did not fit the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendMismatch {
    /// The largest index at or below the rejected one whose term is at most
    /// the leader's `prev_log_term` (or the last index if the log is shorter).
    pub hint_index: Index,
    /// The term at `hint_index` (0 if the log cannot tell: empty or compacted).
    pub hint_term: Term,
}

/// Why an append from a leader was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppendError {
    /// The log does not hold (`prev_index`, `prev_term`): the usual
    /// rejection, with a hint for the leader's next probe.
    Mismatch(AppendMismatch),
    /// An entry contradicts the log: another entry at the same index and
    /// term, or a different term at a committed index. Raft rules this out
    /// between correct nodes (see [`crate::Fault::LogConflict`]).
    Conflict {
        /// Where.
        index: Index,
        /// The term of the leader's entry there.
        term: Term,
    },
}

/// The in-memory log of one node.
#[derive(Clone, Debug)]
pub struct RaftLog {
    /// Entries after `boundary_index`, consecutive.
    entries: VecDeque<Entry>,
    /// The last index no longer held in `entries` (compacted or covered by a snapshot).
    boundary_index: Index,
    /// The term of the entry at `boundary_index`.
    boundary_term: Term,
    /// The configuration in force at `boundary_index`.
    boundary_config: Configuration,
    /// The latest snapshot (index >= boundary_index).
    snapshot: SnapshotMeta,
    /// The first index not yet handed to storage in a persist request.
    persist_from: Index,
    /// Every entry up to here is known durable.
    durable_index: Index,
    /// Indexes of the config entries held in `entries`, ascending, so the
    /// configuration at an index is found without scanning the log.
    config_indexes: VecDeque<Index>,
}

impl RaftLog {
    /// A log restored from a snapshot and the synced entries after it.
    pub fn restore(snapshot: SnapshotMeta, mut entries: Vec<Entry>) -> Result<Self, String> {
        // Entries the snapshot covers (kept by storage for the compaction
        // lag) are not needed to restart.
        let covered = entries
            .iter()
            .take_while(|e| e.index <= snapshot.index)
            .count();
        entries.drain(..covered);
        let mut expected = snapshot.index + 1;
        for entry in &entries {
            if entry.index != expected {
                return Err(format!(
                    "log entry index {} found where index {} was expected (the log must follow the snapshot at {} without gaps)",
                    entry.index, expected, snapshot.index
                ));
            }
            expected += 1;
        }
        let last = expected - 1;
        let config_indexes = entries
            .iter()
            .filter(|e| matches!(e.payload, EntryPayload::Config(_)))
            .map(|e| e.index)
            .collect();
        Ok(RaftLog {
            config_indexes,
            entries: entries.into(),
            boundary_index: snapshot.index,
            boundary_term: snapshot.term,
            boundary_config: snapshot.config.clone(),
            snapshot,
            persist_from: last + 1,
            durable_index: last,
        })
    }

    /// The first index held in memory.
    pub fn first_index(&self) -> Index {
        self.boundary_index + 1
    }

    /// The last index (the boundary when no entries are held).
    pub fn last_index(&self) -> Index {
        self.boundary_index + self.entries.len() as u64
    }

    /// The term of the last entry.
    pub fn last_term(&self) -> Term {
        self.entries.back().map_or(self.boundary_term, |e| e.term)
    }

    /// The latest snapshot.
    pub fn snapshot(&self) -> &SnapshotMeta {
        &self.snapshot
    }

    /// The index below which terms are unknown.
    pub fn boundary_index(&self) -> Index {
        self.boundary_index
    }

    /// Every entry up to this index is durable.
    pub fn durable_index(&self) -> Index {
        self.durable_index
    }

    /// The term at `index`, if known.
    pub fn term_at(&self, index: Index) -> Option<Term> {
        if index == self.boundary_index {
            return Some(self.boundary_term);
        }
        if index == self.snapshot.index {
            return Some(self.snapshot.term);
        }
        if index < self.boundary_index || index > self.last_index() {
            return None;
        }
        self.entry(index).map(|e| e.term)
    }

    /// The entry at `index`, if held.
    pub fn entry(&self, index: Index) -> Option<&Entry> {
        if index <= self.boundary_index {
            return None;
        }
        let offset = usize::try_from(index - self.boundary_index - 1).ok()?;
        self.entries.get(offset)
    }

    /// Entries `[from, to]` (inclusive, clamped to what is held), at most
    /// `max_bytes` of them but always at least one if any is in range.
    pub fn slice(&self, from: Index, to: Index, max_bytes: u64) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut bytes = 0u64;
        let mut index = from.max(self.first_index());
        let to = to.min(self.last_index());
        while index <= to {
            let Some(entry) = self.entry(index) else {
                break;
            };
            bytes += entry.size_bytes();
            if !out.is_empty() && bytes > max_bytes {
                break;
            }
            out.push(entry.clone());
            index += 1;
        }
        out
    }

    /// Whether a candidate's log (`last_term`, `last_index`) is at least as
    /// up to date as this one (Raft §5.4.1).
    pub fn is_up_to_date(&self, last_index: Index, last_term: Term) -> bool {
        last_term > self.last_term()
            || (last_term == self.last_term() && last_index >= self.last_index())
    }

    /// Appends one entry the leader created (index must be `last_index + 1`).
    pub fn append_new(&mut self, entry: Entry) {
        assert_eq!(
            entry.index,
            self.last_index() + 1,
            "leader appends must be consecutive"
        );
        assert!(
            entry.term >= self.last_term(),
            "leader appends never go back in term"
        );
        self.push(entry);
    }

    /// Applies a leader's append: checks (`prev_index`, `prev_term`), drops
    /// entries already present, truncates at the first conflict and appends the
    /// rest. Returns the index of the last entry the append covers (the match
    /// index). Entries at or below `committed` are never truncated; the caller
    /// skips them first.
    pub fn try_append(
        &mut self,
        prev_index: Index,
        prev_term: Term,
        entries: &[Entry],
        committed: Index,
    ) -> Result<Index, AppendError> {
        let mismatch = |log: &Self| {
            Err(AppendError::Mismatch(
                log.mismatch_hint(prev_index, prev_term),
            ))
        };
        match self.term_at(prev_index) {
            Some(term) if term == prev_term => {}
            Some(_) | None => return mismatch(self),
        }
        // The caller bounds indexes far below u64::MAX (crate::INDEX_MAX).
        for (expected, (position, entry)) in (prev_index + 1..).zip(entries.iter().enumerate()) {
            if entry.index != expected {
                // Malformed message from a peer: treat as a mismatch at prev.
                return mismatch(self);
            }
            match self.term_at(entry.index) {
                Some(term) if term == entry.term => {
                    // Same index and term: by log matching the same entry.
                    // Where both are at hand, check it: two different
                    // entries under one (index, term) mean two leaders in
                    // one term, and taking ours for the leader's would
                    // diverge silently.
                    if self
                        .entry(entry.index)
                        .is_some_and(|held| held.payload != entry.payload)
                    {
                        return Err(AppendError::Conflict {
                            index: entry.index,
                            term: entry.term,
                        });
                    }
                    continue;
                }
                Some(_) => {
                    if entry.index <= committed {
                        // A committed entry can never be replaced.
                        return Err(AppendError::Conflict {
                            index: entry.index,
                            term: entry.term,
                        });
                    }
                    // Conflict: truncate from here and append the rest.
                    self.truncate_from(entry.index);
                    entries[position..]
                        .iter()
                        .cloned()
                        .for_each(|e| self.push(e));
                    return Ok(prev_index + entries.len() as u64);
                }
                None => {
                    if entry.index <= self.boundary_index {
                        continue; // compacted: committed, so it matches
                    }
                    entries[position..]
                        .iter()
                        .cloned()
                        .for_each(|e| self.push(e));
                    return Ok(prev_index + entries.len() as u64);
                }
            }
        }
        Ok(prev_index + entries.len() as u64)
    }

    /// The hint a follower sends when it rejects an append at `index` with
    /// `term`: the largest index at or below `min(index, last)` whose term is
    /// at most `term`, so the leader can skip whole terms at once.
    pub fn mismatch_hint(&self, index: Index, term: Term) -> AppendMismatch {
        let mut hint_index = index.min(self.last_index());
        loop {
            match self.term_at(hint_index) {
                Some(t) if t <= term => {
                    return AppendMismatch {
                        hint_index,
                        hint_term: t,
                    }
                }
                Some(_) => {
                    if hint_index == 0 {
                        return AppendMismatch {
                            hint_index: 0,
                            hint_term: 0,
                        };
                    }
                    hint_index -= 1;
                }
                None => {
                    // Below the boundary: the follower cannot tell the term.
                    return AppendMismatch {
                        hint_index: self.boundary_index.min(hint_index),
                        hint_term: 0,
                    };
                }
            }
        }
    }

    /// On the leader: the largest index at or below `index` whose term is at
    /// most `term`, or `None` if that search reaches the compacted part.
    pub fn find_by_term(&self, index: Index, term: Term) -> Option<Index> {
        let mut candidate = index.min(self.last_index());
        loop {
            match self.term_at(candidate) {
                Some(t) if t <= term => return Some(candidate),
                Some(_) if candidate > 0 => candidate -= 1,
                Some(_) => return Some(0),
                None => return None,
            }
        }
    }

    fn push(&mut self, entry: Entry) {
        if matches!(entry.payload, EntryPayload::Config(_)) {
            self.config_indexes.push_back(entry.index);
        }
        self.entries.push_back(entry);
    }

    fn truncate_from(&mut self, index: Index) {
        while self.config_indexes.back().is_some_and(|&i| i >= index) {
            self.config_indexes.pop_back();
        }
        assert!(
            index > self.boundary_index,
            "cannot truncate compacted entries"
        );
        let keep = usize::try_from(index - self.boundary_index - 1).unwrap_or(usize::MAX);
        self.entries.truncate(keep);
        self.persist_from = self.persist_from.min(index);
        self.durable_index = self.durable_index.min(index - 1);
    }

    /// Entries not yet handed to storage; marks them handed. Returns them
    /// and the (index, term) of the last one.
    pub fn take_unpersisted(&mut self) -> Vec<Entry> {
        let from = self.persist_from.max(self.first_index());
        let last = self.last_index();
        self.persist_from = last + 1;
        if from > last {
            return Vec::new();
        }
        self.slice(from, last, u64::MAX)
    }

    /// Whether entries are waiting to be handed to storage.
    pub fn has_unpersisted(&self) -> bool {
        self.persist_from <= self.last_index()
    }

    /// A persist request that wrote up to (`index`, `term`) is durable.
    pub fn mark_durable(&mut self, index: Index, term: Term) {
        if index > self.durable_index && self.term_at(index) == Some(term) {
            self.durable_index = index;
        }
    }

    /// The configuration in force at `index` (from the last config entry at or
    /// before it, or the boundary's configuration).
    pub fn config_at(&self, index: Index) -> Configuration {
        let found = self.config_indexes.iter().rev().find(|&&i| i <= index);
        if let Some(Entry {
            payload: EntryPayload::Config(config),
            ..
        }) = found.and_then(|&i| self.entry(i))
        {
            return config.clone();
        }
        self.boundary_config.clone()
    }

    /// The index of the last config entry in the log after `after`, if any.
    pub fn last_config_index_after(&self, after: Index) -> Option<Index> {
        self.config_indexes.back().copied().filter(|&i| i > after)
    }

    /// Records a snapshot the state machine built at `index` (which must be in
    /// the log or at the boundary) and compacts through `compact_through`.
    /// Returns the new boundary if it moved.
    pub fn snapshot_built(&mut self, index: Index, compact_through: Index) -> Option<Index> {
        let term = self.term_at(index)?;
        if index <= self.snapshot.index {
            return None;
        }
        self.snapshot = SnapshotMeta {
            index,
            term,
            config: self.config_at(index),
        };
        let through = compact_through.min(index);
        if through <= self.boundary_index {
            return None;
        }
        let through_term = self.term_at(through)?;
        let config = self.config_at(through);
        let drop = usize::try_from(through - self.boundary_index).unwrap_or(usize::MAX);
        self.entries.drain(..drop.min(self.entries.len()));
        while self.config_indexes.front().is_some_and(|&i| i <= through) {
            self.config_indexes.pop_front();
        }
        self.boundary_index = through;
        self.boundary_term = through_term;
        self.boundary_config = config;
        Some(through)
    }

    /// Replaces the whole log with an installed snapshot.
    pub fn reset_to_snapshot(&mut self, meta: SnapshotMeta) {
        self.entries.clear();
        self.config_indexes.clear();
        self.boundary_index = meta.index;
        self.boundary_term = meta.term;
        self.boundary_config = meta.config.clone();
        self.persist_from = meta.index + 1;
        self.durable_index = meta.index;
        self.snapshot = meta;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entries_with_terms(terms: &[Term]) -> Vec<Entry> {
        terms
            .iter()
            .enumerate()
            .map(|(i, &term)| Entry {
                term,
                index: i as u64 + 1,
                payload: EntryPayload::Noop,
            })
            .collect()
    }

    fn log_with_terms(terms: &[Term]) -> RaftLog {
        RaftLog::restore(SnapshotMeta::default(), entries_with_terms(terms)).unwrap()
    }

    #[test]
    fn restore_rejects_gaps() {
        let mut entries = entries_with_terms(&[1, 1, 1]);
        entries.remove(1);
        assert!(RaftLog::restore(SnapshotMeta::default(), entries).is_err());
    }

    #[test]
    fn append_truncates_at_conflict_only() {
        let mut log = log_with_terms(&[1, 1, 2, 2]);
        let new = vec![
            Entry {
                term: 1,
                index: 2,
                payload: EntryPayload::Noop,
            },
            Entry {
                term: 3,
                index: 3,
                payload: EntryPayload::Noop,
            },
        ];
        assert_eq!(log.try_append(1, 1, &new, 0), Ok(3));
        assert_eq!(log.last_index(), 3);
        assert_eq!(log.term_at(3), Some(3));
        // A duplicate (shorter) append does not truncate the tail.
        assert_eq!(log.try_append(1, 1, &new[..1], 0), Ok(2));
        assert_eq!(log.last_index(), 3);
    }

    #[test]
    fn hint_on_empty_log_is_zero() {
        let log = log_with_terms(&[]);
        assert_eq!(
            log.mismatch_hint(5, 3),
            AppendMismatch {
                hint_index: 0,
                hint_term: 0
            }
        );
    }

    #[test]
    fn compaction_keeps_terms_and_config() {
        let mut log = log_with_terms(&[1, 1, 2, 2, 3]);
        assert_eq!(log.snapshot_built(4, 3), Some(3));
        assert_eq!(log.first_index(), 4);
        assert_eq!(log.term_at(3), Some(2));
        assert_eq!(log.term_at(2), None);
        assert_eq!(log.snapshot().index, 4);
        assert_eq!(log.snapshot().term, 2);
        let hint = log.mismatch_hint(2, 1);
        assert_eq!(hint.hint_term, 0);
    }

    proptest! {
        /// Appending a leader's suffix to any follower log leaves the
        /// follower with exactly the leader's log up to the append's end,
        /// and the hints always move strictly backwards, so the leader's
        /// backtracking terminates at a point of agreement.
        #[test]
        fn backtracking_converges(
            common in proptest::collection::vec(1u64..3, 0..8),
            leader_tail in proptest::collection::vec(3u64..6, 0..8),
            follower_tail in proptest::collection::vec(1u64..3, 0..8),
        ) {
            let mut leader_terms = common.clone();
            let mut last = *common.last().unwrap_or(&1);
            for t in leader_tail { last = last.max(t); leader_terms.push(last); }
            let mut follower_terms = common.clone();
            let mut flast = *common.last().unwrap_or(&1);
            // The follower's own tail only has terms the leader's tail never
            // uses, so the two logs obey the Log Matching property.
            for t in follower_tail { flast = flast.max(t); follower_terms.push(flast); }
            let leader = log_with_terms(&leader_terms);
            let mut follower = log_with_terms(&follower_terms);
            let mut next = leader.last_index() + 1;
            let mut rounds = 0;
            loop {
                rounds += 1;
                prop_assert!(rounds < 100, "backtracking did not converge");
                let prev = next - 1;
                let prev_term = leader.term_at(prev).unwrap();
                let entries = leader.slice(next, leader.last_index(), u64::MAX);
                match follower.try_append(prev, prev_term, &entries, 0) {
                    Ok(matched) => { prop_assert_eq!(matched, leader.last_index()); break; }
                    Err(AppendError::Conflict { index, .. }) => {
                        prop_assert!(false, "no conflict between these logs, found one at {}", index);
                    }
                    Err(AppendError::Mismatch(hint)) => {
                        let candidate = if hint.hint_term == 0 { hint.hint_index } else {
                            leader.find_by_term(hint.hint_index, hint.hint_term).unwrap()
                        };
                        let new_next = (candidate + 1).min(prev);
                        prop_assert!(new_next < next);
                        next = new_next.max(1);
                    }
                }
            }
            for i in 1..=leader.last_index() {
                prop_assert_eq!(follower.term_at(i), leader.term_at(i));
            }
        }
    }
}
