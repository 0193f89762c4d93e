//! Latency histograms and the summary numbers computed from them.

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Highest latency a histogram tracks exactly; larger values are clamped to it (60 s).
pub const MAX_TRACKED_NS: u64 = 60_000_000_000;

/// Creates an empty latency histogram in nanoseconds (1 ns .. 60 s, 3 significant digits).
///
/// All memory is allocated here, so recording never allocates.
pub fn new_histogram() -> Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, MAX_TRACKED_NS, 3).context("creating latency histogram")
}

/// Latency figures of one set of I/Os, in nanoseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub samples: u64,
    /// Smallest latency.
    pub min_ns: u64,
    /// Largest latency.
    pub max_ns: u64,
    /// Arithmetic mean.
    pub mean_ns: f64,
    /// Standard deviation.
    pub stddev_ns: f64,
    /// Median.
    pub p50_ns: u64,
    /// 90th percentile.
    pub p90_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// 99.9th percentile.
    pub p999_ns: u64,
}

impl LatencySummary {
    /// Computes the summary of a histogram; all zeros for an empty one.
    pub fn from_histogram(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        Self {
            samples: h.len(),
            min_ns: h.min_nz(),
            max_ns: h.max(),
            mean_ns: h.mean(),
            stddev_ns: h.stdev(),
            p50_ns: h.value_at_quantile(0.50),
            p90_ns: h.value_at_quantile(0.90),
            p99_ns: h.value_at_quantile(0.99),
            p999_ns: h.value_at_quantile(0.999),
        }
    }
}

/// Throughput and latency of one direction (reads, writes, or both) over a measured window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IoStats {
    /// Completed I/Os.
    pub ios: u64,
    /// Bytes transferred.
    pub bytes: u64,
    /// I/Os per second.
    pub iops: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// Latency from submission to completion.
    pub lat: LatencySummary,
}

impl IoStats {
    /// Computes throughput from counts over `elapsed` and latency from `h`.
    pub fn new(h: &Histogram<u64>, ios: u64, bytes: u64, elapsed: Duration) -> Self {
        let secs = elapsed.as_secs_f64();
        let rate = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        Self {
            ios,
            bytes,
            iops: rate(ios),
            bytes_per_sec: rate(bytes),
            lat: LatencySummary::from_histogram(h),
        }
    }

    /// Bandwidth in MB/s (10⁶ bytes per second).
    pub fn mb_per_sec(&self) -> f64 {
        self.bytes_per_sec / 1e6
    }
}

/// Median of `values` (mean of the two middle ones for an even count); `None` if empty.
/// NaNs are ignored.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

/// `a / b`, or `None` when `b` is zero or either is not finite.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    if b == 0.0 || !a.is_finite() || !b.is_finite() {
        None
    } else {
        Some(a / b)
    }
}

/// Formats a rate the way fio does: `950`, `12.3k`, `1.25M`.
pub fn format_rate(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.2}M", value / 1e6)
    } else if value >= 1e4 {
        format!("{:.1}k", value / 1e3)
    } else if value >= 1e3 {
        format!("{:.2}k", value / 1e3)
    } else {
        format!("{value:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_uniform_values() {
        let mut h = new_histogram().unwrap();
        for v in 1..=1000u64 {
            h.record(v * 1000).unwrap();
        }
        let s = LatencySummary::from_histogram(&h);
        assert_eq!(s.samples, 1000);
        assert_eq!(s.min_ns, 1000);
        // 3 significant digits: values are exact to within 0.1 %.
        let close = |got: u64, want: u64| (got as f64 - want as f64).abs() <= want as f64 * 1e-3;
        assert!(close(s.max_ns, 1_000_000), "{}", s.max_ns);
        assert!(close(s.p50_ns, 500_000), "{}", s.p50_ns);
        assert!(close(s.p90_ns, 900_000), "{}", s.p90_ns);
        assert!(close(s.p99_ns, 990_000), "{}", s.p99_ns);
        assert!(close(s.p999_ns, 999_000), "{}", s.p999_ns);
        assert!((s.mean_ns - 500_500.0).abs() < 500.0, "{}", s.mean_ns);
    }

    #[test]
    fn summary_of_empty_histogram_is_zero() {
        let h = new_histogram().unwrap();
        assert_eq!(
            LatencySummary::from_histogram(&h),
            LatencySummary::default()
        );
    }

    #[test]
    fn tail_is_seen_by_high_percentiles_only() {
        let mut h = new_histogram().unwrap();
        for _ in 0..990 {
            h.record(10_000).unwrap();
        }
        for _ in 0..10 {
            h.record(5_000_000).unwrap();
        }
        let s = LatencySummary::from_histogram(&h);
        assert!(s.p50_ns < 10_100);
        assert!(s.p99_ns < 10_100);
        assert!(s.p999_ns > 4_990_000);
        assert!(s.max_ns > 4_990_000);
    }

    #[test]
    fn throughput() {
        let mut h = new_histogram().unwrap();
        h.record(1000).unwrap();
        let s = IoStats::new(&h, 2000, 2000 * 4096, Duration::from_secs(2));
        assert_eq!(s.iops, 1000.0);
        assert_eq!(s.bytes_per_sec, 4096.0 * 1000.0);
        assert!((s.mb_per_sec() - 4.096).abs() < 1e-9);
        let zero = IoStats::new(&h, 5, 5, Duration::ZERO);
        assert_eq!(zero.iops, 0.0);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[f64::NAN, 1.0, 5.0, 3.0]), Some(3.0));
    }

    #[test]
    fn ratios_and_rates() {
        assert_eq!(ratio(3.0, 2.0), Some(1.5));
        assert_eq!(ratio(3.0, 0.0), None);
        assert_eq!(format_rate(950.0), "950");
        assert_eq!(format_rate(1234.0), "1.23k");
        assert_eq!(format_rate(123_456.0), "123.5k");
        assert_eq!(format_rate(1_250_000.0), "1.25M");
    }
}
