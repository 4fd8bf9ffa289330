//! Alarms: a NOSPACE alarm raised and cleared through the log, the writes
//! it refuses and those it lets through, alarms in snapshots and on disk,
//! and a defragment that gives back what compaction freed.

use std::path::PathBuf;

use super::helpers::*;
use crate::command::{command, CommandKind};
use crate::error::KvError;
use crate::kv_state::{CommandResponse, KvLimits, KvState, ALARMS_MAX};
use crate::pb::etcdserverpb::alarm_request::AlarmAction;
use crate::pb::etcdserverpb::{AlarmMember, AlarmRequest, AlarmType, TxnRequest};
use crate::pb::ferrypb::Command;
use ferry_storage::{AnyDisk, SimDisk};

fn alarm_cmd(action: AlarmAction, member_id: u64, alarm: AlarmType) -> Command {
    command(CommandKind::Alarm(AlarmRequest {
        action: action as i32,
        member_id,
        alarm: alarm as i32,
    }))
}

fn raise(member_id: u64) -> Command {
    crate::command::raise_no_space(member_id)
}

fn clear(member_id: u64) -> Command {
    alarm_cmd(AlarmAction::Deactivate, member_id, AlarmType::Nospace)
}

fn nospace(member_id: u64) -> AlarmMember {
    AlarmMember {
        member_id,
        alarm: AlarmType::Nospace as i32,
    }
}

fn refused(m: &mut Machine, command: Command) -> KvError {
    m.apply(command).response.expect_err("the alarm refuses it")
}

#[test]
fn a_raised_nospace_alarm_refuses_what_grows_the_store_and_lets_the_rest_through() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1"));
    m.ok(put_cmd("b", "1"));
    m.ok(grant_cmd(7, 60));
    assert_eq!(m.ok(raise(3)), CommandResponse::Alarm(vec![nospace(3)]));
    assert!(m.kv.out_of_space());
    assert_eq!(m.kv.alarms(), vec![nospace(3)]);
    let revision = m.revision();

    // Refused, with etcd's error, changing nothing.
    assert_eq!(refused(&mut m, put_cmd("c", "1")), KvError::NoSpace);
    assert_eq!(refused(&mut m, grant_cmd(8, 60)), KvError::NoSpace);
    let nested_put = TxnRequest {
        failure: vec![op_txn(TxnRequest {
            success: vec![op_put("d", "1")],
            ..Default::default()
        })],
        ..Default::default()
    };
    assert_eq!(refused(&mut m, txn_cmd(nested_put)), KvError::NoSpace);
    assert_eq!(m.revision(), revision);
    assert_eq!(m.keys("a", "z"), vec!["a", "b"]);

    // Let through: reads in a txn, deletes, compaction, revokes.
    m.ok(txn_cmd(TxnRequest {
        success: vec![op_range("a", "z"), op_delete("b", "")],
        ..Default::default()
    }));
    m.ok(delete_cmd("a", ""));
    m.ok(compact_cmd(m.revision()));
    m.ok(revoke_cmd(7));
    assert!(m.keys("a", "z").is_empty());

    // Cleared: writes go through again. Clearing what is not raised
    // changes nothing and says so with an empty answer, as etcd does.
    assert_eq!(m.ok(clear(3)), CommandResponse::Alarm(vec![nospace(3)]));
    assert_eq!(m.ok(clear(3)), CommandResponse::Alarm(Vec::new()));
    assert!(!m.kv.out_of_space());
    m.ok(put_cmd("c", "1"));
    assert_eq!(m.keys("a", "z"), vec!["c"]);
}

#[test]
fn every_member_alarm_must_be_cleared_and_unknown_alarms_are_ignored() {
    let mut m = Machine::new();
    m.ok(raise(1));
    m.ok(raise(2));
    // Raising one twice answers nothing new.
    assert_eq!(m.ok(raise(2)), CommandResponse::Alarm(Vec::new()));
    m.ok(clear(1));
    assert_eq!(refused(&mut m, put_cmd("a", "1")), KvError::NoSpace);
    m.ok(clear(2));
    m.ok(put_cmd("a", "1"));

    // NONE and numbers no alarm type has are not raised.
    assert_eq!(
        m.ok(alarm_cmd(AlarmAction::Activate, 1, AlarmType::None)),
        CommandResponse::Alarm(Vec::new())
    );
    let unknown = command(CommandKind::Alarm(AlarmRequest {
        action: AlarmAction::Activate as i32,
        member_id: 1,
        alarm: 99,
    }));
    assert_eq!(m.ok(unknown), CommandResponse::Alarm(Vec::new()));
    assert!(m.kv.alarms().is_empty());
}

#[test]
fn the_alarms_are_bounded() {
    let mut m = Machine::new();
    for member_id in 0..ALARMS_MAX as u64 + 10 {
        m.ok(raise(member_id));
    }
    assert_eq!(m.kv.alarms().len(), ALARMS_MAX);
}

#[test]
fn alarms_travel_in_snapshots_and_survive_a_reopen_from_disk() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1"));
    m.ok(raise(5));
    let restored = KvState::restore(&m.kv.snapshot().unwrap(), KvLimits::default()).unwrap();
    assert_eq!(restored.alarms(), vec![nospace(5)]);
    assert!(restored.out_of_space());

    let disk = SimDisk::with_seed(1);
    let dir = PathBuf::from("/data/kv");
    let mut state = KvState::open(AnyDisk::Sim(disk.clone()), &dir, KvLimits::default()).unwrap();
    state.apply(1, &put_cmd("a", "1"));
    state.apply(2, &raise(5));
    state.checkpoint();
    run_store_jobs(&mut state);
    drop(state);
    let reopened = KvState::open(AnyDisk::Sim(disk), &dir, KvLimits::default()).unwrap();
    assert_eq!(reopened.alarms(), vec![nospace(5)]);
}

#[test]
fn a_defragment_merges_the_whole_store_and_gives_back_what_compaction_freed() {
    let disk = SimDisk::with_seed(2);
    let dir = PathBuf::from("/data/kv");
    let mut state = KvState::open(AnyDisk::Sim(disk), &dir, KvLimits::default()).unwrap();
    let value = "v".repeat(10_000);
    let mut index = 0;
    // Three checkpoints of the same keys written over: three runs, most
    // of them history.
    for _ in 0..3 {
        for round in 0..10 {
            for key in ["a", "b"] {
                index += 1;
                let applied = state.apply(index, &put_cmd(key, &format!("{value}{round}")));
                applied.response.unwrap();
            }
        }
        state.checkpoint();
        run_store_jobs(&mut state);
    }
    let before = state.store().size_bytes();
    assert!(before > 500_000, "{before} bytes of history");
    index += 1;
    let revision = state.store().revision();
    state.apply(index, &compact_cmd(revision)).response.unwrap();
    // The policy's merges do not reach the history in the oldest run.
    assert!(state.store().size_bytes() > before / 2);

    let ticket = state.request_full_merge();
    assert!(!state.store().full_merge_done(ticket));
    run_store_jobs(&mut state);
    assert!(state.store().full_merge_done(ticket));
    let after = state.store().size_bytes();
    // Left: the newest value of each key, and the one b's last put (at
    // the compaction revision) replaced, kept for that revision's event.
    assert!(after < 35_000, "three values of 10 KB left, {after} bytes");
    assert_eq!(state.store().store_stats().runs, 1);
    let a = state.range(&range("a", "")).unwrap().kvs;
    assert_eq!(a[0].value, format!("{value}9").into_bytes());
}
