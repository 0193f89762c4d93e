//! `katablk-csi`: parses flags, starts reconciliation and serves CSI on a unix socket.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use katablk_csi::{Config, Driver, Mode};

/// CSI driver publishing node-local SPDK lvols to Kata pods over vhost-user-blk.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// CSI endpoint.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// CSI driver name.
    #[arg(long, default_value = katablk_csi::DEFAULT_DRIVER_NAME)]
    driver_name: String,
    /// Node id (default: the hostname).
    #[arg(long)]
    node_id: Option<String>,
    /// SPDK JSON-RPC socket.
    #[arg(long, default_value = "/var/tmp/spdk.sock")]
    spdk_rpc: PathBuf,
    /// Kata vhost-user store; the target must create sockets in <store>/block/sockets.
    #[arg(long, default_value = "/var/run/kata-containers/vhost-user")]
    vhost_user_store: PathBuf,
    /// Default (existing) lvstore for volumes.
    #[arg(long)]
    lvs: Option<String>,
    /// Services to run.
    #[arg(long, value_enum, default_value_t = Mode::All)]
    mode: Mode,
    /// Declared node storage (YAML or JSON), applied at start and on change.
    #[arg(long)]
    node_config: Option<PathBuf>,
    /// kubelet root directory; target paths must be inside it.
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
    /// Kata direct-assigned volumes directory.
    #[arg(long, default_value = "/run/kata-containers/shared/direct-volumes")]
    direct_volumes_dir: PathBuf,
    /// The driver's state directory.
    #[arg(long, default_value = "/var/lib/katablk-csi")]
    state_dir: PathBuf,
    /// Seconds between reconciliation passes (and node config polls).
    #[arg(long, default_value_t = 10)]
    reconcile_interval: u64,
    /// Block volumes: prepare the loop device kubelet's mapping locks the volume with
    /// (`kubelet`: target paths must follow kubelet's layout), or not (`off`: for callers that
    /// are not kubelet).
    #[arg(long, value_enum, default_value_t = katablk_csi::kubelet_lock::LockMode::Kubelet)]
    kubelet_block_lock: katablk_csi::kubelet_lock::LockMode,
    /// The Kata runtime Filesystem volumes' mountInfo.json is written for, unless the
    /// StorageClass sets `kataRuntime`: `go` (Kata's Go runtime: kata-qemu) or `rs`
    /// (runtime-rs: kata-dragonball).
    #[arg(long, value_enum, default_value_t = katablk_csi::kata::KataRuntime::Go)]
    kata_runtime: katablk_csi::kata::KataRuntime,
    /// Prometheus metrics address, e.g. 0.0.0.0:9808.
    #[arg(long)]
    metrics: Option<SocketAddr>,
}

fn hostname() -> anyhow::Result<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").context("reading hostname")?;
    Ok(h.trim().to_owned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let mut cfg = Config::new(match a.node_id {
        Some(n) => n,
        None => hostname()?,
    });
    cfg.driver_name = a.driver_name;
    cfg.spdk_rpc = a.spdk_rpc;
    cfg.vhost_user_store = a.vhost_user_store;
    cfg.lvs = a.lvs;
    cfg.mode = a.mode;
    cfg.node_config = a.node_config;
    cfg.kubelet_dir = a.kubelet_dir;
    cfg.direct_volumes_dir = a.direct_volumes_dir;
    cfg.state_dir = a.state_dir;
    cfg.kubelet_block_lock = a.kubelet_block_lock;
    cfg.kata_runtime = a.kata_runtime;
    cfg.reconcile_interval = Duration::from_secs(a.reconcile_interval.max(1));
    let driver = Driver::new(cfg).context("starting the driver")?;
    tokio::spawn(katablk_csi::reconcile::run(driver.clone()));
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
    };
    katablk_csi::serve(driver, &a.endpoint, a.metrics, shutdown)
        .await
        .context("serving CSI")?;
    Ok(())
}
