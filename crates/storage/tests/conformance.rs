//! One conformance suite, run against every storage backend: the real
//! filesystem (a unique directory under the system temp folder) and the
//! simulated disk.

mod common;

use std::collections::BTreeMap;

use common::*;
use ferry_raft::{Configuration, HardState, PersistRequest, SnapshotMeta};
use ferry_storage::{Disk, Storage, StorageError, WalOptions};

fn open<B: Backend>(b: &B, options: WalOptions) -> (Storage<B::D>, ferry_storage::RecoveryReport) {
    Storage::open(b.disk(), &b.dir(), options).unwrap()
}

fn req(seq: u64, hs: Option<HardState>, entries: Vec<ferry_raft::Entry>) -> PersistRequest {
    PersistRequest {
        seq,
        hard_state: hs,
        entries,
    }
}

fn hs(term: u64, vote: Option<u64>, commit: u64) -> Option<HardState> {
    Some(HardState { term, vote, commit })
}

fn empty_directory_opens_empty<B: Backend>(b: B) {
    let (s, report) = open(&b, WalOptions::default());
    assert!(report.groups.is_empty());
    assert_eq!(report.wal.truncated_bytes, 0);
    assert_eq!(s.wal.groups().count(), 0);
    drop(s);
    b.restart();
    let (_, report) = open(&b, WalOptions::default());
    assert!(report.groups.is_empty());
}

fn appends_survive_restart<B: Backend>(b: B) {
    let mut model = Model::new();
    let (mut s, _) = open(&b, WalOptions::default());
    for g in 1..=3u64 {
        let r = req(
            1,
            hs(1, Some(g), 0),
            (1..=5).map(|i| entry(i, 1, g)).collect(),
        );
        s.wal.append(g, &r).unwrap();
        model.entry(g).or_default().persist(&r);
    }
    let durable = s.wal.sync().unwrap();
    assert_eq!(durable, BTreeMap::from([(1, 1), (2, 1), (3, 1)]));
    let r = req(2, hs(2, None, 3), vec![entry(6, 2, 2)]);
    s.wal.append(2, &r).unwrap();
    model.entry(2).or_default().persist(&r);
    assert_eq!(s.wal.sync().unwrap(), BTreeMap::from([(2, 2)]));
    assert!(s.wal.sync().unwrap().is_empty(), "nothing new to sync");
    drop(s);
    b.restart();
    let (s, report) = open(&b, WalOptions::default());
    matches_model(&s, &report.groups, &model).unwrap();
    assert_eq!(s.wal.last_index(2), Some(6));
    assert_eq!(s.wal.term(2, 6), Some(2));
    let restored = report.groups[&1].restored_state(Configuration::with_voters([1, 2, 3]));
    assert_eq!(restored.entries.len(), 5);
    assert_eq!(
        restored.snapshot.config,
        Configuration::with_voters([1, 2, 3])
    );
    assert_eq!(restored.hard_state.vote, Some(1));
}

fn entries_replace_the_suffix<B: Backend>(b: B) {
    let mut model = Model::new();
    let (mut s, _) = open(&b, small_options());
    let reqs = [
        req(
            1,
            hs(1, None, 0),
            (1..=10).map(|i| entry(i, 1, 1)).collect(),
        ),
        req(
            2,
            hs(2, Some(2), 4),
            (6..=8).map(|i| entry(i, 2, 9)).collect(),
        ),
        req(3, None, (8..=12).map(|i| entry(i, 3, 8)).collect()),
    ];
    for r in &reqs {
        s.wal.append(1, r).unwrap();
        model.entry(1).or_default().persist(r);
    }
    s.wal.sync().unwrap();
    let got = s.wal.entries(1, 1, 13, u64::MAX).unwrap();
    assert_eq!(got, model[&1].entries);
    // A request that would leave a gap is refused and changes nothing.
    let err = s
        .wal
        .append(1, &req(4, None, vec![entry(14, 3, 1)]))
        .unwrap_err();
    assert!(matches!(err, StorageError::InvalidRequest { .. }), "{err}");
    drop(s);
    b.restart();
    let (s, report) = open(&b, small_options());
    matches_model(&s, &report.groups, &model).unwrap();
    assert_eq!(
        s.wal.entries(1, 5, 13, u64::MAX).unwrap(),
        model[&1].entries[4..].to_vec()
    );
}

fn reads_come_from_cache_and_disk<B: Backend>(b: B) {
    let (mut s, _) = open(&b, small_options());
    let all: Vec<_> = (1..=40).map(|i| entry(i, 1 + i / 10, 5)).collect();
    for (k, chunk) in all.chunks(3).enumerate() {
        s.wal
            .append(5, &req(k as u64 + 1, None, chunk.to_vec()))
            .unwrap();
    }
    // Unsynced and partly still in the write buffer: reads must see it all.
    assert_eq!(s.wal.entries(5, 1, 41, u64::MAX).unwrap(), all);
    s.wal.sync().unwrap();
    assert!(s.wal.segment_count() > 2, "small segments rotate");
    for lo in 1..=40 {
        for hi in lo + 1..=41 {
            assert_eq!(
                s.wal.entries(5, lo, hi, u64::MAX).unwrap(),
                all[lo as usize - 1..hi as usize - 1]
            );
        }
    }
    // A byte limit returns a prefix, never nothing.
    let one = s.wal.entries(5, 1, 41, 0).unwrap();
    assert_eq!(one, all[..1]);
    let some = s.wal.entries(5, 1, 41, 200).unwrap();
    assert!(!some.is_empty() && some.len() < 40);
    assert_eq!(some, all[..some.len()]);
    let err = s.wal.entries(5, 0, 3, u64::MAX).unwrap_err();
    assert!(matches!(err, StorageError::OutOfRange { .. }), "{err}");
    let err = s.wal.entries(5, 40, 42, u64::MAX).unwrap_err();
    assert!(matches!(err, StorageError::OutOfRange { .. }), "{err}");
    assert!(matches!(
        s.wal.entries(9, 1, 2, 10),
        Err(StorageError::UnknownGroup(9))
    ));
}

fn compaction_deletes_old_segments<B: Backend>(b: B) {
    let mut model = Model::new();
    let (mut s, _) = open(&b, small_options());
    let mut seq = 0;
    for round in 0..20u64 {
        for g in 1..=3u64 {
            seq += 1;
            let first = model.get(&g).map_or(0, |m| m.last_index()) + 1;
            let r = req(
                seq,
                hs(round + 1, Some(g), first),
                vec![entry(first, round + 1, g), entry(first + 1, round + 1, g)],
            );
            s.wal.append(g, &r).unwrap();
            model.entry(g).or_default().persist(&r);
        }
        s.wal.sync().unwrap();
    }
    let before = s.wal.segment_count();
    assert!(before > 5, "{before} segments");
    // Snapshot every group at its last index but one, then compact.
    for g in 1..=3u64 {
        let m = &model[&g];
        let at = m.last_index() - 1;
        let term = m.entries.iter().find(|e| e.index == at).unwrap().term;
        let meta = SnapshotMeta {
            index: at,
            term,
            config: Configuration::with_voters([1, 2, 3]),
        };
        let data = snapshot_data(g, at, 1000);
        let mut w = s.begin_snapshot(g, meta.clone()).unwrap();
        w.write(0, &data).unwrap();
        s.save_snapshot(w).unwrap();
        s.wal.compact(g, at).unwrap();
        model.get_mut(&g).unwrap().snapshot(meta, data);
    }
    s.wal.sync().unwrap();
    let after = s.wal.segment_count();
    // Only the segments holding the last entry of each group (and the current one) remain.
    assert!(after <= 3, "old segments removed: {before} -> {after}");
    assert!(
        s.wal.entries(1, 1, 2, u64::MAX).is_err(),
        "compacted entries are gone"
    );
    drop(s);
    b.restart();
    let (s, report) = open(&b, small_options());
    matches_model(&s, &report.groups, &model).unwrap();
    let g1 = report.groups[&1].restored_state(Configuration::default());
    assert_eq!(g1.applied, model[&1].snapshot.as_ref().unwrap().0.index);
}

fn a_slow_group_pins_only_its_segments<B: Backend>(b: B) {
    // Group 2 never snapshots: its first entries keep old segments alive,
    // and a restart still finds everything.
    let mut model = Model::new();
    let (mut s, _) = open(&b, small_options());
    let r = req(1, hs(1, None, 0), vec![entry(1, 1, 2)]);
    s.wal.append(2, &r).unwrap();
    model.entry(2).or_default().persist(&r);
    for i in 1..=30u64 {
        let r = req(i, None, vec![entry(i, 1, 1)]);
        s.wal.append(1, &r).unwrap();
        model.entry(1).or_default().persist(&r);
        s.wal.sync().unwrap();
    }
    let meta = SnapshotMeta {
        index: 30,
        term: 1,
        config: Configuration::default(),
    };
    let w = s.begin_snapshot(1, meta.clone()).unwrap();
    s.save_snapshot(w).unwrap();
    s.wal.compact(1, 30).unwrap();
    model.get_mut(&1).unwrap().snapshot(meta, Vec::new());
    s.wal.sync().unwrap();
    assert!(s.wal.segment_count() > 3, "group 2 pins the old segments");
    // Removing the slow group lets the next sync delete its segments.
    s.wal.remove_group(2).unwrap();
    model.remove(&2);
    s.wal.sync().unwrap();
    assert!(s.wal.segment_count() <= 2, "{}", s.wal.segment_count());
    // A hard state alone (no entries) is a valid persist request.
    s.wal.append(1, &req(40, hs(2, None, 30), vec![])).unwrap();
    model.get_mut(&1).unwrap().hard_state = HardState {
        term: 2,
        vote: None,
        commit: 30,
    };
    s.wal.sync().unwrap();
    assert!(s.wal.segment_count() <= 2, "{}", s.wal.segment_count());
    drop(s);
    b.restart();
    let (s, report) = open(&b, small_options());
    matches_model(&s, &report.groups, &model).unwrap();
}

fn snapshots_round_trip_in_chunks<B: Backend>(b: B) {
    let (mut s, _) = open(&b, WalOptions::default());
    let sizes = [0usize, 1, 65_535, 65_536, 65_537, 300_000];
    let mut metas = Vec::new();
    for (k, &size) in sizes.iter().enumerate() {
        let meta = SnapshotMeta {
            index: 10 * (k as u64 + 1),
            term: 1,
            config: Configuration::with_voters([1, 2, 3]),
        };
        let data = snapshot_data(7, meta.index, size);
        let mut w = s.begin_snapshot(7, meta.clone()).unwrap();
        let mut off = 0;
        for chunk in data.chunks(10_007) {
            w.write(off, chunk).unwrap();
            off += chunk.len() as u64;
        }
        if off > 0 {
            let err = w.write(0, b"x").unwrap_err();
            assert!(
                matches!(err, StorageError::SnapshotChunkOutOfOrder { .. }),
                "{err}"
            );
        }
        if k % 2 == 1 {
            // Sealed first (as a caller does on another thread): complete,
            // closed to more chunks, and finished the same way.
            w.seal().unwrap();
            w.seal().unwrap();
            let err = w.write(off, b"x").unwrap_err();
            assert!(matches!(err, StorageError::SnapshotSealed { .. }), "{err}");
        }
        s.save_snapshot(w).unwrap();
        for max in [1u64, 4096, 65_536, 100_000, u64::MAX] {
            let mut got = Vec::new();
            let mut offset = 0;
            loop {
                let (chunk, done) = s
                    .snapshots
                    .read_chunk(7, meta.index, offset, max)
                    .unwrap()
                    .unwrap();
                got.extend_from_slice(&chunk);
                offset += chunk.len() as u64;
                if done {
                    break;
                }
                assert!(!chunk.is_empty());
            }
            assert_eq!(got, data, "size {size}, chunk {max}");
        }
        metas.push((meta, data));
    }
    // Only the two newest are kept.
    assert_eq!(s.snapshots.read_chunk(7, 10, 0, 10).unwrap(), None);
    assert!(s.snapshots.read_chunk(7, 50, 0, 10).unwrap().is_some());
    assert_eq!(s.snapshots.latest(7), Some(&metas[5].0));
    // An older snapshot than the latest is refused.
    assert!(s.begin_snapshot(7, metas[0].0.clone()).is_err());
    // A temporary file left by an unfinished transfer is cleaned up.
    let unfinished = s
        .begin_snapshot(
            7,
            SnapshotMeta {
                index: 99,
                ..metas[5].0.clone()
            },
        )
        .unwrap();
    drop(unfinished);
    // So is one sealed but never finished: it never became the latest.
    let mut sealed = s
        .begin_snapshot(
            7,
            SnapshotMeta {
                index: 98,
                ..metas[5].0.clone()
            },
        )
        .unwrap();
    sealed.write(0, b"sealed, not finished").unwrap();
    sealed.seal().unwrap();
    drop(sealed);
    drop(s);
    b.restart();
    let (s, report) = open(&b, WalOptions::default());
    let files = b.disk().list_files(&b.dir().join("snapshots")).unwrap();
    assert_eq!(files.len(), 2, "{files:?}");
    assert_eq!(report.groups[&7].snapshot.as_ref(), Some(&metas[5].0));
    assert_eq!(s.snapshots.read_all(7, 60).unwrap().unwrap(), metas[5].1);
    assert_eq!(s.snapshots.read_all(7, 50).unwrap().unwrap(), metas[4].1);
}

/// A received snapshot is restored from its own file, one verified block
/// at a time, before it is installed; the reader goes on reading the file
/// once it is moved into place, and a damaged block is an error, never
/// other data.
fn a_sealed_snapshot_reads_back_block_by_block<B: Backend>(b: B) {
    use std::io::Read;
    let (mut s, _) = open(&b, WalOptions::default());
    for (k, size) in [0usize, 1, 65_536, 200_001].into_iter().enumerate() {
        let meta = SnapshotMeta {
            index: 10 * (k as u64 + 1),
            term: 1,
            config: Configuration::with_voters([1, 2, 3]),
        };
        let data = snapshot_data(3, meta.index, size);
        let mut w = s.begin_snapshot(3, meta.clone()).unwrap();
        let mut off = 0;
        for chunk in data.chunks(9_001) {
            w.write(off, chunk).unwrap();
            off += chunk.len() as u64;
        }
        let err = w.data_reader().unwrap_err();
        assert!(matches!(err, StorageError::InvalidRequest { .. }), "{err}");
        w.seal().unwrap();
        let mut reader = w.data_reader().unwrap();
        assert_eq!(reader.data_bytes(), size as u64);
        // Half read before the file is moved into place, the rest after.
        let mut got = vec![0u8; size / 2];
        reader.read_exact(&mut got).unwrap();
        s.save_snapshot(w).unwrap();
        reader.read_to_end(&mut got).unwrap();
        assert_eq!(got, data, "size {size}");
    }
    // A flipped byte in the second block of a sealed file.
    let meta = SnapshotMeta {
        index: 100,
        term: 2,
        config: Configuration::with_voters([1, 2, 3]),
    };
    let data = snapshot_data(3, 100, 200_000);
    let mut w = s.begin_snapshot(3, meta).unwrap();
    w.write(0, &data).unwrap();
    w.seal().unwrap();
    let tmp = b
        .disk()
        .list_files(&b.dir().join("snapshots"))
        .unwrap()
        .into_iter()
        .find(|n| n.ends_with(".tmp"))
        .expect("the file being received");
    b.corrupt_byte(&b.dir().join("snapshots").join(tmp), 70_000);
    let mut got = Vec::new();
    let err = w.data_reader().unwrap().read_to_end(&mut got).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
    assert!(got.len() <= 65_536, "only the good first block was yielded");
    assert_eq!(got[..], data[..got.len()]);
}

fn installing_a_snapshot_resets_the_log<B: Backend>(b: B) {
    let mut model = Model::new();
    let (mut s, _) = open(&b, small_options());
    let r = req(1, hs(1, None, 0), (1..=8).map(|i| entry(i, 1, 3)).collect());
    s.wal.append(3, &r).unwrap();
    model.entry(3).or_default().persist(&r);
    s.wal.sync().unwrap();
    let meta = SnapshotMeta {
        index: 20,
        term: 4,
        config: Configuration::with_voters([1, 2, 3]),
    };
    let data = snapshot_data(3, 20, 5000);
    let mut w = s.begin_snapshot(3, meta.clone()).unwrap();
    w.write(0, &data[..100]).unwrap();
    w.write(100, &data[100..]).unwrap();
    s.install_snapshot(w).unwrap();
    s.wal.sync().unwrap();
    model
        .get_mut(&3)
        .unwrap()
        .snapshot(meta.clone(), data.clone());
    assert_eq!(s.wal.last_index(3), Some(20));
    assert_eq!(s.wal.term(3, 20), Some(4));
    let r = req(2, hs(4, None, 20), vec![entry(21, 4, 3)]);
    s.wal.append(3, &r).unwrap();
    model.get_mut(&3).unwrap().persist(&r);
    // A group new to this node starts from a snapshot alone.
    let meta9 = SnapshotMeta {
        index: 5,
        term: 2,
        config: Configuration::with_voters([4, 5, 6]),
    };
    let w = s.begin_snapshot(9, meta9.clone()).unwrap();
    s.install_snapshot(w).unwrap();
    model.entry(9).or_default().snapshot(meta9, Vec::new());
    s.wal.sync().unwrap();
    drop(s);
    b.restart();
    let (s, report) = open(&b, small_options());
    matches_model(&s, &report.groups, &model).unwrap();
    let restored = report.groups[&3].restored_state(Configuration::default());
    assert_eq!(restored.applied, 20);
    assert_eq!(restored.hard_state.commit, 20);
}

fn many_groups_share_one_log<B: Backend>(b: B) {
    let mut model = Model::new();
    let (mut s, _) = open(&b, WalOptions::default());
    for round in 1..=3u64 {
        for g in 1..=1000u64 {
            let r = req(
                round,
                hs(round, Some(1), round - 1),
                vec![entry(round, round, g)],
            );
            s.wal.append(g, &r).unwrap();
            model.entry(g).or_default().persist(&r);
        }
        let durable = s.wal.sync().unwrap();
        assert_eq!(durable.len(), 1000, "one sync covers every group");
        assert!(durable.values().all(|seq| *seq == round));
    }
    drop(s);
    b.restart();
    let (s, report) = open(&b, WalOptions::default());
    matches_model(&s, &report.groups, &model).unwrap();
}

fn the_next_batch_fills_while_a_sync_is_in_flight<B: Backend>(b: B) {
    let (mut s, _) = open(&b, WalOptions::default());
    s.wal
        .append(1, &req(1, hs(1, None, 0), vec![entry(1, 1, 1)]))
        .unwrap();
    s.wal
        .append(2, &req(1, None, vec![entry(1, 1, 2)]))
        .unwrap();
    let pending = s.wal.prepare_sync().unwrap().unwrap();
    assert!(matches!(
        s.wal.prepare_sync(),
        Err(StorageError::SyncInFlight)
    ));
    // The sync runs on another thread while this one keeps appending.
    let worker = std::thread::spawn(move || {
        let outcome = pending.execute();
        (pending, outcome)
    });
    s.wal
        .append(1, &req(2, None, vec![entry(2, 1, 1)]))
        .unwrap();
    s.wal
        .append(3, &req(1, None, vec![entry(1, 1, 3)]))
        .unwrap();
    let (pending, outcome) = worker.join().unwrap();
    let durable = s.wal.complete_sync(pending, outcome).unwrap();
    assert_eq!(
        durable,
        BTreeMap::from([(1, 1), (2, 1)]),
        "only what was written before the prepare"
    );
    let durable = s.wal.sync().unwrap();
    assert_eq!(durable, BTreeMap::from([(1, 2), (3, 1)]));
    drop(s);
    b.restart();
    let (_, report) = open(&b, WalOptions::default());
    assert_eq!(report.groups[&1].entries.len(), 2);
    assert_eq!(report.groups[&3].entries.len(), 1);
}

/// How a test tears the last record of a log.
#[derive(Clone, Copy)]
enum Tear {
    /// A log that appends without reserving: the file ends inside the
    /// record.
    Appended,
    /// A log with reserved space: the record's last bytes read as zeros
    /// (its write did not all reach the disk) and the zeros go on after it.
    InReservedSpace,
}

fn a_torn_tail_is_cut_and_reported<B: Backend>(b: B) {
    a_torn_tail_is_cut(b, Tear::Appended);
}

fn a_torn_record_in_reserved_space_is_cut_and_reported<B: Backend>(b: B) {
    a_torn_tail_is_cut(b, Tear::InReservedSpace);
}

fn a_torn_tail_is_cut<B: Backend>(b: B, tear: Tear) {
    let options = match tear {
        Tear::Appended => WalOptions {
            reserve_bytes: 0,
            ..WalOptions::default()
        },
        Tear::InReservedSpace => WalOptions::default(),
    };
    let (mut s, _) = open(&b, options.clone());
    s.wal
        .append(1, &req(1, hs(1, None, 0), vec![entry(1, 1, 1)]))
        .unwrap();
    s.wal.sync().unwrap();
    s.wal
        .append(1, &req(2, None, vec![entry(2, 1, 1), entry(3, 1, 1)]))
        .unwrap();
    // Written to the file, never synced.
    let pending = s.wal.prepare_sync().unwrap();
    assert!(pending.is_some());
    drop(s);
    b.restart_keeping_written();
    // Cut the unsynced record short, as a crash in the middle of its write
    // would. (Cutting a synced one is lost synced data: see lost_data.rs.)
    let seg = last_segment(&b);
    let file_len = b.file_len(&seg);
    match tear {
        Tear::Appended => b.disk().truncate_synced(&seg, file_len - 5).unwrap(),
        Tear::InReservedSpace => {
            let len = b.content_len(&seg);
            assert!(file_len > len + 1000, "the segment has reserved space");
            b.zero_bytes(&seg, len - 5, 5);
        }
    }
    let (mut s, report) = open(&b, options.clone());
    assert!(report.wal.truncated_bytes > 0);
    if let Tear::InReservedSpace = tear {
        assert!(
            report.wal.truncated_bytes < 200,
            "only the torn record counts as cut, not the zeros after it: {}",
            report.wal.truncated_bytes
        );
    }
    assert_eq!(report.wal.truncated_file.as_deref(), Some(seg.as_path()));
    assert_eq!(report.groups[&1].entries, vec![entry(1, 1, 1)]);
    // The log keeps working after the cut, and a second restart is clean.
    s.wal
        .append(1, &req(3, None, vec![entry(2, 2, 1)]))
        .unwrap();
    s.wal.sync().unwrap();
    drop(s);
    b.restart();
    let (_, report) = open(&b, options);
    assert_eq!(report.wal.truncated_bytes, 0);
    assert_eq!(
        report.groups[&1].entries,
        vec![entry(1, 1, 1), entry(2, 2, 1)]
    );
}

/// The current segment is written into zeros reserved ahead of it; a
/// restart finds its records followed by zeros and reads that as space not
/// yet used, not as a torn write. Sealed segments end with their last
/// record.
fn reserved_space_is_not_a_torn_write<B: Backend>(b: B) {
    let options = WalOptions {
        segment_size_bytes_max: 64 * 1024,
        reserve_bytes: 16 * 1024,
        ..WalOptions::default()
    };
    let (mut s, _) = open(&b, options.clone());
    let mut model = Model::new();
    for i in 1..=60u64 {
        let payload = ferry_raft::EntryPayload::Command(vec![i as u8 | 1; 4000].into());
        let r = req(
            i,
            hs(1, Some(1), i - 1),
            vec![ferry_raft::Entry {
                term: 1,
                index: i,
                payload,
            }],
        );
        s.wal.append(1, &r).unwrap();
        model.entry(1).or_default().persist(&r);
        s.wal.sync().unwrap();
    }
    assert!(s.wal.segment_count() >= 3, "the log rotated");
    let dir = b.dir().join("wal");
    let segments: Vec<_> = b
        .disk()
        .list_files(&dir)
        .unwrap()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .map(|n| dir.join(n))
        .collect();
    let (last, sealed) = segments.split_last().unwrap();
    for seg in sealed {
        assert_eq!(
            b.file_len(seg),
            b.content_len(seg),
            "{} was cut back to its last record when it was sealed",
            seg.display()
        );
    }
    assert!(
        b.file_len(last) > b.content_len(last),
        "the current segment has reserved space"
    );
    assert!(
        b.file_len(last) <= 64 * 1024,
        "reserved up to the segment size"
    );
    drop(s);
    b.restart();
    let (s, report) = open(&b, options);
    assert_eq!(report.wal.truncated_bytes, 0);
    assert_eq!(report.wal.truncated_file, None);
    matches_model(&s, &report.groups, &model).unwrap();
}

fn corruption_in_the_middle_is_an_error<B: Backend>(b: B) {
    let (mut s, _) = open(&b, WalOptions::default());
    for i in 1..=5 {
        s.wal
            .append(1, &req(i, None, vec![entry(i, 1, 1)]))
            .unwrap();
    }
    s.wal.sync().unwrap();
    drop(s);
    b.restart();
    let seg = last_segment(&b);
    let len = b.content_len(&seg);
    b.corrupt_byte(&seg, len / 2);
    match Storage::open(b.disk(), &b.dir(), WalOptions::default()) {
        Err(StorageError::Corrupt { path, offset, .. }) => {
            assert_eq!(path, seg);
            assert!(offset <= len / 2, "{offset}");
        }
        other => panic!("expected corruption, got {other:?}"),
    }
}

fn errors_are_typed<B: Backend>(b: B) {
    let (mut s, _) = open(&b, WalOptions::default());
    assert!(matches!(
        s.wal.compact(4, 1),
        Err(StorageError::UnknownGroup(4))
    ));
    s.wal
        .append(4, &req(1, None, vec![entry(1, 1, 4)]))
        .unwrap();
    assert!(matches!(
        s.wal.compact(4, 2),
        Err(StorageError::OutOfRange { .. })
    ));
    let bad = req(2, None, vec![entry(2, 2, 4), entry(4, 2, 4)]);
    assert!(matches!(
        s.wal.append(4, &bad),
        Err(StorageError::InvalidRequest { .. })
    ));
    let backwards = req(2, None, vec![entry(2, 3, 4), entry(3, 2, 4)]);
    assert!(matches!(
        s.wal.append(4, &backwards),
        Err(StorageError::InvalidRequest { .. })
    ));
    s.wal.compact(4, 1).unwrap();
    let below_base = req(3, None, vec![entry(1, 1, 4)]);
    assert!(matches!(
        s.wal.append(4, &below_base),
        Err(StorageError::InvalidRequest { .. })
    ));
    assert!(s.wal.compact(4, 1).is_ok(), "compacting again is a no-op");
}

fn random_operations_match_the_model<B: Backend>(b: B) {
    // Random scripts (appends that replace suffixes, syncs, snapshots,
    // compaction, installs, removals), each followed by a restart: the
    // recovered state is the model's, and reads agree with it.
    let mut opened = open(&b, small_options()).0;
    let mut groups_seen = std::collections::BTreeSet::new();
    for seed in 0..8u64 {
        // Each script starts from what the previous one left, so its groups
        // are offset to keep them apart.
        let (ops, states) = random_script(seed);
        let offset = 100 * seed;
        for op in &ops {
            let op = match op.clone() {
                Op::Append(g, r) => Op::Append(g + offset, r),
                Op::Compact(g, at) => Op::Compact(g + offset, at),
                Op::SaveSnapshot(g, m, d) => Op::SaveSnapshot(g + offset, m, d),
                Op::Install(g, m, d) => Op::Install(g + offset, m, d),
                Op::Remove(g) => Op::Remove(g + offset),
                Op::Sync => Op::Sync,
            };
            apply(&mut opened, &op).unwrap();
        }
        opened.wal.sync().unwrap();
        drop(opened);
        b.restart();
        let (s, report) = open(&b, small_options());
        let want: Model = states
            .last()
            .unwrap()
            .iter()
            .map(|(g, m)| (g + offset, m.clone()))
            .collect();
        let mine = report
            .groups
            .iter()
            .filter(|(g, _)| (offset..offset + 100).contains(*g))
            .map(|(g, r)| (*g, r.clone()))
            .collect();
        matches_model(&s, &mine, &want).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        for (g, m) in &want {
            if let (Some(first), Some(last)) = (m.entries.first(), m.entries.last()) {
                let got = s
                    .wal
                    .entries(*g, first.index, last.index + 1, u64::MAX)
                    .unwrap();
                assert_eq!(got, m.entries, "seed {seed} group {g}");
            }
            groups_seen.insert(*g);
        }
        opened = s;
    }
    assert!(groups_seen.len() > 10, "{groups_seen:?}");
}

fn disk_operations_behave_alike<B: Backend>(b: B) {
    use ferry_storage::DiskFile;
    let disk = b.disk();
    let dir = b.dir().join("raw");
    disk.create_dir_all(&dir).unwrap();
    assert!(disk.list_files(&dir).unwrap().is_empty());
    let a = dir.join("a");
    let f = disk.create(&a).unwrap();
    f.append(b"hello ").unwrap();
    f.append(b"world").unwrap();
    f.sync_data().unwrap();
    disk.sync_dir(&dir).unwrap();
    assert_eq!(disk.read_all(&a).unwrap(), b"hello world");
    assert_eq!(disk.file_len(&a).unwrap(), 11);
    let mut buf = [0u8; 5];
    disk.read_exact_at(&a, 6, &mut buf).unwrap();
    assert_eq!(&buf, b"world");
    let err = disk.read_exact_at(&a, 8, &mut buf).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    disk.truncate_synced(&a, 5).unwrap();
    assert_eq!(disk.read_all(&a).unwrap(), b"hello");
    let c = dir.join("c");
    disk.rename(&a, &c).unwrap();
    assert!(disk.read_all(&a).is_err());
    assert_eq!(disk.list_files(&dir).unwrap(), vec!["c".to_string()]);
    // Creating an existing name starts it empty.
    let f = disk.create(&c).unwrap();
    f.append(b"x").unwrap();
    assert_eq!(disk.read_all(&c).unwrap(), b"x");
    disk.remove_file(&c).unwrap();
    assert!(disk.list_files(&dir).unwrap().is_empty());
    assert!(disk.remove_file(&c).is_err());
    // Reserved space reads as zeros after the appended bytes; appends
    // overwrite it; releasing it cuts the file back to what was appended.
    let r = dir.join("r");
    let f = disk.create(&r).unwrap();
    f.append(b"abc").unwrap();
    f.reserve(100).unwrap();
    f.reserve(50).unwrap();
    assert_eq!(disk.file_len(&r).unwrap(), 100);
    f.append(b"def").unwrap();
    f.sync_data().unwrap();
    let mut want = b"abcdef".to_vec();
    want.resize(100, 0);
    assert_eq!(disk.read_all(&r).unwrap(), want);
    let mut buf = [9u8; 4];
    disk.read_exact_at(&r, 96, &mut buf).unwrap();
    assert_eq!(buf, [0; 4]);
    f.append(&[7u8; 120]).unwrap();
    assert_eq!(
        disk.file_len(&r).unwrap(),
        126,
        "an append past the reserve grows the file"
    );
    f.reserve(200).unwrap();
    f.release_reserved().unwrap();
    f.sync_data().unwrap();
    assert_eq!(disk.file_len(&r).unwrap(), 126);
    assert_eq!(&disk.read_all(&r).unwrap()[..6], b"abcdef");
}

fn last_segment<B: Backend>(b: &B) -> std::path::PathBuf {
    let dir = b.dir().join("wal");
    let names = b.disk().list_files(&dir).unwrap();
    // The newest segment is the empty one the last open created; the data
    // is in the one before it (or in the newest if it holds records).
    let mut best = None;
    for name in names.iter().rev().filter(|n| n.ends_with(".seg")) {
        let path = dir.join(name);
        if b.content_len(&path) > 200 {
            best = Some(path);
            break;
        }
    }
    best.expect("a segment with data")
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod fs {
            use super::*;
            $(#[test] fn $name() { super::$name(FsBackend::new(stringify!($name))); })*
        }
        mod sim {
            use super::*;
            $(#[test] fn $name() { super::$name(SimBackend::new(42)); })*
        }
    };
}

conformance!(
    empty_directory_opens_empty,
    appends_survive_restart,
    entries_replace_the_suffix,
    reads_come_from_cache_and_disk,
    compaction_deletes_old_segments,
    a_slow_group_pins_only_its_segments,
    snapshots_round_trip_in_chunks,
    a_sealed_snapshot_reads_back_block_by_block,
    installing_a_snapshot_resets_the_log,
    many_groups_share_one_log,
    the_next_batch_fills_while_a_sync_is_in_flight,
    a_torn_tail_is_cut_and_reported,
    a_torn_record_in_reserved_space_is_cut_and_reported,
    reserved_space_is_not_a_torn_write,
    corruption_in_the_middle_is_an_error,
    errors_are_typed,
    random_operations_match_the_model,
    disk_operations_behave_alike,
);
