//! Helpers shared by the file-device integration tests: aligned buffers, a tiny PRNG, device
//! setup for every mode with and without `O_DIRECT`, and request drivers.

#![allow(dead_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::path::Path;

use katablk_bdev::file::{FileDevice, FileOptions, IoMode};
use katablk_bdev::{iovec, BlockDevice, Completion, IoChannel, IoOp, IoRequest, SubmitError};

/// Every mode a channel can be opened in.
pub const MODES: [IoMode; 4] = [
    IoMode::Inline,
    IoMode::IoUring,
    IoMode::ThreadPool,
    IoMode::Auto,
];

/// A zeroed heap buffer aligned to 4096 bytes (good for `O_DIRECT`).
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        AlignedBuf { ptr, len }
    }

    pub fn filled(len: usize, byte: u8) -> Self {
        let mut b = Self::new(len);
        b.fill(byte);
        b
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A failing test may unwind with requests still in flight on a channel that outlives
            // this buffer: leak it rather than let the kernel write into freed memory.
            return;
        }
        let layout = Layout::from_size_align(self.len.max(1), 4096).unwrap();
        // SAFETY: allocated in `new` with the same layout.
        unsafe { dealloc(self.ptr, layout) };
    }
}

/// xorshift64*: deterministic, dependency-free randomness for the tests.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// A temporary backing file and the device opened on it.
pub struct TestDev {
    pub file: tempfile::NamedTempFile,
    pub dev: FileDevice,
    pub mode: IoMode,
    pub direct: bool,
}

impl TestDev {
    pub fn size(&self) -> u64 {
        self.dev.info().size_bytes()
    }

    pub fn path(&self) -> &Path {
        self.file.path()
    }

    pub fn channel(&self, depth: usize, max_segments: usize) -> Box<dyn IoChannel> {
        self.dev.open_channel(depth, max_segments).unwrap()
    }

    /// Alignment every buffer address and length must have.
    pub fn align(&self) -> usize {
        self.dev.info().buf_align as usize
    }
}

/// Where a test device's file lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// A file in the page cache (the temporary directory), no `O_DIRECT`.
    Buffered,
    /// A file under /var/tmp opened with `O_DIRECT` (tmpfs refuses it).
    Direct,
    /// A file on tmpfs (/dev/shm): the device maps it and copies through the mapping.
    Memory,
}

impl Backing {
    pub fn direct(self) -> bool {
        self == Backing::Direct
    }
}

impl From<bool> for Backing {
    fn from(direct: bool) -> Self {
        if direct {
            Backing::Direct
        } else {
            Backing::Buffered
        }
    }
}

/// Creates a `size`-byte device in `mode`. Returns `None`, after printing why, when the
/// combination cannot run here.
pub fn make_dev(mode: IoMode, backing: impl Into<Backing>, size: u64) -> Option<TestDev> {
    make_dev_opts(mode, backing, size, false)
}

/// Like [`make_dev`], optionally read-only.
pub fn make_dev_opts(
    mode: IoMode,
    backing: impl Into<Backing>,
    size: u64,
    read_only: bool,
) -> Option<TestDev> {
    let backing = backing.into();
    let direct = backing.direct();
    let file = match backing {
        Backing::Direct => tempfile::Builder::new()
            .prefix("katablk-bdev-test")
            .tempfile_in("/var/tmp")
            .unwrap(),
        Backing::Buffered => tempfile::NamedTempFile::new().unwrap(),
        Backing::Memory => {
            let shm = std::path::Path::new("/dev/shm");
            if !shm.is_dir() {
                println!("skipped: no /dev/shm here");
                return None;
            }
            tempfile::Builder::new()
                .prefix("katablk-bdev-test")
                .tempfile_in(shm)
                .unwrap()
        }
    };
    file.as_file().set_len(size).unwrap();
    let opts = FileOptions {
        read_only,
        direct,
        mode,
        ..Default::default()
    };
    let dev = match FileDevice::open(file.path(), &opts) {
        Ok(d) => d,
        Err(e) if direct => {
            println!("skipped: the filesystem under /var/tmp refuses O_DIRECT: {e}");
            return None;
        }
        Err(e) => panic!("open {}: {e}", file.path().display()),
    };
    if mode == IoMode::IoUring {
        if let Err(e) = dev.open_channel(1, 1) {
            println!("skipped: io_uring unavailable here: {e}");
            return None;
        }
    }
    Some(TestDev {
        file,
        dev,
        mode,
        direct,
    })
}

/// Splits `buf` into up to `max` iovecs at random `align`-multiple boundaries.
pub fn split_iov(buf: &mut [u8], max: usize, align: usize, rng: &mut Rng) -> Vec<iovec> {
    let units = buf.len() / align;
    assert_eq!(units * align, buf.len());
    let pieces = (rng.range(1, max as u64) as usize).min(units.max(1));
    let mut cuts: Vec<usize> = (0..pieces - 1)
        .map(|_| rng.range(1, (units.max(2) - 1) as u64) as usize * align)
        .collect();
    cuts.push(0);
    cuts.push(buf.len());
    cuts.sort_unstable();
    cuts.dedup();
    let base = buf.as_mut_ptr();
    cuts.windows(2)
        .map(|w| iovec {
            // `w[0] < buf.len()`: the pointer stays inside the buffer.
            iov_base: base.wrapping_add(w[0]).cast(),
            iov_len: w[1] - w[0],
        })
        .collect()
}

/// One iovec over all of `buf`.
pub fn iov1(buf: &mut [u8]) -> [iovec; 1] {
    [iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }]
}

/// Submits `req` (test-only convenience; the caller keeps the buffers alive until reaped).
pub fn submit(ch: &mut dyn IoChannel, req: &IoRequest<'_>) -> Result<(), SubmitError> {
    // SAFETY: every test keeps its buffers alive and untouched until `drain` has returned the
    // completion or the channel has been dropped.
    unsafe { ch.submit(req) }
}

/// Commits, then waits and polls until nothing is in flight; returns every completion.
pub fn drain(ch: &mut dyn IoChannel) -> Vec<Completion> {
    ch.commit().unwrap();
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while ch.in_flight() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "requests never completed"
        );
        ch.wait(Some(std::time::Duration::from_secs(1))).unwrap();
        ch.clear_notify();
        ch.poll(&mut out);
    }
    out
}

/// Runs one request to completion and returns its result.
pub fn run1(ch: &mut dyn IoChannel, req: &IoRequest<'_>) -> Result<u64, katablk_bdev::IoError> {
    submit(ch, req).unwrap();
    let c = drain(ch);
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].token, req.token);
    c[0].result
}

/// Reads `len` bytes at `off` (one aligned buffer).
pub fn read_at(ch: &mut dyn IoChannel, off: u64, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::filled(len, 0xee);
    let iov = iov1(&mut b);
    let req = IoRequest {
        op: IoOp::Read,
        offset: off,
        len: len as u64,
        iov: &iov,
        token: u64::MAX,
    };
    assert_eq!(run1(ch, &req), Ok(len as u64));
    b
}

/// Writes `data` at `off` (copied into one aligned buffer).
pub fn write_at(ch: &mut dyn IoChannel, off: u64, data: &[u8]) {
    let mut b = AlignedBuf::new(data.len());
    b.copy_from_slice(data);
    let iov = iov1(&mut b);
    let req = IoRequest {
        op: IoOp::Write,
        offset: off,
        len: data.len() as u64,
        iov: &iov,
        token: u64::MAX - 1,
    };
    assert_eq!(run1(ch, &req), Ok(data.len() as u64));
}

/// Runs a data-less request (flush, discard, write-zeroes) to completion.
pub fn no_data(ch: &mut dyn IoChannel, op: IoOp, off: u64, len: u64) {
    let req = IoRequest::no_data(op, off, len, 77);
    assert_eq!(run1(ch, &req), Ok(0), "{op:?} {off}+{len}");
}
