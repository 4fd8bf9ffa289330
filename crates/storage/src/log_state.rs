//! What the log knows it has synced, kept beside the segments so that
//! recovery can tell "the log lost data it had synced" from "the last write
//! was torn" (see the crate documentation, "Knowing what was synced").
//!
//! Two small files live in the log directory next to the segments:
//!
//! - The **state file** ([`LOG_STATE_FILE`]): which segment the log writes
//!   next, the exact length of the newest sealed segment, and each group's
//!   term and vote, all durable when written. It is replaced atomically
//!   (written to a temporary file, synced, renamed over, the directory
//!   synced) on open, before the new segment is created, and after a
//!   segment is sealed (rotation), by the first sync of the next segment,
//!   on the thread that runs the sync: once per segment, never per batch.
//! - The **sync progress file** ([`SYNC_PROGRESS_FILE`]): after each
//!   completed sync, a claim "segment S is synced through byte L" is
//!   appended to it, *without* a sync of its own: one small write per batch,
//!   no extra fdatasync. A claim is only ever written after the sync it
//!   describes, so whatever part of the file survives a crash claims no more
//!   than what was durable. After a process restart (the page cache
//!   survives) it vouches for the last synced batch exactly; after a power
//!   loss it may have lost its latest claims and vouches for less. The
//!   first claim about a new segment (after an open or a rotation) is
//!   synced, in the sync that makes the segment's name durable, so that the
//!   current segment's existence and its checkpoints are always vouched for
//!   durably: one extra fdatasync per segment, not per batch. So is the
//!   first claim after the file is started afresh (on open, and once it
//!   reaches [`PROGRESS_BYTES_MAX`]).
//!
//! # What recovery checks
//!
//! Before it changes anything on disk, [`crate::Wal::open`] refuses with
//! [`StorageError::LostSyncedData`] unless:
//!
//! - each segment is exactly as long as its successor's header says it was
//!   sealed (longer is [`StorageError::Corrupt`]);
//! - the highest claim about a segment at or after the state file's next
//!   segment is met: that segment exists and holds at least that many bytes
//!   of valid records (claims about older segments are superseded by the
//!   state file: those are sealed, and may have been deleted since);
//! - the state file's sealed segment holds at least its sealed length, or
//!   is gone while a newer segment holds records (a segment is deleted only
//!   once a newer one with a checkpoint of every group is synced);
//! - each group's term and vote are no older than the state file records
//!   (a group removed since is skipped: if it comes back, its term may
//!   start over);
//! - without a state file: no segment is in format 2 or later (those always
//!   have one, written before their first segment), and snapshots exist only
//!   beside a segment that holds records.
//!
//! # Formats
//!
//! Both files hold records framed like the log's (`[length u32][crc32c
//! u32][payload]`, see [`crate::codec`]). The state file is exactly one
//! record:
//!
//! ```text
//! magic "FERRYLST" u64 | version u32 | next segment u64 |
//! sealed flag u8 | sealed segment u64 | sealed length u64 |
//! group count u32 | (group u64 | term u64 | vote flag u8 | vote u64)*
//! ```
//!
//! The progress file is a sequence of records
//! `magic "FSYN" u32 | segment u64 | synced length u64`; reading stops at the
//! first record that is cut short or fails its checksum (a torn append), and
//! the highest claim before it counts.

use std::collections::BTreeMap;
use std::path::Path;

use bytes::Bytes;
use ferry_raft::{GroupId, NodeId, Term};

use crate::codec::{frame, read_frame, Decoder, Encoder, FrameRead};
use crate::disk::{Disk, DiskFile};
use crate::error::{Result, StorageError};

/// The name of the state file in the log directory.
pub const LOG_STATE_FILE: &str = "log.state";
/// The temporary name the state file is written under before the rename.
pub const LOG_STATE_TEMP_FILE: &str = "log.state.tmp";
/// The name of the sync progress file in the log directory.
pub const SYNC_PROGRESS_FILE: &str = "log.progress";
/// The version of the state file's format.
pub const LOG_STATE_FORMAT_VERSION: u32 = 1;
/// The progress file is started afresh once it holds this many bytes (about
/// 2,300 claims), so that it stays small however many batches a segment
/// takes.
pub const PROGRESS_BYTES_MAX: u64 = 64 * 1024;

/// The most of the progress file recovery reads.
const PROGRESS_READ_BYTES_MAX: u64 = 4 * PROGRESS_BYTES_MAX;
const LOG_STATE_MAGIC: u64 = u64::from_le_bytes(*b"FERRYLST");
const PROGRESS_MAGIC: u32 = u32::from_le_bytes(*b"FSYN");
/// The fewest bytes one group takes in the state file.
const VOTE_BYTES_MIN: usize = 25;

/// A term and the vote cast in it: the part of a group's hard state that
/// must never be forgotten (a node that forgets it can vote twice in a term).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Vote {
    /// The group's current term.
    pub term: Term,
    /// The node voted for in that term, if any.
    pub vote: Option<NodeId>,
}

impl Vote {
    /// Whether `later` can follow `self` in one group's history: a higher
    /// term, or the same term with the same vote (or a first one).
    pub fn is_covered_by(&self, later: &Vote) -> bool {
        later.term > self.term
            || (later.term == self.term && (self.vote.is_none() || later.vote == self.vote))
    }
}

/// A segment that is sealed (synced whole, never written again) at `len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SealedSegment {
    /// Its sequence number.
    pub segment: u64,
    /// Its exact length in bytes.
    pub len: u64,
}

/// The content of the state file: what the log had durably at the moment it
/// was written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogState {
    /// The segment the log writes after this state was recorded. Every
    /// segment before it is sealed.
    pub next_segment: u64,
    /// The newest sealed segment (`next_segment - 1`), if there is one.
    /// It may later be deleted, but only once a newer segment holds a
    /// checkpoint of every group.
    pub sealed: Option<SealedSegment>,
    /// Each group's term and vote (groups that never had a term are left
    /// out: there is nothing of theirs to lose).
    pub votes: BTreeMap<GroupId, Vote>,
}

impl LogState {
    /// The file's content: one framed record.
    pub fn encode(&self) -> Vec<u8> {
        let mut enc = Encoder::default();
        enc.u64(LOG_STATE_MAGIC);
        enc.u32(LOG_STATE_FORMAT_VERSION);
        enc.u64(self.next_segment);
        match self.sealed {
            None => {
                enc.u8(0);
                enc.u64(0);
                enc.u64(0);
            }
            Some(s) => {
                enc.u8(1);
                enc.u64(s.segment);
                enc.u64(s.len);
            }
        }
        // Counts above u32 cannot occur: a node holds far fewer groups.
        enc.u32(self.votes.len() as u32);
        for (group, v) in &self.votes {
            enc.u64(*group);
            enc.u64(v.term);
            match v.vote {
                None => {
                    enc.u8(0);
                    enc.u64(0);
                }
                Some(id) => {
                    enc.u8(1);
                    enc.u64(id);
                }
            }
        }
        let payload = enc.into_inner();
        let mut out = Vec::with_capacity(payload.len() + 8);
        frame(&mut out, &payload);
        out
    }

    /// Decodes a whole state file. Errors say what is wrong and where.
    pub fn decode(buf: &[u8]) -> std::result::Result<LogState, (u64, String)> {
        let (start, end) = match read_frame(buf, 0) {
            FrameRead::Valid { start, end } => (start, end),
            other => return Err((0, format!("the record fails verification: {other:?}"))),
        };
        if end != buf.len() {
            return Err((
                end as u64,
                format!("{} bytes follow the record", buf.len() - end),
            ));
        }
        let mut d = Decoder::new(Bytes::copy_from_slice(&buf[start..end]));
        let at = |d: &Decoder| (start + d.position()) as u64;
        let err = |d: &Decoder, e: crate::error::DecodeError| (at(d), e.to_string());
        let magic = d.u64().map_err(|e| err(&d, e))?;
        if magic != LOG_STATE_MAGIC {
            return Err((start as u64, "no FERRYLST magic".into()));
        }
        let version = d.u32().map_err(|e| err(&d, e))?;
        if version != LOG_STATE_FORMAT_VERSION {
            return Err((at(&d), format!("unsupported state file version {version}")));
        }
        let next_segment = d.u64().map_err(|e| err(&d, e))?;
        let flag = d.u8().map_err(|e| err(&d, e))?;
        let segment = d.u64().map_err(|e| err(&d, e))?;
        let len = d.u64().map_err(|e| err(&d, e))?;
        let sealed = match flag {
            // Zeros without a sealed segment, as written: other values would
            // decode to a state that encodes to other bytes.
            0 if segment == 0 && len == 0 => None,
            0 => return Err((at(&d), "a sealed segment's fields without one".into())),
            1 => Some(SealedSegment { segment, len }),
            tag => return Err((at(&d), format!("unknown sealed-segment flag {tag}"))),
        };
        let n = d
            .count("group count", u32::MAX as u64, VOTE_BYTES_MIN)
            .map_err(|e| err(&d, e))?;
        let mut votes = BTreeMap::new();
        for _ in 0..n {
            let group = d.u64().map_err(|e| err(&d, e))?;
            let term = d.u64().map_err(|e| err(&d, e))?;
            let flag = d.u8().map_err(|e| err(&d, e))?;
            let id = d.u64().map_err(|e| err(&d, e))?;
            let vote = match flag {
                0 if id == 0 => None,
                0 => {
                    return Err((
                        at(&d),
                        format!("group {group} has no vote but names a voter"),
                    ))
                }
                1 => Some(id),
                tag => return Err((at(&d), format!("unknown vote flag {tag}"))),
            };
            // In ascending order, as written (one state, one encoding).
            match votes.last_key_value() {
                Some((last, _)) if *last == group => {
                    return Err((at(&d), format!("group {group} is listed twice")))
                }
                Some((last, _)) if *last > group => {
                    return Err((at(&d), format!("group {group} is listed out of order")))
                }
                _ => {}
            }
            votes.insert(group, Vote { term, vote });
        }
        d.finish().map_err(|e| err(&d, e))?;
        Ok(LogState {
            next_segment,
            sealed,
            votes,
        })
    }
}

/// One claim of the progress file: `segment` is synced through byte `len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SyncClaim {
    /// The segment.
    pub segment: u64,
    /// How many of its bytes are synced.
    pub len: u64,
}

impl SyncClaim {
    /// The claim as one framed record.
    pub fn encode(&self) -> Vec<u8> {
        let mut enc = Encoder::new(Vec::with_capacity(20));
        enc.u32(PROGRESS_MAGIC);
        enc.u64(self.segment);
        enc.u64(self.len);
        let payload = enc.into_inner();
        let mut out = Vec::with_capacity(payload.len() + 8);
        frame(&mut out, &payload);
        out
    }

    /// The highest claim among the valid records at the start of `buf`.
    pub fn highest_in(buf: &[u8]) -> Option<SyncClaim> {
        let mut at = 0;
        let mut best: Option<SyncClaim> = None;
        while let FrameRead::Valid { start, end } = read_frame(buf, at) {
            let Some(claim) = SyncClaim::decode(&buf[start..end]) else {
                break;
            };
            best = Some(best.map_or(claim, |b| b.max(claim)));
            at = end;
        }
        best
    }

    fn decode(payload: &[u8]) -> Option<SyncClaim> {
        let mut d = Decoder::new(Bytes::copy_from_slice(payload));
        if d.u32().ok()? != PROGRESS_MAGIC {
            return None;
        }
        let claim = SyncClaim {
            segment: d.u64().ok()?,
            len: d.u64().ok()?,
        };
        d.finish().ok()?;
        Some(claim)
    }
}

/// Reads the state file, if the log has one (`names` lists the directory).
/// A state file that fails verification is [`StorageError::Corrupt`]: it
/// is only ever renamed into place whole and synced, so no crash explains it.
pub(crate) fn read_state<D: Disk>(
    disk: &D,
    dir: &Path,
    names: &[String],
) -> Result<Option<LogState>> {
    if !names.iter().any(|n| n == LOG_STATE_FILE) {
        return Ok(None);
    }
    let path = dir.join(LOG_STATE_FILE);
    let buf = disk
        .read_all(&path)
        .map_err(|e| StorageError::io("read log state", &path, e))?;
    LogState::decode(&buf)
        .map(Some)
        .map_err(|(offset, reason)| StorageError::corrupt(&path, offset, reason))
}

/// Replaces the state file atomically and durably: a crash at any point
/// leaves either the old file or the new one, whole. (An I/O error, since it
/// runs inside [`crate::PendingSync::execute`] too.)
pub(crate) fn write_state<D: Disk>(disk: &D, dir: &Path, state: &LogState) -> std::io::Result<()> {
    let tmp = dir.join(LOG_STATE_TEMP_FILE);
    let file = disk.create(&tmp)?;
    file.append(&state.encode())?;
    file.sync_data()?;
    disk.rename(&tmp, &dir.join(LOG_STATE_FILE))?;
    disk.sync_dir(dir)
}

/// The highest claim in the progress file, if there is one. Damage in the
/// file only loses claims (the file is a lower bound), so it is no error.
pub(crate) fn read_progress<D: Disk>(
    disk: &D,
    dir: &Path,
    names: &[String],
) -> Result<Option<SyncClaim>> {
    if !names.iter().any(|n| n == SYNC_PROGRESS_FILE) {
        return Ok(None);
    }
    let path = dir.join(SYNC_PROGRESS_FILE);
    let len = disk
        .file_len(&path)
        .map_err(|e| StorageError::io("read sync progress", &path, e))?;
    // The log never lets the file grow much past PROGRESS_BYTES_MAX; of a
    // larger one (not ours), a prefix is as good a lower bound as any.
    let mut buf = vec![0u8; len.min(PROGRESS_READ_BYTES_MAX) as usize];
    disk.read_exact_at(&path, 0, &mut buf)
        .map_err(|e| StorageError::io("read sync progress", &path, e))?;
    Ok(SyncClaim::highest_in(&buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_and_damage_is_refused() {
        let state = LogState {
            next_segment: 7,
            sealed: Some(SealedSegment {
                segment: 6,
                len: 4096,
            }),
            votes: BTreeMap::from([
                (
                    1,
                    Vote {
                        term: 3,
                        vote: Some(2),
                    },
                ),
                (
                    9,
                    Vote {
                        term: 1,
                        vote: None,
                    },
                ),
            ]),
        };
        let buf = state.encode();
        assert_eq!(LogState::decode(&buf).unwrap(), state);
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            assert!(LogState::decode(&bad).is_err(), "byte {i}");
        }
        assert!(LogState::decode(&buf[..buf.len() - 1]).is_err());
        assert!(LogState::decode(&[]).is_err());
        let mut longer = buf.clone();
        longer.push(0);
        assert!(LogState::decode(&longer).is_err());
        let empty = LogState::default();
        assert_eq!(LogState::decode(&empty.encode()).unwrap(), empty);
    }

    /// Found by fuzzing (`crates/fuzz`, log_state): the fields of an
    /// absent sealed segment or vote were not checked to be zero, and the
    /// groups not checked to be in order, so bytes no writer writes decoded
    /// to a state that encodes to other bytes.
    #[test]
    fn a_state_with_stray_fields_or_groups_out_of_order_is_refused() {
        let state = |sealed: (u8, u64, u64), votes: &[(u64, u8, u64)]| {
            let mut enc = Encoder::default();
            enc.u64(LOG_STATE_MAGIC);
            enc.u32(LOG_STATE_FORMAT_VERSION);
            enc.u64(7);
            enc.u8(sealed.0);
            enc.u64(sealed.1);
            enc.u64(sealed.2);
            enc.u32(votes.len() as u32);
            for (group, flag, id) in votes {
                enc.u64(*group);
                enc.u64(1);
                enc.u8(*flag);
                enc.u64(*id);
            }
            let mut out = Vec::new();
            frame(&mut out, &enc.into_inner());
            out
        };
        assert!(LogState::decode(&state((0, 0, 0), &[(1, 0, 0), (2, 1, 3)])).is_ok());
        for (what, bytes) in [
            ("no sealed segment, but its number", state((0, 6, 0), &[])),
            (
                "no sealed segment, but its length",
                state((0, 0, 4096), &[]),
            ),
            ("no vote, but a voter", state((0, 0, 0), &[(1, 0, 2)])),
            (
                "groups out of order",
                state((0, 0, 0), &[(2, 0, 0), (1, 0, 0)]),
            ),
            ("a group twice", state((0, 0, 0), &[(2, 0, 0), (2, 0, 0)])),
        ] {
            assert!(LogState::decode(&bytes).is_err(), "{what}: decoded");
        }
    }

    #[test]
    fn the_highest_claim_before_damage_counts() {
        let mut buf = Vec::new();
        for (segment, len) in [(3, 100), (3, 250), (4, 80), (4, 120)] {
            buf.extend(SyncClaim { segment, len }.encode());
        }
        let whole = SyncClaim::highest_in(&buf);
        assert_eq!(
            whole,
            Some(SyncClaim {
                segment: 4,
                len: 120
            })
        );
        // A torn last append.
        assert_eq!(
            SyncClaim::highest_in(&buf[..buf.len() - 3]),
            Some(SyncClaim {
                segment: 4,
                len: 80
            })
        );
        // Damage in the second record hides everything after it.
        let one = SyncClaim { segment: 0, len: 0 }.encode().len();
        let mut bad = buf.clone();
        bad[one + 10] ^= 1;
        assert_eq!(
            SyncClaim::highest_in(&bad),
            Some(SyncClaim {
                segment: 3,
                len: 100
            })
        );
        assert_eq!(SyncClaim::highest_in(&[]), None);
        assert_eq!(SyncClaim::highest_in(&[0u8; 64]), None);
    }

    #[test]
    fn votes_only_move_forward() {
        let v = |term, vote| Vote { term, vote };
        assert!(v(3, Some(2)).is_covered_by(&v(3, Some(2))));
        assert!(v(3, None).is_covered_by(&v(3, Some(2))));
        assert!(v(3, Some(2)).is_covered_by(&v(4, None)));
        assert!(!v(3, Some(2)).is_covered_by(&v(3, None)));
        assert!(!v(3, Some(2)).is_covered_by(&v(3, Some(1))));
        assert!(!v(3, None).is_covered_by(&v(2, Some(1))));
    }
}
