//! The vhost-user inflight region (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`).
//!
//! The backend records in a shared memory file, owned by the frontend between connections, which
//! descriptor heads it has taken from each queue and not yet put in the used ring. After a
//! backend restart the frontend hands the same file back and the backend resubmits those
//! requests in their original order, so none is lost. The layout of a split queue's region is
//! the one libvhost-user uses (the frontend treats it as opaque):
//!
//! ```text
//! u64 features; u16 version; u16 desc_num; u16 last_batch_head; u16 used_idx;
//! struct { u8 inflight; u8 pad[5]; u16 next; u64 counter; } desc[desc_num];
//! ```
//! each queue's region rounded up to 64 bytes.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use crate::fdcheck::check_mappable;
use crate::Error;
use katablk_bdev::sigbus::{self, Poison, Protection};

const HEADER: usize = 16;
const DESC: usize = 16;
const ALIGN: usize = 64;
const VERSION: u16 = 1;

/// Bytes one queue of `queue_size` entries takes in the region.
pub fn queue_region_size(queue_size: u16) -> usize {
    (HEADER + DESC * usize::from(queue_size)).div_ceil(ALIGN) * ALIGN
}

/// A mapped inflight region covering every queue of a device.
#[derive(Debug)]
pub struct InflightRegion {
    base: *mut u8,
    len: usize,
    file: File,
    num_queues: u16,
    queue_size: u16,
    /// Registration with the SIGBUS handler (the frontend holds the file and may shrink it).
    protection: Option<Protection>,
}

// SAFETY: the mapping is owned by the region and only accessed through volatile reads and writes
// of plain integers at offsets checked against `len`; the frontend accesses it only while the
// backend is not running.
unsafe impl Send for InflightRegion {}
// SAFETY: see `Send`; each queue's part is written by the one worker serving that queue.
unsafe impl Sync for InflightRegion {}

impl InflightRegion {
    /// Creates a zeroed region in a new memfd (`GET_INFLIGHT_FD`).
    pub fn create(num_queues: u16, queue_size: u16) -> Result<Self, Error> {
        Self::create_protected(num_queues, queue_size, None)
    }

    /// [`InflightRegion::create`], with the mapping registered with the SIGBUS handler on
    /// behalf of the connection `poison` (the frontend gets the file and may shrink it).
    pub(crate) fn create_protected(
        num_queues: u16,
        queue_size: u16,
        poison: Option<&Arc<Poison>>,
    ) -> Result<Self, Error> {
        if num_queues == 0 || queue_size == 0 {
            return Err(Error::Config("inflight region with no queues".into()));
        }
        let len = usize::from(num_queues) * queue_region_size(queue_size);
        // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"katablk-inflight".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::Sys("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64)
            .map_err(|e| Error::Sys("ftruncate inflight", e))?;
        let region = Self::map(file, 0, len, num_queues, queue_size, 0, poison)?;
        for q in 0..num_queues {
            let iq = region.queue_raw(q);
            iq.set_u16(8, VERSION);
            iq.set_u16(10, queue_size);
        }
        Ok(region)
    }

    /// Maps a region handed back by the frontend (`SET_INFLIGHT_FD`). The file must be a
    /// regular file (a memfd) covering `[offset, offset + size)`.
    pub fn open(
        file: File,
        offset: u64,
        size: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Self, Error> {
        Self::open_protected(file, offset, size, num_queues, queue_size, None)
    }

    /// [`InflightRegion::open`], with the mapping registered with the SIGBUS handler on behalf
    /// of the connection `poison` before it is first touched.
    pub(crate) fn open_protected(
        file: File,
        offset: u64,
        size: u64,
        num_queues: u16,
        queue_size: u16,
        poison: Option<&Arc<Poison>>,
    ) -> Result<Self, Error> {
        let need = usize::from(num_queues) * queue_region_size(queue_size);
        let len = usize::try_from(size).map_err(|_| Error::Config("inflight size".into()))?;
        if num_queues == 0 || queue_size == 0 || len < need {
            return Err(Error::Config(format!(
                "inflight region of {size} bytes is too small for {num_queues} queues of {queue_size}"
            )));
        }
        let checked = check_mappable(
            &file,
            format!("inflight region ({num_queues} queues of {queue_size})"),
            offset,
            size,
        )?;
        let region = Self::map(
            file,
            offset,
            len,
            num_queues,
            queue_size,
            checked.block_size,
            poison,
        )?;
        for q in 0..num_queues {
            let iq = region.queue_raw(q);
            if iq.get_u16(8) == 0 {
                iq.set_u16(8, VERSION);
                iq.set_u16(10, queue_size);
            } else if iq.get_u16(8) != VERSION || iq.get_u16(10) != queue_size {
                return Err(Error::Config(format!(
                    "inflight region of queue {q} has version {} size {}, expected {VERSION} {queue_size}",
                    iq.get_u16(8),
                    iq.get_u16(10)
                )));
            }
        }
        Ok(region)
    }

    #[allow(clippy::too_many_arguments)]
    fn map(
        file: File,
        offset: u64,
        len: usize,
        num_queues: u16,
        queue_size: u16,
        block_size: u64,
        poison: Option<&Arc<Poison>>,
    ) -> Result<Self, Error> {
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| Error::Config(format!("inflight offset {offset:#x} out of range")))?;
        // SAFETY: a shared mapping of a file we own, with no address hint; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::Sys("mmap inflight", std::io::Error::last_os_error()));
        }
        let protection = poison.and_then(|p| sigbus::protect(base.cast(), len, block_size, p));
        Ok(InflightRegion {
            base: base.cast(),
            len,
            file,
            num_queues,
            queue_size,
            protection,
        })
    }

    /// The memory file (to send to the frontend).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Mapped size in bytes.
    pub fn size(&self) -> u64 {
        self.len as u64
    }

    /// Queues covered.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Entries per queue.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    fn queue_raw(&self, q: u16) -> RawQueue {
        // SAFETY: `q < num_queues` (checked by callers), so the offset is inside the mapping.
        let base = unsafe {
            self.base
                .add(usize::from(q) * queue_region_size(self.queue_size))
        };
        RawQueue {
            base,
            desc_num: self.queue_size,
        }
    }

    /// The part of queue `q`, or `None` if the region does not cover it.
    pub fn queue(self: &Arc<Self>, q: u16) -> Option<InflightQueue> {
        (q < self.num_queues).then(|| InflightQueue {
            raw: self.queue_raw(q),
            _region: self.clone(),
        })
    }
}

impl Drop for InflightRegion {
    fn drop(&mut self) {
        // Unregistered before the unmap: nothing touches the region any more, and the address
        // range must not stay registered once something else can be mapped there.
        self.protection = None;
        // SAFETY: unmaps exactly the mapping made in `map`; every `InflightQueue` holds an `Arc`
        // to this region, so none is left pointing into it.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[derive(Debug, Clone, Copy)]
struct RawQueue {
    base: *mut u8,
    desc_num: u16,
}

impl RawQueue {
    fn get_u16(&self, off: usize) -> u16 {
        // SAFETY: `off` is a header field offset below HEADER or a descriptor field offset
        // computed from an index below `desc_num`, all inside this queue's part of the mapping and
        // 2-byte aligned (the region is page aligned and all offsets are even).
        unsafe { std::ptr::read_volatile(self.base.add(off).cast::<u16>()) }
    }
    fn set_u16(&self, off: usize, v: u16) {
        // SAFETY: as for `get_u16`.
        unsafe { std::ptr::write_volatile(self.base.add(off).cast::<u16>(), v) }
    }
    fn get_u8(&self, off: usize) -> u8 {
        // SAFETY: as for `get_u16`.
        unsafe { std::ptr::read_volatile(self.base.add(off)) }
    }
    fn set_u8(&self, off: usize, v: u8) {
        // SAFETY: as for `get_u16`.
        unsafe { std::ptr::write_volatile(self.base.add(off), v) }
    }
    fn get_u64(&self, off: usize) -> u64 {
        // SAFETY: as for `get_u16`; descriptor counters are at offsets 8 mod 16, so 8-byte aligned.
        unsafe { std::ptr::read_volatile(self.base.add(off).cast::<u64>()) }
    }
    fn set_u64(&self, off: usize, v: u64) {
        // SAFETY: as for `get_u64`.
        unsafe { std::ptr::write_volatile(self.base.add(off).cast::<u64>(), v) }
    }
    fn desc(&self, head: u16) -> usize {
        HEADER + DESC * usize::from(head)
    }
}

/// One queue's part of the inflight region, used by the worker serving the queue.
#[derive(Debug)]
pub struct InflightQueue {
    raw: RawQueue,
    _region: Arc<InflightRegion>,
}

// SAFETY: the raw pointer stays valid while `_region` is held; one worker owns each queue's part.
unsafe impl Send for InflightQueue {}

impl InflightQueue {
    /// Records that `head` was taken from the available ring as the `counter`-th request.
    pub fn begin(&self, head: u16, counter: u64) {
        if head >= self.raw.desc_num {
            return;
        }
        let d = self.raw.desc(head);
        self.raw.set_u64(d + 8, counter);
        fence(Ordering::Release);
        self.raw.set_u8(d, 1);
    }

    /// Called before `head` is put in the used ring.
    pub fn pre_put(&self, head: u16) {
        self.raw.set_u16(12, head);
        fence(Ordering::Release);
    }

    /// Called after `head` was put in the used ring, whose index is now `used_idx`.
    pub fn post_put(&self, head: u16, used_idx: u16) {
        if head >= self.raw.desc_num {
            return;
        }
        fence(Ordering::Release);
        self.raw.set_u8(self.raw.desc(head), 0);
        fence(Ordering::Release);
        self.raw.set_u16(14, used_idx);
    }

    /// After a reconnect: given the used index found in the ring, returns the heads still in
    /// flight in submission order and the highest counter seen.
    pub fn recover(&self, ring_used_idx: u16) -> (Vec<u16>, u64) {
        if self.raw.get_u16(14) != ring_used_idx {
            // The last batch reached the used ring but its inflight flag was not cleared.
            let last = self.raw.get_u16(12);
            if last < self.raw.desc_num {
                self.raw.set_u8(self.raw.desc(last), 0);
            }
            fence(Ordering::Release);
            self.raw.set_u16(14, ring_used_idx);
        }
        let mut heads: Vec<(u64, u16)> = Vec::new();
        let mut max = 0u64;
        for h in 0..self.raw.desc_num {
            let d = self.raw.desc(h);
            let c = self.raw.get_u64(d + 8);
            max = max.max(c);
            if self.raw.get_u8(d) == 1 {
                heads.push((c, h));
            }
        }
        heads.sort_unstable();
        (heads.into_iter().map(|(_, h)| h).collect(), max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_and_recover() {
        let r = Arc::new(InflightRegion::create(2, 8).unwrap());
        let q = r.queue(1).unwrap();
        q.begin(3, 1);
        q.begin(5, 2);
        q.begin(1, 3);
        q.pre_put(5);
        q.post_put(5, 1);
        // Reopen through the file, as after a backend restart.
        let f = r.file().try_clone().unwrap();
        let r2 = Arc::new(InflightRegion::open(f, 0, r.size(), 2, 8).unwrap());
        let q2 = r2.queue(1).unwrap();
        assert_eq!(q2.recover(1), (vec![3, 1], 3));
        // Used ring went one further than the region recorded: last batch head is dropped.
        q2.pre_put(3);
        assert_eq!(q2.recover(2), (vec![1], 3));
        assert!(r2.queue(2).is_none());
        assert!(InflightRegion::open(r.file().try_clone().unwrap(), 0, 16, 2, 8).is_err());
    }

    /// A file handed back that does not cover the mapping is refused before it is mapped.
    #[test]
    fn short_or_odd_files_are_refused() {
        let r = InflightRegion::create(1, 8).unwrap();
        let f = r.file().try_clone().unwrap();
        f.set_len(0).unwrap();
        let e = InflightRegion::open(f, 0, r.size(), 1, 8).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Fd(crate::fdcheck::FdError::TooSmall { file_size: 0, .. })
            ),
            "{e}"
        );
        let f = r.file().try_clone().unwrap();
        f.set_len(2 * r.size()).unwrap();
        // Offset past the end, and offset + size past the end.
        assert!(InflightRegion::open(f.try_clone().unwrap(), 1 << 20, r.size(), 1, 8).is_err());
        assert!(InflightRegion::open(f.try_clone().unwrap(), 4096, 2 * r.size(), 1, 8).is_err());
        assert!(InflightRegion::open(f, u64::MAX - 4095, r.size(), 1, 8).is_err());
        let dir = File::open("/").unwrap();
        assert!(matches!(
            InflightRegion::open(dir, 0, r.size(), 1, 8),
            Err(Error::Fd(crate::fdcheck::FdError::NotRegular { .. }))
        ));
    }

    /// The frontend shrinks the inflight file under a running queue: the next record faults,
    /// the fault is absorbed and the connection poisoned instead of the process killed.
    #[test]
    fn shrunk_inflight_file_poisons_the_connection() {
        let poison = Poison::new().unwrap();
        let r = Arc::new(InflightRegion::create_protected(1, 256, Some(&poison)).unwrap());
        let q = r.queue(0).unwrap();
        q.begin(1, 1);
        assert!(!poison.is_poisoned());
        r.file().set_len(0).unwrap();
        q.begin(2, 2);
        assert!(poison.is_poisoned());
        // The faulting page was replaced by a zero page, where the write that faulted then
        // landed: the first record is lost, the second one kept, nothing faults any more.
        assert_eq!(q.recover(0), (vec![2], 2));
        drop(q);
        drop(r);
        assert_eq!(Arc::strong_count(&poison), 1, "registration not released");
    }
}
