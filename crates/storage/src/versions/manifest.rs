//! The manifest: which runs make up the store, and the durable point they
//! stand for.
//!
//! ```text
//! magic u64 | format u32 | marker u64 | floor u64 | next_run_id u64
//! | meta (u32 len + bytes) | count u32 | (layer_id u64, run_id u64,
//!   records u64, min_version u64, max_version u64, file_bytes u64)*
//! | crc32c
//! ```
//!
//! Runs are listed newest layer first; the runs of one layer (adjacent
//! entries with the same layer id) in key order. Format 1 had no layer id:
//! each run was a layer of its own, and reads so.
//!
//! It is replaced whole: written to `MANIFEST.tmp`, synced, renamed over
//! `MANIFEST`, and the directory synced. A crash leaves either the old
//! manifest or the new one, never a mix; a manifest that fails its
//! checksum was damaged after it was written, and is refused.

use std::path::{Path, PathBuf};

use bytes::Bytes;

use super::run::RunSummary;
use crate::codec::{Decoder, Encoder};
use crate::disk::{Disk, DiskFile};
use crate::error::{DecodeError, Result, StorageError};

/// The manifest's file name.
pub const MANIFEST_FILE: &str = "MANIFEST";
const MANIFEST_TMP_FILE: &str = "MANIFEST.tmp";
const MAGIC: u64 = u64::from_le_bytes(*b"FERRYMAN");
/// Format 2 added the layer id to each run.
const FORMAT: u32 = 2;
const FORMAT_WITHOUT_LAYERS: u32 = 1;
/// Largest caller state kept beside the runs.
pub const META_BYTES_MAX: u64 = 256 * 1024 * 1024;
/// Most runs a manifest names.
pub const RUNS_MAX: u64 = 4096;
const RUN_ENTRY_BYTES: usize = 6 * 8;
const RUN_ENTRY_WITHOUT_LAYER_BYTES: usize = 5 * 8;

/// One run the manifest names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunEntry {
    /// The layer it belongs to (ids are drawn from the run ids).
    pub layer: u64,
    /// Its id (the file is `run-<id>.dat`).
    pub id: u64,
    /// What it holds.
    pub summary: RunSummary,
}

/// The durable description of the store.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Manifest {
    /// The caller's durable point: what the runs hold is everything the
    /// caller wrote up to this marker (for the KV store, an applied log
    /// index).
    pub marker: u64,
    /// Versions at or below this may be dropped when shadowed.
    pub floor: u64,
    /// The id the next run gets.
    pub next_run_id: u64,
    /// The caller's own state at `marker` (small: leases, auth, members).
    pub meta: Bytes,
    /// The runs, newest layer first, each layer's in key order.
    pub runs: Vec<RunEntry>,
}

/// The file name of run `id`.
pub fn run_file_name(id: u64) -> String {
    format!("run-{id:016x}.dat")
}

impl Manifest {
    fn encode(&self) -> Vec<u8> {
        let mut enc = Encoder::default();
        enc.u64(MAGIC);
        enc.u32(FORMAT);
        enc.u64(self.marker);
        enc.u64(self.floor);
        enc.u64(self.next_run_id);
        enc.bytes(&self.meta);
        enc.u32(u32::try_from(self.runs.len()).unwrap_or(u32::MAX));
        for run in &self.runs {
            enc.u64(run.layer);
            enc.u64(run.id);
            enc.u64(run.summary.records);
            enc.u64(run.summary.min_version);
            enc.u64(run.summary.max_version);
            enc.u64(run.summary.file_bytes);
        }
        let mut bytes = enc.into_inner();
        let crc = crc32c::crc32c(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        bytes
    }

    fn decode(bytes: Bytes, path: &Path) -> Result<Manifest> {
        let corrupt = |offset: usize, reason: String| StorageError::Corrupt {
            path: path.to_path_buf(),
            offset: offset as u64,
            reason,
        };
        if bytes.len() < 4 {
            return Err(corrupt(0, "shorter than a checksum".to_string()));
        }
        let body_len = bytes.len() - 4;
        let crc = &bytes[body_len..];
        let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        if crc32c::crc32c(&bytes[..body_len]) != stored {
            return Err(corrupt(0, "manifest checksum mismatch".to_string()));
        }
        let mut d = Decoder::new(bytes.slice(..body_len));
        let manifest = (|| -> std::result::Result<Manifest, DecodeError> {
            if d.u64()? != MAGIC {
                return Err(DecodeError::Invalid("not a manifest (bad magic)"));
            }
            let with_layers = match d.u32()? {
                FORMAT => true,
                FORMAT_WITHOUT_LAYERS => false,
                _ => {
                    return Err(DecodeError::Invalid(
                        "a manifest format this build does not read",
                    ))
                }
            };
            let marker = d.u64()?;
            let floor = d.u64()?;
            let next_run_id = d.u64()?;
            let meta = d.bytes("manifest meta", META_BYTES_MAX)?;
            let entry_bytes = if with_layers {
                RUN_ENTRY_BYTES
            } else {
                RUN_ENTRY_WITHOUT_LAYER_BYTES
            };
            let count = d.count("manifest runs", RUNS_MAX, entry_bytes)?;
            let mut runs: Vec<RunEntry> = Vec::with_capacity(count);
            for _ in 0..count {
                let layer = if with_layers { d.u64()? } else { 0 };
                let id = d.u64()?;
                let layer = if with_layers { layer } else { id };
                if id >= next_run_id || layer >= next_run_id {
                    return Err(DecodeError::Invalid(
                        "a run or layer id at or above the next run id",
                    ));
                }
                let seen_before = runs
                    .iter()
                    .rev()
                    .skip_while(|r| r.layer == layer)
                    .any(|r| r.layer == layer);
                if seen_before || runs.iter().any(|r| r.id == id) {
                    return Err(DecodeError::Invalid(
                        "a run named twice, or a layer's runs not adjacent",
                    ));
                }
                runs.push(RunEntry {
                    layer,
                    id,
                    summary: RunSummary {
                        records: d.u64()?,
                        min_version: d.u64()?,
                        max_version: d.u64()?,
                        file_bytes: d.u64()?,
                    },
                });
            }
            d.finish()?;
            Ok(Manifest {
                marker,
                floor,
                next_run_id,
                meta,
                runs,
            })
        })()
        .map_err(|e| corrupt(d.position(), e.to_string()))?;
        Ok(manifest)
    }

    /// Reads the manifest in `dir`; `None` when there is none (a new store).
    pub fn read<D: Disk>(disk: &D, dir: &Path) -> Result<Option<Manifest>> {
        let path = dir.join(MANIFEST_FILE);
        match disk.read_all(&path) {
            Ok(bytes) => Manifest::decode(Bytes::from(bytes), &path).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StorageError::io("read manifest", path, e)),
        }
    }

    /// Replaces the manifest in `dir` with this one, durably; the bytes
    /// written.
    pub fn write<D: Disk>(&self, disk: &D, dir: &Path) -> Result<u64> {
        let tmp: PathBuf = dir.join(MANIFEST_TMP_FILE);
        let file = disk
            .create(&tmp)
            .map_err(|e| StorageError::io("create manifest", &tmp, e))?;
        let bytes = self.encode();
        file.append(&bytes)
            .map_err(|e| StorageError::io("write manifest", &tmp, e))?;
        file.sync_data()
            .map_err(|e| StorageError::io("sync manifest", &tmp, e))?;
        let path = dir.join(MANIFEST_FILE);
        disk.rename(&tmp, &path)
            .map_err(|e| StorageError::io("rename manifest", &path, e))?;
        disk.sync_dir(dir)
            .map_err(|e| StorageError::io("sync directory", dir, e))?;
        Ok(bytes.len() as u64)
    }
}
