//! `katablk-target`: an embedded SPDK-compatible target. It speaks the subset of SPDK's JSON-RPC
//! that the node stack uses (bdevs, lvstores and lvols, vhost-user-blk controllers), with SPDK's
//! parameter names, reply shapes and error codes, and serves the controllers from katablk's own
//! vhost-user-blk backend, so the whole stack runs where SPDK is not installed and a real SPDK
//! `vhost` app stays a drop-in replacement.
//!
//! - [`state::Target`]: the state (bdevs, lvstores, controllers) and every operation.
//! - [`rpc`]: the JSON-RPC method table.
//! - [`persist`]: `--state-dir`, the configuration saved after each change and restored at start.
//! - [`metrics`]: the Prometheus endpoint.

#![deny(missing_docs)]

pub mod bdevs;
pub mod cpumask;
pub mod error;
pub mod metrics;
pub mod names;
pub mod persist;
pub mod rpc;
pub mod state;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use crate::state::{Target, TargetSettings};
pub use cpumask::CpuMask;

/// Everything needed to run a target.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    /// Settings of the target itself.
    pub settings: TargetSettings,
    /// The JSON-RPC socket.
    pub rpc_socket: PathBuf,
    /// Permission bits of the RPC socket.
    pub rpc_mode: u32,
    /// Group owning the RPC socket.
    pub rpc_group: Option<String>,
    /// Saved configuration directory.
    pub state_dir: Option<PathBuf>,
    /// A JSON configuration (SPDK `save_config` format) to load at start.
    pub config_file: Option<PathBuf>,
    /// Prometheus endpoint address.
    pub metrics: Option<std::net::SocketAddr>,
    /// Limits of the RPC server.
    pub rpc_limits: RpcLimits,
    /// How often unrestored configuration entries are retried (`None`: only at start and
    /// when re-created by an RPC).
    pub restore_retry: Option<Duration>,
}

/// Limits of the JSON-RPC server (see [`katablk_rpc::server`]).
#[derive(Debug, Clone)]
pub struct RpcLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Idle connections are closed after this (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// Bytes of partial requests buffered across connections.
    pub max_buffered: usize,
    /// Requests and notifications in flight per connection.
    pub max_in_flight: usize,
}

impl Default for RpcLimits {
    fn default() -> Self {
        RpcLimits {
            max_connections: katablk_rpc::server::DEFAULT_MAX_CONNECTIONS,
            idle_timeout: Some(katablk_rpc::server::DEFAULT_IDLE_TIMEOUT),
            max_buffered: katablk_rpc::server::DEFAULT_MAX_BUFFERED_TOTAL,
            max_in_flight: katablk_rpc::server::DEFAULT_MAX_IN_FLIGHT,
        }
    }
}

/// How long stopping waits for the state lock (an operation stuck in I/O) before giving up
/// on a clean close of controllers and lvstores.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// Retries unrestored entries every `every`, saving the configuration when any came back.
async fn retry_unrestored(target: Arc<Target>, state: Option<persist::StateDir>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        if target.unrestored_count() == 0 {
            continue;
        }
        let (t, s) = (target.clone(), state.clone());
        let _ = tokio::task::spawn_blocking(move || {
            if persist::retry_unrestored(&t) > 0 {
                if let Some(s) = &s {
                    if let Err(e) = s.save(&t) {
                        tracing::error!("cannot save the configuration: {e}");
                    }
                }
            }
        })
        .await;
    }
}

/// Errors starting the target.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The RPC socket could not be set up.
    #[error("RPC socket: {0}")]
    Rpc(#[from] katablk_rpc::ServerError),
    /// A directory or file could not be used.
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
}

/// Runs a target until `shutdown` resolves or `spdk_kill_instance` is called; then stops every
/// controller (in-flight requests complete) and closes every lvstore cleanly.
pub async fn run(
    cfg: TargetConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), StartError> {
    let sdir = &cfg.settings.socket_dir;
    std::fs::create_dir_all(sdir).map_err(|e| StartError::Io(sdir.display().to_string(), e))?;
    let target = Arc::new(Target::new(cfg.settings.clone()));
    let state = match &cfg.state_dir {
        Some(d) => Some(
            persist::StateDir::new(d).map_err(|e| StartError::Io(d.display().to_string(), e))?,
        ),
        None => None,
    };
    if let Some(f) = &cfg.config_file {
        let s = persist::StateDir::from_file(f);
        let t = target.clone();
        tokio::task::spawn_blocking(move || s.restore(&t))
            .await
            .map_err(|e| StartError::Io(f.display().to_string(), std::io::Error::other(e)))?
            .map_err(|e| StartError::Io(f.display().to_string(), e))?;
    }
    if let Some(s) = state.clone() {
        let t = target.clone();
        let p = s.path();
        tokio::task::spawn_blocking(move || s.restore(&t))
            .await
            .map_err(|e| StartError::Io(p.display().to_string(), std::io::Error::other(e)))?
            .map_err(|e| StartError::Io(p.display().to_string(), e))?;
    }
    let unrestored = target.unrestored_count();
    if unrestored > 0 {
        tracing::warn!(
            entries = unrestored,
            "some saved configuration could not be restored; it is kept and retried (see katablk_get_unrestored)"
        );
    }
    let retry_task = cfg
        .restore_retry
        .map(|every| tokio::spawn(retry_unrestored(target.clone(), state.clone(), every)));
    let l = &cfg.rpc_limits;
    let mut scfg = katablk_rpc::ServerConfig::new(&cfg.rpc_socket)
        .mode(cfg.rpc_mode)
        .max_connections(l.max_connections)
        .idle_timeout(l.idle_timeout)
        .max_in_flight(l.max_in_flight);
    scfg = scfg.max_buffered(
        l.max_buffered,
        katablk_rpc::server::DEFAULT_UNBUDGETED_PER_CONNECTION,
    );
    if let Some(g) = &cfg.rpc_group {
        scfg = scfg.group(g)?;
    }
    let server = katablk_rpc::RpcServer::bind(scfg)?;
    let metrics_task = match cfg.metrics {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| StartError::Io(addr.to_string(), e))?;
            Some(tokio::spawn(metrics::serve(l, target.clone())))
        }
        None => None,
    };
    let kill = Arc::new(tokio::sync::Notify::new());
    let router = rpc::router(rpc::Ctx {
        target: target.clone(),
        state,
        kill: kill.clone(),
    });
    tracing::info!(rpc = %cfg.rpc_socket.display(), sockets = %sdir.display(), "katablk-target ready");
    let stop = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = kill.notified() => {}
        }
    };
    let res = server.serve_until(Arc::new(router), stop).await;
    for t in [metrics_task, retry_task].into_iter().flatten() {
        t.abort();
    }
    let t = target.clone();
    let stop = tokio::task::spawn_blocking(move || t.shutdown());
    if tokio::time::timeout(SHUTDOWN_TIMEOUT, stop).await.is_err() {
        tracing::warn!(
            "state still busy after {SHUTDOWN_TIMEOUT:?}; stopping without a clean close"
        );
    }
    tracing::info!("katablk-target stopped");
    res.map_err(StartError::Rpc)
}
