//! The katablk block-device layer.
//!
//! A [`BlockDevice`] is a sized, block-addressed store. I/O is done through per-thread
//! [`IoChannel`]s (one per vhost queue worker, like SPDK's io_channels): requests are queued with
//! [`IoChannel::submit`], handed to the device with [`IoChannel::commit`] and reaped with
//! [`IoChannel::poll`]. Buffers are caller-owned `iovec`s, so guest memory mapped by the vhost
//! backend is passed straight to the device with no bounce buffer.
//!
//! Implementations: [`file::FileDevice`] (regular file or block device; io_uring, a thread pool,
//! or inline system calls), [`malloc::MallocDevice`] (RAM) and [`null::NullDevice`].

#![deny(missing_docs)]

mod error;
mod eventfd;
pub mod file;
mod file_io;
mod inline;
pub mod malloc;
mod memfile;
pub mod null;
mod pool;
pub mod qos;
pub mod shm;
pub mod sigbus;
pub mod sync;
mod uring;

use std::os::fd::RawFd;
use std::time::Duration;

pub use error::{BdevError, IoError, ParseIoModeError, SubmitError};
pub use libc::iovec;

/// Static and dynamic properties of a block device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Logical block size in bytes (512 or 4096): the unit of addressing and alignment.
    pub block_size: u32,
    /// Capacity in logical blocks. May grow or shrink at run time (lvol resize).
    pub num_blocks: u64,
    /// Writes, discards and write-zeroes are refused.
    pub read_only: bool,
    /// The device has a volatile write cache, so [`IoOp::Flush`] matters.
    pub volatile_cache: bool,
    /// [`IoOp::Discard`] is supported.
    pub discard: bool,
    /// [`IoOp::WriteZeroes`] is supported.
    pub write_zeroes: bool,
    /// Required alignment of buffer addresses and lengths in bytes (1 when any is fine; the
    /// block size with `O_DIRECT`).
    pub buf_align: u32,
    /// Physical block size in bytes (for the virtio topology hint).
    pub physical_block_size: u32,
    /// Optimal I/O size in bytes (0 if unknown).
    pub optimal_io_size: u32,
}

impl DeviceInfo {
    /// Capacity in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.num_blocks.saturating_mul(u64::from(self.block_size))
    }

    /// Checks that `[offset, offset + len)` is block aligned and inside the device.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), SubmitError> {
        let bs = u64::from(self.block_size);
        if offset % bs != 0 || len % bs != 0 {
            return Err(SubmitError::Misaligned { offset, len });
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.size_bytes() => Ok(()),
            _ => Err(SubmitError::OutOfRange {
                offset,
                len,
                size: self.size_bytes(),
            }),
        }
    }
}

/// Checks a block size for the RAM and null devices (512, 1024, 2048 or 4096).
pub(crate) fn check_block_size(block_size: u32) -> Result<(), BdevError> {
    if matches!(block_size, 512 | 1024 | 2048 | 4096) {
        Ok(())
    } else {
        Err(BdevError::Invalid(format!(
            "block size {block_size} is not 512, 1024, 2048 or 4096"
        )))
    }
}

/// The operation of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoOp {
    /// Read into the request's buffers.
    Read,
    /// Write the request's buffers.
    Write,
    /// Make every completed write durable.
    Flush,
    /// Deallocate a range; reads of it afterwards return unspecified data (zeroes on most devices).
    Discard,
    /// Make a range read as zeroes; with `unmap` the device may deallocate it.
    WriteZeroes {
        /// The caller allows deallocation.
        unmap: bool,
    },
}

impl IoOp {
    /// The operation modifies the device.
    pub fn is_write(&self) -> bool {
        matches!(self, IoOp::Write | IoOp::Discard | IoOp::WriteZeroes { .. })
    }
}

/// One request handed to [`IoChannel::submit`].
#[derive(Debug, Clone, Copy)]
pub struct IoRequest<'a> {
    /// What to do.
    pub op: IoOp,
    /// Byte offset on the device (block aligned).
    pub offset: u64,
    /// Length in bytes. For reads and writes it must equal the sum of the `iov` lengths; for
    /// discard and write-zeroes it is the range length; for flush it is ignored.
    pub len: u64,
    /// Data buffers for reads and writes (empty otherwise). The channel copies the array (not the
    /// data), so it need only live for the call to `submit`.
    pub iov: &'a [iovec],
    /// Caller's tag, returned in the [`Completion`].
    pub token: u64,
}

impl<'a> IoRequest<'a> {
    /// A request with no data buffers (flush, discard, write-zeroes).
    pub fn no_data(op: IoOp, offset: u64, len: u64, token: u64) -> Self {
        IoRequest {
            op,
            offset,
            len,
            iov: &[],
            token,
        }
    }
}

/// The result of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The request's token.
    pub token: u64,
    /// Bytes transferred, or the error.
    pub result: Result<u64, IoError>,
}

/// A block device. Cheap to share between threads; I/O goes through [`IoChannel`]s.
pub trait BlockDevice: Send + Sync {
    /// Current properties (the capacity may change at run time).
    fn info(&self) -> DeviceInfo;

    /// Opens an I/O channel for one thread: at most `depth` requests in flight, each with at most
    /// `max_segments` buffers.
    fn open_channel(
        &self,
        depth: usize,
        max_segments: usize,
    ) -> Result<Box<dyn IoChannel>, BdevError>;

    /// A short human-readable description (kind and backing), for logs.
    fn describe(&self) -> String;

    /// Re-reads the capacity from the backing store (a file or disk that grew), returning the
    /// new properties. Devices whose size only changes through their own API return
    /// [`BlockDevice::info`].
    fn rescan(&self) -> Result<DeviceInfo, BdevError> {
        Ok(self.info())
    }

    /// Tells the device that `[addr, addr + len)` (client memory mapped by the caller, e.g. a
    /// guest RAM region) will hold I/O buffers, so a device that DMAs can register it (SPDK's
    /// memory map). The mapping stays valid until [`BlockDevice::unregister_memory`]. Devices
    /// that read and write through the CPU or the kernel ignore it.
    fn register_memory(&self, addr: *mut u8, len: usize) {
        let _ = (addr, len);
    }

    /// Undoes [`BlockDevice::register_memory`] for a region about to be unmapped.
    fn unregister_memory(&self, addr: *mut u8, len: usize) {
        let _ = (addr, len);
    }
}

/// A per-thread submission and completion queue on a [`BlockDevice`].
pub trait IoChannel: Send {
    /// Queues one request. It is started at the latest by the next [`IoChannel::commit`].
    ///
    /// Errors are immediate: [`SubmitError::Full`] means `depth` requests are in flight and the
    /// caller should reap completions first; other errors mean the request is invalid and was not
    /// queued.
    ///
    /// # Safety
    ///
    /// Every buffer in `req.iov` must stay valid (mapped, and for reads writable) until the
    /// completion with `req.token` has been returned by [`IoChannel::poll`], or the channel has
    /// been dropped. The caller must not access the buffers of a read in that time, and must not
    /// modify the buffers of a write.
    unsafe fn submit(&mut self, req: &IoRequest<'_>) -> Result<(), SubmitError>;

    /// Starts every queued request.
    fn commit(&mut self) -> Result<(), BdevError>;

    /// Appends every finished request to `out` without blocking; returns how many were added.
    fn poll(&mut self, out: &mut Vec<Completion>) -> usize;

    /// Blocks until at least one completion is ready to be polled, nothing is in flight, or the
    /// timeout passes.
    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), BdevError>;

    /// Requests submitted and not yet returned by `poll`.
    fn in_flight(&self) -> usize;

    /// A file descriptor that becomes readable when completions are ready (an eventfd, to be read
    /// to reset it with [`IoChannel::clear_notify`]), or `None` when every request completes by
    /// the time `commit` returns.
    fn notify_fd(&self) -> Option<RawFd>;

    /// Resets the readiness of [`IoChannel::notify_fd`].
    ///
    /// Call it *before* [`IoChannel::poll`], not after: a completion that arrives after the reset
    /// makes the descriptor readable again, so none is missed.
    fn clear_notify(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> DeviceInfo {
        DeviceInfo {
            block_size: 512,
            num_blocks: 8,
            read_only: false,
            volatile_cache: false,
            discard: true,
            write_zeroes: true,
            buf_align: 1,
            physical_block_size: 512,
            optimal_io_size: 0,
        }
    }

    #[test]
    fn range_checks() {
        let i = info();
        assert!(i.check_range(0, 4096).is_ok());
        assert!(i.check_range(512, 3584).is_ok());
        assert!(matches!(
            i.check_range(512, 4096),
            Err(SubmitError::OutOfRange { .. })
        ));
        assert!(matches!(
            i.check_range(1, 512),
            Err(SubmitError::Misaligned { .. })
        ));
        assert!(matches!(
            i.check_range(u64::MAX - 511, 512),
            Err(SubmitError::OutOfRange { .. })
        ));
    }
}
