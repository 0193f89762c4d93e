//! SPDK bdevs behind katablk's [`BlockDevice`] trait.
//!
//! [`SpdkBdev::open`] opens a bdev descriptor on the application thread. Each
//! [`BlockDevice::open_channel`] creates a new SPDK thread (scheduled on the application's
//! reactors) that owns an `spdk_io_channel` of the bdev and a poller. The caller's thread (a
//! vhost-user queue worker) fills preallocated request slots with its iovecs — guest memory,
//! passed by address — and hands slot numbers to the SPDK thread through a short queue; the
//! poller submits them with `spdk_bdev_{readv,writev,flush,unmap,write_zeroes}_blocks`, and
//! completion callbacks queue the results back and signal an eventfd. Data is never copied by
//! katablk: the bdev module reads or writes the iovecs directly (AIO by the kernel, NVMe by DMA
//! when the memory is registered, see [`crate::mem`]).
//!
//! This file holds the descriptor and what both channel kinds share (request validation and
//! submission); `channel` is the cross-thread channel above, `local` the one used on the SPDK
//! thread that made it (queue workers polled by a reactor).

use std::ffi::{c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use katablk_bdev::{
    iovec, BdevError, BlockDevice, DeviceInfo, IoChannel, IoOp, IoRequest, SubmitError,
};
use tracing::{debug, warn};

use crate::ffi;
use crate::thread::Thread;
use crate::Error;

mod channel;
mod local;

use channel::SpdkChannel;
use local::LocalChannel;

/// Bdev state changed by SPDK's event callback (resize, hot removal).
#[derive(Debug)]
struct Events {
    num_blocks: AtomicU64,
    removed: AtomicBool,
}

unsafe extern "C" fn bdev_event(
    kind: ffi::spdk_bdev_event_type,
    bdev: *mut ffi::spdk_bdev,
    ctx: *mut c_void,
) {
    // SAFETY: `ctx` is the `Arc<Events>` leaked at open and released only after the
    // descriptor is closed, so no event can arrive after it is freed.
    let ev = unsafe { &*ctx.cast::<Events>() };
    match kind {
        ffi::SPDK_BDEV_EVENT_RESIZE => {
            // SAFETY: SPDK passes the live bdev of the descriptor.
            let n = unsafe { ffi::spdk_bdev_get_num_blocks(bdev) };
            ev.num_blocks.store(n, Ordering::SeqCst);
            debug!(num_blocks = n, "bdev resized");
        }
        ffi::SPDK_BDEV_EVENT_REMOVE => {
            ev.removed.store(true, Ordering::SeqCst);
            warn!("bdev hot-removed: new I/O fails until the device is closed");
        }
        _ => {}
    }
}

/// A raw descriptor pointer that may cross threads (SPDK allows using a descriptor from any
/// thread; only `spdk_bdev_close` must run on the opening thread).
#[derive(Debug, Clone, Copy)]
struct Desc(*mut ffi::spdk_bdev_desc);
// SAFETY: see the type's comment; closing is always sent to the opening thread.
unsafe impl Send for Desc {}
// SAFETY: as above.
unsafe impl Sync for Desc {}

#[derive(Debug)]
struct BdevShared {
    name: String,
    product: String,
    owner: Thread,
    desc: Desc,
    events: *const Events,
    info: DeviceInfo,
    /// The bdev handles FLUSH (lvols do not: they have no cache of their own).
    flush: bool,
    channels: AtomicUsize,
}

// SAFETY: `events` points to an `Events` (atomics only) kept alive until Drop; every other
// field is Send + Sync or a handle used only through thread-safe SPDK calls.
unsafe impl Send for BdevShared {}
// SAFETY: as above.
unsafe impl Sync for BdevShared {}

impl BdevShared {
    fn events(&self) -> &Events {
        // SAFETY: valid until Drop (see the field).
        unsafe { &*self.events }
    }
}

impl Drop for BdevShared {
    fn drop(&mut self) {
        let desc = self.desc;
        let events = self.events as usize;
        let r = self.owner.send(move || {
            let desc = desc;
            // SAFETY: on the opening thread, as spdk_bdev_close requires; after it no event
            // callback refers to `events`, which is then released.
            unsafe {
                ffi::spdk_bdev_close(desc.0);
                drop(Arc::from_raw(events as *const Events));
            }
        });
        if r.is_err() {
            // The framework is gone (the app stopped first): SPDK closed everything.
            debug!(bdev = %self.name, "SPDK stopped before the bdev was closed");
        }
    }
}

/// An SPDK bdev used as a katablk [`BlockDevice`].
#[derive(Debug, Clone)]
pub struct SpdkBdev {
    inner: Arc<BdevShared>,
}

impl SpdkBdev {
    /// Opens bdev `name` (for writing unless `read_only`) on SPDK thread `owner` (normally the
    /// application thread). Call it from a non-SPDK thread.
    pub fn open(owner: Thread, name: &str, read_only: bool) -> Result<SpdkBdev, Error> {
        let cname = CString::new(name).map_err(|_| Error::InvalidName(name.to_string()))?;
        let events = Arc::new(Events {
            num_blocks: AtomicU64::new(0),
            removed: AtomicBool::new(false),
        });
        let ev_ptr = Arc::into_raw(events) as usize;
        let opened = owner.run(
            move || -> Result<(Desc, DeviceInfo, String, String, bool), i32> {
                let mut desc: *mut ffi::spdk_bdev_desc = std::ptr::null_mut();
                // SAFETY: on an SPDK thread; `cname` is a valid C string for the call and the
                // event context stays alive until the descriptor is closed.
                let rc = unsafe {
                    ffi::spdk_bdev_open_ext(
                        cname.as_ptr(),
                        !read_only,
                        Some(bdev_event),
                        ev_ptr as *mut c_void,
                        &mut desc,
                    )
                };
                if rc != 0 {
                    return Err(rc);
                }
                // SAFETY: `desc` is open, so its bdev is live for these queries.
                unsafe {
                    let b = ffi::spdk_bdev_desc_get_bdev(desc);
                    let block_size = ffi::spdk_bdev_get_block_size(b);
                    let num_blocks = ffi::spdk_bdev_get_num_blocks(b);
                    (*(ev_ptr as *const Events))
                        .num_blocks
                        .store(num_blocks, Ordering::SeqCst);
                    let phys = ffi::spdk_bdev_get_physical_block_size(b);
                    let boundary = ffi::spdk_bdev_get_optimal_io_boundary(b);
                    let product = CStr::from_ptr(ffi::spdk_bdev_get_product_name(b))
                        .to_string_lossy()
                        .into_owned();
                    let canonical = CStr::from_ptr(ffi::spdk_bdev_get_name(b))
                        .to_string_lossy()
                        .into_owned();
                    let info = DeviceInfo {
                        block_size,
                        num_blocks,
                        read_only,
                        volatile_cache: ffi::spdk_bdev_has_write_cache(b),
                        discard: ffi::spdk_bdev_io_type_supported(b, ffi::SPDK_BDEV_IO_TYPE_UNMAP),
                        write_zeroes: ffi::spdk_bdev_io_type_supported(
                            b,
                            ffi::SPDK_BDEV_IO_TYPE_WRITE_ZEROES,
                        ),
                        buf_align: ffi::spdk_bdev_get_buf_align(b).max(1) as u32,
                        physical_block_size: if phys == 0 { block_size } else { phys },
                        optimal_io_size: boundary.saturating_mul(block_size),
                    };
                    let flush = ffi::spdk_bdev_io_type_supported(b, ffi::SPDK_BDEV_IO_TYPE_FLUSH);
                    Ok((Desc(desc), info, product, canonical, flush))
                }
            },
        );
        let (desc, info, product, canonical, flush) = match opened {
            Ok(Ok(v)) => v,
            Ok(Err(rc)) => {
                // SAFETY: the open failed, so no event can refer to the context.
                drop(unsafe { Arc::from_raw(ev_ptr as *const Events) });
                return Err(Error::OpenBdev(name.to_string(), rc));
            }
            Err(e) => {
                // SAFETY: the message never ran (or ran and failed before open).
                drop(unsafe { Arc::from_raw(ev_ptr as *const Events) });
                return Err(e);
            }
        };
        Ok(SpdkBdev {
            inner: Arc::new(BdevShared {
                name: canonical,
                product,
                owner,
                desc,
                events: ev_ptr as *const Events,
                info,
                flush,
                channels: AtomicUsize::new(0),
            }),
        })
    }

    /// The bdev's name (SPDK's canonical name: a UUID for lvols opened by alias).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// SPDK's product name of the bdev ("Malloc disk", "AIO disk", "Logical Volume", ...).
    pub fn product(&self) -> &str {
        &self.inner.product
    }

    /// True once SPDK reported the bdev removed.
    pub fn is_removed(&self) -> bool {
        self.inner.events().removed.load(Ordering::SeqCst)
    }
}

impl BlockDevice for SpdkBdev {
    fn info(&self) -> DeviceInfo {
        let mut i = self.inner.info.clone();
        i.num_blocks = self.inner.events().num_blocks.load(Ordering::SeqCst);
        i
    }

    fn open_channel(
        &self,
        depth: usize,
        max_segments: usize,
    ) -> Result<Box<dyn IoChannel>, BdevError> {
        let r = if Thread::current().is_some() {
            // Called on an SPDK thread (a queue worker run by crate::runtime): the channel
            // lives on this thread and submits directly.
            LocalChannel::open(self.inner.clone(), depth, max_segments)
                .map(|c| Box::new(c) as Box<dyn IoChannel>)
        } else {
            SpdkChannel::open(self.inner.clone(), depth, max_segments)
                .map(|c| Box::new(c) as Box<dyn IoChannel>)
        };
        r.map_err(|e| BdevError::Invalid(format!("SPDK channel on {}: {e}", self.inner.name)))
    }

    fn describe(&self) -> String {
        format!("SPDK bdev {} ({})", self.inner.name, self.inner.product)
    }

    fn register_memory(&self, addr: *mut u8, len: usize) {
        crate::mem::register(addr, len);
    }

    fn unregister_memory(&self, addr: *mut u8, len: usize) {
        crate::mem::unregister(addr, len);
    }
}

/// The request part of a slot (both channel kinds).
struct SlotReq {
    op: IoOp,
    offset_blocks: u64,
    num_blocks: u64,
    len: u64,
    iov: Vec<iovec>,
    token: u64,
}

impl SlotReq {
    fn new(max_segments: usize) -> SlotReq {
        SlotReq {
            op: IoOp::Flush,
            offset_blocks: 0,
            num_blocks: 0,
            len: 0,
            iov: Vec::with_capacity(max_segments),
            token: 0,
        }
    }

    /// Takes a validated request (block size `bs`), copying its iovec array.
    fn fill(&mut self, req: &IoRequest<'_>, bs: u64) {
        self.op = req.op;
        self.offset_blocks = req.offset / bs;
        self.num_blocks = req.len / bs;
        self.len = req.len;
        self.token = req.token;
        self.iov.clear();
        self.iov.extend_from_slice(req.iov);
    }
}

/// Checks a request against the bdev before it takes a slot.
fn validate(
    bdev: &BdevShared,
    req: &IoRequest<'_>,
    max_segments: usize,
) -> Result<(), SubmitError> {
    let bs = u64::from(bdev.info.block_size);
    let size = bdev.events().num_blocks.load(Ordering::Relaxed) * bs;
    if req.op.is_write() && bdev.info.read_only {
        return Err(SubmitError::ReadOnly);
    }
    match req.op {
        IoOp::Discard if !bdev.info.discard => return Err(SubmitError::Unsupported),
        IoOp::WriteZeroes { .. } if !bdev.info.write_zeroes => {
            return Err(SubmitError::Unsupported)
        }
        _ => {}
    }
    if req.op != IoOp::Flush {
        if req.offset % bs != 0 || req.len % bs != 0 {
            return Err(SubmitError::Misaligned {
                offset: req.offset,
                len: req.len,
            });
        }
        match req.offset.checked_add(req.len) {
            Some(end) if end <= size => {}
            _ => {
                return Err(SubmitError::OutOfRange {
                    offset: req.offset,
                    len: req.len,
                    size,
                })
            }
        }
    }
    if matches!(req.op, IoOp::Read | IoOp::Write) {
        let total: u64 = req.iov.iter().map(|v| v.iov_len as u64).sum();
        if req.iov.is_empty() || req.iov.len() > max_segments || total != req.len {
            return Err(SubmitError::BadBuffers);
        }
    }
    Ok(())
}

/// Submits one request on the current SPDK thread; the raw return code of SPDK's call.
///
/// # Safety
/// On the SPDK thread that owns `io_ch`; `slot.r.iov` and the buffers it points to, and `arg`,
/// stay valid until `cb` runs.
#[allow(clippy::too_many_arguments)]
unsafe fn submit_raw(
    desc: *mut ffi::spdk_bdev_desc,
    io_ch: *mut ffi::spdk_io_channel,
    op: IoOp,
    iov: &mut [iovec],
    offset_blocks: u64,
    num_blocks: u64,
    cb: ffi::spdk_bdev_io_completion_cb,
    arg: *mut c_void,
) -> i32 {
    // SAFETY: per the function's contract.
    unsafe {
        match op {
            IoOp::Read | IoOp::Write => {
                let f = if op == IoOp::Read {
                    ffi::spdk_bdev_readv_blocks
                } else {
                    ffi::spdk_bdev_writev_blocks
                };
                f(
                    desc,
                    io_ch,
                    iov.as_mut_ptr().cast(),
                    iov.len() as i32,
                    offset_blocks,
                    num_blocks,
                    cb,
                    arg,
                )
            }
            IoOp::Flush => {
                let n = ffi::spdk_bdev_get_num_blocks(ffi::spdk_bdev_desc_get_bdev(desc));
                ffi::spdk_bdev_flush_blocks(desc, io_ch, 0, n, cb, arg)
            }
            IoOp::Discard => {
                ffi::spdk_bdev_unmap_blocks(desc, io_ch, offset_blocks, num_blocks, cb, arg)
            }
            IoOp::WriteZeroes { .. } => {
                ffi::spdk_bdev_write_zeroes_blocks(desc, io_ch, offset_blocks, num_blocks, cb, arg)
            }
        }
    }
}
