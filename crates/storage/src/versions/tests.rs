//! The version store against a model (every version ever written, in a
//! `BTreeMap`), through random writes, freezes, flushes, merges, reopens,
//! crashes at every point of a job, and damaged files.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::sim_disk::{CrashMode, SimDisk};

/// Every version written: (key, version) -> (tombstone, value).
type Model = BTreeMap<(Vec<u8>, u64), (bool, Vec<u8>)>;

fn dir() -> PathBuf {
    PathBuf::from("/data/kv")
}

fn open(disk: &SimDisk) -> (VersionStore<SimDisk>, Recovered) {
    VersionStore::open(disk.clone(), &dir(), VersionStoreOptions::default()).unwrap()
}

fn record(key: &[u8], version: u64, tombstone: bool, value: &[u8]) -> Record {
    Record {
        key: Bytes::copy_from_slice(key),
        version,
        tombstone,
        value: Bytes::copy_from_slice(value),
    }
}

/// Runs every job the store hands out until none is left.
fn run_jobs(store: &mut VersionStore<SimDisk>) {
    store.run_jobs_now().unwrap();
}

fn all(store: &VersionStore<SimDisk>) -> Vec<Record> {
    store
        .iter(&[], Bound::Unbounded)
        .collect::<Result<Vec<_>>>()
        .unwrap()
}

fn model_records(model: &Model) -> Vec<Record> {
    model
        .iter()
        .map(|((k, v), (t, value))| record(k, *v, *t, value))
        .collect()
}

fn model_latest(model: &Model, key: &[u8], version_max: u64) -> Option<Record> {
    model
        .range((key.to_vec(), 0)..=(key.to_vec(), version_max))
        .next_back()
        .map(|((k, v), (t, value))| record(k, *v, *t, value))
}

/// A random write against the model: keys from a small set (so keys get
/// many versions), values up to 3 KiB (so records span blocks).
fn random_put(rng: &mut ChaCha8Rng, version: u64) -> Record {
    let key = format!("key-{:02}", rng.next_u64() % 40);
    let tombstone = rng.next_u64() % 10 == 0;
    let len = if tombstone {
        0
    } else {
        (rng.next_u64() % 3000) as usize
    };
    let value = vec![(version % 251) as u8; len];
    record(key.as_bytes(), version, tombstone, &value)
}

fn put(store: &mut VersionStore<SimDisk>, model: &mut Model, r: Record) {
    model.insert((r.key.to_vec(), r.version), (r.tombstone, r.value.to_vec()));
    store.put(r).unwrap();
}

/// `count` random writes above `version`, flushed (and merged) every 100.
fn write_flushing(
    store: &mut VersionStore<SimDisk>,
    model: &mut Model,
    rng: &mut ChaCha8Rng,
    version: &mut u64,
    count: u64,
) {
    for step in 0..count {
        *version += 1;
        put(store, model, random_put(rng, *version));
        if step % 100 == 99 {
            store.freeze(step, Bytes::new());
            run_jobs(store);
        }
    }
}

#[test]
fn reads_see_every_layer_and_a_reopen_keeps_what_was_flushed() {
    let disk = SimDisk::with_seed(1);
    let (mut store, recovered) = open(&disk);
    assert_eq!(recovered.marker, 0);
    store.put(record(b"a", 2, false, b"a2")).unwrap();
    store.put(record(b"b", 3, false, b"b3")).unwrap();
    store.freeze(10, Bytes::from_static(b"meta@10"));
    store.put(record(b"a", 4, false, b"a4")).unwrap();
    // The frozen layer and the memtable both answer.
    assert_eq!(store.latest(b"a", 3).unwrap().unwrap().value, &b"a2"[..]);
    assert_eq!(store.latest(b"a", 9).unwrap().unwrap().value, &b"a4"[..]);
    assert_eq!(store.latest(b"a", 1).unwrap(), None);
    run_jobs(&mut store);
    assert_eq!(store.durable_marker(), 10);
    assert_eq!(store.stats().runs, 1);
    // From the run now.
    assert_eq!(store.latest(b"b", 9).unwrap().unwrap().value, &b"b3"[..]);
    // A crash loses the memtable; the log replays it from marker 10.
    disk.crash(CrashMode::LoseUnsynced);
    let (store, recovered) = open(&disk);
    assert_eq!(recovered.marker, 10);
    assert_eq!(recovered.meta, &b"meta@10"[..]);
    assert_eq!(store.latest(b"a", 9).unwrap().unwrap().value, &b"a2"[..]);
    assert_eq!(
        all(&store),
        vec![record(b"a", 2, false, b"a2"), record(b"b", 3, false, b"b3")]
    );
}

#[test]
fn versions_of_a_key_must_grow() {
    let disk = SimDisk::with_seed(2);
    let (mut store, _) = open(&disk);
    store.put(record(b"a", 5, false, b"")).unwrap();
    assert!(matches!(
        store.put(record(b"a", 5, false, b"")),
        Err(StorageError::VersionOutOfOrder {
            version: 5,
            last: 5
        })
    ));
    // Undo takes back a write since the freeze.
    assert!(store.undo(b"a", 5));
    assert!(!store.undo(b"a", 5));
    assert_eq!(store.latest(b"a", 9).unwrap(), None);
}

#[test]
fn undo_finds_the_version_among_many_of_one_key() {
    let disk = SimDisk::with_seed(3);
    let (mut store, _) = open(&disk);
    for version in (2..200u64).step_by(2) {
        store.put(record(b"a", version, false, b"v")).unwrap();
    }
    // Absent versions, between and past the stored ones, are not undone.
    assert!(!store.undo(b"a", 101));
    assert!(!store.undo(b"a", 1));
    assert!(!store.undo(b"a", 1000));
    assert!(!store.undo(b"b", 100));
    // The newest and one in the middle go; their neighbours stay.
    assert!(store.undo(b"a", 198));
    assert!(store.undo(b"a", 100));
    assert_eq!(
        store.latest(b"a", 1000).unwrap().map(|r| r.version),
        Some(196)
    );
    assert_eq!(
        store.latest(b"a", 101).unwrap().map(|r| r.version),
        Some(98)
    );
    assert_eq!(
        store.latest(b"a", 102).unwrap().map(|r| r.version),
        Some(102)
    );
}

/// What `VersionStore::history` should return, from the model.
fn model_history(
    model: &Model,
    keys: (Bound<&[u8]>, Bound<&[u8]>),
    versions: std::ops::RangeInclusive<u64>,
    records_max: usize,
) -> Vec<Record> {
    let mut expected: Vec<Record> = model_records(model)
        .into_iter()
        .filter(|r| {
            RangeBounds::<[u8]>::contains(&keys, r.key.as_ref()) && versions.contains(&r.version)
        })
        .collect();
    expected.sort_by(|a, b| (a.version, &a.key).cmp(&(b.version, &b.key)));
    if expected.len() > records_max {
        let last = match records_max.checked_sub(1) {
            Some(nth) => expected[nth].version,
            None => return Vec::new(),
        };
        expected.retain(|r| r.version <= last);
    }
    expected
}

#[test]
fn history_of_a_key_range_is_cut_at_a_whole_version() {
    for seed in 0..10 {
        let disk = SimDisk::with_seed(seed);
        let (mut store, _) = open(&disk);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut model = Model::new();
        let mut version = 1u64;
        for step in 0..600u64 {
            // Several keys change in one version, as in a transaction.
            version += 1;
            let mut keys: Vec<u64> = (0..1 + rng.next_u64() % 4)
                .map(|_| rng.next_u64() % 30)
                .collect();
            keys.sort_unstable();
            keys.dedup();
            for key in keys {
                let tombstone = rng.next_u64() % 8 == 0;
                let value = if tombstone {
                    Vec::new()
                } else {
                    version.to_be_bytes().to_vec()
                };
                put(
                    &mut store,
                    &mut model,
                    record(
                        format!("key-{key:02}").as_bytes(),
                        version,
                        tombstone,
                        &value,
                    ),
                );
            }
            if rng.next_u64() % 50 == 0 {
                store.freeze(step, Bytes::new());
            }
            if rng.next_u64() % 80 == 0 {
                run_jobs(&mut store);
            }
        }
        for _ in 0..100 {
            let low = format!("key-{:02}", rng.next_u64() % 32);
            let high = format!("key-{:02}", rng.next_u64() % 32);
            let end = match rng.next_u64() % 3 {
                0 => Bound::Included(high.as_bytes()),
                1 => Bound::Excluded(high.as_bytes()),
                _ => Bound::Unbounded,
            };
            let version_min = rng.next_u64() % (version + 2);
            let version_max = version_min + rng.next_u64() % (version + 2);
            let records_max = usize::try_from(rng.next_u64() % 80).unwrap();
            assert_eq!(
                store.history(low.as_bytes(), end, version_min, version_max, records_max).unwrap(),
                model_history(
                    &model,
                    (Bound::Included(low.as_bytes()), end),
                    version_min..=version_max,
                    records_max
                ),
                "seed {seed}: {low}..{end:?} versions {version_min}..={version_max} max {records_max}"
            );
        }
    }
}

/// A watcher 20,000 versions behind, on a prefix that changes with every
/// version, catches up in batches of 100. Each batch must cost about what
/// it returns, in the memtable and in runs on disk alike; a walk to the
/// present looked at every version of its lag for every batch.
#[test]
fn a_history_batch_far_behind_looks_at_about_what_it_returns() {
    let disk = SimDisk::with_seed(7);
    let (mut store, _) = open(&disk);
    let mut model = Model::new();
    let versions_total = 20_000u64;
    let records_max = 100usize;
    for version in 1..=versions_total {
        let key = format!("hot/{:02}", version % 10);
        put(
            &mut store,
            &mut model,
            record(key.as_bytes(), version, false, &[1; 200]),
        );
        // The older half goes to runs, the newer half stays in memory.
        if version == versions_total / 2 {
            store.freeze(version, Bytes::new());
            run_jobs(&mut store);
        }
    }
    let prefix_end = Bound::Excluded(&b"hot0"[..]);
    for version_min in [1, versions_total / 4, versions_total * 3 / 4] {
        let walk = store
            .history_walk(
                b"hot/",
                prefix_end,
                version_min..=versions_total,
                records_max,
            )
            .unwrap();
        assert_eq!(
            walk.records,
            model_history(
                &model,
                (Bound::Included(&b"hot/"[..]), prefix_end),
                version_min..=versions_total,
                records_max
            ),
            "from {version_min}"
        );
        assert_eq!(walk.records.len(), records_max, "from {version_min}");
        assert_eq!(
            walk.windows, 1,
            "from {version_min}: the first window holds the batch"
        );
        if version_min > versions_total / 2 {
            assert_eq!(walk.memtable_versions, records_max, "from {version_min}");
            assert_eq!(walk.blocks_read, 0, "from {version_min}");
        } else {
            // The window of 100 versions meets one or two blocks of each
            // of the 10 keys, out of about 14 each.
            assert!(
                walk.blocks_read <= 20,
                "from {version_min}: {} blocks",
                walk.blocks_read
            );
            assert_eq!(walk.memtable_versions, 0, "from {version_min}");
        }
    }
    // A key that changed only every 1,000th version is found in windows
    // growing four times each: a few of them, not one per batch size.
    for version in (versions_total + 1..=versions_total + 10_000).step_by(1_000) {
        put(
            &mut store,
            &mut model,
            record(b"rare", version, false, b"r"),
        );
    }
    let walk = store
        .history_walk(
            b"rare",
            Bound::Included(&b"rare"[..]),
            1..=versions_total + 10_000,
            5,
        )
        .unwrap();
    let versions: Vec<u64> = walk.records.iter().map(|r| r.version).collect();
    assert_eq!(
        versions,
        (0..5)
            .map(|i| versions_total + 1 + i * 1_000)
            .collect::<Vec<_>>()
    );
    assert!(walk.windows <= 10, "{} windows", walk.windows);
}

#[test]
fn random_writes_flushes_and_merges_match_the_model() {
    for seed in 0..20 {
        let disk = SimDisk::with_seed(seed);
        let (mut store, _) = open(&disk);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut model = Model::new();
        let mut version = 1;
        for step in 0..1500u64 {
            version += 1 + rng.next_u64() % 3;
            put(&mut store, &mut model, random_put(&mut rng, version));
            if rng.next_u64() % 60 == 0 {
                store.freeze(step, Bytes::new());
            }
            if rng.next_u64() % 90 == 0 {
                run_jobs(&mut store);
            }
        }
        store.freeze(1500, Bytes::new());
        run_jobs(&mut store);
        assert_eq!(all(&store), model_records(&model), "seed {seed}");
        for key in 0..40 {
            let key = format!("key-{key:02}");
            for version_max in [0, version / 3, version / 2, version] {
                assert_eq!(
                    store.latest(key.as_bytes(), version_max).unwrap(),
                    model_latest(&model, key.as_bytes(), version_max),
                    "seed {seed} key {key} at {version_max}"
                );
            }
        }
        // A sub-range, and the history in version order.
        let sub: Vec<Record> = store
            .iter(b"key-10", Bound::Excluded(b"key-20"))
            .collect::<Result<_>>()
            .unwrap();
        let expected: Vec<Record> = model_records(&model)
            .into_iter()
            .filter(|r| r.key.as_ref() >= &b"key-10"[..] && r.key.as_ref() < &b"key-20"[..])
            .collect();
        assert_eq!(sub, expected, "seed {seed}");
        let history = store
            .history(b"", Bound::Unbounded, version / 2, version, usize::MAX)
            .unwrap();
        let mut expected: Vec<Record> = model_records(&model)
            .into_iter()
            .filter(|r| r.version >= version / 2)
            .collect();
        expected.sort_by_key(|r| r.version);
        assert_eq!(history, expected, "seed {seed}");
        // Merging keeps the number of runs logarithmic.
        let stats = store.stats();
        assert!(stats.runs <= 12, "seed {seed}: {stats:?}");
        // And a reopen reads the same.
        drop(store);
        let (store, _) = open(&disk);
        assert_eq!(all(&store), model_records(&model), "seed {seed} reopened");
    }
}

#[test]
fn merges_drop_what_the_floor_shadows_and_keep_what_reads_see() {
    let disk = SimDisk::with_seed(3);
    let (mut store, _) = open(&disk);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut model = Model::new();
    let mut version = 1;
    write_flushing(&mut store, &mut model, &mut rng, &mut version, 3000);
    let floor = version - 200;
    store.set_floor(floor);
    // Enough new runs for a merge that reaches the oldest run.
    write_flushing(&mut store, &mut model, &mut rng, &mut version, 3000);
    let stats = store.stats();
    assert!(
        stats.run_records < model.len() as u64,
        "shadowed versions were dropped: {stats:?}, {} written",
        model.len()
    );
    for key in 0..40 {
        let key = format!("key-{key:02}");
        for version_max in [floor, floor + 100, version] {
            let expected = model_latest(&model, key.as_bytes(), version_max);
            let found = store.latest(key.as_bytes(), version_max).unwrap();
            // A tombstone at or below the floor may be gone: both mean
            // "no key".
            let visible = |r: Option<Record>| r.filter(|r| !r.tombstone);
            assert_eq!(visible(found), visible(expected), "{key} at {version_max}");
        }
    }
}

/// The model as it stood when the store was frozen at each marker.
struct Frozen {
    by_marker: BTreeMap<u64, Model>,
}

#[test]
fn a_crash_at_any_point_of_a_job_recovers_a_manifest_whole() {
    let mut outcomes = (0, 0);
    for seed in 0..40u64 {
        let disk = SimDisk::with_seed(seed);
        let (mut store, _) = open(&disk);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut model = Model::new();
        let mut frozen = Frozen {
            by_marker: BTreeMap::from([(0, Model::new())]),
        };
        let mut log: Vec<Record> = Vec::new();
        let mut version = 1;
        let mut marker = 0;
        // Some history first, flushed and merged without faults.
        for _ in 0..400 {
            version += 1;
            let r = random_put(&mut rng, version);
            log.push(r.clone());
            put(&mut store, &mut model, r);
            if rng.next_u64() % 50 == 0 {
                marker = log.len() as u64;
                store.freeze(marker, Bytes::from(marker.to_le_bytes().to_vec()));
                frozen.by_marker.insert(marker, model.clone());
                run_jobs(&mut store);
            }
        }
        for _ in 0..200 {
            version += 1;
            let r = random_put(&mut rng, version);
            log.push(r.clone());
            put(&mut store, &mut model, r);
        }
        marker = marker.max(log.len() as u64);
        store.freeze(marker, Bytes::from(marker.to_le_bytes().to_vec()));
        frozen.by_marker.insert(marker, model.clone());
        // The power goes at a random point of the next job.
        let before = store.durable_marker();
        // A flush here writes about a megabyte: some crashes hit the run,
        // some the manifest, some come after the job.
        disk.set_fault_budget(Some(rng.next_u64() % 1_500_000));
        if let Some(job) = store.next_job(JobLane::Flush) {
            let done = job.run();
            if let Ok(write) = store.finish_job(JobLane::Flush, done) {
                if let Ok(written) = write.commit() {
                    store.manifest_written(written);
                }
            }
        }
        let mode = match seed % 3 {
            0 => CrashMode::LoseUnsynced,
            1 => CrashMode::TornUnsynced,
            _ => CrashMode::KeepWritten,
        };
        disk.crash(mode);
        drop(store);
        let (mut store, recovered) = open(&disk);
        assert!(
            recovered.marker == before || recovered.marker == marker,
            "seed {seed}: recovered at {}, expected {before} or {marker}",
            recovered.marker
        );
        if recovered.marker > 0 {
            assert_eq!(recovered.meta.as_ref(), &recovered.marker.to_le_bytes()[..]);
        } else {
            assert!(recovered.meta.is_empty(), "seed {seed}: a new store");
        }
        if recovered.marker == marker && marker != before {
            outcomes.1 += 1;
        } else {
            outcomes.0 += 1;
        }
        let expected = &frozen.by_marker[&recovered.marker];
        assert_eq!(all(&store), model_records(expected), "seed {seed}");
        // The log after the marker is applied again, and all is there.
        for r in &log[recovered.marker as usize..] {
            store.put(r.clone()).unwrap();
        }
        assert_eq!(all(&store), model_records(&model), "seed {seed} replayed");
        // No leftover of the broken job is left on disk.
        let files = disk.list_files(&dir()).unwrap();
        assert!(
            files.iter().all(|f| !f.ends_with(".tmp")),
            "seed {seed}: {files:?}"
        );
    }
    assert!(
        outcomes.0 > 5 && outcomes.1 > 5,
        "crashes before and after the manifest: {outcomes:?}"
    );
}

fn run_files(disk: &SimDisk, dir: &Path) -> Vec<PathBuf> {
    disk.list_files(dir)
        .unwrap()
        .into_iter()
        .filter(|f| f.starts_with("run-"))
        .map(|f| dir.join(f))
        .collect()
}

#[test]
fn a_damaged_run_or_manifest_is_refused_naming_the_file() {
    let disk = SimDisk::with_seed(4);
    let (mut store, _) = open(&disk);
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut version = 1;
    for _ in 0..300 {
        version += 1;
        store.put(random_put(&mut rng, version)).unwrap();
    }
    store.freeze(300, Bytes::new());
    run_jobs(&mut store);
    drop(store);
    let run = run_files(&disk, &dir()).remove(0);
    // A byte in the middle of the blocks: open succeeds (the index is
    // whole), the read of that block fails with the file named.
    assert!(disk.corrupt_byte(&run, 100));
    let (store, _) = open(&disk);
    let error = store
        .iter(&[], Bound::Unbounded)
        .find_map(|r| r.err())
        .expect("the damaged block is refused");
    match error {
        StorageError::Corrupt { path, .. } => assert_eq!(path, run),
        other => panic!("expected Corrupt, got {other}"),
    }
    drop(store);
    // A damaged footer: the open itself refuses.
    let len = disk.file_len(&run).unwrap();
    assert!(disk.corrupt_byte(&run, len - 10));
    assert!(matches!(
        VersionStore::open(disk.clone(), &dir(), VersionStoreOptions::default()),
        Err(StorageError::Corrupt { .. })
    ));
    // A damaged manifest, likewise.
    let disk = SimDisk::with_seed(5);
    let (mut store, _) = open(&disk);
    store.put(record(b"a", 2, false, b"x")).unwrap();
    store.freeze(1, Bytes::new());
    run_jobs(&mut store);
    drop(store);
    assert!(disk.corrupt_byte(&dir().join(manifest::MANIFEST_FILE), 20));
    match VersionStore::open(disk.clone(), &dir(), VersionStoreOptions::default()) {
        Err(StorageError::Corrupt { path, .. }) => {
            assert_eq!(path, dir().join(manifest::MANIFEST_FILE))
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn a_view_does_not_change_with_later_writes_and_merges() {
    let disk = SimDisk::with_seed(6);
    let (mut store, _) = open(&disk);
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let mut model = Model::new();
    let mut version = 1;
    write_flushing(&mut store, &mut model, &mut rng, &mut version, 1000);
    let view = store.view(1000, Bytes::from_static(b"at 1000"));
    let seen = model.clone();
    write_flushing(&mut store, &mut model, &mut rng, &mut version, 2000);
    let from_view: Vec<Record> = view
        .iter(&[], Bound::Unbounded)
        .collect::<Result<_>>()
        .unwrap();
    assert_eq!(from_view, model_records(&seen));
    assert_eq!(view.marker(), 1000);
}

#[test]
fn a_range_view_is_cut_after_the_memtable_keys_it_copied_and_keeps_its_versions() {
    let disk = SimDisk::with_seed(8);
    let (mut store, _) = open(&disk);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let mut model = Model::new();
    let mut version = 1;
    // Runs on disk, frozen layers and a memtable, all holding keys.
    write_flushing(&mut store, &mut model, &mut rng, &mut version, 1050);
    let seen = model.clone();
    let in_range = |r: &Record| r.key.as_ref() >= &b"k"[..] && r.key.as_ref() < &b"l"[..];
    let expected: Vec<Record> = model_records(&seen).into_iter().filter(in_range).collect();
    // Walk the range view by view, as a scan in steps does, changing and
    // flushing the store between views.
    let mut walked: Vec<Record> = Vec::new();
    let mut start = b"k".to_vec();
    let mut views = 0;
    loop {
        let view = store.range_view(&start, Bound::Excluded(b"l"), 3);
        let found: Vec<Record> = view.iter().collect::<Result<_>>().unwrap();
        // Every version of the view's keys, none of another key.
        assert!(found.iter().all(|r| r.key.as_ref() >= start.as_slice()));
        if let Some(cut) = view.cut() {
            assert!(found.iter().all(|r| r.key.as_ref() <= cut));
        }
        // Later writes, flushes and merges do not change a view taken.
        write_flushing(&mut store, &mut model, &mut rng, &mut version, 150);
        let again: Vec<Record> = view.iter().collect::<Result<_>>().unwrap();
        assert_eq!(again, found);
        // Only what was there when the view was taken counts.
        walked.extend(
            found
                .into_iter()
                .filter(|r| seen.contains_key(&(r.key.to_vec(), r.version))),
        );
        views += 1;
        match view.cut() {
            Some(cut) => {
                start = cut.to_vec();
                start.push(0);
            }
            None => break,
        }
    }
    assert!(views > 1, "the memtable held more than 3 keys of the range");
    assert_eq!(walked, expected);
}

#[test]
fn the_durable_view_holds_what_a_reopen_finds_and_nothing_later() {
    let disk = SimDisk::with_seed(8);
    let (mut store, _) = open(&disk);
    store.put(record(b"a", 2, false, b"flushed")).unwrap();
    store.freeze(5, Bytes::from_static(b"at 5"));
    run_jobs(&mut store);
    // Written after the flush: in the store, not in the durable view.
    store.put(record(b"b", 3, false, b"later")).unwrap();
    store.freeze(9, Bytes::from_static(b"at 9"));
    let view = store.durable_view();
    assert_eq!(view.marker(), 5);
    assert_eq!(view.meta(), &Bytes::from_static(b"at 5"));
    let held: Vec<Record> = view
        .iter(&[], Bound::Unbounded)
        .collect::<Result<_>>()
        .unwrap();
    assert_eq!(held, vec![record(b"a", 2, false, b"flushed")]);
    disk.crash(CrashMode::LoseUnsynced);
    let (reopened, recovered) = open(&disk);
    assert_eq!(recovered.marker, 5);
    assert_eq!(all(&reopened), held);
}

/// Flushes every frozen layer without merging, so runs pile up until a
/// merge is due.
fn flush_only(store: &mut VersionStore<SimDisk>) {
    while let Some(job) = store.next_job(JobLane::Flush) {
        let done = job.run();
        let written = store.finish_job(JobLane::Flush, done).unwrap().commit();
        store.manifest_written(written.unwrap());
    }
}

#[test]
fn a_flush_runs_while_a_merge_is_in_flight_and_a_crash_anywhere_recovers_a_manifest_whole() {
    let mut outcomes = BTreeMap::<&str, u32>::new();
    for seed in 0..60u64 {
        let disk = SimDisk::with_seed(seed);
        let (mut store, _) = open(&disk);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut model = Model::new();
        let mut by_marker = BTreeMap::from([(0u64, Model::new())]);
        let mut version = 1;
        let mut marker = 0u64;
        let meta = |marker: u64| Bytes::from(marker.to_le_bytes().to_vec());
        // Each run larger than the one before, so a merge is due.
        for count in [60u64, 120, 240, 480] {
            for _ in 0..count {
                version += 1;
                put(&mut store, &mut model, random_put(&mut rng, version));
            }
            marker += count;
            store.freeze(marker, meta(marker));
            by_marker.insert(marker, model.clone());
            flush_only(&mut store);
        }
        let before = store.durable_marker();
        assert_eq!(before, marker);
        let merge = store.next_job(JobLane::Merge).expect("a merge is due");
        assert!(
            store.next_job(JobLane::Merge).is_none(),
            "one merge at a time"
        );
        let sources = run_files(&disk, &dir());
        // Writes go on while the merge runs, and are frozen and flushed
        // beside it.
        for _ in 0..100 {
            version += 1;
            put(&mut store, &mut model, random_put(&mut rng, version));
        }
        marker += 100;
        store.freeze(marker, meta(marker));
        by_marker.insert(marker, model.clone());
        let flush = store
            .next_job(JobLane::Flush)
            .expect("a flush is handed out while a merge runs");
        assert!(
            store.next_job(JobLane::Flush).is_none(),
            "one flush at a time"
        );
        let crash = seed % 4 != 0;
        if crash {
            disk.set_fault_budget(Some(rng.next_u64() % 2_000_000));
        }
        // Either job may finish first, and either manifest may be written
        // first.
        let merge_first = seed % 2 == 0;
        let commit_in_order = (seed / 2) % 2 == 0;
        let merge_done = merge.run();
        let flush_done = flush.run();
        let (first, second) = if merge_first {
            (
                store.finish_job(JobLane::Merge, merge_done),
                store.finish_job(JobLane::Flush, flush_done),
            )
        } else {
            (
                store.finish_job(JobLane::Flush, flush_done),
                store.finish_job(JobLane::Merge, merge_done),
            )
        };
        let (first, second) = if commit_in_order {
            (first, second)
        } else {
            (second, first)
        };
        for write in [first, second].into_iter().flatten() {
            if !crash && write.marker() == marker {
                // Installed but not yet durable: the marker has not moved.
                assert_eq!(store.durable_marker(), before);
            }
            if let Ok(written) = write.commit() {
                store.manifest_written(written);
            }
        }
        if !crash {
            assert_eq!(all(&store), model_records(&model), "seed {seed}: live");
            assert_eq!(store.durable_marker(), marker, "seed {seed}");
            let files = run_files(&disk, &dir());
            assert_eq!(
                files.len(),
                2,
                "seed {seed}: the merged run and the flushed one"
            );
            assert!(
                sources.iter().all(|source| !files.contains(source)),
                "seed {seed}: the merge's sources are gone"
            );
        }
        disk.crash(match seed % 3 {
            0 => CrashMode::LoseUnsynced,
            1 => CrashMode::TornUnsynced,
            _ => CrashMode::KeepWritten,
        });
        drop(store);
        let (store, recovered) = open(&disk);
        assert!(
            recovered.marker == before || recovered.marker == marker,
            "seed {seed}: recovered at {}",
            recovered.marker
        );
        assert_eq!(recovered.meta, meta(recovered.marker), "seed {seed}");
        assert_eq!(
            all(&store),
            model_records(&by_marker[&recovered.marker]),
            "seed {seed}: reopened at {}",
            recovered.marker
        );
        let label = match (crash, recovered.marker == marker) {
            (false, _) => "no crash",
            (true, true) => "crash after the flush's manifest",
            (true, false) => "crash before it",
        };
        *outcomes.entry(label).or_default() += 1;
    }
    assert!(
        outcomes.len() == 3 && outcomes.values().all(|n| *n >= 5),
        "every outcome is seen: {outcomes:?}"
    );
}

/// A long run is synced every [`run::RUN_SYNC_BYTES`] as it is written,
/// not only at its end: a run of gigabytes left dirty in the page cache
/// until one final sync held every sync of the Raft log behind its
/// writeback (a 5.7 s put at 2 GB).
#[test]
fn a_long_run_is_synced_as_it_is_written() {
    let disk = SimDisk::with_seed(10);
    crate::disk::create_dir_durably(&disk, &dir()).unwrap();
    let mut writer = run::RunWriter::create(&disk, &dir().join("run.tmp")).unwrap();
    disk.fail_next_syncs(1);
    let value = Bytes::from(vec![7u8; 64 * 1024]);
    let mut written = 0u64;
    let mut failed_at = None;
    for i in 0..400u32 {
        let record = Record {
            key: Bytes::from(format!("key-{i:06}")),
            version: 1,
            tombstone: false,
            value: value.clone(),
        };
        if writer.push(&record).is_err() {
            failed_at = Some(written);
            break;
        }
        written += value.len() as u64;
    }
    let failed_at = failed_at.expect("a sync ran before the run was finished");
    assert!(
        (run::RUN_SYNC_BYTES - 2 * value.len() as u64
            ..=run::RUN_SYNC_BYTES + 2 * value.len() as u64)
            .contains(&failed_at),
        "synced after {failed_at} bytes"
    );
}

/// A run being written keeps nothing of the records pushed into it: a
/// merge reads its sources in blocks, and an index entry holding a slice
/// of one (its first key) kept every source block alive until the merge
/// finished (347 MB of a 400 MB merge, seen with heaptrack).
#[test]
fn a_run_being_written_keeps_no_slice_of_the_records_pushed() {
    let disk = SimDisk::with_seed(9);
    crate::disk::create_dir_durably(&disk, &dir()).unwrap();
    let mut writer = run::RunWriter::create(&disk, &dir().join("run.tmp")).unwrap();
    // A "block read from a source run": keys and values are slices of it.
    let mut source = Vec::new();
    for i in 0..2000u32 {
        source.extend_from_slice(format!("key-{i:06}").as_bytes());
    }
    let source = Bytes::from(source);
    for i in 0..2000usize {
        let record = Record {
            key: source.slice(i * 10..i * 10 + 10),
            version: 1,
            tombstone: false,
            value: source.slice(0..100),
        };
        writer.push(&record).unwrap();
    }
    assert!(
        source.is_unique(),
        "the writer holds a slice of the records' buffer"
    );
    let summary = writer.finish().unwrap();
    assert_eq!(summary.records, 2000);
}

#[test]
fn a_point_lookup_reads_only_blocks_of_runs_that_may_hold_the_key() {
    let disk = SimDisk::with_seed(3);
    // No merges: three runs stay three, each holding every third key.
    let (mut store, _) = VersionStore::open(
        disk.clone(),
        &dir(),
        VersionStoreOptions {
            merge_ratio: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let keys = 600u64;
    let key = |i: u64| format!("key-{i:04}").into_bytes();
    let mut version = 0;
    for run in 0..3 {
        for i in (0..keys).filter(|i| i % 3 == run) {
            version += 1;
            store
                .put(record(&key(i), version, false, &[run as u8; 200]))
                .unwrap();
        }
        store.freeze(version, Bytes::new());
        run_jobs(&mut store);
    }
    assert_eq!(store.stats().layers, 3);
    let reads_of = |lookup: &dyn Fn()| {
        let before = disk.reads();
        lookup();
        disk.reads() - before
    };
    // Outside every run's key range: no read at all.
    for absent in [&b"a"[..], b"key-", b"zzz"] {
        assert_eq!(
            reads_of(&|| assert_eq!(store.latest(absent, version).unwrap(), None)),
            0
        );
    }
    // Inside the key ranges but in no run: the filters refuse nearly all
    // (without them, each lookup would read one block of each run).
    let absent_reads = reads_of(&|| {
        for i in 0..keys {
            let mut k = key(i);
            k.push(b'x');
            assert_eq!(store.latest(&k, version).unwrap(), None);
        }
    });
    assert!(absent_reads <= keys * 3 / 20, "{absent_reads} block reads");
    // A key held by one run: its block, and rarely another run's.
    let present_reads = reads_of(&|| {
        for i in 0..keys {
            let found = store.latest(&key(i), version).unwrap().unwrap();
            assert_eq!(found.value, vec![(i % 3) as u8; 200]);
        }
    });
    assert!(
        present_reads <= keys + keys * 3 / 20,
        "{present_reads} block reads"
    );
}

/// Small runs, so that a few hundred records make layers of several runs.
fn small_runs() -> VersionStoreOptions {
    VersionStoreOptions {
        merge_ratio: 1,
        run_bytes_target: 48 * 1024,
        run_bytes_move_min: 16 * 1024,
    }
}

fn open_with(disk: &SimDisk, options: VersionStoreOptions) -> VersionStore<SimDisk> {
    VersionStore::open(disk.clone(), &dir(), options).unwrap().0
}

/// 8000 keys written about in key order, 40 flushes of 200 each, into a
/// store with `options`: each key a little out of order, as 256 clients
/// putting keys in order write them (a few land in the next flush, after
/// keys above them).
fn fill_in_key_order(store: &mut VersionStore<SimDisk>, model: &mut Model) {
    let mut rng = ChaCha8Rng::seed_from_u64(8000);
    let mut order: Vec<(u64, u64)> = (0..8000u64).map(|i| (i + rng.next_u64() % 40, i)).collect();
    order.sort();
    for (step, (_, i)) in order.into_iter().enumerate() {
        let version = step as u64 + 1;
        let key = format!("fill-{i:06}");
        put(
            store,
            model,
            record(key.as_bytes(), version, false, &[7; 300]),
        );
        if version % 200 == 0 {
            store.freeze(version, Bytes::new());
            run_jobs(store);
        }
    }
}

#[test]
fn keys_written_in_order_are_moved_by_merges_not_written_again() {
    let moving_disk = SimDisk::with_seed(21);
    let mut moving = open_with(&moving_disk, small_runs());
    let mut model = Model::new();
    fill_in_key_order(&mut moving, &mut model);
    // The same fill with every run rewritten by every merge, as before
    // runs were moved.
    let rewriting_disk = SimDisk::with_seed(21);
    let mut rewriting = open_with(
        &rewriting_disk,
        VersionStoreOptions {
            run_bytes_move_min: u64::MAX,
            ..small_runs()
        },
    );
    fill_in_key_order(&mut rewriting, &mut Model::new());

    let (moved, rewritten) = (moving.stats(), rewriting.stats());
    assert_eq!(all(&moving), model_records(&model));
    assert_eq!(all(&rewriting), model_records(&model));
    assert!(moved.runs_moved > 0, "{moved:?}");
    assert_eq!(rewritten.runs_moved, 0);
    // Merges kept the layers few either way.
    assert!(
        moved.layers <= 8 && rewritten.layers <= 8,
        "{moved:?} {rewritten:?}"
    );
    // Each byte written about once (the flush), plus the older runs the
    // keys out of order overlap, and the manifests.
    assert!(
        moved.written_bytes < moved.run_file_bytes * 3 / 2,
        "{moved:?}"
    );
    assert!(
        moved.written_bytes * 2 < rewritten.written_bytes,
        "moved {moved:?}, rewritten {rewritten:?}"
    );
    // Reads find every key through the layers' runs, and a reopen reads
    // the same shape.
    for i in (0..8000u64).step_by(37) {
        let key = format!("fill-{i:06}");
        assert_eq!(
            moving.latest(key.as_bytes(), u64::MAX).unwrap(),
            model_latest(&model, key.as_bytes(), u64::MAX)
        );
    }
    let sub: Vec<Record> = moving
        .iter(b"fill-001234", Bound::Included(b"fill-005678"))
        .collect::<Result<_>>()
        .unwrap();
    assert_eq!(sub.len(), 5678 - 1234 + 1);
    drop(moving);
    let reopened = open_with(&moving_disk, small_runs());
    assert_eq!(reopened.stats().runs, moved.runs);
    assert_eq!(all(&reopened), model_records(&model));
    // A full merge rewrites every run, moving none.
    let mut reopened = reopened;
    let ticket = reopened.request_full_merge(0);
    run_jobs(&mut reopened);
    assert!(reopened.full_merge_done(ticket));
    assert_eq!(reopened.stats().layers, 1);
    assert_eq!(reopened.stats().runs_moved, 0);
    assert_eq!(all(&reopened), model_records(&model));
}

/// Writes in key order mixed with writes over keys already written (so
/// merges both move and rewrite, and rewrite only what overlaps), with
/// tombstones, random freezes, jobs and reopens: every read matches the
/// model.
#[test]
fn ordered_and_overlapping_writes_mixed_match_the_model() {
    for seed in 0..30u64 {
        let disk = SimDisk::with_seed(seed);
        let mut store = open_with(&disk, small_runs());
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut model = Model::new();
        let mut version = 0u64;
        let mut next_key = 0u64;
        let mut moved_before_reopens = 0;
        let key_of = |i: u64| format!("k-{i:06}").into_bytes();
        for step in 0..4000u64 {
            version += 1;
            let roll = rng.next_u64() % 100;
            let (key, tombstone) = if roll < 70 || next_key == 0 {
                next_key += 1;
                (key_of(next_key - 1), false)
            } else {
                // Over a key written before: near the end as often as
                // anywhere.
                let back = if roll < 85 {
                    50.min(next_key)
                } else {
                    next_key
                };
                let i = next_key - 1 - rng.next_u64() % back;
                (key_of(i), roll >= 95)
            };
            let len = if tombstone {
                0
            } else {
                100 + (rng.next_u64() % 400) as usize
            };
            put(
                &mut store,
                &mut model,
                record(&key, version, tombstone, &vec![(version % 251) as u8; len]),
            );
            if rng.next_u64() % 150 == 0 {
                store.freeze(step, Bytes::new());
            }
            if rng.next_u64() % 200 == 0 {
                run_jobs(&mut store);
            }
            if rng.next_u64() % 1000 == 0 {
                store.freeze(step, Bytes::new());
                run_jobs(&mut store);
                moved_before_reopens += store.stats().runs_moved;
                drop(store);
                store = open_with(&disk, small_runs());
            }
        }
        store.freeze(4000, Bytes::new());
        run_jobs(&mut store);
        let stats = store.stats();
        assert!(
            stats.runs_moved + moved_before_reopens > 0,
            "seed {seed}: {stats:?}"
        );
        assert!(stats.runs > stats.layers, "seed {seed}: {stats:?}");
        assert_eq!(all(&store), model_records(&model), "seed {seed}");
        for _ in 0..200 {
            let i = rng.next_u64() % (next_key + 10);
            let version_max = rng.next_u64() % (version + 1);
            assert_eq!(
                store.latest(&key_of(i), version_max).unwrap(),
                model_latest(&model, &key_of(i), version_max),
                "seed {seed} key {i} at {version_max}"
            );
        }
        let (from, to) = (key_of(next_key / 3), key_of(next_key * 2 / 3));
        let sub: Vec<Record> = store
            .iter(&from, Bound::Excluded(&to))
            .collect::<Result<_>>()
            .unwrap();
        let expected: Vec<Record> = model_records(&model)
            .into_iter()
            .filter(|r| r.key.as_ref() >= from.as_slice() && r.key.as_ref() < to.as_slice())
            .collect();
        assert_eq!(sub, expected, "seed {seed}");
        let history = store
            .history(b"", Bound::Unbounded, version / 2, version, usize::MAX)
            .unwrap();
        let mut expected: Vec<Record> = model_records(&model)
            .into_iter()
            .filter(|r| r.version >= version / 2)
            .collect();
        expected.sort_by_key(|r| r.version);
        assert_eq!(history, expected, "seed {seed}");
        drop(store);
        let reopened = open_with(&disk, small_runs());
        assert_eq!(
            all(&reopened),
            model_records(&model),
            "seed {seed} reopened"
        );
    }
}

/// A merge that moves some runs and rewrites others, cut short by a crash
/// at any point: the store reopens whole, at its marker, every run its
/// manifest names there and no file it does not.
#[test]
fn a_crash_anywhere_in_a_merge_that_moves_runs_recovers_whole() {
    let mut crashed = 0;
    for seed in 0..40u64 {
        let disk = SimDisk::with_seed(seed);
        let mut store = open_with(&disk, small_runs());
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut model = Model::new();
        let mut version = 0u64;
        // Layers growing in size so that a merge is due: keys in order,
        // and in the last some over the first layer's (a part to rewrite).
        for (layer, count) in [150u64, 300, 600].into_iter().enumerate() {
            for i in 0..count {
                version += 1;
                let key = if layer == 2 && i % 10 == 0 {
                    format!("k-{:06}", 1000 + rng.next_u64() % 150)
                } else {
                    format!("k-{:06}", 1000 * (layer as u64 + 1) + i)
                };
                put(
                    &mut store,
                    &mut model,
                    record(key.as_bytes(), version, false, &[1; 300]),
                );
            }
            store.freeze(version, Bytes::new());
            flush_only(&mut store);
        }
        let marker = store.durable_marker();
        let merge = store.next_job(JobLane::Merge).expect("a merge is due");
        disk.set_fault_budget(Some(rng.next_u64() % 400_000));
        let outcome = store
            .finish_job(JobLane::Merge, merge.run())
            .and_then(ManifestWrite::commit);
        match outcome {
            Ok(written) => {
                drop(store.manifest_written(written));
                let stats = store.stats();
                assert!(
                    stats.runs_moved > 0 && stats.layers == 1,
                    "seed {seed}: the merge moves runs: {stats:?}"
                );
            }
            Err(_) => crashed += 1,
        }
        disk.crash(match seed % 3 {
            0 => CrashMode::LoseUnsynced,
            1 => CrashMode::TornUnsynced,
            _ => CrashMode::KeepWritten,
        });
        drop(store);
        let (store, recovered) = VersionStore::open(disk.clone(), &dir(), small_runs()).unwrap();
        assert_eq!(recovered.marker, marker, "seed {seed}");
        assert_eq!(all(&store), model_records(&model), "seed {seed}");
        assert_eq!(
            run_files(&disk, &dir()).len(),
            store.stats().runs,
            "seed {seed}: only the runs the manifest names are left"
        );
    }
    assert!((5..40).contains(&crashed), "{crashed} of 40 merges crashed");
}
