//! The JSON result format of `katablk-bench` and its fio-like text rendering.

use crate::cpu::CpuUsage;
use crate::size::format_size;
use crate::stats::{format_rate, IoStats};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// Version of the JSON layout; bumped on incompatible changes.
pub const REPORT_VERSION: u32 = 1;

/// What a report measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportKind {
    /// An I/O workload.
    Io,
    /// A connected client doing no I/O (`--idle-cpu`): only CPU figures are meaningful.
    Idle,
}

/// The parameters a run was started with.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Params {
    /// vhost-user socket path.
    pub socket: String,
    /// Workload (`randread`, `randwrite`, `read`, `write`, `randrw`).
    pub rw: String,
    /// Percentage of reads for `randrw`.
    pub rwmixread: u8,
    /// Block size in bytes.
    pub bs: u64,
    /// I/Os in flight per job.
    pub iodepth: u32,
    /// Jobs (threads), one virtqueue each.
    pub numjobs: u32,
    /// Measured time, seconds.
    pub runtime_s: f64,
    /// Warm-up time before measuring, seconds.
    pub ramp_s: f64,
    /// Bytes of the device the I/Os go to (from offset 0).
    pub size: u64,
    /// Virtqueue size.
    pub queue_size: u32,
    /// How completions are waited for (`busy` or `event`).
    pub poll: String,
    /// Whether every I/O was a pattern write checked by a read-back.
    pub verify: bool,
    /// Seed of the offset generators.
    pub seed: u64,
    /// Free-text label (`--label`).
    pub label: Option<String>,
    /// Key/value tags (`--meta case=file`), used by the summary tool.
    pub meta: BTreeMap<String, String>,
    /// Server process whose CPU use was sampled.
    pub server_pid: Option<u32>,
    /// Segment size requests were split into (`--segment-size`), if any.
    #[serde(default)]
    pub segment_size: Option<u64>,
}

/// What the device reported after connecting.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Capacity in bytes.
    pub capacity: u64,
    /// Largest number of queues the server offers.
    pub max_queues: i32,
    /// Required alignment of offsets and lengths.
    pub request_alignment: i32,
    /// Largest request in bytes (0: no limit).
    pub max_transfer: i32,
    /// Largest segment in bytes (0: no limit).
    pub max_segment_len: i32,
    /// Largest number of segments per request.
    pub max_segments: i32,
    /// Required alignment of memory regions.
    pub mem_region_alignment: u64,
    /// Whether a flush is needed for durability (write-back cache).
    pub flush_needed: bool,
}

/// Results of one job, or the total of all jobs (`job` = `None`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobReport {
    /// Job index; `None` for the total.
    pub job: Option<u32>,
    /// Reads.
    pub read: IoStats,
    /// Writes.
    pub write: IoStats,
    /// Reads and writes together.
    pub total: IoStats,
    /// Blocks written and read back with a matching pattern (`--verify`).
    pub verified: u64,
}

/// One complete result file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// [`REPORT_VERSION`].
    pub version: u32,
    /// What was measured.
    pub kind: ReportKind,
    /// Tool name and version.
    pub tool: String,
    /// When the run ended, seconds since the Unix epoch.
    pub timestamp_unix: u64,
    /// Parameters.
    pub params: Params,
    /// Device properties.
    pub device: DeviceInfo,
    /// Length of the measured window in seconds.
    pub elapsed_s: f64,
    /// Per-job results (empty for `idle`).
    pub jobs: Vec<JobReport>,
    /// All jobs together.
    pub total: JobReport,
    /// CPU used by this client in the measured window.
    pub client_cpu: CpuUsage,
    /// CPU used by the server in the measured window (with `--server-pid`).
    pub server_cpu: Option<CpuUsage>,
    /// Completions per interval over the measured window (with `--interval`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
}

/// Completed I/Os over time: one sample per `--interval` of the measured window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Wall-clock start of the measured window, seconds since the Unix epoch (to line the
    /// samples up with events outside the client, such as a limit changed over RPC).
    pub start_unix_s: f64,
    /// The interval asked for, in seconds (each sample records the time it really covers).
    pub interval_s: f64,
    /// The samples, in order.
    pub samples: Vec<TimelineSample>,
}

/// Completions in one interval.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimelineSample {
    /// End of the interval, seconds since the start of the measured window.
    pub t_s: f64,
    /// Length of the interval in seconds.
    pub len_s: f64,
    /// I/Os completed in it.
    pub ios: u64,
    /// I/Os per second over it.
    pub iops: f64,
    /// Bytes per second over it.
    pub bytes_per_sec: f64,
}

impl BenchReport {
    /// Writes the report as pretty JSON.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).context("serialising report")?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
    }

    /// Reads a report written by [`BenchReport::write_json`].
    pub fn read_json(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// The fio-like text rendering printed at the end of a run.
    pub fn to_text(&self) -> String {
        let p = &self.params;
        let mut out = String::new();
        let label = p
            .label
            .as_deref()
            .map(|l| format!("{l}: "))
            .unwrap_or_default();
        let mix = if p.rw == "randrw" {
            format!(" rwmixread={}", p.rwmixread)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{label}rw={}{mix} bs={} iodepth={} numjobs={} size={} runtime={}s ramp={}s poll={}{}",
            p.rw,
            format_size(p.bs),
            p.iodepth,
            p.numjobs,
            format_size(p.size),
            p.runtime_s,
            p.ramp_s,
            p.poll,
            if p.verify { " verify" } else { "" }
        );
        let d = &self.device;
        let _ = writeln!(
            out,
            "device: {} capacity={} max-queues={} request-alignment={} max-transfer={} queue-size={}",
            p.socket,
            format_size(d.capacity),
            d.max_queues,
            d.request_alignment,
            d.max_transfer,
            p.queue_size
        );
        if self.kind == ReportKind::Io {
            if self.jobs.len() > 1 {
                for j in &self.jobs {
                    let name = format!("job{}", j.job.unwrap_or(0));
                    render_job(&mut out, &name, j);
                }
            }
            render_job(&mut out, "total", &self.total);
            if p.verify {
                let _ = writeln!(
                    out,
                    "  verify: {} blocks written and read back, all matched",
                    self.total.verified
                );
            }
        } else {
            let _ = writeln!(
                out,
                "idle: connected with {} queue(s), no I/O for {:.1}s",
                p.numjobs, self.elapsed_s
            );
        }
        let c = &self.client_cpu;
        let _ = write!(
            out,
            "cpu: client usr={:.2}s sys={:.2}s ({:.1}% of one core)",
            c.user_s, c.sys_s, c.percent
        );
        if let Some(s) = &self.server_cpu {
            let _ = write!(
                out,
                "; server pid {} usr={:.2}s sys={:.2}s ({:.1}% of one core)",
                s.pid.unwrap_or(0),
                s.user_s,
                s.sys_s,
                s.percent
            );
        }
        out.push('\n');
        out
    }
}

fn render_dir(out: &mut String, name: &str, s: &IoStats) {
    let mib = s.bytes_per_sec / (1024.0 * 1024.0);
    let _ = writeln!(
        out,
        "  {name:>5}: IOPS={}, BW={mib:.1}MiB/s ({:.1}MB/s), ios={}",
        format_rate(s.iops),
        s.mb_per_sec(),
        s.ios
    );
    let us = |ns: u64| ns as f64 / 1000.0;
    let l = &s.lat;
    let _ = writeln!(
        out,
        "         lat (usec): min={:.2}, max={:.2}, mean={:.2}, stdev={:.2}",
        us(l.min_ns),
        us(l.max_ns),
        l.mean_ns / 1000.0,
        l.stddev_ns / 1000.0
    );
    let _ = writeln!(
        out,
        "         lat (usec): p50={:.2}, p90={:.2}, p99={:.2}, p99.9={:.2}",
        us(l.p50_ns),
        us(l.p90_ns),
        us(l.p99_ns),
        us(l.p999_ns)
    );
}

fn render_job(out: &mut String, name: &str, j: &JobReport) {
    let _ = writeln!(out, "{name}:");
    if j.read.ios > 0 {
        render_dir(out, "read", &j.read);
    }
    if j.write.ios > 0 {
        render_dir(out, "write", &j.write);
    }
    if j.read.ios > 0 && j.write.ios > 0 {
        render_dir(out, "all", &j.total);
    }
    if j.total.ios == 0 {
        let _ = writeln!(out, "  no I/O completed in the measured window");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{new_histogram, LatencySummary};
    use std::time::Duration;

    fn sample() -> BenchReport {
        let mut h = new_histogram().unwrap();
        for v in [10_000u64, 12_000, 15_000, 90_000] {
            h.record(v).unwrap();
        }
        let read = IoStats::new(&h, 4, 4 * 4096, Duration::from_millis(500));
        let job = JobReport {
            job: Some(0),
            read: read.clone(),
            write: IoStats::default(),
            total: read,
            verified: 0,
        };
        let mut meta = BTreeMap::new();
        meta.insert("case".to_string(), "file".to_string());
        BenchReport {
            version: REPORT_VERSION,
            kind: ReportKind::Io,
            tool: "katablk-bench test".to_string(),
            timestamp_unix: 1_700_000_000,
            params: Params {
                socket: "/tmp/x.sock".into(),
                rw: "randread".into(),
                rwmixread: 70,
                bs: 4096,
                iodepth: 32,
                numjobs: 1,
                runtime_s: 0.5,
                ramp_s: 0.0,
                size: 1 << 30,
                queue_size: 256,
                poll: "event".into(),
                verify: false,
                seed: 42,
                label: Some("unit".into()),
                meta,
                server_pid: Some(99),
                segment_size: None,
            },
            device: DeviceInfo {
                capacity: 1 << 30,
                max_queues: 2,
                request_alignment: 512,
                ..DeviceInfo::default()
            },
            elapsed_s: 0.5,
            jobs: vec![job.clone()],
            total: JobReport { job: None, ..job },
            client_cpu: CpuUsage::default(),
            timeline: None,
            server_cpu: Some(CpuUsage {
                pid: Some(99),
                percent: 12.5,
                ..CpuUsage::default()
            }),
        }
    }

    #[test]
    fn json_round_trip() {
        let r = sample();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.json");
        r.write_json(&path).unwrap();
        let back = BenchReport::read_json(&path).unwrap();
        assert_eq!(back, r);
        let value: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(value["kind"], "io");
        assert_eq!(value["total"]["read"]["iops"], 8.0);
        assert_eq!(value["params"]["meta"]["case"], "file");
    }

    #[test]
    fn text_mentions_the_key_numbers() {
        let text = sample().to_text();
        assert!(text.contains("rw=randread bs=4KiB iodepth=32"), "{text}");
        assert!(text.contains("IOPS=8"), "{text}");
        assert!(text.contains("p99.9="), "{text}");
        assert!(text.contains("server pid 99"), "{text}");
        assert_ne!(sample().total.read.lat, LatencySummary::default());
    }
}
