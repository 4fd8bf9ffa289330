//! One sorted run: an immutable file of records in (key, version) order.
//!
//! ```text
//! block*   index   footer
//! block  := record* crc32c(block)            (about BLOCK_BYTES_TARGET each)
//! record := key (u32 len + bytes) | version u64 | flags u8 | value (u32 len + bytes)
//! index  := count u32 | (first_key, offset u64, len u32, records u32,
//!                        min_version u64, max_version u64)*
//!           last_key (u32 len + bytes) | filter crc32c(index)
//! footer := magic u64 | format u32 | index_offset u64 | index_len u64
//!           | records u64 | min_version u64 | max_version u64 | crc32c(footer)
//! ```
//!
//! Little-endian throughout. A run is written once, synced, and only then
//! named in the manifest, so a run the manifest names is whole; its
//! checksums catch a disk that damages it later, and every length read
//! from it is checked against the file before anything is allocated.
//! The index (one entry per block), the last key and the key filter
//! ([`super::filter`]) are the only parts kept in memory: a point lookup
//! of a key outside the run's key range or refused by its filter reads no
//! block, and one that reads a block compares keys in place and builds
//! only the record it returns.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use super::filter::{key_hash, KeyFilter};
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

/// Bytes a run is written past its last sync before it is synced again
/// while being written. Why: left to the kernel, a run of gigabytes (a
/// merge of large runs, a state received whole) sits dirty in the page
/// cache until the sync that ends it, which then writes all of it at once,
/// and every sync of the Raft log on the same disk (each acknowledged put
/// waits for one) waits behind that writeback for seconds. Synced as it
/// goes, a log sync waits behind a few MiB at most.
pub const RUN_SYNC_BYTES: u64 = 8 * 1024 * 1024;

const MAGIC: u64 = u64::from_le_bytes(*b"FERRYRUN");
/// Format 2 added the last key and the key filter to the index.
const FORMAT: u32 = 2;
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
    /// The offset up to which the file was last synced.
    synced_offset: u64,
    /// The last record's key (a copy, reused) and version, for the order
    /// check.
    last: Option<(Vec<u8>, u64)>,
    /// One [`key_hash`] per distinct key, for the filter.
    key_hashes: Vec<u32>,
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
            synced_offset: 0,
            last: None,
            key_hashes: Vec::new(),
            summary: RunSummary {
                records: 0,
                min_version: 0,
                max_version: 0,
                file_bytes: 0,
            },
        })
    }

    /// Bytes written to the file so far (the block being filled not
    /// included).
    pub fn bytes_written(&self) -> u64 {
        self.offset
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
        let new_key = self
            .last
            .as_ref()
            .is_none_or(|(key, _)| key.as_slice() != record.key.as_ref());
        if new_key {
            self.key_hashes.push(key_hash(&record.key));
        }
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
        if self.offset - self.synced_offset >= RUN_SYNC_BYTES {
            self.file
                .sync_data()
                .map_err(|e| StorageError::io("sync run", &self.path, e))?;
            self.synced_offset = self.offset;
        }
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
        enc.bytes(
            self.last
                .as_ref()
                .map_or(&[][..], |(key, _)| key.as_slice()),
        );
        KeyFilter::build(&self.key_hashes).encode(&mut enc);
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
    /// The key of its last record (empty when the run is).
    last_key: Bytes,
    filter: KeyFilter,
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
        let (index, last_key, filter) = (|| -> std::result::Result<_, DecodeError> {
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
            let last_key = d.bytes("last key", KEY_BYTES_MAX)?;
            let filter = KeyFilter::decode(&mut d, index_len)?;
            d.finish()?;
            Ok((index, last_key, filter))
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
        let key_range_holds = match (index.first(), index.last()) {
            (Some(_), Some(last)) => last.first_key <= last_key,
            (None, None) => last_key.is_empty(),
            _ => false,
        };
        if !key_range_holds {
            return Err(corrupt(
                index_offset,
                "the last key is before a block's first key".to_string(),
            ));
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
            last_key,
            filter,
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

    /// The key of its first record (empty when the run is).
    pub fn first_key(&self) -> &[u8] {
        self.index.first().map_or(&[], |h| h.first_key.as_ref())
    }

    /// The key of its last record (empty when the run is).
    pub fn last_key(&self) -> &[u8] {
        &self.last_key
    }

    /// Its blocks.
    pub fn blocks(&self) -> &[BlockHandle] {
        &self.index
    }

    /// Bytes of the index, last key and key filter kept in memory
    /// (roughly).
    pub fn index_bytes(&self) -> usize {
        let blocks: usize = self
            .index
            .iter()
            .map(|h| h.first_key.len() + std::mem::size_of::<BlockHandle>())
            .sum();
        blocks + self.last_key.len() + self.filter.size_bytes()
    }

    /// False when the run surely holds no version of `key` (outside its
    /// key range, or refused by its filter), without reading a block.
    pub fn may_hold(&self, key: &[u8]) -> bool {
        let Some(first) = self.index.first() else {
            return false;
        };
        first.first_key.as_ref() <= key
            && key <= self.last_key.as_ref()
            && self.filter.may_contain(key)
    }

    /// The body of block `i` (without its checksum), checked against its
    /// checksum.
    fn block_body(&self, i: usize) -> Result<Option<(&BlockHandle, Bytes)>> {
        let Some(handle) = self.index.get(i) else {
            return Ok(None);
        };
        let bytes = read_checked(
            &self.reader,
            &self.path,
            handle.offset,
            u64::from(handle.len),
        )?;
        let body_len = bytes.len().saturating_sub(4);
        let (body, crc) = bytes.split_at(body_len);
        let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        if crc32c::crc32c(body) != stored {
            return Err(self.corrupt_block(handle, "block checksum mismatch".to_string()));
        }
        Ok(Some((handle, bytes.slice(..body_len))))
    }

    fn corrupt_block(&self, handle: &BlockHandle, reason: String) -> StorageError {
        StorageError::Corrupt {
            path: self.path.clone(),
            offset: handle.offset,
            reason,
        }
    }

    /// Calls `visit` with each record of block `i` in order, until it
    /// returns false; then checks that the block held exactly the records
    /// its index entry says, if it was read to the end.
    fn scan_block(
        &self,
        i: usize,
        mut visit: impl FnMut(&Bytes, RecordSpan) -> bool,
    ) -> Result<()> {
        let Some((handle, body)) = self.block_body(i)? else {
            return Ok(());
        };
        let mut d = Decoder::new(body);
        for _ in 0..handle.records {
            let span = RecordSpan::decode(&mut d)
                .map_err(|e| self.corrupt_block(handle, e.to_string()))?;
            if !visit(d.input(), span) {
                return Ok(());
            }
        }
        d.finish()
            .map_err(|e| self.corrupt_block(handle, e.to_string()))
    }

    /// The records of block `i`, checked against its checksum.
    pub fn read_block(&self, i: usize) -> Result<Vec<Record>> {
        // The count comes from the disk: capacity only for what the block
        // could hold.
        let capacity = self.index.get(i).map_or(0, |h| {
            (h.records as usize).min(h.len as usize / RECORD_BYTES_MIN)
        });
        let mut records = Vec::with_capacity(capacity);
        self.scan_block(i, |body, span| {
            records.push(span.record(body));
            true
        })?;
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
        if !self.may_hold(key) {
            return Ok(None);
        }
        let mut found = None;
        let mut past = false;
        let mut i = self.seek_block(key);
        while let Some(handle) = self.index.get(i) {
            if past || handle.first_key.as_ref() > key {
                break;
            }
            if handle.min_version <= version_max {
                // Records are in (key, version) order: the answer is the
                // last of `key` at or below the bound, and the scan stops
                // at the first record past it.
                self.scan_block(i, |body, span| match body[span.key.clone()].cmp(key) {
                    std::cmp::Ordering::Less => true,
                    std::cmp::Ordering::Equal if span.version <= version_max => {
                        found = Some((span, body.clone()));
                        true
                    }
                    std::cmp::Ordering::Equal | std::cmp::Ordering::Greater => {
                        past = true;
                        false
                    }
                })?;
            }
            i += 1;
        }
        // The one record found leaves its block: a copy, so that whoever
        // keeps it (a response, a watch event) does not keep the block.
        Ok(found.map(|(span, body)| span.copied_record(&body)))
    }
}

/// One record of a block, its key and value as spans of the block.
struct RecordSpan {
    key: std::ops::Range<usize>,
    version: u64,
    tombstone: bool,
    value: std::ops::Range<usize>,
}

impl RecordSpan {
    fn decode(d: &mut Decoder) -> std::result::Result<RecordSpan, DecodeError> {
        let key = d.bytes_span("key", KEY_BYTES_MAX)?;
        let version = d.u64()?;
        let flags = d.u8()?;
        let value = d.bytes_span("value", VALUE_BYTES_MAX)?;
        if flags & !FLAG_TOMBSTONE != 0 {
            return Err(DecodeError::UnknownTag {
                what: "record flags",
                tag: flags,
                at: d.position(),
            });
        }
        Ok(RecordSpan {
            key,
            version,
            tombstone: flags & FLAG_TOMBSTONE != 0,
            value,
        })
    }

    /// The record as its own bytes, not sharing the block.
    fn copied_record(self, body: &[u8]) -> Record {
        Record {
            key: Bytes::copy_from_slice(&body[self.key]),
            version: self.version,
            tombstone: self.tombstone,
            value: Bytes::copy_from_slice(&body[self.value]),
        }
    }

    fn record(self, body: &Bytes) -> Record {
        Record {
            key: body.slice(self.key),
            version: self.version,
            tombstone: self.tombstone,
            value: body.slice(self.value),
        }
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
