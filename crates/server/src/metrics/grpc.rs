//! gRPC call counts by method and status code, as go-grpc-prometheus
//! counts them for etcd: `grpc_server_started_total` and
//! `grpc_server_handled_total`, labelled `grpc_type`, `grpc_service`,
//! `grpc_method` (and `grpc_code`).
//!
//! [`GrpcMetricsLayer`] wraps the API's gRPC services on every client
//! connection (see `crate::api::grpc_server`): a call is started when its
//! request arrives, and handled when its status is known: in the
//! response's headers (an error answered at once), in the trailers after
//! its body (a success, or a stream that ended with an error), or
//! `Canceled` when the response is dropped before either (the client went
//! away). Only the etcd API's own methods are counted, so what a client
//! puts in a request path cannot grow the label sets.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// One method of the etcd API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Method {
    /// The full service name, as in the path (`etcdserverpb.KV`).
    pub service: &'static str,
    /// The method's name (`Put`).
    pub method: &'static str,
    /// `unary`, `client_stream`, `server_stream` or `bidi_stream`.
    pub kind: &'static str,
}

const UNARY: &str = "unary";
const SERVER_STREAM: &str = "server_stream";
const BIDI_STREAM: &str = "bidi_stream";

/// Every method of etcd's v3 API (proto/etcdserverpb/rpc.proto; a test
/// checks the two agree).
const METHODS: &[Method] = &[
    m("etcdserverpb.KV", "Range", UNARY),
    m("etcdserverpb.KV", "Put", UNARY),
    m("etcdserverpb.KV", "DeleteRange", UNARY),
    m("etcdserverpb.KV", "Txn", UNARY),
    m("etcdserverpb.KV", "Compact", UNARY),
    m("etcdserverpb.Watch", "Watch", BIDI_STREAM),
    m("etcdserverpb.Lease", "LeaseGrant", UNARY),
    m("etcdserverpb.Lease", "LeaseRevoke", UNARY),
    m("etcdserverpb.Lease", "LeaseKeepAlive", BIDI_STREAM),
    m("etcdserverpb.Lease", "LeaseTimeToLive", UNARY),
    m("etcdserverpb.Lease", "LeaseLeases", UNARY),
    m("etcdserverpb.Cluster", "MemberAdd", UNARY),
    m("etcdserverpb.Cluster", "MemberRemove", UNARY),
    m("etcdserverpb.Cluster", "MemberUpdate", UNARY),
    m("etcdserverpb.Cluster", "MemberList", UNARY),
    m("etcdserverpb.Cluster", "MemberPromote", UNARY),
    m("etcdserverpb.Maintenance", "Alarm", UNARY),
    m("etcdserverpb.Maintenance", "Status", UNARY),
    m("etcdserverpb.Maintenance", "Defragment", UNARY),
    m("etcdserverpb.Maintenance", "Hash", UNARY),
    m("etcdserverpb.Maintenance", "HashKV", UNARY),
    m("etcdserverpb.Maintenance", "Snapshot", SERVER_STREAM),
    m("etcdserverpb.Maintenance", "MoveLeader", UNARY),
    m("etcdserverpb.Maintenance", "Downgrade", UNARY),
    m("etcdserverpb.Auth", "AuthEnable", UNARY),
    m("etcdserverpb.Auth", "AuthDisable", UNARY),
    m("etcdserverpb.Auth", "AuthStatus", UNARY),
    m("etcdserverpb.Auth", "Authenticate", UNARY),
    m("etcdserverpb.Auth", "UserAdd", UNARY),
    m("etcdserverpb.Auth", "UserGet", UNARY),
    m("etcdserverpb.Auth", "UserList", UNARY),
    m("etcdserverpb.Auth", "UserDelete", UNARY),
    m("etcdserverpb.Auth", "UserChangePassword", UNARY),
    m("etcdserverpb.Auth", "UserGrantRole", UNARY),
    m("etcdserverpb.Auth", "UserRevokeRole", UNARY),
    m("etcdserverpb.Auth", "RoleAdd", UNARY),
    m("etcdserverpb.Auth", "RoleGet", UNARY),
    m("etcdserverpb.Auth", "RoleList", UNARY),
    m("etcdserverpb.Auth", "RoleDelete", UNARY),
    m("etcdserverpb.Auth", "RoleGrantPermission", UNARY),
    m("etcdserverpb.Auth", "RoleRevokePermission", UNARY),
];

impl Method {
    /// Whether a call of it carries one request message (unary and
    /// server-streaming methods).
    pub fn takes_one_message(&self) -> bool {
        self.kind == UNARY || self.kind == SERVER_STREAM
    }
}

const fn m(service: &'static str, method: &'static str, kind: &'static str) -> Method {
    Method {
        service,
        method,
        kind,
    }
}

/// The etcd method a request path (`/etcdserverpb.KV/Put`) names, if any.
pub fn method(path: &str) -> Option<&'static Method> {
    method_index(path).map(|index| &METHODS[index.0])
}

/// A method's place in [`METHODS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MethodIndex(usize);

fn method_index(path: &str) -> Option<MethodIndex> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    METHODS
        .iter()
        .position(|m| m.service == service && m.method == method)
        .map(MethodIndex)
}

/// gRPC's status codes by value (`grpc-status` 0 to 16), as
/// [`code_name`] names them.
const CODES: usize = 17;

/// gRPC's names of its status codes (as Go's `codes.Code.String()`), by
/// value.
const CODE_NAMES: [&str; CODES] = [
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

/// A gRPC status code (below [`CODES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Code(u8);

impl Code {
    const CANCELED: Code = Code(1);
    const UNKNOWN: Code = Code(2);

    /// The code a `grpc-status` header or trailer carries; `Unknown` for
    /// anything but a number below [`CODES`] written as gRPC writes it.
    fn of_status(status: &[u8]) -> Code {
        let value = match status {
            [digit @ b'0'..=b'9'] => digit - b'0',
            [b'1', digit @ b'0'..=b'6'] => 10 + (digit - b'0'),
            _ => return Code::UNKNOWN,
        };
        Code(value)
    }

    /// Its name, as Go's `codes.Code.String()`.
    fn name(self) -> &'static str {
        CODE_NAMES[usize::from(self.0)]
    }
}

/// gRPC's name of a status code (as Go's `codes.Code.String()`), from the
/// value of a `grpc-status` header or trailer; `Unknown` for anything else.
pub fn code_name(status: &[u8]) -> &'static str {
    Code::of_status(status).name()
}

/// The labels of `grpc_server_started_total`.
type StartedLabels = [(&'static str, &'static str); 3];
/// The labels of `grpc_server_handled_total`.
type HandledLabels = [(&'static str, &'static str); 4];

fn started_labels(method: &Method) -> StartedLabels {
    [
        ("grpc_type", method.kind),
        ("grpc_service", method.service),
        ("grpc_method", method.method),
    ]
}

fn handled_labels(method: &Method, code: &'static str) -> HandledLabels {
    let [kind, service, name] = started_labels(method);
    [kind, service, name, ("grpc_code", code)]
}

/// The call counts of one API server.
///
/// Each request would otherwise look its counter up in a family by its
/// labels (hashing four label pairs under a lock, twice per call); the
/// counter of a method, or of a method and code, is looked up once, when
/// it is first counted, and kept here. A family shows a label set only
/// once it was created, so what the metrics page lists is unchanged: the
/// methods and codes that were seen.
#[derive(Debug)]
pub struct GrpcMetrics {
    /// Calls started, by method.
    pub started: Family<StartedLabels, Counter>,
    /// Calls completed, by method and status code.
    pub handled: Family<HandledLabels, Counter>,
    /// `started`'s counter of each method of [`METHODS`], by its index.
    started_by_method: Box<[OnceLock<Counter>]>,
    /// `handled`'s counter of each method and code, at
    /// `method index * CODES + code`.
    handled_by_method_code: Box<[OnceLock<Counter>]>,
}

impl Default for GrpcMetrics {
    fn default() -> Self {
        GrpcMetrics {
            started: Family::default(),
            handled: Family::default(),
            started_by_method: (0..METHODS.len()).map(|_| OnceLock::new()).collect(),
            handled_by_method_code: (0..METHODS.len() * CODES)
                .map(|_| OnceLock::new())
                .collect(),
        }
    }
}

impl GrpcMetrics {
    fn start(&self, method: MethodIndex) {
        self.started_by_method[method.0]
            .get_or_init(|| {
                let labels = started_labels(&METHODS[method.0]);
                self.started.get_or_create(&labels).clone()
            })
            .inc();
    }

    fn handled(&self, method: MethodIndex, code: Code) {
        self.handled_by_method_code[method.0 * CODES + usize::from(code.0)]
            .get_or_init(|| {
                let labels = handled_labels(&METHODS[method.0], code.name());
                self.handled.get_or_create(&labels).clone()
            })
            .inc();
    }

    /// How many calls of `service`/`method` completed with `code` (for
    /// tests and status pages).
    pub fn handled_count(&self, service: &str, method: &str, code: &str) -> u64 {
        let Some(method) = METHODS
            .iter()
            .find(|m| m.service == service && m.method == method)
        else {
            return 0;
        };
        let Some(code) = CODE_NAMES.iter().find(|name| **name == code) else {
            return 0;
        };
        self.handled
            .get(&handled_labels(method, code))
            .map_or(0, |counter| counter.get())
    }
}

/// Counts the calls of the service it wraps in a [`GrpcMetrics`].
#[derive(Debug, Clone)]
pub struct GrpcMetricsLayer {
    metrics: Arc<GrpcMetrics>,
}

impl GrpcMetricsLayer {
    /// A layer counting into `metrics`.
    pub fn new(metrics: Arc<GrpcMetrics>) -> GrpcMetricsLayer {
        GrpcMetricsLayer { metrics }
    }
}

impl<S> tower::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetricsService {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// The service of [`GrpcMetricsLayer`].
#[derive(Debug, Clone)]
pub struct GrpcMetricsService<S> {
    inner: S,
    metrics: Arc<GrpcMetrics>,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for GrpcMetricsService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>> + Clone,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = http::Response<CountedBody<ResBody>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let method = method_index(request.uri().path());
        if let Some(method) = method {
            self.metrics.start(method);
        }
        // The service that was polled ready takes the call; a clone stays.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let mut outcome = method.map(|method| Outcome {
            metrics: self.metrics.clone(),
            method,
            recorded: false,
        });
        let call = inner.call(request);
        Box::pin(async move {
            let response = match call.await {
                Ok(response) => response,
                Err(error) => {
                    if let Some(outcome) = outcome.as_mut() {
                        outcome.record(Code::UNKNOWN);
                    }
                    return Err(error);
                }
            };
            let (parts, body) = response.into_parts();
            // An error answered at once carries its status in the headers
            // (a trailers-only response).
            if let Some(status) = parts.headers.get("grpc-status") {
                if let Some(outcome) = outcome.as_mut() {
                    outcome.record(Code::of_status(status.as_bytes()));
                }
            }
            Ok(http::Response::from_parts(
                parts,
                CountedBody {
                    inner: body,
                    outcome,
                },
            ))
        })
    }
}

/// Records a call's code once.
#[derive(Debug)]
struct Outcome {
    metrics: Arc<GrpcMetrics>,
    method: MethodIndex,
    recorded: bool,
}

impl Outcome {
    fn record(&mut self, code: Code) {
        if !self.recorded {
            self.recorded = true;
            self.metrics.handled(self.method, code);
        }
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        // Dropped before a status was sent: the client went away.
        self.record(Code::CANCELED);
    }
}

/// A response body that records its call's status from its trailers.
#[derive(Debug)]
pub struct CountedBody<B> {
    inner: B,
    outcome: Option<Outcome>,
}

impl<B: Body + Unpin> Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Some(outcome) = this.outcome.as_mut() {
            match &polled {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(trailers) = frame.trailers_ref() {
                        let code = trailers
                            .get("grpc-status")
                            .map_or(Code::UNKNOWN, |status| Code::of_status(status.as_bytes()));
                        outcome.record(code);
                    }
                }
                // The body failed, or ended with no status at all.
                Poll::Ready(Some(Err(_))) | Poll::Ready(None) => outcome.record(Code::UNKNOWN),
                Poll::Pending => {}
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};
    use tower::{Layer, Service, ServiceExt};

    #[test]
    fn paths_map_to_etcd_methods_with_their_kinds() {
        let put = method("/etcdserverpb.KV/Put").expect("Put");
        assert_eq!(
            (put.service, put.method, put.kind),
            ("etcdserverpb.KV", "Put", "unary")
        );
        assert_eq!(
            method("/etcdserverpb.Watch/Watch").map(|m| m.kind),
            Some("bidi_stream")
        );
        assert_eq!(
            method("/etcdserverpb.Lease/LeaseKeepAlive").map(|m| m.kind),
            Some("bidi_stream")
        );
        assert_eq!(
            method("/etcdserverpb.Maintenance/Snapshot").map(|m| m.kind),
            Some("server_stream")
        );
        for unknown in [
            "",
            "/",
            "/etcdserverpb.KV",
            "/etcdserverpb.KV/",
            "/etcdserverpb.KV/Put/extra",
            "/etcdserverpb.KV/put",
            "/other.KV/Put",
            "etcdserverpb.KV/Put",
        ] {
            assert_eq!(method(unknown), None, "{unknown:?}");
        }
    }

    #[test]
    fn status_codes_have_grpcs_names() {
        assert_eq!(code_name(b"0"), "OK");
        assert_eq!(code_name(b"1"), "Canceled");
        assert_eq!(code_name(b"5"), "NotFound");
        assert_eq!(code_name(b"14"), "Unavailable");
        assert_eq!(code_name(b"16"), "Unauthenticated");
        for bad in [&b""[..], b"17", b"-1", b"00", b" 0", b"OK", b"\xff"] {
            assert_eq!(code_name(bad), "Unknown", "{bad:?}");
        }
        for value in 0..CODES {
            let code = Code::of_status(value.to_string().as_bytes());
            assert_eq!(usize::from(code.0), value);
        }
    }

    /// Every `rpc` of the proto is in the table with its kind, and the
    /// table has nothing else.
    #[test]
    fn the_table_covers_every_method_of_the_proto() {
        let proto = include_str!("../../proto/etcdserverpb/rpc.proto");
        let mut service = "";
        let mut found = Vec::new();
        for line in proto.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("service ") {
                service = rest.split_whitespace().next().unwrap_or("");
            } else if let Some(rest) = line.strip_prefix("rpc ") {
                let (name, signature) = rest.split_once('(').unwrap();
                let (request, response) = signature.split_once("returns").unwrap();
                let kind = match (request.contains("stream "), response.contains("stream ")) {
                    (false, false) => "unary",
                    (true, false) => "client_stream",
                    (false, true) => "server_stream",
                    (true, true) => "bidi_stream",
                };
                let path = format!("/etcdserverpb.{service}/{}", name.trim());
                assert_eq!(method(&path).map(|m| m.kind), Some(kind), "{path}");
                found.push(path);
            }
        }
        assert_eq!(found.len(), METHODS.len());
    }

    type Frames = StreamBody<
        tonic::codegen::tokio_stream::Iter<
            std::vec::IntoIter<Result<Frame<bytes::Bytes>, std::convert::Infallible>>,
        >,
    >;

    /// A body of one data frame and trailers with `grpc-status: status`.
    fn body_with_status(status: &'static str) -> Frames {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static(status));
        StreamBody::new(tonic::codegen::tokio_stream::iter(vec![
            Ok(Frame::data(bytes::Bytes::from_static(b"data"))),
            Ok(Frame::trailers(trailers)),
        ]))
    }

    fn request(path: &str) -> http::Request<()> {
        http::Request::builder().uri(path).body(()).unwrap()
    }

    #[tokio::test]
    async fn a_call_is_counted_with_the_code_of_its_trailers_or_its_headers() {
        let metrics = Arc::new(GrpcMetrics::default());
        let layer = GrpcMetricsLayer::new(metrics.clone());
        // Answers by path: a success with trailers, or an error in the
        // headers with an empty body.
        let inner = tower::service_fn(|request: http::Request<()>| async move {
            let response = match request.uri().path() {
                "/etcdserverpb.KV/Range" => {
                    let mut response = http::Response::new(body_with_status("0"));
                    response
                        .headers_mut()
                        .insert("grpc-status", http::HeaderValue::from_static("14"));
                    response
                }
                _ => http::Response::new(body_with_status("0")),
            };
            Ok::<_, std::convert::Infallible>(response)
        });
        let mut service = layer.layer(inner);
        for path in ["/etcdserverpb.KV/Put", "/etcdserverpb.KV/Put"] {
            let response = service.ready().await.unwrap().call(request(path)).await;
            let body = response.unwrap().into_body().collect().await.unwrap();
            assert!(body.trailers().is_some());
        }
        assert_eq!(metrics.handled_count("etcdserverpb.KV", "Put", "OK"), 2);
        let response = service
            .ready()
            .await
            .unwrap()
            .call(request("/etcdserverpb.KV/Range"))
            .await
            .unwrap();
        // Counted from the headers, before the body is read (and not
        // again from its trailers).
        assert_eq!(
            metrics.handled_count("etcdserverpb.KV", "Range", "Unavailable"),
            1
        );
        response.into_body().collect().await.unwrap();
        assert_eq!(metrics.handled_count("etcdserverpb.KV", "Range", "OK"), 0);
        assert_eq!(
            metrics
                .started
                .get(&[
                    ("grpc_type", "unary"),
                    ("grpc_service", "etcdserverpb.KV"),
                    ("grpc_method", "Put"),
                ])
                .map(|c| c.get()),
            Some(2)
        );
    }

    #[tokio::test]
    async fn a_response_dropped_before_its_status_counts_as_canceled() {
        let metrics = Arc::new(GrpcMetrics::default());
        let inner = tower::service_fn(|_request: http::Request<()>| async move {
            Ok::<_, std::convert::Infallible>(http::Response::new(body_with_status("0")))
        });
        let mut service = GrpcMetricsLayer::new(metrics.clone()).layer(inner);
        let response = service
            .ready()
            .await
            .unwrap()
            .call(request("/etcdserverpb.Watch/Watch"))
            .await
            .unwrap();
        drop(response);
        assert_eq!(
            metrics.handled_count("etcdserverpb.Watch", "Watch", "Canceled"),
            1
        );
        assert_eq!(
            metrics.handled_count("etcdserverpb.Watch", "Watch", "OK"),
            0
        );
    }

    #[tokio::test]
    async fn paths_that_are_not_etcd_methods_are_not_counted() {
        let metrics = Arc::new(GrpcMetrics::default());
        let inner = tower::service_fn(|_request: http::Request<()>| async move {
            Ok::<_, std::convert::Infallible>(http::Response::new(body_with_status("12")))
        });
        let mut service = GrpcMetricsLayer::new(metrics.clone()).layer(inner);
        for path in ["/etcdserverpb.KV/Nope", "/x/y", "/"] {
            let response = service
                .ready()
                .await
                .unwrap()
                .call(request(path))
                .await
                .unwrap();
            response.into_body().collect().await.unwrap();
        }
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("grpc_server_started", "Started", metrics.started.clone());
        registry.register("grpc_server_handled", "Handled", metrics.handled.clone());
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(samples.is_empty(), "{samples:?}");
    }
}
