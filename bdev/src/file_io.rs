//! The system-call layer of a [`crate::file::FileDevice`], shared by its three I/O modes:
//! the opened file and what it is (`FileInner`), the blocking execution of one request
//! (`preadv`/`pwritev`, hole punching or `BLKDISCARD`, `FALLOC_FL_ZERO_RANGE` or `BLKZEROOUT`,
//! `fdatasync`), rescans, and the block-device ioctls. The inline mode runs it on the
//! submitting thread, the pool mode on its workers, and the io_uring mode falls back to it.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;

use crate::inline::InlineExec;
use crate::memfile::MemFile;
use crate::{BdevError, DeviceInfo, IoError, IoOp, IoRequest};

#[derive(Debug)]
pub(crate) struct FileInner {
    pub(crate) file: File,
    pub(crate) path: PathBuf,
    pub(crate) is_blockdev: bool,
    /// The file lives in memory (tmpfs, ramfs): requests never block, so small ones are done
    /// inline (io_uring would punt tmpfs I/O to its worker threads).
    pub(crate) memory_backed: bool,
    /// A regular file on a storage-backed filesystem opened without `O_DIRECT`: writes land in
    /// the page cache, and io_uring may hand them to its workers (ext4 has no non-blocking
    /// buffered writes), so small ones are done inline while they stay quick.
    pub(crate) page_cache: bool,
    pub(crate) info: DeviceInfo,
    /// Current capacity in blocks (changed by [`BlockDevice::rescan`]).
    pub(crate) num_blocks: std::sync::atomic::AtomicU64,
    /// A file in memory opened without `O_DIRECT`: reads and writes of its allocated pages are
    /// copies through this mapping (`memfile`).
    pub(crate) mem: Option<MemFile>,
}

pub(crate) const TMPFS_MAGIC: i64 = 0x0102_1994;
pub(crate) const RAMFS_MAGIC: i64 = 0x8584_58f6;

pub(crate) fn is_memory_fs(fd: RawFd) -> bool {
    // SAFETY: a zeroed statfs is a valid out-buffer; fstatfs fills it for an owned fd.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatfs(fd, &mut st) } != 0 {
        return false;
    }
    let t = st.f_type as i64;
    t == TMPFS_MAGIC || t == RAMFS_MAGIC
}

pub(crate) const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
pub(crate) const BLKSSZGET: libc::c_ulong = 0x1268;
pub(crate) const BLKPBSZGET: libc::c_ulong = 0x127b;
pub(crate) const BLKDISCARD: libc::c_ulong = 0x1277;
pub(crate) const BLKZEROOUT: libc::c_ulong = 0x127f;

pub(crate) fn ioctl_u64(fd: RawFd, req: libc::c_ulong) -> std::io::Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: the request writes one u64 into `v`, a valid exclusive location.
    let r = unsafe { libc::ioctl(fd, req, &mut v as *mut u64) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(v)
    }
}

pub(crate) fn ioctl_int(fd: RawFd, req: libc::c_ulong) -> std::io::Result<u32> {
    let mut v: libc::c_int = 0;
    // SAFETY: the request writes one int into `v`, a valid exclusive location.
    let r = unsafe { libc::ioctl(fd, req, &mut v as *mut libc::c_int) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(v as u32)
    }
}

impl FileInner {
    /// Current properties.
    pub(crate) fn info(&self) -> DeviceInfo {
        let mut i = self.info.clone();
        i.num_blocks = self.num_blocks.load(std::sync::atomic::Ordering::Relaxed);
        i
    }

    /// Re-reads the size of the file or device.
    pub(crate) fn rescan(&self) -> Result<DeviceInfo, BdevError> {
        let size = if self.is_blockdev {
            ioctl_u64(self.fd(), BLKGETSIZE64).map_err(|e| BdevError::io("BLKGETSIZE64", e))?
        } else {
            self.file
                .metadata()
                .map_err(|e| BdevError::io("fstat", e))?
                .len()
        };
        let blocks = size / u64::from(self.info.block_size);
        if blocks == 0 {
            return Err(BdevError::Invalid(format!(
                "{} is now smaller than one block",
                self.path.display()
            )));
        }
        self.num_blocks
            .store(blocks, std::sync::atomic::Ordering::Relaxed);
        Ok(self.info())
    }
    pub(crate) fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Whether `pos` is at or past the end of a regular file (which may have shrunk under the
    /// device). Always false for block devices.
    pub(crate) fn past_eof(&self, pos: u64) -> bool {
        !self.is_blockdev && self.file.metadata().is_ok_and(|m| pos >= m.len())
    }

    /// Deallocates or zeroes `[off, off+len)`.
    pub(crate) fn zero_range(&self, off: u64, len: u64, deallocate: bool) -> Result<(), IoError> {
        match &self.mem {
            // Either way the pages may be deallocated (tmpfs zeroes by punching a hole).
            Some(m) => m.deallocating(off, len, || self.zero_range_raw(off, len, deallocate)),
            None => self.zero_range_raw(off, len, deallocate),
        }
    }

    fn zero_range_raw(&self, off: u64, len: u64, deallocate: bool) -> Result<(), IoError> {
        if len == 0 {
            return Ok(());
        }
        let r = if self.is_blockdev {
            let range = [off, len];
            let req = if deallocate { BLKDISCARD } else { BLKZEROOUT };
            // SAFETY: both requests read a [u64; 2] range from a valid pointer.
            unsafe { libc::ioctl(self.fd(), req, range.as_ptr()) }
        } else {
            let mode = if deallocate {
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
            } else {
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
            };
            // SAFETY: fallocate on an owned fd with plain integer arguments.
            unsafe { libc::fallocate(self.fd(), mode, off as libc::off_t, len as libc::off_t) }
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            let errno = e.raw_os_error().unwrap_or(libc::EIO);
            if !deallocate && errno == libc::EOPNOTSUPP && !self.is_blockdev {
                // Filesystems without ZERO_RANGE: punch a hole instead (reads back as zeroes).
                return self.zero_range_raw(off, len, true);
            }
            return Err(IoError::Errno(errno));
        }
        Ok(())
    }

    /// Executes one validated request with blocking system calls.
    ///
    /// # Safety
    ///
    /// The buffers of `req` must be valid for the call.
    pub(crate) unsafe fn exec_blocking(&self, req: &IoRequest<'_>) -> Result<u64, IoError> {
        match req.op {
            IoOp::Read | IoOp::Write => match &self.mem {
                // SAFETY: forwarded contract (the request was validated by the channel).
                Some(m) => unsafe { m.read_write(req, || self.read_write_blocking(req)) },
                // SAFETY: forwarded contract.
                None => unsafe { self.read_write_blocking(req) },
            },
            IoOp::Flush => {
                // SAFETY: fdatasync on an owned fd.
                if unsafe { libc::fdatasync(self.fd()) } < 0 {
                    let e = std::io::Error::last_os_error();
                    return Err(IoError::Errno(e.raw_os_error().unwrap_or(libc::EIO)));
                }
                Ok(0)
            }
            IoOp::Discard => self.zero_range(req.offset, req.len, true).map(|_| 0),
            IoOp::WriteZeroes { unmap } => self.zero_range(req.offset, req.len, unmap).map(|_| 0),
        }
    }

    /// Executes a validated read or write with `preadv`/`pwritev`.
    ///
    /// # Safety
    ///
    /// The buffers of `req` must be valid for the call.
    unsafe fn read_write_blocking(&self, req: &IoRequest<'_>) -> Result<u64, IoError> {
        let mut done = 0u64;
        let mut iov_idx = 0usize;
        let mut skip = 0usize;
        // Retry short transfers (signals, page-cache pressure) until complete or EOF.
        while done < req.len {
            let mut tmp = [crate::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 1];
            let (ptr, cnt) = if skip == 0 {
                (req.iov[iov_idx..].as_ptr(), req.iov.len() - iov_idx)
            } else {
                let v = req.iov[iov_idx];
                // SAFETY: `skip < v.iov_len`, so the pointer stays inside the buffer.
                tmp[0].iov_base = unsafe { v.iov_base.cast::<u8>().add(skip).cast() };
                tmp[0].iov_len = v.iov_len - skip;
                (tmp.as_ptr(), 1)
            };
            let cnt = cnt.min(libc::UIO_MAXIOV as usize) as libc::c_int;
            let off = (req.offset + done) as libc::off_t;
            // SAFETY: `ptr` points to `cnt` iovecs describing caller buffers that are
            // valid for the call (the function's contract).
            let n = unsafe {
                if req.op == IoOp::Read {
                    libc::preadv(self.fd(), ptr, cnt, off)
                } else {
                    libc::pwritev(self.fd(), ptr, cnt, off)
                }
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(IoError::Errno(e.raw_os_error().unwrap_or(libc::EIO)));
            }
            if n == 0 {
                if req.op == IoOp::Read {
                    // Past the end of a file that shrank: the rest reads as zeroes.
                    zero_tail(req, done, iov_idx, skip);
                    return Ok(req.len);
                }
                return Err(IoError::Short {
                    done,
                    wanted: req.len,
                });
            }
            let mut n = n as usize;
            done += n as u64;
            while n > 0 && iov_idx < req.iov.len() {
                let left = req.iov[iov_idx].iov_len - skip;
                if n >= left {
                    n -= left;
                    iov_idx += 1;
                    skip = 0;
                } else {
                    skip += n;
                    n = 0;
                }
            }
            if req.op == IoOp::Read && done < req.len && self.past_eof(req.offset + done) {
                // Short read ending at the end of a shrunk file: the rest reads as zeroes
                // (do not retry: with O_DIRECT an unaligned retry fails with EINVAL).
                zero_tail(req, done, iov_idx, skip);
                return Ok(req.len);
            }
        }
        Ok(done)
    }
}

/// Zeroes the part of a read's buffers from (`iov_idx`, `skip`) on.
fn zero_tail(req: &IoRequest<'_>, _done: u64, iov_idx: usize, skip: usize) {
    // SAFETY: the buffers of a read are valid and writable for their whole length (the caller's
    // contract of `exec_blocking`), and `skip` lies within the buffer at `iov_idx`.
    unsafe { zero_iovecs(&req.iov[iov_idx.min(req.iov.len())..], skip) }
}

/// Zeroes every buffer of `iov`, skipping the first `skip` bytes of the first one.
///
/// # Safety
///
/// Every buffer must be valid and writable for its `iov_len` bytes, and `skip` must not exceed
/// the first buffer's length.
pub(crate) unsafe fn zero_iovecs(iov: &[crate::iovec], skip: usize) {
    for (i, v) in iov.iter().enumerate() {
        let s = if i == 0 { skip.min(v.iov_len) } else { 0 };
        // SAFETY: the buffer is valid for `iov_len` bytes (the function's contract) and `s` is
        // within it.
        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>().add(s), 0, v.iov_len - s) };
    }
}

impl InlineExec for FileInner {
    fn info(&self) -> DeviceInfo {
        FileInner::info(self)
    }

    unsafe fn exec(&self, req: &IoRequest<'_>) -> Result<u64, IoError> {
        // SAFETY: forwarded contract.
        unsafe { self.exec_blocking(req) }
    }
}
