//! Revisions, historical reads, range semantics and compaction.

use super::helpers::*;
use crate::error::KvError;
use crate::pb::etcdserverpb::range_request::{SortOrder, SortTarget};
use crate::pb::etcdserverpb::RangeRequest;
use crate::pb::mvccpb::Event;

#[test]
fn revisions_versions_and_tombstones_follow_etcd() {
    let mut m = Machine::new();
    assert_eq!(m.revision(), 1, "a fresh store is at revision 1");
    m.ok(put_cmd("a", "1"));
    let kv = m.get("a").unwrap();
    assert_eq!((kv.create_revision, kv.mod_revision, kv.version), (2, 2, 1));
    m.ok(put_cmd("a", "2"));
    let kv = m.get("a").unwrap();
    assert_eq!((kv.create_revision, kv.mod_revision, kv.version), (2, 3, 2));
    m.ok(delete_cmd("a", ""));
    assert_eq!(m.revision(), 4);
    assert_eq!(m.get("a"), None);
    m.ok(put_cmd("a", "3"));
    let kv = m.get("a").unwrap();
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (5, 5, 1),
        "a key recreated after a delete starts a new generation"
    );
}

#[test]
fn deleting_nothing_does_not_advance_the_revision() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1"));
    let applied = m.apply(delete_cmd("zzz", ""));
    assert_eq!(applied.revision, 2);
    assert!(applied.events.is_empty());
    assert_eq!(m.revision(), 2);
}

#[test]
fn reads_at_past_revisions_until_compacted() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1")); // 2
    m.ok(put_cmd("a", "2")); // 3
    m.ok(delete_cmd("a", "")); // 4
    m.ok(put_cmd("b", "x")); // 5
    let at = |m: &Machine, revision: i64| {
        m.kv.range(&RangeRequest {
            revision,
            ..range("a", "")
        })
    };
    assert_eq!(at(&m, 2).unwrap().kvs[0].value, &b"1"[..]);
    assert_eq!(at(&m, 3).unwrap().kvs[0].value, &b"2"[..]);
    assert!(at(&m, 4).unwrap().kvs.is_empty());
    assert!(at(&m, 1).unwrap().kvs.is_empty());
    assert_eq!(at(&m, 6), Err(KvError::FutureRevision));
    m.ok(compact_cmd(3));
    assert_eq!(
        at(&m, 2),
        Err(KvError::Compacted {
            compacted_revision: 3
        })
    );
    assert_eq!(
        at(&m, 3).unwrap().kvs[0].value,
        &b"2"[..],
        "the compacted revision itself stays readable"
    );
    assert!(at(&m, 4).unwrap().kvs.is_empty());
    // Compacting again at or below is an error, as is the future.
    assert_eq!(
        m.apply(compact_cmd(3)).response,
        Err(KvError::Compacted {
            compacted_revision: 3
        })
    );
    assert_eq!(
        m.apply(compact_cmd(99)).response,
        Err(KvError::FutureRevision)
    );
    m.ok(compact_cmd(5));
    // The deleted key is gone from storage entirely.
    assert_eq!(
        m.kv.store()
            .compacted_view()
            .unwrap()
            .iter()
            .filter(|v| v.kv.key == b"a"[..])
            .count(),
        0
    );
}

#[test]
fn empty_key_is_refused() {
    let mut m = Machine::new();
    assert_eq!(m.kv.range(&range("", "")), Err(KvError::EmptyKey));
    assert_eq!(m.apply(put_cmd("", "v")).response, Err(KvError::EmptyKey));
    assert_eq!(m.apply(delete_cmd("", "")).response, Err(KvError::EmptyKey));
}

#[test]
fn range_end_selects_single_interval_prefix_and_all() {
    let mut m = Machine::new();
    for key in ["a", "ab", "abc", "b", "c"] {
        m.ok(put_cmd(key, key));
    }
    assert_eq!(m.keys("ab", ""), vec!["ab"]);
    assert_eq!(m.keys("a", "b"), vec!["a", "ab", "abc"]);
    assert_eq!(m.keys("ab", "ac"), vec!["ab", "abc"], "prefix ab");
    assert_eq!(
        m.keys("ab", "\0"),
        vec!["ab", "abc", "b", "c"],
        "\\0 means every key >= key"
    );
    assert_eq!(m.keys("\0", "\0"), vec!["a", "ab", "abc", "b", "c"]);
    assert!(
        m.keys("c", "a").is_empty(),
        "range_end before key selects nothing"
    );
    assert!(m.keys("b", "b").is_empty());
}

#[test]
fn limit_count_more_keys_only_count_only() {
    let mut m = Machine::new();
    for key in ["k1", "k2", "k3", "k4"] {
        m.ok(put_cmd(key, "v"));
    }
    let r =
        m.kv.range(&RangeRequest {
            limit: 2,
            ..range("k", "l")
        })
        .unwrap();
    assert_eq!(r.kvs.len(), 2);
    assert!(r.more);
    assert_eq!(r.count, 4);
    let r =
        m.kv.range(&RangeRequest {
            limit: 4,
            ..range("k", "l")
        })
        .unwrap();
    assert!(!r.more);
    let r =
        m.kv.range(&RangeRequest {
            count_only: true,
            ..range("k", "l")
        })
        .unwrap();
    assert!(r.kvs.is_empty());
    assert_eq!(r.count, 4);
    let r =
        m.kv.range(&RangeRequest {
            keys_only: true,
            ..range("k", "l")
        })
        .unwrap();
    assert_eq!(r.kvs.len(), 4);
    assert!(r
        .kvs
        .iter()
        .all(|kv| kv.value.is_empty() && kv.version == 1));
}

#[test]
fn sort_by_every_target_and_order() {
    let mut m = Machine::new();
    m.ok(put_cmd("b", "3")); // 2
    m.ok(put_cmd("a", "2")); // 3
    m.ok(put_cmd("c", "1")); // 4
    m.ok(put_cmd("c", "0")); // 5: c has version 2
    let sorted = |target: SortTarget, order: SortOrder, limit: i64| -> Vec<String> {
        m.kv.range(&RangeRequest {
            sort_target: target as i32,
            sort_order: order as i32,
            limit,
            ..range("a", "\0")
        })
        .unwrap()
        .kvs
        .into_iter()
        .map(|kv| String::from_utf8(kv.key.to_vec()).unwrap())
        .collect()
    };
    assert_eq!(sorted(SortTarget::Key, SortOrder::None, 0), ["a", "b", "c"]);
    assert_eq!(
        sorted(SortTarget::Key, SortOrder::Descend, 0),
        ["c", "b", "a"]
    );
    assert_eq!(sorted(SortTarget::Key, SortOrder::Descend, 1), ["c"]);
    assert_eq!(
        sorted(SortTarget::Value, SortOrder::Ascend, 0),
        ["c", "a", "b"]
    );
    assert_eq!(
        sorted(SortTarget::Value, SortOrder::None, 0),
        ["c", "a", "b"],
        "a target without order sorts ascending"
    );
    assert_eq!(
        sorted(SortTarget::Create, SortOrder::Ascend, 0),
        ["b", "a", "c"]
    );
    assert_eq!(
        sorted(SortTarget::Mod, SortOrder::Descend, 0),
        ["c", "a", "b"]
    );
    assert_eq!(sorted(SortTarget::Version, SortOrder::Descend, 1), ["c"]);
}

#[test]
fn revision_filters() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1")); // 2
    m.ok(put_cmd("b", "1")); // 3
    m.ok(put_cmd("a", "2")); // 4
    let keys = |request: RangeRequest| -> Vec<String> {
        m.kv.range(&request)
            .unwrap()
            .kvs
            .into_iter()
            .map(|kv| String::from_utf8(kv.key.to_vec()).unwrap())
            .collect()
    };
    assert_eq!(
        keys(RangeRequest {
            min_mod_revision: 4,
            ..range("a", "\0")
        }),
        ["a"]
    );
    assert_eq!(
        keys(RangeRequest {
            max_mod_revision: 3,
            ..range("a", "\0")
        }),
        ["b"]
    );
    assert_eq!(
        keys(RangeRequest {
            min_create_revision: 3,
            ..range("a", "\0")
        }),
        ["b"]
    );
    assert_eq!(
        keys(RangeRequest {
            max_create_revision: 2,
            ..range("a", "\0")
        }),
        ["a"]
    );
}

#[test]
fn history_replays_in_revision_and_operation_order() {
    let mut m = Machine::new();
    m.ok(put_cmd("b", "1")); // 2
    m.ok(txn_cmd(crate::pb::etcdserverpb::TxnRequest {
        compare: vec![],
        success: vec![op_put("c", "1"), op_put("a", "1")],
        failure: vec![],
    })); // 3: c before a
    m.ok(delete_cmd("b", "")); // 4
    let everything = crate::mvcc::KeyRange::new(b"\0", b"\0");
    let events =
        m.kv.store()
            .history(&everything, 2, 4, 100, usize::MAX, true)
            .unwrap();
    let seen: Vec<(i64, String, i32)> = events
        .iter()
        .map(|e| {
            let kv = e.kv.as_ref().unwrap();
            (
                kv.mod_revision,
                String::from_utf8(kv.key.to_vec()).unwrap(),
                e.r#type,
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (2, "b".into(), 0),
            (3, "c".into(), 0),
            (3, "a".into(), 0),
            (4, "b".into(), 1)
        ]
    );
    assert_eq!(events[3].prev_kv.as_ref().unwrap().value, &b"1"[..]);
    // A limit never splits a revision.
    assert_eq!(
        m.kv.store()
            .history(&everything, 2, 4, 2, usize::MAX, true)
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn compaction_keeps_a_delete_at_the_compacted_revision_for_watchers() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1")); // 2
    m.ok(delete_cmd("a", "")); // 3
    m.ok(compact_cmd(3));
    let everything = crate::mvcc::KeyRange::new(b"\0", b"\0");
    let events =
        m.kv.store()
            .history(&everything, 3, 3, 100, usize::MAX, true)
            .unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].r#type, 1);
    assert_eq!(m.get("a"), None);
    m.ok(put_cmd("z", "1")); // 4
    m.ok(compact_cmd(4));
    assert_eq!(
        m.kv.store()
            .compacted_view()
            .unwrap()
            .iter()
            .filter(|v| v.kv.key == b"a"[..])
            .count(),
        0
    );
}

#[test]
fn hash_kv_identifies_the_history_up_to_a_revision() {
    let mut a = Machine::new();
    let mut b = Machine::new();
    for m in [&mut a, &mut b] {
        m.ok(put_cmd("x", "1"));
        m.ok(put_cmd("y", "1"));
    }
    let at_three = a.kv.store().hash_kv(0).unwrap();
    assert_eq!(at_three, b.kv.store().hash_kv(0).unwrap());
    a.ok(put_cmd("x", "2"));
    b.ok(put_cmd("x", "3"));
    assert_ne!(
        a.kv.store().hash_kv(0).unwrap(),
        b.kv.store().hash_kv(0).unwrap()
    );
    assert_eq!(
        a.kv.store().hash_kv(3).unwrap(),
        at_three,
        "later writes do not change a past hash"
    );
    assert_eq!(a.kv.store().hash_kv(9), Err(KvError::FutureRevision));
}

#[test]
fn a_single_key_read_at_any_revision_matches_a_range_over_that_key() {
    let mut m = Machine::new();
    // Many versions of one key, deleted and created again, between writes
    // of its neighbours.
    for i in 0..60 {
        if i % 7 == 3 {
            m.ok(delete_cmd("k", ""));
        } else {
            m.ok(put_cmd("k", &i.to_string()));
        }
        m.ok(put_cmd("j", &i.to_string()));
        m.ok(put_cmd("k0", &i.to_string()));
    }
    for revision in 0..=m.revision() {
        let single =
            m.kv.range(&RangeRequest {
                revision,
                ..range("k", "")
            })
            .unwrap();
        // [k, k\0) holds the key k alone, read by a walk of the range.
        let walked =
            m.kv.range(&RangeRequest {
                revision,
                key: b"k".to_vec(),
                range_end: b"k\0".to_vec(),
                ..RangeRequest::default()
            })
            .unwrap();
        assert_eq!(single.kvs, walked.kvs, "at revision {revision}");
        assert_eq!(single.count, walked.count, "at revision {revision}");
    }
}

#[test]
fn history_gives_each_change_the_value_before_it() {
    let mut m = Machine::new();
    // Keys changed several times, deleted and created again inside the
    // window read, and one last changed before it.
    m.ok(put_cmd("old", "0")); // 2
    for i in 0..40 {
        let key = ["a", "b", "c"][i % 3];
        if i % 5 == 4 {
            m.ok(delete_cmd(key, ""));
        } else {
            m.ok(put_cmd(key, &i.to_string()));
        }
        if i % 10 == 0 {
            m.ok(put_cmd("old", &i.to_string()));
        }
    }
    let everything = crate::mvcc::KeyRange::new(b"\0", b"\0");
    for from in [2, 3, 10, 25] {
        let events =
            m.kv.store()
                .history(&everything, from, m.revision(), 1000, usize::MAX, true)
                .unwrap();
        assert!(!events.is_empty());
        // Without previous values: the same events, none looked up.
        let without_prev =
            m.kv.store()
                .history(&everything, from, m.revision(), 1000, usize::MAX, false)
                .unwrap();
        let stripped: Vec<Event> = events
            .iter()
            .map(|event| Event {
                prev_kv: None,
                ..event.clone()
            })
            .collect();
        assert_eq!(without_prev, stripped, "from {from}");
        for event in events {
            let kv = event.kv.as_ref().unwrap();
            let expected =
                m.kv.range(&RangeRequest {
                    revision: kv.mod_revision - 1,
                    ..range(std::str::from_utf8(&kv.key).unwrap(), "")
                })
                .unwrap()
                .kvs
                .pop();
            assert_eq!(event.prev_kv, expected, "from {from}: {kv:?}");
        }
    }
}
