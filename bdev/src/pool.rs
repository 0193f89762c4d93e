//! [`IoMode::ThreadPool`](crate::file::IoMode::ThreadPool): blocking system calls on a few worker
//! threads, for hosts where io_uring is unavailable (old kernels, `kernel.io_uring_disabled`,
//! seccomp filters in some container runtimes).
//!
//! The workers belong to one channel, not to the device. Channels are per queue thread and fully
//! independent, so a per-channel pool needs no routing of completions between channels, its
//! slots, queues and lock are touched only by its own submitter and workers (no cross-queue lock
//! contention), and shutdown is scoped to the channel: `Drop` lets the workers finish every
//! request already handed over and joins them, after which no thread can touch the caller's
//! buffers. The cost is `min(depth, POOL_THREADS)` threads per channel, which is small for the
//! handful of queues a vhost-user-blk device has.
//!
//! Requests are copied (the iovec array, not the data) into slots preallocated at open time, so
//! nothing is allocated per request. Completions go to a preallocated queue; the channel's
//! eventfd is signalled when that queue becomes non-empty (clear it with `clear_notify` *before*
//! polling so no wake-up is lost).

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::eventfd::EventFd;
use crate::file_io::FileInner;
use crate::inline::validate;
use crate::{iovec, BdevError, Completion, IoChannel, IoOp, IoRequest, SubmitError};

/// Worker threads per channel (fewer if the channel is shallower).
pub(crate) const POOL_THREADS: usize = 4;

/// A request waiting for or running on a worker.
#[derive(Debug, Clone, Copy)]
struct SlotMeta {
    op: IoOp,
    offset: u64,
    len: u64,
    token: u64,
    /// Number of iovecs in the slot's part of `State::iovs`.
    nseg: usize,
}

/// Everything shared between the submitter and the workers, under one mutex.
struct State {
    slots: Box<[SlotMeta]>,
    /// `slots.len() * max_segments` iovecs; slot `i` owns `[i * max_segments, ..)`.
    iovs: Box<[iovec]>,
    free: Vec<u32>,
    /// Slots handed to the workers, oldest first.
    pending: VecDeque<u32>,
    /// Finished requests not yet polled.
    done: VecDeque<Completion>,
    /// Requests pending or running on a worker.
    busy: usize,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when work is queued or shutdown starts.
    work: Condvar,
    /// Signalled when a request finishes.
    finished: Condvar,
    efd: EventFd,
    inner: Arc<FileInner>,
    max_segments: usize,
}

// SAFETY: the only non-`Send`/`Sync` data are the iovec copies inside `State`, always accessed under
// the mutex. Their raw pointers refer to buffers the caller lent to the channel under the contract
// of `IoChannel::submit`, which is not tied to a thread; a worker dereferences them only while
// executing the request, before it reports the completion.
unsafe impl Send for Shared {}
// SAFETY: see `Send`; all mutable state is behind the mutex.
unsafe impl Sync for Shared {}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A worker never panics while holding the lock with the state half-updated, so a poisoned
        // lock still guards consistent data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An [`IoChannel`] served by its own small pool of worker threads.
pub(crate) struct PoolChannel {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    depth: usize,
    /// Requests submitted and not yet returned by `poll`.
    in_flight: usize,
    /// Requests submitted since the last `commit` (for waking the right number of workers).
    staged: usize,
}

impl PoolChannel {
    /// Starts `min(depth, POOL_THREADS)` workers for a channel of `depth` slots of up to
    /// `max_segments` buffers.
    pub(crate) fn new(
        inner: Arc<FileInner>,
        depth: usize,
        max_segments: usize,
    ) -> Result<Self, BdevError> {
        let depth = depth.max(1);
        let max_segments = max_segments.max(1);
        let n_iov = depth.checked_mul(max_segments).ok_or_else(|| {
            BdevError::Invalid(format!(
                "depth {depth} x {max_segments} segments is too large"
            ))
        })?;
        let empty = SlotMeta {
            op: IoOp::Flush,
            offset: 0,
            len: 0,
            token: 0,
            nseg: 0,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                slots: vec![empty; depth].into_boxed_slice(),
                iovs: vec![
                    iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    };
                    n_iov
                ]
                .into_boxed_slice(),
                free: (0..depth as u32).rev().collect(),
                pending: VecDeque::with_capacity(depth),
                done: VecDeque::with_capacity(depth),
                busy: 0,
                shutdown: false,
            }),
            work: Condvar::new(),
            finished: Condvar::new(),
            efd: EventFd::new()?,
            inner,
            max_segments,
        });
        let n = depth.min(POOL_THREADS);
        let mut ch = PoolChannel {
            shared,
            workers: Vec::with_capacity(n),
            depth,
            in_flight: 0,
            staged: 0,
        };
        for i in 0..n {
            let sh = ch.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("bdev-pool-{i}"))
                .spawn(move || worker(&sh))
                // On failure `ch` is dropped, which stops and joins the workers started so far.
                .map_err(|e| BdevError::io("spawn I/O worker", e))?;
            ch.workers.push(h);
        }
        Ok(ch)
    }
}

/// A worker: takes slots off `pending`, executes them with blocking calls, reports completions.
/// Exits when shutdown is requested and nothing is pending.
fn worker(sh: &Shared) {
    let mut iov: Vec<iovec> = Vec::with_capacity(sh.max_segments);
    let mut st = sh.lock();
    loop {
        let Some(idx) = st.pending.pop_front() else {
            if st.shutdown {
                return;
            }
            st = sh.work.wait(st).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let idx = idx as usize;
        let meta = st.slots[idx];
        let base = idx * sh.max_segments;
        iov.clear();
        iov.extend_from_slice(&st.iovs[base..base + meta.nseg]);
        // The slot's copy is no longer needed: free it now (the request stays counted in the
        // submitter's `in_flight` until polled, so this cannot overcommit `done`).
        st.free.push(idx as u32);
        drop(st);

        let req = IoRequest {
            op: meta.op,
            offset: meta.offset,
            len: meta.len,
            iov: &iov,
            token: meta.token,
        };
        // SAFETY: the buffers stay valid until the completion is polled or the channel dropped
        // (`IoChannel::submit`'s contract); the completion is only published below, and `Drop`
        // joins this thread before returning.
        let result = unsafe { sh.inner.exec_blocking(&req) };

        st = sh.lock();
        let was_empty = st.done.is_empty();
        st.done.push_back(Completion {
            token: meta.token,
            result,
        });
        st.busy -= 1;
        if was_empty {
            sh.efd.signal();
        }
        sh.finished.notify_all();
    }
}

impl IoChannel for PoolChannel {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        if self.in_flight >= self.depth {
            return Err(SubmitError::Full);
        }
        validate(&self.shared.inner.info(), req, self.shared.max_segments)?;
        let mut st = self.shared.lock();
        // Every slot in use belongs to a request counted in `in_flight`, so one is free.
        let idx = st.free.pop().ok_or(SubmitError::Full)? as usize;
        let base = idx * self.shared.max_segments;
        st.iovs[base..base + req.iov.len()].copy_from_slice(req.iov);
        st.slots[idx] = SlotMeta {
            op: req.op,
            offset: req.offset,
            len: req.len,
            token: req.token,
            nseg: req.iov.len(),
        };
        st.pending.push_back(idx as u32);
        st.busy += 1;
        drop(st);
        self.in_flight += 1;
        self.staged += 1;
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BdevError> {
        match self.staged {
            0 => {}
            1 => self.shared.work.notify_one(),
            _ => self.shared.work.notify_all(),
        }
        self.staged = 0;
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let mut st = self.shared.lock();
        let n = st.done.len();
        out.extend(st.done.drain(..));
        drop(st);
        self.in_flight -= n;
        n
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), BdevError> {
        // Requests queued without `commit` would never finish while we sleep: start them.
        self.commit()?;
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut st = self.shared.lock();
        while st.done.is_empty() && st.busy > 0 {
            st = match (timeout, deadline) {
                (Some(_), Some(d)) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    self.shared
                        .finished
                        .wait_timeout(st, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                (Some(t), None) if t.is_zero() => break,
                _ => self
                    .shared
                    .finished
                    .wait(st)
                    .unwrap_or_else(|e| e.into_inner()),
            };
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.shared.efd.fd())
    }

    fn clear_notify(&mut self) {
        self.shared.efd.clear();
    }
}

impl Drop for PoolChannel {
    fn drop(&mut self) {
        // Workers drain `pending` before honouring shutdown, so every request handed over is
        // finished (and no longer touches caller buffers) once they are joined.
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for h in self.workers.drain(..) {
            if h.join().is_err() {
                tracing::error!("bdev I/O worker panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::{FileDevice, FileOptions, IoMode};
    use crate::BlockDevice;

    #[test]
    fn uncommitted_requests_run_on_wait_and_drop() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let opts = FileOptions {
            mode: IoMode::ThreadPool,
            ..Default::default()
        };
        let d = FileDevice::open(f.path(), &opts).unwrap();
        let mut ch = d.open_channel(8, 1).unwrap();
        let mut buf = vec![7u8; 4096];
        let iov = [iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        let w = IoRequest {
            op: IoOp::Write,
            offset: 0,
            len: 4096,
            iov: &iov,
            token: 1,
        };
        // SAFETY: `buf` outlives the channel.
        unsafe { ch.submit(&w).unwrap() };
        let mut out = Vec::new();
        while out.is_empty() {
            ch.wait(None).unwrap();
            ch.poll(&mut out);
        }
        assert_eq!(out[0].result, Ok(4096));
        for t in 0..8 {
            // SAFETY: `buf` outlives the channel, whose drop finishes the writes.
            unsafe {
                ch.submit(&IoRequest {
                    token: t,
                    offset: t * 4096,
                    ..w
                })
                .unwrap()
            };
        }
        drop(ch);
        let back = std::fs::read(f.path()).unwrap();
        assert!(back[..8 * 4096].iter().all(|&b| b == 7));
        assert_eq!(buf[0], 7);
        buf[0] = 0;
    }

    #[test]
    fn notify_fd_signals() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let opts = FileOptions {
            mode: IoMode::ThreadPool,
            ..Default::default()
        };
        let d = FileDevice::open(f.path(), &opts).unwrap();
        let mut ch = d.open_channel(2, 1).unwrap();
        let fd = ch.notify_fd().unwrap();
        let fl = IoRequest::no_data(IoOp::Flush, 0, 0, 3);
        // SAFETY: no buffers.
        unsafe { ch.submit(&fl).unwrap() };
        ch.commit().unwrap();
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, 10_000) };
        assert_eq!(r, 1);
        ch.clear_notify();
        let mut out = Vec::new();
        assert_eq!(ch.poll(&mut out), 1);
        assert_eq!(out[0].result, Ok(0));
    }
}
