//! Mutations of valid encodings: what a damaged disk, a buggy peer or a
//! hostile one does to bytes that were right.
//!
//! Positions are taken modulo the input's length, so that any mutation
//! applies to any input (a fuzzer or proptest draws them without knowing
//! the input); a mutation of an empty input does nothing but insert.

/// Values a length, count, index or term field is set to: the edges where
/// arithmetic wraps, limits sit and allocations explode.
pub const EXTREME_U32: [u32; 12] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_fffe,
    u32::MAX,
    64 << 20,
];

/// The 64-bit counterparts of [`EXTREME_U32`].
pub const EXTREME_U64: [u64; 10] = [
    0,
    1,
    u32::MAX as u64,
    1 << 32,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
    0x7fff_ffff_ffff_fffe,
    64 << 20,
];

/// One change to a byte string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Flips bit `bit % 8` of the byte at `at`.
    FlipBit {
        /// Where.
        at: usize,
        /// Which bit.
        bit: u8,
    },
    /// Sets the byte at `at`.
    SetByte {
        /// Where.
        at: usize,
        /// The new value.
        value: u8,
    },
    /// Keeps the first `len` bytes (modulo the length plus one).
    Truncate {
        /// How many bytes are kept.
        len: usize,
    },
    /// Inserts `bytes` before `at` (modulo the length plus one).
    Insert {
        /// Where.
        at: usize,
        /// What.
        bytes: Vec<u8>,
    },
    /// Removes up to `len` bytes from `at`.
    Remove {
        /// Where.
        at: usize,
        /// How many.
        len: usize,
    },
    /// Copies up to `len` bytes from `from` over the bytes at `at` (a
    /// splice of the input with itself: records and fields moved around).
    Splice {
        /// Where the bytes go.
        at: usize,
        /// Where they come from.
        from: usize,
        /// How many.
        len: usize,
    },
    /// Writes one of [`EXTREME_U32`] little endian at `at` (a length or
    /// count field set to an extreme).
    ExtremeU32 {
        /// Where.
        at: usize,
        /// Which extreme.
        which: usize,
    },
    /// Writes one of [`EXTREME_U64`] little endian at `at`.
    ExtremeU64 {
        /// Where.
        at: usize,
        /// Which extreme.
        which: usize,
    },
}

/// Applies `mutation` to `data`.
pub fn apply(data: &mut Vec<u8>, mutation: &Mutation) {
    let len = data.len();
    match mutation {
        Mutation::Insert { at, bytes } => {
            let at = at % (len + 1);
            data.splice(at..at, bytes.iter().copied());
        }
        Mutation::Truncate { len: keep } => data.truncate(keep % (len + 1)),
        _ if len == 0 => {}
        Mutation::FlipBit { at, bit } => data[at % len] ^= 1 << (bit % 8),
        Mutation::SetByte { at, value } => data[at % len] = *value,
        Mutation::Remove { at, len: count } => {
            let at = at % len;
            let end = at.saturating_add(*count).min(len);
            data.drain(at..end);
        }
        Mutation::Splice {
            at,
            from,
            len: count,
        } => {
            let (at, from) = (at % len, from % len);
            let count = (*count).min(len - at).min(len - from);
            data.copy_within(from..from + count, at);
        }
        Mutation::ExtremeU32 { at, which } => {
            let value = EXTREME_U32[which % EXTREME_U32.len()].to_le_bytes();
            overwrite(data, at % len, &value);
        }
        Mutation::ExtremeU64 { at, which } => {
            let value = EXTREME_U64[which % EXTREME_U64.len()].to_le_bytes();
            overwrite(data, at % len, &value);
        }
    }
}

/// Writes as much of `value` as fits at `at`.
fn overwrite(data: &mut [u8], at: usize, value: &[u8]) {
    let count = value.len().min(data.len() - at);
    data[at..at + count].copy_from_slice(&value[..count]);
}

/// `data` with every mutation of `mutations` applied in order.
pub fn mutated(data: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut out = data.to_vec();
    for mutation in mutations {
        apply(&mut out, mutation);
    }
    out
}

/// Inputs one byte away from `data`: each byte XORed with each of a few
/// masks (one bit, the low half, all bits), then each truncation; every
/// `step`-th of them (1 for all), made only when taken. For small seeds,
/// run exhaustively rather than drawn.
pub fn one_byte_neighbours(data: &[u8], step: usize) -> impl Iterator<Item = Vec<u8>> + '_ {
    const MASKS: [u8; 4] = [0x01, 0x80, 0x0f, 0xff];
    let flips = data.len() * MASKS.len();
    (0..flips + data.len()).step_by(step.max(1)).map(move |i| {
        if i < flips {
            let mut out = data.to_vec();
            out[i / MASKS.len()] ^= MASKS[i % MASKS.len()];
            out
        } else {
            data[..i - flips].to_vec()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_apply_to_any_input_without_panicking() {
        let all = [
            Mutation::FlipBit { at: 7, bit: 9 },
            Mutation::SetByte { at: 3, value: 1 },
            Mutation::Truncate { len: 100 },
            Mutation::Insert {
                at: 50,
                bytes: vec![1, 2],
            },
            Mutation::Remove {
                at: 2,
                len: usize::MAX,
            },
            Mutation::Splice {
                at: 1,
                from: 5,
                len: usize::MAX,
            },
            Mutation::ExtremeU32 { at: 9, which: 100 },
            Mutation::ExtremeU64 { at: 0, which: 3 },
        ];
        for len in 0..12 {
            let data: Vec<u8> = (0..len).collect();
            for mutation in &all {
                let _ = mutated(&data, std::slice::from_ref(mutation));
            }
        }
        assert_eq!(
            mutated(
                &[1, 2, 3, 4],
                &[Mutation::Splice {
                    at: 0,
                    from: 2,
                    len: 2
                }]
            ),
            [3, 4, 3, 4]
        );
        assert_eq!(one_byte_neighbours(&[0, 0], 1).count(), 2 * 4 + 2);
        assert_eq!(one_byte_neighbours(&[0, 0], 3).count(), 4);
    }
}
