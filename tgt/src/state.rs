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
//!
//! The operations live beside the RPC families they serve (as `katablk_rpc::methods` groups
//! them): `bdev` (base bdevs, counters), `lvol` (lvstores, lvols), `qos` (limits, groups),
//! `vhost` (controllers), `config` (the saved configuration), `unrestored`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use katablk_bdev::qos::Limiter;
use katablk_lvol::LvStore;
use katablk_rpc::methods::*;
use katablk_rpc::SpdkError;
use katablk_vhost::ServerHandle;
use tracing::warn;
use uuid::Uuid;

use crate::bdevs::BaseBdev;
use crate::cpumask::CpuMask;

mod bdev;
mod config;
mod lvol;
mod qos;
mod unrestored;
mod vhost;

pub use lvol::LvolOp;

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
