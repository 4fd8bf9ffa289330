//! The binary form of engine messages on the peer wire.
//!
//! Built on the storage layer's codec ([`ferry_storage::codec`]), so that an
//! entry, a configuration or a snapshot's metadata has one binary form, on
//! disk and on the wire, and one decoder with one set of checks: every
//! count and length is checked against its limit and the bytes left before
//! anything is allocated, so a bad or hostile peer gets a [`DecodeError`],
//! never a panic or a huge allocation. Decoding slices commands and
//! snapshot data out of the received frame without copying them.
//!
//! A message is `group, from, to, term` (u64 each), a tag byte for the
//! body's kind, then the body's fields in order; enums are a tag byte and
//! their fields.

use bytes::Bytes;
use ferry_raft::{
    AppendResult, CampaignOutcome, CampaignRefusal, ForwardedRequest, MembershipChange, Message,
    MessageBody, RequestError, RequestId, Response, Role, SnapshotOutcome, Status,
};
use ferry_storage::codec::{Decoder, Encoder, COMMAND_BYTES_MAX, ENTRY_BYTES_MIN};

pub use ferry_storage::DecodeError;

/// The largest snapshot chunk a message may carry; the transport's frame
/// limit is lower, so this only bounds what a forged length may claim.
const SNAPSHOT_CHUNK_BYTES_MAX: u64 = 64 * 1024 * 1024;
/// The longest reason text a refused membership change may carry.
const REASON_BYTES_MAX: u64 = 64 * 1024;

/// Encodes a message.
pub fn encode_message(message: &Message) -> Bytes {
    let mut out = Encoder::new(Vec::with_capacity(64));
    out.u64(message.group);
    out.u64(message.from);
    out.u64(message.to);
    out.u64(message.term);
    put_body(&mut out, &message.body);
    Bytes::from(out.into_inner())
}

/// Decodes a message. Commands and snapshot data in it share `bytes`.
pub fn decode_message(bytes: &Bytes) -> Result<Message, DecodeError> {
    let mut reader = Reader(Decoder::new(bytes.clone()));
    let message = Message {
        group: reader.0.u64()?,
        from: reader.0.u64()?,
        to: reader.0.u64()?,
        term: reader.0.u64()?,
        body: reader.body()?,
    };
    reader.0.finish()?;
    Ok(message)
}

fn put_bool(out: &mut Encoder, value: bool) {
    out.u8(u8::from(value));
}

fn put_option_u64(out: &mut Encoder, value: Option<u64>) {
    match value {
        None => out.u8(0),
        Some(value) => {
            out.u8(1);
            out.u64(value);
        }
    }
}

fn put_change(out: &mut Encoder, change: &MembershipChange) {
    let (tag, id) = match change {
        MembershipChange::AddLearner(id) => (0, id),
        MembershipChange::AddVoter(id) => (1, id),
        MembershipChange::PromoteLearner(id) => (2, id),
        MembershipChange::Remove(id) => (3, id),
    };
    out.u8(tag);
    out.u64(*id);
}

fn put_body(out: &mut Encoder, body: &MessageBody) {
    match body {
        MessageBody::RequestVote {
            pre_vote,
            last_log_index,
            last_log_term,
            transfer,
        } => {
            out.u8(0);
            put_bool(out, *pre_vote);
            out.u64(*last_log_index);
            out.u64(*last_log_term);
            put_bool(out, *transfer);
        }
        MessageBody::RequestVoteResponse {
            pre_vote,
            granted,
            commit,
            commit_term,
        } => {
            out.u8(1);
            put_bool(out, *pre_vote);
            put_bool(out, *granted);
            out.u64(*commit);
            out.u64(*commit_term);
        }
        MessageBody::Append {
            prev_log_index,
            prev_log_term,
            entries,
            leader_commit,
        } => {
            out.u8(2);
            out.u64(*prev_log_index);
            out.u64(*prev_log_term);
            out.u64(*leader_commit);
            out.u32(entries.len() as u32);
            for entry in entries {
                out.entry(entry);
            }
        }
        MessageBody::AppendResponse(result) => {
            out.u8(3);
            match result {
                AppendResult::Success { match_index } => {
                    out.u8(0);
                    out.u64(*match_index);
                }
                AppendResult::Reject {
                    rejected_index,
                    hint_index,
                    hint_term,
                } => {
                    out.u8(1);
                    out.u64(*rejected_index);
                    out.u64(*hint_index);
                    out.u64(*hint_term);
                }
            }
        }
        MessageBody::Heartbeat {
            leader_commit,
            read_seq,
        } => {
            out.u8(4);
            out.u64(*leader_commit);
            out.u64(*read_seq);
        }
        MessageBody::HeartbeatResponse {
            read_seq,
            last_index,
            needs_append,
        } => {
            out.u8(5);
            out.u64(*read_seq);
            out.u64(*last_index);
            put_bool(out, *needs_append);
        }
        MessageBody::SnapshotChunk {
            meta,
            offset,
            data,
            done,
        } => {
            out.u8(6);
            out.snapshot_meta(meta);
            out.u64(*offset);
            out.bytes(data);
            put_bool(out, *done);
        }
        MessageBody::SnapshotChunkAck {
            snapshot_index,
            next_offset,
        } => {
            out.u8(7);
            out.u64(*snapshot_index);
            out.u64(*next_offset);
        }
        MessageBody::SnapshotResponse {
            snapshot_index,
            outcome,
        } => {
            out.u8(8);
            out.u64(*snapshot_index);
            match outcome {
                SnapshotOutcome::Installed { last_index } => {
                    out.u8(0);
                    out.u64(*last_index);
                }
                SnapshotOutcome::Stale { match_index } => {
                    out.u8(1);
                    out.u64(*match_index);
                }
                SnapshotOutcome::Rejected => out.u8(2),
            }
        }
        MessageBody::TimeoutNow => out.u8(9),
        MessageBody::Forward { id, request } => {
            out.u8(10);
            out.u64(id.0);
            match request {
                ForwardedRequest::Propose(data) => {
                    out.u8(0);
                    out.bytes(data);
                }
                ForwardedRequest::ReadIndex => out.u8(1),
                ForwardedRequest::ChangeMembership(change) => {
                    out.u8(2);
                    put_change(out, change);
                }
                ForwardedRequest::TransferLeadership(target) => {
                    out.u8(3);
                    out.u64(*target);
                }
            }
        }
        MessageBody::ForwardResponse { id, result } => {
            out.u8(11);
            out.u64(id.0);
            match result {
                Ok(response) => {
                    out.u8(0);
                    put_response(out, response);
                }
                Err(error) => {
                    out.u8(1);
                    put_error(out, error);
                }
            }
        }
        MessageBody::Quiesce {
            last_index,
            last_term,
            commit,
        } => {
            out.u8(12);
            out.u64(*last_index);
            out.u64(*last_term);
            out.u64(*commit);
        }
        MessageBody::WakeUp => out.u8(13),
    }
}

fn put_response(out: &mut Encoder, response: &Response) {
    match response {
        Response::Proposed { index, term } => {
            out.u8(0);
            out.u64(*index);
            out.u64(*term);
        }
        Response::ReadReady { index } => {
            out.u8(1);
            out.u64(*index);
        }
        Response::TransferStarted => out.u8(2),
        Response::Status(status) => {
            out.u8(3);
            out.u64(status.group);
            out.u64(status.id);
            out.u8(match status.role {
                Role::Follower => 0,
                Role::PreCandidate => 1,
                Role::Candidate => 2,
                Role::Leader => 3,
                Role::Learner => 4,
            });
            put_bool(out, status.receiving_snapshot);
            out.u64(status.term);
            put_option_u64(out, status.leader);
            out.u64(status.last_index);
            out.u64(status.commit);
            out.u64(status.applied);
            out.configuration(&status.config);
            put_bool(out, status.removed);
        }
        Response::Campaign(outcome) => {
            out.u8(4);
            out.u8(match outcome {
                CampaignOutcome::Started => 0,
                CampaignOutcome::AlreadyCampaigning => 1,
                CampaignOutcome::AlreadyLeader => 2,
            });
        }
    }
}

fn put_error(out: &mut Encoder, error: &RequestError) {
    match error {
        RequestError::NotLeader { leader } => {
            out.u8(0);
            put_option_u64(out, *leader);
        }
        RequestError::NoLeader => out.u8(1),
        RequestError::Timeout => out.u8(2),
        RequestError::Busy { limit } => {
            out.u8(3);
            out.u64(*limit as u64);
        }
        RequestError::Removed => out.u8(4),
        RequestError::LeadershipLost => out.u8(5),
        RequestError::MembershipChangePending => out.u8(6),
        RequestError::InvalidMembershipChange { reason } => {
            out.u8(7);
            out.bytes(reason.as_bytes());
        }
        RequestError::LearnerNotCaughtUp {
            id,
            matched,
            last_index,
        } => {
            out.u8(8);
            out.u64(*id);
            out.u64(*matched);
            out.u64(*last_index);
        }
        RequestError::TransferInProgress => out.u8(9),
        RequestError::LeaseReadsDisabled => out.u8(10),
        RequestError::Halted { reason } => {
            out.u8(11);
            out.bytes(reason.as_bytes());
        }
        RequestError::CannotCampaign { reason } => {
            out.u8(12);
            out.u8(match reason {
                CampaignRefusal::NotVoter => 0,
                CampaignRefusal::ReceivingSnapshot => 1,
                CampaignRefusal::TermExhausted => 2,
            });
        }
    }
}

/// The storage decoder with the peer messages' own enums on top.
struct Reader(Decoder);

impl Reader {
    /// A tag byte, and where it was (for [`DecodeError::UnknownTag`]).
    fn tag(&mut self) -> Result<(u8, usize), DecodeError> {
        let at = self.0.position();
        Ok((self.0.u8()?, at))
    }

    fn bool(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        match self.tag()? {
            (0, _) => Ok(false),
            (1, _) => Ok(true),
            (tag, at) => Err(DecodeError::UnknownTag { what, tag, at }),
        }
    }

    fn option_u64(&mut self, what: &'static str) -> Result<Option<u64>, DecodeError> {
        match self.tag()? {
            (0, _) => Ok(None),
            (1, _) => Ok(Some(self.0.u64()?)),
            (tag, at) => Err(DecodeError::UnknownTag { what, tag, at }),
        }
    }

    fn string(&mut self, what: &'static str, max: u64) -> Result<String, DecodeError> {
        let bytes = self.0.bytes(what, max)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| DecodeError::Invalid("a text that is not UTF-8"))
    }

    fn change(&mut self) -> Result<MembershipChange, DecodeError> {
        let (tag, at) = self.tag()?;
        let id = self.0.u64()?;
        match tag {
            0 => Ok(MembershipChange::AddLearner(id)),
            1 => Ok(MembershipChange::AddVoter(id)),
            2 => Ok(MembershipChange::PromoteLearner(id)),
            3 => Ok(MembershipChange::Remove(id)),
            tag => Err(DecodeError::UnknownTag {
                what: "membership change",
                tag,
                at,
            }),
        }
    }

    fn body(&mut self) -> Result<MessageBody, DecodeError> {
        let body = match self.tag()? {
            (0, _) => MessageBody::RequestVote {
                pre_vote: self.bool("pre_vote")?,
                last_log_index: self.0.u64()?,
                last_log_term: self.0.u64()?,
                transfer: self.bool("transfer")?,
            },
            (1, _) => MessageBody::RequestVoteResponse {
                pre_vote: self.bool("pre_vote")?,
                granted: self.bool("granted")?,
                commit: self.0.u64()?,
                commit_term: self.0.u64()?,
            },
            (2, _) => {
                let prev_log_index = self.0.u64()?;
                let prev_log_term = self.0.u64()?;
                let leader_commit = self.0.u64()?;
                let count = self
                    .0
                    .count("entry count", u64::from(u32::MAX), ENTRY_BYTES_MIN)?;
                let mut entries = Vec::with_capacity(count);
                for _ in 0..count {
                    entries.push(self.0.entry()?);
                }
                MessageBody::Append {
                    prev_log_index,
                    prev_log_term,
                    entries,
                    leader_commit,
                }
            }
            (3, _) => MessageBody::AppendResponse(match self.tag()? {
                (0, _) => AppendResult::Success {
                    match_index: self.0.u64()?,
                },
                (1, _) => AppendResult::Reject {
                    rejected_index: self.0.u64()?,
                    hint_index: self.0.u64()?,
                    hint_term: self.0.u64()?,
                },
                (tag, at) => {
                    return Err(DecodeError::UnknownTag {
                        what: "append result",
                        tag,
                        at,
                    })
                }
            }),
            (4, _) => MessageBody::Heartbeat {
                leader_commit: self.0.u64()?,
                read_seq: self.0.u64()?,
            },
            (5, _) => MessageBody::HeartbeatResponse {
                read_seq: self.0.u64()?,
                last_index: self.0.u64()?,
                needs_append: self.bool("needs_append")?,
            },
            (6, _) => MessageBody::SnapshotChunk {
                meta: self.0.snapshot_meta()?,
                offset: self.0.u64()?,
                data: self.0.bytes("snapshot chunk", SNAPSHOT_CHUNK_BYTES_MAX)?,
                done: self.bool("snapshot done")?,
            },
            (7, _) => MessageBody::SnapshotChunkAck {
                snapshot_index: self.0.u64()?,
                next_offset: self.0.u64()?,
            },
            (8, _) => {
                let snapshot_index = self.0.u64()?;
                let outcome = match self.tag()? {
                    (0, _) => SnapshotOutcome::Installed {
                        last_index: self.0.u64()?,
                    },
                    (1, _) => SnapshotOutcome::Stale {
                        match_index: self.0.u64()?,
                    },
                    (2, _) => SnapshotOutcome::Rejected,
                    (tag, at) => {
                        return Err(DecodeError::UnknownTag {
                            what: "snapshot outcome",
                            tag,
                            at,
                        })
                    }
                };
                MessageBody::SnapshotResponse {
                    snapshot_index,
                    outcome,
                }
            }
            (9, _) => MessageBody::TimeoutNow,
            (10, _) => {
                let id = RequestId(self.0.u64()?);
                let request = match self.tag()? {
                    (0, _) => {
                        ForwardedRequest::Propose(self.0.bytes("proposal", COMMAND_BYTES_MAX)?)
                    }
                    (1, _) => ForwardedRequest::ReadIndex,
                    (2, _) => ForwardedRequest::ChangeMembership(self.change()?),
                    (3, _) => ForwardedRequest::TransferLeadership(self.0.u64()?),
                    (tag, at) => {
                        return Err(DecodeError::UnknownTag {
                            what: "forwarded request",
                            tag,
                            at,
                        })
                    }
                };
                MessageBody::Forward { id, request }
            }
            (11, _) => {
                let id = RequestId(self.0.u64()?);
                let result = match self.tag()? {
                    (0, _) => Ok(self.response()?),
                    (1, _) => Err(self.error()?),
                    (tag, at) => {
                        return Err(DecodeError::UnknownTag {
                            what: "forward result",
                            tag,
                            at,
                        })
                    }
                };
                MessageBody::ForwardResponse { id, result }
            }
            (12, _) => MessageBody::Quiesce {
                last_index: self.0.u64()?,
                last_term: self.0.u64()?,
                commit: self.0.u64()?,
            },
            (13, _) => MessageBody::WakeUp,
            (tag, at) => {
                return Err(DecodeError::UnknownTag {
                    what: "message kind (is the peer running another ferry version?)",
                    tag,
                    at,
                })
            }
        };
        Ok(body)
    }

    fn response(&mut self) -> Result<Response, DecodeError> {
        Ok(match self.tag()? {
            (0, _) => Response::Proposed {
                index: self.0.u64()?,
                term: self.0.u64()?,
            },
            (1, _) => Response::ReadReady {
                index: self.0.u64()?,
            },
            (2, _) => Response::TransferStarted,
            (3, _) => Response::Status(Status {
                group: self.0.u64()?,
                id: self.0.u64()?,
                role: match self.tag()? {
                    (0, _) => Role::Follower,
                    (1, _) => Role::PreCandidate,
                    (2, _) => Role::Candidate,
                    (3, _) => Role::Leader,
                    (4, _) => Role::Learner,
                    (tag, at) => {
                        return Err(DecodeError::UnknownTag {
                            what: "role",
                            tag,
                            at,
                        })
                    }
                },
                receiving_snapshot: self.bool("receiving_snapshot")?,
                term: self.0.u64()?,
                leader: self.option_u64("leader")?,
                last_index: self.0.u64()?,
                commit: self.0.u64()?,
                applied: self.0.u64()?,
                config: self.0.configuration()?,
                removed: self.bool("removed")?,
            }),
            (4, _) => Response::Campaign(match self.tag()? {
                (0, _) => CampaignOutcome::Started,
                (1, _) => CampaignOutcome::AlreadyCampaigning,
                (2, _) => CampaignOutcome::AlreadyLeader,
                (tag, at) => {
                    return Err(DecodeError::UnknownTag {
                        what: "campaign outcome",
                        tag,
                        at,
                    })
                }
            }),
            (tag, at) => {
                return Err(DecodeError::UnknownTag {
                    what: "response",
                    tag,
                    at,
                })
            }
        })
    }

    fn error(&mut self) -> Result<RequestError, DecodeError> {
        Ok(match self.tag()? {
            (0, _) => RequestError::NotLeader {
                leader: self.option_u64("leader")?,
            },
            (1, _) => RequestError::NoLeader,
            (2, _) => RequestError::Timeout,
            (3, _) => RequestError::Busy {
                limit: usize::try_from(self.0.u64()?).unwrap_or(usize::MAX),
            },
            (4, _) => RequestError::Removed,
            (5, _) => RequestError::LeadershipLost,
            (6, _) => RequestError::MembershipChangePending,
            (7, _) => RequestError::InvalidMembershipChange {
                reason: self.string("reason", REASON_BYTES_MAX)?,
            },
            (8, _) => RequestError::LearnerNotCaughtUp {
                id: self.0.u64()?,
                matched: self.0.u64()?,
                last_index: self.0.u64()?,
            },
            (9, _) => RequestError::TransferInProgress,
            (10, _) => RequestError::LeaseReadsDisabled,
            (11, _) => RequestError::Halted {
                reason: self.string("reason", REASON_BYTES_MAX)?,
            },
            (12, _) => RequestError::CannotCampaign {
                reason: match self.tag()? {
                    (0, _) => CampaignRefusal::NotVoter,
                    (1, _) => CampaignRefusal::ReceivingSnapshot,
                    (2, _) => CampaignRefusal::TermExhausted,
                    (tag, at) => {
                        return Err(DecodeError::UnknownTag {
                            what: "campaign refusal",
                            tag,
                            at,
                        })
                    }
                },
            },
            (tag, at) => {
                return Err(DecodeError::UnknownTag {
                    what: "request error",
                    tag,
                    at,
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_raft::{Configuration, Entry, EntryPayload, SnapshotMeta};

    fn message(body: MessageBody) -> Message {
        Message {
            group: 3,
            from: 1,
            to: 2,
            term: 9,
            body,
        }
    }

    fn samples() -> Vec<Message> {
        let config = Configuration {
            voters: [1, 2, 3].into(),
            voters_outgoing: [1, 2].into(),
            learners: [4].into(),
        };
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
            MessageBody::Quiesce {
                last_index: 40,
                last_term: 9,
                commit: 40,
            },
            MessageBody::WakeUp,
        ];
        bodies.extend(
            [
                CampaignOutcome::Started,
                CampaignOutcome::AlreadyCampaigning,
                CampaignOutcome::AlreadyLeader,
            ]
            .into_iter()
            .map(|outcome| MessageBody::ForwardResponse {
                id: RequestId(10),
                result: Ok(Response::Campaign(outcome)),
            }),
        );
        let errors = [
            RequestError::NotLeader { leader: Some(1) },
            RequestError::NotLeader { leader: None },
            RequestError::NoLeader,
            RequestError::Timeout,
            RequestError::Busy { limit: 10 },
            RequestError::Removed,
            RequestError::LeadershipLost,
            RequestError::MembershipChangePending,
            RequestError::InvalidMembershipChange {
                reason: "node 4 is already a voter".into(),
            },
            RequestError::LearnerNotCaughtUp {
                id: 4,
                matched: 10,
                last_index: 500,
            },
            RequestError::TransferInProgress,
            RequestError::LeaseReadsDisabled,
            RequestError::Halted {
                reason: "a log conflict".into(),
            },
            RequestError::CannotCampaign {
                reason: CampaignRefusal::NotVoter,
            },
            RequestError::CannotCampaign {
                reason: CampaignRefusal::ReceivingSnapshot,
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
        bodies.into_iter().map(message).collect()
    }

    #[test]
    fn every_message_kind_round_trips() {
        for original in samples() {
            let bytes = encode_message(&original);
            assert_eq!(decode_message(&bytes), Ok(original.clone()));
            // One binary form of entries on disk and on the wire.
            if let MessageBody::Append { entries, .. } = &original.body {
                let mut storage = Encoder::new(Vec::new());
                for entry in entries {
                    storage.entry(entry);
                }
                let storage = storage.into_inner();
                assert!(bytes
                    .windows(storage.len())
                    .any(|w| w == storage.as_slice()));
            }
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error_not_a_panic() {
        for original in samples() {
            let bytes = encode_message(&original);
            for cut in 0..bytes.len() {
                assert!(
                    decode_message(&bytes.slice(..cut)).is_err(),
                    "cut at {cut} of {original:?}"
                );
            }
            let mut longer = bytes.to_vec();
            longer.push(0);
            assert_eq!(
                decode_message(&Bytes::from(longer)),
                Err(DecodeError::TrailingBytes { count: 1 })
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode_message(&Bytes::from(bytes));
        }
    }

    #[test]
    fn the_quiesce_notice_and_the_wake_up_round_trip_with_their_fields() {
        let notice = message(MessageBody::Quiesce {
            last_index: 1 << 40,
            last_term: 77,
            commit: (1 << 40) - 1,
        });
        let bytes = encode_message(&notice);
        // Header (four u64), the kind tag, three u64 fields.
        assert_eq!(bytes.len(), 4 * 8 + 1 + 3 * 8);
        assert_eq!(decode_message(&bytes), Ok(notice));
        let wake = message(MessageBody::WakeUp);
        let bytes = encode_message(&wake);
        assert_eq!(bytes.len(), 4 * 8 + 1);
        assert_eq!(decode_message(&bytes), Ok(wake));
    }

    #[test]
    fn a_forged_count_does_not_allocate() {
        let mut bytes = Encoder::new(Vec::new());
        for field in [1u64, 1, 2, 1] {
            bytes.u64(field);
        }
        bytes.u8(2); // Append
        bytes.u64(0);
        bytes.u64(0);
        bytes.u64(0);
        bytes.u32(u32::MAX); // claims four billion entries
        let bytes = Bytes::from(bytes.into_inner());
        assert!(matches!(
            decode_message(&bytes),
            Err(DecodeError::Truncated { .. })
        ));
    }

    #[test]
    fn a_configuration_with_node_zero_or_a_repeated_id_is_refused() {
        let mut status = Encoder::new(Vec::new());
        for field in [1u64, 1, 2, 1] {
            status.u64(field);
        }
        status.u8(11); // ForwardResponse
        status.u64(1);
        status.u8(0); // Ok
        status.u8(3); // Status
        for field in [1u64, 2] {
            status.u64(field);
        }
        status.u8(0); // Follower
        status.u8(0);
        status.u64(1);
        status.u8(0); // no leader
        for field in [0u64, 0, 0] {
            status.u64(field);
        }
        let mut zero = Encoder::new(status.into_inner());
        zero.u32(1);
        zero.u64(0); // a voter with id 0
        zero.u32(0);
        zero.u32(0);
        zero.u8(0);
        assert_eq!(
            decode_message(&Bytes::from(zero.into_inner())),
            Err(DecodeError::Invalid("node id 0 in a configuration"))
        );
    }

    #[test]
    fn commands_are_sliced_from_the_frame_not_copied() {
        let original = message(MessageBody::Forward {
            id: RequestId(5),
            request: ForwardedRequest::Propose(Bytes::from(vec![7u8; 4096])),
        });
        let bytes = encode_message(&original);
        let Ok(Message {
            body:
                MessageBody::Forward {
                    request: ForwardedRequest::Propose(data),
                    ..
                },
            ..
        }) = decode_message(&bytes)
        else {
            panic!("not a forwarded proposal");
        };
        let frame = bytes.as_ptr_range();
        assert!(frame.contains(&data.as_ptr()));
    }
}
