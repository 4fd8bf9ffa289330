//! # ferry-fuzz: every decoder of untrusted bytes, fuzzed
//!
//! Bytes reach a node from peers (frames, the handshake, engine messages,
//! snapshot chunks), from clients (gRPC requests, the HTTP/2 bytes under
//! them) and from its disk (log records and segments, the log's state
//! files, snapshot files, key-value snapshots, backups). Each decoder has
//! one target here: a function that takes the bytes as they would arrive,
//! decodes them as the node would, and panics if a property the node relies
//! on does not hold:
//!
//! - no panic, whatever the bytes;
//! - no unbounded allocation: with [`alloc::CountingAllocator`] installed,
//!   the most memory held at once while decoding one input is bounded by a
//!   small multiple of its size plus a constant (or the decoder's
//!   documented limit);
//! - no hang: the work is bounded by the input's size (recovery asserts a
//!   time bound; the fuzzers see a hang as a timeout);
//! - nothing invalid accepted: a value decodes only from the bytes that
//!   encode it (so a changed byte is refused or read as what those bytes
//!   encode), a frame or file only with its checksum, a truncated input is
//!   refused or read as a torn tail, never as another value.
//!
//! | target | what it decodes | where the bytes come from |
//! | --- | --- | --- |
//! | [`peer::peer_frame`] | `[length][crc32c][payload]` frames, fed in pieces | a peer connection |
//! | [`peer::peer_handshake`] | the hello and the answer to it | a peer connection |
//! | [`peer::peer_message`] | engine messages (entries, snapshot chunks, ...) | a peer's frame |
//! | [`storage::wal_record`] | one log record, its frame, the engine values it holds | the log on disk |
//! | [`storage::wal_segment`] | a whole segment, through recovery | the log on disk |
//! | [`storage::log_state`] | the log's state file and sync progress file | the log on disk |
//! | [`storage::snapshot_file`] | a snapshot file (header, blocks, trailer) | the snapshot directory |
//! | [`server::kv_snapshot`] | a key-value snapshot (magic, protobuf, crc32c) | a leader, or the disk |
//! | [`server::backup_file`] | a backup (`etcdctl snapshot save`) | an operator's file |
//! | [`server::command_apply`] | a replicated command, decoded and applied | a committed log entry |
//! | [`server::authority`] | a client's HTTP/2 bytes through the authority repair | a client connection |
//!
//! Structured targets check what a byte target cannot know:
//! [`storage::wal_recovery`] writes a real log, damages one of its files
//! and checks that recovery never takes a damaged record for a valid one;
//! [`storage::snapshot_chunks`] does the same for a snapshot received in
//! chunks. The TCP transport's reading path and the gRPC API with extreme
//! values run against real sockets in this crate's tests.
//!
//! # Running
//!
//! `cargo test --release -p ferry-fuzz` runs every target through proptest
//! (part of `cargo test --workspace --release`): each file of
//! `crates/fuzz/corpus/<target>/` and its one-byte neighbours, mutations
//! of valid encodings (bit flips, truncations, insertions, splices, length
//! fields set to extremes), and valid structures with extreme field values.
//! `FERRY_FUZZ_CASES=N` sets the cases per property (default
//! [`DEFAULT_CASES`]) for long runs. Coverage-guided fuzzing with AFL++ on
//! the stable toolchain: see `fuzz/README.md` at the repository's root.

pub mod alloc;
pub mod mutate;
pub mod peer;
pub mod seeds;
pub mod server;
pub mod storage;

/// What a target made of one input: counted by the tests, so that a
/// mutation strategy that never gets past the checks shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The decoder took the input (all properties checked).
    Accepted,
    /// The decoder refused it with a typed error.
    Refused,
}

impl Verdict {
    /// [`Verdict::Accepted`] if `accepted`.
    pub fn accepted_if(accepted: bool) -> Verdict {
        if accepted {
            Verdict::Accepted
        } else {
            Verdict::Refused
        }
    }
}

/// The cases per property when `FERRY_FUZZ_CASES` is not set (some
/// properties run a multiple or a fraction of it, by their cost): the
/// whole suite then runs in about 30 seconds on two cores, once built.
pub const DEFAULT_CASES: u32 = 20_000;

/// The cases per property: `FERRY_FUZZ_CASES`, or `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("FERRY_FUZZ_CASES")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// A byte target: takes the bytes as they arrive.
pub type Target = fn(&[u8]) -> Verdict;

/// Every byte target, by the name of its corpus directory (and of its AFL++
/// harness).
pub const TARGETS: [(&str, Target); 11] = [
    ("peer_frame", peer::peer_frame),
    ("peer_handshake", peer::peer_handshake),
    ("peer_message", peer::peer_message),
    ("wal_record", storage::wal_record),
    ("wal_segment", storage::wal_segment),
    ("log_state", storage::log_state),
    ("snapshot_file", storage::snapshot_file),
    ("kv_snapshot", server::kv_snapshot),
    ("backup_file", server::backup_file),
    ("command_apply", server::command_apply),
    ("authority", server::authority),
];

/// The bytes target `name` decodes for a fuzzer's input: the first byte
/// says whether the rest goes to the decoder as it is (even) or first gets
/// the checksums and framing its format wants (odd: see the `build`
/// modules), so that a coverage-guided fuzzer explores what lies behind a
/// checksum as well as the checksum itself. `None` for an unknown name.
pub fn target_input(name: &str, data: &[u8]) -> Option<Vec<u8>> {
    let (&mode, rest) = data.split_first().unwrap_or((&0, &[]));
    TARGETS.iter().find(|(known, _)| *known == name)?;
    if mode % 2 == 0 {
        return Some(rest.to_vec());
    }
    Some(match name {
        "peer_frame" => {
            let mut out = bytes::BytesMut::new();
            ferry_runtime::transport::frame::encode_frame(rest, &mut out);
            out.to_vec()
        }
        "wal_segment" | "log_state" => storage::build::framed_from_fuzz(rest),
        "wal_record" => storage::build::framed(&[rest.to_vec()]),
        "snapshot_file" => storage::build::snapshot_file_from_fuzz(rest),
        "kv_snapshot" => server::build::kv_snapshot(rest),
        "backup_file" => server::build::backup(&server::build::kv_snapshot(rest)),
        "command_apply" => {
            let mut out = vec![ferry_server::command::COMMAND_FORMAT_VERSION];
            out.extend_from_slice(rest);
            out
        }
        "authority" => [server::PREFACE, rest].concat(),
        _ => rest.to_vec(),
    })
}

/// Runs target `name` on a fuzzer's input (see [`target_input`]); `None`
/// for an unknown name.
pub fn fuzz_one(name: &str, data: &[u8]) -> Option<Verdict> {
    let (_, target) = TARGETS.iter().find(|(known, _)| *known == name)?;
    Some(target(&target_input(name, data)?))
}
