//! Backups: the state streamed with its SHA-256, inspected, and restored as
//! the state before a new cluster's first entry; a damaged file is refused
//! and restores nothing.

use std::path::{Path, PathBuf};

use ring::digest::{digest, SHA256};

use super::helpers::*;
use crate::backup::{self, BackupError, BACKUP_HASH_BYTES};
use crate::command::{command, CommandKind};
use crate::kv_state::{KvLimits, KvState};
use crate::pb::ferrypb::MemberRecordCommand;

/// A state with overwrites, deletes, a lease and a member record: 15
/// numbered keys and the leased one.
fn loaded() -> Machine {
    let mut m = Machine::new();
    for i in 0..50 {
        m.ok(put_cmd(&format!("k{:02}", i % 20), &format!("v{i}")));
    }
    m.ok(delete_cmd("k00", "k05"));
    m.ok(grant_cmd(7, 600));
    m.ok(put_lease_cmd("leased", "x", 7));
    m.ok(command(CommandKind::MemberRecord(MemberRecordCommand {
        id: 2,
        name: "two".into(),
        peer_addr: "127.0.0.1:22380".into(),
        client_url: "http://127.0.0.1:22379".into(),
        create: false,
    })));
    m
}

/// The backup of `m` as a client receives it, checking that each blob
/// says exactly how many bytes remain after it.
fn backup_of(m: &Machine) -> Vec<u8> {
    let mut bytes = Vec::new();
    let mut counted = Vec::new();
    let total = backup::stream_backup(&m.kv.snapshot_source(), |blob, remaining| {
        assert!(blob.len() <= backup::BACKUP_BLOB_BYTES_MAX);
        bytes.extend_from_slice(&blob);
        counted.push((bytes.len() as u64, remaining));
        Ok(())
    })
    .unwrap();
    assert_eq!(total, bytes.len() as u64);
    for (received, remaining) in counted {
        assert_eq!(received + remaining, total);
    }
    bytes
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn all_keys(kv: &KvState) -> Vec<crate::pb::mvccpb::KeyValue> {
    kv.range(&range("\0", "\0")).unwrap().kvs
}

#[test]
fn a_backup_is_the_state_followed_by_its_sha256_and_says_what_it_holds() {
    let m = loaded();
    let bytes = backup_of(&m);
    // etcdctl's check: whole 512-byte blocks, then the hash.
    assert_eq!(bytes.len() % 512, BACKUP_HASH_BYTES);
    let (padded, hash) = bytes.split_at(bytes.len() - BACKUP_HASH_BYTES);
    assert_eq!(hash, digest(&SHA256, padded).as_ref());
    let snapshot = m.kv.snapshot().unwrap();
    assert_eq!(&padded[..snapshot.len()], snapshot.as_slice());
    let (zeros, length) = padded[snapshot.len()..].split_at(padded.len() - snapshot.len() - 8);
    assert!(zeros.iter().all(|b| *b == 0));
    assert_eq!(length, (snapshot.len() as u64).to_le_bytes());
    let dir = ferry_storage::unique_temp_dir("backup-inspect");
    let info = backup::inspect(&write(&dir, "backup.db", &bytes)).unwrap();
    assert_eq!(info.revision, m.revision());
    assert_eq!(info.keys, 16, "20 keys, 5 deleted, and the leased one");
    assert_eq!(
        info.versions,
        50 + 5 + 1,
        "the puts, the tombstones, the leased put"
    );
    assert_eq!(info.leases, 1);
    assert_eq!(info.size_bytes, bytes.len() as u64);
    assert_eq!(info.sha256.len(), 64);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_restored_backup_is_the_state_before_the_first_entry_without_the_old_members() {
    let m = loaded();
    assert!(!m.kv.member_records().is_empty());
    let dir = ferry_storage::unique_temp_dir("backup-restore");
    let file = write(&dir, "backup.db", &backup_of(&m));
    let data_dir = dir.join("node");
    let info = backup::restore(&file, &data_dir, KvLimits::default()).unwrap();
    assert_eq!(info.revision, m.revision());
    let store_dir = crate::node::first_store_dir(&data_dir.join(crate::node::KV_DIR));
    let restored = KvState::open(
        ferry_storage::AnyDisk::Fs(ferry_storage::FsDisk),
        &store_dir,
        KvLimits::default(),
    )
    .unwrap();
    assert_eq!(
        restored.applied_index(),
        0,
        "before the new cluster's first entry"
    );
    assert!(restored.member_records().is_empty());
    assert_eq!(restored.store().revision(), m.revision());
    assert_eq!(all_keys(&restored), all_keys(&m.kv));
    // A data directory that holds something is not written over.
    match backup::restore(&file, &data_dir, KvLimits::default()) {
        Err(BackupError::DataDirInUse(dir)) => assert_eq!(dir, data_dir),
        other => panic!("expected DataDirInUse, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_damaged_or_cut_backup_is_refused_and_restores_nothing() {
    let bytes = backup_of(&loaded());
    let mut damaged: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x01;
    damaged.push(("a byte of the state", flipped));
    let mut flipped = bytes.clone();
    flipped[bytes.len() - 1] ^= 0x01;
    damaged.push(("a byte of the hash", flipped));
    damaged.push(("cut by one byte", bytes[..bytes.len() - 1].to_vec()));
    damaged.push(("cut to its magic", bytes[..40].to_vec()));
    damaged.push(("shorter than a hash", bytes[..10].to_vec()));
    let mut longer = bytes.clone();
    longer.push(0);
    damaged.push(("one byte too many", longer));
    let mut wrong_length = bytes.clone();
    let at = bytes.len() - BACKUP_HASH_BYTES - 8;
    wrong_length[at] ^= 0x01;
    damaged.push(("a byte of the snapshot's length", wrong_length));
    let dir = ferry_storage::unique_temp_dir("backup-damaged");
    for (i, (what, bytes)) in damaged.iter().enumerate() {
        let file = write(&dir, &format!("damaged-{i}.db"), bytes);
        assert!(backup::inspect(&file).is_err(), "{what}: inspected");
        let data_dir = dir.join(format!("node-{i}"));
        let refused = backup::restore(&file, &data_dir, KvLimits::default());
        assert!(refused.is_err(), "{what}: restored");
        assert!(
            !data_dir.join(crate::node::KV_DIR).exists(),
            "{what}: left a state behind"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A backup of `snapshot` (encoded as a member streams it), with a valid
/// crc32c, padding, length and SHA-256 around it.
fn backup_holding(snapshot: &crate::pb::ferrypb::Snapshot) -> Vec<u8> {
    use prost::Message;
    let mut bytes = b"FERRYKV1".to_vec();
    bytes.extend_from_slice(&snapshot.encode_to_vec());
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let content_bytes = bytes.len() as u64;
    let padding = (512 - (content_bytes + 8) % 512) % 512;
    bytes.resize(bytes.len() + padding as usize, 0);
    bytes.extend_from_slice(&content_bytes.to_le_bytes());
    let hash = digest(&SHA256, &bytes);
    bytes.extend_from_slice(hash.as_ref());
    bytes
}

/// Found by fuzzing (`crates/fuzz`, backup_file): `ferry snapshot status`
/// called a backup whole whose key was attached to a lease that did not
/// record it (or whose versions were out of order), which `ferry snapshot
/// restore` then refused. Status makes every check restore makes.
#[test]
fn a_backup_that_restore_would_refuse_is_refused_by_status_too() {
    use crate::pb::ferrypb::{Snapshot, SnapshotLease, SnapshotVersion};
    use crate::pb::mvccpb::KeyValue;
    let version = |key: &str, revision: i64, lease: i64| SnapshotVersion {
        kv: Some(KeyValue {
            key: key.as_bytes().to_vec().into(),
            create_revision: revision,
            mod_revision: revision,
            version: 1,
            value: b"v".to_vec().into(),
            lease,
        }),
        sub_revision: 0,
        tombstone: false,
    };
    let whole = Snapshot {
        applied_index: 3,
        revision: 3,
        lease_id_next: 8,
        versions: vec![version("a", 2, 0), version("b", 3, 7)],
        leases: vec![SnapshotLease {
            id: 7,
            granted_ttl_seconds: 60,
            keys: vec![b"b".to_vec()],
        }],
        ..Snapshot::default()
    };
    let dir = ferry_storage::unique_temp_dir("backup-inconsistent");
    let file = write(&dir, "whole.db", &backup_holding(&whole));
    assert!(backup::inspect(&file).is_ok());
    let unrecorded = Snapshot {
        leases: Vec::new(),
        ..whole.clone()
    };
    let out_of_order = Snapshot {
        versions: vec![version("b", 3, 7), version("a", 2, 0)],
        ..whole.clone()
    };
    let duplicate_lease = Snapshot {
        leases: [whole.leases.clone(), whole.leases.clone()].concat(),
        ..whole.clone()
    };
    let past_the_last_revision = Snapshot {
        revision: i64::MAX,
        ..whole.clone()
    };
    for (i, (what, snapshot)) in [
        ("a key its lease does not record", unrecorded),
        ("versions out of order", out_of_order),
        ("a lease listed twice", duplicate_lease),
        ("a revision past the last", past_the_last_revision),
    ]
    .into_iter()
    .enumerate()
    {
        let file = write(
            &dir,
            &format!("inconsistent-{i}.db"),
            &backup_holding(&snapshot),
        );
        assert!(
            matches!(backup::inspect(&file), Err(BackupError::Snapshot { .. })),
            "{what}: inspected as whole"
        );
        let data_dir = dir.join(format!("node-{i}"));
        assert!(
            backup::restore(&file, &data_dir, KvLimits::default()).is_err(),
            "{what}: restored"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
