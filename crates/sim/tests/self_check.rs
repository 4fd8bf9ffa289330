//! The checks check something: with a deliberately broken runtime, seeds
//! must fail, and with the failure kind that names the broken promise.

use ferry_sim::config::{DiskConfig, Sabotage, SimConfig};
use ferry_sim::{run_config, FailureKind};

fn first_failure(sabotage: Sabotage, seeds: u64) -> Option<(u64, ferry_sim::Failure)> {
    (0..seeds).find_map(|seed| {
        let mut config = SimConfig::random(seed, None);
        config.sabotage = sabotage;
        run_config(config).failure.map(|f| (seed, f))
    })
}

#[test]
fn acknowledging_before_sync_is_caught() {
    let (seed, failure) = first_failure(Sabotage::PersistedBeforeSync, 200)
        .expect("no seed noticed writes reported durable before their sync");
    assert_eq!(
        failure.kind,
        FailureKind::Durability,
        "seed {seed}: {failure}"
    );
}

#[test]
fn reads_without_read_index_are_caught() {
    let (seed, failure) = first_failure(Sabotage::LocalReads, 200)
        .expect("no seed noticed reads served without ReadIndex");
    assert_eq!(
        failure.kind,
        FailureKind::Linearizability,
        "seed {seed}: {failure}"
    );
}

#[test]
fn restarting_on_a_wiped_corrupt_disk_is_caught() {
    // Seeds on the real storage with frequent disk faults, so that some
    // node's disk is found corrupt.
    let failure = (0..100).find_map(|seed| {
        let mut config = SimConfig::random(seed, None);
        config.sabotage = Sabotage::RestartOnCorruptDisk;
        config.disk = DiskConfig {
            real: true,
            sync_ticks_min: 0,
            sync_ticks_max: 10,
            fault_weight: 20,
            replacements: 1,
        };
        run_config(config).failure.map(|f| (seed, f))
    });
    let (seed, failure) =
        failure.expect("no seed noticed a node restarted empty on its corrupt disk");
    assert_eq!(
        failure.kind,
        FailureKind::Durability,
        "seed {seed}: {failure}"
    );
    assert!(
        failure
            .detail
            .contains("restarted without what it had synced"),
        "seed {seed}: {failure}"
    );
}

#[test]
fn honest_runtime_passes_the_same_seeds() {
    for seed in 0..20 {
        let report = run_config(SimConfig::random(seed, None));
        assert!(
            report.failure.is_none(),
            "seed {seed}: {:?}",
            report.failure
        );
    }
}
