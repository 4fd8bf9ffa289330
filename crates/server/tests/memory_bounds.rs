//! Memory the state machine and the watch hub take, measured with a
//! counting allocator: a put fanned out to thousands of watchers costs one
//! copy of its event, a stream that does not read holds a bounded amount
//! and gives it back when it goes, and a member no client waits on builds
//! no read results.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ferry_server::command::{command, CommandKind};
use ferry_server::kv_state::{KvLimits, Reads};
use ferry_server::pb::etcdserverpb::request_op::Request;
use ferry_server::pb::etcdserverpb::{
    PutRequest, RangeRequest, RequestOp, TxnRequest, WatchCreateRequest, WatchResponse,
};
use ferry_server::pb::ferrypb::Command;
use ferry_server::state::StateMachine;
use ferry_server::watch::{StreamId, WatchLimits};

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed on to the system allocator unchanged; the
// counters are only read by the tests.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            let live = LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One measurement at a time: the counters are global.
static MEASURING: Mutex<()> = Mutex::new(());

/// Bytes live now.
fn live() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

/// The most bytes live at once while `work` runs, above what was live
/// before it.
fn peak_during<T>(work: impl FnOnce() -> T) -> (T, usize) {
    let before = live();
    PEAK_BYTES.store(before, Ordering::Relaxed);
    let value = work();
    let peak = PEAK_BYTES.load(Ordering::Relaxed);
    (value, peak.saturating_sub(before))
}

const MIB: usize = 1 << 20;

fn put(key: &str, value_bytes: usize) -> Command {
    command(CommandKind::Put(PutRequest {
        key: key.as_bytes().to_vec().into(),
        value: vec![b'v'; value_bytes].into(),
        ..PutRequest::default()
    }))
}

fn whole_keyspace() -> WatchCreateRequest {
    WatchCreateRequest {
        key: vec![0],
        range_end: vec![0],
        ..WatchCreateRequest::default()
    }
}

/// Drains a stream until nothing is behind, checking as it goes that each
/// of its watchers sees the revisions `next[watch_id]..` in order, once.
fn drain_checking(
    machine: &mut StateMachine,
    stream: StreamId,
    next: &mut std::collections::BTreeMap<i64, i64>,
) {
    loop {
        let (out, behind) = drain(machine, stream);
        for response in out {
            check_response(&response, next);
        }
        if !behind {
            return;
        }
    }
}

/// One drain of `stream`, its responses decoded as a client reads them.
fn drain(machine: &mut StateMachine, stream: StreamId) -> (Vec<WatchResponse>, bool) {
    let (out, behind) = machine.watch_drain(stream);
    let out = out
        .into_iter()
        .map(|response| response.into_response().expect("events decode"))
        .collect();
    (out, behind)
}

fn check_response(response: &WatchResponse, next: &mut std::collections::BTreeMap<i64, i64>) {
    assert!(!response.canceled, "{}", response.cancel_reason);
    for event in &response.events {
        let revision = event.kv.as_ref().map_or(0, |kv| kv.mod_revision);
        let expected = next.entry(response.watch_id).or_insert(2);
        assert_eq!(
            revision, *expected,
            "watcher {} skipped or repeated",
            response.watch_id
        );
        *expected += 1;
    }
}

#[test]
fn a_put_fanned_out_to_4096_watchers_costs_one_copy_and_a_stream_that_does_not_read_stays_bounded()
{
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    const VALUE_BYTES: usize = 20 * 1024;
    const PUTS: usize = 1000;
    let limits = WatchLimits::default();
    let mut machine = StateMachine::new(KvLimits::default(), limits.clone());
    let (slow, _) = machine.watches.open_stream().unwrap();
    for _ in 0..4096 {
        machine.watch_create(slow, &whole_keyspace());
    }
    let (fast, _) = machine.watches.open_stream().unwrap();
    machine.watch_create(fast, &whole_keyspace());
    let mut fast_next = std::collections::BTreeMap::new();
    drain_checking(&mut machine, fast, &mut fast_next);
    // The slow stream's client reads its "created" answers, then nothing.
    let _ = drain(&mut machine, slow);

    let before = live();
    for i in 0..PUTS {
        let ((), peak) = peak_during(|| {
            let applied = machine.apply(i as u64 + 1, &put(&format!("k{}", i % 100), VALUE_BYTES));
            assert!(applied.response.is_ok());
        });
        // One put: the value in the store, its event, a few copies of it
        // at most, and a queue entry per watcher (when all 4096 queues
        // double their capacity on the same put, about 1.3 KB each); not
        // 4096 copies of the event (80 MiB).
        assert!(
            peak < 8 * MIB,
            "put {i}, of 20 KiB, to 4096 watchers took {peak} bytes at its peak"
        );
        // However many puts, the slow stream holds no more than its bound.
        let queued = machine.watches.stream_queued_bytes(slow);
        assert!(
            queued <= limits.stream_queued_bytes_max,
            "{queued} bytes queued for the slow stream after put {i}"
        );
        // The watcher that keeps up gets every revision.
        drain_checking(&mut machine, fast, &mut fast_next);
        assert_eq!(fast_next.get(&0), Some(&(i as i64 + 3)));
    }
    let queued = machine.watches.queued_bytes();
    assert_eq!(
        machine.watches.stream_queued_bytes(slow),
        queued,
        "the fast stream holds nothing"
    );
    // The store keeps every version (nothing was compacted); the hub keeps
    // the last revisions' events for watchers that fall behind.
    let store_bytes = PUTS * (VALUE_BYTES + 128);
    let grown = live().saturating_sub(before);
    assert!(
        grown < limits.stream_queued_bytes_max + limits.recent_bytes_max + store_bytes + 4 * MIB,
        "the node grew by {grown} bytes"
    );

    // The client goes away: what its stream held is given back.
    let before_close = live();
    machine.watches.close_stream(slow);
    assert_eq!(machine.watches.queued_bytes(), 0);
    let freed = before_close.saturating_sub(live());
    assert!(
        freed + MIB >= queued.min(8 * MIB),
        "closing the stream freed {freed} of the {queued} bytes it held"
    );
}

#[test]
fn a_slow_stream_loses_nothing_once_it_reads_again() {
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let limits = WatchLimits {
        stream_queued_bytes_max: 256 * 1024,
        node_queued_bytes_max: 512 * 1024,
        drain_bytes_max: 64 * 1024,
        ..WatchLimits::default()
    };
    let mut machine = StateMachine::new(KvLimits::default(), limits.clone());
    let (slow, _) = machine.watches.open_stream().unwrap();
    for _ in 0..64 {
        machine.watch_create(slow, &whole_keyspace());
    }
    let (fast, _) = machine.watches.open_stream().unwrap();
    machine.watch_create(fast, &whole_keyspace());
    let mut slow_next = std::collections::BTreeMap::new();
    let mut fast_next = std::collections::BTreeMap::new();
    drain_checking(&mut machine, slow, &mut slow_next);
    drain_checking(&mut machine, fast, &mut fast_next);
    for i in 0..500u64 {
        let applied = machine.apply(i + 1, &put(&format!("k{}", i % 37), 2048));
        assert!(applied.response.is_ok());
        drain_checking(&mut machine, fast, &mut fast_next);
        assert!(machine.watches.queued_bytes() <= limits.node_queued_bytes_max);
        assert!(machine.watches.stream_queued_bytes(slow) <= limits.stream_queued_bytes_max);
    }
    assert_eq!(fast_next.get(&0), Some(&502));
    // Each drain hands out a bounded piece.
    let (first, behind) = drain(&mut machine, slow);
    assert!(behind);
    let handed: usize = first
        .iter()
        .flat_map(|r| r.events.iter())
        .map(|e| e.kv.as_ref().map_or(0, |kv| kv.value.len()))
        .sum();
    assert!(
        handed <= limits.drain_bytes_max + 2 * 4096,
        "{handed} bytes in one drain"
    );
    for response in &first {
        check_response(response, &mut slow_next);
    }
    drain_checking(&mut machine, slow, &mut slow_next);
    assert_eq!(slow_next.len(), 64);
    assert!(
        slow_next.values().all(|next| *next == 502),
        "every slow watcher got every revision: {slow_next:?}"
    );
}

fn full_range() -> RequestOp {
    RequestOp {
        request: Some(Request::RequestRange(RangeRequest {
            key: vec![0],
            range_end: vec![0],
            ..RangeRequest::default()
        })),
    }
}

#[test]
fn a_member_no_client_waits_on_builds_no_read_results() {
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let mut machines: Vec<StateMachine> = (0..2)
        .map(|_| StateMachine::new(KvLimits::default(), WatchLimits::default()))
        .collect();
    // 1 MB of values, and a txn of 32 ranges over all of it (32 MB).
    for machine in &mut machines {
        for i in 0..100u64 {
            assert!(machine
                .apply(i + 1, &put(&format!("k{i:03}"), 10_000))
                .response
                .is_ok());
        }
    }
    let txn = command(CommandKind::Txn(TxnRequest {
        compare: vec![],
        success: (0..32).map(|_| full_range()).collect(),
        failure: vec![],
    }));
    let (built, built_peak) = peak_during(|| machines[0].apply_with(101, &txn, Reads::Build));
    let (sized, sized_peak) = peak_during(|| machines[1].apply_with(101, &txn, Reads::SizeOnly));
    assert!(built.response.is_ok() && sized.response.is_ok());
    assert!(built_peak >= 32 * 1_000_000, "{built_peak}");
    assert!(
        sized_peak < MIB,
        "a member nobody waits on took {sized_peak} bytes for the reads"
    );
    assert_eq!(machines[0].kv(), machines[1].kv());
}
