//! State shared by a store, its volumes, their channels and the allocation worker: the
//! metadata state behind one lock and the queue of cluster allocations and releases.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;
use uuid::Uuid;

use crate::channel::ChanShared;
use crate::cluster_map::Bitmap;
use crate::lvol::Lvol;
use crate::md::BlobMd;
use crate::superblock::SuperBlock;

pub(crate) struct Waiter {
    pub(crate) chan: Arc<ChanShared>,
    pub(crate) slot: u32,
}

#[derive(Default)]
pub(crate) struct AllocQueue {
    pub(crate) pending: HashMap<(u64, u64), Vec<Waiter>>,
    pub(crate) queue: Vec<(Arc<Lvol>, u64)>,
    /// Whole clusters discarded on thin volumes, to be given back to the store.
    pub(crate) releases: Vec<(Arc<Lvol>, u64)>,
    pub(crate) closed: bool,
}

/// Result of asking for a cluster allocation.
pub(crate) enum AllocReq {
    /// The waiter will be notified.
    Queued,
    /// The store is closed.
    Closed,
}

impl Shared {
    /// The store's current name.
    pub(crate) fn name(&self) -> String {
        self.name.read().map(|n| n.clone()).unwrap_or_default()
    }
}

/// State shared by the store, its volumes, their channels and the allocation worker.
pub(crate) struct Shared {
    pub(crate) dev: Arc<dyn BlockDevice>,
    pub(crate) cluster_size: u64,
    /// Store name (changed by [`LvStore::rename`](crate::LvStore::rename)).
    pub(crate) name: std::sync::RwLock<String>,
    pub(crate) uuid: Uuid,
    pub(crate) md: Mutex<MdState>,
    pub(crate) alloc: Mutex<AllocQueue>,
    pub(crate) alloc_cv: Condvar,
    pub(crate) closed: AtomicBool,
    pub(crate) allocations: AtomicU64,
    /// Clusters unmapped by committed releases whose earlier I/O is still draining.
    pub(crate) releasing: AtomicU64,
}

pub(crate) struct MdState {
    pub(crate) io: SyncIo,
    pub(crate) sb: SuperBlock,
    pub(crate) md_used: Bitmap,
    pub(crate) clusters: Bitmap,
    pub(crate) blobs: BTreeMap<u64, BlobMd>,
    pub(crate) pages: HashMap<u64, Vec<u32>>,
    pub(crate) vols: HashMap<u64, Arc<Lvol>>,
    pub(crate) next_txn: u64,
    /// Newest committed transaction (whose pages are all still on disk).
    pub(crate) last_committed: u64,
    pub(crate) next_id: u64,
    pub(crate) deferred_zero: Vec<u32>,
    /// A metadata write failed in a way that could not be undone: refuse further updates.
    pub(crate) poisoned: bool,
    /// The store was closed (marked clean): refuse further updates.
    pub(crate) closed: bool,
    pub(crate) md_hint: u64,
    pub(crate) cluster_hint: u64,
    pub(crate) bounce: Vec<u8>,
    pub(crate) write_zeroes: bool,
    pub(crate) discard: bool,
}

impl Shared {
    pub(crate) fn md(&self) -> MutexGuard<'_, MdState> {
        self.md.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn aq(&self) -> MutexGuard<'_, AllocQueue> {
        self.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues the allocation of logical cluster `c` of `vol`; the waiter is told when done. The
    /// caller holds `vol`'s state read lock and saw the cluster unallocated, so the worker
    /// cannot have published it yet.
    pub(crate) fn request_alloc(&self, vol: &Arc<Lvol>, c: u64, w: Waiter) -> AllocReq {
        self.request(vol, c, w, false)
    }

    /// Queues the release of logical cluster `c` of `vol` (a whole-cluster discard); the
    /// waiter is told when done. Requests for the same cluster share one entry, so a write
    /// that finds the cluster already unmapped waits for the release and then allocates anew.
    pub(crate) fn request_release(&self, vol: &Arc<Lvol>, c: u64, w: Waiter) -> AllocReq {
        self.request(vol, c, w, true)
    }

    /// Adds `w` to the pending entry of (`vol`, `c`), queueing the work for the allocation
    /// worker (a release or an allocation) when the entry is new.
    fn request(&self, vol: &Arc<Lvol>, c: u64, w: Waiter, release: bool) -> AllocReq {
        let mut q = self.aq();
        if q.closed {
            return AllocReq::Closed;
        }
        let key = (vol.id, c);
        match q.pending.get_mut(&key) {
            Some(ws) => ws.push(w),
            None => {
                q.pending.insert(key, vec![w]);
                let work = (vol.clone(), c);
                if release {
                    q.releases.push(work);
                } else {
                    q.queue.push(work);
                }
                self.alloc_cv.notify_one();
            }
        }
        AllocReq::Queued
    }
}
