//! What a nemesis run records: every client operation with its times and
//! answer, every response a watcher received, and every fault, one JSON
//! object per line (`history.jsonl` in the run's directory).
//!
//! The first line is a [`Header`]; `ferry lincheck` recognizes the file by
//! it and checks the register operations, and `ferry nemesis --check FILE`
//! runs every check of a run again on a saved history. Times are
//! microseconds since the run started, on the one clock of the process
//! that ran every client, so they order operations across clients.
//!
//! Keys are the strings the clients used: registers are `r/<n>` (read,
//! written and compared-and-set by the register clients; values are
//! decimal numbers, unique per write), lease keys are `l/<n>` (each put
//! once, attached to a lease). Watchers watch every key of the test.

use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// The `format` field of the header line.
pub const FORMAT: &str = "ferry-nemesis-history";
/// The version of the format this build writes and reads.
pub const VERSION: u32 = 1;
/// The prefix of register keys.
pub const REGISTER_PREFIX: &str = "r/";
/// The prefix of lease keys.
pub const LEASE_PREFIX: &str = "l/";
/// Longest line read back, so that a damaged file cannot make the reader
/// hold an unbounded line (a watch response of a few hundred events is a
/// few tens of KiB).
pub const LINE_BYTES_MAX: usize = 16 * 1024 * 1024;

/// One line of a history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "kebab-case")]
pub enum Record {
    /// The first line: what ran.
    Header(Header),
    /// A client operation.
    Op(OpRecord),
    /// Something a watcher saw or did.
    Watch(WatchRecord),
    /// A fault applied or healed.
    Fault(FaultRecord),
}

/// The first line of a history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Always [`FORMAT`].
    pub format: String,
    /// The format's version ([`VERSION`]).
    pub version: u32,
    /// The seed the run's faults and operations were drawn from.
    pub seed: u64,
    /// How long faults were applied, in seconds.
    pub secs: u64,
    /// How many members the cluster had.
    pub members: u64,
    /// Whether register reads were serializable (may be stale: the
    /// negative control).
    pub serializable_reads: bool,
}

/// How an operation ended, as its client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// It took effect (for a compare-and-set: its compare held and it
    /// wrote).
    Ok,
    /// It certainly had no effect: a compare that failed, or an error the
    /// server gives only for requests it did not carry out.
    Fail,
    /// The client does not know: a timeout, a lost connection, or an
    /// error that may come after the request was proposed.
    Unknown,
}

/// What a client asked for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "f", rename_all = "kebab-case")]
pub enum Op {
    /// A Range of one key.
    Get {
        /// The key.
        key: String,
        /// Whether the read was serializable (served from the member's own
        /// state, possibly stale) rather than linearizable.
        serializable: bool,
    },
    /// A Put.
    Put {
        /// The key.
        key: String,
        /// The value, unique in the run.
        value: String,
        /// The lease the key was attached to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<i64>,
    },
    /// A Txn: if the key's value is `from`, put `to`.
    Cas {
        /// The key.
        key: String,
        /// The value compared.
        from: String,
        /// The value written when the compare holds (unique in the run).
        to: String,
    },
    /// A LeaseGrant.
    LeaseGrant {
        /// The TTL asked for, in seconds.
        ttl_secs: i64,
    },
    /// One LeaseKeepAlive request and its answer.
    LeaseKeepAlive {
        /// The lease.
        lease: i64,
    },
    /// A LeaseTimeToLive.
    LeaseTimeToLive {
        /// The lease.
        lease: i64,
    },
    /// A LeaseRevoke.
    LeaseRevoke {
        /// The lease.
        lease: i64,
    },
    /// An AlarmRequest that disarms every NOSPACE alarm (what an operator
    /// does once a full disk has room again).
    DisarmNoSpace,
}

/// A client operation and its answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRecord {
    /// The client that ran it; a client runs one operation at a time.
    pub process: u64,
    /// The member it was sent to.
    pub member: u64,
    /// When the client sent it.
    pub invoked_us: u64,
    /// When the client had its answer; `None` when the outcome is unknown.
    pub completed_us: Option<u64>,
    /// What it asked for.
    pub op: Op,
    /// How it ended.
    pub outcome: Outcome,
    /// The store revision in the answer's header (for a put or a
    /// compare-and-set that wrote: the revision of the write).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<i64>,
    /// For a get that succeeded: whether the key existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub found: Option<bool>,
    /// For a get that found the key: its value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// For a get that found the key: the lease it is attached to (0: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_lease: Option<i64>,
    /// For a lease grant: the id of the lease granted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<i64>,
    /// For a time-to-live or a keep-alive: the TTL answered, in seconds
    /// (-1 or 0: the lease does not exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<i64>,
    /// The error, for an outcome other than `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One event of a watch response.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WatchEvent {
    /// The revision that made the change.
    pub revision: i64,
    /// The key.
    pub key: String,
    /// Whether the key was deleted (otherwise put).
    pub delete: bool,
    /// The value put (empty for a delete).
    pub value: String,
    /// The lease the value was attached to (0: none).
    pub lease: i64,
}

/// What a watcher saw or did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRecord {
    /// The watcher (one per watch stream the test keeps open).
    pub watcher: u64,
    /// When.
    pub at_us: u64,
    /// What.
    pub event: WatchStep,
}

/// The steps of a watcher's life, in the order its stream gave them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "kebab-case")]
pub enum WatchStep {
    /// A stream was opened on `member`, asking for every event from
    /// `start_revision` on (1 for the first; after a disconnect, one past
    /// the last revision the watcher knew to be complete).
    Open {
        /// The member.
        member: u64,
        /// The first revision asked for.
        start_revision: i64,
    },
    /// The member confirmed the watch.
    Created,
    /// A response carrying events.
    Events {
        /// The revision in the response's header.
        header_revision: i64,
        /// The events, as sent.
        events: Vec<WatchEvent>,
    },
    /// A progress notification: every event through `revision` has been
    /// sent on this stream.
    Progress {
        /// The revision in the response's header.
        revision: i64,
    },
    /// The member cancelled the watch.
    Cancelled {
        /// Its reason.
        reason: String,
        /// When the start revision was compacted: the compaction revision.
        compact_revision: i64,
    },
    /// The stream ended: an error, a lost connection, or the watcher
    /// closed it on purpose (to resume from a revision elsewhere).
    Closed {
        /// Why.
        reason: String,
        /// Whether the watcher closed it on purpose.
        deliberate: bool,
    },
}

/// A fault, as the nemesis applied or healed it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRecord {
    /// When.
    pub at_us: u64,
    /// Which fault (`partition`, `one-way`, `loss`, `pause`, `kill`,
    /// `disk-full`, `disk-stall`).
    pub fault: String,
    /// Whether this applies it or heals it.
    pub heal: bool,
    /// The members it struck.
    pub targets: Vec<u64>,
    /// What else is worth knowing (the other side of a partition, the
    /// loss rate, whether a target was the leader).
    pub detail: String,
}

/// Collects the records of a run, from every task, on one clock.
#[derive(Clone)]
pub struct Recorder {
    started: Instant,
    records: Arc<Mutex<Vec<Record>>>,
}

impl Recorder {
    /// A recorder whose clock starts now, with the header first.
    pub fn new(header: Header) -> Recorder {
        Recorder {
            started: Instant::now(),
            records: Arc::new(Mutex::new(vec![Record::Header(header)])),
        }
    }

    /// Microseconds since the run started.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Adds a record.
    pub fn push(&self, record: Record) {
        // A task that panicked while holding the lock left a whole vector.
        self.records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(record);
    }

    /// Everything recorded so far.
    pub fn records(&self) -> Vec<Record> {
        self.records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

/// Why a history file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file could not be read.
    #[error("cannot read it: {0}")]
    Io(#[from] std::io::Error),
    /// The first line is not a nemesis history header of this version.
    #[error("line 1 is not a `{FORMAT}` header of version {VERSION}")]
    NotAHistory,
    /// A line is too long.
    #[error("line {line} is longer than {LINE_BYTES_MAX} bytes")]
    LineTooLong {
        /// The line (from 1).
        line: usize,
    },
    /// A line is not a record.
    #[error("line {line}: {reason}")]
    BadLine {
        /// The line (from 1).
        line: usize,
        /// What the JSON parser said.
        reason: String,
    },
}

/// Whether `first_line` starts a nemesis history.
pub fn is_history(first_line: &str) -> bool {
    match serde_json::from_str::<Record>(first_line) {
        Ok(Record::Header(header)) => header.format == FORMAT,
        _ => false,
    }
}

/// Writes `records` as JSON lines.
pub fn write(records: &[Record], out: impl Write) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(out);
    for record in records {
        serde_json::to_writer(&mut out, record)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

/// Reads a history written by [`write()`]: a header of this version, then
/// records. Blank lines are skipped.
pub fn read(input: impl BufRead) -> Result<Vec<Record>, ReadError> {
    let mut records = Vec::new();
    let mut input = input.take(u64::MAX);
    let mut line = Vec::new();
    let mut number = 0;
    loop {
        line.clear();
        number += 1;
        // Bounded: a line longer than the limit is refused without holding
        // more of it than the limit.
        input.set_limit(LINE_BYTES_MAX as u64 + 1);
        let read = input.read_until(b'\n', &mut line)?;
        if read == 0 {
            break;
        }
        if line.len() > LINE_BYTES_MAX {
            return Err(ReadError::LineTooLong { line: number });
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let record: Record = serde_json::from_str(text).map_err(|error| ReadError::BadLine {
            line: number,
            reason: error.to_string(),
        })?;
        if records.is_empty() {
            match &record {
                Record::Header(header) if header.format == FORMAT && header.version == VERSION => {}
                _ => return Err(ReadError::NotAHistory),
            }
        }
        records.push(record);
    }
    if records.is_empty() {
        return Err(ReadError::NotAHistory);
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            format: FORMAT.into(),
            version: VERSION,
            seed: 7,
            secs: 30,
            members: 3,
            serializable_reads: false,
        }
    }

    #[test]
    fn a_history_reads_back_as_written() {
        let records = vec![
            Record::Header(header()),
            Record::Op(OpRecord {
                process: 1,
                member: 2,
                invoked_us: 10,
                completed_us: Some(20),
                op: Op::Get {
                    key: "r/1".into(),
                    serializable: false,
                },
                outcome: Outcome::Ok,
                revision: Some(5),
                found: Some(true),
                value: Some("17".into()),
                value_lease: Some(0),
                lease: None,
                ttl_secs: None,
                error: None,
            }),
            Record::Watch(WatchRecord {
                watcher: 1,
                at_us: 11,
                event: WatchStep::Events {
                    header_revision: 5,
                    events: vec![WatchEvent {
                        revision: 5,
                        key: "r/1".into(),
                        delete: false,
                        value: "17".into(),
                        lease: 0,
                    }],
                },
            }),
            Record::Fault(FaultRecord {
                at_us: 12,
                fault: "kill".into(),
                heal: false,
                targets: vec![2],
                detail: "leader".into(),
            }),
        ];
        let mut bytes = Vec::new();
        write(&records, &mut bytes).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(is_history(text.lines().next().unwrap()));
        assert_eq!(read(&bytes[..]).unwrap(), records);
    }

    #[test]
    fn a_file_without_the_header_or_with_a_bad_line_is_refused() {
        assert!(matches!(read(&b""[..]), Err(ReadError::NotAHistory)));
        assert!(matches!(
            read(&b"{\"record\":\"fault\",\"at_us\":1,\"fault\":\"kill\",\"heal\":false,\"targets\":[],\"detail\":\"\"}\n"[..]),
            Err(ReadError::NotAHistory)
        ));
        let mut bytes = Vec::new();
        write(&[Record::Header(header())], &mut bytes).unwrap();
        bytes.extend_from_slice(b"{\"record\":\"op\"}\n");
        assert!(matches!(
            read(&bytes[..]),
            Err(ReadError::BadLine { line: 2, .. })
        ));
    }
}
