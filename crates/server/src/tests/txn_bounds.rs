//! The bounds of a txn: every operation counts, nested ones included; what
//! a txn answers is bounded in bytes; a committed entry beyond its bounds
//! gets the same error on every replica, also when replayed; and members no
//! client waits on build no read results.

use bytes::Bytes;
use proptest::prelude::*;

use super::helpers::*;
use crate::command::{decode_command, encode_command};
use crate::error::KvError;
use crate::kv_state::{txn_ops, CommandResponse, KvLimits, KvState, Reads};
use crate::pb::etcdserverpb::response_op::Response;
use crate::pb::etcdserverpb::{PutRequest, RangeRequest, RequestOp, TxnRequest};
use crate::pb::ferrypb::Command;

/// A txn of `outer` txns of `inner` full-keyspace ranges each: every
/// level within etcd's per-level limit, 16,384 ranges for 128 x 128.
fn nested_ranges(outer: usize, inner: usize) -> TxnRequest {
    let ranges = TxnRequest {
        compare: vec![],
        success: (0..inner).map(|_| op_range("\0", "\0")).collect(),
        failure: vec![],
    };
    TxnRequest {
        compare: vec![],
        success: (0..outer).map(|_| op_txn(ranges.clone())).collect(),
        failure: vec![],
    }
}

/// A state holding `keys` keys of `value_bytes` bytes each.
fn filled(keys: usize, value_bytes: usize) -> Machine {
    let mut m = Machine::new();
    for i in 0..keys {
        m.ok(put_cmd(&format!("k{i:04}"), &"v".repeat(value_bytes)));
    }
    m
}

#[test]
fn nested_operations_count_toward_the_txn_limit() {
    // etcd's count for one level: the largest of compares, success, failure.
    let flat = TxnRequest {
        compare: vec![],
        success: (0..128).map(|i| op_put(&format!("a{i}"), "1")).collect(),
        failure: (0..128).map(|i| op_put(&format!("b{i}"), "1")).collect(),
    };
    assert_eq!(txn_ops(&flat), 128);
    assert_eq!(txn_ops(&nested_ranges(128, 128)), 128 + 128 * 128);
    assert_eq!(txn_ops(&nested_ranges(2, 63)), 2 + 2 * 63);

    let m = Machine::new();
    let admit = |txn: TxnRequest| m.kv.validate(&txn_cmd(txn));
    assert_eq!(admit(flat), Ok(()));
    assert_eq!(admit(nested_ranges(2, 63)), Ok(()));
    assert_eq!(admit(nested_ranges(2, 64)), Err(KvError::TooManyTxnOps));
    assert_eq!(
        admit(nested_ranges(128, 128)),
        Err(KvError::TooManyTxnOps),
        "the bomb of 16,384 ranges passes every per-level check"
    );
    assert_eq!(
        KvError::TooManyTxnOps.to_string(),
        "etcdserver: too many operations in txn request"
    );
}

/// Applies the same entries on replicas that differ in their own limits
/// and in whether a client waits on them.
fn replicas() -> Vec<(KvState, Reads)> {
    vec![
        (KvState::new(KvLimits::default()), Reads::Build),
        (KvState::new(KvLimits::default()), Reads::SizeOnly),
        (
            // A node configured with far larger limits: the entry's bounds
            // decide, not the node's.
            KvState::new(KvLimits {
                txn_ops_max: 1 << 20,
                txn_response_bytes_max: usize::MAX,
                request_size_bytes_max: 64 << 20,
                ..KvLimits::default()
            }),
            Reads::SizeOnly,
        ),
    ]
}

fn fill_entries(keys: usize, value_bytes: usize) -> Vec<Vec<u8>> {
    (0..keys)
        .map(|i| encode_command(&put_cmd(&format!("k{i:04}"), &"v".repeat(value_bytes))))
        .collect()
}

#[test]
fn a_committed_entry_beyond_its_bounds_gets_the_same_error_everywhere_and_on_replay() {
    // The entry as a build without the total count would have committed
    // it: no bounds written in it, so the defaults apply.
    let bomb = Bytes::from(encode_command(&txn_cmd(nested_ranges(128, 128))));
    assert!(decode_command(&bomb).unwrap().bounds.is_none());
    // And one admitted by a node with a large --max-txn-ops but the
    // default response limit, over a state whose ranges cannot fit it.
    let mut wide = txn_cmd(nested_ranges(16, 128));
    wide.bounds = Some(
        KvLimits {
            txn_ops_max: 1 << 20,
            ..KvLimits::default()
        }
        .command_bounds(),
    );
    let wide = encode_command(&wide);
    // As the log hands them to a machine.
    let mut entries: Vec<Bytes> = fill_entries(100, 1024)
        .into_iter()
        .map(Bytes::from)
        .collect();
    entries.push(bomb);
    entries.push(wide.into());
    entries.push(encode_command(&put_cmd("after", "1")).into());
    let bomb_index = 101;

    let mut states = Vec::new();
    for (mut kv, reads) in replicas() {
        let mut outcomes = Vec::new();
        for (i, entry) in entries.iter().enumerate() {
            outcomes.push(kv.apply_bytes_with(i as u64 + 1, entry, reads).response);
        }
        assert_eq!(
            outcomes[bomb_index - 1],
            Err(KvError::TooManyTxnOps),
            "{reads:?}"
        );
        // 16 x 128 ranges of 100 KiB: 200 MiB, over the 64 MiB default.
        assert_eq!(
            outcomes[bomb_index],
            Err(KvError::TxnResponseTooLarge {
                bytes_max: 64 << 20
            }),
            "{reads:?}"
        );
        assert!(outcomes[bomb_index + 1].is_ok());
        states.push(kv);
    }
    let hashes: Vec<u32> = states
        .iter()
        .map(|kv| kv.store().hash_kv(0).unwrap())
        .collect();
    assert!(hashes.windows(2).all(|w| w[0] == w[1]), "{hashes:?}");
    assert!(states
        .windows(2)
        .all(|w| w[0].snapshot().unwrap() == w[1].snapshot().unwrap()));

    // Replay after a restart: restore a snapshot from before the entries,
    // apply them again; same outcome, same state, no crash.
    let mut before = KvState::new(KvLimits::default());
    for (i, entry) in entries.iter().take(50).enumerate() {
        before.apply_bytes(i as u64 + 1, entry);
    }
    let snapshot = before.snapshot().unwrap();
    for reads in [Reads::SizeOnly, Reads::Build] {
        let mut replay = KvState::restore(&snapshot, KvLimits::default()).unwrap();
        for (i, entry) in entries.iter().enumerate().skip(50) {
            let outcome = replay.apply_bytes_with(i as u64 + 1, entry, reads).response;
            if i + 1 == bomb_index {
                assert_eq!(outcome, Err(KvError::TooManyTxnOps));
            }
        }
        assert_eq!(replay.snapshot().unwrap(), states[0].snapshot().unwrap());
    }
}

fn lease_id(response: CommandResponse) -> i64 {
    match response {
        CommandResponse::LeaseGrant(grant) => grant.id,
        other => panic!("expected a lease grant, got {other:?}"),
    }
}

fn range_op(request: RangeRequest) -> RequestOp {
    RequestOp {
        request: Some(crate::pb::etcdserverpb::request_op::Request::RequestRange(
            request,
        )),
    }
}

#[test]
fn a_txn_past_its_response_limit_is_refused_whole_and_its_writes_undone() {
    for reads in [Reads::Build, Reads::SizeOnly] {
        let mut m = Machine::with_limits(KvLimits {
            txn_response_bytes_max: 50_000,
            ..KvLimits::default()
        });
        let old_lease = lease_id(m.ok(grant_cmd(1, 60)));
        let new_lease = lease_id(m.ok(grant_cmd(2, 60)));
        for i in 0..10 {
            m.ok(put_lease_cmd(
                &format!("k{i}"),
                &"v".repeat(4000),
                old_lease,
            ));
        }
        let before = m.kv.clone();
        // Writes first, then reads that see them and pass the limit.
        let txn = TxnRequest {
            compare: vec![],
            success: vec![
                RequestOp {
                    request: Some(crate::pb::etcdserverpb::request_op::Request::RequestPut(
                        PutRequest {
                            lease: new_lease,
                            ..put("k0", &"w".repeat(20_000))
                        },
                    )),
                },
                op_put("new", "1"),
                op_delete("k9", ""),
                op_range("k", "l"),
                op_range("k", "l"),
            ],
            failure: vec![],
        };
        m.index += 1;
        let mut command = txn_cmd(txn);
        command.bounds = Some(m.kv.limits().command_bounds());
        let applied = m.kv.apply_with(m.index, &command, reads);
        assert_eq!(
            applied.response,
            Err(KvError::TxnResponseTooLarge { bytes_max: 50_000 }),
            "{reads:?}"
        );
        assert!(applied.events.is_empty());
        // Nothing changed but the applied index.
        assert_eq!(m.kv.store(), before.store());
        assert_eq!(m.kv.leases(), before.leases());
        assert_eq!(m.kv.applied_index(), before.applied_index() + 1);
        // And the store goes on as before: the next put takes the revision
        // the txn gave back, as the first write of it, and finds the key as
        // it was before the txn (a plain put does not look for a version
        // of its own revision to replace).
        m.ok(put_cmd("k0", "x"));
        assert_eq!(m.revision(), before.store().revision() + 1);
        let k0 =
            m.kv.store()
                .get(b"k0", crate::mvcc::ReadAt::Latest)
                .unwrap()
                .unwrap();
        assert_eq!(k0.value, "x".as_bytes());
        assert_eq!(k0.version, 2);
        assert_eq!(k0.mod_revision, m.revision());
        assert_eq!(k0.lease, 0);
        assert!(m
            .kv
            .store()
            .get(b"new", crate::mvcc::ReadAt::Latest)
            .unwrap()
            .is_none());
    }
}

#[test]
fn members_no_client_waits_on_build_no_read_results() {
    let txn = TxnRequest {
        compare: vec![],
        success: vec![
            op_range("\0", "\0"),
            RequestOp {
                request: Some(crate::pb::etcdserverpb::request_op::Request::RequestPut(
                    PutRequest {
                        prev_kv: true,
                        ..put("k0001", "new")
                    },
                )),
            },
            op_delete("k0002", ""),
        ],
        failure: vec![],
    };
    let mut built = filled(50, 100);
    let mut sized = filled(50, 100);
    built.index += 1;
    sized.index += 1;
    let command = txn_cmd(txn);
    let with = built.kv.apply_with(built.index, &command, Reads::Build);
    let without = sized.kv.apply_with(sized.index, &command, Reads::SizeOnly);
    assert_eq!(built.kv, sized.kv);
    assert_eq!(with.events, without.events);
    let responses = |applied: &crate::kv_state::Applied| match &applied.response {
        Ok(CommandResponse::Txn(txn)) => txn.responses.clone(),
        other => panic!("{other:?}"),
    };
    let (with, without) = (responses(&with), responses(&without));
    match (&with[0].response, &without[0].response) {
        (Some(Response::ResponseRange(full)), Some(Response::ResponseRange(empty))) => {
            assert_eq!(full.kvs.len(), 50);
            assert!(empty.kvs.is_empty());
        }
        other => panic!("{other:?}"),
    }
    match (&with[1].response, &without[1].response) {
        (Some(Response::ResponsePut(full)), Some(Response::ResponsePut(empty))) => {
            assert!(full.prev_kv.is_some());
            assert!(empty.prev_kv.is_none());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn admission_estimates_the_response_from_the_state() {
    let m = {
        let mut m = Machine::with_limits(KvLimits {
            txn_response_bytes_max: 100_000,
            ..KvLimits::default()
        });
        for i in 0..10 {
            m.ok(put_cmd(&format!("k{i}"), &"v".repeat(4000)));
        }
        m
    };
    let ranges = |n: usize, limit: i64| TxnRequest {
        compare: vec![],
        success: (0..n)
            .map(|_| {
                range_op(RangeRequest {
                    limit,
                    ..range("k", "l")
                })
            })
            .collect(),
        failure: vec![],
    };
    // 2 x 40 KB fit, 3 do not; with a limit of one key, 20 fit.
    assert_eq!(m.kv.admit_txn_response(&ranges(2, 0)), Ok(()));
    assert_eq!(
        m.kv.admit_txn_response(&ranges(3, 0)),
        Err(KvError::TxnResponseTooLarge { bytes_max: 100_000 })
    );
    assert_eq!(m.kv.admit_txn_response(&ranges(20, 1)), Ok(()));
    // Count-only and keys-only ranges cost (almost) nothing.
    let counts = TxnRequest {
        compare: vec![],
        success: (0..100)
            .map(|_| {
                range_op(RangeRequest {
                    count_only: true,
                    ..range("k", "l")
                })
            })
            .collect(),
        failure: vec![],
    };
    assert_eq!(m.kv.admit_txn_response(&counts), Ok(()));
}

fn arbitrary_txn() -> impl Strategy<Value = Command> {
    let key = prop::sample::select(vec!["a", "b", "c", "d/1", "d/2"]);
    let op = prop_oneof![
        (key.clone(), 0usize..3000).prop_map(|(k, n)| op_put(k, &"x".repeat(n))),
        key.clone().prop_map(|k| op_delete(k, "")),
        Just(op_range("\0", "\0")),
        Just(op_range("d/", "d0")),
    ];
    proptest::collection::vec(op, 0..6).prop_map(|success| {
        txn_cmd(TxnRequest {
            compare: vec![],
            success,
            failure: vec![],
        })
    })
}

proptest! {
    /// Whether read results are built never changes the state or the
    /// outcome, and a txn refused for its response leaves no trace.
    #[test]
    fn building_reads_or_not_agrees_and_refusals_leave_no_trace(
        setup in proptest::collection::vec(arbitrary_txn(), 0..6),
        txns in proptest::collection::vec(arbitrary_txn(), 1..6),
        bytes_max in 0usize..12_000,
    ) {
        let limits = KvLimits { txn_response_bytes_max: bytes_max, ..KvLimits::default() };
        let mut built = KvState::new(limits.clone());
        let mut sized = KvState::new(limits.clone());
        let mut index = 0;
        for mut command in setup.into_iter().chain(txns) {
            index += 1;
            command.bounds = Some(limits.command_bounds());
            let before = built.clone();
            let a = built.apply_with(index, &command, Reads::Build);
            let b = sized.apply_with(index, &command, Reads::SizeOnly);
            prop_assert_eq!(&built, &sized);
            prop_assert_eq!(a.response.is_ok(), b.response.is_ok());
            prop_assert_eq!(&a.events, &b.events);
            if let Err(error) = a.response {
                prop_assert_eq!(b.response, Err(error));
                prop_assert_eq!(built.store(), before.store());
                prop_assert_eq!(built.leases(), before.leases());
            }
        }
    }
}
