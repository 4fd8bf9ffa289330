//! The rewriter on byte streams built the way an HTTP/2 client builds them,
//! read back the way the server reads them.

use proptest::prelude::*;

use super::*;

const URL: &[u8] = b"http://127.0.0.1:2379";
const HOST_PORT: &[u8] = b"127.0.0.1:2379";
const FRAME_TYPE_DATA: u8 = 0x0;
const FRAME_TYPE_SETTINGS: u8 = 0x4;
const FRAME_TYPE_WINDOW_UPDATE: u8 = 0x8;

type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// A frame of any size (the rewriter's own frames stay within 16 KiB).
fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let length = (payload.len() as u32).to_be_bytes();
    let mut out = length[1..].to_vec();
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn request_fields(authority: &[u8], path: &str) -> Fields {
    vec![
        (b":method".to_vec(), b"POST".to_vec()),
        (b":scheme".to_vec(), b"http".to_vec()),
        (b":path".to_vec(), path.as_bytes().to_vec()),
        (b":authority".to_vec(), authority.to_vec()),
        (b"content-type".to_vec(), b"application/grpc".to_vec()),
        (b"te".to_vec(), b"trailers".to_vec()),
        (b"grpc-client".to_vec(), b"etcdctl-like".to_vec()),
    ]
}

/// A client's side of a connection: one HPACK encoder for all its blocks,
/// which indexes new names in its dynamic table as real clients do.
struct Client {
    encoder: loona_hpack::Encoder<'static>,
    bytes: Vec<u8>,
}

impl Client {
    fn new() -> Client {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(FRAME_TYPE_SETTINGS, 0, 0, &[]));
        Client {
            encoder: loona_hpack::Encoder::new(),
            bytes,
        }
    }

    fn request(&mut self, stream_id: u32, fields: &Fields) {
        let block = self
            .encoder
            .encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        self.bytes.extend(frame(
            FRAME_TYPE_HEADERS,
            FLAG_END_HEADERS,
            stream_id,
            &block,
        ));
        let message = [0u8, 0, 0, 0, 3, 1, 2, 3];
        self.bytes
            .extend(frame(FRAME_TYPE_DATA, FLAG_END_STREAM, stream_id, &message));
        self.bytes
            .extend(frame(FRAME_TYPE_WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]));
    }
}

/// What the server makes of the bytes: frames other than header blocks as
/// they are, header blocks decoded by a decoder of its own.
#[derive(Debug, PartialEq)]
enum Seen {
    Frame {
        kind: u8,
        flags: u8,
        stream_id: u32,
        payload: Vec<u8>,
    },
    Headers {
        stream_id: u32,
        end_stream: bool,
        fields: Fields,
    },
}

fn server_view(bytes: &[u8]) -> Vec<Seen> {
    assert!(bytes.starts_with(PREFACE));
    let mut rest = &bytes[PREFACE.len()..];
    let mut decoder = loona_hpack::Decoder::new();
    let mut seen = Vec::new();
    let mut block: Option<(u32, bool, Vec<u8>)> = None;
    while !rest.is_empty() {
        let header = FrameHeader::parse(&rest[..FRAME_HEADER_BYTES]);
        assert!(header.payload_bytes <= FRAME_PAYLOAD_BYTES_MAX);
        let payload = &rest[FRAME_HEADER_BYTES..FRAME_HEADER_BYTES + header.payload_bytes];
        rest = &rest[FRAME_HEADER_BYTES + header.payload_bytes..];
        match header.kind {
            FRAME_TYPE_HEADERS => {
                assert!(block.is_none());
                assert_eq!(header.flags & FLAG_PADDED, 0);
                let mut fragment = payload;
                if header.flags & FLAG_PRIORITY != 0 {
                    fragment = &fragment[PRIORITY_BYTES..];
                }
                let end_stream = header.flags & FLAG_END_STREAM != 0;
                block = Some((header.stream_id, end_stream, fragment.to_vec()));
            }
            FRAME_TYPE_CONTINUATION => {
                let (stream_id, _, fragment) = block.as_mut().unwrap();
                assert_eq!(*stream_id, header.stream_id);
                fragment.extend_from_slice(payload);
            }
            kind => {
                assert!(block.is_none());
                seen.push(Seen::Frame {
                    kind,
                    flags: header.flags,
                    stream_id: header.stream_id,
                    payload: payload.to_vec(),
                });
                continue;
            }
        }
        if header.flags & FLAG_END_HEADERS != 0 {
            let (stream_id, end_stream, fragment) = block.take().unwrap();
            seen.push(Seen::Headers {
                stream_id,
                end_stream,
                fields: decoder.decode(&fragment).unwrap(),
            });
        }
    }
    assert!(block.is_none());
    seen
}

/// Runs bytes through a rewriter in pieces cut at `cuts`.
fn rewrite(input: &[u8], cuts: &[usize]) -> Result<Vec<u8>, RepairError> {
    let mut rewriter = Rewriter::new();
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    cuts.push(input.len());
    cuts.sort_unstable();
    let mut start = 0;
    for cut in cuts {
        rewriter.push(&input[start..cut])?;
        start = cut;
    }
    rewriter.finish();
    Ok(rewriter.out.to_vec())
}

fn with_authority(fields: &Fields, authority: &[u8]) -> Fields {
    let mut fields = fields.clone();
    for (name, value) in fields.iter_mut() {
        if name == b":authority" {
            *value = authority.to_vec();
        }
    }
    fields
}

#[test]
fn a_url_authority_is_cut_to_host_and_port_in_every_block_and_nothing_else_changes() {
    let mut client = Client::new();
    let requests = [
        (1, request_fields(URL, "/etcdserverpb.Maintenance/Status")),
        (3, request_fields(URL, "/etcdserverpb.KV/Range")),
        (5, request_fields(URL, "/etcdserverpb.Maintenance/Status")),
    ];
    for (stream_id, fields) in &requests {
        client.request(*stream_id, fields);
    }
    let expected: Vec<Seen> = server_view(&client.bytes)
        .into_iter()
        .map(|seen| match seen {
            Seen::Headers {
                stream_id,
                end_stream,
                fields,
            } => Seen::Headers {
                stream_id,
                end_stream,
                fields: with_authority(&fields, HOST_PORT),
            },
            other => other,
        })
        .collect();
    let output = rewrite(&client.bytes, &[]).unwrap();
    assert_eq!(server_view(&output), expected);
    // The client's later blocks index its earlier ones, and still decode.
    assert!(client.bytes.len() < output.len());
}

#[test]
fn an_authority_kept_in_the_clients_dynamic_table_is_repaired_where_it_is_referenced() {
    // As gRPC-Go sends it: the authority as a literal with incremental
    // indexing on the static name `:authority` (index 1), then by index 62.
    let mut first = vec![0x83, 0x86, 0x41, URL.len() as u8];
    first.extend_from_slice(URL);
    let second = [0x83, 0x86, 0xbe];
    let mut input = PREFACE.to_vec();
    input.extend(frame(FRAME_TYPE_HEADERS, FLAG_END_HEADERS, 1, &first));
    input.extend(frame(
        FRAME_TYPE_HEADERS,
        FLAG_END_HEADERS | FLAG_END_STREAM,
        3,
        &second,
    ));
    let seen = server_view(&rewrite(&input, &[]).unwrap());
    let expected_fields = vec![
        (b":method".to_vec(), b"POST".to_vec()),
        (b":scheme".to_vec(), b"http".to_vec()),
        (b":authority".to_vec(), HOST_PORT.to_vec()),
    ];
    assert_eq!(
        seen,
        vec![
            Seen::Headers {
                stream_id: 1,
                end_stream: false,
                fields: expected_fields.clone(),
            },
            Seen::Headers {
                stream_id: 3,
                end_stream: true,
                fields: expected_fields,
            },
        ]
    );
}

#[test]
fn a_valid_authority_leaves_the_connection_byte_for_byte_untouched() {
    let mut client = Client::new();
    client.request(1, &request_fields(HOST_PORT, "/etcdserverpb.KV/Range"));
    // The first block decided: later blocks are not looked at.
    client.request(3, &request_fields(URL, "/etcdserverpb.KV/Range"));
    let mut rewriter = Rewriter::new();
    rewriter.push(&client.bytes).unwrap();
    assert!(rewriter.is_passthrough());
    assert_eq!(rewriter.out.to_vec(), client.bytes);
}

#[test]
fn a_large_block_is_split_into_continuation_frames() {
    let mut fields = request_fields(URL, "/etcdserverpb.KV/Range");
    fields.push((b"x-large".to_vec(), vec![b'v'; 40_000]));
    let mut client = Client::new();
    // Sent as one frame the size of the block, as a server that allowed
    // large frames would receive it.
    client.request(1, &fields);
    let output = rewrite(&client.bytes, &[]).unwrap();
    let seen = server_view(&output);
    assert_eq!(
        seen[1],
        Seen::Headers {
            stream_id: 1,
            end_stream: false,
            fields: with_authority(&fields, HOST_PORT),
        }
    );
}

#[test]
fn padding_is_dropped_and_priority_and_continuations_are_kept() {
    let mut encoder = loona_hpack::Encoder::new();
    let fields = request_fields(URL, "/etcdserverpb.KV/Put");
    let block = encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
    let (head, tail) = block.split_at(10);
    let padding_bytes = 7;
    let mut payload = vec![padding_bytes];
    payload.extend_from_slice(&[0x80, 0, 0, 0, 15]); // exclusive, depends on 0, weight 16
    payload.extend_from_slice(head);
    payload.extend(std::iter::repeat_n(0, usize::from(padding_bytes)));
    let mut input = PREFACE.to_vec();
    input.extend(frame(
        FRAME_TYPE_HEADERS,
        FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
        1,
        &payload,
    ));
    input.extend(frame(FRAME_TYPE_CONTINUATION, FLAG_END_HEADERS, 1, tail));
    let output = rewrite(&input, &[]).unwrap();
    let header = FrameHeader::parse(&output[PREFACE.len()..PREFACE.len() + FRAME_HEADER_BYTES]);
    assert_eq!(
        header.flags,
        FLAG_PRIORITY | FLAG_END_STREAM | FLAG_END_HEADERS
    );
    let priority_at = PREFACE.len() + FRAME_HEADER_BYTES;
    assert_eq!(
        output[priority_at..priority_at + PRIORITY_BYTES],
        [0x80, 0, 0, 0, 15]
    );
    assert_eq!(
        server_view(&output),
        vec![Seen::Headers {
            stream_id: 1,
            end_stream: true,
            fields: with_authority(&fields, HOST_PORT),
        }]
    );
}

#[test]
fn bytes_that_are_not_http2_pass_through() {
    let input = b"GET / HTTP/1.1\r\nHost: http://127.0.0.1:2379\r\n\r\n";
    assert_eq!(rewrite(input, &[3]).unwrap(), input.to_vec());
}

#[test]
fn a_malformed_first_block_goes_to_the_server_as_it_came() {
    let mut input = PREFACE.to_vec();
    // Index 70 is past the static table and the empty dynamic table.
    input.extend(frame(FRAME_TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0x80 | 70]));
    input.extend(frame(FRAME_TYPE_DATA, 0, 1, b"abc"));
    assert_eq!(rewrite(&input, &[]).unwrap(), input);

    let mut input = PREFACE.to_vec();
    // A DATA frame in the middle of a header block.
    input.extend(frame(FRAME_TYPE_HEADERS, 0, 1, &[0x83]));
    input.extend(frame(FRAME_TYPE_DATA, 0, 1, b"abc"));
    assert_eq!(rewrite(&input, &[]).unwrap(), input);

    let mut input = PREFACE.to_vec();
    // Padding longer than the frame.
    input.extend(frame(
        FRAME_TYPE_HEADERS,
        FLAG_PADDED | FLAG_END_HEADERS,
        1,
        &[9, 0x83],
    ));
    assert_eq!(rewrite(&input, &[]).unwrap(), input);
}

#[test]
fn a_rewritten_connection_that_breaks_hpack_or_framing_is_closed() {
    let mut client = Client::new();
    client.request(1, &request_fields(URL, "/etcdserverpb.KV/Range"));
    let rewritten = client.bytes.clone();

    let mut bad_index = rewritten.clone();
    bad_index.extend(frame(
        FRAME_TYPE_HEADERS,
        FLAG_END_HEADERS,
        3,
        &[0x80 | 120],
    ));
    assert!(matches!(
        rewrite(&bad_index, &[]),
        Err(RepairError::Hpack(_))
    ));

    let mut interrupted = rewritten.clone();
    interrupted.extend(frame(FRAME_TYPE_HEADERS, 0, 3, &[0x83]));
    interrupted.extend(frame(FRAME_TYPE_HEADERS, FLAG_END_HEADERS, 5, &[0x83]));
    assert_eq!(
        rewrite(&interrupted, &[]),
        Err(RepairError::Malformed("a header block was interrupted"))
    );

    let mut too_large = rewritten;
    too_large.extend(frame(FRAME_TYPE_HEADERS, 0, 3, &vec![0; 10_000]));
    for _ in 0..HEADER_BLOCK_BYTES_MAX / 10_000 {
        too_large.extend(frame(FRAME_TYPE_CONTINUATION, 0, 3, &vec![0; 10_000]));
    }
    assert_eq!(rewrite(&too_large, &[]), Err(RepairError::TooLarge));
}

/// An HPACK block that grows the client's dynamic table by one entry with a
/// value of `value_bytes`, carries a URL authority, and then references the
/// entry `references` times (one byte each): a few KB that decode to
/// `references * value_bytes` bytes. `table_bytes` is announced first as a
/// dynamic table size update, if given.
fn hpack_bomb(table_bytes: Option<usize>, value_bytes: usize, references: usize) -> Vec<u8> {
    let mut block = Vec::new();
    if let Some(size) = table_bytes {
        // A dynamic table size update: 001 and a 5-bit prefix integer.
        loona_hpack::encoder::encode_integer_into(size, 5, 0x20, &mut block).unwrap();
    }
    // A literal with incremental indexing and a new name: 01000000.
    block.push(0x40);
    encode_string(b"x-bomb", &mut block);
    encode_string(&vec![b'b'; value_bytes], &mut block);
    // The authority as a literal without indexing on the static name
    // `:authority` (index 1), so that the bomb stays the newest entry.
    block.extend_from_slice(&[0x83, 0x86, 0x01, URL.len() as u8]);
    block.extend_from_slice(URL);
    // Index 62 is the newest dynamic entry.
    block.extend(std::iter::repeat_n(0x80 | 62, references));
    block
}

#[test]
fn a_table_larger_than_the_server_advertises_is_not_mirrored_and_goes_to_the_server_as_it_came() {
    // As reported: a 64 KiB table entry referenced thousands of times
    // decoded to over a GB; here 2000 references of 60 KB (120 MB).
    let mut input = PREFACE.to_vec();
    input.extend(frame(
        FRAME_TYPE_HEADERS,
        FLAG_END_HEADERS,
        1,
        &hpack_bomb(Some(64 * 1024), 60_000, 2000),
    ));
    let mut rewriter = Rewriter::new();
    rewriter.push(&input).unwrap();
    // The server sees the table update it never allowed and refuses it.
    assert!(rewriter.is_passthrough());
    assert_eq!(rewriter.out.to_vec(), input);
}

#[test]
fn a_block_decoding_past_the_header_list_bound_is_not_held_in_either_mode() {
    // Within the table the server allows: a 4000-byte entry referenced
    // 20 000 times decodes to 80 MB from 24 KB.
    let bomb = hpack_bomb(None, 4000, 20_000);
    assert!(bomb.len() < HEADER_BLOCK_BYTES_MAX);
    let mut first = PREFACE.to_vec();
    first.extend(frame(FRAME_TYPE_HEADERS, FLAG_END_HEADERS, 1, &bomb));
    // As the first block: handed to the server as it came (which refuses
    // a list this large), not decoded into memory and re-encoded.
    let mut rewriter = Rewriter::new();
    rewriter.push(&first).unwrap();
    assert!(rewriter.is_passthrough());
    assert_eq!(rewriter.out.to_vec(), first);

    // On a rewritten connection: the connection is closed.
    let mut client = Client::new();
    client.request(1, &request_fields(URL, "/etcdserverpb.KV/Range"));
    let mut later = client.bytes.clone();
    later.extend(frame(FRAME_TYPE_HEADERS, FLAG_END_HEADERS, 3, &bomb));
    assert_eq!(rewrite(&later, &[]), Err(RepairError::ListTooLarge));

    // Just under the bound, a block is still repaired.
    let mut fields = request_fields(URL, "/etcdserverpb.KV/Range");
    let used: usize = fields
        .iter()
        .map(|(n, v)| n.len() + v.len() + FIELD_OVERHEAD_BYTES)
        .sum();
    let filler = HEADER_LIST_BYTES_MAX - used - FIELD_OVERHEAD_BYTES - b"x-filler".len();
    fields.push((b"x-filler".to_vec(), vec![b'f'; filler]));
    let mut client = Client::new();
    client.request(1, &fields);
    let seen = server_view(&rewrite(&client.bytes, &[]).unwrap());
    assert_eq!(
        seen[1],
        Seen::Headers {
            stream_id: 1,
            end_stream: false,
            fields: with_authority(&fields, HOST_PORT),
        }
    );
}

#[test]
fn authorities_are_repaired_only_when_they_are_urls_around_a_valid_authority() {
    let cases: [(&[u8], Option<&[u8]>); 8] = [
        (b"127.0.0.1:2379", None),
        (b"localhost", None),
        (b"http://127.0.0.1:2379", Some(b"127.0.0.1:2379")),
        (
            b"https://node-1.example:2379/",
            Some(b"node-1.example:2379"),
        ),
        (b"unix://sock/path", Some(b"sock")),
        (b"http://", None),
        (b"http://bad host", None),
        (b"\xff\xfe", None),
    ];
    for (value, expected) in cases {
        assert_eq!(
            repaired_authority(value).as_deref(),
            expected,
            "{}",
            String::from_utf8_lossy(value)
        );
    }
}

proptest! {
    #[test]
    fn the_output_does_not_depend_on_how_the_input_was_cut(
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        url_first in any::<bool>(),
    ) {
        let mut client = Client::new();
        let first = if url_first { URL } else { HOST_PORT };
        client.request(1, &request_fields(first, "/etcdserverpb.KV/Range"));
        client.request(3, &request_fields(URL, "/etcdserverpb.KV/Put"));
        let whole = rewrite(&client.bytes, &[]).unwrap();
        prop_assert_eq!(rewrite(&client.bytes, &cuts).unwrap(), whole);
    }

    #[test]
    fn no_input_makes_it_panic(
        tail in proptest::collection::vec(any::<u8>(), 0..2048),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
        rewritten in any::<bool>(),
    ) {
        let mut input = if rewritten {
            let mut client = Client::new();
            client.request(1, &request_fields(URL, "/etcdserverpb.KV/Range"));
            client.bytes
        } else {
            PREFACE.to_vec()
        };
        input.extend(tail);
        let _ = rewrite(&input, &cuts);
    }

    #[test]
    fn random_header_blocks_never_panic_the_decoder(
        blocks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..6),
    ) {
        let mut client = Client::new();
        client.request(1, &request_fields(URL, "/etcdserverpb.KV/Range"));
        for (i, block) in blocks.iter().enumerate() {
            client.bytes.extend(frame(FRAME_TYPE_HEADERS, FLAG_END_HEADERS, 3 + 2 * i as u32, block));
        }
        let _ = rewrite(&client.bytes, &[]);
    }
}
