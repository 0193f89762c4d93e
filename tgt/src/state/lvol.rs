//! Lvstores and lvols: the `bdev_lvol_*` operations.

use std::sync::Arc;

use katablk_bdev::BlockDevice;
use katablk_lvol::{ClearMethod, LvStore, LvolOptions, LvsOptions};
use katablk_rpc::methods::*;
use katablk_rpc::SpdkError;
use tracing::{info, warn};
use uuid::Uuid;

use crate::error::{einval, in_use, lvol_err};
use crate::names::valid_name;

use super::{Found, Inner, Store, Target, MIB};

pub(super) fn parse_uuid_opt(s: &Option<String>) -> Result<Option<Uuid>, SpdkError> {
    match s {
        Some(u) => Uuid::parse_str(u)
            .map(Some)
            .map_err(|_| einval(format!("bad uuid {u:?}"))),
        None => Ok(None),
    }
}

/// Examine: an lvstore on a new bdev is opened with all its lvols (SPDK's examine). Done
/// before the bdev is added, outside the lock for files.
pub(super) fn examine(name: &str, dev: &Arc<dyn BlockDevice>) -> Option<LvStore> {
    match LvStore::probe(&**dev) {
        Ok(true) => match LvStore::open(dev.clone()) {
            Ok(lvs) => Some(lvs),
            Err(e) => {
                warn!(bdev = %name, "lvstore found but cannot be opened: {e}");
                None
            }
        },
        Ok(false) => None,
        Err(e) => {
            warn!(bdev = %name, "examine failed: {e}");
            None
        }
    }
}

pub(super) fn lvs_clear(m: Option<LvsClearMethod>) -> ClearMethod {
    match m {
        Some(LvsClearMethod::None) => ClearMethod::None,
        Some(LvsClearMethod::WriteZeroes) => ClearMethod::WriteZeroes,
        _ => ClearMethod::Unmap,
    }
}

/// Single-lvol operations without parameters beyond the name.
#[derive(Debug, Clone, Copy)]
pub enum LvolOp {
    /// `bdev_lvol_inflate`.
    Inflate,
    /// `bdev_lvol_decouple_parent`.
    DecoupleParent,
    /// `bdev_lvol_set_read_only`.
    SetReadOnly,
}

impl Target {
    /// `bdev_lvol_create_lvstore`.
    pub fn create_lvstore(&self, p: &BdevLvolCreateLvstoreParams) -> Result<String, SpdkError> {
        let mut inner = self.lock()?;
        valid_name("lvstore", &p.lvs_name)?;
        if p.lvs_name.len() > 63 {
            return Err(einval("lvstore name longer than 63 bytes"));
        }
        let b = inner
            .bdevs
            .get(&p.bdev_name)
            .ok_or_else(SpdkError::no_such_device)?;
        if inner.stores.iter().any(|s| s.base == p.bdev_name) {
            return Err(in_use(&format!("bdev {}", p.bdev_name), "an lvstore"));
        }
        if let Some(c) = inner.users_of(&p.bdev_name).first() {
            return Err(in_use(
                &format!("bdev {}", p.bdev_name),
                &format!("controller {c}"),
            ));
        }
        if inner.stores.iter().any(|s| s.lvs.name() == p.lvs_name) {
            return Err(SpdkError::exists());
        }
        let mut opts = LvsOptions::new(&p.lvs_name);
        if let Some(c) = p.cluster_sz {
            opts.cluster_size = c;
        }
        opts.clear_method = lvs_clear(p.clear_method);
        let dev = b.dev.clone();
        let lvs = LvStore::create(dev, opts).map_err(lvol_err)?;
        let uuid = lvs.uuid().to_string();
        info!(bdev = %p.bdev_name, lvs = %p.lvs_name, %uuid, "lvstore created");
        inner.stores.push(Store {
            lvs: Arc::new(lvs),
            base: p.bdev_name.clone(),
        });
        Ok(uuid)
    }

    /// `bdev_lvol_get_lvstores`.
    pub fn get_lvstores(&self, sel: &LvstoreSelector) -> Result<Vec<LvstoreInfo>, SpdkError> {
        let inner = self.lock()?;
        let filter = sel.filter()?;
        let idx: Vec<usize> = match filter {
            Some(k) => vec![inner.store_index(k).ok_or_else(SpdkError::no_such_device)?],
            None => (0..inner.stores.len()).collect(),
        };
        Ok(idx
            .into_iter()
            .map(|i| {
                let s = &inner.stores[i];
                let li = s.lvs.info();
                LvstoreInfo {
                    uuid: li.uuid.to_string(),
                    name: li.name,
                    base_bdev: s.base.clone(),
                    total_data_clusters: li.total_data_clusters,
                    free_clusters: li.free_clusters,
                    block_size: li.block_size,
                    cluster_size: li.cluster_size,
                    max_growable_size: Some(li.max_growable_size),
                    extra: Default::default(),
                }
            })
            .collect())
    }

    /// `bdev_lvol_delete_lvstore`.
    pub fn delete_lvstore(&self, sel: &LvstoreSelector) -> Result<bool, SpdkError> {
        let mut inner = self.lock()?;
        let i = inner
            .store_index(sel.key()?)
            .ok_or_else(SpdkError::no_such_device)?;
        if let Some(u) = inner.store_in_use(i) {
            return Err(in_use(
                &format!("lvstore {}", inner.stores[i].lvs.name()),
                &u,
            ));
        }
        let s = inner.stores.remove(i);
        let name = s.lvs.name();
        match Arc::try_unwrap(s.lvs) {
            Ok(lvs) => lvs.destroy().map_err(lvol_err)?,
            Err(lvs) => {
                // Still referenced (an lvol handle in flight): put it back rather than lose it.
                inner.stores.insert(i, Store { lvs, base: s.base });
                return Err(SpdkError::busy());
            }
        }
        info!(lvs = %name, "lvstore deleted");
        Ok(true)
    }

    /// `bdev_lvol_grow_lvstore`.
    pub fn grow_lvstore(&self, sel: &LvstoreSelector) -> Result<bool, SpdkError> {
        let inner = self.lock()?;
        let i = inner
            .store_index(sel.key()?)
            .ok_or_else(SpdkError::no_such_device)?;
        // Pick up a grown file or disk first (SPDK needs a separate bdev_aio_rescan).
        if let Some(b) = inner.bdevs.get(&inner.stores[i].base) {
            b.dev
                .rescan()
                .map_err(|e| SpdkError::internal(format!("rescan: {e}")))?;
        }
        let n = inner.stores[i].lvs.grow().map_err(lvol_err)?;
        info!(
            lvs = inner.stores[i].lvs.name(),
            clusters = n,
            "lvstore grown"
        );
        Ok(true)
    }

    /// `bdev_lvol_rename_lvstore`.
    pub fn rename_lvstore(&self, p: &RenameParams) -> Result<bool, SpdkError> {
        let inner = self.lock()?;
        valid_name("lvstore", &p.new_name)?;
        let i = inner
            .store_index(LvstoreKey::Name(&p.old_name))
            .ok_or_else(SpdkError::no_such_device)?;
        if inner.stores.iter().any(|s| s.lvs.name() == p.new_name) {
            return Err(SpdkError::exists());
        }
        inner.stores[i]
            .lvs
            .rename_store(&p.new_name)
            .map_err(lvol_err)?;
        info!(old = %p.old_name, new = %p.new_name, "lvstore renamed");
        Ok(true)
    }

    /// `bdev_lvol_create`.
    pub fn create_lvol(&self, p: &BdevLvolCreateParams) -> Result<String, SpdkError> {
        let inner = self.lock()?;
        valid_name("lvol", &p.lvol_name)?;
        let i = inner
            .store_index(p.lvstore()?)
            .ok_or_else(SpdkError::no_such_device)?;
        let lvs = &inner.stores[i].lvs;
        if lvs.lvol(&p.lvol_name).is_ok() {
            return Err(SpdkError::exists());
        }
        let size = p
            .size_in_mib
            .checked_mul(MIB)
            .ok_or_else(|| SpdkError::invalid_params("No space left on device"))?;
        let clear_method = match p.clear_method {
            Some(LvolClearMethod::None) => ClearMethod::None,
            Some(LvolClearMethod::WriteZeroes) => ClearMethod::WriteZeroes,
            _ => ClearMethod::Unmap,
        };
        let opts = LvolOptions {
            thin: p.thin_provision.unwrap_or(false),
            clear_method,
            uuid: None,
        };
        let lvol = lvs
            .create_lvol_with(&p.lvol_name, size, opts)
            .map_err(lvol_err)?;
        info!(lvol = %lvol.alias(), uuid = %lvol.uuid(), size, "lvol created");
        Ok(lvol.uuid().to_string())
    }

    /// `bdev_lvol_get_lvols`.
    pub fn get_lvols(&self, p: &BdevLvolGetLvolsParams) -> Result<Vec<LvolInfo>, SpdkError> {
        let inner = self.lock()?;
        let idx: Vec<usize> = match (p.lvs_uuid.as_deref(), p.lvs_name.as_deref()) {
            (None, None) => (0..inner.stores.len()).collect(),
            (Some(u), None) => vec![inner
                .store_index(LvstoreKey::Uuid(u))
                .ok_or_else(SpdkError::no_such_device)?],
            (None, Some(n)) => vec![inner
                .store_index(LvstoreKey::Name(n))
                .ok_or_else(SpdkError::no_such_device)?],
            _ => return Err(SpdkError::einval()),
        };
        let mut out = Vec::new();
        for i in idx {
            let s = &inner.stores[i];
            for l in s.lvs.list() {
                out.push(LvolInfo {
                    alias: l.alias.clone(),
                    uuid: l.uuid.to_string(),
                    name: l.name.clone(),
                    is_thin_provisioned: l.thin,
                    is_snapshot: l.snapshot,
                    is_clone: l.clone,
                    is_esnap_clone: false,
                    is_degraded: false,
                    num_allocated_clusters: l.num_allocated_clusters,
                    lvs: LvsRef {
                        name: l.lvs_name.clone(),
                        uuid: l.lvs_uuid.to_string(),
                    },
                    extra: Default::default(),
                });
            }
        }
        Ok(out)
    }

    pub(super) fn lvol_of(inner: &Inner, name: &str) -> Result<(usize, Uuid), SpdkError> {
        match inner.find(name) {
            Some(Found::Lvol { store, uuid, .. }) => Ok((store, uuid)),
            _ => Err(SpdkError::no_such_device()),
        }
    }

    /// `bdev_lvol_delete`: refused while a controller serves the lvol.
    pub fn delete_lvol(&self, name: &str) -> Result<bool, SpdkError> {
        let mut inner = self.lock()?;
        let (i, uuid) = Self::lvol_of(&inner, name)?;
        if let Some(c) = inner.users_of(&uuid.to_string()).first() {
            return Err(in_use(&format!("lvol {name}"), &format!("controller {c}")));
        }
        inner.stores[i]
            .lvs
            .delete(&uuid.to_string())
            .map_err(lvol_err)?;
        inner.forget_qos(&uuid.to_string());
        info!(lvol = %name, "lvol deleted");
        Ok(true)
    }

    /// `bdev_lvol_resize`: the guests of controllers serving it are told the new capacity.
    pub fn resize_lvol(&self, p: &BdevLvolResizeParams) -> Result<bool, SpdkError> {
        let inner = self.lock()?;
        let (i, uuid) = Self::lvol_of(&inner, &p.name)?;
        let size = p
            .size_in_mib
            .checked_mul(MIB)
            .ok_or_else(|| SpdkError::invalid_params("No space left on device"))?;
        inner.stores[i]
            .lvs
            .resize(&uuid.to_string(), size)
            .map_err(lvol_err)?;
        for c in inner.ctrlrs.values().filter(|c| c.bdev == uuid.to_string()) {
            let told = c.handle.notify_config_change();
            info!(ctrlr = %c.name, told, "capacity change sent to the frontend");
        }
        info!(lvol = %p.name, size, "lvol resized");
        Ok(true)
    }

    /// `bdev_lvol_rename`.
    pub fn rename_lvol(&self, p: &RenameParams) -> Result<bool, SpdkError> {
        let inner = self.lock()?;
        valid_name("lvol", &p.new_name)?;
        let (i, uuid) = Self::lvol_of(&inner, &p.old_name)?;
        inner.stores[i]
            .lvs
            .rename(&uuid.to_string(), &p.new_name)
            .map_err(lvol_err)?;
        Ok(true)
    }

    /// `bdev_lvol_snapshot`.
    pub fn snapshot(&self, p: &BdevLvolSnapshotParams) -> Result<String, SpdkError> {
        let inner = self.lock()?;
        valid_name("snapshot", &p.snapshot_name)?;
        let (i, uuid) = Self::lvol_of(&inner, &p.lvol_name)?;
        let snap = inner.stores[i]
            .lvs
            .snapshot(&uuid.to_string(), &p.snapshot_name)
            .map_err(lvol_err)?;
        info!(lvol = %p.lvol_name, snapshot = %snap.alias(), "snapshot created");
        Ok(snap.uuid().to_string())
    }

    /// `bdev_lvol_clone`.
    pub fn clone_lvol(&self, p: &BdevLvolCloneParams) -> Result<String, SpdkError> {
        let inner = self.lock()?;
        valid_name("clone", &p.clone_name)?;
        let (i, uuid) = Self::lvol_of(&inner, &p.snapshot_name)?;
        let c = inner.stores[i]
            .lvs
            .clone_lvol(&uuid.to_string(), &p.clone_name)
            .map_err(lvol_err)?;
        info!(snapshot = %p.snapshot_name, clone = %c.alias(), "clone created");
        Ok(c.uuid().to_string())
    }

    /// `bdev_lvol_inflate`, `bdev_lvol_decouple_parent`, `bdev_lvol_set_read_only`.
    pub fn lvol_op(&self, name: &str, op: LvolOp) -> Result<bool, SpdkError> {
        let inner = self.lock()?;
        let (i, uuid) = Self::lvol_of(&inner, name)?;
        let lvs = &inner.stores[i].lvs;
        let key = uuid.to_string();
        match op {
            LvolOp::Inflate => lvs.inflate(&key),
            LvolOp::DecoupleParent => lvs.decouple_parent(&key),
            LvolOp::SetReadOnly => lvs.set_read_only(&key),
        }
        .map_err(lvol_err)?;
        info!(lvol = %name, ?op, "lvol updated");
        Ok(true)
    }
}
