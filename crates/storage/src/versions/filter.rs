//! A run's key filter: a Bloom filter over the distinct keys of one run,
//! kept in memory beside its block index, so that a point lookup of a key
//! the run does not hold reads none of its blocks (a put of a new key
//! asks every run; without the filter it would read one block of each).
//!
//! ```text
//! filter := probes u8 | bits (u32 len + bytes)
//! ```
//!
//! [`FILTER_BITS_PER_KEY`] bits a key and [`FILTER_PROBES`] probes give
//! about one false positive in a hundred. A key's probes come from one
//! 32-bit hash (crc32c, hardware-accelerated, of the key) spread over 64
//! bits by a fixed mixer and split into a start and a stride (double
//! hashing). Both are fixed by the run format: a filter written by one build
//! is read by the next.

use bytes::Bytes;

use crate::codec::{Decoder, Encoder};
use crate::error::DecodeError;

/// Bits of filter per distinct key.
pub const FILTER_BITS_PER_KEY: usize = 10;
/// Bits probed (and set) per key: about `ln 2 * FILTER_BITS_PER_KEY`.
pub const FILTER_PROBES: u8 = 7;
/// Most probes a filter read from disk may ask for.
const FILTER_PROBES_MAX: u8 = 30;
/// Fewest bits a filter has (so that a run of one key is not all ones).
const FILTER_BITS_MIN: usize = 64;

/// The hash a filter is built from and probed with.
pub fn key_hash(key: &[u8]) -> u32 {
    crc32c::crc32c(key)
}

/// A Bloom filter over a set of keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFilter {
    probes: u8,
    bits: Bytes,
}

impl KeyFilter {
    /// A filter for the keys whose [`key_hash`]es are `hashes` (one per
    /// distinct key).
    pub fn build(hashes: &[u32]) -> KeyFilter {
        let bit_count = hashes
            .len()
            .saturating_mul(FILTER_BITS_PER_KEY)
            .max(FILTER_BITS_MIN);
        let mut bits = vec![0u8; bit_count.div_ceil(8)];
        let bit_count = (bits.len() as u64).saturating_mul(8);
        for &hash in hashes {
            for bit in probe_bits(hash, FILTER_PROBES, bit_count) {
                bits[(bit / 8) as usize] |= 1 << (bit % 8);
            }
        }
        KeyFilter {
            probes: FILTER_PROBES,
            bits: Bytes::from(bits),
        }
    }

    /// False when the set surely lacks `key`; true when it may hold it.
    pub fn may_contain(&self, key: &[u8]) -> bool {
        let bit_count = (self.bits.len() as u64).saturating_mul(8);
        probe_bits(key_hash(key), self.probes, bit_count)
            .all(|bit| self.bits[(bit / 8) as usize] & (1 << (bit % 8)) != 0)
    }

    /// Bytes it takes in memory.
    pub fn size_bytes(&self) -> usize {
        self.bits.len()
    }

    /// Appends its encoding.
    pub fn encode(&self, enc: &mut Encoder) {
        enc.u8(self.probes);
        enc.bytes(&self.bits);
    }

    /// Reads one, of at most `bytes_max` bytes of bits.
    pub fn decode(d: &mut Decoder, bytes_max: u64) -> Result<KeyFilter, DecodeError> {
        let probes = d.u8()?;
        if probes == 0 || probes > FILTER_PROBES_MAX {
            return Err(DecodeError::Invalid("key filter probe count out of range"));
        }
        let bits = d.bytes("key filter", bytes_max)?;
        if bits.is_empty() {
            return Err(DecodeError::Invalid("key filter without bits"));
        }
        Ok(KeyFilter { probes, bits })
    }
}

/// The bits probed for `hash` in a filter of `bit_count` bits (not 0).
fn probe_bits(hash: u32, probes: u8, bit_count: u64) -> impl Iterator<Item = u64> {
    debug_assert!(bit_count > 0);
    // crc32c is linear in its input, so keys that differ in a few bits
    // have hashes that differ in a few fixed bits; a multiply-xorshift
    // mixer (a bijection) breaks that pattern before the hash is split.
    let mut h = u64::from(hash).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^= h >> 29;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 32;
    let start = h & 0xFFFF_FFFF;
    let stride = (h >> 32) | 1;
    (0..u64::from(probes)).map(move |i| start.wrapping_add(i.wrapping_mul(stride)) % bit_count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter_of(keys: &[Vec<u8>]) -> KeyFilter {
        let hashes: Vec<u32> = keys.iter().map(|k| key_hash(k)).collect();
        KeyFilter::build(&hashes)
    }

    #[test]
    fn every_key_put_in_is_found() {
        let keys: Vec<Vec<u8>> = (0..5000)
            .map(|i| format!("/registry/pods/ns-{}/pod-{i}", i % 7).into_bytes())
            .collect();
        let filter = filter_of(&keys);
        assert!(keys.iter().all(|k| filter.may_contain(k)));
    }

    #[test]
    fn keys_not_put_in_are_mostly_refused() {
        // Keys of the shape the benchmarks and Kubernetes use: a shared
        // prefix and a counter, the case a linear hash handles worst.
        let keys: Vec<Vec<u8>> = (0..20_000)
            .map(|i| format!("key-{i:08}").into_bytes())
            .collect();
        let filter = filter_of(&keys);
        let absent = 20_000..120_000;
        let false_positives = absent
            .clone()
            .filter(|i| filter.may_contain(format!("key-{i:08}").as_bytes()))
            .count();
        let rate = false_positives as f64 / absent.len() as f64;
        assert!(rate < 0.02, "false-positive rate {rate}");
        assert_eq!(filter.size_bytes(), 20_000 * FILTER_BITS_PER_KEY / 8);
    }

    #[test]
    fn an_empty_filter_refuses_everything_and_round_trips() {
        let filter = KeyFilter::build(&[]);
        assert!(!filter.may_contain(b"a"));
        let mut enc = Encoder::default();
        filter.encode(&mut enc);
        let mut d = Decoder::new(Bytes::from(enc.into_inner()));
        assert_eq!(KeyFilter::decode(&mut d, 1 << 20).unwrap(), filter);
        d.finish().unwrap();
    }

    #[test]
    fn a_damaged_filter_header_is_refused() {
        for (probes, bits) in [(0u8, vec![1u8; 8]), (200, vec![1; 8]), (7, vec![])] {
            let mut enc = Encoder::default();
            enc.u8(probes);
            enc.bytes(&bits);
            let mut d = Decoder::new(Bytes::from(enc.into_inner()));
            assert!(KeyFilter::decode(&mut d, 1 << 20).is_err());
        }
        let mut enc = Encoder::default();
        KeyFilter::build(&[1, 2, 3]).encode(&mut enc);
        let mut d = Decoder::new(Bytes::from(enc.into_inner()));
        assert!(KeyFilter::decode(&mut d, 4).is_err(), "longer than allowed");
    }
}
