//! Framing: `[u32 length][u32 crc32c][payload]`, both integers little endian.
//! The checksum catches corruption that TCP's weak checksum lets through, and
//! the length is bounded so a bad peer cannot make us allocate without limit.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The default largest payload a frame may carry.
pub const FRAME_BYTES_MAX_DEFAULT: u32 = 64 << 20;

/// The bytes in front of each payload.
pub const FRAME_HEADER_BYTES: usize = 8;

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// The length field is larger than the limit.
    #[error("peer sent a frame of {length_bytes} bytes, over the limit of {limit_bytes}")]
    TooLarge {
        /// The announced length.
        length_bytes: u32,
        /// The limit.
        limit_bytes: u32,
    },
    /// The payload does not match its checksum.
    #[error("frame checksum mismatch (expected {expected:#010x}, computed {computed:#010x}): the connection corrupted data")]
    Checksum {
        /// The checksum in the header.
        expected: u32,
        /// The checksum of the payload received.
        computed: u32,
    },
}

/// Appends one frame carrying `payload` to `out`.
pub fn encode_frame(payload: &[u8], out: &mut BytesMut) {
    out.reserve(FRAME_HEADER_BYTES + payload.len());
    out.put_u32_le(payload.len() as u32);
    out.put_u32_le(crc32c::crc32c(payload));
    out.put_slice(payload);
}

/// The bytes still missing from the frame at the front of `buffer` (its
/// header first), or 0 if a whole frame is there. Call after
/// [`decode_frame`] checked the length against the limit.
pub fn frame_bytes_missing(buffer: &[u8]) -> usize {
    let Some(length) = buffer.get(..4) else {
        return FRAME_HEADER_BYTES - buffer.len();
    };
    let length_bytes = u32::from_le_bytes([length[0], length[1], length[2], length[3]]);
    let total = FRAME_HEADER_BYTES.saturating_add(length_bytes as usize);
    total.saturating_sub(buffer.len())
}

/// Takes one whole frame off the front of `buffer`, if one is there.
/// Returns `Ok(None)` when more bytes are needed.
pub fn decode_frame(buffer: &mut BytesMut, limit_bytes: u32) -> Result<Option<Bytes>, FrameError> {
    if buffer.len() < FRAME_HEADER_BYTES {
        return Ok(None);
    }
    let length_bytes = u32::from_le_bytes([buffer[0], buffer[1], buffer[2], buffer[3]]);
    if length_bytes > limit_bytes {
        return Err(FrameError::TooLarge {
            length_bytes,
            limit_bytes,
        });
    }
    let expected = u32::from_le_bytes([buffer[4], buffer[5], buffer[6], buffer[7]]);
    let total = FRAME_HEADER_BYTES + length_bytes as usize;
    if buffer.len() < total {
        // No room is reserved for the rest here: a header alone must not
        // make us allocate what it announces (the reader grows the buffer
        // as the bytes arrive).
        return Ok(None);
    }
    buffer.advance(FRAME_HEADER_BYTES);
    let payload = buffer.split_to(length_bytes as usize).freeze();
    let computed = crc32c::crc32c(&payload);
    if computed != expected {
        return Err(FrameError::Checksum { expected, computed });
    }
    Ok(Some(payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_across_partial_reads() {
        let mut wire = BytesMut::new();
        encode_frame(b"hello", &mut wire);
        encode_frame(b"", &mut wire);
        encode_frame(&[7u8; 1000], &mut wire);
        let wire = wire.freeze();
        // Feed the bytes one at a time: frames come out whole and in order.
        let mut buffer = BytesMut::new();
        let mut frames = Vec::new();
        for byte in wire.iter() {
            buffer.put_u8(*byte);
            while let Some(frame) = decode_frame(&mut buffer, 4096).unwrap() {
                frames.push(frame);
            }
        }
        assert_eq!(frames.len(), 3);
        assert_eq!(&frames[0][..], b"hello");
        assert!(frames[1].is_empty());
        assert_eq!(&frames[2][..], &[7u8; 1000][..]);
        assert!(buffer.is_empty());
    }

    #[test]
    fn oversized_and_corrupt_frames_are_errors() {
        let mut wire = BytesMut::new();
        encode_frame(&[1u8; 100], &mut wire);
        let mut small_limit = wire.clone();
        assert_eq!(
            decode_frame(&mut small_limit, 10),
            Err(FrameError::TooLarge {
                length_bytes: 100,
                limit_bytes: 10
            })
        );
        let last = wire.len() - 1;
        wire[last] ^= 0xff;
        assert!(matches!(
            decode_frame(&mut wire, 4096),
            Err(FrameError::Checksum { .. })
        ));
    }
}
