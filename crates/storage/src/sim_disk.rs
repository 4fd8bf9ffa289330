//! A simulated disk for the simulator and the crash tests: memory only,
//! deterministic from a seed, and unkind in every way the [`crate::disk`]
//! durability rules allow.
//!
//! - Unsynced appends and unsynced directory changes are lost on
//!   [`SimDisk::crash`] (how much of them survives depends on the
//!   [`CrashMode`]).
//! - Torn writes: with a fault budget ([`SimDisk::set_fault_budget`]) the disk
//!   "loses power" after a given number of units (one per byte appended, one
//!   per other mutating operation); the write in progress leaves a prefix
//!   and every later operation fails until the crash is applied.
//! - Corrupted sectors: [`SimDisk::corrupt_sector`] and
//!   [`SimDisk::corrupt_random_sector`] damage stored bytes in place.
//! - Reserved space ([`DiskFile::reserve`]) reads as zeros after a file's
//!   appended bytes; the reservation and its release are unsynced changes
//!   of the file's length like any other, so a crash may keep or undo them.
//!   Writes reach the disk in the order they were made (a torn write keeps
//!   a prefix): a real disk may write an unsynced batch's pages out of
//!   order, which recovery treats as corruption (see [`crate::wal`]).
//! - Failed syncs: [`SimDisk::fail_next_syncs`] makes syncs return an I/O
//!   error without syncing (the log then refuses further work).
//! - Failed creates: [`SimDisk::fail_next_creates`] makes creating files
//!   fail with a given OS error (out of descriptors, of space) without
//!   creating anything.
//! - Slow syncs: each sync draws a latency from the configured range; the
//!   caller reads the total with [`SimDisk::take_sync_ticks`] and delivers the
//!   completion that much later.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::disk::{Disk, DiskFile, DiskReader};

/// The size of a sector, the unit of simulated corruption.
pub const SECTOR_BYTES: u64 = 512;

/// How much unsynced data survives a crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashMode {
    /// Nothing that was not synced survives.
    LoseUnsynced,
    /// Everything written survives, as if the kernel had flushed it all
    /// (including the prefix of a write torn by the fault budget).
    KeepWritten,
    /// Each file keeps its synced bytes plus a random prefix of its unsynced
    /// appends (a torn write); the unsynced directory changes survive all
    /// together or not at all, chosen at random.
    TornUnsynced,
}

/// Configuration of a simulated disk.
#[derive(Clone, Debug, Default)]
pub struct SimDiskOptions {
    /// The seed of every random choice the disk makes.
    pub seed: u64,
    /// The fewest ticks a sync takes.
    pub sync_latency_ticks_min: u64,
    /// The most ticks a sync takes.
    pub sync_latency_ticks_max: u64,
}

#[derive(Debug, Default)]
struct Inode {
    /// The appended bytes.
    data: Vec<u8>,
    /// Bytes at the front of `data` that are durable. Only appends are ever
    /// unsynced (truncation is synced), so the durable content is a prefix.
    synced_len: usize,
    /// The file's length with its reserved zeros (which follow `data`; no
    /// longer than `data` if nothing is reserved).
    reserved_len: usize,
    /// `reserved_len` as of the last sync.
    synced_reserved_len: usize,
}

impl Inode {
    /// The file's length as a reader sees it.
    fn len(&self) -> usize {
        self.data.len().max(self.reserved_len)
    }

    /// `len` bytes from `start` (zeros past the appended bytes), or `None`
    /// past the end of the file.
    fn read(&self, start: usize, len: usize) -> Option<Vec<u8>> {
        let end = start.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        let mut out = vec![0u8; len];
        if start < self.data.len() {
            let n = (self.data.len() - start).min(len);
            out[..n].copy_from_slice(&self.data[start..start + n]);
        }
        Some(out)
    }
}

#[derive(Debug)]
struct State {
    rng: ChaCha8Rng,
    options: SimDiskOptions,
    /// Bumped by every crash; handles of an older generation are dead.
    generation: u64,
    /// Set when the fault budget ran out: everything fails until `crash`.
    powered_off: bool,
    fault_budget: Option<u64>,
    /// Syncs still to fail with an I/O error (the disk stays on).
    failing_syncs: u64,
    /// Creates still to fail, and the OS error they fail with.
    failing_creates: u64,
    failing_create_errno: i32,
    failing_appends: u64,
    failing_append_errno: i32,
    units_used: u64,
    sync_ticks: u64,
    /// Positioned reads done, through readers and the disk itself.
    reads: u64,
    dirs: BTreeSet<PathBuf>,
    inodes: BTreeMap<u64, Inode>,
    next_inode: u64,
    names: BTreeMap<PathBuf, u64>,
    durable_names: BTreeMap<PathBuf, u64>,
}

fn powered_off() -> io::Error {
    io::Error::other("simulated power loss: the disk is off until the crash is applied")
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{} not found", path.display()),
    )
}

impl State {
    fn check_on(&self) -> io::Result<()> {
        if self.powered_off {
            return Err(powered_off());
        }
        Ok(())
    }

    /// Charges one unit for a metadata operation or a sync.
    fn charge_op(&mut self) -> io::Result<()> {
        self.check_on()?;
        if let Some(budget) = self.fault_budget.as_mut() {
            if *budget == 0 {
                self.powered_off = true;
                return Err(powered_off());
            }
            *budget -= 1;
        }
        self.units_used += 1;
        Ok(())
    }

    /// Fails this sync if failures were asked for.
    fn check_sync_failure(&mut self) -> io::Result<()> {
        if self.failing_syncs > 0 {
            self.failing_syncs -= 1;
            return Err(io::Error::other("simulated I/O error during sync"));
        }
        Ok(())
    }

    /// Fails this write (append or reserve) if failures were asked for
    /// ([`SimDisk::fail_next_appends`]).
    fn fail_write_if_asked(&mut self) -> io::Result<()> {
        if self.failing_appends > 0 {
            self.failing_appends -= 1;
            return Err(io::Error::from_raw_os_error(self.failing_append_errno));
        }
        Ok(())
    }

    fn draw_sync_latency(&mut self) {
        let lo = self.options.sync_latency_ticks_min;
        let hi = self.options.sync_latency_ticks_max.max(lo);
        let span = hi - lo + 1;
        let ticks = lo
            + if span == 0 {
                0
            } else {
                self.rng.next_u64() % span
            };
        self.sync_ticks = self.sync_ticks.saturating_add(ticks);
    }

    fn inode_of(&self, path: &Path) -> io::Result<u64> {
        self.names.get(path).copied().ok_or_else(|| not_found(path))
    }

    fn draw(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            0
        } else {
            self.rng.next_u64() % bound
        }
    }
}

/// A simulated disk. Clones share the same disk.
#[derive(Clone, Debug)]
pub struct SimDisk {
    state: Arc<Mutex<State>>,
}

/// A file on a [`SimDisk`].
#[derive(Debug)]
pub struct SimFile {
    disk: SimDisk,
    inode: u64,
    generation: u64,
}

impl SimDisk {
    /// An empty disk.
    pub fn new(options: SimDiskOptions) -> Self {
        SimDisk {
            state: Arc::new(Mutex::new(State {
                rng: ChaCha8Rng::seed_from_u64(options.seed),
                options,
                generation: 0,
                powered_off: false,
                fault_budget: None,
                failing_syncs: 0,
                failing_creates: 0,
                failing_create_errno: 0,
                failing_appends: 0,
                failing_append_errno: 0,
                units_used: 0,
                sync_ticks: 0,
                reads: 0,
                dirs: BTreeSet::new(),
                inodes: BTreeMap::new(),
                next_inode: 1,
                names: BTreeMap::new(),
                durable_names: BTreeMap::new(),
            })),
        }
    }

    /// An empty disk with default options and the given seed.
    pub fn with_seed(seed: u64) -> Self {
        SimDisk::new(SimDiskOptions {
            seed,
            ..SimDiskOptions::default()
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a test thread panicked while holding it; the
        // state is still consistent for our purposes (every mutation is
        // completed before the guard drops).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Loses power after `units` more units of work (bytes appended, or one
    /// per sync, create, rename, remove, truncate). `None` removes the limit.
    pub fn set_fault_budget(&self, units: Option<u64>) {
        self.lock().fault_budget = units;
    }

    /// Makes the next `count` creates fail with the OS error `errno` (such
    /// as EMFILE or ENOSPC) without creating anything; the disk stays on.
    pub fn fail_next_creates(&self, count: u64, errno: i32) {
        let mut s = self.lock();
        s.failing_creates = count;
        s.failing_create_errno = errno;
    }

    /// Makes the next `count` appends or reserves (both write) fail with
    /// the OS error `errno` (such as ENOSPC) without writing anything, as
    /// a real file's failed write ends (see
    /// [`crate::disk::DiskFile::append`]); the disk stays on.
    pub fn fail_next_appends(&self, count: u64, errno: i32) {
        let mut s = self.lock();
        s.failing_appends = count;
        s.failing_append_errno = errno;
    }

    /// Makes the next `count` syncs (of files or directories) fail with an
    /// I/O error, leaving the data unsynced; the disk stays on.
    pub fn fail_next_syncs(&self, count: u64) {
        self.lock().failing_syncs = count;
    }

    /// Units of work done so far (see [`SimDisk::set_fault_budget`]).
    pub fn units_used(&self) -> u64 {
        self.lock().units_used
    }

    /// Whether the fault budget has run out.
    pub fn is_powered_off(&self) -> bool {
        self.lock().powered_off
    }

    /// Positioned reads done so far (for tests that a lookup reads no more
    /// than it must).
    pub fn reads(&self) -> u64 {
        self.lock().reads
    }

    /// The sum of the latencies of the syncs since the last call.
    pub fn take_sync_ticks(&self) -> u64 {
        std::mem::take(&mut self.lock().sync_ticks)
    }

    /// Crashes and restarts the disk: unsynced data is lost as `mode` says,
    /// every open handle dies, and the fault budget is cleared.
    pub fn crash(&self, mode: CrashMode) {
        let mut s = self.lock();
        s.generation += 1;
        s.powered_off = false;
        s.fault_budget = None;
        // Directory entries first: which names survive.
        match mode {
            CrashMode::LoseUnsynced => s.names = s.durable_names.clone(),
            CrashMode::KeepWritten => s.durable_names = s.names.clone(),
            CrashMode::TornUnsynced => {
                // Metadata changes are journaled by real filesystems: either
                // the journal's latest state reached the disk or it did not.
                if s.draw(2) == 0 {
                    s.names = s.durable_names.clone();
                } else {
                    s.durable_names = s.names.clone();
                }
            }
        }
        let ids: Vec<u64> = s.inodes.keys().copied().collect();
        for id in ids {
            let keep = {
                let inode = &s.inodes[&id];
                (inode.synced_len, inode.data.len())
            };
            let reserved = {
                let inode = &s.inodes[&id];
                (inode.synced_reserved_len, inode.reserved_len)
            };
            let (new_len, new_reserved) = match mode {
                CrashMode::LoseUnsynced => (keep.0, reserved.0),
                CrashMode::KeepWritten => (keep.1, reserved.1),
                CrashMode::TornUnsynced => {
                    let extra = (keep.1 - keep.0) as u64;
                    let new_len = keep.0 + s.draw(extra + 1) as usize;
                    let new_reserved = if s.draw(2) == 0 {
                        reserved.0
                    } else {
                        reserved.1
                    };
                    (new_len, new_reserved)
                }
            };
            if let Some(inode) = s.inodes.get_mut(&id) {
                inode.data.truncate(new_len);
                inode.synced_len = new_len;
                inode.reserved_len = new_reserved;
                inode.synced_reserved_len = new_reserved;
            }
        }
        let live: BTreeSet<u64> = s.names.values().copied().collect();
        s.inodes.retain(|id, _| live.contains(id));
    }

    /// Damages the sector at `sector` of `path` (every byte of it that
    /// exists is changed). Returns false if the file or sector does not exist.
    pub fn corrupt_sector(&self, path: &Path, sector: u64) -> bool {
        let mut s = self.lock();
        let Some(id) = s.names.get(path).copied() else {
            return false;
        };
        let mut noise = vec![0u8; SECTOR_BYTES as usize];
        s.rng.fill_bytes(&mut noise);
        let Some(inode) = s.inodes.get_mut(&id) else {
            return false;
        };
        let start = (sector * SECTOR_BYTES) as usize;
        if start >= inode.data.len() {
            return false;
        }
        let end = (start + SECTOR_BYTES as usize).min(inode.data.len());
        for (b, n) in inode.data[start..end].iter_mut().zip(noise) {
            *b ^= n | 1;
        }
        true
    }

    /// Flips the bits of one byte of `path` (for precise corruption tests).
    pub fn corrupt_byte(&self, path: &Path, offset: u64) -> bool {
        let mut s = self.lock();
        let Some(id) = s.names.get(path).copied() else {
            return false;
        };
        match s
            .inodes
            .get_mut(&id)
            .and_then(|i| i.data.get_mut(offset as usize))
        {
            Some(b) => {
                *b ^= 0xff;
                true
            }
            None => false,
        }
    }

    /// Sets `len` bytes of `path` from `offset` to zero, as a write that
    /// never reached the disk leaves reserved space. Returns false if the
    /// file does not exist or is shorter.
    pub fn zero_bytes(&self, path: &Path, offset: u64, len: usize) -> bool {
        let mut s = self.lock();
        let Some(id) = s.names.get(path).copied() else {
            return false;
        };
        let Some(inode) = s.inodes.get_mut(&id) else {
            return false;
        };
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let Some(end) = start.checked_add(len).filter(|end| *end <= inode.len()) else {
            return false;
        };
        let data_end = end.min(inode.data.len());
        if start < data_end {
            inode.data[start..data_end].fill(0);
        }
        true
    }

    /// Damages one random sector of one random non-empty file whose path
    /// starts with `under`; returns which, or `None` if there is no such file.
    pub fn corrupt_random_sector(&self, under: &Path) -> Option<(PathBuf, u64)> {
        let (path, sector) = {
            let mut s = self.lock();
            let candidates: Vec<(PathBuf, u64)> = s
                .names
                .iter()
                .filter(|(p, _)| p.starts_with(under))
                .filter_map(|(p, id)| {
                    let len = s.inodes.get(id)?.data.len() as u64;
                    (len > 0).then(|| (p.clone(), len.div_ceil(SECTOR_BYTES)))
                })
                .collect();
            if candidates.is_empty() {
                return None;
            }
            let pick = s.draw(candidates.len() as u64) as usize;
            let (path, sectors) = candidates[pick].clone();
            let sector = s.draw(sectors);
            (path, sector)
        };
        self.corrupt_sector(&path, sector).then_some((path, sector))
    }

    /// Every file path on the disk (as currently visible), sorted.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.lock().names.keys().cloned().collect()
    }
}

impl SimFile {
    /// Fails for a handle opened before the last crash.
    fn check_generation(&self, s: &State) -> io::Result<()> {
        if s.generation != self.generation {
            return Err(io::Error::other("file handle from before a crash"));
        }
        Ok(())
    }
}

impl DiskFile for SimFile {
    fn append(&self, data: &[u8]) -> io::Result<()> {
        let mut s = self.disk.lock();
        s.check_on()?;
        self.check_generation(&s)?;
        s.fail_write_if_asked()?;
        let (n, cut) = match s.fault_budget {
            Some(budget) if budget < data.len() as u64 => (budget as usize, true),
            _ => (data.len(), false),
        };
        if let Some(budget) = s.fault_budget.as_mut() {
            *budget -= n as u64;
        }
        s.units_used += n as u64;
        let inode = s.inodes.entry(self.inode).or_default();
        inode.data.extend_from_slice(&data[..n]);
        if cut {
            s.powered_off = true;
            return Err(powered_off());
        }
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut s = self.disk.lock();
        s.charge_op()?;
        self.check_generation(&s)?;
        s.check_sync_failure()?;
        s.draw_sync_latency();
        if let Some(inode) = s.inodes.get_mut(&self.inode) {
            inode.synced_len = inode.data.len();
            inode.synced_reserved_len = inode.reserved_len;
        }
        Ok(())
    }

    fn reserve(&self, len_bytes: u64) -> io::Result<()> {
        let mut s = self.disk.lock();
        s.charge_op()?;
        self.check_generation(&s)?;
        s.fail_write_if_asked()?;
        let len = usize::try_from(len_bytes).unwrap_or(usize::MAX);
        if let Some(inode) = s.inodes.get_mut(&self.inode) {
            inode.reserved_len = inode.reserved_len.max(len);
        }
        Ok(())
    }

    fn release_reserved(&self) -> io::Result<()> {
        let mut s = self.disk.lock();
        s.charge_op()?;
        self.check_generation(&s)?;
        if let Some(inode) = s.inodes.get_mut(&self.inode) {
            inode.reserved_len = 0;
        }
        Ok(())
    }
}

/// A simulated file opened for reading: it reads its inode, whatever names
/// it has since (until a crash drops an inode no name keeps).
#[derive(Debug)]
pub struct SimReader {
    disk: SimDisk,
    inode: u64,
}

impl DiskReader for SimReader {
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut s = self.disk.lock();
        s.check_on()?;
        s.reads += 1;
        let Some(inode) = s.inodes.get(&self.inode) else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the file is gone (dropped by a crash)",
            ));
        };
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        match inode.read(start, buf.len()) {
            Some(src) => {
                buf.copy_from_slice(&src);
                Ok(())
            }
            None => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the file",
            )),
        }
    }

    fn file_len(&self) -> io::Result<u64> {
        let s = self.disk.lock();
        s.check_on()?;
        Ok(s.inodes.get(&self.inode).map_or(0, |i| i.len() as u64))
    }
}

impl Disk for SimDisk {
    type File = SimFile;
    type Reader = SimReader;

    fn open_read(&self, path: &Path) -> io::Result<SimReader> {
        let s = self.lock();
        s.check_on()?;
        let inode = s.inode_of(path)?;
        Ok(SimReader {
            disk: self.clone(),
            inode,
        })
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.check_on()?;
        // Directories are durable at once: the layout is created at install
        // time and never changes, so losing it is not a fault worth modelling.
        for a in dir.ancestors() {
            s.dirs.insert(a.to_path_buf());
        }
        Ok(())
    }

    fn list_files(&self, dir: &Path) -> io::Result<Vec<String>> {
        let s = self.lock();
        s.check_on()?;
        if !s.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        Ok(s.names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
            .collect())
    }

    fn create(&self, path: &Path) -> io::Result<SimFile> {
        let mut s = self.lock();
        s.charge_op()?;
        if s.failing_creates > 0 {
            s.failing_creates -= 1;
            return Err(io::Error::from_raw_os_error(s.failing_create_errno));
        }
        let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
        if !s.dirs.contains(&parent) {
            return Err(not_found(&parent));
        }
        let id = s.next_inode;
        s.next_inode += 1;
        s.inodes.insert(id, Inode::default());
        s.names.insert(path.to_path_buf(), id);
        Ok(SimFile {
            disk: self.clone(),
            inode: id,
            generation: s.generation,
        })
    }

    fn read_all(&self, path: &Path) -> io::Result<Vec<u8>> {
        let s = self.lock();
        s.check_on()?;
        let id = s.inode_of(path)?;
        Ok(s.inodes
            .get(&id)
            .and_then(|i| i.read(0, i.len()))
            .unwrap_or_default())
    }

    fn read_exact_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut s = self.lock();
        s.check_on()?;
        s.reads += 1;
        let id = s.inode_of(path)?;
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        match s.inodes.get(&id).and_then(|i| i.read(start, buf.len())) {
            Some(src) => {
                buf.copy_from_slice(&src);
                Ok(())
            }
            None => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the file",
            )),
        }
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        let s = self.lock();
        s.check_on()?;
        let id = s.inode_of(path)?;
        Ok(s.inodes.get(&id).map(|i| i.len() as u64).unwrap_or(0))
    }

    fn truncate_synced(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut s = self.lock();
        s.charge_op()?;
        let id = s.inode_of(path)?;
        s.draw_sync_latency();
        if let Some(inode) = s.inodes.get_mut(&id) {
            let len = usize::try_from(len).unwrap_or(usize::MAX).min(inode.len());
            inode.data.truncate(len);
            inode.synced_len = inode.data.len();
            inode.reserved_len = len;
            inode.synced_reserved_len = len;
        }
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.charge_op()?;
        let id = s.inode_of(from)?;
        s.names.remove(from);
        s.names.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.charge_op()?;
        s.inode_of(path)?;
        s.names.remove(path);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.charge_op()?;
        s.check_sync_failure()?;
        s.draw_sync_latency();
        let in_dir = |p: &PathBuf| p.parent() == Some(dir);
        s.durable_names.retain(|p, _| !in_dir(p));
        let current: Vec<(PathBuf, u64)> = s
            .names
            .iter()
            .filter(|(p, _)| in_dir(p))
            .map(|(p, id)| (p.clone(), *id))
            .collect();
        s.durable_names.extend(current);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        PathBuf::from("/d")
    }

    #[test]
    fn unsynced_appends_and_names_are_lost_on_crash() {
        let disk = SimDisk::with_seed(1);
        disk.create_dir_all(&dir()).unwrap();
        let f = disk.create(&dir().join("a")).unwrap();
        f.append(b"hello").unwrap();
        f.sync_data().unwrap();
        f.append(b" world").unwrap();
        disk.crash(CrashMode::LoseUnsynced);
        // The name was never made durable.
        assert!(disk.read_all(&dir().join("a")).is_err());

        let f = disk.create(&dir().join("b")).unwrap();
        f.append(b"hello").unwrap();
        f.sync_data().unwrap();
        disk.sync_dir(&dir()).unwrap();
        f.append(b" world").unwrap();
        disk.crash(CrashMode::LoseUnsynced);
        assert_eq!(disk.read_all(&dir().join("b")).unwrap(), b"hello");
        assert!(f.append(b"x").is_err(), "handles die with a crash");
    }

    #[test]
    fn fault_budget_tears_a_write_and_powers_off() {
        let disk = SimDisk::with_seed(1);
        disk.create_dir_all(&dir()).unwrap();
        let f = disk.create(&dir().join("a")).unwrap();
        disk.sync_dir(&dir()).unwrap();
        disk.set_fault_budget(Some(3));
        assert!(f.append(b"hello").is_err());
        assert!(disk.is_powered_off());
        assert!(disk.read_all(&dir().join("a")).is_err());
        disk.crash(CrashMode::KeepWritten);
        assert_eq!(disk.read_all(&dir().join("a")).unwrap(), b"hel");
    }

    #[test]
    fn torn_crash_keeps_a_prefix_and_is_deterministic() {
        let run = |seed| {
            let disk = SimDisk::with_seed(seed);
            disk.create_dir_all(&dir()).unwrap();
            let f = disk.create(&dir().join("a")).unwrap();
            disk.sync_dir(&dir()).unwrap();
            f.append(b"0123").unwrap();
            f.sync_data().unwrap();
            f.append(b"456789").unwrap();
            disk.crash(CrashMode::TornUnsynced);
            disk.read_all(&dir().join("a")).unwrap()
        };
        for seed in 0..20 {
            let data = run(seed);
            assert!(data.starts_with(b"0123") && b"0123456789".starts_with(&data));
            assert_eq!(data, run(seed));
        }
    }

    #[test]
    fn slow_syncs_report_latency() {
        let disk = SimDisk::new(SimDiskOptions {
            seed: 3,
            sync_latency_ticks_min: 2,
            sync_latency_ticks_max: 5,
        });
        disk.create_dir_all(&dir()).unwrap();
        let f = disk.create(&dir().join("a")).unwrap();
        f.sync_data().unwrap();
        let t = disk.take_sync_ticks();
        assert!((2..=5).contains(&t), "{t}");
        assert_eq!(disk.take_sync_ticks(), 0);
    }

    #[test]
    fn corrupt_sector_changes_every_byte() {
        let disk = SimDisk::with_seed(9);
        disk.create_dir_all(&dir()).unwrap();
        let f = disk.create(&dir().join("a")).unwrap();
        f.append(&[7u8; 600]).unwrap();
        assert!(disk.corrupt_sector(&dir().join("a"), 1));
        let data = disk.read_all(&dir().join("a")).unwrap();
        assert!(data[..512].iter().all(|b| *b == 7));
        assert!(data[512..].iter().all(|b| *b != 7));
        assert!(!disk.corrupt_sector(&dir().join("a"), 2));
        assert!(disk.corrupt_random_sector(&dir()).is_some());
    }
}
