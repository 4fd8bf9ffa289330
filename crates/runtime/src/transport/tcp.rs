//! The TCP peer transport: one outbound connection per peer with a bounded
//! queue and batched writes, an accept loop for inbound connections, and
//! reconnection with capped exponential backoff.
//!
//! # What an inbound connection may cost
//!
//! The peer port's only credential is the cluster id, which every client
//! can read, and a member may be buggy or compromised; so what a connection
//! can make this node hold is bounded whoever is on the other end:
//!
//! - the listener holds [`TransportConfig::connection_limits`] connections
//!   at once, in all and per address;
//! - before its hello, a connection may send at most a hello's bytes, within
//!   [`TransportConfig::connect_timeout`];
//! - after it, a frame's bytes are held only as they arrive (a header alone
//!   allocates nothing), one frame at a time per connection (so at most
//!   [`TransportConfig::frame_bytes_max`]), and every byte held, in frames
//!   being read and in frames waiting for the runtime, is paid for from one
//!   budget of [`TransportConfig::inbound_buffered_bytes_max`]: while it is
//!   spent, readers wait and TCP pushes back on the senders;
//! - a connection that sends nothing for [`TransportConfig::read_timeout`],
//!   sends a frame slower than [`FRAME_BYTES_PER_SECOND_MIN`], or waits that
//!   long for the budget (which breaks the deadlock of connections that
//!   each hold part of a frame and wait for more), is closed;
//! - warnings a connection can cause are rate limited ([`crate::log_limit`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use ferry_raft::NodeId;

use crate::connections::{ConnectionGate, ConnectionLimits};
use crate::log_limit::SharedLogLimiter;
use crate::member_id::Hex;
use crate::tls::ReloadableTls;

use super::frame::{
    decode_frame, encode_frame, frame_bytes_missing, FrameError, FRAME_BYTES_MAX_DEFAULT,
    FRAME_HEADER_BYTES,
};
use super::handshake::{
    decode_answer, encode_answer, HandshakeError, Hello, HELLO_BYTES, REASON_BYTES_MAX,
};

/// The most bytes read from a peer socket at once (and so the most a
/// connection holds beyond what it has paid for, never).
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// The budget a connection leaves free when it reads ahead (see
/// [`FrameReader`]): room for a few other connections' chunks.
const READ_AHEAD_ROOM_BYTES: usize = 4 * READ_CHUNK_BYTES;
/// The slowest a frame may arrive, once its header is in: a frame of `n`
/// bytes must be complete within the read timeout plus `n` divided by this.
/// A link slower than this cannot carry a cluster's replication anyway, and
/// a sender that trickles a large frame would otherwise hold its bytes of
/// the budget for as long as it likes.
pub const FRAME_BYTES_PER_SECOND_MIN: u64 = 256 * 1024;

/// Settings of the transport.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// This node.
    pub node_id: NodeId,
    /// The cluster this node belongs to; peers of other clusters are refused.
    pub cluster_id: u64,
    /// Where to accept peer connections.
    pub listen: SocketAddr,
    /// The peers to dial: id -> "host:port".
    pub peers: BTreeMap<NodeId, String>,
    /// The most frames queued for one peer; more are shed (the engine
    /// regenerates anything that matters).
    pub queue_frames_max: usize,
    /// The most bytes written to a socket in one batch.
    pub batch_bytes_max: usize,
    /// The largest frame accepted from a peer.
    pub frame_bytes_max: u32,
    /// The first reconnect delay; it doubles up to `reconnect_backoff_max`.
    pub reconnect_backoff_min: Duration,
    /// The longest reconnect delay.
    pub reconnect_backoff_max: Duration,
    /// How long connecting and the handshake may take; also how long an
    /// inbound connection has to send its hello.
    pub connect_timeout: Duration,
    /// The longest an inbound connection may go without a byte from its
    /// peer once past the handshake. A live peer sends heartbeats, their
    /// answers or votes every few ticks, so only a stuck or hostile one is
    /// closed (and a closed peer simply dials again).
    pub read_timeout: Duration,
    /// The most bytes held for frames from peers, across every inbound
    /// connection: frames being read and frames received but not yet
    /// dropped by the runtime. Raised to one largest frame if lower.
    pub inbound_buffered_bytes_max: usize,
    /// How many inbound connections the peer listener holds at once, in
    /// all and per address.
    pub connection_limits: ConnectionLimits,
    /// TLS for every peer connection, both ways (`--peer-cert-file` and
    /// the rest), or `None` for plain TCP. Inbound connections complete a
    /// TLS handshake (within `connect_timeout`) before their hello is
    /// read, so that a peer without a certificate the cluster's CA signed
    /// cannot send a single frame; outbound ones verify the peer's
    /// certificate against the same CA. A reload takes effect at the next
    /// handshake; open connections keep theirs.
    pub tls: Option<Arc<ReloadableTls>>,
}

impl TransportConfig {
    /// Defaults for a node listening on `listen`.
    pub fn new(node_id: NodeId, cluster_id: u64, listen: SocketAddr) -> Self {
        TransportConfig {
            node_id,
            cluster_id,
            listen,
            peers: BTreeMap::new(),
            queue_frames_max: 4096,
            batch_bytes_max: 1 << 20,
            frame_bytes_max: FRAME_BYTES_MAX_DEFAULT,
            reconnect_backoff_min: Duration::from_millis(50),
            reconnect_backoff_max: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            read_timeout: Duration::from_secs(30),
            inbound_buffered_bytes_max: 256 << 20,
            connection_limits: ConnectionLimits {
                connections_max: 64,
                connections_per_ip_max: 16,
            },
            tls: None,
        }
    }

    /// The inbound budget in force: at least one largest frame (with its
    /// header and a read's worth), so that any frame a peer may send can
    /// be read.
    fn inbound_budget_bytes(&self) -> usize {
        let frame_bytes = (self.frame_bytes_max as usize)
            .saturating_add(FRAME_HEADER_BYTES)
            .saturating_add(READ_CHUNK_BYTES);
        self.inbound_buffered_bytes_max
            .max(frame_bytes)
            .min(Semaphore::MAX_PERMITS)
    }
}

/// The share of the transport's inbound budget a received frame holds
/// until it is dropped (see [`TransportConfig::inbound_buffered_bytes_max`]):
/// the runtime drops it once it has taken the frame in.
#[derive(Debug, Default)]
pub struct BufferLease(Option<OwnedSemaphorePermit>);

impl BufferLease {
    /// The bytes this lease holds.
    pub fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, OwnedSemaphorePermit::num_permits)
    }
}

/// A lease says nothing about the frame it pays for: events compare by
/// what they carry.
impl PartialEq for BufferLease {
    fn eq(&self, _other: &BufferLease) -> bool {
        true
    }
}

impl Eq for BufferLease {}

/// What the transport tells the runtime.
#[derive(Debug, PartialEq, Eq)]
pub enum TransportEvent {
    /// The outbound connection to a peer is up (after the handshake).
    Connected(NodeId),
    /// The outbound connection to a peer went down.
    Disconnected(NodeId),
    /// A frame arrived from a peer.
    Received {
        /// The peer, as named in its handshake.
        from: NodeId,
        /// The frame's payload.
        payload: Bytes,
        /// The frame's share of the inbound budget, given back when the
        /// event is dropped.
        lease: BufferLease,
    },
}

/// Why the transport could not start.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer port could not be bound.
    #[error("cannot listen for peers on {addr}: {source}; is another process using the port?")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// Why one connection ended.
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Frame(#[from] FrameError),
    #[error("{0}")]
    Handshake(#[from] HandshakeError),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("connection closed by the peer")]
    Closed,
    #[error("the peer sent nothing for {0:?}")]
    Silent(Duration),
    #[error("the peer sent a frame of {0} bytes too slowly")]
    Slow(usize),
    #[error("the buffer budget for peers was used up for {0:?}; closing to give back this connection's share")]
    Starved(Duration),
}

/// Counters of what the transport did, for status and tests.
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Frames shed because a peer's queue was full or it was disconnected.
    pub frames_shed: AtomicU64,
    /// Frames written to sockets.
    pub frames_sent: AtomicU64,
    /// Connections refused at the handshake (either side).
    pub handshakes_refused: AtomicU64,
    /// Inbound connections closed because their peer was silent or slow,
    /// or because they waited too long for the buffer budget.
    pub connections_timed_out: AtomicU64,
}

/// A running transport. Dropping it does not stop the tasks; call
/// [`Transport::shutdown`].
pub struct Transport {
    config: TransportConfig,
    local_addr: SocketAddr,
    inbound: Arc<Inbound>,
    outbound: BTreeMap<NodeId, mpsc::Sender<Bytes>>,
    events: mpsc::Sender<TransportEvent>,
    stats: Arc<TransportStats>,
    shutdown: watch::Sender<bool>,
}

impl Transport {
    /// Binds the peer port and starts dialing every configured peer.
    pub async fn start(
        config: TransportConfig,
        events: mpsc::Sender<TransportEvent>,
    ) -> Result<Transport, TransportError> {
        let listener = crate::connections::bind_listener(config.listen).map_err(|source| {
            TransportError::Bind {
                addr: config.listen,
                source,
            }
        })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| TransportError::Bind {
                addr: config.listen,
                source,
            })?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        let stats = Arc::new(TransportStats::default());
        let inbound = Arc::new(Inbound {
            config: config.clone(),
            events: events.clone(),
            stats: stats.clone(),
            budget: Arc::new(Semaphore::new(config.inbound_budget_bytes())),
            gate: ConnectionGate::new(config.connection_limits),
            accept_warnings: SharedLogLimiter::for_remote_input(),
            refusal_warnings: SharedLogLimiter::for_remote_input(),
            drop_warnings: SharedLogLimiter::for_remote_input(),
            redial: Mutex::new(BTreeMap::new()),
        });
        tokio::spawn(accept_loop(listener, inbound.clone(), shutdown_rx));
        let mut transport = Transport {
            config: config.clone(),
            local_addr,
            inbound,
            outbound: BTreeMap::new(),
            events,
            stats,
            shutdown,
        };
        for (id, addr) in &config.peers {
            transport.add_peer(*id, addr.clone());
        }
        Ok(transport)
    }

    /// The address the transport listens on (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The peers this transport dials.
    pub fn peer_ids(&self) -> Vec<NodeId> {
        self.outbound.keys().copied().collect()
    }

    /// Starts dialing a new peer (after a membership change). A peer that is
    /// already known keeps its connection.
    pub fn add_peer(&mut self, id: NodeId, addr: String) {
        if id == self.config.node_id || self.outbound.contains_key(&id) {
            return;
        }
        let (sender, receiver) = mpsc::channel(self.config.queue_frames_max.max(1));
        self.outbound.insert(id, sender);
        let redial = Arc::new(Notify::new());
        self.inbound.redial_wakers().insert(id, redial.clone());
        tokio::spawn(outbound_loop(
            id,
            addr,
            self.config.clone(),
            redial,
            receiver,
            self.events.clone(),
            self.stats.clone(),
            self.shutdown.subscribe(),
        ));
    }

    /// Stops dialing a peer (after it left the cluster).
    pub fn remove_peer(&mut self, id: NodeId) {
        // Dropping the sender ends the peer's outbound task.
        self.outbound.remove(&id);
        self.inbound.redial_wakers().remove(&id);
    }

    /// Queues a frame for a peer. Returns false if it was shed (unknown peer,
    /// full queue): the engine's timers regenerate what matters.
    pub fn send(&self, to: NodeId, payload: Bytes) -> bool {
        let queued = match self.outbound.get(&to) {
            Some(sender) => sender.try_send(payload).is_ok(),
            None => false,
        };
        if !queued {
            self.stats.frames_shed.fetch_add(1, Ordering::Relaxed);
        }
        queued
    }

    /// The transport's counters.
    pub fn stats(&self) -> &TransportStats {
        &self.stats
    }

    /// Bytes of the inbound budget held now: frames being read and frames
    /// not yet dropped by the runtime.
    pub fn inbound_buffered_bytes(&self) -> usize {
        self.config
            .inbound_budget_bytes()
            .saturating_sub(self.inbound.budget.available_permits())
    }

    /// Frames queued for each peer now, waiting to be written.
    pub fn queued_frames(&self) -> BTreeMap<NodeId, usize> {
        self.outbound
            .iter()
            .map(|(id, sender)| (*id, sender.max_capacity().saturating_sub(sender.capacity())))
            .collect()
    }

    /// Events (received frames, link changes) waiting for the runtime now.
    pub fn events_queued(&self) -> usize {
        self.events
            .max_capacity()
            .saturating_sub(self.events.capacity())
    }

    /// Inbound connections open now.
    pub fn inbound_connections(&self) -> usize {
        self.inbound.gate.open_connections()
    }

    /// Stops every task of the transport.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
    }
}

/// What every inbound connection shares.
struct Inbound {
    config: TransportConfig,
    events: mpsc::Sender<TransportEvent>,
    stats: Arc<TransportStats>,
    /// One permit per byte held for frames from peers.
    budget: Arc<Semaphore>,
    gate: ConnectionGate,
    accept_warnings: SharedLogLimiter,
    refusal_warnings: SharedLogLimiter,
    drop_warnings: SharedLogLimiter,
    /// Per dialed peer, what wakes its dialer out of its backoff: a peer
    /// that connects to us is up again, so we dial it at once instead of
    /// leaving it without our messages until the backoff ends.
    redial: Mutex<BTreeMap<NodeId, Arc<Notify>>>,
}

impl Inbound {
    /// The dialers' wake-ups by peer (a poisoned lock still holds a whole
    /// map: each change is one insert or remove).
    fn redial_wakers(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, Arc<Notify>>> {
        self.redial
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

async fn accept_loop(
    listener: TcpListener,
    inbound: Arc<Inbound>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let (stream, remote, ticket) = tokio::select! {
            _ = shutdown.changed() => return,
            accepted = inbound.gate.accept(&listener, "peer", &inbound.accept_warnings) => accepted,
        };
        let inbound = inbound.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            inbound_connection(stream, remote, &inbound, shutdown).await;
            // The connection's place is given back once it is closed.
            drop(ticket);
        });
    }
}

async fn inbound_connection(
    stream: TcpStream,
    remote: SocketAddr,
    inbound: &Inbound,
    shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let Some(tls) = &inbound.config.tls else {
        return inbound_session(stream, remote, inbound, shutdown).await;
    };
    // The TLS handshake comes first and is bounded like the hello: a
    // connection that stalls in it holds its place for no longer.
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.current().server());
    match tokio::time::timeout(inbound.config.connect_timeout, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => inbound_session(stream, remote, inbound, shutdown).await,
        Ok(Err(error)) => {
            inbound
                .stats
                .handshakes_refused
                .fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = inbound.refusal_warnings.allow() {
                tracing::warn!(%remote, %error, suppressed, "refused a peer connection: TLS handshake failed");
            }
        }
        Err(_) => {
            tracing::debug!(%remote, "peer connection timed out during the TLS handshake");
        }
    }
}

async fn inbound_session<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    remote: SocketAddr,
    inbound: &Inbound,
    mut shutdown: watch::Receiver<bool>,
) {
    let config = &inbound.config;
    let stats = &inbound.stats;
    // Before the hello a connection has proved nothing: it may send a
    // hello's bytes, unpaid (they are that few), and nothing more.
    let hello_limits = ReadLimits {
        frame_bytes_max: HELLO_BYTES as u32,
        budget: None,
        read_timeout: config.connect_timeout,
    };
    let mut reader = FrameReader::new();
    let hello = match tokio::time::timeout(
        config.connect_timeout,
        reader.next(&mut stream, &hello_limits),
    )
    .await
    {
        Ok(Ok((payload, _))) => match Hello::decode(&payload) {
            Ok(hello) => hello,
            Err(error) => {
                if let Some(suppressed) = inbound.refusal_warnings.allow() {
                    tracing::warn!(%remote, %error, suppressed, "refused a peer connection");
                }
                stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
                let _ = write_frame(&mut stream, &encode_answer(Some(&error.to_string()))).await;
                return;
            }
        },
        Ok(Err(error)) => {
            tracing::debug!(%remote, %error, "peer connection ended during the handshake");
            return;
        }
        Err(_) => {
            tracing::debug!(%remote, "peer connection timed out during the handshake");
            return;
        }
    };
    if let Err(reason) = hello.verify(config.cluster_id, config.node_id) {
        if let Some(suppressed) = inbound.refusal_warnings.allow() {
            tracing::warn!(%remote, %reason, suppressed, "refused a peer connection");
        }
        stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
        let _ = write_frame(&mut stream, &encode_answer(Some(&reason))).await;
        return;
    }
    if write_frame(&mut stream, &encode_answer(None))
        .await
        .is_err()
    {
        return;
    }
    let from = hello.from;
    tracing::debug!(%remote, peer = %Hex(from), "accepted a peer connection");
    if let Some(redial) = inbound.redial_wakers().get(&from) {
        // At most one stored wake-up: a dialer that is connected now only
        // skips its first backoff after its next failure.
        redial.notify_one();
    }
    let limits = ReadLimits {
        frame_bytes_max: config.frame_bytes_max,
        budget: Some(&inbound.budget),
        read_timeout: config.read_timeout,
    };
    loop {
        let (payload, lease) = tokio::select! {
            _ = shutdown.changed() => return,
            read = reader.next(&mut stream, &limits) => match read {
                Ok(frame) => frame,
                Err(ConnectionError::Closed) => return,
                Err(error) => {
                    if matches!(
                        error,
                        ConnectionError::Silent(_)
                            | ConnectionError::Slow(_)
                            | ConnectionError::Starved(_)
                    ) {
                        stats.connections_timed_out.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(suppressed) = inbound.drop_warnings.allow() {
                        tracing::warn!(peer = %Hex(from), %remote, %error, suppressed, "dropping peer connection");
                    }
                    return;
                }
            },
        };
        let event = TransportEvent::Received {
            from,
            payload,
            lease,
        };
        // Waiting here (the runtime is behind) stops this connection's
        // reads, and TCP pushes back on the peer.
        if inbound.events.send(event).await.is_err() {
            return; // The runtime is gone.
        }
    }
}

/// What a [`FrameReader`] may read and hold.
struct ReadLimits<'a> {
    /// The largest frame payload accepted.
    frame_bytes_max: u32,
    /// Where every byte held is paid for, if anywhere.
    budget: Option<&'a Arc<Semaphore>>,
    /// The longest wait for the next byte.
    read_timeout: Duration,
}

/// Reads frames off one connection, allocating only for bytes that arrived
/// and paying for every byte held from the limits' budget. Where there is a
/// budget, a read takes up to [`READ_CHUNK_BYTES`] past a small frame in
/// progress, so that one system call brings in every small frame a peer
/// sent together (a leader's appends and a follower's answers come many at
/// once); without a budget (before the handshake) it never reads past the
/// frame in progress.
///
/// A frame larger than [`LARGE_FRAME_BYTES`] arrives in pieces, each
/// allocated at its final size, and is put together once when whole (and
/// each piece freed as it is copied). Growing one buffer by doubling would
/// copy the frame at every step and, with an allocator that does not remap
/// large blocks in place, hold the old and the new copy at once: peers
/// holding a budget's worth of half-sent frames then made the node hold
/// twice the budget.
struct FrameReader {
    /// The bytes read after the pieces: a frame's header and body, or the
    /// last piece of a large frame.
    buffer: BytesMut,
    /// The large frame in progress, if one is.
    large: Option<LargeFrame>,
    /// The budget's permits for the bytes in `buffer` and `large`.
    held: Option<OwnedSemaphorePermit>,
}

/// The first pieces of a frame larger than [`LARGE_FRAME_BYTES`].
struct LargeFrame {
    /// Filled pieces, in order; the first begins with the frame's header.
    pieces: Vec<Bytes>,
    /// The bytes in `pieces`.
    pieces_bytes: usize,
    /// The whole frame's bytes, header included.
    frame_bytes: usize,
}

/// Frames above this size are read in pieces of this size (see
/// [`FrameReader`]).
const LARGE_FRAME_BYTES: usize = 1 << 20;

impl FrameReader {
    fn new() -> FrameReader {
        FrameReader {
            buffer: BytesMut::new(),
            large: None,
            held: None,
        }
    }

    /// The bytes read and not yet returned as frames.
    fn held_bytes(&self) -> usize {
        let pieces_bytes = self.large.as_ref().map_or(0, |large| large.pieces_bytes);
        pieces_bytes + self.buffer.len()
    }

    /// The bytes still to read for the frame in progress (for the header
    /// first, while it is not whole), and the frame's size once known.
    fn frame_missing(&self) -> (usize, Option<usize>) {
        match &self.large {
            Some(large) => (
                large.frame_bytes.saturating_sub(self.held_bytes()),
                Some(large.frame_bytes),
            ),
            None => {
                let missing = frame_bytes_missing(&self.buffer);
                let known = (self.buffer.len() >= FRAME_HEADER_BYTES)
                    .then(|| missing.saturating_add(self.buffer.len()));
                (missing, known)
            }
        }
    }

    /// Makes room in `buffer` for a read of up to `wanted` bytes and returns
    /// how many the read may take: a large frame gets a new piece when the
    /// last is full, and a read never goes past its piece.
    fn make_room(&mut self, wanted: usize) -> usize {
        let (missing, frame_bytes) = self.frame_missing();
        let Some(frame_bytes) = frame_bytes.filter(|&bytes| bytes > LARGE_FRAME_BYTES) else {
            self.buffer.reserve(wanted);
            return wanted;
        };
        let spare = self.buffer.capacity() - self.buffer.len();
        if spare > 0 && (self.large.is_some() || spare >= missing) {
            return wanted.min(spare);
        }
        let large = self.large.get_or_insert(LargeFrame {
            pieces: Vec::new(),
            pieces_bytes: 0,
            frame_bytes,
        });
        if !self.buffer.is_empty() {
            let piece = std::mem::take(&mut self.buffer).freeze();
            large.pieces_bytes += piece.len();
            large.pieces.push(piece);
        }
        // The piece ends with the frame, or a read ahead past it may use
        // what a chunk has left.
        let piece_bytes = if missing < READ_CHUNK_BYTES {
            READ_CHUNK_BYTES
        } else {
            missing.min(LARGE_FRAME_BYTES)
        };
        self.buffer = BytesMut::with_capacity(piece_bytes);
        wanted.min(piece_bytes)
    }

    /// Puts a large frame together once all of it has arrived, so that
    /// [`decode_frame`] finds it whole at the front of `buffer`.
    fn join_pieces(&mut self) {
        let Some(large) = self
            .large
            .take_if(|large| self.buffer.len() + large.pieces_bytes >= large.frame_bytes)
        else {
            return;
        };
        let mut joined = BytesMut::with_capacity(large.pieces_bytes + self.buffer.len());
        for piece in large.pieces {
            // Each piece is freed once copied.
            joined.extend_from_slice(&piece);
        }
        joined.extend_from_slice(&self.buffer);
        self.buffer = joined;
    }

    /// The next frame and its share of the budget.
    async fn next<R: AsyncRead + Unpin>(
        &mut self,
        stream: &mut R,
        limits: &ReadLimits<'_>,
    ) -> Result<(Bytes, BufferLease), ConnectionError> {
        let mut frame_deadline: Option<Instant> = None;
        loop {
            // While a large frame is in pieces, `buffer` holds only its last.
            self.join_pieces();
            let whole = match self.large {
                Some(_) => None,
                None => decode_frame(&mut self.buffer, limits.frame_bytes_max)?,
            };
            if let Some(payload) = whole {
                let frame_bytes = FRAME_HEADER_BYTES.saturating_add(payload.len());
                // The frame takes its bytes' share of what is held; the
                // bytes read past it keep theirs.
                let lease = if self.buffer.is_empty() {
                    self.held.take()
                } else {
                    self.held.as_mut().and_then(|held| held.split(frame_bytes))
                };
                // A frame read together with others shares their
                // allocation: a copy holds only its own bytes, so that a
                // small entry kept by the log cache cannot pin a whole read.
                let payload = if payload.len() < READ_CHUNK_BYTES {
                    Bytes::copy_from_slice(&payload)
                } else {
                    payload
                };
                debug_assert!(
                    self.held.as_ref().map_or(0, |held| held.num_permits()) == self.held_bytes()
                        || limits.budget.is_none(),
                    "every byte held is paid for"
                );
                return Ok((payload, BufferLease(lease)));
            }
            let (missing, frame_bytes) = self.frame_missing();
            if let (None, Some(frame_bytes)) = (frame_deadline, frame_bytes) {
                let transfer = Duration::from_secs(frame_bytes as u64 / FRAME_BYTES_PER_SECOND_MIN);
                frame_deadline =
                    Instant::now().checked_add(limits.read_timeout.saturating_add(transfer));
            }
            // Never past the frame, nor past the largest frame allowed
            // (before the header is whole its length is not checked yet)...
            let frame_bytes_allowed =
                FRAME_HEADER_BYTES.saturating_add(limits.frame_bytes_max as usize);
            let missing = missing
                .min(frame_bytes_allowed.saturating_sub(self.held_bytes()))
                .clamp(1, READ_CHUNK_BYTES);
            let mut wanted = missing;
            if let Some(budget) = limits.budget {
                // ... unless the frame is small and the budget has room to
                // spare: then a whole chunk, paid now if it can be at once
                // (a read ahead never waits for the budget, so it never
                // keeps another connection's frame waiting for long).
                let ahead = (missing < READ_CHUNK_BYTES
                    && budget.available_permits() >= READ_AHEAD_ROOM_BYTES)
                    .then(|| {
                        budget
                            .clone()
                            .try_acquire_many_owned(READ_CHUNK_BYTES as u32)
                            .ok()
                    })
                    .flatten();
                let paid = match ahead {
                    Some(paid) => {
                        wanted = READ_CHUNK_BYTES;
                        paid
                    }
                    None => {
                        // `wanted` fits a u32: it is at most READ_CHUNK_BYTES.
                        // The budget is never closed; if it were, the
                        // transport is going away and so is this connection.
                        //
                        // The wait is bounded too: a connection waiting here
                        // holds what it paid for its frame so far, and if
                        // every byte of the budget is held by connections
                        // that wait (peers that sent parts of large frames
                        // and stopped, or went away unnoticed because nobody
                        // reads from them), nothing would ever be given
                        // back. Closing the connection breaks that; a live
                        // peer dials again.
                        let waiting_since = Instant::now();
                        let paid = match tokio::time::timeout(
                            limits.read_timeout,
                            budget.clone().acquire_many_owned(wanted as u32),
                        )
                        .await
                        {
                            Ok(Ok(paid)) => paid,
                            Ok(Err(_)) => return Err(ConnectionError::Closed),
                            Err(_) => return Err(ConnectionError::Starved(limits.read_timeout)),
                        };
                        // Time spent waiting for the budget is this node's,
                        // not the peer's: it does not count against the
                        // frame's deadline.
                        let waited = waiting_since.elapsed();
                        frame_deadline =
                            frame_deadline.map(|at| at.checked_add(waited).unwrap_or(at));
                        paid
                    }
                };
                match self.held.as_mut() {
                    Some(held) => held.merge(paid),
                    None => self.held = Some(paid),
                }
            }
            let room = self.make_room(wanted);
            if let Some(held) = self.held.as_mut() {
                // Give back what was paid for and has no room in this read.
                drop(held.split(wanted - room));
            }
            let wanted = room;
            let mut deadline = Instant::now()
                .checked_add(limits.read_timeout)
                .unwrap_or_else(far_future);
            if let Some(frame_deadline) = frame_deadline {
                deadline = deadline.min(frame_deadline);
            }
            let read = tokio::time::timeout_at(
                deadline,
                (&mut *stream)
                    .take(wanted as u64)
                    .read_buf(&mut self.buffer),
            )
            .await;
            let read_bytes = match read {
                Ok(Ok(n)) => n,
                Ok(Err(error)) => return Err(ConnectionError::Io(error)),
                Err(_) if frame_deadline.is_some_and(|at| Instant::now() >= at) => {
                    let (missing, _) = self.frame_missing();
                    return Err(ConnectionError::Slow(missing + self.held_bytes()));
                }
                Err(_) => return Err(ConnectionError::Silent(limits.read_timeout)),
            };
            if let Some(held) = self.held.as_mut() {
                // Give back what was paid for and did not arrive.
                drop(held.split(wanted.saturating_sub(read_bytes)));
            }
            if read_bytes == 0 {
                return Err(ConnectionError::Closed);
            }
        }
    }
}

/// An instant far enough ahead to stand for "no deadline".
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(30 * 365 * 24 * 3600)
}

#[allow(clippy::too_many_arguments)]
async fn outbound_loop(
    peer: NodeId,
    addr: String,
    config: TransportConfig,
    redial: Arc<Notify>,
    mut queue: mpsc::Receiver<Bytes>,
    events: mpsc::Sender<TransportEvent>,
    stats: Arc<TransportStats>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = config.reconnect_backoff_min;
    let mut jitter = Jitter::new(config.node_id ^ peer.rotate_left(32));
    let mut failures_logged = 0u32;
    loop {
        if *shutdown.borrow() {
            return;
        }
        match tokio::time::timeout(config.connect_timeout, connect(&addr, &config, peer)).await {
            Ok(Ok(stream)) => {
                backoff = config.reconnect_backoff_min;
                failures_logged = 0;
                tracing::info!(peer = %Hex(peer), %addr, "connected to peer");
                if events.send(TransportEvent::Connected(peer)).await.is_err() {
                    return;
                }
                let ended = write_loop(stream, &mut queue, &config, &stats, &mut shutdown).await;
                let _ = events.send(TransportEvent::Disconnected(peer)).await;
                match ended {
                    WriteLoopEnd::Shutdown => return,
                    WriteLoopEnd::Failed(error) => {
                        tracing::info!(peer = %Hex(peer), %addr, %error, "lost connection to peer");
                    }
                }
            }
            Ok(Err(error)) => {
                if let ConnectionError::Handshake(HandshakeError::Refused(_)) = &error {
                    stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(peer = %Hex(peer), %addr, %error, "peer refused us");
                } else if let ConnectionError::Tls(_) = &error {
                    stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
                    if failures_logged < 3 {
                        tracing::warn!(peer = %Hex(peer), %addr, %error, "TLS handshake with peer failed; retrying");
                    }
                } else if failures_logged < 3 {
                    // Say it a few times, then stay quiet until it works.
                    tracing::info!(peer, %addr, %error, "cannot reach peer; retrying");
                }
                failures_logged = failures_logged.saturating_add(1);
            }
            Err(_) => {
                if failures_logged < 3 {
                    tracing::info!(peer, %addr, "connecting to peer timed out; retrying");
                }
                failures_logged = failures_logged.saturating_add(1);
            }
        }
        // What was queued while the link was down is stale by now; the engine
        // re-sends what the peer needs when the link comes back up.
        while queue.try_recv().is_ok() {
            stats.frames_shed.fetch_add(1, Ordering::Relaxed);
        }
        let delay = jitter.spread(backoff);
        backoff = (backoff * 2).min(config.reconnect_backoff_max);
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep(delay) => {}
            // The peer connected to us: it is up, dial it now.
            () = redial.notified() => backoff = config.reconnect_backoff_min,
        }
        if queue.is_closed() {
            return; // The peer was removed.
        }
    }
}

/// An outbound peer connection.
enum PeerStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// A TLS failure hides in an I/O error (an alert the peer sent, such as
/// its refusal of our certificate, arrives on the first read): name it.
fn tls_cause(error: ConnectionError) -> ConnectionError {
    match error {
        ConnectionError::Io(io) => {
            match io.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
                Some(tls) => ConnectionError::Tls(tls.to_string()),
                None => ConnectionError::Io(io),
            }
        }
        other => other,
    }
}

async fn connect(
    addr: &str,
    config: &TransportConfig,
    peer: NodeId,
) -> Result<PeerStream, ConnectionError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let Some(tls) = &config.tls else {
        return Ok(PeerStream::Plain(say_hello(stream, config, peer).await?));
    };
    let client = tls.current().client().ok_or_else(|| {
        ConnectionError::Tls("no --peer-trusted-ca-file to verify peers by".to_string())
    })?;
    let name = crate::tls::server_name(addr)
        .ok_or_else(|| ConnectionError::Tls(format!("{addr:?} names no host to verify")))?;
    let stream = tokio_rustls::TlsConnector::from(client)
        .connect(name, stream)
        .await
        .map_err(|error| tls_cause(ConnectionError::Io(error)))?;
    let stream = say_hello(stream, config, peer).await.map_err(tls_cause)?;
    Ok(PeerStream::Tls(Box::new(stream)))
}

/// Sends our hello on a fresh connection and reads the peer's answer.
async fn say_hello<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    config: &TransportConfig,
    peer: NodeId,
) -> Result<S, ConnectionError> {
    let hello = Hello {
        cluster_id: config.cluster_id,
        from: config.node_id,
        to: peer,
    };
    write_frame(&mut stream, &hello.encode()).await?;
    // The answer is empty or a short reason: nothing longer is read.
    let limits = ReadLimits {
        frame_bytes_max: REASON_BYTES_MAX as u32,
        budget: None,
        read_timeout: config.connect_timeout,
    };
    let (answer, _) = FrameReader::new().next(&mut stream, &limits).await?;
    decode_answer(&answer)?;
    Ok(stream)
}

enum WriteLoopEnd {
    Shutdown,
    Failed(ConnectionError),
}

/// Writes queued frames in batches until the connection fails.
async fn write_loop(
    stream: PeerStream,
    queue: &mut mpsc::Receiver<Bytes>,
    config: &TransportConfig,
    stats: &TransportStats,
    shutdown: &mut watch::Receiver<bool>,
) -> WriteLoopEnd {
    match stream {
        // A TCP stream splits for free; a TLS one shares its session
        // between the halves behind a lock.
        PeerStream::Plain(stream) => {
            let (read_half, write_half) = stream.into_split();
            write_halves(read_half, write_half, queue, config, stats, shutdown).await
        }
        PeerStream::Tls(stream) => {
            let (read_half, write_half) = tokio::io::split(stream);
            write_halves(read_half, write_half, queue, config, stats, shutdown).await
        }
    }
}

/// Encodes the frames already queued into `batch` until it holds
/// `batch_bytes_max`; returns how many it took.
fn drain_queued(
    queue: &mut mpsc::Receiver<Bytes>,
    batch: &mut BytesMut,
    batch_bytes_max: usize,
) -> u64 {
    let mut frames = 0;
    while batch.len() < batch_bytes_max {
        match queue.try_recv() {
            Ok(frame) => {
                encode_frame(&frame, batch);
                frames += 1;
            }
            Err(_) => break,
        }
    }
    frames
}

async fn write_halves<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut read_half: R,
    mut write_half: W,
    queue: &mut mpsc::Receiver<Bytes>,
    config: &TransportConfig,
    stats: &TransportStats,
    shutdown: &mut watch::Receiver<bool>,
) -> WriteLoopEnd {
    let mut batch = BytesMut::with_capacity(config.batch_bytes_max.min(1 << 20));
    let mut probe = [0u8; 1];
    loop {
        let first = tokio::select! {
            _ = shutdown.changed() => return WriteLoopEnd::Shutdown,
            // The peer never writes on this connection: a read that returns
            // means it closed or broke, which we want to learn of even when
            // we have nothing to send.
            read = read_half.read(&mut probe) => {
                return WriteLoopEnd::Failed(match read {
                    Ok(_) => ConnectionError::Closed,
                    Err(error) => ConnectionError::Io(error),
                });
            }
            next = queue.recv() => match next {
                Some(frame) => frame,
                None => return WriteLoopEnd::Shutdown, // The peer was removed.
            },
        };
        batch.clear();
        encode_frame(&first, &mut batch);
        let mut frames = 1u64;
        // What is queued now goes in this write; then, once, the tasks
        // already waiting to run (a worker finishing its step, others
        // answering) run first, and what they queue joins it: one system
        // call for the frames of a moment instead of one for each.
        frames += drain_queued(queue, &mut batch, config.batch_bytes_max);
        if batch.len() < config.batch_bytes_max {
            tokio::task::yield_now().await;
            frames += drain_queued(queue, &mut batch, config.batch_bytes_max);
        }
        if let Err(error) = write_half.write_all(&batch).await {
            return WriteLoopEnd::Failed(ConnectionError::Io(error));
        }
        // TLS buffers what it encrypts: push it out now.
        if let Err(error) = write_half.flush().await {
            return WriteLoopEnd::Failed(ConnectionError::Io(error));
        }
        stats.frames_sent.fetch_add(frames, Ordering::Relaxed);
    }
}

async fn write_frame<W: AsyncWrite + Unpin>(
    stream: &mut W,
    payload: &[u8],
) -> Result<(), ConnectionError> {
    let mut out = BytesMut::with_capacity(payload.len() + 8);
    encode_frame(payload, &mut out);
    stream.write_all(&out).await?;
    stream.flush().await?;
    Ok(())
}

/// Spreads reconnect delays so that nodes restarted together do not dial in
/// lockstep. Not for anything that needs real randomness.
struct Jitter(u64);

impl Jitter {
    fn new(seed: u64) -> Self {
        Jitter(seed | 1)
    }

    /// A delay in [delay/2, delay].
    fn spread(&mut self, delay: Duration) -> Duration {
        // xorshift64
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let half = delay / 2;
        let extra_ms = half.as_millis() as u64;
        half + Duration::from_millis(if extra_ms == 0 {
            0
        } else {
            self.0 % (extra_ms + 1)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes handed out by a reader that counts how often it is read.
    struct CountingReader {
        bytes: Vec<u8>,
        reads: usize,
    }

    impl CountingReader {
        fn of(bytes: &[u8]) -> CountingReader {
            CountingReader {
                bytes: bytes.to_vec(),
                reads: 0,
            }
        }
    }

    /// The limits of a handshaken connection paying from `budget`.
    fn budgeted(budget: &Arc<Semaphore>, frame_bytes_max: u32) -> ReadLimits<'_> {
        ReadLimits {
            frame_bytes_max,
            budget: Some(budget),
            read_timeout: Duration::from_secs(5),
        }
    }

    impl AsyncRead for CountingReader {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            self.reads += 1;
            let n = buf.remaining().min(self.bytes.len());
            let rest = self.bytes.split_off(n);
            buf.put_slice(&self.bytes);
            self.bytes = rest;
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn small_frames_sent_together_are_read_in_one_go_and_each_pays_for_itself() {
        let mut wire = BytesMut::new();
        for n in 0..50u8 {
            encode_frame(&vec![n; 100 + n as usize], &mut wire);
        }
        let mut stream = CountingReader::of(&wire);
        let budget = Arc::new(Semaphore::new(16 << 20));
        let limits = budgeted(&budget, 1 << 20);
        let mut reader = FrameReader::new();
        let mut leases = Vec::new();
        for n in 0..50u8 {
            let (payload, lease) = reader.next(&mut stream, &limits).await.unwrap();
            assert_eq!(&payload[..], &vec![n; 100 + n as usize][..]);
            assert_eq!(lease.bytes(), FRAME_HEADER_BYTES + 100 + n as usize);
            leases.push(lease);
        }
        // 50 frames, 6,425 bytes: one read, not two per frame.
        assert_eq!(stream.reads, 1);
        // Every byte held is paid for, by the frame it belongs to.
        let held: usize = leases.iter().map(BufferLease::bytes).sum();
        assert_eq!(held, wire.len());
        assert_eq!(budget.available_permits(), (16 << 20) - wire.len());
        drop(leases);
        assert_eq!(budget.available_permits(), 16 << 20);
    }

    #[tokio::test]
    async fn large_frames_arrive_in_pieces_and_are_put_together_whole() {
        let large_a: Vec<u8> = (0..5 << 19).map(|i| (i % 251) as u8).collect();
        let large_b = vec![7u8; LARGE_FRAME_BYTES + 1];
        let mut wire = BytesMut::new();
        encode_frame(&large_a, &mut wire);
        encode_frame(b"small", &mut wire);
        encode_frame(&large_b, &mut wire);
        let mut stream = CountingReader::of(&wire);
        let budget = Arc::new(Semaphore::new(16 << 20));
        let limits = budgeted(&budget, 4 << 20);
        let mut reader = FrameReader::new();
        let mut leases = Vec::new();
        for expected in [&large_a[..], b"small", &large_b[..]] {
            let (payload, lease) = reader.next(&mut stream, &limits).await.unwrap();
            assert!(payload == expected, "a frame of {} bytes", expected.len());
            assert_eq!(lease.bytes(), FRAME_HEADER_BYTES + expected.len());
            leases.push(lease);
        }
        assert!(reader.large.is_none() && reader.buffer.is_empty());
        assert_eq!(budget.available_permits(), (16 << 20) - wire.len());
        drop(leases);
        assert_eq!(budget.available_permits(), 16 << 20);
    }

    #[tokio::test]
    async fn a_half_sent_large_frame_is_held_in_pieces_of_at_most_a_mebibyte() {
        // 3 MiB of an 8 MiB frame, then the peer goes away. Before, the
        // buffer doubled to 4 MiB, copying the frame at each step.
        let mut wire = BytesMut::new();
        encode_frame(&vec![1u8; 8 << 20], &mut wire);
        wire.truncate(3 << 20);
        let mut stream = CountingReader::of(&wire);
        let budget = Arc::new(Semaphore::new(16 << 20));
        let limits = budgeted(&budget, 8 << 20);
        let mut reader = FrameReader::new();
        let error = reader.next(&mut stream, &limits).await.unwrap_err();
        assert!(matches!(error, ConnectionError::Closed), "{error}");
        let large = reader.large.as_ref().expect("the frame is read in pieces");
        assert_eq!(large.frame_bytes, FRAME_HEADER_BYTES + (8 << 20));
        assert_eq!(reader.held_bytes(), 3 << 20);
        assert!(large.pieces.len() >= 2);
        assert!(reader.buffer.capacity() <= LARGE_FRAME_BYTES);
        for piece in &large.pieces {
            assert!(
                piece.len() <= LARGE_FRAME_BYTES,
                "a piece of {}",
                piece.len()
            );
        }
        // What is held is paid for, and given back with the reader.
        assert_eq!(budget.available_permits(), (16 << 20) - (3 << 20));
        drop(reader);
        assert_eq!(budget.available_permits(), 16 << 20);
    }

    #[tokio::test]
    async fn without_a_budget_nothing_past_the_frame_is_read() {
        // Before the handshake a connection has paid for nothing: the hello
        // is read exactly, and what follows it stays in the socket.
        let mut wire = BytesMut::new();
        encode_frame(b"hello", &mut wire);
        encode_frame(b"more", &mut wire);
        let mut stream = CountingReader::of(&wire);
        let limits = ReadLimits {
            frame_bytes_max: 64,
            budget: None,
            read_timeout: Duration::from_secs(5),
        };
        let (payload, _) = FrameReader::new().next(&mut stream, &limits).await.unwrap();
        assert_eq!(&payload[..], b"hello");
        assert_eq!(stream.bytes.len(), FRAME_HEADER_BYTES + 4);
    }

    fn loopback() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    async fn next_event(events: &mut mpsc::Receiver<TransportEvent>) -> TransportEvent {
        tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .unwrap()
            .unwrap()
    }

    #[tokio::test]
    async fn two_nodes_exchange_frames_and_report_connections() {
        let (events_a, mut rx_a) = mpsc::channel(64);
        let (events_b, mut rx_b) = mpsc::channel(64);
        let mut a = Transport::start(TransportConfig::new(1, 42, loopback()), events_a)
            .await
            .unwrap();
        let mut b = Transport::start(TransportConfig::new(2, 42, loopback()), events_b)
            .await
            .unwrap();
        a.add_peer(2, b.local_addr().to_string());
        b.add_peer(1, a.local_addr().to_string());
        assert_eq!(next_event(&mut rx_a).await, TransportEvent::Connected(2));
        assert_eq!(next_event(&mut rx_b).await, TransportEvent::Connected(1));
        for i in 0..100u8 {
            assert!(a.send(2, Bytes::from(vec![i; 10])));
        }
        for i in 0..100u8 {
            assert_eq!(
                next_event(&mut rx_b).await,
                TransportEvent::Received {
                    from: 1,
                    payload: Bytes::from(vec![i; 10]),
                    lease: BufferLease::default(),
                }
            );
        }
        // B goes away: A learns its link is down.
        b.shutdown();
        drop(b);
        loop {
            if next_event(&mut rx_a).await == TransportEvent::Disconnected(2) {
                break;
            }
        }
        a.shutdown();
    }

    /// A peer that comes back connects to us; we dial it at once instead of
    /// leaving it without our messages until our backoff ends.
    #[tokio::test]
    async fn a_peer_that_connects_to_us_is_dialed_at_once_not_after_the_backoff() {
        let (events_a, mut rx_a) = mpsc::channel(64);
        let (events_b, _rx_b) = mpsc::channel(64);
        // B's address, free until B starts.
        let addr_b = std::net::TcpListener::bind(loopback())
            .unwrap()
            .local_addr()
            .unwrap();
        let mut config_a = TransportConfig::new(1, 42, loopback());
        config_a.reconnect_backoff_min = Duration::from_secs(60);
        config_a.reconnect_backoff_max = Duration::from_secs(60);
        let mut a = Transport::start(config_a, events_a).await.unwrap();
        a.add_peer(2, addr_b.to_string());
        // A's first dial is refused; it now waits 30 to 60 s.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut b = Transport::start(TransportConfig::new(2, 42, addr_b), events_b)
            .await
            .unwrap();
        b.add_peer(1, a.local_addr().to_string());
        let connected = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if rx_a.recv().await == Some(TransportEvent::Connected(2)) {
                    break;
                }
            }
        })
        .await;
        assert!(connected.is_ok(), "A waited out its backoff to dial B");
        a.shutdown();
        b.shutdown();
    }

    #[tokio::test]
    async fn a_peer_of_another_cluster_is_refused() {
        let (events_a, mut rx_a) = mpsc::channel(64);
        let (events_b, _rx_b) = mpsc::channel(64);
        let a = Transport::start(TransportConfig::new(1, 42, loopback()), events_a)
            .await
            .unwrap();
        let mut b = Transport::start(TransportConfig::new(2, 99, loopback()), events_b)
            .await
            .unwrap();
        b.add_peer(1, a.local_addr().to_string());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while b.stats().handshakes_refused.load(Ordering::Relaxed) == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "refusal never happened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(a.stats().handshakes_refused.load(Ordering::Relaxed) >= 1);
        // Nothing from the foreign node reached A's runtime.
        assert!(rx_a.try_recv().is_err());
        a.shutdown();
        b.shutdown();
    }

    fn tls_node(
        dir: &std::path::Path,
        name: &str,
        issuer: &rcgen::Issuer<'static, rcgen::KeyPair>,
        trusted_ca_pem: &str,
    ) -> Arc<ReloadableTls> {
        use crate::tls::tests::{issue, write};
        let issued = issue(issuer, name);
        let files = crate::tls::TlsFiles {
            cert: write(dir, &format!("{name}.crt"), &issued.cert_pem),
            key: write(dir, &format!("{name}.key"), &issued.key_pem),
            trusted_ca: Some(write(dir, &format!("{name}-ca.crt"), trusted_ca_pem)),
            client_cert_auth: true,
        };
        ReloadableTls::load("peer", files, &[]).unwrap()
    }

    #[tokio::test]
    async fn over_tls_only_peers_with_the_clusters_ca_send_frames() {
        use crate::tls::tests::{ca, temp_dir};
        let dir = temp_dir("peers");
        let (cluster_ca, cluster_ca_pem) = ca();
        let (other_ca, _) = ca();
        let config = |id, tls| {
            let mut config = TransportConfig::new(id, 42, loopback());
            config.tls = Some(tls);
            config
        };
        let (events_a, mut rx_a) = mpsc::channel(64);
        let (events_b, mut rx_b) = mpsc::channel(64);
        let (events_c, _rx_c) = mpsc::channel(64);
        let mut a = Transport::start(
            config(1, tls_node(&dir, "a", &cluster_ca, &cluster_ca_pem)),
            events_a,
        )
        .await
        .unwrap();
        let mut b = Transport::start(
            config(2, tls_node(&dir, "b", &cluster_ca, &cluster_ca_pem)),
            events_b,
        )
        .await
        .unwrap();
        a.add_peer(2, b.local_addr().to_string());
        b.add_peer(1, a.local_addr().to_string());
        assert_eq!(next_event(&mut rx_a).await, TransportEvent::Connected(2));
        assert_eq!(next_event(&mut rx_b).await, TransportEvent::Connected(1));
        assert!(a.send(2, Bytes::from_static(b"over tls")));
        assert_eq!(
            next_event(&mut rx_b).await,
            TransportEvent::Received {
                from: 1,
                payload: Bytes::from_static(b"over tls"),
                lease: BufferLease::default(),
            }
        );
        // Node 3 trusts the cluster's CA, but its own certificate is
        // another CA's: A refuses it at the TLS handshake.
        let mut c = Transport::start(
            config(3, tls_node(&dir, "c", &other_ca, &cluster_ca_pem)),
            events_c,
        )
        .await
        .unwrap();
        c.add_peer(1, a.local_addr().to_string());
        for _ in 0..100 {
            c.send(1, Bytes::from_static(b"forged"));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while a.stats().handshakes_refused.load(Ordering::Relaxed) == 0
            || c.stats().handshakes_refused.load(Ordering::Relaxed) == 0
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "refusal never happened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        while let Ok(event) = rx_a.try_recv() {
            assert!(
                !matches!(event, TransportEvent::Received { from: 3, .. }),
                "a frame of node 3 arrived"
            );
        }
        assert_eq!(c.stats().frames_sent.load(Ordering::Relaxed), 0);
        a.shutdown();
        b.shutdown();
        c.shutdown();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Dials `addr` as node 9 of cluster 42 and completes the handshake.
    async fn handshaken(addr: SocketAddr) -> TcpStream {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let hello = Hello {
            cluster_id: 42,
            from: 9,
            to: 1,
        };
        write_frame(&mut stream, &hello.encode()).await.unwrap();
        let mut answer = [0u8; FRAME_HEADER_BYTES];
        stream.read_exact(&mut answer).await.unwrap();
        assert_eq!(answer[..4], [0, 0, 0, 0], "refused");
        stream
    }

    /// A frame header announcing `length_bytes`, with a checksum that will
    /// not match.
    fn bare_header(length_bytes: u32) -> [u8; FRAME_HEADER_BYTES] {
        let mut header = [0u8; FRAME_HEADER_BYTES];
        header[..4].copy_from_slice(&length_bytes.to_le_bytes());
        header
    }

    /// Whether the transport closed `stream` within `within`.
    async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
        let mut sink = [0u8; 1024];
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut sink)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
            }
        }
    }

    #[tokio::test]
    async fn a_connection_may_send_no_more_than_a_hello_before_its_hello() {
        let (events, _rx) = mpsc::channel(64);
        let mut config = TransportConfig::new(1, 42, loopback());
        config.connect_timeout = Duration::from_secs(30);
        let a = Transport::start(config, events).await.unwrap();
        // As reported: a 64 MiB frame header before any hello used to make
        // the node reserve 64 MiB and wait for it.
        let mut stream = TcpStream::connect(a.local_addr()).await.unwrap();
        stream.write_all(&bare_header(64 << 20)).await.unwrap();
        stream.write_all(&[7u8; 4096]).await.unwrap();
        assert!(
            closed_within(&mut stream, Duration::from_secs(5)).await,
            "an oversized hello was waited for"
        );
        assert_eq!(a.inbound_buffered_bytes(), 0);
        a.shutdown();
    }

    #[tokio::test]
    async fn what_peers_can_make_the_node_hold_is_bounded_in_total_and_in_time() {
        let (events, mut rx) = mpsc::channel(64);
        let mut config = TransportConfig::new(1, 42, loopback());
        config.frame_bytes_max = 1 << 20;
        config.inbound_buffered_bytes_max = 3 << 20;
        config.read_timeout = Duration::from_millis(500);
        let a = Transport::start(config, events).await.unwrap();
        let budget_bytes = 3 << 20;
        // Eight handshaken connections each send most of a 1 MiB frame and
        // stop: 7 MiB offered, and without bounds all of it held.
        let mut writers = Vec::new();
        for _ in 0..8 {
            let mut stream = handshaken(a.local_addr()).await;
            writers.push(tokio::spawn(async move {
                stream.write_all(&bare_header(1 << 20)).await?;
                stream.write_all(&vec![5u8; 900 << 10]).await?;
                // Hold the connection open, silent.
                let mut sink = [0u8; 16];
                let _ = stream.read(&mut sink).await;
                Ok::<_, std::io::Error>(())
            }));
        }
        let mut peak_bytes = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let held = a.inbound_buffered_bytes();
            peak_bytes = peak_bytes.max(held);
            assert!(held <= budget_bytes, "{held} bytes held");
            if a.stats().connections_timed_out.load(Ordering::Relaxed) == 8 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "silent connections were not closed ({} of 8)",
                a.stats().connections_timed_out.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(peak_bytes > 1 << 20, "the test did not fill the budget");
        // Every connection closed: nothing is held any more.
        assert_eq!(a.inbound_buffered_bytes(), 0);
        for writer in writers {
            let _ = writer.await;
        }
        // A frame that arrives whole is still delivered, and holds its
        // bytes of the budget until the runtime drops it.
        let mut stream = handshaken(a.local_addr()).await;
        let mut frame = BytesMut::new();
        encode_frame(&[3u8; 1000], &mut frame);
        stream.write_all(&frame).await.unwrap();
        let event = next_event(&mut rx).await;
        let TransportEvent::Received { payload, lease, .. } = event else {
            panic!("expected a frame, got {event:?}");
        };
        assert_eq!(payload.len(), 1000);
        assert_eq!(lease.bytes(), 1000 + FRAME_HEADER_BYTES);
        // The reader has paid for its next read already: a chunk, as the
        // budget has room.
        assert_eq!(
            a.inbound_buffered_bytes(),
            1000 + FRAME_HEADER_BYTES + READ_CHUNK_BYTES
        );
        drop(lease);
        assert_eq!(a.inbound_buffered_bytes(), READ_CHUNK_BYTES);
        a.shutdown();
    }

    #[tokio::test]
    async fn connections_each_holding_part_of_a_frame_cannot_deadlock_the_budget() {
        let (events, mut rx) = mpsc::channel(64);
        let mut config = TransportConfig::new(1, 42, loopback());
        config.frame_bytes_max = 1 << 20;
        // Raised to one largest frame: eight connections reading at once
        // share it, each holding a part of its frame and waiting for more.
        config.inbound_buffered_bytes_max = 0;
        config.read_timeout = Duration::from_millis(500);
        let a = Transport::start(config, events).await.unwrap();
        let mut writers = Vec::new();
        for _ in 0..8 {
            let mut stream = handshaken(a.local_addr()).await;
            writers.push(tokio::spawn(async move {
                stream.write_all(&bare_header(1 << 20)).await?;
                stream.write_all(&vec![5u8; (1 << 20) - 1]).await?;
                let mut sink = [0u8; 16];
                let _ = stream.read(&mut sink).await;
                Ok::<_, std::io::Error>(())
            }));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while a.stats().connections_timed_out.load(Ordering::Relaxed) < 8 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the budget stayed held: {} bytes, {} of 8 connections closed",
                a.inbound_buffered_bytes(),
                a.stats().connections_timed_out.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for writer in writers {
            let _ = writer.await;
        }
        assert_eq!(a.inbound_buffered_bytes(), 0);
        // And the budget serves the next peer.
        let mut stream = handshaken(a.local_addr()).await;
        let mut frame = BytesMut::new();
        encode_frame(b"after", &mut frame);
        stream.write_all(&frame).await.unwrap();
        assert!(matches!(
            next_event(&mut rx).await,
            TransportEvent::Received { payload, .. } if payload.as_ref() == b"after"
        ));
        a.shutdown();
    }

    #[tokio::test]
    async fn a_peer_trickling_a_frame_is_closed_as_too_slow() {
        let (events, _rx) = mpsc::channel(64);
        let mut config = TransportConfig::new(1, 42, loopback());
        config.read_timeout = Duration::from_millis(600);
        let a = Transport::start(config, events).await.unwrap();
        let mut stream = handshaken(a.local_addr()).await;
        stream.write_all(&bare_header(1000)).await.unwrap();
        // A byte every 200 ms never trips the read timeout, but the frame
        // is due within 600 ms.
        let started = tokio::time::Instant::now();
        loop {
            if stream.write_all(&[1u8]).await.is_err() {
                break;
            }
            if closed_within(&mut stream, Duration::from_millis(200)).await {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "never closed");
        }
        assert_eq!(a.stats().connections_timed_out.load(Ordering::Relaxed), 1);
        a.shutdown();
    }

    #[tokio::test]
    async fn frames_to_an_unknown_or_unreachable_peer_are_shed_not_blocking() {
        let (events, _rx) = mpsc::channel(64);
        let mut config = TransportConfig::new(1, 42, loopback());
        config.queue_frames_max = 4;
        let mut a = Transport::start(config, events).await.unwrap();
        assert!(!a.send(9, Bytes::from_static(b"x")));
        // Port 1 on loopback refuses connections: the queue fills and sheds.
        a.add_peer(2, "127.0.0.1:1".into());
        let sent = (0..100)
            .filter(|_| a.send(2, Bytes::from_static(b"x")))
            .count();
        assert!(sent <= 5, "queue bound not enforced: {sent} queued");
        a.shutdown();
    }
}
