//! The driver task: feeds events to the engine and carries out its actions.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use ferry_raft::{
    Action, Configuration, EntryPayload, GroupId, Index, Input, MembershipChange, NodeId, Options,
    RaftNode, ReadConsistency, Request, RequestError, RequestId, Response, Role, Term,
};
use ferry_storage::{FsDisk, SnapshotWriter, Storage, StorageError, WalOptions};

use super::backend::RaftBackend;
use super::config::NodeConfig;
use super::member_addrs;
use crate::api::EtcdApi;
use crate::backend::NodeStatus;
use crate::connections::{open_files_limit, split_descriptors, ConnectionLimits};
use crate::error::ApiError;
use crate::kv_state::{CommandResponse, KvLimits, KvState, Reads};
use crate::log_limit::LogLimiter;
use crate::member_id::Hex;
use crate::peer::{
    decode_message, encode_message, Transport, TransportConfig, TransportError, TransportEvent,
};
use crate::state::{SharedState, StateMachine};

/// The one Raft group of the key-value store.
pub const KV_GROUP: GroupId = 1;
/// The most API calls queued for the driver before callers wait.
const CALLS_QUEUED_MAX: usize = 4096;
/// The most transport events queued for the driver before readers wait.
const TRANSPORT_EVENTS_QUEUED_MAX: usize = 8192;
/// Most leases one expiry proposal removes.
const EXPIRED_LEASES_PER_COMMAND_MAX: usize = 64;
/// How long after a local snapshot failed for lack of descriptors or space
/// the next one is tried: building one can cost a pass over the whole
/// state, and the log keeps every entry meanwhile.
const SNAPSHOT_RETRY_DELAY: std::time::Duration = std::time::Duration::from_secs(5);
/// Least election timeouts a removed member's link is kept: longer than
/// the engine goes on replicating to it (four of the longest election
/// timeouts, twice the least), so that it can learn of its removal.
const RETIRING_LINK_ELECTION_TIMEOUTS: u64 = 10;

/// Why a node could not start or had to stop.
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
    /// The engine refused the recovered state.
    #[error("cannot start the Raft node: {0}")]
    Engine(#[from] ferry_raft::InitError),
    /// The peer transport could not start.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The client port could not be bound.
    #[error("cannot listen for clients on {addr}: {source}; is another process using the port?")]
    ClientBind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The snapshot the state machine was saved in cannot be read.
    #[error("cannot restore the state machine from snapshot {index}: {reason}")]
    Snapshot {
        /// The snapshot's index.
        index: Index,
        /// Why.
        reason: String,
    },
}

/// A call from the API to the driver.
pub(crate) enum Call {
    Propose {
        command: Vec<u8>,
        reply: oneshot::Sender<Result<CommandResponse, ApiError>>,
    },
    ReadIndex {
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
    ChangeMembership {
        change: MembershipChange,
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
}

/// What an engine request is waiting for, and who to tell.
enum Waiter {
    /// A proposal: first its place in the log, then its apply.
    Propose(oneshot::Sender<Result<CommandResponse, ApiError>>),
    /// A linearizable read barrier.
    Read(oneshot::Sender<Result<(), ApiError>>),
    /// A membership change: first its place in the log, then its apply.
    Membership(oneshot::Sender<Result<(), ApiError>>),
}

/// Something waiting for the entry at an index to apply with a given term.
enum ApplyWaiter {
    Propose(oneshot::Sender<Result<CommandResponse, ApiError>>),
    Membership(oneshot::Sender<Result<(), ApiError>>),
}

impl Waiter {
    /// Answers the caller with `error`.
    fn fail(self, error: ApiError) {
        match self {
            Waiter::Propose(reply) => {
                let _ = reply.send(Err(error));
            }
            Waiter::Read(reply) | Waiter::Membership(reply) => {
                let _ = reply.send(Err(error));
            }
        }
    }
}

impl From<ApplyWaiter> for Waiter {
    fn from(waiter: ApplyWaiter) -> Waiter {
        match waiter {
            ApplyWaiter::Propose(reply) => Waiter::Propose(reply),
            ApplyWaiter::Membership(reply) => Waiter::Membership(reply),
        }
    }
}

/// What the driver publishes for the API after every step.
#[derive(Debug, Default)]
pub(crate) struct NodeView {
    pub(crate) status: NodeStatus,
    pub(crate) config: Configuration,
    /// Peers this node has a working connection to, for the strict
    /// reconfiguration check of MemberAdd.
    pub(crate) connected: std::collections::BTreeSet<NodeId>,
}

/// A running node: its API, its driver and its transport.
pub struct RunningNode {
    /// The backend the API runs on.
    pub backend: Arc<RaftBackend>,
    /// Where the etcd API listens.
    pub client_addr: SocketAddr,
    /// Where peers connect.
    pub peer_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    driver: JoinHandle<()>,
    api: JoinHandle<()>,
}

impl RunningNode {
    /// Stops accepting clients, finishes the sync in flight and stops.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.api.await;
        let _ = self.driver.await;
    }

    /// Resolves when the driver stops by itself (a storage failure).
    pub async fn stopped(&mut self) {
        let _ = (&mut self.driver).await;
    }
}

fn api_error(error: RequestError) -> ApiError {
    match error {
        RequestError::NotLeader { .. } | RequestError::NoLeader => ApiError::NoLeader,
        RequestError::LeadershipLost => ApiError::NoLeader,
        RequestError::Timeout => ApiError::Timeout,
        RequestError::LearnerNotCaughtUp { .. } => ApiError::LearnerNotReady,
        RequestError::Removed => ApiError::Removed,
        RequestError::Busy { .. }
        | RequestError::MembershipChangePending
        | RequestError::InvalidMembershipChange { .. }
        | RequestError::TransferInProgress
        | RequestError::LeaseReadsDisabled
        | RequestError::CannotCampaign { .. } => ApiError::Internal(error.to_string()),
        RequestError::Halted { reason } => ApiError::Halted(reason),
    }
}

/// Opens the node's storage, recovers its state and starts the driver, the
/// transport and the etcd API.
pub async fn start_node(config: NodeConfig) -> Result<RunningNode, StartError> {
    let storage_error = |source| StartError::Storage {
        dir: config.data_dir.display().to_string(),
        source,
    };
    // A log that lost data it had synced (`StorageError::LostSyncedData`)
    // is refused here like corruption: the node must not start, least of
    // all as a voter, and the error's message names the way back.
    let wal_options = WalOptions {
        segment_size_bytes_max: config.wal_segment_size_bytes_max.max(1),
        ..WalOptions::default()
    };
    let (storage, report) =
        Storage::open(FsDisk, &config.data_dir, wal_options).map_err(storage_error)?;
    if report.wal.truncated_bytes > 0 {
        tracing::warn!(
            bytes = report.wal.truncated_bytes,
            file = ?report.wal.truncated_file,
            "cut a torn write from the end of the log (the node stopped while writing; \
             nothing the log knew to be synced was cut)"
        );
    }
    if report.wal.upgraded_from_format_1 {
        tracing::info!(
            data = %config.data_dir.display(),
            "the log was written by an older version without a log state file: accepted as \
             it is, and given one"
        );
    }
    // A joining node founds nothing: it starts with an empty configuration
    // (`RestoredState::joining()` when its storage is empty) and learns the
    // real one from the leader.
    let founders = if config.join {
        Configuration::default()
    } else {
        Configuration::with_voters(config.members.keys().copied())
    };
    let recovered = report.groups.get(&KV_GROUP).cloned().unwrap_or_default();
    let restored = recovered.restored_state(founders);

    let state = Arc::new(SharedState::new(StateMachine::new(
        config.kv_limits.clone(),
        config.watch_limits.clone(),
    )));
    if restored.snapshot.index > 0 {
        let index = restored.snapshot.index;
        let data = storage
            .snapshots
            .read_all(KV_GROUP, index)
            .map_err(storage_error)?
            .ok_or_else(|| StartError::Snapshot {
                index,
                reason: "the snapshot file is missing".into(),
            })?;
        state
            .lock()
            .restore(&data)
            .map_err(|error| StartError::Snapshot {
                index,
                reason: error.to_string(),
            })?;
    }

    let mut options = Options::new(config.node_id, KV_GROUP);
    options.election_timeout_ticks = config.election_timeout_ticks;
    options.heartbeat_interval_ticks = config.heartbeat_interval_ticks;
    options.compaction_lag_entries = config.compaction_lag_entries;
    let request_timeout_ticks =
        (config.request_timeout.as_millis() / config.tick_interval.as_millis().max(1)).max(1);
    options.request_timeout_ticks = u32::try_from(request_timeout_ticks).unwrap_or(u32::MAX);
    // Election timeouts must differ between nodes and between restarts; the
    // wall clock and the process id give that (the engine only needs a seed).
    let wall_nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    let seed = config.node_id.rotate_left(32) ^ wall_nanos ^ u64::from(std::process::id());
    let applied = restored.applied;
    let node = RaftNode::new(options, restored, seed)?;

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
    let split = split_descriptors(
        open_files,
        config.reserved_fds,
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

    let (transport_events_tx, transport_events) = mpsc::channel(TRANSPORT_EVENTS_QUEUED_MAX);
    let mut transport_config =
        TransportConfig::new(config.node_id, config.cluster_id, config.peer_listen);
    transport_config.connection_limits = peer_limits;
    transport_config.read_timeout = config.peer_read_timeout;
    transport_config.inbound_buffered_bytes_max = config.peer_buffered_bytes_max;
    transport_config.peers = config
        .members
        .iter()
        .filter(|(id, _)| **id != config.node_id)
        .map(|(id, addrs)| (*id, addrs.peer_addr.clone()))
        .collect();
    let transport = Transport::start(transport_config, transport_events_tx).await?;
    let peer_addr = transport.local_addr();

    let listener = TcpListener::bind(config.client_listen)
        .await
        .map_err(|source| StartError::ClientBind {
            addr: config.client_listen,
            source,
        })?;
    let client_addr = listener
        .local_addr()
        .map_err(|source| StartError::ClientBind {
            addr: config.client_listen,
            source,
        })?;

    let (calls_tx, calls) = mpsc::channel(CALLS_QUEUED_MAX);
    let view = Arc::new(Mutex::new(NodeView {
        status: NodeStatus {
            cluster_id: config.cluster_id,
            member_id: config.node_id,
            ..NodeStatus::default()
        },
        config: node.config().clone(),
        connected: std::collections::BTreeSet::new(),
    }));
    // One clock for lease deadlines: the driver starts them when it applies
    // a grant and expires them, the API renews them on keep-alive.
    let clock_origin = Instant::now();
    let backend = Arc::new(RaftBackend::new(
        state.clone(),
        calls_tx,
        view.clone(),
        config.clone(),
        clock_origin,
    ));
    let (shutdown, shutdown_rx) = watch::channel(false);

    let mut api_options = config.api_options.clone();
    api_options.connection_limits = client_limits;
    let api = EtcdApi::new(backend.clone(), api_options);
    let mut api_shutdown = shutdown_rx.clone();
    let api_task = tokio::spawn(async move {
        let stop = async move {
            let _ = api_shutdown.wait_for(|stop| *stop).await;
        };
        if let Err(error) = api.serve(listener, stop).await {
            tracing::error!(%error, "the client API stopped");
        }
    });

    let (mut driver, snapshot_written, snapshot_restored) = Driver::new(DriverParts {
        node,
        storage,
        state,
        transport,
        view,
        config,
        clock_origin,
        applied,
    });
    let driver_task = tokio::spawn(async move {
        if let Err(error) = driver
            .run(
                calls,
                transport_events,
                snapshot_written,
                snapshot_restored,
                shutdown_rx,
            )
            .await
        {
            tracing::error!(%error, "the node stopped: {error}");
        }
        driver.transport.shutdown();
    });
    Ok(RunningNode {
        backend,
        client_addr,
        peer_addr,
        shutdown,
        driver: driver_task,
        api: api_task,
    })
}

/// Why the driver stopped.
#[derive(Debug, thiserror::Error)]
enum DriverError {
    #[error("storage failed: {0}; the node cannot go on without losing durability (restart it; if it fails again, see the storage docs on rejoining)")]
    Storage(#[from] StorageError),
}

struct Driver {
    node: RaftNode,
    storage: Storage<FsDisk>,
    state: Arc<SharedState>,
    transport: Transport,
    view: Arc<Mutex<NodeView>>,
    config: NodeConfig,
    clock_origin: Instant,
    /// Reused action buffer.
    actions: Vec<Action>,
    next_request_id: u64,
    /// Calls waiting for the engine's `Respond`.
    waiting: HashMap<RequestId, Waiter>,
    /// Calls waiting for the entry at an index to apply with a term.
    applying: BTreeMap<Index, (Term, ApplyWaiter)>,
    sync_in_flight: bool,
    /// Inputs to feed once the next sync completes (snapshot installs,
    /// whose log reset becomes durable with that sync).
    after_sync: Vec<Input>,
    /// The snapshot being received from the leader.
    receiving: Option<Inbound>,
    /// The received snapshot being restored on a blocking thread, if any
    /// (one at a time: the engine sends no chunk while it waits for an
    /// install).
    restoring: Option<Restoring>,
    /// Numbers restores, so that a result is matched to the one in flight.
    restore_seq: u64,
    /// Where the restore thread hands its result back.
    snapshot_restored_tx: mpsc::Sender<Restored>,
    /// The last index applied to the state machine.
    applied: Index,
    /// The index of the latest local snapshot.
    snapshot_index: Index,
    /// The index of the snapshot being written on a blocking thread, if any
    /// (one at a time).
    snapshot_building: Option<Index>,
    /// Where that thread hands the written snapshot back.
    snapshot_written_tx: mpsc::Sender<SnapshotWritten>,
    /// Ticks since the start.
    ticks: u64,
    /// The tick at or after which this node (re)publishes its own addresses.
    self_publish_tick: u64,
    role: Role,
    /// Whether the engine said this node was removed.
    removed: bool,
    /// Warnings of detected faults, rate limited per kind.
    fault_warnings: BTreeMap<&'static str, LogLimiter>,
    /// Storage shortages being waited out, as the status reports them.
    troubles: Troubles,
    /// Whether the status's errors need to be published again.
    errors_changed: bool,
    /// No local snapshot is tried before this (after one failed for lack
    /// of descriptors or space).
    snapshot_retry_at: Option<Instant>,
    /// Warnings a peer can cause, rate limited.
    undecodable_warnings: LogLimiter,
    misaddressed_warnings: LogLimiter,
    snapshot_chunk_warnings: LogLimiter,
    /// Warnings of storage shortages, rate limited.
    storage_warnings: LogLimiter,
    /// Links to removed members kept until the tick given (see
    /// [`RETIRING_LINK_ELECTION_TIMEOUTS`]).
    retiring: BTreeMap<NodeId, u64>,
}

/// Storage shortages the node waits out instead of stopping (out of file
/// descriptors, space or quota where nothing was lost), each with the text
/// the status's errors carry while it lasts.
#[derive(Debug, Default, PartialEq, Eq)]
struct Troubles {
    /// The log cannot start a new segment and writes on in the current one.
    rotation: Option<String>,
    /// A local snapshot could not be taken.
    snapshot: Option<String>,
}

/// The way back for a member whose log contradicts its group's.
const REPAIR_HINT: &str = "stop it, move its data directory aside, remove it with `etcdctl member remove`, \
     then add it back as a new member (`etcdctl member add --learner`) and start it empty with --join";

type SyncOutcome = (ferry_storage::PendingSync<FsDisk>, std::io::Result<()>);
/// A snapshot of the local state machine whose data a blocking thread wrote.
type SnapshotWritten = (SnapshotWriter<FsDisk>, Result<(), StorageError>);

/// A snapshot arriving from the leader, chunk by chunk.
struct Inbound {
    /// Its file, written as the chunks come.
    writer: SnapshotWriter<FsDisk>,
    /// The chunks, kept to restore from on the last one without reading
    /// the file back (the storage can only be read from the driver). They
    /// take as much memory as the snapshot, which the restore needs in one
    /// piece anyway: the bound is the snapshot's size, as before.
    chunks: Vec<Bytes>,
}

/// A received snapshot whose state a blocking thread is restoring.
struct Restoring {
    /// Matches the thread's [`Restored`] to this restore.
    seq: u64,
    /// The snapshot's index.
    index: Index,
    /// Offset of the last chunk, which the engine's answer names.
    offset: u64,
    /// The snapshot's size.
    size_bytes: u64,
}

/// What a restore thread hands back to the driver.
struct Restored {
    /// Which restore (see [`Restoring::seq`]).
    seq: u64,
    /// The state decoded from the snapshot, or why it could not be.
    outcome: Result<KvState, String>,
    /// The snapshot's file, sealed (complete and synced) by the thread, to
    /// be installed with the state.
    writer: Option<SnapshotWriter<FsDisk>>,
    /// How long sealing, decoding and rebuilding took on the thread.
    restore_ms: u128,
}

/// What a driver is built from; everything else in it starts empty.
struct DriverParts {
    node: RaftNode,
    storage: Storage<FsDisk>,
    state: Arc<SharedState>,
    transport: Transport,
    view: Arc<Mutex<NodeView>>,
    config: NodeConfig,
    clock_origin: Instant,
    /// The index the state machine holds (restored from the snapshot).
    applied: Index,
}

impl Driver {
    /// A driver, with the channels on which its blocking threads hand back
    /// written snapshots and restored ones (for [`Driver::run`]).
    fn new(
        parts: DriverParts,
    ) -> (
        Driver,
        mpsc::Receiver<SnapshotWritten>,
        mpsc::Receiver<Restored>,
    ) {
        let (snapshot_written_tx, snapshot_written) = mpsc::channel(1);
        let (snapshot_restored_tx, snapshot_restored) = mpsc::channel(1);
        let driver = Driver {
            node: parts.node,
            storage: parts.storage,
            state: parts.state,
            transport: parts.transport,
            view: parts.view,
            config: parts.config,
            clock_origin: parts.clock_origin,
            actions: Vec::new(),
            next_request_id: 1,
            waiting: HashMap::new(),
            applying: BTreeMap::new(),
            sync_in_flight: false,
            after_sync: Vec::new(),
            receiving: None,
            restoring: None,
            restore_seq: 0,
            snapshot_restored_tx,
            applied: parts.applied,
            snapshot_index: parts.applied,
            snapshot_building: None,
            snapshot_written_tx,
            ticks: 0,
            self_publish_tick: 0,
            role: Role::Follower,
            removed: false,
            fault_warnings: BTreeMap::new(),
            troubles: Troubles::default(),
            errors_changed: false,
            snapshot_retry_at: None,
            undecodable_warnings: LogLimiter::for_remote_input(),
            misaddressed_warnings: LogLimiter::for_remote_input(),
            snapshot_chunk_warnings: LogLimiter::for_remote_input(),
            storage_warnings: LogLimiter::for_remote_input(),
            retiring: BTreeMap::new(),
        };
        (driver, snapshot_written, snapshot_restored)
    }

    async fn run(
        &mut self,
        mut calls: mpsc::Receiver<Call>,
        mut transport_events: mpsc::Receiver<TransportEvent>,
        mut snapshot_written: mpsc::Receiver<SnapshotWritten>,
        mut snapshot_restored: mpsc::Receiver<Restored>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), DriverError> {
        let mut ticker = tokio::time::interval(self.config.tick_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (sync_done_tx, mut sync_done) = mpsc::channel::<SyncOutcome>(1);
        // Apply what the log holds beyond the snapshot before serving.
        self.step(Input::Tick)?;
        loop {
            self.start_sync(&sync_done_tx)?;
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|stop| *stop) => break,
                Some((pending, outcome)) = sync_done.recv() => {
                    self.sync_in_flight = false;
                    let seqs = self.storage.wal.complete_sync(pending, outcome)?;
                    if let Some(seq) = seqs.get(&KV_GROUP) {
                        self.step(Input::Persisted { seq: *seq })?;
                    }
                    for input in std::mem::take(&mut self.after_sync) {
                        self.step(input)?;
                    }
                }
                Some((writer, outcome)) = snapshot_written.recv() => self.on_snapshot_written(writer, outcome)?,
                Some(restored) = snapshot_restored.recv() => self.on_snapshot_restored(restored)?,
                Some(event) = transport_events.recv() => self.on_transport(event)?,
                Some(call) = calls.recv() => self.on_call(call)?,
                _ = ticker.tick() => self.on_tick()?,
            }
        }
        // Finish what was written: a clean stop leaves nothing half-synced.
        if self.sync_in_flight {
            if let Some((pending, outcome)) = sync_done.recv().await {
                self.storage.wal.complete_sync(pending, outcome)?;
            }
        }
        self.storage.wal.sync()?;
        tracing::info!("node stopped cleanly");
        Ok(())
    }

    /// One tick of the timer: the engine's clock, lease expiry, and the
    /// publication of this node's addresses.
    fn on_tick(&mut self) -> Result<(), DriverError> {
        self.ticks += 1;
        self.step(Input::Tick)?;
        if self.receiving.is_some() && !self.node.is_receiving_snapshot() {
            // The engine gave up on the transfer (the leader went quiet):
            // free the chunks kept for the restore now rather than when the
            // next transfer starts.
            tracing::debug!("dropping a snapshot transfer the engine abandoned");
            self.receiving = None;
        }
        self.drop_retired_links();
        self.expire_leases()?;
        self.publish_self()
    }

    /// Starts a sync of everything written since the last one, unless one is
    /// in flight (then the next covers it: group commit).
    fn start_sync(&mut self, done: &mpsc::Sender<SyncOutcome>) -> Result<(), DriverError> {
        if self.sync_in_flight {
            return Ok(());
        }
        let Some(pending) = self.storage.wal.prepare_sync()? else {
            // Nothing unsynced: inputs waiting for a sync may go now.
            for input in std::mem::take(&mut self.after_sync) {
                self.step(input)?;
            }
            return Ok(());
        };
        self.sync_in_flight = true;
        let done = done.clone();
        tokio::task::spawn_blocking(move || {
            let outcome = pending.execute();
            let _ = done.blocking_send((pending, outcome));
        });
        Ok(())
    }

    fn on_transport(&mut self, event: TransportEvent) -> Result<(), DriverError> {
        match event {
            TransportEvent::Connected(peer) => {
                self.set_connected(peer, true);
                self.step(Input::PeerConnected(peer))
            }
            TransportEvent::Disconnected(peer) => {
                self.set_connected(peer, false);
                self.step(Input::PeerDisconnected(peer))
            }
            // The lease holds the frame's share of the transport's inbound
            // budget until the frame has been taken in.
            TransportEvent::Received {
                from,
                payload,
                lease: _lease,
            } => match decode_message(&payload) {
                Ok(message) if message.from == from && message.group == KV_GROUP => {
                    self.step(Input::Message(message))
                }
                // A peer can send these as fast as it likes: the warnings
                // are rate limited, so that it cannot fill the disk with
                // the log.
                Ok(message) => {
                    if let Some(suppressed) = self.misaddressed_warnings.allow() {
                        tracing::warn!(
                            peer = %Hex(from),
                            claimed = %Hex(message.from),
                            group = message.group,
                            suppressed,
                            "dropping a message with the wrong sender or group"
                        );
                    }
                    Ok(())
                }
                Err(error) => {
                    if let Some(suppressed) = self.undecodable_warnings.allow() {
                        tracing::warn!(peer = %Hex(from), %error, suppressed, "dropping a message that does not decode");
                    }
                    Ok(())
                }
            },
        }
    }

    fn on_call(&mut self, call: Call) -> Result<(), DriverError> {
        let id = RequestId(self.next_request_id);
        self.next_request_id += 1;
        let (request, waiter) = match call {
            Call::Propose { command, reply } => (
                Request::Propose(Bytes::from(command)),
                Waiter::Propose(reply),
            ),
            Call::ReadIndex { reply } => (
                Request::Read(ReadConsistency::Linearizable),
                Waiter::Read(reply),
            ),
            Call::ChangeMembership { change, reply } => {
                (Request::ChangeMembership(change), Waiter::Membership(reply))
            }
        };
        self.waiting.insert(id, waiter);
        self.step(Input::Client { id, request })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Publishes whether the link to `peer` is up.
    fn set_connected(&mut self, peer: NodeId, up: bool) {
        let mut view = self
            .view
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if up {
            view.connected.insert(peer);
        } else {
            view.connected.remove(&peer);
        }
    }

    /// The leader decides lease expiry by its clock and replicates it.
    fn expire_leases(&mut self) -> Result<(), DriverError> {
        if self.role != Role::Leader {
            return Ok(());
        }
        let now_ms = self.now_ms();
        let command = self
            .state
            .lock()
            .expired_leases(now_ms, EXPIRED_LEASES_PER_COMMAND_MAX);
        if let Some(command) = command {
            let id = RequestId(self.next_request_id);
            self.next_request_id += 1;
            let bytes = crate::command::encode_command(&command);
            // Nobody waits for the answer: a lost expiry is proposed again
            // on a later tick.
            self.step(Input::Client {
                id,
                request: Request::Propose(Bytes::from(bytes)),
            })?;
        }
        Ok(())
    }

    /// Feeds one input and carries out every action it produces.
    fn step(&mut self, input: Input) -> Result<(), DriverError> {
        let mut actions = std::mem::take(&mut self.actions);
        self.node.step(input, &mut actions);
        let mut result = Ok(());
        for action in actions.drain(..) {
            if let Err(error) = self.act(action) {
                result = Err(error);
                break;
            }
        }
        self.actions = actions;
        self.publish_status();
        result
    }

    fn act(&mut self, action: Action) -> Result<(), DriverError> {
        match action {
            Action::Persist(request) => self.storage.wal.append(KV_GROUP, &request)?,
            Action::Send(message) => {
                let to = message.to;
                self.transport.send(to, encode_message(&message));
            }
            Action::Apply(entries) => {
                for entry in entries {
                    self.apply(entry.index, entry.term, &entry.payload);
                }
                // Applied member records may name the address of a member
                // the configuration already has.
                self.reconcile_peers();
                self.maybe_snapshot()?;
            }
            Action::Respond { id, result } => self.respond(id, result),
            Action::LoadSnapshotChunk {
                to,
                snapshot_index,
                offset,
                max_bytes,
            } => {
                let chunk = match self.storage.snapshots.read_chunk(
                    KV_GROUP,
                    snapshot_index,
                    offset,
                    max_bytes,
                ) {
                    Ok(chunk) => chunk,
                    Err(error) if error.is_transient() => {
                        // Not answered: the engine asks for the chunk again
                        // after its chunk timeout.
                        if let Some(suppressed) = self.storage_warnings.allow() {
                            tracing::warn!(%error, suppressed, to = %Hex(to), "cannot read a snapshot chunk for a follower for now; the transfer is retried");
                        }
                        return Ok(());
                    }
                    Err(error) => return Err(error.into()),
                };
                self.step(Input::SnapshotChunkLoaded {
                    to,
                    snapshot_index,
                    offset,
                    chunk,
                })?;
            }
            Action::SaveSnapshotChunk {
                meta,
                offset,
                data,
                done,
            } => {
                let snapshot_index = meta.index;
                let ok = match self.save_snapshot_chunk(meta, offset, data, done) {
                    ChunkSaved::Written => true,
                    ChunkSaved::Failed => false,
                    // Answered when the restore thread is done; until then
                    // the engine sees the snapshot as being received.
                    ChunkSaved::Restoring => return Ok(()),
                };
                self.step(Input::SnapshotChunkSaved {
                    snapshot_index,
                    offset,
                    ok,
                })?;
            }
            Action::Compact { through } => self.storage.wal.compact(KV_GROUP, through)?,
            Action::RoleChanged { role, term, leader } => {
                tracing::info!(?role, term, leader = %Hex(leader), "role changed");
                if self.role == Role::Leader && role != Role::Leader {
                    // Lease deadlines are the leader's; a new leader starts
                    // them afresh.
                    self.state.lock().lease_clock.reset();
                }
                self.role = role;
            }
            Action::Removed => {
                self.removed = true;
                self.errors_changed = true;
                tracing::warn!(
                    "this node was removed from the cluster; it serves no more requests"
                );
                // Publish before waking the watch streams, which end when
                // they see it.
                self.publish_status();
                self.state.lock().watches.wake_all();
            }
            Action::Fault(fault) => {
                self.report_fault(&fault);
                if self.node.is_halted() {
                    // The fault halted the group: clients are refused from
                    // the published status on, and watch streams end when
                    // they see it.
                    self.errors_changed = true;
                    self.publish_status();
                    self.state.lock().watches.wake_all();
                }
            }
        }
        Ok(())
    }

    /// Logs a fault the engine detected, rate limited per kind: a faulty
    /// peer can cause one per message.
    fn report_fault(&mut self, fault: &ferry_raft::Fault) {
        let kind = match fault {
            ferry_raft::Fault::MessageOutOfRange { .. } => "message out of range",
            ferry_raft::Fault::TermExhausted { .. } => "term exhausted",
            ferry_raft::Fault::LogConflict { .. } => "log conflict",
            ferry_raft::Fault::CommitBeyondLog { .. } => "commit beyond log",
            ferry_raft::Fault::FollowerLogWentBack { .. } => "follower log went back",
        };
        let Some(suppressed) = self
            .fault_warnings
            .entry(kind)
            .or_insert_with(LogLimiter::for_remote_input)
            .allow()
        else {
            return;
        };
        match fault {
            ferry_raft::Fault::LogConflict { .. } => {
                tracing::error!(suppressed, "{fault}; repair this member: {REPAIR_HINT}")
            }
            ferry_raft::Fault::MessageOutOfRange { .. }
            | ferry_raft::Fault::TermExhausted { .. }
            | ferry_raft::Fault::CommitBeyondLog { .. }
            | ferry_raft::Fault::FollowerLogWentBack { .. } => {
                tracing::warn!(suppressed, "{fault}")
            }
        }
    }

    fn apply(&mut self, index: Index, term: Term, payload: &EntryPayload) {
        // Anything waiting on an earlier index lost its place (a new leader
        // replaced the entry): it will never apply.
        while let Some(entry) = self.applying.first_entry() {
            if *entry.key() >= index {
                break;
            }
            let (_, waiter) = entry.remove();
            Waiter::from(waiter).fail(ApiError::NoLeader);
        }
        let waiter = match self.applying.remove(&index) {
            Some((waited_term, waiter)) if waited_term == term => Some(waiter),
            Some((_, waiter)) => {
                Waiter::from(waiter).fail(ApiError::NoLeader);
                None
            }
            None => None,
        };
        match payload {
            EntryPayload::Command(data) => {
                let now_ms = self.now_ms();
                // Read results are built only where a client waits for
                // them; on every other member (and on a replay after a
                // restart) they would be thrown away, and a txn of large
                // ranges would cost every member its memory for nothing.
                let reads = match waiter {
                    Some(ApplyWaiter::Propose(_)) => Reads::Build,
                    Some(ApplyWaiter::Membership(_)) | None => Reads::SizeOnly,
                };
                let mut state = self.state.lock();
                let applied = state.apply_bytes_with(index, data, reads);
                state.sync_lease_clock(now_ms);
                drop(state);
                if let Some(ApplyWaiter::Propose(reply)) = waiter {
                    let _ = reply.send(applied.response.map_err(ApiError::from));
                } else if let Some(ApplyWaiter::Membership(reply)) = waiter {
                    let _ = reply.send(Err(ApiError::Internal(
                        "a membership change applied as a command".into(),
                    )));
                }
            }
            EntryPayload::Noop | EntryPayload::Config(_) => {
                if let Some(waiter) = waiter {
                    match waiter {
                        ApplyWaiter::Membership(reply) => {
                            // The caller answers with the member list it
                            // reads from the view: publish the new
                            // configuration before waking it.
                            self.publish_status();
                            let _ = reply.send(Ok(()));
                        }
                        ApplyWaiter::Propose(reply) => {
                            let _ = reply.send(Err(ApiError::NoLeader));
                        }
                    }
                }
            }
        }
        self.applied = index;
    }

    fn respond(&mut self, id: RequestId, result: Result<Response, RequestError>) {
        let Some(waiter) = self.waiting.remove(&id) else {
            // Lease expiry proposals have no waiter.
            return;
        };
        match (waiter, result) {
            (Waiter::Propose(reply), Ok(Response::Proposed { index, term })) => {
                self.applying
                    .insert(index, (term, ApplyWaiter::Propose(reply)));
            }
            (Waiter::Membership(reply), Ok(Response::Proposed { index, term })) => {
                self.applying
                    .insert(index, (term, ApplyWaiter::Membership(reply)));
            }
            (Waiter::Read(reply), Ok(Response::ReadReady { .. })) => {
                let _ = reply.send(Ok(()));
            }
            (waiter, Ok(other)) => {
                let error = ApiError::Internal(format!("the engine answered {other:?}"));
                waiter.fail(error);
            }
            (waiter, Err(error)) => waiter.fail(api_error(error)),
        }
    }

    /// Writes a chunk of a snapshot from the leader. The last one is not
    /// installed here: its state is restored on a blocking thread first
    /// (decoding hundreds of MB would stall heartbeats and client calls),
    /// and [`Driver::on_snapshot_restored`] installs it.
    fn save_snapshot_chunk(
        &mut self,
        meta: ferry_raft::SnapshotMeta,
        offset: u64,
        data: Bytes,
        done: bool,
    ) -> ChunkSaved {
        if let Some(restoring) = &self.restoring {
            // The engine sends no chunk while it waits for an install; if it
            // ever did, refusing it leaves the install in flight intact.
            tracing::warn!(
                index = meta.index,
                offset,
                restoring = restoring.index,
                "refusing a snapshot chunk while another snapshot is being restored"
            );
            return ChunkSaved::Failed;
        }
        let result = (|| -> Result<(), String> {
            if offset == 0 {
                self.receiving = Some(Inbound {
                    writer: self
                        .storage
                        .begin_snapshot(KV_GROUP, meta.clone())
                        .map_err(|e| e.to_string())?,
                    chunks: Vec::new(),
                });
            }
            let inbound = self
                .receiving
                .as_mut()
                .ok_or("a chunk arrived for no snapshot in progress")?;
            if inbound.writer.meta().index != meta.index {
                return Err(format!(
                    "chunk of snapshot {} while receiving {}",
                    meta.index,
                    inbound.writer.meta().index
                ));
            }
            inbound
                .writer
                .write(offset, &data)
                .map_err(|e| e.to_string())?;
            inbound.chunks.push(data);
            Ok(())
        })();
        match result {
            Ok(()) if done => match self.receiving.take() {
                Some(inbound) => {
                    self.start_restore(offset, inbound);
                    ChunkSaved::Restoring
                }
                None => {
                    debug_assert!(false, "the chunk was just written to it");
                    ChunkSaved::Failed
                }
            },
            Ok(()) => ChunkSaved::Written,
            Err(reason) => {
                if let Some(suppressed) = self.snapshot_chunk_warnings.allow() {
                    tracing::warn!(index = meta.index, offset, %reason, suppressed, "could not save a snapshot chunk; the leader will start over");
                }
                self.receiving = None;
                ChunkSaved::Failed
            }
        }
    }

    /// Hands a completely received snapshot to a blocking thread that
    /// seals its file (the sync of the whole file) and builds the state it
    /// holds.
    fn start_restore(&mut self, offset: u64, inbound: Inbound) {
        debug_assert!(self.restoring.is_none());
        self.restore_seq += 1;
        let seq = self.restore_seq;
        let index = inbound.writer.meta().index;
        let size_bytes = inbound.writer.data_bytes();
        self.restoring = Some(Restoring {
            seq,
            index,
            offset,
            size_bytes,
        });
        let limits = self.config.kv_limits.clone();
        let Inbound { mut writer, chunks } = inbound;
        let done = self.snapshot_restored_tx.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let outcome = writer
                .seal()
                .map_err(|e| e.to_string())
                .and_then(|()| restore_received(chunks, index, limits));
            let restored = Restored {
                seq,
                outcome,
                writer: Some(writer),
                restore_ms: started.elapsed().as_millis(),
            };
            // The driver holds the receiver until it stops; after that the
            // state is not needed, and the snapshot's temporary file is
            // removed by the next start.
            let _ = done.blocking_send(restored);
        });
    }

    /// Installs a received snapshot whose state a blocking thread restored
    /// (or reports that it could not be), and tells the engine.
    fn on_snapshot_restored(&mut self, restored: Restored) -> Result<(), DriverError> {
        if self.restoring.as_ref().map(|r| r.seq) != Some(restored.seq) {
            // Not the restore in flight (none is abandoned today, but a
            // result must never replace the state it was not meant for).
            tracing::debug!(
                seq = restored.seq,
                "dropping the result of a snapshot restore nobody waits for"
            );
            return Ok(());
        }
        let Some(restoring) = self.restoring.take() else {
            return Ok(());
        };
        let index = restoring.index;
        let offset = restoring.offset;
        let busy_started = Instant::now();
        let writer = restored.writer;
        let installed = restored.outcome.and_then(|kv| {
            let writer = writer.ok_or("the restore thread returned no snapshot file")?;
            self.storage
                .install_snapshot(writer)
                .map(|_| kv)
                .map_err(|e| e.to_string())
        });
        let ok = match installed {
            Ok(kv) => {
                let replaced = self.state.lock().install(kv);
                // Freeing a large state takes a while too.
                tokio::task::spawn_blocking(move || drop(replaced));
                self.applied = index;
                self.snapshot_index = index;
                tracing::info!(
                    index,
                    bytes = restoring.size_bytes,
                    restore_ms = restored.restore_ms,
                    driver_busy_us = busy_started.elapsed().as_micros() as u64,
                    "installed a snapshot from the leader"
                );
                true
            }
            Err(reason) => {
                tracing::warn!(index, %reason, "could not install a snapshot from the leader; the leader will start over");
                false
            }
        };
        let input = Input::SnapshotChunkSaved {
            snapshot_index: index,
            offset,
            ok,
        };
        if ok {
            // The log reset becomes durable with the next sync.
            self.after_sync.push(input);
            Ok(())
        } else {
            self.step(input)
        }
    }

    /// Takes a snapshot of the state machine every `snapshot_interval_entries`.
    ///
    /// The state must be the one at `applied`, so its contents are taken
    /// here, but only as shared pointers to the key-values
    /// ([`crate::kv_state::SnapshotSource`]); the encoding, the checksum and
    /// the write run on a blocking thread: for a state of hundreds of MB
    /// they would otherwise stall heartbeats, appends and client calls. The
    /// snapshot is completed (synced and renamed into place) when the
    /// thread hands it back.
    fn maybe_snapshot(&mut self) -> Result<(), DriverError> {
        if self.snapshot_building.is_some()
            || self.applied < self.snapshot_index + self.config.snapshot_interval_entries
            || self.snapshot_retry_at.is_some_and(|at| Instant::now() < at)
        {
            return Ok(());
        }
        let index = self.applied;
        let Some(term) = self.node.term_at(index) else {
            return Ok(());
        };
        let meta = ferry_raft::SnapshotMeta {
            index,
            term,
            config: self.node.config().clone(),
        };
        let busy_started = Instant::now();
        let mut writer = match self.storage.begin_snapshot(KV_GROUP, meta) {
            Ok(writer) => writer,
            Err(error) if error.is_transient() => {
                self.snapshot_deferred(&error);
                return Ok(());
            }
            Err(error) => return Err(error.into()),
        };
        let source = self.state.lock().snapshot_source();
        self.snapshot_building = Some(index);
        tracing::debug!(
            index,
            driver_busy_us = busy_started.elapsed().as_micros() as u64,
            "writing a snapshot"
        );
        let done = self.snapshot_written_tx.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            // Sealing syncs the whole file: here, not on the driver.
            let outcome = source
                .write_to(|piece| writer.write(writer.data_bytes(), piece))
                .and_then(|bytes| {
                    writer.seal()?;
                    tracing::debug!(
                        index,
                        bytes,
                        encode_write_sync_ms = started.elapsed().as_millis(),
                        "encoded, wrote and synced a snapshot"
                    );
                    Ok(())
                });
            // The driver holds the receiver until it stops; a send after
            // that has nobody to tell, and the temporary file is removed
            // by the next start.
            let _ = done.blocking_send((writer, outcome));
        });
        Ok(())
    }

    /// Completes a snapshot whose data a blocking thread wrote, and tells
    /// the engine (which may then compact the log).
    fn on_snapshot_written(
        &mut self,
        writer: SnapshotWriter<FsDisk>,
        outcome: Result<(), StorageError>,
    ) -> Result<(), DriverError> {
        let index = writer.meta().index;
        debug_assert_eq!(self.snapshot_building, Some(index));
        self.snapshot_building = None;
        if let Err(error) = outcome {
            if !error.is_transient() {
                return Err(error.into());
            }
            // Out of space while writing it, typically: give the space back.
            self.storage.abandon_snapshot(writer);
            self.snapshot_deferred(&error);
            return Ok(());
        }
        if index <= self.snapshot_index {
            // A snapshot from the leader was installed meanwhile and is newer.
            tracing::debug!(
                index,
                newer = self.snapshot_index,
                "dropping a local snapshot overtaken by an installed one"
            );
            return Ok(());
        }
        let finish_started = Instant::now();
        match self.storage.save_snapshot(writer) {
            Ok(_) => {}
            Err(error) if error.is_transient() => {
                self.snapshot_deferred(&error);
                return Ok(());
            }
            Err(error) => return Err(error.into()),
        }
        self.snapshot_retry_at = None;
        self.set_trouble(|t| &mut t.snapshot, None);
        self.snapshot_index = index;
        tracing::debug!(
            index,
            finish_ms = finish_started.elapsed().as_millis(),
            "took a snapshot"
        );
        self.step(Input::SnapshotBuilt { index })?;
        // More may have been applied while it was written.
        self.maybe_snapshot()
    }

    /// A local snapshot failed for lack of descriptors, space or quota:
    /// nothing is lost (the log keeps every entry), so the node goes on,
    /// says so, and tries again after [`SNAPSHOT_RETRY_DELAY`].
    fn snapshot_deferred(&mut self, error: &StorageError) {
        self.snapshot_retry_at = Instant::now().checked_add(SNAPSHOT_RETRY_DELAY);
        if let Some(suppressed) = self.storage_warnings.allow() {
            tracing::warn!(
                %error,
                suppressed,
                "cannot take a snapshot for now; the log keeps every entry meanwhile, retrying in {SNAPSHOT_RETRY_DELAY:?}"
            );
        }
        self.set_trouble(
            |t| &mut t.snapshot,
            Some(format!("storage: cannot take a snapshot: {error}")),
        );
    }

    /// Records a storage shortage (or its end) for the status.
    fn set_trouble(
        &mut self,
        which: fn(&mut Troubles) -> &mut Option<String>,
        now: Option<String>,
    ) {
        let slot = which(&mut self.troubles);
        if *slot != now {
            *slot = now;
            self.errors_changed = true;
        }
    }

    /// Notices the log starting (or no longer unable to start) new segments.
    fn watch_rotation(&mut self) {
        let deferred = self.storage.wal.rotation_deferred();
        if deferred.is_none() && self.troubles.rotation.is_none() {
            return;
        }
        let now = deferred.map(|error| {
            format!(
                "storage: cannot start a new log segment, writing on in the current one: {error}"
            )
        });
        if now == self.troubles.rotation {
            return;
        }
        match &now {
            Some(text) => tracing::warn!("{text}; retrying as the segment grows"),
            None => tracing::info!("the log starts new segments again"),
        }
        self.set_trouble(|t| &mut t.rotation, now);
    }

    /// Makes the transport dial exactly the other members of the current
    /// configuration, at the addresses known for them. A member whose
    /// address is not known yet (its record is not applied yet) is dialed
    /// once it is.
    fn reconcile_peers(&mut self) {
        let members = self.node.config().members();
        let dialed = self.transport.peer_ids();
        let wanted: Vec<(NodeId, String)> = {
            let machine = self.state.lock();
            members
                .iter()
                .filter(|id| **id != self.config.node_id && !dialed.contains(id))
                .filter_map(|id| {
                    member_addrs(&self.config.members, machine.kv().member_records(), *id)
                        .filter(|addrs| !addrs.peer_addr.is_empty())
                        .map(|addrs| (*id, addrs.peer_addr))
                })
                .collect()
        };
        for (id, addr) in wanted {
            tracing::info!(peer = %Hex(id), %addr, "dialing a new member");
            self.transport.add_peer(id, addr);
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
        let members = self.node.config().members();
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
                self.transport.remove_peer(id);
            }
        }
    }

    /// Records this node's own addresses in the replicated state (as etcd's
    /// members publish theirs), so that every member, and every member added
    /// later, can reach it and forward to it. Retried until the record is in.
    fn publish_self(&mut self) -> Result<(), DriverError> {
        if self.ticks < self.self_publish_tick || self.node.leader().is_none() {
            return Ok(());
        }
        let me = self.config.node_id;
        if !self.node.config().contains(me) {
            return Ok(());
        }
        let Some(mine) = self.config.members.get(&me).cloned() else {
            return Ok(());
        };
        let recorded = {
            let machine = self.state.lock();
            machine.kv().member_records().get(&me).cloned()
        };
        if recorded
            .is_some_and(|r| r.peer_addr == mine.peer_addr && r.client_url == mine.client_url)
        {
            return Ok(());
        }
        // Not again before the proposal had time to apply.
        self.self_publish_tick = self.ticks + 50;
        let record = crate::command::command(crate::command::CommandKind::MemberRecord(
            crate::pb::ferrypb::MemberRecordCommand {
                id: me,
                name: mine.name,
                peer_addr: mine.peer_addr,
                client_url: mine.client_url,
                create: false,
            },
        ));
        let id = RequestId(self.next_request_id);
        self.next_request_id += 1;
        let bytes = crate::command::encode_command(&record);
        self.step(Input::Client {
            id,
            request: Request::Propose(Bytes::from(bytes)),
        })
    }

    /// Publishes the node's view for the API. Runs after every step, so it
    /// reads fields rather than building a full status.
    fn publish_status(&mut self) {
        self.watch_rotation();
        let errors = self.errors_changed.then(|| {
            let mut errors = Vec::new();
            if self.removed {
                errors.push("this member has been removed from the cluster".to_string());
            }
            if let Some(fault) = self.node.halted() {
                errors.push(format!(
                    "this member halted on a detected fault: {fault}; {REPAIR_HINT}"
                ));
            }
            errors.extend(self.troubles.rotation.iter().cloned());
            errors.extend(self.troubles.snapshot.iter().cloned());
            errors
        });
        self.errors_changed = false;
        let config_changed = {
            let mut view = self
                .view
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let config = self.node.config();
            let changed = view.config != *config;
            if changed {
                view.config = config.clone();
            }
            let published = &mut view.status;
            published.leader_id = self.node.leader().unwrap_or(0);
            published.raft_term = self.node.term();
            published.raft_index = self.node.last_index();
            published.raft_applied_index = self.node.applied_index();
            published.is_learner = config.is_learner(self.config.node_id);
            published.removed = self.removed;
            if published.halted.is_none() {
                published.halted = self.node.halted().map(ToString::to_string);
            }
            if let Some(errors) = errors {
                published.errors = errors;
            }
            changed
        };
        if config_changed {
            self.reconcile_peers();
        }
    }
}

/// What became of a snapshot chunk from the leader.
enum ChunkSaved {
    /// Written; the engine may ask for the next.
    Written,
    /// Not written; the leader starts over.
    Failed,
    /// The last chunk: the state is being restored from the snapshot, and
    /// the engine hears about it when that is done.
    Restoring,
}

/// Builds the state a received snapshot holds (on a blocking thread).
fn restore_received(chunks: Vec<Bytes>, index: Index, limits: KvLimits) -> Result<KvState, String> {
    let size_bytes: usize = chunks.iter().map(Bytes::len).sum();
    let mut bytes = Vec::with_capacity(size_bytes);
    for chunk in chunks {
        // Each chunk is freed once copied: the peak stays at one snapshot.
        bytes.extend_from_slice(&chunk);
    }
    let kv = KvState::restore(&bytes, limits).map_err(|e| e.to_string())?;
    if kv.applied_index() > index {
        return Err(format!(
            "the snapshot for index {index} holds a state applied up to {}",
            kv.applied_index()
        ));
    }
    Ok(kv)
}

#[cfg(test)]
mod tests {
    //! The driver's half of receiving a snapshot: the state is restored on
    //! a blocking thread, and only its result installs the snapshot and
    //! answers the engine.

    use std::collections::BTreeMap;
    use std::path::PathBuf;

    use ferry_raft::{Message, MessageBody, SnapshotMeta};

    use super::*;
    use crate::kv_state::KvLimits;
    use crate::pb::etcdserverpb::PutRequest;
    use crate::state::StateMachine;
    use crate::watch::WatchLimits;

    /// A driver for node 1 of the group {1, 2}, with everything but the
    /// client API, and the receiving ends of its snapshot channels.
    struct Harness {
        driver: Driver,
        restored: mpsc::Receiver<Restored>,
        dir: PathBuf,
    }

    impl Drop for Harness {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    async fn harness(name: &str) -> Harness {
        let dir = std::env::temp_dir().join(format!("ferry-driver-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut members = BTreeMap::new();
        for id in [1u64, 2] {
            members.insert(
                id,
                crate::runtime::MemberAddrs {
                    name: format!("n{id}"),
                    // Nobody listens there: node 2 is played by the test.
                    peer_addr: "127.0.0.1:9".into(),
                    client_url: String::new(),
                },
            );
        }
        let config = NodeConfig::new(1, dir.clone(), local, local, members);
        let (storage, report) = Storage::open(FsDisk, &dir, WalOptions::default()).unwrap();
        let recovered = report.groups.get(&KV_GROUP).cloned().unwrap_or_default();
        let restored = recovered.restored_state(Configuration::with_voters([1, 2]));
        let node = RaftNode::new(Options::new(1, KV_GROUP), restored, 7).unwrap();
        let (events_tx, _events) = mpsc::channel(16);
        let mut transport_config = TransportConfig::new(1, config.cluster_id, local);
        transport_config.peers = BTreeMap::from([(2, "127.0.0.1:9".to_string())]);
        let transport = Transport::start(transport_config, events_tx).await.unwrap();
        let state = Arc::new(SharedState::new(StateMachine::new(
            KvLimits::default(),
            WatchLimits::default(),
        )));
        let view = Arc::new(Mutex::new(NodeView::default()));
        let (driver, _snapshot_written, restored) = Driver::new(DriverParts {
            node,
            storage,
            state,
            transport,
            view,
            config,
            clock_origin: Instant::now(),
            applied: 0,
        });
        Harness {
            driver,
            restored,
            dir,
        }
    }

    /// The snapshot of a state holding `keys` keys, as a leader would send.
    fn leader_state(keys: usize, index: Index) -> KvState {
        let mut kv = KvState::new(KvLimits::default());
        for i in 0..keys {
            let put = crate::command::command(crate::command::CommandKind::Put(PutRequest {
                key: format!("k{i}").into_bytes(),
                value: vec![b'v'; 100],
                ..PutRequest::default()
            }));
            kv.apply(i as u64 + 1, &put).response.unwrap();
        }
        assert!(kv.applied_index() <= index);
        kv
    }

    fn meta(index: Index) -> SnapshotMeta {
        SnapshotMeta {
            index,
            term: 1,
            config: Configuration::with_voters([1, 2]),
        }
    }

    /// Node 2, the leader of term 1, sends a chunk.
    fn chunk(meta: &SnapshotMeta, offset: u64, data: &[u8], done: bool) -> Input {
        Input::Message(Message {
            group: KV_GROUP,
            from: 2,
            to: 1,
            term: 1,
            body: MessageBody::SnapshotChunk {
                meta: meta.clone(),
                offset,
                data: Bytes::copy_from_slice(data),
                done,
            },
        })
    }

    /// Completes the log sync the install needs, as the run loop does.
    fn sync(driver: &mut Driver) {
        driver.storage.wal.sync().unwrap();
        for input in std::mem::take(&mut driver.after_sync) {
            driver.step(input).unwrap();
        }
    }

    #[tokio::test]
    async fn a_received_snapshot_is_installed_only_when_its_restore_comes_back() {
        let mut h = harness("restore").await;
        let leader = leader_state(50, 60);
        let bytes = leader.snapshot();
        let snapshot = meta(60);
        let half = bytes.len() / 2;
        h.driver
            .step(chunk(&snapshot, 0, &bytes[..half], false))
            .unwrap();
        assert!(h.driver.receiving.is_some());
        h.driver
            .step(chunk(&snapshot, half as u64, &bytes[half..], true))
            .unwrap();

        // The last chunk went to the restore thread: nothing is installed
        // yet, and the engine still sees the snapshot as being received.
        assert!(h.driver.receiving.is_none());
        assert!(h.driver.restoring.is_some());
        assert!(h.driver.node.is_receiving_snapshot());
        assert_eq!(h.driver.state.lock().kv().applied_index(), 0);
        assert_eq!(h.driver.applied, 0);
        assert!(h.driver.storage.snapshots.latest(KV_GROUP).is_none());

        // A newer snapshot's first chunk meanwhile: the engine waits for
        // the install and does not pass it on; had it done so, the driver
        // would refuse it and keep the restore in flight.
        let newer = meta(90);
        let newer_bytes = leader_state(80, 90).snapshot();
        h.driver
            .step(chunk(&newer, 0, &newer_bytes, false))
            .unwrap();
        assert!(h.driver.receiving.is_none());
        assert!(matches!(
            h.driver
                .save_snapshot_chunk(newer, 0, Bytes::from(newer_bytes), false),
            ChunkSaved::Failed
        ));
        assert!(h.driver.restoring.is_some());
        assert!(h.driver.node.is_receiving_snapshot());

        let restored = h.restored.recv().await.unwrap();
        h.driver.on_snapshot_restored(restored).unwrap();
        assert!(h.driver.restoring.is_none());
        assert_eq!(h.driver.state.lock().kv(), &leader);
        assert_eq!((h.driver.applied, h.driver.snapshot_index), (60, 60));
        assert_eq!(
            h.driver.storage.snapshots.latest(KV_GROUP).map(|m| m.index),
            Some(60)
        );
        assert_eq!(
            h.driver.storage.snapshots.read_all(KV_GROUP, 60).unwrap(),
            Some(bytes)
        );
        // The engine hears of it once the log reset is durable.
        assert!(h.driver.node.is_receiving_snapshot());
        sync(&mut h.driver);
        assert!(!h.driver.node.is_receiving_snapshot());
        assert_eq!(h.driver.node.applied_index(), 60);
    }

    #[tokio::test]
    async fn a_restore_result_nobody_waits_for_changes_nothing() {
        let mut h = harness("stale").await;
        let before = h.driver.state.lock().kv().clone();
        // No restore in flight.
        h.driver
            .on_snapshot_restored(Restored {
                seq: 1,
                outcome: Ok(leader_state(5, 10)),
                writer: None,
                restore_ms: 0,
            })
            .unwrap();
        assert_eq!(h.driver.state.lock().kv(), &before);

        // A restore in flight, and a result from another one.
        let bytes = leader_state(5, 10).snapshot();
        h.driver.step(chunk(&meta(10), 0, &bytes, true)).unwrap();
        let in_flight = h.driver.restoring.as_ref().unwrap().seq;
        h.driver
            .on_snapshot_restored(Restored {
                seq: in_flight + 1,
                outcome: Ok(leader_state(7, 10)),
                writer: None,
                restore_ms: 0,
            })
            .unwrap();
        assert_eq!(h.driver.state.lock().kv(), &before);
        assert_eq!(h.driver.applied, 0);
        assert!(h.driver.restoring.is_some());
        assert!(h.driver.node.is_receiving_snapshot());

        // The real one still installs.
        let restored = h.restored.recv().await.unwrap();
        assert_eq!(restored.seq, in_flight);
        h.driver.on_snapshot_restored(restored).unwrap();
        assert_eq!(h.driver.state.lock().kv(), &leader_state(5, 10));
        sync(&mut h.driver);
        assert_eq!(h.driver.node.applied_index(), 10);
    }

    #[tokio::test]
    async fn the_chunks_of_a_transfer_the_engine_abandons_are_freed() {
        let mut h = harness("abandoned").await;
        let bytes = leader_state(5, 10).snapshot();
        h.driver
            .step(chunk(&meta(10), 0, &bytes[..10], false))
            .unwrap();
        assert_eq!(h.driver.receiving.as_ref().map(|r| r.chunks.len()), Some(1));
        // The leader goes quiet; the engine gives up after a few election
        // timeouts of ticks.
        let mut ticks = 0;
        while h.driver.node.is_receiving_snapshot() {
            assert!(h.driver.receiving.is_some());
            h.driver.on_tick().unwrap();
            ticks += 1;
            assert!(ticks < 10_000, "the engine never abandoned the transfer");
        }
        assert!(h.driver.receiving.is_none());
    }

    #[tokio::test]
    async fn a_snapshot_that_does_not_restore_is_refused_and_not_installed() {
        let mut h = harness("damaged").await;
        let mut bytes = leader_state(20, 30).snapshot();
        bytes[20] ^= 0x01;
        h.driver.step(chunk(&meta(30), 0, &bytes, true)).unwrap();
        assert!(h.driver.node.is_receiving_snapshot());
        let restored = h.restored.recv().await.unwrap();
        assert!(restored.outcome.is_err());
        h.driver.on_snapshot_restored(restored).unwrap();
        // Refused at once (the leader starts over); nothing changed here.
        assert!(!h.driver.node.is_receiving_snapshot());
        assert!(h.driver.after_sync.is_empty());
        assert!(h.driver.restoring.is_none());
        assert_eq!(h.driver.state.lock().kv().applied_index(), 0);
        assert_eq!(h.driver.applied, 0);
        assert!(h.driver.storage.snapshots.latest(KV_GROUP).is_none());

        // The next transfer of it works.
        let good = leader_state(20, 30);
        h.driver
            .step(chunk(&meta(30), 0, &good.snapshot(), true))
            .unwrap();
        let restored = h.restored.recv().await.unwrap();
        h.driver.on_snapshot_restored(restored).unwrap();
        sync(&mut h.driver);
        assert_eq!(h.driver.state.lock().kv(), &good);
        assert_eq!(h.driver.node.applied_index(), 30);
    }

    #[tokio::test]
    async fn a_node_whose_log_lost_synced_data_refuses_to_start() {
        let dir = std::env::temp_dir().join(format!("ferry-driver-lost-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The node voted in term 4, durably.
        {
            let (mut storage, _) = Storage::open(FsDisk, &dir, WalOptions::default()).unwrap();
            let vote = ferry_raft::PersistRequest {
                seq: 1,
                hard_state: Some(ferry_raft::HardState {
                    term: 4,
                    vote: Some(2),
                    commit: 0,
                }),
                entries: Vec::new(),
            };
            storage.wal.append(KV_GROUP, &vote).unwrap();
            storage.wal.sync().unwrap();
        }
        // Its only segment is lost.
        let wal = dir.join("wal");
        for entry in std::fs::read_dir(&wal).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "seg") {
                std::fs::remove_file(path).unwrap();
            }
        }
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let members = BTreeMap::from([(
            1,
            crate::runtime::MemberAddrs {
                name: "n1".into(),
                peer_addr: "127.0.0.1:9".into(),
                client_url: String::new(),
            },
        )]);
        let config = NodeConfig::new(1, dir.clone(), local, local, members);
        let error = match start_node(config).await {
            Err(error) => error,
            Ok(node) => {
                node.shutdown().await;
                panic!("a node that forgot its vote started");
            }
        };
        assert!(
            matches!(
                &error,
                StartError::Storage {
                    source: StorageError::LostSyncedData { .. },
                    ..
                }
            ),
            "{error}"
        );
        let text = error.to_string();
        assert!(text.contains("must not start as a voter"), "{text}");
        assert!(text.contains("new learner"), "{text}");
        assert!(text.contains("When the disk lies: the way back"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
