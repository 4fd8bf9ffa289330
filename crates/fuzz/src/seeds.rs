//! Valid encodings made by the real encoders: the seeds of the corpus in
//! `crates/fuzz/corpus/<target>/`, and what the mutation tests damage.

use bytes::{Bytes, BytesMut};
use ferry_raft::HardState;
use ferry_raft::{
    AppendResult, CampaignOutcome, CampaignRefusal, Configuration, Entry, EntryPayload,
    ForwardedRequest, MembershipChange, Message, MessageBody, RequestError, RequestId, Response,
    Role, SnapshotMeta, SnapshotOutcome, Status,
};
use ferry_runtime::transport::codec::encode_message;
use ferry_runtime::transport::frame::encode_frame;
use ferry_runtime::transport::handshake::{encode_answer, Hello};
use ferry_server::command::{
    command, encode_command, CommandKind, LeaseExpireCommand, LeaseGrantCommand, LeaseRevokeCommand,
};
use ferry_server::pb::etcdserverpb::{
    compare, request_op, AuthRoleAddRequest, AuthRoleGrantPermissionRequest, AuthUserAddRequest,
    AuthUserGrantRoleRequest, CompactionRequest, Compare, DeleteRangeRequest, PutRequest,
    RangeRequest, RequestOp, TxnRequest,
};
use ferry_storage::codec::{WalRecord, WAL_FORMAT_VERSION, WAL_FORMAT_VERSION_OLDEST};

use crate::storage::{build, LogStep};

/// A configuration with every set used.
pub fn configuration() -> Configuration {
    Configuration {
        voters: [1, 2, 3].into(),
        voters_outgoing: [1, 2].into(),
        learners: [4].into(),
    }
}

/// One message of every kind the peer wire carries (every body, response
/// and error).
pub fn messages() -> Vec<Message> {
    let config = configuration();
    let entries = vec![
        Entry {
            term: 2,
            index: 5,
            payload: EntryPayload::Noop,
        },
        Entry {
            term: 2,
            index: 6,
            payload: EntryPayload::Command(Bytes::from_static(b"put x")),
        },
        Entry {
            term: 2,
            index: 7,
            payload: EntryPayload::Config(config.clone()),
        },
    ];
    let status = Status {
        group: 3,
        id: 2,
        role: Role::Learner,
        receiving_snapshot: true,
        term: 9,
        leader: Some(1),
        last_index: 7,
        commit: 6,
        applied: 5,
        config: config.clone(),
        removed: false,
    };
    let mut bodies = vec![
        MessageBody::RequestVote {
            pre_vote: true,
            last_log_index: 7,
            last_log_term: 2,
            transfer: false,
        },
        MessageBody::RequestVoteResponse {
            pre_vote: false,
            granted: true,
            commit: 6,
            commit_term: 2,
        },
        MessageBody::Append {
            prev_log_index: 4,
            prev_log_term: 1,
            entries,
            leader_commit: 5,
        },
        MessageBody::AppendResponse(AppendResult::Success { match_index: 7 }),
        MessageBody::AppendResponse(AppendResult::Reject {
            rejected_index: 9,
            hint_index: 3,
            hint_term: 0,
        }),
        MessageBody::Heartbeat {
            leader_commit: 5,
            read_seq: 11,
        },
        MessageBody::HeartbeatResponse {
            read_seq: 11,
            last_index: 40,
            needs_append: true,
        },
        MessageBody::SnapshotChunk {
            meta: SnapshotMeta {
                index: 100,
                term: 3,
                config,
            },
            offset: 4096,
            data: Bytes::from_static(&[1, 2, 3]),
            done: true,
        },
        MessageBody::SnapshotChunkAck {
            snapshot_index: 100,
            next_offset: 8192,
        },
        MessageBody::SnapshotResponse {
            snapshot_index: 100,
            outcome: SnapshotOutcome::Installed { last_index: 100 },
        },
        MessageBody::SnapshotResponse {
            snapshot_index: 100,
            outcome: SnapshotOutcome::Stale { match_index: 120 },
        },
        MessageBody::SnapshotResponse {
            snapshot_index: 100,
            outcome: SnapshotOutcome::Rejected,
        },
        MessageBody::TimeoutNow,
        MessageBody::Forward {
            id: RequestId(5),
            request: ForwardedRequest::Propose(Bytes::from_static(b"cmd")),
        },
        MessageBody::Forward {
            id: RequestId(6),
            request: ForwardedRequest::ReadIndex,
        },
        MessageBody::Forward {
            id: RequestId(7),
            request: ForwardedRequest::ChangeMembership(MembershipChange::PromoteLearner(4)),
        },
        MessageBody::Forward {
            id: RequestId(8),
            request: ForwardedRequest::TransferLeadership(3),
        },
        MessageBody::ForwardResponse {
            id: RequestId(5),
            result: Ok(Response::Proposed { index: 8, term: 9 }),
        },
        MessageBody::ForwardResponse {
            id: RequestId(6),
            result: Ok(Response::ReadReady { index: 8 }),
        },
        MessageBody::ForwardResponse {
            id: RequestId(8),
            result: Ok(Response::TransferStarted),
        },
        MessageBody::ForwardResponse {
            id: RequestId(9),
            result: Ok(Response::Status(status)),
        },
        MessageBody::ForwardResponse {
            id: RequestId(10),
            result: Ok(Response::Campaign(CampaignOutcome::AlreadyLeader)),
        },
        MessageBody::Quiesce {
            last_index: 40,
            last_term: 9,
            commit: 40,
        },
        MessageBody::WakeUp,
    ];
    let errors = [
        RequestError::NotLeader { leader: Some(1) },
        RequestError::NoLeader,
        RequestError::Busy { limit: 10 },
        RequestError::InvalidMembershipChange {
            reason: "node 4 is already a voter".into(),
        },
        RequestError::LearnerNotCaughtUp {
            id: 4,
            matched: 10,
            last_index: 500,
        },
        RequestError::Halted {
            reason: "a log conflict".into(),
        },
        RequestError::CannotCampaign {
            reason: CampaignRefusal::TermExhausted,
        },
    ];
    bodies.extend(
        errors
            .into_iter()
            .map(|error| MessageBody::ForwardResponse {
                id: RequestId(1),
                result: Err(error),
            }),
    );
    bodies
        .into_iter()
        .map(|body| Message {
            group: 3,
            from: 1,
            to: 2,
            term: 9,
            body,
        })
        .collect()
}

/// One log record of every kind, unframed.
pub fn records() -> Vec<WalRecord> {
    let hard_state = HardState {
        term: 3,
        vote: Some(2),
        commit: 5,
    };
    vec![
        WalRecord::SegmentHeader {
            segment: 4,
            version: WAL_FORMAT_VERSION,
            previous_len: Some(4096),
        },
        WalRecord::SegmentHeader {
            segment: 1,
            version: WAL_FORMAT_VERSION_OLDEST,
            previous_len: None,
        },
        WalRecord::Checkpoint {
            group: 1,
            hard_state,
            base_index: 2,
            base_term: 1,
            last_index: 9,
        },
        WalRecord::Persist {
            group: 1,
            seq: 7,
            hard_state: Some(hard_state),
            entries: match &messages()[2].body {
                MessageBody::Append { entries, .. } => entries.clone(),
                _ => Vec::new(),
            },
        },
        WalRecord::Compact {
            group: 1,
            through: 4,
            term: 2,
        },
        WalRecord::ResetToSnapshot {
            group: 2,
            index: 100,
            term: 3,
        },
        WalRecord::RemoveGroup { group: 2 },
    ]
}

/// A log of two groups over several segments, with rewrites and
/// compactions: what the log seeds and the recovery tests start from.
pub fn log_steps() -> Vec<LogStep> {
    let append = |group, rewind, count, new_term| LogStep::Append {
        group,
        rewind,
        count,
        command_bytes: 40,
        new_term,
    };
    vec![
        append(1, 0, 3, true),
        append(2, 0, 2, true),
        append(1, 0, 4, false),
        append(1, 2, 3, true),
        LogStep::Compact { group: 1, keep: 2 },
        append(2, 0, 5, false),
        append(1, 0, 2, false),
    ]
}

/// Commands of every kind a client can cause, encoded for the log.
pub fn commands() -> Vec<Vec<u8>> {
    let put = |key: &str, lease| PutRequest {
        key: Bytes::copy_from_slice(key.as_bytes()),
        value: Bytes::from_static(b"value"),
        lease,
        prev_kv: true,
        ..PutRequest::default()
    };
    let range = RangeRequest {
        key: b"a".to_vec(),
        range_end: vec![0],
        limit: 2,
        ..RangeRequest::default()
    };
    let txn = TxnRequest {
        compare: vec![Compare {
            result: compare::CompareResult::Greater as i32,
            target: compare::CompareTarget::Version as i32,
            key: b"a".to_vec(),
            range_end: Vec::new(),
            target_union: Some(compare::TargetUnion::Version(1)),
        }],
        success: vec![
            RequestOp {
                request: Some(request_op::Request::RequestRange(range)),
            },
            RequestOp {
                request: Some(request_op::Request::RequestPut(put("e", 0))),
            },
        ],
        failure: vec![RequestOp {
            request: Some(request_op::Request::RequestDeleteRange(
                DeleteRangeRequest {
                    key: b"a".to_vec(),
                    range_end: b"b".to_vec(),
                    prev_kv: true,
                },
            )),
        }],
    };
    let kinds = vec![
        CommandKind::Put(put("a", 0)),
        CommandKind::Put(put("z", 7)),
        CommandKind::DeleteRange(DeleteRangeRequest {
            key: b"c/".to_vec(),
            range_end: b"c0".to_vec(),
            prev_kv: true,
        }),
        CommandKind::Txn(txn),
        CommandKind::Compact(CompactionRequest {
            revision: 5,
            physical: true,
        }),
        CommandKind::LeaseGrant(LeaseGrantCommand {
            id: 9,
            ttl_seconds: 30,
        }),
        CommandKind::LeaseRevoke(LeaseRevokeCommand { id: 7 }),
        CommandKind::LeaseExpire(LeaseExpireCommand { ids: vec![7, 8] }),
        CommandKind::UserAdd(AuthUserAddRequest {
            name: "alice".into(),
            hashed_password: "$2b$04$abcdefghijklmnopqrstuu5Z3z1nLDR.0CY4mJw7bN2o3sqAhxh2S".into(),
            ..AuthUserAddRequest::default()
        }),
        CommandKind::RoleAdd(AuthRoleAddRequest { name: "app".into() }),
        CommandKind::RoleGrantPermission(AuthRoleGrantPermissionRequest {
            name: "app".into(),
            perm: Some(ferry_server::pb::authpb::Permission {
                perm_type: 2,
                key: b"app/".to_vec(),
                range_end: b"app0".to_vec(),
            }),
        }),
        CommandKind::UserGrantRole(AuthUserGrantRoleRequest {
            user: "alice".into(),
            role: "app".into(),
        }),
    ];
    let mut encoded: Vec<Vec<u8>> = kinds
        .into_iter()
        .map(|kind| encode_command(&command(kind)))
        .collect();
    encoded.push(encode_command(&ferry_server::command::raise_no_space(1)));
    encoded.push(encode_command(&ferry_server::command::peer_record(
        2,
        "127.0.0.1:2380".into(),
        true,
    )));
    encoded
}

/// An HTTP/2 connection's first bytes: the preface, an empty SETTINGS
/// frame and a HEADERS frame with `authority`, its fields all literals.
pub fn http2_request(authority: &[u8]) -> Vec<u8> {
    fn literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
        // Literal without indexing, new name, raw strings shorter than 127.
        out.push(0x00);
        out.push(name.len() as u8);
        out.extend_from_slice(name);
        out.push(value.len() as u8);
        out.extend_from_slice(value);
    }
    let mut block = Vec::new();
    literal(b":method", b"POST", &mut block);
    literal(b":scheme", b"http", &mut block);
    literal(b":path", b"/etcdserverpb.KV/Range", &mut block);
    literal(b":authority", authority, &mut block);
    literal(b"content-type", b"application/grpc", &mut block);
    let mut out = crate::server::PREFACE.to_vec();
    out.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    let length = (block.len() as u32).to_be_bytes();
    out.extend_from_slice(&length[1..]);
    out.extend_from_slice(&[0x1, 0x4, 0, 0, 0, 1]);
    out.extend_from_slice(&block);
    // A DATA frame on the stream, passed through untouched.
    out.extend_from_slice(&[0, 0, 5, 0x0, 0x1, 0, 0, 0, 1, 0, 0, 0, 0, 0]);
    out
}

/// The valid inputs each byte target starts from, by target name (the
/// names of [`crate::TARGETS`]).
pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    match name {
        "peer_frame" => {
            let mut wire = BytesMut::new();
            let hello = Hello {
                cluster_id: 42,
                from: 1,
                to: 2,
            };
            encode_frame(&hello.encode(), &mut wire);
            for message in messages().iter().take(4) {
                encode_frame(&encode_message(message), &mut wire);
            }
            encode_frame(b"", &mut wire);
            let mut one = BytesMut::new();
            encode_frame(&encode_message(&messages()[2]), &mut one);
            vec![wire.to_vec(), one.to_vec()]
        }
        "peer_handshake" => vec![
            Hello {
                cluster_id: 42,
                from: 1,
                to: 2,
            }
            .encode()
            .to_vec(),
            encode_answer(Some("node 1 belongs to cluster 0x2a")).to_vec(),
            encode_answer(None).to_vec(),
        ],
        "peer_message" => messages()
            .iter()
            .map(|m| encode_message(m).to_vec())
            .collect(),
        "wal_record" => records()
            .iter()
            .flat_map(|record| {
                let bare = build::record(record);
                let framed = build::framed(std::slice::from_ref(&bare));
                [bare, framed]
            })
            .collect(),
        // Segments that hold a whole log: the first of a log, or its only.
        "wal_segment" => [true, false]
            .into_iter()
            .filter_map(|small| {
                let files = build::log_files(&log_steps(), small);
                files.into_iter().find(|(name, _)| name.ends_with(".seg"))
            })
            .map(|(_, data)| data)
            .collect(),
        "log_state" => build::log_files(&log_steps(), true)
            .into_iter()
            .filter(|(name, _)| !name.ends_with(".seg"))
            .map(|(_, data)| data)
            .collect(),
        "snapshot_file" => vec![
            build::real_snapshot_file(&configuration(), b"some snapshot data", 5),
            build::real_snapshot_file(&configuration(), &[], 1),
            build::snapshot_file(
                &build::snapshot_header(
                    1,
                    &SnapshotMeta {
                        index: 1,
                        term: 1,
                        config: configuration(),
                    },
                    4,
                ),
                4,
                b"blocks of four bytes",
            ),
        ],
        "kv_snapshot" => vec![
            crate::server::populated_state()
                .snapshot()
                .expect("an in-memory state encodes"),
            ferry_server::kv_state::KvState::new(Default::default())
                .snapshot()
                .expect("an in-memory state encodes"),
        ],
        "backup_file" => {
            let state = crate::server::populated_state();
            let mut backup = Vec::new();
            ferry_server::backup::stream_backup(&state.snapshot_source(), |blob, _| {
                backup.extend_from_slice(&blob);
                Ok(())
            })
            .expect("an in-memory state streams");
            vec![backup]
        }
        "command_apply" => commands(),
        "authority" => vec![
            http2_request(b"http://127.0.0.1:2379"),
            http2_request(b"127.0.0.1:2379"),
            http2_request(b"https://[::1]:2379/"),
        ],
        _ => Vec::new(),
    }
}
