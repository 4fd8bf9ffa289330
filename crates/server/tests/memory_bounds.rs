//! Memory the state machine takes, measured with a counting allocator: a
//! member no client waits on builds no read results.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ferry_server::command::{command, CommandKind};
use ferry_server::kv_state::{KvLimits, Reads};
use ferry_server::pb::etcdserverpb::request_op::Request;
use ferry_server::pb::etcdserverpb::{PutRequest, RangeRequest, RequestOp, TxnRequest};
use ferry_server::pb::ferrypb::Command;
use ferry_server::state::StateMachine;
use ferry_server::watch::WatchLimits;

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
        key: key.as_bytes().to_vec(),
        value: vec![b'v'; value_bytes],
        ..PutRequest::default()
    }))
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
