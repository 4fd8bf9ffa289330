//! Snapshots read as a stream: in pieces of any size, into memory or
//! written to disk as they come, and refused whole when damaged (a store
//! restored from a damaged stream leaves nothing behind).

use std::io::Read;
use std::path::PathBuf;

use proptest::prelude::*;

use super::helpers::*;
use crate::error::CodecError;
use crate::kv_state::{KvLimits, KvState};
use ferry_storage::{AnyDisk, Disk, SimDisk};

fn dir() -> PathBuf {
    PathBuf::from("/data/kv/store-1")
}

/// Hands out at most `piece` bytes per read.
struct Dribble<'a> {
    bytes: &'a [u8],
    piece: usize,
}

impl Read for Dribble<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let count = out.len().min(self.piece).min(self.bytes.len());
        out[..count].copy_from_slice(&self.bytes[..count]);
        self.bytes = &self.bytes[count..];
        Ok(count)
    }
}

/// A state with history, leases, a compaction, and values larger than the
/// reader's buffer.
fn loaded_machine() -> Machine {
    let mut m = Machine::new();
    m.ok(grant_cmd(7, 60));
    for i in 0..40 {
        m.ok(put_cmd(&format!("k{:02}", i % 13), &format!("v{i}")));
    }
    m.ok(put_lease_cmd("leased", "1", 7));
    m.ok(put_cmd("big", &"x".repeat(600 * 1024)));
    m.ok(delete_cmd("k00", "k03"));
    m.ok(compact_cmd(20));
    m.ok(put_cmd("big", &"y".repeat(300 * 1024)));
    m
}

#[test]
fn a_snapshot_read_in_pieces_of_any_size_restores_the_same_state_in_memory_and_on_disk() {
    let m = loaded_machine();
    let bytes = m.kv.snapshot().unwrap();
    for piece in [1, 7, 4096, 300_000, bytes.len()] {
        let mut source = Dribble {
            bytes: &bytes,
            piece,
        };
        let restored = KvState::restore_from(&mut source, KvLimits::default()).unwrap();
        assert_eq!(restored, m.kv, "in memory, pieces of {piece}");

        let disk = SimDisk::with_seed(piece as u64);
        let mut source = Dribble {
            bytes: &bytes,
            piece,
        };
        let on_disk = KvState::restore_into(
            &mut source,
            AnyDisk::Sim(disk.clone()),
            &dir(),
            KvLimits::default(),
        )
        .unwrap();
        assert_eq!(
            on_disk.snapshot().unwrap(),
            bytes,
            "on disk, pieces of {piece}"
        );
        assert_eq!(on_disk.durable_index(), m.kv.applied_index());
        drop(on_disk);
        // Durable as it stands: a reopen finds the same state.
        let reopened = KvState::open(AnyDisk::Sim(disk), &dir(), KvLimits::default()).unwrap();
        assert_eq!(
            reopened.snapshot().unwrap(),
            bytes,
            "reopened, pieces of {piece}"
        );
    }
}

/// Restores `bytes` both ways; the on-disk one must leave no file behind
/// when it fails.
fn restore_both(bytes: &[u8]) -> (Result<(), CodecError>, Result<(), CodecError>) {
    let in_memory = KvState::restore(bytes, KvLimits::default()).map(drop);
    let disk = SimDisk::with_seed(1);
    let mut source = bytes;
    let on_disk = KvState::restore_into(
        &mut source,
        AnyDisk::Sim(disk.clone()),
        &dir(),
        KvLimits::default(),
    )
    .map(drop);
    if on_disk.is_err() {
        let left = disk.list_files(&dir()).unwrap_or_default();
        assert!(left.is_empty(), "a failed restore left {left:?}");
    }
    (in_memory, on_disk)
}

#[test]
fn a_damaged_snapshot_is_refused_both_ways_and_leaves_no_store() {
    let mut m = Machine::new();
    m.ok(grant_cmd(7, 60));
    m.ok(put_lease_cmd("a", "1", 7));
    m.ok(put_cmd("b", "2"));
    let bytes = m.kv.snapshot().unwrap();
    // Cut anywhere.
    for len in 0..bytes.len() {
        let (in_memory, on_disk) = restore_both(&bytes[..len]);
        assert!(in_memory.is_err() && on_disk.is_err(), "cut at {len}");
    }
    // A bit flipped anywhere.
    for at in 0..bytes.len() {
        let mut flipped = bytes.clone();
        flipped[at] ^= 0x10;
        let (in_memory, on_disk) = restore_both(&flipped);
        assert!(in_memory.is_err() && on_disk.is_err(), "flipped at {at}");
    }
    // Bytes after the checksum.
    let mut longer = bytes.clone();
    longer.push(0);
    let (in_memory, on_disk) = restore_both(&longer);
    assert!(in_memory.is_err() && on_disk.is_err());
}

#[test]
fn a_field_claiming_a_huge_length_is_refused_before_anything_is_allocated() {
    // The magic, then field 5 (versions) claiming 2^40 bytes.
    let mut bytes = b"FERRYKV1".to_vec();
    bytes.push((5 << 3) | 2);
    let mut length = 1u64 << 40;
    while length >= 0x80 {
        bytes.push((length as u8 & 0x7f) | 0x80);
        length >>= 7;
    }
    bytes.push(length as u8);
    bytes.extend_from_slice(&[0; 64]);
    let (in_memory, on_disk) = restore_both(&bytes);
    for outcome in [in_memory, on_disk] {
        let error = outcome.unwrap_err();
        assert!(
            matches!(&error, CodecError::Malformed(reason) if reason.contains("bytes at byte")),
            "{error}"
        );
    }
}

#[test]
fn a_source_that_fails_to_read_is_a_read_error() {
    struct Failing;
    impl Read for Failing {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("the disk went away"))
        }
    }
    let error = KvState::restore_from(&mut Failing, KvLimits::default()).unwrap_err();
    assert!(matches!(&error, CodecError::Read(reason) if reason.contains("went away")));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// After the magic, anything: refused with an error, never a panic,
    /// and nothing left on disk.
    #[test]
    fn arbitrary_bytes_after_the_magic_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut bytes = b"FERRYKV1".to_vec();
        bytes.extend_from_slice(&tail);
        let _ = restore_both(&bytes);
    }
}
