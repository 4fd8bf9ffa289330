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
