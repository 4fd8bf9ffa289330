//! `ferry serve`: run one node of a cluster.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use ferry_server::connections::raise_open_files_limit;
use ferry_server::member_id::Hex;
use ferry_server::node::{start_node, ClientListen, MemberAddrs, NodeConfig};
use ferry_server::tls::TlsFiles;

/// Arguments of `ferry serve`. Every option may also come from a TOML file
/// (`--config`); a flag given on the command line wins over the file.
#[derive(clap::Args, Debug, Default)]
pub struct ServeArgs {
    /// A TOML file with any of the options below, by their long names with
    /// dashes as underscores (e.g. `data_dir = "/var/lib/ferry"`, `member =
    /// ["1=10.0.0.1:2380,http://10.0.0.1:2379", ...]`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// This node's id: a nonzero number in hexadecimal, as etcdctl prints
    /// member ids (`0x` may lead), unique in the cluster and never changed.
    /// It names the node in the log and to its peers.
    #[arg(long, value_name = "HEX")]
    pub id: Option<String>,
    /// The directory for this node's log and snapshots. Created if missing;
    /// on restart the node resumes from it. [default: ./ferry-data]
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where to serve the etcd v3 gRPC API; TLS when `--cert-file` is
    /// given, plaintext otherwise. [default: 127.0.0.1:2379]
    #[arg(long, value_name = "ADDR")]
    pub listen_client: Option<SocketAddr>,
    /// The client ports as URLs, comma separated, each `http://HOST:PORT`
    /// (plaintext) or `https://HOST:PORT` (TLS, needs `--cert-file`), as
    /// etcd's flag: both kinds may be served at once. Replaces
    /// `--listen-client`.
    #[arg(long, value_name = "URLS")]
    pub listen_client_urls: Option<String>,
    /// The certificate (PEM) the client ports present over TLS.
    #[arg(long, value_name = "FILE")]
    pub cert_file: Option<PathBuf>,
    /// The private key (PEM) of `--cert-file`.
    #[arg(long, value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// The CA certificates (PEM) client certificates are verified against
    /// (with `--client-cert-auth`).
    #[arg(long, value_name = "FILE")]
    pub trusted_ca_file: Option<PathBuf>,
    /// The certificate (PEM) this node presents to its peers, both when it
    /// accepts their connections and when it dials them; turns on TLS for
    /// every peer connection. Needs `--peer-trusted-ca-file`.
    #[arg(long, value_name = "FILE")]
    pub peer_cert_file: Option<PathBuf>,
    /// The private key (PEM) of `--peer-cert-file`.
    #[arg(long, value_name = "FILE")]
    pub peer_key_file: Option<PathBuf>,
    /// The CA certificates (PEM) peers' certificates must be signed by.
    #[arg(long, value_name = "FILE")]
    pub peer_trusted_ca_file: Option<PathBuf>,
    /// Peers that connect must present a certificate signed by
    /// `--peer-trusted-ca-file` (etcd's flag): a node without one cannot
    /// send a single Raft message.
    #[arg(long)]
    pub peer_client_cert_auth: bool,
    /// Where to accept connections from the other nodes. [default: 127.0.0.1:2380]
    #[arg(long, value_name = "ADDR")]
    pub listen_peer: Option<SocketAddr>,
    /// A founding member, as `ID=PEER_ADDR,CLIENT_URL` with the id in
    /// hexadecimal (e.g. `2=127.0.0.1:22380,http://127.0.0.1:22379`). Give every member,
    /// this node included, with the same list on every node. Without any,
    /// the node founds a one-member cluster of itself.
    #[arg(long, value_name = "MEMBER")]
    pub member: Vec<String>,
    /// The cluster id, a hexadecimal number every node of the cluster shares;
    /// a node refuses peers with another. [default: f3e7700000000001]
    #[arg(long, value_name = "HEX")]
    pub cluster_id: Option<String>,
    /// The length of one Raft tick in milliseconds; the election timeout is
    /// 10 to 20 ticks and the leader sends heartbeats every tick. [default: 100]
    #[arg(long, value_name = "MS")]
    pub tick_ms: Option<u64>,
    /// Take a snapshot of the key-value state after this many log entries
    /// (followers far behind are sent the snapshot); on disk, a
    /// checkpoint that flushes what changed. [default: 10000 in memory,
    /// 100000 on disk]
    #[arg(long, value_name = "ENTRIES")]
    pub snapshot_entries: Option<u64>,
    /// Keep the key-value state on disk (`kv/` in the data directory),
    /// flushed incrementally: the default (the flag is kept for scripts
    /// that name it).
    #[arg(long, conflicts_with = "kv_in_memory")]
    pub kv_on_disk: bool,
    /// Keep the key-value state in memory, snapshotted whole every
    /// --snapshot-entries entries, instead of on disk: for a small state,
    /// or tests. A data directory whose state is on disk does not start
    /// this way; one kept in memory moves to disk when started without it.
    #[arg(long)]
    pub kv_in_memory: bool,
    /// How log lines are written to stderr: `text` for people, `json` (one
    /// object per line, with its fields: every consensus event names the
    /// member, the term and the index) for a log collector.
    /// [default: text]
    #[arg(long, value_enum)]
    pub log_format: Option<crate::LogFormat>,
    /// Join a running cluster instead of founding one. First add this node
    /// with `etcdctl member add NAME --peer-urls=http://PEER_ADDR [--learner]`
    /// and start it with the id that call printed, an empty
    /// data directory, and `--member` for this node and at least one
    /// current member. It learns the log and the configuration from the
    /// leader. On later restarts the flag is ignored: the data directory
    /// already knows the cluster.
    #[arg(long)]
    pub join: bool,
    /// Log entries kept behind a snapshot, so that a follower a little
    /// behind is sent those entries rather than the whole snapshot. [default: 1000]
    #[arg(long, value_name = "ENTRIES")]
    pub compaction_lag_entries: Option<u64>,
    /// The most client connections at once; more wait in the kernel's
    /// backlog until one closes. Never more than the open files limit
    /// (raised to its hard limit at start) leaves after --reserved-fds and
    /// --max-peer-connections. [default: all that leaves]
    #[arg(long, value_name = "N")]
    pub max_client_connections: Option<usize>,
    /// The most connections at once from one IP address, on the client port
    /// and on the peer port; more are closed as soon as they are accepted.
    /// [default: 128]
    #[arg(long, value_name = "N")]
    pub max_connections_per_ip: Option<usize>,
    /// The most inbound peer connections at once (each member dials one).
    /// [default: 32]
    #[arg(long, value_name = "N")]
    pub max_peer_connections: Option<usize>,
    /// File descriptors never given to connections: kept for the log's
    /// segments, snapshots, outbound peer connections and the process, so
    /// that no number of connections can keep the storage from opening a
    /// file. [default: 64]
    #[arg(long, value_name = "N")]
    pub reserved_fds: Option<u64>,
    /// How long a new client connection has to send the HTTP/2 preface
    /// before it is closed. [default: 10000]
    #[arg(long, value_name = "MS")]
    pub client_handshake_timeout_ms: Option<u64>,
    /// How long a client connection may send nothing before it is closed.
    /// The node pings idle clients every third of this, and live clients
    /// answer, so only dead or silent ones are closed. [default: 60000]
    #[arg(long, value_name = "MS")]
    pub client_idle_timeout_ms: Option<u64>,
    /// How long a peer connection may send nothing before it is closed (the
    /// peer dials again). [default: 30000]
    #[arg(long, value_name = "MS")]
    pub peer_read_timeout_ms: Option<u64>,
    /// The most bytes held for frames from peers, in all connections
    /// together; past it the node stops reading from peers until the
    /// frames held are processed. At least the largest frame (64 MiB).
    /// [default: 268435456]
    #[arg(long, value_name = "BYTES")]
    pub peer_buffered_bytes_max: Option<usize>,
    /// The size a log segment grows to before the next one is started.
    /// [default: 67108864]
    #[arg(long, value_name = "BYTES")]
    pub wal_segment_bytes: Option<u64>,
    /// The largest client request accepted, in bytes (etcd's flag; at most
    /// 32 MiB, as every request becomes one log entry). [default: 1572864]
    #[arg(long, value_name = "BYTES")]
    pub max_request_bytes: Option<usize>,
    /// The bytes this member's store may hold (etcd's flag): a write that
    /// would grow it past them raises the cluster's NOSPACE alarm, and
    /// writes that grow the store are refused until `etcdctl alarm
    /// disarm` once space is back (compact, then defrag). 0 is the
    /// default; a negative value sets no quota. [default: 2147483648]
    #[arg(long, value_name = "BYTES", allow_negative_numbers = true)]
    pub quota_backend_bytes: Option<i64>,
    /// Free bytes on the data directory's file system below which this
    /// member raises the NOSPACE alarm, before the disk fills under the
    /// log (writes that grow the store are refused until `etcdctl alarm
    /// disarm`; reads, deletes and compaction go on). 0 turns the check
    /// off. [default: 134217728]
    #[arg(long, value_name = "BYTES")]
    pub disk_reserve_bytes: Option<u64>,
    /// The most operations one txn may hold, nested txns included: on each
    /// level the largest of its compares, success ops and failure ops, plus
    /// the operations of every txn nested in it (etcd's flag and default).
    /// [default: 128]
    #[arg(long, value_name = "OPS")]
    pub max_txn_ops: Option<usize>,
    /// The largest response one txn may produce, in bytes: the key-values
    /// its ranges return and the previous values its puts and deletes
    /// return (about 48 bytes per key-value besides key and value). A txn
    /// beyond it is refused whole. [default: 67108864]
    #[arg(long, value_name = "BYTES")]
    pub max_txn_response_bytes: Option<usize>,
    /// Bytes of events one watcher may have queued for a client that reads
    /// slower than the writes come; beyond it the watcher catches up from
    /// the store's history later, missing nothing. [default: 4194304]
    #[arg(long, value_name = "BYTES")]
    pub max_watcher_queued_bytes: Option<usize>,
    /// Bytes of events the watchers of one watch stream may have queued,
    /// an event shared by its watchers counted once; beyond it the stream
    /// is slowed to its client's pace (its watchers catch up from history).
    /// [default: 16777216]
    #[arg(long, value_name = "BYTES")]
    pub max_watch_stream_queued_bytes: Option<usize>,
    /// Bytes of events queued for all watch streams of this node together.
    /// [default: 268435456]
    #[arg(long, value_name = "BYTES")]
    pub max_watch_queued_bytes: Option<usize>,
    /// Which auth tokens Authenticate hands out, as etcd's flag: `simple`
    /// (random, kept by this member with a TTL) or
    /// `jwt,pub-key=PATH,priv-key=PATH,sign-method=RS256,ttl=5m` (signed,
    /// valid on every member with the public key; RS*, PS*, ES256, ES384,
    /// EdDSA, or HS* with the key file's bytes as the secret).
    /// [default: simple]
    #[arg(long, value_name = "KIND[,OPTIONS]")]
    pub auth_token: Option<String>,
    /// How long a simple token lives without being used, in seconds (etcd's
    /// flag). [default: 300]
    #[arg(long, value_name = "SECONDS")]
    pub auth_token_ttl: Option<u64>,
    /// bcrypt's cost for password hashes, 4 to 31 (etcd's flag). Each step
    /// doubles the time Authenticate takes. [default: 10]
    #[arg(long, value_name = "COST")]
    pub bcrypt_cost: Option<u32>,
    /// Clients must present a certificate signed by `--trusted-ca-file`,
    /// and a request without a token acts as the user named by the
    /// certificate's common name (etcd's flag; needs TLS).
    #[arg(long)]
    pub client_cert_auth: bool,
    /// Where to serve Prometheus metrics (`/metrics`) and etcd's health
    /// endpoints (`/health`, `/livez`, `/readyz`) over plain HTTP, as
    /// `http://HOST:PORT` URLs, comma separated (etcd's
    /// `--listen-metrics-urls`; e.g. `http://127.0.0.1:2381`). [default: none]
    #[arg(long, value_name = "URLS", visible_alias = "listen-metrics-urls")]
    pub listen_metrics: Option<String>,
    /// The most connections at once to the metrics port (scrapers and
    /// health probes); more wait in the kernel's backlog. [default: 16]
    #[arg(long, value_name = "N")]
    pub max_metrics_connections: Option<usize>,
    /// Threads that run the node's tasks (the async runtime's workers; the
    /// log's syncs and the state's flushes run on threads of their own).
    /// Give members that share a machine their share of its cores: an idle
    /// worker is woken to help with every burst of work, and with more
    /// workers than cores those wake-ups cost more than the help is worth.
    /// [default: one per CPU, or `TOKIO_WORKER_THREADS`]
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,
}

/// The most `--worker-threads`: far more than any machine has cores, few
/// enough that a typo does not start a thread per megabyte.
const WORKER_THREADS_MAX: usize = 1024;

/// The largest `--max-request-bytes`: a request is one log entry, and an
/// entry must fit in one frame between peers (64 MiB) with room to spare.
const REQUEST_BYTES_MAX_LIMIT: usize = 32 << 20;

/// The TOML form of [`ServeArgs`].
#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    /// A string, in hexadecimal like the flag: a TOML integer would invite
    /// reading `10` as ten where the flag reads sixteen.
    id: Option<String>,
    data_dir: Option<PathBuf>,
    listen_client: Option<SocketAddr>,
    listen_client_urls: Option<String>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    trusted_ca_file: Option<PathBuf>,
    peer_cert_file: Option<PathBuf>,
    peer_key_file: Option<PathBuf>,
    peer_trusted_ca_file: Option<PathBuf>,
    peer_client_cert_auth: Option<bool>,
    listen_peer: Option<SocketAddr>,
    #[serde(default)]
    member: Vec<String>,
    cluster_id: Option<String>,
    tick_ms: Option<u64>,
    snapshot_entries: Option<u64>,
    kv_on_disk: Option<bool>,
    kv_in_memory: Option<bool>,
    log_format: Option<crate::LogFormat>,
    compaction_lag_entries: Option<u64>,
    join: Option<bool>,
    max_client_connections: Option<usize>,
    max_connections_per_ip: Option<usize>,
    max_peer_connections: Option<usize>,
    reserved_fds: Option<u64>,
    client_handshake_timeout_ms: Option<u64>,
    client_idle_timeout_ms: Option<u64>,
    peer_read_timeout_ms: Option<u64>,
    peer_buffered_bytes_max: Option<usize>,
    wal_segment_bytes: Option<u64>,
    max_request_bytes: Option<usize>,
    quota_backend_bytes: Option<i64>,
    disk_reserve_bytes: Option<u64>,
    max_txn_ops: Option<usize>,
    max_txn_response_bytes: Option<usize>,
    max_watcher_queued_bytes: Option<usize>,
    max_watch_stream_queued_bytes: Option<usize>,
    max_watch_queued_bytes: Option<usize>,
    auth_token: Option<String>,
    auth_token_ttl: Option<u64>,
    bcrypt_cost: Option<u32>,
    client_cert_auth: Option<bool>,
    listen_metrics: Option<String>,
    max_metrics_connections: Option<usize>,
    worker_threads: Option<usize>,
}

/// Parses a member id written as etcdctl prints it: hexadecimal, with or
/// without `0x`, and nonzero.
fn parse_id(text: &str) -> Result<u64, String> {
    let digits = text.trim();
    let digits = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
        .unwrap_or(digits);
    match u64::from_str_radix(digits, 16) {
        Ok(0) => Err(format!("the id {text:?} is zero; ids start at 1")),
        Ok(id) => Ok(id),
        Err(_) => Err(format!(
            "the id {text:?} is not a hexadecimal number (as etcdctl prints member ids)"
        )),
    }
}

/// Parses `ID=PEER_ADDR,CLIENT_URL`.
fn parse_member(text: &str) -> Result<(u64, MemberAddrs), String> {
    let (id, addrs) = text
        .split_once('=')
        .ok_or_else(|| format!("member {text:?}: expected ID=PEER_ADDR,CLIENT_URL"))?;
    let id = parse_id(id).map_err(|reason| format!("member {text:?}: {reason}"))?;
    let (peer_addr, client_url) = addrs
        .split_once(',')
        .ok_or_else(|| format!("member {text:?}: expected ID=PEER_ADDR,CLIENT_URL"))?;
    let client_url = client_url.trim().to_string();
    if !client_url.starts_with("http://") && !client_url.starts_with("https://") {
        return Err(format!(
            "member {text:?}: the client URL must start with http:// or https://"
        ));
    }
    Ok((
        id,
        MemberAddrs {
            name: format!("ferry-{id:x}"),
            peer_addr: peer_addr.trim().to_string(),
            client_url,
        },
    ))
}

/// The options file named by `--config`, if any.
fn serve_file(config: Option<&std::path::Path>) -> Result<ServeFile, String> {
    match config {
        None => Ok(ServeFile::default()),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
            toml::from_str(&text).map_err(|error| format!("{}: {error}", path.display()))
        }
    }
}

/// What `ferry serve` runs with: the node's configuration and the
/// runtime's worker threads, from the flags over the options file (read
/// once).
fn serve_settings(args: ServeArgs) -> Result<(NodeConfig, Option<usize>), String> {
    let file = serve_file(args.config.as_deref())?;
    let threads = worker_threads(&args, &file)?;
    Ok((node_config(args, file)?, threads))
}

/// The runtime's worker threads: the flag, else the file's, else none
/// (tokio's default).
fn worker_threads(args: &ServeArgs, file: &ServeFile) -> Result<Option<usize>, String> {
    match args.worker_threads.or(file.worker_threads) {
        Some(threads) if !(1..=WORKER_THREADS_MAX).contains(&threads) => Err(format!(
            "--worker-threads {threads}: give 1 to {WORKER_THREADS_MAX}"
        )),
        threads => Ok(threads),
    }
}

/// Merges flags over the file and fills in defaults.
fn node_config(args: ServeArgs, file: ServeFile) -> Result<NodeConfig, String> {
    let id_text = args
        .id
        .or(file.id)
        .ok_or("--id is required (a nonzero hexadecimal number unique in the cluster)")?;
    let id = parse_id(&id_text).map_err(|reason| format!("--id: {reason}"))?;
    let data_dir = args
        .data_dir
        .or(file.data_dir)
        .unwrap_or_else(|| PathBuf::from("ferry-data"));
    let default_client = SocketAddr::from(([127, 0, 0, 1], 2379));
    let default_peer = SocketAddr::from(([127, 0, 0, 1], 2380));
    let listen_client = args
        .listen_client
        .or(file.listen_client)
        .unwrap_or(default_client);
    let cert_file = args.cert_file.or(file.cert_file);
    let key_file = args.key_file.or(file.key_file);
    let client_cert_auth = args.client_cert_auth || file.client_cert_auth.unwrap_or(false);
    let client_tls = match (cert_file, key_file) {
        (Some(cert), Some(key)) => Some(TlsFiles {
            cert,
            key,
            trusted_ca: args.trusted_ca_file.or(file.trusted_ca_file),
            client_cert_auth,
        }),
        (None, None) => None,
        _ => return Err("--cert-file and --key-file go together".to_string()),
    };
    let mut client_ports = match args.listen_client_urls.or(file.listen_client_urls) {
        Some(urls) => parse_listen_urls(&urls)?,
        None => vec![ClientListen {
            addr: listen_client,
            tls: client_tls.is_some(),
        }],
    };
    let first_port = client_ports.remove(0);
    let peer_client_cert_auth =
        args.peer_client_cert_auth || file.peer_client_cert_auth.unwrap_or(false);
    let peer_tls = match (
        args.peer_cert_file.or(file.peer_cert_file),
        args.peer_key_file.or(file.peer_key_file),
        args.peer_trusted_ca_file.or(file.peer_trusted_ca_file),
    ) {
        (Some(cert), Some(key), Some(ca)) => Some(TlsFiles {
            cert,
            key,
            trusted_ca: Some(ca),
            client_cert_auth: peer_client_cert_auth,
        }),
        (None, None, None) if !peer_client_cert_auth => None,
        _ => {
            return Err("peer TLS needs --peer-cert-file, --peer-key-file and --peer-trusted-ca-file (the CA peers' certificates are verified against)".to_string())
        }
    };
    let listen_peer = args
        .listen_peer
        .or(file.listen_peer)
        .unwrap_or(default_peer);
    let member_texts = if args.member.is_empty() {
        file.member
    } else {
        args.member
    };
    let mut members = BTreeMap::new();
    for text in &member_texts {
        let (member_id, addrs) = parse_member(text)?;
        if members.insert(member_id, addrs).is_some() {
            return Err(format!("member {member_id:x} is listed twice"));
        }
    }
    if members.is_empty() {
        members.insert(
            id,
            MemberAddrs {
                name: format!("ferry-{id:x}"),
                peer_addr: listen_peer.to_string(),
                client_url: format!(
                    "{}://{}",
                    if first_port.tls { "https" } else { "http" },
                    first_port.addr
                ),
            },
        );
    }
    if !members.contains_key(&id) {
        let listed: Vec<String> = members.keys().map(|id| format!("{id:x}")).collect();
        return Err(format!(
            "this node's id {id:x} is not among the members {}",
            listed.join(", ")
        ));
    }
    let mut config = NodeConfig::new(id, data_dir, first_port.addr, listen_peer, members);
    config.client_listen_tls = first_port.tls;
    config.client_listen_more = client_ports;
    config.client_tls = client_tls;
    config.peer_tls = peer_tls;
    if let Some(hex) = args.cluster_id.or(file.cluster_id) {
        config.cluster_id = u64::from_str_radix(hex.trim_start_matches("0x"), 16)
            .map_err(|_| format!("--cluster-id {hex:?} is not a hexadecimal number"))?;
    }
    if let Some(tick_ms) = args.tick_ms.or(file.tick_ms) {
        if tick_ms == 0 {
            return Err("--tick-ms must be at least 1".into());
        }
        config.tick_interval = Duration::from_millis(tick_ms);
    }
    if let Some(entries) = args.snapshot_entries.or(file.snapshot_entries) {
        config.snapshot_interval_entries = Some(entries.max(1));
    }
    // On disk unless asked otherwise, on the command line (which wins) or
    // in the file (`kv_in_memory = true` or `kv_on_disk = false`).
    let in_memory_by_file = file.kv_in_memory.unwrap_or(false) || file.kv_on_disk == Some(false);
    config.kv_on_disk = !args.kv_in_memory && (args.kv_on_disk || !in_memory_by_file);
    config.join = args.join || file.join.unwrap_or(false);
    if let Some(entries) = args.compaction_lag_entries.or(file.compaction_lag_entries) {
        config.compaction_lag_entries = entries;
    }
    let at_least_one = |value: Option<usize>, flag: &str| -> Result<Option<usize>, String> {
        match value {
            Some(0) => Err(format!("{flag} must be at least 1")),
            other => Ok(other),
        }
    };
    config.max_client_connections = at_least_one(
        args.max_client_connections.or(file.max_client_connections),
        "--max-client-connections",
    )?;
    if let Some(n) = at_least_one(
        args.max_connections_per_ip.or(file.max_connections_per_ip),
        "--max-connections-per-ip",
    )? {
        config.max_connections_per_ip = n;
    }
    if let Some(n) = at_least_one(
        args.max_peer_connections.or(file.max_peer_connections),
        "--max-peer-connections",
    )? {
        config.max_peer_connections = n;
    }
    if let Some(n) = args.reserved_fds.or(file.reserved_fds) {
        config.reserved_fds = n;
    }
    let millis = |value: Option<u64>, flag: &str| -> Result<Option<Duration>, String> {
        match value {
            Some(0) => Err(format!("{flag} must be at least 1")),
            other => Ok(other.map(Duration::from_millis)),
        }
    };
    let timeouts = &mut config.api_options.client_timeouts;
    if let Some(timeout) = millis(
        args.client_handshake_timeout_ms
            .or(file.client_handshake_timeout_ms),
        "--client-handshake-timeout-ms",
    )? {
        timeouts.handshake = timeout;
    }
    if let Some(timeout) = millis(
        args.client_idle_timeout_ms.or(file.client_idle_timeout_ms),
        "--client-idle-timeout-ms",
    )? {
        timeouts.idle = timeout;
    }
    if let Some(timeout) = millis(
        args.peer_read_timeout_ms.or(file.peer_read_timeout_ms),
        "--peer-read-timeout-ms",
    )? {
        config.peer_read_timeout = timeout;
    }
    if let Some(bytes) = args
        .peer_buffered_bytes_max
        .or(file.peer_buffered_bytes_max)
    {
        config.peer_buffered_bytes_max = bytes;
    }
    if let Some(bytes) = args.wal_segment_bytes.or(file.wal_segment_bytes) {
        if bytes == 0 {
            return Err("--wal-segment-bytes must be at least 1".into());
        }
        config.wal_segment_size_bytes_max = bytes;
    }
    if let Some(bytes) = at_least_one(
        args.max_request_bytes.or(file.max_request_bytes),
        "--max-request-bytes",
    )? {
        if bytes > REQUEST_BYTES_MAX_LIMIT {
            return Err(format!(
                "--max-request-bytes {bytes} is above {REQUEST_BYTES_MAX_LIMIT}: a request is one log entry and must fit in a message between nodes"
            ));
        }
        config.kv_limits.request_size_bytes_max = bytes;
    }
    if let Some(bytes) = args.quota_backend_bytes.or(file.quota_backend_bytes) {
        config.api_options.quota_backend_bytes = match u64::try_from(bytes) {
            Ok(0) => ferry_server::api::QUOTA_BACKEND_BYTES_DEFAULT,
            Ok(bytes) => bytes,
            Err(_) => u64::MAX,
        };
    }
    if let Some(bytes) = args.disk_reserve_bytes.or(file.disk_reserve_bytes) {
        config.disk_reserve_bytes = bytes;
    }
    if let Some(ops) = at_least_one(args.max_txn_ops.or(file.max_txn_ops), "--max-txn-ops")? {
        config.kv_limits.txn_ops_max = ops;
    }
    if let Some(bytes) = at_least_one(
        args.max_txn_response_bytes.or(file.max_txn_response_bytes),
        "--max-txn-response-bytes",
    )? {
        config.kv_limits.txn_response_bytes_max = bytes;
    }
    if let Some(bytes) = at_least_one(
        args.max_watcher_queued_bytes
            .or(file.max_watcher_queued_bytes),
        "--max-watcher-queued-bytes",
    )? {
        config.watch_limits.watcher_queued_bytes_max = bytes;
    }
    if let Some(bytes) = at_least_one(
        args.max_watch_stream_queued_bytes
            .or(file.max_watch_stream_queued_bytes),
        "--max-watch-stream-queued-bytes",
    )? {
        config.watch_limits.stream_queued_bytes_max = bytes;
    }
    if let Some(bytes) = at_least_one(
        args.max_watch_queued_bytes.or(file.max_watch_queued_bytes),
        "--max-watch-queued-bytes",
    )? {
        config.watch_limits.node_queued_bytes_max = bytes;
    }
    let auth = &mut config.api_options.auth;
    if let Some(token) = args.auth_token.or(file.auth_token) {
        auth.token = token.parse()?;
    }
    if let Some(seconds) = args.auth_token_ttl.or(file.auth_token_ttl) {
        if seconds == 0 {
            return Err("--auth-token-ttl must be at least 1 second".to_string());
        }
        auth.token_ttl = Duration::from_secs(seconds);
    }
    if let Some(cost) = args.bcrypt_cost.or(file.bcrypt_cost) {
        if !(4..=31).contains(&cost) {
            return Err(format!("--bcrypt-cost {cost}: bcrypt takes 4 to 31"));
        }
        auth.bcrypt_cost = cost;
    }
    auth.client_cert_auth = client_cert_auth;
    if let Some(urls) = args.listen_metrics.or(file.listen_metrics) {
        config.metrics_listen = parse_metrics_urls(&urls)?;
    }
    if let Some(n) = at_least_one(
        args.max_metrics_connections
            .or(file.max_metrics_connections),
        "--max-metrics-connections",
    )? {
        config.metrics_options.connection_limits.connections_max = n;
        config
            .metrics_options
            .connection_limits
            .connections_per_ip_max = n;
    }
    Ok(config)
}

/// Parses `--listen-metrics`: `http://HOST:PORT`, comma separated.
fn parse_metrics_urls(urls: &str) -> Result<Vec<SocketAddr>, String> {
    let mut addrs = Vec::new();
    for url in urls.split(',').map(str::trim).filter(|url| !url.is_empty()) {
        let Some(rest) = url.strip_prefix("http://") else {
            return Err(if url.starts_with("https://") {
                format!("--listen-metrics: {url:?}: the metrics port serves plain HTTP only; use http://")
            } else {
                format!("--listen-metrics: {url:?} must start with http://")
            });
        };
        let addr = rest
            .trim_end_matches('/')
            .parse::<SocketAddr>()
            .map_err(|_| {
                format!("--listen-metrics: {url:?} is not a URL of an IP address and port")
            })?;
        addrs.push(addr);
    }
    if addrs.is_empty() {
        return Err("--listen-metrics names no URL".to_string());
    }
    Ok(addrs)
}

/// Parses `--listen-client-urls`: `http://HOST:PORT` or `https://HOST:PORT`,
/// comma separated.
fn parse_listen_urls(urls: &str) -> Result<Vec<ClientListen>, String> {
    let mut ports = Vec::new();
    for url in urls.split(',').map(str::trim).filter(|url| !url.is_empty()) {
        let (tls, rest) = if let Some(rest) = url.strip_prefix("https://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("http://") {
            (false, rest)
        } else {
            return Err(format!(
                "--listen-client-urls: {url:?} must start with http:// or https://"
            ));
        };
        let addr = rest
            .trim_end_matches('/')
            .parse::<SocketAddr>()
            .map_err(|_| {
                format!("--listen-client-urls: {url:?} is not a URL of an IP address and port")
            })?;
        ports.push(ClientListen { addr, tls });
    }
    if ports.is_empty() {
        return Err("--listen-client-urls names no URL".to_string());
    }
    Ok(ports)
}

/// Runs `ferry serve` until SIGINT or SIGTERM.
pub fn run(args: ServeArgs) -> ExitCode {
    // The log first, so that everything after is written as asked (a
    // file that does not read is reported by `node_config` below).
    let log_format = args.log_format.or_else(|| {
        serve_file(args.config.as_deref())
            .ok()
            .and_then(|file| file.log_format)
    });
    let log_format = log_format.unwrap_or_default();
    crate::init_logging(log_format);
    // Why the node stops, on stderr: a line for people, or a JSON log line
    // like every other.
    let fatal = move |message: String| match log_format {
        crate::LogFormat::Text => eprintln!("ferry serve: {message}"),
        crate::LogFormat::Json => tracing::error!("{message}"),
    };
    let (config, worker_threads) = match serve_settings(args) {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("ferry serve: {message}");
            return ExitCode::from(2);
        }
    };
    // Every descriptor the process may have, before any is used: the
    // connection limits are derived from what this leaves.
    match raise_open_files_limit() {
        Ok(limit) if limit.soft > limit.soft_before => tracing::info!(
            from = limit.soft_before,
            to = limit.soft,
            "raised the open files limit to its hard limit"
        ),
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "cannot read or raise the open files limit"),
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(threads) = worker_threads {
        runtime.worker_threads(threads);
    }
    let runtime = match runtime.build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("ferry serve: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let node_id = config.node_id;
        let data_dir = config.data_dir.clone();
        let mut node = match start_node(config).await {
            Ok(node) => node,
            Err(error) => {
                fatal(format!("node {node_id:x} cannot start: {error}"));
                return ExitCode::FAILURE;
            }
        };
        let client_urls: Vec<String> = node
            .client_addrs
            .iter()
            .map(|(addr, tls)| format!("{}://{addr}", if *tls { "https" } else { "http" }))
            .collect();
        let metrics_urls: Vec<String> = node
            .metrics_addrs
            .iter()
            .map(|addr| format!("http://{addr}"))
            .collect();
        tracing::info!(
            node = %Hex(node_id),
            client = %client_urls.join(","),
            peer = %node.peer_addr,
            metrics = %metrics_urls.join(","),
            data = %data_dir.display(),
            "serving"
        );
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(error) => {
                    fatal(format!("cannot listen for SIGTERM: {error}"));
                    return ExitCode::FAILURE;
                }
            };
        let mut hangup =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(signal) => signal,
                Err(error) => {
                    fatal(format!("cannot listen for SIGHUP: {error}"));
                    return ExitCode::FAILURE;
                }
            };
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {
                    tracing::info!("SIGINT: stopping");
                    break;
                }
                _ = terminate.recv() => {
                    tracing::info!("SIGTERM: stopping");
                    break;
                }
                _ = hangup.recv() => {
                    tracing::info!("SIGHUP: reloading the TLS certificates");
                    node.reload_tls();
                }
                _ = node.stopped() => {
                    fatal(format!("node {node_id:x} stopped after an error (see the log above)"));
                    return ExitCode::FAILURE;
                }
            }
        }
        node.shutdown().await;
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node configuration `args` give (with their options file).
    fn config_of(args: ServeArgs) -> Result<NodeConfig, String> {
        serve_settings(args).map(|(config, _)| config)
    }

    /// The worker threads `args` give (with their options file).
    fn threads_of(args: &ServeArgs) -> Result<Option<usize>, String> {
        worker_threads(args, &serve_file(args.config.as_deref())?)
    }

    #[test]
    fn metrics_urls_reach_the_node_config_and_bad_ones_say_why() {
        let member = "1=127.0.0.1:1,http://127.0.0.1:2".to_string();
        let config = config_of(ServeArgs {
            id: Some("1".into()),
            member: vec![member.clone()],
            listen_metrics: Some("http://127.0.0.1:2381, http://[::1]:2382/".into()),
            max_metrics_connections: Some(3),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(
            config.metrics_listen,
            vec![
                "127.0.0.1:2381".parse::<SocketAddr>().unwrap(),
                "[::1]:2382".parse().unwrap()
            ]
        );
        assert_eq!(config.metrics_options.connection_limits.connections_max, 3);
        let default = config_of(ServeArgs {
            id: Some("1".into()),
            member: vec![member.clone()],
            ..ServeArgs::default()
        })
        .unwrap();
        assert!(default.metrics_listen.is_empty(), "off unless asked");
        for (urls, says) in [
            ("https://127.0.0.1:2381", "plain HTTP only"),
            ("127.0.0.1:2381", "must start with http://"),
            ("http://localhost:2381", "IP address and port"),
            (" , ", "names no URL"),
        ] {
            let error = config_of(ServeArgs {
                id: Some("1".into()),
                member: vec![member.clone()],
                listen_metrics: Some(urls.into()),
                ..ServeArgs::default()
            })
            .unwrap_err();
            assert!(error.contains(says), "{urls:?}: {error}");
        }
    }

    #[test]
    fn members_parse_and_bad_ones_say_why() {
        let (id, addrs) = parse_member("2=127.0.0.1:22380,http://127.0.0.1:22379").unwrap();
        assert_eq!(id, 2);
        assert_eq!(addrs.peer_addr, "127.0.0.1:22380");
        assert_eq!(addrs.client_url, "http://127.0.0.1:22379");
        assert!(parse_member("x=a,http://b")
            .unwrap_err()
            .contains("not a hexadecimal number"));
        assert!(parse_member("0=a,http://b")
            .unwrap_err()
            .contains("start at 1"));
        assert!(parse_member("1=a").unwrap_err().contains("expected"));
        assert!(parse_member("1=a,b").unwrap_err().contains("http://"));
    }

    #[test]
    fn ids_are_read_in_hexadecimal_as_etcdctl_prints_them() {
        assert_eq!(parse_id("a"), Ok(10));
        assert_eq!(parse_id("10"), Ok(16));
        assert_eq!(parse_id("0x8e9e05c52164694d"), Ok(0x8e9e_05c5_2164_694d));
        assert_eq!(parse_id(" 8E9E05C52164694D "), Ok(0x8e9e_05c5_2164_694d));
        assert!(parse_id("0").unwrap_err().contains("start at 1"));
        assert!(parse_id("ten").unwrap_err().contains("hexadecimal"));
        assert!(parse_id("1ffffffffffffffff").is_err());
        let (id, addrs) = parse_member("a=127.0.0.1:1,http://127.0.0.1:2").unwrap();
        assert_eq!((id, addrs.name.as_str()), (10, "ferry-a"));
        let config = config_of(ServeArgs {
            id: Some("0xa".into()),
            member: vec!["a=127.0.0.1:1,http://127.0.0.1:2".into()],
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(config.node_id, 10);
    }

    #[test]
    fn a_toml_file_gives_the_id_as_a_hexadecimal_string() {
        let dir = std::env::temp_dir().join(format!("ferry-serve-toml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("node.toml");
        std::fs::write(
            &path,
            "id = \"b\"\nmember = [\"b=127.0.0.1:1,http://127.0.0.1:2\"]\n",
        )
        .unwrap();
        let config = config_of(ServeArgs {
            config: Some(path.clone()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(config.node_id, 11);
        std::fs::write(&path, "id = 11\n").unwrap();
        let error = config_of(ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert!(error.contains("expected a string"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_node_must_be_among_its_members() {
        let args = ServeArgs {
            id: Some("3".into()),
            member: vec!["1=127.0.0.1:1,http://127.0.0.1:2".into()],
            ..ServeArgs::default()
        };
        assert!(config_of(args)
            .unwrap_err()
            .contains("not among the members"));
    }

    #[test]
    fn connection_and_storage_limits_reach_the_config_of() {
        let config = config_of(ServeArgs {
            id: Some("1".into()),
            max_client_connections: Some(500),
            max_connections_per_ip: Some(8),
            max_peer_connections: Some(12),
            reserved_fds: Some(100),
            client_handshake_timeout_ms: Some(1500),
            client_idle_timeout_ms: Some(9000),
            peer_read_timeout_ms: Some(4000),
            peer_buffered_bytes_max: Some(1 << 30),
            wal_segment_bytes: Some(1 << 20),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(config.max_client_connections, Some(500));
        assert_eq!(config.max_connections_per_ip, 8);
        assert_eq!(config.max_peer_connections, 12);
        assert_eq!(config.reserved_fds, 100);
        let timeouts = config.api_options.client_timeouts;
        assert_eq!(timeouts.handshake, Duration::from_millis(1500));
        assert_eq!(timeouts.idle, Duration::from_millis(9000));
        assert_eq!(config.peer_read_timeout, Duration::from_millis(4000));
        assert_eq!(config.peer_buffered_bytes_max, 1 << 30);
        assert_eq!(config.wal_segment_size_bytes_max, 1 << 20);
        // Without flags: the limits come from the open files limit.
        let defaults = config_of(ServeArgs {
            id: Some("1".into()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(defaults.max_client_connections, None);
        for zero in [
            ServeArgs {
                max_connections_per_ip: Some(0),
                ..ServeArgs::default()
            },
            ServeArgs {
                client_idle_timeout_ms: Some(0),
                ..ServeArgs::default()
            },
            ServeArgs {
                wal_segment_bytes: Some(0),
                ..ServeArgs::default()
            },
        ] {
            let error = config_of(ServeArgs {
                id: Some("1".into()),
                ..zero
            })
            .unwrap_err();
            assert!(error.contains("at least 1"), "{error}");
        }
    }

    #[test]
    fn limits_come_from_etcds_flags_and_are_checked() {
        let base = || ServeArgs {
            id: Some("1".into()),
            ..ServeArgs::default()
        };
        let config = config_of(ServeArgs {
            max_request_bytes: Some(4096),
            max_txn_ops: Some(16),
            max_txn_response_bytes: Some(1 << 20),
            max_watcher_queued_bytes: Some(1000),
            max_watch_stream_queued_bytes: Some(2000),
            max_watch_queued_bytes: Some(3000),
            ..base()
        })
        .unwrap();
        assert_eq!(config.kv_limits.request_size_bytes_max, 4096);
        assert_eq!(config.kv_limits.txn_ops_max, 16);
        assert_eq!(config.kv_limits.txn_response_bytes_max, 1 << 20);
        assert_eq!(config.watch_limits.watcher_queued_bytes_max, 1000);
        assert_eq!(config.watch_limits.stream_queued_bytes_max, 2000);
        assert_eq!(config.watch_limits.node_queued_bytes_max, 3000);
        let defaults = config_of(base()).unwrap();
        assert_eq!(defaults.kv_limits.txn_ops_max, 128);
        assert_eq!(defaults.kv_limits.request_size_bytes_max, 1536 * 1024);
        let error = config_of(ServeArgs {
            max_txn_ops: Some(0),
            ..base()
        })
        .unwrap_err();
        assert!(error.contains("--max-txn-ops"), "{error}");
        let error = config_of(ServeArgs {
            max_request_bytes: Some(64 << 20),
            ..base()
        })
        .unwrap_err();
        assert!(error.contains("--max-request-bytes"), "{error}");
    }

    #[test]
    fn a_lone_node_founds_a_cluster_of_itself() {
        let config = config_of(ServeArgs {
            id: Some("1".into()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(config.members.keys().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!(config.client_listen.port(), 2379);
    }

    #[test]
    fn worker_threads_come_from_the_flag_over_the_file_and_are_checked() {
        assert_eq!(threads_of(&ServeArgs::default()), Ok(None));
        let flag = |threads| ServeArgs {
            worker_threads: Some(threads),
            ..ServeArgs::default()
        };
        assert_eq!(threads_of(&flag(1)), Ok(Some(1)));
        assert_eq!(
            threads_of(&flag(WORKER_THREADS_MAX)),
            Ok(Some(WORKER_THREADS_MAX))
        );
        for threads in [0, WORKER_THREADS_MAX + 1, usize::MAX] {
            let error = threads_of(&flag(threads)).unwrap_err();
            assert!(error.contains("--worker-threads"), "{error}");
        }
        let dir = std::env::temp_dir().join(format!("ferry-serve-threads-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("node.toml");
        std::fs::write(&path, "worker_threads = 3\n").unwrap();
        let from_file = ServeArgs {
            config: Some(path.clone()),
            ..ServeArgs::default()
        };
        assert_eq!(threads_of(&from_file), Ok(Some(3)));
        let flag_wins = ServeArgs {
            worker_threads: Some(2),
            ..from_file
        };
        assert_eq!(threads_of(&flag_wins), Ok(Some(2)));
        std::fs::write(&path, "worker_threads = 0\n").unwrap();
        let error = threads_of(&ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert!(error.contains("give 1 to"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
