//! One sorted run: an immutable file of records in (key, version) order.
//!
//! ```text
//! block*   index   footer
//! block  := record* crc32c(block)            (about BLOCK_BYTES_TARGET each)
//! record := key (u32 len + bytes) | version u64 | flags u8 | value (u32 len + bytes)
//! index  := count u32 | (first_key, offset u64, len u32, records u32,
//!                        min_version u64, max_version u64)* crc32c(index)
//! footer := magic u64 | format u32 | index_offset u64 | index_len u64
//!           | records u64 | min_version u64 | max_version u64 | crc32c(footer)
//! ```
//!
//! Little-endian throughout. A run is written once, synced, and only then
//! named in the manifest, so a run the manifest names is whole; its
//! checksums catch a disk that damages it later, and every length read
//! from it is checked against the file before anything is allocated.
//! The index (one entry per block) is the only part kept in memory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use super::Record;
use crate::codec::{Decoder, Encoder};
use crate::disk::{Disk, DiskFile, DiskReader};
use crate::error::{DecodeError, Result, StorageError};

/// What a block is filled to before the next one starts (a record larger
/// than this gets a block of its own).
pub const BLOCK_BYTES_TARGET: usize = 16 * 1024;
/// Largest block a reader accepts (a record of the largest key and value
/// fits).
pub const BLOCK_BYTES_MAX: u64 = 256 * 1024 * 1024;
/// Largest key a run holds.
pub const KEY_BYTES_MAX: u64 = 16 * 1024 * 1024;
/// Largest value a run holds.
pub const VALUE_BYTES_MAX: u64 = 128 * 1024 * 1024;

const MAGIC: u64 = u64::from_le_bytes(*b"FERRYRUN");
const FORMAT: u32 = 1;
const FOOTER_BYTES: u64 = 8 + 4 + 8 + 8 + 8 + 8 + 8 + 4;
const FLAG_TOMBSTONE: u8 = 1;
/// Fewest bytes one record takes (empty key and value).
const RECORD_BYTES_MIN: usize = 4 + 8 + 1 + 4;
/// Fewest bytes one index entry takes (an empty first key).
const INDEX_ENTRY_BYTES_MIN: usize = 4 + 8 + 4 + 4 + 8 + 8;

/// Where one block is and what it holds.
#[derive(Debug, Clone)]
pub struct BlockHandle {
    /// The key of its first record.
    pub first_key: Bytes,
    /// Offset in the file.
    pub offset: u64,
    /// Length including its checksum.
    pub len: u32,
    /// Records in it.
    pub records: u32,
    /// Lowest version in it.
    pub min_version: u64,
    /// Highest version in it.
    pub max_version: u64,
}

/// What a finished run holds, for the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunSummary {
    /// Records in it.
    pub records: u64,
    /// Lowest version in it (0 when empty).
    pub min_version: u64,
    /// Highest version in it (0 when empty).
    pub max_version: u64,
    /// File size in bytes.
    pub file_bytes: u64,
}

/// Writes a run, record by record, in (key, version) order.
pub struct RunWriter<D: Disk> {
    file: D::File,
    path: PathBuf,
    block: Vec<u8>,
    block_first_key: Option<Bytes>,
    block_records: u32,
    block_min_version: u64,
    block_max_version: u64,
    index: Vec<BlockHandle>,
    offset: u64,
    /// The last record's key (a copy, reused) and version, for the order
    /// check.
    last: Option<(Vec<u8>, u64)>,
    summary: RunSummary,
}

impl<D: Disk> std::fmt::Debug for RunWriter<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunWriter")
            .field("path", &self.path)
            .field("records", &self.summary.records)
            .finish_non_exhaustive()
    }
}

impl<D: Disk> RunWriter<D> {
    /// Creates (or replaces) the file at `path`.
    pub fn create(disk: &D, path: &Path) -> Result<RunWriter<D>> {
        let file = disk
            .create(path)
            .map_err(|e| StorageError::io("create run", path, e))?;
        Ok(RunWriter {
            file,
            path: path.to_path_buf(),
            block: Vec::with_capacity(BLOCK_BYTES_TARGET + 4096),
            block_first_key: None,
            block_records: 0,
            block_min_version: u64::MAX,
            block_max_version: 0,
            index: Vec::new(),
            offset: 0,
            last: None,
            summary: RunSummary {
                records: 0,
                min_version: 0,
                max_version: 0,
                file_bytes: 0,
            },
        })
    }

    /// Appends one record; records must come in strictly increasing
    /// (key, version) order.
    pub fn push(&mut self, record: &Record) -> Result<()> {
        if let Some((key, version)) = &self.last {
            let ordered = (key.as_slice(), *version) < (record.key.as_ref(), record.version);
            if !ordered {
                return Err(StorageError::Corrupt {
                    path: self.path.clone(),
                    offset: self.offset,
                    reason: "records pushed out of (key, version) order".to_string(),
                });
            }
        }
        if record.key.len() as u64 > KEY_BYTES_MAX || record.value.len() as u64 > VALUE_BYTES_MAX {
            return Err(StorageError::Corrupt {
                path: self.path.clone(),
                offset: self.offset,
                reason: format!(
                    "a record of {} key bytes and {} value bytes is beyond the run's limits",
                    record.key.len(),
                    record.value.len()
                ),
            });
        }
        if self.block_first_key.is_none() {
            // A copy: the record's key may be a slice of a block read
            // from another run (a merge), which the index would otherwise
            // keep alive whole until the run is finished.
            self.block_first_key = Some(Bytes::copy_from_slice(&record.key));
        }
        let mut enc = Encoder::new(std::mem::take(&mut self.block));
        enc.bytes(&record.key);
        enc.u64(record.version);
        enc.u8(if record.tombstone { FLAG_TOMBSTONE } else { 0 });
        enc.bytes(&record.value);
        self.block = enc.into_inner();
        self.block_records += 1;
        self.block_min_version = self.block_min_version.min(record.version);
        self.block_max_version = self.block_max_version.max(record.version);
        let s = &mut self.summary;
        s.min_version = if s.records == 0 {
            record.version
        } else {
            s.min_version.min(record.version)
        };
        s.max_version = s.max_version.max(record.version);
        s.records += 1;
        match &mut self.last {
            Some((key, version)) => {
                key.clear();
                key.extend_from_slice(&record.key);
                *version = record.version;
            }
            None => self.last = Some((record.key.to_vec(), record.version)),
        }
        if self.block.len() >= BLOCK_BYTES_TARGET {
            self.finish_block()?;
        }
        Ok(())
    }

    fn append(&mut self, bytes: &[u8]) -> Result<()> {
        self.file
            .append(bytes)
            .map_err(|e| StorageError::io("write run", &self.path, e))?;
        self.offset += bytes.len() as u64;
        Ok(())
    }

    fn finish_block(&mut self) -> Result<()> {
        let Some(first_key) = self.block_first_key.take() else {
            return Ok(());
        };
        let crc = crc32c::crc32c(&self.block);
        self.block.extend_from_slice(&crc.to_le_bytes());
        let block = std::mem::take(&mut self.block);
        let handle = BlockHandle {
            first_key,
            offset: self.offset,
            len: u32::try_from(block.len()).unwrap_or(u32::MAX),
            records: self.block_records,
            min_version: self.block_min_version,
            max_version: self.block_max_version,
        };
        self.append(&block)?;
        self.block = block;
        self.block.clear();
        self.index.push(handle);
        self.block_records = 0;
        self.block_min_version = u64::MAX;
        self.block_max_version = 0;
        Ok(())
    }

    /// Writes the index and footer and syncs the file. The run is whole
    /// once this returns; naming it in the manifest makes it part of the
    /// store.
    pub fn finish(mut self) -> Result<RunSummary> {
        self.finish_block()?;
        let index_offset = self.offset;
        let mut enc = Encoder::default();
        enc.u32(u32::try_from(self.index.len()).unwrap_or(u32::MAX));
        for handle in &self.index {
            enc.bytes(&handle.first_key);
            enc.u64(handle.offset);
            enc.u32(handle.len);
            enc.u32(handle.records);
            enc.u64(handle.min_version);
            enc.u64(handle.max_version);
        }
        let mut index = enc.into_inner();
        let crc = crc32c::crc32c(&index);
        index.extend_from_slice(&crc.to_le_bytes());
        self.append(&index)?;
        let mut footer = Encoder::default();
        footer.u64(MAGIC);
        footer.u32(FORMAT);
        footer.u64(index_offset);
        footer.u64(index.len() as u64);
        footer.u64(self.summary.records);
        footer.u64(self.summary.min_version);
        footer.u64(self.summary.max_version);
        let mut footer = footer.into_inner();
        let crc = crc32c::crc32c(&footer);
        footer.extend_from_slice(&crc.to_le_bytes());
        self.append(&footer)?;
        self.file
            .sync_data()
            .map_err(|e| StorageError::io("sync run", &self.path, e))?;
        self.summary.file_bytes = self.offset;
        Ok(self.summary)
    }
}

/// An open run: its index in memory, its blocks read on demand.
#[derive(Debug)]
pub struct Run<D: Disk> {
    reader: D::Reader,
    path: PathBuf,
    index: Vec<BlockHandle>,
    summary: RunSummary,
}

impl<D: Disk> Run<D> {
    /// Opens the run at `path`, checking its footer and index.
    pub fn open(disk: &D, path: &Path) -> Result<Arc<Run<D>>> {
        let reader = disk
            .open_read(path)
            .map_err(|e| StorageError::io("open run", path, e))?;
        let file_bytes = reader
            .file_len()
            .map_err(|e| StorageError::io("open run", path, e))?;
        let corrupt = |offset: u64, reason: String| StorageError::Corrupt {
            path: path.to_path_buf(),
            offset,
            reason,
        };
        if file_bytes < FOOTER_BYTES {
            return Err(corrupt(
                0,
                format!("{file_bytes} bytes: shorter than a footer"),
            ));
        }
        let footer_offset = file_bytes - FOOTER_BYTES;
        let footer = read_checked(&reader, path, footer_offset, FOOTER_BYTES)?;
        let body_len = footer.len() - 4;
        let crc = &footer[body_len..];
        if crc32c::crc32c(&footer[..body_len])
            != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]])
        {
            return Err(corrupt(
                footer_offset,
                "footer checksum mismatch".to_string(),
            ));
        }
        let mut d = Decoder::new(footer.slice(..body_len));
        let decoded = (|| -> std::result::Result<_, DecodeError> {
            Ok((
                d.u64()?,
                d.u32()?,
                d.u64()?,
                d.u64()?,
                d.u64()?,
                d.u64()?,
                d.u64()?,
            ))
        })();
        let (magic, format, index_offset, index_len, records, min_version, max_version) =
            decoded.map_err(|e| corrupt(footer_offset, e.to_string()))?;
        if magic != MAGIC {
            return Err(corrupt(
                footer_offset,
                "not a run file (bad magic)".to_string(),
            ));
        }
        if format != FORMAT {
            return Err(corrupt(
                footer_offset,
                format!("run format {format}; this build reads {FORMAT}"),
            ));
        }
        if index_offset.checked_add(index_len) != Some(footer_offset) || index_len < 8 {
            return Err(corrupt(
                footer_offset,
                format!("index at {index_offset} of {index_len} bytes does not end at the footer"),
            ));
        }
        let index_bytes = read_checked(&reader, path, index_offset, index_len)?;
        let body_len = index_bytes.len() - 4;
        let crc = &index_bytes[body_len..];
        if crc32c::crc32c(&index_bytes[..body_len])
            != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]])
        {
            return Err(corrupt(index_offset, "index checksum mismatch".to_string()));
        }
        let mut d = Decoder::new(index_bytes.slice(..body_len));
        let index = (|| -> std::result::Result<_, DecodeError> {
            let count = d.count("run index entries", u32::MAX as u64, INDEX_ENTRY_BYTES_MIN)?;
            let mut index = Vec::with_capacity(count);
            for _ in 0..count {
                index.push(BlockHandle {
                    first_key: d.bytes("first key", KEY_BYTES_MAX)?,
                    offset: d.u64()?,
                    len: d.u32()?,
                    records: d.u32()?,
                    min_version: d.u64()?,
                    max_version: d.u64()?,
                });
            }
            d.finish()?;
            Ok(index)
        })()
        .map_err(|e| corrupt(index_offset, e.to_string()))?;
        // Blocks must tile the file before the index, in key order.
        let mut expected = 0u64;
        let mut total_records = 0u64;
        for (i, handle) in index.iter().enumerate() {
            if handle.offset != expected || u64::from(handle.len) > BLOCK_BYTES_MAX {
                return Err(corrupt(index_offset, format!("block {i} is misplaced")));
            }
            if i > 0 && index[i - 1].first_key > handle.first_key {
                return Err(corrupt(
                    index_offset,
                    format!("block {i} is out of key order"),
                ));
            }
            expected = expected.saturating_add(u64::from(handle.len));
            total_records = total_records.saturating_add(u64::from(handle.records));
        }
        if expected != index_offset || total_records != records {
            return Err(corrupt(
                index_offset,
                "the index does not match the blocks".to_string(),
            ));
        }
        Ok(Arc::new(Run {
            reader,
            path: path.to_path_buf(),
            index,
            summary: RunSummary {
                records,
                min_version,
                max_version,
                file_bytes,
            },
        }))
    }

    /// What the run holds.
    pub fn summary(&self) -> RunSummary {
        self.summary
    }

    /// Its file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its blocks.
    pub fn blocks(&self) -> &[BlockHandle] {
        &self.index
    }

    /// Bytes of the index kept in memory (roughly).
    pub fn index_bytes(&self) -> usize {
        self.index
            .iter()
            .map(|h| h.first_key.len() + std::mem::size_of::<BlockHandle>())
            .sum()
    }

    /// The records of block `i`, checked against its checksum.
    pub fn read_block(&self, i: usize) -> Result<Vec<Record>> {
        let Some(handle) = self.index.get(i) else {
            return Ok(Vec::new());
        };
        let bytes = read_checked(
            &self.reader,
            &self.path,
            handle.offset,
            u64::from(handle.len),
        )?;
        let corrupt = |reason: String| StorageError::Corrupt {
            path: self.path.clone(),
            offset: handle.offset,
            reason,
        };
        let body_len = bytes.len().saturating_sub(4);
        let (body, crc) = bytes.split_at(body_len);
        let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        if crc32c::crc32c(body) != stored {
            return Err(corrupt("block checksum mismatch".to_string()));
        }
        let mut d = Decoder::new(bytes.slice(..body_len));
        // The count comes from the disk: capacity only for what the block
        // could hold.
        let mut records =
            Vec::with_capacity((handle.records as usize).min(body_len / RECORD_BYTES_MIN));
        for _ in 0..handle.records {
            let record = (|| -> std::result::Result<_, DecodeError> {
                let key = d.bytes("key", KEY_BYTES_MAX)?;
                let version = d.u64()?;
                let flags = d.u8()?;
                let value = d.bytes("value", VALUE_BYTES_MAX)?;
                if flags & !FLAG_TOMBSTONE != 0 {
                    return Err(DecodeError::UnknownTag {
                        what: "record flags",
                        tag: flags,
                        at: d.position(),
                    });
                }
                Ok(Record {
                    key,
                    version,
                    tombstone: flags & FLAG_TOMBSTONE != 0,
                    value,
                })
            })()
            .map_err(|e| corrupt(e.to_string()))?;
            records.push(record);
        }
        d.finish().map_err(|e| corrupt(e.to_string()))?;
        Ok(records)
    }

    /// The first block that may hold `key` (its versions may begin in the
    /// block before the first whose first key is `key`).
    pub fn seek_block(&self, key: &[u8]) -> usize {
        self.index
            .partition_point(|h| h.first_key.as_ref() < key)
            .saturating_sub(1)
    }

    /// The newest version of `key` at or below `version_max`, if this run
    /// holds one.
    pub fn latest(&self, key: &[u8], version_max: u64) -> Result<Option<Record>> {
        let mut found = None;
        let mut i = self.seek_block(key);
        while let Some(handle) = self.index.get(i) {
            if handle.first_key.as_ref() > key {
                break;
            }
            if handle.min_version <= version_max {
                for record in self.read_block(i)? {
                    if record.key.as_ref() == key && record.version <= version_max {
                        found = Some(record);
                    }
                }
            }
            i += 1;
        }
        Ok(found)
    }
}

fn read_checked<R: DiskReader>(reader: &R, path: &Path, offset: u64, len: u64) -> Result<Bytes> {
    let len = usize::try_from(len).map_err(|_| StorageError::Corrupt {
        path: path.to_path_buf(),
        offset,
        reason: format!("a read of {len} bytes"),
    })?;
    let mut buf = vec![0u8; len];
    reader
        .read_exact_at(offset, &mut buf)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => StorageError::Corrupt {
                path: path.to_path_buf(),
                offset,
                reason: format!("{len} bytes expected, the file ends before"),
            },
            _ => StorageError::io("read run", path, e),
        })?;
    Ok(Bytes::from(buf))
}
