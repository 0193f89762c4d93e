//! Shared memory for vhost-user clients that must hand the server 2 MiB-aligned regions.
//!
//! SPDK's vhost target registers a client's memory with its memory map in 2 MiB units and drops
//! the connection (older builds crash) when a region's address or length — as the server maps
//! it — is not 2 MiB-aligned; libblkio's own memfd buffers are not. A [`SharedRegion`] is a
//! memfd on 2 MiB hugepages (so any mapping of it, the server's included, is 2 MiB-aligned),
//! mapped here at a 2 MiB-aligned address with a 2 MiB-multiple length; without free hugepages
//! it falls back to normal pages (aligned here, not necessarily in the server).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::BdevError;

/// SPDK's registration unit.
pub const TWO_MIB: usize = 2 << 20;

/// A shared, 2 MiB-aligned mapping of a memfd. Unmapped when dropped.
#[derive(Debug)]
pub struct SharedRegion {
    addr: *mut libc::c_void,
    len: usize,
    fd: OwnedFd,
    huge: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value.
unsafe impl Send for SharedRegion {}
// SAFETY: the value only hands out the address; access is the owner's business.
unsafe impl Sync for SharedRegion {}

fn sys(what: &'static str) -> BdevError {
    BdevError::Io {
        what,
        source: std::io::Error::last_os_error(),
    }
}

/// A new memfd of `size` bytes, on 2 MiB hugepages if `huge`.
fn memfd(size: libc::off_t, huge: bool) -> Result<OwnedFd, BdevError> {
    let flags = if huge {
        libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB
    } else {
        libc::MFD_CLOEXEC
    };
    // SAFETY: memfd_create with a static NUL-terminated name.
    let raw = unsafe { libc::memfd_create(c"katablk-shm".as_ptr(), flags) };
    if raw < 0 {
        return Err(sys("memfd_create"));
    }
    // SAFETY: `raw` is a new descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ftruncate on our own descriptor (hugetlbfs needs the size before mapping).
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
        return Err(sys("ftruncate"));
    }
    Ok(fd)
}

/// Maps `len` bytes of `fd` shared at a 2 MiB-aligned address: reserves `len + 2 MiB` of address
/// space, maps the memfd at the aligned address inside it and gives back the rest.
fn map_aligned(fd: &OwnedFd, len: usize) -> Result<*mut libc::c_void, BdevError> {
    let span = len + TWO_MIB;
    // SAFETY: an anonymous PROT_NONE reservation, checked below.
    let res = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if res == libc::MAP_FAILED {
        return Err(sys("mmap (reservation)"));
    }
    let start = res as usize;
    let aligned = start.next_multiple_of(TWO_MIB);
    // SAFETY: [aligned, aligned + len) lies inside our reservation, which MAP_FIXED replaces;
    // the memfd is `len` bytes long.
    let p = unsafe {
        libc::mmap(
            aligned as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let e = sys("mmap");
        // SAFETY: unmapping our own reservation.
        unsafe { libc::munmap(res, span) };
        return Err(e);
    }
    // SAFETY: the parts of the reservation before and after the mapping are ours.
    unsafe {
        if aligned > start {
            libc::munmap(res, aligned - start);
        }
        let end = aligned + len;
        if start + span > end {
            libc::munmap(end as *mut libc::c_void, start + span - end);
        }
    }
    Ok(p)
}

impl SharedRegion {
    /// Maps at least `len` bytes (rounded up to 2 MiB), on hugepages when the kernel has enough
    /// free ones, else on normal pages.
    pub fn new(len: usize) -> Result<SharedRegion, BdevError> {
        let len = len
            .max(1)
            .checked_next_multiple_of(TWO_MIB)
            .ok_or_else(|| BdevError::Invalid(format!("shared region of {len} bytes")))?;
        let size = libc::off_t::try_from(len)
            .map_err(|_| BdevError::Invalid(format!("shared region of {len} bytes")))?;
        // A hugetlbfs memfd is created and sized even when no hugepage is free; the pages are
        // reserved by mmap, which then fails with ENOMEM. Any failure on the way falls back.
        if let Ok((fd, addr)) =
            memfd(size, true).and_then(|fd| map_aligned(&fd, len).map(|a| (fd, a)))
        {
            return Ok(SharedRegion {
                addr,
                len,
                fd,
                huge: true,
            });
        }
        let fd = memfd(size, false)?;
        let addr = map_aligned(&fd, len)?;
        Ok(SharedRegion {
            addr,
            len,
            fd,
            huge: false,
        })
    }

    /// The mapping's address (2 MiB-aligned).
    pub fn addr(&self) -> *mut u8 {
        self.addr.cast()
    }

    /// The mapping's length (a multiple of 2 MiB).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a region has at least 2 MiB).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memfd, to pass to the server.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The memory is on 2 MiB hugepages.
    pub fn is_hugepages(&self) -> bool {
        self.huge
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_shared_and_writable() {
        let r = SharedRegion::new(5 << 20).unwrap();
        assert_eq!(r.len(), 6 << 20);
        assert_eq!(r.addr() as usize % TWO_MIB, 0);
        // SAFETY: the region is ours and `len` bytes long.
        let s = unsafe { std::slice::from_raw_parts_mut(r.addr(), r.len()) };
        s[0] = 7;
        s[r.len() - 1] = 9;
        // The memfd shows the same bytes (it is what the server maps).
        let mut b = [0u8; 1];
        // SAFETY: pread into a 1-byte buffer from our memfd.
        let n = unsafe { libc::pread(r.fd(), b.as_mut_ptr().cast(), 1, 0) };
        assert_eq!((n, b[0]), (1, 7));
        assert!(SharedRegion::new(0).is_ok());
    }

    fn meminfo(key: &str) -> Option<usize> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].trim().parse().ok()
    }

    #[test]
    fn more_than_every_hugepage_falls_back_to_normal_pages() {
        // One page more than the kernel has in all, so the hugetlbfs mmap must fail (ENOMEM)
        // whatever else runs; with surplus pages allowed that is not certain, so do not ask.
        let overcommit = std::fs::read_to_string("/proc/sys/vm/nr_overcommit_hugepages")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(0);
        let total = meminfo("HugePages_Total:").unwrap_or(0);
        let r = SharedRegion::new((total + 1) * TWO_MIB).unwrap();
        assert_eq!(r.len(), (total + 1) * TWO_MIB);
        assert_eq!(r.addr() as usize % TWO_MIB, 0);
        if overcommit == 0 {
            assert!(!r.is_hugepages());
        }
        // SAFETY: the region is ours and `len` bytes long.
        let s = unsafe { std::slice::from_raw_parts_mut(r.addr(), r.len()) };
        s[r.len() - 1] = 3;
        assert_eq!(s[r.len() - 1], 3);
    }
}
