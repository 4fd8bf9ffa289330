//! One node's storage: the shared log and the snapshot store in one data
//! directory, opened and reconciled together.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferry_raft::{Configuration, Entry, GroupId, HardState, RestoredState, SnapshotMeta};

use crate::disk::Disk;
use crate::error::{Result, StorageError};
use crate::snapshot::{SnapshotStore, SnapshotWriter};
use crate::wal::{Wal, WalOptions, WalRecovery};

/// The log and the snapshots of one node. Layout: `<dir>/wal/*.seg` and
/// `<dir>/snapshots/*.snap`.
#[derive(Debug)]
pub struct Storage<D: Disk> {
    /// The shared write-ahead log.
    pub wal: Wal<D>,
    /// The snapshot files.
    pub snapshots: SnapshotStore<D>,
    dir: PathBuf,
}

/// One group's durable state as found on start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupRecovery {
    /// Term, vote and commit as last written.
    pub hard_state: HardState,
    /// The latest snapshot, if the group has one.
    pub snapshot: Option<SnapshotMeta>,
    /// The log entries after the snapshot, consecutive.
    pub entries: Vec<Entry>,
}

impl GroupRecovery {
    /// The state to start the group's engine from. `initial_config` is the
    /// group's founding configuration, used when it has no snapshot yet.
    pub fn restored_state(&self, initial_config: Configuration) -> RestoredState {
        let snapshot = self.snapshot.clone().unwrap_or(SnapshotMeta {
            index: 0,
            term: 0,
            config: initial_config,
        });
        let mut hard_state = self.hard_state;
        hard_state.commit = hard_state.commit.max(snapshot.index);
        // A local snapshot is durable on its own, so it can be newer than
        // the last synced hard state (see "Failed syncs and snapshots" in the
        // crate docs). The term a node has seen is at least that of every
        // entry it holds: raise it, with no vote in the raised term (a vote
        // is sent only once its record is synced, so none was given).
        let held_term = self
            .entries
            .last()
            .map_or(snapshot.term, |e| e.term.max(snapshot.term));
        if held_term > hard_state.term {
            hard_state.term = held_term;
            hard_state.vote = None;
        }
        RestoredState {
            hard_state,
            applied: snapshot.index,
            snapshot,
            // The machine restarts from the snapshot and applies the log
            // after it again, so every body after the snapshot is needed.
            entries: self.entries.clone(),
            outline: None,
        }
    }
}

/// What [`Storage::open`] found.
#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    /// Every group with durable state.
    pub groups: BTreeMap<GroupId, GroupRecovery>,
    /// Details of the log replay (its `groups` are moved into `groups` above).
    pub wal: WalRecovery,
}

impl<D: Disk> Storage<D> {
    /// Opens the node's storage in `dir` (creating it if new), verifies the
    /// latest snapshots, replays the log and reconciles the two.
    pub fn open(disk: D, dir: &Path, options: WalOptions) -> Result<(Storage<D>, RecoveryReport)> {
        let snap_dir = dir.join("snapshots");
        let mut snapshots = SnapshotStore::open(disk.clone(), &snap_dir)?;
        let mut latest = snapshots.latest_all();
        let indexes = latest
            .iter()
            .map(|(g, m)| (*g, (m.index, m.term)))
            .collect();
        let (wal, mut wal_report) = Wal::open(disk, &dir.join("wal"), options, &indexes)?;
        // A removal that was synced to the log but interrupted before the
        // group's snapshots were deleted: finish it.
        for group in &wal_report.removed_groups {
            if latest.remove(group).is_some() {
                snapshots.remove_group(*group)?;
            }
        }
        let mut groups = BTreeMap::new();
        for (group, log) in std::mem::take(&mut wal_report.groups) {
            let snapshot = latest.get(&group).cloned();
            let snapshot_index = snapshot.as_ref().map_or(0, |s| s.index);
            if log.base_index > snapshot_index {
                return Err(StorageError::corrupt(
                    &snap_dir,
                    0,
                    format!(
                        "group {group}: the log is compacted through {} but the latest snapshot is at {snapshot_index}",
                        log.base_index
                    ),
                ));
            }
            groups.insert(
                group,
                GroupRecovery {
                    hard_state: log.hard_state,
                    snapshot,
                    entries: log.entries,
                },
            );
        }
        Ok((
            Storage {
                wal,
                snapshots,
                dir: dir.to_path_buf(),
            },
            RecoveryReport {
                groups,
                wal: wal_report,
            },
        ))
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts writing a snapshot (built locally or received from a leader).
    pub fn begin_snapshot(&self, group: GroupId, meta: SnapshotMeta) -> Result<SnapshotWriter<D>> {
        self.snapshots.begin(group, meta)
    }

    /// Completes a snapshot received from a leader and resets the group's log
    /// to it. The install is durable after the next sync of the log: answer
    /// `SnapshotChunkSaved { ok: true }` only then. (The snapshot file itself
    /// is durable on return, and a restart before the sync usually reconciles
    /// the log with it anyway; but if the log's last word on the group is its
    /// removal, the restart honours the removal and deletes the file.)
    pub fn install_snapshot(&mut self, writer: SnapshotWriter<D>) -> Result<SnapshotMeta> {
        let group = writer.group();
        let meta = self.snapshots.finish(writer)?;
        self.wal.reset_to_snapshot(group, meta.index, meta.term)?;
        Ok(meta)
    }

    /// Completes a snapshot the local state machine built. The log is
    /// compacted separately, when the engine asks (`Action::Compact`).
    pub fn save_snapshot(&mut self, writer: SnapshotWriter<D>) -> Result<SnapshotMeta> {
        self.snapshots.finish(writer)
    }

    /// Gives up on a snapshot being written (see [`SnapshotStore::abandon`]).
    pub fn abandon_snapshot(&self, writer: SnapshotWriter<D>) {
        self.snapshots.abandon(writer);
    }

    /// Removes every trace of `group` from this node.
    ///
    /// The log record is synced before the snapshots are deleted (otherwise a
    /// crash could leave a compacted log without its snapshot), so this runs
    /// a whole sync: it fails with [`StorageError::SyncInFlight`] while one is
    /// in flight, and returns the persist sequence numbers the sync made
    /// durable, which the caller reports to the engines like those of
    /// [`Wal::complete_sync`].
    pub fn remove_group(&mut self, group: GroupId) -> Result<BTreeMap<GroupId, u64>> {
        self.wal.remove_group(group)?;
        let durable = self.wal.sync()?;
        self.snapshots.remove_group(group)?;
        Ok(durable)
    }
}
