//! End-to-end tests: the driver over a real unix-socket gRPC client, backed by a real
//! katablk-target process (root: real mknod and bind mounts).
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

use common::*;
use katablk_csi::csi::{self, volume_capability::access_mode::Mode};
use katablk_csi::volume::LvolId;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_volume_lifecycle() {
    let mut e = Env::start().await;
    let probe = e
        .identity
        .probe(csi::ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(probe.ready, Some(true));

    // Provision: rounded up to the 4 MiB cluster, with this node's topology; idempotent.
    let v = e
        .controller
        .create_volume(create_req("pvc-block", 10 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(v.volume_id, "lvs0/pvc-block");
    assert_eq!(v.capacity_bytes, 12 << 20);
    assert_eq!(
        v.accessible_topology[0].segments[katablk_csi::TOPOLOGY_KEY],
        "node-a"
    );
    let again = e
        .controller
        .create_volume(create_req("pvc-block", 10 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, v.volume_id);
    assert_eq!(
        code(
            e.controller
                .create_volume(create_req("pvc-block", 64 << 20))
                .await
        ),
        Code::AlreadyExists
    );

    // Publish as a block device.
    let tp = e.target_path("pod1");
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    let req = publish_req(&v.volume_id, &tp, block_cap(), false);
    e.node.node_publish_volume(req.clone()).await.unwrap();
    e.node.node_publish_volume(req.clone()).await.unwrap(); // idempotent
    let name = ctrlr(&v.volume_id);
    let dev = e.store().join("block/devices").join(&name);
    let sock = e.store().join("block/sockets").join(&name);
    let md = std::fs::metadata(&dev).unwrap();
    assert!(md.file_type().is_block_device());
    assert_eq!(libc::major(md.rdev()), 241);
    assert_eq!(libc::minor(md.rdev()), 0);
    assert!(sock.exists());
    assert!(katablk_csi::mounts::is_mount_point(&tp).unwrap());
    assert_eq!(std::fs::metadata(&tp).unwrap().rdev(), md.rdev());
    // Same target path, other options: AlreadyExists; another target path: FailedPrecondition.
    assert_eq!(
        code(
            e.node
                .node_publish_volume(publish_req(&v.volume_id, &tp, block_cap(), true))
                .await
        ),
        Code::AlreadyExists
    );
    let tp2 = e.target_path("pod2");
    assert_eq!(
        code(
            e.node
                .node_publish_volume(publish_req(&v.volume_id, &tp2, block_cap(), false))
                .await
        ),
        Code::FailedPrecondition
    );

    // Data path through the published socket.
    let s2 = sock.clone();
    blk(move || {
        let mut c = blk_client(&s2, false).unwrap();
        assert_eq!(c.capacity, 12 << 20);
        assert_eq!(c.write(0, 4096, &pattern(7, 65536)), 0);
        assert_eq!(c.read_ok(0, 4096, 65536), pattern(7, 65536));
    })
    .await;

    // Stats: healthy, capacity = lvol size, used = allocated clusters.
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
    assert_eq!(st.usage[0].total, 12 << 20);
    assert!(st.usage[0].used > 0);
    assert!(!st.volume_condition.unwrap().abnormal);

    // A second volume, read-only: read-only controller, next minor.
    let ro = e
        .controller
        .create_volume(create_req("pvc-ro", 4 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let tpr = e.target_path("pod3");
    e.node
        .node_publish_volume(publish_req(
            &ro.volume_id,
            &tpr,
            cap(true, Mode::SingleNodeReaderOnly),
            false,
        ))
        .await
        .unwrap();
    let c = e
        .driver
        .rpc
        .vhost_get_controllers(Some(&ctrlr(&ro.volume_id)))
        .await
        .unwrap();
    assert!(c[0].backend_specific.block.as_ref().unwrap().readonly);
    let rmd =
        std::fs::metadata(e.store().join("block/devices").join(ctrlr(&ro.volume_id))).unwrap();
    assert_eq!(libc::minor(rmd.rdev()), 1);
    assert!(katablk_csi::mounts::is_read_only_mount(&tpr).unwrap());

    // Delete while published: FailedPrecondition.
    assert_eq!(
        code(
            e.controller
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: v.volume_id.clone(),
                    ..Default::default()
                })
                .await
        ),
        Code::FailedPrecondition
    );

    // Unpublish: mount, node and controller gone; lvol kept; repeat is fine.
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
        .vhost_get_controllers(Some(&name))
        .await
        .map(|v| v.is_empty())
        .unwrap_or(true));
    assert!(e
        .driver
        .lvol(&LvolId::parse(&v.volume_id).unwrap())
        .await
        .unwrap()
        .is_some());

    // Republish keeps the data.
    e.node.node_publish_volume(req.clone()).await.unwrap();
    let s3 = sock.clone();
    blk(move || {
        let mut c = blk_client(&s3, false).unwrap();
        assert_eq!(c.read_ok(0, 4096, 65536), pattern(7, 65536));
    })
    .await;
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    e.node
        .node_unpublish_volume(unpublish_req(&ro.volume_id, &tpr))
        .await
        .unwrap();

    for id in [&v.volume_id, &ro.volume_id] {
        let d = csi::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        };
        e.controller.delete_volume(d.clone()).await.unwrap();
        e.controller.delete_volume(d).await.unwrap();
    }
    let l = e
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(l.entries.is_empty());
    assert!(e
        .driver
        .metrics
        .render()
        .contains("method=\"NodePublishVolume\",code=\"Ok\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filesystem_volume_is_formatted_once_and_handed_to_kata() {
    let mut e = Env::start().await;
    let mut r = create_req("pvc-fs", 64 << 20);
    r.volume_capabilities = vec![mount_cap()];
    r.parameters
        .insert("csi.storage.k8s.io/fstype".into(), "ext4".into());
    r.parameters.insert("cpumask".into(), "0x1".into());
    r.parameters.insert("thinProvision".into(), "true".into());
    // runtime-rs' mountInfo.json (the Go runtime's is in tests/kata.rs).
    r.parameters.insert("kataRuntime".into(), "rs".into());
    let v = e
        .controller
        .create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(v.volume_context["fstype"], "ext4");
    assert_eq!(v.volume_context["kataRuntime"], "rs");
    assert_eq!(v.volume_context["cpumask"], "0x1");
    let tp = e.target_path("fs1");
    std::fs::create_dir_all(tp.parent().unwrap()).unwrap();
    let mut pr = publish_req(&v.volume_id, &tp, mount_cap(), false);
    pr.volume_context = v.volume_context.clone();
    e.node.node_publish_volume(pr).await.unwrap();
    assert!(tp.is_dir());
    let c = e
        .driver
        .rpc
        .vhost_get_controllers(Some(&ctrlr(&v.volume_id)))
        .await
        .unwrap();
    assert_eq!(c[0].cpumask, "0x1");
    // A thin volume: formatting allocated only a few clusters of the 64 MiB.
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
    assert!(st.usage[0].used < st.usage[0].total, "{:?}", st.usage);
    assert!(!st.volume_condition.unwrap().abnormal);
    // Expanding a filesystem volume asks for node expansion.
    let ex = e
        .controller
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 96 << 20,
                limit_bytes: 0,
            }),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ex.node_expansion_required);
    assert_eq!(ex.capacity_bytes, 96 << 20);
    let sock = e.store().join("block/sockets").join(ctrlr(&v.volume_id));
    let info = katablk_csi::kata::read_mount_info(&e.direct(), &tp).unwrap();
    assert_eq!(info.volume_type, "spdkvol");
    assert_eq!(info.device, sock.display().to_string());
    assert_eq!(info.fstype, "ext4");
    let f = katablk_csi::kata::direct_volume_dir(&e.direct(), &tp).join("mountInfo.json");
    assert_eq!(
        std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let raw = std::fs::read_to_string(&f).unwrap();
    assert!(raw.contains("\"volume-type\"") && !raw.contains("volume_type"));

    // The superblock is in the lvol; remember its UUID.
    let s = sock.clone();
    let sb = blk(move || blk_client(&s, true).unwrap().read_ok(0, 0, 128 << 10)).await;
    assert_eq!(katablk_csi::format::probe_fs(&sb), Some("ext4"));
    let uuid = sb[0x468..0x478].to_vec();

    // Unpublish and publish again (read-only): not reformatted.
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    assert!(katablk_csi::kata::read_mount_info(&e.direct(), &tp).is_none());
    assert!(!tp.exists());
    e.node
        .node_publish_volume(publish_req(&v.volume_id, &tp, mount_cap(), true))
        .await
        .unwrap();
    let info = katablk_csi::kata::read_mount_info(&e.direct(), &tp).unwrap();
    assert!(info.options.contains(&"ro".to_string()));
    let s = sock.clone();
    let sb2 = blk(move || blk_client(&s, true).unwrap().read_ok(0, 0, 128 << 10)).await;
    assert_eq!(&sb2[0x468..0x478], &uuid[..]);
    // Wrong fstype for an existing filesystem: FailedPrecondition.
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    let mut xfs = mount_cap();
    if let Some(csi::volume_capability::AccessType::Mount(m)) = xfs.access_type.as_mut() {
        m.fs_type = "xfs".into();
    }
    assert_eq!(
        code(
            e.node
                .node_publish_volume(publish_req(&v.volume_id, &tp, xfs, false))
                .await
        ),
        Code::FailedPrecondition
    );
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    e.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: v.volume_id,
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_clone_expand() {
    let mut e = Env::start().await;
    let v = e
        .controller
        .create_volume(create_req("pvc-src", 8 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let tp = e.target_path("src");
    e.node
        .node_publish_volume(publish_req(&v.volume_id, &tp, block_cap(), false))
        .await
        .unwrap();
    let sock = e.store().join("block/sockets").join(ctrlr(&v.volume_id));
    let s = sock.clone();
    blk(move || {
        assert_eq!(
            blk_client(&s, false)
                .unwrap()
                .write(0, 0, &pattern(3, 8192)),
            0
        )
    })
    .await;

    // Snapshot (idempotent; name reuse for another source is AlreadyExists).
    let sreq = csi::CreateSnapshotRequest {
        source_volume_id: v.volume_id.clone(),
        name: "snapshot-1".into(),
        ..Default::default()
    };
    let snap = e
        .controller
        .create_snapshot(sreq.clone())
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    assert_eq!(snap.source_volume_id, v.volume_id);
    assert_eq!(snap.size_bytes, 8 << 20);
    let snap2 = e
        .controller
        .create_snapshot(sreq)
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(snap2.snapshot_id, snap.snapshot_id);
    assert_eq!(snap2.creation_time, snap.creation_time);
    let other = e
        .controller
        .create_volume(create_req("pvc-other", 4 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(
        code(
            e.controller
                .create_snapshot(csi::CreateSnapshotRequest {
                    source_volume_id: other.volume_id.clone(),
                    name: "snapshot-1".into(),
                    ..Default::default()
                })
                .await
        ),
        Code::AlreadyExists
    );
    // Writes after the snapshot do not reach it.
    let s = sock.clone();
    blk(move || {
        assert_eq!(
            blk_client(&s, false)
                .unwrap()
                .write(0, 0, &pattern(9, 8192)),
            0
        )
    })
    .await;

    let ls = e
        .controller
        .list_snapshots(csi::ListSnapshotsRequest {
            source_volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ls.entries.len(), 1);
    let by_id = e
        .controller
        .list_snapshots(csi::ListSnapshotsRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_id.entries.len(), 1);

    // Restore from the snapshot (bigger than it), and clone from the live volume.
    let r = restore_req("pvc-restore", 16 << 20, &snap.snapshot_id);
    let restored = e
        .controller
        .create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(restored.capacity_bytes, 16 << 20);
    assert!(restored.content_source.is_some());
    let mut r = create_req("pvc-clone", 8 << 20);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: v.volume_id.clone(),
            },
        )),
    });
    let cloned = e
        .controller
        .create_volume(r.clone())
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let again = e
        .controller
        .create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, cloned.volume_id);

    // Check contents through their own controllers.
    for (vol, want) in [(&restored.volume_id, 3u8), (&cloned.volume_id, 9u8)] {
        let t = e.target_path(&vol.replace('/', "_"));
        e.node
            .node_publish_volume(publish_req(vol, &t, block_cap(), false))
            .await
            .unwrap();
        let s = e.store().join("block/sockets").join(ctrlr(vol));
        let data = blk(move || blk_client(&s, true).unwrap().read_ok(0, 0, 8192)).await;
        assert_eq!(data, pattern(u64::from(want), 8192), "{vol}");
        e.node
            .node_unpublish_volume(unpublish_req(vol, &t))
            .await
            .unwrap();
    }

    // Online expansion of the published source: the client sees the new capacity.
    let ex = e
        .controller
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
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
    assert_eq!(ex.capacity_bytes, 20 << 20);
    assert!(!ex.node_expansion_required);
    let nx = e
        .node
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(nx.capacity_bytes, 20 << 20);
    let s = sock.clone();
    let cap = blk(move || blk_client(&s, true).unwrap().capacity).await;
    assert_eq!(cap, 20 << 20);

    // Pagination over the volumes.
    let p1 = e
        .controller
        .list_volumes(csi::ListVolumesRequest {
            max_entries: 2,
            starting_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p1.entries.len(), 2);
    let p2 = e
        .controller
        .list_volumes(csi::ListVolumesRequest {
            max_entries: 2,
            starting_token: p1.next_token.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p2.entries.len(), 2);
    assert!(p2.next_token.is_empty());
    assert_eq!(
        code(
            e.controller
                .list_volumes(csi::ListVolumesRequest {
                    max_entries: 1,
                    starting_token: "bogus".into()
                })
                .await
        ),
        Code::Aborted
    );

    // Capacity shrinks as volumes are made.
    let cap = e
        .controller
        .get_capacity(csi::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(cap.available_capacity > 0 && (cap.available_capacity as u64) < DISK_SIZE);

    // Delete everything (the snapshot while volumes depend on it, too).
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    let ds = csi::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    };
    e.controller.delete_snapshot(ds.clone()).await.unwrap();
    e.controller.delete_snapshot(ds).await.unwrap();
    for id in [
        &v.volume_id,
        &restored.volume_id,
        &cloned.volume_id,
        &other.volume_id,
    ] {
        e.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let lv = e
        .driver
        .rpc
        .bdev_lvol_get_lvols(&Default::default())
        .await
        .unwrap();
    assert!(lv.is_empty(), "left over: {lv:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_repeats_are_safe() {
    let e = Env::start().await;
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let mut c = e.controller.clone();
        tasks.push(tokio::spawn(async move {
            c.create_volume(create_req("pvc-race", 8 << 20))
                .await
                .map(|r| r.into_inner().volume.unwrap().volume_id)
        }));
    }
    let mut ids = Vec::new();
    for t in tasks {
        ids.push(t.await.unwrap().unwrap());
    }
    assert!(ids.iter().all(|i| i == "lvs0/pvc-race"));
    let tp = e.target_path("race");
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let mut n = e.node.clone();
        let r = publish_req("lvs0/pvc-race", &tp, block_cap(), false);
        tasks.push(tokio::spawn(async move {
            n.node_publish_volume(r).await.map(|_| ())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(e.driver.store.device_nodes().unwrap().len(), 1);
    let mounts = katablk_csi::mounts::mount_points().unwrap();
    assert_eq!(mounts.iter().filter(|m| **m == tp).count(), 1);
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let mut n = e.node.clone();
        let r = unpublish_req("lvs0/pvc-race", &tp);
        tasks.push(tokio::spawn(async move {
            n.node_unpublish_volume(r).await.map(|_| ())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert!(e.driver.store.device_nodes().unwrap().is_empty());
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let mut c = e.controller.clone();
        tasks.push(tokio::spawn(async move {
            c.delete_volume(csi::DeleteVolumeRequest {
                volume_id: "lvs0/pvc-race".into(),
                ..Default::default()
            })
            .await
            .map(|_| ())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert!(e.driver.locks.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_restart_is_reconciled() {
    let mut e = Env::start().await;
    let v = e
        .controller
        .create_volume(create_req("pvc-keep", 8 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let tp = e.target_path("keep");
    e.node
        .node_publish_volume(publish_req(&v.volume_id, &tp, block_cap(), false))
        .await
        .unwrap();
    let name = ctrlr(&v.volume_id);
    let sock = e.store().join("block/sockets").join(&name);
    let s = sock.clone();
    blk(move || {
        let mut c = blk_client(&s, false).unwrap();
        assert_eq!(c.write(0, 0, &pattern(5, 4096)), 0);
        c.queues[0].flush(0, blkio::ReqFlags::empty());
    })
    .await;

    // Orphans of ours (and a foreign node that must stay).
    let st = e.driver.store.clone();
    st.ensure_device_node("ctrlr-00000000deadbeef", None)
        .unwrap();
    st.ensure_device_node("someone-else", None).unwrap();

    // Target dies: Probe and controller calls say UNAVAILABLE.
    e.target.kill();
    assert_eq!(
        code(e.identity.probe(csi::ProbeRequest {}).await),
        Code::Unavailable
    );
    assert_eq!(
        code(
            e.controller
                .create_volume(create_req("pvc-x", 4 << 20))
                .await
        ),
        Code::Unavailable
    );
    let st = e
        .node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(st), Code::Unavailable);

    // It comes back empty (no --state-dir): the node config re-declares the lvstore (examined,
    // not re-created) and reconciliation restores the controller on the same socket.
    e.target.spawn();
    let mut w = katablk_csi::node_config::Watcher::new(e.driver.cfg.node_config.clone().unwrap());
    assert!(w.poll(&e.driver.rpc, true).await.unwrap());
    // An unchanged file with everything present is a no-op.
    assert!(w.poll(&e.driver.rpc, false).await.unwrap());
    let cond = e
        .node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume_condition
        .unwrap();
    assert!(cond.abnormal, "controller is missing after the restart");
    assert!(cond.message.contains("controller"));
    let orphan = katablk_rpc::methods::VhostCreateBlkControllerParams {
        ctrlr: "ctrlr-0000000000000bad".into(),
        dev_name: v.volume_id.clone(),
        ..Default::default()
    };
    e.driver
        .rpc
        .vhost_create_blk_controller(&orphan)
        .await
        .unwrap();
    let rep = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert_eq!(rep.restored, vec![name.clone()]);
    assert_eq!(
        rep.orphan_controllers,
        vec!["ctrlr-0000000000000bad".to_string()]
    );
    assert_eq!(rep.orphan_nodes, vec!["ctrlr-00000000deadbeef".to_string()]);
    assert!(e
        .driver
        .store
        .device_nodes()
        .unwrap()
        .contains_key("someone-else"));
    let again = katablk_csi::reconcile::reconcile(&e.driver).await.unwrap();
    assert_eq!(again, Default::default());
    let s = sock.clone();
    let data = blk(move || blk_client(&s, false).unwrap().read_ok(0, 0, 4096)).await;
    assert_eq!(data, pattern(5, 4096));
    assert!(katablk_csi::mounts::is_mount_point(&tp).unwrap());
    let cond = e
        .node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: tp.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume_condition
        .unwrap();
    assert!(!cond.abnormal, "{}", cond.message);
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    e.driver.store.remove_device_node("someone-else").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_codes() {
    let mut e = Env::start().await;
    let c = &mut e.controller;
    // INVALID_ARGUMENT
    assert_eq!(
        code(c.create_volume(create_req("", 1)).await),
        Code::InvalidArgument
    );
    let mut r = create_req("pvc-e", 1);
    r.parameters.clear();
    let s = c.create_volume(r).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(
        s.message().contains("Kata vhost-user-blk"),
        "{}",
        s.message()
    );
    let mut r = create_req("pvc-e", 1);
    r.volume_capabilities.clear();
    assert_eq!(code(c.create_volume(r).await), Code::InvalidArgument);
    let mut r = create_req("pvc-e", 1);
    r.volume_capabilities = vec![cap(true, Mode::MultiNodeMultiWriter)];
    assert_eq!(code(c.create_volume(r).await), Code::InvalidArgument);
    let mut r = create_req("pvc-e", 1);
    r.parameters.insert("lvs".into(), "nosuch".into());
    assert_eq!(code(c.create_volume(r).await), Code::InvalidArgument);
    assert_eq!(
        code(c.delete_volume(csi::DeleteVolumeRequest::default()).await),
        Code::InvalidArgument
    );
    // RESOURCE_EXHAUSTED: no space; topology elsewhere.
    assert_eq!(
        code(c.create_volume(create_req("pvc-huge", 4 << 30)).await),
        Code::ResourceExhausted
    );
    let mut r = create_req("pvc-e", 1);
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![csi::Topology {
            segments: [(katablk_csi::TOPOLOGY_KEY.to_owned(), "node-b".to_owned())].into(),
        }],
        preferred: vec![],
    });
    assert_eq!(code(c.create_volume(r).await), Code::ResourceExhausted);
    // OUT_OF_RANGE: no cluster multiple in range.
    let mut r = create_req("pvc-e", 5 << 20);
    r.capacity_range.as_mut().unwrap().limit_bytes = 6 << 20;
    assert_eq!(code(c.create_volume(r).await), Code::OutOfRange);
    // NOT_FOUND
    let r = restore_req("pvc-e", 1, "lvs0/nosnap");
    assert_eq!(code(c.create_volume(r).await), Code::NotFound);
    assert_eq!(
        code(
            c.controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: "lvs0/nosuch".into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 1,
                    limit_bytes: 0
                }),
                ..Default::default()
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: "lvs0/nosuch".into(),
                volume_capabilities: vec![block_cap()],
                ..Default::default()
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: "lvs0/nosuch".into(),
                name: "s".into(),
                ..Default::default()
            })
            .await
        ),
        Code::NotFound
    );
    // Idempotent deletes of things that never existed.
    c.delete_volume(csi::DeleteVolumeRequest {
        volume_id: "lvs0/nosuch".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.delete_volume(csi::DeleteVolumeRequest {
        volume_id: "garbage".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.delete_snapshot(csi::DeleteSnapshotRequest {
        snapshot_id: "lvs0/nosnap".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    // UNIMPLEMENTED
    assert_eq!(
        code(
            c.controller_publish_volume(csi::ControllerPublishVolumeRequest::default())
                .await
        ),
        Code::Unimplemented
    );
    // Node side.
    let n = &mut e.node;
    let tp = e.dir.path().join("kubelet/pods/x/vol");
    assert_eq!(
        code(
            n.node_publish_volume(publish_req("lvs0/nosuch", &tp, block_cap(), false))
                .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            n.node_publish_volume(publish_req("", &tp, block_cap(), false))
                .await
        ),
        Code::InvalidArgument
    );
    let mut r = publish_req("lvs0/nosuch", &tp, block_cap(), false);
    r.volume_capability = None;
    assert_eq!(code(n.node_publish_volume(r).await), Code::InvalidArgument);
    for bad in ["/etc/passwd", "relative/path"] {
        let r = publish_req("lvs0/nosuch", std::path::Path::new(bad), block_cap(), false);
        assert_eq!(
            code(n.node_publish_volume(r).await),
            Code::InvalidArgument,
            "{bad}"
        );
    }
    let esc = format!("{}/../../etc", e.dir.path().join("kubelet").display());
    let r = publish_req(
        "lvs0/nosuch",
        std::path::Path::new(&esc),
        block_cap(),
        false,
    );
    assert_eq!(code(n.node_publish_volume(r).await), Code::InvalidArgument);
    assert_eq!(
        code(n.node_unpublish_volume(unpublish_req("", &tp)).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            n.node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: "lvs0/nosuch".into(),
                volume_path: tp.display().to_string(),
                ..Default::default()
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            n.node_stage_volume(csi::NodeStageVolumeRequest::default())
                .await
        ),
        Code::Unimplemented
    );
    let info = n
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "node-a");
    assert_eq!(
        info.accessible_topology.unwrap().segments[katablk_csi::TOPOLOGY_KEY],
        "node-a"
    );
    let m = e.driver.metrics.render();
    assert!(m.contains("katablk_csi_operation_errors_total{method=\"CreateVolume\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_csi_and_metrics() {
    let dir = tempfile::Builder::new()
        .prefix("kcsib")
        .tempdir_in("/tmp")
        .unwrap();
    let root = dir.path();
    let disk = image(root, "disk.img", 64 << 20);
    let nc = root.join("node.json");
    std::fs::write(
        &nc,
        format!(
            r#"{{"devices":[{{"path":"{}","lvs":"lvsb"}}]}}"#,
            disk.display()
        ),
    )
    .unwrap();
    let rpc = root.join("spdk.sock");
    let _t = Target::start(&rpc, &root.join("store/block/sockets"), None);
    let port = 20000 + (std::process::id() % 20000) as u16;
    let csi_sock = root.join("csi.sock");
    let mut csi_bin = Daemon::new(katablk_test_support::bin_path!("katablk-csi"))
        .arg("--endpoint")
        .arg(format!("unix://{}", csi_sock.display()))
        .arg("--node-id")
        .arg("node-bin")
        .arg("--spdk-rpc")
        .arg(&rpc)
        .arg("--vhost-user-store")
        .arg(root.join("store"))
        .arg("--lvs")
        .arg("lvsb")
        .arg("--node-config")
        .arg(&nc)
        .arg("--kubelet-dir")
        .arg(root.join("kubelet"))
        .arg("--kubelet-block-lock")
        .arg("off")
        .arg("--direct-volumes-dir")
        .arg(root.join("direct"))
        .arg("--state-dir")
        .arg(root.join("state"))
        .arg("--metrics")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--reconcile-interval")
        .arg("1")
        .env("RUST_LOG", "warn")
        .start();
    let ch = channel(&csi_sock).await;
    let mut id = katablk_csi::csi::identity_client::IdentityClient::new(ch.clone());
    let info = id
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "katablk.csi.io");
    // Ready once the node config created lvsb.
    let t0 = std::time::Instant::now();
    loop {
        let p = id.probe(csi::ProbeRequest {}).await.unwrap().into_inner();
        if p.ready == Some(true) {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(15),
            "never ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let caps = id
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.len() >= 2);
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(
        body.contains("katablk_csi_operations_total{method=\"Probe\",code=\"Ok\"}"),
        "{body}"
    );
    assert!(csi_bin.term().success());
    assert!(!csi_sock.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_config_never_recreates_a_store() {
    use katablk_csi::node_config::{apply_device, NodeConfig};
    let e = Env::start().await;
    let disk = e.root().join("disk.img");
    let rpc = &e.driver.rpc;
    // Same device, another lvstore name: refused, lvs0 untouched.
    let c = NodeConfig::parse(&format!(
        "devices:\n  - path: {}\n    bdev: lvs0-aio\n    lvs: lvs9\n",
        disk.display()
    ))
    .unwrap();
    let err = apply_device(rpc, &c.devices[0]).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    // Re-applying the real config is idempotent.
    let c = NodeConfig::load(e.driver.cfg.node_config.as_ref().unwrap()).unwrap();
    apply_device(rpc, &c.devices[0]).await.unwrap();
    apply_device(rpc, &c.devices[0]).await.unwrap();
    let stores = e.driver.lvstores().await.unwrap();
    assert_eq!(stores.len(), 1);
    // A device with a blobstore signature the target did not open: refused.
    let foreign = e.root().join("foreign.img");
    let mut img = b"SPDKBLOB".to_vec();
    img.resize(64 << 20, 0);
    std::fs::write(&foreign, &img).unwrap();
    let c = NodeConfig::parse(&format!(
        "devices:\n  - path: {}\n    lvs: lvsf\n",
        foreign.display()
    ))
    .unwrap();
    let err = apply_device(rpc, &c.devices[0]).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert_eq!(&std::fs::read(&foreign).unwrap()[..8], b"SPDKBLOB");
    // create: false on a blank device: refused.
    let blank = image(e.root(), "blank.img", 64 << 20);
    let c = NodeConfig::parse(&format!(
        "devices:\n  - path: {}\n    lvs: lvsb\n    create: false\n",
        blank.display()
    ))
    .unwrap();
    assert!(apply_device(rpc, &c.devices[0]).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_minors_and_driver_restart() {
    let mut e = Env::start().await;
    let mut ids = Vec::new();
    for i in 0..4 {
        let v = e
            .controller
            .create_volume(create_req(&format!("pvc-m{i}"), 4 << 20))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        ids.push(v.volume_id);
    }
    // Concurrent publishes of different volumes get distinct minors.
    let mut tasks = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let mut n = e.node.clone();
        let r = publish_req(id, &e.target_path(&format!("m{i}")), block_cap(), false);
        tasks.push(tokio::spawn(async move {
            n.node_publish_volume(r).await.map(|_| ())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let nodes = e.driver.store.device_nodes().unwrap();
    let mut minors: Vec<u32> = nodes.values().copied().collect();
    minors.sort();
    assert_eq!(minors, vec![0, 1, 2, 3]);

    // The driver restarts (new process, same state dir): reconciliation changes nothing that
    // is in use.
    let d2 = katablk_csi::Driver::new(e.driver.cfg.clone()).unwrap();
    let rep = katablk_csi::reconcile::reconcile(&d2).await.unwrap();
    assert_eq!(rep, Default::default());
    assert_eq!(d2.store.device_nodes().unwrap(), nodes);
    for i in 0..4 {
        assert!(katablk_csi::mounts::is_mount_point(&e.target_path(&format!("m{i}"))).unwrap());
    }
    // The state file is lost: everything is still bind-mounted into pods, so nothing is
    // removed.
    std::fs::remove_file(e.driver.cfg.state_dir.join("published.json")).unwrap();
    let d3 = katablk_csi::Driver::new(e.driver.cfg.clone()).unwrap();
    let rep = katablk_csi::reconcile::reconcile(&d3).await.unwrap();
    assert_eq!(rep.kept_in_use.len(), 4, "{rep:?}");
    assert!(rep.orphan_controllers.is_empty() && rep.orphan_nodes.is_empty());
    assert_eq!(d3.store.device_nodes().unwrap(), nodes);
    drop(d3);
    // Put the records back (the test's driver still has them in memory).
    for (k, v) in e.driver.state.published.all() {
        e.driver.state.published.insert(&k, v).unwrap();
    }
    // A freed minor is reused by the next publish.
    e.node
        .node_unpublish_volume(unpublish_req(&ids[1], &e.target_path("m1")))
        .await
        .unwrap();
    let freed = nodes[&ctrlr(&ids[1])];
    e.node
        .node_publish_volume(publish_req(
            &ids[1],
            &e.target_path("m1b"),
            block_cap(),
            false,
        ))
        .await
        .unwrap();
    assert_eq!(
        e.driver.store.device_nodes().unwrap()[&ctrlr(&ids[1])],
        freed
    );
    e.node
        .node_unpublish_volume(unpublish_req(&ids[1], &e.target_path("m1b")))
        .await
        .unwrap();
    for (i, id) in ids.iter().enumerate().filter(|(i, _)| *i != 1) {
        e.node
            .node_unpublish_volume(unpublish_req(id, &e.target_path(&format!("m{i}"))))
            .await
            .unwrap();
    }
    assert!(e.driver.store.device_nodes().unwrap().is_empty());
}

/// The filesystem formatter writes only mkfs's data extents, so a new lvol must read zeros
/// where it does not write — also when its clusters belonged to a deleted volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_thick_volume_reads_zeros_over_reused_clusters() {
    let mut e = Env::start().await;
    for round in 0..2u8 {
        let name = format!("pvc-reuse{round}");
        let v = e
            .controller
            .create_volume(create_req(&name, 32 << 20))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let tp = e.target_path(&name);
        e.node
            .node_publish_volume(publish_req(&v.volume_id, &tp, block_cap(), false))
            .await
            .unwrap();
        let s = e.store().join("block/sockets").join(ctrlr(&v.volume_id));
        blk(move || {
            let mut c = blk_client(&s, false).unwrap();
            for off in (0..c.capacity).step_by(1 << 20) {
                let got = c.read_ok(0, off, 1 << 20);
                if round == 1 {
                    assert!(got.iter().all(|b| *b == 0), "stale data at {off}");
                }
                assert_eq!(c.write(0, off, &pattern(u64::from(round) + 1, 1 << 20)), 0);
            }
        })
        .await;
        e.node
            .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
            .await
            .unwrap();
        e.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: v.volume_id,
                ..Default::default()
            })
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_with_a_connected_client_is_refused_then_retried() {
    let mut e = Env::start().await;
    let v = e
        .controller
        .create_volume(create_req("pvc-busy", 4 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let tp = e.target_path("busy");
    e.node
        .node_publish_volume(publish_req(&v.volume_id, &tp, block_cap(), false))
        .await
        .unwrap();
    let name = ctrlr(&v.volume_id);
    let sock = e.store().join("block/sockets").join(&name);
    let dev = e.store().join("block/devices").join(&name);
    let s = sock.clone();
    let client = blk(move || blk_client(&s, false).unwrap()).await;
    assert_eq!(
        code(
            e.node
                .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
                .await
        ),
        Code::FailedPrecondition
    );
    assert!(sock.exists() && dev.exists());
    drop(client);
    // The CO retries once the VM let go.
    e.node
        .node_unpublish_volume(unpublish_req(&v.volume_id, &tp))
        .await
        .unwrap();
    assert!(!tp.exists() && !dev.exists() && !sock.exists());
}
