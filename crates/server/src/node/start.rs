//! Starting a node: the runtime's host with the key-value group on it, the
//! etcd API in front, and the node's own housekeeping beside them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use ferry_raft::{GroupId, NodeId, Options, Role};
use ferry_runtime::{
    GroupError, GroupEvent, GroupHandle, HostConfig, HostError, Membership, NodeHost,
    SnapshotPolicy,
};
use ferry_storage::{StorageError, WalOptions};

use super::backend::RaftBackend;
use super::config::NodeConfig;
use super::machine::{KvMachine, StoreHome};
use super::member_addrs;
use crate::api::{ClientListener, EtcdApi};
use crate::connections::{bind_listener, open_files_limit, split_descriptors, ConnectionLimits};
use crate::kv_state::KvState;
use crate::member_id::Hex;
use crate::metrics::{serve_metrics, MetricsListener, NodeMetrics};
use crate::state::{SharedState, StateMachine};
use crate::tls::{ReloadableTls, TlsError, ALPN_H2, ALPN_HTTP1};

/// The one Raft group of the key-value store.
pub const KV_GROUP: GroupId = 1;
/// Most leases one expiry proposal removes.
const EXPIRED_LEASES_PER_COMMAND_MAX: usize = 64;
/// Least election timeouts a removed member's link is kept: longer than
/// the engine goes on replicating to it (four of the longest election
/// timeouts, twice the least), so that it can learn of its removal.
const RETIRING_LINK_ELECTION_TIMEOUTS: u64 = 10;
/// Ticks before this node publishes its own addresses again when its
/// record is not in yet: time for the proposal to apply.
const SELF_PUBLISH_RETRY_TICKS: u64 = 50;

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The storage could not be opened or recovered.
    #[error("storage in {dir}: {source}")]
    Storage {
        /// The data directory.
        dir: String,
        /// The cause.
        source: StorageError,
    },
    /// The peer transport could not start.
    #[error(transparent)]
    Transport(#[from] crate::peer::TransportError),
    /// The key-value group could not start (its stored state was refused,
    /// or its snapshot does not restore).
    #[error("cannot start the key-value group: {0}")]
    Group(#[from] GroupError),
    /// The auth token settings are unusable (a JWT key cannot be read).
    #[error("auth tokens: {0}")]
    AuthTokens(String),
    /// The key-value state on disk cannot be opened.
    #[error("{0}")]
    KvStore(String),
    /// Certificates could not be loaded (a missing file, bad PEM, a key
    /// that is not the certificate's).
    #[error("{side} TLS: {source}")]
    Tls {
        /// "client" or "peer".
        side: &'static str,
        /// The cause.
        source: TlsError,
    },
    /// A client port is to serve TLS but no certificate was given.
    #[error(
        "the client port {0} is to serve TLS (https), but no --cert-file and --key-file were given"
    )]
    TlsWithoutCertificate(SocketAddr),
    /// The client port could not be bound.
    #[error("cannot listen for clients on {addr}: {source}; is another process using the port?")]
    ClientBind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The metrics port could not be bound.
    #[error("cannot listen for metrics on {addr}: {source}; is another process using the port?")]
    MetricsBind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

impl From<HostError> for StartError {
    fn from(error: HostError) -> Self {
        match error {
            HostError::Storage { dir, source } => StartError::Storage { dir, source },
            HostError::Transport(error) => StartError::Transport(error),
        }
    }
}

/// A running node: its API, its host and its housekeeping.
pub struct RunningNode {
    /// The backend the API runs on.
    pub backend: Arc<RaftBackend>,
    /// Where the etcd API listens.
    pub client_addr: SocketAddr,
    /// Where peers connect.
    pub peer_addr: SocketAddr,
    /// Every client port, with whether it serves TLS (the first is
    /// `client_addr`).
    pub client_addrs: Vec<(SocketAddr, bool)>,
    /// Where the metrics port listens (`--listen-metrics`), if anywhere.
    pub metrics_addrs: Vec<SocketAddr>,
    /// The certificates in use (client side, peer side), for reloading.
    pub tls: Vec<Arc<ReloadableTls>>,
    tls_watch: Option<JoinHandle<()>>,
    host: NodeHost,
    shutdown: watch::Sender<bool>,
    housekeeping: JoinHandle<()>,
    api: JoinHandle<()>,
    metrics: Option<JoinHandle<()>>,
}

impl RunningNode {
    /// Stops accepting clients, syncs the log and stops.
    pub async fn shutdown(self) {
        if let Some(watch) = &self.tls_watch {
            watch.abort();
        }
        let _ = self.shutdown.send(true);
        let _ = self.api.await;
        if let Some(metrics) = self.metrics {
            let _ = metrics.await;
        }
        let _ = self.housekeeping.await;
        self.host.shutdown().await;
        tracing::info!("node stopped cleanly");
    }

    /// Reads every certificate file again (SIGHUP): new handshakes use the
    /// new certificates, open connections keep theirs, and files that do
    /// not load leave the previous certificates in force (logged).
    pub fn reload_tls(&self) {
        for tls in &self.tls {
            let _ = tls.reload();
        }
    }

    /// Resolves when the node stops by itself (a storage failure).
    pub async fn stopped(&mut self) {
        let reason = self.host.stopped().await;
        tracing::error!("the node stopped: {reason}");
    }
}

/// Opens the node's storage, recovers its state and starts the host, the
/// key-value group and the etcd API.
pub async fn start_node(config: NodeConfig) -> Result<RunningNode, StartError> {
    // Connections get what the open files limit leaves after a reserve for
    // the storage, so that no number of them can keep the log from
    // creating its next segment.
    let open_files = match open_files_limit() {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "cannot read the open files limit; assuming 1024");
            1024
        }
    };
    // The metrics port's connections come out of the reserve's side, so
    // that they take nothing from the storage's share.
    let metrics_connections = if config.metrics_listen.is_empty() {
        0
    } else {
        config.metrics_options.connection_limits.connections_max
    };
    let split = split_descriptors(
        open_files,
        config
            .reserved_fds
            .saturating_add(u64::try_from(metrics_connections).unwrap_or(u64::MAX)),
        config.max_client_connections,
        config.max_peer_connections,
    );
    if let Some(warning) = &split.warning {
        tracing::warn!("{warning}");
    }
    let per_ip = config.max_connections_per_ip.max(1);
    let client_limits = ConnectionLimits {
        connections_max: split.client_connections_max,
        connections_per_ip_max: per_ip.min(split.client_connections_max),
    };
    let peer_limits = ConnectionLimits {
        connections_max: split.peer_connections_max,
        connections_per_ip_max: per_ip.min(split.peer_connections_max),
    };
    tracing::info!(
        open_files,
        reserved_fds = config.reserved_fds,
        client_connections_max = client_limits.connections_max,
        peer_connections_max = peer_limits.connections_max,
        connections_per_ip_max = per_ip,
        "connection limits"
    );

    // A log that lost data it had synced (`StorageError::LostSyncedData`)
    // is refused here like corruption: the node must not start, least of
    // all as a voter, and the error's message names the way back.
    // Certificates first: a mistake in them is reported before anything
    // else starts.
    let peer_tls = config
        .peer_tls
        .clone()
        .map(|files| ReloadableTls::load("peer", files, &[]))
        .transpose()
        .map_err(|source| StartError::Tls {
            side: "peer",
            source,
        })?;
    let client_tls = config
        .client_tls
        .clone()
        .map(|files| ReloadableTls::load("client", files, &[ALPN_H2, ALPN_HTTP1]))
        .transpose()
        .map_err(|source| StartError::Tls {
            side: "client",
            source,
        })?;
    let mut host_settings = host_config(&config, peer_limits);
    host_settings.peer_tls = peer_tls.clone();
    let host = NodeHost::start(host_settings).await?;
    let peer_addr = host.peer_addr();

    // On disk, the key-value state lives beside the log and only what was
    // applied after its last flush is applied again; in memory, it is
    // restored from the runtime's snapshot.
    let (home, kv) = if config.kv_on_disk {
        let (home, kv) = StoreHome::open(
            ferry_storage::AnyDisk::Fs(ferry_storage::FsDisk),
            &config.data_dir.join(super::KV_DIR),
            config.kv_limits.clone(),
            config.snapshot_entries(),
        )
        .map_err(StartError::KvStore)?;
        (Some(Arc::new(home)), kv)
    } else {
        // A state kept on disk is not in the snapshots an in-memory start
        // would restore from: starting so would serve an empty or old store.
        let kv_dir = config.data_dir.join(super::KV_DIR);
        if kv_dir.exists() {
            return Err(StartError::KvStore(format!(
                "the key-value state of this data directory is kept on disk ({}); start it without --kv-in-memory",
                kv_dir.display()
            )));
        }
        (None, KvState::new(config.kv_limits.clone()))
    };
    let state = Arc::new(SharedState::new(StateMachine::with_kv(
        kv,
        config.watch_limits.clone(),
    )));
    // One clock for lease deadlines: the machine starts them when it
    // applies a grant, the leader expires them, the API renews them.
    let clock_origin = Instant::now();
    let (events_tx, events) = mpsc::unbounded_channel();
    let machine = KvMachine::new(
        state.clone(),
        config.kv_limits.clone(),
        clock_origin,
        events_tx,
    );
    let machine = match home.clone() {
        Some(home) => machine.on_disk(home),
        None => machine,
    };
    // A joining node founds nothing: it starts with an empty configuration
    // and learns the real one from the leader.
    let membership = if config.join {
        Membership::Join
    } else {
        Membership::Found(config.members.keys().copied().collect())
    };
    let group = host.start_group(KV_GROUP, membership, machine).await?;

    let mut listeners = Vec::new();
    let mut client_addrs = Vec::new();
    let ports = std::iter::once(super::ClientListen {
        addr: config.client_listen,
        tls: config.client_listen_tls,
    })
    .chain(config.client_listen_more.iter().copied());
    for port in ports {
        let tls = match (port.tls, &client_tls) {
            (false, _) => None,
            (true, Some(tls)) => Some(tls.clone()),
            (true, None) => return Err(StartError::TlsWithoutCertificate(port.addr)),
        };
        let bind_error = |source| StartError::ClientBind {
            addr: port.addr,
            source,
        };
        let listener = bind_listener(port.addr).map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        client_addrs.push((addr, port.tls));
        listeners.push(ClientListener { listener, tls });
    }
    let client_addr = client_addrs
        .first()
        .map_or(config.client_listen, |(addr, _)| *addr);
    let mut metrics_listeners = Vec::new();
    let mut metrics_addrs = Vec::new();
    for addr in &config.metrics_listen {
        let bind_error = |source| StartError::MetricsBind {
            addr: *addr,
            source,
        };
        let listener = bind_listener(*addr).map_err(bind_error)?;
        metrics_addrs.push(listener.local_addr().map_err(bind_error)?);
        metrics_listeners.push(MetricsListener { listener });
    }
    let tls: Vec<Arc<ReloadableTls>> = client_tls.into_iter().chain(peer_tls).collect();
    let tls_watch = (!tls.is_empty())
        .then(|| crate::tls::spawn_reload_watch(tls.clone(), config.tls_reload_interval));

    let backend = Arc::new(RaftBackend::new(
        state.clone(),
        group.clone(),
        host.clone(),
        config.clone(),
        clock_origin,
        home.clone(),
    ));
    let (shutdown, shutdown_rx) = watch::channel(false);

    let mut api_options = config.api_options.clone();
    api_options.connection_limits = client_limits;
    let tokens =
        crate::auth_token::Tokens::new(&api_options.auth.token, api_options.auth.token_ttl)
            .map_err(StartError::AuthTokens)?;
    let api = EtcdApi::with_tokens(backend.clone(), api_options, Arc::new(tokens));
    let metrics_task = (!metrics_listeners.is_empty()).then(|| {
        let node_metrics = NodeMetrics::new(backend.clone(), api.grpc_metrics());
        let mut options = config.metrics_options;
        options.connection_limits.connections_per_ip_max =
            options.connection_limits.connections_per_ip_max.min(per_ip);
        tokio::spawn(serve_metrics(
            metrics_listeners,
            node_metrics,
            options,
            shutdown_rx.clone(),
        ))
    });
    let mut api_shutdown = shutdown_rx.clone();
    let api_task = tokio::spawn(async move {
        let stop = async move {
            let _ = api_shutdown.wait_for(|stop| *stop).await;
        };
        api.serve_on(listeners, stop).await;
    });

    let housekeeping = Housekeeping {
        host: host.clone(),
        group,
        state,
        config,
        clock_origin,
        ticks: 0,
        self_publish_tick: 0,
        retiring: BTreeMap::new(),
        dialed_at: BTreeMap::new(),
        disk_low: false,
        home,
    };
    let housekeeping = tokio::spawn(housekeeping.run(events, shutdown_rx));
    Ok(RunningNode {
        backend,
        client_addr,
        peer_addr,
        client_addrs,
        metrics_addrs,
        tls,
        tls_watch,
        host,
        shutdown,
        housekeeping,
        api: api_task,
        metrics: metrics_task,
    })
}

/// The runtime's settings for this node.
fn host_config(config: &NodeConfig, peer_limits: ConnectionLimits) -> HostConfig {
    let mut host = HostConfig::new(config.node_id, &config.data_dir, config.peer_listen);
    host.cluster_id = config.cluster_id;
    host.peers = config
        .members
        .iter()
        .filter(|(id, _)| **id != config.node_id)
        .map(|(id, addrs)| (*id, addrs.peer_addr.clone()))
        .collect();
    host.tick_interval = config.tick_interval;
    let mut engine = Options::new(config.node_id, KV_GROUP);
    engine.election_timeout_ticks = config.election_timeout_ticks;
    engine.heartbeat_interval_ticks = config.heartbeat_interval_ticks;
    engine.compaction_lag_entries = config.compaction_lag_entries;
    let request_timeout_ticks =
        (config.request_timeout.as_millis() / config.tick_interval.as_millis().max(1)).max(1);
    engine.request_timeout_ticks = u32::try_from(request_timeout_ticks).unwrap_or(u32::MAX);
    host.engine = engine;
    host.snapshot_policy = SnapshotPolicy {
        entries_max: Some(config.snapshot_entries()),
        ..SnapshotPolicy::default()
    };
    // One group: its machine's apply path is one worker; a second would
    // only wait.
    host.workers = 1;
    host.wal = WalOptions {
        segment_size_bytes_max: config.wal_segment_size_bytes_max.max(1),
        ..WalOptions::default()
    };
    host.peer_connection_limits = peer_limits;
    host.peer_read_timeout = config.peer_read_timeout;
    host.peer_buffered_bytes_max = config.peer_buffered_bytes_max;
    host
}

/// What the node does besides running its group: lease expiry on the
/// leader, publishing its own addresses, and dialing exactly the members.
struct Housekeeping {
    host: NodeHost,
    group: GroupHandle<KvMachine>,
    state: Arc<SharedState>,
    config: NodeConfig,
    clock_origin: Instant,
    ticks: u64,
    /// The tick at or after which this node (re)publishes its addresses.
    self_publish_tick: u64,
    /// Links to removed members kept until the tick given.
    retiring: BTreeMap<NodeId, u64>,
    /// The address each peer this task dialed is dialed at, so that a
    /// member whose peer URL was changed (MemberUpdate) is dialed again at
    /// the new one.
    dialed_at: BTreeMap<NodeId, String>,
    /// Whether the data directory's free space was below the reserve at
    /// the last look (to log the crossing once each way).
    disk_low: bool,
    /// Where the key-value state lives on disk (`None`: in memory).
    home: Option<Arc<StoreHome>>,
}

/// Ticks between two looks at the data directory's free space.
const DISK_SPACE_CHECK_TICKS: u64 = 10;

impl Housekeeping {
    async fn run(
        mut self,
        mut events: mpsc::UnboundedReceiver<GroupEvent>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut ticker = tokio::time::interval(self.config.tick_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|stop| *stop) => break,
                Some(event) = events.recv() => self.on_event(event),
                _ = ticker.tick() => self.on_tick(),
            }
        }
    }

    fn on_event(&mut self, event: GroupEvent) {
        match event {
            // The runtime logs it, with the member, term and index.
            GroupEvent::RoleChanged { .. } => {}
            GroupEvent::ConfigChanged(_) => self.reconcile_peers(),
            GroupEvent::Removed => {
                tracing::warn!("this node was removed from the cluster; it serves no more requests")
            }
            GroupEvent::Halted(fault) => tracing::error!(
                "this node halted on a detected fault: {fault}; it serves no more requests"
            ),
        }
    }

    fn on_tick(&mut self) {
        self.ticks += 1;
        // Applied member records may name the address of a member the
        // configuration already has.
        self.reconcile_peers();
        self.drop_retired_links();
        self.expire_leases();
        self.publish_self();
        if self.ticks % DISK_SPACE_CHECK_TICKS == 0 {
            self.watch_disk_space();
        }
    }

    /// Raises this member's NOSPACE alarm when the data directory's free
    /// space falls below the reserve (see [`super::disk_space`]) or the
    /// log or the store found the disk full, and again on a later look
    /// while that lasts and the alarm is not raised (a disarm before space
    /// came back). An operator clears it
    /// with `etcdctl alarm disarm` once there is room again, as for the
    /// quota.
    fn watch_disk_space(&mut self) {
        let reserve = self.config.disk_reserve_bytes;
        let available = if reserve == 0 {
            u64::MAX
        } else {
            match super::disk_space::available_bytes(&self.config.data_dir) {
                Ok(available) => available,
                Err(error) => {
                    tracing::debug!(%error, "cannot read the data directory's free space");
                    u64::MAX
                }
            }
        };
        // A log or a store that found its disk full is as low as can be,
        // whatever the reserve (another process may have filled it).
        let low = available < reserve
            || self.host.log_disk_full()
            || self.home.as_ref().is_some_and(|home| home.out_of_space());
        if low != self.disk_low {
            if low {
                tracing::warn!(
                    available_bytes = available,
                    disk_reserve_bytes = reserve,
                    "the data directory's disk is nearly full: raising the NOSPACE alarm (writes that grow the store are refused until `etcdctl alarm disarm` once there is room)"
                );
            } else {
                tracing::info!(
                    available_bytes = available,
                    "the data directory's disk has room again; `etcdctl alarm disarm` lets writes in"
                );
            }
            self.disk_low = low;
        }
        let member_id = self.config.node_id;
        if low && !self.state.lock().kv().no_space_raised_by(member_id) {
            let raise = crate::command::raise_no_space(member_id);
            self.propose_unanswered(crate::command::encode_command(&raise));
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Proposes a command nobody waits for: a lost one is proposed again
    /// on a later tick.
    fn propose_unanswered(&self, command: Vec<u8>) {
        let group = self.group.clone();
        tokio::spawn(async move {
            if let Err(error) = group.propose(Bytes::from(command)).await {
                tracing::debug!(%error, "a housekeeping proposal did not go through; it is made again");
            }
        });
    }

    /// The leader decides lease expiry by its clock and replicates it.
    fn expire_leases(&mut self) {
        if self.group.view_with(|view| view.role) != Role::Leader {
            return;
        }
        let now_ms = self.now_ms();
        let command = self
            .state
            .lock()
            .expired_leases(now_ms, EXPIRED_LEASES_PER_COMMAND_MAX);
        if let Some(command) = command {
            self.propose_unanswered(crate::command::encode_command(&command));
        }
    }

    /// Makes the host dial exactly the other members of the current
    /// configuration, at the addresses known for them. A member whose
    /// address is not known yet (its record is not applied yet) is dialed
    /// once it is.
    fn reconcile_peers(&mut self) {
        let members = self.group.view_with(|view| view.config.members());
        let dialed = self.host.dialed_peers();
        let known: Vec<(NodeId, String)> = {
            let machine = self.state.lock();
            members
                .iter()
                .filter(|id| **id != self.config.node_id)
                .filter_map(|id| {
                    member_addrs(&self.config.members, machine.kv().member_records(), *id)
                        .filter(|addrs| !addrs.peer_addr.is_empty())
                        .map(|addrs| (*id, addrs.peer_addr))
                })
                .collect()
        };
        for (id, addr) in known {
            if dialed.contains(&id) {
                // The founding members are dialed by the host at the
                // addresses given on the command line.
                let dialed_at = self.dialed_at.entry(id).or_insert_with(|| {
                    self.config
                        .members
                        .get(&id)
                        .map(|founding| founding.peer_addr.clone())
                        .unwrap_or_else(|| addr.clone())
                });
                if *dialed_at == addr {
                    continue;
                }
                tracing::info!(peer = %Hex(id), old = %dialed_at, new = %addr, "a member's peer URL changed; dialing it at the new one");
                self.host.remove_peer(id);
            } else {
                tracing::info!(peer = %Hex(id), %addr, "dialing a new member");
            }
            self.dialed_at.insert(id, addr.clone());
            self.host.add_peer(id, addr);
        }
        // A removed member keeps its link for a while: the leader goes on
        // replicating to it so that it learns of its removal (and stops
        // serving); cut at once, it would never hear of it.
        let grace_ticks =
            RETIRING_LINK_ELECTION_TIMEOUTS * u64::from(self.config.election_timeout_ticks);
        for id in dialed {
            if members.contains(&id) {
                self.retiring.remove(&id);
            } else if !self.retiring.contains_key(&id) {
                tracing::info!(peer = %Hex(id), "a member was removed; dialing it a little longer so that it learns of it");
                self.retiring.insert(id, self.ticks + grace_ticks);
            }
        }
    }

    /// Drops the links of removed members whose grace period is over.
    fn drop_retired_links(&mut self) {
        let now = self.ticks;
        let members = self.group.view_with(|view| view.config.members());
        let due: Vec<NodeId> = self
            .retiring
            .iter()
            .filter(|(_, until)| **until <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.retiring.remove(&id);
            if !members.contains(&id) {
                tracing::info!(peer = %Hex(id), "no longer dialing a removed member");
                self.host.remove_peer(id);
                self.dialed_at.remove(&id);
            }
        }
    }

    /// Records this node's own addresses in the replicated state (as etcd's
    /// members publish theirs), so that every member, and every member added
    /// later, can reach it and forward to it. Retried until the record is in.
    fn publish_self(&mut self) {
        let me = self.config.node_id;
        let (has_leader, is_member) = self
            .group
            .view_with(|view| (view.leader.is_some(), view.config.contains(me)));
        if self.ticks < self.self_publish_tick || !has_leader || !is_member {
            return;
        }
        let Some(mine) = self.config.members.get(&me).cloned() else {
            return;
        };
        let recorded = {
            let machine = self.state.lock();
            machine.kv().member_records().get(&me).cloned()
        };
        // The peer URL is published once; after that only MemberUpdate
        // changes it (as in etcd: the operator updates it, then restarts
        // the member at the new address), so a member still running at
        // the old one does not undo the update.
        let peer_addr_recorded = recorded.as_ref().is_some_and(|r| !r.peer_addr.is_empty());
        if recorded.is_some_and(|r| peer_addr_recorded && r.client_url == mine.client_url) {
            return;
        }
        self.self_publish_tick = self.ticks + SELF_PUBLISH_RETRY_TICKS;
        let record = crate::command::command(crate::command::CommandKind::MemberRecord(
            crate::pb::ferrypb::MemberRecordCommand {
                id: me,
                name: mine.name,
                peer_addr: if peer_addr_recorded {
                    String::new()
                } else {
                    mine.peer_addr
                },
                client_url: mine.client_url,
                create: false,
            },
        ));
        self.propose_unanswered(crate::command::encode_command(&record));
    }
}
