//! Binary codec for the engine's types and for the log's records.
//!
//! Little-endian fixed-width integers, length-prefixed byte strings and
//! count-prefixed sets. Decoding never panics and never allocates more than
//! the input can justify: every count is checked against the bytes left, and
//! every length against a format limit, before anything is reserved.
//!
//! On disk each record is framed as `[length u32][crc32c u32][payload]`,
//! where the checksum covers the length field and the payload, so a damaged
//! length is caught as surely as damaged data.

use std::collections::BTreeSet;

use bytes::Bytes;
use ferry_raft::{
    Configuration, Entry, EntryPayload, GroupId, HardState, Index, NodeId, SnapshotMeta, Term,
};

use crate::error::DecodeError;

/// The largest command payload a single entry may carry.
pub const COMMAND_BYTES_MAX: u64 = 32 * 1024 * 1024;
/// The most members one set of a configuration may list.
pub const CONFIG_MEMBERS_MAX: u64 = 1 << 16;
/// The largest framed record payload. Larger writes are split by the writer.
pub const RECORD_BYTES_MAX: u64 = 64 * 1024 * 1024;
/// Bytes of the frame header: length and checksum.
pub const FRAME_HEADER_BYTES: usize = 8;

/// Whether a configuration is small enough to be encoded and decoded.
pub fn config_fits(c: &Configuration) -> bool {
    [&c.voters, &c.voters_outgoing, &c.learners]
        .iter()
        .all(|set| set.len() as u64 <= CONFIG_MEMBERS_MAX)
}

/// Appends little-endian values to a buffer.
#[derive(Debug, Default)]
pub struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    /// An encoder writing to `buf` (appending to what it holds).
    pub fn new(buf: Vec<u8>) -> Self {
        Encoder { buf }
    }
    /// The bytes written.
    pub fn into_inner(self) -> Vec<u8> {
        self.buf
    }
    /// Writes one byte.
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    /// Writes a u32.
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    /// Writes a u64.
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    /// Writes a length-prefixed byte string.
    pub fn bytes(&mut self, v: &[u8]) {
        // Lengths above u32 cannot occur: callers enforce COMMAND_BYTES_MAX.
        debug_assert!(v.len() as u64 <= u32::MAX as u64);
        self.u32(v.len() as u32);
        self.buf.extend_from_slice(v);
    }
    fn set(&mut self, set: &BTreeSet<NodeId>) {
        self.u32(set.len() as u32);
        for id in set {
            self.u64(*id);
        }
    }
    /// Writes a configuration.
    pub fn configuration(&mut self, c: &Configuration) {
        self.set(&c.voters);
        self.set(&c.voters_outgoing);
        self.set(&c.learners);
    }
    /// Writes a hard state.
    pub fn hard_state(&mut self, hs: &HardState) {
        self.u64(hs.term);
        match hs.vote {
            None => {
                self.u8(0);
                self.u64(0);
            }
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
        }
        self.u64(hs.commit);
    }
    /// Writes a snapshot's metadata.
    pub fn snapshot_meta(&mut self, m: &SnapshotMeta) {
        self.u64(m.index);
        self.u64(m.term);
        self.configuration(&m.config);
    }
    /// Writes one entry.
    pub fn entry(&mut self, e: &Entry) {
        self.u64(e.term);
        self.u64(e.index);
        match &e.payload {
            EntryPayload::Noop => self.u8(0),
            EntryPayload::Command(data) => {
                self.u8(1);
                self.bytes(data);
            }
            EntryPayload::Config(c) => {
                self.u8(2);
                self.configuration(c);
            }
        }
    }
}

/// Reads little-endian values from a byte string, without copying payloads.
#[derive(Debug)]
pub struct Decoder {
    data: Bytes,
    pos: usize,
}

impl Decoder {
    /// A decoder over `data`.
    pub fn new(data: Bytes) -> Self {
        Decoder { data, pos: 0 }
    }
    /// Where the next read starts, in bytes from the start of the input
    /// (for errors that say where).
    pub fn position(&self) -> usize {
        self.pos
    }
    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }
    /// Fails unless every byte has been read.
    pub fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(DecodeError::TrailingBytes { count }),
        }
    }
    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Truncated {
                at: self.pos,
                needed: n - self.remaining(),
            });
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    /// Reads a u32.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    /// Reads a u64.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    /// Reads a length-prefixed byte string of at most `max` bytes.
    pub fn bytes(&mut self, what: &'static str, max: u64) -> Result<Bytes, DecodeError> {
        let span = self.bytes_span(what, max)?;
        Ok(self.data.slice(span))
    }
    /// Reads a length-prefixed byte string of at most `max` bytes and
    /// returns where it is in the input, for a caller that only compares
    /// it in place ([`Decoder::input`]) and keeps few.
    pub fn bytes_span(
        &mut self,
        what: &'static str,
        max: u64,
    ) -> Result<std::ops::Range<usize>, DecodeError> {
        let len = self.u32()? as u64;
        if len > max {
            return Err(DecodeError::TooLong { what, len, max });
        }
        let len = len as usize;
        if self.remaining() < len {
            return Err(DecodeError::Truncated {
                at: self.pos,
                needed: len - self.remaining(),
            });
        }
        let span = self.pos..self.pos + len;
        self.pos += len;
        Ok(span)
    }
    /// The whole input (spans from [`Decoder::bytes_span`] index it).
    pub fn input(&self) -> &Bytes {
        &self.data
    }
    /// Reads a count and checks it against a limit and the bytes left,
    /// given the fewest bytes one item takes.
    pub fn count(
        &mut self,
        what: &'static str,
        max: u64,
        item_bytes_min: usize,
    ) -> Result<usize, DecodeError> {
        let count = self.u32()? as u64;
        if count > max {
            return Err(DecodeError::TooLong {
                what,
                len: count,
                max,
            });
        }
        let needed = count.saturating_mul(item_bytes_min as u64);
        if needed > self.remaining() as u64 {
            return Err(DecodeError::Truncated {
                at: self.pos,
                needed: (needed - self.remaining() as u64).min(usize::MAX as u64) as usize,
            });
        }
        Ok(count as usize)
    }
    fn set(&mut self, what: &'static str) -> Result<BTreeSet<NodeId>, DecodeError> {
        let n = self.count(what, CONFIG_MEMBERS_MAX, 8)?;
        let mut set = BTreeSet::new();
        for _ in 0..n {
            let id = self.u64()?;
            if id == 0 {
                return Err(DecodeError::Invalid("node id 0 in a configuration"));
            }
            // Ascending, as the encoder writes a set: ids in another order
            // would decode to a configuration that encodes to other bytes
            // (one value, two encodings), which no writer wrote.
            match set.last() {
                Some(last) if *last == id => {
                    return Err(DecodeError::Invalid("duplicate node id in a configuration"))
                }
                Some(last) if *last > id => {
                    return Err(DecodeError::Invalid(
                        "node ids of a configuration out of order",
                    ))
                }
                _ => {}
            }
            set.insert(id);
        }
        Ok(set)
    }
    /// Reads a configuration.
    pub fn configuration(&mut self) -> Result<Configuration, DecodeError> {
        Ok(Configuration {
            voters: self.set("voters")?,
            voters_outgoing: self.set("outgoing voters")?,
            learners: self.set("learners")?,
        })
    }
    /// Reads a hard state.
    pub fn hard_state(&mut self) -> Result<HardState, DecodeError> {
        let term = self.u64()?;
        let at = self.pos;
        let vote = match self.u8()? {
            // The voter's place is zero without a vote: any other value
            // would decode to a hard state that encodes to other bytes.
            0 => {
                if self.u64()? != 0 {
                    return Err(DecodeError::Invalid(
                        "a hard state without a vote names a voter",
                    ));
                }
                None
            }
            1 => Some(self.u64()?),
            tag => {
                return Err(DecodeError::UnknownTag {
                    what: "vote",
                    tag,
                    at,
                })
            }
        };
        let commit = self.u64()?;
        Ok(HardState { term, vote, commit })
    }
    /// Reads a snapshot's metadata.
    pub fn snapshot_meta(&mut self) -> Result<SnapshotMeta, DecodeError> {
        Ok(SnapshotMeta {
            index: self.u64()?,
            term: self.u64()?,
            config: self.configuration()?,
        })
    }
    /// Reads one entry.
    pub fn entry(&mut self) -> Result<Entry, DecodeError> {
        let term = self.u64()?;
        let index = self.u64()?;
        let at = self.pos;
        let payload = match self.u8()? {
            0 => EntryPayload::Noop,
            1 => EntryPayload::Command(self.bytes("command", COMMAND_BYTES_MAX)?),
            2 => EntryPayload::Config(self.configuration()?),
            tag => {
                return Err(DecodeError::UnknownTag {
                    what: "entry payload",
                    tag,
                    at,
                })
            }
        };
        Ok(Entry {
            term,
            index,
            payload,
        })
    }
}

/// The fewest bytes one encoded entry takes (term, index, payload tag).
pub const ENTRY_BYTES_MIN: usize = 17;

/// One record of the write-ahead log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WalRecord {
    /// First record of every segment: identifies the file and the format.
    SegmentHeader {
        /// The segment's sequence number (also in its file name).
        segment: u64,
        /// The log format the segment is written in: [`WAL_FORMAT_VERSION`],
        /// or [`WAL_FORMAT_VERSION_OLDEST`] for a segment written before the
        /// log had a state file (see [`crate::log_state`]).
        version: u32,
        /// The length of the previous segment (`segment - 1`) when this one
        /// was started, if there was one: the previous segment is sealed at
        /// exactly this length, so recovery can tell a sealed segment cut
        /// at a record boundary from a whole one. Format 1 has no such field
        /// (encoding a format 1 header leaves it out).
        previous_len: Option<u64>,
    },
    /// The state of one group as of the start of a segment, so that older
    /// segments can be deleted without losing term, vote or log bounds.
    Checkpoint {
        /// The group.
        group: GroupId,
        /// Its hard state.
        hard_state: HardState,
        /// The last index behind the group's snapshot (the log starts after it).
        base_index: Index,
        /// The term at `base_index`.
        base_term: Term,
        /// The group's last log index at that moment.
        last_index: Index,
    },
    /// A persist request (or one part of a large one): an optional new hard
    /// state and entries replacing every stored entry from the first one on.
    Persist {
        /// The group.
        group: GroupId,
        /// The engine's sequence number for the request.
        seq: u64,
        /// The new hard state, if it changed.
        hard_state: Option<HardState>,
        /// Consecutive entries.
        entries: Vec<Entry>,
    },
    /// Entries through `through` are covered by a snapshot and dropped.
    Compact {
        /// The group.
        group: GroupId,
        /// The last dropped index.
        through: Index,
        /// The term at `through`.
        term: Term,
    },
    /// The group installed a snapshot: the whole log is replaced by it.
    ResetToSnapshot {
        /// The group.
        group: GroupId,
        /// The snapshot's index.
        index: Index,
        /// The snapshot's term.
        term: Term,
    },
    /// The group no longer lives on this node.
    RemoveGroup {
        /// The group.
        group: GroupId,
    },
}

/// The magic number in every segment header: "FERRYWAL".
pub const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"FERRYWAL");
/// The version of the log format this code writes. Format 2 added the
/// previous segment's length to the segment header and the log state file
/// beside the segments ([`crate::log_state`]).
pub const WAL_FORMAT_VERSION: u32 = 2;
/// The oldest log format this code reads: format 1, whose logs have no state
/// file (accepted as they are on open, and given one).
pub const WAL_FORMAT_VERSION_OLDEST: u32 = 1;

impl WalRecord {
    /// Appends the record's payload (unframed) to `enc`.
    pub fn encode(&self, enc: &mut Encoder) {
        match self {
            WalRecord::SegmentHeader {
                segment,
                version,
                previous_len,
            } => {
                enc.u8(1);
                enc.u64(SEGMENT_MAGIC);
                enc.u32(*version);
                enc.u64(*segment);
                if *version > WAL_FORMAT_VERSION_OLDEST {
                    match previous_len {
                        None => {
                            enc.u8(0);
                            enc.u64(0);
                        }
                        Some(len) => {
                            enc.u8(1);
                            enc.u64(*len);
                        }
                    }
                }
            }
            WalRecord::Checkpoint {
                group,
                hard_state,
                base_index,
                base_term,
                last_index,
            } => {
                enc.u8(2);
                enc.u64(*group);
                enc.hard_state(hard_state);
                enc.u64(*base_index);
                enc.u64(*base_term);
                enc.u64(*last_index);
            }
            WalRecord::Persist {
                group,
                seq,
                hard_state,
                entries,
            } => {
                enc.u8(3);
                enc.u64(*group);
                enc.u64(*seq);
                match hard_state {
                    None => enc.u8(0),
                    Some(hs) => {
                        enc.u8(1);
                        enc.hard_state(hs);
                    }
                }
                enc.u32(entries.len() as u32);
                for e in entries {
                    enc.entry(e);
                }
            }
            WalRecord::Compact {
                group,
                through,
                term,
            } => {
                enc.u8(4);
                enc.u64(*group);
                enc.u64(*through);
                enc.u64(*term);
            }
            WalRecord::ResetToSnapshot { group, index, term } => {
                enc.u8(5);
                enc.u64(*group);
                enc.u64(*index);
                enc.u64(*term);
            }
            WalRecord::RemoveGroup { group } => {
                enc.u8(6);
                enc.u64(*group);
            }
        }
    }

    /// Decodes one record payload (unframed), which must be consumed whole.
    pub fn decode(data: Bytes) -> Result<WalRecord, DecodeError> {
        let mut d = Decoder::new(data);
        let tag = d.u8()?;
        let record = match tag {
            1 => {
                if d.u64()? != SEGMENT_MAGIC {
                    return Err(DecodeError::Invalid(
                        "segment header without the FERRYWAL magic",
                    ));
                }
                let version = d.u32()?;
                let segment = d.u64()?;
                let previous_len = match version {
                    WAL_FORMAT_VERSION_OLDEST => None,
                    WAL_FORMAT_VERSION => {
                        let at = d.position();
                        match d.u8()? {
                            0 => {
                                if d.u64()? != 0 {
                                    return Err(DecodeError::Invalid(
                                        "a segment header without a previous segment gives its length",
                                    ));
                                }
                                None
                            }
                            1 => Some(d.u64()?),
                            tag => {
                                return Err(DecodeError::UnknownTag {
                                    what: "previous segment length flag",
                                    tag,
                                    at,
                                })
                            }
                        }
                    }
                    _ => return Err(DecodeError::Invalid("unsupported log format version")),
                };
                WalRecord::SegmentHeader {
                    segment,
                    version,
                    previous_len,
                }
            }
            2 => WalRecord::Checkpoint {
                group: d.u64()?,
                hard_state: d.hard_state()?,
                base_index: d.u64()?,
                base_term: d.u64()?,
                last_index: d.u64()?,
            },
            3 => {
                let group = d.u64()?;
                let seq = d.u64()?;
                let at = d.position();
                let hard_state = match d.u8()? {
                    0 => None,
                    1 => Some(d.hard_state()?),
                    tag => {
                        return Err(DecodeError::UnknownTag {
                            what: "hard state flag",
                            tag,
                            at,
                        })
                    }
                };
                let n = d.count("entry count", u32::MAX as u64, ENTRY_BYTES_MIN)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    let e = d.entry()?;
                    if let Some(prev) = entries.last() {
                        let prev: &Entry = prev;
                        if prev.index.checked_add(1) != Some(e.index) {
                            return Err(DecodeError::Invalid(
                                "entries in a record are not consecutive",
                            ));
                        }
                        if e.term < prev.term {
                            return Err(DecodeError::Invalid(
                                "entry terms decrease within a record",
                            ));
                        }
                    } else if e.index == 0 {
                        return Err(DecodeError::Invalid("entry with index 0"));
                    }
                    entries.push(e);
                }
                WalRecord::Persist {
                    group,
                    seq,
                    hard_state,
                    entries,
                }
            }
            4 => WalRecord::Compact {
                group: d.u64()?,
                through: d.u64()?,
                term: d.u64()?,
            },
            5 => WalRecord::ResetToSnapshot {
                group: d.u64()?,
                index: d.u64()?,
                term: d.u64()?,
            },
            6 => WalRecord::RemoveGroup { group: d.u64()? },
            tag => {
                return Err(DecodeError::UnknownTag {
                    what: "record",
                    tag,
                    at: 0,
                })
            }
        };
        d.finish()?;
        Ok(record)
    }
}

/// Appends `payload` to `out` framed with its length and crc32c.
pub fn frame(out: &mut Vec<u8>, payload: &[u8]) {
    debug_assert!(payload.len() as u64 <= RECORD_BYTES_MAX);
    let len = (payload.len() as u32).to_le_bytes();
    let crc = crc32c::crc32c_append(crc32c::crc32c(&len), payload);
    out.extend_from_slice(&len);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(payload);
}

/// Encodes and frames a record, appending it to `out`. Returns the framed size.
pub fn frame_record(out: &mut Vec<u8>, record: &WalRecord) -> usize {
    let start = out.len();
    // Reserve the header, encode the payload in place, then fill the header.
    out.extend_from_slice(&[0u8; FRAME_HEADER_BYTES]);
    let mut enc = Encoder::new(std::mem::take(out));
    record.encode(&mut enc);
    *out = enc.into_inner();
    let payload_len = out.len() - start - FRAME_HEADER_BYTES;
    debug_assert!(payload_len as u64 <= RECORD_BYTES_MAX);
    let len = (payload_len as u32).to_le_bytes();
    let crc = crc32c::crc32c_append(crc32c::crc32c(&len), &out[start + FRAME_HEADER_BYTES..]);
    out[start..start + 4].copy_from_slice(&len);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    out.len() - start
}

/// What reading one frame at an offset found.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameRead {
    /// A whole frame whose checksum matches: its payload range and total size.
    Valid {
        /// Payload start (absolute offset in the buffer).
        start: usize,
        /// Payload end (exclusive).
        end: usize,
    },
    /// The buffer ends inside the frame (a torn write, if at the tail).
    Incomplete,
    /// The length field exceeds [`RECORD_BYTES_MAX`]: no writer wrote this.
    BadLength(u64),
    /// The frame is whole but its checksum does not match.
    BadChecksum {
        /// Where the frame ends.
        end: usize,
    },
}

/// Reads the frame starting at `at` in `buf`.
pub fn read_frame(buf: &[u8], at: usize) -> FrameRead {
    let Some(header) = buf.get(at..at + FRAME_HEADER_BYTES) else {
        return FrameRead::Incomplete;
    };
    let len_bytes = [header[0], header[1], header[2], header[3]];
    let len = u32::from_le_bytes(len_bytes) as u64;
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if len > RECORD_BYTES_MAX {
        return FrameRead::BadLength(len);
    }
    let start = at + FRAME_HEADER_BYTES;
    let end = start + len as usize;
    let Some(payload) = buf.get(start..end) else {
        return FrameRead::Incomplete;
    };
    if crc32c::crc32c_append(crc32c::crc32c(&len_bytes), payload) != crc {
        return FrameRead::BadChecksum { end };
    }
    FrameRead::Valid { start, end }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config() -> impl Strategy<Value = Configuration> {
        (
            proptest::collection::btree_set(1u64..20, 0..5),
            proptest::collection::btree_set(1u64..20, 0..5),
            proptest::collection::btree_set(1u64..20, 0..3),
        )
            .prop_map(|(voters, voters_outgoing, learners)| Configuration {
                voters,
                voters_outgoing,
                learners,
            })
    }

    fn payload() -> impl Strategy<Value = EntryPayload> {
        prop_oneof![
            Just(EntryPayload::Noop),
            proptest::collection::vec(any::<u8>(), 0..64)
                .prop_map(|v| EntryPayload::Command(Bytes::from(v))),
            config().prop_map(EntryPayload::Config),
        ]
    }

    fn hard_state() -> impl Strategy<Value = HardState> {
        (any::<u64>(), proptest::option::of(1u64..100), any::<u64>())
            .prop_map(|(term, vote, commit)| HardState { term, vote, commit })
    }

    fn record() -> impl Strategy<Value = WalRecord> {
        prop_oneof![
            any::<u64>().prop_map(|segment| WalRecord::SegmentHeader {
                segment,
                version: WAL_FORMAT_VERSION_OLDEST,
                previous_len: None,
            }),
            (any::<u64>(), proptest::option::of(any::<u64>())).prop_map(
                |(segment, previous_len)| {
                    WalRecord::SegmentHeader {
                        segment,
                        version: WAL_FORMAT_VERSION,
                        previous_len,
                    }
                }
            ),
            (
                any::<u64>(),
                hard_state(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>()
            )
                .prop_map(|(group, hard_state, base_index, base_term, last_index)| {
                    WalRecord::Checkpoint {
                        group,
                        hard_state,
                        base_index,
                        base_term,
                        last_index,
                    }
                }),
            (
                any::<u64>(),
                any::<u64>(),
                proptest::option::of(hard_state()),
                1u64..1000,
                1u64..5,
                proptest::collection::vec(payload(), 0..6)
            )
                .prop_map(|(group, seq, hard_state, first, term, payloads)| {
                    WalRecord::Persist {
                        group,
                        seq,
                        hard_state,
                        entries: payloads
                            .into_iter()
                            .enumerate()
                            .map(|(i, payload)| Entry {
                                term,
                                index: first + i as u64,
                                payload,
                            })
                            .collect(),
                    }
                }),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(group, through, term)| {
                WalRecord::Compact {
                    group,
                    through,
                    term,
                }
            }),
            (any::<u64>(), any::<u64>(), any::<u64>())
                .prop_map(|(group, index, term)| WalRecord::ResetToSnapshot { group, index, term }),
            any::<u64>().prop_map(|group| WalRecord::RemoveGroup { group }),
        ]
    }

    proptest! {
        #[test]
        fn records_round_trip(r in record()) {
            let mut enc = Encoder::default();
            r.encode(&mut enc);
            prop_assert_eq!(WalRecord::decode(Bytes::from(enc.into_inner())).unwrap(), r);
        }

        #[test]
        fn framed_records_round_trip(r in record()) {
            let mut buf = vec![7u8; 3];
            let n = frame_record(&mut buf, &r);
            prop_assert_eq!(n, buf.len() - 3);
            match read_frame(&buf, 3) {
                FrameRead::Valid { start, end } => {
                    prop_assert_eq!(end, buf.len());
                    prop_assert_eq!(WalRecord::decode(Bytes::copy_from_slice(&buf[start..end])).unwrap(), r);
                }
                other => prop_assert!(false, "unexpected {:?}", other),
            }
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = WalRecord::decode(Bytes::from(data.clone()));
            let _ = read_frame(&data, 0);
            let mut d = Decoder::new(Bytes::from(data.clone()));
            let _ = d.entry();
            let mut d = Decoder::new(Bytes::from(data.clone()));
            let _ = d.snapshot_meta();
            let mut d = Decoder::new(Bytes::from(data));
            let _ = d.hard_state();
        }

        #[test]
        fn decoding_mutated_records_never_panics(r in record(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4)) {
            let mut enc = Encoder::default();
            r.encode(&mut enc);
            let mut bytes = enc.into_inner();
            for (pos, x) in flips {
                let i = pos % bytes.len();
                bytes[i] ^= x;
            }
            let _ = WalRecord::decode(Bytes::from(bytes));
        }

        #[test]
        fn a_flipped_bit_in_a_frame_is_detected(r in record(), pos in any::<usize>(), bit in 0u8..8) {
            let mut buf = Vec::new();
            frame_record(&mut buf, &r);
            let i = pos % buf.len();
            buf[i] ^= 1 << bit;
            let whole_frame_valid = matches!(read_frame(&buf, 0), FrameRead::Valid { end, .. } if end == buf.len());
            prop_assert!(!whole_frame_valid);
        }
    }

    /// Found by fuzzing (`crates/fuzz`, peer_message and wal_record): a
    /// configuration whose ids were not in ascending order decoded to a
    /// set that encodes to other bytes, so two byte strings (one of which
    /// no writer wrote) read as one configuration.
    #[test]
    fn a_configuration_listed_out_of_order_is_refused() {
        let set = |ids: &[u64]| {
            let mut enc = Encoder::default();
            enc.u32(ids.len() as u32);
            for id in ids {
                enc.u64(*id);
            }
            enc.u32(0);
            enc.u32(0);
            Bytes::from(enc.into_inner())
        };
        assert_eq!(
            Decoder::new(set(&[3, 1])).configuration(),
            Err(DecodeError::Invalid(
                "node ids of a configuration out of order"
            ))
        );
        assert_eq!(
            Decoder::new(set(&[2, 2])).configuration(),
            Err(DecodeError::Invalid("duplicate node id in a configuration"))
        );
        let mut ordered = Decoder::new(set(&[1, 3, 1 << 40]));
        assert_eq!(
            ordered.configuration().unwrap().voters,
            [1, 3, 1 << 40].into()
        );
    }

    /// Found by fuzzing (`crates/fuzz`, wal_record): the voter of a hard
    /// state without a vote, and the previous length of a segment header
    /// without a previous segment, were read and thrown away, so any value
    /// there decoded to the record that encodes with zero. No writer
    /// writes anything but zero there.
    #[test]
    fn fields_of_an_absent_value_that_are_not_zero_are_refused() {
        let mut hard_state = Encoder::default();
        hard_state.u64(3);
        hard_state.u8(0);
        hard_state.u64(2);
        hard_state.u64(1);
        assert_eq!(
            Decoder::new(Bytes::from(hard_state.into_inner())).hard_state(),
            Err(DecodeError::Invalid(
                "a hard state without a vote names a voter"
            ))
        );
        let header = WalRecord::SegmentHeader {
            segment: 4,
            version: WAL_FORMAT_VERSION,
            previous_len: None,
        };
        let mut enc = Encoder::default();
        header.encode(&mut enc);
        let mut bytes = enc.into_inner();
        let last = bytes.len() - 1;
        bytes[last] = 0x10;
        assert!(matches!(
            WalRecord::decode(Bytes::from(bytes)),
            Err(DecodeError::Invalid(_))
        ));
    }

    #[test]
    fn huge_counts_are_refused_without_allocating() {
        let mut enc = Encoder::default();
        enc.u8(3);
        enc.u64(1);
        enc.u64(1);
        enc.u8(0);
        enc.u32(u32::MAX);
        let err = WalRecord::decode(Bytes::from(enc.into_inner())).unwrap_err();
        assert!(matches!(err, DecodeError::Truncated { .. }), "{err:?}");
    }

    /// The log finds its end in reserved space by content (see "Reserved
    /// space" in [`crate::wal`]): zeros must never frame a record, at any
    /// length the buffer allows.
    #[test]
    fn zeros_never_frame_a_record() {
        let zeros = [0u8; 64];
        for at in 0..zeros.len() {
            assert!(
                !matches!(read_frame(&zeros, at), FrameRead::Valid { .. }),
                "zeros framed a record at {at}"
            );
        }
    }
}
