//! The server's decoders under proptest: key-value snapshots and backups
//! (damaged, and damaged behind valid checksums), replicated commands with
//! extreme values applied as every member applies them, and the HTTP/2
//! authority repair.

mod common;

use common::{
    bytes, check, extreme_i64, extreme_u64, mutated_seed, mutations, within_one_burst, Expect,
};
use ferry_fuzz::mutate::mutated;
use ferry_fuzz::seeds::http2_request;
use ferry_fuzz::server::{
    authority, backup_file, build, command_apply, command_apply_on, kv_snapshot, populated_state,
};
use ferry_fuzz::Verdict;
use ferry_server::command::{
    encode_command, CommandKind, LeaseExpireCommand, LeaseGrantCommand, LeaseRevokeCommand,
};
use ferry_server::pb::etcdserverpb::{
    compare, request_op, AlarmRequest, CompactionRequest, Compare, DeleteRangeRequest, PutRequest,
    RangeRequest, RequestOp, TxnRequest,
};
use ferry_server::pb::ferrypb::{AuthStamp, Command, CommandBounds};
use proptest::prelude::*;

/// Keys as clients send them: empty, `\0` (all keys as a range end), short
/// ones that exist in the populated state, long ones.
fn key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        Just(vec![0]),
        Just(vec![0xff; 3]),
        proptest::sample::select(vec![
            b"a".to_vec(),
            b"b".to_vec(),
            b"c/".to_vec(),
            b"c0".to_vec(),
            b"d".to_vec()
        ]),
        bytes(8),
        (1usize..70_000).prop_map(|len| vec![b'k'; len]),
    ]
}

fn range() -> impl Strategy<Value = RangeRequest> {
    (
        (key(), key(), extreme_i64(), extreme_i64()),
        (
            -2i32..4,
            -2i32..7,
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
        (extreme_i64(), extreme_i64(), extreme_i64(), extreme_i64()),
    )
        .prop_map(
            |(
                (key, range_end, limit, revision),
                (sort_order, sort_target, serializable, keys_only, count_only),
                (min_mod_revision, max_mod_revision, min_create_revision, max_create_revision),
            )| RangeRequest {
                key,
                range_end,
                limit,
                revision,
                sort_order,
                sort_target,
                serializable,
                keys_only,
                count_only,
                min_mod_revision,
                max_mod_revision,
                min_create_revision,
                max_create_revision,
            },
        )
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => bytes(16),
        1 => prop_oneof![Just(1536 * 1024 - 64), Just(1536 * 1024 + 1)].prop_map(|len| vec![b'v'; len]),
    ]
}

fn put() -> impl Strategy<Value = PutRequest> {
    (
        key(),
        value(),
        prop_oneof![Just(0i64), Just(7), extreme_i64()],
        any::<(bool, bool, bool)>(),
    )
        .prop_map(
            |(key, value, lease, (prev_kv, ignore_value, ignore_lease))| PutRequest {
                key: key.into(),
                value: value.into(),
                lease,
                prev_kv,
                ignore_value,
                ignore_lease,
            },
        )
}

fn delete() -> impl Strategy<Value = DeleteRangeRequest> {
    (key(), key(), any::<bool>()).prop_map(|(key, range_end, prev_kv)| DeleteRangeRequest {
        key,
        range_end,
        prev_kv,
    })
}

fn compare() -> impl Strategy<Value = Compare> {
    let target_union = prop_oneof![
        extreme_i64().prop_map(compare::TargetUnion::Version),
        extreme_i64().prop_map(compare::TargetUnion::CreateRevision),
        extreme_i64().prop_map(compare::TargetUnion::ModRevision),
        bytes(4).prop_map(compare::TargetUnion::Value),
        extreme_i64().prop_map(compare::TargetUnion::Lease),
    ];
    (
        -1i32..5,
        -1i32..6,
        key(),
        key(),
        proptest::option::of(target_union),
    )
        .prop_map(|(result, target, key, range_end, target_union)| Compare {
            result,
            target,
            key,
            range_end,
            target_union,
        })
}

fn txn() -> impl Strategy<Value = TxnRequest> {
    let leaf = prop_oneof![
        range().prop_map(request_op::Request::RequestRange),
        put().prop_map(request_op::Request::RequestPut),
        delete().prop_map(request_op::Request::RequestDeleteRange),
    ];
    let ops = |op: BoxedStrategy<request_op::Request>| {
        proptest::collection::vec(proptest::option::of(op), 0..4).prop_map(|ops| {
            ops.into_iter()
                .map(|request| RequestOp { request })
                .collect::<Vec<_>>()
        })
    };
    let flat = (
        proptest::collection::vec(compare(), 0..3),
        ops(leaf.clone().boxed()),
        ops(leaf.clone().boxed()),
    )
        .prop_map(|(compare, success, failure)| TxnRequest {
            compare,
            success,
            failure,
        });
    flat.prop_recursive(4, 24, 4, move |inner| {
        let op = prop_oneof![
            leaf.clone(),
            inner.prop_map(request_op::Request::RequestTxn),
        ]
        .boxed();
        (
            proptest::collection::vec(compare(), 0..3),
            ops(op.clone()),
            ops(op),
        )
            .prop_map(|(compare, success, failure)| TxnRequest {
                compare,
                success,
                failure,
            })
    })
}

fn kind() -> impl Strategy<Value = CommandKind> {
    prop_oneof![
        3 => put().prop_map(CommandKind::Put),
        2 => delete().prop_map(CommandKind::DeleteRange),
        3 => txn().prop_map(CommandKind::Txn),
        1 => (extreme_i64(), any::<bool>()).prop_map(|(revision, physical)| CommandKind::Compact(CompactionRequest { revision, physical })),
        1 => (extreme_i64(), extreme_i64()).prop_map(|(id, ttl_seconds)| CommandKind::LeaseGrant(LeaseGrantCommand { id, ttl_seconds })),
        1 => prop_oneof![Just(7i64), extreme_i64()].prop_map(|id| CommandKind::LeaseRevoke(LeaseRevokeCommand { id })),
        1 => proptest::collection::vec(prop_oneof![Just(7i64), extreme_i64()], 0..4).prop_map(|ids| CommandKind::LeaseExpire(LeaseExpireCommand { ids })),
        1 => (-1i32..4, extreme_u64(), -1i32..4).prop_map(|(action, member_id, alarm)| CommandKind::Alarm(AlarmRequest { action, member_id, alarm })),
    ]
}

/// A command with extreme values: any kind, with or without bounds (the
/// proposer's limits, which every member applies it under) and an auth
/// stamp.
fn command_value() -> impl Strategy<Value = Command> {
    let bounds = (
        extreme_u64(),
        any::<u32>(),
        prop_oneof![Just(0u32), Just(1), Just(u32::MAX), 0u32..40],
        extreme_u64(),
    )
        .prop_map(
            |(request_bytes_max, txn_ops_max, txn_depth_max, txn_response_bytes_max)| {
                CommandBounds {
                    request_bytes_max,
                    txn_ops_max,
                    txn_depth_max,
                    txn_response_bytes_max,
                }
            },
        );
    let stamp = (
        prop_oneof![Just(String::new()), Just("root".to_string()), "\\PC{0,8}"],
        extreme_u64(),
    )
        .prop_map(|(user, revision)| AuthStamp { user, revision });
    (
        kind(),
        proptest::option::of(bounds),
        proptest::option::of(stamp),
    )
        .prop_map(|(kind, bounds, auth)| Command {
            kind: Some(kind),
            bounds,
            auth,
        })
}

#[test]
fn kv_snapshots_of_arbitrary_bytes() {
    let magic = bytes(300).prop_map(|body| [b"FERRYKV1".as_slice(), &body].concat());
    check("kv_snapshot arbitrary", 1.0, magic, Expect::Any, |data| {
        kv_snapshot(&data)
    });
}

/// A key-value snapshot ends with a crc32c of everything before it: any
/// change is refused.
#[test]
fn kv_snapshots_mutated() {
    let strategy = (common::seed("kv_snapshot"), mutations());
    check(
        "kv_snapshot mutated seed",
        1.0,
        strategy,
        Expect::Any,
        |(seed, damage)| {
            let damaged = mutated(&seed, &damage);
            let verdict = kv_snapshot(&damaged);
            if damaged == seed {
                assert_eq!(verdict, Verdict::Accepted);
            } else if within_one_burst(&seed, &damaged) {
                assert_eq!(verdict, Verdict::Refused, "a damaged snapshot was accepted");
            }
            verdict
        },
    );
}

/// Snapshots of states reached by commands with extreme values, and the
/// same damaged behind a valid checksum (what a buggy leader would send):
/// the consistency checks refuse what the checksum cannot.
#[test]
fn kv_snapshots_of_states_and_damaged_behind_the_checksum() {
    let strategy = (
        proptest::collection::vec(command_value(), 0..4),
        mutations(),
    );
    check(
        "kv_snapshot structured",
        0.3,
        strategy,
        Expect::Both,
        |(commands, damage)| {
            let mut state = populated_state();
            for (index, command) in (100u64..).zip(&commands) {
                state.apply(index, command);
            }
            let snapshot = state.snapshot().expect("an in-memory state encodes");
            assert_eq!(kv_snapshot(&snapshot), Verdict::Accepted);
            let body = &snapshot[..snapshot.len() - 4];
            kv_snapshot(&build::kv_snapshot(&mutated(body, &damage)))
        },
    );
}

/// A backup ends with the SHA-256 of everything before it: any change is
/// refused; damage behind a valid hash is refused by the snapshot's own
/// checks or restores to what it holds.
#[test]
fn backups_mutated() {
    let strategy = (common::seed("backup_file"), mutations());
    check(
        "backup_file mutated seed",
        0.2,
        strategy,
        Expect::Any,
        |(seed, damage)| {
            let damaged = mutated(&seed, &damage);
            let verdict = backup_file(&damaged);
            if damaged == seed {
                assert_eq!(verdict, Verdict::Accepted);
            } else if within_one_burst(&seed, &damaged) {
                assert_eq!(verdict, Verdict::Refused, "a damaged backup was accepted");
            }
            verdict
        },
    );
    let snapshot = populated_state()
        .snapshot()
        .expect("an in-memory state encodes");
    let body = snapshot[..snapshot.len() - 4].to_vec();
    let strategy = (Just(body), mutations(), any::<bool>());
    check(
        "backup_file behind the hash",
        0.2,
        strategy,
        Expect::Both,
        |(body, damage, reseal)| {
            let damaged = mutated(&body, &damage);
            let snapshot = if reseal {
                build::kv_snapshot(&damaged)
            } else {
                [damaged.as_slice(), &[0; 4]].concat()
            };
            backup_file(&build::backup(&snapshot))
        },
    );
}

#[test]
fn commands_of_arbitrary_bytes() {
    let versioned = bytes(200).prop_map(|body| [[1u8].as_slice(), &body].concat());
    check(
        "command_apply arbitrary",
        0.5,
        versioned,
        Expect::Any,
        |data| command_apply(&data),
    );
}

#[test]
fn commands_mutated() {
    check(
        "command_apply mutated seed",
        0.5,
        mutated_seed("command_apply"),
        Expect::Both,
        |data| command_apply(&data),
    );
}

/// Commands with extreme values (ranges over everything, limits of 0,
/// negative and i64::MAX, revisions far in the future, empty keys, values
/// at and over the request limit, nested txns, leases and compactions at
/// the edges, the proposer's bounds at their extremes): applied as every
/// member applies them, on a state with a little of everything.
#[test]
fn commands_with_extreme_values() {
    let base = populated_state();
    check(
        "command_apply structured",
        0.5,
        command_value(),
        Expect::Both,
        |command| command_apply_on(&base, &encode_command(&command)),
    );
}

/// A sequence of extreme commands, each applied where the last left the
/// state, so that extremes meet extremes (a revision far ahead, then a
/// compaction to it, then a txn over it).
#[test]
fn command_sequences_with_extreme_values() {
    let strategy = proptest::collection::vec(command_value(), 1..6);
    check(
        "command_apply sequence",
        0.2,
        strategy,
        Expect::Any,
        |commands| {
            let mut state = populated_state();
            let mut verdict = Verdict::Refused;
            for command in &commands {
                verdict = command_apply_on(&state, &encode_command(command));
                let next = state.applied_index() + 1;
                state.apply_bytes(next, &encode_command(command));
                let restored = ferry_server::kv_state::KvState::restore(
                    &state.snapshot().expect("an in-memory state encodes"),
                    Default::default(),
                );
                assert!(
                    restored.is_ok(),
                    "a state reached by commands does not restore: {restored:?}"
                );
                state = restored.unwrap_or_else(|_| populated_state());
            }
            verdict
        },
    );
}

#[test]
fn authority_of_arbitrary_bytes() {
    check(
        "authority arbitrary",
        1.0,
        bytes(300),
        Expect::Any,
        |data| authority(&data),
    );
    let http2 = bytes(300).prop_map(|rest| [ferry_fuzz::server::PREFACE, &rest].concat());
    check(
        "authority arbitrary http2",
        1.0,
        http2,
        Expect::Any,
        |data| authority(&data),
    );
}

#[test]
fn authority_mutated() {
    check(
        "authority mutated seed",
        1.0,
        mutated_seed("authority"),
        Expect::Any,
        |data| authority(&data),
    );
    let authorities = prop_oneof![
        Just(b"http://127.0.0.1:2379".to_vec()),
        Just(b"https://host:1/path".to_vec()),
        Just(b"http://".to_vec()),
        Just(b"://:".to_vec()),
        bytes(60),
        "[a-z]{0,5}://[a-z0-9.:\\[\\]]{0,20}(/[a-z]{0,5})?".prop_map(String::into_bytes),
    ];
    check(
        "authority structured",
        1.0,
        (authorities, mutations()),
        Expect::Any,
        |(value, damage)| {
            let request = http2_request(&value);
            authority(&request);
            authority(&mutated(&request, &damage))
        },
    );
}

fn snapshot_value() -> impl Strategy<Value = ferry_server::pb::ferrypb::Snapshot> {
    use ferry_server::pb::authpb::{Permission, Role, User};
    use ferry_server::pb::etcdserverpb::AlarmMember;
    use ferry_server::pb::ferrypb::{
        AuthSnapshot, MemberRecordCommand, Snapshot, SnapshotLease, SnapshotVersion,
    };
    use ferry_server::pb::mvccpb::KeyValue;
    let version = (
        proptest::sample::select(vec![
            b"a".to_vec(),
            b"b".to_vec(),
            Vec::new(),
            vec![0xff; 3],
        ]),
        (extreme_i64(), extreme_i64(), extreme_i64()),
        (bytes(6), prop_oneof![Just(0i64), Just(7), extreme_i64()]),
        (any::<u32>(), any::<bool>()),
    )
        .prop_map(
            |(
                key,
                (mod_revision, create_revision, version),
                (value, lease),
                (sub_revision, tombstone),
            )| {
                SnapshotVersion {
                    kv: Some(KeyValue {
                        key: key.into(),
                        create_revision,
                        mod_revision,
                        version,
                        value: value.into(),
                        lease,
                    }),
                    sub_revision,
                    tombstone,
                }
            },
        );
    let lease = (
        prop_oneof![Just(7i64), extreme_i64()],
        extreme_i64(),
        proptest::collection::vec(key(), 0..3),
    )
        .prop_map(|(id, granted_ttl_seconds, keys)| SnapshotLease {
            id,
            granted_ttl_seconds,
            keys,
        });
    let member = (extreme_u64(), "\\PC{0,6}", any::<bool>()).prop_map(|(id, name, create)| {
        MemberRecordCommand {
            id,
            name: name.clone(),
            peer_addr: name.clone(),
            client_url: name,
            create,
        }
    });
    let auth = (
        any::<bool>(),
        extreme_u64(),
        proptest::collection::vec(
            (
                bytes(6),
                bytes(6),
                proptest::collection::vec("\\PC{0,4}", 0..3),
            ),
            0..3,
        ),
        proptest::collection::vec(
            (
                bytes(6),
                proptest::collection::vec((-1i32..4, key(), key()), 0..3),
            ),
            0..3,
        ),
    )
        .prop_map(|(enabled, revision, users, roles)| AuthSnapshot {
            enabled,
            revision,
            users: users
                .into_iter()
                .map(|(name, password, roles)| User {
                    name,
                    password,
                    roles,
                    options: None,
                })
                .collect(),
            roles: roles
                .into_iter()
                .map(|(name, permissions)| Role {
                    name,
                    key_permission: permissions
                        .into_iter()
                        .map(|(perm_type, key, range_end)| Permission {
                            perm_type,
                            key,
                            range_end,
                        })
                        .collect(),
                })
                .collect(),
        });
    (
        (extreme_u64(), extreme_i64(), extreme_i64(), extreme_i64()),
        proptest::collection::vec(version, 0..5),
        proptest::collection::vec(lease, 0..3),
        proptest::collection::vec(member, 0..3),
        proptest::option::of(auth),
        proptest::collection::vec((extreme_u64(), -1i32..4), 0..3),
        any::<bool>(),
    )
        .prop_map(
            |(
                (applied_index, revision, compacted_revision, lease_id_next),
                mut versions,
                leases,
                members,
                auth,
                alarms,
                tidy,
            )| {
                let (mut revision, mut compacted_revision, mut leases, mut auth) =
                    (revision, compacted_revision, leases, auth);
                if tidy {
                    // Consistent versions and revisions, so that the checks
                    // after the first ones are reached with extreme values in
                    // the other fields.
                    versions.retain(|v| v.kv.as_ref().is_some_and(|kv| !kv.key.is_empty()));
                    versions.sort_by(|a, b| {
                        a.kv.as_ref().unwrap().key.cmp(&b.kv.as_ref().unwrap().key)
                    });
                    versions
                        .dedup_by(|a, b| a.kv.as_ref().unwrap().key == b.kv.as_ref().unwrap().key);
                    for (revision, version) in (1i64..).zip(versions.iter_mut()) {
                        let kv = version.kv.as_mut().unwrap();
                        kv.mod_revision = revision;
                        kv.create_revision = revision;
                        kv.version = 1;
                        kv.lease = 0;
                    }
                    let floor = (versions.len() as i64).max(1);
                    revision = revision.clamp(floor, ferry_server::mvcc::REVISION_MAX);
                    compacted_revision = compacted_revision.clamp(0, revision);
                    for lease in &mut leases {
                        lease.keys.clear();
                    }
                    leases.sort_by_key(|lease| lease.id);
                    leases.dedup_by_key(|lease| lease.id);
                    auth = None;
                }
                Snapshot {
                    applied_index,
                    revision,
                    compacted_revision,
                    lease_id_next,
                    versions,
                    leases,
                    members,
                    auth,
                    alarms: alarms
                        .into_iter()
                        .map(|(member_id, alarm)| AlarmMember { member_id, alarm })
                        .collect(),
                }
            },
        )
}

/// Snapshots whose every field is drawn, with extreme values, sealed with
/// a valid checksum (what a buggy or hostile leader sends, or a forged
/// backup holds): refused, or restored to a state that goes on applying
/// entries and snapshots to itself.
#[test]
fn kv_snapshots_with_extreme_values() {
    use prost::Message;
    check(
        "kv_snapshot extreme values",
        1.0,
        snapshot_value(),
        Expect::Any,
        |snapshot| {
            let body = [b"FERRYKV1".as_slice(), &snapshot.encode_to_vec()].concat();
            kv_snapshot(&build::kv_snapshot(&body))
        },
    );
}
