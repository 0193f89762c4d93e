//! The CSI Node service: publishes an lvol to a Kata pod as a vhost-user-blk controller.
//!
//! Block volumes: controller `ctrlr-<hash>` with its socket at `<store>/block/sockets/<name>`
//! (the target runs with `-S <store>/block/sockets`), device node `<store>/block/devices/<name>`
//! (`b 241:<lowest free minor>`) bind-mounted onto the target path (a file). Kata finds the
//! socket by the device node's name.
//!
//! Filesystem volumes: the same controller; the volume is formatted through it if it has no
//! filesystem (see [`crate::format`]), and handed to Kata as a direct-assigned volume
//! (`mountInfo.json`) keyed by the target path, which is a directory the guest mounts the
//! filesystem on. The file is written for one Kata runtime ([`KataRuntime`], the StorageClass's
//! `kataRuntime` or `--kata-runtime`): the Go runtime gets `device` = the 241 device node
//! (created as for Block volumes), runtime-rs gets `spdkvol` with `device` = the socket, ext4
//! only, or with `rawBlock` the unformatted device.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use katablk_rpc::methods::{BdevInfo, VhostCreateBlkControllerParams};
use tonic::{Request, Response, Status};

use crate::class::{params, unsupported_capability};
use crate::csi::{self, node_service_capability as nsc, volume_capability as vc};
use crate::driver::{bdev_size, Driver};
use crate::error::{CsiError, Result};
use crate::kata::{self, KataRuntime};
use crate::kubelet_lock::{self, LockMode};
use crate::safe_path::{self, Kind};
use crate::state::Publication;
use crate::volume::{check_socket_path, require_id, validate_path, LvolId};

/// Node service.
#[derive(Debug, Clone)]
pub struct NodeService {
    d: Arc<Driver>,
}

fn bdev_matches(b: &BdevInfo, name: &str) -> bool {
    b.name == name || b.aliases.iter().any(|a| a == name)
}

/// Makes sure controller `ctrlr` exports `b` with the given read-only flag and its socket exists.
pub async fn ensure_controller(
    d: &Driver,
    id: &LvolId,
    b: &BdevInfo,
    ctrlr: &str,
    readonly: bool,
    cpumask: Option<&str>,
) -> Result<()> {
    let socket = d.store.socket_path(ctrlr);
    check_socket_path(&socket)?;
    let existing = match d.rpc.vhost_get_controllers(Some(ctrlr)).await {
        Ok(v) => v.into_iter().find(|c| c.ctrlr == ctrlr),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(CsiError::rpc("vhost_get_controllers")(e)),
    };
    let ok = existing.as_ref().is_some_and(|c| {
        c.backend_specific.block.as_ref().is_some_and(|k| {
            k.readonly == readonly && k.bdev.as_deref().is_some_and(|n| bdev_matches(b, n))
        })
    });
    if existing.is_some() && !ok {
        tracing::warn!(volume_id = %id, ctrlr, "controller exports something else; re-creating");
        delete_controller(d, ctrlr).await?;
    }
    if !ok {
        let p = VhostCreateBlkControllerParams {
            ctrlr: ctrlr.to_owned(),
            dev_name: id.alias(),
            cpumask: cpumask.map(str::to_owned),
            readonly: Some(readonly),
            packed_ring: None,
            transport: None,
        };
        match d.rpc.vhost_create_blk_controller(&p).await {
            Ok(_) => {}
            Err(e) if e.is_exists() => {}
            Err(e) => return Err(CsiError::rpc("vhost_create_blk_controller")(e)),
        }
        tracing::info!(volume_id = %id, ctrlr, readonly, socket = %socket.display(),
            "vhost-user-blk controller created");
    }
    let t0 = Instant::now();
    while !socket.exists() {
        if t0.elapsed() > Duration::from_secs(5) {
            return Err(CsiError::FailedPrecondition(format!(
                "controller {ctrlr} exists but its socket {} did not appear: run the target \
                 with -S {}",
                socket.display(),
                d.store.sockets_dir().display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// How long [`delete_controller`] lets a connected client (a VMM shutting down) go away.
const DISCONNECT_GRACE: Duration = Duration::from_secs(2);

/// Deletes controller `ctrlr`; absent is success. While a client is connected it is refused
/// with `FAILED_PRECONDITION` (the CO retries), on every target: katablk-target answers -EBUSY,
/// but SPDK's vhost app does not refuse — it re-queues the deletion until the client goes,
/// holding the RPC reply (our call times out), spinning its reactor with an error line each
/// try, and finally deletes whichever controller then has that name, possibly one a later
/// publish re-created. So the sessions are checked first, with a short grace.
pub async fn delete_controller(d: &Driver, ctrlr: &str) -> Result<()> {
    let t0 = Instant::now();
    loop {
        let c = match d.rpc.vhost_get_controllers(Some(ctrlr)).await {
            Ok(v) => v.into_iter().find(|c| c.ctrlr == ctrlr),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(CsiError::rpc("vhost_get_controllers")(e)),
        };
        let Some(c) = c else { return Ok(()) };
        if c.sessions.is_empty() {
            break;
        }
        if t0.elapsed() >= DISCONNECT_GRACE {
            return Err(CsiError::FailedPrecondition(format!(
                "controller {ctrlr} still has a connected client ({}); retry once the VM \
                 has let go of {}",
                c.sessions
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                c.socket
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match d.rpc.vhost_delete_controller(ctrlr).await {
        Ok(_) => Ok(()),
        Err(e) if e.is_not_found() => Ok(()),
        Err(e) => Err(CsiError::rpc("vhost_delete_controller")(e)),
    }
}

/// Bind-mounts the device node onto `target` (a file below `kubelet_dir`, walked without
/// following symlinks) unless already mounted.
pub fn publish_block_target(
    kubelet_dir: &Path,
    device: &Path,
    target: &Path,
    readonly: bool,
) -> Result<()> {
    let r = safe_path::resolve(kubelet_dir, target, true)?.ok_or_else(|| {
        CsiError::Internal(format!("target {} has no directory", target.display()))
    })?;
    if r.is_mount_point()? {
        return Ok(());
    }
    match r.kind()? {
        Kind::Dir => {
            // A directory from the CO: replace it by the file a block target must be.
            r.remove()?;
            r.create_file(0o640)?;
        }
        Kind::Absent => {
            r.create_file(0o640)?;
        }
        Kind::File => {}
        Kind::Symlink => {
            return Err(CsiError::InvalidArgument(format!(
                "target_path {} is a symlink; it is never followed",
                target.display()
            )))
        }
        Kind::Other => {
            return Err(CsiError::FailedPrecondition(format!(
                "target_path {} is a device, FIFO or socket, not a file",
                target.display()
            )))
        }
    }
    r.bind_from(device, readonly)
}

/// Unmounts and removes a target path below `kubelet_dir` (file or empty directory); absent is
/// success. A symlink there is removed itself: nothing is unmounted through it.
pub fn remove_target(kubelet_dir: &Path, target: &Path) -> Result<()> {
    let Some(r) = safe_path::resolve(kubelet_dir, target, false)? else {
        return Ok(());
    };
    if r.kind()? != Kind::Symlink {
        r.unmount_all()?;
    }
    r.remove()
}

impl NodeService {
    /// The service over a driver.
    pub fn new(d: Arc<Driver>) -> Self {
        Self { d }
    }

    fn target(&self, p: &str, what: &str) -> Result<PathBuf> {
        validate_path(p, &self.d.cfg.kubelet_dir, what)
    }

    /// A volume path of a stats/expand call: one outside the kubelet directory (or not
    /// absolute, or with `..`) cannot be a volume this driver published, so it is `NOT_FOUND`.
    fn existing_volume_path(&self, p: &str) -> Result<PathBuf> {
        let path = self
            .target(p, "volume_path")
            .map_err(|e| CsiError::NotFound(format!("no volume at volume_path: {e}")))?;
        // Walked without following links: a symlink names no volume of this driver.
        let kind = safe_path::resolve(&self.d.cfg.kubelet_dir, &path, false)
            .map_err(|e| CsiError::NotFound(format!("no volume at volume_path: {e}")))?
            .map_or(Ok(Kind::Absent), |r| r.kind())?;
        if matches!(kind, Kind::Absent | Kind::Symlink) {
            return Err(CsiError::NotFound(format!(
                "volume_path {} does not exist",
                path.display()
            )));
        }
        Ok(path)
    }

    async fn publish(&self, r: csi::NodePublishVolumeRequest) -> Result<()> {
        if r.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if r.target_path.is_empty() {
            return Err(CsiError::InvalidArgument("target_path is required".into()));
        }
        let cap = r
            .volume_capability
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?;
        if let Some(why) = unsupported_capability(cap) {
            return Err(CsiError::InvalidArgument(why));
        }
        let target = self.target(&r.target_path, "target_path")?;
        let id = require_id(&r.volume_id, "volume")?;
        // A symlink on the way is refused before anything is recorded or made.
        if let Some(res) = safe_path::resolve(&self.d.cfg.kubelet_dir, &target, false)? {
            if res.kind()? == Kind::Symlink {
                return Err(CsiError::InvalidArgument(format!(
                    "target_path {} is a symlink; it is never followed",
                    target.display()
                )));
            }
        }
        let _g = self.d.locks.lock(&id.alias()).await;
        let b = self
            .d
            .lvol(&id)
            .await?
            .filter(|b| !b.driver_specific.lvol.as_ref().is_some_and(|l| l.snapshot))
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        let ro_mode = cap
            .access_mode
            .as_ref()
            .is_some_and(|m| m.mode == vc::access_mode::Mode::SingleNodeReaderOnly as i32);
        let readonly = r.readonly || ro_mode;
        let fstype = match &cap.access_type {
            Some(vc::AccessType::Mount(m)) => Some(if !m.fs_type.is_empty() {
                m.fs_type.clone()
            } else {
                r.volume_context
                    .get("fstype")
                    .cloned()
                    .unwrap_or_else(|| "ext4".into())
            }),
            _ => None,
        };
        let mount_flags: Vec<String> = match &cap.access_type {
            Some(vc::AccessType::Mount(m)) => m.mount_flags.clone(),
            _ => Vec::new(),
        };
        let runtime = match r.volume_context.get(params::KATA_RUNTIME) {
            Some(v) => Some(KataRuntime::parse(v)?),
            None => None,
        };
        let raw_block = r
            .volume_context
            .get(params::RAW_BLOCK)
            .is_some_and(|v| v == "true");
        let runtime = match &fstype {
            None if runtime == Some(KataRuntime::Rs) => {
                return Err(CsiError::InvalidArgument(format!(
                    "volume {id}'s class is for Kata runtime-rs, which cannot attach Block PVs \
                     (it looks container devices up in /sys/dev/block): use a Filesystem PV"
                )))
            }
            None => None,
            Some(fs) => {
                let rt = runtime.unwrap_or(self.d.cfg.kata_runtime);
                if let Some(why) = rt.refuses(fs, raw_block) {
                    return Err(CsiError::InvalidArgument(why));
                }
                Some(rt)
            }
        };
        let ctrlr = id.ctrlr_name();
        // Another volume at this target (kubelet never does that): its unpublish would unmount
        // the other one.
        if let Some((other, _)) = self
            .d
            .state
            .published
            .all()
            .into_iter()
            .find(|(a, p)| p.target_path == target && *a != id.alias())
        {
            return Err(CsiError::FailedPrecondition(format!(
                "target_path {} is in use by volume {other}",
                target.display()
            )));
        }
        let prev = self.d.state.published.get(&id.alias());
        if let Some(p) = &prev {
            if p.target_path != target {
                return Err(CsiError::FailedPrecondition(format!(
                    "volume {id} is already published at {} (single-node single-attach)",
                    p.target_path.display()
                )));
            }
            if p.readonly != readonly
                || p.fstype.is_some() != fstype.is_some()
                || p.runtime() != runtime
                || p.raw_block != raw_block
            {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {id} is published at {} with other options",
                    target.display()
                )));
            }
        }
        let cpumask = r.volume_context.get(params::CPUMASK).cloned();
        let pod = crate::pod_qos::group_for(&r.volume_context)?;
        // kubelet's map file, checked before anything is changed: a Block target path that does
        // not follow kubelet's layout is refused while the lock is on.
        let kubelet_map = match (&fstype, self.d.cfg.kubelet_block_lock) {
            (None, LockMode::Kubelet) => {
                Some(kubelet_lock::map_file(&self.d.cfg.kubelet_dir, &target)?)
            }
            _ => None,
        };
        let mut rec = Publication {
            target_path: target.clone(),
            ctrlr: ctrlr.clone(),
            minor: prev.as_ref().and_then(|p| p.minor),
            readonly,
            fstype: fstype.clone(),
            cpumask: cpumask.clone(),
            kubelet_map: kubelet_map.clone(),
            kata_runtime: runtime,
            raw_block: raw_block && fstype.is_some(),
            mount_options: Vec::new(),
            pod_group: pod.as_ref().map(|(g, _)| g.clone()),
            pod_qos: pod.as_ref().map(|(_, q)| *q),
        };
        if fstype.is_some() {
            rec.mount_options = mount_flags;
            if readonly && !rec.mount_options.iter().any(|o| o == "ro") {
                rec.mount_options.push("ro".into());
            }
        }
        // Record first: if anything below fails, reconciliation and unpublish know what to
        // clean up.
        self.d.state.published.insert(&id.alias(), rec.clone())?;
        ensure_controller(&self.d, &id, &b, &ctrlr, readonly, cpumask.as_deref()).await?;
        // A volume published again for another pod (after a crash, say) leaves the old group.
        if let Some(old) = prev.as_ref().and_then(|p| p.pod_group.clone()) {
            if rec.pod_group.as_ref() != Some(&old) {
                crate::pod_qos::sync(&self.d, &old, None).await?;
            }
        }
        if let Some(g) = &rec.pod_group {
            crate::pod_qos::sync(&self.d, g, None).await?;
        }
        let minor = if rec.needs_device_node() {
            let minor = {
                let _m = self.d.minors.lock().await;
                self.d.store.ensure_device_node(&ctrlr, rec.minor)?
            };
            if rec.minor != Some(minor) {
                rec.minor = Some(minor);
                self.d.state.published.insert(&id.alias(), rec.clone())?;
            }
            Some(minor)
        } else {
            None
        };
        match &fstype {
            None => {
                let dev = self.d.store.device_path(&ctrlr);
                publish_block_target(&self.d.cfg.kubelet_dir, &dev, &target, readonly)?;
                if let Some(map) = &kubelet_map {
                    kubelet_lock::prepare(&self.d.cfg.kubelet_dir, map, &id.alias())?;
                }
                tracing::info!(volume_id = %id, target = %target.display(), minor, readonly,
                    "block volume published");
            }
            Some(fs) => {
                if !rec.raw_block {
                    self.ensure_filesystem(&id, &b, &ctrlr, fs, readonly)
                        .await?;
                }
                safe_path::resolve(&self.d.cfg.kubelet_dir, &target, true)?
                    .ok_or_else(|| {
                        CsiError::Internal(format!("no directory for {}", target.display()))
                    })?
                    .create_dir()?;
                let info = rec.mount_info(&self.d.store, &id.alias()).ok_or_else(|| {
                    CsiError::Internal(format!("volume {id}: no mountInfo for its record"))
                })?;
                let f = kata::write_mount_info(&self.d.cfg.direct_volumes_dir, &target, &info)?;
                tracing::info!(volume_id = %id, target = %target.display(), fstype = %fs,
                    kata_runtime = ?runtime, raw_block = rec.raw_block, ?minor,
                    mount_info = %f.display(), "filesystem volume published");
            }
        }
        self.d.refresh_published_gauge();
        Ok(())
    }

    async fn ensure_filesystem(
        &self,
        id: &LvolId,
        b: &BdevInfo,
        ctrlr: &str,
        fs: &str,
        readonly: bool,
    ) -> Result<()> {
        crate::format::check_fstype(fs)?;
        let socket = self.d.store.socket_path(ctrlr);
        let s2 = socket.clone();
        let found = tokio::task::spawn_blocking(move || crate::format::detect_fs(&s2))
            .await
            .map_err(|e| CsiError::Internal(e.to_string()))??;
        match found {
            Some(f) if crate::format::same_family(f, fs) => return Ok(()),
            Some(f) => {
                return Err(CsiError::FailedPrecondition(format!(
                    "volume {id} holds a {f} filesystem, not {fs}"
                )))
            }
            None if readonly => {
                return Err(CsiError::FailedPrecondition(format!(
                    "volume {id} has no filesystem and is published read-only"
                )))
            }
            None => {}
        }
        tracing::info!(volume_id = %id, fstype = fs, "formatting");
        let size = bdev_size(b);
        let scratch = self.d.cfg.state_dir.join("scratch");
        let fs = fs.to_owned();
        tokio::task::spawn_blocking(move || crate::format::format(&socket, &fs, size, &scratch))
            .await
            .map_err(|e| CsiError::Internal(e.to_string()))?
    }

    async fn unpublish(&self, r: csi::NodeUnpublishVolumeRequest) -> Result<()> {
        if r.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if r.target_path.is_empty() {
            return Err(CsiError::InvalidArgument("target_path is required".into()));
        }
        let target = self.target(&r.target_path, "target_path")?;
        let Some(id) = LvolId::parse(&r.volume_id) else {
            return Err(CsiError::NotFound(format!(
                "volume {} does not exist",
                crate::volume::shown(&r.volume_id)
            )));
        };
        let _g = self.d.locks.lock(&id.alias()).await;
        let rec = self
            .d
            .state
            .published
            .get(&id.alias())
            .filter(|p| p.target_path == target);
        // The target belongs to another volume's publication: nothing here is this volume's.
        if rec.is_none()
            && self
                .d
                .state
                .published
                .all()
                .iter()
                .any(|(a, p)| p.target_path == target && *a != id.alias())
        {
            tracing::info!(volume_id = %id, target = %target.display(),
                "unpublish of a target another volume is published at: nothing to do");
            return Ok(());
        }
        // kubelet's unmap normally released its lock already; what is left of ours goes now.
        let map = rec
            .as_ref()
            .and_then(|p| p.kubelet_map.clone())
            .or_else(|| {
                (self.d.cfg.kubelet_block_lock == LockMode::Kubelet)
                    .then(|| kubelet_lock::map_file(&self.d.cfg.kubelet_dir, &target).ok())
                    .flatten()
            });
        // A path that now leads through a symlink is not followed: it is left as it is (nothing
        // of ours can be behind it any more) and the rest of the volume is cleaned up.
        let not_followed = |r: Result<()>| match r {
            Err(CsiError::InvalidArgument(m)) => {
                tracing::warn!(volume_id = %id, target = %target.display(), reason = %m,
                    "unpublish leaves a path it cannot walk without following links");
                Ok(())
            }
            r => r,
        };
        if let Some(map) = &map {
            not_followed(kubelet_lock::release(&self.d.cfg.kubelet_dir, map).map(drop))?;
        }
        not_followed(remove_target(&self.d.cfg.kubelet_dir, &target))?;
        kata::remove_mount_info(&self.d.cfg.direct_volumes_dir, &target)?;
        if let Some(p) = rec {
            // Out of the pod's group first, while the record still says which one.
            if let Some(g) = &p.pod_group {
                crate::pod_qos::sync(&self.d, g, Some(&id.alias())).await?;
            }
            delete_controller(&self.d, &p.ctrlr).await?;
            self.d.store.remove_device_node(&p.ctrlr)?;
            self.d.state.published.remove(&id.alias())?;
            self.d.refresh_published_gauge();
        }
        tracing::info!(volume_id = %id, target = %target.display(), "unpublished");
        Ok(())
    }

    async fn stats(
        &self,
        r: csi::NodeGetVolumeStatsRequest,
    ) -> Result<csi::NodeGetVolumeStatsResponse> {
        if r.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if r.volume_path.is_empty() {
            return Err(CsiError::InvalidArgument("volume_path is required".into()));
        }
        let id = require_id(&r.volume_id, "volume")?;
        let path = self.existing_volume_path(&r.volume_path)?;
        let b = self
            .d
            .lvol(&id)
            .await?
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        let cluster = self.d.lvstore(&id.lvs).await?.map_or(0, |l| l.cluster_size);
        let total = bdev_size(&b);
        let allocated = b
            .driver_specific
            .lvol
            .as_ref()
            .map_or(0, |l| l.num_allocated_clusters)
            .saturating_mul(cluster)
            .min(total);
        let condition = self.condition(&id, &path).await?;
        Ok(csi::NodeGetVolumeStatsResponse {
            usage: vec![csi::VolumeUsage {
                available: (total - allocated) as i64,
                total: total as i64,
                used: allocated as i64,
                unit: csi::volume_usage::Unit::Bytes as i32,
            }],
            volume_condition: Some(condition),
        })
    }

    async fn condition(&self, id: &LvolId, path: &Path) -> Result<csi::VolumeCondition> {
        let abnormal = |m: String| csi::VolumeCondition {
            abnormal: true,
            message: m,
        };
        let Some(p) = self.d.state.published.get(&id.alias()) else {
            return Ok(abnormal(format!(
                "volume {id} is not published on this node"
            )));
        };
        if p.target_path != path {
            return Ok(abnormal(format!(
                "volume {id} is published at {}, not here",
                p.target_path.display()
            )));
        }
        let ctrl = match self.d.rpc.vhost_get_controllers(Some(&p.ctrlr)).await {
            Ok(v) => v.into_iter().any(|c| c.ctrlr == p.ctrlr),
            Err(e) if e.is_not_found() => false,
            Err(e) => return Err(CsiError::rpc("vhost_get_controllers")(e)),
        };
        if !ctrl {
            return Ok(abnormal(format!(
                "vhost-user-blk controller {} is missing",
                p.ctrlr
            )));
        }
        let socket = self.d.store.socket_path(&p.ctrlr);
        if !socket.exists() {
            return Ok(abnormal(format!("socket {} is missing", socket.display())));
        }
        if p.needs_device_node() && !self.d.store.device_nodes()?.contains_key(&p.ctrlr) {
            return Ok(abnormal(format!("device node {} is missing", p.ctrlr)));
        }
        if let Some(want) = p.mount_info(&self.d.store, &id.alias()) {
            match kata::read_mount_info(&self.d.cfg.direct_volumes_dir, path) {
                None => {
                    return Ok(abnormal(format!(
                        "Kata's mountInfo.json for {} is missing or unreadable",
                        path.display()
                    )))
                }
                Some(have) if have != want => {
                    return Ok(abnormal(format!(
                        "Kata's mountInfo.json for {} names {} ({}), not {} ({})",
                        path.display(),
                        have.device,
                        have.volume_type,
                        want.device,
                        want.volume_type
                    )))
                }
                Some(_) => {}
            }
        }
        if p.fstype.is_none() {
            let mounted = match safe_path::resolve(&self.d.cfg.kubelet_dir, path, false)? {
                Some(r) => r.is_mount_point()?,
                None => false,
            };
            if !mounted {
                return Ok(abnormal(format!("{} is not mounted", path.display())));
            }
            if let Some(map) = &p.kubelet_map {
                if !kubelet_lock::is_held(map) {
                    return Ok(abnormal(format!(
                        "kubelet's lock for {} is missing (no loop device, not mapped)",
                        map.display()
                    )));
                }
            }
        }
        Ok(csi::VolumeCondition {
            abnormal: false,
            message: "volume is healthy".into(),
        })
    }

    async fn expand(
        &self,
        r: csi::NodeExpandVolumeRequest,
    ) -> Result<csi::NodeExpandVolumeResponse> {
        if r.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if r.volume_path.is_empty() {
            return Err(CsiError::InvalidArgument("volume_path is required".into()));
        }
        let id = require_id(&r.volume_id, "volume")?;
        self.existing_volume_path(&r.volume_path)?;
        let b = self
            .d
            .lvol(&id)
            .await?
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        let size = bdev_size(&b);
        if let Some(req) = r.capacity_range.as_ref().map(|c| c.required_bytes) {
            if req > 0 && size < req as u64 {
                return Err(CsiError::OutOfRange(format!(
                    "volume {id} is {size} bytes, smaller than the {req} requested: expand it \
                     with ControllerExpandVolume first"
                )));
            }
        }
        // The target announces the new capacity to the guest (virtio config change); a
        // filesystem inside is grown in the guest (Kata direct-volume resize).
        Ok(csi::NodeExpandVolumeResponse {
            capacity_bytes: size as i64,
        })
    }
}

fn node_cap(t: nsc::rpc::Type) -> csi::NodeServiceCapability {
    csi::NodeServiceCapability {
        r#type: Some(nsc::Type::Rpc(nsc::Rpc { r#type: t as i32 })),
    }
}

#[tonic::async_trait]
impl csi::node_server::Node for NodeService {
    async fn node_stage_volume(
        &self,
        req: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let t0 = Instant::now();
        let vid = req.into_inner().volume_id;
        let res = Err(CsiError::Unimplemented(
            "NodeStageVolume: not needed".into(),
        ));
        self.d.finish("NodeStageVolume", &vid, t0, res)
    }

    async fn node_unstage_volume(
        &self,
        req: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let t0 = Instant::now();
        let vid = req.into_inner().volume_id;
        let res = Err(CsiError::Unimplemented(
            "NodeUnstageVolume: not needed".into(),
        ));
        self.d.finish("NodeUnstageVolume", &vid, t0, res)
    }

    async fn node_publish_volume(
        &self,
        req: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.volume_id.clone();
        let res = self
            .publish(r)
            .await
            .map(|()| csi::NodePublishVolumeResponse {});
        self.d.finish("NodePublishVolume", &vid, t0, res)
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.volume_id.clone();
        let res = self
            .unpublish(r)
            .await
            .map(|()| csi::NodeUnpublishVolumeResponse {});
        self.d.finish("NodeUnpublishVolume", &vid, t0, res)
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.volume_id.clone();
        let res = self.stats(r).await;
        self.d.finish("NodeGetVolumeStats", &vid, t0, res)
    }

    async fn node_expand_volume(
        &self,
        req: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.volume_id.clone();
        let res = self.expand(r).await;
        self.d.finish("NodeExpandVolume", &vid, t0, res)
    }

    async fn node_get_capabilities(
        &self,
        _req: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use nsc::rpc::Type;
        let t0 = Instant::now();
        let capabilities = [
            Type::GetVolumeStats,
            Type::ExpandVolume,
            Type::VolumeCondition,
        ]
        .into_iter()
        .map(node_cap)
        .collect();
        let res = Ok(csi::NodeGetCapabilitiesResponse { capabilities });
        self.d.finish("NodeGetCapabilities", "", t0, res)
    }

    async fn node_get_info(
        &self,
        _req: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        let t0 = Instant::now();
        let res = Ok(csi::NodeGetInfoResponse {
            node_id: self.d.cfg.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(self.d.topology()),
        });
        self.d.finish("NodeGetInfo", "", t0, res)
    }
}
