//! The TCP transport's reading path, fed fuzzed byte streams over real
//! connections: a hello (valid, or damaged) and frames (valid, or damaged)
//! in one stream per connection. The node delivers exactly the frames a
//! reference reading of the same bytes finds (none without a valid hello
//! for this node and cluster, none after the first bad frame), never
//! panics, gives back every byte of its inbound budget, and still takes a
//! valid peer's frames afterwards.

mod common;

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::{bytes, check, mutations, Expect};
use ferry_fuzz::mutate::mutated;
use ferry_fuzz::Verdict;
use ferry_runtime::transport::frame::{decode_frame, encode_frame};
use ferry_runtime::transport::handshake::{Hello, HELLO_BYTES};
use ferry_runtime::transport::{Transport, TransportConfig, TransportEvent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

const CLUSTER: u64 = 42;
const NODE: u64 = 1;
/// Small, so that damaged length fields often land on both sides of it.
const FRAME_BYTES_MAX: u32 = 4096;

/// The frames a node reading `stream` takes: the hello first (refused
/// unless it is one for this node and cluster), then frames up to the
/// first one that is over the limit or fails its checksum, or the end.
fn reference(stream: &[u8]) -> Vec<Bytes> {
    let mut buffer = BytesMut::from(stream);
    let Ok(Some(hello)) = decode_frame(&mut buffer, HELLO_BYTES as u32) else {
        return Vec::new();
    };
    let accepted = Hello::decode(&hello).is_ok_and(|hello| hello.verify(CLUSTER, NODE).is_ok());
    if !accepted {
        return Vec::new();
    }
    let mut frames = Vec::new();
    while let Ok(Some(frame)) = decode_frame(&mut buffer, FRAME_BYTES_MAX) {
        frames.push(frame);
    }
    frames
}

/// A valid peer's stream: its hello, then `payloads` framed.
fn stream_of(payloads: &[Vec<u8>]) -> Vec<u8> {
    let mut wire = BytesMut::new();
    let hello = Hello {
        cluster_id: CLUSTER,
        from: 9,
        to: NODE,
    };
    encode_frame(&hello.encode(), &mut wire);
    for payload in payloads {
        encode_frame(payload, &mut wire);
    }
    wire.to_vec()
}

/// Sends `stream` on a new connection, closes the sending side and waits
/// for the node to close the connection; returns the frames delivered.
async fn deliver(
    address: std::net::SocketAddr,
    events: &mut mpsc::Receiver<TransportEvent>,
    stream: &[u8],
) -> Vec<Bytes> {
    let mut connection = TcpStream::connect(address).await.unwrap();
    // The node may close early (a refused hello, a bad frame): then the
    // rest of the write fails, which is what a peer would see.
    let _ = connection.write_all(stream).await;
    let _ = connection.shutdown().await;
    let mut sink = [0u8; 4096];
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match connection.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the node kept a finished connection open");
    // Every frame of the connection was handed on before it closed.
    let mut frames = Vec::new();
    while let Ok(event) = events.try_recv() {
        match event {
            TransportEvent::Received { payload, .. } => frames.push(payload),
            other => panic!("unexpected {other:?}"),
        }
    }
    frames
}

#[test]
fn fuzzed_peer_streams_deliver_exactly_the_valid_frames() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (events_tx, events) = mpsc::channel(1024);
    // The property runs in a `Fn`: the receiver is borrowed per case.
    let events = std::cell::RefCell::new(events);
    let transport = runtime.block_on(async {
        let mut config = TransportConfig::new(NODE, CLUSTER, "127.0.0.1:0".parse().unwrap());
        config.frame_bytes_max = FRAME_BYTES_MAX;
        config.connect_timeout = Duration::from_secs(2);
        config.read_timeout = Duration::from_secs(2);
        Transport::start(config, events_tx).await.unwrap()
    });
    let address = transport.local_addr();
    let strategy = (
        proptest::collection::vec(bytes(300), 0..6),
        proptest::option::of(mutations()),
    );
    check(
        "transport stream",
        0.1,
        strategy,
        Expect::Both,
        |(payloads, damage)| {
            let valid = stream_of(&payloads);
            let stream = match &damage {
                Some(damage) => mutated(&valid, damage),
                None => valid,
            };
            let expected = reference(&stream);
            let received = runtime.block_on(deliver(address, &mut events.borrow_mut(), &stream));
            assert_eq!(
                received, expected,
                "the node delivered other frames than the stream holds"
            );
            if damage.is_none() {
                assert_eq!(received.len(), payloads.len());
            }
            Verdict::accepted_if(!received.is_empty())
        },
    );
    // Everything held for frames was given back (the events are dropped).
    runtime.block_on(async {
        for _ in 0..100 {
            if transport.inbound_buffered_bytes() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    assert_eq!(
        transport.inbound_buffered_bytes(),
        0,
        "the inbound budget leaked"
    );
    // A valid peer is still served.
    let payloads = vec![b"still here".to_vec()];
    let received = runtime.block_on(deliver(
        address,
        &mut events.borrow_mut(),
        &stream_of(&payloads),
    ));
    assert_eq!(received, vec![Bytes::from_static(b"still here")]);
    transport.shutdown();
}
