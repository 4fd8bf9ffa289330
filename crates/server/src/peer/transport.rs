//! The TCP peer transport: one outbound connection per peer with a bounded
//! queue and batched writes, an accept loop for inbound connections, and
//! reconnection with capped exponential backoff.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use ferry_raft::NodeId;

use crate::member_id::Hex;

use super::frame::{decode_frame, encode_frame, FrameError, FRAME_BYTES_MAX_DEFAULT};
use super::handshake::{decode_answer, encode_answer, HandshakeError, Hello};

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
    /// How long connecting and the handshake may take.
    pub connect_timeout: Duration,
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
        }
    }
}

/// What the transport tells the runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    #[error("connection closed by the peer")]
    Closed,
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
}

/// A running transport. Dropping it does not stop the tasks; call
/// [`Transport::shutdown`].
pub struct Transport {
    config: TransportConfig,
    local_addr: SocketAddr,
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
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| TransportError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| TransportError::Bind {
                addr: config.listen,
                source,
            })?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        let stats = Arc::new(TransportStats::default());
        tokio::spawn(accept_loop(
            listener,
            config.clone(),
            events.clone(),
            stats.clone(),
            shutdown_rx,
        ));
        let mut transport = Transport {
            config: config.clone(),
            local_addr,
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
        tokio::spawn(outbound_loop(
            id,
            addr,
            self.config.clone(),
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

    /// Stops every task of the transport.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
    }
}

async fn accept_loop(
    listener: TcpListener,
    config: TransportConfig,
    events: mpsc::Sender<TransportEvent>,
    stats: Arc<TransportStats>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, remote)) => {
                    tokio::spawn(inbound_connection(
                        stream,
                        remote,
                        config.clone(),
                        events.clone(),
                        stats.clone(),
                        shutdown.clone(),
                    ));
                }
                Err(error) => {
                    tracing::warn!(%error, "accepting a peer connection failed");
                    // Out of file descriptors and similar: don't spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

async fn inbound_connection(
    mut stream: TcpStream,
    remote: SocketAddr,
    config: TransportConfig,
    events: mpsc::Sender<TransportEvent>,
    stats: Arc<TransportStats>,
    mut shutdown: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let mut buffer = BytesMut::with_capacity(64 << 10);
    let hello = match tokio::time::timeout(
        config.connect_timeout,
        read_frame(&mut stream, &mut buffer, config.frame_bytes_max),
    )
    .await
    {
        Ok(Ok(payload)) => match Hello::decode(&payload) {
            Ok(hello) => hello,
            Err(error) => {
                tracing::warn!(%remote, %error, "refused a peer connection");
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
        tracing::warn!(%remote, %reason, "refused a peer connection");
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
    loop {
        let payload = tokio::select! {
            _ = shutdown.changed() => return,
            read = read_frame(&mut stream, &mut buffer, config.frame_bytes_max) => match read {
                Ok(payload) => payload,
                Err(ConnectionError::Closed) => return,
                Err(error) => {
                    tracing::warn!(peer = %Hex(from), %error, "dropping peer connection");
                    return;
                }
            },
        };
        if events
            .send(TransportEvent::Received { from, payload })
            .await
            .is_err()
        {
            return; // The runtime is gone.
        }
    }
}

async fn outbound_loop(
    peer: NodeId,
    addr: String,
    config: TransportConfig,
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
        }
        if queue.is_closed() {
            return; // The peer was removed.
        }
    }
}

async fn connect(
    addr: &str,
    config: &TransportConfig,
    peer: NodeId,
) -> Result<TcpStream, ConnectionError> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let hello = Hello {
        cluster_id: config.cluster_id,
        from: config.node_id,
        to: peer,
    };
    write_frame(&mut stream, &hello.encode()).await?;
    let mut buffer = BytesMut::new();
    let answer = read_frame(&mut stream, &mut buffer, config.frame_bytes_max).await?;
    decode_answer(&answer)?;
    Ok(stream)
}

enum WriteLoopEnd {
    Shutdown,
    Failed(ConnectionError),
}

/// Writes queued frames in batches until the connection fails.
async fn write_loop(
    stream: TcpStream,
    queue: &mut mpsc::Receiver<Bytes>,
    config: &TransportConfig,
    stats: &TransportStats,
    shutdown: &mut watch::Receiver<bool>,
) -> WriteLoopEnd {
    let (mut read_half, mut write_half) = stream.into_split();
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
        while batch.len() < config.batch_bytes_max {
            match queue.try_recv() {
                Ok(frame) => {
                    encode_frame(&frame, &mut batch);
                    frames += 1;
                }
                Err(_) => break,
            }
        }
        if let Err(error) = write_half.write_all(&batch).await {
            return WriteLoopEnd::Failed(ConnectionError::Io(error));
        }
        stats.frames_sent.fetch_add(frames, Ordering::Relaxed);
    }
}

async fn read_frame(
    stream: &mut TcpStream,
    buffer: &mut BytesMut,
    limit_bytes: u32,
) -> Result<Bytes, ConnectionError> {
    loop {
        if let Some(frame) = decode_frame(buffer, limit_bytes)? {
            return Ok(frame);
        }
        if stream.read_buf(buffer).await? == 0 {
            return Err(ConnectionError::Closed);
        }
    }
}

async fn write_frame(stream: &mut TcpStream, payload: &[u8]) -> Result<(), ConnectionError> {
    let mut out = BytesMut::with_capacity(payload.len() + 8);
    encode_frame(payload, &mut out);
    stream.write_all(&out).await?;
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
                    payload: Bytes::from(vec![i; 10])
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
