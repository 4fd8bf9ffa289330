//! TLS on the client port: the stream a client connection is read through
//! (plain TCP or TLS on it), and what the connection tells requests about
//! its client ([`ClientConnectInfo`]: the common name of a verified client
//! certificate, for `--client-cert-auth`).
//!
//! The TLS handshake runs after the connection gate has admitted the
//! connection and is bounded by the client handshake timeout, so a client
//! that opens a TLS port and stalls, or speaks plaintext to it, holds its
//! place no longer than one that sends no HTTP/2 preface. Loading the
//! certificates and reloading them is [`ferry_runtime::tls`]'s, shared with
//! the peer transport.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::Connected;

pub use ferry_runtime::tls::*;

/// The protocol gRPC speaks, offered by ALPN (newer gRPC clients insist).
pub const ALPN_H2: &[u8] = b"h2";

/// HTTP/1.1, offered by ALPN on the client ports after h2: the JSON
/// gateway's (a client that offers both gets h2, so over TLS a gateway
/// client asks for HTTP/1.1 alone, as `curl --http1.1` does).
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

/// What a request learns about the connection it came on.
#[derive(Clone, Debug, Default)]
pub struct ClientConnectInfo {
    /// The client's address.
    pub remote: Option<SocketAddr>,
    /// Whether the connection is TLS.
    pub tls: bool,
    /// The common name of the client's certificate, which the handshake
    /// verified against the trusted CA (only asked for with
    /// `--client-cert-auth`).
    pub common_name: Option<Arc<str>>,
}

/// A client connection: plain TCP, or TLS over TCP.
#[derive(Debug)]
pub enum ClientIo {
    /// Plaintext.
    Plain(TcpStream),
    /// TLS, past its handshake.
    Tls(
        Box<tokio_rustls::server::TlsStream<TcpStream>>,
        Option<Arc<str>>,
    ),
}

impl ClientIo {
    /// Completes the TLS handshake of a connection accepted on a TLS port
    /// within `timeout`, with the certificates in force now.
    pub async fn accept_tls(
        stream: TcpStream,
        tls: &ReloadableTls,
        timeout: Duration,
    ) -> io::Result<ClientIo> {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.current().server());
        let stream = tokio::time::timeout(timeout, acceptor.accept(stream))
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not complete the TLS handshake in time",
                )
            })??;
        let common_name = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|certs| certs.first())
            .and_then(common_name)
            .map(Arc::from);
        Ok(ClientIo::Tls(Box::new(stream), common_name))
    }
}

impl AsyncRead for ClientIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            ClientIo::Tls(stream, _) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientIo::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            ClientIo::Tls(stream, _) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientIo::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            ClientIo::Tls(stream, _) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ClientIo::Plain(stream) => stream.is_write_vectored(),
            ClientIo::Tls(stream, _) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(stream) => Pin::new(stream).poll_flush(cx),
            ClientIo::Tls(stream, _) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            ClientIo::Tls(stream, _) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

impl Connected for ClientIo {
    type ConnectInfo = ClientConnectInfo;

    fn connect_info(&self) -> ClientConnectInfo {
        match self {
            ClientIo::Plain(stream) => ClientConnectInfo {
                remote: stream.peer_addr().ok(),
                tls: false,
                common_name: None,
            },
            ClientIo::Tls(stream, common_name) => ClientConnectInfo {
                remote: stream.get_ref().0.peer_addr().ok(),
                tls: true,
                common_name: common_name.clone(),
            },
        }
    }
}

/// A gRPC channel to the TLS port at `addr` ("host:port"), verifying the
/// server's certificate with `client` (see [`client_config`]); for ferry's
/// own tools and tests.
pub async fn channel(
    addr: &str,
    client: Arc<rustls::ClientConfig>,
    timeout: Duration,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let name = server_name(addr);
    let target = addr.to_string();
    let connector = tower::service_fn(move |_uri: tonic::codegen::http::Uri| {
        let client = client.clone();
        let target = target.clone();
        let name = name.clone();
        async move {
            let name = name.ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "the address names no host")
            })?;
            let stream = TcpStream::connect(&target).await?;
            let _ = stream.set_nodelay(true);
            let stream = tokio_rustls::TlsConnector::from(client)
                .connect(name, stream)
                .await?;
            Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_with_connector(connector)
        .await
}
