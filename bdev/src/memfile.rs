//! A file in memory (tmpfs, ramfs) read and written through a shared mapping of it.
//!
//! On a memory filesystem a `preadv`/`pwritev` of 4 KiB is a page lookup and a copy, and the
//! system call around it costs more than both (on a 2-vCPU VM serving a tmpfs file at 4 KiB:
//! 2.25 µs of server CPU per request through system calls, 0.90 µs through the mapping). So
//! [`FileDevice`](crate::file::FileDevice) maps such a file once and copies between the caller's
//! buffers and the mapping, as the RAM device does, where it can do so without changing what
//! the system calls would do:
//!
//! - **Holes stay holes.** A page fault on a hole of a shared tmpfs mapping allocates a page (a
//!   read through `preadv` returns zeroes and allocates nothing), and when the filesystem is
//!   full the fault raises `SIGBUS` where `pwritev` returns `ENOSPC`. A bitmap records which
//!   pages are known to be allocated (from `SEEK_DATA`/`SEEK_HOLE` when the device opens, then
//!   from the device's own writes). Only a request whose pages are all known to be allocated
//!   goes through the mapping; any other goes through the system call, and a write that
//!   succeeds marks its pages.
//! - **Discards exclude copies.** Punching a hole (discard, write-zeroes: tmpfs has no
//!   `FALLOC_FL_ZERO_RANGE`) takes the device's lock exclusively and clears the pages' bits
//!   before it runs, while copies and system-call writes that set bits hold it shared. So no
//!   copy runs on a page that is being deallocated, whatever a driver sends at the same time.
//! - **A file shrunk under the device does not kill the process.** Someone else may truncate
//!   the file (or punch it, then fill the filesystem): the mapping is registered with the
//!   process's `SIGBUS` guard ([`crate::sigbus`]), which maps zero pages over a faulting page
//!   and marks the device's [`Poison`]. The request that faulted is redone with its system call,
//!   and so is every later one: they see the file as it is, as without the mapping.
//!
//! Without the guard (the handler could not be installed, or its registry is full) the device
//! does not map the file at all.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::sigbus::{self, Poison, Protection};
use crate::{IoError, IoOp, IoRequest};

/// Bytes of a file's data mapped when the device opens. Beyond this, pages are mapped by the
/// first request that touches them: populating 4 GiB fills 8 MiB of page tables, and populating
/// a much larger file would make opening the device slow.
const POPULATE_MAX: usize = 4 << 30;

/// A shared mapping of a file in memory, with the set of its pages known to be allocated.
#[derive(Debug)]
pub(crate) struct MemFile {
    base: *mut u8,
    /// Bytes mapped: the file's size when the device opened.
    len: usize,
    page_shift: u32,
    /// One bit per page of the mapping: set when the page is known to be allocated.
    bits: Box<[AtomicU64]>,
    /// Shared by copies and by system-call writes that set bits; exclusive while a range is
    /// being deallocated.
    lock: RwLock<()>,
    poison: Arc<Poison>,
    /// Dropped before the mapping goes away.
    guard: Option<Protection>,
}

// SAFETY: `base` is a shared mapping owned by this value for its whole life; every access to it
// goes through `&self` methods that copy with raw pointers under `lock` (the bits and the
// poison are atomics), so the value may be used and dropped from any thread.
unsafe impl Send for MemFile {}
// SAFETY: as above: concurrent copies touch the mapping only through raw pointers, like the
// system calls they replace would, and bookkeeping is atomic or under `lock`.
unsafe impl Sync for MemFile {}

impl MemFile {
    /// Maps `file` (`size` bytes, on a memory filesystem) and reads which pages it has. `None`
    /// when the file cannot be mapped or the mapping cannot be guarded: the device then uses
    /// system calls only.
    pub(crate) fn open(file: &File, size: u64, writable: bool) -> Option<MemFile> {
        let len = usize::try_from(size).ok().filter(|l| *l > 0)?;
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = usize::try_from(page).ok().filter(|p| p.is_power_of_two())?;
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a new shared mapping of an open file chosen by the kernel; no existing memory
        // is affected. The result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "cannot map the memory file: using system calls"
            );
            return None;
        }
        let base = p.cast::<u8>();
        let Ok(poison) = Poison::new() else {
            // SAFETY: unmaps the mapping made above, which nothing else references.
            unsafe { libc::munmap(p, len) };
            return None;
        };
        let Some(guard) = sigbus::protect(base, len, page as u64, &poison) else {
            // SAFETY: as above.
            unsafe { libc::munmap(p, len) };
            return None;
        };
        let pages = len.div_ceil(page);
        let m = MemFile {
            base,
            len,
            page_shift: page.trailing_zeros(),
            bits: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            lock: RwLock::new(()),
            poison,
            guard: Some(guard),
        };
        m.scan_allocated(file, size, writable);
        Some(m)
    }

    /// Sets the bits of the file's data extents (`SEEK_DATA`/`SEEK_HOLE`) and maps the pages of
    /// the first [`POPULATE_MAX`] bytes of them now (`MADV_POPULATE_*`, which faults in pages
    /// that exist and allocates none here), so that requests do not each take a page fault on
    /// first touch: at 4 KiB QD1 on a 512 MiB file nearly every request of a 2 s run would.
    /// Where the filesystem cannot tell, no page is known to be allocated until the device
    /// writes it.
    fn scan_allocated(&self, file: &File, size: u64, writable: bool) {
        let populate = if writable {
            libc::MADV_POPULATE_WRITE
        } else {
            libc::MADV_POPULATE_READ
        };
        let fd = file.as_raw_fd();
        let mut budget = POPULATE_MAX;
        let mut pos: libc::off_t = 0;
        while (pos as u64) < size {
            // SAFETY: lseek on an owned descriptor with integer arguments.
            let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
            if data < 0 {
                break;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            if hole <= data {
                break;
            }
            self.mark(data as u64, (hole - data) as u64);
            let start = (data as usize).min(self.len);
            let end = (hole as usize).min(self.len);
            let end = end.min(start + budget);
            if end > start {
                budget -= end - start;
                // SAFETY: `[start, end)` lies inside this value's mapping; populating changes
                // no memory contents. Failure (an older kernel, a file shrinking meanwhile)
                // only leaves the faults to the first accesses.
                unsafe { libc::madvise(self.base.add(start).cast(), end - start, populate) };
            }
            pos = hole;
        }
    }

    /// The pages overlapping `[off, off + len)`, clipped to the mapping (empty when nothing of
    /// the range is mapped).
    fn pages(&self, off: u64, len: u64) -> Range<usize> {
        let end = off.saturating_add(len).min(self.len as u64);
        if end <= off {
            return 0..0;
        }
        (off >> self.page_shift) as usize..((end - 1) >> self.page_shift) as usize + 1
    }

    fn all_marked(&self, off: u64, len: u64) -> bool {
        let mut pages = self.pages(off, len);
        !pages.is_empty()
            && pages.all(|p| self.bits[p / 64].load(Ordering::Acquire) & (1 << (p % 64)) != 0)
    }

    /// Records the pages overlapping `[off, off + len)` as allocated.
    fn mark(&self, off: u64, len: u64) {
        for p in self.pages(off, len) {
            self.bits[p / 64].fetch_or(1 << (p % 64), Ordering::Release);
        }
    }

    /// Forgets the pages overlapping `[off, off + len)`.
    fn unmark(&self, off: u64, len: u64) {
        for p in self.pages(off, len) {
            self.bits[p / 64].fetch_and(!(1 << (p % 64)), Ordering::Release);
        }
    }

    /// Executes a read or write through the mapping when all its pages are known to be
    /// allocated, else with `syscall` (marking the pages of a successful write).
    ///
    /// # Safety
    ///
    /// The buffers of `req` must be valid for the call (writable for a read), and `req` must lie
    /// within the device (validated against its size).
    pub(crate) unsafe fn read_write(
        &self,
        req: &IoRequest<'_>,
        syscall: impl FnOnce() -> Result<u64, IoError>,
    ) -> Result<u64, IoError> {
        let _shared = self.lock.read().unwrap_or_else(|e| e.into_inner());
        let inside = req
            .offset
            .checked_add(req.len)
            .is_some_and(|end| end <= self.len as u64);
        if req.len == 0 || !inside || self.poison.is_poisoned() {
            return syscall();
        }
        if !self.all_marked(req.offset, req.len) {
            let r = syscall();
            if req.op == IoOp::Write && r.is_ok() {
                self.mark(req.offset, req.len);
            }
            return r;
        }
        let mut at = req.offset as usize;
        for v in req.iov {
            // SAFETY: the request lies inside the mapping (checked above) and its buffers add up
            // to `req.len` (validated by the channel), so `[at, at + iov_len)` is mapped; the
            // buffers are valid (the function's contract) and cannot overlap the device's own
            // mapping, which only this value knows.
            unsafe {
                let m = self.base.add(at);
                if req.op == IoOp::Read {
                    std::ptr::copy_nonoverlapping(m, v.iov_base.cast::<u8>(), v.iov_len);
                } else {
                    std::ptr::copy_nonoverlapping(v.iov_base.cast::<u8>(), m, v.iov_len);
                }
            }
            at += v.iov_len;
        }
        if self.poison.is_poisoned() {
            // The file shrank (or lost pages) under the mapping, during this copy or another:
            // the guard replaced the faulting page, so the copy may be wrong. Redone with the
            // system call it sees the file as it is (a read past the new end reads zeroes, a
            // write lands in the file), as every later request will be.
            tracing::warn!(
                fault_addr = self.poison.fault_addr(),
                "memory file changed under its mapping: using system calls from now on"
            );
            return syscall();
        }
        Ok(req.len)
    }

    /// Runs `dealloc`, which deallocates or zeroes `[off, off + len)`, with no copy in flight
    /// and the range's pages no longer known to be allocated.
    pub(crate) fn deallocating<R>(&self, off: u64, len: u64, dealloc: impl FnOnce() -> R) -> R {
        let _exclusive = self.lock.write().unwrap_or_else(|e| e.into_inner());
        self.unmark(off, len);
        dealloc()
    }

    /// True once a fault in the mapping made the device fall back to system calls.
    #[cfg(test)]
    pub(crate) fn is_poisoned(&self) -> bool {
        self.poison.is_poisoned()
    }
}

impl Drop for MemFile {
    fn drop(&mut self) {
        // Unregister first: once the guard is gone no handler refers to the mapping.
        drop(self.guard.take());
        // SAFETY: unmaps the mapping made in `open`; no copy can be running (`&mut self`).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    use crate::file::{FileDevice, FileOptions, IoMode};
    use crate::sync::SyncIo;

    const PAGE: u64 = 4096;

    /// A sparse tmpfs file of `len` bytes and a device on it, or `None` without /dev/shm.
    fn shm_dev(len: u64, mode: IoMode) -> Option<(tempfile::NamedTempFile, FileDevice)> {
        if !Path::new("/dev/shm").is_dir() {
            println!("skipped: no /dev/shm here");
            return None;
        }
        let f = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
        f.as_file().set_len(len).unwrap();
        let opts = FileOptions {
            mode,
            ..Default::default()
        };
        let d = FileDevice::open(f.path(), &opts).unwrap();
        Some((f, d))
    }

    fn blocks(f: &tempfile::NamedTempFile) -> u64 {
        f.as_file().metadata().unwrap().blocks()
    }

    /// Pages already in the file are found at open; reading holes allocates nothing; a write
    /// to a hole allocates its page and marks it; a discard frees the pages and forgets them.
    #[test]
    fn holes_stay_holes() {
        if !Path::new("/dev/shm").is_dir() {
            println!("skipped: no /dev/shm here");
            return;
        }
        let f = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(f.path())
            .and_then(|mut w| {
                use std::io::{Seek, SeekFrom, Write};
                w.seek(SeekFrom::Start(8 * PAGE))?;
                w.write_all(&[0x11u8; 2 * PAGE as usize])
            })
            .unwrap();
        let d = FileDevice::open(f.path(), &FileOptions::default()).unwrap();
        let m = d.inner.mem.as_ref().expect("a tmpfs file is mapped");
        assert!(m.all_marked(8 * PAGE, 2 * PAGE));
        assert!(!m.all_marked(7 * PAGE, 2 * PAGE));
        assert!(!m.all_marked(0, PAGE));

        let mut io = SyncIo::new(&d).unwrap();
        let before = blocks(&f);
        let mut b = vec![0xffu8; 64 << 10];
        io.read_at(0, &mut b).unwrap();
        assert!(b[..(8 * PAGE) as usize].iter().all(|&x| x == 0));
        assert!(b[(8 * PAGE) as usize..(10 * PAGE) as usize]
            .iter()
            .all(|&x| x == 0x11));
        io.read_at(512 << 10, &mut b).unwrap();
        assert_eq!(blocks(&f), before, "reading holes allocated pages");

        io.write_at(100 * PAGE + 512, &[0x22u8; 512]).unwrap();
        assert!(m.all_marked(100 * PAGE, PAGE), "a written page is marked");
        assert!(blocks(&f) > before);
        let mut one = vec![0u8; PAGE as usize];
        io.read_at(100 * PAGE, &mut one).unwrap();
        assert!(one[..512].iter().all(|&x| x == 0));
        assert!(one[512..1024].iter().all(|&x| x == 0x22));

        let allocated = blocks(&f);
        io.discard(8 * PAGE, 2 * PAGE).unwrap();
        assert!(!m.all_marked(8 * PAGE, PAGE) && !m.all_marked(9 * PAGE, PAGE));
        assert!(blocks(&f) < allocated, "discard freed nothing");
        let freed = blocks(&f);
        io.read_at(8 * PAGE, &mut one).unwrap();
        assert!(one.iter().all(|&x| x == 0));
        io.write_zeroes(100 * PAGE, PAGE, false).unwrap();
        assert!(!m.all_marked(100 * PAGE, PAGE));
        io.read_at(100 * PAGE, &mut one).unwrap();
        assert!(one.iter().all(|&x| x == 0));
        assert!(blocks(&f) <= freed);
        assert!(!m.is_poisoned());
    }

    /// A file truncated under the device: the copy that faults is redone with the system call
    /// (zeroes past the new end), the process lives, and every later request uses system
    /// calls, in each mode that copies.
    #[test]
    fn shrunk_file_falls_back_to_system_calls() {
        for mode in [IoMode::IoUring, IoMode::Inline, IoMode::ThreadPool] {
            let Some((f, d)) = shm_dev(1 << 20, mode) else {
                return;
            };
            let mut io = SyncIo::new(&d).unwrap();
            io.write_at(0, &vec![0x33u8; 1 << 20]).unwrap();
            let m = d.inner.mem.as_ref().unwrap();
            assert!(m.all_marked(0, 1 << 20));
            f.as_file().set_len(256 << 10).unwrap();
            let mut b = vec![0xffu8; 64 << 10];
            io.read_at((256 << 10) - PAGE, &mut b).unwrap();
            assert!(b[..PAGE as usize].iter().all(|&x| x == 0x33), "{mode:?}");
            assert!(b[PAGE as usize..].iter().all(|&x| x == 0), "{mode:?}");
            assert!(m.is_poisoned(), "{mode:?}: the read did not fault");
            // A write past the new end goes to the file (extending it), and reads back.
            io.write_at(512 << 10, &[0x44u8; 4096]).unwrap();
            assert!(f.as_file().metadata().unwrap().len() >= (512 << 10) + 4096);
            let mut one = vec![0u8; 4096];
            io.read_at(512 << 10, &mut one).unwrap();
            assert!(one.iter().all(|&x| x == 0x44), "{mode:?}");
            io.read_at(0, &mut one).unwrap();
            assert!(one.iter().all(|&x| x == 0x33), "{mode:?}");
        }
    }

    /// Two channels on one device: one keeps discarding and rewriting a few pages while the
    /// other reads them. A copy never runs on a page being deallocated (the lock), so reads
    /// never allocate holes or fault.
    #[test]
    fn discards_and_copies_on_two_channels() {
        let Some((f, d)) = shm_dev(64 * PAGE, IoMode::IoUring) else {
            return;
        };
        let d = std::sync::Arc::new(d);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (d, stop) = (d.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut io = SyncIo::new(d.as_ref()).unwrap();
                let mut round = 0u8;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    round = round.wrapping_add(1) | 1;
                    for p in 0..4u64 {
                        io.write_at(p * PAGE, &[round; PAGE as usize]).unwrap();
                    }
                    io.discard(0, 4 * PAGE).unwrap();
                }
            })
        };
        let mut io = SyncIo::new(d.as_ref()).unwrap();
        let mut b = vec![0u8; PAGE as usize];
        for i in 0..20_000u64 {
            io.read_at((i % 4) * PAGE, &mut b).unwrap();
            // Overlapping reads and writes may interleave (as system calls may); every byte is
            // still one some write put there, or a hole's zero.
            assert!(
                b.iter().all(|&x| x == 0 || x % 2 == 1),
                "a byte nobody wrote"
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
        let m = d.inner.mem.as_ref().unwrap();
        assert!(!m.is_poisoned());
        io.discard(0, 64 * PAGE).unwrap();
        assert_eq!(blocks(&f), 0, "pages left allocated after the last discard");
    }
}
