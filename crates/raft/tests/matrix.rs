//! The state/request matrix: a node is put in each role or sub-state and fed
//! each kind of input; the observed outcome must be the one documented in
//! the crate docs (the table in lib.rs is this test's EXPECTED table). No
//! pair may panic, and no client request may go unanswered: each is
//! answered at once, forwarded, or held and then answered by its deadline.

use bytes::Bytes;
use ferry_raft::testing::test_options;
use ferry_raft::{
    Action, AppendResult, Configuration, Entry, EntryPayload, HardState, Input, MembershipChange,
    Message, MessageBody, RaftNode, ReadConsistency, Request, RequestError, RequestId, Response,
    RestoredState, Role, SnapshotMeta, SnapshotOutcome,
};

const ROWS: [&str; 11] = [
    "follower",
    "follower quiescent",
    "follower receiving snapshot",
    "pre-candidate",
    "candidate",
    "leader",
    "leader quiescent",
    "leader transferring",
    "learner",
    "removed",
    "halted",
];

const COLUMNS: [&str; 33] = [
    "RequestVote (newer term)",
    "pre-vote RequestVote",
    "RequestVoteResponse (granted)",
    "Append",
    "AppendResponse (success)",
    "Heartbeat",
    "HeartbeatResponse",
    "SnapshotChunk (first)",
    "SnapshotChunkAck",
    "SnapshotResponse (installed)",
    "TimeoutNow",
    "Forward (proposal)",
    "ForwardResponse (unknown id)",
    "Quiesce",
    "WakeUp",
    "any message from an older term",
    "Propose",
    "Read Linearizable",
    "Read Lease",
    "Read Local",
    "Read Local (min_applied ahead)",
    "ChangeMembership",
    "TransferLeadership",
    "Campaign",
    "Status",
    "Tick",
    "Persisted",
    "SnapshotBuilt",
    "SnapshotChunkLoaded",
    "SnapshotChunkSaved",
    "EntriesLoaded",
    "PeerConnected",
    "PeerDisconnected",
];

fn options(id: u64) -> ferry_raft::Options {
    let mut o = test_options(id);
    o.lease_reads = true;
    o
}

/// The options of the quiescent rows: quiescence on, the rest alike.
fn quiesce_options(id: u64) -> ferry_raft::Options {
    let mut o = options(id);
    o.quiesce = true;
    o
}

fn msg(from: u64, term: u64, body: MessageBody) -> Input {
    Input::Message(Message {
        group: 1,
        from,
        to: 1,
        term,
        body,
    })
}

fn entries(n: u64) -> Vec<Entry> {
    (1..=n)
        .map(|i| Entry {
            index: i,
            term: 1,
            payload: EntryPayload::Command(Bytes::from_static(b"x")),
        })
        .collect()
}

fn restored(config: Configuration, log: Vec<Entry>) -> RestoredState {
    let commit = log.len() as u64;
    RestoredState {
        hard_state: HardState {
            term: 1,
            vote: None,
            commit,
        },
        snapshot: SnapshotMeta {
            index: 0,
            term: 0,
            config,
        },
        entries: log,
        outline: None,
        applied: commit,
    }
}

/// Feeds `input`, then completes any persist it asked for (so replies
/// held for durability show up).
fn feed(node: &mut RaftNode, input: Input) -> Vec<Action> {
    let mut actions = Vec::new();
    node.step(input, &mut actions);
    let seqs: Vec<u64> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Persist(p) => Some(p.seq),
            _ => None,
        })
        .collect();
    for seq in seqs {
        node.step(Input::Persisted { seq }, &mut actions);
    }
    actions
}

fn heartbeat_from_2(node: &mut RaftNode) {
    let term = node.term();
    feed(
        node,
        msg(
            2,
            term,
            MessageBody::Heartbeat {
                leader_commit: 3,
                read_seq: 0,
            },
        ),
    );
}

type OptionsFn = fn(u64) -> ferry_raft::Options;

fn pre_candidate(options: OptionsFn) -> RaftNode {
    let voters = Configuration::with_voters([1, 2, 3]);
    let mut n = RaftNode::new(options(1), restored(voters, entries(3)), 1).unwrap();
    while n.role() != Role::PreCandidate {
        feed(&mut n, Input::Tick);
    }
    n
}

fn candidate(options: OptionsFn) -> RaftNode {
    let mut n = pre_candidate(options);
    feed(
        &mut n,
        msg(
            2,
            2,
            MessageBody::RequestVoteResponse {
                pre_vote: true,
                granted: true,
                commit: 0,
                commit_term: 0,
            },
        ),
    );
    assert_eq!(n.role(), Role::Candidate);
    n
}

/// A leader of term 2 whose no-op is committed. With `all_matched` both
/// followers have the whole log (the group is idle); otherwise node 3 lags
/// one entry behind and one heartbeat round answered by both makes the
/// lease fresh.
fn leader_node(options: OptionsFn, all_matched: bool) -> RaftNode {
    let mut n = candidate(options);
    feed(
        &mut n,
        msg(
            2,
            2,
            MessageBody::RequestVoteResponse {
                pre_vote: false,
                granted: true,
                commit: 0,
                commit_term: 0,
            },
        ),
    );
    assert_eq!(n.role(), Role::Leader);
    let last = n.last_index();
    feed(
        &mut n,
        msg(
            2,
            2,
            MessageBody::AppendResponse(AppendResult::Success { match_index: last }),
        ),
    );
    let match_3 = if all_matched { last } else { last - 1 };
    feed(
        &mut n,
        msg(
            3,
            2,
            MessageBody::AppendResponse(AppendResult::Success {
                match_index: match_3,
            }),
        ),
    );
    assert_eq!(n.commit_index(), last);
    if all_matched {
        return n;
    }
    feed(&mut n, Input::Tick);
    for from in [2, 3] {
        feed(
            &mut n,
            msg(
                from,
                2,
                MessageBody::HeartbeatResponse {
                    read_seq: 1,
                    last_index: last,
                    needs_append: false,
                },
            ),
        );
    }
    n
}

fn make(row: &str) -> RaftNode {
    let voters = Configuration::with_voters([1, 2, 3]);
    match row {
        "follower" => {
            let mut n = RaftNode::new(options(1), restored(voters, entries(3)), 1).unwrap();
            heartbeat_from_2(&mut n);
            n
        }
        "follower receiving snapshot" => {
            let mut n = make("follower");
            let meta = SnapshotMeta {
                index: 10,
                term: 1,
                config: Configuration::with_voters([1, 2, 3]),
            };
            feed(
                &mut n,
                msg(
                    2,
                    1,
                    MessageBody::SnapshotChunk {
                        meta,
                        offset: 0,
                        data: Bytes::from_static(b"abc"),
                        done: false,
                    },
                ),
            );
            assert!(n.is_receiving_snapshot());
            n
        }
        "follower quiescent" => {
            let mut n = RaftNode::new(quiesce_options(1), restored(voters, entries(3)), 1).unwrap();
            // An append verifies the log against leader 2, then its notice.
            feed(
                &mut n,
                msg(
                    2,
                    1,
                    MessageBody::Append {
                        prev_log_index: 3,
                        prev_log_term: 1,
                        entries: Vec::new(),
                        leader_commit: 3,
                    },
                ),
            );
            feed(
                &mut n,
                msg(
                    2,
                    1,
                    MessageBody::Quiesce {
                        last_index: 3,
                        last_term: 1,
                        commit: 3,
                    },
                ),
            );
            assert!(n.is_quiescent(), "a matching follower goes quiet");
            n
        }
        "pre-candidate" => pre_candidate(options),
        "candidate" => candidate(options),
        "leader" => leader_node(options, false),
        "leader quiescent" => {
            let mut n = leader_node(quiesce_options, true);
            feed(&mut n, Input::Tick);
            assert!(n.is_quiescent(), "an idle leader goes quiet");
            n
        }
        "leader transferring" => {
            let mut n = make("leader");
            let actions = feed(
                &mut n,
                Input::Client {
                    id: RequestId(900),
                    request: Request::TransferLeadership(3),
                },
            );
            assert!(actions
                .iter()
                .any(|a| matches!(a, Action::Respond { result: Ok(_), .. })));
            n
        }
        "learner" => {
            let mut config = Configuration::with_voters([2, 3]);
            config.learners.insert(1);
            let mut n = RaftNode::new(options(1), restored(config, entries(3)), 1).unwrap();
            heartbeat_from_2(&mut n);
            assert_eq!(n.role(), Role::Learner);
            n
        }
        "removed" => {
            let mut log = entries(3);
            log.push(Entry {
                index: 4,
                term: 1,
                payload: EntryPayload::Config(Configuration::with_voters([2, 3])),
            });
            let mut r = restored(voters, log);
            r.hard_state.commit = 3;
            r.applied = 3;
            let mut n = RaftNode::new(options(1), r, 1).unwrap();
            feed(
                &mut n,
                msg(
                    2,
                    1,
                    MessageBody::Append {
                        prev_log_index: 4,
                        prev_log_term: 1,
                        entries: Vec::new(),
                        leader_commit: 4,
                    },
                ),
            );
            assert!(n.is_removed());
            n
        }
        "halted" => {
            // The leader sends an entry at an index and term this follower
            // holds, but a different one: two leaders in one term.
            let mut n = make("follower");
            let actions = feed(
                &mut n,
                msg(
                    2,
                    1,
                    MessageBody::Append {
                        prev_log_index: 2,
                        prev_log_term: 1,
                        entries: vec![Entry {
                            index: 3,
                            term: 1,
                            payload: EntryPayload::Command(Bytes::from_static(b"forged")),
                        }],
                        leader_commit: 2,
                    },
                ),
            );
            assert!(actions.iter().any(|a| matches!(a, Action::Fault(_))));
            assert!(n.is_halted());
            n
        }
        other => panic!("unknown row {other}"),
    }
}

fn input_for(column: &str, node: &RaftNode) -> Input {
    let term = node.term();
    let last = node.last_index();
    let client = |request| Input::Client {
        id: RequestId(1),
        request,
    };
    match column {
        "RequestVote (newer term)" => msg(
            3,
            term + 1,
            MessageBody::RequestVote {
                pre_vote: false,
                last_log_index: last + 5,
                last_log_term: term + 1,
                transfer: false,
            },
        ),
        "pre-vote RequestVote" => msg(
            3,
            term + 1,
            MessageBody::RequestVote {
                pre_vote: true,
                last_log_index: last + 5,
                last_log_term: term + 1,
                transfer: false,
            },
        ),
        "RequestVoteResponse (granted)" => msg(
            3,
            term,
            MessageBody::RequestVoteResponse {
                pre_vote: false,
                granted: true,
                commit: 0,
                commit_term: 0,
            },
        ),
        "Append" => msg(
            2,
            term,
            MessageBody::Append {
                prev_log_index: last,
                prev_log_term: node.term_at(last).unwrap_or(0),
                entries: vec![Entry {
                    index: last + 1,
                    term,
                    payload: EntryPayload::Command(Bytes::from_static(b"y")),
                }],
                leader_commit: 3,
            },
        ),
        "AppendResponse (success)" => msg(
            2,
            term,
            MessageBody::AppendResponse(AppendResult::Success { match_index: last }),
        ),
        "Heartbeat" => msg(
            2,
            term,
            MessageBody::Heartbeat {
                leader_commit: 3,
                read_seq: 7,
            },
        ),
        "HeartbeatResponse" => msg(
            2,
            term,
            MessageBody::HeartbeatResponse {
                read_seq: 1,
                last_index: last,
                needs_append: false,
            },
        ),
        "SnapshotChunk (first)" => msg(
            2,
            term,
            MessageBody::SnapshotChunk {
                meta: SnapshotMeta {
                    index: 20,
                    term: 1,
                    config: Configuration::with_voters([1, 2, 3]),
                },
                offset: 0,
                data: Bytes::from_static(b"snap"),
                done: false,
            },
        ),
        "SnapshotChunkAck" => msg(
            2,
            term,
            MessageBody::SnapshotChunkAck {
                snapshot_index: 5,
                next_offset: 10,
            },
        ),
        "SnapshotResponse (installed)" => msg(
            2,
            term,
            MessageBody::SnapshotResponse {
                snapshot_index: 5,
                outcome: SnapshotOutcome::Installed { last_index: last },
            },
        ),
        "TimeoutNow" => msg(2, term, MessageBody::TimeoutNow),
        "Quiesce" => msg(
            2,
            term,
            MessageBody::Quiesce {
                last_index: last,
                last_term: node.term_at(last).unwrap_or(0),
                commit: node.commit_index(),
            },
        ),
        "WakeUp" => msg(2, term, MessageBody::WakeUp),
        "Forward (proposal)" => msg(
            3,
            term,
            MessageBody::Forward {
                id: RequestId(77),
                request: ferry_raft::ForwardedRequest::Propose(Bytes::from_static(b"f")),
            },
        ),
        "ForwardResponse (unknown id)" => msg(
            2,
            term,
            MessageBody::ForwardResponse {
                id: RequestId(12345),
                result: Err(ferry_raft::RequestError::Timeout),
            },
        ),
        "any message from an older term" => msg(
            2,
            term - 1,
            MessageBody::Heartbeat {
                leader_commit: 0,
                read_seq: 0,
            },
        ),
        "Propose" => client(Request::Propose(Bytes::from_static(b"p"))),
        "Read Linearizable" => client(Request::Read(ReadConsistency::Linearizable)),
        "Read Lease" => client(Request::Read(ReadConsistency::Lease)),
        "Read Local" => client(Request::Read(ReadConsistency::Local { min_applied: None })),
        "Read Local (min_applied ahead)" => client(Request::Read(ReadConsistency::Local {
            min_applied: Some(last + 100),
        })),
        "ChangeMembership" => client(Request::ChangeMembership(MembershipChange::AddLearner(4))),
        "TransferLeadership" => client(Request::TransferLeadership(3)),
        "Campaign" => client(Request::Campaign),
        "Status" => client(Request::Status),
        "Tick" => Input::Tick,
        "Persisted" => Input::Persisted { seq: 1 },
        "SnapshotBuilt" => Input::SnapshotBuilt {
            index: node.applied_index(),
        },
        "SnapshotChunkLoaded" => Input::SnapshotChunkLoaded {
            to: 2,
            snapshot_index: 5,
            offset: 0,
            chunk: Some((Bytes::from_static(b"c"), true)),
        },
        "SnapshotChunkSaved" => Input::SnapshotChunkSaved {
            snapshot_index: 10,
            offset: 0,
            ok: true,
        },
        // No load is outstanding in any row: an answer nobody waits for.
        "EntriesLoaded" => Input::EntriesLoaded {
            to: 2,
            term,
            from: last,
            entries: Some(vec![Entry {
                index: last,
                term: node.term_at(last).unwrap_or(0),
                payload: EntryPayload::Command(Bytes::from_static(b"x")),
            }]),
        },
        "PeerConnected" => Input::PeerConnected(2),
        "PeerDisconnected" => Input::PeerDisconnected(2),
        other => panic!("unknown column {other}"),
    }
}

fn body_name(body: &MessageBody) -> String {
    match body {
        MessageBody::RequestVote { pre_vote: true, .. } => "PreVote".into(),
        MessageBody::RequestVote { .. } => "RequestVote".into(),
        MessageBody::RequestVoteResponse {
            granted, pre_vote, ..
        } => {
            format!(
                "{}Vote{}",
                if *pre_vote { "Pre" } else { "" },
                if *granted { "Granted" } else { "Refused" }
            )
        }
        MessageBody::Append { .. } => "Append".into(),
        MessageBody::AppendResponse(AppendResult::Success { .. }) => "AppendOk".into(),
        MessageBody::AppendResponse(AppendResult::Reject { .. }) => "AppendReject".into(),
        MessageBody::Heartbeat { .. } => "Heartbeat".into(),
        MessageBody::HeartbeatResponse { .. } => "HeartbeatResponse".into(),
        MessageBody::SnapshotChunk { .. } => "SnapshotChunk".into(),
        MessageBody::SnapshotChunkAck { .. } => "ChunkAck".into(),
        MessageBody::SnapshotResponse { outcome, .. } => format!("Snapshot{outcome:?}")
            .split_whitespace()
            .next()
            .unwrap_or("")
            .into(),
        MessageBody::TimeoutNow => "TimeoutNow".into(),
        MessageBody::Forward { .. } => "Forward".into(),
        MessageBody::ForwardResponse { result: Ok(_), .. } => "ForwardOk".into(),
        MessageBody::ForwardResponse { result: Err(e), .. } => {
            format!("ForwardErr:{}", error_name(e))
        }
        MessageBody::Quiesce { .. } => "Quiesce".into(),
        MessageBody::WakeUp => "WakeUp".into(),
    }
}

/// The column each kind of input falls in. The matches are exhaustive, so
/// a new input, message or request kind does not compile until it has a
/// column (and with it a cell in every row of the documented matrix).
fn column_of(input: &Input) -> &'static str {
    match input {
        Input::Tick => "Tick",
        Input::Message(m) => match &m.body {
            MessageBody::RequestVote { pre_vote: true, .. } => "pre-vote RequestVote",
            MessageBody::RequestVote { .. } => "RequestVote (newer term)",
            MessageBody::RequestVoteResponse { .. } => "RequestVoteResponse (granted)",
            MessageBody::Append { .. } => "Append",
            MessageBody::AppendResponse(_) => "AppendResponse (success)",
            MessageBody::Heartbeat { .. } => "Heartbeat",
            MessageBody::HeartbeatResponse { .. } => "HeartbeatResponse",
            MessageBody::SnapshotChunk { .. } => "SnapshotChunk (first)",
            MessageBody::SnapshotChunkAck { .. } => "SnapshotChunkAck",
            MessageBody::SnapshotResponse { .. } => "SnapshotResponse (installed)",
            MessageBody::TimeoutNow => "TimeoutNow",
            MessageBody::Forward { .. } => "Forward (proposal)",
            MessageBody::ForwardResponse { .. } => "ForwardResponse (unknown id)",
            MessageBody::Quiesce { .. } => "Quiesce",
            MessageBody::WakeUp => "WakeUp",
        },
        Input::Client { request, .. } => match request {
            Request::Propose(_) => "Propose",
            Request::Read(ReadConsistency::Linearizable) => "Read Linearizable",
            Request::Read(ReadConsistency::Lease) => "Read Lease",
            Request::Read(ReadConsistency::Local { min_applied: None }) => "Read Local",
            Request::Read(ReadConsistency::Local { .. }) => "Read Local (min_applied ahead)",
            Request::ChangeMembership(_) => "ChangeMembership",
            Request::TransferLeadership(_) => "TransferLeadership",
            Request::Campaign => "Campaign",
            Request::Status => "Status",
        },
        Input::Persisted { .. } => "Persisted",
        Input::SnapshotBuilt { .. } => "SnapshotBuilt",
        Input::SnapshotChunkLoaded { .. } => "SnapshotChunkLoaded",
        Input::SnapshotChunkSaved { .. } => "SnapshotChunkSaved",
        Input::EntriesLoaded { .. } => "EntriesLoaded",
        Input::PeerConnected(_) => "PeerConnected",
        Input::PeerDisconnected(_) => "PeerDisconnected",
    }
}

fn error_name(e: &ferry_raft::RequestError) -> String {
    format!("{e:?}")
        .split([' ', '{', '('])
        .next()
        .unwrap_or("")
        .to_string()
}

/// A short label for what the node did: its answers, messages, storage
/// actions, role change, and whether a request is now held.
fn observe(node: &mut RaftNode, input: Input) -> String {
    let role_before = node.role();
    let pending_before = node.pending_request_count();
    let quiescent_before = node.is_quiescent();
    let actions = feed(node, input);
    let mut parts: Vec<String> = Vec::new();
    let mut push = |s: String| {
        if !parts.contains(&s) {
            parts.push(s);
        }
    };
    for action in &actions {
        match action {
            Action::Respond { id, result } if id.0 != 900 => match result {
                Ok(Response::Campaign(outcome)) => push(format!("ok:Campaign({outcome:?})")),
                Err(RequestError::CannotCampaign { reason }) => {
                    push(format!("err:CannotCampaign({reason:?})"))
                }
                Ok(r) => push(format!(
                    "ok:{}",
                    format!("{r:?}").split([' ', '(', '{']).next().unwrap_or("")
                )),
                Err(e) => push(format!("err:{}", error_name(e))),
            },
            Action::Respond { .. } => {}
            Action::Send(m) => push(format!("send:{}", body_name(&m.body))),
            Action::Persist(_) => push("persist".into()),
            Action::Apply(_) => push("apply".into()),
            Action::LoadSnapshotChunk { .. } => push("load-chunk".into()),
            Action::SaveSnapshotChunk { .. } => push("save-chunk".into()),
            Action::LoadEntries { .. } => push("load-entries".into()),
            Action::Compact { .. } => push("compact".into()),
            Action::RoleChanged { .. } => {}
            Action::Removed => push("removed".into()),
            Action::Fault(_) => push("fault".into()),
        }
    }
    if node.role() != role_before {
        push(format!("become:{:?}", node.role()));
    }
    match (quiescent_before, node.is_quiescent()) {
        (true, false) => push("wake".into()),
        (false, true) => push("quiesce".into()),
        (true, true) | (false, false) => {}
    }
    if node.pending_request_count() > pending_before {
        push("held".into());
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(" ")
    }
}

/// The documented outcomes (the crate docs render this table).
const EXPECTED: [[&str; 33]; 11] = include!("matrix_expected.in");

#[test]
fn every_role_and_input_has_its_documented_outcome() {
    let mut observed = Vec::new();
    let mut mismatches = Vec::new();
    for (r, row) in ROWS.iter().enumerate() {
        let mut line = Vec::new();
        for (c, column) in COLUMNS.iter().enumerate() {
            let mut node = make(row);
            let input = input_for(column, &node);
            let is_request = matches!(input, Input::Client { .. });
            let label = observe(&mut node, input);
            if is_request {
                // A request is answered, forwarded or held; never dropped.
                let definite = label.contains("ok:")
                    || label.contains("err:")
                    || label.contains("send:Forward")
                    || label.contains("held");
                assert!(
                    definite,
                    "{row} x {column}: request neither answered, forwarded nor held: {label}"
                );
                if label.contains("held") || label.contains("send:Forward") {
                    // ...and then answered by its deadline at the latest.
                    let mut answered = false;
                    for _ in 0..=test_options(1).request_timeout_ticks {
                        let mut actions = Vec::new();
                        node.step(Input::Tick, &mut actions);
                        answered |= actions.iter().any(|a| {
                            matches!(
                                a,
                                Action::Respond {
                                    id: RequestId(1),
                                    ..
                                }
                            )
                        });
                        for a in actions {
                            if let Action::Persist(p) = a {
                                node.step(Input::Persisted { seq: p.seq }, &mut Vec::new());
                            }
                        }
                        if answered {
                            break;
                        }
                    }
                    let read_during_step_down = *row == "leader" || *row == "leader transferring";
                    assert!(
                        answered || read_during_step_down && node.role() != Role::Leader,
                        "{row} x {column}: held request never answered"
                    );
                }
            }
            if EXPECTED[r][c] != label {
                mismatches.push(format!(
                    "{row} x {column}: expected `{}`, observed `{label}`",
                    EXPECTED[r][c]
                ));
            }
            line.push(label);
        }
        observed.push(line);
    }
    if !mismatches.is_empty() {
        let mut table = String::from("[\n");
        for line in &observed {
            table.push_str("    [");
            table.push_str(
                &line
                    .iter()
                    .map(|l| format!("{l:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            );
            table.push_str("],\n");
        }
        table.push(']');
        panic!(
            "{} cells differ from the documented matrix:\n{}\n\nobserved table:\n{table}",
            mismatches.len(),
            mismatches.join("\n")
        );
    }
}

#[test]
fn every_column_is_its_own_kind_of_input() {
    // Each column's input falls in that column (so `column_of`, which
    // names a column for every kind of input there is, covers the matrix).
    let node = make("follower");
    for column in COLUMNS {
        let input = input_for(column, &node);
        let kind = column_of(&input);
        let expected = if column == "any message from an older term" {
            "Heartbeat"
        } else {
            column
        };
        assert_eq!(kind, expected, "column {column}");
        assert!(COLUMNS.contains(&kind));
    }
}

#[test]
fn crate_docs_contain_the_matrix() {
    let docs = include_str!("../src/lib.rs");
    for (r, row) in ROWS.iter().enumerate() {
        let line = docs
            .lines()
            .find(|l| l.starts_with(&format!("//! | {row} |")))
            .unwrap_or_else(|| panic!("row {row} missing from the crate docs"));
        for (c, column) in COLUMNS.iter().enumerate() {
            let _ = column;
            assert!(
                line.contains(&format!("`{}`", EXPECTED[r][c])),
                "docs row {row} lacks cell {}: `{}`",
                column,
                EXPECTED[r][c]
            );
        }
    }
}
