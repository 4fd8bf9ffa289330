//! The first frame on a peer connection: who is calling, for which cluster.
//!
//! A node refuses a peer of another cluster (or one that dialed the wrong
//! node) with a reason, logs it, and closes the connection; the dialer logs
//! the reason too. Mixing two clusters' messages would be silent corruption.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use ferry_raft::NodeId;

/// Identifies the peer protocol and its version in the hello frame.
const MAGIC: u32 = 0x4652_5259; // "FRRY"
/// The version of the peer protocol this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// The longest refusal reason we send or accept.
pub const REASON_BYTES_MAX: usize = 1024;
/// The size of an encoded hello.
pub const HELLO_BYTES: usize = 30;

/// The dialer's introduction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The cluster the dialer belongs to.
    pub cluster_id: u64,
    /// The dialer.
    pub from: NodeId,
    /// The node the dialer means to reach.
    pub to: NodeId,
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandshakeError {
    /// The frame is not a ferry hello.
    #[error("not a ferry peer hello (bad magic or length); is another program on the peer port?")]
    NotFerry,
    /// The peer speaks another protocol version.
    #[error("peer speaks protocol version {theirs}, this node speaks {ours}; run the same ferry version on every node")]
    Version {
        /// The peer's version.
        theirs: u16,
        /// Ours.
        ours: u16,
    },
    /// The peer refused us, and said why.
    #[error("peer refused the connection: {0}")]
    Refused(String),
}

impl Hello {
    /// The hello as a frame payload.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(HELLO_BYTES);
        out.put_u32_le(MAGIC);
        out.put_u16_le(PROTOCOL_VERSION);
        out.put_u64_le(self.cluster_id);
        out.put_u64_le(self.from);
        out.put_u64_le(self.to);
        out.freeze()
    }

    /// Reads a hello from a frame payload.
    pub fn decode(mut payload: &[u8]) -> Result<Hello, HandshakeError> {
        if payload.len() != HELLO_BYTES || payload.get_u32_le() != MAGIC {
            return Err(HandshakeError::NotFerry);
        }
        let version = payload.get_u16_le();
        if version != PROTOCOL_VERSION {
            return Err(HandshakeError::Version {
                theirs: version,
                ours: PROTOCOL_VERSION,
            });
        }
        Ok(Hello {
            cluster_id: payload.get_u64_le(),
            from: payload.get_u64_le(),
            to: payload.get_u64_le(),
        })
    }

    /// Checks a received hello against this node; `Err` carries the reason
    /// to send back.
    pub fn verify(&self, cluster_id: u64, me: NodeId) -> Result<(), String> {
        if self.cluster_id != cluster_id {
            return Err(format!(
                "node {:x} belongs to cluster {:#x} but this node (id {me:x}) belongs to cluster {cluster_id:#x}",
                self.from, self.cluster_id
            ));
        }
        if self.to != me {
            return Err(format!(
                "node {:x} dialed node {:x} but reached node {me:x}; check the peer addresses",
                self.from, self.to
            ));
        }
        if self.from == me {
            return Err(format!(
                "node {me:x} dialed itself; check the peer addresses"
            ));
        }
        Ok(())
    }
}

/// The acceptor's answer: empty payload to accept, a reason to refuse.
pub fn encode_answer(refusal: Option<&str>) -> Bytes {
    match refusal {
        None => Bytes::new(),
        Some(reason) => {
            let mut end = reason.len().min(REASON_BYTES_MAX);
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            Bytes::copy_from_slice(&reason.as_bytes()[..end])
        }
    }
}

/// Reads the acceptor's answer.
pub fn decode_answer(payload: &[u8]) -> Result<(), HandshakeError> {
    if payload.is_empty() {
        return Ok(());
    }
    let end = payload.len().min(REASON_BYTES_MAX);
    Err(HandshakeError::Refused(
        String::from_utf8_lossy(&payload[..end]).into_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_is_verified() {
        let hello = Hello {
            cluster_id: 7,
            from: 1,
            to: 2,
        };
        let decoded = Hello::decode(&hello.encode()).unwrap();
        assert_eq!(decoded, hello);
        assert!(decoded.verify(7, 2).is_ok());
        let wrong_cluster = decoded.verify(8, 2).unwrap_err();
        assert!(wrong_cluster.contains("cluster"), "{wrong_cluster}");
        assert!(decoded.verify(7, 3).unwrap_err().contains("dialed node 2"));
    }

    #[test]
    fn garbage_is_not_a_hello() {
        assert_eq!(
            Hello::decode(b"GET / HTTP/1.1\r\n"),
            Err(HandshakeError::NotFerry)
        );
        let mut bad_version = BytesMut::from(
            &Hello {
                cluster_id: 1,
                from: 1,
                to: 2,
            }
            .encode()[..],
        );
        bad_version[4] = 9;
        assert!(matches!(
            Hello::decode(&bad_version),
            Err(HandshakeError::Version { theirs: 9, .. })
        ));
    }

    #[test]
    fn answers_round_trip() {
        assert_eq!(decode_answer(&encode_answer(None)), Ok(()));
        assert_eq!(
            decode_answer(&encode_answer(Some("wrong cluster"))),
            Err(HandshakeError::Refused("wrong cluster".into()))
        );
    }
}
