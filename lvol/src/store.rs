//! The volume store: creation, examination (open), lifecycle (the state it shares with its
//! volumes and their channels is in `crate::shared`). The metadata transaction engine is in
//! [`txn`] (`impl MdState`), the volume-level operations in
//! [`volumes`].

mod txn;
mod volumes;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;

use katablk_bdev::sync::SyncIo;
use katablk_bdev::{BlockDevice, IoError};
use uuid::Uuid;

use crate::cluster_map::Bitmap;
use crate::error::{LvolError, Result};
use crate::lvol::{Lvol, LvolInfo, VolState};
use crate::md::{
    build_page, encode_blob, BlobMd, ClearMethod, PageHdr, NO_PAGE, PAGE_SIZE, PAGE_TOMBSTONE,
};
use crate::recover::OpenReport;
use crate::shared::{AllocQueue, MdState, Shared, Waiter};
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
        check_name(new_name)?;
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
}

impl Drop for LvStore {
    fn drop(&mut self) {
        self.close();
    }
}
