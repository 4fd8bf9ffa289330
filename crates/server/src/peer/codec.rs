//! The binary form of engine messages on the peer wire.
//!
//! Little-endian fixed-width integers, a tag byte per enum, a u32 count or
//! length before every sequence. Decoding never trusts a count: every read
//! is checked against the bytes left, so a bad or hostile peer gets a
//! [`DecodeError`], never a panic or a huge allocation.

use std::collections::BTreeSet;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use ferry_raft::{
    AppendResult, Configuration, Entry, EntryPayload, ForwardedRequest, MembershipChange, Message,
    MessageBody, RequestError, RequestId, Response, Role, SnapshotMeta, SnapshotOutcome, Status,
};

/// Why a peer message could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// The message ended early.
    #[error("peer message truncated while reading {what}")]
    Truncated {
        /// The field being read.
        what: &'static str,
    },
    /// A tag byte names no known variant.
    #[error(
        "peer message has unknown {what} tag {tag}; is the peer running another ferry version?"
    )]
    UnknownTag {
        /// The enum being read.
        what: &'static str,
        /// The tag.
        tag: u8,
    },
    /// Bytes were left after the message.
    #[error("peer message has {0} unexpected trailing bytes")]
    Trailing(usize),
    /// A string is not UTF-8.
    #[error("peer message has a string that is not UTF-8")]
    Utf8,
}

/// Encodes a message.
pub fn encode_message(message: &Message) -> Bytes {
    let mut out = BytesMut::with_capacity(64);
    out.put_u64_le(message.group);
    out.put_u64_le(message.from);
    out.put_u64_le(message.to);
    out.put_u64_le(message.term);
    put_body(&mut out, &message.body);
    out.freeze()
}

/// Decodes a message.
pub fn decode_message(bytes: &[u8]) -> Result<Message, DecodeError> {
    let mut reader = Reader(bytes);
    let message = Message {
        group: reader.u64("group")?,
        from: reader.u64("from")?,
        to: reader.u64("to")?,
        term: reader.u64("term")?,
        body: reader.body()?,
    };
    if !reader.0.is_empty() {
        return Err(DecodeError::Trailing(reader.0.len()));
    }
    Ok(message)
}

fn put_bool(out: &mut BytesMut, value: bool) {
    out.put_u8(value as u8);
}

fn put_bytes(out: &mut BytesMut, data: &[u8]) {
    out.put_u32_le(data.len() as u32);
    out.put_slice(data);
}

fn put_ids(out: &mut BytesMut, ids: &BTreeSet<u64>) {
    out.put_u32_le(ids.len() as u32);
    for id in ids {
        out.put_u64_le(*id);
    }
}

fn put_config(out: &mut BytesMut, config: &Configuration) {
    put_ids(out, &config.voters);
    put_ids(out, &config.voters_outgoing);
    put_ids(out, &config.learners);
}

fn put_entry(out: &mut BytesMut, entry: &Entry) {
    out.put_u64_le(entry.term);
    out.put_u64_le(entry.index);
    match &entry.payload {
        EntryPayload::Noop => out.put_u8(0),
        EntryPayload::Command(data) => {
            out.put_u8(1);
            put_bytes(out, data);
        }
        EntryPayload::Config(config) => {
            out.put_u8(2);
            put_config(out, config);
        }
    }
}

fn put_snapshot_meta(out: &mut BytesMut, meta: &SnapshotMeta) {
    out.put_u64_le(meta.index);
    out.put_u64_le(meta.term);
    put_config(out, &meta.config);
}

fn put_change(out: &mut BytesMut, change: &MembershipChange) {
    let (tag, id) = match change {
        MembershipChange::AddLearner(id) => (0, id),
        MembershipChange::AddVoter(id) => (1, id),
        MembershipChange::PromoteLearner(id) => (2, id),
        MembershipChange::Remove(id) => (3, id),
    };
    out.put_u8(tag);
    out.put_u64_le(*id);
}

fn put_option_u64(out: &mut BytesMut, value: Option<u64>) {
    match value {
        None => out.put_u8(0),
        Some(value) => {
            out.put_u8(1);
            out.put_u64_le(value);
        }
    }
}

fn put_body(out: &mut BytesMut, body: &MessageBody) {
    match body {
        MessageBody::RequestVote {
            pre_vote,
            last_log_index,
            last_log_term,
            transfer,
        } => {
            out.put_u8(0);
            put_bool(out, *pre_vote);
            out.put_u64_le(*last_log_index);
            out.put_u64_le(*last_log_term);
            put_bool(out, *transfer);
        }
        MessageBody::RequestVoteResponse { pre_vote, granted } => {
            out.put_u8(1);
            put_bool(out, *pre_vote);
            put_bool(out, *granted);
        }
        MessageBody::Append {
            prev_log_index,
            prev_log_term,
            entries,
            leader_commit,
        } => {
            out.put_u8(2);
            out.put_u64_le(*prev_log_index);
            out.put_u64_le(*prev_log_term);
            out.put_u64_le(*leader_commit);
            out.put_u32_le(entries.len() as u32);
            for entry in entries {
                put_entry(out, entry);
            }
        }
        MessageBody::AppendResponse(result) => {
            out.put_u8(3);
            match result {
                AppendResult::Success { match_index } => {
                    out.put_u8(0);
                    out.put_u64_le(*match_index);
                }
                AppendResult::Reject {
                    rejected_index,
                    hint_index,
                    hint_term,
                } => {
                    out.put_u8(1);
                    out.put_u64_le(*rejected_index);
                    out.put_u64_le(*hint_index);
                    out.put_u64_le(*hint_term);
                }
            }
        }
        MessageBody::Heartbeat {
            leader_commit,
            read_seq,
        } => {
            out.put_u8(4);
            out.put_u64_le(*leader_commit);
            out.put_u64_le(*read_seq);
        }
        MessageBody::HeartbeatResponse { read_seq } => {
            out.put_u8(5);
            out.put_u64_le(*read_seq);
        }
        MessageBody::SnapshotChunk {
            meta,
            offset,
            data,
            done,
        } => {
            out.put_u8(6);
            put_snapshot_meta(out, meta);
            out.put_u64_le(*offset);
            put_bytes(out, data);
            put_bool(out, *done);
        }
        MessageBody::SnapshotChunkAck {
            snapshot_index,
            next_offset,
        } => {
            out.put_u8(7);
            out.put_u64_le(*snapshot_index);
            out.put_u64_le(*next_offset);
        }
        MessageBody::SnapshotResponse {
            snapshot_index,
            outcome,
        } => {
            out.put_u8(8);
            out.put_u64_le(*snapshot_index);
            match outcome {
                SnapshotOutcome::Installed { last_index } => {
                    out.put_u8(0);
                    out.put_u64_le(*last_index);
                }
                SnapshotOutcome::Stale { match_index } => {
                    out.put_u8(1);
                    out.put_u64_le(*match_index);
                }
                SnapshotOutcome::Rejected => out.put_u8(2),
            }
        }
        MessageBody::TimeoutNow => out.put_u8(9),
        MessageBody::Forward { id, request } => {
            out.put_u8(10);
            out.put_u64_le(id.0);
            match request {
                ForwardedRequest::Propose(data) => {
                    out.put_u8(0);
                    put_bytes(out, data);
                }
                ForwardedRequest::ReadIndex => out.put_u8(1),
                ForwardedRequest::ChangeMembership(change) => {
                    out.put_u8(2);
                    put_change(out, change);
                }
                ForwardedRequest::TransferLeadership(target) => {
                    out.put_u8(3);
                    out.put_u64_le(*target);
                }
            }
        }
        MessageBody::ForwardResponse { id, result } => {
            out.put_u8(11);
            out.put_u64_le(id.0);
            match result {
                Ok(response) => {
                    out.put_u8(0);
                    put_response(out, response);
                }
                Err(error) => {
                    out.put_u8(1);
                    put_error(out, error);
                }
            }
        }
    }
}

fn put_response(out: &mut BytesMut, response: &Response) {
    match response {
        Response::Proposed { index, term } => {
            out.put_u8(0);
            out.put_u64_le(*index);
            out.put_u64_le(*term);
        }
        Response::ReadReady { index } => {
            out.put_u8(1);
            out.put_u64_le(*index);
        }
        Response::TransferStarted => out.put_u8(2),
        Response::Status(status) => {
            out.put_u8(3);
            out.put_u64_le(status.group);
            out.put_u64_le(status.id);
            out.put_u8(match status.role {
                Role::Follower => 0,
                Role::PreCandidate => 1,
                Role::Candidate => 2,
                Role::Leader => 3,
                Role::Learner => 4,
            });
            put_bool(out, status.receiving_snapshot);
            out.put_u64_le(status.term);
            put_option_u64(out, status.leader);
            out.put_u64_le(status.last_index);
            out.put_u64_le(status.commit);
            out.put_u64_le(status.applied);
            put_config(out, &status.config);
            put_bool(out, status.removed);
        }
    }
}

fn put_error(out: &mut BytesMut, error: &RequestError) {
    match error {
        RequestError::NotLeader { leader } => {
            out.put_u8(0);
            put_option_u64(out, *leader);
        }
        RequestError::NoLeader => out.put_u8(1),
        RequestError::Timeout => out.put_u8(2),
        RequestError::Busy { limit } => {
            out.put_u8(3);
            out.put_u64_le(*limit as u64);
        }
        RequestError::Removed => out.put_u8(4),
        RequestError::LeadershipLost => out.put_u8(5),
        RequestError::MembershipChangePending => out.put_u8(6),
        RequestError::InvalidMembershipChange { reason } => {
            out.put_u8(7);
            put_bytes(out, reason.as_bytes());
        }
        RequestError::LearnerNotCaughtUp {
            id,
            matched,
            last_index,
        } => {
            out.put_u8(8);
            out.put_u64_le(*id);
            out.put_u64_le(*matched);
            out.put_u64_le(*last_index);
        }
        RequestError::TransferInProgress => out.put_u8(9),
        RequestError::LeaseReadsDisabled => out.put_u8(10),
    }
}

/// A checked reader over a message's bytes.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn need(&self, bytes: usize, what: &'static str) -> Result<(), DecodeError> {
        if self.0.len() < bytes {
            return Err(DecodeError::Truncated { what });
        }
        Ok(())
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        self.need(1, what)?;
        Ok(self.0.get_u8())
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.need(4, what)?;
        Ok(self.0.get_u32_le())
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        self.need(8, what)?;
        Ok(self.0.get_u64_le())
    }

    fn bool(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(DecodeError::UnknownTag { what, tag }),
        }
    }

    fn bytes(&mut self, what: &'static str) -> Result<Bytes, DecodeError> {
        let length = self.u32(what)? as usize;
        self.need(length, what)?;
        let data = Bytes::copy_from_slice(&self.0[..length]);
        self.0.advance(length);
        Ok(data)
    }

    fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let data = self.bytes(what)?;
        String::from_utf8(data.to_vec()).map_err(|_| DecodeError::Utf8)
    }

    /// A count of items at least `item_bytes` each: checked against the bytes
    /// left so that a forged count cannot drive a huge allocation.
    fn count(&mut self, item_bytes: usize, what: &'static str) -> Result<usize, DecodeError> {
        let count = self.u32(what)? as usize;
        self.need(count.saturating_mul(item_bytes), what)?;
        Ok(count)
    }

    fn option_u64(&mut self, what: &'static str) -> Result<Option<u64>, DecodeError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.u64(what)?)),
            tag => Err(DecodeError::UnknownTag { what, tag }),
        }
    }

    fn ids(&mut self, what: &'static str) -> Result<BTreeSet<u64>, DecodeError> {
        let count = self.count(8, what)?;
        let mut ids = BTreeSet::new();
        for _ in 0..count {
            ids.insert(self.u64(what)?);
        }
        Ok(ids)
    }

    fn config(&mut self) -> Result<Configuration, DecodeError> {
        Ok(Configuration {
            voters: self.ids("voters")?,
            voters_outgoing: self.ids("outgoing voters")?,
            learners: self.ids("learners")?,
        })
    }

    fn entry(&mut self) -> Result<Entry, DecodeError> {
        let term = self.u64("entry term")?;
        let index = self.u64("entry index")?;
        let payload = match self.u8("entry payload")? {
            0 => EntryPayload::Noop,
            1 => EntryPayload::Command(self.bytes("entry command")?),
            2 => EntryPayload::Config(self.config()?),
            tag => {
                return Err(DecodeError::UnknownTag {
                    what: "entry payload",
                    tag,
                })
            }
        };
        Ok(Entry {
            term,
            index,
            payload,
        })
    }

    fn snapshot_meta(&mut self) -> Result<SnapshotMeta, DecodeError> {
        Ok(SnapshotMeta {
            index: self.u64("snapshot index")?,
            term: self.u64("snapshot term")?,
            config: self.config()?,
        })
    }

    fn change(&mut self) -> Result<MembershipChange, DecodeError> {
        let tag = self.u8("membership change")?;
        let id = self.u64("membership change id")?;
        match tag {
            0 => Ok(MembershipChange::AddLearner(id)),
            1 => Ok(MembershipChange::AddVoter(id)),
            2 => Ok(MembershipChange::PromoteLearner(id)),
            3 => Ok(MembershipChange::Remove(id)),
            tag => Err(DecodeError::UnknownTag {
                what: "membership change",
                tag,
            }),
        }
    }

    fn body(&mut self) -> Result<MessageBody, DecodeError> {
        let tag = self.u8("message kind")?;
        let body = match tag {
            0 => MessageBody::RequestVote {
                pre_vote: self.bool("pre_vote")?,
                last_log_index: self.u64("last_log_index")?,
                last_log_term: self.u64("last_log_term")?,
                transfer: self.bool("transfer")?,
            },
            1 => MessageBody::RequestVoteResponse {
                pre_vote: self.bool("pre_vote")?,
                granted: self.bool("granted")?,
            },
            2 => {
                let prev_log_index = self.u64("prev_log_index")?;
                let prev_log_term = self.u64("prev_log_term")?;
                let leader_commit = self.u64("leader_commit")?;
                // An entry is at least 17 bytes (term, index, payload tag).
                let count = self.count(17, "entries")?;
                let mut entries = Vec::with_capacity(count);
                for _ in 0..count {
                    entries.push(self.entry()?);
                }
                MessageBody::Append {
                    prev_log_index,
                    prev_log_term,
                    entries,
                    leader_commit,
                }
            }
            3 => MessageBody::AppendResponse(match self.u8("append result")? {
                0 => AppendResult::Success {
                    match_index: self.u64("match_index")?,
                },
                1 => AppendResult::Reject {
                    rejected_index: self.u64("rejected_index")?,
                    hint_index: self.u64("hint_index")?,
                    hint_term: self.u64("hint_term")?,
                },
                tag => {
                    return Err(DecodeError::UnknownTag {
                        what: "append result",
                        tag,
                    })
                }
            }),
            4 => MessageBody::Heartbeat {
                leader_commit: self.u64("leader_commit")?,
                read_seq: self.u64("read_seq")?,
            },
            5 => MessageBody::HeartbeatResponse {
                read_seq: self.u64("read_seq")?,
            },
            6 => MessageBody::SnapshotChunk {
                meta: self.snapshot_meta()?,
                offset: self.u64("snapshot offset")?,
                data: self.bytes("snapshot data")?,
                done: self.bool("snapshot done")?,
            },
            7 => MessageBody::SnapshotChunkAck {
                snapshot_index: self.u64("snapshot index")?,
                next_offset: self.u64("next offset")?,
            },
            8 => {
                let snapshot_index = self.u64("snapshot index")?;
                let outcome = match self.u8("snapshot outcome")? {
                    0 => SnapshotOutcome::Installed {
                        last_index: self.u64("last_index")?,
                    },
                    1 => SnapshotOutcome::Stale {
                        match_index: self.u64("match_index")?,
                    },
                    2 => SnapshotOutcome::Rejected,
                    tag => {
                        return Err(DecodeError::UnknownTag {
                            what: "snapshot outcome",
                            tag,
                        })
                    }
                };
                MessageBody::SnapshotResponse {
                    snapshot_index,
                    outcome,
                }
            }
            9 => MessageBody::TimeoutNow,
            10 => {
                let id = RequestId(self.u64("request id")?);
                let request = match self.u8("forwarded request")? {
                    0 => ForwardedRequest::Propose(self.bytes("proposal")?),
                    1 => ForwardedRequest::ReadIndex,
                    2 => ForwardedRequest::ChangeMembership(self.change()?),
                    3 => ForwardedRequest::TransferLeadership(self.u64("transfer target")?),
                    tag => {
                        return Err(DecodeError::UnknownTag {
                            what: "forwarded request",
                            tag,
                        })
                    }
                };
                MessageBody::Forward { id, request }
            }
            11 => {
                let id = RequestId(self.u64("request id")?);
                let result = match self.u8("forward result")? {
                    0 => Ok(self.response()?),
                    1 => Err(self.error()?),
                    tag => {
                        return Err(DecodeError::UnknownTag {
                            what: "forward result",
                            tag,
                        })
                    }
                };
                MessageBody::ForwardResponse { id, result }
            }
            tag => {
                return Err(DecodeError::UnknownTag {
                    what: "message kind",
                    tag,
                })
            }
        };
        Ok(body)
    }

    fn response(&mut self) -> Result<Response, DecodeError> {
        Ok(match self.u8("response")? {
            0 => Response::Proposed {
                index: self.u64("index")?,
                term: self.u64("term")?,
            },
            1 => Response::ReadReady {
                index: self.u64("index")?,
            },
            2 => Response::TransferStarted,
            3 => Response::Status(Status {
                group: self.u64("group")?,
                id: self.u64("id")?,
                role: match self.u8("role")? {
                    0 => Role::Follower,
                    1 => Role::PreCandidate,
                    2 => Role::Candidate,
                    3 => Role::Leader,
                    4 => Role::Learner,
                    tag => return Err(DecodeError::UnknownTag { what: "role", tag }),
                },
                receiving_snapshot: self.bool("receiving_snapshot")?,
                term: self.u64("term")?,
                leader: self.option_u64("leader")?,
                last_index: self.u64("last_index")?,
                commit: self.u64("commit")?,
                applied: self.u64("applied")?,
                config: self.config()?,
                removed: self.bool("removed")?,
            }),
            tag => {
                return Err(DecodeError::UnknownTag {
                    what: "response",
                    tag,
                })
            }
        })
    }

    fn error(&mut self) -> Result<RequestError, DecodeError> {
        Ok(match self.u8("request error")? {
            0 => RequestError::NotLeader {
                leader: self.option_u64("leader")?,
            },
            1 => RequestError::NoLeader,
            2 => RequestError::Timeout,
            3 => RequestError::Busy {
                limit: self.u64("limit")? as usize,
            },
            4 => RequestError::Removed,
            5 => RequestError::LeadershipLost,
            6 => RequestError::MembershipChangePending,
            7 => RequestError::InvalidMembershipChange {
                reason: self.string("reason")?,
            },
            8 => RequestError::LearnerNotCaughtUp {
                id: self.u64("id")?,
                matched: self.u64("matched")?,
                last_index: self.u64("last_index")?,
            },
            9 => RequestError::TransferInProgress,
            10 => RequestError::LeaseReadsDisabled,
            tag => {
                return Err(DecodeError::UnknownTag {
                    what: "request error",
                    tag,
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            MessageBody::HeartbeatResponse { read_seq: 11 },
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
        ];
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
            assert_eq!(decode_message(&bytes), Ok(original));
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error_not_a_panic() {
        for original in samples() {
            let bytes = encode_message(&original);
            for cut in 0..bytes.len() {
                assert!(
                    decode_message(&bytes[..cut]).is_err(),
                    "cut at {cut} of {original:?}"
                );
            }
            let mut longer = bytes.to_vec();
            longer.push(0);
            assert_eq!(decode_message(&longer), Err(DecodeError::Trailing(1)));
        }
    }

    proptest::proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode_message(&bytes);
        }
    }

    #[test]
    fn a_forged_count_does_not_allocate() {
        let mut bytes = BytesMut::new();
        for field in [1u64, 1, 2, 1] {
            bytes.put_u64_le(field);
        }
        bytes.put_u8(2); // Append
        bytes.put_u64_le(0);
        bytes.put_u64_le(0);
        bytes.put_u64_le(0);
        bytes.put_u32_le(u32::MAX); // claims four billion entries
        assert_eq!(
            decode_message(&bytes),
            Err(DecodeError::Truncated { what: "entries" })
        );
    }
}
