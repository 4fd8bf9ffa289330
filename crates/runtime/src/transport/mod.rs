//! Peer transport: how the nodes of a cluster talk to each other.
//!
//! TCP with length-and-checksum framed messages rather than gRPC: a peer
//! stream is a one-way firehose of small messages that wants per-peer
//! batching (many messages per write and per flush), a bounded queue that
//! sheds load instead of blocking the engine, and a handshake that checks the
//! cluster id. A plain framed stream gives all three in a few hundred lines
//! and costs no HTTP/2 framing per message.
//!
//! Every node dials each peer for its own outbound messages; the peer's
//! outbound messages arrive on the connection it dialed. So each direction
//! has its own connection and there is no tie-break between simultaneous
//! dials. When an outbound connection comes up, the runtime is told
//! ([`TransportEvent::Connected`]) and passes it to the engine as
//! `Input::PeerConnected`, which re-sends whatever the peer needs to know
//! now (seed 002's lesson: state that a half-open link lost must be re-sent
//! when it opens, not left for the next change).

pub mod codec;
pub mod frame;
pub mod handshake;
pub mod tcp;

pub use codec::{decode_message, encode_message, DecodeError};
pub use frame::{FrameError, FRAME_BYTES_MAX_DEFAULT};
pub use handshake::{HandshakeError, Hello};
pub use tcp::{BufferLease, Transport, TransportConfig, TransportError, TransportEvent};
