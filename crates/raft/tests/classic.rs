//! The classic Raft cases: Figure 8, stale leaders, short logs, duplicated
//! and reordered appends, check-quorum, pre-vote.

use bytes::Bytes;
use ferry_raft::testing::{test_options, Cluster};
use ferry_raft::{
    Action, AppendResult, Entry, EntryPayload, HardState, Input, Message, MessageBody, RaftNode,
    Request, RequestError, Response, RestoredState, Role,
};

fn msg(from: u64, to: u64, term: u64, body: MessageBody) -> Input {
    Input::Message(Message {
        group: 1,
        from,
        to,
        term,
        body,
    })
}

fn entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        payload: EntryPayload::Command(Bytes::from(format!("e{index}"))),
    }
}

/// Drives node 1 of {1,2,3}, restored with `entries` and `term`, to leader
/// by feeding it the votes it asks for. Returns the node and its new term.
fn make_leader(entries: Vec<Entry>, term: u64) -> (RaftNode, Vec<Action>) {
    let mut restored = RestoredState::bootstrap([1, 2, 3]);
    restored.entries = entries;
    restored.hard_state = HardState {
        term,
        vote: None,
        commit: 0,
    };
    let mut node = RaftNode::new(test_options(1), restored, 1).unwrap();
    let mut actions = Vec::new();
    while node.role() == Role::Follower {
        node.step(Input::Tick, &mut actions);
    }
    assert_eq!(node.role(), Role::PreCandidate);
    node.step(
        msg(
            2,
            1,
            term + 1,
            MessageBody::RequestVoteResponse {
                pre_vote: true,
                granted: true,
                commit: 0,
                commit_term: 0,
            },
        ),
        &mut actions,
    );
    assert_eq!(node.role(), Role::Candidate);
    node.step(Input::Persisted { seq: 1 }, &mut actions);
    node.step(
        msg(
            2,
            1,
            term + 1,
            MessageBody::RequestVoteResponse {
                pre_vote: false,
                granted: true,
                commit: 0,
                commit_term: 0,
            },
        ),
        &mut actions,
    );
    assert_eq!(node.role(), Role::Leader);
    (node, actions)
}

#[test]
fn figure_8_old_term_entry_is_not_committed_by_counting() {
    // Node 1 holds entry 2 from term 2 and leads term 3 (after appending its no-op at 3).
    let (mut leader, mut actions) = make_leader(vec![entry(1, 1), entry(2, 2)], 2);
    assert_eq!(leader.term(), 3);
    assert_eq!(leader.last_index(), 3);
    // Its own log is durable through 3; follower 2 reports a match at 2:
    // a majority holds entry 2, but it is from term 2, so it must not commit.
    leader.step(Input::Persisted { seq: 2 }, &mut actions);
    leader.step(
        msg(
            2,
            1,
            3,
            MessageBody::AppendResponse(AppendResult::Success { match_index: 2 }),
        ),
        &mut actions,
    );
    assert_eq!(
        leader.commit_index(),
        0,
        "an entry of an earlier term was committed by counting replicas"
    );
    // Once the term-3 no-op is on a majority, everything up to it commits.
    leader.step(
        msg(
            2,
            1,
            3,
            MessageBody::AppendResponse(AppendResult::Success { match_index: 3 }),
        ),
        &mut actions,
    );
    assert_eq!(leader.commit_index(), 3);
}

#[test]
fn leader_counts_itself_only_for_durable_entries() {
    let (mut leader, mut actions) = make_leader(vec![], 0);
    // The no-op at 1 is not synced on the leader: one follower alone is no majority.
    leader.step(
        msg(
            2,
            1,
            1,
            MessageBody::AppendResponse(AppendResult::Success { match_index: 1 }),
        ),
        &mut actions,
    );
    assert_eq!(leader.commit_index(), 0);
    leader.step(
        msg(
            3,
            1,
            1,
            MessageBody::AppendResponse(AppendResult::Success { match_index: 1 }),
        ),
        &mut actions,
    );
    assert_eq!(
        leader.commit_index(),
        1,
        "two followers are a majority without the leader"
    );
}

#[test]
fn partitioned_stale_leader_rejoins_and_steps_down() {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o = test_options(id);
        o.check_quorum = false;
        o
    });
    let old = c.elect();
    let old_term = c.raft(old).term();
    c.isolate(old);
    // The old leader keeps believing it leads and takes a proposal it can never commit.
    let lost = c.propose(old, "lost");
    let Some(Ok(Response::Proposed {
        index: lost_index,
        term: lost_term,
    })) = c.response(old, lost).cloned()
    else {
        panic!()
    };
    assert!(c.run_until(200, |c| c
        .nodes
        .iter()
        .any(|(&id, n)| id != old && n.raft.role() == Role::Leader)));
    let new = c
        .nodes
        .iter()
        .find(|(&id, n)| id != old && n.raft.role() == Role::Leader)
        .map(|(&id, _)| id)
        .unwrap();
    assert!(c.raft(new).term() > old_term);
    assert_eq!(
        c.raft(old).role(),
        Role::Leader,
        "without check-quorum the old leader does not notice"
    );
    let kept = c.propose(new, "kept");
    let Some(Ok(Response::Proposed {
        index: kept_index, ..
    })) = c.response(new, kept).cloned()
    else {
        panic!()
    };
    c.heal();
    assert!(c.run_until(50, |c| c.raft(old).role() == Role::Follower
        && c.all_applied(kept_index)));
    assert_eq!(c.raft(old).leader(), Some(new));
    // The stale proposal's slot holds another term's entry everywhere.
    let applied_term = c.committed.get(&lost_index).map(|(t, _)| *t);
    assert_ne!(
        applied_term,
        Some(lost_term),
        "the stale leader's uncommitted entry must be overwritten"
    );
    for n in c.nodes.values() {
        assert!(!n.applied.iter().any(|b| b.as_ref() == b"lost"));
        assert!(n.applied.iter().any(|b| b.as_ref() == b"kept"));
    }
}

#[test]
fn candidate_with_shorter_log_loses() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let mut others = [1u64, 2, 3].into_iter().filter(|&n| n != leader);
    let (short, long) = (others.next().unwrap(), others.next().unwrap());
    c.partition(leader, short);
    let r = c.propose(leader, "only-on-two");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    assert!(c.run_until(10, |c| c.node(long).applied_index >= index));
    assert!(c.raft(short).last_index() < index);
    // The leader disappears; only `short` and `long` remain.
    c.nodes.get_mut(&leader).unwrap().up = false;
    c.heal();
    assert!(c.run_until(500, |c| [short, long]
        .iter()
        .any(|&n| c.raft(n).role() == Role::Leader)));
    assert_eq!(
        c.raft(long).role(),
        Role::Leader,
        "the node with the shorter log must not win"
    );
    assert_eq!(c.raft(short).role(), Role::Follower);

    // And directly: a vote request with a shorter log is refused.
    let mut actions = Vec::new();
    let mut voter = RaftNode::new(
        test_options(2),
        RestoredState {
            hard_state: HardState {
                term: 2,
                vote: None,
                commit: 0,
            },
            entries: vec![entry(1, 1), entry(2, 2)],
            ..RestoredState::bootstrap([1, 2, 3])
        },
        9,
    )
    .unwrap();
    let request = MessageBody::RequestVote {
        pre_vote: false,
        last_log_index: 5,
        last_log_term: 1,
        transfer: false,
    };
    voter.step(msg(3, 2, 3, request), &mut actions);
    voter.step(Input::Persisted { seq: 1 }, &mut actions);
    let answer = actions.iter().find_map(|a| match a {
        Action::Send(Message {
            body: MessageBody::RequestVoteResponse { granted, .. },
            ..
        }) => Some(*granted),
        _ => None,
    });
    assert_eq!(
        answer,
        Some(false),
        "a vote went to a candidate with a shorter log"
    );
}

#[test]
fn duplicate_and_reordered_appends_are_idempotent() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    c.record = true;
    for i in 0..10 {
        c.propose(leader, &format!("v{i}"));
    }
    // Capture every append to the follower as it flows, then replay them
    // duplicated and in reverse order.
    let appends: Vec<Message> = c
        .network
        .iter()
        .filter(|m| m.to == follower && matches!(m.body, MessageBody::Append { .. }))
        .cloned()
        .collect();
    assert!(!appends.is_empty());
    c.deliver_all();
    assert!(c.run_until(20, |c| c.all_applied(c.raft(leader).last_index())));
    let before: Vec<_> = (1..=c.raft(follower).last_index())
        .map(|i| c.raft(follower).term_at(i))
        .collect();
    let commit_before = c.raft(follower).commit_index();
    for m in appends.iter().rev().chain(appends.iter()) {
        c.network.push_back(m.clone());
    }
    c.deliver_all();
    let after: Vec<_> = (1..=c.raft(follower).last_index())
        .map(|i| c.raft(follower).term_at(i))
        .collect();
    assert_eq!(before, after, "replayed appends changed the follower's log");
    assert_eq!(c.raft(follower).commit_index(), commit_before);
    assert!(c.run_until(5, |c| c.all_applied(c.raft(leader).last_index())));
}

#[test]
fn check_quorum_leader_steps_down_when_isolated() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    c.isolate(leader);
    let read = c.request(
        leader,
        Request::Read(ferry_raft::ReadConsistency::Linearizable),
    );
    assert!(c.run_until(25, |c| c.raft(leader).role() != Role::Leader));
    // Its unconfirmed read failed rather than being answered stale.
    assert_eq!(
        c.response(leader, read),
        Some(&Err(RequestError::LeadershipLost))
    );
}

#[test]
fn pre_vote_keeps_a_rejoining_node_from_disrupting_the_leader() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let term = c.raft(leader).term();
    let loner = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    c.isolate(loner);
    for _ in 0..100 {
        c.tick_all();
    }
    assert_eq!(
        c.raft(loner).term(),
        term,
        "pre-vote failures must not raise the term"
    );
    c.heal();
    for _ in 0..30 {
        c.tick_all();
    }
    assert_eq!(c.leader(), Some(leader));
    assert_eq!(c.raft(leader).term(), term);
    assert_eq!(c.raft(loner).leader(), Some(leader));
}
