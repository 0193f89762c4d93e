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

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::ffi::{c_void, CStr, CString};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use katablk_bdev::{
    iovec, BdevError, BlockDevice, Completion, DeviceInfo, IoChannel, IoError, IoOp, IoRequest,
    SubmitError,
};
use tracing::{debug, warn};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::ffi;
use crate::thread::{exit_current, Poller, Thread};
use crate::Error;

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

/// One request's state. Owned by the caller's thread while free or being filled, by the SPDK
/// thread from the moment its index is queued until its completion is queued back.
struct Slot {
    r: SlotReq,
    index: u32,
    chan: *const ChanShared,
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

struct ChanShared {
    slots: Box<[UnsafeCell<Slot>]>,
    submit: Mutex<Vec<u32>>,
    done: Mutex<Vec<(u32, Result<u64, IoError>)>>,
    /// Completions were queued since the poller last signalled.
    pending_signal: AtomicBool,
    efd: EventFd,
    closing: AtomicBool,
    bdev: Arc<BdevShared>,
}

// SAFETY: a slot is accessed by one thread at a time, handed over through the `submit` and
// `done` mutexes (which order the accesses); the rest is Send + Sync.
unsafe impl Send for ChanShared {}
// SAFETY: as above.
unsafe impl Sync for ChanShared {}

impl ChanShared {
    fn complete(&self, index: u32, r: Result<u64, IoError>) {
        if let Ok(mut d) = self.done.lock() {
            d.push((index, r));
        }
        self.pending_signal.store(true, Ordering::Release);
    }
}

/// State of the channel's SPDK thread (lives in the poller's closure).
struct SpdkSide {
    shared: Arc<ChanShared>,
    io_ch: *mut ffi::spdk_io_channel,
    batch: Vec<u32>,
    retry: VecDeque<u32>,
    stopped: Option<mpsc::SyncSender<()>>,
}

unsafe extern "C" fn io_done(bdev_io: *mut ffi::spdk_bdev_io, success: bool, arg: *mut c_void) {
    // SAFETY: SPDK passes back the bdev_io it gave us; it is freed exactly once here.
    unsafe { ffi::spdk_bdev_free_io(bdev_io) };
    // SAFETY: `arg` is the slot submitted by the poller, owned by the SPDK side until its
    // completion is queued; its `chan` outlives every request in flight (the channel waits for
    // them before it is torn down).
    let slot = unsafe { &*arg.cast::<Slot>() };
    // SAFETY: as above.
    let chan = unsafe { &*slot.chan };
    let r = if success {
        Ok(match slot.r.op {
            IoOp::Read | IoOp::Write => slot.r.len,
            _ => 0,
        })
    } else {
        Err(IoError::Errno(libc::EIO))
    };
    chan.complete(slot.index, r);
    // The poller counts completions through the done queue (see SpdkSide::poll).
}

impl SpdkSide {
    /// Submits slot `i`; Ok(false) when SPDK is out of bdev_io (retry later).
    fn submit_one(&mut self, i: u32) -> bool {
        let shared = &*self.shared;
        let slot_cell = &shared.slots[i as usize];
        // SAFETY: the slot index came through the submit queue, so the SPDK side owns it.
        let slot = unsafe { &mut *slot_cell.get() };
        if shared.bdev.events().removed.load(Ordering::SeqCst) {
            shared.complete(i, Err(IoError::Errno(libc::ENODEV)));
            return true;
        }
        let desc = shared.bdev.desc.0;
        let arg = (slot as *mut Slot).cast::<c_void>();
        // SAFETY: on the channel's SPDK thread, with its io channel; the iovec array and the
        // buffers it points to stay valid until io_done runs (the slot is not reused before its
        // completion is reaped, and the caller keeps the buffers alive per IoChannel::submit).
        let rc = unsafe {
            submit_raw(
                desc,
                self.io_ch,
                slot.r.op,
                &mut slot.r.iov,
                slot.r.offset_blocks,
                slot.r.num_blocks,
                Some(io_done),
                arg,
            )
        };
        match rc {
            0 => true,
            rc if rc == -libc::ENOMEM => false,
            rc => {
                shared.complete(i, Err(IoError::Errno(-rc)));
                true
            }
        }
    }

    fn poll(&mut self) -> bool {
        let mut busy = false;
        while let Some(&i) = self.retry.front() {
            if !self.submit_one(i) {
                break;
            }
            self.retry.pop_front();
            busy = true;
        }
        if let Ok(mut q) = self.shared.submit.lock() {
            std::mem::swap(&mut *q, &mut self.batch);
        }
        let mut batch = std::mem::take(&mut self.batch);
        for &i in &batch {
            busy = true;
            if !self.retry.is_empty() || !self.submit_one(i) {
                self.retry.push_back(i);
            }
        }
        batch.clear();
        self.batch = batch;
        if self.shared.pending_signal.swap(false, Ordering::AcqRel) {
            let _ = self.shared.efd.write(1);
            busy = true;
        }
        busy
    }
}

/// The caller-side half of a channel.
struct SpdkChannel {
    shared: Arc<ChanShared>,
    thread: Thread,
    free: Vec<u32>,
    staged: Vec<u32>,
    reaped: Vec<(u32, Result<u64, IoError>)>,
    in_flight: usize,
    max_segments: usize,
    stopped: Option<mpsc::Receiver<()>>,
    /// Requests completed without reaching SPDK (a flush of a bdev without FLUSH).
    immediate: Vec<Completion>,
}

impl SpdkChannel {
    fn open(bdev: Arc<BdevShared>, depth: usize, max_segments: usize) -> Result<Self, Error> {
        if depth == 0 || depth > 65536 || max_segments == 0 {
            return Err(Error::InvalidName(format!(
                "depth {depth} / segments {max_segments}"
            )));
        }
        let efd = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::Io("eventfd", e))?;
        let n = bdev.channels.fetch_add(1, Ordering::Relaxed);
        let name = format!("katablk_{}_{n}", bdev.name);
        let owner = bdev.owner;
        let mut slots = Vec::with_capacity(depth);
        for i in 0..depth {
            slots.push(UnsafeCell::new(Slot {
                r: SlotReq::new(max_segments),
                index: i as u32,
                chan: std::ptr::null(),
            }));
        }
        let shared = Arc::new(ChanShared {
            slots: slots.into_boxed_slice(),
            submit: Mutex::new(Vec::with_capacity(depth)),
            done: Mutex::new(Vec::with_capacity(depth)),
            pending_signal: AtomicBool::new(false),
            efd,
            closing: AtomicBool::new(false),
            bdev,
        });
        let self_ptr = Arc::as_ptr(&shared);
        for s in shared.slots.iter() {
            // SAFETY: no other thread knows the slots yet.
            unsafe { (*s.get()).chan = self_ptr };
        }
        let (stop_tx, stop_rx) = mpsc::sync_channel(1);
        let sh = shared.clone();
        // Create the channel's thread from the owner thread, then set it up on itself.
        let thread = owner.run(move || Thread::create(&name))??;
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<(), Error>>(1);
        thread.send(move || {
            let r = start_channel_thread(sh, stop_tx);
            let _ = ready_tx.send(r);
        })?;
        ready_rx.recv().map_err(|_| Error::Stopped)??;
        Ok(SpdkChannel {
            shared,
            thread,
            free: (0..depth as u32).rev().collect(),
            staged: Vec::with_capacity(depth),
            reaped: Vec::with_capacity(depth),
            in_flight: 0,
            max_segments,
            stopped: Some(stop_rx),
            immediate: Vec::new(),
        })
    }
}

fn start_channel_thread(
    shared: Arc<ChanShared>,
    stopped: mpsc::SyncSender<()>,
) -> Result<(), Error> {
    // SAFETY: on the channel's own SPDK thread; the descriptor is open.
    let io_ch = unsafe { ffi::spdk_bdev_get_io_channel(shared.bdev.desc.0) };
    if io_ch.is_null() {
        exit_current()?;
        return Err(Error::Call("spdk_bdev_get_io_channel", -libc::ENOMEM));
    }
    let side = std::rc::Rc::new(std::cell::RefCell::new(SpdkSide {
        shared,
        io_ch,
        batch: Vec::new(),
        retry: VecDeque::new(),
        stopped: Some(stopped),
    }));
    let holder: std::rc::Rc<std::cell::RefCell<Option<Poller>>> = Default::default();
    let (s2, h2) = (side.clone(), holder.clone());
    let poller = Poller::register(
        move || {
            let mut s = s2.borrow_mut();
            let busy = s.poll();
            if s.shared.closing.load(Ordering::Acquire) && s.retry.is_empty() {
                // `closing` is set only after the caller reaped every completion, so nothing
                // is in flight. Tear down outside the poller callback: a message runs after it
                // returns.
                let (h3, s3) = (h2.clone(), s2.clone());
                let _ = crate::thread::send_to_current(move || teardown(&s3, &h3));
            }
            busy
        },
        0,
    );
    match poller {
        Ok(p) => {
            *holder.borrow_mut() = Some(p);
            Ok(())
        }
        Err(e) => {
            // SAFETY: on the thread that got the channel.
            unsafe { ffi::spdk_put_io_channel(io_ch) };
            exit_current()?;
            Err(e)
        }
    }
}

fn teardown(
    side: &std::rc::Rc<std::cell::RefCell<SpdkSide>>,
    holder: &std::rc::Rc<std::cell::RefCell<Option<Poller>>>,
) {
    let Some(p) = holder.borrow_mut().take() else {
        return;
    };
    drop(p);
    let mut s = side.borrow_mut();
    // SAFETY: on the thread that got the channel; nothing is in flight.
    unsafe { ffi::spdk_put_io_channel(s.io_ch) };
    s.io_ch = std::ptr::null_mut();
    if let Err(e) = exit_current() {
        warn!("SPDK channel thread exit: {e}");
    }
    if let Some(tx) = s.stopped.take() {
        let _ = tx.send(());
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

impl IoChannel for SpdkChannel {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        validate(&self.shared.bdev, req, self.max_segments)?;
        let bs = u64::from(self.shared.bdev.info.block_size);
        if self.in_flight >= self.shared.slots.len() {
            return Err(SubmitError::Full);
        }
        if req.op == IoOp::Flush && !self.shared.bdev.flush {
            // Nothing below SPDK's bdev caches writes (an lvol forwards to its base bdev with
            // the same durability): the flush is complete.
            self.immediate.push(Completion {
                token: req.token,
                result: Ok(0),
            });
            self.in_flight += 1;
            return Ok(());
        }
        let Some(i) = self.free.pop() else {
            return Err(SubmitError::Full);
        };
        // SAFETY: a free slot belongs to this (caller-side) thread.
        let slot = unsafe { &mut *self.shared.slots[i as usize].get() };
        slot.r.fill(req, bs);
        self.staged.push(i);
        self.in_flight += 1;
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BdevError> {
        if self.staged.is_empty() {
            return Ok(());
        }
        let mut q = self
            .shared
            .submit
            .lock()
            .map_err(|_| BdevError::Invalid("SPDK channel poisoned".into()))?;
        q.append(&mut self.staged);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        if let Ok(mut d) = self.shared.done.lock() {
            std::mem::swap(&mut *d, &mut self.reaped);
        }
        let n = self.reaped.len() + self.immediate.len();
        out.append(&mut self.immediate);
        for (i, r) in self.reaped.drain(..) {
            // SAFETY: the completion handed the slot back to this thread.
            let slot = unsafe { &*self.shared.slots[i as usize].get() };
            out.push(Completion {
                token: slot.r.token,
                result: r,
            });
            self.free.push(i);
        }
        self.in_flight -= n;
        n
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), BdevError> {
        if self.in_flight == 0 {
            return Ok(());
        }
        if self
            .shared
            .done
            .lock()
            .map(|d| !d.is_empty())
            .unwrap_or(true)
        {
            return Ok(());
        }
        let mut pfd = libc::pollfd {
            fd: self.shared.efd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout
            .map(|t| t.as_millis().min(i32::MAX as u128) as i32)
            .unwrap_or(-1);
        // SAFETY: `pfd` is one valid pollfd for the call.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(BdevError::Invalid(format!("poll: {e}")));
            }
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.shared.efd.as_raw_fd())
    }

    fn clear_notify(&mut self) {
        let _ = self.shared.efd.read();
    }
}

impl Drop for SpdkChannel {
    fn drop(&mut self) {
        // Hand any staged requests over, then wait for every request to complete: the caller's
        // buffers must not be touched after the channel is gone.
        let _ = self.commit();
        let mut sink = Vec::new();
        while self.in_flight > 0 {
            self.clear_notify();
            self.poll(&mut sink);
            if self.in_flight > 0 {
                let _ = self.wait(Some(Duration::from_millis(100)));
            }
        }
        self.shared.closing.store(true, Ordering::Release);
        if let Some(rx) = self.stopped.take() {
            if rx.recv_timeout(Duration::from_secs(30)).is_err() {
                warn!(thread = ?self.thread, "SPDK channel thread did not stop");
            }
        }
    }
}

/// Completions queued by callbacks on a [`LocalChannel`]'s thread: (slot, result).
type LocalDone = std::cell::RefCell<Vec<(u32, Result<u64, IoError>)>>;

/// A request slot of a [`LocalChannel`].
struct LocalSlot {
    r: SlotReq,
    index: u32,
    done: *const LocalDone,
}

unsafe extern "C" fn local_io_done(
    bdev_io: *mut ffi::spdk_bdev_io,
    success: bool,
    arg: *mut c_void,
) {
    // SAFETY: SPDK passes back the bdev_io it gave us; freed once here.
    unsafe { ffi::spdk_bdev_free_io(bdev_io) };
    // SAFETY: `arg` is a slot of a LocalChannel, whose slots and completion list stay
    // allocated while requests are in flight (a channel dropped early leaks them), and this
    // callback runs on the channel's own thread.
    let slot = unsafe { &*arg.cast::<LocalSlot>() };
    let r = if success {
        Ok(match slot.r.op {
            IoOp::Read | IoOp::Write => slot.r.len,
            _ => 0,
        })
    } else {
        Err(IoError::Errno(libc::EIO))
    };
    // SAFETY: as above.
    unsafe { &*slot.done }.borrow_mut().push((slot.index, r));
}

/// A channel used on the SPDK thread that made it: requests go straight to SPDK in `commit`,
/// completion callbacks (run by the same thread's pollers) queue the results, `poll` reaps
/// them. Nothing blocks and nothing crosses threads: this is how queue workers polled by an
/// SPDK reactor ([`crate::runtime::SpdkRuntime`]) do I/O, like SPDK's own vhost target.
struct LocalChannel {
    bdev: Arc<BdevShared>,
    io_ch: *mut ffi::spdk_io_channel,
    thread: Thread,
    slots: Box<[UnsafeCell<LocalSlot>]>,
    done: Box<LocalDone>,
    free: Vec<u32>,
    staged: Vec<u32>,
    retry: VecDeque<u32>,
    immediate: Vec<Completion>,
    in_flight: usize,
    max_segments: usize,
}

// SAFETY: a LocalChannel is only used on the SPDK thread that opened it (the queue worker that
// owns it is polled there and nowhere else); it is moved across threads only as part of a
// worker before its first use.
unsafe impl Send for LocalChannel {}

impl LocalChannel {
    fn open(bdev: Arc<BdevShared>, depth: usize, max_segments: usize) -> Result<Self, Error> {
        if depth == 0 || depth > 65536 || max_segments == 0 {
            return Err(Error::InvalidName(format!(
                "depth {depth} / segments {max_segments}"
            )));
        }
        let thread = Thread::current().ok_or(Error::NotOnSpdkThread("LocalChannel"))?;
        // SAFETY: on an SPDK thread; the descriptor is open.
        let io_ch = unsafe { ffi::spdk_bdev_get_io_channel(bdev.desc.0) };
        if io_ch.is_null() {
            return Err(Error::Call("spdk_bdev_get_io_channel", -libc::ENOMEM));
        }
        let done = Box::new(std::cell::RefCell::new(Vec::with_capacity(depth)));
        let done_ptr: *const _ = &*done;
        let slots = (0..depth)
            .map(|i| {
                UnsafeCell::new(LocalSlot {
                    r: SlotReq::new(max_segments),
                    index: i as u32,
                    done: done_ptr,
                })
            })
            .collect();
        Ok(LocalChannel {
            bdev,
            io_ch,
            thread,
            slots,
            done,
            free: (0..depth as u32).rev().collect(),
            staged: Vec::with_capacity(depth),
            retry: VecDeque::new(),
            immediate: Vec::new(),
            in_flight: 0,
            max_segments,
        })
    }

    /// Submits slot `i`: false when SPDK is out of bdev_io (retry later).
    fn submit_one(&mut self, i: u32) -> bool {
        // SAFETY: a staged or retried slot is owned by this channel until its completion.
        let slot = unsafe { &mut *self.slots[i as usize].get() };
        if self.bdev.events().removed.load(Ordering::SeqCst) {
            self.done
                .borrow_mut()
                .push((i, Err(IoError::Errno(libc::ENODEV))));
            return true;
        }
        let arg = (slot as *mut LocalSlot).cast::<c_void>();
        // SAFETY: on the channel's thread with its io channel; the slot's iovecs and the
        // caller's buffers stay valid until local_io_done runs.
        let rc = unsafe {
            submit_raw(
                self.bdev.desc.0,
                self.io_ch,
                slot.r.op,
                &mut slot.r.iov,
                slot.r.offset_blocks,
                slot.r.num_blocks,
                Some(local_io_done),
                arg,
            )
        };
        match rc {
            0 => true,
            rc if rc == -libc::ENOMEM => false,
            rc => {
                self.done.borrow_mut().push((i, Err(IoError::Errno(-rc))));
                true
            }
        }
    }
}

impl IoChannel for LocalChannel {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        validate(&self.bdev, req, self.max_segments)?;
        if self.in_flight >= self.slots.len() {
            return Err(SubmitError::Full);
        }
        if req.op == IoOp::Flush && !self.bdev.flush {
            self.immediate.push(Completion {
                token: req.token,
                result: Ok(0),
            });
            self.in_flight += 1;
            return Ok(());
        }
        let Some(i) = self.free.pop() else {
            return Err(SubmitError::Full);
        };
        let bs = u64::from(self.bdev.info.block_size);
        // SAFETY: a free slot belongs to this channel.
        let slot = unsafe { &mut *self.slots[i as usize].get() };
        slot.r.fill(req, bs);
        self.staged.push(i);
        self.in_flight += 1;
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BdevError> {
        let staged = std::mem::take(&mut self.staged);
        for &i in &staged {
            if !self.retry.is_empty() || !self.submit_one(i) {
                self.retry.push_back(i);
            }
        }
        self.staged = staged;
        self.staged.clear();
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        while let Some(&i) = self.retry.front() {
            if !self.submit_one(i) {
                break;
            }
            self.retry.pop_front();
        }
        let mut n = self.immediate.len();
        out.append(&mut self.immediate);
        let done = std::mem::take(&mut *self.done.borrow_mut());
        for &(i, r) in &done {
            // SAFETY: the completion handed the slot back.
            let slot = unsafe { &*self.slots[i as usize].get() };
            out.push(Completion {
                token: slot.r.token,
                result: r,
            });
            self.free.push(i);
        }
        n += done.len();
        let mut done = done;
        done.clear();
        *self.done.borrow_mut() = done;
        self.in_flight -= n;
        n
    }

    fn wait(&mut self, _timeout: Option<Duration>) -> Result<(), BdevError> {
        // Never block an SPDK thread: completions arrive when it polls.
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn notify_fd(&self) -> Option<RawFd> {
        None
    }
}

impl Drop for LocalChannel {
    fn drop(&mut self) {
        if Thread::current() != Some(self.thread) {
            warn!("SPDK channel dropped off its thread: its io_channel is leaked");
            return;
        }
        if self.in_flight > self.immediate.len() {
            // Completions will still write into the slots: keep them (and the channel) alive.
            warn!(
                in_flight = self.in_flight,
                "SPDK channel dropped with requests in flight: leaking it"
            );
            let slots = std::mem::take(&mut self.slots);
            std::mem::forget(slots);
            let done = std::mem::take(&mut self.done);
            std::mem::forget(done);
            return;
        }
        // SAFETY: on the thread that got the channel; nothing is in flight.
        unsafe { ffi::spdk_put_io_channel(self.io_ch) };
    }
}
