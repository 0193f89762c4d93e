//! Test helpers: run `katablk-vhost` as a child process (a `katablk_test_support::Daemon`) and
//! drive it with the shared libblkio client.
#![allow(dead_code, unused_imports)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::ExitStatus;

pub use katablk_test_support::blk::Client;
pub use katablk_test_support::files::image;
pub use katablk_test_support::pattern::offset as pattern;
use katablk_test_support::Daemon;

/// The `katablk-vhost` binary of this build.
pub fn bin() -> PathBuf {
    katablk_test_support::bin_path!("katablk-vhost")
}

/// `katablk-vhost --socket <socket> <args>` with `RUST_LOG=warn`, ready once the socket
/// accepts connections; not started.
pub fn daemon(socket: &Path, args: &[&str]) -> Daemon {
    Daemon::new(bin())
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env("RUST_LOG", "warn")
        .wait_for_socket(socket)
}

/// A running `katablk-vhost`.
pub struct Server {
    pub daemon: Daemon,
    pub socket: PathBuf,
}

impl Server {
    pub fn start(socket: &Path, args: &[&str]) -> Server {
        Server {
            daemon: daemon(socket, args).start(),
            socket: socket.to_path_buf(),
        }
    }

    /// Starts it again (after [`Server::stop`] or [`Server::kill`]).
    pub fn spawn(&mut self) {
        self.daemon.spawn();
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        self.daemon.term()
    }

    /// SIGKILL and wait.
    pub fn kill(&mut self) {
        self.daemon.kill();
    }
}
