//! katablk-target driven by SPDK's own python client, `spdk-rpc` (PyPI `spdk`): the node
//! flow of DESIGN.md section 2, verbatim, then the data path through the controller.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;

#[test]
fn design_flow_verbatim_then_data_path() {
    let Some(rpc) = spdk_rpc_bin() else {
        eprintln!(
            "SKIPPED: spdk-rpc not found (scripts/setup-debian.sh installs it; set SPDK_RPC)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "node-disk.img", 256 * MIB);
    let t = Target::start(dir.path(), &[]);
    let s = &t.rpc;
    let img = img.to_str().unwrap();
    // rpc.py bdev_aio_create <dev> <bdev>
    assert_eq!(
        spdk_rpc_ok(&rpc, s, &["bdev_aio_create", img, "aio0"]),
        "aio0"
    );
    // rpc.py bdev_lvol_create_lvstore <bdev> <lvs>
    let lvs_uuid = spdk_rpc_ok(&rpc, s, &["bdev_lvol_create_lvstore", "aio0", "lvs0"]);
    assert!(uuid::Uuid::parse_str(&lvs_uuid).is_ok(), "{lvs_uuid}");
    // rpc.py bdev_lvol_create <lvol> <size_mib> -l <lvs>
    let lvol_uuid = spdk_rpc_ok(&rpc, s, &["bdev_lvol_create", "lvol0", "64", "-l", "lvs0"]);
    assert!(uuid::Uuid::parse_str(&lvol_uuid).is_ok(), "{lvol_uuid}");
    // rpc.py vhost_create_blk_controller --cpumask 0x1 vhostblk0 <lvs>/<lvol>
    // (spdk-rpc prints nothing for this method's `true`.)
    spdk_rpc_ok(
        &rpc,
        s,
        &[
            "vhost_create_blk_controller",
            "--cpumask",
            "0x1",
            "vhostblk0",
            "lvs0/lvol0",
        ],
    );
    let ctrlrs: serde_json::Value =
        serde_json::from_str(&spdk_rpc_ok(&rpc, s, &["vhost_get_controllers"])).unwrap();
    assert_eq!(ctrlrs[0]["ctrlr"], "vhostblk0");
    assert_eq!(
        ctrlrs[0]["backend_specific"]["block"]["bdev"],
        lvol_uuid.as_str()
    );
    assert_eq!(
        ctrlrs[0]["socket"],
        t.ctrlr_socket("vhostblk0").to_str().unwrap()
    );
    let bdevs: serde_json::Value = serde_json::from_str(&spdk_rpc_ok(
        &rpc,
        s,
        &["bdev_get_bdevs", "-b", "lvs0/lvol0"],
    ))
    .unwrap();
    assert_eq!(bdevs[0]["name"], lvol_uuid.as_str());
    assert_eq!(bdevs[0]["aliases"][0], "lvs0/lvol0");
    assert_eq!(bdevs[0]["num_blocks"], 131072);
    assert_eq!(bdevs[0]["driver_specific"]["lvol"]["base_bdev"], "aio0");

    // The data path: a real vhost-user client on the controller socket.
    let mut c = Client::connect(&t.ctrlr_socket("vhostblk0"), 1, false).unwrap();
    assert_eq!(c.capacity, 64 << 20);
    for i in 0..16u64 {
        assert_eq!(c.write(0, (i * 4) << 20, &fill(i, 65536)), 0);
    }
    assert_eq!(c.flush(0), 0);
    for i in 0..16u64 {
        assert_eq!(c.read_ok(0, (i * 4) << 20, 65536), fill(i, 65536));
    }
    drop(c);

    // Iostat and lvstore accounting saw it.
    let st: serde_json::Value = serde_json::from_str(&spdk_rpc_ok(
        &rpc,
        s,
        &["bdev_get_iostat", "--names", "lvs0/lvol0"],
    ))
    .unwrap();
    assert!(
        st["bdevs"][0]["num_write_ops"].as_u64().unwrap() >= 16,
        "{st}"
    );
    let lvs: serde_json::Value =
        serde_json::from_str(&spdk_rpc_ok(&rpc, s, &["bdev_lvol_get_lvstores"])).unwrap();
    assert_eq!(lvs[0]["cluster_size"], 4194304);
    assert_eq!(lvs[0]["base_bdev"], "aio0");

    // Unpublish: delete controller, then the lvol.
    spdk_rpc_ok(&rpc, s, &["vhost_delete_controller", "vhostblk0"]);
    assert!(!t.ctrlr_socket("vhostblk0").exists());
    spdk_rpc_ok(&rpc, s, &["bdev_lvol_delete", "lvs0/lvol0"]);
    let lvols: serde_json::Value =
        serde_json::from_str(&spdk_rpc_ok(&rpc, s, &["bdev_lvol_get_lvols"])).unwrap();
    assert_eq!(lvols.as_array().unwrap().len(), 0);
}

#[test]
fn spdk_client_errors_and_save_load_config() {
    let Some(rpc) = spdk_rpc_bin() else {
        eprintln!(
            "SKIPPED: spdk-rpc not found (scripts/setup-debian.sh installs it; set SPDK_RPC)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "d.img", 64 * MIB);
    let t = Target::start(dir.path(), &[]);
    let s = &t.rpc;
    let err = |args: &[&str]| {
        let o = spdk_rpc(&rpc, s, args);
        assert!(!o.status.success(), "{args:?} should fail");
        let text =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        text
    };
    spdk_rpc_ok(&rpc, s, &["bdev_aio_create", img.to_str().unwrap(), "aio0"]);
    assert!(err(&["bdev_aio_create", img.to_str().unwrap(), "aio0"]).contains("-17"));
    assert!(err(&["bdev_get_bdevs", "-b", "nosuch"]).contains("-19"));
    assert!(err(&["vhost_create_blk_controller", "c0", "nosuch"]).contains("-32602"));
    assert!(err(&["vhost_delete_controller", "nosuch"]).contains("-32602"));
    assert!(err(&["bdev_lvol_create", "x", "4", "-l", "nolvs"]).contains("-19"));
    spdk_rpc_ok(&rpc, s, &["bdev_lvol_create_lvstore", "aio0", "lvs0"]);
    assert!(err(&["bdev_lvol_create", "big", "999999", "-l", "lvs0"]).contains("No space"));
    spdk_rpc_ok(&rpc, s, &["bdev_lvol_create", "v", "8", "-l", "lvs0"]);
    spdk_rpc_ok(&rpc, s, &["vhost_create_blk_controller", "c0", "lvs0/v"]);
    // In use: refused, and nothing is dropped (SPDK would silently lose every lvol).
    assert!(err(&["bdev_aio_delete", "aio0"]).contains("-16"));
    assert!(err(&["bdev_lvol_delete", "lvs0/v"]).contains("-16"));
    assert!(err(&["bdev_lvol_delete_lvstore", "-l", "lvs0"]).contains("-16"));
    assert!(err(&["vhost_create_blk_controller", "c1", "lvs0/v"]).contains("-16"));
    assert!(err(&["vhost_create_blk_controller", "c0", "lvs0/v"]).contains("-17"));
    let cfg = spdk_rpc_ok(&rpc, s, &["save_config"]);
    let v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let subs: Vec<&str> = v["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["subsystem"].as_str().unwrap())
        .collect();
    assert_eq!(subs, vec!["bdev", "vhost_blk"]);
    // Load the saved configuration into a fresh target: same bdevs, lvols, controllers.
    drop(t);
    let dir2 = tempfile::tempdir().unwrap();
    let t2 = Target::start(dir2.path(), &[]);
    let cfg = cfg.replace(
        dir.path().join("sockets").to_str().unwrap(),
        dir2.path().join("sockets").to_str().unwrap(),
    );
    let f = dir2.path().join("cfg.json");
    std::fs::write(&f, cfg).unwrap();
    let o = std::process::Command::new(&rpc)
        .arg("-s")
        .arg(&t2.rpc)
        .arg("load_config")
        .stdin(std::fs::File::open(&f).unwrap())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "load_config: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let c: serde_json::Value =
        serde_json::from_str(&spdk_rpc_ok(&rpc, &t2.rpc, &["vhost_get_controllers"])).unwrap();
    assert_eq!(c[0]["ctrlr"], "c0");
    assert!(t2.ctrlr_socket("c0").exists());
    let l: serde_json::Value =
        serde_json::from_str(&spdk_rpc_ok(&rpc, &t2.rpc, &["bdev_lvol_get_lvols"])).unwrap();
    assert_eq!(l[0]["alias"], "lvs0/v");
}
