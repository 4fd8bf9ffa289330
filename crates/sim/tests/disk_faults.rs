//! The simulator on the real storage code: restarts bring back what was
//! synced, and a node whose log is found corrupt stays down and is replaced
//! by a new member while the cluster stays live.

use ferry_sim::config::{DiskConfig, SimConfig, TICK_US};
use ferry_sim::sim::Simulation;
use ferry_sim::{run_config, Counter};

fn real_disk_config(seed: u64, voters: usize) -> SimConfig {
    let mut config = SimConfig::quiet(seed, voters);
    config.clients = 3;
    config.disk = DiskConfig {
        real: true,
        sync_ticks_min: 1,
        sync_ticks_max: 30,
        fault_weight: 0,
        replacements: 1,
    };
    config
}

fn elect(sim: &mut Simulation) -> u64 {
    assert!(
        sim.run_until_true(300 * TICK_US, TICK_US, |s| s.leader().is_some()),
        "no leader: {:?}",
        sim.failure()
    );
    sim.leader().unwrap()
}

#[test]
fn restarts_on_the_real_storage_bring_back_what_was_synced() {
    let mut sim = Simulation::new(real_disk_config(5, 3));
    elect(&mut sim);
    // Crash every node in turn while clients write; each restart opens the
    // real storage on the crashed disk and checks what came back.
    for round in 0..6u64 {
        let victim = round % 3 + 1;
        let until = sim.now_us() + 80 * TICK_US;
        sim.run_until(until);
        sim.crash_node(victim);
        let until = sim.now_us() + 15 * TICK_US;
        sim.run_until(until);
        assert!(sim.restart_node(victim), "{:?}", sim.failure());
    }
    assert!(sim.failure().is_none(), "{:?}", sim.failure());
    assert!(sim.coverage().count(Counter::SlowSync) > 0);
    assert!(sim.run_liveness(), "{:?}", sim.failure());
    assert!(sim.history().operations.len() > 20);
}

#[test]
fn a_node_with_a_corrupt_log_stays_down_and_is_replaced() {
    let mut sim = Simulation::new(real_disk_config(11, 3));
    let leader = elect(&mut sim);
    let until = sim.now_us() + 300 * TICK_US;
    sim.run_until(until);
    assert!(sim.failure().is_none(), "{:?}", sim.failure());
    let victim = if leader == 1 { 2 } else { 1 };
    sim.crash_node(victim);
    assert!(sim.damage_log_sector(victim, 0));
    assert!(!sim.restart_node(victim), "ran on a corrupt log");
    assert!(sim.disk_lost(victim));
    assert_eq!(sim.coverage().count(Counter::CorruptFoundOnOpen), 1);
    // Removed, wiped, and a new id (the run's replacement, 3 voters + 2
    // spares + 1) added as a learner and promoted.
    assert!(
        sim.run_until_true(2_000 * TICK_US, TICK_US, |s| !s.repair_in_progress()),
        "repair did not finish: {:?}",
        sim.failure()
    );
    assert_eq!(sim.coverage().count(Counter::NodeRepaired), 1);
    let leader = sim.leader().unwrap();
    let config = sim.engine(leader).unwrap().config().clone();
    assert!(config.is_voter(6), "{config:?}");
    assert!(!config.contains(victim), "{config:?}");
    // The node never runs on its damaged disk again, and the cluster
    // converges without it.
    assert!(!sim.restart_node(victim));
    assert!(sim.run_liveness(), "{:?}", sim.failure());
    assert!(sim.engine(6).is_some());
}

#[test]
fn real_storage_seeds_pass_and_reach_their_disk_faults() {
    // A few seeds forced onto the real storage with frequent disk faults.
    let mut reached = [0u64; 4];
    for seed in 0..40 {
        let mut config = SimConfig::random(seed, None);
        config.disk = DiskConfig {
            real: true,
            sync_ticks_min: 0,
            sync_ticks_max: 40,
            fault_weight: 20,
            replacements: 1,
        };
        let report = run_config(config);
        assert!(
            report.failure.is_none(),
            "seed {seed}: {:?}",
            report.failure
        );
        for (i, counter) in [
            Counter::PowerLossMidWrite,
            Counter::FailedSync,
            Counter::CorruptFoundOnOpen,
            Counter::NodeRepaired,
        ]
        .into_iter()
        .enumerate()
        {
            reached[i] += report.coverage.count(counter);
        }
    }
    assert!(reached.iter().all(|&n| n > 0), "{reached:?}");
}
