//! The node flow against SPDK's own `vhost` app instead of katablk-target: the driver must work
//! unchanged on it. Runs when `SPDK_VHOST` names SPDK's `build/bin/vhost` (root, 2 MiB
//! hugepages: SPDK takes 512 MiB, the libblkio clients a few pages); otherwise it prints why it
//! is skipped and passes. `scripts/e2e/spdk-vhost-csi.sh` runs the same flow on the binaries.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::PathBuf;

use common::*;
use katablk_csi::csi;
use tonic::Code;

fn spdk_vhost() -> Option<PathBuf> {
    let Some(v) = std::env::var_os("SPDK_VHOST") else {
        eprintln!("SKIP: SPDK_VHOST is not set (path of SPDK's build/bin/vhost)");
        return None;
    };
    let v = PathBuf::from(v);
    if !v.is_file() {
        eprintln!("SKIP: SPDK_VHOST={} does not exist", v.display());
        return None;
    }
    Some(v)
}

/// The lvol bdev behind an alias `lvs/lvol`, as SPDK reports it (None once deleted).
async fn lvol_bdev(e: &Env, alias: &str) -> Option<String> {
    e.driver
        .rpc
        .bdev_get_bdev(alias)
        .await
        .unwrap()
        .map(|b| b.name)
}

fn expand_req(
    vol: &str,
    bytes: i64,
    c: csi::VolumeCapability,
) -> csi::ControllerExpandVolumeRequest {
    csi::ControllerExpandVolumeRequest {
        volume_id: vol.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capability: Some(c),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_flow_on_spdk_vhost() {
    let Some(vhost) = spdk_vhost() else { return };
    assert!(
        katablk_bdev::shm::SharedRegion::new(1)
            .unwrap()
            .is_hugepages(),
        "no free 2 MiB hugepages: SPDK's vhost needs them for the clients' buffers \
         (scripts/setup-hugepages.sh)"
    );
    let mut e = Env::start_on(Some(&vhost)).await;
    let probe = e
        .identity
        .probe(csi::ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(probe.ready, Some(true), "lvs0 was created on SPDK");

    // CreateVolume: an lvol on SPDK's lvstore, rounded up to the 4 MiB cluster.
    let v = e
        .controller
        .create_volume(create_req("pvc-spdk", 10 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(v.volume_id, "lvs0/pvc-spdk");
    assert_eq!(v.capacity_bytes, 12 << 20);
    let uuid = lvol_bdev(&e, &v.volume_id).await.expect("lvol on SPDK");

    // NodePublishVolume: SPDK's controller on that lvol, socket in the store, b 241:0 bound.
    let tp = e.target_path("pod1");
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    let req = publish_req(&v.volume_id, &tp, block_cap(), false);
    e.node.node_publish_volume(req.clone()).await.unwrap();
    e.node.node_publish_volume(req.clone()).await.unwrap();
    let name = ctrlr(&v.volume_id);
    let dev = e.store().join("block/devices").join(&name);
    let sock = e.store().join("block/sockets").join(&name);
    let md = std::fs::metadata(&dev).unwrap();
    assert!(md.file_type().is_block_device());
    assert_eq!((libc::major(md.rdev()), libc::minor(md.rdev())), (241, 0));
    assert!(std::fs::metadata(&sock).unwrap().file_type().is_socket());
    assert!(katablk_csi::mounts::is_mount_point(&tp).unwrap());
    assert_eq!(std::fs::metadata(&tp).unwrap().rdev(), md.rdev());
    let c = e
        .driver
        .rpc
        .vhost_get_controllers(Some(&name))
        .await
        .unwrap();
    assert_eq!(c[0].socket, sock.display().to_string());
    let b = c[0].backend_specific.block.as_ref().unwrap();
    assert_eq!(b.bdev.as_deref(), Some(uuid.as_str()));
    assert!(!b.readonly);

    // Data through the published socket (libblkio with 2 MiB-aligned hugepage buffers).
    let s = sock.clone();
    blk(move || {
        let mut c = blk_client(&s, false).unwrap();
        assert_eq!(c.capacity, 12 << 20);
        assert_eq!(c.write(0, 4096, &pattern(7, 1 << 20)), 0);
        assert_eq!(c.read_ok(0, 4096, 1 << 20), pattern(7, 1 << 20));
    })
    .await;

    // Delete while published: refused.
    let del = csi::DeleteVolumeRequest {
        volume_id: v.volume_id.clone(),
        ..Default::default()
    };
    assert_eq!(
        code(e.controller.delete_volume(del.clone()).await),
        Code::FailedPrecondition
    );

    // Online expansion: bdev_lvol_resize on SPDK; the controller reports the new capacity.
    let ex = e
        .controller
        .controller_expand_volume(expand_req(&v.volume_id, 20 << 20, block_cap()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ex.capacity_bytes, 20 << 20);
    let nx = e
        .node
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            volume_path: tp.display().to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 20 << 20,
                limit_bytes: 0,
            }),
            volume_capability: Some(block_cap()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(nx.capacity_bytes, 20 << 20);
    let s = sock.clone();
    blk(move || {
        let mut c = blk_client(&s, false).unwrap();
        assert_eq!(c.capacity, 20 << 20);
        assert_eq!(c.read_ok(0, 4096, 1 << 20), pattern(7, 1 << 20));
        assert_eq!(c.write(0, 16 << 20, &pattern(8, 4096)), 0);
    })
    .await;
    let st = e
        .node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.usage[0].total, 20 << 20);
    assert!(!st.volume_condition.unwrap().abnormal);

    // SPDK dies (kill -9) and comes back empty: the node config brings back the aio bdev (the
    // lvstore and lvols by examine), reconciliation the controller on the same socket; the data
    // and the new size are there.
    e.target.kill();
    assert_eq!(
        code(e.identity.probe(csi::ProbeRequest {}).await),
        Code::Unavailable
    );
    e.target.spawn();
    let mut w = katablk_csi::node_config::Watcher::new(e.driver.cfg.node_config.clone().unwrap());
    assert!(w.poll(&e.driver.rpc, true).await.unwrap());
    assert_eq!(
        lvol_bdev(&e, &v.volume_id).await.as_deref(),
        Some(uuid.as_str())
    );
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert_eq!(rep.restored, vec![name.clone()]);
    let s = sock.clone();
    blk(move || {
        let mut c = blk_client(&s, false).unwrap();
        assert_eq!(c.capacity, 20 << 20);
        assert_eq!(c.read_ok(0, 4096, 1 << 20), pattern(7, 1 << 20));
        assert_eq!(c.read_ok(0, 16 << 20, 4096), pattern(8, 4096));
    })
    .await;
    assert!(katablk_csi::mounts::is_mount_point(&tp).unwrap());

    // Snapshot, and a clone of it published next to the source.
    let snap = e
        .controller
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "snapshot-spdk".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    let r = restore_req("pvc-spdk-restore", 20 << 20, &snap.snapshot_id);
    let restored = e
        .controller
        .create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let tpr = e.target_path("pod2");
    e.node
        .node_publish_volume(publish_req(&restored.volume_id, &tpr, block_cap(), false))
        .await
        .unwrap();
    let rdev = std::fs::metadata(
        e.store()
            .join("block/devices")
            .join(ctrlr(&restored.volume_id)),
    )
    .unwrap()
    .rdev();
    assert_eq!(libc::minor(rdev), 1, "next free minor");
    let s = e
        .store()
        .join("block/sockets")
        .join(ctrlr(&restored.volume_id));
    blk(move || {
        let mut c = blk_client(&s, true).unwrap();
        assert_eq!(c.read_ok(0, 4096, 1 << 20), pattern(7, 1 << 20));
        assert_eq!(c.read_ok(0, 16 << 20, 4096), pattern(8, 4096));
    })
    .await;
    e.node
        .node_unpublish_volume(unpublish_req(&restored.volume_id, &tpr))
        .await
        .unwrap();
    e.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: restored.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    e.controller
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(lvol_bdev(&e, &snap.snapshot_id).await.is_none());

    // NodeUnpublishVolume while a client is connected: refused within the grace period (SPDK
    // itself would keep the RPC pending until the client goes), controller and socket kept.
    let s = sock.clone();
    let client = blk(move || blk_client(&s, false).unwrap()).await;
    let t0 = std::time::Instant::now();
    assert_eq!(
        code(
            e.node
                .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
                .await
        ),
        Code::FailedPrecondition
    );
    assert!(t0.elapsed() < std::time::Duration::from_secs(10));
    assert!(sock.exists() && dev.exists());
    drop(client);

    // NodeUnpublishVolume: bind mount, target file, device node, controller and socket gone.
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    assert!(!tp.exists());
    assert!(!dev.exists());
    assert!(!sock.exists());
    assert!(e
        .driver
        .rpc
        .vhost_get_controllers(None)
        .await
        .unwrap()
        .is_empty());
    assert!(lvol_bdev(&e, &v.volume_id).await.is_some(), "lvol kept");

    // DeleteVolume: the lvol is gone from SPDK; a repeat is fine.
    e.controller.delete_volume(del.clone()).await.unwrap();
    e.controller.delete_volume(del).await.unwrap();
    assert!(lvol_bdev(&e, &v.volume_id).await.is_none());
    assert!(lvol_bdev(&e, &uuid).await.is_none());

    // A filesystem volume: the driver formats it through SPDK's controller with libblkio.
    let have_mkfs = std::process::Command::new("mkfs.ext4")
        .arg("-V")
        .output()
        .is_ok();
    if !have_mkfs {
        eprintln!("SKIP (filesystem part): mkfs.ext4 is not installed");
    } else {
        let mut r = create_req("pvc-spdk-fs", 64 << 20);
        r.volume_capabilities = vec![mount_cap()];
        r.parameters
            .insert("csi.storage.k8s.io/fstype".into(), "ext4".into());
        r.parameters.insert("kataRuntime".into(), "rs".into());
        let fv = e
            .controller
            .create_volume(r)
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let tpf = e.target_path("fs1");
        std::fs::create_dir_all(tpf.parent().unwrap()).unwrap();
        let mut pr = publish_req(&fv.volume_id, &tpf, mount_cap(), false);
        pr.volume_context = fv.volume_context.clone();
        e.node.node_publish_volume(pr).await.unwrap();
        let fsock = e.store().join("block/sockets").join(ctrlr(&fv.volume_id));
        let info = katablk_csi::kata::read_mount_info(&e.direct(), &tpf).unwrap();
        assert_eq!(info.volume_type, "spdkvol");
        assert_eq!(info.device, fsock.display().to_string());
        let s = fsock.clone();
        let sb = blk(move || blk_client(&s, true).unwrap().read_ok(0, 0, 128 << 10)).await;
        assert_eq!(katablk_csi::format::probe_fs(&sb), Some("ext4"));
        e.node
            .node_unpublish_volume(unpublish_req(&fv.volume_id, &tpf))
            .await
            .unwrap();
        assert!(!fsock.exists());
        e.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: fv.volume_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(e
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .is_empty());
    assert!(
        e.target.daemon.try_wait().is_none(),
        "SPDK's vhost is still running"
    );
}
