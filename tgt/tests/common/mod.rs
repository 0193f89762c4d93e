//! Helpers: run `katablk-target` as a child (a `katablk_test_support::Daemon`), drive it with
//! SPDK's `spdk-rpc` and with `katablk-rpc`, and check controllers' data with the shared
//! libblkio client.
#![allow(clippy::unwrap_used, dead_code, unused_imports)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};

pub use katablk_test_support::blk::Client;
pub use katablk_test_support::files::image;
pub use katablk_test_support::pattern::seeded as fill;
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
    let cand = std::env::var_os("SPDK_RPC")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("spdk-rpc"));
    let ok = Command::new(&cand)
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if ok {
        Some(cand)
    } else if std::env::var_os("SPDK_RPC").is_some() {
        panic!("$SPDK_RPC is set but does not run");
    } else {
        None
    }
}

pub fn spdk_rpc(bin: &Path, sock: &Path, args: &[&str]) -> Output {
    Command::new(bin)
        .arg("-s")
        .arg(sock)
        .args(args)
        .output()
        .unwrap()
}

pub fn spdk_rpc_ok(bin: &Path, sock: &Path, args: &[&str]) -> String {
    let o = spdk_rpc(bin, sock, args);
    assert!(
        o.status.success(),
        "spdk-rpc {args:?} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}
