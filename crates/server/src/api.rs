//! The etcd v3 gRPC services, written against [`Backend`].
//!
//! Writes become commands proposed through the backend; linearizable reads
//! wait for the backend's read barrier and then read the local state;
//! serializable reads read the local state at once. Watches run one task per
//! client stream that drains the watch hub; leases renew on the leader's
//! clock. Calls ferry does not offer answer `Unimplemented` with a message
//! that says so. The same calls are served as JSON over HTTP/1.1 by the
//! [`gateway`] on the same ports.

pub mod gateway;
pub mod grpc_server;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::tokio_stream::StreamExt;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Access, AuthError, AuthStore, PASSWORD_BYTES_MAX};
use crate::auth_token::{Issued, TokenConfig, Tokens, SIMPLE_TOKEN_TTL_DEFAULT, TOKEN_BYTES_MAX};
use crate::authority::AuthorityRepair;
use crate::backend::{Backend, Defragmented, NodeStatus};
use crate::batched_writes::BatchedWrites;
use crate::command::{
    command, encoded_command_len, raise_no_space, CommandKind, LeaseGrantCommand,
    LeaseRevokeCommand,
};
use crate::connections::{
    ClientConnection, ClientProtocol, ClientTimeouts, ConnectionGate, ConnectionLimits,
};
use crate::error::{ApiError, KvError};
use crate::kv_state::{grows_store, CommandResponse};
use crate::log_limit::SharedLogLimiter;
use crate::metrics::grpc::GrpcMetrics;
use crate::pb::etcdserverpb as pb;
use crate::pb::etcdserverpb::auth_server::Auth;
use crate::pb::etcdserverpb::cluster_server::Cluster;
use crate::pb::etcdserverpb::kv_server::Kv;
use crate::pb::etcdserverpb::lease_server::Lease;
use crate::pb::etcdserverpb::maintenance_server::Maintenance;
use crate::pb::etcdserverpb::watch_request::RequestUnion;
use crate::pb::etcdserverpb::watch_wire::watch_server::Watch;
use crate::pb::ferrypb::WatchResponseWire;
use crate::pb::ferrypb::{AuthStamp, Command};
use crate::state::{StateMachine, RANGE_KEYS_PER_LOCK};
use crate::tls::{ClientConnectInfo, ClientIo, ReloadableTls};
use crate::watch::StreamId;

/// The etcd version ferry reports in Status: the API level it implements.
pub const REPORTED_ETCD_VERSION: &str = "3.5.0";

/// Extra room gRPC messages get above the request size limit, so that an
/// oversized request reaches our check and gets etcd's error instead of a
/// transport error (etcd allows the same 512 KiB).
pub const GRPC_OVERHEAD_BYTES: usize = 512 * 1024;

/// A port the API serves on: plaintext, or TLS with these certificates
/// (etcd's `--listen-client-urls http://...,https://...`).
#[derive(Debug)]
pub struct ClientListener {
    /// The bound listener.
    pub listener: TcpListener,
    /// TLS on this port, or `None` for plaintext.
    pub tls: Option<Arc<ReloadableTls>>,
}

/// Bytes of key-values a Range may return and still be copied into its
/// response on the API task; larger ones are built on a blocking thread.
const RANGE_INLINE_BYTES_MAX: usize = 256 * 1024;

/// Why a member with this status serves no client requests, if it does not.
fn refusal(status: &NodeStatus) -> Option<ApiError> {
    if status.removed {
        return Some(ApiError::Removed);
    }
    status.halted.clone().map(ApiError::Halted)
}

/// Control responses a watch stream may hold before its task stops reading
/// requests and sends them.
const WATCH_OUTBOX_FLUSH_AT: usize = 64;

/// Settings of authentication on this member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthOptions {
    /// Which tokens Authenticate hands out (`--auth-token`).
    pub token: TokenConfig,
    /// TTL of simple tokens, renewed by each use (`--auth-token-ttl`).
    pub token_ttl: Duration,
    /// bcrypt's cost for new password hashes (`--bcrypt-cost`, etcd's
    /// default 10; 4 to 31).
    pub bcrypt_cost: u32,
    /// Whether a client certificate's common name names the user of a
    /// request that carries no token (`--client-cert-auth`).
    pub client_cert_auth: bool,
    /// bcrypt computations run at once on this member (each keeps a core
    /// busy for tens of milliseconds at cost 10).
    pub bcrypt_concurrency: usize,
    /// Calls that may wait for a bcrypt slot; past them, Authenticate and
    /// the password-setting calls answer `etcdserver: too many requests`.
    pub bcrypt_waiting_max: usize,
}

/// Default of [`AuthOptions::bcrypt_cost`] (etcd's).
pub const BCRYPT_COST_DEFAULT: u32 = 10;

impl Default for AuthOptions {
    fn default() -> Self {
        AuthOptions {
            token: TokenConfig::Simple,
            token_ttl: SIMPLE_TOKEN_TTL_DEFAULT,
            bcrypt_cost: BCRYPT_COST_DEFAULT,
            client_cert_auth: false,
            bcrypt_concurrency: std::thread::available_parallelism().map_or(1, |n| n.get()),
            bcrypt_waiting_max: 128,
        }
    }
}

/// What a request brings to say who sends it.
#[derive(Clone, Default)]
pub struct Credentials {
    /// The token from the `token` metadata (etcd's clients), or from
    /// `authorization` (etcd's HTTP gateway), if any.
    token: Option<String>,
    /// The common name of the client's TLS certificate, if any.
    peer_common_name: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("peer_common_name", &self.peer_common_name)
            .finish()
    }
}

impl Credentials {
    /// The credentials of a request: its token metadata, and the common
    /// name of its client certificate, which the TLS layer reads from the
    /// connection (`None` without TLS).
    pub fn from_metadata(
        metadata: &tonic::metadata::MetadataMap,
        peer_common_name: Option<String>,
    ) -> Credentials {
        let token = ["token", "authorization"].iter().find_map(|key| {
            let value = metadata.get(*key)?.to_str().ok()?;
            let value = value.strip_prefix("Bearer ").unwrap_or(value).trim();
            (!value.is_empty()).then(|| value.to_string())
        });
        Credentials {
            token,
            peer_common_name,
        }
    }

    /// The credentials of `request` (see [`Credentials::from_metadata`]).
    pub fn of<T>(request: &Request<T>) -> Credentials {
        Credentials::from_metadata(request.metadata(), peer_common_name(request))
    }
}

/// The common name of the client certificate `request` came with: the hook
/// for `--client-cert-auth`. The TLS handshake verified the certificate
/// against the trusted CA before any request could arrive; a plaintext
/// connection, or one without a client certificate, has none.
fn peer_common_name<T>(request: &Request<T>) -> Option<String> {
    request
        .extensions()
        .get::<ClientConnectInfo>()
        .and_then(|info| info.common_name.as_deref())
        .map(str::to_string)
}

/// Settings of the API layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiOptions {
    /// Period of progress notifications for watchers that asked for them
    /// (etcd: 10 minutes).
    pub progress_notify_interval: Duration,
    /// Responses buffered per watch or keep-alive stream before the stream
    /// task waits for the client.
    pub stream_buffer_responses_max: usize,
    /// Bytes of responses buffered per watch stream before the stream task
    /// waits for the client (a response larger than this waits for an
    /// empty buffer), so that a client that does not read holds at most
    /// this much of the node's memory beyond what the watch hub bounds.
    pub watch_stream_buffer_bytes_max: usize,
    /// Largest gRPC message accepted, in bytes; raised automatically to the
    /// state machine's request limit plus [`GRPC_OVERHEAD_BYTES`].
    pub grpc_message_size_bytes_max: usize,
    /// How many client connections the listener holds at once, in all and
    /// per source address (the node derives them from its open files limit,
    /// see [`crate::connections::split_descriptors`]).
    pub connection_limits: ConnectionLimits,
    /// How long a client connection may stay silent.
    pub client_timeouts: ClientTimeouts,
    /// Authentication settings.
    pub auth: AuthOptions,
    /// Bytes this member's store may hold (`--quota-backend-bytes`): a
    /// write that grows the store past it raises the cluster's NOSPACE
    /// alarm and is refused, as etcd does.
    pub quota_backend_bytes: u64,
}

/// etcd's default backend quota: 2 GiB.
pub const QUOTA_BACKEND_BYTES_DEFAULT: u64 = 2 << 30;

impl Default for ApiOptions {
    fn default() -> Self {
        ApiOptions {
            progress_notify_interval: Duration::from_secs(600),
            stream_buffer_responses_max: 128,
            watch_stream_buffer_bytes_max: 4 << 20,
            grpc_message_size_bytes_max: 1536 * 1024 + GRPC_OVERHEAD_BYTES,
            connection_limits: ConnectionLimits::default(),
            client_timeouts: ClientTimeouts::default(),
            auth: AuthOptions::default(),
            quota_backend_bytes: QUOTA_BACKEND_BYTES_DEFAULT,
        }
    }
}

/// The etcd API over one backend; cheap to clone.
#[derive(Debug)]
pub struct EtcdApi<B> {
    backend: Arc<B>,
    options: ApiOptions,
    /// Turns true when the server stops, so that long-lived streams (watch,
    /// keep-alive) end and a graceful shutdown does not wait on them.
    stopping: tokio::sync::watch::Sender<bool>,
    /// This member's auth tokens.
    tokens: Arc<Tokens>,
    /// bcrypt computations running, and those running or waiting.
    bcrypt_running: Arc<Semaphore>,
    bcrypt_admitted: Arc<Semaphore>,
    /// Calls counted by method and code, for the metrics port.
    grpc_metrics: Arc<GrpcMetrics>,
    /// Backups streaming at once (each holds a view of the state and a
    /// blocking thread while its client reads).
    backups: Arc<Semaphore>,
}

impl<B> Clone for EtcdApi<B> {
    fn clone(&self) -> Self {
        EtcdApi {
            backend: self.backend.clone(),
            options: self.options.clone(),
            stopping: self.stopping.clone(),
            tokens: self.tokens.clone(),
            bcrypt_running: self.bcrypt_running.clone(),
            bcrypt_admitted: self.bcrypt_admitted.clone(),
            grpc_metrics: self.grpc_metrics.clone(),
            backups: self.backups.clone(),
        }
    }
}

/// Why a watch was refused or cancelled for lack of permission: the text
/// etcd puts in `cancel_reason` (the gRPC error's text).
const WATCH_PERMISSION_DENIED: &str =
    "rpc error: code = PermissionDenied desc = etcdserver: permission denied";

/// The user a watch stream acts as, and the auth revision its watchers
/// were last checked at.
struct WatchAuth {
    user: String,
    checked_revision: u64,
}

impl<B: Backend> EtcdApi<B> {
    /// The API over `backend`, with simple tokens (JWTs need keys loaded:
    /// see [`EtcdApi::with_tokens`]; with a JWT configuration this falls
    /// back to simple tokens and says so).
    pub fn new(backend: Arc<B>, options: ApiOptions) -> EtcdApi<B> {
        let tokens =
            Tokens::new(&options.auth.token, options.auth.token_ttl).unwrap_or_else(|error| {
                tracing::error!(%error, "auth tokens: using simple tokens instead");
                Tokens::simple(options.auth.token_ttl)
            });
        EtcdApi::with_tokens(backend, options, Arc::new(tokens))
    }

    /// The API over `backend` with the given token provider.
    pub fn with_tokens(backend: Arc<B>, options: ApiOptions, tokens: Arc<Tokens>) -> EtcdApi<B> {
        let running = options.auth.bcrypt_concurrency.max(1);
        let admitted = options
            .auth
            .bcrypt_waiting_max
            .max(1)
            .saturating_add(running);
        EtcdApi {
            backend,
            options,
            stopping: tokio::sync::watch::Sender::new(false),
            tokens,
            bcrypt_running: Arc::new(Semaphore::new(running.min(Semaphore::MAX_PERMITS))),
            bcrypt_admitted: Arc::new(Semaphore::new(admitted.min(Semaphore::MAX_PERMITS))),
            grpc_metrics: Arc::new(GrpcMetrics::default()),
            backups: Arc::new(Semaphore::new(BACKUPS_AT_ONCE_MAX)),
        }
    }

    /// The API's call counts by method and code (`grpc_server_handled_total`
    /// on the metrics port), kept by [`EtcdApi::serve_on`].
    pub fn grpc_metrics(&self) -> Arc<GrpcMetrics> {
        self.grpc_metrics.clone()
    }

    /// The user `credentials` name by the auth state `auth`: empty while
    /// auth is off (tokens are then ignored, as etcd does) or when the
    /// request brings none. A token wins over a certificate's name.
    fn caller_in(
        &self,
        machine: &StateMachine,
        credentials: &Credentials,
    ) -> Result<String, AuthError> {
        let auth = machine.kv().auth();
        if !auth.enabled() {
            return Ok(String::new());
        }
        if let Some(token) = &credentials.token {
            return self.tokens.resolve(token, auth, &machine.tokens);
        }
        if self.options.auth.client_cert_auth {
            if let Some(name) = &credentials.peer_common_name {
                return Ok(name.clone());
            }
        }
        Ok(String::new())
    }

    /// The credentials `request` brings, once this member can judge its
    /// token: a simple token handed out through another member is held
    /// here only once this member applied the entry, which may lag the
    /// client that brings it. So an unknown one makes this member catch up
    /// with everything committed before the call (ReadIndex) first.
    async fn credentials<T>(&self, request: &Request<T>) -> Result<Credentials, Status> {
        self.authenticated(Credentials::of(request)).await
    }

    /// `credentials`, once a simple token this member does not know yet
    /// had the chance to arrive (see [`EtcdApi::credentials`]).
    async fn authenticated(&self, credentials: Credentials) -> Result<Credentials, Status> {
        if let Some(token) = &credentials.token {
            let unknown = self.tokens.is_simple() && token.len() <= TOKEN_BYTES_MAX && {
                let machine = self.backend.state().lock();
                machine.kv().auth().enabled() && !machine.tokens.contains(token)
            };
            if unknown {
                self.backend.read_index().await?;
            }
        }
        Ok(credentials)
    }

    /// The user a request acts as, and the auth revision that was read at.
    fn caller(&self, credentials: &Credentials) -> Result<(String, u64), Status> {
        let machine = self.backend.state().lock();
        let auth = machine.kv().auth();
        let user = self
            .caller_in(&machine, credentials)
            .map_err(ApiError::from)?;
        Ok((user, auth.revision()))
    }

    /// Checks `check` against the auth state for the request's caller.
    fn authorize_with(
        &self,
        credentials: &Credentials,
        check: impl FnOnce(&AuthStore, &str) -> Result<(), AuthError>,
    ) -> Result<String, Status> {
        let machine = self.backend.state().lock();
        let auth = machine.kv().auth();
        let user = self
            .caller_in(&machine, credentials)
            .map_err(ApiError::from)?;
        check(auth, &user).map_err(ApiError::from)?;
        Ok(user)
    }

    /// Reads the auth state as of now (after a read index, as a
    /// linearizable read): `read` gets the state and the caller's user
    /// name, and decides what the caller may see.
    async fn read_auth<T>(
        &self,
        credentials: &Credentials,
        read: impl FnOnce(&AuthStore, &str) -> Result<T, AuthError>,
    ) -> Result<T, Status> {
        self.backend.read_index().await?;
        let machine = self.backend.state().lock();
        let user = self
            .caller_in(&machine, credentials)
            .map_err(ApiError::from)?;
        Ok(read(machine.kv().auth(), &user).map_err(ApiError::from)?)
    }

    /// Only root may (with auth on).
    fn require_admin(&self, credentials: &Credentials) -> Result<(), Status> {
        self.authorize_with(credentials, |auth, user| auth.check_admin(user))
            .map(drop)
    }

    /// Runs a bcrypt computation on a blocking thread, at most
    /// [`AuthOptions::bcrypt_concurrency`] at once; refuses it when too
    /// many wait already.
    async fn bcrypt<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Status> {
        let _admitted = self
            .bcrypt_admitted
            .clone()
            .try_acquire_owned()
            .map_err(|_| ApiError::from(AuthError::TooManyRequests))?;
        let _running = self
            .bcrypt_running
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Stopped)?;
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|error| ApiError::Internal(format!("the bcrypt task failed: {error}")).into())
    }

    /// The bcrypt hash of a new password, or etcd's refusal of it.
    async fn hash_password(&self, password: String) -> Result<String, Status> {
        if password.len() > PASSWORD_BYTES_MAX {
            return Err(ApiError::from(AuthError::Bound {
                what: "a password must be shorter (bcrypt reads only its first 72 bytes)",
                max: PASSWORD_BYTES_MAX,
            })
            .into());
        }
        let cost = self.options.auth.bcrypt_cost;
        self.bcrypt(move || bcrypt::hash(password.as_bytes(), cost))
            .await?
            .map_err(|error| ApiError::Internal(format!("bcrypt: {error}")).into())
    }

    /// Ends every open watch and keep-alive stream (their clients see the
    /// stream close and reconnect elsewhere). `serve` calls it on shutdown.
    pub fn stop_streams(&self) {
        self.stopping.send_replace(true);
    }

    /// Resolves once [`EtcdApi::stop_streams`] was called.
    async fn stopped(&self) {
        let mut stopping = self.stopping.subscribe();
        // An error means the sender is gone, which also means stop.
        let _ = stopping.wait_for(|stop| *stop).await;
    }

    /// The largest gRPC message the services decode: room for the largest
    /// request the state machine accepts plus framing, so that an
    /// oversized request gets etcd's error from our check.
    fn grpc_message_bytes_max(&self) -> usize {
        let request_size_max = self
            .backend
            .state()
            .lock()
            .kv()
            .limits()
            .request_size_bytes_max;
        self.options
            .grpc_message_size_bytes_max
            .max(request_size_max.saturating_add(GRPC_OVERHEAD_BYTES))
    }

    /// Serves the API on `listener` until `shutdown` resolves.
    ///
    /// Connections are accepted within [`ApiOptions::connection_limits`]
    /// (past the total, new ones wait in the kernel's backlog; past an
    /// address's share, they are closed), and closed when they stay silent
    /// past [`ApiOptions::client_timeouts`]; the server pings idle ones so
    /// that live clients never do. They go through [`AuthorityRepair`], so
    /// that etcd v3.4 clients which send a URL as the HTTP/2 authority are
    /// served too, and have Nagle's algorithm off, so that small responses
    /// are not held back.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send) {
        self.serve_on(
            vec![ClientListener {
                listener,
                tls: None,
            }],
            shutdown,
        )
        .await;
    }

    /// Serves the API on every listener of `listeners` until `shutdown`
    /// resolves, as [`EtcdApi::serve`] does on one. The listeners share one
    /// set of connection limits. On a TLS listener a connection is admitted
    /// by the limits first and then has the client handshake timeout to
    /// complete its TLS handshake (a plaintext client fails it at once), so
    /// no handshake holds a place for longer.
    pub async fn serve_on(
        self,
        listeners: Vec<ClientListener>,
        shutdown: impl Future<Output = ()> + Send,
    ) {
        let services = grpc_server::GrpcServices::new(&self, self.grpc_message_bytes_max());
        let gate = ConnectionGate::new(self.options.connection_limits);
        let timeouts = self.options.client_timeouts;
        // Every connection task holds a sender; once the API stops, the
        // receiver's end tells when the last connection is done.
        let (connections_open, mut connections_done) = mpsc::channel::<()>(1);
        let (stop_accepting, accepting_stopped) = tokio::sync::watch::channel(false);
        let warnings = Arc::new(SharedLogLimiter::for_remote_input());
        for ClientListener { listener, tls } in listeners {
            let gate = gate.clone();
            let warnings = warnings.clone();
            let api = self.clone();
            let services = services.clone();
            let connections_open = connections_open.clone();
            let mut accepting_stopped = accepting_stopped.clone();
            tokio::spawn(async move {
                loop {
                    let (stream, remote, ticket) = tokio::select! {
                        // The server stopped accepting (or `serve_on` was
                        // dropped, which `api.stopped()` would not see):
                        // close the listener.
                        _ = accepting_stopped.wait_for(|stop| *stop) => return,
                        accepted = gate.accept(&listener, "client", &warnings) => accepted,
                    };
                    let _ = stream.set_nodelay(true);
                    // Handshakes and the first bytes are awaited beside
                    // the accept loop, each holding its ticket: a slow
                    // client delays nobody else.
                    let tls = tls.clone();
                    let api = api.clone();
                    let services = services.clone();
                    let open = connections_open.clone();
                    tokio::spawn(async move {
                        let _open = open;
                        let io = match &tls {
                            None => ClientIo::Plain(stream),
                            Some(tls) => {
                                match ClientIo::accept_tls(stream, tls, timeouts.handshake).await {
                                    Ok(io) => io,
                                    Err(error) => {
                                        // A client's mistake, not the node's: no warning.
                                        tracing::debug!(%remote, %error, "client TLS handshake failed");
                                        return;
                                    }
                                }
                            }
                        };
                        let info = io.connect_info();
                        let mut connection =
                            ClientConnection::new(BatchedWrites::new(io), timeouts, Some(ticket));
                        match connection.sniff().await {
                            Ok(ClientProtocol::Http2) => {
                                let metrics = api.grpc_metrics.clone();
                                grpc_server::serve_connection(
                                    &services,
                                    metrics,
                                    AuthorityRepair::new(connection),
                                    info,
                                    timeouts.keepalive_interval(),
                                    api.stopped(),
                                )
                                .await;
                            }
                            Ok(ClientProtocol::Http1) => {
                                gateway::serve_connection(api, connection, info).await;
                            }
                            Err(error) => {
                                tracing::debug!(%remote, %error, "a client connection ended before its first request");
                            }
                        }
                    });
                }
            });
        }
        drop(connections_open);
        drop(accepting_stopped);
        shutdown.await;
        // Streams end, listeners close, and each connection shuts down
        // gracefully: the calls in flight finish.
        self.stop_streams();
        let _ = stop_accepting.send(true);
        while connections_done.recv().await.is_some() {}
    }

    fn header(&self, revision: i64) -> pb::ResponseHeader {
        let status = self.backend.status();
        pb::ResponseHeader {
            cluster_id: status.cluster_id,
            member_id: status.member_id,
            revision,
            raft_term: status.raft_term,
        }
    }

    fn fill(&self, header: &mut Option<pb::ResponseHeader>) {
        let revision = header.as_ref().map_or(0, |h| h.revision);
        *header = Some(self.header(revision));
    }

    fn current_revision(&self) -> i64 {
        self.backend.state().lock().kv().store().revision()
    }

    /// Refuses client requests on a member that was removed from the
    /// cluster (its state no longer follows the cluster's, so even a
    /// serializable read would answer from a past nobody else is in) or
    /// that halted on a detected fault (its state may contradict what the
    /// cluster committed).
    fn serving(&self) -> Result<(), Status> {
        refusal(&self.backend.status()).map_or(Ok(()), |error| Err(error.into()))
    }

    async fn propose(
        &self,
        credentials: &Credentials,
        command: Command,
    ) -> Result<CommandResponse, Status> {
        self.serving()?;
        Ok(self.propose_checked(credentials, command).await?)
    }

    /// [`EtcdApi::propose`] with the error as the API's, for callers that
    /// look at it.
    async fn propose_checked(
        &self,
        credentials: &Credentials,
        mut command: Command,
    ) -> Result<CommandResponse, ApiError> {
        let over_quota = {
            // Refuse what can be refused before it costs a log entry, and
            // write the limits it was admitted under into the command, for
            // every replica to apply it under the same ones; likewise who
            // asked and the auth revision it was authorized at.
            let machine = self.backend.state().lock();
            let kv = machine.kv();
            command.bounds = Some(kv.limits().command_bounds());
            kv.validate(&command)?;
            let user = self.caller_in(&machine, credentials)?;
            kv.authorize(&user, &command)?;
            command.auth = Some(AuthStamp {
                user,
                revision: kv.auth().revision(),
            });
            if let Some(CommandKind::Txn(txn)) = &command.kind {
                kv.admit_txn_response(txn)?;
            }
            if !grows_store(&command) {
                None
            } else if kv.out_of_space() {
                return Err(KvError::NoSpace.into());
            } else {
                let size_bytes = kv.store().size_bytes();
                let cost = encoded_command_len(&command) as u64;
                (size_bytes.saturating_add(cost) > self.options.quota_backend_bytes)
                    .then_some(size_bytes)
            }
        };
        if let Some(size_bytes) = over_quota {
            self.raise_no_space(size_bytes).await;
            return Err(KvError::NoSpace.into());
        }
        self.backend.propose(command).await
    }

    /// Raises this member's NOSPACE alarm for the whole cluster (a write
    /// would grow its store past the quota). A failure to raise it is
    /// logged: the write is refused all the same, and the next one tries
    /// again.
    async fn raise_no_space(&self, size_bytes: u64) {
        let member_id = self.backend.status().member_id;
        tracing::warn!(
            size_bytes,
            quota_backend_bytes = self.options.quota_backend_bytes,
            "the store is at its quota: raising the NOSPACE alarm"
        );
        if let Err(error) = self.backend.propose(raise_no_space(member_id)).await {
            tracing::warn!(%error, "raising the NOSPACE alarm failed");
        }
    }

    /// Checks `password` against `user`'s by the newest auth state (a
    /// change committed before this call counts), with bcrypt off the
    /// async threads; answers the auth revision it checked at.
    async fn check_password(&self, user: &str, password: &str) -> Result<u64, Status> {
        self.backend.read_index().await?;
        let (hash, revision) = {
            let machine = self.backend.state().lock();
            let auth = machine.kv().auth();
            if !auth.enabled() {
                return Err(ApiError::from(AuthError::AuthNotEnabled).into());
            }
            (auth.password_hash(user).cloned(), auth.revision())
        };
        let cost = self.options.auth.bcrypt_cost;
        let password = password.to_string();
        let verified = self
            .bcrypt(move || match &hash {
                Some(hash) => bcrypt::verify(password.as_bytes(), hash.as_str()).unwrap_or(false),
                None => {
                    // The same time spent for a user that does not exist
                    // (or has no password), so that timing tells nothing.
                    if let Some(decoy) = decoy_hash(cost) {
                        let _ = bcrypt::verify(password.as_bytes(), decoy);
                    }
                    false
                }
            })
            .await?;
        if !verified {
            return Err(ApiError::from(AuthError::AuthFailed).into());
        }
        Ok(revision)
    }

    /// Proposes an auth change and answers with a header.
    async fn propose_auth(
        &self,
        credentials: &Credentials,
        kind: CommandKind,
    ) -> Result<pb::ResponseHeader, Status> {
        match self.propose(credentials, command(kind)).await? {
            CommandResponse::AuthChanged { .. } => Ok(self.header(self.current_revision())),
            other => Err(unexpected(other)),
        }
    }
}

/// How often Authenticate checks a password again because the auth state
/// moved before its token was handed out.
const AUTHENTICATE_ATTEMPTS_MAX: u32 = 3;

fn unexpected(response: CommandResponse) -> Status {
    ApiError::Internal(format!("state machine answered with {response:?}")).into()
}

#[tonic::async_trait]
impl<B: Backend> Kv for EtcdApi<B> {
    async fn range(
        &self,
        request: Request<pb::RangeRequest>,
    ) -> Result<Response<pb::RangeResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let request = request.into_inner();
        self.serving()?;
        if request.key.is_empty() {
            return Err(ApiError::from(KvError::EmptyKey).into());
        }
        if !request.serializable {
            self.backend.read_index().await?;
        }
        // After the barrier: the auth state checked is at least as new as
        // the data read.
        self.authorize_with(&credentials, |auth, user| {
            auth.check_range(user, &request.key, &request.range_end, Access::Read)
        })?;
        // In steps, without holding the applier's lock for the whole scan
        // and never while the response is built (see
        // `SharedState::range_in_steps`). A small range is done here; a
        // large one keeps a core busy for a while, so it goes on a blocking
        // thread.
        let state = self.backend.state();
        let read = state
            .range_begin(&request, RANGE_KEYS_PER_LOCK)
            .map_err(ApiError::from)?;
        let mut response = if read.is_scanned() && read.collected_bytes() <= RANGE_INLINE_BYTES_MAX
        {
            read.finish(state, RANGE_KEYS_PER_LOCK, || {})
        } else {
            let backend = self.backend.clone();
            tokio::task::spawn_blocking(move || {
                read.finish(backend.state(), RANGE_KEYS_PER_LOCK, || {})
            })
            .await
            .map_err(|error| ApiError::Internal(format!("the range task failed: {error}")))?
        }
        .map_err(ApiError::from)?;
        self.fill(&mut response.header);
        Ok(Response::new(response))
    }

    async fn put(
        &self,
        request: Request<pb::PutRequest>,
    ) -> Result<Response<pb::PutResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        match self
            .propose(
                &credentials,
                command(CommandKind::Put(request.into_inner())),
            )
            .await?
        {
            CommandResponse::Put(mut response) => {
                self.fill(&mut response.header);
                Ok(Response::new(response))
            }
            other => Err(unexpected(other)),
        }
    }

    async fn delete_range(
        &self,
        request: Request<pb::DeleteRangeRequest>,
    ) -> Result<Response<pb::DeleteRangeResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        match self
            .propose(
                &credentials,
                command(CommandKind::DeleteRange(request.into_inner())),
            )
            .await?
        {
            CommandResponse::DeleteRange(mut response) => {
                self.fill(&mut response.header);
                Ok(Response::new(response))
            }
            other => Err(unexpected(other)),
        }
    }

    async fn txn(
        &self,
        request: Request<pb::TxnRequest>,
    ) -> Result<Response<pb::TxnResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        match self
            .propose(
                &credentials,
                command(CommandKind::Txn(request.into_inner())),
            )
            .await?
        {
            CommandResponse::Txn(mut response) => {
                let header = self.header(response.header.as_ref().map_or(0, |h| h.revision));
                response.header = Some(header);
                // Nested responses carry the same header; no recursion.
                let mut stack: Vec<&mut pb::ResponseOp> = response.responses.iter_mut().collect();
                while let Some(op) = stack.pop() {
                    use pb::response_op::Response as R;
                    match &mut op.response {
                        None => {}
                        Some(R::ResponseRange(r)) => r.header = Some(header),
                        Some(R::ResponsePut(r)) => r.header = Some(header),
                        Some(R::ResponseDeleteRange(r)) => r.header = Some(header),
                        Some(R::ResponseTxn(r)) => {
                            r.header = Some(header);
                            stack.extend(r.responses.iter_mut());
                        }
                    }
                }
                Ok(Response::new(response))
            }
            other => Err(unexpected(other)),
        }
    }

    async fn compact(
        &self,
        request: Request<pb::CompactionRequest>,
    ) -> Result<Response<pb::CompactionResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        match self
            .propose(
                &credentials,
                command(CommandKind::Compact(request.into_inner())),
            )
            .await?
        {
            CommandResponse::Compact(mut response) => {
                self.fill(&mut response.header);
                Ok(Response::new(response))
            }
            other => Err(unexpected(other)),
        }
    }
}

/// Closes a watch stream in the hub when its task ends, however it ends.
struct StreamGuard<B: Backend> {
    backend: Arc<B>,
    stream_id: StreamId,
}

impl<B: Backend> Drop for StreamGuard<B> {
    fn drop(&mut self) {
        self.backend
            .state()
            .lock()
            .watches
            .close_stream(self.stream_id);
    }
}

/// A watch response on its way to the client, with the share of the
/// stream's byte budget it holds until the client side takes it.
type WatchItem = (
    Result<WatchResponseWire, Status>,
    Option<OwnedSemaphorePermit>,
);

/// The sending side of a watch stream: a channel bounded in responses and
/// a budget in bytes (see [`ApiOptions::watch_stream_buffer_bytes_max`]).
struct WatchOutgoing {
    sender: mpsc::Sender<WatchItem>,
    budget: Arc<Semaphore>,
    budget_bytes: usize,
}

impl<B: Backend> EtcdApi<B> {
    /// Sends one response once the stream's buffer has room for it;
    /// `false` when the client is gone or the server stops.
    async fn send_watch(
        &self,
        outgoing: &WatchOutgoing,
        response: Result<WatchResponseWire, Status>,
    ) -> bool {
        let bytes = response.as_ref().map_or(0, |r| r.encoded_len());
        let permits = u32::try_from(bytes.min(outgoing.budget_bytes).max(1)).unwrap_or(u32::MAX);
        let send = async {
            let permit = outgoing
                .budget
                .clone()
                .acquire_many_owned(permits)
                .await
                .ok();
            outgoing.sender.send((response, permit)).await.is_ok()
        };
        tokio::select! {
            sent = send => sent,
            _ = outgoing.sender.closed() => false,
            _ = self.stopped() => false,
        }
    }

    /// Sends everything the hub has for the stream; `false` when the client
    /// is gone.
    async fn flush_watch(
        &self,
        stream_id: StreamId,
        outgoing: &WatchOutgoing,
        watch_auth: &mut WatchAuth,
    ) -> bool {
        loop {
            if let Some(error) = refusal(&self.backend.status()) {
                self.send_watch(outgoing, Err(error.into())).await;
                return false;
            }
            let (responses, behind) = {
                let mut machine = self.backend.state().lock();
                // The auth state changed since the watchers were checked:
                // check them again before handing out any more events, so
                // that a revoked permission stops the events that follow
                // it (they are applied after it, under this same lock).
                let revision = machine.kv().auth().revision();
                if revision != watch_auth.checked_revision {
                    machine.watch_retain_permitted(
                        stream_id,
                        &watch_auth.user,
                        WATCH_PERMISSION_DENIED,
                    );
                    watch_auth.checked_revision = revision;
                }
                machine.watch_drain(stream_id)
            };
            for mut response in responses {
                self.fill(&mut response.header);
                if !self.send_watch(outgoing, Ok(response)).await {
                    return false;
                }
            }
            if !behind {
                return true;
            }
        }
    }

    async fn run_watch_stream<S>(
        self,
        stream_id: StreamId,
        wake: Arc<tokio::sync::Notify>,
        mut incoming: S,
        outgoing: WatchOutgoing,
        mut watch_auth: WatchAuth,
    ) where
        S: tonic::codegen::tokio_stream::Stream<Item = Result<pb::WatchRequest, Status>>
            + Unpin
            + Send,
    {
        let _guard = StreamGuard {
            backend: self.backend.clone(),
            stream_id,
        };
        let mut progress = tokio::time::interval(self.options.progress_notify_interval);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        progress.tick().await;
        loop {
            tokio::select! {
                message = incoming.next() => {
                    let request = match message {
                        Some(Ok(request)) => request,
                        None => return,
                        Some(Err(status)) => {
                            tracing::debug!(%status, "watch stream closed by an error");
                            return;
                        }
                    };
                    let backlog = {
                        let mut machine = self.backend.state().lock();
                        match request.request_union {
                            Some(RequestUnion::CreateRequest(create)) => {
                                let permitted = machine.kv().auth().check_range(
                                    &watch_auth.user,
                                    &create.key,
                                    &create.range_end,
                                    Access::Read,
                                );
                                if permitted.is_ok() {
                                    machine.watch_create(stream_id, &create);
                                } else {
                                    // etcd's answer: created and cancelled
                                    // at once, with watch id -1.
                                    let revision = machine.kv().store().revision();
                                    machine.watches.refuse(
                                        stream_id,
                                        -1,
                                        WATCH_PERMISSION_DENIED,
                                        revision,
                                    );
                                }
                            }
                            Some(RequestUnion::CancelRequest(cancel)) => {
                                machine.watch_cancel(stream_id, cancel.watch_id);
                            }
                            Some(RequestUnion::ProgressRequest(_)) => {
                                machine.watches.request_progress(stream_id);
                            }
                            // An empty request asks for nothing.
                            None => {}
                        }
                        machine.watches.outbox_len(stream_id)
                    };
                    // Answer before reading more, so that a client that only
                    // sends cannot grow the outbox without bound.
                    if backlog >= WATCH_OUTBOX_FLUSH_AT && !self.flush_watch(stream_id, &outgoing, &mut watch_auth).await {
                        return;
                    }
                }
                _ = wake.notified() => {
                    if !self.flush_watch(stream_id, &outgoing, &mut watch_auth).await {
                        return;
                    }
                }
                _ = progress.tick() => {
                    self.backend.state().lock().watch_progress_tick(stream_id);
                }
                _ = outgoing.sender.closed() => return,
                _ = self.stopped() => return,
            }
        }
    }
}

/// The stream of watch responses a client reads (each event already
/// encoded; see [`WatchResponseWire`]).
pub type WatchResponseStream = Pin<
    Box<dyn tonic::codegen::tokio_stream::Stream<Item = Result<WatchResponseWire, Status>> + Send>,
>;

#[tonic::async_trait]
impl<B: Backend> Watch for EtcdApi<B> {
    type WatchStream = WatchResponseStream;

    async fn watch(
        &self,
        request: Request<Streaming<pb::WatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let credentials = self.credentials(&request).await?;
        let responses = self.open_watch(&credentials, request.into_inner()).await?;
        Ok(Response::new(responses))
    }
}

impl<B: Backend> EtcdApi<B> {
    /// Opens a watch stream fed by `incoming` (a gRPC client's stream, or
    /// the JSON gateway's requests) for the caller of `credentials`.
    pub(crate) async fn open_watch<S>(
        &self,
        credentials: &Credentials,
        incoming: S,
    ) -> Result<WatchResponseStream, Status>
    where
        S: tonic::codegen::tokio_stream::Stream<Item = Result<pb::WatchRequest, Status>>
            + Unpin
            + Send
            + 'static,
    {
        self.serving()?;
        let (user, checked_revision) = self.caller(credentials)?;
        let opened = self.backend.state().lock().watches.open_stream();
        let Some((stream_id, wake)) = opened else {
            return Err(Status::resource_exhausted(
                "ferry: too many watch streams on this node; retry later or use another member",
            ));
        };
        let (sender, receiver) = mpsc::channel(self.options.stream_buffer_responses_max.max(1));
        let budget_bytes = self
            .options
            .watch_stream_buffer_bytes_max
            .clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
        let outgoing = WatchOutgoing {
            sender,
            budget: Arc::new(Semaphore::new(budget_bytes)),
            budget_bytes,
        };
        tokio::spawn(self.clone().run_watch_stream(
            stream_id,
            wake,
            incoming,
            outgoing,
            WatchAuth {
                user,
                checked_revision,
            },
        ));
        // The budget a response held is given back as the client side
        // takes it.
        let responses = ReceiverStream::new(receiver).map(|(response, permit)| {
            drop(permit);
            response
        });
        Ok(Box::pin(responses))
    }
}

#[tonic::async_trait]
impl<B: Backend> Lease for EtcdApi<B> {
    async fn lease_grant(
        &self,
        request: Request<pb::LeaseGrantRequest>,
    ) -> Result<Response<pb::LeaseGrantResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let request = request.into_inner();
        let grant = LeaseGrantCommand {
            id: request.id,
            ttl_seconds: request.ttl,
        };
        match self
            .propose(&credentials, command(CommandKind::LeaseGrant(grant)))
            .await?
        {
            CommandResponse::LeaseGrant(mut response) => {
                self.fill(&mut response.header);
                Ok(Response::new(response))
            }
            other => Err(unexpected(other)),
        }
    }

    async fn lease_revoke(
        &self,
        request: Request<pb::LeaseRevokeRequest>,
    ) -> Result<Response<pb::LeaseRevokeResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let revoke = LeaseRevokeCommand {
            id: request.into_inner().id,
        };
        match self
            .propose(&credentials, command(CommandKind::LeaseRevoke(revoke)))
            .await?
        {
            CommandResponse::LeaseRevoke(mut response) => {
                self.fill(&mut response.header);
                Ok(Response::new(response))
            }
            other => Err(unexpected(other)),
        }
    }

    type LeaseKeepAliveStream = ReceiverStream<Result<pb::LeaseKeepAliveResponse, Status>>;

    async fn lease_keep_alive(
        &self,
        request: Request<Streaming<pb::LeaseKeepAliveRequest>>,
    ) -> Result<Response<Self::LeaseKeepAliveStream>, Status> {
        self.serving()?;
        self.authorize_with(&self.credentials(&request).await?, |auth, user| {
            auth.check_user(user)
        })?;
        let mut incoming = request.into_inner();
        let (outgoing, receiver) = mpsc::channel(self.options.stream_buffer_responses_max);
        let api = self.clone();
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    message = incoming.message() => message,
                    _ = api.stopped() => return,
                };
                let request = match message {
                    Ok(Some(request)) => request,
                    Ok(None) | Err(_) => return,
                };
                let answer = api.renew_lease(request.id).await;
                let failed = answer.is_err();
                if outgoing.send(answer).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(receiver)))
    }

    async fn lease_time_to_live(
        &self,
        request: Request<pb::LeaseTimeToLiveRequest>,
    ) -> Result<Response<pb::LeaseTimeToLiveResponse>, Status> {
        self.serving()?;
        let credentials = self.credentials(&request).await?;
        let request = request.into_inner();
        {
            // The keys are told only to whom may read them.
            let machine = self.backend.state().lock();
            let kv = machine.kv();
            let user = self
                .caller_in(&machine, &credentials)
                .map_err(ApiError::from)?;
            kv.auth().check_user(&user).map_err(ApiError::from)?;
            if let (true, Some(record)) = (request.keys, kv.leases().get(&request.id)) {
                for key in &record.keys {
                    kv.auth()
                        .check_range(&user, key, &[], Access::Read)
                        .map_err(ApiError::from)?;
                }
            }
        }
        let remaining = self.backend.lease_time_to_live(request.id).await?;
        let (granted, keys, revision) = {
            let machine = self.backend.state().lock();
            let record = machine.kv().leases().get(&request.id);
            (
                record.map(|r| r.granted_ttl_seconds),
                match (record, request.keys) {
                    (Some(record), true) => record.keys.iter().cloned().collect(),
                    _ => Vec::new(),
                },
                machine.kv().store().revision(),
            )
        };
        let response = match (remaining, granted) {
            (Some(ttl), Some(granted_ttl)) => pb::LeaseTimeToLiveResponse {
                header: Some(self.header(revision)),
                id: request.id,
                ttl,
                granted_ttl,
                keys,
            },
            // etcd reports an unknown or expired lease as TTL -1.
            _ => pb::LeaseTimeToLiveResponse {
                header: Some(self.header(revision)),
                id: request.id,
                ttl: -1,
                granted_ttl: 0,
                keys: Vec::new(),
            },
        };
        Ok(Response::new(response))
    }

    async fn lease_leases(
        &self,
        request: Request<pb::LeaseLeasesRequest>,
    ) -> Result<Response<pb::LeaseLeasesResponse>, Status> {
        self.serving()?;
        self.authorize_with(&self.credentials(&request).await?, |auth, user| {
            auth.check_user(user)
        })?;
        self.backend.read_index().await?;
        let (leases, revision) = {
            let machine = self.backend.state().lock();
            (
                machine
                    .kv()
                    .leases()
                    .keys()
                    .map(|id| pb::LeaseStatus { id: *id })
                    .collect(),
                machine.kv().store().revision(),
            )
        };
        Ok(Response::new(pb::LeaseLeasesResponse {
            header: Some(self.header(revision)),
            leases,
        }))
    }
}

#[tonic::async_trait]
impl<B: Backend> Cluster for EtcdApi<B> {
    async fn member_add(
        &self,
        request: Request<pb::MemberAddRequest>,
    ) -> Result<Response<pb::MemberAddResponse>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        let request = request.into_inner();
        let (member, members) = self
            .backend
            .member_add(request.peer_ur_ls, request.is_learner)
            .await?;
        Ok(Response::new(pb::MemberAddResponse {
            header: Some(self.header(self.current_revision())),
            member: Some(member),
            members,
        }))
    }

    async fn member_remove(
        &self,
        request: Request<pb::MemberRemoveRequest>,
    ) -> Result<Response<pb::MemberRemoveResponse>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        let members = self.backend.member_remove(request.into_inner().id).await?;
        Ok(Response::new(pb::MemberRemoveResponse {
            header: Some(self.header(self.current_revision())),
            members,
        }))
    }

    async fn member_update(
        &self,
        request: Request<pb::MemberUpdateRequest>,
    ) -> Result<Response<pb::MemberUpdateResponse>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        let request = request.into_inner();
        let members = self
            .backend
            .member_update(request.id, request.peer_ur_ls)
            .await?;
        Ok(Response::new(pb::MemberUpdateResponse {
            header: Some(self.header(self.current_revision())),
            members,
        }))
    }

    async fn member_list(
        &self,
        _request: Request<pb::MemberListRequest>,
    ) -> Result<Response<pb::MemberListResponse>, Status> {
        self.serving()?;
        let members = self.backend.member_list().await?;
        Ok(Response::new(pb::MemberListResponse {
            header: Some(self.header(self.current_revision())),
            members,
        }))
    }

    async fn member_promote(
        &self,
        request: Request<pb::MemberPromoteRequest>,
    ) -> Result<Response<pb::MemberPromoteResponse>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        let members = self.backend.member_promote(request.into_inner().id).await?;
        Ok(Response::new(pb::MemberPromoteResponse {
            header: Some(self.header(self.current_revision())),
            members,
        }))
    }
}

impl<B: Backend> EtcdApi<B> {
    /// Renews lease `id` once: one answer of a keep-alive stream (gRPC's
    /// or the gateway's), whose caller was authorized when it opened.
    async fn renew_lease(&self, id: i64) -> Result<pb::LeaseKeepAliveResponse, Status> {
        self.serving()?;
        match self.backend.lease_keep_alive(id).await {
            // etcd answers an unknown lease with TTL 0, not an error.
            Ok(ttl) => Ok(pb::LeaseKeepAliveResponse {
                header: Some(self.header(self.current_revision())),
                id,
                ttl: ttl.unwrap_or(0),
            }),
            Err(error) => Err(Status::from(error)),
        }
    }
}

/// Stream type of the Snapshot call (a backup, see [`crate::backup`]).
pub type SnapshotStream = ReceiverStream<Result<pb::SnapshotResponse, Status>>;

/// Backups one member streams at once; another is refused with
/// ResourceExhausted until one ends.
pub const BACKUPS_AT_ONCE_MAX: usize = 2;

/// Blobs of a backup queued for its client.
const BACKUP_QUEUE_BLOBS: usize = 4;

/// How long a backup waits for its client to take the next blob before it
/// gives up (a client that stopped reading holds no thread for longer).
const BACKUP_SEND_TIMEOUT: Duration = Duration::from_secs(60);

#[tonic::async_trait]
impl<B: Backend> Maintenance for EtcdApi<B> {
    async fn alarm(
        &self,
        request: Request<pb::AlarmRequest>,
    ) -> Result<Response<pb::AlarmResponse>, Status> {
        use pb::alarm_request::AlarmAction;
        let credentials = self.credentials(&request).await?;
        let request = request.into_inner();
        match AlarmAction::try_from(request.action) {
            // Anyone may list alarms (etcdctl's health check does); each
            // member answers from the replicated state it has applied.
            Ok(AlarmAction::Get) => {
                let alarms = self.backend.state().lock().kv().alarms();
                Ok(Response::new(pb::AlarmResponse {
                    header: Some(self.header(self.current_revision())),
                    alarms,
                }))
            }
            Ok(AlarmAction::Activate) | Ok(AlarmAction::Deactivate) => {
                self.require_admin(&credentials)?;
                match self
                    .propose(&credentials, command(CommandKind::Alarm(request)))
                    .await?
                {
                    CommandResponse::Alarm(alarms) => Ok(Response::new(pb::AlarmResponse {
                        header: Some(self.header(self.current_revision())),
                        alarms,
                    })),
                    other => Err(unexpected(other)),
                }
            }
            Err(_) => Err(Status::invalid_argument(format!(
                "ferry: unknown alarm action {}",
                request.action
            ))),
        }
    }

    async fn status(
        &self,
        _request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let mut status = self.backend.status();
        let (revision, db_size, alarms) = {
            let machine = self.backend.state().lock();
            let store = machine.kv().store();
            (
                store.revision(),
                i64::try_from(store.size_bytes()).unwrap_or(i64::MAX),
                machine.kv().alarms(),
            )
        };
        // As etcd lists them: one error per raised alarm.
        status.errors.extend(alarms.iter().map(|alarm| {
            format!(
                "memberID:{} alarm:{}",
                alarm.member_id,
                pb::AlarmType::try_from(alarm.alarm).map_or("UNKNOWN", |a| a.as_str_name())
            )
        }));
        Ok(Response::new(pb::StatusResponse {
            header: Some(pb::ResponseHeader {
                cluster_id: status.cluster_id,
                member_id: status.member_id,
                revision,
                raft_term: status.raft_term,
            }),
            version: REPORTED_ETCD_VERSION.to_string(),
            db_size,
            leader: status.leader_id,
            raft_index: status.raft_index,
            raft_term: status.raft_term,
            raft_applied_index: status.raft_applied_index,
            errors: status.errors,
            db_size_in_use: db_size,
            is_learner: status.is_learner,
        }))
    }

    async fn defragment(
        &self,
        request: Request<pb::DefragmentRequest>,
    ) -> Result<Response<pb::DefragmentResponse>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        // etcd rewrites its bbolt file to give back the pages deleted keys
        // left free. ferry's store holds no free pages, but the versions
        // compaction removed stay in its runs until a merge rewrites them:
        // a defragment merges every run into one now, so that the space
        // is back when it answers (an operator clearing a NOSPACE alarm
        // compacts, defragments, then disarms).
        match self.backend.defragment().await {
            Defragmented::NothingToDo => tracing::info!(
                "defragment: nothing to do (the state is in memory; compaction freed what it removed)"
            ),
            Defragmented::Merged {
                size_bytes_before,
                size_bytes_after,
            } => tracing::info!(
                size_bytes_before,
                size_bytes_after,
                "defragment: the store was merged into one run"
            ),
        }
        Ok(Response::new(pb::DefragmentResponse {
            header: Some(self.header(self.current_revision())),
        }))
    }

    async fn hash(
        &self,
        request: Request<pb::HashRequest>,
    ) -> Result<Response<pb::HashResponse>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        // The view is taken under the lock (it shares the values); the
        // checksum runs off it, on a blocking thread.
        let source = self.backend.state().lock().snapshot_source();
        let revision = source.revision();
        let hash = tokio::task::spawn_blocking(move || source.content_hash())
            .await
            .map_err(|error| ApiError::Internal(format!("hashing the state: {error}")))?
            .map_err(ApiError::from)?;
        Ok(Response::new(pb::HashResponse {
            header: Some(self.header(revision)),
            hash,
        }))
    }

    async fn hash_kv(
        &self,
        request: Request<pb::HashKvRequest>,
    ) -> Result<Response<pb::HashKvResponse>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        let requested = request.into_inner().revision;
        let (hash, compact_revision, current) = {
            let machine = self.backend.state().lock();
            let store = machine.kv().store();
            (
                store.hash_kv(requested).map_err(ApiError::from)?,
                store.compacted_revision(),
                store.revision(),
            )
        };
        Ok(Response::new(pb::HashKvResponse {
            header: Some(self.header(current)),
            hash,
            compact_revision,
            hash_revision: if requested > 0 { requested } else { current },
        }))
    }

    type SnapshotStream = SnapshotStream;

    async fn snapshot(
        &self,
        request: Request<pb::SnapshotRequest>,
    ) -> Result<Response<Self::SnapshotStream>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        let Ok(permit) = self.backups.clone().try_acquire_owned() else {
            return Err(Status::resource_exhausted(format!(
                "ferry: {BACKUPS_AT_ONCE_MAX} backups are streaming from this member; try again when one ends"
            )));
        };
        // The state as applied now, taken under the lock (the versions are
        // shared, not copied); encoded on a blocking thread as the client
        // reads.
        let source = self.backend.state().lock().snapshot_source();
        let header = self.header(source.revision());
        let (tx, rx) = mpsc::channel(BACKUP_QUEUE_BLOBS);
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut first = true;
            let streamed = crate::backup::stream_backup(&source, |blob, remaining_bytes| {
                let response = pb::SnapshotResponse {
                    header: Some(header),
                    remaining_bytes,
                    blob,
                    // etcd 3.6 names its storage version in the first message.
                    version: if std::mem::take(&mut first) {
                        REPORTED_ETCD_VERSION.to_string()
                    } else {
                        String::new()
                    },
                };
                runtime
                    .block_on(tx.send_timeout(Ok(response), BACKUP_SEND_TIMEOUT))
                    .map_err(|_| crate::backup::BackupError::ReceiverGone)
            });
            match streamed {
                Ok(bytes) => tracing::info!(bytes, revision = source.revision(), "backup streamed"),
                Err(crate::backup::BackupError::ReceiverGone) => {
                    tracing::info!("backup given up: its client went away or stopped reading")
                }
                Err(error) => {
                    tracing::error!(%error, "backup failed");
                    let status = Status::from(ApiError::Internal(format!("backup: {error}")));
                    let _ = runtime.block_on(tx.send_timeout(Err(status), BACKUP_SEND_TIMEOUT));
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn move_leader(
        &self,
        request: Request<pb::MoveLeaderRequest>,
    ) -> Result<Response<pb::MoveLeaderResponse>, Status> {
        self.serving()?;
        self.require_admin(&self.credentials(&request).await?)?;
        let target = request.into_inner().target_id;
        self.backend.move_leader(target).await?;
        Ok(Response::new(pb::MoveLeaderResponse {
            header: Some(self.header(self.current_revision())),
        }))
    }

    async fn downgrade(
        &self,
        request: Request<pb::DowngradeRequest>,
    ) -> Result<Response<pb::DowngradeResponse>, Status> {
        self.require_admin(&self.credentials(&request).await?)?;
        Err(ApiError::Unimplemented("Downgrade").into())
    }
}

/// A bcrypt hash that matches no password, checked when the user is
/// unknown or has no password, so that a wrong name costs as long as a
/// wrong password and Authenticate does not tell which users exist.
fn decoy_hash(cost: u32) -> Option<&'static str> {
    static DECOY: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    DECOY
        .get_or_init(|| bcrypt::hash(b"ferry: no such user", cost).ok())
        .as_deref()
}

#[tonic::async_trait]
impl<B: Backend> Auth for EtcdApi<B> {
    async fn auth_enable(
        &self,
        request: Request<pb::AuthEnableRequest>,
    ) -> Result<Response<pb::AuthEnableResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let header = self
            .propose_auth(&credentials, CommandKind::AuthEnable(request.into_inner()))
            .await?;
        Ok(Response::new(pb::AuthEnableResponse {
            header: Some(header),
        }))
    }

    async fn auth_disable(
        &self,
        request: Request<pb::AuthDisableRequest>,
    ) -> Result<Response<pb::AuthDisableResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let header = self
            .propose_auth(&credentials, CommandKind::AuthDisable(request.into_inner()))
            .await?;
        Ok(Response::new(pb::AuthDisableResponse {
            header: Some(header),
        }))
    }

    async fn auth_status(
        &self,
        _request: Request<pb::AuthStatusRequest>,
    ) -> Result<Response<pb::AuthStatusResponse>, Status> {
        self.serving()?;
        self.backend.read_index().await?;
        let (enabled, auth_revision) = {
            let machine = self.backend.state().lock();
            let auth = machine.kv().auth();
            (auth.enabled(), auth.revision())
        };
        Ok(Response::new(pb::AuthStatusResponse {
            header: Some(self.header(self.current_revision())),
            enabled,
            auth_revision,
        }))
    }

    async fn authenticate(
        &self,
        request: Request<pb::AuthenticateRequest>,
    ) -> Result<Response<pb::AuthenticateResponse>, Status> {
        self.serving()?;
        let request = request.into_inner();
        if request.name.is_empty() || request.password.len() > PASSWORD_BYTES_MAX {
            return Err(ApiError::from(AuthError::AuthFailed).into());
        }
        // A simple token is valid once the log handed it out, and only if
        // the auth state did not move between the password check and that
        // apply (the password may have changed); if it moved, check again,
        // as etcd does, a bounded number of times.
        let mut attempts_left = AUTHENTICATE_ATTEMPTS_MAX;
        loop {
            attempts_left -= 1;
            let revision = self
                .check_password(&request.name, &request.password)
                .await?;
            let token = match self
                .tokens
                .issue(&request.name, revision)
                .map_err(ApiError::from)?
            {
                Issued::Signed(token) => token,
                Issued::Replicate(assign) => {
                    let token = assign.token.clone();
                    let proposed = self
                        .propose_checked(
                            &Credentials::default(),
                            command(CommandKind::AuthToken(assign)),
                        )
                        .await;
                    match proposed {
                        Ok(CommandResponse::TokenAssigned(_)) => token,
                        Ok(other) => return Err(unexpected(other)),
                        Err(ApiError::Kv(KvError::Auth(AuthError::AuthOldRevision)))
                            if attempts_left > 0 =>
                        {
                            continue;
                        }
                        Err(error) => return Err(error.into()),
                    }
                }
            };
            return Ok(Response::new(pb::AuthenticateResponse {
                header: Some(self.header(self.current_revision())),
                token,
            }));
        }
    }

    async fn user_add(
        &self,
        request: Request<pb::AuthUserAddRequest>,
    ) -> Result<Response<pb::AuthUserAddResponse>, Status> {
        self.serving()?;
        let credentials = self.credentials(&request).await?;
        let mut request = request.into_inner();
        // Who may add users is checked before bcrypt spends any time.
        self.require_admin(&credentials)?;
        if request.name.is_empty() {
            return Err(ApiError::from(AuthError::UserEmpty).into());
        }
        let no_password = request.options.as_ref().is_some_and(|o| o.no_password);
        if no_password {
            request.hashed_password.clear();
        } else if request.hashed_password.is_empty() || !request.password.is_empty() {
            request.hashed_password = self
                .hash_password(std::mem::take(&mut request.password))
                .await?;
        }
        request.password.clear();
        let header = self
            .propose_auth(&credentials, CommandKind::UserAdd(request))
            .await?;
        Ok(Response::new(pb::AuthUserAddResponse {
            header: Some(header),
        }))
    }

    async fn user_get(
        &self,
        request: Request<pb::AuthUserGetRequest>,
    ) -> Result<Response<pb::AuthUserGetResponse>, Status> {
        self.serving()?;
        let credentials = self.credentials(&request).await?;
        let name = request.into_inner().name;
        let roles = self
            .read_auth(&credentials, |auth, user| {
                // A user may read itself; everyone else, only root.
                if !(auth.enabled() && user == name && !user.is_empty()) {
                    auth.check_admin(user)?;
                }
                let record = auth.users().get(&name).ok_or(AuthError::UserNotFound)?;
                Ok(record.roles.iter().cloned().collect())
            })
            .await?;
        Ok(Response::new(pb::AuthUserGetResponse {
            header: Some(self.header(self.current_revision())),
            roles,
        }))
    }

    async fn user_list(
        &self,
        request: Request<pb::AuthUserListRequest>,
    ) -> Result<Response<pb::AuthUserListResponse>, Status> {
        self.serving()?;
        let credentials = self.credentials(&request).await?;
        let users = self
            .read_auth(&credentials, |auth, user| {
                auth.check_admin(user)?;
                Ok(auth.users().keys().cloned().collect())
            })
            .await?;
        Ok(Response::new(pb::AuthUserListResponse {
            header: Some(self.header(self.current_revision())),
            users,
        }))
    }

    async fn user_delete(
        &self,
        request: Request<pb::AuthUserDeleteRequest>,
    ) -> Result<Response<pb::AuthUserDeleteResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let request = request.into_inner();
        let header = self
            .propose_auth(&credentials, CommandKind::UserDelete(request))
            .await?;
        Ok(Response::new(pb::AuthUserDeleteResponse {
            header: Some(header),
        }))
    }

    async fn user_change_password(
        &self,
        request: Request<pb::AuthUserChangePasswordRequest>,
    ) -> Result<Response<pb::AuthUserChangePasswordResponse>, Status> {
        self.serving()?;
        let credentials = self.credentials(&request).await?;
        let mut request = request.into_inner();
        // Root, or the user itself, before bcrypt spends any time.
        let name = request.name.clone();
        self.authorize_with(&credentials, |auth, user| {
            if auth.enabled() && user == name && !user.is_empty() {
                auth.check_user(user)
            } else {
                auth.check_admin(user)
            }
        })?;
        if request.name.is_empty() {
            return Err(ApiError::from(AuthError::UserEmpty).into());
        }
        if request.hashed_password.is_empty() || !request.password.is_empty() {
            request.hashed_password = self
                .hash_password(std::mem::take(&mut request.password))
                .await?;
        }
        request.password.clear();
        let header = self
            .propose_auth(&credentials, CommandKind::UserChangePassword(request))
            .await?;
        Ok(Response::new(pb::AuthUserChangePasswordResponse {
            header: Some(header),
        }))
    }

    async fn user_grant_role(
        &self,
        request: Request<pb::AuthUserGrantRoleRequest>,
    ) -> Result<Response<pb::AuthUserGrantRoleResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let header = self
            .propose_auth(
                &credentials,
                CommandKind::UserGrantRole(request.into_inner()),
            )
            .await?;
        Ok(Response::new(pb::AuthUserGrantRoleResponse {
            header: Some(header),
        }))
    }

    async fn user_revoke_role(
        &self,
        request: Request<pb::AuthUserRevokeRoleRequest>,
    ) -> Result<Response<pb::AuthUserRevokeRoleResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let header = self
            .propose_auth(
                &credentials,
                CommandKind::UserRevokeRole(request.into_inner()),
            )
            .await?;
        Ok(Response::new(pb::AuthUserRevokeRoleResponse {
            header: Some(header),
        }))
    }

    async fn role_add(
        &self,
        request: Request<pb::AuthRoleAddRequest>,
    ) -> Result<Response<pb::AuthRoleAddResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let header = self
            .propose_auth(&credentials, CommandKind::RoleAdd(request.into_inner()))
            .await?;
        Ok(Response::new(pb::AuthRoleAddResponse {
            header: Some(header),
        }))
    }

    async fn role_get(
        &self,
        request: Request<pb::AuthRoleGetRequest>,
    ) -> Result<Response<pb::AuthRoleGetResponse>, Status> {
        self.serving()?;
        let credentials = self.credentials(&request).await?;
        let role = request.into_inner().role;
        let perm = self
            .read_auth(&credentials, |auth, user| {
                // A user may read the roles it has; everyone else, only root.
                let has_role = auth
                    .users()
                    .get(user)
                    .is_some_and(|u| u.roles.contains(&role));
                if !(auth.enabled() && has_role) {
                    auth.check_admin(user)?;
                }
                Ok(auth
                    .roles()
                    .get(&role)
                    .ok_or(AuthError::RoleNotFound)?
                    .clone())
            })
            .await?;
        Ok(Response::new(pb::AuthRoleGetResponse {
            header: Some(self.header(self.current_revision())),
            perm,
        }))
    }

    async fn role_list(
        &self,
        request: Request<pb::AuthRoleListRequest>,
    ) -> Result<Response<pb::AuthRoleListResponse>, Status> {
        self.serving()?;
        let credentials = self.credentials(&request).await?;
        let roles = self
            .read_auth(&credentials, |auth, user| {
                auth.check_admin(user)?;
                Ok(auth.roles().keys().cloned().collect())
            })
            .await?;
        Ok(Response::new(pb::AuthRoleListResponse {
            header: Some(self.header(self.current_revision())),
            roles,
        }))
    }

    async fn role_delete(
        &self,
        request: Request<pb::AuthRoleDeleteRequest>,
    ) -> Result<Response<pb::AuthRoleDeleteResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let header = self
            .propose_auth(&credentials, CommandKind::RoleDelete(request.into_inner()))
            .await?;
        Ok(Response::new(pb::AuthRoleDeleteResponse {
            header: Some(header),
        }))
    }

    async fn role_grant_permission(
        &self,
        request: Request<pb::AuthRoleGrantPermissionRequest>,
    ) -> Result<Response<pb::AuthRoleGrantPermissionResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let header = self
            .propose_auth(
                &credentials,
                CommandKind::RoleGrantPermission(request.into_inner()),
            )
            .await?;
        Ok(Response::new(pb::AuthRoleGrantPermissionResponse {
            header: Some(header),
        }))
    }

    async fn role_revoke_permission(
        &self,
        request: Request<pb::AuthRoleRevokePermissionRequest>,
    ) -> Result<Response<pb::AuthRoleRevokePermissionResponse>, Status> {
        let credentials = self.credentials(&request).await?;
        let header = self
            .propose_auth(
                &credentials,
                CommandKind::RoleRevokePermission(request.into_inner()),
            )
            .await?;
        Ok(Response::new(pb::AuthRoleRevokePermissionResponse {
            header: Some(header),
        }))
    }
}

/// Binds `address` and serves `api` on it in a background task; returns the
/// bound address (useful with port 0) and the task.
pub async fn spawn_server<B: Backend>(
    api: EtcdApi<B>,
    address: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = crate::connections::bind_listener(address)?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(api.serve(listener, shutdown));
    Ok((local, task))
}
