//! The peer port's decoders under proptest: arbitrary bytes, mutations of
//! valid encodings, and valid messages with extreme field values.

mod common;

use bytes::{Bytes, BytesMut};
use common::{bytes, check, extreme_u64, mutated_seed, mutations, Expect};
use ferry_fuzz::mutate::mutated;
use ferry_fuzz::peer::{peer_frame, peer_handshake, peer_message};
use ferry_fuzz::Verdict;
use ferry_raft::{
    AppendResult, CampaignOutcome, CampaignRefusal, Configuration, Entry, EntryPayload,
    ForwardedRequest, MembershipChange, Message, MessageBody, RequestError, RequestId, Response,
    Role, SnapshotMeta, SnapshotOutcome, Status,
};
use ferry_runtime::transport::codec::{decode_message, encode_message};
use ferry_runtime::transport::frame::encode_frame;
use ferry_runtime::transport::handshake::Hello;
use proptest::prelude::*;

fn node_set() -> impl Strategy<Value = std::collections::BTreeSet<u64>> {
    proptest::collection::btree_set(extreme_u64().prop_map(|id| id.max(1)), 0..5)
}

fn configuration() -> impl Strategy<Value = Configuration> {
    (node_set(), node_set(), node_set()).prop_map(|(voters, voters_outgoing, learners)| {
        Configuration {
            voters,
            voters_outgoing,
            learners,
        }
    })
}

fn payload() -> impl Strategy<Value = EntryPayload> {
    prop_oneof![
        Just(EntryPayload::Noop),
        bytes(200).prop_map(|b| EntryPayload::Command(Bytes::from(b))),
        configuration().prop_map(EntryPayload::Config),
    ]
}

fn entries() -> impl Strategy<Value = Vec<Entry>> {
    proptest::collection::vec((extreme_u64(), extreme_u64(), payload()), 0..6).prop_map(|drawn| {
        drawn
            .into_iter()
            .map(|(term, index, payload)| Entry {
                term,
                index,
                payload,
            })
            .collect()
    })
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), "\\PC{0,40}"]
}

fn request_error() -> impl Strategy<Value = RequestError> {
    prop_oneof![
        proptest::option::of(extreme_u64()).prop_map(|leader| RequestError::NotLeader { leader }),
        Just(RequestError::NoLeader),
        Just(RequestError::Timeout),
        extreme_u64().prop_map(|limit| RequestError::Busy {
            limit: limit as usize
        }),
        Just(RequestError::Removed),
        Just(RequestError::LeadershipLost),
        Just(RequestError::MembershipChangePending),
        text().prop_map(|reason| RequestError::InvalidMembershipChange { reason }),
        (extreme_u64(), extreme_u64(), extreme_u64()).prop_map(|(id, matched, last_index)| {
            RequestError::LearnerNotCaughtUp {
                id,
                matched,
                last_index,
            }
        }),
        Just(RequestError::TransferInProgress),
        Just(RequestError::LeaseReadsDisabled),
        text().prop_map(|reason| RequestError::Halted { reason }),
        proptest::sample::select(vec![
            CampaignRefusal::NotVoter,
            CampaignRefusal::ReceivingSnapshot,
            CampaignRefusal::TermExhausted,
        ])
        .prop_map(|reason| RequestError::CannotCampaign { reason }),
    ]
}

fn response() -> impl Strategy<Value = Response> {
    let status = (
        (extreme_u64(), extreme_u64(), 0usize..5, any::<bool>()),
        (
            extreme_u64(),
            proptest::option::of(extreme_u64()),
            extreme_u64(),
            extreme_u64(),
            extreme_u64(),
        ),
        (configuration(), any::<bool>()),
    )
        .prop_map(
            |(
                (group, id, role, receiving_snapshot),
                (term, leader, last_index, commit, applied),
                (config, removed),
            )| {
                Response::Status(Status {
                    group,
                    id,
                    role: [
                        Role::Follower,
                        Role::PreCandidate,
                        Role::Candidate,
                        Role::Leader,
                        Role::Learner,
                    ][role],
                    receiving_snapshot,
                    term,
                    leader,
                    last_index,
                    commit,
                    applied,
                    config,
                    removed,
                })
            },
        );
    prop_oneof![
        (extreme_u64(), extreme_u64()).prop_map(|(index, term)| Response::Proposed { index, term }),
        extreme_u64().prop_map(|index| Response::ReadReady { index }),
        Just(Response::TransferStarted),
        status,
        proptest::sample::select(vec![
            CampaignOutcome::Started,
            CampaignOutcome::AlreadyCampaigning,
            CampaignOutcome::AlreadyLeader,
        ])
        .prop_map(Response::Campaign),
    ]
}

fn body() -> impl Strategy<Value = MessageBody> {
    let change = (0u8..4, extreme_u64()).prop_map(|(kind, id)| match kind {
        0 => MembershipChange::AddLearner(id),
        1 => MembershipChange::AddVoter(id),
        2 => MembershipChange::PromoteLearner(id),
        _ => MembershipChange::Remove(id),
    });
    let request = prop_oneof![
        bytes(200).prop_map(|b| ForwardedRequest::Propose(Bytes::from(b))),
        Just(ForwardedRequest::ReadIndex),
        change.prop_map(ForwardedRequest::ChangeMembership),
        extreme_u64().prop_map(ForwardedRequest::TransferLeadership),
    ];
    let outcome = prop_oneof![
        extreme_u64().prop_map(|last_index| SnapshotOutcome::Installed { last_index }),
        extreme_u64().prop_map(|match_index| SnapshotOutcome::Stale { match_index }),
        Just(SnapshotOutcome::Rejected),
    ];
    prop_oneof![
        (any::<bool>(), extreme_u64(), extreme_u64(), any::<bool>()).prop_map(
            |(pre_vote, last_log_index, last_log_term, transfer)| MessageBody::RequestVote {
                pre_vote,
                last_log_index,
                last_log_term,
                transfer,
            }
        ),
        (any::<bool>(), any::<bool>(), extreme_u64(), extreme_u64()).prop_map(
            |(pre_vote, granted, commit, commit_term)| MessageBody::RequestVoteResponse {
                pre_vote,
                granted,
                commit,
                commit_term,
            }
        ),
        (extreme_u64(), extreme_u64(), entries(), extreme_u64()).prop_map(
            |(prev_log_index, prev_log_term, entries, leader_commit)| MessageBody::Append {
                prev_log_index,
                prev_log_term,
                entries,
                leader_commit,
            }
        ),
        extreme_u64().prop_map(
            |match_index| MessageBody::AppendResponse(AppendResult::Success { match_index })
        ),
        (extreme_u64(), extreme_u64(), extreme_u64()).prop_map(
            |(rejected_index, hint_index, hint_term)| MessageBody::AppendResponse(
                AppendResult::Reject {
                    rejected_index,
                    hint_index,
                    hint_term,
                }
            )
        ),
        (extreme_u64(), extreme_u64()).prop_map(|(leader_commit, read_seq)| {
            MessageBody::Heartbeat {
                leader_commit,
                read_seq,
            }
        }),
        (extreme_u64(), extreme_u64(), any::<bool>()).prop_map(
            |(read_seq, last_index, needs_append)| MessageBody::HeartbeatResponse {
                read_seq,
                last_index,
                needs_append,
            }
        ),
        (
            extreme_u64(),
            extreme_u64(),
            configuration(),
            extreme_u64(),
            bytes(300),
            any::<bool>()
        )
            .prop_map(|(index, term, config, offset, data, done)| {
                MessageBody::SnapshotChunk {
                    meta: SnapshotMeta {
                        index,
                        term,
                        config,
                    },
                    offset,
                    data: Bytes::from(data),
                    done,
                }
            }),
        (extreme_u64(), extreme_u64()).prop_map(|(snapshot_index, next_offset)| {
            MessageBody::SnapshotChunkAck {
                snapshot_index,
                next_offset,
            }
        }),
        (extreme_u64(), outcome).prop_map(|(snapshot_index, outcome)| {
            MessageBody::SnapshotResponse {
                snapshot_index,
                outcome,
            }
        }),
        Just(MessageBody::TimeoutNow),
        (extreme_u64(), request).prop_map(|(id, request)| MessageBody::Forward {
            id: RequestId(id),
            request,
        }),
        (
            extreme_u64(),
            prop_oneof![response().prop_map(Ok), request_error().prop_map(Err)]
        )
            .prop_map(|(id, result)| MessageBody::ForwardResponse {
                id: RequestId(id),
                result,
            }),
        (extreme_u64(), extreme_u64(), extreme_u64()).prop_map(
            |(last_index, last_term, commit)| MessageBody::Quiesce {
                last_index,
                last_term,
                commit,
            }
        ),
        Just(MessageBody::WakeUp),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    (
        extreme_u64(),
        extreme_u64(),
        extreme_u64(),
        extreme_u64(),
        body(),
    )
        .prop_map(|(group, from, to, term, body)| Message {
            group,
            from,
            to,
            term,
            body,
        })
}

/// Frames of the given payloads, back to back.
fn framed(payloads: &[Vec<u8>]) -> Vec<u8> {
    let mut wire = BytesMut::new();
    for payload in payloads {
        encode_frame(payload, &mut wire);
    }
    wire.to_vec()
}

#[test]
fn peer_frames_of_arbitrary_bytes() {
    check(
        "peer_frame arbitrary",
        1.0,
        bytes(600),
        Expect::Any,
        |data| peer_frame(&data),
    );
}

#[test]
fn peer_frames_mutated() {
    let strategy = (proptest::collection::vec(bytes(100), 1..5), mutations());
    check(
        "peer_frame mutated",
        1.0,
        strategy,
        Expect::Both,
        |(payloads, damage)| {
            let wire = framed(&payloads);
            assert_eq!(peer_frame(&wire), Verdict::Accepted);
            peer_frame(&mutated(&wire, &damage))
        },
    );
}

#[test]
fn peer_handshakes_of_arbitrary_bytes() {
    check(
        "peer_handshake arbitrary",
        1.0,
        bytes(64),
        Expect::Any,
        |data| peer_handshake(&data),
    );
}

#[test]
fn peer_handshakes_mutated() {
    let strategy = mutated_seed("peer_handshake");
    check(
        "peer_handshake mutated seed",
        1.0,
        strategy,
        Expect::Both,
        |data| peer_handshake(&data),
    );
    let hello = (extreme_u64(), extreme_u64(), extreme_u64(), mutations());
    check(
        "peer_handshake mutated hello",
        1.0,
        hello,
        Expect::Both,
        |(cluster_id, from, to, damage)| {
            let hello = Hello {
                cluster_id,
                from,
                to,
            }
            .encode();
            assert_eq!(peer_handshake(&hello), Verdict::Accepted);
            // A hello is never an answer that accepts: only the empty one does.
            let damaged = mutated(&hello, &damage);
            let decoded = Hello::decode(&damaged);
            assert!(decoded.is_err() || damaged.len() == hello.len());
            peer_handshake(&damaged)
        },
    );
}

#[test]
fn peer_messages_of_arbitrary_bytes() {
    check(
        "peer_message arbitrary",
        1.0,
        bytes(400),
        Expect::Any,
        |data| peer_message(&data),
    );
}

#[test]
fn peer_messages_mutated() {
    check(
        "peer_message mutated seed",
        2.0,
        mutated_seed("peer_message"),
        Expect::Both,
        |data| peer_message(&data),
    );
}

/// A valid message with extreme values decodes to itself, and every
/// mutation of it is refused or decodes to what its bytes encode.
#[test]
fn peer_messages_with_extreme_values() {
    check(
        "peer_message structured",
        2.0,
        (message(), mutations()),
        Expect::Both,
        |(message, damage)| {
            let encoded = encode_message(&message);
            assert_eq!(decode_message(&encoded), Ok(message));
            assert_eq!(peer_message(&encoded), Verdict::Accepted);
            peer_message(&mutated(&encoded, &damage))
        },
    );
}
