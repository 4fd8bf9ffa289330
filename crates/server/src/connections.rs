//! Client connections that stay silent are closed: one that does not send
//! the HTTP/2 preface within its handshake timeout, or nothing at all for
//! its idle timeout ([`ClientConnection`]). The limits on how many
//! connections a listener holds are the runtime's
//! ([`ferry_runtime::connections`], re-exported here).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;

pub use ferry_runtime::connections::*;

/// The bytes of the HTTP/2 client connection preface (RFC 9113, 3.4).
const HTTP2_PREFACE_BYTES: usize = 24;
/// Far enough ahead to stand for "never" when a timeout is too long to add.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

/// How long a client connection may stay silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientTimeouts {
    /// From accept until the whole HTTP/2 preface has arrived.
    pub handshake: Duration,
    /// The longest time without a byte from the client after that. The
    /// server pings idle connections more often than this (HTTP/2 PING,
    /// see [`ClientTimeouts::keepalive_interval`]), and a live client
    /// answers every ping, so only a client that is gone or does not speak
    /// HTTP/2 reaches it.
    pub idle: Duration,
}

impl Default for ClientTimeouts {
    fn default() -> Self {
        ClientTimeouts {
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(60),
        }
    }
}

impl ClientTimeouts {
    /// How often the server pings a connection it heard nothing from, and
    /// how long it waits for the answer: a third of the idle timeout each,
    /// so that a live client has answered well before the idle timeout.
    pub fn keepalive_interval(&self) -> Duration {
        (self.idle / 3).max(Duration::from_millis(1))
    }
}

/// A client connection that is closed (its reads fail with `TimedOut`)
/// when the client stays silent past its [`ClientTimeouts`], and that holds
/// its listener's [`ConnectionTicket`] while it lives.
#[derive(Debug)]
pub struct ClientConnection<IO> {
    io: IO,
    timeouts: ClientTimeouts,
    accepted_at: Instant,
    last_read_at: Instant,
    /// Bytes read so far, counted up to the preface's length.
    preface_bytes_read: usize,
    timer: Pin<Box<Sleep>>,
    _ticket: Option<ConnectionTicket>,
    /// Bytes read ahead by [`ClientConnection::sniff`], given to the next
    /// reads before anything new.
    replay: bytes::BytesMut,
    /// Served as HTTP/1.1 (the JSON gateway): after its first bytes the
    /// connection's silences are bounded by the HTTP server's own header
    /// timeout, not the idle timeout (a watch answered over HTTP/1.1 has
    /// nothing to ping with; its client rightly says nothing for long).
    http1: bool,
}

/// What a client connection speaks, by its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientProtocol {
    /// The HTTP/2 preface: gRPC.
    Http2,
    /// Anything else: HTTP/1.1 for the JSON gateway (a request line).
    Http1,
}

/// The bytes that tell the protocols apart: the preface starts `PRI `,
/// which no HTTP/1.1 method does.
const SNIFF_BYTES: usize = 4;

/// `at + after`, or far in the future when that cannot be represented.
fn later(at: Instant, after: Duration) -> Instant {
    at.checked_add(after).unwrap_or_else(|| at + FAR_FUTURE)
}

impl<IO> ClientConnection<IO> {
    /// Wraps a connection accepted just now.
    pub fn new(
        io: IO,
        timeouts: ClientTimeouts,
        ticket: Option<ConnectionTicket>,
    ) -> ClientConnection<IO> {
        let now = Instant::now();
        ClientConnection {
            io,
            timeouts,
            accepted_at: now,
            last_read_at: now,
            preface_bytes_read: 0,
            timer: Box::pin(tokio::time::sleep_until(later(now, timeouts.handshake))),
            _ticket: ticket,
            replay: bytes::BytesMut::new(),
            http1: false,
        }
    }

    /// Reads the connection's first bytes (within the handshake timeout)
    /// and tells which protocol they start; the bytes are read again by
    /// whoever serves the connection. A connection that ends or times out
    /// first is an error.
    pub async fn sniff(&mut self) -> io::Result<ClientProtocol>
    where
        IO: AsyncRead + Unpin,
    {
        use tokio::io::AsyncReadExt;
        let mut first = [0u8; SNIFF_BYTES];
        let mut filled = 0;
        while filled < SNIFF_BYTES {
            let read = self.read(&mut first[filled..]).await?;
            if read == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the client closed the connection before its first request",
                ));
            }
            filled += read;
        }
        self.replay.extend_from_slice(&first);
        let protocol = if first == *b"PRI " {
            ClientProtocol::Http2
        } else {
            ClientProtocol::Http1
        };
        self.http1 = protocol == ClientProtocol::Http1;
        Ok(protocol)
    }

    fn in_handshake(&self) -> bool {
        self.preface_bytes_read < HTTP2_PREFACE_BYTES
    }

    fn deadline(&self) -> Instant {
        if self.http1 {
            // hyper's header timeout bounds it (see `http1`).
            later(self.last_read_at, FAR_FUTURE)
        } else if self.in_handshake() {
            later(self.accepted_at, self.timeouts.handshake)
        } else {
            later(self.last_read_at, self.timeouts.idle)
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for ClientConnection<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.replay.is_empty() {
            let n = this.replay.len().min(buf.remaining());
            buf.put_slice(&this.replay.split_to(n));
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = buf.filled().len().saturating_sub(before);
                if read > 0 {
                    this.last_read_at = Instant::now();
                    this.preface_bytes_read = this
                        .preface_bytes_read
                        .saturating_add(read)
                        .min(HTTP2_PREFACE_BYTES);
                }
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
            Poll::Pending => {}
        }
        // Nothing to read: wait for the deadline too. The timer is moved
        // only when the deadline moved, not on every read.
        loop {
            let deadline = this.deadline();
            if Instant::now() >= deadline {
                let why = if this.in_handshake() {
                    "the client sent no HTTP/2 preface in time"
                } else {
                    "the client sent nothing for too long"
                };
                tracing::debug!("closing a client connection: {why}");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)));
            }
            if this.timer.deadline() != deadline {
                this.timer.as_mut().reset(deadline);
            }
            match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => continue,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for ClientConnection<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for ClientConnection<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Whether `elapsed` is `expected`, give or take a loaded machine.
    fn about(elapsed: Duration, expected: Duration) -> bool {
        elapsed >= expected && elapsed < expected + Duration::from_millis(1500)
    }

    #[tokio::test]
    async fn a_client_that_sends_no_preface_or_goes_silent_is_timed_out() {
        let timeouts = ClientTimeouts {
            handshake: Duration::from_millis(300),
            idle: Duration::from_millis(800),
        };
        // Nothing at all: closed at the handshake deadline.
        let (_client, server) = tokio::io::duplex(1024);
        let mut conn = ClientConnection::new(server, timeouts, None);
        let started = Instant::now();
        let mut buf = [0u8; 64];
        let error = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(about(started.elapsed(), timeouts.handshake));

        // A preface cut short does not extend the handshake deadline.
        let (mut client, server) = tokio::io::duplex(1024);
        let mut conn = ClientConnection::new(server, timeouts, None);
        let started = Instant::now();
        client.write_all(b"PRI * HTTP/2.0").await.unwrap();
        assert_eq!(conn.read(&mut buf).await.unwrap(), 14);
        let error = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(about(started.elapsed(), timeouts.handshake));

        // After the preface, each byte restarts the idle timeout.
        let (mut client, server) = tokio::io::duplex(1024);
        let mut conn = ClientConnection::new(server, timeouts, None);
        let started = Instant::now();
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(conn.read(&mut buf).await.unwrap(), 24);
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(400)).await;
            client.write_all(b"x").await.unwrap();
            assert_eq!(conn.read(&mut buf).await.unwrap(), 1);
        }
        // Well past both timeouts from the start, and still open.
        assert!(started.elapsed() > timeouts.idle + timeouts.handshake);
        let silent_from = Instant::now();
        let error = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(about(silent_from.elapsed(), timeouts.idle));
    }
}
