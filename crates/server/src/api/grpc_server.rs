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

/// The service name of a path naming a method of the API
/// (`/etcdserverpb.KV/Range` → `etcdserverpb.KV`); the metrics' table of
/// methods is the one list of them.
fn service_of(path: &str) -> Option<&'static str> {
    crate::metrics::grpc::method(path).map(|method| method.service)
}

impl<B, RequestBody> Service<http::Request<RequestBody>> for GrpcRouter<B>
where
    B: Backend,
    RequestBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
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
        let services = &self.services;
        match service_of(request.uri().path()) {
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
    use super::service_of;

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
}
