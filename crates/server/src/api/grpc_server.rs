//! The gRPC side of the client port: hyper's HTTP/2 server on each
//! connection, with the API's six services behind a router on the service
//! name in the request path.
//!
//! This is what tonic's own server does, less what the API does not use:
//! tonic's server also peeks at every connection for HTTP/1.1 (ours were
//! sniffed already), routes through a general path router, boxes each
//! request body and wraps each call in layers for timeouts, concurrency
//! limits and tracing. Measured on a 2-vCPU VM with 256 clients on 16
//! connections (medians of alternating rounds):
//!
//! - the gRPC stack alone (`examples/grpc_floor.rs`, serializable reads,
//!   8 rounds each): 19 µs of CPU per call through tonic's server, 17 µs
//!   through hyper's;
//! - ferry (`scripts/bench-ab.sh`, 4 rounds each): 19 → 16.5 µs of server
//!   CPU per serializable read, 46 → 42 µs per put.
//!
//! Each connection gets the client's [`ClientConnectInfo`] in every
//! request's extensions (where the services look for a client
//! certificate's common name), the server's keep-alive pings, at most
//! [`STREAMS_PER_CONNECTION_MAX`] calls at once, and a graceful shutdown
//! (GOAWAY, then the calls in flight finish) when the API stops. A
//! client's `grpc-timeout` is left to the client, which ends the call at
//! its deadline (the stream is reset and the call's future dropped); the
//! server bounds every call on the Raft group (writes, linearizable
//! reads) by its own request timeout.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::body::Body;
use tonic::codegen::BoxFuture;
use tonic::server::NamedService;
use tonic::Status;
use tower::{Layer, Service};

use super::EtcdApi;
use crate::backend::Backend;
use crate::metrics::grpc::{GrpcMetrics, GrpcMetricsLayer};
use crate::pb::etcdserverpb::auth_server::AuthServer;
use crate::pb::etcdserverpb::cluster_server::ClusterServer;
use crate::pb::etcdserverpb::kv_server::KvServer;
use crate::pb::etcdserverpb::lease_server::LeaseServer;
use crate::pb::etcdserverpb::maintenance_server::MaintenanceServer;
use crate::pb::etcdserverpb::watch_wire::watch_server::WatchServer;
use crate::tls::ClientConnectInfo;

/// The most calls (HTTP/2 streams) one client connection may have open at
/// once; a client past it waits for one to end (gRPC clients queue their
/// calls). Watches and lease keep-alives multiplex many watchers and
/// leases over one stream each, so this bounds what one connection may
/// hold without limiting them.
pub const STREAMS_PER_CONNECTION_MAX: u32 = 1024;

/// The API's six services, each accepting messages up to the same size:
/// built once by the API and shared by every connection.
pub(super) struct GrpcServices<B: Backend> {
    kv: KvServer<EtcdApi<B>>,
    watch: WatchServer<EtcdApi<B>>,
    lease: LeaseServer<EtcdApi<B>>,
    cluster: ClusterServer<EtcdApi<B>>,
    maintenance: MaintenanceServer<EtcdApi<B>>,
    auth: AuthServer<EtcdApi<B>>,
}

impl<B: Backend> GrpcServices<B> {
    /// `api`'s services, which decode messages of at most
    /// `message_bytes_max`.
    pub(super) fn new(api: &EtcdApi<B>, message_bytes_max: usize) -> Arc<GrpcServices<B>> {
        Arc::new(GrpcServices {
            kv: KvServer::new(api.clone()).max_decoding_message_size(message_bytes_max),
            watch: WatchServer::new(api.clone()).max_decoding_message_size(message_bytes_max),
            lease: LeaseServer::new(api.clone()).max_decoding_message_size(message_bytes_max),
            cluster: ClusterServer::new(api.clone()).max_decoding_message_size(message_bytes_max),
            maintenance: MaintenanceServer::new(api.clone())
                .max_decoding_message_size(message_bytes_max),
            auth: AuthServer::new(api.clone()).max_decoding_message_size(message_bytes_max),
        })
    }
}

/// Routes a call of one connection to the service its path names
/// (`/etcdserverpb.KV/Range` goes to KV), with the connection's
/// [`ClientConnectInfo`]; a path naming no method of the API is answered
/// `Unimplemented`. Cheap to clone (hyper takes a clone per call).
struct GrpcRouter<B: Backend> {
    services: Arc<GrpcServices<B>>,
    info: ClientConnectInfo,
}

impl<B: Backend> Clone for GrpcRouter<B> {
    fn clone(&self) -> Self {
        GrpcRouter {
            services: self.services.clone(),
            info: self.info.clone(),
        }
    }
}

/// A request body that ends as soon as the one message of a unary (or
/// server-streaming) call is in.
///
/// tonic's server reads a unary call's request to its end before it calls
/// the service (to merge trailers no gRPC client sends), and Rust clients
/// built on tonic send the end of a request in an empty DATA frame after
/// the message's: the call waits for that frame and its task is polled
/// once more for it; when the frame comes in a packet of its own, the
/// call waits for another read of the connection (39 µs after the
/// message, once, in a trace of a one-client put). With tonic's client
/// at 256 clients on 16 connections, answering at the message cut the
/// server's CPU per put from 51.2 to 47.7 µs (`scripts/bench-ab.sh`).
/// Go's clients (etcdctl) end the stream on the message's frame, and so
/// does `ferry bench`.
///
/// The body follows gRPC's framing (a flag byte, a 4-byte big-endian
/// length, the message): when a DATA frame ends exactly where the first
/// message does, the body ends there. Anything else (a frame reaching past
/// it, a second message, a streaming method) passes through as it came, and
/// tonic reads it as before. Once the call is answered, HTTP/2 resets
/// what is left of the client's side of the stream with `NO_ERROR`, as
/// RFC 9113 §8.1 has a server that answers before a request ends do.
pub(super) struct OneMessageBody<B> {
    inner: B,
    framing: Framing,
}

/// Where a [`OneMessageBody`] is in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Reading the 5-byte prefix; `seen` bytes of it so far (in `prefix`).
    Prefix {
        prefix: [u8; MESSAGE_PREFIX_BYTES],
        seen: usize,
    },
    /// Reading the message: `left` bytes to go.
    Message { left: u64 },
    /// The message ended with a frame: the body ends.
    Complete,
    /// Not followed (a streaming method, or a frame past the message).
    PassThrough,
}

/// The bytes of a gRPC message's prefix: the compressed flag and the length.
const MESSAGE_PREFIX_BYTES: usize = 5;

impl<B> OneMessageBody<B> {
    fn new(inner: B, one_message: bool) -> OneMessageBody<B> {
        let framing = if one_message {
            Framing::START
        } else {
            Framing::PassThrough
        };
        OneMessageBody { inner, framing }
    }
}

impl Framing {
    /// Before the first byte of a message.
    const START: Framing = Framing::Prefix {
        prefix: [0; MESSAGE_PREFIX_BYTES],
        seen: 0,
    };

    /// Follows the framing through one DATA frame.
    fn observe(&mut self, mut data: &[u8]) {
        loop {
            match self {
                Framing::Prefix { prefix, seen } => {
                    let take = (MESSAGE_PREFIX_BYTES - *seen).min(data.len());
                    prefix[*seen..*seen + take].copy_from_slice(&data[..take]);
                    *seen += take;
                    data = &data[take..];
                    if *seen < MESSAGE_PREFIX_BYTES {
                        return;
                    }
                    let [_, length @ ..] = *prefix;
                    *self = Framing::Message {
                        left: u64::from(u32::from_be_bytes(length)),
                    };
                }
                Framing::Message { left } => {
                    // `take` is at most `data.len()`, so it fits a usize.
                    let take = (*left).min(data.len() as u64);
                    *left -= take;
                    data = &data[take as usize..];
                    if *left > 0 {
                        return;
                    }
                    *self = if data.is_empty() {
                        Framing::Complete
                    } else {
                        Framing::PassThrough
                    };
                    return;
                }
                Framing::Complete | Framing::PassThrough => return,
            }
        }
    }
}

impl<B> http_body::Body for OneMessageBody<B>
where
    B: http_body::Body<Data = bytes::Bytes> + Unpin,
{
    type Data = bytes::Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, B::Error>>> {
        if self.framing == Framing::Complete {
            return Poll::Ready(None);
        }
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.framing.observe(data);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Complete || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.framing == Framing::Complete {
            http_body::SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

impl<B, RequestBody> Service<http::Request<RequestBody>> for GrpcRouter<B>
where
    B: Backend,
    RequestBody: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    RequestBody::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Every service is always ready (they hold no per-call capacity).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<RequestBody>) -> Self::Future {
        request.extensions_mut().insert(self.info.clone());
        // The metrics' table of methods is the one list of them.
        let method = crate::metrics::grpc::method(request.uri().path());
        let one_message = method.is_some_and(|method| method.takes_one_message());
        let request = request.map(|body| OneMessageBody::new(body, one_message));
        let services = &self.services;
        match method.map(|method| method.service) {
            Some(KvServer::<EtcdApi<B>>::NAME) => services.kv.clone().call(request),
            Some(WatchServer::<EtcdApi<B>>::NAME) => services.watch.clone().call(request),
            Some(LeaseServer::<EtcdApi<B>>::NAME) => services.lease.clone().call(request),
            Some(ClusterServer::<EtcdApi<B>>::NAME) => services.cluster.clone().call(request),
            Some(MaintenanceServer::<EtcdApi<B>>::NAME) => {
                services.maintenance.clone().call(request)
            }
            Some(AuthServer::<EtcdApi<B>>::NAME) => services.auth.clone().call(request),
            _ => {
                let status =
                    Status::unimplemented(format!("no such gRPC method: {}", request.uri().path()));
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

/// Serves one client connection that speaks HTTP/2 until the client
/// closes it, it fails, or `stopped` resolves (then gracefully: the calls
/// in flight finish first). Calls are counted in `metrics`.
pub(super) async fn serve_connection<B, IO>(
    services: &Arc<GrpcServices<B>>,
    metrics: Arc<GrpcMetrics>,
    io: IO,
    info: ClientConnectInfo,
    keepalive: Duration,
    stopped: impl std::future::Future<Output = ()>,
) where
    B: Backend,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let router = GrpcRouter {
        services: services.clone(),
        info,
    };
    let service = GrpcMetricsLayer::new(metrics).layer(router);
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(keepalive))
        .keep_alive_timeout(keepalive)
        .max_concurrent_streams(STREAMS_PER_CONNECTION_MAX);
    let connection = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    let mut connection = std::pin::pin!(connection);
    let mut stopped = std::pin::pin!(stopped);
    tokio::select! {
        outcome = connection.as_mut() => {
            if let Err(error) = outcome {
                tracing::debug!(%error, "a client connection ended with an error");
            }
            return;
        }
        () = &mut stopped => {}
    }
    connection.as_mut().graceful_shutdown();
    if let Err(error) = connection.await {
        tracing::debug!(%error, "a client connection ended with an error while the API stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::{Framing, MESSAGE_PREFIX_BYTES};

    /// The service of the method a path names, as the router sees it.
    fn service_of(path: &str) -> Option<&'static str> {
        crate::metrics::grpc::method(path).map(|method| method.service)
    }

    #[test]
    fn a_call_is_routed_by_the_service_in_its_path() {
        assert_eq!(
            service_of("/etcdserverpb.KV/Range"),
            Some("etcdserverpb.KV")
        );
        assert_eq!(
            service_of("/etcdserverpb.Watch/Watch"),
            Some("etcdserverpb.Watch")
        );
        for path in [
            "",
            "/",
            "etcdserverpb.KV/Range",
            "/etcdserverpb.KV",
            "/etcdserverpb.KV/",
            "/a/b/c",
        ] {
            assert_eq!(service_of(path), None, "{path:?}");
        }
    }

    /// A gRPC message of `length` bytes with its prefix.
    fn message(length: u32) -> Vec<u8> {
        let mut bytes = vec![0];
        bytes.extend_from_slice(&length.to_be_bytes());
        bytes.extend(std::iter::repeat_n(7u8, length as usize));
        bytes
    }

    /// Where the framing is after the message's bytes arrive in frames of
    /// the given sizes.
    fn after_frames(bytes: &[u8], sizes: &[usize]) -> Framing {
        let mut framing = Framing::START;
        let mut at = 0;
        for &size in sizes {
            framing.observe(&bytes[at..at + size]);
            at += size;
        }
        assert_eq!(at, bytes.len(), "the sizes cover the bytes");
        framing
    }

    #[test]
    fn a_message_in_one_frame_completes_the_body() {
        let bytes = message(300);
        assert_eq!(after_frames(&bytes, &[bytes.len()]), Framing::Complete);
        let empty = message(0);
        assert_eq!(after_frames(&empty, &[5]), Framing::Complete);
    }

    #[test]
    fn a_message_split_anywhere_completes_with_its_last_byte() {
        let bytes = message(20);
        for split in 1..bytes.len() {
            assert_eq!(
                after_frames(&bytes, &[split, bytes.len() - split]),
                Framing::Complete,
                "split at {split}"
            );
            assert_eq!(
                after_frames(&bytes[..split], &[split]),
                if split < MESSAGE_PREFIX_BYTES {
                    Framing::Prefix {
                        prefix: {
                            let mut prefix = [0; MESSAGE_PREFIX_BYTES];
                            prefix[..split].copy_from_slice(&bytes[..split]);
                            prefix
                        },
                        seen: split,
                    }
                } else {
                    Framing::Message {
                        left: (bytes.len() - split) as u64,
                    }
                },
                "only the first {split} bytes"
            );
        }
        // One byte per frame.
        assert_eq!(
            after_frames(&bytes, &vec![1; bytes.len()]),
            Framing::Complete
        );
    }

    #[test]
    fn a_frame_past_the_first_message_is_passed_through() {
        // Two messages in one frame, or the second in a frame of its own
        // after the first ended mid-frame: tonic reads them as it always
        // did.
        let mut two = message(3);
        two.extend(message(4));
        assert_eq!(after_frames(&two, &[two.len()]), Framing::PassThrough);
        assert_eq!(
            after_frames(&two, &[9, two.len() - 9]),
            Framing::PassThrough
        );
    }

    #[test]
    fn the_largest_length_a_prefix_can_state_is_followed_without_overflow() {
        let mut bytes = vec![1];
        bytes.extend_from_slice(&u32::MAX.to_be_bytes());
        bytes.extend_from_slice(&[0; 10]);
        assert_eq!(
            after_frames(&bytes, &[bytes.len()]),
            Framing::Message {
                left: u64::from(u32::MAX) - 10
            }
        );
    }
}
