//! Process-level tests: real `ferry serve` processes on loopback, driven
//! through the etcd v3 gRPC API with our own generated client.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use ferry_server::pb::etcdserverpb::{PutRequest, RangeRequest, StatusRequest};
use tonic::transport::Channel;

/// A free port on loopback (bound, then released for the node to take).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Node {
    id: u64,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    child: Option<Child>,
}

struct Cluster {
    nodes: Vec<Node>,
    members: Vec<String>,
    dir: PathBuf,
}

impl Cluster {
    fn new(name: &str, size: u64) -> Cluster {
        let dir = std::env::temp_dir().join(format!("ferry-cluster-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let nodes: Vec<Node> = (1..=size)
            .map(|id| Node {
                id,
                client_port: free_port(),
                peer_port: free_port(),
                data_dir: dir.join(format!("node{id}")),
                child: None,
            })
            .collect();
        let members = nodes
            .iter()
            .map(|n| {
                format!(
                    "{}=127.0.0.1:{},http://127.0.0.1:{}",
                    n.id, n.peer_port, n.client_port
                )
            })
            .collect();
        let mut cluster = Cluster {
            nodes,
            members,
            dir,
        };
        for id in 1..=size {
            cluster.start(id);
        }
        cluster
    }

    fn start(&mut self, id: u64) {
        let node = &mut self.nodes[(id - 1) as usize];
        assert!(node.child.is_none());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("node{id}.log")))
            .unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_ferry"));
        command
            .args(["serve", "--id", &id.to_string(), "--tick-ms", "20"])
            .arg("--data-dir")
            .arg(&node.data_dir)
            .args([
                "--listen-client",
                &format!("127.0.0.1:{}", node.client_port),
            ])
            .args(["--listen-peer", &format!("127.0.0.1:{}", node.peer_port)]);
        for member in &self.members {
            command.args(["--member", member]);
        }
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        node.child = Some(command.spawn().unwrap());
    }

    /// Kills a node without warning (SIGKILL).
    fn kill(&mut self, id: u64) {
        let mut child = self.nodes[(id - 1) as usize].child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Stops a node cleanly (SIGTERM) and checks it exits with success.
    fn stop(&mut self, id: u64) {
        let mut child = self.nodes[(id - 1) as usize].child.take().unwrap();
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "node {id} exited with {status} on SIGTERM"
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {id} did not stop on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn url(&self, id: u64) -> String {
        format!(
            "http://127.0.0.1:{}",
            self.nodes[(id - 1) as usize].client_port
        )
    }

    fn log(&self) -> String {
        let mut all = String::new();
        for node in &self.nodes {
            let text = std::fs::read_to_string(self.dir.join(format!("node{}.log", node.id)))
                .unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            all.push_str(&format!("--- node {} (last lines)\n", node.id));
            for line in tail.into_iter().rev() {
                all.push_str(line);
                all.push('\n');
            }
        }
        all
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

async fn channel(url: &str) -> Option<Channel> {
    tonic::transport::Endpoint::from_shared(url.to_string())
        .ok()?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .ok()
}

/// Waits until some live node reports a leader; returns its id.
async fn wait_for_leader(cluster: &Cluster, live: &[u64]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for id in live {
            if let Some(channel) = channel(&cluster.url(*id)).await {
                if let Ok(response) = MaintenanceClient::new(channel)
                    .status(StatusRequest {})
                    .await
                {
                    let leader = response.into_inner().leader;
                    if leader != 0 && live.contains(&leader) {
                        return leader;
                    }
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "no leader among {live:?}\n{}",
            cluster.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Puts through node `id`, retrying while the cluster elects a leader.
async fn put(cluster: &Cluster, id: u64, key: &str, value: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(channel) = channel(&cluster.url(id)).await {
            let request = PutRequest {
                key: key.into(),
                value: value.into(),
                ..Default::default()
            };
            match KvClient::new(channel).put(request).await {
                Ok(_) => return,
                Err(status) => {
                    assert!(
                        Instant::now() < deadline,
                        "put {key} via node {id}: {status}\n{}",
                        cluster.log()
                    )
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "node {id} unreachable\n{}",
            cluster.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A linearizable get through node `id`.
async fn get(cluster: &Cluster, id: u64, key: &str) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(channel) = channel(&cluster.url(id)).await {
            let request = RangeRequest {
                key: key.into(),
                ..Default::default()
            };
            match KvClient::new(channel).range(request).await {
                Ok(response) => {
                    return response
                        .into_inner()
                        .kvs
                        .first()
                        .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
                }
                Err(status) => {
                    assert!(
                        Instant::now() < deadline,
                        "get {key} via node {id}: {status}\n{}",
                        cluster.log()
                    )
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "node {id} unreachable\n{}",
            cluster.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_any_member_are_read_through_every_member() {
    let cluster = Cluster::new("any-member", 3);
    wait_for_leader(&cluster, &[1, 2, 3]).await;
    for id in 1..=3u64 {
        put(
            &cluster,
            id,
            &format!("key-{id}"),
            &format!("from node {id}"),
        )
        .await;
    }
    for reader in 1..=3u64 {
        for writer in 1..=3u64 {
            assert_eq!(
                get(&cluster, reader, &format!("key-{writer}"))
                    .await
                    .as_deref(),
                Some(format!("from node {writer}").as_str()),
                "node {reader} reading node {writer}'s write"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_fails_over_and_nothing_acknowledged_is_lost() {
    let mut cluster = Cluster::new("failover", 3);
    let leader = wait_for_leader(&cluster, &[1, 2, 3]).await;
    for i in 0..20 {
        put(&cluster, leader, &format!("before-{i}"), &i.to_string()).await;
    }
    cluster.kill(leader);
    let live: Vec<u64> = (1..=3).filter(|id| *id != leader).collect();
    let new_leader = wait_for_leader(&cluster, &live).await;
    assert_ne!(new_leader, leader);
    for i in 0..20 {
        put(&cluster, live[0], &format!("after-{i}"), &i.to_string()).await;
    }
    for i in 0..20 {
        assert_eq!(
            get(&cluster, live[1], &format!("before-{i}")).await,
            Some(i.to_string())
        );
    }
    // The old leader comes back from its disk and catches up.
    cluster.start(leader);
    wait_for_leader(&cluster, &[1, 2, 3]).await;
    for i in 0..20 {
        assert_eq!(
            get(&cluster, leader, &format!("after-{i}")).await,
            Some(i.to_string())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_cluster_restarts_from_disk_with_every_acknowledged_write() {
    let mut cluster = Cluster::new("restart", 3);
    let leader = wait_for_leader(&cluster, &[1, 2, 3]).await;
    for i in 0..50 {
        put(&cluster, leader, &format!("k{i}"), &format!("v{i}")).await;
    }
    // One clean stop, two crashes: the disk must hold everything acknowledged.
    cluster.stop(1);
    cluster.kill(2);
    cluster.kill(3);
    for id in 1..=3 {
        cluster.start(id);
    }
    wait_for_leader(&cluster, &[1, 2, 3]).await;
    for i in 0..50 {
        assert_eq!(
            get(&cluster, 1 + (i % 3), &format!("k{i}")).await,
            Some(format!("v{i}"))
        );
    }
}
