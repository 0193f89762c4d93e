//! Random numbers, offset generators and the verification data pattern.

/// A small, fast pseudo-random generator (xorshift64*); not for cryptography.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Creates a generator; any seed is fine (zero is remapped).
    pub fn new(seed: u64) -> Self {
        Self(mix64(seed) | 1)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (`n` > 0), without modulo bias worth caring about.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// True with probability `percent`/100.
    pub fn percent(&mut self, percent: u8) -> bool {
        self.below(100) < u64::from(percent)
    }
}

/// SplitMix64 finaliser: a good 64-bit mixing function.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Chooses the byte offsets of successive I/Os inside a region of the device.
#[derive(Clone, Debug)]
pub struct OffsetGen {
    base: u64,
    bs: u64,
    blocks: u64,
    stride: u64,
    phase: u64,
    random: bool,
    cursor: u64,
}

impl OffsetGen {
    /// I/Os of `bs` bytes inside `[base, base + len)`, random or sequential (wrapping around).
    /// `start` is where a sequential stream begins, relative to `base`.
    pub fn new(base: u64, len: u64, bs: u64, random: bool, start: u64) -> Self {
        let blocks = (len / bs).max(1);
        Self {
            base,
            bs,
            blocks,
            stride: 1,
            phase: 0,
            random,
            cursor: (start / bs) % blocks,
        }
    }

    /// Restricts the generator to blocks `b` with `b % stride == phase`, so that `stride`
    /// generators with distinct phases never touch the same block (used by `--verify` so
    /// that two I/Os in flight never overlap).
    pub fn interleaved(mut self, stride: u64, phase: u64) -> Self {
        let stride = stride.clamp(1, self.blocks);
        self.stride = stride;
        self.phase = phase % stride;
        self.blocks = (self.blocks - self.phase).div_ceil(stride);
        self.cursor %= self.blocks;
        self
    }

    /// Byte offset of the next I/O.
    pub fn next(&mut self, rng: &mut Rng) -> u64 {
        let idx = if self.random {
            rng.below(self.blocks)
        } else {
            let i = self.cursor;
            self.cursor += 1;
            if self.cursor == self.blocks {
                self.cursor = 0;
            }
            i
        };
        self.base + (idx * self.stride + self.phase) * self.bs
    }
}

/// Fills `buf` with the verification pattern of (`offset`, `seq`): every 8-byte word is a
/// hash of the offset, the sequence number and the word's index, so stale data, data from
/// another offset and torn writes are all detected.
pub fn fill_pattern(buf: &mut [u8], offset: u64, seq: u64) {
    let key = mix64(offset ^ seq.rotate_left(32));
    for (i, word) in buf.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&mix64(key ^ i as u64).to_le_bytes());
    }
}

/// Returns the byte index of the first difference between `buf` and the pattern of
/// (`offset`, `seq`), or `None` if it matches.
pub fn check_pattern(buf: &[u8], offset: u64, seq: u64) -> Option<usize> {
    let key = mix64(offset ^ seq.rotate_left(32));
    buf.chunks_exact(8)
        .enumerate()
        .find(|(i, word)| **word != mix64(key ^ *i as u64).to_le_bytes())
        .map(|(i, _)| i * 8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn random_offsets_are_aligned_and_in_range() {
        let mut rng = Rng::new(1);
        let mut g = OffsetGen::new(1 << 20, 1 << 20, 4096, true, 0);
        for _ in 0..10_000 {
            let o = g.next(&mut rng);
            assert_eq!(o % 4096, 0);
            assert!((1 << 20..2 << 20).contains(&o));
        }
    }

    #[test]
    fn sequential_offsets_wrap() {
        let mut rng = Rng::new(1);
        let mut g = OffsetGen::new(0, 4 * 512, 512, false, 1024);
        let got: Vec<u64> = (0..6).map(|_| g.next(&mut rng)).collect();
        assert_eq!(got, vec![1024, 1536, 0, 512, 1024, 1536]);
    }

    #[test]
    fn interleaved_generators_are_disjoint() {
        let mut rng = Rng::new(7);
        let mut seen: Vec<HashSet<u64>> = Vec::new();
        for phase in 0..4 {
            let mut g = OffsetGen::new(0, 1 << 16, 512, true, 0).interleaved(4, phase);
            seen.push((0..1000).map(|_| g.next(&mut rng)).collect());
            assert!(seen[phase as usize].iter().all(|o| *o < 1 << 16));
        }
        for a in 0..4 {
            for b in a + 1..4 {
                assert!(seen[a].is_disjoint(&seen[b]));
            }
        }
    }

    #[test]
    fn rng_below_is_in_range_and_covers() {
        let mut rng = Rng::new(0);
        let mut hits = [0u32; 10];
        for _ in 0..10_000 {
            hits[rng.below(10) as usize] += 1;
        }
        assert!(hits.iter().all(|h| *h > 800), "{hits:?}");
    }

    #[test]
    fn pattern_roundtrip_and_mismatch() {
        let mut buf = vec![0u8; 4096];
        fill_pattern(&mut buf, 8192, 3);
        assert_eq!(check_pattern(&buf, 8192, 3), None);
        assert_eq!(check_pattern(&buf, 8192, 4), Some(0));
        assert_eq!(check_pattern(&buf, 4096, 3), Some(0));
        buf[100] ^= 1;
        assert_eq!(check_pattern(&buf, 8192, 3), Some(96));
    }
}
