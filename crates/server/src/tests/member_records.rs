//! Member addresses recorded in the replicated state: merged field by field,
//! kept in snapshots, and overlaid on the addresses given at start.

use std::collections::BTreeMap;

use super::helpers::*;
use crate::command::{command, CommandKind};
use crate::kv_state::{CommandResponse, KvLimits, KvState};
use crate::node::MemberAddrs;
use crate::pb::ferrypb::{Command, MemberRecordCommand};

fn record(id: u64, name: &str, peer_addr: &str, client_url: &str) -> Command {
    command(CommandKind::MemberRecord(MemberRecordCommand {
        id,
        name: name.into(),
        peer_addr: peer_addr.into(),
        client_url: client_url.into(),
        create: false,
    }))
}

/// The record a MemberAdd proposes: it must create the member.
fn add_record(id: u64, peer_addr: &str) -> Command {
    command(CommandKind::MemberRecord(MemberRecordCommand {
        id,
        peer_addr: peer_addr.into(),
        create: true,
        ..Default::default()
    }))
}

#[test]
fn two_adds_that_picked_the_same_id_cannot_both_create_it() {
    let mut m = Machine::new();
    assert_eq!(
        m.ok(add_record(4, "127.0.0.1:42380")),
        CommandResponse::MemberRecorded
    );
    // An add through another node picked the same id at the same moment:
    // refused on every replica, and the first member's address stays.
    assert_eq!(
        m.apply(add_record(4, "127.0.0.1:52380")).response,
        Err(crate::error::KvError::MemberIdTaken)
    );
    assert_eq!(m.kv.member_records()[&4].peer_addr, "127.0.0.1:42380");
    // The member's own publish (not a create) still merges.
    m.ok(record(4, "ferry-4", "", "http://127.0.0.1:42379"));
    assert_eq!(m.kv.member_records()[&4].name, "ferry-4");
}

#[test]
fn a_record_fills_in_fields_without_erasing_known_ones_nor_bumping_the_revision() {
    let mut m = Machine::new();
    m.ok(put_cmd("a", "1"));
    let revision = m.revision();
    assert_eq!(
        m.ok(record(4, "ferry-4", "10.0.0.4:2380", "")),
        CommandResponse::MemberRecorded
    );
    // The member publishes its client URL later; the peer address stays.
    m.ok(record(4, "", "", "http://10.0.0.4:2379"));
    let recorded = &m.kv.member_records()[&4];
    assert_eq!(recorded.name, "ferry-4");
    assert_eq!(recorded.peer_addr, "10.0.0.4:2380");
    assert_eq!(recorded.client_url, "http://10.0.0.4:2379");
    assert_eq!(
        m.revision(),
        revision,
        "member records are not key-value writes"
    );
}

#[test]
fn records_survive_a_snapshot() {
    let mut m = Machine::new();
    m.ok(record(
        4,
        "ferry-4",
        "10.0.0.4:2380",
        "http://10.0.0.4:2379",
    ));
    m.ok(record(5, "ferry-5", "10.0.0.5:2380", ""));
    let restored = KvState::restore(&m.kv.snapshot().unwrap(), KvLimits::default()).unwrap();
    assert_eq!(restored.member_records(), m.kv.member_records());
    assert_eq!(restored, m.kv);
}

#[test]
fn recorded_addresses_override_those_given_at_start() {
    let mut founding = BTreeMap::new();
    founding.insert(
        1,
        MemberAddrs {
            name: "ferry-1".into(),
            peer_addr: "old:2380".into(),
            client_url: "http://old:2379".into(),
        },
    );
    let mut m = Machine::new();
    m.ok(record(1, "", "new:2380", ""));
    m.ok(record(4, "ferry-4", "ten:2380", ""));
    let records = m.kv.member_records();
    let one = crate::node::member_addrs(&founding, records, 1).unwrap();
    assert_eq!(one.peer_addr, "new:2380");
    assert_eq!(one.client_url, "http://old:2379");
    let four = crate::node::member_addrs(&founding, records, 4).unwrap();
    assert_eq!(four.peer_addr, "ten:2380");
    assert_eq!(four.client_url, "", "not published yet");
    assert!(crate::node::member_addrs(&founding, records, 9).is_none());
}
