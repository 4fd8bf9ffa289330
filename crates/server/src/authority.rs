//! Repairs the HTTP/2 `:authority` of client connections that send a URL
//! there instead of `host:port`.
//!
//! etcd's Go client v3.4 (Debian's etcdctl) dials some calls by the raw
//! endpoint string: `endpoint status` and `endpoint hashkv` (also with
//! `--cluster`, which takes the members' client URLs) dial
//! `passthrough:///http://host:port`, and gRPC-Go then sends
//! `http://host:port` as the `:authority`. etcd's server ignores the value;
//! the HTTP/2 layer under tonic refuses the stream with PROTOCOL_ERROR before
//! any of our code could. So the repair happens below HTTP/2, on the bytes.
//!
//! [`AuthorityRepair`] sits between the TCP stream and the HTTP/2 server. It
//! reads the client's frames up to the end of the first header block:
//!
//! - If that block's `:authority` is a valid authority, as with every other
//!   client, it steps aside for good: the block and everything after it
//!   flow through untouched, with no per-request cost.
//! - If it is a URL, the whole connection is rewritten: every header block
//!   is decoded (HPACK, tracking the client's dynamic table) and re-encoded
//!   with literal fields only, with any URL authority cut to its
//!   `host:port`. Literal fields never enter the server's dynamic table, so
//!   the server's decoder stays consistent with what it is sent, while the
//!   client's encoder keeps indexing against its own table, mirrored here.
//!
//! What the repair holds runs ahead of the HTTP/2 server and of any
//! authentication, so it is bounded as the server bounds it: a header
//! block of at most 64 KiB, a header list of at most 64 KiB once decoded
//! (counted as HPACK counts it; h2 closes a connection at four times its
//! 16 KiB limit), and a mirror of the client's HPACK table no larger than
//! the 4096 bytes the server advertises. A block past a bound is never
//! decoded into memory: before the decision it goes to the server as it
//! came, which refuses it; on a rewritten connection the connection ends.
//!
//! gRPC clients send one authority for the life of a connection, which is
//! why the first block may decide. Frames other than header blocks are
//! never changed. Anything malformed before the decision is handed to the
//! server unchanged, so that the server rejects it as it would have.

use std::borrow::Cow;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::codegen::http::uri::Authority;
use tonic::transport::server::Connected;

/// What an HTTP/2 client sends first (RFC 9113, section 3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_BYTES: usize = 9;
const FRAME_TYPE_HEADERS: u8 = 0x1;
const FRAME_TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
const PRIORITY_BYTES: usize = 5;
/// The initial SETTINGS_MAX_FRAME_SIZE, and its smallest legal value: a
/// server always accepts frames of this size, whatever it advertised.
const FRAME_PAYLOAD_BYTES_MAX: usize = 16_384;
/// The most decoded header-list bytes taken from one header block, counted
/// as RFC 7541 (section 4.1) counts them: name, value and 32 bytes per
/// field. The server (hyper) refuses a stream whose list is over 16 KiB and
/// h2 closes the connection over four times that, so a block beyond this
/// bound is one the server never serves: nothing is lost by not decoding
/// it into memory, and a block of a few bytes per reference to a large
/// table entry (an "HPACK bomb") cannot make us hold more than this.
const HEADER_LIST_BYTES_MAX: usize = 64 * 1024;
/// The largest header block held while it is decoded, in encoded bytes. h2
/// closes the connection when a block's encoded bytes pass the header list
/// limit (16 KiB), so this is far above anything the server accepts.
const HEADER_BLOCK_BYTES_MAX: usize = HEADER_LIST_BYTES_MAX;
/// The HPACK dynamic table size the server advertises: the protocol's
/// default, which the HTTP/2 server under tonic does not change. A client
/// may not grow its table beyond it (the server would answer with a
/// COMPRESSION_ERROR), so the mirror of the client's table is held to it:
/// an update past it fails to decode here and the block goes to the server
/// as it came, which refuses it.
const SERVER_HEADER_TABLE_BYTES: usize = 4096;
/// The bytes HPACK counts for one field besides its name and value.
const FIELD_OVERHEAD_BYTES: usize = 32;
/// How much is read from the socket at a time while frames are inspected.
const READ_CHUNK_BYTES: usize = 16 * 1024;

/// A client connection whose `:authority` is repaired if it is a URL (see
/// the module docs). Writes go straight to the inner stream.
pub struct AuthorityRepair<IO> {
    io: IO,
    rewriter: Rewriter,
}

impl<IO> AuthorityRepair<IO> {
    /// Wraps a freshly accepted connection.
    pub fn new(io: IO) -> AuthorityRepair<IO> {
        AuthorityRepair {
            io,
            rewriter: Rewriter::new(),
        }
    }
}

/// Why a rewritten connection had to be closed. Only a connection whose
/// first block carried a URL authority can get these; the server would have
/// refused its streams anyway.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RepairError {
    /// The client's HPACK data could not be decoded.
    #[error("the client sent a header block that does not decode: {0}")]
    Hpack(String),
    /// A header block broke HTTP/2's framing rules.
    #[error("the client sent a malformed header block: {0}")]
    Malformed(&'static str),
    /// A header block was larger than 64 KiB (the server's own limit on a
    /// header block is far lower).
    #[error("the client sent a header block over 64 KiB")]
    TooLarge,
    /// A header block decoded to a header list over 64 KiB (the server's own
    /// limit on a header list is 16 KiB).
    #[error("the client sent a header block that decodes to a header list over 64 KiB")]
    ListTooLarge,
}

/// Where the client's byte stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Within the connection preface, this many bytes of it seen.
    Preface { matched_bytes: usize },
    /// Reading frames; `rewrite` once a URL authority was seen.
    Frames { rewrite: bool },
    /// Bytes flow through unchanged for the rest of the connection.
    Passthrough,
}

/// A header block being collected from a HEADERS frame and its
/// CONTINUATION frames.
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; PRIORITY_BYTES]>,
    /// The HPACK data, without padding and priority fields.
    fragment: Vec<u8>,
    /// The frames as received, handed on if the block needs no repair.
    frames: Vec<u8>,
}

/// The byte-level state machine behind [`AuthorityRepair`], kept apart from
/// the socket so that it can be driven by tests.
struct Rewriter {
    phase: Phase,
    /// Bytes from the client not processed yet.
    raw: BytesMut,
    /// Bytes ready for the server.
    out: BytesMut,
    /// Bytes of the current frame still to forward unchanged.
    forward_bytes: usize,
    block: Option<PendingBlock>,
    decoder: loona_hpack::Decoder<'static>,
}

impl Rewriter {
    fn new() -> Rewriter {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(SERVER_HEADER_TABLE_BYTES);
        Rewriter {
            phase: Phase::Preface { matched_bytes: 0 },
            raw: BytesMut::new(),
            out: BytesMut::new(),
            forward_bytes: 0,
            block: None,
            decoder,
        }
    }

    /// Whether nothing is inspected any more.
    fn is_passthrough(&self) -> bool {
        self.phase == Phase::Passthrough
    }

    /// Takes bytes from the client.
    fn push(&mut self, bytes: &[u8]) -> Result<(), RepairError> {
        self.raw.extend_from_slice(bytes);
        self.process()
    }

    /// The client closed its side: whatever is left goes to the server as
    /// it is, which reports a truncated frame if there is one.
    fn finish(&mut self) {
        self.pass_on();
        let rest = self.raw.split();
        self.out.extend_from_slice(&rest);
    }

    /// Moves every complete unit of `raw` to `out`, rewriting header
    /// blocks where the phase says so.
    fn process(&mut self) -> Result<(), RepairError> {
        loop {
            match self.phase {
                Phase::Passthrough => {
                    let rest = self.raw.split();
                    self.out.extend_from_slice(&rest);
                    return Ok(());
                }
                Phase::Preface { matched_bytes } => {
                    let wanted = &PREFACE[matched_bytes..];
                    let n = wanted.len().min(self.raw.len());
                    if n == 0 {
                        return Ok(());
                    }
                    if self.raw[..n] != wanted[..n] {
                        // Not HTTP/2 with prior knowledge: nothing to repair.
                        self.phase = Phase::Passthrough;
                        continue;
                    }
                    let preface = self.raw.split_to(n);
                    self.out.extend_from_slice(&preface);
                    self.phase = if matched_bytes + n == PREFACE.len() {
                        Phase::Frames { rewrite: false }
                    } else {
                        Phase::Preface {
                            matched_bytes: matched_bytes + n,
                        }
                    };
                }
                Phase::Frames { rewrite } => {
                    if self.forward_bytes > 0 {
                        let n = self.forward_bytes.min(self.raw.len());
                        if n == 0 {
                            return Ok(());
                        }
                        let bytes = self.raw.split_to(n);
                        self.out.extend_from_slice(&bytes);
                        self.forward_bytes -= n;
                        continue;
                    }
                    if self.raw.len() < FRAME_HEADER_BYTES {
                        return Ok(());
                    }
                    let header = FrameHeader::parse(&self.raw[..FRAME_HEADER_BYTES]);
                    let in_block = self.block.is_some();
                    let is_block_frame = match header.kind {
                        FRAME_TYPE_HEADERS => !in_block,
                        FRAME_TYPE_CONTINUATION => in_block,
                        _ => false,
                    };
                    if !is_block_frame {
                        if in_block {
                            self.malformed(rewrite, "a header block was interrupted")?;
                            continue;
                        }
                        let bytes = self.raw.split_to(FRAME_HEADER_BYTES);
                        self.out.extend_from_slice(&bytes);
                        self.forward_bytes = header.payload_bytes;
                        continue;
                    }
                    let held_bytes = self.block.as_ref().map_or(0, |b| b.frames.len());
                    if held_bytes + FRAME_HEADER_BYTES + header.payload_bytes
                        > HEADER_BLOCK_BYTES_MAX
                    {
                        if rewrite {
                            return Err(RepairError::TooLarge);
                        }
                        self.pass_on();
                        continue;
                    }
                    if self.raw.len() < FRAME_HEADER_BYTES + header.payload_bytes {
                        return Ok(());
                    }
                    let frame = self.raw.split_to(FRAME_HEADER_BYTES + header.payload_bytes);
                    if let Err(reason) = self.collect(&header, &frame) {
                        self.malformed(rewrite, reason)?;
                        self.out.extend_from_slice(&frame);
                        continue;
                    }
                    if header.flags & FLAG_END_HEADERS != 0 {
                        self.finish_block(rewrite)?;
                    }
                }
            }
        }
    }

    /// Adds a HEADERS or CONTINUATION frame to the pending block.
    fn collect(&mut self, header: &FrameHeader, frame: &[u8]) -> Result<(), &'static str> {
        let payload = &frame[FRAME_HEADER_BYTES..];
        match self.block.as_mut() {
            Some(block) => {
                if header.stream_id != block.stream_id {
                    return Err("a CONTINUATION frame is on another stream");
                }
                block.fragment.extend_from_slice(payload);
                block.frames.extend_from_slice(frame);
            }
            None => {
                let mut body = payload;
                let mut padding_bytes = 0;
                if header.flags & FLAG_PADDED != 0 {
                    let (&pad, rest) = body.split_first().ok_or("a padded frame is empty")?;
                    padding_bytes = usize::from(pad);
                    body = rest;
                }
                let mut priority = None;
                if header.flags & FLAG_PRIORITY != 0 {
                    let fields = body
                        .get(..PRIORITY_BYTES)
                        .ok_or("a HEADERS frame is too short for its priority")?;
                    let mut copy = [0; PRIORITY_BYTES];
                    copy.copy_from_slice(fields);
                    priority = Some(copy);
                    body = &body[PRIORITY_BYTES..];
                }
                let fragment_bytes = body
                    .len()
                    .checked_sub(padding_bytes)
                    .ok_or("the padding is longer than the frame")?;
                self.block = Some(PendingBlock {
                    stream_id: header.stream_id,
                    end_stream: header.flags & FLAG_END_STREAM != 0,
                    priority,
                    fragment: body[..fragment_bytes].to_vec(),
                    frames: frame.to_vec(),
                });
            }
        }
        Ok(())
    }

    /// Something is wrong with the framing of a header block. Before the
    /// decision the server gets the bytes as they came and answers them
    /// itself; on a rewritten connection the connection ends.
    fn malformed(&mut self, rewrite: bool, reason: &'static str) -> Result<(), RepairError> {
        if rewrite {
            return Err(RepairError::Malformed(reason));
        }
        self.pass_on();
        Ok(())
    }

    /// Hands everything held to the server unchanged and steps aside.
    fn pass_on(&mut self) {
        if let Some(block) = self.block.take() {
            self.out.extend_from_slice(&block.frames);
        }
        self.phase = Phase::Passthrough;
    }

    /// Decodes a complete header block and sends it on, repaired or not.
    fn finish_block(&mut self, rewrite: bool) -> Result<(), RepairError> {
        let Some(block) = self.block.take() else {
            return Ok(());
        };
        // Fields are kept only up to the bound; past it the rest of the
        // block is still decoded (without keeping anything) so that the
        // client's table stays mirrored, and the block is not served.
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut list_bytes: usize = 0;
        let decoded = self.decoder.decode_with_cb(&block.fragment, |name, value| {
            list_bytes = list_bytes
                .saturating_add(name.len())
                .saturating_add(value.len())
                .saturating_add(FIELD_OVERHEAD_BYTES);
            if list_bytes <= HEADER_LIST_BYTES_MAX {
                fields.push((name.into_owned(), value.into_owned()));
            }
        });
        if let Err(error) = decoded {
            if rewrite {
                return Err(RepairError::Hpack(error.to_string()));
            }
            self.block = Some(block);
            self.pass_on();
            return Ok(());
        }
        if list_bytes > HEADER_LIST_BYTES_MAX {
            if rewrite {
                return Err(RepairError::ListTooLarge);
            }
            // The server refuses it as it refuses any list this large.
            drop(fields);
            self.block = Some(block);
            self.pass_on();
            return Ok(());
        }
        let mut repaired = false;
        for (name, value) in fields.iter_mut() {
            if name.as_slice() == b":authority" {
                if let Some(authority) = repaired_authority(value) {
                    *value = authority.into_owned();
                    repaired = true;
                }
            }
        }
        if !rewrite && !repaired {
            self.block = Some(block);
            self.pass_on();
            return Ok(());
        }
        if !rewrite {
            tracing::debug!(
                "a client sent a URL as its HTTP/2 authority; rewriting its connection's headers"
            );
            self.phase = Phase::Frames { rewrite: true };
        }
        let mut encoded = Vec::with_capacity(block.fragment.len() * 2);
        for (name, value) in &fields {
            encode_literal(name, value, &mut encoded);
        }
        self.write_block(&block, &encoded);
        Ok(())
    }

    /// Frames `encoded` as a HEADERS frame with CONTINUATION frames as
    /// needed, keeping the original's stream, END_STREAM and priority.
    fn write_block(&mut self, block: &PendingBlock, encoded: &[u8]) {
        let priority_bytes = if block.priority.is_some() {
            PRIORITY_BYTES
        } else {
            0
        };
        let first_bytes = encoded.len().min(FRAME_PAYLOAD_BYTES_MAX - priority_bytes);
        let (first, mut rest) = encoded.split_at(first_bytes);
        let mut flags = 0;
        if block.end_stream {
            flags |= FLAG_END_STREAM;
        }
        if block.priority.is_some() {
            flags |= FLAG_PRIORITY;
        }
        if rest.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        FrameHeader {
            payload_bytes: priority_bytes + first.len(),
            kind: FRAME_TYPE_HEADERS,
            flags,
            stream_id: block.stream_id,
        }
        .write(&mut self.out);
        if let Some(priority) = &block.priority {
            self.out.extend_from_slice(priority);
        }
        self.out.extend_from_slice(first);
        while !rest.is_empty() {
            let (chunk, remaining) = rest.split_at(rest.len().min(FRAME_PAYLOAD_BYTES_MAX));
            rest = remaining;
            FrameHeader {
                payload_bytes: chunk.len(),
                kind: FRAME_TYPE_CONTINUATION,
                flags: if rest.is_empty() { FLAG_END_HEADERS } else { 0 },
                stream_id: block.stream_id,
            }
            .write(&mut self.out);
            self.out.extend_from_slice(chunk);
        }
    }
}

/// The 9-byte header in front of every HTTP/2 frame.
struct FrameHeader {
    payload_bytes: usize,
    kind: u8,
    flags: u8,
    stream_id: u32,
}

impl FrameHeader {
    fn parse(bytes: &[u8]) -> FrameHeader {
        debug_assert_eq!(bytes.len(), FRAME_HEADER_BYTES);
        let payload_bytes =
            (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
        let stream_id = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]) & 0x7fff_ffff;
        FrameHeader {
            payload_bytes,
            kind: bytes[3],
            flags: bytes[4],
            stream_id,
        }
    }

    fn write(&self, out: &mut BytesMut) {
        assert!(self.payload_bytes <= FRAME_PAYLOAD_BYTES_MAX);
        let length = (self.payload_bytes as u32).to_be_bytes();
        out.extend_from_slice(&length[1..]);
        out.extend_from_slice(&[self.kind, self.flags]);
        out.extend_from_slice(&self.stream_id.to_be_bytes());
    }
}

/// `host:port` from an authority that is a URL such as
/// `http://host:port` or `https://host:port/`; `None` if the authority is
/// valid as it is, or is not a URL with a valid authority in it.
fn repaired_authority(value: &[u8]) -> Option<Cow<'static, [u8]>> {
    let text = std::str::from_utf8(value).ok()?;
    if text.parse::<Authority>().is_ok() {
        return None;
    }
    let (_scheme, rest) = text.split_once("://")?;
    let host_port = rest.split('/').next()?;
    if host_port.is_empty() || host_port.parse::<Authority>().is_err() {
        return None;
    }
    Some(Cow::Owned(host_port.as_bytes().to_vec()))
}

/// Appends a "literal header field without indexing, new name" (RFC 7541,
/// section 6.2.2) with raw (not Huffman) strings.
fn encode_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    encode_string(name, out);
    encode_string(value, out);
}

fn encode_string(bytes: &[u8], out: &mut Vec<u8>) {
    // A 7-bit prefix with the Huffman bit clear. Writing to a Vec cannot fail.
    let _ = loona_hpack::encoder::encode_integer_into(bytes.len(), 7, 0, out);
    out.extend_from_slice(bytes);
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityRepair<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let rewriter = &mut this.rewriter;
            if !rewriter.out.is_empty() {
                let n = buf.remaining().min(rewriter.out.len());
                buf.put_slice(&rewriter.out[..n]);
                rewriter.out.advance(n);
                return Poll::Ready(Ok(()));
            }
            if rewriter.is_passthrough() && rewriter.raw.is_empty() {
                return Pin::new(&mut this.io).poll_read(cx, buf);
            }
            let mut chunk = [0u8; READ_CHUNK_BYTES];
            let mut chunk_buf = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut chunk_buf))?;
            if chunk_buf.filled().is_empty() {
                rewriter.finish();
                if rewriter.out.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            rewriter.push(chunk_buf.filled()).map_err(|error| {
                tracing::debug!(%error, "closing a client connection");
                io::Error::new(io::ErrorKind::InvalidData, error)
            })?;
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityRepair<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for AuthorityRepair<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests;
