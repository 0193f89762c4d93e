//! katablk-target's own methods, beyond SPDK's (prefixed `katablk_`; SPDK does not have them,
//! so they are not in [`super::METHOD_NAMES`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{method, NoParams};

/// A saved-configuration entry katablk-target could not restore (say, an aio bdev whose
/// file is missing at start). It stays in the saved configuration and is retried; see
/// `katablk_get_unrestored`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnrestoredEntry {
    /// Subsystem of the entry: `"bdev"` or `"vhost_blk"`.
    pub subsystem: String,
    /// The bdev or controller name the entry creates (empty if the params have none).
    pub name: String,
    /// The saved call's method, e.g. `bdev_aio_create`.
    pub method: String,
    /// The saved call's params.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Value>,
    /// Why the last attempt failed.
    pub error: String,
    /// When it first failed, in seconds since the Unix epoch.
    pub since: u64,
    /// Attempts so far.
    pub attempts: u64,
}

method!(
    /// `katablk_get_unrestored` → the saved configuration entries not restored (yet).
    KatablkGetUnrestored = "katablk_get_unrestored", NoParams => Vec<UnrestoredEntry>, idempotent: true
);

/// `katablk_set_qos_group` params: a rate limit shared by several bdevs (SPDK has none: its
/// `bdev_set_qos_limit` is per bdev). Creates the group if needed; limits as in
/// `bdev_set_qos_limit` (absent: kept, 0: removed); `bdevs`, if given, replaces the members.
/// A member's requests must pass its own limits and the group's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KatablkSetQosGroupParams {
    /// Group name.
    pub name: String,
    /// Read/write I/Os per second (a multiple of 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rw_ios_per_sec: Option<u64>,
    /// Read/write MiB per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rw_mbytes_per_sec: Option<u64>,
    /// Read MiB per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub r_mbytes_per_sec: Option<u64>,
    /// Write MiB per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub w_mbytes_per_sec: Option<u64>,
    /// The member bdevs (names or aliases); absent: unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bdevs: Option<Vec<String>>,
}

/// One group in `katablk_get_qos_groups`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosGroupInfo {
    /// Group name.
    pub name: String,
    /// Its limits (0 = unlimited).
    pub assigned_rate_limits: super::RateLimits,
    /// Member bdevs, by the name controllers use (base bdev name or lvol UUID).
    pub bdevs: Vec<String>,
}

/// `katablk_delete_qos_group` params.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KatablkDeleteQosGroupParams {
    /// Group name.
    pub name: String,
}

method!(
    /// `katablk_set_qos_group` → `true`.
    KatablkSetQosGroup = "katablk_set_qos_group", KatablkSetQosGroupParams => bool, idempotent: false
);

method!(
    /// `katablk_get_qos_groups` → every group.
    KatablkGetQosGroups = "katablk_get_qos_groups", NoParams => Vec<QosGroupInfo>, idempotent: true
);

method!(
    /// `katablk_delete_qos_group` → `true` (its members keep their own limits).
    KatablkDeleteQosGroup = "katablk_delete_qos_group", KatablkDeleteQosGroupParams => bool, idempotent: false
);

/// Typed calls of the katablk methods.
mod calls {
    use crate::client::RpcClient;
    use crate::error::RpcError;
    use crate::methods::*;

    impl RpcClient {
        /// `katablk_get_unrestored` (katablk-target only): saved configuration entries the
        /// target could not restore yet.
        pub async fn katablk_get_unrestored(&self) -> Result<Vec<UnrestoredEntry>, RpcError> {
            self.call_method::<KatablkGetUnrestored>(&NoParams {}).await
        }
    }
}
