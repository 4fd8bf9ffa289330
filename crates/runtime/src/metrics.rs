//! What a host measures as it runs, for an embedder to export.
//!
//! The host keeps these as it goes (each costs an atomic add, or a short
//! lock for a histogram) in [`HostMetrics`], read with
//! [`crate::NodeHost::metrics`]; the embedder registers them under the names
//! it wants in a [`prometheus_client`] registry (ferry's etcd server uses
//! etcd's names). What is cheaper to read when asked than to keep up to
//! date, the host and its groups report on demand:
//! [`crate::NodeHost::queue_depths`] and [`crate::GroupHandle::progress`].

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

use ferry_raft::{Index, NodeId, Role};

/// The label set of a measure taken per peer node: `To` and the peer's id
/// in hexadecimal, as etcd labels its peer round trips.
pub type PeerLabel = [(&'static str, String); 1];

/// The label of peer `id`.
pub fn peer_label(id: NodeId) -> PeerLabel {
    [("To", format!("{id:x}"))]
}

/// A histogram per peer node.
pub type PeerHistograms = Family<PeerLabel, Histogram, fn() -> Histogram>;

/// Disk latencies: 1 ms to about 8 s, doubling (etcd's buckets for its
/// fsync and backend commit histograms).
pub fn disk_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 14))
}

/// Network round trips: 100 µs to about 3.3 s, doubling (etcd's buckets).
fn round_trip_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

/// What a host measured since it started.
#[derive(Debug)]
pub struct HostMetrics {
    /// How long each sync of the shared log took, in seconds (one sync
    /// makes every group's writes since the last one durable).
    pub log_sync_seconds: Histogram,
    /// How long each local snapshot of a group's machine took to write
    /// and make durable, in seconds.
    pub snapshot_write_seconds: Histogram,
    /// Round trips to each peer node, in seconds: a ping the host sends
    /// every [`PING_INTERVAL_TICKS`] ticks over the link every group
    /// shares, so a round trip includes the time the ping waited behind
    /// the groups' messages on both sides.
    pub peer_round_trip_seconds: PeerHistograms,
    /// Snapshot transfers this node began to send to followers (a transfer
    /// started over counts again).
    pub snapshots_sent: Counter,
    /// Snapshots this node received from a leader and installed.
    pub snapshots_received: Counter,
    /// How many times a group on this node learned of a new leader
    /// (etcd's leader changes seen).
    pub leader_changes: Counter,
    /// Proposals made through a group handle that failed (no leader, a
    /// timeout, the group stopped, ...) or whose caller stopped waiting.
    pub proposals_failed: Counter,
    /// Proposals made through group handles and not answered yet.
    pub proposals_pending: Gauge,
    /// Read index rounds asked of the engine for linearizable read
    /// barriers through group handles; one answers every caller that was
    /// waiting when it started (compare with the reads served).
    pub read_rounds: Counter,
}

impl Default for HostMetrics {
    fn default() -> Self {
        HostMetrics {
            log_sync_seconds: disk_histogram(),
            snapshot_write_seconds: disk_histogram(),
            peer_round_trip_seconds: Family::new_with_constructor(round_trip_histogram),
            snapshots_sent: Counter::default(),
            snapshots_received: Counter::default(),
            leader_changes: Counter::default(),
            proposals_failed: Counter::default(),
            proposals_pending: Gauge::default(),
            read_rounds: Counter::default(),
        }
    }
}

/// How many messages wait in the host's queues now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueDepths {
    /// Storage requests waiting for the log task.
    pub log_requests: usize,
    /// Inputs waiting for the workers (peer messages, calls), all workers.
    pub worker_inputs: usize,
    /// Frames received from peers waiting for the router.
    pub transport_events: usize,
    /// Frames waiting to be written to each peer node.
    pub peer_frames: BTreeMap<NodeId, usize>,
    /// Bytes held for frames from peers (the inbound budget in use).
    pub inbound_buffered_bytes: usize,
}

/// A group's replication as this node sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupProgress {
    /// This node's role.
    pub role: Role,
    /// Its last log index.
    pub last_index: Index,
    /// Requests the engine holds: this node's own and, on a leader, reads
    /// that followers forwarded, waiting for a leader or a quorum.
    pub engine_requests: usize,
    /// Calls through this node's group handles waiting for their answer:
    /// held by the engine, in the log waiting to apply, or reads waiting
    /// for this node to apply up to their index.
    pub callers_waiting: usize,
    /// On a leader, the index each peer's log is known to match the
    /// leader's up to; empty on other roles.
    pub match_index: BTreeMap<NodeId, Index>,
}

impl GroupProgress {
    /// How many entries each peer is behind the leader's log (leader only).
    pub fn lag_entries(&self) -> BTreeMap<NodeId, u64> {
        self.match_index
            .iter()
            .map(|(peer, matched)| (*peer, self.last_index.saturating_sub(*matched)))
            .collect()
    }
}

/// Ticks between two pings of each peer for its round trip.
pub const PING_INTERVAL_TICKS: u64 = 10;

/// The pings in flight, one per peer: a pong counts only if it echoes the
/// last ping sent to that peer, so a peer cannot make up round trips.
#[derive(Debug)]
pub(crate) struct RoundTrips {
    origin: Instant,
    in_flight: Mutex<BTreeMap<NodeId, u64>>,
}

impl RoundTrips {
    pub(crate) fn new() -> RoundTrips {
        RoundTrips {
            origin: Instant::now(),
            in_flight: Mutex::new(BTreeMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, u64>> {
        self.in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The stamp of a ping to `peer` sent now (never 0), remembered.
    pub(crate) fn ping(&self, peer: NodeId) -> u64 {
        let stamp = self.stamp_now();
        self.lock().insert(peer, stamp);
        stamp
    }

    /// A pong from `peer` echoing `stamp`: the round trip, if it answers
    /// the ping in flight to that peer.
    pub(crate) fn pong(&self, peer: NodeId, stamp: u64) -> Option<Duration> {
        let mut in_flight = self.lock();
        if in_flight.get(&peer) != Some(&stamp) {
            return None;
        }
        in_flight.remove(&peer);
        drop(in_flight);
        Some(Duration::from_nanos(self.stamp_now().saturating_sub(stamp)))
    }

    fn stamp_now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_pong_that_echoes_the_ping_in_flight_counts() {
        let trips = RoundTrips::new();
        let stamp = trips.ping(2);
        assert_ne!(stamp, 0);
        assert_eq!(trips.pong(3, stamp), None, "another peer's");
        assert_eq!(
            trips.pong(2, stamp.wrapping_add(1)),
            None,
            "a made-up stamp"
        );
        assert!(trips.pong(2, stamp).is_some());
        assert_eq!(trips.pong(2, stamp), None, "answered once");
    }

    #[test]
    fn a_newer_ping_replaces_the_one_in_flight() {
        let trips = RoundTrips::new();
        let old = trips.ping(2);
        let new = loop {
            let new = trips.ping(2);
            if new != old {
                break new;
            }
        };
        assert_eq!(trips.pong(2, old), None);
        assert!(trips.pong(2, new).is_some());
    }

    #[test]
    fn lag_is_how_far_each_peer_is_behind_the_last_index() {
        let progress = GroupProgress {
            role: Role::Leader,
            last_index: 10,
            engine_requests: 0,
            callers_waiting: 0,
            match_index: [(2, 10), (3, 4), (4, 12)].into(),
        };
        assert_eq!(progress.lag_entries(), [(2, 0), (3, 6), (4, 0)].into());
    }
}
