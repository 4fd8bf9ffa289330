//! Reads a key-value snapshot as a stream: one version at a time, so that
//! restoring a state of any size takes memory for one version and the
//! small parts (leases, members, auth), never for the whole.
//!
//! The encoding (see [`crate::kv_state::SnapshotSource`]) is the magic, the
//! protobuf encoding of `ferrypb::Snapshot` and a crc32c of all that
//! precedes it. Each `versions` field is decoded and handed out as it is
//! read; every other field is kept, in order, and decoded at the end (so
//! the result is what prost would decode from the whole message). The
//! checksum is known only at the end: whoever consumes versions before
//! then must be ready to throw them away ([`SnapshotReader::finish`]
//! refuses a snapshot whose checksum does not match).

use std::io::Read;

use prost::Message;

use crate::error::CodecError;
use crate::pb::ferrypb;

/// The magic a key-value snapshot starts with.
pub(crate) const SNAPSHOT_MAGIC: &[u8; 8] = b"FERRYKV1";

/// The field number of `Snapshot.versions`.
const FIELD_VERSIONS: u64 = 5;

/// Largest single field read into memory (a version is one key and one
/// value, far below this; a larger length is a damaged snapshot).
const FIELD_BYTES_MAX: u64 = 64 * 1024 * 1024;

/// Largest total of the fields other than versions (leases with their
/// keys, members, auth).
const SMALL_BYTES_MAX: usize = 256 * 1024 * 1024;

/// Bytes read from the source at a time.
const READ_BYTES: usize = 256 * 1024;

/// A snapshot being read (see the module docs).
pub(crate) struct SnapshotReader<'a> {
    source: &'a mut dyn Read,
    /// Bytes read and not yet consumed are `buffer[at..]`.
    buffer: Vec<u8>,
    at: usize,
    eof: bool,
    /// crc32c of every byte consumed.
    checksum: u32,
    /// Bytes consumed.
    consumed: u64,
    /// The fields other than versions, as they were encoded.
    small: Vec<u8>,
}

impl<'a> SnapshotReader<'a> {
    /// Starts reading, checking the magic.
    pub(crate) fn new(source: &'a mut dyn Read) -> Result<SnapshotReader<'a>, CodecError> {
        let mut reader = SnapshotReader {
            source,
            buffer: Vec::with_capacity(READ_BYTES),
            at: 0,
            eof: false,
            checksum: 0,
            consumed: 0,
            small: Vec::new(),
        };
        reader.fill(SNAPSHOT_MAGIC.len() + 4)?;
        if reader.available() < SNAPSHOT_MAGIC.len() + 4 {
            return Err(CodecError::Truncated {
                size_bytes: reader.available(),
            });
        }
        if &reader.buffer[..SNAPSHOT_MAGIC.len()] != SNAPSHOT_MAGIC {
            return Err(CodecError::BadMagic);
        }
        reader.consume(SNAPSHOT_MAGIC.len());
        Ok(reader)
    }

    fn available(&self) -> usize {
        self.buffer.len() - self.at
    }

    /// Reads until at least `wanted` bytes are available or the source ends.
    fn fill(&mut self, wanted: usize) -> Result<(), CodecError> {
        if self.available() >= wanted || self.eof {
            return Ok(());
        }
        self.buffer.drain(..self.at);
        self.at = 0;
        while self.buffer.len() < wanted && !self.eof {
            let start = self.buffer.len();
            // Room for one read, not for all that is wanted: what is wanted
            // comes from a length field, which may claim any size up to
            // FIELD_BYTES_MAX, and memory is spent on bytes that arrived,
            // not on bytes a damaged or forged snapshot only announces.
            self.buffer.resize(start + READ_BYTES, 0);
            let read = loop {
                match self.source.read(&mut self.buffer[start..]) {
                    Ok(read) => break read,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        self.buffer.truncate(start);
                        return Err(CodecError::Read(e.to_string()));
                    }
                }
            };
            self.buffer.truncate(start + read);
            self.eof = read == 0;
        }
        Ok(())
    }

    fn consume(&mut self, count: usize) {
        let bytes = &self.buffer[self.at..self.at + count];
        self.checksum = crc32c::crc32c_append(self.checksum, bytes);
        self.consumed = self.consumed.saturating_add(count as u64);
        self.at += count;
    }

    /// Whether only the 4-byte checksum is left.
    fn at_trailer(&mut self) -> Result<bool, CodecError> {
        self.fill(5)?;
        Ok(self.available() <= 4)
    }

    fn truncated(&self) -> CodecError {
        CodecError::Truncated {
            size_bytes: usize::try_from(self.consumed)
                .unwrap_or(usize::MAX)
                .saturating_add(self.available()),
        }
    }

    /// A varint at the front, without consuming it: its value and length.
    fn peek_varint(&mut self, skip: usize) -> Result<(u64, usize), CodecError> {
        self.fill(skip + 10)?;
        let mut rest = &self.buffer[self.at + skip..];
        let before = rest.len();
        let value = prost::encoding::decode_varint(&mut rest).map_err(|_| {
            CodecError::Malformed(format!("a bad varint at byte {}", self.consumed))
        })?;
        Ok((value, before - rest.len()))
    }

    /// The next version, or `None` once only the checksum is left.
    pub(crate) fn next_version(&mut self) -> Result<Option<ferrypb::SnapshotVersion>, CodecError> {
        loop {
            if self.at_trailer()? {
                return Ok(None);
            }
            let (key, key_len) = self.peek_varint(0)?;
            let field = key >> 3;
            let wire_type = key & 7;
            // The payload's length (and where it starts, after the key).
            let (payload_at, payload_len) = match wire_type {
                0 => {
                    let (_, len) = self.peek_varint(key_len)?;
                    (key_len, len as u64)
                }
                1 => (key_len, 8),
                2 => {
                    let (len, len_len) = self.peek_varint(key_len)?;
                    (key_len + len_len, len)
                }
                5 => (key_len, 4),
                _ => {
                    return Err(CodecError::Malformed(format!(
                        "wire type {wire_type} of field {field} at byte {}",
                        self.consumed
                    )))
                }
            };
            if payload_len > FIELD_BYTES_MAX {
                return Err(CodecError::Malformed(format!(
                    "field {field} of {payload_len} bytes at byte {} (at most {FIELD_BYTES_MAX})",
                    self.consumed
                )));
            }
            let whole = payload_at + payload_len as usize;
            self.fill(whole + 4)?;
            // The field must end before the checksum.
            if self.available() < whole + 4 {
                return Err(self.truncated());
            }
            if field == FIELD_VERSIONS && wire_type == 2 {
                let start = self.at + payload_at;
                let version = ferrypb::SnapshotVersion::decode(
                    &self.buffer[start..start + payload_len as usize],
                )
                .map_err(|e| {
                    CodecError::Malformed(format!("a version at byte {}: {e}", self.consumed))
                })?;
                self.consume(whole);
                return Ok(Some(version));
            }
            if self.small.len() + whole > SMALL_BYTES_MAX {
                return Err(CodecError::Malformed(format!(
                    "more than {SMALL_BYTES_MAX} bytes of leases, members and auth"
                )));
            }
            self.small
                .extend_from_slice(&self.buffer[self.at..self.at + whole]);
            self.consume(whole);
        }
    }

    /// Checks the checksum and nothing after it, and decodes everything but
    /// the versions. Call once [`SnapshotReader::next_version`] said `None`.
    pub(crate) fn finish(mut self) -> Result<ferrypb::Snapshot, CodecError> {
        self.fill(5)?;
        if self.available() != 4 {
            return Err(self.truncated());
        }
        let trailer = &self.buffer[self.at..self.at + 4];
        let stored = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
        if stored != self.checksum {
            return Err(CodecError::ChecksumMismatch {
                stored,
                computed: self.checksum,
            });
        }
        ferrypb::Snapshot::decode(self.small.as_slice())
            .map_err(|e| CodecError::Malformed(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source that records the largest buffer it was handed to fill.
    struct Recording<'a> {
        data: &'a [u8],
        largest_buffer_bytes: usize,
    }

    impl Read for Recording<'_> {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            self.largest_buffer_bytes = self.largest_buffer_bytes.max(out.len());
            self.data.read(out)
        }
    }

    /// Found by fuzzing (`crates/fuzz`, kv_snapshot): a snapshot of a few
    /// bytes whose first field announced 60 MiB made the reader allocate
    /// and zero 60 MiB before it found the bytes missing. Memory now goes
    /// only to bytes that arrive, one read at a time.
    #[test]
    fn a_field_announcing_more_than_arrives_allocates_only_what_arrives() {
        let mut snapshot = SNAPSHOT_MAGIC.to_vec();
        snapshot.push((FIELD_VERSIONS << 3 | 2) as u8);
        prost::encoding::encode_varint(60 << 20, &mut snapshot);
        snapshot.extend_from_slice(&[0u8; 100]);
        let mut source = Recording {
            data: &snapshot,
            largest_buffer_bytes: 0,
        };
        let mut reader = SnapshotReader::new(&mut source).unwrap();
        assert!(matches!(
            reader.next_version(),
            Err(CodecError::Truncated { .. })
        ));
        assert!(reader.buffer.capacity() <= 2 * READ_BYTES);
        drop(reader);
        assert!(source.largest_buffer_bytes <= READ_BYTES);
    }
}
