//! Blocking helpers over an [`IoChannel`], for metadata I/O, tools and tests.

use crate::{
    iovec, BdevError, BlockDevice, Completion, IoChannel, IoError, IoOp, IoRequest, SubmitError,
};

/// Why a blocking request failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The request was refused at submission.
    #[error("request refused: {0}")]
    Submit(#[from] SubmitError),
    /// The request failed.
    #[error("request failed: {0}")]
    Io(#[from] IoError),
    /// The channel failed.
    #[error(transparent)]
    Bdev(#[from] BdevError),
}

/// One channel used synchronously: every call submits one request and waits for it.
pub struct SyncIo {
    ch: Box<dyn IoChannel>,
    done: Vec<Completion>,
    next: u64,
}

impl SyncIo {
    /// Opens a channel of depth 1 with up to 64 segments on `dev`.
    pub fn new(dev: &dyn BlockDevice) -> Result<Self, BdevError> {
        Ok(Self::from_channel(dev.open_channel(1, 64)?))
    }

    /// Wraps an existing channel (which must have nothing in flight).
    pub fn from_channel(ch: Box<dyn IoChannel>) -> Self {
        SyncIo {
            ch,
            done: Vec::with_capacity(4),
            next: 0,
        }
    }

    fn run(&mut self, op: IoOp, offset: u64, len: u64, iov: &[iovec]) -> Result<u64, SyncError> {
        self.next = self.next.wrapping_add(1);
        let token = self.next;
        let req = IoRequest {
            op,
            offset,
            len,
            iov,
            token,
        };
        // SAFETY: the buffers are borrowed by the callers of `run` for its whole duration, and
        // `run` does not return before the completion for `token` has been polled (or the
        // channel reported a failure, after which it is dropped with the buffers still borrowed).
        unsafe { self.ch.submit(&req)? };
        self.ch.commit()?;
        loop {
            self.done.clear();
            self.ch.poll(&mut self.done);
            if let Some(c) = self.done.iter().find(|c| c.token == token) {
                return Ok(c.result?);
            }
            self.ch.wait(None)?;
        }
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), SyncError> {
        let iov = [iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        let n = self.run(IoOp::Read, offset, buf.len() as u64, &iov)?;
        short(n, buf.len() as u64)
    }

    /// Writes `buf` at `offset`.
    pub fn write_at(&mut self, offset: u64, buf: &[u8]) -> Result<(), SyncError> {
        let iov = [iovec {
            iov_base: buf.as_ptr().cast_mut().cast(),
            iov_len: buf.len(),
        }];
        let n = self.run(IoOp::Write, offset, buf.len() as u64, &iov)?;
        short(n, buf.len() as u64)
    }

    /// Makes completed writes durable.
    pub fn flush(&mut self) -> Result<(), SyncError> {
        self.run(IoOp::Flush, 0, 0, &[]).map(|_| ())
    }

    /// Discards a range.
    pub fn discard(&mut self, offset: u64, len: u64) -> Result<(), SyncError> {
        self.run(IoOp::Discard, offset, len, &[]).map(|_| ())
    }

    /// Zeroes a range.
    pub fn write_zeroes(&mut self, offset: u64, len: u64, unmap: bool) -> Result<(), SyncError> {
        self.run(IoOp::WriteZeroes { unmap }, offset, len, &[])
            .map(|_| ())
    }
}

fn short(done: u64, wanted: u64) -> Result<(), SyncError> {
    if done == wanted {
        Ok(())
    } else {
        Err(IoError::Short { done, wanted }.into())
    }
}
