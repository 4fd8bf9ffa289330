//! `ferry sim`: runs seeds of the simulator, replays one seed with its
//! trace, or runs a named scenario.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_sim::config::GROUPS_MAX;
use ferry_sim::scenarios::{run_scenario, ScenarioOptions};
use ferry_sim::sim::run_seed_in_groups_with;
use ferry_sim::{CoverageSummary, QuiesceMode, SeedReport};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Arguments of `ferry sim`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("mode").args(["seeds", "seed", "scenario"])))]
pub struct SimArgs {
    /// Run this many seeds (with --from, starting there).
    #[arg(long)]
    seeds: Option<u64>,
    /// The first seed of a --seeds run.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Replay one seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Run a named scenario (snapshot-requests, lost-leader-announcement,
    /// stale-snapshot-hint-zero, stale-data-directory,
    /// idle-group-leader-crash, quiescent-leader-crash,
    /// quiescent-follower-partition).
    #[arg(long)]
    scenario: Option<String>,
    /// Which seeds run with quiescence (idle groups go quiet): off (every
    /// seed exactly as before), on (every seed), or drawn (about half,
    /// drawn per seed from a generator of its own, so that the seed's
    /// other parameters are the same). With --groups, every group alike.
    #[arg(long, value_enum, default_value_t = QuiesceArg::Off)]
    quiesce: QuiesceArg,
    /// Founding voters (3, 5 or 7); drawn from each seed when absent.
    #[arg(long)]
    nodes: Option<usize>,
    /// Raft groups each simulated node hosts (1 to 64), sharing the node's
    /// log and the links between nodes; about a quarter of them get no
    /// client traffic. With 1 (the default) every seed runs as it always did.
    /// Scenarios set their own.
    #[arg(long, default_value_t = 1)]
    groups: usize,
    /// Print the trace of the replayed seed or scenario.
    #[arg(long)]
    trace: bool,
    /// Worker threads for a --seeds run (default: the available cores).
    #[arg(long)]
    jobs: Option<usize>,
    /// Scenario demonstration only: the runtime does not report links that
    /// become ready (puts seed 002's class of bug back; the
    /// lost-leader-announcement scenario must then fail).
    #[arg(long, hide = true)]
    without_peer_connected: bool,
    /// Scenario demonstration only: every snapshot report from the
    /// follower is lost (stale-snapshot-hint-zero must still recover).
    #[arg(long, hide = true)]
    drop_snapshot_reports: bool,
}

/// `--quiesce`: which seeds run with quiescence on.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuiesceArg {
    /// Every seed exactly as before quiescence existed.
    Off,
    /// Every seed with quiescence on.
    On,
    /// About half the seeds, drawn per seed.
    Drawn,
}

impl QuiesceArg {
    fn mode(self) -> QuiesceMode {
        match self {
            QuiesceArg::Off => QuiesceMode::Off,
            QuiesceArg::On => QuiesceMode::On,
            QuiesceArg::Drawn => QuiesceMode::Drawn,
        }
    }

    /// The flag as the replay command spells it (nothing for the default).
    fn flag(self) -> &'static str {
        match self {
            QuiesceArg::Off => "",
            QuiesceArg::On => " --quiesce on",
            QuiesceArg::Drawn => " --quiesce drawn",
        }
    }
}

/// Runs `ferry sim`.
pub fn run(args: SimArgs) -> ExitCode {
    if let Some(nodes) = args.nodes {
        if ![3, 5, 7].contains(&nodes) {
            eprintln!("ferry sim: --nodes must be 3, 5 or 7 (got {nodes})");
            return ExitCode::from(2);
        }
    }
    if !(1..=GROUPS_MAX).contains(&args.groups) {
        eprintln!(
            "ferry sim: --groups must be between 1 and {GROUPS_MAX} (got {})",
            args.groups
        );
        return ExitCode::from(2);
    }
    if let Some(name) = &args.scenario {
        let options = ScenarioOptions {
            trace: args.trace,
            without_peer_connected: args.without_peer_connected,
            drop_snapshot_reports: args.drop_snapshot_reports,
        };
        return scenario(name, options);
    }
    if let Some(seed) = args.seed {
        return replay(seed, args.nodes, args.groups, args.trace, args.quiesce);
    }
    let count = args.seeds.unwrap_or(100);
    sweep(
        args.from,
        count,
        args.nodes,
        args.groups,
        args.jobs,
        args.quiesce,
    )
}

fn replay_command(seed: u64, nodes: Option<usize>, groups: usize, quiesce: QuiesceArg) -> String {
    let mut command = format!("ferry sim --seed {seed}");
    if let Some(n) = nodes {
        command.push_str(&format!(" --nodes {n}"));
    }
    if groups > 1 {
        command.push_str(&format!(" --groups {groups}"));
    }
    command.push_str(quiesce.flag());
    command.push_str(" --trace");
    command
}

fn replay(
    seed: u64,
    nodes: Option<usize>,
    groups: usize,
    trace: bool,
    quiesce: QuiesceArg,
) -> ExitCode {
    install_quiet_panic_hook();
    let report = run_seed_in_groups_with(seed, nodes, groups, trace, quiesce.mode());
    let mut out = std::io::stdout().lock();
    if let Some(text) = &report.trace {
        let _ = out.write_all(text.as_bytes());
    }
    let mut summary = CoverageSummary::default();
    summary.add_seed(&report.coverage);
    // With one group the line reads as it always did.
    let groups_item = if groups > 1 {
        format!(" groups={groups}")
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "seed={seed} voters={}{groups_item} operations={} simulated_us={}",
        report.voters,
        report.operations(),
        report.end_us
    );
    let _ = writeln!(out, "coverage: {summary}");
    if groups > 1 {
        let _ = writeln!(out, "multi-group coverage: {}", summary.multi_group());
    }
    let mut config = ferry_sim::SimConfig::random(seed, nodes);
    config.apply_quiesce(quiesce.mode());
    let _ = writeln!(out, "engine: {:?}", config.engine);
    let _ = writeln!(out, "network: {:?}", config.net);
    let _ = writeln!(out, "faults: {:?}", config.faults);
    let _ = writeln!(out, "disk: {:?}", config.disk);
    if groups > 1 {
        let config = config.with_groups(groups);
        let idle: Vec<u64> = config
            .group_ids()
            .into_iter()
            .filter(|&g| config.is_idle_group(g))
            .collect();
        let _ = writeln!(
            out,
            "groups: {groups} per node, idle (no clients): {idle:?}"
        );
    }
    if report.quiesce {
        // Every group's together.
        let _ = writeln!(
            out,
            "quiescence: on, quiesce notices={} wake-ups={}",
            report.quiesce_notices, report.wake_ups
        );
    }
    match &report.failure {
        None => {
            let _ = writeln!(out, "seeds=1 passed=1 failed=0");
            ExitCode::SUCCESS
        }
        Some(failure) => {
            let _ = writeln!(out, "FAILED seed={seed}: {failure}");
            let _ = writeln!(out, "seeds=1 passed=0 failed=1");
            ExitCode::FAILURE
        }
    }
}

fn scenario(name: &str, options: ScenarioOptions) -> ExitCode {
    install_quiet_panic_hook();
    let report = match run_scenario(name, options) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("ferry sim: {e}");
            return ExitCode::from(2);
        }
    };
    let mut out = std::io::stdout().lock();
    if let Some(text) = &report.trace {
        let _ = out.write_all(text.as_bytes());
    }
    for note in &report.notes {
        let _ = writeln!(out, "{name}: {note}");
    }
    match &report.failure {
        None => {
            let _ = writeln!(out, "scenario {name}: passed");
            ExitCode::SUCCESS
        }
        Some(failure) => {
            let _ = writeln!(out, "scenario {name}: FAILED: {failure}");
            let _ = writeln!(out, "replay: ferry sim --scenario {name} --trace");
            ExitCode::FAILURE
        }
    }
}

fn sweep(
    from: u64,
    count: u64,
    nodes: Option<usize>,
    groups: usize,
    jobs: Option<usize>,
    quiesce: QuiesceArg,
) -> ExitCode {
    install_quiet_panic_hook();
    let jobs = jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, 64);
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(count), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    if let Ok(style) =
        ProgressStyle::with_template("{bar:40} {pos}/{len} seeds {per_sec} eta {eta} {msg}")
    {
        bar.set_style(style);
    }
    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let results: Arc<Mutex<Vec<(u64, SeedReport)>>> = Arc::new(Mutex::new(Vec::new()));
    let failures = Arc::new(AtomicU64::new(0));
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            let next = Arc::clone(&next);
            let results = Arc::clone(&results);
            let failures = Arc::clone(&failures);
            let bar = bar.clone();
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let seed = from.wrapping_add(i);
                let mut report =
                    run_seed_in_groups_with(seed, nodes, groups, false, quiesce.mode());
                // Keep what the summary needs; histories are large.
                report.histories.clear();
                if report.failure.is_some() {
                    let n = failures.fetch_add(1, Ordering::Relaxed) + 1;
                    bar.set_message(format!("{n} failed"));
                }
                if let Ok(mut all) = results.lock() {
                    all.push((seed, report));
                }
                bar.inc(1);
            });
        }
    });
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    let mut results = match Arc::try_unwrap(results).map(|m| m.into_inner()) {
        Ok(Ok(results)) => results,
        _ => {
            eprintln!("ferry sim: a worker thread failed; results are incomplete");
            return ExitCode::FAILURE;
        }
    };
    results.sort_by_key(|(seed, _)| *seed);
    let mut summary = CoverageSummary::default();
    let mut failed = Vec::new();
    for (seed, report) in &results {
        summary.add_seed(&report.coverage);
        if let Some(failure) = &report.failure {
            failed.push((*seed, failure.clone()));
        }
    }
    let mut out = std::io::stdout().lock();
    for (seed, failure) in &failed {
        let _ = writeln!(out, "FAILED seed={seed}: {failure}");
        let _ = writeln!(
            out,
            "  replay: {}",
            replay_command(*seed, nodes, groups, quiesce)
        );
    }
    let passed = results.len() as u64 - failed.len() as u64;
    // How many election timeouts convergence took once the faults stopped.
    let mut timeouts: Vec<f64> = results
        .iter()
        .filter_map(|(_, r)| {
            r.converged_after_us
                .map(|us| us as f64 / r.election_timeout_us.max(1) as f64)
        })
        .collect();
    timeouts.sort_by(f64::total_cmp);
    if let Some(&worst) = timeouts.last() {
        let median = timeouts[timeouts.len() / 2];
        let p99 = timeouts[(timeouts.len() * 99 / 100).min(timeouts.len() - 1)];
        let _ = writeln!(
            out,
            "liveness: converged after median={median:.1} p99={p99:.1} max={worst:.1} election timeouts"
        );
    }
    let seconds = elapsed.as_secs_f64();
    let _ = writeln!(
        out,
        "wall={seconds:.1}s seeds_per_second={:.1} jobs={jobs}",
        results.len() as f64 / seconds.max(1e-9)
    );
    let _ = writeln!(out, "coverage (seeds/events): {summary}");
    if quiesce != QuiesceArg::Off {
        // Printed only with quiescence asked for, so that the default
        // sweep's output stays what it was; every group's together.
        let on = results.iter().filter(|(_, r)| r.quiesce).count();
        let quiet = results
            .iter()
            .filter(|(_, r)| r.quiesce_notices > 0)
            .count();
        let notices: u64 = results.iter().map(|(_, r)| r.quiesce_notices).sum();
        let wake_ups: u64 = results.iter().map(|(_, r)| r.wake_ups).sum();
        let _ = writeln!(
            out,
            "quiescence: on in {on} seeds, a group went quiet in {quiet}; quiesce notices={notices} wake-ups={wake_ups}"
        );
    }
    let mut gaps = summary.gaps();
    if groups > 1 {
        let _ = writeln!(
            out,
            "multi-group coverage (seeds/events): {}",
            summary.multi_group()
        );
        gaps.extend(summary.multi_group_gaps());
    }
    if !gaps.is_empty() {
        let names: Vec<&str> = gaps.iter().map(|c| c.label()).collect();
        let _ = writeln!(
            out,
            "coverage gaps (no seed exercised): {}",
            names.join(" ")
        );
    }
    let groups_item = if groups > 1 {
        format!("groups={groups} ")
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "{groups_item}seeds={} passed={passed} failed={}",
        results.len(),
        failed.len()
    );
    if failed.is_empty() && results.len() as u64 == count {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Panics inside a seed are caught and reported as that seed's failure;
/// the default hook would also spray them over the progress bar.
fn install_quiet_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        ferry_sim::sim::record_panic(info.to_string());
    }));
}
