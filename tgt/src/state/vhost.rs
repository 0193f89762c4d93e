//! vhost-user-blk controllers: creation, deletion, listing, coalescing, counters.

use std::sync::Arc;

use katablk_bdev::BlockDevice;
use katablk_rpc::methods::*;
use katablk_rpc::SpdkError;
use katablk_vhost::{BlkOptions, StatsSnapshot, VhostBlkServer};
use tracing::{info, warn};

use crate::cpumask::CpuMask;
use crate::error::{einval, in_use, vhost_no_device};
use crate::names::valid_name;

use super::{Controller, Found, Inner, Target};

impl Target {
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

    pub(super) fn create_controller_locked(
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

    /// Per-controller I/O counters.
    pub fn controller_stats(&self) -> Result<Vec<(String, String, StatsSnapshot)>, SpdkError> {
        let inner = self.lock()?;
        Ok(inner
            .ctrlrs
            .values()
            .map(|c| (c.name.clone(), c.bdev.clone(), c.handle.stats()))
            .collect())
    }
}
