//! `katablk-vhost`: serve one block device over vhost-user-blk (the katablk counterpart of
//! qemu-storage-daemon's vhost-user-blk export).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use katablk_bdev::file::{FileDevice, FileOptions, IoMode};
use katablk_bdev::malloc::MallocDevice;
use katablk_bdev::null::NullDevice;
use katablk_bdev::BlockDevice;
use katablk_vhost::{BlkOptions, VhostBlkServer};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

#[derive(Parser, Debug)]
#[command(
    name = "katablk-vhost",
    version,
    about = "Serve a block device over vhost-user-blk"
)]
#[command(group(clap::ArgGroup::new("backing").required(true).args(["file", "malloc", "null"])))]
struct Args {
    /// Unix socket to listen on (a stale socket is removed).
    #[arg(long)]
    socket: PathBuf,
    /// Serve this file or block device.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Serve a RAM disk of this many MiB.
    #[arg(long, value_name = "MIB")]
    malloc: Option<u64>,
    /// Serve a null device of this many MiB (writes dropped, reads return zeroes).
    #[arg(long, value_name = "MIB")]
    null: Option<u64>,
    /// Expose the device read-only.
    #[arg(long)]
    readonly: bool,
    /// Number of virtqueues offered.
    #[arg(long, default_value_t = 1)]
    num_queues: u16,
    /// Largest virtqueue size accepted.
    #[arg(long, default_value_t = 256)]
    queue_size: u16,
    /// Open the file with O_DIRECT (bypass the host page cache).
    #[arg(long)]
    direct: bool,
    /// Serial number reported by GET_ID (up to 20 bytes).
    #[arg(long, default_value = "")]
    serial: String,
    /// Busy-poll window in microseconds after the last request (0: interrupt driven only).
    #[arg(long, default_value_t = 50)]
    poll_us: u32,
    /// Logical block size (default: the device's, 512 for files).
    #[arg(long)]
    block_size: Option<u32>,
    /// Worker threads as queue bitmasks, e.g. `0x3,0xc` (default: one thread per queue).
    #[arg(long, value_delimiter = ',', value_parser = parse_mask)]
    queue_threads: Vec<u64>,
    /// Pin workers to these CPUs (round-robin), e.g. `0,1`.
    #[arg(long, value_delimiter = ',')]
    cpus: Vec<usize>,
    /// Report a write-through cache to the guest (every write is flushed before completion).
    #[arg(long)]
    writethrough: bool,
    /// How file I/O is executed: auto (io_uring, else a thread pool), io_uring, threads or
    /// inline (system calls on the queue thread).
    #[arg(long, default_value = "auto")]
    io_mode: IoMode,
    /// Permission bits of the socket, octal (e.g. 660).
    #[arg(long, value_parser = parse_octal)]
    socket_mode: Option<u32>,
    /// Rate limit: I/Os per second of any kind (0: unlimited), as SPDK's `rw_ios_per_sec`.
    #[arg(long, default_value_t = 0)]
    qos_rw_ios_per_sec: u64,
    /// Rate limit: MiB per second read and written (0: unlimited).
    #[arg(long, default_value_t = 0)]
    qos_rw_mbytes_per_sec: u64,
    /// Rate limit: MiB per second read (0: unlimited).
    #[arg(long, default_value_t = 0)]
    qos_r_mbytes_per_sec: u64,
    /// Rate limit: MiB per second written (0: unlimited).
    #[arg(long, default_value_t = 0)]
    qos_w_mbytes_per_sec: u64,
}

fn parse_mask(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse(),
    };
    r.map_err(|e| format!("bad queue mask {s:?}: {e}"))
}

fn parse_octal(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8).map_err(|e| format!("bad mode {s:?}: {e}"))
}

fn open_device(a: &Args) -> Result<Arc<dyn BlockDevice>> {
    let mib = |m: u64| -> Result<u64> {
        if m == 0 {
            bail!("size must be at least 1 MiB");
        }
        m.checked_mul(1 << 20).context("size too large")
    };
    let bs = a.block_size.unwrap_or(512);
    Ok(if let Some(path) = &a.file {
        let opts = FileOptions {
            read_only: a.readonly,
            direct: a.direct,
            block_size: a.block_size,
            mode: a.io_mode,
        };
        Arc::new(FileDevice::open(path, &opts)?)
    } else if let Some(m) = a.malloc {
        Arc::new(MallocDevice::new(mib(m)? / u64::from(bs), bs)?)
    } else if let Some(m) = a.null {
        Arc::new(NullDevice::new(mib(m)? / u64::from(bs), bs, true)?)
    } else {
        bail!("one of --file, --malloc or --null is required")
    })
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let dev = open_device(&args).context("cannot open the backing device")?;
    let opts = BlkOptions {
        num_queues: args.num_queues,
        queue_size: args.queue_size,
        read_only: args.readonly,
        serial: args.serial.clone(),
        poll_us: args.poll_us,
        queue_threads: args.queue_threads.clone(),
        writeback: !args.writethrough,
        cpus: args.cpus.clone(),
        runtime: None,
        qos: None,
    };
    let limits = katablk_bdev::qos::QosLimits {
        rw_ios_per_sec: args.qos_rw_ios_per_sec,
        rw_bytes_per_sec: args.qos_rw_mbytes_per_sec.saturating_mul(1 << 20),
        r_bytes_per_sec: args.qos_r_mbytes_per_sec.saturating_mul(1 << 20),
        w_bytes_per_sec: args.qos_w_mbytes_per_sec.saturating_mul(1 << 20),
    };
    let opts = if limits.is_unlimited() {
        opts
    } else {
        let l = katablk_bdev::qos::Limiter::new();
        l.set_limits(limits);
        tracing::info!(?limits, "rate limits set");
        BlkOptions {
            qos: Some(l),
            ..opts
        }
    };
    let server = VhostBlkServer::bind(&args.socket, dev, opts, args.socket_mode)
        .context("cannot start the server")?;
    let stop = server.shutdown_handle();
    let mut signals = Signals::new([SIGTERM, SIGINT]).context("cannot install signal handlers")?;
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            tracing::info!(signal = sig, "shutting down");
            stop.shutdown();
        }
    });
    server.run()?;
    Ok(())
}
