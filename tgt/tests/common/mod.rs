//! Helpers: run `katablk-target` as a child (a `katablk_test_support::Daemon`), drive it with
//! SPDK's `spdk-rpc` and with `katablk-rpc`, and check controllers' data with the shared
//! libblkio client.
#![allow(clippy::unwrap_used, dead_code, unused_imports)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use katablk_rpc::methods::*;
use katablk_rpc::RpcClient;

pub use katablk_test_support::blk::Client;
pub use katablk_test_support::files::image;
pub use katablk_test_support::pattern::seeded as fill;
pub use katablk_test_support::spdk_rpc::{run as spdk_rpc, run_ok as spdk_rpc_ok};
use katablk_test_support::Daemon;

pub const MIB: u64 = 1 << 20;

/// A running `katablk-target` serving its RPC socket and controller sockets in `dir`, its
/// stderr appended to `dir/target.log`.
pub struct Target {
    pub daemon: Daemon,
    pub dir: PathBuf,
    pub rpc: PathBuf,
    pub sockets: PathBuf,
}

impl Target {
    pub fn start(dir: &Path, extra: &[&str]) -> Target {
        let rpc = dir.join("spdk.sock");
        let sockets = dir.join("sockets");
        let daemon = Daemon::new(katablk_test_support::bin_path!("katablk-target"))
            .arg("-S")
            .arg(&sockets)
            .arg("-r")
            .arg(&rpc)
            .args(extra)
            .env("RUST_LOG", "info")
            .log(dir.join("target.log"))
            .wait_for_socket(&rpc)
            .start();
        Target {
            daemon,
            dir: dir.to_path_buf(),
            rpc,
            sockets,
        }
    }

    /// Starts it again, same command line.
    pub fn spawn(&mut self) {
        self.daemon.spawn();
    }

    pub fn log(&self) -> String {
        self.daemon.log_text()
    }

    pub fn kill9(&mut self) {
        self.daemon.kill();
    }

    pub fn term(&mut self) -> ExitStatus {
        self.daemon.term()
    }

    pub fn ctrlr_socket(&self, name: &str) -> PathBuf {
        self.sockets.join(name)
    }
}

/// SPDK's python client, as installed by scripts/setup-debian.sh (`$SPDK_RPC`) or on PATH.
pub fn spdk_rpc_bin() -> Option<PathBuf> {
    katablk_test_support::spdk_rpc::installed().unwrap_or_else(|e| panic!("{e}"))
}

/// A current-thread runtime for `block_on` around `katablk-rpc` calls.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A `katablk-rpc` client of `t` whose calls give up after 30 s.
pub fn client(t: &Target) -> RpcClient {
    RpcClient::builder(&t.rpc)
        .timeout(Duration::from_secs(30))
        .build()
}

/// Through `rpc`: aio bdev `aio0` on `img`, lvstore `lvs0` (1 MiB clusters) on it, lvol `vol`
/// of `size_in_mib` (thin or thick), and controller `ctrlr0` serving it. Returns the lvol's
/// UUID.
pub async fn provision_lvol(rpc: &RpcClient, img: &Path, size_in_mib: u64, thin: bool) -> String {
    rpc.bdev_aio_create(&BdevAioCreateParams {
        filename: img.display().to_string(),
        name: "aio0".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    rpc.bdev_lvol_create_lvstore(&BdevLvolCreateLvstoreParams {
        bdev_name: "aio0".into(),
        lvs_name: "lvs0".into(),
        cluster_sz: Some(1 << 20),
        clear_method: None,
        num_md_pages_per_cluster_ratio: None,
        md_page_size: None,
    })
    .await
    .unwrap();
    let uuid = rpc
        .bdev_lvol_create(&BdevLvolCreateParams {
            lvol_name: "vol".into(),
            size_in_mib,
            thin_provision: Some(thin),
            clear_method: None,
            uuid: None,
            lvs_name: Some("lvs0".into()),
        })
        .await
        .unwrap();
    rpc.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
        ctrlr: "ctrlr0".into(),
        dev_name: "lvs0/vol".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    uuid
}
