//! Split-ring accesses on the request path, through the host addresses of the rings.
//!
//! virtio-queue reads an available entry and writes a used element through vm-memory's
//! generic slice walk (a region lookup and an iterator per access); here the rings are
//! translated once per memory snapshot ([`Rings`]) and each access is a volatile or atomic load
//! or store. Where a ring is not inside one mapped region, or not aligned, its accesses fall
//! back to virtio-queue, which then also does the checks and reports the error. The layout is VIRTIO 1.2, 2.7 (split virtqueues):
//! `avail = { flags: u16, idx: u16, ring: [u16; size], used_event: u16 }`,
//! `used = { flags: u16, idx: u16, ring: [{ id: u32, len: u32 }; size], avail_event: u16 }`.

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::sync::{Arc, Weak};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use crate::chain::DescTable;
use crate::GuestMem;

const RING_HEADER: u64 = 4;
const AVAIL_ELEM: u64 = 2;
const USED_ELEM: u64 = 8;
const DESC_SIZE: u64 = 16;

/// The host addresses of one queue's rings, translated once per memory snapshot instead of
/// at every access (a request used to cost eight region lookups for its ring accesses).
pub(crate) struct Rings {
    /// The snapshot the addresses were translated in. A weak reference keeps its allocation,
    /// so while it is cached no other snapshot can have the same address, but not its
    /// mappings: a snapshot dropped while the worker sleeps still unmaps removed regions.
    mem: Weak<GuestMem>,
    /// Descriptor table, available ring and used ring addresses, and queue size, translated.
    key: (u64, u64, u64, u16),
    desc: Option<NonNull<u8>>,
    avail: Option<NonNull<u8>>,
    used_event: Option<NonNull<u8>>,
    used: Option<NonNull<u8>>,
}

// SAFETY: the pointers are only dereferenced through a `RingView`, which borrows the live
// snapshot they were translated in; the worker owning the queue is the only user.
unsafe impl Send for Rings {}

impl Default for Rings {
    fn default() -> Self {
        Rings {
            mem: Weak::new(),
            key: (0, 0, 0, 0),
            desc: None,
            avail: None,
            used_event: None,
            used: None,
        }
    }
}

/// `len` bytes at guest address `addr` inside one mapped region, aligned to `align`.
fn host(mem: &GuestMem, addr: u64, len: u64, align: usize) -> Option<NonNull<u8>> {
    let p = crate::host_range(mem, addr, usize::try_from(len).ok()?)?;
    if (p as usize) % align != 0 {
        return None;
    }
    NonNull::new(p)
}

impl Rings {
    /// The rings of `queue` in `mem`, translated again only when the snapshot or the ring
    /// addresses changed since the last call.
    pub fn view<'m>(&mut self, mem: &'m Arc<GuestMem>, queue: &Queue) -> RingView<'m> {
        let size = queue.size();
        let key = (
            queue.desc_table(),
            queue.avail_ring(),
            queue.used_ring(),
            size,
        );
        if !std::ptr::eq(self.mem.as_ptr(), Arc::as_ptr(mem)) || self.key != key {
            let n = u64::from(size);
            let m: &GuestMem = mem;
            self.desc = host(m, key.0, n * DESC_SIZE, 1);
            self.avail = host(m, key.1, RING_HEADER + n * AVAIL_ELEM, 2);
            self.used_event = key
                .1
                .checked_add(RING_HEADER + n * AVAIL_ELEM)
                .and_then(|a| host(m, a, 2, 2));
            self.used = host(m, key.2, RING_HEADER + n * USED_ELEM, 4);
            self.key = key;
            self.mem = Arc::downgrade(mem);
        }
        RingView {
            mem,
            desc: self.desc,
            avail: self.avail,
            used_event: self.used_event,
            used: self.used,
        }
    }
}

/// A queue's rings in one live memory snapshot (see [`Rings::view`]). Where a ring is not
/// inside one mapped region, or not aligned, its accesses fall back to virtio-queue, which then
/// also does the checks and reports the error.
#[derive(Clone, Copy)]
pub(crate) struct RingView<'m> {
    mem: &'m GuestMem,
    desc: Option<NonNull<u8>>,
    avail: Option<NonNull<u8>>,
    used_event: Option<NonNull<u8>>,
    used: Option<NonNull<u8>>,
}

impl<'m> RingView<'m> {
    /// The `AtomicU16` at byte `off` of a translated ring.
    ///
    /// # Safety
    /// `off + 2` must lie within the ring's translated length and `off` must be even.
    unsafe fn atomic_u16(base: NonNull<u8>, off: u64) -> &'m AtomicU16 {
        // SAFETY: per the contract the two bytes lie inside the translated ring, which the
        // snapshot borrowed for 'm keeps mapped; the base is 2-aligned (checked when
        // translated) and `off` even; the driver writes them concurrently, which atomic
        // accesses tolerate.
        unsafe { &*base.as_ptr().add(off as usize).cast::<AtomicU16>() }
    }

    /// The descriptor table of `queue`, for walking its chains.
    pub fn desc_table(&self, queue: &Queue) -> DescTable<'m> {
        let addr = GuestAddress(queue.desc_table());
        match self.desc {
            // SAFETY: `desc` is the host address of the queue's whole descriptor table
            // (`size` entries) in the snapshot borrowed for 'm.
            Some(p) => unsafe { DescTable::translated(self.mem, addr, queue.size(), p) },
            None => DescTable::new(self.mem, addr, queue.size()),
        }
    }

    /// The driver's available index (Acquire: the entries it covers are visible after it).
    pub fn avail_idx(&self, queue: &Queue) -> Option<u16> {
        match self.avail {
            // SAFETY: the index is bytes 2..4 of the translated available ring.
            Some(p) => Some(u16::from_le(
                unsafe { Self::atomic_u16(p, 2) }.load(Ordering::Acquire),
            )),
            None => queue
                .avail_idx(self.mem, Ordering::Acquire)
                .ok()
                .map(|w| w.0),
        }
    }

    /// Takes the head index of the next available chain; the caller has seen an available
    /// index past `queue.next_avail()` (with [`RingView::avail_idx`]). `None` when the entry
    /// is unreadable.
    pub fn pop_head(&self, queue: &mut Queue) -> Option<u16> {
        if self.avail.is_none() {
            return queue.pop_descriptor_chain(self.mem).map(|c| c.head_index());
        }
        // Ordered after the Acquire load of the index by the caller.
        let head = self.peek_head(queue, 0)?;
        queue.set_next_avail(queue.next_avail().wrapping_add(1));
        Some(head)
    }

    /// The head index `k` entries past `queue.next_avail()`, without taking it; `None` when
    /// the ring is not translated. The caller has seen an available index covering it.
    pub fn peek_head(&self, queue: &Queue, k: u16) -> Option<u16> {
        let p = self.avail?;
        let slot = u64::from(
            queue
                .next_avail()
                .wrapping_add(k)
                .checked_rem(queue.size())?,
        );
        // SAFETY: `slot` is below the queue size, so its entry lies inside the translated
        // ring at an even offset.
        let a = unsafe { Self::atomic_u16(p, RING_HEADER + slot * AVAIL_ELEM) };
        Some(u16::from_le(a.load(Ordering::Relaxed)))
    }

    /// Puts `head` with `len` bytes written in the used ring and publishes the used index
    /// (Release: the element and the request's data are visible before it).
    pub fn add_used(&self, queue: &mut Queue, head: u16, len: u32) -> Result<(), UsedError> {
        let size = queue.size();
        if head >= size {
            return Err(UsedError(format!("head {head} out of range")));
        }
        let Some(p) = self.used else {
            return queue
                .add_used(self.mem, head, len)
                .map_err(|e| UsedError(e.to_string()));
        };
        let next = queue.next_used();
        let off = RING_HEADER + u64::from(next % size) * USED_ELEM;
        let mut raw = [0u8; USED_ELEM as usize];
        raw[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        raw[4..].copy_from_slice(&len.to_le_bytes());
        // SAFETY: the element's eight bytes lie inside the translated used ring (its slot is
        // below the queue size), which the snapshot keeps mapped; a volatile write of a byte
        // array needs no alignment.
        unsafe {
            std::ptr::write_volatile(
                p.as_ptr()
                    .add(off as usize)
                    .cast::<[u8; USED_ELEM as usize]>(),
                raw,
            )
        };
        let next = next.wrapping_add(1);
        // SAFETY: the index is bytes 2..4 of the translated used ring.
        unsafe { Self::atomic_u16(p, 2) }.store(u16::to_le(next), Ordering::Release);
        queue.set_next_used(next);
        Ok(())
    }

    /// Whether the driver wants a notification for the chains put in the used ring since
    /// `since` (the used index at the previous decision). With EVENT_IDX: when its `used_event`
    /// lies in `[since, next_used)` (VIRTIO 1.2, 2.7.10); without: always.
    pub fn needs_notification(&self, queue: &Queue, since: u16) -> bool {
        let new = queue.next_used();
        if new == since {
            return false;
        }
        if !queue.event_idx_enabled() {
            return true;
        }
        // The used index stores above happen before the read of the driver's event index.
        fence(Ordering::SeqCst);
        let used_event = match self.used_event {
            // SAFETY: `used_event` is the translated, 2-aligned field itself.
            Some(p) => u16::from_le(unsafe { Self::atomic_u16(p, 0) }.load(Ordering::Relaxed)),
            None => {
                // Unreadable: notify (a spurious interrupt is harmless, a missed one is not).
                let addr = queue
                    .avail_ring()
                    .checked_add(RING_HEADER + u64::from(queue.size()) * AVAIL_ELEM);
                let mut b = [0u8; 2];
                match addr.map(|a| vm_memory::Bytes::read_slice(self.mem, &mut b, GuestAddress(a)))
                {
                    Some(Ok(())) => u16::from_le_bytes(b),
                    _ => return true,
                }
            }
        };
        new.wrapping_sub(used_event).wrapping_sub(1) < new.wrapping_sub(since)
    }
}

/// Why a used element could not be added.
#[derive(Debug)]
pub(crate) struct UsedError(pub String);

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;

    fn mem() -> Arc<GuestMem> {
        Arc::new(GuestMem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap())
    }

    /// Three one-descriptor chains (heads 0, 1, 2) in `mq`, and its queue.
    fn three_chains(mq: &MockSplitQueue<'_, GuestMem>) -> Queue {
        let descs: Vec<RawDescriptor> = (0..3)
            .map(|i| RawDescriptor::from(SplitDescriptor::new(0x8_0000 + i * 0x100, 16, 0, 0)))
            .collect();
        mq.add_desc_chains(&descs, 0).unwrap();
        mq.create_queue().unwrap()
    }

    #[test]
    fn pops_heads_and_adds_used_like_virtio_queue() {
        let m = mem();
        let mq = MockSplitQueue::new(&*m, 8);
        let mut q = three_chains(&mq);
        let mut rings = Rings::default();
        assert_eq!(Rings::default().view(&m, &q).avail_idx(&q), Some(3));
        let heads: Vec<u16> = (0..3)
            .map(|_| rings.view(&m, &q).pop_head(&mut q).unwrap())
            .collect();
        assert_eq!(heads, [0, 1, 2]);
        assert_eq!(q.next_avail(), 3);
        rings.view(&m, &q).add_used(&mut q, 2, 512).unwrap();
        rings.view(&m, &q).add_used(&mut q, 0, 1).unwrap();
        assert_eq!(mq.used().idx().load(), 2);
        let e = mq.used().ring().ref_at(0).unwrap().load();
        assert_eq!((e.id(), e.len()), (2, 512));
        let e = mq.used().ring().ref_at(1).unwrap().load();
        assert_eq!((e.id(), e.len()), (0, 1));
        assert!(rings.view(&m, &q).add_used(&mut q, 8, 1).is_err());
        assert_eq!(mq.used().idx().load(), 2);
    }

    #[test]
    fn peeking_heads_takes_nothing() {
        let m = mem();
        let mq = MockSplitQueue::new(&*m, 8);
        let mut q = three_chains(&mq);
        let mut rings = Rings::default();
        let v = rings.view(&m, &q);
        let peeked: Vec<Option<u16>> = (0..3).map(|k| v.peek_head(&q, k)).collect();
        assert_eq!(peeked, [Some(0), Some(1), Some(2)]);
        let table = v.desc_table(&q);
        for k in 0..10 {
            // Hints only, also out of range.
            table.prefetch(k);
            table.prefetch_first_buffer(k);
        }
        assert_eq!(q.next_avail(), 0);
        assert_eq!(rings.view(&m, &q).pop_head(&mut q), Some(0));
        assert_eq!(rings.view(&m, &q).peek_head(&q, 0), Some(1));
    }

    #[test]
    fn the_used_index_wraps_around_the_ring() {
        let m = mem();
        let mq = MockSplitQueue::new(&*m, 4);
        let mut q: Queue = mq.create_queue().unwrap();
        let mut rings = Rings::default();
        q.set_next_used(u16::MAX);
        rings.view(&m, &q).add_used(&mut q, 1, 7).unwrap();
        rings.view(&m, &q).add_used(&mut q, 2, 9).unwrap();
        assert_eq!(q.next_used(), 1);
        assert_eq!(mq.used().idx().load(), 1);
        // u16::MAX % 4 == 3, then slot 0.
        let e = mq.used().ring().ref_at(3).unwrap().load();
        assert_eq!((e.id(), e.len()), (1, 7));
        let e = mq.used().ring().ref_at(0).unwrap().load();
        assert_eq!((e.id(), e.len()), (2, 9));
    }

    #[test]
    fn event_index_decides_notifications() {
        let m = mem();
        let mq = MockSplitQueue::new(&*m, 8);
        let mut q: Queue = mq.create_queue().unwrap();
        let mut rings = Rings::default();
        // Without EVENT_IDX: whenever something was added.
        assert!(!rings.view(&m, &q).needs_notification(&q, 0));
        rings.view(&m, &q).add_used(&mut q, 0, 1).unwrap();
        assert!(rings.view(&m, &q).needs_notification(&q, 0));
        q.set_event_idx(true);
        let used_event = mq.avail_addr().0 + 4 + 8 * 2;
        let set = |v: u16| {
            vm_memory::Bytes::write_slice(&*m, &v.to_le_bytes(), GuestAddress(used_event)).unwrap()
        };
        // The driver waits for the element at index 0: adding it (0 -> 1) notifies.
        set(0);
        assert!(rings.view(&m, &q).needs_notification(&q, 0));
        // It asked for index 3; elements 1..3 added: not yet.
        set(3);
        rings.view(&m, &q).add_used(&mut q, 1, 1).unwrap();
        rings.view(&m, &q).add_used(&mut q, 2, 1).unwrap();
        assert!(!rings.view(&m, &q).needs_notification(&q, 1));
        // Element 3 added: now.
        rings.view(&m, &q).add_used(&mut q, 3, 1).unwrap();
        assert!(rings.view(&m, &q).needs_notification(&q, 3));
        // Across the wrap of the 16-bit index.
        q.set_next_used(u16::MAX);
        set(u16::MAX);
        rings.view(&m, &q).add_used(&mut q, 4, 1).unwrap();
        assert!(rings.view(&m, &q).needs_notification(&q, u16::MAX));
        set(5);
        rings.view(&m, &q).add_used(&mut q, 5, 1).unwrap();
        assert!(!rings.view(&m, &q).needs_notification(&q, 0));
    }

    #[test]
    fn a_new_snapshot_is_translated_again() {
        let old = mem();
        let mq = MockSplitQueue::new(&*old, 8);
        let mut q: Queue = mq.create_queue().unwrap();
        let mut rings = Rings::default();
        rings.view(&old, &q).add_used(&mut q, 1, 1).unwrap();
        assert_eq!(mq.used().idx().load(), 1);
        // The frontend sent a new table: the same layout in other memory. Writes go there,
        // and the old snapshot is not written again.
        let new = mem();
        let used_idx = GuestAddress(q.used_ring() + 2);
        rings.view(&new, &q).add_used(&mut q, 2, 1).unwrap();
        let idx = |m: &GuestMem| vm_memory::Bytes::read_obj::<u16>(m, used_idx).unwrap();
        assert_eq!(idx(&new), 2);
        assert_eq!(idx(&old), 1);
        drop(old);
        rings.view(&new, &q).add_used(&mut q, 3, 1).unwrap();
        assert_eq!(idx(&new), 3);
    }

    #[test]
    fn rings_outside_one_region_take_virtio_queues_path() {
        // Two adjacent regions with the used ring across their boundary: the used ring is
        // not translated, its accesses go through virtio-queue and still work.
        let m = Arc::new(
            GuestMem::from_ranges(&[(GuestAddress(0), 0x1000), (GuestAddress(0x1000), 0x1000)])
                .unwrap(),
        );
        let mut q = Queue::new(8).unwrap();
        q.set_desc_table_address(Some(0x100), Some(0));
        q.set_avail_ring_address(Some(0x200), Some(0));
        q.set_used_ring_address(Some(0xff0), Some(0));
        q.set_ready(true);
        let mut rings = Rings::default();
        let v = rings.view(&m, &q);
        assert!(v.desc.is_some() && v.avail.is_some() && v.used.is_none());
        v.add_used(&mut q, 1, 9).unwrap();
        assert_eq!(
            vm_memory::Bytes::read_obj::<u16>(&*m, GuestAddress(0xff2)).unwrap(),
            1
        );
        assert_eq!(v.avail_idx(&q), Some(0));
    }
}
