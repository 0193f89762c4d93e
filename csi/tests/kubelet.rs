//! kubelet mapping a Block volume that katablk-csi published, step by step as kubelet's own
//! code does it (k8s.io/kubernetes v1.35, the same in 1.32–1.36):
//!
//! - `pkg/volume/csi/csi_block.go`: the publish path `<kubelet>/plugins/kubernetes.io/csi/
//!   volumeDevices/publish/<pv>/<podUID>`, the global map path `…/volumeDevices/<pv>/dev`;
//! - `pkg/volume/util/util.go` `MapBlockVolume` / `UnmapBlockVolume`;
//! - `pkg/volume/util/volumepathhandler/volume_path_handler.go` `MapDevice`,
//!   `mapBindMountDevice`, `mapSymlinkDevice`, `unmapBindMountDevice`, `IsDeviceBindMountExist`;
//! - `pkg/volume/util/volumepathhandler/volume_path_handler_linux.go` `AttachFileDevice`,
//!   `GetLoopDevice`, `getLoopDeviceFromSysfs`, `makeLoopDevice`, `DetachFileDevice`.
//!
//! Without katablk's lock the `losetup -f` of `makeLoopDevice` fails on the 241 node (ENXIO: no
//! kernel driver owns that major), which is what keeps a pod in ContainerCreating; the first test
//! checks that too, so the second one proves something.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use katablk_csi::kubelet_lock::{self, LockMode};

const PV: &str = "pvc-0b5e";
const POD: &str = "8d3c2a10-77aa-4c1e-9d7e-1c2b3a4d5e6f";

struct Paths {
    /// devicePath: the CSI publish path (NodePublishVolume's target_path).
    publish: PathBuf,
    /// globalMapPath (`…/volumeDevices/<pv>/dev`) and its `<podUID>` file.
    global_map: PathBuf,
    map_file: PathBuf,
    /// podVolumeMapPath (`pods/<uid>/volumeDevices/kubernetes.io~csi`) and the volume name.
    pod_map: PathBuf,
    volume_name: &'static str,
}

fn paths(kubelet: &Path) -> Paths {
    let vd = kubelet.join("plugins/kubernetes.io/csi/volumeDevices");
    Paths {
        publish: vd.join("publish").join(PV).join(POD),
        global_map: vd.join(PV).join("dev"),
        map_file: vd.join(PV).join("dev").join(POD),
        pod_map: kubelet
            .join("pods")
            .join(POD)
            .join("volumeDevices/kubernetes.io~csi"),
        volume_name: PV,
    }
}

/// `MapDevice`: `os.MkdirAll(mapPath, 0750)`.
fn mkdir_0750(p: &Path) {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(p)
        .unwrap();
}

/// `getLoopDeviceFromSysfs`: `filepath.EvalSymlinks(path)`, then the first
/// `/sys/block/loop*/loop/backing_file` (cleaned of "(deleted)") equal to path or its real path.
fn kubelet_get_loop_device(path: &Path) -> Option<PathBuf> {
    std::fs::metadata(path).ok()?; // GetLoopDevice: os.Stat, ErrDeviceNotFound if absent
    let real = std::fs::canonicalize(path).unwrap();
    let mut devs: Vec<PathBuf> = std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("loop"))
        .collect();
    devs.sort();
    for d in devs {
        let Ok(data) = std::fs::read_to_string(d.join("loop/backing_file")) else {
            continue;
        };
        let b = data.trim();
        let b = b.strip_suffix("(deleted)").unwrap_or(b).trim();
        if Path::new(b) == path || Path::new(b) == real {
            return Some(PathBuf::from("/dev").join(d.file_name().unwrap()));
        }
    }
    None
}

/// `MapBlockVolume`: bind mount, symlink, then `AttachFileDevice` (the fd lock). Returns the
/// loop device kubelet ends up with, or `losetup`'s failure.
fn kubelet_map(p: &Paths) -> Result<PathBuf, String> {
    // MapDevice(devicePath, globalMapPath, podUID, bindMount=true) → mapBindMountDevice.
    mkdir_0750(&p.global_map);
    match std::fs::metadata(&p.map_file) {
        Err(_) => {
            // os.OpenFile(linkPath, O_CREATE|O_RDWR, 0750)
            let f = std::fs::File::create(&p.map_file).unwrap();
            f.set_permissions(std::fs::Permissions::from_mode(0o750))
                .unwrap();
        }
        Ok(md) if md.file_type().is_block_device() => {} // "bind mount already exist": skipped
        Ok(_) => {} // "already exist but not mounted, skip creating file"
    }
    if !std::fs::metadata(&p.map_file)
        .unwrap()
        .file_type()
        .is_block_device()
    {
        // mounter.MountSensitiveWithoutSystemd(devicePath, linkPath, "", ["bind"])
        let st = Command::new("mount")
            .arg("--bind")
            .arg(&p.publish)
            .arg(&p.map_file)
            .status()
            .unwrap();
        assert!(st.success(), "bind mount of the publish path");
    }
    // MapDevice(devicePath, podVolumeMapPath, volumeMapName, bindMount=false) → mapSymlinkDevice.
    mkdir_0750(&p.pod_map);
    let link = p.pod_map.join(p.volume_name);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&p.publish, &link).unwrap();
    // AttachFileDevice(filepath.Join(globalMapPath, podUID)).
    if let Some(dev) = kubelet_get_loop_device(&p.map_file) {
        return Ok(dev);
    }
    // makeLoopDevice: losetup -f <path>, then the sysfs lookup again.
    let out = Command::new("losetup")
        .arg("-f")
        .arg(&p.map_file)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(format!(
            "losetup -f {} failed: {}",
            p.map_file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    kubelet_get_loop_device(&p.map_file).ok_or_else(|| "no loop device after losetup".into())
}

/// `UnmapBlockVolume`: DetachFileDevice, then UnmapDevice (symlink), then UnmapDevice (bind).
fn kubelet_unmap(p: &Paths) {
    // DetachFileDevice(globalUnmapPath/podUID): GetLoopDevice, removeLoopDevice (losetup -d).
    if let Some(dev) = kubelet_get_loop_device(&p.map_file) {
        let st = Command::new("losetup")
            .arg("-d")
            .arg(&dev)
            .status()
            .unwrap();
        assert!(st.success(), "losetup -d {}", dev.display());
    }
    // unmapSymlinkDevice: IsSymlinkExist (Lstat), os.Remove.
    let link = p.pod_map.join(p.volume_name);
    if std::fs::symlink_metadata(&link).is_ok_and(|m| m.file_type().is_symlink()) {
        std::fs::remove_file(&link).unwrap();
    }
    // unmapBindMountDevice: IsDeviceBindMountExist (Lstat is a device) → Unmount, os.Remove.
    let mapped =
        std::fs::symlink_metadata(&p.map_file).is_ok_and(|m| m.file_type().is_block_device());
    if mapped {
        let st = Command::new("umount").arg(&p.map_file).status().unwrap();
        assert!(st.success(), "umount {}", p.map_file.display());
    }
    if std::fs::symlink_metadata(&p.map_file).is_ok() {
        std::fs::remove_file(&p.map_file).unwrap();
    }
}

async fn publish_block(e: &mut Env, name: &str, target: &Path) -> String {
    let v = e
        .controller
        .create_volume(create_req(name, 8 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    // kubelet creates the publish directory's parent (csi_block.go SetUpDevice).
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let req = publish_req(&v.volume_id, target, block_cap(), false);
    e.node.node_publish_volume(req).await.unwrap();
    v.volume_id
}

fn loops_on(path: &Path) -> Vec<PathBuf> {
    kubelet_lock::loops_of(path)
}

#[tokio::test(flavor = "multi_thread")]
async fn without_the_lock_kubelet_cannot_map_a_241_node() {
    let mut e = Env::start_with(None, LockMode::Off).await;
    let p = paths(&e.kubelet());
    let id = publish_block(&mut e, PV, &p.publish).await;
    let rdev = std::fs::metadata(&p.publish).unwrap().rdev();
    assert_eq!(libc::major(rdev), 241);
    let err = kubelet_map(&p).unwrap_err();
    assert!(err.contains("losetup -f"), "{err}");
    kubelet_unmap(&p);
    e.node
        .node_unpublish_volume(unpublish_req(&id, &p.publish))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn kubelet_maps_and_unmaps_a_published_block_volume() {
    let mut e = Env::start_with(None, LockMode::Kubelet).await;
    let p = paths(&e.kubelet());
    let id = publish_block(&mut e, PV, &p.publish).await;

    // Before kubelet: the map file is katablk's, one read-only loop device serves it.
    let md = std::fs::symlink_metadata(&p.map_file).unwrap();
    assert!(md.file_type().is_file());
    let ours = loops_on(&p.map_file);
    assert_eq!(ours.len(), 1, "{ours:?}");
    let ro = std::fs::read_to_string(format!(
        "/sys/block/{}/ro",
        ours[0].file_name().unwrap().to_string_lossy()
    ))
    .unwrap();
    assert_eq!(ro.trim(), "1");
    // Publishing again changes nothing.
    e.node
        .node_publish_volume(publish_req(&id, &p.publish, block_cap(), false))
        .await
        .unwrap();
    assert_eq!(loops_on(&p.map_file), ours);

    // kubelet's MapBlockVolume finds that loop device and never runs losetup -f.
    let got = kubelet_map(&p).unwrap();
    assert_eq!(got, ours[0]);
    let mapped = std::fs::metadata(&p.map_file).unwrap();
    assert!(mapped.file_type().is_block_device());
    assert_eq!(libc::major(mapped.rdev()), 241);
    let link = p.pod_map.join(p.volume_name);
    assert_eq!(std::fs::read_link(&link).unwrap(), p.publish);
    // A second MapBlockVolume (kubelet retries after a restart) is the same.
    assert_eq!(kubelet_map(&p).unwrap(), ours[0]);
    // Publishing again while kubelet maps it changes nothing either.
    e.node
        .node_publish_volume(publish_req(&id, &p.publish, block_cap(), false))
        .await
        .unwrap();
    assert_eq!(loops_on(&p.map_file), ours);
    // Stats: healthy with the lock held.
    let st = e
        .node
        .node_get_volume_stats(katablk_csi::csi::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: p.publish.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let c = st.volume_condition.unwrap();
    assert!(!c.abnormal, "{}", c.message);

    // kubelet's UnmapBlockVolume, then NodeUnpublishVolume: nothing is left.
    kubelet_unmap(&p);
    assert!(loops_on(&p.map_file).is_empty());
    e.node
        .node_unpublish_volume(unpublish_req(&id, &p.publish))
        .await
        .unwrap();
    assert!(std::fs::symlink_metadata(&p.map_file).is_err());
    assert!(std::fs::symlink_metadata(&p.publish).is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn unpublish_and_reconciliation_remove_leftovers_but_no_foreign_loop() {
    let mut e = Env::start_with(None, LockMode::Kubelet).await;
    let p = paths(&e.kubelet());
    let id = publish_block(&mut e, PV, &p.publish).await;
    assert_eq!(loops_on(&p.map_file).len(), 1);

    // NodeUnpublishVolume without kubelet's unmap (kubelet died): the lock goes too.
    e.node
        .node_unpublish_volume(unpublish_req(&id, &p.publish))
        .await
        .unwrap();
    assert!(loops_on(&p.map_file).is_empty());
    assert!(std::fs::symlink_metadata(&p.map_file).is_err());

    // A lock nobody records (the driver was killed between its steps): reconciliation
    // releases it.
    let stray = e
        .kubelet()
        .join("plugins/kubernetes.io/csi/volumeDevices/pvc-stray/dev/pod-x");
    kubelet_lock::prepare(&e.kubelet(), &stray, "lvs0/gone").unwrap();
    assert_eq!(loops_on(&stray).len(), 1);

    // A loop device of someone else on a file in the same layout: never touched.
    let foreign = e
        .kubelet()
        .join("plugins/kubernetes.io/csi/volumeDevices/pvc-other/dev/pod-y");
    std::fs::create_dir_all(foreign.parent().unwrap()).unwrap();
    std::fs::write(&foreign, vec![0x5a; 4096]).unwrap();
    let out = Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&foreign)
        .output()
        .unwrap();
    assert!(out.status.success());
    let foreign_loop = String::from_utf8_lossy(&out.stdout).trim().to_owned();

    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert_eq!(rep.orphan_locks, vec![stray.clone()]);
    assert!(loops_on(&stray).is_empty());
    assert!(std::fs::symlink_metadata(&stray).is_err());
    assert_eq!(loops_on(&foreign).len(), 1);
    assert!(foreign.exists());
    // A second pass has nothing to do.
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert!(rep.orphan_locks.is_empty());
    let st = Command::new("losetup")
        .args(["-d", &foreign_loop])
        .status()
        .unwrap();
    assert!(st.success());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_target_outside_kubelets_layout_is_refused_with_a_clear_error() {
    let mut e = Env::start_with(None, LockMode::Kubelet).await;
    let v = e
        .controller
        .create_volume(create_req("pvc-odd", 8 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let tp = e.target_path("odd");
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    let r = e
        .node
        .node_publish_volume(publish_req(&v.volume_id, &tp, block_cap(), false))
        .await;
    let s = r.unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
    assert!(
        s.message().contains("--kubelet-block-lock=off"),
        "{}",
        s.message()
    );
    // Nothing was made: no controller, no device node, no record.
    assert!(!tp.exists());
    assert!(std::fs::read_dir(e.store().join("block/devices"))
        .unwrap()
        .next()
        .is_none());
}
