//! The watch hub: delivers store changes to watchers in revision order,
//! with no gap and no duplicate, without ever making the store wait.
//!
//! Every watcher remembers the next revision it must deliver
//! (`next_revision`). A watcher whose `next_revision` is the revision being
//! applied is *synced*: it receives that revision's events directly into its
//! own bounded queue. A watcher that started in the past, or whose queue was
//! full because its client reads slowly, falls *behind*: it is skipped by
//! live delivery and catches up from the MVCC history when its stream drains
//! it, a bounded batch at a time, until it is synced again. So the store
//! never blocks on a watcher and a watcher's memory is bounded. A watcher
//! that falls behind the compacted revision, or more than
//! `lag_revisions_max` behind the store, is cancelled with a reason.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::mvcc::{KeyRange, MvccStore};
use crate::pb::etcdserverpb::watch_create_request::FilterType;
use crate::pb::etcdserverpb::{ResponseHeader, WatchCreateRequest, WatchResponse};
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
    /// Events a watcher may have queued before it falls behind.
    pub events_per_watcher_max: usize,
    /// Watchers one stream may hold.
    pub watchers_per_stream_max: usize,
    /// How far behind the store a watcher may fall before it is cancelled.
    pub lag_revisions_max: i64,
    /// Watch streams open at once on this node.
    pub streams_max: usize,
}

impl Default for WatchLimits {
    fn default() -> Self {
        WatchLimits {
            events_per_watcher_max: 1024,
            watchers_per_stream_max: 4096,
            lag_revisions_max: 1_000_000,
            streams_max: 65_536,
        }
    }
}

#[derive(Debug)]
struct Watcher {
    range: KeyRange,
    prev_kv: bool,
    no_put: bool,
    no_delete: bool,
    progress_notify: bool,
    /// First revision not yet queued for this watcher.
    next_revision: i64,
    /// Events per revision, oldest first.
    queued: VecDeque<(i64, Vec<Event>)>,
    queued_events: usize,
    /// Whether events went out since the last periodic progress report.
    delivered_since_progress: bool,
}

impl Watcher {
    fn wants(&self, event: &Event) -> bool {
        let is_put = event.r#type == EventType::Put as i32;
        if (is_put && self.no_put) || (!is_put && self.no_delete) {
            return false;
        }
        event
            .kv
            .as_ref()
            .is_some_and(|kv| self.range.contains(&kv.key))
    }

    fn shape(&self, event: &Event) -> Event {
        let mut event = event.clone();
        if !self.prev_kv {
            event.prev_kv = None;
        }
        event
    }
}

#[derive(Debug)]
struct Stream {
    watchers: BTreeMap<i64, Watcher>,
    next_watch_id: i64,
    /// Control responses (created, cancelled, progress) in order.
    outbox: VecDeque<WatchResponse>,
    progress_requested: bool,
    wake: Arc<Notify>,
}

/// Every watcher of every stream on this node.
#[derive(Debug, Default)]
pub struct WatchHub {
    streams: BTreeMap<StreamId, Stream>,
    next_stream_id: StreamId,
    limits: WatchLimits,
}

fn header(revision: i64) -> Option<ResponseHeader> {
    Some(ResponseHeader {
        revision,
        ..ResponseHeader::default()
    })
}

impl WatchHub {
    /// An empty hub.
    pub fn new(limits: WatchLimits) -> WatchHub {
        WatchHub {
            streams: BTreeMap::new(),
            next_stream_id: 1,
            limits,
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
            },
        );
        Some((id, wake))
    }

    /// Control responses waiting on a stream; the stream task flushes before
    /// reading more requests when this grows, which bounds the outbox.
    pub fn outbox_len(&self, stream_id: StreamId) -> usize {
        self.streams.get(&stream_id).map_or(0, |s| s.outbox.len())
    }

    /// Drops a stream and all its watchers.
    pub fn close_stream(&mut self, stream_id: StreamId) {
        self.streams.remove(&stream_id);
    }

    /// Number of watchers on all streams.
    pub fn watcher_count(&self) -> usize {
        self.streams.values().map(|s| s.watchers.len()).sum()
    }

    /// Number of watchers that are behind `current_revision` and will catch
    /// up from history (for metrics and tests).
    pub fn behind_count(&self, current_revision: i64) -> usize {
        self.streams
            .values()
            .flat_map(|s| s.watchers.values())
            .filter(|w| w.next_revision <= current_revision)
            .count()
    }

    /// Creates a watcher. Its answer (created, and cancelled if its start
    /// revision is compacted) goes to the stream's outbox.
    pub fn create(&mut self, stream_id: StreamId, request: &WatchCreateRequest, store: &MvccStore) {
        let limits = self.limits.clone();
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        let current = store.revision();
        let refuse = |watch_id: i64, reason: String| WatchResponse {
            header: header(current),
            watch_id,
            created: true,
            canceled: true,
            cancel_reason: reason,
            ..WatchResponse::default()
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
        stream.watchers.insert(
            watch_id,
            Watcher {
                range: KeyRange::new(&request.key, &request.range_end),
                prev_kv: request.prev_kv,
                no_put: filters.contains(&(FilterType::Noput as i32)),
                no_delete: filters.contains(&(FilterType::Nodelete as i32)),
                progress_notify: request.progress_notify,
                next_revision,
                queued: VecDeque::new(),
                queued_events: 0,
                delivered_since_progress: false,
            },
        );
        stream.outbox.push_back(WatchResponse {
            header: header(current),
            watch_id,
            created: true,
            ..WatchResponse::default()
        });
        stream.wake.notify_one();
    }

    /// Cancels a watcher at the client's request. Unknown ids are ignored,
    /// as etcd does.
    pub fn cancel(&mut self, stream_id: StreamId, watch_id: i64, store: &MvccStore) {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return;
        };
        if stream.watchers.remove(&watch_id).is_some() {
            stream.outbox.push_back(WatchResponse {
                header: header(store.revision()),
                watch_id,
                canceled: true,
                ..WatchResponse::default()
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
            if idle && watcher.next_revision > current {
                stream.outbox.push_back(WatchResponse {
                    header: header(current),
                    watch_id: *watch_id,
                    ..WatchResponse::default()
                });
                any = true;
            }
        }
        if any {
            stream.wake.notify_one();
        }
    }

    /// Hands the events of a just-committed revision to synced watchers.
    pub fn notify(&mut self, revision: i64, events: &[Event]) {
        let events_max = self.limits.events_per_watcher_max;
        for stream in self.streams.values_mut() {
            let mut woke = false;
            for watcher in stream.watchers.values_mut() {
                if watcher.next_revision != revision {
                    // Behind (catches up from history) or starts later.
                    continue;
                }
                let batch: Vec<Event> = events
                    .iter()
                    .filter(|e| watcher.wants(e))
                    .map(|e| watcher.shape(e))
                    .collect();
                if batch.is_empty() {
                    watcher.next_revision = revision + 1;
                    continue;
                }
                if !watcher.queued.is_empty() && watcher.queued_events + batch.len() > events_max {
                    // Full: leave next_revision here; the watcher is now
                    // behind and will read this revision from history.
                    woke = true;
                    continue;
                }
                watcher.queued_events += batch.len();
                watcher.queued.push_back((revision, batch));
                watcher.next_revision = revision + 1;
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
    /// still behind, so the caller should drain again after sending.
    pub fn drain(&mut self, stream_id: StreamId, store: &MvccStore) -> (Vec<WatchResponse>, bool) {
        let limits = self.limits.clone();
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return (Vec::new(), false);
        };
        let current = store.revision();
        let compacted = store.compacted_revision();
        let mut out: Vec<WatchResponse> = stream.outbox.drain(..).collect();
        let mut cancelled: Vec<(i64, WatchResponse)> = Vec::new();
        let mut behind = false;
        for (watch_id, watcher) in &mut stream.watchers {
            while let Some((revision, events)) = watcher.queued.pop_front() {
                watcher.delivered_since_progress = true;
                out.push(WatchResponse {
                    header: header(revision),
                    watch_id: *watch_id,
                    events,
                    ..WatchResponse::default()
                });
            }
            watcher.queued_events = 0;
            if watcher.next_revision > current {
                continue;
            }
            if watcher.next_revision < compacted {
                cancelled.push((
                    *watch_id,
                    WatchResponse {
                        header: header(current),
                        watch_id: *watch_id,
                        canceled: true,
                        compact_revision: compacted,
                        cancel_reason: COMPACTED_REASON.to_string(),
                        ..WatchResponse::default()
                    },
                ));
                continue;
            }
            if current - watcher.next_revision > limits.lag_revisions_max {
                cancelled.push((
                    *watch_id,
                    WatchResponse {
                        header: header(current),
                        watch_id: *watch_id,
                        canceled: true,
                        cancel_reason: format!(
                            "ferry: watcher too slow: {} revisions behind (limit {})",
                            current - watcher.next_revision,
                            limits.lag_revisions_max
                        ),
                        ..WatchResponse::default()
                    },
                ));
                continue;
            }
            // Catch up from history, one bounded batch per drain.
            let history = store.history(
                &watcher.range,
                watcher.next_revision,
                current,
                limits.events_per_watcher_max,
            );
            let complete = history.len() < limits.events_per_watcher_max;
            let mut last_revision = watcher.next_revision - 1;
            let mut batch: Vec<Event> = Vec::new();
            let mut batch_revision = 0;
            for event in history {
                let revision = event.kv.as_ref().map_or(0, |kv| kv.mod_revision);
                if revision != batch_revision && !batch.is_empty() {
                    out.push(WatchResponse {
                        header: header(batch_revision),
                        watch_id: *watch_id,
                        events: std::mem::take(&mut batch),
                        ..WatchResponse::default()
                    });
                }
                batch_revision = revision;
                last_revision = revision;
                if watcher.wants(&event) {
                    batch.push(watcher.shape(&event));
                }
            }
            if !batch.is_empty() {
                out.push(WatchResponse {
                    header: header(batch_revision),
                    watch_id: *watch_id,
                    events: batch,
                    ..WatchResponse::default()
                });
            }
            watcher.delivered_since_progress = true;
            if complete {
                watcher.next_revision = current + 1;
            } else {
                watcher.next_revision = last_revision + 1;
                behind = true;
            }
        }
        for (watch_id, response) in cancelled {
            stream.watchers.remove(&watch_id);
            out.push(response);
        }
        if stream.progress_requested && !behind {
            let all_synced = stream.watchers.values().all(|w| w.next_revision > current);
            if all_synced {
                stream.progress_requested = false;
                out.push(WatchResponse {
                    header: header(current),
                    watch_id: STREAM_WATCH_ID,
                    ..WatchResponse::default()
                });
            }
        }
        (out, behind)
    }
}
