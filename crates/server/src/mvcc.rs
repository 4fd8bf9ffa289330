//! Multi-version key-value store with etcd's revision model.
//!
//! One revision counter for the whole store: every write transaction that
//! changes something advances it by one, and every key remembers the
//! revision it was created at (`create_revision`), last modified at
//! (`mod_revision`) and how often it changed since (`version`). Old versions
//! stay readable until a compaction removes them. A delete leaves a
//! tombstone so that reads at older revisions and watchers replaying history
//! see it. The store is deterministic: the same writes give the same state.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;

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

/// The multi-version store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MvccStore {
    /// Every key's versions, oldest first.
    keys: BTreeMap<Vec<u8>, Vec<Version>>,
    /// The newest committed revision. Starts at 1 as in etcd, so the first
    /// write of a fresh store is revision 2.
    revision: i64,
    /// Reads below this revision fail; 0 when nothing was compacted.
    compacted_revision: i64,
}

impl MvccStore {
    /// An empty store at revision 1.
    pub fn new() -> MvccStore {
        MvccStore {
            keys: BTreeMap::new(),
            revision: 1,
            compacted_revision: 0,
        }
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

    /// The visible version of `key` at `at`, or `None` when absent.
    pub fn get(&self, key: &[u8], at: ReadAt) -> Option<&KeyValue> {
        let versions = self.keys.get(key)?;
        visible(versions, at).map(|v| &*v.kv)
    }

    /// Visible key-values in `range` at `at`, in key order.
    pub fn scan<'a>(
        &'a self,
        range: &'a KeyRange,
        at: ReadAt,
    ) -> impl Iterator<Item = &'a KeyValue> + 'a {
        let walk = range.bounds().map(|bounds| {
            self.keys
                .range::<[u8], _>(bounds)
                .filter_map(move |(_, versions)| visible(versions, at).map(|v| &*v.kv))
        });
        walk.into_iter().flatten()
    }

    /// etcd's Range over the store: filters, sort, limit, count, keys-only.
    /// `at` must have been checked with [`MvccStore::check_read_revision`].
    /// The whole scan in one go; see [`RangeScan`] for one in steps.
    pub fn range(&self, request: &RangeRequest, at: ReadAt) -> RangeResponse {
        let mut scan = RangeScan::new(request, at);
        scan.step(self, usize::MAX);
        scan.into_response()
    }

    /// Removes the version `key` got at `revision`, a revision not yet
    /// committed: undoes a write of the write transaction in progress.
    pub fn discard(&mut self, revision: i64, key: &[u8]) {
        debug_assert!(revision > self.revision);
        let Some(versions) = self.keys.get_mut(key) else {
            return;
        };
        if versions
            .last()
            .is_some_and(|v| v.kv.mod_revision == revision)
        {
            versions.pop();
        }
        if versions.is_empty() {
            self.keys.remove(key);
        }
    }

    /// Writes `key` = `value` at `revision` and returns (previous, new).
    pub fn put(
        &mut self,
        revision: i64,
        sub_revision: u32,
        key: &[u8],
        value: Vec<u8>,
        lease: i64,
    ) -> (Option<KeyValue>, KeyValue) {
        debug_assert!(revision > self.revision);
        let versions = self.keys.entry(key.to_vec()).or_default();
        // A second write of the same key in one revision replaces the first;
        // txn validation prevents it, this keeps the history well-formed.
        if versions
            .last()
            .is_some_and(|v| v.kv.mod_revision == revision)
        {
            versions.pop();
        }
        let previous = versions
            .last()
            .filter(|v| !v.tombstone)
            .map(|v| KeyValue::clone(&v.kv));
        let (create_revision, version) = match &previous {
            Some(prev) => (prev.create_revision, prev.version + 1),
            None => (revision, 1),
        };
        let kv = KeyValue {
            key: key.to_vec(),
            create_revision,
            mod_revision: revision,
            version,
            value,
            lease,
        };
        versions.push(Version {
            kv: Arc::new(kv.clone()),
            sub_revision,
            tombstone: false,
        });
        (previous, kv)
    }

    /// Deletes `key` at `revision` if it is live; returns the deleted value.
    pub fn delete(&mut self, revision: i64, sub_revision: u32, key: &[u8]) -> Option<KeyValue> {
        debug_assert!(revision > self.revision);
        let versions = self.keys.get_mut(key)?;
        let previous = KeyValue::clone(&versions.last().filter(|v| !v.tombstone)?.kv);
        versions.push(Version {
            kv: Arc::new(KeyValue {
                key: key.to_vec(),
                mod_revision: revision,
                ..KeyValue::default()
            }),
            sub_revision,
            tombstone: true,
        });
        Some(previous)
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
        self.keys.retain(|_, versions| {
            let newest_at_or_below = versions.iter().rposition(|v| v.kv.mod_revision <= revision);
            if let Some(position) = newest_at_or_below {
                let newest = &versions[position];
                let keep_from = if newest.tombstone && newest.kv.mod_revision < revision {
                    position + 1
                } else if newest.kv.mod_revision == revision
                    && position > 0
                    && !versions[position - 1].tombstone
                {
                    // A change exactly at the compacted revision can still
                    // be watched; keep its predecessor for its prev_kv.
                    position - 1
                } else {
                    position
                };
                versions.drain(..keep_from);
            }
            !versions.is_empty()
        });
        self.compacted_revision = revision;
        Ok(())
    }

    /// Events with revisions in `from..=to` for keys in `range`, in revision
    /// order (and operation order within a revision), each with the previous
    /// version when it still exists. Stops after the revision in which the
    /// event count reaches `events_max` or the events' size reaches
    /// `bytes_max`, so a revision is never split.
    ///
    /// Only the events returned are copied: the walk first notes where each
    /// change is, so a watcher far behind does not copy the whole history to
    /// keep a batch of it.
    pub fn history(
        &self,
        range: &KeyRange,
        from: i64,
        to: i64,
        events_max: usize,
        bytes_max: usize,
    ) -> Vec<Event> {
        let Some(bounds) = range.bounds() else {
            return Vec::new();
        };
        let mut found: Vec<(i64, u32, &[Version], usize)> = Vec::new();
        for (_, versions) in self.keys.range::<[u8], _>(bounds) {
            for (position, version) in versions.iter().enumerate() {
                let revision = version.kv.mod_revision;
                if revision >= from && revision <= to {
                    found.push((revision, version.sub_revision, versions, position));
                }
            }
        }
        found.sort_by_key(|(revision, sub, _, _)| (*revision, *sub));
        let mut events = Vec::new();
        let mut bytes = 0usize;
        let mut last_revision = 0;
        for (revision, _, versions, position) in found {
            if (events.len() >= events_max || bytes >= bytes_max) && revision != last_revision {
                break;
            }
            last_revision = revision;
            let prev_kv = position
                .checked_sub(1)
                .and_then(|p| versions.get(p))
                .filter(|p| !p.tombstone)
                .map(|p| KeyValue::clone(&p.kv));
            let Some(version) = versions.get(position) else {
                continue;
            };
            let event = to_event(version, prev_kv);
            bytes = bytes.saturating_add(event_size_bytes(&event));
            events.push(event);
        }
        events
    }

    /// Every stored version, in key order, for snapshots.
    pub fn versions(&self) -> impl Iterator<Item = &Version> {
        self.keys.values().flatten()
    }

    /// Rebuilds a store from snapshot parts, checking that each key's
    /// versions are in revision order and within the store's revision.
    pub fn from_parts(
        revision: i64,
        compacted_revision: i64,
        versions: Vec<Version>,
    ) -> Result<MvccStore, String> {
        if revision < 1 || compacted_revision < 0 || compacted_revision > revision {
            return Err(format!(
                "revision {revision} and compacted revision {compacted_revision} do not fit"
            ));
        }
        let mut keys: BTreeMap<Vec<u8>, Vec<Version>> = BTreeMap::new();
        for version in versions {
            if version.kv.key.is_empty() {
                return Err("a stored version has an empty key".to_string());
            }
            if version.kv.mod_revision > revision || version.kv.mod_revision < 1 {
                return Err(format!(
                    "version of key {:?} has revision {} outside 1..={revision}",
                    String::from_utf8_lossy(&version.kv.key),
                    version.kv.mod_revision
                ));
            }
            let history = keys.entry(version.kv.key.clone()).or_default();
            if history
                .last()
                .is_some_and(|last| last.kv.mod_revision >= version.kv.mod_revision)
            {
                return Err(format!(
                    "versions of key {:?} are not in revision order",
                    String::from_utf8_lossy(&version.kv.key)
                ));
            }
            history.push(version);
        }
        Ok(MvccStore {
            keys,
            revision,
            compacted_revision,
        })
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
        for (key, versions) in &self.keys {
            for version in versions.iter().filter(|v| v.kv.mod_revision <= revision) {
                hash = crc32c::crc32c_append(hash, key);
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
            }
        }
        Ok(hash)
    }

    /// Approximate memory held by keys and values, reported as the db size.
    pub fn size_bytes(&self) -> u64 {
        let mut total: u64 = 0;
        for (key, versions) in &self.keys {
            total += key.len() as u64;
            for version in versions {
                total += (version.kv.key.len() + version.kv.value.len() + 48) as u64;
            }
        }
        total
    }

    /// Number of keys that are live at the newest revision.
    pub fn live_key_count(&self) -> usize {
        self.keys
            .values()
            .filter(|versions| versions.last().is_some_and(|v| !v.tombstone))
            .count()
    }
}

/// Turns a stored version into a watch event.
pub fn to_event(version: &Version, prev_kv: Option<KeyValue>) -> Event {
    Event {
        r#type: if version.tombstone {
            EventType::Delete as i32
        } else {
            EventType::Put as i32
        },
        kv: Some(KeyValue::clone(&version.kv)),
        prev_kv,
    }
}

fn visible(versions: &[Version], at: ReadAt) -> Option<&Version> {
    let version = match at {
        ReadAt::Latest => versions.last()?,
        ReadAt::Revision(revision) => versions
            .iter()
            .rev()
            .find(|v| v.kv.mod_revision <= revision)?,
    };
    if version.tombstone {
        None
    } else {
        Some(version)
    }
}

fn sort_kvs(kvs: &mut [Arc<KeyValue>], target: SortTarget, order: SortOrder) {
    // etcd: a sort target without an order means ascending. The sort is
    // stable, so equal targets stay in key order.
    match target {
        SortTarget::Key => kvs.sort_by(|a, b| a.key.cmp(&b.key)),
        SortTarget::Version => kvs.sort_by_key(|kv| kv.version),
        SortTarget::Create => kvs.sort_by_key(|kv| kv.create_revision),
        SortTarget::Mod => kvs.sort_by_key(|kv| kv.mod_revision),
        SortTarget::Value => kvs.sort_by(|a, b| a.value.cmp(&b.value)),
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
    kvs: Vec<Arc<KeyValue>>,
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

    /// Scans up to `keys_max` more keys of the range; returns whether the
    /// scan is complete.
    pub fn step(&mut self, store: &MvccStore, keys_max: usize) -> bool {
        if self.done {
            return true;
        }
        let Some((lower, upper)) = self.range.bounds() else {
            self.done = true;
            return true;
        };
        let lower = match &self.resume_after {
            Some(key) => Bound::Excluded(key.as_slice()),
            None => lower,
        };
        if !walkable(lower, upper) {
            // Resumed after the last key the range can hold.
            self.done = true;
            return true;
        }
        let mut scanned = 0usize;
        let mut last_key: Option<&[u8]> = None;
        let mut walk = store.keys.range::<[u8], _>((lower, upper));
        loop {
            if scanned >= keys_max {
                break;
            }
            let Some((key, versions)) = walk.next() else {
                self.done = true;
                break;
            };
            scanned += 1;
            last_key = Some(key.as_slice());
            let Some(version) = visible(versions, self.at) else {
                continue;
            };
            let kv = &version.kv;
            self.count += 1;
            if self.count_only || !self.passes_filters(kv) {
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
            self.bytes = self
                .bytes
                .saturating_add(kv_response_bytes(kv, self.keys_only));
            self.kvs.push(Arc::clone(kv));
        }
        if !self.done {
            self.resume_after = last_key.map(<[u8]>::to_vec);
        }
        self.done
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
                self.bytes = self
                    .bytes
                    .saturating_sub(kv_response_bytes(&kv, self.keys_only));
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
            .map(|kv| {
                if keys_only {
                    KeyValue {
                        key: kv.key.clone(),
                        create_revision: kv.create_revision,
                        mod_revision: kv.mod_revision,
                        version: kv.version,
                        value: Vec::new(),
                        lease: kv.lease,
                    }
                } else {
                    KeyValue::clone(kv)
                }
            })
            .collect();
        RangeResponse {
            header: None,
            kvs,
            more,
            count: self.count,
        }
    }

    fn passes_filters(&self, kv: &KeyValue) -> bool {
        (self.min_mod_revision <= 0 || kv.mod_revision >= self.min_mod_revision)
            && (self.max_mod_revision <= 0 || kv.mod_revision <= self.max_mod_revision)
            && (self.min_create_revision <= 0 || kv.create_revision >= self.min_create_revision)
            && (self.max_create_revision <= 0 || kv.create_revision <= self.max_create_revision)
    }
}
