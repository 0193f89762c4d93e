//! The volume I/O channel: asynchronous cluster allocation, deep queues, scatter-gather,
//! concurrent channels and snapshots under I/O.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use katablk_bdev::sync::SyncIo;
use katablk_bdev::{
    iovec, BdevError, BlockDevice, Completion, DeviceInfo, IoChannel, IoOp, IoRequest, SubmitError,
};
use katablk_lvol::{LvStore, LvsOptions};

const CS: u64 = 64 << 10;

fn store(dev: Arc<dyn BlockDevice>) -> LvStore {
    let mut o = LvsOptions::new("lvs0");
    o.cluster_size = CS as u32;
    LvStore::create(dev, o).unwrap()
}

/// A device whose flushes take `delay` while `slow` is set.
struct SlowFlush {
    inner: FaultDev,
    slow: Arc<AtomicBool>,
    delay: Duration,
}

struct SlowChan {
    inner: Box<dyn IoChannel>,
    slow: Arc<AtomicBool>,
    delay: Duration,
}

impl BlockDevice for SlowFlush {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn open_channel(&self, d: usize, s: usize) -> Result<Box<dyn IoChannel>, BdevError> {
        Ok(Box::new(SlowChan {
            inner: self.inner.open_channel(d, s)?,
            slow: self.slow.clone(),
            delay: self.delay,
        }))
    }
    fn describe(&self) -> String {
        "slowflush".into()
    }
}

impl IoChannel for SlowChan {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        if req.op == IoOp::Flush && self.slow.load(Ordering::SeqCst) {
            std::thread::sleep(self.delay);
        }
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.inner.submit(req) }
    }
    fn commit(&mut self) -> Result<(), BdevError> {
        self.inner.commit()
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        self.inner.poll(out)
    }
    fn wait(&mut self, t: Option<Duration>) -> Result<(), BdevError> {
        self.inner.wait(t)
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn notify_fd(&self) -> Option<RawFd> {
        self.inner.notify_fd()
    }
}

fn iov(b: &[u8]) -> iovec {
    iovec {
        iov_base: b.as_ptr().cast_mut().cast(),
        iov_len: b.len(),
    }
}

fn iov_mut(b: &mut [u8]) -> iovec {
    iovec {
        iov_base: b.as_mut_ptr().cast(),
        iov_len: b.len(),
    }
}

fn drain(ch: &mut dyn IoChannel, want: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < want {
        ch.poll(&mut out);
        if out.len() < want {
            ch.wait(Some(Duration::from_millis(50))).unwrap();
        }
        assert!(start.elapsed() < Duration::from_secs(20), "timeout");
    }
    out
}

#[test]
fn first_write_does_not_block_other_io() {
    let slow = Arc::new(AtomicBool::new(false));
    let dev: Arc<dyn BlockDevice> = Arc::new(SlowFlush {
        inner: FaultDev::new(8 << 20),
        slow: slow.clone(),
        delay: Duration::from_millis(300),
    });
    let lvs = store(dev);
    let v = lvs.create_lvol("thin", 4 * CS, true).unwrap();
    write(&*v, 0, &pattern(1, 4096)); // cluster 0 allocated
    slow.store(true, Ordering::SeqCst);
    let mut ch = v.open_channel(8, 4).unwrap();
    assert!(ch.notify_fd().is_some());
    let a = pattern(2, 4096);
    let b = pattern(3, 4096);
    let t0 = Instant::now();
    let ia = [iov(&a)];
    let ib = [iov(&b)];
    // SAFETY: the buffers outlive the completions, which are drained below.
    unsafe {
        ch.submit(&IoRequest {
            op: IoOp::Write,
            offset: 2 * CS,
            len: 4096,
            iov: &ia,
            token: 1,
        })
        .unwrap();
        ch.submit(&IoRequest {
            op: IoOp::Write,
            offset: 8192,
            len: 4096,
            iov: &ib,
            token: 2,
        })
        .unwrap();
    }
    ch.commit().unwrap();
    let first = drain(&mut *ch, 1);
    assert_eq!(first[0].token, 2, "write to an allocated cluster waited");
    assert!(t0.elapsed() < Duration::from_millis(250));
    let second = drain(&mut *ch, 1);
    assert_eq!(second[0].token, 1);
    assert_eq!(second[0].result, Ok(4096));
    assert!(t0.elapsed() >= Duration::from_millis(300));
    slow.store(false, Ordering::SeqCst);
    drop(ch);
    assert_eq!(read(&*v, 2 * CS, 4096), a);
    assert_eq!(read(&*v, 8192, 4096), b);
}

#[test]
fn deep_queue_scatter_gather() {
    let dev = FaultDev::new(16 << 20);
    let lvs = store(dev.arc());
    let v = lvs.create_lvol("thin", 16 * CS, true).unwrap();
    let depth = 32;
    let mut ch = v.open_channel(depth, 8).unwrap();
    // 32 writes of 24 KiB in 3 segments each, at offsets that straddle cluster boundaries.
    let bufs: Vec<Vec<u8>> = (0..depth)
        .map(|i| pattern(100 + i as u64, 24 << 10))
        .collect();
    let offs: Vec<u64> = (0..depth as u64).map(|i| (i * 30) << 10).collect();
    let iovs: Vec<[iovec; 3]> = bufs
        .iter()
        .map(|b| [iov(&b[..4096]), iov(&b[4096..20480]), iov(&b[20480..])])
        .collect();
    for i in 0..depth {
        // SAFETY: buffers outlive the drain below.
        unsafe {
            ch.submit(&IoRequest {
                op: IoOp::Write,
                offset: offs[i],
                len: 24 << 10,
                iov: &iovs[i],
                token: i as u64,
            })
            .unwrap()
        };
    }
    // SAFETY: no buffers.
    let full = unsafe { ch.submit(&IoRequest::no_data(IoOp::Flush, 0, 0, 99)) };
    assert_eq!(full, Err(SubmitError::Full));
    ch.commit().unwrap();
    let done = drain(&mut *ch, depth);
    assert!(done.iter().all(|c| c.result == Ok(24 << 10)), "{done:?}");
    // Read back with split buffers through the same channel.
    let mut back: Vec<Vec<u8>> = (0..depth).map(|_| vec![0u8; 24 << 10]).collect();
    let riovs: Vec<[iovec; 2]> = back
        .iter_mut()
        .map(|b| {
            let (x, y) = b.split_at_mut(10 << 10);
            [iov_mut(x), iov_mut(y)]
        })
        .collect();
    for i in 0..depth {
        // SAFETY: buffers outlive the drain below and are not touched until then.
        unsafe {
            ch.submit(&IoRequest {
                op: IoOp::Read,
                offset: offs[i],
                len: 24 << 10,
                iov: &riovs[i],
                token: i as u64,
            })
            .unwrap()
        };
    }
    ch.commit().unwrap();
    drain(&mut *ch, depth);
    drop(ch);
    // Overlapping writes: later offsets overwrite the tail of earlier ones (6 KiB overlap is
    // not possible with 30 KiB strides and 24 KiB lengths, so every buffer reads back whole).
    for i in 0..depth {
        assert_eq!(back[i], bufs[i], "request {i}");
    }
    // Write-zeroes and discard through the channel.
    let mut io = SyncIo::new(&*v).unwrap();
    io.write_zeroes(4096, 8192, false).unwrap();
    io.discard(10 * CS, CS).unwrap();
    io.flush().unwrap();
    let mut b = vec![1u8; 8192];
    io.read_at(4096, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0));
    // One request spanning many clusters on a depth-1 channel: the pieces overflow the
    // backing channel and are retried.
    let t = lvs.create_lvol("thick", 12 * CS, false).unwrap();
    let big = pattern(4242, 11 * CS as usize);
    write(&*t, 512, &big);
    assert_eq!(read(&*t, 512, big.len()), big);
    // Out of range and misaligned requests are refused.
    let mut small = vec![0u8; 512];
    assert!(io.read_at(16 * CS, &mut small).is_err());
    assert!(io.read_at(100, &mut small).is_err());
}

#[test]
fn concurrent_channels_same_clusters() {
    let dev = FaultDev::new(16 << 20);
    let lvs = Arc::new(store(dev.arc()));
    let v = lvs.create_lvol("thin", 8 * CS, true).unwrap();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let v = v.clone();
            std::thread::spawn(move || {
                let mut io = SyncIo::new(&*v).unwrap();
                // Thread t writes block t of every 4-block group: all threads race to
                // allocate the same clusters.
                for blk in (t as usize..8 * 16).step_by(4) {
                    io.write_at((blk * 4096) as u64, &pattern(1000 + blk as u64, 4096))
                        .unwrap();
                }
                io.flush().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(lvs.lvol_info("thin").unwrap().num_allocated_clusters, 8);
    for blk in 0..8 * 16 {
        assert_eq!(
            read(&*v, (blk * 4096) as u64, 4096),
            pattern(1000 + blk as u64, 4096),
            "block {blk}"
        );
    }
    drop(v);
    let lvs = Arc::into_inner(lvs).unwrap();
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    let v = lvs.lvol("thin").unwrap();
    for blk in 0..8 * 16 {
        assert_eq!(
            read(&*v, (blk * 4096) as u64, 4096),
            pattern(1000 + blk as u64, 4096)
        );
    }
}

#[test]
fn snapshot_and_delete_under_io() {
    let dev = FaultDev::new(16 << 20);
    let lvs = Arc::new(store(dev.arc()));
    let v = lvs.create_lvol("vol", 8 * CS, true).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let last = Arc::new(AtomicU64::new(0));
    let writer = {
        let (v, stop, last) = (v.clone(), stop.clone(), last.clone());
        std::thread::spawn(move || {
            let mut io = SyncIo::new(&*v).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let blk = (n * 7) % 128;
                io.write_at(blk * 4096, &pattern(n, 4096)).unwrap();
                last.store(n, Ordering::SeqCst);
            }
            n
        })
    };
    let mut snaps = Vec::new();
    for i in 0..5 {
        std::thread::sleep(Duration::from_millis(20));
        let name = format!("snap{i}");
        lvs.snapshot("vol", &name).unwrap();
        snaps.push(name);
    }
    // Merge every snapshot back while the writer runs.
    for s in snaps.iter().rev() {
        lvs.delete(s).unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let n = writer.join().unwrap();
    assert!(n > 5);
    // The newest write of each block is what the volume holds.
    let mut want = vec![0u64; 128];
    for k in 1..=n {
        want[((k * 7) % 128) as usize] = k;
    }
    for (blk, &t) in want.iter().enumerate() {
        assert_eq!(
            read(&*v, blk as u64 * 4096, 4096),
            pattern(t, 4096),
            "block {blk}"
        );
    }
    assert_eq!(lvs.list().len(), 1);
}

#[test]
fn asynchronous_backing_device() {
    let dev: Arc<dyn BlockDevice> = Arc::new(AsyncDev {
        inner: FaultDev::new(8 << 20),
    });
    let lvs = store(dev.clone());
    let v = lvs.create_lvol("thin", 8 * CS, true).unwrap();
    let mut ch = v.open_channel(16, 4).unwrap();
    let fd = ch.notify_fd().unwrap();
    let bufs: Vec<Vec<u8>> = (0..16).map(|i| pattern(500 + i, 8192)).collect();
    let iovs: Vec<[iovec; 1]> = bufs.iter().map(|b| [iov(b)]).collect();
    for (i, io) in iovs.iter().enumerate() {
        // SAFETY: buffers outlive the completions drained below.
        unsafe {
            ch.submit(&IoRequest {
                op: IoOp::Write,
                offset: (i as u64 * 30) << 10,
                len: 8192,
                iov: io,
                token: i as u64,
            })
            .unwrap()
        };
    }
    ch.commit().unwrap();
    // Drive the channel the way a vhost worker does: block on the notify fd, clear, poll.
    let mut done = Vec::new();
    let start = Instant::now();
    while done.len() < 16 {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, 100) };
        ch.clear_notify();
        ch.poll(&mut done);
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "stuck: {}",
            done.len()
        );
    }
    assert!(done.iter().all(|c| c.result == Ok(8192)));
    assert_eq!(ch.in_flight(), 0);
    drop(ch);
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(&read(&*v, (i as u64 * 30) << 10, 8192), b);
    }
    // SyncIo (poll + wait) on the same kind of device, thick and thin, with a snapshot.
    let mut io = SyncIo::new(&*v).unwrap();
    io.write_at(7 * CS, &pattern(9, 4096)).unwrap();
    io.flush().unwrap();
    drop(io);
    lvs.snapshot("thin", "s").unwrap();
    write(&*v, 7 * CS + 4096, &pattern(10, 4096));
    assert_eq!(read(&*v, 7 * CS, 4096), pattern(9, 4096));
    assert_eq!(read(&*v, 7 * CS + 4096, 4096), pattern(10, 4096));
}

#[test]
fn concurrent_admin_operations() {
    let dev = FaultDev::new(32 << 20);
    let lvs = Arc::new(store(dev.arc()));
    for i in 0..4 {
        lvs.create_lvol(&format!("v{i}"), 4 * CS, i % 2 == 0)
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for t in 0..4u64 {
        let (lvs, stop) = (lvs.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let name = format!("v{t}");
                match n % 6 {
                    0 => {
                        let _ = lvs.snapshot(&name, &format!("s{t}-{n}"));
                    }
                    1 => {
                        // Delete the snapshot just taken (merge), if any.
                        if let Some(s) = lvs
                            .list()
                            .into_iter()
                            .find(|l| l.name.starts_with(&format!("s{t}-")))
                        {
                            lvs.delete(&s.name).unwrap();
                        }
                    }
                    2 => lvs.resize(&name, (2 + n % 4) * CS).unwrap(),
                    _ => {
                        let v = lvs.lvol(&name).unwrap();
                        let size = v.size_bytes();
                        let mut io = SyncIo::new(&*v).unwrap();
                        let off = (n * 4096 * 5) % size;
                        // The size may shrink under us: refusals are fine, corruption is not.
                        let _ = io.write_at(off, &pattern(n, 4096));
                    }
                }
            }
        }));
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let before: Vec<_> = lvs.list();
    let info = lvs.info();
    let alloc: u64 = before.iter().map(|l| l.num_allocated_clusters).sum();
    assert_eq!(alloc + info.free_clusters, info.total_data_clusters);
    let lvs = Arc::into_inner(lvs).unwrap();
    drop(lvs);
    let lvs = LvStore::open(dev.arc()).unwrap();
    assert_eq!(lvs.list(), before);
}
