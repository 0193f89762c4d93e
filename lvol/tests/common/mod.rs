//! Test devices: a RAM device with a volatile write cache, fault injection and resizing.
#![allow(dead_code, unused_imports, clippy::unwrap_used)] // each test binary uses a part

use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use katablk_bdev::sync::SyncIo;
use katablk_bdev::{
    BdevError, BlockDevice, Completion, DeviceInfo, IoChannel, IoError, IoOp, IoRequest,
    SubmitError,
};

pub const BS: usize = 512;

/// What happens to writes cached but not flushed when the device "crashes".
#[derive(Clone, Copy, Debug)]
pub enum CrashMode {
    /// Every pending write reaches the medium.
    KeepAll,
    /// Pending writes are each kept, dropped or torn (a random subset of their sectors).
    Random(u64),
}

struct Pending {
    off: usize,
    data: Vec<u8>,
}

struct State {
    durable: Vec<u8>,
    current: Vec<u8>,
    pending: Vec<Pending>,
    writes: u64,
    /// After this many write operations every request fails.
    fail_after: Option<u64>,
    dead: bool,
}

/// A RAM device whose unflushed writes can be lost or torn.
#[derive(Clone)]
pub struct FaultDev {
    st: Arc<Mutex<State>>,
}

impl FaultDev {
    pub fn new(bytes: usize) -> Self {
        Self::from_image(vec![0u8; bytes])
    }

    pub fn from_image(img: Vec<u8>) -> Self {
        FaultDev {
            st: Arc::new(Mutex::new(State {
                durable: img.clone(),
                current: img,
                pending: Vec::new(),
                writes: 0,
                fail_after: None,
                dead: false,
            })),
        }
    }

    pub fn arc(&self) -> Arc<dyn BlockDevice> {
        Arc::new(self.clone())
    }

    /// Every request fails once `n` more write operations have been done.
    pub fn fail_after(&self, n: u64) {
        let mut s = self.st.lock().unwrap();
        s.fail_after = Some(s.writes + n);
    }

    pub fn writes(&self) -> u64 {
        self.st.lock().unwrap().writes
    }

    /// The medium as it would be after a power loss now.
    pub fn crash_image(&self, mode: CrashMode) -> Vec<u8> {
        let s = self.st.lock().unwrap();
        let mut img = s.durable.clone();
        let mut rng = match mode {
            CrashMode::KeepAll => 0,
            CrashMode::Random(seed) => seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
        };
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for p in &s.pending {
            match mode {
                CrashMode::KeepAll => img[p.off..p.off + p.data.len()].copy_from_slice(&p.data),
                CrashMode::Random(_) => match next() % 3 {
                    0 => {}
                    1 => img[p.off..p.off + p.data.len()].copy_from_slice(&p.data),
                    _ => {
                        for (i, sec) in p.data.chunks(BS).enumerate() {
                            if next() % 2 == 0 {
                                let o = p.off + i * BS;
                                img[o..o + sec.len()].copy_from_slice(sec);
                            }
                        }
                    }
                },
            }
        }
        img
    }

    /// Current contents (as reads see them).
    pub fn image(&self) -> Vec<u8> {
        self.st.lock().unwrap().current.clone()
    }

    /// Resizes the device (grow or truncate), keeping contents.
    pub fn resize(&self, bytes: usize) {
        let mut s = self.st.lock().unwrap();
        s.current.resize(bytes, 0);
        s.durable.resize(bytes, 0);
        s.pending.retain(|p| p.off + p.data.len() <= bytes);
    }

    pub fn poke(&self, off: usize, data: &[u8]) {
        let mut s = self.st.lock().unwrap();
        s.current[off..off + data.len()].copy_from_slice(data);
        s.durable[off..off + data.len()].copy_from_slice(data);
    }
}

impl BlockDevice for FaultDev {
    fn info(&self) -> DeviceInfo {
        let s = self.st.lock().unwrap();
        DeviceInfo {
            block_size: BS as u32,
            num_blocks: (s.current.len() / BS) as u64,
            read_only: false,
            volatile_cache: true,
            discard: true,
            write_zeroes: true,
            buf_align: 1,
            physical_block_size: BS as u32,
            optimal_io_size: 0,
        }
    }

    fn open_channel(&self, depth: usize, _segs: usize) -> Result<Box<dyn IoChannel>, BdevError> {
        Ok(Box::new(FaultChan {
            dev: self.clone(),
            done: Vec::new(),
            depth: depth.max(1),
        }))
    }

    fn describe(&self) -> String {
        "faultdev".into()
    }
}

struct FaultChan {
    dev: FaultDev,
    done: Vec<Completion>,
    depth: usize,
}

impl IoChannel for FaultChan {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        if self.done.len() >= self.depth {
            return Err(SubmitError::Full);
        }
        let info = self.dev.info();
        if req.op != IoOp::Flush {
            info.check_range(req.offset, req.len)?;
        }
        let mut s = self.dev.st.lock().unwrap();
        let result = if s.dead {
            Err(IoError::Errno(libc::EIO))
        } else {
            let off = req.offset as usize;
            let len = req.len as usize;
            if req.op.is_write() {
                s.writes += 1;
                if !s.dead && s.fail_after.is_some_and(|n| s.writes > n) {
                    s.dead = true;
                    // The write that hits the crash is torn: its first half of sectors may
                    // reach the medium.
                    if req.op == IoOp::Write && len >= 2 * BS {
                        let mut data = Vec::with_capacity(len);
                        for v in req.iov {
                            // SAFETY: caller buffers valid per the submit contract.
                            data.extend_from_slice(unsafe {
                                std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len)
                            });
                        }
                        data.truncate(len / BS / 2 * BS);
                        s.pending.push(Pending { off, data });
                    }
                }
            }
            if s.dead {
                Err(IoError::Errno(libc::EIO))
            } else {
                match req.op {
                    IoOp::Read => {
                        let mut o = off;
                        for v in req.iov {
                            // SAFETY: caller buffers valid per the submit contract.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    s.current.as_ptr().add(o),
                                    v.iov_base.cast::<u8>(),
                                    v.iov_len,
                                )
                            };
                            o += v.iov_len;
                        }
                        Ok(req.len)
                    }
                    IoOp::Write => {
                        let mut data = Vec::with_capacity(len);
                        for v in req.iov {
                            // SAFETY: caller buffers valid per the submit contract.
                            data.extend_from_slice(unsafe {
                                std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len)
                            });
                        }
                        s.current[off..off + len].copy_from_slice(&data);
                        s.pending.push(Pending { off, data });
                        Ok(req.len)
                    }
                    IoOp::Discard | IoOp::WriteZeroes { .. } => {
                        s.current[off..off + len].fill(0);
                        s.pending.push(Pending {
                            off,
                            data: vec![0; len],
                        });
                        Ok(0)
                    }
                    IoOp::Flush => {
                        let st = &mut *s;
                        for p in st.pending.drain(..) {
                            st.durable[p.off..p.off + p.data.len()].copy_from_slice(&p.data);
                        }
                        Ok(0)
                    }
                }
            }
        };
        drop(s);
        self.done.push(Completion {
            token: req.token,
            result,
        });
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BdevError> {
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let n = self.done.len();
        out.append(&mut self.done);
        n
    }

    fn wait(&mut self, _t: Option<Duration>) -> Result<(), BdevError> {
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    fn notify_fd(&self) -> Option<RawFd> {
        None
    }
}

/// Block pattern: 8-byte tag then bytes derived from it; tag 0 is all zeroes.
pub use katablk_test_support::pattern::tagged as pattern;

/// Reads `len` bytes at `off` of a device.
pub fn read(dev: &dyn BlockDevice, off: u64, len: usize) -> Vec<u8> {
    let mut io = SyncIo::new(dev).unwrap();
    let mut b = vec![0u8; len];
    io.read_at(off, &mut b).unwrap();
    b
}

/// Writes at `off` of a device.
pub fn write(dev: &dyn BlockDevice, off: u64, data: &[u8]) {
    let mut io = SyncIo::new(dev).unwrap();
    io.write_at(off, data).unwrap();
}

/// Extra latency of reads on [`AsyncDev`] (each test runs in its own process under nextest;
/// tests that set it must not run with others in one process).
pub static READ_DELAY_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A device whose requests complete later, on another thread, signalled through an eventfd
/// (like an io_uring device).
pub struct AsyncDev {
    pub inner: FaultDev,
}

struct Job {
    op: IoOp,
    offset: u64,
    len: u64,
    iov: Vec<(usize, usize)>,
    token: u64,
}

struct AsyncShared {
    done: Mutex<Vec<Completion>>,
    efd: std::os::fd::OwnedFd,
}

pub struct AsyncChan {
    tx: Option<std::sync::mpsc::Sender<Job>>,
    queued: Vec<Job>,
    shared: Arc<AsyncShared>,
    in_flight: usize,
    depth: usize,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BlockDevice for AsyncDev {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }

    fn open_channel(&self, depth: usize, segs: usize) -> Result<Box<dyn IoChannel>, BdevError> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain system call; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        let shared = Arc::new(AsyncShared {
            done: Mutex::new(Vec::new()),
            // SAFETY: fresh descriptor owned by nobody else.
            efd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
        });
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let mut inner = self.inner.open_channel(depth, segs)?;
        let sh = shared.clone();
        let thread = std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let mut out = Vec::new();
            while let Ok(j) = rx.recv() {
                std::thread::sleep(Duration::from_micros(50));
                let extra = READ_DELAY_US.load(std::sync::atomic::Ordering::SeqCst);
                if j.op == IoOp::Read && extra > 0 {
                    std::thread::sleep(Duration::from_micros(extra));
                }
                let iov: Vec<katablk_bdev::iovec> = j
                    .iov
                    .iter()
                    .map(|&(b, l)| katablk_bdev::iovec {
                        iov_base: b as *mut libc::c_void,
                        iov_len: l,
                    })
                    .collect();
                let req = IoRequest {
                    op: j.op,
                    offset: j.offset,
                    len: j.len,
                    iov: &iov,
                    token: j.token,
                };
                // SAFETY: the submitter keeps the buffers valid until the completion is polled.
                let r = unsafe { inner.submit(&req) };
                out.clear();
                inner.poll(&mut out);
                let c = match r {
                    Ok(()) => out[0],
                    Err(e) => Completion {
                        token: j.token,
                        result: Err(e.into()),
                    },
                };
                sh.done.lock().unwrap().push(c);
                let one: u64 = 1;
                // SAFETY: 8-byte write to our eventfd.
                unsafe { libc::write(sh.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
            }
        });
        Ok(Box::new(AsyncChan {
            tx: Some(tx),
            queued: Vec::new(),
            shared,
            in_flight: 0,
            depth: depth.max(1),
            thread: Some(thread),
        }))
    }

    fn describe(&self) -> String {
        "asyncdev".into()
    }
}

impl IoChannel for AsyncChan {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        if self.in_flight >= self.depth {
            return Err(SubmitError::Full);
        }
        self.in_flight += 1;
        self.queued.push(Job {
            op: req.op,
            offset: req.offset,
            len: req.len,
            iov: req
                .iov
                .iter()
                .map(|v| (v.iov_base as usize, v.iov_len))
                .collect(),
            token: req.token,
        });
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BdevError> {
        for j in self.queued.drain(..) {
            self.tx.as_ref().unwrap().send(j).unwrap();
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let mut d = self.shared.done.lock().unwrap();
        let n = d.len();
        out.append(&mut d);
        self.in_flight -= n;
        n
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), BdevError> {
        use std::os::fd::AsRawFd;
        if !self.shared.done.lock().unwrap().is_empty() || self.in_flight == 0 {
            return Ok(());
        }
        let mut pfd = libc::pollfd {
            fd: self.shared.efd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.map(|t| t.as_millis() as i32).unwrap_or(-1);
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, ms) };
        self.clear_notify();
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn notify_fd(&self) -> Option<RawFd> {
        use std::os::fd::AsRawFd;
        Some(self.shared.efd.as_raw_fd())
    }

    fn clear_notify(&mut self) {
        use std::os::fd::AsRawFd;
        let mut v: u64 = 0;
        // SAFETY: 8-byte read from our non-blocking eventfd.
        unsafe { libc::read(self.shared.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

impl Drop for AsyncChan {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
