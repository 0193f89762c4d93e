//! The vhost-user protocol side of a device: the message handler that negotiates features, maps
//! guest memory, sets up virtqueues and hands them to the queue workers.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use tracing::{debug, info, warn};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    Backend, Error as VuError, GpuBackend, Result as VuResult, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::config::{self, BlkOptions, CONFIG_SPACE_LEN, MAX_MEM_SLOTS};
use crate::fdcheck::check_mappable;
use crate::inflight::InflightRegion;
use crate::queue::{Cmd, DeviceShared, MemTable, VringCtx, WorkerHandle};
use crate::{Error, GuestMem};
use katablk_bdev::sigbus::{self, Protection};

/// A guest memory region registered with the SIGBUS handler, kept registered until the region
/// is unmapped (requests in flight may hold it after it left the memory table).
struct Protected {
    region: Weak<GuestRegionMmap<()>>,
    _protection: Protection,
}

#[derive(Debug, Clone, Copy)]
struct Mapping {
    user_addr: u64,
    size: u64,
    gpa: u64,
}

#[derive(Default)]
struct Vring {
    size: u16,
    desc: Option<u64>,
    avail: Option<u64>,
    used: Option<u64>,
    base: u16,
    kick: Option<File>,
    call: Option<File>,
    enabled: bool,
    running: bool,
    /// A queue paused by `SET_VRING_ENABLE 0`, resumed as it was.
    paused: Option<Box<VringCtx>>,
}

/// The vhost-user-blk message handler of one device (one frontend at a time).
pub struct BlkBackend {
    shared: Arc<DeviceShared>,
    opts: BlkOptions,
    mem: MemTable,
    mappings: Vec<Mapping>,
    owned: bool,
    acked_features: u64,
    acked_protocol: u64,
    vrings: Vec<Vring>,
    workers: Vec<WorkerHandle>,
    queue_worker: Vec<usize>,
    inflight: Option<Arc<InflightRegion>>,
    /// Host ranges of guest memory announced to the device with `register_memory`.
    registered: Vec<(usize, usize)>,
    /// Guest memory mappings registered with the SIGBUS handler.
    protected: Vec<Protected>,
    /// Set when the frontend sent a memory file that does not back what it asked to map: the
    /// server drops such a frontend after the refusal (and the error reply, if it asked for
    /// one).
    fatal: Option<String>,
}

fn err(e: impl std::fmt::Display) -> VuError {
    VuError::ReqHandlerError(std::io::Error::other(e.to_string()))
}

fn eventfd_from(file: File) -> EventFd {
    // SAFETY: the descriptor was received from the frontend as an eventfd and is owned solely by
    // `file`, whose ownership moves into the EventFd.
    unsafe { EventFd::from_raw_fd(file.into_raw_fd()) }
}

impl BlkBackend {
    pub(crate) fn new(shared: Arc<DeviceShared>, opts: BlkOptions) -> Result<Self, Error> {
        let mapping = opts.validate()?;
        if !sigbus::install() {
            warn!("no SIGBUS handler: a frontend shrinking its memory would kill the process");
        }
        let mem = MemTable::new(GuestMem::new());
        let mut queue_worker = vec![0usize; usize::from(opts.num_queues)];
        let mut workers = Vec::new();
        for (t, mask) in mapping.iter().enumerate() {
            for (q, w) in queue_worker.iter_mut().enumerate() {
                if mask & (1u64 << q) != 0 {
                    *w = t;
                }
            }
            let cpu = (!opts.cpus.is_empty()).then(|| opts.cpus[t % opts.cpus.len()]);
            workers.push(WorkerHandle::spawn(
                t,
                shared.clone(),
                mem.clone(),
                cpu,
                opts.runtime.as_ref(),
            )?);
        }
        Ok(BlkBackend {
            vrings: (0..opts.num_queues).map(|_| Vring::default()).collect(),
            shared,
            opts,
            mem,
            mappings: Vec::new(),
            owned: false,
            acked_features: 0,
            acked_protocol: 0,
            workers,
            queue_worker,
            inflight: None,
            registered: Vec::new(),
            protected: Vec::new(),
            fatal: None,
        })
    }

    /// Forgets the SIGBUS registrations of guest memory regions that are unmapped by now
    /// (the queue workers drop their last references to a replaced table asynchronously).
    pub(crate) fn prune_protected(&mut self) {
        self.protected.retain(|p| p.region.strong_count() > 0);
    }

    /// Why the frontend must be dropped, if it sent a memory file that was refused.
    pub(crate) fn take_fatal(&mut self) -> Option<String> {
        self.fatal.take()
    }

    /// Records a refused memory file (the frontend is dropped after the reply) and turns the
    /// refusal into the protocol error answered to it (and logged by the server).
    fn refuse(&mut self, e: Error) -> VuError {
        self.fatal = Some(e.to_string());
        err(e)
    }

    /// Checks the file of memory region `r` (`what` names it), maps it and registers the mapping
    /// with the SIGBUS handler; the registration is pushed to `protected`.
    fn map_region(
        &mut self,
        what: String,
        r: &VhostUserMemoryRegion,
        file: File,
        protected: &mut Vec<Protected>,
    ) -> VuResult<Arc<GuestRegionMmap<()>>> {
        // Copies: the message struct is packed.
        let (gpa, size, offset) = (r.guest_phys_addr, r.memory_size, r.mmap_offset);
        let what = format!("{what} (gpa {gpa:#x}, size {size:#x}, mmap_offset {offset:#x})");
        let checked = match check_mappable(&file, what, offset, size) {
            Ok(c) => c,
            Err(e) => return Err(self.refuse(e.into())),
        };
        let region = Arc::new(
            GuestRegionMmap::new(r.mmap_region(file)?, GuestAddress(gpa))
                .ok_or_else(|| err("memory region overflows the address space"))?,
        );
        if let Some(p) = sigbus::protect(
            region.as_ptr(),
            region.len() as usize,
            checked.block_size,
            &self.shared.poison,
        ) {
            protected.push(Protected {
                region: Arc::downgrade(&region),
                _protection: p,
            });
        }
        Ok(region)
    }

    fn vring(&mut self, index: u32) -> VuResult<&mut Vring> {
        self.vrings
            .get_mut(index as usize)
            .ok_or(VuError::InvalidParam)
    }

    fn va_to_gpa(&self, va: u64) -> VuResult<u64> {
        self.mappings
            .iter()
            .find(|m| va >= m.user_addr && va - m.user_addr < m.size)
            .map(|m| va - m.user_addr + m.gpa)
            .ok_or_else(|| err(format!("vring address {va:#x} is not in guest memory")))
    }

    /// Tells the device which host ranges hold guest memory now (see
    /// [`katablk_bdev::BlockDevice::register_memory`]): ranges that went away are unregistered,
    /// new ones registered.
    fn sync_registration(&mut self) {
        let now: Vec<(usize, usize)> = {
            let mem = self.mem.memory();
            mem.iter()
                .map(|r| (r.as_ptr() as usize, r.len() as usize))
                .collect()
        };
        let dev = &self.shared.dev;
        for &(a, l) in self.registered.iter().filter(|r| !now.contains(r)) {
            dev.unregister_memory(a as *mut u8, l);
        }
        for &(a, l) in now.iter().filter(|r| !self.registered.contains(r)) {
            dev.register_memory(a as *mut u8, l);
        }
        self.registered = now;
        // Mappings that are gone leave the SIGBUS registry.
        self.prune_protected();
    }

    fn protocol_negotiated(&self) -> bool {
        self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
    }

    /// Starts queue `index` if it is fully set up and enabled.
    fn maybe_start(&mut self, index: usize) -> VuResult<()> {
        let event_idx = self.acked_features & (1u64 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let inflight = self.inflight.clone();
        let worker = self.queue_worker[index];
        let mem = self.mem.memory();
        if !self.owned {
            // The protocol's first message is SET_OWNER: no queue runs before it (queues set
            // up earlier start when it comes).
            debug!(
                queue = index,
                "vring ready before SET_OWNER: not started yet"
            );
            return Ok(());
        }
        let v = &mut self.vrings[index];
        if v.running || !v.enabled || v.kick.is_none() {
            return Ok(());
        }
        if let Some(mut ctx) = v.paused.take() {
            if let Some(k) = v.kick.as_ref().and_then(|k| k.try_clone().ok()) {
                ctx.kick = eventfd_from(k);
            }
            ctx.call = v
                .call
                .as_ref()
                .and_then(|c| c.try_clone().ok())
                .map(eventfd_from);
            v.running = true;
            self.workers[worker].send(Cmd::Start(ctx));
            return Ok(());
        }
        let (Some(desc), Some(avail), Some(used)) = (v.desc, v.avail, v.used) else {
            return Ok(());
        };
        let size = if v.size == 0 {
            self.opts.queue_size
        } else {
            v.size
        };
        let mut q = Queue::new(self.opts.queue_size).map_err(err)?;
        q.try_set_size(size).map_err(err)?;
        q.try_set_desc_table_address(GuestAddress(desc))
            .map_err(err)?;
        q.try_set_avail_ring_address(GuestAddress(avail))
            .map_err(err)?;
        q.try_set_used_ring_address(GuestAddress(used))
            .map_err(err)?;
        q.set_event_idx(event_idx);
        q.set_ready(true);
        if !q.is_valid(&*mem) {
            return Err(err(format!("queue {index} rings are not in guest memory")));
        }
        let used_idx = q.used_idx(&*mem, Ordering::Acquire).map_err(err)?.0;
        q.set_next_used(used_idx);
        let mut resubmit = VecDeque::new();
        let mut counter = 0;
        let iq = inflight.as_ref().and_then(|r| r.queue(index as u16));
        if let Some(iq) = &iq {
            let (heads, max) = iq.recover(used_idx);
            counter = max;
            if !heads.is_empty() {
                info!(
                    queue = index,
                    count = heads.len(),
                    "resubmitting in-flight requests"
                );
            }
            q.set_next_avail(used_idx.wrapping_add(heads.len() as u16));
            resubmit.extend(heads);
        } else {
            q.set_next_avail(v.base);
        }
        let kick = v
            .kick
            .as_ref()
            .ok_or(VuError::InvalidParam)?
            .try_clone()
            .map_err(VuError::ReqHandlerError)?;
        let call = match &v.call {
            Some(c) => Some(eventfd_from(
                c.try_clone().map_err(VuError::ReqHandlerError)?,
            )),
            None => None,
        };
        let ctx = Box::new(VringCtx {
            index: index as u16,
            queue: q,
            kick: eventfd_from(kick),
            call,
            inflight: iq,
            resubmit,
            counter,
        });
        v.running = true;
        debug!(queue = index, size, event_idx, "starting queue");
        self.workers[worker].send(Cmd::Start(ctx));
        Ok(())
    }

    /// Stops queue `index`, waiting for its in-flight requests; returns the next avail index.
    fn stop(&mut self, index: usize, pause: bool) -> u16 {
        let worker = self.queue_worker[index];
        let v = &mut self.vrings[index];
        if !v.running {
            return v
                .paused
                .as_ref()
                .map(|c| c.queue.next_avail())
                .unwrap_or(v.base);
        }
        v.running = false;
        match self.workers[worker].stop(index as u16) {
            Some(ctx) => {
                let next = ctx.queue.next_avail();
                v.base = next;
                if pause {
                    v.paused = Some(ctx);
                }
                next
            }
            None => v.base,
        }
    }

    /// Stops every queue and forgets the frontend (on disconnect or reset).
    pub(crate) fn disconnect(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop(i, false);
        }
        self.vrings = (0..self.opts.num_queues)
            .map(|_| Vring::default())
            .collect();
        self.owned = false;
        self.acked_features = 0;
        self.acked_protocol = 0;
        self.inflight = None;
        self.mappings.clear();
        if let Err(e) = self.mem.replace(GuestMem::new()) {
            warn!("reset: {e}");
        }
        self.sync_registration();
        self.fatal = None;
    }

    fn config(&self) -> [u8; CONFIG_SPACE_LEN] {
        let mut o = self.opts.clone();
        o.read_only = self.shared.read_only;
        config::config_space(
            &self.shared.dev.info(),
            &o,
            self.shared.writeback.load(Ordering::Relaxed),
        )
    }
}

impl Drop for BlkBackend {
    fn drop(&mut self) {
        self.disconnect();
    }
}

/// How far into the device config a frontend may read (zeroes past [`CONFIG_SPACE_LEN`]).
const CONFIG_WINDOW: usize = 256;

/// The config offset of a GET_CONFIG / SET_CONFIG message, 0-based. Frontends count it two ways:
/// from 0, as the vhost-user spec says (QEMU, libblkio, SPDK's initiators), or from rust-vmm's
/// `VHOST_USER_CONFIG_OFFSET` (0x100, where the device config starts in a virtio-pci common
/// config window): Dragonball's vhost-user-blk frontend in Kata (`dbs_virtio_devices`) and
/// cloud-hypervisor before 2026 send 0x100 for the first byte. The virtio-blk config is 60 bytes
/// and the window 256, so an offset of 0x100 or more can only mean the second convention.
fn config_offset(offset: u32) -> usize {
    let off = offset as usize;
    let base = vhost::vhost_user::message::VHOST_USER_CONFIG_OFFSET as usize;
    if off >= base {
        off - base
    } else {
        off
    }
}

impl VhostUserBackendReqHandlerMut for BlkBackend {
    fn set_owner(&mut self) -> VuResult<()> {
        if self.owned {
            return Err(VuError::InvalidOperation("already owned"));
        }
        self.owned = true;
        for i in 0..self.vrings.len() {
            self.maybe_start(i)?;
        }
        Ok(())
    }

    fn reset_owner(&mut self) -> VuResult<()> {
        self.disconnect();
        Ok(())
    }

    fn reset_device(&mut self) -> VuResult<()> {
        for i in 0..self.vrings.len() {
            self.stop(i, false);
            let v = &mut self.vrings[i];
            v.enabled = false;
            v.base = 0;
            v.paused = None;
        }
        self.acked_features = 0;
        Ok(())
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(config::virtio_features(self.shared.read_only))
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !config::virtio_features(self.shared.read_only) != 0 {
            return Err(VuError::InvalidParam);
        }
        self.acked_features = features;
        if !self.protocol_negotiated() {
            // Without VHOST_USER_F_PROTOCOL_FEATURES rings are enabled from the start.
            for i in 0..self.vrings.len() {
                self.vrings[i].enabled = true;
                self.maybe_start(i)?;
            }
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy_listening: Option<bool>,
    ) -> VuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy_listening.is_some() {
            return Err(VuError::InvalidOperation("postcopy not supported"));
        }
        let mut regions = Vec::with_capacity(ctx.len());
        let mut mappings = Vec::with_capacity(ctx.len());
        let mut protected = Vec::with_capacity(ctx.len());
        // On any refusal the regions mapped so far are dropped (unmapped) with their
        // registrations, and the previous table stays in place.
        for (i, (r, f)) in ctx.iter().zip(files).enumerate() {
            regions.push(self.map_region(format!("memory region {i}"), r, f, &mut protected)?);
            mappings.push(Mapping {
                user_addr: r.user_addr,
                size: r.memory_size,
                gpa: r.guest_phys_addr,
            });
        }
        let mem = GuestMem::from_arc_regions(regions).map_err(err)?;
        self.mem.replace(mem).map_err(err)?;
        self.mappings = mappings;
        self.protected.extend(protected);
        self.sync_registration();
        debug!(regions = ctx.len(), "memory table set");
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        let max = self.opts.queue_size;
        let v = self.vring(index)?;
        if num == 0 || num > u32::from(max) || !num.is_power_of_two() {
            warn!(index, num, max, "refusing queue size");
            return Err(VuError::InvalidParam);
        }
        v.size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VuResult<()> {
        let d = self.va_to_gpa(descriptor)?;
        let u = self.va_to_gpa(used)?;
        let a = self.va_to_gpa(available)?;
        let v = self.vring(index)?;
        v.desc = Some(d);
        v.used = Some(u);
        v.avail = Some(a);
        v.paused = None;
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        let v = self.vring(index)?;
        v.base = base as u16;
        v.paused = None;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        self.vring(index)?;
        let next = self.stop(index as usize, false);
        let negotiated = self.protocol_negotiated();
        let v = &mut self.vrings[index as usize];
        v.kick = None;
        v.call = None;
        if negotiated {
            v.enabled = false;
        }
        Ok(VhostUserVringState::new(index, u32::from(next)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let running = self.vring(u32::from(index))?.running;
        if running {
            // A new kick fd for a running ring: restart it with the new descriptor.
            self.stop(usize::from(index), true);
        }
        self.vrings[usize::from(index)].kick = fd;
        if !self.protocol_negotiated() {
            self.vrings[usize::from(index)].enabled = true;
        }
        self.maybe_start(usize::from(index))
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let worker = *self
            .queue_worker
            .get(usize::from(index))
            .ok_or(VuError::InvalidParam)?;
        let v = self.vring(u32::from(index))?;
        if v.running {
            let call = match &fd {
                Some(f) => Some(eventfd_from(
                    f.try_clone().map_err(VuError::ReqHandlerError)?,
                )),
                None => None,
            };
            v.call = fd;
            self.workers[worker].send(Cmd::SetCall {
                index: u16::from(index),
                call,
            });
        } else {
            v.call = fd;
        }
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> VuResult<()> {
        self.vring(u32::from(index))?;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(config::protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        if features & !config::protocol_features().bits() != 0 {
            return Err(VuError::InvalidParam);
        }
        self.acked_protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(u64::from(self.opts.num_queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        if !self.protocol_negotiated() {
            return Err(VuError::InvalidOperation(
                "protocol features not negotiated",
            ));
        }
        let v = self.vring(index)?;
        if v.enabled == enable {
            return Ok(());
        }
        v.enabled = enable;
        if enable {
            self.maybe_start(index as usize)
        } else {
            self.stop(index as usize, true);
            Ok(())
        }
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VuResult<Vec<u8>> {
        let cfg = self.config();
        let (off, size) = (config_offset(offset), size as usize);
        if off.checked_add(size).is_none_or(|e| e > CONFIG_WINDOW) {
            return Err(VuError::InvalidParam);
        }
        let mut out = vec![0u8; size];
        for (i, b) in out.iter_mut().enumerate() {
            *b = cfg.get(off + i).copied().unwrap_or(0);
        }
        Ok(out)
    }

    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VuResult<()> {
        // Only the writeback byte (offset 32) is writable.
        const WCE: usize = 32;
        let off = config_offset(offset);
        if off <= WCE && off + buf.len() > WCE {
            let wb = buf[WCE - off] != 0;
            self.shared.writeback.store(wb, Ordering::Relaxed);
            info!(writeback = wb, "write cache mode changed by the guest");
            Ok(())
        } else {
            Err(VuError::InvalidParam)
        }
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VuResult<()> {
        Err(VuError::InvalidOperation("not a gpu device"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        Err(VuError::InvalidOperation("no shared objects"))
    }

    fn get_inflight_fd(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> VuResult<(VhostUserInflight, File)> {
        if inflight.num_queues == 0
            || inflight.num_queues > self.opts.num_queues
            || inflight.queue_size == 0
            || inflight.queue_size > self.opts.queue_size
        {
            return Err(VuError::InvalidParam);
        }
        let region = InflightRegion::create_protected(
            inflight.num_queues,
            inflight.queue_size,
            Some(&self.shared.poison),
        )
        .map_err(err)?;
        let file = region
            .file()
            .try_clone()
            .map_err(VuError::ReqHandlerError)?;
        let reply =
            VhostUserInflight::new(region.size(), 0, inflight.num_queues, inflight.queue_size);
        self.inflight = Some(Arc::new(region));
        Ok((reply, file))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VuResult<()> {
        let region = match InflightRegion::open_protected(
            file,
            inflight.mmap_offset,
            inflight.mmap_size,
            inflight.num_queues,
            inflight.queue_size,
            Some(&self.shared.poison),
        ) {
            Ok(r) => r,
            Err(e @ Error::Fd(_)) => return Err(self.refuse(e)),
            Err(e) => return Err(err(e)),
        };
        self.inflight = Some(Arc::new(region));
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        Ok(MAX_MEM_SLOTS)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy_listening: Option<bool>,
    ) -> VuResult<Option<VhostUserMemoryRegionBase>> {
        if postcopy_listening.is_some() {
            return Err(VuError::InvalidOperation("postcopy not supported"));
        }
        if self.mappings.len() as u64 >= MAX_MEM_SLOTS {
            return Err(VuError::InvalidParam);
        }
        let mut protected = Vec::with_capacity(1);
        let slot = self.mappings.len();
        let r = self.map_region(format!("memory slot {slot}"), region, fd, &mut protected)?;
        let mem = self.mem.memory().insert_region(r).map_err(err)?;
        self.mem.replace(mem).map_err(err)?;
        self.protected.extend(protected);
        self.mappings.push(Mapping {
            user_addr: region.user_addr,
            size: region.memory_size,
            gpa: region.guest_phys_addr,
        });
        self.sync_registration();
        let (gpa, size) = (region.guest_phys_addr, region.memory_size);
        debug!(gpa, size, "memory region added");
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        let (mem, _) = self
            .mem
            .memory()
            .remove_region(GuestAddress(region.guest_phys_addr), region.memory_size)
            .map_err(err)?;
        // Requests in flight keep their own snapshot of the old table, so the removed region
        // stays mapped until they complete.
        self.mem.replace(mem).map_err(err)?;
        self.mappings.retain(|m| m.gpa != region.guest_phys_addr);
        self.sync_registration();
        let gpa = region.guest_phys_addr;
        debug!(gpa, "memory region removed");
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        Err(VuError::InvalidOperation(
            "device state transfer not supported",
        ))
    }

    fn check_device_state(&mut self) -> VuResult<()> {
        Err(VuError::InvalidOperation(
            "device state transfer not supported",
        ))
    }

    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        Err(VuError::InvalidOperation("no shared memory regions"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VuResult<()> {
        Err(VuError::InvalidOperation("dirty logging not supported"))
    }
}
