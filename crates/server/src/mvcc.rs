//! Multi-version key-value store with etcd's revision model.
//!
//! One revision counter for the whole store: every write transaction that
//! changes something advances it by one, and every key remembers the
//! revision it was created at (`create_revision`), last modified at
//! (`mod_revision`) and how often it changed since (`version`). Old versions
//! stay readable until a compaction removes them. A delete leaves a
//! tombstone so that reads at older revisions and watchers replaying history
//! see it. The store is deterministic: the same writes give the same state.

use std::collections::HashMap;
use std::ops::Bound;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use ferry_storage::versions::{
    JobLane, ManifestWrite, ManifestWritten, RangeView, Record, StoreView, VersionStore,
    VersionStoreOptions,
};
use ferry_storage::AnyDisk;

use crate::error::KvError;
use crate::pb::etcdserverpb::range_request::{SortOrder, SortTarget};
use crate::pb::etcdserverpb::{RangeRequest, RangeResponse};
use crate::pb::mvccpb::{event::EventType, Event, KeyValue};

/// One stored version of a key.
///
/// Cloning a version is cheap: the key-value is shared, never changed in
/// place (a write adds a new version). That is what lets the driver take
/// the store's contents for a snapshot in O(versions) pointer copies and
/// leave the encoding of the (possibly hundreds of MB of) data to a
/// blocking thread, while applies go on changing the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// The key-value as a reader sees it; for a tombstone only `key` and
    /// `mod_revision` are set.
    pub kv: Arc<KeyValue>,
    /// Position of the change inside its revision, to replay a txn's events
    /// in the order its operations ran.
    pub sub_revision: u32,
    /// True when this version records a delete.
    pub tombstone: bool,
}

/// The revision a read should observe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadAt {
    /// The newest state, including changes made by the write transaction in
    /// progress (a txn's later operations see its earlier writes).
    Latest,
    /// A committed revision, checked against compaction and the present.
    Revision(i64),
}

/// The key interval selected by etcd's (key, range_end) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRange {
    /// First key, inclusive.
    pub start: Vec<u8>,
    /// End of the interval.
    pub end: RangeEnd,
}

/// Where a key interval ends.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum RangeEnd {
    /// Only `start` itself (etcd: empty range_end).
    Single,
    /// Every key >= start (etcd: range_end "\0").
    Unbounded,
    /// Keys strictly below this one.
    Before(Vec<u8>),
}

impl KeyRange {
    /// Interprets etcd's (key, range_end) pair.
    pub fn new(key: &[u8], range_end: &[u8]) -> KeyRange {
        let end = if range_end.is_empty() {
            RangeEnd::Single
        } else if range_end == [0] {
            RangeEnd::Unbounded
        } else {
            RangeEnd::Before(range_end.to_vec())
        };
        KeyRange {
            start: key.to_vec(),
            end,
        }
    }

    /// True when `key` lies in the interval.
    pub fn contains(&self, key: &[u8]) -> bool {
        match &self.end {
            RangeEnd::Single => key == self.start.as_slice(),
            RangeEnd::Unbounded => key >= self.start.as_slice(),
            RangeEnd::Before(end) => key >= self.start.as_slice() && key < end.as_slice(),
        }
    }

    /// Bounds for a `BTreeMap::range` walk; `None` when the interval is empty
    /// (range_end <= key), which `BTreeMap::range` would reject.
    fn bounds(&self) -> Option<KeyBounds<'_>> {
        match &self.end {
            RangeEnd::Single => Some((
                Bound::Included(self.start.as_slice()),
                Bound::Included(self.start.as_slice()),
            )),
            RangeEnd::Unbounded => Some((Bound::Included(self.start.as_slice()), Bound::Unbounded)),
            RangeEnd::Before(end) => {
                if end.as_slice() <= self.start.as_slice() {
                    None
                } else {
                    Some((
                        Bound::Included(self.start.as_slice()),
                        Bound::Excluded(end.as_slice()),
                    ))
                }
            }
        }
    }
}

/// Lower and upper bound of a key interval, for `BTreeMap::range`.
type KeyBounds<'a> = (Bound<&'a [u8]>, Bound<&'a [u8]>);

/// Whether `BTreeMap::range` takes these bounds: it panics when the start
/// lies after the end, or on one key excluded at both ends.
fn walkable(lower: Bound<&[u8]>, upper: Bound<&[u8]>) -> bool {
    match (lower, upper) {
        (Bound::Unbounded, _) | (_, Bound::Unbounded) => true,
        (Bound::Included(low), Bound::Included(high))
        | (Bound::Included(low), Bound::Excluded(high))
        | (Bound::Excluded(low), Bound::Included(high)) => low <= high,
        (Bound::Excluded(low), Bound::Excluded(high)) => low < high,
    }
}

/// The multi-version store: every version of every key in a
/// [`VersionStore`], keyed by (key, mod revision), the value holding the
/// rest of the key-value (see [`encode_version`]).
///
/// A key has at most one version per revision (a txn writes a key once),
/// so the revision alone orders a key's versions; the sub-revision (the
/// order of the operations in a txn) rides in the value.
///
/// Compaction sets the version store's floor one below the compacted
/// revision: the version store keeps the newest version at or below the
/// floor, which is exactly the version a change at the compacted revision
/// replaced (a watch from there needs it for its prev_kv). What compaction
/// removes goes from memory at once and from the disk in the version
/// store's merges; everything that reads the store as a whole (snapshots,
/// hashes) sees it as compaction left it, whatever the merges did so far
/// (see [`MvccStore::compacted_view`]).
#[derive(Debug)]
pub struct MvccStore {
    versions: VersionStore<AnyDisk>,
    /// The newest committed revision. Starts at 1 as in etcd, so the first
    /// write of a fresh store is revision 2.
    revision: i64,
    /// Reads below this revision fail; 0 when nothing was compacted.
    compacted_revision: i64,
}

impl Default for MvccStore {
    fn default() -> Self {
        MvccStore::new()
    }
}

impl Clone for MvccStore {
    /// A copy in memory of everything the store holds (for tests that
    /// compare a state before and after).
    fn clone(&self) -> Self {
        let mut copy = MvccStore::new();
        copy.revision = self.revision;
        copy.compacted_revision = self.compacted_revision;
        copy.versions.set_floor(self.versions_floor());
        for record in self.versions.iter(&[], Bound::Unbounded) {
            match record {
                Ok(record) => {
                    let _ = copy.versions.put(record);
                }
                Err(error) => {
                    tracing::error!(%error, "cannot copy the store");
                    break;
                }
            }
        }
        copy
    }
}

impl PartialEq for MvccStore {
    /// Equal when both hold the same versions as compaction left them.
    fn eq(&self, other: &Self) -> bool {
        self.revision == other.revision
            && self.compacted_revision == other.compacted_revision
            && self.compacted_view().ok() == other.compacted_view().ok()
    }
}

impl Eq for MvccStore {}

/// Where the in-memory store's version store lives on its simulated disk.
const IN_MEMORY_DIR: &str = "/kv";

/// The version-store version of a revision (revisions are at least 1).
fn version_of(revision: i64) -> u64 {
    u64::try_from(revision).unwrap_or(0)
}

/// The compaction floor of the version store for a compacted revision:
/// versions below it that a newer one at or below it shadows may go.
pub fn versions_floor_of(compacted_revision: i64) -> u64 {
    version_of(compacted_revision).saturating_sub(1)
}

/// The version store's record of a stored version.
pub fn record_of(version: &Version) -> Record {
    Record {
        key: Bytes::copy_from_slice(&version.kv.key),
        version: version_of(version.kv.mod_revision),
        tombstone: version.tombstone,
        value: encode_version(version.sub_revision, &version.kv),
    }
}

/// The highest revision a snapshot or a store on disk may stand at: 2^62,
/// more writes than any store makes in its life, with room above it so
/// that the next revision (and a key's next version, which is never above
/// its revision) cannot wrap. A snapshot that claims more is damaged or
/// forged, and refused before anything is applied on top of it.
pub const REVISION_MAX: i64 = 1 << 62;

/// Checks that a store's revision and compaction fit together.
pub fn check_positions(revision: i64, compacted_revision: i64) -> Result<(), String> {
    if !(1..=REVISION_MAX).contains(&revision) || !(0..=revision).contains(&compacted_revision) {
        return Err(format!(
            "revision {revision} and compacted revision {compacted_revision} do not fit"
        ));
    }
    Ok(())
}

/// Checks the versions a snapshot brings as they arrive, in store order:
/// keys not empty and in order, each key's versions in revision order,
/// revisions from 1 up to the snapshot's revision (known only at the end
/// when the versions are streamed: see [`SnapshotVersionCheck::finish`]).
#[derive(Debug, Default)]
pub struct SnapshotVersionCheck {
    last: Option<(Vec<u8>, i64)>,
    revision_max: i64,
}

impl SnapshotVersionCheck {
    /// Checks the next version; its record for the version store.
    pub fn check(&mut self, version: &Version) -> Result<Record, String> {
        let kv = &version.kv;
        if kv.key.is_empty() {
            return Err("a stored version has an empty key".to_string());
        }
        if kv.mod_revision < 1 {
            return Err(format!(
                "version of key {:?} has revision {}",
                String::from_utf8_lossy(&kv.key),
                kv.mod_revision
            ));
        }
        // A key is created at or before each of its revisions, and puts
        // it at most once per revision: its version and creation are never
        // above the revision (which keeps its next version from wrapping).
        if !(0..=kv.mod_revision).contains(&kv.version)
            || !(0..=kv.mod_revision).contains(&kv.create_revision)
        {
            return Err(format!(
                "version {} of key {:?}, created at {}, does not fit its revision {}",
                kv.version,
                String::from_utf8_lossy(&kv.key),
                kv.create_revision,
                kv.mod_revision
            ));
        }
        if let Some((last_key, last_revision)) = &self.last {
            let ordered =
                (last_key.as_slice(), *last_revision) < (kv.key.as_ref(), kv.mod_revision);
            if last_key.as_slice() == kv.key.as_ref() && !ordered {
                return Err(format!(
                    "versions of key {:?} are not in revision order",
                    String::from_utf8_lossy(&kv.key)
                ));
            }
            if !ordered {
                return Err(format!(
                    "key {:?} is out of key order",
                    String::from_utf8_lossy(&kv.key)
                ));
            }
        }
        self.revision_max = self.revision_max.max(kv.mod_revision);
        self.last = Some((kv.key.to_vec(), kv.mod_revision));
        Ok(record_of(version))
    }

    /// Checks that no version was above the snapshot's `revision`.
    pub fn finish(&self, revision: i64) -> Result<(), String> {
        if self.revision_max > revision {
            return Err(format!(
                "a version has revision {} above the snapshot's revision {revision}",
                self.revision_max
            ));
        }
        Ok(())
    }
}

/// The key-value a record from [`VersionStore::latest`] holds (`None` for a
/// tombstone). `latest` hands out a record of its own (a copy when it came
/// from a run's block), so the key-value shares its bytes.
fn live_key_value(record: Record) -> Result<Option<KeyValue>, KvError> {
    if record.tombstone {
        return Ok(None);
    }
    Ok(Some(Found::of(record)?.into_shared_key_value()))
}

/// The value bytes of a stored version: sub-revision, create revision,
/// version and lease, then the value.
pub fn encode_version(sub_revision: u32, kv: &KeyValue) -> Bytes {
    encode_header_and_value(
        sub_revision,
        kv.create_revision,
        kv.version,
        kv.lease,
        &kv.value,
    )
}

/// [`encode_version`] from the parts of a key-value the record holds.
fn encode_header_and_value(
    sub_revision: u32,
    create_revision: i64,
    version: i64,
    lease: i64,
    value: &[u8],
) -> Bytes {
    let mut out = Vec::with_capacity(ENCODED_VERSION_HEADER_BYTES.saturating_add(value.len()));
    out.extend_from_slice(&sub_revision.to_le_bytes());
    out.extend_from_slice(&create_revision.to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&lease.to_le_bytes());
    out.extend_from_slice(value);
    Bytes::from(out)
}

/// The header [`encode_version`] puts before a value: the sub-revision
/// (4 bytes), create revision, version and lease (8 each).
const ENCODED_VERSION_HEADER_BYTES: usize = 4 + 3 * 8;

/// A stored version from its record (see [`encode_version`]).
pub fn decode_version(record: &Record) -> Result<Version, KvError> {
    let found = Found::of(record.clone())?;
    Ok(Version {
        kv: Arc::new(found.to_key_value(false)),
        sub_revision: found.sub_revision,
        tombstone: record.tombstone,
    })
}

/// A version a scan found, still in the store's encoding: the value is
/// shared with the store, not copied, until the response is built (which
/// happens without the store's lock).
#[derive(Debug, Clone)]
pub struct Found {
    record: Record,
    sub_revision: u32,
    create_revision: i64,
    version: i64,
    lease: i64,
}

impl Found {
    /// Reads the header of a stored version (see [`encode_version`]).
    fn of(record: Record) -> Result<Found, KvError> {
        if record.value.len() < ENCODED_VERSION_HEADER_BYTES {
            return Err(KvError::Storage(format!(
                "a stored version of {} bytes is shorter than its header",
                record.value.len()
            )));
        }
        let number = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&record.value[at..at + 8]);
            i64::from_le_bytes(b)
        };
        let mut sub = [0u8; 4];
        sub.copy_from_slice(&record.value[..4]);
        Ok(Found {
            sub_revision: u32::from_le_bytes(sub),
            create_revision: number(4),
            version: number(12),
            lease: number(20),
            record,
        })
    }

    fn mod_revision(&self) -> i64 {
        i64::try_from(self.record.version).unwrap_or(i64::MAX)
    }

    fn value(&self) -> &[u8] {
        &self.record.value[ENCODED_VERSION_HEADER_BYTES..]
    }

    /// What it adds to a response (see [`kv_response_bytes`]).
    fn response_bytes(&self, keys_only: bool) -> usize {
        let value = if keys_only { 0 } else { self.value().len() };
        self.record.key.len() + value + KV_OVERHEAD_BYTES
    }

    /// The key-value, sharing the store's buffers: no copy, and no change
    /// to a shared count (a value read from a run is a slice of its block,
    /// which lives as long as the key-value; see [`Found::to_key_value`]).
    fn into_shared_key_value(self) -> KeyValue {
        let mod_revision = self.mod_revision();
        let mut value = self.record.value;
        value.advance(ENCODED_VERSION_HEADER_BYTES);
        KeyValue {
            key: self.record.key,
            create_revision: self.create_revision,
            mod_revision,
            version: self.version,
            value,
            lease: self.lease,
        }
    }

    /// The key-value, copied out of the store's encoding (a value read from
    /// a run is a slice of its block: a copy keeps the block from living as
    /// long as a response or a watch event that holds the value). Copies of
    /// the key-value after this one share it.
    fn to_key_value(&self, keys_only: bool) -> KeyValue {
        KeyValue {
            key: Bytes::copy_from_slice(&self.record.key),
            create_revision: self.create_revision,
            mod_revision: self.mod_revision(),
            version: self.version,
            value: if keys_only {
                Bytes::new()
            } else {
                Bytes::copy_from_slice(self.value())
            },
            lease: self.lease,
        }
    }
}

fn storage_error(error: ferry_storage::StorageError) -> KvError {
    KvError::Storage(error.to_string())
}

/// The newest version at or below `at` among one key's versions
/// (ascending), unless it is a tombstone.
fn visible_record(records: &[Record], at: ReadAt) -> Option<&Record> {
    let newest = match at {
        ReadAt::Latest => records.last()?,
        ReadAt::Revision(revision) => {
            let max = version_of(revision);
            records.iter().rev().find(|r| r.version <= max)?
        }
    };
    (!newest.tombstone).then_some(newest)
}

/// Groups a version iterator into each key's versions, ascending.
pub(crate) struct KeyGroups<I> {
    records: I,
    pending: Option<Record>,
}

impl<I: Iterator<Item = ferry_storage::Result<Record>>> Iterator for KeyGroups<I> {
    type Item = Result<Vec<Record>, KvError>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut group: Vec<Record> = Vec::new();
        if let Some(first) = self.pending.take() {
            group.push(first);
        }
        loop {
            match self.records.next() {
                None => return (!group.is_empty()).then_some(Ok(group)),
                Some(Err(error)) => return Some(Err(storage_error(error))),
                Some(Ok(record)) => {
                    if group.first().is_some_and(|first| first.key != record.key) {
                        self.pending = Some(record);
                        return Some(Ok(group));
                    }
                    group.push(record);
                }
            }
        }
    }
}

pub(crate) fn groups<I: Iterator<Item = ferry_storage::Result<Record>>>(
    records: I,
) -> KeyGroups<I> {
    KeyGroups {
        records,
        pending: None,
    }
}

/// The versions of one key (ascending) that a compaction at `compacted`
/// leaves: from the newest at or below it, without it if it is a tombstone
/// older than the compaction, and with its predecessor if it changed the
/// key exactly at the compaction (a watch from there needs the
/// predecessor for its prev_kv) and that predecessor is not a tombstone.
pub(crate) fn compacted_versions(records: &[Record], compacted: i64) -> &[Record] {
    if compacted <= 0 {
        return records;
    }
    let compacted = version_of(compacted);
    let Some(position) = records.iter().rposition(|r| r.version <= compacted) else {
        return records;
    };
    let newest = &records[position];
    let keep_from = if newest.tombstone && newest.version < compacted {
        position + 1
    } else if newest.version == compacted && position > 0 && !records[position - 1].tombstone {
        position - 1
    } else {
        position
    };
    &records[keep_from..]
}

impl MvccStore {
    /// An empty store at revision 1, held in memory.
    pub fn new() -> MvccStore {
        let disk = AnyDisk::Sim(ferry_storage::SimDisk::with_seed(0));
        // A fresh simulated disk cannot fail to open an empty store.
        let versions = VersionStore::open(
            disk,
            std::path::Path::new(IN_MEMORY_DIR),
            VersionStoreOptions::default(),
        )
        .map(|(store, _)| store);
        match versions {
            Ok(versions) => MvccStore {
                versions,
                revision: 1,
                compacted_revision: 0,
            },
            Err(error) => unreachable!("an empty store in memory failed to open: {error}"),
        }
    }

    /// The store kept on `disk` in `dir`, and the state its last flush
    /// recorded beside the versions (empty for a new store). Its revision
    /// and compaction are set from that state with
    /// [`MvccStore::set_positions`].
    pub fn open(
        disk: AnyDisk,
        dir: &std::path::Path,
    ) -> Result<(MvccStore, Bytes), ferry_storage::StorageError> {
        let (versions, recovered) = VersionStore::open(disk, dir, VersionStoreOptions::default())?;
        Ok((
            MvccStore {
                versions,
                revision: 1,
                compacted_revision: 0,
            },
            recovered.meta,
        ))
    }

    /// Sets the revision and compaction a reopened store stands at.
    pub fn set_positions(&mut self, revision: i64, compacted_revision: i64) -> Result<(), String> {
        check_positions(revision, compacted_revision)?;
        self.revision = revision;
        self.compacted_revision = compacted_revision;
        self.versions.set_floor(self.versions_floor());
        Ok(())
    }

    /// Adds a stored version as it is (copying a store): versions of a
    /// key must come in revision order.
    pub fn insert_version(&mut self, version: &Version) -> Result<(), KvError> {
        self.versions.put(record_of(version)).map_err(storage_error)
    }

    /// Bytes of versions written since the last checkpoint.
    pub fn unflushed_bytes(&self) -> usize {
        self.versions.memtable_bytes()
    }

    /// Freezes what was written so far as the state at `applied_index`,
    /// with the rest of the state `meta`, for the next flush.
    pub fn checkpoint(&mut self, applied_index: u64, meta: Bytes) {
        self.versions.freeze(applied_index, meta);
    }

    /// The next job of `lane` (a flush or a merge), if one is due and
    /// none of that lane runs.
    pub fn next_job(&mut self, lane: JobLane) -> Option<ferry_storage::versions::Job<AnyDisk>> {
        self.versions.next_job(lane)
    }

    /// Asks for a merge of every run into one (see
    /// [`VersionStore::request_full_merge`]); answers its ticket.
    pub fn request_full_merge(&mut self, after_marker: u64) -> u64 {
        self.versions.request_full_merge(after_marker)
    }

    /// Whether the full merge of `ticket` has finished.
    pub fn full_merge_done(&self, ticket: u64) -> bool {
        self.versions.full_merge_done(ticket)
    }

    /// Installs what a job did; the manifest write returned makes it
    /// durable (see [`VersionStore::finish_job`]).
    pub fn finish_job(
        &mut self,
        lane: JobLane,
        done: ferry_storage::Result<ferry_storage::versions::JobDone<AnyDisk>>,
    ) -> Result<ManifestWrite<AnyDisk>, KvError> {
        self.versions.finish_job(lane, done).map_err(storage_error)
    }

    /// Records a manifest written (see [`VersionStore::manifest_written`]).
    /// Returns what the store let go of, to drop off the state's lock (see
    /// [`VersionStore::manifest_written`]).
    pub fn manifest_written(&mut self, written: ManifestWritten<AnyDisk>) -> StoreView<AnyDisk> {
        self.versions.manifest_written(written)
    }

    /// Runs every job due and makes the result durable, on this thread.
    pub fn run_jobs_now(&mut self) -> Result<(), KvError> {
        self.versions.run_jobs_now().map_err(storage_error)
    }

    /// The versions at the durable point, with the state recorded beside
    /// them (see [`VersionStore::durable_view`]).
    pub fn durable_view(&self) -> StoreView<AnyDisk> {
        self.versions.durable_view()
    }

    /// The applied index the versions on disk are complete up to.
    pub fn durable_marker(&self) -> u64 {
        self.versions.durable_marker()
    }

    fn versions_floor(&self) -> u64 {
        versions_floor_of(self.compacted_revision)
    }

    /// The newest committed revision.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The revision of the last compaction, 0 if none.
    pub fn compacted_revision(&self) -> i64 {
        self.compacted_revision
    }

    /// Marks `revision` as committed; called once a write transaction that
    /// changed something is complete.
    pub fn commit(&mut self, revision: i64) {
        assert!(revision == self.revision + 1, "revisions advance by one");
        self.revision = revision;
    }

    /// Checks that a read at `revision` (0 = latest) is possible.
    pub fn check_read_revision(&self, revision: i64) -> Result<(), KvError> {
        if revision > self.revision {
            return Err(KvError::FutureRevision);
        }
        if revision > 0 && revision < self.compacted_revision {
            return Err(KvError::Compacted {
                compacted_revision: self.compacted_revision,
            });
        }
        Ok(())
    }

    fn version_max(at: ReadAt) -> u64 {
        match at {
            ReadAt::Latest => u64::MAX,
            ReadAt::Revision(revision) => version_of(revision),
        }
    }

    /// The visible version of `key` at `at`, or `None` when absent.
    pub fn get(&self, key: &[u8], at: ReadAt) -> Result<Option<Arc<KeyValue>>, KvError> {
        let newest = self
            .versions
            .latest(key, Self::version_max(at))
            .map_err(storage_error)?;
        match newest {
            Some(record) => Ok(live_key_value(record)?.map(Arc::new)),
            None => Ok(None),
        }
    }

    /// Visible key-values in `range` at `at`, in key order.
    pub fn scan<'a>(
        &'a self,
        range: &'a KeyRange,
        at: ReadAt,
    ) -> impl Iterator<Item = Result<Arc<KeyValue>, KvError>> + 'a {
        let walk = range.bounds().map(|(lower, upper)| {
            // `bounds` always starts inclusive.
            let start = match lower {
                Bound::Included(start) | Bound::Excluded(start) => start,
                Bound::Unbounded => &[][..],
            };
            groups(self.versions.iter(start, upper)).filter_map(move |group| match group {
                Err(error) => Some(Err(error)),
                Ok(records) => match visible_record(&records, at).map(decode_version) {
                    None => None,
                    Some(Ok(version)) => Some(Ok(version.kv)),
                    Some(Err(error)) => Some(Err(error)),
                },
            })
        });
        walk.into_iter().flatten()
    }

    /// etcd's Range over the store: filters, sort, limit, count, keys-only.
    /// `at` must have been checked with [`MvccStore::check_read_revision`].
    /// The whole scan in one go; see [`RangeScan`] for one in steps.
    pub fn range(&self, request: &RangeRequest, at: ReadAt) -> Result<RangeResponse, KvError> {
        let mut scan = RangeScan::new(request, at);
        while !scan.step(self, usize::MAX)? {}
        Ok(scan.into_response())
    }

    /// Removes the version `key` got at `revision`, a revision not yet
    /// committed: undoes a write of the write transaction in progress.
    pub fn discard(&mut self, revision: i64, key: &[u8]) {
        debug_assert!(revision > self.revision);
        self.versions.undo(key, version_of(revision));
    }

    /// Writes `key` = `value` at `revision` and returns (previous, new).
    pub fn put(
        &mut self,
        revision: i64,
        sub_revision: u32,
        key: &[u8],
        value: &[u8],
        lease: i64,
    ) -> Result<(Option<KeyValue>, KeyValue), KvError> {
        debug_assert!(revision > self.revision);
        if sub_revision > 0 {
            // A second write of the same key in one revision replaces the
            // first; txn validation prevents it, this keeps the history
            // well-formed.
            self.versions.undo(key, version_of(revision));
        } else {
            // The first write of a revision has nothing of its revision to
            // replace (a write transaction that failed half-way took all
            // its versions back), so a plain put skips the look-up.
            debug_assert!(self
                .versions
                .latest(key, u64::MAX)
                .ok()
                .flatten()
                .is_none_or(|record| record.version < version_of(revision)));
        }
        let newest = self
            .versions
            .latest(key, Self::version_max(ReadAt::Latest))
            .map_err(storage_error)?;
        // The store's copy of the key serves the new version too (a key
        // written before is not allocated again).
        let stored_key = newest.as_ref().map(|record| record.key.clone());
        let previous = match newest {
            Some(record) => live_key_value(record)?,
            None => None,
        };
        let (create_revision, version) = match &previous {
            Some(prev) => (prev.create_revision, prev.version + 1),
            None => (revision, 1),
        };
        let record = Record {
            key: stored_key.unwrap_or_else(|| Bytes::copy_from_slice(key)),
            version: version_of(revision),
            tombstone: false,
            value: encode_header_and_value(sub_revision, create_revision, version, lease, value),
        };
        // The new key-value shares the record's bytes: the value is copied
        // once, into the store.
        let kv = Found::of(record.clone())?.into_shared_key_value();
        self.versions.put(record).map_err(storage_error)?;
        Ok((previous, kv))
    }

    /// Deletes `key` at `revision` if it is live; returns the deleted value.
    pub fn delete(
        &mut self,
        revision: i64,
        sub_revision: u32,
        key: &[u8],
    ) -> Result<Option<KeyValue>, KvError> {
        debug_assert!(revision > self.revision);
        let Some(previous) = self.get(key, ReadAt::Latest)? else {
            return Ok(None);
        };
        let tombstone = KeyValue {
            key: Bytes::copy_from_slice(key),
            mod_revision: revision,
            ..KeyValue::default()
        };
        self.versions
            .put(Record {
                key: Bytes::copy_from_slice(key),
                version: version_of(revision),
                tombstone: true,
                value: encode_version(sub_revision, &tombstone),
            })
            .map_err(storage_error)?;
        Ok(Some(Arc::unwrap_or_clone(previous)))
    }

    /// Compacts history up to `revision`: afterwards reads below it fail, and
    /// each key keeps only its newest version at or below it. Changes exactly
    /// at `revision` stay watchable in full: such a tombstone is kept, and so
    /// is the version before such a change (for the event's prev_kv).
    pub fn compact(&mut self, revision: i64) -> Result<(), KvError> {
        if revision > self.revision {
            return Err(KvError::FutureRevision);
        }
        if revision <= self.compacted_revision {
            return Err(KvError::Compacted {
                compacted_revision: self.compacted_revision,
            });
        }
        self.compacted_revision = revision;
        self.versions.compact_memtable(self.versions_floor());
        Ok(())
    }

    /// Events with revisions in `from..=to` for keys in `range`, in revision
    /// order (and operation order within a revision), each with the previous
    /// version when it still exists and `prev_kv` asks for it (finding it
    /// costs a look-up per key). Stops after the revision in which the
    /// event count reaches `events_max` or the events' size reaches
    /// `bytes_max`, so a revision is never split.
    ///
    /// The events' keys and values share the store's buffers, not copies
    /// (a value read from a run is a slice of its block): they are meant to
    /// be encoded and dropped, as the watch hub does, not kept.
    pub fn history(
        &self,
        range: &KeyRange,
        from: i64,
        to: i64,
        events_max: usize,
        bytes_max: usize,
        prev_kv: bool,
    ) -> Result<Vec<Event>, KvError> {
        // (Bounds always start at an included key; `None` is an empty range.)
        let Some((Bound::Included(start), end)) = range.bounds() else {
            return Ok(Vec::new());
        };
        if to < from {
            return Ok(Vec::new());
        }
        // The store hands out only the oldest `events_max` changes (whole
        // revisions): a watcher far behind catches up in pieces, each
        // costing what it returns, not the whole way to `to`.
        let changes = self
            .versions
            .history(start, end, version_of(from), version_of(to), events_max)
            .map_err(storage_error)?;
        let mut found: Vec<Found> = Vec::with_capacity(changes.len());
        for record in changes {
            found.push(Found::of(record)?);
        }
        found.sort_by_key(|f| (f.mod_revision(), f.sub_revision));
        let mut events = Vec::new();
        let mut bytes = 0usize;
        let mut last_revision = 0;
        // A key's change before this one, when it lies in the window too
        // (`None`: a delete): its value is this change's previous one, so
        // only a key's first change here costs a lookup.
        let mut before: HashMap<Bytes, Option<KeyValue>> = HashMap::new();
        for change in found {
            let revision = change.mod_revision();
            if (events.len() >= events_max || bytes >= bytes_max) && revision != last_revision {
                break;
            }
            last_revision = revision;
            let tombstone = change.record.tombstone;
            let kv = change.into_shared_key_value();
            let prev = if prev_kv {
                let prev = match before.get(&kv.key) {
                    Some(prev) => prev.clone(),
                    None => self
                        .get(&kv.key, ReadAt::Revision(revision - 1))?
                        .map(Arc::unwrap_or_clone),
                };
                before.insert(kv.key.clone(), (!tombstone).then(|| kv.clone()));
                prev
            } else {
                None
            };
            let event = event_of(kv, tombstone, prev);
            bytes = bytes.saturating_add(event_size_bytes(&event));
            events.push(event);
        }
        Ok(events)
    }

    /// A view of every version that later writes do not change (for a
    /// snapshot written out elsewhere); read it through
    /// the compaction (as snapshots do) to see it as compaction left it.
    pub fn view(&self) -> StoreView<AnyDisk> {
        self.versions.view_copy(0, Bytes::new())
    }

    /// Every version as compaction left it, in key order and revision
    /// order per key: what snapshots and hashes hold. Builds a list; see
    /// [`MvccStore::for_each_compacted`] to walk without one.
    pub fn compacted_view(&self) -> Result<Vec<Version>, KvError> {
        let mut out = Vec::new();
        self.for_each_compacted(|version| {
            out.push(version);
            Ok(())
        })?;
        Ok(out)
    }

    /// Calls `visit` with every version as compaction left it, in key
    /// order and revision order per key.
    pub fn for_each_compacted(
        &self,
        mut visit: impl FnMut(Version) -> Result<(), KvError>,
    ) -> Result<(), KvError> {
        for group in groups(self.versions.iter(&[], Bound::Unbounded)) {
            for record in compacted_versions(&group?, self.compacted_revision) {
                visit(decode_version(record)?)?;
            }
        }
        Ok(())
    }

    /// Rebuilds a store from snapshot parts, checking that each key's
    /// versions are in revision order and within the store's revision.
    pub fn from_parts(
        revision: i64,
        compacted_revision: i64,
        versions: Vec<Version>,
    ) -> Result<MvccStore, String> {
        check_positions(revision, compacted_revision)?;
        let mut store = MvccStore::new();
        store.revision = revision;
        store.compacted_revision = compacted_revision;
        store.versions.set_floor(store.versions_floor());
        let mut check = SnapshotVersionCheck::default();
        for version in versions {
            let record = check.check(&version)?;
            store.versions.put(record).map_err(|e| e.to_string())?;
        }
        check.finish(revision)?;
        Ok(store)
    }

    /// CRC32C over every stored version at or below `revision`, in key
    /// order: replicas that applied the same commands give the same hash,
    /// which makes divergence visible (etcd's HashKV).
    pub fn hash_kv(&self, revision: i64) -> Result<u32, KvError> {
        self.check_read_revision(revision)?;
        let revision = if revision > 0 {
            revision
        } else {
            self.revision
        };
        let mut hash: u32 = 0;
        self.for_each_compacted(|version| {
            if version.kv.mod_revision > revision {
                return Ok(());
            }
            hash = crc32c::crc32c_append(hash, &version.kv.key);
            for number in [
                version.kv.create_revision,
                version.kv.mod_revision,
                version.kv.version,
                version.kv.lease,
                i64::from(version.tombstone),
            ] {
                hash = crc32c::crc32c_append(hash, &number.to_le_bytes());
            }
            hash = crc32c::crc32c_append(hash, &version.kv.value);
            Ok(())
        })?;
        Ok(hash)
    }

    /// Bytes the store holds, in memory and on disk, reported as the db
    /// size. Cheap: the quota check asks it on every write.
    pub fn size_bytes(&self) -> u64 {
        (self.versions.memtable_bytes() as u64).saturating_add(self.versions.run_file_bytes())
    }

    /// The version store's figures (memtable, frozen layers, runs).
    pub fn store_stats(&self) -> ferry_storage::versions::StoreStats {
        self.versions.stats()
    }
}

/// Turns a stored version into a watch event.
pub fn to_event(version: &Version, prev_kv: Option<KeyValue>) -> Event {
    event_of(KeyValue::clone(&version.kv), version.tombstone, prev_kv)
}

/// The event of a change to `kv` (a delete when `tombstone`).
pub(crate) fn event_of(kv: KeyValue, tombstone: bool, prev_kv: Option<KeyValue>) -> Event {
    Event {
        r#type: if tombstone {
            EventType::Delete as i32
        } else {
            EventType::Put as i32
        },
        kv: Some(kv),
        prev_kv,
    }
}

fn sort_kvs(kvs: &mut [Found], target: SortTarget, order: SortOrder) {
    // etcd: a sort target without an order means ascending. The sort is
    // stable, so equal targets stay in key order.
    match target {
        SortTarget::Key => kvs.sort_by(|a, b| a.record.key.cmp(&b.record.key)),
        SortTarget::Version => kvs.sort_by_key(|kv| kv.version),
        SortTarget::Create => kvs.sort_by_key(|kv| kv.create_revision),
        SortTarget::Mod => kvs.sort_by_key(Found::mod_revision),
        SortTarget::Value => kvs.sort_by(|a, b| a.value().cmp(b.value())),
    }
    if order == SortOrder::Descend {
        kvs.reverse();
    }
}

/// Bytes a key-value adds to a response, beyond its key and value: field
/// tags, lengths and the four numbers, rounded up. Used to bound responses;
/// an estimate that is the same on every replica, not the exact encoding.
pub const KV_OVERHEAD_BYTES: usize = 48;

/// What a key-value adds to a response (see [`KV_OVERHEAD_BYTES`]).
pub fn kv_response_bytes(kv: &KeyValue, keys_only: bool) -> usize {
    let value = if keys_only { 0 } else { kv.value.len() };
    kv.key.len() + value + KV_OVERHEAD_BYTES
}

/// What a watch event holds in memory and on the wire, roughly.
pub fn event_size_bytes(event: &Event) -> usize {
    let kv = event
        .kv
        .as_ref()
        .map_or(0, |kv| kv_response_bytes(kv, false));
    let prev = event
        .prev_kv
        .as_ref()
        .map_or(0, |kv| kv_response_bytes(kv, false));
    kv + prev + KV_OVERHEAD_BYTES
}

/// Bytes of stored versions one step of a [`RangeScan`] reads at most
/// (past the key it is at), so that a scan of large values holds the
/// store's lock for a bounded time however few keys it covers.
pub const RANGE_STEP_BYTES_MAX: usize = 4 * 1024 * 1024;

/// The part of the store one step of a [`RangeScan`] reads: a consistent
/// view that later writes and compactions do not change.
#[derive(Debug)]
pub struct ScanView(RangeView<AnyDisk>);

/// A Range over the store that can run in steps, each a bounded number of
/// keys, so that a caller may release the store's lock between steps while
/// the store goes on changing.
///
/// Why this is consistent: a scan in steps reads at one fixed revision
/// (the newest when it started), and the store keeps every version at or
/// below a revision that is not compacted; each step checks that the
/// revision is still readable. Collecting the matches costs one pointer
/// copy each (the key-values are shared, see [`Version`]); the copy into
/// the response happens in [`RangeScan::into_response`], which needs no
/// store at all.
#[derive(Debug)]
pub struct RangeScan {
    range: KeyRange,
    at: ReadAt,
    /// The last key scanned, where the next step resumes.
    resume_after: Option<Vec<u8>>,
    done: bool,
    kvs: Vec<Found>,
    count: i64,
    /// Response bytes of `kvs` so far (see [`kv_response_bytes`]).
    bytes: usize,
    /// Whether the sort and the limit were applied to `kvs`.
    settled: bool,
    /// Whether the limit cut matches off.
    more: bool,
    sort_order: SortOrder,
    sort_target: SortTarget,
    key_ascending: bool,
    has_filters: bool,
    limit: usize,
    count_only: bool,
    keys_only: bool,
    min_mod_revision: i64,
    max_mod_revision: i64,
    min_create_revision: i64,
    max_create_revision: i64,
}

impl RangeScan {
    /// A scan for `request` reading at `at`. For a scan in several steps
    /// `at` must be a revision, not [`ReadAt::Latest`].
    pub fn new(request: &RangeRequest, at: ReadAt) -> RangeScan {
        let sort_order = SortOrder::try_from(request.sort_order).unwrap_or(SortOrder::None);
        let sort_target = SortTarget::try_from(request.sort_target).unwrap_or(SortTarget::Key);
        RangeScan {
            range: KeyRange::new(&request.key, &request.range_end),
            at,
            resume_after: None,
            done: false,
            kvs: Vec::new(),
            count: 0,
            bytes: 0,
            settled: false,
            more: false,
            sort_order,
            sort_target,
            // Keys come out in ascending order already; only other orders
            // need every match before the limit can be applied.
            key_ascending: sort_target == SortTarget::Key && sort_order != SortOrder::Descend,
            has_filters: request.min_mod_revision > 0
                || request.max_mod_revision > 0
                || request.min_create_revision > 0
                || request.max_create_revision > 0,
            limit: usize::try_from(request.limit).unwrap_or(0),
            count_only: request.count_only,
            keys_only: request.keys_only,
            min_mod_revision: request.min_mod_revision,
            max_mod_revision: request.max_mod_revision,
            min_create_revision: request.min_create_revision,
            max_create_revision: request.max_create_revision,
        }
    }

    /// Whether every key of the range has been scanned.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Scans up to `keys_max` more keys of the range, reading the store
    /// in place; returns whether the scan is complete.
    pub fn step(&mut self, store: &MvccStore, keys_max: usize) -> Result<bool, KvError> {
        let Some((start, upper)) = self.resume_point() else {
            return Ok(true);
        };
        if self.range.end == RangeEnd::Single {
            // One key: only its newest version at the read revision counts,
            // so a key written many times since the last compaction costs
            // one lookup, not a walk of its history.
            let newest = store
                .versions
                .latest(&start, MvccStore::version_max(self.at))
                .transpose();
            return self.scan(newest.into_iter(), None, keys_max);
        }
        let records = store
            .versions
            .iter(&start, upper.as_ref().map(Vec::as_slice));
        self.scan(records, None, keys_max)
    }

    /// The part of the store the next step reads (`None` when the scan is
    /// complete): cheap to take under the store's lock, and scanned with
    /// [`RangeScan::scan_view`] after releasing it, so that however slowly
    /// its versions come off the disk no apply waits for them.
    pub fn next_view(&mut self, store: &MvccStore, keys_max: usize) -> Option<ScanView> {
        let (start, upper) = self.resume_point()?;
        let view = store
            .versions
            .range_view(&start, upper.as_ref().map(Vec::as_slice), keys_max);
        Some(ScanView(view))
    }

    /// Scans up to `keys_max` keys of `view` (taken by
    /// [`RangeScan::next_view`]); returns whether the scan is complete.
    pub fn scan_view(&mut self, view: &ScanView, keys_max: usize) -> Result<bool, KvError> {
        self.scan(view.0.iter(), view.0.cut(), keys_max)
    }

    /// Where the next step starts and the range's end; `None` (and the
    /// scan marked complete) when nothing of the range is left.
    fn resume_point(&mut self) -> Option<(Vec<u8>, Bound<Vec<u8>>)> {
        if self.done {
            return None;
        }
        let Some((lower, upper)) = self.range.bounds() else {
            self.done = true;
            return None;
        };
        // Resume right after the last key scanned: its successor in key
        // order is the key with a zero byte appended.
        let start = match (&self.resume_after, lower) {
            (Some(last), _) => {
                let mut next = last.clone();
                next.push(0);
                next
            }
            (None, Bound::Included(start) | Bound::Excluded(start)) => start.to_vec(),
            (None, Bound::Unbounded) => Vec::new(),
        };
        if !walkable(Bound::Included(&start), upper) {
            // Resumed after the last key the range can hold.
            self.done = true;
            return None;
        }
        Some((start, upper.map(<[u8]>::to_vec)))
    }

    /// Scans up to `keys_max` keys of `records`, the versions from the
    /// resume point on, which hold every key of the range up to `cut` (to
    /// its end without one).
    fn scan(
        &mut self,
        records: impl Iterator<Item = ferry_storage::Result<Record>>,
        cut: Option<&[u8]>,
        keys_max: usize,
    ) -> Result<bool, KvError> {
        let mut scanned = 0usize;
        let mut read_bytes = 0usize;
        let mut last_key: Option<Vec<u8>> = None;
        let mut walk = groups(records);
        let mut walked_all = false;
        loop {
            // Keys and bytes both bound a step: versions read from disk
            // cost their size, whatever the response keeps of them.
            if scanned >= keys_max || read_bytes >= RANGE_STEP_BYTES_MAX {
                break;
            }
            let Some(group) = walk.next() else {
                walked_all = true;
                break;
            };
            let records = group?;
            scanned += 1;
            read_bytes = records
                .iter()
                .map(|r| r.key.len() + r.value.len())
                .fold(read_bytes, usize::saturating_add);
            last_key = records.first().map(|r| r.key.to_vec());
            let Some(record) = visible_record(&records, self.at) else {
                continue;
            };
            let kv = Found::of(record.clone())?;
            self.count += 1;
            if self.count_only || !self.passes_filters(&kv) {
                continue;
            }
            // With the natural order, one past the limit is enough to know
            // whether there is more.
            if self.key_ascending
                && self.limit > 0
                && self.kvs.len() > self.limit
                && !self.has_filters
            {
                continue;
            }
            self.bytes = self.bytes.saturating_add(kv.response_bytes(self.keys_only));
            self.kvs.push(kv);
        }
        match (walked_all, cut) {
            // The whole range is scanned.
            (true, None) => self.done = true,
            // Every key up to the cut is scanned; the next view starts
            // after it.
            (true, Some(cut)) => self.resume_after = Some(cut.to_vec()),
            (false, _) => self.resume_after = last_key,
        }
        Ok(self.done)
    }

    /// Response bytes of the key-values collected so far, before sorting
    /// and the limit (an upper bound of what the response will hold).
    pub fn collected_bytes(&self) -> usize {
        self.bytes
    }

    /// Sorts and cuts to the limit (which needs no store), after which
    /// `bytes` is what the response will hold. Runs once.
    fn settle(&mut self) {
        if self.settled {
            return;
        }
        self.settled = true;
        if !self.key_ascending {
            sort_kvs(&mut self.kvs, self.sort_target, self.sort_order);
        }
        self.more = self.limit > 0 && self.kvs.len() > self.limit;
        if self.more {
            for kv in self.kvs.drain(self.limit..) {
                self.bytes = self.bytes.saturating_sub(kv.response_bytes(self.keys_only));
            }
        }
    }

    /// Bytes of the key-values the response will hold (see
    /// [`kv_response_bytes`]); call once the scan is done.
    pub fn response_bytes(&mut self) -> usize {
        self.settle();
        self.bytes
    }

    /// The response (without header): copies the key-values collected.
    pub fn into_response(mut self) -> RangeResponse {
        self.settle();
        let more = self.more;
        let keys_only = self.keys_only;
        let kvs = self
            .kvs
            .iter()
            .map(|kv| kv.to_key_value(keys_only))
            .collect();
        RangeResponse {
            header: None,
            kvs,
            more,
            count: self.count,
        }
    }

    fn passes_filters(&self, kv: &Found) -> bool {
        (self.min_mod_revision <= 0 || kv.mod_revision() >= self.min_mod_revision)
            && (self.max_mod_revision <= 0 || kv.mod_revision() <= self.max_mod_revision)
            && (self.min_create_revision <= 0 || kv.create_revision >= self.min_create_revision)
            && (self.max_create_revision <= 0 || kv.create_revision <= self.max_create_revision)
    }
}
