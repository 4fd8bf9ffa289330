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

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

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
