//! The JSON gateway: real HTTP/1.1 requests to the client port, answered
//! with etcd's JSON shapes (base64 keys and values, 64-bit integers as
//! strings), beside gRPC on the same port; and the NOSPACE alarm of a
//! store past its quota, raised, refused, cleared through the gateway.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_server::api::ApiOptions;
use ferry_server::backend::LocalBackend;
use ferry_server::kv_state::KvLimits;
use ferry_server::pb::etcdserverpb as pb;
use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::watch::WatchLimits;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TIMEOUT: Duration = Duration::from_secs(10);

async fn start(options: ApiOptions) -> (SocketAddr, common::TestServer) {
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits::default(),
        "http://127.0.0.1:0".to_string(),
    ));
    let server = common::start(backend, options).await;
    (server.address, server)
}

fn b64(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// Decodes a chunked body.
fn unchunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(end) = body.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(std::str::from_utf8(&body[..end]).unwrap().trim(), 16)
            .unwrap_or(0);
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&body[end + 2..end + 2 + size]);
        body = &body[end + 2 + size + 2..];
    }
}

/// One request on a new connection; answers the status and the body.
async fn http(
    address: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<u8>) {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut answer))
        .await
        .expect("the answer in time")
        .unwrap();
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let head = String::from_utf8_lossy(&answer[..split]).to_ascii_lowercase();
    let status: u16 = head[9..12].parse().unwrap();
    let body = &answer[split + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        unchunk(body)
    } else {
        body.to_vec()
    };
    (status, body)
}

/// A POST whose answer is one JSON object.
async fn post(address: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, body) = http(address, "POST", path, &body.to_string(), &[]).await;
    let value = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {}", String::from_utf8_lossy(&body)));
    (status, value)
}

async fn ok(address: SocketAddr, path: &str, body: Value) -> Value {
    let (status, value) = post(address, path, body).await;
    assert_eq!(status, 200, "{path}: {value}");
    value
}

#[tokio::test]
async fn kv_calls_through_the_gateway_speak_etcds_json_beside_grpc_on_one_port() {
    let (address, _server) = start(ApiOptions::default()).await;

    let put = ok(
        address,
        "/v3/kv/put",
        json!({"key": b64("foo"), "value": b64("bar")}),
    )
    .await;
    assert_eq!(put["header"]["revision"], "2", "{put}");
    assert!(put["header"]["cluster_id"].is_string());

    let range = ok(address, "/v3/kv/range", json!({"key": b64("foo")})).await;
    assert_eq!(range["count"], "1");
    let kv = &range["kvs"][0];
    assert_eq!(kv["key"], b64("foo"));
    assert_eq!(kv["value"], b64("bar"));
    assert_eq!(kv["create_revision"], "2");
    assert_eq!(kv["mod_revision"], "2");
    assert_eq!(kv["version"], "1");

    // A txn: compare on the create revision, put on success; the
    // camelCase names of the JSON mapping are read too.
    let txn = ok(
        address,
        "/v3/kv/txn",
        json!({
            "compare": [{"key": b64("foo"), "result": "EQUAL", "target": "CREATE", "create_revision": "2"}],
            "success": [{"requestPut": {"key": b64("foo"), "value": b64("baz"), "prev_kv": true}}],
            "failure": [{"request_range": {"key": b64("foo")}}],
        }),
    )
    .await;
    assert_eq!(txn["succeeded"], true, "{txn}");
    assert_eq!(
        txn["responses"][0]["response_put"]["prev_kv"]["value"],
        b64("bar")
    );

    // gRPC on the same port reads what the gateway wrote.
    let channel = common::connect(address).await;
    let got = KvClient::new(channel)
        .range(pb::RangeRequest {
            key: b"foo".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.kvs[0].value, &b"baz"[..]);

    let deleted = ok(
        address,
        "/v3/kv/deleterange",
        json!({"key": b64("a"), "range_end": b64("z")}),
    )
    .await;
    assert_eq!(deleted["deleted"], "1");
    let compacted = ok(address, "/v3/kv/compaction", json!({"revision": "3"})).await;
    assert!(compacted["header"].is_object());
    let status = ok(address, "/v3/maintenance/status", json!({})).await;
    assert_eq!(status["header"]["revision"], "4", "{status}");
    let members = ok(address, "/v3/cluster/member/list", json!({})).await;
    assert_eq!(members["members"].as_array().map(Vec::len), Some(1));
    let lease = ok(address, "/v3/lease/grant", json!({"TTL": "60"})).await;
    let id = lease["ID"].as_str().unwrap().to_string();
    let alive = post(address, "/v3/lease/keepalive", json!({"ID": id})).await;
    assert_eq!(alive.1["result"]["TTL"], "60", "{alive:?}");
    let ttl = ok(address, "/v3/lease/timetolive", json!({"ID": id})).await;
    assert_eq!(ttl["grantedTTL"], "60", "{ttl}");
}

#[tokio::test]
async fn the_gateway_answers_bad_requests_with_etcds_error_shape() {
    let (address, _server) = start(ApiOptions::default()).await;
    // etcd's own refusal, with its gRPC code and the HTTP status for it.
    let (status, body) = post(address, "/v3/kv/range", json!({"key": ""})).await;
    assert_eq!(status, 400);
    assert_eq!(body["code"], 3);
    assert_eq!(body["message"], "etcdserver: key is not provided");
    assert_eq!(body["error"], "etcdserver: key is not provided");

    let (status, body) = http(address, "POST", "/v3/kv/put", "{not json", &[]).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    let (status, _) = post(address, "/v3/kv/put", json!({"key": "not base64!"})).await;
    assert_eq!(status, 400);
    let (status, _) = http(address, "GET", "/v3/kv/range", "", &[]).await;
    assert_eq!(status, 405);
    let (status, _) = post(address, "/v3/no/such/call", json!({})).await;
    assert_eq!(status, 404);
    let (status, _) = post(address, "/elsewhere", json!({})).await;
    assert_eq!(status, 404);
    // A body past its bound is refused before it is parsed.
    let huge = format!(
        "{{\"key\":\"{}\"}}",
        "A".repeat(ApiOptions::default().grpc_message_size_bytes_max * 2 + 10)
    );
    let (status, _) = http(address, "POST", "/v3/kv/put", &huge, &[]).await;
    assert_eq!(status, 400);
    // With auth on, a call without a token is refused; one with the
    // token of the Authorization header is served.
    ok(
        address,
        "/v3/auth/user/add",
        json!({"name": "root", "password": "pw"}),
    )
    .await;
    ok(
        address,
        "/v3/auth/user/grant",
        json!({"user": "root", "role": "root"}),
    )
    .await;
    ok(address, "/v3/auth/enable", json!({})).await;
    let (status, body) = post(
        address,
        "/v3/kv/put",
        json!({"key": b64("k"), "value": b64("v")}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["message"], "etcdserver: user name is empty");
    let auth = ok(
        address,
        "/v3/auth/authenticate",
        json!({"name": "root", "password": "pw"}),
    )
    .await;
    let token = auth["token"].as_str().unwrap().to_string();
    let put = json!({"key": b64("k"), "value": b64("v")}).to_string();
    let (status, body) = http(
        address,
        "POST",
        "/v3/kv/put",
        &put,
        &[("Authorization", &token)],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

/// Reads a watch answer until its results hold `events` events (and at
/// least one result).
async fn read_results(stream: &mut TcpStream, events: usize) -> Vec<Value> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let text = String::from_utf8_lossy(&seen).to_string();
        let results: Vec<Value> = text
            .lines()
            .filter(|line| line.starts_with("{\"result\""))
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        let seen_events: usize = results
            .iter()
            .map(|r| r["result"]["events"].as_array().map_or(0, Vec::len))
            .sum();
        if !results.is_empty() && seen_events >= events {
            return results;
        }
        let mut buffer = [0u8; 4096];
        let read = tokio::time::timeout_at(deadline, stream.read(&mut buffer))
            .await
            .expect("watch results in time")
            .unwrap();
        assert!(read > 0, "the watch ended early: {text}");
        seen.extend_from_slice(&buffer[..read]);
    }
}

#[tokio::test]
async fn a_watch_through_the_gateway_streams_every_event_until_the_client_goes() {
    let (address, _server) = start(ApiOptions::default()).await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    let body =
        json!({"create_request": {"key": b64("w/"), "range_end": b64("w0"), "prev_kv": true}})
            .to_string();
    let request = format!(
        "POST /v3/watch HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let created = read_results(&mut stream, 0).await;
    assert_eq!(created[0]["result"]["created"], true, "{created:?}");
    ok(
        address,
        "/v3/kv/put",
        json!({"key": b64("w/a"), "value": b64("1")}),
    )
    .await;
    ok(
        address,
        "/v3/kv/put",
        json!({"key": b64("elsewhere"), "value": b64("1")}),
    )
    .await;
    ok(
        address,
        "/v3/kv/put",
        json!({"key": b64("w/a"), "value": b64("2")}),
    )
    .await;
    ok(address, "/v3/kv/deleterange", json!({"key": b64("w/a")})).await;
    let results = read_results(&mut stream, 3).await;
    let events: Vec<&Value> = results
        .iter()
        .flat_map(|r| r["result"]["events"].as_array().unwrap())
        .collect();
    assert_eq!(events.len(), 3, "{results:?}");
    assert_eq!(events[0]["kv"]["value"], b64("1"));
    assert_eq!(events[1]["kv"]["value"], b64("2"));
    assert_eq!(events[1]["prev_kv"]["value"], b64("1"));
    assert_eq!(events[2]["type"], "DELETE");
    assert_eq!(events[2]["kv"]["mod_revision"], "5");
}

#[tokio::test]
async fn past_the_quota_writes_that_grow_the_store_are_refused_until_the_alarm_is_disarmed() {
    let (address, _server) = start(ApiOptions {
        quota_backend_bytes: 300_000,
        ..ApiOptions::default()
    })
    .await;
    let value = b64(&"v".repeat(30_000));
    let mut refused = None;
    for i in 0..40 {
        let (status, body) = post(
            address,
            "/v3/kv/put",
            json!({"key": b64(&format!("k{}", i % 2)), "value": value}),
        )
        .await;
        if status != 200 {
            refused = Some((i, status, body));
            break;
        }
    }
    let (at, status, body) = refused.expect("the quota is reached");
    assert!(at > 5, "refused after {at} puts");
    assert_eq!(status, 429);
    assert_eq!(body["code"], 8);
    assert_eq!(body["message"], "etcdserver: mvcc: database space exceeded");

    // Raised for the whole cluster; listed by the alarm call and by status.
    let alarms = ok(address, "/v3/maintenance/alarm", json!({"action": "GET"})).await;
    assert_eq!(alarms["alarms"][0]["alarm"], "NOSPACE", "{alarms}");
    let member = alarms["alarms"][0]["memberID"].clone();
    let status = ok(address, "/v3/maintenance/status", json!({})).await;
    assert!(
        status["errors"][0]
            .as_str()
            .unwrap()
            .contains("alarm:NOSPACE"),
        "{status}"
    );

    // Every write that grows the store is refused, small or in a txn or a
    // lease grant; reads, deletes and compaction are served.
    let (status, _) = post(
        address,
        "/v3/kv/put",
        json!({"key": b64("new"), "value": b64("x")}),
    )
    .await;
    assert_eq!(status, 429);
    let (status, _) = post(
        address,
        "/v3/kv/txn",
        json!({"success": [{"request_put": {"key": b64("t"), "value": b64("x")}}]}),
    )
    .await;
    assert_eq!(status, 429);
    let (status, _) = post(address, "/v3/lease/grant", json!({"TTL": "60"})).await;
    assert_eq!(status, 429);
    let range = ok(address, "/v3/kv/range", json!({"key": b64("k0")})).await;
    assert_eq!(range["count"], "1");
    let revision = range["header"]["revision"].as_str().unwrap().to_string();
    ok(address, "/v3/kv/compaction", json!({"revision": revision})).await;
    ok(address, "/v3/maintenance/defragment", json!({})).await;

    // Cleared: writes are served again.
    let cleared = ok(
        address,
        "/v3/maintenance/alarm",
        json!({"action": "DEACTIVATE", "memberID": member, "alarm": "NOSPACE"}),
    )
    .await;
    assert_eq!(cleared["alarms"][0]["alarm"], "NOSPACE", "{cleared}");
    let alarms = ok(address, "/v3/maintenance/alarm", json!({"action": "GET"})).await;
    assert!(alarms.get("alarms").is_none(), "{alarms}");
    ok(
        address,
        "/v3/kv/put",
        json!({"key": b64("new"), "value": b64("x")}),
    )
    .await;
}
