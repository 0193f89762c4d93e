//! [`IoMode::IoUring`](crate::file::IoMode::IoUring): one io_uring per channel.
//!
//! Each channel owns a ring with at least `depth` submission entries and `depth` request slots.
//! A slot holds the request's bookkeeping and room for `max_segments` iovecs, all allocated when
//! the channel is opened, so `submit` never allocates: it copies the caller's iovec array (not the
//! data) into the slot and pushes one SQE whose `user_data` is the slot index. Reads and writes
//! become `READ`/`WRITE` (one buffer) or `READV`/`WRITEV`; flush is `FSYNC` with `DATASYNC`;
//! discard and write-zeroes are `FALLOCATE` on regular files and inline `BLKDISCARD`/`BLKZEROOUT`
//! on block devices (completed at once).
//!
//! Two kinds of request skip the ring: reads and writes of files in memory (tmpfs, ramfs) up to
//! 1 MiB, which io_uring would hand to its workers although they never block, and writes to
//! page-cache files up to 256 KiB, which io_uring hands to its workers on ext4, while
//! [`WriteGate`] sees them finish quickly. Both run on the submitting thread and complete at once
//! (those in memory as copies through the file's mapping where its pages are allocated, see
//! `memfile`). Discards and write-zeroes of a mapped file run inline too, under its lock.
//!
//! `poll` reaps CQEs without blocking. Short transfers are resubmitted from where they stopped
//! (the slot's iovec copy is advanced in place); a read that stops at the end of a file that
//! shrank under the device has the rest of its buffers zeroed, as the blocking path does;
//! `EINTR`/`EAGAIN` are retried. An eventfd registered with the ring is the channel's
//! `notify_fd`. Dropping the channel waits until the kernel has finished with every request,
//! since it may still be writing into the caller's buffers.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring, Probe};

use crate::eventfd::EventFd;
use crate::file_io::{zero_iovecs, FileInner};
use crate::inline::validate;
use crate::{iovec, BdevError, Completion, IoChannel, IoError, IoOp, IoRequest, SubmitError};

/// Most iovecs handed to one `READV`/`WRITEV` (the kernel's `UIO_MAXIOV`); the rest of a longer
/// list is sent as the remainder of a short transfer.
const MAX_IOV_PER_SQE: usize = 1024;

/// Largest ring the kernel sets up (`IORING_MAX_ENTRIES`); deeper channels are clamped to it.
const MAX_DEPTH: usize = 32768;

/// What the kernel's io_uring supports, probed once per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UringSupport {
    /// `IORING_OP_READ`/`WRITE` (5.6+); otherwise one-buffer requests use `READV`/`WRITEV`.
    rw: bool,
    /// `IORING_OP_FALLOCATE` (5.6+); otherwise discard and write-zeroes run inline.
    fallocate: bool,
}

fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// Checks that io_uring works here (it may be compiled out, disabled by
/// `kernel.io_uring_disabled`, or blocked by seccomp) and which opcodes it has. Returns the errno
/// that refused it otherwise.
pub(crate) fn probe() -> Result<UringSupport, i32> {
    let mut ring: IoUring = IoUring::new(2).map_err(|e| errno_of(&e))?;
    let mut p = Probe::new();
    let support = match ring.submitter().register_probe(&mut p) {
        Ok(()) => {
            let base = [
                opcode::Readv::CODE,
                opcode::Writev::CODE,
                opcode::Fsync::CODE,
            ];
            if !base.iter().all(|&op| p.is_supported(op)) {
                return Err(libc::EOPNOTSUPP);
            }
            UringSupport {
                rw: p.is_supported(opcode::Read::CODE) && p.is_supported(opcode::Write::CODE),
                fallocate: p.is_supported(opcode::Fallocate::CODE),
            }
        }
        // Kernels before 5.6 have no probe, but do have READV, WRITEV and FSYNC.
        Err(_) => UringSupport {
            rw: false,
            fallocate: false,
        },
    };
    // A seccomp filter may allow io_uring_setup and refuse io_uring_enter: run one NOP.
    let nop = opcode::Nop::new().build().user_data(0);
    // SAFETY: a NOP references no memory.
    unsafe { ring.submission().push(&nop) }.map_err(|_| libc::EBUSY)?;
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => return Err(errno_of(&e)),
        }
    }
    let res = ring.completion().next().map(|c| c.result());
    match res {
        Some(r) if r >= 0 => Ok(support),
        Some(r) => Err(-r),
        None => Err(libc::EIO),
    }
}

/// What a slot's SQE does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Flush,
    /// `fallocate` with this mode over the whole range.
    Fallocate(i32),
}

/// One request in flight.
#[derive(Debug, Clone, Copy)]
struct Slot {
    token: u64,
    kind: Kind,
    /// Device offset of the request.
    offset: u64,
    /// Request length in bytes.
    len: u64,
    /// Bytes transferred so far.
    done: u64,
    /// Index in `UringChannel::iovs` of the first iovec not yet fully transferred.
    cur: usize,
    /// One past the request's last iovec in `UringChannel::iovs`.
    end: usize,
}

const EMPTY_SLOT: Slot = Slot {
    token: 0,
    kind: Kind::Flush,
    offset: 0,
    len: 0,
    done: 0,
    cur: 0,
    end: 0,
};

const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;

/// Reads and writes of files in memory up to this size are done inline: the copy costs the
/// same on the submitting core, and io_uring's worker threads add a hand-off and a wake-up per
/// request (128 KiB reads from tmpfs, QD8, one server core: 4.8 GB/s through the workers,
/// 7.6 GB/s inline). Larger ones (over ~0.1 ms of copying) go to the workers so that they do not
/// hold up the other queues of the submitting thread.
const INLINE_MAX: u64 = 1 << 20;
/// Reads and writes of files in memory from this size on are handed to io_uring's workers.
const ASYNC_MIN: u64 = 64 << 10;

/// Writes to page-cache files up to this size are done inline while [`WriteGate`] allows it.
const PAGE_CACHE_WRITE_MAX: u64 = 256 << 10;

/// Decides whether a channel may write to a page-cache file inline.
///
/// A buffered write that finds its pages in memory takes microseconds (4 KiB on ext4: about
/// 3 µs), while io_uring hands every buffered write on ext4 to a worker thread (ext4 has no
/// non-blocking buffered writes), which costs a hand-off and two wake-ups per request: on one
/// server core, 4 KiB writes at QD1 ran at half the rate through the workers. But a buffered write
/// may also block, in dirty-page throttling, in reclaim or behind the journal, and while it does
/// the submitting thread serves none of its other queues. So a write that takes longer than
/// [`WriteGate::STALL`] sends the following writes to io_uring for a pause that starts at
/// [`WriteGate::PAUSE_MIN`] and doubles with every stall in a row, up to [`WriteGate::PAUSE_MAX`]:
/// a device that keeps stalling holds its thread up for at most a small fraction of the time.
#[derive(Debug, Clone)]
pub(crate) struct WriteGate {
    /// Inline writes resume at this instant.
    paused_until: Option<Instant>,
    /// The pause the next stall sets.
    pause: Duration,
}

impl WriteGate {
    /// An inline write that took longer than this is a stall.
    pub(crate) const STALL: Duration = Duration::from_micros(500);
    /// The pause after a first stall.
    pub(crate) const PAUSE_MIN: Duration = Duration::from_millis(100);
    /// The longest pause.
    pub(crate) const PAUSE_MAX: Duration = Duration::from_secs(10);

    pub(crate) fn new() -> Self {
        WriteGate {
            paused_until: None,
            pause: Self::PAUSE_MIN,
        }
    }

    /// Whether a write submitted at `now` may run inline.
    pub(crate) fn allows(&mut self, now: Instant) -> bool {
        match self.paused_until {
            Some(t) if now < t => false,
            Some(_) => {
                self.paused_until = None;
                true
            }
            None => true,
        }
    }

    /// Records an inline write that started at `start` and ended at `end`; true if it stalled
    /// (inline writes are then paused).
    pub(crate) fn record(&mut self, start: Instant, end: Instant) -> bool {
        if end.saturating_duration_since(start) <= Self::STALL {
            self.pause = Self::PAUSE_MIN;
            return false;
        }
        self.paused_until = Some(end + self.pause);
        self.pause = (self.pause * 2).min(Self::PAUSE_MAX);
        true
    }
}

/// An [`IoChannel`] backed by its own io_uring.
pub(crate) struct UringChannel {
    ring: IoUring,
    inner: Arc<FileInner>,
    support: UringSupport,
    /// The file is registered with the ring (index 0).
    fixed_file: bool,
    efd: EventFd,
    /// `efd` was signalled for an inline completion and not cleared since: it is still
    /// readable, so further inline completions need no `write` to it.
    efd_signalled: bool,
    slots: Box<[Slot]>,
    /// `slots.len() * max_segments` iovecs: slot `i` owns `[i * max_segments, (i + 1) *
    /// max_segments)`. Never reallocated, so pointers handed to the kernel stay valid.
    iovs: Box<[iovec]>,
    /// Free slot indices.
    free: Vec<u32>,
    /// Finished requests not yet returned by `poll`.
    done: VecDeque<Completion>,
    /// Reaped CQEs (`user_data`, `res`) being processed.
    cqes: Vec<(u64, i32)>,
    max_segments: usize,
    /// Requests submitted and not yet returned by `poll`.
    in_flight: usize,
    /// SQEs pushed whose CQE has not been reaped (submitted or still in the SQ).
    in_ring: usize,
    /// Inline writes to a page-cache file.
    write_gate: WriteGate,
}

// SAFETY: the only non-`Send` fields are the iovec copies, whose raw pointers refer to buffers the
// caller lent to the channel under the contract of `IoChannel::submit`; that contract is not tied
// to a thread, and the pointers are only used by the kernel or by the thread that owns the
// channel. The ring itself is `Send`.
unsafe impl Send for UringChannel {}

impl UringChannel {
    /// Sets up a ring of `depth` entries (clamped to 1..=32768) for requests of up to
    /// `max_segments` buffers.
    pub(crate) fn new(
        inner: Arc<FileInner>,
        support: UringSupport,
        depth: usize,
        max_segments: usize,
    ) -> Result<Self, BdevError> {
        let depth = depth.clamp(1, MAX_DEPTH);
        let max_segments = max_segments.max(1);
        let n_iov = depth.checked_mul(max_segments).ok_or_else(|| {
            BdevError::Invalid(format!(
                "depth {depth} x {max_segments} segments is too large"
            ))
        })?;
        let ring: IoUring = IoUring::builder()
            .build(depth as u32)
            .map_err(|e| BdevError::io("io_uring_setup", e))?;
        let efd = EventFd::new()?;
        ring.submitter()
            .register_eventfd(efd.fd())
            .map_err(|e| BdevError::io("io_uring register_eventfd", e))?;
        let cq = (ring.params().cq_entries() as usize).max(depth);
        // Optional: without registration requests name the file by descriptor.
        let fixed_file = ring.submitter().register_files(&[inner.fd()]).is_ok();
        Ok(UringChannel {
            ring,
            inner,
            support,
            fixed_file,
            efd,
            efd_signalled: false,
            slots: vec![EMPTY_SLOT; depth].into_boxed_slice(),
            iovs: vec![
                iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                };
                n_iov
            ]
            .into_boxed_slice(),
            free: (0..depth as u32).rev().collect(),
            done: VecDeque::with_capacity(depth),
            cqes: Vec::with_capacity(cq),
            max_segments,
            in_flight: 0,
            in_ring: 0,
            write_gate: WriteGate::new(),
        })
    }

    /// Takes a free slot and copies `req` (a validated read, write, flush or fallocate) into it.
    fn alloc_slot(&mut self, req: &IoRequest<'_>, kind: Kind) -> Result<usize, SubmitError> {
        // `in_flight < depth` and every busy slot is in flight, so one is free.
        let idx = self.free.pop().ok_or(SubmitError::Full)? as usize;
        let base = idx * self.max_segments;
        let end = base + req.iov.len();
        self.iovs[base..end].copy_from_slice(req.iov);
        self.slots[idx] = Slot {
            token: req.token,
            kind,
            offset: req.offset,
            len: req.len,
            done: 0,
            cur: base,
            end,
        };
        Ok(idx)
    }

    /// Builds the SQE for what remains of slot `idx`.
    fn sqe(&self, idx: usize) -> squeue::Entry {
        let s = &self.slots[idx];
        // With the file registered, the SQE's fd field is its index in the table (0) and
        // IOSQE_FIXED_FILE is set below, sparing the kernel an fget/fput per request.
        let fd = types::Fd(if self.fixed_file { 0 } else { self.inner.fd() });
        let e = match s.kind {
            Kind::Read | Kind::Write => {
                let pos = s.offset + s.done;
                let cnt = (s.end - s.cur).min(MAX_IOV_PER_SQE);
                let first = self.iovs[s.cur];
                let single = cnt == 1 && self.support.rw && first.iov_len <= u32::MAX as usize;
                match (s.kind == Kind::Read, single) {
                    (true, true) => {
                        opcode::Read::new(fd, first.iov_base.cast(), first.iov_len as u32)
                            .offset(pos)
                            .build()
                    }
                    (false, true) => {
                        opcode::Write::new(fd, first.iov_base.cast(), first.iov_len as u32)
                            .offset(pos)
                            .build()
                    }
                    (true, false) => {
                        opcode::Readv::new(fd, self.iovs[s.cur..].as_ptr(), cnt as u32)
                            .offset(pos)
                            .build()
                    }
                    (false, false) => {
                        opcode::Writev::new(fd, self.iovs[s.cur..].as_ptr(), cnt as u32)
                            .offset(pos)
                            .build()
                    }
                }
            }
            Kind::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Kind::Fallocate(mode) => opcode::Fallocate::new(fd, s.len)
                .offset(s.offset)
                .mode(mode)
                .build(),
        };
        let mut flags = squeue::Flags::empty();
        if self.fixed_file {
            flags |= squeue::Flags::FIXED_FILE;
        }
        if matches!(s.kind, Kind::Read | Kind::Write)
            && s.len - s.done >= ASYNC_MIN
            && self.inner.memory_backed
        {
            // io_uring punts tmpfs I/O to its workers anyway; asking for it up front skips the
            // failed non-blocking attempt, and large copies then run in parallel. (On ext4 the
            // page-cache copy done inline in io_uring_enter measured faster: not there.)
            flags |= squeue::Flags::ASYNC;
        }
        e.flags(flags).user_data(idx as u64)
    }

    /// Queues the SQE for slot `idx`; false if the submission queue is full (cannot happen: it
    /// has at least one entry per slot and a slot has at most one SQE at a time).
    fn push(&mut self, idx: usize) -> bool {
        let e = self.sqe(idx);
        // SAFETY: the SQE points into `self.iovs` (never reallocated or freed before `Drop` has
        // reaped every CQE, and not modified while the SQE is outstanding) and into the caller's
        // buffers, which `IoChannel::submit`'s contract keeps valid until the completion is
        // polled or the channel is dropped (and `Drop` waits for the kernel).
        let ok = unsafe { self.ring.submission().push(&e) }.is_ok();
        if ok {
            self.in_ring += 1;
        }
        ok
    }

    /// Hands queued SQEs to the kernel. Transient refusals (`EAGAIN`, `EBUSY`) leave them queued
    /// for the next call.
    fn submit_ring(&mut self) -> std::io::Result<()> {
        loop {
            if self.ring.submission().is_empty() {
                return Ok(());
            }
            match self.ring.submit() {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EAGAIN) | Some(libc::EBUSY) => return Ok(()),
                    _ => return Err(e),
                },
            }
        }
    }

    /// Completes slot `idx` and frees it.
    fn finish(&mut self, idx: usize, result: Result<u64, IoError>) {
        self.done.push_back(Completion {
            token: self.slots[idx].token,
            result,
        });
        self.free.push(idx as u32);
    }

    /// Resubmits the rest of slot `idx`; true if an SQE was queued.
    fn resubmit(&mut self, idx: usize) -> bool {
        if self.push(idx) {
            true
        } else {
            self.finish(idx, Err(IoError::Errno(libc::EAGAIN)));
            false
        }
    }

    /// Moves slot `idx`'s iovec cursor `n` bytes on, trimming the current iovec in place.
    fn advance(&mut self, idx: usize, mut n: usize) {
        let s = &mut self.slots[idx];
        while n > 0 && s.cur < s.end {
            let v = &mut self.iovs[s.cur];
            if n >= v.iov_len {
                n -= v.iov_len;
                s.cur += 1;
            } else {
                v.iov_base = v.iov_base.cast::<u8>().wrapping_add(n).cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }

    /// Zeroes what is left of read slot `idx` (the file ended) and completes it in full.
    fn finish_eof(&mut self, idx: usize) {
        let s = self.slots[idx];
        // SAFETY: the iovecs from `cur` on describe the untransferred parts of the caller's read
        // buffers, valid and writable until the completion is polled (`submit`'s contract); the
        // kernel is done with this slot (its CQE was reaped).
        unsafe { zero_iovecs(&self.iovs[s.cur..s.end], 0) };
        self.finish(idx, Ok(s.len));
    }

    /// Handles one CQE; true if it queued a new SQE.
    fn handle_cqe(&mut self, idx: usize, res: i32) -> bool {
        if idx >= self.slots.len() {
            tracing::error!(user_data = idx, "io_uring completion for an unknown slot");
            return false;
        }
        let s = self.slots[idx];
        if res == -libc::EINTR || res == -libc::EAGAIN {
            return self.resubmit(idx);
        }
        match s.kind {
            Kind::Read | Kind::Write if res > 0 => {
                let n = res as u64;
                self.slots[idx].done += n;
                self.advance(idx, n as usize);
                let done = self.slots[idx].done;
                if done >= s.len {
                    self.finish(idx, Ok(s.len));
                } else if s.kind == Kind::Read && self.inner.past_eof(s.offset + done) {
                    self.finish_eof(idx);
                } else {
                    return self.resubmit(idx);
                }
            }
            Kind::Read if res == 0 => self.finish_eof(idx),
            Kind::Write if res == 0 => self.finish(
                idx,
                Err(IoError::Short {
                    done: s.done,
                    wanted: s.len,
                }),
            ),
            Kind::Fallocate(ZERO) if res == -libc::EOPNOTSUPP => {
                // Filesystems without ZERO_RANGE: punch a hole instead (reads back as zeroes).
                self.slots[idx].kind = Kind::Fallocate(PUNCH);
                return self.resubmit(idx);
            }
            _ if res < 0 => self.finish(idx, Err(IoError::Errno(-res))),
            _ => self.finish(idx, Ok(0)),
        }
        false
    }

    /// Processes every available CQE (moving finished requests to `done`) and submits any
    /// resubmissions.
    fn reap(&mut self) {
        let mut queued = false;
        loop {
            self.cqes.clear();
            let cap = self.cqes.capacity();
            self.cqes.extend(
                self.ring
                    .completion()
                    .take(cap)
                    .map(|c| (c.user_data(), c.result())),
            );
            if self.cqes.is_empty() {
                break;
            }
            for i in 0..self.cqes.len() {
                let (ud, res) = self.cqes[i];
                self.in_ring = self.in_ring.saturating_sub(1);
                queued |= self.handle_cqe(ud as usize, res);
            }
        }
        if queued {
            if let Err(e) = self.submit_ring() {
                // The SQEs stay queued and go with the next commit or wait.
                tracing::warn!(error = %e, "io_uring resubmission failed");
            }
        }
    }

    /// Completes a request at once (done inline, or trivially empty).
    fn complete_now(&mut self, token: u64, result: Result<u64, IoError>) {
        self.done.push_back(Completion { token, result });
        self.in_flight += 1;
        // Keep the "readable when completions are ready" promise of `notify_fd`. The descriptor
        // stays readable until it is cleared, so one `write` covers every inline completion up
        // to the next `clear_notify`: a caller that polls without sleeping (and so without
        // clearing) makes no system call per request here.
        if !self.efd_signalled {
            self.efd.signal();
            self.efd_signalled = true;
        }
    }

    /// Waits for a CQE for at most `left` (the kernel's timeout, or the eventfd on kernels
    /// without `EXT_ARG`).
    fn wait_timeout(&mut self, left: Duration) -> std::io::Result<()> {
        if self.ring.params().is_feature_ext_arg() {
            let ts = types::Timespec::from(left);
            let args = types::SubmitArgs::new().timespec(&ts);
            self.ring.submitter().submit_with_args(1, &args).map(|_| ())
        } else {
            self.submit_ring()?;
            // Reset first so a completion arriving after the check below still wakes us.
            self.clear_notify();
            self.reap();
            if self.done.is_empty() {
                let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
                self.efd.wait_readable(ms);
            }
            Ok(())
        }
    }
}

impl IoChannel for UringChannel {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        if self.in_flight >= self.slots.len() {
            return Err(SubmitError::Full);
        }
        validate(&self.inner.info(), req, self.max_segments)?;
        let kind = match req.op {
            IoOp::Read | IoOp::Write if req.len == 0 => {
                self.complete_now(req.token, Ok(0));
                return Ok(());
            }
            IoOp::Read | IoOp::Write if self.inner.memory_backed && req.len <= INLINE_MAX => {
                // tmpfs/ramfs never block, and io_uring would punt them to its workers: small
                // copies are cheapest done right here.
                // SAFETY: `submit`'s contract keeps the buffers valid for this call.
                let result = unsafe { self.inner.exec_blocking(req) };
                self.complete_now(req.token, result);
                return Ok(());
            }
            IoOp::Write if self.inner.page_cache && req.len <= PAGE_CACHE_WRITE_MAX => {
                let start = Instant::now();
                if !self.write_gate.allows(start) {
                    Kind::Write
                } else {
                    // SAFETY: `submit`'s contract keeps the buffers valid for this call.
                    let result = unsafe { self.inner.exec_blocking(req) };
                    let end = Instant::now();
                    if self.write_gate.record(start, end) {
                        tracing::debug!(
                            path = %self.inner.path.display(),
                            took_us = end.duration_since(start).as_micros() as u64,
                            "a buffered write blocked: writes go to io_uring's workers for a while"
                        );
                    }
                    self.complete_now(req.token, result);
                    return Ok(());
                }
            }
            IoOp::Read => Kind::Read,
            IoOp::Write => Kind::Write,
            IoOp::Flush => Kind::Flush,
            IoOp::Discard | IoOp::WriteZeroes { .. } => {
                let dealloc = matches!(req.op, IoOp::Discard | IoOp::WriteZeroes { unmap: true });
                // A mapped memory file deallocates under its lock (`memfile`): inline too.
                if self.inner.is_blockdev
                    || !self.support.fallocate
                    || req.len == 0
                    || self.inner.mem.is_some()
                {
                    let result = self
                        .inner
                        .zero_range(req.offset, req.len, dealloc)
                        .map(|()| 0);
                    self.complete_now(req.token, result);
                    return Ok(());
                }
                Kind::Fallocate(if dealloc { PUNCH } else { ZERO })
            }
        };
        let idx = self.alloc_slot(req, kind)?;
        if !self.push(idx) {
            self.free.push(idx as u32);
            return Err(SubmitError::Full);
        }
        self.in_flight += 1;
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BdevError> {
        self.submit_ring()
            .map_err(|e| BdevError::io("io_uring_enter", e))
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        self.reap();
        let n = self.done.len();
        out.extend(self.done.drain(..));
        self.in_flight -= n;
        n
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), BdevError> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            self.reap();
            if !self.done.is_empty() || self.in_ring == 0 {
                return Ok(());
            }
            let r = match (timeout, deadline) {
                (Some(_), Some(d)) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(());
                    }
                    self.wait_timeout(left)
                }
                (Some(t), None) if t.is_zero() => return Ok(()),
                _ => self.ring.submit_and_wait(1).map(|_| ()),
            };
            match r {
                Ok(()) => {}
                Err(e) => match e.raw_os_error() {
                    Some(libc::ETIME) => return Ok(()),
                    Some(libc::EINTR) | Some(libc::EBUSY) => {}
                    Some(libc::EAGAIN) => std::thread::yield_now(),
                    _ => return Err(BdevError::io("io_uring_enter", e)),
                },
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.efd.fd())
    }

    fn clear_notify(&mut self) {
        self.efd.clear();
        self.efd_signalled = false;
    }
}

impl Drop for UringChannel {
    fn drop(&mut self) {
        // The kernel may still be writing into the caller's buffers: finish every request
        // (resubmitting short transfers, as `poll` would) before the ring goes away.
        let mut warned = false;
        loop {
            self.reap();
            self.done.clear();
            if self.in_ring == 0 {
                return;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                    ) => {}
                Err(e) => {
                    // SQEs never handed over are harmless; wait only for what the kernel holds.
                    if self.in_ring <= self.ring.submission().len() {
                        return;
                    }
                    if !warned {
                        tracing::warn!(error = %e, "io_uring wait failed while closing a channel");
                        warned = true;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::{FileDevice, FileOptions, IoMode};
    use crate::BlockDevice;

    fn dev(size: u64) -> (tempfile::NamedTempFile, FileDevice) {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(size).unwrap();
        let opts = FileOptions {
            mode: IoMode::IoUring,
            ..Default::default()
        };
        let d = FileDevice::open(f.path(), &opts).unwrap();
        (f, d)
    }

    fn run(ch: &mut dyn IoChannel, want: usize) -> Vec<Completion> {
        let mut out = Vec::new();
        while out.len() < want {
            ch.wait(None).unwrap();
            ch.poll(&mut out);
        }
        out
    }

    #[test]
    fn probe_works_here() {
        match probe() {
            Ok(s) => println!("io_uring support: {s:?}"),
            Err(e) => println!("io_uring unavailable here (errno {e})"),
        }
    }

    /// More iovecs than one READV takes: exercises the split + resubmission path.
    #[test]
    fn split_beyond_uio_maxiov() {
        if probe().is_err() {
            println!("skipped: io_uring unavailable");
            return;
        }
        let (_f, d) = dev(4 << 20);
        let mut ch = d.open_channel(2, 3000).unwrap();
        let n = 2500usize;
        let mut data: Vec<u8> = (0..n * 512).map(|i| (i % 251) as u8).collect();
        let iov: Vec<iovec> = data
            .chunks_mut(512)
            .map(|c| iovec {
                iov_base: c.as_mut_ptr().cast(),
                iov_len: c.len(),
            })
            .collect();
        let w = IoRequest {
            op: IoOp::Write,
            offset: 4096,
            len: (n * 512) as u64,
            iov: &iov,
            token: 1,
        };
        // SAFETY: `data` outlives the completion, which is waited for below.
        unsafe { ch.submit(&w).unwrap() };
        ch.commit().unwrap();
        let c = run(ch.as_mut(), 1);
        assert_eq!(c[0].result, Ok((n * 512) as u64));
        let mut back = vec![0u8; n * 512];
        let riov: Vec<iovec> = back
            .chunks_mut(512)
            .map(|c| iovec {
                iov_base: c.as_mut_ptr().cast(),
                iov_len: c.len(),
            })
            .collect();
        let r = IoRequest {
            op: IoOp::Read,
            iov: &riov,
            token: 2,
            ..w
        };
        // SAFETY: `back` outlives the completion, which is waited for below.
        unsafe { ch.submit(&r).unwrap() };
        ch.commit().unwrap();
        let c = run(ch.as_mut(), 1);
        assert_eq!(
            c[0],
            Completion {
                token: 2,
                result: Ok((n * 512) as u64)
            }
        );
        assert_eq!(back, data);
    }

    /// Inline completions (tmpfs) make the notify descriptor readable once: a caller that polls
    /// without clearing gets no further `write` per request, and one that cleared it is
    /// signalled again by the next inline completion.
    #[test]
    fn inline_completions_signal_once_until_cleared() {
        if probe().is_err() {
            println!("skipped: io_uring unavailable");
            return;
        }
        let Ok(f) = tempfile::NamedTempFile::new_in("/dev/shm") else {
            println!("skipped: no /dev/shm");
            return;
        };
        f.as_file().set_len(1 << 20).unwrap();
        let opts = FileOptions {
            mode: IoMode::IoUring,
            ..Default::default()
        };
        let d = FileDevice::open(f.path(), &opts).unwrap();
        let mut ch = d.open_channel(4, 4).unwrap();
        let fd = ch.notify_fd().unwrap();
        let counter = || {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes from an eventfd into a local u64 (non-blocking fd).
            let n = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
            if n == 8 {
                // Put the count back so the channel still sees the descriptor readable.
                // SAFETY: writes 8 bytes from a local u64 to the same eventfd.
                unsafe { libc::write(fd, (&v as *const u64).cast(), 8) };
                v
            } else {
                0
            }
        };
        let mut buf = vec![0u8; 4096];
        let iov = [iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        let mut out = Vec::new();
        for token in 0..3 {
            let r = IoRequest {
                op: IoOp::Read,
                offset: token * 4096,
                len: 4096,
                iov: &iov,
                token,
            };
            // SAFETY: `buf` outlives the request, which completes inside `submit`.
            unsafe { ch.submit(&r).unwrap() };
            ch.commit().unwrap();
            assert_eq!(ch.poll(&mut out), 1);
        }
        assert_eq!(counter(), 1, "one signal for three inline completions");
        ch.clear_notify();
        assert_eq!(counter(), 0);
        let r = IoRequest {
            op: IoOp::Read,
            offset: 0,
            len: 4096,
            iov: &iov,
            token: 9,
        };
        // SAFETY: as above.
        unsafe { ch.submit(&r).unwrap() };
        assert_eq!(counter(), 1, "signalled again after the clear");
        assert_eq!(ch.poll(&mut out), 1);
        assert!(out.iter().all(|c| c.result == Ok(4096)));
    }

    /// tmpfs has no `FALLOC_FL_ZERO_RANGE`: the channel must fall back to punching a hole.
    #[test]
    fn zero_range_fallback_on_tmpfs() {
        if probe().is_err() {
            println!("skipped: io_uring unavailable");
            return;
        }
        let Ok(f) = tempfile::NamedTempFile::new_in("/dev/shm") else {
            println!("skipped: no /dev/shm");
            return;
        };
        f.as_file().set_len(1 << 20).unwrap();
        std::fs::write(f.path(), vec![0x5au8; 1 << 20]).unwrap();
        let opts = FileOptions {
            mode: IoMode::IoUring,
            ..Default::default()
        };
        let d = FileDevice::open(f.path(), &opts).unwrap();
        let mut io = crate::sync::SyncIo::new(&d).unwrap();
        io.write_zeroes(8192, 8192, false).unwrap();
        let mut back = vec![1u8; 16384];
        io.read_at(4096, &mut back).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0x5a));
        assert!(back[4096..12288].iter().all(|&b| b == 0));
        assert!(back[12288..].iter().all(|&b| b == 0x5a));
    }

    fn uring_channel(size: u64) -> Option<(tempfile::NamedTempFile, UringChannel)> {
        let Ok(support) = probe() else {
            println!("skipped: io_uring unavailable");
            return None;
        };
        let (f, d) = dev(size);
        let ch = UringChannel::new(d.inner.clone(), support, 4, 4).unwrap();
        Some((f, ch))
    }

    /// Feeds a fabricated CQE for a slot that was never submitted, then runs the channel until
    /// the slot completes.
    fn fake_cqe(ch: &mut UringChannel, req: &IoRequest<'_>, kind: Kind, res: i32) -> Completion {
        let idx = ch.alloc_slot(req, kind).unwrap();
        ch.in_flight += 1;
        ch.handle_cqe(idx, res);
        ch.commit().unwrap();
        let mut out = Vec::new();
        while out.is_empty() {
            ch.wait(None).unwrap();
            ch.poll(&mut out);
        }
        assert_eq!(ch.in_flight(), 0);
        out[0]
    }

    fn iovs_of(buf: &mut [u8], cuts: &[usize]) -> Vec<iovec> {
        let mut v = Vec::new();
        let mut at = 0;
        for &c in cuts.iter().chain(std::iter::once(&buf.len())) {
            v.push(iovec {
                iov_base: buf[at..].as_mut_ptr().cast(),
                iov_len: c - at,
            });
            at = c;
        }
        v
    }

    /// A short write is resubmitted from the right device offset and buffer position.
    #[test]
    fn short_write_resumes_mid_buffer() {
        let Some((f, mut ch)) = uring_channel(1 << 20) else {
            return;
        };
        let mut data: Vec<u8> = (0..4096).map(|i| (i % 253) as u8 + 1).collect();
        let iov = iovs_of(&mut data, &[1000, 4000]);
        let req = IoRequest {
            op: IoOp::Write,
            offset: 8192,
            len: 4096,
            iov: &iov,
            token: 7,
        };
        // Pretend the kernel wrote 1500 bytes (it wrote none): only the rest must land.
        let c = fake_cqe(&mut ch, &req, Kind::Write, 1500);
        assert_eq!(
            c,
            Completion {
                token: 7,
                result: Ok(4096)
            }
        );
        let file = std::fs::read(f.path()).unwrap();
        assert!(file[8192..8192 + 1500].iter().all(|&b| b == 0));
        assert_eq!(&file[8192 + 1500..12288], &data[1500..]);
    }

    /// A short read (not at EOF) and an `EAGAIN` are retried; the remainder fills the buffer
    /// where the first part stopped.
    #[test]
    fn short_read_and_eagain_are_retried() {
        let Some((f, mut ch)) = uring_channel(1 << 20) else {
            return;
        };
        let pattern: Vec<u8> = (0..1 << 20).map(|i| (i % 241) as u8 + 1).collect();
        std::fs::write(f.path(), &pattern).unwrap();
        let mut buf = vec![0xeeu8; 8192];
        let iov = iovs_of(&mut buf, &[512, 5000]);
        let req = IoRequest {
            op: IoOp::Read,
            offset: 65536,
            len: 8192,
            iov: &iov,
            token: 8,
        };
        let c = fake_cqe(&mut ch, &req, Kind::Read, 3000);
        assert_eq!(
            c,
            Completion {
                token: 8,
                result: Ok(8192)
            }
        );
        assert!(buf[..3000].iter().all(|&b| b == 0xee));
        assert_eq!(&buf[3000..], &pattern[65536 + 3000..65536 + 8192]);

        let c = fake_cqe(&mut ch, &req, Kind::Read, -libc::EAGAIN);
        assert_eq!(c.result, Ok(8192));
        assert_eq!(&buf[..], &pattern[65536..65536 + 8192]);

        let c = fake_cqe(&mut ch, &req, Kind::Read, -libc::EIO);
        assert_eq!(c.result, Err(IoError::Errno(libc::EIO)));

        let fl = IoRequest::no_data(IoOp::Flush, 0, 0, 9);
        let c = fake_cqe(&mut ch, &fl, Kind::Flush, -libc::EINTR);
        assert_eq!(
            c,
            Completion {
                token: 9,
                result: Ok(0)
            }
        );
    }

    /// A write that makes no progress is reported as short, not retried forever.
    #[test]
    fn zero_length_write_result_is_short() {
        let Some((_f, mut ch)) = uring_channel(1 << 20) else {
            return;
        };
        let mut data = vec![1u8; 1024];
        let iov = iovs_of(&mut data, &[]);
        let req = IoRequest {
            op: IoOp::Write,
            offset: 0,
            len: 1024,
            iov: &iov,
            token: 1,
        };
        let idx = ch.alloc_slot(&req, Kind::Write).unwrap();
        ch.in_flight += 1;
        ch.handle_cqe(idx, 512);
        // The resubmitted remainder is real; reap it, then fake a zero-byte completion on a
        // fresh slot.
        let mut out = Vec::new();
        ch.commit().unwrap();
        while out.is_empty() {
            ch.wait(None).unwrap();
            ch.poll(&mut out);
        }
        assert_eq!(out[0].result, Ok(1024));
        let idx = ch.alloc_slot(&req, Kind::Write).unwrap();
        ch.in_flight += 1;
        assert!(!ch.handle_cqe(idx, 0));
        out.clear();
        ch.poll(&mut out);
        assert_eq!(
            out[0].result,
            Err(IoError::Short {
                done: 0,
                wanted: 1024
            })
        );
    }

    #[test]
    fn timed_wait_returns() {
        if probe().is_err() {
            println!("skipped: io_uring unavailable");
            return;
        }
        let (_f, d) = dev(1 << 20);
        let mut ch = d.open_channel(4, 4).unwrap();
        // Nothing in flight: returns at once.
        ch.wait(Some(Duration::from_secs(5))).unwrap();
        let fl = IoRequest::no_data(IoOp::Flush, 0, 0, 9);
        // SAFETY: no buffers.
        unsafe { ch.submit(&fl).unwrap() };
        ch.commit().unwrap();
        let mut out = Vec::new();
        while out.is_empty() {
            ch.wait(Some(Duration::from_millis(50))).unwrap();
            ch.poll(&mut out);
        }
        assert_eq!(
            out[0],
            Completion {
                token: 9,
                result: Ok(0)
            }
        );
        assert_eq!(ch.in_flight(), 0);
    }

    #[test]
    fn write_gate_pauses_after_a_stall_and_backs_off() {
        let mut g = WriteGate::new();
        let t0 = Instant::now();
        assert!(g.allows(t0));
        // A quick write changes nothing.
        assert!(!g.record(t0, t0 + Duration::from_micros(5)));
        assert!(g.allows(t0));
        // A stall pauses inline writes for PAUSE_MIN from its end.
        let end = t0 + Duration::from_millis(2);
        assert!(g.record(t0, end));
        assert!(!g.allows(end + WriteGate::PAUSE_MIN - Duration::from_millis(1)));
        let t1 = end + WriteGate::PAUSE_MIN;
        assert!(g.allows(t1));
        // A second stall in a row pauses twice as long.
        let end = t1 + Duration::from_millis(1);
        assert!(g.record(t1, end));
        assert!(!g.allows(end + WriteGate::PAUSE_MIN * 2 - Duration::from_millis(1)));
        let t2 = end + WriteGate::PAUSE_MIN * 2;
        assert!(g.allows(t2));
        // A quick write resets the back-off.
        assert!(!g.record(t2, t2));
        let end = t2 + Duration::from_millis(1);
        assert!(g.record(t2, end));
        assert!(g.allows(end + WriteGate::PAUSE_MIN));
        // The pause never exceeds PAUSE_MAX.
        let mut t = end + WriteGate::PAUSE_MIN;
        for _ in 0..20 {
            assert!(g.allows(t));
            let e = t + Duration::from_millis(1);
            g.record(t, e);
            t = e + WriteGate::PAUSE_MAX;
        }
        assert!(g.pause <= WriteGate::PAUSE_MAX);
    }

    /// A page-cache file (not tmpfs, no O_DIRECT): small writes complete inside `submit`, large
    /// ones and those made while the gate is paused go through the ring; all land.
    #[test]
    fn page_cache_writes_run_inline_until_the_gate_pauses() {
        let Ok(support) = probe() else {
            println!("skipped: io_uring unavailable");
            return;
        };
        let f = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        f.as_file().set_len(4 << 20).unwrap();
        let opts = FileOptions {
            mode: IoMode::IoUring,
            ..Default::default()
        };
        let d = FileDevice::open(f.path(), &opts).unwrap();
        if !d.inner.page_cache {
            println!("skipped: /var/tmp is a memory filesystem here");
            return;
        }
        let mut ch = UringChannel::new(d.inner.clone(), support, 4, 4).unwrap();
        let mut small = vec![0x11u8; 4096];
        let mut large = vec![0x22u8; (PAGE_CACHE_WRITE_MAX + 4096) as usize];
        let mut paused = vec![0x33u8; 8192];
        fn write(iov: &[iovec], offset: u64, token: u64) -> IoRequest<'_> {
            IoRequest {
                op: IoOp::Write,
                offset,
                len: iov.iter().map(|v| v.iov_len as u64).sum(),
                iov,
                token,
            }
        }
        let mut out = Vec::new();
        let iov = iovs_of(&mut small, &[]);
        // SAFETY: `small` outlives the completion, which is polled right after.
        unsafe { ch.submit(&write(&iov, 0, 1)).unwrap() };
        assert_eq!(ch.in_ring, 0, "a small write is done inline");
        ch.poll(&mut out);
        assert_eq!(
            out,
            [Completion {
                token: 1,
                result: Ok(4096)
            }]
        );

        let iov = iovs_of(&mut large, &[]);
        // SAFETY: `large` outlives the completion, which is waited for below.
        unsafe { ch.submit(&write(&iov, 1 << 20, 2)).unwrap() };
        assert_eq!(ch.in_ring, 1, "a large write goes to the ring");
        ch.commit().unwrap();
        let c = run(&mut ch, 1);
        assert_eq!(c[0].result, Ok(PAGE_CACHE_WRITE_MAX + 4096));

        ch.write_gate
            .record(Instant::now(), Instant::now() + Duration::from_secs(1));
        let iov = iovs_of(&mut paused, &[]);
        // SAFETY: `paused` outlives the completion, which is waited for below.
        unsafe { ch.submit(&write(&iov, 8192, 3)).unwrap() };
        assert_eq!(
            ch.in_ring, 1,
            "a paused gate sends small writes to the ring"
        );
        ch.commit().unwrap();
        let c = run(&mut ch, 1);
        assert_eq!(c[0].result, Ok(8192));

        let mut io = crate::sync::SyncIo::new(&d).unwrap();
        let mut back = vec![0u8; 16384];
        io.read_at(0, &mut back).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0x11));
        assert!(back[4096..8192].iter().all(|&b| b == 0));
        assert!(back[8192..].iter().all(|&b| b == 0x33));
        let mut back = vec![0u8; large.len()];
        io.read_at(1 << 20, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0x22));
    }
}
