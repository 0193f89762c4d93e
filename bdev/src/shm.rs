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

impl SharedRegion {
    /// Maps at least `len` bytes (rounded up to 2 MiB).
    pub fn new(len: usize) -> Result<SharedRegion, BdevError> {
        let len = len
            .max(1)
            .checked_next_multiple_of(TWO_MIB)
            .ok_or_else(|| BdevError::Invalid(format!("shared region of {len} bytes")))?;
        let size = libc::off_t::try_from(len)
            .map_err(|_| BdevError::Invalid(format!("shared region of {len} bytes")))?;
        let mut huge = true;
        // SAFETY: memfd_create with a static NUL-terminated name.
        let mut raw = unsafe {
            libc::memfd_create(
                c"katablk-shm".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            )
        };
        // SAFETY: ftruncate on our own descriptor (hugetlbfs needs the size before mapping).
        if raw >= 0 && unsafe { libc::ftruncate(raw, size) } != 0 {
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(raw) };
            raw = -1;
        }
        if raw < 0 {
            huge = false;
            // SAFETY: as above, without hugepages.
            raw = unsafe { libc::memfd_create(c"katablk-shm".as_ptr(), libc::MFD_CLOEXEC) };
            if raw < 0 {
                return Err(sys("memfd_create"));
            }
            // SAFETY: ftruncate on our own descriptor.
            if unsafe { libc::ftruncate(raw, size) } != 0 {
                let e = sys("ftruncate");
                // SAFETY: closing our own descriptor.
                unsafe { libc::close(raw) };
                return Err(e);
            }
        }
        // SAFETY: `raw` is a new descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Reserve len + 2 MiB of address space, map the memfd at the aligned address inside it
        // and give back the rest.
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
        // SAFETY: [aligned, aligned + len) lies inside our reservation, which MAP_FIXED
        // replaces; the memfd is `len` bytes long.
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
        Ok(SharedRegion {
            addr: p,
            len,
            fd,
            huge,
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
}
