//! The simulated disk of one node. It keeps what was written apart from
//! what was synced: a [`PersistRequest`] is written at once, becomes durable
//! only when a sync that started after it completes, and is lost if the
//! node crashes first. A restart rebuilds the engine's [`RestoredState`]
//! from the synced state alone.
//!
//! A node hosts one or more Raft groups over one durable log
//! ([`NodeDisk`]): each group's part of it is a [`DiskModel`], and a sync is
//! the node's, not a group's (group commit): it covers every group's writes
//! since the last one, a crash loses every group's unsynced writes together,
//! and installing a received snapshot syncs the whole log.
//!
//! The model also checks the durable-state promises the engine makes: the
//! synced term never decreases, a vote is never changed within a term, the
//! synced commit index never goes back, and the log never gets a gap.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use ferry_raft::{
    Entry, GroupId, HardState, Index, PersistRequest, RestoredState, SnapshotMeta, Term,
};

/// The most written-but-unsynced requests the disk holds; the engine
/// waits for syncs, so more means the runtime lost track of one.
pub const PENDING_WRITES_MAX: usize = 1 << 16;

/// A broken promise about durable state, or a request the disk cannot
/// carry out. Either is a failure of the run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StorageViolation {
    /// Persist requests must carry increasing sequence numbers.
    #[error("persist seq {got} does not follow {last}")]
    SeqNotIncreasing {
        /// The last seq written.
        last: u64,
        /// The seq received.
        got: u64,
    },
    /// The entries of one request must be consecutive.
    #[error("persist seq {seq}: entries are not consecutive at index {index}")]
    EntriesNotConsecutive {
        /// The request.
        seq: u64,
        /// Where the run breaks.
        index: Index,
    },
    /// Writing would leave a hole in the log.
    #[error("persist seq {seq}: entries start at {first} but the log ends at {last}")]
    Gap {
        /// The request.
        seq: u64,
        /// Its first entry's index.
        first: Index,
        /// The log's last index.
        last: Index,
    },
    /// The durable term went down.
    #[error("durable term went back from {from} to {to}")]
    TermWentBack {
        /// Before.
        from: Term,
        /// After.
        to: Term,
    },
    /// The durable vote changed within one term.
    #[error("durable vote in term {term} changed from {from:?} to {to:?}")]
    VoteChanged {
        /// The term.
        term: Term,
        /// Before.
        from: Option<u64>,
        /// After.
        to: Option<u64>,
    },
    /// The durable commit index went down.
    #[error("durable commit went back from {from} to {to}")]
    CommitWentBack {
        /// Before.
        from: Index,
        /// After.
        to: Index,
    },
    /// Too many writes waiting for a sync.
    #[error("more than {PENDING_WRITES_MAX} writes wait for a sync")]
    TooManyPending,
    /// A sync completion for a sync that was not started.
    #[error("sync of seq {seq} completed but none was in flight")]
    UnexpectedSync {
        /// The seq.
        seq: u64,
    },
    /// A write or a sync for a group the node does not host.
    #[error("group {group} is not hosted on this node")]
    UnknownGroup {
        /// The group.
        group: GroupId,
    },
}

/// What survives a crash.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DurableState {
    /// Term, vote, commit.
    pub hard_state: HardState,
    /// The latest snapshot's metadata (index 0: none yet).
    pub snapshot: SnapshotMeta,
    /// The latest snapshot's bytes.
    pub snapshot_data: Bytes,
    /// Log entries, consecutive; those at or below the snapshot index are
    /// leftovers that compaction has not dropped yet.
    pub entries: Vec<Entry>,
    /// Every vote ever synced, by term: a later term overwrites the hard
    /// state, but the vote given in an earlier term stays given.
    pub votes: std::collections::BTreeMap<Term, u64>,
}

impl DurableState {
    /// The last index the durable state covers (log or snapshot).
    pub fn last_index(&self) -> Index {
        self.entries
            .last()
            .map_or(self.snapshot.index, |e| e.index.max(self.snapshot.index))
    }

    /// Durable entries `from..=through`, consecutive, at most about
    /// `max_bytes` of them (at least one), or `None` if `from` is not
    /// stored (compacted, or not written).
    pub fn load(&self, from: Index, through: Index, max_bytes: u64) -> Option<Vec<Entry>> {
        let start = self.entries.binary_search_by_key(&from, |e| e.index).ok()?;
        let mut bytes = 0u64;
        let mut out = Vec::new();
        for (entry, index) in self.entries[start..].iter().zip(from..=through) {
            if entry.index != index {
                break;
            }
            bytes = bytes.saturating_add(entry.size_bytes());
            if !out.is_empty() && bytes > max_bytes {
                break;
            }
            out.push(entry.clone());
        }
        Some(out)
    }

    /// The term of the durable entry at `index`, if known.
    pub fn term_at(&self, index: Index) -> Option<Term> {
        if index == self.snapshot.index {
            return Some(self.snapshot.term);
        }
        if index == 0 {
            return Some(0);
        }
        let first = self.entries.first()?.index;
        if index < first {
            return None;
        }
        self.entries.get((index - first) as usize).map(|e| e.term)
    }

    fn set_hard_state(&mut self, next: HardState) -> Result<(), StorageViolation> {
        let prev = self.hard_state;
        if next.term < prev.term {
            return Err(StorageViolation::TermWentBack {
                from: prev.term,
                to: next.term,
            });
        }
        if next.term == prev.term && prev.vote.is_some() && next.vote != prev.vote {
            return Err(StorageViolation::VoteChanged {
                term: prev.term,
                from: prev.vote,
                to: next.vote,
            });
        }
        if next.commit < prev.commit {
            return Err(StorageViolation::CommitWentBack {
                from: prev.commit,
                to: next.commit,
            });
        }
        if let Some(vote) = next.vote {
            self.votes.insert(next.term, vote);
        }
        self.hard_state = next;
        Ok(())
    }

    fn write_entries(&mut self, seq: u64, entries: &[Entry]) -> Result<(), StorageViolation> {
        for pair in entries.windows(2) {
            if pair[1].index != pair[0].index + 1 {
                return Err(StorageViolation::EntriesNotConsecutive {
                    seq,
                    index: pair[1].index,
                });
            }
        }
        let Some(request_first) = entries.first().map(|e| e.index) else {
            return Ok(());
        };
        // Entries the snapshot already covers are not needed.
        let kept: Vec<&Entry> = entries
            .iter()
            .filter(|e| e.index > self.snapshot.index)
            .collect();
        if let Some(first) = kept.first().map(|e| e.index) {
            let last = self.last_index();
            if first > last + 1 {
                return Err(StorageViolation::Gap { seq, first, last });
            }
        }
        // Replace everything from the request's first index on, also when
        // the snapshot covers every entry it carries: the entries after
        // them were cut from the engine's log (a conflicting append), and
        // must not come back after a restart.
        self.entries.retain(|e| e.index < request_first);
        let Some(first) = kept.first().map(|e| e.index) else {
            return Ok(());
        };
        // Entries the snapshot covers may end before it (the state machine
        // can snapshot entries applied before they were synced here); they
        // are no longer needed, and keeping them would leave a hole.
        if self.entries.last().is_some_and(|e| e.index + 1 != first) {
            self.entries.clear();
        }
        self.entries.extend(kept.into_iter().cloned());
        Ok(())
    }

    /// Applies one written request as a sync would (hard state, then
    /// entries), checking the durable-state promises.
    pub fn apply_request(&mut self, request: &PersistRequest) -> Result<(), StorageViolation> {
        if let Some(hard_state) = request.hard_state {
            self.set_hard_state(hard_state)?;
        }
        self.write_entries(request.seq, &request.entries)
    }

    /// Makes `meta` the durable snapshot. The log beside it stays as
    /// written: the storage decides at recovery which of it survives (see
    /// [`DurableState::recovered`]).
    pub fn adopt_snapshot(&mut self, meta: SnapshotMeta, data: Bytes) {
        self.snapshot = meta;
        self.snapshot_data = data;
    }

    /// The state as the storage's recovery gives it back. A local snapshot
    /// is durable on its own, before the log writes that led to it are, so
    /// the synced log may disagree with it: the log's entries stay only if
    /// the log does not hold the snapshot's own index with another term (a
    /// log that disagrees there was overwritten after what was synced, and
    /// none of it can follow the snapshot). The term is at least that of
    /// every entry held (the snapshot's included), with no vote in a term
    /// raised that way.
    pub fn recovered(&self) -> DurableState {
        let mut state = self.clone();
        let (index, term) = (state.snapshot.index, state.snapshot.term);
        if index > 0
            && state
                .entries
                .iter()
                .any(|e| e.index == index && e.term != term)
        {
            state.entries.clear();
        }
        state.hard_state = state.restarted_hard_state();
        state
    }

    fn restarted_hard_state(&self) -> HardState {
        let mut hard_state = self.hard_state;
        let held_term = self
            .entries
            .iter()
            .filter(|e| e.index > self.snapshot.index)
            .map(|e| e.term)
            .max()
            .unwrap_or(0)
            .max(self.snapshot.term);
        if held_term > hard_state.term {
            hard_state.term = held_term;
            hard_state.vote = None;
        }
        hard_state
    }

    /// The state a restarting engine is handed (as recovered).
    pub fn restored_state(&self) -> RestoredState {
        let recovered = self.recovered();
        RestoredState {
            hard_state: recovered.hard_state,
            snapshot: recovered.snapshot.clone(),
            entries: recovered
                .entries
                .iter()
                .filter(|e| e.index > self.snapshot.index)
                .cloned()
                .collect(),
            // The register machine restarts from the snapshot, so every
            // entry after it is applied again: the whole log is given.
            outline: None,
            applied: self.snapshot.index,
        }
    }
}

/// A snapshot being received chunk by chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IncomingSnapshot {
    /// Which snapshot.
    pub meta: SnapshotMeta,
    /// The bytes received so far, in order.
    pub data: BytesMut,
}

/// The simulated disk of one node.
#[derive(Clone, Debug, Default)]
pub struct DiskModel {
    synced: DurableState,
    pending: VecDeque<PersistRequest>,
    last_written_seq: u64,
    durable_seq: u64,
    reported_seq: u64,
    sync_in_flight: Option<u64>,
    incoming: Option<IncomingSnapshot>,
}

impl DiskModel {
    /// A disk holding `initial` as its synced state.
    pub fn new(initial: DurableState) -> Self {
        DiskModel {
            synced: initial,
            ..DiskModel::default()
        }
    }

    /// What survives a crash now.
    pub fn synced(&self) -> &DurableState {
        &self.synced
    }

    /// Entries `from..=through` as a read of the disk gives them now (what
    /// was written, synced or not, as the real log serves reads from what
    /// it wrote), bounded by `max_bytes` as [`DurableState::load`] is.
    /// `None` if the log no longer holds `from`.
    pub fn load_written(&self, from: Index, through: Index, max_bytes: u64) -> Option<Vec<Entry>> {
        if self.pending.is_empty() {
            return self.synced.load(from, through, max_bytes);
        }
        let mut written = self.synced.clone();
        for request in &self.pending {
            written.apply_request(request).ok()?;
        }
        written.load(from, through, max_bytes)
    }

    /// Writes a request (not yet durable).
    pub fn write(&mut self, request: PersistRequest) -> Result<(), StorageViolation> {
        if request.seq <= self.last_written_seq {
            return Err(StorageViolation::SeqNotIncreasing {
                last: self.last_written_seq,
                got: request.seq,
            });
        }
        if self.pending.len() >= PENDING_WRITES_MAX {
            return Err(StorageViolation::TooManyPending);
        }
        self.last_written_seq = request.seq;
        self.pending.push_back(request);
        Ok(())
    }

    /// Starts a sync of everything written so far, if there is something
    /// to sync and no sync is running. Returns the seq it will make durable.
    pub fn start_sync(&mut self) -> Option<u64> {
        if self.sync_in_flight.is_some() {
            return None;
        }
        let seq = self.pending.back()?.seq;
        self.sync_in_flight = Some(seq);
        Some(seq)
    }

    /// Completes the running sync: every request up to `seq` becomes durable.
    pub fn complete_sync(&mut self, seq: u64) -> Result<(), StorageViolation> {
        if self.sync_in_flight != Some(seq) {
            return Err(StorageViolation::UnexpectedSync { seq });
        }
        self.sync_in_flight = None;
        self.make_durable_through(seq)
    }

    /// Makes every write so far durable, as a sync of the whole log does
    /// (a sync that is running stays in flight, as in
    /// [`DiskModel::install_snapshot`]).
    pub fn make_written_durable(&mut self) -> Result<(), StorageViolation> {
        self.make_durable_through(self.last_written_seq)
    }

    fn make_durable_through(&mut self, seq: u64) -> Result<(), StorageViolation> {
        while self.pending.front().is_some_and(|r| r.seq <= seq) {
            let Some(request) = self.pending.pop_front() else {
                break;
            };
            self.synced.apply_request(&request)?;
            self.durable_seq = self.durable_seq.max(request.seq);
        }
        Ok(())
    }

    /// The highest durable seq, if it has not been reported to the engine
    /// yet; marks it reported.
    pub fn take_persisted_report(&mut self) -> Option<u64> {
        if self.durable_seq > self.reported_seq {
            self.reported_seq = self.durable_seq;
            Some(self.durable_seq)
        } else {
            None
        }
    }

    /// The writes not yet durable, oldest first.
    pub fn pending_requests(&self) -> Vec<PersistRequest> {
        self.pending.iter().cloned().collect()
    }

    /// Whether a sync is running.
    pub fn sync_in_flight(&self) -> bool {
        self.sync_in_flight.is_some()
    }

    /// Whether writes are waiting for a sync.
    pub fn has_unsynced(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The power goes out: everything not synced is lost.
    pub fn crash(&mut self) {
        self.pending.clear();
        self.sync_in_flight = None;
        self.incoming = None;
        // A new incarnation of the engine starts its seqs afresh.
        self.last_written_seq = 0;
        self.durable_seq = 0;
        self.reported_seq = 0;
    }

    /// Drops log entries up to `through` that the durable snapshot covers.
    pub fn compact(&mut self, through: Index) {
        // The entry at the snapshot's index itself stays: it decides
        // whether the log after it survives a restart (see `recovered`).
        let through = through.min(self.synced.snapshot.index);
        self.synced.entries.retain(|e| e.index >= through);
    }

    /// Stores a snapshot the local state machine took (written and synced
    /// atomically). Ignored if not newer than the one stored.
    pub fn store_local_snapshot(&mut self, meta: SnapshotMeta, data: Bytes) -> bool {
        if meta.index <= self.synced.snapshot.index {
            return false;
        }
        self.synced.adopt_snapshot(meta, data);
        true
    }

    /// Saves one chunk of a snapshot from the leader. Returns false when the
    /// chunk does not continue the snapshot being received.
    pub fn save_chunk(&mut self, meta: &SnapshotMeta, offset: u64, data: &[u8]) -> bool {
        if offset == 0 {
            self.incoming = Some(IncomingSnapshot {
                meta: meta.clone(),
                data: BytesMut::new(),
            });
        }
        match &mut self.incoming {
            Some(incoming) if incoming.meta == *meta && incoming.data.len() as u64 == offset => {
                incoming.data.extend_from_slice(data);
                true
            }
            _ => false,
        }
    }

    /// Takes the completely received snapshot, if any.
    pub fn take_incoming(&mut self) -> Option<IncomingSnapshot> {
        self.incoming.take()
    }

    /// Installs a received snapshot: every write so far becomes durable
    /// (the install syncs), then the log is reset to the snapshot's index.
    pub fn install_snapshot(
        &mut self,
        meta: SnapshotMeta,
        data: Bytes,
    ) -> Result<(), StorageViolation> {
        // A sync still running stays in flight: when it completes it finds
        // its writes durable already and reports nothing new.
        self.make_durable_through(self.last_written_seq)?;
        self.synced.entries.clear();
        self.synced.snapshot = meta;
        self.synced.snapshot_data = data;
        Ok(())
    }

    /// Reads a chunk of the stored snapshot at `snapshot_index`: the bytes
    /// and whether they are the last, or `None` when that snapshot is gone.
    pub fn load_chunk(
        &self,
        snapshot_index: Index,
        offset: u64,
        max_bytes: u64,
    ) -> Option<(Bytes, bool)> {
        if self.synced.snapshot.index != snapshot_index || snapshot_index == 0 {
            return None;
        }
        let data = &self.synced.snapshot_data;
        let len = data.len() as u64;
        if offset > len {
            return None;
        }
        let end = offset.saturating_add(max_bytes.max(1)).min(len);
        Some((data.slice(offset as usize..end as usize), end == len))
    }
}

/// The storage of one node: one durable log shared by every group the node
/// hosts, with group commit, and a snapshot store per group. Each group's
/// part is a [`DiskModel`] (its own persist seqs, synced state, snapshot);
/// syncs belong to the node: one runs at a time and covers every group's
/// writes since the previous one, which is what the real log does
/// (`ferry_storage::Wal::prepare_sync`).
#[derive(Clone, Debug, Default)]
pub struct NodeDisk {
    /// Each group's part, sorted by group id (a vector: it is looked up on
    /// every write and every message sent, and nodes host few groups).
    groups: Vec<(GroupId, DiskModel)>,
    /// Whether a sync runs (each covered group's model knows its own seq).
    sync_in_flight: bool,
}

/// A broken promise about one group's durable state.
pub type GroupViolation = (GroupId, StorageViolation);

/// What one sync of a node's log covers: each group's writes through its
/// seq, in group order.
pub type SyncCoverage = Vec<(GroupId, u64)>;

impl NodeDisk {
    /// A node's storage holding each group's `initial` state as synced.
    pub fn new(initial: impl IntoIterator<Item = (GroupId, DurableState)>) -> Self {
        let mut groups: Vec<(GroupId, DiskModel)> = initial
            .into_iter()
            .map(|(group, state)| (group, DiskModel::new(state)))
            .collect();
        groups.sort_by_key(|(group, _)| *group);
        groups.dedup_by_key(|(group, _)| *group);
        NodeDisk {
            groups,
            sync_in_flight: false,
        }
    }

    /// The groups the node hosts, in order.
    pub fn group_ids(&self) -> Vec<GroupId> {
        self.groups.iter().map(|(group, _)| *group).collect()
    }

    fn position(&self, group: GroupId) -> Option<usize> {
        self.groups.binary_search_by_key(&group, |(g, _)| *g).ok()
    }

    /// One group's part of the storage.
    pub fn group(&self, group: GroupId) -> Option<&DiskModel> {
        let i = self.position(group)?;
        self.groups.get(i).map(|(_, disk)| disk)
    }

    /// One group's part of the storage, to change it. Syncs go through the
    /// node ([`NodeDisk::start_sync`]), not through the group's model.
    pub fn group_mut(&mut self, group: GroupId) -> Option<&mut DiskModel> {
        let i = self.position(group)?;
        self.groups.get_mut(i).map(|(_, disk)| disk)
    }

    /// Writes a request of `group` to the shared log (not yet durable).
    pub fn write(
        &mut self,
        group: GroupId,
        request: PersistRequest,
    ) -> Result<(), StorageViolation> {
        match self.group_mut(group) {
            Some(disk) => disk.write(request),
            None => Err(StorageViolation::UnknownGroup { group }),
        }
    }

    /// Starts a sync of everything written so far in every group, if there
    /// is something to sync and no sync is running. Returns the seq each
    /// covered group's writes will be durable through.
    pub fn start_sync(&mut self) -> Option<SyncCoverage> {
        if self.sync_in_flight {
            return None;
        }
        let covered: SyncCoverage = self
            .groups
            .iter_mut()
            .filter_map(|(group, disk)| disk.start_sync().map(|seq| (*group, seq)))
            .collect();
        if covered.is_empty() {
            return None;
        }
        self.sync_in_flight = true;
        Some(covered)
    }

    /// Completes the running sync, which covered `covered`: every covered
    /// group's writes through its seq become durable, all of them or (on a
    /// broken promise) the run fails.
    pub fn complete_sync(&mut self, covered: &[(GroupId, u64)]) -> Result<(), GroupViolation> {
        let unexpected =
            |(group, seq): (GroupId, u64)| (group, StorageViolation::UnexpectedSync { seq });
        if !self.sync_in_flight {
            return Err(unexpected(covered.first().copied().unwrap_or((0, 0))));
        }
        self.sync_in_flight = false;
        for &(group, seq) in covered {
            let disk = self
                .group_mut(group)
                .ok_or((group, StorageViolation::UnknownGroup { group }))?;
            disk.complete_sync(seq).map_err(|v| (group, v))?;
        }
        // A group the sync covered but `covered` left out would never sync
        // again: that is a bug of the caller, not a disk's doing.
        match self.groups.iter().find(|(_, disk)| disk.sync_in_flight()) {
            Some((group, _)) => Err(unexpected((*group, 0))),
            None => Ok(()),
        }
    }

    /// Each group's highest durable seq not reported to its engine yet, in
    /// group order; marks them reported.
    pub fn take_persisted_reports(&mut self) -> Vec<(GroupId, u64)> {
        self.groups
            .iter_mut()
            .filter_map(|(group, disk)| disk.take_persisted_report().map(|seq| (*group, seq)))
            .collect()
    }

    /// Whether a sync is running.
    pub fn sync_in_flight(&self) -> bool {
        self.sync_in_flight
    }

    /// Whether any group has writes waiting for a sync.
    pub fn has_unsynced(&self) -> bool {
        self.groups.iter().any(|(_, disk)| disk.has_unsynced())
    }

    /// The power goes out: every group's unsynced writes are lost together.
    pub fn crash(&mut self) {
        self.sync_in_flight = false;
        for (_, disk) in self.groups.iter_mut() {
            disk.crash();
        }
    }

    /// Installs a snapshot `group` received. The install syncs the whole
    /// log, so every group's writes so far become durable, the installing
    /// group's first (a running sync stays in flight and, when it
    /// completes, finds its writes durable already).
    pub fn install_snapshot(
        &mut self,
        group: GroupId,
        meta: SnapshotMeta,
        data: Bytes,
    ) -> Result<(), GroupViolation> {
        let disk = self
            .group_mut(group)
            .ok_or((group, StorageViolation::UnknownGroup { group }))?;
        disk.install_snapshot(meta, data).map_err(|v| (group, v))?;
        for (other, disk) in self.groups.iter_mut() {
            if *other != group {
                disk.make_written_durable().map_err(|v| (*other, v))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_raft::{Configuration, EntryPayload};

    fn entry(index: Index, term: Term) -> Entry {
        Entry {
            index,
            term,
            payload: EntryPayload::Noop,
        }
    }

    fn request(seq: u64, hard_state: Option<HardState>, entries: Vec<Entry>) -> PersistRequest {
        PersistRequest {
            seq,
            hard_state,
            entries,
        }
    }

    #[test]
    fn unsynced_writes_are_lost_on_crash() {
        let mut disk = DiskModel::default();
        disk.write(request(1, None, vec![entry(1, 1), entry(2, 1)]))
            .unwrap();
        let seq = disk.start_sync().unwrap();
        assert_eq!(seq, 1);
        disk.write(request(2, None, vec![entry(3, 1)])).unwrap();
        assert_eq!(disk.start_sync(), None, "one sync at a time");
        disk.complete_sync(1).unwrap();
        assert_eq!(disk.take_persisted_report(), Some(1));
        assert_eq!(disk.take_persisted_report(), None);
        assert_eq!(disk.synced().last_index(), 2);
        disk.crash();
        let restored = disk.synced().restored_state();
        assert_eq!(restored.entries, vec![entry(1, 1), entry(2, 1)]);
        assert!(!disk.has_unsynced());
    }

    #[test]
    fn overwrite_truncates_the_tail() {
        let mut disk = DiskModel::default();
        disk.write(request(
            1,
            None,
            vec![entry(1, 1), entry(2, 1), entry(3, 1)],
        ))
        .unwrap();
        disk.write(request(2, None, vec![entry(2, 2)])).unwrap();
        disk.start_sync();
        disk.complete_sync(2).unwrap();
        assert_eq!(disk.synced().entries, vec![entry(1, 1), entry(2, 2)]);
        assert_eq!(disk.synced().term_at(2), Some(2));
        assert_eq!(disk.synced().term_at(3), None);
    }

    #[test]
    fn durable_promises_are_checked() {
        let mut disk = DiskModel::default();
        let hs = |term, vote, commit| HardState { term, vote, commit };
        disk.write(request(1, Some(hs(2, Some(1), 0)), vec![]))
            .unwrap();
        assert!(disk.write(request(1, None, vec![])).is_err());
        disk.write(request(2, Some(hs(2, Some(3), 0)), vec![]))
            .unwrap();
        disk.start_sync();
        assert_eq!(
            disk.complete_sync(2),
            Err(StorageViolation::VoteChanged {
                term: 2,
                from: Some(1),
                to: Some(3)
            })
        );
        let mut disk = DiskModel::default();
        disk.write(request(1, None, vec![entry(1, 1)])).unwrap();
        disk.write(request(2, None, vec![entry(3, 1)])).unwrap();
        disk.start_sync();
        assert!(matches!(
            disk.complete_sync(2),
            Err(StorageViolation::Gap { .. })
        ));
        assert!(disk.complete_sync(9).is_err());
    }

    #[test]
    fn snapshot_install_resets_the_log_and_chunks_load() {
        let mut disk = DiskModel::default();
        disk.write(request(1, None, vec![entry(1, 1), entry(2, 1)]))
            .unwrap();
        let meta = SnapshotMeta {
            index: 5,
            term: 2,
            config: Configuration::with_voters([1, 2]),
        };
        assert!(disk.save_chunk(&meta, 0, b"abc"));
        assert!(!disk.save_chunk(&meta, 9, b"x"), "out of order chunk");
        assert!(disk.save_chunk(&meta, 0, b"abc"), "restart from 0");
        assert!(disk.save_chunk(&meta, 3, b"def"));
        let incoming = disk.take_incoming().unwrap();
        assert_eq!(&incoming.data[..], b"abcdef");
        disk.install_snapshot(meta.clone(), incoming.data.freeze())
            .unwrap();
        assert_eq!(
            disk.take_persisted_report(),
            Some(1),
            "install syncs earlier writes"
        );
        assert!(disk.synced().entries.is_empty());
        assert_eq!(disk.synced().last_index(), 5);
        let restored = disk.synced().restored_state();
        assert_eq!(restored.snapshot, meta);
        assert_eq!(restored.applied, 5);
        assert_eq!(
            disk.load_chunk(5, 0, 4),
            Some((Bytes::from_static(b"abcd"), false))
        );
        assert_eq!(
            disk.load_chunk(5, 4, 4),
            Some((Bytes::from_static(b"ef"), true))
        );
        assert_eq!(disk.load_chunk(4, 0, 4), None);
        // Entries the snapshot covers are skipped; the next ones append.
        disk.write(request(2, None, vec![entry(5, 2), entry(6, 2)]))
            .unwrap();
        disk.start_sync();
        disk.complete_sync(2).unwrap();
        assert_eq!(disk.synced().entries, vec![entry(6, 2)]);
    }

    #[test]
    fn snapshot_beyond_the_synced_log_leaves_no_hole() {
        let mut disk = DiskModel::default();
        disk.write(request(1, None, (1..=4).map(|i| entry(i, 1)).collect()))
            .unwrap();
        disk.start_sync();
        disk.complete_sync(1).unwrap();
        // Entries 5..=8 are written, the state machine snapshots at 6
        // before they are synced.
        disk.write(request(2, None, (5..=8).map(|i| entry(i, 1)).collect()))
            .unwrap();
        let meta = SnapshotMeta {
            index: 6,
            term: 1,
            config: Configuration::default(),
        };
        assert!(disk.store_local_snapshot(meta, Bytes::from_static(b"s")));
        disk.start_sync();
        disk.complete_sync(2).unwrap();
        assert_eq!(disk.synced().entries, vec![entry(7, 1), entry(8, 1)]);
        // Overwriting the tail keeps the log consecutive.
        disk.write(request(3, None, vec![entry(8, 2), entry(9, 2)]))
            .unwrap();
        disk.start_sync();
        disk.complete_sync(3).unwrap();
        assert_eq!(
            disk.synced().entries,
            vec![entry(7, 1), entry(8, 2), entry(9, 2)]
        );
        assert_eq!(disk.synced().restored_state().entries.len(), 3);
    }

    /// Seed 1019: a follower holding its own uncommitted entry 5 takes the
    /// leader's conflicting entries 3..=4, and snapshots at 4 (applied,
    /// committed by the leader) before the overwrite is synced. The
    /// overwrite still cuts entry 5, as the real storage does; the model
    /// kept it and then reported the real storage as having lost it.
    #[test]
    fn an_overwrite_the_snapshot_covers_still_cuts_the_tail() {
        let mut disk = DiskModel::default();
        disk.write(request(1, None, (1..=5).map(|i| entry(i, 1)).collect()))
            .unwrap();
        disk.start_sync();
        disk.complete_sync(1).unwrap();
        disk.write(request(2, None, vec![entry(3, 2), entry(4, 2)]))
            .unwrap();
        let meta = SnapshotMeta {
            index: 4,
            term: 2,
            config: Configuration::default(),
        };
        assert!(disk.store_local_snapshot(meta, Bytes::from_static(b"s")));
        disk.start_sync();
        disk.complete_sync(2).unwrap();
        assert_eq!(disk.synced().restored_state().entries, vec![]);
        assert_eq!(disk.synced().last_index(), 4);
    }

    /// Seed 16953: a local snapshot becomes durable before the log write
    /// that overwrote the entry at its index (and the term it came with).
    /// After a crash the synced log disagrees with the snapshot at its index,
    /// so none of it can follow the snapshot; the restarting node takes the
    /// snapshot's term, with no vote in it.
    #[test]
    fn a_snapshot_newer_than_the_synced_log_drops_a_log_that_disagrees() {
        let mut disk = DiskModel::default();
        let hs = |term, vote| {
            Some(HardState {
                term,
                vote,
                commit: 0,
            })
        };
        disk.write(request(
            1,
            hs(8, Some(1)),
            (1..=6).map(|i| entry(i, 8)).collect(),
        ))
        .unwrap();
        disk.start_sync();
        disk.complete_sync(1).unwrap();
        disk.write(request(2, hs(10, None), vec![entry(4, 10), entry(5, 10)]))
            .unwrap();
        let meta = SnapshotMeta {
            index: 5,
            term: 10,
            config: Configuration::default(),
        };
        assert!(disk.store_local_snapshot(meta, Bytes::from_static(b"s")));
        disk.crash();
        let restored = disk.synced().restored_state();
        assert_eq!(restored.entries, vec![], "(6, 8) cannot follow (5, 10)");
        assert_eq!(restored.hard_state.term, 10);
        assert_eq!(restored.hard_state.vote, None);
        // Compaction behind the snapshot decides the same way.
        let mut compacted = disk.clone();
        compacted.compact(5);
        assert_eq!(compacted.synced().restored_state(), restored);
    }

    #[test]
    fn local_snapshots_and_compaction() {
        let mut disk = DiskModel::default();
        disk.write(request(1, None, (1..=5).map(|i| entry(i, 1)).collect()))
            .unwrap();
        disk.start_sync();
        disk.complete_sync(1).unwrap();
        let meta = SnapshotMeta {
            index: 3,
            term: 1,
            config: Configuration::default(),
        };
        assert!(disk.store_local_snapshot(meta.clone(), Bytes::from_static(b"s")));
        assert!(!disk.store_local_snapshot(meta, Bytes::new()), "not newer");
        disk.compact(10);
        // The snapshot's own entry stays: it decides what follows it.
        assert_eq!(
            disk.synced().entries,
            vec![entry(3, 1), entry(4, 1), entry(5, 1)]
        );
        assert_eq!(disk.synced().restored_state().entries.len(), 2);
    }

    fn two_groups() -> NodeDisk {
        NodeDisk::new([(1, DurableState::default()), (2, DurableState::default())])
    }

    #[test]
    fn one_sync_covers_every_groups_writes() {
        let mut disk = two_groups();
        disk.write(1, request(1, None, vec![entry(1, 1)])).unwrap();
        disk.write(2, request(1, None, vec![entry(1, 1), entry(2, 1)]))
            .unwrap();
        disk.write(2, request(2, None, vec![entry(3, 1)])).unwrap();
        let covered = disk.start_sync().unwrap();
        assert_eq!(covered, vec![(1, 1), (2, 2)]);
        assert_eq!(disk.start_sync(), None, "one sync at a time per node");
        // Written while the sync runs: the next sync's.
        disk.write(1, request(2, None, vec![entry(2, 1)])).unwrap();
        disk.complete_sync(&covered).unwrap();
        assert_eq!(disk.take_persisted_reports(), vec![(1, 1), (2, 2)]);
        assert_eq!(disk.group(1).unwrap().synced().last_index(), 1);
        assert_eq!(disk.group(2).unwrap().synced().last_index(), 3);
        assert_eq!(disk.start_sync(), Some(vec![(1, 2)]));
        assert!(disk.write(3, request(1, None, vec![])).is_err());
    }

    #[test]
    fn a_crash_loses_every_groups_unsynced_writes() {
        let mut disk = two_groups();
        disk.write(1, request(1, None, vec![entry(1, 1)])).unwrap();
        let covered = disk.start_sync().unwrap();
        disk.complete_sync(&covered).unwrap();
        disk.write(1, request(2, None, vec![entry(2, 1)])).unwrap();
        disk.write(2, request(1, None, vec![entry(1, 1)])).unwrap();
        assert!(disk.start_sync().is_some());
        disk.crash();
        assert!(!disk.has_unsynced());
        assert!(!disk.sync_in_flight());
        assert_eq!(disk.group(1).unwrap().synced().last_index(), 1);
        assert_eq!(disk.group(2).unwrap().synced().last_index(), 0);
    }

    #[test]
    fn installing_a_snapshot_syncs_every_group() {
        let mut disk = two_groups();
        disk.write(1, request(1, None, vec![entry(1, 1)])).unwrap();
        disk.write(2, request(1, None, vec![entry(1, 1)])).unwrap();
        let meta = SnapshotMeta {
            index: 4,
            term: 1,
            config: Configuration::default(),
        };
        disk.install_snapshot(2, meta, Bytes::from_static(b"s"))
            .unwrap();
        assert_eq!(disk.take_persisted_reports(), vec![(1, 1), (2, 1)]);
        assert_eq!(disk.group(1).unwrap().synced().last_index(), 1);
        assert_eq!(disk.group(2).unwrap().synced().last_index(), 4);
        assert!(!disk.has_unsynced());
    }
}
