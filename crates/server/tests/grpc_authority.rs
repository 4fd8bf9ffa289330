//! A client that sends a URL as its HTTP/2 `:authority`, as etcdctl v3.4
//! does for `endpoint status`, is served. The HTTP/2 exchange is written by
//! hand here: no client library lets a test send such an authority.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_server::api::ApiOptions;
use ferry_server::backend::LocalBackend;
use ferry_server::kv_state::KvLimits;
use ferry_server::pb::etcdserverpb as pb;
use ferry_server::watch::WatchLimits;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let length = (payload.len() as u32).to_be_bytes();
    let mut out = length[1..].to_vec();
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A gRPC message: not compressed, length, bytes.
fn grpc_message(message: &impl Message) -> Vec<u8> {
    let bytes = message.encode_to_vec();
    let mut out = vec![0];
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(&bytes);
    out
}

/// What came back on one stream.
#[derive(Debug, Default)]
struct Reply {
    fields: Vec<(String, String)>,
    data: Vec<u8>,
    reset: bool,
    ended: bool,
}

impl Reply {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn message<M: Message + Default>(&self) -> M {
        assert!(self.data.len() >= 5, "no gRPC message in {self:?}");
        M::decode(&self.data[5..]).unwrap()
    }
}

/// Sends two unary calls on one connection with `authority`, the second
/// block indexing the first as a client's encoder does, and reads the
/// replies.
async fn two_calls(address: SocketAddr, authority: &str) -> BTreeMap<u32, Reply> {
    let mut encoder = loona_hpack::Encoder::new();
    let mut request = PREFACE.to_vec();
    request.extend(frame(SETTINGS, 0, 0, &[]));
    let calls = [
        (
            1,
            "/etcdserverpb.Maintenance/Status",
            grpc_message(&pb::StatusRequest {}),
        ),
        (
            3,
            "/etcdserverpb.KV/Put",
            grpc_message(&pb::PutRequest {
                key: b"greeting".to_vec().into(),
                value: b"hello".to_vec().into(),
                ..Default::default()
            }),
        ),
    ];
    for (stream_id, path, body) in &calls {
        let fields: [(&[u8], &[u8]); 7] = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", authority.as_bytes()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"user-agent", b"grpc-go/1.26.0"),
        ];
        let block = encoder.encode(fields);
        request.extend(frame(HEADERS, END_HEADERS, *stream_id, &block));
        request.extend(frame(DATA, END_STREAM, *stream_id, body));
    }
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(&request).await.unwrap();

    let mut decoder = loona_hpack::Decoder::new();
    let mut replies: BTreeMap<u32, Reply> = BTreeMap::new();
    let mut block: Vec<u8> = Vec::new();
    let exchange = async {
        while replies.len() < calls.len() || !replies.values().all(|r| r.ended || r.reset) {
            let mut header = [0u8; 9];
            stream.read_exact(&mut header).await.unwrap();
            let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            let (kind, flags) = (header[3], header[4]);
            let stream_id = u32::from_be_bytes([header[5], header[6], header[7], header[8]]);
            let mut payload = vec![0u8; length];
            stream.read_exact(&mut payload).await.unwrap();
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    stream
                        .write_all(&frame(SETTINGS, ACK, 0, &[]))
                        .await
                        .unwrap();
                }
                GOAWAY => panic!("the server ended the connection: {payload:?}"),
                RST_STREAM => replies.entry(stream_id).or_default().reset = true,
                DATA => {
                    let reply = replies.entry(stream_id).or_default();
                    reply.data.extend_from_slice(&payload);
                    reply.ended |= flags & END_STREAM != 0;
                }
                HEADERS | CONTINUATION => {
                    block.extend_from_slice(&payload);
                    let reply = replies.entry(stream_id).or_default();
                    reply.ended |= flags & END_STREAM != 0;
                    if flags & END_HEADERS != 0 {
                        for (name, value) in decoder.decode(&block).unwrap() {
                            reply.fields.push((
                                String::from_utf8(name).unwrap(),
                                String::from_utf8(value).unwrap(),
                            ));
                        }
                        block.clear();
                    }
                }
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .expect("the server answered within 10 s");
    replies
}

async fn start() -> (SocketAddr, oneshot::Sender<()>) {
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits::default(),
        "http://127.0.0.1:0".to_string(),
    ));
    let server = common::start(backend, ApiOptions::default()).await;
    (server.address, server.stop)
}

fn assert_served(replies: &BTreeMap<u32, Reply>) {
    for (stream_id, reply) in replies {
        assert!(!reply.reset, "stream {stream_id} was reset: {reply:?}");
        assert_eq!(reply.field(":status"), Some("200"), "{reply:?}");
        assert_eq!(reply.field("grpc-status"), Some("0"), "{reply:?}");
    }
    let status: pb::StatusResponse = replies[&1].message();
    assert!(!status.version.is_empty());
    let put: pb::PutResponse = replies[&3].message();
    assert!(put.header.unwrap().revision >= 2);
}

#[tokio::test]
async fn a_url_as_the_authority_is_served_like_host_and_port() {
    let (address, _stop) = start().await;
    assert_served(&two_calls(address, &format!("http://{address}")).await);
    assert_served(&two_calls(address, &address.to_string()).await);
}
