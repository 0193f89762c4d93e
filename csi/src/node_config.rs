//! Declared node storage (`--node-config FILE`, YAML or JSON): the devices or files of this
//! node and the lvstore each holds. The driver makes the target match it at start and whenever
//! the file changes, idempotently, and never creates an lvstore over a device that already
//! holds one (examined or not).
//!
//! ```yaml
//! devices:
//!   - path: /dev/nvme1n1      # block device or regular file
//!     lvs: lvs0               # the lvstore it holds
//!     bdev: nvme1n1           # optional aio bdev name (default: lvs name + "-aio")
//!     blockSize: 512          # optional (files default to 512)
//!     clusterSize: 4194304    # optional, only used when creating the lvstore
//!     create: true            # optional (default true): may create the lvstore if absent
//! ```

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use katablk_rpc::methods::{BdevAioCreateParams, BdevLvolCreateLvstoreParams};
use katablk_rpc::RpcClient;
use serde::Deserialize;

use crate::error::{CsiError, Result};
use crate::volume::valid_name;

/// One declared device.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceSpec {
    /// Block device or file.
    pub path: PathBuf,
    /// lvstore name.
    pub lvs: String,
    /// aio bdev name.
    #[serde(default)]
    pub bdev: Option<String>,
    /// Block size for `bdev_aio_create`.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Cluster size for a new lvstore.
    #[serde(default)]
    pub cluster_size: Option<u32>,
    /// Whether the lvstore may be created.
    #[serde(default = "yes")]
    pub create: bool,
}

fn yes() -> bool {
    true
}

impl DeviceSpec {
    /// The aio bdev name.
    pub fn bdev_name(&self) -> String {
        self.bdev
            .clone()
            .unwrap_or_else(|| format!("{}-aio", self.lvs))
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Declared devices.
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
}

impl NodeConfig {
    /// Parses YAML (a superset of JSON) and validates names and paths.
    pub fn parse(text: &str) -> Result<Self> {
        let c: NodeConfig = serde_yaml::from_str(text)
            .map_err(|e| CsiError::InvalidArgument(format!("node config: {e}")))?;
        let mut seen = std::collections::BTreeSet::new();
        for d in &c.devices {
            if !valid_name(&d.lvs) || !valid_name(&d.bdev_name()) {
                return Err(CsiError::InvalidArgument(format!(
                    "node config: invalid lvs/bdev name for {}",
                    d.path.display()
                )));
            }
            if !d.path.is_absolute() {
                return Err(CsiError::InvalidArgument(format!(
                    "node config: {} is not an absolute path",
                    d.path.display()
                )));
            }
            if !seen.insert(d.lvs.clone()) || !seen.insert(format!("bdev:{}", d.bdev_name())) {
                return Err(CsiError::InvalidArgument(format!(
                    "node config: lvs {} or its bdev is declared twice",
                    d.lvs
                )));
            }
        }
        Ok(c)
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Self> {
        let t = std::fs::read_to_string(path).map_err(|e| CsiError::io("read", path, e))?;
        Self::parse(&t)
    }
}

/// The SPDK blobstore super block signature at offset 0 of an lvstore's base device.
pub const BLOBSTORE_SIGNATURE: &[u8; 8] = b"SPDKBLOB";

/// katablk's own lvstore signature (same position, `lvol/docs/FORMAT.md`): SPDK does not
/// recognise it, so a store of ours must be protected from `bdev_lvol_create_lvstore` too.
pub const KATABLK_LVS_SIGNATURE: &[u8; 8] = b"KATABLOB";

/// True if the first bytes of `path` carry a blobstore signature (SPDK's or katablk's).
pub fn holds_blobstore(path: &Path) -> Result<bool> {
    let mut f = std::fs::File::open(path).map_err(|e| CsiError::io("open", path, e))?;
    let mut b = [0u8; 8];
    match f.read_exact(&mut b) {
        Ok(()) => Ok(&b == BLOBSTORE_SIGNATURE || &b == KATABLK_LVS_SIGNATURE),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(CsiError::io("read", path, e)),
    }
}

/// Makes one device's bdev and lvstore exist.
pub async fn apply_device(rpc: &RpcClient, d: &DeviceSpec) -> Result<()> {
    let bdev = d.bdev_name();
    let file = d.path.display().to_string();
    match rpc
        .bdev_get_bdev(&bdev)
        .await
        .map_err(CsiError::rpc("bdev_get_bdevs"))?
    {
        Some(b) => {
            if let Some(aio) = &b.driver_specific.aio {
                if aio.filename != file {
                    return Err(CsiError::FailedPrecondition(format!(
                        "bdev {bdev} is {} but the node config says {file}",
                        aio.filename
                    )));
                }
            }
        }
        None => {
            let is_file = std::fs::metadata(&d.path)
                .map_err(|e| CsiError::io("stat", &d.path, e))?
                .is_file();
            let p = BdevAioCreateParams {
                filename: file.clone(),
                name: bdev.clone(),
                block_size: d.block_size.or(is_file.then_some(512)),
                readonly: None,
                fallocate: None,
                uuid: None,
                ..Default::default()
            };
            match rpc.bdev_aio_create(&p).await {
                Ok(_) => tracing::info!(bdev, file, "aio bdev created"),
                Err(e) if e.is_exists() => {}
                Err(e) => return Err(CsiError::rpc("bdev_aio_create")(e)),
            }
            // Let the lvol module find an existing lvstore on it.
            let _ = rpc.bdev_wait_for_examine().await;
        }
    }
    let stores = rpc
        .bdev_lvol_get_lvstores(&Default::default())
        .await
        .map_err(CsiError::rpc("bdev_lvol_get_lvstores"))?;
    if let Some(s) = stores.iter().find(|s| s.base_bdev == bdev) {
        if s.name != d.lvs {
            return Err(CsiError::FailedPrecondition(format!(
                "{file} holds lvstore {:?}, not {:?}; refusing to touch it",
                s.name, d.lvs
            )));
        }
        return Ok(());
    }
    if let Some(s) = stores.iter().find(|s| s.name == d.lvs) {
        return Err(CsiError::FailedPrecondition(format!(
            "lvstore {} already lives on bdev {}, not {bdev}",
            d.lvs, s.base_bdev
        )));
    }
    if holds_blobstore(&d.path)? {
        return Err(CsiError::FailedPrecondition(format!(
            "{file} holds a blobstore the target did not open; refusing to create {} over it",
            d.lvs
        )));
    }
    if !d.create {
        return Err(CsiError::FailedPrecondition(format!(
            "lvstore {} not found on {file} and create is false",
            d.lvs
        )));
    }
    let p = BdevLvolCreateLvstoreParams {
        bdev_name: bdev.clone(),
        lvs_name: d.lvs.clone(),
        cluster_sz: d.cluster_size,
        clear_method: None,
        num_md_pages_per_cluster_ratio: None,
        md_page_size: None,
    };
    match rpc.bdev_lvol_create_lvstore(&p).await {
        Ok(uuid) => tracing::info!(lvs = %d.lvs, bdev, uuid, "lvstore created"),
        Err(e) if e.is_exists() => {}
        Err(e) => return Err(CsiError::rpc("bdev_lvol_create_lvstore")(e)),
    }
    Ok(())
}

/// Applies every device; returns the errors (one bad device does not block the others).
pub async fn apply(rpc: &RpcClient, c: &NodeConfig) -> Vec<CsiError> {
    let mut errs = Vec::new();
    for d in &c.devices {
        if let Err(e) = apply_device(rpc, d).await {
            tracing::error!(lvs = %d.lvs, path = %d.path.display(), error = %e,
                "node config device not applied");
            errs.push(e);
        }
    }
    errs
}

/// Watches a node config file by mtime.
#[derive(Debug)]
pub struct Watcher {
    path: PathBuf,
    applied: Option<SystemTime>,
}

impl Watcher {
    /// A watcher that has applied nothing yet.
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            applied: None,
        }
    }

    /// Applies the file if it changed since the last successful application (or the target
    /// lost state: `force`). Returns whether it was applied cleanly.
    pub async fn poll(&mut self, rpc: &RpcClient, force: bool) -> Result<bool> {
        let mtime = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .map_err(|e| CsiError::io("stat", &self.path, e))?;
        let c = NodeConfig::load(&self.path)?;
        if !force && self.applied == Some(mtime) {
            // Unchanged file; still re-apply if the target lost a declared lvstore (it
            // restarted without its state between two polls).
            let have = rpc
                .bdev_lvol_get_lvstores(&Default::default())
                .await
                .map_err(CsiError::rpc("bdev_lvol_get_lvstores"))?;
            if c.devices
                .iter()
                .all(|d| have.iter().any(|s| s.name == d.lvs))
            {
                return Ok(true);
            }
            tracing::warn!("a declared lvstore is missing from the target; re-applying");
        }
        let errs = apply(rpc, &c).await;
        if errs.is_empty() {
            self.applied = Some(mtime);
            Ok(true)
        } else {
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_yaml_and_json() {
        let y = "devices:\n  - path: /dev/nvme1n1\n    lvs: lvs0\n    clusterSize: 1048576\n";
        let c = NodeConfig::parse(y).unwrap();
        assert_eq!(c.devices[0].bdev_name(), "lvs0-aio");
        assert_eq!(c.devices[0].cluster_size, Some(1 << 20));
        assert!(c.devices[0].create);
        let j = r#"{"devices":[{"path":"/data/img","lvs":"lvs1","bdev":"a0","create":false}]}"#;
        let c = NodeConfig::parse(j).unwrap();
        assert_eq!(c.devices[0].bdev_name(), "a0");
        assert!(!c.devices[0].create);
        assert!(NodeConfig::parse("devices:\n - path: rel\n   lvs: x\n").is_err());
        assert!(NodeConfig::parse("devices:\n - path: /a\n   lvs: x/y\n").is_err());
        assert!(
            NodeConfig::parse("devices:\n - path: /a\n   lvs: x\n - path: /b\n   lvs: x\n")
                .is_err()
        );
        assert!(NodeConfig::parse("devices:\n - path: /a\n   lvs: x\n   typo: 1\n").is_err());
        assert_eq!(NodeConfig::parse("{}").unwrap(), NodeConfig::default());
    }

    #[test]
    fn blobstore_signature() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("img");
        std::fs::write(&p, b"SPDKBLOB and more").unwrap();
        assert!(holds_blobstore(&p).unwrap());
        std::fs::write(&p, b"KATABLOB and more").unwrap();
        assert!(holds_blobstore(&p).unwrap());
        std::fs::write(&p, vec![0u8; 4096]).unwrap();
        assert!(!holds_blobstore(&p).unwrap());
        std::fs::write(&p, b"x").unwrap();
        assert!(!holds_blobstore(&p).unwrap());
    }
}
