//! Test helpers: run `katablk-vhost` as a child process and drive it with the shared libblkio
//! client.
#![allow(clippy::unwrap_used, dead_code, unused_imports)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use katablk_test_support::blk::Client;

/// A running `katablk-vhost`.
pub struct Server {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub args: Vec<String>,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_katablk-vhost")
}

impl Server {
    pub fn start(socket: &Path, args: &[&str]) -> Server {
        let mut s = Server {
            child: None,
            socket: socket.to_path_buf(),
            args: args.iter().map(|s| s.to_string()).collect(),
        };
        s.spawn();
        s
    }

    pub fn spawn(&mut self) {
        let child = Command::new(bin())
            .arg("--socket")
            .arg(&self.socket)
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        wait_for_socket(&self.socket, self.child.as_mut().unwrap());
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().unwrap();
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        c.wait().unwrap()
    }

    /// SIGKILL and wait.
    pub fn kill(&mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn wait_for_socket(p: &Path, child: &mut Child) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if std::os::unix::net::UnixStream::connect(p).is_ok() {
            return;
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!("katablk-vhost exited early: {st}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("socket {} did not appear", p.display());
}

/// A deterministic pattern for (offset, len, seed).
pub fn pattern(off: u64, len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((off as usize + i).wrapping_mul(31) as u8) ^ seed)
        .collect()
}

pub fn temp_image(dir: &Path, size: u64) -> PathBuf {
    let p = dir.join("disk.img");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(size).unwrap();
    p
}
