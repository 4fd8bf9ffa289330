//! Crash tests at every write boundary: a small run over the simulated disk
//! is cut after N units of work (one per byte written, one per sync, create,
//! rename or remove), for every N, and recovered under each crash mode.
//! Everything acknowledged as durable must come back intact, and nothing is
//! invented: the recovered state is exactly the state after some prefix of
//! the operations, no shorter than the acknowledged one.

mod common;

use common::*;
use ferry_raft::{Configuration, HardState, PersistRequest, SnapshotMeta};
use ferry_storage::{CrashMode, SimDisk, Storage, StorageError, WalOptions};

fn options() -> WalOptions {
    WalOptions {
        // One record per request, so that every recoverable state is the
        // state after a whole operation.
        record_size_bytes_target: 1 << 20,
        // Reserved space as a server's log has it, so that crashes land
        // in it and rotations give it back.
        reserve_bytes: 160,
        ..small_options()
    }
}

/// The script, and the model state after each prefix of it (`states[i]` is
/// the state after the first `i` operations).
fn script() -> (Vec<Op>, Vec<Model>) {
    let mut ops = Vec::new();
    let mut model = Model::new();
    let mut states = vec![model.clone()];
    let mut seq = 0;
    let mut push = |op: Op, model: &mut Model, states: &mut Vec<Model>| {
        match &op {
            Op::Append(g, r) => model.entry(*g).or_default().persist(r),
            Op::Sync | Op::Compact(..) => {}
            Op::SaveSnapshot(g, m, d) | Op::Install(g, m, d) => {
                model.entry(*g).or_default().snapshot(m.clone(), d.clone())
            }
            Op::Remove(g) => {
                model.remove(g);
            }
        }
        ops.push(op);
        states.push(model.clone());
    };
    for round in 1..=7u64 {
        for g in 1..=3u64 {
            if round == 7 && g == 2 {
                continue;
            }
            let last = model.get(&g).map_or(0, |m| m.last_index());
            // Group 2 replaces its last entry every other round.
            let first = if g == 2 && round % 2 == 0 && last > 1 {
                last
            } else {
                last + 1
            };
            let n = 1 + (round + g) % 3;
            let entries = (first..first + n).map(|i| entry(i, round, g)).collect();
            seq += 1;
            let hs = (round % 2 == 1).then_some(HardState {
                term: round,
                vote: Some(g),
                commit: last.saturating_sub(1),
            });
            push(
                Op::Append(
                    g,
                    PersistRequest {
                        seq,
                        hard_state: hs,
                        entries,
                    },
                ),
                &mut model,
                &mut states,
            );
        }
        push(Op::Sync, &mut model, &mut states);
        if round == 3 || round == 6 {
            let m = &model[&1];
            let at = m.last_index() - 1;
            let term = m
                .entries
                .iter()
                .find(|e| e.index == at)
                .map(|e| e.term)
                .unwrap_or(0);
            let meta = SnapshotMeta {
                index: at,
                term,
                config: Configuration::with_voters([1, 2, 3]),
            };
            push(
                Op::SaveSnapshot(1, meta, snapshot_data(1, at, 300)),
                &mut model,
                &mut states,
            );
            push(Op::Compact(1, at), &mut model, &mut states);
        }
        if round == 4 {
            let at = model[&3].last_index() + 5;
            let meta = SnapshotMeta {
                index: at,
                term: round + 1,
                config: Configuration::with_voters([3, 4, 5]),
            };
            push(
                Op::Install(3, meta, snapshot_data(3, at, 200)),
                &mut model,
                &mut states,
            );
            push(Op::Sync, &mut model, &mut states);
        }
        if round == 6 {
            push(Op::Remove(2), &mut model, &mut states);
            push(Op::Sync, &mut model, &mut states);
        }
    }
    (ops, states)
}

fn dir() -> std::path::PathBuf {
    std::path::PathBuf::from("/node")
}

/// Runs the script until the disk fails. Returns (acknowledged, started):
/// the state index that is known durable, and the number of operations begun.
/// A sync acknowledges everything before it; so do a local snapshot and a
/// group removal (both durable on return). An installed snapshot is
/// acknowledged by the next sync, as the runtime must wait for it.
fn run(disk: &SimDisk, ops: &[Op]) -> (usize, usize) {
    let mut s = match Storage::open(disk.clone(), &dir(), options()) {
        Ok((s, _)) => s,
        Err(_) => return (0, 0),
    };
    let mut acked = 0;
    for (i, op) in ops.iter().enumerate() {
        match apply(&mut s, op) {
            Ok(()) => {
                if matches!(op, Op::Sync | Op::SaveSnapshot(..) | Op::Remove(..)) {
                    acked = i + 1;
                }
            }
            Err(_) => return (acked, i + 1),
        }
    }
    (acked, ops.len())
}

/// Opens the storage and checks that it holds `states[j]` for some `j` in
/// `acked..=started`. Returns the storage and `j`.
fn check_recovery(
    disk: &SimDisk,
    states: &[Model],
    acked: usize,
    started: usize,
    what: &str,
) -> (Storage<SimDisk>, usize, u64) {
    let (s, report) = Storage::open(disk.clone(), &dir(), options())
        .unwrap_or_else(|e| panic!("{what}: recovery failed: {e}"));
    let mut errors = Vec::new();
    for (j, state) in states.iter().enumerate().take(started + 1).skip(acked) {
        match matches_model(&s, &report.groups, state) {
            Ok(()) => return (s, j, report.wal.truncated_bytes),
            Err(e) => errors.push(format!("  state {j}: {e}")),
        }
    }
    panic!(
        "{what}: recovered state matches no state in {acked}..={started}\n{}",
        errors.join("\n")
    );
}

/// After recovery the storage must keep working: a new synced entry
/// survives the next crash.
fn check_usable(mut s: Storage<SimDisk>, disk: &SimDisk, what: &str) {
    let last = s.wal.last_index(1).unwrap_or(0);
    let req = PersistRequest {
        seq: 1000,
        hard_state: None,
        entries: vec![entry(last + 1, 50, 1)],
    };
    s.wal.append(1, &req).unwrap();
    s.wal.sync().unwrap();
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    let (s, report) = Storage::open(disk.clone(), &dir(), options())
        .unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
    assert_eq!(
        report.groups[&1].entries.last(),
        Some(&req.entries[0]),
        "{what}"
    );
    assert_eq!(s.wal.last_index(1), Some(last + 1));
}

#[test]
fn every_write_boundary_recovers_what_was_acknowledged() {
    let (ops, states) = script();
    let clean = SimDisk::with_seed(0);
    let (acked, started) = run(&clean, &ops);
    assert_eq!(
        (acked, started),
        (ops.len(), ops.len()),
        "the clean run finishes"
    );
    let total = clean.units_used();
    assert!(
        total > 2000,
        "the run is big enough to be interesting: {total} units"
    );
    clean.crash(CrashMode::LoseUnsynced);
    let (s, j, _) = check_recovery(&clean, &states, ops.len(), ops.len(), "clean");
    assert_eq!(j, ops.len());
    drop(s);

    let modes = [
        CrashMode::LoseUnsynced,
        CrashMode::KeepWritten,
        CrashMode::TornUnsynced,
    ];
    let mut truncations = 0;
    for n in 0..=total {
        for mode in modes {
            let disk = SimDisk::with_seed(n);
            disk.set_fault_budget(Some(n));
            let (acked, started) = run(&disk, &ops);
            disk.crash(mode);
            let what =
                format!("crash after {n} units ({mode:?}), acked {acked}, started {started}");
            let (s, _, cut) = check_recovery(&disk, &states, acked, started, &what);
            drop(s);
            if cut > 0 {
                truncations += 1;
            }
            // A crash during recovery itself must not lose anything either.
            if n % 13 == 0 {
                for k in 0..12 {
                    disk.set_fault_budget(Some(k));
                    let opened = Storage::open(disk.clone(), &dir(), options());
                    drop(opened);
                    disk.crash(mode);
                    let what = format!("{what}, then during recovery after {k} units");
                    let (s, _, _) = check_recovery(&disk, &states, acked, started, &what);
                    drop(s);
                }
            }
            let (s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
            drop(s);
            disk.crash(mode);
            let (s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
            check_usable(s, &disk, &what);
        }
    }
    // Sanity: the loop did see torn writes (otherwise the test tests little).
    eprintln!(
        "{total} write boundaries x {} crash modes; {truncations} recoveries cut a torn tail",
        modes.len()
    );
    assert!(truncations > 100, "{truncations}");
}

#[test]
fn a_crash_at_any_point_of_recovery_loses_nothing_acknowledged() {
    // Recovery writes too (it cuts the torn tail, replaces the log state
    // file, starts the progress file and a new segment): a crash at each of
    // its write boundaries, from the same crashed disk each time, must leave
    // a disk that recovers what was acknowledged, and is never taken for
    // one that lost synced data.
    let (ops, states) = script();
    let clean = SimDisk::with_seed(0);
    run(&clean, &ops);
    let total = clean.units_used();
    let modes = [
        CrashMode::LoseUnsynced,
        CrashMode::KeepWritten,
        CrashMode::TornUnsynced,
    ];
    let mut crashes = 0;
    for n in (0..=total).step_by(97) {
        for mode in modes {
            for k in 0u64.. {
                let disk = SimDisk::with_seed(n ^ k);
                disk.set_fault_budget(Some(n));
                let (acked, started) = run(&disk, &ops);
                disk.crash(mode);
                disk.set_fault_budget(Some(k));
                let finished = Storage::open(disk.clone(), &dir(), options()).is_ok();
                disk.crash(mode);
                let what = format!(
                    "crash after {n} units ({mode:?}), acked {acked}, started {started}, \
                     then during recovery after {k} units"
                );
                let (s, _, _) = check_recovery(&disk, &states, acked, started, &what);
                drop(s);
                if finished {
                    break;
                }
                crashes += 1;
                assert!(k < 100_000, "{what}: recovery never finishes");
            }
        }
    }
    eprintln!("{crashes} crashes during recovery");
    assert!(crashes > 1000, "{crashes}");
}

#[test]
fn a_sync_claim_never_outruns_the_data() {
    // A claim in the progress file must only be written once the sync it
    // describes is done: a crash in the middle of a sync, with each file
    // keeping a random part of what was written to it, must never leave a
    // claim that the log falls short of. Every unit of work of every sync
    // of the script, under many seeds of the torn crash.
    let (ops, states) = script();
    let clean = SimDisk::with_seed(0);
    let (mut s, _) = Storage::open(clean.clone(), &dir(), options()).unwrap();
    let mut inside_syncs = Vec::new();
    for op in &ops {
        let before = clean.units_used();
        apply(&mut s, op).unwrap();
        if matches!(op, Op::Sync) {
            inside_syncs.extend(before..clean.units_used());
        }
    }
    drop(s);
    assert!(inside_syncs.len() > 50, "{}", inside_syncs.len());
    for &n in &inside_syncs {
        for seed in 0..12 {
            let disk = SimDisk::with_seed(seed * 100_003 + n);
            disk.set_fault_budget(Some(n));
            let (acked, started) = run(&disk, &ops);
            disk.crash(CrashMode::TornUnsynced);
            let what = format!(
                "torn crash after {n} units (seed {seed}), acked {acked}, started {started}"
            );
            let (s, _, _) = check_recovery(&disk, &states, acked, started, &what);
            drop(s);
        }
    }
}

#[test]
fn torn_tails_are_reported() {
    let (ops, _) = script();
    let mut seen = 0;
    for n in (100..3000).step_by(37) {
        let disk = SimDisk::with_seed(n);
        disk.set_fault_budget(Some(n));
        run(&disk, &ops);
        disk.crash(CrashMode::KeepWritten);
        let (_, report) = Storage::open(disk.clone(), &dir(), options()).unwrap();
        if report.wal.truncated_bytes > 0 {
            seen += 1;
            let file = report.wal.truncated_file.unwrap();
            assert!(file.starts_with(dir().join("wal")));
        }
    }
    assert!(seen > 10, "torn writes are cut and reported ({seen})");
}

#[test]
fn a_failed_sync_poisons_the_log() {
    let disk = SimDisk::with_seed(1);
    let (mut s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    s.wal
        .append(
            1,
            &PersistRequest {
                seq: 1,
                hard_state: None,
                entries: vec![entry(1, 1, 1)],
            },
        )
        .unwrap();
    disk.set_fault_budget(Some(0));
    assert!(matches!(s.wal.sync(), Err(StorageError::Io { .. })));
    let err = s
        .wal
        .append(
            1,
            &PersistRequest {
                seq: 2,
                hard_state: None,
                entries: vec![entry(2, 1, 1)],
            },
        )
        .unwrap_err();
    assert!(matches!(err, StorageError::Poisoned(_)), "{err}");
    assert!(matches!(s.wal.sync(), Err(StorageError::Poisoned(_))));
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    let (_, report) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    assert!(report.groups.get(&1).is_none_or(|g| g.entries.is_empty()));
}

/// Seed 16953: a follower learns term 10 and a conflicting suffix, applies
/// the committed entries and saves a local snapshot of them (durable on its
/// own), then the log's sync fails and the node crashes. The synced log
/// still holds the old term and the old entries, which disagree with the
/// snapshot at its index: recovery keeps the snapshot, drops the log that
/// cannot follow it, and raises the term to the snapshot's with no vote, so
/// the engine never starts with a term below an entry it holds.
#[test]
fn a_snapshot_newer_than_a_failed_sync_wins_and_raises_the_term() {
    let disk = SimDisk::with_seed(3);
    let (mut s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    let synced = PersistRequest {
        seq: 1,
        hard_state: Some(HardState {
            term: 8,
            vote: Some(1),
            commit: 2,
        }),
        entries: (1..=5).map(|i| entry(i, 8, 1)).collect(),
    };
    s.wal.append(1, &synced).unwrap();
    s.wal.sync().unwrap();
    let newer = PersistRequest {
        seq: 2,
        hard_state: Some(HardState {
            term: 10,
            vote: None,
            commit: 5,
        }),
        entries: (4..=6).map(|i| entry(i, 10, 1)).collect(),
    };
    s.wal.append(1, &newer).unwrap();
    let meta = SnapshotMeta {
        index: 5,
        term: 10,
        config: Configuration::with_voters([1, 2, 3]),
    };
    let mut w = s.begin_snapshot(1, meta.clone()).unwrap();
    w.write(0, b"state through 5").unwrap();
    s.save_snapshot(w).unwrap();
    disk.fail_next_syncs(1);
    assert!(matches!(s.wal.sync(), Err(StorageError::Io { .. })));
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    let (_, report) = Storage::open(disk.clone(), &dir(), options()).unwrap();
    let group = &report.groups[&1];
    assert_eq!(group.snapshot.as_ref(), Some(&meta));
    assert!(
        group.entries.iter().all(|e| e.index > 5 && e.term >= 10),
        "entries that cannot follow the snapshot survived: {:?}",
        group.entries
    );
    let restored = group.restored_state(Configuration::with_voters([1, 2, 3]));
    assert_eq!(
        (restored.hard_state.term, restored.hard_state.vote),
        (10, None),
        "the term must cover the snapshot's"
    );
    let options = ferry_raft::Options::new(1, 1);
    assert!(ferry_raft::RaftNode::new(options, restored, 0).is_ok());
}

#[test]
fn random_scripts_crashed_at_random_boundaries() {
    use rand_chacha::rand_core::{Rng, SeedableRng};
    let modes = [
        CrashMode::LoseUnsynced,
        CrashMode::KeepWritten,
        CrashMode::TornUnsynced,
    ];
    let mut checks = 0;
    // FERRY_STORAGE_CRASH_SEEDS runs a longer soak.
    let seeds: u64 = std::env::var("FERRY_STORAGE_CRASH_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    for seed in 0..seeds {
        let (ops, states) = random_script(seed);
        let clean = SimDisk::with_seed(seed);
        let (acked, started) = run(&clean, &ops);
        assert_eq!(started, ops.len(), "seed {seed}: clean run");
        clean.crash(CrashMode::LoseUnsynced);
        let (s, _, _) = check_recovery(
            &clean,
            &states,
            acked,
            started,
            &format!("seed {seed}: clean"),
        );
        drop(s);
        let total = clean.units_used();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for _ in 0..12 {
            let n = rng.next_u64() % (total + 1);
            let mode = modes[(rng.next_u64() % 3) as usize];
            let disk = SimDisk::with_seed(seed ^ n);
            disk.set_fault_budget(Some(n));
            let (acked, started) = run(&disk, &ops);
            disk.crash(mode);
            let what = format!("seed {seed}: crash after {n} of {total} units ({mode:?}), acked {acked}, started {started}");
            let (s, _, _) = check_recovery(&disk, &states, acked, started, &what);
            drop(s);
            disk.crash(mode);
            let (s, _) = Storage::open(disk.clone(), &dir(), options()).unwrap();
            check_usable(s, &disk, &what);
            checks += 1;
        }
    }
    assert_eq!(checks, seeds * 12);
}

#[test]
fn an_io_error_on_sync_poisons_the_log_and_nothing_unsynced_is_reported() {
    let disk = SimDisk::with_seed(2);
    let (mut s, _) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    let req = |seq: u64| PersistRequest {
        seq,
        hard_state: None,
        entries: vec![entry(seq, 1, 1)],
    };
    s.wal.append(1, &req(1)).unwrap();
    assert_eq!(s.wal.sync().unwrap()[&1], 1);
    s.wal.append(1, &req(2)).unwrap();
    disk.fail_next_syncs(1);
    let err = s.wal.sync().unwrap_err();
    assert!(matches!(err, StorageError::Io { .. }), "{err}");
    // The disk works again, but the log must not retry: the kernel may have
    // dropped the pages that failed to sync.
    assert!(matches!(s.wal.sync(), Err(StorageError::Poisoned(_))));
    assert!(matches!(
        s.wal.append(1, &req(3)),
        Err(StorageError::Poisoned(_))
    ));
    assert!(matches!(
        s.wal.entries(1, 1, 2, u64::MAX),
        Err(StorageError::Poisoned(_))
    ));
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    let (_, report) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    assert_eq!(report.groups[&1].entries, vec![entry(1, 1, 1)]);
}

/// Persist request `seq` of one entry at index `seq`, its command
/// `size_bytes` bytes of `seq`.
fn filled_request(seq: u64, size_bytes: usize) -> PersistRequest {
    PersistRequest {
        seq,
        hard_state: None,
        entries: vec![ferry_raft::Entry {
            term: 1,
            index: seq,
            payload: ferry_raft::EntryPayload::Command(vec![seq as u8; size_bytes].into()),
        }],
    }
}

#[test]
fn a_segment_that_cannot_be_created_for_lack_of_descriptors_or_space_is_waited_out() {
    // EMFILE (24) and ENOSPC (28), as Linux and every BSD number them.
    for errno in [24, 28] {
        let disk = SimDisk::with_seed(3);
        let options = WalOptions {
            segment_size_bytes_max: 4096,
            ..WalOptions::default()
        };
        let (mut s, _) = Storage::open(disk.clone(), &dir(), options.clone()).unwrap();
        let req = |seq: u64| filled_request(seq, 500);
        let segments = s.wal.segment_count();
        // Every create fails for a while: the log writes on in its segment,
        // well past the segment size, and every sync succeeds.
        disk.fail_next_creates(u64::MAX, errno);
        for seq in 1..=40 {
            s.wal.append(1, &req(seq)).unwrap();
            assert_eq!(s.wal.sync().unwrap()[&1], seq);
        }
        assert_eq!(s.wal.segment_count(), segments);
        let deferred = s.wal.rotation_deferred().expect("the rotation is reported");
        assert!(deferred.is_transient(), "{deferred}");
        assert!(
            deferred.to_string().contains("create segment"),
            "{deferred}"
        );
        // The shortage ends: the next attempt starts a new segment.
        disk.fail_next_creates(0, errno);
        for seq in 41..=60 {
            s.wal.append(1, &req(seq)).unwrap();
            s.wal.sync().unwrap();
        }
        assert!(s.wal.rotation_deferred().is_none());
        assert!(s.wal.segment_count() > segments);
        drop(s);
        disk.crash(CrashMode::LoseUnsynced);
        let (_, report) = Storage::open(disk.clone(), &dir(), options).unwrap();
        let entries = &report.groups[&1].entries;
        assert_eq!(entries.len(), 60);
        assert_eq!(entries.last().map(|e| e.index), Some(60));
    }
}

#[test]
fn appends_that_find_the_disk_full_are_held_and_written_once_there_is_room() {
    // ENOSPC (28) and EDQUOT (122), as Linux numbers them.
    for (seed, errno) in [(6u64, 28), (7, 122)] {
        let disk = SimDisk::with_seed(seed);
        let options = WalOptions {
            segment_size_bytes_max: 4096,
            write_buffer_bytes_max: 1024,
            ..WalOptions::default()
        };
        let (mut s, _) = Storage::open(disk.clone(), &dir(), options.clone()).unwrap();
        let req = |seq: u64| filled_request(seq, 700);
        for seq in 1..=5 {
            s.wal.append(1, &req(seq)).unwrap();
        }
        assert_eq!(s.wal.sync().unwrap()[&1], 5);
        // The disk is full for a while: appends are taken (their records
        // are held, buffered flushes and rotations wait), and every sync
        // says it cannot write yet, changing nothing.
        disk.fail_next_appends(u64::MAX, errno);
        for seq in 6..=20 {
            s.wal.append(1, &req(seq)).unwrap();
            let error = s.wal.sync().unwrap_err();
            assert!(error.is_transient(), "{error}");
        }
        // Room again: the next sync writes everything held, in order.
        disk.fail_next_appends(0, errno);
        assert_eq!(s.wal.sync().unwrap()[&1], 20);
        for seq in 21..=40 {
            s.wal.append(1, &req(seq)).unwrap();
            s.wal.sync().unwrap();
        }
        assert!(s.wal.segment_count() > 1, "rotations resumed");
        drop(s);
        disk.crash(CrashMode::LoseUnsynced);
        let (_, report) = Storage::open(disk.clone(), &dir(), options).unwrap();
        let entries = &report.groups[&1].entries;
        assert_eq!(entries.len(), 40);
        for (i, entry) in entries.iter().enumerate() {
            assert_eq!(entry.index, i as u64 + 1);
            assert_eq!(
                entry.payload,
                ferry_raft::EntryPayload::Command(vec![entry.index as u8; 700].into())
            );
        }
    }
}

/// Reserving space is a write like any other and can find the disk full:
/// the log then appends without a reserve, nothing fails, and it reserves
/// again once it has passed the chunk it could not reserve.
#[test]
fn a_reserve_that_finds_the_disk_full_is_skipped() {
    use ferry_storage::Disk;
    let disk = SimDisk::with_seed(9);
    let options = WalOptions {
        segment_size_bytes_max: 64 * 1024,
        reserve_bytes: 8 * 1024,
        ..WalOptions::default()
    };
    let (mut s, _) = Storage::open(disk.clone(), &dir(), options.clone()).unwrap();
    let seg = dir().join("wal").join("00000000000000000001.seg");
    // The first flush reserves first: that write fails, the append after
    // it does not.
    disk.fail_next_appends(1, 28);
    s.wal.append(1, &filled_request(1, 700)).unwrap();
    assert_eq!(s.wal.sync().unwrap()[&1], 1);
    let unreserved = disk.file_len(&seg).unwrap();
    assert!(unreserved < 1000, "nothing reserved: {unreserved} bytes");
    for seq in 2..=20 {
        s.wal.append(1, &filled_request(seq, 700)).unwrap();
        s.wal.sync().unwrap();
    }
    assert!(
        disk.file_len(&seg).unwrap() > 14 * 1024 + 1000,
        "reserved again past the chunk it could not reserve"
    );
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    let (_, report) = Storage::open(disk.clone(), &dir(), options).unwrap();
    assert_eq!(report.wal.truncated_bytes, 0);
    assert_eq!(report.groups[&1].entries.len(), 20);
}

#[test]
fn a_crash_while_the_disk_is_full_keeps_every_acknowledged_append() {
    let disk = SimDisk::with_seed(8);
    let (mut s, _) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    for seq in 1..=3 {
        s.wal
            .append(
                1,
                &PersistRequest {
                    seq,
                    hard_state: None,
                    entries: vec![entry(seq, 1, 1)],
                },
            )
            .unwrap();
    }
    s.wal.sync().unwrap();
    disk.fail_next_appends(u64::MAX, 28);
    s.wal
        .append(
            1,
            &PersistRequest {
                seq: 4,
                hard_state: None,
                entries: vec![entry(4, 1, 1)],
            },
        )
        .unwrap();
    assert!(s.wal.sync().unwrap_err().is_transient());
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    disk.fail_next_appends(0, 28);
    let (_, report) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    let indexes: Vec<u64> = report.groups[&1].entries.iter().map(|e| e.index).collect();
    assert_eq!(indexes, vec![1, 2, 3]);
}

#[test]
fn a_segment_that_cannot_be_created_for_another_reason_still_poisons_the_log() {
    let disk = SimDisk::with_seed(4);
    let options = WalOptions {
        segment_size_bytes_max: 1024,
        ..WalOptions::default()
    };
    let (mut s, _) = Storage::open(disk.clone(), &dir(), options).unwrap();
    disk.fail_next_creates(u64::MAX, 13); // EACCES
    let mut failed = None;
    for seq in 1..=200 {
        let req = PersistRequest {
            seq,
            hard_state: None,
            entries: vec![entry(seq, 1, 1)],
        };
        if let Err(error) = s.wal.append(1, &req) {
            failed = Some(error);
            break;
        }
    }
    let error = failed.expect("the create failure surfaces");
    assert!(!error.is_transient(), "{error}");
    assert!(matches!(s.wal.sync(), Err(StorageError::Poisoned(_))));
}

#[test]
fn slow_syncs_are_observable_and_the_next_batch_fills_meanwhile() {
    let disk = SimDisk::new(ferry_storage::SimDiskOptions {
        seed: 5,
        sync_latency_ticks_min: 3,
        sync_latency_ticks_max: 9,
    });
    // Large segments: every sync is one file sync (plus the directory once).
    let (mut s, _) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    disk.take_sync_ticks();
    let mut durable = std::collections::BTreeMap::new();
    let mut in_flight: Option<(u64, ferry_storage::PendingSync<SimDisk>)> = None;
    let mut now = 0u64;
    let mut next_seq = 1u64;
    // Simulated time: one append per tick; a sync completes `latency` ticks
    // after it starts, and the next one starts as soon as it completes.
    while now < 200 {
        let req = PersistRequest {
            seq: next_seq,
            hard_state: None,
            entries: vec![entry(next_seq, 1, 1)],
        };
        s.wal.append(1, &req).unwrap();
        next_seq += 1;
        if let Some((done_at, _)) = &in_flight {
            if *done_at <= now {
                let (_, pending) = in_flight.take().unwrap();
                durable.extend(s.wal.complete_sync(pending, Ok(())).unwrap());
            }
        }
        if in_flight.is_none() {
            if let Some(pending) = s.wal.prepare_sync().unwrap() {
                pending.execute().unwrap();
                let latency = disk.take_sync_ticks();
                assert!((3..=18).contains(&latency), "{latency}");
                in_flight = Some((now + latency, pending));
            }
        }
        now += 1;
    }
    let covered = durable[&1];
    assert!(
        covered > 170,
        "syncs kept up by batching: {covered} of {next_seq}"
    );
    assert!(covered < next_seq - 1, "the last batch is still in flight");
    // Everything reported durable survives a crash.
    drop(s);
    disk.crash(CrashMode::LoseUnsynced);
    let (_, report) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    assert!(report.groups[&1].entries.len() as u64 >= covered);
}

#[test]
fn what_recovery_reports_is_durable_even_if_it_was_never_synced() {
    // A process restart (no power loss) finds unsynced records in the page
    // cache and reports them to the engine as the log. They must be made
    // durable before the node goes on, or a later power loss would take back
    // entries the engine already relied on.
    let disk = SimDisk::with_seed(3);
    let req = |seq: u64| PersistRequest {
        seq,
        hard_state: Some(HardState {
            term: seq,
            vote: Some(1),
            commit: 0,
        }),
        entries: vec![entry(seq, seq, 1)],
    };
    let (mut s, _) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    s.wal.append(1, &req(1)).unwrap();
    s.wal.sync().unwrap();
    s.wal.append(1, &req(2)).unwrap();
    s.wal.prepare_sync().unwrap(); // written to the file, never synced
    drop(s);
    // The process restarts; the disk keeps its page cache.
    let (mut s, report) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    assert_eq!(
        report.groups[&1].entries.len(),
        2,
        "the unsynced record is visible"
    );
    s.wal.append(1, &req(3)).unwrap();
    s.wal.sync().unwrap();
    drop(s);
    // Now the power fails.
    disk.crash(CrashMode::LoseUnsynced);
    let (_, report) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    assert_eq!(
        report.groups[&1].entries,
        vec![entry(1, 1, 1), entry(2, 2, 1), entry(3, 3, 1)]
    );
    assert_eq!(report.groups[&1].hard_state.term, 3);

    // The same when not even the segment's name was ever synced, and the
    // power fails right after the restart.
    let disk = SimDisk::with_seed(4);
    let (mut s, _) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    s.wal.append(1, &req(1)).unwrap();
    s.wal.prepare_sync().unwrap();
    drop(s);
    let (_, report) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    assert_eq!(report.groups[&1].entries, vec![entry(1, 1, 1)]);
    disk.crash(CrashMode::LoseUnsynced);
    let (_, report) = Storage::open(disk.clone(), &dir(), WalOptions::default()).unwrap();
    assert_eq!(report.groups[&1].entries, vec![entry(1, 1, 1)]);
}
