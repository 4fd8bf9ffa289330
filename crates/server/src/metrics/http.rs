//! The metrics port's HTTP/1.1 server (hyper), bounded from outside as the
//! client and peer ports are:
//!
//! - connections are admitted by the runtime's [`ConnectionGate`] (in all
//!   and per address; past them new ones wait in the kernel's backlog);
//! - a request's head (request line and headers) may hold at most
//!   [`MetricsOptions::head_bytes_max`] bytes (past it: 431) and must
//!   arrive within [`MetricsOptions::header_timeout`], which also closes a
//!   kept-alive connection that sends no next request;
//! - request bodies are never read (every endpoint is a GET);
//! - a connection on which nothing moves either way for
//!   [`MetricsOptions::stall_timeout`] (a client that does not read its
//!   answer) is closed.
//!
//! Paths: `/metrics`, `/health`, `/livez[/CHECK]`, `/readyz[/CHECK]`;
//! anything else is 404.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use super::health::{self, CheckKind, HealthQuery};
use super::NodeMetrics;
use crate::connections::{ConnectionGate, ConnectionLimits};
use crate::log_limit::SharedLogLimiter;

/// The smallest head limit hyper takes (its read buffer's minimum).
const HEAD_BYTES_MIN: usize = 8192;

/// How the metrics port bounds its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsOptions {
    /// Connections at once, in all and per address.
    pub connection_limits: ConnectionLimits,
    /// The longest a request's head may take to arrive, counted from when
    /// the server waits for it (so also an idle kept-alive connection's).
    pub header_timeout: Duration,
    /// The most bytes of a request's head (at least 8 KiB).
    pub head_bytes_max: usize,
    /// The longest a connection may go with nothing read or written while
    /// the server waits on it.
    pub stall_timeout: Duration,
}

impl Default for MetricsOptions {
    fn default() -> Self {
        MetricsOptions {
            connection_limits: ConnectionLimits {
                connections_max: 16,
                connections_per_ip_max: 8,
            },
            header_timeout: Duration::from_secs(30),
            head_bytes_max: 16 * 1024,
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// A bound metrics port.
#[derive(Debug)]
pub struct MetricsListener {
    /// The listener.
    pub listener: TcpListener,
}

/// Serves the metrics port on `listeners` until `shutdown` says stop.
pub async fn serve_metrics(
    listeners: Vec<MetricsListener>,
    metrics: NodeMetrics,
    options: MetricsOptions,
    shutdown: watch::Receiver<bool>,
) {
    let gate = ConnectionGate::new(options.connection_limits);
    let warnings = Arc::new(SharedLogLimiter::for_remote_input());
    let mut loops = tokio::task::JoinSet::new();
    for MetricsListener { listener } in listeners {
        loops.spawn(accept_loop(
            listener,
            gate.clone(),
            warnings.clone(),
            metrics.clone(),
            options,
            shutdown.clone(),
        ));
    }
    while loops.join_next().await.is_some() {}
}

async fn accept_loop(
    listener: TcpListener,
    gate: ConnectionGate,
    warnings: Arc<SharedLogLimiter>,
    metrics: NodeMetrics,
    options: MetricsOptions,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let (stream, _remote, ticket) = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            accepted = gate.accept(&listener, "metrics", &warnings) => accepted,
        };
        let _ = stream.set_nodelay(true);
        let metrics = metrics.clone();
        let warnings = warnings.clone();
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            let io = TokioIo::new(Stalled::new(stream, options.stall_timeout));
            let service = hyper::service::service_fn(move |request| {
                let metrics = metrics.clone();
                let warnings = warnings.clone();
                async move { Ok::<_, Infallible>(answer(&metrics, &warnings, request).await) }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(options.header_timeout)
                .max_buf_size(options.head_bytes_max.max(HEAD_BYTES_MIN))
                .max_header_size(options.head_bytes_max.max(HEAD_BYTES_MIN));
            let connection = builder.serve_connection(io, service);
            tokio::select! {
                outcome = connection => {
                    if let Err(error) = outcome {
                        tracing::debug!(%error, "a metrics connection ended");
                    }
                }
                _ = shutdown.wait_for(|stop| *stop) => {}
            }
            drop(ticket);
        });
    }
}

type Answer = Response<Full<Bytes>>;

fn text(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Answer {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response.headers_mut().insert(
        "x-content-type-options",
        header::HeaderValue::from_static("nosniff"),
    );
    response
}

const PLAIN: &str = "text/plain; charset=utf-8";

fn not_found() -> Answer {
    text(StatusCode::NOT_FOUND, PLAIN, "404 page not found\n")
}

fn method_not_allowed(allow: &'static str) -> Answer {
    let mut response = text(
        StatusCode::METHOD_NOT_ALLOWED,
        PLAIN,
        "Method Not Allowed\n",
    );
    response
        .headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static(allow));
    response
}

/// The answer to one request. Failed health checks are logged as etcd
/// logs them, at most a few times a second (probes come often).
async fn answer(
    metrics: &NodeMetrics,
    warnings: &SharedLogLimiter,
    request: Request<Incoming>,
) -> Answer {
    let path = request.uri().path();
    let query = HealthQuery::parse(request.uri().query());
    let method = request.method();
    // `/livez` runs every check, `/livez/NAME` one.
    let checks = |prefix: &str| -> Option<Option<&str>> {
        match path.strip_prefix(prefix)? {
            "" => Some(None),
            rest => rest.strip_prefix('/').map(Some),
        }
    };
    if path == "/metrics" {
        if method != Method::GET && method != Method::HEAD {
            return method_not_allowed("GET, HEAD");
        }
        return text(
            StatusCode::OK,
            super::CONTENT_TYPE,
            metrics.exposition().await,
        );
    }
    if path == "/health" {
        if method != Method::GET {
            return method_not_allowed("GET");
        }
        let health = health::health(metrics, &query).await;
        return if health.healthy {
            text(StatusCode::OK, "application/json", health.json())
        } else {
            if let Some(suppressed) = warnings.allow() {
                tracing::warn!(reason = %health.reason, suppressed, "/health: unhealthy");
            }
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                "application/json",
                format!("{}\n", health.json()),
            )
        };
    }
    let found = [("/livez", CheckKind::Livez), ("/readyz", CheckKind::Readyz)]
        .into_iter()
        .find_map(|(prefix, kind)| checks(prefix).map(|only| (kind, only)));
    let Some((kind, only)) = found else {
        return not_found();
    };
    if method != Method::GET {
        return method_not_allowed("GET");
    }
    match health::run_checks(metrics, kind, only, &query).await {
        None => not_found(),
        Some(report) if report.ok => text(StatusCode::OK, PLAIN, report.body(query.verbose)),
        Some(report) => {
            if let Some(suppressed) = warnings.allow() {
                tracing::warn!(path, checks = %report.lines.trim_end(), suppressed, "health check failed");
            }
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                PLAIN,
                report.body(query.verbose),
            )
        }
    }
}

/// A connection whose reads and writes fail with `TimedOut` once nothing
/// has moved either way for its limit while the server waited on it.
struct Stalled<IO> {
    io: IO,
    limit: Duration,
    timer: Pin<Box<Sleep>>,
}

impl<IO> Stalled<IO> {
    fn new(io: IO, limit: Duration) -> Stalled<IO> {
        Stalled {
            io,
            limit,
            timer: Box::pin(tokio::time::sleep_until(deadline(limit))),
        }
    }

    fn moved(&mut self) {
        self.timer.as_mut().reset(deadline(self.limit));
    }

    fn waiting<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the metrics client stalled",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Now plus `limit`, or far ahead if that cannot be represented.
fn deadline(limit: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(limit)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

impl<IO: AsyncRead + Unpin> AsyncRead for Stalled<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(outcome) => {
                if buf.filled().len() > before {
                    this.moved();
                }
                Poll::Ready(outcome)
            }
            Poll::Pending => this.waiting(cx),
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Stalled<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_write(cx, data) {
            Poll::Ready(outcome) => {
                if matches!(outcome, Ok(n) if n > 0) {
                    this.moved();
                }
                Poll::Ready(outcome)
            }
            Poll::Pending => this.waiting(cx),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_flush(cx) {
            Poll::Ready(outcome) => Poll::Ready(outcome),
            Poll::Pending => this.waiting(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
