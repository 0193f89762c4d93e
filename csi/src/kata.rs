//! Kata Containers' side of a volume: the vhost-user store (`block/sockets/<name>` and
//! `block/devices/<name>`, block major 241 with a unique minor) and direct-assigned volumes
//! (`<direct-volumes>/<base64url(volume path)>/mountInfo.json`).
//!
//! The two Kata runtimes read a direct volume differently, so its `mountInfo.json` is written
//! for one of them ([`KataRuntime`]):
//! - the Go runtime (`src/runtime/virtcontainers/container.go`, `createMounts`) ignores
//!   `volume-type`, stats `device`, and turns a block device of major 241 into a vhost-user-blk
//!   device through the store (`src/runtime/pkg/device/config/config.go`,
//!   `getVhostUserHostPath`: the node in `block/devices/` with that major:minor names the
//!   socket in `block/sockets/`); the guest mounts it with `fstype` and `options`
//!   (`kata_agent.go`, `handleVhostUserBlkVolume`). So `device` is the 241 node.
//! - runtime-rs (`src/runtime-rs/crates/resource/src/volume/direct_volumes/spdk_volume.rs`)
//!   takes `volume-type: spdkvol` with `device` = the socket (it must stat as a socket), reads
//!   `num_queues`/`queue_size` from `metadata`, and mounts ext4 whatever `fstype` says, because
//!   CRI hands CSI volumes over as bind mounts; a container mount under `/dev` gets the guest's
//!   block device itself (storage type `bind`).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::Write as _;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::error::{CsiError, Result};
use crate::volume::check_socket_path;

/// Block major Kata treats as vhost-user-blk.
pub const VHOST_USER_BLK_MAJOR: u32 = 241;

/// Minors available for device nodes (Linux minors are 20 bits).
pub const MAX_MINOR: u32 = (1 << 20) - 1;

/// The mode of the store's device nodes: read and write for owner and group, as the Go
/// runtime's documentation creates them (`mknod -m 0660`).
pub const DEVICE_NODE_MODE: u32 = 0o660;

/// The mode of a direct volume's directory: Kata's own `direct-volume add` uses 0700
/// (`src/runtime/pkg/direct-volume/utils.go`, `Add`).
pub const DIRECT_VOLUME_DIR_MODE: u32 = 0o700;

/// The only filesystem runtime-rs mounts a direct volume with (`DEFAULT_VOLUME_FS_TYPE`).
pub const RUNTIME_RS_FSTYPE: &str = "ext4";

/// The Kata runtime a Filesystem volume's `mountInfo.json` is written for.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum KataRuntime {
    /// The Go runtime (`containerd-shim-kata-v2` of `src/runtime`; kata-qemu): `device` is the
    /// store's 241 device node, any filesystem the guest kernel mounts.
    #[default]
    Go,
    /// runtime-rs (`src/runtime-rs`; kata-dragonball): `volume-type: spdkvol`, `device` is the
    /// socket; ext4 only, or the raw device under `/dev`.
    Rs,
}

impl KataRuntime {
    /// The name used in flags, StorageClass parameters and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Go => "go",
            Self::Rs => "rs",
        }
    }

    /// Parses a StorageClass / volume context value.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "go" => Ok(Self::Go),
            "rs" => Ok(Self::Rs),
            _ => Err(CsiError::InvalidArgument(format!(
                "kataRuntime {s:?}: use go (Kata's Go runtime, e.g. kata-qemu) or rs \
                 (runtime-rs, e.g. kata-dragonball)"
            ))),
        }
    }

    /// Why this runtime cannot take a Filesystem volume of `fstype` (`raw`: handed over
    /// unformatted), if it cannot.
    pub fn refuses(self, fstype: &str, raw: bool) -> Option<String> {
        match self {
            Self::Go if raw => Some(
                "rawBlock is for Kata runtime-rs; Kata's Go runtime takes raw volumes as \
                 Block PVs (volumeMode: Block)"
                    .into(),
            ),
            Self::Rs if !raw && fstype != RUNTIME_RS_FSTYPE => Some(format!(
                "Kata runtime-rs mounts direct volumes as {RUNTIME_RS_FSTYPE} whatever \
                 mountInfo.json says (CRI bind-mounts CSI volumes and spdk_volume.rs uses \
                 DEFAULT_VOLUME_FS_TYPE for bind mounts), so fsType {fstype} would not mount: \
                 use fsType {RUNTIME_RS_FSTYPE}, or kataRuntime go"
            )),
            _ => None,
        }
    }
}

/// The vhost-user store directory layout.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    /// A store rooted at `root` (e.g. `/var/run/kata-containers/vhost-user`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The store root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/block/sockets`: where the target must create controller sockets (`-S`).
    pub fn sockets_dir(&self) -> PathBuf {
        self.root.join("block/sockets")
    }

    /// `<root>/block/devices`.
    pub fn devices_dir(&self) -> PathBuf {
        self.root.join("block/devices")
    }

    /// The socket of controller `name`.
    pub fn socket_path(&self, name: &str) -> PathBuf {
        self.sockets_dir().join(name)
    }

    /// The device node of controller `name`.
    pub fn device_path(&self, name: &str) -> PathBuf {
        self.devices_dir().join(name)
    }

    /// Creates both directories and checks the socket paths of controller names fit.
    pub fn prepare(&self) -> Result<()> {
        for d in [self.sockets_dir(), self.devices_dir()] {
            std::fs::create_dir_all(&d).map_err(|e| CsiError::io("create", &d, e))?;
        }
        check_socket_path(&self.socket_path("ctrlr-0123456789abcdef"))
    }

    /// Minors of the 241-major block device nodes in `devices/`, by file name.
    pub fn device_nodes(&self) -> Result<BTreeMap<String, u32>> {
        let dir = self.devices_dir();
        let mut out = BTreeMap::new();
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(CsiError::io("read", &dir, e)),
        };
        for ent in rd.flatten() {
            let Ok(md) = ent.path().symlink_metadata() else {
                continue;
            };
            if md.file_type().is_block_device() {
                let rdev = md.rdev();
                if libc::major(rdev) == VHOST_USER_BLK_MAJOR {
                    out.insert(
                        ent.file_name().to_string_lossy().into_owned(),
                        libc::minor(rdev),
                    );
                }
            }
        }
        Ok(out)
    }

    /// Makes `devices/<name>` a `b 241:N` node, reusing an existing one, else taking the lowest
    /// free minor. Callers serialise calls (the minor scan and mknod are not atomic together).
    pub fn ensure_device_node(&self, name: &str, want: Option<u32>) -> Result<u32> {
        let nodes = self.device_nodes()?;
        if let Some(m) = nodes.get(name) {
            return Ok(*m);
        }
        let path = self.device_path(name);
        if path.symlink_metadata().is_ok() {
            // Something else is in the way (wrong type or major): replace it.
            std::fs::remove_file(&path).map_err(|e| CsiError::io("remove", &path, e))?;
        }
        let used: std::collections::BTreeSet<u32> = nodes.values().copied().collect();
        let minor = match want {
            Some(m) if !used.contains(&m) => m,
            _ => (0..=MAX_MINOR)
                .find(|m| !used.contains(m))
                .ok_or_else(|| CsiError::ResourceExhausted("no free device minor".into()))?,
        };
        mknod_block(&path, VHOST_USER_BLK_MAJOR, minor)?;
        Ok(minor)
    }

    /// Removes `devices/<name>` if present.
    pub fn remove_device_node(&self, name: &str) -> Result<()> {
        remove_if_exists(&self.device_path(name))
    }
}

/// Removes a file, treating "not there" as done.
pub fn remove_if_exists(p: &Path) -> Result<()> {
    match std::fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CsiError::io("remove", p, e)),
    }
}

/// `mknod(path, S_IFBLK | 0660, makedev(major, minor))`.
pub fn mknod_block(path: &Path, major: u32, minor: u32) -> Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| CsiError::InvalidArgument(format!("path {path:?} contains NUL")))?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call; mknod reads it only.
    let r = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFBLK | DEVICE_NODE_MODE,
            libc::makedev(major, minor),
        )
    };
    if r != 0 {
        return Err(CsiError::io("mknod", path, std::io::Error::last_os_error()));
    }
    // mknod applies the umask (0022 makes 0640): set the mode itself.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(DEVICE_NODE_MODE))
        .map_err(|e| CsiError::io("chmod", path, e))
}

/// The `mountInfo.json` of a Kata direct-assigned volume (hyphenated keys are what Kata reads;
/// `metadata` and `options` are left out when empty, as Go's `omitempty` writes them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountInfo {
    /// `spdkvol` (runtime-rs attaches `device` as a vhost-user-blk socket) or `block` (the Go
    /// runtime, which does not read it).
    #[serde(rename = "volume-type")]
    pub volume_type: String,
    /// The vhost-user socket (runtime-rs) or the store's 241 device node (Go runtime).
    pub device: String,
    /// Filesystem the guest mounts.
    pub fstype: String,
    /// Extra attributes (runtime-rs: `num_queues`, `queue_size`; ours: `volume-id`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Mount options (e.g. `ro`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// `volume-type` of runtime-rs' vhost-user-blk direct volumes.
pub const SPDK_VOLUME_TYPE: &str = "spdkvol";

/// `volume-type` written for the Go runtime (which does not read it; Kata's documentation
/// uses `block`).
pub const BLOCK_VOLUME_TYPE: &str = "block";

impl MountInfo {
    /// The `mountInfo.json` that `runtime` reads for controller `ctrlr` of volume `alias`.
    /// `fstype` is what the guest mounts (runtime-rs with `raw`: `bind`, the device itself).
    pub fn for_runtime(
        runtime: KataRuntime,
        store: &Store,
        ctrlr: &str,
        alias: &str,
        fstype: &str,
        raw: bool,
        options: Vec<String>,
    ) -> Self {
        match runtime {
            KataRuntime::Go => Self {
                volume_type: BLOCK_VOLUME_TYPE.into(),
                device: store.device_path(ctrlr).display().to_string(),
                fstype: fstype.into(),
                // The Go runtime warns about every metadata key it does not know.
                metadata: BTreeMap::new(),
                options,
            },
            KataRuntime::Rs => Self {
                volume_type: SPDK_VOLUME_TYPE.into(),
                device: store.socket_path(ctrlr).display().to_string(),
                fstype: if raw { "bind".into() } else { fstype.into() },
                metadata: [
                    ("volume-id".to_owned(), alias.to_owned()),
                    ("num_queues".to_owned(), "1".to_owned()),
                ]
                .into(),
                options,
            },
        }
    }

    /// The controller `device` names in `store` (its socket or its device node), if it is one.
    pub fn ctrlr(&self, store: &Store) -> Option<String> {
        let p = Path::new(&self.device);
        let parent = p.parent()?;
        (parent == store.sockets_dir() || parent == store.devices_dir())
            .then(|| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .flatten()
    }
}

/// The directory holding the `mountInfo.json` of the volume mounted at `volume_path`:
/// `<dir>/<base64url(volume_path)>` (padded URL-safe base64, as Kata encodes it).
pub fn direct_volume_dir(dir: &Path, volume_path: &Path) -> PathBuf {
    let enc = base64::engine::general_purpose::URL_SAFE.encode(volume_path.as_os_str().as_bytes());
    dir.join(enc)
}

/// Writes `mountInfo.json` (mode 0600, its directory 0700) atomically.
pub fn write_mount_info(dir: &Path, volume_path: &Path, info: &MountInfo) -> Result<PathBuf> {
    let d = direct_volume_dir(dir, volume_path);
    if info.volume_type == SPDK_VOLUME_TYPE {
        check_socket_path(Path::new(&info.device))?;
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIRECT_VOLUME_DIR_MODE)
        .create(&d)
        .map_err(|e| CsiError::io("create", &d, e))?;
    // An existing directory (an older driver made them 0755) gets the mode too.
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(DIRECT_VOLUME_DIR_MODE))
        .map_err(|e| CsiError::io("chmod", &d, e))?;
    let file = d.join("mountInfo.json");
    let tmp = d.join(".mountInfo.json.tmp");
    let json = serde_json::to_vec_pretty(info).map_err(|e| CsiError::Internal(e.to_string()))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| CsiError::io("create", &tmp, e))?;
    f.write_all(&json)
        .and_then(|()| f.sync_all())
        .map_err(|e| CsiError::io("write", &tmp, e))?;
    std::fs::rename(&tmp, &file).map_err(|e| CsiError::io("rename", &file, e))?;
    Ok(file)
}

/// Reads a volume's `mountInfo.json`, if any.
pub fn read_mount_info(dir: &Path, volume_path: &Path) -> Option<MountInfo> {
    let f = direct_volume_dir(dir, volume_path).join("mountInfo.json");
    serde_json::from_slice(&std::fs::read(f).ok()?).ok()
}

/// Removes a volume's direct-volume directory.
pub fn remove_mount_info(dir: &Path, volume_path: &Path) -> Result<()> {
    let d = direct_volume_dir(dir, volume_path);
    match std::fs::remove_dir_all(&d) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CsiError::io("remove", &d, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn direct_volume_layout() {
        let d = tempfile::tempdir().unwrap();
        let vp = Path::new("/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount");
        let info = MountInfo {
            volume_type: "spdkvol".into(),
            device: "/run/vhost-user/block/sockets/ctrlr-1".into(),
            fstype: "ext4".into(),
            metadata: BTreeMap::new(),
            options: vec!["ro".into()],
        };
        let f = write_mount_info(d.path(), vp, &info).unwrap();
        let name = f.parent().unwrap().file_name().unwrap().to_str().unwrap();
        let back = base64::engine::general_purpose::URL_SAFE
            .decode(name)
            .unwrap();
        assert_eq!(back, vp.as_os_str().as_bytes());
        assert!(!name.contains('/'));
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(text.contains("\"volume-type\": \"spdkvol\""));
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(f.parent().unwrap())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        assert_eq!(read_mount_info(d.path(), vp), Some(info));
        remove_mount_info(d.path(), vp).unwrap();
        remove_mount_info(d.path(), vp).unwrap();
        assert!(read_mount_info(d.path(), vp).is_none());
    }

    #[test]
    fn mount_info_per_runtime() {
        let s = Store::new("/run/vu");
        let go = MountInfo::for_runtime(
            KataRuntime::Go,
            &s,
            "ctrlr-1",
            "lvs/v",
            "xfs",
            false,
            vec![],
        );
        assert_eq!(go.device, "/run/vu/block/devices/ctrlr-1");
        assert_eq!(go.fstype, "xfs");
        assert_eq!(go.ctrlr(&s).as_deref(), Some("ctrlr-1"));
        // Go's `omitempty`: no empty metadata/options keys.
        let text = serde_json::to_string(&go).unwrap();
        assert!(
            !text.contains("metadata") && !text.contains("options"),
            "{text}"
        );
        let back: MountInfo = serde_json::from_str(&text).unwrap();
        assert_eq!(back, go);
        let rs = MountInfo::for_runtime(
            KataRuntime::Rs,
            &s,
            "ctrlr-1",
            "lvs/v",
            "ext4",
            false,
            vec!["ro".into()],
        );
        assert_eq!(rs.volume_type, "spdkvol");
        assert_eq!(rs.device, "/run/vu/block/sockets/ctrlr-1");
        assert_eq!(rs.metadata["num_queues"], "1");
        assert_eq!(rs.ctrlr(&s).as_deref(), Some("ctrlr-1"));
        let raw = MountInfo::for_runtime(
            KataRuntime::Rs,
            &s,
            "ctrlr-1",
            "lvs/v",
            "ext4",
            true,
            vec![],
        );
        assert_eq!(raw.fstype, "bind");
        assert!(MountInfo {
            device: "/elsewhere/ctrlr-1".into(),
            ..rs
        }
        .ctrlr(&s)
        .is_none());
    }

    #[test]
    fn runtimes_refuse_what_they_cannot_mount() {
        assert!(KataRuntime::Go.refuses("xfs", false).is_none());
        assert!(KataRuntime::Go.refuses("ext4", true).is_some());
        assert!(KataRuntime::Rs.refuses("ext4", false).is_none());
        assert!(KataRuntime::Rs
            .refuses("xfs", false)
            .unwrap()
            .contains("fsType ext4"));
        assert!(KataRuntime::Rs.refuses("xfs", true).is_none());
        assert_eq!(KataRuntime::parse("rs").unwrap(), KataRuntime::Rs);
        assert!(KataRuntime::parse("rust").is_err());
    }

    #[test]
    fn store_paths() {
        let s = Store::new("/var/run/kata-containers/vhost-user");
        assert_eq!(
            s.socket_path("ctrlr-1"),
            Path::new("/var/run/kata-containers/vhost-user/block/sockets/ctrlr-1")
        );
        assert_eq!(
            s.device_path("ctrlr-1"),
            Path::new("/var/run/kata-containers/vhost-user/block/devices/ctrlr-1")
        );
        assert!(Store::new("/x".repeat(50)).prepare().is_err());
    }

    #[test]
    fn device_nodes_get_lowest_free_minor() {
        // mknod needs CAP_MKNOD; skip quietly without it.
        let d = tempfile::tempdir().unwrap();
        let s = Store::new(d.path());
        s.prepare().unwrap();
        if s.ensure_device_node("a", None).is_err() {
            return;
        }
        let md = std::fs::metadata(s.device_path("a")).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, DEVICE_NODE_MODE);
        assert_eq!(s.ensure_device_node("b", None).unwrap(), 1);
        assert_eq!(s.ensure_device_node("a", None).unwrap(), 0);
        s.remove_device_node("a").unwrap();
        assert_eq!(s.ensure_device_node("c", None).unwrap(), 0);
        assert_eq!(s.ensure_device_node("d", Some(7)).unwrap(), 7);
        assert_eq!(s.device_nodes().unwrap().len(), 3);
    }
}
