//! Restart and crash behaviour: `--state-dir` brings back the same controllers on the same
//! sockets, lvols come back with their lvstore, and acknowledged flushed writes survive kill -9.
//! Driven with the `katablk-rpc` client.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use katablk_rpc::methods::*;
use katablk_rpc::RpcClient;

fn provision(rpc: &RpcClient, img: &std::path::Path, thin: bool) -> String {
    rt().block_on(provision_lvol(rpc, img, 32, thin))
}

#[test]
fn state_dir_restart_brings_back_controllers_and_data() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 128 * MIB);
    let state = dir.path().join("state");
    let mut t = Target::start(dir.path(), &["--state-dir", state.to_str().unwrap()]);
    let rpc = RpcClient::new(&t.rpc);
    let uuid = provision(&rpc, &img, true);
    let sock = t.ctrlr_socket("ctrlr0");
    let mut c = Client::connect(&sock, 1, false).unwrap();
    for i in 0..8u64 {
        assert_eq!(c.write(0, i << 20, &fill(i, 131072)), 0);
    }
    assert_eq!(c.flush(0), 0);
    // Crash the target under a connected client.
    t.kill9();
    drop(c);
    t.spawn();
    let ctrlrs = rt().block_on(rpc.vhost_get_controllers(None)).unwrap();
    assert_eq!(ctrlrs.len(), 1);
    assert_eq!(ctrlrs[0].socket, sock.display().to_string());
    assert_eq!(
        ctrlrs[0]
            .backend_specific
            .block
            .as_ref()
            .unwrap()
            .bdev
            .as_deref(),
        Some(uuid.as_str())
    );
    // The client reconnects to the same socket and finds its data.
    let mut c = Client::connect(&sock, 1, false).unwrap();
    for i in 0..8u64 {
        assert_eq!(c.read_ok(0, i << 20, 131072), fill(i, 131072), "write {i}");
    }
    drop(c);
    // A clean stop and start works the same way.
    assert!(t.term().success());
    t.spawn();
    let mut c = Client::connect(&sock, 1, false).unwrap();
    assert_eq!(c.read_ok(0, 7 << 20, 131072), fill(7, 131072));
}

#[test]
fn kill9_mid_write_keeps_flushed_data() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 128 * MIB);
    let state = dir.path().join("state");
    let mut t = Target::start(dir.path(), &["--state-dir", state.to_str().unwrap()]);
    let rpc = RpcClient::new(&t.rpc);
    provision(&rpc, &img, true);
    let sock = t.ctrlr_socket("ctrlr0");
    // Writer: each round writes 64 KiB to a fresh (thin, so first-write allocating) cluster
    // and flushes; `flushed` is the last round whose flush was acknowledged.
    let flushed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (f2, s2, sock2) = (flushed.clone(), stop.clone(), sock.clone());
    let writer = std::thread::spawn(move || {
        let mut c = Client::connect(&sock2, 1, false).unwrap();
        for round in 1..=30u64 {
            if s2.load(Ordering::Relaxed) {
                break;
            }
            if c.write(0, round << 20, &fill(round, 65536)) != 0 || c.flush(0) != 0 {
                break;
            }
            f2.store(round, Ordering::Release);
        }
    });
    while flushed.load(Ordering::Acquire) < 5 {
        std::thread::sleep(Duration::from_millis(1));
    }
    t.kill9();
    stop.store(true, Ordering::Relaxed);
    let _ = writer.join();
    let done = flushed.load(Ordering::Acquire);
    t.spawn();
    let lvs = rt()
        .block_on(rpc.bdev_lvol_get_lvstores(&LvstoreSelector::default()))
        .unwrap();
    assert_eq!(lvs.len(), 1, "{}", t.log());
    let mut c = Client::connect(&sock, 1, false).unwrap();
    for round in 1..=done {
        assert_eq!(
            c.read_ok(0, round << 20, 65536),
            fill(round, 65536),
            "round {round} of {done}"
        );
    }
    let lvols = rt()
        .block_on(rpc.bdev_lvol_get_lvols(&BdevLvolGetLvolsParams::default()))
        .unwrap();
    assert!(lvols[0].num_allocated_clusters >= done, "{lvols:?}");
}

#[test]
fn concurrent_rpc_clients() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 256 * MIB);
    let t = Target::start(dir.path(), &[]);
    let rpc = RpcClient::new(&t.rpc);
    provision(&rpc, &img, false);
    // Eight clients, each creating and publishing its own volumes, and all racing for one name.
    let sock = t.rpc.clone();
    let results = rt().block_on(async move {
        let mut tasks = Vec::new();
        for k in 0..8 {
            let sock = sock.clone();
            tasks.push(tokio::spawn(async move {
                let c = RpcClient::new(&sock);
                let mut won = 0;
                for j in 0..3 {
                    let name = format!("v{k}-{j}");
                    c.bdev_lvol_create(&BdevLvolCreateParams {
                        lvol_name: name.clone(),
                        size_in_mib: 4,
                        thin_provision: Some(true),
                        clear_method: None,
                        uuid: None,
                        lvs_name: Some("lvs0".into()),
                    })
                    .await
                    .unwrap();
                    c.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
                        ctrlr: format!("c{k}-{j}"),
                        dev_name: format!("lvs0/{name}"),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                }
                let r = c
                    .bdev_lvol_create(&BdevLvolCreateParams {
                        lvol_name: "contended".into(),
                        size_in_mib: 4,
                        thin_provision: Some(true),
                        clear_method: None,
                        uuid: None,
                        lvs_name: Some("lvs0".into()),
                    })
                    .await;
                match r {
                    Ok(_) => won += 1,
                    Err(e) => assert!(e.is_exists(), "{e}"),
                }
                won
            }));
        }
        let mut won = 0;
        for t in tasks {
            won += t.await.unwrap();
        }
        won
    });
    assert_eq!(
        results, 1,
        "exactly one client creates the contended volume"
    );
    let ctrlrs = rt().block_on(rpc.vhost_get_controllers(None)).unwrap();
    assert_eq!(ctrlrs.len(), 25);
    let lvols = rt()
        .block_on(rpc.bdev_lvol_get_lvols(&BdevLvolGetLvolsParams::default()))
        .unwrap();
    assert_eq!(lvols.len(), 26);
    for k in 0..8 {
        assert!(t.ctrlr_socket(&format!("c{k}-2")).exists());
    }
}

#[test]
fn snapshot_clone_resize_through_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 256 * MIB);
    let t = Target::start(dir.path(), &[]);
    let rpc = RpcClient::new(&t.rpc);
    provision(&rpc, &img, false);
    let sock = t.ctrlr_socket("ctrlr0");
    let mut c = Client::connect(&sock, 1, false).unwrap();
    assert_eq!(c.write(0, 0, &fill(1, 65536)), 0);
    assert_eq!(c.flush(0), 0);
    drop(c);
    let r = rt();
    let snap = r
        .block_on(rpc.bdev_lvol_snapshot("lvs0/vol", "snap"))
        .unwrap();
    let clone = r
        .block_on(rpc.bdev_lvol_clone("lvs0/snap", "clone"))
        .unwrap();
    assert_ne!(snap, clone);
    // The origin keeps working and diverges from the snapshot; the clone sees the snapshot.
    let mut c = Client::connect(&sock, 1, false).unwrap();
    assert_eq!(c.read_ok(0, 0, 65536), fill(1, 65536));
    assert_eq!(c.write(0, 0, &fill(2, 65536)), 0);
    drop(c);
    r.block_on(
        rpc.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
            ctrlr: "clonectl".into(),
            dev_name: "lvs0/clone".into(),
            ..Default::default()
        }),
    )
    .unwrap();
    let mut cc = Client::connect(&t.ctrlr_socket("clonectl"), 1, false).unwrap();
    assert_eq!(cc.read_ok(0, 0, 65536), fill(1, 65536));
    drop(cc);
    // Snapshot bdev info and clone relationships as SPDK reports them.
    let b = r.block_on(rpc.bdev_get_bdevs(Some("lvs0/snap"))).unwrap();
    let l = b[0].driver_specific.lvol.as_ref().unwrap();
    assert!(l.snapshot);
    assert_eq!(l.clones.as_ref().unwrap().len(), 2, "{l:?}");
    // A snapshot with two clones cannot be deleted.
    let e = r.block_on(rpc.bdev_lvol_delete("lvs0/snap")).unwrap_err();
    assert!(e.to_string().contains("not permitted"), "{e}");
    // Resize the origin: a new client sees the new capacity.
    r.block_on(rpc.bdev_lvol_resize("lvs0/vol", 64)).unwrap();
    let c = Client::connect(&sock, 1, false).unwrap();
    assert_eq!(c.capacity, 64 << 20);
    drop(c);
    // Inflate the clone; delete it with its controller gone.
    r.block_on(rpc.vhost_delete_controller("clonectl")).unwrap();
    r.block_on(rpc.bdev_lvol_inflate("lvs0/clone")).unwrap();
    r.block_on(rpc.bdev_lvol_delete("lvs0/clone")).unwrap();
    // Unknown names everywhere give "not found".
    assert!(r
        .block_on(rpc.bdev_lvol_delete("lvs0/nope"))
        .unwrap_err()
        .is_not_found());
    assert!(r
        .block_on(rpc.vhost_delete_controller("nope"))
        .unwrap_err()
        .is_not_found());
    assert!(r.block_on(rpc.bdev_get_bdev("nope")).unwrap().is_none());
}

#[test]
fn rename_and_grow_lvstore() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 64 * MIB);
    let t = Target::start(dir.path(), &[]);
    let rpc = RpcClient::new(&t.rpc);
    provision(&rpc, &img, true);
    let r = rt();
    r.block_on(rpc.bdev_lvol_rename_lvstore("lvs0", "fast"))
        .unwrap();
    let b = r.block_on(rpc.bdev_get_bdevs(Some("fast/vol"))).unwrap();
    assert_eq!(b[0].aliases, vec!["fast/vol".to_string()]);
    assert!(r.block_on(rpc.bdev_get_bdev("lvs0/vol")).unwrap().is_none());
    assert!(r
        .block_on(rpc.bdev_lvol_rename_lvstore("nope", "x"))
        .unwrap_err()
        .is_not_found());
    let before = r
        .block_on(rpc.bdev_lvol_get_lvstores(&LvstoreSelector::by_name("fast")))
        .unwrap();
    // Grow the file under the store; grow_lvstore picks the new size up.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    r.block_on(rpc.bdev_lvol_grow_lvstore(&LvstoreSelector::by_name("fast")))
        .unwrap();
    let after = r
        .block_on(rpc.bdev_lvol_get_lvstores(&LvstoreSelector::by_name("fast")))
        .unwrap();
    assert!(
        after[0].total_data_clusters >= before[0].total_data_clusters + 60,
        "{before:?} {after:?}"
    );
    assert_eq!(
        after[0].free_clusters - before[0].free_clusters,
        after[0].total_data_clusters - before[0].total_data_clusters
    );
}
