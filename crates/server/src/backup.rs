//! Backups: what etcd's `Maintenance.Snapshot` call streams, what
//! `etcdctl snapshot save` writes to a file from it, and the two things an
//! operator does with such a file (inspect it, restore a new cluster from
//! it).
//!
//! The format: the key-value snapshot encoding the members send each other
//! (magic `FERRYKV1`, the protobuf body, a crc32c of both; see
//! [`crate::kv_state::SnapshotSource`]), zero bytes up to a multiple of 512
//! bytes with the snapshot's length (u64, little-endian) in its last eight,
//! then the 32-byte SHA-256 of everything before it, as etcd appends a
//! SHA-256 to the bbolt file it streams. etcdctl writes the stream to disk
//! unchanged and refuses one whose size is not a multiple of 512 plus the
//! hash (a bbolt file is whole pages), hence the padding. The file is
//! checked twice over: the SHA-256 of the whole and the crc32c and the
//! consistency checks of the snapshot itself.
//!
//! A backup holds the state (every version, the leases, the auth state) at
//! the revision it was taken, and nothing of the cluster it came from:
//! [`restore`] writes it as the state "before the first entry" of a new
//! cluster, whose members are those the new nodes are started with.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use ring::digest::{Context, SHA256};

use crate::error::{CodecError, KvError};
use crate::kv_state::{KvLimits, KvState, SnapshotCheck, SnapshotSource};
use crate::snapshot_reader::SnapshotReader;

/// Bytes of the SHA-256 that ends a backup.
pub const BACKUP_HASH_BYTES: usize = 32;

/// What the bytes before the hash come to a multiple of (etcdctl checks
/// it: its size check is meant for bbolt's pages).
pub const BACKUP_ALIGN_BYTES: u64 = 512;

/// Bytes of the snapshot's length, at the end of the padding.
const LENGTH_BYTES: u64 = 8;

/// The zero bytes that follow a snapshot of `content_bytes` in a backup.
fn padding_bytes(content_bytes: u64) -> u64 {
    (BACKUP_ALIGN_BYTES - (content_bytes + LENGTH_BYTES) % BACKUP_ALIGN_BYTES) % BACKUP_ALIGN_BYTES
}

/// Largest blob of one `SnapshotResponse` (etcd sends 32 KiB; larger blobs
/// cost fewer messages and stay far below any client's message limit).
pub const BACKUP_BLOB_BYTES_MAX: usize = 1024 * 1024;

/// Why a backup could not be taken, read or restored.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// The state could not be read while streaming it.
    #[error("reading the state: {0}")]
    State(#[from] KvError),
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The file is too short to be a backup.
    #[error("{path} is not a ferry backup: {size_bytes} bytes, too short")]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Its size.
        size_bytes: u64,
    },
    /// The SHA-256 at the end of the file does not match what precedes it.
    #[error(
        "{path}: the SHA-256 at its end does not match its contents (stored {stored}, computed {computed}): the file is damaged or incomplete"
    )]
    HashMismatch {
        /// The file.
        path: PathBuf,
        /// The hash the file ends with, in hex.
        stored: String,
        /// The hash of its contents, in hex.
        computed: String,
    },
    /// The file's framing (size, padding, the snapshot's length) is wrong.
    #[error("{path} is not a whole ferry backup: {reason}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The snapshot inside does not decode or is inconsistent.
    #[error("{path}: {source}")]
    Snapshot {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: CodecError,
    },
    /// The data directory to restore into already holds something.
    #[error("{0} exists and is not empty: restore into a new data directory")]
    DataDirInUse(PathBuf),
    /// Whoever received the stream went away.
    #[error("the receiver of the backup went away")]
    ReceiverGone,
}

/// Streams a backup of `source` to `send` in blobs of at most
/// [`BACKUP_BLOB_BYTES_MAX`], each with the bytes that remain after it (the
/// last blob is the SHA-256, with none remaining). Returns the bytes sent.
///
/// The size is computed first, in a pass over the state that encodes
/// nothing, so that `remaining` is exact from the first blob on.
pub fn stream_backup(
    source: &SnapshotSource,
    mut send: impl FnMut(Vec<u8>, u64) -> Result<(), BackupError>,
) -> Result<u64, BackupError> {
    let content_bytes = source.encoded_len()? as u64;
    let mut trailer = vec![0u8; usize::try_from(padding_bytes(content_bytes)).unwrap_or(0)];
    trailer.extend_from_slice(&content_bytes.to_le_bytes());
    let total = content_bytes + trailer.len() as u64 + BACKUP_HASH_BYTES as u64;
    let mut hash = Context::new(&SHA256);
    let mut sent: u64 = 0;
    source.write_to(|piece| -> Result<(), BackupError> {
        hash.update(piece);
        for blob in piece.chunks(BACKUP_BLOB_BYTES_MAX) {
            sent += blob.len() as u64;
            send(blob.to_vec(), total.saturating_sub(sent))?;
        }
        Ok(())
    })?;
    if sent != content_bytes {
        return Err(BackupError::State(KvError::Storage(format!(
            "the snapshot encoded to {sent} bytes, {content_bytes} were expected"
        ))));
    }
    hash.update(&trailer);
    sent += trailer.len() as u64;
    send(trailer, total.saturating_sub(sent))?;
    send(hash.finish().as_ref().to_vec(), 0)?;
    Ok(total)
}

/// What a backup holds (`ferry snapshot status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupInfo {
    /// The store's revision.
    pub revision: i64,
    /// The revision compacted through.
    pub compacted_revision: i64,
    /// Keys that exist at the revision.
    pub keys: u64,
    /// Versions stored (every revision of every key kept).
    pub versions: u64,
    /// Leases.
    pub leases: u64,
    /// Bytes of the file.
    pub size_bytes: u64,
    /// The SHA-256 the file ends with (checked), in hex.
    pub sha256: String,
}

/// Reads the backup at `path` whole, checking its SHA-256, its checksum
/// and its consistency, and says what it holds.
pub fn inspect(path: &Path) -> Result<BackupInfo, BackupError> {
    let mut backup = BackupFile::open(path)?;
    let mut counts = VersionCounts::default();
    // Every check a restore makes, so that a file said to be whole is one
    // that restores.
    let mut check = SnapshotCheck::default();
    let snapshot = {
        let mut reader = SnapshotReader::new(&mut backup).map_err(|e| backup_codec(path, e))?;
        while let Some(version) = reader.next_version().map_err(|e| backup_codec(path, e))? {
            counts.add(&version);
            check.version(version).map_err(|e| backup_codec(path, e))?;
        }
        reader.finish().map_err(|e| backup_codec(path, e))?
    };
    check.finish(&snapshot).map_err(|e| backup.codec(e))?;
    let sha256 = backup.check_hash()?;
    Ok(BackupInfo {
        revision: snapshot.revision,
        compacted_revision: snapshot.compacted_revision,
        keys: counts.keys(),
        versions: counts.versions,
        leases: snapshot.leases.len() as u64,
        size_bytes: backup.size_bytes,
        sha256,
    })
}

/// Restores the backup at `path` into `data_dir` (which must not exist or
/// be empty) as the state of the first member of a new cluster: its
/// versions, revisions, leases and auth state as the backup holds them,
/// standing before the new cluster's first entry, with no member records
/// (the members are those the nodes are started with, and each publishes
/// its own addresses). Every member of the new cluster is restored from
/// the same file. On an error nothing is left in `data_dir`.
pub fn restore(path: &Path, data_dir: &Path, limits: KvLimits) -> Result<BackupInfo, BackupError> {
    match std::fs::read_dir(data_dir) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(BackupError::DataDirInUse(data_dir.to_path_buf()));
            }
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(BackupError::Io {
                path: data_dir.to_path_buf(),
                source,
            })
        }
    }
    // Checked whole first: a damaged file is refused before anything is
    // written.
    let info = inspect(path)?;
    let kv_root = data_dir.join(crate::node::KV_DIR);
    let mut backup = BackupFile::open(path)?;
    let restored = KvState::restore_into_as(
        &mut backup,
        ferry_storage::AnyDisk::Fs(ferry_storage::FsDisk),
        &crate::node::first_store_dir(&kv_root),
        limits,
        |snapshot| {
            // The state before the new cluster's first entry, with none of
            // the old cluster's members nor their alarms.
            snapshot.applied_index = 0;
            snapshot.members.clear();
            snapshot.alarms.clear();
        },
    );
    let checked = match restored {
        Ok(_) => backup.check_hash().map(|_| ()),
        Err(error) => Err(backup.codec(error)),
    };
    if let Err(error) = checked {
        let _ = std::fs::remove_dir_all(&kv_root);
        return Err(error);
    }
    Ok(info)
}

fn backup_codec(path: &Path, source: CodecError) -> BackupError {
    BackupError::Snapshot {
        path: path.to_path_buf(),
        source,
    }
}

/// A backup file read as the snapshot it holds: everything but the
/// SHA-256 at its end, hashed as it is read.
struct BackupFile {
    path: PathBuf,
    file: File,
    size_bytes: u64,
    /// Bytes of snapshot not read yet.
    left: u64,
    /// Bytes of padding and length after it.
    padded_left: u64,
    hash: Context,
}

impl BackupFile {
    fn open(path: &Path) -> Result<BackupFile, BackupError> {
        let failed = |source| BackupError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::open(path).map_err(failed)?;
        let size_bytes = file.metadata().map_err(failed)?.len();
        let malformed = |reason: String| BackupError::Malformed {
            path: path.to_path_buf(),
            reason,
        };
        let Some(padded_bytes) = size_bytes
            .checked_sub(BACKUP_HASH_BYTES as u64)
            .filter(|padded| *padded >= LENGTH_BYTES)
        else {
            return Err(BackupError::TooShort {
                path: path.to_path_buf(),
                size_bytes,
            });
        };
        if padded_bytes % BACKUP_ALIGN_BYTES != 0 {
            return Err(malformed(format!(
                "{size_bytes} bytes is not a multiple of {BACKUP_ALIGN_BYTES} plus the hash: cut or extended"
            )));
        }
        file.seek(SeekFrom::Start(padded_bytes - LENGTH_BYTES))
            .map_err(failed)?;
        let mut length = [0u8; LENGTH_BYTES as usize];
        file.read_exact(&mut length).map_err(failed)?;
        let content_bytes = u64::from_le_bytes(length);
        let fits = content_bytes
            .checked_add(padding_bytes(content_bytes) + LENGTH_BYTES)
            .is_some_and(|whole| whole == padded_bytes);
        if !fits {
            return Err(malformed(format!(
                "it names a snapshot of {content_bytes} bytes, which does not fit its {size_bytes}"
            )));
        }
        file.seek(SeekFrom::Start(0)).map_err(failed)?;
        Ok(BackupFile {
            path: path.to_path_buf(),
            file,
            size_bytes,
            left: content_bytes,
            padded_left: padded_bytes - content_bytes,
            hash: Context::new(&SHA256),
        })
    }

    fn codec(&self, source: CodecError) -> BackupError {
        backup_codec(&self.path, source)
    }

    /// Reads what the snapshot left unread and the stored SHA-256, and
    /// compares; returns the hash in hex.
    fn check_hash(&mut self) -> Result<String, BackupError> {
        let path = self.path.clone();
        let failed = |source| BackupError::Io {
            path: path.clone(),
            source,
        };
        // The snapshot's reader stops at its trailer; nothing may follow
        // it but the hash, which the hash of the whole then shows.
        io::copy(&mut *self, &mut io::sink()).map_err(failed)?;
        let mut padding = vec![0u8; usize::try_from(self.padded_left).unwrap_or(0)];
        self.file.read_exact(&mut padding).map_err(failed)?;
        self.hash.update(&padding);
        let zeros = padding.len().saturating_sub(LENGTH_BYTES as usize);
        if padding[..zeros].iter().any(|b| *b != 0) {
            return Err(BackupError::Malformed {
                path: self.path.clone(),
                reason: "the padding after the snapshot is not zero".into(),
            });
        }
        let mut stored = [0u8; BACKUP_HASH_BYTES];
        self.file.read_exact(&mut stored).map_err(failed)?;
        let computed = self.hash.clone().finish();
        let stored_hex = hex(&stored);
        if computed.as_ref() != &stored[..] {
            return Err(BackupError::HashMismatch {
                path: self.path.clone(),
                stored: stored_hex,
                computed: hex(computed.as_ref()),
            });
        }
        Ok(stored_hex)
    }
}

impl Read for BackupFile {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = usize::try_from(self.left)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        if want == 0 {
            return Ok(0);
        }
        let read = self.file.read(&mut buf[..want])?;
        self.hash.update(&buf[..read]);
        self.left -= read as u64;
        Ok(read)
    }
}

/// Versions and live keys, counted as versions come in key order, oldest
/// first per key.
#[derive(Default)]
struct VersionCounts {
    versions: u64,
    keys_before: u64,
    last_key: Option<Vec<u8>>,
    last_is_live: bool,
}

impl VersionCounts {
    fn add(&mut self, version: &crate::pb::ferrypb::SnapshotVersion) {
        self.versions += 1;
        let key = version.kv.as_ref().map(|kv| kv.key.as_ref()).unwrap_or(&[]);
        if self.last_key.as_deref() != Some(key) {
            self.keys_before += u64::from(self.last_is_live);
            self.last_key = Some(key.to_vec());
        }
        self.last_is_live = !version.tombstone;
    }

    fn keys(&self) -> u64 {
        self.keys_before + u64::from(self.last_is_live)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
