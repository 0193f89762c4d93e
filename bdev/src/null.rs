//! The null device: writes are dropped, reads return zeroes (like SPDK's null bdev, which leaves
//! read buffers untouched; katablk zeroes them so a guest never sees stale memory).

use std::sync::Arc;

use crate::inline::{InlineChannel, InlineExec};
use crate::{BdevError, BlockDevice, DeviceInfo, IoChannel, IoError, IoOp, IoRequest};

/// A device of a given size that stores nothing.
#[derive(Debug)]
pub struct NullDevice {
    inner: Arc<NullInner>,
}

#[derive(Debug)]
struct NullInner {
    info: DeviceInfo,
    zero_reads: bool,
}

impl NullDevice {
    /// A null device of `num_blocks` blocks of `block_size` bytes. With `zero_reads` false, reads
    /// leave the buffers untouched (measures pure protocol overhead, as SPDK's null bdev).
    pub fn new(num_blocks: u64, block_size: u32, zero_reads: bool) -> Result<Self, BdevError> {
        crate::check_block_size(block_size)?;
        if num_blocks == 0 {
            return Err(BdevError::Invalid("size must be non-zero".into()));
        }
        Ok(NullDevice {
            inner: Arc::new(NullInner {
                info: DeviceInfo {
                    block_size,
                    num_blocks,
                    read_only: false,
                    volatile_cache: false,
                    discard: true,
                    write_zeroes: true,
                    buf_align: 1,
                    physical_block_size: block_size,
                    optimal_io_size: 0,
                },
                zero_reads,
            }),
        })
    }
}

impl InlineExec for NullInner {
    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    unsafe fn exec(&self, req: &IoRequest<'_>) -> Result<u64, IoError> {
        if req.op == IoOp::Read && self.zero_reads {
            for v in req.iov {
                // SAFETY: the caller guarantees each iovec is a valid writable buffer of
                // `iov_len` bytes for the duration of the request.
                unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
            }
        }
        Ok(match req.op {
            IoOp::Read | IoOp::Write => req.len,
            _ => 0,
        })
    }
}

impl BlockDevice for NullDevice {
    fn info(&self) -> DeviceInfo {
        self.inner.info.clone()
    }

    fn open_channel(
        &self,
        depth: usize,
        max_segments: usize,
    ) -> Result<Box<dyn IoChannel>, BdevError> {
        Ok(Box::new(InlineChannel::new(
            self.inner.clone(),
            depth,
            max_segments,
        )))
    }

    fn describe(&self) -> String {
        format!("null ({} bytes)", self.inner.info.size_bytes())
    }
}
