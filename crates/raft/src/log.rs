//! The in-memory Raft log: the entries after the last compaction point, with
//! conflict detection, term lookup, compaction, tracking of which entries
//! have been handed to storage and which are known durable, and the memory
//! bound (settled entries' bodies beyond it are evicted to storage).
//!
//! The log keeps the entries after its *boundary* (the last compacted index
//! and its term). The boundary trails the latest snapshot by
//! `compaction_lag_entries`, so followers slightly behind still get entries.

use std::collections::VecDeque;

use crate::membership::Configuration;
use crate::types::{Entry, EntryPayload, Index, LogOutline, SnapshotMeta, Term};

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

/// Why entries loaded from storage do not fit the log (see
/// [`RaftLog::check_loaded`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadedMismatch {
    /// Where.
    pub index: Index,
    /// How.
    pub reason: &'static str,
}

/// The in-memory log of one node.
///
/// The log is every entry after its *boundary* (`first_index..=last_index`).
/// Of these, the bodies of a prefix may be *evicted*: entries that are
/// settled (durable here and handed out to be applied) beyond the memory
/// bound live only in storage. The log still knows the term of every entry
/// (from term runs: the first index of each term) and every configuration
/// entry, so term lookups, conflict checks, hints and configuration lookups
/// work on the whole log; only the bodies of `first_index..held_first_index`
/// must be loaded from storage.
///
/// Invariants (checked by [`RaftLog::assert_invariants`]):
/// * `boundary_index < held_from <= last_index + 1`; `entries` holds
///   `held_from..=last_index`, consecutive.
/// * `term_runs` covers `boundary_index + 1..=last_index`: empty iff the log
///   is, the first run starts at `boundary_index + 1`, indexes and terms
///   strictly ascending, terms not below `boundary_term`.
/// * `configs` holds exactly the configuration entries after the boundary.
/// * `held_bytes` is the size of `entries`; `settled_bytes` that of the held
///   entries at or below `settled_through`, with
///   `held_from - 1 <= settled_through <= min(durable_index, last_index)`.
#[derive(Clone, Debug)]
pub struct RaftLog {
    /// Bodies of `held_from..=last_index`, consecutive.
    entries: VecDeque<Entry>,
    /// The index of `entries[0]` (`last_index + 1` when none is held).
    held_from: Index,
    /// `(first index, term)` of each run of one term after the boundary.
    term_runs: VecDeque<(Index, Term)>,
    /// The configuration entries after the boundary, ascending, so the
    /// configuration at an index is known without the entries' bodies.
    configs: VecDeque<(Index, Configuration)>,
    /// The last index no longer part of the log (compacted or covered by a snapshot).
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
    /// The size of the held entries.
    held_bytes: u64,
    /// Held entries up to here are settled (durable and applied): they may
    /// be evicted.
    settled_through: Index,
    /// The size of the held settled entries.
    settled_bytes: u64,
}

impl RaftLog {
    /// A log restored from a snapshot and the synced entries after it. With
    /// an `outline` (the shape of the whole log), `entries` may be only a
    /// tail of the log ending at its last index: the entries before it are
    /// evicted from the start (their bodies are in storage).
    pub fn restore(
        snapshot: SnapshotMeta,
        mut entries: Vec<Entry>,
        outline: Option<LogOutline>,
    ) -> Result<Self, String> {
        // Entries the snapshot covers (kept by storage for the compaction
        // lag) are not needed to restart.
        let covered = entries
            .iter()
            .take_while(|e| e.index <= snapshot.index)
            .count();
        entries.drain(..covered);
        let outline = match outline {
            Some(outline) => outline,
            None => {
                if let Some(first) = entries.first() {
                    if first.index != snapshot.index + 1 {
                        return Err(format!(
                            "log entry index {} found where index {} was expected (the log must follow the snapshot at {} without gaps)",
                            first.index,
                            snapshot.index + 1,
                            snapshot.index
                        ));
                    }
                }
                let mut outline = LogOutline::of(&entries);
                outline.last_index = outline.last_index.max(snapshot.index);
                outline
            }
        };
        let last = outline.last_index;
        if last < snapshot.index {
            return Err(format!(
                "the log ends at {last}, before the snapshot at {}",
                snapshot.index
            ));
        }
        // Term runs clipped to start just after the snapshot.
        let mut term_runs: VecDeque<(Index, Term)> = VecDeque::new();
        if last > snapshot.index {
            let first = snapshot.index + 1;
            let starting = outline
                .term_runs
                .iter()
                .take_while(|&&(index, _)| index <= first)
                .last()
                .map(|&(_, term)| term);
            let Some(first_term) = starting else {
                return Err(format!(
                    "the log's term runs do not cover index {first}, the first after the snapshot"
                ));
            };
            term_runs.push_back((first, first_term));
            for &(index, term) in outline.term_runs.iter().filter(|(i, _)| *i > first) {
                if index > last {
                    return Err(format!(
                        "a term run starts at {index}, after the log's last index {last}"
                    ));
                }
                if term_runs.back().is_some_and(|&(_, t)| t >= term) {
                    return Err(format!(
                        "term runs out of order: term {term} at {index} does not follow a lower term"
                    ));
                }
                term_runs.push_back((index, term));
            }
            if first_term < snapshot.term {
                return Err(format!(
                    "the entry after the snapshot has term {first_term}, below the snapshot's term {}",
                    snapshot.term
                ));
            }
        }
        let configs: VecDeque<(Index, Configuration)> = outline
            .configs
            .into_iter()
            .filter(|(index, _)| *index > snapshot.index)
            .collect();
        if configs.iter().any(|(index, _)| *index > last)
            || configs
                .iter()
                .zip(configs.iter().skip(1))
                .any(|(a, b)| a.0 >= b.0)
        {
            return Err("the log's configuration entries are out of range or order".into());
        }
        let held_from = entries.first().map_or(last + 1, |e| e.index);
        let mut log = RaftLog {
            entries: VecDeque::new(),
            held_from,
            term_runs,
            configs,
            boundary_index: snapshot.index,
            boundary_term: snapshot.term,
            boundary_config: snapshot.config.clone(),
            snapshot,
            persist_from: last + 1,
            durable_index: last,
            held_bytes: 0,
            settled_through: held_from - 1,
            settled_bytes: 0,
        };
        if entries.last().is_some_and(|e| e.index != last) {
            return Err(format!(
                "the entries end at {} but the log's last index is {last}",
                entries.last().map_or(0, |e| e.index)
            ));
        }
        log.held_bytes = entries.iter().map(Entry::size_bytes).sum();
        log.entries = entries.into();
        for (expected, entry) in (held_from..).zip(&log.entries) {
            if entry.index != expected {
                return Err(format!(
                    "log entry index {} found where index {expected} was expected (the entries must be consecutive)",
                    entry.index
                ));
            }
            if let Err(mismatch) = log.fits(entry) {
                return Err(format!("log entry {}: {}", mismatch.index, mismatch.reason));
            }
        }
        log.assert_invariants();
        Ok(log)
    }

    /// The first index of the log (its boundary + 1), held in memory or not.
    pub fn first_index(&self) -> Index {
        self.boundary_index + 1
    }

    /// The first index whose body is held in memory (`last_index + 1` when
    /// none is); the bodies before it are in storage only.
    pub fn held_first_index(&self) -> Index {
        self.held_from
    }

    /// The last index (the boundary when no entries are held).
    pub fn last_index(&self) -> Index {
        // held_from >= 1 (it is above the boundary), so this cannot wrap.
        self.held_from + self.entries.len() as u64 - 1
    }

    /// The term of the last entry.
    pub fn last_term(&self) -> Term {
        self.term_runs.back().map_or(self.boundary_term, |r| r.1)
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

    /// The bytes (as [`Entry::size_bytes`] counts them) of the entries held
    /// in memory.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// The number of entries held in memory.
    pub fn held_entry_count(&self) -> u64 {
        self.entries.len() as u64
    }

    /// The bytes of the held entries that are settled (durable and applied):
    /// what `Options::log_memory_bytes_max` bounds.
    pub fn settled_bytes(&self) -> u64 {
        self.settled_bytes
    }

    /// The number of held settled entries: what
    /// `Options::log_memory_entries_max` bounds.
    pub fn settled_entry_count(&self) -> u64 {
        (self.settled_through + 1).saturating_sub(self.held_from)
    }

    /// The term at `index`, if known (anywhere in the log, at its boundary
    /// or at the snapshot).
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
        // The first run starts at boundary + 1 <= index, so one is found.
        let runs = self.term_runs.partition_point(|&(first, _)| first <= index);
        runs.checked_sub(1)
            .and_then(|run| self.term_runs.get(run))
            .map(|&(_, term)| term)
    }

    /// The entry at `index`, if its body is held in memory.
    pub fn entry(&self, index: Index) -> Option<&Entry> {
        if index < self.held_from {
            return None;
        }
        let offset = usize::try_from(index - self.held_from).ok()?;
        self.entries.get(offset)
    }

    /// Held entries `[from, to]` (inclusive, clamped to what is held in
    /// memory), at most `max_bytes` of them but always at least one if any
    /// is in range.
    pub fn slice(&self, from: Index, to: Index, max_bytes: u64) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut bytes = 0u64;
        let mut index = from.max(self.held_from);
        let to = to.min(self.last_index());
        while index <= to {
            let Some(entry) = self.entry(index) else {
                break;
            };
            bytes = bytes.saturating_add(entry.size_bytes());
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
        // A leader's entries never go back in term: anything else is
        // malformed (and would break the term runs).
        if entries.windows(2).any(|w| w[1].term < w[0].term)
            || entries.first().is_some_and(|e| e.term < prev_term)
        {
            return mismatch(self);
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
                    // The entry before it matched (prev or an earlier one of
                    // these), so its term is at most this one's.
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
        match self.find_by_term(index, term) {
            Some(hint_index) => AppendMismatch {
                hint_index,
                // Only index 0 of an empty log can be found with a higher
                // term (none is lower); it says "cannot tell".
                hint_term: self.term_at(hint_index).filter(|&t| t <= term).unwrap_or(0),
            },
            // Below the boundary: the follower cannot tell the term. The
            // search stopped at the index it could not look at.
            None => {
                let candidate = index.min(self.last_index());
                AppendMismatch {
                    hint_index: if candidate < self.boundary_index {
                        candidate
                    } else {
                        self.boundary_index.saturating_sub(1)
                    },
                    hint_term: 0,
                }
            }
        }
    }

    /// The largest index at or below `index` whose term is at most `term`,
    /// or `None` if that search reaches the compacted part. Walks the term
    /// runs, not the entries: its cost is the number of terms skipped.
    pub fn find_by_term(&self, index: Index, term: Term) -> Option<Index> {
        let candidate = index.min(self.last_index());
        if candidate < self.boundary_index {
            return None;
        }
        if candidate > self.boundary_index {
            let runs = self
                .term_runs
                .partition_point(|&(first, _)| first <= candidate);
            // Runs up to `runs` start at or before the candidate; walk back
            // to the last whose term is at most `term`.
            for (position, &(first, run_term)) in self.term_runs.iter().enumerate().take(runs).rev()
            {
                if run_term <= term {
                    let end = match self.term_runs.get(position + 1) {
                        Some(&(next, _)) => next - 1,
                        None => self.last_index(),
                    };
                    debug_assert!(first <= end);
                    return Some(end.min(candidate));
                }
            }
        }
        // Every run after the boundary has a higher term: the boundary.
        if self.boundary_term <= term {
            Some(self.boundary_index)
        } else if self.boundary_index == 0 {
            Some(0)
        } else {
            None
        }
    }

    fn push(&mut self, entry: Entry) {
        assert_eq!(
            entry.index,
            self.last_index() + 1,
            "log entries are consecutive"
        );
        assert!(entry.term >= self.last_term(), "log terms never go back");
        if self.term_runs.back().is_none_or(|&(_, t)| t != entry.term) {
            self.term_runs.push_back((entry.index, entry.term));
        }
        if let EntryPayload::Config(config) = &entry.payload {
            self.configs.push_back((entry.index, config.clone()));
        }
        self.held_bytes += entry.size_bytes();
        self.entries.push_back(entry);
    }

    fn truncate_from(&mut self, index: Index) {
        assert!(
            index > self.boundary_index,
            "cannot truncate compacted entries"
        );
        // Settled entries are applied, so committed: never truncated. Only
        // settled entries are evicted, so every truncated entry is held.
        assert!(
            index > self.settled_through,
            "cannot truncate settled entries"
        );
        while self.configs.back().is_some_and(|&(i, _)| i >= index) {
            self.configs.pop_back();
        }
        while self.term_runs.back().is_some_and(|&(i, _)| i >= index) {
            self.term_runs.pop_back();
        }
        let keep = usize::try_from(index - self.held_from).unwrap_or(usize::MAX);
        for entry in self.entries.iter().skip(keep) {
            self.held_bytes -= entry.size_bytes();
        }
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
        // Evicted entries are durable, so unpersisted ones are all held.
        assert!(from >= self.held_from, "unpersisted entries are held");
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
        self.configs
            .iter()
            .rev()
            .find(|(i, _)| *i <= index)
            .map_or_else(|| self.boundary_config.clone(), |(_, c)| c.clone())
    }

    /// The index of the last config entry in the log after `after`, if any.
    pub fn last_config_index_after(&self, after: Index) -> Option<Index> {
        self.configs.back().map(|&(i, _)| i).filter(|&i| i > after)
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
        while self.entries.front().is_some_and(|e| e.index <= through) {
            if let Some(entry) = self.entries.pop_front() {
                let size = entry.size_bytes();
                self.held_bytes -= size;
                if entry.index <= self.settled_through {
                    self.settled_bytes -= size;
                }
            }
        }
        self.held_from = self.held_from.max(through + 1);
        self.settled_through = self.settled_through.max(through);
        while self.configs.front().is_some_and(|&(i, _)| i <= through) {
            self.configs.pop_front();
        }
        // Runs wholly at or below `through` go; the one containing
        // `through + 1` now starts there.
        while self
            .term_runs
            .get(1)
            .is_some_and(|&(first, _)| first <= through + 1)
        {
            self.term_runs.pop_front();
        }
        if through >= self.last_index() {
            self.term_runs.clear();
        } else if let Some(run) = self.term_runs.front_mut() {
            run.0 = run.0.max(through + 1);
        }
        self.boundary_index = through;
        self.boundary_term = through_term;
        self.boundary_config = config;
        self.assert_invariants();
        Some(through)
    }

    /// Replaces the whole log with an installed snapshot.
    pub fn reset_to_snapshot(&mut self, meta: SnapshotMeta) {
        self.entries.clear();
        self.term_runs.clear();
        self.configs.clear();
        self.boundary_index = meta.index;
        self.boundary_term = meta.term;
        self.boundary_config = meta.config.clone();
        self.held_from = meta.index + 1;
        self.persist_from = meta.index + 1;
        self.durable_index = meta.index;
        self.held_bytes = 0;
        self.settled_through = meta.index;
        self.settled_bytes = 0;
        self.snapshot = meta;
    }

    /// Entries up to `applied` that are durable are settled; evicts the
    /// oldest settled bodies while more than `bytes_max` bytes or
    /// `entries_max` entries of them are held. Costs O(1) per entry over
    /// the log's life.
    pub fn release_settled(&mut self, applied: Index, bytes_max: u64, entries_max: u64) {
        let limit = applied.min(self.durable_index).min(self.last_index());
        while self.settled_through < limit {
            let next = self.settled_through + 1;
            let Some(size) = self.entry(next).map(Entry::size_bytes) else {
                break;
            };
            self.settled_bytes += size;
            self.settled_through = next;
        }
        while self.settled_bytes > bytes_max || self.settled_entry_count() > entries_max {
            let Some(entry) = self.entries.pop_front() else {
                break;
            };
            assert!(
                entry.index <= self.settled_through,
                "only settled entries are evicted"
            );
            let size = entry.size_bytes();
            self.held_bytes -= size;
            self.settled_bytes -= size;
            self.held_from += 1;
        }
        self.assert_invariants();
    }

    /// Whether `entry`, loaded from storage or restored, fits the log: its
    /// term is the log's term at its index and it is a configuration entry
    /// exactly where the log has one (the same one).
    fn fits(&self, entry: &Entry) -> Result<(), LoadedMismatch> {
        let index = entry.index;
        let fail = |reason| Err(LoadedMismatch { index, reason });
        if index <= self.boundary_index || index > self.last_index() {
            return fail("the index is outside the log");
        }
        if self.term_at(index) != Some(entry.term) {
            return fail("the term differs from the log's term there");
        }
        let config = self
            .configs
            .binary_search_by_key(&index, |(i, _)| *i)
            .ok()
            .and_then(|position| self.configs.get(position));
        match (&entry.payload, config) {
            (EntryPayload::Config(loaded), Some((_, known))) if loaded == known => Ok(()),
            (EntryPayload::Config(_), Some(_)) => fail("another configuration than the log's"),
            (EntryPayload::Config(_), None) => fail("a configuration entry where the log has none"),
            (EntryPayload::Noop | EntryPayload::Command(_), Some(_)) => {
                fail("the log has a configuration entry there")
            }
            (EntryPayload::Noop | EntryPayload::Command(_), None) => Ok(()),
        }
    }

    /// Checks entries loaded from storage for `from..=through`: consecutive
    /// from `from`, not beyond `through`, at least one, and each fits the
    /// log (term and configuration, see the type's docs).
    pub fn check_loaded(
        &self,
        from: Index,
        through: Index,
        entries: &[Entry],
    ) -> Result<(), LoadedMismatch> {
        if entries.is_empty() {
            return Err(LoadedMismatch {
                index: from,
                reason: "no entries were returned",
            });
        }
        for (expected, entry) in (from..).zip(entries) {
            if entry.index != expected {
                return Err(LoadedMismatch {
                    index: expected,
                    reason: "the entries are not consecutive from the index asked for",
                });
            }
            if entry.index > through {
                return Err(LoadedMismatch {
                    index: entry.index,
                    reason: "more entries than asked for",
                });
            }
            self.fits(entry)?;
        }
        Ok(())
    }

    /// Checks the invariants listed in the type's docs; the ones that cost
    /// O(entries) only with debug assertions (tests call
    /// [`RaftLog::assert_invariants_full`]).
    pub fn assert_invariants(&self) {
        assert!(
            self.held_from > self.boundary_index,
            "held entries follow the boundary"
        );
        let last = self.last_index();
        assert!(
            self.snapshot.index >= self.boundary_index,
            "the snapshot covers the boundary"
        );
        match (self.term_runs.front(), self.term_runs.back()) {
            (Some(&(first, first_term)), Some(&(back, _))) => {
                assert_eq!(
                    first,
                    self.boundary_index + 1,
                    "term runs start after the boundary"
                );
                assert!(first_term >= self.boundary_term, "terms never go back");
                assert!(back <= last, "term runs end within the log");
            }
            (None, None) => assert_eq!(last, self.boundary_index, "an empty log has no term runs"),
            (Some(_), None) | (None, Some(_)) => unreachable!("front and back agree"),
        }
        assert!(
            self.settled_through + 1 >= self.held_from,
            "evicted entries are settled"
        );
        assert!(self.settled_through <= last.max(self.boundary_index));
        assert!(self.settled_bytes <= self.held_bytes);
        if cfg!(debug_assertions) {
            self.assert_invariants_full();
        }
    }

    /// Every invariant of the type's docs, O(entries).
    pub fn assert_invariants_full(&self) {
        for (a, b) in self.term_runs.iter().zip(self.term_runs.iter().skip(1)) {
            assert!(a.0 < b.0 && a.1 < b.1, "term runs strictly ascend");
        }
        let mut held = 0u64;
        let mut settled = 0u64;
        for (expected, entry) in (self.held_from..).zip(&self.entries) {
            assert_eq!(entry.index, expected, "held entries are consecutive");
            assert_eq!(
                self.term_at(entry.index),
                Some(entry.term),
                "term runs match"
            );
            assert!(self.fits(entry).is_ok(), "configs match the entries");
            held += entry.size_bytes();
            if entry.index <= self.settled_through {
                settled += entry.size_bytes();
            }
        }
        let held_configs = self
            .entries
            .iter()
            .filter(|e| matches!(e.payload, EntryPayload::Config(_)))
            .count();
        let known_configs = self
            .configs
            .iter()
            .filter(|(i, _)| *i >= self.held_from)
            .count();
        assert_eq!(
            held_configs, known_configs,
            "every held config entry is known"
        );
        assert_eq!(held, self.held_bytes, "held bytes add up");
        assert_eq!(settled, self.settled_bytes, "settled bytes add up");
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
        RaftLog::restore(SnapshotMeta::default(), entries_with_terms(terms), None).unwrap()
    }

    #[test]
    fn restore_rejects_gaps() {
        let mut entries = entries_with_terms(&[1, 1, 1]);
        entries.remove(1);
        assert!(RaftLog::restore(SnapshotMeta::default(), entries, None).is_err());
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
            // A Raft log's terms never go back (the log refuses others).
            let mut common = common;
            common.sort_unstable();
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
