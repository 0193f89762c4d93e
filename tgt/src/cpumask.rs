//! SPDK cpumasks: `0x3`, `3` (hex) or a CPU list `[0,2-3]`.

use std::fmt;

/// A set of CPUs (up to 1024).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CpuMask(Vec<usize>);

/// Why a cpumask could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cpumask {0:?}")]
pub struct CpuMaskError(pub String);

impl CpuMask {
    /// Parses SPDK's forms: hex with or without `0x`, or `[a,b-c]`.
    pub fn parse(s: &str) -> Result<Self, CpuMaskError> {
        let err = || CpuMaskError(s.to_string());
        let t = s.trim();
        let mut cpus = Vec::new();
        if let Some(list) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (a, b) = match part.split_once('-') {
                    Some((a, b)) => (a.trim(), b.trim()),
                    None => (part, part),
                };
                let a: usize = a.parse().map_err(|_| err())?;
                let b: usize = b.parse().map_err(|_| err())?;
                if a > b || b >= 1024 {
                    return Err(err());
                }
                cpus.extend(a..=b);
            }
        } else {
            let hex = t
                .strip_prefix("0x")
                .or_else(|| t.strip_prefix("0X"))
                .unwrap_or(t);
            if hex.is_empty() || hex.len() > 256 {
                return Err(err());
            }
            for (i, c) in hex.chars().rev().enumerate() {
                let d = c.to_digit(16).ok_or_else(err)? as usize;
                for bit in 0..4 {
                    if d & (1 << bit) != 0 {
                        cpus.push(i * 4 + bit);
                    }
                }
            }
        }
        cpus.sort_unstable();
        cpus.dedup();
        if cpus.is_empty() {
            return Err(err());
        }
        Ok(CpuMask(cpus))
    }

    /// The CPUs, ascending.
    pub fn cpus(&self) -> &[usize] {
        &self.0
    }

    /// True if every CPU of `self` is in `other`.
    pub fn is_subset_of(&self, other: &CpuMask) -> bool {
        self.0.iter().all(|c| other.0.contains(c))
    }

    /// CPUs this process may run on.
    pub fn online() -> Self {
        // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it for this thread.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above; the size passed is the size of `set`.
        let r =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        let mut cpus = Vec::new();
        if r == 0 {
            for c in 0..1024usize.min(libc::CPU_SETSIZE as usize) {
                // SAFETY: `c` is below CPU_SETSIZE.
                if unsafe { libc::CPU_ISSET(c, &set) } {
                    cpus.push(c);
                }
            }
        }
        if cpus.is_empty() {
            cpus.push(0);
        }
        CpuMask(cpus)
    }
}

impl fmt::Display for CpuMask {
    /// Formats as SPDK reports it: `0x` and hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let max = self.0.iter().copied().max().unwrap_or(0);
        let mut digits = vec![0u8; max / 4 + 1];
        for &c in &self.0 {
            digits[c / 4] |= 1 << (c % 4);
        }
        write!(f, "0x")?;
        for d in digits.iter().rev() {
            write!(f, "{d:x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        assert_eq!(CpuMask::parse("0x1").unwrap().cpus(), &[0]);
        assert_eq!(CpuMask::parse("3").unwrap().cpus(), &[0, 1]);
        assert_eq!(CpuMask::parse("0x10").unwrap().cpus(), &[4]);
        assert_eq!(CpuMask::parse("[0,2-3]").unwrap().cpus(), &[0, 2, 3]);
        assert_eq!(CpuMask::parse("0x5").unwrap().to_string(), "0x5");
        assert_eq!(CpuMask::parse("[4]").unwrap().to_string(), "0x10");
        for bad in ["", "0x", "0", "zz", "[3-1]", "[x]", "[]"] {
            assert!(CpuMask::parse(bad).is_err(), "{bad}");
        }
        assert!(CpuMask::parse("0x1")
            .unwrap()
            .is_subset_of(&CpuMask::parse("0x3").unwrap()));
        assert!(!CpuMask::parse("0x4")
            .unwrap()
            .is_subset_of(&CpuMask::parse("0x3").unwrap()));
    }
}
