//! Test helpers: run `katablk-vhost` as a child process and drive it with libblkio.
#![allow(clippy::unwrap_used, dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

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

/// A libblkio client with one memory region used as I/O buffer space.
pub struct Client {
    pub blkio: Blkio,
    pub queues: Vec<Blkioq>,
    pub region: MemoryRegion,
    pub capacity: u64,
}

impl Client {
    pub fn connect(
        socket: &Path,
        num_queues: i32,
        read_only: bool,
    ) -> Result<Client, blkio::Error> {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", socket.to_str().unwrap())?;
        b.set_bool("read-only", read_only)?;
        b.connect()?;
        b.set_i32("num-queues", num_queues)?;
        b.set_i32("queue-size", 256)?;
        let out = b.start()?;
        let capacity = b.get_u64("capacity")?;
        let region = b.alloc_mem_region(8 << 20)?;
        b.map_mem_region(&region)?;
        Ok(Client {
            blkio: b,
            queues: out.queues,
            region,
            capacity,
        })
    }

    pub fn buf(&self) -> *mut u8 {
        self.region.addr as *mut u8
    }

    /// Waits for one request on queue `q`; returns its `ret`.
    pub fn wait1(&mut self, q: usize) -> i32 {
        let mut c = [std::mem::MaybeUninit::<Completion>::uninit()];
        let mut t = Duration::from_secs(30);
        let n = self.queues[q].do_io(&mut c, 1, Some(&mut t), None).unwrap();
        assert_eq!(n, 1, "request timed out");
        // SAFETY: do_io initialised one completion.
        unsafe { c[0].assume_init_ref() }.ret
    }

    pub fn write(&mut self, q: usize, off: u64, data: &[u8]) -> i32 {
        assert!(data.len() <= self.region.len);
        // SAFETY: the region is ours and at least data.len() long.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.buf(), data.len()) };
        let buf = self.buf();
        self.queues[q].write(off, buf, data.len(), 0, ReqFlags::empty());
        self.wait1(q)
    }

    pub fn read(&mut self, q: usize, off: u64, len: usize) -> Result<Vec<u8>, i32> {
        assert!(len <= self.region.len);
        let buf = self.buf();
        self.queues[q].read(off, buf, len, 0, ReqFlags::empty());
        let r = self.wait1(q);
        if r != 0 {
            return Err(r);
        }
        let mut v = vec![0u8; len];
        // SAFETY: the region holds `len` bytes just read.
        unsafe { std::ptr::copy_nonoverlapping(buf, v.as_mut_ptr(), len) };
        Ok(v)
    }

    pub fn flush(&mut self, q: usize) -> i32 {
        self.queues[q].flush(0, ReqFlags::empty());
        self.wait1(q)
    }

    pub fn discard(&mut self, q: usize, off: u64, len: u64) -> i32 {
        self.queues[q].discard(off, len, 0, ReqFlags::empty());
        self.wait1(q)
    }

    pub fn write_zeroes(&mut self, q: usize, off: u64, len: u64, unmap: bool) -> i32 {
        let flags = if unmap {
            ReqFlags::empty()
        } else {
            ReqFlags::NO_UNMAP
        };
        self.queues[q].write_zeroes(off, len, 0, flags);
        self.wait1(q)
    }
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
