//! The real storage in the simulation: opening it on (re)start and checking
//! what came back, carrying out syncs and snapshot I/O on it, stopping a
//! node whose storage failed, injecting disk faults, and replacing a node
//! whose disk was found corrupt (the way back the storage crate documents).
//! The storage is the node's: one log and one snapshot store for all its
//! groups, so a failure stops every group on the node, and a lost disk is
//! replaced in every group.

use ferry_storage::{CrashMode, StorageError};

use super::*;
use crate::real_storage::{check_restored, OpenOutcome};

/// The seed of node `id`'s simulated disk.
pub(super) fn disk_seed(seed: u64, id: NodeId) -> u64 {
    seed.rotate_left(17) ^ id.wrapping_mul(0xd6e8_feb8_6659_fd93) ^ 0xd15c
}

/// Where the replacement of a node with a corrupt disk stands, in one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RepairStage {
    /// The healthy members remove the node from the group.
    Remove,
    /// The replacement joins as a learner.
    AddLearner,
    /// The learner is promoted once it has caught up.
    Promote,
    /// The replacement is a voter in the group.
    Done,
}

/// The replacement of one node whose disk was found corrupt, group by group.
#[derive(Clone, Debug)]
pub(super) struct Repair {
    lost: NodeId,
    replacement: NodeId,
    stages: BTreeMap<GroupId, RepairStage>,
    /// Whether the lost node's disk was wiped (once it is out of every group).
    wiped: bool,
}

impl Simulation {
    /// Crashes a running node now (a scenario's fault); unsynced data on a
    /// real disk is lost as the run's generator draws.
    pub fn crash_node(&mut self, id: NodeId) {
        self.crash(id);
    }

    /// A copy of a node's disk as it is now (what a backup of its data
    /// directory would hold: every group's part), on the storage model
    /// (`None` in runs on the real storage).
    pub fn copy_disk(&self, id: NodeId) -> Option<NodeDisk> {
        let node = self.nodes.get(&id)?;
        node.real.is_none().then(|| node.disk.clone())
    }

    /// Byzantine-lite: an operator restores an older copy of a stopped
    /// node's data directory. What the node promised since is void, so its
    /// restart is not held to it; from now on the faults the engines detect
    /// are recorded ([`Simulation::faults_seen`]) instead of failing the run,
    /// and the scenario decides what must have been detected. Safety,
    /// linearizability and liveness are still checked.
    pub fn restore_stale_disk(&mut self, id: NodeId, mut disk: NodeDisk) -> bool {
        let Some(node) = self.nodes.get_mut(&id) else {
            return false;
        };
        if node.running() || node.real.is_some() {
            return false;
        }
        disk.crash();
        node.disk = disk;
        node.restart_check = None;
        self.faults_seen.get_or_insert_with(Vec::new);
        self.log(
            Some(id),
            "SCENARIO: an older copy of its data directory was restored",
        );
        true
    }

    /// The faults detected since a scenario allowed them: which node, in
    /// which group, detected what.
    pub fn faults_seen(&self) -> &[(NodeId, GroupId, ferry_raft::Fault)] {
        self.faults_seen.as_deref().unwrap_or(&[])
    }

    /// Restarts a stopped node from its disk. Returns whether it runs.
    pub fn restart_node(&mut self, id: NodeId) -> bool {
        self.start_node(id);
        self.is_running(id)
    }

    /// Damages sector `sector` of the oldest log segment on a stopped
    /// node's real disk. Returns whether there was such a sector.
    pub fn damage_log_sector(&mut self, id: NodeId, sector: u64) -> bool {
        let Some(node) = self.nodes.get_mut(&id) else {
            return false;
        };
        if node.running() {
            return false;
        }
        let Some(real) = node.real.as_ref() else {
            return false;
        };
        let wal = RealStorage::dir().join("wal");
        let Some(segment) = real
            .disk()
            .paths()
            .into_iter()
            .find(|p| p.starts_with(&wal))
        else {
            return false;
        };
        let damaged = real.disk().corrupt_sector(&segment, sector);
        node.corrupted_since_open |= damaged;
        damaged
    }

    /// Whether the node's storage was found corrupt (it stays down).
    pub fn disk_lost(&self, id: NodeId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.disk_lost)
    }

    /// Whether a repair is under way.
    pub fn repair_in_progress(&self) -> bool {
        self.repair.is_some()
    }

    /// Opens the node's real storage, if it has one, and checks what came
    /// back. Returns whether the node may start.
    pub(super) fn open_real_storage(&mut self, id: NodeId) -> bool {
        let wipe_corrupt = self.config.sabotage == Sabotage::RestartOnCorruptDisk;
        let wipe_seed = disk_seed(self.config.seed ^ 0xbad, id);
        let sync_ticks = (
            self.config.disk.sync_ticks_min,
            self.config.disk.sync_ticks_max,
        );
        let multi = self.config.groups > 1;
        let Some(node) = self.nodes.get_mut(&id) else {
            return false;
        };
        let initial = node.initial_states();
        let Some(real) = node.real.as_mut() else {
            return true;
        };
        let outcome = real.open(&initial);
        match outcome {
            Err(e @ StorageError::Io { .. }) => {
                // The disk refused (a failed sync of the directory, say):
                // like a server that exits on start, try again later.
                self.log(
                    Some(id),
                    &format!("storage could not open, retry later: {e}"),
                );
                if matches!(&e, StorageError::Io { op, .. } if op.contains("sync")) {
                    self.coverage.hit(Counter::FailedSync);
                }
                let election = u64::from(self.config.engine.election_timeout_ticks);
                let later = self.rng.range(1, 3 * election) * TICK_US;
                self.schedule(later, Event::Restart { node: id });
                false
            }
            Err(e) => {
                self.fail(
                    FailureKind::Durability,
                    format!("node {id}: its storage could not be opened: {e}"),
                );
                false
            }
            Ok(OpenOutcome::Corrupt(message)) if wipe_corrupt => {
                real.wipe(wipe_seed, sync_ticks.0, sync_ticks.1);
                node.corrupted_since_open = false;
                self.log(
                    Some(id),
                    &format!(
                        "SABOTAGE: wiped a corrupt disk, restarting under the same id: {message}"
                    ),
                );
                self.open_real_storage(id)
            }
            Ok(OpenOutcome::Corrupt(message)) => {
                node.disk_lost = true;
                self.log(
                    Some(id),
                    &format!("storage corrupt, the node stays down: {message}"),
                );
                self.coverage.hit(Counter::CorruptFoundOnOpen);
                self.begin_repair(id);
                false
            }
            Ok(OpenOutcome::Opened {
                mut durable,
                truncated_bytes,
            }) => {
                let check = node.restart_check.take();
                let corrupted = std::mem::take(&mut node.corrupted_since_open);
                let mut restored = Ok(());
                for (group, acked) in check.iter().flatten() {
                    let Some(state) = durable.get_mut(group) else {
                        continue;
                    };
                    if let Err(detail) = check_restored(acked, state) {
                        restored = Err(if multi {
                            format!("group {group}: {detail}")
                        } else {
                            detail
                        });
                        break;
                    }
                    state.votes = acked.synced.votes.clone();
                }
                if let Err(detail) = restored {
                    if corrupted {
                        // Damage to the very end of the log looks like a
                        // torn write and is cut (the storage crate's
                        // documented limit). Only the simulator knows the
                        // sector was damaged; it treats the disk as lost.
                        node.disk_lost = true;
                        real.crash(CrashMode::LoseUnsynced);
                        self.coverage.hit(Counter::CorruptTailTakenForTorn);
                        self.log(
                            Some(id),
                            &format!("a damaged sector at the log's end passed for a torn write (documented limit); the node stays down: {detail}"),
                        );
                        self.begin_repair(id);
                        return false;
                    }
                    self.fail(
                        FailureKind::Durability,
                        format!("node {id} restarted without what it had synced: {detail}"),
                    );
                    return false;
                }
                for state in durable.values_mut() {
                    if let Some(vote) = state.hard_state.vote {
                        state.votes.insert(state.hard_state.term, vote);
                    }
                }
                node.disk = NodeDisk::new(durable);
                if truncated_bytes > 0 {
                    self.coverage.hit(Counter::TornTailCut);
                    self.log(
                        Some(id),
                        &format!("recovery cut a torn tail of {truncated_bytes} bytes"),
                    );
                }
                true
            }
        }
    }

    /// The node's storage failed (a failed sync, a power loss in the middle
    /// of a write, damage found on a read): it stops, as the server does,
    /// and is restarted later on what its disk holds.
    pub(super) fn storage_failed(&mut self, id: NodeId, error: StorageError) {
        match &error {
            // What a disk can do to the storage. (The simulated disk runs
            // out of neither descriptors nor space, so `Unavailable` does
            // not come up; if it did, it is the disk's doing too.)
            StorageError::Io { .. }
            | StorageError::Unavailable { .. }
            | StorageError::Corrupt { .. }
            | StorageError::LostSyncedData { .. }
            | StorageError::Poisoned(_) => {}
            // A request the storage refused: a bug in this runtime (or in the
            // storage), not a disk fault; it must not pass for one.
            StorageError::InvalidRequest { .. }
            | StorageError::OutOfRange { .. }
            | StorageError::UnknownGroup(_)
            | StorageError::SyncInFlight
            | StorageError::SnapshotChunkOutOfOrder { .. }
            | StorageError::SnapshotSealed { .. }
            | StorageError::VersionOutOfOrder { .. } => {
                self.fail(
                    FailureKind::Contract,
                    format!("node {id}: the storage refused a request: {error}"),
                );
                return;
            }
        }
        let powered_off = self
            .nodes
            .get(&id)
            .and_then(|n| n.real.as_ref())
            .is_some_and(|r| r.disk().is_powered_off());
        if matches!(error, StorageError::Corrupt { .. }) {
            self.coverage.hit(Counter::CorruptFoundOnRead);
        }
        if powered_off {
            self.coverage.hit(Counter::PowerLossMidWrite);
        } else if matches!(&error, StorageError::Io { op, .. } if op.contains("sync")) {
            self.coverage.hit(Counter::FailedSync);
        }
        self.log(
            Some(id),
            &format!("storage failed, the node stops: {error}"),
        );
        if !self.is_running(id) {
            return;
        }
        self.crash(id);
        let election = u64::from(self.config.engine.election_timeout_ticks);
        let down = self.rng.range(1, 3 * election) * TICK_US;
        self.schedule(down, Event::Restart { node: id });
    }

    /// Draws how a crash treats the unsynced data of a real disk.
    pub(super) fn draw_crash_mode(&mut self) -> CrashMode {
        match self.rng.range(0, 3) {
            0 => CrashMode::LoseUnsynced,
            1 => CrashMode::KeepWritten,
            _ => CrashMode::TornUnsynced,
        }
    }

    /// Completes a sync on the real storage, checking it made the same
    /// writes durable as the model, group by group: one sync of the shared
    /// log covers exactly the groups, and the seqs, the model's sync
    /// covered. Returns whether to go on.
    pub(super) fn real_complete_sync(&mut self, id: NodeId, covered: &[(GroupId, u64)]) -> bool {
        let multi = self.config.groups > 1;
        let Some(real) = self.nodes.get_mut(&id).and_then(|n| n.real.as_mut()) else {
            return true;
        };
        match real.complete_sync() {
            Ok(Some(durable)) => {
                // A group the model covered may be missing from the real
                // log's answer only if it wrote nothing the log recorded;
                // a group or a seq the model did not cover is a mismatch.
                let model_seq = |group: GroupId| {
                    covered
                        .binary_search_by_key(&group, |(g, _)| *g)
                        .ok()
                        .and_then(|i| covered.get(i))
                        .map(|(_, seq)| *seq)
                };
                let mismatch = durable
                    .iter()
                    .find(|(&group, &seq)| model_seq(group) != Some(seq));
                let Some((&group, &real_seq)) = mismatch else {
                    return true;
                };
                let model = model_seq(group).unwrap_or(0);
                let detail = if multi {
                    format!("node {id}: the real log made seq {real_seq} of group {group} durable, the model {model} (the model's sync covered {covered:?}, the real one {durable:?})")
                } else {
                    format!(
                        "node {id}: the real log made seq {real_seq} durable, the model {model}"
                    )
                };
                self.fail(FailureKind::Durability, detail);
                false
            }
            Ok(None) => true,
            Err(e) => {
                self.storage_failed(id, e);
                false
            }
        }
    }

    /// Writes a received snapshot chunk to the real storage. Returns
    /// whether it was saved (false also when the node stopped).
    pub(super) fn real_save_chunk(
        &mut self,
        id: NodeId,
        group: GroupId,
        meta: &SnapshotMeta,
        offset: u64,
        data: &[u8],
    ) -> bool {
        let Some(real) = self.nodes.get_mut(&id).and_then(|n| n.real.as_mut()) else {
            return true;
        };
        match real.save_chunk(group, meta, offset, data) {
            Ok(()) => true,
            Err(
                e @ (StorageError::InvalidRequest { .. }
                | StorageError::SnapshotChunkOutOfOrder { .. }),
            ) => {
                self.log_group(Some(id), group, &format!("snapshot chunk refused: {e}"));
                false
            }
            Err(e) => {
                self.storage_failed(id, e);
                false
            }
        }
    }

    /// Stores a local snapshot on the real storage. Returns whether to go on.
    pub(super) fn real_save_local_snapshot(
        &mut self,
        id: NodeId,
        group: GroupId,
        meta: &SnapshotMeta,
        data: &Bytes,
    ) -> bool {
        let Some(node) = self.nodes.get_mut(&id) else {
            return false;
        };
        let stored_index = node
            .disk
            .group(group)
            .map_or(0, |d| d.synced().snapshot.index);
        if meta.index <= stored_index {
            return true;
        }
        let Some(real) = node.real.as_mut() else {
            return true;
        };
        let Some(replica) = group_index(group).and_then(|i| node.replicas.get_mut(i)) else {
            return false;
        };
        replica.snapshot_attempt = Some((meta.clone(), data.clone()));
        match real.save_local_snapshot(group, meta.clone(), data) {
            Ok(()) => {
                replica.snapshot_attempt = None;
                true
            }
            Err(e) => {
                replica.snapshot_in_progress = false;
                self.storage_failed(id, e);
                false
            }
        }
    }

    /// Reads a snapshot chunk from the real storage (the model's chunk
    /// must agree where both have it). `None` when the node stopped.
    pub(super) fn real_load_chunk(
        &mut self,
        id: NodeId,
        group: GroupId,
        snapshot_index: Index,
        offset: u64,
        max_bytes: u64,
        model_chunk: Option<(Bytes, bool)>,
    ) -> Option<Option<(Bytes, bool)>> {
        let Some(real) = self.nodes.get_mut(&id).and_then(|n| n.real.as_mut()) else {
            return Some(model_chunk);
        };
        match real.load_chunk(group, snapshot_index, offset, max_bytes) {
            Ok(chunk) => {
                if let (Some(real_chunk), Some(expected)) = (&chunk, &model_chunk) {
                    if real_chunk != expected {
                        let who = self.who(id, group);
                        self.fail(
                            FailureKind::Durability,
                            format!("{who}: the stored snapshot at {snapshot_index} gives other bytes at offset {offset} than were saved"),
                        );
                        return None;
                    }
                }
                Some(chunk)
            }
            Err(e) => {
                self.storage_failed(id, e);
                None
            }
        }
    }

    /// Reads entries for a leader's load through the real storage, when
    /// the run has it (and checks them against the model's), else returns
    /// the model's. `None` when the storage failed (the run stops).
    pub(super) fn real_load_entries(
        &mut self,
        id: NodeId,
        group: GroupId,
        (from, through, max_bytes): (Index, Index, u64),
        (model, covered): (Option<Vec<Entry>>, (Index, Term)),
    ) -> Option<Option<Vec<Entry>>> {
        let Some(real) = self.nodes.get_mut(&id).and_then(|n| n.real.as_mut()) else {
            return Some(model);
        };
        match real.load_entries(group, from, through, max_bytes) {
            Ok(entries) => {
                if let (Some(real_entries), Some(expected)) = (&entries, &model) {
                    if !loads_agree(real_entries, expected, covered) {
                        let who = self.who(id, group);
                        self.fail(
                            FailureKind::Durability,
                            format!(
                                "{who}: the stored log gives other entries from {from} than were written: {} than {}",
                                describe_entries(real_entries),
                                describe_entries(expected)
                            ),
                        );
                        return None;
                    }
                }
                Some(entries)
            }
            Err(e) => {
                self.storage_failed(id, e);
                None
            }
        }
    }

    /// Injects one disk fault: a power loss in the middle of a coming
    /// write, a failed sync, or a damaged sector (at most one node with a
    /// damaged disk per run, and only while a replacement id is free, so a
    /// majority of the voters stays healthy).
    pub(super) fn next_disk_fault(&mut self) {
        let candidates: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.running() && n.real.is_some())
            .map(|n| n.id)
            .collect();
        let Some(&picked) = self.rng.pick(&candidates) else {
            return;
        };
        let mut victim = picked;
        match self.rng.range(0, 4) {
            0 | 1 => {
                let units = self.rng.range(0, 8_192);
                if let Some(real) = self.nodes.get(&victim).and_then(|n| n.real.as_ref()) {
                    real.disk().set_fault_budget(Some(units));
                }
                self.log(
                    Some(victim),
                    &format!("disk loses power after {units} more units of work"),
                );
            }
            2 => {
                if let Some(real) = self.nodes.get(&victim).and_then(|n| n.real.as_ref()) {
                    real.disk().fail_next_syncs(1);
                }
                self.log(Some(victim), "disk fails its next sync");
            }
            _ => {
                let any_lost = self
                    .nodes
                    .values()
                    .any(|n| n.disk_lost || n.corrupted_since_open);
                let replacement_free = self
                    .config
                    .replacement_ids()
                    .iter()
                    .any(|&r| !self.ever_added_anywhere(r));
                if any_lost || self.repair.is_some() || !replacement_free {
                    return;
                }
                // Damage found on the next start, or (half the time) in a
                // running leader's snapshot, which it reads to send to
                // followers: its reads are verified, and damage found there
                // stops it.
                let while_running = self.rng.chance_percent(50);
                if while_running {
                    // A leader of some group: it reads its snapshots to
                    // send them (with one group, group 1 and no draw).
                    let group = if self.config.groups > 1 {
                        let groups: Vec<GroupId> = self.group_ids().collect();
                        self.group_rng.pick(&groups).copied().unwrap_or(GROUP)
                    } else {
                        GROUP
                    };
                    match self.group_leader(group) {
                        Some(leader) => victim = leader,
                        _ => return,
                    }
                } else {
                    self.crash(victim);
                }
                let damaged = self
                    .nodes
                    .get(&victim)
                    .and_then(|n| n.real.as_ref())
                    .and_then(|r| {
                        if while_running {
                            r.corrupt_random_snapshot_sector()
                        } else {
                            r.corrupt_random_sector()
                        }
                    });
                if let Some((path, sector)) = damaged {
                    if let Some(n) = self.nodes.get_mut(&victim) {
                        n.corrupted_since_open = true;
                    }
                    self.log(
                        Some(victim),
                        &format!("disk damages sector {sector} of {}", path.display()),
                    );
                }
                if !while_running {
                    let election = u64::from(self.config.engine.election_timeout_ticks);
                    let down = self.rng.range(1, 3 * election) * TICK_US;
                    self.schedule(down, Event::Restart { node: victim });
                }
            }
        }
    }

    /// Whether `id` was ever added to (or started for) any group.
    pub(super) fn ever_added_anywhere(&self, id: NodeId) -> bool {
        self.ever_added.iter().any(|&(_, n)| n == id)
    }

    /// Starts replacing `lost` (whose disk is corrupt) with a free
    /// replacement id, if there is one, in every group.
    pub(super) fn begin_repair(&mut self, lost: NodeId) {
        if self.repair.is_some() {
            return;
        }
        let Some(replacement) = self
            .config
            .replacement_ids()
            .into_iter()
            .find(|&r| !self.ever_added_anywhere(r))
        else {
            return;
        };
        let groups: Vec<GroupId> = self.group_ids().collect();
        for &group in &groups {
            self.ever_added.insert((group, replacement));
        }
        self.repair = Some(Repair {
            lost,
            replacement,
            stages: groups.iter().map(|&g| (g, RepairStage::Remove)).collect(),
            wiped: false,
        });
        self.log(
            Some(lost),
            &format!("repair: remove n{lost}, wipe it, add n{replacement} in its place"),
        );
        self.schedule(TICK_US, Event::RepairStep);
    }

    /// One step of the repair: ask each group's leader for the group's
    /// next membership change once the previous one shows in its
    /// configuration.
    pub(super) fn repair_step(&mut self) {
        let Some(repair) = self.repair.clone() else {
            return;
        };
        if self.phase == Phase::Done {
            return;
        }
        let election_us = u64::from(self.config.engine.election_timeout_ticks) * TICK_US;
        self.schedule(election_us, Event::RepairStep);
        for (&group, &stage) in &repair.stages {
            if self.failure.is_some() {
                return;
            }
            self.repair_group_step(group, stage);
        }
        if self
            .repair
            .as_ref()
            .is_some_and(|r| r.stages.values().all(|s| *s == RepairStage::Done))
        {
            let (lost, replacement) = (repair.lost, repair.replacement);
            if self.config.groups > 1 {
                self.log(
                    Some(replacement),
                    &format!(
                        "repair: n{replacement} is a voter in place of n{lost} in every group"
                    ),
                );
            }
            self.coverage.hit(Counter::NodeRepaired);
            self.repair = None;
        }
    }

    fn set_repair_stage(&mut self, group: GroupId, stage: RepairStage) {
        if let Some(repair) = self.repair.as_mut() {
            repair.stages.insert(group, stage);
        }
    }

    /// The repair's step in one group.
    fn repair_group_step(&mut self, group: GroupId, stage: RepairStage) {
        let Some((lost, replacement)) = self.repair.as_ref().map(|r| (r.lost, r.replacement))
        else {
            return;
        };
        let Some(leader) = self.group_leader(group) else {
            return;
        };
        let Some(config) = self.group_engine(leader, group).map(|e| e.config().clone()) else {
            return;
        };
        let request = match stage {
            RepairStage::Done => return,
            RepairStage::Remove if config.contains(lost) => MembershipChange::Remove(lost),
            RepairStage::Remove => {
                // Out of the group. Once it is out of every group, move its
                // data aside; start the replacement with an empty disk.
                self.set_repair_stage(group, RepairStage::AddLearner);
                let out_everywhere = self.repair.as_ref().is_some_and(|r| {
                    !r.wiped && r.stages.values().all(|s| *s != RepairStage::Remove)
                });
                if out_everywhere {
                    if let Some(node) = self.nodes.get_mut(&lost) {
                        let seed = disk_seed(self.config.seed ^ 0x5ea1, lost);
                        if let Some(real) = node.real.as_mut() {
                            real.wipe(
                                seed,
                                self.config.disk.sync_ticks_min,
                                self.config.disk.sync_ticks_max,
                            );
                        }
                    }
                    if let Some(repair) = self.repair.as_mut() {
                        repair.wiped = true;
                    }
                    self.log(Some(lost), "repair: removed and wiped");
                } else {
                    self.log_group(Some(lost), group, "repair: removed");
                }
                self.start_node(replacement);
                MembershipChange::AddLearner(replacement)
            }
            RepairStage::AddLearner if !config.contains(replacement) => {
                MembershipChange::AddLearner(replacement)
            }
            RepairStage::AddLearner | RepairStage::Promote
                if !config.is_voter(replacement) || config.is_joint() =>
            {
                self.set_repair_stage(group, RepairStage::Promote);
                if config.is_voter(replacement) {
                    return;
                }
                MembershipChange::PromoteLearner(replacement)
            }
            RepairStage::AddLearner | RepairStage::Promote => {
                self.log_group(
                    Some(replacement),
                    group,
                    &format!("repair: n{replacement} is a voter in place of n{lost}"),
                );
                self.set_repair_stage(group, RepairStage::Done);
                return;
            }
        };
        self.log_group(
            Some(leader),
            group,
            &format!("repair: admin request {request:?}"),
        );
        self.send_request(
            leader,
            group,
            Request::ChangeMembership(request),
            Owner::Admin { group },
        );
    }
}

/// Whether a load through the real log agrees with the model's: the same
/// entries as far as both go, and any more that one of them gives covered
/// by the snapshot (`covered`: its index and term). The model drops the
/// entries a snapshot covers at once; the real log keeps them until it
/// compacts, and may serve them.
fn loads_agree(real: &[Entry], model: &[Entry], covered: (Index, Term)) -> bool {
    let common = real.len().min(model.len());
    let longer = if real.len() > model.len() {
        real
    } else {
        model
    };
    real[..common] == model[..common]
        && longer[common..]
            .iter()
            .all(|e| e.index < covered.0 || (e.index == covered.0 && e.term == covered.1))
}

/// The indexes, terms and sizes of `entries`, for a failure message.
fn describe_entries(entries: &[Entry]) -> String {
    let parts: Vec<String> = entries
        .iter()
        .map(|e| format!("{}@{}/{}B", e.index, e.term, e.size_bytes()))
        .collect();
    format!("[{}]", parts.join(" "))
}
