//! The volume store: creation, examination (open), the metadata transaction engine, and the
//! volume-level operations.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;

use katablk_bdev::sync::SyncIo;
use katablk_bdev::{BlockDevice, IoError};
use uuid::Uuid;

use crate::channel::ChanShared;
use crate::cluster_map::Bitmap;
use crate::error::{LvolError, Result};
use crate::lvol::{Lvol, LvolInfo, VolState};
use crate::md::{
    build_page, encode_blob, BlobMd, ClearMethod, PageHdr, NO_PAGE, PAGE_SIZE, PAGE_TOMBSTONE,
};
use crate::recover::OpenReport;
use crate::superblock::{
    encode_mask, mask_capacity, mask_pages, SuperBlock, MASK_TYPE_CLUSTERS, MASK_TYPE_PAGES,
    MAX_NAME, SLOTS, VERSION,
};

/// Default cluster size (SPDK's): 4 MiB.
pub const DEFAULT_CLUSTER_SIZE: u32 = 4 << 20;
const PAGE: u64 = PAGE_SIZE as u64;
pub use crate::md::MAX_VOL_CLUSTERS;
/// Metadata pages only transactions that delete volumes may use.
const MD_RESERVE: u64 = 4;
/// Largest zero buffer used to emulate write-zeroes.
const ZERO_CHUNK: usize = 1 << 20;

/// Options for [`LvStore::create`].
#[derive(Debug, Clone)]
pub struct LvsOptions {
    /// Store name (at most 63 bytes).
    pub name: String,
    /// Store UUID; random when `None`.
    pub uuid: Option<Uuid>,
    /// Cluster size in bytes: a power of two, at least 4 KiB (default 4 MiB).
    pub cluster_size: u32,
    /// Pages reserved for metadata; default one per 8 clusters, at least 64 (SPDK reserves one
    /// per cluster; like SPDK, a clean open reads only the used ones, found in the persisted
    /// metadata page mask, and an open after a crash scans them all).
    pub md_pages: Option<u32>,
    /// How the data area is cleared at creation (SPDK's lvstore `clear_method`).
    pub clear_method: ClearMethod,
}

impl LvsOptions {
    /// Defaults with the given name.
    pub fn new(name: &str) -> Self {
        LvsOptions {
            name: name.to_string(),
            uuid: None,
            cluster_size: DEFAULT_CLUSTER_SIZE,
            md_pages: None,
            clear_method: ClearMethod::Unmap,
        }
    }
}

/// Options for [`LvStore::create_lvol_with`].
#[derive(Debug, Clone, Default)]
pub struct LvolOptions {
    /// Thin provisioned (clusters allocated on first write).
    pub thin: bool,
    /// Clear method for released clusters.
    pub clear_method: ClearMethod,
    /// UUID; random when `None`.
    pub uuid: Option<Uuid>,
}

/// Reported properties of a store (SPDK's `bdev_lvol_get_lvstores`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LvsInfo {
    /// Store name.
    pub name: String,
    /// Store UUID.
    pub uuid: Uuid,
    /// Cluster size in bytes.
    pub cluster_size: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// Clusters available for data.
    pub total_data_clusters: u64,
    /// Free data clusters.
    pub free_clusters: u64,
    /// Pages of the metadata region.
    pub md_pages: u32,
    /// Free metadata pages.
    pub free_md_pages: u32,
    /// Largest size the store can be grown to.
    pub max_growable_size: u64,
}

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
    /// Store name (changed by [`LvStore::rename`]).
    name: std::sync::RwLock<String>,
    pub(crate) uuid: Uuid,
    md: Mutex<MdState>,
    alloc: Mutex<AllocQueue>,
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

/// A logical volume store on a block device. `Send + Sync`; share it with an `Arc`.
pub struct LvStore {
    pub(crate) shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
    report: OpenReport,
}

impl std::fmt::Debug for LvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LvStore")
            .field("name", &self.shared.name())
            .field("uuid", &self.shared.uuid)
            .finish()
    }
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME || name.contains('/') || name.contains('\0') {
        return Err(LvolError::Invalid(format!(
            "bad name {name:?} (1 to {MAX_NAME} bytes, no '/')"
        )));
    }
    Ok(())
}

pub(crate) fn check_name_pub(name: &str) -> Result<()> {
    check_name(name)
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

impl MdState {
    pub(crate) fn page_off(&self, p: u32) -> u64 {
        (u64::from(self.sb.md_start) + u64::from(p)) * PAGE
    }

    pub(crate) fn cs(&self) -> u64 {
        u64::from(self.sb.cluster_size)
    }

    pub(crate) fn check_ok(&self) -> Result<()> {
        if self.closed {
            return Err(LvolError::Closed);
        }
        if self.poisoned {
            return Err(LvolError::CorruptMetadata(
                "an earlier metadata write failed; reopen the store".into(),
            ));
        }
        Ok(())
    }

    /// Writes a new generation of the super block to the other slot and flushes.
    pub(crate) fn write_sb(&mut self, mut sb: SuperBlock) -> Result<()> {
        sb.generation = self.sb.generation + 1;
        let page = sb.encode();
        self.io.write_at(sb.slot() * PAGE, &page)?;
        self.flush()?;
        self.sb = sb;
        Ok(())
    }

    /// Writes the used-page and used-cluster masks to their regions, stamped with the
    /// generation the next super block write gets, and flushes (clean shutdown, before the
    /// super block says `clean`).
    fn write_masks(&mut self) -> Result<()> {
        if !self.sb.has_masks() {
            return Ok(());
        }
        let generation = self.sb.generation + 1;
        let r = encode_mask(
            MASK_TYPE_PAGES,
            generation,
            &self.md_used,
            self.sb.pmask_len,
        );
        self.io
            .write_at(u64::from(self.sb.pmask_start) * PAGE, &r)?;
        if self.sb.cmask_len != 0 {
            let r = encode_mask(
                MASK_TYPE_CLUSTERS,
                generation,
                &self.clusters,
                self.sb.cmask_len,
            );
            self.io
                .write_at(u64::from(self.sb.cmask_start) * PAGE, &r)?;
        }
        self.flush()
    }

    pub(crate) fn check_ok_pub(&self) -> Result<()> {
        self.check_ok()
    }

    pub(crate) fn clusters_mut(&mut self) -> &mut Bitmap {
        &mut self.clusters
    }

    fn alloc_md_page(&mut self) -> Option<u32> {
        let p = self.md_used.find_clear(self.md_hint)?;
        self.md_used.set(p);
        self.md_hint = p + 1;
        Some(p as u32)
    }

    /// Allocates one data cluster near `hint`.
    pub(crate) fn alloc_cluster(&mut self, hint: Option<u64>) -> Result<u32> {
        let h = hint.unwrap_or(self.cluster_hint);
        let c = self
            .clusters
            .find_clear(h)
            .ok_or(LvolError::NoSpace { needed: 1, free: 0 })?;
        self.clusters.set(c);
        self.cluster_hint = c + 1;
        Ok(c as u32)
    }

    pub(crate) fn free_clusters(&self) -> u64 {
        self.clusters.count_clear()
    }

    fn zero_range(&mut self, off: u64, len: u64) -> Result<()> {
        if self.write_zeroes {
            if self.io.write_zeroes(off, len, false).is_ok() {
                return Ok(());
            }
            self.write_zeroes = false;
        }
        let zeroes = vec![0u8; ZERO_CHUNK.min(len as usize)];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            self.io.write_at(off + done, &zeroes[..n])?;
            done += n as u64;
        }
        Ok(())
    }

    /// Fills physical cluster `dst` with a copy of cluster `src`, or zeroes.
    pub(crate) fn fill_cluster(&mut self, dst: u32, src: Option<u32>) -> Result<()> {
        let cs = self.cs();
        match src {
            Some(s) => {
                if self.bounce.len() != cs as usize {
                    self.bounce = vec![0u8; cs as usize];
                }
                let mut buf = std::mem::take(&mut self.bounce);
                let r = self
                    .io
                    .read_at(u64::from(s) * cs, &mut buf)
                    .and_then(|_| self.io.write_at(u64::from(dst) * cs, &buf));
                self.bounce = buf;
                r?;
                Ok(())
            }
            None => self.zero_range(u64::from(dst) * cs, cs),
        }
    }

    pub(crate) fn flush(&mut self) -> Result<()> {
        Ok(self.io.flush()?)
    }

    /// Releases clusters (after the metadata no longer references them), clearing them.
    pub(crate) fn release_clusters(&mut self, phys: &[u32], how: ClearMethod) {
        let cs = self.cs();
        for &p in phys {
            let off = u64::from(p) * cs;
            let r = match how {
                ClearMethod::None => Ok(()),
                ClearMethod::Unmap if self.discard => {
                    self.io.discard(off, cs).map_err(LvolError::from)
                }
                ClearMethod::Unmap => Ok(()),
                ClearMethod::WriteZeroes => self.zero_range(off, cs),
            };
            if let Err(e) = r {
                tracing::warn!("clearing cluster {p}: {e}");
            }
            self.clusters.clear(u64::from(p));
        }
    }

    /// Physical cluster of logical cluster `c` in the ancestors starting at `parent`.
    pub(crate) fn ancestor_cluster(&self, mut parent: Option<u64>, c: u64) -> Option<u32> {
        let mut hops = 0;
        while let Some(pid) = parent {
            let b = self.blobs.get(&pid)?;
            match b.clusters.get(c as usize) {
                Some(&x) if x != 0 => return Some(x),
                Some(_) => {}
                None => return None,
            }
            parent = b.parent;
            hops += 1;
            if hops > self.blobs.len() {
                return None;
            }
        }
        None
    }

    /// Writes `updates` and tombstones for `deletes` as one atomic transaction and applies
    /// them to the in-memory state. On error nothing is applied.
    pub(crate) fn commit(&mut self, updates: Vec<BlobMd>, deletes: &[u64]) -> Result<()> {
        self.check_ok()?;
        let new_ids = updates
            .iter()
            .filter(|b| !self.blobs.contains_key(&b.id))
            .count();
        let live = (self.blobs.len() + new_ids - deletes.len()) as u32;
        let members = (updates.len() + deletes.len()) as u32;
        if members == 0 {
            return Ok(());
        }
        let txn = self.next_txn;
        self.next_txn += 1;
        // Build and place every page before writing any.
        let mut placed: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut chains: Vec<(u64, Vec<u32>)> = Vec::new();
        let mut tombs: Vec<u32> = Vec::new();
        let mut failed = false;
        let mut jobs: Vec<(u64, Vec<Vec<u8>>, u32)> =
            updates.iter().map(|b| (b.id, encode_blob(b), 0)).collect();
        jobs.extend(
            deletes
                .iter()
                .map(|&id| (id, vec![Vec::new()], PAGE_TOMBSTONE)),
        );
        'outer: for (id, bodies, flags) in &jobs {
            let mut idx = Vec::with_capacity(bodies.len());
            for _ in 0..bodies.len() {
                match self.alloc_md_page() {
                    Some(p) => idx.push(p),
                    None => {
                        for p in idx {
                            self.md_used.clear(u64::from(p));
                        }
                        failed = true;
                        break 'outer;
                    }
                }
            }
            let n = bodies.len() as u32;
            for (i, body) in bodies.iter().enumerate() {
                let h = PageHdr {
                    blob_id: *id,
                    seq_num: i as u32,
                    flags: *flags,
                    txn,
                    members,
                    chain_len: n,
                    live,
                    next: idx.get(i + 1).copied().unwrap_or(NO_PAGE),
                };
                placed.push((idx[i], build_page(&h, body)));
            }
            if *flags & PAGE_TOMBSTONE != 0 {
                tombs.extend_from_slice(&idx);
            } else {
                chains.push((*id, idx));
            }
        }
        let undo_pages = |s: &mut MdState, placed: &[(u32, Vec<u8>)]| {
            for (p, _) in placed {
                s.md_used.clear(u64::from(*p));
            }
        };
        // Keep a few pages back for deletions, so a full metadata region can always be
        // relieved by deleting volumes.
        let freed_after: usize = self.deferred_zero.len()
            + updates
                .iter()
                .map(|b| self.pages.get(&b.id).map_or(0, |p| p.len()))
                .sum::<usize>();
        if deletes.is_empty() && self.md_used.count_clear() + (freed_after as u64) < MD_RESERVE {
            failed = true;
        }
        if failed {
            undo_pages(self, &placed);
            return Err(LvolError::MdFull(self.sb.md_len));
        }
        let mut res = Ok(());
        for (p, page) in &placed {
            let off = self.page_off(*p);
            if let Err(e) = self.io.write_at(off, page) {
                res = Err(e);
                break;
            }
        }
        if res.is_ok() {
            res = self.io.flush();
        }
        if let Err(e) = res {
            // Make sure the partial transaction can never be mistaken for a committed one.
            let zero = vec![0u8; PAGE_SIZE];
            let mut ok = true;
            for (p, _) in &placed {
                let off = self.page_off(*p);
                ok &= self.io.write_at(off, &zero).is_ok();
            }
            ok &= self.io.flush().is_ok();
            if !ok {
                self.poisoned = true;
            }
            undo_pages(self, &placed);
            return Err(e.into());
        }
        // Committed. Release what it superseded.
        self.last_committed = txn;
        let zero = vec![0u8; PAGE_SIZE];
        let mut to_zero: Vec<u32> = std::mem::take(&mut self.deferred_zero);
        for (id, idx) in chains {
            if let Some(old) = self.pages.insert(id, idx) {
                to_zero.extend(old);
            }
        }
        for &id in deletes {
            if let Some(old) = self.pages.remove(&id) {
                to_zero.extend(old);
            }
            self.blobs.remove(&id);
        }
        for p in to_zero {
            let off = self.page_off(p);
            if self.io.write_at(off, &zero).is_err() {
                self.poisoned = true;
            }
            self.md_used.clear(u64::from(p));
        }
        self.deferred_zero = tombs;
        for b in updates {
            self.next_id = self.next_id.max((b.id & 0xffff_ffff) + 1);
            self.blobs.insert(b.id, b);
        }
        Ok(())
    }

    /// Copies a blob's persistent state to its live volume handle.
    pub(crate) fn publish(&self, id: u64) {
        let Some(v) = self.vols.get(&id) else { return };
        let Some(b) = self.blobs.get(&id) else { return };
        let parent = b.parent.and_then(|p| self.vols.get(&p).cloned());
        let mut st = v.st_mut();
        st.name = b.name.clone();
        st.map = b.clusters.clone();
        st.parent = parent;
        st.read_only = b.read_only;
        st.thin = b.thin;
    }

    /// Registers a live handle for a new blob.
    pub(crate) fn add_vol(&mut self, shared: &Arc<Shared>, id: u64) -> Arc<Lvol> {
        let uuid = self.blobs.get(&id).map(|b| b.uuid).unwrap_or_default();
        let v = Arc::new_cyclic(|me| Lvol {
            me: me.clone(),
            shared: shared.clone(),
            id,
            uuid,
            state: RwLock::new(VolState {
                name: String::new(),
                map: Vec::new(),
                parent: None,
                read_only: false,
                deleted: false,
                thin: false,
            }),
            frozen: std::sync::atomic::AtomicU32::new(0),
            inflight: AtomicU64::new(0),
            io_epoch: AtomicU64::new(0),
            io_count: [AtomicU64::new(0), AtomicU64::new(0)],
        });
        self.vols.insert(id, v.clone());
        self.publish(id);
        v
    }

    pub(crate) fn remove_vol(&mut self, id: u64) {
        if let Some(v) = self.vols.remove(&id) {
            let mut st = v.st_mut();
            st.deleted = true;
            st.parent = None;
        }
    }

    pub(crate) fn new_id(&mut self) -> u64 {
        let id = (1u64 << 32) | self.next_id;
        self.next_id += 1;
        id
    }

    /// Finds a blob by name, alias or UUID.
    pub(crate) fn find(&self, key: &str) -> Result<u64> {
        let name = match key.split_once('/') {
            Some((lvs, n)) if lvs == self.sb.name => n,
            Some(_) => return Err(LvolError::NotFound(key.to_string())),
            None => key,
        };
        let uuid = Uuid::parse_str(key).ok();
        self.blobs
            .values()
            .find(|b| b.name == name || Some(b.uuid) == uuid)
            .map(|b| b.id)
            .ok_or_else(|| LvolError::NotFound(key.to_string()))
    }

    pub(crate) fn blob(&self, id: u64) -> Result<&BlobMd> {
        self.blobs
            .get(&id)
            .ok_or_else(|| LvolError::NotFound(format!("{id:#x}")))
    }

    pub(crate) fn clones_of(&self, id: u64) -> Vec<u64> {
        self.blobs
            .values()
            .filter(|b| b.parent == Some(id))
            .map(|b| b.id)
            .collect()
    }

    pub(crate) fn name_taken(&self, name: &str) -> bool {
        self.blobs.values().any(|b| b.name == name)
    }

    pub(crate) fn info_of_pub(&self, b: &BlobMd, shared: &Shared) -> LvolInfo {
        self.info_of(b, shared)
    }

    fn info_of(&self, b: &BlobMd, shared: &Shared) -> LvolInfo {
        let cs = self.cs();
        let clones: Vec<String> = self
            .clones_of(b.id)
            .iter()
            .filter_map(|c| self.blobs.get(c).map(|x| x.name.clone()))
            .collect();
        let bs = self.sb.block_size;
        LvolInfo {
            name: b.name.clone(),
            uuid: b.uuid,
            alias: format!("{}/{}", shared.name(), b.name),
            lvs_name: shared.name(),
            lvs_uuid: shared.uuid,
            size_bytes: b.clusters.len() as u64 * cs,
            block_size: bs,
            num_blocks: b.clusters.len() as u64 * cs / u64::from(bs),
            num_allocated_clusters: b.clusters.iter().filter(|&&c| c != 0).count() as u64,
            thin: b.thin,
            snapshot: b.snapshot || !clones.is_empty(),
            clone: b.parent.is_some(),
            base_snapshot: b
                .parent
                .and_then(|p| self.blobs.get(&p).map(|x| x.name.clone())),
            clones,
            read_only: b.read_only,
            clear_method: b.clear,
        }
    }
}

/// Reads the two super block slots and picks the newest valid one.
fn read_superblock(io: &mut SyncIo, dev_size: u64) -> Result<SuperBlock> {
    if dev_size < SLOTS * PAGE {
        return Err(LvolError::NotAnLvstore(format!(
            "device of {dev_size} bytes is too small to hold a super block"
        )));
    }
    let mut best: Option<SuperBlock> = None;
    let mut first_err: Option<LvolError> = None;
    let mut foreign = String::new();
    for slot in 0..SLOTS {
        let mut p = vec![0u8; PAGE_SIZE];
        io.read_at(slot * PAGE, &mut p)?;
        if slot == 0 {
            foreign = describe_foreign(&p);
        }
        match SuperBlock::decode(&p) {
            Ok(Some(sb)) => {
                if best.as_ref().is_none_or(|b| sb.generation > b.generation) {
                    best = Some(sb);
                }
            }
            Ok(None) => {}
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match (best, first_err) {
        (Some(sb), _) => Ok(sb),
        (None, Some(e)) => Err(e),
        (None, None) => Err(LvolError::NotAnLvstore(foreign)),
    }
}

fn describe_foreign(p0: &[u8]) -> String {
    if let Some(d) = crate::superblock::describe_spdk(p0) {
        return d;
    }
    if p0.len() >= 1082 && p0[1080] == 0x53 && p0[1081] == 0xef {
        return "device holds an ext2/3/4 file system".into();
    }
    if p0.iter().all(|&b| b == 0) {
        return "device is blank (all zeroes)".into();
    }
    "no katablk signature in either super block slot".into()
}

impl LvStore {
    fn start(shared: Arc<Shared>, report: OpenReport) -> LvStore {
        let s2 = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("lvs-{}-alloc", shared.name()))
            .spawn(move || crate::alloc::alloc_worker(s2))
            .ok();
        if handle.is_none() {
            tracing::error!("cannot start the allocation worker; thin writes will fail");
            shared.aq().closed = true;
        }
        LvStore {
            shared,
            worker: Mutex::new(handle),
            report,
        }
    }

    /// Creates a new, empty store on `dev`, overwriting whatever it held.
    pub fn create(dev: Arc<dyn BlockDevice>, opts: LvsOptions) -> Result<LvStore> {
        check_name(&opts.name)?;
        let info = dev.info();
        if info.read_only {
            return Err(LvolError::Invalid("device is read-only".into()));
        }
        let cs = opts.cluster_size;
        if !cs.is_power_of_two() || (cs as usize) < PAGE_SIZE || cs < info.block_size {
            return Err(LvolError::Invalid(format!(
                "cluster size {cs} must be a power of two of at least 4096 bytes"
            )));
        }
        let num_clusters = info.size_bytes() / u64::from(cs);
        if num_clusters > u64::from(u32::MAX) {
            return Err(LvolError::Invalid("device has too many clusters".into()));
        }
        // Mask regions follow the super block slots, as in SPDK: the used-page mask, then the
        // used-cluster mask with room for the store to grow to 4 times its size (at least one
        // page, which holds 32512 clusters).
        let cmask_len = mask_pages((num_clusters.saturating_mul(4)).min(u64::from(u32::MAX)));
        let md_len = match opts.md_pages {
            Some(0) => return Err(LvolError::Invalid("md_pages must be positive".into())),
            Some(n) => n,
            // One page per 8 clusters, but at least enough for the super block and mask pages
            // and the metadata to fill the first 4 MiB (1020 pages for most stores: room for
            // ~500 volumes, as every change writes a volume's new chain before freeing the old
            // one) where the device can spare 1/16 of itself, and at least 64 pages; at most
            // 2^18 pages, to keep the scan after a crash short. With 4 MiB clusters the data
            // still starts at cluster 1.
            None => {
                let header = SLOTS + 1 + cmask_len;
                let floor = (info.size_bytes() / PAGE / 16)
                    .clamp(64, ((4 << 20) / PAGE).saturating_sub(header).max(64));
                (num_clusters / 8).clamp(floor, 1 << 18) as u32
            }
        };
        let pmask_len = mask_pages(u64::from(md_len));
        let md_start = SLOTS + pmask_len + cmask_len;
        let (Ok(md_start), Ok(pmask_len), Ok(cmask_len)) = (
            u32::try_from(md_start),
            u32::try_from(pmask_len),
            u32::try_from(cmask_len),
        ) else {
            return Err(LvolError::Invalid("store too large".into()));
        };
        let md_end = (u64::from(md_start) + u64::from(md_len)) * PAGE;
        let first_data_cluster = md_end.div_ceil(u64::from(cs));
        if first_data_cluster >= num_clusters {
            return Err(LvolError::Invalid(format!(
                "device of {} bytes is too small for {md_len} metadata pages and {cs}-byte clusters",
                info.size_bytes()
            )));
        }
        let sb = SuperBlock {
            version: VERSION,
            generation: 1,
            cluster_size: cs,
            block_size: info.block_size,
            md_start,
            md_len,
            size: num_clusters * u64::from(cs),
            num_clusters,
            first_data_cluster,
            uuid: opts.uuid.unwrap_or_else(Uuid::new_v4),
            name: opts.name.clone(),
            clean: false,
            last_txn: 0,
            pmask_start: SLOTS as u32,
            pmask_len,
            cmask_start: SLOTS as u32 + pmask_len,
            cmask_len,
        };
        sb.validate()?;
        let io = SyncIo::new(dev.as_ref())?;
        let mut st = Self::empty_state(io, sb.clone(), &info);
        // Kill the old identity first, then the old masks and metadata, then clear the data
        // area.
        st.zero_range(0, SLOTS * PAGE)?;
        st.flush()?;
        st.zero_range(
            SLOTS * PAGE,
            (u64::from(md_start) - SLOTS + u64::from(md_len)) * PAGE,
        )?;
        let data_off = first_data_cluster * u64::from(cs);
        let data_len = (num_clusters - first_data_cluster) * u64::from(cs);
        match opts.clear_method {
            ClearMethod::None => {}
            ClearMethod::Unmap => {
                if st.discard {
                    // Discard is advisory; a failure is not fatal.
                    let _ = st.io.discard(data_off, data_len);
                }
            }
            ClearMethod::WriteZeroes => st.zero_range(data_off, data_len)?,
        }
        st.flush()?;
        let page = sb.encode();
        st.io.write_at(PAGE, &page)?;
        st.io.write_at(0, &page)?;
        st.flush()?;
        let shared = Self::make_shared(dev, &sb, st);
        tracing::info!(
            "created lvstore {} ({}) with {} data clusters",
            sb.name,
            sb.uuid,
            num_clusters - first_data_cluster
        );
        let report = OpenReport {
            version: VERSION,
            ..Default::default()
        };
        Ok(Self::start(shared, report))
    }

    fn empty_state(io: SyncIo, sb: SuperBlock, info: &katablk_bdev::DeviceInfo) -> MdState {
        let mut clusters = Bitmap::new(sb.num_clusters);
        for c in 0..sb.first_data_cluster {
            clusters.set(c);
        }
        MdState {
            io,
            md_used: Bitmap::new(u64::from(sb.md_len)),
            cluster_hint: sb.first_data_cluster,
            sb,
            clusters,
            blobs: BTreeMap::new(),
            pages: HashMap::new(),
            vols: HashMap::new(),
            next_txn: 1,
            last_committed: 0,
            next_id: 0,
            deferred_zero: Vec::new(),
            poisoned: false,
            closed: false,
            md_hint: 0,
            bounce: Vec::new(),
            write_zeroes: info.write_zeroes,
            discard: info.discard,
        }
    }

    fn make_shared(dev: Arc<dyn BlockDevice>, sb: &SuperBlock, st: MdState) -> Arc<Shared> {
        Arc::new(Shared {
            dev,
            cluster_size: u64::from(sb.cluster_size),
            name: std::sync::RwLock::new(sb.name.clone()),
            uuid: sb.uuid,
            md: Mutex::new(st),
            alloc: Mutex::new(AllocQueue::default()),
            alloc_cv: Condvar::new(),
            closed: AtomicBool::new(false),
            allocations: AtomicU64::new(0),
            releasing: AtomicU64::new(0),
        })
    }

    /// Opens (examines) the store on `dev`: validates the super block; after a clean shutdown
    /// reads the persisted allocation masks and only the metadata pages they mark used,
    /// otherwise scans the whole metadata region, recovers from an interrupted transaction and
    /// rebuilds the masks (see [`LvStore::open_report`]).
    pub fn open(dev: Arc<dyn BlockDevice>) -> Result<LvStore> {
        let info = dev.info();
        let mut io = SyncIo::new(dev.as_ref())?;
        let sb = read_superblock(&mut io, info.size_bytes())?;
        if sb.block_size != info.block_size {
            return Err(LvolError::CorruptSuperblock(format!(
                "store block size {} differs from the device's {}",
                sb.block_size, info.block_size
            )));
        }
        if info.size_bytes() < sb.size {
            return Err(LvolError::DeviceTooSmall {
                needed: sb.size,
                actual: info.size_bytes(),
            });
        }
        let mut st = Self::empty_state(io, sb, &info);
        let report = st.recover()?;
        let sb = st.sb.clone();
        let shared = Self::make_shared(dev, &sb, st);
        {
            let mut st = shared.md();
            let ids: Vec<u64> = st.blobs.keys().copied().collect();
            for &id in &ids {
                st.add_vol(&shared, id);
            }
            // Parents may have been registered after their children.
            for &id in &ids {
                st.publish(id);
            }
        }
        Ok(Self::start(shared, report))
    }

    /// How [`LvStore::open`] found the store: clean or not, whether the persisted allocation
    /// masks were used, how many metadata pages were read, what was rolled back and scrubbed.
    /// For a store made by [`LvStore::create`], all fields are defaults except `version`.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// Whether `dev` holds a katablk lvstore (a valid super block in either slot), without
    /// opening it. Errors only when the device cannot be read.
    pub fn probe(dev: &dyn BlockDevice) -> Result<bool> {
        let mut io = SyncIo::new(dev)?;
        match read_superblock(&mut io, dev.info().size_bytes()) {
            Ok(_) => Ok(true),
            Err(LvolError::Io(e)) => Err(LvolError::Io(e)),
            Err(_) => Ok(false),
        }
    }

    /// Closes the store: stops the allocation worker and detaches the volumes (their handles
    /// stay valid for I/O to allocated clusters). Also done on drop.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        let waiters: Vec<Waiter> = {
            let mut q = self.shared.aq();
            q.closed = true;
            q.queue.clear();
            q.releases.clear();
            q.pending.drain().flat_map(|(_, w)| w).collect()
        };
        for w in waiters {
            w.chan.notify(w.slot, 0, Err(IoError::Errno(libc::ENODEV)));
        }
        self.shared.alloc_cv.notify_all();
        if let Some(h) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
        let mut st = self.shared.md();
        if !st.poisoned && !st.sb.clean {
            let mut sb = st.sb.clone();
            sb.clean = true;
            sb.last_txn = st.last_committed;
            // Masks first (flushed), then the super block that makes them valid.
            if let Err(e) = st
                .flush()
                .and_then(|_| st.write_masks())
                .and_then(|_| st.write_sb(sb))
            {
                tracing::warn!("lvstore {}: marking clean shutdown: {e}", st.sb.name);
            }
        }
        st.closed = true;
        // Handles kept by users keep serving allocated clusters (parent links stay, so clones
        // still read through); only the store's own references are dropped.
        st.vols.clear();
    }

    /// Destroys the store: every volume is detached and the super block and metadata are
    /// erased, so the device no longer opens as a store.
    pub fn destroy(self) -> Result<()> {
        let vols: Vec<Arc<Lvol>> = self.shared.md().vols.values().cloned().collect();
        for v in &vols {
            let _ = v.freeze();
            v.st_mut().deleted = true;
        }
        self.close();
        let mut st = self.shared.md();
        st.poisoned = true;
        let header = u64::from(st.sb.md_start) * PAGE;
        st.zero_range(0, header)?;
        st.flush()?;
        let (start, len) = (u64::from(st.sb.md_start), u64::from(st.sb.md_len));
        st.zero_range(start * PAGE, len * PAGE)?;
        st.flush()?;
        Ok(())
    }

    /// Store properties.
    pub fn info(&self) -> LvsInfo {
        let st = self.shared.md();
        let cs = st.cs();
        LvsInfo {
            name: self.shared.name(),
            uuid: self.shared.uuid,
            cluster_size: cs,
            block_size: st.sb.block_size,
            total_data_clusters: st.sb.num_clusters - st.sb.first_data_cluster,
            free_clusters: st.free_clusters(),
            md_pages: st.sb.md_len,
            free_md_pages: st.md_used.count_clear() as u32,
            max_growable_size: cs * u64::from(u32::MAX),
        }
    }

    /// Store name.
    pub fn name(&self) -> String {
        self.shared.name()
    }

    /// Renames the store (SPDK's `bdev_lvol_rename_lvstore`); volume aliases follow.
    pub fn rename_store(&self, new_name: &str) -> Result<()> {
        if new_name.is_empty() || new_name.len() > 63 || new_name.contains('/') {
            return Err(LvolError::Invalid(format!(
                "lvstore name {new_name:?} must be 1 to 63 bytes without '/'"
            )));
        }
        let mut st = self.shared.md();
        st.check_ok()?;
        let mut sb = st.sb.clone();
        sb.name = new_name.to_string();
        sb.validate()?;
        st.write_sb(sb)?;
        if let Ok(mut n) = self.shared.name.write() {
            *n = new_name.to_string();
        }
        Ok(())
    }

    /// Store UUID.
    pub fn uuid(&self) -> Uuid {
        self.shared.uuid
    }

    /// The backing device.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.shared.dev
    }

    /// Grows the store to the current size of the device. Returns the new number of data
    /// clusters.
    pub fn grow(&self) -> Result<u64> {
        let mut st = self.shared.md();
        st.check_ok()?;
        let size = self.shared.dev.info().size_bytes();
        let cs = st.cs();
        let n = (size / cs).min(u64::from(u32::MAX));
        if n > st.sb.num_clusters {
            let mut sb = st.sb.clone();
            sb.num_clusters = n;
            sb.size = n * cs;
            if sb.cmask_len != 0 && mask_capacity(sb.cmask_len) < n {
                // No room to persist the larger cluster mask: stop keeping one. Opens after a
                // clean shutdown still read only the used metadata pages and derive the used
                // clusters from the volumes.
                tracing::warn!(
                    "lvstore {}: the cluster mask region holds {} clusters, the store now has \
                     {n}; the cluster mask is no longer persisted",
                    sb.name,
                    mask_capacity(sb.cmask_len)
                );
                sb.cmask_len = 0;
            }
            sb.validate()?;
            st.write_sb(sb)?;
            st.clusters.grow(n);
        }
        Ok(st.sb.num_clusters - st.sb.first_data_cluster)
    }

    /// Looks a volume up by name, alias (`lvs/name`) or UUID.
    pub fn lvol(&self, key: &str) -> Result<Arc<Lvol>> {
        let st = self.shared.md();
        let id = st.find(key)?;
        st.vols.get(&id).cloned().ok_or(LvolError::Closed)
    }

    /// Every volume, in blob id order.
    pub fn list(&self) -> Vec<LvolInfo> {
        let st = self.shared.md();
        st.blobs
            .values()
            .map(|b| st.info_of(b, &self.shared))
            .collect()
    }

    /// One volume's properties.
    pub fn lvol_info(&self, key: &str) -> Result<LvolInfo> {
        let st = self.shared.md();
        let id = st.find(key)?;
        Ok(st.info_of(st.blob(id)?, &self.shared))
    }

    fn clusters_for(&self, size_bytes: u64) -> Result<u64> {
        if size_bytes == 0 {
            return Err(LvolError::Invalid("size must be positive".into()));
        }
        Ok(size_bytes.div_ceil(self.shared.cluster_size))
    }

    /// Creates a volume of `size_bytes` (rounded up to whole clusters).
    pub fn create_lvol(&self, name: &str, size_bytes: u64, thin: bool) -> Result<Arc<Lvol>> {
        self.create_lvol_with(
            name,
            size_bytes,
            LvolOptions {
                thin,
                ..Default::default()
            },
        )
    }

    /// Creates a volume with options.
    pub fn create_lvol_with(
        &self,
        name: &str,
        size_bytes: u64,
        opts: LvolOptions,
    ) -> Result<Arc<Lvol>> {
        check_name(name)?;
        let n = self.clusters_for(size_bytes)?;
        let mut st = self.shared.md();
        st.check_ok()?;
        if st.name_taken(name) {
            return Err(LvolError::Exists(name.to_string()));
        }
        if let Some(u) = opts.uuid {
            if st.blobs.values().any(|b| b.uuid == u) {
                return Err(LvolError::Exists(u.to_string()));
            }
        }
        if n > MAX_VOL_CLUSTERS {
            return Err(LvolError::NoSpace {
                needed: n,
                free: st.free_clusters(),
            });
        }
        let mut clusters = vec![0u32; n as usize];
        if !opts.thin {
            if n > st.free_clusters() {
                return Err(LvolError::NoSpace {
                    needed: n,
                    free: st.free_clusters(),
                });
            }
            let mut prev = None;
            for c in clusters.iter_mut() {
                let p = st.alloc_cluster(prev)?;
                prev = Some(u64::from(p) + 1);
                *c = p;
            }
        }
        let id = st.new_id();
        let b = BlobMd {
            id,
            name: name.to_string(),
            uuid: opts.uuid.unwrap_or_else(Uuid::new_v4),
            clusters: clusters.clone(),
            thin: opts.thin,
            read_only: false,
            snapshot: false,
            parent: None,
            clear: opts.clear_method,
        };
        if let Err(e) = st.commit(vec![b], &[]) {
            for &p in &clusters {
                if p != 0 {
                    st.clusters.clear(u64::from(p));
                }
            }
            return Err(e);
        }
        Ok(st.add_vol(&self.shared, id))
    }

    /// Renames a volume.
    pub fn rename(&self, key: &str, new_name: &str) -> Result<()> {
        check_name(new_name)?;
        let mut st = self.shared.md();
        let id = st.find(key)?;
        if st.blob(id)?.name == new_name {
            return Ok(());
        }
        if st.name_taken(new_name) {
            return Err(LvolError::Exists(new_name.to_string()));
        }
        let mut b = st.blob(id)?.clone();
        b.name = new_name.to_string();
        st.commit(vec![b], &[])?;
        st.publish(id);
        Ok(())
    }

    /// Makes a volume read-only (persistently).
    pub fn set_read_only(&self, key: &str) -> Result<()> {
        let mut st = self.shared.md();
        let id = st.find(key)?;
        let mut b = st.blob(id)?.clone();
        if b.read_only {
            return Ok(());
        }
        b.read_only = true;
        st.commit(vec![b], &[])?;
        st.publish(id);
        Ok(())
    }

    /// Resizes a volume to `size_bytes` (rounded up to whole clusters). Shrinking releases the
    /// clusters beyond the new end (after draining I/O).
    pub fn resize(&self, key: &str, size_bytes: u64) -> Result<()> {
        let n = self.clusters_for(size_bytes)? as usize;
        let vol = self.lvol(key)?;
        let shrinking = vol.st().map.len() > n;
        let _frozen = if shrinking { Some(vol.freeze()?) } else { None };
        let mut st = self.shared.md();
        st.check_ok()?;
        let mut b = st.blob(vol.id)?.clone();
        if b.read_only {
            return Err(LvolError::ReadOnly(b.name));
        }
        let old = b.clusters.len();
        let mut released = Vec::new();
        let mut taken = Vec::new();
        let mut fill = false;
        if n < old {
            released = b.clusters[n..]
                .iter()
                .copied()
                .filter(|&c| c != 0)
                .collect();
            b.clusters.truncate(n);
        } else if n > old {
            let extra = (n - old) as u64;
            if !b.thin && extra > st.free_clusters() {
                return Err(LvolError::NoSpace {
                    needed: extra,
                    free: st.free_clusters(),
                });
            }
            if n as u64 > MAX_VOL_CLUSTERS {
                return Err(LvolError::NoSpace {
                    needed: n as u64,
                    free: st.free_clusters(),
                });
            }
            let mut prev = b
                .clusters
                .last()
                .filter(|&&c| c != 0)
                .map(|&c| u64::from(c) + 1);
            let mut r = Ok(());
            for c in old..n {
                // A grown clone must not expose ancestor data beyond its old end: such clusters
                // get zeroed clusters of their own.
                let masked = b.thin && st.ancestor_cluster(b.parent, c as u64).is_some();
                if b.thin && !masked {
                    b.clusters.push(0);
                    continue;
                }
                let p = match st.alloc_cluster(prev) {
                    Ok(p) => p,
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                };
                prev = Some(u64::from(p) + 1);
                taken.push(p);
                b.clusters.push(p);
                if masked {
                    fill = true;
                    if let Err(e) = st.fill_cluster(p, None) {
                        r = Err(e);
                        break;
                    }
                }
            }
            if let Err(e) = r {
                for p in taken {
                    st.clusters.clear(u64::from(p));
                }
                return Err(e);
            }
        } else {
            return Ok(());
        }
        let clear = b.clear;
        let r = if !fill { Ok(()) } else { st.flush() };
        if let Err(e) = r.and_then(|_| st.commit(vec![b], &[])) {
            for p in taken {
                st.clusters.clear(u64::from(p));
            }
            return Err(e);
        }
        st.publish(vol.id);
        st.release_clusters(&released, clear);
        Ok(())
    }

    /// Volumes of the store that are still open.
    pub(crate) fn vols(&self, ids: &[u64]) -> Vec<Arc<Lvol>> {
        let st = self.shared.md();
        ids.iter().filter_map(|i| st.vols.get(i).cloned()).collect()
    }

    /// Number of cluster allocations done by the write path since open (for tests).
    pub fn allocations(&self) -> u64 {
        self.shared.allocations.load(Ordering::Relaxed)
    }

    /// Clusters released by discards that are no longer in any volume but not free yet:
    /// requests issued to them before the discard are still running. They become free (or,
    /// if those requests never finish, stay in use until the store is reopened) without
    /// anything else waiting for them.
    pub fn releasing_clusters(&self) -> u64 {
        self.shared.releasing.load(Ordering::SeqCst)
    }

    /// Waits until no released cluster is waiting for earlier requests (at most `timeout`);
    /// true if none is.
    pub fn settle_releases(&self, timeout: std::time::Duration) -> bool {
        let start = std::time::Instant::now();
        while self.releasing_clusters() != 0 {
            if start.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        true
    }
}

impl Drop for LvStore {
    fn drop(&mut self) {
        self.close();
    }
}
