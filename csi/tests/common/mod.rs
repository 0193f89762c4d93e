//! Test harness: a real `katablk-target` child process, the driver served in-process on a unix
//! socket, a tonic client over that socket, and the shared libblkio client for the data path.
#![allow(clippy::unwrap_used, dead_code, unused_imports)] // each test binary uses a part

use katablk_csi::kubelet_lock::LockMode;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use katablk_csi::csi::{
    self, controller_client::ControllerClient, identity_client::IdentityClient,
    node_client::NodeClient, volume_capability as vc,
};
use katablk_csi::{Config, Driver, Mode};
pub use katablk_test_support::blk::{self, Client};
pub use katablk_test_support::files::image;
pub use katablk_test_support::pattern::seeded as pattern;
pub use katablk_test_support::Daemon;
use tonic::transport::Channel;

/// `katablk-target`, or SPDK's `vhost` app, serving an RPC socket and controller sockets.
pub struct Target {
    pub daemon: Daemon,
    pub rpc: PathBuf,
    pub sockets: PathBuf,
    pub state: Option<PathBuf>,
    /// SPDK's `vhost` app instead of katablk-target (same `-S`/`-r` command line, no state).
    pub spdk_vhost: Option<PathBuf>,
}

impl Target {
    pub fn start(rpc: &Path, sockets: &Path, state: Option<&Path>) -> Target {
        let mut d = Daemon::new(katablk_test_support::bin_path!("katablk-target"))
            .arg("-r")
            .arg(rpc)
            .arg("-S")
            .arg(sockets);
        if let Some(s) = state {
            d = d.arg("--state-dir").arg(s);
        }
        Self::start_daemon(d, rpc, sockets, state, None)
    }

    /// SPDK's vhost app (`vhost -S <sockets> -r <rpc> -m 0x1 -s 512`): 512 MiB of hugepages.
    pub fn start_spdk(vhost: &Path, rpc: &Path, sockets: &Path) -> Target {
        // SPDK logs every vhost-user message: keep it out of the test output.
        let d = Daemon::new(vhost)
            .arg("-r")
            .arg(rpc)
            .arg("-S")
            .arg(sockets)
            .args(["-m", "0x1", "-s", "512"])
            .log(rpc.with_file_name("spdk-vhost.log"))
            .fresh_log()
            .log_stdout();
        Self::start_daemon(d, rpc, sockets, None, Some(vhost))
    }

    fn start_daemon(
        d: Daemon,
        rpc: &Path,
        sockets: &Path,
        state: Option<&Path>,
        spdk_vhost: Option<&Path>,
    ) -> Target {
        let mut t = Target {
            daemon: d.env("RUST_LOG", "warn").wait_for_socket(rpc),
            rpc: rpc.into(),
            sockets: sockets.into(),
            state: state.map(Into::into),
            spdk_vhost: spdk_vhost.map(Into::into),
        };
        t.spawn();
        t
    }

    /// Starts it (again): a fresh RPC socket, the controller sockets' directory made.
    pub fn spawn(&mut self) {
        std::fs::create_dir_all(&self.sockets).unwrap();
        let _ = std::fs::remove_file(&self.rpc);
        self.daemon.spawn();
    }

    pub fn kill(&mut self) {
        self.daemon.kill();
    }
}

pub struct Env {
    pub dir: tempfile::TempDir,
    pub target: Target,
    pub driver: Arc<Driver>,
    pub csi_sock: PathBuf,
    pub identity: IdentityClient<Channel>,
    pub controller: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
    pub server: tokio::task::JoinHandle<()>,
}

pub const DISK_SIZE: u64 = 512 << 20;

impl Env {
    pub fn root(&self) -> &Path {
        self.dir.path()
    }
    pub fn store(&self) -> PathBuf {
        self.root().join("store")
    }
    pub fn kubelet(&self) -> PathBuf {
        self.root().join("kubelet")
    }
    pub fn direct(&self) -> PathBuf {
        self.root().join("direct")
    }
    pub fn target_path(&self, name: &str) -> PathBuf {
        self.kubelet().join("pods").join(name).join("vol")
    }

    /// Target with a 512 MiB file declared as lvstore `lvs0` through a node config file.
    pub async fn start() -> Env {
        Self::start_on(None).await
    }

    /// The same on SPDK's vhost app (`Some(path of build/bin/vhost)`) or katablk-target (`None`).
    /// Block target paths here are not kubelet's (`target_path`), so kubelet's lock is off;
    /// `start_with` turns it on.
    pub async fn start_on(spdk_vhost: Option<&Path>) -> Env {
        Self::start_with(spdk_vhost, LockMode::Off).await
    }

    /// The same with kubelet's loop-device lock for Block volumes set to `lock`.
    pub async fn start_with(spdk_vhost: Option<&Path>, lock: LockMode) -> Env {
        Self::start_configured(spdk_vhost, |c| c.kubelet_block_lock = lock).await
    }

    /// The same with the driver's configuration changed by `tune` (kubelet's lock off unless
    /// `tune` turns it on).
    pub async fn start_configured(
        spdk_vhost: Option<&Path>,
        tune: impl FnOnce(&mut Config),
    ) -> Env {
        let dir = tempfile::Builder::new()
            .prefix("kcsi")
            .tempdir_in("/tmp")
            .unwrap();
        let root = dir.path().to_path_buf();
        let disk = image(&root, "disk.img", DISK_SIZE);
        let nc = root.join("node.yaml");
        std::fs::write(
            &nc,
            format!("devices:\n  - path: {}\n    lvs: lvs0\n", disk.display()),
        )
        .unwrap();
        let rpc = root.join("spdk.sock");
        let sockets = root.join("store/block/sockets");
        let target = match spdk_vhost {
            Some(v) => Target::start_spdk(v, &rpc, &sockets),
            None => Target::start(&rpc, &sockets, None),
        };
        let mut cfg = Config::new("node-a");
        cfg.spdk_rpc = rpc;
        cfg.vhost_user_store = root.join("store");
        cfg.lvs = Some("lvs0".into());
        cfg.mode = Mode::All;
        cfg.node_config = Some(nc.clone());
        cfg.kubelet_dir = root.join("kubelet");
        cfg.direct_volumes_dir = root.join("direct");
        cfg.state_dir = root.join("state");
        cfg.kubelet_block_lock = LockMode::Off;
        tune(&mut cfg);
        std::fs::create_dir_all(&cfg.kubelet_dir).unwrap();
        let driver = Driver::new(cfg).unwrap();
        let mut w = katablk_csi::node_config::Watcher::new(nc);
        assert!(
            w.poll(&driver.rpc, true).await.unwrap(),
            "node config applies"
        );
        Self::serve(dir, target, driver).await
    }

    pub async fn serve(dir: tempfile::TempDir, target: Target, driver: Arc<Driver>) -> Env {
        let csi_sock = dir.path().join("csi.sock");
        let ep = format!("unix://{}", csi_sock.display());
        let d = driver.clone();
        let server = tokio::spawn(async move {
            katablk_csi::serve(d, &ep, None, std::future::pending())
                .await
                .unwrap();
        });
        let ch = channel(&csi_sock).await;
        Env {
            identity: IdentityClient::new(ch.clone()),
            controller: ControllerClient::new(ch.clone()),
            node: NodeClient::new(ch),
            dir,
            target,
            driver,
            csi_sock,
            server,
        }
    }
}

impl Drop for Env {
    /// A failed test must not leave bind mounts behind under the temp dir.
    fn drop(&mut self) {
        self.server.abort();
        if let Ok(mps) = katablk_csi::mounts::mount_points() {
            for m in mps.iter().rev().filter(|m| m.starts_with(self.dir.path())) {
                let _ = katablk_csi::mounts::unmount(m);
            }
        }
    }
}

/// A tonic channel over a unix socket (waits for it to appear).
pub async fn channel(path: &Path) -> Channel {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "CSI socket did not appear"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The path can exist a moment before the driver listens on it (or be a stale socket it is
    // about to replace): retry refused connections until the same deadline.
    loop {
        let p = path.to_path_buf();
        let r = tonic::transport::Endpoint::try_from("http://[::]:50051")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let p = p.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(p).await?,
                    ))
                }
            }))
            .await;
        match r {
            Ok(ch) => return ch,
            Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("cannot connect to the CSI socket: {e}"),
        }
    }
}

pub fn spdk_params() -> HashMap<String, String> {
    [("spdk".to_owned(), "true".to_owned())].into()
}

pub fn cap(block: bool, mode: vc::access_mode::Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(if block {
            vc::AccessType::Block(vc::BlockVolume {})
        } else {
            vc::AccessType::Mount(vc::MountVolume {
                fs_type: "ext4".into(),
                ..Default::default()
            })
        }),
        access_mode: Some(vc::AccessMode { mode: mode as i32 }),
    }
}

pub fn block_cap() -> csi::VolumeCapability {
    cap(true, vc::access_mode::Mode::SingleNodeWriter)
}

pub fn mount_cap() -> csi::VolumeCapability {
    cap(false, vc::access_mode::Mode::SingleNodeWriter)
}

pub fn create_req(name: &str, bytes: i64) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![block_cap()],
        parameters: spdk_params(),
        ..Default::default()
    }
}

/// CreateVolume with a snapshot as its content source.
pub fn restore_req(name: &str, bytes: i64, snapshot_id: &str) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, bytes);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: snapshot_id.into(),
            },
        )),
    });
    r
}

pub fn publish_req(
    vol: &str,
    target: &Path,
    c: csi::VolumeCapability,
    ro: bool,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: vol.into(),
        target_path: target.display().to_string(),
        volume_capability: Some(c),
        readonly: ro,
        ..Default::default()
    }
}

pub fn unpublish_req(vol: &str, target: &Path) -> csi::NodeUnpublishVolumeRequest {
    csi::NodeUnpublishVolumeRequest {
        volume_id: vol.into(),
        target_path: target.display().to_string(),
    }
}

/// A libblkio client of a controller, as the tests here use it: one queue, and a 2 MiB-aligned
/// hugepage buffer when there are free hugepages (SPDK's vhost needs that; see
/// `katablk_bdev::shm`), else libblkio's own.
pub fn blk_client(socket: &Path, read_only: bool) -> Result<Client, blkio::Error> {
    Client::connect_with(
        socket,
        &blk::Options {
            read_only,
            buffer: blk::Buffer::Aligned(1 << 20),
            ..blk::Options::default()
        },
    )
}

/// Runs a blocking libblkio closure off the async runtime.
pub async fn blk<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    tokio::task::spawn_blocking(f).await.unwrap()
}

pub fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> tonic::Code {
    match r {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    }
}

/// The controller name of a volume id.
pub fn ctrlr(vol: &str) -> String {
    katablk_csi::volume::LvolId::parse(vol)
        .unwrap()
        .ctrlr_name()
}
