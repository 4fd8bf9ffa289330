//! The cost of the gRPC stack alone: a KV service that keeps keys in a
//! map (no Raft, no MVCC, no limits), served on the three `ferry dev`
//! client ports in one process, either by tonic's server (`tonic`) or by
//! hyper's HTTP/2 server with the KV service behind it (`hyper`, as the
//! API serves), on tokio's multi-thread runtime or a current-thread one
//! (`current`). `ferry bench` against it measures what a call costs
//! before any of ferry's own work: the floor under ferry's CPU per
//! request. `scripts/bench-vs-etcd.sh` measures it beside etcd and ferry when
//! `FLOOR` names this example's binary.
//!
//! ```text
//! cargo run --release -p ferry-server --example grpc_floor -- hyper multi 2379,22379,32379
//! ferry bench --workload range-serializable --clients 256 --connections 16
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferry_server::pb::etcdserverpb as pb;
use ferry_server::pb::etcdserverpb::kv_server::{Kv, KvServer};
use ferry_server::pb::mvccpb::KeyValue;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

#[derive(Clone, Default)]
struct MapKv {
    keys: Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>>,
}

impl MapKv {
    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, Vec<u8>>> {
        // A panic while holding the lock leaves a usable map.
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[tonic::async_trait]
impl Kv for MapKv {
    async fn range(
        &self,
        request: Request<pb::RangeRequest>,
    ) -> Result<Response<pb::RangeResponse>, Status> {
        let request = request.into_inner();
        let value = self.keys().get(&request.key).cloned();
        let kvs: Vec<KeyValue> = value
            .into_iter()
            .map(|value| KeyValue {
                key: request.key.clone().into(),
                value: value.into(),
                create_revision: 1,
                mod_revision: 1,
                version: 1,
                lease: 0,
            })
            .collect();
        Ok(Response::new(pb::RangeResponse {
            header: Some(pb::ResponseHeader::default()),
            count: kvs.len() as i64,
            kvs,
            more: false,
        }))
    }
    async fn put(
        &self,
        request: Request<pb::PutRequest>,
    ) -> Result<Response<pb::PutResponse>, Status> {
        let request = request.into_inner();
        self.keys()
            .insert(request.key.to_vec(), request.value.to_vec());
        Ok(Response::new(pb::PutResponse {
            header: Some(pb::ResponseHeader::default()),
            prev_kv: None,
        }))
    }
    async fn delete_range(
        &self,
        _: Request<pb::DeleteRangeRequest>,
    ) -> Result<Response<pb::DeleteRangeResponse>, Status> {
        Err(Status::unimplemented("delete_range"))
    }
    async fn txn(&self, _: Request<pb::TxnRequest>) -> Result<Response<pb::TxnResponse>, Status> {
        Err(Status::unimplemented("txn"))
    }
    async fn compact(
        &self,
        _: Request<pb::CompactionRequest>,
    ) -> Result<Response<pb::CompactionResponse>, Status> {
        Err(Status::unimplemented("compact"))
    }
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let server = args.first().map_or("hyper", String::as_str).to_string();
    let runtime = args.get(1).map_or("multi", String::as_str);
    let ports: Result<Vec<u16>, _> = args
        .get(2)
        .map_or("2379,22379,32379", String::as_str)
        .split(',')
        .map(str::parse)
        .collect();
    let (Ok(ports), "tonic" | "hyper" | "h2", "multi" | "current") =
        (ports, server.as_str(), runtime)
    else {
        eprintln!("usage: grpc_floor [tonic|hyper|h2] [multi|current] [PORT,PORT,...]");
        return std::process::ExitCode::from(2);
    };
    let runtime = match runtime {
        "current" => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        _ => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
    };
    match runtime {
        Ok(runtime) => match runtime.block_on(serve(server, ports)) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("grpc_floor: {error}");
                std::process::ExitCode::FAILURE
            }
        },
        Err(error) => {
            eprintln!("grpc_floor: cannot start the runtime: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Serves on every port until the process is stopped; fails if a port
/// cannot be bound.
async fn serve(server: String, ports: Vec<u16>) -> std::io::Result<()> {
    let kv = MapKv::default();
    let mut tasks = Vec::new();
    for port in ports {
        let listener = TcpListener::bind(("127.0.0.1", port)).await?;
        let kv = kv.clone();
        let server = server.clone();
        tasks.push(tokio::spawn(async move {
            if server == "tonic" {
                if let Err(error) = tonic::transport::Server::builder()
                    .add_service(KvServer::new(kv))
                    .serve_with_incoming(accepted(listener))
                    .await
                {
                    eprintln!("grpc_floor: {error}");
                }
                return;
            }
            loop {
                // A failed accept (out of descriptors) is skipped.
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                if server == "h2" {
                    tokio::spawn(serve_h2(stream, kv.clone()));
                    continue;
                }
                let service = TowerToHyperService::new(KvServer::new(kv.clone()));
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    Ok(())
}

/// Serves one connection with h2 alone: each call is read whole, decoded,
/// answered and encoded here (unary KV calls only), without hyper's
/// service glue or tonic's server-side codec.
async fn serve_h2(stream: tokio::net::TcpStream, kv: MapKv) {
    let Ok(mut connection) = h2::server::handshake(stream).await else {
        return;
    };
    while let Some(Ok((request, respond))) = connection.accept().await {
        let kv = kv.clone();
        tokio::spawn(async move {
            let _ = answer_h2(&kv, request, respond).await;
        });
    }
}

async fn answer_h2(
    kv: &MapKv,
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
) -> Result<(), h2::Error> {
    use bytes::{Buf, BufMut};
    let (parts, mut body) = request.into_parts();
    let mut message = bytes::BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        message.extend_from_slice(&chunk);
    }
    if message.len() < 5 {
        return Ok(());
    }
    message.advance(5);
    let encoded = match parts.uri.path() {
        "/etcdserverpb.KV/Range" => encoded(kv.range(decoded(message)).await),
        "/etcdserverpb.KV/Put" => encoded(kv.put(decoded(message)).await),
        _ => None,
    };
    let mut head = http::Response::new(());
    head.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    let mut send = respond.send_response(head, false)?;
    let mut trailers = http::HeaderMap::new();
    let status = if let Some(encoded) = encoded {
        let mut framed = bytes::BytesMut::with_capacity(5 + encoded.len());
        framed.put_u8(0);
        framed.put_u32(encoded.len() as u32);
        framed.put_slice(&encoded);
        send.send_data(framed.freeze(), false)?;
        "0"
    } else {
        "12"
    };
    trailers.insert("grpc-status", http::HeaderValue::from_static(status));
    send.send_trailers(trailers)
}

/// A request message from its bytes (a malformed one reads as the empty
/// message: the floor measures the stack, not validation).
fn decoded<T: prost::Message + Default>(message: bytes::BytesMut) -> Request<T> {
    Request::new(T::decode(message).unwrap_or_default())
}

/// A response's message bytes, or none for an error.
fn encoded<T: prost::Message>(response: Result<Response<T>, Status>) -> Option<Vec<u8>> {
    response
        .ok()
        .map(|response| response.into_inner().encode_to_vec())
}

/// The connections `listener` accepts, with Nagle's algorithm off (as the
/// API's own are), as the stream tonic's server takes.
fn accepted(
    listener: TcpListener,
) -> impl tonic::codegen::tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        loop {
            let accepted = listener.accept().await.map(|(stream, _)| {
                let _ = stream.set_nodelay(true);
                stream
            });
            if tx.send(accepted).await.is_err() {
                return;
            }
        }
    });
    tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx)
}
