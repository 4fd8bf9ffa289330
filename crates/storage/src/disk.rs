//! The filesystem as the storage layer sees it: a few operations, each with
//! the durability rules spelled out, so that a simulated disk can break them
//! in every way a real one may.
//!
//! Durability rules (the simulated disk enforces exactly these):
//! - bytes appended to a file survive a crash only after that file's
//!   [`DiskFile::sync_data`]; so do a file's reserved zeros
//!   ([`DiskFile::reserve`]) and the release of them;
//! - a created, renamed or removed name survives a crash only after
//!   [`Disk::sync_dir`] on its directory;
//! - [`Disk::truncate_synced`] is durable when it returns.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A file opened for appending. Methods take `&self` so that a sync can run
/// on one thread while another appends the next batch.
pub trait DiskFile: Send + Sync + std::fmt::Debug + 'static {
    /// Appends `data` at the end of the file. A failed append leaves the
    /// file as it was (what part of `data` reached it is cut back), so
    /// that one that failed for want of space can be made again; if the
    /// cut itself fails, the error says so and carries no OS error code.
    fn append(&self, data: &[u8]) -> io::Result<()>;
    /// Makes every byte appended so far durable (fdatasync), and the
    /// file's length as reserved or released.
    fn sync_data(&self) -> io::Result<()>;
    /// Writes zeros past the appended bytes until the file is `len_bytes`
    /// long (nothing if it is that long already). Appends then overwrite
    /// them in place: a sync of an overwrite has no file length or block
    /// allocation to record, so it costs the filesystem about half what a
    /// sync of an append does. A reader sees the zeros after the appended
    /// bytes. A failed reserve leaves the file as it was.
    fn reserve(&self, len_bytes: u64) -> io::Result<()>;
    /// Cuts the file back to the bytes appended so far (what is reserved
    /// past them is given back).
    fn release_reserved(&self) -> io::Result<()>;
}

/// A file opened for reading at any offset. It keeps reading the file it
/// opened even after that file is renamed over or removed (as an open
/// descriptor does), so that readers of an immutable file never race with
/// the code that retires it.
pub trait DiskReader: Send + Sync + std::fmt::Debug + 'static {
    /// Fills `buf` from `offset`; fails with `UnexpectedEof` if the file is
    /// shorter.
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// The length of the file in bytes.
    fn file_len(&self) -> io::Result<u64>;
}

/// A filesystem.
pub trait Disk: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// The handle type of files opened for appending.
    type File: DiskFile;
    /// The handle type of files opened for reading.
    type Reader: DiskReader;
    /// Opens an existing file for reading.
    fn open_read(&self, path: &Path) -> io::Result<Self::Reader>;
    /// Creates a directory and its parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// The names of the files directly in `dir`, sorted.
    fn list_files(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Creates an empty file (replacing any file of that name) for appending.
    fn create(&self, path: &Path) -> io::Result<Self::File>;
    /// The whole content of a file.
    fn read_all(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Fills `buf` from `offset`; fails with `UnexpectedEof` if the file is shorter.
    fn read_exact_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// The length of a file in bytes.
    fn file_len(&self, path: &Path) -> io::Result<u64>;
    /// Cuts a file to `len` bytes and syncs it.
    fn truncate_synced(&self, path: &Path, len: u64) -> io::Result<()>;
    /// Renames a file, replacing the target.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Makes the directory's entries (creates, renames, removes) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// The real filesystem through `std::fs`; syncs are `fdatasync`
/// (`File::sync_data`).
#[derive(Clone, Copy, Debug, Default)]
pub struct FsDisk;

/// A real file opened for appending.
#[derive(Debug)]
pub struct FsFile {
    file: File,
    /// Bytes appended whole so far: where the next append starts.
    len: AtomicU64,
    /// The file's length on disk: `len` plus the zeros reserved past it.
    physical_len: AtomicU64,
}

/// The zeros [`FsFile::reserve`] writes, 64 KiB per write. The page cache
/// sizes its folios by the writes that fill them (Linux 6.18 on ext4), so
/// this is also the unit a record written into the reserve dirties. Side
/// by side (`scripts/bench-ab.sh`, puts at 256 clients) 64 KiB cost less
/// server CPU per put than 4 KiB (32.5 against 34.3 µs) and than 1 MiB
/// (35.0 against 37.0 µs). The process is charged a whole dirtied folio
/// in `write_bytes` (`/proc/PID/io`) while the disk receives only the
/// blocks written (`/proc/diskstats`), so that figure overstates what the
/// log writes.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

impl FsFile {
    /// Cuts the file to `len` after a failed write, so that it holds only
    /// whole appends; `error` is what failed.
    fn cut_back(&self, len: u64, error: io::Error) -> io::Error {
        match self.file.set_len(len) {
            Ok(()) => {
                self.physical_len.store(len, Ordering::Relaxed);
                error
            }
            Err(cut) => io::Error::other(format!(
                "{error}; cutting back the partial write failed: {cut}"
            )),
        }
    }
}

impl DiskFile for FsFile {
    fn append(&self, data: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        // Only this handle writes the file, one call at a time (the log
        // appends from one thread; a sync only reads the descriptor).
        let start = self.len.load(Ordering::Relaxed);
        let end = start.saturating_add(data.len() as u64);
        if let Err(error) = self.file.write_all_at(data, start) {
            // A write that ran out of space may have written part of
            // `data` (over reserved zeros, or past the end): cut it, so
            // that the next append follows the last whole one.
            return Err(self.cut_back(start, error));
        }
        self.len.store(end, Ordering::Relaxed);
        self.physical_len.fetch_max(end, Ordering::Relaxed);
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn reserve(&self, len_bytes: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let start = self.physical_len.load(Ordering::Relaxed);
        let mut at = start;
        while at < len_bytes {
            let n = (len_bytes - at).min(ZEROS.len() as u64) as usize;
            if let Err(error) = self.file.write_all_at(&ZEROS[..n], at) {
                return Err(self.cut_back(start, error));
            }
            at += n as u64;
        }
        self.physical_len.store(at, Ordering::Relaxed);
        Ok(())
    }
    fn release_reserved(&self) -> io::Result<()> {
        let len = self.len.load(Ordering::Relaxed);
        if self.physical_len.load(Ordering::Relaxed) > len {
            self.file.set_len(len)?;
            self.physical_len.store(len, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// A real file opened for reading.
#[derive(Debug)]
pub struct FsReader {
    file: File,
}

impl DiskReader for FsReader {
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.read_exact_at(buf, offset)
    }
    fn file_len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

impl Disk for FsDisk {
    type File = FsFile;
    type Reader = FsReader;

    fn open_read(&self, path: &Path) -> io::Result<FsReader> {
        Ok(FsReader {
            file: File::open(path)?,
        })
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }

    fn list_files(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                if let Some(name) = entry.file_name().to_str() {
                    names.push(name.to_string());
                }
            }
        }
        names.sort();
        Ok(names)
    }

    fn create(&self, path: &Path) -> io::Result<FsFile> {
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)?;
        // Appends are positioned writes at `len`, which starts at 0 and
        // only moves forward (a failed append leaves it where it was).
        Ok(FsFile {
            file,
            len: AtomicU64::new(0),
            physical_len: AtomicU64::new(0),
        })
    }

    fn read_all(&self, path: &Path) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }

    fn read_exact_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        File::open(path)?.read_exact_at(buf, offset)
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        Ok(std::fs::metadata(path)?.len())
    }

    fn truncate_synced(&self, path: &Path, len: u64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(path)?;
        file.set_len(len)?;
        file.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// Creates `dir` (and its parents) and syncs the parents of `dir` and of
/// its own parent, so that a newly created directory survives a crash along
/// with the files later synced in it.
pub fn create_dir_durably<D: Disk>(disk: &D, dir: &Path) -> crate::error::Result<()> {
    use crate::error::StorageError;
    disk.create_dir_all(dir)
        .map_err(|e| StorageError::io("create directory", dir, e))?;
    for parent in dir.ancestors().skip(1).take(2) {
        if parent.as_os_str().is_empty() {
            break;
        }
        disk.sync_dir(parent)
            .map_err(|e| StorageError::io("sync directory", parent, e))?;
    }
    Ok(())
}

/// A fresh, uniquely named directory under the system's temp folder, for
/// tests and benchmarks. The caller removes it.
pub fn unique_temp_dir(label: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "ferry-storage-{label}-{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}
