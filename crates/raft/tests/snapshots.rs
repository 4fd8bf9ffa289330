//! Snapshot transfer: compaction, chunks with flow control, loss, restart.

use ferry_raft::testing::{test_options, Cluster};
use ferry_raft::{Input, MessageBody, Response, SnapshotOutcome};

/// Leader, lagging follower and the index a snapshot was taken at, with the
/// leader's log compacted behind it.
fn lagging_follower_behind_snapshot() -> (Cluster, u64, u64, u64) {
    lagging_follower_behind_snapshot_with(Cluster::new(&[1, 2, 3]))
}

fn lagging_follower_behind_snapshot_with(mut c: Cluster) -> (Cluster, u64, u64, u64) {
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    c.partition(leader, follower);
    let mut last = 0;
    for i in 0..20 {
        let r = c.propose(leader, &format!("command-{i}"));
        if let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r) {
            last = *index;
        }
    }
    c.deliver_all();
    assert!(c.run_until(10, |c| c.node(leader).applied_index >= last));
    c.snapshot(leader);
    let snapshot_index = c.raft(leader).snapshot_meta().index;
    assert!(
        c.raft(leader).first_index() > c.raft(follower).last_index() + 1,
        "the follower's next entries are compacted"
    );
    (c, leader, follower, snapshot_index)
}

#[test]
fn lagging_follower_catches_up_by_snapshot_despite_lost_chunks() {
    let (mut c, leader, follower, snapshot_index) = lagging_follower_behind_snapshot();
    c.heal();
    c.record = true;
    // Lose every third chunk for a while: the leader resends after its timeout.
    let mut n = 0;
    for _ in 0..200 {
        let ids: Vec<u64> = c.nodes.keys().copied().collect();
        for id in ids {
            c.step(id, Input::Tick);
        }
        c.deliver_filtered(|m| {
            if matches!(m.body, MessageBody::SnapshotChunk { .. }) {
                n += 1;
                return n % 3 != 0 || n > 30;
            }
            true
        });
        if c.node(follower).applied_index >= snapshot_index {
            break;
        }
    }
    assert!(
        c.node(follower).applied_index >= snapshot_index,
        "snapshot never installed"
    );
    assert!(n > 3, "the snapshot travelled in several chunks");
    let installed = c.sent_log.iter().any(|m| {
        matches!(
            m.body,
            MessageBody::SnapshotResponse {
                outcome: SnapshotOutcome::Installed { .. },
                ..
            }
        )
    });
    assert!(installed, "installation is acknowledged over the wire");
    // Replication continues after the snapshot.
    let r = c.propose(leader, "after-snapshot");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    assert!(c.run_until(20, |c| c.all_applied(index)));
    assert_eq!(c.node(follower).applied, c.node(leader).applied);
}

#[test]
fn failed_chunk_save_makes_the_leader_start_over() {
    let (mut c, _leader, follower, snapshot_index) = lagging_follower_behind_snapshot();
    c.nodes.get_mut(&follower).unwrap().fail_snapshot_saves = true;
    c.heal();
    c.record = true;
    for _ in 0..5 {
        c.tick_all();
    }
    let rejected = c.sent_log.iter().any(|m| {
        matches!(
            m.body,
            MessageBody::SnapshotResponse {
                outcome: SnapshotOutcome::Rejected,
                ..
            }
        )
    });
    assert!(rejected);
    c.nodes.get_mut(&follower).unwrap().fail_snapshot_saves = false;
    assert!(c.run_until(100, |c| c.node(follower).applied_index >= snapshot_index));
}

#[test]
fn snapshot_transfer_resumes_after_the_follower_restarts() {
    let (mut c, _leader, follower, snapshot_index) = lagging_follower_behind_snapshot();
    c.heal();
    // Let a few chunks through, then crash the follower mid-transfer.
    for _ in 0..2 {
        c.tick_all();
    }
    c.restart(follower);
    assert!(c.run_until(300, |c| c.node(follower).applied_index >= snapshot_index));
}

#[test]
fn compaction_keeps_the_configured_lag() {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o = ferry_raft::testing::test_options(id);
        o.compaction_lag_entries = 5;
        o
    });
    let leader = c.elect();
    for i in 0..20 {
        c.propose(leader, &format!("c{i}"));
    }
    c.deliver_all();
    assert!(c.run_until(10, |c| c.all_applied(21)));
    c.snapshot(leader);
    let s = c.raft(leader).snapshot_meta().index;
    assert_eq!(c.raft(leader).first_index(), s - 5 + 1);
    assert!(c
        .node(leader)
        .storage
        .entries
        .first()
        .is_none_or(|e| e.index == s - 4));
}

/// Delivers the messages in flight now (not those they cause): one hop.
fn deliver_hop(c: &mut Cluster) {
    for _ in 0..c.network.len() {
        c.deliver_one();
    }
}

fn chunks_in_flight(c: &Cluster) -> usize {
    c.in_flight(|m| matches!(m.body, MessageBody::SnapshotChunk { .. }))
}

/// Seeds 18288, 18400, 70673 and 86665: with one chunk in flight a transfer
/// took a round trip per chunk, so small chunks (or a long link) kept a
/// follower behind past the liveness bound. Chunks are pipelined under the
/// inflight window: several travel before the first acknowledgement, never
/// more than the window, and the transfer takes far fewer round trips than
/// it has chunks.
#[test]
fn snapshot_chunks_are_pipelined_under_the_inflight_window() {
    let window = 4;
    let cluster = Cluster::with_options(&[1, 2, 3], |id| {
        let mut options = test_options(id);
        options.inflight_messages_max = window;
        options
    });
    let (mut c, leader, follower, snapshot_index) = lagging_follower_behind_snapshot_with(cluster);
    let chunks = c.node(leader).storage.snapshot_data.len().div_ceil(16);
    assert!(chunks >= 3 * window, "the snapshot spans many chunks");
    c.heal();
    c.step(leader, Input::PeerConnected(follower));
    let mut hops = 0;
    let mut most_in_flight = 0;
    while c.node(follower).applied_index < snapshot_index {
        most_in_flight = most_in_flight.max(chunks_in_flight(&c));
        deliver_hop(&mut c);
        hops += 1;
        assert!(hops < 4 * chunks, "the transfer stalled");
    }
    assert!(most_in_flight > 1, "chunks were sent one at a time");
    assert!(
        most_in_flight <= window,
        "{most_in_flight} chunks in flight, beyond the window of {window}"
    );
    assert!(
        hops < chunks,
        "{hops} hops for {chunks} chunks: one round trip per chunk"
    );
}

/// A lost chunk in the middle of the window: the follower's answers to the
/// chunks after the gap say where it is, and the leader resends from there
/// at once, without waiting for the chunk timeout (no tick in this test).
#[test]
fn a_lost_chunk_is_resent_when_the_follower_shows_the_gap() {
    let (mut c, leader, follower, snapshot_index) = lagging_follower_behind_snapshot();
    c.heal();
    c.step(leader, Input::PeerConnected(follower));
    let mut dropped = false;
    let mut hops = 0;
    while c.node(follower).applied_index < snapshot_index {
        if !dropped {
            if let Some(at) = c.network.iter().position(
                |m| matches!(m.body, MessageBody::SnapshotChunk { offset, .. } if offset > 0),
            ) {
                c.network.remove(at);
                dropped = true;
            }
        }
        deliver_hop(&mut c);
        hops += 1;
        assert!(hops < 1000, "the transfer stalled without a timeout");
    }
    assert!(dropped, "a chunk was lost");
}
