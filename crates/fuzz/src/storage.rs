//! The storage layer's decoders: log records, segments and their recovery,
//! the log's state file, snapshot files and the chunks they are written
//! from.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferry_raft::{Configuration, Entry, EntryPayload, GroupId, HardState, PersistRequest};
use ferry_raft::{Index, SnapshotMeta, Term};
use ferry_storage::codec::{
    frame, read_frame, Decoder, Encoder, FrameRead, WalRecord, FRAME_HEADER_BYTES, RECORD_BYTES_MAX,
};
use ferry_storage::log_state::{LogState, SyncClaim};
use ferry_storage::{Disk, DiskFile, SimDisk, SnapshotStore, StorageError, Wal, WalOptions};

use crate::alloc::assert_bounded;
use crate::mutate::{self, Mutation};
use crate::Verdict;

/// Where the targets keep the log on their in-memory disk.
const LOG_DIR: &str = "/fuzz/log";
/// Where the targets keep snapshots on their in-memory disk.
const SNAPSHOT_DIR: &str = "/fuzz/snapshots";
/// The longest one recovery of a fuzzed log may take: recovery's work is
/// bounded by the bytes it reads, and fuzzed logs are small, so a run this
/// long is a hang in the making (an input whose cost grows faster than its
/// size).
const RECOVERY_TIME_MAX: Duration = Duration::from_secs(2);

/// One record of the log, unframed, and the frame around it: a record
/// decodes only from the bytes that encode it (so a changed byte is refused
/// or read as the record those bytes encode), and the same holds for each
/// engine value the log stores (entries, hard states, snapshot metadata,
/// configurations); a frame is valid only with its checksum, and then is
/// exactly its header and payload.
pub fn wal_record(data: &[u8]) -> Verdict {
    let bytes = Bytes::copy_from_slice(data);
    let bound_bytes = 16 * data.len() + 4096;
    let record = assert_bounded("wal_record", data.len(), bound_bytes, || {
        WalRecord::decode(bytes.clone())
    });
    let mut accepted = false;
    if let Ok(record) = &record {
        let mut encoder = Encoder::default();
        record.encode(&mut encoder);
        assert_eq!(
            encoder.into_inner(),
            data,
            "{record:?} decoded from bytes that are not its encoding"
        );
        accepted = true;
    }
    match read_frame(data, 0) {
        FrameRead::Valid { start, end } => {
            assert_eq!(start, FRAME_HEADER_BYTES);
            let mut framed = Vec::new();
            frame(&mut framed, &data[start..end]);
            assert_eq!(
                framed,
                &data[..end],
                "a frame whose checksum does not match"
            );
            accepted = true;
        }
        FrameRead::Incomplete => {
            let whole = data.get(..4).map(|l| {
                FRAME_HEADER_BYTES as u64 + u64::from(u32::from_le_bytes([l[0], l[1], l[2], l[3]]))
            });
            assert!(whole.is_none_or(|whole| whole > data.len() as u64));
        }
        FrameRead::BadLength(len) => assert!(len > RECORD_BYTES_MAX),
        FrameRead::BadChecksum { end } => {
            let mut framed = Vec::new();
            frame(&mut framed, &data[FRAME_HEADER_BYTES..end]);
            assert_ne!(framed, &data[..end]);
        }
    }
    // Each engine value the log stores, from the start of the input.
    type Read = fn(&mut Decoder) -> Result<Vec<u8>, ferry_storage::DecodeError>;
    let readers: [Read; 4] = [
        |d| {
            let entry = d.entry()?;
            let mut e = Encoder::default();
            e.entry(&entry);
            Ok(e.into_inner())
        },
        |d| {
            let hard_state = d.hard_state()?;
            let mut e = Encoder::default();
            e.hard_state(&hard_state);
            Ok(e.into_inner())
        },
        |d| {
            let meta = d.snapshot_meta()?;
            let mut e = Encoder::default();
            e.snapshot_meta(&meta);
            Ok(e.into_inner())
        },
        |d| {
            let config = d.configuration()?;
            let mut e = Encoder::default();
            e.configuration(&config);
            Ok(e.into_inner())
        },
    ];
    for read in readers {
        let mut decoder = Decoder::new(bytes.clone());
        let value = assert_bounded("wal_record", data.len(), bound_bytes, || read(&mut decoder));
        if let Ok(encoded) = value {
            assert_eq!(
                encoded,
                &data[..decoder.position()],
                "a value decoded from bytes that are not its encoding"
            );
        }
    }
    Verdict::accepted_if(accepted)
}

/// The log's state file and its sync progress file: a state decodes only
/// from exactly the bytes that encode it, and the highest claim of a
/// progress file is one that the file holds whole.
pub fn log_state(data: &[u8]) -> Verdict {
    let state = assert_bounded("log_state", data.len(), 16 * data.len() + 4096, || {
        LogState::decode(data)
    });
    let claim = assert_bounded("log_state", data.len(), 2 * data.len() + 4096, || {
        SyncClaim::highest_in(data)
    });
    if let Some(claim) = claim {
        let encoded = claim.encode();
        assert!(
            data.windows(encoded.len()).any(|w| w == encoded),
            "a claim the file does not hold"
        );
    }
    match state {
        Ok(state) => {
            assert_eq!(
                state.encode(),
                data,
                "{state:?} decoded from bytes that are not its encoding"
            );
            Verdict::Accepted
        }
        Err(_) => Verdict::accepted_if(claim.is_some()),
    }
}

fn log_dir() -> &'static Path {
    Path::new(LOG_DIR)
}

/// The options the log targets write and recover with: small segments, so
/// that a few records span several.
pub fn small_log_options() -> WalOptions {
    WalOptions {
        segment_size_bytes_max: 512,
        write_buffer_bytes_max: 256,
        ..WalOptions::default()
    }
}

fn segment_name(seq: u64) -> String {
    format!("{seq:020}.seg")
}

fn write_file(disk: &SimDisk, path: &Path, data: &[u8]) {
    let file = disk.create(path).expect("the in-memory disk creates files");
    file.append(data).expect("the in-memory disk appends");
    file.sync_data().expect("the in-memory disk syncs");
}

/// Opens the log in [`LOG_DIR`] on `disk`, checking that it takes no
/// longer than [`RECOVERY_TIME_MAX`].
fn recover(disk: &SimDisk) -> Result<(Wal<SimDisk>, ferry_storage::WalRecovery), StorageError> {
    let started = Instant::now();
    let opened = Wal::open(
        disk.clone(),
        log_dir(),
        small_log_options(),
        &BTreeMap::new(),
    );
    let took = started.elapsed();
    assert!(
        took <= RECOVERY_TIME_MAX,
        "recovery took {took:?}: its work is not bounded by what it reads"
    );
    opened
}

/// The segment number a segment's header names (where a header would
/// hold it), or 1.
fn segment_number(data: &[u8]) -> u64 {
    // Frame header, record tag, magic, version, then the number.
    const AT: usize = FRAME_HEADER_BYTES + 1 + 8 + 4;
    data.get(AT..AT + 8)
        .map(|n| u64::from_le_bytes([n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7]]))
        .filter(|seq| (1..u64::MAX / 2).contains(seq))
        .unwrap_or(1)
}

/// Recovery of a log whose only segment holds `data` (named for the number
/// its header gives, beside a state file that expects it): it never
/// panics, takes time and memory bounded by the bytes it reads, cuts no
/// more than the segment holds, and what it recovers it recovers again
/// when the log is opened once more (recovery makes the log it accepted
/// whole).
pub fn wal_segment(data: &[u8]) -> Verdict {
    let disk = SimDisk::with_seed(1);
    disk.create_dir_all(log_dir())
        .expect("the in-memory disk creates directories");
    let seq = segment_number(data);
    write_file(&disk, &log_dir().join(segment_name(seq)), data);
    let state = LogState {
        next_segment: seq,
        sealed: None,
        votes: BTreeMap::new(),
    };
    write_file(
        &disk,
        &log_dir().join(ferry_storage::log_state::LOG_STATE_FILE),
        &state.encode(),
    );
    let opened = assert_bounded(
        "wal_segment",
        data.len(),
        32 * data.len() + (4 << 20),
        || recover(&disk),
    );
    match opened {
        Ok((wal, report)) => {
            assert!(report.truncated_bytes <= data.len() as u64);
            drop(wal);
            let (_, again) = recover(&disk).expect("a log recovery accepted opens again");
            assert_eq!(again.groups, report.groups, "a second recovery differs");
            assert_eq!(
                again.truncated_bytes, 0,
                "a second recovery cut the log again"
            );
            Verdict::Accepted
        }
        Err(error) => {
            assert_typed_storage_error(&error);
            Verdict::Refused
        }
    }
}

fn assert_typed_storage_error(error: &StorageError) {
    match error {
        StorageError::Corrupt { .. } | StorageError::LostSyncedData { .. } => {}
        other => panic!("recovery failed with {other}, not as corrupt or lost data"),
    }
}

/// One step of a log written by [`wal_recovery`].
#[derive(Clone, Debug)]
pub enum LogStep {
    /// Appends `count` entries to `group` (at its end, or from `rewind`
    /// entries before it: a new leader's entries replacing a suffix), with
    /// commands of `command_bytes` bytes, and perhaps a new hard state.
    Append {
        /// The group (a few groups share the log).
        group: GroupId,
        /// Entries written before the end that this append replaces.
        rewind: u64,
        /// How many entries.
        count: u64,
        /// The size of each command.
        command_bytes: usize,
        /// Whether the hard state moves on (a new term and a vote).
        new_term: bool,
    },
    /// Compacts `group` through `keep` entries before its end.
    Compact {
        /// The group.
        group: GroupId,
        /// Entries left after the compaction.
        keep: u64,
    },
}

/// What a log written by [`wal_recovery`] ever held, per group: every
/// entry written and every hard state.
#[derive(Default)]
struct Written {
    entries: BTreeSet<(GroupId, Index, Term, Vec<u8>)>,
    last: BTreeMap<GroupId, (Index, Term)>,
    terms: BTreeMap<GroupId, Term>,
    /// Each group's (term, vote) pairs written.
    hard_states: BTreeSet<(GroupId, Term, Option<u64>)>,
    base: BTreeMap<GroupId, Index>,
}

fn command_for(group: GroupId, index: Index, term: Term, command_bytes: usize) -> Vec<u8> {
    // Distinct per entry, so that an entry read from the wrong place shows.
    let mut command = format!("g{group} i{index} t{term} ").into_bytes();
    command.resize(command_bytes.max(command.len()), b'x');
    command
}

/// Writes `steps` through the real log on `disk`, syncing after each.
fn write_log(disk: &SimDisk, steps: &[LogStep], options: WalOptions) -> Written {
    let (mut wal, _) =
        Wal::open(disk.clone(), log_dir(), options, &BTreeMap::new()).expect("a new log opens");
    let mut written = Written::default();
    for (seq, step) in (1u64..).zip(steps) {
        match *step {
            LogStep::Append {
                group,
                rewind,
                count,
                command_bytes,
                new_term,
            } => {
                let (last, last_term) = written.last.get(&group).copied().unwrap_or((0, 0));
                let base = written.base.get(&group).copied().unwrap_or(0);
                let first = last.saturating_sub(rewind).max(base) + 1;
                let mut term = written
                    .terms
                    .get(&group)
                    .copied()
                    .unwrap_or(0)
                    .max(last_term);
                if new_term || term == 0 {
                    term += 1;
                    written.terms.insert(group, term);
                }
                let hard_state = new_term.then_some(HardState {
                    term,
                    vote: Some(1 + term % 3),
                    commit: 0,
                });
                let entries: Vec<Entry> = (first..first + count)
                    .map(|index| Entry {
                        term,
                        index,
                        payload: EntryPayload::Command(Bytes::from(command_for(
                            group,
                            index,
                            term,
                            command_bytes,
                        ))),
                    })
                    .collect();
                let request = PersistRequest {
                    seq,
                    hard_state,
                    entries: entries.clone(),
                };
                if wal.append(group, &request).is_err() {
                    continue;
                }
                if let Some(hard_state) = hard_state {
                    written
                        .hard_states
                        .insert((group, hard_state.term, hard_state.vote));
                }
                for entry in &entries {
                    let EntryPayload::Command(command) = &entry.payload else {
                        unreachable!("only commands are written")
                    };
                    written
                        .entries
                        .insert((group, entry.index, entry.term, command.to_vec()));
                }
                if let Some(entry) = entries.last() {
                    written.last.insert(group, (entry.index, entry.term));
                }
            }
            LogStep::Compact { group, keep } => {
                let Some(&(last, _)) = written.last.get(&group) else {
                    continue;
                };
                let through = last.saturating_sub(keep);
                if through > written.base.get(&group).copied().unwrap_or(0)
                    && wal.compact(group, through).is_ok()
                {
                    written.base.insert(group, through);
                }
            }
        }
        wal.sync().expect("the in-memory disk syncs");
    }
    written
}

/// Recovery of a real log (written through [`Wal`] by `steps`, every step
/// synced) after `damage` to one of its files (`file` picks which, among
/// the segments, the state file and the progress file): it never panics
/// and is bounded in time and memory; it either refuses the log as corrupt
/// or as having lost synced data, or recovers entries and hard states that
/// were each written: a damaged record is never taken for a valid one.
pub fn wal_recovery(steps: &[LogStep], file: usize, damage: &[Mutation]) -> Verdict {
    let disk = SimDisk::with_seed(2);
    let written = write_log(&disk, steps, small_log_options());
    let names = disk.list_files(log_dir()).expect("the log directory lists");
    let Some(name) = names.get(file % names.len().max(1)) else {
        return Verdict::Refused;
    };
    let path = log_dir().join(name);
    let original = disk.read_all(&path).expect("a listed file reads");
    let damaged = mutate::mutated(&original, damage);
    write_file(&disk, &path, &damaged);
    let opened = assert_bounded(
        "wal_recovery",
        damaged.len(),
        64 * written.entries.len() * 256 + (8 << 20),
        || recover(&disk),
    );
    let (_, report) = match opened {
        Ok(opened) => opened,
        Err(error) => {
            assert_typed_storage_error(&error);
            return Verdict::Refused;
        }
    };
    for (group, log) in &report.groups {
        for entry in &log.entries {
            let EntryPayload::Command(command) = &entry.payload else {
                panic!("group {group}: recovered {entry:?}, which was never written");
            };
            assert!(
                written
                    .entries
                    .contains(&(*group, entry.index, entry.term, command.to_vec())),
                "group {group}: recovered {entry:?}, which was never written"
            );
        }
        let hard_state = log.hard_state;
        assert!(
            hard_state == HardState::default()
                || written
                    .hard_states
                    .contains(&(*group, hard_state.term, hard_state.vote)),
            "group {group}: recovered {hard_state:?}, which was never written"
        );
    }
    Verdict::Accepted
}

fn snapshot_dir() -> &'static Path {
    Path::new(SNAPSHOT_DIR)
}

/// The name of the snapshot file [`snapshot_file`] places its input under.
fn snapshot_name(group: GroupId, index: Index, term: Term) -> String {
    format!("g{group:020}-i{index:020}-t{term:020}.snap")
}

/// A snapshot file holding `data`, found by the snapshot store on open:
/// it never panics and holds memory bounded by the file; if the store
/// accepts the file, every byte of its data reads back verified, no more
/// than the file holds.
pub fn snapshot_file(data: &[u8]) -> Verdict {
    let disk = SimDisk::with_seed(3);
    disk.create_dir_all(snapshot_dir())
        .expect("the in-memory disk creates directories");
    write_file(&disk, &snapshot_dir().join(snapshot_name(1, 1, 1)), data);
    let bound_bytes = 8 * data.len() + (1 << 20);
    let opened = assert_bounded("snapshot_file", data.len(), bound_bytes, || {
        SnapshotStore::open(disk.clone(), snapshot_dir())
    });
    let store = match opened {
        Ok(store) => store,
        Err(error) => {
            assert_typed_storage_error(&error);
            return Verdict::Refused;
        }
    };
    let Some(meta) = store.latest(1).cloned() else {
        panic!("the store accepted the file and does not list it");
    };
    let size = store
        .data_bytes(1, meta.index)
        .expect("a listed snapshot has a size");
    assert!(size <= data.len() as u64);
    let all = assert_bounded("snapshot_file", data.len(), bound_bytes, || {
        store.read_all(1, meta.index)
    });
    let all = all
        .expect("an accepted snapshot reads back")
        .expect("a listed snapshot is there");
    assert_eq!(all.len() as u64, size);
    // Chunks read at every offset agree with the whole.
    for offset in [0, 1, size / 2, size.saturating_sub(1), size] {
        let offset = offset.min(size);
        let (chunk, last) = store
            .read_chunk(1, meta.index, offset, 3)
            .expect("an accepted snapshot reads back")
            .expect("a listed snapshot is there");
        let start = offset as usize;
        assert_eq!(&chunk[..], &all[start..start + chunk.len()]);
        assert_eq!(last, start + chunk.len() == all.len());
    }
    Verdict::Accepted
}

/// A snapshot received in chunks (as a follower takes them from the peer
/// wire, each at the offset the leader says) and then the file it became,
/// damaged by `damage`: chunks out of order are refused with a typed error
/// and leave what was written as it was; the sealed file reads back exactly
/// what was accepted; a damaged file is refused or reads back the same.
pub fn snapshot_chunks(
    config: &Configuration,
    chunks: &[(u64, Vec<u8>)],
    damage: &[Mutation],
) -> Verdict {
    let disk = SimDisk::with_seed(4);
    let mut store = SnapshotStore::open(disk.clone(), snapshot_dir()).expect("a new store opens");
    let meta = SnapshotMeta {
        index: 7,
        term: 3,
        config: config.clone(),
    };
    let mut writer = match store.begin(1, meta.clone()) {
        Ok(writer) => writer,
        Err(StorageError::InvalidRequest { .. }) => return Verdict::Refused,
        Err(other) => panic!("beginning a snapshot failed with {other}"),
    };
    let mut accepted = Vec::new();
    for (offset, data) in chunks {
        // Offsets as a peer may send them: anywhere, mostly where expected.
        let offset = if offset % 4 == 0 {
            *offset
        } else {
            accepted.len() as u64
        };
        match writer.write(offset, data) {
            Ok(()) => accepted.extend_from_slice(data),
            Err(StorageError::SnapshotChunkOutOfOrder { expected, .. }) => {
                assert_ne!(offset, expected);
                assert_eq!(expected, accepted.len() as u64);
            }
            Err(other) => panic!("a chunk was refused with {other}"),
        }
    }
    store
        .finish(writer)
        .expect("the in-memory disk writes snapshots");
    let read = store.read_all(1, meta.index).expect("a new snapshot reads");
    assert_eq!(read.as_deref(), Some(&accepted[..]));
    let path = snapshot_dir().join(snapshot_name(1, meta.index, meta.term));
    let original = disk.read_all(&path).expect("the snapshot file reads");
    let damaged = mutate::mutated(&original, damage);
    write_file(&disk, &path, &damaged);
    match SnapshotStore::open(disk.clone(), snapshot_dir()) {
        Ok(store) => {
            let back = store.latest(1).cloned();
            assert_eq!(back.as_ref(), Some(&meta), "a damaged header was accepted");
            let read = store.read_all(1, meta.index);
            let read = read.expect("an accepted snapshot reads back");
            assert_eq!(
                read.as_deref(),
                Some(&accepted[..]),
                "damaged snapshot data was accepted"
            );
            Verdict::accepted_if(damaged == original)
        }
        Err(error) => {
            assert_typed_storage_error(&error);
            assert_ne!(damaged, original, "an undamaged snapshot was refused");
            Verdict::Refused
        }
    }
}

/// Builders of valid encodings, for seeds and for turning a fuzzer's bytes
/// into inputs whose checksums match (so that it explores what lies behind
/// them).
pub mod build {
    use super::*;

    /// Each piece framed as a log record, with its checksum.
    pub fn framed(pieces: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        for piece in pieces {
            frame(&mut out, piece);
        }
        out
    }

    /// Splits `data` into pieces at each `0xF0 0x0F` pair (a separator a
    /// fuzzer learns quickly) and frames each: a log segment or progress
    /// file whose records all pass their checksums.
    pub fn framed_from_fuzz(data: &[u8]) -> Vec<u8> {
        let mut pieces = vec![Vec::new()];
        let mut i = 0;
        while i < data.len() {
            if data[i..].starts_with(&[0xf0, 0x0f]) {
                pieces.push(Vec::new());
                i += 2;
            } else {
                pieces.last_mut().expect("never empty").push(data[i]);
                i += 1;
            }
        }
        framed(&pieces)
    }

    /// The encoding of `record`, unframed.
    pub fn record(record: &WalRecord) -> Vec<u8> {
        let mut encoder = Encoder::default();
        record.encode(&mut encoder);
        encoder.into_inner()
    }

    /// A snapshot file as the store writes it: a header frame holding
    /// `header` (checksummed), `data` in blocks of `block_bytes` (at least
    /// one) each with its checksum, and a trailer that matches.
    pub fn snapshot_file(header: &[u8], block_bytes: usize, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        frame(&mut out, header);
        let mut blocks = 0u64;
        for block in data.chunks(block_bytes.max(1)) {
            out.extend_from_slice(block);
            out.extend_from_slice(&crc32c::crc32c(block).to_le_bytes());
            blocks += 1;
        }
        let mut trailer = Vec::new();
        trailer.extend_from_slice(&(data.len() as u64).to_le_bytes());
        trailer.extend_from_slice(&blocks.to_le_bytes());
        trailer.extend_from_slice(b"FSNE");
        let crc = crc32c::crc32c(&trailer);
        trailer.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&trailer);
        out
    }

    /// The header of a snapshot file of `group` with `meta` and blocks of
    /// `block_bytes`.
    pub fn snapshot_header(group: GroupId, meta: &SnapshotMeta, block_bytes: u32) -> Vec<u8> {
        let mut encoder = Encoder::default();
        encoder.u64(u64::from_le_bytes(*b"FERRYSNP"));
        encoder.u32(1);
        encoder.u64(group);
        encoder.snapshot_meta(meta);
        encoder.u32(block_bytes);
        encoder.into_inner()
    }

    /// A fuzzer's bytes as a snapshot file whose checksums match: a 16-bit
    /// header length, the header, a 16-bit block size, then the data.
    pub fn snapshot_file_from_fuzz(data: &[u8]) -> Vec<u8> {
        let (header, rest) = split_sized(data);
        let (block, rest) = rest.split_at(rest.len().min(2));
        let block_bytes = match block {
            [low, high] => usize::from(u16::from_le_bytes([*low, *high])),
            _ => 1,
        };
        snapshot_file(header, block_bytes, rest)
    }

    /// A 16-bit length and that many bytes off the front of `data` (as
    /// many as there are), and the rest.
    pub(crate) fn split_sized(data: &[u8]) -> (&[u8], &[u8]) {
        let (size, rest) = data.split_at(data.len().min(2));
        let size = match size {
            [low, high] => usize::from(u16::from_le_bytes([*low, *high])),
            _ => 0,
        };
        rest.split_at(size.min(rest.len()))
    }

    /// The files of a real log written by `steps` (segments, state file,
    /// progress file), by name: in segments of 512 bytes if `small`, else
    /// in one.
    pub fn log_files(steps: &[LogStep], small: bool) -> Vec<(String, Vec<u8>)> {
        let disk = SimDisk::with_seed(5);
        let options = if small {
            small_log_options()
        } else {
            WalOptions::default()
        };
        write_log(&disk, steps, options);
        let names = disk.list_files(log_dir()).expect("the log directory lists");
        names
            .into_iter()
            .map(|name| {
                let data = disk
                    .read_all(&log_dir().join(&name))
                    .expect("a listed file reads");
                (name, data)
            })
            .collect()
    }

    /// A snapshot file written by the real store: `data` in chunks of
    /// `chunk_bytes`, with `config`.
    pub fn real_snapshot_file(config: &Configuration, data: &[u8], chunk_bytes: usize) -> Vec<u8> {
        let disk = SimDisk::with_seed(6);
        let mut store =
            SnapshotStore::open(disk.clone(), snapshot_dir()).expect("a new store opens");
        let meta = SnapshotMeta {
            index: 1,
            term: 1,
            config: config.clone(),
        };
        let mut writer = store.begin(1, meta).expect("a snapshot begins");
        let mut offset = 0;
        for chunk in data.chunks(chunk_bytes.max(1)) {
            writer
                .write(offset, chunk)
                .expect("chunks in order are taken");
            offset += chunk.len() as u64;
        }
        store
            .finish(writer)
            .expect("the in-memory disk writes snapshots");
        disk.read_all(&snapshot_dir().join(snapshot_name(1, 1, 1)))
            .expect("the snapshot file reads")
    }
}
