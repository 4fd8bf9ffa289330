//! `ferry dev`: a local three-node cluster in one command.
//!
//! Starts three `ferry serve` processes on 127.0.0.1 with etcd's local
//! cluster ports (clients on 2379, 22379 and 32379), data under
//! `./ferry-dev/`, waits for a leader, prints the endpoints, reports
//! leader changes and nodes that die, and stops every node cleanly on
//! Ctrl-C. Run it again in the same folder and the same cluster resumes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use ferry_server::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use ferry_server::pb::etcdserverpb::StatusRequest;

/// Arguments of `ferry dev`.
#[derive(clap::Args, Debug)]
pub struct DevArgs {
    /// Where the nodes keep their data and logs.
    #[arg(long, value_name = "DIR", default_value = "ferry-dev")]
    pub dir: PathBuf,
    /// How long to wait for the first leader, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub leader_timeout_seconds: u64,
}

/// One node of the dev cluster.
struct DevNode {
    id: u64,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl DevNode {
    fn client_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }
}

const NODES: [(u64, u16, u16); 3] = [(1, 2379, 2380), (2, 22379, 22380), (3, 32379, 32380)];

fn spawn(node: &DevNode, members: &[String], dir: &Path) -> std::io::Result<Child> {
    let exe = std::env::current_exe()?;
    let node_dir = dir.join(format!("node{}", node.id));
    std::fs::create_dir_all(&node_dir)?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("node{}.log", node.id)))?;
    let mut command = Command::new(exe);
    command
        .arg("serve")
        .arg("--id")
        .arg(format!("{:x}", node.id))
        .arg("--data-dir")
        .arg(&node_dir)
        .arg("--listen-client")
        .arg(format!("127.0.0.1:{}", node.client_port))
        .arg("--listen-peer")
        .arg(format!("127.0.0.1:{}", node.peer_port));
    for member in members {
        command.arg("--member").arg(member);
    }
    command
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    command.spawn()
}

/// Asks one node for its status: (leader id, raft term).
async fn status(url: &str) -> Option<(u64, u64)> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string())
        .ok()?
        .connect_timeout(Duration::from_millis(300))
        .timeout(Duration::from_millis(500));
    let channel = endpoint.connect().await.ok()?;
    let response = MaintenanceClient::new(channel)
        .status(StatusRequest {})
        .await
        .ok()?
        .into_inner();
    Some((response.leader, response.raft_term))
}

/// The leader as the live nodes see it, if any agree on one.
async fn leader(nodes: &[DevNode]) -> Option<(u64, u64)> {
    for node in nodes.iter().filter(|n| n.child.is_some()) {
        if let Some((leader, term)) = status(&node.client_url()).await {
            if leader != 0 {
                return Some((leader, term));
            }
        }
    }
    None
}

/// Asks a child to stop cleanly (SIGTERM), then kills it if it lingers.
/// Returns whether it stopped by itself with success.
fn stop(child: &mut Child, grace: Duration) -> bool {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        match child.try_wait() {
            Ok(Some(status)) => return status.success(),
            Ok(None) => {}
            Err(_) => return false,
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    false
}

/// Runs `ferry dev` until Ctrl-C.
pub fn run(args: DevArgs) -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("ferry dev: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut nodes: Vec<DevNode> = NODES
        .iter()
        .map(|&(id, client_port, peer_port)| DevNode {
            id,
            client_port,
            peer_port,
            child: None,
        })
        .collect();
    let members: Vec<String> = nodes
        .iter()
        .map(|n| format!("{:x}=127.0.0.1:{},{}", n.id, n.peer_port, n.client_url()))
        .collect();
    if let Err(error) = std::fs::create_dir_all(&args.dir) {
        eprintln!("ferry dev: cannot create {}: {error}", args.dir.display());
        return ExitCode::FAILURE;
    }
    let resuming = args.dir.join("node1").exists();
    println!(
        "ferry dev: {} a three-node cluster in {}/",
        if resuming { "resuming" } else { "starting" },
        args.dir.display()
    );
    for index in 0..nodes.len() {
        match spawn(&nodes[index], &members, &args.dir) {
            Ok(child) => nodes[index].child = Some(child),
            Err(error) => {
                eprintln!("ferry dev: cannot start node {}: {error}", nodes[index].id);
                for node in &mut nodes {
                    if let Some(child) = node.child.as_mut() {
                        stop(child, Duration::from_secs(5));
                    }
                }
                return ExitCode::FAILURE;
            }
        }
    }

    let outcome = runtime.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(args.leader_timeout_seconds);
        let mut current = loop {
            if let Some(found) = leader(&nodes).await {
                break Some(found);
            }
            if reap(&mut nodes) == nodes.len() {
                eprintln!(
                    "ferry dev: every node exited; see {}/node*.log",
                    args.dir.display()
                );
                return ExitCode::FAILURE;
            }
            if Instant::now() > deadline {
                eprintln!(
                    "ferry dev: no leader after {} s; see {}/node*.log (is a port in use?)",
                    args.leader_timeout_seconds,
                    args.dir.display()
                );
                break None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if let Some((leader_id, term)) = current {
            println!("ferry dev: node {leader_id} is the leader (term {term})");
        }
        let endpoints: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.client_port))
            .collect();
        println!("ferry dev: endpoints {}", endpoints.join(","));
        println!(
            "ferry dev: logs in {}/node{{1,2,3}}.log",
            args.dir.display()
        );
        println!(
            "ferry dev: try  etcdctl --endpoints={} put greeting hello",
            endpoints.join(",")
        );
        println!(
            "ferry dev:      etcdctl --endpoints={} get greeting",
            endpoints.join(",")
        );
        println!("ferry dev: Ctrl-C stops every node");
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            reap(&mut nodes);
            let now = leader(&nodes).await;
            if now.map(|(id, _)| id) != current.map(|(id, _)| id) {
                match now {
                    Some((id, term)) => {
                        println!("ferry dev: node {id} is the leader (term {term})")
                    }
                    None => {
                        println!("ferry dev: no leader right now (an election may be under way)")
                    }
                }
                current = now;
            }
        }
        ExitCode::SUCCESS
    });
    println!("ferry dev: stopping every node");
    let mut all_clean = true;
    for node in &mut nodes {
        if let Some(child) = node.child.as_mut() {
            if !stop(child, Duration::from_secs(10)) {
                eprintln!(
                    "ferry dev: node {} did not stop cleanly; see {}/node{}.log",
                    node.id,
                    args.dir.display(),
                    node.id
                );
                all_clean = false;
            }
        }
    }
    println!("ferry dev: stopped; run it again to resume the same cluster");
    if all_clean {
        outcome
    } else {
        ExitCode::FAILURE
    }
}

/// Notices nodes that exited, says so, and returns how many are gone.
fn reap(nodes: &mut [DevNode]) -> usize {
    let mut gone = 0;
    for node in nodes.iter_mut() {
        let Some(child) = node.child.as_mut() else {
            gone += 1;
            continue;
        };
        if let Ok(Some(status)) = child.try_wait() {
            println!(
                "ferry dev: node {} exited ({status}); the other nodes keep running (its log: node{}.log)",
                node.id, node.id
            );
            node.child = None;
            gone += 1;
        }
    }
    gone
}
