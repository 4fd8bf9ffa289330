//! Snapshots round-trip and refuse damage; apply is deterministic.

use proptest::prelude::*;

use super::helpers::*;
use crate::error::CodecError;
use crate::kv_state::{KvLimits, KvState};
use crate::pb::etcdserverpb::compare::{CompareResult, TargetUnion};
use crate::pb::etcdserverpb::TxnRequest;
use crate::pb::ferrypb::Command;

fn arbitrary_command() -> impl Strategy<Value = Command> {
    let key = prop::sample::select(vec!["a", "b", "c", "d/1", "d/2"]);
    let value = prop::sample::select(vec!["0", "1", "2"]);
    prop_oneof![
        4 => (key.clone(), value.clone()).prop_map(|(k, v)| put_cmd(k, v)),
        2 => (key.clone(), value.clone(), 1i64..4).prop_map(|(k, v, l)| put_lease_cmd(k, v, l)),
        2 => key.clone().prop_map(|k| delete_cmd(k, "")),
        1 => Just(delete_cmd("d/", "d0")),
        1 => (1i64..12).prop_map(compact_cmd),
        1 => (1i64..4, 1i64..100).prop_map(|(id, ttl)| grant_cmd(id, ttl)),
        1 => (1i64..4).prop_map(revoke_cmd),
        1 => proptest::collection::vec(1i64..4, 0..3).prop_map(expire_cmd),
        2 => (key.clone(), value.clone(), key, value).prop_map(|(k1, v1, k2, v2)| {
            txn_cmd(TxnRequest {
                compare: vec![cmp(k1, CompareResult::Equal, TargetUnion::Value(v1.as_bytes().to_vec()))],
                success: vec![op_put(k2, v2), op_range("\0", "\0")],
                failure: vec![op_delete(k1, "")],
            })
        }),
    ]
}

#[test]
fn snapshot_round_trip_preserves_everything() {
    let mut m = Machine::new();
    let lease = match m.ok(grant_cmd(0, 30)) {
        crate::kv_state::CommandResponse::LeaseGrant(g) => g.id,
        other => panic!("unexpected {other:?}"),
    };
    m.ok(put_lease_cmd("a", "1", lease));
    m.ok(put_cmd("b", "1"));
    m.ok(put_cmd("b", "2"));
    m.ok(delete_cmd("a", ""));
    m.ok(put_lease_cmd("c", "1", lease));
    m.ok(compact_cmd(3));
    let bytes = m.kv.snapshot().unwrap();
    let restored = KvState::restore(&bytes, KvLimits::default()).unwrap();
    assert_eq!(restored, m.kv);
    assert_eq!(restored.snapshot().unwrap(), bytes);
}

#[test]
fn damaged_snapshots_are_refused_with_a_reason() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1"));
    let bytes = m.kv.snapshot().unwrap();
    let limits = KvLimits::default;
    assert!(matches!(
        KvState::restore(&bytes[..5], limits()),
        Err(CodecError::Truncated { .. })
    ));
    let mut flipped = bytes.clone();
    flipped[12] ^= 0x40;
    assert!(matches!(
        KvState::restore(&flipped, limits()),
        Err(CodecError::ChecksumMismatch { .. })
    ));
    let mut magic = bytes.clone();
    magic[0] = b'X';
    assert_eq!(
        KvState::restore(&magic, limits()),
        Err(CodecError::BadMagic)
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Two replicas applying the same commands end in the same state, and a
    /// replica restored from a snapshot taken midway ends there too.
    #[test]
    fn apply_is_deterministic_and_snapshots_resume(
        commands in proptest::collection::vec(arbitrary_command(), 1..60),
        cut in 0usize..60,
    ) {
        let mut first = Machine::new();
        let mut second = Machine::new();
        let cut = cut % commands.len();
        let mut restored: Option<Machine> = None;
        for (position, command) in commands.iter().enumerate() {
            let a = first.apply(command.clone());
            let b = second.apply(command.clone());
            prop_assert_eq!(&a, &b);
            if let Some(r) = restored.as_mut() {
                let c = r.apply(command.clone());
                prop_assert_eq!(&a, &c);
            }
            if position == cut {
                let kv = KvState::restore(&first.kv.snapshot().unwrap(), KvLimits::default()).unwrap();
                restored = Some(Machine { kv, index: first.index });
            }
        }
        prop_assert_eq!(first.kv.snapshot().unwrap(), second.kv.snapshot().unwrap());
        if let Some(r) = restored {
            prop_assert_eq!(r.kv.snapshot().unwrap(), first.kv.snapshot().unwrap());
        }
        // Invariants: every lease's key set is exactly the live keys naming it.
        for (id, record) in first.kv.leases() {
            for key in &record.keys {
                let kv = first.kv.store().get(key, crate::mvcc::ReadAt::Latest).unwrap().unwrap();
                prop_assert_eq!(kv.lease, *id);
            }
        }
    }

    #[test]
    fn arbitrary_snapshot_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = KvState::restore(&bytes, KvLimits::default());
    }
}

/// A snapshot of `snapshot` as a member sends it: magic, protobuf, crc32c.
fn sealed(snapshot: &crate::pb::ferrypb::Snapshot) -> Vec<u8> {
    use prost::Message;
    let mut bytes = b"FERRYKV1".to_vec();
    bytes.extend_from_slice(&snapshot.encode_to_vec());
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    bytes
}

/// Found by fuzzing (`crates/fuzz`, kv_snapshot with extreme values): a
/// snapshot at revision i64::MAX restored, and the next write computed
/// revision + 1, which wrapped (a panic with overflow checks, a negative
/// revision without). Snapshots past `REVISION_MAX` are refused, and a
/// store that reaches it takes no more writes (so its own snapshot always
/// restores).
#[test]
fn a_snapshot_at_a_revision_with_no_room_after_it_is_refused() {
    use crate::mvcc::REVISION_MAX;
    use crate::pb::ferrypb::Snapshot;
    for revision in [i64::MAX, i64::MAX - 1, REVISION_MAX + 1] {
        let snapshot = Snapshot {
            applied_index: 5,
            revision,
            compacted_revision: revision,
            lease_id_next: 1,
            ..Snapshot::default()
        };
        assert!(
            matches!(
                KvState::restore(&sealed(&snapshot), KvLimits::default()),
                Err(CodecError::Inconsistent(_))
            ),
            "revision {revision} restored"
        );
    }
    let at_the_last = Snapshot {
        applied_index: 5,
        revision: REVISION_MAX,
        compacted_revision: REVISION_MAX,
        lease_id_next: i64::MAX,
        ..Snapshot::default()
    };
    let mut kv = KvState::restore(&sealed(&at_the_last), KvLimits::default()).unwrap();
    let applied = kv.apply(6, &put_cmd("a", "1"));
    assert_eq!(
        applied.response,
        Err(crate::error::KvError::RevisionsExhausted)
    );
    assert_eq!(applied.revision, REVISION_MAX);
    let granted = kv.apply(7, &grant_cmd(0, 30));
    assert!(granted.response.is_ok(), "{granted:?}");
    // Its own snapshot restores: the state never goes past the last revision.
    let again = KvState::restore(&kv.snapshot().unwrap(), KvLimits::default()).unwrap();
    assert_eq!(again, kv);
    let one_before = Snapshot {
        revision: REVISION_MAX - 1,
        compacted_revision: 0,
        ..at_the_last
    };
    let mut kv = KvState::restore(&sealed(&one_before), KvLimits::default()).unwrap();
    assert!(kv.apply(6, &put_cmd("a", "1")).response.is_ok());
    assert_eq!(
        kv.apply(7, &put_cmd("a", "2")).response,
        Err(crate::error::KvError::RevisionsExhausted)
    );
    assert_eq!(kv.store().revision(), REVISION_MAX);
}

/// Found by fuzzing (the same target): a version whose `version` (or
/// creation) is above its own revision can be at i64::MAX, and the next
/// put of its key computed version + 1. Such a version is refused.
#[test]
fn a_version_above_its_revision_is_refused() {
    use crate::pb::ferrypb::{Snapshot, SnapshotVersion};
    use crate::pb::mvccpb::KeyValue;
    let with = |version: i64, create_revision: i64| Snapshot {
        applied_index: 2,
        revision: 2,
        lease_id_next: 1,
        versions: vec![SnapshotVersion {
            kv: Some(KeyValue {
                key: b"a".to_vec().into(),
                create_revision,
                mod_revision: 2,
                version,
                value: b"v".to_vec().into(),
                lease: 0,
            }),
            sub_revision: 0,
            tombstone: false,
        }],
        ..Snapshot::default()
    };
    for (version, create_revision) in [(i64::MAX, 2), (3, 2), (-1, 2), (1, 3), (1, -1)] {
        assert!(
            matches!(
                KvState::restore(
                    &sealed(&with(version, create_revision)),
                    KvLimits::default()
                ),
                Err(CodecError::Inconsistent(_))
            ),
            "version {version} created at {create_revision} restored"
        );
    }
    let mut kv = KvState::restore(&sealed(&with(2, 1)), KvLimits::default()).unwrap();
    assert!(kv.apply(3, &put_cmd("a", "2")).response.is_ok());
}
