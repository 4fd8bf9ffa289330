//! A node's storage on the real code: [`ferry_storage::Storage`] over a
//! [`SimDisk`], run beside the [`crate::storage::NodeDisk`].
//!
//! The model stays the simulator's record of what the node has been told
//! is durable (the durability checks read it); the real storage decides what
//! actually comes back after a crash, how long syncs take, and whether the
//! disk fails. The two are driven in lockstep: every persist request of
//! every group goes to both, and a sync starts in both at once, so the
//! sequence numbers the real log reports durable, group by group, must
//! equal the model's. One storage serves every group the node hosts: one
//! log (group commit: a sync covers every group's writes since the last)
//! and one snapshot store. After each restart [`check_restored`] proves, for
//! each group, that the recovered state is exactly the synced state plus
//! some prefix of the writes that were in flight.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use ferry_raft::{Entry, GroupId, Index, PersistRequest, SnapshotMeta};
use ferry_storage::{
    CrashMode, PendingSync, SimDisk, SimDiskOptions, SnapshotWriter, Storage, StorageError,
    WalOptions,
};

use crate::storage::DurableState;

/// Where each node keeps its data on its own simulated disk.
pub const DATA_DIR: &str = "/data";
/// The simulated time one tick of the simulated disk's sync latency takes.
pub const DISK_TICK_US: u64 = 100;

/// What opening the storage found.
#[derive(Debug)]
pub enum OpenOutcome {
    /// The storage opened; each group starts from its `durable` state.
    Opened {
        /// The recovered state of each group (votes not filled in: the
        /// caller keeps them).
        durable: BTreeMap<GroupId, DurableState>,
        /// Bytes recovery cut off a torn tail.
        truncated_bytes: u64,
    },
    /// The storage found damage it cannot explain: the node must not run.
    Corrupt(String),
}

/// The real storage of one simulated node, shared by all its groups.
#[derive(Debug)]
pub struct RealStorage {
    disk: SimDisk,
    storage: Option<Storage<SimDisk>>,
    in_flight: Option<(PendingSync<SimDisk>, std::io::Result<()>)>,
    /// The snapshot each group is receiving from its leader.
    incoming: BTreeMap<GroupId, SnapshotWriter<SimDisk>>,
}

/// The log tunables for the simulator: small segments and records so that
/// rotation, old-segment deletion and multi-record requests all happen.
fn wal_options() -> WalOptions {
    WalOptions {
        segment_size_bytes_max: 16 * 1024,
        write_buffer_bytes_max: 2 * 1024,
        cache_entries_max_per_group: 64,
        cache_size_bytes_max_per_group: 64 * 1024,
        record_size_bytes_target: 4 * 1024,
        // Reserved in small chunks, so that segments are cut back at every
        // rotation and crashes land in reserved space.
        reserve_bytes: 3 * 1024,
    }
}

fn not_open() -> StorageError {
    StorageError::Poisoned("the node's storage is not open".to_string())
}

impl RealStorage {
    /// An empty disk drawing its choices from `seed`; syncs take between
    /// `sync_ticks_min` and `sync_ticks_max` disk ticks.
    pub fn new(seed: u64, sync_ticks_min: u64, sync_ticks_max: u64) -> Self {
        RealStorage {
            disk: SimDisk::new(SimDiskOptions {
                seed,
                sync_latency_ticks_min: sync_ticks_min,
                sync_latency_ticks_max: sync_ticks_max.max(sync_ticks_min),
            }),
            storage: None,
            in_flight: None,
            incoming: BTreeMap::new(),
        }
    }

    /// The simulated disk (for fault injection).
    pub fn disk(&self) -> &SimDisk {
        &self.disk
    }

    /// The data directory.
    pub fn dir() -> PathBuf {
        PathBuf::from(DATA_DIR)
    }

    /// Whether the storage is open (the node runs on it).
    pub fn is_open(&self) -> bool {
        self.storage.is_some()
    }

    /// Opens the storage on the disk as the last crash left it. `initial`
    /// holds each hosted group's state before it ever wrote anything (the
    /// founding configuration, or nothing for a joining node).
    pub fn open(
        &mut self,
        initial: &BTreeMap<GroupId, DurableState>,
    ) -> Result<OpenOutcome, StorageError> {
        self.storage = None;
        self.in_flight = None;
        self.incoming.clear();
        let (storage, report) = match Storage::open(self.disk.clone(), &Self::dir(), wal_options())
        {
            Ok(opened) => opened,
            // Damage the storage cannot explain: a corrupt file, or a log
            // shorter than what it had synced (as damage at its very end
            // now is, when a claim vouches for it).
            Err(e @ (StorageError::Corrupt { .. } | StorageError::LostSyncedData { .. })) => {
                return Ok(OpenOutcome::Corrupt(e.to_string()))
            }
            Err(e) => return Err(e),
        };
        let mut durable = BTreeMap::new();
        for (&group, before) in initial {
            // With one group the message reads as it always did.
            let which = if initial.len() > 1 {
                format!("group {group}: ")
            } else {
                String::new()
            };
            let state = match report.groups.get(&group) {
                None => before.clone(),
                Some(recovery) => {
                    let restored = recovery.restored_state(before.snapshot.config.clone());
                    let snapshot_data = if restored.snapshot.index == 0 {
                        Bytes::new()
                    } else {
                        match storage.snapshots.read_all(group, restored.snapshot.index) {
                            Ok(Some(data)) => Bytes::from(data),
                            Ok(None) => {
                                return Ok(OpenOutcome::Corrupt(format!(
                                    "{which}the snapshot at {} the log relies on is missing",
                                    restored.snapshot.index
                                )))
                            }
                            Err(e @ StorageError::Corrupt { .. }) => {
                                return Ok(OpenOutcome::Corrupt(e.to_string()))
                            }
                            Err(e) => return Err(e),
                        }
                    };
                    DurableState {
                        hard_state: restored.hard_state,
                        snapshot: restored.snapshot,
                        snapshot_data,
                        entries: restored.entries,
                        votes: Default::default(),
                    }
                }
            };
            durable.insert(group, state);
        }
        self.storage = Some(storage);
        Ok(OpenOutcome::Opened {
            durable,
            truncated_bytes: report.wal.truncated_bytes,
        })
    }

    fn storage(&mut self) -> Result<&mut Storage<SimDisk>, StorageError> {
        self.storage.as_mut().ok_or_else(not_open)
    }

    /// Writes a persist request of `group` to the shared log (durable after
    /// the next sync).
    pub fn append(&mut self, group: GroupId, request: &PersistRequest) -> Result<(), StorageError> {
        self.storage()?.wal.append(group, request)
    }

    /// Starts a sync of everything written, by every group, runs it on the
    /// simulated disk and returns how long it took, in simulated
    /// microseconds; `None` when there was nothing to sync. The outcome is
    /// kept for [`RealStorage::complete_sync`].
    pub fn start_sync(&mut self) -> Result<Option<u64>, StorageError> {
        if self.in_flight.is_some() {
            return Err(StorageError::SyncInFlight);
        }
        let Some(pending) = self.storage()?.wal.prepare_sync()? else {
            return Ok(None);
        };
        let outcome = pending.execute();
        let ticks = self.disk.take_sync_ticks();
        self.in_flight = Some((pending, outcome));
        Ok(Some(ticks.saturating_mul(DISK_TICK_US)))
    }

    /// Whether a sync is in flight.
    pub fn sync_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Completes the sync in flight: the durable persist seq of each group
    /// it covered; `Ok(None)` when no sync was in flight (a snapshot install
    /// completed it early). A failed sync fails for every group it covered.
    pub fn complete_sync(&mut self) -> Result<Option<BTreeMap<GroupId, u64>>, StorageError> {
        let Some((pending, outcome)) = self.in_flight.take() else {
            return Ok(None);
        };
        let durable = self.storage()?.wal.complete_sync(pending, outcome)?;
        Ok(Some(durable))
    }

    /// Drops `group`'s log entries through `through` (covered by its
    /// durable snapshot).
    pub fn compact(&mut self, group: GroupId, through: Index) -> Result<(), StorageError> {
        self.storage()?.wal.compact(group, through)
    }

    /// Stores a snapshot `group`'s state machine built; durable on return.
    pub fn save_local_snapshot(
        &mut self,
        group: GroupId,
        meta: SnapshotMeta,
        data: &[u8],
    ) -> Result<(), StorageError> {
        let storage = self.storage()?;
        let mut writer = storage.begin_snapshot(group, meta)?;
        writer.write(0, data)?;
        storage.save_snapshot(writer)?;
        Ok(())
    }

    /// Writes one chunk of a snapshot from `group`'s leader (the first
    /// chunk starts a new file). The caller has checked that it continues
    /// the snapshot being received.
    pub fn save_chunk(
        &mut self,
        group: GroupId,
        meta: &SnapshotMeta,
        offset: u64,
        data: &[u8],
    ) -> Result<(), StorageError> {
        if offset == 0 {
            let writer = self.storage()?.begin_snapshot(group, meta.clone())?;
            self.incoming.insert(group, writer);
        }
        match self.incoming.get_mut(&group) {
            Some(writer) => writer.write(offset, data),
            None => Err(StorageError::InvalidRequest {
                group,
                reason: format!("snapshot chunk at offset {offset} without a first chunk"),
            }),
        }
    }

    /// Installs `group`'s completely received snapshot: completes a sync in
    /// flight first (its outcome is known), installs, then syncs the log so
    /// that the install and every earlier write, of every group, are
    /// durable. Returns the durable seq of each group that got one.
    pub fn install_incoming(
        &mut self,
        group: GroupId,
        meta: &SnapshotMeta,
    ) -> Result<BTreeMap<GroupId, u64>, StorageError> {
        let Some(writer) = self.incoming.remove(&group) else {
            return Err(StorageError::InvalidRequest {
                group,
                reason: format!("no snapshot at {} is being received", meta.index),
            });
        };
        let mut durable = self.complete_sync()?.unwrap_or_default();
        let storage = self.storage()?;
        storage.install_snapshot(writer)?;
        durable.extend(storage.wal.sync()?);
        Ok(durable)
    }

    /// Reads a chunk of `group`'s stored snapshot at `index` (verified).
    pub fn load_chunk(
        &mut self,
        group: GroupId,
        index: Index,
        offset: u64,
        max_bytes: u64,
    ) -> Result<Option<(Bytes, bool)>, StorageError> {
        self.storage()?
            .snapshots
            .read_chunk(group, index, offset, max_bytes)
    }

    /// Reads `group`'s log entries `from..=through` (at most about
    /// `max_bytes`, at least one) through the write-ahead log's reads, as
    /// the runtime does; `None` if the log no longer holds `from`.
    pub fn load_entries(
        &mut self,
        group: GroupId,
        from: Index,
        through: Index,
        max_bytes: u64,
    ) -> Result<Option<Vec<Entry>>, StorageError> {
        let wal = &self.storage()?.wal;
        let (Some(first), Some(last)) = (wal.first_index(group), wal.last_index(group)) else {
            return Ok(None);
        };
        if from < first || from > last || through < from {
            return Ok(None);
        }
        let hi = through.min(last).saturating_add(1);
        wal.entries(group, from, hi, max_bytes).map(Some)
    }

    /// The node stops (crash or storage failure): the storage is dropped
    /// and the disk loses what `mode` says.
    pub fn crash(&mut self, mode: CrashMode) {
        self.storage = None;
        self.in_flight = None;
        self.incoming.clear();
        self.disk.crash(mode);
    }

    /// Damages one random sector of the node's data; returns which file.
    pub fn corrupt_random_sector(&self) -> Option<(PathBuf, u64)> {
        self.disk.corrupt_random_sector(Path::new(DATA_DIR))
    }

    /// Damages one random sector of the node's snapshot files.
    pub fn corrupt_random_snapshot_sector(&self) -> Option<(PathBuf, u64)> {
        self.disk
            .corrupt_random_sector(&Path::new(DATA_DIR).join("snapshots"))
    }

    /// Wipes the disk (the operator moves the data directory aside).
    pub fn wipe(&mut self, seed: u64, sync_ticks_min: u64, sync_ticks_max: u64) {
        *self = RealStorage::new(seed, sync_ticks_min, sync_ticks_max);
    }
}

/// What a node had been told was durable when it stopped, and what it
/// had under way.
#[derive(Clone, Debug, Default)]
pub struct Acknowledged {
    /// The state it was told is synced.
    pub synced: DurableState,
    /// The writes not yet reported durable, oldest first.
    pub pending: Vec<PersistRequest>,
    /// A snapshot whose save (or install) had started but not been
    /// reported done: its file may or may not have become durable.
    pub snapshot_attempt: Option<(SnapshotMeta, Bytes)>,
}

/// Checks that `restored` is what a crash may leave: the synced state plus
/// the first k of the pending writes (k from 0 to all), with or without a
/// snapshot that was being saved, with nothing acknowledged as synced
/// missing and nothing invented. Returns a description of the differences
/// when nothing matches.
pub fn check_restored(acked: &Acknowledged, restored: &DurableState) -> Result<(), String> {
    let pending = &acked.pending;
    let mut candidate = acked.synced.clone();
    let mut differences = Vec::new();
    for k in 0..=pending.len() {
        if k > 0 && candidate.apply_request(&pending[k - 1]).is_err() {
            break;
        }
        match same_state(&candidate, restored) {
            Ok(()) => return Ok(()),
            Err(difference) => differences.push(format!("with {k} of them: {difference}")),
        }
        if let Some((meta, data)) = &acked.snapshot_attempt {
            if meta.index > candidate.snapshot.index {
                let mut with_snapshot = candidate.clone();
                with_snapshot.adopt_snapshot(meta.clone(), data.clone());
                if same_state(&with_snapshot, restored).is_ok() {
                    return Ok(());
                }
            }
        }
    }
    Err(format!(
        "the state recovered after a restart is not the synced state plus a prefix of the {} unsynced writes ({})",
        pending.len(),
        differences.join("; ")
    ))
}

fn same_state(expected: &DurableState, restored: &DurableState) -> Result<(), String> {
    let expected = &expected.recovered();
    let (e, r) = (expected.hard_state, restored.hard_state);
    if e.term != r.term || e.vote != r.vote {
        return Err(format!(
            "term/vote expected ({}, {:?}), recovered ({}, {:?})",
            e.term, e.vote, r.term, r.vote
        ));
    }
    let commit = e.commit.max(expected.snapshot.index);
    if commit != r.commit.max(restored.snapshot.index) {
        return Err(format!(
            "commit expected {commit}, recovered {}",
            r.commit.max(restored.snapshot.index)
        ));
    }
    if expected.snapshot.index != restored.snapshot.index
        || expected.snapshot.term != restored.snapshot.term
        || expected.snapshot_data != restored.snapshot_data
    {
        return Err(format!(
            "snapshot expected ({}, {}), recovered ({}, {})",
            expected.snapshot.index,
            expected.snapshot.term,
            restored.snapshot.index,
            restored.snapshot.term
        ));
    }
    let live = |s: &DurableState| -> Vec<(Index, u64)> {
        s.entries
            .iter()
            .filter(|x| x.index > s.snapshot.index)
            .map(|x| (x.index, x.term))
            .collect()
    };
    let (le, lr) = (live(expected), live(restored));
    if le != lr {
        let first_diff = le
            .iter()
            .zip(&lr)
            .position(|(a, b)| a != b)
            .unwrap_or(le.len().min(lr.len()));
        return Err(format!(
            "log expected {} entries after the snapshot at {}, recovered {}, first difference at position {first_diff}: expected {:?}, recovered {:?}",
            le.len(),
            expected.snapshot.index,
            lr.len(),
            &le[first_diff.min(le.len())..le.len().min(first_diff + 8)],
            &lr[first_diff.min(lr.len())..lr.len().min(first_diff + 8)],
        ));
    }
    let payloads_match = expected
        .entries
        .iter()
        .filter(|x| x.index > expected.snapshot.index)
        .zip(
            restored
                .entries
                .iter()
                .filter(|x| x.index > restored.snapshot.index),
        )
        .all(|(a, b)| a.payload == b.payload);
    if !payloads_match {
        return Err("an entry came back with a different payload".to_string());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_raft::{Configuration, Entry, EntryPayload, HardState};

    fn entry(index: Index, term: u64) -> Entry {
        Entry {
            index,
            term,
            payload: EntryPayload::Command(Bytes::from(vec![index as u8; 1500])),
        }
    }

    fn founding() -> DurableState {
        DurableState {
            snapshot: SnapshotMeta {
                index: 0,
                term: 0,
                config: Configuration::with_voters([1, 2, 3]),
            },
            ..DurableState::default()
        }
    }

    fn request(seq: u64, term: u64, entries: Vec<Entry>) -> PersistRequest {
        PersistRequest {
            seq,
            hard_state: Some(HardState {
                term,
                vote: Some(1),
                commit: 0,
            }),
            entries,
        }
    }

    fn open_groups(real: &mut RealStorage, groups: &[GroupId]) -> BTreeMap<GroupId, DurableState> {
        let initial = groups.iter().map(|&g| (g, founding())).collect();
        match real.open(&initial).unwrap() {
            OpenOutcome::Opened { durable, .. } => durable,
            OpenOutcome::Corrupt(e) => panic!("corrupt: {e}"),
        }
    }

    fn open(real: &mut RealStorage) -> DurableState {
        open_groups(real, &[1]).remove(&1).unwrap()
    }

    #[test]
    fn synced_writes_survive_and_unsynced_are_a_prefix() {
        for mode in [
            CrashMode::LoseUnsynced,
            CrashMode::KeepWritten,
            CrashMode::TornUnsynced,
        ] {
            for seed in 0..20 {
                let mut real = RealStorage::new(seed, 0, 3);
                open(&mut real);
                let mut synced = founding();
                let first = request(1, 1, vec![entry(1, 1), entry(2, 1)]);
                real.append(1, &first).unwrap();
                assert!(real.start_sync().unwrap().is_some());
                assert_eq!(
                    real.complete_sync().unwrap(),
                    Some(BTreeMap::from([(1, 1)]))
                );
                synced.apply_request(&first).unwrap();
                let pending = vec![
                    request(2, 2, vec![entry(2, 2), entry(3, 2)]),
                    request(3, 2, vec![entry(4, 2)]),
                ];
                for p in &pending {
                    real.append(1, p).unwrap();
                }
                // The entries are larger than the write buffer: they reach
                // the file, unsynced.
                real.crash(mode);
                let restored = open(&mut real);
                let acked = Acknowledged {
                    synced: synced.clone(),
                    pending: pending.clone(),
                    snapshot_attempt: None,
                };
                check_restored(&acked, &restored)
                    .unwrap_or_else(|e| panic!("{mode:?} seed {seed}: {e}"));
                if mode == CrashMode::LoseUnsynced {
                    assert_eq!(restored.entries.len(), 2);
                }
                if mode == CrashMode::KeepWritten {
                    // The first pending write reached the file; the last
                    // one was still in the log's buffer.
                    assert_eq!(restored.entries.len(), 3);
                }
            }
        }
    }

    #[test]
    fn check_restored_rejects_lost_acknowledged_state() {
        let mut synced = founding();
        synced
            .apply_request(&request(1, 3, vec![entry(1, 1), entry(2, 3)]))
            .unwrap();
        let acked = Acknowledged {
            synced: synced.clone(),
            ..Acknowledged::default()
        };
        let mut lost_entry = synced.clone();
        lost_entry.entries.pop();
        assert!(check_restored(&acked, &lost_entry).is_err());
        let mut lost_vote = synced.clone();
        lost_vote.hard_state.vote = None;
        assert!(check_restored(&acked, &lost_vote).is_err());
        let mut older_term = synced.clone();
        older_term.hard_state.term = 2;
        assert!(check_restored(&acked, &older_term).is_err());
        // A write that was never made does not count either.
        let mut invented = synced.clone();
        invented.entries.push(entry(3, 3));
        assert!(check_restored(&acked, &invented).is_err());
        let with_pending = Acknowledged {
            pending: vec![request(2, 3, vec![entry(3, 3)])],
            ..acked.clone()
        };
        assert!(check_restored(&with_pending, &invented).is_ok());
        assert!(check_restored(&with_pending, &synced).is_ok());
        // A snapshot being saved may or may not have become durable.
        let meta = SnapshotMeta {
            index: 1,
            term: 1,
            config: Configuration::with_voters([1, 2, 3]),
        };
        let mut snapshotted = synced.clone();
        snapshotted.snapshot = meta.clone();
        snapshotted.snapshot_data = Bytes::from_static(b"state");
        assert!(check_restored(&acked, &snapshotted).is_err());
        let saving = Acknowledged {
            snapshot_attempt: Some((meta, Bytes::from_static(b"state"))),
            ..acked.clone()
        };
        assert_eq!(check_restored(&saving, &snapshotted), Ok(()));
        assert!(check_restored(&saving, &synced).is_ok());
    }

    #[test]
    fn a_corrupt_sector_in_the_middle_stops_the_node() {
        let mut real = RealStorage::new(7, 0, 0);
        open(&mut real);
        for seq in 1..=60 {
            let r = request(seq, 1, vec![entry(seq, 1)]);
            real.append(1, &r).unwrap();
            real.start_sync().unwrap();
            real.complete_sync().unwrap();
        }
        real.crash(CrashMode::LoseUnsynced);
        let segment = real.disk().paths().into_iter().next().unwrap();
        assert!(real.disk().corrupt_sector(&segment, 0));
        match real.open(&BTreeMap::from([(1, founding())])).unwrap() {
            OpenOutcome::Corrupt(message) => assert!(message.contains("corrupt")),
            OpenOutcome::Opened { .. } => panic!("opened on a corrupt disk"),
        }
    }

    #[test]
    fn failed_sync_poisons_the_storage() {
        let mut real = RealStorage::new(3, 0, 0);
        open(&mut real);
        real.append(1, &request(1, 1, vec![entry(1, 1)])).unwrap();
        real.disk().fail_next_syncs(1);
        real.start_sync().unwrap();
        assert!(real.complete_sync().is_err());
        assert!(matches!(
            real.append(1, &request(2, 1, vec![entry(2, 1)])),
            Err(StorageError::Poisoned(_))
        ));
    }

    /// Group commit on the real log: one sync makes the writes of every
    /// group durable, each group through its own seq, and a crash after it
    /// brings back each group's synced writes and loses all unsynced ones.
    #[test]
    fn one_sync_covers_several_groups() {
        let mut real = RealStorage::new(11, 0, 0);
        open_groups(&mut real, &[1, 2, 3]);
        real.append(1, &request(1, 1, vec![entry(1, 1)])).unwrap();
        real.append(2, &request(1, 1, vec![entry(1, 1)])).unwrap();
        real.append(2, &request(2, 1, vec![entry(2, 1)])).unwrap();
        assert!(real.start_sync().unwrap().is_some());
        assert_eq!(
            real.complete_sync().unwrap(),
            Some(BTreeMap::from([(1, 1), (2, 2)]))
        );
        real.append(3, &request(1, 1, vec![entry(1, 1)])).unwrap();
        real.crash(CrashMode::LoseUnsynced);
        let durable = open_groups(&mut real, &[1, 2, 3]);
        assert_eq!(durable[&1].entries.len(), 1);
        assert_eq!(durable[&2].entries.len(), 2);
        assert_eq!(durable[&3].entries.len(), 0);
    }

    /// A failed sync fails for every group it covered: none of their
    /// writes is reported durable and the storage refuses them all after.
    #[test]
    fn a_failed_sync_fails_every_group_it_covered() {
        let mut real = RealStorage::new(12, 0, 0);
        open_groups(&mut real, &[1, 2]);
        real.append(1, &request(1, 1, vec![entry(1, 1)])).unwrap();
        real.append(2, &request(1, 1, vec![entry(1, 1)])).unwrap();
        real.disk().fail_next_syncs(1);
        real.start_sync().unwrap();
        assert!(real.complete_sync().is_err());
        for group in [1, 2] {
            assert!(matches!(
                real.append(group, &request(2, 1, vec![entry(2, 1)])),
                Err(StorageError::Poisoned(_))
            ));
        }
    }
}
