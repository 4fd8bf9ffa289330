//! A counting allocator, so that a target can assert that decoding one
//! input allocated no more than the input justifies.
//!
//! A test binary (or a fuzzer's harness) installs it with
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: ferry_fuzz::alloc::CountingAllocator = ferry_fuzz::alloc::CountingAllocator;
//! ```
//!
//! The counts are per thread: test binaries run their tests on several
//! threads at once, and a target decodes on the thread that calls it, so a
//! thread's own counts measure its target and nothing else. Memory freed on
//! another thread than the one that allocated it only makes a count lower,
//! never a peak higher. Without the allocator installed the targets skip
//! their allocation checks ([`peak_bytes_during`] says `None`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

/// The system allocator, counting per thread the bytes live and their peak.
pub struct CountingAllocator;

/// Whether [`CountingAllocator`] is the global allocator (set by its first
/// allocation).
static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    // `const` and no destructor: reading these from inside the allocator
    // never allocates, also while the thread is being torn down.
    static LIVE_BYTES: Cell<isize> = const { Cell::new(0) };
    static PEAK_BYTES: Cell<isize> = const { Cell::new(0) };
}

fn add_live(delta_bytes: isize) {
    let _ = LIVE_BYTES.try_with(|live| {
        let now = live.get().saturating_add(delta_bytes);
        live.set(now);
        let _ = PEAK_BYTES.try_with(|peak| {
            if now > peak.get() {
                peak.set(now);
            }
        });
    });
}

fn size_of(layout: Layout) -> isize {
    isize::try_from(layout.size()).unwrap_or(isize::MAX)
}

// SAFETY: every call is passed on to the system allocator unchanged; the
// counters are plain thread-local cells that never allocate.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            add_live(size_of(layout));
        }
        pointer
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        let pointer = unsafe { System.alloc_zeroed(layout) };
        if !pointer.is_null() {
            add_live(size_of(layout));
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) };
        add_live(-size_of(layout));
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let moved = unsafe { System.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            // Counted as if both blocks were live for a moment, as they may
            // be: a peak never under-reports.
            add_live(isize::try_from(new_size).unwrap_or(isize::MAX));
            add_live(-size_of(layout));
        }
        moved
    }
}

/// Runs `work` and returns what it returned and the most bytes this thread
/// held at once while it ran, above what it held before; `None` for the
/// bytes if [`CountingAllocator`] is not the global allocator.
pub fn peak_bytes_during<T>(work: impl FnOnce() -> T) -> (T, Option<usize>) {
    let before = LIVE_BYTES.with(Cell::get);
    PEAK_BYTES.with(|peak| peak.set(before));
    let value = work();
    let peak = PEAK_BYTES.with(Cell::get);
    let bytes = usize::try_from(peak.saturating_sub(before)).unwrap_or(0);
    (value, INSTALLED.load(Ordering::Relaxed).then_some(bytes))
}

/// Asserts that `work` held at most `bound_bytes` at once (when the counting
/// allocator is installed), naming `target` and the input size if not.
pub fn assert_bounded<T>(
    target: &str,
    input_bytes: usize,
    bound_bytes: usize,
    work: impl FnOnce() -> T,
) -> T {
    let (value, peak) = peak_bytes_during(work);
    if let Some(peak_bytes) = peak {
        assert!(
            peak_bytes <= bound_bytes,
            "{target}: decoding {input_bytes} bytes held {peak_bytes} bytes at once, \
             over the bound of {bound_bytes}"
        );
    }
    value
}
