//! The three production failures ferry must make impossible (see
//! shared/seeds/), replayed at the engine level.

use ferry_raft::testing::Cluster;
use ferry_raft::{
    AppendResult, Input, MembershipChange, Message, MessageBody, ReadConsistency, Request,
    Response, Role, SnapshotOutcome,
};

/// A cluster whose `follower` lags behind the leader's compacted log.
fn lagging_follower() -> (Cluster, u64, u64, u64) {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    c.partition(leader, follower);
    for i in 0..20 {
        c.propose(leader, &format!("command-{i}"));
    }
    c.deliver_all();
    let last = c.raft(leader).last_index();
    assert!(c.run_until(10, |c| c.node(leader).applied_index >= last));
    c.snapshot(leader);
    let snapshot_index = c.raft(leader).snapshot_meta().index;
    (c, leader, follower, snapshot_index)
}

/// Seed 000 (Ra): a follower receiving a snapshot answered client commands
/// and local queries with `unsupported_call`. Here every request kind gets
/// a definite answer while the follower is in that sub-state.
#[test]
fn seed_000_follower_receiving_snapshot_answers_every_request() {
    let (mut c, leader, follower, snapshot_index) = lagging_follower();
    // Keep the follower in its receiving-snapshot sub-state: its storage
    // does not confirm the chunk saves until we say so.
    c.nodes.get_mut(&follower).unwrap().hold_snapshot_saves = true;
    c.heal();
    assert!(c.run_until(10, |c| c.raft(follower).is_receiving_snapshot()));
    let applied_before = c.node(follower).applied_index;

    let status = c.request(follower, Request::Status);
    let local = c.request(
        follower,
        Request::Read(ReadConsistency::Local { min_applied: None }),
    );
    let propose = c.request(follower, Request::Propose("during-snapshot".into()));
    let linearizable = c.request(follower, Request::Read(ReadConsistency::Linearizable));
    let membership = c.request(
        follower,
        Request::ChangeMembership(MembershipChange::AddLearner(9)),
    );
    c.deliver_all();

    // Answered locally at once.
    match c.response(follower, status) {
        Some(Ok(Response::Status(s))) => assert!(s.receiving_snapshot && s.leader == Some(leader)),
        other => panic!("status not answered while receiving a snapshot: {other:?}"),
    }
    assert_eq!(
        c.response(follower, local),
        Some(&Ok(Response::ReadReady {
            index: applied_before
        })),
        "local reads are served from the state last applied"
    );
    // Forwarded to the leader and the leader's answer relayed.
    assert!(
        matches!(
            c.response(follower, propose),
            Some(Ok(Response::Proposed { .. }))
        ),
        "{:?}",
        c.response(follower, propose)
    );
    assert!(
        matches!(
            c.response(follower, membership),
            Some(Ok(Response::Proposed { .. }))
        ),
        "{:?}",
        c.response(follower, membership)
    );
    // The linearizable read was confirmed by the leader; it is answered
    // once the follower has applied up to the read index, i.e. after the
    // snapshot is installed.
    assert!(c.response(follower, linearizable).is_none());
    c.nodes.get_mut(&follower).unwrap().hold_snapshot_saves = false;
    for _ in 0..50 {
        c.release_saves(follower);
        c.tick_all();
        if c.response(follower, linearizable).is_some() {
            break;
        }
    }
    let Some(Ok(Response::ReadReady { index })) = c.response(follower, linearizable).cloned()
    else {
        panic!(
            "linearizable read not answered: {:?}",
            c.response(follower, linearizable)
        )
    };
    assert!(index >= snapshot_index);
    assert!(c.node(follower).applied_index >= index);
}

/// Seed 002 (Tarantool): the leader's announcement to a freshly connected
/// follower was lost while the connection was being set up, and nothing
/// re-sent it. Here the transport's `PeerConnected` makes the leader send
/// its term, commit and identity at once, and the follower follows it
/// without a new election.
#[test]
fn seed_002_peer_connected_makes_the_follower_follow_without_an_election() {
    let mut c = Cluster::new(&[1, 2, 3]);
    // Node 3's links are down while 1 and 2 elect a leader.
    c.isolate(3);
    c.heal_pair(1, 2);
    let leader = c.elect();
    let term = c.raft(leader).term();
    assert_eq!(c.raft(3).leader(), None);
    // The link from the leader to 3 comes up; the transport says so.
    c.heal();
    c.step(leader, Input::PeerConnected(3));
    // No tick: only what the connection event produced is delivered.
    c.deliver_all();
    assert_eq!(
        c.raft(3).leader(),
        Some(leader),
        "the follower did not learn of the leader on connect"
    );
    assert_eq!(c.raft(3).term(), term);
    assert_eq!(c.raft(3).role(), Role::Follower);
    // It takes the leader's data from then on, and no election happened.
    let r = c.propose(leader, "after-connect");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    c.deliver_all();
    assert!(c.run_until(5, |c| c.all_applied(index)));
    assert_eq!(c.raft(leader).term(), term);
    assert_eq!(c.leader(), Some(leader));
}

/// Seed 002, second half: if the first messages from a new leader were
/// lost, whatever message arrives next from it is enough.
#[test]
fn seed_002_any_message_from_the_new_leader_is_enough() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.isolate(3);
    c.heal_pair(1, 2);
    let leader = c.elect();
    c.heal();
    // Deliver only a heartbeat (the appends were "lost").
    c.step(leader, Input::Tick);
    c.deliver_filtered(|m| !(m.to == 3 && matches!(m.body, MessageBody::Append { .. })));
    assert_eq!(c.raft(3).leader(), Some(leader));
    assert_eq!(c.raft(3).term(), c.raft(leader).term());
}

/// Seed 004 (Picodata / raft-rs): a follower rejected an append with hint
/// term 0, got a snapshot it had already applied, and the leader then
/// waited forever for a status report that never came. Here: a stale
/// snapshot is acknowledged over the wire at once without being installed,
/// a hint term of 0 never sends the leader below what it knows matches,
/// and replication carries on without any local signal.
#[test]
fn seed_004_stale_snapshot_and_zero_hint_term_do_not_stall_the_leader() {
    let (mut c, leader, follower, snapshot_index) = lagging_follower();
    c.heal();
    c.record = true;
    // 1-3: the follower rejects, gets the snapshot and installs it.
    assert!(c.run_until(50, |c| c.node(follower).applied_index >= snapshot_index));
    let first_chunk = c
        .sent_log
        .iter()
        .find(|m| matches!(m.body, MessageBody::SnapshotChunk { offset: 0, .. }))
        .cloned()
        .expect("the leader sent a snapshot");
    c.sent_log.clear();

    // 4: the leader's next appends to the follower are in flight (here:
    // lost), so the leader's match for it is behind its last index.
    c.blocked.insert((leader, follower));
    c.propose(leader, "in-flight-1");
    c.propose(leader, "in-flight-2");
    c.deliver_all();
    c.blocked.clear();
    c.sent_log.clear();

    // 5: a reject with hint term 0 reaches the leader, as raft-rs sent it:
    // hint index 0, hint term 0, for an append at the end of the log.
    let zero_hint = Message {
        group: 1,
        from: follower,
        to: leader,
        term: c.raft(leader).term(),
        body: MessageBody::AppendResponse(AppendResult::Reject {
            rejected_index: c.raft(leader).last_index(),
            hint_index: 0,
            hint_term: 0,
        }),
    };
    c.step(leader, Input::Message(zero_hint));
    // 6-7: and the same snapshot arrives again at the follower (duplicated
    // by the network). It has applied it already: it must say so at once.
    let mut stale = first_chunk.clone();
    stale.term = c.raft(leader).term();
    c.step(follower, Input::Message(stale));
    let stale_ack = c.network.iter().any(|m| {
        m.from == follower
            && matches!(m.body, MessageBody::SnapshotResponse { outcome: SnapshotOutcome::Stale { match_index }, .. } if match_index >= snapshot_index)
    });
    assert!(
        stale_ack,
        "a stale snapshot must be acknowledged at once with the follower's match index"
    );
    c.deliver_all();

    // The leader never went back below what it knew matched, and keeps
    // replicating: new entries reach the follower within a few ticks,
    // far sooner than any snapshot timeout could rescue a stall.
    let mut proposed = Vec::new();
    for i in 0..5 {
        let r = c.propose(leader, &format!("after-{i}"));
        if let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r) {
            proposed.push(*index);
        }
    }
    let last = *proposed.last().unwrap();
    assert!(
        c.run_until(3, |c| c.node(follower).applied_index >= last),
        "the leader stalled on the follower"
    );
    let resent_snapshot = c
        .sent_log
        .iter()
        .any(|m| m.to == follower && matches!(m.body, MessageBody::SnapshotChunk { .. }));
    assert!(
        !resent_snapshot,
        "the leader sent a snapshot the follower already has"
    );
}

/// Seed 004, the leader's half: the follower's "installed" answer is lost,
/// so the leader still thinks it is sending a snapshot the follower has
/// already applied. Its chunk timeout re-sends; the follower answers
/// `Stale` at once; the leader leaves the snapshot state on that message
/// and replicates again. No local signal is needed.
#[test]
fn seed_004_lost_installed_answer_is_recovered_over_the_wire() {
    let (mut c, leader, follower, snapshot_index) = lagging_follower();
    c.heal();
    c.record = true;
    let lost_installed = |m: &Message| {
        !matches!(
            m.body,
            MessageBody::SnapshotResponse {
                outcome: SnapshotOutcome::Installed { .. },
                ..
            }
        )
    };
    let mut ticks = 0;
    while c.node(follower).applied_index < snapshot_index {
        ticks += 1;
        assert!(ticks < 50);
        let ids: Vec<u64> = c.nodes.keys().copied().collect();
        for id in ids {
            c.step(id, Input::Tick);
        }
        c.deliver_filtered(lost_installed);
    }
    let r = c.propose(leader, "after-install");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    // Within one chunk timeout (plus a little), the follower has the new entry.
    let timeout = ferry_raft::testing::test_options(1).snapshot_chunk_timeout_ticks as usize;
    assert!(
        c.run_until(timeout + 5, |c| c.node(follower).applied_index >= index),
        "the leader stalled"
    );
    let stale = c.sent_log.iter().any(|m| {
        m.from == follower
            && matches!(
                m.body,
                MessageBody::SnapshotResponse {
                    outcome: SnapshotOutcome::Stale { .. },
                    ..
                }
            )
    });
    assert!(stale, "recovery went through the follower's Stale answer");
}

/// Seed 004 with every snapshot report lost (the simulator's NOTE-SIM-5):
/// the leader must not depend on the report at all. After its chunk
/// timeouts it probes with an append right after the snapshot index, which
/// the follower that installed the snapshot accepts.
#[test]
fn seed_004_every_snapshot_report_lost_still_resumes_replication() {
    let (mut c, leader, follower, snapshot_index) = lagging_follower();
    c.heal();
    let no_reports = |m: &Message| !matches!(m.body, MessageBody::SnapshotResponse { .. });
    let r = c.propose(leader, "after");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    let timeout = ferry_raft::testing::test_options(1).snapshot_chunk_timeout_ticks as usize;
    let mut ticks = 0;
    while c.node(follower).applied_index < index {
        ticks += 1;
        assert!(
            ticks < 5 * timeout,
            "replication never resumed without snapshot reports"
        );
        let ids: Vec<u64> = c.nodes.keys().copied().collect();
        for id in ids {
            c.step(id, Input::Tick);
        }
        c.deliver_filtered(no_reports);
    }
    assert!(c.node(follower).applied_index >= snapshot_index);
}
