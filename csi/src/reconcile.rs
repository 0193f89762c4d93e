//! Reconciliation: after a driver or target restart, make the target's controllers and the
//! store's device nodes match what this node published (the state file), without deleting
//! anything in use.
//!
//! - A recorded publication whose lvol exists gets its controller back (same name, so the same
//!   socket path the VM reconnects to), its device node and, for block volumes, its bind mount.
//! - A recorded publication whose lvol is gone is kept and reported (its pod still references
//!   it; unpublish cleans it up).
//! - Controllers named `ctrlr-*` (this driver's prefix) that no record mentions are deleted;
//!   so are `ctrlr-*` device nodes without a record. Others' controllers and nodes are left.
//! - A recorded Filesystem publication whose `mountInfo.json` is missing or differs gets it
//!   written again (while its target directory exists); for the Go runtime its device node too.
//! - kubelet locks ([`crate::kubelet_lock`]): a recorded Block publication gets its loop device
//!   back if it lost it; loop devices of this driver on map files no record wants (and kubelet
//!   does not map) are detached. Loop devices of others are never touched.

use std::sync::Arc;

use crate::driver::Driver;
use crate::error::{CsiError, Result};
use crate::node::{delete_controller, ensure_controller, publish_block_target};
use crate::volume::LvolId;

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Controllers re-created.
    pub restored: Vec<String>,
    /// Orphaned controllers deleted.
    pub orphan_controllers: Vec<String>,
    /// Orphaned device nodes removed.
    pub orphan_nodes: Vec<String>,
    /// Publications whose lvol is missing.
    pub missing_volumes: Vec<String>,
    /// Unrecorded controllers kept because something uses them.
    pub kept_in_use: Vec<String>,
    /// kubelet map files whose loop device of ours was detached (no publication wants them).
    pub orphan_locks: Vec<std::path::PathBuf>,
    /// Filesystem publications whose `mountInfo.json` was written again.
    pub mount_infos: Vec<std::path::PathBuf>,
    /// Publications that could not be restored this pass (logged; retried next pass).
    pub failed: Vec<String>,
    /// Per-pod QoS groups made to match the records again (or deleted).
    pub pod_groups: Vec<String>,
}

/// Controller names referenced by `mountInfo.json` files in the direct-volumes directory.
/// Both runtimes' files count: runtime-rs names the socket, the Go runtime the device node.
fn direct_volume_ctrlrs(d: &Driver) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(&d.cfg.direct_volumes_dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| std::fs::read(e.path().join("mountInfo.json")).ok())
        .filter_map(|b| serde_json::from_slice::<crate::kata::MountInfo>(&b).ok())
        .filter_map(|m| m.ctrlr(&d.store))
        .collect()
}

const PREFIX: &str = "ctrlr-";

/// One reconciliation pass.
pub async fn reconcile(d: &Arc<Driver>) -> Result<Report> {
    let mut rep = Report::default();
    let published = d.state.published.all();
    let ctrls = d
        .rpc
        .vhost_get_controllers(None)
        .await
        .map_err(CsiError::rpc("vhost_get_controllers"))?;
    let wanted: std::collections::BTreeSet<String> =
        published.values().map(|p| p.ctrlr.clone()).collect();

    // In use without a record (e.g. the state file was lost): still bind-mounted into a pod,
    // or named by a Kata direct-volume mountInfo.json. Never removed.
    let mut in_use = crate::mounts::bound_device_names()?;
    in_use.extend(direct_volume_ctrlrs(d));
    // Orphans first: one may hold the bdev a recorded controller needs.
    for c in ctrls.iter().filter(|c| c.ctrlr.starts_with(PREFIX)) {
        if !wanted.contains(&c.ctrlr) {
            if !c.sessions.is_empty() || in_use.contains(&c.ctrlr) {
                tracing::warn!(ctrlr = %c.ctrlr, "unrecorded controller is in use; kept");
                d.metrics.reconciled("orphan_in_use_kept");
                rep.kept_in_use.push(c.ctrlr.clone());
                continue;
            }
            tracing::info!(ctrlr = %c.ctrlr, "deleting orphaned controller");
            delete_controller(d, &c.ctrlr).await?;
            d.metrics.reconciled("orphan_controller_deleted");
            rep.orphan_controllers.push(c.ctrlr.clone());
        }
    }
    for (vid, p) in &published {
        let Some(id) = LvolId::parse(vid) else {
            continue;
        };
        let _g = d.locks.lock(vid).await;
        // Re-read under the lock: an unpublish may have just finished.
        let Some(p) = d.state.published.get(vid).filter(|q| q == p) else {
            continue;
        };
        if let Err(e) = restore_one(d, vid, &id, &p, &ctrls, &mut rep).await {
            // One bad record must not keep the others from being restored.
            tracing::warn!(volume_id = %vid, error = %e, "cannot restore publication");
            d.metrics.reconciled("publication_restore_failed");
            rep.failed.push(vid.clone());
        }
    }

    if d.cfg.kubelet_block_lock == crate::kubelet_lock::LockMode::Kubelet {
        for (map, alias) in crate::kubelet_lock::unmapped_locks(&d.cfg.kubelet_dir) {
            // Under the volume's lock: a publish records its map file before attaching.
            let _g = d.locks.lock(&alias).await;
            let wanted = d
                .state
                .published
                .get(&alias)
                .is_some_and(|p| p.kubelet_map.as_deref() == Some(map.as_path()));
            if wanted {
                continue;
            }
            crate::kubelet_lock::release(&d.cfg.kubelet_dir, &map)?;
            tracing::info!(map = %map.display(), volume_id = %alias,
                "released an orphaned kubelet lock");
            d.metrics.reconciled("orphan_kubelet_lock_released");
            rep.orphan_locks.push(map);
        }
    }

    match crate::pod_qos::reconcile(d).await {
        Ok(groups) => {
            for g in groups {
                tracing::info!(group = %g, "pod QoS group reconciled");
                d.metrics.reconciled("pod_group_synced");
                rep.pod_groups.push(g);
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot reconcile pod QoS groups");
            d.metrics.reconciled("pod_group_sync_failed");
        }
    }

    {
        let _m = d.minors.lock().await;
        for name in d.store.device_nodes()?.keys() {
            if name.starts_with(PREFIX) && !wanted.contains(name) && !in_use.contains(name) {
                tracing::info!(node = %name, "removing orphaned device node");
                d.store.remove_device_node(name)?;
                d.metrics.reconciled("orphan_node_removed");
                rep.orphan_nodes.push(name.clone());
            }
        }
    }
    d.refresh_published_gauge();
    Ok(rep)
}

/// Brings back what one recorded publication needs: controller, device node, `mountInfo.json`,
/// bind mount and kubelet's lock.
async fn restore_one(
    d: &Arc<Driver>,
    vid: &str,
    id: &LvolId,
    p: &crate::state::Publication,
    ctrls: &[katablk_rpc::methods::VhostController],
    rep: &mut Report,
) -> Result<()> {
    let Some(b) = d.lvol(id).await? else {
        tracing::warn!(volume_id = %vid, "published volume's lvol is missing");
        rep.missing_volumes.push(vid.to_owned());
        return Ok(());
    };
    let had = ctrls.iter().any(|c| c.ctrlr == p.ctrlr);
    ensure_controller(d, id, &b, &p.ctrlr, p.readonly, p.cpumask.as_deref()).await?;
    if !had {
        tracing::info!(volume_id = %vid, ctrlr = %p.ctrlr, "controller restored");
        d.metrics.reconciled("controller_restored");
        rep.restored.push(p.ctrlr.clone());
    }
    if p.needs_device_node() {
        let minor = {
            let _m = d.minors.lock().await;
            d.store.ensure_device_node(&p.ctrlr, p.minor)?
        };
        if p.minor != Some(minor) {
            tracing::warn!(volume_id = %vid, old = ?p.minor, minor,
                "device node re-created with another minor");
            let mut q = p.clone();
            q.minor = Some(minor);
            d.state.published.insert(vid, q)?;
        }
    }
    if let Some(info) = p.mount_info(&d.store, vid) {
        // The direct-volumes directory is on tmpfs: a lost file is written again while the
        // target directory (the pod's volume) is still there.
        let have = crate::kata::read_mount_info(&d.cfg.direct_volumes_dir, &p.target_path);
        let target_is_dir = crate::safe_path::resolve(&d.cfg.kubelet_dir, &p.target_path, false)?
            .map_or(Ok(false), |r| {
            r.kind().map(|k| k == crate::safe_path::Kind::Dir)
        })?;
        if have.as_ref() != Some(&info) && target_is_dir {
            crate::kata::write_mount_info(&d.cfg.direct_volumes_dir, &p.target_path, &info)?;
            tracing::info!(volume_id = %vid, target = %p.target_path.display(),
                "mountInfo.json restored");
            d.metrics.reconciled("mount_info_restored");
            rep.mount_infos.push(p.target_path.clone());
        }
    }
    // The target's directory still there (walked without following links): the pod is.
    let parent_there =
        crate::safe_path::resolve(&d.cfg.kubelet_dir, &p.target_path, false)?.is_some();
    if p.fstype.is_none() && parent_there {
        publish_block_target(
            &d.cfg.kubelet_dir,
            &d.store.device_path(&p.ctrlr),
            &p.target_path,
            p.readonly,
        )?;
        if let Some(map) = &p.kubelet_map {
            if let Err(e) = crate::kubelet_lock::prepare(&d.cfg.kubelet_dir, map, vid) {
                tracing::warn!(volume_id = %vid, map = %map.display(), error = %e,
                    "cannot restore kubelet's lock");
            }
        }
    }
    Ok(())
}

/// Runs the node config watcher and reconciliation forever, every `cfg.reconcile_interval`.
pub async fn run(d: Arc<Driver>) {
    let mut watcher = d
        .cfg
        .node_config
        .clone()
        .map(crate::node_config::Watcher::new);
    let mut target_was_down = true;
    loop {
        let up = d.rpc.spdk_get_version().await.is_ok() || d.lvstores().await.is_ok();
        if up {
            if let Some(w) = watcher.as_mut() {
                if let Err(e) = w.poll(&d.rpc, target_was_down).await {
                    tracing::error!(error = %e, "node config");
                }
            }
            if d.cfg.mode.node() {
                match reconcile(&d).await {
                    Ok(r) if r != Report::default() => tracing::info!(?r, "reconciled"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "reconciliation pass failed"),
                }
            }
        } else if !target_was_down {
            tracing::warn!(rpc = %d.cfg.spdk_rpc.display(), "SPDK target does not answer");
        }
        target_was_down = !up;
        tokio::time::sleep(d.cfg.reconcile_interval).await;
    }
}
