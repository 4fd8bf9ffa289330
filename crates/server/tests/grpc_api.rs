//! End-to-end tests of the etcd v3 API: a real gRPC server on 127.0.0.1
//! (port 0) over the in-process backend, driven through the client code
//! generated from our .proto files.

mod common;

use std::sync::Arc;
use std::time::Duration;

use ferry_server::api::ApiOptions;
use ferry_server::backend::LocalBackend;
use ferry_server::kv_state::KvLimits;
use ferry_server::pb::etcdserverpb as pb;
use ferry_server::pb::etcdserverpb::cluster_client::ClusterClient;
use ferry_server::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::lease_client::LeaseClient;
use ferry_server::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use ferry_server::pb::etcdserverpb::watch_client::WatchClient;
use ferry_server::watch::WatchLimits;
use tokio::sync::{mpsc, oneshot};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Code;

struct Server {
    channel: Channel,
    _stop: oneshot::Sender<()>,
}

impl Server {
    async fn start() -> Server {
        Server::start_with(KvLimits {
            lease_ttl_seconds_min: 1,
            ..KvLimits::default()
        })
        .await
    }

    async fn start_with(limits: KvLimits) -> Server {
        let backend = Arc::new(LocalBackend::new(
            limits,
            WatchLimits::default(),
            "http://127.0.0.1:0".to_string(),
        ));
        backend.spawn_lease_expiry(Duration::from_millis(50));
        let options = ApiOptions {
            progress_notify_interval: Duration::from_millis(300),
            ..ApiOptions::default()
        };
        let server = common::start(backend, options).await;
        Server {
            channel: common::connect(server.address).await,
            _stop: server.stop,
        }
    }

    fn kv(&self) -> KvClient<Channel> {
        KvClient::new(self.channel.clone()).max_decoding_message_size(8 << 20)
    }
    fn watch(&self) -> WatchClient<Channel> {
        WatchClient::new(self.channel.clone())
    }
    fn lease(&self) -> LeaseClient<Channel> {
        LeaseClient::new(self.channel.clone())
    }
}

fn put(key: &str, value: &str) -> pb::PutRequest {
    pb::PutRequest {
        key: key.to_owned().into(),
        value: value.to_owned().into(),
        ..Default::default()
    }
}

fn range(key: &str, range_end: &str) -> pb::RangeRequest {
    pb::RangeRequest {
        key: key.into(),
        range_end: range_end.into(),
        ..Default::default()
    }
}

fn keys(response: &pb::RangeResponse) -> Vec<String> {
    response
        .kvs
        .iter()
        .map(|kv| String::from_utf8(kv.key.to_vec()).unwrap())
        .collect()
}

#[tokio::test]
async fn put_get_range_prefix_revision_delete() {
    let server = Server::start().await;
    let mut kv = server.kv();
    let first = kv
        .put(put("fruit/apple", "red"))
        .await
        .unwrap()
        .into_inner();
    let header = first.header.unwrap();
    assert_eq!(header.revision, 2);
    assert_ne!(header.cluster_id, 0);
    assert_ne!(header.member_id, 0);
    kv.put(put("fruit/banana", "yellow")).await.unwrap();
    kv.put(put("fruit/cherry", "dark")).await.unwrap();
    kv.put(put("veg/carrot", "orange")).await.unwrap();
    let updated = kv
        .put(pb::PutRequest {
            prev_kv: true,
            ..put("fruit/cherry", "red")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(updated.prev_kv.unwrap().value, &b"dark"[..]);

    let one = kv
        .range(range("fruit/cherry", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(one.kvs.len(), 1);
    let cherry = &one.kvs[0];
    assert_eq!(
        (cherry.create_revision, cherry.mod_revision, cherry.version),
        (4, 6, 2)
    );
    assert_eq!(one.header.unwrap().revision, 6);

    let prefix = kv
        .range(range("fruit/", "fruit0"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        keys(&prefix),
        ["fruit/apple", "fruit/banana", "fruit/cherry"]
    );
    let everything = kv.range(range("\0", "\0")).await.unwrap().into_inner();
    assert_eq!(everything.count, 4);

    let limited = kv
        .range(pb::RangeRequest {
            limit: 2,
            sort_order: pb::range_request::SortOrder::Descend as i32,
            ..range("fruit/", "fruit0")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(keys(&limited), ["fruit/cherry", "fruit/banana"]);
    assert!(limited.more);
    assert_eq!(limited.count, 3);

    let serializable = kv
        .range(pb::RangeRequest {
            serializable: true,
            count_only: true,
            ..range("fruit/", "fruit0")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(serializable.count, 3);
    assert!(serializable.kvs.is_empty());

    let old = kv
        .range(pb::RangeRequest {
            revision: 4,
            ..range("fruit/cherry", "")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(old.kvs[0].value, &b"dark"[..]);

    let deleted = kv
        .delete_range(pb::DeleteRangeRequest {
            key: "fruit/".into(),
            range_end: "fruit0".into(),
            prev_kv: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(deleted.deleted, 3);
    assert_eq!(deleted.prev_kvs.len(), 3);
    assert_eq!(deleted.header.unwrap().revision, 7);
    let after = kv.range(range("\0", "\0")).await.unwrap().into_inner();
    assert_eq!(keys(&after), ["veg/carrot"]);
}

#[tokio::test]
async fn errors_are_etcds() {
    let server = Server::start().await;
    let mut kv = server.kv();
    let status = kv.range(range("", "")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "etcdserver: key is not provided");
    let status = kv.put(put("", "v")).await.unwrap_err();
    assert_eq!(status.message(), "etcdserver: key is not provided");

    kv.put(put("k", "1")).await.unwrap();
    kv.put(put("k", "2")).await.unwrap();
    kv.put(put("k", "3")).await.unwrap(); // revision 4
    let status = kv
        .range(pb::RangeRequest {
            revision: 9,
            ..range("k", "")
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange);
    assert_eq!(
        status.message(),
        "etcdserver: mvcc: required revision is a future revision"
    );

    kv.compact(pb::CompactionRequest {
        revision: 3,
        physical: true,
    })
    .await
    .unwrap();
    let status = kv
        .range(pb::RangeRequest {
            revision: 2,
            ..range("k", "")
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange);
    assert_eq!(
        status.message(),
        "etcdserver: mvcc: required revision has been compacted"
    );
    let status = kv
        .compact(pb::CompactionRequest {
            revision: 2,
            physical: false,
        })
        .await
        .unwrap_err();
    assert_eq!(
        status.message(),
        "etcdserver: mvcc: required revision has been compacted"
    );

    let status = kv
        .put(pb::PutRequest {
            lease: 4242,
            ..put("k", "v")
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(status.message(), "etcdserver: requested lease not found");

    // Default limit (1.5 MiB): a 1.6 MiB value passes gRPC and is refused by
    // the size check with etcd's error.
    let big = "x".repeat(1_600_000);
    let status = kv.put(put("big", &big)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "etcdserver: request is too large");
    // Just under the limit is accepted.
    kv.put(put("big", &"x".repeat(1_500_000))).await.unwrap();

    let txn = pb::TxnRequest {
        compare: vec![],
        success: vec![
            pb::RequestOp {
                request: Some(pb::request_op::Request::RequestPut(put("d", "1"))),
            },
            pb::RequestOp {
                request: Some(pb::request_op::Request::RequestPut(put("d", "2"))),
            },
        ],
        failure: vec![],
    };
    let status = kv.txn(txn).await.unwrap_err();
    assert_eq!(
        status.message(),
        "etcdserver: duplicate key given in txn request"
    );
}

#[tokio::test]
async fn configurable_request_limit() {
    let server = Server::start_with(KvLimits {
        request_size_bytes_max: 4096,
        ..KvLimits::default()
    })
    .await;
    let mut kv = server.kv();
    let status = kv.put(put("k", &"x".repeat(5000))).await.unwrap_err();
    assert_eq!(status.message(), "etcdserver: request is too large");
    kv.put(put("k", &"x".repeat(3000))).await.unwrap();
}

#[tokio::test]
async fn txn_with_compares_and_nested_branches() {
    let server = Server::start().await;
    let mut kv = server.kv();
    kv.put(put("account", "100")).await.unwrap(); // 2
    let cas = |expected: &str, new: &str| pb::TxnRequest {
        compare: vec![pb::Compare {
            result: CompareResult::Equal as i32,
            target: CompareTarget::Value as i32,
            key: "account".into(),
            target_union: Some(TargetUnion::Value(expected.into())),
            range_end: vec![],
        }],
        success: vec![
            pb::RequestOp {
                request: Some(pb::request_op::Request::RequestPut(put("account", new))),
            },
            pb::RequestOp {
                request: Some(pb::request_op::Request::RequestTxn(pb::TxnRequest {
                    compare: vec![pb::Compare {
                        result: CompareResult::Equal as i32,
                        target: CompareTarget::Version as i32,
                        key: "audit".into(),
                        target_union: Some(TargetUnion::Version(0)),
                        range_end: vec![],
                    }],
                    success: vec![pb::RequestOp {
                        request: Some(pb::request_op::Request::RequestPut(put("audit", "first"))),
                    }],
                    failure: vec![pb::RequestOp {
                        request: Some(pb::request_op::Request::RequestPut(put("audit", "again"))),
                    }],
                })),
            },
        ],
        failure: vec![pb::RequestOp {
            request: Some(pb::request_op::Request::RequestRange(range("account", ""))),
        }],
    };
    let won = kv.txn(cas("100", "90")).await.unwrap().into_inner();
    assert!(won.succeeded);
    assert_eq!(won.header.unwrap().revision, 3);
    match &won.responses[1].response {
        Some(pb::response_op::Response::ResponseTxn(nested)) => assert!(nested.succeeded),
        other => panic!("unexpected {other:?}"),
    }
    let lost = kv.txn(cas("100", "80")).await.unwrap().into_inner();
    assert!(!lost.succeeded);
    match &lost.responses[0].response {
        Some(pb::response_op::Response::ResponseRange(r)) => assert_eq!(r.kvs[0].value, &b"90"[..]),
        other => panic!("unexpected {other:?}"),
    }
    let again = kv.txn(cas("90", "70")).await.unwrap().into_inner();
    assert!(again.succeeded);
    let audit = kv.range(range("audit", "")).await.unwrap().into_inner();
    assert_eq!(audit.kvs[0].value, &b"again"[..]);
    assert_eq!(audit.kvs[0].version, 2);
}

async fn next(stream: &mut tonic::Streaming<pb::WatchResponse>) -> pb::WatchResponse {
    tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("a watch response within 5 s")
        .unwrap()
        .expect("the stream stays open")
}

fn create(key: &str, range_end: &str, start_revision: i64, prev_kv: bool) -> pb::WatchRequest {
    pb::WatchRequest {
        request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
            pb::WatchCreateRequest {
                key: key.into(),
                range_end: range_end.into(),
                start_revision,
                prev_kv,
                ..Default::default()
            },
        )),
    }
}

#[tokio::test]
async fn watch_key_prefix_history_prev_kv_cancel_and_progress() {
    let server = Server::start().await;
    let mut kv = server.kv();
    kv.put(put("w/a", "1")).await.unwrap(); // 2
    kv.put(put("w/b", "1")).await.unwrap(); // 3

    let (requests, receiver) = mpsc::channel(16);
    let mut responses = server
        .watch()
        .watch(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();

    // A prefix watch from revision 2 replays history, then goes live.
    requests.send(create("w/", "w0", 2, true)).await.unwrap();
    let created = next(&mut responses).await;
    assert!(created.created);
    let prefix_id = created.watch_id;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let r = next(&mut responses).await;
        assert_eq!(r.watch_id, prefix_id);
        seen.extend(r.events);
    }
    assert_eq!(
        seen.iter()
            .map(|e| e.kv.as_ref().unwrap().mod_revision)
            .collect::<Vec<_>>(),
        vec![2, 3]
    );

    // A key watch from now.
    requests.send(create("w/a", "", 0, false)).await.unwrap();
    let created = next(&mut responses).await;
    assert!(created.created);
    let key_id = created.watch_id;
    assert_ne!(key_id, prefix_id);

    kv.put(put("w/a", "2")).await.unwrap(); // 4
    kv.delete_range(pb::DeleteRangeRequest {
        key: "w/a".into(),
        range_end: vec![],
        prev_kv: false,
    })
    .await
    .unwrap(); // 5
    let mut prefix_events = Vec::new();
    let mut key_events = Vec::new();
    while prefix_events.len() < 2 || key_events.len() < 2 {
        let r = next(&mut responses).await;
        if r.watch_id == prefix_id {
            prefix_events.extend(r.events);
        } else if r.watch_id == key_id {
            key_events.extend(r.events);
        } else {
            panic!("unexpected response {r:?}");
        }
    }
    assert_eq!(
        prefix_events[0].prev_kv.as_ref().unwrap().value,
        &b"1"[..],
        "prev_kv asked"
    );
    assert_eq!(prefix_events[1].r#type, 1, "a delete");
    assert_eq!(prefix_events[1].prev_kv.as_ref().unwrap().value, &b"2"[..]);
    assert!(key_events[0].prev_kv.is_none(), "prev_kv not asked");
    assert_eq!(
        key_events
            .iter()
            .map(|e| e.kv.as_ref().unwrap().mod_revision)
            .collect::<Vec<_>>(),
        vec![4, 5]
    );

    // Progress on request: whole-stream id -1, the current revision.
    requests
        .send(pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::ProgressRequest(
                pb::WatchProgressRequest {},
            )),
        })
        .await
        .unwrap();
    let progress = next(&mut responses).await;
    assert_eq!(progress.watch_id, -1);
    assert_eq!(progress.header.unwrap().revision, 5);
    assert!(progress.events.is_empty());

    // Cancel the key watch: a cancel response, then nothing more for it.
    requests
        .send(pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CancelRequest(
                pb::WatchCancelRequest { watch_id: key_id },
            )),
        })
        .await
        .unwrap();
    let cancelled = next(&mut responses).await;
    assert!(cancelled.canceled);
    assert_eq!(cancelled.watch_id, key_id);
    kv.put(put("w/a", "3")).await.unwrap(); // 6
    let r = next(&mut responses).await;
    assert_eq!(
        r.watch_id, prefix_id,
        "only the remaining watch sees revision 6"
    );
    assert_eq!(r.events[0].kv.as_ref().unwrap().mod_revision, 6);
}

#[tokio::test]
async fn watch_compacted_start_and_periodic_progress() {
    let server = Server::start().await;
    let mut kv = server.kv();
    for i in 0..4 {
        kv.put(put("c", &i.to_string())).await.unwrap(); // 2..=5
    }
    kv.compact(pb::CompactionRequest {
        revision: 4,
        physical: false,
    })
    .await
    .unwrap();
    let (requests, receiver) = mpsc::channel(16);
    let mut responses = server
        .watch()
        .watch(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    requests.send(create("c", "", 2, false)).await.unwrap();
    assert!(next(&mut responses).await.created);
    let cancelled = next(&mut responses).await;
    assert!(cancelled.canceled);
    assert_eq!(cancelled.compact_revision, 4);
    assert_eq!(
        cancelled.cancel_reason,
        "etcdserver: mvcc: required revision has been compacted"
    );

    requests
        .send(pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
                pb::WatchCreateRequest {
                    key: "idle".into(),
                    progress_notify: true,
                    ..Default::default()
                },
            )),
        })
        .await
        .unwrap();
    let created = next(&mut responses).await;
    assert!(created.created);
    // The server was started with a 300 ms progress period.
    let progress = next(&mut responses).await;
    assert_eq!(progress.watch_id, created.watch_id);
    assert!(progress.events.is_empty());
    assert_eq!(progress.header.unwrap().revision, 5);
}

#[tokio::test]
async fn lease_grant_keepalive_ttl_revoke_and_expiry() {
    let server = Server::start().await;
    let mut kv = server.kv();
    let mut lease = server.lease();
    let granted = lease
        .lease_grant(pb::LeaseGrantRequest { ttl: 30, id: 0 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(granted.ttl, 30);
    let id = granted.id;
    assert_ne!(id, 0);
    kv.put(pb::PutRequest {
        lease: id,
        ..put("session/a", "1")
    })
    .await
    .unwrap();
    kv.put(pb::PutRequest {
        lease: id,
        ..put("session/b", "1")
    })
    .await
    .unwrap();

    let ttl = lease
        .lease_time_to_live(pb::LeaseTimeToLiveRequest { id, keys: true })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ttl.granted_ttl, 30);
    assert!(ttl.ttl > 25 && ttl.ttl <= 30, "ttl {}", ttl.ttl);
    assert_eq!(ttl.keys, vec![b"session/a".to_vec(), b"session/b".to_vec()]);

    let (keepalives, receiver) = mpsc::channel(4);
    let mut answers = lease
        .lease_keep_alive(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    keepalives
        .send(pb::LeaseKeepAliveRequest { id })
        .await
        .unwrap();
    let answer = answers.message().await.unwrap().unwrap();
    assert_eq!((answer.id, answer.ttl), (id, 30));
    keepalives
        .send(pb::LeaseKeepAliveRequest { id: 999_999 })
        .await
        .unwrap();
    let answer = answers.message().await.unwrap().unwrap();
    assert_eq!(answer.ttl, 0, "unknown lease: TTL 0");

    let listed = lease
        .lease_leases(pb::LeaseLeasesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.leases.iter().map(|l| l.id).collect::<Vec<_>>(),
        vec![id]
    );

    lease
        .lease_revoke(pb::LeaseRevokeRequest { id })
        .await
        .unwrap();
    let after = kv
        .range(range("session/", "session0"))
        .await
        .unwrap()
        .into_inner();
    assert!(after.kvs.is_empty(), "revoking deletes attached keys");
    let status = lease
        .lease_revoke(pb::LeaseRevokeRequest { id })
        .await
        .unwrap_err();
    assert_eq!(status.message(), "etcdserver: requested lease not found");
    let gone = lease
        .lease_time_to_live(pb::LeaseTimeToLiveRequest { id, keys: false })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gone.ttl, -1);

    // Expiry on the leader's clock: a 1 s lease nobody renews.
    let short = lease
        .lease_grant(pb::LeaseGrantRequest { ttl: 1, id: 0 })
        .await
        .unwrap()
        .into_inner();
    kv.put(pb::PutRequest {
        lease: short.id,
        ..put("ephemeral", "1")
    })
    .await
    .unwrap();
    // A renewed lease with the same TTL survives the same wait.
    let kept = lease
        .lease_grant(pb::LeaseGrantRequest { ttl: 1, id: 0 })
        .await
        .unwrap()
        .into_inner();
    kv.put(pb::PutRequest {
        lease: kept.id,
        ..put("renewed", "1")
    })
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        keepalives
            .send(pb::LeaseKeepAliveRequest { id: kept.id })
            .await
            .unwrap();
        assert_eq!(answers.message().await.unwrap().unwrap().ttl, 1);
        let left = kv.range(range("ephemeral", "")).await.unwrap().into_inner();
        if left.kvs.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease did not expire in 5 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let renewed = kv.range(range("renewed", "")).await.unwrap().into_inner();
    assert_eq!(renewed.kvs.len(), 1, "kept alive");
    let expired = lease
        .lease_time_to_live(pb::LeaseTimeToLiveRequest {
            id: short.id,
            keys: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expired.ttl, -1);
}

#[tokio::test]
async fn cluster_maintenance_and_unsupported_calls() {
    let server = Server::start().await;
    let mut cluster = ClusterClient::new(server.channel.clone());
    let members = cluster
        .member_list(pb::MemberListRequest { linearizable: true })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(members.members.len(), 1);
    let me = members.members[0].id;
    let status = cluster
        .member_promote(pb::MemberPromoteRequest { id: me })
        .await
        .unwrap_err();
    assert_eq!(
        status.message(),
        "etcdserver: can only promote a learner member"
    );
    let status = cluster
        .member_remove(pb::MemberRemoveRequest { id: me + 1 })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(status.message(), "etcdserver: member not found");
    let status = cluster
        .member_update(pb::MemberUpdateRequest {
            id: me,
            peer_ur_ls: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    assert!(
        status.message().contains("not supported"),
        "{}",
        status.message()
    );

    server.kv().put(put("a", "1")).await.unwrap();
    let mut maintenance = MaintenanceClient::new(server.channel.clone());
    let status = maintenance
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.leader, me);
    assert_eq!(status.raft_index, 1);
    assert!(status.raft_term >= 1);
    assert!(status.db_size > 0);
    assert_eq!(status.header.unwrap().revision, 2);
    assert!(!status.version.is_empty());
    let hashed = maintenance
        .hash_kv(pb::HashKvRequest { revision: 0 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(hashed.hash_revision, 2);
    assert_ne!(hashed.hash, 0);
    let alarms = maintenance
        .alarm(pb::AlarmRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(alarms.alarms.is_empty());
    // Hash covers the whole state: the same twice, another after a write.
    let hash = |maintenance: &mut MaintenanceClient<tonic::transport::Channel>| {
        let mut maintenance = maintenance.clone();
        async move {
            maintenance
                .hash(pb::HashRequest {})
                .await
                .unwrap()
                .into_inner()
        }
    };
    let first = hash(&mut maintenance).await;
    assert_eq!(first.header.as_ref().unwrap().revision, 2);
    assert_eq!(hash(&mut maintenance).await.hash, first.hash);
    server.kv().put(put("b", "2")).await.unwrap();
    let second = hash(&mut maintenance).await;
    assert_ne!(second.hash, first.hash);
    assert_eq!(second.header.unwrap().revision, 3);
    // Nothing to defragment: the call succeeds, as etcd's does.
    let defragmented = maintenance
        .defragment(pb::DefragmentRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(defragmented.header.unwrap().revision, 3);
    // MoveLeader on a single member: to itself it changes nothing; no one
    // else can lead.
    maintenance
        .move_leader(pb::MoveLeaderRequest { target_id: me })
        .await
        .unwrap();
    let status = maintenance
        .move_leader(pb::MoveLeaderRequest { target_id: me + 1 })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(status.message(), "etcdserver: bad leader transferee");

    // Auth answers (tests/grpc_auth.rs tests it whole): no users yet.
    let mut auth =
        ferry_server::pb::etcdserverpb::auth_client::AuthClient::new(server.channel.clone());
    let users = auth
        .user_list(pb::AuthUserListRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(users.users.is_empty());
    // A service nobody defines answers Unimplemented too.
    let mut grpc = tonic::client::Grpc::new(server.channel.clone());
    grpc.ready().await.unwrap();
    let path =
        tonic::codegen::http::uri::PathAndQuery::from_static("/etcdserverpb.Nonexistent/Call");
    let result: Result<tonic::Response<pb::StatusResponse>, tonic::Status> = grpc
        .unary(
            tonic::Request::new(pb::StatusRequest {}),
            path,
            tonic_prost::ProstCodec::default(),
        )
        .await;
    assert_eq!(result.unwrap_err().code(), Code::Unimplemented);
}

/// A server over a local backend, and an HTTP/2 connection to it spoken
/// directly (no gRPC client in between).
async fn raw_http2_to_a_local_server() -> (
    common::TestServer,
    h2::client::SendRequest<bytes::Bytes>,
    h2::client::Connection<tokio::net::TcpStream>,
) {
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits::default(),
        "http://127.0.0.1:0".to_string(),
    ));
    let server = common::start(backend, ApiOptions::default()).await;
    let tcp = tokio::net::TcpStream::connect(server.address)
        .await
        .unwrap();
    let (calls, connection) = h2::client::handshake(tcp).await.unwrap();
    (server, calls, connection)
}

/// A client connection may have at most `STREAMS_PER_CONNECTION_MAX`
/// calls open at once: the server says so in its HTTP/2 settings (gRPC
/// clients then queue their calls past it), and a call on a connection
/// still answers as before.
#[tokio::test]
async fn a_connection_is_told_how_many_calls_it_may_have_open() {
    let (server, mut calls, connection) = raw_http2_to_a_local_server().await;
    let mut connection = std::pin::pin!(connection);
    // A call to a service nobody defines: its answer comes after the
    // server's settings, and says Unimplemented in its headers.
    let request = http::Request::builder()
        .method("POST")
        .uri(format!(
            "http://{}/etcdserverpb.Nonexistent/Call",
            server.address
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, _) = calls.send_request(request, true).unwrap();
    let mut response = std::pin::pin!(response);
    let response = tokio::select! {
        response = &mut response => response.unwrap(),
        ended = &mut connection => panic!("the connection ended first: {ended:?}"),
    };
    assert_eq!(
        response.headers().get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"12"[..]),
        "{response:?}"
    );
    assert_eq!(
        connection.max_concurrent_send_streams(),
        ferry_server::api::grpc_server::STREAMS_PER_CONNECTION_MAX as usize
    );
}

/// A unary call is answered once its one message is in, before the client
/// ends its side of the stream (clients built on tonic end it in a frame
/// of their own after the message's; Go's end it on the message's frame).
#[tokio::test]
async fn a_unary_call_is_answered_before_the_client_ends_its_request() {
    let (server, calls, connection) = raw_http2_to_a_local_server().await;
    tokio::spawn(connection);
    let mut calls = calls.ready().await.unwrap();
    let put = pb::PutRequest {
        key: b"early".to_vec().into(),
        value: b"answer".to_vec().into(),
        ..Default::default()
    };
    let message = prost::Message::encode_to_vec(&put);
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&message);
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{}/etcdserverpb.KV/Put", server.address))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut body) = calls.send_request(request, false).unwrap();
    // The message, and no end of stream: it never comes.
    body.send_data(framed.into(), false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("answered without the end of the request")
        .unwrap();
    assert_eq!(response.status(), http::StatusCode::OK);
    let mut answer = response.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = answer.data().await {
        data.extend_from_slice(&chunk.unwrap());
    }
    let trailers = answer.trailers().await.unwrap().expect("trailers");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"0"[..]),
        "{trailers:?}"
    );
    let reply: pb::PutResponse = prost::Message::decode(&data[5..]).unwrap();
    assert!(reply.header.is_some_and(|header| header.revision == 2));
    // The put took effect.
    let mut kv = KvClient::new(common::connect(server.address).await);
    let range = kv
        .range(pb::RangeRequest {
            key: b"early".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(range.kvs.len(), 1);
    assert_eq!(&range.kvs[0].value[..], b"answer");
}
