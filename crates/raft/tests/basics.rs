//! Elections, replication and commit in a healthy cluster.

use ferry_raft::testing::Cluster;
use ferry_raft::{Input, ReadConsistency, Request, Response, Role};

#[test]
fn three_nodes_elect_one_leader_and_replicate() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let leaders = c
        .nodes
        .values()
        .filter(|n| n.raft.role() == Role::Leader)
        .count();
    assert_eq!(leaders, 1);
    let r = c.propose(leader, "x=1");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!("not proposed")
    };
    assert!(c.run_until(20, |c| c.all_applied(index)));
    for n in c.nodes.values() {
        assert_eq!(n.applied[index as usize - 1].as_ref(), b"x=1");
    }
}

#[test]
fn single_node_group_commits_alone() {
    let mut c = Cluster::new(&[1]);
    let leader = c.elect();
    assert_eq!(leader, 1);
    let r = c.propose(1, "solo");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(1, r).cloned() else {
        panic!()
    };
    assert!(c.run_until(5, |c| c.all_applied(index)));
}

#[test]
fn follower_forwards_proposals_and_reads() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    let follower = [1, 2, 3].into_iter().find(|&n| n != leader).unwrap();
    let r = c.propose(follower, "fwd");
    c.deliver_all();
    let Some(Ok(Response::Proposed { index, .. })) = c.response(follower, r).cloned() else {
        panic!(
            "forwarded proposal not answered: {:?}",
            c.response(follower, r)
        )
    };
    let read = c.request(follower, Request::Read(ReadConsistency::Linearizable));
    assert!(c.run_until(20, |c| c.response(follower, read).is_some()));
    let Some(Ok(Response::ReadReady { index: read_index })) = c.response(follower, read).cloned()
    else {
        panic!()
    };
    assert!(read_index >= index);
    assert!(c.node(follower).applied_index >= read_index);
}

#[test]
fn persistence_gates_votes_and_acks() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.auto_sync = false;
    // Nothing is acknowledged while nothing is synced: no leader can emerge.
    for _ in 0..60 {
        c.tick_all();
    }
    assert!(
        c.leader().is_none(),
        "a leader was elected on votes that were never synced"
    );
    c.auto_sync = true;
    for id in [1, 2, 3] {
        c.sync(id);
    }
    c.deliver_all();
    let leader = c.elect();
    c.step(leader, Input::Tick);
    assert!(c.raft(leader).term() > 0);
}

#[test]
fn the_bytes_crate_is_re_exported_for_embedders() {
    // An embedder names the engine's Bytes through the engine: one version.
    let command: ferry_raft::bytes::Bytes = ferry_raft::bytes::Bytes::from_static(b"x=1");
    let mut c = Cluster::new(&[1]);
    let leader = c.elect();
    let r = c.request(leader, Request::Propose(command));
    assert!(matches!(
        c.response(leader, r),
        Some(Ok(Response::Proposed { .. }))
    ));
}

#[test]
fn only_a_leader_reports_its_peers_progress_and_it_reaches_the_last_index() {
    let mut c = Cluster::new(&[1, 2, 3]);
    let leader = c.elect();
    for id in [1, 2, 3].into_iter().filter(|&id| id != leader) {
        assert!(c.raft(id).peer_progress().is_none(), "node {id} follows");
    }
    let r = c.propose(leader, "x=1");
    let Some(Ok(Response::Proposed { index, .. })) = c.response(leader, r).cloned() else {
        panic!("not proposed")
    };
    assert!(c.run_until(20, |c| c.all_applied(index)));
    let progress = c.raft(leader).peer_progress().expect("the leader's view");
    let peers: Vec<u64> = progress.keys().copied().collect();
    let mut others: Vec<u64> = [1, 2, 3].into_iter().filter(|&id| id != leader).collect();
    others.sort_unstable();
    assert_eq!(peers, others, "every peer, not the leader itself");
    let last = c.raft(leader).last_index();
    for (peer, p) in progress {
        assert_eq!(p.match_index, last, "peer {peer} caught up");
    }
}
