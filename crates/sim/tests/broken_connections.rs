//! A message belongs to the connection it was sent on: once the runtime
//! has reported that connection broken (`PeerDisconnected`, on a crash or a
//! cut both ways), nothing still in flight on it arrives, as with a real
//! transport, which delivers a connection's messages before it reports the
//! connection gone or loses them. With quiescence on the engine relies on
//! that order: a quiesce notice from a crashed leader delivered after the
//! crash was reported would silence its followers for good.

use std::cell::Cell;
use std::rc::Rc;

use ferry_raft::MessageBody;
use ferry_sim::config::{SimConfig, TICK_US};
use ferry_sim::sim::{run_seed_in_groups_with, Interference, Simulation};
use ferry_sim::QuiesceMode;

/// The leader goes quiet with its notices still in flight and crashes: the
/// notices are lost with its connections, and the followers, told their
/// leader is gone, elect another instead of going quiet under a dead one.
#[test]
fn a_crashed_leaders_quiesce_notices_in_flight_are_lost() {
    let mut config = SimConfig::quiet(21, 3);
    config.engine.quiesce = true;
    let election_us = u64::from(config.engine.election_timeout_ticks) * TICK_US;
    let mut sim = Simulation::new(config);
    assert!(sim.run_until_true(300 * TICK_US, TICK_US, |s| s.leader().is_some()));
    let leader = sim.leader().expect("a leader");
    // Hold every quiesce notice on the wire for two ticks.
    let held = Rc::new(Cell::new(0u64));
    let seen = Rc::clone(&held);
    sim.set_message_hook(Box::new(move |_, m| {
        if matches!(m.body, MessageBody::Quiesce { .. }) {
            seen.set(seen.get() + 1);
            Interference::Delay(2 * TICK_US)
        } else {
            Interference::None
        }
    }));
    let quiet = sim.run_until_true(200 * TICK_US, 10, |s| {
        s.engine(leader).is_some_and(|e| e.is_quiescent())
    });
    assert!(quiet, "the idle group's leader did not go quiet");
    assert!(held.get() > 0, "no quiesce notice was sent");
    let term = sim.engine(leader).map_or(0, |e| e.term());
    sim.crash_node(leader);
    sim.clear_message_hook();
    // Well past the notices' arrival: no follower went quiet under the dead
    // leader, and one of them leads in a later term.
    let elected = sim.run_until_true(10 * election_us, TICK_US, |s| {
        s.leader()
            .is_some_and(|l| l != leader && s.engine(l).is_some_and(|e| e.term() > term))
    });
    let followers: Vec<String> = sim
        .config()
        .voter_ids()
        .into_iter()
        .filter(|&n| n != leader)
        .map(|n| {
            let e = sim.engine(n).expect("running");
            format!(
                "n{n}: {:?} term {} leader {:?} quiescent {}",
                e.role(),
                e.term(),
                e.leader(),
                e.is_quiescent()
            )
        })
        .collect();
    assert!(
        elected,
        "no new leader within 10 election timeouts of the crash: {followers:?}"
    );
}

/// The sweep's seed that found it: eight groups, quiescence on; node 1
/// leads an idle group, goes quiet, crashes with its notices in flight and
/// never comes back (its disk is found corrupt), so the group needs its
/// followers' timers to elect another leader.
#[test]
fn seed_871_with_eight_groups_and_quiescence_passes() {
    let report = run_seed_in_groups_with(871, None, 8, false, QuiesceMode::On);
    if let Some(failure) = &report.failure {
        panic!("{failure}\nreplay: ferry sim --seed 871 --groups 8 --quiesce on --trace");
    }
    assert!(report.quiesce && report.quiesce_notices > 0);
}

/// Found while making a quiet leader drop the late answers of its caught-up
/// followers (they had woken it forever on a loaded host): eight groups,
/// quiescence on. A follower went quiet on the notice, then got a delayed
/// copy of an append its leader had sent before the notice, woke with its
/// election timer running, and its answers no longer woke the quiet
/// leader: it campaigned and deposed a healthy leader, again and again.
/// A quiet follower now answers such a copy without waking.
#[test]
fn seed_286_with_eight_groups_and_quiescence_passes() {
    let report = run_seed_in_groups_with(286, None, 8, false, QuiesceMode::On);
    if let Some(failure) = &report.failure {
        panic!("{failure}\nreplay: ferry sim --seed 286 --groups 8 --quiesce on --trace");
    }
    assert!(report.quiesce && report.quiesce_notices > 0);
}
