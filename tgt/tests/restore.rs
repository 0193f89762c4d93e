//! Saved configuration that cannot be restored (issue 18 R7): a bdev whose disk image is
//! missing at start stays in the saved state with the controllers on it, is reported by
//! `katablk_get_unrestored`, and comes back when the disk does: when the bdev is created
//! again, on the periodic retry, or at the next start.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use katablk_rpc::methods::*;

fn aio(img: &Path) -> BdevAioCreateParams {
    BdevAioCreateParams {
        filename: img.display().to_string(),
        name: "aio0".into(),
        ..Default::default()
    }
}

/// aio0 on `img`, lvs0/vol on it, controller ctrlr0 serving it, and a pattern written and
/// flushed. Returns the aio bdev's UUID.
fn provision(t: &Target, img: &Path) -> String {
    let rpc = client(t);
    rt().block_on(provision_lvol(&rpc, img, 8, true));
    let mut c = Client::connect(&t.ctrlr_socket("ctrlr0"), 1, false).unwrap();
    assert_eq!(c.write(0, 4096, &fill(7, 65536)), 0);
    assert_eq!(c.flush(0), 0);
    drop(c);
    let b = rt().block_on(rpc.bdev_get_bdevs(Some("aio0"))).unwrap();
    b[0].uuid.clone().unwrap()
}

fn unrestored(t: &Target) -> Vec<UnrestoredEntry> {
    rt().block_on(client(t).katablk_get_unrestored()).unwrap()
}

fn saved(state: &Path) -> String {
    std::fs::read_to_string(state.join("config.json")).unwrap()
}

/// Everything provisioned is live again, with the data.
fn assert_back(t: &Target, uuid: &str) {
    let rpc = client(t);
    let r = rt();
    let b = r.block_on(rpc.bdev_get_bdevs(Some("aio0"))).unwrap();
    assert_eq!(b[0].uuid.as_deref(), Some(uuid), "the bdev keeps its UUID");
    assert!(r.block_on(rpc.bdev_get_bdev("lvs0/vol")).unwrap().is_some());
    let c = r.block_on(rpc.vhost_get_controllers(None)).unwrap();
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(unrestored(t).is_empty());
    let mut blk = Client::connect(&t.ctrlr_socket("ctrlr0"), 1, false).unwrap();
    assert_eq!(blk.read_ok(0, 4096, 65536), fill(7, 65536));
}

#[test]
fn missing_disk_stays_saved_and_comes_back_when_created_again() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 64 * MIB);
    let away = dir.path().join("disk.img.away");
    let state = dir.path().join("state");
    let args = [
        "--state-dir",
        state.to_str().unwrap(),
        "--restore-retry",
        "0",
    ];
    let mut t = Target::start(dir.path(), &args);
    let uuid = provision(&t, &img);
    assert!(t.term().success());

    // Boot without the disk: the bdev and the controller on it are reported, not dropped.
    std::fs::rename(&img, &away).unwrap();
    t.spawn();
    let u = unrestored(&t);
    assert_eq!(u.len(), 2, "{u:?}");
    assert_eq!(
        (u[0].subsystem.as_str(), u[0].name.as_str()),
        ("bdev", "aio0")
    );
    assert_eq!(u[0].method, "bdev_aio_create");
    assert!(u[0].error.contains("No such file"), "{}", u[0].error);
    assert_eq!(
        (u[1].subsystem.as_str(), u[1].name.as_str()),
        ("vhost_blk", "ctrlr0")
    );
    assert!(t
        .log()
        .contains("not restored; kept in the saved configuration"));
    let rpc = client(&t);
    let r = rt();
    assert!(r.block_on(rpc.bdev_get_bdevs(None)).unwrap().is_empty());
    assert!(r
        .block_on(rpc.vhost_get_controllers(None))
        .unwrap()
        .is_empty());

    // A change of another kind saves the configuration: the missing entries stay in it.
    r.block_on(rpc.bdev_malloc_create(&BdevMallocCreateParams {
        num_blocks: 2048,
        block_size: 512,
        name: Some("Malloc9".into()),
        ..Default::default()
    }))
    .unwrap();
    let s = saved(&state);
    assert!(
        s.contains("Malloc9") && s.contains("\"aio0\"") && s.contains("ctrlr0"),
        "{s}"
    );
    // The name is not free for another file.
    let other = image(dir.path(), "other.img", 16 * MIB);
    let e = r.block_on(rpc.bdev_aio_create(&aio(&other))).unwrap_err();
    assert!(e.is_exists(), "{e}");
    assert!(e.to_string().contains("saved configuration"), "{e}");
    // A controller cannot be made on the missing lvol; its entry stays.
    let e = r
        .block_on(
            rpc.vhost_create_blk_controller(&VhostCreateBlkControllerParams {
                ctrlr: "ctrlr0".into(),
                dev_name: "lvs0/vol".into(),
                ..Default::default()
            }),
        )
        .unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert_eq!(unrestored(&t).len(), 2);

    // Still missing at the next start: still kept.
    assert!(t.term().success());
    t.spawn();
    assert_eq!(unrestored(&t).len(), 2);

    // The disk is back: creating the same bdev restores it, its lvstore and the controller.
    std::fs::rename(&away, &img).unwrap();
    let rpc = client(&t);
    rt().block_on(rpc.bdev_aio_create(&aio(&img))).unwrap();
    assert_back(&t, &uuid);
    assert!(!saved(&state).contains("\"attempts\""));
    // And it is saved as live configuration: a restart brings it all back.
    assert!(t.term().success());
    t.spawn();
    assert_back(&t, &uuid);
}

#[test]
fn periodic_retry_restores_a_returning_disk() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 64 * MIB);
    let away = dir.path().join("disk.img.away");
    let state = dir.path().join("state");
    let args = [
        "--state-dir",
        state.to_str().unwrap(),
        "--restore-retry",
        "1",
    ];
    let mut t = Target::start(dir.path(), &args);
    let uuid = provision(&t, &img);
    assert!(t.term().success());
    std::fs::rename(&img, &away).unwrap();
    t.spawn();
    assert_eq!(unrestored(&t).len(), 2);
    std::fs::rename(&away, &img).unwrap();
    let t0 = Instant::now();
    while !unrestored(&t).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "not retried: {}",
            t.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_back(&t, &uuid);
    // The retry saved the configuration.
    assert!(t.term().success());
    std::fs::rename(&img, &away).unwrap();
    std::fs::rename(&away, &img).unwrap();
    t.spawn();
    assert_back(&t, &uuid);
}

#[test]
fn deleting_unrestored_entries_forgets_them() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 64 * MIB);
    let state = dir.path().join("state");
    let args = [
        "--state-dir",
        state.to_str().unwrap(),
        "--restore-retry",
        "0",
    ];
    let mut t = Target::start(dir.path(), &args);
    provision(&t, &img);
    assert!(t.term().success());
    std::fs::remove_file(&img).unwrap();
    t.spawn();
    let rpc = client(&t);
    let r = rt();
    assert_eq!(unrestored(&t).len(), 2);
    assert!(r.block_on(rpc.vhost_delete_controller("ctrlr0")).unwrap());
    // The wrong kind does not delete it.
    assert!(r
        .block_on(rpc.bdev_malloc_delete("aio0"))
        .unwrap_err()
        .is_not_found());
    assert!(r.block_on(rpc.bdev_aio_delete("aio0")).unwrap());
    assert!(unrestored(&t).is_empty());
    let s = saved(&state);
    assert!(!s.contains("aio0") && !s.contains("ctrlr0"), "{s}");
    assert!(t.term().success());
    t.spawn();
    assert!(unrestored(&t).is_empty());
}
