//! Membership: joint consensus, learners, removal, leadership transfer.

use ferry_raft::testing::{test_options, Cluster};
use ferry_raft::{MembershipChange, Request, RequestError, Response, RestoredState, Role};

fn change(c: &mut Cluster, at: u64, change: MembershipChange) -> Result<Response, RequestError> {
    let r = c.request(at, Request::ChangeMembership(change));
    c.deliver_all();
    c.response(at, r)
        .cloned()
        .expect("membership change answered")
}

#[test]
fn add_voter_goes_through_joint_and_leaves_it_automatically() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    c.add_node(4, test_options(4), RestoredState::joining());
    let first = c.request(
        leader,
        Request::ChangeMembership(MembershipChange::AddVoter(4)),
    );
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, first).cloned() else {
        panic!()
    };
    // A second change while one is in progress is refused.
    let second = c.request(
        leader,
        Request::ChangeMembership(MembershipChange::AddLearner(5)),
    );
    assert_eq!(
        c.response(leader, second),
        Some(&Err(RequestError::MembershipChangePending))
    );
    assert!(c.run_until(50, |c| c.all_applied(index + 1)));
    // The joint entry was followed by the leave-joint entry the leader appended itself.
    let (_, joint) = &c.committed[&index];
    let ferry_raft::EntryPayload::Config(joint) = joint else {
        panic!("not a config entry")
    };
    assert!(joint.is_joint());
    let final_config = c.raft(leader).config().clone();
    assert!(!final_config.is_joint());
    assert_eq!(
        final_config.voters.iter().copied().collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    assert_eq!(c.raft(4).config(), &final_config);
    assert_eq!(c.raft(4).role(), Role::Follower);
    let r = c.propose(leader, "after");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!()
    };
    assert!(c.run_until(20, |c| c.all_applied(index)));
}

#[test]
fn removed_voter_is_told_and_stops_campaigning() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let victim = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    assert!(change(&mut c, leader, MembershipChange::Remove(victim)).is_ok());
    assert!(c.run_until(50, |c| c.raft(victim).is_removed()));
    assert!(c.run_until(50, |c| !c.raft(c.leader().unwrap()).config().is_joint()));
    assert_eq!(
        c.node(victim).removed_seen,
        1,
        "Action::Removed is emitted exactly once"
    );
    // Cut off from the rest, it would campaign if it could.
    c.isolate(victim);
    let term = c.raft(victim).term();
    for _ in 0..100 {
        c.tick_all();
    }
    assert_eq!(
        c.raft(victim).term(),
        term,
        "a removed node must not campaign"
    );
    let r = c.propose(victim, "x");
    assert_eq!(c.response(victim, r), Some(&Err(RequestError::Removed)));
    let s = c.request(victim, Request::Status);
    assert!(matches!(c.response(victim, s), Some(Ok(Response::Status(st))) if st.removed));
    assert_eq!(c.node(victim).removed_seen, 1);
}

#[test]
fn leader_removing_itself_steps_down_after_commit() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    assert!(change(&mut c, leader, MembershipChange::Remove(leader)).is_ok());
    assert!(c.run_until(50, |c| c.raft(leader).is_removed()));
    assert_ne!(c.raft(leader).role(), Role::Leader);
    assert!(c.run_until(300, |c| c
        .nodes
        .iter()
        .any(|(&id, n)| id != leader && n.raft.role() == Role::Leader)));
    let new = c
        .nodes
        .iter()
        .find(|(&id, n)| id != leader && n.raft.role() == Role::Leader)
        .map(|(&id, _)| id)
        .unwrap();
    assert_eq!(c.raft(new).config().voters.len(), 2);
}

#[test]
fn learner_is_promoted_only_once_caught_up() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    c.add_node(4, test_options(4), RestoredState::joining());
    c.partition(leader, 4);
    assert!(change(&mut c, leader, MembershipChange::AddLearner(4)).is_ok());
    for i in 0..100 {
        c.propose(leader, &format!("fill{i}"));
    }
    c.deliver_all();
    c.tick_all();
    let refused = change(&mut c, leader, MembershipChange::PromoteLearner(4));
    assert!(
        matches!(refused, Err(RequestError::LearnerNotCaughtUp { id: 4, .. })),
        "{refused:?}"
    );
    c.heal();
    assert!(c.run_until(50, |c| c.node(4).applied_index
        >= c.raft(leader).commit_index()));
    assert_eq!(c.raft(4).role(), Role::Learner);
    // A learner never campaigns, however long it waits.
    assert!(change(&mut c, leader, MembershipChange::PromoteLearner(4)).is_ok());
    assert!(c.run_until(50, |c| c.raft(4).config().is_voter(4)
        && !c.raft(4).config().is_joint()));
    assert_eq!(c.raft(4).role(), Role::Follower);
    // Removing a learner is one step (no joint config).
    c.add_node(5, test_options(5), RestoredState::joining());
    assert!(change(&mut c, leader, MembershipChange::AddLearner(5)).is_ok());
    assert!(c.run_until(20, |c| c.raft(leader).config().is_learner(5)));
    let Ok(Response::Proposed { index, .. }) = change(&mut c, leader, MembershipChange::Remove(5))
    else {
        panic!()
    };
    assert!(c.run_until(20, |c| c.raft(leader).commit_index() >= index));
    assert!(!c.raft(leader).config().contains(5));
    assert!(
        !matches!(&c.committed[&index].1, ferry_raft::EntryPayload::Config(cfg) if cfg.is_joint())
    );
}

#[test]
fn invalid_changes_are_refused_with_reasons() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    assert!(matches!(
        change(&mut c, leader, MembershipChange::AddVoter(2)),
        Err(RequestError::InvalidMembershipChange { .. })
    ));
    assert!(matches!(
        change(&mut c, leader, MembershipChange::Remove(9)),
        Err(RequestError::InvalidMembershipChange { .. })
    ));
    assert!(matches!(
        change(&mut c, leader, MembershipChange::PromoteLearner(2)),
        Err(RequestError::InvalidMembershipChange { .. })
    ));
}

#[test]
fn leadership_transfer_hands_over_and_blocks_proposals_meanwhile() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let target = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    // Hold the target back so the transfer must catch it up first.
    c.partition(leader, target);
    c.propose(leader, "before");
    c.deliver_all();
    let t = c.request(leader, Request::TransferLeadership(target));
    assert_eq!(c.response(leader, t), Some(&Ok(Response::TransferStarted)));
    let p = c.propose(leader, "during");
    assert_eq!(
        c.response(leader, p),
        Some(&Err(RequestError::TransferInProgress))
    );
    c.heal();
    assert!(c.run_until(30, |c| c.raft(target).role() == Role::Leader));
    assert!(c.run_until(10, |c| c.raft(leader).leader() == Some(target)));
    let r = c.propose(leader, "after");
    c.deliver_all();
    assert!(matches!(
        c.response(leader, r),
        Some(Ok(Response::Proposed { .. }))
    ));
}

#[test]
fn transfer_aborts_after_an_election_timeout() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let target = [1u64, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    c.partition(leader, target);
    c.propose(leader, "x");
    let _ = c.request(leader, Request::TransferLeadership(target));
    for _ in 0..25 {
        c.tick_all();
    }
    assert_eq!(c.leader(), Some(leader));
    let p = c.propose(leader, "resumed");
    assert!(matches!(
        c.response(leader, p),
        Some(Ok(Response::Proposed { .. }))
    ));
}
