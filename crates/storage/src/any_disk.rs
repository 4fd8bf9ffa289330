//! The real or the simulated disk behind one type, for code that picks one
//! at run time (a server on the filesystem, its tests in memory) without
//! becoming generic over [`Disk`].

use std::io;
use std::path::Path;

use crate::disk::{Disk, DiskFile, DiskReader, FsDisk, FsFile, FsReader};
use crate::sim_disk::{SimDisk, SimFile, SimReader};

/// [`FsDisk`] or [`SimDisk`].
#[derive(Debug, Clone)]
pub enum AnyDisk {
    /// The filesystem.
    Fs(FsDisk),
    /// A disk in memory.
    Sim(SimDisk),
}

/// A file of an [`AnyDisk`] opened for appending.
#[derive(Debug)]
pub enum AnyFile {
    /// On the filesystem.
    Fs(FsFile),
    /// In memory.
    Sim(SimFile),
}

/// A file of an [`AnyDisk`] opened for reading.
#[derive(Debug)]
pub enum AnyReader {
    /// On the filesystem.
    Fs(FsReader),
    /// In memory.
    Sim(SimReader),
}

impl DiskFile for AnyFile {
    fn append(&self, data: &[u8]) -> io::Result<()> {
        match self {
            AnyFile::Fs(f) => f.append(data),
            AnyFile::Sim(f) => f.append(data),
        }
    }
    fn sync_data(&self) -> io::Result<()> {
        match self {
            AnyFile::Fs(f) => f.sync_data(),
            AnyFile::Sim(f) => f.sync_data(),
        }
    }
    fn reserve(&self, len_bytes: u64) -> io::Result<()> {
        match self {
            AnyFile::Fs(f) => f.reserve(len_bytes),
            AnyFile::Sim(f) => f.reserve(len_bytes),
        }
    }
    fn release_reserved(&self) -> io::Result<()> {
        match self {
            AnyFile::Fs(f) => f.release_reserved(),
            AnyFile::Sim(f) => f.release_reserved(),
        }
    }
}

impl DiskReader for AnyReader {
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        match self {
            AnyReader::Fs(r) => r.read_exact_at(offset, buf),
            AnyReader::Sim(r) => r.read_exact_at(offset, buf),
        }
    }
    fn file_len(&self) -> io::Result<u64> {
        match self {
            AnyReader::Fs(r) => r.file_len(),
            AnyReader::Sim(r) => r.file_len(),
        }
    }
}

impl Disk for AnyDisk {
    type File = AnyFile;
    type Reader = AnyReader;

    fn open_read(&self, path: &Path) -> io::Result<AnyReader> {
        match self {
            AnyDisk::Fs(d) => d.open_read(path).map(AnyReader::Fs),
            AnyDisk::Sim(d) => d.open_read(path).map(AnyReader::Sim),
        }
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        match self {
            AnyDisk::Fs(d) => d.create_dir_all(dir),
            AnyDisk::Sim(d) => d.create_dir_all(dir),
        }
    }
    fn list_files(&self, dir: &Path) -> io::Result<Vec<String>> {
        match self {
            AnyDisk::Fs(d) => d.list_files(dir),
            AnyDisk::Sim(d) => d.list_files(dir),
        }
    }
    fn create(&self, path: &Path) -> io::Result<AnyFile> {
        match self {
            AnyDisk::Fs(d) => d.create(path).map(AnyFile::Fs),
            AnyDisk::Sim(d) => d.create(path).map(AnyFile::Sim),
        }
    }
    fn read_all(&self, path: &Path) -> io::Result<Vec<u8>> {
        match self {
            AnyDisk::Fs(d) => d.read_all(path),
            AnyDisk::Sim(d) => d.read_all(path),
        }
    }
    fn read_exact_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        match self {
            AnyDisk::Fs(d) => d.read_exact_at(path, offset, buf),
            AnyDisk::Sim(d) => d.read_exact_at(path, offset, buf),
        }
    }
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        match self {
            AnyDisk::Fs(d) => d.file_len(path),
            AnyDisk::Sim(d) => d.file_len(path),
        }
    }
    fn truncate_synced(&self, path: &Path, len: u64) -> io::Result<()> {
        match self {
            AnyDisk::Fs(d) => d.truncate_synced(path, len),
            AnyDisk::Sim(d) => d.truncate_synced(path, len),
        }
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        match self {
            AnyDisk::Fs(d) => d.rename(from, to),
            AnyDisk::Sim(d) => d.rename(from, to),
        }
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        match self {
            AnyDisk::Fs(d) => d.remove_file(path),
            AnyDisk::Sim(d) => d.remove_file(path),
        }
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        match self {
            AnyDisk::Fs(d) => d.sync_dir(dir),
            AnyDisk::Sim(d) => d.sync_dir(dir),
        }
    }
}
