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
