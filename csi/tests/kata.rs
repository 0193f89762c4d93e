//! Kata Containers reading the Filesystem volumes katablk-csi published, step by step as each
//! Kata runtime's own code does it (kata-containers `main`, 2026-08):
//!
//! Go runtime (kata-qemu):
//! - `src/runtime/pkg/direct-volume/utils.go`: `VolumeMountInfo` (the file at
//!   `<root>/<base64.URLEncoding(mount source)>/mountInfo.json`, decoded into `MountInfo`),
//!   `RecordSandboxID` (a file named after the sandbox in that directory), `Remove`;
//! - `src/runtime/virtcontainers/container.go`: `createMounts` (bind mounts only; `os.Stat`
//!   of `device`, a regular file would be a disk image; `ro` in `options`), `createDeviceInfo`
//!   (`unix.Stat`: a block device gives `DevType b` and its major:minor);
//! - `src/runtime/pkg/device/config/config.go`: `GetHostPath` → `getVhostUserHostPath` →
//!   `getVhostUserDevName` (every entry of `<store>/block/devices/` is stat'ed — one that fails
//!   aborts the lookup — and the one with the same major:minor names the socket in
//!   `<store>/block/sockets/`, which must exist);
//! - `src/runtime/virtcontainers/kata_agent.go`: `handleVhostUserBlkVolume` (the guest mounts
//!   the disk with `Fstype` = the mount type = `fstype`, options = `options`).
//!
//! runtime-rs (kata-dragonball):
//! - `src/libs/kata-types/src/mount.rs`: `join_path` (base64 `URL_SAFE`), `get_volume_mount_info`
//!   (serde into `DirectVolumeMountInfo`: `volume-type`, `device`, `fstype` required);
//! - `src/runtime-rs/crates/resource/src/volume/direct_volume.rs`: `is_direct_volume` (the
//!   directory exists), `to_volume_type` (`spdkvol`);
//! - `src/runtime-rs/crates/resource/src/volume/direct_volumes/spdk_volume.rs`: `spdk://`
//!   prefix, `stat` must say `S_IFSOCK`, `num_queues` as `usize`, `queue_size` as `u32`, the
//!   guest mounts ext4 for a bind mount (what CRI makes of a CSI volume) and binds the device
//!   itself when the container path is under `/dev`.
//!
//! The VMMs' side (QEMU for the Go runtime, Dragonball for runtime-rs) is the vhost-user
//! connection: a libblkio client here, QEMU in `e2e/`, Dragonball's message sequence in
//! `vhost/tests/frontends.rs`.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use common::*;
use katablk_csi::csi;
use katablk_csi::kata::KataRuntime;

const POD: &str = "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f";

/// kubelet's mount path of a CSI Filesystem volume (`pkg/volume/csi/csi_mounter.go`
/// `GetPath`): `<kubelet>/pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`.
fn mount_path(e: &Env, pv: &str) -> PathBuf {
    e.kubelet()
        .join("pods")
        .join(POD)
        .join("volumes/kubernetes.io~csi")
        .join(pv)
        .join("mount")
}

fn cap_fs(fs: &str) -> csi::VolumeCapability {
    let mut c = mount_cap();
    if let Some(csi::volume_capability::AccessType::Mount(m)) = c.access_type.as_mut() {
        m.fs_type = fs.into();
    }
    c
}

fn have(tool: &str) -> bool {
    std::process::Command::new(tool)
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// CreateVolume + NodePublishVolume of a Filesystem volume the way the external provisioner
/// and kubelet call them; returns the volume id and the mount path.
async fn publish_fs(
    e: &mut Env,
    pv: &str,
    bytes: i64,
    fs: &str,
    class: &[(&str, &str)],
    ro: bool,
) -> Result<(String, PathBuf), tonic::Status> {
    let mut r = create_req(pv, bytes);
    r.volume_capabilities = vec![cap_fs(fs)];
    r.parameters.insert("thinProvision".into(), "true".into());
    for (k, v) in class {
        r.parameters.insert((*k).into(), (*v).into());
    }
    let v = e
        .controller
        .create_volume(r)
        .await?
        .into_inner()
        .volume
        .unwrap();
    let tp = mount_path(e, pv);
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    let mut pr = publish_req(&v.volume_id, &tp, cap_fs(fs), ro);
    pr.volume_context = v.volume_context.clone();
    e.node.node_publish_volume(pr).await?;
    Ok((v.volume_id, tp))
}

/// `MountInfo` of `utils.go` as Go's `encoding/json` decodes it: the keys by their JSON names,
/// strings where Go has `string`, `map[string]string`, `[]string`; absent keys are zero values.
#[derive(Debug)]
struct GoMountInfo {
    device: String,
    fs_type: String,
    metadata: BTreeMap<String, String>,
    options: Vec<String>,
}

/// `VolumeMountInfo(volumePath)`: `os.Stat` of the file, `os.ReadFile`, `json.Unmarshal`.
fn go_volume_mount_info(root: &Path, volume_path: &Path) -> Option<GoMountInfo> {
    let enc = base64::engine::general_purpose::URL_SAFE
        .encode(volume_path.as_os_str().as_encoded_bytes());
    let f = root.join(enc).join("mountInfo.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(f).ok()?).unwrap();
    let obj = v.as_object().unwrap();
    let s = |k: &str| match obj.get(k) {
        None => String::new(),
        Some(x) => x
            .as_str()
            .unwrap_or_else(|| panic!("{k} is not a string"))
            .to_owned(),
    };
    // Every field has the type Go's struct declares, or Unmarshal fails.
    s("volume-type");
    Some(GoMountInfo {
        device: s("device"),
        fs_type: s("fstype"),
        metadata: obj
            .get("metadata")
            .map(|m| serde_json::from_value(m.clone()).unwrap())
            .unwrap_or_default(),
        options: obj
            .get("options")
            .map(|m| serde_json::from_value(m.clone()).unwrap())
            .unwrap_or_default(),
    })
}

/// `getVhostUserHostPath(devInfo, store)`: the socket behind the node with `major:minor`.
fn go_vhost_user_host_path(store: &Path, major: u32, minor: u32) -> Result<PathBuf, String> {
    let devices = store.join("block/devices");
    let sockets = store.join("block/sockets");
    let mut name = None;
    for ent in std::fs::read_dir(&devices).map_err(|e| e.to_string())? {
        let ent = ent.map_err(|e| e.to_string())?;
        // `GetVhostUserNodeStat` is `unix.Stat` (follows links); an error ends the search.
        let md =
            std::fs::metadata(ent.path()).map_err(|e| format!("stat {:?}: {e}", ent.path()))?;
        if libc::major(md.rdev()) == major && libc::minor(md.rdev()) == minor {
            name = Some(ent.file_name());
            break;
        }
    }
    let name = name.ok_or(format!(
        "Required device node ({major}:{minor}) doesn't exist under directory {devices:?}"
    ))?;
    let sock = sockets.join(name);
    std::fs::metadata(&sock).map_err(|e| e.to_string())?;
    Ok(sock)
}

/// The Go runtime's steps from the mount source (kubelet's mount path) to the socket the VMM
/// connects to, and the fstype/options the agent mounts with.
fn go_runtime_resolves(e: &Env, tp: &Path, sandbox: &str) -> (PathBuf, GoMountInfo) {
    let info = go_volume_mount_info(&e.direct(), tp).expect("VolumeMountInfo finds the file");
    // RecordSandboxID: the runtime writes into the volume's directory.
    let enc = base64::engine::general_purpose::URL_SAFE.encode(tp.as_os_str().as_encoded_bytes());
    std::fs::write(e.direct().join(enc).join(sandbox), b"").unwrap();
    // createMounts: a regular file would be a disk image (isBlockFile); ours is not.
    let md = std::fs::metadata(&info.device).unwrap();
    assert!(!md.file_type().is_file());
    // createDeviceInfo: unix.Stat → S_IFBLK, DevType "b", Major/Minor.
    assert!(
        md.file_type().is_block_device(),
        "{} is not a block device",
        info.device
    );
    let (major, minor) = (libc::major(md.rdev()), libc::minor(md.rdev()));
    // GetHostPath: vhost-user store enabled, DevType b, VhostUserBlkMajor (241).
    assert_eq!(major, 241);
    let sock = go_vhost_user_host_path(&e.store(), major, minor).unwrap();
    assert!(std::fs::metadata(&sock).unwrap().file_type().is_socket());
    // The metadata keys the Go runtime knows; any other one is only warned about.
    for k in info.metadata.keys() {
        assert!(
            [
                "encryptionKey",
                "createFilesystem",
                "fsGroup",
                "fsGroupChangePolicy"
            ]
            .contains(&k.as_str()),
            "the Go runtime ignores metadata key {k}"
        );
    }
    (sock, info)
}

async fn fs_on(sock: &Path) -> Option<&'static str> {
    let s = sock.to_path_buf();
    let sb = blk(move || blk_client(&s, true).unwrap().read_ok(0, 0, 128 << 10)).await;
    katablk_csi::format::probe_fs(&sb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_runtime_finds_the_socket_behind_a_filesystem_volume() {
    // The node default is the Go runtime.
    let mut e = Env::start().await;
    let fs = if have("mkfs.xfs") { "xfs" } else { "ext4" };
    if fs != "xfs" {
        eprintln!("mkfs.xfs is not installed (scripts/setup-debian.sh installs it): ext4 only");
    }
    let (vid, tp) = publish_fs(&mut e, "pvc-go", 320 << 20, fs, &[], false)
        .await
        .unwrap();
    let (sock, info) = go_runtime_resolves(&e, &tp, "sandbox-1");
    assert_eq!(sock, e.store().join("block/sockets").join(ctrlr(&vid)));
    // handleVhostUserBlkVolume: the agent mounts the guest's disk with this type.
    assert_eq!(info.fs_type, fs);
    assert!(info.options.is_empty());
    assert_eq!(fs_on(&sock).await, Some(fs));
    // The node is 0660, the directory 0700 (Kata's own `direct-volume add`).
    let node = std::fs::metadata(&info.device).unwrap();
    assert_eq!(node.permissions().mode() & 0o777, 0o660);
    let dir = katablk_csi::kata::direct_volume_dir(&e.direct(), &tp);
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // Healthy, and counted as a Go-runtime hand-over.
    let st = e
        .node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: vid.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!st.volume_condition.as_ref().unwrap().abnormal, "{st:?}");
    assert!(e
        .driver
        .metrics
        .render()
        .contains("katablk_csi_published_volumes{handoff=\"direct_go\"} 1"));

    // A lost device node: abnormal, and reconciliation brings it back with its minor.
    let minor = libc::minor(node.rdev());
    std::fs::remove_file(&info.device).unwrap();
    let st = e
        .node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: vid.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let c = st.volume_condition.unwrap();
    assert!(c.abnormal && c.message.contains("device node"), "{c:?}");
    // A lost mountInfo.json (the directory is on tmpfs) too.
    std::fs::remove_dir_all(&dir).unwrap();
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert_eq!(rep.mount_infos, vec![tp.clone()], "{rep:?}");
    let md = std::fs::metadata(&info.device).unwrap();
    assert_eq!(libc::minor(md.rdev()), minor);
    let (sock2, _) = go_runtime_resolves(&e, &tp, "sandbox-2");
    assert_eq!(sock2, sock);

    // Read-only publish: `ro` in options, which createMounts turns into ReadOnly.
    e.node
        .node_unpublish_volume(unpublish_req(&vid, &tp))
        .await
        .unwrap();
    // Remove: the directory goes with the sandbox file in it; the node goes too.
    assert!(!dir.exists());
    assert!(!Path::new(&info.device).exists());
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    let mut pr = publish_req(&vid, &tp, cap_fs(fs), true);
    pr.volume_context = [("fstype".to_owned(), fs.to_owned())].into();
    e.node.node_publish_volume(pr).await.unwrap();
    let (_, info) = go_runtime_resolves(&e, &tp, "sandbox-3");
    assert!(info.options.iter().any(|o| o == "ro"), "{info:?}");
    e.node
        .node_unpublish_volume(unpublish_req(&vid, &tp))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_runtime_lookup_survives_every_store_entry() {
    // getVhostUserDevName stats every entry of block/devices and gives up at the first error:
    // two published volumes, Block and Filesystem, must both resolve.
    let mut e = Env::start().await;
    let (fvid, tp) = publish_fs(&mut e, "pvc-go-a", 64 << 20, "ext4", &[], false)
        .await
        .unwrap();
    let b = e
        .controller
        .create_volume(create_req("pvc-go-b", 64 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let btp = e.target_path("blk");
    std::fs::create_dir_all(btp.parent().unwrap()).unwrap();
    e.node
        .node_publish_volume(publish_req(&b.volume_id, &btp, block_cap(), false))
        .await
        .unwrap();
    let (sock, _) = go_runtime_resolves(&e, &tp, "sandbox-1");
    assert_eq!(sock, e.store().join("block/sockets").join(ctrlr(&fvid)));
    let md = std::fs::metadata(&btp).unwrap();
    let bsock = go_vhost_user_host_path(&e.store(), libc::major(md.rdev()), libc::minor(md.rdev()))
        .unwrap();
    assert_eq!(
        bsock,
        e.store().join("block/sockets").join(ctrlr(&b.volume_id))
    );
    for d in std::fs::read_dir(e.store().join("block/devices")).unwrap() {
        std::fs::metadata(d.unwrap().path()).unwrap();
    }
}

/// runtime-rs' `DirectVolumeMountInfo` (kata-types `mount.rs`).
#[derive(Debug, serde::Deserialize)]
#[allow(dead_code)]
struct RsMountInfo {
    #[serde(rename = "volume-type")]
    volume_type: String,
    device: String,
    #[serde(rename = "fstype")]
    fs_type: String,
    #[serde(default)]
    metadata: std::collections::HashMap<String, String>,
    #[serde(default)]
    options: Vec<String>,
}

/// runtime-rs from the mount source to the socket Dragonball connects to and the fstype its
/// agent storage gets, for a container mount at `dest`.
fn rs_resolves(e: &Env, tp: &Path, dest: &str) -> (PathBuf, String, RsMountInfo) {
    // join_path + is_direct_volume: the directory exists and is a directory.
    let enc = base64::engine::general_purpose::URL_SAFE.encode(tp.as_os_str().as_encoded_bytes());
    let dir = e.direct().join(enc);
    assert!(std::fs::metadata(&dir).unwrap().is_dir());
    // get_volume_mount_info.
    let info: RsMountInfo =
        serde_json::from_str(&std::fs::read_to_string(dir.join("mountInfo.json")).unwrap())
            .unwrap();
    // to_volume_type → Spdk; the device gets its `spdk://` prefix and loses it again.
    assert_eq!(info.volume_type, "spdkvol");
    let device = format!("spdk://{}", info.device);
    let (_, sock) = device.split_once("://").unwrap();
    // `stat` (follows links): S_IFSOCK, else "device ... is not valid".
    assert!(std::fs::metadata(sock).unwrap().file_type().is_socket());
    if let Some(n) = info.metadata.get("num_queues") {
        n.parse::<usize>().expect("num queues parse usize failed.");
    }
    if let Some(n) = info.metadata.get("queue_size") {
        n.parse::<u32>().expect("num queues parse u32 failed.");
    }
    // CRI's CSI mounts are bind mounts: DEFAULT_VOLUME_FS_TYPE, or `bind` under /dev.
    let fstype = if dest.starts_with("/dev") {
        "bind"
    } else {
        "ext4"
    };
    (PathBuf::from(sock), fstype.to_owned(), info)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_rs_attaches_the_socket_of_a_filesystem_volume() {
    let mut e = Env::start().await;
    let (vid, tp) = publish_fs(
        &mut e,
        "pvc-rs",
        64 << 20,
        "ext4",
        &[("kataRuntime", "rs")],
        false,
    )
    .await
    .unwrap();
    let (sock, fstype, info) = rs_resolves(&e, &tp, "/data");
    assert_eq!(sock, e.store().join("block/sockets").join(ctrlr(&vid)));
    assert_eq!(info.fs_type, "ext4");
    // The guest mounts ext4, and the volume holds ext4.
    assert_eq!(fs_on(&sock).await, Some(fstype.as_str()));
    // No device node for runtime-rs.
    assert!(!e.store().join("block/devices").join(ctrlr(&vid)).exists());
    assert!(e
        .driver
        .metrics
        .render()
        .contains("katablk_csi_published_volumes{handoff=\"direct_rs\"} 1"));
    e.node
        .node_unpublish_volume(unpublish_req(&vid, &tp))
        .await
        .unwrap();
    assert!(!katablk_csi::kata::direct_volume_dir(&e.direct(), &tp).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_rs_raw_block_is_left_unformatted() {
    let mut e = Env::start().await;
    let class = [("kataRuntime", "rs"), ("rawBlock", "true")];
    let (vid, tp) = publish_fs(&mut e, "pvc-raw", 64 << 20, "ext4", &class, false)
        .await
        .unwrap();
    let (sock, fstype, info) = rs_resolves(&e, &tp, "/dev/xvda");
    assert_eq!(fstype, "bind");
    assert_eq!(info.fs_type, "bind");
    // Nothing was written: the application gets the device as it is.
    assert_eq!(fs_on(&sock).await, None);
    let s = sock.clone();
    blk(move || {
        let mut b = blk_client(&s, false).unwrap();
        assert_eq!(b.write(0, 0, &pattern(7, 4096)), 0);
    })
    .await;
    // Publishing again keeps the data (never formatted over).
    e.node
        .node_unpublish_volume(unpublish_req(&vid, &tp))
        .await
        .unwrap();
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    let mut pr = publish_req(&vid, &tp, cap_fs("ext4"), false);
    pr.volume_context = class
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    e.node.node_publish_volume(pr).await.unwrap();
    let s = sock.clone();
    let head = blk(move || blk_client(&s, true).unwrap().read_ok(0, 0, 4096)).await;
    assert_eq!(head, pattern(7, 4096));
    assert!(e
        .driver
        .metrics
        .render()
        .contains("katablk_csi_published_volumes{handoff=\"direct_rs_raw\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtimes_refuse_what_they_cannot_mount() {
    // A node whose default is runtime-rs: xfs would be mounted as ext4 by runtime-rs.
    let mut e = Env::start_configured(None, |c| c.kata_runtime = KataRuntime::Rs).await;
    let err = publish_fs(&mut e, "pvc-xfs", 320 << 20, "xfs", &[], false)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("runtime-rs"), "{err:?}");
    // The class can say so at CreateVolume already.
    let err = publish_fs(
        &mut e,
        "pvc-xfs2",
        320 << 20,
        "xfs",
        &[("kataRuntime", "rs")],
        false,
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // Block PVs for runtime-rs: refused at CreateVolume.
    let mut r = create_req("pvc-rs-blk", 64 << 20);
    r.parameters.insert("kataRuntime".into(), "rs".into());
    assert_eq!(
        code(e.controller.create_volume(r).await),
        tonic::Code::InvalidArgument
    );
    // rawBlock for the Go runtime: refused.
    let err = publish_fs(
        &mut e,
        "pvc-go-raw",
        64 << 20,
        "ext4",
        &[("kataRuntime", "go"), ("rawBlock", "true")],
        false,
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // The class overrides the node: xfs for the Go runtime is fine on this node.
    if have("mkfs.xfs") {
        let (vid, tp) = publish_fs(
            &mut e,
            "pvc-go-xfs",
            320 << 20,
            "xfs",
            &[("kataRuntime", "go")],
            false,
        )
        .await
        .unwrap();
        let (sock, info) = go_runtime_resolves(&e, &tp, "sandbox-1");
        assert_eq!(info.fs_type, "xfs");
        assert_eq!(fs_on(&sock).await, Some("xfs"));
        e.node
            .node_unpublish_volume(unpublish_req(&vid, &tp))
            .await
            .unwrap();
    }
    // A publication of the same volume for another runtime at the same path: AlreadyExists.
    let (vid, tp) = publish_fs(&mut e, "pvc-rs-ok", 64 << 20, "ext4", &[], false)
        .await
        .unwrap();
    let mut pr = publish_req(&vid, &tp, cap_fs("ext4"), false);
    pr.volume_context = [("kataRuntime".to_owned(), "go".to_owned())].into();
    assert_eq!(
        code(e.node.node_publish_volume(pr).await),
        tonic::Code::AlreadyExists
    );
}
