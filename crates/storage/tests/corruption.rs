//! A corruption test for each kind of file: the middle of a segment, the
//! tail of a sealed segment, the tail of the last segment (vouched for by a
//! surviving sync claim, or not), a missing segment, and snapshots (data
//! block, header, trailer). Plus a seeded sweep
//! of random sector damage: storage either refuses to start with a typed
//! error, or recovers exactly the right state; it never serves wrong data.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use ferry_raft::{Configuration, HardState, PersistRequest, SnapshotMeta};
use ferry_storage::codec::{read_frame, FrameRead};
use ferry_storage::{CrashMode, Disk, SimDisk, Storage, StorageError, WalOptions};

fn dir() -> PathBuf {
    PathBuf::from("/node")
}

fn options() -> WalOptions {
    WalOptions {
        segment_size_bytes_max: 700,
        ..small_options()
    }
}

/// Writes a few synced groups, with a snapshot for group 1; returns the model.
fn populate(disk: &SimDisk) -> Model {
    populate_rounds(disk).pop().unwrap()
}

/// Like [`populate`], returning the model after each synced round.
fn populate_rounds(disk: &SimDisk) -> Vec<Model> {
    let mut rounds = Vec::new();
    let mut model = Model::new();
    let (mut s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    for round in 1..=12u64 {
        for g in 1..=2u64 {
            let last = model.get(&g).map_or(0, |m| m.last_index());
            let r = PersistRequest {
                seq: round,
                hard_state: Some(HardState {
                    term: round,
                    vote: Some(g),
                    commit: last,
                }),
                entries: (last + 1..=last + 3).map(|i| entry(i, round, g)).collect(),
            };
            s.wal.append(g, &r).unwrap();
            model.entry(g).or_default().persist(&r);
        }
        s.wal.sync().unwrap();
        if round == 6 {
            let meta = SnapshotMeta {
                index: 10,
                term: 4,
                config: Configuration::with_voters([1, 2, 3]),
            };
            let data = snapshot_data(1, 10, 150_000);
            let mut w = s.begin_snapshot(1, meta.clone()).unwrap();
            w.write(0, &data).unwrap();
            s.save_snapshot(w).unwrap();
            s.wal.compact(1, 10).unwrap();
            model.get_mut(&1).unwrap().snapshot(meta, data);
        }
        rounds.push(model.clone());
    }
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    rounds
}

fn segments(disk: &SimDisk) -> Vec<PathBuf> {
    let wal = dir().join("wal");
    disk.list_files(&wal)
        .unwrap()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .map(|n| wal.join(n))
        .collect()
}

/// Offsets of the records in a segment.
fn record_offsets(disk: &SimDisk, path: &Path) -> Vec<u64> {
    let buf = disk.read_all(path).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    while let FrameRead::Valid { end, .. } = read_frame(&buf, at) {
        out.push(at as u64);
        at = end;
    }
    assert_eq!(at, buf.len(), "the segment is clean before we damage it");
    out
}

fn expect_corrupt(disk: &SimDisk, file: &Path, at_or_before: u64) -> String {
    match Storage::open(disk.clone(), &dir(), options()) {
        Err(err @ StorageError::Corrupt { .. }) => {
            let StorageError::Corrupt { path, offset, .. } = &err else {
                unreachable!()
            };
            assert_eq!(path, file, "{err}");
            assert!(*offset <= at_or_before, "{err}");
            let text = err.to_string();
            assert!(
                text.contains(&file.display().to_string()),
                "the message names the file: {text}"
            );
            assert!(
                text.contains("rejoins"),
                "the message says the way back: {text}"
            );
            text
        }
        Err(other) => panic!("expected corruption, got {other}"),
        Ok(_) => panic!("corruption in {} was not detected", file.display()),
    }
}

#[test]
fn segment_middle() {
    let disk = SimDisk::with_seed(1);
    populate(&disk);
    let segs = segments(&disk);
    assert!(segs.len() >= 3, "{segs:?}");
    for seg in [&segs[0], &segs[segs.len() / 2]] {
        let disk = SimDisk::with_seed(1);
        populate(&disk);
        let offsets = record_offsets(&disk, seg);
        let target = offsets[offsets.len() / 2] + 10;
        disk.corrupt_byte(seg, target);
        expect_corrupt(&disk, seg, target);
    }
}

#[test]
fn sealed_segment_tail() {
    let disk = SimDisk::with_seed(2);
    populate(&disk);
    let segs = segments(&disk);
    let sealed = &segs[segs.len() - 2];
    let len = disk.file_len(sealed).unwrap();
    // The last byte of a sealed segment: nothing valid follows in that file,
    // but it is not the last segment, so it cannot be a torn write.
    disk.corrupt_byte(sealed, len - 1);
    expect_corrupt(&disk, sealed, len);
}

#[test]
fn last_segment_tail_is_lost_synced_data_when_a_claim_vouches_for_it() {
    let disk = SimDisk::with_seed(3);
    populate(&disk);
    // Append one more synced record, then damage it. The first sync after
    // an open syncs its claim in the progress file, so the claim survives
    // the power loss and the damage is not taken for a torn write.
    let (mut s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    let last = s.wal.last_index(2).unwrap();
    s.wal
        .append(
            2,
            &PersistRequest {
                seq: 99,
                hard_state: None,
                entries: vec![entry(last + 1, 12, 2)],
            },
        )
        .unwrap();
    s.wal.sync().unwrap();
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    let segs = segments(&disk);
    let seg = segs.last().unwrap();
    let len = disk.file_len(seg).unwrap();
    disk.corrupt_byte(seg, len - 3);
    match Storage::open(disk.clone(), &dir(), options()) {
        Err(StorageError::LostSyncedData { path, .. }) => assert_eq!(&path, seg),
        other => panic!("expected lost synced data, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn last_segment_tail_is_cut_and_reported_when_its_claim_was_lost() {
    let disk = SimDisk::with_seed(3);
    let mut model = populate(&disk);
    // Two synced batches; only the first batch's claim is synced, so after
    // the power loss nothing vouches for the second. Damage to it is then
    // indistinguishable from a torn write: it is cut and the cut is
    // reported (the documented limit).
    let (mut s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    for k in 0..2 {
        let last = s.wal.last_index(2).unwrap();
        let r = PersistRequest {
            seq: 99 + k,
            hard_state: None,
            entries: vec![entry(last + 1, 12, 2)],
        };
        s.wal.append(2, &r).unwrap();
        s.wal.sync().unwrap();
        if k == 0 {
            model.get_mut(&2).unwrap().persist(&r);
        }
    }
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    let segs = segments(&disk);
    let seg = segs.last().unwrap();
    let len = disk.file_len(seg).unwrap();
    disk.corrupt_byte(seg, len - 3);
    let (s, report) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    assert!(report.wal.truncated_bytes > 0);
    assert_eq!(report.wal.truncated_file.as_deref(), Some(seg.as_path()));
    matches_model(&s, &report.groups, &model).unwrap();
}

#[test]
fn missing_segment() {
    let disk = SimDisk::with_seed(4);
    populate(&disk);
    let segs = segments(&disk);
    // Removing a segment in the middle leaves the older ones behind a gap;
    // group 2 never compacted, so its entries are missing.
    disk.remove_file(&segs[segs.len() / 2]).unwrap();
    disk.sync_dir(&dir().join("wal")).unwrap();
    match Storage::open(disk.clone(), &dir(), options()) {
        Err(StorageError::Corrupt { reason, .. }) => {
            assert!(reason.contains("no longer exist"), "{reason}")
        }
        other => panic!("expected corruption, got {:?}", other.map(|_| ())),
    }
}

fn snapshot_file(disk: &SimDisk) -> PathBuf {
    let d = dir().join("snapshots");
    d.join(&disk.list_files(&d).unwrap()[0])
}

#[test]
fn snapshot_data_block() {
    let disk = SimDisk::with_seed(5);
    populate(&disk);
    let snap = snapshot_file(&disk);
    // Second data block (the header is well under 100 bytes; blocks are 64 KiB + crc).
    let target = 100 + 65_536 + 1000;
    disk.corrupt_byte(&snap, target);
    let text = expect_corrupt(&disk, &snap, target);
    assert!(text.contains("block 1"), "{text}");
}

#[test]
fn snapshot_header_and_trailer() {
    for at_end in [false, true] {
        let disk = SimDisk::with_seed(6);
        populate(&disk);
        let snap = snapshot_file(&disk);
        let len = disk.file_len(&snap).unwrap();
        let target = if at_end { len - 10 } else { 20 };
        disk.corrupt_byte(&snap, target);
        expect_corrupt(&disk, &snap, target);
    }
}

#[test]
fn snapshot_damage_found_while_reading_for_a_transfer() {
    let disk = SimDisk::with_seed(7);
    populate(&disk);
    let (s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    let snap = snapshot_file(&disk);
    disk.corrupt_byte(&snap, 100 + 2 * (65_536 + 4) + 5);
    assert!(
        s.snapshots.read_chunk(1, 10, 0, 65_536).unwrap().is_some(),
        "undamaged blocks still read"
    );
    let err = s.snapshots.read_chunk(1, 10, 2 * 65_536, 100).unwrap_err();
    assert!(matches!(err, StorageError::Corrupt { .. }), "{err}");
}

#[test]
fn log_record_damage_found_while_reading_entries() {
    let disk = SimDisk::with_seed(8);
    populate(&disk);
    let (s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    let seg = &segments(&disk)[0];
    let offsets = record_offsets(&disk, seg);
    // Damage every record after the header of the oldest segment, which
    // holds group 2's first entries.
    for off in &offsets[1..] {
        disk.corrupt_byte(seg, off + 12);
    }
    // Early entries are no longer cached; reading them hits the damage.
    let mut saw = false;
    for lo in 1..=36 {
        match s.wal.entries(2, lo, lo + 1, u64::MAX) {
            Ok(got) => assert_eq!(got[0].index, lo),
            Err(StorageError::Corrupt { .. }) => saw = true,
            Err(other) => panic!("{other}"),
        }
    }
    assert!(saw, "the damaged record was read and refused");
}

#[test]
fn random_sector_damage_never_yields_wrong_data() {
    let mut refused = 0;
    let mut cut = 0;
    let mut unharmed = 0;
    for seed in 0..300u64 {
        let disk = SimDisk::with_seed(seed);
        let rounds = populate_rounds(&disk);
        let model = rounds.last().unwrap().clone();
        let Some((path, sector)) = disk.corrupt_random_sector(&dir()) else {
            panic!("nothing to corrupt");
        };
        match Storage::open(disk.clone(), &dir(), options()) {
            Err(StorageError::Corrupt { .. } | StorageError::LostSyncedData { .. }) => refused += 1,
            Err(other) => panic!(
                "seed {seed}: {}#{sector}: unexpected error {other}",
                path.display()
            ),
            Ok((s, report)) => {
                if report.wal.truncated_bytes > 0 {
                    // Damage in the last sector of the last segment, past
                    // what the surviving claims vouch for (after the power
                    // loss, only the claims of the first sync after an open
                    // or a rotation are durable): at most the last two
                    // rounds are cut.
                    let len = disk.file_len(&path).unwrap();
                    assert!(
                        sector * 512 + 512 >= len,
                        "seed {seed}: cut for damage before the last sector"
                    );
                    // Each group's state is its state after one of the last
                    // rounds (a batch may be cut between two groups' records).
                    for (g, rec) in &report.groups {
                        let one = std::collections::BTreeMap::from([(*g, rec.clone())]);
                        let j = rounds
                            .iter()
                            .rposition(|m| {
                                let mine: Model = m
                                    .iter()
                                    .filter(|(k, _)| *k == g)
                                    .map(|(k, v)| (*k, v.clone()))
                                    .collect();
                                matches_model(&s, &one, &mine).is_ok()
                            })
                            .unwrap_or_else(|| {
                                panic!("seed {seed}: group {g} matches no earlier round")
                            });
                        assert!(
                            j + 3 >= rounds.len(),
                            "seed {seed}: group {g} cut back to round {}",
                            j + 1
                        );
                    }
                    cut += 1;
                } else {
                    matches_model(&s, &report.groups, &model).unwrap_or_else(|e| {
                        panic!("seed {seed}: {}#{sector}: {e}", path.display())
                    });
                    unharmed += 1;
                }
                // Whatever was recovered reads back consistently.
                for (g, rec) in &report.groups {
                    if let (Some(first), Some(last)) = (rec.entries.first(), rec.entries.last()) {
                        if let Ok(got) = s.wal.entries(*g, first.index, last.index + 1, u64::MAX) {
                            assert_eq!(got, rec.entries, "seed {seed}");
                        }
                    }
                }
            }
        }
    }
    eprintln!("random sector damage: {refused} refused, {cut} cut as torn tails, {unharmed} unharmed (unused bytes)");
    assert!(refused > 200, "{refused}");
}

/// Replaces the last segment with its content followed by `tail`.
fn append_to_last_segment(disk: &SimDisk, tail: &[u8]) -> PathBuf {
    use ferry_storage::DiskFile;
    let segs = segments(disk);
    let seg = segs.last().unwrap().clone();
    let mut data = disk.read_all(&seg).unwrap();
    data.extend_from_slice(tail);
    let file = disk.create(&seg).unwrap();
    file.append(&data).unwrap();
    file.sync_data().unwrap();
    seg
}

/// Found by fuzzing (`crates/fuzz`, wal_segment): deciding whether damage
/// at the end of the last segment is a torn write checksummed, from every
/// offset after it, every record length that fit the bytes left, so a
/// tail built with such lengths at every fourth byte took seconds for
/// 1 MiB (and hours for a whole segment). The search is now bounded by
/// the bytes it searches; a tail that exceeds it is not a torn write.
#[test]
fn a_damaged_tail_too_costly_to_search_is_refused_in_bounded_time() {
    let tail_bytes = 4usize << 20;
    // At every fourth offset, a length of half the tail.
    let pattern = ((tail_bytes / 2) as u32).to_le_bytes();
    let crafted: Vec<u8> = pattern.iter().copied().cycle().take(tail_bytes).collect();
    let disk = SimDisk::with_seed(11);
    populate(&disk);
    let seg = append_to_last_segment(&disk, &crafted);
    let started = std::time::Instant::now();
    let text = expect_corrupt(&disk, &seg, u64::MAX);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert!(text.contains("gave up"), "{text}");
    // Zeros after the records, as a real disk leaves a write that never
    // reached it in reserved space, are read at once as space not yet
    // used: nothing is reported cut, and the segment is cut back to its
    // records.
    let disk = SimDisk::with_seed(11);
    let model = populate(&disk);
    let records_len = disk.file_len(segments(&disk).last().unwrap()).unwrap();
    let seg = append_to_last_segment(&disk, &vec![0u8; tail_bytes]);
    let started = std::time::Instant::now();
    let (s, report) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(report.wal.truncated_bytes, 0);
    assert_eq!(disk.file_len(&seg).unwrap(), records_len);
    matches_model(&s, &report.groups, &model).unwrap();
}
