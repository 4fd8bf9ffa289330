//! Every file of the corpus kept in the repository (`crates/fuzz/corpus/
//! <target>/`: the seeds the real encoders made, and every input a fuzzer
//! found a bug with), and every input one byte away from each, through its
//! target.

mod common;

use std::path::{Path, PathBuf};

use ferry_fuzz::mutate::one_byte_neighbours;
use ferry_fuzz::{Verdict, TARGETS};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

/// The files of one target's corpus, by name.
fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(corpus_dir(target)) else {
        return Vec::new();
    };
    let mut files: Vec<(String, Vec<u8>)> = entries
        .map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(entry.path()).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// The most one-byte neighbours tried per corpus file up to 16 KiB: all of
/// them for small files, an even sample of a larger one's.
const NEIGHBOURS_MAX: usize = 4096;
/// The same for larger files (a crafted segment of a MiB takes tens of
/// milliseconds to refuse; thousands of its neighbours would take minutes).
const NEIGHBOURS_OF_LARGE_MAX: usize = 64;

fn run_corpus(target_name: &str) {
    let (_, target) = TARGETS
        .iter()
        .find(|(name, _)| *name == target_name)
        .unwrap();
    let files = corpus(target_name);
    assert!(
        !files.is_empty(),
        "no corpus for {target_name}: run the seed writer"
    );
    for (name, data) in &files {
        let verdict = target(data);
        // Commands are applied to a state that need not fit them.
        if name.starts_with("seed") && target_name != "command_apply" {
            assert_eq!(
                verdict,
                Verdict::Accepted,
                "{target_name}/{name} is a valid seed"
            );
        }
        // Five neighbours per byte (four flips and a cut).
        let max = if data.len() > 16 * 1024 {
            NEIGHBOURS_OF_LARGE_MAX
        } else {
            NEIGHBOURS_MAX
        };
        let step = (5 * data.len() / max).max(1);
        for neighbour in one_byte_neighbours(data, step) {
            target(&neighbour);
        }
    }
}

macro_rules! corpus_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                run_corpus(stringify!($name));
            }
        )*
    };
}

corpus_tests!(
    peer_frame,
    peer_handshake,
    peer_message,
    wal_record,
    wal_segment,
    log_state,
    snapshot_file,
    kv_snapshot,
    backup_file,
    command_apply,
    authority,
);

#[test]
fn every_target_has_a_corpus_test() {
    assert_eq!(TARGETS.len(), 11, "add the new target to corpus_tests!");
}

/// Writes the seeds the real encoders make into the corpus (run it after a
/// format change): `cargo test --release -p ferry-fuzz --test corpus --
/// --ignored write_seed_corpus`. Files a fuzzer found are kept.
#[test]
#[ignore]
fn write_seed_corpus() {
    for (target, _) in TARGETS {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, _) in corpus(target) {
            if name.starts_with("seed-") {
                std::fs::remove_file(dir.join(name)).unwrap();
            }
        }
        for (i, seed) in ferry_fuzz::seeds::seeds(target).iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}")), seed).unwrap();
        }
    }
}

/// Writes the inputs of the bugs the fuzz targets found into the corpus
/// (each as the bytes its target decodes), so that CI runs them and their
/// one-byte neighbours for good: `cargo test --release -p ferry-fuzz --test
/// corpus -- --ignored write_crash_corpus`. Each has a named regression
/// test next to the code that was fixed (see `crates/fuzz/FINDINGS.md`).
#[test]
#[ignore]
fn write_crash_corpus() {
    use ferry_fuzz::seeds;
    use ferry_runtime::transport::codec::encode_message;
    use ferry_server::pb::ferrypb::{Snapshot, SnapshotLease, SnapshotVersion};
    use ferry_server::pb::mvccpb::KeyValue;
    use ferry_storage::codec::{WalRecord, WAL_FORMAT_VERSION};
    use prost::Message;

    let write = |target: &str, name: &str, bytes: &[u8]| {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("crash-{name}")), bytes).unwrap();
    };
    // A configuration whose ids are out of order: the Append seed with the
    // outgoing voters [1, 2] written as [2, 1].
    let append = encode_message(&seeds::messages()[2]).to_vec();
    let ids = [1u64.to_le_bytes(), 2u64.to_le_bytes()].concat();
    let swapped = [2u64.to_le_bytes(), 1u64.to_le_bytes()].concat();
    let at = append
        .windows(20)
        .position(|w| w[..4] == 2u32.to_le_bytes() && w[4..] == ids[..])
        .unwrap()
        + 4;
    let mut out_of_order = append.clone();
    out_of_order[at..at + 16].copy_from_slice(&swapped);
    write("peer_message", "config-out-of-order", &out_of_order);
    // A segment header without a previous segment that gives its length.
    let mut header = ferry_fuzz::storage::build::record(&WalRecord::SegmentHeader {
        segment: 4,
        version: WAL_FORMAT_VERSION,
        previous_len: None,
    });
    let last = header.len() - 1;
    header[last] = 0x10;
    write("wal_record", "segment-header-stray-length", &header);
    // A checkpoint whose hard state has no vote but names a voter.
    let mut checkpoint = ferry_fuzz::storage::build::record(&WalRecord::Checkpoint {
        group: 1,
        hard_state: ferry_raft::HardState {
            term: 3,
            vote: None,
            commit: 5,
        },
        base_index: 2,
        base_term: 1,
        last_index: 9,
    });
    // Tag, group, term, then the vote flag and the voter's place.
    checkpoint[1 + 8 + 8 + 1] = 2;
    write("wal_record", "hard-state-stray-voter", &checkpoint);
    // A state file whose groups are out of order.
    let state = ferry_storage::log_state::LogState {
        next_segment: 3,
        sealed: None,
        votes: [
            (
                1,
                ferry_storage::log_state::Vote {
                    term: 1,
                    vote: None,
                },
            ),
            (
                2,
                ferry_storage::log_state::Vote {
                    term: 1,
                    vote: None,
                },
            ),
        ]
        .into(),
    };
    let encoded = state.encode();
    let payload = &encoded[8..];
    let group_at = 8 + 4 + 8 + 1 + 8 + 8 + 4;
    let mut reordered = payload.to_vec();
    let (first, second) = reordered[group_at..].split_at_mut(25);
    first.swap_with_slice(&mut second[..25]);
    write(
        "log_state",
        "groups-out-of-order",
        &ferry_fuzz::storage::build::framed(&[reordered]),
    );
    // A snapshot whose first field announces 60 MiB and holds 100 bytes.
    let mut announcing = b"FERRYKV1".to_vec();
    announcing.push(5 << 3 | 2);
    prost::encoding::encode_varint(60 << 20, &mut announcing);
    announcing.extend_from_slice(&[0u8; 100]);
    write("kv_snapshot", "field-announcing-60mib", &announcing);
    let sealed = |snapshot: &Snapshot| {
        ferry_fuzz::server::build::kv_snapshot(
            &[b"FERRYKV1".as_slice(), &snapshot.encode_to_vec()].concat(),
        )
    };
    // A snapshot at the last revision there is.
    let last_revision = Snapshot {
        applied_index: 5,
        revision: i64::MAX,
        compacted_revision: i64::MAX,
        lease_id_next: 1,
        ..Snapshot::default()
    };
    write("kv_snapshot", "revision-i64-max", &sealed(&last_revision));
    // A version above its own revision.
    let version = |key: &str, revision: i64, version: i64, lease: i64| SnapshotVersion {
        kv: Some(KeyValue {
            key: key.as_bytes().to_vec().into(),
            create_revision: revision,
            mod_revision: revision,
            version,
            value: b"v".to_vec().into(),
            lease,
        }),
        sub_revision: 0,
        tombstone: false,
    };
    let version_too_high = Snapshot {
        applied_index: 2,
        revision: 2,
        lease_id_next: 1,
        versions: vec![version("a", 2, i64::MAX, 0)],
        ..Snapshot::default()
    };
    write("kv_snapshot", "version-i64-max", &sealed(&version_too_high));
    // A backup whose leased key its lease does not record.
    let unrecorded = Snapshot {
        applied_index: 3,
        revision: 3,
        lease_id_next: 8,
        versions: vec![version("a", 2, 1, 0), version("b", 3, 1, 7)],
        leases: vec![SnapshotLease {
            id: 7,
            granted_ttl_seconds: 60,
            keys: Vec::new(),
        }],
        ..Snapshot::default()
    };
    // A segment whose tail has a record length that fits at every fourth
    // offset: judging whether it is a torn write took seconds per MiB.
    let header = ferry_fuzz::storage::build::record(&WalRecord::SegmentHeader {
        segment: 1,
        version: WAL_FORMAT_VERSION,
        previous_len: None,
    });
    let mut segment = ferry_fuzz::storage::build::framed(&[header]);
    let tail_bytes = 1usize << 20;
    let pattern = ((tail_bytes / 2) as u32).to_le_bytes();
    segment.extend(pattern.iter().copied().cycle().take(tail_bytes));
    write("wal_segment", "costly-tail", &segment);
    write(
        "backup_file",
        "lease-keys-unrecorded",
        &ferry_fuzz::server::build::backup(&sealed(&unrecorded)),
    );
}
