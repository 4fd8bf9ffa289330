//! The peer port's decoders: frames, the handshake, engine messages.

use bytes::{BufMut, Bytes, BytesMut};
use ferry_runtime::transport::codec::{decode_message, encode_message};
use ferry_runtime::transport::frame::{
    decode_frame, encode_frame, frame_bytes_missing, FrameError, FRAME_HEADER_BYTES,
};
use ferry_runtime::transport::handshake::{
    decode_answer, encode_answer, HandshakeError, Hello, HELLO_BYTES, REASON_BYTES_MAX,
};

use crate::alloc::assert_bounded;
use crate::Verdict;

/// What one frame decoder run saw, to compare runs that were fed the same
/// bytes in different pieces.
#[derive(Debug, PartialEq, Eq)]
struct FrameRun {
    frames: Vec<Bytes>,
    error: Option<FrameError>,
    consumed_bytes: usize,
}

/// Feeds `data` to [`decode_frame`] `piece_bytes` at a time, as the TCP
/// reader does, and checks every frame against the bytes it came from.
fn frame_run(data: &[u8], limit_bytes: u32, piece_bytes: usize) -> FrameRun {
    let mut buffer = BytesMut::new();
    let mut run = FrameRun {
        frames: Vec::new(),
        error: None,
        consumed_bytes: 0,
    };
    for piece in data.chunks(piece_bytes.max(1)) {
        buffer.put_slice(piece);
        loop {
            let held_bytes = buffer.len();
            match decode_frame(&mut buffer, limit_bytes) {
                Ok(Some(payload)) => {
                    // A frame is exactly the header and payload it came
                    // from, within the limit and with its checksum.
                    let frame_bytes = FRAME_HEADER_BYTES + payload.len();
                    assert_eq!(held_bytes - buffer.len(), frame_bytes);
                    assert!(payload.len() <= limit_bytes as usize);
                    let start = run.consumed_bytes;
                    let mut reencoded = BytesMut::new();
                    encode_frame(&payload, &mut reencoded);
                    assert_eq!(&reencoded[..], &data[start..start + frame_bytes]);
                    run.consumed_bytes += frame_bytes;
                    run.frames.push(payload);
                }
                Ok(None) => {
                    // More bytes are needed, and the reader is told how many.
                    assert_eq!(held_bytes, buffer.len());
                    assert!(frame_bytes_missing(&buffer) > 0);
                    break;
                }
                Err(error) => {
                    let header = &data[run.consumed_bytes..run.consumed_bytes + 8];
                    let length_bytes =
                        u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
                    match &error {
                        FrameError::TooLarge { .. } => assert!(length_bytes > limit_bytes),
                        FrameError::Checksum { expected, computed } => {
                            assert_ne!(expected, computed);
                            let start = run.consumed_bytes + FRAME_HEADER_BYTES;
                            let payload = &data[start..start + length_bytes as usize];
                            assert_eq!(*computed, crc32c::crc32c(payload));
                        }
                    }
                    run.error = Some(error);
                    return run;
                }
            }
        }
    }
    run
}

/// Peer frames (`[length][crc32c][payload]`) as the TCP reader takes them
/// off a connection: every frame returned is exactly the bytes it came
/// from, within the limit, with a matching checksum; a frame over the limit
/// or failing its checksum is an error; more bytes are asked for only when
/// they are missing; the outcome does not depend on how the bytes arrived;
/// memory is bounded by the input.
pub fn peer_frame(data: &[u8]) -> Verdict {
    // The limit of a hello, of a handshake answer and the default.
    let limits = [
        HELLO_BYTES as u32,
        REASON_BYTES_MAX as u32,
        ferry_runtime::transport::FRAME_BYTES_MAX_DEFAULT,
    ];
    let mut accepted = false;
    for limit_bytes in limits {
        let whole = assert_bounded("peer_frame", data.len(), 2 * data.len() + 4096, || {
            frame_run(data, limit_bytes, data.len())
        });
        for piece_bytes in [1, 7, 4096] {
            if piece_bytes >= data.len() || (piece_bytes == 1 && data.len() > 4096) {
                continue;
            }
            assert_eq!(frame_run(data, limit_bytes, piece_bytes), whole);
        }
        accepted |= !whole.frames.is_empty();
    }
    Verdict::accepted_if(accepted)
}

/// The handshake: a hello decodes only from exactly the 30 bytes that
/// encode it (magic, version, cluster, from, to), and an answer is an
/// acceptance only when empty; a refusal's reason is the text sent, cut to
/// its limit, and a reason we send always reads back as its own prefix.
pub fn peer_handshake(data: &[u8]) -> Verdict {
    let hello = assert_bounded("peer_handshake", data.len(), 1024, || Hello::decode(data));
    let accepted = match &hello {
        Ok(hello) => {
            assert_eq!(
                &hello.encode()[..],
                data,
                "a hello decoded from other bytes"
            );
            true
        }
        Err(HandshakeError::NotFerry) => {
            assert!(data.len() != HELLO_BYTES || data[..4] != *b"YRRF");
            false
        }
        Err(HandshakeError::Version { theirs, ours }) => {
            assert_ne!(theirs, ours);
            false
        }
        Err(HandshakeError::Refused(_)) => panic!("a hello decoded to a refusal"),
    };
    let answer = assert_bounded(
        "peer_handshake",
        data.len(),
        4 * REASON_BYTES_MAX + 1024,
        || decode_answer(data),
    );
    match answer {
        Ok(()) => assert!(data.is_empty(), "a non-empty answer taken as an acceptance"),
        Err(HandshakeError::Refused(reason)) => {
            let end = data.len().min(REASON_BYTES_MAX);
            assert_eq!(reason, String::from_utf8_lossy(&data[..end]));
        }
        Err(other) => panic!("an answer decoded to {other:?}"),
    }
    // What we send as a reason reads back as its longest prefix that fits.
    let text = String::from_utf8_lossy(data);
    match decode_answer(&encode_answer(Some(&text))) {
        Ok(()) => assert!(text.is_empty()),
        Err(HandshakeError::Refused(reason)) => {
            assert!(text.starts_with(&reason));
            if text.len() <= REASON_BYTES_MAX {
                assert_eq!(reason, text);
            } else {
                // Cut at the last character boundary within the limit.
                assert!(reason.len() <= REASON_BYTES_MAX && reason.len() > REASON_BYTES_MAX - 4);
            }
        }
        Err(other) => panic!("our own answer decoded to {other:?}"),
    }
    // Accepted: a hello, or an answer this node could have sent.
    let answer_sent = data.len() <= REASON_BYTES_MAX && std::str::from_utf8(data).is_ok();
    Verdict::accepted_if(accepted || answer_sent)
}

/// Engine messages on the peer wire: a decoded message is exactly what its
/// bytes encode (decoding is the inverse of encoding: no two byte strings
/// decode to one message, so a changed byte is either refused or read as
/// another message whose encoding is those bytes), and decoding holds at
/// most a small multiple of the input in memory whatever its counts and
/// lengths claim.
pub fn peer_message(data: &[u8]) -> Verdict {
    let bytes = Bytes::copy_from_slice(data);
    let decoded = assert_bounded("peer_message", data.len(), 16 * data.len() + 4096, || {
        decode_message(&bytes)
    });
    match decoded {
        Ok(message) => {
            let encoded = encode_message(&message);
            assert_eq!(
                &encoded[..],
                data,
                "{message:?} decoded from bytes that are not its encoding"
            );
            Verdict::Accepted
        }
        Err(_) => Verdict::Refused,
    }
}
