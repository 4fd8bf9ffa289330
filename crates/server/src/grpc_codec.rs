//! The protobuf codec of every gRPC service: prost's, with buffers sized
//! for etcd's messages.
//!
//! tonic starts each call's decode buffer and each response's encode buffer
//! at 8 KiB. An etcd request or response is mostly a few hundred bytes, so
//! every call took two 8 KiB blocks from the allocator: on a busy member the
//! largest allocations per request, too large for the allocator's
//! per-thread cache, and the reason its heaps grew a page at a time (an
//! `mprotect` call every other put). Buffers of 1 KiB hold a typical put,
//! range or its answer whole and come from the per-thread cache; a larger
//! message grows its buffer as it arrives (doubling, so a 1.5 MiB value
//! costs a dozen copies of a small prefix, not one per KiB), and the limits
//! on message size are checked exactly as before.

use std::marker::PhantomData;

use bytes::BufMut;
use prost::encoding::{self, WireType};
use prost::Message;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

use crate::pb::etcdserverpb::WatchRequest;
use crate::pb::ferrypb::WatchResponseWire;

/// Where a call's decode buffer and a response's encode buffer start.
pub const BUFFER_BYTES: usize = 1024;

/// How much a streamed response gathers before it hands the bytes to
/// HTTP/2 (tonic's default).
pub const YIELD_THRESHOLD_BYTES: usize = 32 * 1024;

/// prost's codec with [`BUFFER_BYTES`] buffers (named in `build.rs` as the
/// codec of the generated services and clients).
#[derive(Debug, Clone)]
pub struct EtcdCodec<T, U> {
    types: PhantomData<(T, U)>,
}

impl<T, U> Default for EtcdCodec<T, U> {
    fn default() -> Self {
        EtcdCodec { types: PhantomData }
    }
}

fn buffer_settings() -> BufferSettings {
    BufferSettings::new(BUFFER_BYTES, YIELD_THRESHOLD_BYTES)
}

impl<T, U> Codec for EtcdCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(buffer_settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(buffer_settings())
    }
}

/// The codec of the Watch service as the server runs it: requests decoded
/// by prost, responses ([`WatchResponseWire`]) encoded by
/// [`WatchResponseEncoder`].
#[derive(Debug, Clone, Default)]
pub struct WatchCodec;

impl Codec for WatchCodec {
    type Encode = WatchResponseWire;
    type Decode = WatchRequest;
    type Encoder = WatchResponseEncoder;
    type Decoder = ProstDecoder<WatchRequest>;

    fn encoder(&mut self) -> Self::Encoder {
        WatchResponseEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(buffer_settings())
    }
}

/// Encodes a [`WatchResponseWire`] as prost does, byte for byte, but
/// copies each event's bytes straight from the slice. prost encodes a
/// `bytes` field by cloning its `Bytes` into the buffer and dropping the
/// clone: two atomic operations on a count that every watcher of the
/// event shares, which a profile of 100 watchers behind on one hot prefix
/// showed costing more than the copy itself.
#[derive(Debug, Clone, Default)]
pub struct WatchResponseEncoder;

/// The field number of `events` in `ferrypb.WatchResponseWire`: the last
/// field, so prost writes it after every other and so do we.
const WATCH_RESPONSE_EVENTS_FIELD: u32 = 11;

impl Encoder for WatchResponseEncoder {
    type Item = WatchResponseWire;
    type Error = Status;

    fn encode(
        &mut self,
        response: WatchResponseWire,
        dst: &mut EncodeBuf<'_>,
    ) -> Result<(), Status> {
        encode_watch_response(response, dst)
            .map_err(|error| Status::internal(format!("encoding a watch response: {error}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        buffer_settings()
    }
}

/// What [`WatchResponseEncoder`] writes: `response` as prost encodes it,
/// with the events copied from their slices.
fn encode_watch_response(
    mut response: WatchResponseWire,
    dst: &mut impl BufMut,
) -> Result<(), prost::EncodeError> {
    let events = std::mem::take(&mut response.events);
    response.encode(dst)?;
    for event in &events {
        encoding::encode_key(WATCH_RESPONSE_EVENTS_FIELD, WireType::LengthDelimited, dst);
        encoding::encode_varint(event.len() as u64, dst);
        dst.put_slice(event);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use bytes::{Bytes, BytesMut};

    use super::*;
    use crate::pb::etcdserverpb::ResponseHeader;

    /// Every field set, events of several sizes (a length of one and of
    /// two varint bytes, an empty one): the same bytes as prost's.
    #[test]
    fn a_watch_response_is_encoded_as_prost_encodes_it() {
        let events: Vec<Bytes> = [0usize, 1, 127, 128, 300, 70_000]
            .into_iter()
            .map(|size_bytes| Bytes::from(vec![0xA5; size_bytes]))
            .collect();
        let responses = [
            WatchResponseWire {
                header: Some(ResponseHeader {
                    cluster_id: 7,
                    member_id: 9,
                    revision: 1234,
                    raft_term: 3,
                }),
                watch_id: 42,
                created: true,
                canceled: true,
                compact_revision: 17,
                cancel_reason: "a reason".to_owned(),
                fragment: true,
                events: events.clone(),
            },
            WatchResponseWire {
                events,
                ..WatchResponseWire::default()
            },
            WatchResponseWire::default(),
        ];
        for response in responses {
            let expected = response.encode_to_vec();
            let mut encoded = BytesMut::new();
            encode_watch_response(response.clone(), &mut encoded).unwrap();
            assert_eq!(&encoded[..], &expected[..], "{response:?}");
            assert_eq!(WatchResponseWire::decode(&encoded[..]).unwrap(), response);
        }
    }
}
