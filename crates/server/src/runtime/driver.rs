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
use crate::error::ApiError;
use crate::kv_state::CommandResponse;
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

/// What the driver publishes for the API after every step.
#[derive(Debug, Default)]
pub(crate) struct NodeView {
    pub(crate) status: NodeStatus,
    pub(crate) config: Configuration,
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
        RequestError::Busy { .. }
        | RequestError::Removed
        | RequestError::MembershipChangePending
        | RequestError::InvalidMembershipChange { .. }
        | RequestError::TransferInProgress
        | RequestError::LeaseReadsDisabled => ApiError::Internal(error.to_string()),
    }
}

/// Opens the node's storage, recovers its state and starts the driver, the
/// transport and the etcd API.
pub async fn start_node(config: NodeConfig) -> Result<RunningNode, StartError> {
    let storage_error = |source| StartError::Storage {
        dir: config.data_dir.display().to_string(),
        source,
    };
    let (storage, report) =
        Storage::open(FsDisk, &config.data_dir, WalOptions::default()).map_err(storage_error)?;
    if report.wal.truncated_bytes > 0 {
        tracing::warn!(
            bytes = report.wal.truncated_bytes,
            file = ?report.wal.truncated_file,
            "cut a torn write from the end of the log (the node stopped while writing)"
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

    let (transport_events_tx, transport_events) = mpsc::channel(TRANSPORT_EVENTS_QUEUED_MAX);
    let mut transport_config =
        TransportConfig::new(config.node_id, config.cluster_id, config.peer_listen);
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

    let api = EtcdApi::new(backend.clone(), config.api_options.clone());
    let mut api_shutdown = shutdown_rx.clone();
    let api_task = tokio::spawn(async move {
        let stop = async move {
            let _ = api_shutdown.wait_for(|stop| *stop).await;
        };
        if let Err(error) = api.serve(listener, stop).await {
            tracing::error!(%error, "the client API stopped");
        }
    });

    let (snapshot_written_tx, snapshot_written) = mpsc::channel(1);
    let mut driver = Driver {
        node,
        storage,
        state,
        transport,
        view,
        config,
        clock_origin,
        actions: Vec::new(),
        next_request_id: 1,
        waiting: HashMap::new(),
        applying: BTreeMap::new(),
        sync_in_flight: false,
        after_sync: Vec::new(),
        receiving: None,
        applied,
        snapshot_index: applied,
        snapshot_building: None,
        snapshot_written_tx,
        ticks: 0,
        self_publish_tick: 0,
        role: Role::Follower,
        removed: false,
    };
    let driver_task = tokio::spawn(async move {
        if let Err(error) = driver
            .run(calls, transport_events, snapshot_written, shutdown_rx)
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
    receiving: Option<SnapshotWriter<FsDisk>>,
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
}

type SyncOutcome = (ferry_storage::PendingSync<FsDisk>, std::io::Result<()>);
/// A snapshot of the local state machine whose data a blocking thread wrote.
type SnapshotWritten = (SnapshotWriter<FsDisk>, Result<(), StorageError>);

impl Driver {
    async fn run(
        &mut self,
        mut calls: mpsc::Receiver<Call>,
        mut transport_events: mpsc::Receiver<TransportEvent>,
        mut snapshot_written: mpsc::Receiver<SnapshotWritten>,
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
                Some(event) = transport_events.recv() => self.on_transport(event)?,
                Some(call) = calls.recv() => self.on_call(call)?,
                _ = ticker.tick() => {
                    self.ticks += 1;
                    self.step(Input::Tick)?;
                    self.expire_leases()?;
                    self.publish_self()?;
                }
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
            TransportEvent::Connected(peer) => self.step(Input::PeerConnected(peer)),
            TransportEvent::Disconnected(peer) => self.step(Input::PeerDisconnected(peer)),
            TransportEvent::Received { from, payload } => match decode_message(&payload) {
                Ok(message) if message.from == from && message.group == KV_GROUP => {
                    self.step(Input::Message(message))
                }
                Ok(message) => {
                    tracing::warn!(
                        peer = from,
                        claimed = message.from,
                        group = message.group,
                        "dropping a message with the wrong sender or group"
                    );
                    Ok(())
                }
                Err(error) => {
                    tracing::warn!(peer = from, %error, "dropping a message that does not decode");
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
                let chunk = self.storage.snapshots.read_chunk(
                    KV_GROUP,
                    snapshot_index,
                    offset,
                    max_bytes,
                )?;
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
                let ok = self.save_snapshot_chunk(meta, offset, &data, done);
                let input = Input::SnapshotChunkSaved {
                    snapshot_index,
                    offset,
                    ok,
                };
                if ok && done {
                    // The log reset becomes durable with the next sync.
                    self.after_sync.push(input);
                } else {
                    self.step(input)?;
                }
            }
            Action::Compact { through } => self.storage.wal.compact(KV_GROUP, through)?,
            Action::RoleChanged { role, term, leader } => {
                tracing::info!(?role, term, ?leader, "role changed");
                if self.role == Role::Leader && role != Role::Leader {
                    // Lease deadlines are the leader's; a new leader starts
                    // them afresh.
                    self.state.lock().lease_clock.reset();
                }
                self.role = role;
            }
            Action::Removed => {
                self.removed = true;
                tracing::warn!(
                    "this node was removed from the cluster; it serves no more requests"
                );
            }
        }
        Ok(())
    }

    fn apply(&mut self, index: Index, term: Term, payload: &EntryPayload) {
        // Anything waiting on an earlier index lost its place (a new leader
        // replaced the entry): it will never apply.
        while let Some(entry) = self.applying.first_entry() {
            if *entry.key() >= index {
                break;
            }
            let (_, waiter) = entry.remove();
            fail_apply_waiter(waiter, ApiError::NoLeader);
        }
        let waiter = match self.applying.remove(&index) {
            Some((waited_term, waiter)) if waited_term == term => Some(waiter),
            Some((_, waiter)) => {
                fail_apply_waiter(waiter, ApiError::NoLeader);
                None
            }
            None => None,
        };
        match payload {
            EntryPayload::Command(data) => {
                let now_ms = self.now_ms();
                let mut state = self.state.lock();
                let applied = state.apply_bytes(index, data);
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
                fail_waiter(waiter, error);
            }
            (waiter, Err(error)) => fail_waiter(waiter, api_error(error)),
        }
    }

    fn save_snapshot_chunk(
        &mut self,
        meta: ferry_raft::SnapshotMeta,
        offset: u64,
        data: &[u8],
        done: bool,
    ) -> bool {
        let result = (|| -> Result<(), String> {
            if offset == 0 {
                self.receiving = Some(
                    self.storage
                        .begin_snapshot(KV_GROUP, meta.clone())
                        .map_err(|e| e.to_string())?,
                );
            }
            let writer = self
                .receiving
                .as_mut()
                .ok_or("a chunk arrived for no snapshot in progress")?;
            if writer.meta().index != meta.index {
                return Err(format!(
                    "chunk of snapshot {} while receiving {}",
                    meta.index,
                    writer.meta().index
                ));
            }
            writer.write(offset, data).map_err(|e| e.to_string())?;
            if done {
                let writer = self.receiving.take().ok_or("no snapshot in progress")?;
                self.storage
                    .install_snapshot(writer)
                    .map_err(|e| e.to_string())?;
                let bytes = self
                    .storage
                    .snapshots
                    .read_all(KV_GROUP, meta.index)
                    .map_err(|e| e.to_string())?
                    .ok_or("the installed snapshot is missing")?;
                self.state
                    .lock()
                    .restore(&bytes)
                    .map_err(|e| e.to_string())?;
                self.applied = meta.index;
                self.snapshot_index = meta.index;
                tracing::info!(
                    index = meta.index,
                    bytes = bytes.len(),
                    "installed a snapshot from the leader"
                );
            }
            Ok(())
        })();
        match result {
            Ok(()) => true,
            Err(reason) => {
                tracing::warn!(index = meta.index, offset, %reason, "could not save a snapshot chunk; the leader will start over");
                self.receiving = None;
                false
            }
        }
    }

    /// Takes a snapshot of the state machine every `snapshot_interval_entries`.
    ///
    /// The state is serialized here (it must be the state at `applied`), but
    /// the bytes are written to disk on a blocking thread: a state of
    /// hundreds of MB would otherwise stall heartbeats, appends and client
    /// calls for as long as the write takes. The snapshot is completed (synced
    /// and renamed into place) when the thread hands it back.
    fn maybe_snapshot(&mut self) -> Result<(), DriverError> {
        if self.snapshot_building.is_some()
            || self.applied < self.snapshot_index + self.config.snapshot_interval_entries
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
        let serialize_started = Instant::now();
        let data = self.state.lock().snapshot();
        let serialize_ms = serialize_started.elapsed().as_millis();
        let mut writer = self.storage.begin_snapshot(KV_GROUP, meta)?;
        self.snapshot_building = Some(index);
        tracing::debug!(
            index,
            bytes = data.len(),
            serialize_ms,
            "writing a snapshot"
        );
        let done = self.snapshot_written_tx.clone();
        tokio::task::spawn_blocking(move || {
            let outcome = writer.write(0, &data);
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
        outcome?;
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
        self.storage.save_snapshot(writer)?;
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
            tracing::info!(peer = id, %addr, "dialing a new member");
            self.transport.add_peer(id, addr);
        }
        for id in dialed {
            if !members.contains(&id) {
                tracing::info!(peer = id, "no longer dialing a removed member");
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
            if self.removed && published.errors.is_empty() {
                published
                    .errors
                    .push("this member has been removed from the cluster".into());
            }
            changed
        };
        if config_changed {
            self.reconcile_peers();
        }
    }
}

fn fail_waiter(waiter: Waiter, error: ApiError) {
    match waiter {
        Waiter::Propose(reply) => {
            let _ = reply.send(Err(error));
        }
        Waiter::Read(reply) | Waiter::Membership(reply) => {
            let _ = reply.send(Err(error));
        }
    }
}

fn fail_apply_waiter(waiter: ApplyWaiter, error: ApiError) {
    match waiter {
        ApplyWaiter::Propose(reply) => {
            let _ = reply.send(Err(error));
        }
        ApplyWaiter::Membership(reply) => {
            let _ = reply.send(Err(error));
        }
    }
}
