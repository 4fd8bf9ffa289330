//! Member addresses recorded in the replicated state: merged field by field,
//! kept in snapshots, and overlaid on the addresses given at start.

use std::collections::BTreeMap;

use super::helpers::*;
use crate::command::{command, CommandKind};
use crate::kv_state::{CommandResponse, KvLimits, KvState};
use crate::pb::ferrypb::{Command, MemberRecordCommand};
use crate::runtime::MemberAddrs;

fn record(id: u64, name: &str, peer_addr: &str, client_url: &str) -> Command {
    command(CommandKind::MemberRecord(MemberRecordCommand {
        id,
        name: name.into(),
        peer_addr: peer_addr.into(),
        client_url: client_url.into(),
    }))
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
    let restored = KvState::restore(&m.kv.snapshot(), KvLimits::default()).unwrap();
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
    let one = crate::runtime::member_addrs(&founding, records, 1).unwrap();
    assert_eq!(one.peer_addr, "new:2380");
    assert_eq!(one.client_url, "http://old:2379");
    let four = crate::runtime::member_addrs(&founding, records, 4).unwrap();
    assert_eq!(four.peer_addr, "ten:2380");
    assert_eq!(four.client_url, "", "not published yet");
    assert!(crate::runtime::member_addrs(&founding, records, 9).is_none());
}
