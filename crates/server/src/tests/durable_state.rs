//! The key-value state on disk: checkpoints flushed and merged by the
//! store's jobs, a crash at any point (of the applies or of a job), and a
//! reopen that stands at the last durable point and, with the log after it
//! applied again, is the state of a member that never crashed.

use std::path::PathBuf;

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::helpers::*;
use crate::command::encode_command;
use crate::kv_state::{KvLimits, KvState};
use crate::pb::ferrypb::Command;
use ferry_storage::versions::JobLane;
use ferry_storage::{AnyDisk, CrashMode, SimDisk};

fn dir() -> PathBuf {
    PathBuf::from("/data/kv")
}

/// A command of a random workload: puts (some on leases), deletes,
/// compactions, lease grants and revokes.
fn random_command(rng: &mut ChaCha8Rng, revision: i64) -> Command {
    let key = format!("k{}", rng.next_u64() % 50);
    let value = "v".repeat((rng.next_u64() % 2000) as usize);
    match rng.next_u64() % 20 {
        0..=10 => put_cmd(&key, &value),
        11..=12 => put_lease_cmd(&key, &value, 1 + (rng.next_u64() % 3) as i64),
        13..=14 => delete_cmd(&key, ""),
        15 => delete_cmd("k1", "k3"),
        16 => compact_cmd((revision - 20).max(1)),
        17..=18 => grant_cmd(1 + (rng.next_u64() % 3) as i64, 60),
        _ => revoke_cmd(1 + (rng.next_u64() % 3) as i64),
    }
}

#[test]
fn a_reopened_state_replays_the_log_from_its_durable_point_to_the_same_state() {
    for seed in 0..12u64 {
        let disk = SimDisk::with_seed(seed);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut durable =
            KvState::open(AnyDisk::Sim(disk.clone()), &dir(), KvLimits::default()).unwrap();
        // The same log applied by a member that never crashes.
        let mut reference = KvState::new(KvLimits::default());
        let mut log: Vec<Vec<u8>> = Vec::new();
        for index in 1..=800u64 {
            let command = random_command(&mut rng, reference.store().revision());
            let bytes = encode_command(&command);
            let a = reference.apply_bytes(index, &bytes).response;
            let b = durable.apply_bytes(index, &bytes).response;
            assert_eq!(a, b, "seed {seed} index {index}");
            log.push(bytes);
            if rng.next_u64() % 40 == 0 {
                durable.checkpoint();
                run_store_jobs(&mut durable);
            }
        }
        assert!(
            durable.durable_index() > 0,
            "seed {seed}: something was flushed"
        );
        // The last checkpoint flushed half-way: the power goes during it.
        durable.checkpoint();
        let before = durable.durable_index();
        disk.set_fault_budget(Some(rng.next_u64() % 400_000));
        if let Some(job) = durable.next_store_job(JobLane::Flush) {
            let done = job.run();
            if let Ok(write) = durable.finish_store_job(JobLane::Flush, done) {
                if let Ok(written) = write.commit() {
                    durable.store_manifest_written(written);
                }
            }
        }
        disk.crash(match seed % 3 {
            0 => CrashMode::LoseUnsynced,
            1 => CrashMode::TornUnsynced,
            _ => CrashMode::KeepWritten,
        });
        drop(durable);
        let mut reopened =
            KvState::open(AnyDisk::Sim(disk.clone()), &dir(), KvLimits::default()).unwrap();
        let at = reopened.applied_index();
        assert!(at >= before && at <= 800, "seed {seed}: reopened at {at}");
        assert_eq!(reopened.durable_index(), at);
        for (position, bytes) in log.iter().enumerate().skip(at as usize) {
            reopened.apply_bytes(position as u64 + 1, bytes);
        }
        assert_eq!(
            reopened.snapshot().unwrap(),
            reference.snapshot().unwrap(),
            "seed {seed}: reopened at {at}"
        );
        assert_eq!(
            reopened.store().hash_kv(0).unwrap(),
            reference.store().hash_kv(0).unwrap()
        );
    }
}

#[test]
fn a_new_directory_is_an_empty_state_and_a_damaged_store_is_refused() {
    let disk = SimDisk::with_seed(7);
    let state = KvState::open(AnyDisk::Sim(disk.clone()), &dir(), KvLimits::default()).unwrap();
    assert_eq!(state.applied_index(), 0);
    assert_eq!(state.store().revision(), 1);
    assert_eq!(
        state.snapshot().unwrap(),
        KvState::new(KvLimits::default()).snapshot().unwrap()
    );
    drop(state);
    let mut state = KvState::open(AnyDisk::Sim(disk.clone()), &dir(), KvLimits::default()).unwrap();
    for index in 1..=50 {
        state.apply_bytes(index, &encode_command(&put_cmd(&format!("k{index}"), "v")));
    }
    state.checkpoint();
    run_store_jobs(&mut state);
    drop(state);
    assert!(disk.corrupt_byte(&dir().join("MANIFEST"), 12));
    assert!(KvState::open(AnyDisk::Sim(disk), &dir(), KvLimits::default()).is_err());
}

/// A store that cannot be read (a damaged block of a run) fails the apply
/// with a storage error and leaves the command unapplied (index, revision
/// and keys as before), so that the member stops instead of skipping a
/// write the others make.
#[test]
fn a_command_the_store_cannot_read_for_is_left_unapplied() {
    use ferry_storage::Disk;
    let disk = SimDisk::with_seed(9);
    let mut state = KvState::open(AnyDisk::Sim(disk.clone()), &dir(), KvLimits::default()).unwrap();
    for index in 1..=50 {
        state.apply_bytes(index, &encode_command(&put_cmd(&format!("k{index}"), "v")));
    }
    state.checkpoint();
    run_store_jobs(&mut state);
    let runs: Vec<String> = disk
        .list_files(&dir())
        .unwrap()
        .into_iter()
        .filter(|name| name.starts_with("run-"))
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    // A byte in the first block: every key is in it.
    assert!(disk.corrupt_byte(&dir().join(&runs[0]), 40));
    let revision = state.store().revision();
    // A put reads the key's previous version (its create revision).
    let applied = state.apply_bytes(51, &encode_command(&put_cmd("k7", "new")));
    assert!(
        matches!(applied.response, Err(crate::error::KvError::Storage(_))),
        "{:?}",
        applied.response
    );
    assert!(applied.events.is_empty());
    assert_eq!(state.applied_index(), 50);
    assert_eq!(state.store().revision(), revision);
}
