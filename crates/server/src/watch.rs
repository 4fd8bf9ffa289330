//! The watch hub: delivers store changes to watchers in revision order,
//! with no gap and no duplicate, without ever making the store wait.
//!
//! A watcher is *synced* when it has every revision up to the last one
//! applied queued or delivered: it receives each new revision's events
//! directly into its own bounded queue. Synced watchers are indexed by key
//! (a watcher of one key under that key; ranges and prefixes in a list of
//! their own), so a revision costs a lookup per event, not a look at every
//! watcher: with 10,000 watchers of single keys, a put concerns the few
//! that watch its key. A watcher that started in the past, or whose queue
//! was full because its client reads slowly, falls *behind*: it remembers
//! the next revision it must deliver, is out of the index, and catches up
//! from the MVCC history when its stream drains it, a bounded batch at a
//! time, until it is synced again; one that starts at a future revision
//! waits in a list by that revision. So the store never blocks on a
//! watcher and a watcher's memory is bounded. The last revisions' events
//! are kept too, in a ring bounded in bytes, while any stream is open: a
//! watcher that fell behind by less than the ring holds catches up from
//! it, as etcd's catches up from a store keyed by revision, not from a
//! scan of the store's recent changes (which costs as much as every change
//! since the last flush, and a look-up of each event's previous value). A watcher that falls behind
//! the compacted revision, or more than `lag_revisions_max` behind the
//! store, is cancelled with a reason.
//!
//! Memory, with many watchers and large values: an event is held once,
//! encoded for the wire as an `mvccpb.Event` (two variants at most: with
//! and without its previous value), shared by every watcher that queues
//! it and by the ring; a response carries those bytes as they are
//! (`ferrypb.WatchResponseWire`, the same bytes on the wire as etcd's
//! `WatchResponse`), so an event is encoded once per revision, not once
//! per watcher. What is queued is counted in bytes per
//! watcher, per stream (shared events once per stream) and per node, and
//! each has a bound; a watcher that would pass one falls behind as above,
//! so a stream whose client does not read stops costing memory and is
//! slowed to the pace of its client, as etcd's slow watchers are, while
//! watchers that keep up lose nothing. The bytes a stream hands out per
//! drain and the history scans per drain are bounded too, so one drain
//! holds the state lock briefly however far behind its watchers are.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::Arc;

use bytes::Bytes;
use prost::Message;
use tokio::sync::Notify;

use crate::mvcc::{KeyRange, MvccStore, RangeEnd};
use crate::pb::etcdserverpb::watch_create_request::FilterType;
use crate::pb::etcdserverpb::{ResponseHeader, WatchCreateRequest, WatchResponse};
use crate::pb::ferrypb::WatchResponseWire;
use crate::pb::mvccpb::event::EventType;
use crate::pb::mvccpb::Event;

/// Identifies one client watch stream on this node.
pub type StreamId = u64;

/// Watch id etcd uses for responses that concern the whole stream.
pub const STREAM_WATCH_ID: i64 = -1;

/// Reason given to a watcher cancelled because history it needs is gone.
pub const COMPACTED_REASON: &str = "etcdserver: mvcc: required revision has been compacted";

/// Bounds of the watch hub.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchLimits {
    /// Events a watcher may have queued before it falls behind; also the
    /// most events one catch-up batch from history holds.
    pub events_per_watcher_max: usize,
    /// Bytes of events one watcher may have queued before it falls behind
    /// (a revision is always taken by a watcher with nothing queued).
    pub watcher_queued_bytes_max: usize,
    /// Bytes of events the watchers of one stream may have queued, shared
    /// events counted once, before its watchers fall behind.
    pub stream_queued_bytes_max: usize,
    /// Bytes of events queued on this node, all streams together, before
    /// watchers fall behind.
    pub node_queued_bytes_max: usize,
    /// Bytes of responses one drain hands to a stream (at least one
    /// response), so that a stream far behind catches up in pieces.
    pub drain_bytes_max: usize,
    /// History scans one drain runs for watchers that are behind; watchers
    /// of the same range and revision share one.
    pub history_scans_per_drain_max: usize,
    /// Watchers one stream may hold.
    pub watchers_per_stream_max: usize,
    /// How far behind the store a watcher may fall before it is cancelled.
    pub lag_revisions_max: i64,
    /// Watch streams open at once on this node.
    pub streams_max: usize,
    /// Bytes of the last revisions' events kept for watchers that fall
    /// behind (0: none; they all catch up from the store), each event
    /// counted with both its encodings.
    pub recent_bytes_max: usize,
}

impl Default for WatchLimits {
    fn default() -> Self {
        WatchLimits {
            events_per_watcher_max: 1024,
            watcher_queued_bytes_max: 4 << 20,
            stream_queued_bytes_max: 16 << 20,
            node_queued_bytes_max: 256 << 20,
            drain_bytes_max: 1 << 20,
            history_scans_per_drain_max: 8,
            watchers_per_stream_max: 4096,
            lag_revisions_max: 1_000_000,
            streams_max: 65_536,
            recent_bytes_max: 24 << 20,
        }
    }
}

/// Bytes of events past which a watch response takes no further
/// revision: a watcher's consecutive revisions share one response up to
/// here (as etcd's catch-up does), so a busy watcher costs a frame per
/// batch, not per revision. One revision's events always go together,
/// whatever their size.
pub const RESPONSE_EVENTS_BYTES_MAX: usize = 64 * 1024;

/// Bytes counted for each revision a watcher queues, beyond its events:
/// the queue entry and one pointer per event.
const QUEUE_ENTRY_OVERHEAD_BYTES: usize = 64;
/// Bytes counted per queued event pointer.
const QUEUE_EVENT_POINTER_BYTES: usize = 16;

/// An event encoded as it goes on the wire (an `mvccpb.Event`).
type WireEvent = Bytes;

/// `event` encoded for the wire.
fn encode_event(event: &Event) -> WireEvent {
    Bytes::from(event.encode_to_vec())
}

/// An event as the hub holds it for watchers, shared by all of them (see
/// [`SharedEventData`]).
type SharedEvent = Arc<SharedEventData>;

/// Bytes counted for a shared event beyond its encodings and key: the
/// struct and its reference count.
const SHARED_EVENT_OVERHEAD_BYTES: usize = 96;

/// An event encoded for the wire once, with and without its previous value,
/// however many watchers get it, live or catching up; with the key and
/// kind to filter it by. Nothing decoded is kept, so what it holds is what
/// it counts ([`SharedEventData::held_bytes`]).
#[derive(Debug)]
struct SharedEventData {
    key: Bytes,
    is_put: bool,
    revision: i64,
    /// Encoded without (`[0]`) and with (`[1]`) the previous value: the
    /// same bytes when there is none.
    wire: [WireEvent; 2],
}

impl SharedEventData {
    fn new(event: &Event) -> SharedEvent {
        let with_prev = encode_event(event);
        let without_prev = if event.prev_kv.is_some() {
            encode_event(&Event {
                prev_kv: None,
                ..event.clone()
            })
        } else {
            with_prev.clone()
        };
        let kv = event.kv.as_ref();
        Arc::new(SharedEventData {
            key: kv.map_or_else(Bytes::new, |kv| Bytes::copy_from_slice(&kv.key)),
            is_put: event.r#type == EventType::Put as i32,
            revision: kv.map_or(0, |kv| kv.mod_revision),
            wire: [without_prev, with_prev],
        })
    }

    /// The bytes a watcher with `prev_kv` counts for the event: its
    /// encoding, and the overhead.
    fn size(&self, prev_kv: bool) -> usize {
        self.wire[usize::from(prev_kv)].len() + SHARED_EVENT_OVERHEAD_BYTES
    }

    /// Everything the event holds: both encodings (once when they are the
    /// same), its key and the overhead.
    fn held_bytes(&self) -> usize {
        let [without_prev, with_prev] = &self.wire;
        let second = if without_prev.as_ptr() == with_prev.as_ptr() {
            0
        } else {
            without_prev.len()
        };
        with_prev.len() + second + self.key.len() + SHARED_EVENT_OVERHEAD_BYTES
    }

    /// The event as a watcher with `prev_kv` gets it.
    fn wire(&self, prev_kv: bool) -> WireEvent {
        self.wire[usize::from(prev_kv)].clone()
    }
}

/// One revision's events queued for a watcher.
#[derive(Debug)]
struct Queued {
    revision: i64,
    events: Vec<WireEvent>,
    /// What this entry counts against the watcher's bound.
    bytes: usize,
}

#[derive(Debug)]
struct Watcher {
    range: KeyRange,
    prev_kv: bool,
    no_put: bool,
    no_delete: bool,
    progress_notify: bool,
    /// Where it stands against the revisions applied.
    position: Position,
    /// Events per revision, oldest first.
    queued: VecDeque<Queued>,
    queued_events: usize,
    /// Sum of the `bytes` of `queued`.
    queued_bytes: usize,
    /// Whether events went out since the last periodic progress report.
    delivered_since_progress: bool,
}

/// Where a watcher stands against the revisions applied (see the module
/// docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Position {
    /// Has everything through [`Tracking::synced_revision`] queued or
    /// delivered, and is in the index.
    Synced,
    /// The first revision not yet queued for it: behind when at or below
    /// the store's revision, starting later when above.
    Next(i64),
}

/// A watcher, by stream and watch id.
type WatcherRef = (StreamId, i64);

/// Which watchers each applied revision concerns.
#[derive(Debug, Default)]
struct Tracking {
    /// The last revision synced watchers have.
    synced_revision: i64,
    /// Synced watchers of one key, by key.
    keys: HashMap<Vec<u8>, BTreeSet<WatcherRef>>,
    /// Synced watchers of a range or prefix, with their range.
    ranges: BTreeMap<WatcherRef, KeyRange>,
    /// Watchers that start at a revision still to come, by it.
    starting: BTreeMap<i64, BTreeSet<WatcherRef>>,
}

impl Tracking {
    /// Files a watcher where its position says (a watcher whose next
    /// revision is the next to come is synced).
    fn track(&mut self, at: WatcherRef, watcher: &mut Watcher) {
        if watcher.position == Position::Next(self.synced_revision + 1) {
            watcher.position = Position::Synced;
        }
        match watcher.position {
            Position::Synced => match watcher.range.end {
                RangeEnd::Single => {
                    self.keys
                        .entry(watcher.range.start.clone())
                        .or_default()
                        .insert(at);
                }
                RangeEnd::Unbounded | RangeEnd::Before(_) => {
                    self.ranges.insert(at, watcher.range.clone());
                }
            },
            Position::Next(next) if next > self.synced_revision + 1 => {
                self.starting.entry(next).or_default().insert(at);
            }
            Position::Next(_) => {}
        }
    }

    /// Takes a watcher out of wherever [`Tracking::track`] filed it.
    fn untrack(&mut self, at: WatcherRef, watcher: &Watcher) {
        match watcher.position {
            Position::Synced => match watcher.range.end {
                RangeEnd::Single => {
                    if let Some(set) = self.keys.get_mut(&watcher.range.start) {
                        set.remove(&at);
                        if set.is_empty() {
                            self.keys.remove(&watcher.range.start);
                        }
                    }
                }
                RangeEnd::Unbounded | RangeEnd::Before(_) => {
                    self.ranges.remove(&at);
                }
            },
            Position::Next(next) => {
                if let Some(set) = self.starting.get_mut(&next) {
                    set.remove(&at);
                    if set.is_empty() {
                        self.starting.remove(&next);
                    }
                }
            }
        }
    }

    /// Calls `found` for each synced watcher whose range holds `key`.
    fn synced_holding(&self, key: &[u8], mut found: impl FnMut(WatcherRef)) {
        if let Some(set) = self.keys.get(key) {
            set.iter().copied().for_each(&mut found);
        }
        for (at, range) in &self.ranges {
            if range.contains(key) {
                found(*at);
            }
        }
    }
}

impl Watcher {
    /// The first revision not yet queued for it.
    fn next_revision(&self, synced_revision: i64) -> i64 {
        match self.position {
            Position::Synced => synced_revision + 1,
            Position::Next(next) => next,
        }
    }

    fn wants(&self, event: &SharedEventData) -> bool {
        let filtered = if event.is_put {
            self.no_put
        } else {
            self.no_delete
        };
        !filtered && self.range.contains(&event.key)
    }
}

/// A revision's events held for the watchers of one stream.
#[derive(Debug, Default)]
struct Held {
    /// Bytes of the distinct events of the revision the stream's watchers
    /// queued, each counted once.
    event_bytes: usize,
    /// Watchers that have the revision queued.
    holders: usize,
}

#[derive(Debug)]
struct Stream {
    watchers: BTreeMap<i64, Watcher>,
    next_watch_id: i64,
    /// Control responses (created, cancelled, progress) in order.
    outbox: VecDeque<WatchResponseWire>,
    progress_requested: bool,
    wake: Arc<Notify>,
    /// What the stream's watchers hold queued.
    ledger: Ledger,
    /// The watch id a drain starts after, so that watchers take turns when
    /// one drain cannot serve them all.
    drain_after: i64,
}

/// The bytes one stream's watchers hold queued.
#[derive(Debug, Default)]
struct Ledger {
    /// Revisions whose events the stream's watchers hold.
    held: BTreeMap<i64, Held>,
    /// Bytes held: the distinct events of `held` plus each queue entry's
    /// overhead.
    queued_bytes: usize,
}

impl Ledger {
    /// Forgets one queue entry of a watcher: its overhead, and the
    /// revision's events once no watcher of the stream holds them.
    fn release(&mut self, node_queued_bytes: &mut usize, entry: &Queued) {
        let overhead = entry_overhead(entry.events.len());
        let mut freed = overhead;
        if let Some(held) = self.held.get_mut(&entry.revision) {
            held.holders = held.holders.saturating_sub(1);
            if held.holders == 0 {
                freed += held.event_bytes;
                self.held.remove(&entry.revision);
            }
        }
        self.queued_bytes = self.queued_bytes.saturating_sub(freed);
        *node_queued_bytes = node_queued_bytes.saturating_sub(freed);
    }

    /// Forgets everything a watcher holds queued.
    fn release_watcher(&mut self, node_queued_bytes: &mut usize, watcher: &mut Watcher) {
        for entry in watcher.queued.drain(..) {
            self.release(node_queued_bytes, &entry);
        }
        watcher.queued_events = 0;
        watcher.queued_bytes = 0;
    }
}

/// Adds a watcher's events of one revision to `out`: to the last response
/// when that holds the same watcher's earlier events and fewer than
/// [`RESPONSE_EVENTS_BYTES_MAX`] bytes of them, else as a response of its
/// own. `open` is the event bytes of the last response when this function
/// pushed it (`None` when the last one is a control response).
fn push_events(
    out: &mut Vec<WatchResponseWire>,
    open: &mut Option<usize>,
    watch_id: i64,
    revision: i64,
    events: Vec<WireEvent>,
    bytes: usize,
) {
    if let (Some(open_bytes), Some(last)) = (open.as_mut(), out.last_mut()) {
        if last.watch_id == watch_id && *open_bytes < RESPONSE_EVENTS_BYTES_MAX {
            last.events.extend(events);
            last.header = header(revision);
            *open_bytes = open_bytes.saturating_add(bytes);
            return;
        }
    }
    out.push(WatchResponseWire {
        header: header(revision),
        watch_id,
        events,
        ..WatchResponseWire::default()
    });
    *open = Some(bytes);
}

impl WatchResponseWire {
    /// The response as etcd's message, its events decoded: for the JSON
    /// gateway and for tests; the gRPC service sends the bytes as they are.
    pub fn into_response(self) -> Result<WatchResponse, prost::DecodeError> {
        let events = self
            .events
            .into_iter()
            .map(Event::decode)
            .collect::<Result<Vec<Event>, _>>()?;
        Ok(WatchResponse {
            header: self.header,
            watch_id: self.watch_id,
            created: self.created,
            canceled: self.canceled,
            compact_revision: self.compact_revision,
            cancel_reason: self.cancel_reason,
            fragment: self.fragment,
            events,
        })
    }
}

fn entry_overhead(events: usize) -> usize {
    QUEUE_ENTRY_OVERHEAD_BYTES + QUEUE_EVENT_POINTER_BYTES * events
}

/// Every watcher of every stream on this node.
#[derive(Debug, Default)]
pub struct WatchHub {
    streams: BTreeMap<StreamId, Stream>,
    next_stream_id: StreamId,
    limits: WatchLimits,
    /// Bytes queued on this node: the sum of the streams' `queued_bytes`.
    queued_bytes: usize,
    tracking: Tracking,
    recent: Recent,
    /// Catch-ups served from `recent`, and from the store's history.
    catch_ups_from_recent: u64,
    catch_ups_from_store: u64,
}

/// The events of the last revisions, every one through
/// [`Tracking::synced_revision`] with none missing, oldest first, each with
/// its previous value; at most [`WatchLimits::recent_bytes_max`] bytes.
#[derive(Debug, Default)]
struct Recent {
    revisions: VecDeque<(i64, Vec<SharedEvent>)>,
    bytes: usize,
}

impl Recent {
    fn clear(&mut self) {
        self.revisions.clear();
        self.bytes = 0;
    }

    /// Adds the next revision's events, dropping the oldest past the bound.
    fn push(&mut self, revision: i64, events: Vec<(SharedEvent, usize)>, bytes_max: usize) {
        debug_assert!(self
            .revisions
            .back()
            .is_none_or(|(last, _)| *last + 1 == revision));
        let bytes: usize = events.iter().map(|(_, size)| size).sum();
        self.bytes += bytes;
        self.revisions.push_back((
            revision,
            events.into_iter().map(|(event, _)| event).collect(),
        ));
        while self.bytes > bytes_max {
            let Some((_, dropped)) = self.revisions.pop_front() else {
                break;
            };
            self.bytes = self
                .bytes
                .saturating_sub(dropped.iter().map(|e| e.held_bytes()).sum::<usize>());
        }
    }

    /// The events of `range` from revision `from` through `to`, cut as the
    /// store's history is (at a revision boundary, once `events_max` events
    /// or `bytes_max` bytes are in); `None` when the ring does not hold
    /// every revision from `from` through `to`.
    fn history(
        &self,
        range: &KeyRange,
        from: i64,
        to: i64,
        events_max: usize,
        bytes_max: usize,
    ) -> Option<Vec<SharedEvent>> {
        let (first, _) = self.revisions.front()?;
        let (last, _) = self.revisions.back()?;
        if from < *first || *last != to {
            return None;
        }
        let skip = usize::try_from(from - first).ok()?;
        let mut events = Vec::new();
        let mut bytes = 0usize;
        for (revision, revision_events) in self.revisions.iter().skip(skip) {
            let mut started = false;
            for event in revision_events {
                if !range.contains(&event.key) {
                    continue;
                }
                if !started && (events.len() >= events_max || bytes >= bytes_max) {
                    return Some(events);
                }
                started = true;
                debug_assert_eq!(event.revision, *revision);
                bytes = bytes.saturating_add(event.size(true));
                events.push(event.clone());
            }
        }
        Some(events)
    }
}

fn header(revision: i64) -> Option<ResponseHeader> {
    Some(ResponseHeader {
        revision,
        ..ResponseHeader::default()
    })
}

/// The response that cancels watcher `watch_id` at revision `current`,
/// saying why (and, for a compaction, from where the client may resume).
fn cancellation(
    watch_id: i64,
    current: i64,
    reason: String,
    compact_revision: i64,
) -> (i64, WatchResponseWire) {
    (
        watch_id,
        WatchResponseWire {
            header: header(current),
            watch_id,
            canceled: true,
            compact_revision,
            cancel_reason: reason,
            ..WatchResponseWire::default()
        },
    )
}

/// A revision's events as notify shares them: each made a
/// [`SharedEventData`] the first time a watcher (or the ring) wants it.
struct SharedRevision<'a> {
    events: &'a [Event],
    shared: Vec<Option<SharedEvent>>,
}

impl<'a> SharedRevision<'a> {
    fn new(events: &'a [Event]) -> SharedRevision<'a> {
        SharedRevision {
            events,
            // Filled on first use: most revisions reach no watcher, and a
            // node without any would pay an allocation per revision.
            shared: Vec::new(),
        }
    }

    /// The shared event `index`.
    fn shared(&mut self, index: usize) -> Option<&SharedEvent> {
        let event = self.events.get(index)?;
        if self.shared.is_empty() {
            self.shared.resize(self.events.len(), None);
        }
        let slot = self.shared.get_mut(index)?;
        Some(slot.get_or_insert_with(|| SharedEventData::new(event)))
    }

    /// The event `index` as a watcher with `prev_kv` gets it, encoded, and
    /// the size it counts.
    fn get(&mut self, index: usize, prev_kv: bool) -> Option<(WireEvent, usize)> {
        let shared = self.shared(index)?;
        Some((shared.wire(prev_kv), shared.size(prev_kv)))
    }

    /// The shared event `index`, for the ring, and its size there.
    fn recent(&mut self, index: usize) -> Option<(SharedEvent, usize)> {
        let shared = self.shared(index)?;
        Some((shared.clone(), shared.held_bytes()))
    }
}

/// The key of a history scan shared by watchers in one drain: range, first
/// revision and whether its events carry previous values.
type ScanKey = (Vec<u8>, RangeEnd, i64, bool);

/// What one history scan found, shared by the watchers that asked for it.
struct Scan {
    events: Vec<SharedEvent>,
    /// Whether the scan reached the present (the batch bound did not cut).
    complete: bool,
}

impl WatchHub {
    /// An empty hub.
    pub fn new(limits: WatchLimits) -> WatchHub {
        WatchHub {
            streams: BTreeMap::new(),
            next_stream_id: 1,
            limits,
            queued_bytes: 0,
            tracking: Tracking::default(),
            recent: Recent::default(),
            catch_ups_from_recent: 0,
            catch_ups_from_store: 0,
        }
    }

    /// Catch-up batches served from the last revisions kept in memory, and
    /// from the store's history (for metrics and tests).
    pub fn catch_ups(&self) -> (u64, u64) {
        (self.catch_ups_from_recent, self.catch_ups_from_store)
    }

    /// Makes `current` the revision synced watchers have, when the
    /// revisions seen did not follow on (the first call, a state replaced
    /// by a snapshot, a revision without events): every watcher synced
    /// before has everything through the old revision only, so it is filed
    /// again from there (behind, to catch up from history, or waiting).
    fn align(&mut self, current: i64) {
        let tracking = &mut self.tracking;
        if tracking.synced_revision == current {
            return;
        }
        let had = tracking.synced_revision;
        // The revisions kept no longer lead up to the present.
        self.recent.clear();
        *tracking = Tracking {
            synced_revision: current,
            ..Tracking::default()
        };
        for (stream_id, stream) in &mut self.streams {
            for (watch_id, watcher) in &mut stream.watchers {
                if watcher.position == Position::Synced {
                    watcher.position = Position::Next(had + 1);
                }
                tracking.track((*stream_id, *watch_id), watcher);
            }
        }
    }

    /// Registers a client stream; the returned `Notify` fires when the
    /// stream has something to drain. `None` when `streams_max` streams are
    /// open already.
    pub fn open_stream(&mut self) -> Option<(StreamId, Arc<Notify>)> {
        if self.streams.len() >= self.limits.streams_max {
            return None;
        }
        let id = self.next_stream_id;
        self.next_stream_id += 1;
        let wake = Arc::new(Notify::new());
        self.streams.insert(
            id,
            Stream {
                watchers: BTreeMap::new(),
                next_watch_id: 0,
                outbox: VecDeque::new(),
                progress_requested: false,
                wake: wake.clone(),
                ledger: Ledger::default(),
                drain_after: -1,
            },
        );
        Some((id, wake))
    }

    /// Control responses waiting on a stream; the stream task flushes before
    /// reading more requests when this grows, which bounds the outbox.
    pub fn outbox_len(&self, stream_id: StreamId) -> usize {
        self.streams.get(&stream_id).map_or(0, |s| s.outbox.len())
    }

    /// Drops a stream and all its watchers, and what they had queued.
    pub fn close_stream(&mut self, stream_id: StreamId) {
        if let Some(stream) = self.streams.remove(&stream_id) {
            for (watch_id, watcher) in &stream.watchers {
                self.tracking.untrack((stream_id, *watch_id), watcher);
            }
            self.queued_bytes = self.queued_bytes.saturating_sub(stream.ledger.queued_bytes);
        }
    }

    /// Number of watchers on all streams.
    pub fn watcher_count(&self) -> usize {
        self.streams.values().map(|s| s.watchers.len()).sum()
    }

    /// Bytes of events queued on this node (see [`WatchLimits`]).
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// Bytes of events queued for one stream, shared events counted once.
    pub fn stream_queued_bytes(&self, stream_id: StreamId) -> usize {
        self.streams
            .get(&stream_id)
            .map_or(0, |s| s.ledger.queued_bytes)
    }

    /// Number of watchers that are behind `current_revision` and will catch
    /// up from history (for metrics and tests).
    pub fn behind_count(&self, current_revision: i64) -> usize {
        let synced = self.tracking.synced_revision;
        self.streams
            .values()
            .flat_map(|s| s.watchers.values())
            .filter(|w| w.next_revision(synced) <= current_revision)
            .count()
    }

    /// Creates a watcher. Its answer (created, and cancelled if its start
    /// revision is compacted) goes to the stream's outbox.
    pub fn create(&mut self, stream_id: StreamId, request: &WatchCreateRequest, store: &MvccStore) {
        let limits = self.limits.clone();
        let current = store.revision();
        self.align(current);
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        let refuse = |watch_id: i64, reason: String| WatchResponseWire {
            header: header(current),
            watch_id,
            created: true,
            canceled: true,
            cancel_reason: reason,
            ..WatchResponseWire::default()
        };
        if stream.watchers.len() >= limits.watchers_per_stream_max {
            stream.outbox.push_back(refuse(
                STREAM_WATCH_ID,
                format!(
                    "ferry: too many watchers on one stream (limit {})",
                    limits.watchers_per_stream_max
                ),
            ));
            stream.wake.notify_one();
            return;
        }
        if request.watch_id < 0 {
            stream.outbox.push_back(refuse(
                request.watch_id,
                format!(
                    "ferry: watch id {} is negative; use 0 to let the server choose",
                    request.watch_id
                ),
            ));
            stream.wake.notify_one();
            return;
        }
        let watch_id = if request.watch_id != 0 {
            if stream.watchers.contains_key(&request.watch_id) {
                stream.outbox.push_back(refuse(
                    request.watch_id,
                    "etcdserver: mvcc: watcher ID already exists".to_string(),
                ));
                stream.wake.notify_one();
                return;
            }
            request.watch_id
        } else {
            while stream.watchers.contains_key(&stream.next_watch_id) {
                stream.next_watch_id += 1;
            }
            let id = stream.next_watch_id;
            stream.next_watch_id += 1;
            id
        };
        let next_revision = if request.start_revision > 0 {
            request.start_revision
        } else {
            current + 1
        };
        let filters: Vec<i32> = request.filters.clone();
        let mut watcher = Watcher {
            range: KeyRange::new(&request.key, &request.range_end),
            prev_kv: request.prev_kv,
            no_put: filters.contains(&(FilterType::Noput as i32)),
            no_delete: filters.contains(&(FilterType::Nodelete as i32)),
            progress_notify: request.progress_notify,
            position: Position::Next(next_revision),
            queued: VecDeque::new(),
            queued_events: 0,
            queued_bytes: 0,
            delivered_since_progress: false,
        };
        self.tracking.track((stream_id, watch_id), &mut watcher);
        stream.watchers.insert(watch_id, watcher);
        stream.outbox.push_back(WatchResponseWire {
            header: header(current),
            watch_id,
            created: true,
            ..WatchResponseWire::default()
        });
        stream.wake.notify_one();
    }

    /// Answers a create request with a refusal: created and cancelled at
    /// once, with `reason` (etcd's answer to a watch without permission).
    pub fn refuse(&mut self, stream_id: StreamId, watch_id: i64, reason: &str, revision: i64) {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        stream.outbox.push_back(WatchResponseWire {
            header: header(revision),
            watch_id,
            created: true,
            canceled: true,
            cancel_reason: reason.to_string(),
            ..WatchResponseWire::default()
        });
        stream.wake.notify_one();
    }

    /// Cancels every watcher of the stream whose (key, range_end)
    /// `permitted` refuses, telling the client `reason`; their queued
    /// events are dropped unsent.
    pub fn retain(
        &mut self,
        stream_id: StreamId,
        permitted: impl Fn(&[u8], &[u8]) -> bool,
        reason: &str,
        store: &MvccStore,
    ) {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        let refused: Vec<i64> = stream
            .watchers
            .iter()
            .filter(|(_, watcher)| {
                let range = &watcher.range;
                let range_end: &[u8] = match &range.end {
                    RangeEnd::Single => &[],
                    RangeEnd::Unbounded => &[0],
                    RangeEnd::Before(end) => end,
                };
                !permitted(&range.start, range_end)
            })
            .map(|(id, _)| *id)
            .collect();
        for watch_id in refused {
            if let Some(mut watcher) = stream.watchers.remove(&watch_id) {
                self.tracking.untrack((stream_id, watch_id), &watcher);
                stream
                    .ledger
                    .release_watcher(&mut self.queued_bytes, &mut watcher);
                stream.outbox.push_back(WatchResponseWire {
                    header: header(store.revision()),
                    watch_id,
                    canceled: true,
                    cancel_reason: reason.to_string(),
                    ..WatchResponseWire::default()
                });
                stream.wake.notify_one();
            }
        }
    }

    /// Cancels a watcher at the client's request. Unknown ids are ignored,
    /// as etcd does.
    pub fn cancel(&mut self, stream_id: StreamId, watch_id: i64, store: &MvccStore) {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        if let Some(mut watcher) = stream.watchers.remove(&watch_id) {
            self.tracking.untrack((stream_id, watch_id), &watcher);
            stream
                .ledger
                .release_watcher(&mut self.queued_bytes, &mut watcher);
            stream.outbox.push_back(WatchResponseWire {
                header: header(store.revision()),
                watch_id,
                canceled: true,
                ..WatchResponseWire::default()
            });
            stream.wake.notify_one();
        }
    }

    /// Asks for one progress report on the whole stream; it is sent once
    /// every watcher of the stream has delivered everything up to the
    /// reported revision.
    pub fn request_progress(&mut self, stream_id: StreamId) {
        if let Some(stream) = self.streams.get_mut(&stream_id) {
            stream.progress_requested = true;
            stream.wake.notify_one();
        }
    }

    /// Periodic progress for watchers that asked for it and had nothing to
    /// deliver since the last period.
    pub fn progress_tick(&mut self, stream_id: StreamId, store: &MvccStore) {
        let current = store.revision();
        self.align(current);
        let synced = self.tracking.synced_revision;
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        let mut any = false;
        for (watch_id, watcher) in &mut stream.watchers {
            if !watcher.progress_notify {
                continue;
            }
            let idle = !watcher.delivered_since_progress && watcher.queued.is_empty();
            watcher.delivered_since_progress = false;
            if idle && watcher.next_revision(synced) > current {
                stream.outbox.push_back(WatchResponseWire {
                    header: header(current),
                    watch_id: *watch_id,
                    ..WatchResponseWire::default()
                });
                any = true;
            }
        }
        if any {
            stream.wake.notify_one();
        }
    }

    /// Hands the events of a just-committed revision to synced watchers.
    /// Each event is encoded once with and once without its previous value
    /// (one encoding when it has none), however many watchers queue it.
    pub fn notify(&mut self, revision: i64, events: &[Event]) {
        if revision != self.tracking.synced_revision + 1 {
            self.align(revision - 1);
        }
        let WatchHub {
            streams,
            limits,
            queued_bytes: node_queued_bytes,
            tracking,
            recent,
            ..
        } = self;
        // Watchers that start at this revision are synced from here.
        for at in tracking.starting.remove(&revision).unwrap_or_default() {
            if let Some(watcher) = streams
                .get_mut(&at.0)
                .and_then(|stream| stream.watchers.get_mut(&at.1))
            {
                tracking.track(at, watcher);
            }
        }
        // The synced watchers some event concerns, and which events, by
        // stream and watch id.
        let mut concerned: BTreeMap<StreamId, BTreeMap<i64, Vec<usize>>> = BTreeMap::new();
        for (index, event) in events.iter().enumerate() {
            let Some(kv) = event.kv.as_ref() else {
                continue;
            };
            tracking.synced_holding(&kv.key, |(stream_id, watch_id)| {
                concerned
                    .entry(stream_id)
                    .or_default()
                    .entry(watch_id)
                    .or_default()
                    .push(index);
            });
        }
        tracking.synced_revision = revision;
        let mut shared = SharedRevision::new(events);
        // Kept while anyone watches (with the previous values: the events
        // a watcher with prev_kv gets; the others' are cut from them).
        if streams.is_empty() || limits.recent_bytes_max == 0 {
            recent.clear();
        } else {
            let kept = (0..events.len())
                .filter_map(|index| shared.recent(index))
                .collect();
            recent.push(revision, kept, limits.recent_bytes_max);
        }
        for (stream_id, watchers) in concerned {
            let Some(stream) = streams.get_mut(&stream_id) else {
                continue;
            };
            let mut woke = false;
            let ledger = &mut stream.ledger;
            // Which shared events this stream already counts, per variant.
            let mut counted: Vec<[bool; 2]> = vec![[false; 2]; events.len()];
            for (watch_id, indexes) in watchers {
                let Some(watcher) = stream.watchers.get_mut(&watch_id) else {
                    continue;
                };
                debug_assert_eq!(watcher.position, Position::Synced);
                let wanted: Vec<usize> = indexes
                    .into_iter()
                    .filter(|&i| shared.shared(i).is_some_and(|e| watcher.wants(e)))
                    .collect();
                if wanted.is_empty() {
                    // Filtered out: it stays synced.
                    continue;
                }
                let variant = usize::from(watcher.prev_kv);
                let mut batch = Vec::with_capacity(wanted.len());
                let mut watcher_bytes = entry_overhead(wanted.len());
                let mut new_event_bytes = 0usize;
                for &index in &wanted {
                    let Some((event, size)) = shared.get(index, watcher.prev_kv) else {
                        continue;
                    };
                    watcher_bytes += size;
                    if !counted[index][variant] {
                        new_event_bytes += size;
                    }
                    batch.push(event);
                }
                let stream_bytes = entry_overhead(batch.len()) + new_event_bytes;
                let fits_watcher = watcher.queued.is_empty()
                    || (watcher.queued_events + batch.len() <= limits.events_per_watcher_max
                        && watcher.queued_bytes + watcher_bytes <= limits.watcher_queued_bytes_max);
                let fits_stream = ledger.queued_bytes == 0
                    || ledger.queued_bytes + stream_bytes <= limits.stream_queued_bytes_max;
                let fits_node = *node_queued_bytes == 0
                    || *node_queued_bytes + stream_bytes <= limits.node_queued_bytes_max;
                if !(fits_watcher && fits_stream && fits_node) {
                    // Full: the watcher is now behind and will read this
                    // revision from history.
                    tracking.untrack((stream_id, watch_id), watcher);
                    watcher.position = Position::Next(revision);
                    woke = true;
                    continue;
                }
                for &index in &wanted {
                    if let Some(slot) = counted.get_mut(index) {
                        slot[variant] = true;
                    }
                }
                let held = ledger.held.entry(revision).or_default();
                held.event_bytes += new_event_bytes;
                held.holders += 1;
                ledger.queued_bytes += stream_bytes;
                *node_queued_bytes += stream_bytes;
                watcher.queued_events += batch.len();
                watcher.queued_bytes += watcher_bytes;
                watcher.queued.push_back(Queued {
                    revision,
                    events: batch,
                    bytes: watcher_bytes,
                });
                woke = true;
            }
            if woke {
                stream.wake.notify_one();
            }
        }
    }

    /// Wakes every stream, e.g. after a snapshot replaced the store.
    pub fn wake_all(&self) {
        for stream in self.streams.values() {
            stream.wake.notify_one();
        }
    }

    /// Takes what the stream should send now, in order: control responses,
    /// then each watcher's events, catching up lagging watchers from the
    /// store's history. Returns `true` as the second value when a watcher is
    /// still behind or has more queued than one drain hands out, so the
    /// caller should drain again after sending.
    ///
    /// One drain hands out about [`WatchLimits::drain_bytes_max`] bytes and
    /// runs at most [`WatchLimits::history_scans_per_drain_max`] history
    /// scans; watchers take turns across drains.
    pub fn drain(
        &mut self,
        stream_id: StreamId,
        store: &MvccStore,
    ) -> (Vec<WatchResponseWire>, bool) {
        let limits = self.limits.clone();
        let current = store.revision();
        self.align(current);
        let tracking = &mut self.tracking;
        let synced = tracking.synced_revision;
        let node_queued_bytes = &mut self.queued_bytes;
        let recent = &self.recent;
        let catch_ups_from_recent = &mut self.catch_ups_from_recent;
        let catch_ups_from_store = &mut self.catch_ups_from_store;
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return (Vec::new(), false);
        };
        let compacted = store.compacted_revision();
        let mut out: Vec<WatchResponseWire> = stream.outbox.drain(..).collect();
        // The response the next events of the same watcher may join.
        let mut open: Option<usize> = None;
        let mut out_bytes = 0usize;
        let mut cancelled: Vec<(i64, WatchResponseWire)> = Vec::new();
        let mut behind = false;
        let mut scans: BTreeMap<ScanKey, Scan> = BTreeMap::new();
        let mut scans_run = 0usize;
        // Watchers in turn, starting after the one the last drain ended at.
        // (Bounds, not `drain_after + 1`: a client picks watch ids, up to
        // i64::MAX, and one past it does not exist.)
        let after = (Bound::Excluded(stream.drain_after), Bound::Unbounded);
        let order: Vec<i64> = stream
            .watchers
            .range(after)
            .chain(stream.watchers.range(..=stream.drain_after))
            .map(|(id, _)| *id)
            .collect();
        let Stream {
            watchers,
            ledger,
            drain_after,
            ..
        } = stream;
        for watch_id in order {
            if out_bytes >= limits.drain_bytes_max {
                behind = true;
                break;
            }
            *drain_after = watch_id;
            let Some(watcher) = watchers.get_mut(&watch_id) else {
                continue;
            };
            while out_bytes < limits.drain_bytes_max {
                let Some(entry) = watcher.queued.pop_front() else {
                    break;
                };
                watcher.queued_events = watcher.queued_events.saturating_sub(entry.events.len());
                watcher.queued_bytes = watcher.queued_bytes.saturating_sub(entry.bytes);
                watcher.delivered_since_progress = true;
                out_bytes = out_bytes.saturating_add(entry.bytes);
                ledger.release(node_queued_bytes, &entry);
                push_events(
                    &mut out,
                    &mut open,
                    watch_id,
                    entry.revision,
                    entry.events,
                    entry.bytes,
                );
            }
            if !watcher.queued.is_empty() {
                behind = true;
                continue;
            }
            let next_revision = watcher.next_revision(synced);
            if next_revision > current {
                continue;
            }
            if next_revision < compacted {
                cancelled.push(cancellation(
                    watch_id,
                    current,
                    COMPACTED_REASON.to_string(),
                    compacted,
                ));
                continue;
            }
            if current - next_revision > limits.lag_revisions_max {
                cancelled.push(cancellation(
                    watch_id,
                    current,
                    format!(
                        "ferry: watcher too slow: {} revisions behind (limit {})",
                        current - next_revision,
                        limits.lag_revisions_max
                    ),
                    0,
                ));
                continue;
            }
            // Catch up from history, one bounded batch per drain, sharing
            // the scan with watchers of the same range and revision.
            let key: ScanKey = (
                watcher.range.start.clone(),
                watcher.range.end.clone(),
                next_revision,
                watcher.prev_kv,
            );
            if !scans.contains_key(&key) {
                if scans_run >= limits.history_scans_per_drain_max {
                    behind = true;
                    continue;
                }
                scans_run += 1;
                let from_recent = recent.history(
                    &watcher.range,
                    next_revision,
                    current,
                    limits.events_per_watcher_max,
                    limits.drain_bytes_max,
                );
                let history = match from_recent {
                    Some(history) => {
                        *catch_ups_from_recent += 1;
                        Ok(history)
                    }
                    None => {
                        *catch_ups_from_store += 1;
                        store
                            .history(
                                &watcher.range,
                                next_revision,
                                current,
                                limits.events_per_watcher_max,
                                limits.drain_bytes_max,
                                watcher.prev_kv,
                            )
                            .map(|events| events.iter().map(SharedEventData::new).collect())
                    }
                };
                let history: Vec<SharedEvent> = match history {
                    Ok(history) => history,
                    Err(error) => {
                        // This member cannot read its history: the client
                        // watches again, elsewhere.
                        cancelled.push(cancellation(watch_id, current, error.to_string(), 0));
                        continue;
                    }
                };
                let complete = history.len() < limits.events_per_watcher_max
                    && history.iter().map(|e| e.size(true)).sum::<usize>() < limits.drain_bytes_max;
                scans.insert(
                    key.clone(),
                    Scan {
                        events: history,
                        complete,
                    },
                );
            }
            let Some(scan) = scans.get(&key) else {
                continue;
            };
            let mut last_revision = next_revision - 1;
            let mut batch: Vec<WireEvent> = Vec::new();
            let mut batch_bytes = 0usize;
            let mut batch_revision = 0;
            for event in scan.events.iter() {
                let revision = event.revision;
                if revision != batch_revision && !batch.is_empty() {
                    let events = std::mem::take(&mut batch);
                    push_events(
                        &mut out,
                        &mut open,
                        watch_id,
                        batch_revision,
                        events,
                        batch_bytes,
                    );
                    batch_bytes = 0;
                }
                batch_revision = revision;
                last_revision = revision;
                if watcher.wants(event) {
                    let size = event.size(watcher.prev_kv);
                    out_bytes = out_bytes.saturating_add(size);
                    batch_bytes = batch_bytes.saturating_add(size);
                    batch.push(event.wire(watcher.prev_kv));
                }
            }
            if !batch.is_empty() {
                push_events(
                    &mut out,
                    &mut open,
                    watch_id,
                    batch_revision,
                    batch,
                    batch_bytes,
                );
            }
            watcher.delivered_since_progress = true;
            // Behind until here, so in no index: synced again when the
            // scan reached the present.
            if scan.complete {
                watcher.position = Position::Next(current + 1);
                tracking.track((stream_id, watch_id), watcher);
            } else {
                watcher.position = Position::Next(last_revision + 1);
                behind = true;
            }
        }
        for (watch_id, response) in cancelled {
            if let Some(mut watcher) = watchers.remove(&watch_id) {
                tracking.untrack((stream_id, watch_id), &watcher);
                ledger.release_watcher(node_queued_bytes, &mut watcher);
            }
            out.push(response);
        }
        if stream.progress_requested && !behind {
            let all_synced = watchers
                .values()
                .all(|w| w.next_revision(synced) > current && w.queued.is_empty());
            if all_synced {
                stream.progress_requested = false;
                out.push(WatchResponseWire {
                    header: header(current),
                    watch_id: STREAM_WATCH_ID,
                    ..WatchResponseWire::default()
                });
            }
        }
        (out, behind)
    }
}
