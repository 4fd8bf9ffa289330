//! Input no correct peer sends and logs that broke Raft's assumptions: each
//! is detected, reported as a [`Fault`], and never wraps a number, crashes
//! the node or makes it apply an entry the group did not commit.

use bytes::Bytes;
use ferry_raft::testing::Cluster;
use ferry_raft::{
    Entry, EntryPayload, Fault, Input, Message, MessageBody, Request, RequestError, Response,
    INDEX_MAX, TERM_MAX,
};

fn message(from: u64, to: u64, term: u64, body: MessageBody) -> Input {
    Input::Message(Message {
        group: 1,
        from,
        to,
        term,
        body,
    })
}

fn committed_proposal(c: &mut Cluster, leader: u64, data: &str) -> u64 {
    let r = c.propose(leader, data);
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!("proposal refused")
    };
    assert!(c.run_until(50, |c| c.all_applied(index)), "not applied");
    index
}

/// Issue: one forged heartbeat with `term = u64::MAX` was adopted by every
/// member, and `term + 1` wrapped to 0: no leader ever again. Terms and
/// indexes beyond the limits are refused unread, with a fault reported.
#[test]
fn a_forged_term_or_index_beyond_the_limit_is_refused_unread() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let term = c.raft(leader).term();
    let forged = [
        (
            u64::MAX,
            MessageBody::Heartbeat {
                leader_commit: 0,
                read_seq: 1,
            },
        ),
        (
            term,
            MessageBody::Append {
                prev_log_index: u64::MAX,
                prev_log_term: term,
                entries: Vec::new(),
                leader_commit: u64::MAX,
            },
        ),
        (
            term,
            MessageBody::RequestVote {
                pre_vote: false,
                last_log_index: INDEX_MAX + 1,
                last_log_term: 1,
                transfer: false,
            },
        ),
    ];
    for id in [1, 2, 3] {
        for (forged_term, body) in forged.clone() {
            c.step(id, message(9, id, forged_term, body));
        }
        let node = c.node(id);
        assert_eq!(node.raft.term(), term, "node {id} took the forged term");
        assert_eq!(
            node.faults
                .iter()
                .filter(|f| matches!(f, Fault::MessageOutOfRange { from: 9, .. }))
                .count(),
            3,
            "node {id}: {:?}",
            node.faults
        );
    }
    committed_proposal(&mut c, leader, "still-working");
}

/// At the limit itself: a node brought to `TERM_MAX` (by a faulty peer) does
/// not wrap to term 0; it stops campaigning and says why.
#[test]
fn a_node_at_the_term_limit_stops_campaigning_and_says_why() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.step(
        1,
        message(
            2,
            1,
            TERM_MAX,
            MessageBody::Heartbeat {
                leader_commit: 0,
                read_seq: 1,
            },
        ),
    );
    assert_eq!(c.raft(1).term(), TERM_MAX);
    c.isolate(1);
    for _ in 0..100 {
        c.step(1, Input::Tick);
    }
    assert_eq!(c.raft(1).term(), TERM_MAX, "the term moved past the limit");
    assert!(c
        .node(1)
        .faults
        .iter()
        .any(|f| matches!(f, Fault::TermExhausted { term } if *term == TERM_MAX)));
}

/// Issue: an append forged as the leader, with an entry at the next index
/// and the current term, was accepted; the real leader's entry at the same
/// (index, term) was then taken as a match, and the follower served the
/// forged value forever. The real entry now shows the contradiction: the
/// follower halts the group instead of diverging silently, and refuses
/// requests with a clear error.
#[test]
fn an_entry_that_differs_at_the_same_index_and_term_halts_the_follower() {
    // (A forgery that also claims the commit index is applied at once: only
    // authenticating peers stops that. What the engine guarantees is that
    // the contradiction is found when the real entry arrives.)
    {
        let mut c = Cluster::new(&[1, 2, 3]);
        let leader = c.elect();
        let follower = if leader == 1 { 2 } else { 1 };
        let applied = committed_proposal(&mut c, leader, "before");
        let term = c.raft(leader).term();
        let next = c.raft(leader).last_index() + 1;
        let forged_entry = Entry {
            index: next,
            term,
            payload: EntryPayload::Command(Bytes::from_static(b"forged")),
        };
        c.step(
            follower,
            message(
                leader,
                follower,
                term,
                MessageBody::Append {
                    prev_log_index: next - 1,
                    prev_log_term: c.raft(leader).term_at(next - 1).unwrap(),
                    entries: vec![forged_entry],
                    leader_commit: applied,
                },
            ),
        );
        c.network.retain(|m| m.to != leader || m.from != follower);
        // The real leader's entry at the same index and term.
        let r = c.propose(leader, "real");
        c.deliver_all();
        c.run_until(20, |_| false);
        let node = c.node(follower);
        assert!(
            node.faults
                .iter()
                .any(|f| matches!(f, Fault::LogConflict { index, .. } if *index == next)),
            "no conflict reported: {:?}",
            node.faults
        );
        assert!(node.raft.is_halted());
        let id = c.request(
            follower,
            Request::Read(ferry_raft::ReadConsistency::Local { min_applied: None }),
        );
        assert!(matches!(
            c.response(follower, id),
            Some(Err(RequestError::Halted { .. }))
        ));
        // The rest of the group goes on and commits the real entry.
        assert!(matches!(
            c.response(leader, r),
            Some(Ok(Response::Proposed { index, .. })) if *index == next
        ));
        assert!(c.node(leader).applied_index >= next);
    }
}

/// Issue: a follower whose log went backwards (a damaged tail cut, or an
/// older copy of its data directory) was ignored forever: its rejections
/// looked stale to the leader, which never probed again. Its heartbeat
/// answers now carry its last index: the leader notices, reports it and
/// sends the log again; the follower refuses the commit index beyond its
/// log, and applies nothing on a heartbeat's word that an append did not
/// show matching.
#[test]
fn a_follower_whose_log_went_backwards_is_noticed_and_caught_up() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let mut last = 0;
    for i in 0..10 {
        last = committed_proposal(&mut c, leader, &format!("v{i}"));
    }
    // The follower's log loses its last entries while it is down, and what
    // it had committed goes back with it (an older copy of its data).
    c.nodes.get_mut(&follower).unwrap().up = false;
    {
        let node = c.nodes.get_mut(&follower).unwrap();
        node.storage.entries.retain(|e| e.index <= last - 5);
        node.storage.hard_state.commit = node.storage.hard_state.commit.min(last - 5);
    }
    c.restart(follower);
    c.nodes.get_mut(&follower).unwrap().up = true;
    assert_eq!(c.raft(follower).last_index(), last - 5);
    // No reconnect is reported: the leader must find out by itself.
    assert!(c.run_until(50, |c| c.raft(follower).last_index() >= last
        && c.node(follower).applied_index >= last));
    assert!(c
        .node(leader)
        .faults
        .iter()
        .any(|f| matches!(f, Fault::FollowerLogWentBack { peer, .. } if *peer == follower)));
    assert!(c
        .node(follower)
        .faults
        .iter()
        .any(|f| matches!(f, Fault::CommitBeyondLog { .. })));
    // Replication goes on.
    let more = committed_proposal(&mut c, leader, "after");
    assert!(c.node(follower).applied_index >= more);
}

/// A restored older log may hold entries that were overwritten since: the
/// leader's heartbeat commit, capped at what the follower once matched, may
/// lie within the follower's log there. The follower takes a heartbeat's
/// commit only up to what an append of this leader showed matching, so it
/// never applies the stale entries (the harness checks state machine safety
/// on every apply).
#[test]
fn a_restored_log_with_overwritten_entries_is_never_applied_on_a_heartbeat() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let first = c.elect();
    let base = committed_proposal(&mut c, first, "base");
    let old_term = c.raft(first).term();
    // A new leader in a newer term writes the entries after `base`.
    c.isolate(first);
    let leader = loop {
        c.tick_all();
        if let Some(l) = c.leader().filter(|&l| l != first) {
            break l;
        }
    };
    c.heal();
    assert!(c.run_until(50, |c| c.raft(first).term() > old_term));
    let follower = [1u64, 2, 3]
        .into_iter()
        .find(|&n| n != leader && n != first)
        .unwrap();
    for i in 0..5 {
        committed_proposal(&mut c, leader, &format!("v{i}"));
    }
    let last = c.raft(leader).last_index();
    // The older copy: the committed prefix, then entries of the old term
    // that the group never committed, reaching beyond the leader's commit.
    c.nodes.get_mut(&follower).unwrap().up = false;
    {
        let node = c.nodes.get_mut(&follower).unwrap();
        node.storage.entries.retain(|e| e.index <= base);
        for index in base + 1..=last + 5 {
            node.storage.entries.push(Entry {
                index,
                term: old_term,
                payload: EntryPayload::Command(Bytes::from(format!("stale-{index}"))),
            });
        }
        node.storage.hard_state.commit = base;
    }
    c.restart(follower);
    c.nodes.get_mut(&follower).unwrap().up = true;
    assert!(c.raft(follower).last_index() > c.raft(leader).commit_index());
    assert!(c.run_until(50, |c| c.node(follower).applied_index >= last
        && c.raft(follower).last_index() == c.raft(leader).last_index()));
}
