//! vhost controller methods (`vhost_*`).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::method;

/// Params of `vhost_create_blk_controller`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostCreateBlkControllerParams {
    /// Controller name; the socket is `<socket dir>/<ctrlr>`.
    pub ctrlr: String,
    /// Bdev to expose (name, UUID or alias).
    pub dev_name: String,
    /// CPU mask for the controller's threads, e.g. `"0x1"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpumask: Option<String>,
    /// Expose read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
    /// Offer packed virtqueues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packed_ring: Option<bool>,
    /// virtio-blk transport (default `vhost_user_blk`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
}

method!(
    /// `vhost_create_blk_controller` → `true`; `-32602 No such device` if the bdev is missing.
    VhostCreateBlkController = "vhost_create_blk_controller", VhostCreateBlkControllerParams => bool, idempotent: false
);

/// Params of `vhost_delete_controller`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostDeleteControllerParams {
    /// Controller name.
    pub ctrlr: String,
}

method!(
    /// `vhost_delete_controller` → `true`; `-32602 No such device` if it does not exist.
    VhostDeleteController = "vhost_delete_controller", VhostDeleteControllerParams => bool, idempotent: false
);

/// Params of `vhost_get_controllers`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostGetControllersParams {
    /// Only this controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// One connected vhost-user session of a controller.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VhostSession {
    /// vhost device id.
    pub vid: i64,
    /// Session id within the controller.
    pub id: u64,
    /// Session name (`<ctrlr>s<id>`).
    pub name: String,
    /// Started (queues running).
    pub started: bool,
    /// Number of queues.
    pub max_queues: u32,
    /// In-flight tasks.
    pub inflight_task_cnt: u64,
    /// Members not modelled here.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `backend_specific.block` of a vhost-blk controller.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlkBackend {
    /// Exposed read-only.
    pub readonly: bool,
    /// Bdev name; `null` once the bdev went away (always serialized).
    pub bdev: Option<String>,
    /// Transport name, e.g. `vhost_user_blk`.
    pub transport: String,
}

/// `backend_specific` of a controller.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BackendSpecific {
    /// For vhost-blk controllers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<BlkBackend>,
    /// Other backends (`scsi`), kept as JSON.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One entry of `vhost_get_controllers`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VhostController {
    /// Controller name.
    pub ctrlr: String,
    /// CPU mask, e.g. `"0x1"`.
    pub cpumask: String,
    /// Interrupt coalescing base delay.
    pub delay_base_us: u32,
    /// Interrupt coalescing IOPS threshold.
    pub iops_threshold: u32,
    /// vhost-user socket path.
    pub socket: String,
    /// Connected sessions.
    pub sessions: Vec<VhostSession>,
    /// Backend info.
    pub backend_specific: BackendSpecific,
    /// Members not modelled here.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

method!(
    /// `vhost_get_controllers` → controllers.
    VhostGetControllers = "vhost_get_controllers", VhostGetControllersParams => Vec<VhostController>, idempotent: true
);

/// Params of `vhost_controller_set_coalescing`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostControllerSetCoalescingParams {
    /// Controller name.
    pub ctrlr: String,
    /// Base coalescing delay in microseconds (0 disables).
    pub delay_base_us: u32,
    /// IOPS threshold above which coalescing kicks in.
    pub iops_threshold: u32,
}

method!(
    /// `vhost_controller_set_coalescing` → `true`.
    VhostControllerSetCoalescing = "vhost_controller_set_coalescing", VhostControllerSetCoalescingParams => bool, idempotent: false
);

/// Typed calls of the vhost methods.
mod calls {
    use crate::client::RpcClient;
    use crate::error::RpcError;
    use crate::methods::*;

    impl RpcClient {
        /// `vhost_create_blk_controller`.
        pub async fn vhost_create_blk_controller(
            &self,
            params: &VhostCreateBlkControllerParams,
        ) -> Result<bool, RpcError> {
            self.call_method::<VhostCreateBlkController>(params).await
        }

        /// `vhost_delete_controller`.
        pub async fn vhost_delete_controller(&self, ctrlr: &str) -> Result<bool, RpcError> {
            self.call_method::<VhostDeleteController>(&VhostDeleteControllerParams {
                ctrlr: ctrlr.to_owned(),
            })
            .await
        }

        /// `vhost_get_controllers`: all, or the one named.
        pub async fn vhost_get_controllers(
            &self,
            name: Option<&str>,
        ) -> Result<Vec<VhostController>, RpcError> {
            self.call_method::<VhostGetControllers>(&VhostGetControllersParams {
                name: name.map(str::to_owned),
            })
            .await
        }

        /// `vhost_controller_set_coalescing`.
        pub async fn vhost_controller_set_coalescing(
            &self,
            ctrlr: &str,
            delay_base_us: u32,
            iops_threshold: u32,
        ) -> Result<bool, RpcError> {
            let p = VhostControllerSetCoalescingParams {
                ctrlr: ctrlr.to_owned(),
                delay_base_us,
                iops_threshold,
            };
            self.call_method::<VhostControllerSetCoalescing>(&p).await
        }
    }
}
