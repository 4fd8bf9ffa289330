//! Process tests of TLS: real `ferry serve` processes on loopback with
//! certificates made here (rcgen), driven through the etcd v3 gRPC API over
//! TLS (`ferry_server::tls::channel`) or, where only the peers use TLS, in
//! plaintext. A compact harness of its own: cluster.rs's speaks plaintext
//! only and its nodes all take the same flags, where these take each their
//! own certificate files and change them between restarts.

mod common;
use common::free_port;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_server::pb::etcdserverpb::auth_client::AuthClient;
use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use ferry_server::pb::etcdserverpb::{PutRequest, RangeRequest, StatusRequest, StatusResponse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

/// A certificate authority made for one test.
struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

/// A certificate (for 127.0.0.1 and localhost) and its key, PEM.
struct Issued {
    cert: String,
    key: String,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        Ca {
            issuer: rcgen::Issuer::new(params, key),
            pem,
        }
    }

    /// A certificate whose subject's common name is `cn`, with serial
    /// number `serial`.
    fn issue(&self, cn: &str, serial: u64) -> Issued {
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.serial_number = Some(serial.into());
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// Like [`Ca::issue`], but of exactly the sizes of `like`'s files (an
    /// ECDSA signature's length varies by a byte or two: signed again
    /// until it matches).
    fn issue_same_size(&self, cn: &str, serial: u64, like: &Issued) -> Issued {
        for _ in 0..1000 {
            let issued = self.issue(cn, serial);
            if issued.cert.len() == like.cert.len() && issued.key.len() == like.key.len() {
                return issued;
            }
        }
        panic!("no certificate for {cn} of the size of the previous one");
    }
}

struct Node {
    id: u64,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    child: Option<Child>,
    /// Flags given to this node's `ferry serve` after the common ones: its
    /// certificate files, mostly.
    args: Vec<String>,
}

struct Cluster {
    nodes: Vec<Node>,
    members: Vec<String>,
    dir: PathBuf,
    /// How the helpers below call the client ports: TLS with these
    /// settings, or plaintext.
    client: Option<Arc<rustls::ClientConfig>>,
}

impl Cluster {
    /// A cluster of `size` nodes, none started yet: the test writes their
    /// certificates into [`Cluster::dir`] and sets their flags first.
    fn new(name: &str, size: u64, client_tls: bool) -> Cluster {
        let dir = std::env::temp_dir().join(format!("ferry-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let nodes: Vec<Node> = (1..=size)
            .map(|id| Node {
                id,
                client_port: free_port(),
                peer_port: free_port(),
                data_dir: dir.join(format!("node{id}")),
                child: None,
                args: Vec::new(),
            })
            .collect();
        let scheme = if client_tls { "https" } else { "http" };
        let members = nodes
            .iter()
            .map(|n| {
                format!(
                    "{:x}=127.0.0.1:{},{scheme}://127.0.0.1:{}",
                    n.id, n.peer_port, n.client_port
                )
            })
            .collect();
        Cluster {
            nodes,
            members,
            dir,
            client: None,
        }
    }

    fn node(&mut self, id: u64) -> &mut Node {
        &mut self.nodes[(id - 1) as usize]
    }

    /// Writes `text` to the file `name` in the cluster's directory.
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Writes `issued` as `NAME.crt` and `NAME.key`; their paths.
    fn write_issued(&self, name: &str, issued: &Issued) -> (PathBuf, PathBuf) {
        (
            self.write(&format!("{name}.crt"), &issued.cert),
            self.write(&format!("{name}.key"), &issued.key),
        )
    }

    fn start(&mut self, id: u64) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("node{id}.log")))
            .unwrap();
        let members = self.members.clone();
        let node = self.node(id);
        assert!(node.child.is_none());
        let mut command = Command::new(env!("CARGO_BIN_EXE_ferry"));
        // 50 ms ticks (elections after 0.5 to 1 s): the leader and term
        // these tests check must not move because a loaded machine was
        // slow to send a heartbeat.
        command
            .args(["serve", "--id", &format!("{id:x}"), "--tick-ms", "50"])
            .arg("--data-dir")
            .arg(&node.data_dir)
            .args([
                "--listen-client",
                &format!("127.0.0.1:{}", node.client_port),
            ])
            .args(["--listen-peer", &format!("127.0.0.1:{}", node.peer_port)]);
        if members.len() > 1 {
            for member in &members {
                command.args(["--member", member]);
            }
        }
        command
            .args(&node.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        node.child = Some(command.spawn().unwrap());
    }

    /// Stops a node cleanly (SIGTERM).
    fn stop(&mut self, id: u64) {
        let mut child = self.node(id).child.take().unwrap();
        signal(&child, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "node {id} ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends SIGHUP to node `id`.
    fn hangup(&mut self, id: u64) {
        signal(self.node(id).child.as_ref().unwrap(), libc::SIGHUP);
    }

    fn client_addr(&self, id: u64) -> String {
        format!("127.0.0.1:{}", self.nodes[(id - 1) as usize].client_port)
    }

    fn full_log(&self, id: u64) -> String {
        std::fs::read_to_string(self.dir.join(format!("node{id}.log"))).unwrap_or_default()
    }

    /// The last lines of every node's log, for failure messages.
    fn log(&self) -> String {
        let mut all = String::new();
        for node in &self.nodes {
            let text = self.full_log(node.id);
            let tail: Vec<&str> = text.lines().rev().take(25).collect();
            all.push_str(&format!("--- node {} (last lines)\n", node.id));
            for line in tail.into_iter().rev() {
                all.push_str(line);
                all.push('\n');
            }
        }
        all
    }

    /// A channel to node `id`'s client port, as [`Cluster::client`] says.
    async fn channel(&self, id: u64) -> Option<Channel> {
        let addr = self.client_addr(id);
        match &self.client {
            Some(client) => tls_channel(&addr, client.clone()).await.ok(),
            None => tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .ok()?
                .connect_timeout(Duration::from_millis(500))
                .timeout(Duration::from_secs(5))
                .connect()
                .await
                .ok(),
        }
    }

    async fn connect(&self, id: u64) -> Channel {
        self.channel(id)
            .await
            .unwrap_or_else(|| panic!("node {id} unreachable\n{}", self.log()))
    }

    /// Calls node `id` until the call succeeds, for up to 15 s.
    async fn retry<T, F, Fut>(&self, id: u64, what: &str, mut call: F) -> T
    where
        F: FnMut(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let failure = match self.channel(id).await {
                Some(channel) => match call(channel).await {
                    Ok(value) => return value,
                    Err(status) => status.to_string(),
                },
                None => "unreachable".to_string(),
            };
            assert!(
                Instant::now() < deadline,
                "{what} via node {id}: {failure}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn status(&self, id: u64) -> StatusResponse {
        self.retry(id, "status", |channel| async move {
            MaintenanceClient::new(channel)
                .status(StatusRequest {})
                .await
        })
        .await
        .into_inner()
    }

    /// Waits until one of `ids` reports a leader among them; its id.
    async fn wait_for_leader(&self, ids: &[u64]) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            for id in ids {
                if let Some(channel) = self.channel(*id).await {
                    if let Ok(response) = MaintenanceClient::new(channel)
                        .status(StatusRequest {})
                        .await
                    {
                        let leader = response.into_inner().leader;
                        if ids.contains(&leader) {
                            return leader;
                        }
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no leader among {ids:?}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn put(&self, id: u64, key: &str, value: &str) {
        let request = put_request(key, value);
        self.retry(id, &format!("put {key}"), |channel| {
            let request = request.clone();
            async move { KvClient::new(channel).put(request).await }
        })
        .await;
    }

    /// What node `id` holds for `key` by itself (a serializable read).
    async fn local_get(&self, id: u64, key: &str) -> Option<String> {
        let request = RangeRequest {
            key: key.into(),
            serializable: true,
            ..Default::default()
        };
        let response = self
            .retry(id, &format!("local get {key}"), |channel| {
                let request = request.clone();
                async move { KvClient::new(channel).range(request).await }
            })
            .await;
        first_value(response.into_inner().kvs)
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

fn signal(child: &Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) takes no pointers; the pid is our own child's, not
    // yet reaped.
    let result = unsafe { libc::kill(pid, signal) };
    assert_eq!(result, 0, "kill({pid}, {signal})");
}

fn put_request(key: &str, value: &str) -> PutRequest {
    PutRequest {
        key: key.to_owned().into(),
        value: value.to_owned().into(),
        ..Default::default()
    }
}

fn first_value(kvs: Vec<ferry_server::pb::mvccpb::KeyValue>) -> Option<String> {
    kvs.first()
        .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
}

async fn tls_channel(
    addr: &str,
    client: Arc<rustls::ClientConfig>,
) -> Result<Channel, tonic::transport::Error> {
    ferry_server::tls::channel(addr, client, Duration::from_secs(5)).await
}

/// Client settings trusting `ca` and presenting `identity`.
fn client_config(ca: &Path, identity: Option<&(PathBuf, PathBuf)>) -> Arc<rustls::ClientConfig> {
    ferry_server::tls::client_config(ca, identity.map(|(c, k)| (c.as_path(), k.as_path()))).unwrap()
}

/// The flags of peer TLS with these files, peers' certificates verified.
fn peer_args((cert, key): &(PathBuf, PathBuf), ca: &Path) -> Vec<String> {
    let path = |p: &Path| p.display().to_string();
    vec![
        "--peer-cert-file".into(),
        path(cert),
        "--peer-key-file".into(),
        path(key),
        "--peer-trusted-ca-file".into(),
        path(ca),
        "--peer-client-cert-auth".into(),
    ]
}

/// The flags of client TLS with these files.
fn client_args((cert, key): &(PathBuf, PathBuf), ca: &Path) -> Vec<String> {
    let path = |p: &Path| p.display().to_string();
    vec![
        "--cert-file".into(),
        path(cert),
        "--key-file".into(),
        path(key),
        "--trusted-ca-file".into(),
        path(ca),
    ]
}

/// The common name and serial number of the certificate the TLS port at
/// `addr` presents to a new connection.
async fn served_certificate(addr: &str, client: Arc<rustls::ClientConfig>) -> (String, u64) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ferry_server::tls::server_name(addr).unwrap();
    let stream = tokio_rustls::TlsConnector::from(client)
        .connect(name, stream)
        .await
        .unwrap();
    let cert = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
    let cn = ferry_server::tls::common_name(&cert).unwrap();
    (cn, serial_number(cert.as_ref()))
}

/// The serial number of a DER certificate: the first INTEGER of its
/// TBSCertificate (after the optional `[0]` version).
fn serial_number(der: &[u8]) -> u64 {
    // (tag, content) of the DER element at the start of `bytes`, and what
    // follows it.
    fn element(bytes: &[u8]) -> (u8, &[u8], &[u8]) {
        let tag = bytes[0];
        let (length, header) = match bytes[1] {
            short if short < 0x80 => (short as usize, 2),
            long => {
                let n = (long & 0x7f) as usize;
                let length = bytes[2..2 + n]
                    .iter()
                    .fold(0usize, |acc, b| (acc << 8) | *b as usize);
                (length, 2 + n)
            }
        };
        (
            tag,
            &bytes[header..header + length],
            &bytes[header + length..],
        )
    }
    let (_, certificate, _) = element(der);
    let (_, tbs, _) = element(certificate);
    let (tag, content, rest) = element(tbs);
    let serial = if tag == 0xa0 {
        element(rest).1
    } else {
        content
    };
    serial.iter().fold(0, |acc, b| (acc << 8) | u64::from(*b))
}

/// Gives `path` the bytes `text` without changing its modification time or
/// its size (which must be the same), so that only SIGHUP can tell the node
/// it changed: the file watch looks at those two.
fn replace_unnoticed(path: &Path, text: &str) {
    let before = std::fs::metadata(path).unwrap();
    assert_eq!(before.len(), text.len() as u64, "{}", path.display());
    let fresh = path.with_extension("fresh");
    std::fs::write(&fresh, text).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&fresh)
        .unwrap()
        .set_modified(before.modified().unwrap())
        .unwrap();
    std::fs::rename(&fresh, path).unwrap();
    let after = std::fs::metadata(path).unwrap();
    assert_eq!(after.modified().unwrap(), before.modified().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_a_certificate_from_another_ca_cannot_join_or_send_a_raft_message() {
    let mut cluster = Cluster::new("peer-ca", 3, false);
    let ca = Ca::new("cluster CA");
    let other_ca = Ca::new("another CA");
    let ca_file = cluster.write("ca.crt", &ca.pem);
    let mut good_args = Vec::new();
    for id in 1..=3 {
        let files =
            cluster.write_issued(&format!("node{id}"), &ca.issue(&format!("node-{id}"), id));
        good_args.push(peer_args(&files, &ca_file));
        cluster.node(id).args = peer_args(&files, &ca_file);
        cluster.start(id);
    }
    let leader = cluster.wait_for_leader(&[1, 2, 3]).await;
    cluster.put(leader, "before", "1").await;
    let victim = if leader == 3 { 2 } else { 3 };
    let others: Vec<u64> = (1..=3).filter(|id| *id != victim).collect();
    let term = cluster.status(leader).await.raft_term;

    // The victim comes back with the same name and the cluster's CA to
    // verify others by, but a certificate another CA signed.
    cluster.stop(victim);
    let intruder = cluster.write_issued("intruder", &other_ca.issue(&format!("node-{victim}"), 99));
    cluster.node(victim).args = peer_args(&intruder, &ca_file);
    cluster.start(victim);
    cluster.put(leader, "during", "2").await;
    // Both members refuse it, both ways: its dials fail their client
    // verification, theirs fail on its server certificate.
    let refused_inbound = |log: &str| {
        log.lines().any(|l| {
            l.contains("refused a peer connection: TLS handshake failed")
                && l.contains("UnknownIssuer")
        })
    };
    let refused_outbound = |log: &str| {
        log.lines()
            .any(|l| l.contains("TLS handshake with peer failed") && l.contains("UnknownIssuer"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !others.iter().all(|id| {
        let log = cluster.full_log(*id);
        refused_inbound(&log) && refused_outbound(&log)
    }) {
        assert!(
            Instant::now() < deadline,
            "the members did not log refusing the intruder's certificate\n{}",
            cluster.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Several election timeouts (10 to 20 ticks of 50 ms) while it tries.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for id in &others {
        let status = cluster.status(*id).await;
        assert_eq!(status.leader, leader, "node {id}\n{}", cluster.log());
        assert_eq!(status.raft_term, term, "node {id}\n{}", cluster.log());
    }
    let status = cluster.status(victim).await;
    assert_ne!(
        status.leader,
        leader,
        "the intruder heard from the leader\n{}",
        cluster.log()
    );
    assert_eq!(
        cluster.local_get(victim, "during").await,
        None,
        "the intruder got the leader's entries"
    );

    // The same node with the cluster's certificate is let back in at once.
    cluster.stop(victim);
    cluster.node(victim).args = good_args[(victim - 1) as usize].clone();
    cluster.start(victim);
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster.local_get(victim, "during").await.is_none() {
        assert!(
            Instant::now() < deadline,
            "node {victim} did not catch up\n{}",
            cluster.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(cluster.status(leader).await.raft_term, term);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_reloaded_on_sighup_without_dropping_the_cluster() {
    let mut cluster = Cluster::new("sighup", 3, true);
    let ca = Ca::new("cluster CA");
    let ca_file = cluster.write("ca.crt", &ca.pem);
    let mut first = Vec::new();
    let mut files = Vec::new();
    for id in 1..=3 {
        // The same certificate for the client port and the peers.
        let issued = ca.issue(&format!("node-{id}-one"), 0x100 + id);
        let written = cluster.write_issued(&format!("node{id}"), &issued);
        let mut args = client_args(&written, &ca_file);
        args.extend(peer_args(&written, &ca_file));
        cluster.node(id).args = args;
        cluster.start(id);
        first.push(issued);
        files.push(written);
    }
    let client = client_config(&ca_file, None);
    cluster.client = Some(client.clone());
    let leader = cluster.wait_for_leader(&[1, 2, 3]).await;
    cluster.put(leader, "warm", "up").await;
    let term = cluster.status(leader).await.raft_term;
    for id in 1..=3 {
        let (cn, serial) = served_certificate(&cluster.client_addr(id), client.clone()).await;
        assert_eq!(cn, format!("node-{id}-one"));
        assert_eq!(serial, 0x100 + id);
    }

    // Puts through the leader all along, on one connection made before.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut kv = KvClient::new(cluster.connect(leader).await);
    let writer = tokio::spawn({
        let (stop, done) = (stop.clone(), done.clone());
        async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Err(status) = kv.put(put_request(&format!("k{i}"), "v")).await {
                    return Err(format!("put {i}: {status}"));
                }
                i += 1;
                done.store(i, Ordering::Relaxed);
            }
            Ok(i)
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The second set, same CA, same file sizes and times: the 2 s file
    // watch cannot see the change, only SIGHUP makes the node read them.
    for id in 1..=3u64 {
        let second = ca.issue_same_size(
            &format!("node-{id}-two"),
            0x200 + id,
            &first[(id - 1) as usize],
        );
        let (cert, key) = &files[(id - 1) as usize];
        replace_unnoticed(key, &second.key);
        replace_unnoticed(cert, &second.cert);
    }
    // Longer than the watch's interval: nothing changed yet.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (cn, _) = served_certificate(&cluster.client_addr(1), client.clone()).await;
    assert_eq!(cn, "node-1-one", "reloaded before SIGHUP");
    let puts_before = done.load(Ordering::Relaxed);
    for id in 1..=3 {
        cluster.hangup(id);
    }
    for id in 1..=3 {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (cn, serial) = served_certificate(&cluster.client_addr(id), client.clone()).await;
            if cn == format!("node-{id}-two") {
                assert_eq!(serial, 0x200 + id);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node {id} still serves {cn} after SIGHUP\n{}",
                cluster.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Both sides were reloaded, each logs it.
        let log = cluster.full_log(id);
        let reloaded = log
            .lines()
            .filter(|l| {
                l.contains("TLS certificates reloaded") && l.contains(&format!("node-{id}-two"))
            })
            .count();
        assert_eq!(reloaded, 2, "node {id}\n{}", cluster.log());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let puts = writer
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}\n{}", cluster.log()));
    assert!(
        puts > puts_before,
        "no put after the reload ({puts_before} before, {puts} in all)"
    );
    // New connections, to every member, with the new certificates.
    for id in 1..=3 {
        cluster.put(id, &format!("after-{id}"), "v").await;
        let status = cluster.status(id).await;
        assert_eq!(status.leader, leader, "node {id}");
        assert_eq!(status.raft_term, term, "node {id}");
    }
}

/// Opens a connection to `addr` that speaks HTTP/2 in clear (the preface
/// and an empty SETTINGS frame), as a gRPC client without TLS does.
async fn plaintext_h2(addr: &str) -> tokio::net::TcpStream {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    stream.write_all(&hello).await.unwrap();
    stream
}

/// How long until the other end closes `stream` (reads to the end, or a
/// reset), if it does within `within`.
async fn closed_after(stream: &mut tokio::net::TcpStream, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return started.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_client_on_a_tls_port_is_refused_and_holds_no_slot() {
    let mut cluster = Cluster::new("plaintext", 1, true);
    let ca = Ca::new("cluster CA");
    let ca_file = cluster.write("ca.crt", &ca.pem);
    let files = cluster.write_issued("node1", &ca.issue("node-1", 1));
    let mut args = client_args(&files, &ca_file);
    args.extend(
        [
            "--max-client-connections",
            "2",
            "--client-handshake-timeout-ms",
            "3000",
        ]
        .map(String::from),
    );
    cluster.node(1).args = args;
    cluster.start(1);
    let client = client_config(&ca_file, None);
    cluster.client = Some(client.clone());
    cluster.wait_for_leader(&[1]).await;
    cluster.put(1, "k", "v").await;
    // The channels above close; give the node a moment to see it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let addr = cluster.client_addr(1);

    // Twice as many as there are slots, kept open on this side: each is
    // refused at once, well within the handshake timeout, the later ones
    // admitted as the earlier free their slots.
    let mut plaintext = Vec::new();
    for _ in 0..4 {
        plaintext.push(plaintext_h2(&addr).await);
    }
    for (i, stream) in plaintext.iter_mut().enumerate() {
        let after = closed_after(stream, Duration::from_millis(2500)).await;
        assert!(
            after.is_some(),
            "plaintext connection {i} still open\n{}",
            cluster.log()
        );
    }
    // Their slots are free: a TLS client is served without waiting for
    // any timeout.
    let started = Instant::now();
    let channel = tls_channel(&addr, client.clone()).await.unwrap();
    let response = KvClient::new(channel)
        .range(RangeRequest {
            key: "k".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first_value(response.kvs).as_deref(), Some("v"));
    assert!(
        started.elapsed() < Duration::from_millis(2000),
        "the TLS client waited {:?}",
        started.elapsed()
    );
    drop(plaintext);

    // A connection that says nothing holds its slot until the handshake
    // timeout, and no longer.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let after = closed_after(&mut silent, Duration::from_secs(6)).await;
    let after = after.unwrap_or_else(|| panic!("a silent connection is still open"));
    assert!(
        after > Duration::from_millis(2000),
        "a silent connection was closed after {after:?}, before the handshake timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_from_another_ca_is_refused_with_client_cert_auth() {
    let mut cluster = Cluster::new("client-ca", 1, true);
    let ca = Ca::new("cluster CA");
    let other_ca = Ca::new("another CA");
    let ca_file = cluster.write("ca.crt", &ca.pem);
    let files = cluster.write_issued("node1", &ca.issue("node-1", 1));
    let mut args = client_args(&files, &ca_file);
    args.push("--client-cert-auth".into());
    cluster.node(1).args = args;
    cluster.start(1);
    let alice = cluster.write_issued("alice", &ca.issue("alice", 2));
    cluster.client = Some(client_config(&ca_file, Some(&alice)));
    cluster.wait_for_leader(&[1]).await;
    cluster.put(1, "k", "from alice").await;

    let addr = cluster.client_addr(1);
    let mallory = cluster.write_issued("mallory", &other_ca.issue("alice", 3));
    for (who, identity, alert) in [
        ("another CA's certificate", Some(&mallory), "UnknownCA"),
        ("no certificate", None, "CertificateRequired"),
    ] {
        let client = client_config(&ca_file, identity);
        let outcome = async {
            let channel = tls_channel(&addr, client.clone())
                .await
                .map_err(|e| e.to_string())?;
            KvClient::new(channel)
                .put(put_request("k", "from mallory"))
                .await
                .map_err(|e| e.to_string())
        }
        .await;
        assert!(outcome.is_err(), "a client with {who} was served");
        // The handshake itself fails, and the node tells the client why.
        let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let name = ferry_server::tls::server_name(&addr).unwrap();
        let refused = match tokio_rustls::TlsConnector::from(client)
            .connect(name, stream)
            .await
        {
            Err(error) => error.to_string(),
            // TLS 1.3: the client finishes first; the refusal is the
            // node's first answer.
            Ok(mut stream) => {
                let mut buf = [0u8; 64];
                match stream.read(&mut buf).await {
                    Err(error) => error.to_string(),
                    Ok(n) => format!("read {n} bytes"),
                }
            }
        };
        assert_eq!(refused, format!("received fatal alert: {alert}"), "{who}");
    }
    assert_eq!(
        cluster.local_get(1, "k").await.as_deref(),
        Some("from alice")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_client_cert_auth_the_certificate_common_name_is_the_user() {
    use ferry_server::pb::authpb::permission::Type as PermType;
    let mut cluster = Cluster::new("cn-user", 1, true);
    let ca = Ca::new("cluster CA");
    let ca_file = cluster.write("ca.crt", &ca.pem);
    let files = cluster.write_issued("node1", &ca.issue("node-1", 1));
    let mut args = client_args(&files, &ca_file);
    args.extend(["--client-cert-auth", "--bcrypt-cost", "4"].map(String::from));
    cluster.node(1).args = args;
    cluster.start(1);
    let root = cluster.write_issued("root", &ca.issue("root", 2));
    let reader = cluster.write_issued("reader", &ca.issue("reader", 3));
    let stranger = cluster.write_issued("stranger", &ca.issue("stranger", 4));
    cluster.client = Some(client_config(&ca_file, Some(&root)));
    cluster.wait_for_leader(&[1]).await;
    cluster.put(1, "app/x", "1").await;
    cluster.put(1, "other", "2").await;

    let mut auth = AuthClient::new(cluster.connect(1).await);
    common::enable_auth_with_app_user(&mut auth, "reader", "ro", PermType::Read).await;

    let addr = cluster.client_addr(1);
    let range = |key: &str| RangeRequest {
        key: key.into(),
        ..Default::default()
    };
    // No token anywhere below: the certificate names the user.
    let mut kv = KvClient::new(
        tls_channel(&addr, client_config(&ca_file, Some(&reader)))
            .await
            .unwrap(),
    );
    let read = kv.range(range("app/x")).await.unwrap().into_inner();
    assert_eq!(first_value(read.kvs).as_deref(), Some("1"));
    let denied = kv.put(put_request("app/y", "no")).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    assert_eq!(denied.message(), "etcdserver: permission denied");
    let denied = kv.range(range("other")).await.unwrap_err();
    assert_eq!(denied.message(), "etcdserver: permission denied");

    // A certificate naming no user is no one's.
    let mut kv = KvClient::new(
        tls_channel(&addr, client_config(&ca_file, Some(&stranger)))
            .await
            .unwrap(),
    );
    let refused = kv.range(range("app/x")).await.unwrap_err();
    assert_eq!(refused.message(), "etcdserver: permission denied");

    // root's certificate may write anywhere.
    let mut kv = KvClient::new(cluster.connect(1).await);
    kv.put(put_request("app/y", "yes")).await.unwrap();
    kv.put(put_request("other", "3")).await.unwrap();
    let read = kv.range(range("app/y")).await.unwrap().into_inner();
    assert_eq!(first_value(read.kvs).as_deref(), Some("yes"));

    // The JSON gateway over TLS (HTTP/1.1 by ALPN): the certificate names
    // the user there too.
    let (status, body) = gateway_over_tls(
        &addr,
        client_config(&ca_file, Some(&reader)),
        "/v3/kv/range",
        r#"{"key": "YXBwL3g="}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""value":"MQ==""#), "{body}");
    let (status, body) = gateway_over_tls(
        &addr,
        client_config(&ca_file, Some(&reader)),
        "/v3/kv/put",
        r#"{"key": "YXBwL3k=", "value": "bm8="}"#,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("etcdserver: permission denied"), "{body}");
}

/// One POST to the JSON gateway at `addr` over TLS, asking for HTTP/1.1
/// alone by ALPN; answers the status and the body.
async fn gateway_over_tls(
    addr: &str,
    client: Arc<rustls::ClientConfig>,
    path: &str,
    body: &str,
) -> (u16, String) {
    let mut config = (*client).clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ferry_server::tls::server_name(addr).unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, stream)
        .await
        .unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    // The server may end the TLS session without close_notify after the
    // answer; what was read is what counts.
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .get(9..12)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    (status, body)
}
