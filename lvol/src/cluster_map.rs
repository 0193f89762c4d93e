//! Allocation bitmaps (SPDK's `used_clusters` and `used_md_pages` masks).
//!
//! Both masks live in memory while the store is open. A clean shutdown writes them to their
//! on-disk mask regions (format version 2, see `docs/FORMAT.md`); the open of a cleanly shut
//! down store reads them back, any other open rebuilds them from the metadata pages (what SPDK
//! does after a dirty shutdown).

/// A growable bitmap with a count of set bits and a next-fit search.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bitmap {
    words: Vec<u64>,
    len: u64,
    set: u64,
}

impl Bitmap {
    /// A bitmap of `len` clear bits.
    pub fn new(len: u64) -> Self {
        Bitmap {
            words: vec![0; len.div_ceil(64) as usize],
            len,
            set: 0,
        }
    }

    /// Number of bits.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The bitmap has no bits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of set bits.
    pub fn count_set(&self) -> u64 {
        self.set
    }

    /// Number of clear bits.
    pub fn count_clear(&self) -> u64 {
        self.len - self.set
    }

    /// Bit `i` (false beyond the end).
    pub fn get(&self, i: u64) -> bool {
        i < self.len && self.words[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    /// Sets bit `i`; returns whether it was clear. Panics never: out-of-range bits are ignored
    /// and reported as "was not clear".
    pub fn set(&mut self, i: u64) -> bool {
        if i >= self.len {
            return false;
        }
        let w = &mut self.words[(i / 64) as usize];
        let m = 1 << (i % 64);
        if *w & m != 0 {
            return false;
        }
        *w |= m;
        self.set += 1;
        true
    }

    /// Clears bit `i`; returns whether it was set.
    pub fn clear(&mut self, i: u64) -> bool {
        if i >= self.len {
            return false;
        }
        let w = &mut self.words[(i / 64) as usize];
        let m = 1 << (i % 64);
        if *w & m == 0 {
            return false;
        }
        *w &= !m;
        self.set -= 1;
        true
    }

    /// Grows to `len` bits (new bits clear). Never shrinks.
    pub fn grow(&mut self, len: u64) {
        if len > self.len {
            self.words.resize(len.div_ceil(64) as usize, 0);
            self.len = len;
        }
    }

    /// The first clear bit at or after `hint`, wrapping around; `None` when all are set.
    pub fn find_clear(&self, hint: u64) -> Option<u64> {
        if self.set >= self.len {
            return None;
        }
        let hint = if hint >= self.len { 0 } else { hint };
        self.scan(hint, self.len).or_else(|| self.scan(0, hint))
    }

    /// The first set bit at or after `from` (no wrap-around).
    pub fn find_set(&self, from: u64) -> Option<u64> {
        let mut i = from;
        while i < self.len {
            let w = self.words[(i / 64) as usize] >> (i % 64);
            if w == 0 {
                i = (i / 64 + 1) * 64;
                continue;
            }
            let x = i + u64::from(w.trailing_zeros());
            return (x < self.len).then_some(x);
        }
        None
    }

    fn scan(&self, from: u64, to: u64) -> Option<u64> {
        let mut i = from;
        while i < to {
            let w = self.words[(i / 64) as usize];
            if w == u64::MAX && i % 64 == 0 {
                i += 64;
                continue;
            }
            if w & (1 << (i % 64)) == 0 {
                return Some(i);
            }
            i += 1;
        }
        None
    }

    /// The bits as bytes, bit `i` in byte `i / 8` at position `i % 8` (SPDK's mask layout).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.words.len() * 8);
        for w in &self.words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.truncate(self.len.div_ceil(8) as usize);
        out
    }

    /// The inverse of [`Bitmap::to_bytes`]. `None` when `bytes` is shorter than `len` bits
    /// or has bits set beyond `len`.
    pub fn from_bytes(len: u64, bytes: &[u8]) -> Option<Self> {
        let nbytes = usize::try_from(len.div_ceil(8)).ok()?;
        let bytes = bytes.get(..nbytes)?;
        let mut b = Bitmap::new(len);
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            b.words[i] = u64::from_le_bytes(w);
        }
        if len % 64 != 0 {
            let last = b.words.len() - 1;
            if b.words[last] >> (len % 64) != 0 {
                return None;
            }
        }
        b.set = b.words.iter().map(|w| u64::from(w.count_ones())).sum();
        Some(b)
    }

    /// Iterates over set bits.
    pub fn iter_set(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.len).filter(move |&i| self.get(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic() {
        let mut b = Bitmap::new(130);
        assert_eq!(b.find_clear(0), Some(0));
        for i in 0..130 {
            assert!(b.set(i));
        }
        assert!(!b.set(5));
        assert_eq!(b.find_clear(7), None);
        assert!(b.clear(129));
        assert_eq!(b.find_clear(3), Some(129));
        assert!(b.clear(2));
        assert_eq!(b.find_clear(3), Some(129));
        assert_eq!(b.find_clear(0), Some(2));
        assert_eq!(b.count_set(), 128);
        b.grow(200);
        assert_eq!(b.count_clear(), 72);
        assert!(!b.set(500));
        assert_eq!(b.iter_set().count(), 128);
        assert_eq!(b.find_set(0), Some(0));
        assert_eq!(b.find_set(2), Some(3));
        assert_eq!(b.find_set(128), Some(128));
        assert_eq!(b.find_set(129), None);
        let bytes = b.to_bytes();
        assert_eq!(bytes.len(), 25);
        assert_eq!(Bitmap::from_bytes(200, &bytes), Some(b.clone()));
        assert_eq!(Bitmap::from_bytes(201, &bytes), None);
        assert_eq!(Bitmap::from_bytes(3, &[0x08]), None);
        assert_eq!(
            Bitmap::from_bytes(4, &[0x08]).map(|x| x.count_set()),
            Some(1)
        );
    }
}
