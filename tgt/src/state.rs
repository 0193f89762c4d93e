//! The target's state: base bdevs, lvstores with their lvols, and vhost-user-blk controllers.
//!
//! Every operation takes the one state lock, like SPDK's single RPC thread, and either
//! completes or leaves nothing behind. Operations are synchronous (lvstore metadata I/O); the
//! RPC layer runs them on blocking threads. Opening a file is never done under the lock: an
//! open can block (a FIFO, a slow device), and everything else would wait with it.
//!
//! Saved configuration entries that cannot be restored at start (a disk image missing at
//! boot, say) are kept as *unrestored*: they stay in the configuration that is saved after
//! every change, are listed by `katablk_get_unrestored`, and are retried at the next start,
//! periodically (`--restore-retry`), and when the same bdev is created again (same name and
//! file). A restored bdev brings back its lvstore and then the unrestored controllers on it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use katablk_bdev::file::{FileDevice, FileOptions};
use katablk_bdev::malloc::MallocDevice;
use katablk_bdev::null::NullDevice;
use katablk_bdev::qos::{Limiter, QosLimits, QosStats};
use katablk_bdev::BlockDevice;
use katablk_lvol::{ClearMethod, LvStore, LvolOptions, LvsOptions};
use katablk_rpc::methods::*;
use katablk_rpc::SpdkError;
use katablk_vhost::{BlkOptions, ServerHandle, StatsSnapshot, VhostBlkServer};
use tracing::{info, warn};
use uuid::Uuid;

use crate::bdevs::{
    check_aio_backing, check_malloc_fits, lvol_bdev_info, ram_bytes, BaseBdev, BaseKind,
};
use crate::cpumask::CpuMask;
use crate::error::{einval, in_use, lvol_err, vhost_no_device};
use crate::names::valid_name;

mod unrestored;

const MIB: u64 = 1 << 20;

/// Static settings of a target.
#[derive(Debug, Clone)]
pub struct TargetSettings {
    /// Directory where controller sockets are created (SPDK's `-S`).
    pub socket_dir: PathBuf,
    /// CPUs the target may use (SPDK's `-m`); controller cpumasks must be inside it.
    pub cpumask: CpuMask,
    /// Permission bits of controller sockets.
    pub socket_mode: u32,
    /// Largest number of virtqueues a controller offers.
    pub max_queues: u16,
    /// Busy-poll window of the queue workers.
    pub poll_us: u32,
}

struct Store {
    lvs: Arc<LvStore>,
    base: String,
}

struct Controller {
    name: String,
    /// The bdev as the controller names it (an lvol's UUID or a base bdev name).
    bdev: String,
    readonly: bool,
    cpumask: CpuMask,
    socket: PathBuf,
    delay_base_us: u32,
    iops_threshold: u32,
    handle: ServerHandle,
}

#[derive(Default)]
struct Inner {
    bdevs: BTreeMap<String, BaseBdev>,
    stores: Vec<Store>,
    ctrlrs: BTreeMap<String, Controller>,
    /// Saved entries not restored (yet), in the order they were saved.
    unrestored: Vec<UnrestoredEntry>,
    /// Rate limits by bdev (its canonical name: base bdev name or lvol UUID), shared by every
    /// controller of the bdev; made on first use, limits set by `bdev_set_qos_limit`.
    qos: BTreeMap<String, Arc<Limiter>>,
    /// Rate limits shared by several bdevs (`katablk_set_qos_group`).
    qos_groups: BTreeMap<String, QosGroup>,
}

/// A limit shared by its member bdevs.
struct QosGroup {
    limiter: Arc<Limiter>,
    /// Members by canonical name.
    members: Vec<String>,
}

/// The limits of `old` with those a call gives replaced, checked as SPDK checks
/// `bdev_set_qos_limit`'s (at least one given; I/O limits in multiples of 1000).
fn merged_limits(
    old: QosLimits,
    ios: Option<u64>,
    rw_mib: Option<u64>,
    r_mib: Option<u64>,
    w_mib: Option<u64>,
) -> Result<QosLimits, SpdkError> {
    if [ios, rw_mib, r_mib, w_mib].iter().all(Option::is_none) {
        return Err(SpdkError::invalid_params("No rate limits specified"));
    }
    if let Some(n) = ios.filter(|n| n % 1000 != 0) {
        return Err(einval(format!(
            "rw_ios_per_sec {n} is not a multiple of 1000"
        )));
    }
    let bytes = |v: Option<u64>, what: &str, old: u64| -> Result<u64, SpdkError> {
        match v {
            None => Ok(old),
            Some(m) => m
                .checked_mul(1 << 20)
                .ok_or_else(|| einval(format!("{what} {m} is too large"))),
        }
    };
    Ok(QosLimits {
        rw_ios_per_sec: ios.unwrap_or(old.rw_ios_per_sec),
        rw_bytes_per_sec: bytes(rw_mib, "rw_mbytes_per_sec", old.rw_bytes_per_sec)?,
        r_bytes_per_sec: bytes(r_mib, "r_mbytes_per_sec", old.r_bytes_per_sec)?,
        w_bytes_per_sec: bytes(w_mib, "w_mbytes_per_sec", old.w_bytes_per_sec)?,
    })
}

fn to_rate_limits(l: QosLimits) -> RateLimits {
    RateLimits {
        rw_ios_per_sec: l.rw_ios_per_sec,
        rw_mbytes_per_sec: l.rw_bytes_per_sec >> 20,
        r_mbytes_per_sec: l.r_bytes_per_sec >> 20,
        w_mbytes_per_sec: l.w_bytes_per_sec >> 20,
    }
}

/// A bdev found by name.
enum Found {
    Base(String),
    Lvol {
        store: usize,
        uuid: Uuid,
        dev: Arc<katablk_lvol::Lvol>,
    },
}

/// The embedded target.
pub struct Target {
    inner: Mutex<Inner>,
    settings: TargetSettings,
}

fn parse_uuid_opt(s: &Option<String>) -> Result<Option<Uuid>, SpdkError> {
    match s {
        Some(u) => Uuid::parse_str(u)
            .map(Some)
            .map_err(|_| einval(format!("bad uuid {u:?}"))),
        None => Ok(None),
    }
}

/// Examine: an lvstore on a new bdev is opened with all its lvols (SPDK's examine). Done
/// before the bdev is added, outside the lock for files.
fn examine(name: &str, dev: &Arc<dyn BlockDevice>) -> Option<LvStore> {
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

fn lvs_clear(m: Option<LvsClearMethod>) -> ClearMethod {
    match m {
        Some(LvsClearMethod::None) => ClearMethod::None,
        Some(LvsClearMethod::WriteZeroes) => ClearMethod::WriteZeroes,
        _ => ClearMethod::Unmap,
    }
}

impl Inner {
    fn find(&self, name: &str) -> Option<Found> {
        if self.bdevs.contains_key(name) {
            return Some(Found::Base(name.to_string()));
        }
        if let Some(b) = self.bdevs.values().find(|b| b.uuid.to_string() == name) {
            return Some(Found::Base(b.name.clone()));
        }
        if let Some((lvs, lvol)) = name.split_once('/') {
            let i = self
                .stores
                .iter()
                .position(|s| s.lvs.name() == lvs || s.lvs.uuid().to_string() == lvs)?;
            let dev = self.stores[i].lvs.lvol(lvol).ok()?;
            return Some(Found::Lvol {
                store: i,
                uuid: dev.uuid(),
                dev,
            });
        }
        if Uuid::parse_str(name).is_ok() {
            for (i, s) in self.stores.iter().enumerate() {
                if let Ok(dev) = s.lvs.lvol(name) {
                    if dev.uuid().to_string() == name {
                        return Some(Found::Lvol {
                            store: i,
                            uuid: dev.uuid(),
                            dev,
                        });
                    }
                }
            }
        }
        None
    }

    fn store_index(&self, key: LvstoreKey<'_>) -> Option<usize> {
        self.stores.iter().position(|s| match key {
            LvstoreKey::Uuid(u) => s.lvs.uuid().to_string() == u,
            LvstoreKey::Name(n) => s.lvs.name() == n,
        })
    }

    /// Controllers serving the lvol `uuid` or the base bdev `name`.
    fn users_of(&self, canonical: &str) -> Vec<String> {
        self.ctrlrs
            .values()
            .filter(|c| c.bdev == canonical)
            .map(|c| c.name.clone())
            .collect()
    }

    /// The name a controller uses for a found bdev.
    fn canonical(&self, f: &Found) -> String {
        match f {
            Found::Base(n) => n.clone(),
            Found::Lvol { uuid, .. } => uuid.to_string(),
        }
    }

    /// The limiter of bdev `canonical` (made, unlimited, if it has none).
    fn limiter(&mut self, canonical: &str) -> Arc<Limiter> {
        self.qos.entry(canonical.to_string()).or_default().clone()
    }

    /// `assigned_rate_limits` of bdev `canonical`, in SPDK's units.
    fn rate_limits(&self, canonical: &str) -> RateLimits {
        to_rate_limits(
            self.qos
                .get(canonical)
                .map(|l| l.limits())
                .unwrap_or_default(),
        )
    }

    /// Gives bdev `canonical`'s limiter the groups that list it.
    fn regroup(&mut self, canonical: &str) {
        let groups: Vec<Arc<Limiter>> = self
            .qos_groups
            .values()
            .filter(|g| g.members.iter().any(|m| m == canonical))
            .map(|g| g.limiter.clone())
            .collect();
        self.limiter(canonical).set_groups(groups);
    }

    /// Forgets a deleted bdev's limits and group memberships.
    fn forget_qos(&mut self, canonical: &str) {
        self.qos.remove(canonical);
        for g in self.qos_groups.values_mut() {
            g.members.retain(|m| m != canonical);
        }
    }

    fn store_in_use(&self, i: usize) -> Option<String> {
        let s = &self.stores[i];
        s.lvs.list().iter().find_map(|l| {
            self.users_of(&l.uuid.to_string())
                .first()
                .map(|c| format!("controller {c} (lvol {})", l.alias))
        })
    }
}

impl Target {
    /// A target with nothing configured.
    pub fn new(settings: TargetSettings) -> Self {
        Target {
            inner: Mutex::new(Inner::default()),
            settings,
        }
    }

    /// Settings the target was started with.
    pub fn settings(&self) -> &TargetSettings {
        &self.settings
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>, SpdkError> {
        self.inner
            .lock()
            .map_err(|_| SpdkError::internal("target state poisoned"))
    }

    /// Adds a base bdev and the lvstore found on it, then retries unrestored controllers.
    fn add_base(&self, inner: &mut Inner, b: BaseBdev, lvs: Option<LvStore>) -> String {
        let name = b.name.clone();
        if let Some(lvs) = lvs {
            if inner
                .stores
                .iter()
                .any(|s| s.lvs.name() == lvs.name() || s.lvs.uuid() == lvs.uuid())
            {
                warn!(bdev = %name, lvs = %lvs.name(), "lvstore with the same name or uuid already open; not loaded");
                lvs.close();
            } else {
                info!(bdev = %name, lvs = %lvs.name(), lvols = lvs.list().len(), "lvstore loaded");
                inner.stores.push(Store {
                    lvs: Arc::new(lvs),
                    base: name.clone(),
                });
            }
        }
        inner.bdevs.insert(name.clone(), b);
        if let Some(i) = inner
            .unrestored
            .iter()
            .position(|u| u.subsystem == "bdev" && u.name == name)
        {
            inner.unrestored.remove(i);
            info!(bdev = %name, "unrestored bdev is back");
        }
        self.retry_controllers(inner);
        name
    }

    fn check_new_bdev_name(inner: &Inner, name: &str) -> Result<(), SpdkError> {
        valid_name("bdev", name)?;
        if inner.find(name).is_some() {
            return Err(SpdkError::exists());
        }
        Ok(())
    }

    /// `bdev_aio_create`. The file is checked and opened, and its lvstore examined, without
    /// the state lock.
    pub fn aio_create(&self, p: &BdevAioCreateParams) -> Result<String, SpdkError> {
        valid_name("bdev", &p.name)?;
        let mut uuid = parse_uuid_opt(&p.uuid)?;
        let readonly = p.readonly.unwrap_or(false);
        if let Some(bs) = p.block_size {
            if !bs.is_power_of_two() || !(512..=4096).contains(&bs) {
                return Err(einval(format!("block_size {bs}")));
            }
        }
        {
            let inner = self.lock()?;
            Self::check_new_bdev_name(&inner, &p.name)?;
            let saved =
                Self::check_unrestored_name(&inner, &p.name, "bdev_aio_create", Some(&p.filename))?;
            uuid = uuid.or(saved);
        }
        check_aio_backing(&p.filename)?;
        let opts = FileOptions {
            read_only: readonly,
            block_size: p.block_size,
            ..Default::default()
        };
        let dev = FileDevice::open(&p.filename, &opts).map_err(|e| {
            let errno = match &e {
                katablk_bdev::BdevError::Open { source, .. } => source.raw_os_error(),
                _ => None,
            };
            SpdkError::new(-errno.unwrap_or(libc::EINVAL), e.to_string())
        })?;
        let dev: Arc<dyn BlockDevice> = Arc::new(dev);
        let lvs = examine(&p.name, &dev);
        let mut inner = self.lock()?;
        // Checked again: another call may have taken the name while the file was opened.
        let again = Self::check_new_bdev_name(&inner, &p.name).and_then(|()| {
            Self::check_unrestored_name(&inner, &p.name, "bdev_aio_create", Some(&p.filename))
        });
        if let Err(e) = again {
            drop(inner);
            if let Some(l) = lvs {
                l.close();
            }
            return Err(e);
        }
        info!(bdev = %p.name, file = %p.filename, "aio bdev created");
        Ok(self.add_base(
            &mut inner,
            BaseBdev {
                name: p.name.clone(),
                uuid: uuid.unwrap_or_else(Uuid::new_v4),
                kind: BaseKind::Aio {
                    filename: p.filename.clone(),
                    readonly,
                    block_size_override: p.block_size.is_some(),
                },
                dev,
            },
            lvs,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn ram_create(
        &self,
        name: Option<&str>,
        uuid: &Option<String>,
        num_blocks: u64,
        block_size: u32,
        kind: BaseKind,
        prefix: &str,
        method: &str,
    ) -> Result<String, SpdkError> {
        if num_blocks == 0 {
            return Err(einval("num_blocks must be positive"));
        }
        let bytes = ram_bytes(num_blocks, block_size)?;
        if kind == BaseKind::Malloc {
            check_malloc_fits(bytes)?;
        }
        let mut inner = self.lock()?;
        let name = match name {
            Some(n) => n.to_string(),
            None => (0..)
                .map(|i| format!("{prefix}{i}"))
                .find(|n| inner.find(n).is_none() && !inner.unrestored.iter().any(|u| &u.name == n))
                .unwrap_or_default(),
        };
        Self::check_new_bdev_name(&inner, &name)?;
        let saved = Self::check_unrestored_name(&inner, &name, method, None)?;
        let uuid = parse_uuid_opt(uuid)?.or(saved).unwrap_or_else(Uuid::new_v4);
        let dev: Arc<dyn BlockDevice> = match kind {
            BaseKind::Malloc => Arc::new(
                MallocDevice::new(num_blocks, block_size).map_err(|e| einval(e.to_string()))?,
            ),
            _ => Arc::new(
                NullDevice::new(num_blocks, block_size, true).map_err(|e| einval(e.to_string()))?,
            ),
        };
        info!(bdev = %name, num_blocks, block_size, "{prefix} bdev created");
        let lvs = examine(&name, &dev);
        Ok(self.add_base(
            &mut inner,
            BaseBdev {
                name,
                uuid,
                kind,
                dev,
            },
            lvs,
        ))
    }

    /// `bdev_malloc_create`: refused (`-12`) beyond the memory available.
    pub fn malloc_create(&self, p: &BdevMallocCreateParams) -> Result<String, SpdkError> {
        if p.md_size.unwrap_or(0) != 0 || p.dif_type.unwrap_or(0) != 0 {
            return Err(einval("metadata and DIF are not supported"));
        }
        self.ram_create(
            p.name.as_deref(),
            &p.uuid,
            p.num_blocks,
            p.block_size,
            BaseKind::Malloc,
            "Malloc",
            "bdev_malloc_create",
        )
    }

    /// `bdev_null_create`: refused (`-22`) if the byte size overflows.
    pub fn null_create(&self, p: &BdevNullCreateParams) -> Result<String, SpdkError> {
        self.ram_create(
            Some(&p.name),
            &p.uuid,
            p.num_blocks,
            p.block_size,
            BaseKind::Null,
            "Null",
            "bdev_null_create",
        )
    }

    /// `bdev_aio_delete`, `bdev_malloc_delete`, `bdev_null_delete`: refused while a controller or
    /// an lvstore uses the bdev (SPDK silently drops every lvol and leaves controllers dangling).
    pub fn base_delete(&self, name: &str, want: &str) -> Result<bool, SpdkError> {
        let mut inner = self.lock()?;
        if !inner.bdevs.contains_key(name) {
            let method = format!("bdev_{want}_create");
            if let Some(i) = inner
                .unrestored
                .iter()
                .position(|u| u.subsystem == "bdev" && u.name == name && u.method == method)
            {
                inner.unrestored.remove(i);
                info!(bdev = %name, "unrestored bdev deleted from the configuration");
                return Ok(true);
            }
        }
        let b = inner
            .bdevs
            .get(name)
            .ok_or_else(SpdkError::no_such_device)?;
        let kind_ok = matches!(
            (&b.kind, want),
            (BaseKind::Aio { .. }, "aio") | (BaseKind::Malloc, "malloc") | (BaseKind::Null, "null")
        );
        if !kind_ok {
            return Err(SpdkError::no_such_device());
        }
        if let Some(c) = inner.users_of(name).first() {
            return Err(in_use(&format!("bdev {name}"), &format!("controller {c}")));
        }
        if let Some(s) = inner.stores.iter().find(|s| s.base == name) {
            return Err(in_use(
                &format!("bdev {name}"),
                &format!("lvstore {}", s.lvs.name()),
            ));
        }
        inner.bdevs.remove(name);
        inner.forget_qos(name);
        info!(bdev = %name, "bdev deleted");
        Ok(true)
    }

    /// `bdev_get_bdevs`.
    pub fn get_bdevs(&self, name: Option<&str>) -> Result<Vec<BdevInfo>, SpdkError> {
        let mut v = self.get_bdevs_unlimited(name)?;
        let inner = self.lock()?;
        for b in &mut v {
            b.assigned_rate_limits = inner.rate_limits(&b.name);
        }
        Ok(v)
    }

    fn get_bdevs_unlimited(&self, name: Option<&str>) -> Result<Vec<BdevInfo>, SpdkError> {
        let inner = self.lock()?;
        let claimed_base = |n: &str| inner.stores.iter().any(|s| s.base == n);
        let lvol_entry = |store: usize, info: &katablk_lvol::LvolInfo| {
            let s = &inner.stores[store];
            let dev = s.lvs.lvol(&info.uuid.to_string()).ok();
            dev.map(|d| {
                let claimed = !inner.users_of(&info.uuid.to_string()).is_empty();
                lvol_bdev_info(info, &s.base, &*d, claimed)
            })
        };
        match name {
            Some(n) => match inner.find(n) {
                Some(Found::Base(b)) => Ok(inner
                    .bdevs
                    .get(&b)
                    .map(|b| vec![b.info(claimed_base(&b.name))])
                    .unwrap_or_default()),
                Some(Found::Lvol { store, dev, .. }) => {
                    let info = dev.properties().map_err(lvol_err)?;
                    Ok(lvol_entry(store, &info).into_iter().collect())
                }
                None => Err(SpdkError::no_such_device()),
            },
            None => {
                let mut out: Vec<BdevInfo> = inner
                    .bdevs
                    .values()
                    .map(|b| b.info(claimed_base(&b.name)))
                    .collect();
                for (i, s) in inner.stores.iter().enumerate() {
                    for l in s.lvs.list() {
                        out.extend(lvol_entry(i, &l));
                    }
                }
                Ok(out)
            }
        }
    }

    /// `bdev_set_qos_limit`, with SPDK's checks: at least one limit, I/O limits in multiples of
    /// 1000; an absent limit stays as it was, 0 removes one. The limits apply to every
    /// controller of the bdev at once, including ones already serving a guest.
    pub fn set_qos_limit(&self, p: &BdevSetQosLimitParams) -> Result<bool, SpdkError> {
        let mut inner = self.lock()?;
        let found = inner.find(&p.name).ok_or_else(SpdkError::no_such_device)?;
        let canonical = inner.canonical(&found);
        let l = inner.limiter(&canonical);
        let new = merged_limits(
            l.limits(),
            p.rw_ios_per_sec,
            p.rw_mbytes_per_sec,
            p.r_mbytes_per_sec,
            p.w_mbytes_per_sec,
        )?;
        l.set_limits(new);
        info!(bdev = %p.name, ?new, "rate limits set");
        Ok(true)
    }

    /// `katablk_set_qos_group`: a limit shared by several bdevs (katablk's extension).
    pub fn set_qos_group(&self, p: &KatablkSetQosGroupParams) -> Result<bool, SpdkError> {
        valid_name("QoS group", &p.name)?;
        let mut inner = self.lock()?;
        let members = match &p.bdevs {
            None => None,
            Some(names) => {
                let mut v = Vec::new();
                for n in names {
                    let f = inner.find(n).ok_or_else(SpdkError::no_such_device)?;
                    let c = inner.canonical(&f);
                    if !v.contains(&c) {
                        v.push(c);
                    }
                }
                Some(v)
            }
        };
        let old = inner
            .qos_groups
            .get(&p.name)
            .map(|g| g.limiter.limits())
            .unwrap_or_default();
        let no_limits = [
            p.rw_ios_per_sec,
            p.rw_mbytes_per_sec,
            p.r_mbytes_per_sec,
            p.w_mbytes_per_sec,
        ]
        .iter()
        .all(Option::is_none);
        // A membership change alone is a valid call here.
        let limits = if members.is_some() && no_limits {
            old
        } else {
            merged_limits(
                old,
                p.rw_ios_per_sec,
                p.rw_mbytes_per_sec,
                p.r_mbytes_per_sec,
                p.w_mbytes_per_sec,
            )?
        };
        let g = inner
            .qos_groups
            .entry(p.name.clone())
            .or_insert_with(|| QosGroup {
                limiter: Limiter::new(),
                members: Vec::new(),
            });
        g.limiter.set_limits(limits);
        let mut touched = g.members.clone();
        if let Some(m) = members {
            touched.extend(m.iter().cloned());
            g.members = m;
        }
        for c in touched {
            inner.regroup(&c);
        }
        info!(group = %p.name, ?limits, "QoS group set");
        Ok(true)
    }

    /// `katablk_delete_qos_group`: its members keep their own limits.
    pub fn delete_qos_group(&self, name: &str) -> Result<bool, SpdkError> {
        let mut inner = self.lock()?;
        let g = inner
            .qos_groups
            .remove(name)
            .ok_or_else(SpdkError::no_such_device)?;
        for c in g.members {
            inner.regroup(&c);
        }
        info!(group = %name, "QoS group deleted");
        Ok(true)
    }

    /// `katablk_get_qos_groups`.
    pub fn qos_groups(&self) -> Result<Vec<QosGroupInfo>, SpdkError> {
        let inner = self.lock()?;
        Ok(inner
            .qos_groups
            .iter()
            .map(|(name, g)| QosGroupInfo {
                name: name.clone(),
                assigned_rate_limits: to_rate_limits(g.limiter.limits()),
                bdevs: g.members.clone(),
            })
            .collect())
    }

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

    fn lvol_of(inner: &Inner, name: &str) -> Result<(usize, Uuid), SpdkError> {
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

    /// `vhost_create_blk_controller`. An unrestored controller of the same name is replaced
    /// once this one is created.
    pub fn create_controller(&self, p: &VhostCreateBlkControllerParams) -> Result<bool, SpdkError> {
        let mut inner = self.lock()?;
        self.create_controller_locked(&mut inner, p)?;
        if let Some(i) = inner
            .unrestored
            .iter()
            .position(|u| u.subsystem == "vhost_blk" && u.name == p.ctrlr)
        {
            inner.unrestored.remove(i);
        }
        Ok(true)
    }

    fn create_controller_locked(
        &self,
        inner: &mut Inner,
        p: &VhostCreateBlkControllerParams,
    ) -> Result<(), SpdkError> {
        valid_name("controller", &p.ctrlr)?;
        if inner.ctrlrs.contains_key(&p.ctrlr) {
            return Err(SpdkError::exists());
        }
        if p.packed_ring == Some(true) {
            return Err(einval("packed rings are not supported"));
        }
        if let Some(t) = &p.transport {
            if t != "vhost_user_blk" {
                return Err(einval(format!("transport {t:?}")));
            }
        }
        let cpumask = match &p.cpumask {
            Some(m) => {
                let m = CpuMask::parse(m).map_err(|e| einval(e.to_string()))?;
                if !m.is_subset_of(&self.settings.cpumask) {
                    return Err(einval(format!(
                        "cpumask {m} is not within the target's {}",
                        self.settings.cpumask
                    )));
                }
                m
            }
            // As SPDK: without a cpumask the controller may use every core of the target.
            None => self.settings.cpumask.clone(),
        };
        let found = inner.find(&p.dev_name).ok_or_else(vhost_no_device)?;
        let canonical = inner.canonical(&found);
        if let Some(c) = inner.users_of(&canonical).first() {
            return Err(in_use(
                &format!("bdev {}", p.dev_name),
                &format!("controller {c}"),
            ));
        }
        let (dev, base_ro): (Arc<dyn BlockDevice>, bool) = match &found {
            Found::Base(n) => {
                if inner.stores.iter().any(|s| &s.base == n) {
                    return Err(in_use(&format!("bdev {n}"), "an lvstore"));
                }
                let b = inner.bdevs.get(n).ok_or_else(vhost_no_device)?;
                (b.dev.clone(), false)
            }
            Found::Lvol { dev, .. } => {
                let ro = dev
                    .properties()
                    .map(|i| i.read_only || i.snapshot)
                    .unwrap_or(false);
                (dev.clone() as Arc<dyn BlockDevice>, ro)
            }
        };
        let readonly = p.readonly.unwrap_or(false) || base_ro;
        let socket = self.settings.socket_dir.join(&p.ctrlr);
        let nq = self.settings.max_queues.max(1);
        let threads = cpumask.cpus().len().clamp(1, usize::from(nq));
        let mut masks = vec![0u64; threads];
        for q in 0..usize::from(nq) {
            masks[q % threads] |= 1u64 << q;
        }
        let opts = BlkOptions {
            num_queues: nq,
            queue_size: 1024,
            read_only: readonly,
            serial: p.ctrlr.chars().take(20).collect(),
            poll_us: self.settings.poll_us,
            queue_threads: masks,
            writeback: true,
            cpus: cpumask.cpus().to_vec(),
            runtime: None,
            qos: Some(inner.limiter(&canonical)),
        };
        let server = VhostBlkServer::bind(&socket, dev, opts, Some(self.settings.socket_mode))
            .map_err(|e| einval(e.to_string()))?;
        let handle = server
            .spawn()
            .map_err(|e| SpdkError::internal(e.to_string()))?;
        info!(ctrlr = %p.ctrlr, bdev = %p.dev_name, socket = %socket.display(), readonly, "controller created");
        inner.ctrlrs.insert(
            p.ctrlr.clone(),
            Controller {
                name: p.ctrlr.clone(),
                bdev: canonical,
                readonly,
                cpumask,
                socket,
                delay_base_us: 0,
                iops_threshold: 60000,
                handle,
            },
        );
        Ok(())
    }

    /// `vhost_delete_controller`: refused with -16 while a frontend is connected (as SPDK); a
    /// frontend that is just disconnecting gets a second to go. In-flight requests finish and
    /// the socket is removed.
    pub fn delete_controller(&self, name: &str) -> Result<bool, SpdkError> {
        let t0 = std::time::Instant::now();
        let c = loop {
            let mut inner = self.lock()?;
            if !inner.ctrlrs.contains_key(name) {
                if let Some(i) = inner
                    .unrestored
                    .iter()
                    .position(|u| u.subsystem == "vhost_blk" && u.name == name)
                {
                    inner.unrestored.remove(i);
                    info!(ctrlr = %name, "unrestored controller deleted from the configuration");
                    return Ok(true);
                }
            }
            let c = inner.ctrlrs.get(name).ok_or_else(vhost_no_device)?;
            if !c.handle.is_connected() {
                break inner.ctrlrs.remove(name).ok_or_else(vhost_no_device)?;
            }
            drop(inner);
            if t0.elapsed() > std::time::Duration::from_secs(1) {
                return Err(SpdkError::new(
                    -libc::EBUSY,
                    format!("Device or resource busy: controller {name} has a connected frontend"),
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        if let Err(e) = c.handle.stop() {
            warn!(ctrlr = %name, "controller stopped with an error: {e}");
        }
        info!(ctrlr = %name, "controller deleted");
        Ok(true)
    }

    /// `vhost_get_controllers`.
    pub fn get_controllers(&self, name: Option<&str>) -> Result<Vec<VhostController>, SpdkError> {
        let inner = self.lock()?;
        let list: Vec<&Controller> = match name {
            Some(n) => vec![inner.ctrlrs.get(n).ok_or_else(vhost_no_device)?],
            None => inner.ctrlrs.values().collect(),
        };
        Ok(list
            .into_iter()
            .map(|c| VhostController {
                ctrlr: c.name.clone(),
                cpumask: c.cpumask.to_string(),
                delay_base_us: c.delay_base_us,
                iops_threshold: c.iops_threshold,
                socket: c.socket.display().to_string(),
                sessions: if c.handle.is_connected() {
                    vec![VhostSession {
                        vid: 0,
                        id: 0,
                        name: format!("{}s0", c.name),
                        started: true,
                        max_queues: u32::from(self.settings.max_queues),
                        inflight_task_cnt: 0,
                        extra: Default::default(),
                    }]
                } else {
                    Vec::new()
                },
                backend_specific: BackendSpecific {
                    block: Some(BlkBackend {
                        readonly: c.readonly,
                        bdev: Some(c.bdev.clone()),
                        transport: "vhost_user_blk".into(),
                    }),
                    extra: Default::default(),
                },
                extra: Default::default(),
            })
            .collect())
    }

    /// `vhost_controller_set_coalescing` (recorded and reported; interrupts are not delayed).
    pub fn set_coalescing(
        &self,
        p: &VhostControllerSetCoalescingParams,
    ) -> Result<bool, SpdkError> {
        let mut inner = self.lock()?;
        let c = inner.ctrlrs.get_mut(&p.ctrlr).ok_or_else(vhost_no_device)?;
        c.delay_base_us = p.delay_base_us;
        c.iops_threshold = p.iops_threshold;
        Ok(true)
    }

    /// Per-bdev I/O counters: each controller's counters are added to its bdev and, for lvols,
    /// to the lvstore's base bdev (I/O passes through both, as SPDK counts it).
    pub fn iostat(&self) -> Result<Vec<(String, StatsSnapshot)>, SpdkError> {
        let inner = self.lock()?;
        let mut per: BTreeMap<String, StatsSnapshot> = BTreeMap::new();
        for name in inner.bdevs.keys() {
            per.insert(name.clone(), StatsSnapshot::default());
        }
        // Each lvol's lvstore base bdev, listed once rather than per controller.
        let mut base_of: BTreeMap<String, &str> = BTreeMap::new();
        for s in &inner.stores {
            for l in s.lvs.list() {
                per.insert(l.uuid.to_string(), StatsSnapshot::default());
                base_of.insert(l.uuid.to_string(), &s.base);
            }
        }
        for c in inner.ctrlrs.values() {
            let st = c.handle.stats();
            let base = base_of.get(&c.bdev).copied();
            for k in std::iter::once(c.bdev.as_str()).chain(base) {
                if let Some(e) = per.get_mut(k) {
                    *e += st;
                }
            }
        }
        Ok(per.into_iter().collect())
    }

    /// Rate-limit counters of every bdev that has a limiter (a limit, a group or a controller).
    pub fn qos_stats(&self) -> Result<BTreeMap<String, QosStats>, SpdkError> {
        let inner = self.lock()?;
        Ok(inner
            .qos
            .iter()
            .map(|(k, l)| (k.clone(), l.stats()))
            .collect())
    }

    /// Per-controller I/O counters.
    pub fn controller_stats(&self) -> Result<Vec<(String, String, StatsSnapshot)>, SpdkError> {
        let inner = self.lock()?;
        Ok(inner
            .ctrlrs
            .values()
            .map(|c| (c.name.clone(), c.bdev.clone(), c.handle.stats()))
            .collect())
    }

    /// The configuration as SPDK's `framework_get_config` lists it, per subsystem.
    pub fn config(&self, subsystem: &str) -> Result<Vec<ConfigEntry>, SpdkError> {
        let inner = self.lock()?;
        let entry = |method: &str, params: serde_json::Value| ConfigEntry {
            method: method.to_string(),
            params: Some(params),
        };
        // Unrestored entries stay in the configuration, after the live ones.
        let unrestored = |sub: &'static str| {
            inner
                .unrestored
                .iter()
                .filter(move |u| u.subsystem == sub)
                .map(|u| ConfigEntry {
                    method: u.method.clone(),
                    params: u.params.clone(),
                })
        };
        match subsystem {
            "bdev" => {
                let mut v = Vec::new();
                for b in inner.bdevs.values() {
                    let i = b.dev.info();
                    v.push(match &b.kind {
                        BaseKind::Aio {
                            filename,
                            readonly,
                            block_size_override,
                        } => {
                            let mut p = serde_json::json!({
                                "name": b.name, "filename": filename, "readonly": readonly,
                                "uuid": b.uuid.to_string(),
                            });
                            if *block_size_override {
                                p["block_size"] = i.block_size.into();
                            }
                            entry("bdev_aio_create", p)
                        }
                        BaseKind::Malloc => entry(
                            "bdev_malloc_create",
                            serde_json::json!({"name": b.name, "num_blocks": i.num_blocks,
                                "block_size": i.block_size, "uuid": b.uuid.to_string()}),
                        ),
                        BaseKind::Null => entry(
                            "bdev_null_create",
                            serde_json::json!({"name": b.name, "num_blocks": i.num_blocks,
                                "block_size": i.block_size, "uuid": b.uuid.to_string()}),
                        ),
                    });
                }
                v.extend(unrestored("bdev"));
                v.push(ConfigEntry {
                    method: "bdev_wait_for_examine".into(),
                    params: None,
                });
                // After the examine: lvols exist by then (SPDK's save_config order too); groups
                // after the per-bdev limits.
                for name in inner.qos.keys() {
                    let l = inner.rate_limits(name);
                    if l != RateLimits::default() {
                        v.push(entry(
                            "bdev_set_qos_limit",
                            serde_json::json!({"name": name,
                                "rw_ios_per_sec": l.rw_ios_per_sec,
                                "rw_mbytes_per_sec": l.rw_mbytes_per_sec,
                                "r_mbytes_per_sec": l.r_mbytes_per_sec,
                                "w_mbytes_per_sec": l.w_mbytes_per_sec}),
                        ));
                    }
                }
                for (name, g) in &inner.qos_groups {
                    let l = to_rate_limits(g.limiter.limits());
                    v.push(entry(
                        "katablk_set_qos_group",
                        serde_json::json!({"name": name,
                            "rw_ios_per_sec": l.rw_ios_per_sec,
                            "rw_mbytes_per_sec": l.rw_mbytes_per_sec,
                            "r_mbytes_per_sec": l.r_mbytes_per_sec,
                            "w_mbytes_per_sec": l.w_mbytes_per_sec,
                            "bdevs": g.members}),
                    ));
                }
                Ok(v)
            }
            "vhost_blk" => Ok(inner
                .ctrlrs
                .values()
                .map(|c| {
                    entry(
                        "vhost_create_blk_controller",
                        serde_json::json!({"ctrlr": c.name, "dev_name": c.bdev,
                            "cpumask": c.cpumask.to_string(), "readonly": c.readonly,
                            "transport": "vhost_user_blk"}),
                    )
                })
                .chain(unrestored("vhost_blk"))
                .collect()),
            _ => Ok(Vec::new()),
        }
    }

    /// Stops every controller (in-flight requests finish) and closes every lvstore cleanly.
    pub fn shutdown(&self) {
        let (ctrlrs, stores) = match self.inner.lock() {
            Ok(mut i) => (std::mem::take(&mut i.ctrlrs), std::mem::take(&mut i.stores)),
            Err(_) => return,
        };
        for (name, c) in ctrlrs {
            if let Err(e) = c.handle.stop() {
                warn!(ctrlr = %name, "stop: {e}");
            }
        }
        for s in stores {
            s.lvs.close();
        }
    }

    /// Socket path a controller of this name gets.
    pub fn controller_socket(&self, name: &str) -> PathBuf {
        self.settings.socket_dir.join(name)
    }

    /// The controller socket directory.
    pub fn socket_dir(&self) -> &Path {
        &self.settings.socket_dir
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
