//! The driver object shared by the three services, its configuration and the gRPC server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use katablk_rpc::methods::{BdevInfo, LvstoreInfo, LvstoreSelector};
use katablk_rpc::RpcClient;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Response, Status};

use crate::csi;
use crate::error::{CsiError, Result};
use crate::kata::Store;
use crate::metrics::Metrics;
use crate::state::State;
use crate::volume::{LvolId, MAX_SOCKET_PATH};
use crate::volume_lock::VolumeLocks;

/// Default CSI driver name.
pub const DEFAULT_DRIVER_NAME: &str = "katablk.csi.io";

/// Topology key whose value is the node id.
pub const TOPOLOGY_KEY: &str = "topology.katablk.csi.io/node";

/// Which services to serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Identity + Node.
    Node,
    /// Identity + Controller.
    Controller,
    /// All three.
    All,
}

impl Mode {
    /// Serves the Controller service.
    pub fn controller(self) -> bool {
        matches!(self, Self::Controller | Self::All)
    }
    /// Serves the Node service.
    pub fn node(self) -> bool {
        matches!(self, Self::Node | Self::All)
    }
}

/// Driver configuration (the CLI flags).
#[derive(Debug, Clone)]
pub struct Config {
    /// CSI driver name.
    pub driver_name: String,
    /// This node's id (also the topology value).
    pub node_id: String,
    /// SPDK JSON-RPC socket.
    pub spdk_rpc: PathBuf,
    /// Kata vhost-user store root.
    pub vhost_user_store: PathBuf,
    /// Default lvstore.
    pub lvs: Option<String>,
    /// Served services.
    pub mode: Mode,
    /// Declared node storage file.
    pub node_config: Option<PathBuf>,
    /// kubelet root: target paths must be inside it.
    pub kubelet_dir: PathBuf,
    /// Kata direct-volumes directory.
    pub direct_volumes_dir: PathBuf,
    /// The driver's state directory.
    pub state_dir: PathBuf,
    /// How often to reconcile controllers and re-read the node config.
    pub reconcile_interval: Duration,
    /// JSON-RPC call timeout.
    pub rpc_timeout: Duration,
    /// Whether Block publications prepare kubelet's loop-device lock ([`crate::kubelet_lock`]).
    pub kubelet_block_lock: crate::kubelet_lock::LockMode,
    /// The Kata runtime Filesystem volumes are written for unless their StorageClass says
    /// (`kataRuntime`).
    pub kata_runtime: crate::kata::KataRuntime,
}

impl Config {
    /// Defaults for everything but the node id.
    pub fn new(node_id: impl Into<String>) -> Self {
        Self {
            driver_name: DEFAULT_DRIVER_NAME.into(),
            node_id: node_id.into(),
            spdk_rpc: katablk_rpc::DEFAULT_SOCKET_PATH.into(),
            vhost_user_store: "/var/run/kata-containers/vhost-user".into(),
            lvs: None,
            mode: Mode::All,
            node_config: None,
            kubelet_dir: "/var/lib/kubelet".into(),
            direct_volumes_dir: "/run/kata-containers/shared/direct-volumes".into(),
            state_dir: "/var/lib/katablk-csi".into(),
            reconcile_interval: Duration::from_secs(10),
            rpc_timeout: Duration::from_secs(30),
            kubelet_block_lock: crate::kubelet_lock::LockMode::Kubelet,
            kata_runtime: crate::kata::KataRuntime::Go,
        }
    }
}

/// Shared state of the services.
#[derive(Debug)]
pub struct Driver {
    /// Configuration.
    pub cfg: Config,
    /// JSON-RPC client of the target.
    pub rpc: RpcClient,
    /// Per-volume locks.
    pub locks: VolumeLocks,
    /// Metrics.
    pub metrics: Metrics,
    /// Persistent state.
    pub state: State,
    /// The vhost-user store.
    pub store: Store,
    /// Serialises device-node minor allocation.
    pub minors: tokio::sync::Mutex<()>,
    /// Serialises changes of per-pod QoS groups (volumes of one pod publish concurrently).
    pub pod_groups: tokio::sync::Mutex<()>,
}

impl Driver {
    /// Validates the configuration, prepares directories and loads the state.
    pub fn new(cfg: Config) -> Result<Arc<Self>> {
        if cfg.node_id.is_empty() || cfg.node_id.len() > 128 {
            return Err(CsiError::InvalidArgument(
                "node id must be 1-128 bytes".into(),
            ));
        }
        if let Some(l) = &cfg.lvs {
            if !crate::volume::valid_name(l) {
                return Err(CsiError::InvalidArgument(format!(
                    "invalid lvstore name {l:?}"
                )));
            }
        }
        if cfg.spdk_rpc.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(CsiError::InvalidArgument("--spdk-rpc path too long".into()));
        }
        let store = Store::new(&cfg.vhost_user_store);
        if cfg.mode.node() {
            store.prepare()?;
        }
        std::fs::create_dir_all(&cfg.state_dir)
            .map_err(|e| CsiError::io("create", &cfg.state_dir, e))?;
        let state = State::load(&cfg.state_dir)?;
        let rpc = RpcClient::builder(&cfg.spdk_rpc)
            .timeout(cfg.rpc_timeout)
            .connect_timeout(Duration::from_secs(2))
            .build();
        let d = Arc::new(Self {
            cfg,
            rpc,
            locks: VolumeLocks::new(),
            metrics: Metrics::new(),
            state,
            store,
            minors: tokio::sync::Mutex::new(()),
            pod_groups: tokio::sync::Mutex::new(()),
        });
        d.refresh_published_gauge();
        Ok(d)
    }

    /// This node's topology segment.
    pub fn topology(&self) -> csi::Topology {
        csi::Topology {
            segments: [(TOPOLOGY_KEY.to_owned(), self.cfg.node_id.clone())].into(),
        }
    }

    /// Updates the published-volume gauges from the state file.
    pub fn refresh_published_gauge(&self) {
        let mut by: std::collections::BTreeMap<&'static str, u64> = Default::default();
        let mut locks = 0;
        for p in self.state.published.all().values() {
            let h = match p.runtime() {
                None => "block_device_node",
                Some(crate::kata::KataRuntime::Go) => "direct_go",
                Some(crate::kata::KataRuntime::Rs) if p.raw_block => "direct_rs_raw",
                Some(crate::kata::KataRuntime::Rs) => "direct_rs",
            };
            *by.entry(h).or_default() += 1;
            locks += u64::from(p.kubelet_map.is_some());
        }
        self.metrics.set_published(by, locks);
    }

    /// Reads the target's rate-limit counters of every volume published on this node into the
    /// metrics (one `bdev_get_iostat` per volume, each bounded by two seconds; a volume the
    /// target does not answer for, or answers for without katablk's counters, is left out).
    pub async fn refresh_volume_qos(&self) {
        let mut v = std::collections::BTreeMap::new();
        for id in self.state.published.all().keys() {
            let p = katablk_rpc::methods::BdevGetIostatParams {
                name: Some(id.clone()),
                ..Default::default()
            };
            let call = self
                .rpc
                .call_method::<katablk_rpc::methods::BdevGetIostat>(&p);
            let r = match tokio::time::timeout(Duration::from_secs(2), call).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    tracing::debug!(volume = %id, error = %e, "bdev_get_iostat failed");
                    continue;
                }
                Err(_) => {
                    tracing::debug!(volume = %id, "bdev_get_iostat timed out");
                    continue;
                }
            };
            let Some(b) = r.bdevs.first() else { continue };
            if let (Some(n), Some(ns)) =
                (b.katablk_qos_throttled_requests, b.katablk_qos_throttled_ns)
            {
                v.insert(
                    id.clone(),
                    crate::metrics::VolumeQos {
                        throttled_requests: n,
                        throttled_ns: ns,
                    },
                );
            }
        }
        self.metrics.set_volume_qos(v);
    }

    /// The metrics as a scrape returns them: per-volume counters refreshed from the target
    /// first.
    pub async fn render_metrics(&self) -> String {
        self.refresh_volume_qos().await;
        self.metrics.render()
    }

    /// Logs a finished call, records metrics and converts the result.
    pub fn finish<T>(
        &self,
        method: &'static str,
        volume: &str,
        t0: Instant,
        r: Result<T>,
    ) -> std::result::Result<Response<T>, Status> {
        let took = t0.elapsed();
        match r {
            Ok(v) => {
                self.metrics.observe(method, tonic::Code::Ok, took);
                tracing::info!(method, volume_id = volume, ?took, "ok");
                Ok(Response::new(v))
            }
            Err(e) => {
                let code = e.code();
                self.metrics.observe(method, code, took);
                if matches!(code, tonic::Code::Internal | tonic::Code::Unavailable) {
                    tracing::error!(method, volume_id = volume, ?code, error = %e, "failed");
                } else {
                    tracing::warn!(method, volume_id = volume, ?code, error = %e, "failed");
                }
                Err(e.into())
            }
        }
    }

    /// The lvol bdev for an id, `None` if absent.
    pub async fn lvol(&self, id: &LvolId) -> Result<Option<BdevInfo>> {
        let b = self
            .rpc
            .bdev_get_bdev(&id.alias())
            .await
            .map_err(CsiError::rpc("bdev_get_bdevs"))?;
        Ok(b.filter(|b| b.driver_specific.lvol.is_some()))
    }

    /// The lvstore named `name`, `None` if absent.
    pub async fn lvstore(&self, name: &str) -> Result<Option<LvstoreInfo>> {
        match self
            .rpc
            .bdev_lvol_get_lvstores(&LvstoreSelector::by_name(name))
            .await
        {
            Ok(v) => Ok(v.into_iter().find(|l| l.name == name)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(CsiError::rpc("bdev_lvol_get_lvstores")(e)),
        }
    }

    /// All lvstores.
    pub async fn lvstores(&self) -> Result<Vec<LvstoreInfo>> {
        self.rpc
            .bdev_lvol_get_lvstores(&LvstoreSelector::default())
            .await
            .map_err(CsiError::rpc("bdev_lvol_get_lvstores"))
    }
}

/// Size in bytes of a bdev.
pub fn bdev_size(b: &BdevInfo) -> u64 {
    b.num_blocks.saturating_mul(u64::from(b.block_size))
}

/// The `<lvs>/<lvol>` alias of an lvol bdev.
pub fn bdev_alias(b: &BdevInfo) -> Option<&str> {
    b.aliases
        .iter()
        .map(String::as_str)
        .find(|a| a.contains('/'))
}

/// Parses `unix:///path` (or `unix:/path`, or a bare absolute path) into a path.
pub fn endpoint_path(endpoint: &str) -> Result<PathBuf> {
    let p = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if !p.starts_with('/') {
        return Err(CsiError::InvalidArgument(format!(
            "endpoint {endpoint:?}: only unix:///absolute/path is supported"
        )));
    }
    crate::volume::check_socket_path(Path::new(p))
        .map_err(|e| CsiError::InvalidArgument(e.to_string()))?;
    Ok(PathBuf::from(p))
}

/// Binds the CSI socket (replacing a stale one) and serves until `shutdown` resolves.
pub async fn serve(
    driver: Arc<Driver>,
    endpoint: &str,
    metrics_addr: Option<SocketAddr>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let path = endpoint_path(endpoint)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| CsiError::io("create", dir, e))?;
    }
    match std::fs::symlink_metadata(&path) {
        Ok(md) if std::os::unix::fs::FileTypeExt::is_socket(&md.file_type()) => {
            std::fs::remove_file(&path).map_err(|e| CsiError::io("remove", &path, e))?;
        }
        Ok(_) => {
            return Err(CsiError::FailedPrecondition(format!(
                "{path:?} exists and is not a socket"
            )))
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(&path).map_err(|e| CsiError::io("bind", &path, e))?;
    tracing::info!(endpoint, driver = %driver.cfg.driver_name, node = %driver.cfg.node_id,
        mode = ?driver.cfg.mode, "CSI endpoint listening");
    if let Some(addr) = metrics_addr {
        let m = driver.metrics.clone();
        let d = driver.clone();
        let refresh = move || {
            let d = d.clone();
            async move { d.refresh_volume_qos().await }
        };
        tokio::spawn(async move {
            if let Err(e) = m.serve(addr, refresh).await {
                tracing::error!(%addr, error = %e, "metrics endpoint failed");
            }
        });
    }
    let mode = driver.cfg.mode;
    let mut router =
        tonic::transport::Server::builder().add_service(csi::identity_server::IdentityServer::new(
            crate::identity::IdentityService::new(driver.clone()),
        ));
    if mode.controller() {
        router = router.add_service(csi::controller_server::ControllerServer::new(
            crate::controller::ControllerService::new(driver.clone()),
        ));
    }
    if mode.node() {
        router = router.add_service(csi::node_server::NodeServer::new(
            crate::node::NodeService::new(driver.clone()),
        ));
    }
    let r = router
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await;
    let _ = std::fs::remove_file(&path);
    r.map_err(|e| CsiError::Internal(format!("gRPC server: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            endpoint_path("unix:///csi/csi.sock").unwrap(),
            Path::new("/csi/csi.sock")
        );
        assert_eq!(
            endpoint_path("unix:/csi/csi.sock").unwrap(),
            Path::new("/csi/csi.sock")
        );
        assert_eq!(
            endpoint_path("/csi/csi.sock").unwrap(),
            Path::new("/csi/csi.sock")
        );
        assert!(endpoint_path("tcp://1.2.3.4:5").is_err());
        assert!(endpoint_path(&format!("unix://{}", "/x".repeat(60))).is_err());
    }
}
