//! The metrics port (`--listen-metrics`): Prometheus metrics under etcd's
//! names where the meaning is the same, ferry's own under `ferry_`, and
//! etcd's health endpoints.
//!
//! - [`grpc`]: call counts of the client API by method and code.
//! - [`health`]: `/health`, `/livez` and `/readyz`.
//! - the HTTP/1.1 server itself ([`serve_metrics`]), bounded as the client
//!   and peer ports are.
//!
//! What the runtime measures as it goes (sync and snapshot latencies,
//! round trips, leader changes, proposals, snapshot transfers) is kept in
//! its [`ferry_runtime::HostMetrics`]; what is cheaper to read when asked
//! (role, commit index, queue depths, each follower's lag, the store's
//! size) is read at each scrape.

pub mod grpc;
pub mod health;
mod http;

pub use http::{serve_metrics, MetricsListener, MetricsOptions};

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferry_raft::Role;
use ferry_runtime::metrics::{peer_label, PeerLabel};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

use crate::backend::{Backend, NodeStatus};
use crate::error::ApiError;
use crate::node::RaftBackend;
use crate::pb::etcdserverpb::AlarmType;
use grpc::GrpcMetrics;

/// The `Content-Type` of the exposition (Prometheus' text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// How long a scrape waits for the group's replication figures; past it
/// they are left out of that scrape (its worker is busy).
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(1);

/// How often a health check's read looks whether the leader is gone.
const LEADER_POLL_INTERVAL: Duration = Duration::from_millis(20);

/// What the metrics port reads from a running node.
#[derive(Debug, Clone)]
pub struct NodeMetrics {
    backend: Arc<RaftBackend>,
    grpc: Arc<GrpcMetrics>,
}

impl NodeMetrics {
    /// The metrics of the node behind `backend`, with its API's call
    /// counts.
    pub fn new(backend: Arc<RaftBackend>, grpc: Arc<GrpcMetrics>) -> NodeMetrics {
        NodeMetrics { backend, grpc }
    }

    /// Every metric, in Prometheus' text format.
    pub async fn exposition(&self) -> String {
        let progress = tokio::time::timeout(PROGRESS_TIMEOUT, self.backend.group().progress())
            .await
            .ok()
            .and_then(Result::ok);
        let registry = self.registry(progress);
        let mut text = String::new();
        if let Err(error) =
            prometheus_client::encoding::prometheus_text::encode(&mut text, &registry)
        {
            tracing::warn!(%error, "cannot encode the metrics");
        }
        text
    }

    /// A registry of everything, as it is now (built for each scrape: the
    /// long-lived metrics are shared, the rest are read now).
    fn registry(&self, progress: Option<ferry_runtime::GroupProgress>) -> Registry {
        let host = self.backend.host();
        let runtime = host.metrics();
        let view = self.backend.group().view();
        let mut r = Registry::default();

        // etcd's server metrics.
        let gauge = |value: bool| ConstGauge::new(i64::from(value));
        r.register(
            "etcd_server_has_leader",
            "Whether or not a leader exists. 1 is existence, 0 is not",
            gauge(view.leader.is_some()),
        );
        r.register(
            "etcd_server_is_leader",
            "Whether or not this member is a leader. 1 if is, 0 otherwise",
            gauge(view.role == Role::Leader),
        );
        r.register(
            "etcd_server_is_learner",
            "Whether or not this member is a learner. 1 if is, 0 otherwise",
            gauge(view.role == Role::Learner),
        );
        r.register(
            "etcd_server_leader_changes_seen",
            "The number of leader changes seen",
            runtime.leader_changes.clone(),
        );
        r.register(
            "etcd_server_proposals_committed_total",
            "The total number of consensus proposals committed (the commit index)",
            ConstGauge::new(as_i64(view.commit)),
        );
        r.register(
            "etcd_server_proposals_applied_total",
            "The total number of consensus proposals applied (the applied index)",
            ConstGauge::new(as_i64(view.applied)),
        );
        r.register(
            "etcd_server_proposals_pending",
            "The current number of pending proposals to commit",
            runtime.proposals_pending.clone(),
        );
        r.register(
            "etcd_server_proposals_failed",
            "The total number of failed proposals seen",
            runtime.proposals_failed.clone(),
        );
        r.register(
            "ferry_server_read_index_rounds",
            "Read index rounds run for linearizable reads; one serves every read waiting when it starts",
            runtime.read_rounds.clone(),
        );

        // Disk and network.
        r.register(
            "etcd_disk_wal_fsync_duration_seconds",
            "The latency distributions of fsync called by WAL (ferry: each sync of the log all groups share)",
            runtime.log_sync_seconds.clone(),
        );
        let store_jobs = self.backend.state().store_jobs();
        if self.backend.kv_on_disk() {
            r.register(
                "etcd_disk_backend_commit_duration_seconds",
                "The latency distributions of commit called by backend (ferry: each flush of the key-value store, from its run file to its manifest on disk)",
                store_jobs.flush_seconds.clone(),
            );
            r.register(
                "ferry_kv_store_merge_duration_seconds",
                "Merges of the key-value store's runs, from the new run file to its manifest on disk",
                store_jobs.merge_seconds.clone(),
            );
        } else {
            r.register(
                "etcd_disk_backend_commit_duration_seconds",
                "The latency distributions of commit called by backend (ferry: each snapshot of the key-value state written and synced)",
                runtime.snapshot_write_seconds.clone(),
            );
        }
        r.register(
            "etcd_network_peer_round_trip_time_seconds",
            "Round-Trip-Time histogram between peers (ferry: a ping over the link the groups share)",
            runtime.peer_round_trip_seconds.clone(),
        );

        // The store and its watchers.
        let (db_bytes, store, watchers, behind, queued_bytes, catch_ups) = {
            let state = self.backend.state().lock();
            let store = state.kv().store();
            let watches = &state.watches;
            (
                store.size_bytes(),
                store.store_stats(),
                watches.watcher_count(),
                watches.behind_count(store.revision()),
                watches.queued_bytes(),
                watches.catch_ups(),
            )
        };
        r.register(
            "etcd_debugging_mvcc_watcher_total",
            "Total number of watchers (ferry: on this member's watch streams)",
            ConstGauge::new(as_i64(watchers as u64)),
        );
        r.register(
            "etcd_debugging_mvcc_slow_watcher_total",
            "Total number of unsynced slow watchers (ferry: watchers behind the store, catching up from history)",
            ConstGauge::new(as_i64(behind as u64)),
        );
        r.register(
            "ferry_watch_queued_bytes",
            "Bytes of events queued for this member's watchers",
            ConstGauge::new(as_i64(queued_bytes as u64)),
        );
        r.register(
            "ferry_watch_catch_ups_from_recent",
            "Catch-ups of watchers that fell behind, served from the ring of recent revisions",
            ConstCounter::new(catch_ups.0),
        );
        r.register(
            "ferry_watch_catch_ups_from_store",
            "Catch-ups of watchers that fell behind, served from the store's history (further behind than the ring holds)",
            ConstCounter::new(catch_ups.1),
        );
        r.register(
            "etcd_mvcc_db_total_size_in_bytes",
            "Total size of the underlying database in bytes (ferry: the MVCC store's size, as Status reports it)",
            ConstGauge::new(as_i64(db_bytes)),
        );
        r.register(
            "ferry_kv_store_memtable_bytes",
            "Bytes of versions written since the key-value store's last checkpoint",
            ConstGauge::new(as_i64(store.memtable_bytes as u64)),
        );
        r.register(
            "ferry_kv_store_frozen_layers",
            "Checkpointed memtables of the key-value store not yet flushed to a run",
            ConstGauge::new(as_i64(store.frozen_layers as u64)),
        );
        r.register(
            "ferry_kv_store_layers",
            "Layers of run files of the key-value store (a read looks into one run of each at most)",
            ConstGauge::new(as_i64(store.layers as u64)),
        );
        r.register(
            "ferry_kv_store_runs",
            "Run files of the key-value store",
            ConstGauge::new(as_i64(store.runs as u64)),
        );
        r.register(
            "ferry_kv_store_run_index_bytes",
            "Bytes of run indexes the key-value store keeps in memory",
            ConstGauge::new(as_i64(store.run_index_bytes as u64)),
        );
        r.register(
            "ferry_kv_store_written_bytes",
            "Bytes the key-value store wrote to run files and manifests since the node started",
            ConstCounter::new(store.written_bytes),
        );

        // The client API.
        r.register(
            "grpc_server_started",
            "Total number of RPCs started on the server",
            self.grpc.started.clone(),
        );
        r.register(
            "grpc_server_handled",
            "Total number of RPCs completed on the server, regardless of success or failure",
            self.grpc.handled.clone(),
        );

        // ferry's own: replication, snapshots, the log and the queues.
        let lag: Family<PeerLabel, Gauge> = Family::default();
        if let Some(progress) = &progress {
            for (peer, behind) in progress.lag_entries() {
                lag.get_or_create(&peer_label(peer)).set(as_i64(behind));
            }
        }
        r.register(
            "ferry_replication_lag_entries",
            "On the leader, how many log entries each follower is behind its last index",
            lag,
        );
        if let Some(progress) = &progress {
            r.register(
                "ferry_engine_requests_pending",
                "Requests the Raft engine holds: this member's own, and reads followers forwarded to it",
                ConstGauge::new(as_i64(progress.engine_requests)),
            );
            r.register(
                "ferry_group_calls_waiting",
                "Calls through this member's group handle waiting for their answer",
                ConstGauge::new(as_i64(progress.callers_waiting)),
            );
        }
        r.register(
            "ferry_snapshot_transfers_sent",
            "Snapshot transfers this member began to send to followers",
            runtime.snapshots_sent.clone(),
        );
        r.register(
            "ferry_snapshot_transfers_received",
            "Snapshots this member received from a leader and installed",
            runtime.snapshots_received.clone(),
        );
        let log = host.log_counters();
        r.register(
            "ferry_log_syncs",
            "Syncs of the log all groups share",
            ConstCounter::new(log.syncs.load(Ordering::Relaxed)),
        );
        r.register(
            "ferry_log_entries_appended",
            "Entries appended to the log",
            ConstCounter::new(log.entries.load(Ordering::Relaxed)),
        );
        r.register(
            "ferry_log_entries_loaded",
            "Entries read back from the log for followers the leader no longer held them in memory for",
            ConstCounter::new(log.entries_loaded.load(Ordering::Relaxed)),
        );
        let queues = host.queue_depths();
        r.register(
            "ferry_log_requests_queued",
            "Storage requests waiting for the log",
            ConstGauge::new(as_i64(queues.log_requests)),
        );
        r.register(
            "ferry_worker_inputs_queued",
            "Peer messages and calls waiting for the workers that run the groups",
            ConstGauge::new(as_i64(queues.worker_inputs)),
        );
        r.register(
            "ferry_peer_events_queued",
            "Frames received from peers waiting to be routed to the groups",
            ConstGauge::new(as_i64(queues.transport_events)),
        );
        r.register(
            "ferry_peer_inbound_buffered_bytes",
            "Bytes held for frames received from peers",
            ConstGauge::new(as_i64(queues.inbound_buffered_bytes)),
        );
        let frames: Family<PeerLabel, Gauge> = Family::default();
        for (peer, queued) in &queues.peer_frames {
            frames
                .get_or_create(&peer_label(*peer))
                .set(as_i64(*queued));
        }
        r.register(
            "ferry_peer_frames_queued",
            "Frames waiting to be written to each peer",
            frames,
        );
        let connected: Family<PeerLabel, Gauge> = Family::default();
        let up = host.connected_peers();
        for peer in host.dialed_peers() {
            connected
                .get_or_create(&peer_label(peer))
                .set(i64::from(up.contains(&peer)));
        }
        r.register(
            "ferry_peer_connected",
            "Whether the link to each peer is up",
            connected,
        );
        r
    }
}

/// A count as a gauge's value.
fn as_i64(value: impl TryInto<i64>) -> i64 {
    value.try_into().unwrap_or(i64::MAX)
}

impl health::Probe for NodeMetrics {
    fn status(&self) -> NodeStatus {
        self.backend.status()
    }

    fn alarms(&self) -> Vec<AlarmType> {
        let alarms = self.backend.state().lock().kv().alarms();
        alarms
            .iter()
            .filter_map(|alarm| AlarmType::try_from(alarm.alarm).ok())
            .collect()
    }

    /// A read barrier, given up at once when this member stops knowing a
    /// leader (as etcd's reads fail when the leader changes), rather than
    /// at the request timeout: a probe should not hang on a member that
    /// has just lost its quorum.
    async fn linearizable_read(&self) -> Result<(), ApiError> {
        let group = self.backend.group();
        let leader_lost = async {
            loop {
                if group.view_with(|view| view.leader.is_none()) {
                    return;
                }
                tokio::time::sleep(LEADER_POLL_INTERVAL).await;
            }
        };
        tokio::select! {
            read = self.backend.read_index() => read,
            () = leader_lost => Err(ApiError::NoLeader),
        }
    }
}
