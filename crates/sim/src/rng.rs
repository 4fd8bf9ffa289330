//! The simulator's one source of randomness: a ChaCha8 generator seeded from
//! the run's u64 seed, with the few helpers the simulator needs. Every
//! random choice in a run goes through one of these, so a seed replays the
//! run exactly.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A seeded deterministic generator.
#[derive(Clone, Debug)]
pub struct SimRng {
    inner: ChaCha8Rng,
}

impl SimRng {
    /// A generator whose whole output is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        SimRng {
            inner: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// A uniformly random u64.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// A uniform value in `[low, high)`; `low` when the range is empty.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            return low;
        }
        let span = high - low;
        // Rejection sampling keeps the draw exactly uniform.
        let zone = u64::MAX - (u64::MAX % span);
        loop {
            let value = self.next_u64();
            if value < zone {
                return low + value % span;
            }
        }
    }

    /// A uniform value in `[low, high]`.
    pub fn range_inclusive(&mut self, low: u64, high: u64) -> u64 {
        if high == u64::MAX {
            return low.max(self.next_u64());
        }
        self.range(low, high + 1)
    }

    /// True with probability `parts_per_million / 1_000_000`.
    pub fn chance_ppm(&mut self, parts_per_million: u32) -> bool {
        self.range(0, 1_000_000) < u64::from(parts_per_million)
    }

    /// True with probability `percent / 100`.
    pub fn chance_percent(&mut self, percent: u32) -> bool {
        self.chance_ppm(percent.saturating_mul(10_000))
    }

    /// An index into a collection of `len` elements; `None` when empty.
    pub fn index(&mut self, len: usize) -> Option<usize> {
        if len == 0 {
            return None;
        }
        Some(self.range(0, len as u64) as usize)
    }

    /// A random element of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        self.index(items.len()).map(|i| &items[i])
    }

    /// A seed for a sub-generator (e.g. one engine node's election timers).
    pub fn derive_seed(&mut self) -> u64 {
        self.next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let mut a = SimRng::new(7);
        let mut b = SimRng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut c = SimRng::new(8);
        let mut a = SimRng::new(7);
        assert_ne!(a.next_u64(), c.next_u64());
    }

    #[test]
    fn ranges_stay_in_bounds_and_cover() {
        let mut rng = SimRng::new(1);
        let mut seen = [false; 5];
        for _ in 0..1000 {
            let v = rng.range(10, 15);
            assert!((10..15).contains(&v));
            seen[(v - 10) as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
        assert_eq!(rng.range(4, 4), 4);
        for _ in 0..100 {
            assert!(rng.range_inclusive(3, 4) <= 4);
        }
    }

    #[test]
    fn chances_are_roughly_right() {
        let mut rng = SimRng::new(2);
        let hits = (0..10_000).filter(|_| rng.chance_percent(30)).count();
        assert!((2_700..3_300).contains(&hits), "{hits}");
        assert!(!(0..1000).any(|_| rng.chance_percent(0)));
        assert!((0..1000).all(|_| rng.chance_percent(100)));
    }
}
