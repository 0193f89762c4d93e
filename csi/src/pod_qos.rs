//! Per-pod rate limits. Every volume a pod mounts whose StorageClass sets `pod*` limits
//! ([`params::POD_QOS`]) is a member of one QoS group on the target, `pod-<pod uid>`
//! (katablk-target's `katablk_set_qos_group`), whose limits are the strictest of its members'.
//! The pod UID comes from kubelet on NodePublishVolume (`csi.storage.k8s.io/pod.uid`, sent
//! when the CSIDriver object has `podInfoOnMount: true`).
//!
//! The publication records are the truth: [`sync`] makes the target's group match them (its
//! members, its limits, or its deletion when the last member leaves), so a publish, an
//! unpublish, a retry of either and reconciliation after a target restart all do the same.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use katablk_rpc::error::codes::METHOD_NOT_FOUND;
use katablk_rpc::methods::{
    KatablkDeleteQosGroup, KatablkDeleteQosGroupParams, KatablkGetQosGroups, KatablkSetQosGroup,
    KatablkSetQosGroupParams, NoParams,
};
use katablk_rpc::RpcError;

use crate::class::{params, QosParams};
use crate::driver::Driver;
use crate::error::{CsiError, Result};

/// Prefix of the target QoS groups this driver owns.
pub const GROUP_PREFIX: &str = "pod-";

/// The pod group and per-pod limits of a publication with volume context `ctx`: `None` when
/// the volume's class sets no per-pod limits.
pub fn group_for(ctx: &HashMap<String, String>) -> Result<Option<(String, QosParams)>> {
    let q = QosParams::parse_pod(ctx)?;
    if !q.any() {
        return Ok(None);
    }
    let uid = ctx.get(params::POD_UID).ok_or_else(|| {
        CsiError::FailedPrecondition(format!(
            "the volume's StorageClass sets per-pod limits ({}) but kubelet passed no {}: set \
             podInfoOnMount: true in the CSIDriver object",
            params::POD_QOS.join(", "),
            params::POD_UID
        ))
    })?;
    if !valid_uid(uid) {
        return Err(CsiError::InvalidArgument(format!(
            "{} {} is not a pod UID",
            params::POD_UID,
            crate::volume::shown(uid)
        )));
    }
    Ok(Some((
        format!("{GROUP_PREFIX}{}", uid.to_ascii_lowercase()),
        q,
    )))
}

/// A Kubernetes UID: a UUID in practice; anything of 1–64 ASCII letters, digits and dashes is
/// taken (it becomes part of a target object name).
fn valid_uid(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// What the target answered, as a CSI error; a target without katablk's group methods (SPDK's
/// vhost app) is a precondition the class cannot meet.
fn rpc_err(op: &'static str) -> impl FnOnce(RpcError) -> CsiError {
    move |e| {
        if e.code() == Some(METHOD_NOT_FOUND) {
            CsiError::FailedPrecondition(format!(
                "the target has no {op}: per-pod limits are katablk-target's extension (SPDK's \
                 vhost app limits single bdevs only); remove the pod* parameters from the \
                 StorageClass or serve it with katablk-target"
            ))
        } else {
            CsiError::rpc(op)(e)
        }
    }
}

/// The members (volume alias → its per-pod limits) the records give group `name`, leaving out
/// volume `leaving` (an unpublish in progress).
fn members(d: &Driver, name: &str, leaving: Option<&str>) -> BTreeMap<String, QosParams> {
    d.state
        .published
        .all()
        .into_iter()
        .filter(|(a, p)| p.pod_group.as_deref() == Some(name) && Some(a.as_str()) != leaving)
        .map(|(a, p)| (a, p.pod_qos.unwrap_or_default()))
        .collect()
}

/// Makes the target's group `name` match the publication records (without volume `leaving`):
/// its members and the strictest of their limits, or no group when no member is left.
pub async fn sync(d: &Driver, name: &str, leaving: Option<&str>) -> Result<()> {
    let _g = d.pod_groups.lock().await;
    let m = members(d, name, leaving);
    if m.is_empty() {
        let p = KatablkDeleteQosGroupParams { name: name.into() };
        match d.rpc.call_method::<KatablkDeleteQosGroup>(&p).await {
            Ok(_) => tracing::info!(group = name, "pod QoS group deleted"),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(rpc_err("katablk_delete_qos_group")(e)),
        }
        return Ok(());
    }
    let lim = QosParams::strictest(m.values());
    let p = KatablkSetQosGroupParams {
        name: name.into(),
        rw_ios_per_sec: lim.rw_ios_per_sec,
        rw_mbytes_per_sec: lim.rw_mbytes_per_sec,
        r_mbytes_per_sec: lim.r_mbytes_per_sec,
        w_mbytes_per_sec: lim.w_mbytes_per_sec,
        bdevs: Some(m.keys().cloned().collect()),
    };
    d.rpc
        .call_method::<KatablkSetQosGroup>(&p)
        .await
        .map_err(rpc_err("katablk_set_qos_group"))?;
    tracing::info!(group = name, members = m.len(), limits = ?lim, "pod QoS group set");
    Ok(())
}

/// Reconciliation: every pod group the records name is made to match them where the target's
/// differs (lost in a target restart without its state, say), and `pod-` groups no record
/// names any more are deleted. Returns the groups changed.
pub async fn reconcile(d: &Driver) -> Result<Vec<String>> {
    let wanted: BTreeSet<String> = d
        .state
        .published
        .all()
        .values()
        .filter_map(|p| p.pod_group.clone())
        .collect();
    let have = match d.rpc.call_method::<KatablkGetQosGroups>(&NoParams {}).await {
        Ok(h) => h,
        // SPDK's vhost app: no groups to reconcile unless a record wants one.
        Err(e) if e.code() == Some(METHOD_NOT_FOUND) && wanted.is_empty() => return Ok(vec![]),
        Err(e) => return Err(rpc_err("katablk_get_qos_groups")(e)),
    };
    let mut changed = Vec::new();
    for name in &wanted {
        let m = members(d, name, None);
        let lim = QosParams::strictest(m.values());
        let same = have.iter().any(|g| {
            g.name == *name
                && g.bdevs.len() == m.len()
                && Some(g.assigned_rate_limits.rw_ios_per_sec) == lim.rw_ios_per_sec
                && Some(g.assigned_rate_limits.rw_mbytes_per_sec) == lim.rw_mbytes_per_sec
                && Some(g.assigned_rate_limits.r_mbytes_per_sec) == lim.r_mbytes_per_sec
                && Some(g.assigned_rate_limits.w_mbytes_per_sec) == lim.w_mbytes_per_sec
        });
        if !same {
            sync(d, name, None).await?;
            changed.push(name.clone());
        }
    }
    for g in have
        .iter()
        .filter(|g| g.name.starts_with(GROUP_PREFIX) && !wanted.contains(&g.name))
    {
        sync(d, &g.name, None).await?;
        changed.push(g.name.clone());
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn no_pod_limits_no_group() {
        assert_eq!(group_for(&ctx(&[(params::POD_UID, "u")])).unwrap(), None);
    }

    #[test]
    fn group_named_after_the_pod() {
        let (g, q) = group_for(&ctx(&[
            (params::POD_RW_IOS_PER_SEC, "2000"),
            (params::POD_UID, "0A1b-2c"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(g, "pod-0a1b-2c");
        assert_eq!(q.rw_ios_per_sec, Some(2000));
    }

    #[test]
    fn pod_limits_without_pod_info_are_refused() {
        let e = group_for(&ctx(&[(params::POD_RW_MBYTES_PER_SEC, "10")])).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.to_string().contains("podInfoOnMount"), "{e}");
    }

    #[test]
    fn bad_uid_and_bad_limits_are_refused() {
        for uid in ["", "../x", "a b", &"a".repeat(65)] {
            let e = group_for(&ctx(&[
                (params::POD_RW_IOS_PER_SEC, "1000"),
                (params::POD_UID, uid),
            ]))
            .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{uid:?}");
        }
        let e = group_for(&ctx(&[
            (params::POD_RW_IOS_PER_SEC, "1500"),
            (params::POD_UID, "u"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("multiple of 1000"), "{e}");
    }

    #[test]
    fn strictest_takes_the_smallest_limit_per_field() {
        let a = QosParams {
            rw_ios_per_sec: Some(5000),
            rw_mbytes_per_sec: Some(0),
            ..Default::default()
        };
        let b = QosParams {
            rw_ios_per_sec: Some(3000),
            w_mbytes_per_sec: Some(20),
            ..Default::default()
        };
        let want = QosParams {
            rw_ios_per_sec: Some(3000),
            rw_mbytes_per_sec: Some(0),
            r_mbytes_per_sec: Some(0),
            w_mbytes_per_sec: Some(20),
        };
        assert_eq!(QosParams::strictest([&a, &b]), want);
        assert_eq!(QosParams::strictest([&b, &a]), want);
        assert!(!QosParams::strictest(std::iter::empty()).limits_anything());
    }
}
