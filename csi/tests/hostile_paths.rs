//! Target paths laid out by someone hostile (anything that can write below the kubelet
//! directory: a hostPath pod, a compromised runtime): the node service never creates, mounts
//! or unmounts anything outside the kubelet directory through a symlink, a kubelet directory
//! reached through a symlink does not stack mounts, one bad record does not stop
//! reconciliation (and its unpublish cleans up without following the link), and a target
//! another volume is published at is left alone. Findings C1–C7 of the hostile-input review.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use common::*;
use katablk_csi::kubelet_lock::LockMode;
use tonic::Code;

/// Mount points in the mount table at `p` exactly (as the kernel shows them: resolved).
fn mounts_at(p: &Path) -> usize {
    katablk_csi::mounts::mount_points()
        .unwrap()
        .iter()
        .filter(|m| m.as_path() == p)
        .count()
}

fn mounts_under(p: &Path) -> usize {
    katablk_csi::mounts::mount_points()
        .unwrap()
        .iter()
        .filter(|m| m.starts_with(p))
        .count()
}

async fn volume(e: &mut Env, name: &str) -> String {
    e.controller
        .create_volume(create_req(name, 64 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id
}

fn outside(e: &Env) -> PathBuf {
    let o = e.root().join("outside");
    std::fs::create_dir_all(&o).unwrap();
    o
}

fn empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).unwrap().next().is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlinked_ancestor_is_never_followed() {
    // C1: the lower part of the path does not exist yet; create_dir_all and mount(2) would
    // have made it, and mounted, under the link's target.
    let mut e = Env::start().await;
    let vid = volume(&mut e, "pvc-c1").await;
    let out = outside(&e);
    std::fs::create_dir_all(e.kubelet().join("pods")).unwrap();
    symlink(&out, e.kubelet().join("pods/evil")).unwrap();
    for (cap, tp) in [
        (block_cap(), e.kubelet().join("pods/evil/a/b/dev")),
        (mount_cap(), e.kubelet().join("pods/evil/volumes/x/mount")),
    ] {
        let r = e
            .node
            .node_publish_volume(publish_req(&vid, &tp, cap, false))
            .await;
        let err = r.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("symlink"), "{err:?}");
        assert!(empty(&out), "something was made outside");
        assert_eq!(mounts_under(&out.canonicalize().unwrap()), 0);
    }
    // Nothing was recorded, so reconciliation has nothing to re-mount there.
    assert!(e.driver.state.published.all().is_empty());
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert!(rep.failed.is_empty(), "{rep:?}");
    assert!(empty(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlinked_target_is_never_mounted_over_or_unmounted_through() {
    let mut e = Env::start().await;
    let vid = volume(&mut e, "pvc-c2").await;
    let out = outside(&e);
    // C2: the last component links to a file outside.
    let victim = out.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let tp = e.target_path("c2");
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    symlink(&victim, &tp).unwrap();
    let err = e
        .node
        .node_publish_volume(publish_req(&vid, &tp, block_cap(), false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert_eq!(mounts_at(&victim.canonicalize().unwrap()), 0);
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");

    // C3: unpublish of a target that links to a filesystem mounted outside.
    let mnt = out.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let src = out.join("src");
    std::fs::create_dir_all(&src).unwrap();
    katablk_csi::mounts::bind_mount(&src, &mnt, false).unwrap();
    let real_mnt = mnt.canonicalize().unwrap();
    assert_eq!(mounts_at(&real_mnt), 1);
    std::fs::remove_file(&tp).unwrap();
    symlink(&mnt, &tp).unwrap();
    e.node
        .node_unpublish_volume(unpublish_req(&vid, &tp))
        .await
        .unwrap();
    assert_eq!(mounts_at(&real_mnt), 1, "a mount outside was unmounted");
    assert!(
        std::fs::symlink_metadata(&tp).is_err(),
        "the link itself is removed"
    );
    katablk_csi::mounts::unmount(&mnt).unwrap();

    // Stats and expansion name no volume through a link.
    symlink(&mnt, &tp).unwrap();
    let st = e
        .node
        .node_get_volume_stats(katablk_csi::csi::NodeGetVolumeStatsRequest {
            volume_id: vid.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(st), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_dir_behind_a_symlink_does_not_stack_mounts() {
    // C4: /var/lib/kubelet -> /data/kubelet. The mount table shows resolved paths.
    let mut e = Env::start_configured(None, |c| {
        let real = c.kubelet_dir.clone();
        std::fs::create_dir_all(&real).unwrap();
        let link = real.with_file_name("kubelet-link");
        symlink(&real, &link).unwrap();
        c.kubelet_dir = link;
        c.kubelet_block_lock = LockMode::Kubelet;
    })
    .await;
    let link = e.driver.cfg.kubelet_dir.clone();
    let vid = volume(&mut e, "pvc-c4").await;
    let tp = link.join("plugins/kubernetes.io/csi/volumeDevices/publish/pvc-c4/pod-1");
    e.node
        .node_publish_volume(publish_req(&vid, &tp, block_cap(), false))
        .await
        .unwrap();
    let real_tp = e
        .kubelet()
        .canonicalize()
        .unwrap()
        .join("plugins/kubernetes.io/csi/volumeDevices/publish/pvc-c4/pod-1");
    assert_eq!(mounts_at(&real_tp), 1);
    let map = link.join("plugins/kubernetes.io/csi/volumeDevices/pvc-c4/dev/pod-1");
    assert_eq!(katablk_csi::kubelet_lock::loops_of(&map).len(), 1);
    for _ in 0..3 {
        let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
        assert!(
            rep.orphan_locks.is_empty() && rep.failed.is_empty(),
            "{rep:?}"
        );
    }
    assert_eq!(mounts_at(&real_tp), 1, "reconciliation stacked bind mounts");
    assert_eq!(katablk_csi::kubelet_lock::loops_of(&map).len(), 1);
    let st = e
        .node
        .node_get_volume_stats(katablk_csi::csi::NodeGetVolumeStatsRequest {
            volume_id: vid.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!st.volume_condition.as_ref().unwrap().abnormal, "{st:?}");
    e.node
        .node_unpublish_volume(unpublish_req(&vid, &tp))
        .await
        .unwrap();
    assert_eq!(mounts_at(&real_tp), 0);
    assert!(katablk_csi::kubelet_lock::loops_of(&map).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_record_does_not_stop_reconciliation() {
    // C5: a record whose target cannot be restored; another volume lost its controller.
    let mut e = Env::start().await;
    let a = volume(&mut e, "pvc-c5a").await;
    let b = volume(&mut e, "pvc-c5b").await;
    let tpa = e.target_path("c5a");
    std::fs::create_dir_all(tpa.parent().unwrap()).unwrap();
    e.node
        .node_publish_volume(publish_req(&a, &tpa, block_cap(), false))
        .await
        .unwrap();
    let tpb = e.target_path("c5b");
    std::fs::create_dir_all(tpb.parent().unwrap()).unwrap();
    e.node
        .node_publish_volume(publish_req(&b, &tpb, block_cap(), false))
        .await
        .unwrap();
    // a's pod directory is replaced by a link (as if planted after the publish).
    let out = outside(&e);
    katablk_csi::mounts::unmount(&tpa).unwrap();
    std::fs::remove_dir_all(tpa.parent().unwrap()).unwrap();
    symlink(&out, tpa.parent().unwrap()).unwrap();
    // b's controller is gone (a target restart without state).
    let cb = ctrlr(&b);
    e.driver.rpc.vhost_delete_controller(&cb).await.unwrap();
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert_eq!(rep.failed, vec![a.clone()], "{rep:?}");
    assert!(rep.restored.contains(&cb), "{rep:?}");
    assert!(empty(&out), "restored through the link");
    // Unpublish of the bad record cleans up the volume's side without following the link.
    e.node
        .node_unpublish_volume(unpublish_req(&a, &tpa))
        .await
        .unwrap();
    assert!(empty(&out));
    assert!(e.driver.state.published.get(&a).is_none());
    assert!(!e.store().join("block/devices").join(ctrlr(&a)).exists());
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert!(rep.failed.is_empty(), "{rep:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_in_use_by_another_volume_is_left_alone() {
    // C6.
    let mut e = Env::start().await;
    let a = volume(&mut e, "pvc-c6a").await;
    let b = volume(&mut e, "pvc-c6b").await;
    let tp = e.target_path("c6");
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    e.node
        .node_publish_volume(publish_req(&a, &tp, block_cap(), false))
        .await
        .unwrap();
    let err = e
        .node
        .node_publish_volume(publish_req(&b, &tp, block_cap(), false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(&a), "{err:?}");
    e.node
        .node_unpublish_volume(unpublish_req(&b, &tp))
        .await
        .unwrap();
    let real = tp.canonicalize().unwrap();
    assert_eq!(mounts_at(&real), 1, "b's unpublish unmounted a");
    e.node
        .node_unpublish_volume(unpublish_req(&a, &tp))
        .await
        .unwrap();
    assert_eq!(mounts_at(&real), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_and_odd_paths_get_short_clear_errors() {
    // C5's 1 MB target path and C7's echo of huge inputs; `./` segments.
    let mut e = Env::start().await;
    let vid = volume(&mut e, "pvc-c7").await;
    let huge = format!("{}/{}", e.kubelet().display(), "a".repeat(1 << 20));
    let err = e
        .node
        .node_publish_volume(publish_req(&vid, Path::new(&huge), block_cap(), false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().len() < 1024, "{} bytes", err.message().len());
    assert!(e.driver.state.published.all().is_empty());
    let dot = format!("{}/pods/./x/vol", e.kubelet().display());
    let err = e
        .node
        .node_publish_volume(publish_req(&vid, Path::new(&dot), block_cap(), false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let huge_id = "x".repeat(1 << 20);
    let err = e
        .node
        .node_unpublish_volume(unpublish_req(&huge_id, &e.target_path("x")))
        .await
        .unwrap_err();
    assert!(err.message().len() < 1024, "{} bytes", err.message().len());
}
