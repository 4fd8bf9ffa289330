//! Typed errors of the storage layer.
//!
//! Every error that comes from disk contents names the file and the byte
//! offset, so that an operator can see what broke; none of them is a panic.

use std::path::PathBuf;

use ferry_raft::{GroupId, Index};

/// Why a byte string could not be decoded into an engine value or a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The input ended before the value did.
    #[error("input ends at byte {at}, but {needed} more bytes were expected")]
    Truncated {
        /// Where the missing bytes would have started.
        at: usize,
        /// How many bytes were missing.
        needed: usize,
    },
    /// A tag byte that no version of the format writes.
    #[error("unknown {what} tag {tag} at byte {at}")]
    UnknownTag {
        /// What kind of value the tag selects.
        what: &'static str,
        /// The tag found.
        tag: u8,
        /// Where it was found.
        at: usize,
    },
    /// A length or count beyond what the format allows.
    #[error("{what} of {len} exceeds the limit of {max}")]
    TooLong {
        /// What was too long.
        what: &'static str,
        /// The length found.
        len: u64,
        /// The largest allowed.
        max: u64,
    },
    /// Bytes left over after a complete value.
    #[error("{count} unexpected bytes after the value")]
    TrailingBytes {
        /// How many bytes were left.
        count: usize,
    },
    /// A structurally valid value that breaks a rule of the format.
    #[error("invalid value: {0}")]
    Invalid(&'static str),
}

/// Everything that can go wrong in the storage layer.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The operating system (or the simulated disk) refused an operation.
    #[error("I/O error: {op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file could not be created or opened because the process or the
    /// system ran out of file descriptors (EMFILE, ENFILE), or a file that
    /// is not yet part of the store (a new segment, a snapshot being
    /// written) could not be created or written for lack of space or quota
    /// (ENOSPC, EDQUOT). Nothing the store holds was changed or lost, so
    /// this is a shortage to wait out and report, not a reason to stop:
    /// see [`StorageError::is_transient`].
    #[error("out of file descriptors or disk space: {op} {path}: {source}")]
    Unavailable {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Data on disk failed its checksum or could not be decoded, somewhere a
    /// torn write cannot explain. The node must not run on it.
    #[error(
        "corrupt data in {path} at byte {offset}: {reason}. This node's data cannot be \
         trusted: stop the node, remove it from its groups through the healthy members, move \
         its data directory aside and add it back as a new member; it then rejoins and \
         receives the state from its peers"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Where the bad data starts.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The log ends before what it is known to have synced: a segment, or a
    /// part of one, that was durable is gone (deleted, replaced by an empty
    /// or zeroed file, truncated, its tail zeroed), or so is the state file
    /// that vouches for the log. Unlike a torn write, this data had been
    /// reported durable, so the node may have forgotten votes it cast and
    /// entries it acknowledged: it must not start (see the crate
    /// documentation, "Knowing what was synced").
    #[error(
        "the log lost data it had synced: {path}: expected {expected}, found {found}. This is \
         not a torn write: the data had been synced, so this node may have forgotten votes it \
         cast and entries it acknowledged, and must not start as a voter. The way back: stop \
         the node, move its data directory aside (keep it for diagnosis), remove it from its \
         groups through the healthy members, then add it back as a new learner and promote it \
         once it has caught up; it rejoins and receives the state from its peers (see \"When \
         the disk lies: the way back\" in the ferry-storage documentation)"
    )]
    LostSyncedData {
        /// The file that lost data (or the missing file, or the log
        /// directory when the whole log is gone).
        path: PathBuf,
        /// What the log is known to have synced there.
        expected: String,
        /// What is there now.
        found: String,
    },
    /// An earlier write or sync failed; after a failed sync the kernel may
    /// have dropped dirty pages, so nothing written since can be trusted.
    #[error("storage stopped after an earlier failure ({0}); restart the node")]
    Poisoned(String),
    /// A request the caller should not have made (a bug in the caller).
    #[error("group {group}: {reason}")]
    InvalidRequest {
        /// The group concerned.
        group: GroupId,
        /// What is wrong with the request.
        reason: String,
    },
    /// The requested entries are not in the log (compacted or never written).
    #[error("group {group}: index {index} is outside the log (first {first}, last {last})")]
    OutOfRange {
        /// The group concerned.
        group: GroupId,
        /// The index asked for.
        index: Index,
        /// The first index the log holds.
        first: Index,
        /// The last index the log holds.
        last: Index,
    },
    /// The group is not known to this storage.
    #[error("group {0} has no state in this storage")]
    UnknownGroup(GroupId),
    /// `prepare_sync` was called while the previous sync has not completed.
    #[error("a sync is already in flight; complete it before preparing the next")]
    SyncInFlight,
    /// A snapshot chunk arrived out of order.
    #[error(
        "snapshot {index} of group {group}: chunk at offset {offset}, expected offset {expected}"
    )]
    SnapshotChunkOutOfOrder {
        /// The group.
        group: GroupId,
        /// The snapshot's index.
        index: Index,
        /// The offset received.
        offset: u64,
        /// The offset expected next.
        expected: u64,
    },
    /// A version written to the version store is not above the versions
    /// its key already has there (a bug in the caller: versions only grow).
    #[error("version {version} written after version {last} of the same key")]
    VersionOutOfOrder {
        /// The version written.
        version: u64,
        /// The key's newest version already held.
        last: u64,
    },
    /// A chunk was written to a snapshot already sealed (complete).
    #[error("snapshot {index} of group {group} is sealed: no more chunks can be written to it")]
    SnapshotSealed {
        /// The group.
        group: GroupId,
        /// The snapshot's index.
        index: Index,
    },
}

impl StorageError {
    /// Wraps an I/O error with what was being done and where.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StorageError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// A lost-synced-data error for `path`.
    pub fn lost(
        path: impl Into<PathBuf>,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        StorageError::LostSyncedData {
            path: path.into(),
            expected: expected.into(),
            found: found.into(),
        }
    }

    /// Wraps the error of an operation that opens an existing file or
    /// directory before it does anything else (a read, a directory sync):
    /// running out of file descriptors can only have come from the open,
    /// and changed nothing, so it is [`StorageError::Unavailable`].
    pub fn opening(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        if is_out_of_descriptors(&source) {
            return StorageError::Unavailable {
                op,
                path: path.into(),
                source,
            };
        }
        StorageError::io(op, path, source)
    }

    /// Wraps the error of creating (or writing) a file that nothing relies
    /// on yet: running out of descriptors, space or quota leaves the store
    /// as it was, so it is [`StorageError::Unavailable`].
    pub fn creating(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        if is_out_of_descriptors(&source) || is_out_of_space(&source) {
            return StorageError::Unavailable {
                op,
                path: path.into(),
                source,
            };
        }
        StorageError::io(op, path, source)
    }

    /// Wraps the error of an append: running out of space or quota left
    /// the file as it was (a failed append is cut back, see
    /// [`crate::disk::DiskFile::append`]), so it is
    /// [`StorageError::Unavailable`]: the same bytes may be appended again
    /// once there is room.
    pub fn appending(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        if is_out_of_space(&source) {
            return StorageError::Unavailable {
                op,
                path: path.into(),
                source,
            };
        }
        StorageError::io(op, path, source)
    }

    /// Whether this is a shortage of disk space or quota (a transient
    /// error: see [`StorageError::is_transient`]).
    pub fn is_out_of_space(&self) -> bool {
        matches!(self, StorageError::Unavailable { source, .. } if is_out_of_space(source))
    }

    /// Whether the caller may wait this error out and try again: only
    /// [`StorageError::Unavailable`], which changed nothing. A failed write
    /// or sync of the log never is (the log poisons itself after one).
    pub fn is_transient(&self) -> bool {
        matches!(self, StorageError::Unavailable { .. })
    }

    /// A corruption error for `path` at `offset`.
    pub fn corrupt(path: impl Into<PathBuf>, offset: u64, reason: impl Into<String>) -> Self {
        StorageError::Corrupt {
            path: path.into(),
            offset,
            reason: reason.into(),
        }
    }
}

/// EMFILE or ENFILE: the process or the whole system has no file
/// descriptor left.
fn is_out_of_descriptors(error: &std::io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// ENOSPC or EDQUOT: no space or quota left on the file system.
pub(crate) fn is_out_of_space(error: &std::io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Shorthand for results of this crate.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_shortages_that_changed_nothing_are_transient() {
        let os = std::io::Error::from_raw_os_error;
        assert!(StorageError::opening("read", "/x", os(libc::EMFILE)).is_transient());
        assert!(StorageError::opening("read", "/x", os(libc::ENFILE)).is_transient());
        // A sync that fails for lack of space may have lost data.
        assert!(!StorageError::opening("sync", "/x", os(libc::ENOSPC)).is_transient());
        assert!(StorageError::creating("create", "/x", os(libc::ENOSPC)).is_transient());
        assert!(StorageError::creating("create", "/x", os(libc::EDQUOT)).is_transient());
        assert!(!StorageError::creating("create", "/x", os(libc::EACCES)).is_transient());
        assert!(!StorageError::io("write", "/x", os(libc::EMFILE)).is_transient());
    }
}
