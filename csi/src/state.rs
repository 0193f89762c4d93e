//! The driver's own state under `--state-dir` (default `/var/lib/katablk-csi`):
//! `published.json` (what this node published, so reconciliation can restore controllers after
//! a target restart) and `snapshots.json` (creation time and source of each snapshot, which
//! SPDK does not keep). Files are rewritten atomically (temp file + rename).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{CsiError, Result};

/// One published volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    /// The CSI target path.
    pub target_path: PathBuf,
    /// vhost-user-blk controller name (= socket and device node file name).
    pub ctrlr: String,
    /// Device node minor (block volumes).
    #[serde(default)]
    pub minor: Option<u32>,
    /// Published read-only.
    pub readonly: bool,
    /// Block (`None`) or filesystem volume (`Some(fstype)`).
    #[serde(default)]
    pub fstype: Option<String>,
    /// `cpumask` for the controller.
    #[serde(default)]
    pub cpumask: Option<String>,
    /// kubelet's map file whose loop-device lock this publication prepared (Block volumes with
    /// `--kubelet-block-lock=kubelet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubelet_map: Option<PathBuf>,
    /// Filesystem volumes: the Kata runtime its `mountInfo.json` is written for (records from
    /// before this field were written for runtime-rs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kata_runtime: Option<crate::kata::KataRuntime>,
    /// Filesystem volumes for runtime-rs handed over unformatted (`rawBlock`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raw_block: bool,
    /// Filesystem volumes: the mount options written into `mountInfo.json`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mount_options: Vec<String>,
    /// The target's QoS group of the pod this volume is published to (`pod-<uid>`), when the
    /// volume's class sets per-pod limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_group: Option<String>,
    /// The per-pod limits this volume's class asks for; the group gets the strictest of its
    /// members'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_qos: Option<crate::class::QosParams>,
}

impl Publication {
    /// The runtime a Filesystem publication was written for (`None` for Block ones).
    pub fn runtime(&self) -> Option<crate::kata::KataRuntime> {
        self.fstype
            .as_ref()
            .map(|_| self.kata_runtime.unwrap_or(crate::kata::KataRuntime::Rs))
    }

    /// Whether the store needs this publication's 241 device node: Block volumes, and
    /// Filesystem volumes for the Go runtime (their `mountInfo.json` names the node).
    pub fn needs_device_node(&self) -> bool {
        self.fstype.is_none() || self.runtime() == Some(crate::kata::KataRuntime::Go)
    }

    /// The `mountInfo.json` of a Filesystem publication.
    pub fn mount_info(
        &self,
        store: &crate::kata::Store,
        alias: &str,
    ) -> Option<crate::kata::MountInfo> {
        let fs = self.fstype.as_deref()?;
        let mut options = self.mount_options.clone();
        if self.readonly && !options.iter().any(|o| o == "ro") {
            options.push("ro".into());
        }
        Some(crate::kata::MountInfo::for_runtime(
            self.runtime()?,
            store,
            &self.ctrlr,
            alias,
            fs,
            self.raw_block,
            options,
        ))
    }
}

/// Metadata of one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotMeta {
    /// The source volume id.
    pub source_volume_id: String,
    /// Seconds since the epoch.
    pub created_secs: i64,
    /// Nanoseconds part.
    pub created_nanos: i32,
}

/// A JSON map persisted in one file.
#[derive(Debug)]
pub struct JsonMap<V> {
    path: PathBuf,
    map: Mutex<BTreeMap<String, V>>,
}

impl<V: Serialize + DeserializeOwned + Clone> JsonMap<V> {
    /// Loads `path` (an absent file is an empty map).
    pub fn load(path: PathBuf) -> Result<Self> {
        let map = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| CsiError::Internal(format!("corrupt state file {path:?}: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(CsiError::io("read", &path, e)),
        };
        Ok(Self {
            path,
            map: Mutex::new(map),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, V>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn save(&self, map: &BTreeMap<String, V>) -> Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(dir).map_err(|e| CsiError::io("create", dir, e))?;
        let tmp = self.path.with_extension("tmp");
        let json = serde_json::to_vec_pretty(map).map_err(|e| CsiError::Internal(e.to_string()))?;
        let mut f = std::fs::File::create(&tmp).map_err(|e| CsiError::io("create", &tmp, e))?;
        f.write_all(&json)
            .and_then(|()| f.sync_all())
            .map_err(|e| CsiError::io("write", &tmp, e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| CsiError::io("rename", &self.path, e))
    }

    /// The entry for `key`.
    pub fn get(&self, key: &str) -> Option<V> {
        self.lock().get(key).cloned()
    }

    /// A copy of every entry.
    pub fn all(&self) -> BTreeMap<String, V> {
        self.lock().clone()
    }

    /// Sets `key` and persists.
    pub fn insert(&self, key: &str, v: V) -> Result<()> {
        let mut m = self.lock();
        m.insert(key.to_owned(), v);
        self.save(&m)
    }

    /// Removes `key` and persists (no-op if absent).
    pub fn remove(&self, key: &str) -> Result<()> {
        let mut m = self.lock();
        if m.remove(key).is_some() {
            self.save(&m)?;
        }
        Ok(())
    }
}

/// Both state files.
#[derive(Debug)]
pub struct State {
    /// volume id → publication.
    pub published: JsonMap<Publication>,
    /// snapshot id → metadata.
    pub snapshots: JsonMap<SnapshotMeta>,
}

impl State {
    /// Loads (or starts) the state in `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        Ok(Self {
            published: JsonMap::load(dir.join("published.json"))?,
            snapshots: JsonMap::load(dir.join("snapshots.json"))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn persists() {
        let d = tempfile::tempdir().unwrap();
        let s = State::load(d.path()).unwrap();
        let p = Publication {
            target_path: "/t".into(),
            ctrlr: "ctrlr-1".into(),
            minor: Some(3),
            readonly: false,
            fstype: None,
            cpumask: None,
            kubelet_map: Some("/k/dev/pod".into()),
            kata_runtime: None,
            raw_block: false,
            mount_options: vec![],
            pod_group: Some("pod-u".into()),
            pod_qos: Some(crate::class::QosParams {
                rw_ios_per_sec: Some(2000),
                ..Default::default()
            }),
        };
        s.published.insert("lvs/v", p.clone()).unwrap();
        s.published.remove("nope").unwrap();
        let s2 = State::load(d.path()).unwrap();
        assert_eq!(s2.published.get("lvs/v"), Some(p.clone()));
        s2.published.remove("lvs/v").unwrap();
        assert!(State::load(d.path()).unwrap().published.all().is_empty());
        // A Filesystem record written before `kata_runtime` existed was for runtime-rs.
        let old: Publication = serde_json::from_str(
            r#"{"target_path":"/t","ctrlr":"ctrlr-1","readonly":true,"fstype":"ext4"}"#,
        )
        .unwrap();
        assert_eq!(old.runtime(), Some(crate::kata::KataRuntime::Rs));
        assert!(!old.needs_device_node());
        let store = crate::kata::Store::new("/s");
        let info = old.mount_info(&store, "lvs/v").unwrap();
        assert_eq!(info.volume_type, "spdkvol");
        assert_eq!(info.options, ["ro"]);
        let go = Publication {
            kata_runtime: Some(crate::kata::KataRuntime::Go),
            ..old
        };
        assert!(go.needs_device_node());
        assert_eq!(
            go.mount_info(&store, "lvs/v").unwrap().device,
            "/s/block/devices/ctrlr-1"
        );
        assert_eq!(p.runtime(), None);
        assert!(p.needs_device_node());
        std::fs::write(d.path().join("snapshots.json"), b"{oops").unwrap();
        assert!(State::load(d.path()).is_err());
    }
}
