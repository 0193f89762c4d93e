//! Split-ring accesses on the request path, through the host addresses of the rings.
//!
//! virtio-queue reads an available entry and writes a used element through vm-memory's
//! generic slice walk (a region lookup and an iterator per access); here each access is one
//! region lookup and a volatile or atomic load or store. Where a ring field is not inside one
//! mapped region, or not aligned, the functions fall back to virtio-queue, which then also
//! does the checks and reports the error. The layout is VIRTIO 1.2, 2.7 (split virtqueues):
//! `avail = { flags: u16, idx: u16, ring: [u16; size], used_event: u16 }`,
//! `used = { flags: u16, idx: u16, ring: [{ id: u32, len: u32 }; size], avail_event: u16 }`.

use std::sync::atomic::{fence, AtomicU16, Ordering};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;

use crate::GuestMem;

const RING_HEADER: u64 = 4;
const AVAIL_ELEM: u64 = 2;
const USED_ELEM: u64 = 8;

/// The `AtomicU16` at guest address `addr`, if it lies in one mapped region and is aligned.
fn atomic_u16(mem: &GuestMem, addr: u64) -> Option<&AtomicU16> {
    let p = crate::host_range(mem, addr, 2)?;
    if (p as usize) % std::mem::align_of::<AtomicU16>() != 0 {
        return None;
    }
    // SAFETY: the two bytes lie inside a guest region that `mem` keeps mapped for the
    // reference's lifetime (tied to `mem`) and are aligned; the driver writes them
    // concurrently, which atomic accesses tolerate.
    Some(unsafe { &*p.cast::<AtomicU16>() })
}

/// The driver's available index (Acquire: the entries it covers are visible after it).
pub(crate) fn avail_idx(mem: &GuestMem, queue: &Queue) -> Option<u16> {
    let addr = queue.avail_ring().checked_add(2)?;
    match atomic_u16(mem, addr) {
        Some(a) => Some(u16::from_le(a.load(Ordering::Acquire))),
        None => queue.avail_idx(mem, Ordering::Acquire).ok().map(|w| w.0),
    }
}

/// Takes the head index of the next available chain; the caller has seen an available index
/// past `queue.next_avail()` (with [`avail_idx`]). `None` when the entry is unreadable.
pub(crate) fn pop_head(mem: &GuestMem, queue: &mut Queue) -> Option<u16> {
    let next = queue.next_avail();
    let slot = u64::from(next.checked_rem(queue.size())?);
    let addr = queue
        .avail_ring()
        .checked_add(RING_HEADER + slot * AVAIL_ELEM)?;
    match atomic_u16(mem, addr) {
        Some(a) => {
            // Ordered after the Acquire load of the index by the caller.
            let head = u16::from_le(a.load(Ordering::Relaxed));
            queue.set_next_avail(next.wrapping_add(1));
            Some(head)
        }
        None => queue.pop_descriptor_chain(mem).map(|c| c.head_index()),
    }
}

/// Why a used element could not be added.
#[derive(Debug)]
pub(crate) struct UsedError(pub String);

/// Puts `head` with `len` bytes written in the used ring and publishes the used index
/// (Release: the element and the request's data are visible before it).
pub(crate) fn add_used(
    mem: &GuestMem,
    queue: &mut Queue,
    head: u16,
    len: u32,
) -> Result<(), UsedError> {
    let size = queue.size();
    if head >= size {
        return Err(UsedError(format!("head {head} out of range")));
    }
    let next = queue.next_used();
    let elem = queue
        .used_ring()
        .checked_add(RING_HEADER + u64::from(next % size) * USED_ELEM);
    let fast = elem.and_then(|e| {
        let p = crate::host_range(mem, e, USED_ELEM as usize)?;
        let idx = atomic_u16(mem, queue.used_ring().checked_add(2)?)?;
        Some((p, idx))
    });
    let Some((p, idx)) = fast else {
        return queue
            .add_used(mem, head, len)
            .map_err(|e| UsedError(e.to_string()));
    };
    let mut raw = [0u8; USED_ELEM as usize];
    raw[..4].copy_from_slice(&u32::from(head).to_le_bytes());
    raw[4..].copy_from_slice(&len.to_le_bytes());
    // SAFETY: the eight bytes at `p` lie inside a guest region that `mem` keeps mapped; a
    // volatile write of a byte array needs no alignment.
    unsafe { std::ptr::write_volatile(p.cast::<[u8; USED_ELEM as usize]>(), raw) };
    let next = next.wrapping_add(1);
    idx.store(u16::to_le(next), Ordering::Release);
    queue.set_next_used(next);
    Ok(())
}

/// Whether the driver wants a notification for the chains put in the used ring since
/// `since` (the used index at the previous decision). With EVENT_IDX: when its `used_event`
/// lies in `[since, next_used)` (VIRTIO 1.2, 2.7.10); without: always.
pub(crate) fn needs_notification(mem: &GuestMem, queue: &Queue, since: u16) -> bool {
    let new = queue.next_used();
    if new == since {
        return false;
    }
    if !queue.event_idx_enabled() {
        return true;
    }
    // The used index stores above happen before the read of the driver's event index.
    fence(Ordering::SeqCst);
    let addr = queue
        .avail_ring()
        .checked_add(RING_HEADER + u64::from(queue.size()) * AVAIL_ELEM);
    let used_event = match addr.and_then(|a| atomic_u16(mem, a)) {
        Some(a) => u16::from_le(a.load(Ordering::Relaxed)),
        None => {
            // Unreadable: notify (a spurious interrupt is harmless, a missed one is not).
            let mut b = [0u8; 2];
            match addr.map(|a| vm_memory::Bytes::read_slice(mem, &mut b, GuestAddress(a))) {
                Some(Ok(())) => u16::from_le_bytes(b),
                _ => return true,
            }
        }
    };
    new.wrapping_sub(used_event).wrapping_sub(1) < new.wrapping_sub(since)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    #[test]
    fn pops_heads_and_adds_used_like_virtio_queue() {
        let m = mem();
        let mq = MockSplitQueue::new(&m, 8);
        let descs: Vec<RawDescriptor> = (0..3)
            .map(|i| RawDescriptor::from(SplitDescriptor::new(0x8_0000 + i * 0x100, 16, 0, 0)))
            .collect();
        mq.add_desc_chains(&descs, 0).unwrap();
        let mut q: Queue = mq.create_queue().unwrap();
        assert_eq!(avail_idx(&m, &q), Some(3));
        let heads: Vec<u16> = (0..3).map(|_| pop_head(&m, &mut q).unwrap()).collect();
        assert_eq!(heads, [0, 1, 2]);
        assert_eq!(q.next_avail(), 3);
        add_used(&m, &mut q, 2, 512).unwrap();
        add_used(&m, &mut q, 0, 1).unwrap();
        assert_eq!(mq.used().idx().load(), 2);
        let e = mq.used().ring().ref_at(0).unwrap().load();
        assert_eq!((e.id(), e.len()), (2, 512));
        let e = mq.used().ring().ref_at(1).unwrap().load();
        assert_eq!((e.id(), e.len()), (0, 1));
        assert!(add_used(&m, &mut q, 8, 1).is_err());
        assert_eq!(mq.used().idx().load(), 2);
    }

    #[test]
    fn the_used_index_wraps_around_the_ring() {
        let m = mem();
        let mq = MockSplitQueue::new(&m, 4);
        let mut q: Queue = mq.create_queue().unwrap();
        q.set_next_used(u16::MAX);
        add_used(&m, &mut q, 1, 7).unwrap();
        add_used(&m, &mut q, 2, 9).unwrap();
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
        let mq = MockSplitQueue::new(&m, 8);
        let mut q: Queue = mq.create_queue().unwrap();
        // Without EVENT_IDX: whenever something was added.
        assert!(!needs_notification(&m, &q, 0));
        add_used(&m, &mut q, 0, 1).unwrap();
        assert!(needs_notification(&m, &q, 0));
        q.set_event_idx(true);
        let used_event = mq.avail_addr().0 + 4 + 8 * 2;
        let set = |v: u16| {
            vm_memory::Bytes::write_slice(&m, &v.to_le_bytes(), GuestAddress(used_event)).unwrap()
        };
        // The driver waits for the element at index 0: adding it (0 -> 1) notifies.
        set(0);
        assert!(needs_notification(&m, &q, 0));
        // It asked for index 3; elements 1..3 added: not yet.
        set(3);
        add_used(&m, &mut q, 1, 1).unwrap();
        add_used(&m, &mut q, 2, 1).unwrap();
        assert!(!needs_notification(&m, &q, 1));
        // Element 3 added: now.
        add_used(&m, &mut q, 3, 1).unwrap();
        assert!(needs_notification(&m, &q, 3));
        // Across the wrap of the 16-bit index.
        q.set_next_used(u16::MAX);
        set(u16::MAX);
        add_used(&m, &mut q, 4, 1).unwrap();
        assert!(needs_notification(&m, &q, u16::MAX));
        set(5);
        add_used(&m, &mut q, 5, 1).unwrap();
        assert!(!needs_notification(&m, &q, 0));
    }
}
