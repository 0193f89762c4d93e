//! Parsing of sizes (`4k`, `128k`, `1M`, `1GiB`) and durations (`5`, `5s`, `500ms`, `1m`).

use anyhow::{bail, Context, Result};
use std::time::Duration;

/// Parses a byte size. Suffixes are binary, as in fio: `k` = 1024, `m` = 1024², `g`, `t`;
/// case-insensitive, with optional `i` and `b` (`4k`, `4K`, `4KiB`, `4kb` are all 4096).
/// A plain number is bytes.
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    if t.is_empty() {
        bail!("empty size");
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        bail!("invalid size {text:?}: expected a number with an optional k/m/g/t suffix");
    }
    let number: u64 = digits
        .parse()
        .with_context(|| format!("invalid size {text:?}"))?;
    let lower = suffix.to_ascii_lowercase();
    let unit = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => bail!("invalid size suffix {suffix:?} in {text:?} (use k, m, g or t)"),
    };
    number
        .checked_mul(1u64 << shift)
        .with_context(|| format!("size {text:?} overflows 64 bits"))
}

/// Parses a block size: a size (see [`parse_size`]) that is a non-zero multiple of 512.
pub fn parse_block_size(text: &str) -> Result<u64> {
    let bs = parse_size(text)?;
    if bs == 0 || bs % 512 != 0 {
        bail!("block size must be a non-zero multiple of 512 bytes (got {bs} from {text:?})");
    }
    if bs > 64 << 20 {
        bail!("block size {bs} is larger than the 64 MiB this tool supports");
    }
    Ok(bs)
}

/// Parses a duration: a number of seconds (`5`, `0.5`), or with a unit `ms`, `s`, `m`.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let t = text.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t, 1.0)
    };
    let value: f64 = num
        .trim()
        .parse()
        .with_context(|| format!("invalid duration {text:?} (examples: 5, 5s, 500ms, 1m)"))?;
    if !value.is_finite() || value < 0.0 {
        bail!("invalid duration {text:?}: must be a non-negative number");
    }
    Ok(Duration::from_secs_f64(value * scale))
}

/// Formats a byte count with a binary unit, as fio does (`4KiB`, `128KiB`, `1MiB`).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut idx = 0;
    while idx + 1 < UNITS.len() && bytes >= 1u64 << (10 * (idx + 1)) {
        if bytes % (1u64 << (10 * (idx + 1))) != 0 {
            break;
        }
        idx += 1;
    }
    format!("{}{}", bytes >> (10 * idx), UNITS[idx])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("4kb").unwrap(), 4096);
        assert_eq!(parse_size("128k").unwrap(), 128 * 1024);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("1t").unwrap(), 1 << 40);
        assert_eq!(parse_size(" 8k ").unwrap(), 8192);
    }

    #[test]
    fn bad_sizes() {
        assert!(parse_size("").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("4x").is_err());
        assert!(parse_size("-4k").is_err());
        assert!(parse_size("4.5k").is_err());
        assert!(parse_size("99999999999t").is_err());
    }

    #[test]
    fn block_sizes() {
        assert_eq!(parse_block_size("4k").unwrap(), 4096);
        assert_eq!(parse_block_size("512").unwrap(), 512);
        let err = parse_block_size("1000").unwrap_err().to_string();
        assert!(err.contains("multiple of 512"), "{err}");
        assert!(parse_block_size("0").is_err());
        assert!(parse_block_size("1G").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("0.25").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("fast").is_err());
    }

    #[test]
    fn format() {
        assert_eq!(format_size(4096), "4KiB");
        assert_eq!(format_size(128 * 1024), "128KiB");
        assert_eq!(format_size(1 << 20), "1MiB");
        assert_eq!(format_size(1000), "1000B");
        assert_eq!(format_size(1536), "1536B");
    }
}
