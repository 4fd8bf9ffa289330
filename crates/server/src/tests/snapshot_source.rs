//! A snapshot's contents taken apart from the live state (what the driver
//! takes between two applies) encode to exactly the bytes of a snapshot
//! taken at that moment, whatever is applied afterwards, and the format is
//! the one earlier versions wrote.

use proptest::prelude::*;
use prost::Message;

use super::helpers::*;
use crate::error::KvError;
use crate::kv_state::{KvLimits, KvState};
use crate::pb::etcdserverpb::compare::{CompareResult, TargetUnion};
use crate::pb::etcdserverpb::TxnRequest;
use crate::pb::ferrypb::{self, Command};

/// A small state that uses every part of the snapshot format: a lease and
/// its key, an overwritten key, two writes in one txn (sub-revisions), a
/// tombstone, a member record, a compaction, and a value longer than 127
/// bytes (two-byte lengths).
fn golden_state() -> Machine {
    let mut m = Machine::new();
    m.ok(grant_cmd(7, 30));
    m.ok(put_lease_cmd("a", "1", 7));
    m.ok(put_cmd("b", "1"));
    m.ok(put_cmd("b", "2"));
    m.ok(txn_cmd(TxnRequest {
        compare: vec![],
        success: vec![op_put("c", "1"), op_put("d", "2")],
        failure: vec![],
    }));
    m.ok(delete_cmd("a", ""));
    m.ok(crate::command::command(
        crate::command::CommandKind::MemberRecord(crate::pb::ferrypb::MemberRecordCommand {
            id: 2,
            name: "n2".into(),
            peer_addr: "10.0.0.2:2380".into(),
            client_url: "http://10.0.0.2:2379".into(),
            create: false,
        }),
    ));
    m.ok(compact_cmd(3));
    m.ok(put_cmd("e", &"x".repeat(200)));
    m
}

/// `golden_state()`'s snapshot as the encoder before `SnapshotSource`
/// (one `ferrypb::Snapshot` built by cloning every key-value, encoded by
/// prost) wrote it.
const GOLDEN_HEX: &str = concat!(
    "46455252594b563108091007180320012a100a0e0a01611002180220012a013130072a090a050a01",
    "61180618012a0e0a0c0a01621003180320012a01312a0e0a0c0a01621003180420022a01322a0e0a",
    "0c0a01631005180520012a01312a100a0c0a01641005180520012a013210012ad7010ad4010a0165",
    "1007180720012ac80178787878787878787878787878787878787878787878787878787878787878",
    "78787878787878787878787878787878787878787878787878787878787878787878787878787878",
    "78787878787878787878787878787878787878787878787878787878787878787878787878787878",
    "78787878787878787878787878787878787878787878787878787878787878787878787878787878",
    "78787878787878787878787878787878787878787878787878787878787878787878787878787878",
    "78787878787878787832040807101e3a2b080212026e321a0d31302e302e302e323a323338302214",
    "687474703a2f2f31302e302e302e323a3233373915779e8e",
);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn the_snapshot_format_is_unchanged() {
    let m = golden_state();
    assert_eq!(hex(&m.kv.snapshot().unwrap()), GOLDEN_HEX);
    let source = m.kv.snapshot_source();
    assert_eq!(hex(&source.encode().unwrap()), GOLDEN_HEX);
    assert_eq!(source.encoded_len().unwrap() * 2, GOLDEN_HEX.len());
}

/// What prost's derived encoder writes for the message the bytes hold:
/// equal to the bytes only if they are that encoder's, field for field.
fn reencoded_by_prost(bytes: &[u8]) -> Vec<u8> {
    let body = &bytes[8..bytes.len() - 4];
    let message = ferrypb::Snapshot::decode(body).unwrap();
    let mut again = bytes[..8].to_vec();
    again.extend_from_slice(&message.encode_to_vec());
    let checksum = crc32c::crc32c(&again);
    again.extend_from_slice(&checksum.to_le_bytes());
    again
}

#[test]
fn values_larger_than_the_write_buffer_stream_in_pieces_with_the_same_bytes() {
    let mut m = Machine::new();
    // 3 MiB of values, some larger than the 1 MiB buffer on their own.
    for (i, size) in [10usize, 1 << 20, 300, (1 << 20) + 17, 5, 900_000]
        .iter()
        .enumerate()
    {
        m.ok(put_cmd(&format!("k{i}"), &"v".repeat(*size)));
    }
    let source = m.kv.snapshot_source();
    let whole = source.encode().unwrap();
    assert_eq!(whole.len(), source.encoded_len().unwrap());
    assert_eq!(whole, reencoded_by_prost(&whole));
    let mut pieces: Vec<Vec<u8>> = Vec::new();
    let written = source
        .write_to(|piece| {
            pieces.push(piece.to_vec());
            Ok::<(), KvError>(())
        })
        .unwrap();
    assert!(pieces.len() > 2, "the encoding is handed on in pieces");
    assert_eq!(written, whole.len() as u64);
    assert_eq!(pieces.concat(), whole);
    assert_eq!(KvState::restore(&whole, KvLimits::default()).unwrap(), m.kv);
}

#[test]
fn a_failing_sink_stops_the_write_with_its_error() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", &"v".repeat(1 << 20)));
    m.ok(put_cmd("b", &"v".repeat(1 << 20)));
    let mut calls = 0;
    let outcome = m.kv.snapshot_source().write_to(|_| {
        calls += 1;
        Err(KvError::Storage("disk full".into()))
    });
    assert_eq!(outcome, Err(KvError::Storage("disk full".into())));
    assert_eq!(calls, 1);
}

fn arbitrary_command() -> impl Strategy<Value = Command> {
    let key = prop::sample::select(vec!["a", "b", "c", "d/1", "d/2"]);
    // Values around the one-byte length limit too.
    let value = prop::sample::select(vec![0usize, 1, 127, 128, 300]).prop_map(|n| "v".repeat(n));
    prop_oneof![
        4 => (key.clone(), value.clone()).prop_map(|(k, v)| put_cmd(k, &v)),
        2 => (key.clone(), value.clone(), 1i64..4).prop_map(|(k, v, l)| put_lease_cmd(k, &v, l)),
        2 => key.clone().prop_map(|k| delete_cmd(k, "")),
        1 => Just(delete_cmd("d/", "d0")),
        1 => (1i64..12).prop_map(compact_cmd),
        1 => (1i64..4, 1i64..100).prop_map(|(id, ttl)| grant_cmd(id, ttl)),
        1 => (1i64..4).prop_map(revoke_cmd),
        2 => (key.clone(), value.clone(), key).prop_map(|(k1, v1, k2)| {
            txn_cmd(TxnRequest {
                compare: vec![cmp(k1, CompareResult::Equal, TargetUnion::Value(v1.into_bytes()))],
                success: vec![op_put(k2, "s1"), op_put("z", "s2")],
                failure: vec![op_delete(k1, "")],
            })
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The contents taken at one point are not changed by anything applied
    /// afterwards (overwrites, deletes, compactions, lease revokes): they
    /// encode to the snapshot of that point, which restores that state.
    #[test]
    fn a_snapshot_source_is_unaffected_by_later_applies(
        commands in proptest::collection::vec(arbitrary_command(), 1..60),
        cut in 0usize..60,
    ) {
        let mut m = Machine::new();
        let cut = cut % commands.len();
        let mut taken = None;
        for (position, command) in commands.iter().enumerate() {
            m.apply(command.clone());
            if position == cut {
                taken = Some((m.kv.snapshot_source(), m.kv.snapshot().unwrap(), m.kv.clone()));
            }
        }
        let (source, bytes_then, state_then) = taken.unwrap();
        let encoded = source.encode().unwrap();
        prop_assert_eq!(&encoded, &bytes_then);
        prop_assert_eq!(encoded.len(), source.encoded_len().unwrap());
        prop_assert_eq!(source.applied_index(), state_then.applied_index());
        prop_assert_eq!(&reencoded_by_prost(&encoded), &encoded);
        prop_assert_eq!(KvState::restore(&encoded, KvLimits::default()).unwrap(), state_then);
        // And the state now encodes as prost would, too.
        let now = m.kv.snapshot().unwrap();
        prop_assert_eq!(reencoded_by_prost(&now), now);
    }
}

/// The keys a lease records are kept in the snapshot (a store reopened
/// from disk reads them instead of every key) and, where the snapshot
/// carries the versions too, checked against them: a lease that forgets a
/// key, or names one that is not attached to it, is refused.
#[test]
fn a_snapshot_whose_leases_disagree_with_its_keys_is_refused() {
    let mut m = Machine::new();
    m.ok(grant_cmd(7, 30));
    m.ok(grant_cmd(8, 30));
    m.ok(put_lease_cmd("a", "1", 7));
    m.ok(put_lease_cmd("b", "1", 7));
    m.ok(put_cmd("c", "1"));
    let bytes = m.kv.snapshot().unwrap();
    let restored = KvState::restore(&bytes, KvLimits::default()).unwrap();
    assert_eq!(restored, m.kv);
    let body = ferrypb::Snapshot::decode(&bytes[8..bytes.len() - 4]).unwrap();
    let lease_7 = body.leases.iter().find(|l| l.id == 7).unwrap();
    assert_eq!(lease_7.keys, vec![b"a".to_vec(), b"b".to_vec()]);

    let resealed = |change: &dyn Fn(&mut ferrypb::Snapshot)| {
        let mut message = body.clone();
        change(&mut message);
        let mut again = bytes[..8].to_vec();
        again.extend_from_slice(&message.encode_to_vec());
        let checksum = crc32c::crc32c(&again);
        again.extend_from_slice(&checksum.to_le_bytes());
        KvState::restore(&again, KvLimits::default())
            .unwrap_err()
            .to_string()
    };
    let forgotten = resealed(&|s| s.leases[0].keys.pop().map_or((), drop));
    assert!(forgotten.contains("does not record it"), "{forgotten}");
    let extra = resealed(&|s| s.leases[0].keys.push(b"c".to_vec()));
    assert!(extra.contains("attached keys"), "{extra}");
    let elsewhere = resealed(&|s| {
        let key = s.leases[0].keys.pop().unwrap();
        s.leases[1].keys.push(key);
    });
    assert!(elsewhere.contains("does not record it"), "{elsewhere}");
    let twice = resealed(&|s| {
        let copy = s.leases[0].clone();
        s.leases.push(copy);
    });
    assert!(twice.contains("appears twice"), "{twice}");
}
