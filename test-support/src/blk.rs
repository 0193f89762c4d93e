//! The libblkio vhost-user-blk client the tests drive every server with (`katablk-vhost`,
//! `katablk-target`, SPDK's `vhost`, `katablk-spdk`, `qemu-storage-daemon`).
//!
//! One memory region serves as the I/O buffer: requests copy their data through its start.
//! It is libblkio's own memory, or ([`Buffer::Aligned`]) a 2 MiB-aligned hugepage memfd, which
//! SPDK's vhost target needs (see [`katablk_bdev::shm`]). Every wait for a completion gives up
//! after [`REQUEST_TIMEOUT`].

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use katablk_bdev::shm::SharedRegion;

/// How long a request may take before the test fails (or [`Client::try_wait1`] gives up).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The buffer size of [`Options::default`]: room for 64 KiB slots of 64 requests, or 2 MiB
/// for each of four queues.
pub const DEFAULT_BUFFER: usize = 8 << 20;

/// Where a client's I/O buffer comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffer {
    /// libblkio's own memory, this many bytes.
    Libblkio(usize),
    /// At least this many bytes (a multiple of 2 MiB) of 2 MiB-aligned memory on hugepages
    /// when the kernel has free ones, as SPDK's vhost target needs; libblkio's own otherwise.
    Aligned(usize),
}

/// How [`Client::connect_with`] sets the client up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Queues to start.
    pub num_queues: i32,
    /// Entries per queue.
    pub queue_size: i32,
    /// Ask for a read-only device.
    pub read_only: bool,
    /// The I/O buffer.
    pub buffer: Buffer,
}

impl Default for Options {
    /// One queue of 256, read-write, an 8 MiB libblkio buffer.
    fn default() -> Options {
        Options {
            num_queues: 1,
            queue_size: 256,
            read_only: false,
            buffer: Buffer::Libblkio(DEFAULT_BUFFER),
        }
    }
}

/// A started libblkio `virtio-blk-vhost-user` client with one mapped memory region.
pub struct Client {
    /// The libblkio instance.
    pub blkio: Blkio,
    /// Its started queues, by index.
    pub queues: Vec<Blkioq>,
    /// The I/O buffer, mapped.
    pub region: MemoryRegion,
    /// The device's size in bytes.
    pub capacity: u64,
    /// Backs `region` when it is ours; declared after `blkio` so it outlives the mapping.
    shm: Option<SharedRegion>,
}

/// An I/O buffer for a connected client, not yet mapped, and the memory behind it when it is
/// not libblkio's.
fn buffer(
    b: &mut Blkio,
    buf: Buffer,
) -> Result<(MemoryRegion, Option<SharedRegion>), blkio::Error> {
    match buf {
        Buffer::Libblkio(len) => Ok((b.alloc_mem_region(len)?, None)),
        Buffer::Aligned(len) => match SharedRegion::new(len) {
            Ok(r) if r.is_hugepages() => Ok((
                MemoryRegion {
                    addr: r.addr() as usize,
                    iova: r.addr() as u64,
                    len: r.len(),
                    fd: r.fd(),
                    fd_offset: 0,
                    flags: 0,
                },
                Some(r),
            )),
            _ => Ok((b.alloc_mem_region(len)?, None)),
        },
    }
}

impl Client {
    /// Connects to `socket` with `num_queues` queues of 256 and an 8 MiB libblkio buffer.
    pub fn connect(
        socket: &Path,
        num_queues: i32,
        read_only: bool,
    ) -> Result<Client, blkio::Error> {
        Self::connect_with(
            socket,
            &Options {
                num_queues,
                read_only,
                ..Options::default()
            },
        )
    }

    /// Connects to `socket` as `opts` says.
    pub fn connect_with(socket: &Path, opts: &Options) -> Result<Client, blkio::Error> {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", socket.to_str().expect("socket path is UTF-8"))?;
        b.set_bool("read-only", opts.read_only)?;
        b.connect()?;
        b.set_i32("num-queues", opts.num_queues)?;
        b.set_i32("queue-size", opts.queue_size)?;
        let out = b.start()?;
        let capacity = b.get_u64("capacity")?;
        let (region, shm) = buffer(&mut b, opts.buffer)?;
        b.map_mem_region(&region)?;
        Ok(Client {
            blkio: b,
            queues: out.queues,
            region,
            capacity,
            shm,
        })
    }

    /// The start of the I/O buffer.
    pub fn buf(&self) -> *mut u8 {
        self.region.addr as *mut u8
    }

    /// True when the buffer is 2 MiB-aligned hugepage memory (see [`Buffer::Aligned`]).
    pub fn hugepage_buffer(&self) -> bool {
        self.shm.is_some()
    }

    /// Waits for one request on queue `q`: its `ret`, or `None` when libblkio failed or nothing
    /// completed within [`REQUEST_TIMEOUT`].
    pub fn try_wait1(&mut self, q: usize) -> Option<i32> {
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let mut t = REQUEST_TIMEOUT;
        let n = self.queues[q].do_io(&mut c, 1, Some(&mut t), None).ok()?;
        // SAFETY: do_io initialised the first `n` completions, and `n` is 1 here.
        (n == 1).then(|| unsafe { c[0].assume_init_ref() }.ret)
    }

    /// Waits for one request on queue `q` and returns its `ret`; panics when it did not
    /// complete within [`REQUEST_TIMEOUT`].
    pub fn wait1(&mut self, q: usize) -> i32 {
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let mut t = REQUEST_TIMEOUT;
        let n = self.queues[q]
            .do_io(&mut c, 1, Some(&mut t), None)
            .expect("libblkio do_io");
        assert_eq!(n, 1, "request timed out");
        // SAFETY: do_io initialised one completion.
        unsafe { c[0].assume_init_ref() }.ret
    }

    /// Writes `data` (at most the buffer's size) at `off` through queue `q`; returns `ret`.
    pub fn write(&mut self, q: usize, off: u64, data: &[u8]) -> i32 {
        assert!(
            data.len() <= self.region.len,
            "write larger than the buffer"
        );
        let buf = self.buf();
        // SAFETY: the region is mapped, ours and at least `data.len()` bytes long.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, data.len()) };
        self.queues[q].write(off, buf, data.len(), 0, ReqFlags::empty());
        self.wait1(q)
    }

    /// Reads `len` bytes (at most the buffer's size) at `off` through queue `q`; `Err(ret)`
    /// when the request failed.
    pub fn read(&mut self, q: usize, off: u64, len: usize) -> Result<Vec<u8>, i32> {
        assert!(len <= self.region.len, "read larger than the buffer");
        let buf = self.buf();
        self.queues[q].read(off, buf, len, 0, ReqFlags::empty());
        let r = self.wait1(q);
        if r != 0 {
            return Err(r);
        }
        let mut v = vec![0u8; len];
        // SAFETY: the region holds the `len` bytes just read.
        unsafe { std::ptr::copy_nonoverlapping(buf, v.as_mut_ptr(), len) };
        Ok(v)
    }

    /// Reads like [`Client::read`] and panics when the request fails.
    pub fn read_ok(&mut self, q: usize, off: u64, len: usize) -> Vec<u8> {
        self.read(q, off, len)
            .unwrap_or_else(|r| panic!("read {len}@{off} on queue {q} failed: {r}"))
    }

    /// Flushes through queue `q`; returns `ret`.
    pub fn flush(&mut self, q: usize) -> i32 {
        self.queues[q].flush(0, ReqFlags::empty());
        self.wait1(q)
    }

    /// Discards `len` bytes at `off` through queue `q`; returns `ret`.
    pub fn discard(&mut self, q: usize, off: u64, len: u64) -> i32 {
        self.queues[q].discard(off, len, 0, ReqFlags::empty());
        self.wait1(q)
    }

    /// Writes `len` zero bytes at `off` through queue `q`, letting the device unmap them if
    /// `unmap`; returns `ret`.
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
