//! The configuration as `framework_get_config` lists it (and as it is saved).

use katablk_rpc::methods::*;
use katablk_rpc::SpdkError;

use crate::bdevs::BaseKind;

use super::qos::to_rate_limits;
use super::Target;

impl Target {
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
}
