//! The RAM device (SPDK's malloc bdev): an anonymous private mapping, populated on first touch.
//!
//! The mapping asks for transparent huge pages (a random access then costs no page-table walk
//! of its own), and writes go with streaming stores (a written line is not read first).

use std::sync::Arc;

use crate::inline::{InlineChannel, InlineExec};
use crate::{BdevError, BlockDevice, DeviceInfo, IoChannel, IoError, IoOp, IoRequest};

/// A device backed by process memory.
#[derive(Debug)]
pub struct MallocDevice {
    inner: Arc<MallocInner>,
}

#[derive(Debug)]
struct MallocInner {
    base: *mut u8,
    len: usize,
    info: DeviceInfo,
}

// SAFETY: the mapping is owned by `MallocInner` for its whole life and only accessed through raw
// pointer copies; concurrent I/O to overlapping ranges yields unspecified data, exactly as on a
// real disk, and never touches memory outside the mapping.
unsafe impl Send for MallocInner {}
// SAFETY: see `Send`; no method hands out references into the mapping.
unsafe impl Sync for MallocInner {}

impl MallocDevice {
    /// A zero-filled RAM device of `num_blocks` blocks of `block_size` bytes.
    pub fn new(num_blocks: u64, block_size: u32) -> Result<Self, BdevError> {
        crate::check_block_size(block_size)?;
        let len = num_blocks
            .checked_mul(u64::from(block_size))
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l > 0)
            .ok_or_else(|| BdevError::Invalid(format!("bad size: {num_blocks} blocks")))?;
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(BdevError::io("mmap", std::io::Error::last_os_error()));
        }
        // Transparent huge pages where the system allows them (`madvise` mode, the default):
        // a random 4 KiB access then costs no page-table walk of its own. Only a hint: without
        // THP the device works the same on small pages.
        // SAFETY: `base`/`len` is the mapping just created; madvise does not change its contents.
        unsafe { libc::madvise(base, len, libc::MADV_HUGEPAGE) };
        Ok(MallocDevice {
            inner: Arc::new(MallocInner {
                base: base.cast(),
                len,
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
            }),
        })
    }
}

impl Drop for MallocInner {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` is the mapping created in `MallocDevice::new`; no channel holds a
        // reference any more (they hold an `Arc` to this value).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl MallocInner {
    /// Zeroes `[off, off+len)`, returning whole pages to the kernel.
    ///
    /// # Safety
    ///
    /// The range must be inside the mapping.
    unsafe fn zero(&self, off: usize, len: usize) {
        const PAGE: usize = 4096;
        let end = off + len;
        let first = off.div_ceil(PAGE) * PAGE;
        let last = end / PAGE * PAGE;
        if first < last {
            // SAFETY: in range by the caller's contract.
            unsafe {
                std::ptr::write_bytes(self.base.add(off), 0, first - off);
                // MADV_DONTNEED on a private anonymous mapping makes the pages read as zeroes.
                libc::madvise(
                    self.base.add(first).cast(),
                    last - first,
                    libc::MADV_DONTNEED,
                );
                std::ptr::write_bytes(self.base.add(last), 0, end - last);
            }
        } else {
            // SAFETY: in range by the caller's contract.
            unsafe { std::ptr::write_bytes(self.base.add(off), 0, len) };
        }
    }
}

impl InlineExec for MallocInner {
    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    unsafe fn exec(&self, req: &IoRequest<'_>) -> Result<u64, IoError> {
        // The request was validated against `info`, so offset + len <= self.len.
        let mut off = req.offset as usize;
        match req.op {
            IoOp::Read => {
                for v in req.iov {
                    // SAFETY: the source range is inside the mapping (validated); the destination
                    // is a caller buffer valid for `iov_len` bytes; they cannot overlap since the
                    // mapping is private to this device.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.base.add(off),
                            v.iov_base.cast::<u8>(),
                            v.iov_len,
                        )
                    };
                    off += v.iov_len;
                }
                Ok(req.len)
            }
            IoOp::Write => {
                for v in req.iov {
                    // SAFETY: as for reads, with source and destination swapped.
                    unsafe {
                        copy_to_device(
                            self.base.add(off),
                            v.iov_base.cast::<u8>().cast_const(),
                            v.iov_len,
                        )
                    };
                    off += v.iov_len;
                }
                #[cfg(target_arch = "x86_64")]
                // SAFETY: sfence has no preconditions; it orders the streaming stores above
                // before the completion is published.
                unsafe {
                    std::arch::x86_64::_mm_sfence()
                };
                Ok(req.len)
            }
            IoOp::Flush => Ok(0),
            IoOp::Discard | IoOp::WriteZeroes { .. } => {
                // SAFETY: the range was validated to lie inside the device.
                unsafe { self.zero(off, req.len as usize) };
                Ok(0)
            }
        }
    }
}

impl BlockDevice for MallocDevice {
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
        format!("malloc ({} bytes)", self.inner.len)
    }
}

/// Copies `len` bytes of a guest buffer into the device. Whole 64-byte lines of a 16-byte
/// aligned destination are written with streaming (non-temporal) stores: a write to a random
/// place of a large RAM device is not read back soon, and a normal store would first read the
/// line it overwrites. The caller issues the store fence.
///
/// # Safety
/// `dst` is valid for `len` bytes of writes, `src` for `len` bytes of reads; they do not overlap.
unsafe fn copy_to_device(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        if len >= 1024 && (dst as usize) % 16 == 0 {
            let lines = len / 64;
            for i in 0..lines {
                // SAFETY: line `i` lies inside both buffers (i * 64 + 64 <= len); the
                // destination is 16-byte aligned, as _mm_stream_si128 requires; SSE2 is part
                // of x86_64.
                unsafe {
                    let s = src.add(i * 64).cast::<__m128i>();
                    let d = dst.add(i * 64).cast::<__m128i>();
                    let a = _mm_loadu_si128(s);
                    let b = _mm_loadu_si128(s.add(1));
                    let c = _mm_loadu_si128(s.add(2));
                    let e = _mm_loadu_si128(s.add(3));
                    _mm_stream_si128(d, a);
                    _mm_stream_si128(d.add(1), b);
                    _mm_stream_si128(d.add(2), c);
                    _mm_stream_si128(d.add(3), e);
                }
            }
            let done = lines * 64;
            // SAFETY: the tail lies inside both buffers.
            unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
            return;
        }
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::SyncIo;

    #[test]
    fn write_read_zero() {
        let dev = MallocDevice::new(64, 512).unwrap();
        let mut io = SyncIo::new(&dev).unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        io.write_at(4096, &data).unwrap();
        let mut back = vec![0u8; 8192];
        io.read_at(4096, &mut back).unwrap();
        assert_eq!(back, data);
        io.write_zeroes(4096 + 512, 4096, true).unwrap();
        io.read_at(4096, &mut back).unwrap();
        assert_eq!(&back[..512], &data[..512]);
        assert!(back[512..4608].iter().all(|&b| b == 0));
        assert_eq!(&back[4608..], &data[4608..]);
        assert!(io.read_at(64 * 512 - 512, &mut back).is_err());
    }

    #[test]
    fn streaming_copy_is_exact() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 253) as u8).collect();
        let mut dst = vec![0u8; 20_032];
        // Aligned destination with a tail, unaligned destination, short copies.
        let base = dst.as_mut_ptr();
        let aligned = base.align_offset(16);
        for (off, len) in [
            (aligned, 4096),
            (aligned, 4096 + 13),
            (aligned + 1, 8192),
            (aligned, 100),
            (aligned, 19_000),
        ] {
            dst.fill(0);
            // SAFETY: `off + len` stays inside `dst` (20,032 bytes) and `len` inside `src`.
            unsafe {
                copy_to_device(dst.as_mut_ptr().add(off), src.as_ptr(), len);
            }
            assert_eq!(
                &dst[off..off + len],
                &src[..len],
                "offset {off}, length {len}"
            );
            assert!(dst[..off].iter().all(|&b| b == 0));
            assert!(dst[off + len..].iter().all(|&b| b == 0));
        }
    }
}
