//! `ferry dev`: a local three-node cluster in one command.
//!
//! Starts three `ferry serve` processes on 127.0.0.1 with etcd's local
//! cluster ports (clients on 2379, 22379 and 32379), data under
//! `./ferry-dev/`, waits for a leader, prints the endpoints, reports
//! leader changes and nodes that die, and stops every node cleanly on
//! Ctrl-C. Run it again in the same folder and the same cluster resumes.
//! Each node serves metrics and health over HTTP on 2381, 22381 and 32381,
//! or on a free port when one of those is taken. Each node's runtime gets
//! its share of the machine's cores (`--worker-threads`), since the three
//! share them.

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
    /// Serve clients and peers over TLS, with a throwaway CA and
    /// certificates made in DIR/tls/ (kept for the next run): clients must
    /// present the client certificate made there (its common name is
    /// `root`, the user it acts as once auth is on).
    #[arg(long)]
    pub tls: bool,
    /// Worker threads of each node's runtime (`ferry serve
    /// --worker-threads`). [default: the machine's CPUs shared among the
    /// three nodes, at least one each]
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,
}

/// Each node's share of `cpus`, at least one thread: three runtimes that
/// each take every core wake one another's idle threads for nothing.
fn worker_threads_share(cpus: usize) -> usize {
    (cpus / NODES.len()).max(1)
}

/// The files of `ferry dev --tls`.
struct DevTls {
    dir: PathBuf,
}

impl DevTls {
    fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
    fn cert(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.crt"))
    }
    fn key(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.key"))
    }

    /// Makes the CA and a certificate for each node (for its client port
    /// and its peer links) and one for clients, unless they exist.
    fn make(dir: PathBuf) -> Result<DevTls, String> {
        let tls = DevTls { dir };
        if tls.ca().exists() {
            return Ok(tls);
        }
        std::fs::create_dir_all(&tls.dir)
            .map_err(|error| format!("cannot create {}: {error}", tls.dir.display()))?;
        let rcgen_error = |error: rcgen::Error| format!("cannot make certificates: {error}");
        let mut ca_params =
            rcgen::CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error)?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "ferry dev CA");
        ca_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let ca_key = rcgen::KeyPair::generate().map_err(rcgen_error)?;
        let ca_cert = ca_params.self_signed(&ca_key).map_err(rcgen_error)?;
        let ca_pem = ca_cert.pem();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let write = |path: PathBuf, text: &str| {
            std::fs::write(&path, text)
                .map_err(|error| format!("cannot write {}: {error}", path.display()))
        };
        let names: Vec<String> = (1..=NODES.len())
            .map(|i| format!("node{i}"))
            .chain(["client".to_string()])
            .collect();
        for name in &names {
            let mut params = rcgen::CertificateParams::new(vec![
                "127.0.0.1".to_string(),
                "localhost".to_string(),
            ])
            .map_err(rcgen_error)?;
            // The client certificate names the user `root`; a node's names
            // the node.
            let cn = if name == "client" {
                "root"
            } else {
                name.as_str()
            };
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, cn);
            params.extended_key_usages = vec![
                rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                rcgen::ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let key = rcgen::KeyPair::generate().map_err(rcgen_error)?;
            let cert = params.signed_by(&key, &issuer).map_err(rcgen_error)?;
            write(tls.cert(name), &cert.pem())?;
            write(tls.key(name), &key.serialize_pem())?;
        }
        // The CA last: its presence says the set is complete.
        write(tls.ca(), &ca_pem)?;
        Ok(tls)
    }
}

/// One node of the dev cluster.
struct DevNode {
    id: u64,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    child: Option<Child>,
    tls: bool,
}

impl DevNode {
    fn client_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }
}

const NODES: [(u64, u16, u16); 3] = [(1, 2379, 2380), (2, 22379, 22380), (3, 32379, 32380)];

/// The metrics port a node prefers (its client port + 2, as etcd's 2381).
fn preferred_metrics_port(client_port: u16) -> u16 {
    client_port.saturating_add(2)
}

/// `preferred` if it is free on 127.0.0.1 now, or a port the system says
/// is free (0 if even that fails: the node then picks one itself).
fn free_port(preferred: u16) -> u16 {
    if std::net::TcpListener::bind(("127.0.0.1", preferred)).is_ok() {
        return preferred;
    }
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .map_or(0, |addr| addr.port())
}

fn spawn(
    node: &DevNode,
    members: &[String],
    dir: &Path,
    tls: Option<&DevTls>,
    worker_threads: usize,
) -> std::io::Result<Child> {
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
        .arg(format!("127.0.0.1:{}", node.peer_port))
        .arg("--listen-metrics")
        .arg(format!("http://127.0.0.1:{}", node.metrics_port))
        .arg("--worker-threads")
        .arg(worker_threads.to_string());
    for member in members {
        command.arg("--member").arg(member);
    }
    if let Some(tls) = tls {
        let name = format!("node{}", node.id);
        command
            .arg("--cert-file")
            .arg(tls.cert(&name))
            .arg("--key-file")
            .arg(tls.key(&name))
            .arg("--trusted-ca-file")
            .arg(tls.ca())
            .arg("--client-cert-auth")
            .arg("--peer-cert-file")
            .arg(tls.cert(&name))
            .arg("--peer-key-file")
            .arg(tls.key(&name))
            .arg("--peer-trusted-ca-file")
            .arg(tls.ca())
            .arg("--peer-client-cert-auth");
    }
    command
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    command.spawn()
}

/// Asks one node for its status: (leader id, raft term).
async fn status(
    node: &DevNode,
    tls: Option<&std::sync::Arc<rustls::ClientConfig>>,
) -> Option<(u64, u64)> {
    let channel = match tls {
        Some(client) => ferry_server::tls::channel(
            &format!("127.0.0.1:{}", node.client_port),
            client.clone(),
            Duration::from_millis(500),
        )
        .await
        .ok()?,
        None => {
            let endpoint = tonic::transport::Endpoint::from_shared(node.client_url())
                .ok()?
                .connect_timeout(Duration::from_millis(300))
                .timeout(Duration::from_millis(500));
            endpoint.connect().await.ok()?
        }
    };
    let response = MaintenanceClient::new(channel)
        .status(StatusRequest {})
        .await
        .ok()?
        .into_inner();
    Some((response.leader, response.raft_term))
}

/// The leader as the live nodes see it, if any agree on one.
async fn leader(
    nodes: &[DevNode],
    tls: Option<&std::sync::Arc<rustls::ClientConfig>>,
) -> Option<(u64, u64)> {
    for node in nodes.iter().filter(|n| n.child.is_some()) {
        if let Some((leader, term)) = status(node, tls).await {
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
            metrics_port: free_port(preferred_metrics_port(client_port)),
            child: None,
            tls: args.tls,
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
    let tls = if args.tls {
        match DevTls::make(args.dir.join("tls")) {
            Ok(tls) => Some(tls),
            Err(message) => {
                eprintln!("ferry dev: {message}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let client_tls = match &tls {
        Some(tls) => match ferry_server::tls::client_config(
            &tls.ca(),
            Some((&tls.cert("client"), &tls.key("client"))),
        ) {
            Ok(config) => Some(config),
            Err(error) => {
                eprintln!("ferry dev: {error}");
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    let worker_threads = match args.worker_threads {
        Some(0) => {
            eprintln!("ferry dev: --worker-threads must be at least 1");
            return ExitCode::from(2);
        }
        Some(threads) => threads,
        None => worker_threads_share(
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        ),
    };
    let resuming = args.dir.join("node1").exists();
    println!(
        "ferry dev: {} a three-node cluster in {}/ ({worker_threads} worker thread{} each)",
        if resuming { "resuming" } else { "starting" },
        args.dir.display(),
        if worker_threads == 1 { "" } else { "s" },
    );
    for index in 0..nodes.len() {
        match spawn(
            &nodes[index],
            &members,
            &args.dir,
            tls.as_ref(),
            worker_threads,
        ) {
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
            if let Some(found) = leader(&nodes, client_tls.as_ref()).await {
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
        let metrics: Vec<String> = nodes
            .iter()
            .map(|n| format!("http://127.0.0.1:{}/metrics", n.metrics_port))
            .collect();
        println!(
            "ferry dev: metrics {} (and /health, /livez, /readyz)",
            metrics.join(" ")
        );
        println!(
            "ferry dev: logs in {}/node{{1,2,3}}.log",
            args.dir.display()
        );
        match &tls {
            Some(tls) => {
                let urls: Vec<String> = nodes.iter().map(DevNode::client_url).collect();
                let flags = format!(
                    "--cacert {} --cert {} --key {} --endpoints {}",
                    tls.ca().display(),
                    tls.cert("client").display(),
                    tls.key("client").display(),
                    urls.join(",")
                );
                println!("ferry dev: try  etcdctl {flags} put greeting hello");
                println!("ferry dev:      etcdctl {flags} get greeting");
            }
            None => {
                println!(
                    "ferry dev: try  etcdctl --endpoints={} put greeting hello",
                    endpoints.join(",")
                );
                println!(
                    "ferry dev:      etcdctl --endpoints={} get greeting",
                    endpoints.join(",")
                );
            }
        }
        println!("ferry dev: Ctrl-C (or SIGTERM) stops every node");
        // `kill` (SIGTERM) stops them too: a script that ends a dev cluster
        // with it must not leave its members serving on the ports.
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(error) => {
                    eprintln!("ferry dev: cannot listen for SIGTERM: {error}");
                    return ExitCode::FAILURE;
                }
            };
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = terminate.recv() => break,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            reap(&mut nodes);
            let now = leader(&nodes, client_tls.as_ref()).await;
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

#[cfg(test)]
mod tests {
    use super::worker_threads_share;

    #[test]
    fn each_node_gets_its_share_of_the_cores_and_at_least_one_thread() {
        assert_eq!(worker_threads_share(1), 1);
        assert_eq!(worker_threads_share(2), 1);
        assert_eq!(worker_threads_share(3), 1);
        assert_eq!(worker_threads_share(8), 2);
        assert_eq!(worker_threads_share(16), 5);
    }
}
