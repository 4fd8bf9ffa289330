//! What a node needs to know to run.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ferry_raft::NodeId;

use crate::api::ApiOptions;
use crate::kv_state::KvLimits;
use crate::metrics::MetricsOptions;
use crate::tls::TlsFiles;
use crate::watch::WatchLimits;

/// Where a member can be reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberAddrs {
    /// The member's name, for people.
    pub name: String,
    /// Its peer address, "host:port".
    pub peer_addr: String,
    /// Its client URL, "http://host:port".
    pub client_url: String,
}

/// A client port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientListen {
    /// Where.
    pub addr: SocketAddr,
    /// Whether it serves TLS (with [`NodeConfig::client_tls`]).
    pub tls: bool,
}

/// The settings of one node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This node's id (nonzero, unique in the cluster).
    pub node_id: NodeId,
    /// The cluster id; peers of other clusters are refused.
    pub cluster_id: u64,
    /// Where the log and snapshots live.
    pub data_dir: PathBuf,
    /// Where to serve the etcd API.
    pub client_listen: SocketAddr,
    /// Whether `client_listen` serves TLS (with `client_tls`).
    pub client_listen_tls: bool,
    /// More client ports besides `client_listen`, each plaintext or TLS
    /// (etcd's `--listen-client-urls http://...,https://...`).
    pub client_listen_more: Vec<ClientListen>,
    /// The certificates of the client ports that serve TLS.
    pub client_tls: Option<TlsFiles>,
    /// Where to accept peer connections.
    pub peer_listen: SocketAddr,
    /// TLS for every peer connection, both ways, or `None` for plain TCP.
    pub peer_tls: Option<TlsFiles>,
    /// How often the certificate files are checked for changes (a changed
    /// file is reloaded; SIGHUP reloads at once).
    pub tls_reload_interval: Duration,
    /// The founding members, this node included (with `join`: the members
    /// to contact, this node included).
    pub members: BTreeMap<NodeId, MemberAddrs>,
    /// Whether this node joins a running cluster (it was added with
    /// MemberAdd) instead of founding one: it starts knowing nothing and
    /// learns the log, the configuration and the state from the leader.
    pub join: bool,
    /// The length of one engine tick.
    pub tick_interval: Duration,
    /// The least election timeout, in ticks.
    pub election_timeout_ticks: u32,
    /// How often the leader sends heartbeats, in ticks.
    pub heartbeat_interval_ticks: u32,
    /// Take a snapshot of the state machine (on disk: a checkpoint) after
    /// this many applied entries; `None` for the default of the mode, see
    /// [`NodeConfig::snapshot_entries`].
    pub snapshot_interval_entries: Option<u64>,
    /// Keep the key-value state on disk (in the data directory's `kv/`),
    /// flushed as it is written (the default), instead of in memory with
    /// whole-state snapshots.
    pub kv_on_disk: bool,
    /// Log entries kept behind a new snapshot, so that a follower a little
    /// behind gets entries instead of the whole snapshot.
    pub compaction_lag_entries: u64,
    /// How long an API call waits for its answer.
    pub request_timeout: Duration,
    /// Limits of the key-value state machine.
    pub kv_limits: KvLimits,
    /// Limits of the watch hub.
    pub watch_limits: WatchLimits,
    /// Settings of the gRPC API. Its connection limits are derived at start
    /// from the fields below and the open files limit.
    pub api_options: ApiOptions,
    /// The most client connections at once; `None` for what the open files
    /// limit leaves after `reserved_fds` and the peers' share (see
    /// [`crate::connections::split_descriptors`]). Never more than that.
    pub max_client_connections: Option<usize>,
    /// The most connections at once from one IP address, on the client and
    /// on the peer listener.
    pub max_connections_per_ip: usize,
    /// The most inbound peer connections at once (members dial one each).
    pub max_peer_connections: usize,
    /// File descriptors kept free of connections: for the log's segments,
    /// snapshot files, directory syncs, outbound peer connections and the
    /// process itself, so that no number of connections can keep the
    /// storage from opening a file.
    pub reserved_fds: u64,
    /// The longest an inbound peer connection may go without a byte.
    pub peer_read_timeout: Duration,
    /// The most bytes held for frames from peers, in all.
    pub peer_buffered_bytes_max: usize,
    /// The size a log segment grows to before the next one is started.
    pub wal_segment_size_bytes_max: u64,
    /// Free bytes on the data directory's file system below which this
    /// member raises the cluster's NOSPACE alarm (0: never), so that the
    /// disk does not fill under the log.
    pub disk_reserve_bytes: u64,
    /// Where to serve metrics and health over HTTP (`--listen-metrics`);
    /// none by default.
    pub metrics_listen: Vec<SocketAddr>,
    /// How the metrics port bounds its clients (its per-address limit is
    /// at most `max_connections_per_ip`; its connections are kept out of
    /// the clients' share of descriptors).
    pub metrics_options: MetricsOptions,
}

impl NodeConfig {
    /// Defaults for node `node_id`: a 100 ms tick, an election timeout of
    /// 1 to 2 s, a heartbeat every 100 ms, a snapshot every
    /// [`NodeConfig::snapshot_entries`] entries.
    pub fn new(
        node_id: NodeId,
        data_dir: PathBuf,
        client_listen: SocketAddr,
        peer_listen: SocketAddr,
        members: BTreeMap<NodeId, MemberAddrs>,
    ) -> NodeConfig {
        NodeConfig {
            node_id,
            cluster_id: 0x_f3e7_7000_0000_0001,
            data_dir,
            client_listen,
            client_listen_tls: false,
            client_listen_more: Vec::new(),
            client_tls: None,
            peer_listen,
            peer_tls: None,
            tls_reload_interval: Duration::from_secs(2),
            members,
            join: false,
            tick_interval: Duration::from_millis(100),
            election_timeout_ticks: 10,
            heartbeat_interval_ticks: 1,
            snapshot_interval_entries: None,
            kv_on_disk: true,
            compaction_lag_entries: 1000,
            request_timeout: Duration::from_secs(7),
            kv_limits: KvLimits::default(),
            watch_limits: WatchLimits::default(),
            api_options: ApiOptions::default(),
            max_client_connections: None,
            max_connections_per_ip: 128,
            max_peer_connections: 32,
            reserved_fds: 64,
            peer_read_timeout: Duration::from_secs(30),
            peer_buffered_bytes_max: 256 << 20,
            wal_segment_size_bytes_max: 64 << 20,
            disk_reserve_bytes: DISK_RESERVE_BYTES_DEFAULT,
            metrics_listen: Vec::new(),
            metrics_options: MetricsOptions::default(),
        }
    }
}

/// Default of [`NodeConfig::disk_reserve_bytes`]: room for the store's
/// flush of a full memtable twice over, and more.
pub const DISK_RESERVE_BYTES_DEFAULT: u64 = 128 << 20;

/// Entries between snapshots of a state kept in memory: each encodes the
/// whole state, so they are kept frequent enough that the log behind one
/// stays short.
pub const IN_MEMORY_SNAPSHOT_ENTRIES: u64 = 10_000;

/// Entries between checkpoints of a state kept on disk (etcd's default
/// `--snapshot-count`). A checkpoint flushes only what changed since the
/// last, and each flush adds a run that merges rewrite, so fewer, larger
/// runs cost fewer bytes per put; the memtable is flushed sooner when it
/// holds [`crate::node::KV_FLUSH_BYTES`] of versions.
pub const ON_DISK_CHECKPOINT_ENTRIES: u64 = 100_000;

impl NodeConfig {
    /// Entries between snapshots (in memory) or checkpoints (on disk): the
    /// one configured, or [`IN_MEMORY_SNAPSHOT_ENTRIES`] or
    /// [`ON_DISK_CHECKPOINT_ENTRIES`].
    pub fn snapshot_entries(&self) -> u64 {
        let default = if self.kv_on_disk {
            ON_DISK_CHECKPOINT_ENTRIES
        } else {
            IN_MEMORY_SNAPSHOT_ENTRIES
        };
        self.snapshot_interval_entries.unwrap_or(default).max(1)
    }
}

/// Where member `id` can be reached: the addresses given on the command
/// line, overlaid by those recorded in the replicated state (members added
/// at run time, and what each member published about itself).
pub(crate) fn member_addrs(
    founding: &BTreeMap<NodeId, MemberAddrs>,
    records: &BTreeMap<u64, crate::pb::ferrypb::MemberRecordCommand>,
    id: NodeId,
) -> Option<MemberAddrs> {
    let mut addrs = founding.get(&id).cloned();
    if let Some(record) = records.get(&id) {
        let known = addrs.get_or_insert_with(|| MemberAddrs {
            name: String::new(),
            peer_addr: String::new(),
            client_url: String::new(),
        });
        if !record.name.is_empty() {
            known.name.clone_from(&record.name);
        }
        if !record.peer_addr.is_empty() {
            known.peer_addr.clone_from(&record.peer_addr);
        }
        if !record.client_url.is_empty() {
            known.client_url.clone_from(&record.client_url);
        }
    }
    addrs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_are_taken_by_the_default_of_the_mode_unless_configured() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut config = NodeConfig::new(1, PathBuf::from("/x"), addr, addr, BTreeMap::new());
        assert!(config.kv_on_disk, "the state is kept on disk by default");
        assert_eq!(config.snapshot_entries(), ON_DISK_CHECKPOINT_ENTRIES);
        config.kv_on_disk = false;
        assert_eq!(config.snapshot_entries(), IN_MEMORY_SNAPSHOT_ENTRIES);
        config.snapshot_interval_entries = Some(500);
        assert_eq!(config.snapshot_entries(), 500);
        config.snapshot_interval_entries = Some(0);
        assert_eq!(config.snapshot_entries(), 1, "never every zero entries");
    }
}
