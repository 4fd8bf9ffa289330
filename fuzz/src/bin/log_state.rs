//! AFL++ harness of the `log_state` target (see `ferry_fuzz::TARGETS`).

#[global_allocator]
static ALLOCATOR: ferry_fuzz::alloc::CountingAllocator = ferry_fuzz::alloc::CountingAllocator;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = ferry_fuzz::fuzz_one("log_state", data);
    });
}
