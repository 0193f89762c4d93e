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
        };
        s.published.insert("lvs/v", p.clone()).unwrap();
        s.published.remove("nope").unwrap();
        let s2 = State::load(d.path()).unwrap();
        assert_eq!(s2.published.get("lvs/v"), Some(p));
        s2.published.remove("lvs/v").unwrap();
        assert!(State::load(d.path()).unwrap().published.all().is_empty());
        std::fs::write(d.path().join("snapshots.json"), b"{oops").unwrap();
        assert!(State::load(d.path()).is_err());
    }
}
