//! AFL++ harness of the `wal_record` target (see `ferry_fuzz::TARGETS`).

#[global_allocator]
static ALLOCATOR: ferry_fuzz::alloc::CountingAllocator = ferry_fuzz::alloc::CountingAllocator;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = ferry_fuzz::fuzz_one("wal_record", data);
    });
}
