//! The replicated commands and their binary codec.
//!
//! A command is what the leader proposes and every replica applies. On the
//! wire of the Raft log it is one format byte followed by the protobuf
//! encoding of [`Command`]. Decoding never panics: bad bytes give a
//! [`CodecError`].

use bytes::Bytes;
use prost::Message;

use crate::error::CodecError;
pub use crate::pb::ferrypb::command::Kind as CommandKind;
pub use crate::pb::ferrypb::{
    AuthStamp, Command, LeaseExpireCommand, LeaseGrantCommand, LeaseRevokeCommand,
};

/// The format byte of encoded commands written by this build.
pub const COMMAND_FORMAT_VERSION: u8 = 1;

/// Wraps one operation as a command.
pub fn command(kind: CommandKind) -> Command {
    Command {
        kind: Some(kind),
        bounds: None,
        auth: None,
    }
}

/// Raises member `member_id`'s NOSPACE alarm (its store is at its quota,
/// or its disk is full).
pub fn raise_no_space(member_id: u64) -> Command {
    use crate::pb::etcdserverpb::{alarm_request::AlarmAction, AlarmRequest, AlarmType};
    command(CommandKind::Alarm(AlarmRequest {
        action: AlarmAction::Activate as i32,
        member_id,
        alarm: AlarmType::Nospace as i32,
    }))
}

/// Records where member `id` can be reached at its peer address
/// `peer_addr` (name and client URL left as they are): `create` for a new
/// member (MemberAdd), not for a change (MemberUpdate).
pub fn peer_record(id: u64, peer_addr: String, create: bool) -> Command {
    command(CommandKind::MemberRecord(
        crate::pb::ferrypb::MemberRecordCommand {
            id,
            name: String::new(),
            peer_addr,
            client_url: String::new(),
            create,
        },
    ))
}

/// Encodes a command for the Raft log.
pub fn encode_command(command: &Command) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(encoded_command_len(command));
    bytes.push(COMMAND_FORMAT_VERSION);
    // Encoded in place behind the version byte (`encode_to_vec` would
    // encode into a buffer of its own, copied here after). `encode_raw` is
    // what prost's own encoders call: infallible, since a `Vec` grows.
    command.encode_raw(&mut bytes);
    bytes
}

/// Size of the encoded command, for the request size limit.
pub fn encoded_command_len(command: &Command) -> usize {
    1 + command.encoded_len()
}

/// Decodes a command from the Raft log. Its `bytes` fields (a put's key and
/// value) are slices of `bytes`, not copies.
pub fn decode_command(bytes: &Bytes) -> Result<Command, CodecError> {
    let version = *bytes.first().ok_or(CodecError::Empty)?;
    let body = bytes.slice(1..);
    if version != COMMAND_FORMAT_VERSION {
        return Err(CodecError::UnknownVersion {
            found: version,
            supported: COMMAND_FORMAT_VERSION,
        });
    }
    let command = Command::decode(body).map_err(|e| CodecError::Malformed(e.to_string()))?;
    if command.kind.is_none() {
        return Err(CodecError::MissingKind);
    }
    Ok(command)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::etcdserverpb::{PutRequest, RequestOp, TxnRequest};
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let put = PutRequest {
            key: Bytes::from_static(b"a"),
            value: Bytes::from_static(b"1"),
            lease: 7,
            ..Default::default()
        };
        let txn = TxnRequest {
            compare: vec![],
            success: vec![RequestOp {
                request: Some(crate::pb::etcdserverpb::request_op::Request::RequestPut(
                    put.clone(),
                )),
            }],
            failure: vec![],
        };
        for kind in [
            CommandKind::Put(put),
            CommandKind::Txn(txn),
            CommandKind::LeaseExpire(LeaseExpireCommand { ids: vec![1, 2] }),
        ] {
            let original = command(kind);
            let bytes = encode_command(&original);
            assert_eq!(bytes.len(), encoded_command_len(&original));
            assert_eq!(decode_command(&bytes.into()).unwrap(), original);
        }
    }

    /// Every member decodes a put from its log entry: the key and value
    /// must be slices of the entry, not copies (prost does so for `Bytes`
    /// fields read from a `Bytes` buffer).
    #[test]
    fn a_puts_key_and_value_are_slices_of_the_entry() {
        let put = PutRequest {
            key: Bytes::from_static(b"key"),
            value: Bytes::from(vec![7u8; 300]),
            ..Default::default()
        };
        let entry = Bytes::from(encode_command(&command(CommandKind::Put(put.clone()))));
        let Some(CommandKind::Put(decoded)) = decode_command(&entry).unwrap().kind else {
            panic!("not a put");
        };
        assert_eq!(decoded, put);
        let entry_bytes = entry.as_ptr_range();
        assert!(entry_bytes.contains(&decoded.key.as_ptr()));
        assert!(entry_bytes.contains(&decoded.value.as_ptr()));
    }

    #[test]
    fn typed_errors() {
        assert_eq!(decode_command(&Bytes::new()), Err(CodecError::Empty));
        assert_eq!(
            decode_command(&Bytes::from_static(&[9, 1, 2])),
            Err(CodecError::UnknownVersion {
                found: 9,
                supported: 1
            })
        );
        assert_eq!(
            decode_command(&Bytes::from_static(&[1])),
            Err(CodecError::MissingKind)
        );
        assert!(matches!(
            decode_command(&Bytes::from_static(&[1, 0x0a, 0xff])),
            Err(CodecError::Malformed(_))
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_command(&bytes.into());
        }

        #[test]
        fn corrupted_encodings_never_panic(flip in 0usize..64, bit in 0u8..8) {
            let original = command(CommandKind::LeaseGrant(LeaseGrantCommand { id: 5, ttl_seconds: 60 }));
            let mut bytes = encode_command(&original);
            let position = flip % bytes.len();
            bytes[position] ^= 1 << bit;
            let _ = decode_command(&bytes.into());
        }
    }
}
