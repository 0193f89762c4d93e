//! Block device methods: listing, iostat, examine, and the aio/malloc/null bdev modules.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{method, NoParams};

/// Params of `bdev_get_bdevs`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevGetBdevsParams {
    /// Name, alias or UUID of one bdev; all bdevs when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Milliseconds to wait for `name` to appear (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
}

/// `assigned_rate_limits` of a bdev (0 = unlimited).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimits {
    /// Read/write I/Os per second.
    pub rw_ios_per_sec: u64,
    /// Read/write MiB per second.
    pub rw_mbytes_per_sec: u64,
    /// Read MiB per second.
    pub r_mbytes_per_sec: u64,
    /// Write MiB per second.
    pub w_mbytes_per_sec: u64,
}

/// `supported_io_types` of a bdev. Missing members (older SPDK) read as `false`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct SupportedIoTypes {
    pub read: bool,
    pub write: bool,
    pub unmap: bool,
    pub flush: bool,
    pub reset: bool,
    pub nvme_admin: bool,
    pub nvme_io: bool,
    pub nvme_io_md: bool,
    pub write_zeroes: bool,
    pub zcopy: bool,
    pub get_zone_info: bool,
    pub zone_management: bool,
    pub zone_append: bool,
    pub compare: bool,
    pub compare_and_write: bool,
    pub abort: bool,
    pub seek_hole: bool,
    pub seek_data: bool,
    pub copy: bool,
    pub nvme_iov_md: bool,
    pub nvme_nssr: bool,
    pub write_uncorrectable: bool,
    /// I/O types this struct does not name.
    #[serde(flatten)]
    pub extra: BTreeMap<String, bool>,
}

/// `driver_specific.lvol` of a logical volume bdev.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LvolDriverSpecific {
    /// UUID of the lvstore holding the lvol.
    pub lvol_store_uuid: String,
    /// Name of the lvstore's base bdev.
    pub base_bdev: String,
    /// Thin provisioned.
    pub thin_provision: bool,
    /// Clusters allocated to this lvol.
    pub num_allocated_clusters: u64,
    /// Is a snapshot.
    pub snapshot: bool,
    /// Is a clone of a snapshot.
    pub clone: bool,
    /// For clones: the snapshot's lvol name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_snapshot: Option<String>,
    /// For snapshots: lvol names of its clones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clones: Option<Vec<String>>,
    /// Is a clone of an external (non-lvol) snapshot.
    pub esnap_clone: bool,
    /// For esnap clones: the external snapshot bdev.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_snapshot_name: Option<String>,
}

/// `driver_specific.aio` of an AIO bdev.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AioDriverSpecific {
    /// Backing file or block device.
    pub filename: String,
    /// Whether `block_size` was given explicitly.
    pub block_size_override: bool,
    /// Opened read-only.
    pub readonly: bool,
    /// Uses fallocate for unmap/write-zeroes.
    pub fallocate: bool,
    /// Uses `RWF_NOWAIT`.
    pub nowait: bool,
}

/// `driver_specific` of a bdev: one member per module (empty `{}` for malloc/null).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DriverSpecific {
    /// Logical volume info.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lvol: Option<LvolDriverSpecific>,
    /// AIO info.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aio: Option<AioDriverSpecific>,
    /// Other modules' members, kept as JSON.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One entry of `bdev_get_bdevs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BdevInfo {
    /// Bdev name (the UUID, for lvols).
    pub name: String,
    /// Aliases (`"lvs/lvol"` for lvols; the UUID for others).
    pub aliases: Vec<String>,
    /// Module's product name: `"Malloc disk"`, `"Null disk"`, `"AIO disk"`, `"Logical Volume"`.
    pub product_name: String,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Number of blocks.
    pub num_blocks: u64,
    /// Preferred write alignment, in blocks.
    #[serde(default)]
    pub preferred_write_alignment: u64,
    /// Preferred write granularity, in blocks.
    #[serde(default)]
    pub preferred_write_granularity: u64,
    /// Optimal write size, in blocks.
    #[serde(default)]
    pub optimal_write_size: u64,
    /// Preferred unmap alignment, in blocks.
    #[serde(default)]
    pub preferred_unmap_alignment: u64,
    /// Preferred unmap granularity, in blocks.
    #[serde(default)]
    pub preferred_unmap_granularity: u64,
    /// Bdev UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// NUMA node (malloc reports -1 = any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_id: Option<i32>,
    /// QoS limits.
    pub assigned_rate_limits: RateLimits,
    /// Claimed by a module (e.g. an lvstore on it).
    pub claimed: bool,
    /// How it is claimed, when claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_type: Option<String>,
    /// Zoned device.
    pub zoned: bool,
    /// Supported I/O types.
    pub supported_io_types: SupportedIoTypes,
    /// Module-specific info.
    pub driver_specific: DriverSpecific,
    /// Members not modelled here (`md_size`, `dif_type`, `memory_domains`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

method!(
    /// `bdev_get_bdevs` → bdevs; `-19 No such device` for an unknown `name`.
    BdevGetBdevs = "bdev_get_bdevs", BdevGetBdevsParams => Vec<BdevInfo>, idempotent: true
);

/// Params of `bdev_get_iostat`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevGetIostatParams {
    /// One bdev (older SPDK spelling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Several bdevs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub names: Option<Vec<String>>,
    /// Per-channel statistics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_channel: Option<bool>,
    /// Reset after reading: `all`, `maxmin`, `error` or `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_mode: Option<String>,
}

/// Statistics of one bdev in `bdev_get_iostat`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct BdevIostat {
    pub name: String,
    pub bytes_read: u64,
    pub num_read_ops: u64,
    pub bytes_written: u64,
    pub num_write_ops: u64,
    pub bytes_unmapped: u64,
    pub num_unmap_ops: u64,
    pub bytes_copied: u64,
    pub num_copy_ops: u64,
    pub read_latency_ticks: u64,
    pub max_read_latency_ticks: u64,
    pub min_read_latency_ticks: u64,
    pub write_latency_ticks: u64,
    pub max_write_latency_ticks: u64,
    pub min_write_latency_ticks: u64,
    pub unmap_latency_ticks: u64,
    pub max_unmap_latency_ticks: u64,
    pub min_unmap_latency_ticks: u64,
    pub copy_latency_ticks: u64,
    pub max_copy_latency_ticks: u64,
    pub min_copy_latency_ticks: u64,
    /// Error counters by status name.
    pub io_error: Map<String, Value>,
    /// katablk-target's extension: requests of this bdev that waited for its rate limits
    /// (`bdev_set_qos_limit`, `katablk_set_qos_group`). SPDK does not report it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub katablk_qos_throttled_requests: Option<u64>,
    /// katablk-target's extension: time this bdev's queues spent holding requests back for its
    /// rate limits, in nanoseconds (summed over queues).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub katablk_qos_throttled_ns: Option<u64>,
    /// Members not modelled here (per-channel data, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Result of `bdev_get_iostat`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IostatResult {
    /// Ticks per second.
    pub tick_rate: u64,
    /// Current tick count.
    pub ticks: u64,
    /// One entry per bdev.
    pub bdevs: Vec<BdevIostat>,
}

method!(
    /// `bdev_get_iostat` → [`IostatResult`].
    BdevGetIostat = "bdev_get_iostat", BdevGetIostatParams => IostatResult, idempotent: true
);

method!(
    /// `bdev_wait_for_examine` → `true` once all bdevs are examined.
    BdevWaitForExamine = "bdev_wait_for_examine", NoParams => bool, idempotent: true
);

/// Params of `bdev_aio_create`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevAioCreateParams {
    /// Path to the file or block device.
    pub filename: String,
    /// Bdev name.
    pub name: String,
    /// Block size (SPDK requires it for regular files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Open read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
    /// Use fallocate for unmap/write-zeroes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallocate: Option<bool>,
    /// Bdev UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Use `RWF_NOWAIT` (block devices only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nowait: Option<bool>,
}

method!(
    /// `bdev_aio_create` → bdev name.
    BdevAioCreate = "bdev_aio_create", BdevAioCreateParams => String, idempotent: false
);

/// Params of the `bdev_*_delete` methods: `{"name": ...}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevDeleteParams {
    /// Bdev name.
    pub name: String,
}

method!(
    /// `bdev_aio_delete` → `true`.
    BdevAioDelete = "bdev_aio_delete", BdevDeleteParams => bool, idempotent: false
);

/// Params of `bdev_malloc_create`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevMallocCreateParams {
    /// Number of blocks.
    pub num_blocks: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// Physical block size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_block_size: Option<u32>,
    /// Bdev name (SPDK picks `MallocN` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Bdev UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Split I/O on this boundary (blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimal_io_boundary: Option<u32>,
    /// Metadata size per block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub md_size: Option<u32>,
    /// Metadata interleaved with data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub md_interleave: Option<bool>,
    /// Protection information type (0-3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dif_type: Option<u32>,
    /// PI in the first 8 bytes of metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dif_is_head_of_md: Option<bool>,
    /// PI format (0-2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dif_pi_format: Option<u32>,
    /// NUMA node (-1 = any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_id: Option<i32>,
}

method!(
    /// `bdev_malloc_create` → bdev name.
    BdevMallocCreate = "bdev_malloc_create", BdevMallocCreateParams => String, idempotent: false
);

method!(
    /// `bdev_malloc_delete` → `true`.
    BdevMallocDelete = "bdev_malloc_delete", BdevDeleteParams => bool, idempotent: false
);

/// Params of `bdev_null_create`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevNullCreateParams {
    /// Bdev name.
    pub name: String,
    /// Number of blocks.
    pub num_blocks: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// Physical block size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_block_size: Option<u32>,
    /// Bdev UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Metadata size per block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub md_size: Option<u32>,
    /// Protection information type (0-3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dif_type: Option<u32>,
    /// PI in the first 8 bytes of metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dif_is_head_of_md: Option<bool>,
    /// PI format (0-2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dif_pi_format: Option<u32>,
    /// Preferred write alignment, in blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_write_alignment: Option<u32>,
    /// Preferred write granularity, in blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_write_granularity: Option<u32>,
    /// Optimal write size, in blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimal_write_size: Option<u32>,
    /// Preferred unmap alignment, in blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_unmap_alignment: Option<u32>,
    /// Preferred unmap granularity, in blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_unmap_granularity: Option<u32>,
}

method!(
    /// `bdev_null_create` → bdev name.
    BdevNullCreate = "bdev_null_create", BdevNullCreateParams => String, idempotent: false
);

method!(
    /// `bdev_null_delete` → `true`.
    BdevNullDelete = "bdev_null_delete", BdevDeleteParams => bool, idempotent: false
);

/// `bdev_set_qos_limit` params: SPDK's names and units. An absent limit is left as it is; 0
/// removes it. SPDK requires I/O limits in multiples of 1000 and byte limits in whole MiB (of
/// at least 1), and at least one limit in the call.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BdevSetQosLimitParams {
    /// The bdev (name or alias).
    pub name: String,
    /// Read/write I/Os per second.
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
}

method!(
    /// `bdev_set_qos_limit` → `true`.
    BdevSetQosLimit = "bdev_set_qos_limit", BdevSetQosLimitParams => bool, idempotent: false
);

/// Typed calls of the bdev methods.
mod calls {
    use crate::client::RpcClient;
    use crate::error::RpcError;
    use crate::methods::*;

    impl RpcClient {
        /// `bdev_get_bdevs`: all bdevs, or the one named (`-19` if missing).
        pub async fn bdev_get_bdevs(&self, name: Option<&str>) -> Result<Vec<BdevInfo>, RpcError> {
            self.call_method::<BdevGetBdevs>(&BdevGetBdevsParams {
                name: name.map(str::to_owned),
                timeout: None,
            })
            .await
        }

        /// One bdev by name, alias or UUID; `Ok(None)` if it does not exist.
        pub async fn bdev_get_bdev(&self, name: &str) -> Result<Option<BdevInfo>, RpcError> {
            match self.bdev_get_bdevs(Some(name)).await {
                Ok(v) => Ok(v.into_iter().next()),
                Err(e) if e.is_not_found() => Ok(None),
                Err(e) => Err(e),
            }
        }

        /// `bdev_get_iostat`.
        pub async fn bdev_get_iostat(
            &self,
            params: &BdevGetIostatParams,
        ) -> Result<IostatResult, RpcError> {
            self.call_method::<BdevGetIostat>(params).await
        }

        /// `bdev_wait_for_examine`.
        pub async fn bdev_wait_for_examine(&self) -> Result<bool, RpcError> {
            self.call_method::<BdevWaitForExamine>(&NoParams {}).await
        }

        /// `bdev_aio_create` → bdev name.
        pub async fn bdev_aio_create(
            &self,
            params: &BdevAioCreateParams,
        ) -> Result<String, RpcError> {
            self.call_method::<BdevAioCreate>(params).await
        }

        /// `bdev_aio_delete`.
        pub async fn bdev_aio_delete(&self, name: &str) -> Result<bool, RpcError> {
            self.call_method::<BdevAioDelete>(&BdevDeleteParams {
                name: name.to_owned(),
            })
            .await
        }

        /// `bdev_malloc_create` → bdev name.
        pub async fn bdev_malloc_create(
            &self,
            params: &BdevMallocCreateParams,
        ) -> Result<String, RpcError> {
            self.call_method::<BdevMallocCreate>(params).await
        }

        /// `bdev_malloc_delete`.
        pub async fn bdev_malloc_delete(&self, name: &str) -> Result<bool, RpcError> {
            self.call_method::<BdevMallocDelete>(&BdevDeleteParams {
                name: name.to_owned(),
            })
            .await
        }

        /// `bdev_null_create` → bdev name.
        pub async fn bdev_null_create(
            &self,
            params: &BdevNullCreateParams,
        ) -> Result<String, RpcError> {
            self.call_method::<BdevNullCreate>(params).await
        }

        /// `bdev_null_delete`.
        pub async fn bdev_null_delete(&self, name: &str) -> Result<bool, RpcError> {
            self.call_method::<BdevNullDelete>(&BdevDeleteParams {
                name: name.to_owned(),
            })
            .await
        }
    }
}
