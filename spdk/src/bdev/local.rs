//! The local channel: used on the SPDK thread that made it, with no hand-off.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use katablk_bdev::{BdevError, Completion, IoChannel, IoError, IoOp, IoRequest, SubmitError};
use tracing::warn;

use crate::ffi;
use crate::thread::Thread;
use crate::Error;

use super::{submit_raw, validate, BdevShared, SlotReq};

/// Completions queued by callbacks on a [`LocalChannel`]'s thread: (slot, result).
pub(super) type LocalDone = std::cell::RefCell<Vec<(u32, Result<u64, IoError>)>>;

/// A request slot of a [`LocalChannel`].
pub(super) struct LocalSlot {
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
pub(super) struct LocalChannel {
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
