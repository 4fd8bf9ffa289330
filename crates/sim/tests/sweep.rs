//! A sweep of random seeds with every fault on: each must keep safety,
//! produce a linearizable history and converge once the faults stop. The
//! sweep must also reach the situations it exists for.

use ferry_sim::{run_seed, Counter, CoverageSummary};

const SEEDS: u64 = 600;

#[test]
fn random_seeds_with_all_faults() {
    let mut summary = CoverageSummary::default();
    let mut failures = Vec::new();
    for seed in 0..SEEDS {
        let report = run_seed(seed, None, false);
        summary.add_seed(&report.coverage);
        if let Some(failure) = report.failure {
            failures.push(format!(
                "seed {seed}: {failure} (replay: ferry sim --seed {seed} --trace)"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {SEEDS} seeds failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Every fault and edge the simulator injects was reached by some seed.
    for &counter in Counter::ALL {
        assert!(
            summary.seeds_with(counter) > 0,
            "no seed exercised {}: {summary}",
            counter.label()
        );
    }
}

#[test]
fn every_cluster_size_runs() {
    for voters in [3, 5, 7] {
        for seed in 0..20 {
            let report = run_seed(seed, Some(voters), false);
            assert_eq!(report.voters, voters);
            assert!(
                report.failure.is_none(),
                "voters={voters} seed={seed}: {:?}",
                report.failure
            );
        }
    }
}
