//! gRPC requests with extreme values against a real server on 127.0.0.1:
//! huge ranges, limits of 0, negative and i64::MAX, revisions far in the
//! future and in the past, empty keys, values just under and over the
//! 1.5 MiB request limit, txns at and past their bounds, watches and
//! leases at the edges. Each call gets a definite answer or a typed gRPC
//! error within a deadline (never a hang), and the server answers
//! afterwards (never a crash).

use std::sync::Arc;
use std::time::Duration;

use ferry_server::api::{spawn_server, ApiOptions, EtcdApi};
use ferry_server::backend::LocalBackend;
use ferry_server::kv_state::{KvLimits, REQUEST_BYTES_MAX_DEFAULT};
use ferry_server::pb::etcdserverpb as pb;
use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::lease_client::LeaseClient;
use ferry_server::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use ferry_server::pb::etcdserverpb::watch_client::WatchClient;
use ferry_server::watch::WatchLimits;
use tokio::sync::{mpsc, oneshot};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Code;

/// The longest one call may take: far above what any of these needs.
const CALL_DEADLINE: Duration = Duration::from_secs(20);

/// Edges of a 64-bit field.
const EXTREMES: [i64; 9] = [
    i64::MIN,
    i64::MIN + 1,
    -1,
    0,
    1,
    2,
    1 << 40,
    i64::MAX - 1,
    i64::MAX,
];

/// The codes a typed refusal may carry: what etcd answers for bad input,
/// for what does not exist and for limits. Not `Unknown`, `Internal`,
/// `Unavailable` or `Cancelled`: those would be a server that failed, not
/// one that refused.
const TYPED_REFUSALS: [Code; 7] = [
    Code::InvalidArgument,
    Code::OutOfRange,
    Code::NotFound,
    Code::FailedPrecondition,
    Code::ResourceExhausted,
    Code::AlreadyExists,
    Code::PermissionDenied,
];

struct Server {
    channel: Channel,
    task: tokio::task::JoinHandle<()>,
    _stop: oneshot::Sender<()>,
}

async fn start() -> Server {
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits::default(),
        "http://127.0.0.1:0".to_string(),
    ));
    backend.spawn_lease_expiry(Duration::from_millis(50));
    let (stop, stopped) = oneshot::channel::<()>();
    let (address, task) = spawn_server(
        EtcdApi::new(backend, ApiOptions::default()),
        "127.0.0.1:0".parse().unwrap(),
        async {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    let channel = Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    Server {
        channel,
        task,
        _stop: stop,
    }
}

impl Server {
    fn kv(&self) -> KvClient<Channel> {
        KvClient::new(self.channel.clone())
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }
}

/// Awaits one call within the deadline and checks its outcome: an answer,
/// or a refusal with a typed code. Returns the answer, if any.
async fn definite<T>(
    what: &str,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Option<T> {
    match tokio::time::timeout(CALL_DEADLINE, call).await {
        Err(_) => panic!("{what}: no answer within {CALL_DEADLINE:?}"),
        Ok(Ok(response)) => Some(response.into_inner()),
        Ok(Err(status)) => {
            assert!(
                TYPED_REFUSALS.contains(&status.code()),
                "{what}: refused with {:?}: {}",
                status.code(),
                status.message()
            );
            assert!(
                !status.message().is_empty(),
                "{what}: a refusal without a reason"
            );
            None
        }
    }
}

fn put(key: &[u8], value: Vec<u8>) -> pb::PutRequest {
    pb::PutRequest {
        key: bytes::Bytes::copy_from_slice(key),
        value: value.into(),
        ..pb::PutRequest::default()
    }
}

/// Keys as extreme as a client can send: empty, `\0`, all 0xff, long.
fn keys() -> Vec<Vec<u8>> {
    vec![
        Vec::new(),
        vec![0],
        vec![0xff; 8],
        b"a".to_vec(),
        vec![b'k'; 64 * 1024],
    ]
}

/// Whether any thread panicked: a panic in a server task (a stream's, a
/// connection's) ends only that task, and a client may not see it.
static PANICKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_requests_get_definite_answers_and_the_server_survives() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICKED.store(true, std::sync::atomic::Ordering::SeqCst);
        default_hook(info);
    }));
    let server = start().await;
    let mut kv = server.kv();
    for key in ["a", "b", "c/1", "c/2"] {
        definite("seed put", kv.put(put(key.as_bytes(), b"v".to_vec())))
            .await
            .unwrap();
    }

    // Ranges: every key/range_end pair, limits and revisions at the edges.
    for key in keys() {
        for range_end in [Vec::new(), vec![0], vec![0xff; 8], b"a".to_vec()] {
            for limit in EXTREMES {
                let request = pb::RangeRequest {
                    key: key.clone(),
                    range_end: range_end.clone(),
                    limit,
                    ..pb::RangeRequest::default()
                };
                if let Some(response) = definite("range limit", kv.range(request)).await {
                    if limit > 0 {
                        assert!(response.kvs.len() as i64 <= limit);
                    }
                }
            }
            for revision in EXTREMES {
                let request = pb::RangeRequest {
                    key: key.clone(),
                    range_end: range_end.clone(),
                    revision,
                    serializable: revision % 2 == 0,
                    ..pb::RangeRequest::default()
                };
                definite("range revision", kv.range(request)).await;
            }
        }
    }
    for bound in EXTREMES {
        let request = pb::RangeRequest {
            key: vec![0],
            range_end: vec![0],
            min_mod_revision: bound,
            max_mod_revision: bound.wrapping_neg(),
            min_create_revision: bound,
            max_create_revision: bound,
            sort_order: (bound % 5) as i32,
            sort_target: (bound % 7) as i32,
            count_only: bound < 0,
            keys_only: bound > 0,
            ..pb::RangeRequest::default()
        };
        definite("range filters", kv.range(request)).await;
    }
    for sort in [-1, 3, 99, i32::MAX, i32::MIN] {
        let request = pb::RangeRequest {
            key: vec![0],
            range_end: vec![0],
            sort_order: sort,
            sort_target: sort,
            ..pb::RangeRequest::default()
        };
        definite("range unknown sort", kv.range(request)).await;
    }

    // Values around the request limit (1.5 MiB): just under is taken,
    // over is refused as too large.
    let under = REQUEST_BYTES_MAX_DEFAULT - 1024;
    assert!(
        definite(
            "put under the limit",
            kv.put(put(b"big", vec![b'v'; under]))
        )
        .await
        .is_some(),
        "a value under the request limit was refused"
    );
    for over in [
        REQUEST_BYTES_MAX_DEFAULT,
        REQUEST_BYTES_MAX_DEFAULT + 1,
        4 << 20,
    ] {
        let refused = definite("put over the limit", kv.put(put(b"big", vec![b'v'; over]))).await;
        assert!(refused.is_none(), "a value of {over} bytes was taken");
    }
    let read = definite(
        "range of the big value",
        kv.range(pb::RangeRequest {
            key: b"big".to_vec(),
            ..pb::RangeRequest::default()
        }),
    )
    .await
    .unwrap();
    assert_eq!(read.kvs[0].value.len(), under);

    // Puts with extreme keys and leases.
    for key in keys() {
        for lease in [0, -1, i64::MAX, i64::MIN] {
            let request = pb::PutRequest {
                lease,
                prev_kv: true,
                ignore_lease: lease == -1,
                ..put(&key, b"x".to_vec())
            };
            definite("put extreme", kv.put(request)).await;
        }
        for (ignore_value, ignore_lease) in [(true, false), (false, true), (true, true)] {
            let request = pb::PutRequest {
                ignore_value,
                ignore_lease,
                ..put(&key, Vec::new())
            };
            definite("put ignore", kv.put(request)).await;
        }
    }

    // Deletes of everything, of nothing, of reversed ranges.
    for key in keys() {
        for range_end in [Vec::new(), vec![0], b"\x01".to_vec()] {
            let request = pb::DeleteRangeRequest {
                key: key.clone(),
                range_end,
                prev_kv: true,
            };
            definite("delete", kv.delete_range(request)).await;
        }
    }
    definite("reseed", kv.put(put(b"a", b"1".to_vec())))
        .await
        .unwrap();

    // Txns: compares at the edges, too many ops, too deep, ops of nothing.
    for value in EXTREMES {
        let compares = [
            pb::compare::TargetUnion::Version(value),
            pb::compare::TargetUnion::CreateRevision(value),
            pb::compare::TargetUnion::ModRevision(value),
            pb::compare::TargetUnion::Lease(value),
        ];
        for (target, union) in (0..).zip(compares) {
            for result in [0, 1, 2, 3, 99] {
                let request = pb::TxnRequest {
                    compare: vec![pb::Compare {
                        result,
                        target,
                        key: b"a".to_vec(),
                        range_end: if value < 0 { vec![0] } else { Vec::new() },
                        target_union: Some(union.clone()),
                    }],
                    success: vec![pb::RequestOp {
                        request: Some(pb::request_op::Request::RequestRange(pb::RangeRequest {
                            key: vec![0],
                            range_end: vec![0],
                            limit: value,
                            revision: value,
                            ..pb::RangeRequest::default()
                        })),
                    }],
                    failure: vec![pb::RequestOp { request: None }],
                };
                definite("txn compare", kv.txn(request)).await;
            }
        }
    }
    let many = |count: usize| pb::TxnRequest {
        success: (0..count)
            .map(|i| pb::RequestOp {
                request: Some(pb::request_op::Request::RequestPut(put(
                    format!("t/{i}").as_bytes(),
                    b"x".to_vec(),
                ))),
            })
            .collect(),
        ..pb::TxnRequest::default()
    };
    assert!(definite("txn at the op limit", kv.txn(many(128)))
        .await
        .is_some());
    assert!(definite("txn past the op limit", kv.txn(many(129)))
        .await
        .is_none());
    let mut deep = pb::TxnRequest::default();
    for _ in 0..40 {
        deep = pb::TxnRequest {
            success: vec![pb::RequestOp {
                request: Some(pb::request_op::Request::RequestTxn(deep)),
            }],
            ..pb::TxnRequest::default()
        };
    }
    definite("txn too deep", kv.txn(deep)).await;
    let same_key_twice = pb::TxnRequest {
        success: vec![
            pb::RequestOp {
                request: Some(pb::request_op::Request::RequestPut(put(
                    b"a",
                    b"1".to_vec(),
                ))),
            },
            pb::RequestOp {
                request: Some(pb::request_op::Request::RequestDeleteRange(
                    pb::DeleteRangeRequest {
                        key: vec![0],
                        range_end: vec![0],
                        prev_kv: false,
                    },
                )),
            },
        ],
        ..pb::TxnRequest::default()
    };
    definite("txn overlapping writes", kv.txn(same_key_twice)).await;

    // Compactions at the edges (the last leaves the store compacted up to
    // its current revision, which the reads after it must respect).
    let current = definite(
        "range",
        kv.range(pb::RangeRequest {
            key: b"a".to_vec(),
            ..pb::RangeRequest::default()
        }),
    )
    .await
    .unwrap()
    .header
    .unwrap()
    .revision;
    for revision in [i64::MIN, -1, 0, i64::MAX, current + 1, current] {
        let request = pb::CompactionRequest {
            revision,
            physical: revision % 2 == 0,
        };
        definite("compact", kv.compact(request)).await;
    }
    for revision in [1, current - 1, current, current + 1] {
        definite(
            "range at a compacted revision",
            kv.range(pb::RangeRequest {
                key: vec![0],
                range_end: vec![0],
                revision,
                ..pb::RangeRequest::default()
            }),
        )
        .await;
    }

    leases_at_the_edges(&server).await;
    watches_at_the_edges(&server).await;

    // The server still answers, and is still running.
    let after = definite("put after", kv.put(put(b"after", b"1".to_vec()))).await;
    assert!(after.is_some(), "the server stopped taking writes");
    let mut maintenance = MaintenanceClient::new(server.channel.clone());
    definite("status after", maintenance.status(pb::StatusRequest {}))
        .await
        .unwrap();
    assert!(!server.task.is_finished(), "the server ended");
    assert!(
        !PANICKED.load(std::sync::atomic::Ordering::SeqCst),
        "a server task panicked (see above)"
    );
}

async fn leases_at_the_edges(server: &Server) {
    let mut lease = LeaseClient::new(server.channel.clone());
    for id in EXTREMES {
        for ttl in EXTREMES {
            definite(
                "lease grant",
                lease.lease_grant(pb::LeaseGrantRequest { ttl, id }),
            )
            .await;
        }
        definite(
            "lease ttl",
            lease.lease_time_to_live(pb::LeaseTimeToLiveRequest { id, keys: true }),
        )
        .await;
        definite(
            "lease revoke",
            lease.lease_revoke(pb::LeaseRevokeRequest { id }),
        )
        .await;
    }
    definite("lease list", lease.lease_leases(pb::LeaseLeasesRequest {}))
        .await
        .unwrap();
    let (requests, receiver) = mpsc::channel(64);
    let mut responses = tokio::time::timeout(
        CALL_DEADLINE,
        lease.lease_keep_alive(ReceiverStream::new(receiver)),
    )
    .await
    .expect("a keep-alive stream opens in time")
    .expect("a keep-alive stream opens")
    .into_inner();
    for id in EXTREMES {
        requests
            .send(pb::LeaseKeepAliveRequest { id })
            .await
            .unwrap();
        let answer = tokio::time::timeout(CALL_DEADLINE, responses.message())
            .await
            .expect("a keep-alive is answered in time");
        // An unknown lease is answered with a TTL of -1 or the stream ends
        // with a typed error; either way, an answer.
        if let Err(status) = answer {
            assert!(
                TYPED_REFUSALS.contains(&status.code()),
                "keep-alive: {status:?}"
            );
            break;
        }
    }
}

async fn watches_at_the_edges(server: &Server) {
    let mut watch = WatchClient::new(server.channel.clone());
    let (requests, receiver) = mpsc::channel(64);
    let mut responses =
        tokio::time::timeout(CALL_DEADLINE, watch.watch(ReceiverStream::new(receiver)))
            .await
            .expect("a watch stream opens in time")
            .expect("a watch stream opens")
            .into_inner();
    let mut sent = 0;
    for key in keys() {
        for start_revision in EXTREMES {
            let create = pb::WatchCreateRequest {
                key: key.clone(),
                range_end: if start_revision < 0 {
                    vec![0]
                } else {
                    Vec::new()
                },
                start_revision,
                progress_notify: start_revision == 1,
                filters: vec![0, 1, 99, -1],
                prev_kv: true,
                watch_id: start_revision,
                fragment: start_revision > 0,
            };
            requests
                .send(pb::WatchRequest {
                    request_union: Some(pb::watch_request::RequestUnion::CreateRequest(create)),
                })
                .await
                .unwrap();
            sent += 1;
        }
    }
    for watch_id in EXTREMES {
        requests
            .send(pb::WatchRequest {
                request_union: Some(pb::watch_request::RequestUnion::CancelRequest(
                    pb::WatchCancelRequest { watch_id },
                )),
            })
            .await
            .unwrap();
        sent += 1;
    }
    requests
        .send(pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::ProgressRequest(
                pb::WatchProgressRequest {},
            )),
        })
        .await
        .unwrap();
    requests
        .send(pb::WatchRequest {
            request_union: None,
        })
        .await
        .unwrap();
    // Every create gets a created (or refused) answer; events of history
    // replays come too. Read until the creates are all answered.
    let mut creates_answered = 0;
    let creates = sent - EXTREMES.len();
    while creates_answered < creates {
        let next = tokio::time::timeout(CALL_DEADLINE, responses.message())
            .await
            .expect("a watch request is answered in time");
        match next {
            Ok(Some(response)) => {
                if response.created || (response.canceled && response.events.is_empty()) {
                    creates_answered += 1;
                }
            }
            Ok(None) => panic!("the watch stream ended"),
            Err(status) => {
                assert!(TYPED_REFUSALS.contains(&status.code()), "watch: {status:?}");
                return;
            }
        }
    }
}
