//! The version store: a durable map of (key, version) to value whose cost
//! does not grow with its size. It holds a state machine's data on disk
//! (the KV store's MVCC history) so that the state never has to be written
//! out whole.
//!
//! # Shape
//!
//! A log-structured merge store, kept small because the Raft log already
//! makes every write durable:
//!
//! - Writes go into the **memtable**, in memory. There is no journal of
//!   its own: what the memtable holds is re-created after a crash by
//!   applying the Raft log again from the store's durable point.
//! - [`VersionStore::freeze`] turns the memtable into an immutable layer
//!   and records the caller's **marker** (the log index the layer is
//!   complete up to) and its small state (`meta`) at that point.
//! - A **flush** job writes the frozen layers into a new **layer** on disk:
//!   sorted **run** files, synced, and a new **manifest** naming them, with
//!   the marker: one manifest replace per flush, off the hot path and never
//!   per batch. Once the manifest is durable the caller may compact its log
//!   up to the marker.
//! - A layer on disk is one or more runs whose key ranges do not overlap,
//!   in key order; a run is cut past
//!   [`VersionStoreOptions::run_bytes_target`] at a key boundary.
//! - A **merge** job joins adjacent layers when an older layer is no
//!   larger than the newer ones together (so there are O(log size) layers),
//!   dropping versions shadowed at or below the **floor** (the caller's
//!   compaction point) and, in a merge that reaches the oldest layer,
//!   tombstones that hide nothing. It rewrites only runs whose key ranges
//!   overlap another's: a run that overlaps no other run of the merge (and
//!   is not small) is moved into the new layer as it is, read and written
//!   not at all. Keys written in order (a bulk fill, time-ordered keys) so
//!   cost one write each rather than one per merge level.
//!
//! Layers partition the version space: every version in a newer layer is
//! above every version in an older one (versions only grow, and merges
//! join neighbours), and within a layer a key lies in one run's range at
//! most, so the newest layer holding any version of a key at or below a
//! bound holds the answer.
//!
//! # Memory
//!
//! The memtable is bounded by the caller's freeze policy
//! ([`VersionStore::memtable_bytes`]); of each run only the index (one
//! entry per block of about [`run::BLOCK_BYTES_TARGET`] bytes) is kept in
//! memory; blocks are read on demand, through the OS page cache. The data
//! set may be far larger than memory.
//!
//! # Crash safety
//!
//! Run files are written under a temporary name, synced, renamed, and only
//! then named in a manifest that is itself replaced atomically (see
//! [`manifest`]). On open, the manifest decides: files it does not name
//! are leftovers of a job that did not finish and are removed. So a crash
//! at any point leaves the store at the marker of the last manifest
//! written, whole.
//!
//! # Jobs
//!
//! Jobs run in two lanes, at most one job in each: a **flush** lane and a
//! **merge** lane, so that a long merge of large runs never holds frozen
//! memtables in memory behind it. [`VersionStore::next_job`] hands out the
//! next job of a lane; [`Job::run`] writes its run file (call it on a
//! blocking thread; it reads only immutable layers);
//! [`VersionStore::finish_job`] installs the run in memory and returns the
//! [`ManifestWrite`] that makes the new shape durable;
//! [`ManifestWrite::commit`] writes it (again off the caller's lock), and
//! [`VersionStore::manifest_written`] records that it is on disk. Only then
//! does the durable marker move, and only then are the runs a merge
//! replaced deleted.
//!
//! Each manifest is built from the whole in-memory shape at the moment a
//! job is installed, and numbered. Manifests are written one at a time and
//! never an older one after a newer: a newer one holds everything an older
//! one does, so an older one found superseded is simply not written.
//! Reads and writes go on meanwhile.

pub mod filter;
pub mod manifest;
pub mod run;

use std::collections::BTreeMap;
use std::ops::{Bound, RangeBounds, RangeInclusive};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::disk::Disk;
use crate::error::{Result, StorageError};
use manifest::{run_file_name, Manifest, RunEntry, MANIFEST_FILE};
use run::{Run, RunWriter};

/// One version of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The key.
    pub key: Bytes,
    /// Its version (for the KV store: main revision and sub revision).
    pub version: u64,
    /// Whether this version records a delete.
    pub tombstone: bool,
    /// The value (opaque to the store).
    pub value: Bytes,
}

/// Memory charged per record beyond its key and value bytes.
const RECORD_OVERHEAD_BYTES: usize = 48;

/// One version as the memtable holds it.
#[derive(Debug, Clone)]
struct MemVersion {
    version: u64,
    tombstone: bool,
    value: Bytes,
}

impl MemVersion {
    /// This version of `key` as a record (sharing the key and value).
    fn record(&self, key: &Bytes) -> Record {
        Record {
            key: key.clone(),
            version: self.version,
            tombstone: self.tombstone,
            value: self.value.clone(),
        }
    }
}

/// Versions written since the last freeze, by key.
#[derive(Debug, Default, Clone)]
pub struct Memtable {
    keys: BTreeMap<Bytes, Vec<MemVersion>>,
    bytes: usize,
    records: usize,
}

impl Memtable {
    fn insert(&mut self, record: Record) -> Result<()> {
        let size = record.key.len() + record.value.len() + RECORD_OVERHEAD_BYTES;
        let versions = self.keys.entry(record.key).or_default();
        if let Some(last) = versions.last() {
            if last.version >= record.version {
                return Err(StorageError::VersionOutOfOrder {
                    version: record.version,
                    last: last.version,
                });
            }
        }
        versions.push(MemVersion {
            version: record.version,
            tombstone: record.tombstone,
            value: record.value,
        });
        self.bytes += size;
        self.records += 1;
        Ok(())
    }

    fn remove(&mut self, key: &[u8], version: u64) -> bool {
        let Some(versions) = self.keys.get_mut(key) else {
            return false;
        };
        // Versions are in ascending order (`insert` keeps them so). The
        // version asked for is nearly always newer than every one kept (a
        // check before a write, which finds nothing) or the newest; any
        // other costs a binary search, not a scan of the key's history.
        let at = match versions.last() {
            Some(newest) if newest.version == version => versions.len() - 1,
            Some(newest) if newest.version > version => {
                match versions.binary_search_by_key(&version, |v| v.version) {
                    Ok(at) => at,
                    Err(_) => return false,
                }
            }
            _ => return false,
        };
        let removed = versions.remove(at);
        self.bytes -= key.len() + removed.value.len() + RECORD_OVERHEAD_BYTES;
        self.records -= 1;
        if versions.is_empty() {
            self.keys.remove(key);
        }
        true
    }

    fn latest(&self, key: &[u8], version_max: u64) -> Option<Record> {
        let (stored_key, versions) = self.keys.get_key_value(key)?;
        versions
            .iter()
            .rev()
            .find(|v| v.version <= version_max)
            .map(|v| v.record(stored_key))
    }

    fn is_empty(&self) -> bool {
        self.records == 0
    }
}

/// A frozen memtable with the durable point it completes.
#[derive(Debug)]
struct Frozen {
    table: Arc<Memtable>,
    marker: u64,
    meta: Bytes,
}

/// Settings of a version store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionStoreOptions {
    /// A merge joins an older layer with the newer ones when it is no
    /// larger than this many times their total size (0: no merges).
    pub merge_ratio: u64,
    /// A run a job writes is cut at the first key boundary past this many
    /// bytes, so that a later merge rewrites only the runs a newer layer
    /// overlaps, not a whole layer.
    pub run_bytes_target: u64,
    /// A run that overlaps no other run of a merge is moved into the new
    /// layer untouched when it holds at least this many bytes; smaller
    /// ones are rewritten with their neighbours, so that small flushes do
    /// not pile up as many small files.
    pub run_bytes_move_min: u64,
}

/// [`VersionStoreOptions::run_bytes_target`] by default.
pub const RUN_BYTES_TARGET: u64 = 64 * 1024 * 1024;

impl Default for VersionStoreOptions {
    fn default() -> Self {
        VersionStoreOptions {
            merge_ratio: 1,
            run_bytes_target: RUN_BYTES_TARGET,
            run_bytes_move_min: RUN_BYTES_TARGET / 4,
        }
    }
}

/// What [`VersionStore::open`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The marker of the last manifest: the caller replays its log after it.
    pub marker: u64,
    /// The caller's state at the marker.
    pub meta: Bytes,
    /// The compaction floor.
    pub floor: u64,
}

/// Figures for status and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Bytes of the memtable.
    pub memtable_bytes: usize,
    /// Frozen layers not yet in a run.
    pub frozen_layers: usize,
    /// Layers on disk.
    pub layers: usize,
    /// Runs on disk (run files, in all layers).
    pub runs: usize,
    /// Bytes of run files.
    pub run_file_bytes: u64,
    /// Records in runs (shadowed ones not yet merged away included).
    pub run_records: u64,
    /// Bytes of run indexes in memory.
    pub run_index_bytes: usize,
    /// Bytes written to run files and manifests since open.
    pub written_bytes: u64,
    /// Runs merges moved into a new layer without rewriting them, since
    /// open.
    pub runs_moved: u64,
}

/// A run file the store's shape includes, with its id.
#[derive(Debug, Clone)]
struct StoredRun<D: Disk> {
    id: u64,
    run: Arc<Run<D>>,
}

/// The runs of one layer on disk, in key order, their key ranges apart.
type RunLayer<D> = Arc<[Arc<Run<D>>]>;

/// A layer of the store's shape, with its id.
#[derive(Debug, Clone)]
struct StoredLayer<D: Disk> {
    id: u64,
    runs: Vec<StoredRun<D>>,
    /// The same runs, shared with views.
    handles: RunLayer<D>,
    /// Bytes of their files.
    file_bytes: u64,
}

impl<D: Disk> StoredLayer<D> {
    fn new(id: u64, runs: Vec<StoredRun<D>>) -> StoredLayer<D> {
        debug_assert!(
            runs.windows(2)
                .all(|w| w[0].run.last_key() < w[1].run.first_key()),
            "a layer's runs are in key order and apart"
        );
        let handles = runs.iter().map(|r| r.run.clone()).collect();
        let file_bytes = runs
            .iter()
            .map(|r| r.run.summary().file_bytes)
            .fold(0, u64::saturating_add);
        StoredLayer {
            id,
            runs,
            handles,
            file_bytes,
        }
    }
}

/// The two lanes jobs run in, one job at a time in each (see the module
/// docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobLane {
    /// Frozen memtables written into a run: moves the durable marker.
    Flush,
    /// Adjacent runs joined into one: changes only the shape on disk.
    Merge,
}

/// The version store of one state machine, in one directory.
#[derive(Debug)]
pub struct VersionStore<D: Disk> {
    disk: D,
    dir: PathBuf,
    options: VersionStoreOptions,
    memtable: Memtable,
    /// Newest first.
    frozen: Vec<Frozen>,
    /// Newest first.
    layers: Vec<StoredLayer<D>>,
    /// The marker and meta the runs are complete up to (in memory: a
    /// manifest saying so may not be on disk yet).
    flushed_marker: u64,
    flushed_meta: Bytes,
    /// The id the next run (or layer) gets, shared with the jobs in flight,
    /// which take one per run they write.
    next_run_id: Arc<AtomicU64>,
    /// The number of the manifest on disk (`durable_view` is its state).
    manifest_seq: u64,
    /// The number the last manifest built got.
    manifest_seq_built: u64,
    /// The number of the last manifest written, shared with the writes in
    /// flight: they are serialized on it and never go backwards.
    manifest_seq_written: Arc<Mutex<u64>>,
    floor: u64,
    flush_running: bool,
    merge_running: bool,
    /// Full merges asked for ([`VersionStore::request_full_merge`]), the
    /// marker the runs must be complete up to before the next one starts,
    /// the request the merge in flight answers, and the last request
    /// answered.
    full_merges_requested: u64,
    full_merge_after_marker: u64,
    full_merge_in_flight: Option<u64>,
    full_merges_done: u64,
    written_bytes: u64,
    runs_moved: u64,
    /// The runs as the manifest on disk names them, with its marker and
    /// meta: the state at the durable point.
    durable_view: StoreView<D>,
}

/// Whether `[start, end)` can hold a key (`BTreeMap::range` panics on an
/// empty interval).
fn walkable_from(start: &[u8], end: Bound<&[u8]>) -> bool {
    match end {
        Bound::Included(k) => start <= k,
        Bound::Excluded(k) => start < k,
        Bound::Unbounded => true,
    }
}

/// A layer for reads.
enum Layer<'a, D: Disk> {
    Mem(&'a Memtable),
    Runs(&'a [Arc<Run<D>>]),
}

/// How many times wider each window of a history walk is than the one
/// before (see [`VersionStore::history`]): a walk that finds little in its
/// first window reaches far back in a few more.
const HISTORY_WINDOW_GROWTH: u64 = 4;

/// What a history walk returned, and what it cost.
#[derive(Debug, Default)]
struct HistoryWalk {
    /// The versions it returns.
    records: Vec<Record>,
    /// Windows it walked.
    windows: usize,
    /// Versions of the memtables it looked at (each key's versions within
    /// a window, after a binary search to the first).
    memtable_versions: usize,
    /// Blocks of runs it read (whole, as every read of a run does).
    blocks_read: usize,
}

/// A version a history walk found: in a memtable (by reference, copied
/// only if it is kept) or read from a run's block.
enum HistoryFound<'a> {
    Mem(&'a Bytes, &'a MemVersion),
    Run(Record),
}

impl HistoryFound<'_> {
    fn version(&self) -> u64 {
        match self {
            HistoryFound::Mem(_, v) => v.version,
            HistoryFound::Run(record) => record.version,
        }
    }

    fn into_record(self) -> Record {
        match self {
            HistoryFound::Mem(key, v) => v.record(key),
            HistoryFound::Run(record) => record,
        }
    }
}

/// The run of a layer on disk whose key range may hold `key`.
fn run_for_key<'a, D: Disk>(runs: &'a [Arc<Run<D>>], key: &[u8]) -> Option<&'a Arc<Run<D>>> {
    let i = runs.partition_point(|r| r.last_key() < key);
    runs.get(i).filter(|r| r.first_key() <= key)
}

impl<D: Disk> VersionStore<D> {
    /// Opens (or creates) the store in `dir`.
    pub fn open(
        disk: D,
        dir: &Path,
        options: VersionStoreOptions,
    ) -> Result<(VersionStore<D>, Recovered)> {
        crate::disk::create_dir_durably(&disk, dir)?;
        let manifest = Manifest::read(&disk, dir)?.unwrap_or_default();
        let mut layers: Vec<StoredLayer<D>> = Vec::new();
        let mut runs: Vec<StoredRun<D>> = Vec::new();
        for (i, entry) in manifest.runs.iter().enumerate() {
            let path = dir.join(run_file_name(entry.id));
            let run = Run::open(&disk, &path)?;
            let corrupt = |reason: String| StorageError::Corrupt {
                path: path.clone(),
                offset: 0,
                reason,
            };
            if run.summary() != entry.summary {
                return Err(corrupt(format!(
                    "the run holds {:?}; the manifest says {:?}",
                    run.summary(),
                    entry.summary
                )));
            }
            if runs
                .last()
                .is_some_and(|before| before.run.last_key() >= run.first_key())
            {
                return Err(corrupt(
                    "the run's key range overlaps the one before it in its layer".to_string(),
                ));
            }
            runs.push(StoredRun { id: entry.id, run });
            let layer_ends = manifest
                .runs
                .get(i + 1)
                .is_none_or(|next| next.layer != entry.layer);
            if layer_ends {
                layers.push(StoredLayer::new(entry.layer, std::mem::take(&mut runs)));
            }
        }
        // Leftovers of a job that did not finish.
        let named: Vec<String> = manifest
            .runs
            .iter()
            .map(|r| run_file_name(r.id))
            .chain([MANIFEST_FILE.to_string()])
            .collect();
        let files = disk
            .list_files(dir)
            .map_err(|e| StorageError::io("list directory", dir, e))?;
        for name in files {
            if !named.contains(&name) {
                let path = dir.join(&name);
                disk.remove_file(&path)
                    .map_err(|e| StorageError::io("remove leftover", &path, e))?;
            }
        }
        let recovered = Recovered {
            marker: manifest.marker,
            meta: manifest.meta.clone(),
            floor: manifest.floor,
        };
        let durable_view = StoreView::of_manifest(
            &manifest,
            layers.iter().map(|l| l.handles.clone()).collect(),
        );
        Ok((
            VersionStore {
                disk,
                dir: dir.to_path_buf(),
                options,
                memtable: Memtable::default(),
                frozen: Vec::new(),
                layers,
                flushed_marker: manifest.marker,
                flushed_meta: manifest.meta.clone(),
                next_run_id: Arc::new(AtomicU64::new(manifest.next_run_id)),
                floor: manifest.floor,
                manifest_seq: 0,
                manifest_seq_built: 0,
                manifest_seq_written: Arc::new(Mutex::new(0)),
                flush_running: false,
                merge_running: false,
                full_merges_requested: 0,
                full_merge_after_marker: 0,
                full_merge_in_flight: None,
                full_merges_done: 0,
                written_bytes: 0,
                runs_moved: 0,
                durable_view,
            },
            recovered,
        ))
    }

    /// Writes one version; versions of a key must grow.
    pub fn put(&mut self, record: Record) -> Result<()> {
        self.memtable.insert(record)
    }

    /// Takes back a version written since the last freeze (a txn undone);
    /// false if there is no such version there.
    pub fn undo(&mut self, key: &[u8], version: u64) -> bool {
        self.memtable.remove(key, version)
    }

    /// Bytes the memtable holds (the caller freezes past its limit).
    pub fn memtable_bytes(&self) -> usize {
        self.memtable.bytes
    }

    /// Sets the compaction floor: versions at or below it that a newer
    /// version at or below it shadows may be dropped by later merges.
    pub fn set_floor(&mut self, floor: u64) {
        self.floor = self.floor.max(floor);
    }

    /// Drops at once what `floor` shadows among the versions the memtable
    /// holds (the layers on disk shed theirs in merges). A tombstone goes
    /// only when no older layer may hold a version it hides.
    pub fn compact_memtable(&mut self, floor: u64) {
        self.set_floor(floor);
        let bottom = self.frozen.is_empty() && self.layers.is_empty();
        let table = &mut self.memtable;
        let mut freed = 0usize;
        let mut dropped = 0usize;
        table.keys.retain(|key, versions| {
            let gone = shadowed(versions, floor, bottom, |v| (v.version, v.tombstone));
            for version in versions.drain(..gone) {
                freed += key.len() + version.value.len() + RECORD_OVERHEAD_BYTES;
            }
            dropped += gone;
            !versions.is_empty()
        });
        table.bytes = table.bytes.saturating_sub(freed);
        table.records = table.records.saturating_sub(dropped);
    }

    /// A consistent view that copies the memtable instead of freezing it
    /// (a store kept in memory only, whose memtable is never flushed).
    pub fn view_copy(&self, marker: u64, meta: Bytes) -> StoreView<D> {
        let mut frozen = vec![Arc::new(self.memtable.clone())];
        frozen.extend(self.frozen.iter().map(|f| f.table.clone()));
        StoreView {
            frozen,
            runs: self.run_handles(),
            marker,
            meta,
        }
    }

    /// A consistent view of the versions of keys in `[start, end)` that
    /// later writes do not change, cheap enough to take under the owner's
    /// lock: it copies (pointer copies, values are shared) the memtable's
    /// versions of at most `memtable_keys_max` keys and shares the frozen
    /// layers and runs. When the memtable holds more keys of the range the
    /// view is cut after the last one copied (see [`RangeView::cut`]).
    ///
    /// Why: reading runs means reading blocks from disk; a caller that
    /// scans the view after releasing its lock holds up no writer however
    /// slow the disk is.
    pub fn range_view(
        &self,
        start: &[u8],
        end: Bound<&[u8]>,
        memtable_keys_max: usize,
    ) -> RangeView<D> {
        let mut copied = Memtable::default();
        let mut cut = None;
        if walkable_from(start, end) {
            for (key, versions) in self
                .memtable
                .keys
                .range::<[u8], _>((Bound::Included(start), end))
            {
                if copied.keys.len() >= memtable_keys_max.max(1) {
                    cut = copied.keys.last_key_value().map(|(k, _)| k.clone());
                    break;
                }
                copied.records += versions.len();
                copied.bytes += versions
                    .iter()
                    .map(|v| key.len() + v.value.len() + RECORD_OVERHEAD_BYTES)
                    .sum::<usize>();
                copied.keys.insert(key.clone(), versions.clone());
            }
        }
        let mut frozen = vec![Arc::new(copied)];
        frozen.extend(self.frozen.iter().map(|f| f.table.clone()));
        RangeView {
            view: StoreView {
                frozen,
                runs: self.run_handles(),
                marker: 0,
                meta: Bytes::new(),
            },
            start: start.to_vec(),
            end: match (end, &cut) {
                (_, Some(cut)) => Bound::Included(cut.to_vec()),
                (Bound::Included(k), None) => Bound::Included(k.to_vec()),
                (Bound::Excluded(k), None) => Bound::Excluded(k.to_vec()),
                (Bound::Unbounded, None) => Bound::Unbounded,
            },
            cut,
        }
    }

    fn run_handles(&self) -> Vec<RunLayer<D>> {
        self.layers.iter().map(|l| l.handles.clone()).collect()
    }

    /// Freezes the memtable as the state at `marker`, with the caller's
    /// small state `meta`. The next flush makes it durable.
    pub fn freeze(&mut self, marker: u64, meta: Bytes) {
        let table = std::mem::take(&mut self.memtable);
        if let Some(newest) = self.frozen.first_mut() {
            if table.is_empty() {
                // Nothing new but the marker (and meta) moved.
                newest.marker = newest.marker.max(marker);
                newest.meta = meta;
                return;
            }
        }
        self.frozen.insert(
            0,
            Frozen {
                table: Arc::new(table),
                marker,
                meta,
            },
        );
    }

    /// The durable point: the marker of the manifest on disk.
    pub fn durable_marker(&self) -> u64 {
        self.durable_view.marker
    }

    /// Every layer, newest first: the memtable, the frozen ones, the
    /// layers on disk. (An iterator: a put looks its key up here, and
    /// collecting the layers would allocate each time.)
    fn layers(&self) -> impl Iterator<Item = Layer<'_, D>> {
        std::iter::once(Layer::Mem(&self.memtable))
            .chain(self.frozen.iter().map(|f| Layer::Mem(f.table.as_ref())))
            .chain(self.layers.iter().map(|l| Layer::Runs(&l.handles)))
    }

    /// The newest version of `key` at or below `version_max`.
    pub fn latest(&self, key: &[u8], version_max: u64) -> Result<Option<Record>> {
        for layer in self.layers() {
            let found = match layer {
                Layer::Mem(table) => table.latest(key, version_max),
                Layer::Runs(runs) => match run_for_key(runs, key) {
                    Some(run) if run.summary().min_version <= version_max => {
                        run.latest(key, version_max)?
                    }
                    Some(_) | None => continue,
                },
            };
            if found.is_some() {
                return Ok(found);
            }
        }
        Ok(None)
    }

    /// Every version in `[start, end)` in (key, version) order.
    pub fn iter<'a>(&'a self, start: &[u8], end: Bound<&[u8]>) -> VersionIter<'a, D> {
        VersionIter::new(self.layers().collect(), start, end)
    }

    /// The versions of the keys in `[start, end)` that lie in
    /// `[version_min, version_max]`, in (version, key) order: what a
    /// watcher catching up reads.
    ///
    /// When there are more than `records_max`, only the oldest are
    /// returned: the first `records_max` and the rest of the last one's
    /// version, so that the changes of one version are never split. The
    /// caller reads on from the version after the last it got.
    ///
    /// A watcher far behind must not pay for its whole lag on every
    /// batch, so the walk looks at versions in windows, oldest first: the
    /// first spans `records_max` versions and each next one
    /// `HISTORY_WINDOW_GROWTH` (four) times the one before, until a window
    /// brings the count to `records_max` or reaches `version_max`. A batch
    /// costs a look at the versions of the last window or two past what it
    /// returns: in memtables a seek per key and window, then each version
    /// in the window; in runs, whose blocks are in key order, every block
    /// whose versions meet a window. Only what is kept is copied.
    pub fn history(
        &self,
        start: &[u8],
        end: Bound<&[u8]>,
        version_min: u64,
        version_max: u64,
        records_max: usize,
    ) -> Result<Vec<Record>> {
        Ok(self
            .history_walk(start, end, version_min..=version_max, records_max)?
            .records)
    }

    /// [`VersionStore::history`], with how much it looked at.
    fn history_walk(
        &self,
        start: &[u8],
        end: Bound<&[u8]>,
        versions: RangeInclusive<u64>,
        records_max: usize,
    ) -> Result<HistoryWalk> {
        let mut walk = HistoryWalk::default();
        let (version_min, version_max) = (*versions.start(), *versions.end());
        if !walkable_from(start, end) || version_min > version_max || records_max == 0 {
            return Ok(walk);
        }
        let mut found: Vec<HistoryFound<'_>> = Vec::new();
        let mut window_min = version_min;
        let mut window_span = u64::try_from(records_max).unwrap_or(u64::MAX);
        loop {
            let window_max = window_min
                .saturating_add(window_span.saturating_sub(1))
                .min(version_max);
            self.history_window(start, end, window_min..=window_max, &mut found, &mut walk)?;
            walk.windows += 1;
            if found.len() >= records_max || window_max >= version_max {
                break;
            }
            // Every version up to `window_max` is in `found`: the next
            // window starts right after it.
            window_min = window_max + 1;
            window_span = window_span.saturating_mul(HISTORY_WINDOW_GROWTH);
        }
        if found.len() > records_max {
            // Keep the oldest `records_max` and whatever shares the
            // version of the newest of them.
            let last = found
                .select_nth_unstable_by_key(records_max - 1, HistoryFound::version)
                .1
                .version();
            found.retain(|r| r.version() <= last);
        }
        // Only what is kept is copied out of the memtables.
        let mut records: Vec<Record> = found.into_iter().map(HistoryFound::into_record).collect();
        records.sort_unstable_by(|a, b| (a.version, &a.key).cmp(&(b.version, &b.key)));
        walk.records = records;
        Ok(walk)
    }

    /// Adds to `found` every version of the keys in `[start, end)` within
    /// `versions`, from every layer.
    fn history_window<'a>(
        &'a self,
        start: &[u8],
        end: Bound<&[u8]>,
        versions: RangeInclusive<u64>,
        found: &mut Vec<HistoryFound<'a>>,
        walk: &mut HistoryWalk,
    ) -> Result<()> {
        let (version_min, version_max) = (*versions.start(), *versions.end());
        let keys = (Bound::Included(start), end);
        for layer in self.layers() {
            match layer {
                Layer::Mem(table) => {
                    for (key, key_versions) in table.keys.range::<[u8], _>(keys) {
                        // Each key's versions ascend: skip to the first in
                        // the window by a binary search.
                        let first = key_versions.partition_point(|v| v.version < version_min);
                        let in_window = key_versions[first..]
                            .iter()
                            .take_while(|v| v.version <= version_max);
                        let before = found.len();
                        found.extend(in_window.map(|v| HistoryFound::Mem(key, v)));
                        walk.memtable_versions += found.len() - before;
                    }
                }
                Layer::Runs(runs) => {
                    for run in runs.iter() {
                        let s = run.summary();
                        // The run holds keys from its first through its last.
                        let overlaps_keys =
                            run.last_key() >= start && walkable_from(run.first_key(), end);
                        if s.max_version < version_min
                            || s.min_version > version_max
                            || !overlaps_keys
                        {
                            continue;
                        }
                        // Blocks are in key order: from the one that may hold
                        // `start` to the last that begins within the range.
                        let blocks = run.blocks().iter().enumerate().skip(run.seek_block(start));
                        for (i, block) in blocks {
                            if !walkable_from(&block.first_key, end) {
                                break;
                            }
                            if block.max_version < version_min || block.min_version > version_max {
                                continue;
                            }
                            let records = run.read_block(i)?;
                            walk.blocks_read += 1;
                            found.extend(
                                records
                                    .into_iter()
                                    .filter(|r| {
                                        versions.contains(&r.version)
                                            && RangeBounds::<[u8]>::contains(&keys, r.key.as_ref())
                                    })
                                    .map(HistoryFound::Run),
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes of the run files, cheap enough for every request (a look at
    /// each layer; [`VersionStore::stats`] looks at every block).
    pub fn run_file_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.file_bytes)
            .fold(0, u64::saturating_add)
    }

    /// Every run of every layer.
    fn stored_runs(&self) -> impl Iterator<Item = &StoredRun<D>> {
        self.layers.iter().flat_map(|l| l.runs.iter())
    }

    /// Figures for status and tests.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            memtable_bytes: self.memtable.bytes,
            frozen_layers: self.frozen.len(),
            layers: self.layers.len(),
            runs: self.stored_runs().count(),
            run_file_bytes: self.run_file_bytes(),
            run_records: self.stored_runs().map(|r| r.run.summary().records).sum(),
            run_index_bytes: self.stored_runs().map(|r| r.run.index_bytes()).sum(),
            written_bytes: self.written_bytes,
            runs_moved: self.runs_moved,
        }
    }

    /// A consistent view of everything written so far, that later writes
    /// do not change (for a snapshot sent to a follower, a backup, a
    /// hash). Freezes the memtable at `marker`/`meta` (see
    /// [`VersionStore::freeze`]).
    pub fn view(&mut self, marker: u64, meta: Bytes) -> StoreView<D> {
        self.freeze(marker, meta.clone());
        StoreView {
            frozen: self.frozen.iter().map(|f| f.table.clone()).collect(),
            runs: self.run_handles(),
            marker,
            meta,
        }
    }

    /// The next job of `lane`, if one is due and none of that lane runs: a
    /// flush when something is frozen; a merge when the runs call for one.
    pub fn next_job(&mut self, lane: JobLane) -> Option<Job<D>> {
        match lane {
            JobLane::Flush if !self.flush_running && !self.frozen.is_empty() => {
                self.flush_running = true;
                Some(self.flush_job())
            }
            JobLane::Merge if !self.merge_running => {
                let job = self.merge_job()?;
                self.merge_running = true;
                Some(job)
            }
            JobLane::Flush | JobLane::Merge => None,
        }
    }

    fn take_run_id(&mut self) -> u64 {
        take_id(&self.next_run_id)
    }

    /// A job writing into `layer_id`, with the store's settings.
    fn job(
        &self,
        kind: JobKind<D>,
        layer_id: u64,
        bottom: bool,
        on_disk: Option<KeySpan>,
    ) -> Job<D> {
        Job {
            disk: self.disk.clone(),
            dir: self.dir.clone(),
            kind,
            layer_id,
            run_ids: self.next_run_id.clone(),
            options: self.options,
            bottom,
            floor: self.floor,
            on_disk,
        }
    }

    /// The lowest and highest key of the runs on disk, if any.
    fn key_span_on_disk(&self) -> Option<KeySpan> {
        let first = self
            .stored_runs()
            .map(|r| r.run.first_key())
            .filter(|k| !k.is_empty())
            .min()?;
        let last = self.stored_runs().map(|r| r.run.last_key()).max()?;
        Some(KeySpan {
            first: Bytes::copy_from_slice(first),
            last: Bytes::copy_from_slice(last),
        })
    }

    fn flush_job(&mut self) -> Job<D> {
        let newest = &self.frozen[0];
        let (marker, meta) = (newest.marker, newest.meta.clone());
        let sources = self.frozen.iter().map(|f| f.table.clone()).collect();
        let frozen_layers = self.frozen.len();
        // With a merge in flight the layers are not empty, so the flush is
        // never the bottom while one runs.
        let bottom = self.layers.is_empty();
        let kind = JobKind::Flush {
            sources,
            frozen_layers,
            marker,
            meta,
        };
        let layer_id = self.take_run_id();
        self.job(kind, layer_id, bottom, self.key_span_on_disk())
    }

    /// Asks for every run to be merged into one, dropping every version
    /// compaction removed and every delete marker below the floor (an
    /// operator's defragment: the space compaction freed comes back at
    /// once, not when the merge policy next reaches the oldest run). The
    /// merge lane does it once the runs are complete up to `after_marker`
    /// (the caller froze the memtable there, for it to be in the merge; a
    /// merge in flight finishes first); answers a ticket for
    /// [`VersionStore::full_merge_done`].
    pub fn request_full_merge(&mut self, after_marker: u64) -> u64 {
        self.full_merges_requested = self.full_merges_requested.saturating_add(1);
        self.full_merge_after_marker = self.full_merge_after_marker.max(after_marker);
        self.full_merges_requested
    }

    /// Whether a full merge that started after `ticket` was asked for
    /// has finished (or there was nothing on disk to merge).
    pub fn full_merge_done(&self, ticket: u64) -> bool {
        self.full_merges_done >= ticket
    }

    fn merge_job(&mut self) -> Option<Job<D>> {
        let flushed = self.flushed_marker >= self.full_merge_after_marker;
        if self.full_merges_requested > self.full_merges_done && flushed {
            if self.layers.is_empty() {
                self.full_merges_done = self.full_merges_requested;
            } else {
                self.full_merge_in_flight = Some(self.full_merges_requested);
                let kind = JobKind::Merge {
                    sources: self.layers.clone(),
                    rewrite_all: true,
                };
                let layer_id = self.take_run_id();
                return Some(self.job(kind, layer_id, true, None));
            }
        }
        // The longest series of newest layers in which each older layer is
        // no larger than `merge_ratio` times the newer ones together.
        let sizes: Vec<u64> = self.layers.iter().map(|l| l.file_bytes).collect();
        let mut newer = *sizes.first()?;
        let mut count = 1;
        for size in sizes.iter().skip(1) {
            if *size > newer.saturating_mul(self.options.merge_ratio) {
                break;
            }
            newer = newer.saturating_add(*size);
            count += 1;
        }
        if count < 2 {
            return None;
        }
        let sources = self.layers[..count].to_vec();
        let bottom = count == self.layers.len();
        let kind = JobKind::Merge {
            sources,
            rewrite_all: false,
        };
        let layer_id = self.take_run_id();
        Some(self.job(kind, layer_id, bottom, None))
    }

    /// Installs what a job of `lane` did in memory and returns the
    /// manifest write that makes it durable (to [`ManifestWrite::commit`]
    /// off the caller's lock, then to hand to
    /// [`VersionStore::manifest_written`]). On an error the store is as
    /// before the job (its file is removed at the next open) and the job
    /// may be handed out again.
    pub fn finish_job(
        &mut self,
        lane: JobLane,
        done: Result<JobDone<D>>,
    ) -> Result<ManifestWrite<D>> {
        match lane {
            JobLane::Flush => self.flush_running = false,
            JobLane::Merge => self.merge_running = false,
        }
        let full_merge = match lane {
            JobLane::Merge => self.full_merge_in_flight.take(),
            JobLane::Flush => None,
        };
        let done = done?;
        if let Some(ticket) = full_merge {
            self.full_merges_done = self.full_merges_done.max(ticket);
        }
        self.written_bytes = self.written_bytes.saturating_add(done.written_bytes);
        self.runs_moved = self.runs_moved.saturating_add(done.runs_moved);
        let mut retired = Vec::new();
        // What the store lets go of here is freed in `commit`, off the
        // caller's lock (see `ManifestWrite::released`).
        let mut released = Released::default();
        match done.kind {
            JobDoneKind::Flushed {
                frozen_layers,
                marker,
                meta,
            } => {
                let keep = self.frozen.len().saturating_sub(frozen_layers);
                released
                    .memtables
                    .extend(self.frozen.drain(keep..).map(|frozen| frozen.table));
                if let Some(layer) = done.layer {
                    self.layers.insert(0, layer);
                }
                self.flushed_marker = self.flushed_marker.max(marker);
                self.flushed_meta = meta;
            }
            JobDoneKind::Merged { sources } => {
                // Flushes may have put newer layers in front meanwhile; the
                // sources are still adjacent, oldest last.
                let first = self
                    .layers
                    .iter()
                    .position(|l| Some(&l.id) == sources.first());
                let in_place = first.is_some_and(|first| {
                    self.layers.len() >= first + sources.len()
                        && self.layers[first..first + sources.len()]
                            .iter()
                            .zip(&sources)
                            .all(|(layer, id)| layer.id == *id)
                });
                // The merge's runs, those it moved among them.
                let output_ids: Vec<u64> = done
                    .layer
                    .iter()
                    .flat_map(|l| l.runs.iter().map(|r| r.id))
                    .collect();
                let Some(first) = first.filter(|_| in_place) else {
                    debug_assert!(false, "a merge's sources are no longer in place");
                    if let Some(layer) = &done.layer {
                        // Remove what it wrote, not what it moved.
                        for run in &layer.runs {
                            if self.stored_runs().all(|r| r.id != run.id) {
                                let _ = self.disk.remove_file(run.run.path());
                            }
                        }
                    }
                    return Err(StorageError::Poisoned(
                        "a merge's sources are no longer in the store's shape".to_string(),
                    ));
                };
                let range = first..first + sources.len();
                let replaced: Vec<StoredLayer<D>> = match done.layer {
                    Some(layer) => self.layers.splice(range, [layer]).collect(),
                    None => self.layers.drain(range).collect(),
                };
                // A run moved into the new layer is not retired.
                retired = replaced
                    .iter()
                    .flat_map(|l| l.runs.iter())
                    .filter(|run| !output_ids.contains(&run.id))
                    .map(|r| r.run.path().to_path_buf())
                    .collect();
                released.runs = replaced
                    .into_iter()
                    .flat_map(|l| l.runs.into_iter().map(|r| r.run))
                    .collect();
            }
        }
        self.manifest_seq_built += 1;
        Ok(ManifestWrite {
            disk: self.disk.clone(),
            dir: self.dir.clone(),
            seq: self.manifest_seq_built,
            manifest: Manifest {
                marker: self.flushed_marker,
                floor: self.floor,
                next_run_id: self.next_run_id.load(Ordering::SeqCst),
                meta: self.flushed_meta.clone(),
                runs: self
                    .layers
                    .iter()
                    .flat_map(|layer| {
                        layer.runs.iter().map(|r| RunEntry {
                            layer: layer.id,
                            id: r.id,
                            summary: r.run.summary(),
                        })
                    })
                    .collect(),
            },
            runs: self.run_handles(),
            retired,
            released,
            written: self.manifest_seq_written.clone(),
        })
    }

    /// Records that a manifest is on disk: the durable marker moves to its
    /// marker (an older one than that on record changes nothing).
    ///
    /// Returns the durable view it replaced (or the one it did not take):
    /// drop it after releasing the lock the store is kept under. It may
    /// hold the last handles of runs a merge retired, and closing a large
    /// deleted file frees its blocks, which can keep a filesystem busy for
    /// a second (a member whose apply waited that long behind the lock
    /// sent its peers nothing for an election timeout).
    pub fn manifest_written(&mut self, written: ManifestWritten<D>) -> StoreView<D> {
        self.written_bytes = self.written_bytes.saturating_add(written.written_bytes);
        if written.seq <= self.manifest_seq {
            return written.view;
        }
        self.manifest_seq = written.seq;
        std::mem::replace(&mut self.durable_view, written.view)
    }

    /// Runs every job due, in both lanes, one after another on this thread,
    /// and makes the result durable (a store copied in whole, tests).
    pub fn run_jobs_now(&mut self) -> Result<()> {
        loop {
            let job = match self.next_job(JobLane::Flush) {
                Some(job) => job,
                None => match self.next_job(JobLane::Merge) {
                    Some(job) => job,
                    None => return Ok(()),
                },
            };
            let lane = job.lane();
            let done = job.run();
            let write = self.finish_job(lane, done)?;
            let written = write.commit()?;
            drop(self.manifest_written(written));
        }
    }

    /// The state at the durable point: the runs the manifest on disk
    /// names, its marker and meta. Unlike [`VersionStore::view`] it takes
    /// nothing written since, so a copy of it holds exactly what a reopen
    /// would find.
    pub fn durable_view(&self) -> StoreView<D> {
        self.durable_view.clone()
    }
}

/// A consistent, immutable view of a store (see [`VersionStore::view`]).
#[derive(Debug, Clone)]
pub struct StoreView<D: Disk> {
    frozen: Vec<Arc<Memtable>>,
    runs: Vec<RunLayer<D>>,
    marker: u64,
    meta: Bytes,
}

impl<D: Disk> StoreView<D> {
    /// The state a manifest on disk stands for: its runs, nothing frozen.
    fn of_manifest(manifest: &Manifest, runs: Vec<RunLayer<D>>) -> StoreView<D> {
        StoreView {
            frozen: Vec::new(),
            runs,
            marker: manifest.marker,
            meta: manifest.meta.clone(),
        }
    }

    /// Every version in `[start, end)` in (key, version) order.
    pub fn iter<'a>(&'a self, start: &[u8], end: Bound<&[u8]>) -> VersionIter<'a, D> {
        let layers = self
            .frozen
            .iter()
            .map(|t| Layer::Mem(t.as_ref()))
            .chain(self.runs.iter().map(|layer| Layer::Runs(layer)))
            .collect();
        VersionIter::new(layers, start, end)
    }

    /// The marker the view was taken at.
    pub fn marker(&self) -> u64 {
        self.marker
    }

    /// The caller's state at the marker.
    pub fn meta(&self) -> &Bytes {
        &self.meta
    }
}

/// The versions of a key range as they were when the view was taken
/// (see [`VersionStore::range_view`]).
#[derive(Debug, Clone)]
pub struct RangeView<D: Disk> {
    view: StoreView<D>,
    start: Vec<u8>,
    /// The range's end, or just after the cut.
    end: Bound<Vec<u8>>,
    cut: Option<Bytes>,
}

impl<D: Disk> RangeView<D> {
    /// Every version the view holds, in (key, version) order.
    pub fn iter(&self) -> VersionIter<'_, D> {
        self.view
            .iter(&self.start, self.end.as_ref().map(Vec::as_slice))
    }

    /// The last key the view covers when it covers only part of the range
    /// asked for: the rest, after this key, needs another view.
    pub fn cut(&self) -> Option<&[u8]> {
        self.cut.as_deref()
    }
}

enum JobKind<D: Disk> {
    Flush {
        sources: Vec<Arc<Memtable>>,
        frozen_layers: usize,
        /// The marker and meta of the newest frozen layer: the durable
        /// point once the flush's manifest is written.
        marker: u64,
        meta: Bytes,
    },
    Merge {
        /// Newest first.
        sources: Vec<StoredLayer<D>>,
        /// Rewrite every run, moving none (a full merge).
        rewrite_all: bool,
    },
}

/// A flush or a merge, to run on a blocking thread (see the module docs).
pub struct Job<D: Disk> {
    disk: D,
    dir: PathBuf,
    kind: JobKind<D>,
    /// The id of the layer it makes.
    layer_id: u64,
    /// Where the ids of the runs it writes come from.
    run_ids: Arc<AtomicU64>,
    options: VersionStoreOptions,
    /// Whether the output is the oldest layer (tombstones may go).
    bottom: bool,
    floor: u64,
    /// For a flush, the lowest and highest key on disk when it was handed
    /// out (see [`KeySpan`]).
    on_disk: Option<KeySpan>,
}

/// The lowest and highest key of the runs on disk. A flush cuts its output
/// where it crosses either, so that keys written past everything on disk
/// (a fill in key order, time-ordered keys) make a run of their own, which
/// a merge can move, apart from the few keys written out of order with
/// them (256 clients putting keys in order put them a few hundred apart)
/// that do overlap older runs and are merged with them.
#[derive(Debug, Clone)]
struct KeySpan {
    first: Bytes,
    last: Bytes,
}

impl KeySpan {
    /// 0 below the span, 1 in it, 2 above it.
    fn region(&self, key: &[u8]) -> u8 {
        if key < self.first.as_ref() {
            0
        } else if key <= self.last.as_ref() {
            1
        } else {
            2
        }
    }
}

impl<D: Disk> std::fmt::Debug for Job<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("lane", &self.lane())
            .field("layer_id", &self.layer_id)
            .finish_non_exhaustive()
    }
}

enum JobDoneKind {
    Flushed {
        frozen_layers: usize,
        marker: u64,
        meta: Bytes,
    },
    Merged {
        /// The ids of the layers merged, newest first.
        sources: Vec<u64>,
    },
}

/// What a finished job hands back to [`VersionStore::finish_job`].
pub struct JobDone<D: Disk> {
    kind: JobDoneKind,
    /// The layer made; none when nothing was left (everything shadowed).
    layer: Option<StoredLayer<D>>,
    written_bytes: u64,
    runs_moved: u64,
}

impl<D: Disk> std::fmt::Debug for JobDone<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobDone")
            .field("layer", &self.layer.as_ref().map(|l| l.id))
            .field("written_bytes", &self.written_bytes)
            .field("runs_moved", &self.runs_moved)
            .finish_non_exhaustive()
    }
}

/// What a merge does with a part of its sources' key space.
enum MergePart<'a, D: Disk> {
    /// A run that overlaps no other: into the new layer as it is.
    Move(&'a StoredRun<D>),
    /// Runs rewritten together (in key order; some may overlap).
    Rewrite(Vec<&'a StoredRun<D>>),
}

/// Splits the runs of a merge's sources into parts, in key order: each
/// set of runs whose key ranges overlap (directly or through others) is
/// rewritten; a run that overlaps none is moved, unless `rewrite_all` or
/// it is smaller than `move_min` (then it is rewritten with the
/// neighbouring parts that are rewritten anyway).
fn merge_parts<'a, D: Disk>(
    sources: &'a [StoredLayer<D>],
    rewrite_all: bool,
    move_min: u64,
) -> Vec<MergePart<'a, D>> {
    let mut runs: Vec<&StoredRun<D>> = sources.iter().flat_map(|l| l.runs.iter()).collect();
    runs.sort_by(|a, b| a.run.first_key().cmp(b.run.first_key()));
    let mut parts = Vec::new();
    let mut rewrite: Vec<&StoredRun<D>> = Vec::new();
    let mut i = 0;
    while i < runs.len() {
        // The runs overlapping runs[i], transitively.
        let mut end = i + 1;
        let mut last_key = runs[i].run.last_key();
        while end < runs.len() && runs[end].run.first_key() <= last_key {
            last_key = last_key.max(runs[end].run.last_key());
            end += 1;
        }
        let alone = end == i + 1;
        if alone && !rewrite_all && runs[i].run.summary().file_bytes >= move_min {
            if !rewrite.is_empty() {
                parts.push(MergePart::Rewrite(std::mem::take(&mut rewrite)));
            }
            parts.push(MergePart::Move(runs[i]));
        } else {
            rewrite.extend_from_slice(&runs[i..end]);
        }
        i = end;
    }
    if !rewrite.is_empty() {
        parts.push(MergePart::Rewrite(rewrite));
    }
    parts
}

impl<D: Disk> Job<D> {
    /// The lane the job runs in.
    pub fn lane(&self) -> JobLane {
        match self.kind {
            JobKind::Flush { .. } => JobLane::Flush,
            JobKind::Merge { .. } => JobLane::Merge,
        }
    }

    /// Writes the output runs, durably (synced and renamed; the renames
    /// are made durable by the next manifest's directory sync).
    pub fn run(self) -> Result<JobDone<D>> {
        let mut writer = SplitWriter::new(
            self.disk.clone(),
            self.dir.clone(),
            self.run_ids.clone(),
            self.options.run_bytes_target,
        );
        writer.cut_at = self.on_disk.clone();
        let (floor, bottom) = (self.floor, self.bottom);
        let mut runs_moved = 0u64;
        match &self.kind {
            JobKind::Flush { sources, .. } => {
                let layers: Vec<Layer<'_, D>> =
                    sources.iter().map(|t| Layer::Mem(t.as_ref())).collect();
                let records = VersionIter::new(layers, &[], Bound::Unbounded);
                writer.write_all(records, floor, bottom)?;
            }
            JobKind::Merge {
                sources,
                rewrite_all,
            } => {
                let parts = merge_parts(sources, *rewrite_all, self.options.run_bytes_move_min);
                for part in parts {
                    match part {
                        MergePart::Move(run) => {
                            writer.keep(run.clone())?;
                            runs_moved += 1;
                        }
                        MergePart::Rewrite(runs) => {
                            let layers = runs
                                .iter()
                                .map(|r| Layer::Runs(std::slice::from_ref(&r.run)))
                                .collect();
                            let records = VersionIter::new(layers, &[], Bound::Unbounded);
                            writer.write_all(records, floor, bottom)?;
                            // The next part's keys are past this one's.
                            writer.finish_run()?;
                        }
                    }
                }
            }
        }
        let (runs, written_bytes) = writer.finish()?;
        let layer = (!runs.is_empty()).then(|| StoredLayer::new(self.layer_id, runs));
        let kind = match self.kind {
            JobKind::Flush {
                frozen_layers,
                marker,
                meta,
                ..
            } => JobDoneKind::Flushed {
                frozen_layers,
                marker,
                meta,
            },
            JobKind::Merge { sources, .. } => JobDoneKind::Merged {
                sources: sources.iter().map(|l| l.id).collect(),
            },
        };
        Ok(JobDone {
            kind,
            layer,
            written_bytes,
            runs_moved,
        })
    }
}

/// Takes the next id from a store's counter.
fn take_id(ids: &AtomicU64) -> u64 {
    ids.fetch_add(1, Ordering::SeqCst)
}

/// Writes records in (key, version) order into runs of one layer, cutting
/// a run at the first key boundary past the target size.
struct SplitWriter<D: Disk> {
    disk: D,
    dir: PathBuf,
    ids: Arc<AtomicU64>,
    bytes_target: u64,
    /// Keys where a run is cut whatever its size (see [`KeySpan`]).
    cut_at: Option<KeySpan>,
    /// The run being written: its id and writer.
    current: Option<(u64, RunWriter<D>)>,
    /// The key last written, for cutting at a key boundary only.
    last_key: Option<Bytes>,
    /// The runs finished, in key order.
    done: Vec<StoredRun<D>>,
    written_bytes: u64,
}

impl<D: Disk> SplitWriter<D> {
    fn new(disk: D, dir: PathBuf, ids: Arc<AtomicU64>, bytes_target: u64) -> Self {
        SplitWriter {
            disk,
            dir,
            ids,
            bytes_target,
            cut_at: None,
            current: None,
            last_key: None,
            done: Vec::new(),
            written_bytes: 0,
        }
    }

    /// Appends one record.
    fn push(&mut self, record: &Record) -> Result<()> {
        let new_key = self.last_key.as_ref() != Some(&record.key);
        let full = self
            .current
            .as_ref()
            .is_some_and(|(_, w)| w.bytes_written() >= self.bytes_target);
        let crosses = match (&self.cut_at, &self.last_key) {
            (Some(span), Some(last)) => span.region(last) != span.region(&record.key),
            (Some(_), None) | (None, _) => false,
        };
        if new_key && (full || crosses) {
            self.finish_run()?;
        }
        if self.current.is_none() {
            let id = take_id(&self.ids);
            let tmp = self.dir.join(format!("{}.tmp", run_file_name(id)));
            self.current = Some((id, RunWriter::create(&self.disk, &tmp)?));
        }
        if let Some((_, writer)) = &mut self.current {
            writer.push(record)?;
        }
        if new_key {
            self.last_key = Some(record.key.clone());
        }
        Ok(())
    }

    /// Writes every record of `records` that `floor` leaves (see
    /// [`shadowed`]), one key at a time.
    fn write_all(
        &mut self,
        records: impl Iterator<Item = Result<Record>>,
        floor: u64,
        bottom: bool,
    ) -> Result<()> {
        let mut pending: Vec<Record> = Vec::new();
        for record in records {
            let record = record?;
            if pending.first().is_some_and(|first| first.key != record.key) {
                self.write_key(&mut pending, floor, bottom)?;
            }
            pending.push(record);
        }
        self.write_key(&mut pending, floor, bottom)
    }

    fn write_key(&mut self, versions: &mut Vec<Record>, floor: u64, bottom: bool) -> Result<()> {
        let dropped = shadowed(versions, floor, bottom, |r| (r.version, r.tombstone));
        for record in &versions[dropped..] {
            self.push(record)?;
        }
        versions.clear();
        Ok(())
    }

    /// Puts a run already on disk into the layer as it is, after what was
    /// written so far (its keys must come after theirs).
    fn keep(&mut self, run: StoredRun<D>) -> Result<()> {
        self.finish_run()?;
        self.done.push(run);
        Ok(())
    }

    /// Finishes the run being written, if any: synced, renamed, opened.
    fn finish_run(&mut self) -> Result<()> {
        let Some((id, writer)) = self.current.take() else {
            return Ok(());
        };
        let name = run_file_name(id);
        let tmp = self.dir.join(format!("{name}.tmp"));
        let summary = writer.finish()?;
        self.written_bytes = self.written_bytes.saturating_add(summary.file_bytes);
        if summary.records == 0 {
            let _ = self.disk.remove_file(&tmp);
            return Ok(());
        }
        let path = self.dir.join(&name);
        self.disk
            .rename(&tmp, &path)
            .map_err(|e| StorageError::io("rename run", &path, e))?;
        self.done.push(StoredRun {
            id,
            run: Run::open(&self.disk, &path)?,
        });
        Ok(())
    }

    /// Finishes the last run; the runs, in key order, and the bytes
    /// written.
    fn finish(mut self) -> Result<(Vec<StoredRun<D>>, u64)> {
        self.finish_run()?;
        Ok((self.done, self.written_bytes))
    }
}

/// A manifest to write (see [`VersionStore::finish_job`]): the store's
/// whole shape when a job was installed.
pub struct ManifestWrite<D: Disk> {
    disk: D,
    dir: PathBuf,
    seq: u64,
    manifest: Manifest,
    /// The runs it names, for the durable view.
    runs: Vec<RunLayer<D>>,
    /// Run files no longer in the shape, deleted once a manifest without
    /// them is on disk.
    retired: Vec<PathBuf>,
    /// What the job made the store let go of, freed by `commit`.
    released: Released<D>,
    written: Arc<Mutex<u64>>,
}

/// Handles a job made the store let go of: frozen memtables it flushed
/// (megabytes to free) and runs it merged away (whose last handle closes a
/// deleted file, and closing a large deleted file frees its blocks: slow).
/// Held by the [`ManifestWrite`], which is committed off the lock the store
/// is kept under, so that neither is freed under it.
struct Released<D: Disk> {
    memtables: Vec<Arc<Memtable>>,
    runs: Vec<Arc<Run<D>>>,
}

impl<D: Disk> Default for Released<D> {
    fn default() -> Self {
        Released {
            memtables: Vec::new(),
            runs: Vec::new(),
        }
    }
}

impl<D: Disk> std::fmt::Debug for ManifestWrite<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManifestWrite")
            .field("seq", &self.seq)
            .field("marker", &self.manifest.marker)
            .finish_non_exhaustive()
    }
}

/// A manifest on disk, for [`VersionStore::manifest_written`].
pub struct ManifestWritten<D: Disk> {
    seq: u64,
    /// The state the manifest stands for.
    view: StoreView<D>,
    written_bytes: u64,
}

impl<D: Disk> std::fmt::Debug for ManifestWritten<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManifestWritten")
            .field("seq", &self.seq)
            .field("marker", &self.view.marker)
            .finish_non_exhaustive()
    }
}

impl<D: Disk> ManifestWrite<D> {
    /// The marker the store is durable at once this is written.
    pub fn marker(&self) -> u64 {
        self.manifest.marker
    }

    /// Writes the manifest durably, unless a newer one was written already
    /// (it holds all this one does), then deletes the retired runs.
    /// Readers that hold a retired run keep their handle to it.
    pub fn commit(self) -> Result<ManifestWritten<D>> {
        let mut written_bytes = 0;
        {
            let mut last = self
                .written
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if *last < self.seq {
                written_bytes = self.manifest.write(&self.disk, &self.dir)?;
                *last = self.seq;
            }
        }
        for path in &self.retired {
            let _ = self.disk.remove_file(path);
        }
        // Freed here, off the store's lock.
        drop(self.released);
        Ok(ManifestWritten {
            seq: self.seq,
            view: StoreView::of_manifest(&self.manifest, self.runs),
            written_bytes,
        })
    }
}

/// How many of one key's versions (ascending) a floor drops: those below
/// the newest at or below `floor` (reads at the floor still see that one;
/// nobody reads the ones below it), and that newest one too if it is a
/// tombstone and `bottom` says no older layer may hold a version it hides.
fn shadowed<T>(
    versions: &[T],
    floor: u64,
    bottom: bool,
    fields: impl Fn(&T) -> (u64, bool),
) -> usize {
    let Some(newest) = versions.iter().rposition(|v| fields(v).0 <= floor) else {
        return 0;
    };
    if bottom && fields(&versions[newest]).1 {
        newest + 1
    } else {
        newest
    }
}

/// A cursor over one layer.
enum Cursor<'a, D: Disk> {
    Mem {
        keys: std::collections::btree_map::Range<'a, Bytes, Vec<MemVersion>>,
        current: Option<(&'a Bytes, &'a [MemVersion])>,
        at: usize,
    },
    /// The runs of a layer on disk, one after another.
    Runs {
        runs: &'a [Arc<Run<D>>],
        /// The run being read, and the next block of it to read.
        run: usize,
        block: usize,
        records: std::vec::IntoIter<Record>,
        done: bool,
    },
}

impl<'a, D: Disk> Cursor<'a, D> {
    fn next(&mut self, start: &[u8]) -> Option<Result<Record>> {
        match self {
            Cursor::Mem { keys, current, at } => loop {
                if let Some((key, versions)) = current {
                    if let Some(v) = versions.get(*at) {
                        *at += 1;
                        return Some(Ok(v.record(key)));
                    }
                }
                let (key, versions) = keys.next()?;
                *current = Some((key, versions.as_slice()));
                *at = 0;
            },
            Cursor::Runs {
                runs,
                run,
                block,
                records,
                done,
            } => loop {
                if let Some(record) = records.next() {
                    if record.key.as_ref() < start {
                        continue;
                    }
                    return Some(Ok(record));
                }
                if *done {
                    return None;
                }
                let Some(current) = runs.get(*run) else {
                    *done = true;
                    return None;
                };
                if *block >= current.blocks().len() {
                    *run += 1;
                    *block = 0;
                    continue;
                }
                match current.read_block(*block) {
                    Ok(loaded) => {
                        *records = loaded.into_iter();
                        *block += 1;
                    }
                    Err(e) => {
                        *done = true;
                        return Some(Err(e));
                    }
                }
            },
        }
    }
}

/// Every version of a key range across layers, in (key, version) order.
pub struct VersionIter<'a, D: Disk> {
    cursors: Vec<Cursor<'a, D>>,
    heads: Vec<Option<Record>>,
    primed: bool,
    start: Vec<u8>,
    end: Bound<Vec<u8>>,
    /// An error met while refilling, given out by the next call.
    error: Option<StorageError>,
    failed: bool,
}

impl<'a, D: Disk> VersionIter<'a, D> {
    fn new(layers: Vec<Layer<'a, D>>, start: &[u8], end: Bound<&[u8]>) -> VersionIter<'a, D> {
        let end_owned = match end {
            Bound::Included(k) => Bound::Included(k.to_vec()),
            Bound::Excluded(k) => Bound::Excluded(k.to_vec()),
            Bound::Unbounded => Bound::Unbounded,
        };
        // An empty interval simply has no cursors.
        let cursors: Vec<Cursor<'a, D>> = if !walkable_from(start, end) {
            Vec::new()
        } else {
            layers
                .into_iter()
                .map(|layer| match layer {
                    Layer::Mem(table) => Cursor::Mem {
                        keys: table.keys.range::<[u8], _>((Bound::Included(start), end)),
                        current: None,
                        at: 0,
                    },
                    Layer::Runs(runs) => {
                        // The first run that may hold a key at or past
                        // `start`.
                        let run = runs.partition_point(|r| r.last_key() < start);
                        Cursor::Runs {
                            block: runs.get(run).map_or(0, |r| r.seek_block(start)),
                            runs,
                            run,
                            records: Vec::new().into_iter(),
                            done: false,
                        }
                    }
                })
                .collect()
        };
        VersionIter {
            heads: cursors.iter().map(|_| None).collect(),
            cursors,
            primed: false,
            start: start.to_vec(),
            end: end_owned,
            error: None,
            failed: false,
        }
    }

    fn before_end(&self, key: &[u8]) -> bool {
        match &self.end {
            Bound::Included(end) => key <= end.as_slice(),
            Bound::Excluded(end) => key < end.as_slice(),
            Bound::Unbounded => true,
        }
    }

    /// The next record of cursor `i` inside the range.
    fn advance(&mut self, i: usize) -> Result<Option<Record>> {
        match self.cursors[i].next(&self.start) {
            None => Ok(None),
            Some(Err(e)) => Err(e),
            Some(Ok(record)) if self.before_end(&record.key) => Ok(Some(record)),
            Some(Ok(_)) => {
                // Past the end: this cursor is done.
                if let Cursor::Runs { done, .. } = &mut self.cursors[i] {
                    *done = true;
                }
                Ok(None)
            }
        }
    }
}

impl<D: Disk> Iterator for VersionIter<'_, D> {
    type Item = Result<Record>;

    fn next(&mut self) -> Option<Result<Record>> {
        if let Some(error) = self.error.take() {
            self.failed = true;
            return Some(Err(error));
        }
        if self.failed {
            return None;
        }
        if !self.primed {
            self.primed = true;
            for i in 0..self.cursors.len() {
                match self.advance(i) {
                    Ok(head) => self.heads[i] = head,
                    Err(e) => {
                        self.failed = true;
                        return Some(Err(e));
                    }
                }
            }
        }
        let mut best: Option<usize> = None;
        for (i, head) in self.heads.iter().enumerate() {
            let Some(record) = head else { continue };
            let better = match best.and_then(|b| self.heads[b].as_ref()) {
                None => true,
                Some(current) => {
                    (record.key.as_ref(), record.version) < (current.key.as_ref(), current.version)
                }
            };
            if better {
                best = Some(i);
            }
        }
        let i = best?;
        let record = self.heads[i].take()?;
        match self.advance(i) {
            Ok(head) => self.heads[i] = head,
            Err(e) => self.error = Some(e),
        }
        Some(Ok(record))
    }
}

#[cfg(test)]
mod tests;

/// A store written in one pass from records already in (key, version)
/// order, such as a whole state received from a leader: one run and a
/// manifest, in a directory that holds no store yet. It takes the memory
/// of one block and the run's index, whatever the size of the data.
pub struct BulkLoad<D: Disk> {
    disk: D,
    dir: PathBuf,
    writer: SplitWriter<D>,
}

impl<D: Disk> std::fmt::Debug for BulkLoad<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BulkLoad")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl<D: Disk> BulkLoad<D> {
    /// Starts loading into `dir` (created if need be), which must hold no
    /// manifest: a store there is never overwritten. The records go into
    /// one layer of runs cut at [`RUN_BYTES_TARGET`].
    pub fn create(disk: D, dir: &Path) -> Result<BulkLoad<D>> {
        crate::disk::create_dir_durably(&disk, dir)?;
        if Manifest::read(&disk, dir)?.is_some() {
            return Err(StorageError::io(
                "bulk load into",
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the directory holds a store already",
                ),
            ));
        }
        let writer = SplitWriter::new(
            disk.clone(),
            dir.to_path_buf(),
            Arc::new(AtomicU64::new(1)),
            RUN_BYTES_TARGET,
        );
        Ok(BulkLoad {
            disk,
            dir: dir.to_path_buf(),
            writer,
        })
    }

    /// Appends one record; records must come in strictly increasing (key,
    /// version) order.
    pub fn push(&mut self, record: &Record) -> Result<()> {
        self.writer.push(record)
    }

    /// Syncs the runs and writes the manifest: the store then opens at
    /// `marker`, with `meta` and `floor`, holding every record pushed.
    /// Returns the bytes written.
    pub fn finish(self, marker: u64, meta: Bytes, floor: u64) -> Result<u64> {
        let ids = self.writer.ids.clone();
        let (runs, written_bytes) = self.writer.finish()?;
        let layer = take_id(&ids);
        let manifest = Manifest {
            marker,
            floor,
            next_run_id: ids.load(Ordering::SeqCst),
            meta,
            runs: runs
                .iter()
                .map(|r| RunEntry {
                    layer,
                    id: r.id,
                    summary: r.run.summary(),
                })
                .collect(),
        };
        // The renames are made durable by the manifest's directory sync.
        Ok(written_bytes.saturating_add(manifest.write(&self.disk, &self.dir)?))
    }
}
