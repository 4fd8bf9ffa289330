//! `ferry nemesis`: a fault test of real `ferry serve` processes.
//!
//! It builds a test bed of its own (`testbed`: a network namespace per
//! member on a bridge, a small ext4 file system per member's data
//! directory), starts a cluster on it, runs clients against it
//! (`workload`: registers read, put and compared-and-set, watchers, leases)
//! while a nemesis drawn from the seed partitions, pauses, kills, fills
//! and stalls members (`faults`), then heals everything, waits for the
//! cluster to answer again, reads every key through every member, lets the
//! watchers catch up, compares the members' hashes, and checks what the
//! clients saw (`check`): linearizability of the registers, the watch
//! guarantees, the lease guarantee. The last line printed is a summary
//! with `verdict=linearizable` when every check passed.
//!
//! The run needs root, `ip`, `iptables`, `mkfs.ext4`, `fallocate` and
//! `fsfreeze`; without one it stops with the reason (exit status 2): it
//! never passes without its faults. The test bed's addresses exist only
//! inside the namespaces it creates: the process re-executes itself in the
//! run's own namespace (where the bridge and the clients are), and
//! removes every namespace when it ends.
//!
//! Exit status: 0 when every check passed, 1 when one failed (the run's
//! directory, with each member's log, the history and the data, is kept
//! and printed with the command that reruns the seed), 2 when the run
//! could not be made.

pub mod check;
mod faults;
pub mod history;
mod members;
mod testbed;
mod workload;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_sim::lincheck::{CheckOptions, Verdict};
use tokio::sync::watch;

use faults::{FaultKind, Nemesis, NemesisReport};
use history::{Header, Record, Recorder, FORMAT, LEASE_PREFIX, VERSION};
use members::{MemberOptions, Members};
use testbed::Testbed;
use workload::{Clients, WatchTarget};

/// How long the cluster has to elect its first leader.
const FIRST_LEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long, once faults stop, every member has to answer a linearizable
/// read (the liveness check).
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a watcher has to catch up to the final revision.
const WATCH_CATCH_UP_TIMEOUT: Duration = Duration::from_secs(30);
/// Process numbers of the reads after the faults (plus the member id).
const FINAL_READ_PROCESS: u64 = 800_000;
/// Lease clients' process numbers start here.
const LEASE_PROCESS: u64 = 1_000;
/// The most members a run may have.
const MEMBERS_MAX: u64 = 9;

/// Arguments of `ferry nemesis`.
#[derive(clap::Args, Debug, Clone)]
pub struct NemesisArgs {
    /// How long to apply faults, in seconds (the run takes about 20 s more:
    /// the start, the recovery, the final reads and the checks).
    #[arg(long, default_value_t = 30, value_name = "S")]
    pub secs: u64,
    /// The seed faults and operations are drawn from.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub seed: u64,
    /// Members of the cluster.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub members: u64,
    /// Register clients.
    #[arg(long, default_value_t = 6, value_name = "N")]
    pub clients: u64,
    /// Register operations per second, over all register clients (each
    /// pauses a random time before each operation; 0: no pauses).
    #[arg(long, default_value_t = 500, value_name = "N")]
    pub rate: u64,
    /// Registers (keys `r/0` ...).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub keys: u64,
    /// Watchers.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub watchers: u64,
    /// Lease clients.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub lease_clients: u64,
    /// The faults to draw from, comma separated. [default: all]
    #[arg(long, value_enum, value_delimiter = ',', value_name = "KINDS")]
    pub faults: Vec<FaultKind>,
    /// Read the registers with serializable reads, which may be stale: the
    /// negative control, which must come out NOT-linearizable under
    /// partitions.
    #[arg(long)]
    pub serializable_reads: bool,
    /// The members' Raft tick (`ferry serve --tick-ms`).
    #[arg(long, default_value_t = 50, value_name = "MS")]
    pub tick_ms: u64,
    /// The size of each member's file system.
    #[arg(long, default_value_t = 512 * 1024 * 1024, value_name = "BYTES")]
    pub disk_bytes: u64,
    /// The run's directory (logs, history, file system images). [default:
    /// a new one under the system's temporary directory]
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Keep the run's directory also when every check passed.
    #[arg(long)]
    pub keep: bool,
    /// Only check a history saved by an earlier run, and print its summary.
    #[arg(long, value_name = "FILE")]
    pub check: Option<PathBuf>,
    /// The `ferry` binary the members run. [default: this one]
    #[arg(long, value_name = "FILE")]
    pub ferry_binary: Option<PathBuf>,
    /// Internal: set when the process runs inside the run's namespace,
    /// with the run's id.
    #[arg(long, hide = true, value_name = "ID")]
    pub inside: Option<String>,
}

/// Why a run could not be made.
#[derive(Debug, thiserror::Error)]
enum SetupError {
    #[error("{0}")]
    Invalid(String),
    #[error("cannot apply faults on this machine: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Testbed(#[from] testbed::TestbedError),
    #[error("{0}")]
    Other(String),
}

/// Runs `ferry nemesis`.
pub fn run(mut args: NemesisArgs) -> ExitCode {
    if args.faults.is_empty() {
        args.faults = FaultKind::ALL.to_vec();
    }
    if let Some(file) = &args.check {
        return check_saved(file);
    }
    if let Err(error) = validate(&args) {
        eprintln!("ferry nemesis: {error}");
        println!("nemesis seed={} verdict=error", args.seed);
        return ExitCode::from(2);
    }
    match args.inside.clone() {
        None => run_outside(&args),
        Some(run_id) => run_inside(&args, &run_id),
    }
}

fn validate(args: &NemesisArgs) -> Result<(), SetupError> {
    let bad = |text: &str| Err(SetupError::Invalid(text.to_string()));
    if !(1..=MEMBERS_MAX).contains(&args.members) {
        return bad("--members must be 1 to 9");
    }
    if args.members < 3
        && args
            .faults
            .iter()
            .any(|f| *f != FaultKind::Pause && *f != FaultKind::Kill)
    {
        return bad("network faults need at least 3 members");
    }
    if args.secs == 0 || args.secs > 24 * 3600 {
        return bad("--secs must be 1 to 86400");
    }
    if args.clients == 0 || args.clients > 256 || args.keys == 0 || args.keys > 1024 {
        return bad("--clients must be 1 to 256 and --keys 1 to 1024");
    }
    if args.watchers > 64 || args.lease_clients > 64 {
        return bad("--watchers and --lease-clients must be at most 64");
    }
    if args.tick_ms == 0 || args.disk_bytes < 64 * 1024 * 1024 {
        return bad("--tick-ms must be positive and --disk-bytes at least 64 MiB");
    }
    Ok(())
}

/// Root, and every program the test bed runs.
fn preflight() -> Result<(), SetupError> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find(|line| line.starts_with("Uid:"))
        .and_then(|line| line.split_whitespace().nth(2))
        == Some("0");
    if !root {
        return Err(SetupError::Unsupported(
            "it must run as root (it creates network namespaces, iptables rules and file systems)"
                .into(),
        ));
    }
    let missing: Vec<String> = testbed::PROGRAMS
        .iter()
        .filter(|(program, _)| !testbed::have_program(program))
        .map(|(program, package)| format!("{program} (Debian package {package})"))
        .collect();
    if !missing.is_empty() {
        return Err(SetupError::Unsupported(format!(
            "missing {}",
            missing.join(", ")
        )));
    }
    Ok(())
}

/// The process the user started: checks the machine, creates the run's
/// namespace, runs the test inside it, and removes every namespace after.
fn run_outside(args: &NemesisArgs) -> ExitCode {
    if let Err(error) = preflight() {
        eprintln!("ferry nemesis: {error}");
        println!("nemesis seed={} verdict=error", args.seed);
        return ExitCode::from(2);
    }
    let run_id = std::process::id().to_string();
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("ferry-nemesis-{}-{run_id}", args.seed))
    });
    let setup = || -> Result<PathBuf, SetupError> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| SetupError::Other(format!("{}: {e}", dir.display())))?;
        let exe = std::env::current_exe()
            .map_err(|e| SetupError::Other(format!("cannot find this program: {e}")))?;
        testbed::run("ip", &["netns", "add", &testbed::hub_namespace(&run_id)])
            .map_err(|e| SetupError::Unsupported(e.to_string()))?;
        Ok(exe)
    };
    let exe = match setup() {
        Ok(exe) => exe,
        Err(error) => {
            eprintln!("ferry nemesis: {error}");
            println!("nemesis seed={} verdict=error", args.seed);
            remove_namespaces(&run_id, args.members);
            return ExitCode::from(2);
        }
    };
    let mut forwarded: Vec<String> = std::env::args().skip(1).collect();
    if args.dir.is_none() {
        forwarded.push("--dir".into());
        forwarded.push(dir.to_string_lossy().into_owned());
    }
    forwarded.extend(["--inside".to_string(), run_id.clone()]);
    let status = Command::new("ip")
        .args(["netns", "exec", &testbed::hub_namespace(&run_id)])
        .arg(&exe)
        .args(&forwarded)
        .status();
    remove_namespaces(&run_id, args.members);
    match status {
        Ok(status) => ExitCode::from(status.code().map_or(2, |code| code.clamp(0, 255) as u8)),
        Err(error) => {
            eprintln!("ferry nemesis: cannot run inside the namespace: {error}");
            ExitCode::from(2)
        }
    }
}

/// Kills whatever still runs in the run's namespaces and removes them
/// (after a run that ended badly; a clean run has removed the members'
/// own already).
fn remove_namespaces(run_id: &str, members: u64) {
    let names = (1..=members)
        .map(|id| testbed::member_namespace(run_id, id))
        .chain(std::iter::once(testbed::hub_namespace(run_id)));
    for name in names {
        if let Ok(pids) = testbed::run("ip", &["netns", "pids", &name]) {
            for pid in pids.split_whitespace() {
                let _ = testbed::run("kill", &["-KILL", pid]);
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The test, inside the run's namespace.
fn run_inside(args: &NemesisArgs, run_id: &str) -> ExitCode {
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let rerun = rerun_command(args);
    match run_test(args, run_id, &dir) {
        Err(error) => {
            eprintln!("ferry nemesis: {error}");
            eprintln!(
                "ferry nemesis: rerun with: {rerun}; the run's files are in {}",
                dir.display()
            );
            println!("nemesis seed={} verdict=error", args.seed);
            ExitCode::from(2)
        }
        Ok(outcome) => {
            let passed = outcome.passed();
            for line in outcome.explanation() {
                eprintln!("ferry nemesis: {line}");
            }
            if passed && !args.keep {
                let _ = std::fs::remove_dir_all(&dir);
            } else {
                eprintln!(
                    "ferry nemesis: the run's files (member logs, history.jsonl, data) are in {}",
                    dir.display()
                );
            }
            if !passed {
                eprintln!("ferry nemesis: rerun with: {rerun}");
            }
            println!("{}", outcome.summary(args));
            if passed {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn rerun_command(args: &NemesisArgs) -> String {
    let mut command = format!(
        "ferry nemesis --secs {} --seed {} --members {}",
        args.secs, args.seed, args.members
    );
    if args.serializable_reads {
        command.push_str(" --serializable-reads");
    }
    if args.faults.len() != FaultKind::ALL.len() {
        let names: Vec<&str> = args.faults.iter().map(|f| f.name()).collect();
        command.push_str(&format!(" --faults {}", names.join(",")));
    }
    command
}

/// What a run found, beyond the history's own checks.
struct RunOutcome {
    report: check::CheckReport,
    nemesis: NemesisReport,
    /// Members that did not answer a linearizable read once faults stopped.
    not_live: Vec<u64>,
    /// Watchers that did not catch up to the final revision.
    watchers_behind: Vec<workload::WatcherEnd>,
    /// The members' HashKV at the final revision, when they disagree or
    /// some did not answer.
    hashes: Result<(), String>,
    /// Members that did not stop cleanly on SIGTERM at the end.
    unclean_stops: Vec<members::Crash>,
    final_revision: i64,
}

impl RunOutcome {
    fn passed(&self) -> bool {
        self.report.passed()
            && self.nemesis.crashes.is_empty()
            && self.nemesis.error.is_none()
            && self.not_live.is_empty()
            && self.watchers_behind.is_empty()
            && self.hashes.is_ok()
            && self.unclean_stops.is_empty()
    }

    fn explanation(&self) -> Vec<String> {
        let mut lines = Vec::new();
        match &self.report.registers {
            Ok(Verdict::Linearizable) => {}
            Ok(verdict) => lines.push(format!("registers: {verdict}")),
            Err(error) => lines.push(format!("registers: {error}")),
        }
        for violation in self.report.watch.violations.iter().take(20) {
            lines.push(format!("watch: {violation}"));
        }
        for violation in self.report.leases.violations.iter().take(20) {
            lines.push(format!("leases: {violation}"));
        }
        for crash in &self.nemesis.crashes {
            lines.push(format!(
                "member {} exited by itself: {}",
                crash.id, crash.status
            ));
        }
        if let Some(error) = &self.nemesis.error {
            lines.push(format!("the nemesis failed: {error}"));
        }
        for id in &self.not_live {
            lines.push(format!(
                "member {id} did not answer a linearizable read within {} s after the faults stopped",
                RECOVERY_TIMEOUT.as_secs()
            ));
        }
        for end in &self.watchers_behind {
            lines.push(format!(
                "watcher {} reached only revision {} of {} within {} s",
                end.watcher,
                end.covered_revision,
                self.final_revision,
                WATCH_CATCH_UP_TIMEOUT.as_secs()
            ));
        }
        if let Err(error) = &self.hashes {
            lines.push(format!("hashes: {error}"));
        }
        for crash in &self.unclean_stops {
            lines.push(format!(
                "member {} did not stop cleanly: {}",
                crash.id, crash.status
            ));
        }
        lines
    }

    fn verdict(&self) -> &'static str {
        if self.passed() {
            "linearizable"
        } else if matches!(
            self.report.registers,
            Ok(Verdict::NotLinearizable(_)) | Err(_)
        ) {
            "NOT-linearizable"
        } else if matches!(self.report.registers, Ok(Verdict::Undecided { .. })) {
            "undecided"
        } else {
            "FAILED"
        }
    }

    fn summary(&self, args: &NemesisArgs) -> String {
        let counts = &self.report.counts;
        let faults: Vec<String> = self
            .nemesis
            .applied
            .iter()
            .map(|(kind, n)| format!("{kind}:{n}"))
            .collect();
        let kinds: Vec<String> = counts
            .by_kind
            .iter()
            .map(|(kind, n)| format!("{kind}:{n}"))
            .collect();
        format!(
            "nemesis seed={} secs={} members={} rate={} ops={} ok={} fail={} unknown={} by_kind={} faults={} at_leader={} crashes={} watch_events={} watch_resumes={} progress={} leases={} lease_reads_after_end={} final_revision={} kv={} watch={} leases_check={} live={} hashes={} verdict={}",
            args.seed,
            args.secs,
            args.members,
            args.rate,
            counts.ok + counts.fail + counts.unknown,
            counts.ok,
            counts.fail,
            counts.unknown,
            kinds.join(","),
            if faults.is_empty() { "none".to_string() } else { faults.join(",") },
            self.nemesis.at_leader,
            self.nemesis.crashes.len(),
            self.report.watch.events,
            self.report.watch.resumes,
            self.report.watch.progress_notifications,
            self.report.leases.granted,
            self.report.leases.reads_after_end,
            self.final_revision,
            self.report.registers_word(),
            if self.report.watch.violations.is_empty() { "ok" } else { "VIOLATED" },
            if self.report.leases.violations.is_empty() { "ok" } else { "VIOLATED" },
            if self.not_live.is_empty() && self.watchers_behind.is_empty() { "ok" } else { "STALLED" },
            if self.hashes.is_ok() { "agree" } else { "DIFFER" },
            self.verdict(),
        )
    }
}

fn run_test(args: &NemesisArgs, run_id: &str, dir: &Path) -> Result<RunOutcome, SetupError> {
    let binary = match &args.ferry_binary {
        Some(binary) => binary.clone(),
        None => std::env::current_exe()
            .map_err(|e| SetupError::Other(format!("cannot find this program: {e}")))?,
    };
    eprintln!(
        "ferry nemesis: seed {}, {} s of faults ({}), {} members; files in {}",
        args.seed,
        args.secs,
        args.faults
            .iter()
            .map(|f| f.name())
            .collect::<Vec<_>>()
            .join(","),
        args.members,
        dir.display()
    );
    let testbed = Testbed::build(run_id, args.members, dir, args.disk_bytes)?;
    let member_options = MemberOptions {
        binary,
        tick_ms: args.tick_ms,
        disk_reserve_bytes: 16 * 1024 * 1024,
    };
    let members = Members::new(member_options, args.members, &testbed, dir);
    let members = Arc::new(Mutex::new(members));
    let testbed = Arc::new(Mutex::new(testbed));
    for id in 1..=args.members {
        lock(&members).start(id)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| SetupError::Other(format!("cannot start the async runtime: {e}")))?;
    let recorder = Recorder::new(Header {
        format: FORMAT.into(),
        version: VERSION,
        seed: args.seed,
        secs: args.secs,
        members: args.members,
        serializable_reads: args.serializable_reads,
    });
    let channels = {
        let _guard = runtime.enter();
        workload::channels(args.members).map_err(SetupError::Other)?
    };
    let (stop_sender, stop) = watch::channel(false);
    let clients = Clients {
        channels: Arc::new(channels),
        recorder: recorder.clone(),
        stop,
    };

    // The first leader.
    let started = Instant::now();
    while runtime.block_on(workload::leader(&clients)).is_none() {
        if started.elapsed() > FIRST_LEADER_TIMEOUT {
            let tails: Vec<String> = (1..=args.members)
                .map(|id| format!("member {id}:\n{}", lock(&members).log_tail(id, 10)))
                .collect();
            return Err(SetupError::Other(format!(
                "no leader within {} s of the start; the members' logs end:\n{}",
                FIRST_LEADER_TIMEOUT.as_secs(),
                tails.join("\n")
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    // The clients.
    let pause_mean = match args.rate {
        0 => Duration::ZERO,
        rate => Duration::from_micros(args.clients.saturating_mul(1_000_000) / rate),
    };
    let mut client_tasks = Vec::new();
    for process in 1..=args.clients {
        client_tasks.push(runtime.spawn(workload::register_client(
            clients.clone(),
            process,
            args.seed,
            args.keys,
            args.serializable_reads,
            pause_mean,
        )));
    }
    for n in 0..args.lease_clients {
        client_tasks.push(runtime.spawn(workload::lease_client(
            clients.clone(),
            LEASE_PROCESS + n,
            args.seed,
        )));
    }
    let (target_sender, target) = watch::channel(WatchTarget::Running);
    let watcher_tasks: Vec<_> = (1..=args.watchers)
        .map(|watcher| {
            runtime.spawn(workload::watcher(
                clients.clone(),
                watcher,
                args.seed,
                target.clone(),
                WATCH_CATCH_UP_TIMEOUT,
            ))
        })
        .collect();

    // The faults, on their own thread (they run commands and wait).
    let nemesis = Nemesis {
        members: members.clone(),
        testbed: testbed.clone(),
        clients: clients.clone(),
        runtime: runtime.handle().clone(),
        recorder: recorder.clone(),
        kinds: args.faults.clone(),
        seed: args.seed,
        duration: Duration::from_secs(args.secs),
    };
    let nemesis = Arc::new(nemesis);
    let nemesis_thread = {
        let nemesis = nemesis.clone();
        std::thread::spawn(move || nemesis.run())
    };
    let faults_started = Instant::now();
    while !nemesis_thread.is_finished() {
        std::thread::sleep(Duration::from_millis(200));
        let elapsed = faults_started.elapsed().as_secs();
        if elapsed > 0 && elapsed % 10 == 0 && faults_started.elapsed().subsec_millis() < 200 {
            let records = recorder.records();
            let ops = records
                .iter()
                .filter(|r| matches!(r, Record::Op(_)))
                .count();
            let faults = records
                .iter()
                .filter(|r| matches!(r, Record::Fault(f) if !f.heal))
                .count();
            eprintln!("ferry nemesis: {elapsed} s: {ops} operations, {faults} faults");
        }
    }
    let nemesis_report = nemesis_thread.join().unwrap_or_else(|_| NemesisReport {
        error: Some("the nemesis thread panicked".into()),
        ..NemesisReport::default()
    });
    eprintln!("ferry nemesis: faults over; waiting for the clients to finish");
    let _ = stop_sender.send(true);
    for task in client_tasks {
        let _ = runtime.block_on(task);
    }

    // Liveness: every member answers a linearizable read.
    let mut not_live = Vec::new();
    let recovery_deadline = Instant::now() + RECOVERY_TIMEOUT;
    for member in 1..=args.members {
        loop {
            let read = runtime.block_on(workload::get(
                &clients,
                FINAL_READ_PROCESS + member,
                member,
                &workload::register_key(0),
                false,
            ));
            if read.is_ok() {
                break;
            }
            if Instant::now() >= recovery_deadline {
                not_live.push(member);
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    nemesis.disarm_alarms(Duration::from_secs(10));

    // Every key through every member.
    let lease_keys: std::collections::BTreeSet<String> = recorder
        .records()
        .iter()
        .filter_map(|record| match record {
            Record::Op(op) => match &op.op {
                history::Op::Put { key, .. } if key.starts_with(LEASE_PREFIX) => Some(key.clone()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    let mut final_revision = 0;
    for member in (1..=args.members).filter(|m| !not_live.contains(m)) {
        let keys = (0..args.keys)
            .map(workload::register_key)
            .chain(lease_keys.iter().cloned());
        for key in keys {
            let _ = runtime.block_on(workload::get(
                &clients,
                FINAL_READ_PROCESS + member,
                member,
                &key,
                false,
            ));
        }
    }
    for record in recorder.records() {
        if let Record::Op(op) = record {
            if op.process > FINAL_READ_PROCESS {
                final_revision = final_revision.max(op.revision.unwrap_or(0));
            }
        }
    }

    // The watchers catch up to it.
    eprintln!("ferry nemesis: final revision {final_revision}; waiting for the watchers");
    let _ = target_sender.send(WatchTarget::CatchUpTo(final_revision));
    let mut watchers_behind = Vec::new();
    for task in watcher_tasks {
        if let Ok(end) = runtime.block_on(task) {
            if !end.caught_up {
                watchers_behind.push(end);
            }
        }
    }

    // Every member's hash of the same revision.
    let hashes = compare_hashes(&runtime, &clients, args.members, final_revision);

    let unclean_stops = lock(&members).stop_all();
    drop(runtime);
    lock(&testbed).teardown();
    let records = recorder.records();
    let history_path = dir.join("history.jsonl");
    if let Err(error) =
        std::fs::File::create(&history_path).and_then(|file| history::write(&records, file))
    {
        eprintln!(
            "ferry nemesis: cannot write {}: {error}",
            history_path.display()
        );
    }
    eprintln!("ferry nemesis: checking {} records", records.len());
    let report = check::check(&records, CheckOptions::default());
    Ok(RunOutcome {
        report,
        nemesis: nemesis_report,
        not_live,
        watchers_behind,
        hashes,
        unclean_stops,
        final_revision,
    })
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether every member's HashKV at `revision` is the same (members
/// that have not applied it yet are asked again for up to 10 s).
fn compare_hashes(
    runtime: &tokio::runtime::Runtime,
    clients: &Clients,
    members: u64,
    revision: i64,
) -> Result<(), String> {
    if revision == 0 {
        return Err("no final revision: no member answered the final reads".into());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut hashes = Vec::new();
    for member in 1..=members {
        loop {
            if let Some(hash) = runtime.block_on(workload::hash_kv(clients, member, revision)) {
                hashes.push((member, hash));
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "member {member} gave no HashKV at revision {revision}"
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    if hashes.iter().all(|(_, hash)| *hash == hashes[0].1) {
        Ok(())
    } else {
        Err(format!("HashKV at revision {revision} differs: {hashes:?}"))
    }
}

/// `ferry nemesis --check FILE`: every check on a saved history.
fn check_saved(file: &Path) -> ExitCode {
    let records = match std::fs::File::open(file)
        .map_err(history::ReadError::Io)
        .and_then(|f| history::read(std::io::BufReader::new(f)))
    {
        Ok(records) => records,
        Err(error) => {
            eprintln!("ferry nemesis: {}: {error}", file.display());
            return ExitCode::from(2);
        }
    };
    let report = check::check(&records, CheckOptions::default());
    match &report.registers {
        Ok(verdict) => println!("registers: {verdict}"),
        Err(error) => println!("registers: {error}"),
    }
    for violation in &report.watch.violations {
        println!("watch: {violation}");
    }
    for violation in &report.leases.violations {
        println!("leases: {violation}");
    }
    println!(
        "history={} ops={} watch_events={} kv={} watch={} leases_check={} verdict={}",
        file.display(),
        report.counts.ok + report.counts.fail + report.counts.unknown,
        report.watch.events,
        report.registers_word(),
        if report.watch.violations.is_empty() {
            "ok"
        } else {
            "VIOLATED"
        },
        if report.leases.violations.is_empty() {
            "ok"
        } else {
            "VIOLATED"
        },
        if report.passed() {
            "linearizable"
        } else {
            report.registers_word()
        },
    );
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
