//! # ferry-storage: durable storage for many Raft groups on one node
//!
//! - [`Wal`]: one write-ahead log per node, shared by every group, with group
//!   commit (one fdatasync covers every group and every record written since
//!   the previous one, and the next batch fills while a sync is in flight).
//!   See the [`wal`] module for the layout, the deletion of old segments, the
//!   threading model and recovery.
//! - [`SnapshotStore`]: snapshot files written in chunks to a temporary file,
//!   synced, renamed and the directory synced; read in verified chunks.
//! - [`Storage`]: both in one data directory, opened and reconciled together;
//!   its [`RecoveryReport`] gives each group's [`ferry_raft::RestoredState`].
//! - [`Disk`]: the filesystem as seen by the storage code, with the real one
//!   ([`FsDisk`]) and a simulated one ([`SimDisk`]: lost unsynced writes, torn
//!   writes, corrupted sectors, slow syncs, all deterministic from a seed).
//! - [`codec`]: the binary format of the engine's types and of log records.
//! - [`log_state`]: the files beside the segments that say what the log had
//!   synced, so that lost synced data is not taken for a torn write.
//!
//! ## Durability contract
//!
//! A [`ferry_raft::PersistRequest`] appended with [`Wal::append`] is durable
//! once a sync prepared after it has completed; [`Wal::complete_sync`] returns
//! the sequence numbers to report as `Input::Persisted`. A snapshot the
//! local state machine built is durable when [`Storage::save_snapshot`]
//! returns; a snapshot installed from a leader ([`Storage::install_snapshot`])
//! after the next completed sync of the log. A group removal
//! ([`Storage::remove_group`]) is durable when it returns.
//!
//! ## Using it from a runtime
//!
//! - Start: [`Storage::open`], then for each group in the report
//!   [`GroupRecovery::restored_state`] gives the engine's
//!   [`ferry_raft::RestoredState`]; restore the state machine from
//!   [`SnapshotStore::read_all`] of the group's snapshot, if any.
//! - `Action::Persist(req)`: [`Wal::append`]. When no sync is in flight and
//!   something was appended: [`Wal::prepare_sync`], run
//!   [`PendingSync::execute`] (a blocking thread in the server; inline in the
//!   simulator), then [`Wal::complete_sync`] and feed each group
//!   `Input::Persisted { seq }` from the map it returns. Appends continue
//!   while the sync runs.
//! - `Action::Compact { through }`: [`Wal::compact`].
//! - Replication reads: [`Wal::entries`] and [`Wal::term`].
//! - `Action::LoadSnapshotChunk`: [`SnapshotStore::read_chunk`] (`None` means
//!   the snapshot is gone: answer `chunk: None`).
//! - `Action::SaveSnapshotChunk`: [`Storage::begin_snapshot`] on offset 0,
//!   [`SnapshotWriter::write`] per chunk, and on the last chunk
//!   [`Storage::install_snapshot`] followed by a log sync before answering
//!   `SnapshotChunkSaved { ok: true }`. A snapshot the local state machine
//!   built goes through [`Storage::save_snapshot`] before
//!   `Input::SnapshotBuilt`.
//! - The simulator: one [`SimDisk`] per node. After [`PendingSync::execute`],
//!   [`SimDisk::take_sync_ticks`] says how long the sync took: deliver
//!   [`Wal::complete_sync`] that many ticks later (slow syncs). A node crash
//!   is [`SimDisk::crash`] with a [`CrashMode`], then [`Storage::open`] again;
//!   [`SimDisk::set_fault_budget`] crashes in the middle of a write;
//!   [`SimDisk::corrupt_random_sector`] damages the disk, after which
//!   [`Storage::open`] (or a read) fails with [`StorageError::Corrupt`] and
//!   the node must take the way back below instead of serving data.
//!
//! ## When the disk lies: the way back
//!
//! Recovery cuts a torn tail (a record cut short, or failing its checksum,
//! at the end of the last segment with no valid record after it) and reports
//! the bytes cut (zeros after the last segment's records are space the log
//! reserved ahead of itself, not a torn write: see "Reserved space" in
//! [`wal`]), unless the log knows those bytes had been synced: then it
//! is [`StorageError::LostSyncedData`] (see "Knowing what was synced"
//! below).
//! Any other damage, in the log or in a snapshot, is
//! [`StorageError::Corrupt`] naming the file and the byte offset, and the
//! node must not start on it (nor on lost synced data). The way back: stop the node and move its data
//! directory aside (keep it for diagnosis); have the healthy members remove
//! the node from each of its groups (a membership change), then add it back
//! as a new learner and promote it once it has caught up. It receives a
//! snapshot and the log from the leaders. Do not simply restart it empty
//! under the same identity: it would have forgotten its votes and could vote
//! twice in one term. Repair one node at a time, so that every group keeps a
//! healthy majority.
//!
//! ## Failed syncs and snapshots: what is promised
//!
//! - A record is durable once a sync prepared after it completed without
//!   error; records synced before a failed sync stay durable and come back
//!   after a restart exactly as written.
//! - After a failed write or fdatasync nothing written since the last
//!   successful sync is promised: the kernel may have dropped those pages or
//!   written some of them. The log refuses all further work
//!   ([`StorageError::Poisoned`]) and the node must stop; it never retries
//!   the sync (a retry could report as durable data that is not). On restart,
//!   recovery finds the synced records plus some of the later ones, and a
//!   damaged record among those later ones is cut as a torn tail if nothing
//!   valid follows it.
//! - A snapshot the local state machine built is durable on its own once
//!   [`Storage::save_snapshot`] returns, independently of the log. The state
//!   machine may apply committed entries before this node synced them, so a
//!   snapshot can cover entries (and be of a term) that the synced log does
//!   not hold, or holds with another term (a conflicting suffix overwritten
//!   since). Recovery then follows Raft: the log after the snapshot is kept
//!   only if it holds the snapshot's own entry with the snapshot's term (or
//!   starts right after it); otherwise the log is discarded and the node
//!   starts from the snapshot alone. The term restored is at least the
//!   snapshot's and that of every entry kept, with no vote if it was raised
//!   that way: a vote is only ever sent once its record is synced, so none
//!   was given in the raised term. (Simulator seeds 16953 and 93901.)
//!
//! One limit remains, narrower than it was: damage to the very end of the
//! log (the last records of the last segment, with nothing valid after
//! them) that no surviving claim of the progress file covers looks exactly
//! like a torn write and is cut, even if those records had been synced.
//! After a process restart the claims vouch for the last synced batch
//! exactly; after a power loss, for the first batch of the current segment
//! and whatever later claims the kernel had written back.
//! [`WalRecovery::truncated_bytes`] makes a cut visible, and the server
//! logs it loudly.
//!
//! ## Knowing what was synced
//!
//! A torn write only damages what was never synced. Anything else that
//! shortens the log loses what the node reported durable (votes it cast,
//! entries it acknowledged), and a node that starts on such a log can vote
//! twice in one term. So the log keeps, beside its segments, what it needs to
//! tell the two apart ([`log_state`] has the formats, [`wal`] where each is
//! written):
//!
//! - each segment's header records the length its predecessor is sealed at;
//! - a state file, replaced atomically on open and once per segment (after a
//!   rotation, by the first sync of the new segment), records the segment
//!   the log writes next, the exact length of the newest sealed one, and
//!   every group's term and vote;
//! - a progress file receives, after each completed sync, an unsynced claim
//!   "segment S is synced through byte L"; the first claim about each new
//!   segment is synced.
//!
//! [`Storage::open`] refuses with [`StorageError::LostSyncedData`] (naming
//! the file, what was known synced and what is there), and leaves the disk
//! as it found it, when a segment that held synced data was deleted or
//! replaced by an empty or zeroed file; when a segment is shorter than a
//! claim or than its sealed length (truncated, or its tail zeroed); when
//! every segment is gone but the state file or snapshots remain; when the
//! state file is gone from a log in the current format; or when a group's
//! term or vote went back. A torn tail of the last, unsynced batch is still
//! cut and reported. A crash at any point (of a run or of a recovery) is
//! never taken for lost synced data: a claim is written only after the sync
//! it describes, and the state file only ever says what is already durable
//! (the crash tests check every write boundary).
//!
//! The cost: per batch, one small write (28 bytes, to the page cache) after
//! the fdatasync, and still one fdatasync; per segment (64 MiB by default),
//! the state file (one fdatasync, a rename and a directory sync) and one
//! fdatasync of the first claim, on the thread that runs the sync; on open,
//! the state file.
//!
//! Old and new directories: a brand-new directory (no state file, no
//! segment, no snapshot) starts empty. A log written before state files
//! existed (format 1: no state file, headers without the predecessor's
//! length) is accepted as it is, since nothing can vouch for it, and gets a
//! state file on open ([`WalRecovery::upgraded_from_format_1`]); from then on
//! it is in format 2, which always has one. A directory with snapshots but
//! neither segments nor a state file is refused. A damaged state file is
//! [`StorageError::Corrupt`] (it is only ever renamed into place whole and
//! synced, so no crash explains it); a damaged or missing progress file only
//! loses claims, since it is a lower bound.
//!
//! Why this design: a synced marker per batch would double the cost of every
//! batch (two fdatasyncs); redundancy inside the segment (a second copy of
//! the last batch's headers) cannot see the file truncated, zeroed or
//! deleted; preallocated fixed-size segments see truncation but not a zeroed
//! tail; fixed slots overwritten in place (like TigerBeetle's superblock
//! copies) need in-place writes, which the [`Disk`] rules (appends, atomic
//! renames) and the simulated disk do not model. An append-only progress
//! file and an atomically replaced state file follow those rules exactly, so
//! the crash tests check them like the log itself. What it cannot see: a
//! whole data directory replaced consistently (restored from an old copy,
//! state file included).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod any_disk;
pub mod cache;
pub mod codec;
pub mod disk;
pub mod error;
pub mod log_state;
pub mod sim_disk;
pub mod snapshot;
pub mod storage;
pub mod versions;
pub mod wal;

pub use any_disk::{AnyDisk, AnyFile, AnyReader};
pub use cache::EntryCache;
pub use disk::{unique_temp_dir, Disk, DiskFile, DiskReader, FsDisk, FsFile, FsReader};
pub use error::{DecodeError, Result, StorageError};
pub use sim_disk::{CrashMode, SimDisk, SimDiskOptions, SimFile, SimReader};
pub use snapshot::{SnapshotDataReader, SnapshotStore, SnapshotWriter};
pub use storage::{GroupRecovery, RecoveryReport, Storage};
pub use wal::{PendingSync, RecoveredLog, Wal, WalOptions, WalRecovery};
