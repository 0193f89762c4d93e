//! The CSI Controller service: lvols as volumes, lvol snapshots as snapshots, clones as
//! content sources. It runs on every node (external-provisioner `--node-deployment`) and only
//! manages that node's lvstores; every volume carries this node's topology.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use katablk_rpc::methods::{BdevInfo, BdevLvolCreateParams, BdevSetQosLimit};
use tonic::{Request, Response, Status};

use crate::class::{
    check_capabilities, mutable_qos, params, unsupported_capability, ClassParams, QosParams,
};
use crate::csi::{self, controller_service_capability as csc, volume_capability as vc};
use crate::driver::{bdev_alias, bdev_size, Driver, TOPOLOGY_KEY};
use crate::error::{CsiError, Result};
use crate::state::SnapshotMeta;
use crate::volume::{fnv64, lvol_name_for, require_id, LvolId, CLONE_SOURCE_PREFIX};

const MIB: u64 = 1 << 20;

/// The size to allocate for a capacity range: at least one allocation unit, rounded up to a
/// multiple of `unit` (the cluster size, at least 1 MiB), within `limit_bytes`.
pub fn volume_size(range: Option<&csi::CapacityRange>, unit: u64) -> Result<u64> {
    let unit = unit.max(MIB);
    let (req, lim) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if req < 0 || lim < 0 {
        return Err(CsiError::InvalidArgument(
            "capacity must not be negative".into(),
        ));
    }
    let (req, lim) = (req as u64, lim as u64);
    if lim > 0 && req > lim {
        return Err(CsiError::InvalidArgument(format!(
            "required_bytes {req} exceeds limit_bytes {lim}"
        )));
    }
    let size = req.max(1).div_ceil(unit).saturating_mul(unit);
    if lim > 0 && size > lim {
        let down = lim / unit * unit;
        if down >= req.max(1) {
            return Ok(down);
        }
        return Err(CsiError::OutOfRange(format!(
            "no multiple of the {unit}-byte cluster lies in [{req}, {lim}]"
        )));
    }
    Ok(size)
}

fn fits(size: u64, range: Option<&csi::CapacityRange>) -> bool {
    let Some(r) = range else { return true };
    size >= r.required_bytes.max(0) as u64 && (r.limit_bytes <= 0 || size <= r.limit_bytes as u64)
}

/// Paginates `items` with an offset token.
pub fn paginate<T>(items: Vec<T>, max_entries: i32, token: &str) -> Result<(Vec<T>, String)> {
    if max_entries < 0 {
        return Err(CsiError::InvalidArgument(
            "max_entries must not be negative".into(),
        ));
    }
    let start = if token.is_empty() {
        0
    } else {
        token
            .parse::<usize>()
            .ok()
            .filter(|s| *s <= items.len())
            .ok_or_else(|| CsiError::Aborted(format!("invalid starting_token {token:?}")))?
    };
    let len = items.len();
    let take = if max_entries == 0 {
        len - start
    } else {
        (max_entries as usize).min(len - start)
    };
    let next = if start + take < len {
        (start + take).to_string()
    } else {
        String::new()
    };
    Ok((items.into_iter().skip(start).take(take).collect(), next))
}

fn is_snapshot(b: &BdevInfo) -> bool {
    b.driver_specific.lvol.as_ref().is_some_and(|l| l.snapshot)
}

fn is_hidden(alias: &str) -> bool {
    alias
        .split_once('/')
        .is_some_and(|(_, n)| n.starts_with(CLONE_SOURCE_PREFIX))
}

fn now() -> (i64, i32) {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos() as i32)
}

/// Controller service.
#[derive(Debug, Clone)]
pub struct ControllerService {
    d: Arc<Driver>,
}

impl ControllerService {
    /// The service over a driver.
    pub fn new(d: Arc<Driver>) -> Self {
        Self { d }
    }

    fn topology_ok(&self, req: Option<&csi::TopologyRequirement>) -> bool {
        let Some(r) = req else { return true };
        if r.requisite.is_empty() {
            return true;
        }
        r.requisite.iter().any(|t| {
            t.segments.get(TOPOLOGY_KEY) == Some(&self.d.cfg.node_id)
                && t.segments.keys().all(|k| k == TOPOLOGY_KEY)
        })
    }

    fn to_volume(
        &self,
        b: &BdevInfo,
        id: &LvolId,
        p: Option<&ClassParams>,
        src: Option<csi::VolumeContentSource>,
    ) -> csi::Volume {
        let mut ctx: HashMap<String, String> = HashMap::new();
        ctx.insert("lvs".into(), id.lvs.clone());
        ctx.insert("lvolUuid".into(), b.name.clone());
        if let Some(p) = p {
            ctx.insert(params::THIN.into(), p.thin.to_string());
            if let Some(m) = &p.cpumask {
                ctx.insert(params::CPUMASK.into(), m.clone());
            }
            if let Some(f) = &p.fstype {
                ctx.insert("fstype".into(), f.clone());
            }
            if let Some(r) = p.kata_runtime {
                ctx.insert(params::KATA_RUNTIME.into(), r.as_str().into());
            }
            if p.raw_block {
                ctx.insert(params::RAW_BLOCK.into(), "true".into());
            }
            // Per-pod limits are applied on publish, when the pod is known.
            for (k, v) in p.pod_qos.to_context(params::POD_QOS) {
                ctx.insert(k.into(), v);
            }
        }
        csi::Volume {
            capacity_bytes: bdev_size(b) as i64,
            volume_id: id.alias(),
            volume_context: ctx,
            content_source: src,
            accessible_topology: vec![self.d.topology()],
        }
    }

    async fn cluster_size(&self, lvs: &str) -> Result<u64> {
        let s = self.d.lvstore(lvs).await?.ok_or_else(|| {
            CsiError::InvalidArgument(format!(
                "lvstore {lvs:?} does not exist on node {}",
                self.d.cfg.node_id
            ))
        })?;
        Ok(s.cluster_size)
    }

    async fn resize_to(&self, alias: &str, size: u64) -> Result<()> {
        self.d
            .rpc
            .bdev_lvol_resize(alias, size.div_ceil(MIB))
            .await
            .map(|_| ())
            .map_err(CsiError::rpc("bdev_lvol_resize"))
    }

    async fn create_volume(&self, r: csi::CreateVolumeRequest) -> Result<csi::Volume> {
        if r.name.is_empty() {
            return Err(CsiError::InvalidArgument("name is required".into()));
        }
        check_capabilities(&r.volume_capabilities)?;
        let p = ClassParams::parse(&r.parameters, self.d.cfg.lvs.as_deref())?;
        p.check_capabilities(&r.volume_capabilities)?;
        // A VolumeAttributesClass at creation: its parameters win over the StorageClass's.
        let qos = p.qos.overlay(&mutable_qos(&r.mutable_parameters)?);
        if !self.topology_ok(r.accessibility_requirements.as_ref()) {
            return Err(CsiError::ResourceExhausted(format!(
                "requisite topology does not include node {}",
                self.d.cfg.node_id
            )));
        }
        let id = LvolId::new(&p.lvs, &lvol_name_for(&r.name, "vol"))?;
        let _g = self.d.locks.lock(&id.alias()).await;
        let cluster = self.cluster_size(&p.lvs).await?;
        let size = volume_size(r.capacity_range.as_ref(), cluster)?;
        let src = r.volume_content_source.clone();
        if let Some(b) = self.d.lvol(&id).await? {
            if is_snapshot(&b) || !fits(bdev_size(&b), r.capacity_range.as_ref()) {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {id} exists with {} bytes, incompatible with the request",
                    bdev_size(&b)
                )));
            }
            // A retry may follow a failed limit call: set the limits again.
            self.apply_qos(&id, &qos).await?;
            return Ok(self.to_volume(&b, &id, Some(&p), src));
        }
        let create_err = |e: CsiError| {
            if e.code() == tonic::Code::ResourceExhausted {
                CsiError::ResourceExhausted(format!(
                    "lvstore {} has no space for {size} bytes: {e}",
                    p.lvs
                ))
            } else {
                e
            }
        };
        match src.as_ref().and_then(|s| s.r#type.as_ref()) {
            None => {
                self.d
                    .rpc
                    .bdev_lvol_create(&BdevLvolCreateParams {
                        lvol_name: id.lvol.clone(),
                        size_in_mib: size / MIB,
                        thin_provision: Some(p.thin),
                        clear_method: p.clear,
                        uuid: None,
                        lvs_name: Some(p.lvs.clone()),
                    })
                    .await
                    .map_err(CsiError::rpc("bdev_lvol_create"))
                    .map_err(create_err)?;
            }
            Some(csi::volume_content_source::Type::Snapshot(s)) => {
                let sid = require_id(&s.snapshot_id, "snapshot id")?;
                let snap = self
                    .d
                    .lvol(&sid)
                    .await?
                    .filter(is_snapshot)
                    .ok_or_else(|| {
                        CsiError::NotFound(format!("snapshot {} does not exist", s.snapshot_id))
                    })?;
                self.clone_from(&id, &sid, &snap, size)
                    .await
                    .map_err(create_err)?;
            }
            Some(csi::volume_content_source::Type::Volume(v)) => {
                let vid = require_id(&v.volume_id, "source volume id")?;
                let srcb = self
                    .d
                    .lvol(&vid)
                    .await?
                    .filter(|b| !is_snapshot(b))
                    .ok_or_else(|| {
                        CsiError::NotFound(format!("source volume {} does not exist", v.volume_id))
                    })?;
                if vid.lvs != id.lvs {
                    return Err(CsiError::InvalidArgument(format!(
                        "source volume {vid} is in another lvstore than {}",
                        id.lvs
                    )));
                }
                if bdev_size(&srcb) > size {
                    return Err(CsiError::OutOfRange(format!(
                        "source volume {vid} ({} bytes) is larger than the requested size",
                        bdev_size(&srcb)
                    )));
                }
                // A hidden snapshot of the source, then a clone of it.
                let hidden = LvolId::new(
                    &id.lvs,
                    &format!("{CLONE_SOURCE_PREFIX}{:016x}", fnv64(&id.alias())),
                )?;
                let snap = match self.d.lvol(&hidden).await? {
                    Some(s) => s,
                    None => {
                        self.d
                            .rpc
                            .bdev_lvol_snapshot(&vid.alias(), &hidden.lvol)
                            .await
                            .map_err(CsiError::rpc("bdev_lvol_snapshot"))
                            .map_err(create_err)?;
                        self.d.lvol(&hidden).await?.ok_or_else(|| {
                            CsiError::Internal(format!("snapshot {hidden} vanished"))
                        })?
                    }
                };
                self.clone_from(&id, &hidden, &snap, size)
                    .await
                    .map_err(create_err)?;
            }
        }
        let b =
            self.d.lvol(&id).await?.ok_or_else(|| {
                CsiError::Internal(format!("volume {id} vanished after creation"))
            })?;
        self.apply_qos(&id, &qos).await?;
        Ok(self.to_volume(&b, &id, Some(&p), src))
    }

    /// Sets the volume's rate limits on its bdev (the target keeps them, across restarts too).
    async fn apply_qos(&self, id: &LvolId, q: &QosParams) -> Result<()> {
        if !q.any() {
            return Ok(());
        }
        self.d
            .rpc
            .call_method::<BdevSetQosLimit>(&q.rpc_params(&id.alias()))
            .await
            .map_err(CsiError::rpc("bdev_set_qos_limit"))?;
        tracing::info!(volume_id = %id, ?q, "rate limits set");
        Ok(())
    }

    async fn modify_volume(&self, r: csi::ControllerModifyVolumeRequest) -> Result<()> {
        let id = require_id(&r.volume_id, "volume_id")?;
        let q = mutable_qos(&r.mutable_parameters)?;
        let _g = self.d.locks.lock(&id.alias()).await;
        self.d
            .lvol(&id)
            .await?
            .filter(|b| !is_snapshot(b))
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        self.apply_qos(&id, &q).await
    }

    async fn clone_from(
        &self,
        id: &LvolId,
        sid: &LvolId,
        snap: &BdevInfo,
        size: u64,
    ) -> Result<()> {
        if sid.lvs != id.lvs {
            return Err(CsiError::InvalidArgument(format!(
                "snapshot {sid} is in another lvstore than {}",
                id.lvs
            )));
        }
        if bdev_size(snap) > size {
            return Err(CsiError::OutOfRange(format!(
                "snapshot {sid} ({} bytes) is larger than the requested size {size}",
                bdev_size(snap)
            )));
        }
        self.d
            .rpc
            .bdev_lvol_clone(&sid.alias(), &id.lvol)
            .await
            .map_err(CsiError::rpc("bdev_lvol_clone"))?;
        if size > bdev_size(snap) {
            if let Err(e) = self.resize_to(&id.alias(), size).await {
                // Leave nothing half-made behind: a retry starts over.
                let _ = self.d.rpc.bdev_lvol_delete(&id.alias()).await;
                return Err(e);
            }
        }
        Ok(())
    }

    async fn published_by(&self, b: &BdevInfo) -> Result<Option<String>> {
        let ctrls = self
            .d
            .rpc
            .vhost_get_controllers(None)
            .await
            .map_err(CsiError::rpc("vhost_get_controllers"))?;
        Ok(ctrls
            .into_iter()
            .find(|c| {
                c.backend_specific
                    .block
                    .as_ref()
                    .and_then(|k| k.bdev.as_deref())
                    .is_some_and(|n| n == b.name || b.aliases.iter().any(|a| a == n))
            })
            .map(|c| c.ctrlr))
    }

    async fn delete_volume(
        &self,
        r: csi::DeleteVolumeRequest,
    ) -> Result<csi::DeleteVolumeResponse> {
        if r.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        let Some(id) = LvolId::parse(&r.volume_id) else {
            return Ok(csi::DeleteVolumeResponse {});
        };
        let _g = self.d.locks.lock(&id.alias()).await;
        let Some(b) = self.d.lvol(&id).await?.filter(|b| !is_snapshot(b)) else {
            return Ok(csi::DeleteVolumeResponse {});
        };
        if let Some(c) = self.published_by(&b).await? {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is published through controller {c}"
            )));
        }
        let base = b
            .driver_specific
            .lvol
            .as_ref()
            .and_then(|l| l.base_snapshot.clone());
        match self.d.rpc.bdev_lvol_delete(&id.alias()).await {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(CsiError::rpc("bdev_lvol_delete")(e)),
        }
        // Drop the hidden clone-source snapshot once nothing is based on it.
        if let Some(base) = base.filter(|n| n.starts_with(CLONE_SOURCE_PREFIX)) {
            let hid = LvolId::new(&id.lvs, &base)?;
            if let Some(h) = self.d.lvol(&hid).await? {
                let n = h
                    .driver_specific
                    .lvol
                    .as_ref()
                    .and_then(|l| l.clones.as_ref())
                    .map_or(0, Vec::len);
                if n <= 1 {
                    if let Err(e) = self.d.rpc.bdev_lvol_delete(&hid.alias()).await {
                        tracing::warn!(volume_id = %id, snapshot = %hid, error = %e,
                            "could not remove the hidden clone-source snapshot");
                    }
                }
            }
        }
        Ok(csi::DeleteVolumeResponse {})
    }

    async fn lvol_bdevs(&self) -> Result<Vec<BdevInfo>> {
        let all = self
            .d
            .rpc
            .bdev_get_bdevs(None)
            .await
            .map_err(CsiError::rpc("bdev_get_bdevs"))?;
        let mut v: Vec<BdevInfo> = all
            .into_iter()
            .filter(|b| b.driver_specific.lvol.is_some())
            .filter(|b| bdev_alias(b).is_some_and(|a| !is_hidden(a)))
            .collect();
        v.sort_by(|a, b| bdev_alias(a).cmp(&bdev_alias(b)));
        Ok(v)
    }

    async fn list_volumes(&self, r: csi::ListVolumesRequest) -> Result<csi::ListVolumesResponse> {
        let vols: Vec<BdevInfo> = self
            .lvol_bdevs()
            .await?
            .into_iter()
            .filter(|b| !is_snapshot(b))
            .collect();
        let (page, next_token) = paginate(vols, r.max_entries, &r.starting_token)?;
        let entries = page
            .iter()
            .filter_map(|b| {
                let id = LvolId::parse(bdev_alias(b)?)?;
                Some(csi::list_volumes_response::Entry {
                    volume: Some(self.to_volume(b, &id, None, None)),
                    status: None,
                })
            })
            .collect();
        Ok(csi::ListVolumesResponse {
            entries,
            next_token,
        })
    }

    fn to_snapshot(&self, b: &BdevInfo, id: &LvolId, meta: Option<SnapshotMeta>) -> csi::Snapshot {
        let (secs, nanos, source) = match meta {
            Some(m) => (m.created_secs, m.created_nanos, m.source_volume_id),
            None => (0, 0, String::new()),
        };
        csi::Snapshot {
            size_bytes: bdev_size(b) as i64,
            snapshot_id: id.alias(),
            source_volume_id: source,
            creation_time: Some(prost_types::Timestamp {
                seconds: secs,
                nanos,
            }),
            ready_to_use: true,
            group_snapshot_id: String::new(),
        }
    }

    async fn create_snapshot(&self, r: csi::CreateSnapshotRequest) -> Result<csi::Snapshot> {
        if r.source_volume_id.is_empty() {
            return Err(CsiError::InvalidArgument(
                "source_volume_id is required".into(),
            ));
        }
        if r.name.is_empty() {
            return Err(CsiError::InvalidArgument("name is required".into()));
        }
        let src = require_id(&r.source_volume_id, "source volume")?;
        let sid = LvolId::new(&src.lvs, &lvol_name_for(&r.name, "snap"))?;
        let _g = self.d.locks.lock(&sid.alias()).await;
        if let Some(b) = self.d.lvol(&sid).await? {
            let meta = self.d.state.snapshots.get(&sid.alias());
            let same_source = meta
                .as_ref()
                .is_none_or(|m| m.source_volume_id == src.alias());
            if !is_snapshot(&b) || !same_source {
                return Err(CsiError::AlreadyExists(format!(
                    "snapshot name {:?} is taken by another object",
                    r.name
                )));
            }
            return Ok(self.to_snapshot(&b, &sid, meta));
        }
        let _s = self.d.locks.lock(&src.alias()).await;
        self.d
            .lvol(&src)
            .await?
            .filter(|b| !is_snapshot(b))
            .ok_or_else(|| CsiError::NotFound(format!("source volume {src} does not exist")))?;
        self.d
            .rpc
            .bdev_lvol_snapshot(&src.alias(), &sid.lvol)
            .await
            .map_err(CsiError::rpc("bdev_lvol_snapshot"))?;
        let (created_secs, created_nanos) = now();
        let meta = SnapshotMeta {
            source_volume_id: src.alias(),
            created_secs,
            created_nanos,
        };
        self.d.state.snapshots.insert(&sid.alias(), meta.clone())?;
        let b = self
            .d
            .lvol(&sid)
            .await?
            .ok_or_else(|| CsiError::Internal(format!("snapshot {sid} vanished")))?;
        Ok(self.to_snapshot(&b, &sid, Some(meta)))
    }

    async fn delete_snapshot(&self, r: csi::DeleteSnapshotRequest) -> Result<()> {
        if r.snapshot_id.is_empty() {
            return Err(CsiError::InvalidArgument("snapshot_id is required".into()));
        }
        let Some(sid) = LvolId::parse(&r.snapshot_id) else {
            return Ok(());
        };
        let _g = self.d.locks.lock(&sid.alias()).await;
        let Some(b) = self.d.lvol(&sid).await?.filter(is_snapshot) else {
            self.d.state.snapshots.remove(&sid.alias())?;
            return Ok(());
        };
        let clones = b
            .driver_specific
            .lvol
            .as_ref()
            .and_then(|l| l.clones.clone())
            .unwrap_or_default();
        // SPDK merges a snapshot into its only clone; with more clones, decouple all but one.
        // Snapshots cannot be decoupled (read-only), so the one kept is a snapshot if any.
        let mut ordered = Vec::with_capacity(clones.len());
        for c in &clones {
            let cid = LvolId::new(&sid.lvs, c)?;
            let snap = self.d.lvol(&cid).await?.is_some_and(|b| is_snapshot(&b));
            ordered.push((!snap, cid));
        }
        ordered.sort();
        if ordered.iter().filter(|(writable, _)| !writable).count() > 1 {
            return Err(CsiError::FailedPrecondition(format!(
                "snapshot {sid} has several snapshots based on it; delete those first"
            )));
        }
        for (_, cid) in ordered.iter().skip(1) {
            self.d
                .rpc
                .bdev_lvol_decouple_parent(&cid.alias())
                .await
                .map_err(|e| {
                    CsiError::FailedPrecondition(format!(
                        "snapshot {sid} has {} dependent volumes and {cid} could not be \
                         decoupled: {e}",
                        clones.len()
                    ))
                })?;
        }
        match self.d.rpc.bdev_lvol_delete(&sid.alias()).await {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(CsiError::rpc("bdev_lvol_delete")(e)),
        }
        self.d.state.snapshots.remove(&sid.alias())
    }

    async fn list_snapshots(
        &self,
        r: csi::ListSnapshotsRequest,
    ) -> Result<csi::ListSnapshotsResponse> {
        let metas = self.d.state.snapshots.all();
        let snaps: Vec<(BdevInfo, LvolId)> = self
            .lvol_bdevs()
            .await?
            .into_iter()
            .filter(is_snapshot)
            .filter_map(|b| {
                let id = LvolId::parse(bdev_alias(&b)?)?;
                Some((b, id))
            })
            .filter(|(_, id)| r.snapshot_id.is_empty() || id.alias() == r.snapshot_id)
            .filter(|(_, id)| {
                r.source_volume_id.is_empty()
                    || metas
                        .get(&id.alias())
                        .is_some_and(|m| m.source_volume_id == r.source_volume_id)
            })
            .collect();
        let (page, next_token) = paginate(snaps, r.max_entries, &r.starting_token)?;
        let entries = page
            .into_iter()
            .map(|(b, id)| csi::list_snapshots_response::Entry {
                snapshot: Some(self.to_snapshot(&b, &id, metas.get(&id.alias()).cloned())),
            })
            .collect();
        Ok(csi::ListSnapshotsResponse {
            entries,
            next_token,
        })
    }

    async fn get_capacity(&self, r: csi::GetCapacityRequest) -> Result<csi::GetCapacityResponse> {
        let zero = csi::GetCapacityResponse {
            available_capacity: 0,
            maximum_volume_size: Some(0),
            minimum_volume_size: None,
        };
        if let Some(t) = &r.accessible_topology {
            if t.segments.get(TOPOLOGY_KEY) != Some(&self.d.cfg.node_id) {
                return Ok(zero);
            }
        }
        if r.volume_capabilities
            .iter()
            .any(|c| unsupported_capability(c).is_some())
        {
            return Ok(zero);
        }
        let lvs = r
            .parameters
            .get(params::LVS)
            .cloned()
            .or_else(|| self.d.cfg.lvs.clone());
        let stores = self.d.lvstores().await?;
        let chosen: Vec<_> = stores
            .iter()
            .filter(|s| lvs.as_ref().is_none_or(|l| &s.name == l))
            .collect();
        let free = |s: &&katablk_rpc::methods::LvstoreInfo| s.free_clusters * s.cluster_size;
        let total: u64 = chosen.iter().map(free).sum();
        let max = chosen.iter().map(free).max().unwrap_or(0);
        Ok(csi::GetCapacityResponse {
            available_capacity: total as i64,
            maximum_volume_size: Some(max as i64),
            minimum_volume_size: chosen.iter().map(|s| s.cluster_size.max(MIB) as i64).min(),
        })
    }

    async fn expand(
        &self,
        r: csi::ControllerExpandVolumeRequest,
    ) -> Result<csi::ControllerExpandVolumeResponse> {
        if r.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        let range = r
            .capacity_range
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("capacity_range is required".into()))?;
        let id = require_id(&r.volume_id, "volume")?;
        let _g = self.d.locks.lock(&id.alias()).await;
        let b = self
            .d
            .lvol(&id)
            .await?
            .filter(|b| !is_snapshot(b))
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        let cluster = self.cluster_size(&id.lvs).await?;
        let want = volume_size(Some(range), cluster)?;
        let mut size = bdev_size(&b);
        if want > size {
            self.resize_to(&id.alias(), want).await.map_err(|e| {
                if e.code() == tonic::Code::ResourceExhausted {
                    CsiError::ResourceExhausted(format!("no space to grow {id} to {want}: {e}"))
                } else {
                    e
                }
            })?;
            size = self.d.lvol(&id).await?.map_or(want, |b| bdev_size(&b));
        }
        let fs = matches!(
            r.volume_capability
                .as_ref()
                .and_then(|c| c.access_type.as_ref()),
            Some(vc::AccessType::Mount(_))
        );
        Ok(csi::ControllerExpandVolumeResponse {
            capacity_bytes: size as i64,
            node_expansion_required: fs,
        })
    }

    async fn validate(
        &self,
        r: csi::ValidateVolumeCapabilitiesRequest,
    ) -> Result<csi::ValidateVolumeCapabilitiesResponse> {
        if r.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if r.volume_capabilities.is_empty() {
            return Err(CsiError::InvalidArgument(
                "volume_capabilities are required".into(),
            ));
        }
        let id = require_id(&r.volume_id, "volume")?;
        self.d
            .lvol(&id)
            .await?
            .filter(|b| !is_snapshot(b))
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        let why: Vec<String> = r
            .volume_capabilities
            .iter()
            .filter_map(unsupported_capability)
            .collect();
        if !why.is_empty() {
            return Ok(csi::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: why.join("; "),
            });
        }
        Ok(csi::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                volume_context: r.volume_context,
                volume_capabilities: r.volume_capabilities,
                parameters: r.parameters,
                mutable_parameters: r.mutable_parameters,
            }),
            message: String::new(),
        })
    }
}

fn rpc_cap(t: csc::rpc::Type) -> csi::ControllerServiceCapability {
    csi::ControllerServiceCapability {
        r#type: Some(csc::Type::Rpc(csc::Rpc { r#type: t as i32 })),
    }
}

#[tonic::async_trait]
impl csi::controller_server::Controller for ControllerService {
    async fn create_volume(
        &self,
        req: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let name = r.name.clone();
        let res = ControllerService::create_volume(self, r)
            .await
            .map(|v| csi::CreateVolumeResponse { volume: Some(v) });
        let vid = res
            .as_ref()
            .ok()
            .and_then(|v| v.volume.as_ref())
            .map_or(name, |v| v.volume_id.clone());
        self.d.finish("CreateVolume", &vid, t0, res)
    }

    async fn delete_volume(
        &self,
        req: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.volume_id.clone();
        let res = ControllerService::delete_volume(self, r).await;
        self.d.finish("DeleteVolume", &vid, t0, res)
    }

    async fn controller_publish_volume(
        &self,
        req: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let t0 = Instant::now();
        let vid = req.into_inner().volume_id;
        let res = Err(CsiError::Unimplemented(
            "ControllerPublishVolume: volumes are node-local, published by the node plugin".into(),
        ));
        self.d.finish("ControllerPublishVolume", &vid, t0, res)
    }

    async fn controller_unpublish_volume(
        &self,
        req: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let t0 = Instant::now();
        let vid = req.into_inner().volume_id;
        let res = Err(CsiError::Unimplemented(
            "ControllerUnpublishVolume: volumes are node-local".into(),
        ));
        self.d.finish("ControllerUnpublishVolume", &vid, t0, res)
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.volume_id.clone();
        let res = self.validate(r).await;
        self.d.finish("ValidateVolumeCapabilities", &vid, t0, res)
    }

    async fn list_volumes(
        &self,
        req: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        let t0 = Instant::now();
        let res = ControllerService::list_volumes(self, req.into_inner()).await;
        self.d.finish("ListVolumes", "", t0, res)
    }

    async fn get_capacity(
        &self,
        req: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        let t0 = Instant::now();
        let res = ControllerService::get_capacity(self, req.into_inner()).await;
        self.d.finish("GetCapacity", "", t0, res)
    }

    async fn controller_get_capabilities(
        &self,
        _req: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csc::rpc::Type;
        let t0 = Instant::now();
        let capabilities = [
            Type::CreateDeleteVolume,
            Type::ListVolumes,
            Type::GetCapacity,
            Type::CreateDeleteSnapshot,
            Type::ListSnapshots,
            Type::CloneVolume,
            Type::ExpandVolume,
            Type::ModifyVolume,
        ]
        .into_iter()
        .map(rpc_cap)
        .collect();
        let res = Ok(csi::ControllerGetCapabilitiesResponse { capabilities });
        self.d.finish("ControllerGetCapabilities", "", t0, res)
    }

    async fn create_snapshot(
        &self,
        req: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.source_volume_id.clone();
        let res = ControllerService::create_snapshot(self, r)
            .await
            .map(|s| csi::CreateSnapshotResponse { snapshot: Some(s) });
        self.d.finish("CreateSnapshot", &vid, t0, res)
    }

    async fn delete_snapshot(
        &self,
        req: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let sid = r.snapshot_id.clone();
        let res = ControllerService::delete_snapshot(self, r)
            .await
            .map(|()| csi::DeleteSnapshotResponse {});
        self.d.finish("DeleteSnapshot", &sid, t0, res)
    }

    async fn list_snapshots(
        &self,
        req: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.source_volume_id.clone();
        let res = ControllerService::list_snapshots(self, r).await;
        self.d.finish("ListSnapshots", &vid, t0, res)
    }

    async fn controller_expand_volume(
        &self,
        req: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.volume_id.clone();
        let res = self.expand(r).await;
        self.d.finish("ControllerExpandVolume", &vid, t0, res)
    }

    async fn controller_modify_volume(
        &self,
        req: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        let t0 = Instant::now();
        let r = req.into_inner();
        let vid = r.volume_id.clone();
        let res = self
            .modify_volume(r)
            .await
            .map(|()| csi::ControllerModifyVolumeResponse {});
        self.d.finish("ControllerModifyVolume", &vid, t0, res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let c = 4 << 20;
        let r = |req, lim| csi::CapacityRange {
            required_bytes: req,
            limit_bytes: lim,
        };
        assert_eq!(volume_size(None, c).unwrap(), 4 << 20);
        assert_eq!(volume_size(Some(&r(1, 0)), c).unwrap(), 4 << 20);
        assert_eq!(volume_size(Some(&r(5 << 20, 0)), c).unwrap(), 8 << 20);
        assert_eq!(
            volume_size(Some(&r(5 << 20, 6 << 20)), c)
                .unwrap_err()
                .code(),
            tonic::Code::OutOfRange
        );
        assert_eq!(volume_size(Some(&r(0, 9 << 20)), c).unwrap(), 4 << 20);
        assert_eq!(
            volume_size(Some(&r(10, 5)), c).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            volume_size(Some(&r(-1, 0)), c).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        assert!(fits(8 << 20, Some(&r(5 << 20, 0))));
        assert!(!fits(8 << 20, Some(&r(9 << 20, 0))));
    }

    #[test]
    fn pagination() {
        let v: Vec<i32> = (0..5).collect();
        assert_eq!(
            paginate(v.clone(), 2, "").unwrap(),
            (vec![0, 1], "2".into())
        );
        assert_eq!(
            paginate(v.clone(), 2, "4").unwrap(),
            (vec![4], String::new())
        );
        assert_eq!(paginate(v.clone(), 0, "").unwrap().0.len(), 5);
        assert_eq!(
            paginate(v.clone(), 1, "x").unwrap_err().code(),
            tonic::Code::Aborted
        );
        assert_eq!(
            paginate(v.clone(), 1, "9").unwrap_err().code(),
            tonic::Code::Aborted
        );
        assert_eq!(
            paginate(v, -1, "").unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }
}
