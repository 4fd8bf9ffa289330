//! Regressions for the engine bugs the simulator found (filed in
//! briefs/bugs-for-engine.md). The staged tests rebuild each bug's situation
//! on purpose and stay meaningful whatever the simulator's random choices
//! become; the seed tests replay the seed that first showed the bug (a
//! seed's run is tied to this version of the simulator, so they guard the
//! exact run that failed, while the staged tests guard the class).

use ferry_raft::{MembershipChange, MessageBody, Request, RequestError, Response};
use ferry_sim::config::{SimConfig, TICK_US};
use ferry_sim::run_seed;
use ferry_sim::sim::{Interference, Simulation};

fn assert_seed_passes(seed: u64) {
    let report = run_seed(seed, None, false);
    if let Some(failure) = report.failure {
        panic!("seed {seed}: {failure}\nreplay: ferry sim --seed {seed} --trace");
    }
}

fn elect(sim: &mut Simulation) -> u64 {
    assert!(
        sim.run_until_true(300 * TICK_US, TICK_US, |s| s.leader().is_some()),
        "no leader"
    );
    sim.leader().unwrap()
}

/// BUG-SIM-1, staged: every forward is delivered twice; each write must
/// still be applied exactly once (the simulator fails the run on a second
/// application of one client operation).
#[test]
fn duplicated_forwards_are_applied_once() {
    let mut sim = Simulation::new(SimConfig::quiet(101, 3));
    let leader = elect(&mut sim);
    let follower = if leader == 1 { 2 } else { 1 };
    sim.set_message_hook(Box::new(|_, m| match m.body {
        MessageBody::Forward { .. } => Interference::DuplicateLate(TICK_US / 2),
        _ => Interference::None,
    }));
    let mut tags = Vec::new();
    for i in 0..20 {
        let write = sim.scenario_write(0, 100 + i);
        tags.push(sim.submit(follower, Request::Propose(write)));
        let next = sim.now_us() + TICK_US;
        sim.run_until(next);
    }
    let done = sim.run_until_true(200 * TICK_US, TICK_US, |s| {
        tags.iter().all(|t| s.probe_response(*t).is_some())
    });
    assert!(done, "not every write was answered");
    assert!(sim.run_liveness(), "{:?}", sim.failure());
    assert!(sim.failure().is_none(), "{:?}", sim.failure());
    for tag in tags {
        assert!(matches!(
            sim.probe_response(tag),
            Some(Ok(Response::Proposed { .. }))
        ));
    }
    assert_eq!(sim.machine(follower).and_then(|m| m.get(0)), Some(119));
}

/// BUG-SIM-2, staged: a follower forwards a write, the leader appends it,
/// the answer is lost, and the follower is removed. Its answer to the
/// client must not claim "no effect".
#[test]
fn removed_node_does_not_deny_a_forwarded_write() {
    let mut sim = Simulation::new(SimConfig::quiet(102, 5));
    let leader = elect(&mut sim);
    let follower = if leader == 1 { 2 } else { 1 };
    sim.set_message_hook(Box::new(move |_, m| match m.body {
        MessageBody::ForwardResponse { .. } if m.to == follower => Interference::Drop,
        _ => Interference::None,
    }));
    let write = sim.scenario_write(3, 777);
    let tag = sim.submit(follower, Request::Propose(write));
    let applied = sim.run_until_true(100 * TICK_US, TICK_US, |s| {
        s.machine(leader).and_then(|m| m.get(3)) == Some(777)
    });
    assert!(applied, "the forwarded write was not applied");
    let remove = sim.submit(
        leader,
        Request::ChangeMembership(MembershipChange::Remove(follower)),
    );
    let answered = sim.run_until_true(300 * TICK_US, TICK_US, |s| s.probe_response(tag).is_some());
    assert!(
        sim.probe_response(remove).is_some(),
        "the removal was not answered"
    );
    assert!(answered, "the forwarded write was never answered");
    let answer = sim.probe_response(tag).cloned();
    match answer {
        Some(Ok(Response::Proposed { .. })) | Some(Err(RequestError::Timeout)) => {}
        other => panic!("the write took effect but the removed node answered {other:?}"),
    }
    assert!(sim.failure().is_none(), "{:?}", sim.failure());
}

/// BUG-SIM-1: the seed that first showed a duplicated forward proposed twice.
#[test]
fn seed_16_duplicated_forward_proposed_once() {
    assert_seed_passes(16);
}

/// BUG-SIM-2: the seed that first showed a removed node answering a
/// forwarded write with `Removed`.
#[test]
fn seed_1291_removed_node_forwarded_write_not_definite() {
    assert_seed_passes(1291);
}

/// BUG-SIM-3: a deferred append acknowledgement must carry the current
/// term and must not cover entries a later snapshot install replaced.
#[test]
fn seed_521_ack_carries_current_term() {
    assert_seed_passes(521);
}

/// BUG-SIM-4: a duplicated forward reaching a leader that has stepped down
/// must not lead to the request being proposed twice.
#[test]
fn seed_1524_duplicate_forward_after_step_down() {
    assert_seed_passes(1524);
}

/// BUG-SIM-6: a removed voter that never learned of its removal must not
/// keep the group from converging (pre-vote and check-quorum both off).
#[test]
fn seed_108534_removed_voter_does_not_livelock() {
    assert_seed_passes(108534);
}
