//! `katablk-target`: the embedded SPDK-compatible vhost target (flags as SPDK's `vhost` app).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use katablk_target::{CpuMask, TargetConfig, TargetSettings};

#[derive(Parser, Debug)]
#[command(
    name = "katablk-target",
    version,
    about = "SPDK-compatible vhost-user-blk target driven by SPDK JSON-RPC"
)]
struct Args {
    /// Directory for controller sockets (default: the working directory).
    #[arg(short = 'S', long = "socket-dir")]
    socket_dir: Option<PathBuf>,
    /// JSON-RPC socket.
    #[arg(short = 'r', long = "rpc-socket", default_value = "/var/tmp/spdk.sock")]
    rpc_socket: PathBuf,
    /// CPUs for the queue workers, as SPDK's core mask (`0x3`, `[0,2]`); default: all.
    #[arg(short = 'm', long = "cpumask")]
    cpumask: Option<String>,
    /// Hugepage memory in MiB (accepted for compatibility with SPDK's vhost; guest memory is
    /// mapped from the frontend, so the target itself needs none).
    #[arg(short = 's', long = "mem-size")]
    mem_size: Option<u64>,
    /// Load this configuration (SPDK `save_config` JSON) at start.
    #[arg(short = 'c', long = "config")]
    config: Option<PathBuf>,
    /// Save the configuration here after every change and restore it at start.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Permission bits of the RPC socket (octal).
    #[arg(long, default_value = "600", value_parser = parse_octal)]
    rpc_mode: u32,
    /// Group owning the RPC socket.
    #[arg(long)]
    rpc_group: Option<String>,
    /// Permission bits of controller sockets (octal; the VMM must be able to connect).
    #[arg(long, default_value = "660", value_parser = parse_octal)]
    socket_mode: u32,
    /// Largest number of virtqueues per controller.
    #[arg(long, default_value_t = 8)]
    max_queues: u16,
    /// Busy-poll window of the queue workers, in microseconds.
    #[arg(long, default_value_t = 50)]
    poll_us: u32,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9420).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Largest number of RPC connections at once; more are refused.
    #[arg(long, default_value_t = katablk_rpc::server::DEFAULT_MAX_CONNECTIONS)]
    rpc_max_connections: usize,
    /// Close RPC connections idle this many seconds (0: never).
    #[arg(long, default_value_t = 600)]
    rpc_idle_timeout: u64,
    /// MiB of partial RPC requests buffered across all connections.
    #[arg(long, default_value_t = 128)]
    rpc_max_buffered_mib: usize,
    /// Retry saved configuration entries that could not be restored (a missing disk) every
    /// this many seconds (0: only at start and when re-created).
    #[arg(long, default_value_t = 30)]
    restore_retry: u64,
}

fn parse_octal(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8).map_err(|e| format!("bad mode {s:?}: {e}"))
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let online = CpuMask::online();
    let cpumask = match &a.cpumask {
        Some(m) => CpuMask::parse(m).context("-m")?,
        None => online,
    };
    let socket_dir = match a.socket_dir {
        Some(d) => d,
        None => std::env::current_dir().context("working directory")?,
    };
    if let Some(s) = a.mem_size {
        tracing::debug!(mib = s, "-s ignored: no hugepage pool is needed");
    }
    let cfg = TargetConfig {
        settings: TargetSettings {
            socket_dir,
            cpumask,
            socket_mode: a.socket_mode,
            max_queues: a.max_queues,
            poll_us: a.poll_us,
        },
        rpc_socket: a.rpc_socket,
        rpc_mode: a.rpc_mode,
        rpc_group: a.rpc_group,
        state_dir: a.state_dir,
        config_file: a.config,
        metrics: a.metrics,
        rpc_limits: katablk_target::RpcLimits {
            max_connections: a.rpc_max_connections,
            idle_timeout: (a.rpc_idle_timeout > 0).then(|| Duration::from_secs(a.rpc_idle_timeout)),
            max_buffered: a.rpc_max_buffered_mib.saturating_mul(1 << 20),
            ..Default::default()
        },
        restore_retry: (a.restore_retry > 0).then(|| Duration::from_secs(a.restore_retry)),
    };
    // State operations serialize on one lock, so a few blocking threads are plenty; the cap
    // keeps a flood of calls from growing hundreds of threads.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(64)
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let res = rt.block_on(async move {
        let shutdown = async {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(_) => return std::future::pending().await,
                };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("shutting down");
        };
        katablk_target::run(cfg, shutdown).await
    });
    // Do not wait forever for a blocking thread stuck in a system call.
    rt.shutdown_timeout(Duration::from_secs(5));
    res?;
    Ok(())
}
