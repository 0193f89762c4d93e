//! Rate limits: per-bdev limits (`bdev_set_qos_limit`) and katablk's QoS groups.

use std::sync::Arc;

use katablk_bdev::qos::{Limiter, QosLimits};
use katablk_rpc::methods::*;
use katablk_rpc::SpdkError;
use tracing::info;

use crate::error::einval;
use crate::names::valid_name;

use super::{Inner, QosGroup, Target};

/// The limits of `old` with those a call gives replaced, checked as SPDK checks
/// `bdev_set_qos_limit`'s (at least one given; I/O limits in multiples of 1000).
pub(super) fn merged_limits(
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

pub(super) fn to_rate_limits(l: QosLimits) -> RateLimits {
    RateLimits {
        rw_ios_per_sec: l.rw_ios_per_sec,
        rw_mbytes_per_sec: l.rw_bytes_per_sec >> 20,
        r_mbytes_per_sec: l.r_bytes_per_sec >> 20,
        w_mbytes_per_sec: l.w_bytes_per_sec >> 20,
    }
}

impl Inner {
    /// The limiter of bdev `canonical` (made, unlimited, if it has none).
    pub(super) fn limiter(&mut self, canonical: &str) -> Arc<Limiter> {
        self.qos.entry(canonical.to_string()).or_default().clone()
    }

    /// `assigned_rate_limits` of bdev `canonical`, in SPDK's units.
    pub(super) fn rate_limits(&self, canonical: &str) -> RateLimits {
        to_rate_limits(
            self.qos
                .get(canonical)
                .map(|l| l.limits())
                .unwrap_or_default(),
        )
    }

    /// Gives bdev `canonical`'s limiter the groups that list it.
    pub(super) fn regroup(&mut self, canonical: &str) {
        let groups: Vec<Arc<Limiter>> = self
            .qos_groups
            .values()
            .filter(|g| g.members.iter().any(|m| m == canonical))
            .map(|g| g.limiter.clone())
            .collect();
        self.limiter(canonical).set_groups(groups);
    }

    /// Forgets a deleted bdev's limits and group memberships.
    pub(super) fn forget_qos(&mut self, canonical: &str) {
        self.qos.remove(canonical);
        for g in self.qos_groups.values_mut() {
            g.members.retain(|m| m != canonical);
        }
    }
}

impl Target {
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
}
