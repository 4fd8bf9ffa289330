//! The replicated state machine the simulator runs on every node: a set of
//! registers (`u64` key -> optional `u64` value) with write and
//! compare-and-set, plus a per-client session table that records the last
//! operation each client had applied and its result. The session table lets
//! a client learn the outcome of its proposal even when the node it asked
//! skipped the entry by installing a snapshot.

use std::collections::BTreeMap;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use ferry_raft::{Configuration, Entry, EntryPayload, Index, Term};

/// A client command, as carried in a log entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Set `key` to `value`.
    Write {
        /// The client that issued it.
        client: u64,
        /// The client's operation number (the same across retries).
        op_seq: u64,
        /// The register.
        key: u64,
        /// The new value.
        value: u64,
    },
    /// Set `key` to `to` if it holds `from`.
    Cas {
        /// The client that issued it.
        client: u64,
        /// The client's operation number.
        op_seq: u64,
        /// The register.
        key: u64,
        /// The expected value.
        from: u64,
        /// The new value.
        to: u64,
    },
}

/// Why bytes could not be decoded (a command or a snapshot).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes end before the value does.
    #[error("{what} is truncated: {len} bytes")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// How many bytes there were.
        len: usize,
    },
    /// An unknown tag or magic number.
    #[error("{what} has an unknown tag {tag}")]
    UnknownTag {
        /// What was being decoded.
        what: &'static str,
        /// The tag found.
        tag: u64,
    },
    /// Bytes left over after the value.
    #[error("{what} has {extra} trailing bytes")]
    Trailing {
        /// What was being decoded.
        what: &'static str,
        /// How many.
        extra: usize,
    },
    /// A declared element count larger than the bytes can hold.
    #[error("{what} declares {count} elements, more than its bytes can hold")]
    BadCount {
        /// What was being decoded.
        what: &'static str,
        /// The declared count.
        count: u64,
    },
}

const TAG_WRITE: u8 = 1;
const TAG_CAS: u8 = 2;
const SNAPSHOT_MAGIC: u64 = 0x6665_7272_7973_6e70; // "ferrysnp"

impl Command {
    /// The client that issued the command.
    pub fn client(&self) -> u64 {
        match self {
            Command::Write { client, .. } | Command::Cas { client, .. } => *client,
        }
    }

    /// The client's operation number.
    pub fn op_seq(&self) -> u64 {
        match self {
            Command::Write { op_seq, .. } | Command::Cas { op_seq, .. } => *op_seq,
        }
    }

    /// The command's wire form.
    pub fn encode(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(41);
        match *self {
            Command::Write {
                client,
                op_seq,
                key,
                value,
            } => {
                buf.put_u8(TAG_WRITE);
                buf.put_u64_le(client);
                buf.put_u64_le(op_seq);
                buf.put_u64_le(key);
                buf.put_u64_le(value);
            }
            Command::Cas {
                client,
                op_seq,
                key,
                from,
                to,
            } => {
                buf.put_u8(TAG_CAS);
                buf.put_u64_le(client);
                buf.put_u64_le(op_seq);
                buf.put_u64_le(key);
                buf.put_u64_le(from);
                buf.put_u64_le(to);
            }
        }
        buf.freeze()
    }

    /// Parses a command; never panics on any input.
    pub fn decode(bytes: &[u8]) -> Result<Command, DecodeError> {
        const WHAT: &str = "command";
        let mut buf = bytes;
        if buf.remaining() < 1 {
            return Err(DecodeError::Truncated {
                what: WHAT,
                len: bytes.len(),
            });
        }
        let tag = buf.get_u8();
        let words = match tag {
            TAG_WRITE => 4,
            TAG_CAS => 5,
            other => {
                return Err(DecodeError::UnknownTag {
                    what: WHAT,
                    tag: u64::from(other),
                })
            }
        };
        if buf.remaining() < words * 8 {
            return Err(DecodeError::Truncated {
                what: WHAT,
                len: bytes.len(),
            });
        }
        if buf.remaining() > words * 8 {
            return Err(DecodeError::Trailing {
                what: WHAT,
                extra: buf.remaining() - words * 8,
            });
        }
        let client = buf.get_u64_le();
        let op_seq = buf.get_u64_le();
        let key = buf.get_u64_le();
        let a = buf.get_u64_le();
        Ok(if tag == TAG_WRITE {
            Command::Write {
                client,
                op_seq,
                key,
                value: a,
            }
        } else {
            Command::Cas {
                client,
                op_seq,
                key,
                from: a,
                to: buf.get_u64_le(),
            }
        })
    }
}

/// What applying one command did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommandResult {
    /// A write took effect.
    Written,
    /// A compare-and-set matched and took effect.
    Swapped,
    /// A compare-and-set did not match: no effect.
    CompareFailed,
}

/// A client's last applied operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Session {
    /// The operation number.
    pub op_seq: u64,
    /// Its result.
    pub result: CommandResult,
}

/// Why an entry could not be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// The engine handed over an entry that does not follow the last applied one.
    #[error("entry {got} handed to the state machine, which expected {expected}")]
    OutOfOrder {
        /// The index expected next.
        expected: Index,
        /// The index handed over.
        got: Index,
    },
    /// The entry's command is not one the simulator wrote.
    #[error("entry {index} carries an undecodable command: {source}")]
    BadCommand {
        /// The entry.
        index: Index,
        /// Why.
        source: DecodeError,
    },
}

/// The register state machine of one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegisterMachine {
    registers: BTreeMap<u64, u64>,
    sessions: BTreeMap<u64, Session>,
    applied: Index,
    applied_term: Term,
    config: Configuration,
}

impl RegisterMachine {
    /// An empty machine that has applied nothing, under `config`.
    pub fn new(config: Configuration) -> Self {
        RegisterMachine {
            config,
            ..RegisterMachine::default()
        }
    }

    /// The value of a register.
    pub fn get(&self, key: u64) -> Option<u64> {
        self.registers.get(&key).copied()
    }

    /// The last applied operation of `client`.
    pub fn session(&self, client: u64) -> Option<Session> {
        self.sessions.get(&client).copied()
    }

    /// The last applied index.
    pub fn applied(&self) -> Index {
        self.applied
    }

    /// The term of the last applied entry (or of the snapshot restored).
    pub fn applied_term(&self) -> Term {
        self.applied_term
    }

    /// The membership as of the last applied entry.
    pub fn config(&self) -> &Configuration {
        &self.config
    }

    /// Applies one committed entry. Returns the command's result for
    /// command entries.
    pub fn apply(&mut self, entry: &Entry) -> Result<Option<(Command, CommandResult)>, ApplyError> {
        if entry.index != self.applied + 1 {
            return Err(ApplyError::OutOfOrder {
                expected: self.applied + 1,
                got: entry.index,
            });
        }
        let outcome = match &entry.payload {
            EntryPayload::Noop => None,
            EntryPayload::Config(config) => {
                self.config = config.clone();
                None
            }
            EntryPayload::Command(bytes) => {
                let command = Command::decode(bytes).map_err(|source| ApplyError::BadCommand {
                    index: entry.index,
                    source,
                })?;
                let result = match command {
                    Command::Write { key, value, .. } => {
                        self.registers.insert(key, value);
                        CommandResult::Written
                    }
                    Command::Cas { key, from, to, .. } => {
                        if self.registers.get(&key) == Some(&from) {
                            self.registers.insert(key, to);
                            CommandResult::Swapped
                        } else {
                            CommandResult::CompareFailed
                        }
                    }
                };
                self.sessions.insert(
                    command.client(),
                    Session {
                        op_seq: command.op_seq(),
                        result,
                    },
                );
                Some((command, result))
            }
        };
        self.applied = entry.index;
        self.applied_term = entry.term;
        Ok(outcome)
    }

    /// The machine's state as snapshot bytes (registers and sessions; the
    /// index, term and configuration travel in the snapshot's metadata).
    pub fn encode_snapshot(&self) -> Bytes {
        let mut buf = BytesMut::new();
        buf.put_u64_le(SNAPSHOT_MAGIC);
        buf.put_u64_le(self.registers.len() as u64);
        for (key, value) in &self.registers {
            buf.put_u64_le(*key);
            buf.put_u64_le(*value);
        }
        buf.put_u64_le(self.sessions.len() as u64);
        for (client, session) in &self.sessions {
            buf.put_u64_le(*client);
            buf.put_u64_le(session.op_seq);
            buf.put_u8(match session.result {
                CommandResult::Written => 0,
                CommandResult::Swapped => 1,
                CommandResult::CompareFailed => 2,
            });
        }
        buf.freeze()
    }

    /// A machine restored from snapshot bytes, as of (`index`, `term`) under `config`.
    pub fn from_snapshot(
        bytes: &[u8],
        index: Index,
        term: Term,
        config: Configuration,
    ) -> Result<Self, DecodeError> {
        const WHAT: &str = "snapshot";
        let mut buf = bytes;
        let truncated = DecodeError::Truncated {
            what: WHAT,
            len: bytes.len(),
        };
        if buf.remaining() < 16 {
            return Err(truncated);
        }
        let magic = buf.get_u64_le();
        if magic != SNAPSHOT_MAGIC {
            return Err(DecodeError::UnknownTag {
                what: WHAT,
                tag: magic,
            });
        }
        let register_count = buf.get_u64_le();
        if register_count > (buf.remaining() / 16) as u64 {
            return Err(DecodeError::BadCount {
                what: WHAT,
                count: register_count,
            });
        }
        let mut registers = BTreeMap::new();
        for _ in 0..register_count {
            let key = buf.get_u64_le();
            let value = buf.get_u64_le();
            registers.insert(key, value);
        }
        if buf.remaining() < 8 {
            return Err(truncated);
        }
        let session_count = buf.get_u64_le();
        if session_count > (buf.remaining() / 17) as u64 {
            return Err(DecodeError::BadCount {
                what: WHAT,
                count: session_count,
            });
        }
        let mut sessions = BTreeMap::new();
        for _ in 0..session_count {
            let client = buf.get_u64_le();
            let op_seq = buf.get_u64_le();
            let result = match buf.get_u8() {
                0 => CommandResult::Written,
                1 => CommandResult::Swapped,
                2 => CommandResult::CompareFailed,
                other => {
                    return Err(DecodeError::UnknownTag {
                        what: WHAT,
                        tag: u64::from(other),
                    })
                }
            };
            sessions.insert(client, Session { op_seq, result });
        }
        if buf.has_remaining() {
            return Err(DecodeError::Trailing {
                what: WHAT,
                extra: buf.remaining(),
            });
        }
        Ok(RegisterMachine {
            registers,
            sessions,
            applied: index,
            applied_term: term,
            config,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command_entry(index: Index, term: Term, command: Command) -> Entry {
        Entry {
            index,
            term,
            payload: EntryPayload::Command(command.encode()),
        }
    }

    #[test]
    fn commands_round_trip_and_garbage_is_an_error() {
        let write = Command::Write {
            client: 1,
            op_seq: 2,
            key: 3,
            value: 4,
        };
        let cas = Command::Cas {
            client: 5,
            op_seq: 6,
            key: 7,
            from: 8,
            to: 9,
        };
        assert_eq!(Command::decode(&write.encode()), Ok(write));
        assert_eq!(Command::decode(&cas.encode()), Ok(cas));
        assert!(Command::decode(&[]).is_err());
        assert!(Command::decode(&[9, 0, 0]).is_err());
        assert!(Command::decode(&write.encode()[..20]).is_err());
        let mut long = write.encode().to_vec();
        long.push(0);
        assert!(Command::decode(&long).is_err());
    }

    #[test]
    fn write_and_cas_semantics_and_sessions() {
        let mut sm = RegisterMachine::new(Configuration::with_voters([1, 2, 3]));
        let cas_on_empty = Command::Cas {
            client: 1,
            op_seq: 1,
            key: 0,
            from: 5,
            to: 6,
        };
        let r = sm.apply(&command_entry(1, 1, cas_on_empty)).unwrap();
        assert_eq!(r, Some((cas_on_empty, CommandResult::CompareFailed)));
        assert_eq!(sm.get(0), None);
        let write = Command::Write {
            client: 1,
            op_seq: 2,
            key: 0,
            value: 5,
        };
        sm.apply(&command_entry(2, 1, write)).unwrap();
        assert_eq!(sm.get(0), Some(5));
        let cas = Command::Cas {
            client: 2,
            op_seq: 1,
            key: 0,
            from: 5,
            to: 6,
        };
        assert_eq!(
            sm.apply(&command_entry(3, 2, cas)).unwrap(),
            Some((cas, CommandResult::Swapped))
        );
        assert_eq!(sm.get(0), Some(6));
        assert_eq!(
            sm.session(1),
            Some(Session {
                op_seq: 2,
                result: CommandResult::Written
            })
        );
        assert_eq!(sm.applied(), 3);
        assert_eq!(sm.applied_term(), 2);
    }

    #[test]
    fn out_of_order_entries_are_refused() {
        let mut sm = RegisterMachine::default();
        let noop = Entry {
            index: 2,
            term: 1,
            payload: EntryPayload::Noop,
        };
        assert_eq!(
            sm.apply(&noop),
            Err(ApplyError::OutOfOrder {
                expected: 1,
                got: 2
            })
        );
    }

    #[test]
    fn snapshot_round_trip_and_corruption() {
        let mut sm = RegisterMachine::new(Configuration::with_voters([1]));
        for i in 1..=10 {
            let write = Command::Write {
                client: i % 3,
                op_seq: i,
                key: i % 4,
                value: i,
            };
            sm.apply(&command_entry(i, 1, write)).unwrap();
        }
        let config = Configuration::with_voters([1, 2]);
        sm.apply(&Entry {
            index: 11,
            term: 2,
            payload: EntryPayload::Config(config.clone()),
        })
        .unwrap();
        let bytes = sm.encode_snapshot();
        let restored = RegisterMachine::from_snapshot(&bytes, 11, 2, config).unwrap();
        assert_eq!(restored, sm);
        for cut in 0..bytes.len() {
            assert!(
                RegisterMachine::from_snapshot(&bytes[..cut], 11, 2, Configuration::default())
                    .is_err()
            );
        }
        let mut bad = bytes.to_vec();
        bad[0] ^= 1;
        assert!(RegisterMachine::from_snapshot(&bad, 11, 2, Configuration::default()).is_err());
    }
}
