//! A channel for devices whose requests complete within `submit`: RAM, null, and files served
//! with inline system calls. Completions wait in a preallocated ring until polled.

use std::os::fd::RawFd;
use std::time::Duration;

use crate::{BdevError, Completion, DeviceInfo, IoChannel, IoError, IoOp, IoRequest, SubmitError};

/// Executes one validated request synchronously.
pub(crate) trait InlineExec: Send + Sync {
    /// Current device properties.
    fn info(&self) -> DeviceInfo;
    /// Performs the request, returning the bytes transferred.
    ///
    /// # Safety
    ///
    /// The buffers in `req.iov` are valid for the duration of the call (see
    /// [`IoChannel::submit`]).
    unsafe fn exec(&self, req: &IoRequest<'_>) -> Result<u64, IoError>;
}

/// Checks a request against the device properties and channel limits.
pub(crate) fn validate(
    info: &DeviceInfo,
    req: &IoRequest<'_>,
    max_segments: usize,
) -> Result<(), SubmitError> {
    if req.op.is_write() && info.read_only {
        return Err(SubmitError::ReadOnly);
    }
    match req.op {
        IoOp::Read | IoOp::Write => {
            if req.iov.len() > max_segments || req.iov.is_empty() {
                return Err(SubmitError::BadBuffers);
            }
            let total = req
                .iov
                .iter()
                .try_fold(0u64, |acc, v| acc.checked_add(v.iov_len as u64));
            if total != Some(req.len) {
                return Err(SubmitError::BadBuffers);
            }
            if info.buf_align > 1 {
                let a = info.buf_align as usize;
                if req
                    .iov
                    .iter()
                    .any(|v| (v.iov_base as usize) % a != 0 || v.iov_len % a != 0)
                {
                    return Err(SubmitError::BadBuffers);
                }
            }
            info.check_range(req.offset, req.len)
        }
        IoOp::Flush => Ok(()),
        IoOp::Discard => {
            if !info.discard {
                return Err(SubmitError::Unsupported);
            }
            info.check_range(req.offset, req.len)
        }
        IoOp::WriteZeroes { .. } => {
            if !info.write_zeroes {
                return Err(SubmitError::Unsupported);
            }
            info.check_range(req.offset, req.len)
        }
    }
}

/// An [`IoChannel`] that runs each request inside `submit`.
pub(crate) struct InlineChannel<E: InlineExec> {
    exec: std::sync::Arc<E>,
    done: Vec<Completion>,
    depth: usize,
    max_segments: usize,
}

impl<E: InlineExec> InlineChannel<E> {
    pub(crate) fn new(exec: std::sync::Arc<E>, depth: usize, max_segments: usize) -> Self {
        InlineChannel {
            exec,
            done: Vec::with_capacity(depth.max(1)),
            depth: depth.max(1),
            max_segments: max_segments.max(1),
        }
    }
}

impl<E: InlineExec + 'static> IoChannel for InlineChannel<E> {
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError> {
        if self.done.len() >= self.depth {
            return Err(SubmitError::Full);
        }
        validate(&self.exec.info(), req, self.max_segments)?;
        // SAFETY: the caller guarantees the buffers are valid until the completion is polled,
        // which is after this call returns.
        let result = unsafe { self.exec.exec(req) };
        self.done.push(Completion {
            token: req.token,
            result,
        });
        Ok(())
    }

    fn commit(&mut self) -> Result<(), BdevError> {
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        // In submission order; one copy of the whole batch (a polling worker calls this on
        // every turn, mostly with nothing done).
        let n = self.done.len();
        if n > 0 {
            out.append(&mut self.done);
        }
        n
    }

    fn wait(&mut self, _timeout: Option<Duration>) -> Result<(), BdevError> {
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    fn notify_fd(&self) -> Option<RawFd> {
        None
    }
}
