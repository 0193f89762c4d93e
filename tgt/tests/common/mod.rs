//! Helpers: run `katablk-target` as a child, drive it with SPDK's `spdk-rpc` and with
//! `katablk-rpc`, and check controllers' data with the shared libblkio client.
#![allow(clippy::unwrap_used, dead_code, unused_imports)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub use katablk_test_support::blk::Client;

pub struct Target {
    pub child: Option<Child>,
    pub dir: PathBuf,
    pub rpc: PathBuf,
    pub sockets: PathBuf,
    pub extra: Vec<String>,
}

impl Target {
    pub fn start(dir: &Path, extra: &[&str]) -> Target {
        let mut t = Target {
            child: None,
            dir: dir.to_path_buf(),
            rpc: dir.join("spdk.sock"),
            sockets: dir.join("sockets"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        t.spawn();
        t
    }

    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("target.log"))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_katablk-target"))
            .arg("-S")
            .arg(&self.sockets)
            .arg("-r")
            .arg(&self.rpc)
            .args(&self.extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(&self.rpc).is_err() {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("katablk-target exited: {st}; log: {}", self.log());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "target did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("target.log")).unwrap_or_default()
    }

    pub fn kill9(&mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    pub fn term(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().unwrap();
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        c.wait().unwrap()
    }

    pub fn ctrlr_socket(&self, name: &str) -> PathBuf {
        self.sockets.join(name)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
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

pub fn fill(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 ^ seed.wrapping_mul(0x9e37)) as u8)
        .collect()
}

pub fn image(dir: &Path, name: &str, mib: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    p
}
