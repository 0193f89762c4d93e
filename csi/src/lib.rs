//! katablk-csi: a CSI driver that provisions node-local lvols through SPDK JSON-RPC (SPDK's
//! vhost target or katablk-target) and publishes them to Kata Containers pods as
//! vhost-user-blk devices.
//!
//! - [`identity`], [`controller`], [`node`]: the three CSI services (gRPC glue + logic);
//!   [`class`]: StorageClass parameters and supported capabilities.
//! - [`kata`]: the vhost-user store layout and direct-assigned volume `mountInfo.json`.
//! - [`mounts`], [`format`](mod@format): bind mounts; formatting through the controller socket.
//! - [`safe_path`]: target paths walked below the kubelet directory without following links.
//! - [`kubelet_lock`]: the loop device kubelet's Block volume mapping looks for.
//! - [`volume`], [`volume_lock`]: ids, names, path validation; per-volume serialisation.
//! - [`node_config`], [`reconcile`], [`state`]: declared storage, restart repair, state files.
//! - [`metrics`], [`error`], [`driver`]: Prometheus counters, CSI error codes, the server.

#![deny(missing_docs)]

pub mod class;
pub mod controller;
pub mod driver;
pub mod error;
pub mod format;
pub mod identity;
pub mod kata;
pub mod kubelet_lock;
pub mod metrics;
pub mod mounts;
pub mod node;
pub mod node_config;
pub mod pod_qos;
pub mod reconcile;
pub mod safe_path;
pub mod state;
pub mod volume;
pub mod volume_lock;

/// Types and services generated from `proto/csi.proto` (CSI v1.9, package `csi.v1`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

pub use driver::{serve, Config, Driver, Mode, DEFAULT_DRIVER_NAME, TOPOLOGY_KEY};
pub use error::CsiError;
