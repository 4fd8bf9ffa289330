//! A replicated counter run as many Raft groups across three local
//! processes: the example an embedder copies.
//!
//! ```text
//! cargo run --release -p ferry-runtime --example counter
//! cargo run --release -p ferry-runtime --example counter -- --groups 1000 --rounds 20
//! cargo run --release -p ferry-runtime --example counter -- --groups 10000 --rounds 0 --idle-seconds 30
//! ```
//!
//! Run without `--node`, it starts three copies of itself (nodes 1, 2 and
//! 3, each with its own data directory and peer port), waits for them and
//! prints what they measured. Each node starts every group, then adds 1 to
//! every group `--rounds` times through its own handles (a node that does
//! not lead a group forwards to the leader), then reads every counter
//! linearizably: every node must see `3 × rounds` in each. With
//! `--idle-seconds S` the nodes then sit idle for S seconds and report the
//! CPU they used meanwhile (from /proc/self/stat) and the memory they hold
//! (from /proc/self/status). With COUNTER_PROGRESS=1
//! in the environment each node prints, while its groups elect, how many
//! have a leader, and after 10 s what the leaderless ones look like;
//! COUNTER_NO_QUIESCE=1 turns the engine's quiescence off, for comparison.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::{Command as Process, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_runtime::{
    ApplyError, BytesSnapshot, Command, GroupHandle, HostConfig, Membership, NodeHost,
    ReadConsistency, RestoreError, SnapshotSource, StateMachine,
};

/// The replicated state: one counter.
#[derive(Default)]
struct Counter(u64);

impl StateMachine for Counter {
    type Response = u64;
    type Query = ();
    type QueryResponse = u64;

    /// A command is a little-endian amount to add; anything else adds 0
    /// (applying must never fail or panic: every member applies it).
    fn apply(&mut self, command: Command<'_>) -> Result<u64, ApplyError> {
        let amount = <[u8; 8]>::try_from(&command.data[..]).map_or(0, u64::from_le_bytes);
        self.0 = self.0.wrapping_add(amount);
        Ok(self.0)
    }

    fn query(&self, (): ()) -> u64 {
        self.0
    }

    fn snapshot(&self) -> Box<dyn SnapshotSource> {
        Box::new(BytesSnapshot(self.0.to_le_bytes().to_vec().into()))
    }

    fn restore(&mut self, snapshot: &mut dyn std::io::Read) -> Result<(), RestoreError> {
        let mut bytes = [0u8; 8];
        snapshot
            .read_exact(&mut bytes)
            .map_err(|_| RestoreError::new("not 8 bytes"))?;
        self.0 = u64::from_le_bytes(bytes);
        Ok(())
    }
}

/// The example's options (a few flags, parsed by hand to keep the example
/// free of dependencies).
#[derive(Clone, Debug)]
struct Options {
    node: Option<u64>,
    groups: u64,
    rounds: u64,
    idle_seconds: u64,
    ports: Vec<u16>,
    data: PathBuf,
    workers: usize,
}

fn parse() -> Result<Options, String> {
    let mut options = Options {
        node: None,
        groups: 1000,
        rounds: 10,
        idle_seconds: 0,
        ports: Vec::new(),
        data: std::env::temp_dir().join(format!("ferry-counter-{}", std::process::id())),
        workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        let number = |text: String| text.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--node" => options.node = Some(number(value()?)?),
            "--groups" => options.groups = number(value()?)?,
            "--rounds" => options.rounds = number(value()?)?,
            "--idle-seconds" => options.idle_seconds = number(value()?)?,
            "--workers" => options.workers = number(value()?)?.max(1) as usize,
            "--data" => options.data = PathBuf::from(value()?),
            "--ports" => {
                options.ports = value()?
                    .split(',')
                    .map(|p| p.parse().map_err(|e| format!("--ports: {e}")))
                    .collect::<Result<_, String>>()?
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(options)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = parse()?;
    match options.node {
        None => run_three(options),
        Some(node) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "warn".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            tokio::runtime::Runtime::new()?.block_on(run_node(node, options))
        }
    }
}

/// Starts nodes 1 to 3 as child processes and prints what they report.
fn run_three(options: Options) -> Result<(), Box<dyn std::error::Error>> {
    let ports: Vec<u16> = (0..3)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| Ok(l.local_addr()?.port()))
        })
        .collect::<Result<_, _>>()?;
    let ports_arg = ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let exe = std::env::current_exe()?;
    println!(
        "counter: {} groups on 3 nodes, {} rounds of +1 from each node; data in {}",
        options.groups,
        options.rounds,
        options.data.display()
    );
    let mut children = Vec::new();
    for node in 1..=3u64 {
        let child = Process::new(&exe)
            .args(["--node", &node.to_string()])
            .args(["--groups", &options.groups.to_string()])
            .args(["--rounds", &options.rounds.to_string()])
            .args(["--idle-seconds", &options.idle_seconds.to_string()])
            .args(["--workers", &options.workers.to_string()])
            .args(["--ports", &ports_arg])
            .arg("--data")
            .arg(&options.data)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        children.push(child);
    }
    // Each node prints "done" when its workload is over and then waits for
    // its stdin to close, so that no node leaves while others still need
    // it for a quorum.
    let mut readers: Vec<_> = children
        .iter_mut()
        .map(|child| std::io::BufReader::new(child.stdout.take().expect("piped")).lines())
        .collect();
    let mut reports = Vec::new();
    for (node, lines) in readers.iter_mut().enumerate() {
        for line in lines.by_ref() {
            let line = line?;
            if line == "done" {
                break;
            }
            reports.push(format!("node {}: {line}", node + 1));
        }
    }
    for line in &reports {
        println!("{line}");
    }
    for child in &mut children {
        drop(child.stdin.take());
    }
    let mut failed = false;
    for child in &mut children {
        failed |= !child.wait()?.success();
    }
    let _ = std::fs::remove_dir_all(&options.data);
    if failed {
        return Err("a node failed".into());
    }
    Ok(())
}

/// The memory this process holds now (its resident set), from /proc.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// CPU time this process used so far (user + system), from /proc.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which is in parentheses.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of the line: 11 and 12 here.
    let total = ticks(11) + ticks(12);
    // The kernel's clock ticks per second are 100 on every Linux ferry runs on.
    Duration::from_millis(total * 10)
}

async fn run_node(node: u64, options: Options) -> Result<(), Box<dyn std::error::Error>> {
    if options.ports.len() != 3 || !(1..=3).contains(&node) {
        return Err("--node must be 1, 2 or 3 and --ports must name three ports".into());
    }
    let port = |id: u64| options.ports[(id - 1) as usize];
    let mut config = HostConfig::new(
        node,
        options.data.join(format!("node-{node}")),
        format!("127.0.0.1:{}", port(node)).parse()?,
    );
    for peer in (1..=3).filter(|p| *p != node) {
        config
            .peers
            .insert(peer, format!("127.0.0.1:{}", port(peer)));
    }
    config.workers = options.workers;
    if std::env::var_os("COUNTER_NO_QUIESCE").is_some() {
        config.engine.quiesce = false;
    }
    let resident_before = resident_bytes();
    let host = NodeHost::start(config).await?;
    let started = Instant::now();
    let mut groups = Vec::with_capacity(options.groups as usize);
    for group in 1..=options.groups {
        groups.push(
            host.start_group(group, Membership::Found(vec![1, 2, 3]), Counter::default())
                .await?,
        );
    }
    let groups: Arc<Vec<GroupHandle<Counter>>> = Arc::new(groups);
    println!(
        "started {} groups in {:.2} s",
        groups.len(),
        started.elapsed().as_secs_f64()
    );

    // Every group elects a leader before the workload starts (thousands of
    // groups starting at once elect for a few seconds).
    let started = Instant::now();
    let deadline = started + Duration::from_secs(120);
    while groups
        .iter()
        .any(|g| g.view_with(|view| view.leader.is_none()))
    {
        if Instant::now() > deadline {
            return Err("some groups elected no leader within 120 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        if std::env::var_os("COUNTER_PROGRESS").is_some() {
            let led = groups
                .iter()
                .filter(|g| g.view_with(|view| view.leader.is_some()))
                .count();
            let quiet = groups
                .iter()
                .filter(|g| g.view_with(|view| view.quiescent))
                .count();
            let syncs = host
                .log_counters()
                .syncs
                .load(std::sync::atomic::Ordering::Relaxed);
            eprintln!(
                "node {node}: {led} of {} groups have a leader after {:.1} s ({quiet} quiet, {syncs} syncs so far)",
                groups.len(),
                started.elapsed().as_secs_f64()
            );
            if started.elapsed() > Duration::from_secs(10) {
                let mut kinds = std::collections::BTreeMap::new();
                for g in groups.iter() {
                    let v = g.view();
                    if v.leader.is_none() {
                        *kinds
                            .entry(format!(
                                "{:?} q={} t={} last={} durable={} commit={}",
                                v.role,
                                v.quiescent,
                                v.term,
                                v.last_index,
                                v.durable_index,
                                v.commit
                            ))
                            .or_insert(0) += 1;
                    }
                }
                eprintln!("node {node}: leaderless: {kinds:?}");
                let sample: Vec<String> = groups
                    .iter()
                    .filter(|g| g.view_with(|view| view.leader.is_none()))
                    .take(6)
                    .map(|g| {
                        let v = g.view();
                        format!(
                            "{}:{:?}/t{}/last{}",
                            g.group(),
                            v.role,
                            v.term,
                            v.last_index
                        )
                    })
                    .collect();
                eprintln!("node {node}: leaderless sample: {}", sample.join(" "));
            }
        }
    }
    println!(
        "every group has a leader after {:.2} s",
        started.elapsed().as_secs_f64()
    );

    // The workload: every group gets `rounds` increments from this node, a
    // bounded number in flight at once.
    let syncs_before = host
        .log_counters()
        .syncs
        .load(std::sync::atomic::Ordering::Relaxed);
    let cpu_before = cpu_time();
    let started = Instant::now();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(256));
    let mut tasks = Vec::new();
    for round in 0..options.rounds {
        for handle in groups.iter() {
            let permit = in_flight.clone().acquire_owned().await?;
            let handle = handle.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = permit;
                propose_retrying(&handle, round).await
            }));
        }
    }
    let mut failures = 0u64;
    for task in tasks {
        if !task.await.unwrap_or(false) {
            failures += 1;
        }
    }
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    let proposals = options.rounds * options.groups;
    let syncs = host
        .log_counters()
        .syncs
        .load(std::sync::atomic::Ordering::Relaxed)
        - syncs_before;
    if proposals > 0 {
        println!(
            "{proposals} proposals in {elapsed:.2} s: {:.0}/s; {syncs} syncs ({:.0}/s, {:.1} proposals per sync); CPU {:.2} s; {failures} failed",
            proposals as f64 / elapsed,
            syncs as f64 / elapsed,
            proposals as f64 / syncs.max(1) as f64,
            (cpu_time() - cpu_before).as_secs_f64(),
        );
    }

    // Every node must see every node's increments.
    let expected = 3 * options.rounds;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut wrong = 0;
    for handle in groups.iter() {
        loop {
            match handle.query((), ReadConsistency::Linearizable).await {
                Ok(value) if value == expected => break,
                Ok(_) | Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Ok(_) | Err(_) => {
                    wrong += 1;
                    break;
                }
            }
        }
    }
    println!(
        "read every counter linearizably: {} of {} hold {expected}",
        groups.len() as u64 - wrong,
        groups.len()
    );

    if options.idle_seconds > 0 {
        // Idle groups go quiet within a heartbeat interval or two.
        let started = Instant::now();
        let quiesce = std::env::var_os("COUNTER_NO_QUIESCE").is_none();
        while quiesce
            && groups.iter().any(|g| !g.view_with(|view| view.quiescent))
            && started.elapsed() < Duration::from_secs(60)
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let quiet = groups
            .iter()
            .filter(|g| g.view_with(|view| view.quiescent))
            .count();
        println!(
            "{quiet} of {} groups quiet after {:.2} s",
            groups.len(),
            started.elapsed().as_secs_f64()
        );
        let cpu_before = cpu_time();
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs(options.idle_seconds)).await;
        let cpu = (cpu_time() - cpu_before).as_secs_f64();
        println!(
            "idle for {:.0} s with {} groups: CPU {:.2} s ({:.1}% of one core)",
            started.elapsed().as_secs_f64(),
            groups.len(),
            cpu,
            100.0 * cpu / started.elapsed().as_secs_f64()
        );
        let resident = resident_bytes();
        println!(
            "memory: {:.1} MiB resident, {:.1} MiB more than before the host started: {:.1} KiB per group",
            resident as f64 / 1048576.0,
            resident.saturating_sub(resident_before) as f64 / 1048576.0,
            resident.saturating_sub(resident_before) as f64 / 1024.0 / groups.len().max(1) as f64
        );
    }
    println!("done");
    std::io::stdout().flush()?;
    // Stay up until the parent says every node is done.
    let _ = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
    })
    .await;
    host.shutdown().await;
    if wrong > 0 {
        return Err(format!("{wrong} counters were wrong").into());
    }
    Ok(())
}

/// Adds 1 to a group's counter, retrying while it certainly did not apply
/// (no leader yet, say); false if it never succeeded or its outcome is
/// unknown (retrying then could add 1 twice).
async fn propose_retrying(handle: &GroupHandle<Counter>, round: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        match handle.propose(1u64.to_le_bytes().to_vec()).await {
            Ok(_) => return true,
            Err(error) if error.outcome_unknown() => {
                tracing::warn!(group = handle.group(), round, %error, "outcome unknown; not retried");
                return false;
            }
            Err(error) => {
                tracing::debug!(group = handle.group(), round, %error, "retrying");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    false
}
