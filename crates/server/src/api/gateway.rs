//! etcd's JSON gateway: the v3 API as JSON over HTTP/1.1 at `/v3/...`, on
//! the client port beside gRPC (a connection that does not open with the
//! HTTP/2 preface is served here), so that `curl` and clients that speak
//! only the gateway work against ferry as against etcd.
//!
//! Bodies follow the protobuf JSON mapping with the .proto files' field
//! names, as etcd's gateway writes them: bytes (keys, values) in base64,
//! 64-bit integers as strings, enums by name; unknown request fields are
//! skipped. Every call is a POST; an empty body is the empty request. A
//! call's answer is its response message, or on failure
//! `{"error": ..., "code": ..., "message": ...}` with the gRPC code and the
//! HTTP status grpc-gateway maps it to. The streaming calls (`/v3/watch`,
//! `/v3/lease/keepalive`, `/v3/maintenance/snapshot`) answer a stream of
//! `{"result": ...}` objects, one per line; a watch takes its requests
//! from the body (one or more objects) and runs until the client goes.
//! A token goes in the `Authorization` header, as with etcd.
//!
//! Bounds: a request head of at most [`HEAD_BYTES_MAX`] that must arrive
//! within [`HEAD_TIMEOUT`] (which also closes an idle kept-alive
//! connection), a body of at most twice the largest gRPC message (JSON
//! and base64 inflate it) that must arrive within [`BODY_TIMEOUT`], and at
//! most [`WATCH_REQUESTS_MAX`] requests in a watch's body. Behind that,
//! each call runs the same code and limits as its gRPC twin.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::codegen::tokio_stream::{self as stream, StreamExt};
use tonic::{Code, Status};

use super::{Credentials, EtcdApi};
use crate::backend::Backend;
use crate::pb::etcdserverpb as pb;
use crate::pb::etcdserverpb::auth_server::Auth;
use crate::pb::etcdserverpb::cluster_server::Cluster;
use crate::pb::etcdserverpb::kv_server::Kv;
use crate::pb::etcdserverpb::lease_server::Lease;
use crate::pb::etcdserverpb::maintenance_server::Maintenance;
use crate::tls::ClientConnectInfo;

/// The longest a request's head may take to arrive (counted from when the
/// server waits for it, so also an idle kept-alive connection's).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// The most bytes of a request's head.
pub const HEAD_BYTES_MAX: usize = 16 * 1024;
/// The longest a request's body may take to arrive.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// The most watch requests one `/v3/watch` body may hold.
pub const WATCH_REQUESTS_MAX: usize = 64;

type Body = UnsyncBoxBody<Bytes, Infallible>;
type Answer = http::Response<Body>;

/// Serves one HTTP/1.1 client connection until it ends or the API stops.
pub async fn serve_connection<B, IO>(api: EtcdApi<B>, io: IO, info: ClientConnectInfo)
where
    B: Backend,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let stopping = api.clone();
    let service = hyper::service::service_fn(move |request| {
        let api = api.clone();
        let info = info.clone();
        async move { Ok::<_, Infallible>(answer(&api, info, request).await) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(HEAD_BYTES_MAX)
        .max_header_size(HEAD_BYTES_MAX);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::select! {
        outcome = connection => {
            if let Err(error) = outcome {
                tracing::debug!(%error, "a gateway connection ended");
            }
        }
        () = stopping.stopped() => {}
    }
}

/// What a call is answered with: its response, or its error.
fn json(status: StatusCode, body: Vec<u8>) -> Answer {
    let mut response = http::Response::new(Full::new(Bytes::from(body)).boxed_unsync());
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn encode(message: &impl Serialize) -> Vec<u8> {
    // The generated impls write only strings, numbers and objects; a
    // failure would be a bug in them, answered as an internal error.
    serde_json::to_vec(message).unwrap_or_else(|error| {
        error_body(&Status::internal(format!("encoding the answer: {error}")))
    })
}

/// The HTTP status grpc-gateway answers a gRPC code with.
fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Cancelled => StatusCode::REQUEST_TIMEOUT,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// etcd's gateway error: `error` as etcd 3.4 writes it, `code` and
/// `message` as later versions do.
fn error_body(status: &Status) -> Vec<u8> {
    serde_json::json!({
        "error": status.message(),
        "code": status.code() as i32,
        "message": status.message(),
    })
    .to_string()
    .into_bytes()
}

fn error(status: &Status) -> Answer {
    json(http_status(status.code()), error_body(status))
}

/// A request message from a body: empty is the empty message.
fn parse<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, Status> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|error| Status::invalid_argument(format!("ferry: malformed JSON body: {error}")))
}

/// The gRPC request a gateway call stands for: its message, the token of
/// its `Authorization` header, and what is known of its connection (the
/// client certificate's name, for `--client-cert-auth`).
fn grpc_request<T>(message: T, parts: &Parts) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = &parts.authorization {
        request
            .metadata_mut()
            .insert("authorization", token.clone());
    }
    request.extensions_mut().insert(parts.info.clone());
    request
}

/// What a call needs of its HTTP request besides the body.
struct Parts {
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    info: ClientConnectInfo,
}

/// Runs one unary call: the body decoded into its request, the answer
/// encoded from its response.
async fn unary<Req, Resp, F, Fut>(body: &[u8], parts: &Parts, call: F) -> Answer
where
    Req: DeserializeOwned + Default,
    Resp: Serialize,
    F: FnOnce(tonic::Request<Req>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
{
    let request = match parse::<Req>(body) {
        Ok(request) => request,
        Err(status) => return error(&status),
    };
    match call(grpc_request(request, parts)).await {
        Ok(response) => json(StatusCode::OK, encode(response.get_ref())),
        Err(status) => error(&status),
    }
}

/// A stream of results as grpc-gateway writes one: an object per line,
/// `{"result": ...}` or, for a failure that ends it, `{"error": ...}`.
fn streamed<T, S>(responses: S) -> Answer
where
    T: Serialize,
    S: stream::Stream<Item = Result<T, Status>> + Send + 'static,
{
    let lines = responses.map(|item| {
        let mut line = match item {
            Ok(message) => serde_json::json!({ "result": message }).to_string(),
            Err(status) => {
                let error: serde_json::Value =
                    serde_json::from_slice(&error_body(&status)).unwrap_or_default();
                serde_json::json!({ "error": error }).to_string()
            }
        };
        line.push('\n');
        Ok::<_, Infallible>(Frame::data(Bytes::from(line)))
    });
    let mut response = http::Response::new(BodyExt::boxed_unsync(StreamBody::new(lines)));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

async fn answer<B: Backend>(
    api: &EtcdApi<B>,
    info: ClientConnectInfo,
    request: http::Request<Incoming>,
) -> Answer {
    let path = request.uri().path().to_string();
    if !path.starts_with("/v3/") {
        return error(&Status::not_found(format!("ferry: no such path {path}")));
    }
    if request.method() != Method::POST {
        let mut answer = error(&Status::unimplemented(
            "ferry: the gateway's calls are POST requests",
        ));
        *answer.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        answer
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return answer;
    }
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok());
    let parts = Parts {
        authorization,
        info,
    };
    let body_bytes_max = api.options.grpc_message_size_bytes_max.saturating_mul(2);
    let collected = tokio::time::timeout(
        BODY_TIMEOUT,
        Limited::new(request.into_body(), body_bytes_max).collect(),
    )
    .await;
    let body = match collected {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(too_large_or_broken)) => {
            return error(&Status::invalid_argument(format!(
                "ferry: the request body could not be read (at most {body_bytes_max} bytes): {too_large_or_broken}"
            )))
        }
        Err(_) => {
            return error(&Status::deadline_exceeded(
                "ferry: the request body did not arrive in time",
            ))
        }
    };
    let b = &body[..];
    let p = &parts;
    match path.as_str() {
        "/v3/kv/range" => unary(b, p, |r| Kv::range(api, r)).await,
        "/v3/kv/put" => unary(b, p, |r| Kv::put(api, r)).await,
        "/v3/kv/deleterange" => unary(b, p, |r| Kv::delete_range(api, r)).await,
        "/v3/kv/txn" => unary(b, p, |r| Kv::txn(api, r)).await,
        "/v3/kv/compaction" => unary(b, p, |r| Kv::compact(api, r)).await,
        "/v3/watch" => watch(api, b, p).await,
        "/v3/lease/grant" => unary(b, p, |r| Lease::lease_grant(api, r)).await,
        "/v3/lease/revoke" | "/v3/kv/lease/revoke" => {
            unary(b, p, |r| Lease::lease_revoke(api, r)).await
        }
        "/v3/lease/timetolive" | "/v3/kv/lease/timetolive" => {
            unary(b, p, |r| Lease::lease_time_to_live(api, r)).await
        }
        "/v3/lease/leases" | "/v3/kv/lease/leases" => {
            unary(b, p, |r| Lease::lease_leases(api, r)).await
        }
        "/v3/lease/keepalive" => keep_alive(api, b, p).await,
        "/v3/cluster/member/add" => unary(b, p, |r| Cluster::member_add(api, r)).await,
        "/v3/cluster/member/remove" => unary(b, p, |r| Cluster::member_remove(api, r)).await,
        "/v3/cluster/member/update" => unary(b, p, |r| Cluster::member_update(api, r)).await,
        "/v3/cluster/member/list" => unary(b, p, |r| Cluster::member_list(api, r)).await,
        "/v3/cluster/member/promote" => unary(b, p, |r| Cluster::member_promote(api, r)).await,
        "/v3/maintenance/alarm" => unary(b, p, |r| Maintenance::alarm(api, r)).await,
        "/v3/maintenance/status" => unary(b, p, |r| Maintenance::status(api, r)).await,
        "/v3/maintenance/defragment" => unary(b, p, |r| Maintenance::defragment(api, r)).await,
        "/v3/maintenance/hash" => unary(b, p, |r| Maintenance::hash(api, r)).await,
        "/v3/maintenance/hashkv" => unary(b, p, |r| Maintenance::hash_kv(api, r)).await,
        "/v3/maintenance/transfer-leadership" => {
            unary(b, p, |r| Maintenance::move_leader(api, r)).await
        }
        "/v3/maintenance/snapshot" => {
            let request = match parse::<pb::SnapshotRequest>(b) {
                Ok(request) => request,
                Err(status) => return error(&status),
            };
            match Maintenance::snapshot(api, grpc_request(request, p)).await {
                Ok(blobs) => streamed(blobs.into_inner()),
                Err(status) => error(&status),
            }
        }
        "/v3/auth/enable" => unary(b, p, |r| Auth::auth_enable(api, r)).await,
        "/v3/auth/disable" => unary(b, p, |r| Auth::auth_disable(api, r)).await,
        "/v3/auth/status" => unary(b, p, |r| Auth::auth_status(api, r)).await,
        "/v3/auth/authenticate" => unary(b, p, |r| Auth::authenticate(api, r)).await,
        "/v3/auth/user/add" => unary(b, p, |r| Auth::user_add(api, r)).await,
        "/v3/auth/user/get" => unary(b, p, |r| Auth::user_get(api, r)).await,
        "/v3/auth/user/list" => unary(b, p, |r| Auth::user_list(api, r)).await,
        "/v3/auth/user/delete" => unary(b, p, |r| Auth::user_delete(api, r)).await,
        "/v3/auth/user/changepw" => unary(b, p, |r| Auth::user_change_password(api, r)).await,
        "/v3/auth/user/grant" => unary(b, p, |r| Auth::user_grant_role(api, r)).await,
        "/v3/auth/user/revoke" => unary(b, p, |r| Auth::user_revoke_role(api, r)).await,
        "/v3/auth/role/add" => unary(b, p, |r| Auth::role_add(api, r)).await,
        "/v3/auth/role/get" => unary(b, p, |r| Auth::role_get(api, r)).await,
        "/v3/auth/role/list" => unary(b, p, |r| Auth::role_list(api, r)).await,
        "/v3/auth/role/delete" => unary(b, p, |r| Auth::role_delete(api, r)).await,
        "/v3/auth/role/grant" => unary(b, p, |r| Auth::role_grant_permission(api, r)).await,
        "/v3/auth/role/revoke" => unary(b, p, |r| Auth::role_revoke_permission(api, r)).await,
        _ => error(&Status::not_found(format!("ferry: no such path {path}"))),
    }
}

/// `/v3/watch`: the body's requests (one or more JSON objects, in order)
/// feed one watch stream, whose responses are streamed back until the
/// client goes (a body that ends does not end the watch, as with etcd's
/// gateway).
async fn watch<B: Backend>(api: &EtcdApi<B>, body: &[u8], parts: &Parts) -> Answer {
    let mut requests = Vec::new();
    for request in serde_json::Deserializer::from_slice(body).into_iter::<pb::WatchRequest>() {
        match request {
            Ok(request) if requests.len() < WATCH_REQUESTS_MAX => requests.push(Ok(request)),
            Ok(_) => {
                return error(&Status::invalid_argument(format!(
                    "ferry: at most {WATCH_REQUESTS_MAX} watch requests in one body"
                )))
            }
            Err(error_) => {
                return error(&Status::invalid_argument(format!(
                    "ferry: malformed JSON body: {error_}"
                )))
            }
        }
    }
    let credentials = Credentials::of(&grpc_request((), parts));
    let credentials = match api.authenticated(credentials).await {
        Ok(credentials) => credentials,
        Err(status) => return error(&status),
    };
    let incoming = stream::iter(requests).chain(stream::pending());
    match api.open_watch(&credentials, incoming).await {
        // JSON carries the events themselves: decoded from the bytes the
        // hub encoded (it wrote them, so they decode).
        Ok(responses) => streamed(responses.map(|response| {
            response?
                .into_response()
                .map_err(|error| Status::internal(format!("ferry: a watch event: {error}")))
        })),
        Err(status) => error(&status),
    }
}

/// `/v3/lease/keepalive`: one keep-alive, answered as a one-result stream.
async fn keep_alive<B: Backend>(api: &EtcdApi<B>, body: &[u8], parts: &Parts) -> Answer {
    let request = match parse::<pb::LeaseKeepAliveRequest>(body) {
        Ok(request) => request,
        Err(status) => return error(&status),
    };
    let credentials = Credentials::of(&grpc_request((), parts));
    let answer = async {
        let credentials = api.authenticated(credentials).await?;
        api.authorize_with(&credentials, |auth, user| auth.check_user(user))?;
        api.renew_lease(request.id).await
    }
    .await;
    streamed(stream::iter([answer]))
}
