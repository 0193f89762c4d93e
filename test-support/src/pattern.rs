//! Deterministic data for the tests to write and check: the same arguments always give the same
//! bytes, so a test can rebuild what it expects from a seed instead of keeping a copy.

/// `len` bytes that depend on `seed` (only its low 8 bits vary the result): byte `i` is
/// `i ^ (seed * 0x9e37)`, truncated to 8 bits.
pub fn seeded(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 ^ seed.wrapping_mul(0x9e37)) as u8)
        .collect()
}

/// `len` bytes for the device range starting at byte `off`: each byte depends on its absolute
/// offset and on `seed` (`(off + i) * 31 ^ seed`, 8 bits), so data that lands at the wrong
/// place, or is an older write's, does not compare equal.
pub fn offset(off: u64, len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((off as usize + i).wrapping_mul(31) as u8) ^ seed)
        .collect()
}

/// A block (`len` ≥ 8) that names the write it came from: `tag` in the first 8 bytes (little
/// endian), then bytes derived from it, none of them zero; tag 0 is all zeroes (what a block
/// reads before it was ever written).
pub fn tagged(tag: u64, len: usize) -> Vec<u8> {
    if tag == 0 {
        return vec![0; len];
    }
    let mut v = vec![0u8; len];
    v[..8].copy_from_slice(&tag.to_le_bytes());
    for (i, b) in v.iter_mut().enumerate().skip(8) {
        *b = (tag as usize).wrapping_mul(31).wrapping_add(i) as u8 | 1;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_keep_their_bytes() {
        assert_eq!(seeded(0, 4), [0, 1, 2, 3]);
        assert_eq!(seeded(1, 4), [0x37, 0x36, 0x35, 0x34]);
        assert_eq!(offset(0, 3, 0), [0, 31, 62]);
        assert_eq!(offset(4096, 2, 7), [7, 31 ^ 7]);
        assert_eq!(tagged(0, 16), [0; 16]);
        let t = tagged(2, 10);
        assert_eq!(&t[..8], &2u64.to_le_bytes());
        assert_eq!(t[8..], [((62 + 8) as u8) | 1, ((62 + 9) as u8) | 1]);
    }
}
