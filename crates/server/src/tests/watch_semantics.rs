//! The watch hub: replay, live delivery, order without gap or duplicate,
//! slow watchers, compaction, cancel and progress.

use super::helpers::*;
use crate::kv_state::KvLimits;
use crate::pb::etcdserverpb::watch_create_request::FilterType;
use crate::pb::etcdserverpb::{WatchCreateRequest, WatchResponse};
use crate::pb::ferrypb::Command;
use crate::state::StateMachine;
use crate::watch::{StreamId, WatchLimits, COMPACTED_REASON, STREAM_WATCH_ID};

struct Hub {
    machine: StateMachine,
    index: u64,
}

impl Hub {
    fn new(limits: WatchLimits) -> Hub {
        Hub {
            machine: StateMachine::new(KvLimits::default(), limits),
            index: 0,
        }
    }

    fn apply(&mut self, command: Command) {
        self.index += 1;
        assert!(self.machine.apply(self.index, &command).response.is_ok());
    }

    /// One drain, its responses decoded as a client reads them.
    fn drain(&mut self, stream: StreamId) -> (Vec<WatchResponse>, bool) {
        let (out, behind) = self.machine.watch_drain(stream);
        let out = out
            .into_iter()
            .map(|response| response.into_response().expect("events decode"))
            .collect();
        (out, behind)
    }

    /// Drains until nothing is behind, as a stream task does.
    fn drain_all(&mut self, stream: StreamId) -> Vec<WatchResponse> {
        let mut all = Vec::new();
        loop {
            let (out, behind) = self.drain(stream);
            all.extend(out);
            if !behind {
                return all;
            }
        }
    }
}

fn watch(key: &str, range_end: &str, start_revision: i64) -> WatchCreateRequest {
    WatchCreateRequest {
        key: key.as_bytes().to_vec(),
        range_end: range_end.as_bytes().to_vec(),
        start_revision,
        ..Default::default()
    }
}

/// (revision, key, is_delete) of every event in the responses for one watch.
fn events_of(responses: &[WatchResponse], watch_id: i64) -> Vec<(i64, String, bool)> {
    responses
        .iter()
        .filter(|r| r.watch_id == watch_id)
        .flat_map(|r| r.events.iter())
        .map(|e| {
            let kv = e.kv.as_ref().unwrap();
            (
                kv.mod_revision,
                String::from_utf8(kv.key.to_vec()).unwrap(),
                e.r#type == 1,
            )
        })
        .collect()
}

#[test]
fn live_events_on_key_and_prefix_with_prev_kv_and_filters() {
    let mut hub = Hub::new(WatchLimits::default());
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("a", "", 0)); // id 0
    hub.machine.watch_create(
        stream,
        &WatchCreateRequest {
            prev_kv: true,
            ..watch("p/", "p0", 0)
        },
    ); // id 1
    hub.machine.watch_create(
        stream,
        &WatchCreateRequest {
            filters: vec![FilterType::Noput as i32],
            ..watch("p/", "p0", 0)
        },
    ); // id 2
    let created = hub.drain_all(stream);
    assert_eq!(
        created
            .iter()
            .filter(|r| r.created)
            .map(|r| r.watch_id)
            .collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    hub.apply(put_cmd("a", "1")); // 2
    hub.apply(put_cmd("p/x", "1")); // 3
    hub.apply(put_cmd("p/x", "2")); // 4
    hub.apply(put_cmd("other", "1")); // 5
    hub.apply(delete_cmd("p/x", "")); // 6
    let out = hub.drain_all(stream);
    assert_eq!(events_of(&out, 0), vec![(2, "a".into(), false)]);
    assert_eq!(
        events_of(&out, 1),
        vec![
            (3, "p/x".into(), false),
            (4, "p/x".into(), false),
            (6, "p/x".into(), true)
        ]
    );
    assert_eq!(events_of(&out, 2), vec![(6, "p/x".into(), true)]);
    let with_prev: Vec<_> = out
        .iter()
        .filter(|r| r.watch_id == 1)
        .flat_map(|r| r.events.iter())
        .collect();
    assert!(with_prev[0].prev_kv.is_none());
    assert_eq!(with_prev[1].prev_kv.as_ref().unwrap().value, &b"1"[..]);
    assert_eq!(with_prev[2].prev_kv.as_ref().unwrap().value, &b"2"[..]);
    let without_prev: Vec<_> = out
        .iter()
        .filter(|r| r.watch_id == 2)
        .flat_map(|r| r.events.iter())
        .collect();
    assert!(without_prev[0].prev_kv.is_none(), "prev_kv only when asked");
    // A response may carry several revisions of one watcher; its header
    // is the revision of its last event.
    for response in out.iter().filter(|r| !r.events.is_empty()) {
        let header = response.header.unwrap().revision;
        let revisions: Vec<i64> = response
            .events
            .iter()
            .map(|e| e.kv.as_ref().unwrap().mod_revision)
            .collect();
        assert!(revisions.is_sorted());
        assert_eq!(revisions.last(), Some(&header));
    }
}

#[test]
fn replay_from_history_then_live_without_gap_or_duplicate() {
    let mut hub = Hub::new(WatchLimits {
        events_per_watcher_max: 3,
        ..WatchLimits::default()
    });
    for i in 0..10 {
        hub.apply(put_cmd("k", &i.to_string())); // revisions 2..=11
    }
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("k", "", 4));
    // Writes that happen between creation and the first drain.
    hub.apply(put_cmd("k", "x")); // 12
    let mut responses = hub.drain_all(stream);
    hub.apply(put_cmd("k", "y")); // 13
    hub.apply(put_cmd("k", "z")); // 14
    responses.extend(hub.drain_all(stream));
    let revisions: Vec<i64> = events_of(&responses, 0).into_iter().map(|e| e.0).collect();
    assert_eq!(revisions, (4..=14).collect::<Vec<_>>());
}

#[test]
fn a_watchers_revisions_share_a_response_up_to_its_size_limit() {
    let mut hub = Hub::new(WatchLimits::default());
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("k", "", 0)); // id 0
    hub.machine.watch_create(stream, &watch("p/", "p0", 0)); // id 1
    let created = hub.drain_all(stream);
    assert_eq!(created.len(), 2);
    // Ten revisions queued before the stream drains: one response per
    // watcher, in order, each stamped with its last revision.
    for i in 0..10 {
        hub.apply(put_cmd("k", &i.to_string())); // revisions 2..=11
        hub.apply(put_cmd(&format!("p/{i}"), "v")); // revisions 12..=21 by twos
    }
    let responses = hub.drain_all(stream);
    assert_eq!(responses.len(), 2, "{responses:?}");
    let key_revisions: Vec<i64> = events_of(&responses, 0).into_iter().map(|e| e.0).collect();
    assert_eq!(
        key_revisions,
        (0..10).map(|i| 2 + 2 * i).collect::<Vec<_>>()
    );
    let prefix_revisions: Vec<i64> = events_of(&responses, 1).into_iter().map(|e| e.0).collect();
    assert_eq!(
        prefix_revisions,
        (0..10).map(|i| 3 + 2 * i).collect::<Vec<_>>()
    );
    for response in &responses {
        let last = response
            .events
            .last()
            .unwrap()
            .kv
            .as_ref()
            .unwrap()
            .mod_revision;
        assert_eq!(response.header.as_ref().unwrap().revision, last);
    }
    // Large values: a response stops taking revisions once it holds
    // RESPONSE_EVENTS_BYTES_MAX, and a watcher caught up from history is cut
    // the same way; every event arrives once, in order.
    let big = "x".repeat(20 * 1024);
    for _ in 0..10 {
        hub.apply(put_cmd("k", &big));
    }
    let live = hub.drain_all(stream);
    let late = hub.machine.watches.open_stream().unwrap().0;
    hub.machine.watch_create(late, &watch("k", "", 2));
    let replayed: Vec<WatchResponse> = hub
        .drain_all(late)
        .into_iter()
        .filter(|r| !r.events.is_empty())
        .collect();
    for responses in [&live, &replayed] {
        assert!(responses.len() > 1, "{} responses", responses.len());
        for response in responses.iter() {
            let value_bytes: usize = response
                .events
                .iter()
                .map(|e| e.kv.as_ref().unwrap().value.len())
                .sum();
            assert!(value_bytes < crate::watch::RESPONSE_EVENTS_BYTES_MAX + big.len());
        }
    }
    assert_eq!(events_of(&live, 0).len(), 10);
    let replayed_revisions: Vec<i64> = events_of(&replayed, 0).into_iter().map(|e| e.0).collect();
    let mut expected: Vec<i64> = (0..10).map(|i| 2 + 2 * i).collect();
    expected.extend(22..=31);
    assert_eq!(replayed_revisions, expected);
}

#[test]
fn slow_watcher_catches_up_from_history_without_blocking_the_store() {
    let mut hub = Hub::new(WatchLimits {
        events_per_watcher_max: 4,
        ..WatchLimits::default()
    });
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("\0", "\0", 0));
    let mut responses = hub.drain_all(stream);
    // The client reads nothing while 100 revisions are applied.
    for i in 0..100 {
        hub.apply(put_cmd(&format!("k{}", i % 7), "v"));
    }
    // Memory held for the watcher stayed bounded.
    let (first, behind) = hub.drain(stream);
    assert!(behind, "the watcher fell behind");
    assert!(first.iter().map(|r| r.events.len()).sum::<usize>() <= 4 + 4);
    responses.extend(first);
    responses.extend(hub.drain_all(stream));
    let revisions: Vec<i64> = events_of(&responses, 0).into_iter().map(|e| e.0).collect();
    assert_eq!(revisions, (2..=101).collect::<Vec<_>>());
    // And it is live again.
    hub.apply(put_cmd("z", "1"));
    let revisions: Vec<i64> = events_of(&hub.drain_all(stream), 0)
        .into_iter()
        .map(|e| e.0)
        .collect();
    assert_eq!(revisions, vec![102]);
}

#[test]
fn a_watcher_behind_by_less_than_the_revisions_kept_catches_up_from_them_not_the_store() {
    // The same history, with the last revisions kept and without: the
    // same events in both, and only the second reads the store's history.
    let mut seen = Vec::new();
    for recent_bytes_max in [16 << 20, 0] {
        let mut hub = Hub::new(WatchLimits {
            events_per_watcher_max: 4,
            recent_bytes_max,
            ..WatchLimits::default()
        });
        let (stream, _) = hub.machine.watches.open_stream().unwrap();
        hub.machine.watch_create(stream, &watch("k", "l", 0));
        let mut with_prev = watch("k3", "", 0);
        with_prev.prev_kv = true;
        hub.machine.watch_create(stream, &with_prev);
        let mut responses = hub.drain_all(stream);
        for i in 0..100 {
            hub.apply(put_cmd(&format!("k{}", i % 7), &i.to_string()));
        }
        hub.apply(delete_cmd("k3", ""));
        responses.extend(hub.drain_all(stream));
        let (from_recent, from_store) = hub.machine.watches.catch_ups();
        if recent_bytes_max > 0 {
            assert!(from_recent > 0, "{from_recent} from the revisions kept");
            assert_eq!(from_store, 0);
        } else {
            assert_eq!(from_recent, 0);
            assert!(from_store > 0);
        }
        let all = events_of(&responses, 0);
        assert_eq!(all.len(), 101);
        assert_eq!(
            all.iter().map(|e| e.0).collect::<Vec<_>>(),
            (2..=102).collect::<Vec<_>>()
        );
        let k3: Vec<_> = responses
            .iter()
            .filter(|r| r.watch_id == 1)
            .flat_map(|r| r.events.iter().cloned())
            .collect();
        // Every change of k3 with its previous value (none for its first).
        assert_eq!(k3.len(), 15);
        assert!(k3[0].prev_kv.is_none());
        assert!(k3[1..].iter().all(|e| e.prev_kv.is_some()));
        // The other watcher's events carry no previous value.
        assert!(responses
            .iter()
            .filter(|r| r.watch_id == 0)
            .flat_map(|r| r.events.iter())
            .all(|e| e.prev_kv.is_none()));
        seen.push(responses);
    }
    assert_eq!(seen[0], seen[1]);
}

#[test]
fn watch_from_a_compacted_revision_is_cancelled_with_the_compact_revision() {
    let mut hub = Hub::new(WatchLimits::default());
    for i in 0..5 {
        hub.apply(put_cmd("k", &i.to_string())); // 2..=6
    }
    hub.apply(compact_cmd(5));
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("k", "", 3));
    let out = hub.drain_all(stream);
    assert!(out[0].created && !out[0].canceled);
    let cancel = out.iter().find(|r| r.canceled).unwrap();
    assert_eq!(cancel.compact_revision, 5);
    assert_eq!(cancel.cancel_reason, COMPACTED_REASON);
    // From the compacted revision itself is fine.
    hub.machine.watch_create(stream, &watch("k", "", 5));
    let out = hub.drain_all(stream);
    assert_eq!(
        events_of(&out, 1)
            .into_iter()
            .map(|e| e.0)
            .collect::<Vec<_>>(),
        vec![5, 6]
    );
}

#[test]
fn a_change_at_the_compacted_revision_keeps_its_prev_kv() {
    let mut hub = Hub::new(WatchLimits::default());
    hub.apply(put_cmd("k", "old")); // 2
    hub.apply(put_cmd("k", "new")); // 3
    hub.apply(compact_cmd(3));
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(
        stream,
        &WatchCreateRequest {
            prev_kv: true,
            ..watch("k", "", 3)
        },
    );
    let out = hub.drain_all(stream);
    let event = out.iter().flat_map(|r| r.events.iter()).next().unwrap();
    assert_eq!(event.kv.as_ref().unwrap().mod_revision, 3);
    assert_eq!(event.prev_kv.as_ref().unwrap().value, &b"old"[..]);
}

#[test]
fn lagging_watcher_overtaken_by_compaction_is_cancelled() {
    let mut hub = Hub::new(WatchLimits {
        events_per_watcher_max: 2,
        ..WatchLimits::default()
    });
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("k", "", 0));
    hub.drain_all(stream);
    for i in 0..10 {
        hub.apply(put_cmd("k", &i.to_string())); // 2..=11
    }
    hub.apply(compact_cmd(8));
    let out = hub.drain_all(stream);
    // It got what it had queued, then the cancel; never a gap.
    let revisions: Vec<i64> = events_of(&out, 0).into_iter().map(|e| e.0).collect();
    assert_eq!(revisions, vec![2, 3]);
    let cancel = out.last().unwrap();
    assert!(cancel.canceled);
    assert_eq!(cancel.compact_revision, 8);
}

#[test]
fn lag_limit_cancels_with_a_reason() {
    let mut hub = Hub::new(WatchLimits {
        events_per_watcher_max: 1,
        lag_revisions_max: 3,
        ..WatchLimits::default()
    });
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("k", "", 0));
    hub.drain_all(stream);
    for i in 0..10 {
        hub.apply(put_cmd("k", &i.to_string()));
    }
    let out = hub.drain_all(stream);
    let cancel = out.last().unwrap();
    assert!(cancel.canceled);
    assert!(
        cancel.cancel_reason.contains("too slow"),
        "{}",
        cancel.cancel_reason
    );
}

#[test]
fn cancel_stops_events_and_duplicate_ids_are_refused() {
    let mut hub = Hub::new(WatchLimits::default());
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(
        stream,
        &WatchCreateRequest {
            watch_id: 7,
            ..watch("k", "", 0)
        },
    );
    hub.machine.watch_create(
        stream,
        &WatchCreateRequest {
            watch_id: 7,
            ..watch("k", "", 0)
        },
    );
    let out = hub.drain_all(stream);
    assert!(out[0].created && !out[0].canceled && out[0].watch_id == 7);
    assert!(out[1].created && out[1].canceled && !out[1].cancel_reason.is_empty());
    hub.apply(put_cmd("k", "1"));
    hub.machine.watch_cancel(stream, 7);
    let out = hub.drain_all(stream);
    assert_eq!(
        out.len(),
        1,
        "queued events of a cancelled watcher are dropped: {out:?}"
    );
    assert!(out[0].canceled && out[0].watch_id == 7);
    hub.apply(put_cmd("k", "2"));
    assert!(hub.drain_all(stream).is_empty());
    hub.machine.watch_cancel(stream, 99);
    assert!(hub.drain_all(stream).is_empty(), "unknown ids are ignored");
}

#[test]
fn progress_request_waits_until_every_watcher_is_synced() {
    let mut hub = Hub::new(WatchLimits {
        events_per_watcher_max: 2,
        ..WatchLimits::default()
    });
    for i in 0..6 {
        hub.apply(put_cmd("k", &i.to_string())); // 2..=7
    }
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("k", "", 2));
    hub.machine.watches.request_progress(stream);
    let (first, behind) = hub.drain(stream);
    assert!(behind);
    assert!(
        first.iter().all(|r| r.watch_id != STREAM_WATCH_ID),
        "no progress while behind"
    );
    let rest = hub.drain_all(stream);
    let progress = rest.last().unwrap();
    assert_eq!(progress.watch_id, STREAM_WATCH_ID);
    assert_eq!(progress.header.unwrap().revision, 7);
    assert!(progress.events.is_empty());
    let delivered: Vec<i64> = events_of(&[first, rest.clone()].concat(), 0)
        .into_iter()
        .map(|e| e.0)
        .collect();
    assert_eq!(delivered, (2..=7).collect::<Vec<_>>());
}

#[test]
fn periodic_progress_only_for_idle_watchers_that_asked() {
    let mut hub = Hub::new(WatchLimits::default());
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(
        stream,
        &WatchCreateRequest {
            progress_notify: true,
            ..watch("k", "", 0)
        },
    );
    hub.machine.watch_create(stream, &watch("j", "", 0));
    hub.drain_all(stream);
    hub.apply(put_cmd("other", "1"));
    hub.machine.watch_progress_tick(stream);
    let out = hub.drain_all(stream);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].watch_id, 0);
    assert_eq!(out[0].header.unwrap().revision, 2);
    hub.apply(put_cmd("k", "1"));
    hub.drain_all(stream);
    hub.machine.watch_progress_tick(stream);
    assert!(
        hub.drain_all(stream).is_empty(),
        "it had events this period"
    );
}

#[test]
fn restore_wakes_watchers_to_catch_up() {
    let mut source = Hub::new(WatchLimits::default());
    source.apply(put_cmd("k", "1")); // 2
    source.apply(put_cmd("k", "2")); // 3
    let snapshot = source.machine.snapshot().unwrap();
    let mut hub = Hub::new(WatchLimits::default());
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(stream, &watch("k", "", 0));
    hub.drain_all(stream);
    hub.machine.restore(&snapshot).unwrap();
    let revisions: Vec<i64> = events_of(&hub.drain_all(stream), 0)
        .into_iter()
        .map(|e| e.0)
        .collect();
    assert_eq!(revisions, vec![2, 3]);
}

#[test]
fn negative_watch_ids_are_refused() {
    let mut hub = Hub::new(WatchLimits::default());
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    hub.machine.watch_create(
        stream,
        &WatchCreateRequest {
            watch_id: -1,
            ..watch("k", "", 0)
        },
    );
    let out = hub.drain_all(stream);
    assert!(out[0].canceled && out[0].cancel_reason.contains("negative"));
    assert_eq!(hub.machine.watches.watcher_count(), 0);
}

/// Found by fuzzing (`crates/fuzz`, gRPC requests with extreme values): a
/// watcher a client numbered i64::MAX made the next drain compute the id
/// after it, which overflowed (a panic with overflow checks, and a drain
/// that visited every watcher twice without them).
#[test]
fn a_watch_id_of_i64_max_is_drained_once_with_the_others() {
    let mut hub = Hub::new(WatchLimits::default());
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    for watch_id in [i64::MAX, 0, 5] {
        hub.machine.watch_create(
            stream,
            &WatchCreateRequest {
                watch_id,
                ..watch("k", "", 0)
            },
        );
    }
    let created = hub.drain_all(stream);
    assert_eq!(
        created.iter().filter(|r| r.created && !r.canceled).count(),
        3
    );
    hub.apply(put_cmd("k", "1"));
    let out = hub.drain_all(stream);
    for watch_id in [i64::MAX, 5] {
        assert_eq!(events_of(&out, watch_id).len(), 1, "{out:?}");
    }
    hub.apply(put_cmd("k", "2"));
    let out = hub.drain_all(stream);
    assert_eq!(events_of(&out, i64::MAX).len(), 1, "{out:?}");
}

mod model {
    //! Random interleavings of writes, compactions, watcher creation and
    //! draining, checked against the log of everything the store applied.

    use super::*;
    use crate::pb::etcdserverpb::TxnRequest;
    use crate::pb::mvccpb::Event;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Put(&'static str, u8),
        Delete(&'static str),
        DeletePrefix,
        TxnPair(&'static str, &'static str),
        Compact(u8),
        Watch {
            range: u8,
            start_back: u8,
            prev_kv: bool,
        },
        Drain,
    }

    fn key() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["a", "b", "d/1", "d/2"])
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (key(), any::<u8>()).prop_map(|(k, v)| Step::Put(k, v)),
            2 => key().prop_map(Step::Delete),
            1 => Just(Step::DeletePrefix),
            2 => (key(), key()).prop_filter("distinct keys", |(a, b)| a != b).prop_map(|(a, b)| Step::TxnPair(a, b)),
            1 => any::<u8>().prop_map(Step::Compact),
            2 => (0u8..3, 0u8..8, any::<bool>()).prop_map(|(range, start_back, prev_kv)| Step::Watch { range, start_back, prev_kv }),
            3 => Just(Step::Drain),
        ]
    }

    struct Expectation {
        range: crate::mvcc::KeyRange,
        start: i64,
        prev_kv: bool,
        received: Vec<Event>,
        cancelled_at_compaction: Option<i64>,
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn every_watcher_sees_exactly_the_applied_events_in_order(steps in proptest::collection::vec(step(), 1..80)) {
            let mut hub = Hub::new(WatchLimits { events_per_watcher_max: 2, ..WatchLimits::default() });
            let (stream, _) = hub.machine.watches.open_stream().unwrap();
            let mut log: Vec<Event> = Vec::new();
            let mut watchers: Vec<Expectation> = Vec::new();
            let ranges = [("a", ""), ("d/", "d0"), ("\0", "\0")];
            let route = |out: Vec<WatchResponse>, watchers: &mut Vec<Expectation>| {
                for response in out {
                    let Ok(index) = usize::try_from(response.watch_id) else { continue };
                    let Some(w) = watchers.get_mut(index) else { continue };
                    if response.canceled {
                        assert!(response.compact_revision > 0, "only compaction cancels here: {response:?}");
                        w.cancelled_at_compaction = Some(response.compact_revision);
                    }
                    w.received.extend(response.events);
                }
            };
            for step in steps {
                let command = match step {
                    Step::Put(k, v) => Some(put_cmd(k, &v.to_string())),
                    Step::Delete(k) => Some(delete_cmd(k, "")),
                    Step::DeletePrefix => Some(delete_cmd("d/", "d0")),
                    Step::TxnPair(a, b) => Some(txn_cmd(TxnRequest {
                        compare: vec![],
                        success: vec![op_put(a, "t"), op_put(b, "t")],
                        failure: vec![],
                    })),
                    Step::Compact(back) => {
                        let current = hub.machine.kv().store().revision();
                        let target = current - i64::from(back % 6);
                        (target > hub.machine.kv().store().compacted_revision()).then(|| compact_cmd(target))
                    }
                    Step::Watch { range, start_back, prev_kv } => {
                        let (key, end) = ranges[usize::from(range)];
                        let current = hub.machine.kv().store().revision();
                        let start = if start_back == 0 { 0 } else { (current + 1 - i64::from(start_back)).max(1) };
                        hub.machine.watch_create(stream, &WatchCreateRequest { prev_kv, ..watch(key, end, start) });
                        watchers.push(Expectation {
                            range: crate::mvcc::KeyRange::new(key.as_bytes(), end.as_bytes()),
                            start: if start == 0 { current + 1 } else { start },
                            prev_kv,
                            received: Vec::new(),
                            cancelled_at_compaction: None,
                        });
                        None
                    }
                    Step::Drain => {
                        let (out, _) = hub.drain(stream);
                        route(out, &mut watchers);
                        None
                    }
                };
                if let Some(command) = command {
                    hub.index += 1;
                    let applied = hub.machine.apply(hub.index, &command);
                    log.extend(applied.events);
                }
            }
            let out = hub.drain_all(stream);
            route(out, &mut watchers);
            for w in &watchers {
                let expected: Vec<Event> = log
                    .iter()
                    .filter(|e| {
                        let kv = e.kv.as_ref().unwrap();
                        kv.mod_revision >= w.start && w.range.contains(&kv.key)
                    })
                    .map(|e| {
                        let mut e = e.clone();
                        if !w.prev_kv {
                            e.prev_kv = None;
                        }
                        e
                    })
                    .collect();
                match w.cancelled_at_compaction {
                    None => prop_assert_eq!(&w.received, &expected),
                    Some(compacted) => {
                        prop_assert!(expected.starts_with(&w.received), "received a prefix of the history");
                        let next = w.received.last().map_or(w.start, |e| e.kv.as_ref().unwrap().mod_revision + 1);
                        prop_assert!(next < compacted, "cancelled only when the next revision was compacted");
                    }
                }
            }
        }
    }
}

#[test]
fn stream_count_is_bounded() {
    let mut hub = Hub::new(WatchLimits {
        streams_max: 2,
        ..WatchLimits::default()
    });
    let (first, _) = hub.machine.watches.open_stream().unwrap();
    assert!(hub.machine.watches.open_stream().is_some());
    assert!(hub.machine.watches.open_stream().is_none());
    hub.machine.watches.close_stream(first);
    assert!(hub.machine.watches.open_stream().is_some());
}

/// The index of synced watchers against a brute-force model: watchers of
/// one key, of a prefix and of a range, starting now, in the past and at
/// revisions still to come, some cancelled, with queues so small that
/// watchers keep falling behind and syncing again, and drains at random
/// times. Each watcher sees exactly the events of its range from its start
/// revision on, in order, once (a cancelled one a prefix of them).
#[test]
fn indexed_watchers_see_exactly_their_events_through_falls_behind_and_random_drains() {
    use rand_chacha::rand_core::{Rng, SeedableRng};
    use std::collections::{BTreeMap, BTreeSet};
    for seed in 0..30u64 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        // The last revisions kept: none, a few (so that catch-ups come from
        // them or, when they reach further back, from the store), or plenty.
        let recent_bytes_max = match seed % 3 {
            0 => 0,
            1 => 2_000,
            _ => 16 << 20,
        };
        let mut hub = Hub::new(WatchLimits {
            events_per_watcher_max: 3,
            recent_bytes_max,
            ..WatchLimits::default()
        });
        let (stream, _) = hub.machine.watches.open_stream().unwrap();
        let mut revision = 1i64;
        let mut live: BTreeSet<String> = BTreeSet::new();
        // (revision, key, is_delete) of every event applied.
        let mut applied: Vec<(i64, String, bool)> = Vec::new();
        // watch id -> (key, range_end, first revision)
        let mut watchers: BTreeMap<i64, (String, String, i64)> = BTreeMap::new();
        let mut cancelled: BTreeSet<i64> = BTreeSet::new();
        let mut responses: Vec<WatchResponse> = Vec::new();
        for _ in 0..800 {
            match rng.next_u64() % 12 {
                0 | 1 => {
                    let (key, end) = match rng.next_u64() % 3 {
                        0 => (format!("k{:02}", rng.next_u64() % 20), String::new()),
                        1 => ("k1".to_string(), "k2".to_string()),
                        _ => ("k05".to_string(), "k12".to_string()),
                    };
                    let start = match rng.next_u64() % 3 {
                        0 => 0,
                        1 => 1 + (rng.next_u64() as i64).rem_euclid(revision),
                        _ => revision + 1 + (rng.next_u64() % 5) as i64,
                    };
                    let id = watchers.len() as i64;
                    hub.machine.watch_create(stream, &watch(&key, &end, start));
                    let first = if start == 0 { revision + 1 } else { start };
                    watchers.insert(id, (key, end, first));
                }
                2 if !watchers.is_empty() => {
                    let id = (rng.next_u64() % watchers.len() as u64) as i64;
                    if cancelled.insert(id) {
                        hub.machine.watch_cancel(stream, id);
                    }
                }
                3 | 4 => responses.extend(hub.drain(stream).0),
                _ => {
                    let key = format!("k{:02}", rng.next_u64() % 20);
                    if rng.next_u64() % 4 == 0 && live.contains(&key) {
                        hub.apply(delete_cmd(&key, ""));
                        live.remove(&key);
                        revision += 1;
                        applied.push((revision, key, true));
                    } else {
                        hub.apply(put_cmd(&key, "v"));
                        live.insert(key.clone());
                        revision += 1;
                        applied.push((revision, key, false));
                    }
                }
            }
        }
        responses.extend(hub.drain_all(stream));
        for (id, (key, end, first)) in &watchers {
            let range = crate::mvcc::KeyRange::new(key.as_bytes(), end.as_bytes());
            let expected: Vec<(i64, String, bool)> = applied
                .iter()
                .filter(|(rev, k, _)| *rev >= *first && range.contains(k.as_bytes()))
                .cloned()
                .collect();
            let seen = events_of(&responses, *id);
            if cancelled.contains(id) {
                assert!(
                    expected.starts_with(&seen),
                    "seed {seed} watch {id} ({key}..{end} from {first}): {seen:?} is not a prefix of {expected:?}"
                );
            } else {
                assert_eq!(
                    seen, expected,
                    "seed {seed} watch {id} ({key}..{end} from {first})"
                );
            }
        }
    }
}

/// The hub hands out events already encoded, once per revision for all
/// watchers; what goes on the wire is still, byte for byte, etcd's
/// `WatchResponse` with those events, live and from history, with and
/// without previous values, so no client can tell.
#[test]
fn responses_with_encoded_events_are_byte_for_byte_etcds_watch_responses() {
    use prost::Message;
    let mut hub = Hub::new(WatchLimits::default());
    let (stream, _) = hub.machine.watches.open_stream().unwrap();
    let with_prev = WatchCreateRequest {
        prev_kv: true,
        ..watch("p/", "p0", 0)
    };
    hub.machine.watch_create(stream, &with_prev); // id 0, live
    hub.machine.watch_create(stream, &watch("p/", "p0", 0)); // id 1, live
    hub.drain_all(stream);
    hub.apply(put_cmd("p/x", "1")); // 2
    hub.apply(put_cmd("p/x", "2")); // 3
    hub.apply(delete_cmd("p/x", "")); // 4
                                      // From history: starts at revision 2.
    hub.machine.watch_create(
        stream,
        &WatchCreateRequest {
            start_revision: 2,
            ..with_prev.clone()
        },
    ); // id 2
    let mut wires = Vec::new();
    loop {
        let (out, behind) = hub.machine.watch_drain(stream);
        wires.extend(out);
        if !behind {
            break;
        }
    }
    let mut events = 0;
    for wire in wires {
        let bytes = wire.encode_to_vec();
        let response = wire.into_response().expect("events decode");
        events += response.events.len();
        assert_eq!(bytes, response.encode_to_vec(), "{response:?}");
        assert_eq!(
            WatchResponse::decode(&bytes[..]).expect("a WatchResponse"),
            response
        );
    }
    assert_eq!(events, 9, "three events for each of the three watchers");
}
