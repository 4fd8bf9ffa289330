//! What every fuzz test binary shares: the counting allocator (so that the
//! targets check their allocation bounds), the proptest settings and the
//! mutation strategy.

// Each test file uses a part of this module.
#![allow(dead_code)]

use ferry_fuzz::mutate::Mutation;
use ferry_fuzz::Verdict;
use proptest::prelude::*;
use proptest::test_runner::Config;

#[global_allocator]
static ALLOCATOR: ferry_fuzz::alloc::CountingAllocator = ferry_fuzz::alloc::CountingAllocator;

/// Proptest's settings for a property worth `weight` of the default cases
/// (`FERRY_FUZZ_CASES` scales every property alike). No failure file is
/// written: a failure becomes a corpus file and a named regression test.
pub fn config(weight: f64) -> Config {
    let cases = f64::from(ferry_fuzz::cases(ferry_fuzz::DEFAULT_CASES)) * weight;
    Config {
        cases: (cases as u32).max(1),
        failure_persistence: None,
        max_shrink_iters: 2048,
        ..Config::default()
    }
}

/// One mutation of any kind, at any place.
pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), any::<u8>()).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::SetByte { at, value }),
        2 => any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1usize..64).prop_map(|(at, len)| Mutation::Remove { at, len }),
        1 => (any::<usize>(), any::<usize>(), 1usize..64)
            .prop_map(|(at, from, len)| Mutation::Splice { at, from, len }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(at, which)| Mutation::ExtremeU32 { at, which }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(at, which)| Mutation::ExtremeU64 { at, which }),
    ]
}

/// One to four mutations.
pub fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    proptest::collection::vec(mutation(), 1..5)
}

/// What a property's verdicts must show, so that a strategy whose inputs
/// are all refused (exploring nothing past the first check) or all
/// accepted (damaging nothing) shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Anything.
    Any,
    /// Some inputs accepted and some refused.
    Both,
    /// Some accepted.
    SomeAccepted,
    /// Every input accepted.
    AllAccepted,
}

/// Runs `test` on `weight` times the default cases drawn from `strategy`
/// (a panic in it is a failure, shrunk to a minimal input and reported),
/// then checks the verdicts against `expect`. Prints the counts with
/// `--nocapture`.
pub fn check<S: Strategy>(
    property: &str,
    weight: f64,
    strategy: S,
    expect: Expect,
    test: impl Fn(S::Value) -> Verdict,
) where
    S::Value: std::fmt::Debug,
{
    let accepted = std::sync::atomic::AtomicU64::new(0);
    let refused = std::sync::atomic::AtomicU64::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(config(weight));
    let started = std::time::Instant::now();
    let outcome = runner.run(&strategy, |value| {
        let counter = match test(value) {
            Verdict::Accepted => &accepted,
            Verdict::Refused => &refused,
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    });
    if let Err(error) = outcome {
        panic!("{property}: {error}");
    }
    let accepted = accepted.into_inner();
    let refused = refused.into_inner();
    eprintln!(
        "{property}: {} cases in {:.1?}: {accepted} accepted, {refused} refused",
        accepted + refused,
        started.elapsed()
    );
    let enough = accepted + refused >= 50;
    match expect {
        Expect::Any => {}
        Expect::Both => assert!(
            !enough || (accepted > 0 && refused > 0),
            "{property}: {accepted} accepted, {refused} refused"
        ),
        Expect::SomeAccepted => assert!(!enough || accepted > 0, "{property}: nothing accepted"),
        Expect::AllAccepted => assert_eq!(refused, 0, "{property}: valid inputs refused"),
    }
}

/// A u64 drawn mostly from the edges ([`ferry_fuzz::mutate::EXTREME_U64`]).
pub fn extreme_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => proptest::sample::select(&ferry_fuzz::mutate::EXTREME_U64[..]),
        1 => 0u64..16,
        1 => any::<u64>(),
    ]
}

/// An i64 drawn mostly from the edges.
pub fn extreme_i64() -> impl Strategy<Value = i64> {
    prop_oneof![
        3 => proptest::sample::select(&[i64::MIN, i64::MIN + 1, -1, 0, 1, 2, i64::MAX - 1, i64::MAX, 1 << 31, 1 << 32][..]),
        2 => -4i64..16,
        1 => any::<i64>(),
    ]
}

/// One of the seeds of `target`, by a drawn index.
pub fn seed(target: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let seeds = ferry_fuzz::seeds::seeds(target);
    assert!(!seeds.is_empty(), "{target} has no seeds");
    proptest::sample::select(seeds)
}

/// Runs `target` on mutations of its seeds, counting verdicts under `property`.
pub fn mutated_seed(target: &'static str) -> impl Strategy<Value = Vec<u8>> {
    (seed(target), mutations())
        .prop_map(|(seed, mutations)| ferry_fuzz::mutate::mutated(&seed, &mutations))
}

/// Arbitrary bytes, short and long.
pub fn bytes(len_max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..len_max)
}

/// Whether `damaged` differs from `original` only within one run of at
/// most four bytes (same length): damage a crc32c always detects. Wider
/// damage can rewrite data and its checksum alike (four 0xff bytes with a
/// checksum of four 0xff bytes are a valid block of a snapshot file with
/// blocks of four bytes), which no checksum can tell from valid data.
pub fn within_one_burst(original: &[u8], damaged: &[u8]) -> bool {
    if original.len() != damaged.len() {
        return false;
    }
    let differing: Vec<usize> = (0..original.len())
        .filter(|&i| original[i] != damaged[i])
        .collect();
    match (differing.first(), differing.last()) {
        (Some(first), Some(last)) => last - first < 4,
        _ => true,
    }
}
