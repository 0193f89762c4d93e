//! The I/O channel of a volume: splits requests at cluster boundaries and maps each piece
//! onto the backing device's channel, with the caller's buffers passed through unchanged.
//!
//! Requests live in slots preallocated when the channel is opened (their iovec arrays too),
//! so the hot path does not allocate. A write to an unallocated cluster parks its slot and
//! asks the store's allocation worker for the cluster; the rest of the channel keeps going,
//! and the parked piece is issued from [`IoChannel::poll`] once the cluster's data and
//! metadata are durable.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use katablk_bdev::{
    iovec, BdevError, Completion, IoChannel, IoError, IoOp, IoRequest, SubmitError,
};

use crate::lvol::{Lvol, VolState};
use crate::shared::{AllocReq, Waiter};

/// One finished allocation: (slot, logical cluster, result).
type Ready = (u32, u64, Result<(), IoError>);

/// The part of a channel the allocation worker talks to.
pub(crate) struct ChanShared {
    ready: Mutex<Vec<Ready>>,
    efd: OwnedFd,
}

impl ChanShared {
    /// Reports a finished allocation and wakes the channel.
    pub(crate) fn notify(&self, slot: u32, cluster: u64, r: Result<(), IoError>) {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((slot, cluster, r));
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our own eventfd.
        unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn drain_efd(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our own non-blocking eventfd.
        unsafe { libc::read(self.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

struct Slot {
    token: u64,
    op: IoOp,
    offset: u64,
    len: u64,
    iov: Vec<iovec>,
    /// Pieces submitted or waiting (plus one while the slot is being dispatched).
    outstanding: u32,
    err: Option<IoError>,
}

#[derive(Clone, Copy)]
struct Piece {
    slot: u32,
    /// Offset in the volume.
    off: u64,
    len: u64,
    /// Offset on the backing device.
    dev_off: u64,
    op: IoOp,
    /// Which of the volume's `io_count` buckets counts this piece ([`NOT_COUNTED`]: none).
    bucket: u8,
}

/// Bucket of a piece that does not touch a cluster of the volume that could be released.
const NOT_COUNTED: u8 = 2;

/// An [`IoChannel`] on a [`Lvol`].
pub(crate) struct LvolChannel {
    vol: Arc<Lvol>,
    backing: Box<dyn IoChannel>,
    shared: Arc<ChanShared>,
    epfd: Option<OwnedFd>,
    cs: u64,
    block_size: u64,
    max_segments: usize,
    backing_wz: bool,
    backing_discard: bool,
    slots: Vec<Slot>,
    free: Vec<u32>,
    done: Vec<Completion>,
    retry: VecDeque<Piece>,
    deferred: VecDeque<u32>,
    alloc_waits: usize,
    bdone: Vec<Completion>,
    ready: Vec<Ready>,
    scratch: Vec<iovec>,
}

// SAFETY: the raw pointers in the slots' iovecs are caller buffers that the `submit` contract
// keeps valid until completion; the channel is used by one thread at a time (it is `Send`, not
// `Sync`) and never dereferences them except to zero-fill read buffers the caller handed over.
unsafe impl Send for LvolChannel {}

fn new_fd(fd: libc::c_int, what: &'static str) -> Result<OwnedFd, BdevError> {
    if fd < 0 {
        return Err(BdevError::Io {
            what,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl LvolChannel {
    pub(crate) fn new(
        vol: Arc<Lvol>,
        depth: usize,
        max_segments: usize,
    ) -> Result<Self, BdevError> {
        let depth = depth.clamp(1, 1 << 16);
        let max_segments = max_segments.max(1);
        let binfo = vol.shared.dev.info();
        // A request may be split into one piece per cluster it touches.
        let backing = vol
            .shared
            .dev
            .open_channel(depth.saturating_mul(2), max_segments)?;
        // SAFETY: plain system call with constant flags.
        let efd = new_fd(
            unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) },
            "eventfd",
        )?;
        let epfd = match backing.notify_fd() {
            None => None,
            Some(bfd) => {
                // SAFETY: plain system call.
                let ep = new_fd(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }, "epoll")?;
                for fd in [efd.as_raw_fd(), bfd] {
                    let mut ev = libc::epoll_event {
                        events: libc::EPOLLIN as u32,
                        u64: fd as u64,
                    };
                    // SAFETY: `ev` is a valid epoll_event; both descriptors are open.
                    let r = unsafe {
                        libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev)
                    };
                    if r < 0 {
                        return Err(BdevError::Io {
                            what: "epoll_ctl",
                            source: std::io::Error::last_os_error(),
                        });
                    }
                }
                Some(ep)
            }
        };
        let slots = (0..depth)
            .map(|_| Slot {
                token: 0,
                op: IoOp::Flush,
                offset: 0,
                len: 0,
                iov: Vec::with_capacity(max_segments),
                outstanding: 0,
                err: None,
            })
            .collect();
        Ok(LvolChannel {
            cs: vol.shared.cluster_size,
            block_size: u64::from(binfo.block_size),
            max_segments,
            backing_wz: binfo.write_zeroes,
            backing_discard: binfo.discard,
            vol,
            backing,
            shared: Arc::new(ChanShared {
                ready: Mutex::new(Vec::with_capacity(depth)),
                efd,
            }),
            epfd,
            slots,
            free: (0..depth as u32).rev().collect(),
            done: Vec::with_capacity(depth),
            retry: VecDeque::with_capacity(depth * 2),
            deferred: VecDeque::with_capacity(depth),
            alloc_waits: 0,
            bdone: Vec::with_capacity(depth * 2),
            ready: Vec::with_capacity(depth),
            scratch: Vec::with_capacity(max_segments),
        })
    }

    /// Completes slot `s` if nothing is outstanding.
    fn maybe_finish(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        if slot.outstanding != 0 {
            return;
        }
        let result = match slot.err.take() {
            Some(e) => Err(e),
            None => Ok(match slot.op {
                IoOp::Read | IoOp::Write => slot.len,
                _ => 0,
            }),
        };
        self.done.push(Completion {
            token: slot.token,
            result,
        });
        slot.iov.clear();
        self.free.push(s);
        self.vol.inflight.fetch_sub(1, Ordering::SeqCst);
    }

    fn fail(&mut self, s: u32, e: IoError) {
        self.slots[s as usize].err.get_or_insert(e);
    }

    /// Submits one piece to the backing channel, or queues it for retry when that is full.
    /// The caller has counted it in `outstanding`. Returns false on a hard error.
    fn issue(&mut self, p: Piece) -> bool {
        let slot = &self.slots[p.slot as usize];
        self.scratch.clear();
        if matches!(p.op, IoOp::Read | IoOp::Write) {
            // Slice the slot's iovecs to [p.off - slot.offset, + p.len).
            let mut skip = (p.off - slot.offset) as usize;
            let mut want = p.len as usize;
            for v in &slot.iov {
                if want == 0 {
                    break;
                }
                if skip >= v.iov_len {
                    skip -= v.iov_len;
                    continue;
                }
                let n = (v.iov_len - skip).min(want);
                self.scratch.push(iovec {
                    // SAFETY: `skip < iov_len`, so the pointer stays inside the caller's buffer.
                    iov_base: unsafe { v.iov_base.cast::<u8>().add(skip) }.cast(),
                    iov_len: n,
                });
                skip = 0;
                want -= n;
            }
        }
        let req = IoRequest {
            op: p.op,
            offset: p.dev_off,
            len: if p.op == IoOp::Flush { 0 } else { p.len },
            iov: &self.scratch,
            token: u64::from(p.slot) | (u64::from(p.bucket) << 32),
        };
        // SAFETY: the buffers are sub-ranges of the ones the caller passed to our `submit`,
        // whose contract keeps them valid until we return the slot's completion, which happens
        // only after every piece has completed on the backing channel.
        match unsafe { self.backing.submit(&req) } {
            Ok(()) => true,
            Err(SubmitError::Full) => {
                self.retry.push_back(p);
                true
            }
            Err(e) => {
                self.fail(p.slot, e.into());
                self.vol.uncount(p.bucket);
                let slot = &mut self.slots[p.slot as usize];
                slot.outstanding -= 1;
                false
            }
        }
    }

    /// Zero-fills bytes [off - slot.offset, + len) of a read slot's buffers.
    fn zero_fill(&mut self, s: u32, off: u64, len: u64) {
        let slot = &self.slots[s as usize];
        let mut skip = (off - slot.offset) as usize;
        let mut want = len as usize;
        for v in &slot.iov {
            if want == 0 {
                break;
            }
            if skip >= v.iov_len {
                skip -= v.iov_len;
                continue;
            }
            let n = (v.iov_len - skip).min(want);
            // SAFETY: a read buffer handed to `submit`, valid for writes of `iov_len` bytes
            // until its completion; `skip + n <= iov_len`.
            unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>().add(skip), 0, n) };
            skip = 0;
            want -= n;
        }
    }

    /// Dispatches a slot: one piece per cluster touched.
    fn start(&mut self, s: u32) {
        let (op, offset, len) = {
            let sl = &mut self.slots[s as usize];
            sl.outstanding = 1;
            (sl.op, sl.offset, sl.len)
        };
        if op == IoOp::Flush {
            self.slots[s as usize].outstanding += 1;
            self.issue(Piece {
                slot: s,
                off: 0,
                len: 0,
                dev_off: 0,
                op,
                bucket: NOT_COUNTED,
            });
        } else {
            let vol = self.vol.clone();
            let st = vol.st();
            if st.deleted {
                self.fail(s, IoError::Errno(libc::ENODEV));
            } else if op.is_write() && st.read_only {
                self.fail(s, IoError::Errno(libc::EROFS));
            } else if offset + len > st.map.len() as u64 * self.cs {
                self.fail(s, IoError::Errno(libc::EINVAL));
            } else {
                let mut o = offset;
                let end = offset + len;
                while o < end {
                    let c = o / self.cs;
                    let n = ((c + 1) * self.cs).min(end) - o;
                    self.dispatch_piece(&st, &vol, s, op, c, o, n, true);
                    o += n;
                }
            }
        }
        self.slots[s as usize].outstanding -= 1;
        self.maybe_finish(s);
    }

    /// Maps one piece (within cluster `c`) and issues it, parks it for an allocation or a
    /// release, or completes it at once. `may_release`: a whole-cluster discard may release
    /// the cluster (false once the store declined to).
    #[allow(clippy::too_many_arguments)]
    fn dispatch_piece(
        &mut self,
        st: &VolState,
        vol: &Arc<Lvol>,
        s: u32,
        op: IoOp,
        c: u64,
        off: u64,
        len: u64,
        may_release: bool,
    ) {
        let in_off = off - c * self.cs;
        let own = st.map[c as usize];
        // Pieces on the volume's own clusters of a thin volume are counted, so that a release
        // can wait for those issued before it unmapped the cluster.
        let piece = |phys: u32, op: IoOp| Piece {
            slot: s,
            off,
            len,
            dev_off: u64::from(phys) * self.cs + in_off,
            op,
            bucket: if st.thin && phys == own {
                vol.count()
            } else {
                NOT_COUNTED
            },
        };
        match op {
            IoOp::Read => match Lvol::resolve(st, c) {
                Some(p) => {
                    self.slots[s as usize].outstanding += 1;
                    let p = piece(p, op);
                    self.issue(p);
                }
                None => self.zero_fill(s, off, len),
            },
            IoOp::Write | IoOp::WriteZeroes { .. } | IoOp::Discard => {
                if own != 0 {
                    // A discard (or write-zeroes that allows unmapping) of a whole cluster of a
                    // thin volume, where reading it unallocated gives zeroes, gives the cluster
                    // back to the store (SPDK releases clusters of thin blobs on unmap).
                    let unmap = matches!(op, IoOp::Discard | IoOp::WriteZeroes { unmap: true });
                    if may_release
                        && unmap
                        && st.thin
                        && !st.read_only
                        && in_off == 0
                        && len == self.cs
                        && !Lvol::ancestor_has(st, c)
                    {
                        let w = Waiter {
                            chan: self.shared.clone(),
                            slot: s,
                        };
                        if let AllocReq::Queued = vol.shared.request_release(vol, c, w) {
                            self.slots[s as usize].outstanding += 1;
                            self.alloc_waits += 1;
                            return;
                        }
                    }
                    let op = match op {
                        IoOp::Discard if !self.backing_discard => return,
                        IoOp::WriteZeroes { .. } if !self.backing_wz => {
                            self.fail(s, IoError::Unsupported);
                            return;
                        }
                        o => o,
                    };
                    self.slots[s as usize].outstanding += 1;
                    let p = piece(own, op);
                    self.issue(p);
                    return;
                }
                // Unallocated. Discard never allocates; write-zeroes only when an ancestor
                // has data there.
                if op == IoOp::Discard || (op != IoOp::Write && Lvol::resolve(st, c).is_none()) {
                    return;
                }
                let w = Waiter {
                    chan: self.shared.clone(),
                    slot: s,
                };
                match vol.shared.request_alloc(vol, c, w) {
                    AllocReq::Queued => {
                        self.slots[s as usize].outstanding += 1;
                        self.alloc_waits += 1;
                    }
                    AllocReq::Closed => self.fail(s, IoError::Errno(libc::ENODEV)),
                }
            }
            IoOp::Flush => {}
        }
    }

    /// Issues the pieces of slot `s` that fall in cluster `c` after the store allocated or
    /// released it (or declined to release it): the cluster is mapped again from the volume's
    /// current state, so a write that waited behind a release allocates a new cluster, and a
    /// discard whose release was declined goes to the device as before.
    fn resume(&mut self, s: u32, c: u64) {
        let (op, offset, len) = {
            let sl = &self.slots[s as usize];
            (sl.op, sl.offset, sl.len)
        };
        let off = offset.max(c * self.cs);
        let end = (offset + len).min((c + 1) * self.cs);
        if off >= end {
            return;
        }
        let vol = self.vol.clone();
        let st = vol.st();
        if st.deleted || c as usize >= st.map.len() {
            // Shrink and delete drain I/O first, so this cannot happen while the slot waits.
            self.fail(s, IoError::Errno(libc::EIO));
            return;
        }
        self.dispatch_piece(&st, &vol, s, op, c, off, end - off, false);
    }

    /// Where a read or write that lies within one cluster goes on the backing device, when
    /// that needs no allocation, release or zero-fill: (device offset, count bucket).
    fn direct_map(&self, st: &VolState, req: &IoRequest<'_>) -> Option<(u64, u8)> {
        if st.deleted || req.len == 0 {
            return None;
        }
        let c = req.offset / self.cs;
        if (req.offset + req.len - 1) / self.cs != c {
            return None;
        }
        let own = *st.map.get(c as usize)?;
        let phys = match req.op {
            IoOp::Read => Lvol::resolve(st, c)?,
            IoOp::Write if own != 0 => own,
            _ => return None,
        };
        let bucket = if st.thin && phys == own {
            self.vol.count()
        } else {
            NOT_COUNTED
        };
        Some((
            u64::from(phys) * self.cs + (req.offset - c * self.cs),
            bucket,
        ))
    }

    fn progress(&mut self) -> bool {
        let mut moved = false;
        self.bdone.clear();
        if self.backing.poll(&mut self.bdone) > 0 {
            moved = true;
            let bdone = std::mem::take(&mut self.bdone);
            for c in &bdone {
                let s = (c.token & 0xffff_ffff) as u32;
                let bucket = c.token >> 32;
                if s as usize >= self.slots.len()
                    || bucket > u64::from(NOT_COUNTED)
                    || self.slots[s as usize].outstanding == 0
                {
                    tracing::error!("backing device returned unknown token {}", c.token);
                    continue;
                }
                self.vol.uncount(bucket as u8);
                if let Err(e) = c.result {
                    self.fail(s, e);
                }
                self.slots[s as usize].outstanding -= 1;
                self.maybe_finish(s);
            }
            self.bdone = bdone;
        }
        if self.alloc_waits > 0 {
            self.shared.drain_efd();
            {
                let mut r = self.shared.ready.lock().unwrap_or_else(|e| e.into_inner());
                std::mem::swap(&mut *r, &mut self.ready);
            }
            if !self.ready.is_empty() {
                moved = true;
                let ready = std::mem::take(&mut self.ready);
                for &(s, c, r) in &ready {
                    self.alloc_waits -= 1;
                    match r {
                        Ok(()) => self.resume(s, c),
                        Err(e) => self.fail(s, e),
                    }
                    self.slots[s as usize].outstanding -= 1;
                    self.maybe_finish(s);
                }
                self.ready = ready;
                self.ready.clear();
            }
        }
        let mut submitted = moved;
        while let Some(p) = self.retry.pop_front() {
            let before = self.retry.len();
            self.issue(p);
            submitted = true;
            if self.retry.len() > before {
                // Queued again: the backing channel is still full.
                break;
            }
        }
        if !self.deferred.is_empty() && self.vol.frozen.load(Ordering::SeqCst) == 0 {
            while let Some(s) = self.deferred.pop_front() {
                self.vol.inflight.fetch_add(1, Ordering::SeqCst);
                if self.vol.frozen.load(Ordering::SeqCst) != 0 {
                    self.vol.inflight.fetch_sub(1, Ordering::SeqCst);
                    self.deferred.push_front(s);
                    break;
                }
                self.start(s);
                moved = true;
                submitted = true;
            }
        }
        if submitted {
            if let Err(e) = self.backing.commit() {
                tracing::error!("lvol backing commit: {e}");
            }
        }
        moved
    }
}

impl IoChannel for LvolChannel {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        let bs = self.block_size;
        let st = self.vol.st();
        if req.op != IoOp::Flush {
            if req.offset % bs != 0 || req.len % bs != 0 {
                return Err(SubmitError::Misaligned {
                    offset: req.offset,
                    len: req.len,
                });
            }
            let size = st.map.len() as u64 * self.cs;
            if req.op.is_write() && st.read_only {
                return Err(SubmitError::ReadOnly);
            }
            if req.offset.checked_add(req.len).is_none_or(|e| e > size) {
                return Err(SubmitError::OutOfRange {
                    offset: req.offset,
                    len: req.len,
                    size,
                });
            }
            if matches!(req.op, IoOp::Read | IoOp::Write) {
                let total = req
                    .iov
                    .iter()
                    .try_fold(0u64, |a, v| a.checked_add(v.iov_len as u64));
                if req.iov.is_empty() || req.iov.len() > self.max_segments || total != Some(req.len)
                {
                    return Err(SubmitError::BadBuffers);
                }
            }
            if matches!(req.op, IoOp::WriteZeroes { .. }) && !self.backing_wz {
                return Err(SubmitError::Unsupported);
            }
        }
        // Finished slots are recycled at once, but their completions count until polled.
        if self.in_flight() >= self.slots.len() {
            return Err(SubmitError::Full);
        }
        let Some(s) = self.free.pop() else {
            return Err(SubmitError::Full);
        };
        {
            let sl = &mut self.slots[s as usize];
            sl.token = req.token;
            sl.op = req.op;
            sl.offset = req.offset;
            sl.len = req.len;
            sl.iov.clear();
            sl.err = None;
            sl.outstanding = 0;
        }
        self.vol.inflight.fetch_add(1, Ordering::SeqCst);
        if self.vol.frozen.load(Ordering::SeqCst) != 0 {
            self.vol.inflight.fetch_sub(1, Ordering::SeqCst);
            self.slots[s as usize].iov.extend_from_slice(req.iov);
            self.deferred.push_back(s);
            return Ok(());
        }
        // Fast path: a read or write within one mapped cluster goes to the backing channel
        // with the caller's iovecs as they are (no copy into the slot, no slicing).
        if let Some((dev_off, bucket)) = self.direct_map(&st, req) {
            self.slots[s as usize].outstanding = 1;
            let breq = IoRequest {
                op: req.op,
                offset: dev_off,
                len: req.len,
                iov: req.iov,
                token: u64::from(s) | (u64::from(bucket) << 32),
            };
            // SAFETY: the caller's buffers, valid until we return this slot's completion,
            // which happens only after the backing channel completed the request.
            let r = unsafe { self.backing.submit(&breq) };
            drop(st);
            match r {
                Ok(()) => {}
                Err(SubmitError::Full) => {
                    // Kept for a retry from `poll`, which slices the slot's own iovecs.
                    self.slots[s as usize].iov.extend_from_slice(req.iov);
                    self.retry.push_back(Piece {
                        slot: s,
                        off: req.offset,
                        len: req.len,
                        dev_off,
                        op: req.op,
                        bucket,
                    });
                }
                Err(e) => {
                    self.vol.uncount(bucket);
                    let sl = &mut self.slots[s as usize];
                    sl.outstanding = 0;
                    sl.err = Some(e.into());
                    self.maybe_finish(s);
                }
            }
            return Ok(());
        }
        drop(st);
        self.slots[s as usize].iov.extend_from_slice(req.iov);
        self.start(s);
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BdevError> {
        self.backing.commit()
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        for _ in 0..64 {
            if !self.progress() {
                break;
            }
        }
        let n = self.done.len();
        out.append(&mut self.done);
        n
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), BdevError> {
        if !self.done.is_empty() || self.free.len() == self.slots.len() {
            return Ok(());
        }
        let nap = Duration::from_millis(1);
        if self.alloc_waits == 0 {
            if self.backing.in_flight() > 0 || self.deferred.is_empty() {
                return self.backing.wait(timeout);
            }
            // Only requests deferred by a freeze (snapshot, delete): check again shortly.
            std::thread::sleep(timeout.unwrap_or(nap).min(nap));
            return Ok(());
        }
        if self.epfd.is_none() && self.backing.in_flight() > 0 {
            // Inline backing: its completions are ready now.
            return Ok(());
        }
        let fd = self.notify_fd().unwrap_or(-1);
        let mut timeout = timeout;
        if !self.deferred.is_empty() {
            timeout = Some(timeout.unwrap_or(nap).min(nap));
        }
        let ms = match timeout {
            None => -1,
            Some(t) => t.as_millis().min(i32::MAX as u128) as i32,
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(BdevError::Io {
                    what: "poll",
                    source: e,
                });
            }
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len() + self.done.len()
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(match &self.epfd {
            Some(ep) => ep.as_raw_fd(),
            None => self.shared.efd.as_raw_fd(),
        })
    }

    fn clear_notify(&mut self) {
        self.shared.drain_efd();
        self.backing.clear_notify();
    }
}

impl Drop for LvolChannel {
    fn drop(&mut self) {
        let active = self.slots.len() - self.free.len() - self.deferred.len();
        self.vol.inflight.fetch_sub(active as u64, Ordering::SeqCst);
    }
}
