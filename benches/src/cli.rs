//! Command line of `katablk-bench`.

use crate::engine::{PollMode, RunConfig, Workload};
use crate::size::{parse_block_size, parse_duration, parse_size};
use anyhow::{bail, Result};
use clap::Parser;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// A fio-like load generator for vhost-user-blk servers (libblkio client).
///
/// Connects to SOCKET, runs NUMJOBS threads with one virtqueue each, keeps IODEPTH requests
/// of BS bytes in flight per job for RUNTIME, and prints IOPS, bandwidth, latency
/// percentiles and CPU use (optionally also as JSON).
#[derive(Debug, Parser)]
#[command(name = "katablk-bench", version)]
pub struct BenchArgs {
    /// vhost-user-blk Unix socket of the server.
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// I/O pattern.
    #[arg(long, value_enum, default_value = "randread")]
    pub rw: Workload,
    /// Percentage of reads for --rw randrw.
    #[arg(long, default_value_t = 70, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub rwmixread: u8,
    /// Block size: a multiple of 512, with optional k/m suffix (binary: 4k = 4096).
    #[arg(long, default_value = "4k", value_parser = parse_block_size)]
    pub bs: u64,
    /// Requests in flight per job.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=16384))]
    pub iodepth: u32,
    /// Jobs: each is a thread with its own virtqueue.
    #[arg(long, visible_alias = "queues", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub numjobs: u32,
    /// Measured time (seconds, or with unit: 500ms, 5s, 1m).
    #[arg(long, default_value = "10", value_parser = parse_duration)]
    pub runtime: Duration,
    /// Warm-up time before measuring, not counted in the results.
    #[arg(long, default_value = "0", value_parser = parse_duration)]
    pub ramp: Duration,
    /// Bytes of the device to address from offset 0 (k/m/g/t suffixes), or `auto` for all.
    #[arg(long, default_value = "auto", value_parser = parse_size_or_auto)]
    pub size: SizeArg,
    /// Virtqueue size (a power of two; needs 3 descriptors per request).
    #[arg(long, default_value_t = 256)]
    pub queue_size: u32,
    /// How to wait for completions: busy polling (one core per job) or the eventfd.
    #[arg(long, value_enum, default_value = "event")]
    pub poll: PollMode,
    /// Place I/O buffers in shared memory at 2 MiB-aligned addresses and sizes (SPDK's vhost
    /// target registers guest memory in 2 MiB units and fails on other regions).
    #[arg(long)]
    pub align_2m: bool,
    /// Write a pattern with every I/O and read it back to check it (a smoke test; the
    /// numbers then mix writes and reads).
    #[arg(long)]
    pub verify: bool,
    /// Seed for the random offsets.
    #[arg(long, default_value_t = 0x6b61_7461)]
    pub seed: u64,
    /// Split every request into segments of at most this many bytes (readv/writev with
    /// several iovecs, as a guest with scattered pages does); requests are also split when
    /// the device's max-segment-len demands it.
    #[arg(long, value_name = "BYTES", value_parser = parse_block_size)]
    pub segment_size: Option<u64>,
    /// Write all results and parameters as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Label printed with, and stored in, the results.
    #[arg(long)]
    pub label: Option<String>,
    /// Tag stored in the JSON (repeatable), e.g. --meta case=file --meta server=qsd.
    #[arg(long = "meta", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub meta: Vec<(String, String)>,
    /// PID of the server: its CPU use over the measured window is reported.
    #[arg(long, value_name = "PID")]
    pub server_pid: Option<u32>,
    /// Do no I/O: stay connected and idle for this long and report CPU use (with
    /// --server-pid, the server's idle CPU).
    #[arg(long, value_name = "S", value_parser = parse_duration)]
    pub idle_cpu: Option<Duration>,
    /// Record the I/Os completed in every interval of this length over the measured window
    /// (e.g. 100ms): a time series in the JSON (`timeline`), to see limits and changes act.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub interval: Option<Duration>,
    /// Do not draw the progress bar (it is never drawn when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Print only the JSON path and errors, not the text report.
    #[arg(long, short)]
    pub quiet: bool,
}

/// `--size`: a byte count or the device's whole capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeArg {
    /// Use the capacity reported by the device.
    Auto,
    /// This many bytes from offset 0.
    Bytes(u64),
}

fn parse_size_or_auto(text: &str) -> Result<SizeArg> {
    if text.eq_ignore_ascii_case("auto") {
        Ok(SizeArg::Auto)
    } else {
        Ok(SizeArg::Bytes(parse_size(text)?))
    }
}

fn parse_key_value(text: &str) -> Result<(String, String)> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => bail!("expected KEY=VALUE, got {text:?}"),
    }
}

impl BenchArgs {
    /// The run configuration these arguments describe.
    pub fn to_config(&self) -> RunConfig {
        RunConfig {
            socket: self.socket.clone(),
            workload: self.rw,
            rwmixread: self.rwmixread,
            bs: self.bs,
            iodepth: self.iodepth,
            numjobs: self.numjobs,
            runtime: self.runtime,
            ramp: self.ramp,
            size: match self.size {
                SizeArg::Auto => None,
                SizeArg::Bytes(b) => Some(b),
            },
            queue_size: self.queue_size,
            poll: self.poll,
            align_2m: self.align_2m,
            verify: self.verify,
            seed: self.seed,
            label: self.label.clone(),
            meta: self.meta.iter().cloned().collect::<BTreeMap<_, _>>(),
            server_pid: self.server_pid,
            progress: !self.no_progress && !self.quiet,
            idle: self.idle_cpu,
            segment_size: self.segment_size,
            interval: self.interval,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        BenchArgs::try_parse_from(std::iter::once("katablk-bench").chain(args.iter().copied()))
    }

    #[test]
    fn defaults() {
        let a = parse(&["--socket", "/tmp/s"]).unwrap();
        let c = a.to_config();
        assert_eq!(c.workload, Workload::Randread);
        assert_eq!(c.bs, 4096);
        assert_eq!(c.iodepth, 32);
        assert_eq!(c.numjobs, 1);
        assert_eq!(c.runtime, Duration::from_secs(10));
        assert_eq!(c.ramp, Duration::ZERO);
        assert_eq!(c.size, None);
        assert_eq!(c.poll, PollMode::Event);
        assert!(c.progress);
        assert!(!c.verify);
        assert_eq!(c.idle, None);
    }

    #[test]
    fn full_command_line() {
        let a = parse(&[
            "--socket",
            "/tmp/s",
            "--rw",
            "randrw",
            "--rwmixread",
            "60",
            "--bs",
            "128k",
            "--iodepth",
            "8",
            "--queues",
            "2",
            "--runtime",
            "5s",
            "--ramp",
            "500ms",
            "--size",
            "1G",
            "--json",
            "/tmp/o.json",
            "--label",
            "x",
            "--meta",
            "case=file",
            "--meta",
            "server=qsd",
            "--no-progress",
            "--poll",
            "busy",
            "--server-pid",
            "42",
        ])
        .unwrap();
        let c = a.to_config();
        assert_eq!(c.workload, Workload::Randrw);
        assert_eq!(c.workload.read_percent(c.rwmixread), 60);
        assert_eq!(c.bs, 128 * 1024);
        assert_eq!(c.iodepth, 8);
        assert_eq!(c.numjobs, 2);
        assert_eq!(c.runtime, Duration::from_secs(5));
        assert_eq!(c.ramp, Duration::from_millis(500));
        assert_eq!(c.size, Some(1 << 30));
        assert_eq!(c.meta.get("case").map(String::as_str), Some("file"));
        assert_eq!(c.meta.get("server").map(String::as_str), Some("qsd"));
        assert_eq!(c.poll, PollMode::Busy);
        assert_eq!(c.server_pid, Some(42));
        assert!(!c.progress);
        assert_eq!(a.json, Some(PathBuf::from("/tmp/o.json")));
    }

    #[test]
    fn numjobs_and_1m_blocks() {
        let a = parse(&[
            "--socket",
            "s",
            "--numjobs",
            "3",
            "--bs",
            "1M",
            "--rw",
            "read",
        ])
        .unwrap();
        assert_eq!(a.numjobs, 3);
        assert_eq!(a.bs, 1 << 20);
        assert_eq!(a.rw, Workload::Read);
    }

    #[test]
    fn rejects_bad_values() {
        let err = parse(&["--socket", "s", "--bs", "1000"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiple of 512"), "{err}");
        assert!(parse(&["--socket", "s", "--iodepth", "0"]).is_err());
        assert!(parse(&["--socket", "s", "--rwmixread", "101"]).is_err());
        assert!(parse(&["--socket", "s", "--rw", "trim"]).is_err());
        assert!(parse(&["--socket", "s", "--meta", "novalue"]).is_err());
        assert!(parse(&["--socket", "s", "--size", "lots"]).is_err());
        assert!(parse(&["--bs", "4k"]).is_err(), "--socket is required");
    }

    #[test]
    fn idle_mode() {
        let a = parse(&["--socket", "s", "--idle-cpu", "3", "--server-pid", "7"]).unwrap();
        let c = a.to_config();
        assert_eq!(c.idle, Some(Duration::from_secs(3)));
        assert_eq!(c.server_pid, Some(7));
    }
}
