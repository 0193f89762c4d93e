//! An lvstore written by a real SPDK (v26.09-pre, `scripts/spdk-lvstore-fixture.sh`: its
//! vhost app and rpc.py made the store, volumes, snapshot and clone, spdk_dd wrote the data)
//! is read by `katablk_lvol::spdk` and imported into a katablk store.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::sync::Arc;

use katablk_bdev::malloc::MallocDevice;
use katablk_bdev::sync::SyncIo;
use katablk_bdev::BlockDevice;
use katablk_lvol::spdk::{is_spdk_blobstore, SpdkLvstore};
use katablk_lvol::{LvStore, LvolError};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

/// The fixture image (decompressed once per test process).
fn image() -> Vec<u8> {
    static IMG: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    IMG.get_or_init(|| {
        let gz = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/spdk-lvstore.img.gz"
        ))
        .unwrap();
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut out)
            .unwrap();
        out
    })
    .clone()
}

fn spdk_json() -> serde_json::Value {
    let s = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/spdk-lvstore.json"
    ))
    .unwrap();
    serde_json::from_str(&s).unwrap()
}

/// A RAM device holding `bytes`.
fn device(bytes: &[u8]) -> Arc<dyn BlockDevice> {
    let dev = MallocDevice::new(bytes.len() as u64 / 512, 512).unwrap();
    let mut io = SyncIo::new(&dev).unwrap();
    io.write_at(0, bytes).unwrap();
    Arc::new(dev)
}

/// The fixture script's pattern: one text line per 4 KiB block, naming the tag and the
/// block's index in the volume, repeated to fill the block.
fn pattern(tag: &str, off: u64, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    let mut b = off;
    while b < off + len {
        let line = format!("katablk spdk fixture {tag} block {}\n", b / 4096);
        let block: Vec<u8> = line.bytes().cycle().take(4096).collect();
        out.extend_from_slice(&block);
        b += 4096;
    }
    out
}

/// Pattern runs of a volume: (offset, tag, len).
type Parts = Vec<(u64, &'static str, u64)>;

/// Expected content of each volume: (name, size, pattern runs); the rest is zero.
fn expected() -> Vec<(&'static str, u64, Parts)> {
    let snap = vec![(0, "B", MIB), (5 * MIB + 256 * 1024, "B", 512 * 1024)];
    let mut thin = snap.clone();
    thin.push((0, "C", 64 * 1024));
    let mut clone = snap.clone();
    clone.push((7 * MIB, "D", MIB));
    vec![
        ("thick", 4 * MIB, vec![(0, "A", 2 * MIB)]),
        ("snap", 8 * MIB, snap),
        ("thin", 8 * MIB, thin),
        ("clone", 8 * MIB, clone),
        ("ro", 2 * MIB, vec![(0, "E", 2 * MIB)]),
    ]
}

fn content(size: u64, parts: &[(u64, &str, u64)]) -> Vec<u8> {
    let mut v = vec![0u8; size as usize];
    for &(off, tag, len) in parts {
        v[off as usize..(off + len) as usize].copy_from_slice(&pattern(tag, off, len));
    }
    v
}

#[test]
fn reads_what_spdk_wrote() {
    let dev = device(&image());
    assert!(is_spdk_blobstore(&*dev));
    let s = SpdkLvstore::open(dev).unwrap();
    let j = spdk_json();
    let lvs = &j["lvstores"][0];
    assert_eq!(s.name, lvs["name"].as_str().unwrap());
    assert_eq!(s.uuid.to_string(), lvs["uuid"].as_str().unwrap());
    assert_eq!(
        u64::from(s.sb.cluster_size),
        lvs["cluster_size"].as_u64().unwrap()
    );
    assert_eq!(s.sb.io_unit_size, 512);
    assert_eq!(s.lvols.len(), 5);
    for l in j["lvols"].as_array().unwrap() {
        let name = l["name"].as_str().unwrap();
        let v = s.find(name).unwrap();
        assert_eq!(v.uuid.to_string(), l["uuid"].as_str().unwrap(), "{name}");
        assert_eq!(
            v.thin,
            l["is_thin_provisioned"].as_bool().unwrap(),
            "{name}"
        );
        assert_eq!(
            v.allocated(),
            l["num_allocated_clusters"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            s.has_clones(v.blob_id),
            l["is_snapshot"].as_bool().unwrap(),
            "{name}"
        );
        assert_eq!(
            v.parent.is_some(),
            l["is_clone"].as_bool().unwrap(),
            "{name}"
        );
        assert!(std::ptr::eq(
            s.find(l["alias"].as_str().unwrap()).unwrap(),
            v
        ));
    }
    let snap = s.find("snap").unwrap().blob_id;
    assert_eq!(s.find("thin").unwrap().parent, Some(snap));
    assert_eq!(s.find("clone").unwrap().parent, Some(snap));
    assert!(s.find("snap").unwrap().read_only);
    assert!(s.find("ro").unwrap().read_only);
    assert!(!s.find("thick").unwrap().read_only);
    for (name, size, parts) in expected() {
        let v = s.find(name).unwrap();
        assert_eq!(v.size_bytes(s.sb.cluster_size), size, "{name}");
        let mut got = vec![0u8; size as usize];
        s.read_at(v, 0, &mut got).unwrap();
        assert!(got == content(size, &parts), "data of {name}");
    }
    // Reads past the end are refused.
    let v = s.find("ro").unwrap();
    assert!(s.read_at(v, 2 * MIB - 4096, &mut [0u8; 8192]).is_err());
}

#[test]
fn imports_into_a_katablk_store() {
    let src = SpdkLvstore::open(device(&image())).unwrap();
    let dst: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new(64 * MIB / 512, 512).unwrap());
    let (lvs, report) = LvStore::import_spdk(&src, dst.clone()).unwrap();
    assert_eq!(report.lvols.len(), 5);
    assert_eq!(report.clusters_copied, 10);
    let check = |lvs: &LvStore| {
        let info = lvs.info();
        assert_eq!(info.name, "lvs_spdk");
        assert_eq!(info.uuid, src.uuid);
        assert_eq!(info.cluster_size, 1 << 20);
        for (name, size, parts) in expected() {
            let i = lvs.lvol_info(name).unwrap();
            let s = src.find(name).unwrap();
            assert_eq!(i.uuid, s.uuid, "{name}");
            assert_eq!(i.size_bytes, size, "{name}");
            assert_eq!(i.thin, s.thin, "{name}");
            assert_eq!(i.num_allocated_clusters, s.allocated(), "{name}");
            assert_eq!(i.snapshot, name == "snap", "{name}");
            assert_eq!(i.clone, name == "thin" || name == "clone", "{name}");
            let v = lvs.lvol(name).unwrap();
            let mut got = vec![0u8; size as usize];
            SyncIo::new(&*v).unwrap().read_at(0, &mut got).unwrap();
            assert!(got == content(size, &parts), "data of {name}");
        }
        let allocated: u64 = lvs.list().iter().map(|l| l.num_allocated_clusters).sum();
        assert_eq!(allocated + info.free_clusters, info.total_data_clusters);
    };
    check(&lvs);
    // Read-only volumes stay read-only; the clone is writable and copies on write.
    let ro = lvs.lvol("ro").unwrap();
    assert!(SyncIo::new(&*ro)
        .unwrap()
        .write_at(0, &[1u8; 4096])
        .is_err());
    let clone = lvs.lvol("clone").unwrap();
    SyncIo::new(&*clone)
        .unwrap()
        .write_at(MIB, &[9u8; 4096])
        .unwrap();
    drop((ro, clone));
    drop(lvs);
    let lvs = LvStore::open(dst).unwrap();
    let clone = lvs.lvol("clone").unwrap();
    let mut b = vec![0u8; 4096];
    SyncIo::new(&*clone).unwrap().read_at(MIB, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 9));
    let mut b = vec![0u8; 4096];
    SyncIo::new(&*clone).unwrap().read_at(0, &mut b).unwrap();
    assert!(b == pattern("B", 0, 4096));
    drop(clone);
    // The snapshot's data is untouched by the clone's write.
    let snap = lvs.lvol("snap").unwrap();
    let mut b = vec![0u8; 4096];
    SyncIo::new(&*snap).unwrap().read_at(MIB, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0));
}

#[test]
fn too_small_a_destination_is_refused_cleanly() {
    let src = SpdkLvstore::open(device(&image())).unwrap();
    let dst: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new(8 * MIB / 512, 512).unwrap());
    match LvStore::import_spdk(&src, dst) {
        Err(LvolError::NoSpace { .. }) => {}
        other => panic!("expected NoSpace, got {:?}", other.map(|(_, r)| r)),
    }
}

#[test]
fn katablk_open_names_the_spdk_store() {
    let e = LvStore::open(device(&image())).unwrap_err().to_string();
    assert!(e.contains("SPDK"), "{e}");
}

#[test]
fn damaged_spdk_stores_give_clear_errors() {
    let img = image();
    // Super block checksum.
    let mut bad = img.clone();
    bad[100] ^= 1;
    let e = SpdkLvstore::open(device(&bad)).unwrap_err();
    assert!(matches!(e, LvolError::CorruptSuperblock(_)), "{e}");
    // Truncated device.
    let e = SpdkLvstore::open(device(&img[..16 << 20])).unwrap_err();
    assert!(matches!(e, LvolError::DeviceTooSmall { .. }), "{e}");
    // Not SPDK at all.
    let e = SpdkLvstore::open(device(&vec![0u8; 1 << 20])).unwrap_err();
    assert!(matches!(e, LvolError::NotSpdkLvstore(_)), "{e}");
    // A metadata page of the super blob with a bad checksum: the store's name is lost.
    let md_start = u32::from_le_bytes(img[48..52].try_into().unwrap()) as usize;
    let super_blob = u64::from_le_bytes(img[20..28].try_into().unwrap());
    let page = (md_start + (super_blob & 0xffff_ffff) as usize) * 4096;
    let mut bad = img.clone();
    bad[page + 40] ^= 0xff;
    let e = SpdkLvstore::open(device(&bad)).unwrap_err();
    assert!(e.to_string().contains("super blob"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Random damage to the super block and metadata region never panics the reader, and
    /// whatever it accepts reads back without panicking either.
    #[test]
    fn random_metadata_damage_never_panics(
        flips in prop::collection::vec((0usize..(80 * 4096), any::<u8>()), 1..16)
    ) {
        let mut img = image();
        for (off, x) in flips {
            img[off] ^= x | 1;
        }
        if let Ok(s) = SpdkLvstore::open(device(&img)) {
            for l in s.lvols.values() {
                let mut b = vec![0u8; 4096.min(l.size_bytes(s.sb.cluster_size) as usize)];
                let _ = s.read_at(l, 0, &mut b);
            }
        }
    }
}

/// A katablk store with every kind of volume, and its expected content.
fn katablk_store(dev: Arc<dyn BlockDevice>) -> (LvStore, Vec<(&'static str, Vec<u8>)>) {
    let mut o = katablk_lvol::LvsOptions::new("lvs_kbl");
    o.cluster_size = MIB as u32;
    let lvs = LvStore::create(dev, o).unwrap();
    let w = |name: &str, off: u64, data: &[u8]| {
        let v = lvs.lvol(name).unwrap();
        SyncIo::new(&*v).unwrap().write_at(off, data).unwrap();
    };
    lvs.create_lvol("thick", 3 * MIB, false).unwrap();
    w("thick", 0, &pattern("a", 0, 2 * MIB));
    lvs.create_lvol("thin", 6 * MIB, true).unwrap();
    w("thin", MIB, &pattern("b", MIB, 64 * 1024));
    w("thin", 4 * MIB, &pattern("b", 4 * MIB, MIB));
    lvs.snapshot("thin", "snap").unwrap();
    w("thin", MIB, &pattern("c", MIB, 4096));
    lvs.clone_lvol("snap", "clone").unwrap();
    w("clone", 5 * MIB, &pattern("d", 5 * MIB, 8192));
    lvs.create_lvol("ro", MIB, false).unwrap();
    w("ro", 0, &pattern("e", 0, MIB));
    lvs.set_read_only("ro").unwrap();
    let mut snap = vec![0u8; 6 * MIB as usize];
    snap[MIB as usize..(MIB + 65536) as usize].copy_from_slice(&pattern("b", MIB, 65536));
    snap[4 * MIB as usize..5 * MIB as usize].copy_from_slice(&pattern("b", 4 * MIB, MIB));
    let mut thin = snap.clone();
    thin[MIB as usize..(MIB + 4096) as usize].copy_from_slice(&pattern("c", MIB, 4096));
    let mut clone = snap.clone();
    clone[5 * MIB as usize..(5 * MIB + 8192) as usize].copy_from_slice(&pattern(
        "d",
        5 * MIB,
        8192,
    ));
    let mut thick = vec![0u8; 3 * MIB as usize];
    thick[..2 * MIB as usize].copy_from_slice(&pattern("a", 0, 2 * MIB));
    let want = vec![
        ("thick", thick),
        ("thin", thin),
        ("snap", snap),
        ("clone", clone),
        ("ro", pattern("e", 0, MIB)),
    ];
    (lvs, want)
}

#[test]
fn exports_as_an_spdk_lvstore_and_back() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new(64 * MIB / 512, 512).unwrap());
    let (lvs, want) = katablk_store(dev);
    let out: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new(32 * MIB / 512, 512).unwrap());
    let r = lvs.export_spdk(out.clone()).unwrap();
    assert_eq!(r.lvols.len(), 5);
    let s = SpdkLvstore::open(out).unwrap();
    assert!(s.sb.clean);
    assert_eq!(s.name, "lvs_kbl");
    assert_eq!(s.uuid, lvs.info().uuid);
    for (name, data) in &want {
        let k = lvs.lvol_info(name).unwrap();
        let v = s.find(name).unwrap();
        assert_eq!(v.uuid, k.uuid, "{name}");
        assert_eq!(v.thin, k.thin, "{name}");
        assert_eq!(v.read_only, k.read_only, "{name}");
        assert_eq!(v.allocated(), k.num_allocated_clusters, "{name}");
        assert_eq!(s.has_clones(v.blob_id), k.snapshot, "{name}");
        assert_eq!(v.parent.is_some(), k.clone, "{name}");
        let mut got = vec![0u8; data.len()];
        s.read_at(v, 0, &mut got).unwrap();
        assert!(&got == data, "data of {name}");
    }
    // And in again.
    let back: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new(64 * MIB / 512, 512).unwrap());
    let (lvs2, _) = LvStore::import_spdk(&s, back).unwrap();
    for (name, data) in &want {
        let v = lvs2.lvol(name).unwrap();
        let mut got = vec![0u8; data.len()];
        SyncIo::new(&*v).unwrap().read_at(0, &mut got).unwrap();
        assert!(&got == data, "data of {name} after the round trip");
    }
    // Too small a destination is refused before anything is written.
    let tiny: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new(4 * MIB / 512, 512).unwrap());
    assert!(matches!(
        lvs.export_spdk(tiny),
        Err(LvolError::NoSpace { .. })
    ));
}

/// With a real SPDK (`SPDK_DIR` set to an SPDK build): SPDK's lvol module examines the
/// exported store, reports the volumes as katablk has them, and spdk_dd reads their data.
#[test]
fn spdk_opens_the_exported_store() {
    let Ok(spdk) = std::env::var("SPDK_DIR") else {
        eprintln!("SKIPPED: needs SPDK: set SPDK_DIR to an SPDK build (build/bin/vhost, spdk_dd)");
        return;
    };
    let dev: Arc<dyn BlockDevice> = Arc::new(MallocDevice::new(64 * MIB / 512, 512).unwrap());
    let (lvs, want) = katablk_store(dev);
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("exported.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let out: Arc<dyn BlockDevice> = Arc::new(
        katablk_bdev::file::FileDevice::open(&img, &katablk_bdev::file::FileOptions::default())
            .unwrap(),
    );
    lvs.export_spdk(out).unwrap();
    let sock = dir.path().join("spdk.sock");
    let mut tgt = std::process::Command::new(format!("{spdk}/build/bin/vhost"))
        .args(["--no-huge", "-s", "512", "-m", "0x1", "-S"])
        .arg(dir.path())
        .arg("-r")
        .arg(&sock)
        .stdout(std::fs::File::create(dir.path().join("vhost.log")).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let rpc = |args: &[&str]| -> String {
        let o = std::process::Command::new("python3")
            .env("PYTHONPATH", format!("{spdk}/python"))
            .arg(format!("{spdk}/scripts/rpc.py"))
            .arg("-s")
            .arg(&sock)
            .args(args)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "rpc {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    for _ in 0..100 {
        if sock.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    rpc(&["framework_wait_init"]);
    rpc(&["bdev_aio_create", img.to_str().unwrap(), "aio0", "512"]);
    rpc(&["bdev_wait_for_examine"]);
    let lvols: serde_json::Value = serde_json::from_str(&rpc(&["bdev_lvol_get_lvols"])).unwrap();
    let stores: serde_json::Value =
        serde_json::from_str(&rpc(&["bdev_lvol_get_lvstores"])).unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-INT", &tgt.id().to_string()])
        .status();
    let _ = tgt.wait();
    assert_eq!(stores[0]["name"], "lvs_kbl");
    assert_eq!(stores[0]["uuid"], lvs.info().uuid.to_string());
    assert_eq!(lvols.as_array().unwrap().len(), 5, "{lvols}");
    for l in lvols.as_array().unwrap() {
        let name = l["name"].as_str().unwrap();
        let k = lvs.lvol_info(name).unwrap();
        assert_eq!(l["uuid"], k.uuid.to_string(), "{name}");
        assert_eq!(l["is_thin_provisioned"], k.thin, "{name}");
        assert_eq!(l["is_snapshot"], k.snapshot, "{name}");
        assert_eq!(l["is_clone"], k.clone, "{name}");
        assert_eq!(
            l["num_allocated_clusters"], k.num_allocated_clusters,
            "{name}"
        );
    }
    // The data, read by SPDK.
    let cfg = dir.path().join("dd.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"subsystems": [{{"subsystem": "bdev", "config": [
  {{"method": "bdev_aio_create", "params": {{"name": "aio0", "filename": "{}", "block_size": 512}}}},
  {{"method": "bdev_wait_for_examine"}}]}}]}}"#,
            img.display()
        ),
    )
    .unwrap();
    for (name, data) in &want {
        let of = dir.path().join(format!("{name}.out"));
        let st = std::process::Command::new(format!("{spdk}/build/bin/spdk_dd"))
            .args(["--no-huge", "-s", "512", "--json"])
            .arg(&cfg)
            .arg("--ib")
            .arg(format!("lvs_kbl/{name}"))
            .arg("--of")
            .arg(&of)
            .args(["--bs", "4096"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(st.success(), "spdk_dd of {name}");
        let got = std::fs::read(&of).unwrap();
        assert!(&got == data, "data of {name} as SPDK reads it");
    }
}
