//! Regression tests for engine bugs the simulator found, one per bug,
//! each rebuilding the situation that showed it.

use ferry_raft::testing::Cluster;
use ferry_raft::{MembershipChange, Message, MessageBody, Request, RequestError, Response};

/// The first `Forward` in flight.
fn forward_in_flight(c: &Cluster) -> Message {
    c.network
        .iter()
        .find(|m| matches!(m.body, MessageBody::Forward { .. }))
        .cloned()
        .expect("a Forward in flight")
}

/// BUG-SIM-1: a Forward delivered twice must become one log entry, and the
/// duplicate is answered with the first outcome.
#[test]
fn duplicated_forward_is_proposed_once() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let r = c.propose(follower, "once");
    let forward = forward_in_flight(&c);
    c.network.push_back(forward.clone());
    c.deliver_all();
    c.network.push_back(forward);
    c.deliver_all();
    let Some(Ok(Response::Proposed { index, .. })) = c.response(follower, r).cloned() else {
        panic!()
    };
    assert!(c.run_until(20, |c| c.all_applied(c.raft(leader).last_index())));
    let copies = c
        .node(leader)
        .applied
        .iter()
        .filter(|b| b.as_ref() == b"once")
        .count();
    assert_eq!(copies, 1, "one request became {copies} entries");
    assert_eq!(c.node(leader).applied[index as usize - 1].as_ref(), b"once");
}

/// BUG-SIM-2: a node removed while a request it forwarded is pending must
/// not answer `Removed` (which means "no effect"): the leader's answer is
/// relayed, or `Timeout` (unknown outcome) at the deadline.
#[test]
fn removed_node_does_not_fail_its_forwarded_requests_as_no_effect() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let victim = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    // Hold the leader's answers to the victim so its forward stays pending
    // while it learns it was removed.
    let change = c.request(
        leader,
        Request::ChangeMembership(MembershipChange::Remove(victim)),
    );
    assert!(matches!(c.response(leader, change), Some(Ok(_))));
    let w = c.propose(victim, "maybe");
    c.deliver_filtered(|m| {
        !(m.to == victim && matches!(m.body, MessageBody::ForwardResponse { .. }))
    });
    assert!(c.run_until(30, |c| c.raft(victim).is_removed()) || c.raft(victim).is_removed());
    match c.response(victim, w) {
        None | Some(Err(RequestError::Timeout)) | Some(Ok(Response::Proposed { .. })) => {}
        Some(other) => panic!("forwarded request answered as if it had no effect: {other:?}"),
    }
    // A request that never left the removed node does fail with Removed.
    let later = c.propose(victim, "late");
    assert_eq!(c.response(victim, later), Some(&Err(RequestError::Removed)));
    assert!(c.run_until(60, |c| c.response(victim, w).is_some()));
    assert_eq!(c.response(victim, w), Some(&Err(RequestError::Timeout)));
}

/// Found by the simulator (seeds 604, 2163, 3422: "acknowledged index 55 to
/// the leader of term 13 but has synced only up to 54"): an append answer
/// held for a sync must not be released after the node moved to a newer
/// term and truncated the entries it would acknowledge.
#[test]
fn held_append_answer_of_an_older_term_is_not_released() {
    use bytes::Bytes;
    use ferry_raft::testing::test_options;
    use ferry_raft::{
        Action, AppendResult, Entry, EntryPayload, HardState, Input, Message, RaftNode,
        RestoredState,
    };
    let entry = |index, term| Entry {
        index,
        term,
        payload: EntryPayload::Command(Bytes::from_static(b"e")),
    };
    let restored = RestoredState {
        hard_state: HardState {
            term: 1,
            vote: None,
            commit: 2,
        },
        entries: vec![entry(1, 1), entry(2, 1)],
        applied: 2,
        ..RestoredState::bootstrap([1, 2, 3])
    };
    let mut node = RaftNode::new(test_options(1), restored, 5).unwrap();
    let mut actions = Vec::new();
    let append = |from, term, entries| {
        Input::Message(Message {
            group: 1,
            from,
            to: 1,
            term,
            body: MessageBody::Append {
                prev_log_index: 2,
                prev_log_term: 1,
                entries,
                leader_commit: 2,
            },
        })
    };
    // The leader of term 2 sends 3..5; the answer waits for the sync.
    node.step(
        append(2, 2, vec![entry(3, 2), entry(4, 2), entry(5, 2)]),
        &mut actions,
    );
    // Before that sync completes, the leader of term 3 overwrites from 3.
    node.step(append(3, 3, vec![entry(3, 3)]), &mut actions);
    let last_seq = actions
        .iter()
        .filter_map(|a| match a {
            Action::Persist(p) => Some(p.seq),
            _ => None,
        })
        .max()
        .unwrap();
    actions.clear();
    node.step(Input::Persisted { seq: last_seq }, &mut actions);
    let acks: Vec<(u64, u64, u64)> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Send(Message {
                to,
                term,
                body: MessageBody::AppendResponse(AppendResult::Success { match_index }),
                ..
            }) => Some((*to, *term, *match_index)),
            _ => None,
        })
        .collect();
    assert_eq!(
        acks,
        vec![(3, 3, 3)],
        "only the current term's answer may go out"
    );
}

/// Found by the simulator (seed 1524): a duplicated `Forward` reached the
/// old leader after it stepped down and was refused with `NotLeader`; that
/// refusal arrived before the answer to the original, and the follower
/// re-sent the request to the next leader: one request, two entries. A
/// `NotLeader` refusal of a forwarded write does not prove "no effect".
#[test]
fn not_leader_refusal_of_a_duplicate_forward_does_not_resend_the_write() {
    use ferry_raft::Input;
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let r = c.propose(follower, "dup");
    let take = |c: &mut Cluster, pred: &dyn Fn(&Message) -> bool| -> Message {
        let i = c.network.iter().position(pred).expect("message in flight");
        c.network.remove(i).unwrap()
    };
    let forward = take(&mut c, &|m| matches!(m.body, MessageBody::Forward { .. }));
    // The original reaches the leader and is executed; its answer is delayed.
    c.step(leader, Input::Message(forward.clone()));
    let answer = take(&mut c, &|m| {
        matches!(m.body, MessageBody::ForwardResponse { .. })
    });
    // The leader learns of a newer term and steps down.
    let mut bump = answer.clone();
    bump.from = follower;
    bump.to = leader;
    bump.term += 1;
    bump.body = MessageBody::HeartbeatResponse {
        read_seq: 0,
        last_index: 0,
        needs_append: false,
    };
    c.step(leader, Input::Message(bump));
    // The network's copy of the Forward arrives now and is refused...
    c.step(leader, Input::Message(forward));
    let refusal = take(&mut c, &|m| {
        matches!(m.body, MessageBody::ForwardResponse { result: Err(_), .. })
    });
    // ...and the refusal overtakes the original answer.
    c.step(follower, Input::Message(refusal));
    c.step(follower, Input::Message(answer));
    assert!(
        matches!(c.response(follower, r), Some(Ok(Response::Proposed { .. }))),
        "{:?}",
        c.response(follower, r)
    );
    assert!(c.run_until(300, |c| c
        .leader()
        .is_some_and(|l| c.all_applied(c.raft(l).commit_index()))));
    for _ in 0..30 {
        c.tick_all();
    }
    let copies = c
        .node(follower)
        .applied
        .iter()
        .filter(|b| b.as_ref() == b"dup")
        .count();
    assert!(copies <= 1, "one request became {copies} entries");
}

/// Found by the simulator (seed 13566, pre-vote and check-quorum off): a
/// voter removed while it was cut off never learns of its removal and
/// campaigns forever with ever higher terms. Members ignore vote requests
/// from nodes outside every configuration they know, so its terms do not
/// spread: not while a leader is alive, and not during the election that
/// follows the leader's loss either (when no leader lease protects them).
#[test]
fn removed_node_that_never_learned_it_cannot_disrupt_the_group() {
    let ids = [1u64, 2, 3, 4, 5];
    let mut c = Cluster::with_options(&ids, |id| {
        let mut o = ferry_raft::testing::test_options(id);
        o.pre_vote = false;
        o.check_quorum = false;
        o
    });
    let leader = c.elect();
    let victim = ids.into_iter().find(|&n| n != leader).unwrap();
    c.isolate(victim);
    let r = c.request(
        leader,
        Request::ChangeMembership(MembershipChange::Remove(victim)),
    );
    assert!(matches!(c.response(leader, r), Some(Ok(_))));
    // Long enough for the removal to commit and the leader to stop
    // replicating to the victim; meanwhile the victim campaigns alone.
    for _ in 0..200 {
        c.tick_all();
    }
    assert!(!c.raft(leader).config().contains(victim));
    assert!(
        !c.raft(victim).is_removed(),
        "the victim never heard of its removal"
    );
    let term = c.raft(leader).term();
    assert!(c.raft(victim).term() > term + 5);
    c.heal();
    for _ in 0..100 {
        c.tick_all();
    }
    assert_eq!(
        c.leader(),
        Some(leader),
        "the removed node deposed the leader"
    );
    assert_eq!(c.raft(leader).term(), term);
    // The leader fails: the members elect a new one among themselves, and
    // the victim's terms still do not spread to them.
    c.nodes.get_mut(&leader).unwrap().up = false;
    let victim_term = c.raft(victim).term();
    assert!(c.run_until(300, |c| c.leader().is_some_and(|l| l != leader)));
    let new = c.leader().unwrap();
    assert_ne!(new, victim);
    assert!(
        c.raft(new).term() < victim_term,
        "the removed node's term spread to the members"
    );
}

/// Found by the simulator (seeds 698 and 18400, pre-vote and check-quorum
/// off): a removed node that never learned of its removal kept raising the
/// term of a lagging follower (which still counted it as a voter), and that
/// follower then deposed every new leader. A node that follows a live
/// leader ignores newer-term vote requests (Raft dissertation §4.2.3), with
/// check-quorum off too; without a live leader it adopts the term as usual
/// (seed 5389: terms must keep converging).
#[test]
fn stale_candidate_does_not_raise_the_term_of_a_follower_with_a_live_leader() {
    use bytes::Bytes;
    use ferry_raft::testing::test_options;
    use ferry_raft::{
        Action, Entry, EntryPayload, HardState, Input, Message, RaftNode, RestoredState,
    };
    let make = || {
        let mut options = test_options(1);
        options.pre_vote = false;
        options.check_quorum = false;
        let entries = (1..=5)
            .map(|index| Entry {
                index,
                term: 1,
                payload: EntryPayload::Command(Bytes::from_static(b"x")),
            })
            .collect();
        let restored = RestoredState {
            hard_state: HardState {
                term: 1,
                vote: None,
                commit: 5,
            },
            entries,
            applied: 5,
            ..RestoredState::bootstrap([1, 2, 3])
        };
        RaftNode::new(options, restored, 1).unwrap()
    };
    let vote = Input::Message(Message {
        group: 1,
        from: 3,
        to: 1,
        term: 9,
        body: MessageBody::RequestVote {
            pre_vote: false,
            last_log_index: 2,
            last_log_term: 1,
            transfer: false,
        },
    });
    // With a live leader: ignored, term unchanged.
    let mut node = make();
    let mut actions = Vec::new();
    let heartbeat = MessageBody::Heartbeat {
        leader_commit: 5,
        read_seq: 0,
    };
    node.step(
        Input::Message(Message {
            group: 1,
            from: 2,
            to: 1,
            term: 1,
            body: heartbeat,
        }),
        &mut actions,
    );
    node.step(vote.clone(), &mut actions);
    assert_eq!(node.term(), 1);
    assert_eq!(node.leader(), Some(2));
    // Also when the candidate's log is more up to date than ours.
    let up_to_date = Input::Message(Message {
        group: 1,
        from: 3,
        to: 1,
        term: 9,
        body: MessageBody::RequestVote {
            pre_vote: false,
            last_log_index: 50,
            last_log_term: 8,
            transfer: false,
        },
    });
    node.step(up_to_date, &mut actions);
    assert_eq!(node.term(), 1);
    // Without a leader: the term is adopted (and the vote refused).
    let mut node = make();
    let mut actions = Vec::new();
    node.step(vote, &mut actions);
    node.step(Input::Persisted { seq: 1 }, &mut actions);
    assert_eq!(node.term(), 9);
    assert!(actions.iter().any(|a| matches!(
        a,
        Action::Send(Message {
            body: MessageBody::RequestVoteResponse { granted: false, .. },
            ..
        })
    )));
}

/// Found by the simulator's disk-fault seeds (seed 2886): a voter added to
/// the group whose leader is then lost for good must still be able to vote
/// before it has heard of any configuration. The joint configuration
/// {1,2,3} & {1,2,3,5} commits without node 5 (3 of 4), the leader dies,
/// and the survivors need node 5's vote. Node 5 knows no configuration; it
/// used to ignore every candidate it did not know as a voter, and the group
/// could never elect again.
#[test]
fn a_joining_voter_that_knows_no_configuration_still_votes() {
    use ferry_raft::testing::test_options;
    use ferry_raft::RestoredState;

    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    c.add_node(5, test_options(5), RestoredState::joining());
    // Node 5 never hears from this leader.
    c.partition(leader, 5);
    let change = c.request(
        leader,
        Request::ChangeMembership(MembershipChange::AddVoter(5)),
    );
    assert!(matches!(
        c.response(leader, change),
        Some(Ok(Response::Proposed { .. }))
    ));
    let survivors: Vec<u64> = [1u64, 2, 3].into_iter().filter(|&n| n != leader).collect();
    assert!(
        c.run_until(50, |c| survivors
            .iter()
            .all(|&n| c.raft(n).config().is_voter(5))),
        "the change adding node 5 must commit without it"
    );
    assert!(
        c.raft(5).config().voters.is_empty(),
        "node 5 has heard nothing"
    );
    // The leader is lost for good: the survivors need node 5's vote.
    c.isolate(leader);
    assert!(
        c.run_until(400, |c| survivors
            .iter()
            .any(|&n| c.raft(n).role() == ferry_raft::Role::Leader)),
        "no leader without the old one: node 5 ignored the candidates"
    );
}

/// Found by the simulator's disk-fault seeds (seed 6975): a lagging voter
/// that has not yet seen the configuration adding node 5 must still hear
/// node 5's campaign when node 5's log is ahead of its own. Here the leader
/// dies for good with node 5 the only survivor holding its last entry, so
/// only node 5 can win, and it needs the lagging voter's vote. The lagging
/// voter used to ignore every candidate it did not know as a voter.
#[test]
fn a_lagging_voter_hears_a_new_voter_whose_log_is_ahead() {
    use ferry_raft::testing::test_options;
    use ferry_raft::{RestoredState, Role};

    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let others: Vec<u64> = [1u64, 2, 3].into_iter().filter(|&n| n != leader).collect();
    let (lagging, other) = (others[0], others[1]);
    c.add_node(5, test_options(5), RestoredState::joining());
    c.isolate(lagging);
    let change = c.request(
        leader,
        Request::ChangeMembership(MembershipChange::AddVoter(5)),
    );
    assert!(matches!(
        c.response(leader, change),
        Some(Ok(Response::Proposed { .. }))
    ));
    let settled = |c: &Cluster, n: u64| {
        let config = c.raft(n).config();
        config.is_voter(5) && !config.is_joint()
    };
    assert!(
        c.run_until(100, |c| [leader, other, 5].iter().all(|&n| settled(c, n))),
        "{{1,2,3,5}} must commit without the lagging voter"
    );
    assert!(!c.raft(lagging).config().is_voter(5));
    // One more entry reaches node 5 but not the other survivor.
    c.partition(leader, other);
    c.propose(leader, "only node 5 has this");
    let last = c.raft(leader).last_index();
    assert!(c.run_until(50, |c| c.raft(5).last_index() == last));
    assert!(c.raft(other).last_index() < last);
    // The leader is lost for good; the lagging voter comes back.
    c.heal();
    c.isolate(leader);
    assert!(
        c.run_until(600, |c| c.raft(5).role() == Role::Leader),
        "node 5 could not win: the lagging voter ignored it"
    );
}

/// Found by the simulator (with every node holding back its vote after a
/// start, which made this path likely): a leader removed voter 2 from
/// {1, 2, 3, 4} and crashed just after the change left its joint phase.
/// Node 2 had learned that the change committed (so it no longer votes)
/// and held one more entry than anyone; nodes 1 and 3 had not (they still
/// count 2 as a voter of the old half) and node 4 was down. 1 and 3 each
/// needed three of {1, 2, 3, 4}; 2 refused both (its log was longer) and
/// could not campaign. Nobody could ever win. A refusing voter now tells
/// the candidate what it knows committed, and the candidate, whose log
/// holds that entry, puts the new configuration in force and wins.
#[test]
fn a_candidate_learns_a_committed_configuration_from_a_voter_that_refuses_it() {
    use ferry_raft::testing::test_options;
    use ferry_raft::{Configuration, Entry, EntryPayload, HardState, RestoredState};

    let founding = Configuration::with_voters([1, 2, 3, 4]);
    let joint = Configuration {
        voters: [1, 3, 4].into(),
        voters_outgoing: [1, 2, 3, 4].into(),
        learners: Default::default(),
    };
    let without_2 = Configuration::with_voters([1, 3, 4]);
    let entry = |index, payload| Entry {
        term: 1,
        index,
        payload,
    };
    let log = vec![
        entry(1, EntryPayload::Noop),
        entry(2, EntryPayload::Config(joint.clone())),
        entry(3, EntryPayload::Config(without_2.clone())),
    ];
    let restored = |entries: Vec<Entry>, commit| RestoredState {
        hard_state: HardState {
            term: 1,
            vote: None,
            commit,
        },
        entries,
        ..RestoredState::bootstrap(founding.voters.iter().copied())
    };
    let mut c = Cluster::with_options(&[], test_options);
    // 1 and 3 know the joint configuration committed, not the way out of it.
    c.add_node(1, test_options(1), restored(log.clone(), 2));
    c.add_node(3, test_options(3), restored(log.clone(), 2));
    // 2 knows the change committed, and holds one entry more.
    let mut longer = log;
    longer.push(entry(4, EntryPayload::Command("late".into())));
    c.add_node(2, test_options(2), restored(longer, 3));
    // Node 4 is down (never started here): messages to it are lost.
    assert_eq!(c.raft(1).config(), &joint);
    assert_eq!(c.raft(2).config(), &without_2);

    assert!(
        c.run_until(300, |c| c.leader().is_some()),
        "no leader: 1 and 3 wait for a vote from 2, which refuses them"
    );
    let leader = c.leader().unwrap();
    assert!([1, 3].contains(&leader));
    assert_eq!(c.raft(leader).config(), &without_2);
    // And the group works: a write commits with 1 and 3.
    let w = c.propose(leader, "after");
    assert!(c.run_until(20, |c| matches!(c.response(leader, w), Some(Ok(_)))));
}

/// BUG-SIM-7, found by the simulator (seed 256499): a leader executed a
/// forwarded write and answered it, crashed (forgetting which forwards it
/// had executed: that memory is kept for duplicates within a term), and
/// led again, in a later term, when the network's late copy of the
/// Forward arrived: the copy became a second entry. A leader does not
/// execute a write forwarded in an older term.
#[test]
fn a_restarted_leader_does_not_execute_a_write_forwarded_in_an_older_term() {
    use ferry_raft::Input;
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let r = c.propose(follower, "late");
    let forward = forward_in_flight(&c);
    c.deliver_all();
    assert!(
        matches!(c.response(follower, r), Some(Ok(Response::Proposed { .. }))),
        "{:?}",
        c.response(follower, r)
    );
    assert!(c.run_until(20, |c| c.all_applied(c.raft(leader).last_index())));

    c.restart(leader);
    // It leads again: elected, or handed the leadership.
    assert!(c.run_until(300, |c| c.leader().is_some()));
    if let Some(other) = c.leader().filter(|&other| other != leader) {
        c.request(other, Request::TransferLeadership(leader));
        assert!(c.run_until(100, |c| c.leader() == Some(leader)));
    }
    assert!(c.raft(leader).term() > forward.term);
    c.step(leader, Input::Message(forward));
    c.deliver_all();
    assert!(c.run_until(50, |c| c.all_applied(c.raft(leader).last_index())));
    for node in [1u64, 2, 3] {
        let copies = c
            .node(node)
            .applied
            .iter()
            .filter(|b| b.as_ref() == b"late")
            .count();
        assert_eq!(
            copies, 1,
            "node {node}: one request became {copies} entries"
        );
    }
}
