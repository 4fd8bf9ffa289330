//! Reads: ReadIndex on leader and follower, lease reads, local reads, and
//! requests waiting for a leader.

use ferry_raft::testing::{test_options, Cluster};
use ferry_raft::{Input, MessageBody, ReadConsistency, Request, RequestError, Response};

fn read(c: &mut Cluster, at: u64, consistency: ReadConsistency) -> ferry_raft::RequestId {
    c.request(at, Request::Read(consistency))
}

#[test]
fn read_index_on_leader_needs_a_heartbeat_quorum() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let r = c.propose(leader, "a");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    c.deliver_all();
    c.tick_all();
    let q = read(&mut c, leader, ReadConsistency::Linearizable);
    // Not answered before the quorum round comes back.
    assert!(c.response(leader, q).is_none());
    assert!(
        c.in_flight(|m| matches!(m.body, MessageBody::Heartbeat { read_seq, .. } if read_seq > 0))
            >= 2
    );
    c.deliver_all();
    let Some(Ok(Response::ReadReady { index: at })) = c.response(leader, q).cloned() else {
        panic!()
    };
    assert!(at >= index);
}

#[test]
fn new_leader_waits_for_its_noop_before_serving_reads() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    // Freshly elected: the no-op may be uncommitted. Block followers so it stays so.
    c.drop_all();
    let follower_links: Vec<u64> = [1u64, 2, 3].into_iter().filter(|&n| n != leader).collect();
    for f in &follower_links {
        c.partition(leader, *f);
    }
    let before = c.raft(leader).commit_index();
    let last = c.raft(leader).last_index();
    if before < last {
        let q = read(&mut c, leader, ReadConsistency::Linearizable);
        c.deliver_all();
        assert!(
            c.response(leader, q).is_none(),
            "read served before the term's first entry committed"
        );
        c.heal();
        assert!(c.run_until(10, |c| c.response(leader, q).is_some()));
        let Some(Ok(Response::ReadReady { index })) = c.response(leader, q).cloned() else {
            panic!()
        };
        assert!(index >= last);
    }
}

#[test]
fn follower_read_waits_until_applied_the_leaders_index() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let r = c.propose(leader, "w");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    // Stop just after the leader committed (before the follower applied).
    while c.raft(leader).commit_index() < index {
        assert!(c.deliver_one());
    }
    let q = read(&mut c, follower, ReadConsistency::Linearizable);
    assert!(c.run_until(20, |c| c.response(follower, q).is_some()));
    let Some(Ok(Response::ReadReady { index: at })) = c.response(follower, q).cloned() else {
        panic!()
    };
    assert!(at >= index, "a read after a committed write must see it");
    assert!(c.node(follower).applied_index >= at);
}

#[test]
fn lease_reads_are_served_from_the_lease_without_a_round() {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o = test_options(id);
        o.lease_reads = true;
        o
    });
    let leader = c.elect();
    for _ in 0..3 {
        c.tick_all();
    }
    let q = read(&mut c, leader, ReadConsistency::Lease);
    assert!(
        matches!(c.response(leader, q), Some(Ok(Response::ReadReady { .. }))),
        "a leader holding its lease answers at once: {:?}",
        c.response(leader, q)
    );
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let f = read(&mut c, follower, ReadConsistency::Lease);
    assert_eq!(
        c.response(follower, f),
        Some(&Err(RequestError::NotLeader {
            leader: Some(leader)
        }))
    );
    // Isolated, the lease runs out and the leader stops serving from it.
    c.isolate(leader);
    let lease = ferry_raft::RaftNode::lease_ticks(10) as usize;
    for _ in 0..lease + 1 {
        c.step(leader, Input::Tick);
        c.drop_all();
    }
    let late = read(&mut c, leader, ReadConsistency::Lease);
    assert!(
        c.response(leader, late).is_none(),
        "served from an expired lease"
    );
}

#[test]
fn lease_reads_without_check_quorum_are_refused() {
    let mut c = Cluster::with_options(&[1], |id| {
        let mut o = test_options(id);
        o.lease_reads = true;
        o.check_quorum = false;
        o
    });
    let leader = c.elect();
    let q = read(&mut c, leader, ReadConsistency::Lease);
    assert_eq!(
        c.response(leader, q),
        Some(&Err(RequestError::LeaseReadsDisabled))
    );
}

#[test]
fn local_reads_answer_now_or_wait_for_min_applied() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let now = read(
        &mut c,
        follower,
        ReadConsistency::Local { min_applied: None },
    );
    assert!(matches!(
        c.response(follower, now),
        Some(Ok(Response::ReadReady { .. }))
    ));
    let target = c.raft(leader).last_index() + 1;
    let wait = read(
        &mut c,
        follower,
        ReadConsistency::Local {
            min_applied: Some(target),
        },
    );
    assert!(c.response(follower, wait).is_none());
    c.propose(leader, "next");
    assert!(c.run_until(10, |c| c.response(follower, wait).is_some()));
    assert_eq!(
        c.response(follower, wait),
        Some(&Ok(Response::ReadReady { index: target }))
    );
    // Never reached: answered with a timeout at the deadline.
    let never = read(
        &mut c,
        follower,
        ReadConsistency::Local {
            min_applied: Some(1_000),
        },
    );
    assert!(c.run_until(60, |c| c.response(follower, never).is_some()));
    assert_eq!(
        c.response(follower, never),
        Some(&Err(RequestError::Timeout))
    );
}

#[test]
fn requests_without_a_leader_wait_then_fail_with_no_leader() {
    let mut c = Cluster::new(&[1, 2, 3]);
    // Nobody has been elected yet: the request waits for a leader...
    let early = c.propose(1, "early");
    assert!(c.response(1, early).is_none());
    let leader = c.elect();
    c.deliver_all();
    assert!(
        matches!(c.response(1, early), Some(Ok(Response::Proposed { .. }))),
        "{:?} (leader {leader})",
        c.response(1, early)
    );
    // ...and a node cut off from everyone gives up at the deadline.
    let mut c = Cluster::new(&[1, 2, 3]);
    c.isolate(1);
    let r = c.propose(1, "lonely");
    assert!(c.run_until(60, |c| c.response(1, r).is_some()));
    assert_eq!(c.response(1, r), Some(&Err(RequestError::NoLeader)));
}

#[test]
fn pending_requests_are_bounded() {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o = test_options(id);
        o.pending_requests_max = 2;
        o
    });
    let a = c.propose(1, "a");
    let b = c.propose(1, "b");
    let d = c.propose(1, "c");
    assert!(c.response(1, a).is_none() && c.response(1, b).is_none());
    assert_eq!(
        c.response(1, d),
        Some(&Err(RequestError::Busy { limit: 2 }))
    );
}

#[test]
fn forwarded_request_times_out_when_the_leader_goes_silent() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    c.blocked.insert((leader, follower));
    let r = c.propose(follower, "into-the-void");
    assert!(c.run_until(60, |c| c.response(follower, r).is_some()));
    assert_eq!(c.response(follower, r), Some(&Err(RequestError::Timeout)));
}

#[test]
fn without_forwarding_followers_redirect() {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o = test_options(id);
        o.forward_requests = false;
        o
    });
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let r = c.propose(follower, "x");
    assert_eq!(
        c.response(follower, r),
        Some(&Err(RequestError::NotLeader {
            leader: Some(leader)
        }))
    );
}

#[test]
fn a_leader_without_quorum_bounds_its_uncommitted_tail() {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o = test_options(id);
        o.pending_requests_max = 8;
        o.check_quorum = false;
        o
    });
    let leader = c.elect();
    c.isolate(leader);
    let answers: Vec<_> = (0..20)
        .map(|i| c.propose(leader, &format!("p{i}")))
        .collect();
    let busy = answers
        .iter()
        .filter(|&&r| c.response(leader, r) == Some(&Err(RequestError::Busy { limit: 8 })))
        .count();
    assert!(busy >= 12, "only {busy} proposals were refused");
    assert!(c.raft(leader).last_index() - c.raft(leader).commit_index() <= 8);
}

/// A follower that granted the leader its lease and then crashed must not,
/// once restarted, vote for another candidate before the lease is over: it
/// no longer remembers hearing from the leader, and the old leader, cut
/// off, would serve a read from its lease after the new leader committed a
/// write (found by the simulator once it drew lease reads).
#[test]
fn a_follower_that_restarts_does_not_vote_away_a_lease_it_granted() {
    let b = 3;
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o = test_options(id);
        o.lease_reads = true;
        if id == b {
            // b campaigns often; the lease holds only by what a promised.
            o.election_timeout_ticks = 2;
        }
        o
    });
    // 1 or 2 leads (b, with its short timeout, is kept out of the election).
    c.isolate(b);
    let leader = c.elect();
    let a = 3 - leader;
    c.heal();
    let w = c.propose(leader, "x=1");
    assert!(c.run_until(10, |c| c.raft(b).last_index()
        == c.raft(leader).last_index()));
    assert!(matches!(c.response(leader, w), Some(Ok(_))));
    assert_eq!(c.leader(), Some(leader));
    c.partition(leader, b);
    // b cannot hear the leader; it keeps asking a for votes, and a refuses:
    // it heard from the leader within its election timeout.
    for _ in 0..10 {
        c.tick_all();
    }
    assert_eq!(c.leader(), Some(leader));
    assert!(c.raft(leader).term() == c.raft(a).term());
    // Just after a round that a answered, the leader is cut off and a
    // crashes and comes back at once.
    c.isolate(leader);
    c.restart(a);
    // While the old leader may still read from its lease, a must not elect b.
    let lease = ferry_raft::RaftNode::lease_ticks(10) as usize;
    for tick in 0..lease {
        c.tick_all();
        assert_ne!(
            c.raft(b).role(),
            ferry_raft::Role::Leader,
            "tick {tick}: the restarted follower voted away the lease it had granted"
        );
    }
    // Then the promise runs out and b is elected; the old leader, cut off,
    // no longer answers from its lease.
    assert!(c.run_until(40, |c| c.raft(b).role() == ferry_raft::Role::Leader));
    let w2 = c.propose(b, "x=2");
    c.deliver_all();
    assert!(matches!(c.response(b, w2), Some(Ok(_))));
    let q = read(&mut c, leader, ReadConsistency::Lease);
    assert!(
        !matches!(c.response(leader, q), Some(Ok(Response::ReadReady { .. }))),
        "the old leader served a lease read after a new leader committed a write"
    );
}

/// Followers learn that a write committed as soon as the leader does, not
/// with the next heartbeat: what a follower has applied is what its
/// serializable reads and its watchers see, so a heartbeat interval of lag
/// would show there after every write. The notice is a heartbeat without a
/// read round, which the followers do not answer.
#[test]
fn followers_learn_a_commit_at_once_and_do_not_answer_the_notice() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    assert!(c.run_until(10, |c| c.all_applied(c.raft(leader).commit_index())));
    c.record = true;
    let w = c.propose(leader, "x");
    // Only messages move now: no tick, so no heartbeat.
    c.deliver_all();
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, w).cloned() else {
        panic!("not committed: {:?}", c.response(leader, w))
    };
    for follower in [1u64, 2, 3].into_iter().filter(|&n| n != leader) {
        assert!(
            c.node(follower).applied_index >= index,
            "follower {follower} applied {} of {index}",
            c.node(follower).applied_index
        );
    }
    let notices = c
        .sent_log
        .iter()
        .filter(|m| matches!(m.body, MessageBody::Heartbeat { read_seq: 0, .. }))
        .count();
    assert_eq!(notices, 2, "one commit notice per follower");
    assert!(!c
        .sent_log
        .iter()
        .any(|m| matches!(m.body, MessageBody::HeartbeatResponse { read_seq: 0, .. })));
}

/// Three linearizable reads stepped at `at` in one batch, with ids from
/// `first_id` on.
fn linearizable_reads_in_one_step(
    c: &mut Cluster,
    at: u64,
    first_id: u64,
) -> Vec<ferry_raft::RequestId> {
    let reads: Vec<ferry_raft::RequestId> = (first_id..first_id + 3)
        .map(ferry_raft::RequestId)
        .collect();
    c.step_batch(
        at,
        reads
            .iter()
            .map(|&id| Input::Client {
                id,
                request: Request::Read(ReadConsistency::Linearizable),
            })
            .collect(),
    );
    reads
}

/// Linearizable reads arriving at a follower in one step share one
/// forwarded ReadIndex; a read of a later step gets a forward of its own.
#[test]
fn follower_reads_of_one_step_share_one_forward() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let r = c.propose(leader, "w");
    assert!(c.run_until(20, |c| c.all_applied(1)));
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    c.deliver_all();
    let reads = linearizable_reads_in_one_step(&mut c, follower, 1_000);
    let forwards = |c: &Cluster| {
        c.in_flight(|m| matches!(m.body, MessageBody::Forward { .. }) && m.from == follower)
    };
    assert_eq!(forwards(&c), 1, "three reads of one step, one forward");
    // A read of the next step does not ride on a forward already sent.
    let late = read(&mut c, follower, ReadConsistency::Linearizable);
    assert_eq!(forwards(&c), 2);
    assert!(c.run_until(20, |c| {
        reads
            .iter()
            .chain([&late])
            .all(|&q| c.response(follower, q).is_some())
    }));
    for q in reads.iter().chain([&late]) {
        let Some(Ok(Response::ReadReady { index: at })) = c.response(follower, *q).cloned() else {
            panic!("{q:?}: {:?}", c.response(follower, *q))
        };
        assert!(at >= index, "a read after a committed write must see it");
    }
}

/// Reads riding on a forwarded ReadIndex keep their own deadlines: when
/// the leader never answers, every one of them times out, and none is left
/// pending.
#[test]
fn follower_reads_riding_on_a_lost_forward_time_out() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    c.deliver_all();
    let reads = linearizable_reads_in_one_step(&mut c, follower, 2_000);
    // The forward is lost, and so is everything after it.
    c.partition(leader, follower);
    c.drop_all();
    let timeout = ferry_raft::testing::test_options(follower).request_timeout_ticks;
    for _ in 0..=timeout {
        c.step(follower, Input::Tick);
        c.drop_all();
    }
    for q in &reads {
        assert_eq!(
            c.response(follower, *q),
            Some(&Err(RequestError::Timeout)),
            "{q:?}"
        );
    }
    assert_eq!(c.raft(follower).pending_request_count(), 0);
}
