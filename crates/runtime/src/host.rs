//! The node host: one per process, owning the shared log, the links to
//! peer nodes, the workers, and every group running on them.

use std::collections::{BTreeMap, BTreeSet};
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use ferry_raft::{
    Configuration, GroupId, Index, MembershipChange, NodeId, Options, RaftNode, ReadConsistency,
    Status,
};
use ferry_storage::{FsDisk, GroupRecovery, Storage, WalOptions};

use crate::connections::ConnectionLimits;
use crate::error::{GroupError, HostError};
use crate::group::{Call, Group};
use crate::log_task::{self, LogRequest};
use crate::machine::{Durability, StateMachine};
use crate::member_id::Hex;
use crate::metrics::{
    peer_label, GroupProgress, HostMetrics, QueueDepths, RoundTrips, PING_INTERVAL_TICKS,
};
use crate::snapshot_policy::SnapshotPolicy;
use crate::transport::{decode_message, Transport, TransportConfig, TransportEvent};
use crate::view::GroupView;
use crate::worker::{self, WorkerInput, Workers};

/// The most storage requests queued for the log before workers wait.
const LOG_REQUESTS_QUEUED_MAX: usize = 8192;
/// The most transport events queued before the connections' readers wait.
const TRANSPORT_EVENTS_QUEUED_MAX: usize = 8192;
/// The group id of the host's own messages: a message to group 0 says only
/// that its sender is alive (see [`Liveness`]). No Raft group has id 0.
const HOST_GROUP: GroupId = 0;

/// How a host is set up.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// This node's id, the same in every group it is a member of. Not 0.
    pub node_id: NodeId,
    /// Shared by every node that may talk to this one: checked when a
    /// connection opens, so that nodes of two clusters never mix.
    pub cluster_id: u64,
    /// Where the log and the snapshots live.
    pub data_dir: PathBuf,
    /// Where peer nodes connect.
    pub peer_listen: SocketAddr,
    /// The peer nodes to dial, and where (`host:port`). More can be added
    /// at run time with [`NodeHost::add_peer`].
    pub peers: BTreeMap<NodeId, String>,
    /// How often every group's clock ticks.
    pub tick_interval: Duration,
    /// The engine options every group starts with (their `id` and `group`
    /// are set by the host). Quiescence is on: an idle group sends nothing
    /// and the host's keepalives tell its followers when a leader's node is
    /// gone.
    pub engine: Options,
    /// When in-memory machines are snapshotted.
    pub snapshot_policy: SnapshotPolicy,
    /// How many workers run the groups: the number of cores by default.
    pub workers: usize,
    /// The log's options.
    pub wal: WalOptions,
    /// How many inbound peer connections the host holds, in all and per
    /// source address.
    pub peer_connection_limits: ConnectionLimits,
    /// How long an inbound peer connection may send nothing before it is
    /// closed (the peer dials again).
    pub peer_read_timeout: Duration,
    /// The most bytes held for frames from peers, in all connections.
    pub peer_buffered_bytes_max: usize,
    /// TLS for the peer links (see [`crate::transport::TransportConfig::tls`]).
    pub peer_tls: Option<std::sync::Arc<crate::tls::ReloadableTls>>,
    /// The most messages queued for one peer node before new ones are shed
    /// (the engines' timers send again what matters). Every group's
    /// messages to a node share its queue, so it must hold a tick's worth
    /// of all of them: thousands of groups waking at once send as many
    /// heartbeats in one tick.
    pub peer_queue_messages_max: usize,
}

impl HostConfig {
    /// A host with ferry's defaults (etcd's): 100 ms ticks, an election
    /// timeout of 10 to 20 ticks (1 to 2 s), a heartbeat every tick, one
    /// worker per core.
    pub fn new(node_id: NodeId, data_dir: impl Into<PathBuf>, peer_listen: SocketAddr) -> Self {
        HostConfig {
            node_id,
            cluster_id: 0xf3e7_7000_0000_0001,
            data_dir: data_dir.into(),
            peer_listen,
            peers: BTreeMap::new(),
            tick_interval: Duration::from_millis(100),
            engine: Options {
                quiesce: true,
                ..Options::new(node_id, 0)
            },
            snapshot_policy: SnapshotPolicy::default(),
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            wal: WalOptions::default(),
            peer_connection_limits: ConnectionLimits::default(),
            peer_read_timeout: Duration::from_secs(30),
            peer_buffered_bytes_max: 256 << 20,
            peer_tls: None,
            peer_queue_messages_max: 1 << 16,
        }
    }
}

/// How a group's membership starts when it has no state on disk yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// A founding member of a new group of these voters (this node among
    /// them). Every founder must be given the same set.
    Found(Vec<NodeId>),
    /// A node joining an existing group: it starts empty and learns the
    /// group's configuration from its leader once a member adds it.
    Join,
}

/// The links to peer nodes: one connection each way per pair of nodes,
/// carrying every group's messages.
pub(crate) struct Links {
    transport: RwLock<Transport>,
}

impl Links {
    /// Queues a message for a peer node. Shed if its queue is full: the
    /// engine's timers send again what matters.
    pub(crate) fn send(&self, to: NodeId, payload: Bytes) {
        let transport = self
            .transport
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        transport.send(to, payload);
    }
}

struct HostInner {
    config: HostConfig,
    workers: Workers,
    log: mpsc::Sender<LogRequest>,
    links: Arc<Links>,
    peer_addr: SocketAddr,
    /// Peer nodes whose link to them is up.
    connected: Arc<Mutex<BTreeSet<NodeId>>>,
    /// Set when the log stopped, with why.
    stopped: watch::Receiver<Option<String>>,
    troubles: Arc<log_task::Troubles>,
    counters: Arc<log_task::LogCounters>,
    metrics: Arc<HostMetrics>,
    /// Groups found on disk at start and not started since.
    recovered: Mutex<BTreeMap<GroupId, GroupRecovery>>,
    shutdown: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    log_task: Mutex<Option<JoinHandle<Result<(), log_task::LogFailed>>>>,
}

/// A node host: the one entry point of the runtime. See the crate docs.
#[derive(Clone)]
pub struct NodeHost {
    inner: Arc<HostInner>,
}

impl NodeHost {
    /// Opens the storage in `config.data_dir` (recovering every group it
    /// holds), starts the workers and the log, binds the peer port and
    /// starts dialing the peers. No group runs until it is started.
    pub async fn start(config: HostConfig) -> Result<NodeHost, HostError> {
        let (storage, report) = Storage::open(FsDisk, &config.data_dir, config.wal.clone())
            .map_err(|source| HostError::Storage {
                dir: config.data_dir.display().to_string(),
                source,
            })?;
        if report.wal.truncated_bytes > 0 {
            tracing::warn!(
                bytes = report.wal.truncated_bytes,
                "cut a torn write from the end of the log"
            );
        }
        let (log_tx, log_rx) = mpsc::channel(LOG_REQUESTS_QUEUED_MAX);
        let (workers, mut tasks) =
            worker::spawn(config.workers, config.tick_interval, log_tx.clone());
        let log_workers = workers.clone();
        let counters = Arc::new(log_task::LogCounters::default());
        let troubles = Arc::new(log_task::Troubles::default());
        let metrics = Arc::new(HostMetrics::default());
        let log_metrics = metrics.clone();
        let (stopped_tx, stopped) = watch::channel(None);
        let log_counters = counters.clone();
        let log_troubles = troubles.clone();
        let (shutdown, log_shutdown) = watch::channel(false);
        let log_task = tokio::spawn(async move {
            let outcome = log_task::run(
                storage,
                log_rx,
                log_workers,
                log_counters,
                log_troubles,
                log_metrics,
                log_shutdown,
            )
            .await;
            let reason = match &outcome {
                Ok(()) => "the host stopped".to_string(),
                Err(error) => {
                    tracing::error!(%error, "the log stopped; every group on this node stops");
                    error.to_string()
                }
            };
            let _ = stopped_tx.send(Some(reason));
            outcome
        });

        let (events_tx, events) = mpsc::channel(TRANSPORT_EVENTS_QUEUED_MAX);
        let mut transport_config =
            TransportConfig::new(config.node_id, config.cluster_id, config.peer_listen);
        transport_config.connection_limits = config.peer_connection_limits;
        transport_config.read_timeout = config.peer_read_timeout;
        transport_config.inbound_buffered_bytes_max = config.peer_buffered_bytes_max;
        transport_config.tls = config.peer_tls.clone();
        transport_config.queue_frames_max = config.peer_queue_messages_max;
        transport_config.peers = config
            .peers
            .iter()
            .filter(|(id, _)| **id != config.node_id)
            .map(|(id, addr)| (*id, addr.clone()))
            .collect();
        let transport = Transport::start(transport_config, events_tx).await?;
        let peer_addr = transport.local_addr();
        let connected = Arc::new(Mutex::new(BTreeSet::new()));
        let silence_ticks = config.engine.election_timeout_ticks.max(1);
        let links = Arc::new(Links {
            transport: RwLock::new(transport),
        });
        let round_trips = Arc::new(RoundTrips::new());
        tasks.push(tokio::spawn(route(
            events,
            workers.clone(),
            connected.clone(),
            (config.tick_interval, silence_ticks),
            Pings {
                me: config.node_id,
                links: links.clone(),
                round_trips: round_trips.clone(),
                metrics: metrics.clone(),
            },
        )));
        tasks.push(tokio::spawn(send_keepalives(
            config.node_id,
            config.tick_interval,
            links.clone(),
            round_trips,
        )));
        Ok(NodeHost {
            inner: Arc::new(HostInner {
                config,
                workers,
                log: log_tx,
                links,
                peer_addr,
                connected,
                stopped,
                troubles,
                counters,
                metrics,
                recovered: Mutex::new(report.groups),
                shutdown,
                tasks: Mutex::new(tasks),
                log_task: Mutex::new(Some(log_task)),
            }),
        })
    }

    /// Where peer nodes connect to this one.
    pub fn peer_addr(&self) -> SocketAddr {
        self.inner.peer_addr
    }

    /// The peer nodes whose link is up now.
    pub fn connected_peers(&self) -> BTreeSet<NodeId> {
        lock(&self.inner.connected).clone()
    }

    /// The peer nodes this host dials.
    pub fn dialed_peers(&self) -> Vec<NodeId> {
        self.inner
            .links
            .transport
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .peer_ids()
    }

    /// Storage shortages being waited out now (the log cannot start a new
    /// segment, a snapshot cannot be written), in words, for an operator.
    pub fn troubles(&self) -> Vec<String> {
        self.inner.troubles.list()
    }

    /// Whether the log is waiting for room on its disk (a write found it
    /// full): it holds what it could not write and takes no new work until
    /// a retry succeeds (see the log task). An embedder raises its "out of
    /// space" signal on it (the etcd server raises NOSPACE).
    pub fn log_disk_full(&self) -> bool {
        self.inner.troubles.disk_full()
    }

    /// Resolves when the host's log has stopped: after [`NodeHost::shutdown`],
    /// or by itself when the storage failed (a failed write or sync), with
    /// why. Nothing can be made durable after that.
    pub async fn stopped(&self) -> String {
        let mut stopped = self.inner.stopped.clone();
        let reason = match stopped.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => "the host stopped".into(),
        };
        reason
    }

    /// What the shared log has done since the host started.
    pub fn log_counters(&self) -> &log_task::LogCounters {
        &self.inner.counters
    }

    /// What the host measured since it started (see [`crate::metrics`]).
    pub fn metrics(&self) -> &HostMetrics {
        &self.inner.metrics
    }

    /// How many messages wait in the host's queues now.
    pub fn queue_depths(&self) -> QueueDepths {
        let log = &self.inner.log;
        let transport = self
            .inner
            .links
            .transport
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        QueueDepths {
            log_requests: log.max_capacity().saturating_sub(log.capacity()),
            worker_inputs: self.inner.workers.queued_inputs(),
            transport_events: transport.events_queued(),
            peer_frames: transport.queued_frames(),
            inbound_buffered_bytes: transport.inbound_buffered_bytes(),
        }
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.inner.config.node_id
    }

    /// The groups found on disk at start that have not been started since.
    pub fn recovered_groups(&self) -> Vec<GroupId> {
        lock(&self.inner.recovered).keys().copied().collect()
    }

    /// Starts dialing a peer node (or does nothing if it is dialed).
    pub fn add_peer(&self, id: NodeId, addr: String) {
        let mut transport = self
            .inner
            .links
            .transport
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        transport.add_peer(id, addr);
    }

    /// Stops dialing a peer node.
    pub fn remove_peer(&self, id: NodeId) {
        let mut transport = self
            .inner
            .links
            .transport
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        transport.remove_peer(id);
    }

    /// Starts running `group` with `machine`. A group with state on disk
    /// resumes from it (its machine is restored from its latest snapshot
    /// and the log after it is applied again; `membership` is then
    /// ignored); a new one starts as `membership` says.
    pub async fn start_group<M: StateMachine>(
        &self,
        group: GroupId,
        membership: Membership,
        mut machine: M,
    ) -> Result<GroupHandle<M>, GroupError> {
        if group == 0 {
            return Err(GroupError::Start {
                group,
                reason: "group 0 is reserved".into(),
            });
        }
        let recovery = lock(&self.inner.recovered).remove(&group);
        let fresh = recovery.is_none();
        let recovery = recovery.unwrap_or_default();
        let founders = match &membership {
            Membership::Found(voters) => Configuration::with_voters(voters.iter().copied()),
            Membership::Join => Configuration::default(),
        };
        let restored = recovery.restored_state(founders);
        let mut snapshot_bytes = 0;
        // A machine in memory is restored from the latest snapshot. A
        // durable one holds its own state, and the log was compacted only
        // behind what it made durable, so it stands at or past the
        // snapshot; if it does not, its state is not the one the log was
        // compacted for: a snapshot that holds a whole state (written while
        // the machine was kept in memory) brings it there, and without one
        // the group refuses to start rather than skip what the log no
        // longer holds.
        let index = restored.snapshot.index;
        let needs_snapshot = index > 0
            && match machine.durability() {
                Durability::InMemory => true,
                Durability::Durable => machine.applied_index() < index,
            };
        if needs_snapshot {
            let (reply, answer) = oneshot::channel();
            self.log(LogRequest::ReadSnapshot {
                group,
                index,
                reply,
            })
            .await?;
            let data = answer
                .await
                .map_err(|_| GroupError::NotRunning { group })?
                .map_err(|source| GroupError::Storage { group, source })?
                .ok_or_else(|| GroupError::Start {
                    group,
                    reason: format!("its snapshot {index} is missing"),
                })?;
            if data.is_empty() {
                let reason = match machine.durability() {
                    Durability::InMemory => format!(
                        "snapshot {index} holds no state: it was taken by a machine that keeps \
                         its state on disk, and this one keeps it in memory"
                    ),
                    Durability::Durable => format!(
                        "the state machine's own state stands at index {}, but the log was \
                         compacted through {index}: its state is missing or older than the log \
                         (restore the data directory, or remove the member and add it back)",
                        machine.applied_index()
                    ),
                };
                return Err(GroupError::Start { group, reason });
            }
            machine
                .restore(&mut &data[..])
                .map_err(|error| GroupError::Start {
                    group,
                    reason: format!("snapshot {index}: {error}"),
                })?;
            snapshot_bytes = data.len() as u64;
        }
        let mut options = self.inner.config.engine.clone();
        options.id = self.inner.config.node_id;
        options.group = group;
        // Election timeouts must differ between nodes, groups and restarts.
        let wall_nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos() as u64);
        let seed = self.inner.config.node_id.rotate_left(32)
            ^ group.rotate_left(16)
            ^ wall_nanos
            ^ u64::from(std::process::id());
        let snapshot_index = restored.snapshot.index;
        let node = RaftNode::new(options, restored, seed).map_err(|error| GroupError::Start {
            group,
            reason: error.to_string(),
        })?;
        let view = Arc::new(Mutex::new(GroupView::default()));
        let runner = Group::new(
            group,
            node,
            machine,
            self.inner.links.clone(),
            self.inner.workers.clone(),
            view.clone(),
            self.inner.config.snapshot_policy,
            (snapshot_index, snapshot_bytes),
            self.inner.metrics.clone(),
        );
        let (reply, started) = oneshot::channel();
        let sent = self
            .inner
            .workers
            .input(
                group,
                WorkerInput::Start {
                    group,
                    runner: Box::new(runner),
                    reply,
                },
            )
            .await;
        if !sent {
            return Err(GroupError::NotRunning { group });
        }
        started
            .await
            .map_err(|_| GroupError::NotRunning { group })??;
        tracing::debug!(group, node = %Hex(self.node_id()), fresh, "group started");
        Ok(GroupHandle {
            group,
            workers: self.inner.workers.clone(),
            view,
            reads: Arc::default(),
            metrics: self.inner.metrics.clone(),
            machine: PhantomData,
        })
    }

    /// Stops running `group` on this node; its data stays, and it can be
    /// started again. Callers waiting on it get [`GroupError::NotRunning`].
    pub async fn stop_group(&self, group: GroupId) -> Result<(), GroupError> {
        let (reply, stopped) = oneshot::channel();
        if !self
            .inner
            .workers
            .input(group, WorkerInput::Stop { group, reply })
            .await
        {
            return Err(GroupError::NotRunning { group });
        }
        stopped
            .await
            .map_err(|_| GroupError::NotRunning { group })??;
        // Started again, it recovers from what the log holds now.
        let (reply, recovered) = oneshot::channel();
        self.log(LogRequest::Recover { group, reply }).await?;
        if let Ok(Ok(Some(recovery))) = recovered.await {
            lock(&self.inner.recovered).insert(group, recovery);
        }
        Ok(())
    }

    /// Stops `group` if it runs and deletes its log and snapshots on this
    /// node (after it was removed from the group, or the group is gone).
    pub async fn destroy_group(&self, group: GroupId) -> Result<(), GroupError> {
        match self.stop_group(group).await {
            Ok(()) | Err(GroupError::NotRunning { .. }) => {}
            Err(error) => return Err(error),
        }
        lock(&self.inner.recovered).remove(&group);
        let (reply, removed) = oneshot::channel();
        self.log(LogRequest::RemoveGroup { group, reply }).await?;
        removed
            .await
            .map_err(|_| GroupError::NotRunning { group })?
            .map_err(|source| GroupError::Storage { group, source })
    }

    /// Stops every group, syncs the log and closes the links.
    pub async fn shutdown(self) {
        let _ = self.inner.shutdown.send(true);
        let tasks = std::mem::take(&mut *lock(&self.inner.tasks));
        for task in &tasks {
            task.abort();
        }
        {
            let transport = self
                .inner
                .links
                .transport
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            transport.shutdown();
        }
        for task in tasks {
            let _ = task.await;
        }
        // The workers are gone; the log syncs what it holds and stops.
        let log_task = lock(&self.inner.log_task).take();
        if let Some(task) = log_task {
            let _ = task.await;
        }
    }

    async fn log(&self, request: LogRequest) -> Result<(), GroupError> {
        self.inner
            .log
            .send(request)
            .await
            .map_err(|_| GroupError::NotRunning { group: 0 })
    }
}

/// What the router needs to answer pings and time pongs.
struct Pings {
    me: NodeId,
    links: Arc<Links>,
    round_trips: Arc<RoundTrips>,
    metrics: Arc<HostMetrics>,
}

impl Pings {
    /// Answers a host message from `from`: a ping gets its pong, a pong
    /// that answers the ping in flight is a round trip; anything else only
    /// says that the peer is alive. Hosts that predate pings ignore both.
    fn host_message(&self, from: NodeId, body: &ferry_raft::MessageBody) {
        match body {
            ferry_raft::MessageBody::Heartbeat { read_seq, .. } => {
                let pong = ferry_raft::Message {
                    group: HOST_GROUP,
                    from: self.me,
                    to: from,
                    term: 0,
                    body: ferry_raft::MessageBody::HeartbeatResponse {
                        read_seq: *read_seq,
                        last_index: 0,
                        needs_append: false,
                    },
                };
                self.links
                    .send(from, crate::transport::encode_message(&pong));
            }
            ferry_raft::MessageBody::HeartbeatResponse { read_seq, .. } => {
                if let Some(took) = self.round_trips.pong(from, *read_seq) {
                    self.metrics
                        .peer_round_trip_seconds
                        .get_or_create(&peer_label(from))
                        .observe(took.as_secs_f64());
                }
            }
            _ => {}
        }
    }
}

/// Routes what the transport receives to the workers of the groups.
async fn route(
    mut events: mpsc::Receiver<TransportEvent>,
    workers: Workers,
    connected: Arc<Mutex<BTreeSet<NodeId>>>,
    (tick, silence_ticks): (Duration, u32),
    pings: Pings,
) {
    let mut liveness = Liveness::new(silence_ticks);
    let mut undecodable = crate::log_limit::LogLimiter::for_remote_input();
    // Silence is checked here, between events, so that a peer's groups hear
    // "gone" and "back" in the order its frames arrived.
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let event = tokio::select! {
            event = events.recv() => match event {
                Some(event) => event,
                None => break,
            },
            _ = ticker.tick() => {
                let up: Vec<NodeId> = lock(&connected).iter().copied().collect();
                // Frames waiting here were heard already, just not read yet.
                let caught_up = events.is_empty();
                for peer in liveness.tick(&up, caught_up) {
                    tracing::info!(peer = %Hex(peer), "a peer node sent nothing for an election timeout; its groups are told it is gone");
                    workers
                        .broadcast(|| WorkerInput::PeerDisconnected(peer))
                        .await;
                }
                continue;
            }
        };
        match event {
            TransportEvent::Connected(peer) => {
                lock(&connected).insert(peer);
                liveness.heard(peer);
                workers.broadcast(|| WorkerInput::PeerConnected(peer)).await
            }
            TransportEvent::Disconnected(peer) => {
                lock(&connected).remove(&peer);
                workers
                    .broadcast(|| WorkerInput::PeerDisconnected(peer))
                    .await
            }
            TransportEvent::Received {
                from,
                payload,
                lease,
            } => match decode_message(&payload) {
                Ok(message) if message.from == from => {
                    if liveness.heard(from) {
                        // It was reported silent: every group hears it is
                        // back (and sends what it owes).
                        workers.broadcast(|| WorkerInput::PeerConnected(from)).await;
                    }
                    if message.group == HOST_GROUP {
                        pings.host_message(from, &message.body);
                        continue;
                    }
                    let group = message.group;
                    workers
                        .input(group, WorkerInput::Message(message, lease))
                        .await;
                }
                Ok(message) => {
                    if let Some(suppressed) = undecodable.allow() {
                        tracing::warn!(peer = %Hex(from), claimed = %Hex(message.from), suppressed, "dropping a message with the wrong sender");
                    }
                }
                Err(error) => {
                    if let Some(suppressed) = undecodable.allow() {
                        tracing::warn!(peer = %Hex(from), %error, suppressed, "dropping a message that does not decode");
                    }
                }
            },
        }
    }
}

/// Node-level liveness, one signal per pair of nodes rather than per group.
///
/// Idle groups go quiet (no heartbeats), so a host cannot tell from its
/// groups' traffic whether a peer node is alive; and the followers of a
/// dead quiet leader hold an election only once the host reports the
/// leader disconnected. So every host sends each peer a keepalive (a message
/// to [`HOST_GROUP`]) every tick, and reports a peer whose link is up but
/// which sent nothing for an election timeout as disconnected to every
/// group; the first frame it sends again reports it connected. Kept by the
/// router task alone.
///
/// Silence is counted in the router's own ticks, and only in those it
/// starts with nothing left to read: a router that was held up (its
/// workers' queues full, its threads busy) has the peer's frames waiting
/// and must not take its own delay for the peer's silence. It did: under
/// load, thousands of quiet groups heard their leaders' node was gone,
/// woke at once, and the work of waking kept the router behind.
struct Liveness {
    /// Ticks each peer whose link is up has been silent while the router
    /// was caught up.
    silent_ticks: BTreeMap<NodeId, u32>,
    /// Peers reported silent to the groups.
    silent: BTreeSet<NodeId>,
    /// After how many such ticks a peer is reported silent.
    silence_ticks_max: u32,
}

impl Liveness {
    fn new(silence_ticks_max: u32) -> Liveness {
        Liveness {
            silent_ticks: BTreeMap::new(),
            silent: BTreeSet::new(),
            silence_ticks_max: silence_ticks_max.max(1),
        }
    }

    /// Records a frame from `peer`; true if it had been reported silent.
    fn heard(&mut self, peer: NodeId) -> bool {
        self.silent_ticks.insert(peer, 0);
        self.silent.remove(&peer)
    }

    /// One tick of the router, with the peers whose link is `up` and
    /// whether the router had read every frame that arrived (`caught_up`).
    /// Returns the peers that are now silent, each reported once.
    fn tick(&mut self, up: &[NodeId], caught_up: bool) -> Vec<NodeId> {
        self.silent_ticks.retain(|peer, _| up.contains(peer));
        if !caught_up {
            return Vec::new();
        }
        let mut newly_silent = Vec::new();
        for &peer in up {
            let ticks = self.silent_ticks.entry(peer).or_insert(0);
            *ticks = ticks.saturating_add(1);
            if *ticks > self.silence_ticks_max && self.silent.insert(peer) {
                newly_silent.push(peer);
            }
        }
        newly_silent
    }
}

/// Sends every peer node a keepalive each tick (see [`Liveness`]); every
/// [`PING_INTERVAL_TICKS`] ticks the keepalive is a ping, which the peer
/// answers, for the round trip ([`HostMetrics::peer_round_trip_seconds`]).
async fn send_keepalives(
    me: NodeId,
    tick: Duration,
    links: Arc<Links>,
    round_trips: Arc<RoundTrips>,
) {
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ticks: u64 = 0;
    loop {
        ticker.tick().await;
        ticks = ticks.wrapping_add(1);
        let ping = ticks % PING_INTERVAL_TICKS == 0;
        let peers = links
            .transport
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .peer_ids();
        for peer in peers {
            let body = if ping {
                ferry_raft::MessageBody::Heartbeat {
                    leader_commit: 0,
                    read_seq: round_trips.ping(peer),
                }
            } else {
                ferry_raft::MessageBody::WakeUp
            };
            let keepalive = ferry_raft::Message {
                group: HOST_GROUP,
                from: me,
                to: peer,
                term: 0,
                body,
            };
            links.send(peer, crate::transport::encode_message(&keepalive));
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A handle on one running group of machine `M`: what an embedder calls.
/// Cheap to clone; calls from many tasks at once are fine.
pub struct GroupHandle<M: StateMachine> {
    group: GroupId,
    workers: Workers,
    view: Arc<Mutex<GroupView>>,
    reads: Arc<SharedReads>,
    metrics: Arc<HostMetrics>,
    machine: PhantomData<fn() -> M>,
}

/// The linearizable read barriers of one group on this node, shared among
/// their callers: a caller that asks while a barrier is in flight waits for
/// the next one, which starts when the one in flight ends and answers every
/// caller that asked meanwhile. Each caller's barrier still starts after it
/// asked, so what it reads is linearizable; a node serving many reads at
/// once asks the engine (and, on a follower, the leader) once per round
/// trip instead of once per read.
#[derive(Default)]
struct SharedReads {
    state: Mutex<SharedReadsState>,
}

#[derive(Default)]
struct SharedReadsState {
    /// Whether a task runs barriers for the callers waiting (it takes all
    /// of `waiting` when it starts the next one, and ends when none wait).
    running: bool,
    /// The callers the next barrier answers: its index, or `None` when it
    /// failed (each then asks alone, for its own error).
    waiting: Vec<oneshot::Sender<Option<Index>>>,
}

/// The most callers waiting for a group's next shared barrier; callers
/// past it ask the engine alone (which bounds what it holds itself).
const SHARED_READS_WAITING_MAX: usize = 16 * 1024;

/// The task that runs a group's shared barriers while callers wait for one.
struct SharedReadsRunner<M: StateMachine> {
    handle: GroupHandle<M>,
    /// Set when it ended by finding no caller waiting.
    finished: bool,
}

impl<M: StateMachine> SharedReadsRunner<M> {
    async fn run(mut self) {
        loop {
            let callers = {
                let mut reads = lock(&self.handle.reads.state);
                if reads.waiting.is_empty() {
                    reads.running = false;
                    self.finished = true;
                    return;
                }
                std::mem::take(&mut reads.waiting)
            };
            self.handle.metrics.read_rounds.inc();
            let index = self
                .handle
                .barrier_alone(ReadConsistency::Linearizable)
                .await
                .ok();
            for caller in callers {
                // A caller that stopped waiting needs no answer.
                let _ = caller.send(index);
            }
        }
    }
}

impl<M: StateMachine> Drop for SharedReadsRunner<M> {
    /// A runner dropped before it finished (its tokio runtime shut down,
    /// perhaps before it ever ran) hands its callers back: each asks alone,
    /// and the next caller starts a runner again, rather than every later
    /// caller waiting for one that is gone.
    fn drop(&mut self) {
        if !self.finished {
            let mut reads = lock(&self.handle.reads.state);
            reads.running = false;
            reads.waiting.clear();
        }
    }
}

impl<M: StateMachine> Clone for GroupHandle<M> {
    fn clone(&self) -> Self {
        GroupHandle {
            group: self.group,
            workers: self.workers.clone(),
            view: self.view.clone(),
            reads: self.reads.clone(),
            metrics: self.metrics.clone(),
            machine: PhantomData,
        }
    }
}

/// Counts a proposal as pending while it lives, and as failed when it
/// ends without a successful answer: an error, or a caller that stopped
/// waiting (its own timeout).
struct Pending<'a> {
    metrics: &'a HostMetrics,
    succeeded: bool,
}

impl<'a> Pending<'a> {
    fn start(metrics: &'a HostMetrics) -> Pending<'a> {
        metrics.proposals_pending.inc();
        Pending {
            metrics,
            succeeded: false,
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.metrics.proposals_pending.dec();
        if !self.succeeded {
            self.metrics.proposals_failed.inc();
        }
    }
}

impl<M: StateMachine> GroupHandle<M> {
    /// The group's id.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// Proposes a command and waits until it is applied on this node;
    /// returns what the machine answered. A follower forwards it to the
    /// leader. On an error the command may or may not have been applied
    /// (a timeout), or was certainly not ([`GroupError::Dropped`], and
    /// every engine refusal before the proposal entered the log).
    pub async fn propose(&self, command: impl Into<Bytes>) -> Result<M::Response, GroupError> {
        let command = command.into();
        let mut pending = Pending::start(&self.metrics);
        let answer = self.call(|reply| Call::Propose { command, reply }).await;
        pending.succeeded = answer.is_ok();
        answer
    }

    /// Answers a query against the machine's applied state, once the
    /// consistency asked for is met (linearizable: every write acknowledged
    /// before the call is visible).
    pub async fn query(
        &self,
        query: M::Query,
        consistency: ReadConsistency,
    ) -> Result<M::QueryResponse, GroupError> {
        self.call(|reply| Call::Query {
            query,
            consistency,
            reply,
        })
        .await
    }

    /// Waits until this node's machine has applied everything the
    /// consistency asks for, and returns the index applied: for an embedder
    /// that reads the machine's state itself (shared with its own threads)
    /// rather than through [`GroupHandle::query`].
    ///
    /// Linearizable barriers asked for at the same time share one round of
    /// the engine's read index (counted in [`HostMetrics::read_rounds`](crate::HostMetrics::read_rounds)).
    pub async fn read_barrier(&self, consistency: ReadConsistency) -> Result<Index, GroupError> {
        if !matches!(consistency, ReadConsistency::Linearizable) {
            return self.barrier_alone(consistency).await;
        }
        let (reply, answer) = oneshot::channel();
        let start_rounds = {
            let mut reads = lock(&self.reads.state);
            if reads.waiting.len() >= SHARED_READS_WAITING_MAX {
                None
            } else {
                reads.waiting.push(reply);
                Some(!std::mem::replace(&mut reads.running, true))
            }
        };
        match start_rounds {
            None => return self.barrier_alone(consistency).await,
            Some(true) => {
                let runner = SharedReadsRunner {
                    handle: self.clone(),
                    finished: false,
                };
                tokio::spawn(runner.run());
            }
            Some(false) => {}
        }
        match answer.await {
            Ok(Some(index)) => Ok(index),
            // The shared barrier failed: ask alone, for this caller's own
            // answer (another leader may be known by now, or the error).
            Ok(None) | Err(_) => self.barrier_alone(consistency).await,
        }
    }

    /// A barrier of this caller's own.
    async fn barrier_alone(&self, consistency: ReadConsistency) -> Result<Index, GroupError> {
        self.call(|reply| Call::Barrier { consistency, reply })
            .await
    }

    /// The group's state on this node as of its last step, without a call
    /// to its worker.
    pub fn view(&self) -> GroupView {
        self.view
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Reads a field of the group's view without copying all of it.
    pub fn view_with<T>(&self, read: impl FnOnce(&GroupView) -> T) -> T {
        read(
            &self
                .view
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    /// Adds or removes a member, or promotes a learner; waits until the new
    /// configuration is applied here and returns its log index.
    pub async fn change_membership(&self, change: MembershipChange) -> Result<Index, GroupError> {
        self.call(|reply| Call::ChangeMembership { change, reply })
            .await
    }

    /// Asks the leader to hand leadership to `to`.
    pub async fn transfer_leadership(&self, to: NodeId) -> Result<(), GroupError> {
        self.call(|reply| Call::TransferLeadership { to, reply })
            .await
    }

    /// Asks this node to stand for election in the group now (after a
    /// pre-vote when the engine's `pre_vote` is on, so a healthy leader
    /// keeps its place).
    pub async fn campaign(&self) -> Result<ferry_raft::CampaignOutcome, GroupError> {
        self.call(|reply| Call::Campaign { reply }).await
    }

    /// The group's state on this node.
    pub async fn status(&self) -> Result<Status, GroupError> {
        self.call(|reply| Call::Status { reply }).await
    }

    /// The group's replication as this node sees it now: on a leader, how
    /// far each peer's log matches; and how many requests its engine holds.
    /// Answered by the group's worker without a step of the engine.
    pub async fn progress(&self) -> Result<GroupProgress, GroupError> {
        self.call(|reply| Call::Progress { reply }).await
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, GroupError>>) -> Call<M>,
    ) -> Result<T, GroupError> {
        let group = self.group;
        let (reply, answer) = oneshot::channel();
        let call = Box::new(make(reply));
        if !self
            .workers
            .input(group, WorkerInput::Call { group, call })
            .await
        {
            return Err(GroupError::NotRunning { group });
        }
        answer.await.map_err(|_| GroupError::NotRunning { group })?
    }
}

#[cfg(test)]
mod tests {
    use super::Liveness;

    #[test]
    fn a_peer_silent_for_an_election_timeout_is_reported_once_and_back_when_heard() {
        let mut liveness = Liveness::new(3);
        liveness.heard(2);
        for _ in 0..3 {
            assert!(liveness.tick(&[2], true).is_empty());
        }
        assert_eq!(liveness.tick(&[2], true), vec![2]);
        assert!(liveness.tick(&[2], true).is_empty(), "reported once");
        assert!(liveness.heard(2), "back once heard");
        assert!(!liveness.heard(2));
        assert!(liveness.tick(&[2], true).is_empty());
    }

    /// Regression: silence was measured in wall-clock time since the router
    /// last read a frame, so a router held up behind its own queue took its
    /// delay for every peer's silence, and thousands of quiet groups woke at
    /// once (10,000 groups per node on a loaded machine never all elected).
    #[test]
    fn ticks_the_router_starts_behind_its_frames_do_not_count_as_silence() {
        let mut liveness = Liveness::new(3);
        liveness.heard(2);
        for _ in 0..100 {
            assert!(liveness.tick(&[2], false).is_empty());
        }
        for _ in 0..3 {
            assert!(liveness.tick(&[2], true).is_empty());
        }
        assert_eq!(liveness.tick(&[2], true), vec![2]);
    }

    #[test]
    fn a_peer_whose_link_went_down_starts_counting_again_when_it_is_back() {
        let mut liveness = Liveness::new(2);
        liveness.heard(3);
        liveness.tick(&[3], true);
        liveness.tick(&[3], true);
        // The link drops: the transport reports that itself.
        assert!(liveness.tick(&[], true).is_empty());
        // Back up and never heard: a full silence again before a report.
        assert!(liveness.tick(&[3], true).is_empty());
        assert!(liveness.tick(&[3], true).is_empty());
        assert_eq!(liveness.tick(&[3], true), vec![3]);
    }
}
