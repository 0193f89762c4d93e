//! The cross-thread channel: a caller thread (a queue worker on its own OS thread) fills
//! request slots and hands them to a dedicated SPDK thread, which submits them and queues the
//! completions back behind an eventfd.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use katablk_bdev::{BdevError, Completion, IoChannel, IoError, IoOp, IoRequest, SubmitError};
use tracing::warn;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::ffi;
use crate::thread::{exit_current, Poller, Thread};
use crate::Error;

use super::{submit_raw, validate, BdevShared, SlotReq};

/// One request's state. Owned by the caller's thread while free or being filled, by the SPDK
/// thread from the moment its index is queued until its completion is queued back.
pub(super) struct Slot {
    r: SlotReq,
    index: u32,
    chan: *const ChanShared,
}

pub(super) struct ChanShared {
    slots: Box<[UnsafeCell<Slot>]>,
    submit: Mutex<Vec<u32>>,
    done: Mutex<Vec<(u32, Result<u64, IoError>)>>,
    /// Completions were queued since the poller last signalled.
    pending_signal: AtomicBool,
    /// `efd` was written and not cleared since: it is still readable, so the poller need not
    /// write it again (a caller that polls without sleeping never clears it).
    signalled: AtomicBool,
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
pub(super) struct SpdkSide {
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
            // Queued before this swap; a `clear_notify` that swaps `signalled` back after it
            // reads `true` here and so sees these completions in its next `poll`.
            if !self.shared.signalled.swap(true, Ordering::SeqCst) {
                let _ = self.shared.efd.write(1);
            }
            busy = true;
        }
        busy
    }
}

/// The caller-side half of a channel.
pub(super) struct SpdkChannel {
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
    pub(super) fn open(
        bdev: Arc<BdevShared>,
        depth: usize,
        max_segments: usize,
    ) -> Result<Self, Error> {
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
            signalled: AtomicBool::new(false),
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

pub(super) fn start_channel_thread(
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

pub(super) fn teardown(
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
        // Forget the signal before draining the descriptor: a poller pass after the swap writes
        // the descriptor again, and one before it queued its completions ahead of its own swap
        // of `signalled` (which this swap reads), so the next `poll` returns them.
        self.shared.signalled.swap(false, Ordering::SeqCst);
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
