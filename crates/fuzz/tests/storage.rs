//! The storage layer's decoders under proptest: arbitrary bytes, mutations
//! of valid encodings (also behind valid checksums), valid records with
//! extreme values, and real logs and snapshots damaged on disk.

mod common;

use bytes::Bytes;
use common::{bytes, check, extreme_u64, mutated_seed, mutations, within_one_burst, Expect};
use ferry_fuzz::mutate::mutated;
use ferry_fuzz::storage::{
    build, log_state, snapshot_chunks, snapshot_file, wal_record, wal_recovery, wal_segment,
    LogStep,
};
use ferry_fuzz::Verdict;
use ferry_raft::{Configuration, Entry, EntryPayload, HardState, SnapshotMeta};
use ferry_storage::codec::{WalRecord, WAL_FORMAT_VERSION, WAL_FORMAT_VERSION_OLDEST};
use ferry_storage::log_state::{LogState, SealedSegment, SyncClaim, Vote};
use proptest::prelude::*;

fn configuration() -> impl Strategy<Value = Configuration> {
    let set = || proptest::collection::btree_set(extreme_u64().prop_map(|id| id.max(1)), 0..4);
    (set(), set(), set()).prop_map(|(voters, voters_outgoing, learners)| Configuration {
        voters,
        voters_outgoing,
        learners,
    })
}

fn hard_state() -> impl Strategy<Value = HardState> {
    (
        extreme_u64(),
        proptest::option::of(extreme_u64()),
        extreme_u64(),
    )
        .prop_map(|(term, vote, commit)| HardState { term, vote, commit })
}

/// A valid record with extreme values (entries consecutive from an
/// extreme first index, terms not decreasing, as the decoder requires).
fn record() -> impl Strategy<Value = WalRecord> {
    let payload = prop_oneof![
        Just(EntryPayload::Noop),
        bytes(100).prop_map(|b| EntryPayload::Command(Bytes::from(b))),
        configuration().prop_map(EntryPayload::Config),
    ];
    let persist = (
        extreme_u64(),
        extreme_u64(),
        proptest::option::of(hard_state()),
        extreme_u64(),
        extreme_u64(),
        proptest::collection::vec(payload, 0..5),
    )
        .prop_map(|(group, seq, hard_state, first, term, payloads)| {
            let first = first.clamp(1, u64::MAX - 8);
            WalRecord::Persist {
                group,
                seq,
                hard_state,
                entries: (first..)
                    .zip(payloads)
                    .map(|(index, payload)| Entry {
                        term,
                        index,
                        payload,
                    })
                    .collect(),
            }
        });
    prop_oneof![
        (
            extreme_u64(),
            proptest::option::of(extreme_u64()),
            any::<bool>()
        )
            .prop_map(|(segment, previous_len, oldest)| WalRecord::SegmentHeader {
                segment,
                version: if oldest {
                    WAL_FORMAT_VERSION_OLDEST
                } else {
                    WAL_FORMAT_VERSION
                },
                previous_len: if oldest { None } else { previous_len },
            }),
        (
            extreme_u64(),
            hard_state(),
            extreme_u64(),
            extreme_u64(),
            extreme_u64()
        )
            .prop_map(|(group, hard_state, base_index, base_term, last_index)| {
                WalRecord::Checkpoint {
                    group,
                    hard_state,
                    base_index,
                    base_term,
                    last_index,
                }
            }),
        persist,
        (extreme_u64(), extreme_u64(), extreme_u64()).prop_map(|(group, through, term)| {
            WalRecord::Compact {
                group,
                through,
                term,
            }
        }),
        (extreme_u64(), extreme_u64(), extreme_u64())
            .prop_map(|(group, index, term)| WalRecord::ResetToSnapshot { group, index, term }),
        extreme_u64().prop_map(|group| WalRecord::RemoveGroup { group }),
    ]
}

fn log_state_value() -> impl Strategy<Value = LogState> {
    (
        extreme_u64(),
        proptest::option::of((extreme_u64(), extreme_u64())),
        proptest::collection::btree_map(
            extreme_u64(),
            (extreme_u64(), proptest::option::of(extreme_u64())),
            0..5,
        ),
    )
        .prop_map(|(next_segment, sealed, votes)| LogState {
            next_segment,
            sealed: sealed.map(|(segment, len)| SealedSegment { segment, len }),
            votes: votes
                .into_iter()
                .map(|(group, (term, vote))| (group, Vote { term, vote }))
                .collect(),
        })
}

/// A segment of records in a plausible order: the header first (of
/// segment 1 and the current format), then checkpoints and the rest.
fn segment_records() -> impl Strategy<Value = Vec<WalRecord>> {
    (
        proptest::option::of(extreme_u64()),
        proptest::collection::vec(record(), 0..8),
    )
        .prop_map(|(previous_len, rest)| {
            let mut records = vec![WalRecord::SegmentHeader {
                segment: 1,
                version: WAL_FORMAT_VERSION,
                previous_len,
            }];
            records.extend(
                rest.into_iter()
                    .filter(|r| !matches!(r, WalRecord::SegmentHeader { .. })),
            );
            records
        })
}

fn log_steps() -> impl Strategy<Value = Vec<LogStep>> {
    let step = prop_oneof![
        4 => (1u64..4, 0u64..4, 0u64..6, 0usize..120, any::<bool>()).prop_map(
            |(group, rewind, count, command_bytes, new_term)| LogStep::Append {
                group,
                rewind,
                count,
                command_bytes,
                new_term,
            }
        ),
        1 => (1u64..4, 0u64..4).prop_map(|(group, keep)| LogStep::Compact { group, keep }),
    ];
    proptest::collection::vec(step, 1..12)
}

#[test]
fn wal_records_of_arbitrary_bytes() {
    check(
        "wal_record arbitrary",
        1.0,
        bytes(300),
        Expect::Any,
        |data| wal_record(&data),
    );
}

#[test]
fn wal_records_mutated() {
    check(
        "wal_record mutated seed",
        2.0,
        mutated_seed("wal_record"),
        Expect::Both,
        |data| wal_record(&data),
    );
}

/// A valid record with extreme values decodes to itself; its mutations
/// are refused or decode to what their bytes encode; a mutated frame fails
/// its checksum.
#[test]
fn wal_records_with_extreme_values() {
    check(
        "wal_record structured",
        2.0,
        (record(), mutations()),
        Expect::Both,
        |(record, damage)| {
            let encoded = build::record(&record);
            assert_eq!(WalRecord::decode(Bytes::from(encoded.clone())), Ok(record));
            assert_eq!(wal_record(&encoded), Verdict::Accepted);
            let framed = build::framed(std::slice::from_ref(&encoded));
            assert_eq!(wal_record(&framed), Verdict::Accepted);
            let damaged = mutated(&framed, &damage);
            // A crc32c detects every change within four bytes; wider damage
            // may, in principle, rewrite the payload and its checksum alike.
            if damaged != framed && within_one_burst(&framed, &damaged) {
                let valid = matches!(
                    ferry_storage::codec::read_frame(&damaged, 0),
                    ferry_storage::codec::FrameRead::Valid { .. }
                );
                assert!(!valid, "a damaged frame passed its checksum");
            }
            wal_record(&mutated(&encoded, &damage))
        },
    );
}

#[test]
fn wal_segments_mutated() {
    check(
        "wal_segment mutated seed",
        0.5,
        mutated_seed("wal_segment"),
        Expect::Both,
        |data| wal_segment(&data),
    );
}

/// Segments of valid frames around records with extreme values, and the
/// same with records damaged behind valid checksums (what a bug in a
/// writer, not the disk, would leave).
#[test]
fn wal_segments_of_valid_frames() {
    let strategy = (segment_records(), mutations(), any::<usize>());
    check(
        "wal_segment structured",
        0.5,
        strategy,
        Expect::Both,
        |(records, damage, which)| {
            let mut pieces: Vec<Vec<u8>> = records.iter().map(build::record).collect();
            let damaged = which % pieces.len();
            pieces[damaged] = mutated(&pieces[damaged], &damage);
            wal_segment(&build::framed(&pieces))
        },
    );
}

#[test]
fn log_states_of_arbitrary_and_mutated_bytes() {
    check(
        "log_state arbitrary",
        1.0,
        bytes(200),
        Expect::Any,
        |data| log_state(&data),
    );
    check(
        "log_state mutated seed",
        1.0,
        mutated_seed("log_state"),
        Expect::Both,
        |data| log_state(&data),
    );
}

/// A state file with extreme values decodes to itself; damage behind a
/// valid checksum is refused or decodes to what its bytes encode.
#[test]
fn log_states_with_extreme_values() {
    let claims = proptest::collection::vec((extreme_u64(), extreme_u64()), 0..5);
    let strategy = (log_state_value(), mutations(), claims);
    check(
        "log_state structured",
        1.0,
        strategy,
        Expect::Both,
        |(state, damage, claims)| {
            let encoded = state.encode();
            assert_eq!(LogState::decode(&encoded), Ok(state));
            assert_eq!(log_state(&encoded), Verdict::Accepted);
            // Claims: the highest one counts.
            let mut progress = Vec::new();
            for (segment, len) in &claims {
                progress.extend(
                    SyncClaim {
                        segment: *segment,
                        len: *len,
                    }
                    .encode(),
                );
            }
            let highest = claims
                .iter()
                .map(|(segment, len)| SyncClaim {
                    segment: *segment,
                    len: *len,
                })
                .max();
            assert_eq!(SyncClaim::highest_in(&progress), highest);
            log_state(&mutated(&progress, &damage));
            let payload = &encoded[8..];
            log_state(&build::framed(&[mutated(payload, &damage)]))
        },
    );
}

/// Every byte of a snapshot file is under a checksum (header, blocks,
/// trailer) or checked against the others (the trailer's sizes): any
/// change is refused.
#[test]
fn snapshot_files_mutated() {
    let strategy = (common::seed("snapshot_file"), mutations());
    check(
        "snapshot_file mutated seed",
        0.5,
        strategy,
        Expect::Any,
        |(seed, damage)| {
            let damaged = mutated(&seed, &damage);
            let verdict = snapshot_file(&damaged);
            if damaged == seed {
                assert_eq!(verdict, Verdict::Accepted);
            } else if within_one_burst(&seed, &damaged) {
                assert_eq!(
                    verdict,
                    Verdict::Refused,
                    "a damaged snapshot file was accepted"
                );
            }
            verdict
        },
    );
}

/// Snapshot files with valid checksums around extreme headers and block
/// sizes, and around damaged headers.
#[test]
fn snapshot_files_with_extreme_values() {
    let strategy = (
        (extreme_u64(), extreme_u64(), configuration()),
        prop_oneof![Just(1u32), 1u32..300, Just(u32::MAX), Just(0u32)],
        bytes(600),
        proptest::option::of(mutations()),
    );
    check(
        "snapshot_file structured",
        0.5,
        strategy,
        Expect::Both,
        |((index, term, config), block_bytes, data, damage)| {
            let meta = SnapshotMeta {
                index,
                term,
                config,
            };
            let mut header = build::snapshot_header(1, &meta, block_bytes);
            if let Some(damage) = &damage {
                header = mutated(&header, damage);
            }
            let written_block_bytes = usize::try_from(block_bytes).unwrap_or(usize::MAX).max(1);
            let file = build::snapshot_file(&header, written_block_bytes, &data);
            let verdict = snapshot_file(&file);
            if damage.is_none() && block_bytes != 0 {
                assert_eq!(
                    verdict,
                    Verdict::Accepted,
                    "a valid snapshot file was refused"
                );
            }
            verdict
        },
    );
}

/// A real log, every step synced, damaged in one of its files: recovery
/// refuses it or recovers only what was written.
#[test]
fn wal_recovery_after_damage() {
    let strategy = (log_steps(), any::<usize>(), mutations());
    check(
        "wal_recovery",
        0.3,
        strategy,
        Expect::Both,
        |(steps, file, damage)| wal_recovery(&steps, file, &damage),
    );
}

/// A snapshot received in chunks at offsets a peer chose, then damaged.
#[test]
fn snapshot_chunks_then_damage() {
    let chunk = (prop_oneof![Just(0u64), any::<u64>(), 1u64..8], bytes(200));
    let strategy = (
        configuration(),
        proptest::collection::vec(chunk, 0..8),
        proptest::collection::vec(common::mutation(), 0..3),
    );
    check(
        "snapshot_chunks",
        0.3,
        strategy,
        Expect::Both,
        |(config, chunks, damage)| snapshot_chunks(&config, &chunks, &damage),
    );
}

/// The progress file's reader takes the highest claim before the first
/// damaged record, whatever follows.
#[test]
fn the_highest_claim_before_damage_counts() {
    let claims: Vec<SyncClaim> = (1..6)
        .map(|len| SyncClaim {
            segment: 3,
            len: len * 100,
        })
        .collect();
    let file: Vec<u8> = claims.iter().flat_map(SyncClaim::encode).collect();
    let one = claims[0].encode().len();
    for at in 0..file.len() {
        let mut damaged = file.clone();
        damaged[at] ^= 0x40;
        let intact = at / one;
        let expected = intact.checked_sub(1).map(|last| claims[last]);
        assert_eq!(SyncClaim::highest_in(&damaged), expected, "damage at {at}");
    }
}
