//! A logical volume: a [`BlockDevice`] whose clusters are mapped onto the store's device.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use katablk_bdev::{BdevError, BlockDevice, DeviceInfo, IoChannel};
use uuid::Uuid;

use crate::channel::LvolChannel;
use crate::error::{LvolError, Result};
use crate::md::ClearMethod;
use crate::shared::Shared;

/// Reported properties of a volume (the fields of SPDK's `bdev_lvol_get_lvols` and
/// `bdev_get_bdevs` `driver_specific.lvol`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LvolInfo {
    /// Volume name.
    pub name: String,
    /// Volume UUID (SPDK names the bdev by it).
    pub uuid: Uuid,
    /// `<lvs name>/<lvol name>`.
    pub alias: String,
    /// Store name.
    pub lvs_name: String,
    /// Store UUID.
    pub lvs_uuid: Uuid,
    /// Size in bytes (a multiple of the cluster size).
    pub size_bytes: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// Size in blocks.
    pub num_blocks: u64,
    /// Clusters allocated to this volume itself (not its ancestors).
    pub num_allocated_clusters: u64,
    /// Thin provisioned.
    pub thin: bool,
    /// A snapshot (read-only, created by [`crate::LvStore::snapshot`]) or a volume with clones.
    pub snapshot: bool,
    /// Has a parent snapshot.
    pub clone: bool,
    /// Name of the parent snapshot.
    pub base_snapshot: Option<String>,
    /// Names of the clones (for snapshots).
    pub clones: Vec<String>,
    /// Writes are refused.
    pub read_only: bool,
    /// Clear method for released clusters.
    pub clear_method: ClearMethod,
}

/// Mutable state of a volume seen by the data path.
#[derive(Debug)]
pub(crate) struct VolState {
    pub(crate) name: String,
    /// Physical cluster of each logical cluster (0: unallocated).
    pub(crate) map: Vec<u32>,
    pub(crate) parent: Option<Arc<Lvol>>,
    pub(crate) read_only: bool,
    pub(crate) deleted: bool,
    /// Thin provisioned: whole-cluster discards may release clusters.
    pub(crate) thin: bool,
}

/// A logical volume. Implements [`BlockDevice`]; obtained from [`crate::LvStore`].
pub struct Lvol {
    /// This handle (for channels, which keep the volume alive).
    pub(crate) me: std::sync::Weak<Lvol>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: u64,
    pub(crate) uuid: Uuid,
    pub(crate) state: RwLock<VolState>,
    /// Number of operations that froze the volume (new I/O is deferred while non-zero).
    pub(crate) frozen: AtomicU32,
    pub(crate) inflight: AtomicU64,
    /// Epoch of the cluster map, advanced by each release after it unmapped clusters.
    pub(crate) io_epoch: AtomicU64,
    /// Device requests on the volume's own clusters in flight, by epoch parity (thin volumes
    /// only): a release waits for the bucket of the epoch in which it unmapped a cluster to
    /// drain before the cluster can be handed out again.
    pub(crate) io_count: [AtomicU64; 2],
}

impl std::fmt::Debug for Lvol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lvol")
            .field("id", &format_args!("{:#x}", self.id))
            .field("uuid", &self.uuid)
            .field("name", &self.name())
            .finish()
    }
}

impl Lvol {
    pub(crate) fn st(&self) -> RwLockReadGuard<'_, VolState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn st_mut(&self) -> std::sync::RwLockWriteGuard<'_, VolState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Volume name.
    pub fn name(&self) -> String {
        self.st().name.clone()
    }

    /// Volume UUID.
    pub fn uuid(&self) -> Uuid {
        self.uuid
    }

    /// Blob id in the store.
    pub fn blob_id(&self) -> u64 {
        self.id
    }

    /// `<lvs>/<lvol>`.
    pub fn alias(&self) -> String {
        format!("{}/{}", self.shared.name(), self.name())
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.st().map.len() as u64 * self.shared.cluster_size
    }

    /// Reported properties (as [`crate::LvStore::lvol_info`]).
    pub fn properties(&self) -> Result<LvolInfo> {
        let st = self.shared.md();
        let b = st.blob(self.id)?;
        Ok(st.info_of_pub(b, &self.shared))
    }

    /// The volume was deleted (I/O fails).
    pub fn is_deleted(&self) -> bool {
        self.st().deleted
    }

    /// Counts a device request on one of the volume's own clusters, issued while the caller
    /// holds the state read lock; returns its bucket for [`Lvol::uncount`].
    pub(crate) fn count(&self) -> u8 {
        let b = (self.io_epoch.load(Ordering::SeqCst) & 1) as usize;
        self.io_count[b].fetch_add(1, Ordering::SeqCst);
        b as u8
    }

    /// The request counted in `bucket` completed (no-op for uncounted requests).
    pub(crate) fn uncount(&self, bucket: u8) {
        if let Some(c) = self.io_count.get(bucket as usize) {
            c.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Starts a new epoch (after clusters were unmapped); returns the bucket that counts the
    /// requests issued in the previous one. Once [`Lvol::bucket_idle`] says it is empty, no
    /// request issued before the unmap is still running. One drain per volume at a time: the
    /// next epoch would count into the same bucket.
    pub(crate) fn begin_drain(&self) -> u8 {
        (self.io_epoch.fetch_add(1, Ordering::SeqCst) & 1) as u8
    }

    /// Whether every request counted in `bucket` has completed.
    pub(crate) fn bucket_idle(&self, bucket: u8) -> bool {
        self.io_count
            .get(bucket as usize)
            .is_none_or(|c| c.load(Ordering::SeqCst) == 0)
    }

    pub(crate) fn ancestor_has(st: &VolState, c: u64) -> bool {
        let mut p = st.parent.clone();
        while let Some(v) = p {
            let ps = v.st();
            match ps.map.get(c as usize) {
                Some(&x) if x != 0 => return true,
                Some(_) => {}
                None => return false,
            }
            p = ps.parent.clone();
        }
        false
    }

    /// Physical cluster holding logical cluster `c` in this volume or its nearest ancestor.
    pub(crate) fn resolve(st: &VolState, c: u64) -> Option<u32> {
        let own = *st.map.get(c as usize)?;
        if own != 0 {
            return Some(own);
        }
        let mut p = st.parent.clone();
        while let Some(v) = p {
            let ps = v.st();
            match ps.map.get(c as usize) {
                Some(&x) if x != 0 => return Some(x),
                Some(_) => {}
                None => return None,
            }
            p = ps.parent.clone();
        }
        None
    }

    /// Stops new I/O and waits for in-flight I/O to drain.
    pub(crate) fn freeze(self: &Arc<Self>) -> Result<Frozen> {
        self.frozen.fetch_add(1, Ordering::SeqCst);
        let guard = Frozen(self.clone());
        let start = Instant::now();
        while self.inflight.load(Ordering::SeqCst) != 0 {
            if start.elapsed() > Duration::from_secs(10) {
                return Err(LvolError::Busy(self.name()));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(guard)
    }
}

/// Undoes [`Lvol::freeze`] when dropped.
pub(crate) struct Frozen(Arc<Lvol>);

impl Drop for Frozen {
    fn drop(&mut self) {
        self.0.frozen.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Wrapper that owns an `Arc<Lvol>` so the channel can keep the volume alive.
pub(crate) fn open_channel(
    vol: &Arc<Lvol>,
    depth: usize,
    max_segments: usize,
) -> Result<Box<dyn IoChannel>, BdevError> {
    Ok(Box::new(LvolChannel::new(
        vol.clone(),
        depth,
        max_segments,
    )?))
}

impl BlockDevice for Lvol {
    fn info(&self) -> DeviceInfo {
        let b = self.shared.dev.info();
        let st = self.st();
        let size = st.map.len() as u64 * self.shared.cluster_size;
        DeviceInfo {
            block_size: b.block_size,
            num_blocks: size / u64::from(b.block_size),
            read_only: st.read_only || st.deleted || b.read_only,
            volatile_cache: b.volatile_cache,
            discard: true,
            write_zeroes: b.write_zeroes,
            buf_align: b.buf_align,
            physical_block_size: b.physical_block_size,
            optimal_io_size: b.optimal_io_size,
        }
    }

    fn open_channel(
        &self,
        depth: usize,
        max_segments: usize,
    ) -> Result<Box<dyn IoChannel>, BdevError> {
        if self.is_deleted() {
            return Err(BdevError::Invalid(format!(
                "volume {} was deleted",
                self.name()
            )));
        }
        // The channel keeps an owning handle; `self` is always inside an `Arc`.
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| BdevError::Invalid("volume handle is being dropped".into()))?;
        open_channel(&me, depth, max_segments)
    }

    fn describe(&self) -> String {
        format!(
            "lvol {} ({}) on {}",
            self.alias(),
            self.uuid,
            self.shared.dev.describe()
        )
    }
}
