//! CPU time per committed put applied to a member's state machine: decode
//! the command, look up the key's previous version, write the new one into
//! the store and hand the event to the watch hub (no watchers). Every
//! member of a group pays this for every write, so it is a third or more
//! of what a put costs the cluster beside the network, the log and the
//! disk. Keys and values as `ferry bench --workload put` sends them: 1,000
//! keys, 256-byte values, every key overwritten again and again.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ferry_server::command::{command, encode_command, CommandKind};
use ferry_server::kv_state::{KvLimits, Reads};
use ferry_server::pb::etcdserverpb::PutRequest;
use ferry_server::state::StateMachine;
use ferry_server::watch::WatchLimits;

/// The keys the puts cycle through (`ferry bench`'s default key space).
const KEY_COUNT: usize = 1_000;
/// Each value's size (`ferry bench`'s default).
const VALUE_BYTES: usize = 256;

fn apply_puts(c: &mut Criterion) {
    let limits = KvLimits::default();
    let commands: Vec<bytes::Bytes> = (0..KEY_COUNT)
        .map(|i| {
            let mut put = command(CommandKind::Put(PutRequest {
                key: format!("key-{i:06}").into_bytes().into(),
                value: vec![b'v'; VALUE_BYTES].into(),
                ..PutRequest::default()
            }));
            put.bounds = Some(limits.command_bounds());
            encode_command(&put).into()
        })
        .collect();
    let mut group = c.benchmark_group("apply");
    group.throughput(Throughput::Elements(1));
    for (name, reads) in [
        ("put", Reads::Build),
        ("put_response_size_only", Reads::SizeOnly),
    ] {
        group.bench_function(name, |b| {
            let mut machine = StateMachine::new(limits.clone(), WatchLimits::default());
            let mut index = 0u64;
            b.iter(|| {
                index += 1;
                let bytes = &commands[index as usize % KEY_COUNT];
                let applied = machine.apply_bytes_with(index, bytes, reads);
                assert!(applied.response.is_ok(), "{:?}", applied.response);
                black_box(applied)
            });
        });
    }
    group.finish();
}

criterion_group!(benches, apply_puts);
criterion_main!(benches);
