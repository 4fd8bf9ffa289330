//! A log that lost data it had synced is refused with
//! `StorageError::LostSyncedData`, on the real filesystem and on the
//! simulated disk: a segment deleted, replaced by an empty or zeroed file,
//! truncated or zeroed at its tail, every segment gone while snapshots
//! remain, the state file gone, a sealed segment cut at a record boundary,
//! a segment replaced by one with an older vote. A torn tail of a write that
//! was never synced is still cut and reported, and a log from before state
//! files existed is accepted and upgraded. A refused directory is left
//! exactly as it was found.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use ferry_raft::{Configuration, HardState, PersistRequest, SnapshotMeta};
use ferry_storage::codec::{frame_record, read_frame, FrameRead, WalRecord};
use ferry_storage::log_state::{LOG_STATE_FILE, SYNC_PROGRESS_FILE};
use ferry_storage::{Disk, DiskFile, Storage, StorageError, WalOptions};

/// These tests cut and zero segments by their length, so their log
/// appends without reserving space; a loss in reserved space is
/// `zeroing_synced_records_in_reserved_space`.
fn options() -> WalOptions {
    WalOptions {
        reserve_bytes: 0,
        ..WalOptions::default()
    }
}

fn open<B: Backend>(b: &B) -> Result<(Storage<B::D>, ferry_storage::RecoveryReport), StorageError> {
    Storage::open(b.disk(), &b.dir(), options())
}

fn wal_dir<B: Backend>(b: &B) -> PathBuf {
    b.dir().join("wal")
}

/// The segment files, oldest first.
fn segments<B: Backend>(b: &B) -> Vec<PathBuf> {
    let dir = wal_dir(b);
    b.disk()
        .list_files(&dir)
        .unwrap()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .map(|n| dir.join(n))
        .collect()
}

/// The segment files that hold records (an open leaves a new, empty one
/// on the real disk until the next sync).
fn segments_with_data<B: Backend>(b: &B) -> Vec<PathBuf> {
    segments(b)
        .into_iter()
        .filter(|p| b.file_len(p) > 0)
        .collect()
}

fn remove<B: Backend>(b: &B, path: &Path) {
    b.disk().remove_file(path).unwrap();
    b.disk().sync_dir(path.parent().unwrap()).unwrap();
}

/// Replaces `path` by a file holding `content`, durably.
fn replace<B: Backend>(b: &B, path: &Path, content: &[u8]) {
    let disk = b.disk();
    let f = disk.create(path).unwrap();
    f.append(content).unwrap();
    f.sync_data().unwrap();
    disk.sync_dir(path.parent().unwrap()).unwrap();
}

/// Every file under the data directory with its content.
fn listing<B: Backend>(b: &B) -> BTreeMap<PathBuf, Vec<u8>> {
    let disk = b.disk();
    let mut out = BTreeMap::new();
    for sub in ["wal", "snapshots"] {
        let dir = b.dir().join(sub);
        for name in disk.list_files(&dir).unwrap_or_default() {
            let path = dir.join(name);
            out.insert(path.clone(), disk.read_all(&path).unwrap());
        }
    }
    out
}

/// Opening must fail with lost synced data about `path`, with a message
/// that names the way back, and must leave the disk as it was.
fn expect_lost<B: Backend>(b: &B, path: &Path) -> String {
    let before = listing(b);
    let err = match open(b) {
        Err(err @ StorageError::LostSyncedData { .. }) => err,
        Err(other) => panic!(
            "expected lost synced data about {}, got {other}",
            path.display()
        ),
        Ok(_) => panic!(
            "the loss of synced data in {} was not detected",
            path.display()
        ),
    };
    let StorageError::LostSyncedData { path: p, .. } = &err else {
        unreachable!()
    };
    assert_eq!(p, path, "{err}");
    let text = err.to_string();
    for words in [
        "not a torn write",
        "must not start as a voter",
        "remove it from its groups",
        "new learner",
        "When the disk lies: the way back",
    ] {
        assert!(text.contains(words), "the message says {words:?}: {text}");
    }
    assert_eq!(listing(b), before, "a refused open changes nothing on disk");
    text
}

fn hs(term: u64, vote: u64) -> Option<HardState> {
    Some(HardState {
        term,
        vote: Some(vote),
        commit: 0,
    })
}

/// Opens, writes one synced batch for group 1 (term 3, vote 2, entries
/// 1..=3), closes and restarts. The node's only segment holds it all.
fn one_synced_batch<B: Backend>(b: &B) -> PathBuf {
    one_synced_batch_with(b, options())
}

/// [`one_synced_batch`] written by a log with `options`.
fn one_synced_batch_with<B: Backend>(b: &B, options: WalOptions) -> PathBuf {
    let (mut s, _) = Storage::open(b.disk(), &b.dir(), options).unwrap();
    s.wal
        .append(
            1,
            &PersistRequest {
                seq: 1,
                hard_state: hs(3, 2),
                entries: (1..=3).map(|i| entry(i, 3, 1)).collect(),
            },
        )
        .unwrap();
    s.wal.sync().unwrap();
    drop(s);
    b.restart();
    let segs = segments(b);
    assert_eq!(segs.len(), 1, "{segs:?}");
    segs[0].clone()
}

fn deleting_the_only_segment<B: Backend>(b: B) {
    let seg = one_synced_batch(&b);
    remove(&b, &seg);
    expect_lost(&b, &seg);
}

fn zeroing_the_only_segment<B: Backend>(b: B) {
    let seg = one_synced_batch(&b);
    let len = b.file_len(&seg);
    replace(&b, &seg, &vec![0u8; len as usize]);
    expect_lost(&b, &seg);
}

fn replacing_the_only_segment_by_an_empty_file<B: Backend>(b: B) {
    let seg = one_synced_batch(&b);
    replace(&b, &seg, &[]);
    expect_lost(&b, &seg);
}

/// In reserved space a synced write that the disk lost reads as zeros,
/// like space the log never reached: the progress file's claim is what
/// tells the two apart.
fn zeroing_synced_records_in_reserved_space<B: Backend>(b: B) {
    let seg = one_synced_batch_with(&b, WalOptions::default());
    let len = b.content_len(&seg);
    assert!(
        b.file_len(&seg) > len + 1000,
        "the segment has reserved space"
    );
    b.zero_bytes(&seg, len - 20, 20);
    expect_lost(&b, &seg);
}

fn truncating_half_of_the_only_segment<B: Backend>(b: B) {
    let seg = one_synced_batch(&b);
    let len = b.file_len(&seg);
    b.disk().truncate_synced(&seg, len / 2).unwrap();
    let text = expect_lost(&b, &seg);
    assert!(text.contains(&format!("{len} bytes synced")), "{text}");
}

fn zeroing_the_tail_of_the_only_segment<B: Backend>(b: B) {
    let seg = one_synced_batch(&b);
    let mut data = b.disk().read_all(&seg).unwrap();
    let n = data.len();
    data[n - 20..].fill(0);
    replace(&b, &seg, &data);
    expect_lost(&b, &seg);
}

fn cutting_the_last_unsynced_write_is_still_a_torn_tail<B: Backend>(b: B) {
    let seg = one_synced_batch(&b);
    let synced_len = b.file_len(&seg);
    let (mut s, _) = open(&b).unwrap();
    s.wal
        .append(
            1,
            &PersistRequest {
                seq: 2,
                hard_state: hs(4, 1),
                entries: vec![entry(4, 4, 1)],
            },
        )
        .unwrap();
    s.wal.sync().unwrap();
    s.wal
        .append(
            1,
            &PersistRequest {
                seq: 3,
                hard_state: None,
                entries: vec![entry(5, 4, 1)],
            },
        )
        .unwrap();
    // Written to the file, never synced; then the process stops and the
    // write is torn.
    assert!(s.wal.prepare_sync().unwrap().is_some());
    drop(s);
    b.restart_keeping_written();
    let segs = segments_with_data(&b);
    let last = segs.last().unwrap().clone();
    assert_ne!(last, seg);
    let len = b.file_len(&last);
    b.disk().truncate_synced(&last, len - 5).unwrap();
    let (_, report) = open(&b).unwrap();
    assert!(report.wal.truncated_bytes > 0);
    assert!(
        report.wal.truncated_bytes < 100,
        "only the torn write is cut"
    );
    assert_eq!(report.wal.truncated_file.as_deref(), Some(last.as_path()));
    let g = &report.groups[&1];
    assert_eq!(g.entries.last().map(|e| e.index), Some(4));
    assert_eq!(g.hard_state.term, 4);
    assert_eq!(b.file_len(&seg), synced_len);
}

fn deleting_every_segment_while_snapshots_remain<B: Backend>(b: B) {
    let (mut s, _) = open(&b).unwrap();
    s.wal
        .append(
            1,
            &PersistRequest {
                seq: 1,
                hard_state: hs(3, 2),
                entries: (1..=3).map(|i| entry(i, 3, 1)).collect(),
            },
        )
        .unwrap();
    s.wal.sync().unwrap();
    let meta = SnapshotMeta {
        index: 2,
        term: 3,
        config: Configuration::with_voters([1, 2, 3]),
    };
    let mut w = s.begin_snapshot(1, meta).unwrap();
    w.write(0, b"state").unwrap();
    s.save_snapshot(w).unwrap();
    s.wal.compact(1, 2).unwrap();
    s.wal.sync().unwrap();
    drop(s);
    b.restart();
    // A second start: the state file now says the first segment is sealed.
    let (s, report) = open(&b).unwrap();
    assert_eq!(report.groups[&1].hard_state.term, 3);
    drop(s);
    b.restart();
    let segs = segments(&b);
    for seg in &segs {
        remove(&b, seg);
    }
    expect_lost(&b, &segs[0]);
}

fn deleting_the_state_file<B: Backend>(b: B) {
    one_synced_batch(&b);
    let state = wal_dir(&b).join(LOG_STATE_FILE);
    remove(&b, &state);
    expect_lost(&b, &state);
}

fn snapshots_without_any_log<B: Backend>(b: B) {
    synced_batch_and_snapshot(&b);
    for name in b.disk().list_files(&wal_dir(&b)).unwrap() {
        remove(&b, &wal_dir(&b).join(name));
    }
    expect_lost(&b, &wal_dir(&b));
}

/// One synced batch for group 1 and a snapshot covering it, then a restart.
fn synced_batch_and_snapshot<B: Backend>(b: &B) {
    let (mut s, _) = open(b).unwrap();
    s.wal
        .append(
            1,
            &PersistRequest {
                seq: 1,
                hard_state: hs(3, 2),
                entries: (1..=3).map(|i| entry(i, 3, 1)).collect(),
            },
        )
        .unwrap();
    s.wal.sync().unwrap();
    let meta = SnapshotMeta {
        index: 3,
        term: 3,
        config: Configuration::with_voters([1, 2, 3]),
    };
    let mut w = s.begin_snapshot(1, meta).unwrap();
    w.write(0, b"state").unwrap();
    s.save_snapshot(w).unwrap();
    drop(s);
    b.restart();
}

/// Offsets of the records of a (clean) segment.
fn record_offsets<B: Backend>(b: &B, path: &Path) -> Vec<u64> {
    let buf = b.disk().read_all(path).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    while let FrameRead::Valid { end, .. } = read_frame(&buf, at) {
        out.push(at as u64);
        at = end;
    }
    assert_eq!(at, buf.len());
    out
}

fn a_sealed_segment_cut_at_a_record_boundary<B: Backend>(b: B) {
    let options = small_options();
    let (mut s, _) = Storage::open(b.disk(), &b.dir(), options.clone()).unwrap();
    for i in 1..=40 {
        s.wal
            .append(
                1,
                &PersistRequest {
                    seq: i,
                    hard_state: hs(i, 1),
                    entries: vec![entry(i, i, 1)],
                },
            )
            .unwrap();
        s.wal.sync().unwrap();
    }
    drop(s);
    b.restart();
    let segs = segments(&b);
    assert!(segs.len() >= 3, "{segs:?}");
    let sealed = &segs[1];
    let offsets = record_offsets(&b, sealed);
    // Cut the sealed segment's last record whole: what remains is valid.
    b.disk()
        .truncate_synced(sealed, *offsets.last().unwrap())
        .unwrap();
    let before = listing(&b);
    match Storage::open(b.disk(), &b.dir(), options) {
        Err(StorageError::LostSyncedData { path, .. }) => assert_eq!(&path, sealed),
        other => panic!("expected lost synced data, got {:?}", other.map(|_| ())),
    }
    assert_eq!(listing(&b), before);
}

fn deleting_the_newest_segments_after_rotations<B: Backend>(b: B) {
    let (mut s, _) = Storage::open(b.disk(), &b.dir(), small_options()).unwrap();
    for i in 1..=40 {
        s.wal
            .append(
                1,
                &PersistRequest {
                    seq: i,
                    hard_state: hs(i, 1),
                    entries: vec![entry(i, i, 1)],
                },
            )
            .unwrap();
        s.wal.sync().unwrap();
    }
    drop(s);
    b.restart();
    let segs = segments_with_data(&b);
    assert!(segs.len() >= 4, "{segs:?}");
    // What is left is a valid log, only shorter: only the state file
    // written at the last rotation and the claims vouch for the rest.
    let newest = &segs[segs.len() - 2..];
    for seg in newest {
        remove(&b, seg);
    }
    let before = listing(&b);
    match Storage::open(b.disk(), &b.dir(), small_options()) {
        Err(StorageError::LostSyncedData { path, .. }) => {
            assert!(newest.contains(&path), "{}", path.display())
        }
        other => panic!("expected lost synced data, got {:?}", other.map(|_| ())),
    }
    assert_eq!(listing(&b), before);
    // Without the progress file's claims, the state file written at the
    // last rotation still knows the newest sealed segment.
    remove(&b, &wal_dir(&b).join(SYNC_PROGRESS_FILE));
    match Storage::open(b.disk(), &b.dir(), small_options()) {
        Err(StorageError::LostSyncedData { path, .. }) => assert_eq!(path, newest[0]),
        other => panic!("expected lost synced data, got {:?}", other.map(|_| ())),
    }
}

fn a_segment_replaced_by_one_with_an_older_vote<B: Backend>(b: B) {
    // Another log, longer than ours but at an older term.
    let other = b.dir().join("other");
    {
        let (mut s, _) = Storage::open(b.disk(), &other, WalOptions::default()).unwrap();
        s.wal
            .append(
                1,
                &PersistRequest {
                    seq: 1,
                    hard_state: hs(1, 3),
                    entries: (1..=9).map(|i| entry(i, 1, 1)).collect(),
                },
            )
            .unwrap();
        s.wal.sync().unwrap();
    }
    b.restart();
    let foreign = b
        .disk()
        .read_all(&other.join("wal").join("00000000000000000001.seg"))
        .unwrap();
    let seg = one_synced_batch(&b);
    assert!(foreign.len() as u64 > b.file_len(&seg));
    // A second start records the vote (term 3, for node 2) in the state file.
    drop(open(&b).unwrap());
    b.restart();
    for extra in segments(&b).into_iter().filter(|p| p != &seg) {
        remove(&b, &extra);
    }
    replace(&b, &seg, &foreign);
    let text = expect_lost(&b, &seg);
    assert!(
        text.contains("group 1 at term 3 with vote Some(2)"),
        "{text}"
    );
}

fn after_a_process_restart_every_synced_batch_is_vouched_for<B: Backend>(b: B) {
    let (mut s, _) = open(&b).unwrap();
    for i in 1..=20 {
        s.wal
            .append(
                1,
                &PersistRequest {
                    seq: i,
                    hard_state: None,
                    entries: vec![entry(i, 1, 1)],
                },
            )
            .unwrap();
        s.wal.sync().unwrap();
    }
    drop(s);
    // The page cache survives a process restart, and with it the latest
    // claim of the progress file.
    b.restart_keeping_written();
    let seg = segments(&b)[0].clone();
    let len = b.file_len(&seg);
    b.disk().truncate_synced(&seg, len - 1).unwrap();
    expect_lost(&b, &seg);
}

/// Writes a log in format 1 by hand, as the version before state files
/// wrote it: a header without the previous segment's length, and no state
/// or progress file.
fn write_format_1_log<B: Backend>(b: &B) {
    let dir = wal_dir(b);
    b.disk().create_dir_all(&dir).unwrap();
    let mut buf = Vec::new();
    frame_record(
        &mut buf,
        &WalRecord::SegmentHeader {
            segment: 1,
            version: 1,
            previous_len: None,
        },
    );
    frame_record(
        &mut buf,
        &WalRecord::Persist {
            group: 1,
            seq: 1,
            hard_state: hs(5, 2),
            entries: (1..=4).map(|i| entry(i, 5, 1)).collect(),
        },
    );
    replace(b, &dir.join("00000000000000000001.seg"), &buf);
}

fn a_format_1_log_without_a_state_file_is_accepted_and_upgraded<B: Backend>(b: B) {
    write_format_1_log(&b);
    let (mut s, report) = open(&b).unwrap();
    assert!(report.wal.upgraded_from_format_1);
    assert_eq!(report.groups[&1].hard_state.term, 5);
    assert_eq!(report.groups[&1].entries.len(), 4);
    s.wal
        .append(
            1,
            &PersistRequest {
                seq: 2,
                hard_state: hs(6, 1),
                entries: vec![entry(5, 6, 1)],
            },
        )
        .unwrap();
    s.wal.sync().unwrap();
    drop(s);
    b.restart();
    let (s, report) = open(&b).unwrap();
    assert!(!report.wal.upgraded_from_format_1);
    assert_eq!(report.groups[&1].hard_state.term, 6);
    assert_eq!(report.groups[&1].entries.len(), 5);
    drop(s);
    b.restart();
    // From now on the log is in format 2: its state file is required.
    let state = wal_dir(&b).join(LOG_STATE_FILE);
    remove(&b, &state);
    expect_lost(&b, &state);
}

fn a_damaged_state_file_is_corrupt<B: Backend>(b: B) {
    one_synced_batch(&b);
    let state = wal_dir(&b).join(LOG_STATE_FILE);
    b.corrupt_byte(&state, 12);
    match open(&b) {
        Err(StorageError::Corrupt { path, .. }) => assert_eq!(path, state),
        other => panic!("expected corruption, got {:?}", other.map(|_| ())),
    }
}

fn a_damaged_or_missing_progress_file_only_weakens_the_check<B: Backend>(b: B) {
    let seg = one_synced_batch(&b);
    let progress = wal_dir(&b).join(SYNC_PROGRESS_FILE);
    // The progress file is a lower bound: without it the log opens (the
    // state file alone vouches for less).
    b.corrupt_byte(&progress, 9);
    let (s, report) = open(&b).unwrap();
    assert_eq!(report.groups[&1].entries.len(), 3);
    drop(s);
    b.restart();
    remove(&b, &progress);
    let (_, report) = open(&b).unwrap();
    assert_eq!(report.groups[&1].entries.len(), 3);
    assert!(b.file_len(&seg) > 0);
}

macro_rules! both_disks {
    ($($name:ident),* $(,)?) => {
        mod fs {
            use super::*;
            $(#[test] fn $name() { super::$name(FsBackend::new(stringify!($name))); })*
        }
        mod sim {
            use super::*;
            $(#[test] fn $name() { super::$name(SimBackend::new(7)); })*
        }
    };
}

both_disks!(
    deleting_the_only_segment,
    zeroing_the_only_segment,
    replacing_the_only_segment_by_an_empty_file,
    truncating_half_of_the_only_segment,
    zeroing_synced_records_in_reserved_space,
    zeroing_the_tail_of_the_only_segment,
    cutting_the_last_unsynced_write_is_still_a_torn_tail,
    deleting_every_segment_while_snapshots_remain,
    deleting_the_state_file,
    snapshots_without_any_log,
    a_sealed_segment_cut_at_a_record_boundary,
    deleting_the_newest_segments_after_rotations,
    a_segment_replaced_by_one_with_an_older_vote,
    after_a_process_restart_every_synced_batch_is_vouched_for,
    a_format_1_log_without_a_state_file_is_accepted_and_upgraded,
    a_damaged_state_file_is_corrupt,
    a_damaged_or_missing_progress_file_only_weakens_the_check,
);

/// After a power loss the progress file's unsynced claims may be gone; only
/// the claim of the first sync after an open (or a rotation) is synced. A
/// synced batch after that one, damaged at the very end of the log, is then
/// indistinguishable from a torn write: it is cut and reported (the
/// documented limit), while damage reaching into the first batch is refused.
#[test]
fn after_a_power_loss_only_the_durable_claim_vouches() {
    for (cut_into_first_batch, lost) in [(false, false), (true, true)] {
        let b = SimBackend::new(11);
        let (mut s, _) = open(&b).unwrap();
        let mut first_len = 0;
        for i in 1..=5 {
            s.wal
                .append(
                    1,
                    &PersistRequest {
                        seq: i,
                        hard_state: None,
                        entries: vec![entry(i, 1, 1)],
                    },
                )
                .unwrap();
            s.wal.sync().unwrap();
            if i == 1 {
                first_len = b.file_len(&segments(&b)[0]);
            }
        }
        drop(s);
        b.restart();
        let seg = segments(&b)[0].clone();
        let len = b.file_len(&seg);
        let cut_to = if cut_into_first_batch {
            first_len - 1
        } else {
            len - 1
        };
        b.disk().truncate_synced(&seg, cut_to).unwrap();
        if lost {
            expect_lost(&b, &seg);
        } else {
            let (_, report) = open(&b).unwrap();
            assert!(report.wal.truncated_bytes > 0);
            assert_eq!(report.groups[&1].entries.len(), 4);
        }
    }
}
