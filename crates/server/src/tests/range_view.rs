//! A Range outside a txn reads one consistent view in steps, releasing the
//! lock the applier needs between them, and builds its response without it.

use super::helpers::*;
use crate::error::KvError;
use crate::kv_state::KvLimits;
use crate::pb::etcdserverpb::range_request::{SortOrder, SortTarget};
use crate::pb::etcdserverpb::RangeRequest;
use crate::state::{SharedState, StateMachine};
use crate::watch::WatchLimits;

fn shared(keys: usize) -> (SharedState, u64) {
    let state = SharedState::new(StateMachine::new(
        KvLimits::default(),
        WatchLimits::default(),
    ));
    let mut index = 0;
    {
        let mut machine = state.lock();
        for i in 0..keys {
            index += 1;
            let applied = machine.apply(index, &put_cmd(&format!("k{i:05}"), &format!("v{i}")));
            assert!(applied.response.is_ok());
        }
    }
    (state, index)
}

#[test]
fn writes_apply_between_the_steps_of_a_range_which_keeps_its_view() {
    let (state, mut index) = shared(2000);
    let revision = state.lock().kv().store().revision();
    let mut steps = 0;
    let response = state
        .range_in_steps(&range("k", "l"), 100, || {
            // The applier's lock is free here: a write goes through while
            // the range is half-way.
            steps += 1;
            let mut machine = state.lock();
            index += 1;
            let key = format!("k{:05}", 1999 - steps);
            assert!(machine
                .apply(index, &put_cmd(&key, "changed"))
                .response
                .is_ok());
            index += 1;
            let gone = format!("k{:05}", steps);
            assert!(machine
                .apply(index, &delete_cmd(&gone, ""))
                .response
                .is_ok());
            index += 1;
            assert!(machine
                .apply(index, &put_cmd(&format!("k{steps:05}x"), "new"))
                .response
                .is_ok());
        })
        .unwrap();
    assert!(steps >= 19, "2000 keys in steps of 100: {steps} pauses");
    // The view of the revision the range started at: none of the writes.
    assert_eq!(response.header.unwrap().revision, revision);
    assert_eq!(response.count, 2000);
    assert_eq!(response.kvs.len(), 2000);
    for (i, kv) in response.kvs.iter().enumerate() {
        assert_eq!(kv.key, format!("k{i:05}").into_bytes());
        assert_eq!(kv.value, format!("v{i}").into_bytes());
    }
    // While the writes are there for the next read.
    let after = state.range(&range("k", "l")).unwrap();
    assert_eq!(after.count, 2000, "as many deleted as added");
    assert!(after.kvs.iter().any(|kv| kv.value == b"changed"[..]));
    assert!(after.header.unwrap().revision > revision);
}

#[test]
fn a_range_in_steps_answers_what_one_read_answers() {
    let (state, _) = shared(777);
    let requests = [
        range("k", "l"),
        range("k00100", ""),
        range("k00100", "k00300"),
        range("k00300", "k00100"),
        RangeRequest {
            limit: 10,
            ..range("k", "l")
        },
        RangeRequest {
            limit: 10,
            sort_order: SortOrder::Descend as i32,
            sort_target: SortTarget::Value as i32,
            ..range("k", "l")
        },
        RangeRequest {
            keys_only: true,
            ..range("k0", "k1")
        },
        RangeRequest {
            count_only: true,
            ..range("\0", "\0")
        },
        RangeRequest {
            revision: 300,
            ..range("k", "l")
        },
        RangeRequest {
            min_mod_revision: 500,
            limit: 3,
            ..range("k", "l")
        },
    ];
    for request in requests {
        let whole = state.lock().kv().range(&request).unwrap();
        for step in [1, 7, 1000] {
            let stepped = state.range_in_steps(&request, step, || {}).unwrap();
            assert_eq!(stepped, whole, "{request:?} in steps of {step}");
        }
    }
}

#[test]
fn a_compaction_past_the_view_of_a_range_in_progress_fails_it_cleanly() {
    let (state, mut index) = shared(300);
    let read_revision = state.lock().kv().store().revision();
    let mut compacted = false;
    let outcome = state.range_in_steps(&range("k", "l"), 50, || {
        if !compacted {
            compacted = true;
            let mut machine = state.lock();
            index += 1;
            assert!(machine
                .apply(index, &put_cmd("k00000", "x"))
                .response
                .is_ok());
            index += 1;
            assert!(machine
                .apply(index, &compact_cmd(read_revision + 1))
                .response
                .is_ok());
        }
    });
    assert_eq!(
        outcome,
        Err(KvError::Compacted {
            compacted_revision: read_revision + 1
        })
    );
}
