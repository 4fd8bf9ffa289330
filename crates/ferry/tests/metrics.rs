//! Process tests of the metrics port: a three-node cluster of real `ferry
//! serve` processes with `--listen-metrics`, scraped over real HTTP/1.1
//! (hyper's client), the exposition parsed strictly (every line must be a
//! well-formed `# HELP`, `# TYPE` or sample of a declared family), and
//! etcd's health endpoints asked before and after the cluster loses its
//! quorum. A compact harness of its own, as tls.rs has: cluster.rs's nodes
//! have no metrics port.

// Only `free_port` is used here.
#[allow(dead_code)]
mod common;
use common::free_port;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use ferry_server::pb::etcdserverpb::watch_client::WatchClient;
use ferry_server::pb::etcdserverpb::watch_request::RequestUnion;
use ferry_server::pb::etcdserverpb::{PutRequest, StatusRequest, WatchCreateRequest, WatchRequest};
use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;
use tonic::codegen::tokio_stream::{self, StreamExt};
use tonic::transport::Channel;

/// Connections each metrics port takes at once (`--max-metrics-connections`).
const METRICS_CONNECTIONS: usize = 3;

struct Node {
    id: u64,
    client_port: u16,
    metrics_port: u16,
    child: Option<Child>,
}

struct Cluster {
    nodes: Vec<Node>,
    dir: PathBuf,
}

impl Cluster {
    fn start(name: &str) -> Cluster {
        Cluster::start_with(name, &[])
    }

    /// Three nodes, each with `extra_args` besides the usual ones.
    fn start_with(name: &str, extra_args: &[&str]) -> Cluster {
        let dir = std::env::temp_dir().join(format!("ferry-metrics-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ports: Vec<(u64, u16, u16, u16)> = (1..=3)
            .map(|id| (id, free_port(), free_port(), free_port()))
            .collect();
        let members: Vec<String> = ports
            .iter()
            .map(|(id, client, peer, _)| {
                format!("{id:x}=127.0.0.1:{peer},http://127.0.0.1:{client}")
            })
            .collect();
        let mut nodes = Vec::new();
        for (id, client_port, peer_port, metrics_port) in ports {
            let log = std::fs::File::create(dir.join(format!("node{id}.log"))).unwrap();
            let mut command = Command::new(env!("CARGO_BIN_EXE_ferry"));
            command
                .args(["serve", "--id", &format!("{id:x}"), "--tick-ms", "20"])
                .arg("--data-dir")
                .arg(dir.join(format!("node{id}")))
                .args(["--listen-client", &format!("127.0.0.1:{client_port}")])
                .args(["--listen-peer", &format!("127.0.0.1:{peer_port}")])
                .args([
                    "--listen-metrics",
                    &format!("http://127.0.0.1:{metrics_port}"),
                ])
                .args([
                    "--max-metrics-connections",
                    &METRICS_CONNECTIONS.to_string(),
                ]);
            for member in &members {
                command.args(["--member", member]);
            }
            command.args(extra_args);
            command
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log);
            nodes.push(Node {
                id,
                client_port,
                metrics_port,
                child: Some(command.spawn().unwrap()),
            });
        }
        Cluster { nodes, dir }
    }

    fn node(&self, id: u64) -> &Node {
        &self.nodes[(id - 1) as usize]
    }

    fn kill(&mut self, id: u64) {
        let mut child = self.nodes[(id - 1) as usize].child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    fn log(&self) -> String {
        let mut all = String::new();
        for node in &self.nodes {
            let text = std::fs::read_to_string(self.dir.join(format!("node{}.log", node.id)))
                .unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
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

async fn channel(port: u16) -> Option<Channel> {
    tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .ok()?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .ok()
}

/// Waits until node `id` reports a leader; returns it.
async fn wait_for_leader(cluster: &Cluster, id: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(channel) = channel(cluster.node(id).client_port).await {
            if let Ok(response) = MaintenanceClient::new(channel)
                .status(StatusRequest {})
                .await
            {
                let leader = response.into_inner().leader;
                if leader != 0 {
                    return leader;
                }
            }
        }
        assert!(Instant::now() < deadline, "no leader\n{}", cluster.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An HTTP answer: status, content type, body.
struct Answer {
    status: u16,
    content_type: String,
    body: String,
}

/// One request on a fresh HTTP/1.1 connection to `port` (closed after).
async fn request(port: u16, method: &str, path: &str, extra: &[(&str, String)]) -> Answer {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(connection);
        let mut builder = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", format!("127.0.0.1:{port}"));
        for (name, value) in extra {
            builder = builder.header(*name, value.as_str());
        }
        let request = builder
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .map(|value| value.to_str().unwrap().to_string())
            .unwrap_or_default();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Answer {
            status,
            content_type,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    };
    tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {path} on port {port}: no answer in 20 s"))
}

async fn get(port: u16, path: &str) -> Answer {
    request(port, "GET", path, &[]).await
}

/// One sample of an exposition.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The samples of a scrape, by family, each family with its type.
#[derive(Debug, Default)]
struct Scrape {
    types: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

fn is_name(text: &str) -> bool {
    let mut chars = text.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Parses `{k="v",...}` at the start of `text`; returns the labels and the
/// rest. Panics on anything malformed.
fn parse_labels(text: &str, line: &str) -> (BTreeMap<String, String>, String) {
    let mut labels = BTreeMap::new();
    let mut chars = text.chars().peekable();
    assert_eq!(chars.next(), Some('{'), "{line}");
    loop {
        if chars.peek() == Some(&'}') {
            chars.next();
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' {
                break;
            }
            key.push(c);
            chars.next();
        }
        assert!(is_name(&key), "label name {key:?}: {line}");
        assert_eq!(chars.next(), Some('='), "{line}");
        assert_eq!(chars.next(), Some('"'), "{line}");
        let mut value = String::new();
        loop {
            match chars.next() {
                Some('"') => break,
                Some('\\') => match chars.next() {
                    Some('\\') => value.push('\\'),
                    Some('"') => value.push('"'),
                    Some('n') => value.push('\n'),
                    other => panic!("bad escape {other:?}: {line}"),
                },
                Some(c) => value.push(c),
                None => panic!("unterminated label value: {line}"),
            }
        }
        assert!(
            labels.insert(key.clone(), value).is_none(),
            "label {key} twice: {line}"
        );
        match chars.next() {
            Some(',') => {}
            Some('}') => break,
            other => panic!("expected , or }} after a label, got {other:?}: {line}"),
        }
    }
    (labels, chars.collect())
}

/// Parses Prometheus' text format strictly: a line that is none of
/// `# HELP`, `# TYPE` or a sample of a family declared before fails.
fn parse(text: &str) -> Scrape {
    let mut scrape = Scrape::default();
    assert!(text.ends_with('\n'), "the exposition ends with a newline");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            assert!(is_name(name) && !help.is_empty(), "{line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect(line);
            assert!(is_name(name), "{line}");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            assert!(
                scrape
                    .types
                    .insert(name.to_string(), kind.to_string())
                    .is_none(),
                "{name} declared twice"
            );
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "{line:?}");
        let name_end = line.find(['{', ' ']).expect(line);
        let name = &line[..name_end];
        assert!(is_name(name), "{line}");
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..], line)
        } else {
            (BTreeMap::new(), line[name_end..].to_string())
        };
        let value = rest.strip_prefix(' ').expect(line);
        assert!(!value.contains(' '), "no timestamps expected: {line}");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            number => number
                .parse()
                .unwrap_or_else(|_| panic!("bad value: {line}")),
        };
        let family = scrape.family_of(name);
        assert!(family.is_some(), "a sample of no declared family: {line}");
        scrape.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    scrape
}

impl Scrape {
    /// The declared family a sample named `name` belongs to.
    fn family_of(&self, name: &str) -> Option<&str> {
        if let Some((family, _)) = self.types.get_key_value(name) {
            return Some(family);
        }
        ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let family = name.strip_suffix(suffix)?;
            let (family, kind) = self.types.get_key_value(family)?;
            (kind == "histogram").then_some(family.as_str())
        })
    }

    /// The value of the one sample `name` with exactly `labels`.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let found: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| s.name == name && s.labels == labels)
            .map(|s| s.value)
            .collect();
        assert!(
            found.len() <= 1,
            "{name} {labels:?} appears {} times",
            found.len()
        );
        found.first().copied()
    }

    /// The samples named `name`, whatever their labels.
    fn all(&self, name: &str) -> Vec<&Sample> {
        self.samples.iter().filter(|s| s.name == name).collect()
    }

    fn kind(&self, family: &str) -> Option<&str> {
        self.types.get(family).map(String::as_str)
    }

    /// Checks a histogram's series with `labels` (besides `le`) and
    /// returns its count: buckets that never decrease, ending with +Inf
    /// equal to the count.
    fn histogram_count(&self, family: &str, labels: &[(&str, &str)]) -> f64 {
        assert_eq!(self.kind(family), Some("histogram"), "{family}");
        let wanted: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut buckets: Vec<(f64, f64)> = self
            .all(&format!("{family}_bucket"))
            .into_iter()
            .filter(|s| {
                let mut rest = s.labels.clone();
                rest.remove("le");
                rest == wanted
            })
            .map(|s| {
                let le = &s.labels["le"];
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (bound, s.value)
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(!buckets.is_empty(), "{family} {labels:?} has no buckets");
        assert!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "{family}: buckets decrease: {buckets:?}"
        );
        let (last_bound, last) = *buckets.last().unwrap();
        assert_eq!(last_bound, f64::INFINITY, "{family}: no +Inf bucket");
        let count = self
            .value(&format!("{family}_count"), labels)
            .unwrap_or_else(|| panic!("{family}_count"));
        assert_eq!(last, count, "{family}: +Inf bucket and count differ");
        assert!(
            self.value(&format!("{family}_sum"), labels).is_some(),
            "{family}_sum"
        );
        count
    }
}

async fn scrape(port: u16) -> Scrape {
    let answer = get(port, "/metrics").await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.content_type,
        "text/plain; version=0.0.4; charset=utf-8"
    );
    parse(&answer.body)
}

/// Scrapes `port` until `check` accepts the scrape, for up to 20 s.
async fn scrape_until(
    cluster: &Cluster,
    port: u16,
    what: &str,
    check: impl Fn(&Scrape) -> bool,
) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let scrape = scrape(port).await;
        if check(&scrape) {
            return scrape;
        }
        assert!(
            Instant::now() < deadline,
            "never: {what}: {:?}\n{}",
            scrape.samples,
            cluster.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const PUTS: u64 = 25;

/// [`PUTS`] puts through node 1 (retried while an election settles: those
/// that fail count too, so count the successes).
async fn put_through_node_1(cluster: &Cluster) {
    let mut kv = KvClient::new(channel(cluster.node(1).client_port).await.unwrap());
    let mut done = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while done < PUTS {
        let put = kv
            .put(PutRequest {
                key: format!("key-{done}").into(),
                value: vec![b'v'; 100].into(),
                ..Default::default()
            })
            .await;
        if put.is_ok() {
            done += 1;
        }
        assert!(Instant::now() < deadline, "puts fail\n{}", cluster.log());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_is_scraped_and_its_health_follows_the_quorum() {
    let mut cluster = Cluster::start("scrape");
    let leader = wait_for_leader(&cluster, 1).await;
    put_through_node_1(&cluster).await;

    for node in &cluster.nodes {
        let port = node.metrics_port;
        let id = node.id;
        // Followers hear of the last commit with the next heartbeat; the
        // first pings take a few ticks.
        let s = scrape_until(&cluster, port, &format!("node {id} caught up"), |s| {
            s.value("etcd_server_proposals_committed_total", &[])
                .is_some_and(|v| v >= PUTS as f64)
                && s.all("etcd_network_peer_round_trip_time_seconds_count")
                    .len()
                    == 2
        })
        .await;
        assert_eq!(
            s.value("etcd_server_has_leader", &[]),
            Some(1.0),
            "node {id}"
        );
        assert_eq!(
            s.value("etcd_server_is_leader", &[]),
            Some(if id == leader { 1.0 } else { 0.0 }),
            "node {id}"
        );
        assert_eq!(
            s.kind("etcd_server_proposals_committed_total"),
            Some("gauge")
        );
        assert!(
            s.value("etcd_server_proposals_applied_total", &[]).unwrap() >= PUTS as f64,
            "node {id} applied the puts"
        );
        assert_eq!(
            s.kind("etcd_server_leader_changes_seen_total"),
            Some("counter")
        );
        assert!(
            s.value("etcd_server_leader_changes_seen_total", &[])
                .unwrap()
                >= 1.0
        );
        assert!(s.value("etcd_server_proposals_failed_total", &[]).is_some());
        assert!(
            s.histogram_count("etcd_disk_wal_fsync_duration_seconds", &[]) > 0.0,
            "node {id} synced its log"
        );
        s.histogram_count("etcd_disk_backend_commit_duration_seconds", &[]);
        assert!(
            s.value("etcd_mvcc_db_total_size_in_bytes", &[]).unwrap() > 0.0,
            "node {id} holds the keys"
        );
        // A round trip to each peer, labelled with its id.
        for peer in cluster.nodes.iter().filter(|n| n.id != id) {
            let to = format!("{:x}", peer.id);
            assert!(
                s.histogram_count("etcd_network_peer_round_trip_time_seconds", &[("To", &to)])
                    > 0.0,
                "node {id} to {to}"
            );
            assert_eq!(
                s.value("ferry_peer_connected", &[("To", &to)]),
                Some(1.0),
                "node {id} to {to}"
            );
        }
        // Only the leader knows its followers' lag.
        let lag = s.all("ferry_replication_lag_entries");
        if id == leader {
            assert_eq!(lag.len(), 2, "{lag:?}");
        } else {
            assert!(lag.is_empty(), "node {id}: {lag:?}");
        }
        assert!(s.value("ferry_log_syncs_total", &[]).unwrap() > 0.0);
        for queue in [
            "ferry_log_requests_queued",
            "ferry_worker_inputs_queued",
            "ferry_peer_events_queued",
            "ferry_engine_requests_pending",
        ] {
            assert!(s.value(queue, &[]).is_some(), "node {id}: {queue}");
        }
    }
    // Two watchers on node 1: counted while their stream is open, neither
    // behind.
    let mut watch = WatchClient::new(channel(cluster.node(1).client_port).await.unwrap());
    let creates: Vec<WatchRequest> = ["key-0", "key-1"]
        .into_iter()
        .map(|key| WatchRequest {
            request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
                key: key.into(),
                ..Default::default()
            })),
        })
        .collect();
    let requests = tokio_stream::iter(creates).chain(tokio_stream::pending());
    let mut responses = watch.watch(requests).await.unwrap().into_inner();
    for _ in 0..2 {
        let created = responses.message().await.unwrap().unwrap();
        assert!(created.created, "{created:?}");
    }
    let s = scrape_until(
        &cluster,
        cluster.node(1).metrics_port,
        "two watchers",
        |s| s.value("etcd_debugging_mvcc_watcher_total", &[]) == Some(2.0),
    )
    .await;
    assert_eq!(
        s.value("etcd_debugging_mvcc_slow_watcher_total", &[]),
        Some(0.0)
    );
    assert_eq!(
        s.kind("ferry_watch_catch_ups_from_store_total"),
        Some("counter")
    );
    assert!(s
        .value("ferry_watch_catch_ups_from_recent_total", &[])
        .is_some());
    assert!(s.value("ferry_watch_queued_bytes", &[]).is_some());
    drop(responses);

    // Node 1 served every put: each one counted with its code.
    let s = scrape(cluster.node(1).metrics_port).await;
    let put_ok = [
        ("grpc_type", "unary"),
        ("grpc_service", "etcdserverpb.KV"),
        ("grpc_method", "Put"),
        ("grpc_code", "OK"),
    ];
    assert!(s.value("grpc_server_handled_total", &put_ok).unwrap() >= PUTS as f64);
    assert!(
        s.value(
            "grpc_server_handled_total",
            &[
                ("grpc_type", "unary"),
                ("grpc_service", "etcdserverpb.Maintenance"),
                ("grpc_method", "Status"),
                ("grpc_code", "OK"),
            ],
        )
        .unwrap()
            >= 1.0,
        "the status calls of wait_for_leader"
    );
    let started = s
        .value(
            "grpc_server_started_total",
            &[
                ("grpc_type", "unary"),
                ("grpc_service", "etcdserverpb.KV"),
                ("grpc_method", "Put"),
            ],
        )
        .unwrap();
    assert!(started >= s.value("grpc_server_handled_total", &put_ok).unwrap());

    // Health as etcd answers it.
    for node in &cluster.nodes {
        let health = get(node.metrics_port, "/health").await;
        assert_eq!(
            (health.status, health.body.as_str()),
            (200, r#"{"health":"true","reason":""}"#),
            "node {}",
            node.id
        );
        for path in ["/livez", "/readyz", "/readyz/linearizable_read"] {
            let answer = get(node.metrics_port, path).await;
            assert_eq!(
                (answer.status, answer.body.as_str()),
                (200, "ok\n"),
                "{path}"
            );
        }
        let verbose = get(node.metrics_port, "/readyz?verbose").await;
        assert_eq!(
            verbose.body,
            "[+]data_corruption ok\n[+]serializable_read ok\n[+]linearizable_read ok\nok\n"
        );
    }

    // What the port refuses.
    let port = cluster.node(2).metrics_port;
    for path in ["/", "/metricsx", "/health/x", "/livez/nope", "/v3/kv/range"] {
        assert_eq!(get(port, path).await.status, 404, "{path}");
    }
    assert_eq!(request(port, "POST", "/health", &[]).await.status, 405);
    assert_eq!(request(port, "DELETE", "/metrics", &[]).await.status, 405);
    let huge = "x".repeat(20 * 1024);
    assert_eq!(
        request(port, "GET", "/metrics", &[("x-filler", huge)])
            .await
            .status,
        431,
        "a head past 16 KiB"
    );
    // Connections past the limit wait: with every slot held by a silent
    // client, a scrape is not answered until one of them goes.
    let mut silent = Vec::new();
    for _ in 0..METRICS_CONNECTIONS {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        stream.write_all(b"GET /metr").await.unwrap();
        silent.push(stream);
    }
    // Give the server time to admit them all before the scrape queues.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = tokio::spawn(async move { get(port, "/health").await.status });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!waiting.is_finished(), "answered past the connection limit");
    drop(silent.pop());
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("answered once a slot is free")
            .unwrap(),
        200
    );
    drop(silent);

    // The other two go: node 1 has no leader and no quorum any more.
    cluster.kill(2);
    cluster.kill(3);
    let port = cluster.node(1).metrics_port;
    let deadline = Instant::now() + Duration::from_secs(5);
    let health = loop {
        let health = get(port, "/health").await;
        if health.status != 200 {
            break health;
        }
        assert!(
            Instant::now() < deadline,
            "still healthy without a quorum\n{}",
            cluster.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(health.status, 503);
    assert!(
        health.body.starts_with(r#"{"health":"false","reason":""#)
            && !health.body.contains(r#""reason":"""#),
        "{}",
        health.body
    );
    let readyz = get(port, "/readyz").await;
    assert_eq!(readyz.status, 503, "{}", readyz.body);
    assert!(
        readyz.body.contains("[-]linearizable_read failed: "),
        "{}",
        readyz.body
    );
    assert_eq!(get(port, "/livez").await.status, 200, "alive all the same");
    scrape_until(&cluster, port, "node 1 sees no leader and no peer", |s| {
        s.value("etcd_server_has_leader", &[]) == Some(0.0)
            && s.value("ferry_peer_connected", &[("To", "2")]) == Some(0.0)
            && s.value("ferry_peer_connected", &[("To", "3")]) == Some(0.0)
    })
    .await;
}

/// With the state on disk, the backend commit histogram counts the
/// store's flushes (as etcd's counts its bbolt commits), and the store's
/// shape is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_state_on_disk_the_store_reports_its_flushes_and_shape() {
    let cluster = Cluster::start_with("store", &["--kv-on-disk", "--snapshot-entries", "20"]);
    wait_for_leader(&cluster, 1).await;
    put_through_node_1(&cluster).await;
    for node in &cluster.nodes {
        let s = scrape_until(&cluster, node.metrics_port, "a flush", |s| {
            s.histogram_count("etcd_disk_backend_commit_duration_seconds", &[]) > 0.0
                && s.value("ferry_kv_store_runs", &[])
                    .is_some_and(|runs| runs >= 1.0)
        })
        .await;
        assert!(
            s.value("ferry_kv_store_written_bytes_total", &[]).unwrap() > 0.0,
            "node {}",
            node.id
        );
        for gauge in [
            "ferry_kv_store_memtable_bytes",
            "ferry_kv_store_frozen_layers",
            "ferry_kv_store_run_index_bytes",
        ] {
            assert!(s.value(gauge, &[]).is_some(), "node {}: {gauge}", node.id);
        }
        assert_eq!(
            s.kind("ferry_kv_store_merge_duration_seconds"),
            Some("histogram")
        );
    }
}
