//! `Request::Campaign`: an embedder asks a node to start an election now
//! (as etcd raft's `Campaign`). Answered at once in every state.

use ferry_raft::testing::{test_options, Cluster};
use ferry_raft::{
    CampaignOutcome, CampaignRefusal, MembershipChange, Options, Request, RequestError, Response,
    Role,
};

fn campaign(c: &mut Cluster, id: u64) -> Result<Response, RequestError> {
    let r = c.request(id, Request::Campaign);
    c.response(id, r).cloned().expect("answered at once")
}

#[test]
fn a_follower_campaigns_at_once_and_wins_a_group_without_a_leader() {
    let mut c = Cluster::new(&[1, 2, 3]);
    // No tick yet: no election timer has fired anywhere.
    assert_eq!(
        campaign(&mut c, 2),
        Ok(Response::Campaign(CampaignOutcome::Started))
    );
    assert_eq!(c.raft(2).role(), Role::PreCandidate);
    c.deliver_all();
    assert_eq!(c.leader(), Some(2));
    assert_eq!(
        campaign(&mut c, 2),
        Ok(Response::Campaign(CampaignOutcome::AlreadyLeader))
    );
}

#[test]
fn without_pre_vote_a_campaign_raises_the_term_at_once() {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o: Options = test_options(id);
        o.pre_vote = false;
        o
    });
    assert_eq!(
        campaign(&mut c, 3),
        Ok(Response::Campaign(CampaignOutcome::Started))
    );
    assert_eq!((c.raft(3).role(), c.raft(3).term()), (Role::Candidate, 1));
    assert_eq!(
        campaign(&mut c, 3),
        Ok(Response::Campaign(CampaignOutcome::AlreadyCampaigning))
    );
    c.deliver_all();
    assert_eq!(c.leader(), Some(3));
}

#[test]
fn pre_vote_protects_a_healthy_leader_from_a_campaign() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let term = c.raft(leader).term();
    let follower = [1, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    assert_eq!(
        campaign(&mut c, follower),
        Ok(Response::Campaign(CampaignOutcome::Started))
    );
    c.deliver_all();
    // The others heard the leader recently and refuse the pre-vote.
    assert_eq!(c.leader(), Some(leader));
    assert_eq!(c.raft(leader).term(), term);
    c.tick_all();
    assert_eq!(c.raft(follower).leader(), Some(leader));
}

#[test]
fn a_campaign_replaces_a_dead_leader_sooner_than_the_timers() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    c.nodes.get_mut(&leader).unwrap().up = false;
    let follower = [1, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    // Once the leader's lease has run out on the other follower (one
    // election timeout without it), the campaign wins at once.
    for _ in 0..test_options(1).election_timeout_ticks {
        let others: Vec<u64> = c
            .nodes
            .keys()
            .copied()
            .filter(|&n| n != leader && n != follower)
            .collect();
        for n in others {
            c.step(n, ferry_raft::Input::Tick);
        }
        c.drop_all();
    }
    assert_eq!(
        campaign(&mut c, follower),
        Ok(Response::Campaign(CampaignOutcome::Started))
    );
    c.deliver_all();
    assert_eq!(c.leader(), Some(follower));
}

#[test]
fn a_learner_refuses_with_a_typed_error() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    c.add_node(4, test_options(4), ferry_raft::RestoredState::joining());
    c.request(
        leader,
        Request::ChangeMembership(MembershipChange::AddLearner(4)),
    );
    assert!(c.run_until(20, |c| c.raft(4).role() == Role::Learner));
    assert_eq!(
        campaign(&mut c, 4),
        Err(RequestError::CannotCampaign {
            reason: CampaignRefusal::NotVoter
        })
    );
    assert_eq!(c.raft(4).role(), Role::Learner);
}

#[test]
fn a_removed_node_refuses_with_removed() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let victim = [1, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    c.request(
        leader,
        Request::ChangeMembership(MembershipChange::Remove(victim)),
    );
    assert!(c.run_until(50, |c| c.raft(victim).is_removed()));
    assert_eq!(campaign(&mut c, victim), Err(RequestError::Removed));
}

#[test]
fn a_campaign_wakes_a_quiescent_follower() {
    let mut c = Cluster::with_options(&[1, 2, 3], |id| {
        let mut o = test_options(id);
        o.quiesce = true;
        o
    });
    let leader = c.elect();
    c.propose(leader, "w");
    assert!(c.run_until(20, |c| c.nodes.values().all(|n| n.raft.is_quiescent())));
    let follower = [1, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    assert_eq!(
        campaign(&mut c, follower),
        Ok(Response::Campaign(CampaignOutcome::Started))
    );
    assert!(!c.raft(follower).is_quiescent());
    c.deliver_all();
    // Its pre-vote woke the others; the leader they still hear stays.
    assert!(c.nodes.values().all(|n| !n.raft.is_quiescent()));
    assert_eq!(c.leader(), Some(leader));
}
