//! Base bdevs (aio, malloc, null): creation, deletion, listing and I/O counters.

use std::collections::BTreeMap;
use std::sync::Arc;

use katablk_bdev::file::{FileDevice, FileOptions};
use katablk_bdev::malloc::MallocDevice;
use katablk_bdev::null::NullDevice;
use katablk_bdev::qos::QosStats;
use katablk_bdev::BlockDevice;
use katablk_lvol::LvStore;
use katablk_rpc::methods::*;
use katablk_rpc::SpdkError;
use katablk_vhost::StatsSnapshot;
use tracing::{info, warn};
use uuid::Uuid;

use crate::bdevs::{
    check_aio_backing, check_malloc_fits, lvol_bdev_info, ram_bytes, BaseBdev, BaseKind,
};
use crate::error::{einval, in_use, lvol_err};
use crate::names::valid_name;

use super::lvol::{examine, parse_uuid_opt};
use super::{Found, Inner, Store, Target};

impl Target {
    /// Adds a base bdev and the lvstore found on it, then retries unrestored controllers.
    pub(super) fn add_base(&self, inner: &mut Inner, b: BaseBdev, lvs: Option<LvStore>) -> String {
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

    pub(super) fn check_new_bdev_name(inner: &Inner, name: &str) -> Result<(), SpdkError> {
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
    pub(super) fn ram_create(
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

    pub(super) fn get_bdevs_unlimited(
        &self,
        name: Option<&str>,
    ) -> Result<Vec<BdevInfo>, SpdkError> {
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
}
