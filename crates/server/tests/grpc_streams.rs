//! Watch streams under load and a backend without a leader, over real gRPC
//! on 127.0.0.1.

mod common;

use std::sync::Arc;
use std::time::Duration;

use ferry_server::api::ApiOptions;
use ferry_server::backend::{Backend, LocalBackend, NodeStatus};
use ferry_server::error::ApiError;
use ferry_server::kv_state::{CommandResponse, KvLimits};
use ferry_server::pb::etcdserverpb as pb;
use ferry_server::pb::etcdserverpb::kv_client::KvClient;
use ferry_server::pb::etcdserverpb::lease_client::LeaseClient;
use ferry_server::pb::etcdserverpb::watch_client::WatchClient;
use ferry_server::pb::ferrypb::Command;
use ferry_server::state::{SharedState, StateMachine};
use ferry_server::watch::WatchLimits;
use tokio::sync::{mpsc, oneshot};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Code;

async fn serve<B: Backend>(backend: Arc<B>, options: ApiOptions) -> (Channel, oneshot::Sender<()>) {
    let server = common::start(backend, options).await;
    (common::connect(server.address).await, server.stop)
}

fn put(key: String, value: &str) -> pb::PutRequest {
    pb::PutRequest {
        key: key.into(),
        value: value.to_owned().into(),
        ..Default::default()
    }
}

fn watch_prefix(prefix: &str) -> pb::WatchRequest {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    pb::WatchRequest {
        request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
            pb::WatchCreateRequest {
                key: prefix.into(),
                range_end: end,
                ..Default::default()
            },
        )),
    }
}

/// Reads events until `count` arrived; returns their revisions.
async fn collect_revisions(
    stream: &mut tonic::Streaming<pb::WatchResponse>,
    count: usize,
) -> Vec<i64> {
    let mut revisions = Vec::new();
    while revisions.len() < count {
        let response = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("watch responses keep coming")
            .unwrap()
            .expect("stream open");
        assert!(!response.canceled, "unexpected cancel: {response:?}");
        revisions.extend(
            response
                .events
                .iter()
                .map(|e| e.kv.as_ref().unwrap().mod_revision),
        );
    }
    revisions
}

#[tokio::test]
async fn a_watcher_that_does_not_read_never_blocks_writes_and_misses_nothing() {
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits {
            events_per_watcher_max: 8,
            ..WatchLimits::default()
        },
        "http://127.0.0.1:0".into(),
    ));
    let (channel, _stop) = serve(
        backend.clone(),
        ApiOptions {
            stream_buffer_responses_max: 2,
            ..ApiOptions::default()
        },
    )
    .await;
    let (requests, receiver) = mpsc::channel(4);
    let mut responses = WatchClient::new(channel.clone())
        .watch(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    requests.send(watch_prefix("slow/")).await.unwrap();
    let created = responses.message().await.unwrap().unwrap();
    assert!(created.created);

    // 2000 writes with 2 KiB values (~4 MB of events, far more than the
    // HTTP/2 windows and the watcher's queue) while the client reads nothing.
    let mut kv = KvClient::new(channel.clone());
    let value = "v".repeat(2048);
    let started = std::time::Instant::now();
    for i in 0..2000 {
        tokio::time::timeout(
            Duration::from_secs(5),
            kv.put(put(format!("slow/{}", i % 50), &value)),
        )
        .await
        .expect("a put is never held up by a slow watcher")
        .unwrap();
    }
    assert!(started.elapsed() < Duration::from_secs(60));
    {
        let machine = backend.state().lock();
        let current = machine.kv().store().revision();
        assert_eq!(current, 2001);
        assert_eq!(
            machine.watches.behind_count(current),
            1,
            "the watcher fell behind instead of blocking"
        );
    }

    let revisions = collect_revisions(&mut responses, 2000).await;
    assert_eq!(
        revisions,
        (2..=2001).collect::<Vec<_>>(),
        "in order, no gap, no duplicate"
    );
}

#[tokio::test]
async fn concurrent_writers_and_a_watcher_agree_on_one_order() {
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits::default(),
        "http://127.0.0.1:0".into(),
    ));
    let (channel, _stop) = serve(backend, ApiOptions::default()).await;
    let (requests, receiver) = mpsc::channel(4);
    let mut responses = WatchClient::new(channel.clone())
        .watch(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    requests.send(watch_prefix("c/")).await.unwrap();
    assert!(responses.message().await.unwrap().unwrap().created);
    let mut writers = Vec::new();
    for writer in 0..4 {
        let mut kv = KvClient::new(channel.clone());
        writers.push(tokio::spawn(async move {
            let mut revisions = Vec::new();
            for i in 0..50 {
                let response = kv
                    .put(put(format!("c/{writer}/{i}"), "x"))
                    .await
                    .unwrap()
                    .into_inner();
                revisions.push(response.header.unwrap().revision);
            }
            revisions
        }));
    }
    let mut acknowledged = Vec::new();
    for writer in writers {
        acknowledged.extend(writer.await.unwrap());
    }
    acknowledged.sort_unstable();
    let watched = collect_revisions(&mut responses, 200).await;
    assert_eq!(watched, (2..=201).collect::<Vec<_>>());
    assert_eq!(
        acknowledged, watched,
        "every acknowledged write was seen once, in order"
    );
}

/// A backend whose node knows no leader: writes and linearizable reads
/// must fail with etcd's error, serializable reads still work.
struct Leaderless {
    state: SharedState,
}

impl Backend for Leaderless {
    fn state(&self) -> &SharedState {
        &self.state
    }
    async fn propose(&self, _command: Command) -> Result<CommandResponse, ApiError> {
        Err(ApiError::NoLeader)
    }
    async fn read_index(&self) -> Result<(), ApiError> {
        Err(ApiError::NoLeader)
    }
    async fn lease_keep_alive(&self, _id: i64) -> Result<Option<i64>, ApiError> {
        Err(ApiError::NoLeader)
    }
    async fn lease_time_to_live(&self, _id: i64) -> Result<Option<i64>, ApiError> {
        Err(ApiError::Timeout)
    }
    async fn member_list(&self) -> Result<Vec<pb::Member>, ApiError> {
        Err(ApiError::NoLeader)
    }
    async fn member_add(
        &self,
        _peer_urls: Vec<String>,
        _is_learner: bool,
    ) -> Result<(pb::Member, Vec<pb::Member>), ApiError> {
        Err(ApiError::NoLeader)
    }
    async fn member_remove(&self, _id: u64) -> Result<Vec<pb::Member>, ApiError> {
        Err(ApiError::NoLeader)
    }
    async fn member_promote(&self, _id: u64) -> Result<Vec<pb::Member>, ApiError> {
        Err(ApiError::NoLeader)
    }
    fn status(&self) -> NodeStatus {
        NodeStatus {
            cluster_id: 9,
            member_id: 3,
            raft_term: 7,
            ..NodeStatus::default()
        }
    }
}

#[tokio::test]
async fn without_a_leader_every_call_gets_a_definite_answer() {
    let mut machine = StateMachine::new(KvLimits::default(), WatchLimits::default());
    let seed = ferry_server::command::command(ferry_server::command::CommandKind::Put(put(
        "local".into(),
        "1",
    )));
    assert!(machine.apply(1, &seed).response.is_ok());
    let backend = Arc::new(Leaderless {
        state: SharedState::new(machine),
    });
    let (channel, _stop) = serve(backend, ApiOptions::default()).await;
    let mut kv = KvClient::new(channel.clone());
    let status = kv.put(put("k".into(), "v")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(status.message(), "etcdserver: no leader");
    let status = kv
        .range(pb::RangeRequest {
            key: "local".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.message(), "etcdserver: no leader");
    let local = kv
        .range(pb::RangeRequest {
            key: "local".into(),
            serializable: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(local.kvs[0].value, &b"1"[..]);
    let header = local.header.unwrap();
    assert_eq!(
        (
            header.cluster_id,
            header.member_id,
            header.raft_term,
            header.revision
        ),
        (9, 3, 7, 2)
    );
    // Refusals that need no leader come first and keep etcd's message.
    let status = kv.put(put(String::new(), "v")).await.unwrap_err();
    assert_eq!(status.message(), "etcdserver: key is not provided");
    let mut lease = LeaseClient::new(channel.clone());
    let status = lease
        .lease_time_to_live(pb::LeaseTimeToLiveRequest { id: 1, keys: false })
        .await
        .unwrap_err();
    assert_eq!(status.message(), "etcdserver: request timed out");
    // A keep-alive stream ends with the error instead of hanging.
    let (keepalives, receiver) = mpsc::channel(1);
    let mut answers = lease
        .lease_keep_alive(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    keepalives
        .send(pb::LeaseKeepAliveRequest { id: 1 })
        .await
        .unwrap();
    let status = answers.message().await.unwrap_err();
    assert_eq!(status.message(), "etcdserver: no leader");
}

#[tokio::test]
async fn shutdown_ends_open_streams_instead_of_waiting_on_them() {
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits::default(),
        "http://127.0.0.1:0".into(),
    ));
    let common::TestServer {
        address,
        task: server,
        stop,
    } = common::start(backend, ApiOptions::default()).await;
    let channel = common::connect(address).await;
    let (requests, receiver) = mpsc::channel(4);
    let mut responses = WatchClient::new(channel.clone())
        .watch(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    requests.send(watch_prefix("s/")).await.unwrap();
    assert!(responses.message().await.unwrap().unwrap().created);
    let (keepalives, keepalive_receiver) = mpsc::channel::<pb::LeaseKeepAliveRequest>(1);
    let _answers = LeaseClient::new(channel.clone())
        .lease_keep_alive(ReceiverStream::new(keepalive_receiver))
        .await
        .unwrap();
    stop.send(()).unwrap();
    let finished = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(
        matches!(finished, Ok(Ok(()))),
        "the server stops although clients keep streams open: {finished:?}"
    );
    let end = tokio::time::timeout(Duration::from_secs(5), responses.message())
        .await
        .expect("the watch stream ends");
    assert!(
        !matches!(end, Ok(Some(_))),
        "no more watch responses: {end:?}"
    );
    drop(requests);
    drop(keepalives);
}

#[tokio::test]
async fn too_many_watch_streams_get_resource_exhausted_and_many_requests_stay_answered() {
    let backend = Arc::new(LocalBackend::new(
        KvLimits::default(),
        WatchLimits {
            streams_max: 1,
            ..WatchLimits::default()
        },
        "http://127.0.0.1:0".into(),
    ));
    let (channel, _stop) = serve(backend, ApiOptions::default()).await;
    let (requests, receiver) = mpsc::channel(1024);
    let mut responses = WatchClient::new(channel.clone())
        .watch(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    // 300 creates and cancels sent without reading a single answer.
    for id in 1..=300i64 {
        requests
            .send(pb::WatchRequest {
                request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
                    pb::WatchCreateRequest {
                        key: "k".into(),
                        watch_id: id,
                        ..Default::default()
                    },
                )),
            })
            .await
            .unwrap();
        requests
            .send(pb::WatchRequest {
                request_union: Some(pb::watch_request::RequestUnion::CancelRequest(
                    pb::WatchCancelRequest { watch_id: id },
                )),
            })
            .await
            .unwrap();
    }
    let mut created = 0;
    let mut cancelled = 0;
    while created < 300 || cancelled < 300 {
        let response = tokio::time::timeout(Duration::from_secs(5), responses.message())
            .await
            .expect("every request is answered")
            .unwrap()
            .unwrap();
        if response.created {
            created += 1;
        }
        if response.canceled {
            cancelled += 1;
        }
    }
    // The node allows one watch stream; a second one is refused.
    let (_second_requests, second_receiver) = mpsc::channel::<pb::WatchRequest>(1);
    let refused = WatchClient::new(channel.clone())
        .watch(ReceiverStream::new(second_receiver))
        .await;
    let status = match refused {
        Err(status) => status,
        Ok(response) => {
            // tonic may report the status on the first read instead.
            response.into_inner().message().await.unwrap_err()
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("too many watch streams"));
}
