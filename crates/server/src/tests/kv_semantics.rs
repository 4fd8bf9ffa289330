//! Put, delete, txn, leases: the state machine's answers and atomicity.

use super::helpers::*;
use crate::command::{command, CommandKind};
use crate::error::KvError;
use crate::kv_state::{CommandResponse, KvLimits};
use crate::pb::etcdserverpb::compare::{CompareResult, TargetUnion};
use crate::pb::etcdserverpb::response_op::Response;
use crate::pb::etcdserverpb::{PutRequest, TxnRequest, TxnResponse};

fn txn(m: &mut Machine, request: TxnRequest) -> TxnResponse {
    match m.ok(txn_cmd(request)) {
        CommandResponse::Txn(response) => response,
        other => panic!("unexpected {other:?}"),
    }
}

fn lease_id(response: CommandResponse) -> i64 {
    match response {
        CommandResponse::LeaseGrant(grant) => grant.id,
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn put_returns_prev_kv_and_header_revision() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1"));
    let response = m.ok(command(CommandKind::Put(PutRequest {
        prev_kv: true,
        ..put("a", "2")
    })));
    match response {
        CommandResponse::Put(put) => {
            assert_eq!(put.prev_kv.unwrap().value, &b"1"[..]);
            assert_eq!(put.header.unwrap().revision, 3);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn delete_range_counts_and_returns_previous() {
    let mut m = Machine::new();
    for key in ["a", "b", "c"] {
        m.ok(put_cmd(key, key));
    }
    match m.ok(delete_cmd("a", "c")) {
        CommandResponse::DeleteRange(d) => {
            assert_eq!(d.deleted, 2);
            assert_eq!(d.prev_kvs.len(), 2);
            assert_eq!(
                d.header.unwrap().revision,
                5,
                "one revision for the whole delete"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(m.keys("\0", "\0"), vec!["c"]);
}

#[test]
fn txn_compares_every_target() {
    let mut m = Machine::new();
    let lease = lease_id(m.ok(grant_cmd(0, 60)));
    m.ok(put_lease_cmd("k", "v", lease)); // revision 2 (grant does not write)
    let check = |m: &mut Machine, compare| {
        txn(
            m,
            TxnRequest {
                compare: vec![compare],
                success: vec![],
                failure: vec![],
            },
        )
        .succeeded
    };
    assert!(check(
        &mut m,
        cmp("k", CompareResult::Equal, TargetUnion::Value(b"v".to_vec()))
    ));
    assert!(check(
        &mut m,
        cmp(
            "k",
            CompareResult::Greater,
            TargetUnion::Value(b"u".to_vec())
        )
    ));
    assert!(check(
        &mut m,
        cmp("k", CompareResult::Less, TargetUnion::Value(b"w".to_vec()))
    ));
    assert!(check(
        &mut m,
        cmp(
            "k",
            CompareResult::NotEqual,
            TargetUnion::Value(b"x".to_vec())
        )
    ));
    assert!(check(
        &mut m,
        cmp("k", CompareResult::Equal, TargetUnion::Version(1))
    ));
    assert!(check(
        &mut m,
        cmp("k", CompareResult::Equal, TargetUnion::CreateRevision(2))
    ));
    assert!(check(
        &mut m,
        cmp("k", CompareResult::Equal, TargetUnion::ModRevision(2))
    ));
    assert!(check(
        &mut m,
        cmp("k", CompareResult::Equal, TargetUnion::Lease(lease))
    ));
    assert!(!check(
        &mut m,
        cmp("k", CompareResult::Equal, TargetUnion::Version(2))
    ));
    // A missing key: version 0 holds, any value compare fails.
    assert!(check(
        &mut m,
        cmp("nope", CompareResult::Equal, TargetUnion::Version(0))
    ));
    assert!(check(
        &mut m,
        cmp("nope", CompareResult::Equal, TargetUnion::CreateRevision(0))
    ));
    assert!(!check(
        &mut m,
        cmp("nope", CompareResult::Equal, TargetUnion::Value(vec![]))
    ));
    assert!(!check(
        &mut m,
        cmp(
            "nope",
            CompareResult::NotEqual,
            TargetUnion::Value(b"x".to_vec())
        )
    ));
}

#[test]
fn txn_compare_over_a_range_needs_every_key() {
    let mut m = Machine::new();
    m.ok(put_cmd("p/a", "1"));
    m.ok(put_cmd("p/b", "1"));
    let mut compare = cmp(
        "p/",
        CompareResult::Equal,
        TargetUnion::Value(b"1".to_vec()),
    );
    compare.range_end = b"p0".to_vec();
    let request = TxnRequest {
        compare: vec![compare],
        success: vec![],
        failure: vec![],
    };
    assert!(txn(&mut m, request.clone()).succeeded);
    m.ok(put_cmd("p/c", "2"));
    assert!(!txn(&mut m, request).succeeded);
}

#[test]
fn txn_branches_reads_see_own_writes_and_nested_txns() {
    let mut m = Machine::new();
    m.ok(put_cmd("x", "1")); // 2
    let response = txn(
        &mut m,
        TxnRequest {
            compare: vec![cmp(
                "x",
                CompareResult::Equal,
                TargetUnion::Value(b"1".to_vec()),
            )],
            success: vec![
                op_put("y", "2"),
                op_range("y", ""),
                op_txn(TxnRequest {
                    compare: vec![cmp("y", CompareResult::Equal, TargetUnion::Version(0))],
                    success: vec![op_put("z", "from-success")],
                    failure: vec![op_put("z", "from-failure")],
                }),
            ],
            failure: vec![op_put("never", "1")],
        },
    );
    assert!(response.succeeded);
    assert_eq!(
        response.header.unwrap().revision,
        3,
        "the whole txn is one revision"
    );
    match &response.responses[1].response {
        Some(Response::ResponseRange(r)) => {
            assert_eq!(r.kvs[0].value, &b"2"[..], "read sees the txn's own put")
        }
        other => panic!("unexpected {other:?}"),
    }
    match &response.responses[2].response {
        Some(Response::ResponseTxn(nested)) => {
            assert!(
                nested.succeeded,
                "nested compares see the state before the txn (y absent)"
            );
            assert_eq!(nested.header.unwrap().revision, 3);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(m.get("z").unwrap().value, &b"from-success"[..]);
    assert_eq!(m.get("y").unwrap().mod_revision, 3);
    assert_eq!(m.get("never"), None);
    // Failure branch.
    let response = txn(
        &mut m,
        TxnRequest {
            compare: vec![cmp(
                "x",
                CompareResult::Equal,
                TargetUnion::Value(b"nope".to_vec()),
            )],
            success: vec![op_put("never", "1")],
            failure: vec![op_delete("y", "")],
        },
    );
    assert!(!response.succeeded);
    assert_eq!(m.get("y"), None);
    assert_eq!(m.get("never"), None);
}

#[test]
fn read_only_txn_does_not_advance_the_revision() {
    let mut m = Machine::new();
    m.ok(put_cmd("x", "1"));
    let response = txn(
        &mut m,
        TxnRequest {
            compare: vec![],
            success: vec![op_range("x", "")],
            failure: vec![],
        },
    );
    assert_eq!(response.header.unwrap().revision, 2);
    assert_eq!(m.revision(), 2);
}

#[test]
fn txn_is_atomic_when_a_later_op_is_refused() {
    let mut m = Machine::new();
    let applied = m.apply(txn_cmd(TxnRequest {
        compare: vec![],
        success: vec![
            op_put("a", "1"),
            crate::pb::etcdserverpb::RequestOp {
                request: Some(crate::pb::etcdserverpb::request_op::Request::RequestPut(
                    PutRequest {
                        lease: 12345,
                        ..put("b", "1")
                    },
                )),
            },
        ],
        failure: vec![],
    }));
    assert_eq!(applied.response, Err(KvError::LeaseNotFound));
    assert!(applied.events.is_empty());
    assert_eq!(m.get("a"), None, "nothing of a refused txn is applied");
    assert_eq!(m.revision(), 1);
    // A range at a future revision also refuses the whole txn.
    let mut future = op_range("a", "");
    if let Some(crate::pb::etcdserverpb::request_op::Request::RequestRange(r)) = &mut future.request
    {
        r.revision = 50;
    }
    let applied = m.apply(txn_cmd(TxnRequest {
        compare: vec![],
        success: vec![op_put("a", "1"), future],
        failure: vec![],
    }));
    assert_eq!(applied.response, Err(KvError::FutureRevision));
    assert_eq!(m.get("a"), None);
}

#[test]
fn txn_shape_errors() {
    let mut m = Machine::with_limits(KvLimits {
        txn_ops_max: 3,
        txn_depth_max: 2,
        ..KvLimits::default()
    });
    let too_many = TxnRequest {
        compare: vec![],
        success: vec![
            op_put("a", "1"),
            op_put("b", "1"),
            op_put("c", "1"),
            op_put("d", "1"),
        ],
        failure: vec![],
    };
    assert_eq!(
        m.apply(txn_cmd(too_many)).response,
        Err(KvError::TooManyTxnOps)
    );
    let duplicate = TxnRequest {
        compare: vec![],
        success: vec![op_put("a", "1"), op_put("a", "2")],
        failure: vec![],
    };
    assert_eq!(
        m.apply(txn_cmd(duplicate)).response,
        Err(KvError::DuplicateKey)
    );
    let put_and_delete = TxnRequest {
        compare: vec![],
        success: vec![op_delete("a", "c"), op_put("b", "2")],
        failure: vec![],
    };
    assert_eq!(
        m.apply(txn_cmd(put_and_delete)).response,
        Err(KvError::DuplicateKey)
    );
    let nested_duplicate = TxnRequest {
        compare: vec![],
        success: vec![
            op_put("a", "1"),
            op_txn(TxnRequest {
                compare: vec![],
                success: vec![],
                failure: vec![op_put("a", "2")],
            }),
        ],
        failure: vec![],
    };
    assert_eq!(
        m.apply(txn_cmd(nested_duplicate)).response,
        Err(KvError::DuplicateKey)
    );
    // The same key in the two branches of one txn is fine: only one runs.
    let both_branches = TxnRequest {
        compare: vec![],
        success: vec![op_put("a", "1")],
        failure: vec![op_put("a", "2")],
    };
    assert!(m.apply(txn_cmd(both_branches)).response.is_ok());
    let deep = TxnRequest {
        compare: vec![],
        success: vec![op_txn(TxnRequest {
            compare: vec![],
            success: vec![op_txn(TxnRequest::default())],
            failure: vec![],
        })],
        failure: vec![],
    };
    assert_eq!(
        m.apply(txn_cmd(deep)).response,
        Err(KvError::TxnTooDeep { depth_max: 2 })
    );
    let empty_key = TxnRequest {
        compare: vec![],
        success: vec![op_put("", "1")],
        failure: vec![],
    };
    assert_eq!(m.apply(txn_cmd(empty_key)).response, Err(KvError::EmptyKey));
}

#[test]
fn request_size_limit() {
    let mut m = Machine::with_limits(KvLimits {
        request_size_bytes_max: 1024,
        ..KvLimits::default()
    });
    let big = "x".repeat(2000);
    assert_eq!(
        m.apply(put_cmd("a", &big)).response,
        Err(KvError::RequestTooLarge)
    );
    assert!(m.apply(put_cmd("a", &"x".repeat(900))).response.is_ok());
    assert_eq!(KvLimits::default().request_size_bytes_max, 1536 * 1024);
}

#[test]
fn ignore_value_and_ignore_lease() {
    let mut m = Machine::new();
    let lease = lease_id(m.ok(grant_cmd(0, 60)));
    let ignore_value = |key: &str| {
        command(CommandKind::Put(PutRequest {
            ignore_value: true,
            lease,
            ..put(key, "")
        }))
    };
    assert_eq!(
        m.apply(ignore_value("a")).response,
        Err(KvError::KeyNotFound)
    );
    m.ok(put_cmd("a", "keep"));
    m.ok(ignore_value("a"));
    let kv = m.get("a").unwrap();
    assert_eq!((kv.value.as_ref(), kv.lease), (&b"keep"[..], lease));
    m.ok(command(CommandKind::Put(PutRequest {
        ignore_lease: true,
        ..put("a", "new")
    })));
    let kv = m.get("a").unwrap();
    assert_eq!((kv.value.as_ref(), kv.lease), (&b"new"[..], lease));
    let both = command(CommandKind::Put(PutRequest {
        ignore_value: true,
        ..put("a", "x")
    }));
    assert_eq!(m.apply(both).response, Err(KvError::ValueProvided));
    let both = command(CommandKind::Put(PutRequest {
        ignore_lease: true,
        lease,
        ..put("a", "")
    }));
    assert_eq!(m.apply(both).response, Err(KvError::LeaseProvided));
}

#[test]
fn lease_grant_rules() {
    let mut m = Machine::new();
    let first = lease_id(m.ok(grant_cmd(0, 60)));
    let second = lease_id(m.ok(grant_cmd(0, 60)));
    assert!(first > 0 && second > 0 && first != second);
    assert_eq!(lease_id(m.ok(grant_cmd(77, 60))), 77);
    assert_eq!(
        m.apply(grant_cmd(77, 60)).response,
        Err(KvError::LeaseExists)
    );
    assert_eq!(
        m.apply(grant_cmd(0, 9_000_000_001)).response,
        Err(KvError::LeaseTtlTooLarge)
    );
    match m.ok(grant_cmd(0, 1)) {
        CommandResponse::LeaseGrant(g) => assert_eq!(g.ttl, 2, "raised to the minimum TTL"),
        other => panic!("unexpected {other:?}"),
    }
    // An automatic id skips ids taken explicitly.
    m.ok(grant_cmd(first + 3, 60));
    let ids: Vec<i64> = (0..4).map(|_| lease_id(m.ok(grant_cmd(0, 60)))).collect();
    assert!(!ids.contains(&(first + 3)) && !ids.contains(&77));
}

#[test]
fn revoke_and_expire_delete_attached_keys_in_one_revision() {
    let mut m = Machine::new();
    let lease = lease_id(m.ok(grant_cmd(0, 60)));
    let other = lease_id(m.ok(grant_cmd(0, 60)));
    m.ok(put_lease_cmd("a", "1", lease)); // 2
    m.ok(put_lease_cmd("b", "1", lease)); // 3
    m.ok(put_lease_cmd("c", "1", lease)); // 4
    m.ok(put_lease_cmd("c", "2", other)); // 5: c moves to the other lease
    m.ok(put_cmd("b", "2")); // 6: b detached
    assert_eq!(
        m.kv.leases()[&lease]
            .keys
            .iter()
            .cloned()
            .collect::<Vec<_>>(),
        vec![b"a".to_vec()]
    );
    let applied = m.apply(revoke_cmd(lease));
    assert!(applied.response.is_ok());
    assert_eq!(applied.revision, 7);
    assert_eq!(applied.events.len(), 1);
    assert_eq!(m.keys("\0", "\0"), vec!["b", "c"]);
    assert_eq!(
        m.apply(revoke_cmd(lease)).response,
        Err(KvError::LeaseNotFound)
    );
    // Expiry skips leases already gone, removes the rest.
    let applied = m.apply(expire_cmd(vec![lease, other]));
    match applied.response.unwrap() {
        CommandResponse::LeaseExpire {
            expired_ids,
            revision,
        } => {
            assert_eq!(expired_ids, vec![other]);
            assert_eq!(revision, 8);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(m.keys("\0", "\0"), vec!["b"]);
    assert!(m.kv.leases().is_empty());
    // A lease without keys is removed without a new revision.
    let empty = lease_id(m.ok(grant_cmd(0, 60)));
    assert_eq!(m.apply(revoke_cmd(empty)).revision, 8);
    // Deleting a key detaches it from its lease.
    let lease = lease_id(m.ok(grant_cmd(0, 60)));
    m.ok(put_lease_cmd("d", "1", lease));
    m.ok(delete_cmd("d", ""));
    assert!(m.kv.leases()[&lease].keys.is_empty());
}

#[test]
fn bad_log_entries_and_replays_get_typed_errors() {
    let mut m = Machine::new();
    let applied = m.kv.apply_bytes(1, &[1, 0xff, 0xff]);
    assert!(matches!(applied.response, Err(KvError::Decode(_))));
    assert_eq!(
        m.kv.applied_index(),
        1,
        "a bad entry still consumes its index"
    );
    let applied = m.kv.apply(1, &put_cmd("a", "1"));
    assert_eq!(
        applied.response,
        Err(KvError::AlreadyApplied {
            index: 1,
            applied_index: 1
        })
    );
    let applied =
        m.kv.apply_bytes(2, &crate::command::encode_command(&put_cmd("a", "1")));
    assert!(applied.response.is_ok());
}
