//! Helpers: run `katablk-target` as a child (a `katablk_test_support::Daemon`), drive it with
//! SPDK's `spdk-rpc` and with `katablk-rpc`, and check controllers' data with the shared
//! libblkio client.
#![allow(clippy::unwrap_used, dead_code, unused_imports)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::ExitStatus;

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
