//! The server's decoders: key-value snapshots (from a leader or a backup
//! file), replicated commands and their application, and the HTTP/2
//! authority repair in front of the client port.

use std::io::Write;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use ferry_server::authority::AuthorityRepair;
use ferry_server::backup::{self, BackupError};
use ferry_server::command::decode_command;
use ferry_server::error::CodecError;
use ferry_server::kv_state::{KvLimits, KvState, Reads};
use tokio::io::{AsyncRead, ReadBuf};

use crate::alloc::assert_bounded;
use crate::Verdict;

/// The limits the server targets run the state machine with: the defaults.
fn limits() -> KvLimits {
    KvLimits::default()
}

/// A key-value snapshot as a member restores it from a leader (the magic,
/// the protobuf body, a crc32c): it never panics, holds memory bounded by
/// the snapshot's size, and a state it accepts is one it would send: its
/// own snapshot restores to the same state and encodes to the same bytes.
/// (A changed byte always fails the checksum, which the mutation tests
/// check.)
pub fn kv_snapshot(data: &[u8]) -> Verdict {
    let restored = assert_bounded(
        "kv_snapshot",
        data.len(),
        16 * data.len() + (4 << 20),
        || KvState::restore(data, limits()),
    );
    match restored {
        Ok(state) => {
            let snapshot = state.snapshot().expect("an in-memory state encodes");
            let again = KvState::restore(&snapshot, limits())
                .expect("the snapshot of an accepted state restores");
            assert_eq!(again, state, "a state and its own snapshot differ");
            assert_eq!(
                again.snapshot().expect("an in-memory state encodes"),
                snapshot
            );
            // A member goes on from a snapshot it installed: the entries
            // after it apply to the state it accepted.
            for command in crate::seeds::commands() {
                command_apply_on(&state, &command);
            }
            Verdict::Accepted
        }
        Err(error) => {
            assert_codec_error(&error);
            Verdict::Refused
        }
    }
}

fn assert_codec_error(error: &CodecError) {
    match error {
        CodecError::BadMagic
        | CodecError::Truncated { .. }
        | CodecError::ChecksumMismatch { .. }
        | CodecError::Malformed(_)
        | CodecError::Inconsistent(_) => {}
        CodecError::Empty
        | CodecError::UnknownVersion { .. }
        | CodecError::MissingKind
        | CodecError::Read(_) => panic!("a snapshot in memory was refused with {error}"),
    }
}

/// A scratch file for one thread's backup inputs.
fn scratch_path(label: &str) -> PathBuf {
    let thread = format!("{:?}", std::thread::current().id());
    let thread: String = thread.chars().filter(char::is_ascii_alphanumeric).collect();
    std::env::temp_dir().join(format!(
        "ferry-fuzz-{}-{label}-{thread}",
        std::process::id()
    ))
}

/// A backup file (`etcdctl snapshot save`'s output: the snapshot, zero
/// padding to 512 bytes with its length, a SHA-256) as `ferry snapshot
/// status` and `restore` read it: never a panic, memory bounded by the
/// file, and one that is inspected whole is restored into a new data
/// directory with the same revisions, and one that is not leaves the data
/// directory empty.
pub fn backup_file(data: &[u8]) -> Verdict {
    let path = scratch_path("backup");
    let written = std::fs::File::create(&path).and_then(|mut file| file.write_all(data));
    written.expect("the temporary directory takes files");
    let inspected = assert_bounded(
        "backup_file",
        data.len(),
        16 * data.len() + (4 << 20),
        || backup::inspect(&path),
    );
    let verdict = match inspected {
        Ok(info) => {
            assert_eq!(info.size_bytes, data.len() as u64);
            let data_dir = scratch_path("restore");
            let _ = std::fs::remove_dir_all(&data_dir);
            let restored = backup::restore(&path, &data_dir, limits());
            let _ = std::fs::remove_dir_all(&data_dir);
            let restored = restored.expect("a backup that inspects whole restores");
            assert_eq!(restored.revision, info.revision);
            Verdict::Accepted
        }
        Err(error) => {
            match &error {
                BackupError::TooShort { .. }
                | BackupError::HashMismatch { .. }
                | BackupError::Malformed { .. } => {}
                BackupError::Snapshot { source, .. } => assert_codec_error(source),
                other => panic!("a backup was refused with {other}"),
            }
            Verdict::Refused
        }
    };
    let _ = std::fs::remove_file(&path);
    verdict
}

/// A state with a little of everything (keys with several versions, a
/// lease with keys, a compaction), that commands are applied to.
pub fn populated_state() -> KvState {
    use ferry_server::command::{command, CommandKind, LeaseGrantCommand};
    use ferry_server::pb::etcdserverpb::{CompactionRequest, DeleteRangeRequest, PutRequest};
    let mut state = KvState::new(limits());
    let put = |key: &str, value: &str, lease: i64| {
        command(CommandKind::Put(PutRequest {
            key: bytes::Bytes::copy_from_slice(key.as_bytes()),
            value: bytes::Bytes::copy_from_slice(value.as_bytes()),
            lease,
            ..PutRequest::default()
        }))
    };
    let commands = [
        command(CommandKind::LeaseGrant(LeaseGrantCommand {
            id: 7,
            ttl_seconds: 60,
        })),
        put("a", "1", 0),
        put("a", "2", 0),
        put("b", "1", 7),
        put("c/x", "1", 0),
        put("c/y", "1", 0),
        command(CommandKind::DeleteRange(DeleteRangeRequest {
            key: "c/y".into(),
            ..DeleteRangeRequest::default()
        })),
        command(CommandKind::Compact(CompactionRequest {
            revision: 3,
            physical: false,
        })),
        put("d", "", 0),
    ];
    for (index, command) in (1u64..).zip(&commands) {
        let applied = state.apply(index, command);
        assert!(applied.response.is_ok(), "{command:?}: {applied:?}");
    }
    state
}

/// A committed entry's bytes, decoded and applied as every member applies
/// it: it never crashes a member whatever it holds (a malformed command is
/// refused, the index consumed); applying it is deterministic (two members
/// reach the same state and answer) and does not depend on whether the
/// member builds the reads' results; memory stays bounded by the entry and
/// the state.
pub fn command_apply(data: &[u8]) -> Verdict {
    command_apply_on(&populated_state(), data)
}

/// [`command_apply`] on a given state.
pub fn command_apply_on(base: &KvState, data: &[u8]) -> Verdict {
    // The log hands a machine its entries as `Bytes`.
    let entry = bytes::Bytes::copy_from_slice(data);
    // The entry after the state's applied index (a state restored from a
    // snapshot may stand at any index).
    let Some(index) = base.applied_index().checked_add(1) else {
        let mut state = base.clone();
        let applied = state.apply_bytes_with(u64::MAX, &entry, Reads::Build);
        assert!(
            applied.response.is_err(),
            "an entry past the last index was applied"
        );
        return Verdict::Refused;
    };
    // What applying may hold is bounded by the entry and, for the results
    // of its reads, by the state it reads (a range of every key copies
    // them into its answer, up to the txn response limit): a state of a
    // few MiB takes a few times that.
    let state_bytes = base.snapshot().map_or(0, |snapshot| snapshot.len());
    let mut built = base.clone();
    let applied = assert_bounded(
        "command_apply",
        data.len(),
        64 * data.len() + 8 * state_bytes + (8 << 20),
        || built.apply_bytes_with(index, &entry, Reads::Build),
    );
    let mut sized = base.clone();
    let sized_applied = sized.apply_bytes_with(index, &entry, Reads::SizeOnly);
    assert_eq!(built, sized, "the state depends on whether reads are built");
    assert_eq!(applied.revision, sized_applied.revision);
    assert_eq!(
        applied.response.is_ok(),
        sized_applied.response.is_ok(),
        "the outcome depends on whether reads are built"
    );
    assert_eq!(
        built.applied_index(),
        index,
        "the entry's index was not consumed"
    );
    let mut again = base.clone();
    assert_eq!(
        again.apply_bytes_with(index, &entry, Reads::Build),
        applied,
        "applying one entry twice gave two answers"
    );
    assert_eq!(again, built);
    // The state it leaves is one a snapshot carries whole.
    let snapshot = built.snapshot().expect("an in-memory state encodes");
    let restored = KvState::restore(&snapshot, limits()).expect("a state's own snapshot restores");
    assert_eq!(restored, built, "a state and its own snapshot differ");
    match decode_command(&entry) {
        Ok(_) => Verdict::accepted_if(applied.response.is_ok()),
        Err(_) => {
            assert!(
                applied.response.is_err(),
                "bytes that do not decode were applied"
            );
            Verdict::Refused
        }
    }
}

/// Reads the bytes of `pieces` one piece per read, as a socket delivers
/// them.
struct Pieces<'a> {
    pieces: Vec<&'a [u8]>,
    next: usize,
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let Some(piece) = self.pieces.get(self.next).copied() else {
            return Poll::Ready(Ok(()));
        };
        let count = piece.len().min(buf.remaining());
        buf.put_slice(&piece[..count]);
        if count == piece.len() {
            self.next += 1;
        } else {
            let next = self.next;
            self.pieces[next] = &piece[count..];
        }
        Poll::Ready(Ok(()))
    }
}

/// What the HTTP/2 server under the repair reads, in one string, or the
/// error that closed the connection.
fn repaired(pieces: Vec<&[u8]>) -> Result<Vec<u8>, String> {
    let mut repair = AuthorityRepair::new(Pieces { pieces, next: 0 });
    let mut context = Context::from_waker(Waker::noop());
    let mut out = Vec::new();
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let mut read = ReadBuf::new(&mut buffer);
        match Pin::new(&mut repair).poll_read(&mut context, &mut read) {
            Poll::Ready(Ok(())) if read.filled().is_empty() => return Ok(out),
            Poll::Ready(Ok(())) => out.extend_from_slice(read.filled()),
            Poll::Ready(Err(error)) => return Err(error.to_string()),
            Poll::Pending => panic!("the repair waits on a source that never waits"),
        }
    }
}

/// The HTTP/2 `:authority` repair in front of the client port, fed a
/// client's bytes: it never panics, holds memory bounded by its header
/// limits, what the server reads does not depend on how the bytes arrived,
/// and a connection that does not open with the HTTP/2 preface reaches the
/// server byte for byte as it was sent.
pub fn authority(data: &[u8]) -> Verdict {
    let whole = assert_bounded("authority", data.len(), 4 * data.len() + (1 << 20), || {
        repaired(vec![data])
    });
    for piece_bytes in [1, 9, 1000] {
        if piece_bytes >= data.len() || (piece_bytes == 1 && data.len() > 2048) {
            continue;
        }
        let pieces = data.chunks(piece_bytes).collect();
        assert_eq!(
            repaired(pieces),
            whole,
            "the output depends on how the input was cut"
        );
    }
    if !data.starts_with(PREFACE) {
        assert_eq!(
            whole.as_deref(),
            Ok(data),
            "bytes that are not HTTP/2 were changed"
        );
    }
    Verdict::accepted_if(whole.is_ok())
}

/// What an HTTP/2 client sends first (RFC 9113, section 3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Builders of valid encodings, for seeds and for turning a fuzzer's bytes
/// into inputs whose checksums match.
pub mod build {
    /// `body` (a snapshot's magic and protobuf) with its crc32c appended.
    pub fn kv_snapshot(body: &[u8]) -> Vec<u8> {
        let mut out = body.to_vec();
        out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
        out
    }

    /// A backup holding `snapshot`: zero padding to 512 bytes with the
    /// snapshot's length in its last eight, then the SHA-256 of it all.
    pub fn backup(snapshot: &[u8]) -> Vec<u8> {
        let content_bytes = snapshot.len() as u64;
        let padding_bytes = (512 - (content_bytes + 8) % 512) % 512;
        let mut out = snapshot.to_vec();
        out.resize(out.len() + padding_bytes as usize, 0);
        out.extend_from_slice(&content_bytes.to_le_bytes());
        let hash = ring::digest::digest(&ring::digest::SHA256, &out);
        out.extend_from_slice(hash.as_ref());
        out
    }
}
