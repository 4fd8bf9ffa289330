//! Helpers shared by the integration tests: backends, a model of what the
//! storage should hold, and request builders.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use ferry_raft::{
    Configuration, Entry, EntryPayload, GroupId, HardState, Index, PersistRequest, SnapshotMeta,
    Term,
};
use ferry_storage::{
    CrashMode, Disk, FsDisk, GroupRecovery, SimDisk, Storage, StorageError, WalOptions,
};

/// A storage backend under test.
pub trait Backend {
    type D: Disk;
    fn disk(&self) -> Self::D;
    fn dir(&self) -> PathBuf;
    /// What a restart of the process does to the disk: for the real disk,
    /// nothing (the page cache survives a process restart); for the
    /// simulated one, a crash that loses everything unsynced.
    fn restart(&self);
    /// A restart after which everything written survives, synced or not
    /// (for the real disk, a process restart; for the simulated one, a
    /// crash that keeps every write), so that a test can tear an unsynced
    /// write itself.
    fn restart_keeping_written(&self);
    /// Flips the bits of one byte.
    fn corrupt_byte(&self, path: &Path, offset: u64);
    /// Sets `len` bytes from `offset` to zero (what a write that never
    /// reached the disk leaves in reserved space), keeping the file's length.
    fn zero_bytes(&self, path: &Path, offset: u64, len: usize);
    fn file_len(&self, path: &Path) -> u64 {
        self.disk().file_len(path).unwrap()
    }
    /// The file's length without the zeros at its end (a log segment's
    /// reserved space): where its last record ends, give or take the
    /// record's own trailing zero bytes.
    fn content_len(&self, path: &Path) -> u64 {
        let data = self.disk().read_all(path).unwrap();
        data.iter()
            .rposition(|b| *b != 0)
            .map_or(0, |i| i as u64 + 1)
    }
}

pub struct FsBackend {
    dir: PathBuf,
}

impl FsBackend {
    pub fn new(label: &str) -> Self {
        let dir = ferry_storage::unique_temp_dir(label);
        std::fs::create_dir_all(&dir).unwrap();
        FsBackend { dir }
    }
}

impl Drop for FsBackend {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Backend for FsBackend {
    type D = FsDisk;
    fn disk(&self) -> FsDisk {
        FsDisk
    }
    fn dir(&self) -> PathBuf {
        self.dir.clone()
    }
    fn restart(&self) {}
    fn restart_keeping_written(&self) {}
    fn corrupt_byte(&self, path: &Path, offset: u64) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, offset).unwrap();
        b[0] ^= 0xff;
        f.write_all_at(&b, offset).unwrap();
        f.sync_all().unwrap();
    }
    fn zero_bytes(&self, path: &Path, offset: u64, len: usize) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.write_all_at(&vec![0u8; len], offset).unwrap();
        f.sync_all().unwrap();
    }
}

pub struct SimBackend {
    pub disk: SimDisk,
}

impl SimBackend {
    pub fn new(seed: u64) -> Self {
        SimBackend {
            disk: SimDisk::with_seed(seed),
        }
    }
}

impl Backend for SimBackend {
    type D = SimDisk;
    fn disk(&self) -> SimDisk {
        self.disk.clone()
    }
    fn dir(&self) -> PathBuf {
        PathBuf::from("/node1")
    }
    fn restart(&self) {
        self.disk.crash(CrashMode::LoseUnsynced);
    }
    fn restart_keeping_written(&self) {
        self.disk.crash(CrashMode::KeepWritten);
    }
    fn corrupt_byte(&self, path: &Path, offset: u64) {
        assert!(self.disk.corrupt_byte(path, offset));
    }
    fn zero_bytes(&self, path: &Path, offset: u64, len: usize) {
        assert!(self.disk.zero_bytes(path, offset, len));
    }
}

pub fn small_options() -> WalOptions {
    WalOptions {
        segment_size_bytes_max: 512,
        write_buffer_bytes_max: 256,
        cache_entries_max_per_group: 4,
        cache_size_bytes_max_per_group: 4096,
        record_size_bytes_target: 200,
        reserve_bytes: 0,
    }
}

pub fn entry(index: Index, term: Term, tag: u64) -> Entry {
    let payload = match index % 7 {
        0 => EntryPayload::Noop,
        3 => EntryPayload::Config(ferry_raft::Configuration::with_voters([1, 2, tag % 5 + 3])),
        _ => EntryPayload::Command(Bytes::from(format!("g{tag}-i{index}-t{term}").into_bytes())),
    };
    Entry {
        term,
        index,
        payload,
    }
}

/// What one group should hold, as recovery reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelGroup {
    pub hard_state: HardState,
    pub snapshot: Option<(SnapshotMeta, Vec<u8>)>,
    /// Entries after the snapshot.
    pub entries: Vec<Entry>,
}

impl ModelGroup {
    pub fn last_index(&self) -> Index {
        self.entries
            .last()
            .map(|e| e.index)
            .unwrap_or_else(|| self.snapshot.as_ref().map_or(0, |s| s.0.index))
    }

    pub fn persist(&mut self, req: &PersistRequest) {
        if let Some(hs) = req.hard_state {
            self.hard_state = hs;
        }
        if let Some(first) = req.entries.first() {
            self.entries.retain(|e| e.index < first.index);
            self.entries.extend(req.entries.iter().cloned());
        }
    }

    pub fn snapshot(&mut self, meta: SnapshotMeta, data: Vec<u8>) {
        let covered = meta.index;
        let keep = self
            .entries
            .iter()
            .any(|e| e.index == covered && e.term == meta.term);
        if keep {
            self.entries.retain(|e| e.index > covered);
        } else {
            self.entries.clear();
        }
        self.snapshot = Some((meta, data));
    }
}

pub type Model = BTreeMap<GroupId, ModelGroup>;

/// Checks that what storage recovered is exactly `model` (snapshot data included).
pub fn matches_model<D: Disk>(
    storage: &Storage<D>,
    recovered: &BTreeMap<GroupId, GroupRecovery>,
    model: &Model,
) -> Result<(), String> {
    let live: Vec<GroupId> = model.keys().copied().collect();
    let got: Vec<GroupId> = recovered.keys().copied().collect();
    if live != got {
        return Err(format!(
            "groups differ: expected {live:?}, recovered {got:?}"
        ));
    }
    for (id, want) in model {
        let have = &recovered[id];
        if have.hard_state != want.hard_state {
            return Err(format!(
                "group {id}: hard state {:?} != {:?}",
                have.hard_state, want.hard_state
            ));
        }
        if have.entries != want.entries {
            return Err(format!(
                "group {id}: entries {:?} != {:?}",
                have.entries
                    .iter()
                    .map(|e| (e.index, e.term))
                    .collect::<Vec<_>>(),
                want.entries
                    .iter()
                    .map(|e| (e.index, e.term))
                    .collect::<Vec<_>>()
            ));
        }
        match (&have.snapshot, &want.snapshot) {
            (None, None) => {}
            (Some(h), Some((w, data))) => {
                if h != w {
                    return Err(format!("group {id}: snapshot {h:?} != {w:?}"));
                }
                let stored = storage
                    .snapshots
                    .read_all(*id, h.index)
                    .map_err(|e| e.to_string())?
                    .ok_or("snapshot data missing")?;
                if &stored != data {
                    return Err(format!("group {id}: snapshot data differs"));
                }
            }
            (h, w) => {
                return Err(format!(
                    "group {id}: snapshot {h:?} != {:?}",
                    w.as_ref().map(|w| &w.0)
                ))
            }
        }
    }
    Ok(())
}

pub fn snapshot_data(group: GroupId, index: Index, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + group * 7 + index) as u8)
        .collect()
}

/// One step of a storage script.
#[derive(Clone, Debug)]
pub enum Op {
    Append(GroupId, PersistRequest),
    Sync,
    Compact(GroupId, Index),
    SaveSnapshot(GroupId, SnapshotMeta, Vec<u8>),
    Install(GroupId, SnapshotMeta, Vec<u8>),
    Remove(GroupId),
}

/// Carries out one step.
pub fn apply<D: Disk>(s: &mut Storage<D>, op: &Op) -> Result<(), StorageError> {
    match op {
        Op::Append(g, r) => s.wal.append(*g, r),
        Op::Sync => s.wal.sync().map(drop),
        Op::Compact(g, at) => s.wal.compact(*g, *at),
        Op::SaveSnapshot(g, meta, data) => {
            let mut w = s.begin_snapshot(*g, meta.clone())?;
            w.write(0, data)?;
            s.save_snapshot(w).map(drop)
        }
        Op::Install(g, meta, data) => {
            let mut w = s.begin_snapshot(*g, meta.clone())?;
            w.write(0, &data[..50])?;
            w.write(50, &data[50..])?;
            s.install_snapshot(w).map(drop)
        }
        Op::Remove(g) => s.remove_group(*g).map(drop),
    }
}

/// A random script over four groups: appends (some replacing a suffix),
/// syncs, snapshots with compaction, installed snapshots and removals.
pub fn random_script(seed: u64) -> (Vec<Op>, Vec<Model>) {
    use rand_chacha::rand_core::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut pick = |n: u64| rng.next_u64() % n;
    let mut ops = Vec::new();
    let mut model = Model::new();
    let mut states = vec![model.clone()];
    let mut terms = std::collections::BTreeMap::<GroupId, u64>::new();
    let mut seq = 0;
    let push = |op: Op, model: &mut Model, ops: &mut Vec<Op>, states: &mut Vec<Model>| {
        match &op {
            Op::Append(g, r) => model.entry(*g).or_default().persist(r),
            Op::Sync | Op::Compact(..) => {}
            Op::SaveSnapshot(g, m, d) | Op::Install(g, m, d) => {
                model.entry(*g).or_default().snapshot(m.clone(), d.clone())
            }
            Op::Remove(g) => {
                model.remove(g);
            }
        }
        ops.push(op);
        states.push(model.clone());
    };
    while ops.len() < 45 {
        let g = 1 + pick(4);
        let term = *terms.entry(g).or_insert(1);
        let m = model.get(&g).cloned().unwrap_or_default();
        let base = m.snapshot.as_ref().map_or(0, |s| s.0.index);
        let last = m.last_index();
        match pick(100) {
            0..=59 => {
                let term = if pick(5) == 0 { term + 1 } else { term };
                terms.insert(g, term);
                let lowest = (base + 1).max(last.saturating_sub(2));
                let first = if last > base && pick(4) == 0 {
                    lowest + pick(last + 1 - lowest + 1)
                } else {
                    last + 1
                };
                let n = pick(4);
                seq += 1;
                let hard_state = (pick(2) == 0).then_some(HardState {
                    term,
                    vote: Some(g),
                    commit: base,
                });
                let entries = (first..first + n)
                    .map(|i| entry(i, term, g + 10 * seq))
                    .collect();
                push(
                    Op::Append(
                        g,
                        PersistRequest {
                            seq,
                            hard_state,
                            entries,
                        },
                    ),
                    &mut model,
                    &mut ops,
                    &mut states,
                );
            }
            60..=79 => push(Op::Sync, &mut model, &mut ops, &mut states),
            80..=89 if last > base => {
                push(Op::Sync, &mut model, &mut ops, &mut states);
                let at = base + 1 + pick(last - base);
                let t = m
                    .entries
                    .iter()
                    .find(|e| e.index == at)
                    .map_or(0, |e| e.term);
                let meta = SnapshotMeta {
                    index: at,
                    term: t,
                    config: Configuration::with_voters([1, 2, 3]),
                };
                let data = snapshot_data(g, at, pick(3000) as usize);
                push(
                    Op::SaveSnapshot(g, meta, data),
                    &mut model,
                    &mut ops,
                    &mut states,
                );
                if pick(3) != 0 {
                    push(Op::Compact(g, at), &mut model, &mut ops, &mut states);
                }
            }
            90..=96 => {
                push(Op::Sync, &mut model, &mut ops, &mut states);
                let at = last + 1 + pick(4);
                terms.insert(g, term + 1);
                let meta = SnapshotMeta {
                    index: at,
                    term: term + 1,
                    config: Configuration::with_voters([g, 7]),
                };
                let data = snapshot_data(g, at, 60 + pick(200) as usize);
                push(
                    Op::Install(g, meta, data),
                    &mut model,
                    &mut ops,
                    &mut states,
                );
            }
            97..=99 if model.contains_key(&g) => {
                terms.remove(&g);
                push(Op::Remove(g), &mut model, &mut ops, &mut states);
            }
            _ => {}
        }
    }
    (ops, states)
}
