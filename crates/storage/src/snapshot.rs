//! Snapshot files: written in chunks to a temporary file, synced, renamed
//! into place and the directory synced; read back in chunks; every block
//! checksummed.
//!
//! # File format
//!
//! ```text
//! [header frame: len u32 | crc32c u32 | magic "FERRYSNP" | version u32 |
//!                group u64 | snapshot meta | block size u32]
//! [block: data (block size bytes, the last may be shorter) | crc32c u32 of data]*
//! [trailer: data length u64 | block count u64 | magic u32 | crc32c u32 of the
//!           preceding 20 bytes]
//! ```
//!
//! Per-block checksums let a chunk be verified as it is read for a transfer,
//! without reading the whole file. The store keeps the two newest snapshots
//! of each group, so a follower's transfer of the previous one can finish
//! after a new one is taken.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use ferry_raft::{GroupId, Index, SnapshotMeta};

use crate::codec::{
    frame, read_frame, Decoder, Encoder, FrameRead, FRAME_HEADER_BYTES, RECORD_BYTES_MAX,
};
use crate::disk::{Disk, DiskFile, DiskReader};
use crate::error::{Result, StorageError};

/// The magic number at the start of every snapshot file: "FERRYSNP".
const SNAPSHOT_MAGIC: u64 = u64::from_le_bytes(*b"FERRYSNP");
/// The magic number of the trailer.
const TRAILER_MAGIC: u32 = u32::from_le_bytes(*b"FSNE");
const SNAPSHOT_FORMAT_VERSION: u32 = 1;
const TRAILER_BYTES: u64 = 24;
const BLOCK_CRC_BYTES: u64 = 4;
/// The data block size new snapshots are written with.
pub const SNAPSHOT_BLOCK_BYTES: u32 = 64 * 1024;
/// How many snapshots per group the store keeps.
const SNAPSHOTS_KEPT_PER_GROUP: usize = 2;

/// A snapshot file the store knows.
#[derive(Clone, Debug)]
struct SnapshotFile {
    meta: SnapshotMeta,
    path: PathBuf,
    header_bytes: u64,
    block_bytes: u64,
    data_bytes: u64,
}

impl SnapshotFile {
    fn file_offset_of_block(&self, block: u64) -> u64 {
        self.header_bytes + block * (self.block_bytes + BLOCK_CRC_BYTES)
    }

    /// Reads data block `block` with `read_at` and checks its checksum.
    fn read_block(
        &self,
        block: u64,
        read_at: impl FnOnce(u64, &mut [u8]) -> std::io::Result<()>,
    ) -> Result<Vec<u8>> {
        let start = block.saturating_mul(self.block_bytes);
        let len = self.block_bytes.min(self.data_bytes.saturating_sub(start));
        let at = self.file_offset_of_block(block);
        let mut buf = vec![0u8; (len + BLOCK_CRC_BYTES) as usize];
        read_at(at, &mut buf).map_err(|e| StorageError::opening("read snapshot", &self.path, e))?;
        let (data, crc) = buf.split_at(len as usize);
        let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        if crc32c::crc32c(data) != stored {
            return Err(StorageError::corrupt(
                &self.path,
                at,
                format!("checksum mismatch in snapshot block {block}"),
            ));
        }
        buf.truncate(len as usize);
        Ok(buf)
    }
}

fn file_name(group: GroupId, meta: &SnapshotMeta) -> String {
    format!("g{group:020}-i{:020}-t{:020}.snap", meta.index, meta.term)
}

fn parse_group(name: &str) -> Option<GroupId> {
    let rest = name.strip_prefix('g')?.strip_suffix(".snap")?;
    rest.get(..20)?.parse().ok()
}

/// The snapshots of every group on this node.
#[derive(Debug)]
pub struct SnapshotStore<D: Disk> {
    disk: D,
    dir: PathBuf,
    /// Per group, oldest first, at most [`SNAPSHOTS_KEPT_PER_GROUP`].
    groups: BTreeMap<GroupId, Vec<SnapshotFile>>,
}

/// A snapshot being written. Hand it to [`SnapshotStore::finish`] (or
/// [`crate::Storage::install_snapshot`]) once every chunk is written; dropping
/// it leaves a temporary file that the next open removes.
#[derive(Debug)]
pub struct SnapshotWriter<D: Disk> {
    disk: D,
    group: GroupId,
    meta: SnapshotMeta,
    tmp_path: PathBuf,
    file: D::File,
    block: Vec<u8>,
    data_bytes: u64,
    blocks: u64,
    header_bytes: u64,
    /// Whether the trailer is written and the file synced (see
    /// [`SnapshotWriter::seal`]).
    sealed: bool,
}

impl<D: Disk> SnapshotWriter<D> {
    /// The group the snapshot belongs to.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// The snapshot's metadata.
    pub fn meta(&self) -> &SnapshotMeta {
        &self.meta
    }

    /// Bytes of snapshot data written so far (the next chunk's offset).
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// Appends a chunk that starts at `offset` of the snapshot data.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        if self.sealed {
            return Err(StorageError::SnapshotSealed {
                group: self.group,
                index: self.meta.index,
            });
        }
        if offset != self.data_bytes {
            return Err(StorageError::SnapshotChunkOutOfOrder {
                group: self.group,
                index: self.meta.index,
                offset,
                expected: self.data_bytes,
            });
        }
        let mut rest = data;
        while !rest.is_empty() {
            let room = SNAPSHOT_BLOCK_BYTES as usize - self.block.len();
            let (now, later) = rest.split_at(room.min(rest.len()));
            self.block.extend_from_slice(now);
            self.data_bytes += now.len() as u64;
            rest = later;
            if self.block.len() == SNAPSHOT_BLOCK_BYTES as usize {
                self.write_block()?;
            }
        }
        Ok(())
    }

    /// Completes the file: writes the last block and the trailer and syncs
    /// the data. This is the slow part of finishing a snapshot (a sync of
    /// the whole file), and it touches only this writer's file, so a caller
    /// can run it on another thread before handing the writer to
    /// [`SnapshotStore::finish`], which otherwise seals it itself. No chunk
    /// can be written after.
    pub fn seal(&mut self) -> Result<()> {
        if self.sealed {
            return Ok(());
        }
        if !self.block.is_empty() {
            self.write_block()?;
        }
        let mut trailer = Vec::with_capacity(TRAILER_BYTES as usize);
        trailer.extend_from_slice(&self.data_bytes.to_le_bytes());
        trailer.extend_from_slice(&self.blocks.to_le_bytes());
        trailer.extend_from_slice(&TRAILER_MAGIC.to_le_bytes());
        let crc = crc32c::crc32c(&trailer);
        trailer.extend_from_slice(&crc.to_le_bytes());
        self.file
            .append(&trailer)
            .map_err(|e| StorageError::creating("write snapshot", &self.tmp_path, e))?;
        self.file
            .sync_data()
            .map_err(|e| StorageError::creating("sync snapshot", &self.tmp_path, e))?;
        self.sealed = true;
        Ok(())
    }

    /// The file's layout, as it will be once sealed, at `path`.
    fn layout(&self, path: PathBuf) -> SnapshotFile {
        SnapshotFile {
            meta: self.meta.clone(),
            path,
            header_bytes: self.header_bytes,
            block_bytes: SNAPSHOT_BLOCK_BYTES as u64,
            data_bytes: self.data_bytes,
        }
    }

    /// A reader of the data written, once sealed: every block verified as
    /// it is read, from disk, so that a received snapshot is restored from
    /// its file in the memory of one block rather than held whole. The
    /// reader keeps reading its file when [`SnapshotStore::finish`] moves
    /// it into place.
    pub fn data_reader(&self) -> Result<SnapshotDataReader<D>> {
        if !self.sealed {
            return Err(StorageError::InvalidRequest {
                group: self.group,
                reason: format!(
                    "snapshot {} is still being received; it can be read once sealed",
                    self.meta.index
                ),
            });
        }
        let reader = self
            .disk
            .open_read(&self.tmp_path)
            .map_err(|e| StorageError::opening("open snapshot", &self.tmp_path, e))?;
        Ok(SnapshotDataReader {
            file: self.layout(self.tmp_path.clone()),
            reader,
            next_block: 0,
            current: Vec::new(),
            position: 0,
        })
    }

    fn write_block(&mut self) -> Result<()> {
        let crc = crc32c::crc32c(&self.block);
        self.block.extend_from_slice(&crc.to_le_bytes());
        self.file
            .append(&self.block)
            .map_err(|e| StorageError::creating("write snapshot", &self.tmp_path, e))?;
        self.block.clear();
        self.blocks += 1;
        Ok(())
    }
}

/// The data of a sealed snapshot file, read in order one verified block at
/// a time (see [`SnapshotWriter::data_reader`]). A damaged block is an
/// [`std::io::ErrorKind::InvalidData`] error naming the file and offset.
#[derive(Debug)]
pub struct SnapshotDataReader<D: Disk> {
    file: SnapshotFile,
    reader: D::Reader,
    next_block: u64,
    /// The block being read, and how far.
    current: Vec<u8>,
    position: usize,
}

impl<D: Disk> SnapshotDataReader<D> {
    /// The snapshot's size: the bytes this reader yields in all.
    pub fn data_bytes(&self) -> u64 {
        self.file.data_bytes
    }
}

impl<D: Disk> std::io::Read for SnapshotDataReader<D> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.position == self.current.len() {
            let start = self.next_block.saturating_mul(self.file.block_bytes);
            if start >= self.file.data_bytes {
                return Ok(0);
            }
            let reader = &self.reader;
            self.current = self
                .file
                .read_block(self.next_block, |at, buf| reader.read_exact_at(at, buf))
                .map_err(|e| match e {
                    StorageError::Corrupt { .. } => {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
                    }
                    other => std::io::Error::other(other.to_string()),
                })?;
            self.position = 0;
            self.next_block += 1;
        }
        let count = out.len().min(self.current.len() - self.position);
        out[..count].copy_from_slice(&self.current[self.position..self.position + count]);
        self.position += count;
        Ok(count)
    }
}

impl<D: Disk> SnapshotStore<D> {
    /// Opens (or creates) the store in `dir`, removes leftover temporary
    /// files, and verifies every block of each group's latest snapshot.
    pub fn open(disk: D, dir: &Path) -> Result<SnapshotStore<D>> {
        crate::disk::create_dir_durably(&disk, dir)?;
        let names = disk
            .list_files(dir)
            .map_err(|e| StorageError::io("list directory", dir, e))?;
        let mut groups: BTreeMap<GroupId, Vec<SnapshotFile>> = BTreeMap::new();
        for name in names {
            let path = dir.join(&name);
            if name.ends_with(".snap.tmp") {
                disk.remove_file(&path)
                    .map_err(|e| StorageError::io("remove temporary snapshot", &path, e))?;
                continue;
            }
            let Some(group) = parse_group(&name) else {
                continue;
            };
            let file = read_layout(&disk, &path, group)?;
            groups.entry(group).or_default().push(file);
        }
        // What open reports must be durable: a rename whose directory sync
        // never happened (a restart between the two) is made durable now.
        disk.sync_dir(dir)
            .map_err(|e| StorageError::io("sync directory", dir, e))?;
        let mut store = SnapshotStore {
            disk,
            dir: dir.to_path_buf(),
            groups: BTreeMap::new(),
        };
        for (group, mut files) in groups {
            files.sort_by_key(|f| (f.meta.index, f.meta.term));
            store.groups.insert(group, files);
            store.prune(group)?;
            if let Some(latest) = store.groups.get(&group).and_then(|f| f.last()) {
                let blocks = latest.data_bytes.div_ceil(latest.block_bytes);
                for block in 0..blocks {
                    store.read_block(latest, block)?;
                }
            }
        }
        Ok(store)
    }

    /// The latest snapshot of each group.
    pub fn latest_all(&self) -> BTreeMap<GroupId, SnapshotMeta> {
        self.groups
            .iter()
            .filter_map(|(g, files)| Some((*g, files.last()?.meta.clone())))
            .collect()
    }

    /// The latest snapshot of `group`.
    pub fn latest(&self, group: GroupId) -> Option<&SnapshotMeta> {
        self.groups.get(&group)?.last().map(|f| &f.meta)
    }

    /// The size of the data of `group`'s snapshot at `index`, if the store has it.
    pub fn data_bytes(&self, group: GroupId, index: Index) -> Option<u64> {
        self.find(group, index).map(|f| f.data_bytes)
    }

    fn find(&self, group: GroupId, index: Index) -> Option<&SnapshotFile> {
        self.groups
            .get(&group)?
            .iter()
            .rev()
            .find(|f| f.meta.index == index)
    }

    /// Starts writing a snapshot of `group` to a temporary file. Refuses a
    /// snapshot older than the latest one.
    pub fn begin(&self, group: GroupId, meta: SnapshotMeta) -> Result<SnapshotWriter<D>> {
        if !crate::codec::config_fits(&meta.config) {
            return Err(StorageError::InvalidRequest {
                group,
                reason: format!(
                    "snapshot configuration lists more than {} members in one set",
                    crate::codec::CONFIG_MEMBERS_MAX
                ),
            });
        }
        if let Some(latest) = self.latest(group) {
            if meta.index < latest.index {
                return Err(StorageError::InvalidRequest {
                    group,
                    reason: format!(
                        "snapshot at {} is older than the latest one at {}",
                        meta.index, latest.index
                    ),
                });
            }
        }
        let tmp_path = self.dir.join(format!("{}.tmp", file_name(group, &meta)));
        let file = self
            .disk
            .create(&tmp_path)
            .map_err(|e| StorageError::creating("create snapshot", &tmp_path, e))?;
        let mut enc = Encoder::default();
        enc.u64(SNAPSHOT_MAGIC);
        enc.u32(SNAPSHOT_FORMAT_VERSION);
        enc.u64(group);
        enc.snapshot_meta(&meta);
        enc.u32(SNAPSHOT_BLOCK_BYTES);
        let mut header = Vec::new();
        frame(&mut header, &enc.into_inner());
        file.append(&header)
            .map_err(|e| StorageError::creating("write snapshot", &tmp_path, e))?;
        Ok(SnapshotWriter {
            disk: self.disk.clone(),
            group,
            meta,
            tmp_path,
            file,
            block: Vec::with_capacity(SNAPSHOT_BLOCK_BYTES as usize + 4),
            data_bytes: 0,
            blocks: 0,
            header_bytes: header.len() as u64,
            sealed: false,
        })
    }

    /// Completes a snapshot: seals the file (unless the caller did, see
    /// [`SnapshotWriter::seal`]), renames it into place and syncs the
    /// directory. When this returns, the snapshot survives a crash. Older
    /// snapshots beyond the two newest are deleted.
    pub fn finish(&mut self, mut writer: SnapshotWriter<D>) -> Result<SnapshotMeta> {
        writer.seal()?;
        let tmp = writer.tmp_path.clone();
        let path = self.dir.join(file_name(writer.group, &writer.meta));
        self.disk
            .rename(&tmp, &path)
            .map_err(|e| StorageError::io("rename snapshot", &tmp, e))?;
        // Out of descriptors here (the directory is opened to be synced)
        // leaves a complete snapshot in place that this store does not
        // list: harmless, the next open finds it, and a caller may take
        // the snapshot again.
        self.disk
            .sync_dir(&self.dir)
            .map_err(|e| StorageError::opening("sync directory", &self.dir, e))?;
        let file = writer.layout(path.clone());
        let files = self.groups.entry(writer.group).or_default();
        files.retain(|f| f.path != path);
        files.push(file);
        files.sort_by_key(|f| (f.meta.index, f.meta.term));
        self.prune(writer.group)?;
        Ok(writer.meta)
    }

    /// Gives up on a snapshot being written and removes its temporary
    /// file, so that a snapshot abandoned for lack of space gives the space
    /// back at once. Best effort: a file left behind is removed by the next
    /// open.
    pub fn abandon(&self, writer: SnapshotWriter<D>) {
        let tmp = writer.tmp_path.clone();
        drop(writer);
        let _ = self.disk.remove_file(&tmp);
    }

    fn prune(&mut self, group: GroupId) -> Result<()> {
        let Some(files) = self.groups.get_mut(&group) else {
            return Ok(());
        };
        while files.len() > SNAPSHOTS_KEPT_PER_GROUP {
            let old = files.remove(0);
            // Not synced: if the removal is lost in a crash, the next open
            // prunes the file again.
            self.disk
                .remove_file(&old.path)
                .map_err(|e| StorageError::io("remove old snapshot", &old.path, e))?;
        }
        Ok(())
    }

    /// Removes every snapshot of `group`.
    pub fn remove_group(&mut self, group: GroupId) -> Result<()> {
        for f in self.groups.remove(&group).unwrap_or_default() {
            self.disk
                .remove_file(&f.path)
                .map_err(|e| StorageError::io("remove snapshot", &f.path, e))?;
        }
        self.disk
            .sync_dir(&self.dir)
            .map_err(|e| StorageError::io("sync directory", &self.dir, e))
    }

    fn read_block(&self, file: &SnapshotFile, block: u64) -> Result<Vec<u8>> {
        file.read_block(block, |at, buf| {
            self.disk.read_exact_at(&file.path, at, buf)
        })
    }

    /// Reads up to `size_bytes_max` bytes (at least one, if any remain) of
    /// `group`'s snapshot at `index` from `offset`, verified. Returns the
    /// chunk and whether it is the last, or `None` if the store no longer
    /// has that snapshot.
    pub fn read_chunk(
        &self,
        group: GroupId,
        index: Index,
        offset: u64,
        size_bytes_max: u64,
    ) -> Result<Option<(Bytes, bool)>> {
        let Some(file) = self.find(group, index) else {
            return Ok(None);
        };
        if offset > file.data_bytes {
            return Err(StorageError::InvalidRequest {
                group,
                reason: format!(
                    "snapshot {index} has {} bytes; cannot read from offset {offset}",
                    file.data_bytes
                ),
            });
        }
        let end = file
            .data_bytes
            .min(offset.saturating_add(size_bytes_max.max(1)));
        let mut out = Vec::with_capacity((end - offset) as usize);
        let mut pos = offset;
        while pos < end {
            let block = pos / file.block_bytes;
            let data = self.read_block(file, block)?;
            let from = (pos - block * file.block_bytes) as usize;
            let to = ((end - block * file.block_bytes) as usize).min(data.len());
            out.extend_from_slice(&data[from..to]);
            pos += (to - from) as u64;
        }
        Ok(Some((Bytes::from(out), end == file.data_bytes)))
    }

    /// The whole data of `group`'s snapshot at `index`, verified (to restore
    /// the state machine), or `None` if the store does not have it.
    pub fn read_all(&self, group: GroupId, index: Index) -> Result<Option<Vec<u8>>> {
        let Some(size) = self.data_bytes(group, index) else {
            return Ok(None);
        };
        Ok(self
            .read_chunk(group, index, 0, size)?
            .map(|(data, _)| data.to_vec()))
    }
}

/// Reads and checks a snapshot file's header and trailer.
fn read_layout<D: Disk>(disk: &D, path: &Path, group: GroupId) -> Result<SnapshotFile> {
    let corrupt = |offset: u64, reason: String| StorageError::corrupt(path, offset, reason);
    let file_bytes = disk
        .file_len(path)
        .map_err(|e| StorageError::io("stat snapshot", path, e))?;
    let mut head = [0u8; FRAME_HEADER_BYTES];
    if file_bytes < FRAME_HEADER_BYTES as u64 + TRAILER_BYTES {
        return Err(corrupt(
            0,
            format!("snapshot file of {file_bytes} bytes is too short"),
        ));
    }
    disk.read_exact_at(path, 0, &mut head)
        .map_err(|e| StorageError::io("read snapshot", path, e))?;
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as u64;
    if len > RECORD_BYTES_MAX || FRAME_HEADER_BYTES as u64 + len + TRAILER_BYTES > file_bytes {
        return Err(corrupt(
            0,
            format!("snapshot header length {len} does not fit the file"),
        ));
    }
    let mut header = vec![0u8; FRAME_HEADER_BYTES + len as usize];
    disk.read_exact_at(path, 0, &mut header)
        .map_err(|e| StorageError::io("read snapshot", path, e))?;
    let FrameRead::Valid { start, end } = read_frame(&header, 0) else {
        return Err(corrupt(0, "snapshot header checksum mismatch".to_string()));
    };
    let mut d = Decoder::new(Bytes::copy_from_slice(&header[start..end]));
    let decoded = (|| {
        if d.u64()? != SNAPSHOT_MAGIC {
            return Err(crate::error::DecodeError::Invalid("not a snapshot file"));
        }
        if d.u32()? != SNAPSHOT_FORMAT_VERSION {
            return Err(crate::error::DecodeError::Invalid(
                "unsupported snapshot format version",
            ));
        }
        let file_group = d.u64()?;
        let meta = d.snapshot_meta()?;
        let block = d.u32()?;
        d.finish()?;
        Ok((file_group, meta, block))
    })();
    let (file_group, meta, block_bytes) =
        decoded.map_err(|e| corrupt(FRAME_HEADER_BYTES as u64, e.to_string()))?;
    if file_group != group {
        return Err(corrupt(
            0,
            format!("snapshot of group {file_group} in a file named for group {group}"),
        ));
    }
    if block_bytes == 0 {
        return Err(corrupt(0, "snapshot block size 0".to_string()));
    }
    let trailer_at = file_bytes - TRAILER_BYTES;
    let mut trailer = [0u8; TRAILER_BYTES as usize];
    disk.read_exact_at(path, trailer_at, &mut trailer)
        .map_err(|e| StorageError::io("read snapshot", path, e))?;
    let word = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&trailer[i..i + 8]);
        u64::from_le_bytes(a)
    };
    let (data_bytes, blocks) = (word(0), word(8));
    let magic = u32::from_le_bytes([trailer[16], trailer[17], trailer[18], trailer[19]]);
    let crc = u32::from_le_bytes([trailer[20], trailer[21], trailer[22], trailer[23]]);
    if magic != TRAILER_MAGIC || crc32c::crc32c(&trailer[..20]) != crc {
        return Err(corrupt(trailer_at, "snapshot trailer damaged".to_string()));
    }
    let block_bytes = block_bytes as u64;
    let header_bytes = header.len() as u64;
    let expected = data_bytes
        .div_ceil(block_bytes)
        .checked_mul(BLOCK_CRC_BYTES)
        .and_then(|c| c.checked_add(data_bytes))
        .and_then(|b| b.checked_add(header_bytes + TRAILER_BYTES));
    if blocks != data_bytes.div_ceil(block_bytes) || expected != Some(file_bytes) {
        return Err(corrupt(
            trailer_at,
            format!("snapshot trailer ({data_bytes} bytes in {blocks} blocks) does not match the file size {file_bytes}"),
        ));
    }
    Ok(SnapshotFile {
        meta,
        path: path.to_path_buf(),
        header_bytes,
        block_bytes,
        data_bytes,
    })
}
