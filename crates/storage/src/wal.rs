//! The write-ahead log: one per node, shared by every Raft group on it.
//!
//! # Layout
//!
//! The log is a directory of segment files `<seq>.seg` (20-digit, zero
//! padded), beside a state file and a sync progress file that say what the
//! log had synced (see [`crate::log_state`]). Every segment starts with a
//! header record (its number, the format version, and the length the
//! previous segment is sealed at) and one checkpoint record per group (its
//! hard state, the index its log starts after, and its last index at that
//! moment). After that come the records of every group, interleaved in the
//! order they were written. Each record is framed with its length and a
//! crc32c (see [`crate::codec`]).
//!
//! # Old segments
//!
//! A segment is deleted once no group has a live entry in it (or in any
//! older segment): every group's entries in it are behind a snapshot or have
//! been replaced. Because each newer segment opens with a checkpoint of every
//! group, nothing else in the old segment is needed. We chose this over
//! moving live entries to per-group files (as Ra does) because it keeps a
//! single sequential write stream and a single sync per batch, and never
//! rewrites data: the cost is disk space when one group is slow to take
//! snapshots, since its oldest live entry pins every segment after it. The
//! engine asks for compaction (`Action::Compact`) after each snapshot, so the
//! pinned span is about one snapshot interval of the slowest group; a group
//! removed from the node releases its segments at once.
//!
//! # Group commit and threading
//!
//! The log itself starts no thread and takes `&mut self`: appends go to an
//! in-memory buffer (flushed to the file when it fills), and a sync is split
//! in three steps so that the caller decides where the slow part runs:
//!
//! 1. [`Wal::prepare_sync`] writes the buffer to the file and returns a
//!    [`PendingSync`] covering every record written so far, by every group;
//! 2. [`PendingSync::execute`] does the fdatasync (and the directory sync
//!    when a segment was created). It needs no access to the log, so the
//!    server runs it on a blocking thread while the log keeps taking appends:
//!    the next batch fills while the sync is in flight;
//! 3. [`Wal::complete_sync`] takes the outcome and returns, per group, the
//!    highest persist sequence number now durable (`Input::Persisted`).
//!
//! One sync is in flight at a time. (When a segment fills, the log syncs it
//! inline before starting the next one: once per segment, see Recovery.)
//! The simulator runs the three steps on its
//! single thread and delivers the completion after the disk's simulated
//! latency; [`Wal::sync`] runs all three at once. We chose this over an
//! internal writer thread so that the simulator stays single-threaded and
//! deterministic, and so that the server owns all of its threads.
//!
//! After a failed write or sync the log refuses all further work
//! ([`StorageError::Poisoned`]): after a failed fdatasync the kernel may have
//! dropped the dirty pages, and retrying could report data as durable that is
//! not. A new segment that cannot be created for lack of file descriptors,
//! space or quota is different: nothing was written, so the log writes on in
//! the current segment and tries again later ([`Wal::rotation_deferred`]).
//!
//! # Reserved space
//!
//! A sync that makes a file longer costs the filesystem more than one that
//! overwrites blocks the file already has: with the data it must record
//! the new length and the blocks it allocated (on ext4, on a virtual disk,
//! a 4 KiB write + fdatasync took about 100 µs appended and 55 µs
//! overwritten). So the log keeps its current segment
//! [`WalOptions::reserve_bytes`] of zeros ahead of its records: when a
//! flush would pass the reserved end, it first writes the next chunk of
//! zeros ([`DiskFile::reserve`]), and the sync after it is the only one of
//! that chunk to pay for a longer file. A segment is cut back to its last
//! record when it is sealed, so only the current (last) segment ever ends
//! in zeros, and recovery reads zeros after its valid records as space not
//! yet used: not a torn write, and not counted in
//! [`WalRecovery::truncated_bytes`]. A torn record written into reserved
//! space is a torn tail like any other (the zeros after it are not
//! counted). The records' framing makes zeros invalid, so the end of the
//! log is found by content: a zero length and checksum never frame a
//! record.
//!
//! We chose zeros written ahead over `fallocate`: space allocated but
//! never written is "unwritten" to ext4, and the first write into it
//! still records a change of extent state at the sync. And over recycling
//! old segments (which would save writing the zeros): a recycled file
//! holds valid-looking records of an older segment past the end, so every
//! record would have to carry its segment's number in its checksum, a
//! format change; the zeros cost one sequential write per chunk.
//!
//! # Recovery
//!
//! A segment is synced before the next one is created (on rotation, and on
//! open for the last segment found), so only the last segment can have a
//! torn tail. [`Wal::open`] replays every segment. Damage at the end of the
//! last segment (a record cut short or failing its checksum, with no valid
//! record after it) is a torn write: it is cut off (durably) and reported in
//! [`WalRecovery::truncated_bytes`]. Any other damage is
//! [`StorageError::Corrupt`] naming the file and offset.
//!
//! Before it changes anything on disk, recovery also checks that the log
//! does not end before what it is known to have synced: each segment as long
//! as its successor's header says it was sealed, the newest sealed segment
//! and every group's term and vote as the state file records them, and the
//! current segment at least as long as the highest claim of the progress
//! file. A log that falls short is [`StorageError::LostSyncedData`], not a
//! torn tail. The way back from either (the node leaves its groups, is wiped
//! and rejoins as a new member that receives a snapshot and the log) is
//! described in the crate documentation.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use ferry_raft::{Entry, EntryPayload, GroupId, HardState, Index, PersistRequest, Term};

use crate::cache::EntryCache;
use crate::codec::{
    self, frame_record, read_frame, FrameRead, WalRecord, FRAME_HEADER_BYTES, WAL_FORMAT_VERSION,
    WAL_FORMAT_VERSION_OLDEST,
};
use crate::disk::{Disk, DiskFile};
use crate::error::{Result, StorageError};
use crate::log_state::{
    self, LogState, SealedSegment, SyncClaim, Vote, LOG_STATE_FILE, PROGRESS_BYTES_MAX,
    SYNC_PROGRESS_FILE,
};

/// Tunables of the log.
#[derive(Clone, Debug)]
pub struct WalOptions {
    /// A new segment is started before a record that would begin past this size.
    pub segment_size_bytes_max: u64,
    /// Appended records are buffered in memory up to this size before being
    /// written to the file (a sync always writes the buffer first).
    pub write_buffer_bytes_max: usize,
    /// The most entries the cache keeps per group.
    pub cache_entries_max_per_group: usize,
    /// The most bytes the cache keeps per group (the node-wide bound is this
    /// times the number of groups).
    pub cache_size_bytes_max_per_group: u64,
    /// Persist requests are split into records of about this many bytes.
    pub record_size_bytes_target: u64,
    /// The current segment is kept this many bytes of zeros ahead of its
    /// records (up to the segment size), written a chunk at a time, so that
    /// most syncs overwrite space the file already has (see "Reserved
    /// space" in the module documentation). 0 appends without reserving.
    pub reserve_bytes: u64,
}

impl Default for WalOptions {
    fn default() -> Self {
        WalOptions {
            segment_size_bytes_max: 64 * 1024 * 1024,
            write_buffer_bytes_max: 1024 * 1024,
            cache_entries_max_per_group: 1024,
            cache_size_bytes_max_per_group: 1024 * 1024,
            record_size_bytes_target: 4 * 1024 * 1024,
            reserve_bytes: 1024 * 1024,
        }
    }
}

/// Where a record starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Location {
    segment: u64,
    offset: u64,
}

/// What the log knows about one group.
#[derive(Debug)]
struct Group {
    hard_state: HardState,
    /// The log starts after this index (compacted through, or snapshot).
    base_index: Index,
    base_term: Term,
    /// Terms of the live entries `base_index + 1 ..`.
    terms: VecDeque<Term>,
    /// The record holding each live entry.
    locations: VecDeque<Location>,
    cache: EntryCache,
}

impl Group {
    fn new(options: &WalOptions) -> Self {
        Group {
            hard_state: HardState::default(),
            base_index: 0,
            base_term: 0,
            terms: VecDeque::new(),
            locations: VecDeque::new(),
            cache: EntryCache::new(
                options.cache_entries_max_per_group,
                options.cache_size_bytes_max_per_group,
            ),
        }
    }

    fn last_index(&self) -> Index {
        self.base_index + self.terms.len() as u64
    }

    fn term(&self, index: Index) -> Option<Term> {
        if index == self.base_index {
            return Some(self.base_term);
        }
        if index < self.base_index {
            return None;
        }
        self.terms
            .get((index - self.base_index - 1) as usize)
            .copied()
    }

    fn apply_entries(&mut self, entries: &[Entry], at: Location) {
        let Some(first) = entries.first() else {
            return;
        };
        debug_assert!(first.index > self.base_index && first.index <= self.last_index() + 1);
        let keep = (first.index - self.base_index - 1) as usize;
        self.terms.truncate(keep);
        self.locations.truncate(keep);
        for e in entries {
            self.terms.push_back(e.term);
            self.locations.push_back(at);
        }
        self.cache.append(entries);
    }

    fn compact(&mut self, through: Index, term: Term) {
        debug_assert!(through > self.base_index && through <= self.last_index());
        let n = (through - self.base_index) as usize;
        self.terms.drain(..n);
        self.locations.drain(..n);
        self.base_index = through;
        self.base_term = term;
        self.cache.drop_through(through);
    }

    fn reset(&mut self, index: Index, term: Term) {
        self.terms.clear();
        self.locations.clear();
        self.cache.clear();
        self.base_index = index;
        self.base_term = term;
    }
}

/// The segment being appended to.
#[derive(Debug)]
struct Current<F> {
    seq: u64,
    path: PathBuf,
    file: Arc<F>,
    /// Bytes already handed to the file.
    flushed_len: u64,
    /// Records not yet handed to the file.
    buffer: Vec<u8>,
    /// Whether anything was written since the last prepared sync.
    dirty: bool,
    /// The file's length with its reserved zeros (at least `flushed_len`
    /// once anything is reserved).
    reserved_len: u64,
}

impl<F> Current<F> {
    fn len(&self) -> u64 {
        self.flushed_len + self.buffer.len() as u64
    }
}

/// One group's state as found by recovery.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveredLog {
    /// The latest hard state written.
    pub hard_state: HardState,
    /// The log starts after this index (its snapshot or compaction point).
    pub base_index: Index,
    /// The term at `base_index`.
    pub base_term: Term,
    /// The entries after `base_index`, consecutive.
    pub entries: Vec<Entry>,
}

/// What [`Wal::open`] found.
#[derive(Clone, Debug, Default)]
pub struct WalRecovery {
    /// Every group with state in the log.
    pub groups: BTreeMap<GroupId, RecoveredLog>,
    /// Bytes cut from the end of the log (a torn write). Nonzero means the
    /// node crashed while writing; only unsynced data can have been cut,
    /// unless the disk also damaged the very last record.
    pub truncated_bytes: u64,
    /// The file that was cut, if any.
    pub truncated_file: Option<PathBuf>,
    /// Segments replayed.
    pub segments_replayed: usize,
    /// Bytes replayed.
    pub bytes_replayed: u64,
    /// Segments deleted because they were left over from an interrupted
    /// deletion of old segments.
    pub stale_segments_removed: usize,
    /// Groups whose last record in the log is their removal. Their snapshot
    /// files, if any survived, must be deleted (as [`crate::Storage::open`] does).
    pub removed_groups: BTreeSet<GroupId>,
    /// The log was written by an older version (format 1) and had no state
    /// file to vouch for what it had synced: it was accepted as it is, and
    /// has one from now on (see [`crate::log_state`]).
    pub upgraded_from_format_1: bool,
}

/// A sync covering everything written before it was prepared. Run
/// [`PendingSync::execute`] anywhere, then hand the outcome to
/// [`Wal::complete_sync`].
#[derive(Debug)]
pub struct PendingSync<D: Disk> {
    disk: D,
    files: Vec<Arc<D::File>>,
    dir: Option<PathBuf>,
    seqs: BTreeMap<GroupId, u64>,
    delete_below: u64,
    /// The state file to write (in this directory), after a rotation.
    state: Option<(PathBuf, LogState)>,
    progress: ProgressClaim<D::File>,
}

/// The claim a sync appends to the progress file once it has completed.
#[derive(Debug)]
struct ProgressClaim<F> {
    file: Arc<F>,
    /// The framed [`SyncClaim`].
    record: Vec<u8>,
    /// Whether to sync the claim too: the first claim after the file was
    /// (re)created, in the sync that makes the new names durable.
    durable: bool,
}

impl<D: Disk> PendingSync<D> {
    /// Syncs the files (and the directory, if a segment was created), then,
    /// after a rotation, replaces the log state file, and records in the
    /// progress file how far the current segment is synced.
    pub fn execute(&self) -> std::io::Result<()> {
        for f in &self.files {
            f.sync_data()?;
        }
        if let Some(dir) = &self.dir {
            self.disk.sync_dir(dir)?;
        }
        if let Some((dir, state)) = &self.state {
            // Here rather than inline in the rotation, so that the thread
            // taking appends does not wait for it.
            log_state::write_state(&self.disk, dir, state)?;
        }
        // Only now is the claim true. It is not synced (that would be a
        // second fdatasync per batch): if a crash loses it, recovery just
        // knows less, never more, than what was durable. For the same
        // reason a claim that finds no space is left out (the failed
        // append left the file as it was).
        if let Err(error) = self.progress.file.append(&self.progress.record) {
            if !crate::error::is_out_of_space(&error) {
                return Err(error);
            }
        }
        if self.progress.durable {
            self.progress.file.sync_data()?;
        }
        Ok(())
    }

    /// The persist sequence numbers this sync makes durable, per group.
    pub fn seqs(&self) -> &BTreeMap<GroupId, u64> {
        &self.seqs
    }
}

/// The write-ahead log. See the module documentation.
#[derive(Debug)]
pub struct Wal<D: Disk> {
    disk: D,
    dir: PathBuf,
    options: WalOptions,
    groups: BTreeMap<GroupId, Group>,
    /// Every segment on disk, oldest first, including the current one.
    segments: BTreeMap<u64, PathBuf>,
    current: Current<D::File>,
    /// Older segments written to since the last prepared sync.
    touched: Vec<Arc<D::File>>,
    dir_dirty: bool,
    unsynced_seqs: BTreeMap<GroupId, u64>,
    sync_in_flight: bool,
    poisoned: Option<String>,
    /// The sync progress file (see [`crate::log_state`]) and the bytes
    /// appended to it since it was created.
    progress: Arc<D::File>,
    progress_bytes: u64,
    /// The segment sealed by the latest rotation, until a sync has written
    /// the state file that says so.
    sealed_unrecorded: Option<SealedSegment>,
    /// Why the last attempt to start a new segment failed, while the log
    /// writes on in the current one (see [`Wal::rotation_deferred`]).
    rotation_deferred: Option<StorageError>,
    /// The length the current segment must reach before the next attempt
    /// to start a new one, once one failed: every attempt syncs the current
    /// segment first, so attempts are spaced by bytes written.
    rotation_retry_at_bytes: u64,
}

fn segment_name(seq: u64) -> String {
    format!("{seq:020}.seg")
}

fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".seg")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Replay state of one group.
#[derive(Debug, Default)]
struct ReplayGroup {
    hard_state: HardState,
    base_index: Index,
    base_term: Term,
    /// The index before the first entry held; above `base_index` when the
    /// entries between were in segments that are gone.
    start: Index,
    entries: VecDeque<Entry>,
    locations: VecDeque<Location>,
}

impl ReplayGroup {
    fn last(&self) -> Index {
        self.start + self.entries.len() as u64
    }

    fn compact(&mut self, through: Index, term: Term) {
        if through <= self.base_index {
            return;
        }
        self.base_index = through;
        self.base_term = term;
        if through >= self.last() {
            self.entries.clear();
            self.locations.clear();
            self.start = through;
        } else if through > self.start {
            let n = (through - self.start) as usize;
            self.entries.drain(..n);
            self.locations.drain(..n);
            self.start = through;
        }
    }

    fn truncate_after(&mut self, last: Index) {
        if last < self.start {
            self.entries.clear();
            self.locations.clear();
            self.start = last.max(self.base_index);
        } else {
            let keep = (last - self.start) as usize;
            self.entries.truncate(keep);
            self.locations.truncate(keep);
        }
    }
}

struct Replay<'a> {
    groups: BTreeMap<GroupId, ReplayGroup>,
    /// Groups whose last record is their removal.
    removed: BTreeSet<GroupId>,
    /// Groups with a removal anywhere in the log (their term may start over
    /// if they come back).
    ever_removed: BTreeSet<GroupId>,
    path: &'a Path,
    segment: u64,
    first_segment: bool,
}

impl Replay<'_> {
    fn corrupt(&self, offset: u64, reason: impl Into<String>) -> StorageError {
        StorageError::corrupt(self.path, offset, reason)
    }

    fn apply(&mut self, record: WalRecord, offset: u64) -> Result<()> {
        match &record {
            WalRecord::Checkpoint { group, .. }
            | WalRecord::Persist { group, .. }
            | WalRecord::Compact { group, .. }
            | WalRecord::ResetToSnapshot { group, .. } => {
                self.removed.remove(group);
            }
            WalRecord::SegmentHeader { .. } | WalRecord::RemoveGroup { .. } => {}
        }
        let at = Location {
            segment: self.segment,
            offset,
        };
        match record {
            WalRecord::SegmentHeader { .. } => {
                Err(self.corrupt(offset, "segment header in the middle of a segment"))
            }
            WalRecord::Checkpoint {
                group,
                hard_state,
                base_index,
                base_term,
                last_index,
            } => {
                if base_index > last_index {
                    return Err(
                        self.corrupt(offset, "checkpoint with its base after its last index")
                    );
                }
                match self.groups.get_mut(&group) {
                    None => {
                        // A group first seen in a later segment's checkpoint
                        // can only be one that recovery created from a
                        // snapshot alone: it has no entries to account for.
                        if !self.first_segment && last_index != base_index {
                            return Err(self.corrupt(
                                offset,
                                format!(
                                    "checkpoint of group {group}, unknown until here, \
                                     claims entries through {last_index}"
                                ),
                            ));
                        }
                        // The entries up to `last_index` were in older,
                        // deleted segments; they must all be compacted by a
                        // later record or covered by a snapshot.
                        self.groups.insert(
                            group,
                            ReplayGroup {
                                hard_state,
                                base_index,
                                base_term,
                                start: last_index,
                                ..ReplayGroup::default()
                            },
                        );
                    }
                    Some(g) => {
                        g.hard_state = hard_state;
                        g.compact(base_index, base_term);
                        if last_index > g.last() {
                            return Err(StorageError::corrupt(
                                self.path,
                                offset,
                                format!(
                                    "checkpoint says group {group} has entries through {last_index}, \
                                     but the log before it holds only through {}",
                                    g.last()
                                ),
                            ));
                        }
                        g.truncate_after(last_index);
                    }
                }
                Ok(())
            }
            WalRecord::Persist {
                group,
                hard_state,
                entries,
                ..
            } => {
                let g = self.groups.entry(group).or_default();
                if let Some(hs) = hard_state {
                    g.hard_state = hs;
                }
                let Some(first) = entries.first().map(|e| e.index) else {
                    return Ok(());
                };
                if first <= g.base_index || first > g.last() + 1 {
                    let (base, last) = (g.base_index, g.last());
                    return Err(self.corrupt(
                        offset,
                        format!("group {group}: entries from {first} do not fit a log with base {base} and last {last}"),
                    ));
                }
                if first <= g.start {
                    g.entries.clear();
                    g.locations.clear();
                    g.start = first - 1;
                } else {
                    g.truncate_after(first - 1);
                }
                for e in entries {
                    g.entries.push_back(e);
                    g.locations.push_back(at);
                }
                Ok(())
            }
            WalRecord::Compact {
                group,
                through,
                term,
            } => {
                let Some(g) = self.groups.get_mut(&group) else {
                    return Err(
                        self.corrupt(offset, format!("compaction of unknown group {group}"))
                    );
                };
                g.compact(through, term);
                Ok(())
            }
            WalRecord::ResetToSnapshot { group, index, term } => {
                let g = self.groups.entry(group).or_default();
                g.entries.clear();
                g.locations.clear();
                g.base_index = index;
                g.base_term = term;
                g.start = index;
                Ok(())
            }
            WalRecord::RemoveGroup { group } => {
                self.groups.remove(&group);
                self.removed.insert(group);
                self.ever_removed.insert(group);
                Ok(())
            }
        }
    }
}

impl<D: Disk> Wal<D> {
    /// Opens (or creates) the log in `dir` and replays it.
    ///
    /// `snapshots` gives, per group, the index and term of the latest
    /// snapshot on disk: entries it covers are dropped, and a log that
    /// disagrees with it (a different term at its index) is discarded after
    /// it, as Raft requires. A group whose entries are missing and not
    /// covered by a snapshot is [`StorageError::Corrupt`]. A log that ends
    /// before what its state file and its progress file say was synced, or
    /// that has lost its state file, is [`StorageError::LostSyncedData`]
    /// (see [`crate::log_state`]); nothing on disk is changed then.
    pub fn open(
        disk: D,
        dir: &Path,
        options: WalOptions,
        snapshots: &BTreeMap<GroupId, (Index, Term)>,
    ) -> Result<(Wal<D>, WalRecovery)> {
        crate::disk::create_dir_durably(&disk, dir)?;
        let names = disk
            .list_files(dir)
            .map_err(|e| StorageError::io("list directory", dir, e))?;
        let state = log_state::read_state(&disk, dir, &names)?;
        let claim = log_state::read_progress(&disk, dir, &names)?;
        let mut seqs: Vec<u64> = names.iter().filter_map(|n| parse_segment_name(n)).collect();
        seqs.sort_unstable();
        // Only the newest contiguous run of segments is the log: anything
        // older than a gap is left over from an interrupted deletion (the
        // first segment after the gap holds a checkpoint of every group).
        let mut run_start = seqs.len();
        while run_start > 0
            && (run_start == seqs.len()
                || seqs[run_start - 1].checked_add(1) == Some(seqs[run_start]))
        {
            run_start -= 1;
        }
        let stale: Vec<u64> = seqs[..run_start].to_vec();
        let run: Vec<u64> = seqs[run_start..].to_vec();

        let mut report = WalRecovery::default();
        let mut replay_groups = BTreeMap::new();
        let mut removed = BTreeSet::new();
        let mut ever_removed = BTreeSet::new();
        let mut found = Vec::with_capacity(run.len());
        for (i, &seq) in run.iter().enumerate() {
            let path = dir.join(segment_name(seq));
            let is_last = i + 1 == run.len();
            let buf = Bytes::from(
                disk.read_all(&path)
                    .map_err(|e| StorageError::io("read segment", &path, e))?,
            );
            let mut replay = Replay {
                groups: std::mem::take(&mut replay_groups),
                removed: std::mem::take(&mut removed),
                ever_removed: std::mem::take(&mut ever_removed),
                path: &path,
                segment: seq,
                first_segment: i == 0,
            };
            let (valid_len, header) =
                replay_segment(&mut replay, &buf, seq, is_last, found.last())?;
            replay_groups = replay.groups;
            removed = replay.removed;
            ever_removed = replay.ever_removed;
            report.segments_replayed += 1;
            report.bytes_replayed += valid_len as u64;
            // What follows the valid records is a torn write, unless it is
            // only reserved zeros; the zeros after a torn write are not
            // counted as cut.
            let damaged_end = buf[valid_len..]
                .iter()
                .rposition(|b| *b != 0)
                .map_or(valid_len, |i| valid_len + i + 1);
            if valid_len < damaged_end {
                debug_assert!(is_last);
                report.truncated_bytes = (damaged_end - valid_len) as u64;
                report.truncated_file = Some(path.clone());
            }
            found.push(FoundSegment {
                seq,
                path,
                file_len: buf.len() as u64,
                valid_len: valid_len as u64,
                header,
            });
        }
        check_nothing_synced_is_missing(
            dir,
            state.as_ref(),
            claim,
            &found,
            &replay_groups,
            &ever_removed,
            !snapshots.is_empty(),
        )?;
        report.upgraded_from_format_1 = state.is_none() && found.iter().any(|f| f.valid_len > 0);

        // Reconcile with the snapshots, then check that nothing is missing.
        let first_path = run
            .first()
            .map(|s| dir.join(segment_name(*s)))
            .unwrap_or_else(|| dir.to_path_buf());
        for (group, &(index, term)) in snapshots {
            if removed.contains(group) {
                // The group was removed after this snapshot was taken; its
                // files are deleted by the caller (see `removed_groups`).
                continue;
            }
            let g = replay_groups.entry(*group).or_default();
            if index <= g.base_index {
                continue;
            }
            // The entries after the snapshot are kept only if the log holds
            // the snapshot's own entry with the same term (or the snapshot
            // ends exactly where the surviving entries begin).
            let matches = (index == g.start && index <= g.last())
                || (index > g.start
                    && index <= g.last()
                    && g.entries
                        .get((index - g.start - 1) as usize)
                        .map(|e| e.term)
                        == Some(term));
            if matches {
                g.compact(index, term);
            } else {
                g.entries.clear();
                g.locations.clear();
                g.base_index = index;
                g.base_term = term;
                g.start = index;
            }
        }
        for (group, g) in &replay_groups {
            if g.start > g.base_index {
                return Err(StorageError::corrupt(
                    &first_path,
                    0,
                    format!(
                        "group {group}: entries {}..={} are in segments that no longer exist and no snapshot covers them",
                        g.base_index + 1,
                        g.start
                    ),
                ));
            }
        }

        // Everything checked: only now change the disk.
        let mut segments = BTreeMap::new();
        for (i, f) in found.iter().enumerate() {
            let is_last = i + 1 == found.len();
            if is_last && f.valid_len == 0 {
                // Not even its header survived: the segment never held data
                // (nothing vouches for it, or the check above would have
                // refused). Its number is reused below, so the run stays
                // contiguous.
                disk.remove_file(&f.path)
                    .map_err(|e| StorageError::io("remove torn segment", &f.path, e))?;
                disk.sync_dir(dir)
                    .map_err(|e| StorageError::io("sync directory", dir, e))?;
                continue;
            }
            if is_last {
                // Cut the torn tail, if any, and make the last segment durable
                // as it is (its tail may have been written but never synced)
                // before a newer segment exists: only the last segment may
                // ever have a torn tail.
                disk.truncate_synced(&f.path, f.valid_len)
                    .map_err(|e| StorageError::io("truncate and sync last segment", &f.path, e))?;
                // Its name, too, may never have been synced; what recovery
                // reports must be durable.
                disk.sync_dir(dir)
                    .map_err(|e| StorageError::io("sync directory", dir, e))?;
            }
            segments.insert(f.seq, f.path.clone());
        }

        report.removed_groups = removed;
        let next_seq = match segments.iter().next_back() {
            Some((last, path)) => last.checked_add(1).ok_or_else(|| {
                StorageError::corrupt(path, 0, "no segment number is left after this one")
            })?,
            None => run.last().copied().unwrap_or(1),
        };
        // The newest segment with data is sealed from now on, at the length
        // it has now; the state file says so (and holds every group's vote)
        // before the next segment exists.
        let sealed = segments.keys().next_back().and_then(|seq| {
            found.iter().find(|f| f.seq == *seq).map(|f| SealedSegment {
                segment: f.seq,
                len: f.valid_len,
            })
        });
        let votes = replay_groups
            .iter()
            .map(|(id, g)| (*id, g.hard_state))
            .filter_map(vote_worth_keeping)
            .collect();
        // Before the new segment exists: a segment in the current format
        // without a state file is refused as one that lost it.
        log_state::write_state(
            &disk,
            dir,
            &LogState {
                next_segment: next_seq,
                sealed,
                votes,
            },
        )
        .map_err(|e| StorageError::io("write log state", dir.join(LOG_STATE_FILE), e))?;
        let progress_path = dir.join(SYNC_PROGRESS_FILE);
        let progress = disk
            .create(&progress_path)
            .map_err(|e| StorageError::io("create sync progress file", &progress_path, e))?;
        let path = dir.join(segment_name(next_seq));
        let file = disk
            .create(&path)
            .map_err(|e| StorageError::io("create segment", &path, e))?;
        segments.insert(next_seq, path.clone());
        let mut wal = Wal {
            disk: disk.clone(),
            dir: dir.to_path_buf(),
            options,
            groups: BTreeMap::new(),
            segments,
            current: Current {
                seq: next_seq,
                path,
                file: Arc::new(file),
                flushed_len: 0,
                buffer: Vec::new(),
                dirty: true,
                reserved_len: 0,
            },
            touched: Vec::new(),
            // The new segment's name and the new progress file's are made
            // durable by the first sync.
            dir_dirty: true,
            unsynced_seqs: BTreeMap::new(),
            sync_in_flight: false,
            poisoned: None,
            progress: Arc::new(progress),
            progress_bytes: 0,
            sealed_unrecorded: None,
            rotation_deferred: None,
            rotation_retry_at_bytes: 0,
        };
        for (id, g) in replay_groups {
            let mut group = Group::new(&wal.options);
            group.hard_state = g.hard_state;
            group.base_index = g.base_index;
            group.base_term = g.base_term;
            group.terms = g.entries.iter().map(|e| e.term).collect();
            group.locations = g.locations;
            let entries: Vec<Entry> = g.entries.into();
            let cached_from = entries
                .len()
                .saturating_sub(wal.options.cache_entries_max_per_group);
            group.cache.append(&entries[cached_from..]);
            report.groups.insert(
                id,
                RecoveredLog {
                    hard_state: g.hard_state,
                    base_index: g.base_index,
                    base_term: g.base_term,
                    entries,
                },
            );
            wal.groups.insert(id, group);
        }
        wal.write_segment_start(sealed.map(|s| s.len))?;
        for seq in stale {
            let path = dir.join(segment_name(seq));
            disk.remove_file(&path)
                .map_err(|e| StorageError::io("remove stale segment", &path, e))?;
            report.stale_segments_removed += 1;
        }
        Ok((wal, report))
    }

    fn check(&self) -> Result<()> {
        match &self.poisoned {
            Some(why) => Err(StorageError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    fn poison<T>(&mut self, err: StorageError) -> Result<T> {
        if self.poisoned.is_none() {
            self.poisoned = Some(err.to_string());
        }
        Err(err)
    }

    /// Writes the header and a checkpoint of every group to the (empty)
    /// current segment. `previous_len` is the length the previous segment
    /// is sealed at, if there is one.
    fn write_segment_start(&mut self, previous_len: Option<u64>) -> Result<()> {
        debug_assert_eq!(self.current.len(), 0);
        let mut buf = std::mem::take(&mut self.current.buffer);
        frame_record(
            &mut buf,
            &WalRecord::SegmentHeader {
                segment: self.current.seq,
                version: WAL_FORMAT_VERSION,
                previous_len,
            },
        );
        for (id, g) in &self.groups {
            frame_record(
                &mut buf,
                &WalRecord::Checkpoint {
                    group: *id,
                    hard_state: g.hard_state,
                    base_index: g.base_index,
                    base_term: g.base_term,
                    last_index: g.last_index(),
                },
            );
        }
        self.current.buffer = buf;
        self.current.dirty = true;
        self.flush_if_full()
    }

    fn flush(&mut self) -> Result<()> {
        if self.current.buffer.is_empty() {
            return Ok(());
        }
        self.reserve_ahead()?;
        if let Err(e) = self.current.file.append(&self.current.buffer) {
            let err = StorageError::appending("write segment", &self.current.path, e);
            if err.is_transient() {
                // Out of space: the segment is as it was and the buffer
                // still holds every record, so nothing is lost; the next
                // flush (at the next sync) tries again.
                return Err(err);
            }
            return self.poison(err);
        }
        self.current.flushed_len += self.current.buffer.len() as u64;
        self.current.buffer.clear();
        Ok(())
    }

    /// Before the buffer is written: if it would reach past the reserved
    /// zeros, reserves the next chunk (up to the segment size), so that the
    /// syncs until then overwrite space the file already has. The zeros go
    /// to disk with the next sync, which is the one to pay for the longer
    /// file, once per chunk.
    fn reserve_ahead(&mut self) -> Result<()> {
        let end = self.current.len();
        let limit = self.options.segment_size_bytes_max;
        if self.options.reserve_bytes == 0 || end <= self.current.reserved_len || end > limit {
            return Ok(());
        }
        let target = end.saturating_add(self.options.reserve_bytes).min(limit);
        if let Err(e) = self.current.file.reserve(target) {
            let err = StorageError::appending("reserve segment space", &self.current.path, e);
            if !err.is_transient() {
                return self.poison(err);
            }
            // Out of space: the file is as it was; the log appends without
            // a reserve and tries again past this chunk.
        }
        self.current.reserved_len = target;
        Ok(())
    }

    fn flush_if_full(&mut self) -> Result<()> {
        if self.current.buffer.len() >= self.options.write_buffer_bytes_max {
            match self.flush() {
                // The records stay buffered (the caller's record with
                // them) and the next sync flushes them or reports it.
                Err(err) if err.is_transient() => {}
                outcome => outcome?,
            }
        }
        Ok(())
    }

    fn rotate(&mut self) -> Result<()> {
        if let Err(err) = self.flush() {
            if !err.is_transient() {
                return Err(err);
            }
            // Out of space: write on in the current segment and rotate
            // once it has grown by a step (as when the next segment
            // cannot be created).
            let step_bytes = (self.options.segment_size_bytes_max / 16).max(1);
            self.rotation_retry_at_bytes = self.current.len().saturating_add(step_bytes);
            self.rotation_deferred = Some(err);
            return Ok(());
        }
        // Seal the old segment before the next one exists: then only the
        // last segment can ever have a torn tail, and damage anywhere else
        // is corruption. One extra sync per segment is cheap. A sealed
        // segment ends with its last record: its reserved zeros go.
        if self.current.reserved_len > self.current.flushed_len {
            if let Err(e) = self.current.file.release_reserved() {
                let err = StorageError::io("release segment space", &self.current.path, e);
                return self.poison(err);
            }
            // If the next segment cannot be created, the log writes on in
            // this one, past its size, without a reserve.
            self.current.reserved_len = self.current.flushed_len;
        }
        if let Err(e) = self.current.file.sync_data() {
            let err = StorageError::io("sync segment", &self.current.path, e);
            return self.poison(err);
        }
        let Some(seq) = self.current.seq.checked_add(1) else {
            let err = StorageError::corrupt(
                &self.current.path,
                0,
                "no segment number is left after this one",
            );
            return self.poison(err);
        };
        // The next sync records durably that the old segment is sealed at
        // this length (see `prepare_sync`). Until then, recovery knows it
        // from the new segment's header and from the old state file and
        // claims, which vouch for less but never for more.
        let sealed = SealedSegment {
            segment: self.current.seq,
            len: self.current.len(),
        };
        let path = self.dir.join(segment_name(seq));
        let file = match self.disk.create(&path) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                let err = StorageError::creating("create segment", &path, e);
                if !err.is_transient() {
                    return self.poison(err);
                }
                // Out of descriptors or space: nothing was lost (the current
                // segment is synced and stays the last one), so the log
                // writes on in it and tries again once it has grown by a
                // step. A name the failed create may have left would sit
                // after the current segment, where recovery allows no torn
                // tail: take it away (if there is none, that fails, fine).
                let _ = self.disk.remove_file(&path);
                let step_bytes = (self.options.segment_size_bytes_max / 16).max(1);
                self.rotation_retry_at_bytes = self.current.len().saturating_add(step_bytes);
                self.rotation_deferred = Some(err);
                return Ok(());
            }
        };
        // Only a segment with a successor is sealed (a deferred rotation
        // writes on in the current one).
        self.sealed_unrecorded = Some(sealed);
        self.rotation_deferred = None;
        self.rotation_retry_at_bytes = 0;
        let old = std::mem::replace(
            &mut self.current,
            Current {
                seq,
                path: path.clone(),
                file,
                flushed_len: 0,
                buffer: Vec::new(),
                dirty: true,
                reserved_len: 0,
            },
        );
        if old.dirty {
            self.touched.push(old.file);
        }
        self.segments.insert(seq, path);
        self.dir_dirty = true;
        self.write_segment_start(Some(sealed.len))
    }

    /// The state file's content for a log whose next segment is `next`.
    /// Every group's vote as the log holds it: written only once all of it
    /// is synced.
    fn log_state(&self, next: u64, sealed: Option<SealedSegment>) -> LogState {
        LogState {
            next_segment: next,
            sealed,
            votes: self
                .groups
                .iter()
                .map(|(id, g)| (*id, g.hard_state))
                .filter_map(vote_worth_keeping)
                .collect(),
        }
    }

    /// Starts the progress file afresh. Its name is made durable by the
    /// next sync, which also syncs its first claim (see [`ProgressClaim`]).
    /// Only while no sync is in flight: the sync appends to the file.
    fn reset_progress(&mut self) -> Result<()> {
        debug_assert!(!self.sync_in_flight);
        let path = self.dir.join(SYNC_PROGRESS_FILE);
        match self.disk.create(&path) {
            Ok(f) => {
                self.progress = Arc::new(f);
                self.progress_bytes = 0;
                self.dir_dirty = true;
                Ok(())
            }
            Err(e) => {
                let err = StorageError::io("create sync progress file", &path, e);
                self.poison(err)
            }
        }
    }

    /// Writes one record; returns where it starts.
    fn write_record(&mut self, record: &WalRecord) -> Result<Location> {
        if self.current.len() >= self.options.segment_size_bytes_max
            && self.current.len() >= self.rotation_retry_at_bytes
        {
            self.rotate()?;
        }
        let at = Location {
            segment: self.current.seq,
            offset: self.current.len(),
        };
        frame_record(&mut self.current.buffer, record);
        self.current.dirty = true;
        self.flush_if_full()?;
        Ok(at)
    }

    /// Writes a persist request of `group`: its hard state, if any, and its
    /// entries, which replace every stored entry from `entries[0].index` on.
    /// Durable after the next completed sync.
    pub fn append(&mut self, group: GroupId, request: &PersistRequest) -> Result<()> {
        self.check()?;
        let invalid = |reason: String| StorageError::InvalidRequest { group, reason };
        let (base, last) = match self.groups.get(&group) {
            Some(g) => (g.base_index, g.last_index()),
            None => (0, 0),
        };
        if let Some(first) = request.entries.first() {
            if first.index <= base || first.index > last + 1 {
                return Err(invalid(format!(
                    "entries from {} cannot follow a log with base {base} and last index {last}",
                    first.index
                )));
            }
            for pair in request.entries.windows(2) {
                if pair[1].index != pair[0].index + 1 || pair[1].term < pair[0].term {
                    return Err(invalid(format!(
                        "entries {} and {} are not consecutive with non-decreasing terms",
                        pair[0].index, pair[1].index
                    )));
                }
            }
            if let Some(e) = request.entries.iter().find(|e| {
                e.size_bytes() > codec::COMMAND_BYTES_MAX
                    || matches!(&e.payload, EntryPayload::Config(c) if !codec::config_fits(c))
            }) {
                return Err(invalid(format!(
                    "entry {} of {} bytes exceeds the limit of {} bytes (or its configuration lists more than {} members in one set)",
                    e.index,
                    e.size_bytes(),
                    codec::COMMAND_BYTES_MAX,
                    codec::CONFIG_MEMBERS_MAX
                )));
            }
        }
        // Split large requests into records of about the target size; the
        // hard state goes with the first.
        // Records stay well under the frame limit: at most one entry (at most
        // COMMAND_BYTES_MAX) beyond this target.
        let record_target = self
            .options
            .record_size_bytes_target
            .min(codec::RECORD_BYTES_MAX - codec::COMMAND_BYTES_MAX - 1024);
        let mut hard_state = request.hard_state;
        let mut rest: &[Entry] = &request.entries;
        loop {
            let mut n = 0;
            let mut bytes = 0;
            while n < rest.len() && (n == 0 || bytes + rest[n].size_bytes() <= record_target) {
                bytes += rest[n].size_bytes();
                n += 1;
            }
            let (chunk, tail) = rest.split_at(n);
            let record = WalRecord::Persist {
                group,
                seq: request.seq,
                hard_state: hard_state.take(),
                entries: chunk.to_vec(),
            };
            let at = self.write_record(&record)?;
            // The in-memory state changes only after its record is written:
            // a rotation inside write_record checkpoints the state as of the
            // records before this one.
            let options = &self.options;
            let g = self
                .groups
                .entry(group)
                .or_insert_with(|| Group::new(options));
            if let Some(hs) = request.hard_state {
                g.hard_state = hs;
            }
            g.apply_entries(chunk, at);
            rest = tail;
            if rest.is_empty() {
                break;
            }
        }
        self.unsynced_seqs.insert(group, request.seq);
        Ok(())
    }

    /// Drops `group`'s entries through `through`, which a snapshot covers.
    /// Does nothing if they are already gone.
    pub fn compact(&mut self, group: GroupId, through: Index) -> Result<()> {
        self.check()?;
        let g = self
            .groups
            .get(&group)
            .ok_or(StorageError::UnknownGroup(group))?;
        if through <= g.base_index {
            return Ok(());
        }
        let Some(term) = g.term(through) else {
            return Err(StorageError::OutOfRange {
                group,
                index: through,
                first: g.base_index + 1,
                last: g.last_index(),
            });
        };
        self.write_record(&WalRecord::Compact {
            group,
            through,
            term,
        })?;
        if let Some(g) = self.groups.get_mut(&group) {
            g.compact(through, term);
        }
        Ok(())
    }

    /// Replaces `group`'s whole log by an installed snapshot at `index`.
    /// Creates the group if it is new. Call after the snapshot is durable.
    pub fn reset_to_snapshot(&mut self, group: GroupId, index: Index, term: Term) -> Result<()> {
        self.check()?;
        self.write_record(&WalRecord::ResetToSnapshot { group, index, term })?;
        let options = self.options.clone();
        self.groups
            .entry(group)
            .or_insert_with(|| Group::new(&options))
            .reset(index, term);
        Ok(())
    }

    /// Forgets `group` (it no longer lives on this node).
    pub fn remove_group(&mut self, group: GroupId) -> Result<()> {
        self.check()?;
        if !self.groups.contains_key(&group) {
            return Ok(());
        }
        self.write_record(&WalRecord::RemoveGroup { group })?;
        self.groups.remove(&group);
        self.unsynced_seqs.remove(&group);
        Ok(())
    }

    /// Starts a sync of everything written so far. `Ok(None)` if nothing was
    /// written since the last one.
    pub fn prepare_sync(&mut self) -> Result<Option<PendingSync<D>>> {
        self.check()?;
        if self.sync_in_flight {
            return Err(StorageError::SyncInFlight);
        }
        self.flush()?;
        if !self.current.dirty && self.touched.is_empty() && !self.dir_dirty {
            return Ok(None);
        }
        if self.progress_bytes >= PROGRESS_BYTES_MAX {
            self.reset_progress()?;
        }
        // Once this sync completes, the current segment is synced through
        // everything handed to its file so far.
        let record = SyncClaim {
            segment: self.current.seq,
            len: self.current.flushed_len,
        }
        .encode();
        self.progress_bytes = self.progress_bytes.saturating_add(record.len() as u64);
        let progress = ProgressClaim {
            file: self.progress.clone(),
            record,
            durable: self.dir_dirty,
        };
        // After a rotation: the sealed segment (synced in the rotation) and
        // every group's vote as of now (synced by this sync), recorded once
        // this sync is done.
        let state = self.sealed_unrecorded.take().map(|sealed| {
            (
                self.dir.clone(),
                self.log_state(self.current.seq, Some(sealed)),
            )
        });
        let mut files = std::mem::take(&mut self.touched);
        if self.current.dirty {
            files.push(self.current.file.clone());
        }
        let oldest_live = self
            .groups
            .values()
            .filter_map(|g| g.locations.front().map(|l| l.segment))
            .min()
            .unwrap_or(self.current.seq);
        let pending = PendingSync {
            disk: self.disk.clone(),
            files,
            dir: self.dir_dirty.then(|| self.dir.clone()),
            seqs: std::mem::take(&mut self.unsynced_seqs),
            delete_below: oldest_live.min(self.current.seq),
            state,
            progress,
        };
        self.current.dirty = false;
        self.dir_dirty = false;
        self.sync_in_flight = true;
        Ok(Some(pending))
    }

    /// Finishes a sync with the outcome of [`PendingSync::execute`]. Returns
    /// the highest durable persist sequence number of each group it covered,
    /// and deletes segments no group needs any more.
    pub fn complete_sync(
        &mut self,
        pending: PendingSync<D>,
        outcome: std::io::Result<()>,
    ) -> Result<BTreeMap<GroupId, u64>> {
        self.sync_in_flight = false;
        self.check()?;
        if let Err(e) = outcome {
            let err = StorageError::io("sync", &self.dir, e);
            return self.poison(err);
        }
        let old: Vec<u64> = self
            .segments
            .range(..pending.delete_below)
            .map(|(s, _)| *s)
            .collect();
        for seq in old {
            if let Some(path) = self.segments.remove(&seq) {
                if let Err(e) = self.disk.remove_file(&path) {
                    let err = StorageError::io("remove old segment", &path, e);
                    return self.poison(err);
                }
            }
        }
        Ok(pending.seqs)
    }

    /// Writes and syncs everything written so far: prepare, execute and
    /// complete in one call.
    pub fn sync(&mut self) -> Result<BTreeMap<GroupId, u64>> {
        match self.prepare_sync()? {
            None => Ok(BTreeMap::new()),
            Some(pending) => {
                let outcome = pending.execute();
                self.complete_sync(pending, outcome)
            }
        }
    }

    /// The groups with state in the log.
    pub fn groups(&self) -> impl Iterator<Item = GroupId> + '_ {
        self.groups.keys().copied()
    }

    /// The latest hard state written for `group`.
    pub fn hard_state(&self, group: GroupId) -> Option<HardState> {
        self.groups.get(&group).map(|g| g.hard_state)
    }

    /// The first index `group`'s log holds (one past its base; the log may be empty).
    pub fn first_index(&self, group: GroupId) -> Option<Index> {
        self.groups.get(&group).map(|g| g.base_index + 1)
    }

    /// The last index of `group`'s log (its base if the log is empty).
    pub fn last_index(&self, group: GroupId) -> Option<Index> {
        self.groups.get(&group).map(Group::last_index)
    }

    /// The term of `group`'s entry at `index` (or at its base), if known.
    pub fn term(&self, group: GroupId, index: Index) -> Option<Term> {
        self.groups.get(&group)?.term(index)
    }

    /// Why the log could not start a new segment when the current one
    /// filled, if the last attempt failed: it ran out of file descriptors,
    /// space or quota ([`StorageError::is_transient`]). That is a condition
    /// the log waits out, not a failure: it writes on in the current
    /// segment (which then grows past its size target) and tries again as
    /// it grows. `None` once a new segment was started.
    pub fn rotation_deferred(&self) -> Option<&StorageError> {
        self.rotation_deferred.as_ref()
    }

    /// Segments on disk (for tests and monitoring).
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Entries `lo..hi` of `group`, stopping once `size_bytes_max` is
    /// reached (always at least one). Served from the cache when it holds
    /// them, otherwise read from the segments.
    pub fn entries(
        &self,
        group: GroupId,
        lo: Index,
        hi: Index,
        size_bytes_max: u64,
    ) -> Result<Vec<Entry>> {
        self.check()?;
        let g = self
            .groups
            .get(&group)
            .ok_or(StorageError::UnknownGroup(group))?;
        let (first, last) = (g.base_index + 1, g.last_index());
        if lo >= hi {
            return Ok(Vec::new());
        }
        for index in [lo, hi - 1] {
            if index < first || index > last {
                return Err(StorageError::OutOfRange {
                    group,
                    index,
                    first,
                    last,
                });
            }
        }
        if let Some(hit) = g.cache.get(lo, hi, size_bytes_max) {
            return Ok(hit);
        }
        let mut out = Vec::new();
        let mut bytes = 0u64;
        let mut index = lo;
        while index < hi {
            let Some(loc) = g.locations.get((index - first) as usize).copied() else {
                break;
            };
            let record = self.read_record(loc)?;
            let WalRecord::Persist { entries, .. } = record else {
                return Err(StorageError::corrupt(
                    self.segment_path(loc.segment),
                    loc.offset,
                    "expected a record of entries",
                ));
            };
            let Some(rec_first) = entries.first().map(|e| e.index) else {
                return Err(StorageError::corrupt(
                    self.segment_path(loc.segment),
                    loc.offset,
                    "record of entries is empty",
                ));
            };
            let before = index;
            for e in entries
                .into_iter()
                .skip(index.saturating_sub(rec_first) as usize)
            {
                if index >= hi {
                    break;
                }
                // The record may also hold entries that a later record
                // replaced: only the ones still located here are live.
                if e.index != index || g.locations.get((index - first) as usize) != Some(&loc) {
                    break;
                }
                bytes += e.size_bytes();
                if !out.is_empty() && bytes > size_bytes_max {
                    return Ok(out);
                }
                out.push(e);
                index += 1;
            }
            if index == before {
                return Err(StorageError::corrupt(
                    self.segment_path(loc.segment),
                    loc.offset,
                    format!("record does not hold entry {index} of group {group}"),
                ));
            }
        }
        Ok(out)
    }

    fn segment_path(&self, seq: u64) -> PathBuf {
        self.segments
            .get(&seq)
            .cloned()
            .unwrap_or_else(|| self.dir.join(segment_name(seq)))
    }

    fn read_record(&self, loc: Location) -> Result<WalRecord> {
        let path = self.segment_path(loc.segment);
        let frame = if loc.segment == self.current.seq && loc.offset >= self.current.flushed_len {
            let at = (loc.offset - self.current.flushed_len) as usize;
            let Some(header) = self.current.buffer.get(at..at + FRAME_HEADER_BYTES) else {
                return Err(StorageError::corrupt(
                    &path,
                    loc.offset,
                    "record missing from the write buffer",
                ));
            };
            let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
            match self.current.buffer.get(at..at + FRAME_HEADER_BYTES + len) {
                Some(f) => f.to_vec(),
                None => {
                    return Err(StorageError::corrupt(
                        &path,
                        loc.offset,
                        "record cut short in the write buffer",
                    ))
                }
            }
        } else {
            let mut header = [0u8; FRAME_HEADER_BYTES];
            self.disk
                .read_exact_at(&path, loc.offset, &mut header)
                .map_err(|e| StorageError::opening("read segment", &path, e))?;
            let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as u64;
            if len > codec::RECORD_BYTES_MAX {
                return Err(StorageError::corrupt(
                    &path,
                    loc.offset,
                    format!("record length {len} is too large"),
                ));
            }
            let mut frame = vec![0u8; FRAME_HEADER_BYTES + len as usize];
            self.disk
                .read_exact_at(&path, loc.offset, &mut frame)
                .map_err(|e| StorageError::opening("read segment", &path, e))?;
            frame
        };
        match read_frame(&frame, 0) {
            FrameRead::Valid { start, end } => {
                WalRecord::decode(Bytes::copy_from_slice(&frame[start..end]))
                    .map_err(|e| StorageError::corrupt(&path, loc.offset, e.to_string()))
            }
            other => Err(StorageError::corrupt(
                &path,
                loc.offset,
                format!("record failed verification on read: {other:?}"),
            )),
        }
    }
}

/// The bytes [`search_after_damage`] may checksum, per byte it searches,
/// beyond [`DAMAGE_SEARCH_CHECKSUM_BYTES_MIN`]. Every offset after damage
/// is a candidate record, and a candidate whose length field fits the bytes
/// after it costs a checksum over that length: bytes crafted so that most
/// offsets fit (or, rarely, noise) would make the search quadratic (a
/// damaged tail of 1 MiB took seconds, one of 64 MiB would take hours).
/// Real damage costs far less: a torn tail reads as zeros (no length fits)
/// and damage in the middle has whole records right after it.
const DAMAGE_SEARCH_CHECKSUM_BYTES_PER_BYTE: u64 = 64;
/// The bytes [`search_after_damage`] may always checksum.
const DAMAGE_SEARCH_CHECKSUM_BYTES_MIN: u64 = 256 << 20;

/// What a search for valid records after damage found.
#[derive(Debug, PartialEq, Eq)]
enum AfterDamage {
    /// A valid record starts here.
    ValidRecord(usize),
    /// No valid record follows the damage.
    Nothing,
    /// The search would take longer than its budget: the bytes after the
    /// damage are not what a torn write leaves.
    TooCostly {
        /// Bytes checksummed before the search gave up.
        checksummed_bytes: u64,
    },
}

/// Looks for the first valid record at or after `from` in `buf`, with work
/// bounded by the bytes searched (see
/// [`DAMAGE_SEARCH_CHECKSUM_BYTES_PER_BYTE`]).
fn search_after_damage(buf: &[u8], from: usize) -> AfterDamage {
    let searched_bytes = buf.len().saturating_sub(from) as u64;
    let budget_bytes = DAMAGE_SEARCH_CHECKSUM_BYTES_MIN
        .saturating_add(searched_bytes.saturating_mul(DAMAGE_SEARCH_CHECKSUM_BYTES_PER_BYTE));
    let mut checksummed_bytes: u64 = 0;
    for at in from..buf.len().saturating_sub(FRAME_HEADER_BYTES - 1) {
        // What read_frame checksums at `at`: the length field and the
        // payload, if the payload fits the buffer (nothing otherwise).
        let Some(length) = buf.get(at..at + 4) else {
            break;
        };
        let len = u64::from(u32::from_le_bytes([
            length[0], length[1], length[2], length[3],
        ]));
        let fits = len <= codec::RECORD_BYTES_MAX
            && (at + FRAME_HEADER_BYTES) as u64 + len <= buf.len() as u64;
        if fits {
            checksummed_bytes = checksummed_bytes.saturating_add(4 + len);
            if checksummed_bytes > budget_bytes {
                return AfterDamage::TooCostly { checksummed_bytes };
            }
        }
        if let FrameRead::Valid { start, end } = read_frame(buf, at) {
            if WalRecord::decode(Bytes::copy_from_slice(&buf[start..end])).is_ok() {
                return AfterDamage::ValidRecord(at);
            }
        }
    }
    AfterDamage::Nothing
}

/// What a segment's header says: its format version and the length its
/// predecessor was sealed at.
type HeaderInfo = (u32, Option<u64>);

/// Replays one segment; returns the length of its valid prefix (shorter
/// than the buffer only for a torn tail of the last segment) and what its
/// header says (`None` if not even the header is valid). `previous` is the
/// segment before it, as replayed: the header says how long it must be.
fn replay_segment(
    replay: &mut Replay<'_>,
    data: &Bytes,
    seq: u64,
    is_last: bool,
    previous: Option<&FoundSegment>,
) -> Result<(usize, Option<HeaderInfo>)> {
    let buf: &[u8] = data;
    let mut header = None;
    if buf.is_empty() && !is_last {
        return Err(replay.corrupt(0, "segment is empty: its header is missing"));
    }
    let mut at = 0usize;
    while at < buf.len() {
        let (start, end) = match read_frame(buf, at) {
            FrameRead::Valid { start, end } => (start, end),
            bad => {
                // A torn write damages only the end of the last segment.
                // If a valid record follows the damage we call it
                // corruption: out-of-order page writeback of an unsynced
                // batch could in theory look like that, but refusing to start
                // is the safe side, while cutting synced records would
                // silently lose acknowledged writes.
                if is_last && buf[at..].iter().all(|b| *b == 0) {
                    // Reserved space the log had not reached yet (or had,
                    // in a write that never reached the disk).
                    return Ok((at, header));
                }
                if is_last {
                    match search_after_damage(buf, at + 1) {
                        AfterDamage::Nothing => return Ok((at, header)),
                        AfterDamage::ValidRecord(_) => {}
                        AfterDamage::TooCostly { checksummed_bytes } => {
                            return Err(replay.corrupt(
                                at as u64,
                                format!(
                                    "damaged tail of {} bytes: searching it for valid records \
                                     gave up after checksumming {checksummed_bytes} bytes (a \
                                     torn write leaves nothing this costly to search)",
                                    buf.len() - at
                                ),
                            ))
                        }
                    }
                }
                let reason = match bad {
                    FrameRead::Incomplete => "segment ends inside a record".to_string(),
                    FrameRead::BadLength(len) => format!("record length {len} is too large"),
                    FrameRead::BadChecksum { .. } => "record checksum mismatch".to_string(),
                    FrameRead::Valid { .. } => "unreachable".to_string(),
                };
                return Err(replay.corrupt(at as u64, reason));
            }
        };
        let record = WalRecord::decode(data.slice(start..end))
            .map_err(|e| replay.corrupt(at as u64, e.to_string()))?;
        if at == 0 {
            match record {
                WalRecord::SegmentHeader {
                    segment,
                    version,
                    previous_len,
                } if segment == seq => {
                    // Before any of this segment's records is applied: a
                    // shorter predecessor would otherwise surface as a
                    // confusing mismatch in the checkpoints that follow.
                    if let (Some(sealed_len), Some(prev)) = (previous_len, previous) {
                        check_sealed_length(prev, sealed_len, seq)?;
                    }
                    header = Some((version, previous_len));
                }
                other => {
                    return Err(replay.corrupt(
                        0,
                        format!("segment does not start with its header: {other:?}"),
                    ));
                }
            }
        } else {
            replay.apply(record, at as u64)?;
        }
        at = end;
    }
    Ok((at, header))
}

/// One segment of the log as recovery found it.
#[derive(Debug)]
struct FoundSegment {
    seq: u64,
    path: PathBuf,
    file_len: u64,
    /// The length of its valid prefix.
    valid_len: u64,
    header: Option<HeaderInfo>,
}

impl FoundSegment {
    fn describe(&self) -> String {
        if self.valid_len == self.file_len {
            format!("{} bytes", self.valid_len)
        } else {
            format!(
                "{} bytes of valid records (the file has {})",
                self.valid_len, self.file_len
            )
        }
    }
}

/// Checks that `prev`, the segment before segment `seq`, is as long as
/// `seq`'s header says it was when it was sealed.
fn check_sealed_length(prev: &FoundSegment, sealed_len: u64, seq: u64) -> Result<()> {
    if prev.valid_len < sealed_len {
        return Err(StorageError::lost(
            &prev.path,
            format!("{sealed_len} bytes (its length when it was sealed, as segment {seq} records)"),
            prev.describe(),
        ));
    }
    if prev.valid_len > sealed_len {
        return Err(StorageError::corrupt(
            &prev.path,
            sealed_len,
            format!(
                "the segment goes on past {sealed_len} bytes, its length when it was sealed \
                 (as segment {seq} records)"
            ),
        ));
    }
    Ok(())
}

/// A group's vote, if it has one worth recording in the state file.
fn vote_worth_keeping((group, hs): (GroupId, HardState)) -> Option<(GroupId, Vote)> {
    (hs.term > 0 || hs.vote.is_some()).then_some((
        group,
        Vote {
            term: hs.term,
            vote: hs.vote,
        },
    ))
}

/// Refuses a log that ends before what it is known to have synced (see the
/// crate documentation, "Knowing what was synced"): the state file vouches
/// for the newest sealed segment and every group's vote, the progress file
/// for the current segment (each segment's header vouches for its
/// predecessor's length; replay checks that). Runs before recovery changes
/// anything, so a refused directory is left as it was found.
fn check_nothing_synced_is_missing(
    dir: &Path,
    state: Option<&LogState>,
    claim: Option<SyncClaim>,
    found: &[FoundSegment],
    groups: &BTreeMap<GroupId, ReplayGroup>,
    ever_removed: &BTreeSet<GroupId>,
    has_snapshots: bool,
) -> Result<()> {
    let Some(state) = state else {
        // No state file: a new directory, or a log from before state files
        // existed (format 1), which is accepted as it is. A log in a newer
        // format always has one, written before its first segment.
        if let Some((version, _)) = found
            .iter()
            .filter_map(|f| f.header)
            .find(|(version, _)| *version > WAL_FORMAT_VERSION_OLDEST)
        {
            return Err(StorageError::lost(
                dir.join(LOG_STATE_FILE),
                format!("the log state file, which every log in format {version} has"),
                "no such file",
            ));
        }
        if has_snapshots && found.iter().all(|f| f.valid_len == 0) {
            return Err(StorageError::lost(
                dir,
                "log segments (this node has snapshots, so it had a log)",
                "no segment with data and no log state file",
            ));
        }
        return Ok(());
    };
    let find = |seq: u64| found.iter().find(|f| f.seq == seq);
    // Claims about older segments are superseded by the state file (those
    // segments are sealed, and may since have been deleted).
    if let Some(c) = claim.filter(|c| c.segment >= state.next_segment && c.len > 0) {
        match find(c.segment) {
            Some(f) if f.valid_len >= c.len => {}
            Some(f) => {
                return Err(StorageError::lost(
                    &f.path,
                    format!("{} bytes synced", c.len),
                    f.describe(),
                ))
            }
            None => {
                return Err(StorageError::lost(
                    dir.join(segment_name(c.segment)),
                    format!("the segment, synced through byte {}", c.len),
                    "no such file",
                ))
            }
        }
    }
    if let Some(s) = state.sealed {
        match find(s.segment) {
            Some(f) if f.valid_len >= s.len => {}
            Some(f) => {
                return Err(StorageError::lost(
                    &f.path,
                    format!("{} bytes (its length when it was sealed)", s.len),
                    f.describe(),
                ))
            }
            // A sealed segment is deleted once no group needs it, which is
            // only after a newer one with a checkpoint of every group was
            // synced.
            None if found.iter().any(|f| f.seq > s.segment && f.valid_len > 0) => {}
            None => {
                return Err(StorageError::lost(
                    dir.join(segment_name(s.segment)),
                    format!("the segment, sealed at {} bytes", s.len),
                    "no such file",
                ))
            }
        }
    }
    let newest = found
        .iter()
        .rev()
        .find(|f| f.valid_len > 0)
        .map_or_else(|| dir.to_path_buf(), |f| f.path.clone());
    for (group, synced) in &state.votes {
        if ever_removed.contains(group) {
            // Removed and perhaps added back since: its term may start over.
            continue;
        }
        let now = groups.get(group).map(|g| Vote {
            term: g.hard_state.term,
            vote: g.hard_state.vote,
        });
        match now {
            Some(now) if synced.is_covered_by(&now) => {}
            now => {
                return Err(StorageError::lost(
                    &newest,
                    format!(
                        "group {group} at term {} with vote {:?}",
                        synced.term, synced.vote
                    ),
                    match now {
                        None => format!("no state for group {group}"),
                        Some(now) => format!("term {} with vote {:?}", now.term, now.vote),
                    },
                ))
            }
        }
    }
    Ok(())
}
